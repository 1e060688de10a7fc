// The small ops of the CUDA model runner against their CPU references, on random inputs with
// fixed seeds: the embedding gather and the row gather (src/kernels/gather.cu, reference
// cpu::gather_rows_reference), SwiGLU (src/kernels/swiglu.cu, cpu::swiglu_reference) and the
// cuBLAS dense GEMM wrapper (src/runtime/dense_gemm.cpp, cpu::linear_reference). Outputs are
// poisoned (0xFF: NaN), rows past the live ones must keep their poison, guard bands must hold.
//
// Tolerances:
//   gathers: exact (a copy; bf16 -> fp32 is exact).
//   SwiGLU: fp32 math then one bf16 rounding; expf vs std::exp differ by an ulp or two of fp32,
//     so |got - bf16(want)| <= 2^-7 |want| + 1e-6 (one bf16 ulp).
//   GEMM: bf16 inputs are exact in fp32; cuBLAS accumulates in fp32 (tensor cores, in its own
//     order), the reference in double: |err| <= 1e-4 * sum_k |x w| (K <= 4096 here: a few fp32
//     ulps per term at worst) plus one bf16 ulp of the result for bf16 out; nmse <= 1e-8 (fp32
//     out) or 1e-5 (bf16 out).
//
// Shapes: Qwen3-30B-A3B H=2048, qkv 5120, o 4096 -> 2048, V=151936 (lm_head rows are cut to 4096
// here to keep the reference fast), dense I=6144; the tiny fixture H=64, qkv 128, I=128.
#include "gpu/gpu_test_util.h"  // first: it makes fmt compile under nvcc

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "cpu/gather.h"
#include "cpu/linear.h"
#include "cpu/swiglu.h"
#include "kernels/gather.cuh"
#include "kernels/swiglu.cuh"
#include "runtime/dense_gemm.h"

namespace moebius {
namespace {

using testing::all_close;
using testing::bytes_are;
using testing::CudaStream;
using testing::DeviceBuffer;

constexpr uint8_t kPoison = 0xFF;

std::vector<float> random_bf16_values(size_t n, float lo, float hi, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(bf16(u(rng)));
  return v;
}

std::vector<uint16_t> bits_of(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = float_to_bf16_bits(v[i]);
  return out;
}

std::vector<float> floats_of(const std::vector<__nv_bfloat16>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __bfloat162float(v[i]);
  return out;
}

// ------------------------------------------------------------------------------------------------
// Gathers
// ------------------------------------------------------------------------------------------------

void check_embedding(int64_t V, int H, int T, uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "V=" << V << " H=" << H << " T=" << T);
  constexpr int kSlack = 2;
  const std::vector<float> table = random_bf16_values(static_cast<size_t>(V * H), -2.0f, 2.0f, seed);
  std::mt19937 rng(seed + 1);
  std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(V - 1));
  std::vector<int32_t> ids(static_cast<size_t>(T));
  for (auto& x : ids) x = id(rng);
  if (T > 2) {
    ids[1] = -1;                           // padding rows: zeros
    ids[2] = static_cast<int32_t>(V);      // out of range: zeros too
  }
  ids[0] = static_cast<int32_t>(V - 1);    // the last row of the table
  CudaStream stream;
  DeviceBuffer<uint16_t> d_table(table.size());
  DeviceBuffer<int32_t> d_ids(ids.size());
  DeviceBuffer<float> d_out(static_cast<size_t>(T + kSlack) * H);
  d_table.upload(bits_of(table));
  d_ids.upload(ids);
  d_out.poison(kPoison, stream);
  kernels::launch_embedding(reinterpret_cast<const __nv_bfloat16*>(d_table.data()), V, d_ids.data(), T, H,
                            d_out.data(), stream);
  stream.sync();
  std::vector<float> want(static_cast<size_t>(T) * H);
  cpu::gather_rows_reference(table.data(), V, H, ids.data(), T, want.data());
  const std::vector<float> got = d_out.download();
  EXPECT_TRUE(testing::same_values(got.data(), want.data(), want.size()));
  EXPECT_TRUE(bytes_are(got.data() + want.size(), got.size() - want.size(), kPoison)) << "rows past T";
  EXPECT_TRUE(d_out.guards_intact());
}

