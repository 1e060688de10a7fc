// The dense skinny GEMM (src/kernels/dense_gemv.cu) against the CPU reference
// cpu::linear_reference, on fresh random bf16 inputs with fixed seeds, for every M from 1 to 16,
// and runtime::DenseGemm's dispatch (GEMV for M <= 16, cuBLAS above) for batches 1..64.
// Outputs are poisoned (0xFF: NaN), entries past N in a row (ldy > N) and rows past M must keep
// their poison, guard bands must hold.
//
// Tolerance (as for the cuBLAS wrapper in test_model_ops.cu): bf16 inputs are exact in fp32; the
// kernel accumulates in fp32 (mma, 8 warps' partial sums added in a fixed order), the reference in
// double: |err| <= 1e-4 * sum_k |x w| plus one bf16 ulp of the result for bf16 out; nmse <= 1e-8
// (fp32 out) or 1e-5 (bf16 out).
//
// Shapes: Qwen3-30B-A3B H=2048, qkv 2048 -> 5120, o 4096 -> 2048, lm_head 2048 -> 151936 (full
// vocab: 9496 row tiles, ~36 per block of the persistent grid); Qwen3-235B-A22B o 8192 -> 4096;
// the tiny fixture H=64, qkv 128, V=512; odd N (1, 15, 17, 4097) and K (8, 24, 40, 264, 2056:
// partial 32-wide columns and warps with nothing to do).
#include "gpu/gpu_test_util.h"  // first: it makes fmt compile under nvcc

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "cpu/linear.h"
#include "cpu/norm.h"
#include "kernels/dense_gemv.cuh"
#include "kernels/moe_combine.cuh"
#include "kernels/norm.cuh"
#include "runtime/dense_gemm.h"

namespace moebius {
namespace {

using testing::bytes_are;
using testing::CudaStream;
using testing::DeviceBuffer;

constexpr uint8_t kPoison = 0xFF;

// bf16 values (as floats and as bits) uniform in [lo, hi); splitmix64, fast enough for the 311 M
// entries of the full lm_head.
struct HostBf16 {
  std::vector<float> f;
  std::vector<uint16_t> bits;
};
HostBf16 random_bf16(size_t n, float lo, float hi, uint64_t seed) {
  HostBf16 r;
  r.f.resize(n);
  r.bits.resize(n);
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < n; ++i) {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);
    r.bits[i] = float_to_bf16_bits(lo + (hi - lo) * u);
    r.f[i] = bf16_bits_to_float(r.bits[i]);
  }
  return r;
}

std::vector<float> abs_of(const std::vector<float>& v) {
  std::vector<float> a(v.size());
  for (size_t i = 0; i < v.size(); ++i) a[i] = std::fabs(v[i]);
  return a;
}

float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
float to_float(float v) { return v; }

// want[m, n] = x[m, :K] . w[n, :] and the bound's scale mag[m, n] = |x| . |w|, both [M, N].
struct Reference {
  std::vector<float> want, mag;
};
Reference reference(const std::vector<float>& x, int64_t ldx, const std::vector<float>& w, int M, int N, int K) {
  std::vector<float> xs(static_cast<size_t>(M) * K);
  for (int m = 0; m < M; ++m)
    for (int k = 0; k < K; ++k) xs[static_cast<size_t>(m) * K + k] = x[static_cast<size_t>(m * ldx + k)];
  Reference r;
  r.want.resize(static_cast<size_t>(M) * N);
  r.mag.resize(r.want.size());
  cpu::linear_reference(xs.data(), w.data(), M, N, K, r.want.data());
  cpu::linear_reference(abs_of(xs).data(), abs_of(w).data(), M, N, K, r.mag.data());
  return r;
}

