// The sampler (src/model/sampler.h) and generation_config.json parsing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "model/generation_config.h"
#include "model/sampler.h"

namespace moebius::model {
namespace {

Sampler make(SamplerParams p) {
  auto s = Sampler::create(p);
  EXPECT_TRUE(s.ok()) << s.error().what();
  return std::move(s).value();
}

std::set<int32_t> candidate_ids(Sampler& s, const std::vector<float>& logits) {
  auto c = s.candidates(logits);
  EXPECT_TRUE(c.ok()) << c.error().what();
  std::set<int32_t> ids;
  for (const auto& [id, p] : *c) ids.insert(id);
  return ids;
}

TEST(Sampler, GreedyPicksArgmaxLowestIdOnTies) {
  Sampler s = make({.temperature = 0.0f});
  EXPECT_EQ(*s.sample(std::vector<float>{0.1f, 3.0f, -2.0f, 2.9f}), 1);
  EXPECT_EQ(*s.sample(std::vector<float>{1.0f, 5.0f, 5.0f, 5.0f}), 1);
  EXPECT_EQ(*s.sample(std::vector<float>{-INFINITY, -1.0f}), 1);
  EXPECT_EQ(argmax(std::vector<float>{2.0f, 2.0f}), 0);
}

TEST(Sampler, TopKOneEqualsGreedy) {
  std::mt19937 rng(7);
  std::normal_distribution<float> d(0.0f, 3.0f);
  Sampler greedy = make({.temperature = 0.0f});
  Sampler k1 = make({.temperature = 1.5f, .top_k = 1, .seed = 42});
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<float> logits(64);
    for (auto& x : logits) x = d(rng);
    if (trial % 5 == 0) logits[3] = logits[40] = 100.0f;  // a tie: both must pick 3
    EXPECT_EQ(*k1.sample(logits), *greedy.sample(logits)) << trial;
  }
}

TEST(Sampler, SeededSamplingIsReproducible) {
  const std::vector<float> logits = {0.5f, 1.0f, 0.2f, 0.9f, -0.3f, 0.7f, 0.0f, 1.1f};
  const SamplerParams p{.temperature = 0.8f, .top_k = 6, .top_p = 0.95f, .min_p = 0.01f, .seed = 1234};
  Sampler a = make(p), b = make(p);
  std::vector<int32_t> ra, rb;
  for (int i = 0; i < 200; ++i) {
    ra.push_back(*a.sample(logits));
    rb.push_back(*b.sample(logits));
  }
  EXPECT_EQ(ra, rb);
  Sampler c = make({.temperature = 0.8f, .top_k = 6, .top_p = 0.95f, .min_p = 0.01f, .seed = 1235});
  std::vector<int32_t> rc;
  for (int i = 0; i < 200; ++i) rc.push_back(*c.sample(logits));
  EXPECT_NE(ra, rc);
}

TEST(Sampler, DistributionMatchesSoftmax) {
  // 4 tokens, temperature 2: expected p = softmax(logits / 2). 200k draws; chi-square with 3
  // degrees of freedom exceeds 30 with probability ~1e-6.
  const std::vector<float> logits = {0.0f, 1.0f, 2.0f, 4.0f};
  Sampler s = make({.temperature = 2.0f, .seed = 99});
  std::vector<double> p(4);
  double z = 0.0;
  for (size_t i = 0; i < 4; ++i) z += p[i] = std::exp(logits[i] / 2.0);
  for (auto& x : p) x /= z;
  const int n = 200000;
  std::vector<int> count(4, 0);
  for (int i = 0; i < n; ++i) ++count[static_cast<size_t>(*s.sample(logits))];
  double chi2 = 0.0;
  for (size_t i = 0; i < 4; ++i) chi2 += (count[i] - n * p[i]) * (count[i] - n * p[i]) / (n * p[i]);
  EXPECT_LT(chi2, 30.0);
}

TEST(Sampler, TopKTopPMinPKeepTheRightTokens) {
  // probabilities (temperature 1): log-odds chosen so p = {0.5, 0.25, 0.125, 0.0625, 0.0625}
  const std::vector<float> logits = {std::log(8.0f), std::log(4.0f), std::log(2.0f), 0.0f, 0.0f};
  Sampler k2 = make({.top_k = 2});
  EXPECT_EQ(candidate_ids(k2, logits), (std::set<int32_t>{0, 1}));
  // top-p: 0.45 is reached by token 0 alone; 0.7 needs 0 and 1; 0.8 needs 0, 1, 2.
  Sampler p05 = make({.top_p = 0.45f});
  EXPECT_EQ(candidate_ids(p05, logits), (std::set<int32_t>{0}));
  Sampler p07 = make({.top_p = 0.7f});
  EXPECT_EQ(candidate_ids(p07, logits), (std::set<int32_t>{0, 1}));
  Sampler p08 = make({.top_p = 0.8f});
  EXPECT_EQ(candidate_ids(p08, logits), (std::set<int32_t>{0, 1, 2}));
  // min-p 0.2: threshold 0.1 drops the two 0.0625 tokens; 0.3 (0.15) drops token 2 too.
  Sampler m02 = make({.min_p = 0.2f});
  EXPECT_EQ(candidate_ids(m02, logits), (std::set<int32_t>{0, 1, 2}));
  Sampler m03 = make({.min_p = 0.3f});
  EXPECT_EQ(candidate_ids(m03, logits), (std::set<int32_t>{0, 1}));
  // Survivors are renormalized, and a sampler never draws outside them.
  auto c = m03.candidates(logits);
  ASSERT_TRUE(c.ok());
  EXPECT_NEAR((*c)[0].second, 2.0 / 3.0, 1e-6);
  for (int i = 0; i < 1000; ++i) EXPECT_LT(*m03.sample(logits), 2);
}

TEST(Sampler, RejectsBadParametersAndLogits) {
  EXPECT_FALSE(Sampler::create({.temperature = -0.1f}).ok());
  EXPECT_FALSE(Sampler::create({.temperature = NAN}).ok());
  EXPECT_FALSE(Sampler::create({.temperature = 1e-40f}).ok());  // 1 / T overflows
  EXPECT_TRUE(Sampler::create({.temperature = 1e-37f}).ok());
  EXPECT_FALSE(Sampler::create({.top_k = -1}).ok());
  EXPECT_FALSE(Sampler::create({.top_p = 0.0f}).ok());
  EXPECT_FALSE(Sampler::create({.top_p = 1.5f}).ok());
  EXPECT_FALSE(Sampler::create({.min_p = 1.0f}).ok());
  EXPECT_FALSE(Sampler::create({.min_p = -0.5f}).ok());
  auto e = Sampler::create({.top_p = 2.0f});
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.error().what().find("--top-p"), std::string::npos) << e.error().what();
  Sampler s = make({});
  EXPECT_FALSE(s.sample(std::vector<float>{}).ok());
  EXPECT_FALSE(s.sample(std::vector<float>{1.0f, NAN}).ok());
  EXPECT_FALSE(s.sample(std::vector<float>{-INFINITY, -INFINITY}).ok());
}

