// Quantization configs: ModelOpt (hf_quant_config.json and config.json), GPTQ, AutoRound; the
// refusal of every malformed or unsupported field; exclusion patterns.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <unistd.h>

#include "formats/quant_config.h"

namespace moebius {
namespace {

using ::testing::HasSubstr;

QuantConfig parse_ok(const std::string& text) {
  auto r = parse_quantization_config_text(text, "config.json");
  EXPECT_TRUE(r.ok()) << r.error().what();
  return r.ok() ? *r : QuantConfig{};
}

// ---- ModelOpt ----------------------------------------------------------------------------------

TEST(QuantConfigModelOpt, HfQuantConfigJson) {
  // Shape of nvidia/*-FP4 checkpoints' hf_quant_config.json.
  const std::string text = R"({
    "producer": {"name": "modelopt", "version": "0.29.0"},
    "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": null, "group_size": 16,
                     "exclude_modules": ["lm_head", "model.layers.*.mlp.gate", "model.layers.0.self_attn*"]}})";
  auto r = parse_hf_quant_config_text(text, "hf_quant_config.json");
  ASSERT_TRUE(r.ok()) << r.error().what();
  EXPECT_EQ(r->method, QuantMethod::kModelOpt);
  EXPECT_EQ(r->quant_algo, "NVFP4");
  EXPECT_EQ(r->group_size, 16);
  EXPECT_EQ(r->kv_cache_quant_algo, "");
  EXPECT_EQ(r->producer, "modelopt 0.29.0");
  EXPECT_TRUE(r->is_excluded("lm_head"));
  EXPECT_TRUE(r->is_excluded("model.layers.17.mlp.gate"));
  EXPECT_FALSE(r->is_excluded("model.layers.17.mlp.gate_proj"));
  EXPECT_TRUE(r->is_excluded("model.layers.0.self_attn.q_proj"));
  EXPECT_FALSE(r->is_excluded("model.layers.1.self_attn.q_proj"));
  const LayerQuant l = r->layer("model.layers.3.mlp.experts.5.down_proj");
  EXPECT_TRUE(l.quantized);
  EXPECT_EQ(l.format, WeightFormat::kNvFp4);
  EXPECT_EQ(l.group_size, 16);
  EXPECT_FALSE(r->layer("lm_head").quantized);
}

TEST(QuantConfigModelOpt, ConfigJsonQuantMethodModelOpt) {
  // ModelOpt's compressed-tensors-style export into config.json.
  const QuantConfig c = parse_ok(R"({
    "quant_method": "modelopt", "quant_algo": "NVFP4",
    "config_groups": {"group_0": {"input_activations": {"dynamic": false, "num_bits": 4, "type": "float", "group_size": 16},
                                  "weights": {"dynamic": false, "num_bits": 4, "type": "float", "group_size": 16},
                                  "targets": ["Linear"]}},
    "ignore": ["lm_head", "*.mlp.gate"],
    "kv_cache_scheme": {"dynamic": false, "num_bits": 8, "type": "float"},
    "producer": {"name": "modelopt", "version": "0.37.0"}})");
  EXPECT_EQ(c.method, QuantMethod::kModelOpt);
  EXPECT_EQ(c.kv_cache_quant_algo, "FP8");
  EXPECT_TRUE(c.is_excluded("model.layers.2.mlp.gate"));
  EXPECT_FALSE(c.is_excluded("model.layers.2.mlp.experts.0.gate_proj"));
}

// ---- GPTQ --------------------------------------------------------------------------------------

