// Routing arithmetic shared, operation for operation, by the CPU backend and the CUDA kernels.
// Everything here is built from IEEE-exact operations (add, mul, div, sqrt, rint) and explicit
// fma, so host and device produce the same bits; the CUDA routing sources are also compiled
// with -fmad=false so that no other multiply-add is contracted. That is what lets the GPU
// tests demand the CPU oracle's ids exactly, tie order included.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/host_device.h"
#include "common/numeric.h"
#include "switchyard/routing.h"

namespace switchyard::detail {

SY_HD bool is_finite(float x) { return (float_bits(x) & 0x7f800000u) != 0x7f800000u; }
// The same test as |x| < inf, the form the CUDA kernels use (route_warp.cuh, softmax_picks.h).
SY_HD bool finite_abs(float x) { return fabsf(x) < bits_float(0x7f800000u); }
SY_HD bool is_nan(float x) { return (float_bits(x) & 0x7fffffffu) > 0x7f800000u; }
SY_HD float neg_inf() { return bits_float(0xff800000u); }
SY_HD float pos_inf() { return bits_float(0x7f800000u); }
// NaN ranks with -inf (docs/design.md 2.6): every selection score is canonicalized through this.
SY_HD float canonical_score(float x) { return is_nan(x) ? neg_inf() : x; }

// 2^n for n in [-126, 127], exact.
SY_HD float exp2_int(int n) { return bits_float(static_cast<std::uint32_t>(n + 127) << 23); }

// exp(x) in fp32, within about 1 ulp: x = n*ln2 + r with |r| <= ln2/2, a degree-7 Taylor
// polynomial for exp(r) (truncation error < 0.1 ulp), then two exact-or-once-rounded scalings.
SY_HD float exp_f32(float x) {
  if (is_nan(x)) return x;
  if (x > 88.72283935546875f) return pos_inf();
  if (x < -103.972084045410156f) return 0.0f;
  const float n = rintf(x * 1.44269502162933349609375f);
  float r = fmaf(n, -0.693145751953125f, x);  // ln2 split: the high part is exact in n*hi
  r = fmaf(n, -1.428606765330187045e-06f, r);
  float p = 1.98412698412698e-04f;  // 1/7!
  p = fmaf(p, r, 1.38888888888889e-03f);
  p = fmaf(p, r, 8.33333333333333e-03f);
  p = fmaf(p, r, 4.16666666666667e-02f);
  p = fmaf(p, r, 1.66666666666667e-01f);
  p = fmaf(p, r, 0.5f);
  p = fmaf(p, r, 1.0f);
  p = fmaf(p, r, 1.0f);
  const int ni = static_cast<int>(n);
  const int n1 = ni / 2;
  const int n2 = ni - n1;
  return (p * exp2_int(n1)) * exp2_int(n2);
}

// log(u) for u in [1, 2]: u = 2^k * m with m in [sqrt(1/2), sqrt(2)], then
// log(m) = 2 atanh(z), z = (m-1)/(m+1), |z| <= 0.1716, six terms of the odd series.
SY_HD float log_1_to_2(float u) {
  int k = 0;
  if (u > 1.41421353816986083984375f) {
    u = u * 0.5f;
    k = 1;
  }
  const float z = (u - 1.0f) / (u + 1.0f);
  const float z2 = z * z;
  float s = 1.0f / 11.0f;
  s = fmaf(s, z2, 1.0f / 9.0f);
  s = fmaf(s, z2, 1.0f / 7.0f);
  s = fmaf(s, z2, 1.0f / 5.0f);
  s = fmaf(s, z2, 1.0f / 3.0f);
  s = fmaf(s, z2, 1.0f);
  const float two_z = 2.0f * z;
  return fmaf(two_z, s, static_cast<float>(k) * 0.693147180559945309f);
}

// log(1 + y) for y in [0, 1], accurate for tiny y (Goldberg: log(u) * y / (u - 1)).
SY_HD float log1p_0_to_1(float y) {
  const float u = 1.0f + y;
  if (u == 1.0f) return y;
  return log_1_to_2(u) * (y / (u - 1.0f));
}

SY_HD float sigmoid_f32(float x) { return 1.0f / (1.0f + exp_f32(-x)); }

// softplus(x) = max(x, 0) + log(1 + exp(-|x|)).
SY_HD float softplus_f32(float x) {
  const float ax = fabsf(x);
  return (x > 0.0f ? x : 0.0f) + log1p_0_to_1(exp_f32(-ax));
}

// Element-wise pre functions (softmax is a row operation: see below). A non-finite logit
// keeps its value as its score, so that it ranks as docs/design.md 2.6 says.
SY_HD float pre_elementwise(PreFn pre, float s) {
  if (!is_finite(s)) return s;
  switch (pre) {
    case PreFn::kSigmoid:
      return sigmoid_f32(s);
    case PreFn::kSqrtSoftplus:
      return sqrtf(softplus_f32(s));
    default:
      return s;
  }
}

// The canonical layout of the softmax denominator: expert e belongs to partial sum
// (e / 4) % 32, each partial adds its experts in ascending e, and the 32 partials are
// combined by a butterfly with xor offsets 16, 8, 4, 2, 1. A warp holding four consecutive
// experts per lane computes exactly this with shuffles.
constexpr int kSoftmaxLanes = 32;
constexpr int kSoftmaxChunk = 4;
SY_HD int softmax_partial_of(int e) { return (e / kSoftmaxChunk) % kSoftmaxLanes; }

// Comparison of two candidates: larger canonical score first, equal -> lower index first.
SY_HD bool ranks_before(float score_a, int index_a, float score_b, int index_b) {
  return score_a > score_b || (score_a == score_b && index_a < index_b);
}

// Post functions over the K picks. `pick_p[k]` is p of pick k and `finite[k]` whether its
// selection score was finite (otherwise its weight is 0 and it is left out of the sums).
// Sums run in k order. Writes K weights, already multiplied by `scale`.
template <typename FiniteFn, typename PFn, typename OutFn>
SY_HD void post_weights(PostFn post, int k_count, float scale, FiniteFn finite, PFn pick_p,
                        OutFn out) {
  if (post == PostFn::kSoftmax) {
    float m = neg_inf();
    for (int k = 0; k < k_count; ++k)
      if (finite(k) && pick_p(k) > m) m = pick_p(k);
    float sum = 0.0f;
    for (int k = 0; k < k_count; ++k)
      if (finite(k)) sum = sum + exp_f32(pick_p(k) - m);
    for (int k = 0; k < k_count; ++k)
      out(k, finite(k) ? (exp_f32(pick_p(k) - m) / sum) * scale : 0.0f);
  } else if (post == PostFn::kNormalize) {
    float sum = 0.0f;
    for (int k = 0; k < k_count; ++k)
      if (finite(k)) sum = sum + pick_p(k);
    const float denom = sum + 1e-20f;
    for (int k = 0; k < k_count; ++k) out(k, finite(k) ? (pick_p(k) / denom) * scale : 0.0f);
  } else if (post == PostFn::kSigmoid) {
    for (int k = 0; k < k_count; ++k)
      out(k, finite(k) ? sigmoid_f32(pick_p(k)) * scale : 0.0f);
  } else {
    for (int k = 0; k < k_count; ++k) out(k, finite(k) ? pick_p(k) * scale : 0.0f);
  }
}

}  // namespace switchyard::detail
