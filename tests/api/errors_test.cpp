// Argument errors of the public API (docs/design.md section 5): each bad input returns a non-ok
// Status of the right code whose message names the bad argument, and nothing is written (every
// output buffer is poisoned before the call and compared after it).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "common/test_data.h"
#include "switchyard/switchyard.h"

namespace {

using switchyard::Device;
using switchyard::DType;
using switchyard::GroupRule;
using switchyard::Layout;
using switchyard::LayoutConfig;
using switchyard::LocalExperts;
using switchyard::PostFn;
using switchyard::PreFn;
using switchyard::RoutingConfig;
using switchyard::Status;
using switchyard::StatusCode;
using switchyard::TensorView;

constexpr StatusCode kInvalid = StatusCode::kInvalidArgument;

// The status has `code` and its message names `arg` the way the API quotes it: 'arg'.
::testing::AssertionResult IsError(const Status& s, StatusCode code, const std::string& arg) {
  if (s.code() != code) {
    return ::testing::AssertionFailure()
           << "code " << switchyard::status_code_name(s.code()) << ", expected "
           << switchyard::status_code_name(code) << " (" << s.to_string() << ")";
  }
  if (!arg.empty() && s.message().find("'" + arg + "'") == std::string::npos) {
    return ::testing::AssertionFailure() << "message does not name '" << arg << "': " << s.message();
  }
  return ::testing::AssertionSuccess();
}

// A buffer filled with the poison byte; intact() says whether any byte changed. Sized with
// slack so that a call that wrongly passes validation writes into poison, not past the end.
class Poisoned {
 public:
  explicit Poisoned(std::int64_t bytes) : words_(static_cast<std::size_t>(bytes) / 8 + 8) {
    std::memset(words_.data(), sy_test::kPoisonByte, words_.size() * 8);
  }
  void* data() { return words_.data(); }
  void* offset(std::size_t bytes) { return reinterpret_cast<char*>(words_.data()) + bytes; }
  bool intact() const {
    const auto* b = reinterpret_cast<const std::uint8_t*>(words_.data());
    for (std::size_t i = 0; i < words_.size() * 8; ++i)
      if (b[i] != sy_test::kPoisonByte) return false;
    return true;
  }

 private:
  std::vector<std::uint64_t> words_;
};

TensorView with_strides(TensorView t, std::int64_t s0, std::int64_t s1 = 0) {
  t.strides[0] = s0;
  if (t.ndim > 1) t.strides[1] = s1;
  return t;
}
TensorView on(TensorView t, Device d) {
  t.device = d;
  return t;
}
TensorView shifted(TensorView t, std::size_t bytes) {
  t.data = static_cast<char*>(t.data) + bytes;
  return t;
}
TensorView null_data(TensorView t) {
  t.data = nullptr;
  return t;
}
TensorView as_dtype(TensorView t, DType d) {
  t.dtype = d;
  return t;
}
TensorView reshaped(const TensorView& t, std::initializer_list<std::int64_t> shape) {
  return TensorView::of(t.data, t.dtype, shape, t.device);
}

template <typename Fixture>
struct Bad {
  const char* what;
  std::function<void(Fixture&)> mutate;
  std::string arg;  // the argument the message must name
  StatusCode code = kInvalid;
};

template <typename Fixture>
void expect_all_rejected(const std::vector<Bad<Fixture>>& cases) {
  for (const Bad<Fixture>& c : cases) {
    SCOPED_TRACE(c.what);
    Fixture f;
    c.mutate(f);
    const Status s = f.run();
    EXPECT_TRUE(IsError(s, c.code, c.arg));
    EXPECT_TRUE(f.untouched()) << "an output was written although the call failed";
  }
}

// Everything on one device; used to put a whole call on a CUDA device.
template <typename Fixture>
void move_all(Fixture& f, Device d);

// ---------------------------------------------------------------------------------------------
// route

struct RouteFixture {
  static constexpr int T = 19, E = 16, K = 4;
  RoutingConfig cfg;
  std::vector<float> logits = sy_test::random_normal(T * (2 * E + 8), sy_test::fresh_seed());
  std::vector<float> bias = sy_test::random_normal(2 * E + 8, sy_test::fresh_seed());
  Poisoned ids{T * (2 * K + 8) * 8}, weights{T * (2 * K + 8) * 8};
  TensorView logits_v, bias_v, ids_v, weights_v;