TEST(QuantConfigGptq, GptqModelConfig) {
  const QuantConfig c = parse_ok(R"({
    "bits": 4, "group_size": 128, "desc_act": false, "sym": true, "lm_head": false,
    "quant_method": "gptq", "checkpoint_format": "gptq", "pack_dtype": "int32",
    "damp_percent": 0.01, "true_sequential": true, "meta": {"quantizer": ["gptqmodel:2.2.0"]},
    "dynamic": {"-:.*\\.mlp\\.gate$": {}, "+:model\\.layers\\.[0-3]\\..*down_proj": {"bits": 8, "group_size": 32}}})");
  EXPECT_EQ(c.method, QuantMethod::kGptq);
  EXPECT_EQ(c.bits, 4);
  EXPECT_EQ(c.group_size, 128);
  EXPECT_EQ(c.zeros, gptq::ZeroFormat::kV1MinusOne);
  EXPECT_TRUE(c.is_excluded("lm_head"));
  EXPECT_TRUE(c.is_excluded("model.layers.5.mlp.gate"));
  EXPECT_FALSE(c.is_excluded("model.layers.5.mlp.gate_proj"));
  LayerQuant l = c.layer("model.layers.2.mlp.experts.9.down_proj");
  EXPECT_EQ(l.format, WeightFormat::kInt8);
  EXPECT_EQ(l.group_size, 32);
  l = c.layer("model.layers.12.mlp.experts.9.down_proj");  // [0-3] then '\.': layer 12 does not match
  EXPECT_EQ(l.format, WeightFormat::kInt4);
  EXPECT_EQ(l.group_size, 128);
  // re.match anchors at the start: a pattern that only matches later in the name does not apply.
  EXPECT_FALSE(c.overrides[1].matches("prefix.model.layers.1.x.down_proj"));
}

TEST(QuantConfigGptq, V2FormatPerChannelAndLmHead) {
  const QuantConfig c = parse_ok(R"({"quant_method": "gptq", "bits": 2, "group_size": -1,
                                     "checkpoint_format": "gptq_v2", "lm_head": true})");
  EXPECT_EQ(c.zeros, gptq::ZeroFormat::kV2Exact);
  EXPECT_EQ(c.group_size, -1);
  EXPECT_FALSE(c.is_excluded("lm_head"));
  EXPECT_EQ(c.layer("lm_head").format, WeightFormat::kInt2);
}

// ---- AutoRound ---------------------------------------------------------------------------------

TEST(QuantConfigAutoRound, AutoGptqPackingWithExtraConfig) {
  const QuantConfig c = parse_ok(R"({
    "autoround_version": "0.6.0", "bits": 4, "data_type": "int", "group_size": 128, "sym": true,
    "iters": 200, "act_bits": 16, "quant_method": "auto-round", "packing_format": "auto_round:auto_gptq",
    "block_name_to_quantize": "model.layers",
    "extra_config": {"model.layers.0.mlp.gate": {"bits": 16, "data_type": "float"},
                     "model.layers.1.mlp.down_proj": {"bits": 8},
                     ".*shared_expert\\..*": {"bits": 8, "group_size": 64},
                     "lm_head": {"bits": 8, "group_size": 128, "sym": true, "data_type": "int"}}})");
  EXPECT_EQ(c.method, QuantMethod::kAutoRound);
  EXPECT_EQ(c.zeros, gptq::ZeroFormat::kV1MinusOne);
  EXPECT_EQ(c.block_name_to_quantize, std::vector<std::string>{"model.layers"});
  EXPECT_TRUE(c.is_excluded("model.layers.0.mlp.gate"));
  EXPECT_FALSE(c.is_excluded("model.layers.1.mlp.gate"));  // router of another layer: in the block
  EXPECT_TRUE(c.is_excluded("model.visual.blocks.0.proj"));  // outside block_name_to_quantize
  EXPECT_EQ(c.layer("model.layers.1.mlp.down_proj").format, WeightFormat::kInt8);
  EXPECT_EQ(c.layer("model.layers.2.mlp.down_proj").format, WeightFormat::kInt4);
  EXPECT_EQ(c.layer("model.layers.2.mlp.shared_expert.up_proj").group_size, 64);
  EXPECT_FALSE(c.is_excluded("lm_head"));  // quantized through extra_config
  EXPECT_EQ(c.layer("lm_head").bits, 8);
}

