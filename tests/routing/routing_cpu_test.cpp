// switchyard::route on the CPU against a brute-force fp64 reference written in this file from the
// formulas of docs/design.md section 2 (std::exp, std::log1p, std::sqrt; nothing from routing_math.h).
//
// The library computes in fp32 with its own exp, so on a near-tie it may legitimately pick
// differently from the fp64 reference. Every row is therefore checked in layers:
//   (a) K distinct ids in [0, E); every output element written (outputs are poisoned first);
//   (b) the selection is right up to a small tolerance: the groups used may only be ones the
//       reference keeps (up to tolerance), every chosen expert's reference q is >= every
//       unchosen allowed expert's q minus the tolerance, the output order is descending in q
//       within the tolerance, and EXACT reference ties are broken by the lower index;
//   (c) where the reference has no near-tie (gap > kExactGap), the ids equal the reference's
//       exactly (as a set across the K-th / K+1-th boundary, as a sequence inside the top-K);
//       tie-heavy inputs (exactly representable values) demand exact equality everywhere;
//   (d) weights, recomputed in fp64 for the ids the library chose, within 1e-5 relative
//       (+1e-6 absolute) for fp32 output; bf16 output equal to the rounded reference, or 1 ulp off
//       where the reference lies within that tolerance of a bf16 rounding midpoint.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/approx_certify.h"
#include "common/routing_math.h"
#include "common/routing_names.h"
#include "common/softmax_picks.h"
#include "common/test_data.h"
#include "common/top8_network.h"
#include "switchyard/switchyard.h"

namespace {

using switchyard::DType;
using switchyard::GroupRule;
using switchyard::PostFn;
using switchyard::PreFn;
using switchyard::RoutingConfig;
using switchyard::Status;
using switchyard::TensorView;

constexpr double kInf = std::numeric_limits<double>::infinity();
// Selection tolerance (b), relative to |p| + |bias| of the experts compared.
constexpr double kSelTol = 1e-5;
// Gap above which the fp32 library must agree with the fp64 reference exactly (c).
constexpr double kExactGap = 1e-4;
constexpr double kAbsTol = 1e-12;

// ---------------------------------------------------------------------------------------------
// 16-bit float encodings, written here independently of the library's numeric.h.

std::uint16_t fp16_bits(float f) {
  const std::uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  if (std::isnan(f)) return static_cast<std::uint16_t>(sign | 0x7e00);
  const double a = std::fabs(static_cast<double>(f));
  if (a >= 65520.0) return static_cast<std::uint16_t>(sign | 0x7c00);  // rounds to inf
  if (a < std::ldexp(1.0, -14)) {
    // subnormal: multiples of 2^-24; 1024 * 2^-24 is the smallest normal, whose bits are 0x0400
    const double m = std::nearbyint(a / std::ldexp(1.0, -24));
    return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(m));
  }
  int e2 = 0;
  std::frexp(a, &e2);
  int exponent = e2 - 1;  // a = 1.m * 2^exponent
  double m = std::nearbyint(a / std::ldexp(1.0, exponent - 10));
  if (m >= 2048.0) {
    m = 1024.0;
    ++exponent;
  }
  return static_cast<std::uint16_t>(sign | ((exponent + 15) << 10) | (static_cast<int>(m) - 1024));
}

double fp16_value(std::uint16_t h) {
  const double sign = (h & 0x8000) ? -1.0 : 1.0;
  const int exponent = (h >> 10) & 0x1f;
  const int mant = h & 0x3ff;
  if (exponent == 0) return sign * std::ldexp(static_cast<double>(mant), -24);
  if (exponent == 31) return mant ? std::numeric_limits<double>::quiet_NaN() : sign * kInf;
  return sign * std::ldexp(static_cast<double>(1024 + mant), exponent - 25);
}

// Position of a bf16 value on the number line, for ulp distances.
int bf16_key(std::uint16_t h) { return (h & 0x8000) ? -static_cast<int>(h & 0x7fff) : static_cast<int>(h); }

using sy_test::make_config;
using sy_test::post_name;
using sy_test::pre_name;
using sy_test::rule_name;

// ---------------------------------------------------------------------------------------------
// Host buffers of any dtype, with poison and element decode.

constexpr std::uint32_t kPoisonF32Bits = 0x7fa5a5a5u;  // a NaN: the router never writes one
constexpr std::uint16_t kPoisonBf16 = 0x7fa5;          // a NaN as well
constexpr std::int64_t kPoisonI64 = 0x5a5a5a5a5a5a5a5aLL;
constexpr std::size_t kGuard = 16;  // poisoned elements past the end of every output

struct Buffer {
  DType dtype = DType::kFloat32;
  std::size_t size = 0;
  std::vector<float> f32;
  std::vector<std::uint16_t> u16;
  std::vector<std::int32_t> i32;
  std::vector<std::int64_t> i64;

  Buffer() = default;
  Buffer(DType d, std::size_t n) : dtype(d), size(n) {
    switch (d) {
      case DType::kFloat32:
        f32.assign(n, 0.0f);
        break;
      case DType::kBFloat16:
      case DType::kFloat16:
        u16.assign(n, 0);
        break;
      case DType::kInt32:
        i32.assign(n, 0);
        break;
      default:
        i64.assign(n, 0);
        break;
    }
  }
  void* data() {
    switch (dtype) {
      case DType::kFloat32:
        return f32.data();
      case DType::kBFloat16:
      case DType::kFloat16:
        return u16.data();
      case DType::kInt32:
        return i32.data();
      default:
        return i64.data();
    }
  }
  void set_float(std::size_t i, float v) {
    if (dtype == DType::kFloat32)
      f32[i] = v;
    else if (dtype == DType::kBFloat16)
      u16[i] = sy_test::bf16_bits(v);
    else
      u16[i] = fp16_bits(v);
  }
  double get(std::size_t i) const {
    switch (dtype) {
      case DType::kFloat32:
        return f32[i];
      case DType::kBFloat16:
        return sy_test::bf16_value(u16[i]);
      case DType::kFloat16:
        return fp16_value(u16[i]);
      case DType::kInt32:
        return i32[i];
      default:
        return static_cast<double>(i64[i]);
    }
  }
  std::int64_t get_int(std::size_t i) const { return dtype == DType::kInt32 ? i32[i] : i64[i]; }
  void poison() {
    float nan_poison;
    std::memcpy(&nan_poison, &kPoisonF32Bits, 4);
    std::fill(f32.begin(), f32.end(), nan_poison);
    std::fill(u16.begin(), u16.end(), kPoisonBf16);
    std::fill(i32.begin(), i32.end(), sy_test::kPoisonI32);
    std::fill(i64.begin(), i64.end(), kPoisonI64);
  }
  // Whether element i still holds the poison pattern, bit for bit.
  bool poisoned(std::size_t i) const {
    switch (dtype) {
      case DType::kFloat32: {
        std::uint32_t b;
        std::memcpy(&b, &f32[i], 4);
        return b == kPoisonF32Bits;
      }
      case DType::kBFloat16:
      case DType::kFloat16:
        return u16[i] == kPoisonBf16;
      case DType::kInt32:
        return i32[i] == sy_test::kPoisonI32;
      default:
        return i64[i] == kPoisonI64;
    }
  }
};

// ---------------------------------------------------------------------------------------------
// The fp64 reference (docs/design.md section 2).

struct RefRow {
  std::vector<double> p, q, mag;  // q with NaN canonicalized to -inf; mag = |p| + |bias| (error scale)
  double max_mag = 0.0;
  // Groups: 2 = kept for sure, 1 = at a near-tie of the keep boundary, 0 = out for sure.
  std::vector<int> group_state;
  std::vector<double> group_score, group_mag;
  std::vector<char> ref_kept;      // the reference's own kept groups (rank < topk_group)
  bool groups_unambiguous = true;  // no near-tie within kExactGap at the boundary
};

double tol(double rel, double mag_a, double mag_b) { return rel * std::max(mag_a, mag_b) + kAbsTol; }
bool near_not_equal(double a, double b, double t) {
  return a != b && std::isfinite(a) && std::isfinite(b) && std::fabs(a - b) <= t;
}

