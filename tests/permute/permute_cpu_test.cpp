// CPU gather and combine against references written here from docs/design.md section 4 and
// permute.h: gather row by row from permuted_to_token, combine both as an fp64 sum (within a
// stated tolerance) and as an in-test replica of the fmaf contract (bit for bit). The 16-bit
// float conversions used by the references are written here too, independently of the library.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/float_formats.h"
#include "common/test_data.h"
#include "switchyard/layout.h"
#include "switchyard/permute.h"

namespace {

using switchyard::Device;
using switchyard::DType;
using switchyard::Layout;
using switchyard::LayoutConfig;
using switchyard::LocalExperts;
using switchyard::Status;
using switchyard::TensorView;
using sy_test::kPoisonByte;

constexpr const auto& kTs = sy_test::kSweepTokens;
constexpr const auto& kEs = sy_test::kSweepExperts;
constexpr const auto& kKs = sy_test::kSweepTopK;
constexpr const auto& kMs = sy_test::kSweepTiles;
// Rows (gather) or elements (combine) after each output's end that must keep their poison.
constexpr std::int64_t kGuardRows = 5;

using sy_test::test_seed;

// ---- 16-bit float formats (tests/common/float_formats.h, independent of the library) ----

using sy_test::f32_bits;
using sy_test::fp16_bits;
using sy_test::fp16_value;
using sy_test::load_as_float;

// Position of a 16-bit sign-magnitude float on the number line, +0 and -0 both at 0.
int ordinal16(std::uint16_t b) { return (b & 0x8000) ? -static_cast<int>(b & 0x7fff) : static_cast<int>(b); }

// Storage bits of f rounded to `dtype` (as uint32 for all three formats).
std::uint32_t bits_of(DType dtype, float f) {
  switch (dtype) {
    case DType::kFloat32:
      return f32_bits(f);
    case DType::kBFloat16:
      return sy_test::bf16_bits(f);
    case DType::kFloat16:
      return fp16_bits(f);
    default:
      return 0;
  }
}

void store_from_float(DType dtype, void* base, std::int64_t i, float f) {
  if (dtype == DType::kFloat32) {
    static_cast<float*>(base)[i] = f;
  } else {
    static_cast<std::uint16_t*>(base)[i] = static_cast<std::uint16_t>(bits_of(dtype, f));
  }
}

std::uint32_t stored_bits(DType dtype, const void* base, std::int64_t i) {
  if (dtype == DType::kFloat32) return f32_bits(static_cast<const float*>(base)[i]);
  return static_cast<const std::uint16_t*>(base)[i];
}

// ---- Layouts as inputs ----

// A layout filled by switchyard::layout (verified by test_layout_cpu), with ids that leave
// picks unplaced three ways: -1, out of range, and experts outside the local range. Every
// fifth token has no placed pick at all.
struct LayoutHolder {
  std::int64_t T = 0;
  int K = 1;
  int L = 0;
  std::int64_t rows = 0;
  std::vector<std::int32_t> counts, offsets, permuted_to_expanded, permuted_to_token, expanded_to_permuted,
      tile_expert, tile_row_end, totals;

  Layout view() const {
    auto v1 = [](const std::vector<std::int32_t>& v) {
      return TensorView::of(v.data(), DType::kInt32, {static_cast<std::int64_t>(v.size())}, Device::cpu());
    };
    Layout out;
    out.counts = v1(counts);
    out.offsets = v1(offsets);
    out.permuted_to_expanded = v1(permuted_to_expanded);
    out.permuted_to_token = v1(permuted_to_token);
    out.expanded_to_permuted =
        TensorView::of(expanded_to_permuted.data(), DType::kInt32, {T, K}, Device::cpu());
    out.tile_expert = v1(tile_expert);
    out.tile_row_end = v1(tile_row_end);
    out.totals = v1(totals);
    return out;
  }
  std::int32_t padded_total() const { return totals[switchyard::kPaddedTotal]; }
};

LayoutHolder make_layout(std::int64_t T, int K, int E, int M, std::uint64_t seed) {
  // Distinct ids per row need K <= E; a case breaking that is a bug of this test, and the
  // rejection loop below would never end.
  if (K > E) {
    ADD_FAILURE() << "test case with K = " << K << " > E = " << E << "; using K = E";
    K = E;
  }
  std::mt19937_64 g(seed);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(T * K));
  std::vector<char> used(E, 0);
  for (std::int64_t t = 0; t < T; ++t) {
    for (int k = 0; k < K; ++k) {
      std::int32_t e;
      do e = static_cast<std::int32_t>(g() % static_cast<std::uint64_t>(E));
      while (used[e]);
      used[e] = 1;
      ids[t * K + k] = e;
    }
    for (int k = 0; k < K; ++k) used[ids[t * K + k]] = 0;
    for (int k = 0; k < K; ++k) {
      if (t % 5 == 4 || g() % 9 == 0) ids[t * K + k] = (g() % 3 == 0) ? E + 3 : -1;
    }
  }
  LayoutConfig config;
  config.num_experts = E;
  config.tile_size = M;
  // About three quarters of the experts are local, so some placed-looking ids are not.
  const int count = std::max(1, E - E / 4);
  config.local = LocalExperts::range(E / 8, std::min(count, E - E / 8), 1);
  LayoutHolder h;
  h.T = T;
  h.K = K;
  h.L = config.num_local();
  h.rows = switchyard::max_permuted_rows(T, K, h.L, M);
  const std::int64_t tiles = switchyard::max_tiles(T, K, h.L, M);
  h.counts.resize(h.L);
  h.offsets.resize(h.L + 1);
  h.permuted_to_expanded.resize(h.rows);
  h.permuted_to_token.resize(h.rows);
  h.expanded_to_permuted.resize(T * K);
  h.tile_expert.resize(tiles);
  h.tile_row_end.resize(tiles);
  h.totals.resize(switchyard::kNumTotals);
  const Status s = switchyard::layout(
      config, TensorView::of(ids.data(), DType::kInt32, {T, K}, Device::cpu()), h.view(), nullptr, 0);
  EXPECT_TRUE(s.ok()) << s.to_string();
  return h;
}

