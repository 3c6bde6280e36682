// Layout of a few picks (N = T*K <= kTinyMaxPicks, DESIGN.md section 3): decode-sized calls,
// where the one-block kernel (one_launch_layout_kernel.cuh) spends its time in a chain of
// block-wide phases (per-warp histograms merged over 16 warps, a BlockScan, a binary search per
// tile), each behind a barrier, for a handful of picks.
//
// Here ONE warp per block does the whole computation and the other warps only write sentinels:
//   1. before pdl_wait(): hist[0..L) = 0 (shared memory);
//   2. every thread: this block's slices of the rows and tiles get the "not a real row / tile"
//      values (N, T) and (-1, t*M); warp 0 issues the loads of the ids; __syncthreads (the real
//      values are written over the sentinels after it, so the later value is the one that
//      stays; padding rows keep the sentinel);
//   3. warp 0: loads the N <= 128 ids (up to 4 groups of 32 picks per lane), ranks each pick
//      among the earlier picks of its expert (match_key per group plus the running count in hist,
//      so hist ends as the per-expert counts), then scans the padded counts of all L experts in
//      the warp (each lane a contiguous run of ceil(L/32) experts, one shuffle scan) into
//      offs[0..L) in shared memory, writing counts, offsets and the tiles of each expert of its
//      slices on the way; then the real rows (row = offs[key] + rank) and expanded_to_permuted.
// No block barrier after step 2 and no per-tile search: a tile is written by the lane that owns
// its expert. Blocks split the writes (rows, tiles, experts, picks) as in the one-block kernel;
// each one repeats the short computation. Deterministic: no atomics at all.
//
// The ids come from a source (Src): the ids array (TinyGlobalIds below), or the rows the fused
// route + layout kernel routes in the same block (route_layout.cu). A source provides
//   Raw:              the type of one id as read;
//   after_wait(p):    called by every thread after pdl_wait() and the sentinel stores (may hold
//                     a block barrier);
//   id(p, x):         pick x's id, x < N (called by warp 0 only, after after_wait).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/launch.cuh"
#include "cuda/layout/layout_kernels.cuh"
#include "cuda/layout/one_launch_layout_kernel.cuh"