void reference_row(const RoutingConfig& c, const double* s, const double* bias, RefRow* r) {
  const int E = c.num_experts;
  r->p.assign(E, 0.0);
  r->q.assign(E, 0.0);
  r->mag.assign(E, 0.0);
  if (c.pre == PreFn::kSoftmax) {
    double m = -kInf;
    for (int e = 0; e < E; ++e)
      if (std::isfinite(s[e])) m = std::max(m, s[e]);
    double sum = 0.0;
    for (int e = 0; e < E; ++e)
      if (std::isfinite(s[e])) sum += std::exp(s[e] - m);
    for (int e = 0; e < E; ++e) r->p[e] = std::isfinite(s[e]) ? std::exp(s[e] - m) / sum : s[e];
  } else {
    for (int e = 0; e < E; ++e) {
      const double x = s[e];
      double p = x;  // none, and every non-finite logit keeps its value
      if (std::isfinite(x) && c.pre == PreFn::kSigmoid) p = 1.0 / (1.0 + std::exp(-x));
      if (std::isfinite(x) && c.pre == PreFn::kSqrtSoftplus) {
        p = std::sqrt(std::max(x, 0.0) + std::log1p(std::exp(-std::fabs(x))));
      }
      r->p[e] = p;
    }
  }
  r->max_mag = 0.0;
  for (int e = 0; e < E; ++e) {
    const double b = bias ? bias[e] : 0.0;
    double q = r->p[e] + b;
    if (std::isnan(q)) q = -kInf;
    r->q[e] = q;
    r->mag[e] = std::isfinite(q) ? std::fabs(r->p[e]) + std::fabs(b) : 0.0;
    r->max_mag = std::max(r->max_mag, r->mag[e]);
  }
  r->groups_unambiguous = true;
  if (c.group_rule == GroupRule::kNone) return;

  const int NG = c.n_group;
  const int G = E / NG;
  int take = c.group_rule == GroupRule::kTop2Sum ? 2
             : c.group_rule == GroupRule::kMax   ? 1
                                                 : c.top_k / c.topk_group;
  take = std::min(take, G);
  r->group_score.assign(NG, 0.0);
  r->group_mag.assign(NG, 0.0);
  std::vector<double> members(G);
  std::vector<int> member_idx(G);
  for (int g = 0; g < NG; ++g) {
    for (int i = 0; i < G; ++i) member_idx[i] = g * G + i;
    std::sort(member_idx.begin(), member_idx.end(), [&](int a, int b) { return r->q[a] > r->q[b]; });
    double score = 0.0, gm = 0.0;
    for (int i = 0; i < take; ++i) {
      score += r->q[member_idx[i]];
      gm += r->mag[member_idx[i]];
    }
    if (std::isnan(score)) score = -kInf;  // +inf + -inf: ranks with -inf like a NaN score
    r->group_score[g] = score;
    r->group_mag[g] = gm;
  }
  std::vector<int> order(NG);
  for (int g = 0; g < NG; ++g) order[g] = g;
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    const double sa = r->group_score[a], sb = r->group_score[b];
    return sa > sb || (sa == sb && a < b);
  });
  std::vector<int> rank(NG);
  for (int i = 0; i < NG; ++i) rank[order[i]] = i;
  r->ref_kept.assign(NG, 0);
  r->group_state.assign(NG, 0);
  for (int g = 0; g < NG; ++g) {
    const bool kept = rank[g] < c.topk_group;
    r->ref_kept[g] = kept;
    bool near_sel = false, near_exact = false;
    for (int h = 0; h < NG; ++h) {
      if ((rank[h] < c.topk_group) == kept) continue;  // only pairs across the boundary
      const double a = r->group_score[g], b = r->group_score[h];
      near_sel = near_sel || near_not_equal(a, b, tol(kSelTol, r->group_mag[g], r->group_mag[h]));
      near_exact = near_exact || near_not_equal(a, b, tol(kExactGap, r->group_mag[g], r->group_mag[h]));
    }
    r->group_state[g] = near_sel ? 1 : (kept ? 2 : 0);
    if (near_exact) r->groups_unambiguous = false;
  }
}

// fp64 weights for the ids `ids` (the library's), and the extra tolerance an ill-conditioned
// normalize sum (signed p) needs.
void reference_weights(const RoutingConfig& c, const RefRow& r, const std::vector<std::int64_t>& ids,
                       std::vector<double>* w, std::vector<double>* extra_tol) {
  const int K = c.top_k;
  w->assign(K, 0.0);
  extra_tol->assign(K, 0.0);
  std::vector<char> fin(K);
  for (int k = 0; k < K; ++k) fin[k] = std::isfinite(r.q[ids[k]]);
  auto p = [&](int k) { return r.p[ids[k]]; };
  const double scale = c.scale;
  if (c.post == PostFn::kSoftmax) {
    double m = -kInf;
    for (int k = 0; k < K; ++k)
      if (fin[k]) m = std::max(m, p(k));
    double sum = 0.0;
    for (int k = 0; k < K; ++k)
      if (fin[k]) sum += std::exp(p(k) - m);
    for (int k = 0; k < K; ++k) (*w)[k] = fin[k] ? std::exp(p(k) - m) / sum * scale : 0.0;
  } else if (c.post == PostFn::kNormalize) {
    double sum = 0.0, sum_abs = 0.0;
    for (int k = 0; k < K; ++k) {
      if (!fin[k]) continue;
      sum += p(k);
      sum_abs += std::fabs(p(k));
    }
    for (int k = 0; k < K; ++k) {
      if (!fin[k]) continue;
      (*w)[k] = p(k) / (sum + 1e-20) * scale;
      // fp32 rounding of the sum is relative to sum |p|; the result to that over |sum|.
      (*extra_tol)[k] = sum_abs > 0.0 ? 1e-5 * std::fabs((*w)[k]) * sum_abs / std::fabs(sum + 1e-20) : 0.0;
    }
  } else if (c.post == PostFn::kSigmoid) {
    for (int k = 0; k < K; ++k) (*w)[k] = fin[k] ? 1.0 / (1.0 + std::exp(-p(k))) * scale : 0.0;
  } else {
    for (int k = 0; k < K; ++k) (*w)[k] = fin[k] ? p(k) * scale : 0.0;
  }
}

std::string ids_string(const std::vector<std::int64_t>& ids) {
  std::ostringstream o;
  o << "[";
  for (std::size_t i = 0; i < ids.size(); ++i) o << (i ? " " : "") << ids[i];
  o << "]";
  return o.str();
}

struct RowVerdict {
  std::string error;  // empty when the row passes
  bool set_exact = false;
  bool order_exact = false;
};

// Checks one output row against the reference; see the file comment for the layers.
RowVerdict check_row(const RoutingConfig& c, const RefRow& r, const std::vector<std::int64_t>& ids,
                     const std::vector<double>& w, bool weights_bf16,
                     const std::vector<std::uint16_t>& w_bits, bool demand_exact) {
  RowVerdict v;
  const int E = c.num_experts;
  const int K = c.top_k;
  const bool grouped = c.group_rule != GroupRule::kNone;
  const int G = grouped ? E / c.n_group : E;
  auto fail = [&](const std::string& what) {
    v.error = what + "; ids " + ids_string(ids);
    return v;
  };

  // (a) distinct ids in range
  std::vector<char> chosen(E, 0);
  for (int k = 0; k < K; ++k) {
    if (ids[k] < 0 || ids[k] >= E)
      return fail("id " + std::to_string(ids[k]) + " out of range (or not written)");
    if (chosen[ids[k]]) return fail("duplicate id " + std::to_string(ids[k]));
    chosen[ids[k]] = 1;
  }

  // (b) groups: only groups the reference keeps (up to tolerance); at most topk_group of them
  std::vector<char> allowed(E, 1);
  if (grouped) {
    std::vector<char> used(c.n_group, 0);
    for (int k = 0; k < K; ++k) {
      const int g = static_cast<int>(ids[k] / G);
      if (r.group_state[g] == 0) {
        std::ostringstream o;
        o << "id " << ids[k] << " is in group " << g << " (score " << r.group_score[g]
          << ") which the group limit excludes";
        return fail(o.str());
      }
      used[g] = 1;
    }
    int kept = 0;
    for (int g = 0; g < c.n_group; ++g) kept += (r.group_state[g] == 2 || used[g]);
    if (kept > c.topk_group) return fail("ids span more groups than topk_group allows");
    for (int e = 0; e < E; ++e) allowed[e] = r.group_state[e / G] == 2 || used[e / G];
  }

  // (b) selection: no unchosen allowed expert beats a chosen one beyond the tolerance, and an
  // exact tie goes to the lower index.
  double min_chosen = kInf;
  for (int k = 0; k < K; ++k) min_chosen = std::min(min_chosen, r.q[ids[k]]);
  for (int e = 0; e < E; ++e) {
    if (!allowed[e] || chosen[e] || r.q[e] < min_chosen) continue;
    for (int k = 0; k < K; ++k) {
      const int i = static_cast<int>(ids[k]);
      if (r.q[i] < r.q[e] - tol(kSelTol, r.mag[i], r.mag[e])) {
        std::ostringstream o;
        o << "expert " << e << " (q=" << r.q[e] << ") not chosen but beats chosen " << i << " (q=" << r.q[i]
          << ")";
        return fail(o.str());
      }
      if (r.q[i] == r.q[e] && e < i) {
        std::ostringstream o;
        o << "exact tie q=" << r.q[e] << ": expert " << i << " chosen over lower index " << e;
        return fail(o.str());
      }
    }
  }
  // (b) order: descending q, exact ties by ascending index
  for (int k = 0; k + 1 < K; ++k) {
    const int a = static_cast<int>(ids[k]), b = static_cast<int>(ids[k + 1]);
    if (r.q[a] < r.q[b] - tol(kSelTol, r.mag[a], r.mag[b])) {
      std::ostringstream o;
      o << "order: position " << k << " q=" << r.q[a] << " below position " << k + 1 << " q=" << r.q[b];
      return fail(o.str());
    }
    if (r.q[a] == r.q[b] && a > b)
      return fail("order: exact tie not in ascending index order at " + std::to_string(k));
  }

  // (c) exact agreement where the reference has no near-tie
  if (!grouped || r.groups_unambiguous) {
    std::vector<int> cand;
    cand.reserve(E);
    for (int e = 0; e < E; ++e)
      if (!grouped || r.ref_kept[e / G]) cand.push_back(e);
    auto before = [&](int a, int b) { return r.q[a] > r.q[b] || (r.q[a] == r.q[b] && a < b); };
    std::partial_sort(cand.begin(), cand.begin() + K, cand.end(), before);
    v.set_exact = true;
    const double kth = r.q[cand[K - 1]];
    const double reach = kExactGap * r.max_mag + kAbsTol;  // >= any pair's tolerance
    for (std::size_t j = K; j < cand.size() && v.set_exact; ++j) {
      const int y = cand[j];
      if (!(r.q[y] >= kth - reach)) continue;
      for (int x = 0; x < K; ++x) {
        if (near_not_equal(r.q[cand[x]], r.q[y], tol(kExactGap, r.mag[cand[x]], r.mag[y]))) {
          v.set_exact = false;
          break;
        }
      }
    }
    v.order_exact = v.set_exact;
    for (int k = 0; k + 1 < K && v.order_exact; ++k) {
      const int a = cand[k], b = cand[k + 1];
      if (near_not_equal(r.q[a], r.q[b], tol(kExactGap, r.mag[a], r.mag[b]))) v.order_exact = false;
    }
    std::vector<std::int64_t> ref_ids(cand.begin(), cand.begin() + K);
    if (v.set_exact) {
      std::vector<std::int64_t> a = ids, b = ref_ids;
      std::sort(a.begin(), a.end());
      std::sort(b.begin(), b.end());
      if (a != b) return fail("chosen set differs from the reference " + ids_string(ref_ids));
    }
    if (v.order_exact && ids != ref_ids)
      return fail("order differs from the reference " + ids_string(ref_ids));
  }
  if (demand_exact && !(v.set_exact && v.order_exact)) {
    return fail("tie test input is ambiguous for the reference (test bug)");
  }

  // (d) weights, for the ids the library chose
  std::vector<double> ref_w, extra;
  reference_weights(c, r, ids, &ref_w, &extra);
  for (int k = 0; k < K; ++k) {
    std::ostringstream o;
    o << "weight " << k << " (id " << ids[k] << "): got " << w[k] << ", reference " << ref_w[k];
    if (std::isnan(w[k])) return fail("NaN " + o.str());
    if (!std::isfinite(r.q[ids[k]])) {
      if (w[k] != 0.0) return fail("non-finite pick must weigh exactly 0: " + o.str());
      continue;
    }
    const double t =
        1e-5 * std::fabs(ref_w[k]) + 1e-6 * std::max(1.0, std::fabs(static_cast<double>(c.scale))) + extra[k];
    if (!weights_bf16) {
      if (!(std::fabs(w[k] - ref_w[k]) <= t)) return fail(o.str());
    } else {
      // The correctly rounded bf16 of the reference, or its neighbour when the reference lies
      // within the fp32 tolerance of the rounding midpoint between them (1 ulp at most).
      const std::uint16_t want = sy_test::bf16_bits(static_cast<float>(ref_w[k]));
      const int ulps = std::abs(bf16_key(w_bits[k]) - bf16_key(want));
      const double midpoint = 0.5 * (sy_test::bf16_value(want) + sy_test::bf16_value(w_bits[k]));
      const bool rounding_ok = ulps == 0 || (ulps == 1 && std::fabs(ref_w[k] - midpoint) <= t);
      // An ill-conditioned normalize (signed p, sum |p| > 2 |sum p|) may lose more than fp32 rounding
      // before the cast; allow its fp32 tolerance on top of one bf16 rounding.
      const bool ill_conditioned = extra[k] > 2e-5 * std::fabs(ref_w[k]);
      if (!rounding_ok &&
          !(ill_conditioned && std::fabs(w[k] - ref_w[k]) <= t + std::fabs(ref_w[k]) / 128.0)) {
        return fail("bf16 " + o.str());
      }
    }
  }
  return v;
}

