#include "model/qwen3_moe_cuda.h"

#ifdef MOEBIUS_HAS_CUDA

#include <algorithm>
#include <limits>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>

#include "core/dtype.h"
#include "cpu/rope.h"
#include "model/rope_frequencies.h"
#include "formats/safetensors.h"
#include "kernels/attention.cuh"
#include "kernels/cuda_check.h"
#include "kernels/fill.cuh"
#include "kernels/gather.cuh"
#include "kernels/kv_cache.cuh"
#include "kernels/moe_route.cuh"
#include "kernels/norm.cuh"
#include "kernels/rope.cuh"
#include "kernels/swiglu.cuh"
#include "model/qwen3_moe_cpu.h"
#include "model/qwen3_moe_cuda_cache.h"
#include "model/qwen3_moe_cuda_dma.h"
#include "model/qwen3_moe_cuda_prefetch.h"
#include "model/qwen3_moe_cuda_ep.h"
#include "moe/moe_layer_cuda.h"
#include "offload/cost_model.h"
#include "offload/memory_budget.h"
#include "offload/placement.h"
#include "offload/routing_profile.h"
#include "runtime/dense_gemm.h"
#include "tune/moe_layer_set.h"

namespace moebius::model {

struct Qwen3MoeCuda::Layer {
  float* input_norm = nullptr;  // [H] fp32
  float* post_norm = nullptr;   // [H]
  float* q_norm = nullptr;      // [hd]
  float* k_norm = nullptr;      // [hd]
  __nv_bfloat16* wqkv = nullptr;  // [(nh + 2 nkv) hd, H]: q_proj, k_proj, v_proj stacked
  __nv_bfloat16* wo = nullptr;    // [H, nh hd]
  bool is_moe = false;
  tune::MoeLayerSet moe;  // one MoeLayerCuda per capacity bucket, same weights (moe_layers_)
  __nv_bfloat16* gate_up = nullptr;  // [2 I, H]: gate_proj then up_proj
  __nv_bfloat16* down = nullptr;     // [H, I]
};

struct Qwen3MoeCuda::Graph {
  int batch = 0;
  kernels::AttentionDecodePlan plan;
  void* attn_workspace = nullptr;  // the plan's split partials and merge counters (nullptr: one split)
  cudaGraphExec_t exec = nullptr;
};

namespace {

size_t align16(size_t n) { return (n + 15) / 16 * 16; }

std::vector<uint16_t> to_bf16_bits(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = float_to_bf16_bits(v[i]);
  return out;
}

std::string gib(uint64_t b) { return fmt::format("{:8.3f} GiB", static_cast<double>(b) / (1024.0 * 1024 * 1024)); }

// Whether a prefill step of `tokens` would rather stage a layer's cold experts than read them
// zero-copy (offload/cost_model.h with every expert cold; both costs scale with the cold count).
bool prefill_prefers_staging(const Qwen3MoeConfig& c, int tokens, uint64_t expert_bytes) {
  offload::ColdLayerShape s;
  s.tokens = tokens;
  s.top_k = c.num_experts_per_tok;
  s.num_experts = c.num_experts;
  s.cold_experts = c.num_experts;
  s.expert_bytes = expert_bytes;
  // The GEMM tile the layer will pick (moe_layer_cuda.cpp): prefill kernels from 12-16 tokens per
  // expert (block_m 64; the crossover depends on the format and the prefill kernel, 12 is the
  // earliest), else the decode kernel's 8.
  const int64_t avg = (int64_t{tokens} * s.top_k + s.num_experts - 1) / s.num_experts;
  s.block_m = avg >= 12 ? 64 : 8;
  return offload::cold_path_cost(s).choice == offload::ColdPath::kStaged;
}

}  // namespace

std::string format_memory_plan(const MemoryPlan& p) {
  std::string s = "memory plan (device):\n";
  s += fmt::format("  attention weights   {}\n", gib(p.attention));
  s += fmt::format("  experts ({:5})     {}  (packed weights + scales, routers)\n", p.expert_format, gib(p.experts));
  if (p.dense_mlp) s += fmt::format("  dense MLP weights   {}\n", gib(p.dense_mlp));
  s += fmt::format("  embeddings/lm_head  {}\n", gib(p.embeddings));
  s += fmt::format("  KV cache            {}  ({} tokens, bf16)\n", gib(p.kv_cache), p.kv_tokens);
  s += fmt::format("  workspace           {}\n", gib(p.workspace));
  s += fmt::format("  total               {}\n", gib(p.total()));
  if (p.budget > 0)
    s += fmt::format("  budget              {}  (--gpu-memory-budget)\n", gib(p.budget));
  if (p.total_experts > 0 && p.resident_experts < p.total_experts)
    s += fmt::format("  cold experts (host) {}  (pinned, zero-copy; {} of {} experts resident, placement {})\n",
                     gib(p.experts_host), p.resident_experts, p.total_experts, p.placement);
  if (!p.cold_paths.empty()) s += fmt::format("  cold expert path per MoE bucket (tokens): {}\n", p.cold_paths);
  if (!p.expert_cache.empty())
    s += fmt::format("  expert cache        {}{}\n", p.expert_cache,
                     p.cache_host ? fmt::format("; routing read-back {:.1f} MB pinned", static_cast<double>(p.cache_host) / 1e6)
                                  : std::string());
  if (!p.expert_prefetch.empty()) s += fmt::format("  expert prefetch     {}\n", p.expert_prefetch);
  if (!p.expert_dma.empty()) s += fmt::format("  routed expert DMA   {}\n", p.expert_dma);
  return s;
}

Qwen3MoeCuda::Qwen3MoeCuda() = default;

Qwen3MoeCuda::~Qwen3MoeCuda() {
  // [TAG_EXPERT_ROUTED_DMA] The copier's thread reads the cold homes and writes the slots: it stops
  // (and its copies finish) before the layers free them.
  if (stream_ != nullptr) (void)cudaStreamSynchronize(stream_);
  dma_.reset();
  for (cudaStream_t s : dma_streams_)
    if (s != nullptr) (void)cudaStreamDestroy(s);
  for (Graph& g : graphs_)
    if (g.exec != nullptr) (void)cudaGraphExecDestroy(g.exec);
  if (staged_ != nullptr) (void)cudaEventDestroy(staged_);
  for (cudaEvent_t e : {stage_copied_[0], stage_copied_[1], stage_done_[0], stage_done_[1], stage_start_})
    if (e != nullptr) (void)cudaEventDestroy(e);
  if (copy_stream_ != nullptr) (void)cudaStreamDestroy(copy_stream_);
  layers_.clear();  // MoE layers free their buffers before the stream goes
  if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
}

Result<void*> Qwen3MoeCuda::device_alloc(size_t bytes, uint64_t* account) {
  MOEBIUS_ASSIGN_OR_RETURN(Buffer b, Buffer::allocate(MemoryKind::kDevice, std::max<size_t>(bytes, 16)));
  void* p = b.data();
  if (account != nullptr) *account += b.size();
  buffers_.push_back(std::move(b));
  return p;
}

void Qwen3MoeCuda::upload(const std::vector<uint16_t>& bf16_bits, __nv_bfloat16* dst) {
  CUDA_CHECK(cudaMemcpy(dst, bf16_bits.data(), bf16_bits.size() * 2, cudaMemcpyHostToDevice));
}

void Qwen3MoeCuda::upload(const std::vector<float>& f32, float* dst) {
  CUDA_CHECK(cudaMemcpy(dst, f32.data(), f32.size() * sizeof(float), cudaMemcpyHostToDevice));
}

Status Qwen3MoeCuda::init(const Qwen3MoeConfig& c, const Qwen3MoeCudaOptions& options) {
  if (!cuda_available()) return Error("no CUDA device is visible").in_field("--backend");
  config_ = c;
  opt_ = options;
  Qwen3MoeCudaOptions& o = opt_;
  if (o.max_context <= 0) o.max_context = static_cast<int>(std::min<int64_t>(c.max_position_embeddings, 1 << 30));
  if (o.max_context > c.context_limit())
    return Error::format("{} exceeds the model's {} positions (max_position_embeddings, stretched by its rope "
                         "scaling)",
                         o.max_context, c.context_limit())
        .in_field("max_context");
  if (o.max_seqs < 1) return Error::format("must be >= 1, got {}", o.max_seqs).in_field("max_seqs");
  if (o.max_tokens < o.max_seqs)
    return Error::format("max_tokens {} is below max_seqs {}", o.max_tokens, o.max_seqs).in_field("max_tokens");
  if (o.max_logit_rows <= 0) o.max_logit_rows = o.max_seqs;
  if (o.max_logit_rows > o.max_tokens)
    return Error::format("{} exceeds max_tokens {}", o.max_logit_rows, o.max_tokens).in_field("max_logit_rows");
  if (o.block_size < 1 || o.block_size > 256)
    return Error::format("must be in [1, 256], got {}", o.block_size).in_field("block_size");
  max_blocks_per_seq_ = (o.max_context + o.block_size - 1) / o.block_size;
  if (o.num_blocks <= 0) {
    // max_context may be up to 2^30 tokens (config.json's max_position_embeddings).
    const int64_t blocks = int64_t{o.max_seqs} * max_blocks_per_seq_;
    if (blocks > std::numeric_limits<int32_t>::max())
      return Error::format("{} sequences of {} tokens need {} KV blocks, more than a pool holds", o.max_seqs,
                           o.max_context, blocks)
          .in_field("max_context");
    o.num_blocks = static_cast<int32_t>(blocks);
  }
  std::sort(o.graph_batches.begin(), o.graph_batches.end());
  o.graph_batches.erase(std::unique(o.graph_batches.begin(), o.graph_batches.end()), o.graph_batches.end());
  for (int b : o.graph_batches)
    if (b < 1 || b > o.max_seqs || b > o.max_logit_rows)
      return Error::format("graph batch {} is outside [1, max_seqs {}]", b, o.max_seqs).in_field("graph_batches");
  // A count in [0, max] from the environment variable `name` (unset or empty: 0).
  auto env_count = [](const char* name, int max) -> Result<int> {
    const char* v = std::getenv(name);
    if (v == nullptr || *v == '\0') return 0;
    const std::string text(v);
    if (text.size() > 2 || text.find_first_not_of("0123456789") != std::string::npos || std::stoi(text) > max)
      return Error::format("must be a count in [0, {}], got '{}'", max, text).in_field(name);
    return std::stoi(text);
  };
  if (o.fold_moe_combine_max_rows == -1) {  // [TAG_MOE_DEFERRED_COMBINE]
    MOEBIUS_ASSIGN_OR_RETURN(o.fold_moe_combine_max_rows, env_count("MOEBIUS_FOLD_MOE_COMBINE", kernels::kDenseGemvMaxM));
  }
  if (o.fold_moe_combine_max_rows < 0 || o.fold_moe_combine_max_rows > kernels::kDenseGemvMaxM)
    return Error::format("must be -1 (the environment) or in [0, {}], got {}", kernels::kDenseGemvMaxM,
                         o.fold_moe_combine_max_rows)
        .in_field("fold_moe_combine_max_rows");
  if (o.expert_dma_slots == -1) {  // [TAG_EXPERT_ROUTED_DMA]
    MOEBIUS_ASSIGN_OR_RETURN(o.expert_dma_slots, env_count("MOEBIUS_EXPERT_DMA_SLOTS", kernels::kExpertDmaMaxSlots));
  }
  if (o.expert_dma_slots < 0 || o.expert_dma_slots > kernels::kExpertDmaMaxSlots)
    return Error::format("must be -1 (the environment) or in [0, {}], got {}", kernels::kExpertDmaMaxSlots,
                         o.expert_dma_slots)
        .in_field("expert_dma_slots");
  fold_combine_max_rows_ = o.fold_moe_combine_max_rows;
  moe_decode_capacity_ = o.graph_batches.empty() ? 1 : o.graph_batches.back();
  tune::MoeLayerFactoryOptions mo;
  mo.max_decode_batch = moe_decode_capacity_;
  mo.prefill_chunk = o.max_tokens;
  mo.autotune = o.autotune;
  mo.tuner.cache_dir = o.tune_cache_dir;
  auto factory = tune::MoeLayerFactory::create(mo);
  if (!factory.ok()) return std::move(factory).error().with_context("MoE layers (--no-autotune skips the tuning)");
  moe_layers_ = std::move(factory).value();

  const int hd = c.head_dim;
  if (hd != 16 && hd != 64 && hd != 128)
    return Error::format("the CUDA attention kernels support head_dim 16, 64 and 128, not {}", hd).in_field("head_dim");
  if (c.hidden_size % 8 != 0) return Error::format("hidden_size {} is not a multiple of 8", c.hidden_size);
  if (c.num_attention_heads % c.num_key_value_heads != 0 || c.num_attention_heads / c.num_key_value_heads > 16)
    return Error::format("nh {} / nkv {}: the decode kernel needs nkv | nh and nh / nkv <= 16", c.num_attention_heads,
                         c.num_key_value_heads);
  for (int l = 0; l < c.num_hidden_layers; ++l)
    if (!c.is_moe_layer(l) && c.intermediate_size % 8 != 0)
      return Error::format("intermediate_size {} is not a multiple of 8", c.intermediate_size);
  qkv_dim_ = (c.num_attention_heads + 2 * c.num_key_value_heads) * hd;

  CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  if (o.expert_dma_slots > 0 && dma_refusal().empty())  // [TAG_EXPERT_ROUTED_DMA] next to stream_: see dma_streams_
    for (cudaStream_t& s : dma_streams_) CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CUDA_CHECK(cudaEventCreateWithFlags(&staged_, cudaEventDisableTiming));
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, dev));
  MOEBIUS_ASSIGN_OR_RETURN(gemm_, runtime::DenseGemm::create());
  plan_.workspace += gemm_->workspace_bytes();

  const int64_t H = c.hidden_size, V = c.vocab_size;
  MOEBIUS_ASSIGN_OR_RETURN(void* e, device_alloc(sizeof(__nv_bfloat16) * V * H, &plan_.embeddings));
  embed_ = static_cast<__nv_bfloat16*>(e);
  if (c.tie_word_embeddings) {
    lm_head_ = embed_;
  } else {
    MOEBIUS_ASSIGN_OR_RETURN(void* lm, device_alloc(sizeof(__nv_bfloat16) * V * H, &plan_.embeddings));
    lm_head_ = static_cast<__nv_bfloat16*>(lm);
  }
  MOEBIUS_ASSIGN_OR_RETURN(void* fn, device_alloc(sizeof(float) * H, &plan_.embeddings));
  final_norm_ = static_cast<float*>(fn);
  MOEBIUS_ASSIGN_OR_RETURN(void* inv, device_alloc(sizeof(float) * hd / 2, &plan_.workspace));
  inv_freq_ = static_cast<float*>(inv);
  const std::vector<float> inv_freq = rope_frequencies(c).inv_freq;
  CUDA_CHECK(cudaMemcpy(inv_freq_, inv_freq.data(), sizeof(float) * inv_freq.size(), cudaMemcpyHostToDevice));

  // Per-layer dense weights (the MoE layers are made by load / create_dummy).
  const int64_t q_dim = int64_t{c.num_attention_heads} * hd;
  layers_.resize(static_cast<size_t>(c.num_hidden_layers));
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    Layer& L = layers_[static_cast<size_t>(l)];
    auto fa = [&](size_t n) -> Result<float*> {
      MOEBIUS_ASSIGN_OR_RETURN(void* p, device_alloc(sizeof(float) * n, &plan_.attention));
      return static_cast<float*>(p);
    };
    MOEBIUS_ASSIGN_OR_RETURN(L.input_norm, fa(static_cast<size_t>(H)));
    MOEBIUS_ASSIGN_OR_RETURN(L.post_norm, fa(static_cast<size_t>(H)));
    MOEBIUS_ASSIGN_OR_RETURN(L.q_norm, fa(static_cast<size_t>(hd)));
    MOEBIUS_ASSIGN_OR_RETURN(L.k_norm, fa(static_cast<size_t>(hd)));
    MOEBIUS_ASSIGN_OR_RETURN(void* qkv, device_alloc(sizeof(__nv_bfloat16) * qkv_dim_ * H, &plan_.attention));
    L.wqkv = static_cast<__nv_bfloat16*>(qkv);
    MOEBIUS_ASSIGN_OR_RETURN(void* wo, device_alloc(sizeof(__nv_bfloat16) * H * q_dim, &plan_.attention));
    L.wo = static_cast<__nv_bfloat16*>(wo);
    L.is_moe = c.is_moe_layer(l);
    if (L.is_moe) moe_layer_ids_.push_back(l);
    if (!L.is_moe) {
      const int64_t I = c.intermediate_size;
      MOEBIUS_ASSIGN_OR_RETURN(void* gu, device_alloc(sizeof(__nv_bfloat16) * 2 * I * H, &plan_.dense_mlp));
      L.gate_up = static_cast<__nv_bfloat16*>(gu);
      MOEBIUS_ASSIGN_OR_RETURN(void* dn, device_alloc(sizeof(__nv_bfloat16) * H * I, &plan_.dense_mlp));
      L.down = static_cast<__nv_bfloat16*>(dn);
    }
  }
  return init_ep();
}

