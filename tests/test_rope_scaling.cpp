// RoPE scaling (config.json rope_scaling / rope_parameters; model/rope_frequencies.h):
//  - the parser: linear and yarn with transformers' fields and defaults, transformers 5's
//    rope_parameters, and a clear error naming the field for everything else;
//  - the frequencies and attention factor against transformers' own (tests/data/rope/
//    rope_scaling_ref.json, made by tools/fixtures/make_rope_scaling_ref.py on the GPU machine);
//  - the tiny model with YaRN on the CPU backend against transformers' YaRN logits
//    (tests/data/tiny-qwen3-moe/reference_yarn.safetensors, same script).
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "cpu/rope.h"
#include "model/qwen3_moe_config.h"
#include "model/qwen3_moe_cpu.h"
#include "model/rope_frequencies.h"
#include "server/step_runner.h"
#include "test_util.h"
#include "tiny_fixture.h"

namespace moebius::model {
namespace {

using nlohmann::json;

json tiny_config() {
  std::ifstream in(testing::tiny_fixture_dir() + "/config.json");
  return json::parse(in);
}

Result<Qwen3MoeConfig> parse(const json& j) { return parse_qwen3_moe_config(j.dump(), "config.json"); }

TEST(RopeScalingConfig, YarnWithTransformersFieldsAndDefaults) {
  json j = tiny_config();
  j["max_position_embeddings"] = 40960;
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 32768}};
  auto c = parse(j);
  ASSERT_TRUE(c.ok()) << c.error().what();
  const RopeScaling& r = c->rope_scaling;
  EXPECT_EQ(r.type, RopeScaling::Type::kYarn);
  EXPECT_EQ(r.factor, 4.0);
  EXPECT_EQ(r.original_max_position_embeddings, 32768);
  EXPECT_EQ(r.beta_fast, 32.0);
  EXPECT_EQ(r.beta_slow, 1.0);
  EXPECT_EQ(r.attention_factor, 0.0);
  EXPECT_TRUE(r.truncate);
  EXPECT_EQ(c->context_limit(), 131072);  // 32768 x 4, as vLLM derives Qwen3's YaRN context
  EXPECT_EQ(c->max_position_embeddings, 40960);

  // No original: the config's max_position_embeddings. No factor: the ratio of the two.
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 2.0}};
  c = parse(j);
  ASSERT_TRUE(c.ok()) << c.error().what();
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 40960);
  EXPECT_EQ(c->context_limit(), 81920);
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"original_max_position_embeddings", 4096}};
  c = parse(j);
  ASSERT_TRUE(c.ok()) << c.error().what();
  EXPECT_EQ(c->rope_scaling.factor, 10.0);

  // The older key "type", and every optional field.
  j["rope_scaling"] = {{"type", "yarn"},      {"factor", 8.0},      {"attention_factor", 1.5}, {"beta_fast", 16},
                       {"beta_slow", 2.0},    {"mscale", 1.0},      {"mscale_all_dim", 0.5},   {"truncate", false}};
  c = parse(j);
  ASSERT_TRUE(c.ok()) << c.error().what();
  EXPECT_EQ(c->rope_scaling.attention_factor, 1.5);
  EXPECT_EQ(c->rope_scaling.beta_fast, 16.0);
  EXPECT_EQ(c->rope_scaling.beta_slow, 2.0);
  EXPECT_EQ(c->rope_scaling.mscale_all_dim, 0.5);
  EXPECT_FALSE(c->rope_scaling.truncate);
}

