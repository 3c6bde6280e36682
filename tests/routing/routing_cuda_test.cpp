// CUDA routing against the CPU oracle (docs/design.md section 2, issue 3). Every case runs
// switchyard::route on the GPU and on the CPU over the same input bits and demands:
//   * topk_ids exactly equal (tie order included), every element written;
//   * topk_weights bit-equal, fp32 and bf16 alike. The kernels reproduce the oracle's
//     arithmetic operation for operation (route_warp.cuh), so the tolerance is zero for every
//     logits dtype; bf16 weights are the same fp32 value rounded by the same routine. The one
//     exception: softmax -> normalize rows on the staged kernels (route_staged.cuh) take their
//     weights from the picks alone, within 1e-6 relative of the oracle's (one bf16 ulp for bf16
//     weights); their cases say so (Case::weight_tol).
// Outputs are poisoned before each GPU call. Inputs are fresh random data on every run; the
// seed is in the failure trace. Without a usable GPU every test skips with the reason.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "common/cuda_test_util.h"
#include "common/numeric.h"
#include "common/routing_names.h"
#include "common/scoped_value.h"
#include "common/test_data.h"
#include "routing/sigmoid_approx_bound.h"
#include "switchyard/switchyard.h"

namespace {

using switchyard::Device;
using switchyard::DType;
using switchyard::GroupRule;
using switchyard::ModelPreset;
using switchyard::PostFn;
using switchyard::PreFn;
using switchyard::RoutingConfig;
using switchyard::Status;
using switchyard::TensorView;

// The kernel options every GPU call of this file passes; a test forces a form by setting a field
// for its scope (sy_test::ScopedValue).
switchyard::RouteOptions g_options;
using sy_test::make_config;
using sy_test::DeviceBuffer;

// Input distributions.
enum class Kind {
  kNormal,   // N(0, 1)
  kWide,     // N(0, 40): exp/sigmoid arguments past the fast range, huge/tiny softmax terms
  kTied,     // four levels: many exact ties in scores, group scores and weights
  kSpecial,  // NaN, +-inf, -0, huge, subnormal values, and whole rows of them
  // The best values of a row in the experts of one lane (e with (e / 4) % 32 == l: the lane
  // layout of route_warp.cuh), on 3 tied levels, sometimes tied with one expert of another lane:
  // one lane holds more picks than its candidate buffer, and ties meet the K-th pick.
  kLaneHeavy,
  // Up to 48 values of a row a few ulps apart (spreads of 4 to 4096 ulps above a random base),
  // in random experts, over N(0, 1): keys that share their high bits but differ in the low ones,
  // and some exact ties. route_warp.cuh's packed top-K rounds rank by the high bits and the
  // expert index; every such pair among the picks or at the K-th pick must send the row to the
  // exact rounds.
  kNearTied,
  // The last expert far above the rest, experts 0 .. 9 tied below it, everything else lower:
  // with one expert per group and topk_group = K, the kept experts sit in three lanes' buffers,
  // which run dry before K picks (the packed top-K rounds then see rounds without a head).
  kDryBuffers,
  // N(0, 1) - 8: every score of the row below zero (keys of negative bf16 / fp16 values have their
  // low bits all ones, which route_warp.cuh's packed buffers restore from a pick's bucket).
  kNegative,
  // Rows built for the packed buffers' check (route_warp.cuh, select_top_k_packed): N(0, 1) - 4,
  // with expert p = 4 * l1 of lane l1 at x = 3 and, in a later lane l2 (its experts 4 * l2 + c in
  // the first stripe), h = x and values one ulp above x after it: one bucket, p first in it. Even
  // rows: h and one value above it; odd rows: lane l2's first expert at 5 (its first pick), then
  // h and two values above it (the second one hidden outside the lane's buffer). A check that
  // trusted a head equal to the last pick would keep p (K = 1, 2) where the oracle picks x + 1 ulp.
  kHiddenInBucket,
  // N(0, 1) rows made flat-top (sy_test::flat_top_row: distinct logits whose softmax p nearly all
  // round equal), for route_staged.cuh's softmax p test.
  kFlatTop,
  // Rows of +0 and -0 with 0-9 positive values, a few -1, -inf and NaNs with payloads in their low
  // bits (and in the bf16 ones), so that the K-th pick and the one after it are often +0 and -0: for
  // route_staged.cuh's raw keys, which rank NaN above +inf or below -inf and -0 below +0. With a bias,
  // some biases are NaN, -inf or +inf (route_staged.cuh's kApprox kernels store NaN ones as -inf).
  kZeros,
  // For the approximate selection of sigmoid + bias rows (route_staged.cuh's kApprox): N(0, 1) - 1 with
  // a cluster of 1 + (row % 40) experts, in random places, at one level in [3, 4) plus 0-47 ulps, so
  // that many sigmoids tie exactly and the rest lie within the approximation's error of each other; with
  // make_bias's bias a few ulps apart (and on a third of the seeds 1000 on half the experts, so that q
  // rounds to ulps of 2^-14 and the margin grows with the bias), the cluster's order and its K-th pick
  // are decided by less than the approximate sigmoid's error: the picks must be put in exact order, or
  // the row routed again.
  kApproxCluster,
};
const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kNormal:
      return "normal";
    case Kind::kWide:
      return "wide";
    case Kind::kTied:
      return "tied";
    case Kind::kSpecial:
      return "special";
    case Kind::kLaneHeavy:
      return "lane-heavy";
    case Kind::kNearTied:
      return "near-tied";
    case Kind::kDryBuffers:
      return "dry-buffers";
    case Kind::kNegative:
      return "negative";
    case Kind::kHiddenInBucket:
      return "hidden-in-bucket";
    case Kind::kFlatTop:
      return "flat-top";
    case Kind::kZeros:
      return "zeros";
    case Kind::kApproxCluster:
      return "approx-cluster";
  }
  return "?";
}

using sy_test::post_name;
using sy_test::pre_name;
using sy_test::rule_name;

struct Case {
  RoutingConfig config;
  std::int64_t T = 1;
  DType logits_dtype = DType::kFloat32;
  bool bias = false;
  DType bias_dtype = DType::kFloat32;
  DType ids_dtype = DType::kInt32;
  DType weights_dtype = DType::kFloat32;
  Kind kind = Kind::kNormal;
  std::int64_t extra_stride = 0;  // row stride = E + extra_stride
  std::int64_t base_offset = 0;   // logits start this many elements into their buffer
  // 0: weights bit-equal to the oracle's. Else fp32 weights within weight_tol relative (plus 1e-30
  // absolute) and bf16 weights within one bf16 ulp: the staged softmax -> normalize rows, whose
  // weights come from the picks alone (route_staged.cuh, step 5).
  float weight_tol = 0.0f;

  std::string describe() const {
    std::ostringstream s;
    const RoutingConfig& c = config;
    s << "E=" << c.num_experts << " K=" << c.top_k << " pre=" << pre_name(c.pre)
      << " post=" << post_name(c.post) << " group=" << rule_name(c.group_rule) << "(" << c.n_group << "/"
      << c.topk_group << ")"
      << " scale=" << c.scale << " T=" << T << " logits=" << switchyard::dtype_name(logits_dtype)
      << " bias=" << (bias ? switchyard::dtype_name(bias_dtype) : "-")
      << " ids=" << switchyard::dtype_name(ids_dtype) << " weights=" << switchyard::dtype_name(weights_dtype)
      << " kind=" << kind_name(kind) << " stride=+" << extra_stride << " offset=" << base_offset;
    if (weight_tol > 0.0f) s << " weight_tol=" << weight_tol;
    return s.str();
  }
};

float special_value(std::mt19937_64& g) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const float v[] = {nan,    -nan,  inf,    -inf,   -0.0f,  0.0f,  1e30f,
                     -1e30f, 90.0f, -90.0f, 1e-40f, -3e38f, 3e38f, 88.8f};
  return v[g() % (sizeof(v) / sizeof(v[0]))];
}