Status Qwen3MoeCuda::allocate_runtime(int) {
  const Qwen3MoeConfig& c = config_;
  const int64_t H = c.hidden_size, V = c.vocab_size, T = opt_.max_tokens, R = opt_.max_logit_rows;
  const int hd = c.head_dim, nkv = c.num_key_value_heads;
  // KV cache: one allocation, per layer k then v.
  kv_pool_elems_ = kernels::kv_cache_pool_elems(opt_.num_blocks, nkv, opt_.block_size, hd);
  MOEBIUS_ASSIGN_OR_RETURN(void* kv, device_alloc(sizeof(__nv_bfloat16) * 2 * kv_pool_elems_ * c.num_hidden_layers,
                                                  &plan_.kv_cache));
  kv_ = static_cast<__nv_bfloat16*>(kv);
  plan_.kv_tokens = int64_t{opt_.num_blocks} * opt_.block_size;
  // The pool starts zeroed: a bug that reads an unwritten slot reads zeros, not NaN.
  CUDA_CHECK(cudaMemset(kv_, 0, sizeof(__nv_bfloat16) * 2 * kv_pool_elems_ * c.num_hidden_layers));

  int64_t dense_I = 0;
  for (const Layer& L : layers_)
    if (!L.is_moe) dense_I = c.intermediate_size;
  auto act = [&](size_t bytes) -> Result<void*> {
    MOEBIUS_ASSIGN_OR_RETURN(void* p, device_alloc(bytes, &plan_.workspace));
    CUDA_CHECK(cudaMemset(p, 0, bytes));  // padding rows of graph buckets stay finite
    return p;
  };
  MOEBIUS_ASSIGN_OR_RETURN(void* x, act(sizeof(float) * T * H));
  x_ = static_cast<float*>(x);
  x_alt_rows_ = static_cast<int>(std::min<int64_t>(T, kernels::kDenseGemvMaxM));
  MOEBIUS_ASSIGN_OR_RETURN(void* xa, act(sizeof(float) * x_alt_rows_ * H));
  x_alt_ = static_cast<float*>(xa);
  MOEBIUS_ASSIGN_OR_RETURN(void* h, act(sizeof(__nv_bfloat16) * T * H));
  h_ = static_cast<__nv_bfloat16*>(h);
  MOEBIUS_ASSIGN_OR_RETURN(void* y, act(sizeof(__nv_bfloat16) * T * H));
  y_ = static_cast<__nv_bfloat16*>(y);
  MOEBIUS_ASSIGN_OR_RETURN(void* qkv, act(sizeof(__nv_bfloat16) * T * qkv_dim_));
  qkv_ = static_cast<__nv_bfloat16*>(qkv);
  MOEBIUS_ASSIGN_OR_RETURN(void* at, act(sizeof(__nv_bfloat16) * T * c.num_attention_heads * hd));
  attn_ = static_cast<__nv_bfloat16*>(at);
  if (dense_I > 0) {
    MOEBIUS_ASSIGN_OR_RETURN(void* m, act(sizeof(__nv_bfloat16) * T * 2 * dense_I));
    mlp_ = static_cast<__nv_bfloat16*>(m);
    MOEBIUS_ASSIGN_OR_RETURN(void* a, act(sizeof(__nv_bfloat16) * T * dense_I));
    act_ = static_cast<__nv_bfloat16*>(a);
  }
  MOEBIUS_ASSIGN_OR_RETURN(void* hl, act(sizeof(__nv_bfloat16) * R * H));
  h_last_ = static_cast<__nv_bfloat16*>(hl);
  MOEBIUS_ASSIGN_OR_RETURN(void* lg, act(sizeof(float) * R * V));
  logits_ = static_cast<float*>(lg);

  // Decode plans, one per graph batch size, each with its own workspace: the counters must stay
  // zero between launches, and another plan's layout would put its partials over them.
  // [TAG_ATTN_CLUSTER_MERGE] When a shorter context than max_context takes another plan (the
  // cluster merge where max_context's merges through the workspace, run O5: decode at 1k context
  // +6%, at 10k -3.6% with the cluster plan alone; [TAG_ATTN_PORTABLE_CLUSTER] clusters of 8 where
  // a longer context's take 16, runs V1b, W1: +2% at 1k), the batch size gets a graph planned for that
  // context, shortest first: steps whose sequences are all that short replay it.
  kernels::AttentionDims dims{c.num_attention_heads, nkv, hd, opt_.block_size, max_blocks_per_seq_};
  for (int b : opt_.graph_batches) {
    Graph g;
    g.batch = b;
    g.plan = kernels::plan_attention_decode(dims, b, opt_.max_context, num_sms_);
    std::vector<Graph> shorter;  // longest first while collected; `longer` points into it
    shorter.reserve(2);
    const Graph* longer = &g;
    for (int ctx : {kernels::attention_decode_cluster_context(dims, b, num_sms_),
                    kernels::attention_decode_portable_cluster_context(dims, b, num_sms_)}) {
      if (ctx <= 256 || ctx >= longer->plan.max_context) continue;  // 256 keys and fewer never split
      Graph s = g;
      s.plan = kernels::plan_attention_decode(dims, b, ctx, num_sms_);
      if (s.plan.cluster_merge &&
          (!longer->plan.cluster_merge || s.plan.max_splits != longer->plan.max_splits)) {
        shorter.push_back(s);
        longer = &shorter.back();
      }
    }
    for (auto s = shorter.rbegin(); s != shorter.rend(); ++s) {
      graphs_.push_back(*s);
      graph_slots_.push_back(DecodeGraphSlot{s->batch, s->plan.max_context});
    }
    if (const size_t ws = kernels::attention_decode_workspace_bytes(dims, g.plan); ws > 0) {
      MOEBIUS_ASSIGN_OR_RETURN(g.attn_workspace, device_alloc(ws, &plan_.workspace));
      kernels::init_attention_decode_workspace(g.attn_workspace, dims, g.plan, stream_);
    }
    graphs_.push_back(g);
    graph_slots_.push_back(DecodeGraphSlot{g.batch, g.plan.max_context});
  }

  // Step inputs: [TAG_STEP_ARENA] one layout for the device arena and the pinned staging area.
  size_t off = 0;
  auto take = [&](size_t ints) {
    const size_t o = off;
    off += align16(ints * sizeof(int32_t));
    return o;
  };
  at_.num_seqs = take(1);
  at_.num_tokens = take(1);
  at_.ids = take(static_cast<size_t>(T));
  at_.positions = take(static_cast<size_t>(T));
  at_.slots = take(static_cast<size_t>(T));
  at_.cu_seqlens = take(static_cast<size_t>(opt_.max_seqs) + 1);
  at_.seq_lens = take(static_cast<size_t>(opt_.max_seqs));
  at_.logit_rows = take(static_cast<size_t>(R));
  at_.block_tables = take(static_cast<size_t>(opt_.max_seqs) * max_blocks_per_seq_);  // last: copies stop early
  arena_bytes_ = off;
  MOEBIUS_ASSIGN_OR_RETURN(void* ar, act(arena_bytes_));
  arena_ = static_cast<uint8_t*>(ar);
  MOEBIUS_ASSIGN_OR_RETURN(Buffer st, Buffer::allocate(MemoryKind::kPinnedHost, arena_bytes_));
  staging_ = st.as<uint8_t>();
  std::memset(staging_, 0, arena_bytes_);
  buffers_.push_back(std::move(st));
  plan_.workspace += moe_layers_->workspace_bytes();  // shared by the layers [TAG_MOE_WORKSPACE_POOL]
  plan_.expert_format = moe::kernel_format_name(experts_format_);
  CUDA_CHECK(cudaDeviceSynchronize());
  // The plan placed the experts from an estimate of the runtime buffers; refuse at start-up rather
  // than run past the budget the user set.
  if (plan_.budget > 0 && plan_.total() > plan_.budget)
    return Error::format("the model takes {:.2f} GiB of device memory, over the budget of {:.2f} GiB (the runtime "
                         "buffers came out {:.2f} GiB larger than planned); raise the budget",
                         static_cast<double>(plan_.total()) / offload::kGiB,
                         static_cast<double>(plan_.budget) / offload::kGiB,
                         static_cast<double>(plan_.total() - plan_.budget) / offload::kGiB)
        .in_field("--gpu-memory-budget");
  return Ok{};
}

