// route_and_layout in one launch for a few tokens (DESIGN.md sections 2 and 3): every block of the
// one-block layout's grid routes all T rows itself (a warp per row, route_warp with a routing
// kernel's specialisation), keeps the picks in shared memory and runs the one-block layout
// (one_launch_layout_kernel.cuh) on them. Block 0 alone writes topk_ids / topk_weights; each block
// writes its own slices of the layout, as in the one-block layout kernel. Nothing goes through
// global memory between the two halves, and the second kernel's wait for the first (a grid's
// completion, then its memory) is gone.
//
// While the T routing warps work, the other warps of the block fill its slices of the rows and
// tiles with the "not a real row / tile" values (the one-block form's first writes), so that
// filling stays off the critical path (session 6's fused kernel filled before routing; that cost
// ~800 cycles at T = 1 and made the fused kernel no faster than the two launches).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/common/launch.cuh"
#include "cuda/layout/one_launch_layout_kernel.cuh"
#include "cuda/routing/route_spec.cuh"
#include "cuda/routing/route_warp.cuh"

namespace switchyard::cuda::layout_detail {

// Rows routed by one block of the fused kernel: one warp each.
constexpr int kFusedMaxTokens = kOneWarps;
// Picks of the fused kernel: one group of 32 per warp of the layout (its ITEMS = 1 form).
constexpr int kFusedMaxPicks = kOneThreads;

// Dynamic shared memory of route_layout_small_kernel: the one-block layout's, then `warps` routing
// warps' (route_smem_bytes_per_warp each, 16-byte aligned).
inline std::size_t fused_smem_bytes(int num_local, std::size_t route_bytes_per_warp, int warps) {
  const std::size_t layout_bytes = (one_launch_smem_bytes(num_local, false) + 15) / 16 * 16;
  return layout_bytes + (route_bytes_per_warp + 15) / 16 * 16 * static_cast<std::size_t>(warps);
}

// rp: the routing parameters (make_route_params, num_tokens = T <= kFusedMaxTokens, outputs set);
// lp: the layout's (one-block slices for gridDim.x blocks; topk_ids is ignored: the picks come from
// shared memory). SpecT: a route_spec::Spec that matches rp (checked by the launcher).
template <class Shape, class SpecT, int KB>
__global__ void __launch_bounds__(kOneThreads, 1)
    route_layout_small_kernel(const routing::RouteParams rp0, const LayoutParams lp0) {
  using Traits = route_spec::SpecTraits<SpecT>;
  __shared__ OneShared sh;
  __shared__ int picks[kFusedMaxPicks];  // pick x = t * K + k: its global expert id
  extern __shared__ __align__(16) int one_dyn[];
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int T = static_cast<int>(rp0.num_tokens);
  const int K = rp0.top_k;
  pdl_wait();  // before any global access (launch.cuh PDL contract)
  pdl_launch_dependents();
  if (warp < T) {
    routing::RouteParams rp = rp0;
    Traits::apply(rp);
    if (blockIdx.x != 0) {  // one block writes the routing outputs
      rp.topk_ids = nullptr;
      rp.topk_weights = nullptr;
    }
    const std::size_t per_warp =
        (routing::route_smem_bytes_per_warp<Shape, true>(rp) + 15) / 16 * 16;  // fused_smem_bytes
    const std::size_t layout_bytes = (one_launch_smem_bytes(lp0.num_local, false) + 15) / 16 * 16;
    unsigned char* warp_smem =
        per_warp == 0 ? nullptr : reinterpret_cast<unsigned char*>(one_dyn) + layout_bytes + warp * per_warp;
    routing::RoutedPicks<Shape> routed;
    routing::route_warp<Shape, Traits::kEarlyBias, true, Traits::kGroupShift>(rp, warp, warp_smem, &routed);
#pragma unroll
    for (int s = 0; s < Shape::kSlots; ++s) {
      const int k = s * 32 + lane;
      if (k < K) picks[warp * K + k] = routed.expert[s];
    }
  }
  int r0, r1, t0, t1;
  block_slices(lp0, r0, r1, t0, t1);
  if (T < kOneWarps) {
    // The idle warps fill this block's slices meanwhile (one_launch_layout's kPrefilled).
    if (warp >= T) fill_one_block_slices(lp0, r0, r1, t0, t1, tid - T * 32, kOneThreads - T * 32);
  } else {
    fill_one_block_slices(lp0, r0, r1, t0, t1, tid, kOneThreads);  // no warp was idle
  }
  __syncthreads();  // picks and fills complete
  LayoutParams lp = lp0;
  lp.topk_ids = picks;  // a generic pointer to this block's shared memory
  one_launch_layout<1, 0, KB, int, false, true>(lp, sh, one_dyn);
}

}  // namespace switchyard::cuda::layout_detail
