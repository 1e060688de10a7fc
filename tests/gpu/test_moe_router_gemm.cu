// The router logits kernels against a plain double-precision CPU reference, on fresh random inputs
// with fixed seeds: the tensor-core router GEMM (launch_moe_router_gemm, src/kernels/
// moe_router_gemm.cu), for every tile it is instantiated for and for the automatic pick, and the
// small-batch router (launch_moe_router_logits, moe_route.cu) in both of its arithmetic classes
// (router_dot up to kRouterDotMaxCapacity, 16 x 8 tensor-core tiles above).
// Before each launch the logits are poisoned (0xFF bytes: NaN); afterwards every live row
// (t < T) must be within the accumulation tolerance below, every row t >= T must still hold the
// poison bytes, and the guard bands around the buffer must be intact. x carries NaN in its
// padding columns [H, x_stride) and in its rows t >= T, so a kernel that read them would put NaN
// into a live logit (the kernel zero-fills W past H, and 0 * NaN = NaN).
// Model shapes:
//   Qwen3-30B-A3B: H=2048, E=128 (the router is "mlp.gate", [E, H] bf16)
//   DeepSeek-V3: E=256 (H=7168; run here with smaller H so the reference stays fast)
//   Qwen1.5-MoE-A2.7B: E=60; Mixtral-8x7B: E=8
#include "gpu/gpu_test_util.h"  // first: it makes fmt compile under nvcc

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "kernels/moe_route.cuh"
#include "kernels/moe_router_gemm.cuh"