// ---------------------------------------------------------------------------------------------
// Expert offload [TAG_EXPERT_OFFLOAD]
// ---------------------------------------------------------------------------------------------

uint64_t Qwen3MoeCuda::estimate_runtime_bytes(const moe::PackedMatrix& w2) const {
  const Qwen3MoeConfig& c = config_;
  const uint64_t H = static_cast<uint64_t>(c.hidden_size), V = static_cast<uint64_t>(c.vocab_size),
                 T = static_cast<uint64_t>(opt_.max_tokens), R = static_cast<uint64_t>(opt_.max_logit_rows);
  const int hd = c.head_dim, nkv = c.num_key_value_heads;
  auto a256 = [](uint64_t n) { return (n + 255) / 256 * 256; };
  uint64_t b = 0;
  // KV cache, exactly as allocate_runtime makes it.
  b += a256(sizeof(__nv_bfloat16) * 2 * static_cast<uint64_t>(kernels::kv_cache_pool_elems(opt_.num_blocks, nkv, opt_.block_size, hd)) *
            static_cast<uint64_t>(c.num_hidden_layers));
  // Activations (x fp32, h, y, qkv, attn, dense MLP), the logit rows, the step arena.
  const uint64_t dense_I = static_cast<uint64_t>(c.intermediate_size);
  b += T * H * 4 + 2 * T * H * 2 + T * static_cast<uint64_t>(qkv_dim_) * 2 +
       T * static_cast<uint64_t>(c.num_attention_heads) * hd * 2 + T * 3 * dense_I * 2 + R * H * 2 + R * V * 4;
  b += 16 * (4 * T + 2 * static_cast<uint64_t>(opt_.max_seqs) + R + 64) +
       4 * static_cast<uint64_t>(opt_.max_seqs) * static_cast<uint64_t>(max_blocks_per_seq_);
  // Attention decode workspaces, one per graph batch.
  const kernels::AttentionDims dims{c.num_attention_heads, nkv, hd, opt_.block_size, max_blocks_per_seq_};
  for (int gb : opt_.graph_batches)
    b += kernels::attention_decode_workspace_bytes(dims, kernels::plan_attention_decode(dims, gb, opt_.max_context,
                                                                                         num_sms_));
  // MoE workspaces, one per capacity bucket (shared by the layers), bounded with block_m 128.
  const uint64_t E = static_cast<uint64_t>(c.num_experts), k = static_cast<uint64_t>(c.num_experts_per_tok);
  for (int cap : moe_layers_->buckets().sizes()) {
    const uint64_t C = static_cast<uint64_t>(cap);
    const uint64_t padded = static_cast<uint64_t>(kernels::moe_align_max_padded(cap, c.num_experts_per_tok, c.num_experts, 128));
    b += a256(C * E * 4) + 2 * a256(C * k * 4) + 2 * a256((E + 1) * 4) + a256(C * k * 4) + a256(padded * 4) +
         a256(padded / 8 * 4) + 256 + a256(padded * static_cast<uint64_t>(w2.cols_padded) * 2) + a256(C * k * H * 4) +
         2 * a256((C + 63) / 64 * 64 * 4);
  }
  b += a256(routing_buffer_bytes());  // routing_capture_ (setup_staging), made whenever an expert is cold
  return b + plan_.workspace;  // + what init already counted (the cuBLAS workspace, rope table)
}

