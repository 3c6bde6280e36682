// Routing: logits [T,E] -> topk_ids [T,K], topk_weights [T,K]. docs/design.md section 2.
#pragma once

#include <string>
#include <vector>

#include "switchyard/status.h"
#include "switchyard/tensor.h"

namespace switchyard {

// Pre-score p = pre(s), per row, in fp32.
enum class PreFn : int {
  kNone = 0,         // p = s
  kSoftmax = 1,      // softmax over the row's finite logits (max-subtracted)
  kSigmoid = 2,      // p = 1 / (1 + exp(-s))
  kSqrtSoftplus = 3, // p = sqrt(log(1 + exp(s)))
};

// Weights from the selected pre-scores p (never from the biased selection scores q).
enum class PostFn : int {
  kNone = 0,       // w = p[id]
  kSoftmax = 1,    // softmax over the K selected p
  kSigmoid = 2,    // w = sigmoid(p[id])
  kNormalize = 3,  // w = p[id] / (sum of the K selected p + 1e-20)
};

// How a group of experts is scored when group limits are used.
enum class GroupRule : int {
  kNone = 0,     // no group limit
  kTop2Sum = 1,  // sum of the group's two largest q (DeepSeek-V3)
  kMax = 2,      // the group's largest q (DeepSeek-V2)
  kTopKSum = 3,  // sum of the group's K/topk_group largest q
};

struct RoutingConfig {
  int num_experts = 0;  // E >= 1
  int top_k = 0;        // 1 <= K <= E. CPU: any such K. CUDA: K <= kMaxGpuTopK.
  PreFn pre = PreFn::kNone;
  PostFn post = PostFn::kSoftmax;
  // Group limit: E % n_group == 0; only the best topk_group groups compete. Used when
  // group_rule != kNone; then 1 <= topk_group <= n_group and topk_group * (E / n_group) >= K.
  GroupRule group_rule = GroupRule::kNone;
  int n_group = 1;
  int topk_group = 1;
  float scale = 1.0f;  // routed scaling factor applied to every weight (finite)
};

constexpr int kMaxGpuTopK = 32;
constexpr int kMaxGpuExperts = 4096;

// Checks a configuration alone (no tensors); the message names the bad field.
Status validate(const RoutingConfig& config);

// A model's routing rule and its hidden size (for data-movement work). The table of
// docs/design.md section 2.
struct ModelPreset {
  std::string name;  // "deepseek-v3", "qwen3-next-80b", ...
  RoutingConfig routing;
  bool has_bias = false;  // the model carries a per-expert selection bias
  int hidden_size = 0;
};

// Every preset of docs/design.md, in table order.
const std::vector<ModelPreset>& model_presets();
// The preset named `name`; InvalidArgument listing the known names otherwise.
Status find_preset(const std::string& name, ModelPreset* preset);

// route: for each token row t of `logits`:
//   p = pre(s); q = p + bias (bias only for selection); optional group limit on q;
//   topk_ids[t] = the K experts with the largest q among those left, in descending q,
//   equal q -> lower expert index first; topk_weights[t] = post(p[ids]) * scale.
//
// Non-finite logits: an expert whose logit is NaN or -inf ranks below every finite one, one
// whose logit is +inf above every finite one (ties by expert index); the pre-scores of the
// finite logits are computed over the finite logits alone. A pick whose q is not finite gets
// weight 0 and is left out of the post softmax/normalize sums. Each row gets K distinct ids
// and no NaN is ever written.
//
// Arguments (all on one device; CUDA calls are asynchronous on `stream`):
//   logits       [T,E] fp32, bf16 or fp16; any row stride >= E.
//   bias         optional [E] fp32 or bf16 (TensorView{} when absent).
//   topk_ids     [T,K] int32 or int64, contiguous (written).
//   topk_weights [T,K] fp32 or bf16, contiguous (written).
// T = 0 is valid and writes nothing. On any error nothing is written.
//
// Exact arithmetic (so that every backend gives the same bits, and so the same ids on ties):
// exp and log are Switchyard's own fp32 routines built from IEEE operations and fma; the
// softmax denominator over E is the sum of 32 partial sums, partial j adding in ascending
// order the experts e with (e / 4) % 32 == j, combined by a butterfly (xor 16, 8, 4, 2, 1);
// the post softmax and normalize sums run in k order. One exception to equal bits: softmax ->
// normalize without a bias or group limit (E % 32 == 0, K <= 8, large T: from 16384 rows with bf16
// logits, 32768 with fp32) takes its weights on the CUDA backend from the K picks alone (the full
// softmax cancels out of the normalisation), within 1e-6 relative of the CPU backend's; the ids
// are the same.
//
// `options` forces kernel forms the CUDA backend otherwise picks from the call's shape (tests reach
// every form with them; measurements compare forms in one process). Every choice gives the same
// ids and weights; where a forced form cannot serve the call, the default is taken. The CPU
// backend has one form and ignores them.
struct RouteOptions {
  enum class Choice { kAuto, kNever, kAlways };
  // Rows of up to 128 experts: one warp per row, narrow segments of one or two stripes, or one
  // thread per row (where that fits: E <= 16, K <= 8), at every T.
  enum class SmallRowForm { kAuto, kWarp, kNarrow, kNarrow2, kRows };
  SmallRowForm small_row_form = SmallRowForm::kAuto;
  bool narrow_packed = true;       // narrow segments on packed candidate buffers where K fits them
  Choice streamed = Choice::kAuto;  // streamed narrow segments (129-192 experts, no group limit)
  Choice staged = Choice::kAuto;    // the staged kernels (softmax picks, sigmoid + bias rows)
  // Staged sigmoid + bias rows select on approximate sigmoids and then certify every decision on
  // exact ones, routing a doubtful row again exactly (same ids and weights; 5-16% faster where the
  // staged kernels run); false: exact sigmoids throughout.
  bool staged_approx = true;
  // Wide rows (E > 512 without a group limit) on packed candidate buffers at every T; off: from
  // the row count where they are faster.
  bool wide_packed_always = false;
};

Status route(const RoutingConfig& config, const TensorView& logits, const TensorView& bias,
             const TensorView& topk_ids, const TensorView& topk_weights, Stream stream = nullptr,
             const RouteOptions& options = RouteOptions());

// route_backward: d logits from d weights for route()'s picks (docs/design.md section 7). The
// selection (top-K, groups, bias) is piecewise constant and passes no gradient; the gradient goes
// through post, scale and pre:
//   u[k] = grad_weights[t,k] * scale for a valid pick (its logit, and its bias if any, finite;
//          id in [0, E)), else 0; dg = post's backward (softmax: w (u - sum w u); normalize:
//          u / d - (sum u g) / d^2 with d = sum g + 1e-20; sigmoid: u sg (1 - sg)); then per
//          expert dp = the dg of the picks naming it, and grad_logits = pre's backward (softmax:
//          p (dp - sum_k p[k] dg[k]); sigmoid: dp p (1 - p); sqrtsoftplus: dp sigmoid(s) / (2 p));
//          0 where the logit is not finite.
// p is recomputed from the logits as route() computes it (softmax over the finite logits with
// the canonical denominator); sums run in k order. The CPU and CUDA backends give the same bits.
//   logits, bias   route()'s inputs (bias only decides which picks are valid).
//   topk_ids       [T,K] int32 or int64: route()'s picks.
//   grad_weights   [T,K] fp32 or bf16, contiguous.
//   grad_logits    [T,E] in the logits' dtype, contiguous: every element written.
Status route_backward(const RoutingConfig& config, const TensorView& logits, const TensorView& bias,
                      const TensorView& topk_ids, const TensorView& grad_weights, const TensorView& grad_logits,
                      Stream stream = nullptr);

}  // namespace switchyard
