// The per-step header of an expert-parallel model, the same on every backend: each step starts
// with an all-gather of every rank's state (its token count this step, or kEpRankDone once it has
// no more work), so that ranks step in lockstep. Every MoE layer is a collective: a rank with no
// tokens this step still runs every layer's dispatch and return for the others, and a rank that is
// done keeps doing so until every rank is done (Qwen3MoeCpu / Qwen3MoeCuda::ep_idle_until_all_done).
// The header also tells every rank the step's largest token count, from which the CUDA runner
// picks the EP layers' capacity: it fixes the sizes on the wire, so all ranks must agree on it
// [TAG_EP_CAPACITY_SLOTS].
#pragma once

#include <cstdint>
#include <span>

#include "core/error.h"

namespace moebius::parallel {

inline constexpr int32_t kEpRankDone = -1;

struct EpStepSummary {
  bool all_done = false;   // every rank posted kEpRankDone
  int32_t max_tokens = 0;  // the most tokens any rank carries this step (0: nobody has any)
};

// `states`: the all-gathered states, one per rank (token counts >= 0, or kEpRankDone).
EpStepSummary summarize_ep_step(std::span<const int32_t> states);

// The capacity the EP layers run a step at: `decode_capacity` (the decode graphs' EP layers) when
// every rank's tokens fit it, else `prefill_capacity`. Errors when a rank carries more than
// prefill_capacity (ranks launched with different --max-step-tokens; a bug otherwise).
Result<int> ep_step_capacity(const EpStepSummary& step, int decode_capacity, int prefill_capacity);

}  // namespace moebius::parallel
