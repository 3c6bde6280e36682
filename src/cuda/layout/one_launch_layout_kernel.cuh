// One-launch layout for small and medium N = T*K (docs/design.md section 3): a stable counting sort
// with ranks from per-expert token bitmaps (blocks of more than 512 picks whose bitmaps fit) or
// from per-warp ballots (match_key below; the other kernels, and the bitmaps' fallback), shaped so that the
// critical path after pdl_wait() is short: ids -> ranks -> counts -> one scan -> writes, with no per-expert
// fill pass behind the scan.
//
//  * One-block form: rows and tiles that are not real rows/tiles are written FIRST, right after
//    pdl_wait(), before anything is known: block g fills its slice [r0, r1) of the rows with the
//    sentinels (T*K, T) and its slice [t0, t1) of the tiles with the past-the-end values (-1, t*M),
//    while its id loads are in flight. The real rows and tiles are then written over them, after a
//    __syncthreads, so the later value is the one that stays; padding rows keep the sentinel.
//    The cluster form writes each row once instead, after the scan: the padding rows by expert
//    slices, the rows past the total by row slices. (Filling
//    first, its blocks double-wrote every real row and the cluster barrier's release waited for
//    the fill stores to drain.)
//  * The scan is over the experts' tile counts; the thread of an expert then writes its tiles
//    itself (a long run of them goes to the whole block after the next barrier), so no tile
//    searches for its expert. Slice bounds and divisions by M and K use values the launcher
//    computed (LayoutParams): each division by a run-time divisor was ~20 dependent instructions
//    on the critical path.
//
// Two forms of the same code:
//  * one_block_layout_kernel (N <= a few thousand): every block ranks ALL picks (short and
//    parallel) and writes only its slices: rows [r0, r1) (sentinels, then the real rows that fall
//    there), tiles, picks x (expanded_to_permuted) and experts (counts, offsets). No block waits
//    for another.
//  * cluster_layout_kernel<CB> (medium N): ONE thread-block cluster of CB = 8 or 16 blocks; block b
//    ranks chunk b of the picks (contiguous in x). Each block stores its per-expert counts into
//    the workspace; after a cluster barrier every block loads all of them (before[l] = picks of l
//    in earlier chunks, counts[l] = the sum), scans the padded counts itself, and writes the rows
//    of its own picks. Those rows are staged in shared
//    memory in expert order first (the block's picks of expert l fill one contiguous run of rows),
//    so that the global stores of consecutive threads hit consecutive rows: written straight from
//    the ranking, every pick was its own uncoalesced store, which made the cluster form slower
//    than the 3-launch pipeline past ~12k picks. (The cluster is there for its barrier: the counts
//    meet in the workspace, not in distributed shared memory, which was slower.)
//    The grid form is the same kernel with CB = 32, 64 or 128 blocks in a cooperative launch,
//    meeting at cooperative_groups' grid barrier instead of the cluster's: more SMs share the
//    ranking and the row stores (docs/decisions/layout-path-selection.md).
//
// All forms are latency / issue bound (E=256 K=8 M=128 on an H200: one-block 2.0 us at T = 1,
// 16-block cluster 5.0 us at T = 1024); docs/decisions/layout-one-launch-kernel.md has the
// measurements behind the choices below.
//
// Deterministic: the atomics add up the dropped count (a sum, order-free) and OR bits into the
// bitmaps (order-free); ballot ranks come from ballots within 32 picks (match_key) and per-warp
// running counts owned by one warp.
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "cuda/common/launch.cuh"
#include "cuda/layout/layout_kernels.cuh"