TEST(EmbeddingGpu, MatchesTheReference) {
  MOEBIUS_REQUIRE_GPU();
  check_embedding(512, 64, 20, 1);     // the tiny fixture
  check_embedding(4096, 2048, 7, 2);   // Qwen3-30B-A3B H (vocab cut)
  check_embedding(1000, 4096, 1, 3);   // Qwen3-235B-A22B H, one decode row
  check_embedding(300, 2048, 300, 4);  // a prefill of 300 rows
}

void check_gather_rows(int rows, int H, int64_t stride, int S, uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "rows=" << rows << " H=" << H << " stride=" << stride << " S=" << S);
  constexpr int kSlack = 2;
  const std::vector<float> src = random_bf16_values(static_cast<size_t>(rows * stride), -4.0f, 4.0f, seed);
  std::mt19937 rng(seed + 1);
  std::uniform_int_distribution<int32_t> r(0, rows - 1);
  std::vector<int32_t> idx(static_cast<size_t>(S));
  for (auto& x : idx) x = r(rng);
  idx[0] = rows - 1;
  if (S > 1) idx[S - 1] = -1;  // a padding row of a graph bucket
  CudaStream stream;
  DeviceBuffer<uint16_t> d_src(src.size());
  DeviceBuffer<int32_t> d_idx(idx.size());
  DeviceBuffer<uint16_t> d_out(static_cast<size_t>(S + kSlack) * H);
  d_src.upload(bits_of(src));
  d_idx.upload(idx);
  d_out.poison(kPoison, stream);
  kernels::launch_gather_rows(reinterpret_cast<const __nv_bfloat16*>(d_src.data()), stride, d_idx.data(), S, H,
                              reinterpret_cast<__nv_bfloat16*>(d_out.data()), stream);
  stream.sync();
  // Reference over the [rows, stride] source, then the first H columns of each row.
  std::vector<float> full(static_cast<size_t>(S) * stride), want(static_cast<size_t>(S) * H);
  cpu::gather_rows_reference(src.data(), rows, stride, idx.data(), S, full.data());
  for (int s = 0; s < S; ++s)
    for (int c = 0; c < H; ++c) want[static_cast<size_t>(s) * H + c] = full[static_cast<size_t>(s) * stride + c];
  const std::vector<uint16_t> raw = d_out.download();
  std::vector<float> got(want.size());
  for (size_t i = 0; i < got.size(); ++i) got[i] = bf16_bits_to_float(raw[i]);
  EXPECT_TRUE(testing::same_values(got.data(), want.data(), want.size()));
  EXPECT_TRUE(bytes_are(raw.data() + want.size(), raw.size() - want.size(), kPoison)) << "rows past S";
  EXPECT_TRUE(d_out.guards_intact());
}

TEST(GatherRowsGpu, MatchesTheReference) {
  MOEBIUS_REQUIRE_GPU();
  check_gather_rows(20, 64, 64, 1, 1);        // tiny fixture, last token of one sequence
  check_gather_rows(20, 64, 64, 20, 2);       // every row (all-logits prefill)
  check_gather_rows(1024, 2048, 2048, 8, 3);  // Qwen3-30B-A3B, 8 sequences
  check_gather_rows(64, 2048, 5120, 5, 4);    // strided source (a slice of a wider buffer)
}

// ------------------------------------------------------------------------------------------------
// SwiGLU
// ------------------------------------------------------------------------------------------------