// sample() (top-k selection without a sort, the sampling order extended band by band) against
// sample_reference() (every candidate scaled and sorted): two samplers with one seed must draw the
// same token from every row. Rows: an LM-like peak over a Gaussian bulk, flat rows whose nucleus
// reaches deep bands, few distinct values (ties), masked (-inf) ids, one live id, and sizes from 1
// to 40,000; every filter alone and combined, with penalties on some.
TEST(Sampler, FastPathDrawsAsTheReference) {
  std::mt19937 rng(77);
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  const size_t sizes[] = {1, 2, 3, 7, 64, 257, 1000, 4099, 40000};
  const float temps[] = {0.25f, 0.7f, 1.0f, 1.9f};
  const int top_ks[] = {0, 1, 3, 20, 300, 3000};  // 3000: top-k's survivors sorted by radix (sampler.cpp)
  const float top_ps[] = {1.0f, 0.95f, 0.5f, 0.999f};
  const float min_ps[] = {0.0f, 0.05f};
  int draws = 0, rows_tried = 0;
  for (size_t V : sizes) {
    for (int shape = 0; shape < 5; ++shape) {
      std::vector<float> row(V);
      const float scale = shape == 1 ? 25.0f : shape == 2 ? 0.05f : 2.5f;
      for (float& x : row) x = scale * gauss(rng);
      if (shape == 0)  // a few plausible continuations far above the bulk
        for (int j = 0; j < 4; ++j) row[rng() % V] = 12.0f + 2.0f * static_cast<float>(j);
      if (shape == 3)  // few distinct values: ties across the whole row
        for (float& x : row) x = std::round(x);
      if (shape == 4) {  // masked ids; at most one live when the row is small
        for (size_t i = 0; i < V; ++i)
          if (rng() % 3 != 0 || V < 4) row[i] = -INFINITY;
        row[rng() % V] = 1.5f;
      }
      for (float T : temps) {
        for (int k : top_ks) {
          for (float tp : top_ps) {
            for (float mp : min_ps) {
              // The reference sorts the row: the largest rows take a random twentieth of the grid.
              if (V > 5000 && rng() % 20 != 0) continue;
              SamplerParams p{.temperature = T, .top_k = k, .top_p = tp, .min_p = mp, .seed = rng()};
              if (rows_tried % 7 == 0) {
                p.presence_penalty = 0.5f;
                p.repetition_penalty = 1.2f;
              }
              ++rows_tried;
              Sampler fast = make(p), ref = make(p);
              const int n = V > 5000 ? 3 : 6;
              for (int i = 0; i < n; ++i, ++draws) {
                auto a = fast.sample(row);
                auto b = ref.sample_reference(row);
                ASSERT_TRUE(a.ok() && b.ok()) << V << " " << shape;
                ASSERT_EQ(*a, *b) << "V " << V << " shape " << shape << " T " << T << " top_k " << k << " top_p "
                                  << tp << " min_p " << mp << " draw " << i;
              }
            }
          }
        }
      }
    }
  }
  EXPECT_GT(draws, 10000);
}