// ---- gather ----

enum class ScaleMode { kNone, kPerToken1D, kPerToken2D, kPerGroup };

const char* scale_name(ScaleMode m) {
  switch (m) {
    case ScaleMode::kNone:
      return "none";
    case ScaleMode::kPerToken1D:
      return "[T]";
    case ScaleMode::kPerToken2D:
      return "[T,1]";
    case ScaleMode::kPerGroup:
      return "[T,G]";
  }
  return "?";
}

struct GatherCase {
  std::int64_t T = 1;
  int K = 1;
  int E = 8;
  int M = 1;
  std::int64_t H = 8;
  DType dtype = DType::kBFloat16;
  ScaleMode scales = ScaleMode::kNone;
  bool zero_fill = false;
  std::int64_t x_stride_extra = 0;
};

std::string describe(const GatherCase& c) {
  std::ostringstream os;
  os << "gather T=" << c.T << " K=" << c.K << " E=" << c.E << " M=" << c.M << " H=" << c.H
     << " dtype=" << switchyard::dtype_name(c.dtype) << " scales=" << scale_name(c.scales)
     << " zero_fill=" << c.zero_fill << " x_stride=H+" << c.x_stride_extra;
  return os.str();
}

// Checks gather's outputs row by row: rows that hold a token carry that token's bytes, padding
// rows below padded_total are zero (zero_fill) or untouched, every other row is untouched.
void check_gather_rows(const GatherCase& c, const std::vector<std::int32_t>& permuted_to_token,
                       std::int64_t padded_total, const std::vector<std::uint8_t>& x, std::int64_t x_stride,
                       const std::vector<float>& scales, std::int64_t cols,
                       const std::vector<std::uint8_t>& x_perm, const std::vector<float>& x_perm_scales) {
  const std::size_t elem = switchyard::dtype_size(c.dtype);
  const std::size_t row_bytes = static_cast<std::size_t>(c.H) * elem;
  const std::int64_t total_rows =
      static_cast<std::int64_t>(x_perm.size() / std::max<std::size_t>(row_bytes, 1));
  std::vector<std::uint8_t> zeros(row_bytes, 0), poison(row_bytes, kPoisonByte);
  std::vector<float> zero_scales(cols, 0.0f), poison_scales(cols);
  if (cols > 0) std::memset(poison_scales.data(), kPoisonByte, cols * sizeof(float));
  for (std::int64_t p = 0; p < total_rows; ++p) {
    const std::uint8_t* got = x_perm.data() + p * row_bytes;
    const float* got_scales = cols > 0 ? x_perm_scales.data() + p * cols : nullptr;
    const std::uint8_t* want;
    const float* want_scales;
    const char* what;
    const std::int64_t token =
        p < static_cast<std::int64_t>(permuted_to_token.size()) ? permuted_to_token[p] : -1;
    if (p < padded_total && token >= 0 && token < c.T) {
      want = x.data() + token * x_stride * elem;
      want_scales = cols > 0 ? scales.data() + token * cols : nullptr;
      what = "a copy of its token's row";
    } else if (p < padded_total && c.zero_fill) {
      want = zeros.data();
      want_scales = zero_scales.data();
      what = "zero-filled padding";
    } else {
      want = poison.data();
      want_scales = poison_scales.data();
      what = p < padded_total ? "untouched padding" : "untouched (past padded_total)";
    }
    if (std::memcmp(got, want, row_bytes) != 0) {
      ADD_FAILURE() << "x_perm row " << p << " (token " << token << ", padded_total " << padded_total
                    << ") should be " << what;
      return;
    }
    if (cols > 0 && std::memcmp(got_scales, want_scales, cols * sizeof(float)) != 0) {
      ADD_FAILURE() << "x_perm_scales row " << p << " (token " << token << ") should be " << what;
      return;
    }
  }
}

std::int64_t scale_cols(ScaleMode mode, std::int64_t H) {
  if (mode == ScaleMode::kNone) return 0;
  if (mode == ScaleMode::kPerGroup)
    return (H + switchyard::kScaleGroupSize - 1) / switchyard::kScaleGroupSize;
  return 1;
}

TensorView scale_view(ScaleMode mode, const float* data, std::int64_t rows, std::int64_t cols) {
  if (mode == ScaleMode::kNone) return TensorView{};
  if (mode == ScaleMode::kPerToken1D) return TensorView::of(data, DType::kFloat32, {rows}, Device::cpu());
  return TensorView::of(data, DType::kFloat32, {rows, cols}, Device::cpu());
}

