#include "cpu/gather.h"

#include <algorithm>

namespace moebius::cpu {

void gather_rows_reference(const float* src, int64_t rows, int64_t cols, const int32_t* idx, int64_t n, float* out) {
  for (int64_t s = 0; s < n; ++s) {
    float* dst = out + s * cols;
    if (idx[s] < 0 || idx[s] >= rows) std::fill_n(dst, cols, 0.0f);
    else std::copy_n(src + int64_t{idx[s]} * cols, cols, dst);
  }
}

}  // namespace moebius::cpu