// The weights are a float exp (sampler.cpp): the candidates' probabilities must still be the
// softmax's to float precision, over scaled logits spanning the whole range that does not
// underflow (s - max down to -87), and a weight below that is 0.
TEST(Sampler, ProbabilitiesMatchADoubleSoftmax) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> spread(-87.0f, 0.0f);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<float> row(300);
    for (float& x : row) x = spread(rng);
    row[7] = 0.0f;
    const float T = trial % 2 == 0 ? 1.0f : 0.9f;
    Sampler s = make({.temperature = T});
    auto c = s.candidates(row);
    ASSERT_TRUE(c.ok());
    double mx = -INFINITY, z = 0.0;
    for (float x : row) mx = std::max(mx, static_cast<double>(x * (1.0f / T)));
    for (float x : row) z += std::exp(static_cast<double>(x * (1.0f / T)) - mx);
    for (const auto& [id, p] : *c) {
      const double want = std::exp(static_cast<double>(row[static_cast<size_t>(id)] * (1.0f / T)) - mx) / z;
      // (below e^-87 ~ 1.6e-38 relative to the max a weight is 0)
      ASSERT_NEAR(p, want, 4e-7 * want + 2e-38) << "trial " << trial << " id " << id;
    }
  }
  // Far below the max: weight 0, so never drawn; the rest renormalize to 1.
  Sampler s = make({});
  auto c = s.candidates(std::vector<float>{0.0f, -100.0f, 0.0f});
  ASSERT_TRUE(c.ok());
  ASSERT_EQ(c->size(), 3u);
  EXPECT_EQ((*c)[0].second, 0.5f);
  EXPECT_EQ((*c)[2].second, 0.0f);
}

