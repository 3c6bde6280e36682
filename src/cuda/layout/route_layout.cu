// Route + layout in ONE launch for small T (DESIGN.md sections 2 and 3; issue: "at small T the
// fused call should be a single launch"). Each block of the one-block layout's grid:
//   1. waits (PDL), fills its slices of the rows and tiles with the "not a real row / tile"
//      values (fill_block_slices), which overlaps the logits' load latency;
//   2. routes every row, warp w the rows w * R .. w * R + R - 1 (R = the shape's rows per warp),
//      with route_warp and the routing kernel's specialisations (route_spec.cuh); block 0 alone
//      writes topk_ids / topk_weights; every block keeps the picks in shared memory;
//   3. runs the one-block layout (one_launch_layout_kernel.cuh) on those picks.
// The routing is repeated by every block (the grid has one block per ~1024 output rows and each
// block writes only its slices, as in the one-block layout): no block waits for another, and the
// picks never go through global memory. Two launches (the routing kernel, then the layout
// kernel, chained by programmatic dependent launch) serve every other call (layout.cu).
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/common/launch.cuh"
#include "cuda/layout/one_launch_layout_kernel.cuh"
#include "cuda/layout/route_layout.h"
#include "cuda/routing/route_spec.cuh"
#include "cuda/routing/route_warp.cuh"

