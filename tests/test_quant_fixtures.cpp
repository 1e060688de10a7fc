// Bit-exact agreement with an independent PyTorch implementation of the published formulas
// (tools/fixtures/make_quant_fixtures.py). The fixture files live in tests/data/quant/:
//   nvfp4.safetensors  per case C: C.w F32 [N, K], C.weight U8 [N, K/2], C.weight_scale F8_E4M3
//                      [N, K/16], C.weight_scale_2 F32 [] or [1], C.dequant F32 [N, K]
//   gptq.safetensors   w BF16 [N, K] shared by all cases; per case "int{B}_g{G}_{scheme}":
//                      .qweight I32, .qzeros I32 (GPTQ v1), .scales F16, optionally .g_idx I32 and
//                      .dequant F32 [R, K] = rows [dequant_row_begin, +R) (metadata)
// When a file is absent the tests skip with a message.
#include <gtest/gtest.h>

#include <bit>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "formats/gptq.h"
#include "formats/nvfp4.h"
#include "formats/quant_matrix.h"
#include "formats/safetensors.h"
#include "test_util.h"

namespace moebius {
namespace {

std::string fixture_path(const char* name) {
  return (std::filesystem::path(testing::test_data_dir()) / "quant" / name).string();
}

// Opens a fixture file, or sets `skip` to the reason it is absent.
std::optional<SafetensorsFile> open_fixture(const char* name, std::string* skip) {
  const std::string path = fixture_path(name);
  if (!std::filesystem::exists(path)) {
    *skip = "fixture " + path + " is absent; generate it with "
            "python3 tools/fixtures/make_quant_fixtures.py --out tests/data/quant (needs torch)";
    return std::nullopt;
  }
  auto f = SafetensorsFile::open(path);
  EXPECT_TRUE(f.ok()) << f.error().what();
  if (!f.ok()) return std::nullopt;
  return std::move(f).value();
}

TensorView must_view(const SafetensorsFile& f, const std::string& name) {
  auto v = f.view(name);
  EXPECT_TRUE(v.ok()) << v.error().what();
  return v.ok() ? *v : TensorView{};
}

std::vector<float> to_floats(const TensorView& v) {
  std::vector<float> out(static_cast<size_t>(v.numel()));
  for (int64_t i = 0; i < v.numel(); ++i) {
    if (v.dtype == DType::kF32) {
      std::memcpy(&out[i], static_cast<const uint8_t*>(v.data) + i * 4, 4);
    } else {
      uint16_t b;
      std::memcpy(&b, static_cast<const uint8_t*>(v.data) + i * 2, 2);
      out[i] = v.dtype == DType::kBF16 ? bf16_bits_to_float(b) : fp16_bits_to_float(b);
    }
  }
  return out;
}

// Number of positions where the bytes differ, with the first one reported.
size_t count_mismatches(std::span<const uint8_t> got, const TensorView& want, size_t elem, const std::string& what) {
  EXPECT_EQ(got.size(), want.nbytes()) << what;
  if (got.size() != want.nbytes()) return 1;
  const auto* w = static_cast<const uint8_t*>(want.data);
  size_t bad = 0;
  for (size_t i = 0; i < got.size(); i += elem) {
    if (std::memcmp(got.data() + i, w + i, elem) != 0) {
      if (bad == 0) ADD_FAILURE() << what << ": first mismatch at element " << i / elem;
      ++bad;
    }
  }
  return bad;
}

size_t count_float_mismatches(const float* got, const std::vector<float>& want, const std::string& what) {
  size_t bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], 4) != 0) {
      if (bad == 0) ADD_FAILURE() << what << ": element " << i << " is " << got[i] << ", expected " << want[i];
      ++bad;
    }
  }
  return bad;
}

std::vector<std::string> cases_with_suffix(const SafetensorsFile& f, const std::string& suffix) {
  std::set<std::string> out;
  for (const TensorInfo& t : f.tensors())
    if (t.name.size() > suffix.size() && t.name.compare(t.name.size() - suffix.size(), suffix.size(), suffix) == 0)
      out.insert(t.name.substr(0, t.name.size() - suffix.size()));
  return {out.begin(), out.end()};
}

