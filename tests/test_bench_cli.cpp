// `moebius bench moe`, `bench generate`, `bench attention`, `bench serve` and `bench engine` through the real binary: their options' bad values get
// a clear error that names the option and a non-zero exit, before any device or weight work starts
// (the CUDA backend's options are validated on machines without a GPU too).
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "test_util.h"

namespace moebius {
namespace {

using testing::CliRun;
CliRun run_moebius(const std::string& args) { return testing::run_shell(std::string(MOEBIUS_BIN) + " " + args); }

void expect_error(const std::string& args, const std::string& needle) {
  const CliRun r = run_moebius(args);
  EXPECT_NE(r.status, 0) << args << "\n" << r.out;
  EXPECT_NE(r.out.find(needle), std::string::npos) << args << "\n" << r.out;
}

TEST(BenchMoeCli, BadOptionsNameTheOption) {
  if (!std::filesystem::exists(MOEBIUS_BIN)) GTEST_SKIP() << MOEBIUS_BIN << " not built";
  // The routing choice: cuda only, and only auto or separate.
  expect_error("bench moe --backend cpu --geometry 64,32,8,2 --tokens 1 --routing separate", "--routing");
  expect_error("bench moe --backend cuda --geometry 64,32,8,2 --tokens 1 --routing fused-always", "--routing");
  // The GEMM path and tile belong to the CUDA backend.
  expect_error("bench moe --backend cpu --geometry 64,32,8,2 --tokens 1 --gemm-path wgmma", "--gemm-path");
  expect_error("bench moe --backend cpu --geometry 64,32,8,2 --tokens 1 --block-m 64", "--block-m");
  expect_error("bench moe --backend cpu --geometry 64,32,8,2 --tokens 1 --format int3", "--format");
  expect_error("bench moe --backend cpu --geometry 64,32,8 --tokens 1", "geometry");
  // The ceilings the ratios divide by: a device's, so not on the CPU backend; named on any machine.
  expect_error("bench moe --backend cpu --geometry 64,32,8,2 --tokens 1 --ceilings measure", "--ceilings");
  expect_error("bench moe --backend cuda --geometry 64,32,8,2 --tokens 1 --ceilings fast", "--ceilings");
  expect_error("bench generate --geometry qwen3-30b-a3b --ceilings fast", "--ceilings");
  expect_error("bench attention --ceilings fast", "--ceilings");
  expect_error("bench gemv --ceilings fast", "--ceilings");
}

// `bench ceilings` needs a GPU: here (CI has none) a clear error and a non-zero exit, never a crash.
TEST(BenchCeilingsCli, WithoutAGpuIsAClearError) {
  if (!std::filesystem::exists(MOEBIUS_BIN)) GTEST_SKIP() << MOEBIUS_BIN << " not built";
  const CliRun probe = run_moebius("bench ceilings --device-mib 64 --host-mib 64 --gemm-n 1024");
  if (probe.status == 0) GTEST_SKIP() << "a GPU is visible: the GPU machine's run measures it";
  EXPECT_EQ(probe.status, 2) << probe.out;  // CLI::RuntimeError(2): an error, not an abort
  EXPECT_TRUE(probe.out.find("no CUDA device is visible") != std::string::npos ||
              probe.out.find("no CUDA support") != std::string::npos)
      << probe.out;
  expect_error("bench ceilings --device-mib 0", "--device-mib");
  expect_error("bench ceilings --gemm-n 1000", "--gemm-n");
}

TEST(BenchGenerateCli, BadExpertCacheOptionsNameTheOption) {
  if (!std::filesystem::exists(MOEBIUS_BIN)) GTEST_SKIP() << MOEBIUS_BIN << " not built";
  // Checked before the model is made (so without a GPU too).
  const std::string base = "bench generate --geometry qwen3-30b-a3b --load-format dummy --context 64 --prefill 16 ";
  expect_error(base + "--gpu-memory-budget 8 --expert-cache lfu", "'--expert-cache': 'lfu': expected off, lru or freq");
  expect_error(base + "--gpu-memory-budget 8 --expert-cache freq --expert-cache-decay 0",
               "'--expert-cache-decay': must be in (0, 1]");
  expect_error(base + "--gpu-memory-budget 8 --expert-cache freq --expert-cache-decay 2",
               "'--expert-cache-decay': must be in (0, 1]");
  expect_error(base + "--gpu-memory-budget 8 --expert-cache lru --expert-cache-swaps -3",
               "'--expert-cache-swaps': must be >= 0");
  // No cold experts without offload (--max-resident-experts also makes experts cold).
  expect_error(base + "--expert-cache lru", "needs expert offload (--gpu-memory-budget)");
}

TEST(BenchAttentionCli, BadOptionsNameTheOption) {
  if (!std::filesystem::exists(MOEBIUS_BIN)) GTEST_SKIP() << MOEBIUS_BIN << " not built";
  // Checked before the device is asked for (so without a GPU too).
  expect_error("bench attention --mode decode --merge global", "--merge");
  expect_error("bench attention --mode decode --max-splits 300", "--max-splits");
  expect_error("bench attention --mode decode --max-splits -1", "--max-splits");
  expect_error("bench attention --mode sideways", "--mode");
  expect_error("bench attention --mode decode --heads 34 --kv-heads 2", "--heads");
  expect_error("bench attention --mode decode --context 1024,x", "--context");
}

TEST(BenchServeCli, BadOptionsNameTheOption) {
  if (!std::filesystem::exists(MOEBIUS_BIN)) GTEST_SKIP() << MOEBIUS_BIN << " not built";
  // Checked before any connection is made.
  expect_error("bench serve --model m --input-len 10 --shared-prefix-len 11", "--shared-prefix-len");
  expect_error("bench serve --model m --input-len 10 --shared-prefix-len -1", "--shared-prefix-len");
  expect_error("bench serve --model m --temperature -1", "--temperature");
  expect_error("bench serve --model m --top-k -2", "--top-k");
  expect_error("bench serve --model m --top-p 0", "--top-p");
}

// bench engine on the tiny serving tokenizer: every request completes and the per-step split is
// printed; bad options and a missing tokenizer are named.
TEST(BenchEngineCli, RunsAndNamesBadOptions) {
  if (!std::filesystem::exists(MOEBIUS_BIN)) GTEST_SKIP() << MOEBIUS_BIN << " not built";
  const std::string tok = testing::test_data_dir() + "/tiny-serve";
  const CliRun r = run_moebius("bench engine --tokenizer " + tok + " --seqs 4 --requests 6 --output-len 9 "
                               "--temperature 0.8 --top-p 0.9 --logprobs 2");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("output tokens 54,"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("per step:"), std::string::npos) << r.out;
  expect_error("bench engine --tokenizer " + tok + " --seqs 0", "--seqs");
  expect_error("bench engine --tokenizer " + tok + " --top-p 2", "--top-p");
  expect_error("bench engine --tokenizer " + tok + " --row spiky", "--row");
  expect_error("bench engine --tokenizer /nonexistent", "/nonexistent");
}

TEST(BenchMoeCli, CpuBackendRunsASmallGeometry) {
  if (!std::filesystem::exists(MOEBIUS_BIN)) GTEST_SKIP() << MOEBIUS_BIN << " not built";
  const CliRun r = run_moebius("bench moe --backend cpu --geometry 64,32,8,2 --format nvfp4 --tokens 1,3 --iters 1");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("geometry"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace moebius