// A temperature below kGreedyBelowTemperature is the T -> 0 limit, the argmax: 1 / T would scale
// an ordinary logit gap (or a logit bias of 100) past float and fail the request (an HTTP 500 the
// server audit found at temperature 1e-38).
TEST(Sampler, TinyTemperaturesAreGreedy) {
  for (float t : {1e-37f, 1e-20f, 9e-6f}) {
    Sampler s = make({.temperature = t, .logit_bias = {{0, 100.0f}}});
    for (int i = 0; i < 20; ++i) {
      auto id = s.sample(std::vector<float>{1.0f, 90.0f, 3e30f, -5.0f});
      ASSERT_TRUE(id.ok()) << t << ": " << id.error().what();
      EXPECT_EQ(*id, 2) << t;
    }
  }
  Sampler warm = make({.temperature = kGreedyBelowTemperature});  // at the threshold: sampling
  EXPECT_TRUE(warm.sample(std::vector<float>{0.0f, 1.0f}).ok());
}

TEST(Sampler, InfiniteOrOverflowingLogitsAreRefused) {
  Sampler s = make({.temperature = 1.0f});
  auto inf = s.sample(std::vector<float>{1.0f, INFINITY});
  ASSERT_FALSE(inf.ok());
  EXPECT_NE(inf.error().what().find("logit 1 is +inf"), std::string::npos) << inf.error().what();
  Sampler cold = make({.temperature = 1e-3f});
  for (float x : {3e37f, -3e37f}) {
    auto big = cold.sample(std::vector<float>{0.0f, x});
    ASSERT_FALSE(big.ok());
    EXPECT_NE(big.error().what().find("overflows"), std::string::npos) << big.error().what();
    EXPECT_FALSE(cold.sample_reference(std::vector<float>{0.0f, x}).ok());
  }
  // Greedy never scales: a huge finite logit is just the largest.
  Sampler greedy = make({.temperature = 0.0f});
  EXPECT_EQ(*greedy.sample(std::vector<float>{0.0f, 3e38f}), 1);
}

// The adjustments written out naively from their definitions (sampler.h a-c), with the history
// as a plain list: the reference the sampler's incremental counts must match bit for bit.
std::vector<float> reference_adjusted(std::vector<float> l, const std::vector<int32_t>& prompt,
                                      const std::vector<int32_t>& output, const SamplerParams& p) {
  const auto count_in = [](const std::vector<int32_t>& v, int32_t id) { return std::count(v.begin(), v.end(), id); };
  for (int32_t id = 0; id < static_cast<int32_t>(l.size()); ++id) {
    float& x = l[static_cast<size_t>(id)];
    if (p.repetition_penalty != 1.0f && (count_in(prompt, id) > 0 || count_in(output, id) > 0))
      x = x > 0.0f ? x / p.repetition_penalty : x * p.repetition_penalty;
    if (const auto c = count_in(output, id); c > 0)
      x -= static_cast<float>(c) * p.frequency_penalty + p.presence_penalty;
  }
  for (const auto& [id, b] : p.logit_bias) l[static_cast<size_t>(id)] += b;
  return l;
}

TEST(SamplerPenalties, OffMeansTheRawRow) {
  Sampler s = make({.temperature = 0.0f});
  s.observe_prompt(std::vector<int32_t>{0, 1});
  const std::vector<float> row{1.0f, 2.0f, 3.0f};
  auto a = s.adjusted(row);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->data(), row.data());  // no copy
  EXPECT_EQ(*s.sample(row), 2);
  EXPECT_EQ(*s.sample(row), 2);  // nothing remembered
}

TEST(SamplerPenalties, RepetitionPenaltyDividesPositiveAndMultipliesNegative) {
  Sampler s = make({.temperature = 0.0f, .repetition_penalty = 2.0f});
  s.observe_prompt(std::vector<int32_t>{0, 2, 2});
  const std::vector<float> row{3.0f, 2.0f, -1.0f, -1.0f, -INFINITY};
  auto a = s.adjusted(row);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(std::vector<float>(a->begin(), a->end()), (std::vector<float>{1.5f, 2.0f, -2.0f, -1.0f, -INFINITY}));
  EXPECT_EQ(*s.sample(row), 1);  // 3 / 2 < 2
  // Token 1 is output now: 2 / 2 = 1 < 1.5. Token 0, seen in the prompt, is divided once only.
  EXPECT_EQ(*s.sample(row), 0);
  EXPECT_EQ(*s.sample(row), 0);
  // A penalty below 1 favours repeats; -inf stays -inf and is never chosen.
  Sampler fav = make({.temperature = 0.0f, .repetition_penalty = 0.5f});
  fav.observe_prompt(std::vector<int32_t>{1, 4});
  EXPECT_EQ(*fav.sample(row), 1);  // 2 / 0.5 = 4 > 3
}

