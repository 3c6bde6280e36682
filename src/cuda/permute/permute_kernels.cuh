// Gather and combine kernels (docs/design.md section 4). Launchers live in permute.cu; these
// kernels know raw pointers and sizes only.
//
// Both operations are pure data movement, so the design goal is "enough bytes in flight":
// HBM3e on an H200 needs roughly bandwidth x latency ~ 4.8 TB/s x ~0.8 us ~ 4 MB in flight,
// ~30 KB per SM. Every warp therefore issues all loads of a work item (up to 8 x 16 B per
// lane) before the first use, and the grid is sized to the resident-block limit, walking work
// items with a grid stride (the number of items is only known on the device: padded_total).
//
// Work items are (row, column chunk) pairs handled by one warp; a chunk holds at most 8
// vectors per lane. Splitting a row into chunks keeps small-T calls (a handful of rows)
// spread across many SMs, which is what makes them latency- rather than bandwidth-bound.
//
// Every kernel calls pdl_wait() before its first global access and pdl_launch_dependents()
// right after it (cuda/common/launch.cuh): a grid is at most one wave of resident blocks, so a
// successor scheduled early only takes SM slots our blocks leave free, and it still waits for
// all of our writes in its own pdl_wait().
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/numeric.h"
#include "cuda/common/element_formats.cuh"
#include "cuda/common/launch.cuh"

namespace switchyard::cuda::permute {

constexpr int kWarpSize = 32;
constexpr int kBlockThreads = 256;
constexpr int kWarpsPerBlock = kBlockThreads / kWarpSize;
// Vectors each lane moves per gather work item, all loads issued before the first store.
constexpr int kGatherVecsPerLane = 8;
// Loads in flight per lane and per step of a combine work item (K rows x vectors).
constexpr int kCombineLoadsPerStep = 8;
// At least 2 x 256 threads x 8 x 16 B = 64 KB of loads in flight per SM (caps registers at 128).
constexpr int kCombineMinBlocksPerSm = 2;

// ---------------------------------------------------------------------------------------
// Small device helpers.

// Copies kBytes between 16-byte-or-less aligned locations as the widest vectors that fit; used
// to move a register array (declared alignas(16)) to or from global memory.
template <int kBytes>
__device__ __forceinline__ void store_vector(void* dst, const void* src) {
  constexpr int kPiece = kBytes < 16 ? kBytes : 16;
  using V = typename VecType<kPiece>::type;
#pragma unroll
  for (int i = 0; i < kBytes / kPiece; ++i) static_cast<V*>(dst)[i] = static_cast<const V*>(src)[i];
}
template <int kBytes>
__device__ __forceinline__ void load_vector(void* dst, const void* src) {
  constexpr int kPiece = kBytes < 16 ? kBytes : 16;
  using V = typename VecType<kPiece>::type;
#pragma unroll
  for (int i = 0; i < kBytes / kPiece; ++i) static_cast<V*>(dst)[i] = static_cast<const V*>(src)[i];
}

// Walks work items item = warp, warp + num_warps, ... of a grid of `rows` x `chunks` items
// without a 64-bit division per step: the stride is split once into whole rows and chunks.
struct ItemWalker {
  std::int64_t row;
  std::int64_t chunk;
  std::int64_t chunks;
  std::int64_t step_rows;
  std::int64_t step_chunks;

