// Device code of the CUDA layout (docs/design.md section 3): a stable counting sort of the expanded
// picks x = t*K + k by local expert, deterministic bit for bit (no atomic whose order reaches the
// output: shared-memory atomics only build histograms, whose values do not depend on order).
//
// Shapes of the same computation (the one-launch kernels for small and mid N with L <= 2155 are
// in one_launch_layout_kernel.cuh; this file has the sorting one-kernel path for larger L and the
// chunked pipeline):
//
//  * small (T*K <= kSmallMaxPicks): ONE kernel. Every block reads all picks, builds the
//    histogram, scans it and sorts the picks by (local expert, x) with cub::BlockRadixSort
//    (stable, so equal experts keep ascending x). The blocks then split the writes: block g
//    writes the sorted positions, padding rows and tiles of its slice. The redundant
//    per-block work is small; the writes (dominated by padding rows, L*(M-1) of them) are
//    spread over many SMs, and no block waits for another.
//
//  * large: three kernels chained by programmatic dependent launch, over B chunks of C
//    contiguous picks (the classic split of a counting sort / radix sort's "upsweep, scan,
//    downsweep", e.g. Merrill & Grimshaw, "High performance and scalable radix sorting"):
//      1. chunk_histogram: chunk b's per-expert counts -> workspace hist[b][l];
//      2. chunk_scan: per expert, the exclusive prefix over chunks (in place) and counts[l];
//      3. chunk_scatter: each block scans pad(counts) (redundantly, L values) into offsets,
//         sorts its chunk stably, and writes row = offsets[l] + hist[b][l] + rank in chunk;
//         then its slice of padding rows and tiles.
//    The kernel boundaries are the grid-wide barriers; the workspace needs no initialisation.
//
// Rows and tiles that are not real rows are written without any search (fill_padding_and_tiles):
// per expert its < M padding rows and its tiles, then the tail past padded_total, split over the
// blocks by experts and by tail range.
//
// Every kernel follows the PDL contract of cuda/common/launch.cuh: nothing touches global memory
// before pdl_wait(), so each may be launched early behind any predecessor in the stream.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_exchange.cuh>
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>

#include "cuda/common/launch.cuh"

