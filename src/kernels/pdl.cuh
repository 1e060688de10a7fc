// Programmatic dependent launch (PDL, sm_90+): lets a kernel start while the kernel before it on
// the stream is still running, so the next kernel's launch latency and prologue hide under the
// previous one's tail. The MoE layer is a chain of dependent kernels (routing, GEMM1, GEMM2,
// combine) that at decode sizes each run a few microseconds; without PDL every boundary costs a
// full drain-and-launch (~2-3 us on the H200 inside a CUDA graph, docs/PERF.md 2026-12-02).
//
// Protocol, for every kernel launched with launch_pdl():
//   1. prologue that reads nothing the previous kernel writes (e.g. building a lookup table);
//   2. pdl_wait(): blocks until every kernel this one depends on has COMPLETED and its writes are
//      visible (griddepcontrol.wait). Before this point, reading their outputs is a race;
//   3. pdl_launch_dependents(): allows the next kernel to be scheduled once every block of this
//      one has reached here or exited. Placing it right after the wait is always safe: the next
//      kernel waits for this one's completion in its own step 2 anyway. Placing it before the wait
//      is safe too (the dependent's wait still covers this kernel's completion) and lets a
//      dependent with a long prologue (a GEMV prefetching weights) start earlier; it only costs
//      resident slots. Such places are tagged [TAG_PDL_EARLY_TRIGGER].
// Completion is transitive: a kernel that passed its wait saw its predecessor complete, which had
// itself seen its own predecessor complete, so kernel N+1 may read what kernel N-1 wrote.
//
// Without the launch attribute (an older GPU, or a kernel launched with <<<>>>) both calls are
// no-ops, so the kernels stay correct anywhere. Programmatic edges survive stream capture: a
// captured graph keeps the overlap ([TAG_MOE_GRAPH_CAPACITY] graphs are how the engine runs).
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/cuda_check.h"

namespace moebius::kernels {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// kernel<<<grid, block, smem, stream>>>(args...) with the programmatic-serialization attribute:
// the kernel may overlap the tail of the previous kernel on the stream (see the protocol above).
template <typename... KernelArgs, typename... Args>
void launch_pdl(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, static_cast<KernelArgs>(args)...));
}

// The launch attribute that groups blocks into clusters of `cluster_x` along x.
inline cudaLaunchAttribute cluster_x_attribute(int cluster_x) {
  cudaLaunchAttribute a{};
  a.id = cudaLaunchAttributeClusterDimension;
  a.val.clusterDim.x = static_cast<unsigned>(cluster_x);
  a.val.clusterDim.y = 1;
  a.val.clusterDim.z = 1;
  return a;
}

// The same with the blocks grouped into thread-block clusters of `cluster_x` (sm_90: their shared
// memory is addressable across the cluster and they meet at a hardware cluster barrier).
template <typename... KernelArgs, typename... Args>
void launch_pdl_cluster(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, int cluster_x,
                        cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  attr[1] = cluster_x_attribute(cluster_x);
  config.attrs = attr;
  config.numAttrs = 2;
  CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, static_cast<KernelArgs>(args)...));
}

}  // namespace moebius::kernels
