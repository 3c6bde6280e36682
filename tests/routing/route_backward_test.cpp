// route_backward on the CPU against an fp64 reference written here from routing.h's formulas
// (docs/design.md section 7): every pre x post pair, bias, scale, bf16 / fp16 logits, non-finite
// logits and biases, with the picks route() makes; and its argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/float_formats.h"
#include "common/routing_names.h"
#include "common/test_data.h"
#include "switchyard/routing.h"

namespace {

using switchyard::Device;
using switchyard::DType;
using switchyard::PostFn;
using switchyard::PreFn;
using switchyard::RoutingConfig;
using switchyard::Status;
using switchyard::TensorView;

struct Case {
  int E = 16, K = 4;
  std::int64_t T = 9;
  PreFn pre = PreFn::kSoftmax;
  PostFn post = PostFn::kNormalize;
  float scale = 1.0f;
  bool bias = false;
  DType dtype = DType::kFloat32;
  bool non_finite = false;  // some logits (and bias entries) inf / NaN
};

std::string describe(const Case& c) {
  std::ostringstream os;
  os << "E=" << c.E << " K=" << c.K << " T=" << c.T << " pre=" << static_cast<int>(c.pre)
     << " post=" << static_cast<int>(c.post) << " scale=" << c.scale << " bias=" << c.bias
     << " dtype=" << switchyard::dtype_name(c.dtype) << " non_finite=" << c.non_finite;
  return os.str();
}

double softplus(double x) { return x > 0 ? x + std::log1p(std::exp(-x)) : std::log1p(std::exp(x)); }
double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// d logits of one row in fp64. With `magnitude`, every difference becomes a sum of absolute values
// (the size of the terms whose rounding bounds the fp32 error, where the result cancels to ~0).
std::vector<double> reference_row(const Case& c, const std::vector<double>& s, const std::vector<double>& bias,
                                  const std::vector<std::int64_t>& ids, const std::vector<double>& dw,
                                  bool magnitude = false) {
  auto sub = [&](double a, double b) { return magnitude ? std::fabs(a) + std::fabs(b) : a - b; };
  auto mul = [&](double a, double b) { return magnitude ? std::fabs(a * b) : a * b; };
  const int E = c.E, K = c.K;
  std::vector<double> p(E, 0.0);
  std::vector<bool> fin(E);
  for (int e = 0; e < E; ++e) fin[e] = std::isfinite(s[e]);
  if (c.pre == PreFn::kSoftmax) {
    double m = -INFINITY, z = 0.0;
    for (int e = 0; e < E; ++e)
      if (fin[e]) m = std::max(m, s[e]);
    for (int e = 0; e < E; ++e)
      if (fin[e]) z += std::exp(s[e] - m);
    for (int e = 0; e < E; ++e) p[e] = fin[e] ? std::exp(s[e] - m) / z : 0.0;
  } else {
    for (int e = 0; e < E; ++e) {
      if (!fin[e]) continue;
      p[e] = c.pre == PreFn::kSigmoid        ? sigmoid(s[e])
             : c.pre == PreFn::kSqrtSoftplus ? std::sqrt(softplus(s[e]))
                                             : s[e];
    }
  }
  std::vector<double> g(K, 0.0), u(K, 0.0), dg(K, 0.0);
  std::vector<bool> valid(K);
  for (int k = 0; k < K; ++k) {
    const std::int64_t id = ids[k];
    valid[k] = id >= 0 && id < E && fin[id] && (bias.empty() || std::isfinite(bias[id]));
    if (!valid[k]) continue;
    g[k] = p[id];
    u[k] = dw[k] * c.scale;
  }
  if (c.post == PostFn::kSoftmax) {
    double m = -INFINITY, z = 0.0, a = 0.0;
    for (int k = 0; k < K; ++k)
      if (valid[k]) m = std::max(m, g[k]);
    for (int k = 0; k < K; ++k)
      if (valid[k]) z += std::exp(g[k] - m);
    for (int k = 0; k < K; ++k)
      if (valid[k]) a += mul(std::exp(g[k] - m) / z, u[k]);
    for (int k = 0; k < K; ++k)
      if (valid[k]) dg[k] = std::exp(g[k] - m) / z * sub(u[k], a);
  } else if (c.post == PostFn::kNormalize) {
    double sum = 0.0, b = 0.0;
    for (int k = 0; k < K; ++k)
      if (valid[k]) sum += g[k], b += mul(u[k], g[k]);
    const double d = magnitude ? std::fabs(sum + 1e-20) : sum + 1e-20;
    for (int k = 0; k < K; ++k)
      if (valid[k]) dg[k] = sub(u[k] / d, b / (d * d));
  } else if (c.post == PostFn::kSigmoid) {
    for (int k = 0; k < K; ++k)
      if (valid[k]) dg[k] = mul(u[k], sigmoid(g[k]) * (1 - sigmoid(g[k])));
  } else {
    for (int k = 0; k < K; ++k)
      if (valid[k]) dg[k] = magnitude ? std::fabs(u[k]) : u[k];
  }
  std::vector<double> dp(E, 0.0), ds(E, 0.0);
  double cs = 0.0;
  for (int k = 0; k < K; ++k) {
    if (!valid[k]) continue;
    dp[ids[k]] += dg[k];
    cs += mul(p[ids[k]], dg[k]);
  }
  for (int e = 0; e < E; ++e) {
    if (!fin[e]) continue;
    switch (c.pre) {
      case PreFn::kSoftmax:
        ds[e] = p[e] * sub(dp[e], cs);
        break;
      case PreFn::kSigmoid:
        ds[e] = mul(dp[e], p[e] * (1 - p[e]));
        break;
      case PreFn::kSqrtSoftplus:
        ds[e] = p[e] > 0 ? mul(dp[e], sigmoid(s[e]) / (2 * p[e])) : 0.0;
        break;
      default:
        ds[e] = dp[e];
    }
  }
  return ds;
}

float stored_to_float(DType dtype, const std::vector<std::uint8_t>& b, std::int64_t i) {
  return sy_test::load_as_float(dtype, b.data(), i);
}

void store(DType dtype, std::vector<std::uint8_t>* b, std::int64_t i, float v) {
  if (dtype == DType::kFloat32) {
    std::memcpy(b->data() + 4 * i, &v, 4);
  } else {
    const std::uint16_t h = dtype == DType::kBFloat16 ? sy_test::bf16_bits(v) : sy_test::fp16_bits(v);
    std::memcpy(b->data() + 2 * i, &h, 2);
  }
}

void run_case(const Case& c, std::uint64_t seed) {
  SCOPED_TRACE(describe(c) + " seed=" + std::to_string(seed));
  std::mt19937_64 g(seed);
  std::normal_distribution<float> n(0.0f, 1.5f);
  const int E = c.E, K = c.K;
  const std::int64_t T = c.T;
  const std::size_t elem = switchyard::dtype_size(c.dtype);
  std::vector<std::uint8_t> logits(static_cast<std::size_t>(T * E) * elem);
  for (std::int64_t i = 0; i < T * E; ++i) {
    float v = n(g);
    if (c.non_finite && g() % 11 == 0) v = g() % 3 == 0 ? NAN : (g() % 2 ? INFINITY : -INFINITY);
    store(c.dtype, &logits, i, v);
  }
  std::vector<float> bias;
  if (c.bias) {
    for (int e = 0; e < E; ++e) bias.push_back(c.non_finite && e % 7 == 3 ? NAN : 0.1f * n(g));
  }
  const Device cpu = Device::cpu();
  const TensorView lv = TensorView::of(logits.data(), c.dtype, {T, E}, cpu);
  const TensorView bv = c.bias ? TensorView::of(bias.data(), DType::kFloat32, {E}, cpu) : TensorView{};
  std::vector<std::int32_t> ids(static_cast<std::size_t>(T * K));
  std::vector<float> w(static_cast<std::size_t>(T * K));
  const RoutingConfig cfg = sy_test::make_config(c.E, c.K, c.pre, c.post, c.scale);
  Status st = switchyard::route(cfg, lv, bv, TensorView::of(ids.data(), DType::kInt32, {T, K}, cpu),
                                TensorView::of(w.data(), DType::kFloat32, {T, K}, cpu));
  ASSERT_TRUE(st.ok()) << st.to_string();
  std::vector<float> dw(static_cast<std::size_t>(T * K));
  for (float& v : dw) v = n(g);
  std::vector<std::uint8_t> out(static_cast<std::size_t>(T * E + 4) * elem, sy_test::kPoisonByte);
  st = switchyard::route_backward(cfg, lv, bv, TensorView::of(ids.data(), DType::kInt32, {T, K}, cpu),
                                  TensorView::of(dw.data(), DType::kFloat32, {T, K}, cpu),
                                  TensorView::of(out.data(), c.dtype, {T, E}, cpu));
  ASSERT_TRUE(st.ok()) << st.to_string();
  // fp32: within 1e-5 of the row's largest |d logit| (exp and sums in fp32); 16-bit outputs add
  // their rounding (2^-8 relative for bf16, 2^-11 for fp16).
  const double rel = c.dtype == DType::kFloat32 ? 0.0 : c.dtype == DType::kBFloat16 ? 1.0 / 256 : 1.0 / 2048;
  int failures = 0;
  for (std::int64_t t = 0; t < T && failures < 5; ++t) {
    std::vector<double> s(E), b, d(K);
    for (int e = 0; e < E; ++e) s[e] = stored_to_float(c.dtype, logits, t * E + e);
    for (float v : bias) b.push_back(v);
    std::vector<std::int64_t> row_ids(ids.begin() + t * K, ids.begin() + (t + 1) * K);
    for (int k = 0; k < K; ++k) d[k] = dw[t * K + k];
    const std::vector<double> want = reference_row(c, s, b, row_ids, d);
    const std::vector<double> terms = reference_row(c, s, b, row_ids, d, /*magnitude=*/true);
    double row_max = 0.0;  // the largest terms of the row
    for (double v : terms) row_max = std::max(row_max, std::fabs(v));
    for (int e = 0; e < E && failures < 5; ++e) {
      const double got = stored_to_float(c.dtype, out, t * E + e);
      const double tol = 1e-5 * row_max + rel * std::fabs(want[e]) + 1e-30;
      if (!(std::fabs(got - want[e]) <= tol)) {
        ADD_FAILURE() << "grad_logits[" << t << "," << e << "] = " << got << ", fp64 " << want[e]
                      << " (largest terms of the row " << row_max << ")";
        ++failures;
      }
    }
  }
  for (std::size_t i = static_cast<std::size_t>(T * E) * elem; i < out.size(); ++i) {
    if (out[i] != sy_test::kPoisonByte) {
      ADD_FAILURE() << "written past [T, E]";
      break;
    }
  }
}

TEST(RouteBackwardCpu, EveryPreAndPostFunction) {
  const std::uint64_t seed = sy_test::test_seed();
  std::mt19937_64 g(seed);
  const PreFn pres[] = {PreFn::kNone, PreFn::kSoftmax, PreFn::kSigmoid, PreFn::kSqrtSoftplus};
  const PostFn posts[] = {PostFn::kNone, PostFn::kSoftmax, PostFn::kSigmoid, PostFn::kNormalize};
  const DType dtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  int i = 0;
  for (PreFn pre : pres) {
    for (PostFn post : posts) {
      Case c;
      c.pre = pre;
      c.post = post;
      c.E = i % 3 == 0 ? 256 : i % 3 == 1 ? 13 : 64;
      c.K = i % 3 == 0 ? 8 : i % 3 == 1 ? 3 : 6;
      c.T = 7 + i;
      c.scale = i % 2 ? 2.5f : 1.0f;
      c.bias = i % 4 >= 2;
      c.dtype = dtypes[i % 3];
      c.non_finite = i % 5 == 4;
      run_case(c, g());
      c.non_finite = !c.non_finite;  // every pair with and without non-finite values
      run_case(c, g());
      ++i;
    }
  }
}

TEST(RouteBackwardCpu, ArgumentsAreCheckedAndNamed) {
  const Device cpu = Device::cpu();
  const RoutingConfig cfg = sy_test::make_config(8, 2, PreFn::kSoftmax, PostFn::kSoftmax);
  std::vector<float> logits(3 * 8, 0.5f), dw(6, 1.0f), out(3 * 8, 7.0f);
  std::vector<std::int32_t> ids = {0, 1, 2, 3, 4, 5};
  const TensorView l = TensorView::of(logits.data(), DType::kFloat32, {3, 8}, cpu);
  const TensorView i = TensorView::of(ids.data(), DType::kInt32, {3, 2}, cpu);
  const TensorView w = TensorView::of(dw.data(), DType::kFloat32, {3, 2}, cpu);
  std::vector<std::uint16_t> out16(3 * 8);
  const Status wrong_dtype = switchyard::route_backward(cfg, l, {}, i, w,
                                                        TensorView::of(out16.data(), DType::kBFloat16, {3, 8}, cpu));
  EXPECT_NE(wrong_dtype.message().find("'grad_logits'"), std::string::npos) << wrong_dtype.message();
  const Status wrong_shape =
      switchyard::route_backward(cfg, l, {}, i, TensorView::of(dw.data(), DType::kFloat32, {3, 1}, cpu),
                                 TensorView::of(out.data(), DType::kFloat32, {3, 8}, cpu));
  EXPECT_NE(wrong_shape.message().find("'grad_weights'"), std::string::npos) << wrong_shape.message();
  for (float v : out) EXPECT_EQ(v, 7.0f);
  const TensorView good = TensorView::of(out.data(), DType::kFloat32, {3, 8}, cpu);
  EXPECT_TRUE(switchyard::route_backward(cfg, l, {}, i, w, good).ok());
}

}  // namespace
