// Row gathers in fp32: the references for kernels::launch_embedding and launch_gather_rows
// (src/kernels/gather.cuh). An index < 0 or >= the source's row count gives a row of zeros (the
// kernels' padding rows).
#pragma once

#include <cstdint>

namespace moebius::cpu {

// out[s, :] = src[idx[s], :] for s < n; src [rows, cols], out [n, cols].
void gather_rows_reference(const float* src, int64_t rows, int64_t cols, const int32_t* idx, int64_t n, float* out);

}  // namespace moebius::cpu
