// Data-parallel serving on the CUDA backend ([TAG_SERVE_DP], `moebius serve --backend cuda --ep N`):
// the host-staged collectives its step messages travel by (parallel/host_staged_communicator.h),
// and the serve runner whose ranks each run the sequences placed on them (server/dp_driver.h,
// step_runner_cuda.cpp), on the tiny fixture (3 layers, 16 experts top-4, V = 512).
//
// The runner is checked against the plain CUDA runner (no EP) step by step. Not bit-identical: the
// EP layer routes with the separate router kernels and runs its local experts as a k = 1 layer
// (test_qwen3_moe_cuda_ep.cu explains it), so the tolerance is that test's: max |dlogit| <= 0.02,
// nmse <= 1e-5, the argmax equal where the top-1 margin is above twice that.
//
// One rank (a one-rank NCCL communicator on GPU 0) runs the whole protocol: the limits check, the
// step messages and logits through host staging, an empty part. EP = 2 and 4 need that many GPUs
// (NCCL puts one rank on one GPU) and skip otherwise. The plain runner's step_rows (the engine's
// call, rows read in place) is checked against its step(). Gtest filter:
// 'HostStaged*:CudaDpRunner.*:CudaRunner.*'.
#include "gpu/gpu_test_util.h"  // first: it makes fmt compile under nvcc

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "server/step_runner.h"
#include "test_util.h"
#include "tiny_fixture.h"

#if defined(MOEBIUS_HAS_NCCL)
#include "parallel/host_staged_communicator.h"
#include "parallel/nccl_communicator.h"
#endif

namespace moebius::server {
namespace {

#if defined(MOEBIUS_HAS_NCCL)

constexpr float kEpTol = 0.02f;
constexpr double kEpNmse = 1e-5;
constexpr size_t kVocab = 512;

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

std::shared_ptr<parallel::NcclCommunicator> make_comm(const parallel::NcclId& id, int rank, int size) {
  auto c = parallel::NcclCommunicator::create(id, rank, size, rank);
  EXPECT_TRUE(c.ok()) << c.error().what();
  return c.ok() ? std::shared_ptr<parallel::NcclCommunicator>(std::move(c).value()) : nullptr;
}

// N ranks as threads, rank r on GPU r: body(rank, its NCCL communicator). Errors per rank.
std::vector<std::string> run_ranks(int n, const std::function<Status(int, std::shared_ptr<parallel::NcclCommunicator>)>& body) {
  auto id = parallel::nccl_unique_id();
  EXPECT_TRUE(id.ok()) << id.error().what();
  std::vector<std::string> errors(static_cast<size_t>(n));
  if (!id.ok()) return errors;
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      CUDA_CHECK(cudaSetDevice(r));
      auto comm = make_comm(*id, r, n);
      const Status st = comm ? body(r, comm) : Status(Error("no communicator"));
      if (!st.ok()) errors[static_cast<size_t>(r)] = st.error().what();
    });
  for (auto& t : threads) t.join();
  return errors;
}