TEST(QuantConfigAutoRound, PackingFormatsAndBlockLists) {
  QuantConfig c = parse_ok(R"({"quant_method": "auto-round", "bits": 2, "group_size": 64,
                               "packing_format": "auto_round:gptqmodel",
                               "block_name_to_quantize": ["model.language_model.layers", "mtp.layers."]})");
  EXPECT_EQ(c.zeros, gptq::ZeroFormat::kV2Exact);
  EXPECT_EQ(c.block_name_to_quantize, (std::vector<std::string>{"model.language_model.layers", "mtp.layers"}));
  EXPECT_TRUE(c.is_excluded("lm_head"));
  EXPECT_FALSE(c.is_excluded("mtp.layers.0.mlp.up_proj"));
  c = parse_ok(R"({"quant_method": "intel/auto-round", "bits": 4, "group_size": 128, "sym": true,
                   "backend": "auto_round:gptq:exllamav2",
                   "block_name_to_quantize": [["model.layers.0", "model.layers.1", "model.layers.10"]]})");
  EXPECT_EQ(c.zeros, gptq::ZeroFormat::kV1MinusOne);
  EXPECT_EQ(c.block_name_to_quantize, std::vector<std::string>{"model.layers"});  // common prefix
  c = parse_ok(R"({"quant_method": "auto-round", "bits": 8, "group_size": 32})");
  EXPECT_EQ(c.packing_format, "auto_round:auto_gptq");
  EXPECT_EQ(c.zeros, gptq::ZeroFormat::kV1MinusOne);
}

// ---- every malformed or unsupported field is named -----------------------------------------------

struct Bad {
  const char* json;
  const char* field;    // expected "field '...'" text
  const char* message;  // expected substring of the message
};

class QuantConfigMalformed : public ::testing::TestWithParam<Bad> {};

TEST_P(QuantConfigMalformed, ErrorNamesTheField) {
  const Bad& b = GetParam();
  auto r = parse_quantization_config_text(b.json, "config.json");
  ASSERT_FALSE(r.ok()) << b.json;
  EXPECT_THAT(r.error().what(), HasSubstr("file 'config.json'"));
  EXPECT_THAT(r.error().what(), HasSubstr(std::string("field '") + b.field + "'"));
  EXPECT_THAT(r.error().what(), HasSubstr(b.message));
}