// y [cap_rows, ldy] downloaded; rows < M, columns < N checked against the reference; the rest must
// be poison.
template <typename OutT>
void expect_output(const std::vector<OutT>& raw, int M, int N, int64_t ldy, const Reference& ref) {
  const bool bf16_out = sizeof(OutT) == 2;
  std::vector<float> got(static_cast<size_t>(M) * N);
  size_t bad = 0, first = 0;
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      const size_t i = static_cast<size_t>(m) * N + n;
      got[i] = to_float(raw[static_cast<size_t>(m * ldy + n)]);
      const double tol = 1e-4 * ref.mag[i] + (bf16_out ? std::fabs(ref.want[i]) / 128.0 : 0.0) + 1e-6;
      if (!(std::fabs(got[i] - ref.want[i]) <= tol) && bad++ == 0) first = i;
    }
  EXPECT_EQ(bad, 0u) << "first at [" << first / N << ", " << first % N << "]: got " << got[first] << " want "
                     << ref.want[first];
  EXPECT_LE(testing::nmse(got.data(), ref.want.data(), got.size()), bf16_out ? 1e-5 : 1e-8);
  for (int m = 0; m < M && ldy > N; ++m)
    EXPECT_TRUE(bytes_are(raw.data() + m * ldy + N, static_cast<size_t>(ldy - N), kPoison)) << "row " << m << " past N";
  const size_t live = static_cast<size_t>(M) * ldy;
  EXPECT_TRUE(bytes_are(raw.data() + live, raw.size() - live, kPoison)) << "rows past M";
}

// One launch of the kernel on (M, N, K, ldx, ldy) with W given (so large weights are made once).
template <typename OutT>
void check_gemv(int M, int N, int K, int64_t ldx, int64_t ldy, const HostBf16& w, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "M=" << M << " N=" << N << " K=" << K << " ldx=" << ldx << " ldy=" << ldy
                                    << (sizeof(OutT) == 2 ? " bf16" : " fp32"));
  ASSERT_EQ(w.f.size(), static_cast<size_t>(N) * K);
  ASSERT_TRUE(kernels::dense_gemv_supports(M, K));
  constexpr int kSlack = 2;
  const HostBf16 x = random_bf16(static_cast<size_t>(M) * ldx, -2.0f, 2.0f, seed);
  CudaStream stream;
  DeviceBuffer<uint16_t> d_x(x.bits.size()), d_w(w.bits.size());
  d_x.upload(x.bits);
  d_w.upload(w.bits);
  DeviceBuffer<OutT> d_y(static_cast<size_t>(M + kSlack) * ldy);
  d_y.poison(kPoison, stream);
  kernels::launch_dense_gemv<OutT>(reinterpret_cast<const __nv_bfloat16*>(d_x.data()), ldx,
                                   reinterpret_cast<const __nv_bfloat16*>(d_w.data()), M, N, K, d_y.data(), ldy,
                                   stream);
  stream.sync();
  const std::vector<OutT> raw = d_y.download();
  expect_output(raw, M, N, ldy, reference(x.f, ldx, w.f, M, N, K));
  EXPECT_TRUE(d_y.guards_intact() && d_x.guards_intact());

  // Run-to-run: the same inputs give the same bits (fixed reduction order, no atomics).
  d_y.poison(kPoison, stream);
  kernels::launch_dense_gemv<OutT>(reinterpret_cast<const __nv_bfloat16*>(d_x.data()), ldx,
                                   reinterpret_cast<const __nv_bfloat16*>(d_w.data()), M, N, K, d_y.data(), ldy,
                                   stream);
  stream.sync();
  const std::vector<OutT> again = d_y.download();
  EXPECT_EQ(std::memcmp(again.data(), raw.data(), raw.size() * sizeof(OutT)), 0) << "rerun differs";
}

template <typename OutT>
void check_gemv(int M, int N, int K, int64_t ldx, int64_t ldy, uint64_t seed) {
  const HostBf16 w = random_bf16(static_cast<size_t>(N) * K, -0.1f, 0.1f, seed + 1000);
  check_gemv<OutT>(M, N, K, ldx, ldy, w, seed);
}

TEST(DenseGemvGpu, Qwen3ProjectionsEveryM) {
  MOEBIUS_REQUIRE_GPU();
  // Qwen3-30B-A3B qkv (2048 -> 5120: 320 tiles, more than one per block on the persistent grid),
  // every M from 1 to 16 (n8 tile 1 for M <= 8, 2 above).
  const HostBf16 wqkv = random_bf16(size_t{5120} * 2048, -0.05f, 0.05f, 1);
  for (int M = 1; M <= 16; ++M) check_gemv<__nv_bfloat16>(M, 5120, 2048, 2048, 5120, wqkv, 100 + M);
  // o (4096 -> 2048: 128 tiles, 16 columns per warp).
  const HostBf16 wo = random_bf16(size_t{2048} * 4096, -0.05f, 0.05f, 2);
  for (int M : {1, 2, 4, 7, 8, 9, 15, 16}) check_gemv<__nv_bfloat16>(M, 2048, 4096, 4096, 2048, wo, 200 + M);
  // Qwen3-235B-A22B o (8192 -> 4096): the largest x staged, M <= 8.
  const HostBf16 wo235 = random_bf16(size_t{4096} * 8192, -0.05f, 0.05f, 3);
  for (int M : {1, 8}) check_gemv<__nv_bfloat16>(M, 4096, 8192, 8192, 4096, wo235, 300 + M);
}

