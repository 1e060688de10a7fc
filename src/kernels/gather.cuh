// Row gathers: the token embedding lookup at the start of the model and the pick of each
// sequence's last row before lm_head. Launchers only (kernels in gather.cu); CPU references in
// src/cpu/gather.h.
//
// [TAG_ATTN_GRAPH_BUCKET] Both take a HOST row count (the graph bucket) and read the indices from
// device memory, so a graph captured for T rows replays for any live batch: an index < 0 (or, for
// the embedding, >= vocab) marks a padding row, which is written as zeros (finite, so the norms and
// GEMMs that follow cannot meet NaN in rows nobody reads).
//
// Pointers are device pointers, 16-byte aligned; H (and the strides) a multiple of 8 elements.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace moebius::kernels {

// out[t, :] = float(table[ids[t], :])  (the fp32 residual stream starts from the bf16 embedding)
//   table  [vocab, H] bf16       ids [T] int32       out [T, H] fp32
void launch_embedding(const __nv_bfloat16* table, int64_t vocab, const int32_t* ids, int T, int H, float* out,
                      cudaStream_t stream);

// out[s, :] = src[rows[s] * src_stride + :]  for s < S (rows[s] < 0: zeros)
//   src  [*, src_stride] bf16    rows [S] int32    out [S, H] bf16 (dense rows)
void launch_gather_rows(const __nv_bfloat16* src, int64_t src_stride, const int32_t* rows, int S, int H,
                        __nv_bfloat16* out, cudaStream_t stream);

}  // namespace moebius::kernels