INSTANTIATE_TEST_SUITE_P(
    QuantConfig, QuantConfigMalformed,
    ::testing::Values(
        Bad{R"([1, 2])", "quantization_config", "expected an object"},
        Bad{R"({"bits": 4})", "quantization_config.quant_method", "missing"},
        Bad{R"({"quant_method": 4})", "quantization_config.quant_method", "expected a string"},
        Bad{R"({"quant_method": "awq", "bits": 4})", "quantization_config.quant_method", "'awq' is not supported"},
        Bad{R"({"quant_method": "gptq"})", "quantization_config.bits", "missing"},
        Bad{R"({"quant_method": "gptq", "bits": "4"})", "quantization_config.bits", "expected an integer"},
        Bad{R"({"quant_method": "gptq", "bits": 4.0})", "quantization_config.bits", "expected an integer"},
        Bad{R"({"quant_method": "gptq", "bits": 3})", "quantization_config.bits", "3-bit weights are not supported"},
        Bad{R"({"quant_method": "gptq", "bits": 4, "group_size": 0})", "quantization_config.group_size",
            "neither -1"},
        Bad{R"({"quant_method": "gptq", "bits": 4, "group_size": true})", "quantization_config.group_size",
            "expected an integer"},
        Bad{R"({"quant_method": "gptq", "bits": 4, "sym": false})", "quantization_config.sym", "asymmetric"},
        Bad{R"({"quant_method": "gptq", "bits": 4, "sym": "yes"})", "quantization_config.sym", "true or false"},
        Bad{R"({"quant_method": "gptq", "bits": 4, "desc_act": 1})", "quantization_config.desc_act", "true or false"},
        Bad{R"({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"})",
            "quantization_config.checkpoint_format", "'marlin' is not supported"},
        Bad{R"({"quant_method": "gptq", "bits": 4, "format": "bitblas"})", "quantization_config.format",
            "'bitblas' is not supported"},
        Bad{R"({"quant_method": "gptq", "bits": 4, "is_marlin_format": true})", "quantization_config.is_marlin_format",
            "Marlin"},
        Bad{R"({"quant_method": "gptq", "bits": 4, "pack_dtype": "int16"})", "quantization_config.pack_dtype",
            "'int16'"},
        Bad{R"({"quant_method": "gptq", "bits": 4, "lm_head": "no"})", "quantization_config.lm_head", "true or false"},
        Bad{R"({"quant_method": "gptq", "bits": 4, "modules_to_not_convert": "lm_head"})",
            "quantization_config.modules_to_not_convert", "expected a list"},
        Bad{R"({"quant_method": "gptq", "bits": 4, "modules_to_not_convert": ["lm_head", 3]})",
            "quantization_config.modules_to_not_convert", "entry 1"},
        Bad{R"({"quant_method": "gptq", "bits": 4, "modules_in_block_to_quantize": [["mlp.up_proj"]]})",
            "quantization_config.modules_in_block_to_quantize", "not supported"},
        Bad{R"({"quant_method": "gptq", "bits": 4, "dynamic": [1]})", "quantization_config.dynamic",
            "expected an object"},
        Bad{R"({"quant_method": "gptq", "bits": 4, "dynamic": {"+:(unclosed": {"bits": 8}}})",
            "quantization_config.dynamic.+:(unclosed", "cannot compile regex"},
        Bad{R"({"quant_method": "gptq", "bits": 4, "dynamic": {"+:.*up": {"bits": 5}}})",
            "quantization_config.dynamic.+:.*up.bits", "5-bit"},
        Bad{R"({"quant_method": "gptq", "bits": 4, "dynamic": {"+:.*up": {"sym": false}}})",
            "quantization_config.dynamic.+:.*up.sym", "asymmetric"},
        Bad{R"({"quant_method": "auto-round", "bits": 4, "data_type": "nv_fp"})", "quantization_config.data_type",
            "'nv_fp'"},
        Bad{R"({"quant_method": "auto-round", "bits": 4, "act_bits": 8})", "quantization_config.act_bits",
            "activation quantization"},
        Bad{R"({"quant_method": "auto-round", "bits": 4, "super_bits": 6})", "quantization_config.super_bits",
            "double-quantized"},
        Bad{R"({"quant_method": "auto-round", "bits": 4, "packing_format": "auto_round:auto_awq"})",
            "quantization_config.packing_format", "not supported"},
        Bad{R"({"quant_method": "auto-round", "bits": 4, "packing_format": 7})", "quantization_config.packing_format",
            "expected a string"},
        Bad{R"({"quant_method": "auto-round", "bits": 4, "block_name_to_quantize": 7})",
            "quantization_config.block_name_to_quantize", "expected a string or a list"},
        Bad{R"({"quant_method": "auto-round", "bits": 4, "extra_config": []})", "quantization_config.extra_config",
            "expected an object"},
        Bad{R"({"quant_method": "auto-round", "bits": 4, "extra_config": {"lm_head": 8}})",
            "quantization_config.extra_config.lm_head", "expected an object"},
        Bad{R"({"quant_method": "auto-round", "bits": 4, "extra_config": {"x.down_proj": {"bits": 4, "sym": false}}})",
            "quantization_config.extra_config.x.down_proj.sym", "asymmetric"},
        Bad{R"({"quant_method": "auto-round", "bits": 4, "extra_config": {"x.down_proj": {"bits": 4, "data_type": "mx_fp"}}})",
            "quantization_config.extra_config.x.down_proj.data_type", "'mx_fp'"},
        Bad{R"({"quant_method": "modelopt"})", "quantization_config.quant_algo", "missing"},
        Bad{R"({"quant_method": "modelopt", "quant_algo": "FP8"})", "quantization_config.quant_algo",
            "'FP8' is not supported"},
        Bad{R"({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"})", "quantization_config.quant_algo",
            "MIXED_PRECISION"},
        Bad{R"({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32})",
            "quantization_config.group_size", "expected 16"},
        Bad{R"({"quant_method": "modelopt", "quant_algo": "NVFP4",
                "config_groups": {"group_0": {"weights": {"group_size": 32}}}})",
            "quantization_config.config_groups.group_0.weights.group_size", "expected 16"},
        Bad{R"({"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": "lm_head"})",
            "quantization_config.ignore", "expected a list"},
        Bad{R"({"quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_scheme": {"num_bits": 4, "type": "int"}})",
            "quantization_config.kv_cache_scheme", "unsupported KV cache scheme"},
        Bad{R"({"quant_method": "modelopt", "quant_algo": "NVFP4", "producer": "modelopt"})",
            "quantization_config.producer", "expected an object"}));

