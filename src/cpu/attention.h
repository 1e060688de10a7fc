// The CPU reference causal GQA attention for one sequence, shared by the Qwen3-MoE CPU backend and
// the CUDA attention tests. Plainly right rather than fast: scores, softmax and the weighted sum
// of values are computed in double.
#pragma once

#include <cstdint>

namespace moebius::cpu {

// One sequence of T query tokens at positions p0 .. p0 + T - 1 over a cache of p0 + T positions:
//   q        [T, nh, hd] fp32
//   k_rows   [p0 + T] pointers; k_rows[j] -> [nkv, hd] fp32, the keys at position j
//   v_rows   [p0 + T] pointers; likewise the values
//   out      [T, nh, hd] fp32
// Query head qh reads KV head qh / (nh / nkv) (nkv divides nh); token t sees positions
// [0, p0 + t]; scale = 1 / sqrt(hd). Rows are row pointers so a paged cache needs no copy.
void attention_reference(const float* q, int64_t T, int nh, int nkv, int hd, int64_t p0, const float* const* k_rows,
                         const float* const* v_rows, float* out);

}  // namespace moebius::cpu
