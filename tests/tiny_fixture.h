// The tiny Qwen3-MoE fixture (tests/data/tiny-qwen3-moe, made by tools/fixtures/
// make_tiny_qwen3_moe.py): its directory and transformers' reference logits, shared by the CPU and
// the CUDA model tests. In a GPU test, include gpu/gpu_test_util.h first (fmt under nvcc).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

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

}  // namespace moebius::testing
