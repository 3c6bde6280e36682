// Expert parallelism (docs/design.md section 6): dispatch tokens to the ranks that own their
// experts and combine the expert outputs back.
//
// This header is the contract. CpuGroup is its reference implementation: R ranks simulated by
// R threads of one process, each rank reading its peers' posted buffers directly. GpuGroup is the
// GPU transport (one-sided pushes over NVLink or within one GPU); for the same inputs its outputs
// are CpuGroup's, bit for bit.
//
// Experts are placed in contiguous blocks: rank r owns global experts [r*L, (r+1)*L), L = E/R,
// and its local expert l is global expert r*L + l.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "switchyard/layout.h"
#include "switchyard/status.h"
#include "switchyard/tensor.h"

namespace switchyard::ep {

struct GroupConfig {
  int num_ranks = 1;                // R >= 1
  int num_experts = 0;              // E, a multiple of R
  int top_k = 0;                    // K in [1, E]
  std::int64_t max_tokens = 0;      // tokens per rank and call, >= 1
  std::int64_t hidden = 0;          // H >= 1
  DType dtype = DType::kBFloat16;   // rows: bf16, fp16, fp32 or fp8 e4m3
  std::int64_t scale_cols = 0;      // fp32 scales moved with each row: 0, 1 (per token) or
                                    // ceil(H/128) (per 128-column group); fp8 rows only
  int tile_size = 1;                // M >= 1 of the expert-major layout
  double timeout_seconds = 30.0;    // bound of every wait for a peer, > 0
  DType partial_dtype = DType::kFloat32;  // combine: dtype of the per-rank partial sums sent back
                                          // to the source: fp32 (exact) or bf16 (half the bytes;
                                          // each partial is rounded to bf16, then summed in fp32)

  int experts_per_rank() const { return num_ranks > 0 ? num_experts / num_ranks : 0; }
};

// Checks a configuration alone; the message names the bad field.
Status validate(const GroupConfig& config);

// Rows a rank can receive in one dispatch: every peer's every token, R * max_tokens (a token
// goes at most once to each rank).
std::int64_t max_recv_rows(const GroupConfig& config);
// Capacity of the expert-major layout arrays and rows of a rank:
// max_permuted_rows(max_recv_rows, K, L, M).
std::int64_t max_expert_rows(const GroupConfig& config);

// Entries of DispatchOutputs::stats (int64).
enum DispatchStat : int {
  kRecvRows = 0,  // rows this rank received
  kSentRows = 1,  // (token, destination rank) pairs this rank sent
  kDropped = 2,   // this rank's input ids outside [0, E) other than -1 (not sent; data, not an error)
  kNumStats = 3,
};

// One rank's dispatch arguments: T <= max_tokens tokens.
struct DispatchInputs {
  TensorView x;             // [T,H] config.dtype; any row stride >= H
  TensorView scales;        // [T, scale_cols] fp32, contiguous; present iff scale_cols > 0
  TensorView topk_ids;      // [T,K] int32 or int64 global ids, contiguous; -1: no expert
  TensorView topk_weights;  // [T,K] fp32, contiguous
};

// One rank's dispatch outputs (caller-owned, contiguous; host memory for CpuGroup), sized by
// N = max_recv_rows and P = max_expert_rows. Received rows are ordered by source rank, then
// source token (DeepEP's order): deterministic. Rows >= stats[kRecvRows] are left untouched.
struct DispatchOutputs {
  // Rank-major output (always written).
  TensorView x;             // [N,H] config.dtype: the token's row
  TensorView scales;        // [N, scale_cols] fp32; present iff scale_cols > 0
  TensorView src_rank;      // [N] int32: source rank of each row
  TensorView src_token;     // [N] int32: token index at the source
  TensorView topk_ids;      // [N,K] int32: this rank's local expert id of each pick, -1 for
                            // experts elsewhere (and for -1 / out-of-range inputs)
  TensorView topk_weights;  // [N,K] fp32: the source's weights, unchanged
  TensorView stats;         // [kNumStats] int64
  // Expert-major output (optional: written when expert_x is present). The section 3 layout of
  // the received rows over this rank's L local experts with tile M (its "tokens" are the
  // received rows: T' = stats[kRecvRows], sentinels T'*K and T'), arrays sized for T' = N; and
  // the rows gathered into it, padding rows zero-filled: one copy per selected local expert,
  // ready for the grouped GEMM. Entries past the capacity of the T' received rows'
  // layout (max_permuted_rows(T', K, L, M) rows, max_tiles(T', ...) tiles, T' rows of
  // expanded_to_permuted) are left untouched, as layout() leaves entries past its capacity.
  Layout layout;            // arrays sized by max_permuted_rows / max_tiles(N, K, L, M)
  TensorView expert_x;      // [P,H] config.dtype
  TensorView expert_scales; // [P, scale_cols] fp32; present iff scale_cols > 0
  // GpuGroup only (CpuGroup ignores it): device memory the handle lives in, [handle_bytes] uint8,
  // 16-byte aligned, on the group's device. Written by dispatch, read by every combine and reuse
  // of the handle: keep it intact while the handle is used.
  TensorView handle_memory;
};

// Bytes of DispatchOutputs::handle_memory a GpuGroup dispatch needs.
std::int64_t handle_bytes(const GroupConfig& config);

// What combine needs from a dispatch: who sent which token where. Filled by dispatch; shared
// by the ranks' handles of one dispatch. A handle is valid until the group is destroyed.
class Handle {
 public:
  Handle();
  ~Handle();
  Handle(const Handle&);
  Handle& operator=(const Handle&);
  bool valid() const;

