// Routing kernels for the fused MoE layer; the launchers are declared in moe_route.cuh.
//
// Kernel A (moe_route_topk_kernel): one warp per token. Lane l holds experts e = i*32 + l,
// i < VPT = ceil(E/32) rounded up to a power of two, in registers: E <= 512 is at most 16 floats a
// lane, and a warp reads a row with VPT coalesced loads. Each of the k winners is a register
// argmax per lane followed by a 5-step xor-shuffle reduction over (value, index) pairs ordered by
// value, then lower index; that order is total, so every lane ends with the same winner and ties
// go to the lower expert, like the oracle. The winner's owner lane clears its bit in a 32-bit
// eligibility mask. Winner j stays in lane j, so the k outputs are one coalesced store.
//
// Matching the oracle (src/cpu/moe_router.cpp), which computes in fp32 with std::exp (glibc expf)
// and sums in double:
//  - ranks use the SAME fp32 quantity as the oracle (the normalised softmax probability, or the
//    biased sigmoid score), not a monotone stand-in such as the raw logit: fp32 rounding can make
//    two distinct logits score equal, and the oracle then picks the lower index; we must too.
//  - expf is evaluated as exp() in fp64 rounded once to fp32: the correctly rounded expf, except
//    when the exact value lies within 2^-29 ulp of a rounding boundary. glibc's expf returns that
//    same float for all but ~6e-4 of inputs (measured here over 2e8 random floats in [-100, 20];
//    it is then 1 ulp off); CUDA's fp32 expf only promises 2 ulp. So an id can differ from the
//    oracle only at a near-tie, two of the top k+1 experts within 1 ulp of each other, decided by
//    such a 1-ulp exp (of one of the two, or of any expert through the softmax sum): ~1e-8 per
//    token for random fp32 logits (near-ties ~5e-6, decided by a misround ~2e-3). Exact ties
//    (equal inputs) always resolve alike. The test SoftmaxTiesFromFp32Rounding builds 1024 such
//    near-ties on purpose: one of them went the other way until it filtered glibc's misrounds.
//  - fp32 adds/divides use __fadd_rn/__fdiv_rn and fp64 ones __dadd_rn/__ddiv_rn, so neither FMA
//    contraction nor -prec-div=false can change the rounding. Do not build with -ftz=true (part of
//    --use_fast_math): the oracle keeps subnormal probabilities.
//  - the softmax denominator is a warp tree sum in fp64; the oracle sums in index order. The two
//    differ by ~E * 2^-53 relative, which moves a weight across an fp32 rounding boundary about
//    once in 10^6. Weights therefore agree to 1 ulp (tests use 1e-6 relative) and are usually
//    bit-identical.
//
// Kernel B (moe_align_*): a counting sort of the n = T*k (token, slot) pairs by expert.
//  1. moe_align_count_kernel, one block of 1024 threads: histogram of the ids with shared-memory
//     atomics, then an exclusive scan over E <= 512 counts -> expert_offsets, padded_offsets,
//     num_tiles, tile_expert. Integer counts do not depend on the atomic order: deterministic.
//  2. moe_align_scatter_kernel, one block per expert: the block walks all n ids in p order, 8192 at
//     a time (16 warps x 16 steps x 32 lanes); per step a __ballot_sync marks this expert's pairs,
//     and popc of the lower lanes' bits plus a 16-entry scan of the per-warp counts gives each pair
//     its rank. Ranks follow p, so each segment is ascending p: stable and deterministic, with no
//     atomics. An empty expert's block returns at once; a block stops once it has found its count.
//     (Placing 4 experts per block cut the L2 reads by 4 but ran 2x slower: the walk is bound by
//     load latency, not by L2 bandwidth, and 4x fewer blocks hide less of it.)
//
// Cost (n = T*k; the ids array, 4n bytes, stays in the 50 MB L2). Expected:
//  - kernel A reads 2*T*E bytes of bf16 logits and writes 8*T*k bytes (Qwen3-30B-A3B, E=128, k=8,
//    T=4096: 1 MiB in, 256 KiB out): a fraction of a microsecond of HBM time. It is bound by the
//    latency of one warp's chain (loads, E/32 fp64 exps a lane, k shuffle-argmax rounds), not by
//    bytes; fp64 exp instead of fp32 expf added 3-16% in a trial.
//  - kernel B step 1 reads 4n bytes on one SM (128 KiB at T=4096, k=8); step 2 reads 4n bytes
//    per non-empty expert from L2 (E=128: 16 MiB) and writes 4n (+ padded) bytes.
// Measured once on the H200 (2026-12-02, a scratch benchmark of back-to-back launches on one
// stream, capacity 4096, so launch overhead is included; not a committed benchmark):
//                              T=1: route, align(2 kernels)    T=4096: route, align
//    Qwen3 E=128 k=8 softmax           4.7 us, 8.2 us                 9.4 us, 14.1 us
//    DeepSeek-V3 E=256 k=8 g8/4        9.9 us, 9.2 us                20.1 us, 15.9 us
// The group-limited path costs ~4 us at T=1 (its per-group top-2 walks shared memory serially); a
// shuffle-based top-2 for n_groups dividing 32 is the next step if DeepSeek decode needs it.
#include "kernels/moe_route.cuh"

#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <cmath>

#include "kernels/cuda_check.h"
#include "kernels/moe_route_device.cuh"
#include "kernels/pdl.cuh"

// Phase timestamps of the fused small-batch routing, for dev/cuda/probe_route_decode.cu, which
// compiles this file with its own definition; nothing otherwise.
#ifndef MOEBIUS_ROUTE_PHASE_STAMP
#define MOEBIUS_ROUTE_PHASE_STAMP(i) ((void)0)
#endif

