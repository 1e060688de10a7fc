// The CUDA Qwen3-MoE runner (src/model/qwen3_moe_cuda.h) end to end on the tiny fixture
// (tests/data/tiny-qwen3-moe: 3 layers, layer 1 dense, H=64, 16 experts top-4, hd 16, V=512).
//
// References:
//  - HF transformers' fp32 logits (reference.safetensors: `logits` of the 20-token prefill,
//    `decode_logits` of prefill 12 + teacher-forced decode at positions 11..18), for bf16 experts;
//  - the CPU backend (Qwen3MoeCpu, fp32) loaded with the SAME expert format, for bf16 and for the
//    online-quantized nvfp4 / int4 / int2 experts (the CPU backend is the oracle for quantized
//    formats; it rounds the SwiGLU intermediate to bf16 as the GPU kernels do).
//
// Tolerances (max |Δlogit| over every logit; the fixture's logits span about ±4.1):
//  - The GPU path rounds every activation that enters a GEMM to bf16 (the residual stays fp32).
//    transformers run entirely in bf16 deviates from its own fp32 run by 0.039 at most on this
//    fixture (logits_bf16 vs logits), and our path rounds less than that; kBf16Tol = 0.1 (2.4% of
//    the logit range) leaves room for a top-k routing near-tie resolved differently, and nmse over
//    all logits <= 1e-3 keeps the bulk honest.
//  - Quantized experts against the CPU backend with the same codes: the same bf16 activation
//    rounding, plus the router seeing bf16 instead of fp32 inputs: kQuantTol = 0.15, nmse <= 1e-3.
//  - The argmax must agree wherever the reference's top-1 margin exceeds 2 * tolerance.
// These bounds are first estimates made without a GPU run; the tests print the measured values.
// Batching: a sequence's logits in a batch of two vs alone differ only by cuBLAS picking other
// kernels for other M (bf16 rounding of GEMM outputs): kBatchTol = 0.02.
#include "gpu/gpu_test_util.h"  // first: it makes fmt compile under nvcc

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "formats/safetensors.h"
#include "model/block_allocator.h"
#include "model/qwen3_moe_cpu.h"
#include "model/qwen3_moe_cuda.h"
#include "model/step_batch.h"
#include "test_util.h"
#include "tiny_fixture.h"

