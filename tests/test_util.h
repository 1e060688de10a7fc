// Shared helpers for the test suite.
#pragma once

#include <sys/wait.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

namespace moebius::testing {

// tests/data, from $MOEBIUS_TEST_DATA_DIR when set (a build carried to another machine), else the
// source tree this binary was configured from.
inline std::string test_data_dir() {
  if (const char* d = std::getenv("MOEBIUS_TEST_DATA_DIR"); d != nullptr && *d != '\0') return d;
  return MOEBIUS_TEST_DATA_DIR;
}

// n normal(0, stddev) floats from a fixed seed.
inline std::vector<float> random_normal(int64_t n, uint32_t seed, float stddev = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, stddev);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = d(rng);
  return v;
}

// A shell command's exit status (-1 when it did not exit normally) and its stdout and stderr.
struct CliRun {
  int status = -1;
  std::string out;
};
inline CliRun run_shell(const std::string& command) {
  CliRun r;
  const std::string cmd = command + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int st = ::pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

}  // namespace moebius::testing
