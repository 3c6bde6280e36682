// Launch helpers shared by the CUDA backend's operations.
//
//   * pdl_wait() / pdl_launch_dependents(): the two device-side controls of programmatic
//     dependent launch (PDL, sm_90+); warm_params() / keep_loaded(): a kernel's parameters into the
//     constant cache before pdl_wait().
//   * launch_kernel(): cudaLaunchKernelEx with PDL allowed, returning a Status that names the
//     kernel and carries cudaGetErrorString on failure; launch_kernel_with() adds a
//     thread-block cluster dimension or a cooperative launch (launch_attributes() builds the
//     attributes).
//   * set_attribute_at_least<kernel, attribute>(value): a per-device cached cudaFuncSetAttribute
//     (an opt-in to more than 48 KB of shared memory, say).
//   * dispatch_value<V...>(name, value, f): runtime int -> template constant. Calls
//     f(std::integral_constant<int, V>{}) for the matching V and returns its Status, or
//     Unsupported("<name> = 7 is not supported; supported values: 1, 2, 4") on a miss. Replaces
//     towers of SWITCH macros (STYLE.md).
//
// PDL contract for every kernel launched through launch_kernel() with pdl = true:
//   1. pdl_wait() before the kernel's first global-memory access (read or write). It returns
//      only after every prerequisite grid has completed and its writes are visible (PTX ISA,
//      griddepcontrol.wait), so a PDL launch is safe after any predecessor in the stream.
//   2. pdl_launch_dependents() as early as the kernel likes (right after pdl_wait() is fine):
//      it only lets the next PDL kernel in the stream be scheduled early, which overlaps its
//      launch latency with our work; that kernel still waits for all of ours in its pdl_wait().
// A kernel launched without the attribute runs normally; pdl_wait() is then a no-op.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>

#include "cuda/common/device_props.h"
#include "switchyard/status.h"

namespace switchyard::cuda {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Bytes [ptr, ptr + bytes) into L2 while the previous kernel runs, before pdl_wait(): one
// cp.async.bulk.prefetch.L2 (sm_90) over the 16-byte granules the range touches (they lie in the
// range's own pages). A prefetch is a hint, not a load: nothing is read into registers or L1, and
// L2 is where every SM's global writes land, so the loads after pdl_wait() still see everything the
// previous kernel wrote, even if it writes these bytes after the prefetch. That keeps it within the
// PDL contract below (no global access before the wait).
__device__ __forceinline__ void prefetch_l2(const void* ptr, unsigned long long bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const auto a = reinterpret_cast<unsigned long long>(ptr);
  const unsigned long long lo = a & ~15ull;
  const unsigned long long hi = (a + bytes + 15ull) & ~15ull;
  if (bytes != 0)
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(lo), "r"(static_cast<unsigned>(hi - lo))
                 : "memory");
#endif
}

// Parameters into the constant cache while the previous kernel runs, before pdl_wait(), so that
// the first use of each parameter line after the wait does not stall on a miss. One word of every
// 16 bytes is loaded (the parameters start 16 bytes into a 32-byte line on sm_90, c[0x0][0x210],
// so every line is touched whatever its size), and the XOR of the words must be used, or the loads
// go:
//   * warm_params(p, &sink), for one thread of each block: stored into *sink, a shared-memory
//     variable the kernel has anyway (the one-launch layout kernels' OneShared);
//   * warm_params(p, never), called by every thread: thread 0 of the first kWarmBlocks blocks
//     passes it to keep_loaded, a shared-memory store inside the asm predicated on `never`, a
//     run-time false the compiler cannot prove (num_tokens < 0: token counts are never negative).
//     Nothing is written and no shared memory is declared for it. The combine kernel uses it; the
//     routing kernels pass keep_loaded their fields by name (routing.cu, route_params_xor).
// p is the kernel's parameter, by value or __grid_constant__: it is read by memcpy, which makes no
// local copy (constant-bank loads in the SASS). kWarmBlocks = 132 blocks, about one per SM of an
// H200 (the cache is per SM; blocks placed later find it warm): warming in every block made the
// routing kernels up to 12% slower at T >= 16384 (docs/decisions/warm-params.md).
inline constexpr unsigned kWarmBlocks = 132;