TEST(DenseGemvGpu, LmHeadFullVocabFp32) {
  MOEBIUS_REQUIRE_GPU();
  // Qwen3-30B-A3B lm_head, fp32 logits: 151936 rows, 9496 tiles on the persistent grid.
  const HostBf16 w = random_bf16(size_t{151936} * 2048, -0.05f, 0.05f, 4);
  for (int M : {1, 3}) check_gemv<float>(M, 151936, 2048, 2048, 151936, w, 400 + M);
  // The tiny fixture's lm_head (H=64, V=512), every M.
  const HostBf16 tiny = random_bf16(size_t{512} * 64, -0.1f, 0.1f, 5);
  for (int M = 1; M <= 16; ++M) check_gemv<float>(M, 512, 64, 64, 512, tiny, 500 + M);
}

TEST(DenseGemvGpu, OddShapesStridesAndBothOutputs) {
  MOEBIUS_REQUIRE_GPU();
  uint64_t seed = 600;
  for (int N : {1, 15, 17, 100, 4097})
    for (int K : {8, 24, 40, 264, 2056})
      for (int M : {1, 3, 8, 9, 16}) {
        const int64_t ldx = K + (M % 2 == 1 ? 8 : 0), ldy = N + (M % 3 == 0 ? 5 : 0);
        if (N * K > 1 << 21 && M != 1 && M != 16) continue;  // keep the reference quick
        check_gemv<__nv_bfloat16>(M, N, K, ldx, ldy, ++seed);
        check_gemv<float>(M, N, K, ldx, ldy, ++seed);
      }
}

TEST(DenseGemvGpu, SupportsAndSharedMemoryLimits) {
  MOEBIUS_REQUIRE_GPU();
  EXPECT_TRUE(kernels::dense_gemv_supports(1, 8));
  EXPECT_TRUE(kernels::dense_gemv_supports(16, 4096));  // Qwen3-30B-A3B o at 16 tokens
  EXPECT_TRUE(kernels::dense_gemv_supports(8, 8192));   // Qwen3-235B-A22B o at 8 tokens
  EXPECT_FALSE(kernels::dense_gemv_supports(16, 8192)); // x alone is 256 KB: cuBLAS
  EXPECT_FALSE(kernels::dense_gemv_supports(0, 2048));
  EXPECT_FALSE(kernels::dense_gemv_supports(17, 2048));
  EXPECT_FALSE(kernels::dense_gemv_supports(1, 2044));  // rows of 16-byte chunks only
  EXPECT_LT(kernels::dense_gemv_smem_bytes(1, 2048), kernels::dense_gemv_smem_bytes(16, 2048));
}

// ------------------------------------------------------------------------------------------------
// [TAG_GEMV_RMS_NORM] The RMSNorm folded into the GEMV against the two kernels it replaces
// (launch_add_rms_norm<float, float> then launch_dense_gemv): y and the updated residual must be
// the same bits, resid untouched, and y within the GEMV tolerance of the CPU composition
// (rms_norm_reference on resid + delta, bf16-rounded, then linear_reference). Shapes: Qwen3-30B-A3B
// qkv (K = 2048: norm.cu's 256 threads, one chunk each), Qwen3-235B-A22B (K = 4096: two chunks),
// K = 12288 (norm.cu's loop kernel), the tiny fixture (K = 64: norm.cu runs one warp) and odd N/K;
// with and without delta (the first layer) and resid_out.
// ------------------------------------------------------------------------------------------------

// fp32 values uniform in [lo, hi) (full fp32 mantissas: the residual stream is fp32).
std::vector<float> random_f32(size_t n, float lo, float hi, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> out(n);
  for (auto& v : out) v = u(rng);
  return out;
}