namespace moebius::model {
namespace {

constexpr int kPrompt = 12;  // the fixture's decode reference: prefill 12, then 7 single steps
constexpr float kBf16Tol = 0.1f, kQuantTol = 0.15f, kBatchTol = 0.02f;
constexpr double kMaxNmse = 1e-3;

std::string fixture_dir() { return testing::test_data_dir() + "/tiny-qwen3-moe"; }

using Reference = testing::TinyReference;
Reference load_reference() { return testing::load_tiny_reference(); }

float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  float m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

// Compares logits [rows, V] with a reference: max |Δ|, nmse, all finite, and argmax where the
// reference is decisive.
void expect_close(const char* what, const std::vector<float>& got, const std::vector<float>& want, int64_t V,
                  float tol) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (float x : got) ASSERT_TRUE(std::isfinite(x)) << what << ": non-finite logit";
  const float d = max_abs_diff(got, want);
  const double e = testing::nmse(got.data(), want.data(), got.size());
  std::printf("%-44s max |dlogit| %.4g  nmse %.3g\n", what, d, e);
  EXPECT_LE(d, tol) << what;
  EXPECT_LE(e, kMaxNmse) << what;
  const int64_t rows = static_cast<int64_t>(got.size()) / V;
  for (int64_t r = 0; r < rows; ++r) {
    const float* w = want.data() + r * V;
    const float* g = got.data() + r * V;
    const int64_t top = std::max_element(w, w + V) - w;
    float second = -1e30f;
    for (int64_t i = 0; i < V; ++i)
      if (i != top) second = std::max(second, w[i]);
    if (w[top] - second > 2 * tol) EXPECT_EQ(std::max_element(g, g + V) - g, top) << what << " row " << r;
  }
}

Qwen3MoeCudaOptions tiny_options(std::optional<WeightFormat> experts, int block_size = 16) {
  Qwen3MoeCudaOptions o;
  o.experts_format = experts;
  o.experts_group_size = 32;  // int formats: H = 64 and I = 32 hold no group of 128
  o.max_tokens = 32;
  o.max_seqs = 2;
  o.max_logit_rows = 32;
  o.max_context = 64;
  o.block_size = block_size;
  o.graph_batches = {1, 2};
  return o;
}

std::unique_ptr<Qwen3MoeCuda> load_cuda(const Qwen3MoeCudaOptions& o) {
  auto m = Qwen3MoeCuda::load(fixture_dir(), o);
  EXPECT_TRUE(m.ok()) << m.error().what();
  return m.ok() ? std::move(m).value() : nullptr;
}

Qwen3MoeCpu load_cpu(std::optional<WeightFormat> experts, bool round_intermediate) {
  Qwen3MoeLoadOptions o;
  o.experts_format = experts;
  o.experts_group_size = 32;
  o.round_intermediate_to_bf16 = round_intermediate;
  auto m = Qwen3MoeCpu::load(fixture_dir(), o);
  EXPECT_TRUE(m.ok()) << m.error().what();
  return std::move(m).value();
}

// One sequence on the CUDA runner: the prefill of `ids` with every row's logits.
std::vector<float> cuda_prefill_all(Qwen3MoeCuda& m, const std::vector<int32_t>& ids) {
  BlockAllocator blocks(m.num_blocks());
  std::vector<int32_t> table;
  EXPECT_TRUE(blocks.ensure(table, static_cast<int64_t>(ids.size()), m.block_size()).ok());
  const SequenceStep seq{ids, 0, table};
  auto b = m.make_batch(std::span<const SequenceStep>(&seq, 1), /*all_logits=*/true);
  EXPECT_TRUE(b.ok()) << b.error().what();
  std::vector<float> logits(ids.size() * static_cast<size_t>(m.config().vocab_size));
  const Status st = m.forward(*b, logits.data());
  EXPECT_TRUE(st.ok()) << st.error().what();
  return logits;
}

// Prefill kPrompt, then teacher-forced decode of ids[kPrompt .. 18]: 8 rows of logits (positions
// 11..18), as the fixture's decode_logits.
std::vector<float> cuda_decode_8(Qwen3MoeCuda& m, const std::vector<int32_t>& ids) {
  const size_t V = static_cast<size_t>(m.config().vocab_size);
  BlockAllocator blocks(m.num_blocks());
  std::vector<int32_t> table;
  EXPECT_TRUE(blocks.ensure(table, kPrompt + 7, m.block_size()).ok());
  std::vector<float> out, step(V);
  const SequenceStep pre{std::span<const int32_t>(ids.data(), kPrompt), 0, table};
  auto b = m.make_batch(std::span<const SequenceStep>(&pre, 1));
  EXPECT_TRUE(b.ok());
  EXPECT_TRUE(m.forward(*b, step.data()).ok());
  out.insert(out.end(), step.begin(), step.end());
  for (int i = 0; i < 7; ++i) {
    const SequenceStep s{std::span<const int32_t>(ids.data() + kPrompt + i, 1), kPrompt + i, table};
    auto d = m.make_batch(std::span<const SequenceStep>(&s, 1));
    EXPECT_TRUE(d.ok());
    EXPECT_TRUE(m.forward(*d, step.data()).ok());
    out.insert(out.end(), step.begin(), step.end());
  }
  return out;
}

std::vector<float> cpu_prefill_all(const Qwen3MoeCpu& m, const std::vector<int32_t>& ids) {
  KvCache cache = m.make_cache(64);
  std::vector<float> logits(ids.size() * static_cast<size_t>(m.config().vocab_size));
  EXPECT_TRUE(m.forward(ids.data(), static_cast<int>(ids.size()), cache, logits.data()).ok());
  return logits;
}

std::vector<float> cpu_decode_8(const Qwen3MoeCpu& m, const std::vector<int32_t>& ids) {
  const size_t V = static_cast<size_t>(m.config().vocab_size);
  KvCache cache = m.make_cache(64);
  std::vector<float> pre(kPrompt * V), step(V);
  EXPECT_TRUE(m.forward(ids.data(), kPrompt, cache, pre.data()).ok());
  std::vector<float> out(pre.end() - static_cast<int64_t>(V), pre.end());
  for (int i = 0; i < 7; ++i) {
    EXPECT_TRUE(m.forward(ids.data() + kPrompt + i, 1, cache, step.data()).ok());
    out.insert(out.end(), step.begin(), step.end());
  }
  return out;
}

TEST(Qwen3MoeCuda, Bf16ExpertsMatchTransformersAndTheCpuBackend) {
  MOEBIUS_REQUIRE_GPU();
  const Reference ref = load_reference();
  for (int block_size : {16, 5}) {
    SCOPED_TRACE(::testing::Message() << "block_size " << block_size);
    auto m = load_cuda(tiny_options(WeightFormat::kBF16, block_size));
    ASSERT_TRUE(m);
    EXPECT_EQ(m->config().vocab_size, ref.vocab);
    const std::vector<float> pre = cuda_prefill_all(*m, ref.ids);
    expect_close("bf16 prefill vs transformers fp32", pre, ref.logits, ref.vocab, kBf16Tol);
    const int64_t graphs_before = m->graph_steps();
    const std::vector<float> dec = cuda_decode_8(*m, ref.ids);
    expect_close("bf16 decode (graph) vs transformers fp32", dec, ref.decode_logits, ref.vocab, kBf16Tol);
    EXPECT_EQ(m->graph_steps() - graphs_before, 6);  // the first decode step runs eagerly and captures

    const Qwen3MoeCpu cpu = load_cpu(WeightFormat::kBF16, /*round_intermediate=*/true);
    expect_close("bf16 prefill vs CPU backend", pre, cpu_prefill_all(cpu, ref.ids), ref.vocab, kBf16Tol);
    expect_close("bf16 decode vs CPU backend", dec, cpu_decode_8(cpu, ref.ids), ref.vocab, kBf16Tol);
  }
}

// YaRN (config.json rope_scaling, model/rope_frequencies.h): its frequencies go to the CUDA rope
// and attention kernels as uploaded inv_freq, its attention factor into the q/k norm weights; the
// runner must match the CPU backend (prefill and graph decode) and transformers' YaRN logits
// (reference_yarn.safetensors, the next test), with the bf16 tolerance above.
TEST(Qwen3MoeCuda, YarnRopeScalingMatchesTheCpuBackend) {
  MOEBIUS_REQUIRE_GPU();
  const Reference ref = load_reference();
  const testing::TinyYarnFixture yarn;
  auto loaded = Qwen3MoeCuda::load(yarn.dir(), tiny_options(WeightFormat::kBF16));
  ASSERT_TRUE(loaded.ok()) << loaded.error().what();
  Qwen3MoeCuda& m = **loaded;
  const std::vector<float> pre = cuda_prefill_all(m, ref.ids);
  Qwen3MoeLoadOptions co;
  co.experts_format = WeightFormat::kBF16;
  co.round_intermediate_to_bf16 = true;
  auto cpu = Qwen3MoeCpu::load(yarn.dir(), co);
  ASSERT_TRUE(cpu.ok()) << cpu.error().what();
  const std::vector<float> cpu_pre = cpu_prefill_all(*cpu, ref.ids);
  expect_close("yarn bf16 prefill vs CPU backend", pre, cpu_pre, ref.vocab, kBf16Tol);
  expect_close("yarn bf16 decode (graph) vs CPU backend", cuda_decode_8(m, ref.ids), cpu_decode_8(*cpu, ref.ids),
               ref.vocab, kBf16Tol);
  // Not the plain model's logits: the GPU moves as far from them as the CPU backend does.
  const float gpu_moved = max_abs_diff(pre, ref.logits), cpu_moved = max_abs_diff(cpu_pre, ref.logits);
  std::printf("yarn vs plain logits: GPU %.4g, CPU %.4g\n", gpu_moved, cpu_moved);
  EXPECT_GT(gpu_moved, 0.5f * cpu_moved) << "YaRN did not take effect on the GPU";
}

TEST(Qwen3MoeCuda, YarnRopeScalingMatchesTransformers) {
  MOEBIUS_REQUIRE_GPU();
  const std::vector<float> hf = testing::TinyYarnFixture::reference_logits();
  ASSERT_FALSE(hf.empty()) << testing::TinyYarnFixture::reference_path()
                           << " (committed; gpu.sh's rope-scaling-ref step remakes it)";
  const Reference ref = load_reference();
  const testing::TinyYarnFixture yarn;
  auto loaded = Qwen3MoeCuda::load(yarn.dir(), tiny_options(WeightFormat::kBF16));
  ASSERT_TRUE(loaded.ok()) << loaded.error().what();
  expect_close("yarn bf16 prefill vs transformers fp32", cuda_prefill_all(**loaded, ref.ids), hf, ref.vocab, kBf16Tol);
}

TEST(Qwen3MoeCuda, QuantizedExpertsMatchTheCpuBackend) {
  MOEBIUS_REQUIRE_GPU();
  const Reference ref = load_reference();
  for (WeightFormat f : {WeightFormat::kNvFp4, WeightFormat::kInt4, WeightFormat::kInt2}) {
    const std::string name(weight_format_name(f));
    SCOPED_TRACE(name);
    auto m = load_cuda(tiny_options(f));
    ASSERT_TRUE(m);
    const Qwen3MoeCpu cpu = load_cpu(f, /*round_intermediate=*/true);
    expect_close((name + " prefill vs CPU backend").c_str(), cuda_prefill_all(*m, ref.ids),
                 cpu_prefill_all(cpu, ref.ids), ref.vocab, kQuantTol);
    expect_close((name + " decode (graph) vs CPU backend").c_str(), cuda_decode_8(*m, ref.ids),
                 cpu_decode_8(cpu, ref.ids), ref.vocab, kQuantTol);
  }
}

// A small Qwen3-MoE geometry for dummy weights (H = 256, 8 heads of 64 over 2 KV heads, 16 experts
// of 128, top-4, a vocabulary of 1000) with `layers` layers, `dense` of them dense MLPs.
Qwen3MoeConfig small_dummy_config(int layers, std::vector<int> dense) {
  Qwen3MoeConfig c;
  c.vocab_size = 1000;
  c.hidden_size = 256;
  c.num_hidden_layers = layers;
  c.num_attention_heads = 8;
  c.num_key_value_heads = 2;
  c.head_dim = 64;
  c.rope_theta = 1e6;
  c.num_experts = 16;
  c.num_experts_per_tok = 4;
  c.moe_intermediate_size = 128;
  c.intermediate_size = 256;
  c.norm_topk_prob = true;
  c.mlp_only_layers = std::move(dense);
  c.max_position_embeddings = 512;
  return c;
}

// Two sequences decoded together for `steps` steps after their prefill (a: ids[0..12), b: ids[5..12)),
// the logits of every step [steps][2][V]: the batch-2 graph (its first step eager, then replays).
std::vector<float> cuda_decode_pair(Qwen3MoeCuda& m, const std::vector<int32_t>& ids, int steps) {
  const size_t V = static_cast<size_t>(m.config().vocab_size);
  const std::vector<int32_t> a(ids.begin(), ids.begin() + 12), b(ids.begin() + 5, ids.begin() + 12);
  BlockAllocator blocks(m.num_blocks());
  std::vector<int32_t> ta, tb;
  EXPECT_TRUE(blocks.ensure(ta, 12 + steps, m.block_size()).ok());
  EXPECT_TRUE(blocks.ensure(tb, 7 + steps, m.block_size()).ok());
  const SequenceStep both[] = {{a, 0, ta}, {b, 0, tb}};
  auto batch = m.make_batch(both);
  EXPECT_TRUE(batch.ok());
  std::vector<float> lg(2 * V), out;
  EXPECT_TRUE(m.forward(*batch, lg.data()).ok());
  for (int s = 0; s < steps; ++s) {
    const int32_t next[] = {ids[static_cast<size_t>(12 + s)], ids[static_cast<size_t>(13 + s)]};
    const SequenceStep d[] = {{std::span<const int32_t>(&next[0], 1), 12 + s, ta},
                              {std::span<const int32_t>(&next[1], 1), 7 + s, tb}};
    auto db = m.make_batch(d);
    EXPECT_TRUE(db.ok());
    EXPECT_TRUE(m.forward(*db, lg.data()).ok());
    out.insert(out.end(), lg.begin(), lg.end());
  }
  return out;
}

// The logits with the combine folded (`folded`) against the combine stage's (`plain`): all
// finite and the same bits.
void expect_same_logits_when_folded(const std::vector<float>& plain, const std::vector<float>& folded) {
  ASSERT_EQ(plain.size(), folded.size());
  for (float x : folded) ASSERT_TRUE(std::isfinite(x));
  EXPECT_EQ(std::memcmp(plain.data(), folded.data(), plain.size() * sizeof(float)), 0)
      << "the folded combine changed the logits (max |d| " << max_abs_diff(plain, folded) << ")";
}

// [TAG_MOE_DEFERRED_COMBINE] Each MoE layer's combine folded into the next layer's qkv GEMV
// (fold_moe_combine_max_rows 2) against the combine stage (0): the same logits bit for bit in an
// eager two-token prefill, the batch-1 teacher-forced decode (graph replays) and the batch-2
// decode, for bf16 and nvfp4 experts; and the fold must have happened (a count of zero would make
// the comparison vacuous).
TEST(Qwen3MoeCuda, FoldedMoeCombineKeepsLogitsBitIdentical) {
  MOEBIUS_REQUIRE_GPU();
  const Reference ref = load_reference();
  for (WeightFormat f : {WeightFormat::kBF16, WeightFormat::kNvFp4}) {
    SCOPED_TRACE(std::string(weight_format_name(f)));
    std::vector<float> logits[2];
    int64_t folded[2] = {0, 0};
    for (int on = 0; on < 2; ++on) {
      Qwen3MoeCudaOptions o = tiny_options(f);
      o.fold_moe_combine_max_rows = on != 0 ? 2 : 0;
      auto m = load_cuda(o);
      ASSERT_TRUE(m);
      const std::vector<int32_t> two(ref.ids.begin(), ref.ids.begin() + 2);
      logits[on] = cuda_prefill_all(*m, two);
      const std::vector<float> single = cuda_decode_8(*m, ref.ids), pair = cuda_decode_pair(*m, ref.ids, 3);
      logits[on].insert(logits[on].end(), single.begin(), single.end());
      logits[on].insert(logits[on].end(), pair.begin(), pair.end());
      EXPECT_GE(m->graph_steps(), 4);
      folded[on] = m->folded_moe_combines();
    }
    EXPECT_EQ(folded[0], 0);
    EXPECT_GT(folded[1], 0);
    expect_same_logits_when_folded(logits[0], logits[1]);
  }
}

// The same on a dummy geometry whose layers are all MoE, as Qwen3-30B-A3B's are (the tiny fixture's
// only fold is MoE layer 0 into dense layer 1): MoE -> MoE boundaries, one live sequence in the
// batch-2 graph (a padding row, whose delta the fold sets to zero) and then two live ones.
TEST(Qwen3MoeCuda, FoldedMoeCombineAcrossMoeLayersAndPaddedGraphs) {
  MOEBIUS_REQUIRE_GPU();
  const Qwen3MoeConfig c = small_dummy_config(4, {});
  for (moe::KernelFormat f : {moe::KernelFormat::kBF16, moe::KernelFormat::kNvFp4}) {
    SCOPED_TRACE(moe::kernel_format_name(f));
    std::vector<float> logits[2];
    int64_t folded[2] = {0, 0};
    for (int on = 0; on < 2; ++on) {
      Qwen3MoeCudaOptions o;
      o.max_tokens = 64;
      o.max_seqs = 2;
      o.max_context = 128;
      o.graph_batches = {2};
      o.fold_moe_combine_max_rows = on != 0 ? 2 : 0;
      auto m = Qwen3MoeCuda::create_dummy(c, f, o);
      ASSERT_TRUE(m.ok()) << m.error().what();
      BlockAllocator blocks((*m)->num_blocks());
      std::vector<int32_t> ta, tb;
      ASSERT_TRUE(blocks.ensure(ta, 40, (*m)->block_size()).ok());
      ASSERT_TRUE(blocks.ensure(tb, 40, (*m)->block_size()).ok());
      std::vector<int32_t> ids(30);
      for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i * 37 + 11) % 1000);
      std::vector<float> lg(2 * 1000);
      for (std::vector<int32_t>* t : {&ta, &tb}) {
        const SequenceStep pre{ids, 0, *t};
        auto b = (*m)->make_batch(std::span<const SequenceStep>(&pre, 1));
        ASSERT_TRUE(b.ok());
        ASSERT_TRUE((*m)->forward(*b, lg.data()).ok());
      }
      for (int s = 0; s < 6; ++s) {
        const int32_t id[2] = {7 + s, 500 + s};
        const int64_t pos = 30 + s;
        std::vector<SequenceStep> d = {{std::span<const int32_t>(&id[0], 1), pos, ta}};
        if (s >= 3) d.push_back({std::span<const int32_t>(&id[1], 1), pos - 3, tb});  // two live from step 3
        auto db = (*m)->make_batch(d);
        ASSERT_TRUE(db.ok());
        ASSERT_TRUE((*m)->forward(*db, lg.data()).ok());
        logits[on].insert(logits[on].end(), lg.begin(), lg.begin() + static_cast<int64_t>(d.size()) * 1000);
      }
      EXPECT_GE((*m)->graph_steps(), 4);
      folded[on] = (*m)->folded_moe_combines();
    }
    EXPECT_EQ(folded[0], 0);
    EXPECT_GE(folded[1], 3) << "every MoE layer but the last folds in each captured or eager step";
    expect_same_logits_when_folded(logits[0], logits[1]);
  }
}

