// The CPU reference of the next-layer expert prediction [TAG_EXPERT_PREFETCH]
// (cpu/expert_prefetch.h): the logits by hand on small cases, and the selection's rules (the
// predicted top-k only, cold experts only, Borda order over tokens, ties to the lower id, the
// slot cap, no tokens). The GPU kernels are checked against it in tests/gpu/test_expert_prefetch.cu.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/dtype.h"
#include "cpu/expert_prefetch.h"
#include "offload/expert_cache.h"

namespace moebius::cpu {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

std::vector<bf16> bf16s(const std::vector<float>& v) {
  std::vector<bf16> out;
  for (float x : v) out.emplace_back(x);
  return out;
}

TEST(ExpertPrefetchCpu, LogitsAreTheNextRouterOnTheNormalisedResidual) {
  // H = 2: x = resid + delta = (3, 4) -> rms = sqrt(12.5); xn = x / rms * w.
  ExpertPrefetchShape s{2, 3, 1, 0.0f};
  const std::vector<float> resid = {1, 4};
  const std::vector<bf16> delta = bf16s({2, 0});
  const std::vector<float> w = {1, 0.5f};
  const std::vector<bf16> router = bf16s({1, 0, 0, 1, 1, 1});
  const std::vector<float> bias = {0, 0, 0.25f};
  const std::vector<float> l = expert_prefetch_logits(s, 1, resid, delta, w, router, bias);
  const float r = 1.0f / std::sqrt(12.5f);
  const float x0 = static_cast<float>(bf16(3 * r * 1)), x1 = static_cast<float>(bf16(4 * r * 0.5f));
  ASSERT_EQ(l.size(), 3u);
  EXPECT_NEAR(l[0], x0, 1e-6);
  EXPECT_NEAR(l[1], x1, 1e-6);
  EXPECT_NEAR(l[2], x0 + x1 + 0.25f, 1e-6);
  // Without delta and bias: the residual alone.
  const std::vector<float> l2 = expert_prefetch_logits(s, 1, resid, {}, w, router, {});
  const float r2 = 1.0f / std::sqrt(8.5f);
  EXPECT_NEAR(l2[0], static_cast<float>(bf16(1 * r2)), 1e-6);
  EXPECT_NEAR(l2[1], static_cast<float>(bf16(4 * r2 * 0.5f)), 1e-6);
}

TEST(ExpertPrefetchCpu, SelectsTheColdExpertsOfThePredictedTopKInOrder) {
  ExpertPrefetchShape s{0, 6, 3, 0};
  // One token: top-3 by logit is 4, 1, 5 (ranks 0, 1, 2); 2 is fourth.
  const std::vector<float> l = {0.1f, 0.8f, 0.5f, -1.0f, 0.9f, 0.7f};
  const std::vector<uint8_t> all_cold(6, 1);
  EXPECT_THAT(expert_prefetch_select(s, 1, l, all_cold, 8), ElementsAre(4, 1, 5));
  EXPECT_THAT(expert_prefetch_select(s, 1, l, all_cold, 2), ElementsAre(4, 1));
  // Resident experts are skipped, and nothing outside the top-k fills their place.
  const std::vector<uint8_t> cold = {1, 0, 1, 1, 1, 1};
  EXPECT_THAT(expert_prefetch_select(s, 1, l, cold, 8), ElementsAre(4, 5));
  const std::vector<uint8_t> none(6, 0);
  EXPECT_THAT(expert_prefetch_select(s, 1, l, none, 8), IsEmpty());
  EXPECT_THAT(expert_prefetch_select(s, 0, l, all_cold, 8), IsEmpty());
  EXPECT_THAT(expert_prefetch_select(s, 1, l, all_cold, 0), IsEmpty());
}

TEST(ExpertPrefetchCpu, RanksAcrossTokensByBordaCountWithTiesToTheLowerId) {
  ExpertPrefetchShape s{0, 5, 2, 0};
  // Token 0: top-2 = 3 (2 points), 0 (1 point). Token 1: top-2 = 0 (2), 2 (1). Token 2: 3 (2), 2 (1).
  // Scores: 0 -> 3, 2 -> 2, 3 -> 4.
  const std::vector<float> l = {
      0.5f, 0.1f, 0.2f, 0.9f, -1.f,  //
      0.9f, 0.1f, 0.5f, 0.2f, -1.f,  //
      0.1f, 0.2f, 0.5f, 0.9f, -1.f,  //
  };
  const std::vector<uint8_t> cold(5, 1);
  EXPECT_THAT(expert_prefetch_select(s, 3, l, cold, 8), ElementsAre(3, 0, 2));
  // Equal logits: the lower id ranks first inside a token, and equal scores keep the lower id first.
  const std::vector<float> tie = {1.f, 1.f, 1.f, 0.f, 0.f};
  EXPECT_THAT(expert_prefetch_select(s, 1, tie, cold, 8), ElementsAre(0, 1));
  const std::vector<float> two = {
      1.f, 0.f, 0.f, 0.f, 0.9f,  //
      0.f, 0.f, 0.f, 0.9f, 1.f,  //
  };
  // Scores: 0 -> 2, 4 -> 1 + 2 = 3, 3 -> 1.
  EXPECT_THAT(expert_prefetch_select(s, 2, two, cold, 8), ElementsAre(4, 0, 3));
}

TEST(ExpertPrefetchFlags, TheFlagIsAnOffloadFlag) {
  // The commands refuse offload flags on the CPU backend by this name.
  EXPECT_EQ(offload::first_offload_flag("", "", offload::ExpertCacheFlags{}, 2), "--expert-prefetch");
  EXPECT_EQ(offload::first_offload_flag("", "", offload::ExpertCacheFlags{}, 0), "");
  EXPECT_EQ(offload::first_offload_flag("", "", offload::ExpertCacheFlags{}, 0, 8), "--expert-dma");
  // --expert-dma 0 is off and an absent flag (-1) leaves it to the environment: neither asks for offload.
  EXPECT_EQ(offload::first_offload_flag("", "", offload::ExpertCacheFlags{}, 0, 0), "");
  EXPECT_EQ(offload::first_offload_flag("", "", offload::ExpertCacheFlags{}, 0, -1), "");
  EXPECT_EQ(offload::first_offload_flag("24", "", offload::ExpertCacheFlags{}, 2), "--gpu-memory-budget");
}

}  // namespace
}  // namespace moebius::cpu
