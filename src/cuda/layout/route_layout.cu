// One-launch route + layout for decode-sized calls (DESIGN.md sections 2 and 3). Compiled with
// -fmad=false (routing arithmetic; see src/CMakeLists.txt).
//
// Each block of kOneThreads threads routes all T <= 16 rows, a warp per row (route_warp, the
// routing kernel's per-row routine, with the same compile-time specialisations: route_spec.cuh),
// keeps the expert ids in shared memory and runs the tiny layout (tiny_layout_kernel.cuh) on them.
// Blocks split the layout's writes (the rows of a call are mostly padding: up to L * (M - 1));
// every block routes the same rows (reads from L2), and block 0 alone writes topk_ids and
// topk_weights. The two launches it replaces (route, then layout chained by PDL) paid a second
// launch and the layout kernel's wait for the routing grid to finish and flush before it could
// read the ids.
//
// Shapes served: 64 < E <= 512 (the whole-warp routing shapes with up to 4 stripes), T <= 16,
// T * K <= kTinyMaxPicks (128), L < 1024. Everything else runs the two launches.
// Measured and not kept: one cluster of up to 16 blocks, each routing its own rows and running
// the cluster layout of one_launch_layout_kernel.cuh on them, took 9.0 / 11.4 us at T = 1 / 256
// (deepseek-v3) against 6.1 / 9.1 us for the two launches: at small N the cluster layout ran
// twice the one-block kernel's instructions (per-expert reads of every block's counts through
// distributed shared memory, a per-expert padding pass).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/backend.h"
#include "cuda/common/launch.cuh"
#include "cuda/layout/layout_launch.cuh"
#include "cuda/layout/route_layout.h"
#include "cuda/layout/tiny_layout_kernel.cuh"
#include "cuda/routing/route_spec.cuh"
#include "cuda/routing/route_warp.cuh"

namespace switchyard::cuda {

namespace layout_detail {

constexpr int kFusedThreads = kOneThreads;   // 16 warps: one routed row each
constexpr int kFusedMaxTokens = kOneWarps;  // 16
constexpr long long kFusedRowsPerBlock = 1024;
constexpr long long kFusedMaxBlocks = 132;

// The ids source of the fused kernel (see tiny_layout_kernel.cuh): warp w routes row w and
// stages its expert ids.
template <class Shape>
struct RoutedIds {
  using Raw = int;
  routing::RouteParams rp;
  int* stage = nullptr;                 // [T * K]
  unsigned char* route_smem = nullptr;  // [kOneWarps][route_smem_per_warp]
  std::uint32_t route_smem_per_warp = 0;

