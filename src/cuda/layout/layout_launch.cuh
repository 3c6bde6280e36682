// Host-side helpers shared by the layout launchers (layout.cu) and the fused route + layout
// launcher (route_layout.cu): kernel attributes set once per device, the 16-block cluster probe,
// the kernel parameters from validated arguments and the SWITCHYARD_LAYOUT_PATH knob.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>

#include "common/op_args.h"
#include "cuda/common/launch.cuh"
#include "cuda/layout/layout_kernels.cuh"
#include "cuda/layout/one_launch_layout_kernel.cuh"

namespace switchyard::cuda::layout_detail {

inline int bit_width(unsigned v) {
  int bits = 0;
  while (v != 0) {
    ++bits;
    v >>= 1;
  }
  return bits;
}

inline LayoutParams make_params(const detail::LayoutArgs& a) {
  LayoutParams p;
  p.num_tokens = static_cast<int>(a.num_tokens);
  p.top_k = a.top_k;
  p.num_picks = static_cast<int>(a.num_tokens * a.top_k);
  p.num_experts = a.num_experts;
  p.num_local = a.num_local;
  p.tile_size = a.tile_size;
  p.key_bits = std::max(1, bit_width(static_cast<unsigned>(a.num_local)));  // keys 0..L
  p.local_start = a.local_start;
  p.local_stride = a.local_stride;
  p.expert_map = a.expert_map;
  p.capacity_rows = static_cast<int>(a.capacity_rows);
  p.capacity_tiles = static_cast<int>(a.capacity_tiles);
  p.topk_ids = a.topk_ids;
  p.counts = a.counts;
  p.offsets = a.offsets;
  p.permuted_to_expanded = a.permuted_to_expanded;
  p.permuted_to_token = a.permuted_to_token;
  p.expanded_to_permuted = a.expanded_to_permuted;
  p.tile_expert = a.tile_expert;
  p.tile_row_end = a.tile_row_end;
  p.totals = a.totals;
  return p;
}

// Kernels whose static + dynamic shared memory may pass the 48 KB default need an opt-in per
// device; below this many dynamic bytes every layout kernel stays under it (static <= 36 KB).
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

// Clusters past the portable 8 blocks (16 on H100 / H200).
template <auto kKernel>
cudaError_t allow_nonportable_clusters() {
  return set_attribute_at_least<kKernel, cudaFuncAttributeNonPortableClusterSizeAllowed>(1);
}

// Whether this device can run one 16-block cluster of kKernel (kOneThreads threads per block)
// with this much shared memory (asked once per device and shared-memory class; a cluster needs
// 16 free SMs of one GPC). Any error reads as "no".
template <auto kKernel>
bool cluster16_schedulable(std::size_t smem) {
  static std::atomic<int> cache[kMaxDevicesCached][2];  // 0 unknown, 1 yes, 2 no; [small, large smem]
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevicesCached) return false;
  const int cls = smem > 64 * 1024 ? 1 : 0;
  const int known = cache[device][cls].load(std::memory_order_relaxed);
  if (known != 0) return known == 1;
  const std::size_t probe = cls ? layout_detail::kOneMaxSmem : 64 * 1024;
  cudaError_t err = allow_dynamic_smem<kKernel>(probe);
  if (err == cudaSuccess) err = allow_nonportable_clusters<kKernel>();
  int clusters = 0;
  if (err == cudaSuccess) {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(16);
    config.blockDim = dim3(layout_detail::kOneThreads);
    config.dynamicSmemBytes = probe;
    cudaLaunchAttribute attribute[2];
    config.attrs = attribute;
    config.numAttrs = launch_attributes(/*pdl=*/false, 16, attribute);
    err = cudaOccupancyMaxActiveClusters(&clusters, kKernel, &config);
  }
  if (err != cudaSuccess) (void)cudaGetLastError();  // a refused probe leaves no error behind
  const bool ok = err == cudaSuccess && clusters > 0;
  cache[device][cls].store(ok ? 1 : 2, std::memory_order_relaxed);
  return ok;
}

// SWITCHYARD_LAYOUT_PATH=tiny|one_block|cluster8|cluster16|chunked (environment, read per call) forces
// a layout path where it fits the call; route_and_layout then runs route() and layout() as two
// launches. A tuning and testing knob, not needed for correct results.
enum class ForcedPath { kNone, kTiny, kOneBlock, kCluster8, kCluster16, kChunked };

inline ForcedPath forced_path() {
  const char* v = std::getenv("SWITCHYARD_LAYOUT_PATH");
  if (v == nullptr) return ForcedPath::kNone;
  const std::string s(v);
  if (s == "tiny") return ForcedPath::kTiny;
  if (s == "one_block") return ForcedPath::kOneBlock;
  if (s == "cluster8") return ForcedPath::kCluster8;
  if (s == "cluster16") return ForcedPath::kCluster16;
  if (s == "chunked") return ForcedPath::kChunked;
  return ForcedPath::kNone;
}

}  // namespace switchyard::cuda::layout_detail