// A penalty near 0 divides a seen positive logit towards +inf: it is clamped finite, so the
// softmax has no inf - inf and the token is simply the most likely (it was NaN probabilities and
// the least likely token).
TEST(SamplerPenalties, ATinyRepetitionPenaltyStaysFinite) {
  Sampler s = make({.temperature = 1.0f, .seed = 1, .repetition_penalty = 1e-39f});
  s.observe_prompt(std::vector<int32_t>{0, 2});
  const std::vector<float> row{2.0f, 1.0f, -3.0f, -INFINITY};
  auto a = s.adjusted(row);
  ASSERT_TRUE(a.ok());
  for (float x : *a) EXPECT_FALSE(std::isnan(x));
  EXPECT_EQ((*a)[3], -INFINITY);
  for (int i = 0; i < 100; ++i) ASSERT_EQ(*s.sample(row), 0) << i;
}

TEST(SamplerPenalties, FrequencyAndPresenceCountTheOutputOnly) {
  Sampler s = make({.temperature = 0.0f, .presence_penalty = 0.5f, .frequency_penalty = 0.25f});
  s.observe_prompt(std::vector<int32_t>{0});  // the OpenAI penalties ignore the prompt
  const std::vector<float> row{5.0f, 4.0f, 3.0f};
  // 0: 5; then 5 - 0.75 = 4.25 > 4; then 5 - 1.0 = 4 ties 4 (lowest id wins); then 3.75 < 4.
  std::vector<int32_t> got;
  for (int i = 0; i < 5; ++i) got.push_back(*s.sample(row));
  EXPECT_EQ(got, (std::vector<int32_t>{0, 0, 0, 1, 0}));
  // Negative values encourage repeats.
  Sampler neg = make({.temperature = 0.0f, .presence_penalty = -2.0f});
  const std::vector<float> close{1.0f, 2.0f};
  EXPECT_EQ(*neg.sample(close), 1);
  EXPECT_EQ(*neg.sample(std::vector<float>{2.5f, 2.0f}), 1);  // 2 + 2 > 2.5
}

TEST(SamplerPenalties, LogitBiasAddsAndIsBoundsChecked) {
  Sampler s = make({.temperature = 0.0f, .logit_bias = {{2, 100.0f}, {0, -100.0f}}});
  EXPECT_EQ(*s.sample(std::vector<float>{50.0f, 10.0f, -60.0f}), 2);
  EXPECT_EQ(*s.sample(std::vector<float>{50.0f, 10.0f, -95.0f}), 1);
  auto past = s.sample(std::vector<float>{1.0f, 2.0f});  // id 2 is outside a 2-token row
  ASSERT_FALSE(past.ok());
  EXPECT_NE(past.error().what().find("logit_bias"), std::string::npos) << past.error().what();
}

