// Qwen3-MoE on the GPU: the model runner for batches of sequences over a paged bf16 KV cache.
//
// Per step (one call of enqueue/forward), for a flat list of T tokens from S sequences
// (StepBatch, step_batch.h), all on one stream:
//   x = embed[ids]                                   [T, H] fp32 residual   kernels/gather.cuh
//   per layer l:
//     h = RMSNorm(x += y) * input_norm_l              [T, H] bf16            kernels/norm.cuh
//     qkv = h Wqkv^T                                  [T, (nh+2nkv) hd] bf16  cuBLAS (runtime/dense_gemm.h)
//     q, k = QK-norm + RoPE; k, v -> cache slots                             kernels/rope.cuh (decode: in attention)
//     a = causal GQA attention over the cache        [T, nh hd] bf16        kernels/attention.cuh
//     y = a Wo^T                                      [T, H] bf16            cuBLAS
//     h = RMSNorm(x += y) * post_norm_l
//     y = MoE(h) (fused MoE layer) | down(SwiGLU(h [gate; up]^T))            moe/moe_layer_cuda.h | cuBLAS + kernels/swiglu.cuh
//   h = RMSNorm(x += y) * norm;  logits = h[logit_rows] lm_head^T  [R, V] fp32   kernels/gather.cuh + cuBLAS
// The residual stream stays fp32 like the CPU backend's; activations between ops are bf16.
//
// Buffers: everything is allocated at creation from the capacities in Qwen3MoeCudaOptions
// (max_tokens, max_seqs, max_logit_rows, max_context, num_blocks), so device addresses never
// change and a captured CUDA graph stays valid. The step's inputs (ids, positions, slots,
// cu_seqlens, seq_lens, logit rows, block tables, live counts) are packed on the host into a
// pinned staging area and uploaded with ONE cudaMemcpyAsync into a device arena of fixed layout.
//
// Synchronization: nothing inside the forward waits for the host. enqueue() waits (host) only for
// the previous step's input copy to finish before reusing the pinned staging area; forward()
// adds the logits download and one stream synchronize at the end. The dynamic expert cache
// (options.expert_cache, qwen3_moe_cuda_cache.h) adds no wait: enqueue() queries the events of
// earlier steps' routing read-back and enqueues the swaps it decides before the step.
//
// CUDA graphs: a pure decode step (every sequence one new token) whose sequence count fits a
// graph batch size B (options.graph_batches) is padded to B rows (StepBatch::pad_decode_to) and
// runs as a graph captured once for B (the first step of that size runs eagerly, then the graph
// is captured). Decode graphs use the split-KV decode attention kernel with a plan for B
// sequences up to max_context, and, where a shorter context would merge its splits in a cluster,
// a second graph for B planned at that context, replayed while every live sequence is that short
// ([TAG_ATTN_CLUSTER_MERGE]); everything else (prefill, chunked prefill, mixed batches) runs
// eagerly through the prefill attention kernel. [TAG_ATTN_GRAPH_BUCKET] [TAG_MOE_GRAPH_CAPACITY]
//
// Expert parallelism (Qwen3MoeCudaOptions::ep_comm, docs/EXPERT_PARALLEL.md): DP attention + EP
// MoE with DP = EP = N ranks, one runner per GPU. Each rank runs attention on its own sequences and
// every MoE layer is a MoeLayerEpCuda over this rank's E / N experts (only those are loaded). Each
// step starts with the EP step header (parallel/ep_step.h: an all-gather of every rank's token
// count, the one host synchronization EP adds), from which every rank picks the same EP capacity:
// the decode graphs' (max(graph_batches)) when every rank's tokens fit it, else max_tokens. A
// rank with no tokens runs ep_empty_step() (every MoE layer's collectives with a live count of 0),
// and one with no more work ep_idle_until_all_done(). Decode steps at the decode capacity replay
// CUDA graphs with the NCCL calls captured in them ([TAG_EP_CAPACITY_SLOTS]); a decode step while
// another rank prefills runs eagerly at the prefill capacity.
//
// MoE layers: per layer, one MoeLayerCuda per capacity bucket (powers of two up to
// max(graph_batches), plus max_tokens) over the same device weights, each bucket's layers sharing
// one workspace, made by tune::MoeLayerFactory (src/tune/moe_layer_set.h) with the autotuner's
// configurations when options.autotune is set, the heuristic's otherwise.
#pragma once

