// CPU routing: the oracle of the CUDA routing kernels. Every floating-point step goes
// through common/routing_math.h in the order its comments fix, so the kernels can match it
// bit for bit.
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "common/numeric.h"
#include "common/op_args.h"
#include "common/routing_math.h"
#include "cpu/backend.h"
#include "cpu/elements.h"
#include "cpu/parallel.h"
#include "cpu/routing/routing_cpu.h"

namespace switchyard::cpu {

namespace {

using detail::canonical_score;
using detail::is_finite;
using detail::ranks_before;

// Per-thread scratch for one row.
struct RowScratch {
  std::vector<float> p, q, group_score;
  std::vector<int> order, groups;
  std::vector<char> allowed;
  explicit RowScratch(int E, int n_group) : p(E), q(E), group_score(n_group), order(E), groups(n_group), allowed(E) {}
};

// p = pre(s) for one row (docs/design.md 2.1), with the canonical softmax denominator.
void pre_scores(PreFn pre, const float* s, int E, float* p) {
  if (pre != PreFn::kSoftmax) {
    for (int e = 0; e < E; ++e) p[e] = detail::pre_elementwise(pre, s[e]);
    return;
  }
  float m = 0.0f, sum = 0.0f;
  canonical_softmax_terms(s, E, &m, &sum);
  for (int e = 0; e < E; ++e) p[e] = is_finite(s[e]) ? detail::exp_f32(s[e] - m) / sum : s[e];
}

// Marks in `allowed` the experts of the best topk_group groups (docs/design.md 2.3).
void group_limit(const RoutingConfig& c, RowScratch& r) {
  const int E = c.num_experts;
  const int G = E / c.n_group;
  const int take = c.group_rule == GroupRule::kTop2Sum ? 2 : c.group_rule == GroupRule::kMax ? 1 : c.top_k / c.topk_group;
  for (int g = 0; g < c.n_group; ++g) {
    int* idx = r.order.data() + g * G;
    std::iota(idx, idx + G, g * G);
    const int n = std::min(take, G);
    std::partial_sort(idx, idx + n, idx + G, [&](int a, int b) { return ranks_before(r.q[a], a, r.q[b], b); });
    float score = r.q[idx[0]];
    for (int i = 1; i < n; ++i) score = score + r.q[idx[i]];
    r.group_score[g] = canonical_score(score);
  }
  std::iota(r.groups.begin(), r.groups.end(), 0);
  std::partial_sort(r.groups.begin(), r.groups.begin() + c.topk_group, r.groups.end(), [&](int a, int b) {
    return ranks_before(r.group_score[a], a, r.group_score[b], b);
  });
  std::fill(r.allowed.begin(), r.allowed.end(), 0);
  for (int i = 0; i < c.topk_group; ++i) {
    const int g = r.groups[i];
    std::fill(r.allowed.begin() + g * G, r.allowed.begin() + (g + 1) * G, 1);
  }
}

void route_row(const detail::RouteArgs& a, std::int64_t t, std::vector<float>& s, RowScratch& r) {
  const RoutingConfig& c = a.config;
  const int E = c.num_experts;
  const int K = c.top_k;
  const std::int64_t row = t * a.logits_row_stride;
  for (int e = 0; e < E; ++e) s[e] = load_float(a.logits, a.logits_dtype, row + e);
  pre_scores(c.pre, s.data(), E, r.p.data());
  for (int e = 0; e < E; ++e) {
    const float b = a.bias ? load_float(a.bias, a.bias_dtype, e) : 0.0f;
    r.q[e] = canonical_score(a.bias ? r.p[e] + b : r.p[e]);
  }
  int candidates = E;
  if (c.group_rule != GroupRule::kNone) {
    group_limit(c, r);
    candidates = 0;
    for (int e = 0; e < E; ++e)
      if (r.allowed[e]) r.order[candidates++] = e;
  } else {
    std::iota(r.order.begin(), r.order.end(), 0);
  }
  std::partial_sort(r.order.begin(), r.order.begin() + K, r.order.begin() + candidates,
                    [&](int x, int y) { return ranks_before(r.q[x], x, r.q[y], y); });
  const std::int64_t out = t * K;
  for (int k = 0; k < K; ++k) {
    if (a.ids_dtype == DType::kInt64) static_cast<std::int64_t*>(a.topk_ids)[out + k] = r.order[k];
    else static_cast<std::int32_t*>(a.topk_ids)[out + k] = r.order[k];
  }
  detail::post_weights(
      c.post, K, c.scale, [&](int k) { return is_finite(r.q[r.order[k]]); }, [&](int k) { return r.p[r.order[k]]; },
      [&](int k, float w) {
        if (a.weights_dtype == DType::kBFloat16) static_cast<std::uint16_t*>(a.topk_weights)[out + k] = detail::float_to_bf16(w);
        else static_cast<float*>(a.topk_weights)[out + k] = w;
      });
}

}  // namespace

Status route(const detail::RouteArgs& args) {
  const int E = args.config.num_experts;
  const std::int64_t grain = std::max<std::int64_t>(1, 65536 / E);
  parallel_for(args.num_tokens, grain, [&](std::int64_t begin, std::int64_t end) {
    std::vector<float> s(E);
    // n_group is only validated (1 <= n_group <= E) when a group rule is used; otherwise it is
    // ignored and may hold anything, so it must not size an allocation.
    RowScratch scratch(E, args.config.group_rule == GroupRule::kNone ? 1 : args.config.n_group);
    for (std::int64_t t = begin; t < end; ++t) route_row(args, t, s, scratch);
  });
  return Status::Ok();
}

void canonical_softmax_terms(const float* s, int E, float* m, float* sum) {
  float max = detail::neg_inf();
  for (int e = 0; e < E; ++e)
    if (is_finite(s[e]) && s[e] > max) max = s[e];
  float partial[detail::kSoftmaxLanes] = {};
  for (int e = 0; e < E; ++e)
    if (is_finite(s[e])) partial[detail::softmax_partial_of(e)] += detail::exp_f32(s[e] - max);
  for (int offset = detail::kSoftmaxLanes / 2; offset >= 1; offset /= 2) {
    float next[detail::kSoftmaxLanes];
    for (int j = 0; j < detail::kSoftmaxLanes; ++j) next[j] = partial[j] + partial[j ^ offset];
    std::copy(next, next + detail::kSoftmaxLanes, partial);
  }
  *m = max;
  *sum = partial[0];
}

}  // namespace switchyard::cpu