TEST(Qwen3MoeCuda, ABatchOfTwoMatchesEachSequenceAlone) {
  MOEBIUS_REQUIRE_GPU();
  const Reference ref = load_reference();
  auto m = load_cuda(tiny_options(WeightFormat::kBF16));
  ASSERT_TRUE(m);
  const int64_t V = ref.vocab;
  const std::vector<int32_t> a(ref.ids.begin(), ref.ids.begin() + 12), b(ref.ids.begin() + 5, ref.ids.begin() + 12);
  BlockAllocator blocks(m->num_blocks());
  std::vector<int32_t> ta, tb;
  ASSERT_TRUE(blocks.ensure(ta, 13, m->block_size()).ok());
  ASSERT_TRUE(blocks.ensure(tb, 8, m->block_size()).ok());
  // Prefill both in one step: the last logits of each.
  const SequenceStep both[] = {{a, 0, ta}, {b, 0, tb}};
  auto batch = m->make_batch(both);
  ASSERT_TRUE(batch.ok()) << batch.error().what();
  std::vector<float> together(2 * static_cast<size_t>(V));
  ASSERT_TRUE(m->forward(*batch, together.data()).ok());
  // One decode step of both (the batch-2 graph's first, eager step), then a second (replay).
  const int32_t next[] = {ref.ids[12], ref.ids[13]};
  std::vector<float> dec_together;
  for (int s = 0; s < 2; ++s) {
    const SequenceStep d[] = {{std::span<const int32_t>(&next[s], 1), 12 + s, ta},
                              {std::span<const int32_t>(&next[s], 1), 7 + s, tb}};
    std::vector<float> lg(2 * static_cast<size_t>(V));
    auto db = m->make_batch(d);
    ASSERT_TRUE(db.ok());
    ASSERT_TRUE(m->forward(*db, lg.data()).ok());
    dec_together.insert(dec_together.end(), lg.begin(), lg.end());
  }
  EXPECT_GE(m->graph_steps(), 1);
  // Each alone, in fresh blocks.
  for (int which = 0; which < 2; ++which) {
    const std::vector<int32_t>& ids = which == 0 ? a : b;
    std::vector<int32_t> t;
    ASSERT_TRUE(blocks.ensure(t, static_cast<int64_t>(ids.size()) + 2, m->block_size()).ok());
    const SequenceStep one{ids, 0, t};
    std::vector<float> alone(static_cast<size_t>(V));
    auto ob = m->make_batch(std::span<const SequenceStep>(&one, 1));
    ASSERT_TRUE(ob.ok());
    ASSERT_TRUE(m->forward(*ob, alone.data()).ok());
    const std::vector<float> got(together.begin() + which * V, together.begin() + (which + 1) * V);
    expect_close(which == 0 ? "batched prefill, sequence 0 vs alone" : "batched prefill, sequence 1 vs alone", got,
                 alone, V, kBatchTol);
    for (int s = 0; s < 2; ++s) {
      const SequenceStep d{std::span<const int32_t>(&next[s], 1), static_cast<int64_t>(ids.size()) + s, t};
      auto db = m->make_batch(std::span<const SequenceStep>(&d, 1));
      ASSERT_TRUE(db.ok());
      ASSERT_TRUE(m->forward(*db, alone.data()).ok());
      const size_t off = (static_cast<size_t>(s) * 2 + which) * V;
      const std::vector<float> g(dec_together.begin() + static_cast<int64_t>(off),
                                 dec_together.begin() + static_cast<int64_t>(off + V));
      expect_close("batched decode vs alone", g, alone, V, kBatchTol);
    }
    blocks.release(t);
  }
}