// The CPU composition: h = bf16(RMSNorm(resid + delta) * weight), y = h . w^T (delta [M, K] as
// floats), against the kernel's y [M, N].
void expect_norm_gemv_near_cpu(const std::vector<float>& resid, const std::vector<float>& delta,
                               const std::vector<float>& weight, float eps, const std::vector<float>& w, int M, int N,
                               int K, const std::vector<__nv_bfloat16>& y) {
  const size_t mk = static_cast<size_t>(M) * K;
  std::vector<float> sum(mk), h(mk);
  for (size_t i = 0; i < mk; ++i) sum[i] = resid[i] + delta[i];
  cpu::rms_norm_reference(sum.data(), weight.data(), M, K, eps, h.data());
  for (auto& v : h) v = bf16_bits_to_float(float_to_bf16_bits(v));
  std::vector<__nv_bfloat16> y_poisoned(static_cast<size_t>(M + 2) * N);  // expect_output's layout: 2 rows of slack
  std::memset(y_poisoned.data(), kPoison, y_poisoned.size() * sizeof(y_poisoned[0]));
  std::memcpy(y_poisoned.data(), y.data(), y.size() * sizeof(y[0]));
  expect_output(y_poisoned, M, N, N, reference(h, K, w, M, N, K));
}

void check_gemv_rms_norm(int M, int N, int K, bool with_delta, bool with_out, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "M=" << M << " N=" << N << " K=" << K << (with_delta ? " delta" : "")
                                    << (with_out ? " resid_out" : ""));
  ASSERT_TRUE(kernels::dense_gemv_supports(M, K));
  constexpr float kEps = 1e-6f;
  const size_t mk = static_cast<size_t>(M) * K;
  const std::vector<float> resid = random_f32(mk, -3.0f, 3.0f, seed);
  const HostBf16 delta = random_bf16(mk, -1.0f, 1.0f, seed + 1);
  const std::vector<float> weight = random_f32(static_cast<size_t>(K), 0.5f, 1.5f, seed + 2);
  const HostBf16 w = random_bf16(static_cast<size_t>(N) * K, -0.05f, 0.05f, seed + 3);
  CudaStream stream;
  DeviceBuffer<float> d_resid(mk), d_resid_ref(mk), d_out(mk), d_weight(static_cast<size_t>(K));
  DeviceBuffer<uint16_t> d_delta(mk), d_w(w.bits.size()), d_h(mk);
  d_resid.upload(resid);
  d_resid_ref.upload(resid);
  d_delta.upload(delta.bits);
  d_weight.upload(weight);
  d_w.upload(w.bits);
  d_out.poison(kPoison, stream);
  DeviceBuffer<__nv_bfloat16> d_y(static_cast<size_t>(M) * N), d_y_ref(static_cast<size_t>(M) * N);
  d_y.poison(kPoison, stream);
  d_y_ref.poison(kPoison, stream);
  const auto* dw = reinterpret_cast<const __nv_bfloat16*>(d_w.data());
  const auto* dd = with_delta ? reinterpret_cast<const __nv_bfloat16*>(d_delta.data()) : nullptr;
  auto* dh = reinterpret_cast<__nv_bfloat16*>(d_h.data());
  // The two kernels it replaces (the norm updates d_resid_ref in place).
  kernels::launch_add_rms_norm<float, float>(d_resid_ref.data(), dd, d_weight.data(), M, K, kEps, dh, stream);
  kernels::launch_dense_gemv<__nv_bfloat16>(dh, K, dw, M, N, K, d_y_ref.data(), N, stream);
  kernels::launch_dense_gemv_rms_norm<__nv_bfloat16>({d_resid.data(), dd, d_weight.data(), kEps,
                                                      with_out ? d_out.data() : nullptr},
                                                     dw, M, N, K, d_y.data(), N, stream);
  stream.sync();
  const auto y = d_y.download(), y_ref = d_y_ref.download();
  EXPECT_EQ(std::memcmp(y.data(), y_ref.data(), y.size() * sizeof(y[0])), 0) << "y differs from norm + GEMV";
  const auto out = d_out.download(), resid_ref = d_resid_ref.download();
  if (with_out)
    EXPECT_EQ(std::memcmp(out.data(), resid_ref.data(), mk * sizeof(float)), 0) << "resid_out differs";
  else
    EXPECT_TRUE(bytes_are(out.data(), out.size(), kPoison)) << "resid_out written without being asked";
  const auto resid_after = d_resid.download();
  EXPECT_EQ(std::memcmp(resid_after.data(), resid.data(), mk * sizeof(float)), 0) << "resid was written";
  EXPECT_TRUE(d_y.guards_intact() && d_out.guards_intact() && d_resid.guards_intact());

  expect_norm_gemv_near_cpu(resid, with_delta ? delta.f : std::vector<float>(mk, 0.0f), weight, kEps, w.f, M, N, K,
                            y);
}

