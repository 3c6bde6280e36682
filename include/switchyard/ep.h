// Expert parallelism (DESIGN.md section 6): dispatch tokens to the ranks that own their experts
// and combine the expert outputs back.
//
// This header is the contract, and CpuGroup its reference implementation: R ranks simulated by
// R threads of one process, each rank reading its peers' posted buffers directly (as a GPU rank
// will read its NVLink peers' memory), with the same outputs, ordering, arithmetic and failure
// behaviour the GPU transport will have. It is the oracle the GPU kernels will be tested
// against, and lets engines develop against the API without several GPUs.
//
// Experts are placed in contiguous blocks: rank r owns global experts [r*L, (r+1)*L), L = E/R,
// and its local expert l is global expert r*L + l.
#pragma once

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
};

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

// Runs fn(rank) for rank = 0..R-1 on R threads and returns the first non-ok Status (by rank).
Status run_ranks(int num_ranks, const std::function<Status(int rank)>& fn);

}  // namespace switchyard::ep