TEST(Qwen3MoeCuda, RefusesStepsPastItsCapacities) {
  MOEBIUS_REQUIRE_GPU();
  auto m = load_cuda(tiny_options(WeightFormat::kBF16));
  ASSERT_TRUE(m);
  BlockAllocator blocks(m->num_blocks());
  std::vector<int32_t> table;
  ASSERT_TRUE(blocks.ensure(table, 64, m->block_size()).ok());
  std::vector<float> logits(64 * 512);
  const std::vector<int32_t> too_many(33, 1), bad_id{1, 512};
  const SequenceStep s1{too_many, 0, table};
  auto b1 = m->make_batch(std::span<const SequenceStep>(&s1, 1));
  ASSERT_TRUE(b1.ok());
  EXPECT_FALSE(m->forward(*b1, logits.data()).ok());  // 33 tokens > max_tokens 32
  const SequenceStep s2{bad_id, 0, table};
  auto b2 = m->make_batch(std::span<const SequenceStep>(&s2, 1));
  ASSERT_TRUE(b2.ok());
  EXPECT_FALSE(m->forward(*b2, logits.data()).ok());  // id 512 outside V
  const std::vector<int32_t> one{1};
  const SequenceStep s3{one, 64, table};  // position 64: past max_context and the table
  EXPECT_FALSE(m->make_batch(std::span<const SequenceStep>(&s3, 1)).ok());
}

