// Edited copies of the tiny Qwen3-MoE fixture (tests/data/tiny-qwen3-moe) for the weight-update
// tests (CPU model, engine, and tests/gpu): the fixture's tensors are read into memory, edited
// (perturbed values, a wrong shape or dtype, a tensor dropped) and written with config.json
// (possibly edited) and generation_config.json into a fresh directory under the system temp dir.
// No JSON library here: the GPU tests include this under nvcc.
#pragma once

#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "formats/nvfp4.h"
#include "formats/safetensors.h"
#include "test_util.h"
#include "tiny_fixture.h"

namespace moebius::testing {

struct FixtureTensor {
  DType dtype = DType::kBF16;
  Shape shape;
  std::vector<uint8_t> bytes;
};
using FixtureTensors = std::map<std::string, FixtureTensor>;

inline std::string read_file_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Every tensor of the fixture's model.safetensors.
inline FixtureTensors tiny_fixture_tensors() {
  FixtureTensors out;
  auto ck = SafetensorsCheckpoint::open(tiny_fixture_dir());
  EXPECT_TRUE(ck.ok()) << ck.error().what();
  if (!ck.ok()) return out;
  for (const std::string& name : ck->names()) {
    const TensorInfo* t = ck->find(name);
    out[name] = FixtureTensor{t->dtype, t->shape, std::vector<uint8_t>(t->data, t->data + t->nbytes())};
  }
  return out;
}

// Every BF16 value times (1 + 0.25 u), u uniform in [-1, 1), drawn from `seed` in name order: a
// different model of the same geometry, every tensor changed (norm weights included).
inline void perturb_bf16(FixtureTensors& tensors, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (auto& [name, t] : tensors) {
    if (t.dtype != DType::kBF16) continue;
    for (size_t i = 0; i + 1 < t.bytes.size(); i += 2) {
      uint16_t b;
      std::memcpy(&b, t.bytes.data() + i, 2);
      b = float_to_bf16_bits(bf16_bits_to_float(b) * (1.0f + 0.25f * u(rng)));
      std::memcpy(t.bytes.data() + i, &b, 2);
    }
  }
}

// The fixture's config.json with the first `"key": old` replaced by `"key": value` (the fixture
// writes `"key": value` with one space). Fails the test when the key is absent.
inline std::string fixture_config_with(const std::string& key, const std::string& value) {
  std::string text = read_file_text(tiny_fixture_dir() + "/config.json");
  const std::string needle = "\"" + key + "\": ";
  const size_t at = text.find(needle);
  EXPECT_NE(at, std::string::npos) << key;
  if (at == std::string::npos) return text;
  const size_t begin = at + needle.size();
  const size_t end = text.find_first_of(",\n}", begin);
  return text.replace(begin, end - begin, value);
}

inline std::filesystem::path fixture_copy_dir(const std::string& tag) {
  return std::filesystem::temp_directory_path() / ("moebius-copy-" + tag + "-" + std::to_string(::getpid()));
}

// Removes every directory write_fixture_copy made in this process. (A model that mmaps files from
// one keeps them readable after the removal, as POSIX unlink does.)
inline void remove_fixture_copies() {
  namespace fs = std::filesystem;
  const std::string suffix = "-" + std::to_string(::getpid());
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(fs::temp_directory_path(), ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("moebius-copy-", 0) == 0 && name.size() > suffix.size() &&
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
      fs::remove_all(e.path(), ec);
  }
}

// A fresh directory <tmp>/moebius-copy-<tag>-<pid> holding `tensors` as model.safetensors, config.json
// (`config`, or the fixture's when empty) and the fixture's generation_config.json.
inline std::string write_fixture_copy(const std::string& tag, const FixtureTensors& tensors,
                                      const std::string& config = "") {
  namespace fs = std::filesystem;
  const fs::path dir = fixture_copy_dir(tag);
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream(dir / "config.json", std::ios::binary)
      << (config.empty() ? read_file_text(tiny_fixture_dir() + "/config.json") : config);
  fs::copy_file(fs::path(tiny_fixture_dir()) / "generation_config.json", dir / "generation_config.json");
  SafetensorsWriter w;
  for (const auto& [name, t] : tensors) {
    const Status st = w.add(name, t.dtype, t.shape, t.bytes);
    EXPECT_TRUE(st.ok()) << name << ": " << st.error().what();
  }
  const Status st = w.write((dir / "model.safetensors").string());
  EXPECT_TRUE(st.ok()) << st.error().what();
  return dir.string();
}

// The fixture with every expert in ModelOpt's NVFP4 layout (weight, weight_scale,
// weight_scale_2; hf_quant_config.json), quantized by nvfp4::quantize.
inline std::string write_nvfp4_fixture_copy(const std::string& tag) {
  FixtureTensors out;
  for (auto& [name, t] : tiny_fixture_tensors()) {
    if (name.find(".mlp.experts.") == std::string::npos) {
      out[name] = t;
      continue;
    }
    const int64_t N = t.shape[0], K = t.shape[1];
    std::vector<float> w(static_cast<size_t>(N * K));
    for (size_t i = 0; i < w.size(); ++i) {
      uint16_t b;
      std::memcpy(&b, t.bytes.data() + 2 * i, 2);
      w[i] = bf16_bits_to_float(b);
    }
    auto q = nvfp4::quantize(w.data(), N, K);
    EXPECT_TRUE(q.ok()) << q.error().what();
    if (!q.ok()) continue;
    const std::string module = name.substr(0, name.size() - std::string(".weight").size());
    const float s2 = q->scale_2.at(0).scale_2;
    std::vector<uint8_t> s2_bytes(4);
    std::memcpy(s2_bytes.data(), &s2, 4);
    out[module + ".weight"] = FixtureTensor{DType::kU8, Shape{N, K / 2}, {q->weight.begin(), q->weight.end()}};
    out[module + ".weight_scale"] =
        FixtureTensor{DType::kF8E4M3, Shape{N, K / 16}, {q->scales.begin(), q->scales.end()}};
    out[module + ".weight_scale_2"] = FixtureTensor{DType::kF32, Shape{}, s2_bytes};
  }
  const std::string dir = write_fixture_copy(tag, out);
  std::ofstream(std::filesystem::path(dir) / "hf_quant_config.json")
      << R"({"producer": {"name": "modelopt", "version": "0.29.0"},
            "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": null, "group_size": 16,
                             "exclude_modules": ["lm_head"]}})";
  return dir;
}

}  // namespace moebius::testing