namespace switchyard::cuda::layout_detail {

// ---------------------------------------------------------------------------------------------
// Parameters: one struct, passed by value to every layout kernel.

struct LayoutParams {
  // Shape.
  int num_tokens = 0;   // T
  int top_k = 1;        // K
  int num_picks = 0;    // N = T*K (< 2^31 - 1, checked by the API layer)
  int num_experts = 0;  // E
  int num_local = 0;    // L (<= kMaxLocalExperts)
  int tile_size = 1;    // M
  int key_bits = 1;     // bits of the sort key: keys are 0..L, L = "not placed"
  // Local experts: expert_map[E] when non-null, else global = start + l * stride.
  int local_start = 0;
  int local_stride = 1;
  const std::int32_t* expert_map = nullptr;
  // Capacities of the row and tile arrays (max_permuted_rows, max_tiles).
  int capacity_rows = 0;
  int capacity_tiles = 0;
  // Input ids [T,K], int32 or int64 (the kernel's template argument says which).
  const void* topk_ids = nullptr;
  // Outputs (layout.h).
  std::int32_t* counts = nullptr;
  std::int32_t* offsets = nullptr;
  std::int32_t* permuted_to_expanded = nullptr;
  std::int32_t* permuted_to_token = nullptr;
  std::int32_t* expanded_to_permuted = nullptr;
  std::int32_t* tile_expert = nullptr;
  std::int32_t* tile_row_end = nullptr;
  std::int32_t* totals = nullptr;
  // Division by M without a hardware divide: (2^32 - 1) / M (see div_tile).
  std::uint32_t tile_magic = 0xffffffffu;
  // t = x / K as a multiply-high, exact for x * K < 2^32: 0xffffffff / K + 1 (0 when K == 1).
  std::uint32_t token_magic = 0;
  // One-launch kernels: each block's slice sizes of the rows, tiles, picks and local experts,
  // ceil(n / blocks), set by the launcher for its grid (block g owns [g * per, (g + 1) * per)).
  int rows_per_block = 0;
  int tiles_per_block = 0;
  int picks_per_block = 0;
  int locals_per_block = 0;
  // One-launch kernels with ITEMS > 1: words per local expert of the token bitmaps that rank the
  // picks (one per 32 tokens, to whole kRankWordsBatch), or 0 to rank by ballots
  // (one_launch_layout_kernel.cuh).
  int rank_words = 0;
  // Chunked path: B chunks of `chunk_picks` picks; hist [B][L] and dropped [B] in workspace. The
  // cluster form uses the first CB rows of both for its blocks' counts.
  int num_chunks = 0;
  int chunk_picks = 0;
  std::int32_t* chunk_hist = nullptr;
  std::int32_t* chunk_dropped = nullptr;
  // Host-side choice, read where rank_words is set (LayoutOptions::rank_by_ballots); kernels ignore it.
  int rank_by_ballots = 0;
};

// Local experts at most (shared-memory arrays of L entries, and 16-bit sort keys 0..L).
constexpr int kMaxLocalExperts = 8192;

// ---------------------------------------------------------------------------------------------
// Small helpers.

__device__ __forceinline__ int ceil_div_int(int a, int b) { return (a + b - 1) / b; }

// floor(x / M) for any 32-bit x: q = floor(x * magic / 2^32) with magic = floor((2^32 - 1) / M)
// is q or q - 1 (the error x * (1 + (2^32 - 1) mod M) / (M * 2^32) is below x / 2^32 < 1), and
// one remainder test fixes it: four dependent instructions instead of the ~20 of a division by a
// run-time divisor, which sat on the critical path of the latency-bound one-launch kernels.
__device__ __forceinline__ std::uint32_t div_tile(std::uint32_t x, const LayoutParams& p) {
  const std::uint32_t m = static_cast<std::uint32_t>(p.tile_size);
  std::uint32_t q = __umulhi(x, p.tile_magic);
  if (x - q * m >= m) ++q;
  return q;
}
// ceil(c / M) = the tiles of c rows (c < 2^31, M < 2^31: c + M - 1 < 2^32).
__device__ __forceinline__ std::uint32_t tiles_of(std::uint32_t c, const LayoutParams& p) {
  return div_tile(c + static_cast<std::uint32_t>(p.tile_size) - 1u, p);
}

// The sort key of global expert id e: its local index l, or L when e is not placed. Ids outside
// [0, E) other than -1 add one to `dropped`.
__device__ __forceinline__ int local_key(long long e, const LayoutParams& p, int& dropped) {
  const int L = p.num_local;
  if (e < 0 || e >= p.num_experts) {
    dropped += (e != -1);
    return L;
  }
  const int ei = static_cast<int>(e);
  int l;
  if (p.expert_map != nullptr) {
    l = __ldg(p.expert_map + ei);  // entries outside [-1, L) count as -1 (range check below)
  } else {
    const int d = ei - p.local_start;
    if (p.local_stride == 1) {
      l = d;
    } else {
      l = (d >= 0 && d % p.local_stride == 0) ? d / p.local_stride : -1;
    }
  }
  return static_cast<unsigned>(l) < static_cast<unsigned>(L) ? l : L;
}

// Reads pick x of the ids and returns its key.
template <typename Id>
struct GlobalIdKeys {
  const Id* ids;
  __device__ __forceinline__ int operator()(int x, const LayoutParams& p, int& dropped) const {
    return local_key(static_cast<long long>(ids[x]), p, dropped);
  }
};

// Block-wide exclusive scan of n values, each thread owning a contiguous run of them (n is a
// runtime value, up to kMaxLocalExperts). `load(i)` gives value i (it is called twice per i);
// `store(i, exclusive_prefix)` is called once per i, after the last load(i). Returns the total.
template <int THREADS, typename T, typename Load, typename Store>
__device__ __forceinline__ T scan_runs(int n, typename cub::BlockScan<T, THREADS>::TempStorage& storage,
                                       Load load, Store store) {
  const int per_thread = ceil_div_int(n, THREADS);
  const int begin = min(n, static_cast<int>(threadIdx.x) * per_thread);
  const int end = min(n, begin + per_thread);
  T run_sum = 0;
  for (int i = begin; i < end; ++i) run_sum += load(i);
  T prefix;
  T total;
  cub::BlockScan<T, THREADS>(storage).ExclusiveSum(run_sum, prefix, total);
  for (int i = begin; i < end; ++i) {
    const T v = load(i);
    store(i, prefix);
    prefix += v;
  }
  return total;
}

// Two 31-bit sums in one 64-bit scan: high half pad(count) (-> offsets), low half a count
// (-> its exclusive prefix). Neither total reaches 2^31, so no carry crosses the halves.
__device__ __forceinline__ unsigned long long pack_pair(std::uint32_t high, std::uint32_t low) {
  return (static_cast<unsigned long long>(high) << 32) | low;
}
__device__ __forceinline__ int high_half(unsigned long long v) { return static_cast<int>(v >> 32); }
__device__ __forceinline__ int low_half(unsigned long long v) { return static_cast<int>(v & 0xffffffffull); }

// [begin, end) of part `part` of `n` items split into `parts` near-equal contiguous parts.
__device__ __forceinline__ void part_range(int n, int part, int parts, int& begin, int& end) {
  const long long per = (static_cast<long long>(n) + parts - 1) / parts;
  begin = static_cast<int>(min(static_cast<long long>(n), per * part));
  end = static_cast<int>(min(static_cast<long long>(n), per * (part + 1)));
}

// Part `part` of `parts` of every row and tile that is not a real row, without any search:
//   * experts [l0, l1) of the part, 32 per warp: padding rows [ends[l], offs[l+1]) (< M of them)
//     and the tiles [offs[l] / M, offs[l+1] / M) of each expert;
//   * rows [padded_total, capacity_rows) and tiles [num_tiles, capacity_tiles), split evenly.
// With every part in [0, parts) run, each such row and tile is written exactly once; the real
// rows are written by the caller. offs[L] = padded_total; ends[l] = offs[l] + counts[l].
template <int THREADS>
__device__ __forceinline__ void fill_padding_and_tiles(const LayoutParams& p, const int* offs,
                                                       const int* ends, int part, int parts) {
  constexpr int kWarps = THREADS / 32;
  const int L = p.num_local;
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int pad_expanded = p.num_picks;
  const int pad_token = p.num_tokens;
  const int M = p.tile_size;
  int l0, l1;
  part_range(L, part, parts, l0, l1);
  // Lane i of warp w looks at expert base + i * kWarps (base = l0 + w, + kWarps * 32 per round:
  // experts dealt round-robin over the warps, so a small slice still spreads over all of them);
  // the warp then writes, coalesced, the padding rows and tiles of each of its 32 experts that has
  // any (empty experts cost nothing more).
  for (int base = l0 + warp; base < l1; base += kWarps * 32) {  // warp-uniform
    const int l = base + lane * kWarps;
    int pad_begin = 0, pad_end = 0, tile_begin = 0, tile_end = 0;
    if (l < l1) {
      pad_begin = ends[l];
      pad_end = offs[l + 1];
      tile_begin = static_cast<int>(div_tile(static_cast<std::uint32_t>(offs[l]), p));
      tile_end = static_cast<int>(div_tile(static_cast<std::uint32_t>(pad_end), p));
    }
    unsigned busy = __ballot_sync(0xffffffffu, tile_end > tile_begin);  // count > 0
    while (busy != 0) {
      const int src = __ffs(busy) - 1;
      busy &= busy - 1;
      const int e = base + src * kWarps;
      const int pb = __shfl_sync(0xffffffffu, pad_begin, src);  // = offs[e] + counts[e]
      const int pe = __shfl_sync(0xffffffffu, pad_end, src);
      const int tb = __shfl_sync(0xffffffffu, tile_begin, src);
      const int te = __shfl_sync(0xffffffffu, tile_end, src);
      for (int r = pb + lane; r < pe; r += 32) {
        p.permuted_to_expanded[r] = pad_expanded;
        p.permuted_to_token[r] = pad_token;
      }
      for (int t = tb + lane; t < te; t += 32) {
        p.tile_expert[t] = e;
        p.tile_row_end[t] =
            static_cast<int>(min(static_cast<long long>(t + 1) * M, static_cast<long long>(pb)));
      }
    }
  }
  const int padded_total = offs[L];
  const int num_tiles = static_cast<int>(div_tile(static_cast<std::uint32_t>(padded_total), p));
  int r_begin, r_end;
  part_range(p.capacity_rows - padded_total, part, parts, r_begin, r_end);
  for (int r = padded_total + r_begin + tid; r < padded_total + r_end; r += THREADS) {
    p.permuted_to_expanded[r] = pad_expanded;
    p.permuted_to_token[r] = pad_token;
  }
  int t_begin, t_end;
  part_range(p.capacity_tiles - num_tiles, part, parts, t_begin, t_end);
  for (int t = num_tiles + t_begin + tid; t < num_tiles + t_end; t += THREADS) {
    p.tile_expert[t] = -1;
    p.tile_row_end[t] = static_cast<int>(static_cast<long long>(t) * M);
  }
}

// Shared arrays of L entries every scatter block keeps (dynamic shared memory):
//   delta[l] = row of the first pick of expert l in this block's sorted order, minus that pick's
//              sorted position (so row = sorted position + delta[key]);
//   offs[l]  = offsets[l], offs[L] = padded_total;
//   ends[l]  = offsets[l] + counts[l] (end of the real rows of l).
struct ExpertArrays {
  int* delta;
  int* offs;
  int* ends;
  __device__ __forceinline__ static ExpertArrays carve(int* smem, int L) {
    return ExpertArrays{smem, smem + L, smem + 2 * L + 1};
  }
};
inline constexpr std::size_t expert_arrays_bytes(int L) { return (3 * static_cast<std::size_t>(L) + 1) * 4; }

// Radix digit width of the block sorts: 2 passes for L < 1024 (keys up to 10 bits). CUB's rank
// counters take (2^bits / 2 + 1) * THREADS * 4 bytes of shared memory, 35 KB at 512 threads.
constexpr int kSortRadixBits = 5;

// Shared memory of a block that sorts THREADS * ITEMS picks; the phases use it one after another
// (load -> exchange, scan of the experts, sort, row of each pick), separated by __syncthreads.
template <int THREADS, int ITEMS>
struct BlockSortTypes {
  static constexpr int kPicks = THREADS * ITEMS;
  using Sort = cub::BlockRadixSort<std::uint16_t, THREADS, ITEMS, std::uint16_t, kSortRadixBits>;
  using Scan = cub::BlockScan<unsigned long long, THREADS>;
  using Exchange = cub::BlockExchange<std::uint16_t, THREADS, ITEMS>;
  union TempStorage {
    typename Sort::TempStorage sort;
    typename Scan::TempStorage scan;
    typename Exchange::TempStorage exchange;
    int pick_row[kPicks];  // row of the block's pick i (-1: not placed), for coalesced writes by x
  };
};

// The keys of picks [x0, x0 + THREADS*ITEMS) in a blocked arrangement (thread tid holds the picks
// x0 + tid*ITEMS + j, in x order, as the stable sort needs), read with coalesced striped loads and
// transposed through shared memory. Picks at or past N get key L. Placed keys are added to `hist`
// when it is non-null; ids outside [0, E) other than -1 are added to `dropped`.
template <int THREADS, int ITEMS, typename KeyOf>
__device__ __forceinline__ void load_keys_blocked(const LayoutParams& p, KeyOf key_of, int x0,
                                                  std::uint16_t (&keys)[ITEMS], int* hist, int& dropped,
                                                  typename BlockSortTypes<THREADS, ITEMS>::TempStorage& tmp) {
  const int L = p.num_local;
  std::uint16_t striped[ITEMS];
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) {
    const int x = x0 + j * THREADS + static_cast<int>(threadIdx.x);
    int key = L;
    if (x < p.num_picks) {
      key = key_of(x, p, dropped);
      if (hist != nullptr && key < L) atomicAdd(hist + key, 1);  // a count: order does not matter
    }
    striped[j] = static_cast<std::uint16_t>(key);
  }
  typename BlockSortTypes<THREADS, ITEMS>::Exchange(tmp.exchange).StripedToBlocked(striped, keys);
}

