// Device helpers of the routing kernels (moe_route.cu: top-k, align, router logits, the fused
// small-batch routing): the per-token scores and top-k, the aligns, the router dot products.
// Header-only and inlined, so every kernel that routes through them computes the same bits (and a
// probe or a fused kernel elsewhere can reuse them); moe_route.cu's header comment explains the
// arithmetic (why fp64 exp, the fp64 sums, the tie order).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <climits>
#include <cmath>
#include <cstdint>

#include "kernels/mma.cuh"
#include "kernels/moe_route.cuh"

namespace moebius::kernels::route_device {

constexpr unsigned kFullMask = 0xffffffffu;

// [TAG_MOE_GRAPH_CAPACITY] The live token count is read from device memory, so a graph captured
// with a grid sized for `capacity` replays for any count. Clamping keeps a bad count from ever
// indexing past the [capacity, ...] buffers.
__device__ __forceinline__ int live_tokens(const int32_t* num_tokens, int capacity) {
  const int t = *num_tokens;
  return t < 0 ? 0 : (t > capacity ? capacity : t);
}

constexpr int kNoExpert = INT_MAX;  // loses every comparison, including to a real -inf score

__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }

// The selection order: higher value first, then lower index.
__device__ __forceinline__ bool ranks_before(float va, int ia, float vb, int ib) {
  return va > vb || (va == vb && ia < ib);
}

// Best eligible entry of the warp. v[i] on lane l is entry i*32 + l; bit i of `eligible` says it
// may be chosen. Every lane returns the same (value, index) and the winner's payload[i]; index
// kNoExpert if none is eligible. The payload rides along in the reduction (5 more shuffles)
// instead of being fetched afterwards: an "if (i == j) x = w[i]" fetch gets folded into a dynamic
// register index, which puts the array in local memory.
template <int VPT>
__device__ __forceinline__ void warp_argmax(const float (&v)[VPT], const float (&payload)[VPT], uint32_t eligible,
                                            int lane, float& best_v, int& best_i, float& best_payload) {
  best_v = -INFINITY;
  best_i = kNoExpert;
  best_payload = 0.0f;
#pragma unroll
  for (int i = 0; i < VPT; ++i)
    if (((eligible >> i) & 1u) && ranks_before(v[i], i * 32 + lane, best_v, best_i)) {
      best_v = v[i];
      best_i = i * 32 + lane;
      best_payload = payload[i];
    }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float ov = __shfl_xor_sync(kFullMask, best_v, offset);
    const int oi = __shfl_xor_sync(kFullMask, best_i, offset);
    const float op = __shfl_xor_sync(kFullMask, best_payload, offset);
    if (ranks_before(ov, oi, best_v, best_i)) {
      best_v = ov;
      best_i = oi;
      best_payload = op;
    }
  }
}

// Clears `entry` from the owner lane's eligibility mask.
__device__ __forceinline__ void take_entry(uint32_t& eligible, int entry, int lane) {
  if (entry != kNoExpert && lane == (entry & 31)) eligible &= ~(1u << (entry >> 5));
}

// fp32 exp as the oracle's glibc expf gives it (see the header comment): fp64 exp, rounded once.
__device__ __forceinline__ float exp_f32(float x) { return __double2float_rn(exp(static_cast<double>(x))); }

