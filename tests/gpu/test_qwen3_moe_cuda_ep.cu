// The CUDA runner with expert parallelism (Qwen3MoeCudaOptions::ep_comm, docs/EXPERT_PARALLEL.md)
// on the tiny fixture (3 layers, layer 1 dense, H=64, 16 experts top-4, V=512), against the
// non-EP runner with the same bf16 experts.
//
// Tolerance, and why it is not bit-identity: EP changes who computes a row, not the combine (fp32,
// slot order, the routed weight applied on the token's rank), but the MoE layer's kernels differ
// from the single-GPU layer's: the EP layer routes with the separate router GEMV + top-k kernels
// (the single-GPU layer fuses router, top-k and align at decode sizes, with another reduction
// order for the router logits), and its local experts run as a k = 1 layer over the received pairs,
// whose GEMM tile choice can differ. MoeLayerEpGpu (test_ep_dispatch.cu) measures the layer at
// nmse < 1e-5 with identical routing; through three layers and the lm_head we allow max |Δlogit|
// <= kEpTol = 0.02 (the batching tolerance of test_qwen3_moe_cuda.cu: bf16 rounding of a few
// outputs) and nmse <= 1e-5, argmax equal where the top-1 margin exceeds 2 * kEpTol. The test
// prints the measured values and whether they came out bit-identical.
//
// Gtest filter: 'Qwen3MoeCudaEp.*'. EP = 2 and 4 need that many GPUs (NCCL puts one rank on one
// GPU) and skip with a message otherwise.
#include "gpu/gpu_test_util.h"  // first: it makes fmt compile under nvcc

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "model/block_allocator.h"
#include "model/qwen3_moe_cuda.h"
#include "model/step_batch.h"
#include "test_util.h"
#include "tiny_fixture.h"

#if defined(MOEBIUS_HAS_NCCL)
#include "parallel/nccl_communicator.h"
#endif

namespace moebius::model {
namespace {

#if defined(MOEBIUS_HAS_NCCL)

constexpr float kEpTol = 0.02f;
constexpr double kEpNmse = 1e-5;

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

// Decode capacity 2 (graphs of 1 and 2 sequences), prefill capacity 32.
Qwen3MoeCudaOptions ep_options(std::shared_ptr<parallel::Communicator> comm) {
  Qwen3MoeCudaOptions o;
  o.max_tokens = 32;
  o.max_seqs = 2;
  o.max_logit_rows = 32;
  o.max_context = 64;
  o.graph_batches = {1, 2};
  o.ep_comm = std::move(comm);
  return o;
}

void expect_close(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  testing::expect_logits_close(got, want, 512, kEpTol, kEpNmse, what);
}

// One sequence driven step by step through a runner: a prefill of `prompt` tokens of `ids`, then
// teacher-forced single-token decode steps; each step's last-row logits are appended to `out`.
class SeqDriver {
 public:
  SeqDriver(Qwen3MoeCuda& m, std::vector<int32_t> ids, int prompt)
      : m_(m), ids_(std::move(ids)), prompt_(prompt), blocks_(m.num_blocks()) {
    EXPECT_TRUE(blocks_.ensure(table_, static_cast<int64_t>(ids_.size()), m.block_size()).ok());
  }
  int steps() const { return static_cast<int>(ids_.size()) - prompt_ + 1; }
  // Step i: 0 is the prefill, i >= 1 decodes token prompt + i - 1.
  Status step(int i) {
    const int start = i == 0 ? 0 : prompt_ + i - 1, n = i == 0 ? prompt_ : 1;
    const SequenceStep s{std::span<const int32_t>(ids_.data() + start, static_cast<size_t>(n)), start, table_};
    MOEBIUS_ASSIGN_OR_RETURN(StepBatch b, m_.make_batch(std::span<const SequenceStep>(&s, 1)));
    std::vector<float> logits(static_cast<size_t>(m_.config().vocab_size));
    MOEBIUS_TRY(m_.forward(b, logits.data()));
    out.insert(out.end(), logits.begin(), logits.end());
    return Ok{};
  }
  std::vector<float> out;

 private:
  Qwen3MoeCuda& m_;
  std::vector<int32_t> ids_;
  int prompt_;
  BlockAllocator blocks_;
  std::vector<int32_t> table_;
};

std::vector<int32_t> prompt_ids(int n, int seed) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) ids[static_cast<size_t>(i)] = (seed * 131 + i * 37 + 5) % 512;
  return ids;
}

// The non-EP runner's logits for a sequence (prefill + decode steps), on the current GPU.
std::vector<float> single_gpu_logits(const std::vector<int32_t>& ids, int prompt) {
  auto m = Qwen3MoeCuda::load(testing::tiny_fixture_dir(), ep_options(nullptr));
  EXPECT_TRUE(m.ok()) << m.error().what();
  if (!m.ok()) return {};
  SeqDriver d(**m, ids, prompt);
  for (int i = 0; i < d.steps(); ++i) EXPECT_TRUE(d.step(i).ok());
  return d.out;
}

std::shared_ptr<parallel::Communicator> make_comm(const parallel::NcclId& id, int rank, int size) {
  auto c = parallel::NcclCommunicator::create(id, rank, size, rank);
  EXPECT_TRUE(c.ok()) << c.error().what();
  return c.ok() ? std::shared_ptr<parallel::Communicator>(std::move(c).value()) : nullptr;
}

