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

// us per launch of `enqueue` in a graph of `n` back-to-back launches, median of 5 timings.
inline double time_chain(const std::function<void(cudaStream_t)>& enqueue, int n = 32) {
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < n; ++i) enqueue(s);
  CUDA_CHECK(cudaStreamEndCapture(s, &g));
  CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
  for (int i = 0; i < 3; ++i) CUDA_CHECK(cudaGraphLaunch(ge, s));
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  std::vector<float> t;
  for (int rep = 0; rep < 5; ++rep) {
    CUDA_CHECK(cudaEventRecord(e0, s));
    for (int i = 0; i < 20; ++i) CUDA_CHECK(cudaGraphLaunch(ge, s));
    CUDA_CHECK(cudaEventRecord(e1, s));
    CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  CUDA_CHECK(cudaGraphExecDestroy(ge));
  CUDA_CHECK(cudaGraphDestroy(g));
  CUDA_CHECK(cudaStreamDestroy(s));
  return 1e3 * t[2] / (20.0 * n);
}

}  // namespace dev_probe
