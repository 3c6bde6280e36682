// Arithmetic of route_backward (include/switchyard/routing.h) shared, operation for operation, by
// the CPU oracle and the CUDA kernel, as routing_math.h is for route(): IEEE-exact operations,
// exp/sigmoid/softplus from routing_math.h, sums in a stated order. Both backends therefore
// produce the same bits (the CUDA source is compiled with -fmad=false, the CPU's with
// -ffp-contract=off).
#pragma once

#include "common/host_device.h"
#include "common/routing_math.h"
#include "switchyard/routing.h"

namespace switchyard::detail {

// p = pre(s) of one finite logit; softmax takes the row's max m over its finite logits and the
// canonical denominator `sum` (routing_math.h).
SY_HD float pre_value(PreFn pre, float s, float m, float sum) {
  return pre == PreFn::kSoftmax ? exp_f32(s - m) / sum : pre_elementwise(pre, s);
}

// d pre / d s times dp at one finite logit, for the elementwise pre functions (softmax is a row
// operation: p * (dp - c), see route_backward_row). p = pre(s).
SY_HD float pre_backward_elementwise(PreFn pre, float s, float p, float dp) {
  switch (pre) {
    case PreFn::kSigmoid:
      return (dp * p) * (1.0f - p);
    case PreFn::kSqrtSoftplus:
      // p = sqrt(softplus(s)): dp/ds = sigmoid(s) / (2 p); p > 0 for every finite s.
      return p > 0.0f ? (dp * sigmoid_f32(s)) / (2.0f * p) : 0.0f;
    default:
      return dp;
  }
}

// The post function's backward over the K picks: dg[k] = d loss / d p[k] from u[k] = d loss /
// d w[k] * scale (0 for a pick that is not valid). g(k): p of pick k; valid(k): whether its
// selection score was finite. Every sum runs in k order. Writes dg(k, value), 0 for invalid picks.
template <typename GFn, typename ValidFn, typename UFn, typename OutFn>
SY_HD void post_backward(PostFn post, int k_count, GFn g, ValidFn valid, UFn u, OutFn dg) {
  if (post == PostFn::kSoftmax) {
    float m = neg_inf();
    for (int k = 0; k < k_count; ++k)
      if (valid(k) && g(k) > m) m = g(k);
    float z = 0.0f;
    for (int k = 0; k < k_count; ++k)
      if (valid(k)) z = z + exp_f32(g(k) - m);
    float a = 0.0f;  // sum of w * u
    for (int k = 0; k < k_count; ++k)
      if (valid(k)) a = a + (exp_f32(g(k) - m) / z) * u(k);
    for (int k = 0; k < k_count; ++k) dg(k, valid(k) ? (exp_f32(g(k) - m) / z) * (u(k) - a) : 0.0f);
  } else if (post == PostFn::kNormalize) {
    float sum = 0.0f, b = 0.0f;
    for (int k = 0; k < k_count; ++k) {
      if (!valid(k)) continue;
      sum = sum + g(k);
      b = b + u(k) * g(k);
    }
    const float denom = sum + 1e-20f;
    for (int k = 0; k < k_count; ++k) dg(k, valid(k) ? u(k) / denom - b / (denom * denom) : 0.0f);
  } else if (post == PostFn::kSigmoid) {
    for (int k = 0; k < k_count; ++k) {
      const float sg = sigmoid_f32(g(k));
      dg(k, valid(k) ? (u(k) * sg) * (1.0f - sg) : 0.0f);
    }
  } else {
    for (int k = 0; k < k_count; ++k) dg(k, valid(k) ? u(k) : 0.0f);
  }
}

}  // namespace switchyard::detail