#ifdef MOEBIUS_HAS_CUDA

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/memory.h"
#include "cpu/moe_layer.h"
#include "formats/quant_matrix.h"
#include "model/qwen3_moe_config.h"
#include "model/step_batch.h"
#include "model/weight_source.h"
#include "moe/expert_layout.h"
#include "offload/expert_cache.h"
#include "offload/model_expert_cache.h"

namespace moebius::parallel {
class Communicator;
}
namespace moebius::moe {
class MoeLayerCuda;
class MoeLayerEpCuda;
struct ExpertResidency;
}
namespace moebius::runtime {
class DenseGemm;
}
namespace moebius::tune {
class MoeLayerFactory;
class MoeLayerSet;
}

namespace moebius::model {

struct Qwen3MoeCudaOptions {
  // Experts: nullopt keeps the checkpoint's bf16 (F16/F32 checkpoints are converted to bf16) or
  // its pre-quantized format; kNvFp4 / kInt4 / kInt2 quantize online exactly as the CPU backend
  // does (Qwen3MoeLoadOptions: a pre-quantized checkpoint only accepts its own format).
  std::optional<WeightFormat> experts_format;
  int experts_group_size = 128;  // int formats (-1: per channel)
  int max_tokens = 2048;         // tokens per step (the prefill chunk); >= max_seqs
  int max_seqs = 1;              // sequences per step
  int max_logit_rows = 0;        // logit rows per step; 0 = max_seqs
  int max_context = 0;           // tokens per sequence; 0 = max_position_embeddings
  int block_size = 16;           // tokens per KV block
  int num_blocks = 0;            // KV blocks in the pool; 0 = max_seqs * ceil(max_context / block_size)
  std::vector<int> graph_batches = {1};  // decode batch sizes run as CUDA graphs (each <= max_seqs)
  // Called after each loaded layer (done, total) and once more at the end; may be empty.
  std::function<void(int done, int total)> progress;
  uint64_t seed = 1;  // create_dummy's weights
  // Tune the MoE layers' kernel configurations per capacity bucket (src/tune), cached per GPU in
  // tune_cache_dir ("" = $MOEBIUS_CACHE_DIR or ~/.cache/moebius); false runs the heuristic.
  bool autotune = false;
  std::string tune_cache_dir;
  // Expert offload [TAG_EXPERT_OFFLOAD] (src/offload, docs/OFFLOAD.md): "" keeps every expert on
  // the GPU; "auto" or a number of GiB (`--gpu-memory-budget`) caps the device bytes of the model.
  // Non-expert weights, KV cache and workspace come first; the experts that do not fit live in one
  // pinned, mapped host allocation made at load and are read zero-copy through the address table.
  std::string gpu_memory_budget;
  // `--placement FILE`: a routing profile (moebius profile-experts); the hottest experts of each
  // layer by routing mass stay resident. "": uniform placement.
  std::string placement_file;
  // At most this many experts per MoE layer on the GPU (tests, and benchmarks comparing placements
  // at one residency); -1: as many as the budget holds (all without a budget).
  int max_resident_experts = -1;
  // How eager steps (prefill) reach cold experts [TAG_EXPERT_STAGING]: "auto" stages where the cost
  // model (offload/cost_model.h) prefers DMA staging to zero-copy, "zero-copy" never stages,
  // "staged" stages every eager bucket (tests, measurements). Decode graphs always read zero-copy.
  std::string cold_path = "auto";
  // The dynamic expert cache [TAG_EXPERT_CACHE] (`--expert-cache lru|freq`, offload/expert_cache.h,
  // qwen3_moe_cuda_cache.h): nullopt keeps the load-time placement. It needs cold experts; when the
  // budget holds every expert it stays off and the memory plan says so. Not with expert parallelism.
  std::optional<offload::CacheOptions> expert_cache;
  // Next-layer expert prefetch [TAG_EXPERT_PREFETCH] (`--expert-prefetch N`, docs/OFFLOAD.md,
  // qwen3_moe_cuda_prefetch.h): in steps of at most kernels::kExpertPrefetchMaxTokens rows, after
  // each MoE layer the next one's routing is predicted and the down projections of up to N of its
  // cold experts are copied into device slots while the layers between run, so PCIe works while
  // no MoE layer reads it (whole experts with MOEBIUS_PREFETCH_PARTS=all).
  // 0: off. At most kernels::kExpertPrefetchMaxSlots; needs cold experts (off otherwise, and the
  // memory plan says so); not with the dynamic cache (both move experts) or expert parallelism.
  int expert_prefetch = 0;
  // Routed cold experts copied by the copy engines [TAG_EXPERT_ROUTED_DMA] (docs/OFFLOAD.md,
  // qwen3_moe_cuda_dma.h): in decode steps of at most kernels::kExpertDmaMaxIds / k rows, each MoE
  // layer's first N routed cold experts are copied into device slots after its routing (a kernel
  // posts its choice, a host thread issues the copies) instead of read zero-copy by its GEMMs.
  // 0: off; -1: $MOEBIUS_EXPERT_DMA_SLOTS, else 0 (the commands' --expert-dma N sets N > 0). At most kernels::kExpertDmaMaxSlots; needs
  // cold experts; not with the dynamic cache or expert parallelism. A measurement setting until
  // the GPU runs compare it with the zero-copy reads.
  int expert_dma_slots = -1;
  // [TAG_MOE_DEFERRED_COMBINE] Steps of at most this many rows leave each MoE layer's combine to
  // the next layer's qkv GEMV, whose folded RMSNorm forms the same bf16 rows from GEMM2's output
  // (one kernel less per MoE layer; every GEMV block then reads k fp32 rows of H per token from L2,
  // so only small steps can gain). 0: off; -1: $MOEBIUS_FOLD_MOE_COMBINE, else 0. At most 16.
  // Expert-parallel layers (ep_comm) combine on their own path and never fold.
  int fold_moe_combine_max_rows = -1;
  // Expert parallelism: this runner is rank ep_comm->rank() of ep_comm->size() (an
  // NcclCommunicator on this process's GPU; it must outlive the runner). Null: one GPU holding
  // every expert. Every rank must be created with the same max_tokens and graph_batches (checked
  // at creation); expert offload, autotuning of the EP layers and weight updates are not
  // supported with it.
  std::shared_ptr<parallel::Communicator> ep_comm;
};

// Device bytes by kind, for the plan printed before generation.
struct MemoryPlan {
  uint64_t attention = 0;   // q/k/v/o projections and the q/k/layer norms
  uint64_t experts = 0;     // packed experts (weights + scales) and routers
  uint64_t dense_mlp = 0;   // dense MLP layers (mlp_only_layers)
  uint64_t embeddings = 0;  // embed_tokens, lm_head (once when tied), the final norm
  uint64_t kv_cache = 0;
  uint64_t workspace = 0;   // activations, MoE and attention workspaces, cuBLAS workspace, step inputs
  // Expert offload: cold experts in pinned host memory (not in total()), experts resident / all,
  // and the budget the plan had to fit (0: none).
  uint64_t experts_host = 0;
  int64_t resident_experts = 0, total_experts = 0;
  uint64_t budget = 0;
  std::string placement;    // "uniform" or the profile's path
  std::string cold_paths;   // the cost model's zero-copy / staged choice per capacity bucket
  std::string expert_cache; // the dynamic cache's settings, or why it is off ("": not asked for)
  std::string expert_prefetch;  // the prefetch's settings, or why it is off ("": not asked for)
  std::string expert_dma;       // the routed experts' DMA [TAG_EXPERT_ROUTED_DMA], likewise
  uint64_t cache_host = 0;  // the cache's pinned routing read-back (not in total())
  std::string expert_format;
  int64_t kv_tokens = 0;    // tokens the KV pool holds
  uint64_t weights() const { return attention + experts + dense_mlp + embeddings; }
  uint64_t total() const { return weights() + kv_cache + workspace; }
};
std::string format_memory_plan(const MemoryPlan& plan);

// A checkpoint read, checked and converted on the host into exactly the bytes of a runner's device
// weight buffers: dense weights as bf16 bits (q/k/v and gate/up stacked as the device holds
// them), norms as fp32, experts packed (moe::PackedMoeLayer). Made by Qwen3MoeCuda::stage_weights,
// copied by commit_weights. It holds as many host bytes as the device weights (host_bytes()).
struct Qwen3MoeStagedWeights {
  struct Layer {
    std::vector<float> input_norm, post_norm, q_norm, k_norm;  // [H], [H], [hd], [hd]
    std::vector<uint16_t> wqkv;                                // [(nh + 2 nkv) hd, H]
    std::vector<uint16_t> wo;                                  // [H, nh hd]
    std::optional<moe::PackedMoeLayer> moe;                    // MoE layers
    std::vector<uint16_t> gate_up, down;                       // dense layers: [2 I, H], [H, I]
  };
  std::string source;                  // the checkpoint directory
  std::vector<uint16_t> embed;         // [V, H]
  std::vector<uint16_t> lm_head;       // [V, H]; empty when tied
  std::vector<float> final_norm;       // [H]
  std::vector<Layer> layers;
  uint64_t host_bytes() const;
};

class Qwen3MoeCuda {
 public:
  // Loads `dir` (config.json + safetensors) layer by layer through the CPU backend's readers
  // (load_qwen3_moe_layer) and uploads each layer as it is read.
  static Result<std::unique_ptr<Qwen3MoeCuda>> load(const std::string& dir, const Qwen3MoeCudaOptions& options);
  // Random weights of `config`'s geometry (benchmarks): dense bf16 weights uniform, norm weights 1,
  // experts from MoeLayerCuda::create_dummy (neutral scales).
  static Result<std::unique_ptr<Qwen3MoeCuda>> create_dummy(const Qwen3MoeConfig& config, moe::KernelFormat experts,
                                                            const Qwen3MoeCudaOptions& options);
  // The runner `source` names (model/weight_source.h): create_dummy of its config with experts in
  // options.experts_format (bf16 when unset), or load(source.model_dir). The one place that makes
  // this choice for `generate`, `bench generate` and `serve`.
  static Result<std::unique_ptr<Qwen3MoeCuda>> open(const WeightSource& source, const Qwen3MoeCudaOptions& options);
  ~Qwen3MoeCuda();
  Qwen3MoeCuda(const Qwen3MoeCuda&) = delete;
  Qwen3MoeCuda& operator=(const Qwen3MoeCuda&) = delete;