TEST(RopeScalingConfig, LinearDefaultAndTransformers5Parameters) {
  json j = tiny_config();
  j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 2.0}};
  auto c = parse(j);
  ASSERT_TRUE(c.ok()) << c.error().what();
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kLinear);
  EXPECT_EQ(c->context_limit(), 512);
  j["rope_scaling"] = {{"rope_type", "default"}};
  c = parse(j);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->rope_scaling, RopeScaling{});
  EXPECT_EQ(c->context_limit(), 256);
  // transformers 5: the theta and the scaling in rope_parameters, no top-level rope_theta.
  j.erase("rope_scaling");
  j.erase("rope_theta");
  j["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 5e5}, {"factor", 2.0}};
  c = parse(j);
  ASSERT_TRUE(c.ok()) << c.error().what();
  EXPECT_EQ(c->rope_theta, 5e5);
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kYarn);
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1e6}};
  c = parse(j);
  ASSERT_TRUE(c.ok()) << c.error().what();
  EXPECT_EQ(c->rope_theta, 1e6);
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kDefault);
}

// Where transformers 5 looks first: a non-empty rope_scaling over rope_parameters, the theta inside
// rope_parameters over a top-level one, a top-level original context when the scaling has none.
TEST(RopeScalingConfig, TransformersPrecedence) {
  json j = tiny_config();
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 5e5}};
  j["rope_scaling"] = json::parse(testing::kTinyYarnScaling);
  auto c = parse(j);
  ASSERT_TRUE(c.ok()) << c.error().what();
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kYarn);
  EXPECT_EQ(c->rope_theta, 5e5);
  j["rope_scaling"] = json::object();  // empty: rope_parameters speaks
  c = parse(j);
  ASSERT_TRUE(c.ok()) << c.error().what();
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kDefault);
  j = tiny_config();
  j["original_max_position_embeddings"] = 128;
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 2.0}};
  c = parse(j);
  ASSERT_TRUE(c.ok()) << c.error().what();
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 128);
  j["rope_scaling"]["original_max_position_embeddings"] = 128.0;  // a whole-number float is taken
  c = parse(j);
  ASSERT_TRUE(c.ok()) << c.error().what();
  j["rope_scaling"]["original_max_position_embeddings"] = 64;  // two different ones: refused
  c = parse(j);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.error().field(), "original_max_position_embeddings") << c.error().what();
  // A null truncate is transformers' falsy None: no truncation.
  j = tiny_config();
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 2.0}, {"truncate", nullptr}};
  c = parse(j);
  ASSERT_TRUE(c.ok()) << c.error().what();
  EXPECT_FALSE(c->rope_scaling.truncate);
}