// Logit values for a [T, E] problem (row-major, no stride).
std::vector<float> make_values(Kind kind, std::int64_t T, int E, std::uint64_t seed) {
  const std::size_t n = static_cast<std::size_t>(T) * E;
  switch (kind) {
    case Kind::kNormal:
      return sy_test::random_normal(n, seed, 1.0f);
    case Kind::kWide:
      return sy_test::random_normal(n, seed, 40.0f);
    case Kind::kTied:
      return sy_test::random_tied(n, seed, 4);
    case Kind::kLaneHeavy: {
      std::vector<float> v = sy_test::random_normal(n, seed, 1.0f);
      std::mt19937_64 g(seed ^ 0x5bd1e995u);
      for (std::int64_t t = 0; t < T; ++t) {
        float* row = v.data() + t * E;
        const int lane = static_cast<int>(g() % 32);
        for (int e = 0; e < E; ++e)
          if ((e / 4) % 32 == lane) row[e] = 4.0f + 0.5f * static_cast<float>(g() % 3);
        if (g() % 4 == 0) row[g() % E] = 4.5f;  // maybe a tie from another lane
      }
      return v;
    }
    case Kind::kNearTied: {
      std::vector<float> v = sy_test::random_normal(n, seed, 1.0f);
      std::mt19937_64 g(seed ^ 0x2545f4914f6cdd1dull);
      const std::uint32_t spreads[] = {4, 16, 256, 4096};
      for (std::int64_t t = 0; t < T; ++t) {
        float* row = v.data() + t * E;
        const float base = 2.0f + 0.25f * static_cast<float>(g() % 8);
        std::uint32_t u;
        std::memcpy(&u, &base, 4);
        const std::uint32_t spread = spreads[g() % 4];
        const int m = 8 + static_cast<int>(g() % 41);
        for (int j = 0; j < m; ++j) {
          const std::uint32_t b = u + static_cast<std::uint32_t>(g() % spread);
          std::memcpy(&row[g() % E], &b, 4);
        }
      }
      return v;
    }
    case Kind::kDryBuffers: {
      std::vector<float> v = sy_test::random_normal(n, seed, 1.0f);
      for (std::int64_t t = 0; t < T; ++t) {
        float* row = v.data() + t * E;
        for (int e = 0; e < E; ++e) row[e] = e < 10 ? 1.0f : row[e] - 4.0f;
        row[E - 1] = (t % 2) ? 5.0f : std::numeric_limits<float>::infinity();
      }
      return v;
    }
    case Kind::kNegative: {
      std::vector<float> v = sy_test::random_normal(n, seed, 1.0f);
      for (float& x : v) x -= 8.0f;
      return v;
    }
    case Kind::kHiddenInBucket: {
      std::vector<float> v = sy_test::random_normal(n, seed, 1.0f);
      std::mt19937_64 g(seed ^ 0x94d049bb133111ebull);
      const float x = 3.0f, above = std::nextafter(x, 4.0f);
      for (std::int64_t t = 0; t < T; ++t) {
        float* row = v.data() + t * E;
        for (int e = 0; e < E; ++e) row[e] -= 4.0f;
        const int l1 = static_cast<int>(g() % 31);
        const int l2 = l1 + 1 + static_cast<int>(g() % static_cast<unsigned>(31 - l1));
        row[4 * l1] = x;
        if (t % 2 == 0) {
          row[4 * l2 + 1] = x;
          row[4 * l2 + 2] = above;
        } else {
          row[4 * l2] = 5.0f;
          row[4 * l2 + 1] = x;
          row[4 * l2 + 2] = above;
          row[4 * l2 + 3] = above;
        }
      }
      return v;
    }
    case Kind::kFlatTop: {
      std::vector<float> v = sy_test::random_normal(n, seed, 1.0f);
      std::mt19937_64 g(seed ^ 0xd6e8feb86659fd93ull);
      for (std::int64_t t = 0; t < T; ++t) sy_test::flat_top_row(v.data() + t * E, E, g);
      return v;
    }
    case Kind::kZeros: {
      std::vector<float> v(n);
      std::mt19937_64 g(seed ^ 0x8bb84b93962eacc9ull);
      const std::uint32_t odd[] = {0x7f800001u, 0xff800001u, 0x7f810000u,
                                   0xff810000u, 0x7f8001ffu, 0xff800000u};
      for (std::int64_t t = 0; t < T; ++t) {
        float* row = v.data() + t * E;
        for (int e = 0; e < E; ++e) {
          const unsigned r = static_cast<unsigned>(g() % 100);
          if (r < 90) {
            row[e] = (g() % 2) ? -0.0f : 0.0f;
          } else if (r < 96) {
            row[e] = -1.0f;
          } else {
            const std::uint32_t b = odd[g() % 6];
            std::memcpy(&row[e], &b, 4);
          }
        }
        const int positives = static_cast<int>(g() % 10);
        for (int j = 0; j < positives; ++j) row[g() % E] = 0.5f + static_cast<float>(g() % 3);
      }
      return v;
    }
    case Kind::kApproxCluster: {
      std::vector<float> v = sy_test::random_normal(n, seed, 1.0f);
      std::mt19937_64 g(seed ^ 0xbf58476d1ce4e5b9ull);
      for (std::int64_t t = 0; t < T; ++t) {
        float* row = v.data() + t * E;
        for (int e = 0; e < E; ++e) row[e] -= 1.0f;
        const float base = 3.0f + 0.125f * static_cast<float>(g() % 8);
        std::uint32_t u;
        std::memcpy(&u, &base, 4);
        const int m = std::min(E, 1 + static_cast<int>(t % 40));
        for (int j = 0; j < m; ++j) {
          const std::uint32_t b = u + static_cast<std::uint32_t>(g() % 48);
          std::memcpy(&row[g() % E], &b, 4);  // may land on an expert already set: fewer, still close
        }
      }
      return v;
    }
    case Kind::kSpecial:
      break;
  }
  std::vector<float> v = sy_test::random_normal(n, seed, 2.0f);
  std::mt19937_64 g(seed ^ 0x9e3779b97f4a7c15ull);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (std::int64_t t = 0; t < T; ++t) {
    float* row = v.data() + t * E;
    switch (t % 8) {
      case 1:
        std::fill(row, row + E, nan);
        break;  // no finite logit at all
      case 2:
        std::fill(row, row + E, -inf);
        break;
      case 3:  // one finite logit among NaN
        std::fill(row, row + E, nan);
        row[g() % E] = 0.5f;
        break;
      case 4:
        std::fill(row, row + E, inf);
        break;
      case 5:  // many specials
        for (int e = 0; e < E; ++e)
          if (g() % 3 == 0) row[e] = special_value(g);
        break;
      default:
        for (int e = 0; e < E; ++e)
          if (g() % 20 == 0) row[e] = special_value(g);
        break;
    }
  }
  return v;
}

std::vector<float> make_bias(Kind kind, int E, std::uint64_t seed) {
  if (kind == Kind::kTied) return sy_test::random_tied(static_cast<std::size_t>(E), seed, 3);
  if (kind == Kind::kNearTied || kind == Kind::kApproxCluster) {  // a few ulps of the scores: the near
    std::mt19937_64 g(seed + 2);                                  // ties survive the bias
    const float big = (kind == Kind::kApproxCluster && seed % 3 == 0) ? 1000.0f : 0.0f;
    std::vector<float> b(static_cast<std::size_t>(E));
    for (float& x : b) x = big * static_cast<float>(g() % 2) + std::ldexp(static_cast<float>(g() % 4), -22);
    return b;
  }
  std::vector<float> b = sy_test::random_normal(static_cast<std::size_t>(E), seed, 0.5f);
  if (kind == Kind::kSpecial) {
    std::mt19937_64 g(seed + 1);
    for (float& x : b)
      if (g() % 10 == 0) x = (g() % 2) ? -0.0f : 0.0f;
  }
  if (kind == Kind::kZeros) {  // non-finite biases (docs/design.md 2.6): q = NaN ranks as -inf,
                               // so does a -inf mask
    std::mt19937_64 g(seed + 3);
    const std::uint32_t odd[] = {0x7fc00000u, 0xffc00001u, 0x7f800001u,
                                 0xff800000u, 0xff800000u, 0x7f800000u};
    for (float& x : b)
      if (g() % 12 == 0) std::memcpy(&x, &odd[g() % 6], 4);
  }
  return b;
}

// Host buffer of `count` elements of `dtype` holding `values` (converted the library's way).
std::vector<std::uint8_t> encode(const std::vector<float>& values, DType dtype, std::size_t count,
                                 std::size_t first, std::size_t stride, std::size_t row_len) {
  const std::size_t es = switchyard::dtype_size(dtype);
  std::vector<std::uint8_t> out(count * es, 0);
  const std::size_t rows = row_len == 0 ? 0 : values.size() / row_len;
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t e = 0; e < row_len; ++e) {
      const float v = values[r * row_len + e];
      const std::size_t i = first + r * stride + e;
      if (dtype == DType::kFloat32) {
        std::memcpy(&out[i * 4], &v, 4);
      } else {
        const std::uint16_t h = dtype == DType::kBFloat16 ? switchyard::detail::float_to_bf16(v)
                                                          : switchyard::detail::float_to_fp16(v);
        std::memcpy(&out[i * 2], &h, 2);
      }
    }
  }
  return out;
}

std::int64_t id_at(const std::vector<std::uint8_t>& ids, DType dtype, std::size_t i) {
  if (dtype == DType::kInt64) {
    std::int64_t v;
    std::memcpy(&v, &ids[i * 8], 8);
    return v;
  }
  std::int32_t v;
  std::memcpy(&v, &ids[i * 4], 4);
  return v;
}
std::uint32_t weight_bits(const std::vector<std::uint8_t>& w, DType dtype, std::size_t i) {
  if (dtype == DType::kBFloat16) {
    std::uint16_t v;
    std::memcpy(&v, &w[i * 2], 2);
    return v;
  }
  std::uint32_t v;
  std::memcpy(&v, &w[i * 4], 4);
  return v;
}
float weight_value(std::uint32_t bits, DType dtype) {
  if (dtype == DType::kBFloat16) return switchyard::detail::bf16_to_float(static_cast<std::uint16_t>(bits));
  return switchyard::detail::bits_float(bits);
}

// Whether a GPU weight matches the oracle's under Case::weight_tol.
bool weight_matches(std::uint32_t gpu, std::uint32_t cpu, DType dtype, float tol) {
  if (gpu == cpu) return true;
  if (tol == 0.0f) return false;
  const double g = weight_value(gpu, dtype), c = weight_value(cpu, dtype);
  if (!std::isfinite(g) || !std::isfinite(c)) return false;
  if (dtype == DType::kBFloat16)
    return (gpu >> 15) == (cpu >> 15) && (gpu > cpu ? gpu - cpu : cpu - gpu) == 1u;
  return std::fabs(g - c) <= static_cast<double>(tol) * std::fabs(c) + 1e-30;
}

// The inputs of one case, on the host and on the device.
struct Problem {
  Case c;
  std::int64_t stride = 0;
  std::vector<float> values;  // [T, E]
  std::vector<std::uint8_t> logits_host, bias_host;
  DeviceBuffer logits_dev, bias_dev, ids_dev, weights_dev;

  TensorView logits_view(Device d) const {
    const void* base = d.is_cuda() ? logits_dev.get() : static_cast<const void*>(logits_host.data());
    const std::size_t es = switchyard::dtype_size(c.logits_dtype);
    const void* p = static_cast<const std::uint8_t*>(base) + c.base_offset * es;
    return TensorView::of(p, c.logits_dtype, {c.T, c.config.num_experts}, d).with_row_stride(stride);
  }
  TensorView bias_view(Device d) const {
    if (!c.bias) return TensorView{};
    const void* p = d.is_cuda() ? bias_dev.get() : static_cast<const void*>(bias_host.data());
    return TensorView::of(p, c.bias_dtype, {c.config.num_experts}, d);
  }
};

