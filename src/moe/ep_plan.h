// Expert parallelism (EP): the routing plan of one step on one rank, shared by the CPU and CUDA EP
// layers. DP attention + EP MoE with DP = EP = N ranks: each rank routes its own tokens, sends
// each routed (token, slot) pair to the rank that owns the expert ([TAG_EP_EXPERT_OWNER]: rank r
// owns experts [r E/N, (r+1) E/N)), the owner runs its local experts, and the FC2 rows come back
// to the token's rank, which applies the routed weights and sums the k slots in fp32 in slot order
// (the same combine as the single-GPU layer, so EP changes which rank computes a row, never the
// arithmetic). The routed weight never leaves the token's rank: it is applied there, after FC2.
//
// Wire format of one dispatched pair ([TAG_EP_WIRE_FORMAT]): the activation row (bf16 on the GPU,
// where the layer input is bf16 anyway; fp32 or bf16 on the CPU) followed by the int32 local
// expert id (global id - owner's first expert). Pairs to one destination are in (token, slot)
// order, destinations in rank order; the returned FC2 rows (fp32 [H]) come back in the order they
// were received, so the sender maps them back with its own send order and needs no index on the
// wire.
#pragma once

#include <cstdint>
#include <vector>

#include "core/error.h"
#include "parallel/communicator.h"

namespace moebius::moe {

struct EpStepPlan {
  int size = 1, rank = 0;
  int64_t num_pairs = 0;                // T * k of this rank
  std::vector<int32_t> counts;          // [N * N]: counts[s * N + d] pairs rank s sends to rank d
  std::vector<int64_t> send_order;      // [T * k]: pair index t * k + s, grouped by destination rank
  std::vector<int64_t> send_begin;      // [N + 1]: destination d's pairs are send_order[send_begin[d] ..)
  std::vector<int64_t> recv_begin;      // [N + 1]: pairs received from rank s start at recv_begin[s]
  std::vector<int32_t> send_local_ids;  // [T * k] in send order: expert id on its owner

  int32_t send_count(int d) const { return counts[static_cast<size_t>(rank * size + d)]; }
  int32_t recv_count(int s) const { return counts[static_cast<size_t>(s * size + rank)]; }
  int64_t num_received() const { return recv_begin.back(); }
};

// Builds this rank's plan from its routing ids [T, k] (global expert ids in [0, E)) and exchanges
// the per-destination counts with every rank (one all_gather of N int32 per rank; the
// communicator must take host buffers). T may be 0: the rank still takes part. Errors for ids out
// of range (before any collective: the caller must abort the group, see run_ranks).
Result<EpStepPlan> make_ep_step_plan(parallel::Communicator& comm, const int32_t* ids, int64_t num_tokens, int top_k,
                                     int num_experts);

// The local part of the plan, before the count exchange (also what the CUDA packing kernel's CPU
// reference computes): per-destination counts [N] and the send order. No communication.
Status ep_local_plan(const int32_t* ids, int64_t num_tokens, int top_k, int num_experts, int size,
                     std::vector<int32_t>* send_counts, std::vector<int64_t>* send_order,
                     std::vector<int32_t>* send_local_ids);

}  // namespace moebius::moe