namespace moebius::kernels {
namespace {

using namespace route_device;

// ------------------------------------------------------------------------------------------------
// Kernel A: top-k routing
// ------------------------------------------------------------------------------------------------

constexpr int kRouteWarps = 4;  // tokens per block; small blocks spread a decode batch over SMs
constexpr int kRouteThreads = kRouteWarps * 32;
template <int VPT, typename InT>
__global__ void __launch_bounds__(kRouteThreads)
    moe_route_topk_kernel(const InT* __restrict__ logits,            // [capacity, E]
                          const float* __restrict__ correction_bias,  // [E] or nullptr
                          const int32_t* __restrict__ num_tokens,     // [1]
                          int capacity, RouteParams params,
                          int32_t* __restrict__ topk_ids,      // [capacity, k]
                          float* __restrict__ topk_weights) {  // [capacity, k]
  // Group-limited routing only: the warp's biased scores and its kept-group flags.
  __shared__ float s_choice[kRouteWarps][VPT * 32];           // [E]
  __shared__ unsigned char s_group_kept[kRouteWarps][VPT * 32];  // [n_groups], n_groups <= E

  pdl_wait();  // logits come from the previous kernel
  pdl_launch_dependents();
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int token = blockIdx.x * kRouteWarps + warp;
  // [TAG_MOE_GRAPH_CAPACITY] Warps past the live count exit here. The whole warp leaves together,
  // and below there are only warp-level barriers, so no block barrier is left waiting.
  if (token >= live_tokens(num_tokens, capacity)) return;
  const int k = params.top_k;
  int my_id;
  float my_weight;
  route_one_token<VPT>(logits + static_cast<int64_t>(token) * params.num_experts, correction_bias, params,
                       s_choice[warp], s_group_kept[warp], lane, my_id, my_weight);
  if (lane < k) {
    topk_ids[static_cast<int64_t>(token) * k + lane] = my_id;
    topk_weights[static_cast<int64_t>(token) * k + lane] = my_weight;
  }
}

template <int VPT, typename InT>
void launch_route_vpt(const InT* logits, const float* bias, const int32_t* num_tokens, int capacity,
                      const RouteParams& p, int32_t* ids, float* weights, cudaStream_t stream) {
  // [TAG_MOE_GRAPH_CAPACITY] Grid from the capacity, never from the live count. At least one
  // block, so capacity 0 is still a valid (empty) launch.
  const int blocks = capacity > 0 ? (capacity + kRouteWarps - 1) / kRouteWarps : 1;
  launch_pdl(moe_route_topk_kernel<VPT, InT>, dim3(blocks), dim3(kRouteThreads), 0, stream, logits, bias, num_tokens,
             capacity, p, ids, weights);
}

template <typename InT>
void launch_route(const InT* logits, const float* bias, const int32_t* num_tokens, int capacity,
                  const RouteParams& p, int32_t* ids, float* weights, cudaStream_t stream) {
  const int E = p.num_experts;
  MOEBIUS_LAUNCH_ASSERT(E >= 1 && E <= kRouteMaxExperts, "num_experts must be in [1, 512]");
  MOEBIUS_LAUNCH_ASSERT(p.top_k >= 1 && p.top_k <= kRouteMaxTopK && p.top_k <= E,
                        "top_k must be in [1, min(16, num_experts)]");
  MOEBIUS_LAUNCH_ASSERT(capacity >= 0, "capacity must be >= 0");
  MOEBIUS_LAUNCH_ASSERT(num_tokens != nullptr, "num_tokens is a device int, never null");
  MOEBIUS_LAUNCH_ASSERT(capacity == 0 || (logits != nullptr && ids != nullptr && weights != nullptr),
                        "logits, topk_ids and topk_weights must be set");
  MOEBIUS_LAUNCH_ASSERT(reinterpret_cast<uintptr_t>(logits) % sizeof(InT) == 0 &&
                            reinterpret_cast<uintptr_t>(ids) % 4 == 0 && reinterpret_cast<uintptr_t>(weights) % 4 == 0 &&
                            reinterpret_cast<uintptr_t>(num_tokens) % 4 == 0 &&
                            reinterpret_cast<uintptr_t>(bias) % 4 == 0,
                        "pointers must be aligned to their element size");
  if (p.scoring == RouteScoring::kSoftmax) {
    MOEBIUS_LAUNCH_ASSERT(p.n_groups == 1 && p.topk_groups == 1 && bias == nullptr,
                          "group-limited routing and correction bias need sigmoid scoring");
  } else {
    MOEBIUS_LAUNCH_ASSERT(p.n_groups >= 1 && E % p.n_groups == 0, "n_groups must divide num_experts");
    MOEBIUS_LAUNCH_ASSERT(p.topk_groups >= 1 && p.topk_groups <= p.n_groups, "topk_groups must be in [1, n_groups]");
    MOEBIUS_LAUNCH_ASSERT(p.top_k <= p.topk_groups * (E / p.n_groups), "top_k exceeds the experts in the kept groups");
  }
  // VPT = experts per lane, the smallest power of two with 32 * VPT >= E.
  if (E <= 32) {
    launch_route_vpt<1>(logits, bias, num_tokens, capacity, p, ids, weights, stream);
  } else if (E <= 64) {
    launch_route_vpt<2>(logits, bias, num_tokens, capacity, p, ids, weights, stream);
  } else if (E <= 128) {
    launch_route_vpt<4>(logits, bias, num_tokens, capacity, p, ids, weights, stream);
  } else if (E <= 256) {
    launch_route_vpt<8>(logits, bias, num_tokens, capacity, p, ids, weights, stream);
  } else {
    launch_route_vpt<16>(logits, bias, num_tokens, capacity, p, ids, weights, stream);
  }
}

// ------------------------------------------------------------------------------------------------
// Kernel B: align (group the pairs by expert)
// ------------------------------------------------------------------------------------------------

constexpr int kCountThreads = 1024;
constexpr int kCountBatch = 16;  // ids in flight per thread: 16384 per block step
constexpr int kScatterWarps = 16;
constexpr int kScatterThreads = kScatterWarps * 32;
constexpr int kScatterSteps = 16;  // 32-id steps per warp and chunk; the ballot masks live in registers
constexpr int kScatterChunk = kScatterWarps * kScatterSteps * 32;  // 8192 ids per block iteration

__global__ void __launch_bounds__(kCountThreads)
    moe_align_count_kernel(const int32_t* __restrict__ topk_ids,    // [capacity, k]
                           const int32_t* __restrict__ num_tokens,  // [1]
                           int capacity, int k, int E, int block_m, int max_tiles,
                           int32_t* __restrict__ expert_offsets,  // [E+1]
                           int32_t* __restrict__ padded_offsets,  // [E+1] or nullptr (no padded outputs)
                           int32_t* __restrict__ tile_expert,     // [max_tiles]
                           int32_t* __restrict__ num_tiles) {     // [1]
  __shared__ int s_count[kRouteMaxExperts];
  __shared__ int s_offsets[kRouteMaxExperts + 1];
  __shared__ int s_padded_offsets[kRouteMaxExperts + 1];
  pdl_wait();  // the ids come from the previous kernel
  pdl_launch_dependents();
  const int tid = threadIdx.x;
  // [TAG_MOE_GRAPH_CAPACITY] Only the first T rows of ids are live.
  const int n = live_tokens(num_tokens, capacity) * k;

  for (int e = tid; e < E; e += kCountThreads) s_count[e] = 0;
  __syncthreads();
  // One block, so the loop is bound by L2 latency: kCountBatch independent loads per thread are
  // issued before any is used, one round trip per batch instead of one per id. Plain shared-memory
  // atomics: on the H200 they cost the same with all ids equal as with random ids, while
  // __match_any_sync warp aggregation made this loop 5x slower (measured, T*k = 32768).
  for (int base = 0; base < n; base += kCountThreads * kCountBatch) {
    int ids[kCountBatch];
#pragma unroll
    for (int j = 0; j < kCountBatch; ++j) {
      const int p = base + j * kCountThreads + tid;  // coalesced
      ids[j] = p < n ? topk_ids[p] : -1;
    }
#pragma unroll
    for (int j = 0; j < kCountBatch; ++j)
      if (static_cast<unsigned>(ids[j]) < static_cast<unsigned>(E)) atomicAdd(&s_count[ids[j]], 1);
  }
  __syncthreads();

  scan_expert_counts<kCountThreads>(s_count, E, block_m, max_tiles, s_offsets, s_padded_offsets, expert_offsets,
                                    padded_offsets, tile_expert, num_tiles);
}

__global__ void __launch_bounds__(kScatterThreads)
    moe_align_scatter_kernel(const int32_t* __restrict__ topk_ids,        // [capacity, k]
                             const int32_t* __restrict__ num_tokens,      // [1]
                             int capacity, int k,
                             const int32_t* __restrict__ expert_offsets,  // [E+1]
                             const int32_t* __restrict__ padded_offsets,  // [E+1] or nullptr
                             int32_t* __restrict__ sorted_pair_ids,       // [capacity*k]
                             int32_t* __restrict__ padded_pair_ids) {     // [max_padded] or nullptr
  __shared__ int s_warp_count[2][kScatterWarps];  // double-buffered: one barrier per chunk
  pdl_wait();  // offsets come from the count kernel, ids from the one before it
  pdl_launch_dependents();
  const int e = blockIdx.x;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const unsigned lanes_below = (1u << lane) - 1u;
  // [TAG_MOE_GRAPH_CAPACITY] Only the first T rows of ids are live.
  const int n = live_tokens(num_tokens, capacity) * k;
  const int begin = expert_offsets[e];
  const int count = expert_offsets[e + 1] - begin;
  const bool padded = padded_pair_ids != nullptr;
  const int padded_begin = padded ? padded_offsets[e] : 0;
  if (padded) {  // the tail of this expert's last tile
    const int padded_end = padded_offsets[e + 1];
    for (int i = padded_begin + count + threadIdx.x; i < padded_end; i += kScatterThreads) padded_pair_ids[i] = -1;
  }
  if (count == 0) return;  // uniform over the block; nothing to place

  int found = 0;  // this expert's pairs in earlier chunks; the same value in every thread
  for (int chunk = 0, it = 0; chunk < n && found < count; chunk += kScatterChunk, ++it) {
    const int warp_base = chunk + warp * (kScatterSteps * 32);
    unsigned hits[kScatterSteps];  // bit l of hits[s]: pair warp_base + s*32 + l belongs to e
    int warp_count = 0;
#pragma unroll
    for (int s = 0; s < kScatterSteps; ++s) {
      const int p = warp_base + s * 32 + lane;
      const int id = p < n ? topk_ids[p] : -1;  // coalesced: a warp reads 128 contiguous bytes
      hits[s] = __ballot_sync(kFullMask, id == e);
      warp_count += __popc(hits[s]);
    }
    const int buf = it & 1;
    if (lane == 0) s_warp_count[buf][warp] = warp_count;
    __syncthreads();
    // Buffer `buf` is rewritten two chunks later, after every thread has passed the next barrier,
    // so the reads below cannot race with it.
    int rank = found, chunk_count = 0;
    for (int w = 0; w < kScatterWarps; ++w) {
      const int wc = s_warp_count[buf][w];
      if (w < warp) rank += wc;
      chunk_count += wc;
    }
#pragma unroll
    for (int s = 0; s < kScatterSteps; ++s) {
      if ((hits[s] >> lane) & 1u) {
        const int pos = rank + __popc(hits[s] & lanes_below);
        const int p = warp_base + s * 32 + lane;
        sorted_pair_ids[begin + pos] = p;
        if (padded) padded_pair_ids[padded_begin + pos] = p;
      }
      rank += __popc(hits[s]);
    }
    found += chunk_count;
  }
}

// The align of at most kAlignSmallMaxPairs pairs in one kernel (decode and small batches): the
// count and scatter kernels are two launches and two dependent waits for a few hundred ids
// (docs/PERF.md run S4: 6.3-6.5 us of stage time at T = 16-64, Qwen3-30B-A3B). One block loads
// the ids once into shared memory and runs align_pairs_chunked (moe_route_device.cuh), whose steps
// grow with n / 1024 + n / 32, not with n: 1024 pairs, T = 128 at k = 8. (Its first version ranked
// a pair by counting equal ids at lower p, which cost 7.4 us at 512 pairs and 15.1 at 1024, run S6,
// and was capped at 256.)
constexpr int kAlignSmallThreads = 1024;
constexpr int kAlignSmallMaxPairs = 1024;
constexpr int kAlignSmallMaxChunks = kAlignSmallMaxPairs / 32;
static_assert(kAlignSmallThreads >= kRouteMaxExperts, "scan_expert_counts: a thread per expert");

__global__ void __launch_bounds__(kAlignSmallThreads)
    moe_align_small_kernel(const int32_t* __restrict__ topk_ids,    // [capacity, k]
                           const int32_t* __restrict__ num_tokens,  // [1]
                           int capacity, int k, int E, int block_m, int max_tiles,
                           int32_t* __restrict__ expert_offsets,   // [E+1]
                           int32_t* __restrict__ sorted_pair_ids,  // [capacity*k]
                           int32_t* __restrict__ padded_offsets,   // [E+1] or nullptr (no padded outputs)
                           int32_t* __restrict__ padded_pair_ids,  // [max_padded] or nullptr
                           int32_t* __restrict__ tile_expert,      // [max_tiles] or nullptr
                           int32_t* __restrict__ num_tiles) {      // [1] or nullptr
  __shared__ int s_ids[kAlignSmallMaxPairs];
  __shared__ uint16_t s_chunk[kAlignSmallMaxChunks * kRouteMaxExperts];
  __shared__ int s_count[kRouteMaxExperts];
  __shared__ int s_offsets[kRouteMaxExperts + 1];
  __shared__ int s_padded_offsets[kRouteMaxExperts + 1];
  pdl_wait();  // the ids come from the previous kernel
  pdl_launch_dependents();
  // [TAG_MOE_GRAPH_CAPACITY] Only the first T rows of ids are live.
  const int n = live_tokens(num_tokens, capacity) * k;
  for (int p = threadIdx.x; p < n; p += kAlignSmallThreads) s_ids[p] = topk_ids[p];
  // align_pairs_chunked's first barrier orders these stores before any read.
  align_pairs_chunked<kAlignSmallThreads, kAlignSmallMaxChunks>(
      s_ids, n, E, block_m, max_tiles, s_chunk, s_count, s_offsets, s_padded_offsets, expert_offsets, sorted_pair_ids,
      padded_offsets, padded_pair_ids, tile_expert, num_tiles);
}

// Top-k and align in one block (the separate routing's kernels A and B for small batches): the
// count of kernel boundaries is what a few tokens pay for, not the work (docs/PERF.md run Z18:
// top-k 3.8 and align 4.4 us of stage time at T = 8-16, each mostly a launch and a dependent
// wait). Warp w routes token w with route_one_token (the top-k kernel's arithmetic), its ids go to
// shared memory, and the block aligns them as moe_align_small_kernel does (one warp for n <= 32
// pairs, as the fused routing's warp path): the same bits as the two kernels. One token per warp
// (capacity <= 32), so the block's chain is one token's top-k plus the align; ungrouped scoring
// only (the group-limited top-k needs a warp's E-float scratch: 64 KB for 32 warps at E = 512), and
// E <= 256: at 1024 threads a lane has 64 registers, and the 16 logits a lane of E = 512 spilled.
constexpr int kTopKAlignThreads = kRouteTopKAlignMaxCapacity * 32;
constexpr int kTopKAlignMaxPairs = kRouteTopKAlignMaxCapacity * kRouteMaxTopK;  // 512
constexpr int kTopKAlignMaxChunks = kTopKAlignMaxPairs / 32;
static_assert(kTopKAlignThreads >= kRouteTopKAlignMaxExperts, "align_pairs_chunked and scan: a thread per expert");
template <int VPT>
__global__ void __launch_bounds__(kTopKAlignThreads)
    moe_route_topk_align_kernel(const float* __restrict__ logits,            // [capacity, E]
                                const float* __restrict__ correction_bias,  // [E] or nullptr
                                const int32_t* __restrict__ num_tokens,     // [1]
                                int capacity, RouteParams params, int block_m, int max_tiles,
                                int32_t* __restrict__ topk_ids,          // [capacity, k]
                                float* __restrict__ topk_weights,        // [capacity, k]
                                int32_t* __restrict__ expert_offsets,    // [E+1]
                                int32_t* __restrict__ sorted_pair_ids,   // [capacity*k]
                                int32_t* __restrict__ padded_offsets,    // [E+1]
                                int32_t* __restrict__ padded_pair_ids,   // [max_padded]
                                int32_t* __restrict__ tile_expert,       // [max_tiles]
                                int32_t* __restrict__ num_tiles) {       // [1]
  __shared__ int s_ids[kTopKAlignMaxPairs];
  __shared__ uint16_t s_chunk[kTopKAlignMaxChunks * kRouteTopKAlignMaxExperts];
  __shared__ int s_count[kRouteTopKAlignMaxExperts];
  __shared__ int s_offsets[kRouteTopKAlignMaxExperts + 1];
  __shared__ int s_padded_offsets[kRouteTopKAlignMaxExperts + 1];
  pdl_wait();  // logits come from the previous kernel
  pdl_launch_dependents();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int T = live_tokens(num_tokens, capacity);  // [TAG_MOE_GRAPH_CAPACITY]
  const int k = params.top_k, E = params.num_experts;
  if (warp < T) {  // uniform over the warp; only warp-level barriers inside
    int my_id;
    float my_weight;
    route_one_token<VPT>(logits + static_cast<int64_t>(warp) * E, correction_bias, params, nullptr, nullptr, lane,
                         my_id, my_weight);
    if (lane < k) {
      const int item = warp * k + lane;
      topk_ids[item] = my_id;
      topk_weights[item] = my_weight;
      s_ids[item] = my_id;
    }
  }
  const int n = T * k;
  if (n <= 32) {
    __syncthreads();  // the ids in s_ids
    if (warp == 0)
      align_pairs_in_warp<VPT>(s_ids[lane < n ? lane : 0], n, E, block_m, max_tiles, lane, expert_offsets,
                               sorted_pair_ids, padded_offsets, padded_pair_ids, tile_expert, num_tiles);
    return;
  }
  // align_pairs_chunked's first barrier orders the s_ids stores before any read.
  align_pairs_chunked<kTopKAlignThreads, kTopKAlignMaxChunks>(s_ids, n, E, block_m, max_tiles, s_chunk, s_count,
                                                               s_offsets, s_padded_offsets, expert_offsets,
                                                               sorted_pair_ids, padded_offsets, padded_pair_ids,
                                                               tile_expert, num_tiles);
}

// ------------------------------------------------------------------------------------------------
// Router logits (the "mlp.gate" GEMV)
// ------------------------------------------------------------------------------------------------

constexpr int kRouterTokens = 8;
constexpr int kRouterWarps = 8;

// Warp per (expert e, 8 tokens): logits[t][e] for t in [t0, t0 + 8).
template <bool kVec>
__global__ void __launch_bounds__(kRouterWarps * 32)
    moe_router_logits_kernel(const __nv_bfloat16* __restrict__ x, int x_stride,    // [capacity, x_stride]
                             const __nv_bfloat16* __restrict__ wr,                  // [E, H]
                             const int32_t* __restrict__ num_tokens, int capacity, int hidden, int num_experts,
                             float* __restrict__ logits) {                          // [capacity, E]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int e = blockIdx.x * kRouterWarps + warp;
  if (e < num_experts) prefetch_router_row(wr + static_cast<int64_t>(e) * hidden, hidden, lane);
  pdl_wait();  // x comes from the previous kernel
  pdl_launch_dependents();
  const int t0 = blockIdx.y * kRouterTokens;
  const int T = live_tokens(num_tokens, capacity);
  if (t0 >= T || e >= num_experts) return;  // [TAG_MOE_GRAPH_CAPACITY]
  const int nt = min(kRouterTokens, T - t0);
  float acc[kRouterTokens];
  router_dot<kRouterTokens, kVec>(x, x_stride, wr + static_cast<int64_t>(e) * hidden, hidden, t0, nt, lane, acc);
#pragma unroll
  for (int j = 0; j < kRouterTokens; ++j)
    if (lane == 0 && j < nt) logits[static_cast<int64_t>(t0 + j) * num_experts + e] = acc[j];
}

// Tensor-core tiles (capacities above kRouterDotMaxCapacity, vectorisable shapes): block =
// (16-expert group, 8-token chunk), its 16 warps splitting the hidden dimension
// (router_tile_partial), then 128 threads sum the partials in warp order (router_tile_sum).
// Qwen3-30B-A3B at T = 64: 8 x 8 blocks; 3.4 us of stage time against the warp-per-expert GEMV's
// 6.4-6.6 at T = 9-64 (docs/PERF.md runs T3-T4: the GEMV spent ~2 instructions per multiply-add).
__global__ void __launch_bounds__(kRouterTileWarps * 32)
    moe_router_logits_tile_kernel(const __nv_bfloat16* __restrict__ x, int x_stride,  // [capacity, x_stride]
                                  const __nv_bfloat16* __restrict__ wr,                // [E, H]
                                  const int32_t* __restrict__ num_tokens, int capacity, int hidden,
                                  int num_experts, float* __restrict__ logits) {   // [capacity, E]
  __shared__ __align__(16) float s_red[kRouterTileWarps * kRouterTileValues];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int e0 = blockIdx.x * kRouterTileExperts;
  if (e0 + warp < num_experts) prefetch_router_row(wr + static_cast<int64_t>(e0 + warp) * hidden, hidden, lane);
  pdl_wait();  // x comes from the previous kernel
  pdl_launch_dependents();
  const int t0 = blockIdx.y * kRouterTileTokens;
  const int T = live_tokens(num_tokens, capacity);
  if (t0 >= T) return;  // [TAG_MOE_GRAPH_CAPACITY] uniform over the block
  const int nt = min(kRouterTileTokens, T - t0);
  router_tile_block<kRouterTileWarps>(x, x_stride, wr, hidden, num_experts, e0, t0, nt, warp, lane, s_red,
                                      [&](int e, int t, float v) {
                                        if (t < t0 + nt) logits[static_cast<int64_t>(t) * num_experts + e] = v;
                                      });
}

// ------------------------------------------------------------------------------------------------
// Fused small-batch routing: router logits + top-k + align in one launch
// ------------------------------------------------------------------------------------------------

constexpr int kSmallWarps = 16;
constexpr int kSmallThreads = kSmallWarps * 32;
constexpr int kSmallClusterBlocks = 8;       // the portable cluster size: capacities up to 4
constexpr int kSmallWideClusterBlocks = 16;  // non-portable (sm_90 allows 16): capacities 5-16
// From this many live tokens on, each token's scores and top-k run in a block of its own (token t
// in block t): one block ranking T x E entries alone took 15k cycles at T = 8 (dev_probe_route_decode,
// phase 2b), a block per token one round; the price is a second cluster barrier (~1k cycles) for the
// ids to reach block 0's align. One or two tokens stay in block 0 (no second barrier).
constexpr int kSmallTokensPerBlockMin = 3;
static_assert(kRouteSmallMaxTokens <= kSmallWideClusterBlocks, "a block per token");
static_assert(kSmallThreads >= kRouteSmallMaxExperts, "one thread per expert in the scan");
static_assert(kRouteSmallMaxTokens <= kSmallWarps, "one warp per token for the scores");

// One thread-block cluster of CB blocks (8, or 16 for capacities above 4).
// Phase 1, every block: the (expert, token chunk of TOK) items are spread over the cluster's warps;
// each computes its logits (router_dot, so the same bits as moe_router_logits_kernel) and stores
// them into the shared memory of the block that owns the token, through the cluster's distributed
// shared memory. Above capacity kRouterDotMaxCapacity (1) with vectorisable shapes, block b takes
// the tiles (16 experts x 8 tokens) b, b + CB, ... on mma instead (the separate router's tiles,
// the same bits). The router rows are prefetched into L2 before pdl_wait (they are weights). A
// cluster barrier (release/acquire) then hands every owner its tokens' logits.
// Owners: block 0 owns every token when T < kSmallTokensPerBlockMin, else block t owns token t.
// One or two tokens (decode): block 0's warp t routes token t with route_one_token (the separate
// top-k kernel's code: scores, warp_top_k, renormalisation), warp 0 then aligns the pairs
// (align_pairs_in_warp); no block barrier after the cluster's.
// Phase 2, from 3 tokens on, in each owner: write the global logits, then the top-k: warp j scores
// its j-th token (softmax or biased sigmoid, group limits), then every thread ranks one
// (token, expert) entry by counting the entries that beat it (higher key, then lower index: the
// order of the warp argmax rounds, so the same winners in the same slots) and the winners write
// their slot; the ids also go to block 0's shared memory (DSMEM), and with a block per token a
// second cluster barrier hands them over. Block 0 alone does phase 3, the align of the T*k <= 256
// pairs (align_pairs_in_warp up to 32 pairs; above, a shared-memory histogram, scan, and a stable
// rank by counting equal ids at lower p).
// Why: at decode sizes the three separate kernels cost ~14 us on the H200, almost all of it
// dependent latency (docs/PERF.md). The router weight (E*H*2 bytes, 512 KiB for Qwen3-30B-A3B)
// needs many SMs to stream, the tail needs them to meet. With a shuffle-butterfly argmax, k rounds
// of one warp were ~3 us of the tail at T = 1, so a block-wide rank replaced them; with
// warp_top_k the warp is the faster tail again at one or two tokens, where the block-wide phases
// cost barriers and shared-memory round trips (routing stage at T = 1 6.69 -> 6.26 us, T = 2
// 9.22 -> 7.44; run P3, dev/cuda/probe_route_decode.cu has the phase stamps).
template <int VPT, int TOK, bool kVec, int CB>
__global__ void __launch_bounds__(kSmallThreads)
    moe_route_small_kernel(const __nv_bfloat16* __restrict__ x, int x_stride,  // [capacity, x_stride]
                           const __nv_bfloat16* __restrict__ wr, int hidden,     // [E, H]
                           const float* __restrict__ correction_bias,            // [E] or nullptr
                           const int32_t* __restrict__ num_tokens, int capacity, RouteParams params, int block_m,
                           int max_tiles,
                           float* __restrict__ logits,        // [capacity, E]
                           int32_t* __restrict__ topk_ids, float* __restrict__ topk_weights,  // [capacity, k]
                           int32_t* __restrict__ expert_offsets,                              // [E+1]
                           int32_t* __restrict__ sorted_pair_ids,                             // [capacity*k]
                           int32_t* __restrict__ padded_offsets,                              // [E+1]
                           int32_t* __restrict__ padded_pair_ids,                             // [max_padded]
                           int32_t* __restrict__ tile_expert,                                 // [max_tiles]
                           int32_t* __restrict__ num_tiles) {                                 // [1]
  __shared__ float s_logits[kRouteSmallMaxTokens][VPT * 32];        // [T, E]: the owned tokens' rows
  __shared__ float s_choice[kRouteSmallMaxTokens][VPT * 32];        // group-limited scratch
  __shared__ unsigned char s_group_kept[kRouteSmallMaxTokens][VPT * 32];
  // Phase 2: each entry's rank key (NaN: not eligible, never beats anything) and raw weight; the
  // winners by slot.
  __shared__ __align__(16) float s_key[kRouteSmallMaxTokens][VPT * 32];
  __shared__ float s_weight[kRouteSmallMaxTokens][VPT * 32];
  __shared__ int s_win_id[kRouteSmallMaxTokens][kRouteMaxTopK];
  __shared__ float s_win_w[kRouteSmallMaxTokens][kRouteMaxTopK];
  __shared__ int s_ids[kRouteSmallMaxPairs];                        // [T*k]
  __shared__ int s_count[kRouteSmallMaxExperts];
  __shared__ int s_offsets[kRouteSmallMaxExperts + 1];
  __shared__ int s_padded_offsets[kRouteSmallMaxExperts + 1];
  // Phase 1 on tensor-core tiles (capacity > 1, vectorisable shapes): the 16 warps' partial sums.
  // s_key is free until phase 2 and holds them from E > 96 (VPT >= 4) on.
  constexpr bool kTiles = kVec && (TOK > 1 || CB == kSmallWideClusterBlocks);  // capacity > 1
  constexpr int kRedFloats = kRouterTileWarps * kRouterTileValues;
  constexpr bool kRedInKey = kRouteSmallMaxTokens * VPT * 32 >= kRedFloats;
  __shared__ __align__(16) float s_red_own[kTiles && !kRedInKey ? kRedFloats : 1];
  float* s_red = kRedInKey ? &s_key[0][0] : s_red_own;

  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  int* leader_ids = cluster.map_shared_rank(&s_ids[0], 0);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int E = params.num_experts, k = params.top_k;
  constexpr int kWarpStride = CB * kSmallWarps;
  for (int e = rank * kSmallWarps + warp; e < E; e += kWarpStride)
    prefetch_router_row(wr + static_cast<int64_t>(e) * hidden, hidden, lane);
  MOEBIUS_ROUTE_PHASE_STAMP(0);
  pdl_wait();  // x comes from the previous kernel
  pdl_launch_dependents();
  MOEBIUS_ROUTE_PHASE_STAMP(1);
  const int T = live_tokens(num_tokens, capacity);  // [TAG_MOE_GRAPH_CAPACITY]
  // Uniform over the cluster: every block reads the same T.
  const bool per_token_blocks = T >= kSmallTokensPerBlockMin;
  auto owner_of = [&](int t) { return per_token_blocks ? t : 0; };
  // This block's tokens: [my_t0, my_t0 + my_nt).
  const int my_t0 = per_token_blocks ? rank : 0;
  const int my_nt = per_token_blocks ? (rank < T ? 1 : 0) : (rank == 0 ? T : 0);

  // Phase 1: item = (expert e, token chunk c of TOK tokens), spread over every warp of the cluster.
  // The 8-block cluster serves capacities <= 4 <= TOK: one chunk whatever T is, and the dot reads
  // the rows below the capacity, so its loads do not wait for the live count (a dependent L2 read
  // at the kernel's start); the rows past T are computed and dropped (a token's sums do not depend
  // on the others'). The 16-block cluster counts chunks from T, so a short step does less work.
  const bool one_chunk = CB == kSmallClusterBlocks;
  const int chunks = one_chunk ? 1 : (T + TOK - 1) / TOK;
  if constexpr (kTiles) {
    // Capacities above kRouterDotMaxCapacity: the tiles (16-expert group g, 8-token chunk c) are
    // dealt to the blocks, tile i = g * tile_chunks + c to block i mod CB, and each computes its
    // logits exactly as moe_router_logits_tile_kernel's block of the same tile (router_tile_block):
    // the same bits as the separate router. Why: router_dot's ~2
    // instructions per multiply-add made this phase ~4.9 us at T = 8 on the cluster (run M3's
    // probe, 8541 cycles), where one mma does 2048 multiply-adds.
    static_assert(kSmallWarps == kRouterTileWarps && kSmallThreads >= kRouterTileValues,
                  "a tile per block and round: 16 warps, 128 sums");
    // The tiles read the capacity's rows, not the live count's (as one_chunk below): a token's
    // column of an mma depends on its own row only, so rows past T change no live logit, and the
    // loads need not wait for *num_tokens.
    const int tile_chunks = (capacity + kRouterTileTokens - 1) / kRouterTileTokens;
    const int tiles = (E + kRouterTileExperts - 1) / kRouterTileExperts * tile_chunks;
    for (int i = rank; i < tiles; i += CB) {  // uniform over the block
      const int e0 = i / tile_chunks * kRouterTileExperts, t0 = i % tile_chunks * kRouterTileTokens;
      const int rows = min(kRouterTileTokens, capacity - t0);
      router_tile_block<kRouterTileWarps>(x, x_stride, wr, hidden, E, e0, t0, rows, warp, lane, s_red,
                                          [&](int e, int t, float v) {
                                            if (t < T) cluster.map_shared_rank(&s_logits[t][0], owner_of(t))[e] = v;
                                          });
      __syncthreads();  // s_red is read before the next tile's partials overwrite it
    }
  }
  for (int item = kTiles ? E * chunks : rank * kSmallWarps + warp; item < E * chunks; item += kWarpStride) {
    const int e = item / chunks, t0 = (item - e * chunks) * TOK;
    const int nt = min(TOK, T - t0);
    float acc[TOK];
    router_dot<TOK, kVec>(x, x_stride, wr + static_cast<int64_t>(e) * hidden, hidden, t0,
                          one_chunk ? min(TOK, capacity) : nt, lane, acc);
#pragma unroll
    for (int j = 0; j < TOK; ++j) {
      if (lane == 0 && j < nt) {
        float* dst = cluster.map_shared_rank(&s_logits[t0 + j][0], owner_of(t0 + j));
        dst[e] = acc[j];
      }
    }
  }
  MOEBIUS_ROUTE_PHASE_STAMP(2);
  // arrive.release / wait.acquire: each owner sees every block's DSMEM stores. Only shared-memory
  // stores precede it (the owners write the global logits below), so the release does not wait
  // for global stores to drain.
  cluster.sync();
  MOEBIUS_ROUTE_PHASE_STAMP(3);
  if (!per_token_blocks) {
    // One or two tokens (decode): block 0's warp t routes token t alone (route_one_token's steps,
    // the separate top-k kernel's code) and warp 0 aligns the pairs; no block barrier. Warp 0 also
    // runs when T = 0: the align still writes empty offsets and dead tiles.
    if (rank != 0 || warp >= max(T, 1)) return;
    int my_id = 0;
    if (warp < T) {
      const int t = warp;
      for (int e = lane; e < E; e += 32) logits[t * E + e] = s_logits[t][e];
      float my_weight;
      route_one_token<VPT>(&s_logits[t][0], correction_bias, params, s_choice[t], s_group_kept[t], lane, my_id,
                           my_weight);
      MOEBIUS_ROUTE_PHASE_STAMP(4);
      if (lane < k) {
        topk_ids[t * k + lane] = my_id;
        topk_weights[t * k + lane] = my_weight;
        s_ids[t * k + lane] = my_id;
      }
      MOEBIUS_ROUTE_PHASE_STAMP(5);
    }
    if (T == 2) asm volatile("bar.sync 1, 64;" ::: "memory");  // warps 0 and 1: token 1's ids in s_ids
    if (warp != 0) return;
    MOEBIUS_ROUTE_PHASE_STAMP(6);
    MOEBIUS_ROUTE_PHASE_STAMP(7);
    align_pairs_in_warp<VPT>(T == 2 ? s_ids[lane < 2 * k ? lane : 0] : my_id, T * k, E, block_m, max_tiles, lane,
                             expert_offsets, sorted_pair_ids, padded_offsets, padded_pair_ids, tile_expert, num_tiles);
    MOEBIUS_ROUTE_PHASE_STAMP(8);
    return;
  }
  for (int i = tid; i < my_nt * E; i += kSmallThreads) {
    const int t = my_t0 + i / E, e = i % E;
    logits[t * E + e] = s_logits[t][e];
  }

  // Phase 2a: warp j scores token my_t0 + j.
  if (warp < my_nt) {
    const int t = my_t0 + warp;
    float key[VPT], weight[VPT];
    const uint32_t eligible = token_scores<VPT>(&s_logits[t][0], correction_bias, params, s_choice[t],
                                                s_group_kept[t], lane, key, weight);
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int e = i * 32 + lane;
      // A NaN score ranks as -inf (it can still fill a slot, so ids stay valid experts).
      s_key[t][e] = ((eligible >> i) & 1u) ? (key[i] != key[i] ? -INFINITY : key[i]) : __int_as_float(0x7fc00000);
      s_weight[t][e] = weight[i];
    }
  }
  __syncthreads();
  MOEBIUS_ROUTE_PHASE_STAMP(4);
  // Phase 2b: rank every eligible (token, expert) entry by counting the entries that beat it;
  // entries ranked below k win that slot. kParts consecutive lanes share an entry, part p counting
  // the keys o = p (mod kParts) with kParts independent partial counts: one thread walking all E
  // keys was a chain of dependent shared-memory loads (1.7 us at T = 1, 6 us at T = 8; the
  // probe's phase stamps). The trip count is uniform over the block, so the shuffles that add the
  // parts see every lane.
  {
    constexpr int kParts = 4;
    const int items = my_nt * E * kParts;
    for (int base = 0; base < items; base += kSmallThreads) {
      const int item = base + tid;
      const bool live = item < items;
      const int entry = live ? item / kParts : 0, part = item % kParts;
      const int t = my_t0 + entry / E, e = entry - (entry / E) * E;
      const float v = s_key[t][e];
      const bool ok = live && v == v;  // NaN: not eligible
      int c[4] = {0, 0, 0, 0};
      if (ok) {
        const float* keys = s_key[t];
        int o = part;
        for (; o + 3 * kParts < E; o += 4 * kParts) {
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const int oo = o + u * kParts;
            const float w = keys[oo];
            c[u] += (w > v) | ((w == v) & (oo < e));
          }
        }
        for (; o < E; o += kParts) {
          const float w = keys[o];
          c[0] += (w > v) | ((w == v) & (o < e));
        }
      }
      int beaten_by = c[0] + c[1] + c[2] + c[3];
      beaten_by += __shfl_xor_sync(kFullMask, beaten_by, 1);
      beaten_by += __shfl_xor_sync(kFullMask, beaten_by, 2);
      if (ok && part == 0 && beaten_by < k) {
        s_win_id[t][beaten_by] = e;
        s_win_w[t][beaten_by] = s_weight[t][e];
      }
    }
  }
  __syncthreads();
  MOEBIUS_ROUTE_PHASE_STAMP(5);
  // Phase 2c: renormalise in slot order (fp64, as the oracle) and publish; the ids also go to
  // block 0 for the align.
  for (int it = tid; it < my_nt * k; it += kSmallThreads) {
    const int item = my_t0 * k + it;
    const int t = item / k, j = item - t * k;
    double sum = 0.0;
    if (params.renormalize)
      for (int q = 0; q < k; ++q) sum = __dadd_rn(sum, static_cast<double>(s_win_w[t][q]));
    const int id = s_win_id[t][j];
    topk_ids[item] = id;
    topk_weights[item] = finish_weight(s_win_w[t][j], sum, params);
    (per_token_blocks ? leader_ids : s_ids)[item] = id;
  }
  if (per_token_blocks) {
    cluster.sync();  // every owner's ids are in block 0's s_ids (DSMEM stores, release/acquire)
  }
  // Uniform over the block; after the last cluster barrier nobody touches another block's
  // shared memory.
  if (rank != 0) return;
  // Phase 3: align the n = T*k pairs (same outputs as moe_align_count + moe_align_scatter).
  const int n = T * k;
  if (n <= 32) {  // one pair per lane: warp 0 alone (the ids arrived by DSMEM before the barrier)
    MOEBIUS_ROUTE_PHASE_STAMP(6);
    if (warp == 0)
      align_pairs_in_warp<VPT>(s_ids[lane < n ? lane : 0], n, E, block_m, max_tiles, lane, expert_offsets,
                               sorted_pair_ids, padded_offsets, padded_pair_ids, tile_expert, num_tiles);
    MOEBIUS_ROUTE_PHASE_STAMP(7);
    MOEBIUS_ROUTE_PHASE_STAMP(8);
    return;
  }
  // The steps of a block align written out here (at most 256 pairs): calling the shared helper of
  // the time (align_pairs_in_block, since replaced by align_pairs_chunked) from this kernel
  // measured the routing stage 1.5 us slower at T = 8 (and 0.9 us faster at T = 4, whose 32 pairs take the
  // warp path above; docs/PERF.md run S8: different code generation for the whole kernel, the
  // layer 62.5 against 64.1 us at T = 8, 44.5 against 44.0 at T = 4).
  for (int i = tid; i < E; i += kSmallThreads) s_count[i] = 0;
  __syncthreads();
  for (int p = tid; p < n; p += kSmallThreads) atomicAdd(&s_count[s_ids[p]], 1);
  __syncthreads();
  MOEBIUS_ROUTE_PHASE_STAMP(6);
  scan_expert_counts<kSmallThreads>(s_count, E, block_m, max_tiles, s_offsets, s_padded_offsets, expert_offsets,
                                    padded_offsets, tile_expert, num_tiles);
  MOEBIUS_ROUTE_PHASE_STAMP(7);
  for (int p = tid; p < n; p += kSmallThreads) {
    const int id = s_ids[p];
    int rank_in_expert = 0;  // pairs of the same expert at lower p: ascending p inside each expert, as align
    for (int q = 0; q < p; ++q) rank_in_expert += s_ids[q] == id;
    sorted_pair_ids[s_offsets[id] + rank_in_expert] = p;
    padded_pair_ids[s_padded_offsets[id] + rank_in_expert] = p;
  }
  if (tid < E) {  // the tail of this expert's last tile
    for (int r = s_padded_offsets[tid] + s_count[tid]; r < s_padded_offsets[tid + 1]; ++r) padded_pair_ids[r] = -1;
  }
  MOEBIUS_ROUTE_PHASE_STAMP(8);
}

}  // namespace