TEST(RopeScalingConfig, EverythingElseIsANamedError) {
  struct Case {
    const char* what;
    json scaling;
    const char* field;
  };
  const std::vector<Case> cases = {
      {"dynamic NTK", {{"rope_type", "dynamic"}, {"factor", 2.0}}, "rope_scaling"},
      {"llama3", {{"rope_type", "llama3"}, {"factor", 8.0}}, "rope_scaling"},
      {"longrope", {{"rope_type", "longrope"}}, "rope_scaling"},
      {"type not a string", {{"rope_type", 3}}, "rope_scaling"},
      {"not an object", json::array({1, 2}), "rope_scaling"},
      {"linear without factor", {{"rope_type", "linear"}}, "rope_scaling.factor"},
      {"factor below 1", {{"rope_type", "yarn"}, {"factor", 0.5}}, "rope_scaling.factor"},
      {"factor a string", {{"rope_type", "yarn"}, {"factor", "4"}}, "rope_scaling.factor"},
      {"factor infinite (as a huge number)", {{"rope_type", "linear"}, {"factor", 1e308}}, "rope_scaling"},
      {"original 0", {{"rope_type", "yarn"}, {"factor", 2.0}, {"original_max_position_embeddings", 0}},
       "rope_scaling.original_max_position_embeddings"},
      {"original a float", {{"rope_type", "yarn"}, {"factor", 2.0}, {"original_max_position_embeddings", 64.5}},
       "rope_scaling.original_max_position_embeddings"},
      {"original above max without factor: ratio below 1",
       {{"rope_type", "yarn"}, {"original_max_position_embeddings", 1024}}, "rope_scaling.factor"},
      {"attention_factor 0", {{"rope_type", "yarn"}, {"factor", 2.0}, {"attention_factor", 0}},
       "rope_scaling.attention_factor"},
      {"negative beta", {{"rope_type", "yarn"}, {"factor", 2.0}, {"beta_fast", -1}}, "rope_scaling.beta_fast"},
      {"truncate a number", {{"rope_type", "yarn"}, {"factor", 2.0}, {"truncate", 1}}, "rope_scaling.truncate"},
      {"context past 2^30", {{"rope_type", "yarn"}, {"factor", 1e7}}, "rope_scaling"},
      {"partial rotary factor", {{"rope_type", "yarn"}, {"factor", 2.0}, {"partial_rotary_factor", 0.5}},
       "rope_scaling.partial_rotary_factor"},
      // Each value in range, together degenerate: an infinite correction range (a NaN ramp), an
      // attention factor past float (its cast was undefined), an mscale ratio that overflows.
      {"betas near zero", {{"rope_type", "yarn"}, {"factor", 2.0}, {"beta_fast", 5e-324}, {"beta_slow", 5e-324}},
       "rope_scaling"},
      {"attention_factor past float", {{"rope_type", "yarn"}, {"factor", 2.0}, {"attention_factor", 1e308}},
       "rope_scaling"},
      {"mscale ratio past float",
       {{"rope_type", "yarn"}, {"factor", 2.0}, {"mscale", 1e308}, {"mscale_all_dim", 1e-300}}, "rope_scaling"},
  };
  for (const Case& k : cases) {
    json j = tiny_config();
    j["rope_scaling"] = k.scaling;
    auto c = parse(j);
    ASSERT_FALSE(c.ok()) << k.what;
    EXPECT_EQ(c.error().field(), k.field) << k.what << ": " << c.error().what();
    EXPECT_EQ(c.error().file(), "config.json") << k.what;
  }
  json j = tiny_config();
  j["partial_rotary_factor"] = 0.5;
  auto c = parse(j);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.error().field(), "partial_rotary_factor");
  j = tiny_config();
  j["rope_theta"] = 1.0;  // YaRN's correction range divides by ln(theta)
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 2.0}};
  c = parse(j);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.error().field(), "rope_scaling") << c.error().what();
  j = tiny_config();
  j.erase("rope_theta");
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", "1e6"}};
  c = parse(j);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.error().field(), "rope_parameters.rope_theta");
}

TEST(RopeScalingConfig, AWeightUpdateMustKeepTheScaling) {
  json j = tiny_config();
  auto plain = parse(j);
  j["rope_scaling"] = json::parse(testing::kTinyYarnScaling);
  auto yarn = parse(j);
  ASSERT_TRUE(plain.ok() && yarn.ok());
  const Status s = check_same_config(*plain, *yarn);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().field(), "rope_scaling") << s.error().what();
  EXPECT_TRUE(check_same_config(*yarn, *yarn).ok());
}

// Every case of a reference file against rope_frequencies: inv_freq within `rel`, the attention
// factor within 1e-6.
void expect_cases_match(const json& ref, double rel) {
  ASSERT_GE(ref["cases"].size(), 12u);
  std::set<std::string> compared;
  for (const json& k : ref["cases"]) {
    // A setting the reference refuses (transformers 5 validates rope_parameters; the port has no
    // such check) is named, not compared: moebius keeps transformers 4's reading of it.
    if (k.contains("transformers_refused")) {
      std::printf("%-28s refused by transformers: %s\n", k["name"].get<std::string>().c_str(),
                  k["transformers_refused"].get<std::string>().c_str());
      continue;
    }
    compared.insert(k["name"].get<std::string>());
    json j = tiny_config();
    j["head_dim"] = k["head_dim"];
    j["rope_theta"] = k["rope_theta"];
    j["max_position_embeddings"] = k["max_position_embeddings"];
    j["rope_scaling"] = k["rope_scaling"];
    auto c = parse(j);
    ASSERT_TRUE(c.ok()) << k["name"] << ": " << c.error().what();
    const RopeFrequencies f = rope_frequencies(*c);
    const std::vector<double> want = k["inv_freq"].get<std::vector<double>>();
    ASSERT_EQ(f.inv_freq.size(), want.size()) << k["name"];
    double worst = 0;
    for (size_t i = 0; i < want.size(); ++i) worst = std::max(worst, std::fabs(f.inv_freq[i] - want[i]) / want[i]);
    std::printf("%-28s inv_freq max rel diff %.3g, attention factor %.9g (transformers %.9g)\n",
                k["name"].get<std::string>().c_str(), worst, f.attention_factor, k["attention_factor"].get<double>());
    EXPECT_LE(worst, rel) << k["name"];
    EXPECT_NEAR(f.attention_factor, k["attention_factor"].get<double>(), 1e-6) << k["name"];
  }
  // Qwen3's own setting, the tiny fixture's and linear are among what must compare.
  EXPECT_GE(compared.size(), 8u);
  for (const char* must : {"qwen3-yarn-4x", "tiny-yarn", "linear-2x"}) EXPECT_TRUE(compared.count(must)) << must;
}

