// The tiny Qwen3-MoE fixture (tests/data/tiny-qwen3-moe, made by
// tools/fixtures/make_tiny_qwen3_moe.py with HF transformers) opens with our readers and has the
// hub layout the model loader will consume: per-expert projections, a dense layer, the reference
// logits.
#include <gtest/gtest.h>

#include <fstream>

#include <nlohmann/json.hpp>

#include "formats/safetensors.h"
#include "test_util.h"

namespace moebius {
namespace {

const std::string kDir = testing::test_data_dir() + "/tiny-qwen3-moe";

TEST(TinyQwen3MoeFixture, CheckpointHasTheHubLayout) {
  auto ckpt = SafetensorsCheckpoint::open(kDir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.error().what();
  std::ifstream f(kDir + "/config.json");
  const auto cfg = nlohmann::json::parse(f);
  const int64_t H = cfg["hidden_size"], E = cfg["num_experts"], I = cfg["moe_intermediate_size"];
  EXPECT_EQ(cfg["architectures"][0], "Qwen3MoeForCausalLM");
  for (int layer : {0, 2})
    for (int e = 0; e < E; ++e) {
      const std::string p = "model.layers." + std::to_string(layer) + ".mlp.experts." + std::to_string(e) + ".";
      EXPECT_TRUE(ckpt->get(p + "gate_proj.weight", DType::kBF16, Shape{I, H}).ok()) << p;
      EXPECT_TRUE(ckpt->get(p + "down_proj.weight", DType::kBF16, Shape{H, I}).ok()) << p;
    }
  EXPECT_TRUE(ckpt->get("model.layers.1.mlp.gate_proj.weight", DType::kBF16).ok());  // the dense layer
  EXPECT_TRUE(ckpt->get("model.layers.0.mlp.gate.weight", DType::kBF16, Shape{E, H}).ok());
}

TEST(TinyQwen3MoeFixture, ReferenceLogitsArePresent) {
  auto ref = SafetensorsFile::open(kDir + "/reference.safetensors");
  ASSERT_TRUE(ref.ok()) << ref.error().what();
  EXPECT_TRUE(ref->get("input_ids", DType::kI64, Shape{20}).ok());
  EXPECT_TRUE(ref->get("logits", DType::kF32, Shape{20, 512}).ok());
  EXPECT_TRUE(ref->get("logits_bf16", DType::kF32, Shape{20, 512}).ok());
  EXPECT_TRUE(ref->get("decode_logits", DType::kF32, Shape{8, 512}).ok());
}

}  // namespace
}  // namespace moebius
