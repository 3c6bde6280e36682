// route_and_layout in ONE kernel for small T (DESIGN.md sections 2 and 3).
//
// Every block routes all T rows with the routing backend's per-row warp routine
// (cuda/routing/route_warp.cuh: warps take rows, the picks come back in registers), keeps the ids
// in shared memory, and then runs the lean layout (lean_layout_kernel.cuh: lean_layout_block) on
// them. As in the lean layout kernel, the blocks repeat the cheap part (routing T <= 64 rows,
// at most 2 route_warp calls per warp; counting <= 2048 picks) so that the expensive part - writing
// the outputs, mostly padding rows - is split over many SMs without any inter-block
// synchronisation. Row group r's topk_ids and topk_weights are written by block r % gridDim.x only.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/numeric.h"
#include "cuda/common/launch.cuh"
#include "cuda/layout/layout_kernels.cuh"
#include "cuda/layout/lean_layout_kernel.cuh"
#include "cuda/routing/route_warp.cuh"

namespace switchyard::cuda::layout_detail {

// Largest shapes the fused kernel takes; larger ones run route() then layout().
constexpr int kFusedMaxTokens = 64;
constexpr int kFusedMaxPicks = 2048;
constexpr int kFusedThreads = kLeanThreads;  // 16 warps route rows in parallel
constexpr int kFusedItems = 4;               // 512 * 4 = kFusedMaxPicks picks counted per block
static_assert(kFusedThreads * kFusedItems >= kFusedMaxPicks, "fused kernel must hold every pick");

struct FusedParams {
  routing::RouteParams route;           // with topk_ids / topk_weights null: this kernel writes them
  void* topk_ids = nullptr;             // [T,K] int32 or int64 (route.ids_int64)
  void* topk_weights = nullptr;         // [T,K] fp32 or bf16 (route.weights_bf16)
  std::size_t route_smem_per_warp = 0;  // multiple of 16
  LayoutParams layout;
};

// Dynamic shared memory of the fused kernel: per-warp routing scratch, the routed ids, the
// layout's per-expert arrays.
struct FusedSmem {
  std::size_t route_bytes, ids_bytes, expert_bytes;
  __host__ __device__ std::size_t total() const { return route_bytes + ids_bytes + expert_bytes; }
};
__host__ __device__ inline FusedSmem fused_smem(std::size_t route_smem_per_warp, int num_picks,
                                                int num_local) {
  FusedSmem s;
  s.route_bytes = route_smem_per_warp * (kFusedThreads / 32);
  s.ids_bytes = (static_cast<std::size_t>(num_picks) * 4 + 15) / 16 * 16;
  s.expert_bytes = lean_smem_bytes(num_local);
  return s;
}

template <class Shape>
__global__ void __launch_bounds__(kFusedThreads, 1) route_layout_kernel(const FusedParams fp) {
  __shared__ LeanShared sh;
  extern __shared__ __align__(16) unsigned char fused_smem_raw[];
  pdl_launch_dependents();  // the next kernel may be scheduled now; it waits for all of us
  pdl_wait();

  const FusedSmem sizes = fused_smem(fp.route_smem_per_warp, fp.layout.num_picks, fp.layout.num_local);
  int* ids = reinterpret_cast<int*>(fused_smem_raw + sizes.route_bytes);
  int* expert_arrays = reinterpret_cast<int*>(fused_smem_raw + sizes.route_bytes + sizes.ids_bytes);
  const int warp = static_cast<int>(threadIdx.x >> 5);
  const int lane = static_cast<int>(threadIdx.x & 31u);
  unsigned char* warp_smem = fp.route_smem_per_warp == 0
                                 ? nullptr
                                 : fused_smem_raw + static_cast<std::size_t>(warp) * fp.route_smem_per_warp;
  const int T = fp.layout.num_tokens;
  const int K = fp.layout.top_k;
  const int groups = (T + Shape::kRowsPerWarp - 1) / Shape::kRowsPerWarp;
  const bool ids64 = fp.route.ids_int64 != 0;
  const bool bf16 = fp.route.weights_bf16 != 0;

  // 1. Route. The loop condition is warp-uniform, as route_warp needs a converged warp.
  for (int group = warp; group < groups; group += kFusedThreads / 32) {
    routing::RoutedPicks<Shape> picks;
    routing::route_warp<Shape>(fp.route, static_cast<std::int64_t>(group) * Shape::kRowsPerWarp, warp_smem,
                               &picks);
    const int row = group * Shape::kRowsPerWarp + lane / Shape::W;
    const bool writer = group % static_cast<int>(gridDim.x) == static_cast<int>(blockIdx.x);
    if (row < T) {
#pragma unroll
      for (int s = 0; s < Shape::kSlots; ++s) {
        const int k = s * Shape::W + lane % Shape::W;
        if (k >= K) continue;
        const int x = row * K + k;
        ids[x] = picks.expert[s];
        if (writer) {
          if (ids64) {
            static_cast<std::int64_t*>(fp.topk_ids)[x] = picks.expert[s];
          } else {
            static_cast<std::int32_t*>(fp.topk_ids)[x] = picks.expert[s];
          }
          if (bf16) {
            static_cast<std::uint16_t*>(fp.topk_weights)[x] = detail::float_to_bf16(picks.weight[s]);
          } else {
            static_cast<float*>(fp.topk_weights)[x] = picks.weight[s];
          }
        }
      }
    }
  }
  __syncthreads();  // every routed id is in shared memory

  // 2. Layout of the routed ids.
  lean_layout_block<kFusedItems>(fp.layout, SharedIdSource{ids}, sh, expert_arrays);
}

}  // namespace switchyard::cuda::layout_detail
