// Token sampling from one row of logits (fp32 [V]).
//
// First the logits are adjusted for what the sequence has seen (vLLM's order, each off at its
// neutral value, and then the raw row is used as is):
//   a. repetition penalty (HF transformers / CTRL): a token seen in the prompt or the output has
//      its logit l divided by p when l > 0 and multiplied by p otherwise;
//   b. frequency and presence penalties (OpenAI): over the output only, a token generated c > 0
//      times loses c * frequency_penalty + presence_penalty;
//   c. logit_bias (OpenAI): a fixed amount added to the listed ids.
// The sampler keeps the history itself: observe_prompt() once, and every sample() records the
// token it returns.
//
// Then the filters run in this order, as in HF transformers' and llama.cpp's default chains:
//   1. temperature: logits / T; T below kGreedyBelowTemperature (0 included) means greedy
//      (argmax, ties to the lowest id: the limit of T -> 0, as vLLM also rules), and the other
//      filters are then irrelevant;
//   2. top-k: keep the k largest logits (k == 0: off), ties broken towards the lowest id;
//   3. softmax over what is left, then top-p (nucleus): keep the smallest prefix of the tokens,
//      sorted by probability, whose mass reaches p (p == 1: off; at least one token is kept);
//   4. min-p: drop tokens whose probability is below min_p * (largest probability) (0: off);
//   5. sample from the renormalized survivors with the request's RNG.
// The RNG is std::mt19937_64 seeded per request; the uniform draw is built from its raw 64-bit
// output (not std::uniform_real_distribution, whose algorithm differs between standard
// libraries), so a seed gives the same tokens on every platform.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "core/error.h"

namespace moebius::model {

struct SamplerParams {
  float temperature = 1.0f;  // >= 0; 0 = greedy
  int top_k = 0;             // >= 0; 0 = off
  float top_p = 1.0f;        // in (0, 1]; 1 = off
  float min_p = 0.0f;        // in [0, 1); 0 = off
  uint64_t seed = 0;
  float repetition_penalty = 1.0f;  // > 0 and finite; 1 = off; > 1 discourages repeats
  float presence_penalty = 0.0f;    // in [-2, 2] (OpenAI's range); 0 = off
  float frequency_penalty = 0.0f;   // in [-2, 2]; 0 = off
  // (id, bias) with bias in [-100, 100] (OpenAI's range); an id must be inside the vocabulary,
  // which only sample() knows: an id past the row is an error there.
  std::vector<std::pair<int32_t, float>> logit_bias;
};

// An Error naming the offending parameter (as its CLI flag) when a value is out of range.
Status validate_sampler_params(const SamplerParams& params);

// The ranges above, for the API and CLI layers' messages.
inline constexpr float kMaxOpenAiPenalty = 2.0f;
inline constexpr float kMaxLogitBias = 100.0f;
// Temperatures below this sample greedily: 1 / T would scale ordinary logit gaps (and a logit bias
// of 100) past float's range, a failed request where the limit T -> 0 is simply the argmax.
inline constexpr float kGreedyBelowTemperature = 1e-5f;

// A candidate token: its logit after the temperature, and its id.
struct ScaledLogit {
  float s;
  int32_t id;
};

// Index of the largest logit, the lowest index on ties. NaNs are never chosen. `logits` non-empty.
int32_t argmax(std::span<const float> logits);

class Sampler {
 public:
  // Validates `params` and seeds the RNG.
  static Result<Sampler> create(const SamplerParams& params);

  const SamplerParams& params() const { return params_; }

  // The prompt's ids, for the repetition penalty (kept only when it is on). Call once, before
  // the first sample(); ids outside the row are ignored when the penalty is applied.
  void observe_prompt(std::span<const int32_t> ids);

  // One token id in [0, V). Errors for an empty row, a NaN or +inf logit, one the temperature
  // scales past float's range, every logit -inf, or a logit_bias id outside [0, V). Advances the
  // RNG (except in greedy mode) and records the id as output (when a penalty needs it).
  // Equal, draw for draw, to sample_reference(), without sorting the row.
  Result<int32_t> sample(std::span<const float> logits);

  // The steps above written out literally (every candidate scaled and sorted), for tests.
  Result<int32_t> sample_reference(std::span<const float> logits);

  // The candidates left after the adjustments and steps 1-4 with their renormalized
  // probabilities, most probable first (ties: lowest id first). Exposed for tests; both sample
  // paths draw from exactly this list. Records nothing.
  // The arithmetic, which both paths share bit for bit: s = logit * (1 / T) in float; each
  // weight w = e^(s - max s) in double; the softmax sums (all of top-k's survivors, then the kept
  // ones) add the weights in ascending id order; top-p accumulates w / sum in the sampling order;
  // min-p keeps w >= min_p; a candidate's probability is float(w / kept sum), and the draw walks
  // those floats' cumulative sum (double) in the sampling order until it exceeds u.
  Result<std::vector<std::pair<int32_t, float>>> candidates(std::span<const float> logits);

  // The row after the adjustments a-c: `logits` itself when every one is off or has nothing to
  // act on, else a copy in the sampler's scratch (valid until the next call).
  Result<std::span<const float>> adjusted(std::span<const float> logits);

  // Greedy decoding: argmax, no RNG draw (temperature below kGreedyBelowTemperature).
  bool greedy() const { return params_.temperature < kGreedyBelowTemperature; }

 private:
  explicit Sampler(const SamplerParams& params) : params_(params), rng_(params.seed) {}

  double next_uniform();    // the draw's u in [0, 1)
  void record(int32_t id);  // the penalties' output history

  bool tracks_output() const {
    return params_.repetition_penalty != 1.0f || params_.presence_penalty != 0.0f || params_.frequency_penalty != 0.0f;
  }

  SamplerParams params_;
  std::mt19937_64 rng_;
  std::vector<ScaledLogit> scratch_;     // sample(): the sampling order's first elements
  std::vector<ScaledLogit> id_scratch_;  // sample(): a set sorted by id for its weight sum
  std::vector<float> adjusted_;                      // [V] the penalized row
  std::unordered_set<int32_t> prompt_ids_;          // repetition penalty only
  std::unordered_map<int32_t, int32_t> output_counts_;  // id -> times sampled
};

}  // namespace moebius::model