Status Qwen3MoeCuda::plan_offload(const moe::PackedMatrix& w13, const moe::PackedMatrix& w2) {
  MOEBIUS_ASSERT(!offload_planned_);
  offload_planned_ = true;
  const Qwen3MoeConfig& c = config_;
  const int E = c.num_experts, L = static_cast<int>(moe_layer_ids_.size());
  resident_.assign(moe_layer_ids_.size(), std::vector<uint8_t>(static_cast<size_t>(E), 1));
  plan_.total_experts = int64_t{L} * E;
  plan_.resident_experts = plan_.total_experts;
  if (opt_.cold_path != "auto" && opt_.cold_path != "zero-copy" && opt_.cold_path != "staged")
    return Error::format("'{}': expected auto, zero-copy or staged", opt_.cold_path).in_field("--cold-path");
  if ((opt_.gpu_memory_budget.empty() && opt_.max_resident_experts < 0) || L == 0) return Ok{};
  offload::BudgetSpec spec;
  spec.bytes = UINT64_MAX / 4;  // no budget: only max_resident_experts limits
  if (!opt_.gpu_memory_budget.empty()) {
    MOEBIUS_ASSIGN_OR_RETURN(spec, offload::parse_gpu_memory_budget(opt_.gpu_memory_budget));
  }
  const uint64_t allocated = plan_.weights() + plan_.kv_cache + plan_.workspace;  // init's buffers so far
  uint64_t budget = spec.bytes;
  if (spec.is_auto) {
    size_t free_b = 0, total_b = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    budget = offload::auto_budget_bytes(free_b + allocated);
  }
  offload::BudgetRequest r;
  r.budget = budget;
  const uint64_t H = static_cast<uint64_t>(c.hidden_size);
  // Per MoE layer besides its experts: the bf16 router, the two address tables, and a correction
  // bias at most.
  const uint64_t router = 2 * static_cast<uint64_t>(E) * H + 2 * sizeof(kernels::ExpertMatrixPtrs) * E + 4 * E + 4 * 256;
  r.non_expert_weights = plan_.weights() + static_cast<uint64_t>(L) * router;
  r.kv_cache = sizeof(__nv_bfloat16) * 2 *
               static_cast<uint64_t>(kernels::kv_cache_pool_elems(opt_.num_blocks, c.num_key_value_heads,
                                                                   opt_.block_size, c.head_dim)) *
               static_cast<uint64_t>(c.num_hidden_layers);
  r.workspace = estimate_runtime_bytes(w2) - std::min(r.kv_cache, estimate_runtime_bytes(w2));
  r.expert_bytes = moe::expert_region_bytes(w13, w2, 1);
  // [TAG_EXPERT_PREFETCH] The prefetch's slots (setup_expert_prefetch; only when something is
  // cold, but reserved whenever asked: the plan decides what is cold).
  // [TAG_EXPERT_ROUTED_DMA] The routed experts' DMA slots likewise (setup_expert_dma).
  // An environment that refuses the copies reserves nothing for them.
  const int dma_slots = dma_refusal().empty() ? opt_.expert_dma_slots : 0;
  const uint64_t prefetch_bytes =
      opt_.expert_cache ? 0 : static_cast<uint64_t>(std::max(opt_.expert_prefetch, 0) + dma_slots) * r.expert_bytes;
  r.staging = r.expert_bytes + prefetch_bytes;  // swap_experts' scratch, the prefetch slots
  r.num_moe_layers = L;
  r.num_experts = E;
  // The plan, capped by max_resident_experts.
  auto make_plan = [&]() -> Result<offload::BudgetPlan> {
    MOEBIUS_ASSIGN_OR_RETURN(offload::BudgetPlan p, offload::plan_budget(r));
    if (opt_.max_resident_experts >= 0) {
      p.resident_total = 0;
      for (int& n : p.per_layer) {
        n = std::min(n, opt_.max_resident_experts);
        p.resident_total += n;
      }
      p.cold_total = int64_t{L} * E - p.resident_total;
    }
    return p;
  };
  MOEBIUS_ASSIGN_OR_RETURN(offload::BudgetPlan bp, make_plan());
  // Staging slots come out of the budget too, and their size depends on the cold count per layer:
  // two slots of the largest layer's cold region. Iterate to the fixed point (the cold count only
  // grows as the slots grow, and is bounded by E).
  const bool stage = opt_.max_tokens > moe_decode_capacity_ &&
                     (opt_.cold_path == "staged" ||
                      (opt_.cold_path == "auto" && prefill_prefers_staging(c, opt_.max_tokens, r.expert_bytes)));
  for (int it = 0; stage && it < 16 && !bp.all_resident(); ++it) {
    const int min_resident = *std::min_element(bp.per_layer.begin(), bp.per_layer.end());
    const uint64_t need = 2 * moe::expert_region_bytes(w13, w2, E - min_resident);
    if (need + r.expert_bytes + prefetch_bytes <= r.staging) break;
    r.staging = need + r.expert_bytes + prefetch_bytes;
    MOEBIUS_ASSIGN_OR_RETURN(bp, make_plan());
  }
  planned_staging_ = r.staging - r.expert_bytes - prefetch_bytes;
  plan_.budget = opt_.gpu_memory_budget.empty() ? 0 : budget;
  std::string placement = "uniform";
  offload::Placement pl;
  if (!opt_.placement_file.empty()) {
    MOEBIUS_ASSIGN_OR_RETURN(offload::RoutingProfile prof, offload::read_profile(opt_.placement_file));
    MOEBIUS_ASSIGN_OR_RETURN(pl, offload::place_hottest(prof, moe_layer_ids_, E, bp.per_layer, opt_.placement_file));
    placement = opt_.placement_file;
  } else {
    pl = offload::place_uniform(moe_layer_ids_, E, bp.per_layer);
  }
  resident_ = pl.resident;
  plan_.placement = placement;
  plan_.resident_experts = bp.resident_total;
  if (bp.all_resident()) return Ok{};
  // One pinned, mapped allocation for every cold expert of every layer, made now and never grown.
  size_t bytes = 0;
  for (size_t i = 0; i < resident_.size(); ++i) {
    const int cold = static_cast<int>(std::count(resident_[i].begin(), resident_[i].end(), uint8_t{0}));
    bytes += moe::expert_region_bytes(w13, w2, cold);
  }
  // The expert cache's routing read-back is pinned too (setup_expert_cache: two steps of routing).
  const uint64_t readback = opt_.expert_cache ? 2 * routing_buffer_bytes() : 0;
  MOEBIUS_TRY(offload::check_host_memory(bytes + readback, offload::host_available_bytes()));
  auto pinned = Buffer::allocate(MemoryKind::kPinnedHost, bytes);
  if (!pinned.ok())
    return Error::format("cannot allocate {:.2f} GiB of pinned host memory for the cold experts: {}",
                         static_cast<double>(bytes) / offload::kGiB, pinned.error().what())
        .in_field("--gpu-memory-budget");
  cold_host_ = pinned->as<uint8_t>();
  cold_host_bytes_ = bytes;
  buffers_.push_back(std::move(pinned).value());
  MOEBIUS_ASSIGN_OR_RETURN(void* scratch, device_alloc(r.expert_bytes, &plan_.workspace));
  swap_scratch_ = static_cast<uint8_t*>(scratch);
  return Ok{};
}

Status Qwen3MoeCuda::add_moe_layer(
    int l, const std::function<Result<tune::MoeLayerSet>(const moe::ExpertResidency&)>& make) {
  auto d = make(residency_for(l));
  if (!d.ok()) return std::move(d).error().with_context(fmt::format("layer {}", l));
  Layer& L = layers_[static_cast<size_t>(l)];
  L.moe = std::move(d).value();
  // The kernel after each MoE layer is the next layer's qkv GEMV (or its norm), which streams its
  // weights before its PDL wait: let it launch with the combine ([TAG_PDL_EARLY_TRIGGER]).
  for (size_t i = 0; i < L.moe.size(); ++i) L.moe.layer(i).set_combine_trigger_early(true);
  const moe::MoeLayerCuda& p = L.moe.primary();
  plan_.experts += p.device_weight_bytes();
  plan_.experts_host += p.cold_bytes();
  cold_host_used_ += p.cold_bytes();
  MOEBIUS_ASSERT(cold_host_used_ <= cold_host_bytes_);
  return Ok{};
}