TEST(QuantFixtures, Nvfp4MatchesTorchBitExactly) {
  std::string skip;
  auto f = open_fixture("nvfp4.safetensors", &skip);
  if (!f) GTEST_SKIP() << skip;
  const std::vector<std::string> cases = cases_with_suffix(*f, ".weight_scale_2");
  ASSERT_FALSE(cases.empty());
  for (const std::string& c : cases) {
    SCOPED_TRACE("case " + c);
    const TensorView w = must_view(*f, c + ".w");
    ASSERT_EQ(w.dtype, DType::kF32);
    const int64_t n = w.shape[0], k = w.shape[1];
    const std::vector<float> wf = to_floats(w);

    // Our quantizer against the fixture's checkpoint tensors.
    auto q = nvfp4::quantize(wf.data(), n, k);
    ASSERT_TRUE(q.ok()) << q.error().what();
    const TensorView ws2 = must_view(*f, c + ".weight_scale_2");
    float s2;
    std::memcpy(&s2, ws2.data, 4);
    EXPECT_EQ(std::bit_cast<uint32_t>(q->scale_2[0].scale_2), std::bit_cast<uint32_t>(s2));
    EXPECT_EQ(count_mismatches(q->weight, must_view(*f, c + ".weight"), 1, "weight"), 0u);
    EXPECT_EQ(count_mismatches(q->scales, must_view(*f, c + ".weight_scale"), 1, "weight_scale"), 0u);

    // Loading the fixture's tensors as a checkpoint and dequantizing them.
    nvfp4::CheckpointTensors t{must_view(*f, c + ".weight"), must_view(*f, c + ".weight_scale"), ws2, {}};
    auto m = nvfp4::from_checkpoint(t, c);
    ASSERT_TRUE(m.ok()) << m.error().what();
    std::vector<float> d(static_cast<size_t>(n * k));
    dequantize_rows(*m, 0, n, d.data());
    EXPECT_EQ(count_float_mismatches(d.data(), to_floats(must_view(*f, c + ".dequant")), "dequant"), 0u);
  }
}

TEST(QuantFixtures, GptqMatchesTorchBitExactly) {
  std::string skip;
  auto f = open_fixture("gptq.safetensors", &skip);
  if (!f) GTEST_SKIP() << skip;
  const TensorView w = must_view(*f, "w");
  ASSERT_EQ(w.dtype, DType::kBF16);
  const int64_t n = w.shape[0], k = w.shape[1];
  const std::vector<float> wf = to_floats(w);
  int64_t row_begin = 0;
  if (auto it = f->metadata().find("dequant_row_begin"); it != f->metadata().end())
    row_begin = std::stoll(it->second);

  const std::vector<std::string> cases = cases_with_suffix(*f, ".qweight");
  ASSERT_FALSE(cases.empty());
  int with_dequant = 0;
  for (const std::string& c : cases) {
    SCOPED_TRACE("case " + c);
    int bits = 0, group = 0;
    char scheme[32] = {};
    ASSERT_EQ(std::sscanf(c.c_str(), "int%d_g%d_%31s", &bits, &group, scheme), 3) << "bad case name";
    const IntRtnScheme sch = std::string(scheme) == "gptq" ? IntRtnScheme::kGptq : IntRtnScheme::kAutoRound;
    ASSERT_TRUE(std::string(scheme) == "gptq" || std::string(scheme) == "autoround") << scheme;

    auto q = gptq::quantize(wf.data(), n, k, bits, group, sch);
    ASSERT_TRUE(q.ok()) << q.error().what();
    EXPECT_EQ(count_mismatches(q->weight, must_view(*f, c + ".qweight"), 4, "qweight"), 0u);
    EXPECT_EQ(count_mismatches(q->scales, must_view(*f, c + ".scales"), 2, "scales"), 0u);
    const TensorView qz = must_view(*f, c + ".qzeros");
    const std::vector<int32_t> our_qz =
        gptq::make_symmetric_qzeros(bits, q->num_groups(), n, gptq::ZeroFormat::kV1MinusOne);
    EXPECT_EQ(count_mismatches({reinterpret_cast<const uint8_t*>(our_qz.data()), our_qz.size() * 4}, qz, 4, "qzeros"),
              0u);

    gptq::CheckpointTensors t{must_view(*f, c + ".qweight"), qz, must_view(*f, c + ".scales"), {}};
    if (f->find(c + ".g_idx") != nullptr) t.g_idx = must_view(*f, c + ".g_idx");
    auto m = gptq::from_checkpoint(t, {bits, group, gptq::ZeroFormat::kV1MinusOne}, c);
    ASSERT_TRUE(m.ok()) << m.error().what();
    if (f->find(c + ".dequant") != nullptr) {
      ++with_dequant;
      const TensorView dv = must_view(*f, c + ".dequant");
      const int64_t rows = dv.shape[0];
      ASSERT_LE(row_begin + rows, n);
      std::vector<float> d(static_cast<size_t>(n * k), 0.0f);
      dequantize_rows(*m, row_begin, row_begin + rows, d.data());
      EXPECT_EQ(count_float_mismatches(d.data() + row_begin * k, to_floats(dv), "dequant"), 0u);
    }
  }
  EXPECT_GT(with_dequant, 0);
}

}  // namespace
}  // namespace moebius
