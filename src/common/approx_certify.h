// Certification of a selection made on approximate sigmoid + bias scores (route_staged.cuh's kApprox
// rows), shared by the kernels and the CPU test that checks it (tests/routing/routing_cpu_test.cpp,
// ApproxCertifyTest: a model of the selection with sigmoids off by up to the error bound, every
// certified row against the oracle).
//
// The oracle's selection score of expert e is q = RN(sigmoid(s) + b). The approximate pass keys
// q' = RN(sigmoid'(s) + b) with |sigmoid'(s) - sigmoid(s)| <= sig_err (non-finite q are exact: they
// come from non-finite logits, which take the exact sigmoid, or from non-finite biases; a finite q is
// never rounded to an infinity, as |sigmoid| <= 1). The two roundings of the bias add are half an ulp
// each (subnormal ulps are far below sig_err), so
//   |q' - q| <= sig_err + 2^-23 |q'|   (to first order; the margins below have a factor 4 to spare)
// and, as q' + 2^-23 |q'| grows with q', an expert left out with q' <= u has q <= u + sig_err +
// 2^-23 |u|. The picks are the oracle's K best when each one's exact q is above
// u + 4 (sig_err + 2^-23 |u|) (u: the top of the bucket of the best key left out, say), and their
// order is then that of their exact (key desc, expert asc).
// Groups: a score RN(q1 + q2) of a group's two best (1-Lipschitz: the two best q' are within the
// bound of the two best q) may sum values of unlike signs, so its error is bounded through B, the
// largest finite |b| of the row (every finite |q| <= B + 1): dq = sig_err + 2^-23 (B + 1), and the
// score moves by at most 2 dq + 2^-22 (B + 1) <= 4 dq. The kept groups are the oracle's when the
// worst kept approximate score minus the best dropped one is above 16 dq (2 x 4 dq for the two scores,
// twice as much again for the rounding of that difference and of dq itself); a best dropped score of
// -inf is exact (every dropped group is then -inf, and the finite groups are all kept).
#pragma once

#include <cmath>

#include "common/host_device.h"
#include "common/routing_math.h"

namespace switchyard::detail {

struct ApproxMargins {
  float sig_err;  // the approximate sigmoid's bound
  float group;    // the worst kept group score minus the best dropped one must exceed this
};

// b_max: the largest |b| over the row's finite bias values (0 when there are none).
SY_HD ApproxMargins approx_margins(float b_max, float sig_err) {
  return {sig_err, 16.0f * (sig_err + 0x1p-23f * (b_max + 1.0f))};
}

// Whether the exact q of the worst pick (`worst_pick_q`, canonical: NaN -> -inf) is above every left-out
// expert's exact q, given u >= every left-out expert's approximate q' (any value; NaN: not certified).
SY_HD bool approx_picks_certified(float worst_pick_q, float u, const ApproxMargins& m) {
  if (u == neg_inf()) return worst_pick_q > u;  // exact: the picks must be finite (or +inf)
  return worst_pick_q > u + 4.0f * (m.sig_err + 0x1p-23f * fabsf(u));  // u = +inf or NaN: false
}

// Whether the kept groups (worst approximate score `kept_min`) are the oracle's, given `dropped_max`,
// the best approximate score of a group not kept (-inf when none).
SY_HD bool approx_groups_certified(float kept_min, float dropped_max, const ApproxMargins& m) {
  if (dropped_max == neg_inf()) return true;
  return kept_min - dropped_max > m.group;  // inf - inf = NaN: false
}

}  // namespace switchyard::detail
