// Grouped expert GEMMs for large token counts (prefill), with in-kernel dequantization.
// Launchers only; the kernels live in moe_gemm_prefill.cu.
//
// Same contract as the decode launchers in moe_gemm.cuh (read that header first): the same
// MoeWeightFormat, [TAG_EXPERT_PTR_TABLE] pointer table, MoeGemmDims, and MoeTiles from
// launch_moe_align; activations gathered through padded_pair_ids (no permuted copy); GEMM1 with
// the activation fused on the accumulators through the gate/up 8-row interleave; GEMM2 kStore
// (fp32 y rows per pair, unweighted, deterministic) or kAtomic (bf16 atomics into out). The
// weights are the same [TAG_EXPERT_TILE_LAYOUT] bytes the decode kernel reads: a layer can switch
// between the two paths per launch without repacking.
//
// What differs is the tiling, for many tokens per expert: one block computes 256 weight rows
// (16 row tiles) x block_m tokens over all of K, with the weight chunks, the nvfp4 block scales
// and the gathered activation rows staged through a multi-stage cp.async pipeline in shared
// memory; see moe_gemm_prefill.cu for the shapes and the reasons.
//
//   tiles.block_m: 64 (every format) or 128 (bf16 and nvfp4 only; the int formats keep a second
//                  accumulator set for the group scales and would not fit in registers).
// Odd shapes run on this path too: K need not be a multiple of 8 or 16, and activation rows need
// not be 16-byte aligned (then the rows are gathered with plain loads instead of cp.async: slower,
// same results).
// [TAG_MOE_GRAPH_CAPACITY] Grid = (ceil(row_tiles / 16), tiles.grid_tiles) from host values; a
// block whose tile_expert is -1 exits at once; nothing syncs the host.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "kernels/moe_gemm.cuh"

namespace moebius::kernels {

// True when the prefill kernels run this format at this block_m.
inline bool moe_gemm_prefill_supports(MoeWeightFormat format, int block_m) {
  if (block_m == 64) return true;
  return block_m == 128 && (format == MoeWeightFormat::kBF16 || format == MoeWeightFormat::kNvFp4);
}

// Arguments as launch_moe_gemm_gate_up: x [T, x_stride] bf16, h [max_padded, h_stride] bf16.
void launch_moe_gemm_prefill_gate_up(MoeWeightFormat format, const ExpertMatrixPtrs* experts,
                                     const MoeGemmDims& dims, const MoeTiles& tiles, const __nv_bfloat16* x,
                                     int x_stride, const MoeActivationParams& act, __nv_bfloat16* h, int h_stride,
                                     cudaStream_t stream);

// Arguments as launch_moe_gemm_down: h [max_padded, h_stride] bf16; kStore writes y
// [capacity * top_k, y_stride] fp32; kAtomic adds bf16(w * y) into out [capacity, out_stride].
void launch_moe_gemm_prefill_down(MoeWeightFormat format, const ExpertMatrixPtrs* experts, const MoeGemmDims& dims,
                                  const MoeTiles& tiles, const __nv_bfloat16* h, int h_stride, MoeCombineMode mode,
                                  float* y, int y_stride, const float* topk_weights, __nv_bfloat16* out,
                                  int out_stride, cudaStream_t stream);

}  // namespace moebius::kernels
