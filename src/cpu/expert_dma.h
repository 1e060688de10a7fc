// CPU reference of the choice that copies a MoE layer's routed cold experts by DMA in offloaded
// decode [TAG_EXPERT_ROUTED_DMA] (kernels/expert_dma.cuh, docs/OFFLOAD.md "Routed experts by DMA").
//
// The live rows' top-k ids [T, k] are read row-major; each expert's first appearance is a
// candidate when at least one of its parts (w13, w2) is still at home in host memory
// (home13[e] / home2[e]: its table entry points into the layer's cold region). Candidates take the
// slots in that order, at most `slots`; the rest stay zero-copy reads. Ids outside [0, E) are
// ignored.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace moebius::cpu {

struct ExpertDmaChoice {
  int expert = 0;
  unsigned parts = 0;  // 1: w13 (weights and scales), 2: w2; kernels::kExpertDmaPart13 / _Part2
  bool operator==(const ExpertDmaChoice&) const = default;
};

std::vector<ExpertDmaChoice> expert_dma_choose(std::span<const int32_t> topk_ids, int rows, int top_k,
                                               int num_experts, std::span<const uint8_t> home13,
                                               std::span<const uint8_t> home2, int slots);

}  // namespace moebius::cpu