TEST(QuantConfigModelOpt, MalformedHfQuantConfig) {
  struct Case {
    const char* json;
    const char* expect;
  };
  const Case cases[] = {
      {R"({"producer": {"name": "modelopt"}})", "field 'quantization': missing"},
      {R"({"quantization": []})", "field 'quantization': expected an object"},
      {R"({"quantization": {"group_size": 16}})", "field 'quantization.quant_algo': missing"},
      {R"({"quantization": {"quant_algo": "W4A8_AWQ"}})", "'W4A8_AWQ' is not supported"},
      {R"({"quantization": {"quant_algo": "NVFP4", "group_size": "16"}})", "field 'quantization.group_size'"},
      {R"({"quantization": {"quant_algo": "NVFP4", "exclude_modules": [1]}})", "field 'quantization.exclude_modules'"},
      {R"({"quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": 8}})",
       "field 'quantization.kv_cache_quant_algo'"},
      {R"({"quantization": {"quant_algo": "NVFP4"}, "producer": {"name": 1}})", "field 'producer.name'"},
      {R"({"quantization": {"quant_algo": "NVFP4"})", "not valid JSON"},
  };
  for (const Case& c : cases) {
    auto r = parse_hf_quant_config_text(c.json, "hf_quant_config.json");
    ASSERT_FALSE(r.ok()) << c.json;
    EXPECT_THAT(r.error().what(), HasSubstr("file 'hf_quant_config.json'")) << c.json;
    EXPECT_THAT(r.error().what(), HasSubstr(c.expect)) << c.json;
  }
}

TEST(QuantConfigMalformedJson, DeepNestingIsRefusedBeforeTheDom) {
  // Found with fuzz_model_config (a crafted input): a value nested 30000 levels deep, followed by
  // one more key, overflowed the stack inside the parse itself. An ordered_json object is a
  // vector of pairs with a const key, whose move may throw, so growing it copies every value, and
  // the copy recurses. The text is refused before any DOM is built.
  const std::string deep = std::string(200000, '[') + std::string(200000, ']');
  const std::string texts[] = {
      R"({"quant_method": "gptq", "bits": )" + deep + R"(, "group_size": 128})",
      R"({"quantization": {"quant_algo": )" + deep + R"(, "group_size": 16}, "producer": {}})",
  };
  for (const std::string& text : texts) {
    for (auto* parse : {&parse_quantization_config_text, &parse_hf_quant_config_text}) {
      auto r = parse(text, "deep.json");
      ASSERT_FALSE(r.ok());
      EXPECT_THAT(r.error().what(), HasSubstr("file 'deep.json'"));
      EXPECT_THAT(r.error().what(), HasSubstr("nests deeper than 64 levels"));
    }
  }
}

