// CPU references of the expert-parallel packing kernels (kernels/ep_dispatch.cuh), on the same
// capacity-padded layouts, so each kernel has an oracle and the whole padded protocol can be run
// on the CPU (tests/test_ep_moe_cpu.cpp runs it over threads as ranks).
//
// [TAG_EP_CAPACITY_SLOTS] Layouts. N ranks; a rank carries at most C tokens per step, so at most
// slots = C * k pairs go to any one peer (all of them, when every pair routes to that peer).
// Every per-peer region is `slots` rows, so the all-to-all sizes are fixed at creation and a
// decode step can be captured in a CUDA graph; only the first count rows of a region are live.
//   send_pos   [C * k]          int32   pair p = t * k + s -> its row in its destination's region
//   send_counts[N]              int32   live rows per destination (all-gathered into counts[N * N],
//                                       counts[src * N + dst])
//   send_x     [N, slots, H]    bf16    the pair's activation row (region = destination rank)
//   send_meta  [N, slots]       int32   the pair's expert id on its owner (global - owner * E / N)
//   recv_x / recv_meta: the same shapes, region = source rank (after the all-to-all)
//   x_local    [N * slots, H]   bf16    live received rows compacted: source 0's, then 1's, ...
//   local_ids  [N * slots]      int32   their local expert ids; num_local = sum_s counts[s * N + me]
//   y_local    [N * slots, H]   fp32    the local experts' FC2 rows, in x_local order
//   ret_send   [N, slots, H]    fp32    y_local rows back in their source's region, at the row
//                                       they arrived in; ret_recv the same shape, region = owner
//   y_pairs    [C * k, H]       fp32    ret_recv gathered back to pair order: the combine's input
// bf16 values are passed as their uint16 bit patterns here.
#pragma once

#include <cstdint>

namespace moebius::cpu {

// Destinations, positions (stable: pair order within a destination) and metadata of the T * k
// pairs of ids [T, k] (global expert ids, checked by the caller). E % N == 0.
void ep_plan_reference(const int32_t* ids, int64_t num_tokens, int top_k, int num_experts, int num_ranks,
                       int64_t slots, int32_t* send_pos, int32_t* send_counts, int32_t* send_meta);
// send_x[dest(p)][send_pos[p]] = x[p / k] for every live pair p.
void ep_pack_rows_reference(const uint16_t* x, int64_t num_tokens, int64_t hidden, int top_k, const int32_t* ids,
                            int num_experts, int num_ranks, const int32_t* send_pos, int64_t slots, uint16_t* send_x);
// Compacts the live received rows (counts[N * N] all-gathered; rank `me`).
void ep_compact_reference(const uint16_t* recv_x, const int32_t* recv_meta, const int32_t* counts, int me,
                          int num_ranks, int64_t slots, int64_t hidden, uint16_t* x_local, int32_t* local_ids,
                          int32_t* num_local);
// y_local rows back to their source's region.
void ep_return_pack_reference(const float* y_local, const int32_t* counts, int me, int num_ranks, int64_t slots,
                              int64_t hidden, float* ret_send);
// y_pairs[p] = ret_recv[dest(p)][send_pos[p]] for every live pair p.
void ep_unpack_return_reference(const float* ret_recv, const int32_t* ids, const int32_t* send_pos,
                                int64_t num_tokens, int top_k, int num_experts, int num_ranks, int64_t slots,
                                int64_t hidden, float* y_pairs);

}  // namespace moebius::cpu
