// Layout test cases and their inputs, shared by tests/layout/layout_cpu_test.cpp and
// layout_cuda_test.cpp: the case description, the expert ids (with invalid ids and repeated
// experts mixed in), the expert map and the LayoutConfig. Header-only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/test_data.h"
#include "switchyard/layout.h"

namespace sy_test {

enum class LocalKind { kAll, kRange, kMap };

// Tokens with two picks of one expert (ids are data: nothing forbids them, and the one-block
// kernels' bitmap ranking must notice them): none, in about a third of the tokens, or in the last
// token only (one duplicate among all the picks, in the last block of a cluster).
enum class Duplicates { kNone, kMany, kLastToken };

struct LayoutCase {
  std::int64_t T = 0;
  int E = 8;
  int K = 1;
  int M = 1;
  Skew skew = Skew::kUniform;
  bool ids64 = false;
  LocalKind local = LocalKind::kAll;
  int start = 0;         // range form
  int count = -1;        // range and map forms: L
  int stride = 1;        // range form
  bool invalid = false;  // mix -1 and ids outside [0, E) into the picks
  Duplicates duplicates = Duplicates::kNone;
  bool independent_blocks = false;  // LayoutConfig::independent_blocks
};

inline std::string describe(const LayoutCase& c) {
  std::ostringstream os;
  os << "T=" << c.T << " E=" << c.E << " K=" << c.K << " M=" << c.M << " skew=" << skew_name(c.skew)
     << " ids=" << (c.ids64 ? "int64" : "int32") << " local=";
  switch (c.local) {
    case LocalKind::kAll:
      os << "all";
      break;
    case LocalKind::kRange:
      os << "range(start=" << c.start << ",count=" << c.count << ",stride=" << c.stride << ")";
      break;
    case LocalKind::kMap:
      os << "map(L=" << c.count << ")";
      break;
  }
  os << " invalid=" << c.invalid << " duplicates="
     << (c.duplicates == Duplicates::kNone   ? "none"
         : c.duplicates == Duplicates::kMany ? "many"
                                             : "last");
  if (c.independent_blocks) os << " independent_blocks";
  return os.str();
}

inline int num_local(const LayoutCase& c) { return c.local == LocalKind::kAll ? c.E : c.count; }

// Fills in a random range or map for a case whose `local` kind is set.
inline void pick_local(LayoutCase& c, std::mt19937_64& g, int stride) {
  if (c.local == LocalKind::kRange) {
    c.stride = stride;
    c.start = static_cast<int>(g() % static_cast<std::uint64_t>(std::max(1, c.E / 2)));
    const int max_count = (c.E - 1 - c.start) / c.stride + 1;
    c.count = 1 + static_cast<int>(g() % static_cast<std::uint64_t>(max_count));
  } else if (c.local == LocalKind::kMap) {
    c.count = 1 + static_cast<int>(g() % static_cast<std::uint64_t>(c.E));
  }
}

// The LayoutConfig of a case; `expert_map` ([E] int32 on `device`) is read in the map form only.
inline switchyard::LayoutConfig make_config(const LayoutCase& c, const void* expert_map,
                                            switchyard::Device device) {
  switchyard::LayoutConfig config;
  config.num_experts = c.E;
  config.tile_size = c.M;
  config.independent_blocks = c.independent_blocks;
  switch (c.local) {
    case LocalKind::kAll:
      config.local = switchyard::LocalExperts::all();
      break;
    case LocalKind::kRange:
      config.local = switchyard::LocalExperts::range(c.start, c.count, c.stride);
      break;
    case LocalKind::kMap:
      config.local = switchyard::LocalExperts::map(
          switchyard::TensorView::of(expert_map, switchyard::DType::kInt32, {c.E}, device), c.count);
      break;
  }
  return config;
}

struct LayoutInputs {
  std::vector<std::int64_t> ids;  // values; handed to the library as int32 or int64
  std::vector<std::int32_t> ids32;
  std::vector<std::int32_t> expert_map;  // map form only
};

// The constants in which the CPU and the GPU layout tests draw their inputs differently. Each
// test keeps its own, so that a seed (SY_TEST_SEED) still gives the inputs it gave before.
struct LayoutInputsDraw {
  std::uint64_t salt = 0;  // seed ^ salt drives the map, the hot expert and the invalid ids
  // Map entries that count as -1: {-1, map_negative[0], map_negative[1], L, L + map_past_l,
  // INT32_MIN, INT32_MAX}.
  std::int32_t map_negative[2] = {-1, -1};
  std::int32_t map_past_l = 1;
  bool random_hot = false;                  // one-hot expert without a local set: drawn from [0, E), else 0
  double fast_ids_above = 2e5;              // T * K * E above which the ids come from fast_random_ids
  std::vector<std::int64_t> invalid_ids64;  // int64 ids added to the invalid ones
  int invalid_every = 16;  // about 1 in this many ids is invalid; 0: 1 in 4-32, drawn per case
};

// The ids (and, in the map form, the expert map) of a case.
inline LayoutInputs make_layout_inputs(const LayoutCase& c, std::uint64_t seed,
                                       const LayoutInputsDraw& draw) {
  LayoutInputs in;
  std::mt19937_64 g(seed ^ draw.salt);
  if (c.local == LocalKind::kMap) {
    // An injective map onto a random subset of [0, L), the other entries -1 or junk that counts as -1.
    const int L = c.count;
    std::vector<int> perm(c.E);
    for (int e = 0; e < c.E; ++e) perm[e] = e;
    std::shuffle(perm.begin(), perm.end(), g);
    const std::int32_t junk[] = {-1,
                                 draw.map_negative[0],
                                 draw.map_negative[1],
                                 L,
                                 L + draw.map_past_l,
                                 std::numeric_limits<std::int32_t>::min(),
                                 std::numeric_limits<std::int32_t>::max()};
    in.expert_map.resize(c.E);
    for (int e = 0; e < c.E; ++e) in.expert_map[e] = junk[g() % 7];
    int placed = 0;
    for (int l = 0; l < L && placed < c.E; ++l) {
      if (g() % 8 == 0) continue;  // about 1 in 8 local experts has no global expert
      in.expert_map[perm[placed++]] = l;
    }
  }
  // One-hot routing sends every token to a local expert when there is one.
  int hot = draw.random_hot ? static_cast<int>(g() % static_cast<std::uint64_t>(c.E)) : 0;
  if (c.local == LocalKind::kRange && c.count > 0) hot = c.start + static_cast<int>(g() % c.count) * c.stride;
  if (c.local == LocalKind::kMap) {
    for (int e = 0; e < c.E; ++e) {
      if (in.expert_map[e] >= 0 && in.expert_map[e] < c.count) {
        hot = e;
        break;
      }
    }
  }
  in.ids = static_cast<double>(c.T) * c.K * c.E <= draw.fast_ids_above
               ? random_ids(c.T, c.K, c.E, c.skew, seed, hot)
               : fast_random_ids(c.T, c.K, c.E, c.skew, seed, hot);
  if (c.duplicates == Duplicates::kMany) repeat_slots(in.ids, c.T, c.K, g, 0, 3);
  if (c.duplicates == Duplicates::kLastToken) repeat_slots(in.ids, c.T, c.K, g, c.T - 1, 1);
  if (c.invalid) {
    std::vector<std::int64_t> bad = {-1,
                                     -1,
                                     -1,
                                     -2,
                                     c.E,
                                     c.E + 1,
                                     -1000000,
                                     std::numeric_limits<std::int32_t>::min(),
                                     std::numeric_limits<std::int32_t>::max()};
    if (c.ids64) bad.insert(bad.end(), draw.invalid_ids64.begin(), draw.invalid_ids64.end());
    const std::uint64_t every =
        draw.invalid_every > 0 ? static_cast<std::uint64_t>(draw.invalid_every) : 4 + g() % 29;
    for (std::int64_t& id : in.ids) {
      if (g() % every == 0) id = bad[g() % bad.size()];
    }
  }
  if (!c.ids64) in.ids32.assign(in.ids.begin(), in.ids.end());
  return in;
}

}  // namespace sy_test