// Runs gather once on `layout` and returns x_perm / x_perm_scales (R + kGuardRows rows each).
void run_gather(const GatherCase& c, const LayoutHolder& layout, const std::vector<std::uint8_t>& x,
                const std::vector<float>& scales, std::vector<std::uint8_t>* x_perm,
                std::vector<float>* x_perm_scales) {
  const std::size_t elem = switchyard::dtype_size(c.dtype);
  const std::int64_t R = layout.rows;
  const std::int64_t cols = scale_cols(c.scales, c.H);
  x_perm->assign((R + kGuardRows) * c.H * elem, kPoisonByte);
  x_perm_scales->assign((R + kGuardRows) * cols, 0.0f);
  if (!x_perm_scales->empty()) {
    std::memset(x_perm_scales->data(), kPoisonByte, x_perm_scales->size() * sizeof(float));
  }
  const TensorView xv =
      TensorView::of(x.data(), c.dtype, {c.T, c.H}, Device::cpu()).with_row_stride(c.H + c.x_stride_extra);
  const Status s = switchyard::gather(xv, scale_view(c.scales, scales.data(), c.T, cols), layout.view(),
                                      TensorView::of(x_perm->data(), c.dtype, {R, c.H}, Device::cpu()),
                                      scale_view(c.scales, x_perm_scales->data(), R, cols), c.zero_fill);
  ASSERT_TRUE(s.ok()) << s.to_string();
}

void check_gather_case(const GatherCase& c, std::uint64_t seed) {
  SCOPED_TRACE(describe(c));
  const LayoutHolder layout = make_layout(c.T, c.K, c.E, c.M, seed);
  std::mt19937_64 g(seed + 1);
  const std::size_t elem = switchyard::dtype_size(c.dtype);
  const std::int64_t x_stride = c.H + c.x_stride_extra;
  // Random bytes, NaN and inf patterns included: gather must copy bytes, not values. The
  // stride gap holds random bytes too, and must not travel.
  std::vector<std::uint8_t> x(std::max<std::int64_t>(c.T * x_stride, 1) * elem);
  for (std::uint8_t& b : x) b = static_cast<std::uint8_t>(g());
  const std::int64_t cols = scale_cols(c.scales, c.H);
  std::vector<float> scales(c.T * cols);
  std::uniform_real_distribution<float> u(0.001f, 10.0f);
  for (float& s : scales) s = u(g);
  std::vector<std::uint8_t> x_perm;
  std::vector<float> x_perm_scales;
  run_gather(c, layout, x, scales, &x_perm, &x_perm_scales);
  if (::testing::Test::HasFatalFailure()) return;
  check_gather_rows(c, layout.permuted_to_token, layout.padded_total(), x, x_stride, scales, cols, x_perm,
                    x_perm_scales);
}

TEST(GatherCpu, SweepDtypesScalesAndShapes) {
  const std::uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 g(seed);
  const DType dtypes[] = {DType::kBFloat16, DType::kFloat16, DType::kFloat32, DType::kFloat8E4M3};
  const ScaleMode modes[] = {ScaleMode::kNone, ScaleMode::kPerToken1D, ScaleMode::kPerToken2D,
                             ScaleMode::kPerGroup};
  const std::int64_t hiddens[] = {1, 7, 8, 64, 129, 256, 300, 301, 4096};
  int i = 0;
  for (const std::int64_t T : kTs) {
    for (const DType dtype : dtypes) {
      for (const bool zero_fill : {false, true}) {
        GatherCase c;
        c.T = T;
        c.dtype = dtype;
        c.zero_fill = zero_fill;
        c.E = kEs[i % 6];
        c.K = std::min(kKs[(i + i / 6) % 6], c.E);
        c.M = kMs[i % 5];
        c.H = hiddens[i % 9];
        // Keep the biggest shapes small in H so the binary stays fast under sanitizers.
        if (T * c.K * c.H > (std::int64_t{1} << 22)) c.H = (i % 2 == 0) ? 8 : 7;
        c.scales = dtype == DType::kFloat8E4M3 ? modes[i % 4] : modes[(i / 3) % 4];
        c.x_stride_extra = (i % 3 == 0) ? 0 : (i % 3 == 1 ? 1 : 13);
        check_gather_case(c, g());
        ++i;
      }
    }
  }
}

// fp8 rows with per-128-column-group scales: H = 300 gives 3 groups; also H = 4096 (32 groups).
TEST(GatherCpu, Fp8WithGroupScales) {
  const std::uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 g(seed);
  for (const std::int64_t H : {std::int64_t{300}, std::int64_t{4096}}) {
    for (const bool zero_fill : {false, true}) {
      GatherCase c;
      c.T = 111;
      c.K = 8;
      c.E = 256;
      c.M = 128;
      c.H = H;
      c.dtype = DType::kFloat8E4M3;
      c.scales = ScaleMode::kPerGroup;
      c.zero_fill = zero_fill;
      c.x_stride_extra = 64;
      ASSERT_EQ(scale_cols(c.scales, 300), 3);
      check_gather_case(c, g());
    }
  }
}