void fill_inputs(Problem& pr, std::uint64_t seed) {
  const Case& c = pr.c;
  const int E = c.config.num_experts;
  pr.values = make_values(c.kind, c.T, E, seed);
  const std::size_t count =
      static_cast<std::size_t>(c.base_offset + (c.T > 0 ? (c.T - 1) * pr.stride + E : 0));
  pr.logits_host = encode(pr.values, c.logits_dtype, count, c.base_offset, pr.stride, E);
  if (c.bias) pr.bias_host = encode(make_bias(c.kind, E, seed + 7), c.bias_dtype, E, 0, E, E);
}

Problem make_problem(const Case& c, std::uint64_t seed) {
  Problem pr;
  pr.c = c;
  pr.stride = c.config.num_experts + c.extra_stride;
  fill_inputs(pr, seed);
  pr.logits_dev = sy_test::to_device(pr.logits_host);
  if (c.bias) pr.bias_dev = sy_test::to_device(pr.bias_host);
  const std::size_t n = static_cast<std::size_t>(c.T) * c.config.top_k;
  pr.ids_dev = DeviceBuffer(n * switchyard::dtype_size(c.ids_dtype) + 64);
  pr.weights_dev = DeviceBuffer(n * switchyard::dtype_size(c.weights_dtype) + 64);
  return pr;
}

// CPU oracle outputs for the problem's current inputs.
void run_cpu(const Problem& pr, std::vector<std::uint8_t>* ids, std::vector<std::uint8_t>* weights) {
  const Case& c = pr.c;
  const std::size_t n = static_cast<std::size_t>(c.T) * c.config.top_k;
  ids->assign(n * switchyard::dtype_size(c.ids_dtype), 0);
  weights->assign(n * switchyard::dtype_size(c.weights_dtype), 0);
  const Status s = switchyard::route(c.config, pr.logits_view(Device::cpu()), pr.bias_view(Device::cpu()),
                                     TensorView::of(ids->data(), c.ids_dtype, {c.T, c.config.top_k}),
                                     TensorView::of(weights->data(), c.weights_dtype, {c.T, c.config.top_k}));
  ASSERT_TRUE(s.ok()) << "CPU oracle: " << s.to_string();
}

TensorView ids_view(const Problem& pr) {
  return TensorView::of(pr.ids_dev.get(), pr.c.ids_dtype, {pr.c.T, pr.c.config.top_k}, Device::cuda());
}
TensorView weights_view(const Problem& pr) {
  return TensorView::of(pr.weights_dev.get(), pr.c.weights_dtype, {pr.c.T, pr.c.config.top_k},
                        Device::cuda());
}

// Compares the device outputs with the CPU oracle; reports the first few differences.
void compare(const Problem& pr, const std::vector<std::uint8_t>& cpu_ids,
             const std::vector<std::uint8_t>& cpu_w) {
  const Case& c = pr.c;
  const int K = c.config.top_k;
  const std::size_t n = static_cast<std::size_t>(c.T) * K;
  const auto gpu_ids = sy_test::to_host<std::uint8_t>(pr.ids_dev, cpu_ids.size());
  const auto gpu_w = sy_test::to_host<std::uint8_t>(pr.weights_dev, cpu_w.size());
  int reported = 0;
  std::int64_t bad_rows = 0, last_bad = -1;
  for (std::size_t i = 0; i < n; ++i) {
    const std::int64_t gi = id_at(gpu_ids, c.ids_dtype, i), ci = id_at(cpu_ids, c.ids_dtype, i);
    const std::uint32_t gw = weight_bits(gpu_w, c.weights_dtype, i),
                        cw = weight_bits(cpu_w, c.weights_dtype, i);
    if (gi == ci && weight_matches(gw, cw, c.weights_dtype, c.weight_tol)) continue;
    const std::int64_t t = static_cast<std::int64_t>(i) / K;
    if (t != last_bad) ++bad_rows;
    last_bad = t;
    if (reported < 6) {
      ++reported;
      std::ostringstream row;
      const int E = c.config.num_experts;
      for (int e = 0; e < std::min(E, 12); ++e) row << pr.values[t * E + e] << " ";
      ADD_FAILURE() << "row " << t << " k " << (i % K) << ": gpu id " << gi << " weight "
                    << weight_value(gw, c.weights_dtype) << " (0x" << std::hex << gw << std::dec
                    << "), cpu id " << ci << " weight " << weight_value(cw, c.weights_dtype) << " (0x"
                    << std::hex << cw << std::dec << "); row starts " << row.str();
    }
  }
  if (bad_rows > 0) ADD_FAILURE() << bad_rows << " of " << c.T << " rows differ";
}

// One case: poison, route on the GPU, compare with the CPU oracle.
void check_case(const Case& c) {
  const std::uint64_t seed = sy_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + ": " + c.describe());
  ASSERT_TRUE(switchyard::validate(c.config).ok()) << switchyard::validate(c.config).to_string();
  Problem pr = make_problem(c, seed);
  ASSERT_NE(pr.logits_dev.get(), nullptr);
  std::vector<std::uint8_t> cpu_ids, cpu_w;
  run_cpu(pr, &cpu_ids, &cpu_w);
  sy_test::poison(pr.ids_dev);
  sy_test::poison(pr.weights_dev);
  const Status s = switchyard::route(c.config, pr.logits_view(Device::cuda()), pr.bias_view(Device::cuda()),
                                     ids_view(pr), weights_view(pr), nullptr, g_options);
  ASSERT_TRUE(s.ok()) << s.to_string();
  SY_CUDA_OK(cudaDeviceSynchronize());
  compare(pr, cpu_ids, cpu_w);
}

const DType kLogitDtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
const Kind kKinds[] = {Kind::kNormal, Kind::kTied, Kind::kSpecial, Kind::kWide};

// Varies the dtypes of ids, weights and bias, the stride and the alignment with a counter, so
// that sweeps cover every combination without a full cartesian product.
void vary(Case& c, int i) {
  c.ids_dtype = (i % 2) ? DType::kInt64 : DType::kInt32;
  c.weights_dtype = (i % 3 == 2) ? DType::kBFloat16 : DType::kFloat32;
  c.bias_dtype = (i % 5 >= 3) ? DType::kBFloat16 : DType::kFloat32;
  c.extra_stride = (i % 7 == 3) ? 3 : (i % 7 == 5) ? 4 : (i % 7 == 6) ? 1 : 0;
  c.base_offset = (i % 11 == 4) ? 1 : (i % 11 == 7) ? 2 : 0;
}

// Some sweep points take T past 1024 (many blocks, rows spread over the grid): the launch
// geometry, and for 129-512 experts the candidate buffers' depth (3 up to kDeepBufferMaxTokens
// rows, 2 past it; route_warp.cuh).
std::int64_t large_t(int i, std::int64_t small) {
  return ((static_cast<unsigned>(i) * 2654435761u) >> 13) % 4 == 1 ? 1025 + (i % 13) : small;
}

// One step of a sweep: c with the i-th variation of vary, checked; i advances. False after a fatal
// failure (the sweep stops there).
bool check_varied(Case c, int& i) {
  vary(c, i++);
  check_case(c);
  return !::testing::Test::HasFatalFailure();
}

// The same for sweeps of the specialised kernels: only the ids and weights dtypes vary with i, so
// that the rows stay aligned and the bias fp32 (what routing.cu's Specs require).
// c's routing rule and bias from the preset `name` (a fatal failure where there is none: the caller
// returns on HasFatalFailure()).
void use_preset(Case& c, const char* name) {
  ModelPreset m;
  ASSERT_TRUE(switchyard::find_preset(name, &m).ok()) << name;
  c.config = m.routing;
  c.bias = m.has_bias;
}

bool check_aligned(Case c, int& i) {
  c.ids_dtype = (i % 2) ? DType::kInt64 : DType::kInt32;
  c.weights_dtype = (i % 5 == 2) ? DType::kBFloat16 : DType::kFloat32;
  ++i;
  check_case(c);
  return !::testing::Test::HasFatalFailure();
}

// ---------------------------------------------------------------------------------------------

// Every preset, every logits dtype and input kind, the odd small token counts.
TEST(RoutingCuda, PresetsSmallT) {
  SY_SKIP_WITHOUT_GPU();
  int i = 0;
  for (const ModelPreset& m : switchyard::model_presets()) {
    for (DType dt : kLogitDtypes) {
      for (std::int64_t T : {1, 3, 19, 111, 989}) {
        for (Kind kind : kKinds) {
          Case c;
          c.config = m.routing;
          c.bias = m.has_bias;
          c.T = T;
          c.logits_dtype = dt;
          c.kind = kind;
          if (!check_varied(c, i)) return;
        }
      }
    }
  }
}

// Large token counts for a few presets (the CPU oracle is the slow part: kept few).
TEST(RoutingCuda, PresetsLargeT) {
  SY_SKIP_WITHOUT_GPU();
  const char* names[] = {"deepseek-v3", "qwen3-next-80b", "kimi-k2", "mixtral-8x7b", "deepseek-v2"};
  int i = 0;
  for (const char* name : names) {
    for (std::int64_t T : {4096, 16384, 65536}) {
      Case c;
      use_preset(c, name);
      if (HasFatalFailure()) return;
      c.T = T;
      c.logits_dtype = (i % 3 == 1) ? DType::kBFloat16 : DType::kFloat32;
      c.kind = (T == 16384) ? Kind::kTied : Kind::kNormal;
      c.ids_dtype = (i % 2) ? DType::kInt64 : DType::kInt32;
      ++i;
      check_case(c);
      if (HasFatalFailure()) return;
    }
  }
  ModelPreset wide;
  ASSERT_TRUE(switchyard::find_preset("wide-2048", &wide).ok());
  Case c;
  c.config = wide.routing;
  c.T = 4096;
  check_case(c);
}

