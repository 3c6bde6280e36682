// One-launch route + layout for small T (DESIGN.md sections 2 and 3). Compiled with -fmad=false
// (routing arithmetic; see src/CMakeLists.txt).
//
// ONE thread-block cluster of CB <= 16 blocks of kOneThreads threads. Block b routes rows
// [b * R, (b + 1) * R) of the T <= 16 * CB rows, a warp per row (route_warp, the routing kernel's
// per-row routine, with the same compile-time specialisations: route_spec.cuh), writes topk_ids
// and topk_weights, and keeps the row's expert ids in shared memory. Its R * K picks are then
// chunk b of the cluster layout (one_launch_layout_kernel.cuh, cluster form), which reads them from
// there instead of global memory. The two launches it replaces (route, then layout chained by
// PDL) paid a second launch and the layout kernel's wait for the routing grid to finish and
// flush before it could load the ids.
//
// Shapes served: 64 < E <= 512 (the whole-warp routing shapes with up to 4 stripes), K <= 32,
// L < 1024, T <= kFusedMaxTokens; the cluster has max(ceil(T / 16), ceil(rows / 4096)) blocks
// (at most 8 up to T = 128, 16 past it where the device can schedule a 16-block cluster), so
// that the padding rows are written by several SMs. Everything else runs the two launches.
// (A fused kernel in which every block routed all rows existed up to 6aaec95 and was slower than
// two launches; this one routes each row once.)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/backend.h"
#include "cuda/common/launch.cuh"
#include "cuda/layout/layout_launch.cuh"
#include "cuda/layout/one_launch_layout_kernel.cuh"
#include "cuda/layout/route_layout.h"
#include "cuda/routing/route_spec.cuh"
#include "cuda/routing/route_warp.cuh"

namespace switchyard::cuda {

namespace layout_detail {

constexpr int kFusedMaxBlocks = 16;
constexpr int kFusedRowsPerWarp = 1;  // the whole-warp routing shapes route one row per warp
constexpr int kFusedMaxTokens = kFusedMaxBlocks * kOneWarps * kFusedRowsPerWarp;  // 256
// Padding rows: about this many rows of the row capacity per block at least.
constexpr long long kFusedRowsPerBlock = 4096;

// The ids source of the fused kernel (see GlobalIds for the interface): block b routes its rows
// after pdl_wait() and stages their expert ids; chunk b is those rows' picks.
template <class Shape>
struct RoutedIds {
  using Raw = int;
  static constexpr bool kExactCluster = false;  // CB blocks, CB <= kFusedMaxBlocks
  routing::RouteParams rp;
  int rows_per_block = 0;
  int* stage = nullptr;                    // [rows_per_block * K]
  unsigned char* route_smem = nullptr;     // [kOneWarps][route_smem_per_warp]
  std::uint32_t route_smem_per_warp = 0;
  int c0 = 0;