// A hand-made layout with odd permuted_to_token entries and totals beyond the capacity, below
// zero and in between: rows >= padded_total (clamped into [0, R]) are never written.
TEST(GatherCpu, HandMadeLayoutAndClampedTotals) {
  const std::int64_t T = 3, H = 5, R = 8;
  LayoutHolder layout;
  layout.T = T;
  layout.K = 1;
  layout.rows = R;
  layout.permuted_to_token = {2, -5, 0, 3, 1, 99, 2, 1};
  layout.expanded_to_permuted.assign(T, -1);
  layout.totals = {0, 0, 0};
  GatherCase c;
  c.T = T;
  c.H = H;
  c.dtype = DType::kFloat8E4M3;
  c.scales = ScaleMode::kPerToken2D;
  c.x_stride_extra = 2;
  std::vector<std::uint8_t> x((H + 2) * T);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<std::uint8_t>(i * 37 + 1);
  const std::vector<float> scales = {0.5f, 2.0f, 8.0f};
  for (const std::int32_t total : {6, 1000, -4, 0, 8}) {
    for (const bool zero_fill : {false, true}) {
      SCOPED_TRACE("totals[0] = " + std::to_string(total) + " zero_fill " + std::to_string(zero_fill));
      layout.totals[0] = total;
      c.zero_fill = zero_fill;
      std::vector<std::uint8_t> x_perm;
      std::vector<float> x_perm_scales;
      run_gather(c, layout, x, scales, &x_perm, &x_perm_scales);
      if (HasFatalFailure()) return;
      const std::int64_t clamped = std::clamp<std::int64_t>(total, 0, R);
      check_gather_rows(c, layout.permuted_to_token, clamped, x, H + 2, scales, 1, x_perm, x_perm_scales);
    }
  }
}

TEST(GatherCpu, ZeroTokensAndDeterminism) {
  const std::uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  // T = 0: an empty layout, nothing to do, nothing written.
  {
    GatherCase c;
    c.T = 0;
    c.K = 8;
    c.E = 160;
    c.M = 64;
    c.H = 300;
    c.dtype = DType::kFloat8E4M3;
    c.scales = ScaleMode::kPerGroup;
    check_gather_case(c, seed);
  }
  // The same call twice gives the same bytes.
  GatherCase c;
  c.T = 989;
  c.K = 10;
  c.E = 512;
  c.M = 7;
  c.H = 256;
  c.dtype = DType::kBFloat16;
  c.scales = ScaleMode::kPerToken1D;
  c.zero_fill = true;
  const LayoutHolder layout = make_layout(c.T, c.K, c.E, c.M, seed);
  std::vector<std::uint8_t> x(c.T * c.H * 2);
  std::mt19937_64 g(seed);
  for (std::uint8_t& b : x) b = static_cast<std::uint8_t>(g());
  std::vector<float> scales(c.T, 1.5f);
  std::vector<std::uint8_t> a, b;
  std::vector<float> as, bs;
  run_gather(c, layout, x, scales, &a, &as);
  run_gather(c, layout, x, scales, &b, &bs);
  EXPECT_TRUE(a == b);
  EXPECT_TRUE(as == bs);
}

// ---- combine ----

enum class WeightMode { kNone, kFp32, kBf16 };

struct CombineCase {
  std::int64_t T = 1;
  int K = 1;
  int E = 8;
  int M = 1;
  std::int64_t H = 8;
  DType y_dtype = DType::kBFloat16;
  WeightMode weights = WeightMode::kFp32;
  DType out_dtype = DType::kBFloat16;
  bool accumulate = false;
  std::int64_t y_stride_extra = 0;
};

std::string describe(const CombineCase& c) {
  std::ostringstream os;
  os << "combine T=" << c.T << " K=" << c.K << " E=" << c.E << " M=" << c.M << " H=" << c.H
     << " y=" << switchyard::dtype_name(c.y_dtype) << " weights="
     << (c.weights == WeightMode::kNone   ? "none"
         : c.weights == WeightMode::kFp32 ? "fp32"
                                          : "bf16")
     << " out=" << switchyard::dtype_name(c.out_dtype) << " accumulate=" << c.accumulate << " y_stride=H+"
     << c.y_stride_extra;
  return os.str();
}

// A random value exactly representable in `dtype`; now and then a tiny one (fp16 subnormal).
float random_value(DType dtype, std::mt19937_64& g) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  float v = n(g);
  if (g() % 64 == 0) v *= 1e-6f;
  if (dtype == DType::kBFloat16) return sy_test::bf16_value(sy_test::bf16_bits(v));
  if (dtype == DType::kFloat16) return fp16_value(fp16_bits(v));
  return v;
}

struct CombineData {
  std::vector<std::uint8_t> y;        // [R, y_stride] in y_dtype
  std::vector<std::uint8_t> weights;  // [T, K] fp32 or bf16
  std::vector<std::uint8_t> out0;     // [T*H + guard] initial out: values when accumulating, poison otherwise
};

