// The fused MoE layer on the GPU: router GEMV, top-k routing, sort by expert, GEMM1 with SwiGLU,
// GEMM2, combine. Everything is enqueued on one stream with no host synchronization, and every
// buffer is sized to a token capacity fixed at creation, so the whole layer can be captured in a
// CUDA graph once and replayed for any token count up to the capacity: the live count is read
// from device memory ([TAG_MOE_GRAPH_CAPACITY]).
#pragma once

#ifdef MOEBIUS_HAS_CUDA

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/memory.h"
#include "cpu/moe_layer.h"
#include "kernels/expert_dma.cuh"
#include "kernels/moe_combine.cuh"
#include "kernels/moe_gemm.cuh"
#include "kernels/moe_route.cuh"
#include "moe/expert_layout.h"
#include "moe/moe_workspace_pool.h"

namespace moebius::moe {

// The kernels of one forward, in order. Each reads what the previous ones left in the
// workspace, so a single stage can be replayed on its own (benchmarks time them one by one).
// kRouteFused (router + top-k + align in one kernel, small capacities) replaces the routing
// stages after it; kTopKAlign (top-k + align in one block, small capacities) replaces kTopK and
// kAlign; kExpertsFused (GEMM1, GEMM2 and the combine in one persistent kernel,
// kernels/moe_fused_experts.cuh) replaces the three after it; uses_stage() says which a layer runs.
enum class MoeStage : int {
  kRouteFused,
  kRouterLogits,
  kTopKAlign,
  kTopK,
  kAlign,
  kExpertsFused,
  kGateUp,
  kDown,
  kCombine,
  kCount
};
const char* moe_stage_name(MoeStage s);

// Which expert GEMM kernels a layer runs. kDecode: moe_gemm.cuh (swap-AB, one 16-row weight tile
// per block, streams weights; for few tokens per expert). kPrefill: moe_gemm_prefill.cuh (256 x
// block_m block tiles on mma.sync over a cp.async pipeline; for many tokens per expert).
// kPrefillWgmma: moe_gemm_wgmma.cuh (the same tiles on Hopper wgmma; needs a build with 90a in
// MOEBIUS_CUDA_ARCHS and a compute capability 9.0 GPU; a forward whose x rows are not 16-byte
// aligned first copies x to an aligned stride). kAuto picks decode or prefill from the
// expected tokens per expert at full capacity (see kPrefillMinTokensPerExpert), and for prefill
// kPrefillWgmma where it is available, else kPrefill. All read the same packed weights; results
// agree to the bf16 rounding of h (and, for the int formats on kPrefillWgmma, of the weights:
// [TAG_INT_FOLDED_SCALE]).
enum class MoeGemmPath : uint8_t { kAuto, kDecode, kPrefill, kPrefillWgmma };
const char* moe_gemm_path_name(MoeGemmPath p);

// kAuto takes the prefill kernels when capacity * k / E (the average tokens per expert at full
// capacity) is at least this. Measured on the H200 (docs/PERF.md, 2026-12-02, Qwen3-30B-A3B
// nvfp4): at 8 tokens per expert (T=128) decode 354 us vs prefill 384; at 16 (T=256) decode 570
// vs prefill 393. The autotuner issue replaces this with crossovers per format and geometry.
// The wgmma kernels take over earlier (prefill_min_tokens_per_expert in moe_layer_cuda.cpp).
inline constexpr int kPrefillMinTokensPerExpert = 16;

// The fused routing runs up to this capacity. Up to 4 tokens it is one cluster of 8 blocks, from
// 5 a 16-block cluster that spreads the router GEMV over 256 warps and gives each token's top-k a
// block of its own (kernels/moe_route.cu). Measured on the H200 against the three separate kernels
// (docs/PERF.md run M3, Qwen3-30B-A3B nvfp4 layer us, fused / separate): T=1 20.4 / 27.3, T=4
// 43.6 / 46.7, T=8 64.0-64.4 / 66.8-66.9, T=16 97.4-97.5 / 95.5-95.7. Since the separate router
// also runs on tensor-core tiles from capacity 2 (session 29, docs/PERF.md runs Z18-Z19, H100, nvfp4
// layer us, separate / fused, both on tiles): T=1 26.2 / 20.9, T=2 31.6 / 29.7, T=3 39.9 / 40.9,
// T=4 44.1 / 45.0, T=8 62.6 / 64.9, T=16 93.8-94.1 / 96.7-97.0: the three kernels overlap each other
// through PDL better than the fused kernel's cluster barriers, so the fused kernel serves one and
// two tokens only. `bench moe --routing separate` and the autotuner's fused-routing candidate
// compare them (the kernel takes up to 16, kernels::kRouteSmallMaxCapacity).
inline constexpr int kFusedRoutingMaxTokens = 2;

// The largest capacity whose separate routing runs top-k and align as one kernel
// (kernels::launch_moe_route_topk_align, which takes up to 32). Measured (docs/PERF.md run Z23, H100,
// Qwen3-30B-A3B nvfp4 layer us, two kernels / one, three rounds): T=3 40.0 / 38.6, T=4 44.1 /
// 43.1, T=8 63.4 / 63.2, T=16 93.6 / 93.7, T=24 114.4 / 115.8, T=32 125.3 / 128.0. One block's chain
// (a warp per token, then the align) wins while the pairs fit the one-warp align (n <= 32) and
// breaks even to ~16 tokens; above, the top-k kernel's blocks on several SMs are quicker.
inline constexpr int kTopKAlignMaxTokens = 8;

// Whether the router logits of a layer with this capacity run on the tensor-core router GEMM
// (kernels/moe_router_gemm.cuh, when moe_router_gemm_supported) rather than the small-batch router
// (launch_moe_router_logits: 16 x 8 tensor-core tiles above capacity 8). The GEMM is latency-bound
// at a floor that grows with H, the tiles cost in proportion to capacity x E x H; measured on the
// H200 (docs/PERF.md run T5, dev_probe_router_gemm, us per launch in a PDL chain):
//   GEMM floor ~0.8 + 4.2 per 1024 of H: 9.4 / 17.7 / 30.3 us at H = 2048 / 4096 / 7168;
//   tiles ~2.5 + 4.7e-8 x capacity x E x H: 7.7 / 14.9 us (Qwen3-30B-A3B, 512 / 1024 tokens), 15.2
//   (Qwen3-235B-A22B, 512), 24.1 (DeepSeek-V3, 256).
// The GEMM is taken from kRouterGemmMinTokens on where the tiles' estimate also exceeds its floor:
// Qwen3-30B-A3B and -235B-A22B from about 600 tokens, DeepSeek-V3 from about 320. (Below 256 the
// small-batch router is always taken: its fixed cost and the GEMM's floor are both ~2 us at small
// H, where this model is not measured. Before the tiles, the warp-per-expert GEMV lost to the
// GEMM from 256 tokens: run L4.)
inline constexpr int kRouterGemmMinTokens = 256;
bool router_takes_gemm(int capacity, int hidden, int num_experts);

// logits [capacity, E] fp32 = x . W^T for the live tokens, on the GEMM or the GEMV by the rule
// above. x [capacity, x_stride] bf16 (the caller's: rows that are not 16-byte aligned take the
// GEMV), W [E, hidden] bf16. Shared by the single-GPU and the expert-parallel layers.
void enqueue_router_logits(const __nv_bfloat16* x, int x_stride, const __nv_bfloat16* router_weight,
                           const int32_t* num_tokens, int capacity, int hidden, int num_experts, float* logits,
                           cudaStream_t stream);

struct MoeCudaOptions {
  int capacity = 1;  // the most tokens one forward may carry
  kernels::MoeCombineMode combine = kernels::MoeCombineMode::kStore;
  // Tokens per GEMM tile; 0 = pick from capacity * k / E and the path. Decode: 8, 16, 32, 64.
  // Prefill: 64 or 128 (kPrefill: 128 for bf16 and nvfp4 only).
  int block_m = 0;
  MoeGemmPath gemm_path = MoeGemmPath::kAuto;
  // Fused small-batch routing (one kernel for router, top-k and align) when the capacity allows
  // it (capacity <= kFusedRoutingMaxTokens and kernels::moe_route_small_supported); false forces
  // the three separate kernels.
  bool fuse_routing = true;
  // Where the routing is not fused: top-k and align in one kernel when the capacity allows it
  // (capacity <= kTopKAlignMaxTokens and kernels::moe_route_topk_align_supported: ungrouped
  // scoring, E <= 256); false keeps the two kernels. Same bits either way.
  // MOEBIUS_ROUTE_TOPK_ALIGN=0|1 overrides it in every layer (an A/B knob for benchmarks).
  bool fuse_topk_align = true;
  // The decode experts in one persistent kernel (kernels/moe_fused_experts.cuh) where it applies:
  // the decode path with block_m 8 (capacity <= kernels::kFusedExpertsMaxTokens), the kStore
  // combine, an nvfp4, int4 or int2 layer whose experts are all device resident, hidden % 8 == 0,
  // and an sm_90 device (and a shared-memory plan: Qwen3-30B-A3B fits capacity 4). Bit-identical
  // to the three kernels it replaces. Off by default: it measured slower than them at every token
  // count (docs/PERF.md runs Q2-Q8, Qwen3-30B-A3B nvfp4: T = 1 16.1 us against 13.3, T = 4 39.2
  // against 33.4). MOEBIUS_FUSED_EXPERTS=0|1 overrides this option in every layer.
  bool fuse_experts = false;
  // Decode GEMMs with one token tile: 16-row weight tiles per block, 1, 2, 4 or 8; 0 = the
  // kernel's heuristic (kernels::MoeTiles::rows_per_block, [TAG_DECODE_ROW_TILES]).
  int decode_rows_per_block = 0;
  // [TAG_DECODE_SPLIT_K] Warps splitting K in the decode GEMM1 with one token tile: 0 (the
  // default, 4) or 8 where kernels::moe_gemm_gate_up_split_k_applies (decode_split_k_warps()
  // reports what the layer runs). MOEBIUS_DECODE_SPLIT_K_WARPS=4|8 overrides a 0 in every layer
  // (an experiment knob for whole-model runs).
  int decode_split_k_warps = 0;
  // [TAG_MOE_BF16_Y] GEMM2 of the wgmma path stores y in bf16 and the combine reads bf16 rows
  // (kernels::MoeCombineMode::kStoreBf16: half the bytes of the y round trip; each expert's row
  // rounded to bf16 once before the same fp32 slot-order sum, still deterministic). 1 on, 0 off,
  // -1 (the default): on for 128-token wgmma tiles, where it measured faster (PERF.md run Z6), and
  // MOEBIUS_MOE_BF16_Y=0|1 overrides that. Layers whose y rows someone else reads as fp32 (expert
  // parallelism's local layer) set 0.
  int bf16_y = -1;
  // Layers given the same pool share one workspace when their layouts match (one geometry and
  // capacity) [TAG_MOE_WORKSPACE_POOL]; null: this layer allocates its own.
  std::shared_ptr<MoeWorkspacePool> workspace_pool;
};

// [TAG_EXPERT_OFFLOAD] Where a layer's experts live when the GPU memory budget cannot hold them
// all (src/offload decides which). Resident experts fill device slots; cold ones live in pinned,
// mapped host memory that the caller allocated ONCE at load (Buffer kPinnedHost: cudaHostAlloc
// portable | mapped), and the kernels read them through their device alias in the address table
// [TAG_EXPERT_PTR_TABLE] (zero-copy over PCIe). Either region holds the experts matrix-major, as
// the device weights always did: [n][w13 weight] [n][w13 scales] [n][w2 weight] [n][w2 scales],
// each array 256-byte aligned (expert_region_bytes), so a layer's cold experts are one contiguous
// range (one DMA when staged) and each 512-byte tile chunk is one wide, coalesced read.
struct ExpertResidency {
  std::vector<uint8_t> resident;  // [E]: 1 on the GPU, 0 cold; empty: every expert resident
  uint8_t* cold_host = nullptr;   // host address of expert_region_bytes(.., cold count) pinned bytes
  int cold_count() const;
};
// Bytes of `n` experts' packed matrices in the region layout above.
size_t expert_region_bytes(const PackedMatrix& w13, const PackedMatrix& w2, int n);
// The packed shapes of create_dummy's experts (gate/up and down).
std::pair<PackedMatrix, PackedMatrix> dummy_expert_shapes(const cpu::MoeShape& shape, KernelFormat format,
                                                          int group_size);

class MoeLayerCuda {
 public:
  // Packs the reference layer's experts into the tile layout and uploads everything.
  static Result<std::unique_ptr<MoeLayerCuda>> create(const cpu::MoeLayerReference& layer, const MoeCudaOptions& opt,
                                                      const ExpertResidency& residency = {});
  // The same from a layer packed on the host (pack_moe_layer).
  static Result<std::unique_ptr<MoeLayerCuda>> create(const PackedMoeLayer& packed, const MoeCudaOptions& opt,
                                                      const ExpertResidency& residency = {});
  // Random weights of the given geometry and format written straight into the packed layout on
  // the device (benchmarks): codes uniform, neutral scales (global scale 1).
  static Result<std::unique_ptr<MoeLayerCuda>> create_dummy(const cpu::MoeShape& shape, KernelFormat format,
                                                           int group_size, const MoeCudaOptions& opt, uint64_t seed,
                                                           const ExpertResidency& residency = {});
  // Another layer over the SAME device weights with its own workspace for another capacity: a
  // model keeps a small-capacity one for decode (fused routing, a grid of a few tiles) and a large
  // one for prefill, and stores the experts once. The weights live while either layer does.
  Result<std::unique_ptr<MoeLayerCuda>> share_weights(const MoeCudaOptions& opt) const;
  // Weight updates: whether `packed` can be copied over this layer's weights (same shape, expert
  // format, packed sizes and group size, routing and activation settings; the error names the
  // first difference), and the copy itself, into the same device buffers ([TAG_MOE_WEIGHTS_IN_PLACE]):
  // graphs captured over this layer, and every layer sharing its weights (share_weights), see the
  // new weights. update_weights checks first and changes nothing when the check fails; it is
  // synchronous, and no forward reading these weights may be in flight.
  Status check_compatible(const PackedMoeLayer& packed) const;
  Status update_weights(const PackedMoeLayer& packed);
  ~MoeLayerCuda();
  MoeLayerCuda(const MoeLayerCuda&) = delete;
  MoeLayerCuda& operator=(const MoeLayerCuda&) = delete;

