// SwiGLU of the dense MLP layers (Qwen3-MoE's mlp_only_layers): out = silu(gate) * up, from one
// fused gate+up GEMM output. Launcher only (kernel in swiglu.cu); CPU reference
// cpu::swiglu_reference (src/cpu/swiglu.h).
//
// The expert MLPs do their SwiGLU inside the MoE GEMM (moe_gemm.cuh); this is the dense path,
// where cuBLAS computes gate_up = h [gate_proj; up_proj]^T.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace moebius::kernels {

// out[t, i] = bf16( silu(g) * u ),  g = gate_up[t, i], u = gate_up[t, I + i], silu(g) = g / (1 + e^-g)
//   gate_up  [T, 2I] bf16 (gate in columns [0, I), up in [I, 2I))
//   out      [T, I] bf16
//   T        host: rows (a graph bucket: every row is computed; rows never mix)
// fp32 math, one rounding. Device pointers 16-byte aligned; I a multiple of 8.
void launch_swiglu(const __nv_bfloat16* gate_up, int T, int I, __nv_bfloat16* out, cudaStream_t stream);

}  // namespace moebius::kernels
