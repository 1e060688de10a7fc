// Probe: do bf16x2 multiplies and bf16 mma.sync keep subnormal inputs (no flush to zero)?
// The NVFP4 dequant places e2m1 codes into bf16 bits as value * 2^-126, which makes the codes
// with a zero exponent (0.5 -> 2^-127) bf16 subnormals. This decides whether that trick is exact.
// Build: nvcc -gencode=arch=compute_90a,code=sm_90a -o probe probe_bf16_subnormal.cu
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdint>
#include <cstring>

__global__ void probe(uint32_t* out) {
  uint32_t a_bits = 0x00600040u;  // lo 0x0040 = 2^-127, hi 0x0060 = 1.5 * 2^-127, both subnormal
  __nv_bfloat162 a, s;
  memcpy(&a, &a_bits, 4);
  uint32_t s_bits = 0x5F805F80u;  // 2^64 in both halves
  memcpy(&s, &s_bits, 4);
  __nv_bfloat162 p = __hmul2(a, s);  // expect 2^-63 and 1.5*2^-63
  memcpy(&out[0], &p, 4);
  // mma.sync m16n8k16 with A = subnormal 2^-127 everywhere, B = 2^100: C = 16 * 2^-27
  uint32_t A[4] = {0x00400040u, 0x00400040u, 0x00400040u, 0x00400040u};
  uint32_t B[2] = {0x71807180u, 0x71807180u};  // 2^100
  float C[4] = {0, 0, 0, 0};
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(C[0]), "+f"(C[1]), "+f"(C[2]), "+f"(C[3])
      : "r"(A[0]), "r"(A[1]), "r"(A[2]), "r"(A[3]), "r"(B[0]), "r"(B[1]));
  if (threadIdx.x == 0) memcpy(&out[1], &C[0], 4);
  // fma.rn.bf16x2 with subnormal input
  __nv_bfloat162 f = __hfma2(a, s, __float2bfloat162_rn(0.0f));
  memcpy(&out[2], &f, 4);
}

int main() {
  uint32_t* d;
  cudaMalloc(&d, 16);
  probe<<<1, 32>>>(d);
  uint32_t h[3];
  cudaMemcpy(h, d, 12, cudaMemcpyDeviceToHost);
  float c;
  memcpy(&c, &h[1], 4);
  printf("hmul2 subnormal*2^64: 0x%08x (expect 0x20402000: 1.5*2^-63 | 2^-63)\n", h[0]);
  printf("mma subnormal A: %g (expect %g)\n", c, 16.0 * 1.0 / (1 << 27));
  printf("hfma2 subnormal: 0x%08x (expect 0x20402000)\n", h[2]);
  return 0;
}
