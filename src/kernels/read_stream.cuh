// A read-only HBM stream: the kernel `moebius bench ceilings` times to measure the device's memory
// read rate, the floor that every weight-streaming benchmark divides by (docs/PERF.md). It also
// reads mapped pinned host memory (the zero-copy offload path's ceiling) when given such a pointer.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace moebius::kernels {

// block_xor[b] := the XOR of the 32-bit words block b read; the XOR over all b is the XOR of every
// 32-bit word of src[0, bytes) whatever the grid, so a test checks that every byte was read.
//   src        device or mapped host memory, 16-byte aligned; bytes a multiple of 64
//   blocks     grid size (>= 1); block_xor has `blocks` entries (device memory)
void launch_read_stream_xor(const void* src, size_t bytes, int blocks, uint32_t* block_xor, cudaStream_t stream);

}  // namespace moebius::kernels