template <class P>
__device__ __forceinline__ unsigned param_words_xor(const P& p) {
  static_assert(sizeof(P) % 4 == 0 && std::is_trivially_copyable_v<P>, "parameters of whole words");
  unsigned w[sizeof(P) / 4];
  memcpy(w, &p, sizeof(w));
  unsigned x = 0;
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(P) / 4); i += 4) x ^= w[i];
  return x;
}
template <class P>
__device__ __forceinline__ void warm_params(const P& p, volatile unsigned* sink) {
  *sink = param_words_xor(p);
}
__device__ __forceinline__ void keep_loaded(unsigned x, bool never) {
#if defined(__CUDA_ARCH__)
  asm volatile(
      "{\n\t.reg .pred q;\n\t.reg .u32 a;\n\tsetp.ne.u32 q, %1, 0;\n\tmov.u32 a, 0;\n\t"
      "@q st.volatile.shared.u32 [a], %0;\n\t}" ::"r"(x),
      "r"(static_cast<unsigned>(never))
      : "memory");
#endif
}
template <class P>
__device__ __forceinline__ void warm_params(const P& p, bool never) {
  if (threadIdx.x == 0 && blockIdx.x < kWarmBlocks) keep_loaded(param_words_xor(p), never);
}

// Status for a failed CUDA runtime call: "<what>: cudaErrorInvalidValue (invalid argument)".
inline Status cuda_status(const char* what, cudaError_t err) {
  if (err == cudaSuccess) return Status::Ok();
  return Status::CudaError(std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) +
                           ")");
}

// The current device's properties (`op` names the operation in an error), queried once per device
// and remembered (devices 0 .. kMaxDevicesCached - 1; others are queried on every call).
inline constexpr int kMaxDevicesCached = 64;
inline Status current_device_props(const char* op, DeviceProps* props) {
  struct Cached {
    std::atomic<bool> ready{false};
    DeviceProps props;
  };
  static Cached cache[kMaxDevicesCached];
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return cuda_status((std::string(op) + ": device query").c_str(), err);
  const bool cacheable = device >= 0 && device < kMaxDevicesCached;
  if (cacheable && cache[device].ready.load(std::memory_order_acquire)) {
    *props = cache[device].props;
    return Status::Ok();
  }
  static std::mutex fill;
  std::lock_guard<std::mutex> lock(fill);
  if (cacheable && cache[device].ready.load(std::memory_order_relaxed)) {
    *props = cache[device].props;
    return Status::Ok();
  }
  int sms = 0, smem_optin = 0, l2 = 0;
  err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device);
  if (err != cudaSuccess) return cuda_status((std::string(op) + ": device query").c_str(), err);
  props->sm_count = sms;
  props->smem_per_block_optin = static_cast<std::size_t>(smem_optin);
  props->l2_bytes = static_cast<std::size_t>(l2);
  if (cacheable) {
    cache[device].props = *props;
    cache[device].ready.store(true, std::memory_order_release);
  }
  return Status::Ok();
}

// Streaming multiprocessors of the current device (`op` names the operation in an error).
inline Status current_sm_count(const char* op, int* sms) {
  DeviceProps props;
  SY_RETURN_IF_ERROR(current_device_props(op, &props));
  *sms = props.sm_count;
  return Status::Ok();
}

// The kernel's signature as the host compiler spells it (routing's RoutePlan::name).
template <auto kKernel>
const char* kernel_name() {
  return __PRETTY_FUNCTION__;
}