void check_swiglu(int T, int I, uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "T=" << T << " I=" << I);
  constexpr int kSlack = 2;
  const std::vector<float> gu = random_bf16_values(static_cast<size_t>(T) * 2 * I, -6.0f, 6.0f, seed);
  CudaStream stream;
  DeviceBuffer<uint16_t> d_gu(gu.size());
  DeviceBuffer<__nv_bfloat16> d_out(static_cast<size_t>(T + kSlack) * I);
  d_gu.upload(bits_of(gu));
  d_out.poison(kPoison, stream);
  kernels::launch_swiglu(reinterpret_cast<const __nv_bfloat16*>(d_gu.data()), T, I, d_out.data(), stream);
  stream.sync();
  std::vector<float> want(static_cast<size_t>(T) * I);
  cpu::swiglu_reference(gu.data(), 2 * I, gu.data() + I, 2 * I, T, I, want.data());
  for (float& v : want) v = static_cast<float>(bf16(v));
  const std::vector<__nv_bfloat16> raw = d_out.download();
  const std::vector<float> got = floats_of(raw);
  EXPECT_TRUE(all_close(got.data(), want.data(), want.size(), 1.0 / 128, 1e-6));
  EXPECT_LE(testing::nmse(got.data(), want.data(), want.size()), 1e-5);
  EXPECT_TRUE(bytes_are(raw.data() + want.size(), raw.size() - want.size(), kPoison)) << "rows past T";
  EXPECT_TRUE(d_out.guards_intact());
}

TEST(SwigluGpu, MatchesTheReference) {
  MOEBIUS_REQUIRE_GPU();
  check_swiglu(1, 128, 1);     // tiny fixture dense layer, decode
  check_swiglu(20, 128, 2);    // tiny fixture prefill
  check_swiglu(1, 6144, 3);    // Qwen3-30B-A3B dense I (its config's intermediate_size)
  check_swiglu(333, 6144, 4);  // a prefill chunk
  check_swiglu(3, 8, 5);       // the smallest I
}

// ------------------------------------------------------------------------------------------------
// cuBLAS dense GEMM
// ------------------------------------------------------------------------------------------------

void check_gemm(int M, int N, int K, int64_t ldx, bool fp32_out, uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "M=" << M << " N=" << N << " K=" << K << " ldx=" << ldx
                                    << (fp32_out ? " fp32" : " bf16"));
  constexpr int kSlack = 2;
  const std::vector<float> x = random_bf16_values(static_cast<size_t>(M) * ldx, -2.0f, 2.0f, seed);
  const std::vector<float> w = random_bf16_values(static_cast<size_t>(N) * K, -0.1f, 0.1f, seed + 1);
  auto gemm = runtime::DenseGemm::create();
  ASSERT_TRUE(gemm.ok()) << gemm.error().what();
  CudaStream stream;
  DeviceBuffer<uint16_t> d_x(x.size()), d_w(w.size());
  d_x.upload(bits_of(x));
  d_w.upload(bits_of(w));
  const size_t n = static_cast<size_t>(M) * N, cap = static_cast<size_t>(M + kSlack) * N;
  // Reference on the dense [M, K] slice of x; bound per entry from sum |x w|.
  std::vector<float> xs(static_cast<size_t>(M) * K), want(n), mag(n);
  for (int m = 0; m < M; ++m)
    for (int k = 0; k < K; ++k) xs[static_cast<size_t>(m) * K + k] = x[static_cast<size_t>(m * ldx + k)];
  cpu::linear_reference(xs.data(), w.data(), M, N, K, want.data());
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < N; ++j) {
      double s = 0;
      for (int k = 0; k < K; ++k) s += std::fabs(xs[static_cast<size_t>(m) * K + k] * w[static_cast<size_t>(j) * K + k]);
      mag[static_cast<size_t>(m) * N + j] = static_cast<float>(s);
    }
  std::vector<float> got(n);
  std::vector<uint8_t> tail;
  if (fp32_out) {
    DeviceBuffer<float> d_y(cap);
    d_y.poison(kPoison, stream);
    (*gemm)->linear(reinterpret_cast<const __nv_bfloat16*>(d_x.data()), ldx,
                    reinterpret_cast<const __nv_bfloat16*>(d_w.data()), M, N, K, d_y.data(), N, stream);
    stream.sync();
    const std::vector<float> raw = d_y.download();
    std::copy_n(raw.begin(), n, got.begin());
    EXPECT_TRUE(bytes_are(raw.data() + n, cap - n, kPoison)) << "rows past M";
    EXPECT_TRUE(d_y.guards_intact());
  } else {
    DeviceBuffer<__nv_bfloat16> d_y(cap);
    d_y.poison(kPoison, stream);
    (*gemm)->linear(reinterpret_cast<const __nv_bfloat16*>(d_x.data()), ldx,
                    reinterpret_cast<const __nv_bfloat16*>(d_w.data()), M, N, K, d_y.data(), N, stream);
    stream.sync();
    const std::vector<__nv_bfloat16> raw = d_y.download();
    for (size_t i = 0; i < n; ++i) got[i] = __bfloat162float(raw[i]);
    EXPECT_TRUE(bytes_are(raw.data() + n, cap - n, kPoison)) << "rows past M";
    EXPECT_TRUE(d_y.guards_intact());
  }
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < n; ++i) {
    const double tol = 1e-4 * mag[i] + (fp32_out ? 0.0 : std::fabs(want[i]) / 128.0) + 1e-6;
    if (!(std::fabs(got[i] - want[i]) <= tol) && bad++ == 0) first = i;
  }
  EXPECT_EQ(bad, 0u) << "first at " << first << ": got " << got[first] << " want " << want[first];
  EXPECT_LE(testing::nmse(got.data(), want.data(), n), fp32_out ? 1e-8 : 1e-5);
}