CombineData make_combine_data(const CombineCase& c, const LayoutHolder& layout, std::uint64_t seed) {
  std::mt19937_64 g(seed);
  CombineData d;
  const std::int64_t R = layout.rows;
  const std::int64_t y_stride = c.H + c.y_stride_extra;
  const std::size_t y_elem = switchyard::dtype_size(c.y_dtype);
  // Every element starts as NaN: rows no placed pick names (padding, rows past padded_total)
  // and the stride gap must never be read, or the output turns NaN.
  d.y.resize(std::max<std::int64_t>(R * y_stride, 1) * y_elem);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (std::int64_t i = 0; i < R * y_stride; ++i) {
    if (c.y_dtype == DType::kFloat32) {
      store_from_float(c.y_dtype, d.y.data(), i, nan);
    } else {
      static_cast<std::uint16_t*>(static_cast<void*>(d.y.data()))[i] =
          c.y_dtype == DType::kBFloat16 ? 0x7fc0 : 0x7e00;
    }
  }
  for (std::int64_t x = 0; x < c.T * c.K; ++x) {
    const std::int32_t r = layout.expanded_to_permuted[x];
    if (r < 0) continue;
    for (std::int64_t h = 0; h < c.H; ++h)
      store_from_float(c.y_dtype, d.y.data(), r * y_stride + h, random_value(c.y_dtype, g));
  }
  if (c.weights != WeightMode::kNone) {
    const DType w_dtype = c.weights == WeightMode::kFp32 ? DType::kFloat32 : DType::kBFloat16;
    d.weights.resize(std::max<std::int64_t>(c.T * c.K, 1) * switchyard::dtype_size(w_dtype));
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (std::int64_t x = 0; x < c.T * c.K; ++x) store_from_float(w_dtype, d.weights.data(), x, u(g));
  }
  const std::size_t out_elem = switchyard::dtype_size(c.out_dtype);
  d.out0.assign((c.T * c.H + kGuardRows) * out_elem, kPoisonByte);
  if (c.accumulate) {
    for (std::int64_t i = 0; i < c.T * c.H; ++i)
      store_from_float(c.out_dtype, d.out0.data(), i, random_value(c.out_dtype, g));
  }
  return d;
}

std::vector<std::uint8_t> run_combine(const CombineCase& c, const LayoutHolder& layout,
                                      const CombineData& d) {
  std::vector<std::uint8_t> out = d.out0;
  const TensorView y = TensorView::of(d.y.data(), c.y_dtype, {layout.rows, c.H}, Device::cpu())
                           .with_row_stride(c.H + c.y_stride_extra);
  TensorView w;
  if (c.weights != WeightMode::kNone) {
    w = TensorView::of(d.weights.data(), c.weights == WeightMode::kFp32 ? DType::kFloat32 : DType::kBFloat16,
                       {c.T, c.K}, Device::cpu());
  }
  const Status s = switchyard::combine(
      y, layout.view(), w, TensorView::of(out.data(), c.out_dtype, {c.T, c.H}, Device::cpu()), c.accumulate);
  EXPECT_TRUE(s.ok()) << s.to_string();
  return out;
}

// Compares combine's output with (1) an in-test replica of the fmaf contract, bit for bit, and
// (2) an fp64 sum: fp32 out within 1e-6 of the sum of |terms|; bf16 / fp16 out within one
// unit in the last place of the fp64 value rounded, widened by that same fp32 error bound
// (which matters only where terms cancel).
void check_combine_case(const CombineCase& c, std::uint64_t seed) {
  SCOPED_TRACE(describe(c));
  const LayoutHolder layout = make_layout(c.T, c.K, c.E, c.M, seed);
  const CombineData d = make_combine_data(c, layout, seed + 7);
  const std::vector<std::uint8_t> out = run_combine(c, layout, d);
  const std::int64_t R = layout.rows;
  const std::int64_t y_stride = c.H + c.y_stride_extra;
  const DType w_dtype = c.weights == WeightMode::kBf16 ? DType::kBFloat16 : DType::kFloat32;
  int failures = 0;
  for (std::int64_t t = 0; t < c.T && failures < 5; ++t) {
    for (std::int64_t h = 0; h < c.H && failures < 5; ++h) {
      float acc = 0.0f;
      double ref = 0.0, magnitude = 0.0;
      for (std::int64_t k = 0; k < c.K; ++k) {
        const std::int32_t r = layout.expanded_to_permuted[t * c.K + k];
        if (r < 0 || r >= R) continue;
        const float w =
            c.weights == WeightMode::kNone ? 1.0f : load_as_float(w_dtype, d.weights.data(), t * c.K + k);
        const float yv = load_as_float(c.y_dtype, d.y.data(), r * y_stride + h);
        acc = std::fmaf(w, yv, acc);
        ref += static_cast<double>(w) * yv;
        magnitude += std::fabs(static_cast<double>(w) * yv);
      }
      if (c.accumulate) {
        const float o = load_as_float(c.out_dtype, d.out0.data(), t * c.H + h);
        acc = acc + o;
        ref += o;
        magnitude += std::fabs(o);
      }
      const std::int64_t i = t * c.H + h;
      const std::uint32_t got = stored_bits(c.out_dtype, out.data(), i);
      const std::uint32_t replica = bits_of(c.out_dtype, acc);
      const float got_value = load_as_float(c.out_dtype, out.data(), i);
      if (got != replica) {
        ADD_FAILURE() << "out[" << t << "," << h << "] bits 0x" << std::hex << got << " = " << got_value
                      << ", fmaf replica 0x" << replica << std::dec << " = " << acc;
        ++failures;
        continue;
      }
      const double tol = 1e-6 * magnitude;
      bool close;
      if (c.out_dtype == DType::kFloat32) {
        close = std::fabs(static_cast<double>(got_value) - ref) <= tol;
      } else {
        const int lo =
            ordinal16(static_cast<std::uint16_t>(bits_of(c.out_dtype, static_cast<float>(ref - tol))));
        const int hi =
            ordinal16(static_cast<std::uint16_t>(bits_of(c.out_dtype, static_cast<float>(ref + tol))));
        const int o = ordinal16(static_cast<std::uint16_t>(got));
        close = o >= lo - 1 && o <= hi + 1;
      }
      if (!close) {
        ADD_FAILURE() << "out[" << t << "," << h << "] = " << got_value << ", fp64 reference " << ref
                      << " (sum of |terms| " << magnitude << ")";
        ++failures;
      }
    }
  }
  // Nothing past [T,H] is written.
  const std::size_t out_elem = switchyard::dtype_size(c.out_dtype);
  for (std::size_t b = static_cast<std::size_t>(c.T * c.H) * out_elem; b < out.size(); ++b) {
    if (out[b] != kPoisonByte) {
      ADD_FAILURE() << "out written past [T, H] at byte " << b;
      break;
    }
  }
}