namespace switchyard::cuda::layout_detail {

// The lanes of the warp whose key equals this lane's, for keys below 2^KB: one ballot per key
// bit (the multisplit of CUB's MatchAny<LABEL_BITS>) instead of __match_any_sync, whose cost
// grows with the number of distinct keys among the 32 lanes. KB is a compile-time bound (10 or
// 14, see key_bits_bound) so that the loop unrolls with immediate bit masks; bits past the key's
// width are 0 in every lane and leave the mask unchanged.
template <int KB>
__device__ __forceinline__ unsigned match_key(int key) {
  unsigned same = 0xffffffffu;
#pragma unroll
  for (int b = 0; b < KB; ++b) {
    const bool one = (key & (1 << b)) != 0;
    const unsigned ones = __ballot_sync(0xffffffffu, one);
    same &= one ? ones : ~ones;
  }
  return same;
}

// The compile-time bit bound for keys 0..L (L <= kMaxLocalExperts = 8192 < 2^14).
constexpr int kKeyBitsSmall = 10;  // L < 1024
constexpr int kKeyBitsLarge = 14;
inline constexpr int key_bits_bound(int key_bits) {
  return key_bits <= kKeyBitsSmall ? kKeyBitsSmall : kKeyBitsLarge;
}

__device__ __forceinline__ unsigned lanemask_lt() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

constexpr int kOneThreads = 512;  // both forms (1024-thread cluster blocks spilled: layout.cu)
constexpr int kOneWarps = kOneThreads / 32;
static_assert(kOneWarps % 4 == 0, "the histogram is zeroed with 16-byte stores");
// Cluster sizes: 8 is portable (always schedulable on sm_90); 16 needs the non-portable opt-in
// and a GPC with 16 free SMs (H100 / H200 have them; the launcher checks).
constexpr int kClusterBlocksPortable = 8;
// Past 16 blocks (the largest cluster) the one-launch kernel runs as a cooperative grid of CB
// blocks (all resident at once) that meet at cooperative_groups' grid barrier: the grid form, of
// 32, 64 or 128 blocks (layout.cu). (Its barrier word is the driver's, initialised for every launch: a
// counter in the caller's workspace could hold anything, and the bit-31 flip scheme of a grid
// barrier then hung when carries from the low bits flipped bit 31 twice.)
constexpr int kMaxClusterBlocks = 16;
constexpr std::size_t kOneMaxSmem = 160 * 1024;

// LayoutParams::rank_words is a multiple of this (the per-expert pass reads whole batches).
constexpr int kRankWordsBatch = 4;

// Zeroes words [0, n) of 16-byte-aligned shared memory, to whole 16 bytes (the ranking region is
// sized for that: rank_region_words). Called by all kOneThreads threads.
__device__ __forceinline__ void zero_words(int* a, int n) {
  for (int i = static_cast<int>(threadIdx.x); i < (n + 3) >> 2; i += kOneThreads)
    reinterpret_cast<int4*>(a)[i] = int4{0, 0, 0, 0};
}

// Picks ranked by each block of a CB-block cluster: ceil(N / CB) rounded up to whole warps' groups.
__host__ __device__ inline constexpr int cluster_chunk(int N, int CB) {
  return ((N + CB - 1) / CB + 31) / 32 * 32;
}

// The ranking region (int32 words): the ballot ranking's hist[kOneWarps][L], or the bitmap
// ranking's bits[words][L] and word_base[words][L] in the same memory (a block that finds two
// picks of one expert in one token goes from the bitmaps to the ballots), to whole 16 bytes.
__host__ __device__ inline constexpr std::size_t rank_region_words(int L, int words) {
  return (static_cast<std::size_t>(kOneWarps > 2 * words ? kOneWarps : 2 * words) * L + 3) / 4 * 4;
}

// Local experts up to which the one-block form scans beside the per-expert pass (one_block_offsets:
// one expert per thread of half the block).
constexpr int kSplitMaxLocal = kOneThreads / 2;

// Dynamic shared memory (int32): the ranking region, offs[L + 1], ends[L], long_runs[L], and for
// the one-block form with L <= kSplitMaxLocal block_counts[L]; the cluster form puts base[L] (row
// of the block's first pick of l) and block_counts[L] after long_runs and adds lstart[L] (the
// block's first staged pick of l) and the staging arrays
// stage_x[chunk], stage_row[chunk]. `chunk` is cluster_chunk(N, CB) (0 for the one-block form),
// `words` is LayoutParams::rank_words.
__host__ __device__ inline constexpr std::size_t one_launch_smem_bytes(int L, bool cluster, int chunk = 0,
                                                                       int words = 0) {
  return (rank_region_words(L, words) +
          static_cast<std::size_t>(cluster               ? 6
                                   : L <= kSplitMaxLocal ? 4
                                                         : 3) *
              L +
          1 + (cluster ? 2 * static_cast<std::size_t>(chunk) : 0)) *
         4;
}

// Slice `part` of n items in parts of `per` (the launcher's ceil(n / parts), LayoutParams): no
// division on the device, where it sat on the critical path. n < 2^31 and per * parts < n + parts,
// so the products fit in 32 bits.
__device__ __forceinline__ void slice(int n, int part, int per, int& begin, int& end) {
  const std::uint32_t b = static_cast<std::uint32_t>(per) * static_cast<std::uint32_t>(part);
  begin = static_cast<int>(min(static_cast<std::uint32_t>(n), b));
  end = static_cast<int>(min(static_cast<std::uint32_t>(n), b + static_cast<std::uint32_t>(per)));
}

// Block scans by warp scans (BLOCK_SCAN_WARP_SCANS): fewer dependent steps than CUB's default
// raking scan, and these kernels are latency-bound.
using OneScan = cub::BlockScan<int, kOneThreads, cub::BLOCK_SCAN_WARP_SCANS>;
using OneScan64 = cub::BlockScan<long long, kOneThreads, cub::BLOCK_SCAN_WARP_SCANS>;
// one_block_offsets: the first kScanWarps warps scan (one expert a thread), the others compute the
// per-expert prefixes.
constexpr int kScanThreads = kSplitMaxLocal;
constexpr int kScanWarps = kScanThreads / 32;

struct OneShared {
  union {
    OneScan::TempStorage scan;
    OneScan64::TempStorage scan64;  // cluster form: two sums at once
  };
  int dropped;
  unsigned param_sink;               // warm_params
  int duplicates;                    // bitmap ranking: some token has two picks of one local expert
  int num_long_runs;                 // experts whose tiles in this block's slice are left to the whole block
  unsigned long long scan_barrier;   // one_block_offsets: an mbarrier of the kScanThreads scan threads
  int scan_warp_totals[kScanWarps];  // one_block_offsets: the scan warps' tile sums
};

// An expert's tiles in a block's tile slice are written by the thread that scans the expert when
// there are at most this many (the common case: a run longer than this is a heavily loaded expert
// with a small M), else by the whole block after the next barrier.
constexpr int kTilesPerThread = 4;

// Ballot ranking, part 1 (match_key): packed[j] = key << 16 for the thread's pick j (key = its
// local expert, L: not placed) gets the pick's rank among its warp's picks of that expert in its
// low 16 bits (one register per pick up to the row writes), with warp w's groups of 32 picks
// [group0, group0 + per_warp) of the chunk. Per-warp counts hist[w][l] (only warp w touches them:
// no atomics, no timing dependence; zeroed before): the ballots of all groups first (independent
// of each other), then the chain through the warp's running counts, which only the groups' order
// serializes. counts != nullptr: each group's leader of a key also adds the group's picks of it to
// counts[key] (a shared-memory sum: order-free), the block's counts without a per-expert pass.
template <int ITEMS, bool kCluster, int KB>
__device__ __forceinline__ void warp_ballot_ranks(int* packed, int* my_hist, int L, int per_warp, int group0,
                                                  int groups, int* counts = nullptr) {
  const unsigned lt = lanemask_lt();
  unsigned same[ITEMS];
  // One-block form, N <= 512 (ITEMS = 1): the last warps own no picks (their groups all lie past
  // the chunk), and they skip the ranking instead of taking issue slots from the warps with picks
  // for ballots over dummies. With ITEMS > 1 the same warp-dependent branch cost more than it saved,
  // so it is compiled out there and in the cluster form (docs/decisions/layout-one-launch-kernel.md).
  const bool has_picks = ITEMS > 1 || kCluster || group0 < groups;  // warp-uniform
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) same[j] = j < per_warp && has_picks ? match_key<KB>(packed[j] >> 16) : 0u;
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) {
    if (!has_picks) break;  // warp-uniform
    if (j < per_warp) {     // warp-uniform
      const int key = packed[j] >> 16;
      const int rank = __popc(same[j] & lt);
      int run = 0;
      if (key < L) run = my_hist[key];
      __syncwarp();
      if (key < L && rank == 0) {
        my_hist[key] = run + __popc(same[j]);
        if (counts != nullptr) atomicAdd(&counts[key], __popc(same[j]));
      }
      __syncwarp();
      packed[j] |= run + rank;
    }
  }
}