  // x [capacity, H] bf16 -> out [capacity, H] bf16, rows [0, *num_tokens). No host sync.
  void forward(const __nv_bfloat16* x, const int32_t* num_tokens, __nv_bfloat16* out, cudaStream_t stream);
  // [TAG_MOE_DEFERRED_COMBINE] forward() without its combine stage, for a caller whose next kernel
  // performs the combine itself (the model runner: the next layer's qkv GEMV with its folded
  // RMSNorm, kernels::DenseGemvRmsNorm::combine). Returns what that kernel reads: GEMM2's fp32 rows
  // and the routed weights, in this layer's workspace, valid until the next forward of any layer
  // sharing it (MoeWorkspacePool). Only where defers_combine(x) holds; forward() otherwise.
  bool defers_combine(const __nv_bfloat16* x) const;
  kernels::MoeCombineSource forward_deferring_combine(const __nv_bfloat16* x, const int32_t* num_tokens,
                                                      cudaStream_t stream);
  // [TAG_EXPERT_PREFETCH] The next forward's GEMM2 (the fused experts kernel: the whole expert
  // stage) waits for `event` first: a down-only prefetch's copies of w2, which only GEMM2 reads,
  // may still run while the routing and GEMM1 go ahead. Once; a null event clears it.
  void wait_before_down(cudaEvent_t event) { down_wait_ = event; }
  cudaEvent_t pending_down_wait() const { return down_wait_; }
  // [TAG_EXPERT_ROUTED_DMA] Once: the next forward calls `f(stream)` right after its routing and
  // before its expert GEMMs (the model runner's routed-expert copies, which need topk_ids()).
  void run_after_routing(std::function<void(cudaStream_t)> f) { after_routing_ = std::move(f); }
  // The experts and combine for a routing computed elsewhere (tests; expert parallelism, where
  // the routing arrives with the tokens): topk_ids/topk_weights [capacity, k] device.
  void forward_routed(const __nv_bfloat16* x, const int32_t* num_tokens, const int32_t* topk_ids,
                      const float* topk_weights, __nv_bfloat16* out, cudaStream_t stream);

