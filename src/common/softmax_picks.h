// The p test of softmax picks selected by their logits: the staged kernels' softmax -> normalize rows
// (cuda/routing/route_staged.cuh, StagedRule::kSoftmaxPicks) and the CPU test that checks it against the
// oracle (tests/routing/routing_cpu_test.cpp, SoftmaxPicksTest).
//
// The oracle ranks by p = exp(s - m) / sum (m: the row's largest finite logit), which is non-decreasing
// in s but can be equal for unequal logits, and then ranks the lower expert first. With t = exp(s - m)
// and m the first pick's logit, the logits' order is the oracle's when the picks are finite, t of the
// K-th pick is not tiny (its p is then a normal number, as sum <= E), every finite logit left out has t
// at least a factor 1 + 2^-18 below it (exp_f32 is within an ulp or so of exp, and the rounding of s - m
// and of the division is monotone: every such p is then below the K-th's), and so has any pick whose
// successor in the order is a lower expert with a smaller logit.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/host_device.h"
#include "common/routing_math.h"

namespace switchyard::detail {

inline constexpr float kSoftmaxPickMargin = 1.0f + 0x1p-18f;

// Whether the order of the K <= kN picks by logit might not be the oracle's p order (the row is then
// routed exactly). s, key, e: the picks' logits, ordered keys and experts in (logit desc, expert asc)
// order; after_s: the best logit left out (or an upper bound on the distinct ones: see
// route_staged.cuh); exp_fn: exp_f32 or a function with its bits. Writes t[k] = exp(s[k] - s[0]) for
// k < K, 0 past K.
template <int kN, typename ExpFn>
SY_HD bool softmax_picks_doubtful(int K, const float (&s)[kN], const std::uint32_t (&key)[kN],
                                  const int (&e)[kN], float after_s, ExpFn exp_fn, float (&t)[kN]) {
  const unsigned kth_bit = 1u << (K - 1);  // selects, not k == K - 1 (which compiles to indexed loads)
  const float m = s[0];
  bool doubt = !finite_abs(m);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int k = 0; k < kN; ++k) {
    t[k] = k < K ? exp_fn(s[k] - m) : 0.0f;
    if ((kth_bit >> k) & 1u) doubt = doubt || !finite_abs(s[k]) || t[k] < 0x1p-100f;
    if (k > 0 && k < K)
      doubt = doubt || (key[k] != key[k - 1] && e[k] < e[k - 1] && !(t[k - 1] > t[k] * kSoftmaxPickMargin));
  }
  float t_kth = t[0];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int k = 1; k < kN; ++k) t_kth = (kth_bit >> k) & 1u ? t[k] : t_kth;
  // A left-out -inf or NaN has no p the oracle compares (it ranks below every finite one).
  if (finite_abs(after_s)) doubt = doubt || !(t_kth > exp_fn(after_s - m) * kSoftmaxPickMargin);
  return doubt;
}

}  // namespace switchyard::detail
