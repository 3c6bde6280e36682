// Kernels of the GPU expert-parallel group (include/switchyard/ep.h, docs/design.md section 6).
//
// One dispatch on a rank is four kernels on its stream (plus the layout kernels in expert-major
// mode), one combine two:
//   dispatch_plan      (1 block)  each token's destination ranks and its slot at each one: a
//                                 prefix over the source's tokens per destination (ballots)
//   dispatch_send      (G blocks) waits for each destination's acknowledgement of the previous
//                                 dispatch, pushes rows, scales and metadata into its slots; the
//                                 last block publishes one header per destination
//   dispatch_receive   (G blocks) waits for the R headers, writes the rank-major metadata, the
//                                 handle's row tables and the layout's input ids
//   dispatch_copy      (G blocks) copies each received row out of its slot to the rank-major row
//                                 and to its expert-major rows; the last block acknowledges to
//                                 every source and advances the dispatch epoch
//   combine_send       (G blocks) waits for each source's acknowledgement of the previous
//                                 combine, reduces each received row's picks and pushes one
//                                 partial per row; the last block publishes one flag per source
//   combine_receive    (G blocks) waits for the R flags, sums each token's partials in rank
//                                 order; the last block acknowledges and advances the epoch
// Every kernel returns at once when the rank's status word holds an error (the group is broken).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/ep_memory.h"
#include "cuda/common/element_formats.cuh"

namespace switchyard::ep::gpu {

using detail::kBadArguments;
using detail::kMaxRanks;

// Steps named in a device-reported error (GpuGroup::check turns them into messages).
enum Step : unsigned {
  kStepNone = 0,
  kStepDispatchSlots = 1,     // waiting for a destination to release its slots
  kStepDispatchRows = 2,      // waiting for a source's rows
  kStepDispatchArgs = 3,      // a source published bad arguments
  kStepCombineSlots = 4,      // waiting for a source to release its partial slots
  kStepCombinePartials = 5,   // waiting for a destination's partials
  kStepCombineArgs = 6,       // a peer published bad combine arguments
  kStepCombineHandles = 7,    // a peer's handle is from another dispatch
};

// Device memory of one rank, not shared with peers.
struct LocalState {
  unsigned dispatch_epoch;  // dispatches completed
  unsigned combine_epoch;   // combines completed
  unsigned done[4];         // last-block counters: send, copy, combine send, combine receive
  unsigned status;          // sticky StatusCode of the first error; 0 while healthy
  unsigned pad;
};

// Mapped pinned host memory of one rank: what its kernels report to the host.
struct ErrorWord {
  unsigned code;   // StatusCode, 0 = none
  unsigned step;   // Step
  int peer;        // the rank named
  unsigned pad;
  unsigned long long recv_rows;  // exact mode: (epoch << 32) | rows received
};

// Shapes shared by every rank.
struct Shape {
  int R = 1, K = 1, L = 1, E = 1;
  int max_tokens = 1;
  int tile_size = 1;
  std::int64_t H = 1;
  int scale_cols = 0;
  detail::RegionOffsets region;
  detail::HandleOffsets handle;
};

// One rank's view of the group.
struct Ctx {
  int rank = 0;
  char* peers[kMaxRanks] = {};  // each rank's region base as this rank addresses it
  LocalState* local = nullptr;
  ErrorWord* error = nullptr;   // device pointer of the mapped word
  unsigned long long timeout_ns = 0;
};

constexpr int kThreads = 512;  // threads of every multi-block transport kernel
constexpr int kWarps = kThreads / 32;

// ------------------------------------------------------------------------------------------------
// Memory-model primitives (PTX ISA, memory consistency model). System scope: peers are other GPUs.

__device__ __forceinline__ unsigned long long ld_acquire_sys(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ bool is_broken(const Ctx& c) {
  return *reinterpret_cast<volatile unsigned*>(&c.local->status) != 0u;
}

// Records the first error of this rank: the status word (device) picks one winner, which fills
// the host's word, code last, behind a system fence.
__device__ __forceinline__ void record_error(const Ctx& c, unsigned code, unsigned step, int peer) {
  if (atomicCAS(&c.local->status, 0u, code) == 0u) {
    volatile ErrorWord* w = c.error;
    w->step = step;
    w->peer = peer;
    __threadfence_system();
    w->code = code;
    __threadfence_system();
  }
}

// Spins until done(value) for the u64 at p, bounded by the rank's timeout (and abandoned when
// another block of this rank has recorded an error). Returns whether done() held.
template <typename Done>
__device__ __forceinline__ bool wait_for(const Ctx& c, const unsigned long long* p, Done done,
                                         unsigned long long* value) {
  const unsigned long long start = global_timer_ns();
  for (unsigned spins = 0;; ++spins) {
    const unsigned long long v = ld_acquire_sys(p);
    if (done(v)) {
      *value = v;
      return true;
    }
    if ((spins & 63u) == 63u) {
      if (is_broken(c) || global_timer_ns() - start > c.timeout_ns) {
        *value = v;
        return false;
      }
    }
    if (spins > 1024u) __nanosleep(256);
  }
}

__device__ __forceinline__ unsigned long long* flag_at(char* base, std::int64_t offset, int index) {
  return reinterpret_cast<unsigned long long*>(base + offset) + index;
}

// Threads 0..R-1 wait until peer i's acknowledgement at own[offset][i] reaches epoch e - 1 (it
// has finished with what this rank wrote at the previous epoch); a timeout is recorded as `step`.
__device__ __forceinline__ void wait_acks(const Ctx& c, int R, std::int64_t offset, unsigned e, unsigned step) {
  if (threadIdx.x < static_cast<unsigned>(R)) {
    const int peer = threadIdx.x;
    unsigned long long v;
    const bool ok = wait_for(c, flag_at(c.peers[c.rank], offset, peer),
                             [&](unsigned long long a) { return a >= e - 1u; }, &v);
    if (!ok && !is_broken(c)) record_error(c, 5u /* kTimeout */, step, peer);
  }
  __syncthreads();
}

// The last block of a grid to call it gets true. Every thread of the block calls it after its
// own stores. The block barrier orders them before thread 0's system-scope fence, which orders
// them before the count (the pattern of cooperative groups' grid sync); the last block's thread
// 0 fences again after the count (fence-fence synchronization with every other block's fence),
// so its following release stores carry all blocks' writes.
__device__ __forceinline__ bool last_block_done(unsigned* counter) {
  __syncthreads();
  __shared__ bool last;
  if (threadIdx.x == 0) {
    __threadfence_system();
    const unsigned prev = atomicAdd(counter, 1u);
    last = prev == gridDim.x - 1;
    if (last) {
      *counter = 0;  // for the next launch (stream order separates them)
      __threadfence_system();
    }
  }
  __syncthreads();
  return last;
}

// L1-bypassing loads (ld.global.cg) of slot data: a previous launch on this SM may have cached
// the same addresses at an earlier epoch. T is any trivially copyable type of 1, 2, 4, 8 or 16
// bytes or a multiple of 16, aligned to its size (16 for the multiples).
template <typename T>
__device__ __forceinline__ T load_cg(const T* p) {
  T r;
  if constexpr (sizeof(T) % 16 == 0) {
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(T) / 16); ++i) {
      const uint4 v = __ldcg(reinterpret_cast<const uint4*>(p) + i);
      memcpy(reinterpret_cast<char*>(&r) + 16 * i, &v, 16);
    }
  } else if constexpr (sizeof(T) == 8) {
    const uint2 v = __ldcg(reinterpret_cast<const uint2*>(p));
    memcpy(&r, &v, 8);
  } else if constexpr (sizeof(T) == 4) {
    const unsigned v = __ldcg(reinterpret_cast<const unsigned*>(p));
    memcpy(&r, &v, 4);
  } else if constexpr (sizeof(T) == 2) {
    const unsigned short v = __ldcg(reinterpret_cast<const unsigned short*>(p));
    memcpy(&r, &v, 2);
  } else {
    static_assert(sizeof(T) == 1, "load_cg: 1, 2, 4, 8 or 16 bytes");
    const unsigned char v = __ldcg(reinterpret_cast<const unsigned char*>(p));
    memcpy(&r, &v, 1);
  }
  return r;
}