// Every pre x post function, with and without bias, over the expert counts of real models and
// the shape boundaries, and the K values of interest.
TEST(RoutingCuda, PrePostSweep) {
  SY_SKIP_WITHOUT_GPU();
  const int experts[] = {8, 160, 256, 384, 512, 576, 896, 2048, 4096};
  const int ks[] = {1, 2, 8, 10, 22, 32};
  int i = 0;
  for (int E : experts) {
    for (int K : ks) {
      if (K > E) continue;
      for (int pre = 0; pre < 4; ++pre) {
        for (int post = 0; post < 4; ++post) {
          Case c;
          c.config = make_config(E, K, static_cast<PreFn>(pre), static_cast<PostFn>(post),
                                 (i % 4 == 1) ? 2.5f : 1.0f);
          c.bias = (i % 2) == 1;
          c.T = large_t(i, E >= 2048 ? 19 : (i % 3 == 0 ? 111 : 19));
          c.logits_dtype = kLogitDtypes[i % 3];
          c.kind = kKinds[(i / 3) % 4];
          if (!check_varied(c, i)) return;
        }
      }
    }
  }
}

// Llama 4's rule (no pre function, K = 1, post sigmoid) on whole-warp rows, which routing.cu serves
// with specialised kernels on the plain top-K pass (rows of one stripe, up to 128 experts): every
// whole-warp shape of one stripe (up to 64 experts at small T, 65-128 with buffers of 3, then 2; past
// the small-T bounds up to 64 experts take narrow segments or route_rows, the generic kernels), fp32
// and bf16 logits, every input kind, scale 1 and 2.5; fp16 logits and a bias, which those kernels do
// not take, alongside.
TEST(RoutingCuda, SigmoidPostTopOneRows) {
  SY_SKIP_WITHOUT_GPU();
  int i = 0;
  for (int E : {16, 33, 64, 100, 128}) {
    for (std::int64_t T : {1, 77, 1000, 5000, 40000}) {
      for (Kind kind : kKinds) {
        Case c;
        c.config = make_config(E, 1, PreFn::kNone, PostFn::kSigmoid, (i / 2) % 2 ? 2.5f : 1.0f);
        c.T = T;
        c.logits_dtype = (i % 5 == 3) ? DType::kFloat16 : (i % 2) ? DType::kBFloat16 : DType::kFloat32;
        c.bias = i % 7 == 6;
        c.kind = kind;
        if (!check_aligned(c, i)) return;
      }
    }
  }
}

// Expert counts around every shape boundary of the kernel (route_warp.cuh's table), including
// counts that are not multiples of 4 (scalar tail loads).
TEST(RoutingCuda, ExpertCountBoundaries) {
  SY_SKIP_WITHOUT_GPU();
  const int experts[] = {1,   2,   3,   4,   5,   7,   9,    13,   16,   17,   31,   32,   33,  63,
                         64,  65,  100, 127, 128, 129, 159,  161,  255,  257,  383,  385,  511, 513,
                         575, 577, 767, 769, 895, 897, 1023, 1025, 1535, 1537, 2047, 2049, 4095};
  int i = 0;
  for (int E : experts) {
    for (int K : {1, 3, 32}) {
      if (K > E) continue;
      Case c;
      c.config = make_config(E, K, static_cast<PreFn>(i % 4), static_cast<PostFn>((i / 4) % 4));
      c.bias = (i % 3) == 0;
      c.T = large_t(i, 37);
      c.logits_dtype = kLogitDtypes[i % 3];
      c.kind = kKinds[i % 4];
      if (!check_varied(c, i)) return;
    }
  }
}

// Group limits: every rule, group sizes on the lane path (route_warp.cuh: group_limit_lanes), on
// the chunk path (G % 4 == 0, at most two scores summed) and on the generic path (any other G,
// topk_sum with more than two scores).
TEST(RoutingCuda, GroupLimits) {
  SY_SKIP_WITHOUT_GPU();
  struct G {
    int E, n_group, topk_group, K;
  };
  // The last six: lane path with 1, 2, 4 and 8 lanes per group, some with chunks past E.
  const G groups[] = {
      {256, 8, 4, 8},    {256, 8, 1, 8},   {256, 8, 7, 8},    {256, 4, 2, 8},   {256, 2, 1, 8},
      {256, 64, 5, 8},   {256, 256, 8, 8}, {256, 128, 9, 10}, {160, 8, 3, 6},   {160, 8, 3, 8},
      {160, 5, 2, 10},   {160, 40, 4, 8},  {384, 12, 4, 8},   {384, 96, 7, 22}, {512, 8, 2, 10},
      {512, 16, 4, 32},  {576, 9, 3, 10},  {576, 144, 11, 8}, {896, 7, 3, 8},   {896, 14, 5, 22},
      {2048, 32, 4, 32}, {2048, 64, 8, 8}, {4096, 64, 8, 32}, {4096, 8, 2, 8},  {8, 2, 1, 2},
      {8, 4, 2, 2},      {16, 4, 2, 4},    {12, 3, 2, 4},     {64, 16, 3, 8},   {120, 6, 2, 8},
      {100, 25, 3, 8},   {96, 3, 1, 8},    {128, 32, 5, 8},   {256, 32, 6, 8},  {256, 16, 3, 8},
      {384, 24, 5, 8},   {96, 24, 4, 8},   {224, 7, 2, 8},
  };
  int i = 0;
  for (const G& g : groups) {
    for (GroupRule rule : {GroupRule::kTop2Sum, GroupRule::kMax, GroupRule::kTopKSum}) {
      Case c;
      c.config = make_config(g.E, g.K, static_cast<PreFn>((i + 2) % 4), static_cast<PostFn>((i / 2) % 4),
                             (i % 3 == 0) ? 2.5f : 1.0f);
      c.config.group_rule = rule;
      c.config.n_group = g.n_group;
      c.config.topk_group = g.topk_group;
      if (!switchyard::validate(c.config).ok()) continue;  // e.g. topk_sum with K / topk_group > G
      c.bias = (i % 2) == 0;
      c.T = large_t(i, g.E >= 2048 ? 19 : 111);
      c.logits_dtype = kLogitDtypes[i % 3];
      c.kind = kKinds[(i / 3) % 4];
      if (!check_varied(c, i)) return;
    }
  }
}

// Groups of 32 experts on the specialised sigmoid + fp32 bias -> normalize kernels of 129-256
// experts (DeepSeek-V3's rule): routing.cu fixes their group shift at compile time, and
// route_warp.cuh's group_limit_lanes ranks the groups by pairs of lanes there (kPairRanks). Every
// number of groups that fits (E = 32 * n_group; E < 256 leaves chunks past E), several topk_group
// (ties between group scores: the tied kind), the three rules, early (T <= 256) and late bias loads.
TEST(RoutingCuda, GroupPairRanks) {
  SY_SKIP_WITHOUT_GPU();
  int i = 0;
  for (int n_group : {8, 7, 6, 5}) {
    const int E = 32 * n_group;
    for (int topk_group : {1, 2, n_group / 2, n_group - 1}) {
      for (GroupRule rule : {GroupRule::kTop2Sum, GroupRule::kMax, GroupRule::kTopKSum}) {
        for (Kind kind : {Kind::kTied, Kind::kNormal, Kind::kNearTied, Kind::kSpecial}) {
          Case c;
          const int K = (i % 3 == 0) ? 8 : (i % 3 == 1) ? 2 * topk_group : 6;
          c.config = make_config(E, std::min(K, 32 * topk_group), PreFn::kSigmoid, PostFn::kNormalize, 2.5f);
          c.config.group_rule = rule;
          c.config.n_group = n_group;
          c.config.topk_group = topk_group;
          if (!switchyard::validate(c.config).ok()) continue;  // topk_sum with K / topk_group > 32
          c.bias = true;                                       // fp32, aligned rows: the specialised kernels
          c.T = (i % 4 == 0) ? 1 : (i % 4 == 1) ? 200 : (i % 4 == 2) ? 257 : 1100;
          c.kind = kind;
          c.logits_dtype = (i % 5 == 1) ? DType::kBFloat16 : DType::kFloat32;
          if (!check_aligned(c, i)) return;
        }
      }
    }
  }
}

// One input kind over an (E, K) grid; pre, post, group rule (every group_every-th case that can
// have groups), bias (every bias_every-th case), logits dtype, T and the secondary axes are drawn
// from the case counter.
void sweep_kind(Kind kind, std::initializer_list<int> experts, std::initializer_list<int> ks,
                std::int64_t small_t, int group_every, int bias_every) {
  int i = 0;
  for (int E : experts) {
    for (int K : ks) {
      if (K > E) continue;
      Case c;
      c.config = make_config(E, K, static_cast<PreFn>(i % 4), static_cast<PostFn>((i + 1) % 4));
      if (E % 8 == 0 && K <= E / 2 && i % group_every == 0) {
        c.config.group_rule = static_cast<GroupRule>(1 + (i / group_every) % 3);
        c.config.n_group = 8;
        c.config.topk_group = 4;
        if (!switchyard::validate(c.config).ok()) c.config.group_rule = GroupRule::kNone;
      }
      c.bias = (i % bias_every) == 1;
      c.T = large_t(i, small_t);
      c.kind = kind;
      c.logits_dtype = kLogitDtypes[i % 3];
      if (!check_varied(c, i)) return;
    }
  }
}