void launch_moe_route_topk(const __nv_bfloat16* logits, const float* correction_bias, const int32_t* num_tokens,
                           int capacity, const RouteParams& params, int32_t* topk_ids, float* topk_weights,
                           cudaStream_t stream) {
  launch_route(logits, correction_bias, num_tokens, capacity, params, topk_ids, topk_weights, stream);
}

void launch_moe_route_topk(const float* logits, const float* correction_bias, const int32_t* num_tokens,
                           int capacity, const RouteParams& params, int32_t* topk_ids, float* topk_weights,
                           cudaStream_t stream) {
  launch_route(logits, correction_bias, num_tokens, capacity, params, topk_ids, topk_weights, stream);
}

void launch_moe_align(const int32_t* topk_ids, const int32_t* num_tokens, int capacity, int top_k, int num_experts,
                      int block_m, int32_t* expert_offsets, int32_t* sorted_pair_ids, int32_t* padded_offsets,
                      int32_t* padded_pair_ids, int32_t* tile_expert, int32_t* num_tiles, cudaStream_t stream) {
  const int E = num_experts;
  MOEBIUS_LAUNCH_ASSERT(E >= 1 && E <= kRouteMaxExperts, "num_experts must be in [1, 512]");
  MOEBIUS_LAUNCH_ASSERT(top_k >= 1, "top_k must be >= 1");
  MOEBIUS_LAUNCH_ASSERT(capacity >= 0, "capacity must be >= 0");
  MOEBIUS_LAUNCH_ASSERT(block_m >= 1, "block_m must be >= 1");
  // Keeps every index and every loop bound (chunk + 8192) well inside int32.
  const int64_t max_padded = moe_align_max_padded(capacity, top_k, E, block_m);
  MOEBIUS_LAUNCH_ASSERT(max_padded < (int64_t{1} << 30), "capacity * top_k + E * (block_m - 1) must be < 2^30");
  const bool padded = padded_offsets != nullptr;
  MOEBIUS_LAUNCH_ASSERT(padded == (padded_pair_ids != nullptr) && padded == (tile_expert != nullptr) &&
                            padded == (num_tiles != nullptr),
                        "padded_offsets, padded_pair_ids, tile_expert and num_tiles: all set or all null");
  MOEBIUS_LAUNCH_ASSERT(num_tokens != nullptr && expert_offsets != nullptr, "num_tokens and expert_offsets must be set");
  MOEBIUS_LAUNCH_ASSERT(capacity == 0 || (topk_ids != nullptr && sorted_pair_ids != nullptr),
                        "topk_ids and sorted_pair_ids must be set");
  const int max_tiles = padded ? static_cast<int>(moe_align_max_tiles(capacity, top_k, E, block_m)) : 0;
  // [TAG_MOE_GRAPH_CAPACITY] The kernel choice and the grids depend on the capacity and E alone;
  // the live count is read on the device.
  if (static_cast<int64_t>(capacity) * top_k <= kAlignSmallMaxPairs) {
    launch_pdl(moe_align_small_kernel, dim3(1), dim3(kAlignSmallThreads), 0, stream, topk_ids, num_tokens, capacity,
               top_k, E, block_m, max_tiles, expert_offsets, sorted_pair_ids, padded_offsets, padded_pair_ids,
               tile_expert, num_tiles);
    return;
  }
  launch_pdl(moe_align_count_kernel, dim3(1), dim3(kCountThreads), 0, stream, topk_ids, num_tokens, capacity, top_k, E,
             block_m, max_tiles, expert_offsets, padded_offsets, tile_expert, num_tiles);
  launch_pdl(moe_align_scatter_kernel, dim3(E), dim3(kScatterThreads), 0, stream, topk_ids, num_tokens, capacity, top_k,
             expert_offsets, padded_offsets, sorted_pair_ids, padded_pair_ids);
}

