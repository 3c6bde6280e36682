// The gather / combine plan: how a call's rows are cut into warp work items and how many blocks
// walk them. Plain C++ (tests/permute/permute_plan_test.cpp runs it on the CPU); permute.cu feeds
// it the device's resident blocks (SM count x the kernel's occupancy) and launches the result.
// The kernels' own constants (block size, vectors a lane, launch bounds) are permute_kernels.cuh's.
#pragma once

#include <algorithm>
#include <cstdint>

namespace switchyard::cuda::permute {

// A row of row_vecs vectors cut into `chunks` work items of chunk_vecs vectors (the last one shorter).
struct Chunking {
  std::int64_t chunk_vecs = 0;
  std::int64_t chunks = 1;
};

// Splits a row of `row_vecs` vectors into work items of at most `max_steps` steps of `step`
// vectors, as evenly as the step allows.
inline Chunking chunk_row(std::int64_t row_vecs, std::int64_t step, std::int64_t max_steps) {
  Chunking c;
  const std::int64_t max_vecs = step * max_steps;
  c.chunks = std::max<std::int64_t>(1, (row_vecs + max_vecs - 1) / max_vecs);
  const std::int64_t per_chunk = (row_vecs + c.chunks - 1) / c.chunks;
  c.chunk_vecs = std::max<std::int64_t>(step, (per_chunk + step - 1) / step * step);
  return c;
}

// Items per resident warp below which the grid-stride loop's last round leaves too many warps
// idle (the tail is at most 1 / items of the time): then items are made smaller.
inline constexpr std::int64_t kBalancedItemsPerWarp = 16;

// The largest chunks (up to `max_steps` steps) that still give each of `warps` resident warps
// kBalancedItemsPerWarp items over `rows` rows, or single-step chunks. Small calls thereby also
// spread each row over more warps, which is what bounds their latency (the expert-major gather and
// the combine kernels).
inline Chunking balanced_chunks(std::int64_t row_vecs, std::int64_t step, std::int64_t max_steps, std::int64_t rows,
                                std::int64_t warps) {
  for (std::int64_t s = max_steps;; s /= 2) {
    const Chunking c = chunk_row(row_vecs, step, s);
    if (s <= 1 || rows * c.chunks >= kBalancedItemsPerWarp * warps) return c;
  }
}

// The largest chunks (up to `max_steps` steps) that still give every one of `warp_slots` resident
// warps a copy item over `rows` rows, or single-step chunks (the token-major gather: one warp an
// item, as many blocks as items; small calls spread each row over many SMs, large ones move 4 KB a
// warp item).
inline Chunking slot_chunks(std::int64_t row_vecs, std::int64_t step, std::int64_t max_steps, std::int64_t rows,
                            std::int64_t warp_slots) {
  for (std::int64_t s = max_steps;; s /= 2) {
    const Chunking c = chunk_row(row_vecs, step, s);
    if (s <= 1 || rows * c.chunks >= warp_slots) return c;
  }
}

// Blocks of `warps_per_block` warps for `work_items` warp items, at most `max_blocks` (the kernels
// walk their items with a grid stride), at least one.
inline std::int64_t grid_blocks(std::int64_t work_items, int warps_per_block, std::int64_t max_blocks) {
  const std::int64_t wanted = (work_items + warps_per_block - 1) / warps_per_block;
  return std::max<std::int64_t>(1, std::min(wanted, max_blocks));
}

}  // namespace switchyard::cuda::permute