// Ballot ranking, part 2, per expert l of the thread ([e_begin, e_end)): hist[w][l] -> its
// exclusive prefix over the warps w; block_counts[l] = the block's count of l (unless nullptr).
__device__ __forceinline__ void warp_prefix(int* hist, int* block_counts, int L, int e_begin, int e_end) {
  for (int l = e_begin; l < e_end; ++l) {
    int v[kOneWarps];  // all loads before any store (the compiler cannot tell the rows apart)
#pragma unroll
    for (int w = 0; w < kOneWarps; ++w) v[w] = hist[w * L + l];
    int c = 0;
#pragma unroll
    for (int w = 0; w < kOneWarps; ++w) {
      hist[w * L + l] = c;
      c += v[w];
    }
    if (block_counts != nullptr) block_counts[l] = c;
  }
}

// Bitmap ranking, part 2, per expert l of the thread ([e_begin, e_end)): word_base[w][l] = the set
// bits of l's words before w; block_counts[l] = the block's count of l (unless nullptr).
__device__ __forceinline__ void bitmap_prefix(const unsigned* bits, int* word_base, int* block_counts, int L,
                                              int W, int e_begin, int e_end) {
  for (int l = e_begin; l < e_end; ++l) {
    int c = 0;
    // W is a multiple of kRankWordsBatch: whole batches, loads before stores (the compiler cannot
    // tell the arrays apart), no guards (guarded, this phase took ~1550 cycles at W = 8).
    for (int w0 = 0; w0 < W; w0 += kRankWordsBatch) {
      unsigned v[kRankWordsBatch];
#pragma unroll
      for (int i = 0; i < kRankWordsBatch; ++i) v[i] = bits[(w0 + i) * L + l];
#pragma unroll
      for (int i = 0; i < kRankWordsBatch; ++i) {
        word_base[(w0 + i) * L + l] = c;
        c += __popc(v[i]);
      }
    }
    if (block_counts != nullptr) block_counts[l] = c;
  }
}

template <int ITEMS>
struct PickInts {
  int v[ITEMS];
};

// The ballot ranking whole, for the blocks of a bitmap-ranking kernel that meet a duplicate (see
// one_launch_layout): returns the rank of each of the thread's picks among the block's picks of
// its expert (0 for picks not placed) and writes block_counts[l] for the thread's experts. Called
// by all kOneThreads threads, with the ranking region free. Not inlined, and its arguments and
// result by value (no local memory), to keep the bitmap path short: inlined, it made the bitmap
// kernels ~0.15 us slower at every T though the bitmap path ran the same instructions.
template <int ITEMS, int KB>
__device__ __noinline__ PickInts<ITEMS> rank_by_ballots(const PickInts<ITEMS> keys, int* hist,
                                                        int* block_counts, int L, int per_warp, int groups) {
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid >> 5;
  zero_words(hist, kOneWarps * L);
  __syncthreads();
  int* my_hist = hist + warp * L;
  int packed[ITEMS];
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) packed[j] = keys.v[j] << 16;
  warp_ballot_ranks<ITEMS, false, KB>(packed, my_hist, L, per_warp, warp * per_warp, groups);
  __syncthreads();  // hist complete
  const int per_thread = (L + kOneThreads - 1) / kOneThreads;
  const int e_begin = min(L, tid * per_thread);
  warp_prefix(hist, block_counts, L, e_begin, min(L, e_begin + per_thread));
  __syncthreads();  // prefixes complete
  PickInts<ITEMS> within;
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) within.v[j] = keys.v[j] < L ? my_hist[keys.v[j]] + (packed[j] & 0xffff) : 0;
  return within;
}

