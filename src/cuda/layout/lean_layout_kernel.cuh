// Lean small/mid-T layout (DESIGN.md section 3): a stable counting sort of N <= 512 * ITEMS picks
// in ONE block, with no block-wide sort and no per-row search.
//
//  1. Each of the 16 warps takes a contiguous run of 32-pick groups in x order. Per group,
//     match_key (one ballot per key bit) gives the lanes with the same key (local expert, or L = not placed);
//     a pick's position in its warp's run of its expert is hist[w][key] (the warp's earlier picks of that
//     expert) + its rank among the group's lanes of that key (lower lanes first, so ascending x); the group
//     leader then adds the group's count to hist[w][key]. Only warp w touches row w of hist, so no atomics:
//     the result does not depend on timing.
//  2. Per expert l (threads over l): counts[l] = sum over w of hist[w][l], in w order, turning
//     hist[w][l] into its exclusive prefix over w; one BlockScan of pad(counts) gives offsets;
//     hist[w][l] += offsets[l], so a pick's row is hist[w][key] + its position.
//  3. Writes, without a single search: the picks' rows (and expanded_to_permuted, coalesced by x);
//     per expert (a warp each) its padding rows [offsets[l] + counts[l], offsets[l+1]) and its
//     tiles; the tail rows [padded_total, capacity) and tiles [num_tiles, capacity)
//     (fill_padding_and_tiles in layout_kernels.cuh).
//
// Several blocks may run the same computation (it is short; they run in parallel): block g then
// writes only slice g of the picks, of the experts (their padding rows, tiles, counts, offsets)
// and of the tail, so every output element is written exactly once and no block waits for another.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "cuda/common/launch.cuh"
#include "cuda/layout/layout_kernels.cuh"

namespace switchyard::cuda::layout_detail {

constexpr int kLeanThreads = 512;
constexpr int kLeanWarps = kLeanThreads / 32;
static_assert(kLeanWarps % 4 == 0, "the histogram is zeroed with 16-byte stores");
// Largest dynamic shared memory of the lean path (hist[16][L] + offs[L+1] + ends[L]); larger L
// takes the sorting path. 2048 local experts need 144 KB.
constexpr std::size_t kLeanMaxSmem = 160 * 1024;

// Dynamic shared memory of a lean block: hist[kLeanWarps][L], offs[L + 1], ends[L] (int32).
__host__ __device__ inline constexpr std::size_t lean_smem_bytes(int L) {
  return (static_cast<std::size_t>(kLeanWarps + 2) * L + 1) * 4;
}

struct LeanShared {
  cub::BlockScan<int, kLeanThreads>::TempStorage scan;
  int dropped;
};

// Raw id of pick x from global memory.
template <typename Id>
struct GlobalIdSource {
  const Id* ids;
  __device__ __forceinline__ long long operator()(int x) const { return static_cast<long long>(ids[x]); }
};

// Raw id of pick x from shared memory (the fused route_and_layout kernel).
struct SharedIdSource {
  const int* ids;
  __device__ __forceinline__ long long operator()(int x) const { return ids[x]; }
};

// The lanes of the warp whose key equals this lane's, for keys below 2^bits: one ballot per key
// bit (the multisplit of CUB's MatchAny<LABEL_BITS>, with a runtime bit count) instead of
// __match_any_sync, whose cost grows with the number of distinct keys among the 32 lanes.
__device__ __forceinline__ unsigned match_key(int key, int bits) {
  unsigned same = 0xffffffffu;
  for (int b = 0; b < bits; ++b) {
    const bool one = ((key >> b) & 1) != 0;
    const unsigned ones = __ballot_sync(0xffffffffu, one);
    same &= one ? ones : ~ones;
  }
  return same;
}

__device__ __forceinline__ unsigned lanemask_lt() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

// The whole layout of N <= kLeanThreads * ITEMS picks; block blockIdx.x writes slice
// blockIdx.x of gridDim.x. Called by all kLeanThreads threads, after pdl_wait (and whatever makes
// the ids readable). `dyn` holds lean_smem_bytes(L).
template <int ITEMS, typename Source>
__device__ __forceinline__ void lean_layout_block(const LayoutParams& p, Source source, LeanShared& sh,
                                                  int* dyn) {
  const int L = p.num_local;
  const int N = p.num_picks;
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int block = static_cast<int>(blockIdx.x);
  const int blocks = static_cast<int>(gridDim.x);
  int* hist = dyn;                   // [kLeanWarps][L]
  int* offs = dyn + kLeanWarps * L;  // [L + 1]
  int* ends = offs + L + 1;          // [L]; counts until the scan

  // Groups of 32 picks: warp w owns groups [w * per_warp, (w + 1) * per_warp).
  const int groups = (N + 31) >> 5;
  const int per_warp = (groups + kLeanWarps - 1) / kLeanWarps;  // <= ITEMS
  const int group0 = warp * per_warp;

  for (int i = tid; i < kLeanWarps / 4 * L; i += kLeanThreads)
    reinterpret_cast<int4*>(hist)[i] = int4{0, 0, 0, 0};
  if (tid == 0) sh.dropped = 0;
  int dropped = 0;
  int packed[ITEMS];  // key << 16 | position of the pick in its warp's run of its expert
  // Id loads in batches of kBatch independent loads in flight together (all of them at once would
  // take two registers per int64 id on top of `packed`).
  constexpr int kBatch = ITEMS <= 32 ? ITEMS : 16;
#pragma unroll
  for (int i0 = 0; i0 < ITEMS; i0 += kBatch) {
    long long raw[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int x = (group0 + i0 + j) * 32 + lane;
      raw[j] = (i0 + j < per_warp && x < N) ? source(x) : -1;
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) packed[i0 + j] = local_key(raw[j], p, dropped) << 16;
  }
  __syncthreads();  // hist zeroed

  // 1. Per-warp ranks.
  int* my_hist = hist + warp * L;
  const unsigned lt = lanemask_lt();
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    if (i < per_warp) {  // warp-uniform
      const int key = packed[i] >> 16;
      const unsigned same = match_key(key, p.key_bits);
      const int rank = __popc(same & lt);
      int base = 0;
      if (key < L) base = my_hist[key];
      __syncwarp();
      if (key < L && rank == 0) my_hist[key] = base + __popc(same);
      __syncwarp();
      packed[i] |= base + rank;
    }
  }
  dropped = __reduce_add_sync(0xffffffffu, dropped);
  if (lane == 0 && dropped != 0) atomicAdd(&sh.dropped, dropped);  // a sum: order does not matter
  __syncthreads();                                                 // hist complete

