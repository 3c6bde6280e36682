// The layout plan (src/cuda/layout/layout_plan.h) on the CPU: plan_layout_path's choice for given
// fits, the forced paths and the independent-blocks rule. layout_cuda_test.cpp checks every path's
// output on the GPU.
#include <gtest/gtest.h>

#include "cuda/layout/layout_plan.h"

namespace {

using switchyard::cuda::layout_detail::LayoutPath;
using switchyard::cuda::layout_detail::plan_layout_path;

// Which forms fit, as layout.cu's launcher answers them.
struct Fits {
  bool one = true, c8 = true, c16 = true, g32 = true, g64 = true, g128 = true;
  bool one_block() const { return one; }
  bool cluster8() const { return c8; }
  bool cluster16() const { return c16; }
  bool grid(int cb) const { return cb == 32 ? g32 : cb == 64 ? g64 : g128; }
};

Fits beyond_one_block() {
  Fits f;
  f.one = false;
  return f;
}

TEST(LayoutPlan, AutoPathByPicks) {
  EXPECT_EQ(plan_layout_path(4096, 256, LayoutPath::kAuto, false, Fits()), LayoutPath::kOneBlock);
  const Fits f = beyond_one_block();
  EXPECT_EQ(plan_layout_path(4097, 256, LayoutPath::kAuto, false, f), LayoutPath::kCluster16);
  EXPECT_EQ(plan_layout_path(16384, 256, LayoutPath::kAuto, false, f), LayoutPath::kCluster16);
  EXPECT_EQ(plan_layout_path(16385, 256, LayoutPath::kAuto, false, f), LayoutPath::kGrid32);
  EXPECT_EQ(plan_layout_path(32769, 256, LayoutPath::kAuto, false, f), LayoutPath::kGrid64);
  EXPECT_EQ(plan_layout_path(65537, 256, LayoutPath::kAuto, false, f), LayoutPath::kGrid128);
  // Past L = 256 the grid of 128 blocks only where 64 cannot take the picks.
  EXPECT_EQ(plan_layout_path(65537, 257, LayoutPath::kAuto, false, f), LayoutPath::kGrid64);
  EXPECT_EQ(plan_layout_path(2560 * 64 + 1, 257, LayoutPath::kAuto, false, f), LayoutPath::kGrid128);
  // Past what the grid forms take: a cluster where it fits, else the multi-launch pipeline.
  EXPECT_EQ(plan_layout_path(2560 * 128 + 1, 256, LayoutPath::kAuto, false, f), LayoutPath::kCluster16);
  Fits none = f;
  none.c16 = none.c8 = false;
  EXPECT_EQ(plan_layout_path(2560 * 128 + 1, 256, LayoutPath::kAuto, false, none), LayoutPath::kChunked);
}

TEST(LayoutPlan, FormsTheDeviceCannotRunAreSkipped) {
  Fits f = beyond_one_block();
  f.c16 = false;  // no 16 free SMs in one GPC
  EXPECT_EQ(plan_layout_path(8192, 256, LayoutPath::kAuto, false, f), LayoutPath::kGrid32);
  f.g32 = f.g64 = f.g128 = false;  // no cooperative grid of that many blocks
  EXPECT_EQ(plan_layout_path(8192, 256, LayoutPath::kAuto, false, f), LayoutPath::kCluster8);
  f.c8 = false;
  EXPECT_EQ(plan_layout_path(8192, 256, LayoutPath::kAuto, false, f), LayoutPath::kChunked);
}

TEST(LayoutPlan, ForcedPathWhereItFits) {
  const LayoutPath forced[] = {LayoutPath::kOneBlock, LayoutPath::kCluster8, LayoutPath::kCluster16,
                               LayoutPath::kGrid32,   LayoutPath::kGrid64,   LayoutPath::kGrid128,
                               LayoutPath::kChunked};
  for (LayoutPath p : forced) EXPECT_EQ(plan_layout_path(100000, 128, p, false, Fits()), p);
  // Where it does not fit, the automatic choice.
  Fits f = beyond_one_block();
  f.g32 = false;
  EXPECT_EQ(plan_layout_path(20000, 128, LayoutPath::kOneBlock, false, f), LayoutPath::kGrid64);
  EXPECT_EQ(plan_layout_path(20000, 128, LayoutPath::kGrid32, false, f), LayoutPath::kGrid64);
}

TEST(LayoutPlan, IndependentBlocksNeverWaitForEachOther) {
  for (LayoutPath p : {LayoutPath::kAuto, LayoutPath::kCluster16, LayoutPath::kGrid64, LayoutPath::kOneBlock}) {
    EXPECT_EQ(plan_layout_path(2048, 64, p, true, Fits()), LayoutPath::kOneBlock);
    EXPECT_EQ(plan_layout_path(20000, 64, p, true, beyond_one_block()), LayoutPath::kChunked);
  }
  EXPECT_EQ(plan_layout_path(2048, 64, LayoutPath::kChunked, true, Fits()), LayoutPath::kChunked);
}

}  // namespace
