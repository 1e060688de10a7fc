// The expert-parallel MoE layer on the GPU: one per rank, over an NcclCommunicator (one process
// per GPU). Same contract as MoeLayerCuda::forward (x [capacity, H] bf16 -> out [capacity, H]
// bf16, live count a device int, no host synchronization), but a COLLECTIVE: every rank calls
// forward once per step, a rank with zero tokens included. Per step, on one stream:
//   route      router logits + top-k over all E experts (this rank's tokens)      moe_route.cuh
//   plan       per-destination counts and rows (launch_ep_plan)                   ep_dispatch.cuh
//   counts     ncclAllGather of the N counts -> counts [N, N]  (token counts synced every step)
//   pack       rows into the send regions (launch_ep_pack_rows)
//   dispatch   grouped ncclSend/ncclRecv: rows [slots, H] bf16 + local ids [slots] per peer
//   compact    live received rows, source order (launch_ep_compact)
//   experts    the local MoeLayerCuda (E/N experts, k = 1: align, GEMM1+SwiGLU, GEMM2 kStore fp32)
//   return     launch_ep_return_pack, grouped ncclSend/ncclRecv of fp32 rows [slots, H] per peer
//   combine    launch_ep_unpack_return, then launch_moe_combine: routed weights on the token's
//              rank, fp32, slot order (the single-GPU layer's combine)
// [TAG_EP_CAPACITY_SLOTS] Every all-to-all moves fixed regions of slots = capacity * k rows per
// peer, so the sizes are host constants and a decode step captures into a CUDA graph. The cost:
// the wire carries whole regions even when few rows are live (bench ep reports live and wire
// bytes). Memory per rank: 2 x N x slots x H bf16 (send/recv), N x slots x H bf16 (compacted),
// 2 x N x slots x H fp32 (return), slots x H fp32 (pairs), plus the local layer's workspace for
// N x slots rows; at Qwen3-30B-A3B decode (H=2048, k=8, capacity 64, N=4) about 60 MiB.
#pragma once

#if defined(MOEBIUS_HAS_CUDA) && defined(MOEBIUS_HAS_NCCL)

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <memory>
#include <vector>

#include "core/error.h"
#include "core/memory.h"
#include "cpu/moe_layer.h"
#include "kernels/moe_route.cuh"
#include "moe/moe_layer_cuda.h"
#include "parallel/nccl_communicator.h"

namespace moebius::moe {

struct MoeEpCudaOptions {
  int capacity = 1;  // the most tokens one rank carries in one step
  // The local experts' GEMM path; kAuto picks from the balanced load (capacity * k / (E / N)
  // tokens per local expert), not from the padded worst case.
  MoeGemmPath gemm_path = MoeGemmPath::kAuto;
  int block_m = 0;
};

// The phases of forward(), in order, for benchmarks (each reads what the previous left).
enum class EpPhase : int { kRoute, kDispatch, kExperts, kReturn, kCombine, kCount };
const char* ep_phase_name(EpPhase p);

class MoeLayerEpCuda {
 public:
  // `layer`: the full router and this rank's E / N experts (moe::validate_ep_layer). `comm` must
  // outlive the layer.
  static Result<std::unique_ptr<MoeLayerEpCuda>> create(const cpu::MoeLayerReference& layer,
                                                        parallel::NcclCommunicator& comm, const MoeEpCudaOptions& opt);
  // Random weights of the given global geometry, this rank's E / N experts written straight into
  // the packed layout on the device (benchmarks; MoeLayerCuda::create_dummy).
  static Result<std::unique_ptr<MoeLayerEpCuda>> create_dummy(const cpu::MoeShape& shape, KernelFormat format,
                                                              int group_size, parallel::NcclCommunicator& comm,
                                                              const MoeEpCudaOptions& opt, uint64_t seed);
  // Another EP layer over the SAME device weights (router and local experts: the local layer's
  // share_weights) with its own buffers for another capacity. The model runner keeps one at its
  // decode-graph capacity and one at its prefill chunk: every rank of a step must use the same
  // capacity, since it fixes the sizes on the wire [TAG_EP_CAPACITY_SLOTS].
  Result<std::unique_ptr<MoeLayerEpCuda>> share_weights(const MoeEpCudaOptions& opt) const;
  ~MoeLayerEpCuda();
  MoeLayerEpCuda(const MoeLayerEpCuda&) = delete;
  MoeLayerEpCuda& operator=(const MoeLayerEpCuda&) = delete;