  // One stage of forward()/forward_routed(); topk_ids/topk_weights are the routing the align,
  // down and combine stages use (the layer's own after kTopK).
  void enqueue_stage(MoeStage stage, const __nv_bfloat16* x, const int32_t* num_tokens, const int32_t* topk_ids,
                     const float* topk_weights, __nv_bfloat16* out, cudaStream_t stream);

  // Whether forward() runs this stage (the fused routing replaces router, top-k and align; the
  // fused experts replace GEMM1, GEMM2 and the combine, except in a forward whose x rows are not
  // 16-byte aligned, which runs those three).
  bool uses_stage(MoeStage stage) const;
  bool fused_routing() const { return fused_routing_; }
  // Whether forward() runs the experts as kExpertsFused (for 16-byte aligned x rows; a forward
  // with unaligned x runs the three separate stages).
  bool fused_experts() const { return fused_experts_; }

  const cpu::MoeShape& shape() const { return shape_; }
  KernelFormat format() const { return format_; }
  int capacity() const { return opt_.capacity; }
  const MoeCudaOptions& options() const { return opt_; }
  int group_size() const { return dims13_.group_size; }  // int formats: K elements per scale
  const kernels::MoeActivationParams& activation() const { return act_; }
  int block_m() const { return block_m_; }
  // The decode GEMM1's warps splitting K as resolved: 4, or 8 ([TAG_DECODE_SPLIT_K]).
  int decode_split_k_warps() const { return split_k_warps_; }
  // The path the GEMM stages run (kDecode, kPrefill or kPrefillWgmma; kAuto is resolved at creation).
  MoeGemmPath gemm_path() const { return path_; }
  // Routing of the last forward, [capacity, k] (device).
  const int32_t* topk_ids() const { return topk_ids_; }
  const float* topk_weights() const { return topk_weights_; }
  // GEMM2's fp32 rows [capacity * k, H] of the last kDown stage in kStore mode, pair t * k + s at
  // row t * k + s, before the routed weights (expert parallelism sends them back to the token's
  // rank, which combines them).
  const float* expert_outputs() const {
    MOEBIUS_ASSERT(!bf16_y(), "expert_outputs: this layer stores bf16 y rows (MoeCudaOptions::bf16_y)");
    return y_;
  }
  // [TAG_MOE_BF16_Y] Whether GEMM2 stores y in bf16 (kernels::MoeCombineMode::kStoreBf16; see
  // MoeCudaOptions::bf16_y).
  bool bf16_y() const;
  // The same rows in bf16, for a layer that stores them so ([TAG_MOE_BF16_Y]; tests).
  const __nv_bfloat16* expert_outputs_bf16() const {
    MOEBIUS_ASSERT(bf16_y(), "expert_outputs_bf16: this layer stores fp32 y rows");
    return reinterpret_cast<const __nv_bfloat16*>(y_);
  }
  // Packed bytes of one expert (gate_up + down, weights and scales): what a forward reads per
  // touched expert.
  size_t expert_bytes() const { return expert_bytes_; }
  // Device bytes of all experts' packed weights and scales, and of the router (shared by the
  // layers made with share_weights), and of this layer's own workspace.
  size_t weight_bytes() const {
    return expert_bytes_ * static_cast<size_t>(shape_.num_experts) +
           sizeof(__nv_bfloat16) * static_cast<size_t>(shape_.num_experts) * static_cast<size_t>(shape_.hidden);
  }
  size_t workspace_bytes() const { return workspace_bytes_; }

