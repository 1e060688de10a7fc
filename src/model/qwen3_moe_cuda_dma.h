// Qwen3MoeCuda's routed cold experts by the copy engines [TAG_EXPERT_ROUTED_DMA] (private to
// qwen3_moe_cuda.cpp and qwen3_moe_cuda_dma.cpp; docs/OFFLOAD.md, "Routed experts by DMA"; the
// kernels in kernels/expert_dma.cuh).
//
// Per MoE layer i of a decode step (main stream, side stream for the w2 wait):
//
//   main: routing(i) -> [prefetch ready] -> choose(i) -> wait13 -> GEMM1 ..... -> wait -> GEMM2 -> restore
//   side:                               (fork after choose) -> wait2 -> event ^
//   host thread (runtime::RoutedExpertCopier): post(i) -> w13 copies, flag13 -> w2 copies, flag2
//
// choose points the chosen experts' table entries at the slots and posts its choice to mapped
// host memory; the copier's thread issues the copies on its copy stream (the copy engines) and
// after each part a flag copy; wait13 / wait2 spin on those flags. The w2 copies queue behind the
// w13 ones (one link: GEMM1's bytes land first) and run while GEMM1 computes; only GEMM2 waits for
// them. A down-only prefetch [TAG_EXPERT_PREFETCH] is waited for before choose (its publish writes
// the same table entries), and choose leaves alone the parts that the prefetch put on the device. restore, after
// the layer, points the changed entries back, so the next layer's choice and any later step see
// homes or valid copies only; one slot set is enough because layer i+1's choice, hence its copies,
// come after layer i's GEMM2.
//
// Eager decode steps and graph replays run the same kernels (nothing here is a graph node of its
// own); prefill keeps the zero-copy or staged paths.
#pragma once

#ifdef MOEBIUS_HAS_CUDA

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "kernels/expert_dma.cuh"
#include "model/qwen3_moe_cuda.h"
#include "moe/moe_layer_cuda.h"
#include "runtime/routed_expert_copier.h"

namespace moebius::model {

struct Qwen3MoeCuda::DmaState {
  DmaState() = default;
  ~DmaState();
  DmaState(const DmaState&) = delete;
  DmaState& operator=(const DmaState&) = delete;

  int slots = 0;                          // experts per MoE layer (expert_dma_slots)
  kernels::ExpertDmaSlots set;            // the slots (device), whole experts
  kernels::ExpertDmaRecord* record = nullptr;  // device, zeroed
  std::unique_ptr<runtime::RoutedExpertCopier> copier;  // the host thread and its copy stream
  bool armed = false;                     // host: a choose is enqueued and its restore is not
  cudaStream_t side = nullptr;            // the w2 wait
  cudaEvent_t fork = nullptr, copied2 = nullptr;
};

}  // namespace moebius::model

#endif  // MOEBIUS_HAS_CUDA
