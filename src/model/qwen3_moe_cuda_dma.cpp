// Qwen3MoeCuda's routed cold experts by the copy engines [TAG_EXPERT_ROUTED_DMA]
// (qwen3_moe_cuda_dma.h has the schedule, kernels/expert_dma.cuh the protocol and why).
#include "model/qwen3_moe_cuda_dma.h"

#ifdef MOEBIUS_HAS_CUDA

#include <fmt/format.h>

#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda_check.h"
#include "kernels/expert_prefetch.cuh"
#include "runtime/cuda_environment.h"

namespace moebius::model {

Qwen3MoeCuda::DmaState::~DmaState() {
  copier.reset();  // joins the thread before the slots it writes go away
  for (cudaEvent_t e : {fork, copied2})
    if (e != nullptr) (void)cudaEventDestroy(e);
  if (side != nullptr) (void)cudaStreamDestroy(side);
}

std::string Qwen3MoeCuda::dma_refusal() const {
  // [TAG_CUDA_CONNECTIONS] Fewer hardware queues than the CLI asks for: the copier's stream could
  // share one with the decode graph, and its copies would queue behind the waits for them.
  if (const int q = runtime::cuda_connections(); q < runtime::kCudaConnectionsWanted)
    return fmt::format("CUDA_DEVICE_MAX_CONNECTIONS is {}, and the copies need {} hardware queues so that they "
                       "never queue behind the kernels waiting for them (the moebius CLI sets {} unless the "
                       "variable is set)",
                       q, runtime::kCudaConnectionsWanted, runtime::kCudaConnectionsWanted);
  if (!runtime::eager_module_loading())  // [TAG_CUDA_EAGER_LOADING]
    return "lazy module loading: a kernel's first launch could wait for the kernels waiting for the copies "
           "(CUDA_MODULE_LOADING=EAGER is needed; the moebius CLI sets it with --expert-dma unless the variable "
           "is set)";
  if (config_.num_experts > 1024) return fmt::format("{} experts, the choice handles at most 1024", config_.num_experts);
  return "";
}

Status Qwen3MoeCuda::setup_expert_dma() {
  const int n = opt_.expert_dma_slots;
  if (n == 0) return Ok{};
  if (opt_.expert_cache)
    return Error("the expert cache (--expert-cache) and the routed-expert DMA both move experts; choose one")
        .in_field("expert_dma_slots");
  if (ep_)  // init_ep refuses it first; kept so that no order of the setup can reach the copier with EP
    return Error("expert offload is not supported together with expert parallelism yet").in_field("--ep");
  const Qwen3MoeConfig& c = config_;
  auto off = [&](const std::string& why) -> Status {
    plan_.expert_dma = fmt::format("off: {} ({} slots asked for)", why, n);
    for (cudaStream_t& s : dma_streams_)  // created for the copies at init; unused now
      if (s != nullptr) CUDA_CHECK(cudaStreamDestroy(std::exchange(s, nullptr)));
    return Ok{};
  };
  if (!offloaded()) return off("every expert is resident");
  if (const std::string why = dma_refusal(); !why.empty()) return off(why);
  auto st = std::make_unique<DmaState>();
  st->slots = n;
  assert_uniform_expert_arrays();
  const moe::MoeLayerCuda::PrefetchView v = moe_layer_at(0).prefetch_view();
  // Whole experts, each array 256-byte aligned: the prefetch's slot layout.
  const kernels::ExpertPrefetchSlots layout =
      kernels::expert_prefetch_slots(nullptr, v.w13_bytes, v.s13_bytes, v.w2_bytes, v.s2_bytes);
  // The slots were reserved in the budget by plan_offload.
  MOEBIUS_ASSIGN_OR_RETURN(void* slots, device_alloc(static_cast<size_t>(n) * layout.stride, &plan_.workspace));
  st->set.base = static_cast<uint8_t*>(slots);
  st->set.stride = layout.stride;
  st->set.off_s13 = layout.off_s13;
  st->set.off_w2 = layout.off_w2;
  st->set.off_s2 = layout.off_s2;
  MOEBIUS_ASSIGN_OR_RETURN(void* rec, device_alloc(sizeof(kernels::ExpertDmaRecord), &plan_.workspace));
  st->record = static_cast<kernels::ExpertDmaRecord*>(rec);
  CUDA_CHECK(cudaMemset(st->record, 0, sizeof(kernels::ExpertDmaRecord)));
  // The copier's sources: each cold expert's home in pinned memory (resident ones stay null: the
  // choice never picks them, and the copier refuses a post that does).
  runtime::RoutedCopierConfig cc;
  const size_t L = moe_layer_ids_.size(), E = static_cast<size_t>(c.num_experts);
  cc.num_layers = static_cast<int>(L);
  cc.num_experts = c.num_experts;
  cc.num_slots = n;
  cc.sources.resize(L * E);
  const std::vector<uint8_t> cold = cold_expert_mask();
  for (size_t i = 0; i < L; ++i) {
    const moe::MoeLayerCuda& layer = moe_layer_at(i);
    for (size_t e = 0; e < E; ++e) {
      if (cold[i * E + e] == 0) continue;
      const moe::MoeLayerCuda::ExpertSource src = layer.copy_source(static_cast<int>(e));
      cc.sources[i * E + e] = {src.w13, src.s13, src.w2, src.s2};
    }
  }
  cc.slots = st->set;
  cc.w13_bytes = v.w13_bytes;
  cc.s13_bytes = v.s13_bytes;
  cc.w2_bytes = v.w2_bytes;
  cc.s2_bytes = v.s2_bytes;
  // The streams created next to the main one (dma_streams_: init created them, n > 0 and no refusal).
  MOEBIUS_ASSERT(dma_streams_[0] != nullptr && dma_streams_[1] != nullptr,
                 "the routed copies' streams were not created");
  cc.stream = std::exchange(dma_streams_[0], nullptr);
  st->side = std::exchange(dma_streams_[1], nullptr);
  MOEBIUS_ASSIGN_OR_RETURN(st->copier, runtime::RoutedExpertCopier::create(std::move(cc)));
  CUDA_CHECK(cudaEventCreateWithFlags(&st->fork, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventCreateWithFlags(&st->copied2, cudaEventDisableTiming));
  plan_.expert_dma = fmt::format(
      "up to {} routed cold experts a MoE layer copied by the copy engines (a host thread issues the copies the "
      "device posts) in decode steps of at most {} rows ({:.1f} MB of slots)",
      n, kernels::kExpertDmaMaxIds / c.num_experts_per_tok, static_cast<double>(n * layout.stride) / 1e6);
  dma_ = std::move(st);
  return Ok{};
}

int64_t Qwen3MoeCuda::expert_dma_posts() const { return dma_ ? dma_->copier->posts_served() : 0; }
uint64_t Qwen3MoeCuda::expert_dma_bytes() const { return dma_ ? dma_->copier->bytes_copied() : 0; }

Status Qwen3MoeCuda::dma_health() const {
  if (dma_ == nullptr) return Ok{};
  return dma_->copier->health();
}

bool Qwen3MoeCuda::dma_step(int rows) const {
  return dma_ != nullptr && rows >= 1 && rows * config_.num_experts_per_tok <= kernels::kExpertDmaMaxIds;
}

void Qwen3MoeCuda::dma_arm(size_t i, moe::MoeLayerCuda& layer, const int32_t* num_tokens, int rows) {
  MOEBIUS_ASSERT(!dma_->armed, "dma_restore was not called after the previous MoE layer");
  dma_->armed = true;
  layer.run_after_routing(
      [this, i, &layer, num_tokens, rows](cudaStream_t s) { dma_copy_routed(i, layer, num_tokens, rows, s); });
}

void Qwen3MoeCuda::dma_copy_routed(size_t i, moe::MoeLayerCuda& layer, const int32_t* num_tokens, int rows,
                                   cudaStream_t s) {
  DmaState& st = *dma_;
  const moe::MoeLayerCuda::PrefetchView v = layer.prefetch_view();
  kernels::ExpertDmaChooseArgs a;
  a.topk_ids = layer.topk_ids();
  a.num_tokens = num_tokens;
  a.capacity = rows;
  a.top_k = config_.num_experts_per_tok;
  a.num_experts = config_.num_experts;
  a.table13 = v.table13;
  a.table2 = v.table2;
  a.home = layer.cold_home();
  a.slots = st.set;
  a.num_slots = st.slots;
  a.layer = static_cast<int>(i);
  a.signal = st.copier->signal();
  a.record = st.record;
  // A down-only prefetch [TAG_EXPERT_PREFETCH] publishes its copied w2 parts into the same table
  // entries on its own stream and would have only GEMM2 wait for it: the choice waits instead, so
  // it reads whole entries and leaves the prefetched parts alone (a choice racing the publish would
  // depend on timing, and its restore could write back a half-published entry).
  if (cudaEvent_t pending = layer.pending_down_wait(); pending != nullptr) CUDA_CHECK(cudaStreamWaitEvent(s, pending, 0));
  kernels::launch_expert_dma_choose(a, s);
  // GEMM2's wait on the side stream (forked after the choice, so after the prefetch too).
  CUDA_CHECK(cudaEventRecord(st.fork, s));
  CUDA_CHECK(cudaStreamWaitEvent(st.side, st.fork, 0));
  kernels::launch_expert_dma_wait(st.record, a.signal, kernels::kExpertDmaPart2, st.side);
  CUDA_CHECK(cudaEventRecord(st.copied2, st.side));
  layer.wait_before_down(st.copied2);
  // GEMM1 follows its own wait on the main stream.
  kernels::launch_expert_dma_wait(st.record, a.signal, kernels::kExpertDmaPart13, s);
}

void Qwen3MoeCuda::dma_restore(cudaStream_t s) {
  if (!dma_ || !dma_->armed) return;
  kernels::launch_expert_dma_restore(dma_->record, s);
  dma_->armed = false;
}

}  // namespace moebius::model

#endif  // MOEBIUS_HAS_CUDA
