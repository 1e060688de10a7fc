// The expert-parallel MoE layer on the CPU backend (ranks are threads over an
// InProcessCommunicator, or any Communicator taking host buffers). The plan and wire format are in
// moe/ep_plan.h. Per step, on every rank, with T (possibly 0) tokens of its own:
//   1. route its tokens (the full router is on every rank): ids, weights [T, k];
//   2. exchange per-destination pair counts (all_gather);
//   3. dispatch: pack [row | local expert id] per pair in send order, all_to_all_v;
//   4. run the local experts on the received rows (moe_experts_reference with k = 1, weight 1);
//   5. return the fp32 FC2 rows (all_to_all_v, counts transposed);
//   6. combine: out[t] = sum over s in slot order of w[t, s] * y[t, s], in fp32.
// With an fp32 payload the result is bit-identical to cpu::MoeLayerReference::forward on the
// same tokens for every N (the same dot products, the same fp32 combine order), so EP=N equals
// EP=1 and the single-process model. A bf16 payload rounds the rows as the GPU wire does; EP=N
// stays bit-identical to EP=1 with the same payload.
#pragma once

#include <cstdint>
#include <vector>

#include "core/error.h"
#include "cpu/moe_layer.h"
#include "parallel/communicator.h"

namespace moebius::moe {

enum class EpPayload : uint8_t { kF32, kBF16 };

// The routed experts. shape: the global layer (E = all experts). local_experts: this rank's E/N
// experts [TAG_EP_EXPERT_OWNER]. x [T, H] fp32, ids/weights [T, k], out [T, H] fp32.
Status ep_moe_experts_cpu(parallel::Communicator& comm, const cpu::MoeShape& shape,
                          const std::vector<cpu::ExpertWeights>& local_experts, const cpu::MoeReferenceOptions& options,
                          EpPayload payload, const float* x, int64_t num_tokens, const int32_t* ids,
                          const float* weights, float* out);

// Router + experts. `layer` holds the full router and only this rank's experts (layer.experts has
// E / N entries); validate_ep_layer checks that.
Status ep_moe_layer_cpu(parallel::Communicator& comm, const cpu::MoeLayerReference& layer, EpPayload payload,
                        const float* x, int64_t num_tokens, float* out);
Status validate_ep_layer(const cpu::MoeLayerReference& layer, int size);

}  // namespace moebius::moe
