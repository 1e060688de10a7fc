// Qwen3 attention prologue, fused: per-head RMSNorm of q and k (QK-norm), RoPE (neox layout) on
// both, and the K/V rows written into the paged cache. Launcher only (kernel in rope.cu).
//
// Prefill and mixed steps only: a decode step does this inside the attention kernel
// (AttentionDecodeToken in attention.cuh, the same arithmetic).
//
// Fused because every step is row-local and the q/k rows come straight from the QKV GEMM: one
// pass reads each q/k/v element once and writes it once, instead of three kernels each re-reading
// [T, (nh + 2 nkv) hd]. Norm and rope stay in fp32 between the steps and round to bf16 once, which
// is what the CPU reference (cpu::rms_norm_reference then cpu::rope_neox_reference, fp32) does
// up to that final rounding.
//
// Per token t (at position positions[t], written to physical slot slot_mapping[t]):
//   q[t, h, :] = bf16(rope(rmsnorm(q[t, h, :]) * q_norm))           in place, h < nh
//   k_cache[slot of t, kvh, :] = bf16(rope(rmsnorm(k[t, kvh, :]) * k_norm))   kvh < nkv
//   v_cache[slot of t, kvh, :] = v[t, kvh, :]
// rope: the pair (x[i], x[i + hd/2]) is rotated by angle = float(pos) * inv_freq[i] (an fp32
// product, as transformers forms it); cos/sin of that angle are evaluated in double and rounded to
// fp32, matching cpu::rope_neox_reference bit for bit up to libm's last-ulp differences.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace moebius::kernels {

// Arguments (device pointers unless noted):
//   q            [T, q_stride] bf16, in/out: head h of token t at q + t*q_stride + h*hd
//   k            [T, k_stride] bf16, in: head kvh at k + t*k_stride + kvh*hd (not written)
//   v            [T, v_stride] bf16, in   (q, k, v may be slices of one fused QKV GEMM output,
//                                          stride (nh + 2 nkv) * hd)
//   q_norm       [hd] fp32, or nullptr: no RMSNorm on q (plain RoPE)
//   k_norm       [hd] fp32, or nullptr: no RMSNorm on k
//   positions    [T] int32: absolute position of each token (>= 0)
//   inv_freq     [hd / 2] fp32: cpu::rope_inv_freq(rope_theta, hd), uploaded
//   slot_mapping [T] int32: physical cache slot (block * block_size + offset); < 0: the token's
//                K/V are not written (graph-bucket padding)  [TAG_KV_CACHE_LAYOUT]
//   k_cache, v_cache  [num_blocks, nkv, block_size, hd] bf16 (kv_cache.cuh); only the slots named
//                in slot_mapping are written
//   T            host: rows to process, the graph bucket size [TAG_ATTN_GRAPH_BUCKET]
//   nh, nkv, hd  host: heads; hd even, a multiple of 4, <= 256 (Qwen3: 128; tiny fixture: 16)
//   eps          host: rms_norm_eps
// Strides must be multiples of 2 elements (4-byte bf16x2 accesses).
void launch_qk_norm_rope_kv(__nv_bfloat16* q, int64_t q_stride, const __nv_bfloat16* k, int64_t k_stride,
                            const __nv_bfloat16* v, int64_t v_stride, const float* q_norm, const float* k_norm,
                            const int32_t* positions, const float* inv_freq, const int32_t* slot_mapping,
                            __nv_bfloat16* k_cache, __nv_bfloat16* v_cache, int T, int nh, int nkv, int hd,
                            int block_size, float eps, cudaStream_t stream);

}  // namespace moebius::kernels
