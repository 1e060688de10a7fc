// Shared helpers for the test suite.
#pragma once

#include <cstdlib>
#include <string>

namespace moebius::testing {

// tests/data, from $MOEBIUS_TEST_DATA_DIR when set (a build carried to another machine), else the
// source tree this binary was configured from.
inline std::string test_data_dir() {
  if (const char* d = std::getenv("MOEBIUS_TEST_DATA_DIR"); d != nullptr && *d != '\0') return d;
  return MOEBIUS_TEST_DATA_DIR;
}

}  // namespace moebius::testing