// After the sort (striped: sorted position s = j*THREADS + tid): writes permuted_to_expanded and
// permuted_to_token of the placed picks whose sorted position lies in [s_begin, s_end), and
// records every pick's row (or -1) in tmp.pick_row by its index in the block. `x0` + index = x.
// The caller must __syncthreads() between the sort and this call (pick_row aliases the sort's
// storage), and before reading pick_row.
template <int THREADS, int ITEMS>
__device__ __forceinline__ void place_sorted(const LayoutParams& p, const ExpertArrays& ex,
                                             const std::uint16_t (&keys)[ITEMS],
                                             const std::uint16_t (&index)[ITEMS], int x0, int s_begin,
                                             int s_end,
                                             typename BlockSortTypes<THREADS, ITEMS>::TempStorage& tmp) {
  const int L = p.num_local;
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) {
    const int s = j * THREADS + static_cast<int>(threadIdx.x);
    const int x = x0 + index[j];
    if (x >= p.num_picks) continue;
    const int key = keys[j];
    int row = -1;
    if (key < L) {
      row = s + ex.delta[key];
      if (s >= s_begin && s < s_end) {
        p.permuted_to_expanded[row] = x;
        p.permuted_to_token[row] = x / p.top_k;
      }
    }
    tmp.pick_row[index[j]] = row;
  }
}

