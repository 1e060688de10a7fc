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

}  // namespace dev_probe