// The scores of one token, computed by one warp: key[i] (what the top-k ranks) and weight[i]
// (what a chosen expert contributes before renormalisation and scaling) of entry i*32 + lane;
// returns the eligibility mask (bit i: entry i*32 + lane exists and may be chosen).
//   row     [E] the token's logits (global or shared memory)
//   choice  [VPT*32] fp32 and kept [VPT*32] bytes: this warp's shared-memory scratch, used by
//           group-limited routing only.
template <int VPT, typename InT>
__device__ __forceinline__ uint32_t token_scores(const InT* __restrict__ row, const float* __restrict__ correction_bias,
                                                 const RouteParams& params, float* choice, unsigned char* kept,
                                                 int lane, float (&key)[VPT], float (&weight)[VPT]) {
  const int E = params.num_experts;

  float x[VPT];
  uint32_t valid = 0;  // bit i: entry i*32 + lane < E
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int e = i * 32 + lane;
    x[i] = -INFINITY;
    if (e < E) {
      x[i] = to_float(row[e]);
      valid |= 1u << i;
    }
  }

  uint32_t eligible = valid;

  if (params.scoring == RouteScoring::kSoftmax) {
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < VPT; ++i)
      if ((valid >> i) & 1u) mx = fmaxf(mx, x[i]);
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, offset));
    // p = fp32(ex / sum) with ex = expf(x - max) in fp32 and sum in fp64, as the oracle does.
    float ex[VPT];
    double sum = 0.0;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      ex[i] = ((valid >> i) & 1u) ? exp_f32(__fsub_rn(x[i], mx)) : 0.0f;
      sum = __dadd_rn(sum, static_cast<double>(ex[i]));
    }
    // Xor butterfly: a + b == b + a exactly, so every lane ends with the same bits.
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) sum = __dadd_rn(sum, __shfl_xor_sync(kFullMask, sum, offset));
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      key[i] = __double2float_rn(__ddiv_rn(static_cast<double>(ex[i]), sum));
      weight[i] = key[i];
    }
  } else {
    // s = 1 / (1 + expf(-x)) in fp32; choice c = s + bias ranks, the unbiased s is the weight.
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int e = i * 32 + lane;
      weight[i] = 0.0f;
      key[i] = -INFINITY;
      if ((valid >> i) & 1u) {
        weight[i] = __fdiv_rn(1.0f, __fadd_rn(1.0f, exp_f32(-x[i])));
        key[i] = __fadd_rn(weight[i], correction_bias != nullptr ? correction_bias[e] : 0.0f);
      }
    }
    if (params.n_groups > 1) {
      // Group g = experts [g*per, (g+1)*per) scores the sum of its two best choices; the best
      // topk_groups groups stay eligible. Lane l scores groups g = i*32 + l (n_groups <= E, so the
      // same VPT registers suffice) from the warp's copy of the choices in shared memory.
      const int G = params.n_groups;
      const int per = E / G;
#pragma unroll
      for (int i = 0; i < VPT; ++i)
        if ((valid >> i) & 1u) choice[i * 32 + lane] = key[i];
      __syncwarp();
      float group_score[VPT];
      uint32_t group_valid = 0;
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int g = i * 32 + lane;
        group_score[i] = -INFINITY;
        if (g < G) {
          // Lane g starts its walk at offset g % per: with per = 32 (DeepSeek-V3) the lanes then
          // read 32 different banks in every step instead of all hitting one. The two largest
          // values do not depend on the walk order.
          float top1 = -INFINITY, top2 = -INFINITY;
          int j = g % per;
          for (int n = 0; n < per; ++n) {
            const float c = choice[g * per + j];
            if (c > top1) {
              top2 = top1;
              top1 = c;
            } else if (c > top2) {
              top2 = c;
            }
            if (++j == per) j = 0;
          }
          group_score[i] = __fadd_rn(top1, per > 1 ? top2 : 0.0f);
          group_valid |= 1u << i;
        }
      }
      uint32_t group_left = group_valid;
      for (int r = 0; r < params.topk_groups; ++r) {
        float best_v, unused;
        int best_g;
        warp_argmax(group_score, group_score, group_left, lane, best_v, best_g, unused);
        take_entry(group_left, best_g, lane);
      }
      const uint32_t group_kept = group_valid & ~group_left;  // the groups just taken
#pragma unroll
      for (int i = 0; i < VPT; ++i)
        if ((group_valid >> i) & 1u) kept[i * 32 + lane] = static_cast<unsigned char>((group_kept >> i) & 1u);
      __syncwarp();
#pragma unroll
      for (int i = 0; i < VPT; ++i)
        if (((valid >> i) & 1u) && kept[(i * 32 + lane) / per] == 0) eligible &= ~(1u << i);
    }
  }

  return eligible;
}

// The final weight of a chosen expert from its raw weight and the fp64 sum of the k raw weights
// in slot order (the oracle's renormalisation: w / (sum + 1e-20)), then the sigmoid scaling.
__device__ __forceinline__ float finish_weight(float raw, double slot_sum, const RouteParams& params) {
  float w = raw;
  if (params.renormalize) w = __double2float_rn(__ddiv_rn(static_cast<double>(raw), __dadd_rn(slot_sum, 1e-20)));
  if (params.scoring == RouteScoring::kSigmoid) w = __fmul_rn(w, params.routed_scaling_factor);
  return w;
}

