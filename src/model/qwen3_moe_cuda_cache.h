// Qwen3MoeCuda's dynamic expert cache [TAG_EXPERT_CACHE] (private to qwen3_moe_cuda.cpp and
// qwen3_moe_cuda_cache.cpp; docs/OFFLOAD.md, "Dynamic cache").
//
// The policy (offload/model_expert_cache.h) runs on the host and needs every MoE layer's routing,
// which lives on the device. Reading it the obvious way (copy, synchronize, decide, swap) would put
// a host synchronization inside every step, which costs the overlap of the host's next enqueue
// with the GPU's current step and cannot live inside a CUDA graph. So the routing travels
// asynchronously and the decisions come one step late:
//
//   step n (enqueue):  [swaps decided from step n-1 or n-2] [inputs] [layers: after each MoE layer
//                      a device-to-device copy of its top-k ids into routing_capture_] [one 2D
//                      copy of the step's live rows of every layer into pinned slot n % 2]
//                      [event ready[n % 2]]
//   step n+1 (enqueue, host): cudaEventQuery(ready) of the pending slots, oldest first; each one
//                      complete is fed to the policy, and the swaps it returns are enqueued on the
//                      stream (MoeLayerCuda::swap_experts) before step n+1's forward.
//
// Why these copies: the layers of a capacity bucket share one workspace [TAG_MOE_WORKSPACE_POOL],
// so topk_ids() holds only the last layer's routing once the step is over; each layer's ids must be
// copied while they are current. Those copies stay on the device (a few hundred bytes each, no PCIe
// round trip between a MoE layer and the next layer's kernels), and ONE device-to-host copy per
// step carries them all over PCIe at the end, where its latency delays no kernel of the step. The
// copies are stream operations, so a captured decode graph contains the per-layer ones, and the
// read-back after the graph launch is an ordinary stream copy.
//
// The lag: forward() synchronizes at the end of a step, so step n's routing is always complete at
// step n+1 (one step of lag). When the host enqueues step n+1 while step n runs (bench generate's
// decode loop, enqueue() back to back), step n is not done yet, but step n-1 is (enqueue waited for
// step n's input copy, which follows step n-1 on the stream): two steps of lag. Hence two slots. A
// slot still in flight when its turn to be overwritten comes is dropped (counted; not expected).
//
// Swaps run on the compute stream between steps, not overlapped with a forward: a swap overwrites
// a resident slot that the next forward may read. Each moves 2 x expert_bytes() over PCIe (the
// incoming expert host-to-device, the outgoing one device-to-host) through the one-expert scratch
// the memory plan reserved (plan_offload).
#pragma once

#ifdef MOEBIUS_HAS_CUDA

#include <cuda_runtime_api.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "model/qwen3_moe_cuda.h"
#include "offload/model_expert_cache.h"

namespace moebius::model {

struct Qwen3MoeCuda::CacheState {
  explicit CacheState(offload::ModelExpertCache c) : cache(std::move(c)) {}
  ~CacheState();
  CacheState(const CacheState&) = delete;
  CacheState& operator=(const CacheState&) = delete;

  offload::ModelExpertCache cache;
  // One step's routing on its way to the host.
  struct Readback {
    int32_t* ids = nullptr;         // pinned [MoE layers][stride]: rows * k ids each
    std::vector<uint8_t> ran_with;  // [MoE layers][E] the residency the step ran with
    cudaEvent_t ready = nullptr;    // recorded after the copy
    uint64_t step = 0;              // the step's number (steps below)
    int rows = 0;                   // the step's live tokens
    bool pending = false;           // enqueued and not fed yet
  };
  Readback slots[2];
  uint64_t steps = 0;  // steps enqueued with the cache on
  size_t stride = 0;   // max_tokens * k: routing_capture_'s per-layer stride, kept on the host
};

}  // namespace moebius::model

#endif  // MOEBIUS_HAS_CUDA
