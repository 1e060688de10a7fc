// Device-side fills for dummy weights and poisoning: random data is generated where it lives, so
// benchmarks of multi-gigabyte layers start in milliseconds.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace moebius::kernels {

// Uniformly random bytes from a counter-based hash of (seed, index): same seed, same bytes.
void launch_fill_random_bytes(void* dst, size_t bytes, uint64_t seed, cudaStream_t stream);
// bf16 values uniform in [-scale, scale).
void launch_fill_random_bf16(void* dst, size_t count, float scale, uint64_t seed, cudaStream_t stream);
// Every 16-bit element := value (e.g. an fp16 scale).
void launch_fill_u16(void* dst, size_t count, uint16_t value, cudaStream_t stream);

}  // namespace moebius::kernels