bool moe_route_topk_align_supported(int capacity, const RouteParams& p) {
  return capacity >= 0 && capacity <= kRouteTopKAlignMaxCapacity && p.num_experts >= 1 &&
         p.num_experts <= kRouteTopKAlignMaxExperts && p.top_k >= 1 && p.top_k <= kRouteMaxTopK &&
         p.top_k <= p.num_experts &&
         p.n_groups == 1 && p.topk_groups == 1;
}

void launch_moe_route_topk_align(const float* logits, const float* correction_bias, const int32_t* num_tokens,
                                 int capacity, const RouteParams& params, int block_m, int32_t* topk_ids,
                                 float* topk_weights, int32_t* expert_offsets, int32_t* sorted_pair_ids,
                                 int32_t* padded_offsets, int32_t* padded_pair_ids, int32_t* tile_expert,
                                 int32_t* num_tiles, cudaStream_t stream) {
  const int E = params.num_experts;
  MOEBIUS_LAUNCH_ASSERT(moe_route_topk_align_supported(capacity, params), "shape outside the one-block top-k + align");
  MOEBIUS_LAUNCH_ASSERT(block_m >= 1, "block_m must be >= 1");
  MOEBIUS_LAUNCH_ASSERT(params.scoring == RouteScoring::kSigmoid || correction_bias == nullptr,
                        "a correction bias needs sigmoid scoring");
  MOEBIUS_LAUNCH_ASSERT(num_tokens != nullptr && topk_ids != nullptr && topk_weights != nullptr &&
                            expert_offsets != nullptr && sorted_pair_ids != nullptr && padded_offsets != nullptr &&
                            padded_pair_ids != nullptr && tile_expert != nullptr && num_tiles != nullptr &&
                            (capacity == 0 || logits != nullptr),
                        "every output of the top-k + align must be set");
  MOEBIUS_LAUNCH_ASSERT(reinterpret_cast<uintptr_t>(logits) % 4 == 0 &&
                            reinterpret_cast<uintptr_t>(correction_bias) % 4 == 0 &&
                            reinterpret_cast<uintptr_t>(num_tokens) % 4 == 0,
                        "logits, bias and num_tokens must be 4-byte aligned");
  const int max_tiles = static_cast<int>(moe_align_max_tiles(capacity, params.top_k, E, block_m));
  auto go = [&](auto kernel) {
    launch_pdl(kernel, dim3(1), dim3(kTopKAlignThreads), 0, stream, logits, correction_bias, num_tokens, capacity,
               params, block_m, max_tiles, topk_ids, topk_weights, expert_offsets, sorted_pair_ids, padded_offsets,
               padded_pair_ids, tile_expert, num_tiles);
  };
  // VPT as launch_route: the smallest power of two with 32 * VPT >= E.
  if (E <= 32) go(moe_route_topk_align_kernel<1>);
  else if (E <= 64) go(moe_route_topk_align_kernel<2>);
  else if (E <= 128) go(moe_route_topk_align_kernel<4>);
  else go(moe_route_topk_align_kernel<8>);
}