  __device__ __forceinline__ ItemWalker(std::int64_t first_item, std::int64_t stride,
                                        std::int64_t chunks_per_row)
      : row(first_item / chunks_per_row),
        chunk(first_item % chunks_per_row),
        chunks(chunks_per_row),
        step_rows(stride / chunks_per_row),
        step_chunks(stride % chunks_per_row) {}
  __device__ __forceinline__ void advance() {
    row += step_rows;
    chunk += step_chunks;
    if (chunk >= chunks) {
      chunk -= chunks;
      ++row;
    }
  }
};

__device__ __forceinline__ std::int64_t global_warp() {
  return (static_cast<std::int64_t>(blockIdx.x) * kBlockThreads + threadIdx.x) / kWarpSize;
}
__device__ __forceinline__ std::int64_t num_warps() {
  return static_cast<std::int64_t>(gridDim.x) * kWarpsPerBlock;
}
__device__ __forceinline__ std::int64_t clamp_rows(std::int32_t padded_total, std::int64_t capacity_rows) {
  const std::int64_t v = padded_total;
  return v < 0 ? 0 : (v > capacity_rows ? capacity_rows : v);
}

// ---------------------------------------------------------------------------------------
// Gather.

struct GatherParams {
  const unsigned char* x = nullptr;  // [T, x_row_stride_bytes]
  std::int64_t x_row_stride_bytes = 0;
  const float* x_scales = nullptr;  // [T, scale_cols] or null
  float* x_perm_scales = nullptr;   // [R, scale_cols] or null
  int scale_cols = 0;
  const std::int32_t* permuted_to_token = nullptr;     // [R]
  const std::int32_t* totals = nullptr;                // totals[0] = padded_total
  const std::int32_t* expanded_to_permuted = nullptr;  // [T,K], token-major kernel only
  int top_k = 0;                                       // token-major kernel only
  std::int64_t num_tokens = 0;
  std::int64_t capacity_rows = 0;
  unsigned char* x_perm = nullptr;  // [R, row_vecs * kVecBytes], contiguous
  std::int64_t row_vecs = 0;        // vectors per row
  std::int64_t chunk_vecs = 0;      // vectors per work item, <= 32 * kGatherVecsPerLane
  std::int64_t chunks_per_row = 1;
  bool zero_fill_padding = false;
};

// Moves one chunk of a row: the source row of token `token` (or zeros when token < 0) to
// destination row `dst_row`, and the row's scales when this is chunk 0.
template <int kVecBytes>
__device__ __forceinline__ void load_chunk(const GatherParams& p, std::int64_t token, std::int64_t chunk,
                                           int lane,
                                           typename VecType<kVecBytes>::type (&buf)[kGatherVecsPerLane]) {
  using V = typename VecType<kVecBytes>::type;
  const std::int64_t first = chunk * p.chunk_vecs;
  const std::int64_t n = min(p.chunk_vecs, p.row_vecs - first);
  const V* src = reinterpret_cast<const V*>(p.x + token * p.x_row_stride_bytes) + first;
#pragma unroll
  for (int j = 0; j < kGatherVecsPerLane; ++j) {
    const std::int64_t v = j * kWarpSize + lane;
    if (v < n) buf[j] = __ldg(src + v);
  }
}

template <int kVecBytes>
__device__ __forceinline__ void store_chunk(
    const GatherParams& p, std::int64_t dst_row, std::int64_t chunk, int lane,
    const typename VecType<kVecBytes>::type (&buf)[kGatherVecsPerLane]) {
  using V = typename VecType<kVecBytes>::type;
  const std::int64_t first = chunk * p.chunk_vecs;
  const std::int64_t n = min(p.chunk_vecs, p.row_vecs - first);
  V* dst = reinterpret_cast<V*>(p.x_perm + dst_row * p.row_vecs * kVecBytes) + first;
#pragma unroll
  for (int j = 0; j < kGatherVecsPerLane; ++j) {
    const std::int64_t v = j * kWarpSize + lane;
    if (v < n) dst[v] = buf[j];
  }
}

// Scales of token `token` (zeros when token < 0) to row `dst_row`.
__device__ __forceinline__ void copy_scales(const GatherParams& p, std::int64_t token, std::int64_t dst_row,
                                            int lane) {
  if (p.scale_cols <= 0 || p.x_scales == nullptr || p.x_perm_scales == nullptr) return;
  for (int c = lane; c < p.scale_cols; c += kWarpSize) {
    p.x_perm_scales[dst_row * p.scale_cols + c] =
        token >= 0 ? __ldg(p.x_scales + token * p.scale_cols + c) : 0.0f;
  }
}

// Row-order gather, the API's contract read literally: for every row p < padded_total, one
// warp per (p, chunk) copies x[permuted_to_token[p]] or zero-fills a padding row. Each token
// row is read once per copy, so for x larger than L2 it reads K rows per token from HBM.
//
// A warp looks its next 32 items up at once (lane j fetches the token of its j-th next item),
// then copies the ones with work. Padding rows without zero-fill thus cost 1/32 of a round
// trip instead of one each: at small T with a large tile almost every row is padding (T=16,
// K=8, M=128 gives ~16K padded rows for 128 tokens).
template <int kVecBytes>
__global__ void __launch_bounds__(kBlockThreads) gather_rows_kernel(const GatherParams p) {
  using V = typename VecType<kVecBytes>::type;
  const int lane = threadIdx.x % kWarpSize;
  const std::int64_t warps = num_warps();
  const std::int64_t chunks = p.chunks_per_row;
  std::int64_t item = global_warp() + lane * warps;  // this lane's item in the current batch
  pdl_wait();                                        // the layout and x come from earlier kernels
  pdl_launch_dependents();
  const std::int64_t rows = clamp_rows(__ldg(p.totals), p.capacity_rows);
  for (;; item += kWarpSize * warps) {
    const std::int64_t my_row = item / chunks;
    const std::int64_t my_chunk = item - my_row * chunks;
    const bool in_range = my_row < rows;
    std::int32_t my_token = in_range ? __ldg(p.permuted_to_token + my_row) : -1;
    if (my_token < 0 || my_token >= p.num_tokens) my_token = -1;
    const unsigned active = __ballot_sync(0xffffffffu, in_range);
    unsigned work = __ballot_sync(0xffffffffu, in_range && (my_token >= 0 || p.zero_fill_padding));
    while (work != 0) {
      const int j = __ffs(work) - 1;
      work &= work - 1;
      const std::int64_t row = __shfl_sync(0xffffffffu, my_row, j);
      const std::int64_t chunk = __shfl_sync(0xffffffffu, my_chunk, j);
      const std::int32_t token = __shfl_sync(0xffffffffu, my_token, j);
      V buf[kGatherVecsPerLane];
      if (token >= 0) {
        load_chunk<kVecBytes>(p, token, chunk, lane, buf);
      } else {
#pragma unroll
        for (int i = 0; i < kGatherVecsPerLane; ++i) buf[i] = V{};
      }
      store_chunk<kVecBytes>(p, row, chunk, lane, buf);
      if (chunk == 0) copy_scales(p, token, row, lane);
    }
    if (active != 0xffffffffu) break;  // items increase with the lane: the rest is past the end
  }
}

// Token-major gather: the same result as gather_rows_kernel for any input, but each token row
// is read from memory once and written to all its K rows (bytes moved: T rows read + rows
// written, against K reads per token in row order).
//
// One launch, two kinds of blocks (blockIdx.x < copy_blocks: copy, else fill), one work item
// per warp and no grid-stride loop: the grid is as large as the work, so the block scheduler
// balances it, and every warp's work is a short chain of dependent loads that the warps of
// other blocks overlap (docs/decisions/permute-gather-combine.md).
//   Copy items (token t, column chunk): the destinations are the rows
//     r = expanded_to_permuted[t,k] with r < padded_total and permuted_to_token[r] == t (the
//     check makes it exact even for an inconsistent layout). Dependent chain: {padded_total,
//     picks} -> {x chunk, permuted_to_token of the picks} -> stores. A token with no placed
//     pick is never read, unless prefetch_x (small calls, where latency is all that counts)
//     issues the x loads together with the picks, taking one round trip off the chain.
//   Fill items (32 rows, column chunk): every row p < padded_total that the copy items do
//     not write - a padding row when zero-filling, or a token row that no expanded_to_permuted
//     entry points to (impossible for a layout made by layout()) - is written here in row
//     order. Without zero-fill there is one column chunk per group (a layout from layout()
//     leaves nothing to write); with it, the columns of a group are split like the copy
//     items', so that zero rows are spread over as many warps as token rows.
// The two kinds write disjoint rows, so they need no ordering between them.
constexpr int kTokenBlockThreads = 128;
constexpr int kTokenWarpsPerBlock = kTokenBlockThreads / kWarpSize;
// 8 x 128 threads per SM (50% occupancy) caps registers at 64, enough for the 8 x 16 B of a
// lane's chunk plus addresses; up to 32 warps x 4 KB = 128 KB of loads in flight per SM.
constexpr int kTokenMinBlocksPerSm = 8;
// Scales per lane held in registers between the load and the K stores (per-128-column
// scales of rows up to 8192 columns); further columns are reloaded per destination.
constexpr int kScalesPerLane = 2;

struct TokenGatherParams {
  GatherParams g;
  std::int64_t copy_blocks = 0;  // blocks of copy items (first in the grid)
  std::int64_t fill_groups = 0;  // ceil(capacity_rows / 32)
  int fill_chunks = 1;           // column chunks per fill group: 1 or g.chunks_per_row
  bool prefetch_x = false;       // load x with the picks (see above)
};

// This lane's vectors [first + 32 j + lane] (j < kGatherVecsPerLane, index < first + n) of the
// row at `src`; x is read once per token here, so it streams through L2 (evict first).
template <int kVecBytes>
__device__ __forceinline__ void load_token_chunk(
    const unsigned char* src_row, int first, int n, int lane,
    typename VecType<kVecBytes>::type (&buf)[kGatherVecsPerLane]) {
  using V = typename VecType<kVecBytes>::type;
  const V* src = reinterpret_cast<const V*>(src_row) + first;
#pragma unroll
  for (int j = 0; j < kGatherVecsPerLane; ++j) {
    if (j * kWarpSize + lane < n) buf[j] = __ldcs(src + j * kWarpSize + lane);
  }
}

template <int kVecBytes>
__device__ __forceinline__ void store_token_chunk(
    unsigned char* dst_row, int first, int n, int lane,
    const typename VecType<kVecBytes>::type (&buf)[kGatherVecsPerLane]) {
  using V = typename VecType<kVecBytes>::type;
  V* dst = reinterpret_cast<V*>(dst_row) + first;
#pragma unroll
  for (int j = 0; j < kGatherVecsPerLane; ++j) {
    if (j * kWarpSize + lane < n) dst[j * kWarpSize + lane] = buf[j];
  }
}

template <int kVecBytes>
__device__ __forceinline__ void gather_copy_item(const TokenGatherParams& tp, std::int64_t t, int chunk,
                                                 int lane) {
  using V = typename VecType<kVecBytes>::type;
  const GatherParams& p = tp.g;
  const int first = chunk * static_cast<int>(p.chunk_vecs);
  const int n = static_cast<int>(min(p.chunk_vecs, p.row_vecs - first));
  const unsigned char* src_row = p.x + t * p.x_row_stride_bytes;
  const int K = p.top_k;
  const std::int32_t* picks = p.expanded_to_permuted + t * K;
  const bool scales = chunk == 0 && p.scale_cols > 0;  // warp-uniform
  const float* src_scales = p.x_scales + t * p.scale_cols;
  V buf[kGatherVecsPerLane];
  float scale_buf[kScalesPerLane];
  auto load = [&]() {
    load_token_chunk<kVecBytes>(src_row, first, n, lane, buf);
    if (scales) {
#pragma unroll
      for (int i = 0; i < kScalesPerLane; ++i) {
        const int c = i * kWarpSize + lane;
        if (c < p.scale_cols) scale_buf[i] = __ldg(src_scales + c);
      }
    }
  };

  pdl_wait();  // the layout and x come from earlier kernels
  pdl_launch_dependents();
  if (tp.prefetch_x) load();
  // padded_total is an int32, so rows and row indices fit in 32 bits here.
  const int rows = static_cast<int>(clamp_rows(__ldg(p.totals), p.capacity_rows));
  std::int32_t r = lane < K ? __ldg(picks + lane) : -1;  // lane j looks at pick k0 + j
  if (!tp.prefetch_x) {
    // A token with no placed pick is never read (with K > 32, tested on the first 32 only).
    if (__ballot_sync(0xffffffffu, r >= 0 && r < rows) == 0 && K <= kWarpSize) return;
    load();
  }
  for (int k0 = 0; k0 < K; k0 += kWarpSize) {
    if (k0 > 0) r = k0 + lane < K ? __ldg(picks + k0 + lane) : -1;
    const bool dest = r >= 0 && r < rows && __ldg(p.permuted_to_token + r) == t;
    unsigned mask = __ballot_sync(0xffffffffu, dest);
    while (mask != 0) {  // destinations in k order
      const int j = __ffs(mask) - 1;
      mask &= mask - 1;
      const std::int64_t dst_row = __shfl_sync(0xffffffffu, r, j);
      store_token_chunk<kVecBytes>(p.x_perm + dst_row * p.row_vecs * kVecBytes, first, n, lane, buf);
      if (scales) {
        float* dst_scales = p.x_perm_scales + dst_row * p.scale_cols;
#pragma unroll
        for (int i = 0; i < kScalesPerLane; ++i) {
          const int c = i * kWarpSize + lane;
          if (c < p.scale_cols) dst_scales[c] = scale_buf[i];
        }
        for (int c = kScalesPerLane * kWarpSize + lane; c < p.scale_cols; c += kWarpSize) {
          dst_scales[c] = __ldg(src_scales + c);
        }
      }
    }
  }
}

template <int kVecBytes>
__device__ __forceinline__ void gather_fill_item(const TokenGatherParams& tp, std::int64_t group,
                                                 int first_chunk, int lane) {
  using V = typename VecType<kVecBytes>::type;
  const GatherParams& p = tp.g;
  const std::int64_t row = group * kWarpSize + lane;
  const int K = p.top_k;
  pdl_wait();
  pdl_launch_dependents();
  // permuted_to_token is loaded together with padded_total (every row < capacity_rows exists).
  std::int32_t token = row < p.capacity_rows ? __ldg(p.permuted_to_token + row) : -1;
  const std::int64_t rows = clamp_rows(__ldg(p.totals), p.capacity_rows);
  if (group * kWarpSize >= rows) return;  // warp-uniform
  bool todo = false;
  if (row < rows) {
    if (token >= 0 && token < p.num_tokens) {
      const std::int32_t* picks = p.expanded_to_permuted + static_cast<std::int64_t>(token) * K;
      bool covered = false;
#pragma unroll 8
      for (int k = 0; k < K; ++k) covered |= __ldg(picks + k) == row;
      todo = !covered;
    } else {
      token = -1;
      todo = p.zero_fill_padding;
    }
  }
  unsigned mask = __ballot_sync(0xffffffffu, todo);
  while (mask != 0) {
    const int j = __ffs(mask) - 1;
    mask &= mask - 1;
    const std::int64_t dst_row = group * kWarpSize + j;
    const std::int32_t src_token = __shfl_sync(0xffffffffu, token, j);
    for (std::int64_t chunk = first_chunk; chunk < p.chunks_per_row; chunk += tp.fill_chunks) {
      V buf[kGatherVecsPerLane];
      if (src_token >= 0) {
        load_chunk<kVecBytes>(p, src_token, chunk, lane, buf);
      } else {
#pragma unroll
        for (int i = 0; i < kGatherVecsPerLane; ++i) buf[i] = V{};
      }
      store_chunk<kVecBytes>(p, dst_row, chunk, lane, buf);
    }
    if (first_chunk == 0) copy_scales(p, src_token, dst_row, lane);
  }
}

// Grid: x = copy_blocks blocks of kTokenWarpsPerBlock tokens, then the fill blocks; y = the
// column chunk of a copy item. Fill blocks use y as their column chunk when zero-filling
// (fill_chunks = chunks_per_row); otherwise (fill_chunks = 1) as more groups, so that no block
// of the y planes is empty.
template <int kVecBytes>
__global__ void __launch_bounds__(kTokenBlockThreads, kTokenMinBlocksPerSm)
    gather_tokens_kernel(const TokenGatherParams tp) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp_in_block = threadIdx.x / kWarpSize;
  const std::int64_t block = blockIdx.x;
  if (block < tp.copy_blocks) {
    const std::int64_t t = block * kTokenWarpsPerBlock + warp_in_block;
    if (t < tp.g.num_tokens) gather_copy_item<kVecBytes>(tp, t, static_cast<int>(blockIdx.y), lane);
  } else {
    const bool split_columns = tp.fill_chunks > 1;
    const std::int64_t fill_block =
        split_columns ? block - tp.copy_blocks : (block - tp.copy_blocks) * gridDim.y + blockIdx.y;
    const std::int64_t group = fill_block * kTokenWarpsPerBlock + warp_in_block;
    const int chunk = split_columns ? static_cast<int>(blockIdx.y) : 0;
    if (group < tp.fill_groups) gather_fill_item<kVecBytes>(tp, group, chunk, lane);
  }
}