// Lane j < k holds winner j's raw weight: its final weight, renormalised by the fp64 sum of the k
// raw weights in slot order (the oracle's order; every lane forms the same sum).
__device__ __forceinline__ float renormalized_weight(float raw, int k, const RouteParams& params) {
  double s = 0.0;
  if (params.renormalize)
    for (int j = 0; j < k; ++j) s = __dadd_rn(s, static_cast<double>(__shfl_sync(kFullMask, raw, j)));
  return finish_weight(raw, s, params);
}

// An unsigned image of a non-NaN float that orders like the float: a > b <=> ordered_key(a) >
// ordered_key(b), a == b <=> equal images (-0 is taken as +0, which it equals). The image of -inf
// is 0x007fffff, so 0 is below every real key.
__device__ __forceinline__ uint32_t ordered_key(float v) {
  const uint32_t b = __float_as_uint(__fadd_rn(v, 0.0f));  // -0 + +0 = +0
  return (b & 0x80000000u) != 0u ? ~b : (b | 0x80000000u);
}

// The k best eligible entries of a warp's VPT x 32, in selection order: higher key first, then
// lower index (the oracle's partial_sort order). A NaN key ranks as -inf: it can still fill a slot,
// so every id stays a valid expert. Lane r < k ends with winner r's entry index and payload; an
// entry index is kNoExpert only if fewer than k entries are eligible (the launchers rule it out).
// Each round is a lane's best remaining entry (VPT compares), then two hardware warp reductions:
// redux.sync max over the ordered keys and redux.sync min over the entry indices of the lanes
// that hold that key (~180 cycles a round on the H200). The 5-step xor butterfly of (value,
// index, payload) it replaced was 15 dependent shuffles a round: the separate top-k kernel went
// 3.28 -> 2.79 us per launch at k = 8 (docs/PERF.md, runs P1-P3).
template <int VPT>
__device__ __forceinline__ void warp_top_k(const float (&key)[VPT], const float (&payload)[VPT], uint32_t eligible,
                                           int k, int lane, int& my_entry, float& my_payload) {
  uint32_t u[VPT];  // 0: not eligible, or already taken
#pragma unroll
  for (int i = 0; i < VPT; ++i)
    u[i] = ((eligible >> i) & 1u) != 0u ? ordered_key(key[i] != key[i] ? -INFINITY : key[i]) : 0u;
  my_entry = kNoExpert;
  my_payload = 0.0f;
  for (int r = 0; r < k; ++r) {
    uint32_t best_u = 0u;
    int best_i = 0;
    float best_p = 0.0f;
#pragma unroll
    for (int i = 0; i < VPT; ++i)  // strict >: the lower index wins a tie inside the lane
      if (u[i] > best_u) {
        best_u = u[i];
        best_i = i;
        best_p = payload[i];
      }
    const uint32_t top = __reduce_max_sync(kFullMask, best_u);
    const uint32_t mine = best_u == top && top != 0u ? static_cast<uint32_t>(best_i * 32 + lane) : 0xffffffffu;
    const uint32_t win = __reduce_min_sync(kFullMask, mine);
    const float win_payload = __shfl_sync(kFullMask, best_p, static_cast<int>(win & 31u));
    if (lane == r) {
      my_entry = win == 0xffffffffu ? kNoExpert : static_cast<int>(win);
      my_payload = win_payload;
    }
    if (win == static_cast<uint32_t>(best_i * 32 + lane))  // the owner drops its entry
#pragma unroll
      for (int i = 0; i < VPT; ++i)
        if (i == best_i) u[i] = 0u;
  }
}

// The top-k of one token, computed by one warp: lane j < k ends with winner j's id and weight.
// Arguments as token_scores.
template <int VPT, typename InT>
__device__ __forceinline__ void route_one_token(const InT* __restrict__ row, const float* __restrict__ correction_bias,
                                                const RouteParams& params, float* choice, unsigned char* kept, int lane,
                                                int& my_id, float& my_weight) {
  const int k = params.top_k;
  float key[VPT], weight[VPT];
  const uint32_t eligible = token_scores<VPT>(row, correction_bias, params, choice, kept, lane, key, weight);
  warp_top_k<VPT>(key, weight, eligible, k, lane, my_id, my_weight);  // winner r in lane r
  my_weight = renormalized_weight(my_weight, k, params);
}