constexpr DType kFloatDtypes[] = {DType::kBFloat16, DType::kFloat16, DType::kFloat32};
constexpr WeightMode kWeightModes[] = {WeightMode::kNone, WeightMode::kFp32, WeightMode::kBf16};

// The shape of sweep case i: T, E, K, M and H rotating through the sweep lists (H capped so that
// T * K * H stays small), and y's row stride.
CombineCase sweep_shape(int i) {
  static const std::int64_t hiddens[] = {1, 7, 8, 64, 129, 300};
  CombineCase c;
  c.T = kTs[1 + i % 6];
  c.E = kEs[i % 6];
  c.K = std::min(kKs[(i + i / 6) % 6], c.E);
  c.M = kMs[i % 5];
  c.H = hiddens[(i / 2) % 6];
  if (c.T * c.K * c.H > (std::int64_t{1} << 19)) c.H = i % 2 == 0 ? 8 : 3;
  c.y_stride_extra = i % 3 == 0 ? 0 : 5;
  return c;
}

TEST(CombineCpu, SweepDtypesWeightsAccumulate) {
  const std::uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 g(seed);
  int i = 0;
  // Every (y dtype, out dtype, weights, accumulate) combination, the shape axes rotating.
  for (const DType y_dtype : kFloatDtypes) {
    for (const DType out_dtype : kFloatDtypes) {
      for (const WeightMode w : kWeightModes) {
        for (const bool accumulate : {false, true}) {
          CombineCase c = sweep_shape(i);
          c.y_dtype = y_dtype;
          c.out_dtype = out_dtype;
          c.weights = w;
          c.accumulate = accumulate;
          check_combine_case(c, g());
          ++i;
        }
      }
    }
  }
}

// A shape large enough to run over several threads, at every listed T.
TEST(CombineCpu, SweepTokens) {
  const std::uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 g(seed);
  int i = 0;
  for (const std::int64_t T : kTs) {
    CombineCase c;
    c.T = T;
    c.E = kEs[(i + 3) % 6];
    c.K = std::min(kKs[i % 6], c.E);
    c.M = kMs[i % 5];
    c.H = T >= 989 ? 64 : 300;
    c.y_dtype = DType::kBFloat16;
    c.out_dtype = i % 2 == 0 ? DType::kBFloat16 : DType::kFloat32;
    c.weights = WeightMode::kFp32;
    c.accumulate = i % 3 == 0;
    c.y_stride_extra = 8;
    check_combine_case(c, g());
    ++i;
  }
}

// Hand-made expanded_to_permuted with entries outside [0, R): -1, -7, R and R + 100 are all
// "not placed"; a token whose picks are all unplaced gets 0 (or its old value, accumulating).
TEST(CombineCpu, HandMadeUnplacedEntries) {
  const std::int64_t T = 3, H = 2, R = 4;
  const int K = 3;
  LayoutHolder layout;
  layout.T = T;
  layout.K = K;
  layout.rows = R;
  layout.permuted_to_token.assign(R, static_cast<std::int32_t>(T));
  layout.expanded_to_permuted = {2, -1, 0, -7, 4, 104, 3, 1, -1};
  const std::vector<float> y = {1.0f, 2.0f, 10.0f, 20.0f, 100.0f, 200.0f, 1000.0f, 2000.0f};
  const std::vector<float> w = {0.5f, 9.0f, 0.25f, 9.0f, 9.0f, 9.0f, 2.0f, -1.0f, 9.0f};
  for (const bool accumulate : {false, true}) {
    std::vector<float> out = {7.0f, 7.0f, 7.0f, 7.0f, 7.0f, 7.0f};
    const Status s =
        switchyard::combine(TensorView::of(y.data(), DType::kFloat32, {R, H}, Device::cpu()), layout.view(),
                            TensorView::of(w.data(), DType::kFloat32, {T, K}, Device::cpu()),
                            TensorView::of(out.data(), DType::kFloat32, {T, H}, Device::cpu()), accumulate);
    ASSERT_TRUE(s.ok()) << s.to_string();
    const float a = accumulate ? 7.0f : 0.0f;
    // token 0: 0.5*row2 + 0.25*row0; token 1: nothing; token 2: 2*row3 - row1.
    EXPECT_EQ(out, (std::vector<float>{50.25f + a, 100.5f + a, a, a, 1990.0f + a, 3980.0f + a}));
  }
}