TEST(Qwen3MoeCuda, DummyWeightsRunEveryFormat) {
  MOEBIUS_REQUIRE_GPU();
  // A small geometry with the real model's structure (a dense layer too).
  const Qwen3MoeConfig c = small_dummy_config(3, {1});
  for (moe::KernelFormat f :
       {moe::KernelFormat::kBF16, moe::KernelFormat::kNvFp4, moe::KernelFormat::kInt4, moe::KernelFormat::kInt2}) {
    SCOPED_TRACE(moe::kernel_format_name(f));
    Qwen3MoeCudaOptions o;
    o.max_tokens = 64;
    o.max_context = 128;
    int progress_calls = 0;
    o.progress = [&](int done, int total) {
      ++progress_calls;
      EXPECT_LE(done, total);
    };
    auto m = Qwen3MoeCuda::create_dummy(c, f, o);
    ASSERT_TRUE(m.ok()) << m.error().what();
    EXPECT_EQ(progress_calls, c.num_hidden_layers + 1);
    const MemoryPlan& plan = (*m)->memory_plan();
    EXPECT_GT(plan.experts, 0u);
    EXPECT_GT(plan.dense_mlp, 0u);
    EXPECT_GT(plan.kv_cache, 0u);
    std::printf("%s", format_memory_plan(plan).c_str());
    BlockAllocator blocks((*m)->num_blocks());
    std::vector<int32_t> table;
    ASSERT_TRUE(blocks.ensure(table, 60, (*m)->block_size()).ok());
    std::vector<int32_t> ids(50);
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i * 37) % 1000);
    std::vector<float> logits(1000);
    const SequenceStep pre{ids, 0, table};
    auto b = (*m)->make_batch(std::span<const SequenceStep>(&pre, 1));
    ASSERT_TRUE(b.ok());
    ASSERT_TRUE((*m)->forward(*b, logits.data()).ok());
    for (float x : logits) ASSERT_TRUE(std::isfinite(x));
    for (int s = 0; s < 3; ++s) {
      const int32_t id = 7 + s;
      const SequenceStep d{std::span<const int32_t>(&id, 1), 50 + s, table};
      auto db = (*m)->make_batch(std::span<const SequenceStep>(&d, 1));
      ASSERT_TRUE(db.ok());
      ASSERT_TRUE((*m)->forward(*db, logits.data()).ok());
      for (float x : logits) ASSERT_TRUE(std::isfinite(x)) << "decode step " << s;
    }
    EXPECT_EQ((*m)->graph_steps(), 2);
    EXPECT_GT((*m)->decode_weight_bytes(), 0u);
  }
}

}  // namespace
}  // namespace moebius::model
