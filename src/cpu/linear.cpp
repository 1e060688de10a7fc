#include "cpu/linear.h"

namespace moebius::cpu {

void linear_reference(const float* x, const float* w, int64_t T, int64_t N, int64_t K, float* y) {
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n) {
      const float* xt = x + t * K;
      const float* wn = w + n * K;
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += static_cast<double>(xt[k]) * wn[k];
      y[t * N + n] = static_cast<float>(s);
    }
}

}  // namespace moebius::cpu
