// RMSNorm over rows, fp32 math, bf16 out: launchers only (kernels live in norm.cu).
//
// The CPU reference is moebius::cpu::rms_norm_reference (src/cpu/norm.h); the Qwen3-MoE CPU
// backend orders a layer as
//   h = RMSNorm(x) * input_norm;  x += attn(h);  h = RMSNorm(x) * post_norm;  x += moe(h)
// with x, the residual stream, in fp32. launch_add_rms_norm is the "x += y; h = RMSNorm(x) * w"
// step between two sublayers (and, with y == nullptr, the first norm of the model): keep the
// residual x in fp32 to match the CPU backend; a bf16 residual (vLLM's choice) is also offered and
// rounds x after the add, before the norm reads it.
//
// Per-head RMSNorm (Qwen3's q_norm / k_norm over [T, heads, hd]) is launch_rms_norm over
// [T * heads, hd] rows when the heads are contiguous; the model runner's path fuses it into
// launch_qk_norm_rope_kv (rope.cuh).
//
// [TAG_ATTN_GRAPH_BUCKET] Row-wise ops take a HOST row count: a CUDA graph captured for a batch
// bucket of T rows normalises all T, padding rows included (their output is garbage and unused;
// rows never mix).
//
// Launch: with the programmatic-dependent-launch attribute (pdl.cuh); the kernels wait for the
// previous kernel before reading x and y and let the next one launch right after. [TAG_PDL_WEIGHTS]
// The weight w is read BEFORE that wait (it is a constant): it must not be written by the kernels
// just before on the stream.
//
// Types: X (input / residual) is __nv_bfloat16 or float, W (weight) is __nv_bfloat16 or float;
// all four combinations are instantiated. Pointers are device pointers; x, y, out must be 16-byte
// aligned and H a multiple of 8 (16-byte vector loads).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

namespace moebius::kernels {

// out[t, :] = bf16( (x[t, :] * inv_rms(x[t, :])) * w ),  inv_rms = 1 / sqrt(mean(x^2) + eps)
//   x    [T, H] X       w [H] W       out [T, H] bf16, not overlapping x
template <typename X, typename W>
void launch_rms_norm(const X* x, const W* w, int T, int H, float eps, __nv_bfloat16* out, cudaStream_t stream);

// x[t, :] = X(x[t, :] + y[t, :]);  out[t, :] = bf16( (x[t, :] * inv_rms(x[t, :])) * w )
//   x    [T, H] X, in/out (the residual stream)
//   y    [T, H] bf16 (the sublayer's output), or nullptr: no add, x is not written
//   w    [H] W      out [T, H] bf16
template <typename X, typename W>
void launch_add_rms_norm(X* x, const __nv_bfloat16* y, const W* w, int T, int H, float eps, __nv_bfloat16* out,
                         cudaStream_t stream);

}  // namespace moebius::kernels
