#include "kernels/read_stream.cuh"

#include "kernels/cuda_check.h"

namespace moebius::kernels {

namespace {

constexpr int kThreads = 512;
// Four independent 16-byte loads per lane per round: Hopper needs ~40 KB in flight per SM to cover
// the HBM latency at full rate (Little's law: ~4.6 TB/s x ~1 us over 132 SMs), and 512 threads x
// 64 bytes is 32 KB per block, two blocks per SM. The XOR is the cheapest use of a load that the
// compiler cannot drop.
constexpr int kLoadsPerRound = 4;

// Read-only, no reuse: the non-coherent path with the L1 skipped (ld.global.nc.L1::no_allocate),
// so the stream pays for DRAM and L2 only, as the weight loads of the decode GEMMs do.
__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// src [vectors] uint4; each round covers kLoadsPerRound * gridDim.x * kThreads consecutive vectors,
// lane-contiguous so every warp load is 512 bytes of one line run.
__global__ void __launch_bounds__(kThreads) read_stream_xor_kernel(const uint4* __restrict__ src, size_t vectors,
                                                                   uint32_t* __restrict__ block_xor) {
  const size_t stride = static_cast<size_t>(gridDim.x) * kThreads;
  uint32_t acc = 0;
  size_t i = static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x;
  for (; i + (kLoadsPerRound - 1) * stride < vectors; i += kLoadsPerRound * stride) {
    uint4 v[kLoadsPerRound];
#pragma unroll
    for (int r = 0; r < kLoadsPerRound; ++r) v[r] = load_stream(src + i + r * stride);
#pragma unroll
    for (int r = 0; r < kLoadsPerRound; ++r) acc ^= v[r].x ^ v[r].y ^ v[r].z ^ v[r].w;
  }
  for (; i < vectors; i += stride) {
    const uint4 v = load_stream(src + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
  __shared__ uint32_t warp_xor[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_xor[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t b = 0;
    for (int w = 0; w < kThreads / 32; ++w) b ^= warp_xor[w];
    block_xor[blockIdx.x] = b;
  }
}

}  // namespace

void launch_read_stream_xor(const void* src, size_t bytes, int blocks, uint32_t* block_xor, cudaStream_t stream) {
  MOEBIUS_LAUNCH_ASSERT(reinterpret_cast<uintptr_t>(src) % 16 == 0, "read stream source must be 16-byte aligned");
  MOEBIUS_LAUNCH_ASSERT(bytes % 64 == 0, "read stream bytes must be a multiple of 64");
  MOEBIUS_LAUNCH_ASSERT(blocks >= 1, "read stream needs at least one block");
  read_stream_xor_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const uint4*>(src), bytes / 16, block_xor);
  CUDA_CHECK_LAUNCH();
}

}  // namespace moebius::kernels
