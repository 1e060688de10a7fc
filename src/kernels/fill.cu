#include "kernels/fill.cuh"

#include <cuda_bf16.h>

#include "kernels/cuda_check.h"

namespace moebius::kernels {

namespace {

// splitmix64: a good 64-bit mix, cheap enough to run per element.
__device__ __forceinline__ uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

__global__ void fill_random_u64_kernel(uint64_t* dst, size_t words, uint64_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < words;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    dst[i] = mix(seed ^ mix(i));
}

__global__ void fill_random_tail_kernel(uint8_t* dst, size_t bytes, uint64_t seed) {
  for (size_t i = threadIdx.x; i < bytes; i += blockDim.x) dst[i] = static_cast<uint8_t>(mix(seed ^ mix(~i)));
}

__global__ void fill_random_bf16_kernel(__nv_bfloat16* dst, size_t count, float scale, uint64_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const float u = static_cast<float>(mix(seed ^ mix(i)) >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    dst[i] = __float2bfloat16((2.0f * u - 1.0f) * scale);
  }
}

__global__ void fill_u16_kernel(uint16_t* dst, size_t count, uint16_t value) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    dst[i] = value;
}

constexpr int kThreads = 256;
unsigned blocks_for(size_t n) {
  const size_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 65536 ? (b == 0 ? 1 : b) : 65536);
}

}  // namespace

void launch_fill_random_bytes(void* dst, size_t bytes, uint64_t seed, cudaStream_t stream) {
  MOEBIUS_LAUNCH_ASSERT(reinterpret_cast<uintptr_t>(dst) % 8 == 0, "fill destination must be 8-byte aligned");
  const size_t words = bytes / 8;
  if (words > 0) {
    fill_random_u64_kernel<<<blocks_for(words), kThreads, 0, stream>>>(static_cast<uint64_t*>(dst), words, seed);
    CUDA_CHECK_LAUNCH();
  }
  if (bytes % 8 != 0) {
    fill_random_tail_kernel<<<1, 32, 0, stream>>>(static_cast<uint8_t*>(dst) + words * 8, bytes % 8, seed);
    CUDA_CHECK_LAUNCH();
  }
}

void launch_fill_random_bf16(void* dst, size_t count, float scale, uint64_t seed, cudaStream_t stream) {
  if (count == 0) return;
  fill_random_bf16_kernel<<<blocks_for(count), kThreads, 0, stream>>>(static_cast<__nv_bfloat16*>(dst), count, scale,
                                                                      seed);
  CUDA_CHECK_LAUNCH();
}

void launch_fill_u16(void* dst, size_t count, uint16_t value, cudaStream_t stream) {
  if (count == 0) return;
  fill_u16_kernel<<<blocks_for(count), kThreads, 0, stream>>>(static_cast<uint16_t*>(dst), count, value);
  CUDA_CHECK_LAUNCH();
}

}  // namespace moebius::kernels