TEST(DenseGemvGpu, RmsNormFoldedMatchesNormThenGemvBitForBit) {
  MOEBIUS_REQUIRE_GPU();
  uint64_t seed = 900;
  for (int M : {1, 2, 4}) check_gemv_rms_norm(M, 5120, 2048, true, true, seed += 10);  // Qwen3-30B-A3B qkv
  check_gemv_rms_norm(1, 5120, 2048, false, false, seed += 10);                     // the first layer
  check_gemv_rms_norm(16, 300, 2048, true, true, seed += 10);                       // two n8 token tiles
  for (int M : {1, 3}) check_gemv_rms_norm(M, 1000, 4096, true, true, seed += 10);  // Qwen3-235B-A22B
  check_gemv_rms_norm(1, 129, 12288, true, true, seed += 10);                       // norm.cu's loop kernel
  for (int M : {1, 5, 16}) check_gemv_rms_norm(M, 128, 64, true, true, seed += 10);  // the tiny fixture
  for (int K : {8, 24, 264, 1032, 2056})
    for (int N : {1, 17}) check_gemv_rms_norm(2, N, K, true, K != 24, seed += 10);
}

// ------------------------------------------------------------------------------------------------
// [TAG_MOE_DEFERRED_COMBINE] The previous MoE layer's combine folded into the norm: against
// launch_moe_combine into a zeroed delta, then the folded norm with that delta, y and resid_out
// must be the same bits for every row (live rows: the combine's; rows past num_tokens: delta 0 on
// both sides), and y within the GEMV tolerance of the CPU composition (the combine in fp32, slot
// order, rounded to bf16). Expert outputs are N(0, 1)-ish fp32 with full mantissas and the routed
// weights positive, as a renormalised top-k gives. Shapes: Qwen3-30B-A3B (K = 2048, k = 8) at 1, 2
// and 4 rows, with padding rows; Qwen3-235B-A22B (K = 4096); the tiny fixture (K = 64, k = 4);
// odd k (1, 3) and a y row stride past K.
// ------------------------------------------------------------------------------------------------