// ------------------------------------------------------------------------------------------------
// dispatch_plan

struct PlanParams {
  Shape s;
  Ctx c;
  const void* topk_ids = nullptr;  // [T,K] int32 or int64
  bool ids64 = false;
  int tokens = 0;
  char* handle = nullptr;
};

__global__ void __launch_bounds__(1024) dispatch_plan_kernel(PlanParams p) {
  const Ctx& c = p.c;
  if (is_broken(c)) return;
  const Shape& s = p.s;
  const int R = s.R, K = s.K, L = s.L, E = s.E, T = p.tokens;
  __shared__ int warp_base[32][kMaxRanks];
  __shared__ int carry[kMaxRanks];
  __shared__ unsigned long long dropped_total, sent_total;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid < R) carry[tid] = 0;
  if (tid == 0) dropped_total = sent_total = 0;
  __syncthreads();
  int* n_dest = reinterpret_cast<int*>(p.handle + s.handle.n_dest);
  int* dest_slot = reinterpret_cast<int*>(p.handle + s.handle.dest_slot);
  unsigned long long dropped = 0, sent = 0;
  const unsigned lanes_below = (1u << lane) - 1u;
  for (int base = 0; base < T; base += blockDim.x) {
    const int t = base + tid;
    unsigned long long mask = 0;
    if (t < T) {
      for (int k = 0; k < K; ++k) {
        const long long e = p.ids64 ? static_cast<const long long*>(p.topk_ids)[static_cast<long long>(t) * K + k]
                                    : static_cast<const int*>(p.topk_ids)[static_cast<long long>(t) * K + k];
        if (e >= 0 && e < E) {
          mask |= 1ull << (e / L);
        } else if (e != -1) {
          ++dropped;
        }
      }
      n_dest[t] = __popcll(mask);
      sent += static_cast<unsigned long long>(__popcll(mask));
    }
    for (int d = 0; d < R; ++d) {
      const unsigned ballot = __ballot_sync(0xffffffffu, (mask >> d) & 1ull);
      if (lane == 0) warp_base[warp][d] = __popc(ballot);
    }
    __syncthreads();
    if (tid < R) {
      int running = carry[tid];
      for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) {
        const int v = warp_base[w][tid];
        warp_base[w][tid] = running;
        running += v;
      }
      carry[tid] = running;
    }
    __syncthreads();
    for (int d = 0; d < R; ++d) {
      const bool goes = (mask >> d) & 1ull;
      const unsigned ballot = __ballot_sync(0xffffffffu, goes);
      if (t < T) dest_slot[static_cast<long long>(t) * R + d] = goes ? warp_base[warp][d] + __popc(ballot & lanes_below) : -1;
    }
    __syncthreads();
  }
  atomicAdd(&dropped_total, dropped);
  atomicAdd(&sent_total, sent);
  __syncthreads();
  if (tid < R) reinterpret_cast<int*>(p.handle + s.handle.send_counts)[tid] = carry[tid];
  if (tid == 0) {
    long long* hdr = reinterpret_cast<long long*>(p.handle + s.handle.header);
    hdr[detail::kTokens] = T;
    hdr[detail::kHdrSentRows] = static_cast<long long>(sent_total);
    hdr[detail::kHdrDropped] = static_cast<long long>(dropped_total);
  }
}

