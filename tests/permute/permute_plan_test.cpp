// The gather / combine plan (src/cuda/permute/permute_plan.h) on the CPU: row chunks cover the row
// in whole steps, chunks shrink until the resident warps have enough items, grids stay within the
// resident blocks. permute_cuda_test.cpp checks the kernels' output for these plans on the GPU.
#include <gtest/gtest.h>

#include <cstdint>

#include "cuda/permute/permute_plan.h"

namespace {

using switchyard::cuda::permute::balanced_chunks;
using switchyard::cuda::permute::chunk_row;
using switchyard::cuda::permute::Chunking;
using switchyard::cuda::permute::grid_blocks;
using switchyard::cuda::permute::kBalancedItemsPerWarp;
using switchyard::cuda::permute::slot_chunks;

TEST(PermutePlan, ChunksCoverTheRowInWholeSteps) {
  for (std::int64_t row : {1, 31, 32, 33, 448, 896, 1000, 4096, 7168, 100000}) {
    for (std::int64_t step : {1, 32, 64, 256}) {
      for (std::int64_t max_steps : {1, 2, 4, 8}) {
        const Chunking c = chunk_row(row, step, max_steps);
        ASSERT_GE(c.chunks, 1);
        ASSERT_EQ(c.chunk_vecs % step, 0) << row << " " << step;
        ASSERT_LE(c.chunk_vecs, step * max_steps);
        ASSERT_GE(c.chunks * c.chunk_vecs, row);
        // No empty chunk: the last one starts inside the row.
        ASSERT_LT((c.chunks - 1) * c.chunk_vecs, row) << row << " " << step << " " << max_steps;
        // As few chunks as the largest allowed chunk gives.
        ASSERT_EQ(c.chunks, (row + step * max_steps - 1) / (step * max_steps));
      }
    }
  }
}

TEST(PermutePlan, BalancedChunksShrinkForSmallCalls) {
  // 7168 bf16 values a row = 896 16-byte vectors; 132 SMs x 8 blocks x 8 warps resident.
  const std::int64_t warps = 132 * 8 * 8;
  const Chunking big = balanced_chunks(896, 32, 8, 65536, warps);
  EXPECT_EQ(big.chunk_vecs, 224);  // 896 / 256 vectors per item -> 4 items of 224
  EXPECT_EQ(big.chunks, 4);
  const Chunking small = balanced_chunks(896, 32, 8, 8, warps);
  EXPECT_EQ(small.chunk_vecs, 32);  // single steps: 28 items a row
  EXPECT_EQ(small.chunks, 28);
  // In between: the largest chunk that still gives every warp kBalancedItemsPerWarp items.
  for (std::int64_t rows : {64, 512, 2048, 8192}) {
    const Chunking c = balanced_chunks(896, 32, 8, rows, warps);
    if (c.chunk_vecs > 32) {
      EXPECT_GE(rows * c.chunks, kBalancedItemsPerWarp * warps) << rows;
      const Chunking smaller = chunk_row(896, 32, c.chunk_vecs / 32 - 1);
      EXPECT_GE(smaller.chunks, c.chunks);
    }
  }
}

TEST(PermutePlan, SlotChunksFillEveryWarpSlot) {
  const std::int64_t slots = 132 * 16 * 4;
  for (std::int64_t tokens : {1, 16, 128, 1024, 4096, 65536}) {
    const Chunking c = slot_chunks(896, 32, 8, tokens, slots);
    if (c.chunk_vecs > 32) EXPECT_GE(tokens * c.chunks, slots) << tokens;
    if (tokens >= 4096) EXPECT_EQ(c.chunk_vecs, 224) << tokens;
  }
}

TEST(PermutePlan, GridWithinTheResidentBlocks) {
  EXPECT_EQ(grid_blocks(0, 8, 1056), 1);
  EXPECT_EQ(grid_blocks(1, 8, 1056), 1);
  EXPECT_EQ(grid_blocks(9, 8, 1056), 2);
  EXPECT_EQ(grid_blocks(1 << 20, 8, 1056), 1056);
}

}  // namespace
