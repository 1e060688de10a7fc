// [TAG_INT_GROUP_STARTS] The decode k-loops' scale-group starts (GroupStarts, kernels/moe_dequant.cuh)
// against the division they replace: k-step s of a warp's range opens a group, and the warp flushes
// the previous one, exactly when s / group_steps differs from the previous step's. Host-side (the
// struct is __host__ __device__), so it runs in CI without a GPU. Covered: every group size the
// GPU tests use and more (16-1024, 48 not a power of two), warp ranges that start mid-group, windows
// of up to 64 steps at any offset (the one-tile kernel's batches), and the compile-time forms of
// the group-128 instances (aligned: whole groups per warp; chunk starts only: int4 GEMM2).
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "kernels/moe_dequant.cuh"

namespace moebius::kernels::moe_detail {
namespace {

// The division the kernels used to do at every k-step.
bool opens_by_division(int first_step, int j, int group_steps) {
  const int s = first_step + j;
  return j > 0 && s / group_steps != (s - 1) / group_steps;
}

// A warp walks steps [first, first + n) in windows of `window_steps` (a batch of chunks), as
// moe_gemm_kernel does: the first window from first_window, later ones from window. Each step's
// answer and the running group index must match the division.
void walk(int group_size, int first, int n, int window_steps) {
  const GroupStarts gs(group_size);
  const int group_steps = group_size / 16;
  int current = gs.group_of(first);
  ASSERT_EQ(current, first / group_steps);
  for (int w0 = 0; w0 < n; w0 += window_steps) {
    const uint64_t bits = w0 == 0 ? gs.first_window(first + w0) : gs.window(first + w0);
    for (int j = 0; j < window_steps && w0 + j < n; ++j) {
      const bool want = opens_by_division(first, w0 + j, group_steps);
      ASSERT_EQ((gs.opens<0, 64, false>(bits, j)), want)
          << "group " << group_size << " first step " << first << " step " << w0 + j << " window " << window_steps;
      if (want) ++current;
      ASSERT_EQ(current, (first + w0 + j) / group_steps) << "group index, group " << group_size << " step " << w0 + j;
    }
  }
}

TEST(GroupStarts, MatchesTheDivisionForEveryGroupSizeOffsetAndWindow) {
  for (int group_size : {16, 32, 48, 64, 128, 256, 512, 1024})
    for (int first = 0; first < 200; ++first)
      for (int window_steps : {4, 8, 16, 32, 64})
        for (int n : {1, 3, 12, 32, 64, 150}) walk(group_size, first, n, window_steps);
}

// The group-128 row-tile instances: a warp's range starts at chunk c_begin = warp * P, k-step
// c_begin * KC / 16. Aligned (P * KC a multiple of 128): the compile-time answer needs no bit.
// Otherwise (int4 GEMM2: KC = 64, P = 3) only chunk starts read the bit.
template <int KC, int P>
void check_group128_instance() {
  constexpr int kSteps = KC / 16;
  constexpr bool kAligned = (P * KC) % 128 == 0;
  const GroupStarts gs(128);
  for (int warp = 0; warp < 4; ++warp) {
    const int first = warp * P * kSteps;
    const uint64_t bits = gs.first_window(first);
    for (int j = 0; j < P * kSteps; ++j)
      EXPECT_EQ((gs.opens<128, KC, kAligned>(bits, j)), opens_by_division(first, j, 8))
          << "KC " << KC << " P " << P << " warp " << warp << " step " << j;
  }
}

TEST(GroupStarts, Group128InstancesAgreeWithTheDivision) {
  check_group128_instance<64, 8>();   // int4 GEMM1, Qwen3-30B-A3B (K = 2048)
  check_group128_instance<64, 4>();   // int4 GEMM1 at K = 1024, GEMM2 at K = 1024
  check_group128_instance<64, 3>();   // int4 GEMM2 at I = 768: warps 1 and 3 start mid-group
  check_group128_instance<128, 8>();  // int2 GEMM1 at K = 4096
  check_group128_instance<128, 4>();  // int2 GEMM1 at K = 2048
  check_group128_instance<128, 3>();  // int2 GEMM2 at K = 1536
}

// The one-tile kernel's group-128 instance: windows start at chunk boundaries (batches of chunks),
// and only chunk starts read the bit.
TEST(GroupStarts, OneTileGroup128ReadsChunkStartsOnly) {
  const GroupStarts gs(128);
  for (int c_begin = 0; c_begin < 40; ++c_begin)
    for (int batch : {4, 8}) {
      constexpr int kSteps = 4;  // int4, KC = 64
      const int first = c_begin * kSteps;
      for (int c0 = c_begin; c0 < c_begin + 24; c0 += batch) {
        const uint64_t bits = c0 == c_begin ? gs.first_window(c0 * kSteps) : gs.window(c0 * kSteps);
        for (int j = 0; j < batch * kSteps; ++j)
          ASSERT_EQ((gs.opens<128, 64, false>(bits, j)), opens_by_division(first, (c0 - c_begin) * kSteps + j, 8))
              << "c_begin " << c_begin << " batch at chunk " << c0 << " step " << j;
      }
    }
}

}  // namespace
}  // namespace moebius::kernels::moe_detail