// Ties everywhere: few levels, all-equal rows, every K.
TEST(RoutingCuda, TieHeavy) {
  SY_SKIP_WITHOUT_GPU();
  sweep_kind(Kind::kTied, {8, 64, 160, 256, 512, 2048}, {1, 2, 8, 10, 22, 32}, 333, 1, 2);
}

// Picks concentrated in one lane's experts (more than its candidate buffer holds), with ties at
// the K-th pick: the top-K fast pass must hand over to the exact rounds at the right pick.
TEST(RoutingCuda, LaneHeavy) {
  SY_SKIP_WITHOUT_GPU();
  sweep_kind(Kind::kLaneHeavy, {8, 40, 64, 96, 160, 256, 384, 512, 640, 1000, 2048},
             {1, 2, 3, 5, 8, 10, 17, 32}, 257, 3, 4);
}

// Values a few ulps apart among the best of a row (see Kind::kNearTied), over the expert counts
// of the packed top-K rounds (E <= 512) and past them.
TEST(RoutingCuda, NearTies) {
  SY_SKIP_WITHOUT_GPU();
  sweep_kind(Kind::kNearTied, {65, 128, 160, 256, 384, 512, 640}, {1, 2, 8, 10, 22, 32}, 301, 2, 2);
}

// Rounds of the top-K fast pass in which every lane's buffer is dry (see Kind::kDryBuffers), for
// expert counts whose last expert has an all-ones index in the packed rounds (128, 256, 512) and
// others.
// T = 37 and 300: both candidate buffer depths (3 and 2 past kDeepBufferMaxTokens rows), so that the
// packed retry of every whole-warp shape that has one (2-4 stripes) sees dry lanes.
TEST(RoutingCuda, DryBuffers) {
  SY_SKIP_WITHOUT_GPU();
  int i = 0;
  for (int T : {37, 300}) {
    for (int E : {128, 256, 160, 384, 512}) {
      for (int K : {2, 8, 10}) {
        for (int pre : {0, 1}) {
          Case c;
          c.config = make_config(E, K, static_cast<PreFn>(pre), PostFn::kSoftmax);
          c.config.group_rule = (i % 2) ? GroupRule::kMax : GroupRule::kTopKSum;
          c.config.n_group = E;
          c.config.topk_group = K;
          c.T = T;
          c.kind = Kind::kDryBuffers;
          c.logits_dtype = kLogitDtypes[i % 3];
          if (!check_varied(c, i)) return;
        }
      }
    }
  }
}

// Rows of 65-128 / 129-512 experts keep 3 candidates per lane up to 4096 / 128 rows (4096 with a
// softmax pre function) and 2 past them (route_warp.cuh's kShapeTable): both sides of the bound, with rows
// whose picks overflow a lane's buffer (lane-heavy: the exact rounds take over), near ties, ties and special
// values, through the specialised kernels (the presets' rules, DeepSeek-V3's group limit) and the generic
// one.
TEST(RoutingCuda, BufferDepthByTokens) {
  SY_SKIP_WITHOUT_GPU();
  const Kind kinds[] = {Kind::kLaneHeavy, Kind::kNearTied, Kind::kTied, Kind::kSpecial, Kind::kNormal};
  int i = 0;
  for (int E : {65, 128, 129, 160, 256, 257, 384, 385, 512}) {
    for (int K : {2, 3, 8, 10, 22, 32}) {
      for (int t = 0; t < 4; ++t) {
        Case c;
        switch (i % 5) {
          case 0:  // Kimi-K2, GLM-4.5
            c.config = make_config(E, K, PreFn::kSigmoid, PostFn::kNormalize, 2.5f);
            c.bias = true;
            break;
          case 1:  // Qwen3
            c.config = make_config(E, K, PreFn::kNone, PostFn::kSoftmax);
            break;
          case 2:
            c.config = make_config(E, K, PreFn::kSoftmax, PostFn::kNormalize);
            break;
          case 3:  // DeepSeek-V3 where 8 groups fit
            c.config = make_config(E, K, PreFn::kSigmoid, PostFn::kNormalize, 2.5f);
            c.bias = true;
            if (E % 8 == 0 && K <= E / 2) {
              c.config.group_rule = GroupRule::kTop2Sum;
              c.config.n_group = 8;
              c.config.topk_group = 4;
              if (!switchyard::validate(c.config).ok()) c.config.group_rule = GroupRule::kNone;
            }
            break;
          default:  // the generic kernel
            c.config = make_config(E, K, static_cast<PreFn>((i / 5) % 4), static_cast<PostFn>((i / 20) % 4));
            c.bias = (i / 5) % 2 == 1;
            break;
        }
        // Rows served by the deep buffers: 4096 for E <= 128 or a softmax pre function, else 128.
        const std::int64_t bound = (E <= 128 || c.config.pre == PreFn::kSoftmax) ? 4096 : 128;
        const std::int64_t ts[] = {1, bound / 2 - 7, bound, bound + 1};
        c.T = ts[t];
        c.kind = kinds[(i / 2) % 5];
        c.logits_dtype = kLogitDtypes[(i / 3) % 3];
        if (!check_aligned(c, i)) return;
      }
    }
  }
}

// bf16 / fp16 logits without a pre function or bias: the packed buffers' keys are whole buckets
// (no collision checks; a pick's key comes from its bucket), over ties, negative rows, lane-heavy
// rows and every post function.
TEST(RoutingCuda, BucketExactRows) {
  SY_SKIP_WITHOUT_GPU();
  int i = 0;
  for (int E : {128, 160, 256, 384, 500, 512}) {
    for (int K : {1, 2, 8, 10, 32}) {
      for (Kind kind : {Kind::kTied, Kind::kNegative, Kind::kLaneHeavy, Kind::kNormal}) {
        Case c;
        c.config = make_config(E, K, PreFn::kNone, static_cast<PostFn>(i % 4));
        c.T = large_t(i, 97);
        c.kind = kind;
        c.logits_dtype = (i % 2) ? DType::kFloat16 : DType::kBFloat16;
        if (!check_varied(c, i)) return;
      }
    }
  }
}

// Wide rows on packed buffers (route_warp_wide, E <= 2048, logits without pre function or bias):
// the specialised kernels of none -> softmax (aligned rows) with bf16 logits (every bucket holds one
// key; every T) and with fp32 logits from kWidePackedMinTokens = 16384 rows on (near-tied rows put
// neighbouring picks in one bucket: sorted above the last pick's bucket, the exact rounds in it),
// and fp16 logits on the generic kernel; K = 1, lane-heavy rows (a lane with more picks than its
// buffer holds: the exact rounds rescan) and rows with a candidate hidden in the last pick's bucket.
TEST(RoutingCuda, WidePackedRows) {
  SY_SKIP_WITHOUT_GPU();
  const Kind kinds[] = {Kind::kTied,   Kind::kNegative, Kind::kLaneHeavy,
                        Kind::kNormal, Kind::kNearTied, Kind::kHiddenInBucket};
  int i = 0;
  const auto run = [&](int E, int K, Kind kind, DType dt, std::int64_t T) {
    Case c;
    c.config = make_config(E, K, PreFn::kNone, PostFn::kSoftmax);
    c.T = T;
    c.kind = kind;
    c.logits_dtype = dt;
    return check_aligned(c, i);
  };
  for (int E : {520, 640, 1000, 1536, 2048}) {
    for (int K : {1, 2, 8, 17, 32}) {
      for (Kind kind : kinds) {
        if (!run(E, K, kind,
                 (i % 4 == 3) ? DType::kFloat16
                 : (i % 2)    ? DType::kFloat32
                              : DType::kBFloat16,
                 large_t(i, 97)))
          return;
      }
    }
  }
  // fp32 logits on the packed buffers (the CPU oracle is the slow part: kept few).
  for (int E : {1000, 2048}) {
    for (Kind kind : {Kind::kNearTied, Kind::kLaneHeavy, Kind::kHiddenInBucket, Kind::kNormal}) {
      if (!run(E, E == 2048 ? 32 : 8, kind, DType::kFloat32, 16384)) return;
    }
  }
}

// Rows that a packed-buffer check trusting a head equal to the last pick would get wrong (see
// Kind::kHiddenInBucket), fp32 logits, whole-warp rows.
TEST(RoutingCuda, HiddenInBucket) {
  SY_SKIP_WITHOUT_GPU();
  int i = 0;
  for (int E : {128, 256, 384, 512}) {
    for (int K : {1, 2, 3}) {
      for (int post : {0, 1}) {
        Case c;
        c.config = make_config(E, K, PreFn::kNone, static_cast<PostFn>(post));
        c.T = 64;
        c.kind = Kind::kHiddenInBucket;
        c.logits_dtype = DType::kFloat32;
        if (!check_varied(c, i)) return;
      }
    }
  }
}

// Sigmoid + fp32 bias -> normalize (the Kimi / GLM / DeepSeek-V3 rule) past T = 256, on the
// specialised kernels (aligned rows, fp32 bias), with near-tied rows (values a few ulps apart at
// the K-th pick, see Kind::kNearTied), group limits on the lane path and, for E = 384, 576, 640 and
// 896, the chunk path (past E = 512: route_warp on packed buffers, specialised; without a group
// limit those rows take the wide kernels), and the usual kinds. It keeps the exact kernels' near
// ties covered.
TEST(RoutingCuda, SigmoidBiasNearTies) {
  SY_SKIP_WITHOUT_GPU();
  int i = 0;
  for (int E : {96, 128, 160, 256, 384, 512, 576, 640, 896, 1024}) {
    for (int K : {2, 8, 10, 31}) {
      for (Kind kind : {Kind::kNearTied, Kind::kNormal, Kind::kTied, Kind::kSpecial, Kind::kWide}) {
        Case c;
        c.config = make_config(E, K, PreFn::kSigmoid, PostFn::kNormalize, 2.5f);
        if (E % 8 == 0 && K <= E / 2 && i % 2 == 0) {
          c.config.group_rule = (i % 4 == 0) ? GroupRule::kTop2Sum : GroupRule::kMax;
          c.config.n_group = 8;
          c.config.topk_group = 4;
        }
        c.bias = true;  // fp32, aligned rows: the specialised kernels
        c.T = 300 + 97 * (i % 7);
        c.kind = kind;
        c.logits_dtype = (i % 3 == 1) ? DType::kBFloat16 : DType::kFloat32;
        if (!check_aligned(c, i)) return;
      }
    }
  }
}