// ---------------------------------------------------------------------------------------
// Combine.

enum class WeightKind : int { kNone = 0, kFloat32 = 1, kBFloat16 = 2 };

struct CombineParams {
  const unsigned char* y = nullptr;  // [R, y_row_stride_bytes]
  std::int64_t y_row_stride_bytes = 0;
  const std::int32_t* expanded_to_permuted = nullptr;  // [T,K]
  std::int64_t capacity_rows = 0;
  const void* weights = nullptr;  // [T,K] or null
  WeightKind weight_kind = WeightKind::kNone;
  void* out = nullptr;  // [T, H] contiguous
  std::int64_t num_tokens = 0;
  int top_k = 0;
  std::int64_t row_vecs = 0;        // H / kV
  std::int64_t chunk_vecs = 0;      // vectors per work item, a multiple of the step width
  std::int64_t chunks_per_row = 1;  // per token
  bool accumulate = false;
};

// One batch of up to kKB picks of a token: source row of each (-1: not placed) and its weight.
// Every index and weight load is issued before any of them is used: no load waits on a branch
// that depends on an earlier one.
template <int kKB>
struct PickBatch {
  std::int32_t row[kKB];
  float weight[kKB];

  __device__ __forceinline__ void load(const CombineParams& p, std::int64_t t, int k0) {
    const std::int64_t first = t * p.top_k + k0;
#pragma unroll
    for (int i = 0; i < kKB; ++i) row[i] = k0 + i < p.top_k ? __ldg(p.expanded_to_permuted + first + i) : -1;
    if (p.weight_kind == WeightKind::kFloat32) {
      const float* w = static_cast<const float*>(p.weights) + first;
#pragma unroll
      for (int i = 0; i < kKB; ++i) weight[i] = k0 + i < p.top_k ? __ldg(w + i) : 0.0f;
    } else if (p.weight_kind == WeightKind::kBFloat16) {
      const unsigned short* w = static_cast<const unsigned short*>(p.weights) + first;
#pragma unroll
      for (int i = 0; i < kKB; ++i) weight[i] = k0 + i < p.top_k ? detail::bf16_to_float(__ldg(w + i)) : 0.0f;
    } else {
#pragma unroll
      for (int i = 0; i < kKB; ++i) weight[i] = 1.0f;
    }
#pragma unroll
    for (int i = 0; i < kKB; ++i) {
      if (row[i] >= p.capacity_rows) row[i] = -1;  // negative: not placed already
    }
  }
};