// A plain-Python port of transformers' formulas in double (tools/fixtures/make_rope_scaling_port.py,
// written from transformers' source): equal up to our one rounding to fp32.
TEST(RopeFrequencies, MatchAPortOfTransformersFormulas) {
  std::ifstream in(testing::test_data_dir() + "/rope/rope_scaling_port.json");
  ASSERT_TRUE(in.good()) << "tests/data/rope/rope_scaling_port.json";
  expect_cases_match(json::parse(in), 1e-7);
}

// transformers itself (tools/fixtures/make_rope_scaling_ref.py on the GPU machine), which computes
// in fp32 torch ops against our double rounded once: a few fp32 ulps apart.
TEST(RopeFrequencies, MatchTransformers) {
  const std::string path = testing::test_data_dir() + "/rope/rope_scaling_ref.json";
  std::ifstream in(path);
  ASSERT_TRUE(in.good()) << path << " (committed; tools/fixtures/make_rope_scaling_ref.py on the GPU machine remakes it)";
  expect_cases_match(json::parse(in), 4e-7);
}

TEST(RopeFrequencies, DefaultAndLinearAreThePlainOnes) {
  json j = tiny_config();
  auto plain = parse(j);
  ASSERT_TRUE(plain.ok());
  const RopeFrequencies p = rope_frequencies(*plain);
  EXPECT_EQ(p.inv_freq, cpu::rope_inv_freq(1e6, 16));
  EXPECT_EQ(p.attention_factor, 1.0f);
  j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 4.0}};
  auto lin = parse(j);
  ASSERT_TRUE(lin.ok());
  const RopeFrequencies l = rope_frequencies(*lin);
  for (size_t i = 0; i < l.inv_freq.size(); ++i) EXPECT_FLOAT_EQ(l.inv_freq[i], p.inv_freq[i] / 4.0f);
  EXPECT_EQ(l.attention_factor, 1.0f);
}

// Achieved on the fixture: printed; the same bound as the plain model's (test_qwen3_moe_cpu.cpp).
constexpr float kLogitTolerance = 2e-5f;

// The attention factor sits in the q/k norms (model/rope_frequencies.h), and YaRN moves the tiny
// model's logits.
TEST(RopeScalingModel, YarnFoldsTheAttentionFactorIntoTheQkNorms) {
  const testing::TinyYarnFixture yarn;
  auto m = Qwen3MoeCpu::load(yarn.dir());
  ASSERT_TRUE(m.ok()) << m.error().what();
  auto plain = Qwen3MoeCpu::load(testing::tiny_fixture_dir());
  ASSERT_TRUE(plain.ok());
  const float af = rope_frequencies(m->config()).attention_factor;
  EXPECT_NEAR(af, 1.0 + 0.1 * std::log(2.0), 1e-6);
  for (size_t l = 0; l < m->layers().size(); ++l) {
    const Qwen3MoeLayerWeights &a = m->layers()[l], &b = plain->layers()[l];
    for (size_t i = 0; i < a.q_norm.size(); ++i) {
      EXPECT_EQ(a.q_norm[i], b.q_norm[i] * af);
      EXPECT_EQ(a.k_norm[i], b.k_norm[i] * af);
    }
    EXPECT_EQ(a.input_norm, b.input_norm);  // only those two
    EXPECT_EQ(a.post_norm, b.post_norm);
  }
  const testing::TinyReference ref = testing::load_tiny_reference();
  const int T = static_cast<int>(ref.ids.size());
  KvCache cache = m->make_cache();
  std::vector<float> got(ref.logits.size());
  ASSERT_TRUE(m->forward(ref.ids.data(), T, cache, got.data()).ok());
  float moved = 0;
  for (size_t i = 0; i < got.size(); ++i) moved = std::max(moved, std::fabs(got[i] - ref.logits[i]));
  std::printf("yarn vs plain logits: max |diff| %.3g\n", moved);
  EXPECT_GT(moved, 1e-3f);
}