Status Qwen3MoeCuda::setup_staging() {
  if (!offloaded()) return Ok{};
  const Qwen3MoeConfig& c = config_;
  {  // each MoE layer's routing: the PCIe byte count (set_routing_capture) and the expert cache
    MOEBIUS_ASSIGN_OR_RETURN(void* p, device_alloc(routing_buffer_bytes(), &plan_.workspace));
    routing_capture_ = static_cast<int32_t*>(p);
  }
  size_t slot_bytes = 0;
  uint64_t eb = 0;
  int max_cold = 0;
  for (int l : moe_layer_ids_) {
    const moe::MoeLayerCuda& p = layers_[static_cast<size_t>(l)].moe.primary();
    slot_bytes = std::max(slot_bytes, p.cold_bytes());
    max_cold = std::max(max_cold, p.cold_experts());
    eb = p.expert_bytes();
  }
  // The cost model per capacity bucket (the same for every layer: take the layer with the most
  // cold experts). Graph buckets always read zero-copy: their steps are decode steps.
  const tune::MoeLayerSet& set0 = layers_[static_cast<size_t>(moe_layer_ids_.front())].moe;
  std::vector<uint8_t> staged_bucket(set0.size(), 0);
  std::string report;
  for (size_t i = 0; i < set0.size(); ++i) {
    offload::ColdLayerShape s;
    s.tokens = set0.buckets().sizes()[i];
    s.top_k = c.num_experts_per_tok;
    s.num_experts = c.num_experts;
    s.cold_experts = max_cold;
    s.expert_bytes = eb;
    s.block_m = set0.layer(i).block_m();
    const offload::ColdCost cost = offload::cold_path_cost(s);
    const bool eager_only = s.tokens > moe_decode_capacity_;
    // Only with the slots the budget reserved (plan_offload).
    const bool want = opt_.cold_path == "staged" || (opt_.cold_path == "auto" && cost.choice == offload::ColdPath::kStaged);
    const bool staged = want && eager_only && 2 * slot_bytes <= planned_staging_;
    staged_bucket[i] = staged;
    report += fmt::format("{}{}:{} (zero-copy {:.0f} us, staged {:.0f} us)", i ? ", " : "", s.tokens,
                          staged ? "staged" : "zero-copy", cost.zero_copy_us, cost.staged_us);
  }
  plan_.cold_paths = report;
  if (std::find(staged_bucket.begin(), staged_bucket.end(), uint8_t{1}) == staged_bucket.end()) return Ok{};
  for (int b = 0; b < 2; ++b) {
    MOEBIUS_ASSIGN_OR_RETURN(void* p, device_alloc(slot_bytes, &plan_.workspace));
    stage_slot_[b] = static_cast<uint8_t*>(p);
    CUDA_CHECK(cudaEventCreateWithFlags(&stage_copied_[b], cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&stage_done_[b], cudaEventDisableTiming));
  }
  CUDA_CHECK(cudaEventCreateWithFlags(&stage_start_, cudaEventDisableTiming));
  CUDA_CHECK(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
  for (int l : moe_layer_ids_) {
    tune::MoeLayerSet& set = layers_[static_cast<size_t>(l)].moe;
    if (set.primary().cold_experts() == 0) continue;
    const size_t j = staged_layers_.size();
    staged_layers_.push_back(l);
    MOEBIUS_TRY(set.primary().set_staging_slot(stage_slot_[j % 2]));
    for (size_t i = 0; i < set.size(); ++i) set.layer(i).set_use_staging(staged_bucket[i] != 0);
  }
  return Ok{};
}

void Qwen3MoeCuda::issue_stage_copy(size_t j) {
  if (j >= staged_layers_.size()) return;
  const int b = static_cast<int>(j % 2);
  const moe::MoeLayerCuda& p = layers_[static_cast<size_t>(staged_layers_[j])].moe.primary();
  // The slot is free once the layer that used it last (two staged layers back, or the previous
  // step's) has run: stage_done_[b] is its latest record.
  CUDA_CHECK(cudaStreamWaitEvent(copy_stream_, stage_done_[b], 0));
  CUDA_CHECK(cudaMemcpyAsync(stage_slot_[b], p.cold_region_host(), p.cold_bytes(), cudaMemcpyHostToDevice, copy_stream_));
  CUDA_CHECK(cudaEventRecord(stage_copied_[b], copy_stream_));
}

moe::ExpertResidency Qwen3MoeCuda::residency_for(int l) {
  moe::ExpertResidency r;
  const auto it = std::find(moe_layer_ids_.begin(), moe_layer_ids_.end(), l);
  MOEBIUS_ASSERT(it != moe_layer_ids_.end() && offload_planned_);
  const std::vector<uint8_t>& m = resident_[static_cast<size_t>(it - moe_layer_ids_.begin())];
  if (std::find(m.begin(), m.end(), uint8_t{0}) == m.end()) return r;  // all resident
  r.resident = m;
  r.cold_host = cold_host_ + cold_host_used_;
  return r;
}

bool Qwen3MoeCuda::expert_resident(int layer, int e) const {
  const Layer& L = layers_.at(static_cast<size_t>(layer));
  MOEBIUS_ASSERT(L.is_moe);
  return L.moe.primary().expert_resident(e);
}

Status Qwen3MoeCuda::swap_experts(int layer, int cold, int resident) {
  if (ep_) return Error("expert offload is not supported with expert parallelism");
  if (layer < 0 || layer >= config_.num_hidden_layers || !layers_[static_cast<size_t>(layer)].is_moe)
    return Error::format("layer {} is not a MoE layer", layer);
  if (swap_scratch_ == nullptr) return Error("no expert is offloaded (no --gpu-memory-budget below the model)");
  if (cache_) return Error("the expert cache (--expert-cache) decides the residency; swap_experts is for runs without it");
  // [TAG_EXPERT_ROUTED_DMA] The copier's thread holds each cold expert's home from load on.
  if (dma_) return Error("swap_experts changes the cold experts' homes, which the routed-expert DMA (expert_dma_slots) "
                         "fixed at load; run without it");
  return move_expert(layer, cold, resident);
}

Status Qwen3MoeCuda::move_expert(int layer, int cold, int resident) {
  return layers_[static_cast<size_t>(layer)].moe.primary().swap_experts(cold, resident, swap_scratch_, stream_);
}

uint64_t Qwen3MoeCuda::last_step_cold_bytes(int rows) const {
  if (!offloaded()) return 0;
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  const int k = config_.num_experts_per_tok;
  uint64_t bytes = 0;
  std::vector<int32_t> ids(static_cast<size_t>(rows) * static_cast<size_t>(k));
  std::vector<int64_t> n(static_cast<size_t>(config_.num_experts));
  MOEBIUS_ASSERT(routing_capture_ != nullptr && rows <= opt_.max_tokens);
  const size_t per_layer = static_cast<size_t>(opt_.max_tokens) * static_cast<size_t>(k);
  // [TAG_EXPERT_PREFETCH] Experts copied ahead cross PCIe once (the copy) and are read from the device.
  const std::vector<std::vector<int>> prefetched = last_step_prefetched();
  for (size_t i = 0; i < moe_layer_ids_.size(); ++i) {
    const Layer& L = layers_[static_cast<size_t>(moe_layer_ids_[i])];
    const moe::MoeLayerCuda& m = L.moe.for_tokens(rows);
    if (m.uses_staging()) {  // the step copied the layer's whole cold region (one DMA)
      bytes += m.cold_bytes();
      continue;
    }
    CUDA_CHECK(cudaMemcpy(ids.data(), routing_capture_ + i * per_layer, ids.size() * sizeof(int32_t),
                          cudaMemcpyDeviceToHost));
    std::fill(n.begin(), n.end(), 0);
    for (int32_t e : ids)
      if (e >= 0 && e < config_.num_experts) ++n[static_cast<size_t>(e)];
    // A down-only prefetch copies the down projection; GEMM1 still reads the rest over PCIe.
    const uint64_t copied = prefetch_copy_bytes(m);
    bytes += copied * prefetched[i].size();
    std::vector<uint8_t> ahead(static_cast<size_t>(config_.num_experts), 0);
    for (int e : prefetched[i]) ahead[static_cast<size_t>(e)] = 1;
    // The GEMMs read an expert's weights once per token tile of block_m rows.
    for (int e = 0; e < config_.num_experts; ++e)
      if (n[static_cast<size_t>(e)] > 0 && !m.expert_resident(e))
        bytes += (m.expert_bytes() - (ahead[static_cast<size_t>(e)] != 0 ? copied : 0)) *
                 static_cast<uint64_t>((n[static_cast<size_t>(e)] + m.block_m() - 1) / m.block_m());
  }
  return bytes;
}

// ---------------------------------------------------------------------------------------------
// Staging: a checkpoint read and converted on the host into the device buffers' bytes
// ---------------------------------------------------------------------------------------------

namespace {

// The checkpoint a runner loads: config, quantization config and the opened safetensors.
struct OpenedCheckpoint {
  Qwen3MoeConfig config;
  QuantConfig quant;
  std::shared_ptr<const SafetensorsCheckpoint> ck;
};

Result<OpenedCheckpoint> open_checkpoint(const std::string& dir) {
  OpenedCheckpoint o;
  MOEBIUS_ASSIGN_OR_RETURN(o.config, load_qwen3_moe_config(dir));
  MOEBIUS_ASSIGN_OR_RETURN(o.quant, load_quant_config(dir));
  MOEBIUS_ASSIGN_OR_RETURN(SafetensorsCheckpoint opened, SafetensorsCheckpoint::open(dir));
  o.ck = std::make_shared<const SafetensorsCheckpoint>(std::move(opened));
  return o;
}

// The CUDA kernels have no fp32 experts: keep bf16 for checkpoints stored in another float type.
// Pre-quantized experts load as stored (load_qwen3_moe_layer refuses an --experts of another
// format); a layer mixing formats (a checkpoint excluding some of its experts) is refused by
// pack_moe_layer.
Qwen3MoeLoadOptions layer_load_options(const Qwen3MoeCudaOptions& o) {
  Qwen3MoeLoadOptions lo;
  lo.experts_format = o.experts_format;
  lo.experts_group_size = o.experts_group_size;
  lo.unquantized_experts_bf16 = true;
  lo.ep_comm = o.ep_comm;  // only this rank's experts [TAG_EP_EXPERT_OWNER]
  return lo;
}

Status stage_embeddings(const OpenedCheckpoint& k, Qwen3MoeStagedWeights& out) {
  const Qwen3MoeConfig& c = k.config;
  const int64_t V = c.vocab_size, H = c.hidden_size;
  MOEBIUS_ASSIGN_OR_RETURN(std::vector<float> e, load_float_tensor(*k.ck, "model.embed_tokens.weight", Shape{V, H}));
  out.embed = to_bf16_bits(e);
  if (!c.tie_word_embeddings) {
    MOEBIUS_ASSIGN_OR_RETURN(std::vector<float> lm, load_linear_weight(*k.ck, k.quant, "lm_head", V, H));
    out.lm_head = to_bf16_bits(lm);
  }
  MOEBIUS_ASSIGN_OR_RETURN(out.final_norm, load_float_tensor(*k.ck, "model.norm.weight", Shape{H}));
  return Ok{};
}

// Layer `l` through the CPU backend's reader (load_qwen3_moe_layer: every tensor present with its
// shape and dtype, quantized layouts checked), converted: dense weights to bf16 (q, k, v stacked;
// gate and up stacked), experts packed (pack_moe_layer).
// With expert parallelism (lo.ep_comm), a MoE layer holds only this rank's experts and is not
// packed: it goes to *ep_moe as read (MoeLayerEpCuda::create packs it).
Result<Qwen3MoeStagedWeights::Layer> stage_layer(const OpenedCheckpoint& k, int l, const Qwen3MoeLoadOptions& lo,
                                                 cpu::MoeLayerReference* ep_moe = nullptr) {
  MOEBIUS_ASSIGN_OR_RETURN(Qwen3MoeLayerWeights w, load_qwen3_moe_layer(k.ck, k.config, k.quant, l, lo));
  Qwen3MoeStagedWeights::Layer s;
  s.input_norm = std::move(w.input_norm);
  s.post_norm = std::move(w.post_norm);
  s.q_norm = std::move(w.q_norm);
  s.k_norm = std::move(w.k_norm);
  s.wqkv.reserve(w.q_proj.size() + w.k_proj.size() + w.v_proj.size());
  for (const std::vector<float>* part : {&w.q_proj, &w.k_proj, &w.v_proj})
    for (float x : *part) s.wqkv.push_back(float_to_bf16_bits(x));
  s.wo = to_bf16_bits(w.o_proj);
  if (w.is_moe && lo.ep_comm) {
    MOEBIUS_ASSERT(ep_moe != nullptr);
    *ep_moe = std::move(w.moe);
  } else if (w.is_moe) {
    auto packed = moe::pack_moe_layer(w.moe);
    if (!packed.ok()) return std::move(packed).error().with_context(fmt::format("layer {}", l));
    s.moe = std::move(packed).value();
  } else {
    s.gate_up.reserve(w.gate_proj.size() + w.up_proj.size());
    for (const std::vector<float>* part : {&w.gate_proj, &w.up_proj})
      for (float x : *part) s.gate_up.push_back(float_to_bf16_bits(x));
    s.down = to_bf16_bits(w.down_proj);
  }
  return s;
}

}  // namespace

void Qwen3MoeCuda::upload_embeddings(const Qwen3MoeStagedWeights& w) {
  upload(w.embed, embed_);
  if (!config_.tie_word_embeddings) upload(w.lm_head, lm_head_);
  upload(w.final_norm, final_norm_);
}

// [TAG_MODEL_WEIGHTS_IN_PLACE] The dense weights of layer `l` into the buffers init() made; the
// MoE weights go through MoeLayerCuda (create at load, update_weights on a reload).
void Qwen3MoeCuda::upload_dense(const Qwen3MoeStagedWeights::Layer& w, Layer& L) {
  upload(w.input_norm, L.input_norm);
  upload(w.post_norm, L.post_norm);
  upload(w.q_norm, L.q_norm);
  upload(w.k_norm, L.k_norm);
  upload(w.wqkv, L.wqkv);
  upload(w.wo, L.wo);
  if (!L.is_moe) {
    upload(w.gate_up, L.gate_up);
    upload(w.down, L.down);
  }
}

Result<std::unique_ptr<Qwen3MoeCuda>> Qwen3MoeCuda::load(const std::string& dir, const Qwen3MoeCudaOptions& options) {
  MOEBIUS_ASSIGN_OR_RETURN(OpenedCheckpoint k, open_checkpoint(dir));
  const Qwen3MoeConfig& c = k.config;
  std::unique_ptr<Qwen3MoeCuda> m(new Qwen3MoeCuda());
  MOEBIUS_TRY(m->init(c, options));
  const int total = c.num_hidden_layers + 1;
  {
    Qwen3MoeStagedWeights e;
    MOEBIUS_TRY(stage_embeddings(k, e));
    m->upload_embeddings(e);
  }
  if (m->opt_.progress) m->opt_.progress(1, total);

  // Layer by layer (one layer's host copy at a time), unlike a reload, which stages everything
  // before it overwrites anything.
  const Qwen3MoeLoadOptions lo = layer_load_options(options);
  MOEBIUS_ASSIGN_OR_RETURN(m->experts_format_,
                           moe::kernel_format_for(options.experts_format.value_or(
                               quantized_experts_format(c, k.quant).value_or(WeightFormat::kBF16))));
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    cpu::MoeLayerReference ep_moe;
    MOEBIUS_ASSIGN_OR_RETURN(Qwen3MoeStagedWeights::Layer w, stage_layer(k, l, lo, &ep_moe));
    Layer& L = m->layers_[static_cast<size_t>(l)];
    m->upload_dense(w, L);
    if (L.is_moe && m->ep_) {
      MOEBIUS_TRY(m->add_ep_moe_layer(l, ep_moe));
    } else if (w.moe) {
      if (!m->offload_planned_) MOEBIUS_TRY(m->plan_offload(w.moe->w13.at(0), w.moe->w2.at(0)));
      if (auto st = m->add_moe_layer(l, [&](const moe::ExpertResidency& r) { return m->moe_layers_->make(*w.moe, r); });
          !st.ok())
        return std::move(st).error();
    }
    if (m->opt_.progress) m->opt_.progress(l + 2, total);
  }
  MOEBIUS_TRY(m->setup_staging());
  MOEBIUS_TRY(m->setup_expert_cache());
  MOEBIUS_TRY(m->setup_expert_prefetch());
  MOEBIUS_TRY(m->setup_expert_dma());
  MOEBIUS_TRY(m->allocate_runtime(m->moe_decode_capacity_));
  return m;
}