// acc[u][e] = fma(w_k, y[r_k][vec[u] * kV + e], acc[u][e]) for the batch's picks in k order,
// for this lane's kUV vectors (vector indices within the row; those >= vec_end are out of this
// item). All kKB * kUV loads are issued before the first fma.
template <typename YF, int kV, int kKB, int kUV>
__device__ __forceinline__ void accumulate_batch(const CombineParams& p, const PickBatch<kKB>& batch,
                                                 const int (&vec)[kUV], int vec_end, float (&acc)[kUV][kV]) {
  using Y = typename YF::Storage;
  constexpr int kYBytes = kV * static_cast<int>(sizeof(Y));
  using YV = typename VecType<kYBytes>::type;
  YV raw[kKB][kUV];
#pragma unroll
  for (int i = 0; i < kKB; ++i) {
    const YV* src =
        reinterpret_cast<const YV*>(p.y + static_cast<std::int64_t>(batch.row[i]) * p.y_row_stride_bytes);
#pragma unroll
    for (int u = 0; u < kUV; ++u) {
      // y_perm is read exactly once: stream it past L1 and let L2 evict it first.
      if (batch.row[i] >= 0 && vec[u] < vec_end) raw[i][u] = __ldcs(src + vec[u]);
    }
  }
#pragma unroll
  for (int i = 0; i < kKB; ++i) {
    if (batch.row[i] < 0) continue;
#pragma unroll
    for (int u = 0; u < kUV; ++u) {
      Y vals[kV];
      static_assert(sizeof(vals) == sizeof(YV), "vector and element array sizes differ");
      *reinterpret_cast<YV*>(vals) = raw[i][u];
#pragma unroll
      for (int e = 0; e < kV; ++e) acc[u][e] = __fmaf_rn(batch.weight[i], YF::to_float(vals[e]), acc[u][e]);
    }
  }
}