  struct Plan;  // implementation detail
  std::shared_ptr<const Plan> plan;
};

// combine: each rank reduces its local experts' outputs per received row, in fp32 in k order
// with fma (expert-major), or takes its per-row output as the rank's partial (rank-major); the
// source then sums, per token, the partials of the ranks it went to in rank order:
//   s = partial(first rank) + partial(next rank) + ... (fp32), 0 for a token sent nowhere,
//   out[t] = cast(s (+ out[t] when accumulate)).
// With R = 1 this is combine() of permute.h, bit for bit.
struct CombineInputs {
  bool expert_major = true;  // needs a dispatch that wrote the expert-major output on this rank
  // expert_major: y_perm [P,H] bf16, fp16 or fp32 (rows of the expert-major layout), weighted by
  //               the received topk_weights over this rank's local picks.
  // rank-major:   [N,H] bf16, fp16 or fp32: one row per received row, already reduced over
  //               this rank's experts by the caller (DeepEP's combine input).
  TensorView y;  // any row stride >= H
  // Expert-major only: false sums the local picks' rows without weights (the backward of
  // dispatch, docs/design.md section 7).
  bool weighted = true;
  // Optional per-pick fp32 values sent back with the rows (in a training backward: the gradient
  // of the dispatched weights; DeepEP's combined weights). pick_values [N,K] fp32, contiguous, on
  // this rank as destination: one value per received row and pick (a rank that passes none sends
  // zeros). pick_values_out [T,K] fp32, contiguous, on this rank as source (written when present):
  // per token, the sum of those values over the ranks it went to, in rank order, in fp32; 0 for
  // a token sent nowhere. A rank passing 0 for the picks it does not own makes each value
  // arrive unchanged at its pick.
  TensorView pick_values;
  TensorView pick_values_out;
};

// A group of R ranks simulated by threads (see the top of this file). Every collective call
// (dispatch, combine) must be made once by each rank, from its own thread, with its own
// arguments; a rank returns when the collective is complete everywhere. If any rank's arguments
// are invalid, every rank returns InvalidArgument naming that rank and argument, and nothing is
// written anywhere. A rank that does not arrive within timeout_seconds makes the waiting ranks
// return kTimeout naming it and the step; the group then refuses every further call (rebuild it).
// Ranks found in different calls (one in dispatch, another in combine) break the group the same
// way, with InvalidArgument.
class CpuGroup {
 public:
  static Status create(const GroupConfig& config, std::unique_ptr<CpuGroup>* group);
  ~CpuGroup();
  CpuGroup(const CpuGroup&) = delete;
  CpuGroup& operator=(const CpuGroup&) = delete;