  RouteFixture() {
    cfg.num_experts = E;
    cfg.top_k = K;
    cfg.pre = PreFn::kSigmoid;
    cfg.post = PostFn::kNormalize;
    logits_v = TensorView::of(logits.data(), DType::kFloat32, {T, E});
    bias_v = TensorView::of(bias.data(), DType::kFloat32, {E});
    ids_v = TensorView::of(ids.data(), DType::kInt32, {T, K});
    weights_v = TensorView::of(weights.data(), DType::kFloat32, {T, K});
  }
  void set_k(int k) {
    cfg.top_k = k;
    ids_v = reshaped(ids_v, {T, k});
    weights_v = reshaped(weights_v, {T, k});
  }
  Status run() { return switchyard::route(cfg, logits_v, bias_v, ids_v, weights_v); }
  bool untouched() const { return ids.intact() && weights.intact(); }
};

template <>
void move_all(RouteFixture& f, Device d) {
  f.logits_v.device = f.bias_v.device = f.ids_v.device = f.weights_v.device = d;
}

// Bad routing configurations, applied to any fixture with a `cfg` and set_k.
template <typename Fixture>
std::vector<Bad<Fixture>> bad_routing_configs() {
  using F = Fixture;
  // Stored in std::function objects that outlive this call: capture by value.
  const auto groups = [](F& f, GroupRule rule, int n_group, int topk_group) {
    f.cfg.group_rule = rule;
    f.cfg.n_group = n_group;
    f.cfg.topk_group = topk_group;
  };
  return {
      {"K > E", [](F& f) { f.set_k(F::E + 1); }, "config.top_k"},
      {"K = 0", [](F& f) { f.set_k(0); }, "config.top_k"},
      {"K < 0", [](F& f) { f.cfg.top_k = -3; }, "config.top_k"},
      {"E = 0", [](F& f) { f.cfg.num_experts = 0; }, "config.num_experts"},
      {"E % n_group != 0", [groups](F& f) { groups(f, GroupRule::kTop2Sum, 3, 1); }, "config.n_group"},
      {"n_group = 0", [groups](F& f) { groups(f, GroupRule::kMax, 0, 1); }, "config.n_group"},
      {"topk_group > n_group", [groups](F& f) { groups(f, GroupRule::kTop2Sum, 4, 5); }, "config.topk_group"},
      {"topk_group = 0", [groups](F& f) { groups(f, GroupRule::kMax, 4, 0); }, "config.topk_group"},
      // groups of 2 experts, one kept: 2 < K = 4
      {"topk_group * (E / n_group) < K", [groups](F& f) { groups(f, GroupRule::kTop2Sum, 8, 1); },
       "config.topk_group"},
      // topk_sum needs K / topk_group >= 1
      {"topk_sum with K / topk_group = 0", [groups](F& f) { groups(f, GroupRule::kTopKSum, 8, 8); },
       "config.topk_group"},
      {"scale NaN", [](F& f) { f.cfg.scale = std::numeric_limits<float>::quiet_NaN(); }, "config.scale"},
      {"scale inf", [](F& f) { f.cfg.scale = std::numeric_limits<float>::infinity(); }, "config.scale"},
      {"unknown pre", [](F& f) { f.cfg.pre = static_cast<PreFn>(7); }, "config.pre"},
      {"unknown post", [](F& f) { f.cfg.post = static_cast<PostFn>(-1); }, "config.post"},
      {"unknown group rule", [](F& f) { f.cfg.group_rule = static_cast<GroupRule>(4); }, "config.group_rule"},
  };
}

TEST(ApiErrors, RouteValidFixtureIsAccepted) {
  RouteFixture f;
  const Status s = f.run();
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_FALSE(f.ids.intact());
}

TEST(ApiErrors, RouteBadConfig) { expect_all_rejected(bad_routing_configs<RouteFixture>()); }

TEST(ApiErrors, RouteBadTensors) {
  using F = RouteFixture;
  const int T = F::T, E = F::E, K = F::K;
  expect_all_rejected<F>({
      // null pointers with T > 0
      {"null logits", [](F& f) { f.logits_v = null_data(f.logits_v); }, "logits"},
      {"null bias", [](F& f) { f.bias_v = null_data(f.bias_v); }, "bias"},
      {"null topk_ids", [](F& f) { f.ids_v = null_data(f.ids_v); }, "topk_ids"},
      {"null topk_weights", [](F& f) { f.weights_v = null_data(f.weights_v); }, "topk_weights"},
      {"absent logits", [](F& f) { f.logits_v = TensorView{}; }, "logits"},
      {"absent topk_ids", [](F& f) { f.ids_v = TensorView{}; }, "topk_ids"},
      // unsupported dtypes
      {"int32 logits", [](F& f) { f.logits_v = as_dtype(f.logits_v, DType::kInt32); }, "logits"},
      {"fp8 logits", [](F& f) { f.logits_v = as_dtype(f.logits_v, DType::kFloat8E4M3); }, "logits"},
      {"out-of-enum logits dtype", [](F& f) { f.logits_v = as_dtype(f.logits_v, static_cast<DType>(42)); },
       "logits"},
      {"fp16 bias", [](F& f) { f.bias_v = as_dtype(f.bias_v, DType::kFloat16); }, "bias"},
      {"int64 bias", [](F& f) { f.bias_v = as_dtype(f.bias_v, DType::kInt64); }, "bias"},
      {"fp32 topk_ids", [](F& f) { f.ids_v = as_dtype(f.ids_v, DType::kFloat32); }, "topk_ids"},
      {"fp16 topk_weights", [](F& f) { f.weights_v = as_dtype(f.weights_v, DType::kFloat16); },
       "topk_weights"},
      {"int32 topk_weights", [](F& f) { f.weights_v = as_dtype(f.weights_v, DType::kInt32); },
       "topk_weights"},
      // wrong shapes
      {"logits [T, E+1]",
       [=](F& f) {
         f.logits_v = reshaped(f.logits_v, {T, E + 1});
       },
       "logits"},
      {"logits [T*E]", [=](F& f) { f.logits_v = reshaped(f.logits_v, {T * E}); }, "logits"},
      {"logits [1, T, E]",
       [=](F& f) {
         f.logits_v = reshaped(f.logits_v, {1, T, E});
       },
       "logits"},
      {"logits [-1, E]",
       [=](F& f) {
         f.logits_v = reshaped(f.logits_v, {-1, E});
       },
       "logits"},
      {"logits ndim 5",
       [](F& f) {
         f.logits_v.ndim = 5;  // past kMaxDims: must be rejected without reading past shape[3]
       },
       "logits"},
      {"bias [E-1]", [=](F& f) { f.bias_v = reshaped(f.bias_v, {E - 1}); }, "bias"},
      {"bias [1, E]",
       [=](F& f) {
         f.bias_v = reshaped(f.bias_v, {1, E});
       },
       "bias"},
      {"topk_ids [T, K+1]",
       [=](F& f) {
         f.ids_v = reshaped(f.ids_v, {T, K + 1});
       },
       "topk_ids"},
      {"topk_ids [T-1, K]",
       [=](F& f) {
         f.ids_v = reshaped(f.ids_v, {T - 1, K});
       },
       "topk_ids"},
      {"topk_ids [T*K]", [=](F& f) { f.ids_v = reshaped(f.ids_v, {T * K}); }, "topk_ids"},
      {"topk_weights [T, K-1]",
       [=](F& f) {
         f.weights_v = reshaped(f.weights_v, {T, K - 1});
       },
       "topk_weights"},
      {"topk_weights [T+1, K]",
       [=](F& f) {
         f.weights_v = reshaped(f.weights_v, {T + 1, K});
       },
       "topk_weights"},
      // layouts
      {"logits row stride < E", [=](F& f) { f.logits_v = with_strides(f.logits_v, E - 1, 1); }, "logits"},
      {"logits last dim strided", [=](F& f) { f.logits_v = with_strides(f.logits_v, 2 * E, 2); }, "logits"},
      {"non-contiguous topk_ids", [=](F& f) { f.ids_v = with_strides(f.ids_v, K + 1, 1); }, "topk_ids"},
      {"column-major topk_weights", [=](F& f) { f.weights_v = with_strides(f.weights_v, 1, T); },
       "topk_weights"},
      // misaligned pointers
      {"logits + 2 bytes", [](F& f) { f.logits_v = shifted(f.logits_v, 2); }, "logits"},
      {"bias + 1 byte", [](F& f) { f.bias_v = shifted(f.bias_v, 1); }, "bias"},
      {"topk_ids + 2 bytes", [](F& f) { f.ids_v = shifted(f.ids_v, 2); }, "topk_ids"},
      {"int64 topk_ids + 4 bytes", [](F& f) { f.ids_v = shifted(as_dtype(f.ids_v, DType::kInt64), 4); },
       "topk_ids"},
      {"topk_weights + 2 bytes", [](F& f) { f.weights_v = shifted(f.weights_v, 2); }, "topk_weights"},
      // mismatched devices (rejected by validation in every build)
      {"bias on cuda:0", [](F& f) { f.bias_v = on(f.bias_v, Device::cuda(0)); }, "bias"},
      {"topk_ids on cuda:0", [](F& f) { f.ids_v = on(f.ids_v, Device::cuda(0)); }, "topk_ids"},
      {"topk_weights on cuda:1, rest on cuda:0",
       [](F& f) {
         move_all(f, Device::cuda(0));
         f.weights_v.device = Device::cuda(1);
       },
       "topk_weights"},
      // backend limits, checked before any device is touched
      {"K > 32 on CUDA",
       [](F& f) {
         f.cfg.num_experts = 64;
         f.logits_v = reshaped(f.logits_v, {2, 64});
         f.ids_v = reshaped(f.ids_v, {2, 40});
         f.weights_v = reshaped(f.weights_v, {2, 40});
         f.bias_v = TensorView{};
         f.cfg.top_k = 40;
         move_all(f, Device::cuda(0));
       },
       "config.top_k"},
      {"E > 4096 on CUDA",
       [](F& f) {
         f.cfg.num_experts = 5000;
         f.logits_v = reshaped(f.logits_v, {0, 5000});
         f.ids_v = reshaped(f.ids_v, {0, K});
         f.weights_v = reshaped(f.weights_v, {0, K});
         f.bias_v = TensorView{};
         move_all(f, Device::cuda(0));
       },
       "config.num_experts"},
      {"T * K >= 2^31",
       [=](F& f) {
         const std::int64_t huge = std::int64_t{1} << 30;
         f.logits_v = reshaped(f.logits_v, {huge, E});
         f.ids_v = reshaped(f.ids_v, {huge, K});
         f.weights_v = reshaped(f.weights_v, {huge, K});
       },
       "logits"},
  });
}

TEST(ApiErrors, RouteOnCudaWithoutCudaBuildIsUnsupported) {
  if (switchyard::built_with_cuda()) GTEST_SKIP() << "this build has the CUDA backend";
  RouteFixture f;
  move_all(f, Device::cuda(0));
  const Status s = f.run();
  EXPECT_TRUE(IsError(s, StatusCode::kUnsupported, ""));
  EXPECT_NE(s.message().find("CUDA"), std::string::npos) << s.message();
  EXPECT_TRUE(f.untouched());
}

// validate(RoutingConfig) alone: nothing to poison.
struct RoutingConfigOnly {
  static constexpr int E = 16;
  RoutingConfig cfg;
  RoutingConfigOnly() {
    cfg.num_experts = E;
    cfg.top_k = 4;
  }
  void set_k(int k) { cfg.top_k = k; }
  Status run() { return switchyard::validate(cfg); }
  bool untouched() const { return true; }
};

TEST(ApiErrors, ValidateRoutingConfig) {
  using Cfg = RoutingConfigOnly;
  ASSERT_TRUE(Cfg().run().ok());
  expect_all_rejected(bad_routing_configs<Cfg>());
  // The group fields are only checked when a group rule is used.
  Cfg c;
  c.cfg.n_group = 3;
  c.cfg.topk_group = 0;
  EXPECT_TRUE(c.run().ok());
}

// ---------------------------------------------------------------------------------------------
// layout

struct LayoutFixture {
  static constexpr int T = 19, K = 4, E = 16, M = 8;
  static constexpr int L = E;
  LayoutConfig cfg;
  std::vector<std::int64_t> ids64 = sy_test::random_ids(T, K, E, sy_test::Skew::kZipf, sy_test::fresh_seed());
  std::vector<std::int32_t> ids = std::vector<std::int32_t>(ids64.begin(), ids64.end());
  std::vector<std::int32_t> expert_map = std::vector<std::int32_t>(E + 8, 0);
  const std::int64_t R = switchyard::max_permuted_rows(T, K, L, M);
  const std::int64_t N = switchyard::max_tiles(T, K, L, M);
  Poisoned counts{(L + 8) * 4}, offsets{(L + 8) * 4}, p2e{(R + 8) * 4}, p2t{(R + 8) * 4},
      e2p{(T * K + 64) * 4}, tile_expert{(N + 8) * 4}, tile_row_end{(N + 8) * 4}, totals{64};
  Poisoned workspace_buf{256};
  Layout out;
  TensorView ids_v;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;