  __device__ __forceinline__ void after_wait(const LayoutParams& p) {
    const int warp = static_cast<int>(threadIdx.x >> 5);
    const int lane = static_cast<int>(threadIdx.x & 31u);
    const int K = p.top_k;
    if (warp < p.num_tokens) {  // warp-uniform
      routing::RoutedPicks<Shape> picks;
      unsigned char* warp_smem = route_smem_per_warp == 0 ? nullptr : route_smem + warp * route_smem_per_warp;
      routing::route_warp<Shape>(rp, warp, warp_smem, &picks);
      // Whole-warp shapes: lane k holds pick k (RoutedPicks, kSlots = 1).
      if (lane < K) stage[warp * K + lane] = picks.expert[0];
    }
    __syncthreads();  // staged
  }
  __device__ __forceinline__ int id(const LayoutParams&, int x) const { return stage[x]; }
};

// Dynamic shared memory: the tiny layout's arrays, the staged ids (16-byte aligned), then the
// routing scratch of each warp.
__host__ __device__ inline std::size_t fused_stage_offset(int L) { return (tiny_smem_bytes(L) + 15) / 16 * 16; }
__host__ __device__ inline std::size_t fused_route_offset(int L, int N) {
  return fused_stage_offset(L) + (static_cast<std::size_t>(N) * 4 + 15) / 16 * 16;
}

template <class Shape, class SpecT>
__global__ void __launch_bounds__(kFusedThreads)
    route_layout_kernel(const routing::RouteParams rp, const LayoutParams p, std::uint32_t route_smem_per_warp) {
  extern __shared__ __align__(16) int fused_dyn[];
  RoutedIds<Shape> src;
  src.rp = rp;
  routing::SpecTraits<SpecT>::apply(src.rp);
  if (blockIdx.x != 0) {  // every block routes the rows; block 0 writes the routing outputs
    src.rp.topk_ids = nullptr;
    src.rp.topk_weights = nullptr;
  }
  unsigned char* base = reinterpret_cast<unsigned char*>(fused_dyn);
  src.stage = reinterpret_cast<int*>(base + fused_stage_offset(p.num_local));
  src.route_smem = base + fused_route_offset(p.num_local, p.num_picks);
  src.route_smem_per_warp = route_smem_per_warp;
  tiny_layout<kFusedThreads, kKeyBitsSmall>(p, fused_dyn, src);
}

}  // namespace layout_detail

namespace {

template <class Shape>
Status launch_fused(const routing::RouteParams& rp, const layout_detail::LayoutParams& p, cudaStream_t stream,
                    bool* launched) {
  const std::size_t per_warp = routing::route_smem_bytes_per_warp<Shape>(rp);
  const std::size_t smem =
      layout_detail::fused_route_offset(p.num_local, p.num_picks) + per_warp * layout_detail::kOneWarps;
  if (smem > layout_detail::kOneMaxSmem) return Status::Ok();  // two launches
  const long long rows = std::max<long long>(p.capacity_rows, p.num_picks);
  const long long blocks = std::clamp<long long>(
      (rows + layout_detail::kFusedRowsPerBlock - 1) / layout_detail::kFusedRowsPerBlock, 1,
      layout_detail::kFusedMaxBlocks);
  return routing::dispatch_route_spec<Shape>(rp, [&](auto spec) -> Status {
    constexpr auto kKernel = layout_detail::route_layout_kernel<Shape, decltype(spec)>;
    const char* name = "route_and_layout: route_layout_kernel";
    const cudaError_t err = layout_detail::allow_dynamic_smem<kKernel>(smem);
    if (err != cudaSuccess) return cuda_status(name, err);
    *launched = true;
    return launch_kernel(name, kKernel, dim3(static_cast<unsigned>(blocks)), dim3(layout_detail::kFusedThreads),
                         smem, stream, /*pdl=*/true, rp, p, static_cast<std::uint32_t>(per_warp));
  });
}

}  // namespace

Status route_and_layout_one_launch(const detail::RouteArgs& ra, const detail::LayoutArgs& la, Stream stream,
                                   bool* launched) {
  *launched = false;
  if (ra.num_tokens < 1 || ra.num_tokens > layout_detail::kFusedMaxTokens || ra.num_tokens != la.num_tokens ||
      ra.num_tokens * ra.config.top_k > layout_detail::kTinyMaxPicks || ra.config.top_k > kMaxGpuTopK ||
      la.num_local >= (1 << layout_detail::kKeyBitsSmall)) {
    return Status::Ok();
  }
  if (routing::route_shape_index(ra.config.num_experts, ra.num_tokens) < 0) return Status::Ok();
  const routing::RouteParams rp = routing::make_route_params(ra);
  const layout_detail::LayoutParams p = layout_detail::make_params(la);
  return routing::dispatch_route_shape(ra.config.num_experts, ra.num_tokens, [&](auto shape) -> Status {
    using Shape = decltype(shape);
    if constexpr (Shape::W == 32 && Shape::S <= 4) {
      return launch_fused<Shape>(rp, p, stream, launched);
    } else {
      return Status::Ok();
    }
  });
}

}  // namespace switchyard::cuda
