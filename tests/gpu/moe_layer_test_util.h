// Helpers shared by the MoE layer GPU tests (test_moe_layer.cu, test_moe_wgmma.cu): random layers
// and inputs, one poisoned forward of a MoeLayerCuda, and the double-precision oracle of the CPU
// reference (src/cpu/moe_layer.h) compared by normalised MSE. Include gpu/gpu_test_util.h first.
#pragma once

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "cpu/moe_layer.h"
#include "kernels/moe_gemm_wgmma.cuh"
#include "moe/moe_layer_cuda.h"

namespace moebius::moe::moe_test {

using ::moebius::testing::CudaStream;
using ::moebius::testing::DeviceBuffer;

struct Geometry {
  int64_t H, I;
  int E, k;
};

inline float round_bf16(float v) { return bf16_bits_to_float(float_to_bf16_bits(v)); }

inline cpu::MoeLayerReference make_layer(WeightFormat f, const Geometry& g, int group, uint64_t seed) {
  std::mt19937_64 rng(seed);
  cpu::MoeLayerReference L;
  L.shape = {g.H, g.I, g.E, g.k};
  L.router.num_experts = g.E;
  L.router.top_k = g.k;
  L.router_weight.resize(static_cast<size_t>(g.E * g.H));
  std::normal_distribution<float> rd(0.0f, 1.0f / std::sqrt(static_cast<float>(g.H)));
  for (auto& v : L.router_weight) v = round_bf16(rd(rng));  // the GPU router reads bf16
  auto mat = [&](int64_t rows, int64_t cols) {
    std::normal_distribution<float> d(0.0f, 1.0f / std::sqrt(static_cast<float>(cols)));
    std::vector<float> w(static_cast<size_t>(rows * cols));
    for (auto& v : w) v = d(rng);
    auto m = quantize(f, w.data(), rows, cols, f == WeightFormat::kNvFp4 ? 16 : group);
    EXPECT_TRUE(m.ok()) << m.error().what();
    return std::move(m).value();
  };
  for (int e = 0; e < g.E; ++e) L.experts.push_back({mat(g.I, g.H), mat(g.I, g.H), mat(g.H, g.I)});
  return L;
}

inline std::vector<uint16_t> random_x(int64_t T, int64_t H, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<uint16_t> x(static_cast<size_t>(T * H));
  for (auto& v : x) v = float_to_bf16_bits(d(rng));
  return x;
}

inline std::vector<float> to_float(const std::vector<uint16_t>& b) {
  std::vector<float> f(b.size());
  for (size_t i = 0; i < b.size(); ++i) f[i] = bf16_bits_to_float(b[i]);
  return f;
}

// Normalised MSE bound: the GPU output is bf16 (relative rounding 2^-9, NMSE ~ 1e-6) and its
// accumulation order differs from the double-precision oracle; h is bf16 on both sides.
inline constexpr double kNmseBound = 5e-5;

struct LayerRun {
  std::vector<uint16_t> out;    // [T, H] bf16
  std::vector<int32_t> ids;     // [T, k]
  std::vector<float> weights;   // [T, k]
};

// One forward (or forward_routed with ids_in/w_in) of T tokens into a poisoned output.
inline LayerRun run_gpu(MoeLayerCuda& layer, const std::vector<uint16_t>& x, int64_t T, const int32_t* ids_in = nullptr,
                        const float* w_in = nullptr) {
  const auto& s = layer.shape();
  const int cap = layer.capacity();
  CudaStream stream;
  DeviceBuffer<__nv_bfloat16> dx(static_cast<size_t>(cap) * s.hidden), dout(static_cast<size_t>(cap) * s.hidden);
  DeviceBuffer<int32_t> dn(1), dids(static_cast<size_t>(cap) * s.top_k);
  DeviceBuffer<float> dw(static_cast<size_t>(cap) * s.top_k);
  dx.upload(x);
  const int32_t n = static_cast<int32_t>(T);
  CUDA_CHECK(cudaMemcpy(dn.data(), &n, 4, cudaMemcpyHostToDevice));
  dout.poison(0xFF, stream);
  if (ids_in) {
    CUDA_CHECK(cudaMemcpy(dids.data(), ids_in, 4 * T * s.top_k, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(dw.data(), w_in, 4 * T * s.top_k, cudaMemcpyHostToDevice));
    layer.forward_routed(dx.data(), dn.data(), dids.data(), dw.data(), dout.data(), stream);
  } else {
    layer.forward(dx.data(), dn.data(), dout.data(), stream);
  }
  stream.sync();
  LayerRun r;
  r.out.resize(static_cast<size_t>(T * s.hidden));
  CUDA_CHECK(cudaMemcpy(r.out.data(), dout.data(), r.out.size() * 2, cudaMemcpyDeviceToHost));
  EXPECT_TRUE(dout.guards_intact());
  if (!ids_in) {
    r.ids.resize(static_cast<size_t>(T * s.top_k));
    r.weights.resize(r.ids.size());
    CUDA_CHECK(cudaMemcpy(r.ids.data(), layer.topk_ids(), 4 * r.ids.size(), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(r.weights.data(), layer.topk_weights(), 4 * r.ids.size(), cudaMemcpyDeviceToHost));
  }
  return r;
}

// The oracle's output on a given routing, [T, H] fp32.
inline std::vector<float> oracle_out(const cpu::MoeLayerReference& L, const std::vector<uint16_t>& x, int64_t T,
                                     const std::vector<int32_t>& ids, const std::vector<float>& w) {
  const auto xf = to_float(x);
  std::vector<float> ref(static_cast<size_t>(T * L.shape.hidden));
  EXPECT_TRUE(
      cpu::moe_experts_reference(L.shape, L.experts, L.options, xf.data(), T, ids.data(), w.data(), ref.data()).ok());
  return ref;
}

// Compares a GPU output with an oracle output; prints the NMSE.
inline void expect_close_to(const std::vector<float>& ref, const std::vector<uint16_t>& gpu_out,
                            const std::string& what) {
  const auto got = to_float(gpu_out);
  ASSERT_EQ(got.size(), ref.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) ASSERT_FALSE(std::isnan(got[i])) << what << ": unwritten output " << i;
  const double e = ::moebius::testing::nmse(got.data(), ref.data(), got.size());
  EXPECT_LT(e, kNmseBound) << what;
  std::printf("  %-48s nmse %.2e\n", what.c_str(), e);
}

// Compares a GPU output with the oracle run on the same routing; prints the NMSE.
inline void expect_matches_oracle(const cpu::MoeLayerReference& L, const std::vector<uint16_t>& x, int64_t T,
                                  const std::vector<int32_t>& ids, const std::vector<float>& w,
                                  const std::vector<uint16_t>& gpu_out, const std::string& what) {
  expect_close_to(oracle_out(L, x, T, ids, w), gpu_out, what);
}

// [TAG_MOE_GRAPH_CAPACITY] One CUDA graph of layer.forward over x (capacity rows), captured once and
// replayed for each token count T into a poisoned output; checks that rows past T stay poisoned
// and hands check(T, live) the first T rows. The routing of the replay is layer.topk_ids().
template <class Check>
void replay_one_graph_per_token_count(MoeLayerCuda& layer, const std::vector<uint16_t>& x,
                                      const std::vector<int32_t>& token_counts, Check&& check) {
  const int cap = layer.capacity();
  const int64_t H = layer.shape().hidden;
  CudaStream stream;
  DeviceBuffer<__nv_bfloat16> dx(static_cast<size_t>(cap) * H), dout(static_cast<size_t>(cap) * H);
  DeviceBuffer<int32_t> dn(1);
  dx.upload(x);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  layer.forward(dx.data(), dn.data(), dout.data(), stream);
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int32_t T : token_counts) {
    CUDA_CHECK(cudaMemcpyAsync(dn.data(), &T, 4, cudaMemcpyHostToDevice, stream));
    dout.poison(0xFF, stream);
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    stream.sync();
    std::vector<uint16_t> out(static_cast<size_t>(cap) * H);
    CUDA_CHECK(cudaMemcpy(out.data(), dout.data(), out.size() * 2, cudaMemcpyDeviceToHost));
    EXPECT_TRUE(testing::bytes_are(out.data() + T * H, (cap - T) * H, 0xFF)) << "T=" << T << ": rows past T written";
    EXPECT_TRUE(dout.guards_intact()) << "T=" << T;
    check(T, std::vector<uint16_t>(out.begin(), out.begin() + T * H));
  }
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
}

// The layer's routing of its last forward of T tokens, checked against the oracle.
inline void expect_last_forward_matches_oracle(const cpu::MoeLayerReference& L, MoeLayerCuda& layer,
                                               const std::vector<uint16_t>& x, int32_t T,
                                               const std::vector<uint16_t>& live, const std::string& what) {
  const int k = layer.shape().top_k;
  std::vector<int32_t> ids(static_cast<size_t>(T) * k);
  std::vector<float> w(ids.size());
  CUDA_CHECK(cudaMemcpy(ids.data(), layer.topk_ids(), 4 * ids.size(), cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(w.data(), layer.topk_weights(), 4 * ids.size(), cudaMemcpyDeviceToHost));
  const std::vector<uint16_t> xs(x.begin(), x.begin() + static_cast<int64_t>(T) * L.shape.hidden);
  expect_matches_oracle(L, xs, T, ids, w, live, what);
}

inline std::string path_label(const MoeLayerCuda& layer) {
  return std::string(moe_gemm_path_name(layer.gemm_path())) + " bm=" + std::to_string(layer.block_m());
}

// The path kAuto takes in the prefill regime on this machine: wgmma where the build and the
// device have it, else the mma.sync prefill kernels.
inline MoeGemmPath auto_prefill_path() {
  return kernels::moe_gemm_wgmma_available() ? MoeGemmPath::kPrefillWgmma : MoeGemmPath::kPrefill;
}

}  // namespace moebius::moe::moe_test