  __device__ __forceinline__ int chunk(int /*N*/) const { return rows_per_block * rp.top_k; }
  __device__ __forceinline__ void after_wait(const LayoutParams& p) {
    const int warp = static_cast<int>(threadIdx.x >> 5);
    const int lane = static_cast<int>(threadIdx.x & 31u);
    const int K = p.top_k;
    const int row0 = static_cast<int>(blockIdx.x) * rows_per_block;
    c0 = row0 * K;
    if (warp < rows_per_block && row0 + warp < p.num_tokens) {  // warp-uniform
      routing::RoutedPicks<Shape> picks;
      unsigned char* warp_smem = route_smem_per_warp == 0 ? nullptr : route_smem + warp * route_smem_per_warp;
      routing::route_warp<Shape>(rp, row0 + warp, warp_smem, &picks);
      // Whole-warp shapes: lane k holds pick k (RoutedPicks, kSlots = 1).
      if (lane < K) stage[warp * K + lane] = picks.expert[0];
    }
    __syncthreads();  // staged
  }
  __device__ __forceinline__ int id(const LayoutParams&, int x) const { return stage[x - c0]; }
};

// Dynamic shared memory: the cluster layout's arrays for a chunk of R * K picks, the staged ids
// (rounded to 16 bytes), then the routing scratch of each warp.
__host__ __device__ inline std::size_t fused_stage_offset(int L, int chunk) {
  return (one_launch_smem_bytes(L, true, chunk) + 15) / 16 * 16;
}
__host__ __device__ inline std::size_t fused_route_offset(int L, int chunk) {
  return fused_stage_offset(L, chunk) + (static_cast<std::size_t>(chunk) * 4 + 15) / 16 * 16;
}

template <class Shape, class SpecT>
__global__ void __launch_bounds__(kOneThreads, 1)
    route_layout_kernel(const routing::RouteParams rp, const LayoutParams p, int rows_per_block,
                        std::uint32_t route_smem_per_warp) {
  __shared__ OneShared sh;
  extern __shared__ __align__(16) int one_dyn[];
  RoutedIds<Shape> src;
  src.rp = rp;
  routing::SpecTraits<SpecT>::apply(src.rp);
  src.rows_per_block = rows_per_block;
  const int chunk = rows_per_block * p.top_k;
  unsigned char* base = reinterpret_cast<unsigned char*>(one_dyn);
  src.stage = reinterpret_cast<int*>(base + fused_stage_offset(p.num_local, chunk));
  src.route_smem = base + fused_route_offset(p.num_local, chunk);
  src.route_smem_per_warp = route_smem_per_warp;
  one_launch_layout<1, kFusedMaxBlocks, kKeyBitsSmall>(p, sh, one_dyn, src);
}

}  // namespace layout_detail

namespace {

using layout_detail::kOneThreads;
using layout_detail::kOneWarps;

template <class Shape>
Status launch_fused(const routing::RouteParams& rp, const layout_detail::LayoutParams& p, cudaStream_t stream,
                    bool* launched) {
  const long long T = p.num_tokens;
  const long long by_rows = (T + kOneWarps - 1) / kOneWarps;
  const long long by_writes = (std::max<long long>(p.capacity_rows, p.num_picks) + layout_detail::kFusedRowsPerBlock -
                               1) / layout_detail::kFusedRowsPerBlock;
  const int max_blocks = by_rows > layout_detail::kClusterBlocksPortable ? layout_detail::kFusedMaxBlocks
                                                                          : layout_detail::kClusterBlocksPortable;
  const int blocks = static_cast<int>(std::min<long long>(std::max(by_rows, by_writes), max_blocks));
  const int rows_per_block = static_cast<int>((T + blocks - 1) / blocks);
  const int chunk = rows_per_block * p.top_k;
  const std::size_t per_warp = routing::route_smem_bytes_per_warp<Shape>(rp);
  const std::size_t smem = layout_detail::fused_route_offset(p.num_local, chunk) + per_warp * kOneWarps;
  if (smem > layout_detail::kOneMaxSmem) return Status::Ok();
  return routing::dispatch_route_spec<Shape>(rp, [&](auto spec) -> Status {
    constexpr auto kKernel = layout_detail::route_layout_kernel<Shape, decltype(spec)>;
    if (blocks > layout_detail::kClusterBlocksPortable &&
        !layout_detail::cluster16_schedulable<kKernel>(smem)) {
      return Status::Ok();  // two launches
    }
    const char* name = "route_and_layout: route_layout_kernel";
    cudaError_t err = layout_detail::allow_dynamic_smem<kKernel>(smem);
    if (err == cudaSuccess && blocks > layout_detail::kClusterBlocksPortable)
      err = layout_detail::allow_nonportable_clusters<kKernel>();
    if (err != cudaSuccess) return cuda_status(name, err);
    *launched = true;
    return launch_kernel_clustered(name, kKernel, dim3(static_cast<unsigned>(blocks)), dim3(kOneThreads), smem,
                                   stream, /*pdl=*/true, static_cast<unsigned>(blocks), rp, p, rows_per_block,
                                   static_cast<std::uint32_t>(per_warp));
  });
}

}  // namespace

Status route_and_layout_one_launch(const detail::RouteArgs& ra, const detail::LayoutArgs& la, Stream stream,
                                   bool* launched) {
  *launched = false;
  if (ra.num_tokens < 1 || ra.num_tokens > layout_detail::kFusedMaxTokens || ra.num_tokens != la.num_tokens ||
      ra.config.top_k > kMaxGpuTopK || la.num_local >= (1 << layout_detail::kKeyBitsSmall)) {
    return Status::Ok();
  }
  const routing::RouteParams rp = routing::make_route_params(ra);
  const layout_detail::LayoutParams p = layout_detail::make_params(la);
  const int index = routing::route_shape_index(ra.config.num_experts, ra.num_tokens);
  if (index < 0) return Status::Ok();
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