void launch_moe_router_logits(const __nv_bfloat16* x, int x_stride, const __nv_bfloat16* router_weight,
                              const int32_t* num_tokens, int capacity, int hidden, int num_experts, float* logits,
                              cudaStream_t stream) {
  MOEBIUS_LAUNCH_ASSERT(hidden >= 1 && num_experts >= 1, "bad router shape");
  if (capacity <= 0) return;
  const dim3 grid((num_experts + kRouterWarps - 1) / kRouterWarps, (capacity + kRouterTokens - 1) / kRouterTokens);
  const bool vec = hidden % 8 == 0 && x_stride % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(router_weight) % 16 == 0;
  if (vec && capacity > kRouterDotMaxCapacity) {
    const dim3 tiles((num_experts + kRouterTileExperts - 1) / kRouterTileExperts,
                     (capacity + kRouterTileTokens - 1) / kRouterTileTokens);
    launch_pdl(moe_router_logits_tile_kernel, tiles, dim3(kRouterTileWarps * 32), 0, stream, x, x_stride,
               router_weight, num_tokens, capacity, hidden, num_experts, logits);
  } else if (vec)
    launch_pdl(moe_router_logits_kernel<true>, grid, dim3(kRouterWarps * 32), 0, stream, x, x_stride, router_weight,
               num_tokens, capacity, hidden, num_experts, logits);
  else
    launch_pdl(moe_router_logits_kernel<false>, grid, dim3(kRouterWarps * 32), 0, stream, x, x_stride, router_weight,
               num_tokens, capacity, hidden, num_experts, logits);
}

