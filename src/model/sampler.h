// Token sampling from one row of logits (fp32 [V]).
//
// The filters run in this order, as in HF transformers' and llama.cpp's default chains:
//   1. temperature: logits / T; T == 0 means greedy (argmax, ties to the lowest id), and the
//      other filters are then irrelevant;
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
};

// An Error naming the offending parameter (as its CLI flag) when a value is out of range.
Status validate_sampler_params(const SamplerParams& params);

// Index of the largest logit, the lowest index on ties. NaNs are never chosen. `logits` non-empty.
int32_t argmax(std::span<const float> logits);

class Sampler {
 public:
  // Validates `params` and seeds the RNG.
  static Result<Sampler> create(const SamplerParams& params);

  const SamplerParams& params() const { return params_; }

  // One token id in [0, V). Errors for an empty row, a NaN, or every logit -inf. Advances the RNG
  // (except in greedy mode).
  Result<int32_t> sample(std::span<const float> logits);

  // The candidates left after steps 1-4 with their renormalized probabilities, most probable
  // first (ties: lowest id first). Exposed for tests; sample() draws from exactly this list.
  Result<std::vector<std::pair<int32_t, float>>> candidates(std::span<const float> logits);

 private:
  explicit Sampler(const SamplerParams& params) : params_(params), rng_(params.seed) {}

  SamplerParams params_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> scratch_;  // (scaled logit, id)
};

}  // namespace moebius::model