TEST(DenseGemmGpu, MatchesTheReference) {
  MOEBIUS_REQUIRE_GPU();
  check_gemm(1, 128, 64, 64, false, 1);        // tiny fixture qkv, decode
  check_gemm(20, 512, 64, 64, true, 2);        // tiny fixture lm_head, fp32 logits
  check_gemm(1, 5120, 2048, 2048, false, 3);   // Qwen3-30B-A3B qkv, decode
  check_gemm(37, 2048, 4096, 4096, false, 4);  // Qwen3-30B-A3B o_proj, a prefill chunk
  check_gemm(3, 4096, 2048, 2048, true, 5);    // lm_head rows (vocab cut), fp32 out
  check_gemm(5, 96, 64, 128, false, 6);        // a strided input (ldx > K)
}

TEST(DenseGemmGpu, CapturesIntoAGraph) {
  // The runner captures its GEMMs into decode graphs: capture, replay on new inputs, same result
  // as an eager call.
  MOEBIUS_REQUIRE_GPU();
  const int M = 1, N = 256, K = 512;
  auto gemm = runtime::DenseGemm::create();
  ASSERT_TRUE(gemm.ok());
  CudaStream stream;
  DeviceBuffer<uint16_t> d_x(static_cast<size_t>(M) * K), d_w(static_cast<size_t>(N) * K);
  DeviceBuffer<float> d_eager(static_cast<size_t>(M) * N), d_graph(static_cast<size_t>(M) * N);
  d_w.upload(bits_of(random_bf16_values(static_cast<size_t>(N) * K, -0.1f, 0.1f, 7)));
  auto* x = reinterpret_cast<const __nv_bfloat16*>(d_x.data());
  auto* w = reinterpret_cast<const __nv_bfloat16*>(d_w.data());
  (*gemm)->linear(x, K, w, M, N, K, d_eager.data(), N, stream);  // warm up outside the capture
  stream.sync();
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  (*gemm)->linear(x, K, w, M, N, K, d_graph.data(), N, stream);
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (uint32_t seed : {11u, 12u}) {
    d_x.upload(bits_of(random_bf16_values(static_cast<size_t>(M) * K, -2.0f, 2.0f, seed)));
    d_graph.poison(kPoison, stream);
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    (*gemm)->linear(x, K, w, M, N, K, d_eager.data(), N, stream);
    stream.sync();
    const auto a = d_eager.download(), b = d_graph.download();
    EXPECT_TRUE(testing::same_values(b.data(), a.data(), a.size())) << "seed " << seed;
  }
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
}

}  // namespace
}  // namespace moebius
