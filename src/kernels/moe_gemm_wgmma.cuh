// Grouped expert GEMMs for large token counts (prefill) on Hopper tensor cores: wgmma with the
// weights dequantized in registers (sm_90a only). Launchers only; the kernels live in
// moe_gemm_wgmma.cu, whose header comment gives the shapes, the shared-memory layout and the
// pipeline.
//
// Same contract as the mma.sync prefill launchers in moe_gemm_prefill.cuh (and the decode ones in
// moe_gemm.cuh): the same MoeWeightFormat, [TAG_EXPERT_PTR_TABLE] pointer table, MoeGemmDims and
// MoeTiles from launch_moe_align; activations gathered through padded_pair_ids; GEMM1 with the
// activation fused on the accumulators through the gate/up 8-row interleave; GEMM2 kStore (fp32 y
// rows per pair, unweighted, deterministic) or kAtomic (bf16 atomics into out). The weights are
// the same [TAG_EXPERT_TILE_LAYOUT] bytes: a layer can switch between the three GEMM kernel
// families per launch without repacking.
//
//   tiles.block_m: 64 or 128 for every format (the mma.sync prefill kernel: 128 for bf16 and
//                  nvfp4 only, so it runs every tile set of those, and the int formats' at 64).
// Alignment: activation rows must be 16-byte aligned (x or h 16-byte aligned and the row stride a
// multiple of 8 elements); the launchers assert it. The MoE layer checks x before it calls and
// runs GEMM1 on the mma.sync prefill kernel otherwise (GEMM2 reads the layer's own h, always
// aligned).
// [TAG_MOE_GRAPH_CAPACITY] Persistent grid: min(#SMs, tiles.grid_tiles * ceil(row_tiles / 16))
// blocks from host values, each walking its share of (tile, row block) work items and skipping
// tiles whose tile_expert is -1; nothing syncs the host.
// Availability: the kernels exist only in builds whose MOEBIUS_CUDA_ARCHS contains 90a and run
// only on compute capability 9.0 devices (H100/H200); moe_gemm_wgmma_available() says whether
// both hold. In other builds the launchers abort.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/moe_gemm.cuh"

namespace moebius::kernels {

// True when this build carries the sm_90a kernels (MOEBIUS_CUDA_ARCHS contains 90a).
bool moe_gemm_wgmma_compiled();

// True when the kernels are compiled in and the current device is compute capability 9.0.
bool moe_gemm_wgmma_available();

// True when the wgmma kernels run this format at this block_m: 64 or 128 for every format (the
// mma.sync prefill kernels take 128 for bf16 and nvfp4 only).
inline bool moe_gemm_wgmma_supports(MoeWeightFormat format, int block_m) {
  (void)format;
  return block_m == 64 || block_m == 128;
}

// True when the wgmma kernels round this format's dequantized weights to bf16 before the tensor
// core: the int formats, whose fp16 group scale is folded into the weight as RN_bf16(q * s)
// ([TAG_INT_FOLDED_SCALE], kernels/moe_dequant.cuh; host mirror moe::folded_int_weight). nvfp4's
// fold is exact (4 x 2 significant bits) and bf16 is the weight itself.
inline bool moe_gemm_wgmma_rounds_weights(MoeWeightFormat format) {
  return format == MoeWeightFormat::kInt4 || format == MoeWeightFormat::kInt2;
}

// Whether activation rows starting at p with this stride (elements) are 16-byte aligned, which the
// wgmma kernels' 16-byte gathers need.
inline bool moe_gemm_wgmma_rows_aligned(const void* p, int stride) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0 && stride % 8 == 0;
}

// Tests and experiments: caps the persistent grid at `blocks` blocks (0, the default: one per
// SM). Results do not depend on it (each output element is one thread's fixed-order sum); the
// tests use a small cap to run many work items per block.
void moe_gemm_wgmma_set_grid_cap(int blocks);

// Arguments as launch_moe_gemm_prefill_gate_up: x [T, x_stride] bf16 (16-byte aligned rows),
// h [max_padded, h_stride] bf16.
void launch_moe_gemm_wgmma_gate_up(MoeWeightFormat format, const ExpertMatrixPtrs* experts, const MoeGemmDims& dims,
                                   const MoeTiles& tiles, const __nv_bfloat16* x, int x_stride,
                                   const MoeActivationParams& act, __nv_bfloat16* h, int h_stride,
                                   cudaStream_t stream);

// Arguments as launch_moe_gemm_prefill_down: h [max_padded, h_stride] bf16; kStore writes y
// [capacity * top_k, y_stride] fp32; kStoreBf16 the same rows in bf16 (y then points to bf16
// storage: 4-byte aligned, y_stride and the output width even; [TAG_MOE_BF16_Y]); kAtomic adds
// bf16(w * y) into out [capacity, out_stride].
void launch_moe_gemm_wgmma_down(MoeWeightFormat format, const ExpertMatrixPtrs* experts, const MoeGemmDims& dims,
                                const MoeTiles& tiles, const __nv_bfloat16* h, int h_stride, MoeCombineMode mode,
                                float* y, int y_stride, const float* topk_weights, __nv_bfloat16* out,
                                int out_stride, cudaStream_t stream);

}  // namespace moebius::kernels