// Largest e in [0, E) with offsets[e] <= row, for 0 <= row < offsets[E]: the expert owning that row
// of the padded layout. Empty experts repeat their offset, and the largest index with a given
// offset is the one that owns rows.
__device__ __forceinline__ int owner_of_row(const int* offsets, int E, int row) {
  int lo = 0, hi = E;  // offsets[lo] <= row < offsets[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (offsets[mid] <= row) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Block-wide: per-expert counts -> offsets. Thread e of THREADS (>= E) owns expert e.
//   s_count           [E] shared, in: pairs per expert.
//   s_offsets         [E+1] shared, out: exclusive prefix sums (s_offsets[E] = total).
//   s_padded_offsets  [E+1] shared, out: the same with counts rounded up to block_m (only when
//                     padded_offsets != nullptr).
//   expert_offsets, padded_offsets [E+1], tile_expert [max_tiles], num_tiles [1]: global copies;
//   tile_expert is written whole ([TAG_MOE_GRAPH_CAPACITY]). The shared outputs are complete
//   (behind a block barrier) when it returns.
template <int THREADS>
__device__ void scan_expert_counts(const int* s_count, int E, int block_m, int max_tiles, int* s_offsets,
                                   int* s_padded_offsets, int32_t* __restrict__ expert_offsets,
                                   int32_t* __restrict__ padded_offsets, int32_t* __restrict__ tile_expert,
                                   int32_t* __restrict__ num_tiles) {
  __shared__ int s_warp_sum[THREADS / 32];
  __shared__ int s_warp_padded_sum[THREADS / 32];
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  // Exclusive scans of the counts and of the counts rounded up to block_m; thread e owns expert e.
  const int c = tid < E ? s_count[tid] : 0;
  const int pc = (c + block_m - 1) / block_m * block_m;
  int inc = c, pinc = pc;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int a = __shfl_up_sync(kFullMask, inc, offset);
    const int b = __shfl_up_sync(kFullMask, pinc, offset);
    if (lane >= offset) {
      inc += a;
      pinc += b;
    }
  }
  if (lane == 31) {
    s_warp_sum[warp] = inc;
    s_warp_padded_sum[warp] = pinc;
  }
  __syncthreads();
  for (int w = 0; w < warp; ++w) {
    inc += s_warp_sum[w];
    pinc += s_warp_padded_sum[w];
  }
  const bool padded = padded_offsets != nullptr;
  if (tid < E) {
    expert_offsets[tid] = inc - c;
    s_offsets[tid] = inc - c;
    if (padded) {
      padded_offsets[tid] = pinc - pc;
      s_padded_offsets[tid] = pinc - pc;
    }
  }
  if (tid == E - 1) {
    expert_offsets[E] = inc;
    s_offsets[E] = inc;
    if (padded) {
      padded_offsets[E] = pinc;
      s_padded_offsets[E] = pinc;
      *num_tiles = pinc / block_m;
    }
  }
  __syncthreads();
  if (!padded) return;  // uniform over the block
  // [TAG_MOE_GRAPH_CAPACITY] Every tile up to the capacity bound gets an owner or -1, so a GEMM
  // grid sized from the capacity knows which of its blocks to retire.
  const int padded_total = s_padded_offsets[E];
  for (int j = tid; j < max_tiles; j += THREADS) {
    const int row = j * block_m;
    tile_expert[j] = row < padded_total ? owner_of_row(s_padded_offsets, E, row) : -1;
  }
}

// Before pdl_wait: pull this warp's router row (hidden bf16, weights that no kernel writes) into
// L2, one 128-byte line per lane and step, so the loads after the wait hit L2 instead of HBM.
__device__ __forceinline__ void prefetch_router_row(const __nv_bfloat16* wrow, int hidden, int lane) {
  const char* p = reinterpret_cast<const char*>(wrow);
  const int bytes = hidden * static_cast<int>(sizeof(__nv_bfloat16));
  for (int off = lane * 128; off < bytes; off += 32 * 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(p + off));
}

