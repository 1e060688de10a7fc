// CPU reference of the next-layer expert prediction that offloaded decode prefetches by
// [TAG_EXPERT_PREFETCH] (kernels/expert_prefetch.cuh, docs/OFFLOAD.md "Prefetch").
//
// After MoE layer j of a decode step, the residual stream x = resid + delta (delta: layer j's MoE
// output) is what the next MoE layer j' will normalise, up to the attention (and any dense layers)
// in between. So j''s own post-attention RMSNorm and router applied to x predict j''s routing:
//   xn[t]      = bf16(x[t] * rsqrt(mean(x[t]^2) + eps) * norm_weight)      [T, H]
//   logits[t]  = router . xn[t] (fp32 sums) + correction_bias             [T, E]
// and the experts worth copying ahead are the cold ones among each token's predicted top-k,
// ranked by a Borda count that is exact in integers on both sides:
//   rank_t(e)  = #{e' : logits[t][e'] > logits[t][e], or equal with e' < e}
//   score(e)   = sum over live tokens t of max(0, k - rank_t(e))
// candidates: cold[e] and score(e) > 0; the first `slots` by (score descending, id ascending).
// At one token the order is the predicted routing's own order.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/dtype.h"

namespace moebius::cpu {

struct ExpertPrefetchShape {
  int hidden = 0;       // H
  int num_experts = 0;  // E
  int top_k = 0;        // k
  float eps = 1e-6f;    // the predicted layer's RMSNorm epsilon
};

// resid [T, H] fp32; delta [T, H] bf16 or empty; norm_weight [H]; router [E, H] bf16;
// correction_bias [E] or empty. Returns logits [T, E].
std::vector<float> expert_prefetch_logits(const ExpertPrefetchShape& s, int tokens, std::span<const float> resid,
                                          std::span<const bf16> delta, std::span<const float> norm_weight,
                                          std::span<const bf16> router, std::span<const float> correction_bias);

// The experts to copy ahead, in order (at most `slots`): logits [T, E], cold [E] (1: in host memory).
std::vector<int> expert_prefetch_select(const ExpertPrefetchShape& s, int tokens, std::span<const float> logits,
                                        std::span<const uint8_t> cold, int slots);

}  // namespace moebius::cpu
