// CPU reference for the routed experts of one MoE layer: the oracle for every CUDA MoE kernel.
//
// For each token t and each of its k routed slots s (expert e = ids[t, s], weight w = w[t, s]):
//   g = W_gate[e] x_t            [I]     W_gate[e]: [I, H]
//   u = W_up[e]   x_t            [I]     W_up[e]:   [I, H]
//   h = act(g, u)                [I]     optionally rounded to bf16, as the GPU kernels store it
//   y = W_down[e] h              [H]     W_down[e]: [H, I]
//   out_t += w * y               accumulated in fp32 over s = 0..k-1 in slot order
// Weights are any QuantMatrix format (fp32, bf16, NVFP4, int2/int4/int8 GPTQ) and are dequantized
// to fp32 first; dot products accumulate in double. This is meant to be plain and obviously
// right, not fast; OpenMP spreads experts over cores.
#pragma once

#include <cstdint>
#include <vector>

#include "core/error.h"
#include "formats/quant_matrix.h"

namespace moebius::cpu {

enum class Activation : uint8_t {
  kSiLU,         // silu(g) * u                                    (Qwen3-MoE, Mixtral, DeepSeek)
  kSiLUClamped,  // silu(min(g, L)) * clamp(u, -L, L)
  kGptOss,       // g' = min(g, L); u' = clamp(u, -L, L); (u' + 1) * g' * sigmoid(alpha * g')
};

struct ActivationConfig {
  Activation kind = Activation::kSiLU;
  float limit = 7.0f;    // L, for the clamped variants
  float alpha = 1.702f;  // kGptOss only
};

float apply_activation(const ActivationConfig& act, float g, float u);

// The three projections of one expert.
struct ExpertWeights {
  QuantMatrix gate;  // [I, H]
  QuantMatrix up;    // [I, H]
  QuantMatrix down;  // [H, I]
};

struct MoeShape {
  int64_t hidden = 0;        // H
  int64_t intermediate = 0;  // I
  int num_experts = 0;       // E
  int top_k = 0;             // k
};

struct MoeReferenceOptions {
  ActivationConfig activation;
  // Round h to bf16 before the down projection. The GPU kernels keep h in bf16 between the two
  // GEMMs (as HF does in bf16), so the oracle does too unless told otherwise.
  bool round_intermediate_to_bf16 = true;
};

Status validate_experts(const MoeShape& shape, const std::vector<ExpertWeights>& experts);

// x: [T, H] fp32. ids: [T, k] int32 in [0, E). weights: [T, k] fp32. out: [T, H] fp32 (overwritten).
// Errors (not asserts) for out-of-range expert ids, since they can come from a bad router.
Status moe_experts_reference(const MoeShape& shape, const std::vector<ExpertWeights>& experts,
                             const MoeReferenceOptions& options, const float* x, int64_t num_tokens,
                             const int32_t* ids, const float* weights, float* out);

// Bytes of packed expert weights (and their scales) that a forward pass over these routes reads:
// each expert that at least one token routes to is read once. For GB/s accounting.
size_t touched_weight_bytes(const std::vector<ExpertWeights>& experts, const int32_t* ids, int64_t num_tokens,
                            int top_k);

}  // namespace moebius::cpu