// Lane partial sums acc[j] = sum over this lane's h of W[e][h] * x[t0 + j][h], j < nt <= TOK, then
// a butterfly reduction so every lane holds the full dot product. Each lane takes 8 consecutive h
// per step (one 16-byte load of the expert row, reused for the TOK tokens), so a 2048-wide row is
// 8 steps whose weight loads all go out before the first use. Token slots j >= nt read token
// t0 + nt - 1 instead of branching: with a branch around each token's activation load the loads
// of one step were issued one after another (T = 8 took 16 us, 3x T = 1; docs/PERF.md). The
// arithmetic of token j does not depend on TOK or nt, so every kernel that computes router logits
// through this function (the fused small-batch routing and the separate router kernel) produces
// bit-identical logits and therefore routing.
// kVec needs H and the x stride to be multiples of 8 and 16-byte aligned rows.
template <int TOK, bool kVec>
__device__ __forceinline__ void router_dot(const __nv_bfloat16* __restrict__ x, int x_stride,
                                           const __nv_bfloat16* __restrict__ wrow, int hidden, int t0, int nt,
                                           int lane, float (&acc)[TOK]) {
  const __nv_bfloat16* xrow[TOK];
#pragma unroll
  for (int j = 0; j < TOK; ++j) {
    acc[j] = 0.0f;
    xrow[j] = x + static_cast<int64_t>(t0 + min(j, nt - 1)) * x_stride;
  }
  if constexpr (kVec) {
    constexpr int kSteps = 8;
    auto step = [&](uint4 wv, int h) {
      const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&wv);
      uint4 xv[TOK];
#pragma unroll
      for (int j = 0; j < TOK; ++j) xv[j] = __ldg(reinterpret_cast<const uint4*>(xrow[j] + h));
#pragma unroll
      for (int j = 0; j < TOK; ++j) {
        const __nv_bfloat162* x2 = reinterpret_cast<const __nv_bfloat162*>(&xv[j]);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float2 a = __bfloat1622float2(w2[q]), b = __bfloat1622float2(x2[q]);
          acc[j] += a.x * b.x + a.y * b.y;
        }
      }
    };
    int h0 = lane * 8;
    // Whole rounds of 8 steps, branch-free so all loads of a round can be in flight together.
    for (; h0 + 256 * (kSteps - 1) < hidden; h0 += 256 * kSteps) {
      uint4 wv[kSteps];
#pragma unroll
      for (int st = 0; st < kSteps; ++st) wv[st] = __ldg(reinterpret_cast<const uint4*>(wrow + h0 + st * 256));
#pragma unroll
      for (int st = 0; st < kSteps; ++st) step(wv[st], h0 + st * 256);
    }
    for (; h0 < hidden; h0 += 256) step(__ldg(reinterpret_cast<const uint4*>(wrow + h0)), h0);
  } else {
    for (int h = lane; h < hidden; h += 32) {
      const float wv = __bfloat162float(wrow[h]);
#pragma unroll
      for (int j = 0; j < TOK; ++j) acc[j] += wv * __bfloat162float(xrow[j][h]);
    }
  }
#pragma unroll
  for (int j = 0; j < TOK; ++j)
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc[j] += __shfl_xor_sync(kFullMask, acc[j], off);
}

// ---- router logits on the tensor cores: a 16-expert x 8-token tile ---------------------------

inline constexpr int kRouterTileExperts = 16;  // mma m16n8k16: experts are M
inline constexpr int kRouterTileTokens = 8;    // tokens are N
inline constexpr int kRouterTileValues = kRouterTileExperts * kRouterTileTokens;
// Warps splitting a tile's hidden dimension: part of the bits (the partials' split and order), so
// every kernel computing router tiles uses this count.
inline constexpr int kRouterTileWarps = 16;