// Vectors per lane and step: enough to keep kCombineLoadsPerStep loads in flight, halved when
// the output vector is 32 bytes (fp32 out of 16-bit y), whose accumulators would otherwise
// push the kernel past 128 registers.
template <typename Out, int kV, int kKB>
constexpr int combine_vectors_per_step() {
  const int uv = kCombineLoadsPerStep / kKB > 0 ? kCombineLoadsPerStep / kKB : 1;
  return kV * static_cast<int>(sizeof(Out)) > 16 && uv > 1 ? uv / 2 : uv;
}

// out[t] = cast(sum_k w[t,k] * y[e2p[t,k]] (+ out[t])). Work items are (token, chunk of
// columns); a lane handles kUV vectors of kV columns per step and loads kKB picks of each at
// once (kKB * kUV = 8 loads in flight), batch after batch when K > kKB. Vectors are
// accumulated in k order from 0.0f with fma: the CPU oracle's exact operation sequence.
template <typename YF, typename OF, int kV, int kKB>
__global__ void __launch_bounds__(kBlockThreads, kCombineMinBlocksPerSm)
    combine_kernel(const CombineParams p) {
  using Out = typename OF::Storage;
  constexpr int kUV = combine_vectors_per_step<Out, kV, kKB>();
  constexpr int kOutBytes = kV * static_cast<int>(sizeof(Out));
  const int lane = threadIdx.x % kWarpSize;
  Out* out = static_cast<Out*>(p.out);
  const std::int64_t H = p.row_vecs * kV;
  // The parameters into the constant cache before the wait (launch.cuh): combine 4.6% faster at
  // T = 1; the gather kernels gained nothing and do not (docs/decisions/warm-params.md).
  warm_params(p, /*never=*/p.num_tokens < 0);  // num_tokens >= 0
  pdl_wait();
  pdl_launch_dependents();
  for (ItemWalker it(global_warp(), num_warps(), p.chunks_per_row); it.row < p.num_tokens; it.advance()) {
    const std::int64_t t = it.row;
    const std::int64_t first = it.chunk * p.chunk_vecs;
    const std::int64_t n = min(p.chunk_vecs, p.row_vecs - first);
    // K <= kKB (the common case): the picks' rows and weights load once per item.
    const bool one_batch = p.top_k <= kKB;
    PickBatch<kKB> batch0;
    if (one_batch) batch0.load(p, t, 0);
    Out* out_row = out + t * H;
    const int vec_end = static_cast<int>(first + n);
    for (int base = static_cast<int>(first); base < vec_end; base += kUV * kWarpSize) {
      int vec[kUV];
#pragma unroll
      for (int u = 0; u < kUV; ++u) vec[u] = base + u * kWarpSize + lane;
      alignas(16) Out prior[kUV][kV];
      if (p.accumulate) {  // issued first so that it overlaps the y loads
#pragma unroll
        for (int u = 0; u < kUV; ++u) {
          if (vec[u] < vec_end) load_vector<kOutBytes>(prior[u], out_row + vec[u] * kV);
        }
      }
      float acc[kUV][kV];
#pragma unroll
      for (int u = 0; u < kUV; ++u) {
#pragma unroll
        for (int e = 0; e < kV; ++e) acc[u][e] = 0.0f;
      }
      if (one_batch) {
        accumulate_batch<YF, kV, kKB, kUV>(p, batch0, vec, vec_end, acc);
      } else {
        for (int k0 = 0; k0 < p.top_k; k0 += kKB) {
          PickBatch<kKB> batch;
          batch.load(p, t, k0);
          accumulate_batch<YF, kV, kKB, kUV>(p, batch, vec, vec_end, acc);
        }
      }
#pragma unroll
      for (int u = 0; u < kUV; ++u) {
        if (vec[u] >= vec_end) continue;
        alignas(16) Out result[kV];
#pragma unroll
        for (int e = 0; e < kV; ++e) {
          const float a = p.accumulate ? __fadd_rn(acc[u][e], OF::to_float(prior[u][e])) : acc[u][e];
          result[e] = OF::from_float(a);
        }
        store_vector<kOutBytes>(out_row + vec[u] * kV, result);
      }
    }
  }
}

}  // namespace switchyard::cuda::permute
