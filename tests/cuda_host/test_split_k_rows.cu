// [TAG_DECODE_SPLIT_K] The 8-warp decode GEMM1's launch sizing (kernels/moe_gemm.cuh): the blocks an
// SM each kernel instance is built for, and the default row tiles per block that fill one wave of
// them. Host-side (constexpr), so CI checks what the GPU tests cannot see: rows per block never
// change an output, so a launch sized for the wrong instance passes every oracle.
#include <gtest/gtest.h>

#include "kernels/moe_gemm.cuh"

namespace moebius::kernels {
namespace {

TEST(SplitKLaunch, BlocksPerSmFollowTheInstanceThatRuns) {
  // int2 at group 128 is the 3-block instance; int2 at any other group runs the run-time-group
  // instance, built for 2 (session 39 sized it for 3: too few rows a block, a second wave).
  EXPECT_EQ(split_k_blocks_per_sm(MoeWeightFormat::kInt2, 128), 3);
  EXPECT_EQ(split_k_blocks_per_sm(MoeWeightFormat::kInt2, 32), 2);
  EXPECT_EQ(split_k_blocks_per_sm(MoeWeightFormat::kInt2, 0), 2);
  for (MoeWeightFormat f : {MoeWeightFormat::kNvFp4, MoeWeightFormat::kInt4}) {
    EXPECT_EQ(split_k_blocks_per_sm(f, 128), 2);
    EXPECT_EQ(split_k_blocks_per_sm(f, 16), 2);
  }
}

TEST(SplitKLaunch, RowsPerBlockFillOneWave) {
  // Qwen3-30B-A3B at T = 1 on 132 SMs: 96 row tiles x 9 grid tiles -> 4 (216 blocks on 264 slots).
  EXPECT_EQ(split_k_rows_for_one_wave(96, 9, 2, 132), 4);
  // 100 row tiles x 3 tiles = 300 one-tile blocks: one wave at 3 an SM (396 slots), two rows a
  // block at 2 (264 slots): the blocks per SM decide it.
  EXPECT_EQ(split_k_rows_for_one_wave(100, 3, 3, 132), 1);
  EXPECT_EQ(split_k_rows_for_one_wave(100, 3, 2, 132), 2);
  EXPECT_EQ(split_k_rows_for_one_wave(100, 3, split_k_blocks_per_sm(MoeWeightFormat::kInt2, 32), 132), 2);
  // Exactly a wave fits; one block more does not.
  EXPECT_EQ(split_k_rows_for_one_wave(264, 1, 2, 132), 1);
  EXPECT_EQ(split_k_rows_for_one_wave(265, 1, 2, 132), 2);
  // Grids too large for 8 rows a block still take 8, the most the kernel walks.
  EXPECT_EQ(split_k_rows_for_one_wave(96, 1000, 2, 132), 8);
  static_assert(split_k_rows_for_one_wave(96, 9, 2, 132) == 4, "usable in constant expressions");
}

}  // namespace
}  // namespace moebius::kernels
