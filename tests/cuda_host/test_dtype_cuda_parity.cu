// Bit-exact parity of moebius's scalar conversions (src/core/dtype.cpp) with CUDA's own
// conversion headers. The CUDA functions used here are __host__ __device__, and their host
// implementation is the reference the device instructions are specified against, so this runs
// without a GPU (in CI). Covered per format:
//   - every representable value, its float neighbours, and the exact midpoints between
//     consecutive representable values (the round-to-nearest-even ties) and their neighbours;
//   - overflow, infinities, NaNs, signed zeros, float subnormals;
//   - a strided sweep over all 2^32 float bit patterns.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp4.h>
#include <cuda_fp8.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "core/dtype.h"

namespace moebius {
namespace {

uint16_t cuda_bf16(float x) {
  __nv_bfloat16 h = __float2bfloat16(x);
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}
uint16_t cuda_fp16(float x) {
  __half h = __float2half(x);
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}
uint8_t cuda_e4m3(float x, __nv_saturation_t sat) { return __nv_cvt_float_to_fp8(x, sat, __NV_E4M3); }
uint8_t cuda_e5m2(float x, __nv_saturation_t sat) { return __nv_cvt_float_to_fp8(x, sat, __NV_E5M2); }
uint8_t cuda_e2m1(float x) { return __nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest); }

float cuda_decode_e4m3(uint8_t b) { return __half2float(__half(__nv_cvt_fp8_to_halfraw(b, __NV_E4M3))); }
float cuda_decode_e5m2(uint8_t b) { return __half2float(__half(__nv_cvt_fp8_to_halfraw(b, __NV_E5M2))); }
float cuda_decode_e2m1(uint8_t b) { return __half2float(__half(__nv_cvt_fp4_to_halfraw(b, __NV_E2M1))); }

// Probe points around every finite value of a format: v, its float neighbours, the midpoints to
// the next value up and their neighbours, all with both signs.
std::vector<float> probes_around(const std::vector<float>& values) {
  std::vector<float> sorted;
  for (float v : values)
    if (std::isfinite(v) && v >= 0) sorted.push_back(v);
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  std::vector<float> out;
  auto add = [&out](float p) {
    for (float q : {p, std::nextafter(p, INFINITY), std::nextafter(p, -INFINITY)}) {
      out.push_back(q);
      out.push_back(-q);
    }
  };
  for (size_t i = 0; i < sorted.size(); ++i) {
    add(sorted[i]);
    if (i + 1 < sorted.size()) add(sorted[i] + (sorted[i + 1] - sorted[i]) / 2);  // exact in float
  }
  // Beyond the top: the first overflow tie, twice the max, and the specials.
  const float top = sorted.back();
  for (float p : {top * 1.0625f, top * 1.125f, top * 2, 1e30f, std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::min(), 0.0f})
    add(p);
  for (float p : {INFINITY, -INFINITY, std::numeric_limits<float>::quiet_NaN(),
                  -std::numeric_limits<float>::quiet_NaN(), std::bit_cast<float>(0x7F800001u),
                  std::bit_cast<float>(0xFFC00001u)})
    out.push_back(p);
  return out;
}

template <typename Ours, typename Theirs>
void expect_same_on(const std::vector<float>& xs, Ours ours, Theirs theirs, const char* what) {
  int failures = 0;
  for (float x : xs) {
    const uint32_t a = ours(x), b = theirs(x);
    if (a != b && failures++ < 10)
      ADD_FAILURE() << what << ": x=" << x << " (0x" << std::hex << std::bit_cast<uint32_t>(x)
                    << ") moebius=0x" << a << " cuda=0x" << b << std::dec;
  }
  EXPECT_EQ(failures, 0) << what;
}

template <typename Ours, typename Theirs>
void expect_same_sweep(Ours ours, Theirs theirs, const char* what) {
  // 2^32 / 257 ~ 16.7M patterns: every exponent and sign, scattered mantissas.
  std::vector<float> xs;
  xs.reserve(1 << 20);
  int failures = 0;
  for (uint64_t u = 0; u < (1ull << 32); u += 257) {
    const float x = std::bit_cast<float>(static_cast<uint32_t>(u));
    const uint32_t a = ours(x), b = theirs(x);
    if (a != b && failures++ < 10)
      ADD_FAILURE() << what << ": x=" << x << " (0x" << std::hex << u << ") moebius=0x" << a
                    << " cuda=0x" << b << std::dec;
  }
  EXPECT_EQ(failures, 0) << what;
}

std::vector<float> all_values_16(float (*decode)(uint16_t)) {
  std::vector<float> v;
  for (uint32_t b = 0; b < 65536; ++b) v.push_back(decode(static_cast<uint16_t>(b)));
  return v;
}

TEST(DTypeCudaParity, Bf16Encode) {
  auto xs = probes_around(all_values_16(bf16_bits_to_float));
  expect_same_on(xs, float_to_bf16_bits, cuda_bf16, "bf16 probes");
  expect_same_sweep(float_to_bf16_bits, cuda_bf16, "bf16 sweep");
}

TEST(DTypeCudaParity, Fp16Encode) {
  auto xs = probes_around(all_values_16(fp16_bits_to_float));
  expect_same_on(xs, float_to_fp16_bits, cuda_fp16, "fp16 probes");
  expect_same_sweep(float_to_fp16_bits, cuda_fp16, "fp16 sweep");
}

TEST(DTypeCudaParity, E4M3EncodeBothSaturationModes) {
  std::vector<float> vals;
  for (int b = 0; b < 256; ++b) vals.push_back(e4m3_bits_to_float(static_cast<uint8_t>(b)));
  auto xs = probes_around(vals);
  expect_same_on(xs, [](float x) { return float_to_e4m3_bits(x, Saturation::kSatFinite); },
                 [](float x) { return cuda_e4m3(x, __NV_SATFINITE); }, "e4m3 satfinite probes");
  expect_same_on(xs, [](float x) { return float_to_e4m3_bits(x, Saturation::kNoSat); },
                 [](float x) { return cuda_e4m3(x, __NV_NOSAT); }, "e4m3 nosat probes");
  expect_same_sweep([](float x) { return float_to_e4m3_bits(x, Saturation::kSatFinite); },
                    [](float x) { return cuda_e4m3(x, __NV_SATFINITE); }, "e4m3 satfinite sweep");
  expect_same_sweep([](float x) { return float_to_e4m3_bits(x, Saturation::kNoSat); },
                    [](float x) { return cuda_e4m3(x, __NV_NOSAT); }, "e4m3 nosat sweep");
}

TEST(DTypeCudaParity, E5M2EncodeBothSaturationModes) {
  std::vector<float> vals;
  for (int b = 0; b < 256; ++b) vals.push_back(e5m2_bits_to_float(static_cast<uint8_t>(b)));
  auto xs = probes_around(vals);
  expect_same_on(xs, [](float x) { return float_to_e5m2_bits(x, Saturation::kSatFinite); },
                 [](float x) { return cuda_e5m2(x, __NV_SATFINITE); }, "e5m2 satfinite probes");
  expect_same_on(xs, [](float x) { return float_to_e5m2_bits(x, Saturation::kNoSat); },
                 [](float x) { return cuda_e5m2(x, __NV_NOSAT); }, "e5m2 nosat probes");
}

TEST(DTypeCudaParity, E2M1Encode) {
  std::vector<float> vals;
  for (int b = 0; b < 16; ++b) vals.push_back(e2m1_bits_to_float(static_cast<uint8_t>(b)));
  auto xs = probes_around(vals);
  expect_same_on(xs, float_to_e2m1_bits, cuda_e2m1, "e2m1 probes");
  expect_same_sweep(float_to_e2m1_bits, cuda_e2m1, "e2m1 sweep");
}

TEST(DTypeCudaParity, DecodeEveryPattern) {
  for (int b = 0; b < 256; ++b) {
    const float ours = e4m3_bits_to_float(static_cast<uint8_t>(b)), theirs = cuda_decode_e4m3(static_cast<uint8_t>(b));
    if (std::isnan(theirs)) EXPECT_TRUE(std::isnan(ours)) << "e4m3 0x" << std::hex << b;
    else EXPECT_EQ(std::bit_cast<uint32_t>(ours), std::bit_cast<uint32_t>(theirs)) << "e4m3 0x" << std::hex << b;
    const float ours5 = e5m2_bits_to_float(static_cast<uint8_t>(b)), theirs5 = cuda_decode_e5m2(static_cast<uint8_t>(b));
    if (std::isnan(theirs5)) EXPECT_TRUE(std::isnan(ours5)) << "e5m2 0x" << std::hex << b;
    else EXPECT_EQ(std::bit_cast<uint32_t>(ours5), std::bit_cast<uint32_t>(theirs5)) << "e5m2 0x" << std::hex << b;
  }
  for (int b = 0; b < 16; ++b)
    EXPECT_EQ(std::bit_cast<uint32_t>(e2m1_bits_to_float(static_cast<uint8_t>(b))),
              std::bit_cast<uint32_t>(cuda_decode_e2m1(static_cast<uint8_t>(b))))
        << "e2m1 0x" << std::hex << b;
  for (uint32_t b = 0; b < 65536; ++b) {
    __half_raw hr;
    hr.x = static_cast<unsigned short>(b);
    const float theirs = __half2float(__half(hr));
    const float ours = fp16_bits_to_float(static_cast<uint16_t>(b));
    if (std::isnan(theirs)) EXPECT_TRUE(std::isnan(ours));
    else EXPECT_EQ(std::bit_cast<uint32_t>(ours), std::bit_cast<uint32_t>(theirs)) << "fp16 0x" << std::hex << b;
    __nv_bfloat16_raw br;
    br.x = static_cast<unsigned short>(b);
    const float theirs_b = __bfloat162float(__nv_bfloat16(br));
    const float ours_b = bf16_bits_to_float(static_cast<uint16_t>(b));
    EXPECT_EQ(std::bit_cast<uint32_t>(ours_b), std::bit_cast<uint32_t>(theirs_b)) << "bf16 0x" << std::hex << b;
  }
}

}  // namespace
}  // namespace moebius