using sy_test::ScopedValue;
using Choice = switchyard::RouteOptions::Choice;
using SmallRowForm = switchyard::RouteOptions::SmallRowForm;

// Wide rows (E > 512) with sigmoid + fp32 bias -> normalize on the specialised wide kernels (aligned
// rows, fp32 / bf16 logits) at the expert counts the issue names (576, 896) and others, plain
// buffers (T below kWidePackedMinTokens) and packed buffers (RouteOptions::wide_packed_always
// puts every T on them; their checks recompute the keys from logit and bias): near-tied rows
// (neighbouring picks in one bucket: sorted above the last pick's bucket, exact rounds in it), rows
// with a candidate hidden in the last pick's bucket, lane-heavy rows, ties and special values.
TEST(RoutingCuda, WideSigmoidBiasRows) {
  SY_SKIP_WITHOUT_GPU();
  const Kind kinds[] = {Kind::kNearTied, Kind::kNormal,    Kind::kTied,
                        Kind::kSpecial,  Kind::kLaneHeavy, Kind::kHiddenInBucket};
  int i = 0;
  for (bool packed : {true, false}) {
    const ScopedValue<bool> knob(g_options.wide_packed_always, packed);
    for (int E : {520, 576, 640, 896, 1024, 1536, 2048}) {
      for (int K : {1, 2, 8, 17, 32}) {
        for (Kind kind : kinds) {
          if (!packed && i % 3 != 0) {  // the plain buffers are main's: a third of the sweep
            ++i;
            continue;
          }
          Case c;
          c.config = make_config(E, K, PreFn::kSigmoid, PostFn::kNormalize, 2.5f);
          c.bias = true;  // fp32, aligned rows: the specialised kernels
          c.T = large_t(i, 97);
          c.kind = kind;
          c.logits_dtype = (i % 3 == 1) ? DType::kBFloat16 : DType::kFloat32;
          if (!check_aligned(c, i)) return;
        }
      }
    }
  }
  // The default threshold itself: fp32 logits at kWidePackedMinTokens rows (CPU oracle: kept few).
  for (int E : {576, 896}) {
    for (Kind kind : {Kind::kNearTied, Kind::kNormal}) {
      Case c;
      c.config = make_config(E, 8, PreFn::kSigmoid, PostFn::kNormalize, 2.5f);
      c.bias = true;
      c.T = 16384;
      c.kind = kind;
      if (!check_aligned(c, i)) return;
    }
  }
}

// Rows of 513-1024 experts without a group limit that routing.cu sends to route_warp (whole row in
// registers, packed buffers) from kWarpForWideMinTokens = 1024 rows on: bf16 sigmoid + fp32 bias ->
// normalize and fp32 / bf16 none -> softmax (aligned rows), over near-tied, hidden-in-bucket,
// lane-heavy, tied, negative and normal rows.
TEST(RoutingCuda, WarpForWideRows) {
  SY_SKIP_WITHOUT_GPU();
  const Kind kinds[] = {Kind::kNearTied, Kind::kHiddenInBucket, Kind::kLaneHeavy,
                        Kind::kTied,     Kind::kNegative,       Kind::kNormal};
  int i = 0;
  for (int E : {520, 576, 640, 896, 1000, 1024}) {
    for (int K : {2, 8, 17, 32}) {
      for (int rule = 0; rule < 3; ++rule) {
        Case c;
        if (rule == 0) {
          c.config = make_config(E, K, PreFn::kSigmoid, PostFn::kNormalize, 2.5f);
          c.bias = true;
          c.logits_dtype = DType::kBFloat16;
        } else {
          c.config = make_config(E, K, PreFn::kNone, PostFn::kSoftmax);
          c.logits_dtype = rule == 1 ? DType::kFloat32 : DType::kBFloat16;
        }
        c.T = 1024 + (i % 37);
        c.kind = kinds[i % 6];
        if (!check_aligned(c, i)) return;
      }
    }
  }
}

// Rows of up to 128 experts in each of their forms: a whole warp per row, narrow segments of one,
// two or four stripes (route_warp.cuh's kShapeTable), on packed candidate buffers (2 <= K <= W) and
// on plain ones (RouteOptions::narrow_packed = false, and K past W), and one thread per row
// (route_rows.cuh, E <= 16, K <= 8), each forced at every T through RouteOptions::small_row_form
// (rows past a form's reach take the default), then the default forms on both sides of their
// token bounds. Every rule
// family (softmax / none / sigmoid + bias pre functions, every post function, group limits where E
// allows them), aligned rows (the specialised kernels) and odd strides (the generic one), K up to E
// (lanes with more picks than their buffer: lane-heavy and tied rows), special values.
TEST(RoutingCuda, SmallExpertForms) {
  SY_SKIP_WITHOUT_GPU();
  const Kind kinds[] = {Kind::kNormal,   Kind::kLaneHeavy, Kind::kTied,    Kind::kSpecial,
                        Kind::kNearTied, Kind::kWide,      Kind::kNegative};
  int i = 0;
  const auto run = [&](int E, int K, std::int64_t T) {
    Case c;
    switch (i % 5) {
      case 0:  // dbrx
        c.config = make_config(E, K, PreFn::kSoftmax, PostFn::kNormalize);
        break;
      case 1:  // mixtral
        c.config = make_config(E, K, PreFn::kNone, PostFn::kSoftmax);
        break;
      case 2:  // sigmoid + bias, with a group limit where 4 groups fit
        c.config = make_config(E, K, PreFn::kSigmoid, PostFn::kNormalize, 2.5f);
        c.bias = true;
        if (E % 4 == 0 && K <= E / 2) {
          c.config.group_rule = static_cast<GroupRule>(1 + (i / 5) % 3);
          c.config.n_group = 4;
          c.config.topk_group = 2;
          if (!switchyard::validate(c.config).ok()) c.config.group_rule = GroupRule::kNone;
        }
        break;
      default:  // any rule
        c.config = make_config(E, K, static_cast<PreFn>((i / 5) % 4), static_cast<PostFn>((i / 3) % 4));
        c.bias = (i / 7) % 2 == 1;
        break;
    }
    c.T = T;
    c.kind = kinds[i % 7];
    c.logits_dtype = kLogitDtypes[(i / 2) % 3];
    return (i % 4 == 3) ? check_varied(c, i) : check_aligned(c, i);
  };
  const std::int64_t ts[] = {1, 5, 33, 200, 1500};
  const std::pair<SmallRowForm, bool> forms[] = {
      {SmallRowForm::kWarp, true},     {SmallRowForm::kNarrow, true},   {SmallRowForm::kNarrow, false},
      {SmallRowForm::kNarrow2, true}, {SmallRowForm::kNarrow2, false}, {SmallRowForm::kRows, true}};
  for (const auto& [form, packed] : forms) {
    const ScopedValue<SmallRowForm> knob(g_options.small_row_form, form);
    const ScopedValue<bool> packed_knob(g_options.narrow_packed, packed);
    for (int E : {2, 3, 4, 5, 8, 11, 16, 17, 24, 32, 40, 60, 64, 65, 96, 100, 128}) {
      for (int K : {1, 2, 3, 4, 5, 7, 8, 9, 16}) {
        if (K > E) continue;
        if (!run(E, K, ts[i % 5])) return;
      }
    }
  }
  // route_warp.cuh's kSmallWarpMaxTokens16 / 32 / 64, kSmallNarrowMaxTokens64 and
  // kNarrowMinTokens128 (- 1; 65-128 experts: narrow packed segments from it on), route_rows.cuh's
  // kRowsMinTokens8 / 16 (- 1).
  const std::pair<int, std::int64_t> bounds[] = {
      {4, 128}, {16, 128}, {17, 256},  {32, 256},   {33, 1024},  {64, 1024},  {33, 32767},  {64, 32767},
      {5, 127}, {8, 127},  {9, 65535}, {16, 65535}, {17, 65535}, {16, 70001}, {128, 32767}, {72, 32767}};
  for (const auto& [E, bound] : bounds) {
    for (std::int64_t T : {bound, bound + 1}) {
      if (!run(E, std::min(E, 2 + i % 7), T)) return;
    }
  }
  // Past that bound, 65-128 experts: K = 1 (whole warp, plain pass), K = W of the narrow packed form
  // (8), K past it (whole warp).
  for (int K : {1, 8, 9, 32}) {
    if (!run(128, K, 32768 + 97 * K)) return;
  }
  if (!run(97, 4, 40961)) return;
}

