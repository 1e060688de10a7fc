// Qwen3MoeCuda's expert-parallel state (private to qwen3_moe_cuda.cpp and qwen3_moe_cuda_ep.cpp).
#pragma once

#ifdef MOEBIUS_HAS_CUDA

#include <cstdint>
#include <memory>
#include <vector>

#include "model/qwen3_moe_cuda.h"
#include "parallel/communicator.h"

#ifdef MOEBIUS_HAS_NCCL
#include "moe/moe_layer_ep_cuda.h"
#include "parallel/nccl_communicator.h"
#endif

namespace moebius::model {

struct Qwen3MoeCuda::EpState {
#ifdef MOEBIUS_HAS_NCCL
  parallel::NcclCommunicator* comm = nullptr;  // opt_.ep_comm, which owns it
  // [model layer]: the EP layers at the decode and the prefill capacity (null for dense layers;
  // prefill null when both capacities are equal). They share the router and the local experts.
  std::vector<std::unique_ptr<moe::MoeLayerEpCuda>> decode, prefill;
#endif
  int decode_capacity = 1;   // max(graph_batches): every decode graph's EP layers
  int prefill_capacity = 1;  // max_tokens
  int step_capacity = 1;     // the step being enqueued (ep_step_header's choice)
  int32_t* header_dev = nullptr;   // [2 + 2 N] device: this rank's values, then everyone's
  int32_t* header_host = nullptr;  // [2 + 2 N] pinned mirror
  int32_t* zero = nullptr;         // one device int 0: the live count of an empty step
};

}  // namespace moebius::model

#endif  // MOEBIUS_HAS_CUDA
