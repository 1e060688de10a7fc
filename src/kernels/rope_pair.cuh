// Device code shared by the rope kernel (rope.cu) and the attention decode prologue
// (attention.cu): one lane's QK-norm scale and neox RoPE rotation of a pair of rotary halves. Both
// kernels write q/k of the same tokens (prefill through rope.cu, decode through the attention
// kernel), so they must agree to the bit; one definition keeps the expression, and with it the
// compiler's FMA contraction, the same.
#pragma once

#include <cuda_runtime.h>

namespace moebius::kernels::rope_detail {

// x = elements (i, i + 1) of the first half of a head row, y = (i, i + 1) of the second half.
// norm: multiply by the row's 1/rms (inv) and the norm weights w = (w[i], w[i+1], w[half+i],
// w[half+i+1]) in the reference's order, (x * inv) * w. rotate: the rotation by the position's
// cos/sin of i and i + 1 (s_cos, s_sin: [half] each).
__device__ __forceinline__ void norm_rope_pair(float2& x, float2& y, bool norm, float inv, float4 w, bool rotate,
                                               const float* s_cos, const float* s_sin, int i) {
  if (norm) {
    x = make_float2(x.x * inv * w.x, x.y * inv * w.y);
    y = make_float2(y.x * inv * w.z, y.y * inv * w.w);
  }
  if (rotate) {
    const float c0 = s_cos[i], c1 = s_cos[i + 1], s0 = s_sin[i], s1 = s_sin[i + 1];
    const float2 xr = make_float2(x.x * c0 - y.x * s0, x.y * c1 - y.y * s1);
    const float2 yr = make_float2(y.x * c0 + x.x * s0, y.y * c1 + x.y * s1);
    x = xr;
    y = yr;
  }
}

}  // namespace moebius::kernels::rope_detail
