// SwiGLU (swiglu.cuh): elementwise over 8-element (16-byte) chunks, a grid-stride loop over
// T * I / 8 chunks. Memory-bound; at Qwen3 dense sizes (I = 6144) a decode row is 24 KiB.
#include "kernels/swiglu.cuh"

#include "kernels/cuda_check.h"

namespace moebius::kernels {
namespace {

__global__ void swiglu_kernel(const __nv_bfloat16* __restrict__ gate_up, int64_t chunks, int I,
                              __nv_bfloat16* __restrict__ out) {
  const int per_row = I / 8;
  for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < chunks;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = c / per_row;
    const int i = static_cast<int>(c % per_row) * 8;
    const __nv_bfloat16* row = gate_up + t * 2 * I;
    const uint4 gu = *reinterpret_cast<const uint4*>(row + i);
    const uint4 uu = *reinterpret_cast<const uint4*>(row + I + i);
    const __nv_bfloat162* g = reinterpret_cast<const __nv_bfloat162*>(&gu);
    const __nv_bfloat162* u = reinterpret_cast<const __nv_bfloat162*>(&uu);
    uint4 o;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 gf = __bfloat1622float2(g[j]), uf = __bfloat1622float2(u[j]);
      // expf, not __expf: the CPU reference uses std::exp, and this kernel is nowhere near
      // compute-bound.
      h[j] = __floats2bfloat162_rn(gf.x / (1.0f + expf(-gf.x)) * uf.x, gf.y / (1.0f + expf(-gf.y)) * uf.y);
    }
    *reinterpret_cast<uint4*>(out + t * I + i) = o;
  }
}

}  // namespace

void launch_swiglu(const __nv_bfloat16* gate_up, int T, int I, __nv_bfloat16* out, cudaStream_t stream) {
  MOEBIUS_LAUNCH_ASSERT(T >= 0 && I > 0 && I % 8 == 0, "swiglu: I must be a positive multiple of 8");
  MOEBIUS_LAUNCH_ASSERT(
      reinterpret_cast<uintptr_t>(gate_up) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0,
      "swiglu: gate_up and out must be 16-byte aligned");
  const int64_t chunks = static_cast<int64_t>(T) * (I / 8);
  if (chunks == 0) return;
  const int threads = 256;
  const int64_t blocks = (chunks + threads - 1) / threads;
  swiglu_kernel<<<static_cast<unsigned>(blocks < 4096 ? blocks : 4096), threads, 0, stream>>>(gate_up, chunks, I,
                                                                                               out);
  CUDA_CHECK_LAUNCH();
}

}  // namespace moebius::kernels
