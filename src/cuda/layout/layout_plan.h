// The layout plan: which path layout() takes for N = T * K picks over L local experts
// (plan_layout_path), and the thresholds it and the launchers use, each with its evidence (H200
// figures; docs/decisions/layout-path-selection.md holds the tables). Plain C++: what the call's
// device can run comes in as `fits` (layout.cu derives it from the kernels' shared memory and the
// device's occupancy answers), so the choice is tested on the CPU (tests/layout/layout_plan_test.cpp).
//
// Paths, by N (the one-launch kernel of one_launch_layout_kernel.cuh while its shared memory fits):
//   N <= kOneBlockMaxPicks: the one-block form, one launch, every block ranks all picks;
//   else the one-launch kernel on CB blocks, each ranking a chunk of N / CB picks: one 16-block
//   cluster, or a cooperative grid of 32, 64 or 128 blocks (the grid form). CB is the smallest of
//   16 / 32 / 64 / 128 with N <= kPicksPerBlock * CB (128 only for L <= kGrid128MaxLocal: every
//   block loads CB rows of L counts), else the largest with N <= kMaxPicksPerBlock * CB; where none
//   fits or can be scheduled, one 16-block or 8-block cluster;
//   else (or L too large): the sorting kernel up to kSmallMaxPicks, then the chunked pipeline.
// LayoutOptions::path forces a path where it fits the call; LayoutConfig::independent_blocks
// leaves only the one-block form and the multi-launch pipeline (whose blocks never wait for each
// other), where a forced chunked path still applies.
#pragma once

#include "switchyard/layout.h"

namespace switchyard::cuda::layout_detail {

using LayoutPath = LayoutOptions::Path;

// One-block form up to this N: past it more blocks share the ranking and the row stores (E=256 K=8
// N = 65536: 16-block cluster 9.36 us, grid of 64 blocks 6.32).
inline constexpr long long kOneBlockMaxPicks = 4096;
// The one-launch forms' preferred chunk of picks a block, and the most before the chunked pipeline.
inline constexpr long long kPicksPerBlock = 1024;
inline constexpr long long kMaxPicksPerBlock = 2560;
// The grid of 128 blocks only up to this L: each block loads 128 rows of L counts.
inline constexpr int kGrid128MaxLocal = 256;
// The grid form's blocks each load CB * L counts: at most this many (the largest measured, E=512 on
// 128 blocks; past it the chunked pipeline's scan kernel does that work once).
inline constexpr long long kGridMaxExchange = 65536;
// One-block form: about this many rows (of the row capacity) a block, at most one block an SM (1024
// rows a block were faster than 2048 at every T measured).
inline constexpr long long kRowsPerOneBlock = 1024;
// Multi-launch paths: one sorting kernel up to kSmallMaxPicks, histogram / scan / scatter over
// chunks of kMediumChunk picks up to kMediumMaxPicks (64..256 blocks: enough to fill the SMs), then
// chunks of 2048 while the chunk histograms stay within kFineMaxHistEntries, else of 4096 (E=256 K=8
// T = 65536: 17.52 us with 2048 against 21.94 with 4096).
inline constexpr long long kSmallMaxPicks = 4096;
inline constexpr long long kMediumMaxPicks = 131072;
inline constexpr int kMediumThreads = 256;
inline constexpr int kMediumItems = 2;
inline constexpr int kMediumChunk = kMediumThreads * kMediumItems;  // 512
inline constexpr int kLargeThreads = 512;
inline constexpr int kLargeItems = 8;
inline constexpr int kLargeChunk = kLargeThreads * kLargeItems;  // 4096
inline constexpr int kFineItems = 4;
inline constexpr int kFineChunk = kLargeThreads * kFineItems;  // 2048
inline constexpr long long kFineMaxHistEntries = 65536;
// Sorting kernel: about this many output rows a block, at most this many blocks (each repeats the
// sort of all N <= 4096 picks, so more blocks cost L2 reads only).
inline constexpr long long kRowsPerSmallBlock = 2048;
inline constexpr long long kMaxSmallBlocks = 128;

// The path for N picks over L local experts. Fits answers, for this call on this device:
// one_block(), cluster8(), cluster16() (fits and a 16-block cluster can be scheduled) and grid(CB)
// for CB = 32, 64, 128 (fits, the workspace holds CB rows of counts, CB * L <= kGridMaxExchange and
// all CB blocks can be resident at once). Returns kChunked for the multi-launch paths (the sorting
// kernel or the chunked pipeline, by N).
template <class Fits>
LayoutPath plan_layout_path(long long picks, int num_local, LayoutPath forced, bool independent_blocks,
                            const Fits& fits) {
  if (independent_blocks) {
    return forced != LayoutPath::kChunked && fits.one_block() ? LayoutPath::kOneBlock : LayoutPath::kChunked;
  }
  switch (forced) {
    case LayoutPath::kOneBlock:
      if (fits.one_block()) return forced;
      break;
    case LayoutPath::kCluster8:
      if (fits.cluster8()) return forced;
      break;
    case LayoutPath::kCluster16:
      if (fits.cluster16()) return forced;
      break;
    case LayoutPath::kGrid32:
      if (fits.grid(32)) return forced;
      break;
    case LayoutPath::kGrid64:
      if (fits.grid(64)) return forced;
      break;
    case LayoutPath::kGrid128:
      if (fits.grid(128)) return forced;
      break;
    case LayoutPath::kChunked:
      return forced;
    case LayoutPath::kAuto:
      break;
  }
  if (fits.one_block()) return LayoutPath::kOneBlock;
  const bool grid128_preferred = num_local <= kGrid128MaxLocal;
  if (picks <= kPicksPerBlock * 16 && fits.cluster16()) return LayoutPath::kCluster16;
  if (picks <= kPicksPerBlock * 32 && fits.grid(32)) return LayoutPath::kGrid32;
  if (picks <= kPicksPerBlock * 64 && fits.grid(64)) return LayoutPath::kGrid64;
  if (grid128_preferred && picks <= kPicksPerBlock * 128 && fits.grid(128)) return LayoutPath::kGrid128;
  if (picks <= kMaxPicksPerBlock * 64 && fits.grid(64)) return LayoutPath::kGrid64;
  if (picks <= kMaxPicksPerBlock * 128 && fits.grid(128)) return LayoutPath::kGrid128;
  if (fits.cluster16()) return LayoutPath::kCluster16;
  if (fits.cluster8()) return LayoutPath::kCluster8;
  return LayoutPath::kChunked;
}

}  // namespace switchyard::cuda::layout_detail
