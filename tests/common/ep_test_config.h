// The expert-parallel group configuration the EP tests build from their cases.
#pragma once

#include <cstdint>

#include "switchyard/ep.h"

namespace sy_test {

// R ranks of L experts each (E = R * L), top-K, rows of H elements of `dtype`, tile M.
template <class Case>
switchyard::ep::GroupConfig ep_group_config(const Case& c, double timeout_seconds) {
  switchyard::ep::GroupConfig cfg;
  cfg.num_ranks = c.R;
  cfg.num_experts = c.R * c.L;
  cfg.top_k = c.K;
  cfg.max_tokens = c.max_tokens;
  cfg.hidden = c.H;
  cfg.dtype = c.dtype;
  cfg.scale_cols = c.scale_cols;
  cfg.tile_size = c.M;
  cfg.timeout_seconds = timeout_seconds;
  return cfg;
}

// An expert-major case (of either EP test's Case type): R ranks of L experts each, top-K, at most
// max_tokens rows of H elements a rank, tile M.
template <class Case>
Case ep_expert_major_case(int R, int L, int K, std::int64_t max_tokens, std::int64_t H, int M) {
  Case c;
  c.R = R;
  c.L = L;
  c.K = K;
  c.max_tokens = max_tokens;
  c.H = H;
  c.expert_major = true;
  c.M = M;
  return c;
}

}  // namespace sy_test