TEST(SamplerPenalties, MatchTheNaiveReferenceOnRandomRows) {
  std::mt19937 rng(2024);
  std::normal_distribution<float> d(0.0f, 2.0f);
  std::uniform_int_distribution<int32_t> tok(0, 63);
  const SamplerParams cases[] = {
      {.temperature = 0.0f, .repetition_penalty = 1.3f},
      {.temperature = 0.7f, .top_k = 20, .seed = 3, .presence_penalty = 0.6f, .frequency_penalty = 0.2f},
      {.temperature = 1.0f, .top_p = 0.9f, .seed = 4, .repetition_penalty = 0.8f, .presence_penalty = -0.5f,
       .frequency_penalty = 1.5f, .logit_bias = {{5, 3.0f}, {63, -7.5f}}},
  };
  for (const SamplerParams& p : cases) {
    Sampler s = make(p);
    std::vector<int32_t> prompt;
    for (int i = 0; i < 40; ++i) prompt.push_back(tok(rng));
    s.observe_prompt(prompt);
    std::vector<int32_t> output;
    std::vector<std::vector<float>> rows;
    for (int step = 0; step < 200; ++step) {
      // Few distinct values, so repeats and ties happen.
      std::vector<float> row(64);
      for (float& x : row) x = std::round(d(rng) * 4.0f) / 4.0f;
      row[static_cast<size_t>(tok(rng))] = -INFINITY;
      const std::vector<float> want = reference_adjusted(row, prompt, output, p);
      auto got = s.adjusted(row);
      ASSERT_TRUE(got.ok());
      ASSERT_EQ(std::vector<float>(got->begin(), got->end()), want) << "step " << step;
      // candidates() remembers nothing; sample() records its token.
      auto c1 = s.candidates(row), c2 = s.candidates(row);
      ASSERT_TRUE(c1.ok() && c2.ok());
      ASSERT_EQ(*c1, *c2);
      auto id = s.sample(row);
      ASSERT_TRUE(id.ok()) << id.error().what();
      if (p.temperature == 0.0f) {
        ASSERT_EQ(*id, argmax(want));
      }
      output.push_back(*id);
      rows.push_back(std::move(row));
    }
    // A fresh sampler with the same seed, prompt and rows draws the same tokens.
    Sampler again = make(p);
    again.observe_prompt(prompt);
    for (size_t i = 0; i < rows.size(); ++i) ASSERT_EQ(*again.sample(rows[i]), output[i]) << "step " << i;
  }
}

TEST(SamplerPenalties, RejectsOutOfRangeValues) {
  for (float bad : {0.0f, -1.0f, INFINITY, NAN}) {
    auto s = Sampler::create({.repetition_penalty = bad});
    ASSERT_FALSE(s.ok()) << bad;
    EXPECT_NE(s.error().what().find("--repetition-penalty"), std::string::npos);
  }
  for (float bad : {2.5f, -2.01f, NAN}) {
    EXPECT_FALSE(Sampler::create({.presence_penalty = bad}).ok()) << bad;
    EXPECT_FALSE(Sampler::create({.frequency_penalty = bad}).ok()) << bad;
  }
  EXPECT_TRUE(Sampler::create({.presence_penalty = -2.0f, .frequency_penalty = 2.0f}).ok());
  EXPECT_FALSE(Sampler::create({.logit_bias = {{1, 100.5f}}}).ok());
  EXPECT_FALSE(Sampler::create({.logit_bias = {{-1, 1.0f}}}).ok());
  EXPECT_FALSE(Sampler::create({.logit_bias = {{1, NAN}}}).ok());
}

TEST(GenerationConfig, ParsesEosIntOrListAndDefaults) {
  auto a = parse_generation_config(R"({"eos_token_id": [2, 3], "do_sample": false})", "a.json");
  ASSERT_TRUE(a.ok()) << a.error().what();
  EXPECT_EQ(a->eos_token_ids, (std::vector<int32_t>{2, 3}));
  EXPECT_EQ(a->do_sample, std::optional<bool>(false));
  EXPECT_FALSE(a->temperature.has_value());
  auto b = parse_generation_config(R"({"eos_token_id": 7, "temperature": 0.6, "top_p": 0.95, "top_k": 20})", "b");
  ASSERT_TRUE(b.ok()) << b.error().what();
  EXPECT_EQ(b->eos_token_ids, (std::vector<int32_t>{7}));
  EXPECT_FLOAT_EQ(*b->temperature, 0.6f);
  EXPECT_FLOAT_EQ(*b->top_p, 0.95f);
  EXPECT_EQ(*b->top_k, 20);
  EXPECT_FALSE(b->repetition_penalty.has_value());
  auto c = parse_generation_config(R"({"repetition_penalty": 1.05, "min_p": 0.0, "top_p": null})", "c");
  ASSERT_TRUE(c.ok()) << c.error().what();
  EXPECT_FLOAT_EQ(*c->repetition_penalty, 1.05f);
  EXPECT_FLOAT_EQ(*c->min_p, 0.0f);
  EXPECT_FALSE(c->top_p.has_value());
  auto empty = load_generation_config("/nonexistent-dir-for-moebius-tests");
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->eos_token_ids.empty());
}

