#include "cpu/swiglu.h"

#include <cmath>

namespace moebius::cpu {

void swiglu_reference(const float* gate, int64_t gate_stride, const float* up, int64_t up_stride, int64_t T,
                      int64_t I, float* out) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < I; ++i) {
      const float g = gate[t * gate_stride + i];
      out[t * I + i] = g / (1.0f + std::exp(-g)) * up[t * up_stride + i];
    }
}

}  // namespace moebius::cpu