// expanded_to_permuted[x] for the block's picks with index in [i_begin, i_end), coalesced.
template <int THREADS, int ITEMS>
__device__ __forceinline__ void write_expanded_to_permuted(
    const LayoutParams& p, int x0, int i_begin, int i_end,
    const typename BlockSortTypes<THREADS, ITEMS>::TempStorage& tmp) {
  i_end = min(i_end, p.num_picks - x0);
  for (int i = i_begin + static_cast<int>(threadIdx.x); i < i_end; i += THREADS) {
    p.expanded_to_permuted[x0 + i] = tmp.pick_row[i];
  }
}

// ---------------------------------------------------------------------------------------------
// Small path: the whole layout of N <= THREADS * ITEMS picks in every block; block g writes
// slice g of the outputs. `key_of(x, p, dropped)` gives pick x's key (from the global ids).
//
// Expects: `dyn` holds expert_arrays_bytes(L) of shared memory; everything the keys come from is
// ready (the caller has passed pdl_wait / __syncthreads).
template <int THREADS, int ITEMS, typename KeyOf>
__device__ __forceinline__ void small_layout_block(const LayoutParams& p, KeyOf key_of,
                                                   typename BlockSortTypes<THREADS, ITEMS>::TempStorage& tmp,
                                                   int* dyn, int& dropped_total) {
  using Types = BlockSortTypes<THREADS, ITEMS>;
  const int L = p.num_local;
  const int N = p.num_picks;
  const int tid = static_cast<int>(threadIdx.x);
  const int block = static_cast<int>(blockIdx.x);
  const int blocks = static_cast<int>(gridDim.x);
  const bool first_block = block == 0;
  const ExpertArrays ex = ExpertArrays::carve(dyn, L);
  int* hist = ex.delta;  // the histogram lives in delta[] until the scan turns it into deltas
  for (int i = tid; i < L; i += THREADS) hist[i] = 0;
  if (tid == 0) dropped_total = 0;
  __syncthreads();

  std::uint16_t keys[ITEMS];
  int dropped = 0;
  load_keys_blocked<THREADS, ITEMS>(p, key_of, 0, keys, hist, dropped, tmp);
  if (dropped != 0) atomicAdd(&dropped_total, dropped);  // a sum: order does not matter
  __syncthreads();  // hist and dropped_total complete; the exchange's storage is free again
  if (first_block && tid == 0) p.totals[2] = dropped_total;

  // counts -> (exclusive prefix of counts, offsets) in one scan.
  const std::uint32_t M = static_cast<std::uint32_t>(p.tile_size);
  const unsigned long long total = scan_runs<THREADS, unsigned long long>(
      L, tmp.scan,
      [&](int i) {
        const std::uint32_t c = static_cast<std::uint32_t>(hist[i]);
        return pack_pair(tiles_of(c, p) * M, c);  // the padded count: < 2^31 (max_permuted_rows bound)
      },
      [&](int i, unsigned long long prefix) {
        const int c = hist[i];
        const int offset = high_half(prefix);
        ex.offs[i] = offset;
        ex.ends[i] = offset + c;
        ex.delta[i] = offset - low_half(prefix);  // overwrites hist[i], which is no longer read
        if (first_block) {
          p.counts[i] = c;
          p.offsets[i] = offset;
        }
      });
  const int padded_total = high_half(total);
  if (tid == 0) {
    ex.offs[L] = padded_total;
    if (first_block) {
      p.offsets[L] = padded_total;
      p.totals[0] = padded_total;
      p.totals[1] = static_cast<int>(div_tile(static_cast<std::uint32_t>(padded_total), p));
    }
  }
  __syncthreads();  // ex complete; the scan's storage may be reused by the sort

  std::uint16_t index[ITEMS];
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) index[j] = static_cast<std::uint16_t>(tid * ITEMS + j);
  typename Types::Sort(tmp.sort).SortBlockedToStriped(keys, index, 0, p.key_bits);
  __syncthreads();  // the sort's storage becomes pick_row

  int s_begin, s_end;
  part_range(N, block, blocks, s_begin, s_end);
  place_sorted<THREADS, ITEMS>(p, ex, keys, index, 0, s_begin, s_end, tmp);
  __syncthreads();
  write_expanded_to_permuted<THREADS, ITEMS>(p, 0, s_begin, s_end, tmp);  // x slice = same split of N

  fill_padding_and_tiles<THREADS>(p, ex.offs, ex.ends, block, blocks);
}