// A NaN result is stored as CUDA's NaN (0x7fffffff) whatever the NaN operand's payload, so that the
// CPU and the CUDA backend store the same bits (x86 would keep the operand's payload).
TEST(CombineCpu, NanResultsAreCudasNan) {
  const std::int64_t T = 1, H = 2, R = 2;
  const int K = 2;
  LayoutHolder layout;
  layout.T = T;
  layout.K = K;
  layout.rows = R;
  layout.permuted_to_token.assign(R, 0);
  layout.expanded_to_permuted = {0, 1};
  float payload_nan;
  const std::uint32_t bits = 0xffa00001u;  // negative, with a payload
  std::memcpy(&payload_nan, &bits, 4);
  const std::vector<float> y = {payload_nan, 1.0f, 2.0f, 3.0f};
  std::vector<float> out(2, 0.0f);
  const Status s = switchyard::combine(TensorView::of(y.data(), DType::kFloat32, {R, H}, Device::cpu()),
                                       layout.view(), TensorView{},
                                       TensorView::of(out.data(), DType::kFloat32, {T, H}, Device::cpu()));
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(f32_bits(out[0]), 0x7fffffffu);
  EXPECT_EQ(out[1], 4.0f);
}

TEST(CombineCpu, ZeroTokensAndDeterminism) {
  const std::uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  {
    CombineCase c;
    c.T = 0;
    c.K = 8;
    c.E = 160;
    c.M = 64;
    c.H = 64;
    check_combine_case(c, seed);
  }
  CombineCase c;
  c.T = 4096;
  c.K = 8;
  c.E = 256;
  c.M = 128;
  c.H = 64;
  c.y_dtype = DType::kBFloat16;
  c.out_dtype = DType::kBFloat16;
  c.weights = WeightMode::kFp32;
  c.accumulate = true;
  const LayoutHolder layout = make_layout(c.T, c.K, c.E, c.M, seed);
  const CombineData d = make_combine_data(c, layout, seed + 1);
  EXPECT_TRUE(run_combine(c, layout, d) == run_combine(c, layout, d));
}


// ---- combine_backward ----

struct BackwardCase {
  CombineCase c;           // T, K, E, M, H, y dtype (also grad_y_perm's), weights
  DType grad_dtype = DType::kBFloat16;
  std::int64_t grad_stride_extra = 0;
  bool want_dy = true, want_dw = true;
};

std::string describe(const BackwardCase& b) {
  return "combine_backward: " + describe(b.c) + " grad_out=" + switchyard::dtype_name(b.grad_dtype) +
         " dy=" + std::to_string(b.want_dy) + " dw=" + std::to_string(b.want_dw);
}

// Runs combine_backward on a random layout and checks it against the contract: every row of the
// layout's capacity written (a pick's row = its weight times its token's gradient, one fp32
// product, rounded; any other row 0), rows past it untouched; dw bit-equal to an fmaf replica in
// column order and within 1e-6 of the fp64 dot's sum of |products|, 0 for unplaced picks.
void check_backward_case(const BackwardCase& b, std::uint64_t seed) {
  const CombineCase& c = b.c;
  SCOPED_TRACE(describe(b));
  const LayoutHolder layout = make_layout(c.T, c.K, c.E, c.M, seed);
  const CombineData d = make_combine_data(c, layout, seed + 7);  // y: NaN on every row no pick names
  std::mt19937_64 g(seed + 11);
  const std::int64_t R = layout.rows, gs = c.H + b.grad_stride_extra, ys = c.H + c.y_stride_extra;
  std::vector<std::uint8_t> grad(std::max<std::int64_t>(c.T * gs, 1) * switchyard::dtype_size(b.grad_dtype));
  for (std::int64_t i = 0; i < c.T * gs; ++i) store_from_float(b.grad_dtype, grad.data(), i, random_value(b.grad_dtype, g));
  const std::size_t dy_elem = switchyard::dtype_size(c.y_dtype);
  std::vector<std::uint8_t> dy(static_cast<std::size_t>((R + kGuardRows) * c.H) * dy_elem, kPoisonByte);
  std::vector<float> dw(static_cast<std::size_t>(c.T * c.K + kGuardRows));
  std::memset(dw.data(), kPoisonByte, dw.size() * sizeof(float));
  const DType w_dtype = c.weights == WeightMode::kBf16 ? DType::kBFloat16 : DType::kFloat32;
  TensorView w;
  if (c.weights != WeightMode::kNone) w = TensorView::of(d.weights.data(), w_dtype, {c.T, c.K}, Device::cpu());
  const Status s = switchyard::combine_backward(
      TensorView::of(grad.data(), b.grad_dtype, {c.T, c.H}, Device::cpu()).with_row_stride(gs),
      TensorView::of(d.y.data(), c.y_dtype, {R, c.H}, Device::cpu()).with_row_stride(ys), layout.view(), w,
      b.want_dy ? TensorView::of(dy.data(), c.y_dtype, {R, c.H}, Device::cpu()) : TensorView{},
      b.want_dw ? TensorView::of(dw.data(), DType::kFloat32, {c.T, c.K}, Device::cpu()) : TensorView{});
  ASSERT_TRUE(s.ok()) << s.to_string();
  int failures = 0;
  // grad_y_perm.
  for (std::int64_t p = 0; p < R + kGuardRows && failures < 5; ++p) {
    const std::int64_t e = p < R ? layout.permuted_to_expanded[p] : -1;
    const bool pick = e >= 0 && e < c.T * c.K;
    for (std::int64_t h = 0; h < c.H && failures < 5; ++h) {
      const std::int64_t i = p * c.H + h;
      std::uint32_t want;
      if (!b.want_dy || p >= R) {
        want = stored_bits(c.y_dtype, std::vector<std::uint8_t>(dy_elem, kPoisonByte).data(), 0);
      } else if (pick) {
        const float wt = c.weights == WeightMode::kNone ? 1.0f : load_as_float(w_dtype, d.weights.data(), e);
        want = bits_of(c.y_dtype, wt * load_as_float(b.grad_dtype, grad.data(), (e / c.K) * gs + h));
      } else {
        want = bits_of(c.y_dtype, 0.0f);
      }
      if (stored_bits(c.y_dtype, dy.data(), i) != want) {
        ADD_FAILURE() << "grad_y_perm[" << p << "," << h << "] bits 0x" << std::hex
                      << stored_bits(c.y_dtype, dy.data(), i) << ", want 0x" << want << std::dec
                      << (p >= R ? " (past the layout's rows: untouched)" : pick ? " (a pick's row)" : " (no pick: 0)");
        ++failures;
      }
    }
  }
  // grad_weights.
  for (std::int64_t x = 0; x < c.T * c.K + kGuardRows && failures < 5; ++x) {
    const float got = dw[static_cast<std::size_t>(x)];
    float want = 0.0f;
    double ref = 0.0, magnitude = 0.0;
    if (!b.want_dw || x >= c.T * c.K) {
      std::memset(&want, kPoisonByte, sizeof want);
    } else {
      const std::int32_t r = layout.expanded_to_permuted[x];
      if (r >= 0 && r < R) {
        for (std::int64_t h = 0; h < c.H; ++h) {
          const float gv = load_as_float(b.grad_dtype, grad.data(), (x / c.K) * gs + h);
          const float yv = load_as_float(c.y_dtype, d.y.data(), r * ys + h);
          want = std::fmaf(gv, yv, want);
          ref += static_cast<double>(gv) * yv;
          magnitude += std::fabs(static_cast<double>(gv) * yv);
        }
      }
    }
    const bool inside = b.want_dw && x < c.T * c.K;
    if (std::memcmp(&got, &want, sizeof got) != 0 || (inside && std::fabs(got - ref) > 1e-6 * magnitude + 1e-30)) {
      ADD_FAILURE() << "grad_weights[" << x / std::max(1, c.K) << "," << x % std::max(1, c.K) << "] = " << got
                    << ", fmaf replica " << want << ", fp64 " << ref << (x >= c.T * c.K ? " (guard: untouched)" : "");
      ++failures;
    }
  }
}