// ------------------------------------------------------------------------------------------------
// dispatch_send

struct SendParams {
  Shape s;
  Ctx c;
  bool bad = false;  // this rank's arguments are bad: publish that, send nothing
  const unsigned char* x = nullptr;
  std::int64_t x_row_bytes_stride = 0;
  const float* scales = nullptr;
  const void* topk_ids = nullptr;
  bool ids64 = false;
  const float* topk_weights = nullptr;
  int tokens = 0;
  const char* handle = nullptr;
};

// Copies `bytes` (a multiple of sizeof(V)) from src to the rows of the destinations in
// dest_mask, the warp reading each vector once. dst_of(d) gives destination d's row.
template <typename V, int kUnroll, typename DstOf>
__device__ __forceinline__ void copy_to_each(const unsigned char* src, std::int64_t bytes, unsigned long long dest_mask,
                                             DstOf dst_of, int lane) {
  const V* in = reinterpret_cast<const V*>(src);
  const std::int64_t n = bytes / static_cast<std::int64_t>(sizeof(V));
  for (std::int64_t i0 = lane; i0 < n; i0 += 32 * kUnroll) {
    V v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const std::int64_t i = i0 + static_cast<std::int64_t>(u) * 32;
      if (i < n) v[u] = in[i];
    }
    for (unsigned long long m = dest_mask; m != 0; m &= m - 1) {
      V* out = reinterpret_cast<V*>(dst_of(__ffsll(static_cast<long long>(m)) - 1));
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const std::int64_t i = i0 + static_cast<std::int64_t>(u) * 32;
        if (i < n) out[i] = v[u];
      }
    }
  }
}

