// The brute-force layout reference of the tests, rebuilt from the docs/design.md section 3
// formulas (buckets filled in ascending x, padded offsets, sentinels, tiles found through the
// owner of their first row), never through library helpers. Shared by the CPU layout tests and
// the fuzz targets. Header-only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/layout_inputs.h"

namespace sy_test {

// Everything a layout must produce, from the docs/design.md formulas.
struct ExpectedLayout {
  std::int64_t rows = 0;   // capacity R
  std::int64_t tiles = 0;  // capacity N
  std::vector<std::int32_t> counts, offsets, permuted_to_expanded, permuted_to_token, expanded_to_permuted,
      tile_expert, tile_row_end, totals;
};

inline ExpectedLayout reference_layout(const LayoutCase& c, const LayoutInputs& in) {
  const std::int64_t T = c.T;
  const std::int64_t K = c.K;
  const std::int64_t TK = T * K;
  const std::int64_t M = c.M;
  const int L = num_local(c);
  // Local index of each global expert, by searching the local set for it.
  std::vector<int> local_of(c.E, -1);
  for (int e = 0; e < c.E; ++e) {
    if (c.local == LocalKind::kMap) {
      const std::int32_t v = in.expert_map[e];
      local_of[e] = (v >= 0 && v < L) ? v : -1;
    } else {
      const int start = c.local == LocalKind::kAll ? 0 : c.start;
      const int stride = c.local == LocalKind::kAll ? 1 : c.stride;
      for (int l = 0; l < L; ++l) {
        if (static_cast<std::int64_t>(start) + static_cast<std::int64_t>(l) * stride == e) {
          local_of[e] = l;
          break;
        }
      }
    }
  }
  std::vector<std::vector<std::int64_t>> bucket(L);
  std::int64_t dropped = 0;
  for (std::int64_t x = 0; x < TK; ++x) {
    const std::int64_t id = in.ids[x];
    if (id == -1) continue;
    if (id < 0 || id >= c.E) {
      ++dropped;
      continue;
    }
    if (local_of[id] >= 0) bucket[local_of[id]].push_back(x);  // ascending x by construction
  }
  ExpectedLayout want;
  // Capacity from the header's formula; nothing can be placed without picks or local experts.
  want.rows = (TK == 0 || L == 0) ? 0 : TK + std::min<std::int64_t>(L, TK) * (M - 1);
  want.tiles = (want.rows + M - 1) / M;
  want.counts.assign(L, 0);
  want.offsets.assign(L + 1, 0);
  std::int64_t row = 0;
  for (int l = 0; l < L; ++l) {
    want.counts[l] = static_cast<std::int32_t>(bucket[l].size());
    want.offsets[l] = static_cast<std::int32_t>(row);
    row += (static_cast<std::int64_t>(bucket[l].size()) + M - 1) / M * M;
  }
  want.offsets[L] = static_cast<std::int32_t>(row);
  const std::int64_t padded_total = row;
  want.permuted_to_expanded.assign(want.rows, static_cast<std::int32_t>(TK));
  want.permuted_to_token.assign(want.rows, static_cast<std::int32_t>(T));
  want.expanded_to_permuted.assign(TK, -1);
  std::vector<int> row_owner(padded_total, -1);
  for (int l = 0; l < L; ++l) {
    for (std::int64_t p = want.offsets[l]; p < want.offsets[l + 1]; ++p) row_owner[p] = l;
    for (std::size_t r = 0; r < bucket[l].size(); ++r) {
      const std::int64_t p = want.offsets[l] + static_cast<std::int64_t>(r);
      const std::int64_t x = bucket[l][r];
      want.permuted_to_expanded[p] = static_cast<std::int32_t>(x);
      want.permuted_to_token[p] = static_cast<std::int32_t>(x / K);
      want.expanded_to_permuted[x] = static_cast<std::int32_t>(p);
    }
  }
  const std::int64_t num_tiles = padded_total / M;
  want.tile_expert.resize(want.tiles);
  want.tile_row_end.resize(want.tiles);
  for (std::int64_t i = 0; i < want.tiles; ++i) {
    if (i < num_tiles) {
      const int l = row_owner[i * M];
      want.tile_expert[i] = l;
      want.tile_row_end[i] =
          static_cast<std::int32_t>(std::min<std::int64_t>((i + 1) * M, want.offsets[l] + want.counts[l]));
    } else {
      want.tile_expert[i] = -1;
      want.tile_row_end[i] = static_cast<std::int32_t>(i * M);
    }
  }
  want.totals = {static_cast<std::int32_t>(padded_total), static_cast<std::int32_t>(num_tiles),
                 static_cast<std::int32_t>(dropped)};
  return want;
}

}  // namespace sy_test