  const Qwen3MoeConfig& config() const { return config_; }
  int max_tokens() const { return opt_.max_tokens; }
  int max_seqs() const { return opt_.max_seqs; }
  int max_logit_rows() const { return opt_.max_logit_rows; }
  int max_context() const { return opt_.max_context; }
  int block_size() const { return opt_.block_size; }
  int32_t num_blocks() const { return opt_.num_blocks; }
  int max_blocks_per_seq() const { return max_blocks_per_seq_; }
  moe::KernelFormat experts_format() const { return experts_format_; }
  const MemoryPlan& memory_plan() const { return plan_; }
  cudaStream_t stream() const { return stream_; }

  // make_step_batch with this cache's geometry.
  Result<StepBatch> make_batch(std::span<const SequenceStep> seqs, bool all_logits = false) const;

  // The checks enqueue() runs before it enqueues anything (or, with expert parallelism, takes
  // part in a collective): the batch's geometry, the capacities, ids inside the vocabulary. Data-
  // parallel serving runs them on every rank before any rank starts a step ([TAG_SERVE_DP]).
  Status check_batch(const StepBatch& batch) const;
  // Enqueues one step; no host synchronization beyond the staging reuse (see the header comment).
  // logits_device() then holds [batch.logit_rows.size(), V] fp32 once the stream reaches that
  // point. Errors (nothing enqueued) are check_batch()'s.
  Status enqueue(const StepBatch& batch);
  // enqueue(), then the logits of the step's logit rows [R, V] fp32 copied to `logits` (host),
  // and a stream synchronize.
  Status forward(const StepBatch& batch, float* logits);
  const float* logits_device() const { return logits_; }