// all_gather and all_to_all_v on host buffers over N ranks: every byte where it belongs, the
// bytes between receive regions untouched, zero-byte peers, and a collective past the cap refused
// before anything is sent.
Status staged_collectives(int rank, parallel::NcclCommunicator& nccl) {
  cudaStream_t s = nullptr;
  CUDA_CHECK(cudaStreamCreate(&s));
  parallel::HostStagedCommunicator c(nccl, s);
  const int N = c.size();
  const size_t n = static_cast<size_t>(N);
  const Status st = [&]() -> Status {
    const int32_t mine[3] = {rank, 10 * rank + 1, -rank};
    std::vector<int32_t> all(3 * n, 0x7f7f7f7f);
    MOEBIUS_TRY(c.all_gather(mine, all.data(), sizeof(mine)));
    for (int r = 0; r < N; ++r)
      if (all[3 * static_cast<size_t>(r)] != r || all[3 * static_cast<size_t>(r) + 1] != 10 * r + 1 ||
          all[3 * static_cast<size_t>(r) + 2] != -r)
        return Error::format("rank {}: all_gather got rank {}'s entry wrong", rank, r);
    // Rank r sends (r + d) % 3 * 7 bytes to rank d, byte value r * 16 + d, regions 9 bytes apart
    // on both sides (gaps of poison that must stay).
    std::vector<size_t> sb(n), so(n), rb(n), ro(n);
    std::vector<uint8_t> send(9 * n + 32, 0xEE), recv(9 * n + 32, 0xCC);
    for (size_t d = 0; d < n; ++d) {
      sb[d] = (static_cast<size_t>(rank) + d) % 3 * 7 % 9;
      so[d] = 9 * d + 1;
      std::fill_n(send.begin() + static_cast<std::ptrdiff_t>(so[d]), sb[d], static_cast<uint8_t>(rank * 16 + d));
      rb[d] = (d + static_cast<size_t>(rank)) % 3 * 7 % 9;
      ro[d] = 9 * d + 2;
    }
    MOEBIUS_TRY(c.all_to_all_v(send.data(), sb, so, recv.data(), rb, ro));
    for (size_t i = 0; i < recv.size(); ++i) {
      uint8_t want = 0xCC;
      for (size_t src = 0; src < n; ++src)
        if (i >= ro[src] && i < ro[src] + rb[src]) want = static_cast<uint8_t>(src * 16 + static_cast<size_t>(rank));
      if (recv[i] != want) return Error::format("rank {}: all_to_all_v byte {} is {}, want {}", rank, i, recv[i], want);
    }
    // Past the cap: an error on every rank (all pass the same size), nothing sent. One byte past
    // it: at the cap itself the collective is legal and would read kMaxBytes of `send`.
    std::vector<size_t> huge(n, 0), zero(n, 0);
    huge[0] = parallel::HostStagedCommunicator::kMaxBytes + 1;
    if (c.all_to_all_v(send.data(), huge, zero, recv.data(), zero, zero).ok())
      return Error::format("rank {}: a {}-byte collective was not refused", rank, huge[0]);
    if (c.all_gather(mine, all.data(), parallel::HostStagedCommunicator::kMaxBytes / n).ok())
      return Error::format("rank {}: an all_gather past the cap was not refused", rank);
    // Sizes whose products or ends wrap size_t to something small: refused, not staged small.
    if (c.all_gather(mine, all.data(), SIZE_MAX / (n + 1) + 1).ok())
      return Error::format("rank {}: an all_gather whose size wraps was not refused", rank);
    std::vector<size_t> wrap_off(n, 0), sixteen(n, 0);
    wrap_off[0] = SIZE_MAX - 7;
    sixteen[0] = 16;
    if (c.all_to_all_v(send.data(), sixteen, wrap_off, recv.data(), zero, zero).ok())
      return Error::format("rank {}: an all_to_all_v region past the address space was not refused", rank);
    return c.barrier();
  }();
  CUDA_CHECK(cudaStreamDestroy(s));
  return st;
}