template <int kVecBytes>
__global__ void __launch_bounds__(kThreads) dispatch_send_kernel(SendParams p) {
  using V = typename cuda::VecType<kVecBytes>::type;
  const Ctx& c = p.c;
  if (is_broken(c)) return;
  const Shape& s = p.s;
  const int R = s.R, K = s.K, L = s.L;
  const unsigned e = c.local->dispatch_epoch + 1u;
  wait_acks(c, R, s.region.dispatch_ack, e, kStepDispatchSlots);
  if (!p.bad && !is_broken(c)) {
    const int lane = threadIdx.x & 31;
    const int warp_id = blockIdx.x * kWarps + (threadIdx.x >> 5);
    const int* dest_slot = reinterpret_cast<const int*>(p.handle + s.handle.dest_slot);
    const std::int64_t row_stride = s.region.row_stride;
    for (int t = warp_id; t < p.tokens; t += gridDim.x * kWarps) {
      const int slot_lo = lane < R ? dest_slot[static_cast<long long>(t) * R + lane] : -1;
      const int slot_hi = lane + 32 < R ? dest_slot[static_cast<long long>(t) * R + lane + 32] : -1;
      const unsigned long long mask = static_cast<unsigned long long>(__ballot_sync(0xffffffffu, slot_lo >= 0)) |
                                      (static_cast<unsigned long long>(__ballot_sync(0xffffffffu, slot_hi >= 0)) << 32);
      // Slot index of destination d, from the lane holding it.
      auto slot_of = [&](int d) {
        const int lo = __shfl_sync(0xffffffffu, slot_lo, d & 31);
        const int hi = __shfl_sync(0xffffffffu, slot_hi, d & 31);
        return d < 32 ? lo : hi;
      };
      // The row index (source, slot) at each destination, computed once per destination.
      auto slot_index = [&](int d) {
        return static_cast<std::int64_t>(c.rank) * s.max_tokens + slot_of(d);
      };
      // Rows: shuffles inside copy_to_each need every lane, so the destination's slot is
      // looked up by all lanes before the copy loop touches memory.
      unsigned long long m_all = mask;
      std::int64_t row_index[8];
      int cached = 0;
      for (unsigned long long m = m_all; m != 0 && cached < 8; m &= m - 1, ++cached) {
        row_index[cached] = slot_index(__ffsll(static_cast<long long>(m)) - 1);
      }
      const unsigned char* src = p.x + static_cast<std::int64_t>(t) * p.x_row_bytes_stride;
      if (__popcll(mask) <= 8) {
        auto dst_of = [&](int d) {
          // Position of d among the destinations: its cached row index.
          const int j = __popcll(mask & ((1ull << d) - 1ull));
          std::int64_t idx = 0;
#pragma unroll
          for (int q = 0; q < 8; ++q) idx = q == j ? row_index[q] : idx;
          return c.peers[d] + s.region.slot_rows + idx * row_stride;
        };
        copy_to_each<V, 4>(src, s.region.row_bytes, mask, dst_of, lane);
      } else {
        for (unsigned long long m = mask; m != 0; m &= m - 1) {
          const int d = __ffsll(static_cast<long long>(m)) - 1;
          char* dst = c.peers[d] + s.region.slot_rows + slot_index(d) * row_stride;
          copy_to_each<V, 4>(src, s.region.row_bytes, 1ull << d, [&](int) { return dst; }, lane);
        }
      }
      // Scales and metadata, per destination.
      for (unsigned long long m = mask; m != 0; m &= m - 1) {
        const int d = __ffsll(static_cast<long long>(m)) - 1;
        const std::int64_t idx = slot_index(d);
        if (s.scale_cols > 0) {
          float* dst = reinterpret_cast<float*>(c.peers[d] + s.region.slot_scales) + idx * s.scale_cols;
          for (int i = lane; i < s.scale_cols; i += 32) dst[i] = p.scales[static_cast<std::int64_t>(t) * s.scale_cols + i];
        }
        int* meta = reinterpret_cast<int*>(c.peers[d] + s.region.slot_meta) + idx * s.region.meta_ints;
        if (lane == 0) {
          meta[0] = t;
          meta[1] = __popcll(mask & ((1ull << d) - 1ull));
        }
        for (int k = lane; k < K; k += 32) {
          const std::int64_t x = static_cast<std::int64_t>(t) * K + k;
          const long long e_id = p.ids64 ? static_cast<const long long*>(p.topk_ids)[x]
                                         : static_cast<const int*>(p.topk_ids)[x];
          const long long first = static_cast<long long>(d) * L;
          meta[2 + k] = (e_id >= first && e_id < first + L) ? static_cast<int>(e_id - first) : -1;
          meta[2 + K + k] = __float_as_int(p.topk_weights[x]);
        }
      }
    }
  }
  if (last_block_done(&c.local->done[0]) && threadIdx.x == 0 && !is_broken(c)) {
    const int* counts = p.bad ? nullptr : reinterpret_cast<const int*>(p.handle + s.handle.send_counts);
    for (int d = 0; d < R; ++d) {
      const unsigned rows = p.bad ? kBadArguments : static_cast<unsigned>(counts[d]);
      st_release_sys(flag_at(c.peers[d], s.region.dispatch_header, c.rank),
                     (static_cast<unsigned long long>(e) << 32) | rows);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// dispatch_receive

struct ReceiveParams {
  Shape s;
  Ctx c;
  bool bad = false;
  bool expert_major = false;
  bool exact = false;
  // Outputs (null when bad).
  int* src_rank = nullptr;
  int* src_token = nullptr;
  int* topk_ids = nullptr;
  float* topk_weights = nullptr;
  long long* stats = nullptr;
  char* handle = nullptr;
  int* layout_ids = nullptr;  // expert-major: [N,K] ids the layout reads; -1 past the received rows
};

// Waits (threads 0..R-1) for the R values at base[offset][0..R) to reach epoch e; on success
// leaves their low words in low[]. Returns false (after recording the error) on a timeout.
__device__ __forceinline__ bool wait_all_peers(const Ctx& c, const Shape& s, std::int64_t offset, unsigned e,
                                               unsigned step, unsigned* low) {
  if (threadIdx.x < static_cast<unsigned>(s.R)) {
    const int peer = threadIdx.x;
    unsigned long long v;
    const bool ok = wait_for(c, flag_at(c.peers[c.rank], offset, peer),
                             [&](unsigned long long a) { return static_cast<unsigned>(a >> 32) == e; }, &v);
    if (ok) {
      low[peer] = static_cast<unsigned>(v);
    } else if (!is_broken(c)) {
      record_error(c, 5u /* kTimeout */, step, peer);
    }
  }
  __syncthreads();
  return !is_broken(c);
}

__global__ void __launch_bounds__(kThreads) dispatch_receive_kernel(ReceiveParams p) {
  const Ctx& c = p.c;
  if (is_broken(c)) return;
  const Shape& s = p.s;
  const int R = s.R, K = s.K;
  const unsigned e = c.local->dispatch_epoch + 1u;
  __shared__ unsigned count[kMaxRanks];
  __shared__ int offset[kMaxRanks + 1];
  if (!wait_all_peers(c, s, s.region.dispatch_header, e, kStepDispatchRows, count)) return;
  if (threadIdx.x == 0) {
    int at = 0;
    for (int src = 0; src < R; ++src) {
      if (count[src] == kBadArguments) {
        record_error(c, 1u /* kInvalidArgument */, kStepDispatchArgs, src);
        break;
      }
      offset[src] = at;
      at += static_cast<int>(count[src]);
    }
    offset[R] = at;
  }
  __syncthreads();
  if (is_broken(c)) return;
  const int total = offset[R];
  const char* own = c.peers[c.rank];
  const int* meta_base = reinterpret_cast<const int*>(own + s.region.slot_meta);
  int* row_src = reinterpret_cast<int*>(p.handle + s.handle.row_src);
  int* row_token = reinterpret_cast<int*>(p.handle + s.handle.row_token);
  int* row_j = reinterpret_cast<int*>(p.handle + s.handle.row_j);
  float* row_weights = reinterpret_cast<float*>(p.handle + s.handle.row_weights);
  const int stride = gridDim.x * blockDim.x;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
    int src = 0;
    while (src + 1 < R && offset[src + 1] <= i) ++src;
    const int pos = i - offset[src];
    const int* meta = meta_base + (static_cast<std::int64_t>(src) * s.max_tokens + pos) * s.region.meta_ints;
    const int token = load_cg(meta);
    p.src_rank[i] = src;
    p.src_token[i] = token;
    row_src[i] = src;
    row_token[i] = token;
    row_j[i] = load_cg(meta + 1);
    for (int k = 0; k < K; ++k) {
      const int id = load_cg(meta + 2 + k);
      const float w = __int_as_float(load_cg(meta + 2 + K + k));
      const std::int64_t x = static_cast<std::int64_t>(i) * K + k;
      p.topk_ids[x] = id;
      p.topk_weights[x] = w;
      row_weights[x] = w;
      if (p.expert_major) p.layout_ids[x] = id;
    }
  }
  if (p.expert_major) {
    const std::int64_t n = static_cast<std::int64_t>(R) * s.max_tokens * K;
    for (std::int64_t x = static_cast<std::int64_t>(total) * K + blockIdx.x * blockDim.x + threadIdx.x; x < n;
         x += stride) {
      p.layout_ids[x] = -1;
    }
  }
  if (blockIdx.x == 0) {
    int* recv_offsets = reinterpret_cast<int*>(p.handle + s.handle.recv_offsets);
    if (threadIdx.x <= static_cast<unsigned>(R)) recv_offsets[threadIdx.x] = offset[threadIdx.x];
    if (threadIdx.x == 0) {
      long long* hdr = reinterpret_cast<long long*>(p.handle + s.handle.header);
      hdr[detail::kHdrRecvRows] = total;
      hdr[detail::kEpoch] = e;
      p.stats[kRecvRows] = total;
      p.stats[kSentRows] = hdr[detail::kHdrSentRows];
      p.stats[kDropped] = hdr[detail::kHdrDropped];
      if (p.exact) {
        volatile unsigned long long* w = &c.error->recv_rows;
        *w = (static_cast<unsigned long long>(e) << 32) | static_cast<unsigned>(total);
        __threadfence_system();
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// dispatch_copy

struct CopyParams {
  Shape s;
  Ctx c;
  bool bad = false;
  bool expert_major = false;
  unsigned char* out_x = nullptr;  // [N, H] rank-major rows
  float* out_scales = nullptr;
  const char* handle = nullptr;
  char* handle_w = nullptr;  // the same memory, written (row_e2p)
  // Expert-major: the layout computed over N rows (scratch) and the caller's arrays, written for
  // the received rows' capacity with the sentinels of T' = received rows.
  const int* scratch_counts = nullptr;
  const int* scratch_offsets = nullptr;
  const int* scratch_p2x = nullptr;
  const int* scratch_p2t = nullptr;
  const int* scratch_e2p = nullptr;
  const int* scratch_tile_expert = nullptr;
  const int* scratch_tile_row_end = nullptr;
  const int* scratch_totals = nullptr;
  int* counts = nullptr;
  int* offsets = nullptr;
  int* p2x = nullptr;
  int* p2t = nullptr;
  int* e2p = nullptr;
  int* tile_expert = nullptr;
  int* tile_row_end = nullptr;
  int* totals = nullptr;
  unsigned char* expert_x = nullptr;  // [P, H]
  float* expert_scales = nullptr;
};

template <int kVecBytes>
__global__ void __launch_bounds__(kThreads) dispatch_copy_kernel(CopyParams p) {
  using V = typename cuda::VecType<kVecBytes>::type;
  const Ctx& c = p.c;
  if (is_broken(c)) return;
  const Shape& s = p.s;
  const int R = s.R, K = s.K, L = s.L, M = s.tile_size;
  const unsigned e = c.local->dispatch_epoch + 1u;
  const int lane = threadIdx.x & 31;
  if (!p.bad) {
    const long long* hdr = reinterpret_cast<const long long*>(p.handle + s.handle.header);
    const int total = static_cast<int>(hdr[detail::kHdrRecvRows]);
    const int* recv_offsets = reinterpret_cast<const int*>(p.handle + s.handle.recv_offsets);
    const char* own = c.peers[c.rank];
    const std::int64_t row_bytes = s.region.row_bytes;
    const int warp_id = blockIdx.x * kWarps + (threadIdx.x >> 5);
    const int warps = gridDim.x * kWarps;
    for (int i = warp_id; i < total; i += warps) {
      int src = 0;
      while (src + 1 < R && recv_offsets[src + 1] <= i) ++src;
      const std::int64_t slot = static_cast<std::int64_t>(src) * s.max_tokens + (i - recv_offsets[src]);
      const unsigned char* from = reinterpret_cast<const unsigned char*>(own + s.region.slot_rows) + slot * s.region.row_stride;
      // Destinations: the rank-major row (bit 63) and each local pick's expert-major row (bit k).
      int pick_row = -1;
      unsigned long long mask = 1ull << 63;
      if (p.expert_major && lane < K && K <= 32) {
        pick_row = p.scratch_e2p[static_cast<std::int64_t>(i) * K + lane];
      }
      if (p.expert_major) mask |= __ballot_sync(0xffffffffu, pick_row >= 0);
      auto dst_of = [&](int d) -> unsigned char* {
        if (d == 63) return p.out_x + static_cast<std::int64_t>(i) * row_bytes;
        return p.expert_x + static_cast<std::int64_t>(__shfl_sync(0xffffffffu, pick_row, d)) * row_bytes;
      };
      // __shfl_sync in dst_of needs all lanes: copy_to_each calls it uniformly across the warp.
      // Slot rows are read with L1-bypassing loads.
      const V* in = reinterpret_cast<const V*>(from);
      const std::int64_t n = row_bytes / static_cast<std::int64_t>(sizeof(V));
      constexpr int kUnroll = 4;
      for (std::int64_t i0 = lane; i0 - lane < n; i0 += 32 * kUnroll) {
        V v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const std::int64_t q = i0 + static_cast<std::int64_t>(u) * 32;
          if (q < n) v[u] = load_cg(in + q);
        }
        for (unsigned long long m = mask; m != 0; m &= m - 1) {
          V* out = reinterpret_cast<V*>(dst_of(__ffsll(static_cast<long long>(m)) - 1));
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const std::int64_t q = i0 + static_cast<std::int64_t>(u) * 32;
            if (q < n) out[q] = v[u];
          }
        }
      }
      if (p.expert_major && K > 32) {
        // Wide K: the picks one at a time, rows read again (rare: K > 32).
        for (int k = 0; k < K; ++k) {
          const int row = p.scratch_e2p[static_cast<std::int64_t>(i) * K + k];
          if (row < 0) continue;
          for (std::int64_t q = lane; q < n; q += 32) reinterpret_cast<V*>(p.expert_x + row * row_bytes)[q] = load_cg(in + q);
        }
      }
      if (s.scale_cols > 0) {
        const float* sc = reinterpret_cast<const float*>(own + s.region.slot_scales) + slot * s.scale_cols;
        for (int q = lane; q < s.scale_cols; q += 32) {
          const float v = load_cg(sc + q);
          p.out_scales[static_cast<std::int64_t>(i) * s.scale_cols + q] = v;
          if (p.expert_major) {
            for (int k = 0; k < K; ++k) {
              const int row = p.scratch_e2p[static_cast<std::int64_t>(i) * K + k];
              if (row >= 0) p.expert_scales[static_cast<std::int64_t>(row) * s.scale_cols + q] = v;
            }
          }
        }
      }
    }
    if (p.expert_major) {
      // The layout of the T' = total received rows: scratch arrays (computed over N rows, rows past
      // T' unplaced) copied for T''s capacity, with T''s sentinels.
      const std::int64_t N = static_cast<std::int64_t>(R) * s.max_tokens;
      const std::int64_t picks = static_cast<std::int64_t>(total) * K;
      const std::int64_t cap_rows = total == 0 ? 0 : picks + (picks < L ? picks : L) * (M - 1);
      const std::int64_t cap_tiles = (cap_rows + M - 1) / M;
      const std::int64_t tid = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
      const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
      int* row_e2p = reinterpret_cast<int*>(p.handle_w + s.handle.row_e2p);
      for (std::int64_t q = tid; q < cap_rows; q += stride) {
        const int x = p.scratch_p2x[q];
        p.p2x[q] = x == N * K ? static_cast<int>(picks) : x;
        const int t = p.scratch_p2t[q];
        p.p2t[q] = t == N ? total : t;
      }
      for (std::int64_t q = tid; q < cap_tiles; q += stride) {
        p.tile_expert[q] = p.scratch_tile_expert[q];
        p.tile_row_end[q] = p.scratch_tile_row_end[q];
      }
      for (std::int64_t q = tid; q < picks; q += stride) {
        const int row = p.scratch_e2p[q];
        p.e2p[q] = row;
        row_e2p[q] = row;
      }
      for (std::int64_t q = tid; q < L; q += stride) p.counts[q] = p.scratch_counts[q];
      for (std::int64_t q = tid; q <= L; q += stride) p.offsets[q] = p.scratch_offsets[q];
      for (std::int64_t q = tid; q < kNumTotals; q += stride) p.totals[q] = p.scratch_totals[q];
      // Padding rows of the expert-major rows are zero (scales too).
      const int padded = p.scratch_totals[kPaddedTotal];
      for (std::int64_t q0 = static_cast<std::int64_t>(warp_id) * 32; q0 < padded; q0 += static_cast<std::int64_t>(warps) * 32) {
        const std::int64_t q = q0 + lane;
        const bool pad = q < padded && p.scratch_p2t[q] == N;
        for (unsigned b = __ballot_sync(0xffffffffu, pad); b != 0; b &= b - 1) {
          const std::int64_t row = q0 + __ffs(b) - 1;
          V* out = reinterpret_cast<V*>(p.expert_x + row * row_bytes);
          for (std::int64_t v = lane; v < row_bytes / static_cast<std::int64_t>(sizeof(V)); v += 32) out[v] = V{};
          for (int k = lane; k < s.scale_cols; k += 32) p.expert_scales[row * s.scale_cols + k] = 0.0f;
        }
      }
    }
  }
  if (last_block_done(&c.local->done[1]) && threadIdx.x == 0 && !is_broken(c)) {
    for (int src = 0; src < R; ++src) {
      st_release_sys(flag_at(c.peers[src], s.region.dispatch_ack, c.rank), e);
    }
    c.local->dispatch_epoch = e;
  }
}

// ------------------------------------------------------------------------------------------------
// combine

struct CombineSendParams {
  Shape s;
  Ctx c;
  bool bad = false;
  bool expert_major = true;
  bool weighted = true;
  const void* y = nullptr;
  std::int64_t y_row_stride = 0;  // elements
  const float* pick_values = nullptr;  // [N,K] or null (zeros are sent)
  const char* handle = nullptr;
};

// kVec elements of type T as one aligned load or store.
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

// YF: input format, PF: partial format (cuda/common/element_formats.cuh), kVec: columns per lane
// and step (H % kVec == 0, rows aligned).
template <typename YF, typename PF, int kVec>
__global__ void __launch_bounds__(kThreads) combine_send_kernel(CombineSendParams p) {
  using Y = typename YF::Storage;
  using P = typename PF::Storage;
  const Ctx& c = p.c;
  if (is_broken(c)) return;
  const Shape& s = p.s;
  const int R = s.R, K = s.K;
  const unsigned e = c.local->combine_epoch + 1u;
  wait_acks(c, R, s.region.combine_ack, e, kStepCombineSlots);
  unsigned handle_epoch = 0;
  if (!p.bad && !is_broken(c)) {
    const long long* hdr = reinterpret_cast<const long long*>(p.handle + s.handle.header);
    handle_epoch = static_cast<unsigned>(hdr[detail::kEpoch]);
    const int total = static_cast<int>(hdr[detail::kHdrRecvRows]);
    const int* row_src = reinterpret_cast<const int*>(p.handle + s.handle.row_src);
    const int* row_token = reinterpret_cast<const int*>(p.handle + s.handle.row_token);
    const int* row_j = reinterpret_cast<const int*>(p.handle + s.handle.row_j);
    const float* row_w = reinterpret_cast<const float*>(p.handle + s.handle.row_weights);
    const int* row_e2p = reinterpret_cast<const int*>(p.handle + s.handle.row_e2p);
    const Y* y = static_cast<const Y*>(p.y);
    const int lane = threadIdx.x & 31;
    const int warp_id = blockIdx.x * kWarps + (threadIdx.x >> 5);
    const std::int64_t H = s.H;
    for (int i = warp_id; i < total; i += gridDim.x * kWarps) {
      const int src = row_src[i];
      const std::int64_t slot = static_cast<std::int64_t>(row_j[i]) * s.max_tokens + row_token[i];
      P* dst = reinterpret_cast<P*>(c.peers[src] + s.region.partials) + slot * H;
      float* dst_values = reinterpret_cast<float*>(c.peers[src] + s.region.partial_values) + slot * K;
      for (int k = lane; k < K; k += 32) {
        dst_values[k] = p.pick_values ? p.pick_values[static_cast<std::int64_t>(i) * K + k] : 0.0f;
      }
      for (std::int64_t col = static_cast<std::int64_t>(lane) * kVec; col < H; col += 32 * kVec) {
        float acc[kVec];
        if (p.expert_major) {
#pragma unroll
          for (int v = 0; v < kVec; ++v) acc[v] = 0.0f;
          for (int k = 0; k < K; ++k) {
            const int row = row_e2p[static_cast<std::int64_t>(i) * K + k];
            if (row < 0) continue;
            const float w = p.weighted ? row_w[static_cast<std::int64_t>(i) * K + k] : 1.0f;
            const Pack<Y, kVec> in = *reinterpret_cast<const Pack<Y, kVec>*>(y + row * p.y_row_stride + col);
#pragma unroll
            for (int v = 0; v < kVec; ++v) acc[v] = __fmaf_rn(w, YF::to_float(in.v[v]), acc[v]);
          }
        } else {
          const Pack<Y, kVec> in = *reinterpret_cast<const Pack<Y, kVec>*>(y + static_cast<std::int64_t>(i) * p.y_row_stride + col);
#pragma unroll
          for (int v = 0; v < kVec; ++v) acc[v] = YF::to_float(in.v[v]);
        }
        Pack<P, kVec> out;
#pragma unroll
        for (int v = 0; v < kVec; ++v) out.v[v] = PF::from_float(acc[v]);
        *reinterpret_cast<Pack<P, kVec>*>(dst + col) = out;
      }
    }
  }
  if (last_block_done(&c.local->done[2]) && threadIdx.x == 0 && !is_broken(c)) {
    const unsigned low = p.bad ? kBadArguments : (handle_epoch & 0x7fffffffu);
    for (int src = 0; src < R; ++src) {
      st_release_sys(flag_at(c.peers[src], s.region.combine_flag, c.rank), (static_cast<unsigned long long>(e) << 32) | low);
    }
  }
}

struct CombineReceiveParams {
  Shape s;
  Ctx c;
  bool bad = false;
  bool accumulate = false;
  int tokens = 0;
  const char* handle = nullptr;
  void* out = nullptr;  // [T, H] contiguous
  float* pick_values_out = nullptr;  // [T, K] or null
};

template <typename PF, typename OF, int kVec>
__global__ void __launch_bounds__(kThreads) combine_receive_kernel(CombineReceiveParams p) {
  using P = typename PF::Storage;
  using O = typename OF::Storage;
  const Ctx& c = p.c;
  if (is_broken(c)) return;
  const Shape& s = p.s;
  const int R = s.R;
  const unsigned e = c.local->combine_epoch + 1u;
  __shared__ unsigned low[kMaxRanks];
  if (!wait_all_peers(c, s, s.region.combine_flag, e, kStepCombinePartials, low)) return;
  if (threadIdx.x == 0) {
    const unsigned mine =
        p.bad ? kBadArguments
              : static_cast<unsigned>(reinterpret_cast<const long long*>(p.handle + s.handle.header)[detail::kEpoch]) &
                    0x7fffffffu;
    for (int d = 0; d < R; ++d) {
      if (low[d] == kBadArguments) {
        record_error(c, 1u /* kInvalidArgument */, kStepCombineArgs, d);
        break;
      }
      if (low[d] != mine) {
        record_error(c, 1u /* kInvalidArgument */, kStepCombineHandles, d);
        break;
      }
    }
  }
  __syncthreads();
  if (is_broken(c)) return;
  const std::int64_t H = s.H;
  const int* n_dest = reinterpret_cast<const int*>(p.handle + s.handle.n_dest);
  const P* partials = reinterpret_cast<const P*>(c.peers[c.rank] + s.region.partials);
  O* out = static_cast<O*>(p.out);
  const int lane = threadIdx.x & 31;
  const int warp_id = blockIdx.x * kWarps + (threadIdx.x >> 5);
  const float* values = reinterpret_cast<const float*>(c.peers[c.rank] + s.region.partial_values);
  const int K = s.K;
  for (int t = warp_id; t < p.tokens; t += gridDim.x * kWarps) {
    const int nd = n_dest[t];
    if (p.pick_values_out) {
      for (int k = lane; k < K; k += 32) {
        float v = 0.0f;
        for (int j = 0; j < nd; ++j) {
          const float in = load_cg(values + (static_cast<std::int64_t>(j) * s.max_tokens + t) * K + k);
          v = j == 0 ? in : v + in;
        }
        p.pick_values_out[static_cast<std::int64_t>(t) * K + k] = v;
      }
    }
    for (std::int64_t col = static_cast<std::int64_t>(lane) * kVec; col < H; col += 32 * kVec) {
      float sum[kVec];
#pragma unroll
      for (int v = 0; v < kVec; ++v) sum[v] = 0.0f;
      for (int j = 0; j < nd; ++j) {
        const Pack<P, kVec> in =
            load_cg(reinterpret_cast<const Pack<P, kVec>*>(partials + (static_cast<std::int64_t>(j) * s.max_tokens + t) * H + col));
#pragma unroll
        for (int v = 0; v < kVec; ++v) sum[v] = j == 0 ? PF::to_float(in.v[v]) : sum[v] + PF::to_float(in.v[v]);
      }
      O* o = out + static_cast<std::int64_t>(t) * H + col;
      Pack<O, kVec> res;
      if (p.accumulate) {
        const Pack<O, kVec> prev = *reinterpret_cast<const Pack<O, kVec>*>(o);
#pragma unroll
        for (int v = 0; v < kVec; ++v) res.v[v] = OF::from_float(sum[v] + OF::to_float(prev.v[v]));
      } else {
#pragma unroll
        for (int v = 0; v < kVec; ++v) res.v[v] = OF::from_float(sum[v]);
      }
      *reinterpret_cast<Pack<O, kVec>*>(o) = res;
    }
  }
  if (last_block_done(&c.local->done[3]) && threadIdx.x == 0 && !is_broken(c)) {
    for (int d = 0; d < R; ++d) st_release_sys(flag_at(c.peers[d], s.region.combine_ack, c.rank), e);
    c.local->combine_epoch = e;
  }
}

}  // namespace switchyard::ep::gpu