uint64_t Qwen3MoeStagedWeights::host_bytes() const {
  auto b = [](const auto& v) { return static_cast<uint64_t>(v.size() * sizeof(v[0])); };
  uint64_t n = b(embed) + b(lm_head) + b(final_norm);
  for (const Layer& l : layers) {
    n += b(l.input_norm) + b(l.post_norm) + b(l.q_norm) + b(l.k_norm) + b(l.wqkv) + b(l.wo) + b(l.gate_up) +
         b(l.down);
    if (l.moe) {
      n += b(l.moe->router);
      for (const moe::PackedMatrix& p : l.moe->w13) n += p.weight.size() + p.scales.size();
      for (const moe::PackedMatrix& p : l.moe->w2) n += p.weight.size() + p.scales.size();
    }
  }
  return n;
}

Result<std::unique_ptr<Qwen3MoeStagedWeights>> Qwen3MoeCuda::stage_weights(const std::string& dir) const {
  if (ep_)
    return Error("weight updates are not supported with expert parallelism yet (every rank would have to reload "
                 "its experts in the same step)");
  // The config first: a checkpoint of another geometry is named as such, not by its first
  // misshapen tensor.
  MOEBIUS_ASSIGN_OR_RETURN(OpenedCheckpoint k, open_checkpoint(dir));
  if (auto st = check_same_config(config_, k.config); !st.ok())
    return std::move(st).error().in_file((std::filesystem::path(dir) / "config.json").string());
  auto w = std::make_unique<Qwen3MoeStagedWeights>();
  w->source = dir;
  MOEBIUS_TRY(stage_embeddings(k, *w));
  const Qwen3MoeLoadOptions lo = layer_load_options(opt_);
  for (int l = 0; l < config_.num_hidden_layers; ++l) {
    MOEBIUS_ASSIGN_OR_RETURN(Qwen3MoeStagedWeights::Layer s, stage_layer(k, l, lo));
    const Layer& L = layers_[static_cast<size_t>(l)];
    MOEBIUS_ASSERT(s.moe.has_value() == L.is_moe);  // the configs are identical
    if (s.moe) {
      if (auto st = L.moe.primary().check_compatible(*s.moe); !st.ok())
        return std::move(st).error().with_context(fmt::format("layer {}", l)).in_file(dir);
    }
    w->layers.push_back(std::move(s));
  }
  return w;
}

void Qwen3MoeCuda::commit_weights(const Qwen3MoeStagedWeights& w) {
  MOEBIUS_ASSERT(w.layers.size() == layers_.size(), "commit_weights of weights staged for another model");
  // Whatever was enqueued (a bench may enqueue without waiting) finishes on the old weights.
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  prefetch_restore_all();  // [TAG_EXPERT_PREFETCH] no table entry may point at a copy of old weights
  upload_embeddings(w);
  for (size_t l = 0; l < layers_.size(); ++l) {
    Layer& L = layers_[l];
    upload_dense(w.layers[l], L);
    if (L.is_moe) {
      const Status st = L.moe.primary().update_weights(*w.layers[l].moe);  // the other buckets share these weights
      MOEBIUS_ASSERT(st.ok(), "layer {}: a staged MoE layer no longer fits: {}", l, st.error().what());
    }
  }
  // cudaMemcpy from pageable memory may return before its DMA lands, and stream_ does not wait for
  // the legacy stream: every copy is done before the next step is enqueued.
  CUDA_CHECK(cudaDeviceSynchronize());
}

Result<std::unique_ptr<Qwen3MoeCuda>> Qwen3MoeCuda::open(const WeightSource& source,
                                                         const Qwen3MoeCudaOptions& options) {
  MOEBIUS_TRY(validate_weight_source(source));
  if (!source.dummy()) return load(source.model_dir, options);
  MOEBIUS_ASSIGN_OR_RETURN(Qwen3MoeConfig config, weight_source_config(source));
  MOEBIUS_ASSIGN_OR_RETURN(moe::KernelFormat experts,
                           moe::kernel_format_for(options.experts_format.value_or(WeightFormat::kBF16)));
  return create_dummy(config, experts, options);
}

