// Device-side routing for the fused MoE layer: launchers only (kernels live in moe_route.cu).
//
//   A. launch_moe_route_topk: router logits [T, E] -> topk_ids [T, k], topk_weights [T, k].
//      Same rules as the CPU oracle, moebius::cpu::route_reference (src/cpu/moe_router.h):
//      softmax in fp32 then top-k, or sigmoid + correction bias + group-limited top-k
//      (DeepSeek-V3) times routed_scaling_factor; optional renormalisation; ties go to the lower
//      expert index; slots are in descending score order.
//   B. launch_moe_align: topk_ids [T, k] -> the (token, slot) pairs p = t*k + s grouped by expert,
//      ascending p inside each expert (stable, so deterministic), plus an optional copy whose
//      segments are padded to a multiple of block_m rows for tensor-core tiles.
//
// [TAG_MOE_GRAPH_CAPACITY] Every launcher takes the live token count T as a DEVICE pointer and
// sizes its grid from a HOST `capacity` (the largest T the buffers hold). Nothing here syncs the
// host, so one CUDA graph captured at `capacity` replays for any T in [0, capacity]: the caller
// writes *num_tokens (e.g. cudaMemcpyAsync outside the graph) and replays. Blocks past T exit
// early and write nothing; a *num_tokens outside [0, capacity] is clamped into it.
// Rows and entries past the live range are never written, except the fixed-size arrays named in
// launch_moe_align (offsets, tile_expert, num_tiles), which are always written whole.
//
// Pointers are device pointers unless noted. Launchers abort (MOEBIUS_LAUNCH_ASSERT) on shapes
// they do not support; validate user configuration (HF config.json) before calling them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace moebius::kernels {

// One warp per token holds a row of logits in registers: 32 lanes x 16 values.
inline constexpr int kRouteMaxExperts = 512;
// Winners are kept one per lane; k <= 16 also keeps the k selection rounds short.
inline constexpr int kRouteMaxTopK = 16;

enum class RouteScoring : uint8_t { kSoftmax, kSigmoid };

// Mirrors moebius::cpu::RouterConfig without the std::vector (the bias is a device pointer here).
struct RouteParams {
  int num_experts = 0;  // E, 1..512
  int top_k = 0;        // k, 1..min(16, E)
  RouteScoring scoring = RouteScoring::kSoftmax;
  bool renormalize = true;  // norm_topk_prob: weights / sum(weights) over the k slots
  // Sigmoid scoring only (DeepSeek-V3 style); softmax needs n_groups == topk_groups == 1.
  int n_groups = 1;                    // n_group, divides E; 1 = no group limit
  int topk_groups = 1;                 // topk_group, 1..n_groups
  float routed_scaling_factor = 1.0f;  // multiplies the final weights (sigmoid only, like the CPU)
};

// Kernel A: top-k routing, one warp per token.
//   logits          [capacity, E] bf16 or fp32, row-major; rows >= *num_tokens are not read.
//                   Must be finite (a NaN logit gives unspecified ids).
//   correction_bias [E] fp32 or nullptr (= zeros); sigmoid scoring only.
//   num_tokens      [1] int32, device: T. [TAG_MOE_GRAPH_CAPACITY]
//   capacity        host int >= 0: grid size; buffers hold `capacity` rows.
//   topk_ids        [capacity, k] int32: rows [0, T) written, the rest untouched.
//   topk_weights    [capacity, k] fp32:  rows [0, T) written, the rest untouched.
// Ids equal the CPU oracle's for the same fp32 logits (exact ties included; a 1-ulp near-tie may
// differ about once in 10^8 tokens); weights agree to 1e-6 relative and are usually bit-identical.
// moe_route.cu explains the arithmetic.
void launch_moe_route_topk(const __nv_bfloat16* logits, const float* correction_bias, const int32_t* num_tokens,
                           int capacity, const RouteParams& params, int32_t* topk_ids, float* topk_weights,
                           cudaStream_t stream);
void launch_moe_route_topk(const float* logits, const float* correction_bias, const int32_t* num_tokens,
                           int capacity, const RouteParams& params, int32_t* topk_ids, float* topk_weights,
                           cudaStream_t stream);

// Buffer sizes for launch_moe_align, from the capacity (host ints; size buffers with these).
// Padding adds at most block_m - 1 rows per expert: sum_e ceil(c_e / m) * m <= T*k + E*(m - 1).
inline constexpr int64_t moe_align_max_padded(int64_t capacity, int top_k, int num_experts, int block_m) {
  return capacity * top_k + static_cast<int64_t>(num_experts) * (block_m - 1);
}
// The padded total is a multiple of block_m and <= moe_align_max_padded, so this bounds the tiles.
inline constexpr int64_t moe_align_max_tiles(int64_t capacity, int top_k, int num_experts, int block_m) {
  return moe_align_max_padded(capacity, top_k, num_experts, block_m) / block_m;
}

