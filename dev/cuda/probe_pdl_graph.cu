// Probe: what a dependent kernel boundary costs inside a CUDA graph on this GPU, with and without
// programmatic dependent launch (src/kernels/pdl.cuh). The MoE decode layer is a chain of 4-6
// small dependent kernels, so this per-boundary cost is a floor on its latency.
//
// A chain of N kernels, each of B blocks that read one int the previous kernel wrote and write
// the next (a real dependency), captured once per mode and replayed; prints us per kernel.
// Modes: plain <<<>>> launches; PDL with the wait at the top; PDL with a ~2 us independent
// prologue before the wait (what a GEMM's table building or weight prefetch would overlap).
// Usage: dev_probe_pdl_graph   (no arguments; prints a table)
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>

#include "kernels/cuda_check.h"
#include "kernels/pdl.cuh"

namespace {

using moebius::kernels::launch_pdl;
using moebius::kernels::pdl_launch_dependents;
using moebius::kernels::pdl_wait;

__global__ void step_kernel(const int* in, int* out, int prologue_iters) {
  // Independent prologue: spin on arithmetic that the compiler cannot drop.
  float v = threadIdx.x;
  for (int i = 0; i < prologue_iters; ++i) v = v * 1.0000001f + 0.5f;
  pdl_wait();
  pdl_launch_dependents();
  const int x = *in;
  if (threadIdx.x == 0 && blockIdx.x == 0) *out = x + 1 + (v == -1.0f);
}

double time_chain(int mode, int kernels, int blocks, int prologue_iters) {
  int* buf = nullptr;
  CUDA_CHECK(cudaMalloc(&buf, sizeof(int) * (kernels + 1)));
  CUDA_CHECK(cudaMemset(buf, 0, sizeof(int) * (kernels + 1)));
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < kernels; ++i) {
    if (mode == 0) {
      step_kernel<<<blocks, 128, 0, s>>>(buf + i, buf + i + 1, prologue_iters);
      CUDA_CHECK_LAUNCH();
    } else {
      launch_pdl(step_kernel, dim3(blocks), dim3(128), 0, s, buf + i, buf + i + 1, prologue_iters);
    }
  }
  CUDA_CHECK(cudaStreamEndCapture(s, &g));
  CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
  for (int i = 0; i < 3; ++i) CUDA_CHECK(cudaGraphLaunch(ge, s));
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  constexpr int kReps = 50;
  CUDA_CHECK(cudaEventRecord(e0, s));
  for (int i = 0; i < kReps; ++i) CUDA_CHECK(cudaGraphLaunch(ge, s));
  CUDA_CHECK(cudaEventRecord(e1, s));
  CUDA_CHECK(cudaEventSynchronize(e1));
  float ms = 0;
  CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
  int last = 0;
  CUDA_CHECK(cudaMemcpy(&last, buf + kernels, sizeof(int), cudaMemcpyDeviceToHost));
  if (last != kernels) std::printf("  chain result %d != %d: dependency broken\n", last, kernels);
  CUDA_CHECK(cudaGraphExecDestroy(ge));
  CUDA_CHECK(cudaGraphDestroy(g));
  CUDA_CHECK(cudaStreamDestroy(s));
  CUDA_CHECK(cudaFree(buf));
  return 1e3 * ms / (kReps * kernels);
}

}  // namespace

int main() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("no CUDA device\n");
    return 0;
  }
  std::printf("%-28s %8s %8s %10s\n", "mode", "blocks", "prologue", "us/kernel");
  for (int blocks : {1, 132, 1024})
    for (int pro : {0, 2000}) {
      const char* names[] = {"plain launch", "pdl"};
      for (int mode : {0, 1})
        std::printf("%-28s %8d %8d %10.2f\n", names[mode], blocks, pro, time_chain(mode, 64, blocks, pro));
    }
  return 0;
}