TEST(HostStagedCommunicator, CollectivesOnHostBuffers) {
  for (int n : {1, 2, 4}) {
    if (device_count() < n) {
      std::printf("  %d ranks skipped: %d GPU(s)\n", n, device_count());
      continue;
    }
    const auto errors = run_ranks(n, [](int r, std::shared_ptr<parallel::NcclCommunicator> c) {
      return staged_collectives(r, *c);
    });
    for (int r = 0; r < n; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << n << " ranks, rank " << r;
  }
}

RunnerOptions tiny_options(std::shared_ptr<parallel::Communicator> comm) {
  RunnerOptions o;
  o.source.model_dir = testing::tiny_fixture_dir();
  o.backend = "cuda";
  o.max_seqs = 4;
  o.max_step_tokens = 64;
  o.max_context = 64;
  o.ep = comm ? comm->size() : 1;
  o.ep_comm = std::move(comm);
  return o;
}

void expect_close(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  testing::expect_logits_close(got, want, kVocab, kEpTol, kEpNmse, what);
}

// A serving script over `ranks` pools, as the engine would run it: prefills, decodes, a chunk
// without logits, a new sequence, a preempted one starting over, a rank with no sequences in a
// step (always with 4 ranks: sequence k runs on rank (k - 1) % ranks), and steps of 1 to 3
// sequences. Returns every step's logits, concatenated. rows_view: through StepRunner::step_rows
// (the engine's call) instead of step().
std::vector<float> run_script(StepRunner& runner, int ranks, bool rows_view = false) {
  std::vector<float> all, logits;
  std::vector<const float*> rows;
  auto step = [&](std::vector<RunnerSeq> seqs, size_t want_rows) {
    if (rows_view) {
      const Status st = runner.step_rows(seqs, logits, rows);
      EXPECT_TRUE(st.ok()) << st.error().what();
      EXPECT_EQ(rows.size(), want_rows);
      for (const float* r : rows) all.insert(all.end(), r, r + kVocab);
      return;
    }
    const Status st = runner.step(seqs, logits);
    EXPECT_TRUE(st.ok()) << st.error().what();
    EXPECT_EQ(logits.size(), want_rows * kVocab);
    all.insert(all.end(), logits.begin(), logits.end());
  };
  // Blocks 2k, 2k + 1 of its pool for sequence k (16-token blocks; no sequence passes 32 tokens).
  const std::vector<std::vector<int32_t>> tables = {{}, {2, 3}, {4, 5}, {6, 7}, {8, 9}};
  auto seq = [&](int k, const std::vector<int32_t>& tokens, int64_t start, bool want) {
    return RunnerSeq{k, tokens, start, tables[static_cast<size_t>(k)], want, (k - 1) % ranks};
  };
  const std::vector<int32_t> p1 = {1, 2, 3, 4, 5}, p2 = {7, 8}, p3 = {3, 9, 27}, p4 = {11, 12, 13, 14};
  const std::vector<int32_t> t1 = {9}, t2 = {10}, t3 = {21}, t4 = {6}, c1 = {30, 31}, t5 = {40};
  step({seq(1, p1, 0, true), seq(2, p2, 0, true), seq(3, p3, 0, true)}, 3);
  step({seq(1, t1, 5, true), seq(2, t2, 2, true), seq(3, t3, 3, true)}, 3);  // decode (graphs)
  step({seq(1, t4, 6, true), seq(2, t1, 3, true), seq(3, t2, 4, true)}, 3);  // decode (replays)
  step({seq(4, p4, 0, true), seq(1, t2, 7, true), seq(3, t3, 5, false)}, 2);
  const std::vector<int32_t> p3_again = {3, 9, 27, 21, 10, 21};  // preempted: started over
  step({seq(3, p3_again, 0, true), seq(1, c1, 8, false), seq(4, t5, 4, true)}, 2);
  step({seq(4, t1, 5, true), seq(3, t4, 6, true), seq(1, t5, 10, true)}, 3);
  step({seq(4, t2, 6, true)}, 1);
  return all;
}

std::vector<float> plain_runner_script(int ranks) {
  CUDA_CHECK(cudaSetDevice(0));
  auto runner = load_runner(tiny_options(nullptr));
  EXPECT_TRUE(runner.ok()) << runner.error().what();
  if (!runner.ok()) return {};
  return run_script(**runner, ranks);
}

// The engine's call, step_rows: on one GPU the rows are read in the runner's pinned read-back,
// with no copy; they must be step()'s bits exactly (the same batches through the same kernels).
TEST(CudaRunner, StepRowsViewEqualsStepBitForBit) {
  const std::vector<float> want = plain_runner_script(1);
  ASSERT_FALSE(want.empty());
  auto runner = load_runner(tiny_options(nullptr));
  ASSERT_TRUE(runner.ok()) << runner.error().what();
  const std::vector<float> got = run_script(**runner, 1, /*rows_view=*/true);
  ASSERT_EQ(got.size(), want.size());
  EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0);
}

// A sequence past the context on rank `rank` is refused by every rank before any forward, the
// runner has not failed, and the next step runs.
void expect_refused_then_runs(StepRunner& runner, int rank) {
  const std::vector<int32_t> table = {0, 1, 2, 3, 4}, one = {0}, t = {4}, p = {1, 2};
  std::vector<float> logits;
  const RunnerSeq past[] = {{9, t, 70, table, true, rank}};
  const Status st = runner.step(past, logits);
  ASSERT_FALSE(st.ok());
  // Rank 0 names its own reason; a follower's is in its log, and rank 0 names the follower.
  const std::string who = rank == 0 ? "rank 0: " : "rank(s) " + std::to_string(rank);
  EXPECT_NE(st.error().what().find(who), std::string::npos) << st.error().what();
  EXPECT_FALSE(runner.failed());
  const RunnerSeq fine[] = {{10, p, 0, one, true, rank}};
  const Status next = runner.step(fine, logits);
  EXPECT_TRUE(next.ok()) << next.error().what();
  EXPECT_EQ(logits.size(), kVocab);
}

TEST(CudaDpRunner, OneRankOverNcclMatchesThePlainRunner) {
  const std::vector<float> want = plain_runner_script(1);
  ASSERT_FALSE(want.empty());
  const auto errors = run_ranks(1, [&](int, std::shared_ptr<parallel::NcclCommunicator> comm) -> Status {
    MOEBIUS_ASSIGN_OR_RETURN(std::unique_ptr<StepRunner> runner, load_runner(tiny_options(comm)));
    EXPECT_EQ(runner->limits().kv_pools, 1);
    EXPECT_EQ(runner->limits().max_seqs, 4);
    EXPECT_NE(runner->describe().find("data parallel over 1"), std::string::npos) << runner->describe();
    expect_close(run_script(*runner, 1), want, "DP over 1 rank (NCCL, host-staged messages)");
    expect_refused_then_runs(*runner, 0);
    return Ok{};
  });
  EXPECT_EQ(errors[0], "");
  // A communicator whose size is not --ep is refused, naming --ep.
  const auto refused = run_ranks(1, [](int, std::shared_ptr<parallel::NcclCommunicator> comm) -> Status {
    RunnerOptions o = tiny_options(comm);
    o.ep = 2;
    auto r = load_runner(o);
    if (r.ok()) return Error("--ep 2 over a one-rank communicator was accepted");
    EXPECT_NE(r.error().what().find("--ep"), std::string::npos) << r.error().what();
    return Ok{};
  });
  EXPECT_EQ(refused[0], "");
}