  // Expert offload [TAG_EXPERT_OFFLOAD]. Device slots and cold experts of this layer's weights
  // (shared with every share_weights layer).
  int device_slots() const { return slots_; }
  int cold_experts() const { return shape_.num_experts - slots_; }
  bool expert_resident(int e) const { return res_->home[static_cast<size_t>(e)] >= 0; }
  // Device bytes of the resident experts and router (what weight_bytes() counts when all are
  // resident), and pinned host bytes of the cold experts.
  size_t device_weight_bytes() const;
  size_t cold_bytes() const { return cold_bytes_; }
  // The dynamic cache's move: cold expert `cold` takes resident expert `resident`'s device slot and
  // `resident` takes `cold`'s place in pinned memory (three copies per matrix on `stream` through
  // `scratch`, >= expert_bytes() of device memory the caller owns, one for all layers), then the
  // two address-table entries are rewritten on `stream`. The device
  // addresses kernels read from (the tables) do not move, so graphs captured before stay valid and
  // replay with the new residency. Enqueued on `stream` after whatever forward is already there;
  // no forward may run on another stream meanwhile. Errors for experts on the wrong side.
  Status swap_experts(int cold, int resident, uint8_t* scratch, cudaStream_t stream);

  // DMA staging [TAG_EXPERT_STAGING] (docs/OFFLOAD.md). set_staging_slot (at load, once per
  // weights, after the layer set is made) allocates a second pair of address tables whose cold
  // entries point into `slot`: device memory of cold_bytes() into which the caller copies this
  // layer's whole cold region verbatim (one DMA; the region layout is position-independent) before
  // the forward. A layer instance with set_use_staging(true) (the prefill bucket) runs its GEMMs on
  // those tables; the caller orders the copy before the forward and the forward before the slot's
  // next copy (events, no host sync). swap_experts keeps both table pairs current.
  Status set_staging_slot(uint8_t* slot);
  void set_use_staging(bool on) { use_staging_ = on && res_->staged13 != nullptr; }
  bool uses_staging() const { return use_staging_; }

