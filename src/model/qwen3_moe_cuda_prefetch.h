// Qwen3MoeCuda's next-layer expert prefetch [TAG_EXPERT_PREFETCH] (private to qwen3_moe_cuda.cpp
// and qwen3_moe_cuda_prefetch.cpp; docs/OFFLOAD.md, "Prefetch"; the kernels and their protocol in
// kernels/expert_prefetch.cuh).
//
// In a step of at most kernels::kExpertPrefetchMaxTokens rows, for MoE layers i = 1, 2, ...:
//
//   main stream:     MoE i-1 -> event fork -> qkv GEMV, attention -> wait predicted -> o GEMV
//                    (overwrites MoE i-1's output) ... -> wait ready -> MoE i
//                    (down-only: ... -> MoE i's routing, GEMM1 -> wait ready -> its GEMM2)
//   prefetch stream: wait fork -> predict(i) [puts MoE i-1's entries back home] -> event predicted
//                    -> copy(i) -> publish(i) -> event ready
//
// The prediction runs beside the main stream (run Z31: on it, it held the step 16 us a layer); it
// reads the residual and MoE i-1's output, so the main stream waits for it before it next writes
// either in place (prefetch_release: the o GEMV writes the MoE output's buffer, an unfolded input
// norm adds into the residual), a wait that is long satisfied by then. The decode graphs are
// instantiated with node priorities so the copy's greatest priority holds in them (run Z31: at
// equal priority the copy started 26 us after the prediction, behind the qkv GEMV's blocks).
//
// One slot set is enough: copy(i) needs MoE i-1's output, so it starts after MoE i-1 has finished
// reading the slots, and predict(i) has put MoE i-1's table entries back home by then, so an entry
// never points at another expert's bytes. Between steps the last owner keeps pointing at a valid
// copy (any step, eager prefill included, reads the right bytes) until the next step's predict(1).
//
// The main stream's wait costs nothing when the copy finished under the layers between, and while
// it waits PCIe is busy with bytes the layer reads from the device (a right guess) instead of over
// the link. But the window between two MoE layers in which PCIe idles is only ~60 us a layer at
// Qwen3-235B (run Z31), a third of one expert's copy, so a whole-expert copy made the layer wait
// (run Z32: the copy kernel 19 ms of a 103 ms step's critical path, no net gain). So by default
// only the predicted experts' down projections are copied (w2, a third of an expert), and only
// GEMM2 waits for them: the copy fills the window and runs on beside the routing and GEMM1, whose
// own reads keep the link busy meanwhile (runs Z35-Z36: decode 5-7% faster with 2 slots).
// MOEBIUS_PREFETCH_PARTS=all copies whole experts and joins before the layer (A/B runs). The
// dynamic cache rewrites the same tables from the host (swap_experts), so the two are not
// combined; expert parallelism has no offload.
#pragma once

#ifdef MOEBIUS_HAS_CUDA

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "kernels/expert_prefetch.cuh"
#include "model/qwen3_moe_cuda.h"
#include "moe/moe_layer_cuda.h"

namespace moebius::model {

struct Qwen3MoeCuda::PrefetchState {
  PrefetchState() = default;
  ~PrefetchState();
  PrefetchState(const PrefetchState&) = delete;
  PrefetchState& operator=(const PrefetchState&) = delete;

  int slots = 0;                                  // experts per MoE layer (--expert-prefetch)
  bool down_only = true;                          // copy w2 only; GEMM2 waits, not the layer
  int copy_blocks = 0;                            // the copy kernel's grid: one block per SM
  int copy_priority = 0;                          // its launch priority: the device's greatest
  kernels::ExpertPrefetchSlots set;               // the slots (device)
  kernels::ExpertPrefetchRecord* record = nullptr;   // device: the slots' owner and saved entries
  float* logits = nullptr;                        // [kExpertPrefetchMaxTokens, E] device scratch
  unsigned* counter = nullptr;                    // [1] device, zeroed
  uint8_t* cold = nullptr;                        // [MoE layers][E] device: 1 where the expert is cold
  int32_t* log = nullptr;                         // [MoE layers][1 + kExpertPrefetchMaxSlots] device
  std::vector<uint8_t> cold_host;                 // the same, on the host (statistics)
  struct Target {                                 // per MoE layer: what predicting it reads
    moe::MoeLayerCuda::PrefetchView view;
    const float* norm = nullptr;                  // [H] its post-attention RMSNorm weight
  };
  std::vector<Target> targets;                    // [MoE layers]
  std::vector<uint8_t> issued;                    // [MoE layers] host: prefetched in the current step
  bool reading = false;                           // host: a prediction may still read resid / delta
  cudaStream_t stream = nullptr;
  cudaEvent_t fork = nullptr, predicted = nullptr, ready = nullptr;
};

}  // namespace moebius::model

#endif  // MOEBIUS_HAS_CUDA