void check_gemv_folded_combine(int M, int live, int capacity, int N, int K, int top_k, int y_stride, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "M=" << M << " live=" << live << " capacity=" << capacity << " N=" << N
                                    << " K=" << K << " k=" << top_k << " y_stride=" << y_stride);
  ASSERT_TRUE(kernels::dense_gemv_supports(M, K));
  ASSERT_LE(live, M);  // the combine stage below writes `live` rows of the M-row delta
  constexpr float kEps = 1e-6f;
  const size_t mk = static_cast<size_t>(M) * K, pairs = static_cast<size_t>(capacity) * top_k;
  const std::vector<float> resid = random_f32(mk, -3.0f, 3.0f, seed);
  const std::vector<float> y_exp = random_f32(pairs * static_cast<size_t>(y_stride), -2.0f, 2.0f, seed + 1);
  const std::vector<float> route_w = random_f32(pairs, 0.01f, 0.5f, seed + 2);
  const std::vector<float> weight = random_f32(static_cast<size_t>(K), 0.5f, 1.5f, seed + 3);
  const HostBf16 w = random_bf16(static_cast<size_t>(N) * K, -0.05f, 0.05f, seed + 4);
  CudaStream stream;
  DeviceBuffer<float> d_resid(mk), d_out(mk), d_out_ref(mk), d_weight(static_cast<size_t>(K));
  DeviceBuffer<float> d_yexp(y_exp.size()), d_route_w(pairs);
  DeviceBuffer<int32_t> d_live(1);
  DeviceBuffer<uint16_t> d_delta(mk), d_w(w.bits.size());
  d_resid.upload(resid);
  d_yexp.upload(y_exp);
  d_route_w.upload(route_w);
  d_live.upload(std::vector<int32_t>{live});
  d_weight.upload(weight);
  d_w.upload(w.bits);
  CUDA_CHECK(cudaMemsetAsync(d_delta.data(), 0, d_delta.bytes(), stream));
  d_out.poison(kPoison, stream);
  d_out_ref.poison(kPoison, stream);
  DeviceBuffer<__nv_bfloat16> d_y(static_cast<size_t>(M) * N), d_y_ref(static_cast<size_t>(M) * N);
  d_y.poison(kPoison, stream);
  d_y_ref.poison(kPoison, stream);
  const auto* dw = reinterpret_cast<const __nv_bfloat16*>(d_w.data());
  auto* dd = reinterpret_cast<__nv_bfloat16*>(d_delta.data());
  // The combine stage, then the norm with its output as delta.
  kernels::launch_moe_combine(d_yexp.data(), y_stride, d_route_w.data(), d_live.data(), capacity, top_k, K, dd, K,
                              stream);
  kernels::launch_dense_gemv_rms_norm<__nv_bfloat16>({d_resid.data(), dd, d_weight.data(), kEps, d_out_ref.data()},
                                                     dw, M, N, K, d_y_ref.data(), N, stream);
  // The fold.
  kernels::DenseGemvRmsNorm folded{d_resid.data(), nullptr, d_weight.data(), kEps, d_out.data()};
  folded.combine = {d_yexp.data(), y_stride, d_route_w.data(), top_k, d_live.data(), capacity};
  kernels::launch_dense_gemv_rms_norm<__nv_bfloat16>(folded, dw, M, N, K, d_y.data(), N, stream);
  stream.sync();
  const auto y = d_y.download(), y_ref = d_y_ref.download();
  EXPECT_EQ(std::memcmp(y.data(), y_ref.data(), y.size() * sizeof(y[0])), 0) << "y differs from combine + norm";
  const auto out = d_out.download(), out_ref = d_out_ref.download();
  EXPECT_EQ(std::memcmp(out.data(), out_ref.data(), mk * sizeof(float)), 0) << "resid_out differs";
  const auto resid_after = d_resid.download();
  EXPECT_EQ(std::memcmp(resid_after.data(), resid.data(), mk * sizeof(float)), 0) << "resid was written";
  EXPECT_TRUE(d_y.guards_intact() && d_out.guards_intact() && d_yexp.guards_intact() && d_route_w.guards_intact() &&
              d_delta.guards_intact());

  // CPU: delta[m] = bf16(sum_s w * y) in slot order for live rows, 0 past them.
  std::vector<float> delta(mk, 0.0f);
  for (int m = 0; m < std::min(M, live); ++m)
    for (int c = 0; c < K; ++c) {
      float acc = 0.0f;
      for (int j = 0; j < top_k; ++j) {
        const size_t pair = static_cast<size_t>(m) * top_k + j;
        acc = std::fmaf(route_w[pair], y_exp[pair * y_stride + c], acc);
      }
      delta[static_cast<size_t>(m) * K + c] = bf16_bits_to_float(float_to_bf16_bits(acc));
    }
  expect_norm_gemv_near_cpu(resid, delta, weight, kEps, w.f, M, N, K, y);
}

TEST(DenseGemvGpu, RmsNormFoldsTheMoeCombineBitForBit) {
  MOEBIUS_REQUIRE_GPU();
  uint64_t seed = 1500;
  for (int M : {1, 2, 4}) check_gemv_folded_combine(M, M, M, 5120, 2048, 8, 2048, seed += 10);  // Qwen3-30B-A3B qkv
  check_gemv_folded_combine(4, 2, 8, 5120, 2048, 8, 2048, seed += 10);  // a padded graph bucket: 2 live of 4
  check_gemv_folded_combine(2, 0, 2, 5120, 2048, 8, 2048, seed += 10);  // nothing live
  check_gemv_folded_combine(1, 1, 1, 1000, 4096, 8, 4096, seed += 10);  // Qwen3-235B-A22B
  for (int M : {1, 2}) check_gemv_folded_combine(M, M, 2, 128, 64, 4, 64, seed += 10);  // the tiny fixture
  for (int k : {1, 3}) check_gemv_folded_combine(3, 3, 5, 17, 1032, k, 1036, seed += 10);  // odd k, K, stride
  check_gemv_folded_combine(12, 10, 16, 300, 2048, 8, 2048, seed += 10);  // two n8 token tiles, 2 padding rows
  check_gemv_folded_combine(16, 16, 16, 64, 2048, 8, 2048, seed += 10);   // the option's largest step
}

// ------------------------------------------------------------------------------------------------
// Chains under programmatic dependent launch: each GEMV reads the previous kernel's output right
// after griddepcontrol.wait and overwrites the buffer the previous kernel read (ping-pong), with
// the add+RMSNorm in the middle. Eager and graph replays against a CPU chain that rounds to bf16
// at the same points. A read before the wait would see poison (NaN) or the stale buffer.
// ------------------------------------------------------------------------------------------------

