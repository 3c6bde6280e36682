// CUDA gather and combine launchers (docs/design.md section 4): pick the vector width the pointers
// and sizes allow, size the work items, and launch with programmatic dependent launch. No
// allocation and no host synchronization: every launch can be captured in a CUDA graph.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

#include "cuda/backend.h"
#include "cuda/permute/permute_internal.h"
#include "cuda/permute/permute_kernels.cuh"
#include "cuda/permute/permute_plan.h"

namespace switchyard::cuda {

namespace {

using permute::CombineParams;
using permute::GatherParams;
using permute::kBlockThreads;
using permute::kWarpSize;
using permute::kWarpsPerBlock;

// Resident blocks per SM of a kernel, queried once per kernel (the build targets one
// architecture, so the answer does not depend on the device).
int resident_blocks_per_sm(const void* kernel, int block_threads) {
  static std::mutex mutex;
  static std::unordered_map<const void*, int> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto found = cache.find(kernel);
  if (found != cache.end()) return found->second;
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, block_threads, 0) != cudaSuccess ||
      blocks < 1) {
    cudaGetLastError();  // not sticky; fall back to one block per SM
    blocks = 1;
  }
  cache.emplace(kernel, blocks);
  return blocks;
}

// Blocks of `block_threads` threads of a kernel that fit on the current device at once.
Status max_resident_blocks(const char* op, const void* kernel, int block_threads, std::int64_t* blocks) {
  int sms = 0;
  const Status status = current_sm_count(op, &sms);
  if (!status.ok()) return status;
  *blocks = static_cast<std::int64_t>(sms) * resident_blocks_per_sm(kernel, block_threads);
  return Status::Ok();
}

Status max_resident_blocks(const char* op, const void* kernel, std::int64_t* blocks) {
  return max_resident_blocks(op, kernel, kBlockThreads, blocks);
}

// Launches `kernel(params)` with blocks of kBlockThreads threads: one block per
// kWarpsPerBlock work items up to `max_blocks` (the kernels walk their items with a grid
// stride), with programmatic dependent launch (cuda/common/launch.cuh: the kernels wait for
// their predecessor before their first global access and let their successor launch early).
template <typename Params>
Status launch(const char* op, void (*kernel)(Params), std::int64_t max_blocks, std::int64_t work_items,
              const Params& params, Stream stream) {
  const unsigned grid = static_cast<unsigned>(permute::grid_blocks(work_items, kWarpsPerBlock, max_blocks));
  const Status status =
      launch_kernel(op, kernel, dim3(grid), dim3(kBlockThreads), 0, stream, /*pdl=*/true, params);
  if (!status.ok()) cudaGetLastError();  // the status carries it; do not leave it for a later check
  return status;
}

using permute::balanced_chunks;
using permute::Chunking;

bool aligned(const void* p, std::int64_t bytes) { return reinterpret_cast<std::uintptr_t>(p) % bytes == 0; }

// ---------------------------------------------------------------------------------------
// Gather.

// Widest vector (16, 8, 4, 2 or 1 bytes) that divides the row and both tensors' addressing.
int gather_vector_bytes(const detail::GatherArgs& a) {
  const std::int64_t elem = static_cast<std::int64_t>(dtype_size(a.dtype));
  const std::int64_t row_bytes = a.hidden * elem;
  const std::int64_t stride_bytes = a.x_row_stride * elem;
  for (int w = 16; w > 1; w /= 2) {
    if (row_bytes % w == 0 && stride_bytes % w == 0 && aligned(a.x, w) && aligned(a.x_perm, w)) return w;
  }
  return 1;
}

GatherParams gather_params(const detail::GatherArgs& a, const std::int32_t* expanded_to_permuted, int top_k,
                           int vec_bytes) {
  const std::int64_t elem = static_cast<std::int64_t>(dtype_size(a.dtype));
  GatherParams p;
  p.x = static_cast<const unsigned char*>(a.x);
  p.x_row_stride_bytes = a.x_row_stride * elem;
  const bool scales = a.scale_cols > 0 && a.x_scales != nullptr && a.x_perm_scales != nullptr;
  p.x_scales = scales ? a.x_scales : nullptr;
  p.x_perm_scales = scales ? a.x_perm_scales : nullptr;
  p.scale_cols = scales ? static_cast<int>(a.scale_cols) : 0;
  p.permuted_to_token = a.permuted_to_token;
  p.totals = a.totals;
  p.expanded_to_permuted = expanded_to_permuted;
  p.top_k = top_k;
  p.num_tokens = a.num_tokens;
  p.capacity_rows = a.capacity_rows;
  p.x_perm = static_cast<unsigned char*>(a.x_perm);
  p.row_vecs = a.hidden * elem / vec_bytes;
  p.zero_fill_padding = a.zero_fill_padding;
  return p;
}

