// CUDA-graph timing shared by the CUDA benchmarks (bench moe, bench attention): capture the work
// once, warm up, replay between events. Graph replays shrink launch gaps to what a captured
// engine step sees (METHOD.md: "for many small launches, capture a graph and time its replays").
#pragma once

#ifdef MOEBIUS_HAS_CUDA

#include <cuda_runtime_api.h>

#include "kernels/cuda_check.h"

namespace moebius::cli {

// Captures enqueue() into a graph, replays it 3 times to warm up, then `iters` times between CUDA
// events; returns microseconds per replay divided by `per_replay` (the units of work in the graph,
// e.g. the layers over rotating weight sets).
template <typename Enqueue>
double time_graph_us(cudaStream_t stream, int iters, int per_replay, Enqueue enqueue) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  enqueue();
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 3; ++i) CUDA_CHECK(cudaGraphLaunch(exec, stream));
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  CUDA_CHECK(cudaEventRecord(e0, stream));
  for (int i = 0; i < iters; ++i) CUDA_CHECK(cudaGraphLaunch(exec, stream));
  CUDA_CHECK(cudaEventRecord(e1, stream));
  CUDA_CHECK(cudaEventSynchronize(e1));
  float ms = 0;
  CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
  CUDA_CHECK(cudaEventDestroy(e0));
  CUDA_CHECK(cudaEventDestroy(e1));
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  return 1e3 * ms / (static_cast<double>(iters) * per_replay);
}

}  // namespace moebius::cli

#endif  // MOEBIUS_HAS_CUDA