  // Weight bytes one decode token reads: one embedding row, every dense weight (attention, norms,
  // routers, dense MLPs, final norm, lm_head) and top_k experts per MoE layer (assumed distinct).
  // The KV cache is not included (kv_bytes_per_token gives it per context token).
  uint64_t decode_weight_bytes() const;
  // Bytes of K and V one decode token reads per token of context (all layers).
  uint64_t kv_bytes_per_context_token() const;
  // Every weight byte on the device: what a large prefill reads once.
  uint64_t total_weight_bytes() const { return plan_.weights(); }

  // Weight updates (`moebius serve`'s POST /update_weights_from_disk) in two steps, so that
  // nothing on the device changes before the new checkpoint has been read and checked in full:
  //  1. stage_weights(dir) reads `dir` with this runner's load options (experts_format, group
  //     size) through the same readers as load(), converts and packs everything on the host, and
  //     checks that it fits the runner: config.json identical (check_same_config), every tensor
  //     present with its shape and dtype, the experts in the runner's format with the same packed
  //     sizes and group size (MoeLayerCuda::check_compatible). It touches no device memory and
  //     reads only what never changes after creation, so it may run on another thread while
  //     steps run.
  //  2. commit_weights(staged) waits for the stream, then copies every weight into the buffers
  //     they already occupy ([TAG_MODEL_WEIGHTS_IN_PLACE], [TAG_MOE_WEIGHTS_IN_PLACE]): device
  //     addresses do not change, so the captured decode graphs stay valid and replay the new
  //     weights. It cannot fail (device errors abort, as everywhere); no step may be enqueued
  //     meanwhile. The KV cache is left as it is.
  // Dummy runners (create_dummy) take a checkpoint of their geometry the same way, with their
  // experts_format option deciding how float experts are quantized.
  Result<std::unique_ptr<Qwen3MoeStagedWeights>> stage_weights(const std::string& dir) const;
  void commit_weights(const Qwen3MoeStagedWeights& staged);

