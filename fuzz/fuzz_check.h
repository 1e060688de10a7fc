// The fuzz targets' invariant check: a violated invariant aborts, which libFuzzer reports as a
// crash with the input that caused it (an exception could be caught on the way).
#pragma once

#include <cstdlib>

namespace moebius::fuzz {

inline void check(bool ok) {
  if (!ok) std::abort();
}

}  // namespace moebius::fuzz
