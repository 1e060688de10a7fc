// The CPU reference MoE layer: router, experts, combine. It is the oracle for the CUDA kernels, so
// these tests check it against hand-computed answers and against a second, naive per-token
// implementation written independently below.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "core/dtype.h"
#include "cpu/moe_layer.h"

namespace moebius::cpu {
namespace {

using ::testing::HasSubstr;

QuantMatrix f32_matrix(const std::vector<float>& w, int64_t rows, int64_t cols) {
  auto m = quantize(WeightFormat::kF32, w.data(), rows, cols, 0);
  EXPECT_TRUE(m.ok()) << m.error().what();
  return std::move(m).value();
}

std::vector<float> randn(size_t n, std::mt19937_64& rng, float stddev = 1.0f) {
  std::normal_distribution<float> d(0.0f, stddev);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// ---- router ----------------------------------------------------------------------------------
TEST(MoeCpuRouter, SoftmaxTopKHandComputed) {
  RouterConfig cfg;
  cfg.num_experts = 4;
  cfg.top_k = 2;
  const float logits[4] = {1.0f, 3.0f, 2.0f, 0.0f};
  int32_t ids[2];
  float w[2];
  cfg.renormalize = false;
  ASSERT_TRUE(route_reference(cfg, logits, 1, ids, w).ok());
  const double z = std::exp(1.0) + std::exp(3.0) + std::exp(2.0) + std::exp(0.0);
  EXPECT_EQ(ids[0], 1);
  EXPECT_EQ(ids[1], 2);
  EXPECT_NEAR(w[0], std::exp(3.0) / z, 1e-6);
  EXPECT_NEAR(w[1], std::exp(2.0) / z, 1e-6);
  cfg.renormalize = true;  // norm_topk_prob: e^3/(e^3+e^2)
  ASSERT_TRUE(route_reference(cfg, logits, 1, ids, w).ok());
  EXPECT_NEAR(w[0], std::exp(3.0) / (std::exp(3.0) + std::exp(2.0)), 1e-6);
  EXPECT_NEAR(w[0] + w[1], 1.0, 1e-6);
}

TEST(MoeCpuRouter, TiesGoToTheLowerExpert) {
  RouterConfig cfg;
  cfg.num_experts = 6;
  cfg.top_k = 3;
  const float logits[6] = {0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f};
  int32_t ids[3];
  float w[3];
  ASSERT_TRUE(route_reference(cfg, logits, 1, ids, w).ok());
  EXPECT_EQ(ids[0], 0);
  EXPECT_EQ(ids[1], 1);
  EXPECT_EQ(ids[2], 2);
}

TEST(MoeCpuRouter, SigmoidGroupLimitedDeepSeekStyle) {
  // E=8 in 4 groups of 2, keep 2 groups, k=2. Choice = sigmoid(logit) + bias.
  RouterConfig cfg;
  cfg.num_experts = 8;
  cfg.top_k = 2;
  cfg.scoring = RouterScoring::kSigmoid;
  cfg.n_groups = 4;
  cfg.topk_groups = 2;
  cfg.routed_scaling_factor = 2.5f;
  cfg.correction_bias = {0, 0, 0, 0, 0, 0, 0.9f, 0};
  // Expert 5 has the single highest score, but its group {4,5} sums lower than {6,7} (biased)
  // and {0,1}.
  const float logits[8] = {2.0f, 2.0f, -3.0f, -3.0f, -5.0f, 3.0f, 0.0f, 1.0f};
  int32_t ids[2];
  float w[2];
  ASSERT_TRUE(route_reference(cfg, logits, 1, ids, w).ok());
  auto sig = [](double v) { return 1.0 / (1.0 + std::exp(-v)); };
  // group sums: {0,1}: 2*sig(2)=1.76; {2,3}: 0.09; {4,5}: sig(-5)+sig(3)=0.96; {6,7}: 0.5+0.9+sig(1)=2.13
  // kept groups {6,7} and {0,1}; choice: e6 = 1.4, e0 = e1 = 0.88, e7 = 0.73 -> experts 6 and 0.
  EXPECT_EQ(ids[0], 6);
  EXPECT_EQ(ids[1], 0);
  // Weights are the unbiased sigmoid scores, renormalised, times the scaling factor.
  const double s6 = sig(0.0), s0 = sig(2.0);
  EXPECT_NEAR(w[0], 2.5 * s6 / (s6 + s0), 1e-6);
  EXPECT_NEAR(w[1], 2.5 * s0 / (s6 + s0), 1e-6);
}

TEST(MoeCpuRouter, InvalidConfigsAreErrors) {
  RouterConfig cfg;
  cfg.num_experts = 8;
  cfg.top_k = 9;
  EXPECT_THAT(cfg.validate().error().what(), HasSubstr("top_k"));
  cfg.top_k = 2;
  cfg.scoring = RouterScoring::kSigmoid;
  cfg.n_groups = 3;
  EXPECT_THAT(cfg.validate().error().what(), HasSubstr("n_group"));
  cfg.n_groups = 4;
  cfg.topk_groups = 5;
  EXPECT_THAT(cfg.validate().error().what(), HasSubstr("topk_group"));
  cfg.topk_groups = 1;
  cfg.top_k = 3;  // only 2 experts in one kept group
  EXPECT_THAT(cfg.validate().error().what(), HasSubstr("top_k"));
  cfg.top_k = 2;
  cfg.correction_bias = {1, 2};
  EXPECT_THAT(cfg.validate().error().what(), HasSubstr("e_score_correction_bias"));
}

// ---- activations -----------------------------------------------------------------------------
TEST(MoeCpuActivation, Variants) {
  ActivationConfig a;
  const double g = 1.5, u = -2.0;
  EXPECT_NEAR(apply_activation(a, 1.5f, -2.0f), g / (1 + std::exp(-g)) * u, 1e-6);
  a.kind = Activation::kSiLUClamped;
  a.limit = 1.0f;
  EXPECT_NEAR(apply_activation(a, 1.5f, -2.0f), 1.0 / (1 + std::exp(-1.0)) * -1.0, 1e-6);
  a.kind = Activation::kGptOss;
  a.limit = 7.0f;
  a.alpha = 1.702f;
  EXPECT_NEAR(apply_activation(a, 9.0f, 0.5f), (0.5 + 1) * 7.0 / (1 + std::exp(-1.702 * 7.0)), 1e-5);
}

// ---- experts ---------------------------------------------------------------------------------
TEST(MoeCpuExperts, HandComputedSingleExpert) {
  // H=2, I=1, E=1, k=1: g = [1, 2].x, u = [3, -1].x, y = [0.5, 2]^T * silu(g) * u.
  MoeShape shape{2, 1, 1, 1};
  std::vector<ExpertWeights> ex(1);
  ex[0].gate = f32_matrix({1, 2}, 1, 2);
  ex[0].up = f32_matrix({3, -1}, 1, 2);
  ex[0].down = f32_matrix({0.5f, 2}, 2, 1);
  const float x[2] = {0.25f, 0.5f};
  const int32_t ids[1] = {0};
  const float w[1] = {0.75f};
  float out[2];
  MoeReferenceOptions opt;
  opt.round_intermediate_to_bf16 = false;
  ASSERT_TRUE(moe_experts_reference(shape, ex, opt, x, 1, ids, w, out).ok());
  const double g = 1.25, u = 0.25, h = g / (1 + std::exp(-g)) * u;
  EXPECT_NEAR(out[0], 0.75 * 0.5 * h, 1e-7);
  EXPECT_NEAR(out[1], 0.75 * 2.0 * h, 1e-7);
}

// An independent, naive formulation: token by token, slot by slot, straight from the
// dequantized matrices, no grouping by expert, no threads.
std::vector<float> naive_moe(const MoeShape& s, const std::vector<ExpertWeights>& ex, const std::vector<float>& x,
                             int64_t T, const std::vector<int32_t>& ids, const std::vector<float>& w) {
  std::vector<std::vector<float>> G, U, D;
  for (const auto& e : ex) {
    std::vector<float> g(s.intermediate * s.hidden), u(g.size()), d(s.hidden * s.intermediate);
    dequantize_rows(e.gate, 0, s.intermediate, g.data());
    dequantize_rows(e.up, 0, s.intermediate, u.data());
    dequantize_rows(e.down, 0, s.hidden, d.data());
    G.push_back(g);
    U.push_back(u);
    D.push_back(d);
  }
  std::vector<float> out(T * s.hidden, 0.0f);
  for (int64_t t = 0; t < T; ++t) {
    for (int j = 0; j < s.top_k; ++j) {
      const int e = ids[t * s.top_k + j];
      std::vector<float> h(s.intermediate);
      for (int64_t i = 0; i < s.intermediate; ++i) {
        long double gs = 0, us = 0;
        for (int64_t c = 0; c < s.hidden; ++c) {
          gs += static_cast<long double>(G[e][i * s.hidden + c]) * x[t * s.hidden + c];
          us += static_cast<long double>(U[e][i * s.hidden + c]) * x[t * s.hidden + c];
        }
        const double gd = static_cast<double>(gs);
        h[i] = bf16_bits_to_float(float_to_bf16_bits(static_cast<float>(gd / (1 + std::exp(-gd)) * static_cast<double>(us))));
      }
      for (int64_t c = 0; c < s.hidden; ++c) {
        long double ys = 0;
        for (int64_t i = 0; i < s.intermediate; ++i) ys += static_cast<long double>(D[e][c * s.intermediate + i]) * h[i];
        out[t * s.hidden + c] += w[t * s.top_k + j] * static_cast<float>(ys);
      }
    }
  }
  return out;
}

struct Case {
  const char* name;
  MoeShape shape;
  int64_t tokens;
  WeightFormat format;
  int group_size;
  enum Routing { kRandom, kAllToOne, kHalfEmpty } routing;
};

class MoeCpuExpertsVsNaive : public ::testing::TestWithParam<Case> {};

TEST_P(MoeCpuExpertsVsNaive, Matches) {
  const Case& c = GetParam();
  std::mt19937_64 rng(1234);
  const MoeShape& s = c.shape;
  std::vector<ExpertWeights> ex;
  for (int e = 0; e < s.num_experts; ++e) {
    ExpertWeights w;
    const float sd = 1.0f / std::sqrt(static_cast<float>(s.hidden));
    auto g = randn(s.intermediate * s.hidden, rng, sd), u = randn(g.size(), rng, sd);
    auto d = randn(s.hidden * s.intermediate, rng, 1.0f / std::sqrt(static_cast<float>(s.intermediate)));
    w.gate = quantize(c.format, g.data(), s.intermediate, s.hidden, c.group_size).value();
    w.up = quantize(c.format, u.data(), s.intermediate, s.hidden, c.group_size).value();
    w.down = quantize(c.format, d.data(), s.hidden, s.intermediate, c.group_size).value();
    ex.push_back(std::move(w));
  }
  auto x = randn(c.tokens * s.hidden, rng);
  std::vector<int32_t> ids(c.tokens * s.top_k);
  std::vector<float> w(ids.size());
  std::uniform_real_distribution<float> ud(0.0f, 1.0f);
  for (int64_t t = 0; t < c.tokens; ++t) {
    // distinct experts per token, as a router would give
    std::vector<int32_t> perm(s.num_experts);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int j = 0; j < s.top_k; ++j) {
      int32_t e = perm[j];
      if (c.routing == Case::kAllToOne) e = (s.num_experts - 1 + j) % s.num_experts;  // one hot expert set
      if (c.routing == Case::kHalfEmpty) e = perm[j] % std::max(1, s.num_experts / 2) * 2;  // odd experts empty
      ids[t * s.top_k + j] = e;
      w[t * s.top_k + j] = ud(rng);
    }
  }
  std::vector<float> out(c.tokens * s.hidden, std::nanf(""));  // poisoned
  ASSERT_TRUE(moe_experts_reference(s, ex, {}, x.data(), c.tokens, ids.data(), w.data(), out.data()).ok());
  const auto ref = naive_moe(s, ex, x, c.tokens, ids, w);
  double num = 0, den = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    ASSERT_FALSE(std::isnan(out[i])) << "unwritten output " << i;
    num += (out[i] - ref[i]) * (out[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  // Both accumulate in >= double and round h to bf16 identically; what remains is the fp32
  // rounding of g, u and y and a rare bf16 rounding flip of h, far below 1e-10 relative.
  EXPECT_LT(num / std::max(den, 1e-30), 1e-10) << c.name;
}

INSTANTIATE_TEST_SUITE_P(
    MoeCpu, MoeCpuExpertsVsNaive,
    ::testing::Values(
        Case{"tiny_f32", {8, 4, 4, 2}, 3, WeightFormat::kF32, 0, Case::kRandom},
        Case{"odd_f32", {13, 7, 5, 2}, 5, WeightFormat::kF32, 0, Case::kRandom},
        Case{"bf16", {64, 32, 8, 2}, 17, WeightFormat::kBF16, 0, Case::kRandom},
        Case{"nvfp4", {64, 32, 8, 2}, 9, WeightFormat::kNvFp4, 16, Case::kRandom},
        Case{"int4_g32", {128, 64, 8, 2}, 8, WeightFormat::kInt4, 32, Case::kRandom},
        Case{"int2_g128", {256, 128, 4, 2}, 4, WeightFormat::kInt2, 128, Case::kRandom},
        Case{"int8_perchannel", {64, 64, 4, 1}, 3, WeightFormat::kInt8, -1, Case::kRandom},
        Case{"all_to_one_expert", {32, 16, 16, 1}, 64, WeightFormat::kNvFp4, 16, Case::kAllToOne},
        Case{"empty_experts", {32, 16, 16, 4}, 33, WeightFormat::kInt4, 16 * 2, Case::kHalfEmpty},
        Case{"single_token_k8", {64, 32, 64, 8}, 1, WeightFormat::kInt4, 32, Case::kRandom}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(MoeCpuExperts, QuantizedEqualsItsDequantizedF32) {
  // The reference must see a quantized matrix exactly as its dequantized fp32 values.
  std::mt19937_64 rng(7);
  MoeShape s{64, 32, 4, 2};
  std::vector<ExpertWeights> q, f;
  for (int e = 0; e < s.num_experts; ++e) {
    ExpertWeights wq, wf;
    for (auto [m, rows, cols] : {std::tuple{&wq.gate, s.intermediate, s.hidden}, std::tuple{&wq.up, s.intermediate, s.hidden},
                                 std::tuple{&wq.down, s.hidden, s.intermediate}}) {
      auto w = randn(rows * cols, rng, 0.1f);
      *m = quantize(WeightFormat::kNvFp4, w.data(), rows, cols, 16).value();
      std::vector<float> deq(rows * cols);
      dequantize_rows(*m, 0, rows, deq.data());
      QuantMatrix fm = f32_matrix(deq, rows, cols);
      if (m == &wq.gate) wf.gate = fm;
      else if (m == &wq.up) wf.up = fm;
      else wf.down = fm;
    }
    q.push_back(wq);
    f.push_back(wf);
  }
  auto x = randn(5 * s.hidden, rng);
  std::vector<int32_t> ids = {0, 1, 2, 3, 3, 0, 1, 2, 0, 3};
  std::vector<float> w = {0.6f, 0.4f, 0.5f, 0.5f, 0.9f, 0.1f, 0.3f, 0.7f, 0.2f, 0.8f};
  std::vector<float> a(5 * s.hidden), b(a.size());
  ASSERT_TRUE(moe_experts_reference(s, q, {}, x.data(), 5, ids.data(), w.data(), a.data()).ok());
  ASSERT_TRUE(moe_experts_reference(s, f, {}, x.data(), 5, ids.data(), w.data(), b.data()).ok());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
}

TEST(MoeCpuExperts, BitIdenticalAcrossRunsAndThreadCounts) {
  std::mt19937_64 rng(99);
  MoeShape s{48, 24, 16, 4};
  std::vector<ExpertWeights> ex;
  for (int e = 0; e < s.num_experts; ++e) {
    auto g = randn(s.intermediate * s.hidden, rng, 0.2f), u = randn(g.size(), rng, 0.2f);
    auto d = randn(s.hidden * s.intermediate, rng, 0.2f);
    ex.push_back({quantize(WeightFormat::kInt4, g.data(), s.intermediate, s.hidden, 16).value(),
                  quantize(WeightFormat::kInt4, u.data(), s.intermediate, s.hidden, 16).value(),
                  quantize(WeightFormat::kInt4, d.data(), s.hidden, s.intermediate, 8).value()});
  }
  const int64_t T = 100;
  auto x = randn(T * s.hidden, rng);
  std::vector<int32_t> ids(T * s.top_k);
  std::vector<float> w(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    ids[i] = static_cast<int32_t>((i * 7 + i / 4) % s.num_experts);
    w[i] = 0.25f;
  }
  std::vector<float> first(T * s.hidden);
  ASSERT_TRUE(moe_experts_reference(s, ex, {}, x.data(), T, ids.data(), w.data(), first.data()).ok());
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    std::vector<float> again(first.size());
    ASSERT_TRUE(moe_experts_reference(s, ex, {}, x.data(), T, ids.data(), w.data(), again.data()).ok());
    EXPECT_EQ(0, std::memcmp(first.data(), again.data(), first.size() * sizeof(float))) << threads << " threads";
  }
  omp_set_num_threads(omp_get_num_procs());
}

TEST(MoeCpuExperts, BadInputsAreErrors) {
  MoeShape s{8, 4, 2, 1};
  std::vector<float> z(32, 0.5f);
  std::vector<ExpertWeights> ex(2, {f32_matrix(z, 4, 8), f32_matrix(z, 4, 8), f32_matrix(z, 8, 4)});
  std::vector<float> x(8, 1.0f), out(8);
  const float w[1] = {1.0f};
  const int32_t bad_id[1] = {2};
  auto st = moe_experts_reference(s, ex, {}, x.data(), 1, bad_id, w, out.data());
  ASSERT_FALSE(st.ok());
  EXPECT_THAT(st.error().what(), HasSubstr("expert 2"));
  ex[1].down = f32_matrix(z, 4, 8);  // transposed down projection
  const int32_t ok_id[1] = {0};
  st = moe_experts_reference(s, ex, {}, x.data(), 1, ok_id, w, out.data());
  ASSERT_FALSE(st.ok());
  EXPECT_THAT(st.error().what(), HasSubstr("down_proj"));
  ex.pop_back();
  EXPECT_THAT(moe_experts_reference(s, ex, {}, x.data(), 1, ok_id, w, out.data()).error().what(),
              HasSubstr("1 experts given"));
}

// ---- whole layer -----------------------------------------------------------------------------
TEST(MoeCpuLayer, RouterThenExpertsMatchesManualComposition) {
  std::mt19937_64 rng(5);
  MoeLayerReference L;
  L.shape = {32, 16, 8, 2};
  L.router.num_experts = 8;
  L.router.top_k = 2;
  L.router_weight = randn(8 * 32, rng, 0.3f);
  for (int e = 0; e < 8; ++e) {
    auto g = randn(16 * 32, rng, 0.2f), u = randn(16 * 32, rng, 0.2f), d = randn(32 * 16, rng, 0.2f);
    L.experts.push_back({f32_matrix(g, 16, 32), f32_matrix(u, 16, 32), f32_matrix(d, 32, 16)});
  }
  const int64_t T = 11;
  auto x = randn(T * 32, rng);
  std::vector<float> out(T * 32), logits(T * 8), w(T * 2), w2(T * 2), out2(T * 32);
  std::vector<int32_t> ids(T * 2), ids2(T * 2);
  ASSERT_TRUE(L.forward(x.data(), T, out.data(), ids.data(), w.data()).ok());
  router_logits_reference(L.router_weight.data(), x.data(), T, 32, 8, logits.data());
  ASSERT_TRUE(route_reference(L.router, logits.data(), T, ids2.data(), w2.data()).ok());
  EXPECT_EQ(ids, ids2);
  ASSERT_TRUE(moe_experts_reference(L.shape, L.experts, L.options, x.data(), T, ids2.data(), w2.data(), out2.data()).ok());
  EXPECT_EQ(0, std::memcmp(out.data(), out2.data(), out.size() * sizeof(float)));
  // Every token's weights are a renormalised top-2: they sum to 1.
  for (int64_t t = 0; t < T; ++t) EXPECT_NEAR(w[t * 2] + w[t * 2 + 1], 1.0f, 1e-6f);
}

}  // namespace
}  // namespace moebius::cpu