  // Expert offload [TAG_EXPERT_OFFLOAD]. Whether some experts are cold; whether MoE layer `layer`'s
  // expert `e` is on the GPU now.
  bool offloaded() const { return plan_.experts_host > 0; }
  bool expert_resident(int layer, int e) const;
  // Moves cold expert `cold` of model layer `layer` into resident expert `resident`'s device slot
  // and `resident` to pinned memory (MoeLayerCuda::swap_experts), enqueued on stream() between
  // steps. Only the expert address table changes for the kernels, so captured graphs stay valid.
  // An error while the expert cache runs (it owns the residency then).
  Status swap_experts(int layer, int cold, int resident);
  // The dynamic expert cache [TAG_EXPERT_CACHE] (options.expert_cache; qwen3_moe_cuda_cache.h):
  // whether it runs, and its counts so far (hit rate over routed (token, expert) pairs, swaps and
  // their PCIe bytes; zeros when off). A step's routing is counted when it is fed to the cache, one
  // step later (two when steps are enqueued back to back), so the last step or two of a run are
  // counted at the next step.
  bool expert_cache_on() const { return cache_ != nullptr; }
  offload::ModelCacheStats expert_cache_stats() const;
  // Routing capture, for measuring PCIe bytes: while on, every step runs eagerly (no graph
  // replay; the same MoE buckets and kernels) and each MoE layer's top-k ids are copied into a
  // buffer of their own (the layers of a bucket share one workspace [TAG_MOE_WORKSPACE_POOL], so
  // the workspace holds only the last layer's). Only for an offloaded model.
  void set_routing_capture(bool on) { capture_routing_ = on && routing_capture_ != nullptr; }
  // Bytes of cold experts the last step (run with routing capture on) moved over PCIe: for a
  // staged layer its whole cold region (the DMA); otherwise from the layer's captured routing, a
  // cold expert routed to by n tokens being read ceil(n / block_m) times (once per token tile; an
  // upper bound, since L2 may serve a repeat). Synchronizes the stream. `rows`: the step's tokens.
  uint64_t last_step_cold_bytes(int rows) const;
  // [TAG_EXPERT_PREFETCH] The last step's prefetch (run with routing capture on; synchronizes):
  // experts copied ahead, how many of them the layer then routed to, and the routed cold experts
  // of the layers that were predicted. last_step_cold_bytes counts the copies and leaves the hits
  // out of the zero-copy reads. Zeros when the step did not prefetch.
  struct PrefetchCounts {
    int64_t copied = 0, hits = 0, routed_cold = 0;
  };
  PrefetchCounts last_step_prefetch(int rows) const;
  bool expert_prefetch_on() const { return prefetch_ != nullptr; }
  bool expert_dma_on() const { return dma_ != nullptr; }
  // [TAG_EXPERT_ROUTED_DMA] Choices the copier's host thread has served so far, and the bytes it
  // copied (0 when the routed-expert DMA is off; no synchronization: copies may still be running).
  int64_t expert_dma_posts() const;
  uint64_t expert_dma_bytes() const;

  // Expert parallelism (see the header comment). ep_size() is 1 without it.
  int ep_rank() const;
  int ep_size() const;
  // A step with no tokens on this rank: the step header, then every MoE layer's collectives with
  // a live count of 0, serving the other ranks' tokens. Enqueued; synchronizes only in the header.
  Status ep_empty_step();
  // This rank has no more work: it posts "done" in every step header and runs the other ranks'
  // steps as empty steps, returning once every rank has called it. Ok at once without EP.
  Status ep_idle_until_all_done();

  // Steps that ran as a graph replay / eagerly so far (tests check the graph path is taken).
  int64_t graph_steps() const { return graph_steps_; }
  // MoE combines enqueued as folded into the next qkv GEMV [TAG_MOE_DEFERRED_COMBINE] (eager steps
  // and graph captures; a replay enqueues nothing): tests check that the fold took place.
  int64_t folded_moe_combines() const { return folded_combines_; }
  int64_t eager_steps() const { return eager_steps_; }

