// Pre-quantized Qwen3-MoE checkpoints: tiny checkpoints are built here from the committed bf16
// fixture (tests/data/tiny-qwen3-moe) by quantizing its experts with our quantizers (bit-exact
// with ModelOpt / AutoRound in torch, tests/test_quant_fixtures.cpp) and writing them in the
// ModelOpt NVFP4 and GPTQ layouts. Loading them must give the same expert bytes and the same
// logits as loading the bf16 fixture with --experts of that format; exclusions keep bf16; broken
// variants are refused with errors that name the tensor or field.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <regex>
#include <sstream>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "formats/gptq.h"
#include "formats/nvfp4.h"
#include "formats/quant_config.h"
#include "formats/safetensors.h"
#include "model/qwen3_moe_cpu.h"
#include "test_util.h"

namespace moebius::model {
namespace {

namespace fs = std::filesystem;
const std::string kDir = testing::test_data_dir() + "/tiny-qwen3-moe";

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct Tensor {
  DType dtype = DType::kF32;
  Shape shape;
  std::vector<uint8_t> bytes;
};
using Tensors = std::map<std::string, Tensor>;

template <typename T>
Tensor make_tensor(DType dtype, const Shape& shape, const T* data, size_t count) {
  Tensor t{dtype, shape, std::vector<uint8_t>(count * sizeof(T))};
  std::memcpy(t.bytes.data(), data, t.bytes.size());
  return t;
}
Tensor from_span(DType dtype, const Shape& shape, std::span<const uint8_t> b) {
  return Tensor{dtype, shape, std::vector<uint8_t>(b.begin(), b.end())};
}

enum class Kind { kModelOpt, kGptq, kAutoRound };

struct Spec {
  Kind kind = Kind::kModelOpt;
  int bits = 4;
  int group_size = 32;                 // int formats; NVFP4 uses 16
  std::vector<std::string> exclude;    // ModelOpt exclude_modules / GPTQ modules_to_not_convert
  bool quantize_q_proj = false;        // also quantize layer 0's self_attn.q_proj (a dense module)
};

// The quantization config JSON for `s`: hf_quant_config.json for ModelOpt, config.json's
// "quantization_config" for the int formats.
nlohmann::json quant_json(const Spec& s) {
  if (s.kind == Kind::kModelOpt) {
    return {{"producer", {{"name", "modelopt"}, {"version", "0.29.0"}}},
            {"quantization",
             {{"quant_algo", "NVFP4"}, {"kv_cache_quant_algo", nullptr}, {"group_size", 16},
              {"exclude_modules", s.exclude}}}};
  }
  nlohmann::json q = {{"bits", s.bits}, {"group_size", s.group_size}, {"sym", true}};
  if (s.kind == Kind::kGptq) {
    q["quant_method"] = "gptq";
    q["desc_act"] = false;
    q["checkpoint_format"] = "gptq";
  } else {
    q["quant_method"] = "auto-round";
    q["data_type"] = "int";
    q["packing_format"] = "auto_round:auto_gptq";
  }
  if (!s.exclude.empty()) q["modules_to_not_convert"] = s.exclude;
  return q;
}

std::vector<float> to_f32(const TensorView& v) {
  std::vector<float> out(static_cast<size_t>(v.numel()));
  for (size_t i = 0; i < out.size(); ++i) {
    uint16_t b;
    std::memcpy(&b, static_cast<const uint8_t*>(v.data) + 2 * i, 2);
    out[i] = bf16_bits_to_float(b);
  }
  return out;
}

// The fixture's tensors, with every linear module the spec quantizes (experts that the config
// does not exclude, plus optionally a q_proj) written in the checkpoint layout of `s`.
Tensors quantized_tensors(const Spec& s) {
  auto ck = SafetensorsCheckpoint::open(kDir);
  EXPECT_TRUE(ck.ok()) << ck.error().what();
  auto qc = s.kind == Kind::kModelOpt ? parse_hf_quant_config(quant_json(s)) : parse_quantization_config(quant_json(s));
  EXPECT_TRUE(qc.ok()) << qc.error().what();
  const std::regex expert(R"(model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight)");
  Tensors out;
  for (const std::string& name : ck->names()) {
    auto v = ck->view(name);
    EXPECT_TRUE(v.ok());
    const std::string module = name.substr(0, name.size() - std::string_view(".weight").size());
    const bool quantize = (std::regex_match(name, expert) && qc->layer(module).quantized) ||
                          (s.quantize_q_proj && name == "model.layers.0.self_attn.q_proj.weight");
    if (!quantize) {
      out[name] = from_span(v->dtype, v->shape, {static_cast<const uint8_t*>(v->data), v->nbytes()});
      continue;
    }
    const int64_t N = v->shape[0], K = v->shape[1];
    const std::vector<float> w = to_f32(*v);
    if (s.kind == Kind::kModelOpt) {
      auto m = nvfp4::quantize(w.data(), N, K);
      EXPECT_TRUE(m.ok()) << m.error().what();
      const float s2 = m->scale_2.at(0).scale_2, in_scale = 1.0f;
      out[module + ".weight"] = from_span(DType::kU8, Shape{N, K / 2}, m->weight);
      out[module + ".weight_scale"] = from_span(DType::kF8E4M3, Shape{N, K / 16}, m->scales);
      out[module + ".weight_scale_2"] = make_tensor(DType::kF32, Shape{}, &s2, 1);
      out[module + ".input_scale"] = make_tensor(DType::kF32, Shape{}, &in_scale, 1);
    } else {
      auto m = gptq::quantize(w.data(), N, K, s.bits, s.group_size);
      EXPECT_TRUE(m.ok()) << m.error().what();
      const int P = gptq::pack_factor(s.bits);
      const int64_t g = s.group_size > 0 ? s.group_size : K, G = (K + g - 1) / g;
      const std::vector<int32_t> qz = gptq::make_symmetric_qzeros(s.bits, G, N, gptq::ZeroFormat::kV1MinusOne);
      std::vector<int32_t> g_idx(static_cast<size_t>(K));
      for (int64_t k = 0; k < K; ++k) g_idx[static_cast<size_t>(k)] = static_cast<int32_t>(k / g);
      out[module + ".qweight"] = from_span(DType::kI32, Shape{K / P, N}, m->weight);
      out[module + ".qzeros"] = make_tensor(DType::kI32, Shape{G, N / P}, qz.data(), qz.size());
      out[module + ".scales"] = from_span(DType::kF16, Shape{G, N}, m->scales);
      out[module + ".g_idx"] = make_tensor(DType::kI32, Shape{K}, g_idx.data(), g_idx.size());
    }
  }
  return out;
}

// Writes a model directory: config.json (+ quantization_config) or hf_quant_config.json, and the
// tensors, sharded when `shard_bytes` > 0. `edit_quant` may change the config JSON.
std::string write_checkpoint(const std::string& tag, const Spec& s, const Tensors& tensors, uint64_t shard_bytes = 0,
                             const std::function<void(nlohmann::json&)>& edit_quant = {}) {
  const fs::path dir = fs::temp_directory_path() / ("moebius-prequant-" + tag + "-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  nlohmann::json config = nlohmann::json::parse(read_text(kDir + "/config.json"));
  nlohmann::json q = quant_json(s);
  if (edit_quant) edit_quant(q);
  if (s.kind == Kind::kModelOpt) std::ofstream(dir / "hf_quant_config.json") << q.dump(2);
  else config["quantization_config"] = q;
  std::ofstream(dir / "config.json") << config.dump(2);
  SafetensorsWriter w;
  for (const auto& [name, t] : tensors) {
    auto st = w.add(name, t.dtype, t.shape, t.bytes);
    EXPECT_TRUE(st.ok()) << st.error().what();
  }
  auto st = shard_bytes > 0 ? w.write_sharded(dir.string(), shard_bytes) : w.write((dir / "model.safetensors").string());
  EXPECT_TRUE(st.ok()) << st.error().what();
  return dir.string();
}

Qwen3MoeCpu load_or_die(const std::string& dir, const Qwen3MoeLoadOptions& opt = {}) {
  auto m = Qwen3MoeCpu::load(dir, opt);
  if (!m.ok()) {
    ADD_FAILURE() << m.error().what();
    std::abort();
  }
  return std::move(m).value();
}

void expect_same_matrix(const QuantMatrix& a, const QuantMatrix& b, const std::string& what) {
  EXPECT_EQ(a.format, b.format) << what;
  EXPECT_EQ(a.rows, b.rows) << what;
  EXPECT_EQ(a.cols, b.cols) << what;
  EXPECT_EQ(a.group_size, b.group_size) << what;
  EXPECT_TRUE(std::ranges::equal(a.weight, b.weight)) << what;
  EXPECT_TRUE(std::ranges::equal(a.scales, b.scales)) << what;
  ASSERT_EQ(a.scale_2.size(), b.scale_2.size()) << what;
  for (size_t i = 0; i < a.scale_2.size(); ++i) {
    EXPECT_EQ(a.scale_2[i].row_begin, b.scale_2[i].row_begin) << what;
    EXPECT_EQ(a.scale_2[i].scale_2, b.scale_2[i].scale_2) << what;
  }
}

// Every expert matrix bit-identical, and bit-identical logits for a 20-token prefill.
void expect_same_model(const Qwen3MoeCpu& a, const Qwen3MoeCpu& b, WeightFormat expected) {
  const auto& la = a.layers();
  const auto& lb = b.layers();
  ASSERT_EQ(la.size(), lb.size());
  for (size_t l = 0; l < la.size(); ++l) {
    if (!la[l].is_moe) continue;
    for (size_t e = 0; e < la[l].moe.experts.size(); ++e) {
      const auto& x = la[l].moe.experts[e];
      const auto& y = lb[l].moe.experts[e];
      const std::string what = "layer " + std::to_string(l) + " expert " + std::to_string(e);
      EXPECT_EQ(x.gate.format, expected) << what;
      expect_same_matrix(x.gate, y.gate, what + " gate");
      expect_same_matrix(x.up, y.up, what + " up");
      expect_same_matrix(x.down, y.down, what + " down");
    }
  }
  std::vector<int32_t> ids(20);
  for (int i = 0; i < 20; ++i) ids[static_cast<size_t>(i)] = (i * 37 + 11) % a.config().vocab_size;
  const size_t n = ids.size() * static_cast<size_t>(a.config().vocab_size);
  std::vector<float> ya(n), yb(n);
  KvCache ca = a.make_cache(), cb = b.make_cache();
  ASSERT_TRUE(a.forward(ids.data(), 20, ca, ya.data()).ok());
  ASSERT_TRUE(b.forward(ids.data(), 20, cb, yb.data()).ok());
  EXPECT_EQ(std::memcmp(ya.data(), yb.data(), n * sizeof(float)), 0) << "logits differ";
}

Qwen3MoeLoadOptions online(WeightFormat f, int group_size = 128) {
  Qwen3MoeLoadOptions o;
  o.experts_format = f;
  o.experts_group_size = group_size;
  return o;
}

// ---------------------------------------------------------------------------------------------
// Pre-quantized == online quantization of the bf16 fixture
// ---------------------------------------------------------------------------------------------

TEST(Qwen3MoePrequant, ModelOptNvfp4MatchesOnlineQuantization) {
  const Spec s{Kind::kModelOpt, 4, 16, {"lm_head"}};
  const std::string dir = write_checkpoint("nvfp4", s, quantized_tensors(s), /*shard_bytes=*/64 * 1024);
  ASSERT_TRUE(fs::exists(fs::path(dir) / "model.safetensors.index.json"));  // sharded
  const Qwen3MoeCpu pre = load_or_die(dir);
  EXPECT_EQ(pre.quant_config().method, QuantMethod::kModelOpt);
  expect_same_model(pre, load_or_die(kDir, online(WeightFormat::kNvFp4)), WeightFormat::kNvFp4);
  // --experts naming the checkpoint's own format is accepted and changes nothing.
  expect_same_model(load_or_die(dir, online(WeightFormat::kNvFp4)), pre, WeightFormat::kNvFp4);
  fs::remove_all(dir);
}

TEST(Qwen3MoePrequant, GptqInt4MatchesOnlineQuantization) {
  const Spec s{Kind::kGptq, 4, 32};
  const std::string dir = write_checkpoint("gptq4", s, quantized_tensors(s));
  const Qwen3MoeCpu pre = load_or_die(dir);
  EXPECT_EQ(pre.quant_config().method, QuantMethod::kGptq);
  expect_same_model(pre, load_or_die(kDir, online(WeightFormat::kInt4, 32)), WeightFormat::kInt4);
  fs::remove_all(dir);
}

TEST(Qwen3MoePrequant, AutoRoundInt2MatchesOnlineQuantization) {
  const Spec s{Kind::kAutoRound, 2, 32};
  const std::string dir = write_checkpoint("ar2", s, quantized_tensors(s));
  expect_same_model(load_or_die(dir), load_or_die(kDir, online(WeightFormat::kInt2, 32)), WeightFormat::kInt2);
  fs::remove_all(dir);
}

TEST(Qwen3MoePrequant, GptqPerChannelMatchesOnlineQuantization) {
  const Spec s{Kind::kGptq, 4, -1};
  const std::string dir = write_checkpoint("gptq4pc", s, quantized_tensors(s));
  expect_same_model(load_or_die(dir), load_or_die(kDir, online(WeightFormat::kInt4, -1)), WeightFormat::kInt4);
  fs::remove_all(dir);
}

TEST(Qwen3MoePrequant, QuantizedDenseModuleIsDequantizedAtLoad) {
  Spec s{Kind::kGptq, 4, 32};
  s.quantize_q_proj = true;
  const std::string dir = write_checkpoint("dense", s, quantized_tensors(s));
  const Qwen3MoeCpu pre = load_or_die(dir);
  // Expected: the fixture's q_proj through the same quantizer, dequantized.
  auto ck = SafetensorsCheckpoint::open(kDir);
  ASSERT_TRUE(ck.ok());
  auto v = ck->view("model.layers.0.self_attn.q_proj.weight");
  ASSERT_TRUE(v.ok());
  const int64_t N = v->shape[0], K = v->shape[1];
  const std::vector<float> w = to_f32(*v);
  auto m = gptq::quantize(w.data(), N, K, 4, 32);
  ASSERT_TRUE(m.ok());
  std::vector<float> expect(static_cast<size_t>(N * K));
  dequantize_rows(*m, 0, N, expect.data());
  EXPECT_EQ(pre.layers()[0].q_proj, expect);
  EXPECT_NE(pre.layers()[0].q_proj, w);  // it really was quantized
  EXPECT_EQ(pre.layers()[0].k_proj, load_or_die(kDir).layers()[0].k_proj);  // stored float: as is
  fs::remove_all(dir);
}

// ---------------------------------------------------------------------------------------------
// Exclusions and the --experts choice
// ---------------------------------------------------------------------------------------------

TEST(Qwen3MoePrequant, ExcludedExpertsKeepTheirSourcePrecision) {
  const Spec s{Kind::kModelOpt, 4, 16,
               {"lm_head", "model.layers.2.mlp.experts.3.*", "model.layers.0.mlp.experts.1.down_proj"}};
  const std::string dir = write_checkpoint("excl", s, quantized_tensors(s));
  const Qwen3MoeCpu bf16 = load_or_die(kDir);
  const Qwen3MoeCpu online_fp4 = load_or_die(kDir, online(WeightFormat::kNvFp4));
  // With and without --experts nvfp4: the excluded modules are never quantized online.
  for (const Qwen3MoeCpu& pre : {load_or_die(dir), load_or_die(dir, online(WeightFormat::kNvFp4))}) {
    for (int l : {0, 2}) {
      for (size_t e = 0; e < 16; ++e) {
        const auto& x = pre.layers()[static_cast<size_t>(l)].moe.experts[e];
        const auto& b = bf16.layers()[static_cast<size_t>(l)].moe.experts[e];
        const auto& q = online_fp4.layers()[static_cast<size_t>(l)].moe.experts[e];
        const std::string what = "layer " + std::to_string(l) + " expert " + std::to_string(e);
        const bool all = l == 2 && e == 3, down = all || (l == 0 && e == 1);
        expect_same_matrix(x.gate, all ? b.gate : q.gate, what + " gate");
        expect_same_matrix(x.up, all ? b.up : q.up, what + " up");
        expect_same_matrix(x.down, down ? b.down : q.down, what + " down");
      }
    }
  }
  fs::remove_all(dir);
}

TEST(Qwen3MoePrequant, ExpertsOfAnotherFormatAreRefused) {
  const Spec s{Kind::kModelOpt, 4, 16, {"lm_head"}};
  const std::string dir = write_checkpoint("other", s, quantized_tensors(s));
  for (WeightFormat f : {WeightFormat::kInt4, WeightFormat::kBF16}) {
    auto m = Qwen3MoeCpu::load(dir, online(f));
    ASSERT_FALSE(m.ok());
    EXPECT_EQ(m.error().tensor(), "model.layers.0.mlp.experts.0.gate_proj") << m.error().what();
    EXPECT_NE(m.error().what().find("re-quantize"), std::string::npos) << m.error().what();
  }
  fs::remove_all(dir);
}

// ---------------------------------------------------------------------------------------------
// Broken checkpoints
// ---------------------------------------------------------------------------------------------

// Loads a variant of `s`'s checkpoint changed by `edit` (tensors) / `edit_quant` (config) and
// returns the load error.
Error load_error(const Spec& s, const std::function<void(Tensors&)>& edit,
                 const std::function<void(nlohmann::json&)>& edit_quant = {}) {
  Tensors t = quantized_tensors(s);
  if (edit) edit(t);
  const std::string dir = write_checkpoint("bad", s, t, 0, edit_quant);
  auto m = Qwen3MoeCpu::load(dir);
  fs::remove_all(dir);
  if (m.ok()) {
    ADD_FAILURE() << "the broken checkpoint loaded";
    return Error("loaded");
  }
  return std::move(m).error();
}

bool mentions(const Error& e, const std::string& s) { return e.what().find(s) != std::string::npos; }

TEST(Qwen3MoePrequant, MissingWeightScale2IsNamed) {
  const std::string name = "model.layers.2.mlp.experts.5.up_proj.weight_scale_2";
  const Error e = load_error({Kind::kModelOpt, 4, 16}, [&](Tensors& t) { t.erase(name); });
  EXPECT_EQ(e.tensor(), name) << e.what();
  EXPECT_TRUE(mentions(e, "missing")) << e.what();
}

TEST(Qwen3MoePrequant, MissingQweightIsNamed) {
  const std::string name = "model.layers.0.mlp.experts.9.down_proj.qweight";
  const Error e = load_error({Kind::kGptq, 4, 32}, [&](Tensors& t) { t.erase(name); });
  EXPECT_EQ(e.tensor(), name) << e.what();
}

TEST(Qwen3MoePrequant, WrongQweightShapeIsNamed) {
  // [K/8, N] = [8, 32] stored transposed as [32, 8]: the same bytes, a different matrix.
  const std::string name = "model.layers.2.mlp.experts.0.gate_proj.qweight";
  const Error e = load_error({Kind::kGptq, 4, 32}, [&](Tensors& t) { t.at(name).shape = Shape{32, 8}; });
  EXPECT_EQ(e.tensor(), name) << e.what();
  EXPECT_TRUE(mentions(e, "[8, 32]")) << e.what();
}

TEST(Qwen3MoePrequant, WrongNvfp4WeightShapeIsNamed) {
  const std::string name = "model.layers.0.mlp.experts.2.down_proj.weight";  // [64, 16]
  const Error e = load_error({Kind::kModelOpt, 4, 16}, [&](Tensors& t) { t.at(name).shape = Shape{16, 64}; });
  EXPECT_EQ(e.tensor(), name) << e.what();
}

TEST(Qwen3MoePrequant, AsymmetricQzerosAreRefusedNamingTheTensor) {
  const std::string name = "model.layers.0.mlp.experts.4.up_proj.qzeros";
  const Error e = load_error({Kind::kGptq, 4, 32}, [&](Tensors& t) {
    const int32_t word = 0x77777778;  // column 0 of group 0 stores zero 8 (v1: 7 is symmetric)
    std::memcpy(t.at(name).bytes.data(), &word, 4);
  });
  EXPECT_TRUE(mentions(e, name)) << e.what();
  EXPECT_TRUE(mentions(e, "symmetric")) << e.what();
}

TEST(Qwen3MoePrequant, ActOrderGidxIsRefusedNamingTheTensor) {
  const std::string name = "model.layers.2.mlp.experts.6.gate_proj.g_idx";
  const Error e = load_error({Kind::kGptq, 4, 32}, [&](Tensors& t) {
    std::vector<int32_t> g(64);
    for (int k = 0; k < 64; ++k) g[static_cast<size_t>(k)] = k % 2;  // a desc_act permutation
    std::memcpy(t.at(name).bytes.data(), g.data(), g.size() * 4);
  });
  EXPECT_TRUE(mentions(e, name)) << e.what();
}

TEST(Qwen3MoePrequant, UnsupportedBitsAreRefusedNamingTheField) {
  const Error e = load_error({Kind::kGptq, 4, 32}, {}, [](nlohmann::json& q) { q["bits"] = 3; });
  EXPECT_TRUE(mentions(e, "bits")) << e.what();
  EXPECT_TRUE(mentions(e, "config.json")) << e.what();
}

}  // namespace
}  // namespace moebius::model