template <int THREADS, int ITEMS, typename Id>
__global__ void __launch_bounds__(THREADS) small_layout_kernel(const LayoutParams p) {
  __shared__ typename BlockSortTypes<THREADS, ITEMS>::TempStorage tmp;
  __shared__ int dropped_total;
  extern __shared__ int dyn[];
  pdl_launch_dependents();  // the next kernel may be scheduled now; it waits for all of us
  pdl_wait();
  small_layout_block<THREADS, ITEMS>(p, GlobalIdKeys<Id>{static_cast<const Id*>(p.topk_ids)}, tmp, dyn,
                                     dropped_total);
}

// ---------------------------------------------------------------------------------------------
// Large path, kernel 1: chunk b's histogram -> chunk_hist[b][0..L), its dropped ids ->
// chunk_dropped[b]. Striped loads (coalesced); order does not matter for counts.
template <int THREADS, int ITEMS, typename Id>
__global__ void __launch_bounds__(THREADS) chunk_histogram_kernel(const LayoutParams p) {
  __shared__ int dropped_total;
  extern __shared__ int hist[];
  const int L = p.num_local;
  const int tid = static_cast<int>(threadIdx.x);
  const int b = static_cast<int>(blockIdx.x);
  for (int i = tid; i < L; i += THREADS) hist[i] = 0;
  const Id* ids = static_cast<const Id*>(p.topk_ids);
  const int x0 = b * p.chunk_picks;
  if (tid == 0) {
    dropped_total = 0;
    // The first wave's chunks into L2 (launch.cuh's prefetch_l2); later blocks start after the wait.
    if (static_cast<unsigned>(b) < kWarmBlocks)
      prefetch_l2(ids + x0,
                  static_cast<unsigned long long>(min(p.chunk_picks, p.num_picks - x0)) * sizeof(Id));
  }
  pdl_launch_dependents();  // the next kernel may be scheduled now; it waits for all of us
  pdl_wait();
  __syncthreads();

  int dropped = 0;
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) {
    const int x = x0 + j * THREADS + tid;
    if (x < p.num_picks) {
      const int key = local_key(static_cast<long long>(ids[x]), p, dropped);
      if (key < L) atomicAdd(hist + key, 1);
    }
  }
  if (dropped != 0) atomicAdd(&dropped_total, dropped);
  __syncthreads();
  if (tid == 0) p.chunk_dropped[b] = dropped_total;
  std::int32_t* out = p.chunk_hist + static_cast<long long>(b) * L;
  for (int i = tid; i < L; i += THREADS) out[i] = hist[i];
}