// The launch attributes of launch_kernel: programmatic stream serialization (PDL) when `pdl`, a
// thread-block cluster of `cluster_x` blocks along x when cluster_x > 0, and a cooperative launch
// (all blocks resident at once, for cooperative_groups' grid barrier) when `cooperative`. Writes
// them to `out` and returns how many there are.
inline constexpr int kMaxLaunchAttributes = 3;
inline unsigned launch_attributes(bool pdl, unsigned cluster_x, bool cooperative,
                                  cudaLaunchAttribute (&out)[kMaxLaunchAttributes]) {
  unsigned n = 0;
  if (pdl) {
    out[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    out[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  if (cluster_x > 0) {
    out[n].id = cudaLaunchAttributeClusterDimension;
    out[n].val.clusterDim.x = cluster_x;
    out[n].val.clusterDim.y = 1;
    out[n].val.clusterDim.z = 1;
    ++n;
  }
  if (cooperative) {
    out[n].id = cudaLaunchAttributeCooperative;
    out[n].val.cooperative = 1;
    ++n;
  }
  return n;
}

// launch_kernel with the attributes of launch_attributes.
template <typename... KernelArgs, typename... Args>
Status launch_kernel_with(const char* name, void (*kernel)(KernelArgs...), dim3 grid, dim3 block,
                          std::size_t smem_bytes, cudaStream_t stream, bool pdl, unsigned cluster_x,
                          bool cooperative, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute[kMaxLaunchAttributes];
  config.attrs = attribute;
  config.numAttrs = launch_attributes(pdl, cluster_x, cooperative, attribute);
  return cuda_status(name, cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

// Launches kernel<<<grid, block, smem_bytes, stream>>>(args...) through cudaLaunchKernelEx;
// with `pdl`, programmatic stream serialization is allowed (see the contract above). `name`
// prefixes the error message. No host synchronization; capturable in a CUDA graph.
template <typename... KernelArgs, typename... Args>
Status launch_kernel(const char* name, void (*kernel)(KernelArgs...), dim3 grid, dim3 block,
                     std::size_t smem_bytes, cudaStream_t stream, bool pdl, Args&&... args) {
  return launch_kernel_with(name, kernel, grid, block, smem_bytes, stream, pdl, 0u, false,
                            std::forward<Args>(args)...);
}

// Sets a kernel attribute whose larger values include the smaller ones (a shared-memory size, a
// 0/1 permission) to at least `value` on the current device, remembering per device the largest
// value set so far (a host-side cache: the attribute call does not repeat on every launch).
// kKernel is a template argument so that each kernel has its own cache (kernels of one signature,
// such as every layout kernel, would share a cache keyed by signature).
template <auto kKernel, cudaFuncAttribute kAttribute>
cudaError_t set_attribute_at_least(int value) {
  static std::atomic<int> granted[kMaxDevicesCached];
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const bool cacheable = device >= 0 && device < kMaxDevicesCached;
  if (cacheable && granted[device].load(std::memory_order_relaxed) >= value) return cudaSuccess;
  err = cudaFuncSetAttribute(kKernel, kAttribute, value);
  if (err == cudaSuccess && cacheable) {
    int seen = granted[device].load(std::memory_order_relaxed);
    while (seen < value && !granted[device].compare_exchange_weak(seen, value)) {
    }
  }
  return err;
}

// Runtime value -> compile-time constant; see the file comment.
template <int... Values, typename F>
Status dispatch_value(const char* name, int value, F&& f) {
  Status result;
  const bool hit =
      ((value == Values ? (result = f(std::integral_constant<int, Values>{}), true) : false) || ...);
  if (hit) return result;
  std::string allowed;
  ((allowed += (allowed.empty() ? "" : ", ") + std::to_string(Values)), ...);
  return Status::Unsupported(std::string(name) + " = " + std::to_string(value) +
                             " is not supported; supported values: " + allowed);
}

}  // namespace switchyard::cuda