TEST(QuantConfigRegex, PathologicalPatternsAreRefusedOrRunInPolynomialTime) {
  // Found with fuzz_model_config (crafted inputs): a GPTQModel "dynamic" key is a regex the
  // loader runs against every module name. std::regex's default executor backtracks, so the
  // 7-character "(.|.)*q" took exponential time in the name's length (never finished on a 45-byte
  // name), and compiling 20000 nested groups, or matching 20000 "a*", overflowed the stack.
  const std::string name = "model.layers.10.mlp.experts.100.gate_proj.weight";
  for (const char* pattern : {"(.|.)*q", "(.*)*q", "(a|.)*(b|.)*(c|.)*q"}) {
    const std::string text =
        std::string(R"({"quant_method": "gptq", "bits": 4, "dynamic": {"+:)") + pattern + R"(": {"bits": 8}}})";
    const QuantConfig c = parse_ok(text);
    ASSERT_EQ(c.overrides.size(), 1u);
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_FALSE(c.overrides[0].matches(name)) << pattern;
    EXPECT_TRUE(c.overrides[0].matches(name + "q")) << pattern;
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0) << pattern;
  }
  const std::string long_patterns[] = {std::string(20000, '(') + "a" + std::string(20000, ')'),
                                       [] {
                                         std::string p;
                                         for (int i = 0; i < 20000; ++i) p += "a*";
                                         return p;
                                       }()};
  for (const std::string& p : long_patterns) {
    auto r = parse_quantization_config_text(
        R"({"quant_method": "auto-round", "bits": 4, "extra_config": {")" + p + R"(": {"bits": 8}}})", "config.json");
    ASSERT_FALSE(r.ok());
    EXPECT_THAT(r.error().what(), HasSubstr("field 'quantization_config.extra_config."));
    EXPECT_THAT(r.error().what(), HasSubstr("longer than 1024 characters"));
  }
  // Found by fuzz_model_config: libstdc++ reads a back-reference's or a repeat count's digits into a
  // long without an overflow check (undefined behaviour, reported by UBSan).
  for (const char* p : {R"(model\\18446744073709551615\\.x)", "a{99999999999999999999}", "a{1,12345678901}"}) {
    auto r = parse_quantization_config_text(
        R"({"quant_method": "gptq", "bits": 4, "dynamic": {"+:)" + std::string(p) + R"(": {"bits": 8}}})", "config.json");
    ASSERT_FALSE(r.ok()) << p;
    EXPECT_THAT(r.error().what(), HasSubstr("more than 9 digits")) << p;
  }
}

// Each pattern is matched against every module name, in time proportional to its length: 1000
// patterns of ~1 KB took ~0.75 s a module (hours for Qwen3-30B-A3B's ~18.7k modules; found by an
// audit, out of the fuzzers' 64 KiB inputs). The patterns' total is capped; exact AutoRound module
// names (compared, not matched) are not counted, so a per-module extra_config of any size loads.
TEST(QuantConfigRegex, ThePatternsTotalLengthIsBounded) {
  std::string dynamic;
  for (int i = 0; i < 200; ++i)
    dynamic += (i ? ", " : "") + fmt::format(R"("+:model\\.layers\\.{}\\..*(gate|up|down)_proj{}": {{"bits": 8}})", i,
                                             std::string(60, 'x'));
  auto r = parse_quantization_config_text(
      R"({"quant_method": "gptq", "bits": 4, "dynamic": {)" + dynamic + "}}", "config.json");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().field(), "quantization_config.dynamic");
  EXPECT_THAT(r.error().what(), HasSubstr("regex patterns total"));
  std::string exact;
  for (int i = 0; i < 2000; ++i)
    exact += (i ? ", " : "") + fmt::format(R"("model.layers.{}.mlp.experts.{}.down_proj": {{"bits": 8}})", i / 128, i % 128);
  const QuantConfig c = parse_ok(R"({"quant_method": "auto-round", "bits": 4, "extra_config": {)" + exact + "}}");
  EXPECT_EQ(c.overrides.size(), 2000u);
}

// ---- wildcards ---------------------------------------------------------------------------------

