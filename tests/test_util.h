// Shared helpers for the test suite.
#pragma once

#include <cstdint>
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

}  // namespace moebius::testing
