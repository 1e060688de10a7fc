// CPU reference of the routed-expert DMA choice [TAG_EXPERT_ROUTED_DMA]; see expert_dma.h.
#include "cpu/expert_dma.h"

#include <algorithm>

#include "core/error.h"

namespace moebius::cpu {

std::vector<ExpertDmaChoice> expert_dma_choose(std::span<const int32_t> topk_ids, int rows, int top_k,
                                               int num_experts, std::span<const uint8_t> home13,
                                               std::span<const uint8_t> home2, int slots) {
  MOEBIUS_ASSERT(rows >= 0 && top_k > 0 && static_cast<size_t>(rows) * static_cast<size_t>(top_k) <= topk_ids.size());
  MOEBIUS_ASSERT(num_experts > 0 && home13.size() == static_cast<size_t>(num_experts) &&
                 home2.size() == static_cast<size_t>(num_experts));
  std::vector<ExpertDmaChoice> out;
  std::vector<uint8_t> seen(static_cast<size_t>(num_experts), 0);
  for (size_t p = 0; p < static_cast<size_t>(rows) * static_cast<size_t>(top_k); ++p) {
    const int32_t e = topk_ids[p];
    if (e < 0 || e >= num_experts || seen[static_cast<size_t>(e)] != 0) continue;
    seen[static_cast<size_t>(e)] = 1;
    const unsigned parts = (home13[static_cast<size_t>(e)] ? 1u : 0u) | (home2[static_cast<size_t>(e)] ? 2u : 0u);
    if (parts != 0 && static_cast<int>(out.size()) < slots) out.push_back({e, parts});
  }
  return out;
}

}  // namespace moebius::cpu