namespace switchyard::cuda::layout_detail {

namespace {

using routing::RouteParams;
using routing::Spec;
using routing::SpecGeneric;
using routing::SpecTraits;

constexpr int bit_width_of(int v) { return v == 0 ? 0 : 1 + bit_width_of(v >> 1); }

// Compile-time key-bit bound of a shape: local keys are 0..L with L <= E <= Shape::kMaxExperts.
template <class Shape>
constexpr int kShapeKeyBits = key_bits_bound(bit_width_of(Shape::kMaxExperts));

// Rows one block routes: one per warp on whole-warp shapes, 32 / W per warp on narrow ones.
template <class Shape>
constexpr int kMaxFusedRows = kOneWarps * Shape::kRowsPerWarp;

// The picks fit one group of 32 per warp (the layout's ITEMS = 1).
constexpr int kMaxFusedPicks = kOneThreads;

// Dynamic shared memory: the one-block layout's arrays, then the N picks (int32), then each
// warp's routing scratch (group limits that need one).
std::size_t ids_offset(const LayoutParams& p) { return one_launch_smem_bytes(p.num_local, false); }
std::size_t route_smem_offset(const LayoutParams& p) {
  return (ids_offset(p) + static_cast<std::size_t>(p.num_picks) * 4 + 15) / 16 * 16;
}

template <class Shape, class SpecT>
__global__ void __launch_bounds__(kOneThreads, 1)
    route_layout_kernel(const RouteParams route0, const LayoutParams p, unsigned ids_offset_bytes,
                        unsigned route_smem_offset_bytes) {
  __shared__ OneShared sh;
  extern __shared__ __align__(16) int fused_dyn[];
  pdl_wait();  // before any global access (launch.cuh PDL contract)
  pdl_launch_dependents();
  fill_block_slices(p, static_cast<int>(blockIdx.x));

  RouteParams rp = route0;
  SpecTraits<SpecT>::apply(rp);
  if (blockIdx.x != 0) {  // every block routes; block 0 writes routing's outputs
    rp.topk_ids = nullptr;
    rp.topk_weights = nullptr;
  }
  unsigned char* smem = reinterpret_cast<unsigned char*>(fused_dyn);
  int* ids = reinterpret_cast<int*>(smem + ids_offset_bytes);
  const int warp = static_cast<int>(threadIdx.x >> 5);
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const int first_row = warp * Shape::kRowsPerWarp;
  if (first_row < p.num_tokens) {  // warp-uniform
    const std::size_t per_warp = routing::route_smem_bytes_per_warp<Shape>(rp);
    unsigned char* warp_smem = per_warp == 0 ? nullptr : smem + route_smem_offset_bytes + warp * per_warp;
    routing::RoutedPicks<Shape> picks;
    routing::route_warp<Shape, SpecTraits<SpecT>::kEarlyBias>(rp, first_row, warp_smem, &picks);
    const int row = first_row + lane / Shape::W;
    if (row < p.num_tokens) {
#pragma unroll
      for (int s = 0; s < Shape::kSlots; ++s) {
        const int k = s * Shape::W + lane % Shape::W;
        if (k < p.top_k) ids[row * p.top_k + k] = picks.expert[s];
      }
    }
  }
  __syncthreads();  // every pick is in shared memory
  one_launch_layout<1, 0, kShapeKeyBits<Shape>, int, /*kFused=*/true>(p, sh, fused_dyn, ids);
}

template <class Shape, class SpecT>
Status launch_fused(const RouteParams& rp, const LayoutParams& p, long long blocks, std::size_t smem,
                    cudaStream_t stream) {
  constexpr auto kKernel = route_layout_kernel<Shape, SpecT>;
  const char* name = "route_and_layout: route_layout_kernel";
  const cudaError_t err = allow_dynamic_smem<kKernel>(smem);
  if (err != cudaSuccess) return cuda_status(name, err);
  return launch_kernel(name, kKernel, dim3(static_cast<unsigned>(blocks)), dim3(kOneThreads), smem, stream,
                       /*pdl=*/true, rp, p, static_cast<unsigned>(ids_offset(p)),
                       static_cast<unsigned>(route_smem_offset(p)));
}

// The routing kernel's specialisations (routing.cu) that can occur here: T <= kMaxFusedRows <=
// kEarlyBiasMaxTokens, so the bias specs are the early-bias ones.
template <class Shape, DType kDtype>
Status launch_fused_dtype(const RouteParams& rp, const LayoutParams& p, long long blocks, std::size_t smem,
                          cudaStream_t stream) {
  return routing::dispatch_spec<Spec<kDtype, PreFn::kSoftmax, false, false, PostFn::kNormalize>,
                                Spec<kDtype, PreFn::kNone, false, false, PostFn::kSoftmax>,
                                Spec<kDtype, PreFn::kSigmoid, true, false, PostFn::kNormalize, true>,
                                Spec<kDtype, PreFn::kSigmoid, true, true, PostFn::kNormalize, true>, SpecGeneric>(
      rp, [&](auto spec) { return launch_fused<Shape, decltype(spec)>(rp, p, blocks, smem, stream); });
}

template <class Shape>
Status launch_fused_shape(const RouteParams& rp, const LayoutParams& p, long long blocks, cudaStream_t stream,
                          bool* launched) {
  const std::size_t smem =
      route_smem_offset(p) + routing::route_smem_bytes_per_warp<Shape>(rp) * static_cast<std::size_t>(kOneWarps);
  if (p.num_tokens > kMaxFusedRows<Shape> || p.key_bits > kShapeKeyBits<Shape> || smem > kOneMaxSmem) {
    return Status::Ok();
  }
  *launched = true;
  if constexpr (Shape::W == 32 && Shape::S <= 4) {
    static_assert(kMaxFusedRows<Shape> <= routing::kEarlyBiasMaxTokens, "see launch_fused_dtype");
    if (rp.logits_dtype == static_cast<int>(DType::kFloat32))
      return launch_fused_dtype<Shape, DType::kFloat32>(rp, p, blocks, smem, stream);
    if (rp.logits_dtype == static_cast<int>(DType::kBFloat16))
      return launch_fused_dtype<Shape, DType::kBFloat16>(rp, p, blocks, smem, stream);
  }
  return launch_fused<Shape, SpecGeneric>(rp, p, blocks, smem, stream);
}

}  // namespace

Status route_and_layout_one_launch(const detail::RouteArgs& route_args, const LayoutParams& p, long long blocks,
                                   cudaStream_t stream, bool* launched) {
  *launched = false;
  if (p.num_tokens < 1 || p.num_picks > kMaxFusedPicks || route_args.config.top_k > kMaxGpuTopK) {
    return Status::Ok();
  }
  const RouteParams rp = routing::make_route_params(route_args);
  const int index = routing::route_shape_index(route_args.config.num_experts, route_args.num_tokens);
  if (index < 0) return Status::Ok();
  return routing::dispatch_route_shape(route_args.config.num_experts, route_args.num_tokens, [&](auto shape) {
    return launch_fused_shape<decltype(shape)>(rp, p, blocks, stream, launched);
  });
}

}  // namespace switchyard::cuda::layout_detail