  // [TAG_PDL_EARLY_TRIGGER] The combine lets the next kernel on the stream launch before its own
  // PDL wait. For callers whose next kernel streams weights before its wait: the model runner,
  // where it is the qkv GEMV with the folded norm (docs/PERF.md run N3: decode +0.9% with the
  // fold, which alone lost 0.9% for want of that head start). Off by default: in a chain of MoE
  // layers (bench moe) the next kernel is the routing, and there it cost ~0.2 us per layer.
  void set_combine_trigger_early(bool on) { combine_trigger_early_ = on; }
  // The host address of the cold region (the DMA source) and its device alias.
  const uint8_t* cold_region_host() const { return cw13_; }

  // [TAG_EXPERT_PREFETCH] What the model runner's next-layer prefetch reads and writes
  // (kernels/expert_prefetch.cuh): this layer's router, its address tables (shared by every
  // share_weights layer) and the bytes of one expert's four arrays.
  struct PrefetchView {
    const __nv_bfloat16* router = nullptr;  // [E, H]
    const float* correction_bias = nullptr; // [E] or null
    kernels::ExpertMatrixPtrs* table13 = nullptr;
    kernels::ExpertMatrixPtrs* table2 = nullptr;
    size_t w13_bytes = 0, s13_bytes = 0, w2_bytes = 0, s2_bytes = 0;
  };
  PrefetchView prefetch_view() const {
    return {router_weight_, correction_bias_, table13_, table2_, w13_bytes_, s13_bytes_, w2_bytes_, s2_bytes_};
  }

