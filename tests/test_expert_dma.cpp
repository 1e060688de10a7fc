// The routed-expert DMA choice's CPU reference [TAG_EXPERT_ROUTED_DMA] (cpu/expert_dma.h), by hand:
// order of first appearance over the live rows, one slot per expert, only parts still at home,
// ids out of range and padding rows ignored, the slot count a cap. The GPU kernel is compared with
// it on random routings in tests/gpu/test_expert_dma.cu.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "cpu/expert_dma.h"

namespace moebius::cpu {
namespace {

using C = ExpertDmaChoice;

TEST(ExpertDmaChoose, FirstAppearanceOrderAndPartsAtHome) {
  const int E = 8, k = 3;
  // Expert 2 resident, 5's w2 already copied elsewhere, the rest cold.
  const std::vector<uint8_t> home13 = {1, 1, 0, 1, 1, 1, 1, 1};
  const std::vector<uint8_t> home2 = {1, 1, 0, 1, 1, 0, 1, 1};
  // Rows: {5, 2, 7}, {7, 0, -1}, {9, 5, 3}; a padding row {4, 4, 4} past the two... three live rows.
  const std::vector<int32_t> ids = {5, 2, 7, 7, 0, -1, 9, 5, 3, 4, 4, 4};
  EXPECT_EQ(expert_dma_choose(ids, 3, k, E, home13, home2, 8), (std::vector<C>{{5, 1}, {7, 3}, {0, 3}, {3, 3}}));
  EXPECT_EQ(expert_dma_choose(ids, 3, k, E, home13, home2, 2), (std::vector<C>{{5, 1}, {7, 3}}));
  EXPECT_EQ(expert_dma_choose(ids, 1, k, E, home13, home2, 8), (std::vector<C>{{5, 1}, {7, 3}}));
  EXPECT_EQ(expert_dma_choose(ids, 4, k, E, home13, home2, 8),
            (std::vector<C>{{5, 1}, {7, 3}, {0, 3}, {3, 3}, {4, 3}}));
  EXPECT_TRUE(expert_dma_choose(ids, 0, k, E, home13, home2, 8).empty());
  const std::vector<uint8_t> none(E, 0);
  EXPECT_TRUE(expert_dma_choose(ids, 4, k, E, none, none, 8).empty());  // every expert resident
}

}  // namespace
}  // namespace moebius::cpu