TEST(QuantConfigWildcard, FnmatchSemantics) {
  EXPECT_TRUE(fnmatch_glob("lm_head", "lm_head"));
  EXPECT_FALSE(fnmatch_glob("lm_head", "model.lm_head"));
  EXPECT_TRUE(fnmatch_glob("*lm_head", "model.lm_head"));
  EXPECT_TRUE(fnmatch_glob("*.mlp.gate", "model.layers.0.mlp.gate"));  // '*' crosses dots
  EXPECT_FALSE(fnmatch_glob("*.mlp.gate", "model.layers.0.mlp.gate_proj"));
  EXPECT_TRUE(fnmatch_glob("model.layers.*.self_attn*", "model.layers.12.self_attn.o_proj"));
  EXPECT_FALSE(fnmatch_glob("model.layers.*.self_attn*", "model.layers.12.mlp.up_proj"));
  EXPECT_TRUE(fnmatch_glob("*", ""));
  EXPECT_TRUE(fnmatch_glob("a*b*c", "aXXbYbZc"));
  EXPECT_FALSE(fnmatch_glob("a*b*c", "aXXbYbZ"));
  EXPECT_TRUE(fnmatch_glob("layers.?.mlp", "layers.7.mlp"));
  EXPECT_FALSE(fnmatch_glob("layers.?.mlp", "layers.17.mlp"));
  EXPECT_TRUE(fnmatch_glob("layers.[0-3].mlp", "layers.2.mlp"));
  EXPECT_FALSE(fnmatch_glob("layers.[0-3].mlp", "layers.5.mlp"));
  EXPECT_TRUE(fnmatch_glob("layers.[!0-3].mlp", "layers.5.mlp"));
  EXPECT_FALSE(fnmatch_glob("layers.[!0-3].mlp", "layers.1.mlp"));
  EXPECT_TRUE(fnmatch_glob("a[]]b", "a]b"));
  EXPECT_TRUE(fnmatch_glob("a[b", "a[b"));  // unclosed '[' is a literal
  EXPECT_TRUE(fnmatch_glob("*experts.*.down_proj", "model.layers.3.mlp.experts.127.down_proj"));
}

TEST(QuantConfigWildcard, PlainNamesAlsoExcludeChildren) {
  QuantConfig c;
  c.method = QuantMethod::kModelOpt;
  c.exclude_modules = {"model.layers.0.mlp", "*.shared_expert_gate"};
  EXPECT_TRUE(c.is_excluded("model.layers.0.mlp"));
  EXPECT_TRUE(c.is_excluded("model.layers.0.mlp.experts.3.up_proj"));
  EXPECT_FALSE(c.is_excluded("model.layers.0.mlp_norm"));
  EXPECT_FALSE(c.is_excluded("model.layers.10.mlp.experts.3.up_proj"));
  EXPECT_TRUE(c.is_excluded("model.layers.9.mlp.shared_expert_gate"));
  EXPECT_TRUE(QuantConfig{}.is_excluded("anything"));  // unquantized model
}

// ---- loading from a model directory --------------------------------------------------------------

class QuantConfigLoad : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("moebius_qc_" + std::to_string(::getpid()) + "_" +
                                                     ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  void write(const std::string& name, const std::string& text) { std::ofstream(dir_ / name) << text; }
  std::filesystem::path dir_;
};

TEST_F(QuantConfigLoad, PrefersHfQuantConfigThenConfigJson) {
  write("config.json", R"({"model_type": "qwen3_moe", "quantization_config": {"quant_method": "gptq", "bits": 4}})");
  auto r = load_quant_config(dir_.string());
  ASSERT_TRUE(r.ok()) << r.error().what();
  EXPECT_EQ(r->method, QuantMethod::kGptq);
  write("hf_quant_config.json", R"({"quantization": {"quant_algo": "NVFP4", "exclude_modules": ["lm_head"]}})");
  r = load_quant_config(dir_.string());
  ASSERT_TRUE(r.ok()) << r.error().what();
  EXPECT_EQ(r->method, QuantMethod::kModelOpt);
}

TEST_F(QuantConfigLoad, UnquantizedAndErrorsNameTheFile) {
  write("config.json", R"({"model_type": "qwen3_moe"})");
  auto r = load_quant_config(dir_.string());
  ASSERT_TRUE(r.ok()) << r.error().what();
  EXPECT_FALSE(r->is_quantized());
  write("config.json", R"({"quantization_config": {"quant_method": "gptq", "bits": 5}})");
  r = load_quant_config(dir_.string());
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.error().what(), HasSubstr("config.json"));
  EXPECT_THAT(r.error().what(), HasSubstr("field 'quantization_config.bits'"));
  std::filesystem::remove(dir_ / "config.json");
  r = load_quant_config(dir_.string());
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.error().what(), HasSubstr("cannot open"));
}

}  // namespace
}  // namespace moebius
