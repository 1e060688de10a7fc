// Helpers shared by the dev/cuda probes (header only; each probe is one .cu program): a device
// check, random bf16 inputs on the device, and graph-chain timing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <vector>

#include "cli/graph_timer.h"
#include "kernels/cuda_check.h"

namespace dev_probe {

// False (and says so) on a machine without a GPU; the probes then exit 0.
inline bool has_device() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("no CUDA device\n");
    return false;
  }
  return true;
}

// n bf16 values uniform in [-scale/2, scale/2) (never all zeros) from a 32-bit LCG whose state
// the caller keeps, in fresh device memory (the caller frees it).
inline __nv_bfloat16* random_bf16(size_t n, float scale, uint32_t& state) {
  std::vector<__nv_bfloat16> h(n);
  for (auto& v : h) {
    state = state * 1664525u + 1013904223u;
    v = __float2bfloat16((static_cast<float>(state >> 8) / 16777216.0f - 0.5f) * scale);
  }
  __nv_bfloat16* d = nullptr;
  CUDA_CHECK(cudaMalloc(&d, n * sizeof(__nv_bfloat16)));
  CUDA_CHECK(cudaMemcpy(d, h.data(), n * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice));
  return d;
}

// us per launch of `enqueue` in a graph of `n` back-to-back launches, median of 5 timings (each
// a capture, 3 warm-up replays and 20 timed ones: cli::time_graph_us, the benchmarks' timer).
inline double time_chain(const std::function<void(cudaStream_t)>& enqueue, int n = 32) {
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::vector<double> t;
  for (int rep = 0; rep < 5; ++rep)
    t.push_back(moebius::cli::time_graph_us(s, 20, n, [&] {
      for (int i = 0; i < n; ++i) enqueue(s);
    }));
  std::sort(t.begin(), t.end());
  CUDA_CHECK(cudaStreamDestroy(s));
  return t[2];
}

// Reads n 16-byte pieces grid-stride with 4 independent loads in flight per thread (enough bytes in
// flight to hide a ~1-2 us PCIe round trip when p is mapped host memory), XORing them into a sink
// that is practically never written, so the loads stay. The zero-copy probes' read.
__global__ inline void read_v4x4(const uint4* __restrict__ p, size_t n, unsigned* __restrict__ sink) {
  unsigned acc = 0;
  const size_t stride = size_t{gridDim.x} * blockDim.x;
  size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = p[i], b = p[i + stride], c = p[i + 2 * stride], d = p[i + 3 * stride];
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < n; i += stride) {
    const uint4 v = p[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

}  // namespace dev_probe