// Large path, kernel 2: for 32 experts per block (a warp's width, so every row read is one
// coalesced 128-byte line), the exclusive prefix of chunk_hist over chunks, in place, and
// counts[l] = the column total. Block 0 also sums the dropped counts into totals[2].
constexpr int kScanRowsY = 32;  // blockDim = (32, kScanRowsY)
constexpr int kScanBatch = 8;   // column loads in flight per thread

__global__ void __launch_bounds__(32 * kScanRowsY) chunk_scan_kernel(const LayoutParams p) {
  __shared__ int part_sums[kScanRowsY][33];
  __shared__ int dropped_total;
  const int lane = static_cast<int>(threadIdx.x);
  const int row_group = static_cast<int>(threadIdx.y);
  if (lane == 0 && row_group == 0) dropped_total = 0;
  pdl_launch_dependents();  // the next kernel may be scheduled now; it waits for all of us
  pdl_wait();
  __syncthreads();  // dropped_total is zero before anyone adds to it
  const int L = p.num_local;
  const int B = p.num_chunks;
  const int l = static_cast<int>(blockIdx.x) * 32 + lane;
  int b_begin, b_end;
  part_range(B, row_group, kScanRowsY, b_begin, b_end);
  std::int32_t* column = p.chunk_hist + l;

  // Loads in batches of kScanBatch, all in flight together (the stores of the second pass would
  // otherwise keep the compiler from hoisting the next load: it cannot prove L != 0).
  int sum = 0;
  if (l < L) {
    for (int b = b_begin; b < b_end; b += kScanBatch) {
      int v[kScanBatch];
#pragma unroll
      for (int j = 0; j < kScanBatch; ++j)
        v[j] = b + j < b_end ? column[static_cast<long long>(b + j) * L] : 0;
#pragma unroll
      for (int j = 0; j < kScanBatch; ++j) sum += v[j];
    }
  }
  part_sums[row_group][lane] = sum;
  if (blockIdx.x == 0) {
    int dropped = 0;
    for (int b = row_group * 32 + lane; b < B; b += 32 * kScanRowsY) dropped += p.chunk_dropped[b];
    if (dropped != 0) atomicAdd(&dropped_total, dropped);
  }
  __syncthreads();
  if (row_group == 0) {
    int run = 0;
#pragma unroll
    for (int y = 0; y < kScanRowsY; ++y) {
      const int v = part_sums[y][lane];
      part_sums[y][lane] = run;
      run += v;
    }
    if (l < L) p.counts[l] = run;
    if (blockIdx.x == 0 && lane == 0) p.totals[2] = dropped_total;
  }
  __syncthreads();
  if (l < L) {
    int run = part_sums[row_group][lane];
    for (int b = b_begin; b < b_end; b += kScanBatch) {
      int v[kScanBatch];
#pragma unroll
      for (int j = 0; j < kScanBatch; ++j)
        v[j] = b + j < b_end ? column[static_cast<long long>(b + j) * L] : 0;
#pragma unroll
      for (int j = 0; j < kScanBatch; ++j) {
        if (b + j < b_end) {
          column[static_cast<long long>(b + j) * L] = run;
          run += v[j];
        }
      }
    }
  }
}

