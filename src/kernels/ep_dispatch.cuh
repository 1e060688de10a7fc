// Expert-parallel dispatch and combine: the device-side packing around the NCCL all-to-alls, on
// the capacity-padded layouts of [TAG_EP_CAPACITY_SLOTS] (src/cpu/ep_pack.h documents every
// buffer; its functions are these kernels' CPU references, tests/gpu/test_ep_dispatch.cu).
//
// [TAG_MOE_GRAPH_CAPACITY] Live counts are device ints (the token count T = *num_tokens, the
// all-gathered pair counts); grids are sized from host capacities and blocks past the live range
// exit, so one captured graph serves every step.
//   N = num_ranks (1..kEpMaxRanks), slots = capacity * k rows per peer region, H = hidden.
//   Row copies move 16 bytes per thread: H % 8 == 0 for bf16 rows, H % 4 == 0 for fp32 rows, and
//   every buffer 16-byte aligned (asserted).
// Expert ids must be in [0, E) (they come from launch_moe_route_topk), E % N == 0.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace moebius::kernels {

inline constexpr int kEpMaxRanks = 32;  // one warp's lanes sum the per-rank counts

// One block walks the T * k pairs in order: send_pos [capacity * k] (the pair's row in its
// destination's region, stable: pair order within a destination), send_counts [N],
// send_meta [N, slots] (local expert id at each live row; rows past the count untouched).
void launch_ep_plan(const int32_t* topk_ids, const int32_t* num_tokens, int capacity, int top_k, int num_experts,
                    int num_ranks, int32_t* send_pos, int32_t* send_counts, int32_t* send_meta, cudaStream_t stream);

// send_x [N, slots, H] bf16: send_x[dest(p)][send_pos[p]] = x[p / k], x [capacity, H] bf16.
void launch_ep_pack_rows(const __nv_bfloat16* x, const int32_t* topk_ids, const int32_t* send_pos,
                         const int32_t* num_tokens, int capacity, int hidden, int top_k, int num_experts,
                         int num_ranks, __nv_bfloat16* send_x, cudaStream_t stream);

// Live received rows compacted, source rank order: x_local [N * slots, H] bf16, local_ids
// [N * slots] int32, *num_local = sum_s counts[s * N + me]. counts [N * N] int32 all-gathered.
void launch_ep_compact(const __nv_bfloat16* recv_x, const int32_t* recv_meta, const int32_t* counts, int me,
                       int num_ranks, int slots, int hidden, __nv_bfloat16* x_local, int32_t* local_ids,
                       int32_t* num_local, cudaStream_t stream);

// ret_send [N, slots, H] fp32: the local FC2 rows y_local [N * slots, H] fp32 back to the region
// and row they arrived in.
void launch_ep_return_pack(const float* y_local, const int32_t* counts, int me, int num_ranks, int slots, int hidden,
                           float* ret_send, cudaStream_t stream);

// y_pairs [capacity * k, H] fp32: y_pairs[p] = ret_recv[dest(p)][send_pos[p]] for live pairs;
// the input of launch_moe_combine (routed weights applied there, fp32, slot order).
void launch_ep_unpack_return(const float* ret_recv, const int32_t* topk_ids, const int32_t* send_pos,
                             const int32_t* num_tokens, int capacity, int top_k, int num_experts, int num_ranks,
                             int hidden, float* y_pairs, cudaStream_t stream);

}  // namespace moebius::kernels