namespace switchyard::cuda::layout_detail {

constexpr int kTinyItems = 4;                   // groups of 32 picks in warp 0
constexpr int kTinyMaxPicks = 32 * kTinyItems;  // 128
constexpr int kTinyMaxLocal = 2048;             // L / 32 <= 64 experts per lane in the scan
constexpr int kTinyThreads = 256;               // the layout-only kernel

// Dynamic shared memory of the tiny layout (int32): hist[L], offs[L].
__host__ __device__ inline constexpr std::size_t tiny_smem_bytes(int L) {
  return static_cast<std::size_t>(2) * L * 4;
}

template <typename Id>
struct TinyGlobalIds {
  using Raw = Id;
  __device__ __forceinline__ void after_wait(const LayoutParams&) {}
  __device__ __forceinline__ Id id(const LayoutParams& p, int x) const {
    return static_cast<const Id*>(p.topk_ids)[x];
  }
};

// pad(c) = c rounded up to a multiple of M (a mask when M is a power of two; most experts are
// empty here, and skip the division).
__device__ __forceinline__ int tiny_pad(int c, std::uint32_t m, bool pow2) {
  if (pow2) return static_cast<int>((static_cast<std::uint32_t>(c) + m - 1) & ~(m - 1));
  return c == 0 ? 0 : padded_count32(c, m);
}

// The whole tiny layout; see the top of the file. Called by all THREADS threads of each block
// before pdl_wait(); `dyn` holds tiny_smem_bytes(L).
template <int THREADS, int KB, class Src>
__device__ __forceinline__ void tiny_layout(const LayoutParams& p, int* dyn, Src& src) {
  const int L = p.num_local;
  const int N = p.num_picks;
  const int M = p.tile_size;
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int block = static_cast<int>(blockIdx.x);
  const int blocks = static_cast<int>(gridDim.x);
  int* hist = dyn;      // [L]: running counts, then the counts
  int* offs = dyn + L;  // [L]: first row of each expert

  // 1. Shared memory only before pdl_wait (launch.cuh PDL contract).
  for (int l = tid; l < L; l += THREADS) hist[l] = 0;
  pdl_launch_dependents();  // the next kernel may be scheduled now; it waits for all of us
  pdl_wait();

  // 2. Sentinels in this block's slices of the rows and tiles.
  int r0, r1, t0, t1;
  part_range32(p.capacity_rows, block, blocks, r0, r1);
  part_range32(p.capacity_tiles, block, blocks, t0, t1);
  for (int r = r0 + tid; r < r1; r += THREADS) {
    p.permuted_to_expanded[r] = N;
    p.permuted_to_token[r] = p.num_tokens;
  }
  for (int t = t0 + tid; t < t1; t += THREADS) {
    p.tile_expert[t] = -1;
    p.tile_row_end[t] = static_cast<int>(static_cast<long long>(t) * M);
  }
  src.after_wait(p);
  using Raw = typename Src::Raw;
  Raw raw[kTinyItems];  // warp 0: loads in flight across the barrier
#pragma unroll
  for (int j = 0; j < kTinyItems; ++j) {
    const int x = j * 32 + lane;
    raw[j] = (tid < 32 && x < N) ? src.id(p, x) : Raw(-1);
  }
  __syncthreads();  // hist zeroed; the sentinels are ordered before the real values below
  if (tid >= 32) return;

  // 3a. Keys and ranks of the picks (lane owns picks j * 32 + lane).
  int dropped = 0;
  int key[kTinyItems];
  int rank[kTinyItems];
#pragma unroll
  for (int j = 0; j < kTinyItems; ++j) key[j] = local_key(static_cast<long long>(raw[j]), p, dropped);
  const unsigned lt = lanemask_lt();
#pragma unroll
  for (int j = 0; j < kTinyItems; ++j) {
    rank[j] = 0;
    if (j * 32 < N) {  // warp-uniform
      const unsigned same = match_key<KB>(key[j]);
      const int within = __popc(same & lt);
      int run = 0;
      if (key[j] < L) run = hist[key[j]];
      __syncwarp();
      if (key[j] < L && within == 0) hist[key[j]] = run + __popc(same);
      __syncwarp();
      rank[j] = run + within;
    }
  }
  dropped = __reduce_add_sync(0xffffffffu, dropped);

  // 3b. Offsets: a warp scan of the padded counts, lane owning experts [e0, e1). The lane that
  //     owns expert l writes counts[l] / offsets[l] (experts slice) and l's tiles (tile slice).
  const std::uint32_t Mu = static_cast<std::uint32_t>(M);
  const bool pow2 = (Mu & (Mu - 1)) == 0;
  const int mshift = __ffs(M) - 1;
  const auto div_m = [&](int v) {  // v / M for v >= 0
    return pow2 ? v >> mshift : static_cast<int>(static_cast<std::uint32_t>(v) / Mu);
  };
  const int per = (L + 31) >> 5;
  const int e0 = min(L, lane * per);
  const int e1 = min(L, e0 + per);
  int sum = 0;
  for (int l = e0; l < e1; ++l) sum += tiny_pad(hist[l], Mu, pow2);
  int incl = sum;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += v;
  }
  const int total = __shfl_sync(0xffffffffu, incl, 31);
  int l0, l1;
  part_range32(L, block, blocks, l0, l1);
  int row = incl - sum;
  for (int l = e0; l < e1; ++l) {
    const int c = hist[l];
    const int padded = tiny_pad(c, Mu, pow2);
    offs[l] = row;
    if (l >= l0 && l < l1) {
      p.counts[l] = c;
      p.offsets[l] = row;
    }
    // Tiles [row / M, (row + padded) / M) hold l; row and padded are multiples of M.
    if (c > 0) {
      const int ta = max(t0, div_m(row));
      const int tb = min(t1, div_m(row + padded));
      for (int t = ta; t < tb; ++t) {
        p.tile_expert[t] = l;
        p.tile_row_end[t] = static_cast<int>(
            min(static_cast<long long>(t) * M + M, static_cast<long long>(row) + c));
      }
    }
    row += padded;
  }
  if (block == 0 && lane == 0) {
    p.offsets[L] = total;
    p.totals[0] = total;
    p.totals[1] = div_m(total);
    p.totals[2] = dropped;
  }
  __syncwarp();  // offs complete

  // 3c. The real rows (those in this block's row slice) and expanded_to_permuted (its x slice).
  int x0, x1;
  part_range32(N, block, blocks, x0, x1);
  const int K = p.top_k;
#pragma unroll
  for (int j = 0; j < kTinyItems; ++j) {
    const int x = j * 32 + lane;
    if (x < N) {
      int r = -1;
      if (key[j] < L) {
        r = offs[key[j]] + rank[j];
        if (r >= r0 && r < r1) {
          p.permuted_to_expanded[r] = x;
          p.permuted_to_token[r] = x / K;
        }
      }
      if (x >= x0 && x < x1) p.expanded_to_permuted[x] = r;
    }
  }
}

template <int KB, typename Id>
__global__ void __launch_bounds__(kTinyThreads) tiny_layout_kernel(const LayoutParams p) {
  extern __shared__ __align__(16) int tiny_dyn[];
  TinyGlobalIds<Id> src;
  tiny_layout<kTinyThreads, KB>(p, tiny_dyn, src);
}

}  // namespace switchyard::cuda::layout_detail