// One warp's share of the logits of experts [e0, e0 + 16) x tokens [t0, t0 + 8): the k-blocks of
// 32 hidden values kb = warp, warp + WARPS, ... (ascending), on the tensor cores, stored as the
// warp's 128 partial sums in s_red[warp * 128 + row * 8 + col] (row = expert - e0, col = token - t0).
// router_tile_sum adds the WARPS partials in warp order after a block barrier. s_red must be 8-byte
// aligned (float2 stores). Why: the CUDA-core dot (router_dot) costs ~2 instructions per
// multiply-add (bf16 -> fp32, FFMA): 8 tokens x 128 experts x 2048 took 6.3 us on the 8 SMs of a
// routing cluster (docs/PERF.md run T2), and the warp-per-expert GEMV 5.5-5.9 us at T = 8-64; one
// mma does 2048 multiply-adds.
// The k order inside a 32-block is free (a sum), so lane (g, t) reads 16 contiguous bytes, h =
// kb * 32 + 8t .. 8t + 7, of expert row g, row g + 8 and token g, and feeds them as the mma
// fragments' k pairs {2t, 2t+1} and {2t+8, 2t+9} (PTX ISA, mma.m16n8k16 fragment layouts): h
// 8t+0..3 in the first mma, 8t+4..7 in the second. A and B then pair the same h, as they must.
// Experts past E read row E - 1 and tokens past nt read token t0 + nt - 1 (valid memory; their
// sums are dropped); hidden % 8 == 0 and 16-byte aligned rows (kVec of router_dot), so a 16-byte
// piece is wholly inside or outside [0, hidden), and pieces outside are zeros.
template <int WARPS>
__device__ __forceinline__ void router_tile_partial(const __nv_bfloat16* __restrict__ x, int x_stride,
                                                    const __nv_bfloat16* __restrict__ wr, int hidden, int num_experts,
                                                    int e0, int t0, int nt, int warp, int lane, float* s_red) {
  const int g = lane >> 2, t = lane & 3;
  const int ea = min(e0 + g, num_experts - 1), eb = min(e0 + g + 8, num_experts - 1);
  const uint4* wa = reinterpret_cast<const uint4*>(wr + static_cast<int64_t>(ea) * hidden) + t;
  const uint4* wb = reinterpret_cast<const uint4*>(wr + static_cast<int64_t>(eb) * hidden) + t;
  const uint4* xr = reinterpret_cast<const uint4*>(x + static_cast<int64_t>(t0 + min(g, nt - 1)) * x_stride) + t;
  const int kblocks = (hidden + 31) / 32;
  float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  constexpr int kBatch = 4;  // k-blocks whose 3 loads are all in flight before the first mma
  for (int kb0 = warp; kb0 < kblocks; kb0 += WARPS * kBatch) {
    uint4 va[kBatch], vb[kBatch], vx[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int kb = kb0 + i * WARPS;
      const bool ok = kb < kblocks && kb * 32 + t * 8 < hidden;
      const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
      va[i] = ok ? __ldg(wa + kb * 4) : zero;
      vb[i] = ok ? __ldg(wb + kb * 4) : zero;
      vx[i] = ok ? __ldg(xr + kb * 4) : zero;
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const uint32_t a_lo[4] = {va[i].x, vb[i].x, va[i].y, vb[i].y}, a_hi[4] = {va[i].z, vb[i].z, va[i].w, vb[i].w};
      mma_m16n8k16_bf16(d, a_lo, vx[i].x, vx[i].y);
      mma_m16n8k16_bf16(d, a_hi, vx[i].z, vx[i].w);
    }
  }
  // Accumulator layout: d0, d1 = (row g, cols 2t, 2t + 1), d2, d3 = (row g + 8, same cols).
  float2* r = reinterpret_cast<float2*>(s_red + warp * kRouterTileValues);
  r[(g * kRouterTileTokens + 2 * t) / 2] = make_float2(d[0], d[1]);
  r[((g + 8) * kRouterTileTokens + 2 * t) / 2] = make_float2(d[2], d[3]);
}

// Logit i = row * 8 + col of the tile (i < 128): the WARPS partials of router_tile_partial in warp
// order, so the bits depend on WARPS and the k-block split only, not on which block computes it.
template <int WARPS>
__device__ __forceinline__ float router_tile_sum(const float* s_red, int i) {
  float v = 0.0f;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) v = __fadd_rn(v, s_red[w * kRouterTileValues + i]);
  return v;
}