// Step 3 for one expert l, once the tiles before it are known: its first row (offs) and the end of
// its real rows (ends), its count and offset if l is in this block's expert slice [l0, l1), and its
// tiles in this block's tile slice [t0, t1) (a run of more than kTilesPerThread goes to long_runs, for
// the whole block after the next barrier). Shared by one_block_offsets and the block-wide step 3.
__device__ __forceinline__ void place_expert(const LayoutParams& p, OneShared& sh, int l, int count,
                                             int tile_prefix, int tiles, int l0, int l1, int t0, int t1,
                                             int* offs, int* ends, int* long_runs) {
  const int M = p.tile_size;
  const int row0 = tile_prefix * M;
  const int row_end = row0 + count;
  offs[l] = row0;
  ends[l] = row_end;
  if (l >= l0 && l < l1) {
    p.counts[l] = count;
    p.offsets[l] = row0;
  }
  const int a = max(tile_prefix, t0);
  const int b = min(tile_prefix + tiles, t1);
  if (b - a > kTilesPerThread) {
    long_runs[atomicAdd(&sh.num_long_runs, 1)] = l;  // list order does not reach the output
  } else {
    for (int t = a; t < b; ++t) {
      p.tile_expert[t] = l;
      p.tile_row_end[t] = min((t + 1) * M, row_end);  // (t + 1) * M <= padded_total
    }
  }
}

// The end of step 3, by thread 0 once the scan's total is known: offs[L] = padded_total, and block
// 0's offsets[L] and totals (totals[2], the dropped count, only where `dropped`).
__device__ __forceinline__ void place_totals(const LayoutParams& p, const OneShared& sh, int block, int L,
                                             int padded_total, int num_tiles, int* offs, bool dropped) {
  offs[L] = padded_total;
  if (block == 0) {
    p.offsets[L] = padded_total;
    p.totals[0] = padded_total;
    p.totals[1] = num_tiles;
    if (dropped) p.totals[2] = sh.dropped;
  }
}

// Steps 2 and 3 of the one-block form for L <= kScanThreads (kSplit below), after the ranking
// barrier, with the block's counts already in block_counts[l] (shared-memory sums during the
// ranking). Thread l < kScanThreads owns expert l: a warp scan of its tile count, the warps' sums
// through shared memory behind an mbarrier of the kScanThreads scan threads, then it places its
// expert (offs, ends, counts and offsets, tiles, as in step 3). Meanwhile the other kScanWarps
// warps compute the per-expert prefixes that only the row writes need: word_base (bitmaps,
// by_bits) or the per-warp prefixes of the ballots' hist (kBallots). The caller's next
// __syncthreads orders both before the row writes. Faster than the block-wide form, whose scan
// waits for the per-expert pass and then for cub::BlockScan's barrier (E=256 K=8 T = 128: 2.36 us
// against 2.65; docs/decisions/layout-one-launch-kernel.md).
template <bool kBallots>
__device__ __forceinline__ void one_block_offsets(const LayoutParams& p, OneShared& sh, int block,
                                                  bool by_bits, const unsigned* bits, int* word_base, int W,
                                                  int* hist, const int* block_counts, int* offs, int* ends,
                                                  int* long_runs, int t0, int t1) {
  const int L = p.num_local;
  const int M = p.tile_size;
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  if (tid >= kScanThreads) {
    const int l = min(L, tid - kScanThreads);
    if constexpr (kBallots) {
      warp_prefix(hist, nullptr, L, l, min(L, l + 1));
    } else if (by_bits) {
      bitmap_prefix(bits, word_base, nullptr, L, W, l, min(L, l + 1));
    }
    return;
  }
  const int mine = tid < L ? static_cast<int>(tiles_of(static_cast<std::uint32_t>(block_counts[tid]), p)) : 0;
  int incl = mine;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int t = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += t;
  }
  if (lane == 31) sh.scan_warp_totals[warp] = incl;
  // The scan threads meet at an mbarrier (arrive: release; the wait: acquire), not at a named
  // barrier (bar.sync 1, 256), which compute-sanitizer racecheck did not treat as ordering these
  // stores before the row phase.
  const auto bar = static_cast<unsigned>(__cvta_generic_to_shared(&sh.scan_barrier));
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
  for (unsigned done = 0; done == 0;) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(bar)
        : "memory");
  }
  int before = 0;  // tiles of the experts before this warp's 32
  int num_tiles = 0;