  LayoutFixture() {
    cfg.num_experts = E;
    cfg.tile_size = M;
    for (int e = 0; e < E; ++e) expert_map[e] = e;
    ids_v = TensorView::of(ids.data(), DType::kInt32, {T, K});
    out.counts = TensorView::of(counts.data(), DType::kInt32, {L});
    out.offsets = TensorView::of(offsets.data(), DType::kInt32, {L + 1});
    out.permuted_to_expanded = TensorView::of(p2e.data(), DType::kInt32, {R});
    out.permuted_to_token = TensorView::of(p2t.data(), DType::kInt32, {R});
    out.expanded_to_permuted = TensorView::of(e2p.data(), DType::kInt32, {T, K});
    out.tile_expert = TensorView::of(tile_expert.data(), DType::kInt32, {N});
    out.tile_row_end = TensorView::of(tile_row_end.data(), DType::kInt32, {N});
    out.totals = TensorView::of(totals.data(), DType::kInt32, {switchyard::kNumTotals});
  }
  TensorView map_view(std::int64_t len) { return TensorView::of(expert_map.data(), DType::kInt32, {len}); }
  Status run() { return switchyard::layout(cfg, ids_v, out, workspace, workspace_bytes); }
  bool untouched() const {
    return counts.intact() && offsets.intact() && p2e.intact() && p2t.intact() && e2p.intact() &&
           tile_expert.intact() && tile_row_end.intact() && totals.intact() && workspace_buf.intact();
  }
};

void move_out(Layout& out, Device d) {
  for (TensorView* t : {&out.counts, &out.offsets, &out.permuted_to_expanded, &out.permuted_to_token,
                        &out.expanded_to_permuted, &out.tile_expert, &out.tile_row_end, &out.totals})
    t->device = d;
}

template <>
void move_all(LayoutFixture& f, Device d) {
  f.ids_v.device = d;
  move_out(f.out, d);
}

// Bad layout configurations, for any fixture with a LayoutConfig `cfg` and `map_view`.
template <typename Fixture>
std::vector<Bad<Fixture>> bad_layout_configs() {
  using F = Fixture;
  return {
      {"tile 0", [](F& f) { f.cfg.tile_size = 0; }, "config.tile_size"},
      {"tile -3", [](F& f) { f.cfg.tile_size = -3; }, "config.tile_size"},
      {"E = 0", [](F& f) { f.cfg.num_experts = 0; }, "config.num_experts"},
      {"range past E", [](F& f) { f.cfg.local = LocalExperts::range(10, 8); }, "config.local.count"},
      {"strided range past E", [](F& f) { f.cfg.local = LocalExperts::range(1, 6, 3); },
       "config.local.count"},
      {"range start < 0", [](F& f) { f.cfg.local = LocalExperts::range(-1, 4); }, "config.local.start"},
      {"range start = E", [](F& f) { f.cfg.local = LocalExperts::range(F::E, 1); }, "config.local.start"},
      {"range stride 0", [](F& f) { f.cfg.local = LocalExperts::range(0, 4, 0); }, "config.local.stride"},
      {"all experts with start 2",
       [](F& f) {
         f.cfg.local = LocalExperts::all();
         f.cfg.local.start = 2;
       },
       "config.local.count"},
      {"map with L = -1", [](F& f) { f.cfg.local = LocalExperts::map(f.map_view(F::E), -1); },
       "config.local.count"},
  };
}

TEST(ApiErrors, LayoutValidFixtureIsAccepted) {
  LayoutFixture f;
  const Status s = f.run();
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_FALSE(f.totals.intact());
}

TEST(ApiErrors, LayoutBadConfig) { expect_all_rejected(bad_layout_configs<LayoutFixture>()); }

TEST(ApiErrors, LayoutBadTensors) {
  using F = LayoutFixture;
  const int T = F::T, K = F::K, E = F::E, L = F::L;
  const std::int64_t R = switchyard::max_permuted_rows(T, K, L, F::M);
  const std::int64_t N = switchyard::max_tiles(T, K, L, F::M);
  std::vector<Bad<F>> cases = {
      {"null topk_ids", [](F& f) { f.ids_v = null_data(f.ids_v); }, "topk_ids"},
      {"fp32 topk_ids", [](F& f) { f.ids_v = as_dtype(f.ids_v, DType::kFloat32); }, "topk_ids"},
      {"topk_ids [T*K]", [=](F& f) { f.ids_v = reshaped(f.ids_v, {T * K}); }, "topk_ids"},
      {"topk_ids [T, 0]",
       [=](F& f) {
         f.ids_v = reshaped(f.ids_v, {T, 0});
       },
       "topk_ids"},
      {"non-contiguous topk_ids", [=](F& f) { f.ids_v = with_strides(f.ids_v, K + 1, 1); }, "topk_ids"},
      {"int64 topk_ids + 4 bytes", [](F& f) { f.ids_v = shifted(as_dtype(f.ids_v, DType::kInt64), 4); },
       "topk_ids"},
      {"T * K >= 2^31",
       [=](F& f) {
         const std::int64_t huge = std::int64_t{1} << 30;
         f.ids_v = reshaped(f.ids_v, {huge, 2});
       },
       "topk_ids"},
      // outputs smaller than their size queries
      {"counts of L-1", [=](F& f) { f.out.counts = reshaped(f.out.counts, {L - 1}); }, "out.counts"},
      {"offsets of L", [=](F& f) { f.out.offsets = reshaped(f.out.offsets, {L}); }, "out.offsets"},
      {"permuted_to_expanded of R-1",
       [=](F& f) { f.out.permuted_to_expanded = reshaped(f.out.permuted_to_expanded, {R - 1}); },
       "out.permuted_to_expanded"},
      {"permuted_to_token of R-1",
       [=](F& f) { f.out.permuted_to_token = reshaped(f.out.permuted_to_token, {R - 1}); },
       "out.permuted_to_token"},
      {"expanded_to_permuted [T, K-1]",
       [=](F& f) {
         f.out.expanded_to_permuted = reshaped(f.out.expanded_to_permuted, {T, K - 1});
       },
       "out.expanded_to_permuted"},
      {"expanded_to_permuted [T*K]",
       [=](F& f) { f.out.expanded_to_permuted = reshaped(f.out.expanded_to_permuted, {T * K}); },
       "out.expanded_to_permuted"},
      {"tile_expert of N-1", [=](F& f) { f.out.tile_expert = reshaped(f.out.tile_expert, {N - 1}); },
       "out.tile_expert"},
      {"tile_row_end of N-1", [=](F& f) { f.out.tile_row_end = reshaped(f.out.tile_row_end, {N - 1}); },
       "out.tile_row_end"},
      {"totals of 2", [](F& f) { f.out.totals = reshaped(f.out.totals, {2}); }, "out.totals"},
      {"tile_expert 2-D",
       [=](F& f) {
         f.out.tile_expert = reshaped(f.out.tile_expert, {1, N});
       },
       "out.tile_expert"},
      // dtypes
      {"int64 counts", [](F& f) { f.out.counts = as_dtype(f.out.counts, DType::kInt64); }, "out.counts"},
      {"fp32 totals", [](F& f) { f.out.totals = as_dtype(f.out.totals, DType::kFloat32); }, "out.totals"},
      // non-contiguous outputs
      {"strided permuted_to_token",
       [](F& f) { f.out.permuted_to_token = with_strides(f.out.permuted_to_token, 2); },
       "out.permuted_to_token"},
      {"expanded_to_permuted row stride K+1",
       [=](F& f) { f.out.expanded_to_permuted = with_strides(f.out.expanded_to_permuted, K + 1, 1); },
       "out.expanded_to_permuted"},
      // misaligned
      {"offsets + 2 bytes", [](F& f) { f.out.offsets = shifted(f.out.offsets, 2); }, "out.offsets"},
      {"tile_row_end + 1 byte", [](F& f) { f.out.tile_row_end = shifted(f.out.tile_row_end, 1); },
       "out.tile_row_end"},
      {"workspace + 1 byte",
       [](F& f) {
         f.workspace = f.workspace_buf.offset(1);
         f.workspace_bytes = 64;
       },
       "workspace"},
      // devices
      {"counts on cuda:0", [](F& f) { f.out.counts = on(f.out.counts, Device::cuda(0)); }, "out.counts"},
      {"topk_ids on cuda:0, outputs on cpu", [](F& f) { f.ids_v = on(f.ids_v, Device::cuda(0)); },
       "out.counts"},
      {"totals on cuda:1, rest on cuda:0",
       [](F& f) {
         move_all(f, Device::cuda(0));
         f.out.totals.device = Device::cuda(1);
       },
       "out.totals"},
  };
  // Each output array null in turn.
  const std::vector<std::pair<const char*, TensorView Layout::*>> arrays = {
      {"out.counts", &Layout::counts},
      {"out.offsets", &Layout::offsets},
      {"out.permuted_to_expanded", &Layout::permuted_to_expanded},
      {"out.permuted_to_token", &Layout::permuted_to_token},
      {"out.expanded_to_permuted", &Layout::expanded_to_permuted},
      {"out.tile_expert", &Layout::tile_expert},
      {"out.tile_row_end", &Layout::tile_row_end},
      {"out.totals", &Layout::totals},
  };
  for (const auto& a : arrays) {
    const auto member = a.second;
    cases.push_back({a.first, [member](F& f) { f.out.*member = null_data(f.out.*member); }, a.first});
    cases.push_back({a.first, [member](F& f) { f.out.*member = TensorView{}; }, a.first});
  }
  // expert_map problems (map form)
  cases.push_back({"expert_map [E-1]", [=](F& f) { f.cfg.local = LocalExperts::map(f.map_view(E - 1), L); },
                   "config.local.expert_map"});
  cases.push_back({"expert_map [E+1]", [=](F& f) { f.cfg.local = LocalExperts::map(f.map_view(E + 1), L); },
                   "config.local.expert_map"});
  cases.push_back({"int64 expert_map",
                   [=](F& f) { f.cfg.local = LocalExperts::map(as_dtype(f.map_view(E), DType::kInt64), L); },
                   "config.local.expert_map"});
  cases.push_back({"null expert_map",
                   [=](F& f) { f.cfg.local = LocalExperts::map(null_data(f.map_view(E)), L); },
                   "config.local.expert_map"});
  cases.push_back({"expert_map on cuda:0",
                   [=](F& f) { f.cfg.local = LocalExperts::map(on(f.map_view(E), Device::cuda(0)), L); },
                   "config.local.expert_map"});
  expect_all_rejected(cases);
}

TEST(ApiErrors, LayoutWorkspaceTooSmallOnCuda) {
  if (!switchyard::built_with_cuda()) GTEST_SKIP() << "no CUDA backend: the CPU layout needs no workspace";
  // The first token count whose CUDA layout needs a workspace.
  const LayoutConfig cfg = LayoutFixture().cfg;
  constexpr int K = LayoutFixture::K, L = LayoutFixture::L, M = LayoutFixture::M;
  std::int64_t T = 0;
  std::size_t need = 0;
  for (std::int64_t t : {19, 1 << 10, 1 << 14, 1 << 18, 1 << 22}) {
    ASSERT_TRUE(switchyard::layout_workspace_size(cfg, t, K, Device::cuda(0), &need).ok());
    T = t;
    if (need > 0) break;
  }
  if (need == 0) GTEST_SKIP() << "the CUDA layout needs no workspace up to T = " << T;
  // Views of that shape over the fixture's small host buffers, labelled CUDA: validation must
  // reject the workspace before any device work, so the memory behind them is never touched.
  const auto cuda_views_of_shape = [T](LayoutFixture& f) {
    const std::int64_t R = switchyard::max_permuted_rows(T, K, L, M);
    const std::int64_t N = switchyard::max_tiles(T, K, L, M);
    f.ids_v = reshaped(f.ids_v, {T, K});
    f.out.permuted_to_expanded = reshaped(f.out.permuted_to_expanded, {R});
    f.out.permuted_to_token = reshaped(f.out.permuted_to_token, {R});
    f.out.expanded_to_permuted = reshaped(f.out.expanded_to_permuted, {T, K});
    f.out.tile_expert = reshaped(f.out.tile_expert, {N});
    f.out.tile_row_end = reshaped(f.out.tile_row_end, {N});
    move_all(f, Device::cuda(0));
  };
  expect_all_rejected<LayoutFixture>({
      {"workspace one byte short",
       [=](LayoutFixture& f) {
         cuda_views_of_shape(f);
         f.workspace = f.workspace_buf.data();
         f.workspace_bytes = need - 1;
       },
       "workspace"},
      {"null workspace",
       [=](LayoutFixture& f) {
         cuda_views_of_shape(f);
         f.workspace = nullptr;
         f.workspace_bytes = need;
       },
       "workspace"},
      {"workspace + 8 bytes",
       [=](LayoutFixture& f) {
         cuda_views_of_shape(f);
         f.workspace = f.workspace_buf.offset(8);
         f.workspace_bytes = need;
       },
       "workspace"},
  });
}

TEST(ApiErrors, LayoutOnCudaWithoutCudaBuildIsUnsupported) {
  if (switchyard::built_with_cuda()) GTEST_SKIP() << "this build has the CUDA backend";
  LayoutFixture f;
  move_all(f, Device::cuda(0));
  EXPECT_TRUE(IsError(f.run(), StatusCode::kUnsupported, ""));
  EXPECT_TRUE(f.untouched());
}

// validate(LayoutConfig) alone: nothing to poison.
struct LayoutConfigOnly {
  static constexpr int E = 16;
  LayoutConfig cfg;
  std::vector<std::int32_t> map = std::vector<std::int32_t>(E, 0);
  LayoutConfigOnly() {
    cfg.num_experts = E;
    cfg.tile_size = 8;
  }
  TensorView map_view(std::int64_t len) { return TensorView::of(map.data(), DType::kInt32, {len}); }
  Status run() { return switchyard::validate(cfg); }
  bool untouched() const { return true; }
};

TEST(ApiErrors, ValidateLayoutConfig) {
  using Cfg = LayoutConfigOnly;
  ASSERT_TRUE(Cfg().run().ok());
  expect_all_rejected(bad_layout_configs<Cfg>());
  Cfg ok_range;
  ok_range.cfg.local = LocalExperts::range(1, 5, 3);  // 1, 4, ..., 13
  EXPECT_TRUE(ok_range.run().ok());
  Cfg empty_range;
  empty_range.cfg.local = LocalExperts::range(0, 0);
  EXPECT_TRUE(empty_range.run().ok());
}

TEST(ApiErrors, LayoutWorkspaceSize) {
  LayoutConfig cfg;
  cfg.num_experts = 16;
  cfg.tile_size = 8;
  std::size_t bytes = 0;
  ASSERT_TRUE(switchyard::layout_workspace_size(cfg, 19, 4, Device::cpu(), &bytes).ok());
  EXPECT_EQ(bytes, 0u) << "the CPU backend needs no workspace";

  const std::size_t poison = 0xA5A5A5A5u;
  auto rejected = [&](const char* what, LayoutConfig c, std::int64_t T, int K, Device d, const char* arg,
                      StatusCode code = kInvalid) {
    SCOPED_TRACE(what);
    std::size_t b = poison;
    EXPECT_TRUE(IsError(switchyard::layout_workspace_size(c, T, K, d, &b), code, arg));
    EXPECT_EQ(b, poison) << "bytes written although the call failed";
  };
  EXPECT_TRUE(
      IsError(switchyard::layout_workspace_size(cfg, 19, 4, Device::cpu(), nullptr), kInvalid, "bytes"));
  rejected("negative T", cfg, -1, 4, Device::cpu(), "num_tokens");
  rejected("K = 0", cfg, 19, 0, Device::cpu(), "top_k");
  LayoutConfig bad = cfg;
  bad.tile_size = 0;
  rejected("tile 0", bad, 19, 4, Device::cpu(), "config.tile_size");
  bad = cfg;
  bad.local = LocalExperts::range(12, 8);
  rejected("range past E", bad, 19, 4, Device::cpu(), "config.local.count");
  if (!switchyard::built_with_cuda()) {
    rejected("CUDA device without CUDA backend", cfg, 19, 4, Device::cuda(0), "", StatusCode::kUnsupported);
  }
}

// docs/design.md section 3: ids outside [0, E) are data, not argument errors. layout() succeeds,
// counts them in totals[kDropped] (all but -1) and places every other pick.
template <typename Id>
void check_out_of_range_ids_are_data() {
  constexpr int T = 6, K = 3, E = 8, M = 4;
  const std::vector<Id> ids = {
      0,
      8,
      3,  // 8 == E
      static_cast<Id>(-1),
      7,
      100,  // -1 is not dropped
      static_cast<Id>(-2),
      static_cast<Id>(std::numeric_limits<Id>::max()),
      3,  //
      static_cast<Id>(std::numeric_limits<Id>::min()),
      5,
      5,  //
      2,
      static_cast<Id>(-1),
      static_cast<Id>(-1),  //
      1,
      6,
      4,
  };
  const int dropped = 5;  // 8, 100, -2, max, min
  LayoutConfig cfg;
  cfg.num_experts = E;
  cfg.tile_size = M;
  const std::int64_t R = switchyard::max_permuted_rows(T, K, E, M);
  const std::int64_t N = switchyard::max_tiles(T, K, E, M);
  std::vector<std::int32_t> counts(E, sy_test::kPoisonI32), offsets(E + 1, sy_test::kPoisonI32),
      p2e(R, sy_test::kPoisonI32), p2t(R, sy_test::kPoisonI32), e2p(T * K, sy_test::kPoisonI32),
      tile_expert(N, sy_test::kPoisonI32), tile_row_end(N, sy_test::kPoisonI32),
      totals(3, sy_test::kPoisonI32);
  Layout out;
  out.counts = TensorView::of(counts.data(), DType::kInt32, {E});
  out.offsets = TensorView::of(offsets.data(), DType::kInt32, {E + 1});
  out.permuted_to_expanded = TensorView::of(p2e.data(), DType::kInt32, {R});
  out.permuted_to_token = TensorView::of(p2t.data(), DType::kInt32, {R});
  out.expanded_to_permuted = TensorView::of(e2p.data(), DType::kInt32, {T, K});
  out.tile_expert = TensorView::of(tile_expert.data(), DType::kInt32, {N});
  out.tile_row_end = TensorView::of(tile_row_end.data(), DType::kInt32, {N});
  out.totals = TensorView::of(totals.data(), DType::kInt32, {3});
  const DType id_dtype = sizeof(Id) == 8 ? DType::kInt64 : DType::kInt32;
  const Status s = switchyard::layout(cfg, TensorView::of(ids.data(), id_dtype, {T, K}), out, nullptr, 0);
  ASSERT_TRUE(s.ok()) << "ids outside [0, E) are data, not an argument error: " << s.to_string();
  EXPECT_EQ(totals[switchyard::kDropped], dropped);
  int placed = 0;
  std::vector<int> want_counts(E, 0);
  for (int x = 0; x < T * K; ++x) {
    const std::int64_t id = static_cast<std::int64_t>(ids[x]);
    if (id < 0 || id >= E) {
      EXPECT_EQ(e2p[x], -1) << "pick " << x << " (id " << id << ") must not be placed";
      continue;
    }
    ++placed;
    ++want_counts[id];
    ASSERT_GE(e2p[x], 0) << "pick " << x;
    ASSERT_LT(e2p[x], R);
    EXPECT_EQ(p2e[e2p[x]], x);
    EXPECT_EQ(p2t[e2p[x]], x / K);
    EXPECT_GE(e2p[x], offsets[id]);
    EXPECT_LT(e2p[x], offsets[id] + counts[id]);
  }
  for (int e = 0; e < E; ++e) EXPECT_EQ(counts[e], want_counts[e]) << "expert " << e;
  EXPECT_EQ(placed, T * K - dropped - 3);
  EXPECT_EQ(totals[switchyard::kPaddedTotal], offsets[E]);
}

TEST(ApiErrors, LayoutIdsOutOfRangeAreDataInt32) { check_out_of_range_ids_are_data<std::int32_t>(); }
TEST(ApiErrors, LayoutIdsOutOfRangeAreDataInt64) { check_out_of_range_ids_are_data<std::int64_t>(); }

// An expert_map entry outside [-1, L) counts as -1: data as well.
TEST(ApiErrors, LayoutExpertMapOutOfRangeIsData) {
  constexpr int T = 2, K = 2, E = 4, L = 2, M = 1;
  const std::vector<std::int32_t> ids = {0, 1, 2, 3};
  const std::vector<std::int32_t> map = {1, 99, -5, 0};  // expert 1 -> 99 and 2 -> -5: not local
  LayoutConfig cfg;
  cfg.num_experts = E;
  cfg.tile_size = M;
  cfg.local = LocalExperts::map(TensorView::of(map.data(), DType::kInt32, {E}), L);
  const std::int64_t R = switchyard::max_permuted_rows(T, K, L, M);
  const std::int64_t N = switchyard::max_tiles(T, K, L, M);
  std::vector<std::int32_t> counts(L), offsets(L + 1), p2e(R), p2t(R), e2p(T * K), te(N), tre(N), totals(3);
  Layout out;
  out.counts = TensorView::of(counts.data(), DType::kInt32, {L});
  out.offsets = TensorView::of(offsets.data(), DType::kInt32, {L + 1});
  out.permuted_to_expanded = TensorView::of(p2e.data(), DType::kInt32, {R});
  out.permuted_to_token = TensorView::of(p2t.data(), DType::kInt32, {R});
  out.expanded_to_permuted = TensorView::of(e2p.data(), DType::kInt32, {T, K});
  out.tile_expert = TensorView::of(te.data(), DType::kInt32, {N});
  out.tile_row_end = TensorView::of(tre.data(), DType::kInt32, {N});
  out.totals = TensorView::of(totals.data(), DType::kInt32, {3});
  const Status s =
      switchyard::layout(cfg, TensorView::of(ids.data(), DType::kInt32, {T, K}), out, nullptr, 0);
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(totals[switchyard::kDropped], 0) << "non-local experts are not dropped ids";
  EXPECT_EQ(counts, (std::vector<std::int32_t>{1, 1}));
  EXPECT_EQ(e2p, (std::vector<std::int32_t>{1, -1, -1, 0}));
}

// ---------------------------------------------------------------------------------------------
// route_and_layout

struct RouteAndLayoutFixture {
  static constexpr int T = 19, E = 16, K = 4, M = 8;
  RouteFixture r;
  LayoutFixture l;  // its ids are replaced by route's output
  Status run() {
    return switchyard::route_and_layout(r.cfg, r.logits_v, r.bias_v, r.ids_v, r.weights_v, l.cfg, l.out,
                                        l.workspace, l.workspace_bytes);
  }
  bool untouched() const { return r.untouched() && l.untouched(); }
};
static_assert(RouteAndLayoutFixture::T == RouteFixture::T && RouteFixture::T == LayoutFixture::T, "");
static_assert(RouteFixture::E == LayoutFixture::E && RouteFixture::K == LayoutFixture::K, "");

TEST(ApiErrors, RouteAndLayoutValidFixtureIsAccepted) {
  RouteAndLayoutFixture f;
  const Status s = f.run();
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_FALSE(f.l.totals.intact());
  EXPECT_FALSE(f.r.ids.intact());
}

TEST(ApiErrors, RouteAndLayoutBadArguments) {
  using F = RouteAndLayoutFixture;
  const int T = F::T, K = F::K;
  const std::int64_t R = switchyard::max_permuted_rows(T, K, F::E, F::M);
  expect_all_rejected<F>({
      {"K > E", [](F& f) { f.r.set_k(F::E + 1); }, "config.top_k"},
      {"K = 0", [](F& f) { f.r.set_k(0); }, "config.top_k"},
      {"E % n_group != 0",
       [](F& f) {
         f.r.cfg.group_rule = GroupRule::kTop2Sum;
         f.r.cfg.n_group = 3;
       },
       "config.n_group"},
      {"tile 0", [](F& f) { f.l.cfg.tile_size = 0; }, "config.tile_size"},
      {"layout E differs", [](F& f) { f.l.cfg.num_experts = F::E + 1; }, "layout_config.num_experts"},
      {"null logits", [](F& f) { f.r.logits_v = null_data(f.r.logits_v); }, "logits"},
      {"null topk_ids", [](F& f) { f.r.ids_v = null_data(f.r.ids_v); }, "topk_ids"},
      {"int32 logits", [](F& f) { f.r.logits_v = as_dtype(f.r.logits_v, DType::kInt32); }, "logits"},
      {"permuted_to_token of R-1",
       [=](F& f) { f.l.out.permuted_to_token = reshaped(f.l.out.permuted_to_token, {R - 1}); },
       "out.permuted_to_token"},
      {"null totals", [](F& f) { f.l.out.totals = null_data(f.l.out.totals); }, "out.totals"},
      {"expanded_to_permuted [T, K+1]",
       [=](F& f) {
         f.l.out.expanded_to_permuted = reshaped(f.l.out.expanded_to_permuted, {T, K + 1});
       },
       "out.expanded_to_permuted"},
      {"expert_map [E-1]", [](F& f) { f.l.cfg.local = LocalExperts::map(f.l.map_view(F::E - 1), F::E); },
       "config.local.expert_map"},
      {"layout range past E", [](F& f) { f.l.cfg.local = LocalExperts::range(10, 8); }, "config.local.count"},
      {"misaligned workspace",
       [](F& f) {
         f.l.workspace = f.l.workspace_buf.offset(4);
         f.l.workspace_bytes = 16;
       },
       "workspace"},
      {"layout outputs on cuda:0", [](F& f) { move_out(f.l.out, Device::cuda(0)); }, "out.counts"},
  });
}

TEST(ApiErrors, RouteAndLayoutOnCudaWithoutCudaBuildIsUnsupported) {
  if (switchyard::built_with_cuda()) GTEST_SKIP() << "this build has the CUDA backend";
  RouteAndLayoutFixture f;
  move_all(f.r, Device::cuda(0));
  move_out(f.l.out, Device::cuda(0));
  EXPECT_TRUE(IsError(f.run(), StatusCode::kUnsupported, ""));
  EXPECT_TRUE(f.untouched());
}

// ---------------------------------------------------------------------------------------------
// gather: fp8 rows with per-128-column-group scales (H = 300: 3 groups).

struct GatherFixture {
  static constexpr int T = 19, H = 300, G = 3, K = 4, L = 16, M = 8;
  const std::int64_t R = switchyard::max_permuted_rows(T, K, L, M);
  std::vector<std::uint8_t> x = std::vector<std::uint8_t>(T * H * 2 + 64, 0x38);
  std::vector<float> x_scales = std::vector<float>(T * G * 2 + 64, 1.0f);
  std::vector<std::int32_t> p2t, totals = {0, 0, 0};
  Poisoned x_perm{(R + 8) * H * 4}, x_perm_scales{(R + 8) * G * 4};
  switchyard::Layout layout;
  TensorView x_v, x_scales_v, x_perm_v, x_perm_scales_v;