// Prompt logprobs' rows (RunnerSeq::all_logits): a prefill's row for token i equals the last row of
// a prefill of the prompt's first i + 1 tokens (kernels of other token counts: the EP tolerance),
// beside a sequence that wants only its last row; through the plain runner and the one-rank DP runner.
void expect_all_logits_rows(StepRunner& runner, const std::string& what) {
  const std::vector<int32_t> prompt = {5, 17, 2, 99, 41, 7, 300, 12, 8}, other = {3, 4, 5};
  std::vector<float> want, logits;
  for (size_t i = 1; i <= prompt.size(); ++i) {
    const std::vector<int32_t> table = {static_cast<int32_t>(i)};
    const RunnerSeq s{static_cast<int64_t>(i), std::span<const int32_t>(prompt.data(), i), 0, table, true};
    ASSERT_TRUE(runner.step(std::span<const RunnerSeq>(&s, 1), logits).ok());
    want.insert(want.end(), logits.begin(), logits.end());
  }
  const std::vector<int32_t> ta = {12}, tb = {13};
  const RunnerSeq step[] = {{20, other, 0, tb, true}, {21, prompt, 0, ta, false, 0, true}};
  const Status st = runner.step(step, logits);
  ASSERT_TRUE(st.ok()) << st.error().what();
  ASSERT_EQ(logits.size(), (1 + prompt.size()) * kVocab);
  expect_close(std::vector<float>(logits.begin() + kVocab, logits.end()), want, what);
  EXPECT_EQ(runner.limits().max_all_logits_rows, 64) << what;  // min(--prompt-logprob-rows 128, step tokens)
}

TEST(CudaDpRunner, AllLogitsRowsEqualPrefixPrefills) {
  CUDA_CHECK(cudaSetDevice(0));
  {
    auto plain = load_runner(tiny_options(nullptr));
    ASSERT_TRUE(plain.ok()) << plain.error().what();
    expect_all_logits_rows(**plain, "all-logits rows, plain runner");
  }
  const auto errors = run_ranks(1, [&](int, std::shared_ptr<parallel::NcclCommunicator> comm) -> Status {
    MOEBIUS_ASSIGN_OR_RETURN(std::unique_ptr<StepRunner> runner, load_runner(tiny_options(comm)));
    expect_all_logits_rows(*runner, "all-logits rows, DP over 1 rank");
    return Ok{};
  });
  EXPECT_EQ(errors[0], "");
}

// DP over 2 and 4 GPUs: rank 0's runner places each sequence on its pool's rank, the followers
// (run_ep_follower, as `serve` runs them) serve their parts and return when the runner goes.
TEST(CudaDpRunner, TwoAndFourRanksMatchThePlainRunner) {
  if (device_count() < 2)
    GTEST_SKIP() << "DP over 2 and 4 ranks needs 2 and 4 GPUs (NCCL cannot put two ranks on one GPU); this machine "
                    "has "
                 << device_count();
  for (int n : {2, 4}) {
    if (device_count() < n) {
      std::printf("  DP=%d skipped: %d GPU(s)\n", n, device_count());
      continue;
    }
    const std::vector<float> want = plain_runner_script(n);
    ASSERT_FALSE(want.empty());
    const auto errors = run_ranks(n, [&](int r, std::shared_ptr<parallel::NcclCommunicator> comm) -> Status {
      if (r != 0) return run_ep_follower(tiny_options(comm));
      MOEBIUS_ASSIGN_OR_RETURN(std::unique_ptr<StepRunner> runner, load_runner(tiny_options(comm)));
      EXPECT_EQ(runner->limits().kv_pools, n);
      EXPECT_EQ(runner->limits().max_seqs, 4 * n);
      expect_close(run_script(*runner, n), want, "DP over " + std::to_string(n) + " ranks");
      expect_refused_then_runs(*runner, n - 1);
      return Ok{};  // the runner goes: the followers return
    });
    for (int r = 0; r < n; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "DP=" << n << " rank " << r;
  }
}

#else

TEST(CudaDpRunner, NeedsNccl) { GTEST_SKIP() << "this build has no NCCL"; }

#endif  // MOEBIUS_HAS_NCCL

}  // namespace
}  // namespace moebius::server
