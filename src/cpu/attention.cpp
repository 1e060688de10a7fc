#include "cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace moebius::cpu {

void attention_reference(const float* q, int64_t T, int nh, int nkv, int hd, int64_t p0, const float* const* k_rows,
                         const float* const* v_rows, float* out) {
  const int group = nh / nkv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t t = 0; t < T; ++t)
    for (int qh = 0; qh < nh; ++qh) {
      const int64_t last = p0 + t;
      const int64_t kv_off = int64_t{qh / group} * hd;
      const float* qv = q + (t * nh + qh) * hd;
      std::vector<double> p(static_cast<size_t>(last + 1));
      double mx = -INFINITY;
      for (int64_t j = 0; j <= last; ++j) {
        const float* kv = k_rows[j] + kv_off;
        double s = 0;
        for (int d = 0; d < hd; ++d) s += static_cast<double>(qv[d]) * kv[d];
        p[static_cast<size_t>(j)] = s * scale;
        mx = std::max(mx, s * scale);
      }
      double sum = 0;
      for (double& x : p) sum += (x = std::exp(x - mx));
      std::vector<double> acc(static_cast<size_t>(hd), 0.0);
      for (int64_t j = 0; j <= last; ++j) {
        const float* vv = v_rows[j] + kv_off;
        const double pj = p[static_cast<size_t>(j)] / sum;
        for (int d = 0; d < hd; ++d) acc[static_cast<size_t>(d)] += pj * vv[d];
      }
      float* o = out + (t * nh + qh) * hd;
      for (int d = 0; d < hd; ++d) o[d] = static_cast<float>(acc[static_cast<size_t>(d)]);
    }
}

}  // namespace moebius::cpu