  GatherFixture() {
    // A plausible filled layout: tokens in order, then padding.
    p2t.assign(R + 8, T);
    for (int t = 0; t < T; ++t) p2t[t] = t;
    totals[switchyard::kPaddedTotal] = T + 5;
    totals[switchyard::kNumTiles] = (T + 5) / M;
    layout.permuted_to_token = TensorView::of(p2t.data(), DType::kInt32, {R});
    layout.totals = TensorView::of(totals.data(), DType::kInt32, {3});
    x_v = TensorView::of(x.data(), DType::kFloat8E4M3, {T, H});
    x_scales_v = TensorView::of(x_scales.data(), DType::kFloat32, {T, G});
    x_perm_v = TensorView::of(x_perm.data(), DType::kFloat8E4M3, {R, H});
    x_perm_scales_v = TensorView::of(x_perm_scales.data(), DType::kFloat32, {R, G});
  }
  Status run() { return switchyard::gather(x_v, x_scales_v, layout, x_perm_v, x_perm_scales_v, true); }
  bool untouched() const { return x_perm.intact() && x_perm_scales.intact(); }
};

template <>
void move_all(GatherFixture& f, Device d) {
  f.x_v.device = f.x_scales_v.device = f.x_perm_v.device = f.x_perm_scales_v.device = d;
  f.layout.permuted_to_token.device = f.layout.totals.device = d;
}

TEST(ApiErrors, GatherValidFixtureIsAccepted) {
  GatherFixture f;
  const Status s = f.run();
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_FALSE(f.x_perm.intact());
}

TEST(ApiErrors, GatherBadArguments) {
  using F = GatherFixture;
  const int T = F::T, H = F::H, G = F::G;
  expect_all_rejected<F>({
      {"null x", [](F& f) { f.x_v = null_data(f.x_v); }, "x"},
      {"null x_perm", [](F& f) { f.x_perm_v = null_data(f.x_perm_v); }, "x_perm"},
      {"null x_scales", [](F& f) { f.x_scales_v = null_data(f.x_scales_v); }, "x_scales"},
      {"null x_perm_scales", [](F& f) { f.x_perm_scales_v = null_data(f.x_perm_scales_v); }, "x_perm_scales"},
      {"null permuted_to_token",
       [](F& f) { f.layout.permuted_to_token = null_data(f.layout.permuted_to_token); },
       "layout.permuted_to_token"},
      {"null totals", [](F& f) { f.layout.totals = null_data(f.layout.totals); }, "layout.totals"},
      {"absent x", [](F& f) { f.x_v = TensorView{}; }, "x"},
      // dtypes
      {"int32 x", [](F& f) { f.x_v = as_dtype(f.x_v, DType::kInt32); }, "x"},
      {"x_perm dtype differs from x", [](F& f) { f.x_perm_v = as_dtype(f.x_perm_v, DType::kBFloat16); },
       "x_perm"},
      {"fp16 x_scales", [](F& f) { f.x_scales_v = as_dtype(f.x_scales_v, DType::kFloat16); }, "x_scales"},
      {"int64 permuted_to_token",
       [](F& f) { f.layout.permuted_to_token = as_dtype(f.layout.permuted_to_token, DType::kInt64); },
       "layout.permuted_to_token"},
      // shapes
      {"x_perm fewer rows than the layout",
       [](F& f) {
         f.x_perm_v = reshaped(f.x_perm_v, {f.R - 1, H});
       },
       "x_perm"},
      {"x_perm [R, H+1]",
       [](F& f) {
         f.x_perm_v = reshaped(f.x_perm_v, {f.R, H + 1});
       },
       "x_perm"},
      {"x 1-D", [=](F& f) { f.x_v = reshaped(f.x_v, {T * H}); }, "x"},
      {"totals of 2", [](F& f) { f.layout.totals = reshaped(f.layout.totals, {2}); }, "layout.totals"},
      {"x_scales with 2 columns",
       [=](F& f) {
         f.x_scales_v = reshaped(f.x_scales_v, {T, 2});
       },
       "x_scales"},
      {"x_scales [T-1, G]",
       [=](F& f) {
         f.x_scales_v = reshaped(f.x_scales_v, {T - 1, G});
       },
       "x_scales"},
      {"x_perm_scales [R-1, G]",
       [=](F& f) {
         f.x_perm_scales_v = reshaped(f.x_perm_scales_v, {f.R - 1, G});
       },
       "x_perm_scales"},
      {"per-token x_scales, per-group x_perm_scales",
       [=](F& f) {
         f.x_scales_v = reshaped(f.x_scales_v, {T, 1});
       },
       "x_perm_scales"},
      // scales on one side only
      {"x_scales only", [](F& f) { f.x_perm_scales_v = TensorView{}; }, "x_perm_scales"},
      {"x_perm_scales only", [](F& f) { f.x_scales_v = TensorView{}; }, "x_scales"},
      // layouts, alignment, devices
      {"non-contiguous x_perm", [=](F& f) { f.x_perm_v = with_strides(f.x_perm_v, H + 1, 1); }, "x_perm"},
      {"x last dim strided",
       [=](F& f) {
         f.x_v = with_strides(reshaped(f.x_v, {T, H / 2}), H, 2);
       },
       "x"},
      {"non-contiguous x_scales", [=](F& f) { f.x_scales_v = with_strides(f.x_scales_v, 1, T); }, "x_scales"},
      {"x_perm_scales + 2 bytes", [](F& f) { f.x_perm_scales_v = shifted(f.x_perm_scales_v, 2); },
       "x_perm_scales"},
      {"permuted_to_token + 2 bytes",
       [](F& f) { f.layout.permuted_to_token = shifted(f.layout.permuted_to_token, 2); },
       "layout.permuted_to_token"},
      {"x_perm on cuda:0", [](F& f) { f.x_perm_v = on(f.x_perm_v, Device::cuda(0)); }, "x_perm"},
      {"totals on cuda:0", [](F& f) { f.layout.totals = on(f.layout.totals, Device::cuda(0)); },
       "layout.totals"},
  });
}

TEST(ApiErrors, GatherBf16Misaligned) {
  using F = GatherFixture;
  expect_all_rejected<F>({
      {"bf16 x_perm + 1 byte",
       [](F& f) {
         f.x_v = as_dtype(f.x_v, DType::kBFloat16);
         f.x_perm_v = shifted(as_dtype(f.x_perm_v, DType::kBFloat16), 1);
       },
       "x_perm"},
      {"bf16 x + 1 byte",
       [](F& f) {
         f.x_v = shifted(as_dtype(f.x_v, DType::kBFloat16), 1);
         f.x_perm_v = as_dtype(f.x_perm_v, DType::kBFloat16);
       },
       "x"},
  });
}

TEST(ApiErrors, GatherOnCudaWithoutCudaBuildIsUnsupported) {
  if (switchyard::built_with_cuda()) GTEST_SKIP() << "this build has the CUDA backend";
  GatherFixture f;
  move_all(f, Device::cuda(0));
  EXPECT_TRUE(IsError(f.run(), StatusCode::kUnsupported, ""));
  EXPECT_TRUE(f.untouched());
}

// ---------------------------------------------------------------------------------------------
// combine

struct CombineFixture {
  static constexpr int T = 19, H = 40, K = 4, L = 16, M = 8;
  const std::int64_t R = switchyard::max_permuted_rows(T, K, L, M);
  std::vector<std::uint16_t> y = std::vector<std::uint16_t>((R + 8) * H * 2, 0x3f80);  // bf16 1.0
  std::vector<std::int32_t> e2p = std::vector<std::int32_t>(T * K * 2 + 16, -1);
  std::vector<std::int32_t> p2t = std::vector<std::int32_t>(R + 8, T);
  std::vector<float> w = std::vector<float>(T * K * 2 + 16, 0.25f);
  Poisoned out{(T + 8) * (H + 8) * 4};
  switchyard::Layout layout;
  TensorView y_v, w_v, out_v;