namespace moebius {
namespace {

using kernels::RouterGemmTile;
using testing::bytes_are;
using testing::CudaStream;
using testing::DeviceBuffer;

constexpr uint8_t kPoison = 0xFF;     // NaN in fp32
constexpr uint16_t kNaNBf16 = 0x7FC0;  // what x holds where the kernel must not read

const RouterGemmTile kTiles[] = {RouterGemmTile::k128x64, RouterGemmTile::k128x32, RouterGemmTile::k128x16,
                                 RouterGemmTile::k64x16};

struct Case {
  const char* name;
  int T;         // live tokens (*num_tokens)
  int capacity;  // >= T: rows [T, capacity) must stay untouched
  int E, H, x_stride;
  bool positive = false;  // all inputs >= 0: the rounding errors of the sums cannot cancel
};

std::string label(const Case& c) {
  return std::string(c.name) + " T=" + std::to_string(c.T) + " cap=" + std::to_string(c.capacity) +
         " E=" + std::to_string(c.E) + " H=" + std::to_string(c.H) + " stride=" + std::to_string(c.x_stride);
}

struct HostInputs {
  std::vector<uint16_t> x;  // [capacity, x_stride] bf16 bits: NaN in the padding columns and rows >= T
  std::vector<uint16_t> w;  // [E, H]
};

// x uniform in [-1, 1] and W in [-1/8, 1/8] (or [0, 1] and [0, 1/8] for `positive`), rounded to
// bf16, so the CPU sees exactly the numbers the GPU multiplies.
HostInputs make_inputs(const Case& c, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> ux(c.positive ? 0.0f : -1.0f, 1.0f);
  std::uniform_real_distribution<float> uw(c.positive ? 0.0f : -0.125f, 0.125f);
  HostInputs in;
  in.x.assign(static_cast<size_t>(c.capacity) * c.x_stride, kNaNBf16);
  for (int t = 0; t < c.T; ++t)
    for (int h = 0; h < c.H; ++h) in.x[static_cast<size_t>(t) * c.x_stride + h] = float_to_bf16_bits(ux(rng));
  in.w.resize(static_cast<size_t>(c.E) * c.H);
  for (auto& v : in.w) v = float_to_bf16_bits(uw(rng));
  return in;
}

struct Reference {
  std::vector<double> sum;  // [T, E]: sum_h W[e][h] * x[t][h]
  std::vector<double> abs;  // [T, E]: sum_h |W[e][h] * x[t][h]|
};

Reference reference(const Case& c, const HostInputs& in) {
  Reference r;
  r.sum.resize(static_cast<size_t>(c.T) * c.E);
  r.abs.resize(r.sum.size());
  std::vector<double> wf(in.w.size()), xf(static_cast<size_t>(c.H));
  for (size_t i = 0; i < wf.size(); ++i) wf[i] = bf16_bits_to_float(in.w[i]);
  for (int t = 0; t < c.T; ++t) {
    for (int h = 0; h < c.H; ++h) xf[static_cast<size_t>(h)] = bf16_bits_to_float(in.x[static_cast<size_t>(t) * c.x_stride + h]);
    for (int e = 0; e < c.E; ++e) {
      const double* wr = wf.data() + static_cast<size_t>(e) * c.H;
      double s = 0.0, a = 0.0;
      for (int h = 0; h < c.H; ++h) {
        const double p = wr[h] * xf[static_cast<size_t>(h)];  // exact: bf16 x bf16 fits a double
        s += p;
        a += std::fabs(p);
      }
      r.sum[static_cast<size_t>(t) * c.E + e] = s;
      r.abs[static_cast<size_t>(t) * c.E + e] = a;
    }
  }
  return r;
}

// The tolerance. Products of bf16 values are exact in fp32; the error is the accumulation's.
// A tensor-core mma adds its 16 products and the accumulator with the significands aligned to
// the largest and truncated (Fasi et al., "Numerical behavior of NVIDIA tensor cores", 2021), so
// each of the 17 addends may lose up to one ulp of the largest partial sum, which is at most
// S = sum_h |w x|. Over ceil(H/16) k-steps that bounds the error by 17 * ceil(H/16) * 2^-23 * S
// (2^-11.9 S at H = 2048). A bug (a dropped or repeated 16-wide k slice, a stale pipeline slot,
// another token's row) moves a logit by ~16/H of S or more (2^-7 S at H = 2048), far outside it.
// The observed error is printed in units of 2^-24 S (typically a few).
double tolerance(int H, double abs_sum) {
  return 17.0 * ((H + 15) / 16) * std::ldexp(abs_sum, -23) + 1e-30;
}

struct DeviceInputs {
  DeviceBuffer<uint16_t> x, w;
  DeviceBuffer<int32_t> T;
};

DeviceInputs upload(const Case& c, const HostInputs& in) {
  DeviceInputs d{DeviceBuffer<uint16_t>(in.x.size()), DeviceBuffer<uint16_t>(in.w.size()), DeviceBuffer<int32_t>(1)};
  d.x.upload(in.x);
  d.w.upload(in.w);
  d.T.upload(std::vector<int32_t>{c.T});
  return d;
}

// One poisoned launch; returns the whole logits buffer [capacity, E].
std::vector<float> run(const Case& c, DeviceInputs& d, DeviceBuffer<float>& logits, RouterGemmTile tile,
                       cudaStream_t stream) {
  logits.poison(kPoison, stream);
  kernels::launch_moe_router_gemm(reinterpret_cast<const __nv_bfloat16*>(d.x.data()), c.x_stride,
                                  reinterpret_cast<const __nv_bfloat16*>(d.w.data()), d.T.data(), c.capacity, c.H, c.E,
                                  logits.data(), stream, tile);
  CUDA_CHECK(cudaStreamSynchronize(stream));
  EXPECT_TRUE(logits.guards_intact()) << "guard band overwritten";
  return logits.download();
}

// Live rows within tolerance of the reference, rows >= T untouched. Returns the largest error in
// units of 2^-24 S.
double check(const Case& c, const Reference& ref, const std::vector<float>& got, const std::string& what) {
  const size_t live = static_cast<size_t>(c.T) * c.E;
  EXPECT_TRUE(bytes_are(got.data() + live, got.size() - live, kPoison)) << what << ": a row >= T was written";
  size_t bad = 0, first = 0;
  double worst = 0.0;
  for (size_t i = 0; i < live; ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - ref.sum[i]);
    if (!(err <= tolerance(c.H, ref.abs[i])) && bad++ == 0) first = i;  // NaN fails too
    if (ref.abs[i] > 0) worst = std::fmax(worst, err / std::ldexp(ref.abs[i], -24));
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << live << " logits outside the tolerance; first [t=" << first / c.E
                     << ", e=" << first % c.E << "]: got " << got[first] << ", want " << ref.sum[first]
                     << " (sum |w x| " << ref.abs[first] << ")";
  return worst;
}

bool same_bytes(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Every tile and the automatic pick on one case; every launch twice (bit-identical reruns), and
// every tile must give the same bits: each logit is the same k-ordered chain of mma steps
// whatever the tile, and the pick is one of them.
void run_case(const Case& c, uint32_t seed) {
  const HostInputs in = make_inputs(c, seed);
  const Reference ref = reference(c, in);
  DeviceInputs d = upload(c, in);
  DeviceBuffer<float> logits(static_cast<size_t>(c.capacity) * c.E);
  CudaStream stream;
  std::vector<float> first;
  for (RouterGemmTile tile : kTiles) {
    const std::string what = label(c) + " tile " + kernels::router_gemm_tile_name(tile);
    const auto a = run(c, d, logits, tile, stream);
    const double worst = check(c, ref, a, what);
    const auto b = run(c, d, logits, tile, stream);
    EXPECT_TRUE(same_bytes(a, b)) << what << ": two launches differ";
    if (first.empty()) first = a;
    else EXPECT_TRUE(same_bytes(a, first)) << what << ": differs from tile " << kernels::router_gemm_tile_name(kTiles[0]);
    std::printf("  %-60s max err %.2f x 2^-24 sum|wx|\n", what.c_str(), worst);
  }
  const RouterGemmTile picked = kernels::router_gemm_pick_tile(c.capacity, c.E);
  const auto a = run(c, d, logits, RouterGemmTile::kAuto, stream);
  check(c, ref, a, label(c) + " auto");
  EXPECT_TRUE(same_bytes(a, first)) << label(c) << ": auto (" << kernels::router_gemm_tile_name(picked)
                                    << ") differs from the forced tiles";
}

TEST(MoeRouterGemmGpu, MatchesDoubleReference) {
  MOEBIUS_REQUIRE_GPU();
  const Case cases[] = {
      // Qwen3-30B-A3B router at the layer's capacities (T = capacity: every row live).
      {"qwen3-30b", 1, 1, 128, 2048, 2048},
      {"qwen3-30b", 255, 256, 128, 2048, 2048},
      {"qwen3-30b", 1000, 1024, 128, 2048, 2048 + 64},
      {"qwen3-30b", 4096, 4096, 128, 2048, 2048},
      // Small and odd shapes; x_stride > H with NaN padding; capacity > T.
      {"mixtral-like", 3, 16, 8, 64, 72},
      {"odd", 17, 17, 64, 200, 200},
      {"odd-e", 17, 40, 40, 200, 208},  // E not a multiple of 16
      {"qwen1.5-like", 64, 80, 60, 2048, 2056},
      {"deepseek-e", 64, 64, 256, 2048, 2056},
      {"deepseek-e", 1000, 1003, 256, 200, 216},
      {"e-past-128", 100, 128, 130, 136, 136},  // a second expert tile with 2 live rows
      {"one-expert", 5, 8, 1, 64, 64},
      {"tall", 4096, 4100, 8, 64, 64},
      // All-positive inputs: the accumulation errors add up instead of cancelling.
      {"positive", 1000, 1000, 128, 2048, 2048, true},
  };
  uint32_t seed = 7;
  for (const Case& c : cases) run_case(c, seed++);
}

// [TAG_MOE_GRAPH_CAPACITY] One capture at capacity 1024, replayed with *num_tokens = 300, 1000,
// 0, and 5000 (clamped to the capacity): each replay matches the eager launch on the live rows,
// bit for bit, and leaves the other rows poisoned.
TEST(MoeRouterGemmGpu, GraphCaptureReplaysAtAnyTokenCount) {
  MOEBIUS_REQUIRE_GPU();
  const Case full{"qwen3-30b graph", 1024, 1024, 128, 2048, 2048 + 8};
  const HostInputs in = make_inputs(full, 99);
  DeviceInputs d = upload(full, in);
  DeviceBuffer<float> logits(static_cast<size_t>(full.capacity) * full.E);
  CudaStream stream;
  const auto eager = run(full, d, logits, RouterGemmTile::kAuto, stream);
  check(full, reference(full, in), eager, label(full) + " eager");

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  kernels::launch_moe_router_gemm(reinterpret_cast<const __nv_bfloat16*>(d.x.data()), full.x_stride,
                                  reinterpret_cast<const __nv_bfloat16*>(d.w.data()), d.T.data(), full.capacity, full.H,
                                  full.E, logits.data(), stream);
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  int32_t* h_T = nullptr;  // pinned, so the copy is truly asynchronous
  CUDA_CHECK(cudaMallocHost(&h_T, sizeof(int32_t)));
  for (int T : {300, 1000, 0, 5000}) {
    const int live = T < full.capacity ? T : full.capacity;
    logits.poison(kPoison, stream);
    *h_T = T;
    CUDA_CHECK(cudaMemcpyAsync(d.T.data(), h_T, sizeof(int32_t), cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    stream.sync();  // also keeps *h_T unchanged until the copy has run
    const auto got = logits.download();
    const size_t n = static_cast<size_t>(live) * full.E;
    EXPECT_EQ(0, std::memcmp(got.data(), eager.data(), n * sizeof(float))) << "replay at T=" << T;
    EXPECT_TRUE(bytes_are(got.data() + n, got.size() - n, kPoison)) << "replay at T=" << T << " wrote a row >= T";
    EXPECT_TRUE(logits.guards_intact());
  }
  CUDA_CHECK(cudaFreeHost(h_T));
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
}

// launch_moe_router_logits: the same poisoned launches and tolerance (the CUDA-core class, fp32
// FMAs, sits far inside it). Capacities up to 8 take router_dot, 9 and up the tensor-core tiles
// (hidden and x_stride multiples of 8); H = 100 and 200 with odd strides take router_dot at any
// capacity. Two launches must give the same bits; a replay at a lower live count must give the
// same bits on the rows both cover (the arithmetic depends on the capacity only).
std::vector<float> run_logits(const Case& c, DeviceInputs& d, DeviceBuffer<float>& logits, cudaStream_t stream) {
  logits.poison(kPoison, stream);
  kernels::launch_moe_router_logits(reinterpret_cast<const __nv_bfloat16*>(d.x.data()), c.x_stride,
                                    reinterpret_cast<const __nv_bfloat16*>(d.w.data()), d.T.data(), c.capacity, c.H,
                                    c.E, logits.data(), stream);
  CUDA_CHECK(cudaStreamSynchronize(stream));
  EXPECT_TRUE(logits.guards_intact()) << "guard band overwritten";
  return logits.download();
}

TEST(MoeRouterLogitsGpu, MatchesDoubleReference) {
  MOEBIUS_REQUIRE_GPU();
  const Case cases[] = {
      {"qwen3-30b dot", 1, 1, 128, 2048, 2048},
      {"qwen3-30b dot", 5, 8, 128, 2048, 2048 + 64},
      {"qwen3-30b tiles", 9, 9, 128, 2048, 2048},
      {"qwen3-30b tiles", 17, 64, 128, 2048, 2048 + 8},
      {"qwen3-30b tiles", 128, 128, 128, 2048, 2048},
      {"qwen3-30b tiles", 200, 255, 128, 2048, 2048},
      {"mixtral-like tiles", 11, 16, 8, 4096, 4096},        // E < 16: one partial tile
      {"qwen1.5-like tiles", 33, 40, 60, 2048, 2056},       // E not a multiple of 16
      {"deepseek-e tiles", 64, 64, 256, 7168, 7168},        // 14 k-blocks per warp
      {"odd-h tiles", 20, 24, 40, 200, 208},                // H % 32 != 0: a partial k-block
      {"odd-h dot", 20, 24, 40, 100, 101},                  // H % 8 != 0: router_dot at any capacity
      {"positive tiles", 100, 100, 128, 2048, 2048, true},  // errors add up instead of cancelling
  };
  uint32_t seed = 300;
  for (const Case& c : cases) {
    const HostInputs in = make_inputs(c, seed++);
    const Reference ref = reference(c, in);
    DeviceInputs d = upload(c, in);
    DeviceBuffer<float> logits(static_cast<size_t>(c.capacity) * c.E);
    CudaStream stream;
    const auto a = run_logits(c, d, logits, stream);
    const double worst = check(c, ref, a, label(c));
    const auto b = run_logits(c, d, logits, stream);
    EXPECT_TRUE(same_bytes(a, b)) << label(c) << ": two launches differ";
    if (c.T > 1) {  // fewer live tokens, same capacity: the live rows' bits do not change
      d.T.upload(std::vector<int32_t>{c.T - 1});
      const auto fewer = run_logits(c, d, logits, stream);
      EXPECT_EQ(std::memcmp(fewer.data(), a.data(), sizeof(float) * (c.T - 1) * c.E), 0)
          << label(c) << ": a row's bits depend on the live count";
    }
    std::printf("  %-60s max err %.2f x 2^-24 sum|wx|\n", label(c).c_str(), worst);
  }
}

// What the launcher refuses (the layer then runs the CUDA-core router): rows that are not
// 16-byte aligned, H not a multiple of 8, no experts. Host-only checks.
TEST(MoeRouterGemmGpu, SupportedShapes) {
  alignas(16) static const uint16_t x[16] = {};
  EXPECT_TRUE(kernels::moe_router_gemm_supported(x, 2048, 2048, 128));
  EXPECT_TRUE(kernels::moe_router_gemm_supported(x, 216, 200, 40));  // odd E, x_stride > H
  EXPECT_TRUE(kernels::moe_router_gemm_supported(x, 8, 8, 1));
  EXPECT_FALSE(kernels::moe_router_gemm_supported(x + 1, 2048, 2048, 128));  // x 2 bytes off
  EXPECT_FALSE(kernels::moe_router_gemm_supported(x, 2052, 2048, 128));     // x_stride % 8
  EXPECT_FALSE(kernels::moe_router_gemm_supported(x, 2048, 2044, 128));     // H % 8
  EXPECT_FALSE(kernels::moe_router_gemm_supported(x, 2048, 4096, 128));     // x_stride < H
  EXPECT_FALSE(kernels::moe_router_gemm_supported(x, 8, 0, 128));           // H = 0
  EXPECT_FALSE(kernels::moe_router_gemm_supported(x, 2048, 2048, 0));       // E = 0
}

}  // namespace
}  // namespace moebius