TEST(DenseGemvGpu, ChainedLaunchesReadTheirPredecessorsOutput) {
  MOEBIUS_REQUIRE_GPU();
  constexpr int D = 1024, Q = 3072;  // square-ish layers of unit gain: weights U(-sqrt(3/K), sqrt(3/K))
  constexpr float kEps = 1e-6f;
  for (int M : {1, 5, 16}) {
    SCOPED_TRACE(::testing::Message() << "M=" << M);
    const HostBf16 w1 = random_bf16(size_t{Q} * D, -std::sqrt(3.0f / D), std::sqrt(3.0f / D), 10);  // D -> Q
    const HostBf16 w2 = random_bf16(size_t{D} * Q, -std::sqrt(3.0f / Q), std::sqrt(3.0f / Q), 11);  // Q -> D
    const HostBf16 x0 = random_bf16(static_cast<size_t>(M) * D, -1.0f, 1.0f, 12 + M);
    const HostBf16 res0 = random_bf16(static_cast<size_t>(M) * D, -1.0f, 1.0f, 20 + M);
    std::vector<float> norm_w(D);
    for (int i = 0; i < D; ++i) norm_w[i] = 0.75f + 0.5f * static_cast<float>(i % 7) / 7.0f;

    // CPU chain: a = bf16(w1 x0); b = bf16(w2 a); res += b; h = bf16(norm(res)); a = bf16(w1 h);
    // b = bf16(w2 a).
    auto lin = [](const std::vector<float>& in, const std::vector<float>& w, int m, int n, int k) {
      std::vector<float> out(static_cast<size_t>(m) * n);
      cpu::linear_reference(in.data(), w.data(), m, n, k, out.data());
      for (float& v : out) v = bf16_bits_to_float(float_to_bf16_bits(v));
      return out;
    };
    std::vector<float> a = lin(x0.f, w1.f, M, Q, D), b = lin(a, w2.f, M, D, Q);
    std::vector<float> res = res0.f;
    for (size_t i = 0; i < res.size(); ++i) res[i] += b[i];
    std::vector<float> h(res.size());
    cpu::rms_norm_reference(res.data(), norm_w.data(), M, D, kEps, h.data());
    for (float& v : h) v = bf16_bits_to_float(float_to_bf16_bits(v));
    a = lin(h, w1.f, M, Q, D);
    const std::vector<float> want = lin(a, w2.f, M, D, Q);

    CudaStream stream;
    DeviceBuffer<uint16_t> d_w1(w1.bits.size()), d_w2(w2.bits.size());
    d_w1.upload(w1.bits);
    d_w2.upload(w2.bits);
    DeviceBuffer<__nv_bfloat16> d_x(static_cast<size_t>(M) * Q), d_y(static_cast<size_t>(M) * Q);  // ping-pong, Q >= D
    DeviceBuffer<float> d_res(static_cast<size_t>(M) * D), d_nw(D);
    d_nw.upload(norm_w);
    const auto* W1 = reinterpret_cast<const __nv_bfloat16*>(d_w1.data());
    const auto* W2 = reinterpret_cast<const __nv_bfloat16*>(d_w2.data());
    auto chain = [&] {
      kernels::launch_dense_gemv(d_x.data(), D, W1, M, Q, D, d_y.data(), Q, stream);  // a -> y
      kernels::launch_dense_gemv(d_y.data(), Q, W2, M, D, Q, d_x.data(), D, stream);  // b -> x (a's input)
      kernels::launch_add_rms_norm<float, float>(d_res.data(), d_x.data(), d_nw.data(), M, D, kEps, d_y.data(),
                                                 stream);                               // h -> y
      kernels::launch_dense_gemv(d_y.data(), D, W1, M, Q, D, d_x.data(), Q, stream);  // a -> x
      kernels::launch_dense_gemv(d_x.data(), Q, W2, M, D, Q, d_y.data(), D, stream);  // out -> y
    };
    auto reset = [&] {
      d_x.poison(kPoison, stream);
      d_y.poison(kPoison, stream);
      CUDA_CHECK(cudaMemcpyAsync(d_x.data(), x0.bits.data(), x0.bits.size() * 2, cudaMemcpyHostToDevice, stream));
      CUDA_CHECK(cudaMemcpyAsync(d_res.data(), res0.f.data(), res0.f.size() * 4, cudaMemcpyHostToDevice, stream));
    };
    auto result = [&] {
      stream.sync();
      const std::vector<__nv_bfloat16> raw = d_y.download();
      std::vector<float> got(want.size());
      for (size_t i = 0; i < got.size(); ++i) got[i] = __bfloat162float(raw[i]);
      return got;
    };
    reset();
    chain();
    const std::vector<float> eager = result();
    // Rounding flips at the bf16 points make the two chains drift apart by a few bf16 ulps;
    // a race reads NaN poison or a stale buffer (nmse ~ 1).
    EXPECT_LE(testing::nmse(eager.data(), want.data(), want.size()), 1e-4);

    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    chain();
    CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int r = 0; r < 3; ++r) {
      reset();
      CUDA_CHECK(cudaGraphLaunch(exec, stream));
      const std::vector<float> replay = result();
      EXPECT_TRUE(testing::same_values(replay.data(), eager.data(), eager.size())) << "graph replay " << r;
    }
    CUDA_CHECK(cudaGraphExecDestroy(exec));
    CUDA_CHECK(cudaGraphDestroy(graph));
    EXPECT_TRUE(d_x.guards_intact() && d_y.guards_intact() && d_res.guards_intact());
  }
}