 private:
  struct Layer;
  struct Graph;
  struct EpState;  // qwen3_moe_cuda_ep.h
  struct CacheState;  // qwen3_moe_cuda_cache.h
  struct PrefetchState;  // qwen3_moe_cuda_prefetch.h
  struct DmaState;  // qwen3_moe_cuda_dma.h
  Qwen3MoeCuda();
  Status init(const Qwen3MoeConfig& config, const Qwen3MoeCudaOptions& options);
  // [TAG_EXPERT_OFFLOAD] With a budget: plans the device memory (offload/memory_budget.h) for
  // experts packed as w13/w2, picks the resident experts per layer (offload/placement.h) and
  // allocates the one pinned region of the cold experts. Called once, before the first MoE layer.
  Status plan_offload(const moe::PackedMatrix& w13, const moe::PackedMatrix& w2);
  // The residency of model layer `l` (every expert resident without a budget).
  moe::ExpertResidency residency_for(int l);
  // Makes model layer l's MoE layers with `make(residency_for(l))` and accounts their bytes.
  Status add_moe_layer(int l, const std::function<Result<tune::MoeLayerSet>(const moe::ExpertResidency&)>& make);
  // Device bytes the runtime buffers (KV, activations, workspaces) will take, before they exist.
  uint64_t estimate_runtime_bytes(const moe::PackedMatrix& w2) const;
  // [TAG_EXPERT_STAGING] After the MoE layers exist: the cost model's choice per bucket, the two
  // device staging slots, the staged tables, the copy stream and its events.
  Status setup_staging();
  // Whether a step of `rows` (eager) stages, and the copy of the j-th staged layer into its slot.
  void issue_stage_copy(size_t j);
  Status allocate_runtime(int moe_decode_capacity);
  // [TAG_EXPERT_CACHE] (qwen3_moe_cuda_cache.cpp). setup_expert_cache: at load, after
  // setup_staging (it reads the routing buffer back); the cache, the pinned read-back, the events.
  // cache_before_step: feeds the routing of earlier steps that has arrived (event queries, never a
  // wait) and enqueues the swaps it returns. cache_after_step: enqueues the read-back of the step
  // just enqueued (`rows` live tokens).
  Status setup_expert_cache();
  // swap_experts without its checks (the cache's swaps, on experts it knows are on the right sides).
  Status move_expert(int layer, int cold, int resident);
  Status cache_before_step();
  void cache_after_step(int rows);
  // [TAG_EXPERT_PREFETCH] (qwen3_moe_cuda_prefetch.cpp). setup_expert_prefetch: at load, after
  // setup_expert_cache; the slots (reserved by plan_offload), record, cold masks, stream, events.
  // prefetch_step: whether this step of `rows` prefetches. prefetch_issue: after MoE layer i-1's
  // forward (x = resid + delta), predicts MoE layer i and copies its experts on the prefetch stream.
  // prefetch_release: before the main stream next writes resid or delta in place, it waits for the
  // prediction to have read them. prefetch_join: before MoE layer i's forward (`layer`), it waits
  // for the copy, or has the layer's GEMM2 wait for it (a down-only prefetch).
  // prefetch_restore_all: every table entry back home (before a weight update).
  Status setup_expert_prefetch();
  bool prefetch_step(int rows) const;
  void prefetch_issue(size_t i, const float* resid, const __nv_bfloat16* delta, const int32_t* num_tokens, int rows,
                      cudaStream_t s);
  void prefetch_release(cudaStream_t s);
  void prefetch_join(size_t i, moe::MoeLayerCuda& layer, cudaStream_t s);
  // PCIe bytes one prefetched expert of `m` costs: the whole expert, or its down projection.
  uint64_t prefetch_copy_bytes(const moe::MoeLayerCuda& m) const;
  void prefetch_restore_all();
  // [TAG_EXPERT_ROUTED_DMA] (qwen3_moe_cuda_dma.cpp). setup_expert_dma: at load, after
  // setup_expert_prefetch; the slots (reserved by plan_offload), record, side stream and the
  // copier (its host thread). dma_arm: before MoE layer i's forward in a small decode step: after
  // its routing the layer runs dma_copy_routed (the choice and its post, GEMM1 after the w13
  // copies' flag, GEMM2 after the w2 ones'). dma_restore: after that forward, the table entries
  // back home. dma_step: whether a decode step of `rows` copies. dma_health: the copier's failure,
  // if any (checked at every step; no synchronization).
  // Both copy paths (prefetch, routed DMA) size their slots from MoE layer 0: asserts every MoE
  // layer has its expert arrays' sizes. cold_expert_mask: [MoE layers][E], 1 where cold.
  void assert_uniform_expert_arrays() const;
  std::vector<uint8_t> cold_expert_mask() const;
  Status setup_expert_dma();
  // Why the routed copies cannot run in this process (too few hardware queues, lazy module
  // loading, too many experts), or "": plan_offload reserves no slots then.
  std::string dma_refusal() const;
  Status dma_health() const;
  bool dma_step(int rows) const;
  void dma_arm(size_t i, moe::MoeLayerCuda& layer, const int32_t* num_tokens, int rows);
  void dma_copy_routed(size_t i, moe::MoeLayerCuda& layer, const int32_t* num_tokens, int rows, cudaStream_t s);
  void dma_restore(cudaStream_t s);
  // Per MoE layer, the experts the last step copied ahead for it (empty: none; synchronizes).
  std::vector<std::vector<int>> last_step_prefetched() const;
  // Whether enqueue_layers copies each MoE layer's top-k ids into routing_capture_.
  bool copies_routing(bool decode) const { return (capture_routing_ && !decode) || cache_ != nullptr; }
  Result<void*> device_alloc(size_t bytes, uint64_t* account);
  // Synchronous host-to-device copies of staged weights into existing buffers.
  static void upload(const std::vector<uint16_t>& bf16_bits, __nv_bfloat16* dst);
  static void upload(const std::vector<float>& f32, float* dst);
  void upload_embeddings(const Qwen3MoeStagedWeights& w);
  void upload_dense(const Qwen3MoeStagedWeights::Layer& w, Layer& L);
  Status enqueue_layers(int rows, int logit_rows, bool decode, int graph_index, int max_q_len);
  // enqueue()'s step once the inputs are uploaded: eager (graph_index < 0), or the decode graph of
  // graph_index (captured after an eager run the first time, replayed after).
  Status enqueue_step(int graph_index, int T, int R, int max_q_len);
  // Expert parallelism (qwen3_moe_cuda_ep.cpp). init_ep: after init(), the communicator, the
  // header buffers and the cross-rank check of the capacities. add_ep_moe_layer(_dummy): model
  // layer l's EP layers (decode and prefill capacity, sharing weights). ep_step_header: posts
  // `mine` (tokens, or kEpRankDone) and sets the step's EP capacity; *all_done when every rank
  // posted kEpRankDone. ep_moe: layer l's EP MoE at the step's capacity.
  Status init_ep();
  Status add_ep_moe_layer(int l, const cpu::MoeLayerReference& layer);
  Status add_ep_moe_layer_dummy(int l, const cpu::MoeShape& shape, moe::KernelFormat format, int group_size,
                                uint64_t seed);
  Status ep_step_header(int32_t mine, bool* all_done);
  Status ep_moe(int l, const __nv_bfloat16* x, const int32_t* num_tokens, __nv_bfloat16* out);
  Status ep_run_empty_layers();
  Status attach_ep_layers(int l, std::unique_ptr<moe::MoeLayerEpCuda> decode);  // + prefill, bytes
  uint64_t moe_expert_bytes(int l) const;  // one expert's packed bytes in model layer l
  // The i-th MoE layer's primary MoeLayerCuda and post-attention norm weight ([H] fp32).
  const moe::MoeLayerCuda& moe_layer_at(size_t i) const;
  const float* moe_post_norm_at(size_t i) const;
  uint64_t routing_buffer_bytes() const;   // routing_capture_: every MoE layer's ids at max_tokens