  // [TAG_EXPERT_ROUTED_DMA] Where a copy engine reads expert e's four arrays (w13 weights and
  // scales, w2 weights and scales; a scale pointer is null when the format has none): device
  // addresses for a resident expert, pinned host pointers for a cold one.
  struct ExpertSource {
    const uint8_t *w13 = nullptr, *s13 = nullptr, *w2 = nullptr, *s2 = nullptr;
  };
  // The cold region as the kernels address it (device aliases): a table entry whose weight lies in
  // a range points home. Empty ranges when every expert is resident.
  kernels::ExpertDmaHome cold_home() const {
    const size_t n = static_cast<size_t>(cold_experts());
    return {dcw13_, dcw13_ + w13_bytes_ * n, dcw2_, dcw2_ + w2_bytes_ * n};
  }
  ExpertSource copy_source(int e) const {
    const ExpertAddr a = copy_addr(e);
    return {a.w13, s13_bytes_ ? a.s13 : nullptr, a.w2, s2_bytes_ ? a.s2 : nullptr};
  }

 private:
  MoeLayerCuda() = default;
  Status allocate(const cpu::MoeShape& shape, KernelFormat format, const PackedMatrix& w13_proto,
                  const PackedMatrix& w2_proto, const MoeCudaOptions& opt, const ExpertResidency& residency);
  // Where expert e's four arrays are: host-writable addresses for copies (device pointers, or the
  // pinned host pointers) and the addresses the kernels read (device, or the mapped alias).
  struct ExpertAddr {
    uint8_t *w13 = nullptr, *s13 = nullptr, *w2 = nullptr, *s2 = nullptr;
  };
  ExpertAddr copy_addr(int e) const;
  ExpertAddr kernel_addr(int e) const;
  // Points expert e's table entries (host mirrors) at kernel_addr(e); global scales unchanged.
  void set_table_entry(int e);
  // Every weight of `packed` into this layer's buffers (checked by check_compatible).
  void upload(const PackedMoeLayer& packed);
  Status allocate_workspace(const MoeCudaOptions& opt);
  void run_after_routing_hook(cudaStream_t stream);  // run_after_routing's f, once
  // with_combine false: GEMM1 and GEMM2 only (forward_deferring_combine; not the fused experts).
  void enqueue_experts(const __nv_bfloat16* x, const int32_t* num_tokens, const int32_t* topk_ids,
                       const float* topk_weights, __nv_bfloat16* out, cudaStream_t stream, bool with_combine = true);

