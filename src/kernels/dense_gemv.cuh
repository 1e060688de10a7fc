// Dense bf16 skinny GEMM ("GEMV") for decode: y[M, N] = x[M, K] W[N, K]^T with M = 1..16 tokens,
// bf16 in, fp32 accumulation, bf16 or fp32 out. Launchers only (kernel in dense_gemv.cu; design
// and numbers in docs/DENSE_KERNELS.md).
//
// Why a kernel of our own: at decode the dense projections are pure weight streams. One token
// reads Qwen3-30B-A3B's qkv weight (5120 x 2048 bf16, 21 MB) and o weight (2048 x 4096, 16.8 MB)
// once per layer and the lm_head (151936 x 2048, 622 MB) once per token: 4.6 + 3.7 + 136 us at the
// H200's 4.57 TB/s. cuBLAS took 11.4 (split-K + reduce), 9.1 and far more than the floor for these
// shapes (docs/PERF.md run E), and its kernels cannot start streaming weights before the previous
// kernel ends. This kernel is programmatic-dependent-launch aware (pdl.cuh): the weights do not
// depend on the previous kernel, so every block fills its shared-memory ring with weight bytes
// BEFORE griddepcontrol.wait, and only the activations x (a few KB) are read after it.
//
// The CPU reference is cpu::linear_reference (src/cpu/linear.h). runtime::DenseGemm dispatches
// here for small M and to cuBLAS otherwise.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/moe_combine.cuh"

namespace moebius::kernels {

// The largest token count the kernel takes (two n8 tiles of the m16n8k16 mma).
inline constexpr int kDenseGemvMaxM = 16;

// Dynamic shared memory one block needs for (M, K): the weight ring, the split-K reduction
// buffers and x [M, K] staged (zero-padded, with a bank-conflict pad per row).
size_t dense_gemv_smem_bytes(int M, int K);

// True when launch_dense_gemv takes (M, K) on the current device: 1 <= M <= 16, K > 0 a multiple of
// 8 (rows of 16-byte chunks) and dense_gemv_smem_bytes(M, K) within the opt-in shared-memory limit
// (Qwen3-30B-A3B: every shape up to M = 16; Qwen3-235B-A22B's o_proj, K = 8192: M <= 8).
bool dense_gemv_supports(int M, int K);

// y[m * ldy + n] = sum_k x[m * ldx + k] * w[n * K + k]   for m < M, n < N; nothing else is written.
//   x    [M, ldx] bf16, 16-byte aligned, ldx >= K and a multiple of 8 (the previous kernel's output)
//   w    [N, K] bf16, 16-byte aligned (a PyTorch Linear weight; read once, evict-first). [TAG_PDL_WEIGHTS]
//        Read BEFORE the PDL wait: it must not be written by the kernels just before on the stream.
//   y    [M, ldy] OutT = __nv_bfloat16 (round to nearest) or float; ldy >= N; any alignment
//   M    host, 0..16 (0: nothing is launched); N > 0; K per dense_gemv_supports
// Launched with the PDL attribute; safe after any kernel (see pdl.cuh's protocol). Graph-capturable
// (no allocation, no host synchronization). Deterministic: fixed summation order, no atomics.
template <typename OutT>
void launch_dense_gemv(const __nv_bfloat16* x, int64_t ldx, const __nv_bfloat16* w, int M, int N, int K, OutT* y,
                       int64_t ldy, cudaStream_t stream);

// [TAG_GEMV_RMS_NORM] The decode layer's "x += delta; h = RMSNorm(x) * weight" folded into the
// projection that reads h (the qkv GEMV): every block forms h [M, K] from the fp32 residual in
// shared memory, and block 0 writes the updated residual to resid_out. The output y is
// bit-identical to launch_add_rms_norm<float, float>(resid, delta, weight, M, K, eps, h) followed
// by launch_dense_gemv(h, K, w, ...), and resid_out to the residual that call leaves (with
// `combine`: launch_moe_combine into delta first).
//   resid      [M, K] fp32, read only (contiguous rows), 16-byte aligned
//   delta      [M, K] bf16 or nullptr (no add: the first layer), 16-byte aligned
//   weight     [K] fp32 RMSNorm weight
//   resid_out  [M, K] fp32 or nullptr: resid + delta, written by one block; must not be resid
//              (the other blocks still read it), 16-byte aligned
//   combine    [TAG_MOE_DEFERRED_COMBINE] instead of delta (combine.y set, delta null): the previous
//              MoE layer's combine, so delta[m] = bf16(sum_s w[m*k+s] * y[m*k+s]) as
//              launch_moe_combine forms it (moe_combine_sum.cuh; the same bits), for the live rows
//              m < *combine.num_tokens; past them delta is zero and no expert row is read (the
//              combine stage leaves those rows of its output as they were; padding rows, computed
//              and discarded). y 16-byte aligned, y_stride a multiple of 4, M <= capacity.
//              Every block reads the M*k rows (k * K * 4 bytes a token, from L2): for small M.
struct DenseGemvRmsNorm {
  const float* resid = nullptr;
  const __nv_bfloat16* delta = nullptr;
  const float* weight = nullptr;
  float eps = 1e-6f;
  float* resid_out = nullptr;
  MoeCombineSource combine;
};
// M, N, K, w, y, ldy as launch_dense_gemv (x is formed from `norm`).
template <typename OutT>
void launch_dense_gemv_rms_norm(const DenseGemvRmsNorm& norm, const __nv_bfloat16* w, int M, int N, int K, OutT* y,
                                int64_t ldy, cudaStream_t stream);

}  // namespace moebius::kernels