  Status forward(const __nv_bfloat16* x, const int32_t* num_tokens, __nv_bfloat16* out, cudaStream_t stream);
  Status enqueue_phase(EpPhase phase, const __nv_bfloat16* x, const int32_t* num_tokens, __nv_bfloat16* out,
                       cudaStream_t stream);

  const cpu::MoeShape& shape() const { return shape_; }  // global: E = all experts
  int capacity() const { return opt_.capacity; }
  int slots() const { return slots_; }
  const MoeLayerCuda& local() const { return *local_; }
  // Bytes one rank puts on the wire per step (all peers, itself included): dispatch (rows + ids)
  // and return (fp32 rows).
  size_t dispatch_wire_bytes() const;
  size_t return_wire_bytes() const;
  // Device bytes of the router (shared by share_weights layers) and of this layer's own buffers
  // (regions, routing, the local layer's workspace); the local experts are local().weight_bytes().
  size_t router_bytes() const;
  size_t workspace_bytes() const;
  // Routing of the last forward [capacity, k] (device).
  const int32_t* topk_ids() const { return topk_ids_; }
  const float* topk_weights() const { return topk_weights_; }

 private:
  MoeLayerEpCuda() = default;
  static Result<std::unique_ptr<MoeLayerEpCuda>> init(const cpu::MoeShape& shape, const cpu::RouterConfig& router,
                                                      const std::vector<uint16_t>& router_bits,
                                                      std::unique_ptr<MoeLayerCuda> local,
                                                      parallel::NcclCommunicator& comm, const MoeEpCudaOptions& opt);
  // The per-capacity part of init: routing parameters, and every buffer but the router's.
  static Status allocate(MoeLayerEpCuda& L, const cpu::MoeShape& shape, const cpu::RouterConfig& router,
                         parallel::NcclCommunicator& comm, const MoeEpCudaOptions& opt);
  Status all_to_all_fixed(const void* send, void* recv, size_t bytes_per_peer);

  parallel::NcclCommunicator* comm_ = nullptr;
  cpu::MoeShape shape_;
  MoeEpCudaOptions opt_;
  kernels::RouteParams route_;
  int N_ = 1, me_ = 0, slots_ = 0;
  std::unique_ptr<MoeLayerCuda> local_;
  cpu::RouterConfig router_;                // as created (share_weights makes the same routing)
  std::shared_ptr<std::vector<Buffer>> weights_;  // the router's, shared by share_weights layers
  std::vector<Buffer> buffers_;             // this layer's own
  __nv_bfloat16* router_weight_ = nullptr;  // [E, H]
  float* correction_bias_ = nullptr;        // [E] or null
  float* logits_ = nullptr;                 // [capacity, E]
  int32_t* topk_ids_ = nullptr;             // [capacity, k]
  float* topk_weights_ = nullptr;           // [capacity, k]
  int32_t* send_pos_ = nullptr;             // [slots]
  int32_t* send_counts_ = nullptr;          // [N]
  int32_t* counts_ = nullptr;               // [N, N]
  __nv_bfloat16* send_x_ = nullptr;         // [N, slots, H]
  __nv_bfloat16* recv_x_ = nullptr;         // [N, slots, H]
  int32_t* send_meta_ = nullptr;            // [N, slots]
  int32_t* recv_meta_ = nullptr;            // [N, slots]
  __nv_bfloat16* x_local_ = nullptr;        // [N * slots, H]
  int32_t* local_ids_ = nullptr;            // [N * slots]
  float* local_w_ = nullptr;                // [N * slots] ones (the local layer's combine is not run)
  int32_t* num_local_ = nullptr;            // [1]
  float* ret_send_ = nullptr;               // [N, slots, H]
  float* ret_recv_ = nullptr;               // [N, slots, H]
  float* y_pairs_ = nullptr;                // [slots, H]
};

}  // namespace moebius::moe

#endif  // MOEBIUS_HAS_CUDA && MOEBIUS_HAS_NCCL
