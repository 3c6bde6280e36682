// Launch helpers shared by the CUDA backend's operations.
//
//   * pdl_wait() / pdl_launch_dependents(): the two device-side controls of programmatic
//     dependent launch (PDL, sm_90+).
//   * launch_kernel(): cudaLaunchKernelEx with PDL allowed, returning a Status that names the
//     kernel and carries cudaGetErrorString on failure; launch_kernel_clustered() adds a
//     thread-block cluster dimension (launch_attributes() builds both attributes).
//   * allow_dynamic_smem<kernel>(bytes) / set_attribute_at_least<kernel, attribute>(value):
//     per-device, cached opt-ins for kernel attributes (past 48 KB of dynamic shared memory).
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
#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>

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

// Status for a failed CUDA runtime call: "<what>: cudaErrorInvalidValue (invalid argument)".
inline Status cuda_status(const char* what, cudaError_t err) {
  if (err == cudaSuccess) return Status::Ok();
  return Status::CudaError(std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) +
                           ")");
}

// Launches kernel<<<grid, block, smem_bytes, stream>>>(args...) through cudaLaunchKernelEx;
// with `pdl`, programmatic stream serialization is allowed (see the contract above). `name`
// prefixes the error message. No host synchronization; capturable in a CUDA graph.
// The launch attributes of launch_kernel: programmatic stream serialization (PDL) when `pdl`,
// and a thread-block cluster of `cluster_x` blocks along x when cluster_x > 0. Writes them to
// `out` and returns how many there are.
inline unsigned launch_attributes(bool pdl, unsigned cluster_x, cudaLaunchAttribute (&out)[2]) {
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
  return n;
}

// launch_kernel with the blocks grouped in clusters of `cluster_x` along x (0: no clusters).
template <typename... KernelArgs, typename... Args>
Status launch_kernel_clustered(const char* name, void (*kernel)(KernelArgs...), dim3 grid, dim3 block,
                               std::size_t smem_bytes, cudaStream_t stream, bool pdl, unsigned cluster_x,
                               Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute[2];
  config.attrs = attribute;
  config.numAttrs = launch_attributes(pdl, cluster_x, attribute);
  return cuda_status(name, cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

template <typename... KernelArgs, typename... Args>
Status launch_kernel(const char* name, void (*kernel)(KernelArgs...), dim3 grid, dim3 block,
                     std::size_t smem_bytes, cudaStream_t stream, bool pdl, Args&&... args) {
  return launch_kernel_clustered(name, kernel, grid, block, smem_bytes, stream, pdl, 0u,
                                 std::forward<Args>(args)...);
}

// Kernels whose static + dynamic shared memory may pass the 48 KB default need an opt-in per
// device; below this many dynamic bytes every kernel of this backend stays under it (their static
// shared memory is <= 36 KB).
constexpr std::size_t kDynamicSmemWithoutOptIn = 8 * 1024;
constexpr int kMaxDevicesCached = 64;

// Sets a kernel attribute whose larger values include the smaller ones (a shared-memory size, a
// 0/1 permission) to at least `value` on the current device, remembering per device the largest
// value set so far (a host-side cache: the attribute call does not repeat on every launch).
// kKernel is a template argument so that each kernel has its own cache (every layout kernel has
// the same signature, so a cache keyed by signature would be shared).
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

template <auto kKernel>
cudaError_t allow_dynamic_smem(std::size_t bytes) {
  if (bytes <= kDynamicSmemWithoutOptIn) return cudaSuccess;
  return set_attribute_at_least<kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize>(
      static_cast<int>(bytes));
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
