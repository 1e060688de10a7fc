// CPU reference router: the oracle for the CUDA routing kernels.
//
// Two scoring rules:
//  - softmax (Qwen3-MoE, Mixtral): p = softmax(logits) over all E experts in fp32, take the top-k
//    of p, optionally renormalise the k weights to sum to 1 (norm_topk_prob).
//  - sigmoid with a correction bias and group-limited top-k (DeepSeek-V3): s = sigmoid(logits);
//    choice scores c = s + bias; experts are split into n_groups equal groups, each group is scored
//    by the sum of its two best c, the best topk_groups groups are kept, the top-k of c inside
//    them are chosen, and the weights are the unbiased s of those experts, optionally
//    renormalised, times routed_scaling_factor.
// Ties are broken toward the lower expert index, so results are deterministic. Output slots are in
// descending score order (like torch.topk(sorted=True)).
#pragma once

#include <cstdint>
#include <vector>

#include "core/error.h"

namespace moebius::cpu {

enum class RouterScoring : uint8_t { kSoftmax, kSigmoid };

struct RouterConfig {
  int num_experts = 0;  // E
  int top_k = 0;        // k
  RouterScoring scoring = RouterScoring::kSoftmax;
  bool renormalize = true;  // norm_topk_prob
  // Sigmoid scoring only (DeepSeek-V3 style). n_groups == 1 means no group limit.
  int n_groups = 1;
  int topk_groups = 1;
  float routed_scaling_factor = 1.0f;
  std::vector<float> correction_bias;  // [E], empty = zeros

  Status validate() const;
};

// logits: [T, E] fp32. expert_ids: [T, k]. weights: [T, k] fp32.
Status route_reference(const RouterConfig& cfg, const float* logits, int64_t num_tokens, int32_t* expert_ids,
                       float* weights);

}  // namespace moebius::cpu