// ---------------------------------------------------------------------------------------------
// Test cases.

enum class BiasKind { kNone, kFp32, kBf16 };
enum class Values { kNormal, kTied };

struct Spec {
  RoutingConfig cfg;
  std::int64_t T = 0;
  DType logits_dtype = DType::kFloat32;
  BiasKind bias = BiasKind::kNone;
  DType ids_dtype = DType::kInt32;
  DType weights_dtype = DType::kFloat32;
  std::int64_t row_stride = 0;  // 0: E (contiguous)
  Values values = Values::kNormal;
  double stddev = 1.0;
  double nonfinite_rows = 0.0;  // fraction of rows replaced by a non-finite pattern
  bool demand_exact = false;
};

std::string describe(const Spec& s) {
  const RoutingConfig& c = s.cfg;
  std::ostringstream o;
  o << "T=" << s.T << " E=" << c.num_experts << " K=" << c.top_k << " pre=" << pre_name(c.pre)
    << " post=" << post_name(c.post) << " scale=" << c.scale << " groups=" << rule_name(c.group_rule);
  if (c.group_rule != GroupRule::kNone) o << "(" << c.n_group << "/" << c.topk_group << ")";
  o << " logits=" << switchyard::dtype_name(s.logits_dtype) << " bias="
    << (s.bias == BiasKind::kNone   ? "none"
        : s.bias == BiasKind::kFp32 ? "fp32"
                                    : "bf16")
    << " ids=" << switchyard::dtype_name(s.ids_dtype)
    << " weights=" << switchyard::dtype_name(s.weights_dtype)
    << " row_stride=" << (s.row_stride ? s.row_stride : c.num_experts)
    << " values=" << (s.values == Values::kTied ? "tied" : "normal") << " sd=" << s.stddev
    << " nonfinite_rows=" << s.nonfinite_rows;
  return o.str();
}

constexpr int kNumPatterns = 10;

// Replaces one row by a non-finite pattern (docs/design.md 2.6).
void apply_pattern(int pattern, float* row, int E, int K, std::mt19937_64& g) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  std::uniform_int_distribution<int> pos(0, E - 1);
  std::bernoulli_distribution coin(0.5);
  auto keep_only = [&](int n, bool mixed) {  // n random finite entries survive
    std::vector<int> idx(E);
    for (int e = 0; e < E; ++e) idx[e] = e;
    std::shuffle(idx.begin(), idx.end(), g);
    for (int i = std::min(n, E); i < E; ++i) row[idx[i]] = mixed && coin(g) ? -inf : nan;
  };
  switch (pattern) {
    case 0:
      std::fill(row, row + E, nan);
      break;  // all NaN
    case 1:
      std::fill(row, row + E, -inf);
      break;  // all -inf
    case 2:
      for (int e = 0; e < E; ++e) row[e] = coin(g) ? nan : -inf;
      break;
    case 3:
      row[pos(g)] = inf;
      break;  // one +inf
    case 4:
      for (int i = 0; i < 3; ++i) row[pos(g)] = inf;  // several +inf: ties among them
      break;
    case 5:
      keep_only(K + 1, true);
      break;  // K+1 finite values only
    case 6:
      keep_only(K / 2, false);
      break;  // fewer than K finite values
    case 7:
      for (int e = 0; e < E; ++e)
        if (pos(g) < E / 10 + 1) row[e] = nan;  // scattered NaNs
      break;
    case 8:  // everything at once
      row[pos(g)] = inf;
      row[pos(g)] = nan;
      row[pos(g)] = -inf;
      keep_only(E - E / 3, true);
      row[pos(g)] = inf;
      break;
    default:
      keep_only(K, false);
      break;  // exactly K finite values
  }
}

struct Stats {
  std::int64_t rows = 0, set_exact = 0, order_exact = 0;
};

