// CPU layout against a brute-force reference written here from docs/design.md section 3: every
// expected array is rebuilt from the formulas (buckets filled in ascending x, padded offsets,
// sentinels, tiles found through the owner of their first row), never through library helpers.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/layout_inputs.h"
#include "common/layout_reference.h"
#include "common/test_data.h"
#include "switchyard/layout.h"

namespace {

using switchyard::Device;
using switchyard::DType;
using switchyard::Layout;
using switchyard::LayoutConfig;
using switchyard::Status;
using switchyard::TensorView;
using sy_test::Duplicates;
using sy_test::kPoisonI32;
using sy_test::kSkews;
using sy_test::LayoutCase;
using sy_test::LayoutInputs;
using sy_test::LocalKind;
using sy_test::Skew;

constexpr const auto& kTs = sy_test::kSweepTokens;
constexpr const auto& kEs = sy_test::kSweepExperts;
constexpr const auto& kKs = sy_test::kSweepTopK;
constexpr const auto& kMs = sy_test::kSweepTiles;
// Elements after each buffer's capacity that must keep their poison.
constexpr std::int64_t kGuard = 61;

using sy_test::num_local;
using sy_test::pick_local;
using sy_test::test_seed;

// This test's draw of the inputs (tests/common/layout_inputs.h).
LayoutInputs make_inputs(const LayoutCase& c, std::uint64_t seed) {
  sy_test::LayoutInputsDraw draw;
  draw.salt = 0x9e3779b97f4a7c15ull;
  draw.map_negative[0] = -2;
  draw.map_negative[1] = -1000;
  draw.map_past_l = 5;
  draw.random_hot = false;
  draw.fast_ids_above = 2e5;
  // Ids whose low 32 bits are a valid expert: a backend that truncates would place them.
  draw.invalid_ids64 = {(std::int64_t{1} << 32) + 3, static_cast<std::int64_t>(0xffffffff00000001ull),
                        std::numeric_limits<std::int64_t>::min(), std::numeric_limits<std::int64_t>::max(),
                        -(std::int64_t{1} << 40)};
  draw.invalid_every = 16;
  return sy_test::make_layout_inputs(c, seed, draw);
}

using sy_test::ExpectedLayout;
using sy_test::reference_layout;

// Caller-owned output buffers: each array holds its capacity plus a poisoned guard zone; the
// views the library sees are `view_extra` elements longer than the capacity (buffers sized
// for a larger shape and reused).
struct LayoutBuffers {
  std::vector<std::int32_t> counts, offsets, permuted_to_expanded, permuted_to_token, expanded_to_permuted,
      tile_expert, tile_row_end, totals;
  std::int64_t T = 0, K = 0;

  LayoutBuffers(std::int64_t T_, int K_, int L, std::int64_t rows, std::int64_t tiles) : T(T_), K(K_) {
    auto alloc = [](std::vector<std::int32_t>& v, std::int64_t n) { v.assign(n + kGuard, kPoisonI32); };
    alloc(counts, L);
    alloc(offsets, L + 1);
    alloc(permuted_to_expanded, rows);
    alloc(permuted_to_token, rows);
    alloc(expanded_to_permuted, T * K);
    alloc(tile_expert, tiles);
    alloc(tile_row_end, tiles);
    alloc(totals, switchyard::kNumTotals);
  }

  void poison() {
    for (auto* v : {&counts, &offsets, &permuted_to_expanded, &permuted_to_token, &expanded_to_permuted,
                    &tile_expert, &tile_row_end, &totals}) {
      std::fill(v->begin(), v->end(), kPoisonI32);
    }
  }

