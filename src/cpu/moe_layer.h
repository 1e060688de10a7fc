// CPU reference for a whole MoE layer: router GEMV, routing, experts and combine.
#pragma once

#include <vector>

#include "cpu/moe_experts.h"
#include "cpu/moe_router.h"

namespace moebius::cpu {

struct MoeLayerReference {
  MoeShape shape;
  RouterConfig router;
  std::vector<float> router_weight;  // [E, H] fp32 (the checkpoint's mlp.gate.weight, upcast)
  std::vector<ExpertWeights> experts;
  MoeReferenceOptions options;

  Status validate() const;
  // x: [T, H] fp32 -> out: [T, H] fp32. ids/weights, when not null, receive the routing [T, k].
  Status forward(const float* x, int64_t num_tokens, float* out, int32_t* ids_out = nullptr,
                 float* weights_out = nullptr) const;
};

// logits[t, e] = sum_h W[e, h] x[t, h], accumulated in double.
void router_logits_reference(const float* router_weight, const float* x, int64_t num_tokens, int64_t hidden,
                             int num_experts, float* logits);

}  // namespace moebius::cpu