  Qwen3MoeConfig config_;
  Qwen3MoeCudaOptions opt_;
  moe::KernelFormat experts_format_ = moe::KernelFormat::kBF16;
  MemoryPlan plan_;
  int max_blocks_per_seq_ = 0;
  int qkv_dim_ = 0;  // (nh + 2 nkv) hd
  int moe_decode_capacity_ = 1;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<runtime::DenseGemm> gemm_;
  std::unique_ptr<tune::MoeLayerFactory> moe_layers_;
  std::vector<Buffer> buffers_;  // every device and pinned allocation
  std::vector<Layer> layers_;
  std::vector<Graph> graphs_;    // per graph batch size (a short-context one first), captured on first use
  std::vector<DecodeGraphSlot> graph_slots_;  // graphs_'s (batch, max_context), for pick_decode_graph

  // Weights.
  __nv_bfloat16* embed_ = nullptr;    // [V, H]
  __nv_bfloat16* lm_head_ = nullptr;  // [V, H] (embed_ when tied)
  float* final_norm_ = nullptr;       // [H]
  float* inv_freq_ = nullptr;         // [hd / 2]
  // KV cache: per layer, k then v pools [num_blocks, nkv, block_size, hd] bf16.
  __nv_bfloat16* kv_ = nullptr;
  int64_t kv_pool_elems_ = 0;
  // Activations, [max_tokens] rows.
  float* x_ = nullptr;              // [T, H] fp32 residual
  // [TAG_GEMV_RMS_NORM] The residual's second buffer for steps whose input RMSNorm is folded into
  // the qkv GEMV (rows <= x_alt_rows_): that kernel reads the residual in every block, so the
  // updated one goes here and the two buffers alternate layer by layer.
  float* x_alt_ = nullptr;          // [x_alt_rows_, H]
  int x_alt_rows_ = 0;
  int fold_combine_max_rows_ = 0;   // opt_.fold_moe_combine_max_rows resolved [TAG_MOE_DEFERRED_COMBINE]
  __nv_bfloat16* h_ = nullptr;      // [T, H]
  __nv_bfloat16* y_ = nullptr;      // [T, H]
  __nv_bfloat16* qkv_ = nullptr;    // [T, qkv_dim]
  __nv_bfloat16* attn_ = nullptr;   // [T, nh hd]
  __nv_bfloat16* mlp_ = nullptr;    // [T, 2 I_dense] (dense layers only)
  __nv_bfloat16* act_ = nullptr;    // [T, I_dense]
  __nv_bfloat16* h_last_ = nullptr; // [R, H]
  float* logits_ = nullptr;         // [R, V]
  // Step inputs: device arena and its pinned host mirror, same layout ([TAG_STEP_ARENA]).
  uint8_t* arena_ = nullptr;
  uint8_t* staging_ = nullptr;
  size_t arena_bytes_ = 0;
  struct ArenaLayout {
    size_t num_seqs, num_tokens, ids, positions, slots, cu_seqlens, seq_lens, logit_rows, block_tables;
  } at_{};
  cudaEvent_t staged_ = nullptr;  // the last input copy; staging is reused after it completes
  bool staged_pending_ = false;
  int num_sms_ = 0;