  const GroupConfig& config() const;

  // Dispatch of rank `rank`'s tokens; *handle then describes this dispatch. With `reuse`, the
  // handle must come from an earlier dispatch of the same routing (same topk_ids on every rank,
  // checked here): a GPU transport skips the count exchange then (a training backward pass);
  // the outputs are the same as without it.
  Status dispatch(int rank, const DispatchInputs& in, const DispatchOutputs& out, Handle* handle,
                  bool reuse = false);

  // Combine for rank `rank`: out [T,H] bf16, fp16 or fp32, contiguous, T = the rank's token count
  // at the dispatch of `handle`; read too when `accumulate`.
  Status combine(int rank, const Handle& handle, const CombineInputs& in, const TensorView& out,
                 bool accumulate = false);

  // Non-empty once a wait timed out: the reason every later call fails.
  std::string broken_reason() const;

  struct State;  // implementation detail

 private:
  explicit CpuGroup(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// Options of a GpuGroup beyond the shared configuration.
struct GpuOptions {
  // true (worst-case mode, for decode and CUDA graphs): every count stays on the device; a call
  // never waits for the host. false (exact mode, for prefill and training): dispatch also
  // publishes the received row count to mapped pinned memory, read by received_rows().
  bool worst_case = true;
  // Blocks of each rank's transport kernels (dispatch and combine): the SMs they take from
  // overlapping work. 0: 24, or fewer when a loopback group's R ranks must share one GPU.
  int num_sms = 0;
  // Loopback only: the device's hardware work queues (CUDA_DEVICE_MAX_CONNECTIONS, 8 unless set
  // before CUDA starts). Each rank's stream needs its own queue, so R may not exceed it.
  int hardware_queues = 8;
};

// All-gather of bytes over the caller's process group (torch.distributed, MPI, a socket...):
// every rank passes `bytes` bytes in `send`, and `recv` receives R * bytes, rank r's at r * bytes.
using AllGather = std::function<Status(const void* send, std::size_t bytes, void* recv)>;

// The GPU transport (docs/design.md section 6). Each rank owns a region of region_bytes() in
// its GPU's memory, allocated at creation, which its peers write with one-sided stores: dispatch
// pushes each token once to every rank owning one of its experts, into a slot fixed by a prefix
// over the source's tokens (no atomics, no count exchange before the data), and publishes a
// per-(source, destination) header after the rows; combine pushes one partial row per (token,
// rank) back into the source's region, which sums them in rank order. Epoch counters on the
// device replace clean-up kernels; per-peer acknowledgements keep a fast rank's next call from
// overwriting slots a slow peer still reads, so back-to-back calls need no host synchronization.
//
// Calls are enqueue-only: they check their own arguments, enqueue kernels on `stream` and
// return. They allocate nothing and never synchronize with the host (exact mode's
// received_rows() excepted), so a whole dispatch -> experts -> combine step can be captured in a
// CUDA graph and replayed. Every collective call must be made by each rank, in the same order.
//
// Errors. A rank whose own arguments are bad returns InvalidArgument naming the argument, and
// tells its peers through its headers instead of sending rows; no rank writes its outputs, and
// every rank's check() then returns InvalidArgument naming that rank. A peer that does not
// arrive within config.timeout_seconds makes the waiting kernels stop (no trap, no hang) and
// check() return kTimeout naming the step and the rank. After either, the group refuses every
// call on that rank (rebuild it): the peers' kernels may have stopped anywhere.
//
// Memory ordering: rows, scales and metadata are plain stores; each block then meets at a block
// barrier, after which one thread executes a system-scope fence (fence.sc.sys) and counts the
// block done (cooperative groups' grid-sync pattern), and the last block to finish fences again
// and publishes each header with a system-scope release store. Receivers read headers with
// system-scope acquire loads, then a block barrier, and read the rows with L1-bypassing loads.
// The same release/acquire pairs carry the acknowledgements and the combine partials. A single
// GPU cannot show a missing system-scope fence (its writes all go through one L2): these
// orderings are argued from the PTX memory model, not shown by the loopback tests.
class GpuGroup {
 public:
  // R ranks simulated in this process on CUDA device `device`: region, kernels and protocol of
  // the real transport, for tests and for engine development without several GPUs. Each rank's
  // calls go on a stream of its own (two ranks' calls on one stream are refused), and the R
  // ranks' kernels must be resident together: creation refuses R above options.hardware_queues
  // or R x num_sms blocks that do not fit the device at the kernels' occupancy.
  static Status create_loopback(const GroupConfig& config, const GpuOptions& options, int device,
                                std::unique_ptr<GpuGroup>* group);
  // Rank `rank` of R processes, each on its own GPU (the current device), the regions mapped
  // through CUDA IPC handles exchanged with `all_gather`. Every rank must call it with the same
  // configuration (checked: a mismatch fails on every rank, naming the field and the ranks).
  static Status create_ipc(const GroupConfig& config, const GpuOptions& options, int rank,
                           const AllGather& all_gather, std::unique_ptr<GpuGroup>* group);
  ~GpuGroup();
  GpuGroup(const GpuGroup&) = delete;
  GpuGroup& operator=(const GpuGroup&) = delete;

  const GroupConfig& config() const;
  const GpuOptions& options() const;
  // Ranks this process drives: all R of a loopback group, one of an IPC group.
  bool is_local(int rank) const;

  // Dispatch: CpuGroup::dispatch's contract, with device tensors on the group's device and
  // out.handle_memory present. Rows >= the received count are untouched, as on the CPU; the
  // count is stats[kRecvRows] on the device (and received_rows() in exact mode). With `reuse`,
  // the handle must come from an earlier dispatch of this group with the same routing (not
  // checked on the GPU: the caller vouches for it); the per-token destinations are not derived
  // again.
  Status dispatch(int rank, const DispatchInputs& in, const DispatchOutputs& out, Handle* handle,
                  bool reuse = false, Stream stream = nullptr);

  // The handle of an earlier dispatch of rank `rank`, rebuilt from that dispatch's
  // out.handle_memory, its token count and whether it wrote the expert-major output (for
  // frameworks whose graphs carry tensors, not handles). Not checked on the GPU: the memory must
  // hold that dispatch's handle, as written by it.
  Status adopt_handle(int rank, const TensorView& handle_memory, std::int64_t tokens, bool expert_major,
                      Handle* handle) const;

  // Exact mode: the rows rank `rank` received in its latest dispatch. Waits (at most the
  // group's timeout) until the count is published, which happens once every peer's rows have
  // arrived, before they are copied out: call it after every rank's dispatch is enqueued.
  Status received_rows(int rank, std::int64_t* rows);

  // Combine: CpuGroup::combine's contract (out on the group's device, contiguous).
  Status combine(int rank, const Handle& handle, const CombineInputs& in, const TensorView& out,
                 bool accumulate = false, Stream stream = nullptr);

  // The error the device reported for rank `rank` so far (kTimeout, InvalidArgument), or Ok.
  // Reads mapped host memory: no synchronization, so it sees what kernels have already written.
  Status check(int rank) const;

  // Bytes of the region each rank allocates.
  static std::int64_t region_bytes(const GroupConfig& config);

  struct State;  // implementation detail

 private:
  explicit GpuGroup(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// Runs fn(rank) for rank = 0..R-1 on R threads and returns the first non-ok Status (by rank).
Status run_ranks(int num_ranks, const std::function<Status(int rank)>& fn);

}  // namespace switchyard::ep