#pragma unroll
  for (int w = 0; w < kScanWarps; ++w) {
    const int v = sh.scan_warp_totals[w];
    before += w < warp ? v : 0;
    num_tiles += v;
  }
  if (tid < L) {
    int l0, l1;  // this block's slice of experts (counts, offsets)
    slice(L, block, p.locals_per_block, l0, l1);
    place_expert(p, sh, tid, block_counts[tid], before + incl - mine, mine, l0, l1, t0, t1, offs, ends,
                 long_runs);
  }
  if (tid == 0) {
    const int padded_total = num_tiles * M;  // < 2^31: the max_permuted_rows bound
    place_totals(p, sh, block, L, padded_total, num_tiles, offs, /*dropped=*/true);
  }
}

// The whole layout; see the top of this file. Called by all kOneThreads threads of each block,
// before pdl_wait(). CB = 0: the one-block form; CB > 0: the cluster form, gridDim.x == CB (one
// cluster of CB <= kMaxClusterBlocks blocks, or the grid form's cooperative grid of CB blocks).
template <int ITEMS, int CB, int KB, typename Id, bool kBitmaps, bool kSplit = false>
__device__ __forceinline__ void one_launch_layout(const LayoutParams& p, OneShared& sh, int* dyn) {
  constexpr bool kCluster = CB > 0;
  const int L = p.num_local;
  const int N = p.num_picks;
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int block = static_cast<int>(blockIdx.x);
  // Bitmap ranking (see 1. below) where the launcher chose it (rank_words > 0): blocks of more than
  // 512 picks whose bitmaps fit.
  constexpr bool kBits = kBitmaps && ITEMS > 1;
  const int W = kBits ? p.rank_words : 0;
  int* hist = dyn;                                                          // [kOneWarps][L] (ballot ranking)
  unsigned* bits = reinterpret_cast<unsigned*>(dyn);                        // [W][L] (bitmap ranking)
  int* word_base = dyn + W * L;                                             // [W][L] (bitmap ranking)
  int* offs = dyn + rank_region_words(L, W);                                // [L + 1]
  int* ends = offs + L + 1;                                                 // [L]
  int* long_runs = ends + L;                                                // [L]
  int* base = kCluster ? long_runs + L : offs;                              // [L]
  int* block_counts = kCluster ? base + L : kSplit ? long_runs + L : ends;  // [L]
  int* lstart = block_counts + L;                                           // [L] (cluster form only)
  int* stage_x = lstart + L;                                                // [chunk] (cluster form only)

  // Shared memory only before pdl_wait (PDL contract): this overlaps the previous kernel's tail.
  zero_words(dyn, kBits ? W * L : kOneWarps * L);  // bitmaps or hist (rank_by_ballots zeroes its own)
  // kSplit (the one-block form with L <= kScanThreads, the launcher's choice): the block's counts are
  // summed during the ranking (tally) and steps 2 and 3 run as one_block_offsets. A compile-time
  // choice: code a kernel carries but does not run costs ~0.15 us a call (rank_by_ballots).
  static_assert(!(kSplit && kCluster), "kSplit: the one-block form only");
  int* tally = kSplit ? block_counts : nullptr;
  if constexpr (kSplit) {
    for (int l = tid; l < L; l += kOneThreads) block_counts[l] = 0;
    if (tid == 0) {  // its first use follows the ranking's __syncthreads
      const auto bar = static_cast<unsigned>(__cvta_generic_to_shared(&sh.scan_barrier));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "n"(kScanThreads) : "memory");
    }
  }
  // The picks this block ranks: all of them, or chunk `block` (a multiple of 32 picks long).
  int c0 = 0;
  int c1 = N;
  int chunk = 0;
  if constexpr (kCluster) {
    chunk = cluster_chunk(N, CB);
    c0 = min(N, block * chunk);
    c1 = min(N, c0 + chunk);
  }
  if (tid == 0) {
    // The parameters into the constant cache (launch.cuh): 1-2% faster at 1024-16384 rows
    // (docs/decisions/warm-params.md).
    warm_params(p, &sh.param_sink);
    // The ids this block ranks into L2 (launch.cuh's prefetch_l2).
    prefetch_l2(static_cast<const Id*>(p.topk_ids) + c0,
                static_cast<unsigned long long>(c1 - c0) * sizeof(Id));
    sh.dropped = 0;
    if (kBits) sh.duplicates = 0;
    sh.num_long_runs = 0;
  }
  pdl_launch_dependents();  // the next kernel may be scheduled now; it waits for all of us
  pdl_wait();

  int* stage_row = stage_x + chunk;  // [chunk] (cluster form only)
  // t = x / K as a multiply-high (token_magic): exact for x * K < 2^32, true here (x < N <= 65536
  // and K <= N).
  const auto token_of = [&](int x) {
    return p.token_magic == 0 ? x : static_cast<int>(__umulhi(static_cast<std::uint32_t>(x), p.token_magic));
  };
  const int first_token = token_of(c0);  // bitmap ranking: bit u of word w <-> token first + 32 w + u
  // Groups of 32 picks: warp w owns groups [w * per_warp, (w + 1) * per_warp) of the chunk.
  const int groups = (c1 - c0 + 31) >> 5;
  const int per_warp = (groups + kOneWarps - 1) / kOneWarps;  // <= ITEMS
  const int group0 = warp * per_warp;
  const Id* ids = static_cast<const Id*>(p.topk_ids);
  Id raw[ITEMS];
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) {
    const int x = c0 + (group0 + j) * 32 + lane;
    raw[j] = (j < per_warp && x < c1) ? ids[x] : Id(-1);
  }

  // The one-block form, while the ids load: this block's slices of the rows and tiles get the
  // values of "not a real row / tile"; the real ones are written over them after a barrier. (The
  // cluster form writes every row once, after the scan: see 4c.)
  const int pad_expanded = N;
  const int pad_token = p.num_tokens;
  const int M = p.tile_size;
  int r0 = 0, r1 = 0, t0, t1;  // rows [r0, r1): the one-block form's slice (the cluster form has none)
  if constexpr (!kCluster) slice(p.capacity_rows, block, p.rows_per_block, r0, r1);
  slice(p.capacity_tiles, block, p.tiles_per_block, t0, t1);
  if constexpr (!kCluster) {
    for (int r = r0 + tid; r < r1; r += kOneThreads) {
      p.permuted_to_expanded[r] = pad_expanded;
      p.permuted_to_token[r] = pad_token;
    }
    for (int t = t0 + tid; t < t1; t += kOneThreads) {
      p.tile_expert[t] = -1;
      p.tile_row_end[t] = static_cast<int>(static_cast<long long>(t) * M);
    }
  }

  int dropped = 0;
  // The picks' local experts (L: not placed); the ballots' packed form key << 16 | rank.
  PickInts<ITEMS> keys;
  int* key = keys.v;