// One block's whole tile: the partials, a block barrier, then threads i < 128 sum logit i in warp
// order and hand it to store(e, t, v) for experts e < num_experts (tokens t in [t0, t0 + 8): the
// caller drops the dead ones). The block that computes a tile does not change its bits, so the
// separate router (moe_router_logits_tile_kernel) and the fused routing share this. A caller that
// reuses s_red for another tile syncs the block first.
template <int WARPS, typename Store>
__device__ __forceinline__ void router_tile_block(const __nv_bfloat16* __restrict__ x, int x_stride,
                                                  const __nv_bfloat16* __restrict__ wr, int hidden, int num_experts,
                                                  int e0, int t0, int nt, int warp, int lane, float* s_red,
                                                  Store store) {
  router_tile_partial<WARPS>(x, x_stride, wr, hidden, num_experts, e0, t0, nt, warp, lane, s_red);
  __syncthreads();
  const int i = threadIdx.x;
  if (i < kRouterTileValues) {
    const int e = e0 + i / kRouterTileTokens, t = t0 + i % kRouterTileTokens;
    const float v = router_tile_sum<WARPS>(s_red, i);
    if (e < num_experts) store(e, t, v);
  }
}


// The align of n <= 32 pairs by one warp (decode), the outputs of moe_align_count +
// moe_align_scatter (padded): lane p < n holds pair p's expert in `expert` (other lanes: ignored).
// A first pass of shuffles over the n pairs gives each lane its expert's count and its rank among
// them (same expert at lower p, so each segment is ascending p); a second gives every lane the
// offsets of its experts e = c*32 + lane, c <= VPT (E <= 32 * VPT, so e = E is covered too) and of
// its own pair's expert. Stores only, no barrier. (__match_any_sync in place of the first pass
// made the whole align ~2.9k cycles at T = 1, run P2.)
template <int VPT>
__device__ __forceinline__ void align_pairs_in_warp(int expert, int n, int E, int block_m, int max_tiles, int lane,
                                                    int32_t* __restrict__ expert_offsets,
                                                    int32_t* __restrict__ sorted_pair_ids,
                                                    int32_t* __restrict__ padded_offsets,
                                                    int32_t* __restrict__ padded_pair_ids,
                                                    int32_t* __restrict__ tile_expert, int32_t* __restrict__ num_tiles) {
  constexpr int kChunks = VPT + 1;
  const bool live = lane < n;
  const int id = live ? expert : -1 - lane;  // dead lanes: distinct negative ids
  int cnt = 0, rank_in_expert = 0;
  for (int q = 0; q < n; ++q) {
    const bool same = __shfl_sync(kFullMask, id, q) == id;
    cnt += same;
    rank_in_expert += same && q < lane;
  }
  const bool leader = live && rank_in_expert == 0;
  const int padded_cnt = (cnt + block_m - 1) / block_m * block_m;
  const int leader_padded = leader ? padded_cnt : 0;  // each expert's padded count, once
  int off_e[kChunks], poff_e[kChunks];
#pragma unroll
  for (int c = 0; c < kChunks; ++c) off_e[c] = poff_e[c] = 0;
  int off_p = 0, poff_p = 0, padded_total = 0;
  for (int q = 0; q < n; ++q) {
    const int idq = __shfl_sync(kFullMask, id, q);
    const int pcq = __shfl_sync(kFullMask, leader_padded, q);
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const bool below = idq < c * 32 + lane;
      off_e[c] += below;
      poff_e[c] += below ? pcq : 0;
    }
    off_p += idq < id;
    poff_p += idq < id ? pcq : 0;
    padded_total += pcq;
  }
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int e = c * 32 + lane;
    if (e <= E) {
      expert_offsets[e] = off_e[c];
      padded_offsets[e] = poff_e[c];
      if (e == E) *num_tiles = poff_e[c] / block_m;
    }
  }
  if (live) {
    sorted_pair_ids[off_p + rank_in_expert] = lane;
    padded_pair_ids[poff_p + rank_in_expert] = lane;
    if (leader) {
      for (int r = poff_p + cnt; r < poff_p + padded_cnt; ++r) padded_pair_ids[r] = -1;  // tile tail
      for (int i = 0; i < padded_cnt / block_m; ++i) tile_expert[poff_p / block_m + i] = id;
    }
  }
  // [TAG_MOE_GRAPH_CAPACITY] tiles past the live ones
  for (int j = lane; j < max_tiles; j += 32)
    if (j * block_m >= padded_total) tile_expert[j] = -1;
}