  Layout views(std::int64_t view_extra) const {
    auto v1 = [&](const std::vector<std::int32_t>& v) {
      const std::int64_t n = static_cast<std::int64_t>(v.size()) - kGuard + view_extra;
      return TensorView::of(v.data(), DType::kInt32, {n}, Device::cpu());
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
};

// Every element below `capacity` equals the reference (so none kept its poison) and every
// element from `capacity` on kept its poison. Reports the first mismatch only.
void expect_array(const char* name, const std::vector<std::int32_t>& got,
                  const std::vector<std::int32_t>& want) {
  const std::size_t capacity = want.size();
  ASSERT_GE(got.size(), capacity) << name;
  for (std::size_t i = 0; i < capacity; ++i) {
    if (got[i] != want[i]) {
      ADD_FAILURE() << name << "[" << i << "] = " << got[i]
                    << (got[i] == kPoisonI32 ? " (poison: never written)" : "") << ", expected " << want[i]
                    << " (capacity " << capacity << ")";
      return;
    }
  }
  for (std::size_t i = capacity; i < got.size(); ++i) {
    if (got[i] != kPoisonI32) {
      ADD_FAILURE() << name << "[" << i << "] = " << got[i] << " written past the capacity " << capacity;
      return;
    }
  }
}

TensorView ids_view(const LayoutCase& c, const LayoutInputs& in) {
  if (c.ids64) return TensorView::of(in.ids.data(), DType::kInt64, {c.T, c.K}, Device::cpu());
  return TensorView::of(in.ids32.data(), DType::kInt32, {c.T, c.K}, Device::cpu());
}

Status run_layout(const LayoutCase& c, const LayoutInputs& in, LayoutBuffers& buf,
                  std::int64_t view_extra = 0) {
  return switchyard::layout(sy_test::make_config(c, in.expert_map.data(), Device::cpu()), ids_view(c, in),
                            buf.views(view_extra), nullptr, 0);
}

// Runs one case end to end and compares every array with the reference.
void check_case(const LayoutCase& c, std::uint64_t seed, std::int64_t view_extra = 0) {
  SCOPED_TRACE(describe(c));
  const LayoutInputs in = make_inputs(c, seed);
  const ExpectedLayout want = reference_layout(c, in);
  const int L = num_local(c);
  if (L > 0) {
    ASSERT_EQ(switchyard::max_permuted_rows(c.T, c.K, L, c.M), want.rows);
    ASSERT_EQ(switchyard::max_tiles(c.T, c.K, L, c.M), want.tiles);
  }
  LayoutBuffers buf(c.T, c.K, L, want.rows, want.tiles);
  const Status s = run_layout(c, in, buf, view_extra);
  ASSERT_TRUE(s.ok()) << s.to_string();
  expect_array("counts", buf.counts, want.counts);
  expect_array("offsets", buf.offsets, want.offsets);
  expect_array("permuted_to_expanded", buf.permuted_to_expanded, want.permuted_to_expanded);
  expect_array("permuted_to_token", buf.permuted_to_token, want.permuted_to_token);
  expect_array("expanded_to_permuted", buf.expanded_to_permuted, want.expanded_to_permuted);
  expect_array("tile_expert", buf.tile_expert, want.tile_expert);
  expect_array("tile_row_end", buf.tile_row_end, want.tile_row_end);
  expect_array("totals", buf.totals, want.totals);
}

// The largest K of the list that does not exceed E, starting from index `i`.
int k_at_most_e(std::size_t i, int E) {
  for (std::size_t j = 0; j < std::size(kKs); ++j) {
    const int K = kKs[(i + std::size(kKs) - j) % std::size(kKs)];
    if (K <= E) return K;
  }
  return 1;
}

TEST(LayoutCpu, SweepMatchesBruteForce) {
  const std::uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 g(seed);
  // Every listed value of every axis appears at every T; the axes rotate at co-prime periods
  // so that the 30 cases per T pair values differently, and 20 more cases per T are drawn at
  // random from the whole cross product.
  constexpr int kFixed = 30;
  constexpr int kRandom = 20;
  for (const std::int64_t T : kTs) {
    for (int i = 0; i < kFixed + kRandom; ++i) {
      LayoutCase c;
      c.T = T;
      int stride = 1;
      if (i < kFixed) {
        c.E = kEs[i % 6];
        c.K = k_at_most_e(static_cast<std::size_t>(i + i / 6), c.E);
        c.M = kMs[i % 5];
        c.local = static_cast<LocalKind>(i % 3);
        stride = (i / 3) % 2 == 0 ? 1 : 3;
        c.skew = kSkews[(i / 2) % 3];
        c.ids64 = (i / 5) % 2 == 1;
        c.invalid = i % 4 == 1;
      } else {
        c.E = kEs[g() % 6];
        c.K = k_at_most_e(g() % 6, c.E);
        c.M = kMs[g() % 5];
        c.local = static_cast<LocalKind>(g() % 3);
        stride = g() % 2 == 0 ? 1 : 3;
        c.skew = kSkews[g() % 3];
        c.ids64 = g() % 2 == 1;
        c.invalid = g() % 2 == 1;
      }
      pick_local(c, g, stride);
      check_case(c, g());
      if (HasFatalFailure()) return;
    }
  }
}

// Every tile size against every local-expert form on mid-sized, skewed inputs.
TEST(LayoutCpu, TileSizesAndLocalForms) {
  const std::uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 g(seed);
  for (const int M : kMs) {
    for (int form = 0; form < 4; ++form) {
      LayoutCase c;
      c.T = 989;
      c.E = 256;
      c.K = 8;
      c.M = M;
      c.skew = kSkews[g() % 3];
      c.invalid = true;
      c.ids64 = form % 2 == 1;
      c.local = form == 0 ? LocalKind::kAll : form == 3 ? LocalKind::kMap : LocalKind::kRange;
      pick_local(c, g, form == 1 ? 1 : 3);
      check_case(c, g());
    }
  }
}

// A small case with the expected arrays written out by hand.
TEST(LayoutCpu, HandWorkedExample) {
  // T=3, K=2, E=4, all local, M=2; ids row by row: {2,0}, {2,-1}, {9,2}.
  // Expert 0: x=1. Expert 2: x=0,2,5. Experts 1,3 empty. 9 is dropped, -1 is not counted.
  const std::vector<std::int32_t> ids = {2, 0, 2, -1, 9, 2};
  LayoutConfig config;
  config.num_experts = 4;
  config.tile_size = 2;
  // R = 6 + min(4,6)*1 = 10, N = 5.
  LayoutBuffers buf(3, 2, 4, 10, 5);
  const Status s = switchyard::layout(
      config, TensorView::of(ids.data(), DType::kInt32, {3, 2}, Device::cpu()), buf.views(0), nullptr, 0);
  ASSERT_TRUE(s.ok()) << s.to_string();
  expect_array("counts", buf.counts, {1, 0, 3, 0});
  expect_array("offsets", buf.offsets, {0, 2, 2, 6, 6});
  expect_array("permuted_to_expanded", buf.permuted_to_expanded, {1, 6, 0, 2, 5, 6, 6, 6, 6, 6});
  expect_array("permuted_to_token", buf.permuted_to_token, {0, 3, 0, 1, 2, 3, 3, 3, 3, 3});
  expect_array("expanded_to_permuted", buf.expanded_to_permuted, {2, 0, 3, -1, -1, 4});
  expect_array("tile_expert", buf.tile_expert, {0, 2, 2, -1, -1});
  expect_array("tile_row_end", buf.tile_row_end, {1, 4, 5, 6, 8});
  expect_array("totals", buf.totals, {6, 3, 1});
}

// Tokens with two (or more) picks of one expert: each pick is placed, in x order (the GPU tests
// use this backend as their oracle for such inputs).
TEST(LayoutCpu, DuplicatePicksInAToken) {
  const std::uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 g(seed);
  for (const std::int64_t T : {1, 7, 64, 333, 4097}) {
    for (const auto& [E, K] : {std::pair<int, int>{8, 2}, {61, 8}, {256, 8}, {512, 10}, {64, 32}}) {
      LayoutCase c;
      c.T = T;
      c.E = E;
      c.K = K;
      c.M = kMs[g() % std::size(kMs)];
      c.skew = kSkews[g() % 3];
      c.ids64 = g() % 2 == 1;
      c.local = static_cast<LocalKind>(g() % 3);
      c.invalid = g() % 2 == 1;
      c.duplicates = Duplicates::kMany;
      pick_local(c, g, g() % 2 == 0 ? 1 : 3);
      check_case(c, g());
      if (HasFatalFailure()) return;
    }
  }
}

TEST(LayoutCpu, InvalidIdsAreDroppedAndCounted) {
  // int32: -1 is neither placed nor counted; every other id outside [0, E) is counted.
  {
    const std::vector<std::int32_t> ids = {-1, 8,   3, std::numeric_limits<std::int32_t>::min(), 7,
                                           -2, 100, 0, std::numeric_limits<std::int32_t>::max(), -1};
    LayoutConfig config;
    config.num_experts = 8;
    config.tile_size = 1;
    LayoutBuffers buf(5, 2, 8, 10, 10);
    ASSERT_TRUE(switchyard::layout(config, TensorView::of(ids.data(), DType::kInt32, {5, 2}, Device::cpu()),
                                   buf.views(0), nullptr, 0)
                    .ok());
    EXPECT_EQ(buf.totals[switchyard::kDropped], 5);
    EXPECT_EQ(buf.totals[switchyard::kPaddedTotal], 3);
    expect_array("expanded_to_permuted", buf.expanded_to_permuted, {-1, -1, 1, -1, 2, -1, -1, 0, -1, -1});
  }
  // int64 ids whose low 32 bits name a valid expert are still out of range.
  {
    const std::vector<std::int64_t> ids = {(std::int64_t{1} << 32) + 3,
                                           3,
                                           -(std::int64_t{1} << 40),
                                           std::numeric_limits<std::int64_t>::min(),
                                           std::numeric_limits<std::int64_t>::max(),
                                           -1};
    LayoutConfig config;
    config.num_experts = 8;
    config.tile_size = 7;
    // R = 6 + 6*6 = 42, N = 6.
    LayoutBuffers buf(3, 2, 8, 42, 6);
    ASSERT_TRUE(switchyard::layout(config, TensorView::of(ids.data(), DType::kInt64, {3, 2}, Device::cpu()),
                                   buf.views(0), nullptr, 0)
                    .ok());
    expect_array("totals", buf.totals, {7, 1, 4});
    expect_array("expanded_to_permuted", buf.expanded_to_permuted, {-1, 0, -1, -1, -1, -1});
  }
  // Random sweep with many invalid ids, both dtypes, all local forms.
  const std::uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 g(seed);
  for (int i = 0; i < 12; ++i) {
    LayoutCase c;
    c.T = kTs[1 + g() % 5];
    c.E = kEs[g() % 6];
    c.K = k_at_most_e(g() % 6, c.E);
    c.M = kMs[g() % 5];
    c.ids64 = i % 2 == 1;
    c.local = static_cast<LocalKind>(i % 3);
    c.invalid = true;
    pick_local(c, g, i % 4 < 2 ? 1 : 3);
    check_case(c, g());
  }
}

// L = 0 (an empty range or map): nothing is placed, every pick reads -1.
TEST(LayoutCpu, NoLocalExperts) {
  const std::uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (const LocalKind kind : {LocalKind::kRange, LocalKind::kMap}) {
    LayoutCase c;
    c.T = 19;
    c.E = 160;
    c.K = 8;
    c.M = 7;
    c.local = kind;
    c.count = 0;
    c.invalid = true;
    check_case(c, seed);
  }
}

TEST(LayoutCpu, ZeroTokens) {
  const std::uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 g(seed);
  for (const LocalKind kind : {LocalKind::kAll, LocalKind::kRange, LocalKind::kMap}) {
    for (const bool ids64 : {false, true}) {
      LayoutCase c;
      c.T = 0;
      c.E = 384;
      c.K = 10;
      c.M = 128;
      c.local = kind;
      c.ids64 = ids64;
      pick_local(c, g, 3);
      check_case(c, g());
    }
  }
}

// Views longer than the capacity (buffers allocated once for a larger shape): only the
// capacity max_permuted_rows / max_tiles of the actual shape is written.
TEST(LayoutCpu, OversizedBuffersWrittenOnlyToCapacity) {
  const std::uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 g(seed);
  for (const std::int64_t T : {std::int64_t{0}, std::int64_t{3}, std::int64_t{111}}) {
    LayoutCase c;
    c.T = T;
    c.E = 512;
    c.K = 22;
    c.M = 192;
    c.local = LocalKind::kRange;
    pick_local(c, g, 1);
    check_case(c, g(), /*view_extra=*/kGuard);
  }
}

// The same input twice gives the same bytes, on a shape large enough to be split over threads.
TEST(LayoutCpu, Deterministic) {
  const std::uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  LayoutCase c;
  c.T = 4096;
  c.E = 256;
  c.K = 32;
  c.M = 64;
  c.skew = Skew::kZipf;
  c.invalid = true;
  const LayoutInputs in = make_inputs(c, seed);
  const std::int64_t rows = switchyard::max_permuted_rows(c.T, c.K, c.E, c.M);
  const std::int64_t tiles = switchyard::max_tiles(c.T, c.K, c.E, c.M);
  LayoutBuffers a(c.T, c.K, c.E, rows, tiles);
  LayoutBuffers b(c.T, c.K, c.E, rows, tiles);
  ASSERT_TRUE(run_layout(c, in, a).ok());
  ASSERT_TRUE(run_layout(c, in, b).ok());
  EXPECT_EQ(a.counts, b.counts);
  EXPECT_EQ(a.offsets, b.offsets);
  EXPECT_EQ(a.permuted_to_expanded, b.permuted_to_expanded);
  EXPECT_EQ(a.permuted_to_token, b.permuted_to_token);
  EXPECT_EQ(a.expanded_to_permuted, b.expanded_to_permuted);
  EXPECT_EQ(a.tile_expert, b.tile_expert);
  EXPECT_EQ(a.tile_row_end, b.tile_row_end);
  EXPECT_EQ(a.totals, b.totals);
  // Rerunning into the same, now dirty, buffers gives the same bytes again.
  LayoutBuffers first = a;
  a.poison();
  ASSERT_TRUE(run_layout(c, in, a).ok());
  EXPECT_EQ(a.permuted_to_expanded, first.permuted_to_expanded);
  EXPECT_EQ(a.tile_row_end, first.tile_row_end);
}

}  // namespace