  // 2. Counts, offsets. Thread t owns experts [e_begin, e_end), contiguous.
  int l0, l1;  // this block's slice of experts
  part_range(L, block, blocks, l0, l1);
  const int per_thread = (L + kLeanThreads - 1) / kLeanThreads;
  const int e_begin = min(L, tid * per_thread);
  const int e_end = min(L, e_begin + per_thread);
  const std::uint32_t M = static_cast<std::uint32_t>(p.tile_size);
  int run_sum = 0;
  for (int l = e_begin; l < e_end; ++l) {
    // All loads before any store (the compiler cannot tell the rows apart: L may be 0 for it).
    int v[kLeanWarps];
#pragma unroll
    for (int w = 0; w < kLeanWarps; ++w) v[w] = hist[w * L + l];
    int c = 0;
#pragma unroll
    for (int w = 0; w < kLeanWarps; ++w) {
      hist[w * L + l] = c;
      c += v[w];
    }
    ends[l] = c;
    run_sum += static_cast<int>(padded_count(static_cast<std::uint32_t>(c), M));
  }
  int prefix, padded_total;
  cub::BlockScan<int, kLeanThreads>(sh.scan).ExclusiveSum(run_sum, prefix, padded_total);
  for (int l = e_begin; l < e_end; ++l) {
    const int c = ends[l];
    offs[l] = prefix;
    ends[l] = prefix + c;
    int v[kLeanWarps];
#pragma unroll
    for (int w = 0; w < kLeanWarps; ++w) v[w] = hist[w * L + l];
#pragma unroll
    for (int w = 0; w < kLeanWarps; ++w) hist[w * L + l] = v[w] + prefix;
    if (l >= l0 && l < l1) {
      p.counts[l] = c;
      p.offsets[l] = prefix;
    }
    prefix += static_cast<int>(padded_count(static_cast<std::uint32_t>(c), M));
  }
  if (tid == 0) {
    offs[L] = padded_total;
    if (block == 0) {
      p.offsets[L] = padded_total;
      p.totals[0] = padded_total;
      p.totals[1] = padded_total / p.tile_size;
      p.totals[2] = sh.dropped;
    }
  }
  __syncthreads();  // offs, ends, hist (now row bases) complete

  // 3a. The picks of this block's x slice.
  int x_begin, x_end;
  part_range(N, block, blocks, x_begin, x_end);
  const int K = p.top_k;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int x = (group0 + i) * 32 + lane;
    if (i < per_warp && x >= x_begin && x < x_end) {
      const int key = packed[i] >> 16;
      int row = -1;
      if (key < L) {
        row = my_hist[key] + (packed[i] & 0xffff);
        p.permuted_to_expanded[row] = x;
        p.permuted_to_token[row] = x / K;
      }
      p.expanded_to_permuted[x] = row;
    }
  }

  // 3b. Padding rows and tiles of this block's experts; its part of the tail.
  fill_padding_and_tiles<kLeanThreads>(p, offs, ends, block, blocks);
}

template <int ITEMS, typename Id>
__global__ void __launch_bounds__(kLeanThreads, 1) lean_layout_kernel(const LayoutParams p) {
  __shared__ LeanShared sh;
  extern __shared__ __align__(16) int lean_dyn[];
  pdl_launch_dependents();  // the next kernel may be scheduled now; it waits for all of us
  pdl_wait();
  lean_layout_block<ITEMS>(p, GlobalIdSource<Id>{static_cast<const Id*>(p.topk_ids)}, sh, lean_dyn);
}

}  // namespace switchyard::cuda::layout_detail