TEST(GenerationConfig, MalformedIsAClearError) {
  auto bad_json = parse_generation_config("{", "g.json");
  ASSERT_FALSE(bad_json.ok());
  EXPECT_NE(bad_json.error().what().find("g.json"), std::string::npos);
  auto bad_eos = parse_generation_config(R"({"eos_token_id": "x"})", "g.json");
  ASSERT_FALSE(bad_eos.ok());
  EXPECT_NE(bad_eos.error().what().find("eos_token_id"), std::string::npos) << bad_eos.error().what();
  EXPECT_FALSE(parse_generation_config(R"({"eos_token_id": [1, -2]})", "g").ok());
  EXPECT_FALSE(parse_generation_config(R"({"top_k": 1.5})", "g").ok());
  EXPECT_FALSE(parse_generation_config(R"({"temperature": "hot"})", "g").ok());
  EXPECT_FALSE(parse_generation_config(R"([1, 2])", "g").ok());
  // Defaults every request would fail on are refused here, naming the field.
  for (const char* bad : {R"({"repetition_penalty": 0})", R"({"top_p": 0})", R"({"top_p": 1.5})",
                          R"({"min_p": 1})", R"({"temperature": -0.1})"}) {
    auto r = parse_generation_config(bad, "g.json");
    ASSERT_FALSE(r.ok()) << bad;
    const std::string key = std::string(bad).substr(3, std::string(bad).find('"', 3) - 3);
    EXPECT_NE(r.error().what().find(key), std::string::npos) << r.error().what();
  }
}

TEST(GenerationConfig, SamplingDefaultsOutOfRangeAreRefusedWithTheirField) {
  // Found by fuzz_model_config: "top_p": 1.95 parsed, then failed validate_sampler_params as
  // "field '--top-p'", a flag nobody passed (and a flag would silently hide it); "temperature":
  // 1e300 became an infinite float. The file and its field are named at parse time now.
  struct Case {
    const char* json;
    const char* field;
  };
  const Case cases[] = {
      {R"({"top_p": 1.95})", "top_p"},        {R"({"top_p": 0})", "top_p"},
      {R"({"top_p": -0.5})", "top_p"},        {R"({"temperature": -0.1})", "temperature"},
      {R"({"temperature": 1e300})", "temperature"}, {R"({"top_k": -1})", "top_k"},
  };
  for (const Case& c : cases) {
    auto r = parse_generation_config(c.json, "generation_config.json");
    ASSERT_FALSE(r.ok()) << c.json;
    EXPECT_EQ(r.error().file(), "generation_config.json") << c.json;
    EXPECT_EQ(r.error().field(), c.field) << c.json << ": " << r.error().what();
  }
  auto edge = parse_generation_config(R"({"temperature": 0, "top_p": 1, "top_k": 0})", "g");
  ASSERT_TRUE(edge.ok()) << edge.error().what();
  EXPECT_EQ(*edge->temperature, 0.0f);
  EXPECT_EQ(*edge->top_p, 1.0f);
}

TEST(GenerationConfig, DeepNestingIsRefusedBeforeTheDom) {
  // The same depth bound as config.json (see Qwen3MoeConfig.DeepNestingIsRefusedBeforeTheDom).
  const std::string deep = std::string(200000, '[') + std::string(200000, ']');
  auto r = parse_generation_config(R"({"eos_token_id": )" + deep + "}", "generation_config.json");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().file(), "generation_config.json");
  EXPECT_NE(r.error().message().find("nests deeper than 64 levels"), std::string::npos) << r.error().what();
}

}  // namespace
}  // namespace moebius::model
