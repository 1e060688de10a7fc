// The teacher-forced logprob oracle (model/eval_logprobs.h) on the CUDA runner, against the tiny
// fixture's transformers-derived dump (tests/data/tiny-qwen3-moe/logprobs_ref.safetensors, see
// tests/test_eval_logprobs.cpp).
//
// Bound: |Δlogprob| <= |Δlogit at the target| + |Δlogsumexp| <= 2 max |Δlogit|. The runner matched
// transformers' fp32 logits to max |Δlogit| ~0.022 on this fixture (test_qwen3_moe_cuda.cu bounds
// it by kBf16Tol = 0.1), so kLogprobTol = 2 * 0.1 = 0.2; the test prints the measured value.
// Chunked (the KV cache kept between chunks) vs one prefill: cuBLAS picks other kernels for
// other M, bf16 rounding of GEMM outputs only: 2 * kBatchTol (0.02) = 0.04.
#include "gpu/gpu_test_util.h"  // first: it makes fmt compile under nvcc

#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <vector>

#include "model/eval_logprobs.h"
#include "model/qwen3_moe_cuda.h"
#include "test_util.h"

namespace moebius::model {
namespace {

constexpr double kLogprobTol = 0.2, kChunkTol = 0.04;

std::string fixture_dir() { return testing::test_data_dir() + "/tiny-qwen3-moe"; }

std::unique_ptr<Qwen3MoeCuda> load(int max_tokens, std::optional<WeightFormat> experts = {}) {
  Qwen3MoeCudaOptions o;
  o.experts_format = experts;
  o.max_tokens = max_tokens;
  o.max_logit_rows = max_tokens;
  o.max_seqs = 1;
  o.max_context = 64;
  o.graph_batches = {1};
  auto m = Qwen3MoeCuda::load(fixture_dir(), o);
  EXPECT_TRUE(m.ok()) << m.error().what();
  return m.ok() ? std::move(m).value() : nullptr;
}

TEST(EvalLogprobsCuda, Bf16MatchesTransformers) {
  MOEBIUS_REQUIRE_GPU();
  auto ref = read_logprob_dump(fixture_dir() + "/logprobs_ref.safetensors");
  ASSERT_TRUE(ref.ok()) << ref.error().what();
  auto m = load(32);
  ASSERT_TRUE(m);
  auto got = teacher_forced_logprobs(*m, ref->input_ids);
  ASSERT_TRUE(got.ok()) << got.error().what();
  auto cmp = compare_logprobs(*got, ref->logprobs);
  ASSERT_TRUE(cmp.ok());
  std::printf("cuda bf16 vs transformers: mean |dlogprob| %.4g, max %.4g at %lld\n", cmp->mean_abs_delta,
              cmp->max_abs_delta, static_cast<long long>(cmp->max_index));
  EXPECT_LE(cmp->max_abs_delta, kLogprobTol);

  // Chunks of 7 tokens through a runner of max_tokens 7.
  auto chunked = load(7);
  ASSERT_TRUE(chunked);
  auto c = teacher_forced_logprobs(*chunked, ref->input_ids);
  ASSERT_TRUE(c.ok()) << c.error().what();
  auto d = compare_logprobs(*c, *got);
  ASSERT_TRUE(d.ok());
  std::printf("cuda chunk 7 vs one prefill: max |dlogprob| %.4g\n", d->max_abs_delta);
  EXPECT_LE(d->max_abs_delta, kChunkTol);
}

TEST(EvalLogprobsCuda, RunEvalLogprobsOnTheCudaBackend) {
  MOEBIUS_REQUIRE_GPU();
  auto ref = read_logprob_dump(fixture_dir() + "/logprobs_ref.safetensors");
  ASSERT_TRUE(ref.ok());
  EvalLogprobsOptions o;
  o.model_dir = fixture_dir();
  o.backend = "cuda";
  o.chunk = 5;
  auto got = run_eval_logprobs(o, ref->input_ids);
  ASSERT_TRUE(got.ok()) << got.error().what();
  auto cmp = compare_logprobs(*got, ref->logprobs);
  ASSERT_TRUE(cmp.ok());
  std::printf("run_eval_logprobs cuda (chunk 5): max |dlogprob| %.4g\n", cmp->max_abs_delta);
  EXPECT_LE(cmp->max_abs_delta, kLogprobTol);
  // nvfp4 experts: nonzero, finite.
  o.experts = "nvfp4";
  auto fp4 = run_eval_logprobs(o, ref->input_ids);
  ASSERT_TRUE(fp4.ok()) << fp4.error().what();
  auto q = compare_logprobs(*fp4, *got);
  ASSERT_TRUE(q.ok());
  std::printf("cuda nvfp4 vs cuda bf16: max |dlogprob| %.4g\n", q->max_abs_delta);
  EXPECT_GT(q->max_abs_delta, 0.0);
  EXPECT_LT(q->max_abs_delta, 1.0);
}

}  // namespace
}  // namespace moebius::model