// Kernel B: group the pairs by expert ("align"). With n = T*k (T = *num_tokens, device):
//   topk_ids        [capacity, k] int32 in: rows [0, T) read. Ids outside [0, E) are skipped (not
//                   counted, not placed), so then expert_offsets[E] < n.
//   expert_offsets  [E+1] int32 out, always written whole: exclusive prefix sum of the per-expert
//                   counts; expert_offsets[E] = n.
//   sorted_pair_ids [capacity*k] int32 out: [0, n) written, the rest untouched. Expert e's pairs
//                   are sorted_pair_ids[expert_offsets[e] .. expert_offsets[e+1]), ascending p;
//                   token = p / k, slot = p % k.
// Padded variant, for tensor-core tiles of block_m rows: all four pointers, or all nullptr.
//   padded_offsets  [E+1] int32 out, written whole: like expert_offsets, each count rounded up to
//                   a multiple of block_m (an empty expert stays empty).
//   padded_pair_ids [moe_align_max_padded(...)] int32 out: [0, padded_offsets[E]) written: each
//                   expert's pairs as above, then -1 up to its padded end; the rest untouched.
//   tile_expert     [moe_align_max_tiles(...)] int32 out, written whole: the expert of tile j
//                   (rows [j*block_m, (j+1)*block_m) of padded_pair_ids), -1 past the last tile,
//                   so a GEMM grid sized from capacity can exit on -1. [TAG_MOE_GRAPH_CAPACITY]
//   num_tiles       [1] int32 out: padded_offsets[E] / block_m.
// block_m >= 1 (1 = no padding). Requires 1 <= E <= 512, k >= 1 and
// moe_align_max_padded(capacity, k, E, block_m) < 2^30. Output is bit-identical run to run.
void launch_moe_align(const int32_t* topk_ids, const int32_t* num_tokens, int capacity, int top_k, int num_experts,
                      int block_m, int32_t* expert_offsets, int32_t* sorted_pair_ids, int32_t* padded_offsets,
                      int32_t* padded_pair_ids, int32_t* tile_expert, int32_t* num_tiles, cudaStream_t stream);

// Kernels A and B (padded) in one launch for small batches: the outputs of launch_moe_route_topk
// followed by launch_moe_align with the same arguments, bit for bit, with one kernel boundary
// fewer. One block, a warp per token. Limits (moe_route_topk_align_supported): capacity <=
// kRouteTopKAlignMaxCapacity, ungrouped scoring (n_groups == 1), E <= 256, k <= 16.
//   logits [capacity, E] fp32; other arguments as launch_moe_route_topk and launch_moe_align.
inline constexpr int kRouteTopKAlignMaxCapacity = 32;
inline constexpr int kRouteTopKAlignMaxExperts = 256;
bool moe_route_topk_align_supported(int capacity, const RouteParams& params);
void launch_moe_route_topk_align(const float* logits, const float* correction_bias, const int32_t* num_tokens,
                                 int capacity, const RouteParams& params, int block_m, int32_t* topk_ids,
                                 float* topk_weights, int32_t* expert_offsets, int32_t* sorted_pair_ids,
                                 int32_t* padded_offsets, int32_t* padded_pair_ids, int32_t* tile_expert,
                                 int32_t* num_tiles, cudaStream_t stream);

// Router logits: logits[t][e] = sum_h W[e][h] * x[t][h] in fp32 (the router, "mlp.gate").
//   x       [capacity, x_stride] bf16;  W [E, H] bf16 row-major;  logits [capacity, E] fp32.
// The arithmetic depends on the capacity (never on the live count), so a layer's logits do not:
//   capacity <= kRouterDotMaxCapacity, or hidden / x_stride not multiples of 8, or rows not 16-byte
//     aligned: one warp per (expert, 8 tokens), fp32 FMAs per lane and a butterfly (router_dot);
//     the fused small-batch routing has the same bits.
//   above: tensor-core tiles of 16 experts x 8 tokens, the hidden dimension split over 16 warps
//     and summed in warp order (mma accumulation, within the bound test_moe_router_gemm.cu
//     states); the fused routing has the same bits. The tensor-core router GEMM
//     (moe_router_gemm.cuh) takes over at larger capacities.
// Why 1: tiles from two tokens made the routing stage at T = 3-8 ~2.5 us shorter in both the fused
// and the separate kernels (docs/PERF.md runs Z16-Z19), and the two must give the same bits at every
// capacity. One token keeps router_dot: a warp per expert is the shortest chain there.
inline constexpr int kRouterDotMaxCapacity = 1;
void launch_moe_router_logits(const __nv_bfloat16* x, int x_stride, const __nv_bfloat16* router_weight,
                              const int32_t* num_tokens, int capacity, int hidden, int num_experts, float* logits,
                              cudaStream_t stream);

// Fused small-batch routing: router logits + kernel A + kernel B (padded) in ONE launch, for
// decode. The outputs are exactly those of launch_moe_router_logits, launch_moe_route_topk and
// launch_moe_align with the same arguments (bit-identical: the logits use the same arithmetic).
// Limits, checked by moe_route_small_supported: capacity <= kRouteSmallMaxCapacity (16), E <= 256,
// capacity * k <= 256.
//   logits   [capacity, E] fp32, written (the logits the routing used).
// It launches one thread-block cluster (sm_90): 8 blocks up to capacity 4, 16 (non-portable)
// above; router_dot at capacity 1, tensor-core tiles above when the shapes vectorise.
//   other outputs as in launch_moe_route_topk / launch_moe_align (padded variant).
inline constexpr int kRouteSmallMaxTokens = 16;
inline constexpr int kRouteSmallMaxCapacity = 16;
static_assert(kRouteSmallMaxCapacity <= kRouteSmallMaxTokens, "the fused routing is laid out for 16 tokens");
inline constexpr int kRouteSmallMaxExperts = 256;
inline constexpr int kRouteSmallMaxPairs = 256;
bool moe_route_small_supported(int capacity, const RouteParams& params);
void launch_moe_route_small(const __nv_bfloat16* x, int x_stride, const __nv_bfloat16* router_weight, int hidden,
                            const float* correction_bias, const int32_t* num_tokens, int capacity,
                            const RouteParams& params, int block_m, float* logits, int32_t* topk_ids,
                            float* topk_weights, int32_t* expert_offsets, int32_t* sorted_pair_ids,
                            int32_t* padded_offsets, int32_t* padded_pair_ids, int32_t* tile_expert,
                            int32_t* num_tiles, cudaStream_t stream);

}  // namespace moebius::kernels
