// The warp-level tensor-core product the small kernels share: mma.sync m16n8k16 with bf16 inputs
// and fp32 accumulators (sm_80+; Hopper runs it at about two thirds of its wgmma rate). Fragment
// layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16"), lane = 4g + t:
//   A (16 x 16, row-major): a[0] = rows g, k 2t..2t+1; a[1] = row g + 8, same k; a[2] = row g,
//     k 2t+8..2t+9; a[3] = row g + 8, same k. Two bf16 per register, the lower k in the low half.
//   B (16 x 8, column-major): b0 = k 2t..2t+1 of column g; b1 = k 2t+8..2t+9 of column g.
//   C/D (16 x 8): c[0], c[1] = row g, columns 2t, 2t+1; c[2], c[3] = row g + 8, same columns.
// Device code only.
#pragma once

#include <cstdint>

namespace moebius::kernels {

// c += A * B.
__device__ __forceinline__ void mma_m16n8k16_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace moebius::kernels