// Builds the inputs of `spec` from `seed`, runs route, and checks every row.
void run_spec(const Spec& spec, std::uint64_t seed, Stats* stats = nullptr) {
  SCOPED_TRACE(describe(spec) + " seed=" + std::to_string(seed));
  const RoutingConfig& c = spec.cfg;
  const int E = c.num_experts;
  const int K = c.top_k;
  const std::int64_t T = spec.T;
  const std::int64_t S = spec.row_stride > 0 ? spec.row_stride : E;
  std::mt19937_64 g(seed);

  // Intended logits, then their encoding in the logits dtype with padding past E.
  std::vector<float> vals =
      spec.values == Values::kTied
          ? sy_test::random_tied(static_cast<std::size_t>(T) * E, g())
          : sy_test::random_normal(static_cast<std::size_t>(T) * E, g(), static_cast<float>(spec.stddev));
  std::bernoulli_distribution special(spec.nonfinite_rows);
  std::uniform_int_distribution<int> which(0, kNumPatterns - 1);
  for (std::int64_t t = 0; t < T; ++t)
    if (special(g)) apply_pattern(which(g), vals.data() + t * E, E, K, g);
  Buffer logits(spec.logits_dtype, static_cast<std::size_t>(std::max<std::int64_t>(T * S, 1)));
  for (std::int64_t t = 0; t < T; ++t) {
    for (std::int64_t e = 0; e < S; ++e) {
      // Padding holds +inf and NaN: reading it instead of the row would change the ids.
      const float pad =
          (e % 2) ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
      logits.set_float(static_cast<std::size_t>(t * S + e), e < E ? vals[t * E + e] : pad);
    }
  }

  Buffer bias;
  std::vector<double> bias_ref;
  TensorView bias_view;
  if (spec.bias != BiasKind::kNone) {
    bias = Buffer(spec.bias == BiasKind::kFp32 ? DType::kFloat32 : DType::kBFloat16, E);
    const std::vector<float> b =
        spec.values == Values::kTied ? sy_test::random_tied(E, g()) : sy_test::random_normal(E, g(), 0.3f);
    for (int e = 0; e < E; ++e) bias.set_float(e, b[e]);
    bias_ref.resize(E);
    for (int e = 0; e < E; ++e) bias_ref[e] = bias.get(e);
    bias_view = TensorView::of(bias.data(), bias.dtype, {E});
  }

  const std::size_t n_out = static_cast<std::size_t>(T * K);
  Buffer ids(spec.ids_dtype, n_out + kGuard);
  Buffer weights(spec.weights_dtype, n_out + kGuard);
  ids.poison();
  weights.poison();
  TensorView logits_view = TensorView::of(logits.data(), spec.logits_dtype, {T, E}).with_row_stride(S);
  const Status st =
      switchyard::route(c, logits_view, bias_view, TensorView::of(ids.data(), ids.dtype, {T, K}),
                        TensorView::of(weights.data(), weights.dtype, {T, K}));
  ASSERT_TRUE(st.ok()) << st.to_string();

  for (std::size_t i = n_out; i < n_out + kGuard; ++i) {
    ASSERT_TRUE(ids.poisoned(i)) << "topk_ids written past [T,K] at element " << i;
    ASSERT_TRUE(weights.poisoned(i)) << "topk_weights written past [T,K] at element " << i;
  }

  RefRow ref;
  std::vector<double> s(E);
  std::vector<std::int64_t> row_ids(K);
  std::vector<double> row_w(K);
  std::vector<std::uint16_t> row_bits(K);
  int failures = 0;
  for (std::int64_t t = 0; t < T; ++t) {
    for (int e = 0; e < E; ++e) s[e] = logits.get(static_cast<std::size_t>(t * S + e));
    reference_row(c, s.data(), bias_ref.empty() ? nullptr : bias_ref.data(), &ref);
    for (int k = 0; k < K; ++k) {
      const std::size_t i = static_cast<std::size_t>(t * K + k);
      row_ids[k] = ids.get_int(i);
      row_w[k] = weights.get(i);
      row_bits[k] = weights.dtype == DType::kBFloat16 ? weights.u16[i] : 0;
      if (weights.poisoned(i)) row_w[k] = std::numeric_limits<double>::quiet_NaN();
    }
    const RowVerdict v =
        check_row(c, ref, row_ids, row_w, weights.dtype == DType::kBFloat16, row_bits, spec.demand_exact);
    if (stats) {
      ++stats->rows;
      stats->set_exact += v.set_exact;
      stats->order_exact += v.order_exact;
    }
    if (!v.error.empty() && ++failures <= 5) {
      std::ostringstream logits_text;
      for (int e = 0; e < std::min(E, 24); ++e) logits_text << s[e] << " ";
      ADD_FAILURE() << "row " << t << ": " << v.error << "\n  logits[0..24): " << logits_text.str();
    }
  }
  EXPECT_EQ(failures, 0) << "rows failing";
}

// A seed per test, fresh every run; the trace prints it on failure.
#define SY_SEEDED(name)                              \
  const std::uint64_t name = sy_test::fresh_seed();  \
  SCOPED_TRACE("test seed " + std::to_string(name)); \
  std::mt19937_64 name##_gen(name)

template <typename T>
T pick(std::mt19937_64& g, const std::vector<T>& v) {
  return v[std::uniform_int_distribution<std::size_t>(0, v.size() - 1)(g)];
}

const std::vector<PreFn> kPres = {PreFn::kNone, PreFn::kSoftmax, PreFn::kSigmoid, PreFn::kSqrtSoftplus};
const std::vector<PostFn> kPosts = {PostFn::kNone, PostFn::kSoftmax, PostFn::kSigmoid, PostFn::kNormalize};
const std::vector<DType> kLogitDtypes = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
const std::vector<BiasKind> kBiases = {BiasKind::kNone, BiasKind::kFp32, BiasKind::kBf16};
const std::vector<DType> kIdDtypes = {DType::kInt32, DType::kInt64};
const std::vector<DType> kWeightDtypes = {DType::kFloat32, DType::kBFloat16};
const std::vector<float> kScales = {1.0f, 2.5f, 16.0f, 2.827f, 0.5f};

// Random dtypes, bias and stride for a spec whose config and T are set.
void randomize_io(Spec* s, std::mt19937_64& g) {
  s->logits_dtype = pick(g, kLogitDtypes);
  s->bias = pick(g, kBiases);
  s->ids_dtype = pick(g, kIdDtypes);
  s->weights_dtype = pick(g, kWeightDtypes);
  s->stddev = pick(g, std::vector<double>{1.0, 2.5});
  if (std::bernoulli_distribution(0.2)(g)) s->row_stride = s->cfg.num_experts + 5;
}

// ---------------------------------------------------------------------------------------------