// Streamed narrow segments (route_warp.cuh's use_stream: route_warp_wide with 8 lanes a row, 4 rows a
// warp, packed buffers of depth 4) for sigmoid + fp32 bias -> normalize, 129-192 experts, 2 <= K <= 8,
// fp32 / bf16 logits (aligned rows: routing.cu's stream Specs), forced at every T through
// RouteOptions::streamed = kAlways (T not a multiple of 4: rows past T in the last warp), then the default
// on both sides of kStreamMinTokens; every input kind (near-tied and hidden-in-bucket rows reach the
// packed buffers' checks, lane-heavy and tied rows the exact rounds with their rescans). Rows the
// form does not serve (E past 192, K = 1 / 9, a group limit, fp16 logits, odd strides) must take the
// other kernels under the knob.
TEST(RoutingCuda, StreamedNarrowRows) {
  SY_SKIP_WITHOUT_GPU();
  const Kind kinds[] = {Kind::kNearTied, Kind::kHiddenInBucket, Kind::kLaneHeavy, Kind::kTied,
                        Kind::kSpecial,  Kind::kNormal,         Kind::kNegative,  Kind::kWide};
  const std::int64_t ts[] = {1, 3, 6, 37, 301, 1027};
  int i = 0;
  {
    const ScopedValue<Choice> knob(g_options.streamed, Choice::kAlways);
    for (int E : {129, 130, 160, 161, 176, 191, 192}) {
      for (int K : {2, 3, 5, 7, 8}) {
        for (int rep = 0; rep < 4; ++rep) {
          Case c;
          c.config = make_config(E, K, PreFn::kSigmoid, PostFn::kNormalize, 2.5f);
          c.bias = true;
          c.T = ts[i % 6];
          c.kind = kinds[i % 8];
          c.logits_dtype = (i % 2 == 1) ? DType::kBFloat16 : DType::kFloat32;
          if (!check_aligned(c, i)) return;
        }
      }
    }
    // Not served by the form: the other kernels, under the knob.
    for (int E : {160, 193, 384}) {
      for (int K : {1, 9, 8}) {
        Case c;
        c.config = make_config(E, K, PreFn::kSigmoid, PostFn::kNormalize, 2.5f);
        c.bias = true;
        c.T = 301;
        c.kind = kinds[i % 8];
        if (K == 8 && E == 160) {  // a group limit, fp16 logits or odd strides (the generic kernels)
          for (int v = 0; v < 3; ++v) {
            Case d = c;
            if (v == 0) {
              d.config.group_rule = GroupRule::kTop2Sum;
              d.config.n_group = 8;
              d.config.topk_group = 4;
            }
            if (v == 1) d.logits_dtype = DType::kFloat16;
            if (!check_varied(d, i)) return;
          }
        } else if (!check_aligned(c, i)) {
          return;
        }
      }
    }
  }
  // The default: kStreamMinTokens (32768) - 1 and 32768 rows (GLM-4.5's E = 160; without the staged
  // kernels, which serve E = 160 from 32768 rows by default, and E = 176, which they do not serve).
  const ScopedValue<Choice> no_staged(g_options.staged, Choice::kNever);
  for (std::int64_t T : {32767, 32768}) {
    for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
      Case c;
      c.config = make_config(T == 32767 ? 160 : 176, 8, PreFn::kSigmoid, PostFn::kNormalize, 2.5f);
      c.bias = true;
      c.T = T;
      c.kind = kinds[i % 8];
      c.logits_dtype = dt;
      if (!check_aligned(c, i)) return;
    }
  }
}

// The input kinds of the staged kernels' tests.
const Kind kStagedKinds[] = {Kind::kNearTied,   Kind::kHiddenInBucket, Kind::kNormal,   Kind::kTied,
                             Kind::kSpecial,    Kind::kLaneHeavy,      Kind::kNegative, Kind::kWide,
                             Kind::kDryBuffers, Kind::kZeros};
constexpr int kNumStagedKinds = sizeof(kStagedKinds) / sizeof(kStagedKinds[0]);

// The staged kernels' sigmoid + bias sweep (StagedRows, StagedApproxRows; the knobs set by the caller):
// E = 32-512, K = 1-8, sometimes a softmax or no post function, every group rule with groups of 32
// experts, fp32 / bf16 logits, strides and offsets, T = 1-4099; inputs kinds[i % n_kinds], or on half
// the cases approx-cluster rows (approx_clusters). False after a fatal failure.
bool staged_sigmoid_sweep(const Kind* kinds, int n_kinds, bool approx_clusters, int& i) {
  const std::int64_t ts[] = {1, 31, 33, 200, 1001, 4099};
  for (int E : {32, 64, 160, 256, 384, 512}) {
    for (int K : {1, 2, 5, 8}) {
      for (int rep = 0; rep < 6; ++rep) {
        Case c;
        c.config = make_config(E, K, PreFn::kSigmoid, PostFn::kNormalize, 2.5f);
        if (rep % 3 == 1) c.config.post = (i % 2) ? PostFn::kSoftmax : PostFn::kNone;
        const int n_group = E / 32;
        if (rep % 2 == 0 && n_group >= 2) {
          const GroupRule rules[] = {GroupRule::kTop2Sum, GroupRule::kMax, GroupRule::kTopKSum};
          c.config.group_rule = rules[(i / 2) % 3];
          c.config.n_group = n_group;
          c.config.topk_group = 1 + (i / 6) % std::min(4, n_group - 1);
          const int per_group = K / c.config.topk_group;
          if (c.config.group_rule == GroupRule::kTopKSum && (per_group < 1 || per_group > 2))
            c.config.group_rule = GroupRule::kTop2Sum;
        }
        c.bias = true;
        c.T = ts[i % 6];
        c.kind = approx_clusters && rep < 3 ? Kind::kApproxCluster : kinds[i % n_kinds];
        // Hidden-in-bucket rows place values in the experts of 32 lanes of four (E >= 128).
        if (c.kind == Kind::kHiddenInBucket && E < 128) c.kind = Kind::kNearTied;
        c.logits_dtype = (i % 2 == 1) ? DType::kBFloat16 : DType::kFloat32;
        c.extra_stride = (i % 5 == 3) ? (c.logits_dtype == DType::kFloat32 ? 4 : 8) : 0;
        c.base_offset = (i % 7 == 4) ? (c.logits_dtype == DType::kFloat32 ? 4 : 8) : 0;
        if (!check_aligned(c, i)) return false;
      }
    }
  }
  return true;
}

// Staged rows (route_staged.cuh: one thread a row, E % 32 == 0 up to 512, K <= 8; sigmoid + fp32 bias
// without a group limit or with groups of 32 experts, logits without a pre function, softmax ->
// normalize) at every T under RouteOptions::staged = kAlways: every input kind (near ties and
// hidden-in-bucket rows send rows to the exact redo; special values to the slow sigmoid and, for
// softmax, to the redo), the three group rules with 1-4 kept groups, every post function, fp32 / bf16
// logits, strides and offsets that keep rows on 16 bytes, row counts that end inside a warp; then the
// requests the kernels do not serve (other kernels under the knob), and the default from
// kStagedMinTokens rows.
TEST(RoutingCuda, StagedRows) {
  SY_SKIP_WITHOUT_GPU();
  // The exact selection throughout (StagedApproxRows: the approximate one, the default).
  const ScopedValue<bool> exact(g_options.staged_approx, false);
  const Kind* kinds = kStagedKinds;
  constexpr int kNumKinds = kNumStagedKinds;
  const std::int64_t ts[] = {1, 31, 33, 200, 1001, 4099};
  int i = 0;
  {
    const ScopedValue<Choice> knob(g_options.staged, Choice::kAlways);
    if (!staged_sigmoid_sweep(kinds, kNumKinds, /*approx_clusters=*/false, i)) return;
    // The logits rules: no pre function (bits equal for every post function) and softmax -> normalize
    // (ids equal, weights within 1e-6 relative), no bias. Flat-top rows reach the softmax rows' p test.
    for (int E : {32, 64, 128, 160, 256, 512}) {
      for (int K : {1, 2, 4, 8}) {
        for (int rep = 0; rep < 5; ++rep) {
          Case c;
          const PostFn posts[] = {PostFn::kSoftmax, PostFn::kNone, PostFn::kSigmoid, PostFn::kNormalize};
          if (rep < 3) {
            c.config = make_config(E, K, PreFn::kNone, posts[(i + rep) % 4], rep == 1 ? 2.5f : 1.0f);
          } else {
            c.config = make_config(E, K, PreFn::kSoftmax, PostFn::kNormalize, rep == 3 ? 1.0f : 2.5f);
            c.weight_tol = 1e-6f;
          }
          c.T = ts[i % 6];
          c.kind = rep == 4   ? Kind::kFlatTop
                   : rep == 2 ? ((i / 10) % 2 ? Kind::kZeros : Kind::kNearTied)
                              : kinds[i % kNumKinds];
          if (c.kind == Kind::kHiddenInBucket && E < 128) c.kind = Kind::kNearTied;
          c.logits_dtype = (i % 2 == 1) ? DType::kBFloat16 : DType::kFloat32;
          c.extra_stride = (i % 5 == 3) ? (c.logits_dtype == DType::kFloat32 ? 4 : 8) : 0;
          c.base_offset = (i % 7 == 4) ? (c.logits_dtype == DType::kFloat32 ? 4 : 8) : 0;
          if (!check_aligned(c, i)) return;
        }
      }
    }
    // Not served: fp16 logits, rows off 16 bytes, E % 32 != 0, K > 8, 5 kept groups, groups of 16;
    // softmax -> none, no pre function with a bias, sigmoid without one.
    for (int v = 0; v < 9; ++v) {
      Case c;
      c.config = make_config(v == 2 ? 200 : 256, v == 3 ? 9 : 8, PreFn::kSigmoid, PostFn::kNormalize, 2.5f);
      c.bias = v != 6 && v != 8;
      if (v == 6) c.config = make_config(256, 8, PreFn::kSoftmax, PostFn::kNone, 1.0f);
      if (v == 7) c.config.pre = PreFn::kNone;
      c.T = 301;
      c.kind = kinds[i % kNumKinds];
      if (v == 0) c.logits_dtype = DType::kFloat16;
      if (v == 1) c.extra_stride = 2;
      if (v >= 4) {
        c.config.group_rule = GroupRule::kTop2Sum;
        c.config.n_group = v == 4 ? 8 : 16;
        c.config.topk_group = v == 4 ? 5 : 4;
      }
      ++i;
      check_case(c);
      if (HasFatalFailure()) return;
    }
  }
  // The default at kStagedMinTokens (32768) rows: deepseek-v3, kimi-k2, qwen3-235b-a22b, gpt-oss-120b,
  // and softmax -> normalize at E = 256 (the bench's softmax-e256-k8).
  for (const char* name : {"deepseek-v3", "kimi-k2", "qwen3-235b-a22b", "gpt-oss-120b", "softmax-e256-k8"}) {
    Case c;
    const std::string n = name;
    if (n == "softmax-e256-k8") {
      c.config = make_config(256, 8, PreFn::kSoftmax, PostFn::kNormalize, 1.0f);
      c.weight_tol = 1e-6f;
    } else {
      use_preset(c, name);
      if (HasFatalFailure()) return;
    }
    c.T = 32768;
    c.kind = kinds[i % kNumKinds];
    c.logits_dtype = (i % 2 == 1) ? DType::kBFloat16 : DType::kFloat32;
    ++i;
    check_case(c);
    if (HasFatalFailure()) return;
  }
}

