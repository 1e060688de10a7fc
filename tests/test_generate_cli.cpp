// model::run_generate (what `moebius generate` runs) on the tiny Qwen3-MoE fixture.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "formats/safetensors.h"
#include "model/generate.h"
#include "test_util.h"

namespace moebius::model {
namespace {

const std::string kDir = moebius::testing::test_data_dir() + "/tiny-qwen3-moe";
constexpr int64_t kVocab = 512;

struct Reference {
  std::vector<int32_t> input_ids;  // [20]
  std::vector<float> logits;       // [20, V]
};

Reference load_reference() {
  Reference r;
  auto f = SafetensorsFile::open(kDir + "/reference.safetensors");
  EXPECT_TRUE(f.ok()) << f.error().what();
  auto ids = f->get("input_ids", DType::kI64, Shape{20});
  auto lg = f->get("logits", DType::kF32, Shape{20, kVocab});
  EXPECT_TRUE(ids.ok() && lg.ok());
  std::vector<int64_t> ids64(20);
  std::memcpy(ids64.data(), ids->data, sizeof(int64_t) * 20);
  for (int64_t id : ids64) r.input_ids.push_back(static_cast<int32_t>(id));
  r.logits.resize(static_cast<size_t>(20 * kVocab));
  std::memcpy(r.logits.data(), lg->data, r.logits.size() * sizeof(float));
  return r;
}

GenerateOptions greedy_options(const std::vector<int32_t>& prompt, int max_tokens) {
  GenerateOptions o;
  o.model_dir = kDir;
  o.prompt_ids = prompt;
  o.max_tokens = max_tokens;
  o.temperature = 0.0f;
  return o;
}

TEST(Generate, FirstGreedyTokenIsReferenceArgmax) {
  const Reference ref = load_reference();
  const std::vector<int32_t> prompt(ref.input_ids.begin(), ref.input_ids.begin() + 12);
  std::vector<int32_t> streamed;
  auto r = run_generate(greedy_options(prompt, 4), [&](int32_t id) { streamed.push_back(id); });
  ASSERT_TRUE(r.ok()) << r.error().what();
  ASSERT_FALSE(r->generated.empty());
  const int32_t expect = argmax(std::span<const float>(ref.logits.data() + 11 * kVocab, kVocab));
  EXPECT_EQ(r->generated[0], expect);
  EXPECT_EQ(streamed, r->generated);
  EXPECT_EQ(r->prompt_tokens, 12);
  EXPECT_GT(r->weight_bytes_per_token, 0u);
}

TEST(Generate, IsDeterministic) {
  const std::vector<int32_t> prompt = {1, 17, 301};
  GenerateOptions o = greedy_options(prompt, 6);
  o.eos_token_ids = std::vector<int32_t>{};  // run the full budget
  auto a = run_generate(o, nullptr);
  auto b = run_generate(o, nullptr);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->generated.size(), 6u);
  EXPECT_EQ(a->decode_steps, 5);
  EXPECT_EQ(a->generated, b->generated);
  EXPECT_EQ(a->logits_hash, b->logits_hash);
  // Seeded sampling is reproducible too.
  o.temperature = 1.0f;
  o.seed = 5;
  auto c = run_generate(o, nullptr);
  auto d = run_generate(o, nullptr);
  ASSERT_TRUE(c.ok() && d.ok());
  EXPECT_EQ(c->generated, d->generated);
  EXPECT_EQ(c->logits_hash, d->logits_hash);
}

TEST(Generate, StopsAtEos) {
  const std::vector<int32_t> prompt = {1, 17, 301};
  GenerateOptions o = greedy_options(prompt, 6);
  o.eos_token_ids = std::vector<int32_t>{};
  auto full = run_generate(o, nullptr);
  ASSERT_TRUE(full.ok()) << full.error().what();
  ASSERT_EQ(full->generated.size(), 6u);
  // Make the third greedy token an eos id: generation ends after two tokens, without it.
  o.eos_token_ids = std::vector<int32_t>{full->generated[2]};
  size_t first = 0;
  while (first < 2 && full->generated[first] != full->generated[2]) ++first;
  auto stopped = run_generate(o, nullptr);
  ASSERT_TRUE(stopped.ok());
  EXPECT_TRUE(stopped->stopped_at_eos);
  EXPECT_EQ(stopped->generated, std::vector<int32_t>(full->generated.begin(), full->generated.begin() + first));
}

// The repetition penalty sees the prompt: run_generate tells the sampler, and the greedy ids equal
// a loop that divides each seen token's positive logit by the penalty (a penalty of 1e9 on a
// positive logit, so a token of the prompt or the output can only win where every logit is <= 0).
TEST(Generate, RepetitionPenaltySeesThePrompt) {
  // A prompt whose plain greedy text repeats a prompt token or itself, so the penalty must act.
  const auto repeats = [](std::vector<int32_t> seen, const std::vector<int32_t>& out) {
    for (int32_t id : out) {
      if (std::find(seen.begin(), seen.end(), id) != seen.end()) return true;
      seen.push_back(id);
    }
    return false;
  };
  std::vector<int32_t> prompt;
  std::vector<int32_t> plain;
  for (int32_t first = 1; first < 40 && plain.empty(); ++first) {
    const std::vector<int32_t> p = {first, 17, 301, 5, 9, first + 100, 42, 250};
    GenerateOptions o = greedy_options(p, 16);
    o.eos_token_ids = std::vector<int32_t>{};
    auto r = run_generate(o, nullptr);
    ASSERT_TRUE(r.ok()) << r.error().what();
    if (repeats(p, r->generated)) prompt = p, plain = r->generated;
  }
  ASSERT_FALSE(plain.empty()) << "no candidate prompt's greedy text repeats a token";
  GenerateOptions o = greedy_options(prompt, 16);
  o.eos_token_ids = std::vector<int32_t>{};
  o.repetition_penalty = 1e9f;
  auto penalized = run_generate(o, nullptr);
  ASSERT_TRUE(penalized.ok());
  ASSERT_EQ(penalized->generated.size(), 16u);
  EXPECT_NE(plain, penalized->generated);
  std::vector<int32_t> seen = prompt;
  for (int32_t id : penalized->generated) {
    EXPECT_EQ(std::find(seen.begin(), seen.end(), id), seen.end()) << "token " << id << " repeats";
    seen.push_back(id);
  }
}

TEST(Generate, BadOptionsAreErrors) {
  const auto fails_naming = [](const GenerateOptions& o, const std::string& what) {
    auto r = run_generate(o, nullptr);
    ASSERT_FALSE(r.ok()) << what;
    EXPECT_NE(r.error().what().find(what), std::string::npos) << r.error().what();
  };
  GenerateOptions o = greedy_options({1, 2, 3}, 2);
  o.backend = "cuda";
  o.load_format = "random";
  fails_naming(o, "--load-format");
  o = greedy_options({1, 2, 3}, 2);
  o.load_format = "dummy";  // dummy weights exist on the cuda backend only
  fails_naming(o, "--load-format");
  o = greedy_options({1, 2, 3}, 2);
  o.backend = "tpu";
  fails_naming(o, "--backend");
  o = greedy_options({}, 2);
  fails_naming(o, "--prompt-ids");
  o = greedy_options({1, 600}, 2);
  fails_naming(o, "--prompt-ids");
  o = greedy_options({1, -1}, 2);
  fails_naming(o, "--prompt-ids");
  o = greedy_options({1, 2}, -1);
  fails_naming(o, "--max-tokens");
  o = greedy_options({1, 2}, 2);
  o.temperature = -1.0f;
  fails_naming(o, "--temperature");
  o = greedy_options({1, 2}, 2);
  o.top_p = 0.0f;
  fails_naming(o, "--top-p");
  o = greedy_options({1, 2}, 2);
  o.repetition_penalty = 0.0f;
  fails_naming(o, "--repetition-penalty");
  o = greedy_options({1, 2}, 2);
  o.frequency_penalty = 2.5f;
  fails_naming(o, "--frequency-penalty");
  o = greedy_options({1, 2}, 2);
  o.experts = "fp3";
  fails_naming(o, "--experts");
  o = greedy_options({1, 2}, 2);
  o.model_dir = kDir + "/does-not-exist";
  EXPECT_FALSE(run_generate(o, nullptr).ok());
}

TEST(Generate, LogitsHashIsFnv1a) {
  EXPECT_EQ(fnv1a_logits({}), 2166136261u);  // the FNV-1a offset basis
  const float zero = 0.0f;
  // Four zero bytes: h = h * prime (xor with 0 is a no-op), four times.
  uint32_t h = 2166136261u;
  for (int i = 0; i < 4; ++i) h *= 16777619u;
  EXPECT_EQ(fnv1a_logits(std::span<const float>(&zero, 1)), h);
}

}  // namespace
}  // namespace moebius::model