// Row order (no expanded_to_permuted): grid-stride warps over (row, chunk) items.
template <int kVecBytes>
Status launch_gather_rows(const detail::GatherArgs& a, Stream stream) {
  GatherParams p = gather_params(a, nullptr, 0, kVecBytes);
  auto kernel = permute::gather_rows_kernel<kVecBytes>;
  std::int64_t max_blocks = 0;
  SY_RETURN_IF_ERROR(max_resident_blocks("gather", reinterpret_cast<const void*>(kernel), &max_blocks));
  const Chunking c =
      balanced_chunks(p.row_vecs, kWarpSize, permute::kGatherVecsPerLane, a.capacity_rows, max_blocks * kWarpsPerBlock);
  p.chunk_vecs = c.chunk_vecs;
  p.chunks_per_row = c.chunks;
  return launch("gather", kernel, max_blocks, a.capacity_rows * c.chunks, p, stream);
}

// Token-major (permute_kernels.cuh, gather_tokens_kernel): one warp per work item, as many
// blocks as items. Rows are split into the largest chunks (up to kGatherVecsPerLane vectors
// per lane) that still give every warp slot of the device a copy item, so that small calls
// spread each row over many SMs and large ones move 4 KB per warp item.
template <int kVecBytes>
Status launch_gather_tokens(const detail::GatherArgs& a, const std::int32_t* expanded_to_permuted, int top_k,
                            Stream stream) {
  using permute::kTokenBlockThreads;
  using permute::kTokenWarpsPerBlock;
  permute::TokenGatherParams tp;
  tp.g = gather_params(a, expanded_to_permuted, top_k, kVecBytes);
  GatherParams& p = tp.g;
  auto kernel = permute::gather_tokens_kernel<kVecBytes>;
  std::int64_t resident_blocks = 0;
  SY_RETURN_IF_ERROR(max_resident_blocks("gather", reinterpret_cast<const void*>(kernel), kTokenBlockThreads,
                                         &resident_blocks));
  const std::int64_t warp_slots = resident_blocks * kTokenWarpsPerBlock;
  const Chunking c = permute::slot_chunks(p.row_vecs, kWarpSize, permute::kGatherVecsPerLane, a.num_tokens, warp_slots);
  if (c.chunks > 65535) return Status::Unsupported("gather: rows of more than 65535 x 256 vectors");
  p.chunk_vecs = c.chunk_vecs;
  p.chunks_per_row = c.chunks;
  tp.copy_blocks = (a.num_tokens + kTokenWarpsPerBlock - 1) / kTokenWarpsPerBlock;
  tp.fill_groups = (a.capacity_rows + kWarpSize - 1) / kWarpSize;
  tp.fill_chunks = a.zero_fill_padding ? static_cast<int>(c.chunks) : 1;
  const std::int64_t fill_blocks_needed = (tp.fill_groups + kTokenWarpsPerBlock - 1) / kTokenWarpsPerBlock;
  // Split over the y planes unless each plane is a column chunk of every group (zero-fill).
  const std::int64_t fill_blocks =
      tp.fill_chunks > 1 ? fill_blocks_needed : (fill_blocks_needed + c.chunks - 1) / c.chunks;
  // At most one wave of copy items: latency bound, so x is loaded without waiting for the picks.
  tp.prefetch_x = a.num_tokens * c.chunks <= warp_slots;
  const std::int64_t grid = tp.copy_blocks + fill_blocks;
  if (grid > 0x7fffffff) return Status::Unsupported("gather: more than 2^31 - 1 blocks of work");
  const Status status = launch_kernel(
      "gather", kernel,
      dim3(static_cast<unsigned>(std::max<std::int64_t>(1, grid)), static_cast<unsigned>(c.chunks)),
      dim3(kTokenBlockThreads), 0, stream, /*pdl=*/true, tp);
  if (!status.ok()) cudaGetLastError();  // the status carries it; do not leave it for a later check
  return status;
}

Status gather_any(const detail::GatherArgs& a, const std::int32_t* expanded_to_permuted, int top_k,
                  Stream stream) {
  if (dtype_size(a.dtype) == 0) return Status::Internal("gather: CUDA backend reached with an invalid dtype");
  return dispatch_value<16, 8, 4, 2, 1>("gather: vector bytes", gather_vector_bytes(a), [&](auto vec_bytes) {
    constexpr int kVecBytes = decltype(vec_bytes)::value;
    return expanded_to_permuted != nullptr
               ? launch_gather_tokens<kVecBytes>(a, expanded_to_permuted, top_k, stream)
               : launch_gather_rows<kVecBytes>(a, stream);
  });
}

