// The repack into the CUDA tile layout ([TAG_EXPERT_TILE_LAYOUT]) must be lossless: unpacking the
// packed bytes gives exactly the checkpoint's dequantized values, and padding is exactly zero.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <iterator>
#include <random>

#include "core/dtype.h"
#include "moe/expert_layout.h"

namespace moebius::moe {
namespace {

QuantMatrix random_matrix(WeightFormat f, int64_t rows, int64_t cols, int group, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 0.5f);
  std::vector<float> w(static_cast<size_t>(rows * cols));
  for (auto& v : w) v = d(rng);
  auto m = quantize(f, w.data(), rows, cols, group);
  EXPECT_TRUE(m.ok()) << m.error().what();
  return std::move(m).value();
}

struct LayoutCase {
  const char* name;
  WeightFormat format;
  int64_t rows, cols;
  int group;
};

class ExpertLayoutRoundTrip : public ::testing::TestWithParam<LayoutCase> {};

TEST_P(ExpertLayoutRoundTrip, PackMatrixIsLossless) {
  const auto& c = GetParam();
  QuantMatrix m = random_matrix(c.format, c.rows, c.cols, c.group, 11);
  auto p = pack_matrix(m);
  ASSERT_TRUE(p.ok()) << p.error().what();
  EXPECT_EQ(p->rows_padded % 16, 0);
  EXPECT_EQ(p->cols_padded % chunk_k(p->format), 0);
  std::vector<float> ref(static_cast<size_t>(c.rows * c.cols)), got(static_cast<size_t>(p->rows_padded * p->cols_padded), -1.0f);
  dequantize_rows(m, 0, c.rows, ref.data());
  unpack_to_float(*p, got.data());
  for (int64_t r = 0; r < p->rows_padded; ++r)
    for (int64_t k = 0; k < p->cols_padded; ++k) {
      const float want = (r < c.rows && k < c.cols) ? ref[r * c.cols + k] : 0.0f;
      ASSERT_EQ(got[r * p->cols_padded + k], want) << c.name << " row " << r << " k " << k;
    }
}

TEST_P(ExpertLayoutRoundTrip, PackGateUpInterleavesByEightRows) {
  const auto& c = GetParam();
  QuantMatrix gate = random_matrix(c.format, c.rows, c.cols, c.group, 21);
  QuantMatrix up = random_matrix(c.format, c.rows, c.cols, c.group, 22);
  auto p = pack_gate_up(gate, up);
  ASSERT_TRUE(p.ok()) << p.error().what();
  const int64_t I8 = (c.rows + 7) / 8 * 8;
  EXPECT_EQ(p->rows, 2 * I8);
  std::vector<float> g(static_cast<size_t>(c.rows * c.cols)), u(g.size());
  dequantize_rows(gate, 0, c.rows, g.data());
  dequantize_rows(up, 0, c.rows, u.data());
  std::vector<float> got(static_cast<size_t>(p->rows_padded * p->cols_padded));
  unpack_to_float(*p, got.data());
  for (int64_t r = 0; r < p->rows_padded; ++r) {
    const int64_t i = (r / 16) * 8 + (r % 8);
    const bool is_up = (r % 16) >= 8;
    for (int64_t k = 0; k < p->cols_padded; ++k) {
      float want = 0.0f;
      if (i < c.rows && k < c.cols) want = (is_up ? u : g)[i * c.cols + k];
      ASSERT_EQ(got[r * p->cols_padded + k], want) << c.name << " row " << r << " k " << k;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    ExpertLayout, ExpertLayoutRoundTrip,
    ::testing::Values(LayoutCase{"bf16", WeightFormat::kBF16, 48, 64, 0},
                      LayoutCase{"bf16_odd", WeightFormat::kBF16, 13, 29, 0},
                      LayoutCase{"nvfp4", WeightFormat::kNvFp4, 32, 128, 16},
                      LayoutCase{"nvfp4_odd_rows_k48", WeightFormat::kNvFp4, 21, 48, 16},
                      LayoutCase{"int4_g128", WeightFormat::kInt4, 40, 256, 128},
                      LayoutCase{"int4_g32", WeightFormat::kInt4, 16, 96, 32},
                      LayoutCase{"int4_perchannel", WeightFormat::kInt4, 24, 192, -1},
                      LayoutCase{"int2_g128", WeightFormat::kInt2, 33, 384, 128},
                      LayoutCase{"int2_g64", WeightFormat::kInt2, 16, 192, 64}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(ExpertLayout, RefusesWhatTheKernelsCannotRun) {
  QuantMatrix i8 = random_matrix(WeightFormat::kInt8, 16, 64, 32, 1);
  EXPECT_THAT(pack_matrix(i8).error().what(), ::testing::HasSubstr("int8"));
  QuantMatrix a = random_matrix(WeightFormat::kInt4, 16, 128, 128, 1);
  QuantMatrix b = random_matrix(WeightFormat::kInt4, 16, 128, 64, 2);
  EXPECT_THAT(pack_gate_up(a, b).error().what(), ::testing::HasSubstr("must match"));
}

// A MoE layer of 4 experts, H = 64, I = 32, in `f`.
cpu::MoeLayerReference random_layer(WeightFormat f, int group) {
  cpu::MoeLayerReference L;
  L.shape = cpu::MoeShape{64, 32, 4, 2};
  L.router.num_experts = 4;
  L.router.top_k = 2;
  std::mt19937_64 rng(5);
  std::normal_distribution<float> d(0.0f, 0.5f);
  L.router_weight.resize(4 * 64);
  for (auto& v : L.router_weight) v = d(rng);
  for (int e = 0; e < 4; ++e)
    L.experts.push_back({random_matrix(f, 32, 64, group, 100 + 3 * e), random_matrix(f, 32, 64, group, 101 + 3 * e),
                         random_matrix(f, 64, 32, group, 102 + 3 * e)});
  return L;
}

// pack_moe_layer is what MoeLayerCuda uploads at creation and on a weight update: exactly the
// per-expert packs and the router in bf16.
TEST(ExpertLayout, PackMoeLayerPacksEveryExpertAndTheRouter) {
  const cpu::MoeLayerReference L = random_layer(WeightFormat::kNvFp4, 16);
  auto p = pack_moe_layer(L);
  ASSERT_TRUE(p.ok()) << p.error().what();
  EXPECT_EQ(p->format, KernelFormat::kNvFp4);
  ASSERT_EQ(p->w13.size(), 4u);
  ASSERT_EQ(p->w2.size(), 4u);
  for (int e = 0; e < 4; ++e) {
    const auto& x = L.experts[static_cast<size_t>(e)];
    auto a = pack_gate_up(x.gate, x.up);
    auto b = pack_matrix(x.down);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(p->w13[static_cast<size_t>(e)].weight, a->weight) << e;
    EXPECT_EQ(p->w13[static_cast<size_t>(e)].scales, a->scales) << e;
    EXPECT_EQ(p->w13[static_cast<size_t>(e)].global_scale[1], a->global_scale[1]) << e;
    EXPECT_EQ(p->w2[static_cast<size_t>(e)].weight, b->weight) << e;
    EXPECT_EQ(p->w2[static_cast<size_t>(e)].scales, b->scales) << e;
  }
  ASSERT_EQ(p->router.size(), L.router_weight.size());
  for (size_t i = 0; i < p->router.size(); ++i) ASSERT_EQ(p->router[i], float_to_bf16_bits(L.router_weight[i]));
}

TEST(ExpertLayout, PackMoeLayerRefusesExpertsOfMixedFormats) {
  cpu::MoeLayerReference L = random_layer(WeightFormat::kInt4, 32);
  L.experts[2].down = random_matrix(WeightFormat::kInt4, 64, 32, 16, 9);  // another group size
  auto p = pack_moe_layer(L);
  ASSERT_FALSE(p.ok());
  EXPECT_THAT(p.error().what(), ::testing::HasSubstr("expert 2"));
}

// The kernel's nvfp4 scale path (kernels/moe_dequant.cuh, nvfp4_step_scale) on the host: for every
// non-NaN e4m3 block scale, the code's bf16 ((code << 4) | 0x6000) is |scale| x 2^74, and its
// product with every e2m1 code in the subnormal-bit form is exact (what HMUL2 computes).
TEST(ExpertLayout, Nvfp4ScaleCodeIsExactForEveryE4m3) {
  for (int bits = 0; bits < 256; ++bits) {
    if ((bits & 0x7F) == 0x7F) continue;  // NaN: refused at pack
    const uint8_t code = nvfp4_scale_code(static_cast<uint8_t>(bits));
    const float mag = std::fabs(e4m3_bits_to_float(static_cast<uint8_t>(bits)));
    if (mag == 0.0f) {
      EXPECT_EQ(code, 0) << bits;
      continue;
    }
    ASSERT_EQ(nvfp4_scale_code_value(code), mag) << bits;
    const float s = bf16_bits_to_float(static_cast<uint16_t>((code << 4) | kNvFp4ScaleCodeBf16Or));
    ASSERT_EQ(s, std::ldexp(mag, kNvFp4ScaleCodeExp2)) << bits;
    for (int c = 0; c < 16; ++c) {
      // e2m1 code c with its magnitude on bf16 bits 6..8 and its sign on bit 15: c x 2^-126.
      const uint16_t cb = static_cast<uint16_t>(((c & 7) << 6) | ((c & 8) << 12));
      const float prod = bf16_bits_to_float(cb) * s;  // exact in fp32 ...
      ASSERT_EQ(bf16_bits_to_float(float_to_bf16_bits(prod)), prod) << bits << " " << c;  // ... and in bf16
      ASSERT_EQ(prod, std::ldexp(e2m1_bits_to_float(static_cast<uint8_t>(c)) * mag, kNvFp4ScaleCodeExp2 - 126));
    }
  }
}

// The kernel's nvfp4 register formation (rotations, masks, scale pairs; dequant_step) emulated on the
// host over a packed matrix: every value equals unpack_to_float's, i.e. the checkpoint's.
float rotl_pair_product(uint32_t word, int j, uint32_t scale_pair, int hi) {
  auto rotl = [](uint32_t w, int r) { return r == 0 ? w : (w << r) | (w >> (32 - r)); };
  uint32_t c = 0;
  switch (j) {
    case 0: c = word & 0x81C081C0u; break;
    case 1: c = rotl(word, 4) & 0x81C081C0u; break;
    case 2: c = rotl(word, 10) & 0x81C081C0u; break;
    default: c = (rotl(word, 6) & 0x80C080C0u) | (rotl(word, 14) & 0x01000100u); break;
  }
  const int row_half = j & 1;  // registers 0, 2: row g (low scale half); 1, 3: row g + 8
  const float s = bf16_bits_to_float(static_cast<uint16_t>(scale_pair >> (16 * row_half)));
  return bf16_bits_to_float(static_cast<uint16_t>(c >> (16 * hi))) * s;
}

void expect_kernel_emulation_matches(const PackedMatrix& p) {
  std::vector<float> want(static_cast<size_t>(p.rows_padded * p.cols_padded));
  unpack_to_float(p, want.data());
  for (int64_t tile = 0; tile < p.row_tiles(); ++tile)
    for (int64_t c = 0; c < p.chunks(); ++c)
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane >> 2, t = lane & 3;
        uint32_t words[4], sc[2];
        std::memcpy(words, p.weight.data() + ((tile * p.chunks() + c) * 32 + lane) * 16, 16);
        std::memcpy(sc, p.scales.data() + (tile * p.chunks() + c) * 64 + g * 8, 8);
        for (int s = 0; s < 4; ++s) {
          const uint32_t w = sc[s >> 1];
          const uint32_t pair = (((s & 1) ? (w >> 4) : (w << 4)) & 0x0FF00FF0u) | 0x60006000u;
          for (int j = 0; j < 4; ++j)
            for (int hi = 0; hi < 2; ++hi) {
              const int64_t row = tile * 16 + g + (j & 1) * 8;
              const int64_t k = c * 64 + s * 16 + 2 * t + hi + (j >> 1) * 8;
              const float v = rotl_pair_product(words[s], j, pair, hi) *
                              std::ldexp(p.global_scale[(j & 1)], 126 - kNvFp4ScaleCodeExp2);
              ASSERT_EQ(v, want[static_cast<size_t>(row * p.cols_padded + k)]) << "row " << row << " k " << k;
            }
        }
      }
}

TEST(ExpertLayout, Nvfp4KernelEmulationMatchesWithEdgeScales) {
  QuantMatrix m = random_matrix(WeightFormat::kNvFp4, 24, 96, 16, 31);
  // Edge block scales the quantizer does not produce: +-0, negative, e4m3 subnormals, the largest.
  const uint8_t edge[] = {0x00, 0x80, 0xB8, 0xC3, 0x01, 0x03, 0x05, 0x07, 0x87, 0x7E, 0xFE};
  std::vector<uint8_t> scales(m.scales.begin(), m.scales.end());
  for (size_t i = 0; i < scales.size(); i += 3) scales[i] = edge[(i / 3) % std::size(edge)];
  m.scales = scales;
  std::vector<float> ref(static_cast<size_t>(24 * 96));
  dequantize_rows(m, 0, 24, ref.data());
  auto p = pack_matrix(m);
  ASSERT_TRUE(p.ok()) << p.error().what();
  std::vector<float> got(static_cast<size_t>(p->rows_padded * p->cols_padded));
  unpack_to_float(*p, got.data());
  for (int64_t r = 0; r < 24; ++r)
    for (int64_t k = 0; k < 96; ++k) {
      const float a = got[static_cast<size_t>(r * p->cols_padded + k)], b = ref[static_cast<size_t>(r * 96 + k)];
      ASSERT_EQ(a, b) << "row " << r << " k " << k;
      ASSERT_EQ(std::signbit(a), std::signbit(b)) << "row " << r << " k " << k;  // -0 stays -0
    }
  expect_kernel_emulation_matches(*p);
  QuantMatrix gate = random_matrix(WeightFormat::kNvFp4, 13, 64, 16, 32), up = random_matrix(WeightFormat::kNvFp4, 13, 64, 16, 33);
  auto gu = pack_gate_up(gate, up);
  ASSERT_TRUE(gu.ok());
  expect_kernel_emulation_matches(*gu);
}

// validate() finds a NaN block scale at every position (the scan takes 8 bytes at a time: word
// starts, middles and the tail past the last whole word), and lets 0x7E / 0xFE (448) through.
TEST(ExpertLayout, Nvfp4ValidateFindsANanScaleAtEveryPosition) {
  QuantMatrix m = random_matrix(WeightFormat::kNvFp4, 3, 112, 16, 43);  // 21 scales: 2 words + 5
  const std::vector<uint8_t> orig(m.scales.begin(), m.scales.end());
  for (size_t i = 0; i < orig.size(); ++i) {
    for (uint8_t v : {uint8_t{0x7F}, uint8_t{0xFF}}) {
      std::vector<uint8_t> scales = orig;
      scales[i] = v;
      m.scales = scales;
      const Status st = m.validate();
      ASSERT_FALSE(st.ok()) << i;
      EXPECT_THAT(st.error().what(), ::testing::HasSubstr(fmt::format("block scale [{}, {}] is NaN", i / 7, i % 7)));
    }
    std::vector<uint8_t> scales = orig;
    scales[i] = i % 2 ? 0x7E : 0xFE;
    m.scales = scales;
    EXPECT_TRUE(m.validate().ok()) << i;
  }
}

TEST(ExpertLayout, Nvfp4RefusesNanBlockScales) {
  QuantMatrix m = random_matrix(WeightFormat::kNvFp4, 16, 64, 16, 41);
  std::vector<uint8_t> scales(m.scales.begin(), m.scales.end());
  scales[9] = 0xFF;
  m.scales = scales;
  auto p = pack_matrix(m);
  ASSERT_FALSE(p.ok());
  EXPECT_THAT(p.error().what(), ::testing::HasSubstr("NaN"));
  EXPECT_THAT(p.error().what(), ::testing::HasSubstr("block scale [2, 1]"));
}

}  // namespace
}  // namespace moebius::moe
