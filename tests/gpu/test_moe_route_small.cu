// The fused small-batch routing kernel (launch_moe_route_small: router logits + top-k + align in
// one launch), and the one-block top-k + align (launch_moe_route_topk_align), against the separate
// kernels they replace (launch_moe_router_logits,
// launch_moe_route_topk, launch_moe_align), which test_moe_route.cu checks against the CPU oracle.
// The contract is bit-identical outputs, so every buffer is compared exactly, after poisoning both
// sides; guard bands must stay intact and rows past the live count untouched. Every launch is
// made twice, so state left behind by one launch (the kernel must keep none) would show.
// Model shapes:
//   Qwen3-30B-A3B: H=2048, E=128, k=8, softmax, renormalised
//   Mixtral-8x7B: H=4096, E=8, k=2
//   DeepSeek-V3: H=7168, E=256, k=8, sigmoid + bias, n_group=8, topk_group=4, scale 2.5
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
#include "kernels/moe_route.cuh"

namespace moebius {
namespace {

using kernels::RouteParams;
using kernels::RouteScoring;
using testing::bytes_are;
using testing::CudaStream;
using testing::DeviceBuffer;
using testing::same_values;

constexpr uint8_t kPoison = 0xAB;

struct Config {
  int H, E, k;
  RouteParams params;
  bool skewed = false;  // every token prefers experts 3 and e % 5 == 1: many experts stay empty
};

RouteParams softmax(int E, int k) {
  RouteParams p;
  p.num_experts = E;
  p.top_k = k;
  return p;
}

RouteParams deepseek() {
  RouteParams p = softmax(256, 8);
  p.scoring = RouteScoring::kSigmoid;
  p.n_groups = 8;
  p.topk_groups = 4;
  p.routed_scaling_factor = 2.5f;
  return p;
}

// Every routing output, for one implementation.
struct Outputs {
  Outputs(int capacity, int E, int k, int block_m)
      : max_padded(kernels::moe_align_max_padded(capacity, k, E, block_m)),
        max_tiles(kernels::moe_align_max_tiles(capacity, k, E, block_m)),
        logits(static_cast<size_t>(capacity) * E), ids(static_cast<size_t>(capacity) * k),
        weights(static_cast<size_t>(capacity) * k), offsets(E + 1), sorted(static_cast<size_t>(capacity) * k),
        padded_offsets(E + 1), padded(static_cast<size_t>(max_padded)), tiles(static_cast<size_t>(max_tiles)),
        num_tiles(1) {}
  void poison(cudaStream_t s) {
    logits.poison(kPoison, s);
    weights.poison(kPoison, s);
    for (auto* b : {&ids, &offsets, &sorted, &padded_offsets, &padded, &tiles, &num_tiles}) b->poison(kPoison, s);
  }
  int64_t max_padded, max_tiles;
  DeviceBuffer<float> logits;
  DeviceBuffer<int32_t> ids;
  DeviceBuffer<float> weights;
  DeviceBuffer<int32_t> offsets, sorted, padded_offsets, padded, tiles, num_tiles;
};

template <typename T>
bool bytes_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

template <typename T>
void expect_same(const DeviceBuffer<T>& got, const DeviceBuffer<T>& want, const char* what) {
  EXPECT_TRUE(got.guards_intact()) << what << ": guard band overwritten";
  const auto g = got.download(), w = want.download();
  ASSERT_EQ(g.size(), w.size());
  // Byte comparison: poisoned (unwritten) entries must match too, so "untouched" is checked.
  EXPECT_TRUE(bytes_equal(g, w)) << what << " differs between the fused and the separate kernels";
}

void run_separate(const Config& c, int capacity, int block_m, const __nv_bfloat16* x, const __nv_bfloat16* w,
                  const float* bias, const int32_t* d_T, Outputs& o, cudaStream_t s) {
  kernels::launch_moe_router_logits(x, c.H, w, d_T, capacity, c.H, c.E, o.logits.data(), s);
  kernels::launch_moe_route_topk(o.logits.data(), bias, d_T, capacity, c.params, o.ids.data(), o.weights.data(), s);
  kernels::launch_moe_align(o.ids.data(), d_T, capacity, c.k, c.E, block_m, o.offsets.data(), o.sorted.data(),
                            o.padded_offsets.data(), o.padded.data(), o.tiles.data(), o.num_tiles.data(), s);
}

void run_fused(const Config& c, int capacity, int block_m, const __nv_bfloat16* x, const __nv_bfloat16* w,
               const float* bias, const int32_t* d_T, Outputs& o, cudaStream_t s) {
  kernels::launch_moe_route_small(x, c.H, w, c.H, bias, d_T, capacity, c.params, block_m, o.logits.data(), o.ids.data(), o.weights.data(), o.offsets.data(), o.sorted.data(),
                                  o.padded_offsets.data(), o.padded.data(), o.tiles.data(), o.num_tiles.data(), s);
}

struct Inputs {
  DeviceBuffer<uint16_t> x, w;
  DeviceBuffer<float> bias;
  bool has_bias = false;
};

// Router rows N(0, 1/sqrt(H)) and activations N(0, 1), rounded to bf16; skewed routing adds a
// large component along a shared direction to experts 3 and e % 5 == 1. Rows t >= live (the
// capacity's dead rows) hold NaN: the fused kernel reads them (its loads do not wait for the live
// count) and must drop what it computes from them, so a NaN reaching a live logit fails the test.
Inputs make_inputs(const Config& c, int capacity, int live, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  std::vector<uint16_t> x(static_cast<size_t>(capacity) * c.H), w(static_cast<size_t>(c.E) * c.H);
  for (auto& v : x) v = float_to_bf16_bits(c.skewed ? 1.0f + 0.1f * n01(rng) : n01(rng));
  std::fill(x.begin() + static_cast<int64_t>(live) * c.H, x.end(), uint16_t{0x7FC0});  // bf16 NaN
  const float sd = 1.0f / std::sqrt(static_cast<float>(c.H));
  for (int e = 0; e < c.E; ++e)
    for (int h = 0; h < c.H; ++h) {
      float v = sd * n01(rng);
      if (c.skewed) v += e == 3 ? 4.0f * sd : (e % 5 == 1 ? 2.0f * sd : 0.0f);
      w[static_cast<size_t>(e) * c.H + h] = float_to_bf16_bits(v);
    }
  Inputs in{DeviceBuffer<uint16_t>(x.size()), DeviceBuffer<uint16_t>(w.size()), DeviceBuffer<float>(c.E), false};
  in.x.upload(x);
  in.w.upload(w);
  if (c.params.scoring == RouteScoring::kSigmoid) {
    std::uniform_real_distribution<float> u(-0.5f, 0.5f);
    std::vector<float> b(static_cast<size_t>(c.E));
    for (auto& v : b) v = u(rng);
    in.bias.upload(b);
    in.has_bias = true;
  }
  return in;
}

// The separate router kernel, then top-k and align in one launch (launch_moe_route_topk_align).
void run_topk_align(const Config& c, int capacity, int block_m, const __nv_bfloat16* x, const __nv_bfloat16* w,
                    const float* bias, const int32_t* d_T, Outputs& o, cudaStream_t s) {
  kernels::launch_moe_router_logits(x, c.H, w, d_T, capacity, c.H, c.E, o.logits.data(), s);
  kernels::launch_moe_route_topk_align(o.logits.data(), bias, d_T, capacity, c.params, block_m, o.ids.data(),
                                       o.weights.data(), o.offsets.data(), o.sorted.data(), o.padded_offsets.data(),
                                       o.padded.data(), o.tiles.data(), o.num_tiles.data(), s);
}

using Runner = void (*)(const Config&, int, int, const __nv_bfloat16*, const __nv_bfloat16*, const float*,
                        const int32_t*, Outputs&, cudaStream_t);

// `run` (the fused routing unless told otherwise) against run_separate, every output byte.
void check(const Config& c, int T, int capacity, int block_m, uint32_t seed, Runner run = run_fused) {
  SCOPED_TRACE(::testing::Message() << "H=" << c.H << " E=" << c.E << " k=" << c.k << " T=" << T
                                    << " capacity=" << capacity << " block_m=" << block_m
                                    << (c.skewed ? " skewed" : "")
                                    << (c.params.scoring == RouteScoring::kSigmoid ? " sigmoid" : ""));
  if (run == run_fused) ASSERT_TRUE(kernels::moe_route_small_supported(capacity, c.params));
  if (run == run_topk_align) ASSERT_TRUE(kernels::moe_route_topk_align_supported(capacity, c.params));
  CudaStream s;
  Inputs in = make_inputs(c, capacity, T, seed);
  const auto* x = reinterpret_cast<const __nv_bfloat16*>(in.x.data());
  const auto* w = reinterpret_cast<const __nv_bfloat16*>(in.w.data());
  const float* bias = in.has_bias ? in.bias.data() : nullptr;
  DeviceBuffer<int32_t> d_T(1);
  d_T.upload(std::vector<int32_t>{T});

  Outputs want(capacity, c.E, c.k, block_m), got(capacity, c.E, c.k, block_m);
  want.poison(s);
  got.poison(s);
  run_separate(c, capacity, block_m, x, w, bias, d_T.data(), want, s);
  // Twice: the second launch must not depend on anything the first left behind.
  run(c, capacity, block_m, x, w, bias, d_T.data(), got, s);
  got.poison(s);
  run(c, capacity, block_m, x, w, bias, d_T.data(), got, s);
  s.sync();
  expect_same(got.logits, want.logits, "logits");
  expect_same(got.ids, want.ids, "topk_ids");
  expect_same(got.weights, want.weights, "topk_weights");
  expect_same(got.offsets, want.offsets, "expert_offsets");
  expect_same(got.sorted, want.sorted, "sorted_pair_ids");
  expect_same(got.padded_offsets, want.padded_offsets, "padded_offsets");
  expect_same(got.padded, want.padded, "padded_pair_ids");
  expect_same(got.tiles, want.tiles, "tile_expert");
  expect_same(got.num_tiles, want.num_tiles, "num_tiles");
  // Sanity on the reference itself, so "both wrong alike" cannot pass silently: every live id is
  // a valid expert and the rows past T kept their poison.
  const auto ids = want.ids.download();
  for (int i = 0; i < T * c.k; ++i) ASSERT_TRUE(ids[i] >= 0 && ids[i] < c.E) << "id " << i;
  EXPECT_TRUE(bytes_are(ids.data() + T * c.k, ids.size() - static_cast<size_t>(T) * c.k, kPoison));
}

TEST(MoeRouteSmallGpu, MatchesSeparateKernelsBitForBit) {
  MOEBIUS_REQUIRE_GPU();
  const std::vector<Config> configs = {
      {2048, 128, 8, softmax(128, 8)},  // Qwen3-30B-A3B
      {4096, 8, 2, softmax(8, 2)},      // Mixtral-8x7B
      {64, 60, 4, softmax(60, 4)},      // Qwen1.5-MoE E=60, small H
      {100, 64, 8, softmax(64, 8)},     // H not a multiple of 8: the scalar dot path
      {7168, 256, 8, deepseek()},       // DeepSeek-V3 grouped sigmoid
      {2048, 32, 16, softmax(32, 16)},  // k = 16 = the top-k maximum
  };
  uint32_t seed = 1;
  for (const Config& c : configs) {
    const int max_cap = std::min(kernels::kRouteSmallMaxCapacity, kernels::kRouteSmallMaxPairs / c.k);
    for (int T : {0, 1, 2, 3, 4, 5, 8, 9, 12, 16}) {
      if (T > max_cap) continue;
      for (int block_m : {1, 8, 16}) {
        check(c, T, std::min(max_cap, T + 3), block_m, seed++);
        if (T == max_cap) check(c, T, T, block_m, seed++);  // capacity == T exactly
      }
    }
  }
}

TEST(MoeRouteSmallGpu, SkewedRoutingLeavesExpertsEmpty) {
  MOEBIUS_REQUIRE_GPU();
  constexpr int kCap = kernels::kRouteSmallMaxCapacity;
  for (int T : {1, 5, kCap}) {
    Config c{2048, 128, 8, softmax(128, 8), /*skewed=*/true};
    check(c, T, kCap, 8, 100u + static_cast<uint32_t>(T));
    Config d{7168, 256, 8, deepseek(), /*skewed=*/true};
    check(d, T, kCap, 8, 200u + static_cast<uint32_t>(T));
  }
}

// One capture at the largest capacity replays for every live count, including 0.
void check_graph_replay(Runner run, int kCap) {
  const Config c{2048, 128, 8, softmax(128, 8)};
  constexpr int kBlockM = 8;
  CudaStream s;
  Inputs in = make_inputs(c, kCap, kCap, 77);  // every row live: the replays vary the count
  const auto* x = reinterpret_cast<const __nv_bfloat16*>(in.x.data());
  const auto* w = reinterpret_cast<const __nv_bfloat16*>(in.w.data());
  DeviceBuffer<int32_t> d_T(1);
  d_T.upload(std::vector<int32_t>{kCap});
  Outputs got(kCap, c.E, c.k, kBlockM), want(kCap, c.E, c.k, kBlockM);

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  run(c, kCap, kBlockM, x, w, nullptr, d_T.data(), got, s);
  CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int T : {kCap, 1, 0, kCap - 1, kCap, 3}) {
    SCOPED_TRACE(::testing::Message() << "replay T=" << T);
    d_T.upload(std::vector<int32_t>{T});
    got.poison(s);
    want.poison(s);
    CUDA_CHECK(cudaGraphLaunch(exec, s));
    run_separate(c, kCap, kBlockM, x, w, nullptr, d_T.data(), want, s);
    s.sync();
    expect_same(got.ids, want.ids, "topk_ids");
    expect_same(got.weights, want.weights, "topk_weights");
    expect_same(got.padded, want.padded, "padded_pair_ids");
    expect_same(got.tiles, want.tiles, "tile_expert");
    expect_same(got.num_tiles, want.num_tiles, "num_tiles");
  }
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
}

TEST(MoeRouteSmallGpu, GraphReplayServesEveryTokenCount) {
  MOEBIUS_REQUIRE_GPU();
  check_graph_replay(run_fused, kernels::kRouteSmallMaxCapacity);
}

// Top-k + align in one block (launch_moe_route_topk_align) against the two kernels, bit for bit:
// every ungrouped shape from one token to the capacity limit, the n <= 32 warp align and the
// chunked block align, block_m 1 (no padding) to 64, E up to 256 (a lane's 8 logits) and k = 16.
TEST(MoeRouteTopKAlignGpu, MatchesTopKThenAlignBitForBit) {
  MOEBIUS_REQUIRE_GPU();
  constexpr int kCap = kernels::kRouteTopKAlignMaxCapacity;
  RouteParams sigmoid = softmax(256, 8);  // sigmoid + correction bias, no group limit
  sigmoid.scoring = RouteScoring::kSigmoid;
  sigmoid.routed_scaling_factor = 2.5f;
  RouteParams no_renorm = softmax(128, 8);
  no_renorm.renormalize = false;
  const std::vector<Config> configs = {
      {2048, 128, 8, softmax(128, 8)},  // Qwen3-30B-A3B
      {4096, 8, 2, softmax(8, 2)},      // Mixtral-8x7B
      {64, 60, 4, softmax(60, 4)},      // E = 60
      {100, 64, 8, softmax(64, 8)},     // H not a multiple of 8: the router's scalar path
      {1024, 256, 8, sigmoid},          // sigmoid with bias and scaling
      {512, 128, 8, no_renorm},         // weights not renormalised
      {256, 256, 16, softmax(256, 16)}, // E = 256, k = 16: the limits
  };
  uint32_t seed = 1000;
  for (const Config& c : configs)
    for (int T : {0, 1, 2, 3, 4, 5, 8, 9, 16, 17, 31, kCap}) {
      for (int block_m : {1, 8, 16, 64}) check(c, T, std::min(kCap, T + 3), block_m, seed++, run_topk_align);
      if (T == kCap || T == 4) check(c, T, T, 8, seed++, run_topk_align);  // capacity == T exactly
    }
  for (int T : {1, 7, kCap}) {
    Config c{2048, 128, 8, softmax(128, 8), /*skewed=*/true};  // most experts empty
    check(c, T, kCap, 8, 2000u + static_cast<uint32_t>(T), run_topk_align);
  }
}

TEST(MoeRouteTopKAlignGpu, GraphReplayServesEveryTokenCount) {
  MOEBIUS_REQUIRE_GPU();
  check_graph_replay(run_topk_align, kernels::kRouteTopKAlignMaxCapacity);
}

// The limits: group-limited scoring, capacities above 32 and E above 256 keep the two kernels.
TEST(MoeRouteTopKAlign, SupportedShapes) {
  EXPECT_TRUE(kernels::moe_route_topk_align_supported(0, softmax(128, 8)));
  EXPECT_TRUE(kernels::moe_route_topk_align_supported(kernels::kRouteTopKAlignMaxCapacity, softmax(256, 16)));
  EXPECT_FALSE(kernels::moe_route_topk_align_supported(kernels::kRouteTopKAlignMaxCapacity + 1, softmax(128, 8)));
  EXPECT_FALSE(kernels::moe_route_topk_align_supported(4, deepseek()));
  EXPECT_FALSE(kernels::moe_route_topk_align_supported(4, softmax(257, 8)));
  EXPECT_FALSE(kernels::moe_route_topk_align_supported(4, softmax(8, 9)));
  EXPECT_FALSE(kernels::moe_route_topk_align_supported(-1, softmax(128, 8)));
}

}  // namespace
}  // namespace moebius