// The align of n <= 32 * MAX_CHUNKS pairs whose ids sit in shared memory, by one block of THREADS
// threads (THREADS >= E): the outputs of moe_align_count + moe_align_scatter, ids outside [0, E)
// skipped as they do. Pairs are cut into 32-pair chunks; a warp ranks each of its chunks' pairs
// among the chunk's pairs of the same expert (__match_any_sync), the chunk's leader of each
// expert records the chunk's count in s_chunk[c][e], and thread e turns its column into the
// counts of expert e in the chunks before c (a scan over at most MAX_CHUNKS entries), whose last
// sum is the expert's count. A pair's place is then its expert's offset + its chunk's prefix + its
// rank in the chunk: ascending p inside each expert, as the other aligns, in O(n / THREADS +
// MAX_CHUNKS) steps. (Ranking by counting equal ids at lower p, the loop this replaced, made the
// last thread walk all n ids: 15 us for 1024 pairs, docs/PERF.md run S6.)
//   s_chunk [MAX_CHUNKS * E] uint16 scratch, s_count [E], s_offsets / s_padded_offsets [E + 1];
//   padded_offsets null: no padded outputs. Starts with a block barrier (so the caller's s_ids
//   stores before the call are ordered) and ends without one.
template <int THREADS, int MAX_CHUNKS>
__device__ __forceinline__ void align_pairs_chunked(const int* s_ids, int n, int E, int block_m, int max_tiles,
                                                    uint16_t* s_chunk, int* s_count, int* s_offsets,
                                                    int* s_padded_offsets, int32_t* __restrict__ expert_offsets,
                                                    int32_t* __restrict__ sorted_pair_ids,
                                                    int32_t* __restrict__ padded_offsets,
                                                    int32_t* __restrict__ padded_pair_ids,
                                                    int32_t* __restrict__ tile_expert, int32_t* __restrict__ num_tiles) {
  constexpr int kWarps = THREADS / 32;
  constexpr int kPerWarp = (MAX_CHUNKS + kWarps - 1) / kWarps;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int chunks = (n + 31) / 32;
  for (int i = tid; i < chunks * E; i += THREADS) s_chunk[i] = 0;
  __syncthreads();
  int my_id[kPerWarp], my_rank[kPerWarp];
#pragma unroll
  for (int j = 0; j < kPerWarp; ++j) {
    const int c = warp + j * kWarps;  // uniform over the warp
    const int p = c * 32 + lane;
    int id = p < n ? s_ids[p] : -1;
    if (static_cast<unsigned>(id) >= static_cast<unsigned>(E)) id = -1;
    my_id[j] = id;
    my_rank[j] = 0;
    if (c < chunks) {
      const unsigned same = __match_any_sync(kFullMask, id);
      my_rank[j] = __popc(same & ((1u << lane) - 1u));
      if (id >= 0 && my_rank[j] == 0) s_chunk[c * E + id] = static_cast<uint16_t>(__popc(same));
    }
  }
  __syncthreads();
  for (int e = tid; e < E; e += THREADS) {
    int run = 0;
    for (int c = 0; c < chunks; ++c) {
      const int v = s_chunk[c * E + e];
      s_chunk[c * E + e] = static_cast<uint16_t>(run);
      run += v;
    }
    s_count[e] = run;
  }
  __syncthreads();
  scan_expert_counts<THREADS>(s_count, E, block_m, max_tiles, s_offsets, s_padded_offsets, expert_offsets,
                              padded_offsets, tile_expert, num_tiles);  // ends with a barrier
  const bool padded = padded_offsets != nullptr;
#pragma unroll
  for (int j = 0; j < kPerWarp; ++j) {
    const int c = warp + j * kWarps, id = my_id[j];
    if (id < 0) continue;
    const int pos = s_chunk[c * E + id] + my_rank[j], p = c * 32 + lane;
    sorted_pair_ids[s_offsets[id] + pos] = p;
    if (padded) padded_pair_ids[s_padded_offsets[id] + pos] = p;
  }
  if (padded) {
    for (int e = tid; e < E; e += THREADS)  // the tail of each expert's last tile
      for (int r = s_padded_offsets[e] + s_count[e]; r < s_padded_offsets[e + 1]; ++r) padded_pair_ids[r] = -1;
  }
}

}  // namespace moebius::kernels::route_device