TEST(CombineBackwardCpu, SweepDtypesWeightsAndOutputs) {
  const std::uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 g(seed);
  int i = 0;
  for (const DType y_dtype : kFloatDtypes) {
    for (const DType grad_dtype : kFloatDtypes) {
      for (const WeightMode w : kWeightModes) {
        BackwardCase b;
        b.c = sweep_shape(i);
        b.c.y_dtype = y_dtype;
        b.c.weights = w;
        b.grad_dtype = grad_dtype;
        b.grad_stride_extra = i % 2 == 0 ? 0 : 3;
        b.want_dy = i % 7 != 3;
        b.want_dw = i % 7 != 5;
        check_backward_case(b, g());
        ++i;
      }
    }
  }
  BackwardCase zero;  // no tokens: every row of the capacity is padding
  zero.c.T = 0;
  zero.c.K = 4;
  zero.c.E = 16;
  zero.c.M = 8;
  check_backward_case(zero, g());
}

TEST(CombineBackwardCpu, BadArgumentsAreNamedAndNothingIsWritten) {
  const LayoutHolder layout = make_layout(4, 2, 8, 2, 1);
  const std::int64_t R = layout.rows, H = 8;
  std::vector<float> grad(4 * H, 1.0f), y(R * H, 1.0f), dy(R * H, 5.0f), dw(8, 5.0f);
  std::vector<std::uint16_t> dy16(R * H, 7);
  const TensorView g = TensorView::of(grad.data(), DType::kFloat32, {4, H}, Device::cpu());
  const TensorView yv = TensorView::of(y.data(), DType::kFloat32, {R, H}, Device::cpu());
  const TensorView dyv = TensorView::of(dy.data(), DType::kFloat32, {R, H}, Device::cpu());
  const TensorView dwv = TensorView::of(dw.data(), DType::kFloat32, {4, 2}, Device::cpu());
  struct Bad {
    const char* name;
    Status status;
  };
  const Bad bad[] = {
      {"grad_y_perm", switchyard::combine_backward(g, yv, layout.view(), {}, {}, {})},
      {"y_perm", switchyard::combine_backward(g, {}, layout.view(), {}, dyv, dwv)},
      {"grad_y_perm", switchyard::combine_backward(g, yv, layout.view(), {},
                                                   TensorView::of(dy16.data(), DType::kBFloat16, {R, H}, Device::cpu()), dwv)},
      {"grad_y_perm", switchyard::combine_backward(g, yv, layout.view(), {},
                                                   TensorView::of(dy.data(), DType::kFloat32, {R - 1, H}, Device::cpu()), {})},
      {"grad_weights", switchyard::combine_backward(g, yv, layout.view(), {}, dyv,
                                                    TensorView::of(dw.data(), DType::kFloat32, {4, 3}, Device::cpu()))},
  };
  for (const Bad& b : bad) {
    EXPECT_FALSE(b.status.ok());
    EXPECT_NE(b.status.message().find(std::string("'") + b.name + "'"), std::string::npos) << b.status.message();
  }
  EXPECT_TRUE(std::all_of(dy.begin(), dy.end(), [](float v) { return v == 5.0f; }));
  EXPECT_TRUE(std::all_of(dw.begin(), dw.end(), [](float v) { return v == 5.0f; }));
}

}  // namespace
