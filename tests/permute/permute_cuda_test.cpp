// GPU tests of gather and combine (docs/design.md section 4) against the CPU oracle.
//
// Each case builds a layout on the CPU, runs the operation on the CPU and on the GPU with the
// same inputs, and compares every output byte:
//   - gather (both the API's row-order kernel and the token-major kernel): byte-identical, over
//     the whole poisoned output, so rows that must not be written have to keep the poison;
//   - combine: bit-identical. Both backends run the same fp32 operation sequence (fma in k
//     order from 0.0f, then + out, then one round to nearest even), so no tolerance is needed.
//     NaN payloads are the one exception (x86 and the GPU differ on them), so the inputs
//     contain no NaN.
// Inputs are fresh random values each run; the seed is in the failure message.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "common/cuda_test_util.h"
#include "common/float_formats.h"
#include "common/numeric.h"
#include "common/op_args.h"
#include "common/test_data.h"
#include "cuda/permute/permute_internal.h"
#include "switchyard/layout.h"
#include "switchyard/permute.h"

namespace {

using switchyard::Device;
using switchyard::DType;
using switchyard::Layout;
using switchyard::Status;
using switchyard::TensorView;
using sy_test::DeviceBuffer;
using sy_test::kSkews;
using sy_test::Skew;
using sy_test::skew_name;

constexpr int kNumExperts = 32;
// Host bytes above which a sweep case shrinks K and the tile (keeps the binary fast).
constexpr std::int64_t kSweepBytesCap = std::int64_t(64) << 20;

// splitmix64: fast, good enough to fill hundreds of MB of test data.
struct FastRng {
  std::uint64_t state;
  explicit FastRng(std::uint64_t seed) : state(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [lo, hi) with 24 random bits.
  float uniform(float lo, float hi) { return lo + (hi - lo) * static_cast<float>(next() >> 40) * 0x1p-24f; }
};

void fill_random_bytes(void* data, std::size_t n, std::uint64_t seed) {
  FastRng rng(seed);
  auto* p = static_cast<unsigned char*>(data);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const std::uint64_t v = rng.next();
    std::memcpy(p + i, &v, 8);
  }
  if (i < n) {
    const std::uint64_t v = rng.next();
    std::memcpy(p + i, &v, n - i);
  }
}

// `n` random values of a float dtype in [-2, 2), as raw bytes.
std::vector<unsigned char> random_floats(DType dtype, std::size_t n, std::uint64_t seed) {
  FastRng rng(seed);
  std::vector<unsigned char> out(n * switchyard::dtype_size(dtype));
  for (std::size_t i = 0; i < n; ++i) {
    const float f = rng.uniform(-2.0f, 2.0f);
    if (dtype == DType::kFloat32) {
      std::memcpy(out.data() + 4 * i, &f, 4);
    } else {
      const std::uint16_t h = dtype == DType::kBFloat16 ? switchyard::detail::float_to_bf16(f)
                                                        : switchyard::detail::float_to_fp16(f);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// Layouts: built on the CPU, copied to the device.

struct LayoutShape {
  std::int64_t T = 1;
  int K = 1;
  int tile = 1;
  bool subset = false;  // only experts [E/4, 3E/4) local, plus a few -1 and out-of-range ids
  Skew skew = Skew::kUniform;

  switchyard::LayoutConfig config() const {
    switchyard::LayoutConfig c;
    c.num_experts = kNumExperts;
    c.local = subset ? switchyard::LocalExperts::range(kNumExperts / 4, kNumExperts / 2)
                     : switchyard::LocalExperts::all();
    c.tile_size = tile;
    return c;
  }
  int num_local() const { return config().num_local(); }
  std::int64_t rows() const { return switchyard::max_permuted_rows(T, K, num_local(), tile); }
  std::int64_t tiles() const { return switchyard::max_tiles(T, K, num_local(), tile); }
};

struct HostLayout {
  LayoutShape shape;
  std::int64_t R = 0;
  std::int64_t N = 0;
  std::vector<std::int32_t> counts, offsets, p2e, p2t, e2p, tile_expert, tile_row_end, totals;

  Layout view() {
    const int L = shape.num_local();
    Layout l;
    l.counts = TensorView::of(counts.data(), DType::kInt32, {L});
    l.offsets = TensorView::of(offsets.data(), DType::kInt32, {L + 1});
    l.permuted_to_expanded = TensorView::of(p2e.data(), DType::kInt32, {R});
    l.permuted_to_token = TensorView::of(p2t.data(), DType::kInt32, {R});
    l.expanded_to_permuted = TensorView::of(e2p.data(), DType::kInt32, {shape.T, shape.K});
    l.tile_expert = TensorView::of(tile_expert.data(), DType::kInt32, {N});
    l.tile_row_end = TensorView::of(tile_row_end.data(), DType::kInt32, {N});
    l.totals = TensorView::of(totals.data(), DType::kInt32, {switchyard::kNumTotals});
    return l;
  }
};

::testing::AssertionResult make_host_layout(const LayoutShape& s, std::uint64_t seed, HostLayout* out) {
  const std::vector<std::int64_t> ids64 =
      sy_test::random_ids(s.T, s.K, kNumExperts, s.skew, seed, /*hot=*/kNumExperts / 4 + 1);
  std::vector<std::int32_t> ids(ids64.begin(), ids64.end());
  if (s.subset) {  // some picks not placed: -1 (ignored) and out-of-range ids (dropped)
    FastRng rng(seed ^ 0x5eedull);
    for (auto& id : ids) {
      const std::uint64_t r = rng.next() % 16;
      if (r == 0) id = -1;
      if (r == 1) id = kNumExperts + 3;
    }
  }
  HostLayout& h = *out;
  h.shape = s;
  h.R = s.rows();
  h.N = s.tiles();
  const int L = s.num_local();
  h.counts.assign(L, 0);
  h.offsets.assign(L + 1, 0);
  h.p2e.assign(h.R, 0);
  h.p2t.assign(h.R, 0);
  h.e2p.assign(s.T * s.K, 0);
  h.tile_expert.assign(h.N, 0);
  h.tile_row_end.assign(h.N, 0);
  h.totals.assign(switchyard::kNumTotals, 0);
  const TensorView ids_view = TensorView::of(ids.data(), DType::kInt32, {s.T, s.K});
  const Status st = switchyard::layout(s.config(), ids_view, h.view(), nullptr, 0);
  if (!st.ok()) return ::testing::AssertionFailure() << "CPU layout failed: " << st.to_string();
  return ::testing::AssertionSuccess();
}

// Device copies of a layout's arrays, allocated once for a shape and refilled by upload().
struct DeviceLayout {
  DeviceBuffer counts, offsets, p2e, p2t, e2p, tile_expert, tile_row_end, totals;
  Layout layout;

  explicit DeviceLayout(const HostLayout& h) {
    auto alloc = [](DeviceBuffer& b, std::size_t n) { b = DeviceBuffer(n * sizeof(std::int32_t) + 16); };
    alloc(counts, h.counts.size());
    alloc(offsets, h.offsets.size());
    alloc(p2e, h.p2e.size());
    alloc(p2t, h.p2t.size());
    alloc(e2p, h.e2p.size());
    alloc(tile_expert, h.tile_expert.size());
    alloc(tile_row_end, h.tile_row_end.size());
    alloc(totals, h.totals.size());
    const Device d = Device::cuda();
    const int L = h.shape.num_local();
    layout.counts = TensorView::of(counts.get(), DType::kInt32, {L}, d);
    layout.offsets = TensorView::of(offsets.get(), DType::kInt32, {L + 1}, d);
    layout.permuted_to_expanded = TensorView::of(p2e.get(), DType::kInt32, {h.R}, d);
    layout.permuted_to_token = TensorView::of(p2t.get(), DType::kInt32, {h.R}, d);
    layout.expanded_to_permuted = TensorView::of(e2p.get(), DType::kInt32, {h.shape.T, h.shape.K}, d);
    layout.tile_expert = TensorView::of(tile_expert.get(), DType::kInt32, {h.N}, d);
    layout.tile_row_end = TensorView::of(tile_row_end.get(), DType::kInt32, {h.N}, d);
    layout.totals = TensorView::of(totals.get(), DType::kInt32, {switchyard::kNumTotals}, d);
    upload(h);
  }
  bool ok() const { return counts.get() && p2t.get() && e2p.get() && totals.get(); }
  void upload(const HostLayout& h) {
    auto copy = [](DeviceBuffer& b, const std::vector<std::int32_t>& v) {
      if (!v.empty()) cudaMemcpy(b.get(), v.data(), v.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice);
    };
    copy(counts, h.counts);
    copy(offsets, h.offsets);
    copy(p2e, h.p2e);
    copy(p2t, h.p2t);
    copy(e2p, h.e2p);
    copy(tile_expert, h.tile_expert);
    copy(tile_row_end, h.tile_row_end);
    copy(totals, h.totals);
  }
};

DeviceBuffer upload_bytes(const void* data, std::size_t n) {
  DeviceBuffer b(n + 16);
  if (b.get() && n > 0) cudaMemcpy(b.get(), data, n, cudaMemcpyHostToDevice);
  return b;
}

std::vector<unsigned char> download_bytes(const void* device_ptr, std::size_t n) {
  std::vector<unsigned char> v(n);
  if (n > 0) cudaMemcpy(v.data(), device_ptr, n, cudaMemcpyDeviceToHost);
  return v;
}

// Byte equality with the first difference located as (row, byte in row).
::testing::AssertionResult same_bytes(const std::vector<unsigned char>& expected,
                                      const std::vector<unsigned char>& actual, std::size_t row_bytes,
                                      const char* what) {
  if (expected.size() != actual.size()) {
    return ::testing::AssertionFailure()
           << what << ": sizes differ " << expected.size() << " vs " << actual.size();
  }
  if (expected.empty() || std::memcmp(expected.data(), actual.data(), expected.size()) == 0) {
    return ::testing::AssertionSuccess();
  }
  std::size_t i = 0;
  while (expected[i] == actual[i]) ++i;
  std::size_t diffs = 0;
  for (std::size_t j = i; j < expected.size(); ++j) diffs += expected[j] != actual[j];
  const std::size_t rb = std::max<std::size_t>(1, row_bytes);
  char bytes[64];
  std::snprintf(bytes, sizeof bytes, "expected 0x%02x, got 0x%02x", expected[i], actual[i]);
  return ::testing::AssertionFailure() << what << ": " << diffs << " bytes differ; first at row " << i / rb
                                       << ", byte " << i % rb << ": " << bytes;
}

::testing::AssertionResult cuda_clean(const char* what) {
  const cudaError_t sync = cudaDeviceSynchronize();
  const cudaError_t last = cudaGetLastError();
  if (sync != cudaSuccess || last != cudaSuccess) {
    return ::testing::AssertionFailure()
           << what << ": " << cudaGetErrorString(sync != cudaSuccess ? sync : last);
  }
  return ::testing::AssertionSuccess();
}

// ---------------------------------------------------------------------------------------
// Gather.

enum class Scales { kNone, kPerToken, kPerTokenFlat, kPerGroup };

const char* scales_name(Scales s) {
  switch (s) {
    case Scales::kNone:
      return "none";
    case Scales::kPerToken:
      return "per-token[T,1]";
    case Scales::kPerTokenFlat:
      return "per-token[T]";
    default:
      return "per-group";
  }
}

struct GatherCase {
  DType dtype = DType::kBFloat16;
  std::int64_t H = 1;
  LayoutShape shape;
  bool zero_fill = false;
  Scales scales = Scales::kNone;
  std::int64_t stride_pad = 0;   // x row stride = H + stride_pad
  std::int64_t base_offset = 0;  // x starts this many elements into its allocation

  std::string describe() const {
    std::ostringstream s;
    s << "gather dtype=" << switchyard::dtype_name(dtype) << " H=" << H << " T=" << shape.T
      << " K=" << shape.K << " tile=" << shape.tile << " skew=" << skew_name(shape.skew)
      << (shape.subset ? " local-subset" : "") << " zero_fill=" << zero_fill
      << " scales=" << scales_name(scales) << " stride=H+" << stride_pad << " base_offset=" << base_offset;
    return s.str();
  }
  std::int64_t scale_cols() const {
    if (scales == Scales::kNone) return 0;
    if (scales == Scales::kPerGroup)
      return (H + switchyard::kScaleGroupSize - 1) / switchyard::kScaleGroupSize;
    return 1;
  }
};

// A scale tensor view of `rows` rows in the case's form.
TensorView scale_view(const GatherCase& c, void* data, std::int64_t rows, Device d) {
  if (c.scales == Scales::kNone) return TensorView{};
  if (c.scales == Scales::kPerTokenFlat) return TensorView::of(data, DType::kFloat32, {rows}, d);
  return TensorView::of(data, DType::kFloat32, {rows, c.scale_cols()}, d);
}

// The flattened arguments the API would pass, for the token-major entry point.
switchyard::detail::GatherArgs gather_args(const GatherCase& c, const HostLayout& h, const void* x,
                                           const DeviceLayout& dl, const void* xs, void* xp, void* xps) {
  switchyard::detail::GatherArgs a;
  a.num_tokens = h.shape.T;
  a.hidden = c.H;
  a.dtype = c.dtype;
  a.x = x;
  a.x_row_stride = c.H + c.stride_pad;
  a.x_scales = static_cast<const float*>(xs);
  a.scale_cols = c.scale_cols();
  a.permuted_to_token = dl.p2t.as<const std::int32_t>();
  a.totals = dl.totals.as<const std::int32_t>();
  a.capacity_rows = h.R;
  a.x_perm = xp;
  a.x_perm_scales = static_cast<float*>(xps);
  a.zero_fill_padding = c.zero_fill;
  return a;
}

struct GatherData {
  std::vector<unsigned char> x;  // with base offset and row stride
  std::vector<float> scales;
};

GatherData make_gather_data(const GatherCase& c, std::uint64_t seed) {
  GatherData d;
  const std::size_t elem = switchyard::dtype_size(c.dtype);
  const std::int64_t stride = c.H + c.stride_pad;
  d.x.resize(
      static_cast<std::size_t>((c.base_offset + c.shape.T * stride) * static_cast<std::int64_t>(elem)));
  fill_random_bytes(d.x.data(), d.x.size(), seed);  // any bits: gather is a byte copy
  d.scales.resize(static_cast<std::size_t>(c.shape.T * c.scale_cols()));
  FastRng rng(seed ^ 0xabcdefull);
  for (float& s : d.scales) s = rng.uniform(0.001f, 1.0f);
  return d;
}

// CPU oracle output of a gather case on poisoned outputs.
struct GatherResult {
  std::vector<unsigned char> x_perm;
  std::vector<unsigned char> scales;
};

::testing::AssertionResult cpu_gather(const GatherCase& c, HostLayout& h, GatherData& d, GatherResult* r) {
  const std::size_t elem = switchyard::dtype_size(c.dtype);
  r->x_perm.assign(static_cast<std::size_t>(h.R * c.H) * elem, sy_test::kPoisonByte);
  r->scales.assign(static_cast<std::size_t>(h.R * c.scale_cols()) * sizeof(float), sy_test::kPoisonByte);
  const TensorView x = TensorView::of(d.x.data() + c.base_offset * elem, c.dtype, {c.shape.T, c.H})
                           .with_row_stride(c.H + c.stride_pad);
  const Status st = switchyard::gather(x, scale_view(c, d.scales.data(), c.shape.T, Device::cpu()), h.view(),
                                       TensorView::of(r->x_perm.data(), c.dtype, {h.R, c.H}),
                                       scale_view(c, r->scales.data(), h.R, Device::cpu()), c.zero_fill);
  if (!st.ok()) return ::testing::AssertionFailure() << "CPU gather failed: " << st.to_string();
  return ::testing::AssertionSuccess();
}

void run_gather_case(const GatherCase& c) {
  const std::uint64_t seed = sy_test::fresh_seed();
  SCOPED_TRACE(c.describe() + " seed=" + std::to_string(seed));
  HostLayout h;
  ASSERT_TRUE(make_host_layout(c.shape, seed, &h));
  GatherData d = make_gather_data(c, seed + 1);
  GatherResult expected;
  ASSERT_TRUE(cpu_gather(c, h, d, &expected));

  const std::size_t elem = switchyard::dtype_size(c.dtype);
  const Device dev = Device::cuda();
  DeviceLayout dl(h);
  DeviceBuffer x = upload_bytes(d.x.data(), d.x.size());
  DeviceBuffer xs = upload_bytes(d.scales.data(), d.scales.size() * sizeof(float));
  DeviceBuffer xp(expected.x_perm.size() + 16);
  DeviceBuffer xps(expected.scales.size() + 16);
  ASSERT_TRUE(dl.ok() && x.get() && xs.get() && xp.get() && xps.get()) << "cudaMalloc failed";
  const void* x_base = x.as<unsigned char>() + c.base_offset * elem;
  const TensorView x_view =
      TensorView::of(x_base, c.dtype, {c.shape.T, c.H}, dev).with_row_stride(c.H + c.stride_pad);

  // The API (row-order kernel).
  sy_test::poison(xp);
  sy_test::poison(xps);
  const Status st = switchyard::gather(x_view, scale_view(c, xs.get(), c.shape.T, dev), dl.layout,
                                       TensorView::of(xp.get(), c.dtype, {h.R, c.H}, dev),
                                       scale_view(c, xps.get(), h.R, dev), c.zero_fill);
  ASSERT_TRUE(st.ok()) << st.to_string();
  ASSERT_TRUE(cuda_clean("gather"));
  EXPECT_TRUE(same_bytes(expected.x_perm, download_bytes(xp.get(), expected.x_perm.size()), c.H * elem,
                         "gather x_perm"));
  EXPECT_TRUE(same_bytes(expected.scales, download_bytes(xps.get(), expected.scales.size()),
                         c.scale_cols() * sizeof(float), "gather x_perm_scales"));

  // The token-major kernel.
  sy_test::poison(xp);
  sy_test::poison(xps);
  const switchyard::detail::GatherArgs args =
      gather_args(c, h, x_base, dl, c.scales == Scales::kNone ? nullptr : xs.get(), xp.get(),
                  c.scales == Scales::kNone ? nullptr : xps.get());
  const Status st2 =
      switchyard::cuda::gather_token_major(args, dl.e2p.as<const std::int32_t>(), c.shape.K, nullptr);
  ASSERT_TRUE(st2.ok()) << st2.to_string();
  ASSERT_TRUE(cuda_clean("gather_token_major"));
  EXPECT_TRUE(same_bytes(expected.x_perm, download_bytes(xp.get(), expected.x_perm.size()), c.H * elem,
                         "token-major x_perm"));
  EXPECT_TRUE(same_bytes(expected.scales, download_bytes(xps.get(), expected.scales.size()),
                         c.scale_cols() * sizeof(float), "token-major x_perm_scales"));
}

const std::vector<std::int64_t> kHiddenSizes = {1, 7, 100, 300, 2048, 2880, 4096, 7168};
const std::vector<std::int64_t> kSmallTokenCounts = {1, 3, 19, 111, 989};
const std::vector<int> kTopKs = {1, 2, 8};

// Shrinks a sweep case whose buffers would exceed kSweepBytesCap.
void cap_shape(LayoutShape* s, std::int64_t row_bytes) {
  while (s->rows() * row_bytes > kSweepBytesCap && (s->K > 1 || s->tile > 1)) {
    if (s->tile > 1) {
      s->tile = 1;
    } else {
      s->K = std::max(1, s->K / 4);
    }
  }
}

TEST(PermuteCuda, GatherSweep) {
  SY_SKIP_WITHOUT_GPU();
  int i = 0;
  for (DType dtype : {DType::kBFloat16, DType::kFloat16, DType::kFloat32, DType::kFloat8E4M3}) {
    for (std::int64_t H : kHiddenSizes) {
      for (std::int64_t T : kSmallTokenCounts) {
        GatherCase c;
        c.dtype = dtype;
        c.H = H;
        c.shape.T = T;
        c.shape.K = kTopKs[i % 3];
        c.shape.skew = kSkews[(i / 3) % 3];
        c.shape.tile = (i / 2) % 2 ? 128 : 1;
        c.shape.subset = (i / 5) % 2 == 1;
        c.zero_fill = (i / 7) % 2 == 0;
        if (dtype == DType::kFloat8E4M3) {
          c.scales = static_cast<Scales>((i / 4) % 4);
        } else if (i % 11 == 0) {
          c.scales = Scales::kPerToken;  // scales are allowed with any dtype
        }
        // Every fourth case a padded row stride, every sixth a misaligned base: both force
        // the narrower vector paths even when the row itself is 16-byte aligned.
        c.stride_pad = i % 4 == 1 ? 8 + i % 3 : 0;
        c.base_offset = i % 6 == 5 ? 1 : 0;
        cap_shape(&c.shape, c.H * static_cast<std::int64_t>(switchyard::dtype_size(dtype)));
        run_gather_case(c);
        ++i;
      }
    }
  }
}

TEST(PermuteCuda, GatherLarge) {
  SY_SKIP_WITHOUT_GPU();
  int i = 0;
  for (std::int64_t H : {2048, 7168}) {
    for (DType dtype : {DType::kBFloat16, DType::kFloat8E4M3}) {
      GatherCase c;
      c.dtype = dtype;
      c.H = H;
      c.shape.T = 4096;
      c.shape.K = 8;
      c.shape.tile = 128;
      c.shape.skew = kSkews[i % 3];
      c.shape.subset = i % 2 == 1;
      c.zero_fill = i % 2 == 0;
      c.scales = dtype == DType::kFloat8E4M3 ? Scales::kPerGroup : Scales::kNone;
      run_gather_case(c);
      ++i;
    }
  }
}

// ---------------------------------------------------------------------------------------
// Combine.

enum class Weights { kNone, kFloat32, kBFloat16 };

const char* weights_name(Weights w) {
  return w == Weights::kNone ? "none" : (w == Weights::kFloat32 ? "fp32" : "bf16");
}

struct CombineCase {
  DType y_dtype = DType::kBFloat16;
  DType out_dtype = DType::kBFloat16;
  std::int64_t H = 1;
  LayoutShape shape;
  Weights weights = Weights::kFloat32;
  bool accumulate = false;
  std::int64_t stride_pad = 0;   // y row stride = H + stride_pad
  std::int64_t base_offset = 0;  // y starts this many elements into its allocation

  std::string describe() const {
    std::ostringstream s;
    s << "combine y=" << switchyard::dtype_name(y_dtype) << " out=" << switchyard::dtype_name(out_dtype)
      << " H=" << H << " T=" << shape.T << " K=" << shape.K << " tile=" << shape.tile
      << " skew=" << skew_name(shape.skew) << (shape.subset ? " local-subset" : "")
      << " weights=" << weights_name(weights) << " accumulate=" << accumulate << " stride=H+" << stride_pad
      << " base_offset=" << base_offset;
    return s.str();
  }
};

struct CombineData {
  std::vector<unsigned char> y;  // with base offset and row stride
  std::vector<unsigned char> weights;
  std::vector<unsigned char> out;  // initial output (read when accumulating)
};

CombineData make_combine_data(const CombineCase& c, std::int64_t R, std::uint64_t seed) {
  CombineData d;
  const std::int64_t stride = c.H + c.stride_pad;
  d.y = random_floats(c.y_dtype, static_cast<std::size_t>(c.base_offset + R * stride), seed);
  if (c.weights != Weights::kNone) {
    FastRng rng(seed ^ 0x77ull);
    const std::size_t n = static_cast<std::size_t>(c.shape.T * c.shape.K);
    std::vector<float> w(n);
    for (float& v : w) v = rng.uniform(0.0f, 1.0f);
    if (c.weights == Weights::kFloat32) {
      d.weights.resize(n * 4);
      std::memcpy(d.weights.data(), w.data(), n * 4);
    } else {
      d.weights.resize(n * 2);
      for (std::size_t i = 0; i < n; ++i) {
        const std::uint16_t b = switchyard::detail::float_to_bf16(w[i]);
        std::memcpy(d.weights.data() + 2 * i, &b, 2);
      }
    }
  }
  if (c.accumulate) {
    d.out = random_floats(c.out_dtype, static_cast<std::size_t>(c.shape.T * c.H), seed ^ 0x99ull);
  } else {
    d.out.assign(static_cast<std::size_t>(c.shape.T * c.H) * switchyard::dtype_size(c.out_dtype),
                 sy_test::kPoisonByte);
  }
  return d;
}

TensorView weights_view(const CombineCase& c, void* data, Device d) {
  if (c.weights == Weights::kNone) return TensorView{};
  return TensorView::of(data, c.weights == Weights::kFloat32 ? DType::kFloat32 : DType::kBFloat16,
                        {c.shape.T, c.shape.K}, d);
}

// Runs combine on the CPU and on the GPU with the same inputs; `gpu_out` gets the GPU output.
void run_combine_inputs(const CombineCase& c, HostLayout& h, CombineData& d,
                        std::vector<unsigned char>* cpu_out, std::vector<unsigned char>* gpu_out) {
  const std::size_t y_elem = switchyard::dtype_size(c.y_dtype);
  const std::size_t out_bytes = d.out.size();
  *cpu_out = d.out;
  const TensorView y_cpu = TensorView::of(d.y.data() + c.base_offset * y_elem, c.y_dtype, {h.R, c.H})
                               .with_row_stride(c.H + c.stride_pad);
  const Status st =
      switchyard::combine(y_cpu, h.view(), weights_view(c, d.weights.data(), Device::cpu()),
                          TensorView::of(cpu_out->data(), c.out_dtype, {c.shape.T, c.H}), c.accumulate);
  ASSERT_TRUE(st.ok()) << "CPU combine failed: " << st.to_string();

  const Device dev = Device::cuda();
  DeviceLayout dl(h);
  DeviceBuffer y = upload_bytes(d.y.data(), d.y.size());
  DeviceBuffer w = upload_bytes(d.weights.data(), d.weights.size());
  DeviceBuffer out = upload_bytes(d.out.data(), out_bytes);
  ASSERT_TRUE(dl.ok() && y.get() && w.get() && out.get()) << "cudaMalloc failed";
  const TensorView y_dev =
      TensorView::of(y.as<unsigned char>() + c.base_offset * y_elem, c.y_dtype, {h.R, c.H}, dev)
          .with_row_stride(c.H + c.stride_pad);
  const Status st2 =
      switchyard::combine(y_dev, dl.layout, weights_view(c, w.get(), dev),
                          TensorView::of(out.get(), c.out_dtype, {c.shape.T, c.H}, dev), c.accumulate);
  ASSERT_TRUE(st2.ok()) << st2.to_string();
  ASSERT_TRUE(cuda_clean("combine"));
  *gpu_out = download_bytes(out.get(), out_bytes);
}

void run_combine_case(const CombineCase& c) {
  const std::uint64_t seed = sy_test::fresh_seed();
  SCOPED_TRACE(c.describe() + " seed=" + std::to_string(seed));
  HostLayout h;
  ASSERT_TRUE(make_host_layout(c.shape, seed, &h));
  CombineData d = make_combine_data(c, h.R, seed + 1);
  std::vector<unsigned char> expected, actual;
  run_combine_inputs(c, h, d, &expected, &actual);
  if (::testing::Test::HasFatalFailure()) return;
  EXPECT_TRUE(same_bytes(expected, actual, c.H * switchyard::dtype_size(c.out_dtype), "combine out"));
}

TEST(PermuteCuda, CombineSweep) {
  SY_SKIP_WITHOUT_GPU();
  int i = 0;
  const DType kFloats[] = {DType::kBFloat16, DType::kFloat16, DType::kFloat32};
  for (DType y : kFloats) {
    for (DType out : kFloats) {
      for (std::int64_t H : kHiddenSizes) {
        // Two token counts per (y, out, H), rotating through the list.
        for (int j = 0; j < 2; ++j) {
          CombineCase c;
          c.y_dtype = y;
          c.out_dtype = out;
          c.H = H;
          c.shape.T = kSmallTokenCounts[(i + 2 * j) % kSmallTokenCounts.size()];
          c.shape.K = kTopKs[i % 3];
          c.shape.skew = kSkews[(i / 3) % 3];
          c.shape.tile = (i / 2) % 2 ? 128 : 1;
          c.shape.subset = (i / 5) % 2 == 1;
          c.weights = static_cast<Weights>((i / 7) % 3);
          c.accumulate = (i / 4) % 2 == 1;
          c.stride_pad = i % 4 == 3 ? 8 + i % 5 : 0;
          c.base_offset = i % 6 == 2 ? 1 : 0;
          cap_shape(&c.shape, c.H * static_cast<std::int64_t>(switchyard::dtype_size(y)));
          run_combine_case(c);
          ++i;
        }
      }
    }
  }
}

TEST(PermuteCuda, CombineLargeK) {
  // K beyond one batch of picks (8): the kernel walks the picks in several batches.
  SY_SKIP_WITHOUT_GPU();
  for (int K : {3, 5, 12, 20}) {
    CombineCase c;
    c.H = K % 2 ? 7168 : 100;
    c.shape.T = 111;
    c.shape.K = K;
    c.shape.tile = K % 3 ? 1 : 128;
    c.shape.subset = K > 10;
    c.weights = K % 2 ? Weights::kFloat32 : Weights::kBFloat16;
    c.accumulate = K > 4;
    run_combine_case(c);
  }
}

TEST(PermuteCuda, CombineLarge) {
  SY_SKIP_WITHOUT_GPU();
  int i = 0;
  for (std::int64_t H : {2048, 7168}) {
    for (int K : {2, 8}) {
      CombineCase c;
      c.H = H;
      c.shape.T = 4096;
      c.shape.K = K;
      c.shape.tile = 128;
      c.shape.skew = kSkews[i % 3];
      c.shape.subset = i == 3;
      c.weights = Weights::kFloat32;
      c.accumulate = i % 2 == 1;
      c.out_dtype = i == 2 ? DType::kFloat32 : DType::kBFloat16;
      run_combine_case(c);
      ++i;
    }
  }
}

// Every rounding path of the output casts: fp32 y holding arbitrary finite and infinite bit
// patterns (normal, subnormal, overflowing the 16-bit formats) summed with one pick of weight
// 1, so out = cast(y) exactly; and 16-bit y of arbitrary bits into fp32.
TEST(PermuteCuda, CombineConversions) {
  SY_SKIP_WITHOUT_GPU();
  const std::uint64_t seed = sy_test::fresh_seed();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  const std::int64_t T = 2048, H = 1024;
  LayoutShape s;
  s.T = T;
  s.K = 1;
  HostLayout h;
  ASSERT_TRUE(make_host_layout(s, seed, &h));
  for (DType y_dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (DType out_dtype : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
      SCOPED_TRACE(std::string("y=") + switchyard::dtype_name(y_dtype) +
                   " out=" + switchyard::dtype_name(out_dtype));
      CombineCase c;
      c.y_dtype = y_dtype;
      c.out_dtype = out_dtype;
      c.H = H;
      c.shape = s;
      c.weights = Weights::kNone;
      CombineData d;
      const std::size_t n = static_cast<std::size_t>(h.R * H);
      d.y.resize(n * switchyard::dtype_size(y_dtype));
      fill_random_bytes(d.y.data(), d.y.size(),
                        seed + static_cast<int>(y_dtype) * 7 + static_cast<int>(out_dtype));
      // Replace NaN patterns (whose payloads the two backends treat differently) by infinities.
      if (y_dtype == DType::kFloat32) {
        for (std::size_t i = 0; i < n; ++i) {
          std::uint32_t u;
          std::memcpy(&u, d.y.data() + 4 * i, 4);
          // Narrow most exponents to the 16-bit formats' ranges so that rounding, not overflow,
          // is what most values exercise.
          if (i % 4 != 0) u = (u & 0x807fffffu) | ((100u + (u >> 23) % 56u) << 23);
          if ((u & 0x7fffffffu) > 0x7f800000u) u = (u & 0x80000000u) | 0x7f800000u;
          std::memcpy(d.y.data() + 4 * i, &u, 4);
        }
      } else {
        const std::uint16_t exp_mask = y_dtype == DType::kBFloat16 ? 0x7f80 : 0x7c00;
        for (std::size_t i = 0; i < n; ++i) {
          std::uint16_t u;
          std::memcpy(&u, d.y.data() + 2 * i, 2);
          if ((u & exp_mask) == exp_mask) u = static_cast<std::uint16_t>((u & 0x8000u) | exp_mask);
          std::memcpy(d.y.data() + 2 * i, &u, 2);
        }
      }
      d.out.assign(static_cast<std::size_t>(T * H) * switchyard::dtype_size(out_dtype), sy_test::kPoisonByte);
      std::vector<unsigned char> expected, actual;
      run_combine_inputs(c, h, d, &expected, &actual);
      if (HasFatalFailure()) return;
      EXPECT_TRUE(same_bytes(expected, actual, H * switchyard::dtype_size(out_dtype), "combine out"));
    }
  }
}

// ---------------------------------------------------------------------------------------
// Run-to-run determinism and CUDA graphs.

TEST(PermuteCuda, Deterministic) {
  SY_SKIP_WITHOUT_GPU();
  const std::uint64_t seed = sy_test::fresh_seed();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  LayoutShape s;
  s.T = 989;
  s.K = 8;
  s.tile = 128;
  s.skew = Skew::kZipf;
  HostLayout h;
  ASSERT_TRUE(make_host_layout(s, seed, &h));
  const std::int64_t H = 4096;
  const Device dev = Device::cuda();
  DeviceLayout dl(h);
  const std::vector<unsigned char> y_host =
      random_floats(DType::kBFloat16, static_cast<std::size_t>(h.R * H), seed);
  std::vector<unsigned char> w_host(static_cast<std::size_t>(s.T * s.K) * 4);
  {
    FastRng rng(seed + 5);
    for (std::size_t i = 0; i < w_host.size() / 4; ++i) {
      const float f = rng.uniform(0.0f, 1.0f);
      std::memcpy(w_host.data() + 4 * i, &f, 4);
    }
  }
  DeviceBuffer y = upload_bytes(y_host.data(), y_host.size());
  DeviceBuffer w = upload_bytes(w_host.data(), w_host.size());
  DeviceBuffer out(static_cast<std::size_t>(s.T * H) * 2 + 16);
  DeviceBuffer xp(static_cast<std::size_t>(h.R * H) * 2 + 16);
  ASSERT_TRUE(dl.ok() && y.get() && w.get() && out.get() && xp.get());
  std::vector<unsigned char> first_out, first_xp;
  for (int run = 0; run < 3; ++run) {
    sy_test::poison(out);
    sy_test::poison(xp);
    // y doubles as gather input: its first T rows are x.
    ASSERT_TRUE(switchyard::gather(TensorView::of(y.get(), DType::kBFloat16, {s.T, H}, dev), TensorView{},
                                   dl.layout, TensorView::of(xp.get(), DType::kBFloat16, {h.R, H}, dev),
                                   TensorView{}, true)
                    .ok());
    ASSERT_TRUE(switchyard::combine(TensorView::of(y.get(), DType::kBFloat16, {h.R, H}, dev), dl.layout,
                                    TensorView::of(w.get(), DType::kFloat32, {s.T, s.K}, dev),
                                    TensorView::of(out.get(), DType::kBFloat16, {s.T, H}, dev))
                    .ok());
    ASSERT_TRUE(cuda_clean("gather + combine"));
    std::vector<unsigned char> o = download_bytes(out.get(), out.bytes());
    std::vector<unsigned char> x = download_bytes(xp.get(), xp.bytes());
    if (run == 0) {
      first_out = o;
      first_xp = x;
    } else {
      EXPECT_TRUE(same_bytes(first_out, o, H * 2, "combine run to run"));
      EXPECT_TRUE(same_bytes(first_xp, x, H * 2, "gather run to run"));
    }
  }
}

// Capture gather (both kernels) and combine in one CUDA graph, then replay it on new inputs
// written into the same buffers - new ids too, so padded_total changes and must be read from
// device memory - and check each replay against the CPU.
TEST(PermuteCuda, GraphCaptureReplayWithNewInputs) {
  SY_SKIP_WITHOUT_GPU();
  LayoutShape s;
  s.T = 300;
  s.K = 8;
  s.tile = 128;
  s.subset = true;
  const std::int64_t H = 2880;
  const Device dev = Device::cuda();
  std::uint64_t seed = sy_test::fresh_seed();
  SCOPED_TRACE("first seed=" + std::to_string(seed));
  HostLayout h;
  ASSERT_TRUE(make_host_layout(s, seed, &h));
  DeviceLayout dl(h);
  GatherCase gc;
  gc.dtype = DType::kFloat8E4M3;
  gc.H = H;
  gc.shape = s;
  gc.zero_fill = true;
  gc.scales = Scales::kPerGroup;
  CombineCase cc;
  cc.y_dtype = DType::kBFloat16;
  cc.out_dtype = DType::kBFloat16;
  cc.H = H;
  cc.shape = s;
  cc.weights = Weights::kFloat32;
  cc.accumulate = true;

  GatherData gd = make_gather_data(gc, seed + 1);
  CombineData cd = make_combine_data(cc, h.R, seed + 2);
  DeviceBuffer x = upload_bytes(gd.x.data(), gd.x.size());
  DeviceBuffer xs = upload_bytes(gd.scales.data(), gd.scales.size() * 4);
  DeviceBuffer xp(static_cast<std::size_t>(h.R * H) + 16);
  DeviceBuffer xps(static_cast<std::size_t>(h.R * gc.scale_cols()) * 4 + 16);
  DeviceBuffer xp2(static_cast<std::size_t>(h.R * H) + 16);
  DeviceBuffer xps2(static_cast<std::size_t>(h.R * gc.scale_cols()) * 4 + 16);
  DeviceBuffer y = upload_bytes(cd.y.data(), cd.y.size());
  DeviceBuffer w = upload_bytes(cd.weights.data(), cd.weights.size());
  DeviceBuffer out = upload_bytes(cd.out.data(), cd.out.size());
  ASSERT_TRUE(dl.ok() && x.get() && xs.get() && xp.get() && xps.get() && xp2.get() && xps2.get() && y.get() &&
              w.get() && out.get());

  sy_test::CapturedGraph graph;
  const cudaStream_t stream = graph.stream();
  SY_CUDA_OK(graph.begin());
  const Status g1 =
      switchyard::gather(TensorView::of(x.get(), gc.dtype, {s.T, H}, dev), scale_view(gc, xs.get(), s.T, dev),
                         dl.layout, TensorView::of(xp.get(), gc.dtype, {h.R, H}, dev),
                         scale_view(gc, xps.get(), h.R, dev), gc.zero_fill, stream);
  const Status g2 =
      switchyard::cuda::gather_token_major(gather_args(gc, h, x.get(), dl, xs.get(), xp2.get(), xps2.get()),
                                           dl.e2p.as<const std::int32_t>(), s.K, stream);
  const Status c1 = switchyard::combine(
      TensorView::of(y.get(), cc.y_dtype, {h.R, H}, dev), dl.layout, weights_view(cc, w.get(), dev),
      TensorView::of(out.get(), cc.out_dtype, {s.T, H}, dev), cc.accumulate, stream);
  const cudaError_t end = graph.end();
  ASSERT_TRUE(g1.ok()) << g1.to_string();
  ASSERT_TRUE(g2.ok()) << g2.to_string();
  ASSERT_TRUE(c1.ok()) << c1.to_string();
  SY_CUDA_OK(end);

  for (int replay = 0; replay < 3; ++replay) {
    if (replay > 0) {  // new ids, activations, weights and shared-expert output
      seed = sy_test::fresh_seed();
      SCOPED_TRACE("replay " + std::to_string(replay) + " seed=" + std::to_string(seed));
      ASSERT_TRUE(make_host_layout(s, seed, &h));
      dl.upload(h);
      gd = make_gather_data(gc, seed + 1);
      cd = make_combine_data(cc, h.R, seed + 2);
      SY_CUDA_OK(cudaMemcpy(x.get(), gd.x.data(), gd.x.size(), cudaMemcpyHostToDevice));
      SY_CUDA_OK(cudaMemcpy(xs.get(), gd.scales.data(), gd.scales.size() * 4, cudaMemcpyHostToDevice));
      SY_CUDA_OK(cudaMemcpy(y.get(), cd.y.data(), cd.y.size(), cudaMemcpyHostToDevice));
      SY_CUDA_OK(cudaMemcpy(w.get(), cd.weights.data(), cd.weights.size(), cudaMemcpyHostToDevice));
      SY_CUDA_OK(cudaMemcpy(out.get(), cd.out.data(), cd.out.size(), cudaMemcpyHostToDevice));
    }
    for (DeviceBuffer* b : {&xp, &xps, &xp2, &xps2}) sy_test::poison(*b);
    SY_CUDA_OK(cudaDeviceSynchronize());
    SY_CUDA_OK(graph.replay());
    ASSERT_TRUE(cuda_clean("graph replay"));

    GatherResult expected;
    ASSERT_TRUE(cpu_gather(gc, h, gd, &expected));
    EXPECT_TRUE(
        same_bytes(expected.x_perm, download_bytes(xp.get(), expected.x_perm.size()), H, "graph gather"));
    EXPECT_TRUE(same_bytes(expected.scales, download_bytes(xps.get(), expected.scales.size()),
                           gc.scale_cols() * 4, "graph gather scales"));
    EXPECT_TRUE(same_bytes(expected.x_perm, download_bytes(xp2.get(), expected.x_perm.size()), H,
                           "graph token-major"));
    EXPECT_TRUE(same_bytes(expected.scales, download_bytes(xps2.get(), expected.scales.size()),
                           gc.scale_cols() * 4, "graph token-major scales"));
    std::vector<unsigned char> expected_out = cd.out;
    const Status st =
        switchyard::combine(TensorView::of(cd.y.data(), cc.y_dtype, {h.R, H}), h.view(),
                            weights_view(cc, cd.weights.data(), Device::cpu()),
                            TensorView::of(expected_out.data(), cc.out_dtype, {s.T, H}), cc.accumulate);
    ASSERT_TRUE(st.ok()) << st.to_string();
    EXPECT_TRUE(same_bytes(expected_out, download_bytes(out.get(), cd.out.size()), H * 2, "graph combine"));
  }
}

// Zero tokens: both operations succeed and launch nothing.
TEST(PermuteCuda, EmptyInputs) {
  SY_SKIP_WITHOUT_GPU();
  const Device dev = Device::cuda();
  LayoutShape s;
  s.T = 0;
  s.K = 2;
  DeviceBuffer scratch(1024);
  void* p = scratch.get();
  Layout l;
  l.counts = TensorView::of(p, DType::kInt32, {kNumExperts}, dev);
  l.offsets = TensorView::of(p, DType::kInt32, {kNumExperts + 1}, dev);
  l.permuted_to_expanded = TensorView::of(p, DType::kInt32, {0}, dev);
  l.permuted_to_token = TensorView::of(p, DType::kInt32, {0}, dev);
  l.expanded_to_permuted = TensorView::of(p, DType::kInt32, {0, 2}, dev);
  l.tile_expert = TensorView::of(p, DType::kInt32, {0}, dev);
  l.tile_row_end = TensorView::of(p, DType::kInt32, {0}, dev);
  l.totals = TensorView::of(p, DType::kInt32, {switchyard::kNumTotals}, dev);
  const Status g = switchyard::gather(TensorView::of(p, DType::kBFloat16, {0, 64}, dev), TensorView{}, l,
                                      TensorView::of(p, DType::kBFloat16, {0, 64}, dev), TensorView{});
  EXPECT_TRUE(g.ok()) << g.to_string();
  const Status c = switchyard::combine(TensorView::of(p, DType::kBFloat16, {0, 64}, dev), l, TensorView{},
                                       TensorView::of(p, DType::kBFloat16, {0, 64}, dev));
  EXPECT_TRUE(c.ok()) << c.to_string();
  EXPECT_TRUE(cuda_clean("empty"));
}


// ---------------------------------------------------------------------------------------
// combine_backward: the GPU against the CPU oracle. grad_y_perm bit for bit (one product and
// one rounding per element, the padding rows 0, rows past the layout untouched); grad_weights
// within fp32 rounding of the sum of |products| (the kernel sums in a fixed tree, the CPU in
// column order), and the same bits on a second run.

struct BackwardCase {
  CombineCase c;  // y dtype (also grad_y_perm's), H, shape, weights, y stride
  DType grad_dtype = DType::kBFloat16;
  bool want_dy = true, want_dw = true;
};

void run_backward_case(const BackwardCase& b) {
  const CombineCase& c = b.c;
  const std::uint64_t seed = sy_test::fresh_seed();
  SCOPED_TRACE(c.describe() + " backward grad=" + switchyard::dtype_name(b.grad_dtype) + " dy=" +
               std::to_string(b.want_dy) + " dw=" + std::to_string(b.want_dw) + " seed=" + std::to_string(seed));
  HostLayout h;
  ASSERT_TRUE(make_host_layout(c.shape, seed, &h));
  CombineData d = make_combine_data(c, h.R, seed + 1);
  const std::int64_t T = c.shape.T, K = c.shape.K, H = c.H, R = h.R;
  const std::int64_t guard = 3;
  std::vector<unsigned char> grad = random_floats(b.grad_dtype, static_cast<std::size_t>(T * H), seed + 2);
  const std::size_t y_elem = switchyard::dtype_size(c.y_dtype);
  const std::size_t dy_bytes = static_cast<std::size_t>((R + guard) * H) * y_elem;
  const std::size_t dw_bytes = static_cast<std::size_t>(T * K + guard) * 4;
  std::vector<unsigned char> dy_cpu(dy_bytes, sy_test::kPoisonByte), dw_cpu(dw_bytes, sy_test::kPoisonByte);
  auto views = [&](void* g, void* y, void* w, void* dy, void* dw, Device dev) {
    const std::size_t off = static_cast<std::size_t>(c.base_offset) * y_elem;
    return std::make_tuple(
        TensorView::of(g, b.grad_dtype, {T, H}, dev),
        TensorView::of(static_cast<unsigned char*>(y) + off, c.y_dtype, {R, H}, dev).with_row_stride(H + c.stride_pad),
        weights_view(c, w, dev), b.want_dy ? TensorView::of(dy, c.y_dtype, {R, H}, dev) : TensorView{},
        b.want_dw ? TensorView::of(dw, DType::kFloat32, {T, K}, dev) : TensorView{});
  };
  {
    auto [g, y, w, dy, dw] = views(grad.data(), d.y.data(), d.weights.data(), dy_cpu.data(), dw_cpu.data(),
                                   Device::cpu());
    const Status st = switchyard::combine_backward(g, y, h.view(), w, dy, dw);
    ASSERT_TRUE(st.ok()) << "CPU combine_backward: " << st.to_string();
  }
  DeviceLayout dl(h);
  DeviceBuffer g_dev = upload_bytes(grad.data(), grad.size());
  DeviceBuffer y_dev = upload_bytes(d.y.data(), d.y.size());
  DeviceBuffer w_dev = upload_bytes(d.weights.data(), d.weights.size());
  std::vector<unsigned char> poison_dy(dy_bytes, sy_test::kPoisonByte), poison_dw(dw_bytes, sy_test::kPoisonByte);
  DeviceBuffer dy_dev = upload_bytes(poison_dy.data(), dy_bytes);
  DeviceBuffer dw_dev = upload_bytes(poison_dw.data(), dw_bytes);
  ASSERT_TRUE(dl.ok() && g_dev.get() && y_dev.get() && w_dev.get() && dy_dev.get() && dw_dev.get());
  std::vector<unsigned char> dw_first;
  for (int run = 0; run < 2; ++run) {
    auto [g, y, w, dy, dw] = views(g_dev.get(), y_dev.get(), w_dev.get(), dy_dev.get(), dw_dev.get(), Device::cuda());
    const Status st = switchyard::combine_backward(g, y, dl.layout, w, dy, dw);
    ASSERT_TRUE(st.ok()) << st.to_string();
    ASSERT_TRUE(cuda_clean("combine_backward"));
    const std::vector<unsigned char> dw_gpu = download_bytes(dw_dev.get(), dw_bytes);
    if (run == 1) {
      EXPECT_TRUE(same_bytes(dw_first, dw_gpu, 4 * K, "grad_weights, second run"));
      break;
    }
    dw_first = dw_gpu;
    EXPECT_TRUE(same_bytes(dy_cpu, download_bytes(dy_dev.get(), dy_bytes), H * y_elem, "grad_y_perm"));
    int failures = 0;
    for (std::int64_t i = 0; i < T * K + guard && failures < 5; ++i) {
      float got, want;
      std::memcpy(&got, dw_gpu.data() + 4 * i, 4);
      std::memcpy(&want, dw_cpu.data() + 4 * i, 4);
      const std::int32_t r = i < T * K ? h.e2p[i] : -1;
      double magnitude = 0.0;
      if (b.want_dw && r >= 0 && r < R) {
        for (std::int64_t col = 0; col < H; ++col) {
          const float gv = sy_test::load_as_float(b.grad_dtype, grad.data(), (i / K) * H + col);
          const float yv = sy_test::load_as_float(
              c.y_dtype, d.y.data() + static_cast<std::size_t>(c.base_offset) * y_elem, r * (H + c.stride_pad) + col);
          magnitude += std::fabs(static_cast<double>(gv) * yv);
        }
      }
      const bool exact = std::memcmp(&got, &want, 4) == 0;
      if (!exact && !(std::fabs(static_cast<double>(got) - want) <= 1e-6 * magnitude)) {
        ADD_FAILURE() << "grad_weights[" << i / K << "," << i % K << "]: gpu " << got << ", cpu " << want
                      << " (sum of |products| " << magnitude << (i >= T * K ? "; guard: untouched" : "") << ")";
        ++failures;
      }
    }
  }
}

TEST(PermuteCuda, CombineBackwardSweep) {
  SY_SKIP_WITHOUT_GPU();
  int i = 0;
  const DType kFloats[] = {DType::kBFloat16, DType::kFloat16, DType::kFloat32};
  for (DType y : kFloats) {
    for (DType g : kFloats) {
      for (std::int64_t H : kHiddenSizes) {
        BackwardCase b;
        b.c.y_dtype = y;
        b.grad_dtype = g;
        b.c.H = H;
        b.c.shape.T = kSmallTokenCounts[i % kSmallTokenCounts.size()];
        b.c.shape.K = kTopKs[i % 3];
        b.c.shape.skew = kSkews[(i / 3) % 3];
        b.c.shape.tile = (i / 2) % 2 ? 128 : 1;
        b.c.shape.subset = (i / 5) % 2 == 1;
        b.c.weights = static_cast<Weights>((i / 7) % 3);
        b.c.stride_pad = i % 4 == 3 ? 8 + i % 5 : 0;
        b.c.base_offset = i % 6 == 2 ? 1 : 0;
        b.want_dy = i % 5 != 1;
        b.want_dw = i % 5 != 3;
        cap_shape(&b.c.shape, H * static_cast<std::int64_t>(switchyard::dtype_size(y)));
        run_backward_case(b);
        ++i;
      }
    }
  }
  for (int K : {12, 20}) {  // picks beyond one pass of the kernel's registers (8)
    BackwardCase b;
    b.c.H = K == 12 ? 7168 : 100;
    b.c.shape.T = 111;
    b.c.shape.K = K;
    b.c.shape.tile = 128;
    b.c.shape.subset = true;
    run_backward_case(b);
  }
}

}  // namespace