// Large path, kernel 3: offsets (every block scans pad(counts) itself: L values, cheaper than
// another launch), then the chunk's stable sort and scatter, then slice b of the padding rows and
// tiles. Block 0 writes offsets[] and totals[0..1]. Two blocks per SM (<= 64 registers at 512
// threads; ptxas spills 4 bytes for it) so that the 512-chunk grids of T = 262144 take 2 waves.
template <int THREADS, int ITEMS, typename Id>
__global__ void __launch_bounds__(THREADS, 2) chunk_scatter_kernel(const LayoutParams p) {
  using Types = BlockSortTypes<THREADS, ITEMS>;
  __shared__ typename Types::TempStorage tmp;
  extern __shared__ int dyn[];
  pdl_launch_dependents();  // the next kernel may be scheduled now; it waits for all of us
  pdl_wait();
  const int L = p.num_local;
  const int B = static_cast<int>(gridDim.x);
  const int b = static_cast<int>(blockIdx.x);
  const int tid = static_cast<int>(threadIdx.x);
  const bool first_block = b == 0;
  const ExpertArrays ex = ExpertArrays::carve(dyn, L);
  const int x0 = b * p.chunk_picks;

  // The chunk's picks in x order, keyed by local expert (dropped ids were counted by kernel 1).
  std::uint16_t keys[ITEMS];
  int unused_dropped = 0;
  load_keys_blocked<THREADS, ITEMS>(p, GlobalIdKeys<Id>{static_cast<const Id*>(p.topk_ids)}, x0, keys,
                                    nullptr, unused_dropped, tmp);
  __syncthreads();  // the exchange's storage becomes the scan's

  // before[l]: picks of l in chunks < b; after[l]: in chunks <= b.
  const std::int32_t* before = p.chunk_hist + static_cast<long long>(b) * L;
  const std::int32_t* after = b + 1 < B ? before + L : p.counts;
  const std::uint32_t M = static_cast<std::uint32_t>(p.tile_size);
  const unsigned long long total = scan_runs<THREADS, unsigned long long>(
      L, tmp.scan,
      [&](int i) {
        const std::uint32_t c = static_cast<std::uint32_t>(p.counts[i]);
        const std::uint32_t in_chunk = static_cast<std::uint32_t>(after[i] - before[i]);
        return pack_pair(tiles_of(c, p) * M, in_chunk);
      },
      [&](int i, unsigned long long prefix) {
        const int offset = high_half(prefix);
        ex.offs[i] = offset;
        ex.ends[i] = offset + p.counts[i];
        ex.delta[i] = offset + before[i] - low_half(prefix);
        if (first_block) p.offsets[i] = offset;
      });
  const int padded_total = high_half(total);
  if (tid == 0) {
    ex.offs[L] = padded_total;
    if (first_block) {
      p.offsets[L] = padded_total;
      p.totals[0] = padded_total;
      p.totals[1] = static_cast<int>(div_tile(static_cast<std::uint32_t>(padded_total), p));
    }
  }
  __syncthreads();  // ex complete; the scan's storage becomes the sort's

  std::uint16_t index[ITEMS];
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) index[j] = static_cast<std::uint16_t>(tid * ITEMS + j);
  typename Types::Sort(tmp.sort).SortBlockedToStriped(keys, index, 0, p.key_bits);
  __syncthreads();  // the sort's storage becomes pick_row
  place_sorted<THREADS, ITEMS>(p, ex, keys, index, x0, 0, Types::kPicks, tmp);
  __syncthreads();
  write_expanded_to_permuted<THREADS, ITEMS>(p, x0, 0, Types::kPicks, tmp);

  fill_padding_and_tiles<THREADS>(p, ex.offs, ex.ends, b, B);
}

}  // namespace switchyard::cuda::layout_detail