bool moe_route_small_supported(int capacity, const RouteParams& p) {
  return capacity >= 0 && capacity <= kRouteSmallMaxCapacity && p.num_experts >= 1 &&
         p.num_experts <= kRouteSmallMaxExperts && p.top_k >= 1 && p.top_k <= kRouteMaxTopK &&
         capacity * p.top_k <= kRouteSmallMaxPairs;
}

void launch_moe_route_small(const __nv_bfloat16* x, int x_stride, const __nv_bfloat16* router_weight, int hidden,
                            const float* correction_bias, const int32_t* num_tokens, int capacity,
                            const RouteParams& params, int block_m, float* logits, int32_t* topk_ids,
                            float* topk_weights, int32_t* expert_offsets, int32_t* sorted_pair_ids,
                            int32_t* padded_offsets, int32_t* padded_pair_ids, int32_t* tile_expert,
                            int32_t* num_tiles, cudaStream_t stream) {
  const int E = params.num_experts;
  MOEBIUS_LAUNCH_ASSERT(moe_route_small_supported(capacity, params), "shape outside the fused small-batch routing");
  MOEBIUS_LAUNCH_ASSERT(hidden >= 1 && block_m >= 1, "bad router shape");
  MOEBIUS_LAUNCH_ASSERT(params.top_k <= E, "top_k must be <= num_experts");
  if (params.scoring == RouteScoring::kSoftmax)
    MOEBIUS_LAUNCH_ASSERT(params.n_groups == 1 && params.topk_groups == 1 && correction_bias == nullptr,
                          "group-limited routing and correction bias need sigmoid scoring");
  else
    MOEBIUS_LAUNCH_ASSERT(params.n_groups >= 1 && E % params.n_groups == 0 && params.topk_groups >= 1 &&
                              params.topk_groups <= params.n_groups &&
                              params.top_k <= params.topk_groups * (E / params.n_groups),
                          "bad group-limited routing parameters");
  MOEBIUS_LAUNCH_ASSERT(num_tokens != nullptr && logits != nullptr && topk_ids != nullptr &&
                            topk_weights != nullptr && expert_offsets != nullptr && sorted_pair_ids != nullptr &&
                            padded_offsets != nullptr && padded_pair_ids != nullptr && tile_expert != nullptr &&
                            num_tiles != nullptr,
                        "every output of the fused routing must be set");
  const int max_tiles = static_cast<int>(moe_align_max_tiles(capacity, params.top_k, E, block_m));
  const bool vec = hidden % 8 == 0 && x_stride % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(router_weight) % 16 == 0;
  // Tokens per router_dot pass: the capacity rounded up to a power of two, at most 4, so a decode
  // step with one token does not compute 4 (the result bits are the same either way). Capacities
  // 5-16 take the 16-block cluster, whose 256 warps then split E x ceil(T / 4) items (router_dot,
  // shapes that do not vectorise) or whose blocks split the tiles.
  const int tok = capacity <= 1 ? 1 : capacity <= 2 ? 2 : 4;
  // TOK 1 (capacity 1) is the only instance on router_dot when the shapes vectorise (kTiles).
  static_assert(kRouterDotMaxCapacity == 1, "the fused kernel's tiles start at capacity 2");
  const bool wide = capacity > 4;
  auto go = [&](auto kernel, int cluster_blocks) {
    if (cluster_blocks > 8)  // a cluster above the portable 8 needs the opt-in
      CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    launch_pdl_cluster(kernel, dim3(cluster_blocks), dim3(kSmallThreads), 0, cluster_blocks, stream, x, x_stride,
                       router_weight, hidden, correction_bias, num_tokens, capacity, params, block_m, max_tiles,
                       logits, topk_ids, topk_weights, expert_offsets, sorted_pair_ids, padded_offsets,
                       padded_pair_ids, tile_expert, num_tiles);
  };
#define MOEBIUS_ROUTE_SMALL_TOK(VPT_, TOK_)                                                                    \
  {                                                                                                            \
    if (wide) go(vec ? moe_route_small_kernel<VPT_, TOK_, true, kSmallWideClusterBlocks>                       \
                     : moe_route_small_kernel<VPT_, TOK_, false, kSmallWideClusterBlocks>,                     \
                 kSmallWideClusterBlocks);                                                                     \
    else go(vec ? moe_route_small_kernel<VPT_, TOK_, true, kSmallClusterBlocks>                                \
                : moe_route_small_kernel<VPT_, TOK_, false, kSmallClusterBlocks>,                              \
            kSmallClusterBlocks);                                                                              \
  }
#define MOEBIUS_ROUTE_SMALL(VPT_)                        \
  {                                                      \
    if (tok == 1) MOEBIUS_ROUTE_SMALL_TOK(VPT_, 1)       \
    else if (tok == 2) MOEBIUS_ROUTE_SMALL_TOK(VPT_, 2)  \
    else MOEBIUS_ROUTE_SMALL_TOK(VPT_, 4)                \
  }
  if (E <= 32) MOEBIUS_ROUTE_SMALL(1)
  else if (E <= 64) MOEBIUS_ROUTE_SMALL(2)
  else if (E <= 128) MOEBIUS_ROUTE_SMALL(4)
  else MOEBIUS_ROUTE_SMALL(8)
#undef MOEBIUS_ROUTE_SMALL
#undef MOEBIUS_ROUTE_SMALL_TOK
}

}  // namespace moebius::kernels