TEST(Qwen3MoeCudaEp, OneRankOverNcclMatchesTheSingleGpuRunner) {
  const std::vector<int32_t> ids = prompt_ids(20, 1);
  const std::vector<float> want = single_gpu_logits(ids, 12);
  ASSERT_FALSE(want.empty());
  auto id = parallel::nccl_unique_id();
  ASSERT_TRUE(id.ok()) << id.error().what();
  auto comm = make_comm(*id, 0, 1);
  ASSERT_TRUE(comm);
  auto m = Qwen3MoeCuda::load(testing::tiny_fixture_dir(), ep_options(comm));
  ASSERT_TRUE(m.ok()) << m.error().what();
  EXPECT_EQ((*m)->ep_size(), 1);
  SeqDriver d(**m, ids, 12);
  const int64_t graphs_before = (*m)->graph_steps();
  for (int i = 0; i < d.steps(); ++i) ASSERT_TRUE(d.step(i).ok());
  // 8 decode steps of one sequence: the first captures the graph, the other 7 replay it.
  EXPECT_EQ((*m)->graph_steps() - graphs_before, 7);
  expect_close(d.out, want, "EP=1 over NCCL, prefill + graph decode");
  // A rank with no tokens in a step: the header and every MoE layer's collectives, nothing else.
  EXPECT_TRUE((*m)->ep_empty_step().ok());
  EXPECT_TRUE((*m)->ep_idle_until_all_done().ok());  // one rank: returns at once

  // Bad input: expert offload together with EP is refused, naming --ep.
  Qwen3MoeCudaOptions off = ep_options(comm);
  off.gpu_memory_budget = "auto";
  auto refused = Qwen3MoeCuda::load(testing::tiny_fixture_dir(), off);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().what().find("--ep"), std::string::npos) << refused.error().what();
}

// DP attention + EP MoE over N ranks (threads, one GPU each): rank 0 runs sequence A from step 0;
// rank 1 is empty at step 0 (a zero-token rank while rank 0 prefills), prefills B at step 1
// while rank 0 decodes (a decode at the prefill capacity, eager), then both decode (graphs);
// rank 0 finishes first and idles; ranks 2 and 3 never have tokens. Each sequence's logits equal
// the single-GPU runner's.
TEST(Qwen3MoeCudaEp, TwoAndFourRanksMatchTheSingleGpuRunner) {
  if (device_count() < 2)
    GTEST_SKIP() << "EP=2 and EP=4 need 2 and 4 GPUs (NCCL cannot put two ranks on one GPU); this machine has "
                 << device_count();
  const std::vector<int32_t> a = prompt_ids(20, 2), b = prompt_ids(16, 3);
  CUDA_CHECK(cudaSetDevice(0));
  const std::vector<float> want_a = single_gpu_logits(a, 12), want_b = single_gpu_logits(b, 8);
  for (int n : {2, 4}) {
    if (device_count() < n) {
      std::printf("  EP=%d skipped: %d GPU(s)\n", n, device_count());
      continue;
    }
    auto id = parallel::nccl_unique_id();
    ASSERT_TRUE(id.ok()) << id.error().what();
    std::vector<std::vector<float>> got(static_cast<size_t>(n));
    std::vector<std::string> errors(static_cast<size_t>(n));
    std::vector<int64_t> graphs(static_cast<size_t>(n), 0);
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        const Status st = [&]() -> Status {
          auto comm = make_comm(*id, r, n);
          if (!comm) return Error("no communicator");
          MOEBIUS_ASSIGN_OR_RETURN(std::unique_ptr<Qwen3MoeCuda> m,
                                   Qwen3MoeCuda::load(testing::tiny_fixture_dir(), ep_options(comm)));
          if (r == 0) {
            SeqDriver d(*m, a, 12);
            for (int i = 0; i < d.steps(); ++i) MOEBIUS_TRY(d.step(i));
            got[0] = d.out;
          } else if (r == 1) {
            MOEBIUS_TRY(m->ep_empty_step());
            SeqDriver d(*m, b, 8);
            for (int i = 0; i < d.steps(); ++i) MOEBIUS_TRY(d.step(i));
            got[1] = d.out;
          }
          graphs[static_cast<size_t>(r)] = m->graph_steps();
          return m->ep_idle_until_all_done();
        }();
        if (!st.ok()) errors[static_cast<size_t>(r)] = st.error().what();
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < n; ++r)
      ASSERT_TRUE(errors[static_cast<size_t>(r)].empty())
          << "EP=" << n << " rank " << r << ": " << errors[static_cast<size_t>(r)];
    expect_close(got[0], want_a, "EP=" + std::to_string(n) + " rank 0 (sequence A)");
    expect_close(got[1], want_b, "EP=" + std::to_string(n) + " rank 1 (sequence B)");
    // Rank 0's decode at step 1 ran eagerly (rank 1 prefilled), step 2 captured, steps 3..8 replayed.
    EXPECT_EQ(graphs[0], 6) << "EP=" << n;
    // Rank 1's 8 decodes (steps 2..9) all run at the decode capacity: the first captures, 7 replay.
    EXPECT_EQ(graphs[1], 7) << "EP=" << n;
  }
}

#else

TEST(Qwen3MoeCudaEp, NeedsNccl) { GTEST_SKIP() << "this build has no NCCL"; }

#endif  // MOEBIUS_HAS_NCCL

}  // namespace
}  // namespace moebius::model