TEST(RopeScalingModel, YarnTinyModelMatchesTransformers) {
  const testing::TinyReference plain_ref = testing::load_tiny_reference();
  const std::vector<float> want = testing::TinyYarnFixture::reference_logits();
  ASSERT_FALSE(want.empty()) << testing::TinyYarnFixture::reference_path()
                             << " (committed; tools/fixtures/make_rope_scaling_ref.py on the GPU machine remakes it)";
  ASSERT_EQ(want.size(), plain_ref.logits.size());
  const testing::TinyYarnFixture yarn;
  auto m = Qwen3MoeCpu::load(yarn.dir());
  ASSERT_TRUE(m.ok()) << m.error().what();
  const int T = static_cast<int>(plain_ref.ids.size());
  KvCache cache = m->make_cache();
  std::vector<float> got(want.size());
  ASSERT_TRUE(m->forward(plain_ref.ids.data(), T, cache, got.data()).ok());
  float d = 0, from_plain = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    d = std::max(d, std::fabs(got[i] - want[i]));
    from_plain = std::max(from_plain, std::fabs(want[i] - plain_ref.logits[i]));
  }
  std::printf("yarn prefill of %d tokens: max |logit - transformers fp32| = %.3g (yarn vs plain: %.3g)\n", T, d,
              from_plain);
  EXPECT_LT(d, kLogitTolerance);
  EXPECT_GT(from_plain, 100 * kLogitTolerance) << "the reference does not tell YaRN from no scaling";
}

// The serving runners' --max-context: up to the stretched context, an error past it (cpu runner,
// one rank and data-parallel ranks; the cuda runner calls the same check).
TEST(RopeScalingModel, MaxContextReachesTheStretchedContextAndNoFurther) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("moebius-rope-ctx-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  json j = tiny_config();  // max_position_embeddings 256
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 8.0}, {"original_max_position_embeddings", 64}};  // 512
  std::ofstream(dir / "config.json") << j.dump();
  fs::copy_file(testing::tiny_fixture_dir() + "/model.safetensors", dir / "model.safetensors",
                fs::copy_options::overwrite_existing);
  for (int ep : {1, 2}) {
    server::RunnerOptions o;
    o.source.model_dir = dir.string();
    o.max_seqs = 2;
    o.ep = ep;
    auto dflt = server::load_runner(o);
    ASSERT_TRUE(dflt.ok()) << dflt.error().what();
    EXPECT_EQ((*dflt)->limits().max_context, 256) << "ep " << ep;  // the default stays the config's
    o.max_context = 512;
    auto stretched = server::load_runner(o);
    ASSERT_TRUE(stretched.ok()) << stretched.error().what();
    EXPECT_EQ((*stretched)->limits().max_context, 512) << "ep " << ep;
    o.max_context = 513;
    auto past = server::load_runner(o);
    ASSERT_FALSE(past.ok()) << "ep " << ep;
    EXPECT_EQ(past.error().field(), "--max-context") << past.error().what();
    EXPECT_NE(past.error().what().find("512"), std::string::npos) << past.error().what();
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace moebius::model