TEST(RoutingCpuReference, Fp16EncodingIsRight) {
  EXPECT_EQ(fp16_bits(1.0f), 0x3c00);
  EXPECT_EQ(fp16_bits(-2.0f), 0xc000);
  EXPECT_EQ(fp16_bits(65504.0f), 0x7bff);
  EXPECT_EQ(fp16_bits(1e6f), 0x7c00);
  EXPECT_EQ(fp16_bits(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_EQ(fp16_bits(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(fp16_bits(std::ldexp(1.0f, -14)), 0x0400);
  EXPECT_EQ(fp16_bits(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie to even
  EXPECT_EQ(fp16_bits(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_TRUE(std::isnan(fp16_value(fp16_bits(std::numeric_limits<float>::quiet_NaN()))));
  for (int h = 0; h < 0x7c00; h += 7) EXPECT_EQ(fp16_bits(static_cast<float>(fp16_value(h))), h);
}

struct ExpectedPreset {
  const char* name;
  int E, K;
  PreFn pre;
  bool bias;
  int n_group, topk_group;
  GroupRule rule;
  PostFn post;
  float scale;
  int hidden;  // 0: docs/design.md lists no hidden size
};

// docs/design.md section 2, copied by hand: the table and the hidden sizes below it.
const ExpectedPreset kDesignTable[] = {
    {"mixtral-8x7b", 8, 2, PreFn::kNone, false, 0, 0, GroupRule::kNone, PostFn::kSoftmax, 1.0f, 4096},
    {"qwen3-235b-a22b", 128, 8, PreFn::kNone, false, 0, 0, GroupRule::kNone, PostFn::kSoftmax, 1.0f, 4096},
    {"qwen3-next-80b", 512, 10, PreFn::kNone, false, 0, 0, GroupRule::kNone, PostFn::kSoftmax, 1.0f, 2048},
    {"deepseek-v3", 256, 8, PreFn::kSigmoid, true, 8, 4, GroupRule::kTop2Sum, PostFn::kNormalize, 2.5f, 7168},
    {"deepseek-v2", 160, 6, PreFn::kSoftmax, false, 8, 3, GroupRule::kMax, PostFn::kNone, 16.0f, 0},
    {"kimi-k2", 384, 8, PreFn::kSigmoid, true, 0, 0, GroupRule::kNone, PostFn::kNormalize, 2.827f, 7168},
    {"glm-4.5", 160, 8, PreFn::kSigmoid, true, 0, 0, GroupRule::kNone, PostFn::kNormalize, 2.5f, 5120},
    {"llama4-maverick", 128, 1, PreFn::kNone, false, 0, 0, GroupRule::kNone, PostFn::kSigmoid, 1.0f, 5120},
    {"gpt-oss-120b", 128, 4, PreFn::kNone, false, 0, 0, GroupRule::kNone, PostFn::kSoftmax, 1.0f, 2880},
    {"dbrx", 16, 4, PreFn::kSoftmax, false, 0, 0, GroupRule::kNone, PostFn::kNormalize, 1.0f, 6144},
    {"wide-2048", 2048, 32, PreFn::kNone, false, 0, 0, GroupRule::kNone, PostFn::kSoftmax, 1.0f, 0},
};

TEST(RoutingCpu, PresetTableMatchesDesign) {
  const auto& presets = switchyard::model_presets();
  ASSERT_EQ(presets.size(), std::size(kDesignTable));
  for (std::size_t i = 0; i < presets.size(); ++i) {
    const ExpectedPreset& x = kDesignTable[i];
    const switchyard::ModelPreset& p = presets[i];
    SCOPED_TRACE(x.name);
    EXPECT_EQ(p.name, x.name) << "table order";
    EXPECT_EQ(p.routing.num_experts, x.E);
    EXPECT_EQ(p.routing.top_k, x.K);
    EXPECT_EQ(p.routing.pre, x.pre);
    EXPECT_EQ(p.has_bias, x.bias);
    EXPECT_EQ(p.routing.group_rule, x.rule);
    if (x.rule != GroupRule::kNone) {
      EXPECT_EQ(p.routing.n_group, x.n_group);
      EXPECT_EQ(p.routing.topk_group, x.topk_group);
    }
    EXPECT_EQ(p.routing.post, x.post);
    EXPECT_EQ(p.routing.scale, x.scale);
    if (x.hidden)
      EXPECT_EQ(p.hidden_size, x.hidden);
    else
      EXPECT_GT(p.hidden_size, 0);
    EXPECT_TRUE(switchyard::validate(p.routing).ok()) << switchyard::validate(p.routing).to_string();
    switchyard::ModelPreset found;
    ASSERT_TRUE(switchyard::find_preset(x.name, &found).ok());
    EXPECT_EQ(found.name, p.name);
    EXPECT_EQ(found.routing.num_experts, p.routing.num_experts);
    EXPECT_EQ(found.hidden_size, p.hidden_size);
  }
}

TEST(RoutingCpu, EveryPreset) {
  SY_SEEDED(seed);
  const std::vector<std::int64_t> Ts = {1, 3, 19, 111, 989};
  Stats stats;
  for (const switchyard::ModelPreset& p : switchyard::model_presets()) {
    for (int variant = 0; variant < 2; ++variant) {
      Spec s;
      s.cfg = p.routing;
      s.T = variant == 0 ? 111 : pick(seed_gen, Ts);
      s.bias = p.has_bias ? (variant == 0 ? BiasKind::kFp32 : BiasKind::kBf16) : BiasKind::kNone;
      if (variant == 1) {
        s.logits_dtype = pick(seed_gen, kLogitDtypes);
        s.ids_dtype = pick(seed_gen, kIdDtypes);
        s.weights_dtype = pick(seed_gen, kWeightDtypes);
        s.nonfinite_rows = 0.1;
      }
      run_spec(s, seed_gen(), &stats);
    }
  }
  EXPECT_GT(stats.set_exact, stats.rows * 8 / 10) << "too few rows compared exactly: the test lost its bite";
}

TEST(RoutingCpu, EveryPreAndPostFunction) {
  SY_SEEDED(seed);
  Stats stats;
  for (PreFn pre : kPres) {
    for (PostFn post : kPosts) {
      Spec s;
      s.cfg = make_config(160, 8, pre, post, pick(seed_gen, kScales));
      s.T = 111;
      s.bias = pick(seed_gen, kBiases);
      s.nonfinite_rows = 0.05;
      run_spec(s, seed_gen(), &stats);
    }
  }
  EXPECT_GT(stats.set_exact, stats.rows * 8 / 10);
  EXPECT_GT(stats.order_exact, stats.rows * 6 / 10);
}

struct GroupCase {
  int E, K, n_group, topk_group;
  GroupRule rule;
};
const std::vector<GroupCase> kGroupCases = {
    {256, 8, 8, 4, GroupRule::kTop2Sum},    // DeepSeek-V3
    {160, 6, 8, 3, GroupRule::kMax},        // DeepSeek-V2
    {256, 8, 8, 4, GroupRule::kTopKSum},    // 2 per group
    {384, 10, 12, 5, GroupRule::kTopKSum},  // 2 per group
    {512, 22, 16, 4, GroupRule::kTopKSum},  // 5 per group
    {2048, 32, 64, 8, GroupRule::kTop2Sum},
    {8, 2, 8, 8, GroupRule::kTop2Sum},  // groups of one expert, all kept
    {160, 8, 8, 8, GroupRule::kMax},    // every group kept
    {256, 8, 8, 1, GroupRule::kMax},    // one group kept
    {160, 8, 4, 2, GroupRule::kTop2Sum},
    {4096, 40, 32, 4, GroupRule::kTopKSum},  // CPU only: E = 4096, K > 32
    {512, 8, 8, 3, GroupRule::kTopKSum},     // K / topk_group = 2 (rounded down)
};

TEST(RoutingCpu, GroupRules) {
  SY_SEEDED(seed);
  Stats stats;
  for (const GroupCase& gc : kGroupCases) {
    for (PreFn pre : {PreFn::kSigmoid, pick(seed_gen, kPres)}) {
      Spec s;
      s.cfg = make_config(gc.E, gc.K, pre, pick(seed_gen, kPosts), pick(seed_gen, kScales), gc.rule,
                          gc.n_group, gc.topk_group);
      s.T = gc.E >= 2048 ? 19 : 111;
      s.bias = pick(seed_gen, kBiases);
      s.nonfinite_rows = 0.05;
      run_spec(s, seed_gen(), &stats);
    }
  }
  EXPECT_GT(stats.set_exact, stats.rows * 7 / 10);
}

TEST(RoutingCpu, EveryDtypeCombination) {
  SY_SEEDED(seed);
  for (DType logits : kLogitDtypes) {
    for (BiasKind bias : kBiases) {
      for (DType ids : kIdDtypes) {
        for (DType weights : kWeightDtypes) {
          Spec s;
          const bool grouped = std::bernoulli_distribution(0.5)(seed_gen);
          s.cfg = grouped ? make_config(256, 8, PreFn::kSigmoid, PostFn::kNormalize, 2.5f,
                                        GroupRule::kTop2Sum, 8, 4)
                          : make_config(256, 8, pick(seed_gen, kPres), pick(seed_gen, kPosts));
          s.T = 19;
          s.logits_dtype = logits;
          s.bias = bias;
          s.ids_dtype = ids;
          s.weights_dtype = weights;
          s.nonfinite_rows = 0.1;
          run_spec(s, seed_gen(), nullptr);
        }
      }
    }
  }
}

TEST(RoutingCpu, TokenExpertAndKSweep) {
  SY_SEEDED(seed);
  // Every T, E and K of the test plan at least once (fixed pairs), plus random extra triples.
  struct Size {
    std::int64_t T;
    int E, K;
  };
  std::vector<Size> sizes = {
      {4096, 256, 8}, {989, 2048, 32}, {111, 4096, 40}, {19, 512, 22}, {3, 384, 10},
      {1, 8, 2},      {0, 160, 1},     {111, 160, 1},   {989, 8, 8},   {19, 4096, 32},
  };
  const std::vector<std::int64_t> Ts = {0, 1, 3, 19, 111, 989, 4096};
  const std::vector<int> Es = {8, 160, 256, 384, 512, 2048, 4096};
  const std::vector<int> Ks = {1, 2, 8, 10, 22, 32, 40};
  while (sizes.size() < 18) {
    const Size z{pick(seed_gen, Ts), pick(seed_gen, Es), pick(seed_gen, Ks)};
    if (z.K <= z.E && z.T * z.E <= (1 << 20)) sizes.push_back(z);
  }
  Stats stats;
  for (const Size& z : sizes) {
    Spec s;
    s.cfg = make_config(z.E, z.K, pick(seed_gen, kPres), pick(seed_gen, kPosts), pick(seed_gen, kScales));
    s.T = z.T;
    randomize_io(&s, seed_gen);
    s.nonfinite_rows = 0.02;
    run_spec(s, seed_gen(), &stats);
  }
  EXPECT_GT(stats.set_exact, stats.rows * 8 / 10);
}

TEST(RoutingCpu, LargeKOnCpu) {
  SY_SEEDED(seed);
  for (auto ek : {std::pair<int, int>{160, 40}, {256, 64}, {48, 48}, {4096, 40}, {512, 33}}) {
    Spec s;
    s.cfg = make_config(ek.first, ek.second, pick(seed_gen, kPres), pick(seed_gen, kPosts));
    s.T = ek.first >= 4096 ? 19 : 111;
    randomize_io(&s, seed_gen);
    s.nonfinite_rows = 0.1;
    run_spec(s, seed_gen(), nullptr);
  }
}

TEST(RoutingCpu, NonFiniteRowsRandom) {
  SY_SEEDED(seed);
  for (int i = 0; i < 24; ++i) {
    Spec s;
    const int E = pick(seed_gen, std::vector<int>{8, 160, 256, 384});
    const int K = std::min(E, pick(seed_gen, std::vector<int>{1, 2, 8, 10}));
    if (i % 3 == 0 && E % 8 == 0) {
      const GroupRule rule =
          pick(seed_gen, std::vector<GroupRule>{GroupRule::kTop2Sum, GroupRule::kMax, GroupRule::kTopKSum});
      s.cfg = make_config(E, K, pick(seed_gen, kPres), pick(seed_gen, kPosts), 1.0f, rule, 8,
                          std::min(8, std::max(1, K / 2)));
      if (!switchyard::validate(s.cfg).ok()) s.cfg.topk_group = 8;
      if (!switchyard::validate(s.cfg).ok()) s.cfg.group_rule = GroupRule::kMax;  // K / 8 == 0
    } else {
      s.cfg = make_config(E, K, pick(seed_gen, kPres), pick(seed_gen, kPosts), pick(seed_gen, kScales));
    }
    s.T = 111;
    randomize_io(&s, seed_gen);
    s.nonfinite_rows = 0.7;
    run_spec(s, seed_gen(), nullptr);
  }
}

// Rows with hand-written expectations (docs/design.md 2.6), on top of the generic reference check.
TEST(RoutingCpu, NonFiniteRowsExplicit) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  constexpr int E = 16, K = 4, T = 5;
  std::vector<float> logits(T * E);
  for (int e = 0; e < E; ++e) {
    logits[0 * E + e] = nan;                               // all NaN
    logits[1 * E + e] = 0.1f * static_cast<float>(e % 5);  // one +inf at 7
    logits[2 * E + e] = (e % 3 == 0) ? -inf : nan;         // K+1 finite: 2, 5, 8, 11, 14
    logits[3 * E + e] = nan;                               // two finite: 9, 4
    logits[4 * E + e] = (e % 2) ? -inf : nan;              // NaN and -inf only
  }
  logits[1 * E + 7] = inf;
  const float five[] = {0.5f, -1.0f, 2.0f, 0.25f, 1.0f};
  for (int i = 0; i < 5; ++i) logits[2 * E + 2 + 3 * i] = five[i];
  logits[3 * E + 9] = 3.0f;
  logits[3 * E + 4] = 1.0f;
  for (PreFn pre : kPres) {
    for (DType dtype : kLogitDtypes) {
      for (PostFn post : {PostFn::kSoftmax, PostFn::kNormalize}) {
        SCOPED_TRACE(std::string(pre_name(pre)) + " " + post_name(post) + " " +
                     switchyard::dtype_name(dtype));
        Buffer in(dtype, T * E);
        for (int i = 0; i < T * E; ++i) in.set_float(i, logits[i]);
        std::vector<std::int32_t> ids(T * K, sy_test::kPoisonI32);
        std::vector<float> w(T * K, -7.0f);
        const RoutingConfig c = make_config(E, K, pre, post);
        ASSERT_TRUE(switchyard::route(c, TensorView::of(in.data(), dtype, {T, E}), TensorView{},
                                      TensorView::of(ids.data(), DType::kInt32, {T, K}),
                                      TensorView::of(w.data(), DType::kFloat32, {T, K}))
                        .ok());
        auto row = [&](int t) {
          return std::vector<std::int32_t>(ids.begin() + t * K, ids.begin() + (t + 1) * K);
        };
        EXPECT_EQ(row(0), (std::vector<std::int32_t>{0, 1, 2, 3})) << "all NaN: lowest indices";
        EXPECT_EQ(row(4), (std::vector<std::int32_t>{0, 1, 2, 3})) << "NaN ranks with -inf";
        for (int t : {0, 4})
          for (int k = 0; k < K; ++k) EXPECT_EQ(w[t * K + k], 0.0f);
        EXPECT_EQ(ids[1 * K], 7) << "+inf ranks above every finite score";
        EXPECT_EQ(w[1 * K], 0.0f) << "+inf pick weighs 0";
        // Row 1's other picks: the three largest finite, 0.4 at e = 4, 9, 14.
        EXPECT_EQ(row(1), (std::vector<std::int32_t>{7, 4, 9, 14}));
        EXPECT_NEAR(w[1 * K + 1] + w[1 * K + 2] + w[1 * K + 3], 1.0f, 1e-6f);
        // K+1 finite: the best four of {2:0.5, 5:-1, 8:2, 11:0.25, 14:1}, no matter the pre function.
        EXPECT_EQ(row(2), (std::vector<std::int32_t>{8, 14, 2, 11}));
        // Two finite, then the lowest non-finite indices with weight 0.
        EXPECT_EQ(row(3), (std::vector<std::int32_t>{9, 4, 0, 1}));
        EXPECT_EQ(w[3 * K + 2], 0.0f);
        EXPECT_EQ(w[3 * K + 3], 0.0f);
        EXPECT_NEAR(w[3 * K + 0] + w[3 * K + 1], 1.0f, 1e-6f);  // positive p: a partition of 1
        for (float x : w) EXPECT_FALSE(std::isnan(x));
      }
    }
  }
}

TEST(RoutingCpu, LogitsRowStrideLargerThanE) {
  SY_SEEDED(seed);
  for (int i = 0; i < 6; ++i) {
    Spec s;
    const int E = pick(seed_gen, std::vector<int>{8, 160, 256, 384});
    s.cfg = make_config(E, std::min(E, pick(seed_gen, std::vector<int>{1, 2, 8, 10})), pick(seed_gen, kPres),
                        pick(seed_gen, kPosts));
    s.T = pick(seed_gen, std::vector<std::int64_t>{1, 3, 19, 111});
    randomize_io(&s, seed_gen);
    s.row_stride = i % 2 ? E + 1 : 2 * E + 3;
    run_spec(s, seed_gen(), nullptr);
  }
}

// Values on a few quarter levels are exact in every dtype and in fp32 sums, so fp32 and fp64
// agree exactly; the tie order (lower index first) is then demanded exactly everywhere.
TEST(RoutingCpu, ExactTiesMatchReferenceExactly) {
  SY_SEEDED(seed);
  Stats stats;
  for (int i = 0; i < 30; ++i) {
    Spec s;
    s.values = Values::kTied;
    s.demand_exact = true;
    s.T = pick(seed_gen, std::vector<std::int64_t>{19, 111});
    s.logits_dtype = pick(seed_gen, kLogitDtypes);
    s.ids_dtype = pick(seed_gen, kIdDtypes);
    s.weights_dtype = pick(seed_gen, kWeightDtypes);
    s.nonfinite_rows = 0.2;
    if (i % 4 == 0) s.row_stride = 300;
    if (i < 12) {
      const GroupCase& gc = kGroupCases[i % kGroupCases.size()];
      // Group sums of tied sigmoid values could near-tie between different multisets; none and
      // softmax keep them apart (softmax without a bias: equal logits give equal p).
      const PreFn pre = pick(seed_gen, std::vector<PreFn>{PreFn::kNone, PreFn::kSoftmax});
      s.cfg = make_config(gc.E, gc.K, pre, pick(seed_gen, kPosts), 1.0f, gc.rule, gc.n_group, gc.topk_group);
      s.bias = pre == PreFn::kNone ? pick(seed_gen, kBiases) : BiasKind::kNone;
      if (s.row_stride && s.row_stride < gc.E) s.row_stride = gc.E + 2;
      if (gc.E >= 2048) s.T = 19;
    } else {
      const int E = pick(seed_gen, std::vector<int>{8, 160, 256, 512});
      const PreFn pre = pick(seed_gen, kPres);
      s.cfg = make_config(E, std::min(E, pick(seed_gen, std::vector<int>{1, 2, 8, 10, 22, 32})), pre,
                          pick(seed_gen, kPosts));
      s.bias = pre == PreFn::kNone ? pick(seed_gen, kBiases) : BiasKind::kNone;
      if (s.row_stride && s.row_stride < E) s.row_stride = E + 2;
    }
    run_spec(s, seed_gen(), &stats);
  }
  EXPECT_EQ(stats.order_exact, stats.rows);
}

TEST(RoutingCpu, ZeroTokensWritesNothing) {
  const RoutingConfig c = make_config(16, 4, PreFn::kSoftmax, PostFn::kSoftmax);
  std::vector<std::int32_t> ids(8, sy_test::kPoisonI32);
  std::vector<float> w(8, -3.0f);
  // Null data with no elements is valid.
  EXPECT_TRUE(switchyard::route(c, TensorView::of(nullptr, DType::kFloat32, {0, 16}), TensorView{},
                                TensorView::of(nullptr, DType::kInt32, {0, 4}),
                                TensorView::of(nullptr, DType::kFloat32, {0, 4}))
                  .ok());
  std::vector<float> logits(16, 1.0f);
  EXPECT_TRUE(switchyard::route(c, TensorView::of(logits.data(), DType::kFloat32, {0, 16}), TensorView{},
                                TensorView::of(ids.data(), DType::kInt32, {0, 4}),
                                TensorView::of(w.data(), DType::kFloat32, {0, 4}))
                  .ok());
  for (std::int32_t x : ids) EXPECT_EQ(x, sy_test::kPoisonI32);
  for (float x : w) EXPECT_EQ(x, -3.0f);
}

TEST(RoutingCpu, SameBitsRunToRun) {
  SY_SEEDED(seed);
  const int E = 512, K = 10;
  const std::int64_t T = 989;
  const std::vector<float> logits = sy_test::random_normal(T * E, seed_gen());
  const std::vector<float> bias = sy_test::random_normal(E, seed_gen(), 0.3f);
  const RoutingConfig c =
      make_config(E, K, PreFn::kSigmoid, PostFn::kNormalize, 2.5f, GroupRule::kTop2Sum, 8, 4);
  std::vector<std::int32_t> ids[2];
  std::vector<float> w[2];
  for (int run = 0; run < 2; ++run) {
    ids[run].assign(T * K, sy_test::kPoisonI32);
    w[run].assign(T * K, -1.0f);
    ASSERT_TRUE(switchyard::route(c, TensorView::of(logits.data(), DType::kFloat32, {T, E}),
                                  TensorView::of(bias.data(), DType::kFloat32, {E}),
                                  TensorView::of(ids[run].data(), DType::kInt32, {T, K}),
                                  TensorView::of(w[run].data(), DType::kFloat32, {T, K}))
                    .ok());
  }
  EXPECT_EQ(ids[0], ids[1]);
  EXPECT_EQ(0, std::memcmp(w[0].data(), w[1].data(), w[0].size() * sizeof(float)));
}

// With group_rule == kNone the group fields are ignored (any n_group / topk_group).
TEST(RoutingCpu, GroupFieldsIgnoredWithoutGroupRule) {
  SY_SEEDED(seed);
  const int E = 8, K = 2;
  const std::int64_t T = 19;
  const std::vector<float> logits = sy_test::random_normal(T * E, seed_gen());
  std::vector<std::int32_t> want(T * K), got(T * K);
  std::vector<float> w(T * K);
  RoutingConfig c = make_config(E, K, PreFn::kNone, PostFn::kSoftmax);
  ASSERT_TRUE(switchyard::route(c, TensorView::of(logits.data(), DType::kFloat32, {T, E}), TensorView{},
                                TensorView::of(want.data(), DType::kInt32, {T, K}),
                                TensorView::of(w.data(), DType::kFloat32, {T, K}))
                  .ok());
  for (auto ng : {std::pair<int, int>{3, 5}, {0, 0}, {-4, 9}, {1 << 20, 1}}) {
    c.n_group = ng.first;
    c.topk_group = ng.second;
    SCOPED_TRACE("n_group " + std::to_string(ng.first));
    EXPECT_TRUE(switchyard::validate(c).ok());
    std::fill(got.begin(), got.end(), sy_test::kPoisonI32);
    ASSERT_TRUE(switchyard::route(c, TensorView::of(logits.data(), DType::kFloat32, {T, E}), TensorView{},
                                  TensorView::of(got.data(), DType::kInt32, {T, K}),
                                  TensorView::of(w.data(), DType::kFloat32, {T, K}))
                    .ok());
    EXPECT_EQ(got, want);
  }
}

// The sorting networks of the staged routing kernels (common/top8_network.h): sort8 on every 0-1
// input (the 0-1 principle: then it sorts every input), merge8 on every pair of sorted 0-1 lists and
// their left-out keys, and both on random keys with many ties against std::sort, as the kernels use
// them for a chunk of 32 keys (its top 8 and the ninth largest).
TEST(TopEightNetwork, SortsMergesAndTracksTheNinth) {
  using switchyard::detail::merge8;
  using switchyard::detail::sort8;
  for (unsigned m = 0; m < 256; ++m) {
    std::uint32_t x[8];
    for (int i = 0; i < 8; ++i) x[i] = (m >> i) & 1u;
    sort8(x);
    for (int i = 0; i < 7; ++i) ASSERT_GE(x[i], x[i + 1]) << "sort8, input bits " << m;
    ASSERT_EQ(static_cast<unsigned>(__builtin_popcount(m)), static_cast<unsigned>(std::count(x, x + 8, 1u)));
  }
  for (int ones_a = 0; ones_a <= 8; ++ones_a) {
    for (int ones_b = 0; ones_b <= 8; ++ones_b) {
      for (std::uint32_t out_a = 0; out_a <= 1; ++out_a) {
        for (std::uint32_t out_b = 0; out_b <= 1; ++out_b) {
          std::uint32_t a[8], b[8];
          for (int i = 0; i < 8; ++i) {
            a[i] = i < ones_a ? 2u : out_a;  // left-out keys are <= every key kept
            b[i] = i < ones_b ? 2u : out_b;
          }
          std::vector<std::uint32_t> all(a, a + 8);
          all.insert(all.end(), b, b + 8);
          all.push_back(out_a);
          all.push_back(out_b);
          std::sort(all.begin(), all.end(), std::greater<std::uint32_t>());
          std::uint32_t na = out_a;
          merge8(a, na, b, out_b);
          for (int i = 0; i < 8; ++i) ASSERT_EQ(a[i], all[i]) << ones_a << " " << ones_b;
          ASSERT_EQ(na, all[8]) << ones_a << " " << ones_b;
        }
      }
    }
  }
  std::mt19937_64 g(sy_test::fresh_seed());
  for (int t = 0; t < 20000; ++t) {
    const std::uint32_t range = 1u + static_cast<std::uint32_t>(g() % 64);  // ties
    std::uint32_t v[32];
    for (std::uint32_t& x : v) x = static_cast<std::uint32_t>(g() % range);
    std::uint32_t s[4][8];
    for (int q = 0; q < 4; ++q) {
      std::copy(v + 8 * q, v + 8 * q + 8, s[q]);
      sort8(s[q]);
    }
    std::uint32_t n0 = 0, n2 = 0;
    merge8(s[0], n0, s[1], 0);
    merge8(s[2], n2, s[3], 0);
    merge8(s[0], n0, s[2], n2);
    std::sort(v, v + 32, std::greater<std::uint32_t>());
    for (int i = 0; i < 8; ++i) ASSERT_EQ(s[0][i], v[i]) << "trial " << t;
    ASSERT_EQ(n0, v[8]) << "trial " << t;
  }
  // merge8_carry (the staged kernels' running top 8 with the picks' logits): distinct keys, as the
  // kernels' packed keys are; each value must stay with its key, and the keys and the largest left out
  // must be merge8's.
  using switchyard::detail::merge8_carry;
  const auto value_of = [](std::uint32_t k) { return k * 2654435761u ^ 0x9e3779b9u; };
  for (int t = 0; t < 20000; ++t) {
    // 18 distinct keys of 0 .. range - 1, dense: many near keys.
    std::vector<std::uint32_t> pool(18u + static_cast<std::uint32_t>(g() % 64));
    std::iota(pool.begin(), pool.end(), 0u);
    std::shuffle(pool.begin(), pool.end(), g);
    pool.resize(18);
    // a: 8 kept and one left out (below all 8), b likewise, as a running list and a chunk's top 8.
    std::sort(pool.begin(), pool.begin() + 9, std::greater<std::uint32_t>());
    std::sort(pool.begin() + 9, pool.end(), std::greater<std::uint32_t>());
    std::uint32_t a[8], av[8], b[8], bv[8], a2[8], b2[8];
    for (int i = 0; i < 8; ++i) {
      a[i] = a2[i] = pool[i];
      av[i] = value_of(pool[i]);
      b[i] = b2[i] = pool[9 + i];
      bv[i] = value_of(pool[9 + i]);
    }
    std::uint32_t na = pool[8], na2 = pool[8];
    merge8_carry(a, av, na, b, bv, pool[17]);
    merge8(a2, na2, b2, pool[17]);
    for (int i = 0; i < 8; ++i) {
      ASSERT_EQ(a[i], a2[i]) << "trial " << t;
      ASSERT_EQ(av[i], value_of(a[i])) << "trial " << t << ", key " << i;
    }
    ASSERT_EQ(na, na2) << "trial " << t;
  }
}

// The p test of the staged softmax -> normalize rows (common/softmax_picks.h; uses the library's exp_f32,
// whose bits the kernels' exp has). Wherever it passes a row, ranking the row by its logits gives the
// oracle's ids and order (the CPU backend's, softmax -> normalize); it passes nearly every row of
// N(0, 1) logits; and on flat-top rows (distinct logits whose p round equal, so that the oracle ranks
// them by expert) and underflow rows (unequal subnormal p that round equal) the logit order is often
// wrong, and the test flags every such row. (Its finiteness conditions guard the weights, which would
// be NaN for infinite picks, rather than the order: the GPU test's special rows check those.)
TEST(SoftmaxPicksTest, PassesOnlyRowsWhoseLogitOrderIsTheOracles) {
  SY_SEEDED(seed);
  std::mt19937_64 g(seed_gen());
  constexpr int kN = 8;
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  for (int E : {32, 64, 256, 512}) {
    for (int K : {1, 2, 5, 8}) {
      // normal, wide, flat-top, tied (bf16-like), specials, underflow (the K-th pick's p subnormal)
      for (int kind = 0; kind < 6; ++kind) {
        const std::int64_t T = 400;
        std::vector<float> v =
            sy_test::random_normal(static_cast<std::size_t>(T) * E, g(), kind == 1 ? 40.0f : 1.0f);
        for (std::int64_t t = 0; t < T; ++t) {
          float* row = v.data() + t * E;
          if (kind == 2) {
            sy_test::flat_top_row(row, E, g);
          } else if (kind == 3) {
            for (int e = 0; e < E; ++e) row[e] = std::round(row[e] * 8.0f) / 8.0f;
          } else if (kind == 4) {
            const float specials[] = {nan, inf, -inf, -0.0f, 0.0f};
            for (int e = 0; e < E; ++e)
              if (g() % 16 == 0) row[e] = specials[g() % 5];
          } else if (kind == 5) {
            // K - 1 experts at 0, then three at -99.4 + 0.02 j: exp of those is a subnormal ~7e-44 (steps
            // of 2%), and p = exp / (K - 1) rounds some of them to one value, which the oracle ranks by
            // expert.
            for (int e = 0; e < E; ++e) row[e] -= 300.0f;
            for (int j = 0; j < K - 1; ++j) row[g() % E] = 0.0f;
            for (int j = 0; j < 3; ++j) row[g() % E] = -99.4f + 0.02f * static_cast<float>(j);
          }
        }
        const RoutingConfig c = make_config(E, K, PreFn::kSoftmax, PostFn::kNormalize);
        std::vector<std::int32_t> ids(static_cast<std::size_t>(T) * K, sy_test::kPoisonI32);
        std::vector<float> w(static_cast<std::size_t>(T) * K);
        ASSERT_TRUE(switchyard::route(c, TensorView::of(v.data(), DType::kFloat32, {T, E}), TensorView{},
                                      TensorView::of(ids.data(), DType::kInt32, {T, K}),
                                      TensorView::of(w.data(), DType::kFloat32, {T, K}))
                        .ok());
        int passed = 0, wrong_order = 0;
        for (std::int64_t t = 0; t < T; ++t) {
          const float* row = v.data() + t * E;
          // The logit order: canonical scores (NaN as -inf) descending, equal ones by expert.
          std::vector<int> order(E);
          for (int e = 0; e < E; ++e) order[e] = e;
          const auto score = [&](int e) { return switchyard::detail::canonical_score(row[e]) + 0.0f; };
          std::partial_sort(order.begin(), order.begin() + K + 1, order.end(), [&](int a, int b) {
            return score(a) > score(b) || (score(a) == score(b) && a < b);
          });
          float sv[kN] = {}, tv[kN];
          std::uint32_t key[kN] = {};
          int ev[kN] = {};
          bool same = true;
          for (int k = 0; k < K; ++k) {
            sv[k] = score(order[k]);
            key[k] = switchyard::detail::float_bits(sv[k]);
            ev[k] = order[k];
            same = same && ids[t * K + k] == order[k];
          }
          const bool doubt = switchyard::detail::softmax_picks_doubtful(
              K, sv, key, ev, score(order[K]), [](float x) { return switchyard::detail::exp_f32(x); }, tv);
          if (!same) ++wrong_order;
          if (!doubt) {
            ++passed;
            ASSERT_TRUE(same) << "E " << E << " K " << K << " kind " << kind << " row " << t;
          }
        }
        SCOPED_TRACE("E " + std::to_string(E) + " K " + std::to_string(K) + " kind " + std::to_string(kind));
        // N(0, 1) logits: nearly every row passes. (N(0, 40) ones need not: a K-th pick more than ~69
        // below the row's largest logit has a tiny t, and its row is routed exactly.)
        if (kind == 0) EXPECT_GE(passed, T - T / 100);
        if (kind == 2) EXPECT_GE(wrong_order, T / 2);  // the case the test exists for
        if (kind == 5 && K >= 5) EXPECT_GE(wrong_order, T / 20);
      }
    }
  }
}

// route_staged.cuh's approximate selection of sigmoid + bias rows (common/approx_certify.h), as a model:
// every finite |s| <= 86.5 gets a sigmoid off the oracle's by up to kErr = 2^-21 (either extreme, or in
// between; other logits take the exact one, as in the kernel), the groups are kept as the kernel keeps
// them (the first topk_group, then a later group replacing the worst kept one only when strictly
// better), the K picks are the best by approximate (q' desc, expert asc) in the kept groups and u the
// best q' left out there. Wherever both certifications pass, the picks in exact (q desc, expert asc)
// order must be the oracle's ids. Rows: clusters of logits a few ulps apart, N(0, 1), tied levels;
// biases a few ulps apart, N(0, 0.5), 1000 on half the experts (q in ulps of 2^-14), +-1e30 on some,
// -inf masks and NaNs on some experts and +inf on a few. The kernel bounds u by the top of its packed bucket,
// a larger value, so it certifies fewer rows, never more.
TEST(ApproxCertifyTest, CertifiedRowsAreTheOracles) {
  SY_SEEDED(seed);
  std::mt19937_64 g(seed_gen());
  namespace d = switchyard::detail;
  constexpr float kErr = 0x1p-21f;
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const auto approx_sigmoid = [&](float s) {
    const float exact = d::pre_elementwise(PreFn::kSigmoid, s);
    if (!(std::fabs(s) <= 86.5f)) return exact;
    const unsigned mode = static_cast<unsigned>(g() % 4);
    const double off = mode == 0   ? kErr
                       : mode == 1 ? -kErr
                                   : kErr * (std::ldexp(static_cast<double>(g() % 2001), -10) - 1.0);
    float a = static_cast<float>(exact + off);
    while (std::fabs(static_cast<double>(a) - exact) > kErr) a = std::nextafter(a, exact);
    return a;
  };
  int total_cluster_redo = 0, total_wrong_if_trusted = 0;
  for (int E : {32, 64, 160, 256, 512}) {
    for (int K : {1, 2, 5, 8}) {
      for (int grouped = 0; grouped < 2; ++grouped) {
        const int n_group = E / 32;
        if (grouped && n_group < 2) continue;
        for (int bias_kind = 0; bias_kind < 5; ++bias_kind) {
          const std::int64_t T = 240;
          RoutingConfig c = make_config(E, K, PreFn::kSigmoid, PostFn::kNormalize, 2.5f);
          if (grouped) {
            c.group_rule = g() % 2 ? GroupRule::kTop2Sum : GroupRule::kMax;
            c.n_group = n_group;
            c.topk_group = 1 + static_cast<int>(g() % std::min(4, n_group - 1));
          }
          const int take = c.group_rule == GroupRule::kTop2Sum ? 2 : 1;
          std::vector<float> v = sy_test::random_normal(static_cast<std::size_t>(T) * E, g(), 1.0f);
          for (std::int64_t t = 0; t < T; ++t) {
            float* row = v.data() + t * E;
            if (t % 3 == 0) {  // a cluster of 1 + (t % 40) logits within 48 ulps of a level in [3, 4)
              for (int e = 0; e < E; ++e) row[e] -= 1.0f;
              const float base = 3.0f + 0.125f * static_cast<float>(g() % 8);
              for (int j = 0, m = std::min(E, 1 + static_cast<int>(t % 40)); j < m; ++j)
                row[g() % E] = d::bits_float(d::float_bits(base) + static_cast<std::uint32_t>(g() % 48));
            } else if (t % 3 == 2) {
              for (int e = 0; e < E; ++e) row[e] = std::round(row[e] * 8.0f) / 8.0f;
            }
          }
          std::vector<float> b(static_cast<std::size_t>(E));
          for (float& x : b) {
            const float tiny = std::ldexp(static_cast<float>(g() % 4), -22);
            x = bias_kind == 0   ? tiny
                : bias_kind == 1 ? 0.5f * static_cast<float>(sy_test::random_normal(1, g(), 1.0f)[0])
                : bias_kind == 2 ? 1000.0f * static_cast<float>(g() % 2) + tiny
                : bias_kind == 3 ? (g() % 8 == 0 ? (g() % 2 ? 1e30f : -1e30f) : tiny)
                                 : (g() % 8 == 0    ? (g() % 2 ? -inf : nan)
                                    : g() % 64 == 0 ? inf
                                                    : tiny);
          }
          std::vector<std::int32_t> ids(static_cast<std::size_t>(T) * K, sy_test::kPoisonI32);
          std::vector<float> w(static_cast<std::size_t>(T) * K);
          ASSERT_TRUE(switchyard::route(c, TensorView::of(v.data(), DType::kFloat32, {T, E}),
                                        TensorView::of(b.data(), DType::kFloat32, {E}),
                                        TensorView::of(ids.data(), DType::kInt32, {T, K}),
                                        TensorView::of(w.data(), DType::kFloat32, {T, K}))
                          .ok());
          float b_max = 0.0f;
          for (float x : b)
            if (std::fabs(x) < inf) b_max = std::max(b_max, std::fabs(x));
          const d::ApproxMargins margins = d::approx_margins(b_max, kErr);
          int certified = 0, certified_normal = 0;
          for (std::int64_t t = 0; t < T; ++t) {
            const float* row = v.data() + t * E;
            std::vector<float> qa(E), qe(E);
            for (int e = 0; e < E; ++e) {
              qa[e] = d::canonical_score(approx_sigmoid(row[e]) + b[e]);
              qe[e] = d::canonical_score(d::pre_elementwise(PreFn::kSigmoid, row[e]) + b[e]);
            }
            // Groups, as the kernel keeps them.
            std::vector<int> cand;
            bool groups_ok = true;
            if (grouped) {
              std::vector<int> kept;
              std::vector<float> kept_score;
              float dropped = d::neg_inf();
              for (int gi = 0; gi < n_group; ++gi) {
                std::vector<float> gq(qa.begin() + 32 * gi, qa.begin() + 32 * gi + 32);
                std::partial_sort(gq.begin(), gq.begin() + 2, gq.end(), std::greater<float>());
                const float score = d::canonical_score(take == 2 ? gq[0] + gq[1] : gq[0]);
                if (gi < c.topk_group) {
                  kept.push_back(gi);
                  kept_score.push_back(score);
                  continue;
                }
                std::size_t worst = 0;
                for (std::size_t j = 1; j < kept.size(); ++j)
                  if (kept_score[j] < kept_score[worst] ||
                      (kept_score[j] == kept_score[worst] && kept[j] > kept[worst]))
                    worst = j;
                if (score > kept_score[worst]) {
                  dropped = std::max(dropped, kept_score[worst]);
                  kept[worst] = gi;
                  kept_score[worst] = score;
                } else {
                  dropped = std::max(dropped, score);
                }
              }
              groups_ok = d::approx_groups_certified(*std::min_element(kept_score.begin(), kept_score.end()),
                                                     dropped, margins);
              for (int gi : kept)
                for (int e = 32 * gi; e < 32 * gi + 32; ++e) cand.push_back(e);
            } else {
              for (int e = 0; e < E; ++e) cand.push_back(e);
            }
            const auto by = [](const std::vector<float>& q) {
              return [&q](int x, int y) { return q[x] > q[y] || (q[x] == q[y] && x < y); };
            };
            std::partial_sort(cand.begin(), cand.begin() + K + 1, cand.end(), by(qa));
            const float u = qa[cand[K]];
            std::vector<int> picks(cand.begin(), cand.begin() + K);
            std::sort(picks.begin(), picks.end(), by(qe));
            const bool ok = groups_ok && d::approx_picks_certified(qe[picks[K - 1]], u, margins);
            bool same = true, same_approx = true;
            for (int k = 0; k < K; ++k) {
              same = same && picks[k] == ids[t * K + k];
              same_approx = same_approx && cand[k] == ids[t * K + k];
            }
            if (ok) {
              ++certified;
              if (t % 3 == 1) ++certified_normal;
              ASSERT_TRUE(same) << "certified row " << t << " differs: E " << E << " K " << K << " grouped "
                                << grouped << " bias kind " << bias_kind;
            } else if (t % 3 == 0) {
              ++total_cluster_redo;
              if (!same_approx) ++total_wrong_if_trusted;
            }
          }
          SCOPED_TRACE("E " + std::to_string(E) + " K " + std::to_string(K) + " grouped " +
                       std::to_string(grouped) + " bias kind " + std::to_string(bias_kind));
          // N(0, 1) rows with small biases: nearly every one is certified (the kernel's redo stays rare).
          if (bias_kind <= 1) EXPECT_GE(certified_normal, T / 3 - T / 30);
          // Biases of +-1e30 tie their experts' q exactly, as do +inf ones: those rows are routed again.
          if (bias_kind <= 2) EXPECT_GT(certified, 0);
        }
      }
    }
  }
  // The clusters reach the fallback, and trusting the approximate order there would be wrong.
  EXPECT_GT(total_cluster_redo, 100);
  EXPECT_GT(total_wrong_if_trusted, 10);
}

}  // namespace
