#include "parallel/ep_step.h"

#include <algorithm>

namespace moebius::parallel {

EpStepSummary summarize_ep_step(std::span<const int32_t> states) {
  EpStepSummary s;
  s.all_done = std::all_of(states.begin(), states.end(), [](int32_t v) { return v == kEpRankDone; });
  for (int32_t v : states) s.max_tokens = std::max(s.max_tokens, v);
  return s;
}

Result<int> ep_step_capacity(const EpStepSummary& step, int decode_capacity, int prefill_capacity) {
  MOEBIUS_ASSERT(decode_capacity >= 1 && decode_capacity <= prefill_capacity);
  if (step.max_tokens > prefill_capacity)
    return Error::format("a rank carries {} tokens in one step, over the {} this rank's EP layers hold (every rank "
                         "must run with the same --max-step-tokens / --prefill-chunk)",
                         step.max_tokens, prefill_capacity);
  return step.max_tokens <= decode_capacity ? decode_capacity : prefill_capacity;
}

}  // namespace moebius::parallel