#pragma unroll
  for (int j = 0; j < ITEMS; ++j)
    key[j] = local_key(static_cast<long long>(raw[j]), p, dropped) << (kBits ? 0 : 16);
  __syncthreads();  // ranking region zeroed
  // The block's dropped count, before the barrier that ends the ranking.
  const auto add_dropped = [&] {
    dropped = __reduce_add_sync(0xffffffffu, dropped);
    if (lane == 0 && dropped != 0) atomicAdd(&sh.dropped, dropped);  // a sum: order does not matter
  };

  // 1. Ranks within the block.
  //    Bitmaps (kBits): pick x of token t sets bit t - first_token of its expert's bitmap; its rank
  //    among the block's picks of that expert is the number of bits below its own, which is its
  //    rank in x order when no token has two picks of one expert. OR is order-free, so the bitmaps
  //    (and the ranks) do not depend on timing. A bit that was already set is such a duplicate (ids
  //    are data: nothing forbids them); a block that finds one ranks by ballots instead
  //    (rank_by_ballots). Faster than ballots wherever the bitmaps fit past 512 picks (E=256 K=8
  //    T = 256: 3.48 us against 4.24; docs/decisions/layout-one-launch-kernel.md). At N <= 512
  //    (ITEMS = 1) bitmaps were no faster: that kernel ranks by ballots, whose code it inlines, as
  //    do the kernels the launcher picks where the bitmaps do not fit.
  //    Ballots: warp_ballot_ranks and warp_prefix.
  int* my_hist = hist + warp * L;
  PickInts<ITEMS> ballot_within{};  // bitmap kernels' ballot fallback
  bool by_bits = false;
  if constexpr (kBits) {  // the launcher instantiates these kernels only with W > 0
    bool duplicate = false;
#pragma unroll
    for (int j = 0; j < ITEMS; ++j) {
      if (key[j] < L) {  // a placed pick: x < c1
        const int u = token_of(c0 + (group0 + j) * 32 + lane) - first_token;
        const unsigned bit = 1u << (u & 31);
        if (atomicOr(&bits[(u >> 5) * L + key[j]], bit) & bit) duplicate = true;
        if (tally != nullptr) atomicAdd(&tally[key[j]], 1);  // a sum: order does not matter
      }
    }
    if (__any_sync(0xffffffffu, duplicate) && lane == 0) atomicOr(&sh.duplicates, 1);
    add_dropped();
    __syncthreads();  // bitmaps complete
    by_bits = sh.duplicates == 0;
    if (!by_bits) ballot_within = rank_by_ballots<ITEMS, KB>(keys, hist, block_counts, L, per_warp, groups);
  } else {
    warp_ballot_ranks<ITEMS, kCluster, KB>(key, my_hist, L, per_warp, group0, groups, tally);
    add_dropped();
    __syncthreads();  // hist complete
  }

  int num_tiles = 0;
  int padded_total = 0;
  int l0 = 0, l1 = 0;  // this block's slice of experts (counts, offsets)
  int placed = 0;      // cluster form: the block's picks that get a row
  namespace cg = cooperative_groups;
  if constexpr (kSplit) {
    one_block_offsets<!kBits>(p, sh, block, by_bits, bits, word_base, W, hist, block_counts, offs, ends,
                              long_runs, t0, t1);
  } else {
    // 2. Per expert (thread t owns experts [e_begin, e_end)): the block's count of l, and
    //    bitmaps: word_base[w][l] = the set bits of l's words before w; ballots: warp_prefix.
    const int per_thread = (L + kOneThreads - 1) / kOneThreads;
    const int e_begin = min(L, tid * per_thread);
    const int e_end = min(L, e_begin + per_thread);
    if constexpr (kBits) {
      if (by_bits) bitmap_prefix(bits, word_base, block_counts, L, W, e_begin, e_end);  // one block: ends
    } else {
      warp_prefix(hist, block_counts, L, e_begin, e_end);
    }
    if constexpr (kCluster) {
      // The blocks' counts meet in the workspace (L2): block b stores its counts into
      // chunk_hist[b][0..L) and its dropped ids into chunk_dropped[b], the cluster (or grid)
      // barrier's release publishes them, and every block loads the CB rows (128-byte lines).
      // Faster than any exchange through distributed shared memory (E=256 K=8 T = 4096: 6.52 us
      // against 7.12; docs/decisions/layout-path-selection.md).
      for (int l = e_begin; l < e_end; ++l) p.chunk_hist[block * L + l] = block_counts[l];
      if (tid == 0) p.chunk_dropped[block] = sh.dropped;
      if constexpr (CB > kMaxClusterBlocks) {
        cg::this_grid().sync();  // every block's counts are published
      } else {
        cg::this_cluster().sync();  // every block's counts are published
      }
      // The dropped total (block 0 writes totals[2]): the last warp's loads of the CB counts go out
      // before the loads of the per-expert rows, so that both are in flight at once (loaded after
      // them, block 0, and so the kernel, ended last).
      constexpr int kDroppedPerLane = (CB + 31) / 32;
      const bool dropped_warp = block == 0 && warp == kOneWarps - 1;  // warp-uniform
      int dropped_part[kDroppedPerLane];
#pragma unroll
      for (int i = 0; i < kDroppedPerLane; ++i) {
        const int b = lane + 32 * i;
        dropped_part[i] = dropped_warp && b < CB ? __ldcg(p.chunk_dropped + b) : 0;
      }
      // before[l] = picks of l in the chunks of blocks < ours; the count = all blocks. The loads go
      // out in batches of up to 64 (a register each).
      constexpr int kBatch = CB < 64 ? CB : 64;
      for (int l = e_begin; l < e_end; ++l) {
        int before = 0;
        int c = 0;
#pragma unroll 1
        for (int b0 = 0; b0 < CB; b0 += kBatch) {
          int v[kBatch];
#pragma unroll
          for (int i = 0; i < kBatch; ++i) v[i] = __ldcg(p.chunk_hist + (b0 + i) * L + l);
#pragma unroll
          for (int i = 0; i < kBatch; ++i) {
            before += b0 + i < block ? v[i] : 0;
            c += v[i];
          }
        }
        base[l] = before;
        ends[l] = c;
      }
      if (dropped_warp) {
        int dropped_total = 0;
#pragma unroll
        for (int i = 0; i < kDroppedPerLane; ++i) dropped_total += dropped_part[i];
        dropped_total = __reduce_add_sync(0xffffffffu, dropped_total);  // a sum: order does not matter
        if (lane == 0) p.totals[2] = dropped_total;
      }
    }

    // 3. Offsets: one scan of the experts' tile counts q = ceil(count / M); offsets are M times the
    //    tiles before (the cluster form also scans the block's own counts in the low half of a
    //    64-bit sum: lstart, where its picks of each expert start in the stage). The thread of an
    //    expert then writes its tiles in this block's tile slice (no search for a tile's expert).
    long long run_sum = 0;
    for (int l = e_begin; l < e_end; ++l) {
      const int q = static_cast<int>(tiles_of(static_cast<std::uint32_t>(ends[l]), p));
      offs[l] = q;  // kept for the second pass
      run_sum += kCluster ? (static_cast<long long>(q) << 32) + block_counts[l] : q;
    }
    int tile_prefix;
    int lprefix = 0;  // cluster form: the block's picks of experts before l
    if constexpr (kCluster) {
      long long prefix64, total64;
      OneScan64(sh.scan64).ExclusiveSum(run_sum, prefix64, total64);
      tile_prefix = static_cast<int>(prefix64 >> 32);
      lprefix = static_cast<int>(prefix64 & 0xffffffffLL);
      num_tiles = static_cast<int>(total64 >> 32);
      placed = static_cast<int>(total64 & 0xffffffffLL);
    } else {
      OneScan(sh.scan).ExclusiveSum(static_cast<int>(run_sum), tile_prefix, num_tiles);
    }
    padded_total = num_tiles * M;  // < 2^31: the max_permuted_rows bound
    slice(L, block, p.locals_per_block, l0, l1);
    for (int l = e_begin; l < e_end; ++l) {
      const int q = offs[l];
      if constexpr (kCluster) {
        base[l] += tile_prefix * M;
        lstart[l] = lprefix;
        lprefix += block_counts[l];
      }
      place_expert(p, sh, l, ends[l], tile_prefix, q, l0, l1, t0, t1, offs, ends, long_runs);
      tile_prefix += q;
    }
    // (The cluster form's dropped total comes from its dropped warp.)
    if (tid == 0) place_totals(p, sh, block, L, padded_total, num_tiles, offs, /*dropped=*/!kCluster);
  }                 // kSplit
  __syncthreads();  // offs, ends, base complete (one-block form: its fills are ordered before what follows)

  // 4a. The real rows (the one-block form: those in its row slice; it ranked every pick) and
  //     expanded_to_permuted (the one-block form: its x slice). The cluster form stages its rows
  //     in expert order and stores them below, coalesced.
  int x0 = c0;
  int x1 = c1;
  if constexpr (!kCluster) slice(N, block, p.picks_per_block, x0, x1);
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) {
    const int x = c0 + (group0 + j) * 32 + lane;
    if (j < per_warp && x < c1) {
      const int l = kBits ? key[j] : key[j] >> 16;
      int row = -1;
      if (l < L) {
        int within;  // the block's earlier picks of l
        if constexpr (kBits) {
          if (by_bits) {  // (not a select: a block that met a duplicate has no bitmap ranks)
            const int u = token_of(x) - first_token;
            const int i = (u >> 5) * L + l;
            within = word_base[i] + __popc(bits[i] & ((1u << (u & 31)) - 1u));
          } else {
            within = ballot_within.v[j];
          }
        } else {
          within = my_hist[l] + (key[j] & 0xffff);
        }
        row = base[l] + within;
        if constexpr (kCluster) {
          const int s = lstart[l] + within;
          stage_x[s] = x;
          stage_row[s] = row;
        } else if (row >= r0 && row < r1) {
          p.permuted_to_expanded[row] = x;
          p.permuted_to_token[row] = token_of(x);
        }
      }
      if (x >= x0 && x < x1) p.expanded_to_permuted[x] = row;
    }
  }
  if constexpr (kCluster) {
    __syncthreads();  // staged
    for (int s = tid; s < placed; s += kOneThreads) {
      const int x = stage_x[s];
      const int row = stage_row[s];
      p.permuted_to_expanded[row] = x;
      p.permuted_to_token[row] = token_of(x);
    }
  }

  // 4b. The tiles of the long runs (kTilesPerThread), the whole block over each: expert l's tiles
  //     are [offs[l] / M, offs[l + 1] / M) (offs[L] = padded_total).
  const int num_long_runs = sh.num_long_runs;
  for (int i = 0; i < num_long_runs; ++i) {  // block-uniform
    const int l = long_runs[i];
    const int row_end = ends[l];
    const int a = max(t0, static_cast<int>(div_tile(static_cast<std::uint32_t>(offs[l]), p)));
    const int b = min(t1, static_cast<int>(div_tile(static_cast<std::uint32_t>(offs[l + 1]), p)));
    for (int t = a + tid; t < b; t += kOneThreads) {
      p.tile_expert[t] = l;
      p.tile_row_end[t] = min((t + 1) * M, row_end);
    }
  }

  if constexpr (kCluster) {
    // The tiles past num_tiles and (4c, below) the rows past padded_total, split evenly over the
    // blocks: by the capacity's tile and row slices, the last blocks held them all.
    int f0, f1;
    part_range(p.capacity_tiles - num_tiles, block, CB, f0, f1);
    for (int t = num_tiles + f0 + tid; t < num_tiles + f1; t += kOneThreads) {
      p.tile_expert[t] = -1;
      p.tile_row_end[t] = static_cast<int>(static_cast<long long>(t) * M);
    }
    // 4c. The rows that hold no pick, each written once (no row is written twice, so no block
    //     waits for another's stores): the padding rows [ends[l], offs[l + 1]) of the experts of
    //     this block's expert slice, a warp per expert; this block's part of the rows past
    //     padded_total. (Giving expert l's padding to the block that holds its last pick instead
    //     put nearly all of it on the last block.)
    for (int l = l0 + warp; l < l1; l += kOneWarps) {  // warp-uniform
      for (int r = ends[l] + lane; r < offs[l + 1]; r += 32) {
        p.permuted_to_expanded[r] = pad_expanded;
        p.permuted_to_token[r] = pad_token;
      }
    }
    part_range(p.capacity_rows - padded_total, block, CB, f0, f1);
    for (int r = padded_total + f0 + tid; r < padded_total + f1; r += kOneThreads) {
      p.permuted_to_expanded[r] = pad_expanded;
      p.permuted_to_token[r] = pad_token;
    }
  }
}

template <int ITEMS, int KB, typename Id, bool kBitmaps, bool kSplit>
__global__ void __launch_bounds__(kOneThreads, 1)
    one_block_layout_kernel(__grid_constant__ const LayoutParams p) {
  __shared__ OneShared sh;
  extern __shared__ __align__(16) int one_dyn[];
  one_launch_layout<ITEMS, 0, KB, Id, kBitmaps, kSplit>(p, sh, one_dyn);
}

// Launched as one cluster of CB blocks (the cluster dimension is a launch attribute, see layout.cu),
// or past kMaxClusterBlocks as a cooperative grid of CB blocks.
template <int ITEMS, int CB, int KB, typename Id, bool kBitmaps>
__global__ void __launch_bounds__(kOneThreads, 1)
    cluster_layout_kernel(__grid_constant__ const LayoutParams p) {
  __shared__ OneShared sh;
  extern __shared__ __align__(16) int one_dyn[];
  one_launch_layout<ITEMS, CB, KB, Id, kBitmaps>(p, sh, one_dyn);
}

}  // namespace switchyard::cuda::layout_detail