// route_warp.cuh's sigmoid_approx against sigmoid_fast (the oracle's bits) over every float with
// |s| <= 86.5: the approximate selection's margins (common/approx_certify.h) assume at most
// kSigmoidApproxErr (2^-21).
TEST(RoutingCuda, ApproxSigmoidBound) {
  SY_SKIP_WITHOUT_GPU();
  float worst = -1.0f;
  SY_CUDA_OK(sy_test::max_sigmoid_approx_error(&worst));
  std::printf("largest |sigmoid_approx - sigmoid| over |s| <= 86.5: %.3g (2^%.2f)\n", worst,
              std::log2(static_cast<double>(worst)));
  EXPECT_GT(worst, 0.0f);  // the approximation differs somewhere (the kernel ran)
  EXPECT_LE(worst, 0x1p-21f);
}

// Staged sigmoid + bias rows on the approximate selection (route_staged.cuh's kApprox,
// RouteOptions::staged_approx): ids and weights are still the oracle's bits. Clusters decided by
// less than the approximation's error (with biases a few ulps apart, or 1000 on half the experts), near
// ties, values hidden in a bucket, special and wide rows (chunks on the exact sigmoid), with and
// without groups of 32 experts (every group rule), fp32 and bf16 logits, E = 32-512, K = 1-8, T up to
// 4099; then the sigmoid presets at 32768 rows.
TEST(RoutingCuda, StagedApproxRows) {
  SY_SKIP_WITHOUT_GPU();
  const ScopedValue<Choice> staged(g_options.staged, Choice::kAlways);
  const ScopedValue<bool> approx(g_options.staged_approx, true);
  int i = 0;
  if (!staged_sigmoid_sweep(kStagedKinds, kNumStagedKinds, /*approx_clusters=*/true, i)) return;
  for (const char* name : {"deepseek-v3", "kimi-k2", "glm-4.5"}) {
    for (Kind kind : {Kind::kApproxCluster, Kind::kNormal}) {
      Case c;
      use_preset(c, name);
      if (HasFatalFailure()) return;
      c.T = 32768;
      c.kind = kind;
      c.logits_dtype = (i % 2 == 1) ? DType::kBFloat16 : DType::kFloat32;
      ++i;
      check_case(c);
      if (HasFatalFailure()) return;
    }
  }
}

// A route call captured in a CUDA graph on a non-default stream, replayed with new inputs copied
// into the same buffers; each replay is compared with the CPU oracle.
TEST(RoutingCuda, GraphReplayWithNewInputs) {
  SY_SKIP_WITHOUT_GPU();
  for (const char* name : {"deepseek-v3", "qwen3-next-80b", "mixtral-8x7b"}) {
    Case c;
    use_preset(c, name);
    if (HasFatalFailure()) return;
    c.T = 777;
    std::uint64_t seed = sy_test::fresh_seed();
    SCOPED_TRACE(std::string(name) + " first seed " + std::to_string(seed));
    Problem pr = make_problem(c, seed);
    sy_test::CapturedGraph graph;
    const cudaStream_t stream = graph.stream();
    SY_CUDA_OK(graph.begin());
    const Status s = switchyard::route(c.config, pr.logits_view(Device::cuda()), pr.bias_view(Device::cuda()),
                                       ids_view(pr), weights_view(pr), stream, g_options);
    SY_CUDA_OK(graph.end());
    ASSERT_TRUE(s.ok()) << s.to_string();
    for (int replay = 0; replay < 4; ++replay) {
      seed = sy_test::fresh_seed();
      SCOPED_TRACE("replay " + std::to_string(replay) + " seed " + std::to_string(seed));
      pr.c.kind = kKinds[replay % 4];
      fill_inputs(pr, seed);
      SY_CUDA_OK(cudaMemcpyAsync(pr.logits_dev.get(), pr.logits_host.data(), pr.logits_host.size(),
                                 cudaMemcpyHostToDevice, stream));
      if (c.bias) {
        SY_CUDA_OK(cudaMemcpyAsync(pr.bias_dev.get(), pr.bias_host.data(), pr.bias_host.size(),
                                   cudaMemcpyHostToDevice, stream));
      }
      SY_CUDA_OK(cudaMemsetAsync(pr.ids_dev.get(), 0xA5, pr.ids_dev.bytes(), stream));
      SY_CUDA_OK(cudaMemsetAsync(pr.weights_dev.get(), 0xA5, pr.weights_dev.bytes(), stream));
      SY_CUDA_OK(graph.replay());
      std::vector<std::uint8_t> cpu_ids, cpu_w;
      run_cpu(pr, &cpu_ids, &cpu_w);
      compare(pr, cpu_ids, cpu_w);
    }
  }
}

// Back-to-back calls on one stream (programmatic dependent launch between them) must each see
// the previous call's inputs and outputs in order: route, overwrite the logits on the stream,
// route again into the same outputs.
TEST(RoutingCuda, BackToBackCallsOnOneStream) {
  SY_SKIP_WITHOUT_GPU();
  Case c;
  use_preset(c, "kimi-k2");
  if (HasFatalFailure()) return;
  c.T = 4096;
  const std::uint64_t seed = sy_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Problem pr = make_problem(c, seed);
  cudaStream_t stream;
  SY_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(switchyard::route(c.config, pr.logits_view(Device::cuda()), pr.bias_view(Device::cuda()),
                                  ids_view(pr), weights_view(pr), stream, g_options)
                    .ok());
  }
  fill_inputs(pr, seed + 1);
  SY_CUDA_OK(cudaMemcpyAsync(pr.logits_dev.get(), pr.logits_host.data(), pr.logits_host.size(),
                             cudaMemcpyHostToDevice, stream));
  if (c.bias) {  // fill_inputs drew a new bias too
    SY_CUDA_OK(cudaMemcpyAsync(pr.bias_dev.get(), pr.bias_host.data(), pr.bias_host.size(),
                               cudaMemcpyHostToDevice, stream));
  }
  ASSERT_TRUE(switchyard::route(c.config, pr.logits_view(Device::cuda()), pr.bias_view(Device::cuda()),
                                ids_view(pr), weights_view(pr), stream, g_options)
                  .ok());
  SY_CUDA_OK(cudaStreamSynchronize(stream));
  std::vector<std::uint8_t> cpu_ids, cpu_w;
  run_cpu(pr, &cpu_ids, &cpu_w);
  compare(pr, cpu_ids, cpu_w);
  cudaStreamDestroy(stream);
}

// Requests past the CUDA backend's range get a clear status and write nothing; T = 0 is fine.
TEST(RoutingCuda, UnsupportedRequestsWriteNothing) {
  SY_SKIP_WITHOUT_GPU();
  struct Bad {
    int E, K;
    const char* arg;
  };
  for (const Bad& b :
       {Bad{64, 33, "config.top_k"}, Bad{4097, 8, "config.num_experts"}, Bad{8192, 40, "config.top_k"}}) {
    SCOPED_TRACE("E=" + std::to_string(b.E) + " K=" + std::to_string(b.K));
    const std::int64_t T = 5;
    const RoutingConfig cfg = make_config(b.E, b.K, PreFn::kNone, PostFn::kSoftmax);
    const std::vector<float> logits = sy_test::random_normal(static_cast<std::size_t>(T) * b.E, 1);
    DeviceBuffer dl = sy_test::to_device(logits);
    DeviceBuffer ids(static_cast<std::size_t>(T) * b.K * 4), w(static_cast<std::size_t>(T) * b.K * 4);
    sy_test::poison(ids);
    sy_test::poison(w);
    const Status s =
        switchyard::route(cfg, TensorView::of(dl.get(), DType::kFloat32, {T, b.E}, Device::cuda()),
                          TensorView{}, TensorView::of(ids.get(), DType::kInt32, {T, b.K}, Device::cuda()),
                          TensorView::of(w.get(), DType::kFloat32, {T, b.K}, Device::cuda()));
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find(b.arg), std::string::npos) << s.to_string();
    SY_CUDA_OK(cudaDeviceSynchronize());
    for (std::uint8_t byte : sy_test::to_host<std::uint8_t>(ids, ids.bytes()))
      ASSERT_EQ(byte, sy_test::kPoisonByte);
    for (std::uint8_t byte : sy_test::to_host<std::uint8_t>(w, w.bytes()))
      ASSERT_EQ(byte, sy_test::kPoisonByte);
  }
  // T = 0: ok, nothing launched.
  DeviceBuffer dl(64), ids(64), w(64);
  const RoutingConfig cfg = make_config(8, 2, PreFn::kNone, PostFn::kSoftmax);
  const Status s =
      switchyard::route(cfg, TensorView::of(dl.get(), DType::kFloat32, {0, 8}, Device::cuda()), TensorView{},
                        TensorView::of(ids.get(), DType::kInt32, {0, 2}, Device::cuda()),
                        TensorView::of(w.get(), DType::kFloat32, {0, 2}, Device::cuda()));
  EXPECT_TRUE(s.ok()) << s.to_string();
}

}  // namespace
