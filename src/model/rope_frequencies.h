// The rotary frequencies and attention factor of a Qwen3-MoE config: what transformers'
// ROPE_INIT_FUNCTIONS compute for rope types default, linear and yarn (modeling_rope_utils.py),
// here in double and rounded to fp32 once at the end.
//
//   default  inv_freq[i] = theta^(-2i/d)                      (cpu::rope_inv_freq), factor 1
//   linear   inv_freq[i] = theta^(-2i/d) / factor             attention factor 1
//   yarn     inv_freq[i] = interp[i] (1 - e[i]) + extrap[i] e[i], extrap = theta^(-2i/d),
//            interp = extrap / factor, e[i] = 1 - clamp((i - low) / (high - low), 0, 1), where
//            low / high are the dimensions that turn beta_fast / beta_slow times over the original
//            context: d ln(orig / (2 pi beta)) / (2 ln theta), floored / ceiled when truncate, then
//            clamped to [0, d - 1]. Attention factor: attention_factor when given, else
//            m(factor, mscale) / m(factor, mscale_all_dim) when both are given, else m(factor),
//            m(s, k) = 1 + 0.1 k ln s for s > 1, else 1.
//
// transformers multiplies cos and sin by the attention factor, so q and k both come out scaled by
// it. RoPE is linear, and Qwen3 RMS-normalizes q and k right before it, so the runners fold the
// factor into the q_norm and k_norm weights at load time (no kernel changes; 1 for default and
// linear, so those weights stay bit-identical).
#pragma once

#include <vector>

#include "model/qwen3_moe_config.h"

namespace moebius::model {

struct RopeFrequencies {
  std::vector<float> inv_freq;   // [head_dim / 2]
  float attention_factor = 1.0f;
};

RopeFrequencies rope_frequencies(const Qwen3MoeConfig& c);
// rope_frequencies(c).attention_factor alone, for the loaders that fold it into the q/k norms.
float rope_attention_factor(const Qwen3MoeConfig& c);

}  // namespace moebius::model
