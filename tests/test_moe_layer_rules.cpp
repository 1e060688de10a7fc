// Host-side rules of the CUDA MoE layer that need no GPU (built when MOEBIUS_HAS_CUDA, run in CI):
// router_takes_gemm, the router GEMM / small-batch router crossover, at the points docs/PERF.md run
// T5 measured on the H200 (us per launch in a PDL chain, small-batch tiles / best GEMM tile):
//   Qwen3-30B-A3B (H 2048, E 128):   512 tokens 7.68 / 9.48, 1024 14.87 / 9.69
//   Qwen3-235B-A22B (H 4096, E 128): 512 15.16 / 17.82, 1024 28.41 / 18.06
//   DeepSeek-V3 (H 7168, E 256):     256 24.10 / 30.35, 512 48.14 / 30.60
// so each geometry must take the tiles at the first size and the GEMM at the second.
#ifdef MOEBIUS_HAS_CUDA

#include <gtest/gtest.h>

#include "moe/moe_layer_cuda.h"

namespace moebius::moe {
namespace {

TEST(RouterTakesGemm, FollowsTheMeasuredCrossovers) {
  EXPECT_FALSE(router_takes_gemm(512, 2048, 128));
  EXPECT_TRUE(router_takes_gemm(1024, 2048, 128));
  EXPECT_FALSE(router_takes_gemm(512, 4096, 128));
  EXPECT_TRUE(router_takes_gemm(1024, 4096, 128));
  EXPECT_FALSE(router_takes_gemm(256, 7168, 256));
  EXPECT_TRUE(router_takes_gemm(512, 7168, 256));
  EXPECT_TRUE(router_takes_gemm(4096, 2048, 128));  // prefill chunks
}

// Below kRouterGemmMinTokens the small-batch router always runs (decode and small batches, where
// the fused small-batch routing must match the separate kernels), whatever the geometry.
TEST(RouterTakesGemm, NeverBelowTheMinimumCapacity) {
  for (int cap : {0, 1, 8, 9, 64, kRouterGemmMinTokens - 1}) {
    EXPECT_FALSE(router_takes_gemm(cap, 2048, 128)) << cap;
    EXPECT_FALSE(router_takes_gemm(cap, 7168, 256)) << cap;
    EXPECT_FALSE(router_takes_gemm(cap, 256, 32)) << cap;
  }
  // Small H: the GEMM from the minimum on (test_ep_dispatch.cu's capacity 320 relies on it).
  EXPECT_TRUE(router_takes_gemm(320, 256, 32));
}

}  // namespace
}  // namespace moebius::moe

#endif  // MOEBIUS_HAS_CUDA