  int64_t graph_steps_ = 0, eager_steps_ = 0;
  int64_t folded_combines_ = 0;

  // Expert offload.
  bool offload_planned_ = false;
  std::vector<int> moe_layer_ids_;                 // model layers that are MoE, ascending
  std::vector<std::vector<uint8_t>> resident_;     // [MoE layer][E] from the placement
  uint8_t* cold_host_ = nullptr;                   // the pinned region (host address)
  size_t cold_host_bytes_ = 0, cold_host_used_ = 0;
  uint8_t* swap_scratch_ = nullptr;                // one expert (device), for swap_experts
  int32_t* routing_capture_ = nullptr;             // [MoE layers][max_tokens * k] (set_routing_capture, the cache)
  bool capture_routing_ = false;
  uint64_t planned_staging_ = 0;                   // staging bytes the budget plan reserved
  // DMA staging [TAG_EXPERT_STAGING]: layer staged_layers_[j] copies into slot j % 2.
  cudaStream_t copy_stream_ = nullptr;
  uint8_t* stage_slot_[2] = {nullptr, nullptr};
  cudaEvent_t stage_copied_[2] = {nullptr, nullptr}, stage_done_[2] = {nullptr, nullptr};
  cudaEvent_t stage_start_ = nullptr;
  std::vector<int> staged_layers_;

  std::unique_ptr<EpState> ep_;  // expert parallelism; null without
  std::unique_ptr<CacheState> cache_;  // the dynamic expert cache; null when off
  std::unique_ptr<PrefetchState> prefetch_;  // the next-layer expert prefetch; null when off
  bool last_step_prefetched_ = false;
  std::unique_ptr<DmaState> dma_;  // routed experts by DMA; null when off
  // The routed copies' copy stream and side stream, created right after stream_ when
  // expert_dma_slots > 0 and the environment allows the copies ([TAG_CUDA_CONNECTIONS]: hardware
  // queues go to streams in turn as they are created, so these cannot share stream_'s queue however
  // many streams come later). setup_expert_dma hands them on, or frees them when it turns the
  // copies off; the destructor frees any left.
  cudaStream_t dma_streams_[2] = {nullptr, nullptr};
};

}  // namespace moebius::model

#endif  // MOEBIUS_HAS_CUDA