Result<std::unique_ptr<Qwen3MoeCuda>> Qwen3MoeCuda::create_dummy(const Qwen3MoeConfig& c, moe::KernelFormat experts,
                                                                 const Qwen3MoeCudaOptions& options) {
  std::unique_ptr<Qwen3MoeCuda> m(new Qwen3MoeCuda());
  MOEBIUS_TRY(m->init(c, options));
  m->experts_format_ = experts;
  const int total = c.num_hidden_layers + 1;
  const int64_t V = c.vocab_size, H = c.hidden_size, hd = c.head_dim;
  uint64_t seed = options.seed;
  cudaStream_t s = m->stream_;
  // Uniform weights with about unit-variance outputs for unit-RMS inputs: scale sqrt(3 / K).
  auto scale_for = [](int64_t K) { return static_cast<float>(std::sqrt(3.0 / static_cast<double>(K))); };
  kernels::launch_fill_random_bf16(m->embed_, static_cast<size_t>(V * H), 1.0f, seed++, s);
  if (!c.tie_word_embeddings)
    kernels::launch_fill_random_bf16(m->lm_head_, static_cast<size_t>(V * H), scale_for(H), seed++, s);
  const std::vector<float> ones(static_cast<size_t>(std::max(H, hd)), 1.0f);
  CUDA_CHECK(cudaMemcpy(m->final_norm_, ones.data(), sizeof(float) * H, cudaMemcpyHostToDevice));
  // [TAG_ROPE_ATTENTION_FACTOR] the q/k norms carry YaRN's attention factor (1 otherwise).
  const std::vector<float> qk_norm(static_cast<size_t>(hd), rope_attention_factor(c));
  if (m->opt_.progress) m->opt_.progress(1, total);
  const int64_t q_dim = int64_t{c.num_attention_heads} * hd;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    Layer& L = m->layers_[static_cast<size_t>(l)];
    CUDA_CHECK(cudaMemcpy(L.input_norm, ones.data(), sizeof(float) * H, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(L.post_norm, ones.data(), sizeof(float) * H, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(L.q_norm, qk_norm.data(), sizeof(float) * hd, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(L.k_norm, qk_norm.data(), sizeof(float) * hd, cudaMemcpyHostToDevice));
    kernels::launch_fill_random_bf16(L.wqkv, static_cast<size_t>(m->qkv_dim_ * H), scale_for(H), seed++, s);
    kernels::launch_fill_random_bf16(L.wo, static_cast<size_t>(H * q_dim), scale_for(q_dim), seed++, s);
    if (L.is_moe) {
      const cpu::MoeShape shape{H, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok};
      if (m->ep_) {
        MOEBIUS_TRY(m->add_ep_moe_layer_dummy(l, shape, experts, options.experts_group_size, seed++));
        if (m->opt_.progress) m->opt_.progress(l + 2, total);
        continue;
      }
      if (!m->offload_planned_) {
        const auto [w13, w2] = moe::dummy_expert_shapes(shape, experts, options.experts_group_size);
        MOEBIUS_TRY(m->plan_offload(w13, w2));
      }
      const uint64_t layer_seed = seed++;
      if (auto st = m->add_moe_layer(l, [&](const moe::ExpertResidency& r) {
            return m->moe_layers_->make_dummy(shape, experts, options.experts_group_size, layer_seed, r);
          });
          !st.ok())
        return std::move(st).error();
    } else {
      const int64_t I = c.intermediate_size;
      kernels::launch_fill_random_bf16(L.gate_up, static_cast<size_t>(2 * I * H), scale_for(H), seed++, s);
      kernels::launch_fill_random_bf16(L.down, static_cast<size_t>(H * I), scale_for(I), seed++, s);
    }
    if (m->opt_.progress) m->opt_.progress(l + 2, total);
  }
  CUDA_CHECK(cudaStreamSynchronize(s));
  MOEBIUS_TRY(m->setup_staging());
  MOEBIUS_TRY(m->setup_expert_cache());
  MOEBIUS_TRY(m->setup_expert_prefetch());
  MOEBIUS_TRY(m->setup_expert_dma());
  MOEBIUS_TRY(m->allocate_runtime(m->moe_decode_capacity_));
  return m;
}

Result<StepBatch> Qwen3MoeCuda::make_batch(std::span<const SequenceStep> seqs, bool all_logits) const {
  return make_step_batch(seqs, opt_.block_size, max_blocks_per_seq_, opt_.num_blocks, all_logits);
}

uint64_t Qwen3MoeCuda::decode_weight_bytes() const {
  const Qwen3MoeConfig& c = config_;
  const uint64_t H = static_cast<uint64_t>(c.hidden_size), V = static_cast<uint64_t>(c.vocab_size),
                 hd = static_cast<uint64_t>(c.head_dim), q_dim = static_cast<uint64_t>(c.num_attention_heads) * hd;
  uint64_t bytes = 2 * H;          // one embedding row
  bytes += 4 * H + 2 * V * H;      // final norm, lm_head
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& L = layers_[l];
    bytes += 4 * (2 * H + 2 * hd) + 2 * (static_cast<uint64_t>(qkv_dim_) * H + H * q_dim);
    if (L.is_moe) {
      bytes += 2 * static_cast<uint64_t>(c.num_experts) * H;
      bytes += static_cast<uint64_t>(c.num_experts_per_tok) * moe_expert_bytes(static_cast<int>(l));
    } else {
      bytes += 2 * 3 * static_cast<uint64_t>(c.intermediate_size) * H;
    }
  }
  return bytes;
}

uint64_t Qwen3MoeCuda::moe_expert_bytes(int l) const {
#ifdef MOEBIUS_HAS_NCCL
  if (ep_) return ep_->decode[static_cast<size_t>(l)]->local().expert_bytes();  // one of this rank's
#endif
  return layers_[static_cast<size_t>(l)].moe.expert_bytes();
}

const moe::MoeLayerCuda& Qwen3MoeCuda::moe_layer_at(size_t i) const {
  return layers_[static_cast<size_t>(moe_layer_ids_.at(i))].moe.primary();
}

const float* Qwen3MoeCuda::moe_post_norm_at(size_t i) const {
  return layers_[static_cast<size_t>(moe_layer_ids_.at(i))].post_norm;
}

uint64_t Qwen3MoeCuda::kv_bytes_per_context_token() const {
  return static_cast<uint64_t>(config_.num_hidden_layers) * 2 * config_.num_key_value_heads * config_.head_dim * 2;
}

Status Qwen3MoeCuda::enqueue_layers(int rows, int logit_rows, bool decode, int graph_index, int max_q_len) {
  const Qwen3MoeConfig& c = config_;
  const int H = static_cast<int>(c.hidden_size), V = static_cast<int>(c.vocab_size), hd = c.head_dim,
            nh = c.num_attention_heads, nkv = c.num_key_value_heads, q_dim = nh * hd;
  const float eps = c.rms_norm_eps;
  cudaStream_t s = stream_;
  auto in = [this](size_t off) { return reinterpret_cast<const int32_t*>(arena_ + off); };
  const int32_t* num_seqs = in(at_.num_seqs);
  const int32_t* num_tokens = in(at_.num_tokens);
  const kernels::AttentionDims dims{nh, nkv, hd, opt_.block_size, max_blocks_per_seq_};
  // The live sequences are at most the rows (decode: one row per sequence; prefill: S <= T).
  const int max_num_seqs = std::min(rows, opt_.max_seqs);

  kernels::launch_embedding(embed_, c.vocab_size, in(at_.ids), rows, H, x_, s);
  // [TAG_EXPERT_STAGING] An eager step whose MoE bucket stages: the copy stream DMAs the staged
  // layers' cold regions into the two slots, two layers ahead, ordered after everything already on
  // the stream (a residency swap rewrites the regions) and before each layer's MoE by events.
  const bool staging = !decode && !staged_layers_.empty() &&
                       layers_[static_cast<size_t>(staged_layers_.front())].moe.for_tokens(rows).uses_staging();
  size_t staged_j = 0;
  int moe_index = 0;
  // [TAG_EXPERT_PREFETCH] Small steps copy the next MoE layer's predicted cold experts ahead.
  const bool prefetching = !staging && prefetch_step(rows);
  last_step_prefetched_ = prefetching;
  // [TAG_EXPERT_ROUTED_DMA] Small decode steps copy the routed cold experts by the copy engines.
  const bool dma = decode && dma_step(rows);
  if (staging) {
    CUDA_CHECK(cudaEventRecord(stage_start_, s));
    CUDA_CHECK(cudaStreamWaitEvent(copy_stream_, stage_start_, 0));
    issue_stage_copy(0);
    issue_stage_copy(1);
  }
  float* resid = x_;  // the residual stream: x_, or x_alt_ after a folded norm ([TAG_GEMV_RMS_NORM])
  static const bool fold_norm = [] {  // MOEBIUS_FUSE_QKV_NORM=0 turns the fold off (A/B runs)
    const char* v = std::getenv("MOEBIUS_FUSE_QKV_NORM");
    return !(v != nullptr && v[0] == '0' && v[1] == '\0');
  }();
  auto folds_input_norm = [&](int l) {
    return fold_norm && rows <= x_alt_rows_ &&
           gemm_->fuses_rms_norm(layers_[static_cast<size_t>(l)].wqkv, rows, qkv_dim_, H);
  };
  // [TAG_MOE_DEFERRED_COMBINE] A MoE layer's combine left to the next layer's qkv GEMV, whose folded
  // norm forms the same bf16 rows from GEMM2's output: one kernel less per MoE layer.
  kernels::MoeCombineSource deferred;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    Layer& L = layers_[static_cast<size_t>(l)];
    __nv_bfloat16* kc = kv_ + 2 * kv_pool_elems_ * l;
    __nv_bfloat16* vc = kc + kv_pool_elems_;
    const __nv_bfloat16* delta = l == 0 ? nullptr : y_;
    if (folds_input_norm(l)) {
      // [TAG_GEMV_RMS_NORM] The input norm inside the qkv GEMV (decode-sized steps): one kernel
      // less per layer. The updated residual goes to the other buffer (every block reads this one).
      float* next = delta == nullptr ? nullptr : (resid == x_ ? x_alt_ : x_);
      kernels::DenseGemvRmsNorm norm{resid, delta, L.input_norm, eps, next};
      if (deferred.y != nullptr) {
        norm.delta = nullptr;
        norm.combine = deferred;
        deferred = {};
      }
      gemm_->linear_rms_norm(norm, L.wqkv, rows, qkv_dim_, H, qkv_, qkv_dim_, s);
      if (next != nullptr) resid = next;
    } else {
      MOEBIUS_ASSERT(deferred.y == nullptr, "a deferred MoE combine needs the next layer's folded norm");
      if (prefetching) prefetch_release(s);  // the norm adds into the residual the prediction reads
      kernels::launch_add_rms_norm<float, float>(resid, delta, L.input_norm, rows, H, eps, h_, s);
      gemm_->linear(h_, H, L.wqkv, rows, qkv_dim_, H, qkv_, qkv_dim_, s);
    }
    if (decode) {  // QK-norm, RoPE and the K/V write are the decode kernel's prologue
      const Graph& g = graphs_[static_cast<size_t>(graph_index)];
      const kernels::AttentionDecodeToken token{qkv_,    qkv_dim_, qkv_ + q_dim, qkv_dim_, qkv_ + q_dim + nkv * hd,
                                                qkv_dim_, L.q_norm, L.k_norm,     inv_freq_, eps};
      kernels::launch_attention_decode(token, in(at_.seq_lens), num_seqs, kc, vc, in(at_.block_tables), dims, g.plan,
                                       g.attn_workspace, attn_, s);
    } else {
      kernels::launch_qk_norm_rope_kv(qkv_, qkv_dim_, qkv_ + q_dim, qkv_dim_, qkv_ + q_dim + nkv * hd, qkv_dim_,
                                      L.q_norm, L.k_norm, in(at_.positions), inv_freq_, in(at_.slots), kc, vc, rows,
                                      nh, nkv, hd, opt_.block_size, eps, s);
      kernels::launch_attention_prefill(qkv_, qkv_dim_, in(at_.cu_seqlens), in(at_.seq_lens), num_seqs, kc, vc,
                                        in(at_.block_tables), dims, max_num_seqs, max_q_len, attn_, s);
    }
    if (prefetching) prefetch_release(s);  // the o GEMV overwrites the MoE output the prediction reads
    gemm_->linear(attn_, q_dim, L.wo, rows, H, q_dim, y_, H, s);
    kernels::launch_add_rms_norm<float, float>(resid, y_, L.post_norm, rows, H, eps, h_, s);
    if (L.is_moe && ep_) {
      MOEBIUS_TRY(ep_moe(l, h_, num_tokens, y_));  // a collective: every rank, same capacity
    } else if (L.is_moe) {
      moe::MoeLayerCuda& moe_layer = L.moe.for_tokens(rows);  // the smallest bucket >= rows
      const bool staged = staging && moe_layer.uses_staging();
      if (staged) CUDA_CHECK(cudaStreamWaitEvent(s, stage_copied_[staged_j % 2], 0));
      if (prefetching) prefetch_join(static_cast<size_t>(moe_index), moe_layer, s);
      if (dma) dma_arm(static_cast<size_t>(moe_index), moe_layer, num_tokens, rows);
      const __nv_bfloat16* moe_out = nullptr;  // the MoE output in y_, if not deferred
      if (rows <= fold_combine_max_rows_ && l + 1 < c.num_hidden_layers && folds_input_norm(l + 1) &&
          moe_layer.defers_combine(h_)) {
        deferred = moe_layer.forward_deferring_combine(h_, num_tokens, s);
        ++folded_combines_;
      } else {
        moe_layer.forward(h_, num_tokens, y_, s);
        moe_out = y_;
      }
      if (dma) dma_restore(s);  // before the next prediction forks off the stream
      // Eager steps for the routing capture (set_routing_capture turns graphs off); every step, graph
      // replays included, for the expert cache [TAG_EXPERT_CACHE] (qwen3_moe_cuda_cache.h: the layers
      // share topk_ids, so each layer's ids are copied while they are current).
      if (copies_routing(decode))
        CUDA_CHECK(cudaMemcpyAsync(routing_capture_ + static_cast<size_t>(moe_index) * opt_.max_tokens *
                                                          static_cast<size_t>(c.num_experts_per_tok),
                                   moe_layer.topk_ids(), sizeof(int32_t) * static_cast<size_t>(rows) *
                                                             static_cast<size_t>(c.num_experts_per_tok),
                                   cudaMemcpyDeviceToDevice, s));
      // The next MoE layer's prediction reads the residual after this one (resid + its output).
      if (prefetching && static_cast<size_t>(moe_index) + 1 < moe_layer_ids_.size())
        prefetch_issue(static_cast<size_t>(moe_index) + 1, resid, moe_out, num_tokens, rows, s);
      ++moe_index;
      if (staged) {
        CUDA_CHECK(cudaEventRecord(stage_done_[staged_j % 2], s));
        issue_stage_copy(staged_j + 2);
        ++staged_j;
      }
    } else {
      const int I = static_cast<int>(c.intermediate_size);
      gemm_->linear(h_, H, L.gate_up, rows, 2 * I, H, mlp_, 2 * I, s);
      kernels::launch_swiglu(mlp_, rows, I, act_, s);
      gemm_->linear(act_, I, L.down, rows, H, I, y_, H, s);
    }
  }
  if (prefetching) prefetch_release(s);
  kernels::launch_add_rms_norm<float, float>(resid, y_, final_norm_, rows, H, eps, h_, s);
  if (decode) {
    // A decode graph's logit rows are its rows in order (one token per sequence; padding rows'
    // logits are computed and never read), so the lm_head reads h itself: one kernel less per
    // token. [TAG_DECODE_GRAPH_LOGIT_ROWS]
    gemm_->linear(h_, H, lm_head_, rows, V, H, logits_, V, s);
  } else {
    kernels::launch_gather_rows(h_, H, in(at_.logit_rows), logit_rows, H, h_last_, s);
    gemm_->linear(h_last_, H, lm_head_, logit_rows, V, H, logits_, V, s);
  }
  return Ok{};
}