// ------------------------------------------------------------------------------------------------
// runtime::DenseGemm: the GEMV for small M, cuBLAS above, one result contract
// ------------------------------------------------------------------------------------------------

TEST(DenseGemvGpu, DenseGemmDispatchBatchesOneTo64) {
  MOEBIUS_REQUIRE_GPU();
  auto gemm = runtime::DenseGemm::create();
  ASSERT_TRUE(gemm.ok()) << gemm.error().what();
  constexpr int N = 1000, K = 1024, kSlack = 2;
  const HostBf16 w = random_bf16(size_t{N} * K, -0.1f, 0.1f, 30);
  DeviceBuffer<uint16_t> d_w(w.bits.size());
  d_w.upload(w.bits);
  const auto* W = reinterpret_cast<const __nv_bfloat16*>(d_w.data());
  CudaStream stream;
  // The default dispatch: the GEMV up to M = 4 and never for an lm_head-sized weight.
  EXPECT_EQ((*gemm)->gemv_max_m(), 4);
  EXPECT_FALSE((*gemm)->uses_gemv(W, K, W, 1, 151936, 2048));
  // Every M through both paths: the GEMV up to its largest M, cuBLAS above.
  (*gemm)->set_gemv_max_m(kernels::kDenseGemvMaxM);
  for (int M = 1; M <= 64; ++M) {
    SCOPED_TRACE(::testing::Message() << "M=" << M);
    const HostBf16 x = random_bf16(static_cast<size_t>(M) * K, -2.0f, 2.0f, 40 + M);
    DeviceBuffer<uint16_t> d_x(x.bits.size());
    d_x.upload(x.bits);
    const auto* X = reinterpret_cast<const __nv_bfloat16*>(d_x.data());
    EXPECT_EQ((*gemm)->uses_gemv(X, K, W, M, N, K), M <= kernels::kDenseGemvMaxM);
    const Reference ref = reference(x.f, K, w.f, M, N, K);
    DeviceBuffer<__nv_bfloat16> d_y(static_cast<size_t>(M + kSlack) * N);
    d_y.poison(kPoison, stream);
    (*gemm)->linear(X, K, W, M, N, K, d_y.data(), N, stream);
    stream.sync();
    expect_output(d_y.download(), M, N, N, ref);
    DeviceBuffer<float> d_yf(static_cast<size_t>(M + kSlack) * N);
    d_yf.poison(kPoison, stream);
    (*gemm)->linear(X, K, W, M, N, K, d_yf.data(), N, stream);
    stream.sync();
    expect_output(d_yf.download(), M, N, N, ref);
  }
  // gemv_max_m 0 sends M = 1 to cuBLAS; same contract.
  (*gemm)->set_gemv_max_m(0);
  const HostBf16 x = random_bf16(K, -2.0f, 2.0f, 99);
  DeviceBuffer<uint16_t> d_x(x.bits.size());
  d_x.upload(x.bits);
  const auto* X = reinterpret_cast<const __nv_bfloat16*>(d_x.data());
  EXPECT_FALSE((*gemm)->uses_gemv(X, K, W, 1, N, K));
  DeviceBuffer<float> d_y(size_t{1 + kSlack} * N);
  d_y.poison(kPoison, stream);
  (*gemm)->linear(X, K, W, 1, N, K, d_y.data(), N, stream);
  stream.sync();
  expect_output(d_y.download(), 1, N, N, reference(x.f, K, w.f, 1, N, K));
}

}  // namespace
}  // namespace moebius