  cpu::MoeShape shape_;
  KernelFormat format_ = KernelFormat::kBF16;
  MoeCudaOptions opt_;
  int block_m_ = 8;
  int split_k_warps_ = 4;
  bool fused_routing_ = false;
  bool topk_align_ = false;  // kTopKAlign in place of kTopK + kAlign (separate routing only)
  bool fused_experts_ = false;
  cudaEvent_t down_wait_ = nullptr;  // wait_before_down: consumed by the next expert stages
  std::function<void(cudaStream_t)> after_routing_;  // run_after_routing: consumed by the next forward
  MoeGemmPath path_ = MoeGemmPath::kDecode;
  kernels::RouteParams route_;
  kernels::MoeActivationParams act_;
  kernels::MoeGemmDims dims13_, dims2_;
  size_t expert_bytes_ = 0;
  int h_stride_ = 0;
  // Row stride (elements) of the aligned copy of an unaligned x for the wgmma GEMM1: H rounded up
  // to 8 (16-byte rows).
  int aligned_x_stride() const { return static_cast<int>((shape_.hidden + 7) / 8 * 8); }
  int64_t max_padded_ = 0, max_tiles_ = 0, grid_tiles_ = 0;

  std::shared_ptr<std::vector<Buffer>> weights_;  // experts, tables, router: shared by share_weights()
  std::shared_ptr<const MoeWorkspacePool::Block> workspace_;  // this layer's, or shared through the pool
  size_t workspace_bytes_ = 0;
  uint8_t* w13_ = nullptr;       // [E][w13 weight bytes]
  uint8_t* s13_ = nullptr;       // [E][w13 scale bytes]
  uint8_t* w2_ = nullptr;
  uint8_t* s2_ = nullptr;
  size_t w13_bytes_ = 0, s13_bytes_ = 0, w2_bytes_ = 0, s2_bytes_ = 0;
  kernels::ExpertMatrixPtrs* table13_ = nullptr;  // [E] device  [TAG_EXPERT_PTR_TABLE]
  kernels::ExpertMatrixPtrs* table2_ = nullptr;
  // Residency, shared by the share_weights layers: home[e] >= 0 is a device slot, -1 - c the
  // c-th cold place; the host mirrors of the tables.
  struct Residency {
    std::vector<int> home;  // [E]
    std::vector<kernels::ExpertMatrixPtrs> table13, table2;
    // [TAG_EXPERT_STAGING] tables (device) and the slot their cold entries point into.
    kernels::ExpertMatrixPtrs* staged13 = nullptr;
    kernels::ExpertMatrixPtrs* staged2 = nullptr;
    uint8_t* staging_slot = nullptr;
  };
  // Expert e's staged-table entries from its home (cold experts: the slot at the region offset).
  kernels::ExpertMatrixPtrs staged_entry(int e, bool w13) const;
  void write_staged_tables();  // both staged tables from the host mirrors (synchronous)
  bool use_staging_ = false;
  bool combine_trigger_early_ = false;
  std::shared_ptr<Residency> res_;
  int slots_ = 0;
  size_t cold_bytes_ = 0;
  // Cold region (pinned host), matrix-major like the device one: host pointers and device aliases.
  uint8_t *cw13_ = nullptr, *cs13_ = nullptr, *cw2_ = nullptr, *cs2_ = nullptr;
  uint8_t *dcw13_ = nullptr, *dcs13_ = nullptr, *dcw2_ = nullptr, *dcs2_ = nullptr;
  __nv_bfloat16* router_weight_ = nullptr;  // [E, H]
  float* correction_bias_ = nullptr;        // [E] or null
  // Workspace, sized to capacity.
  float* logits_ = nullptr;          // [cap, E]
  int32_t* topk_ids_ = nullptr;      // [cap, k]
  float* topk_weights_ = nullptr;    // [cap, k]
  uint32_t* fused_sync_ = nullptr;   // kExpertsFused's counters (zeroed; the kernel leaves them so)
  int32_t* expert_offsets_ = nullptr;   // [E + 1]
  int32_t* sorted_pair_ids_ = nullptr;  // [cap * k]
  int32_t* padded_offsets_ = nullptr;   // [E + 1]
  int32_t* padded_pair_ids_ = nullptr;  // [max_padded]
  int32_t* tile_expert_ = nullptr;      // [max_tiles]
  int32_t* num_tiles_ = nullptr;        // [1]
  // [4]: the wgmma GEMM1 and GEMM2 work-item counters (MoeTiles::work_counter), zeroed; layers
  // sharing the workspace run one after another, and each launch leaves its pair zeroed.
  int32_t* work_counters_ = nullptr;
  __nv_bfloat16* h_ = nullptr;          // [max_padded, h_stride]
  float* y_ = nullptr;                  // [cap * k, H]
};

}  // namespace moebius::moe

#endif  // MOEBIUS_HAS_CUDA