Status Qwen3MoeCuda::check_batch(const StepBatch& in_batch) const {
  const Qwen3MoeConfig& c = config_;
  const int T = in_batch.num_tokens, S = in_batch.num_seqs, R = static_cast<int>(in_batch.logit_rows.size());
  if (in_batch.block_size != opt_.block_size || in_batch.max_blocks_per_seq != max_blocks_per_seq_)
    return Error("the step batch was made for another cache geometry (use make_batch)");
  if (T < 1 || T > opt_.max_tokens)
    return Error::format("a step carries {} tokens; this runner holds 1 to {}", T, opt_.max_tokens);
  if (S < 1 || S > opt_.max_seqs)
    return Error::format("a step carries {} sequences; this runner holds 1 to {}", S, opt_.max_seqs);
  if (R < 1 || R > opt_.max_logit_rows)
    return Error::format("a step asks for {} logit rows; this runner holds 1 to {}", R, opt_.max_logit_rows);
  if (in_batch.max_seq_len > opt_.max_context)
    return Error::format("a sequence reaches {} tokens; this runner's context is {}", in_batch.max_seq_len,
                         opt_.max_context);
  for (int t = 0; t < T; ++t)
    if (in_batch.ids[static_cast<size_t>(t)] < 0 || in_batch.ids[static_cast<size_t>(t)] >= c.vocab_size)
      return Error::format("token {} is id {}, outside the vocabulary [0, {})", t, in_batch.ids[static_cast<size_t>(t)],
                           c.vocab_size);
  return Ok{};
}

Status Qwen3MoeCuda::enqueue(const StepBatch& in_batch) {
  const int T = in_batch.num_tokens, S = in_batch.num_seqs, R = static_cast<int>(in_batch.logit_rows.size());
  MOEBIUS_TRY(check_batch(in_batch));
  // [TAG_EXPERT_ROUTED_DMA] A copier failure in an earlier step (seen without a sync) stops here.
  MOEBIUS_TRY(dma_health());

  // Expert parallelism: the step header (every rank's token count) picks the EP layers' capacity
  // for all ranks; a graph holds the decode capacity's, so a step at the prefill capacity (another
  // rank prefills) runs eagerly.
  bool ep_decode_capacity = true;
  if (ep_) {
    bool all_done = false;
    MOEBIUS_TRY(ep_step_header(T, &all_done));
    ep_decode_capacity = ep_->step_capacity == ep_->decode_capacity;
  }
  // A decode step whose logits are exactly one per sequence may run as a graph of B >= S rows
  // (its logit rows are then 0..S-1: [TAG_DECODE_GRAPH_LOGIT_ROWS]).
  // The first graph of at least S rows whose attention plan covers the longest live context
  // (a batch size's short-context graph comes before its full one).
  int graph_index = -1;
  if (in_batch.is_decode() && T == S && R == S && !capture_routing_ && ep_decode_capacity)
    graph_index = pick_decode_graph(graph_slots_, S, in_batch.max_seq_len);
  StepBatch padded;
  const StepBatch* b = &in_batch;
  if (graph_index >= 0 && graphs_[static_cast<size_t>(graph_index)].batch > S) {
    padded = in_batch;
    padded.pad_decode_to(graphs_[static_cast<size_t>(graph_index)].batch);
    b = &padded;
  }

  // Pack the inputs ([TAG_STEP_ARENA]); first wait until the previous copy has read the staging area.
  if (staged_pending_) CUDA_CHECK(cudaEventSynchronize(staged_));
  // [TAG_EXPERT_CACHE] The routing of earlier steps that has arrived (event queries, no wait) goes
  // to the cache; its swaps are enqueued here, before this step's forward.
  if (cache_) MOEBIUS_TRY(cache_before_step());
  auto put = [this](size_t off, const std::vector<int32_t>& v) {
    std::memcpy(staging_ + off, v.data(), v.size() * sizeof(int32_t));
  };
  const int32_t counts[2] = {S, T};
  std::memcpy(staging_ + at_.num_seqs, &counts[0], 4);
  std::memcpy(staging_ + at_.num_tokens, &counts[1], 4);
  put(at_.ids, b->ids);
  put(at_.positions, b->positions);
  put(at_.slots, b->slot_mapping);
  put(at_.cu_seqlens, b->cu_seqlens);
  put(at_.seq_lens, b->seq_lens);
  put(at_.logit_rows, b->logit_rows);
  put(at_.block_tables, b->block_tables);
  const size_t bytes = at_.block_tables + b->block_tables.size() * sizeof(int32_t);
  // [TAG_ATTN_DECODE_PREWAIT] Uploaded before the step's first kernel and never written by one:
  // the decode attention kernel reads seq_lens and the block tables before its PDL wait.
  CUDA_CHECK(cudaMemcpyAsync(arena_, staging_, bytes, cudaMemcpyHostToDevice, stream_));
  CUDA_CHECK(cudaEventRecord(staged_, stream_));
  staged_pending_ = true;

  MOEBIUS_TRY(enqueue_step(graph_index, T, R, in_batch.max_q_len));
  if (cache_) cache_after_step(T);  // the routing of the T live rows, read back asynchronously
  return Ok{};
}

Status Qwen3MoeCuda::enqueue_step(int graph_index, int T, int R, int max_q_len) {
  if (graph_index < 0) {
    MOEBIUS_TRY(enqueue_layers(T, R, /*decode=*/false, -1, max_q_len));
    ++eager_steps_;
    return Ok{};
  }
  Graph& g = graphs_[static_cast<size_t>(graph_index)];
  if (g.exec == nullptr) {
    // First step of this size: run it eagerly (this also loads every kernel and lets cuBLAS pick
    // its algorithms outside capture), then capture the same enqueue for the next steps.
    MOEBIUS_TRY(enqueue_layers(g.batch, g.batch, /*decode=*/true, graph_index, 1));
    ++eager_steps_;
    // [TAG_EXPERT_ROUTED_DMA] Capture and instantiate with the GPU idle: in run Z39b (eager
    // loading on) the eager step's routed copies stalled from its ~25th MoE layer of 94, about when
    // the host had captured the graph and was instantiating it, and never on the small test models,
    // whose eager step ends first; with this wait (Z40) they no longer stall. Once per step size.
    if (dma_) CUDA_CHECK(cudaStreamSynchronize(stream_));
    cudaGraph_t graph = nullptr;
    // With EP the NCCL calls are captured too (recorded, not run: the other ranks see one step).
    CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    const Status captured = enqueue_layers(g.batch, g.batch, /*decode=*/true, graph_index, 1);
    CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
    if (!captured.ok()) {
      CUDA_CHECK(cudaGraphDestroy(graph));
      return captured;
    }
    // Node priorities: the expert prefetch's copy runs at the greatest one beside the step's
    // kernels ([TAG_EXPERT_PREFETCH]); without the flag a graph ignores them (run Z31). Only then:
    // every other node has the default priority.
    CUDA_CHECK(cudaGraphInstantiate(&g.exec, graph, prefetch_ ? cudaGraphInstantiateFlagUseNodePriority : 0));
    CUDA_CHECK(cudaGraphDestroy(graph));
    return Ok{};
  }
  CUDA_CHECK(cudaGraphLaunch(g.exec, stream_));
  ++graph_steps_;
  return Ok{};
}

Status Qwen3MoeCuda::forward(const StepBatch& batch, float* logits) {
  MOEBIUS_TRY(enqueue(batch));
  const size_t n = batch.logit_rows.size() * static_cast<size_t>(config_.vocab_size);
  CUDA_CHECK(cudaMemcpyAsync(logits, logits_, n * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  return dma_health();  // these logits are invalid if the routed copies failed during the step
}

}  // namespace moebius::model

#endif  // MOEBIUS_HAS_CUDA
