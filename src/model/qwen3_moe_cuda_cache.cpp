// Qwen3MoeCuda's dynamic expert cache [TAG_EXPERT_CACHE]: the routing read back one step late and
// the swaps it decides (qwen3_moe_cuda_cache.h has the design and why).
#include "model/qwen3_moe_cuda_cache.h"

#ifdef MOEBIUS_HAS_CUDA

#include <algorithm>
#include <span>

#include <fmt/format.h>

#include "kernels/cuda_check.h"

namespace moebius::model {

Qwen3MoeCuda::CacheState::~CacheState() {
  for (Readback& r : slots)
    if (r.ready != nullptr) (void)cudaEventDestroy(r.ready);
}

offload::ModelCacheStats Qwen3MoeCuda::expert_cache_stats() const {
  return cache_ ? cache_->cache.stats() : offload::ModelCacheStats{};
}

uint64_t Qwen3MoeCuda::routing_buffer_bytes() const {
  return moe_layer_ids_.size() * static_cast<uint64_t>(opt_.max_tokens) *
         static_cast<uint64_t>(config_.num_experts_per_tok) * sizeof(int32_t);
}

Status Qwen3MoeCuda::setup_expert_cache() {
  if (!opt_.expert_cache) return Ok{};
  const offload::CacheOptions& o = *opt_.expert_cache;
  MOEBIUS_ASSERT(!ep_);  // init_ep refuses expert offload and the cache together with EP
  if (!offloaded()) {  // the budget holds every expert: nothing is cold, nothing to cache
    plan_.expert_cache = fmt::format("off: every expert is resident (--expert-cache {} has nothing to do)",
                                     offload::cache_policy_name(o.policy));
    return Ok{};
  }
  MOEBIUS_ASSERT(routing_capture_ != nullptr && swap_scratch_ != nullptr);  // setup_staging, plan_offload
  const int E = config_.num_experts;
  std::vector<std::vector<uint8_t>> resident(moe_layer_ids_.size(), std::vector<uint8_t>(static_cast<size_t>(E)));
  for (size_t i = 0; i < moe_layer_ids_.size(); ++i)
    for (int e = 0; e < E; ++e) resident[i][static_cast<size_t>(e)] = expert_resident(moe_layer_ids_[i], e) ? 1 : 0;
  const uint64_t expert_bytes = moe_expert_bytes(moe_layer_ids_.front());
  auto made = offload::ModelExpertCache::create(resident, o, 2 * expert_bytes);
  if (!made.ok()) return std::move(made).error().with_context("--expert-cache");
  auto state = std::make_unique<CacheState>(std::move(made).value());
  state->stride = static_cast<size_t>(opt_.max_tokens) * static_cast<size_t>(config_.num_experts_per_tok);
  // Pinned once, here, for two steps of every layer at full capacity (a prefill chunk's routing is
  // fed too); never grown.
  const uint64_t per_slot = routing_buffer_bytes();
  auto pinned = Buffer::allocate(MemoryKind::kPinnedHost, 2 * per_slot);
  if (!pinned.ok())
    return Error::format("cannot allocate {:.1f} MB of pinned host memory for the routing read-back: {}",
                         2.0 * static_cast<double>(per_slot) / 1e6, pinned.error().what())
        .in_field("--expert-cache");
  for (int s = 0; s < 2; ++s) {
    CacheState::Readback& r = state->slots[s];
    r.ids = pinned->as<int32_t>() + static_cast<size_t>(s) * per_slot / sizeof(int32_t);
    r.ran_with.assign(moe_layer_ids_.size() * static_cast<size_t>(E), 0);
    CUDA_CHECK(cudaEventCreateWithFlags(&r.ready, cudaEventDisableTiming));
  }
  plan_.cache_host = pinned->size();
  buffers_.push_back(std::move(pinned).value());
  plan_.expert_cache = fmt::format("{}{}, at most {} swaps per MoE layer per step ({:.2f} MB over PCIe each)",
                                   offload::cache_policy_name(o.policy),
                                   o.policy == offload::CachePolicy::kFreqDecay ? fmt::format(" (decay {})", o.decay)
                                                                               : std::string(),
                                   o.max_swaps_per_step, 2.0 * static_cast<double>(expert_bytes) / 1e6);
  cache_ = std::move(state);
  return Ok{};
}

Status Qwen3MoeCuda::cache_before_step() {
  CacheState& c = *cache_;
  const int k = config_.num_experts_per_tok;
  // Oldest first: the policy must see the steps in order, and on one stream a newer read-back
  // cannot be complete while an older one is not.
  CacheState::Readback* order[2] = {&c.slots[0], &c.slots[1]};
  if (order[1]->step < order[0]->step) std::swap(order[0], order[1]);
  for (CacheState::Readback* r : order) {
    if (!r->pending) continue;
    const cudaError_t q = cudaEventQuery(r->ready);  // never a blocking wait
    if (q == cudaErrorNotReady) {
      // Not an error: clear it so the next CUDA_CHECK_LAUNCH does not see it (as PyTorch does).
      (void)cudaGetLastError();
      break;
    }
    CUDA_CHECK(q);
    r->pending = false;
    const std::span<const int32_t> ids(r->ids, moe_layer_ids_.size() * c.stride);
    for (const offload::ModelExpertCache::Swap& s : c.cache.feed(ids, c.stride, r->rows, k, r->ran_with)) {
      const int layer = moe_layer_ids_[static_cast<size_t>(s.layer)];
      // The cache's residency mirrors the layers' (it made every change since load), so a refusal
      // here is our bug; the error still names the layer and experts.
      if (auto st = move_expert(layer, s.admit, s.evict); !st.ok())
        return std::move(st).error().with_context(fmt::format("expert cache, model layer {} (internal)", layer));
    }
  }
  return Ok{};
}

void Qwen3MoeCuda::cache_after_step(int rows) {
  CacheState& c = *cache_;
  CacheState::Readback& r = c.slots[c.steps % 2];
  if (r.pending) c.cache.drop();  // its routing never arrived in time; the copy below is ordered after it
  // The first `rows` rows of each layer's ids (the rest of a graph bucket's rows are padding, and
  // routing_capture_ keeps a stride of max_tokens rows): one strided copy, L rows of rows * k ids.
  const size_t pitch = c.stride * sizeof(int32_t);
  const size_t width = static_cast<size_t>(rows) * static_cast<size_t>(config_.num_experts_per_tok) * sizeof(int32_t);
  CUDA_CHECK(cudaMemcpy2DAsync(r.ids, pitch, routing_capture_, pitch, width, moe_layer_ids_.size(),
                               cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaEventRecord(r.ready, stream_));
  c.cache.snapshot(r.ran_with);  // no swap is enqueued between this step's forward and here
  r.step = c.steps++;
  r.rows = rows;
  r.pending = true;
}

}  // namespace moebius::model

#endif  // MOEBIUS_HAS_CUDA