  CombineFixture() {
    for (int x = 0; x < T * K; ++x) e2p[x] = x;  // a plausible layout: pick x at row x
    y_v = TensorView::of(y.data(), DType::kBFloat16, {R, H});
    layout.expanded_to_permuted = TensorView::of(e2p.data(), DType::kInt32, {T, K});
    layout.permuted_to_token = TensorView::of(p2t.data(), DType::kInt32, {R});
    w_v = TensorView::of(w.data(), DType::kFloat32, {T, K});
    out_v = TensorView::of(out.data(), DType::kBFloat16, {T, H});
  }
  Status run() { return switchyard::combine(y_v, layout, w_v, out_v); }
  bool untouched() const { return out.intact(); }
};

template <>
void move_all(CombineFixture& f, Device d) {
  f.y_v.device = f.w_v.device = f.out_v.device = d;
  f.layout.expanded_to_permuted.device = f.layout.permuted_to_token.device = d;
}

TEST(ApiErrors, CombineValidFixtureIsAccepted) {
  CombineFixture f;
  const Status s = f.run();
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_FALSE(f.out.intact());
}

TEST(ApiErrors, CombineBadArguments) {
  using F = CombineFixture;
  const int T = F::T, H = F::H, K = F::K;
  expect_all_rejected<F>({
      {"null y_perm", [](F& f) { f.y_v = null_data(f.y_v); }, "y_perm"},
      {"null expanded_to_permuted",
       [](F& f) { f.layout.expanded_to_permuted = null_data(f.layout.expanded_to_permuted); },
       "layout.expanded_to_permuted"},
      {"null permuted_to_token",
       [](F& f) { f.layout.permuted_to_token = null_data(f.layout.permuted_to_token); },
       "layout.permuted_to_token"},
      {"null topk_weights", [](F& f) { f.w_v = null_data(f.w_v); }, "topk_weights"},
      {"null out", [](F& f) { f.out_v = null_data(f.out_v); }, "out"},
      {"absent out", [](F& f) { f.out_v = TensorView{}; }, "out"},
      // dtypes
      {"fp8 y_perm", [](F& f) { f.y_v = as_dtype(f.y_v, DType::kFloat8E4M3); }, "y_perm"},
      {"int32 y_perm", [](F& f) { f.y_v = as_dtype(f.y_v, DType::kInt32); }, "y_perm"},
      {"fp8 out", [](F& f) { f.out_v = as_dtype(f.out_v, DType::kFloat8E4M3); }, "out"},
      {"int64 out", [](F& f) { f.out_v = as_dtype(f.out_v, DType::kInt64); }, "out"},
      {"fp16 topk_weights", [](F& f) { f.w_v = as_dtype(f.w_v, DType::kFloat16); }, "topk_weights"},
      {"int64 expanded_to_permuted",
       [](F& f) { f.layout.expanded_to_permuted = as_dtype(f.layout.expanded_to_permuted, DType::kInt64); },
       "layout.expanded_to_permuted"},
      // shapes
      {"y_perm fewer rows than the layout",
       [=](F& f) {
         f.y_v = reshaped(f.y_v, {f.R - 1, H});
       },
       "y_perm"},
      {"topk_weights [T, K-1]",
       [=](F& f) {
         f.w_v = reshaped(f.w_v, {T, K - 1});
       },
       "topk_weights"},
      {"topk_weights [T+1, K]",
       [=](F& f) {
         f.w_v = reshaped(f.w_v, {T + 1, K});
       },
       "topk_weights"},
      {"out [T, H+1]",
       [=](F& f) {
         f.out_v = reshaped(f.out_v, {T, H + 1});
       },
       "out"},
      {"out [T-1, H]",
       [=](F& f) {
         f.out_v = reshaped(f.out_v, {T - 1, H});
       },
       "out"},
      {"expanded_to_permuted 1-D",
       [=](F& f) { f.layout.expanded_to_permuted = reshaped(f.layout.expanded_to_permuted, {T * K}); },
       "layout.expanded_to_permuted"},
      // layouts, alignment, devices
      {"non-contiguous out", [=](F& f) { f.out_v = with_strides(f.out_v, H + 2, 1); }, "out"},
      {"non-contiguous topk_weights", [=](F& f) { f.w_v = with_strides(f.w_v, K + 1, 1); }, "topk_weights"},
      {"y_perm row stride < H", [=](F& f) { f.y_v = with_strides(f.y_v, H - 1, 1); }, "y_perm"},
      {"out + 1 byte", [](F& f) { f.out_v = shifted(f.out_v, 1); }, "out"},
      {"topk_weights + 2 bytes", [](F& f) { f.w_v = shifted(f.w_v, 2); }, "topk_weights"},
      {"out on cuda:0", [](F& f) { f.out_v = on(f.out_v, Device::cuda(0)); }, "out"},
      {"expanded_to_permuted on cuda:0",
       [](F& f) { f.layout.expanded_to_permuted = on(f.layout.expanded_to_permuted, Device::cuda(0)); },
       "layout.expanded_to_permuted"},
  });
}

TEST(ApiErrors, CombineOnCudaWithoutCudaBuildIsUnsupported) {
  if (switchyard::built_with_cuda()) GTEST_SKIP() << "this build has the CUDA backend";
  CombineFixture f;
  move_all(f, Device::cuda(0));
  EXPECT_TRUE(IsError(f.run(), StatusCode::kUnsupported, ""));
  EXPECT_TRUE(f.untouched());
}

// ---------------------------------------------------------------------------------------------
// presets, Status and dtype helpers

TEST(ApiErrors, FindPresetUnknownName) {
  switchyard::ModelPreset p;
  p.name = "poison";
  p.hidden_size = -7;
  const Status s = switchyard::find_preset("deepseek-v4", &p);
  EXPECT_TRUE(IsError(s, kInvalid, "name"));
  EXPECT_NE(s.message().find("deepseek-v4"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("deepseek-v3"), std::string::npos) << "the message lists the known names";
  EXPECT_EQ(p.name, "poison");
  EXPECT_EQ(p.hidden_size, -7);
  EXPECT_TRUE(IsError(switchyard::find_preset("", &p), kInvalid, "name"));
  EXPECT_TRUE(IsError(switchyard::find_preset("Mixtral-8x7B", &p), kInvalid, "name")) << "names are exact";
  EXPECT_TRUE(switchyard::find_preset("mixtral-8x7b", &p).ok());
  EXPECT_EQ(p.name, "mixtral-8x7b");
}

TEST(ApiErrors, StatusToString) {
  EXPECT_TRUE(Status().ok());
  EXPECT_TRUE(Status::Ok().ok());
  EXPECT_EQ(Status::Ok().to_string(), "Ok");
  EXPECT_EQ(Status::Ok().code(), StatusCode::kOk);
  EXPECT_EQ(Status::InvalidArgument("route: argument 'topk_ids': bad").to_string(),
            "InvalidArgument: route: argument 'topk_ids': bad");
  EXPECT_EQ(Status::Unsupported("x").to_string(), "Unsupported: x");
  EXPECT_EQ(Status::CudaError("y").to_string(), "CudaError: y");
  EXPECT_EQ(Status::Internal("z").to_string(), "Internal: z");
  EXPECT_FALSE(Status::Internal("z").ok());
  EXPECT_EQ(Status::Unsupported("m").message(), "m");
  EXPECT_EQ(Status::CudaError("m").code(), StatusCode::kCudaError);
  EXPECT_STREQ(switchyard::status_code_name(StatusCode::kOk), "Ok");
  EXPECT_STREQ(switchyard::status_code_name(StatusCode::kInvalidArgument), "InvalidArgument");
  EXPECT_STREQ(switchyard::status_code_name(StatusCode::kUnsupported), "Unsupported");
  EXPECT_STREQ(switchyard::status_code_name(StatusCode::kCudaError), "CudaError");
  EXPECT_STREQ(switchyard::status_code_name(StatusCode::kInternal), "Internal");
  EXPECT_STREQ(switchyard::status_code_name(static_cast<StatusCode>(99)), "Unknown");
  // A real error's string carries the operation and the argument.
  RouteFixture f;
  f.set_k(RouteFixture::E + 1);
  const std::string text = f.run().to_string();
  EXPECT_EQ(text.rfind("InvalidArgument: route: argument 'config.top_k': ", 0), 0u) << text;
}

TEST(ApiErrors, DtypeNamesAndSizes) {
  const struct {
    DType d;
    const char* name;
    std::size_t size;
  } table[] = {
      {DType::kFloat32, "fp32", 4},        {DType::kBFloat16, "bf16", 2}, {DType::kFloat16, "fp16", 2},
      {DType::kFloat8E4M3, "fp8_e4m3", 1}, {DType::kInt32, "int32", 4},   {DType::kInt64, "int64", 8},
  };
  for (const auto& row : table) {
    EXPECT_STREQ(switchyard::dtype_name(row.d), row.name);
    EXPECT_EQ(switchyard::dtype_size(row.d), row.size) << row.name;
  }
  EXPECT_STREQ(switchyard::dtype_name(static_cast<DType>(42)), "invalid");
  EXPECT_EQ(switchyard::dtype_size(static_cast<DType>(42)), 0u);
  EXPECT_STREQ(switchyard::dtype_name(static_cast<DType>(-1)), "invalid");
  EXPECT_EQ(switchyard::dtype_size(static_cast<DType>(-1)), 0u);
  EXPECT_STREQ(switchyard::version(), "0.1.0");
}

}  // namespace
