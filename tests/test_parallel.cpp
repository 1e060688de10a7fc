// src/parallel: the in-process communicator (threads as ranks), the expert split, the launcher's
// environment and the file rendezvous; and the EP step plan of src/moe/ep_plan.h.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <thread>

#include "moe/ep_plan.h"
#include "parallel/ep_step.h"
#include "parallel/in_process_communicator.h"
#include "parallel/launch_env.h"
#include "parallel/launcher.h"

namespace moebius::parallel {
namespace {

using ::testing::HasSubstr;

TEST(InProcessCommunicator, AllGatherCollectsEveryRankInOrder) {
  for (int n : {1, 2, 3, 4, 8}) {
    std::vector<std::vector<int32_t>> got(static_cast<size_t>(n));
    auto st = run_ranks(n, [&](Communicator& c) -> Status {
      EXPECT_EQ(c.size(), n);
      EXPECT_FALSE(c.buffers_on_device());
      const int32_t mine[2] = {c.rank(), 100 + c.rank()};
      auto& out = got[static_cast<size_t>(c.rank())];
      out.assign(static_cast<size_t>(2 * n), -1);
      for (int rep = 0; rep < 3; ++rep) MOEBIUS_TRY(c.all_gather(mine, out.data(), sizeof(mine)));
      return Ok{};
    });
    for (int r = 0; r < n; ++r) {
      ASSERT_TRUE(st[static_cast<size_t>(r)].ok()) << st[static_cast<size_t>(r)].error().what();
      for (int s = 0; s < n; ++s) {
        EXPECT_EQ(got[static_cast<size_t>(r)][static_cast<size_t>(2 * s)], s);
        EXPECT_EQ(got[static_cast<size_t>(r)][static_cast<size_t>(2 * s + 1)], 100 + s);
      }
    }
  }
}

// Rank s sends count(s, d) bytes with value (s * 16 + d) to every rank d, including itself;
// counts cover zero (ranks that send or receive nothing) and very uneven sizes.
size_t test_count(int s, int d, int n) {
  if (s == 0) return 0;                              // rank 0 sends nothing at all
  if (d == n - 1) return 100000 + 7 * s;             // everybody floods the last rank
  return static_cast<size_t>((s * 3 + d) % 4 == 0 ? 0 : s + d);
}

TEST(InProcessCommunicator, AllToAllVWithZeroAndUnevenCounts) {
  for (int n : {1, 2, 4, 5}) {
    auto st = run_ranks(n, [&](Communicator& c) -> Status {
      const int me = c.rank();
      std::vector<size_t> sb(static_cast<size_t>(n)), so(sb.size()), rb(sb.size()), ro(sb.size());
      size_t stotal = 0, rtotal = 0;
      for (int d = 0; d < n; ++d) {
        sb[static_cast<size_t>(d)] = test_count(me, d, n);
        so[static_cast<size_t>(d)] = stotal;
        stotal += sb[static_cast<size_t>(d)];
        rb[static_cast<size_t>(d)] = test_count(d, me, n);
        ro[static_cast<size_t>(d)] = rtotal;
        rtotal += rb[static_cast<size_t>(d)];
      }
      std::vector<uint8_t> send(stotal), recv(rtotal + 1, 0xEE);  // one sentinel byte past the end
      for (int d = 0; d < n; ++d)
        std::fill_n(send.begin() + static_cast<ptrdiff_t>(so[static_cast<size_t>(d)]), sb[static_cast<size_t>(d)],
                    static_cast<uint8_t>(me * 16 + d));
      for (int rep = 0; rep < 2; ++rep) MOEBIUS_TRY(c.all_to_all_v(send.data(), sb, so, recv.data(), rb, ro));
      for (int s = 0; s < n; ++s)
        for (size_t i = 0; i < rb[static_cast<size_t>(s)]; ++i)
          if (recv[ro[static_cast<size_t>(s)] + i] != static_cast<uint8_t>(s * 16 + me))
            return Error::format("rank {} byte {} from rank {} is wrong", me, i, s);
      if (recv.back() != 0xEE) return Error("wrote past the receive buffer");
      return c.barrier();
    });
    for (auto& s : st) EXPECT_TRUE(s.ok()) << s.error().what();
  }
}

TEST(InProcessCommunicator, MismatchedSizesAreAnErrorOnTheReceiver) {
  auto st = run_ranks(2, [&](Communicator& c) -> Status {
    std::vector<uint8_t> buf(64);
    const size_t send_b[2] = {0, c.rank() == 0 ? size_t{8} : size_t{0}}, zero[2] = {0, 0};
    const size_t recv_b[2] = {c.rank() == 1 ? size_t{4} : size_t{0}, 0};  // rank 1 expects 4, gets 8
    return c.all_to_all_v(buf.data(), send_b, zero, buf.data() + 32, recv_b, zero);
  });
  EXPECT_TRUE(st[0].ok());
  ASSERT_FALSE(st[1].ok());
  EXPECT_THAT(st[1].error().what(), HasSubstr("sends 8 bytes to rank 1, which expects 4"));
}

TEST(InProcessCommunicator, AFailingRankReleasesTheOthers) {
  auto st = run_ranks(3, [&](Communicator& c) -> Status {
    if (c.rank() == 1) return Error("model load failed");
    int32_t v = c.rank(), all[3];
    MOEBIUS_TRY(c.all_gather(&v, all, sizeof(v)));  // would wait for rank 1 forever
    return c.barrier();
  });
  ASSERT_FALSE(st[1].ok());
  for (int r : {0, 2}) {
    ASSERT_FALSE(st[static_cast<size_t>(r)].ok());
    EXPECT_THAT(st[static_cast<size_t>(r)].error().what(), HasSubstr("rank 1 failed: model load failed"));
  }
}

TEST(ExpertSplit, OwnersAreContiguousBlocks) {
  EXPECT_TRUE(check_expert_split(128, 4).ok());
  EXPECT_FALSE(check_expert_split(128, 3).ok());
  EXPECT_THAT(check_expert_split(16, 32).error().what(), HasSubstr("--ep must divide it"));
  EXPECT_EQ(expert_range(128, 4, 2).begin, 64);
  EXPECT_EQ(expert_range(128, 4, 2).end, 96);
  for (int e = 0; e < 128; ++e) {
    const int r = expert_owner(e, 128, 4);
    EXPECT_GE(e, expert_range(128, 4, r).begin);
    EXPECT_LT(e, expert_range(128, 4, r).end);
  }
}

// Sets environment variables for one test and restores them.
class ScopedEnv {
 public:
  void set(const char* k, const char* v) {
    const char* old = std::getenv(k);
    saved_.emplace_back(k, old ? std::optional<std::string>(old) : std::nullopt);
    if (v) ::setenv(k, v, 1); else ::unsetenv(k);
  }
  ~ScopedEnv() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      if (it->second) ::setenv(it->first.c_str(), it->second->c_str(), 1); else ::unsetenv(it->first.c_str());
    }
  }
 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

TEST(LaunchEnv, ReadsTheBuiltInLauncherAndMpirunVariables) {
  ScopedEnv env;
  for (const char* k : {"MOEBIUS_EP_RANK", "MOEBIUS_EP_SIZE", "MOEBIUS_EP_LOCAL_RANK", "MOEBIUS_EP_RENDEZVOUS",
                        "MOEBIUS_EP_JOB_ID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                        "OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK", "PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid"})
    env.set(k, nullptr);
  auto none = placement_from_env();
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());

  env.set("OMPI_COMM_WORLD_RANK", "3");
  env.set("OMPI_COMM_WORLD_SIZE", "4");
  env.set("LOCAL_RANK", "1");
  env.set("PMIX_NAMESPACE", "prterun-host-1234@1");
  auto mpi = placement_from_env();
  ASSERT_TRUE(mpi.ok()) << mpi.error().what();
  ASSERT_TRUE(mpi->has_value());
  EXPECT_TRUE((*mpi)->from_mpirun);
  EXPECT_EQ((*mpi)->rank, 3);
  EXPECT_EQ((*mpi)->size, 4);
  EXPECT_EQ((*mpi)->local_rank, 1);
  EXPECT_EQ((*mpi)->job_id, "prterun-host-1234@1");

  env.set("OMPI_COMM_WORLD_RANK", "4");  // rank past the size: named
  auto bad = placement_from_env();
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.error().what(), HasSubstr("OMPI_COMM_WORLD_RANK='4'"));

  env.set("MOEBIUS_EP_RANK", "1");  // the built-in launcher wins
  env.set("MOEBIUS_EP_SIZE", "2");
  env.set("MOEBIUS_EP_RENDEZVOUS", "/tmp/x");
  auto own = placement_from_env();
  ASSERT_TRUE(own.ok()) << own.error().what();
  EXPECT_FALSE((*own)->from_mpirun);
  EXPECT_EQ((*own)->rank, 1);
  EXPECT_EQ((*own)->size, 2);
  EXPECT_EQ((*own)->local_rank, 1);
  EXPECT_EQ((*own)->rendezvous, "/tmp/x");
}

TEST(Rendezvous, RankZeroPublishesTheOthersWait) {
  const std::string dir = (std::filesystem::temp_directory_path() /
                           ("moebius-test-rdv-" + std::to_string(::getpid()))).string();
  std::filesystem::remove_all(dir);
  std::vector<uint8_t> id(128);
  std::iota(id.begin(), id.end(), uint8_t{7});
  std::vector<Result<std::vector<uint8_t>>> got;
  std::vector<std::thread> waiters;
  got.reserve(3);
  for (int i = 0; i < 3; ++i) got.emplace_back(Error("not run"));
  for (int i = 0; i < 3; ++i)
    waiters.emplace_back([&, i] { got[static_cast<size_t>(i)] = rendezvous_wait(dir, "nccl-id.job1", 128, 20.0); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ASSERT_TRUE(rendezvous_publish(dir, "nccl-id.job1", id).ok());
  for (auto& t : waiters) t.join();
  for (auto& g : got) {
    ASSERT_TRUE(g.ok()) << g.error().what();
    EXPECT_EQ(*g, id);
  }
  auto late = rendezvous_wait(dir, "nccl-id.job2", 128, 0.1);  // nobody publishes job2
  ASSERT_FALSE(late.ok());
  EXPECT_THAT(late.error().what(), HasSubstr("did not publish"));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace moebius::parallel

namespace moebius::moe {
namespace {

// The step header every EP model starts a step with: ranks that are done (-1), idle (0) or busy.
TEST(EpStepHeader, SummaryAndCapacityAgreeOnEveryRank) {
  const std::vector<int32_t> busy = {3, 0, parallel::kEpRankDone, 1};
  const parallel::EpStepSummary s = parallel::summarize_ep_step(busy);
  EXPECT_FALSE(s.all_done);
  EXPECT_EQ(s.max_tokens, 3);
  // Every rank fits the decode capacity: the decode graphs' EP layers, on every rank.
  EXPECT_EQ(parallel::ep_step_capacity(s, 4, 64).value(), 4);
  EXPECT_EQ(parallel::ep_step_capacity(s, 3, 64).value(), 3);
  // One rank prefills: every rank, the idle and the decoding ones included, takes the prefill size.
  const std::vector<int32_t> prefill = {1, 40, 0, 0};
  EXPECT_EQ(parallel::ep_step_capacity(parallel::summarize_ep_step(prefill), 4, 64).value(), 64);
  const std::vector<int32_t> over = {65, 0};
  auto bad = parallel::ep_step_capacity(parallel::summarize_ep_step(over), 4, 64);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.error().what(), ::testing::HasSubstr("65 tokens"));

  const std::vector<int32_t> done = {parallel::kEpRankDone, parallel::kEpRankDone};
  EXPECT_TRUE(parallel::summarize_ep_step(done).all_done);
  EXPECT_EQ(parallel::summarize_ep_step(done).max_tokens, 0);
  EXPECT_EQ(parallel::ep_step_capacity(parallel::summarize_ep_step(done), 4, 64).value(), 4);
  const std::vector<int32_t> idle = {0, parallel::kEpRankDone};  // an empty step is not the end
  EXPECT_FALSE(parallel::summarize_ep_step(idle).all_done);
}

TEST(EpStepPlan, CountsAndSendOrderAcrossRanks) {
  // E = 8 over 4 ranks (2 each), k = 2. Rank 0: no tokens; rank 1: one token; rank 2: five
  // tokens all on experts 6 and 7 (rank 3); rank 3: two tokens.
  const std::vector<std::vector<int32_t>> ids = {{}, {1, 4}, {6, 7, 7, 6, 6, 7, 7, 6, 6, 7}, {0, 3, 2, 5}};
  std::vector<EpStepPlan> plans(4);
  auto st = parallel::run_ranks(4, [&](parallel::Communicator& c) -> Status {
    const auto& mine = ids[static_cast<size_t>(c.rank())];
    MOEBIUS_ASSIGN_OR_RETURN(plans[static_cast<size_t>(c.rank())],
                             make_ep_step_plan(c, mine.data(), static_cast<int64_t>(mine.size()) / 2, 2, 8));
    return Ok{};
  });
  for (auto& s : st) ASSERT_TRUE(s.ok()) << s.error().what();
  // counts[s * 4 + d]
  const std::vector<int32_t> want = {0, 0, 0, 0, /**/ 1, 0, 1, 0, /**/ 0, 0, 0, 10, /**/ 1, 2, 1, 0};
  for (const auto& p : plans) EXPECT_EQ(p.counts, want);
  EXPECT_EQ(plans[3].num_received(), 10);  // all from rank 2
  EXPECT_EQ(plans[3].recv_begin, (std::vector<int64_t>{0, 0, 0, 10, 10}));
  EXPECT_EQ(plans[0].num_received(), 2);  // one each from ranks 1 and 3
  EXPECT_EQ(plans[0].recv_begin, (std::vector<int64_t>{0, 0, 1, 1, 2}));
  // Rank 3's pairs (0, 3, 2, 5) -> owners (0, 1, 1, 2): order 0 | 1, 2 | 3, local ids 0 | 1, 0 | 1.
  EXPECT_EQ(plans[3].send_order, (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(plans[3].send_local_ids, (std::vector<int32_t>{0, 1, 0, 1}));
  EXPECT_EQ(plans[1].send_order, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(plans[1].send_local_ids, (std::vector<int32_t>{1, 0}));
}

TEST(EpStepPlan, RefusesExpertIdsOutOfRange) {
  std::vector<int32_t> counts;
  std::vector<int64_t> order;
  std::vector<int32_t> local;
  const int32_t ids[2] = {3, 8};
  auto st = ep_local_plan(ids, 1, 2, 8, 2, &counts, &order, &local);
  ASSERT_FALSE(st.ok());
  EXPECT_THAT(st.error().what(), ::testing::HasSubstr("expert 8, outside [0, 8)"));
}

}  // namespace
}  // namespace moebius::moe

namespace moebius::parallel {
namespace {

// The built-in launcher with /bin/sh as the worker: every rank sees its place; one failing worker
// brings the others down (they would sleep for a minute) and is named in the error.
TEST(Launcher, WorkersSeeTheirPlaceAndOneFailureStopsTheOthers) {
  const std::string dir = (std::filesystem::temp_directory_path() /
                           ("moebius-test-launch-" + std::to_string(::getpid()))).string();
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  LaunchOptions o;
  o.size = 3;
  o.argv = {"/bin/sh", "-c",
            "echo \"$MOEBIUS_EP_RANK $MOEBIUS_EP_SIZE $MOEBIUS_EP_LOCAL_RANK $NCCL_NVLS_ENABLE\" > " + dir +
                "/rank.$MOEBIUS_EP_RANK && test -d \"$MOEBIUS_EP_RENDEZVOUS\""};
  Status ok = launch_workers(o);
  ASSERT_TRUE(ok.ok()) << ok.error().what();
  for (int r = 0; r < 3; ++r) {
    std::ifstream f(dir + "/rank." + std::to_string(r));
    std::string line;
    std::getline(f, line);
    EXPECT_EQ(line, std::to_string(r) + " 3 " + std::to_string(r) + " 0");
  }
  const auto t0 = std::chrono::steady_clock::now();
  o.argv = {"/bin/sh", "-c", "if [ \"$MOEBIUS_EP_RANK\" = 1 ]; then exit 3; fi; exec sleep 60"};
  o.grace_s = 5;
  Status bad = launch_workers(o);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.error().what(), HasSubstr("rank 1 exited with status 3"));
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 30.0);
  o.argv = {"/nonexistent/moebius"};  // exec fails: 127
  Status missing = launch_workers(o);
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(missing.error().what(), HasSubstr("exited with status 127"));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace moebius::parallel
