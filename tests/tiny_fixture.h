// The tiny Qwen3-MoE fixture (tests/data/tiny-qwen3-moe, made by tools/fixtures/
// make_tiny_qwen3_moe.py): its directory and transformers' reference logits, shared by the CPU and
// the CUDA model tests. In a GPU test, include gpu/gpu_test_util.h first (fmt under nvcc).
#pragma once

#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>
#include <vector>

#include <nlohmann/json.hpp>

#include "formats/safetensors.h"
#include "test_util.h"

namespace moebius::testing {

inline std::string tiny_fixture_dir() { return test_data_dir() + "/tiny-qwen3-moe"; }

// reference.safetensors: the prompt and transformers' fp32 logits.
struct TinyReference {
  std::vector<int32_t> ids;           // [20]
  std::vector<float> logits;          // [20, V]
  std::vector<float> decode_logits;   // [8, V], positions 11..18
  int64_t vocab = 0;
};

inline TinyReference load_tiny_reference() {
  TinyReference r;
  auto f = SafetensorsFile::open(tiny_fixture_dir() + "/reference.safetensors");
  EXPECT_TRUE(f.ok()) << f.error().what();
  if (!f.ok()) return r;
  auto ids = f->get("input_ids", DType::kI64);
  auto lg = f->get("logits", DType::kF32);
  auto dl = f->get("decode_logits", DType::kF32);
  EXPECT_TRUE(ids.ok() && lg.ok() && dl.ok());
  if (!ids.ok() || !lg.ok() || !dl.ok()) return r;
  for (int64_t i = 0; i < ids->numel(); ++i) {
    int64_t v;
    std::memcpy(&v, static_cast<const uint8_t*>(ids->data) + i * 8, 8);
    r.ids.push_back(static_cast<int32_t>(v));
  }
  r.vocab = lg->shape[1];
  r.logits.resize(static_cast<size_t>(lg->numel()));
  std::memcpy(r.logits.data(), lg->data, lg->nbytes());
  r.decode_logits.resize(static_cast<size_t>(dl->numel()));
  std::memcpy(r.decode_logits.data(), dl->data, dl->nbytes());
  return r;
}

// The tiny fixture with YaRN on, as tools/fixtures/make_rope_scaling_ref.py made
// reference_yarn.safetensors from it: a directory holding its config.json with kTinyYarnScaling
// set and a copy of its model.safetensors (removed when this object goes).
inline constexpr const char* kTinyYarnScaling =
    R"({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64})";
class TinyYarnFixture {
 public:
  TinyYarnFixture() {
    namespace fs = std::filesystem;
    dir_ = (fs::temp_directory_path() / ("moebius-tiny-yarn-" + std::to_string(::getpid()) + "-" +
                                         std::to_string(reinterpret_cast<uintptr_t>(this))))
               .string();
    fs::create_directories(dir_);
    std::ifstream in(tiny_fixture_dir() + "/config.json");
    nlohmann::json cfg = nlohmann::json::parse(in);
    cfg["rope_scaling"] = nlohmann::json::parse(kTinyYarnScaling);
    std::ofstream(dir_ + "/config.json") << cfg.dump(2);
    fs::copy_file(tiny_fixture_dir() + "/model.safetensors", dir_ + "/model.safetensors",
                  fs::copy_options::overwrite_existing);
  }
  ~TinyYarnFixture() {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  TinyYarnFixture(const TinyYarnFixture&) = delete;
  TinyYarnFixture& operator=(const TinyYarnFixture&) = delete;
  const std::string& dir() const { return dir_; }

  // reference_yarn.safetensors: transformers' fp32 logits of the 20 ids with YaRN on (transformers
  // 5.17.0, made on the GPU machine by tools/fixtures/make_rope_scaling_ref.py); empty if the file
  // is absent, which the tests report as a failure.
  static std::string reference_path() { return tiny_fixture_dir() + "/reference_yarn.safetensors"; }
  static std::vector<float> reference_logits() {
    if (!std::filesystem::exists(reference_path())) return {};
    auto f = SafetensorsFile::open(reference_path());
    EXPECT_TRUE(f.ok()) << f.error().what();
    if (!f.ok()) return {};
    auto lg = f->get("logits", DType::kF32);
    EXPECT_TRUE(lg.ok());
    if (!lg.ok()) return {};
    std::vector<float> out(static_cast<size_t>(lg->numel()));
    std::memcpy(out.data(), lg->data, lg->nbytes());
    return out;
  }

 private:
  std::string dir_;
};

}  // namespace moebius::testing