// ---------------------------------------------------------------------------------------
// Combine.

template <typename YF, typename OF, int kV, int kKB>
Status launch_combine(const detail::CombineArgs& a, Stream stream) {
  constexpr int kUV = permute::combine_vectors_per_step<typename OF::Storage, kV, kKB>();
  auto kernel = permute::combine_kernel<YF, OF, kV, kKB>;
  CombineParams p;
  p.y = static_cast<const unsigned char*>(a.y_perm);
  p.y_row_stride_bytes = a.y_row_stride * static_cast<std::int64_t>(sizeof(typename YF::Storage));
  p.expanded_to_permuted = a.expanded_to_permuted;
  p.capacity_rows = a.capacity_rows;
  p.weights = a.topk_weights;
  p.weight_kind = a.topk_weights == nullptr             ? permute::WeightKind::kNone
                  : a.weights_dtype == DType::kBFloat16 ? permute::WeightKind::kBFloat16
                                                        : permute::WeightKind::kFloat32;
  p.out = a.out;
  p.num_tokens = a.num_tokens;
  p.top_k = a.top_k;
  p.row_vecs = a.hidden / kV;
  p.accumulate = a.accumulate;
  std::int64_t max_blocks = 0;
  SY_RETURN_IF_ERROR(max_resident_blocks("combine", reinterpret_cast<const void*>(kernel), &max_blocks));
  // Up to 4 steps per item, so that the picks' rows and weights load once per 4 steps.
  const Chunking c =
      balanced_chunks(p.row_vecs, static_cast<std::int64_t>(kUV) * kWarpSize, 4, a.num_tokens, max_blocks * kWarpsPerBlock);
  p.chunk_vecs = c.chunk_vecs;
  p.chunks_per_row = c.chunks;
  return launch("combine", kernel, max_blocks, a.num_tokens * c.chunks, p, stream);
}

template <typename YF, typename OF>
Status combine_formats(const detail::CombineArgs& a, Stream stream) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(typename YF::Storage));
  constexpr int kOutVecBytes = kVec * static_cast<int>(sizeof(typename OF::Storage));
  const std::int64_t y_elem = static_cast<std::int64_t>(sizeof(typename YF::Storage));
  const bool vector = a.hidden % kVec == 0 && aligned(a.y_perm, 16) && (a.y_row_stride * y_elem) % 16 == 0 &&
                      aligned(a.out, std::min(16, kOutVecBytes));
  // Picks loaded per batch: the smallest of 2, 4, 8 that holds K (K > 8 walks several batches).
  const int batch = a.top_k <= 2 ? 2 : (a.top_k <= 4 ? 4 : 8);
  return dispatch_value<2, 4, 8>("combine: picks per batch", batch, [&](auto kb) {
    constexpr int kKB = decltype(kb)::value;
    return vector ? launch_combine<YF, OF, kVec, kKB>(a, stream) : launch_combine<YF, OF, 1, kKB>(a, stream);
  });
}

}  // namespace

// Token-major when the layout's expanded_to_permuted is given: each token row is read once
// (x is read K times in row order once it outgrows L2; H=7168 K=8 T=4096 bf16: 150 us against
// 217; docs/decisions/permute-gather-combine.md).
Status gather(const detail::GatherArgs& args, Stream stream) {
  return gather_any(args, args.expanded_to_permuted, args.expanded_to_permuted ? args.top_k : 0, stream);
}

Status gather_token_major(const detail::GatherArgs& args, const std::int32_t* expanded_to_permuted, int top_k,
                          Stream stream) {
  if (expanded_to_permuted == nullptr || top_k < 1) {
    return Status::InvalidArgument("gather: token-major gather needs expanded_to_permuted and top_k >= 1");
  }
  if (args.capacity_rows == 0 || args.hidden == 0) return Status::Ok();
  return gather_any(args, expanded_to_permuted, top_k, stream);
}

Status combine(const detail::CombineArgs& args, Stream stream) {
  if (args.topk_weights != nullptr && args.weights_dtype != DType::kFloat32 &&
      args.weights_dtype != DType::kBFloat16) {
    return Status::Internal("combine: CUDA backend reached with weights dtype " +
                            std::string(dtype_name(args.weights_dtype)));
  }
  Status status =
      Status::Internal("combine: CUDA backend reached with y dtype " + std::string(dtype_name(args.y_dtype)) +
                       " and out dtype " + std::string(dtype_name(args.out_dtype)));
  with_float_format(args.y_dtype, [&](auto y_format) {
    with_float_format(args.out_dtype, [&](auto out_format) {
      status = combine_formats<decltype(y_format), decltype(out_format)>(args, stream);
    });
  });
  return status;
}

}  // namespace switchyard::cuda
