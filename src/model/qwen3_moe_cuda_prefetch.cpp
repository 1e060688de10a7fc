// Qwen3MoeCuda's next-layer expert prefetch [TAG_EXPERT_PREFETCH] (qwen3_moe_cuda_prefetch.h has
// the schedule and why).
#include "model/qwen3_moe_cuda_prefetch.h"

#ifdef MOEBIUS_HAS_CUDA

#include <algorithm>
#include <cstdlib>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "kernels/cuda_check.h"
#include "kernels/device_info.h"

namespace moebius::model {

namespace {
constexpr size_t kLogStride = 1 + kernels::kExpertPrefetchMaxSlots;  // count, ids

// A measurement knob (MOEBIUS_PREFETCH_COPY_BLOCKS, MOEBIUS_PREFETCH_PRIORITY): an integer, or
// `fallback` when unset or not one.
int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  return (*end == '\0' && n >= -64 && n <= 4096) ? static_cast<int>(n) : fallback;
}
}  // namespace

Qwen3MoeCuda::PrefetchState::~PrefetchState() {
  for (cudaEvent_t e : {fork, predicted, ready})
    if (e != nullptr) (void)cudaEventDestroy(e);
  if (stream != nullptr) (void)cudaStreamDestroy(stream);
}

Status Qwen3MoeCuda::setup_expert_prefetch() {
  const int n = opt_.expert_prefetch;
  if (n == 0) return Ok{};
  if (n < 0 || n > kernels::kExpertPrefetchMaxSlots)
    return Error::format("{}: expected 0 (off) to {} experts per MoE layer", n, kernels::kExpertPrefetchMaxSlots)
        .in_field("--expert-prefetch");
  if (opt_.expert_cache)
    return Error("the expert cache (--expert-cache) and the prefetch both move experts; choose one")
        .in_field("--expert-prefetch");
  MOEBIUS_ASSERT(!ep_);  // init_ep refuses expert offload with EP
  const Qwen3MoeConfig& c = config_;
  auto off = [&](const std::string& why) -> Status {
    plan_.expert_prefetch = fmt::format("off: {} (--expert-prefetch {} has nothing to do)", why, n);
    return Ok{};
  };
  if (!offloaded()) return off("every expert is resident");
  if (moe_layer_ids_.size() < 2) return off("fewer than two MoE layers");
  if (c.num_experts > kernels::kExpertPrefetchMaxExperts)
    return off(fmt::format("{} experts, the predictor ranks at most {}", c.num_experts,
                           kernels::kExpertPrefetchMaxExperts));
  if (c.hidden_size % 8 != 0) return off("hidden_size is not a multiple of 8");
  const size_t E = static_cast<size_t>(c.num_experts), L = moe_layer_ids_.size();
  auto st = std::make_unique<PrefetchState>();
  st->slots = n;
  // The down projections only (runs Z35-Z36: 5-7% faster decode; whole experts never gained,
  // Z28-Z32); MOEBIUS_PREFETCH_PARTS=all, a measurement knob, copies whole experts.
  const char* parts = std::getenv("MOEBIUS_PREFETCH_PARTS");
  st->down_only = !(parts != nullptr && std::string_view(parts) == "all");
  assert_uniform_expert_arrays();
  const moe::MoeLayerCuda::PrefetchView v = moe_layer_at(0).prefetch_view();
  kernels::ExpertPrefetchSlots& set = st->set;
  set = st->down_only ? kernels::expert_prefetch_slots(nullptr, 0, 0, v.w2_bytes, v.s2_bytes)
                      : kernels::expert_prefetch_slots(nullptr, v.w13_bytes, v.s13_bytes, v.w2_bytes, v.s2_bytes);
  // The slots were reserved in the budget by plan_offload (prefetch bytes there).
  MOEBIUS_ASSIGN_OR_RETURN(void* slots, device_alloc(static_cast<size_t>(n) * set.stride, &plan_.workspace));
  set.base = static_cast<uint8_t*>(slots);
  MOEBIUS_ASSIGN_OR_RETURN(void* rec, device_alloc(sizeof(kernels::ExpertPrefetchRecord), &plan_.workspace));
  st->record = static_cast<kernels::ExpertPrefetchRecord*>(rec);
  MOEBIUS_ASSIGN_OR_RETURN(void* lg, device_alloc(sizeof(float) * kernels::kExpertPrefetchMaxTokens * E, &plan_.workspace));
  st->logits = static_cast<float*>(lg);
  MOEBIUS_ASSIGN_OR_RETURN(void* ctr, device_alloc(sizeof(unsigned), &plan_.workspace));
  st->counter = static_cast<unsigned*>(ctr);
  MOEBIUS_ASSIGN_OR_RETURN(void* cold, device_alloc(L * E, &plan_.workspace));
  st->cold = static_cast<uint8_t*>(cold);
  MOEBIUS_ASSIGN_OR_RETURN(void* log, device_alloc(sizeof(int32_t) * L * kLogStride, &plan_.workspace));
  st->log = static_cast<int32_t*>(log);
  st->cold_host = cold_expert_mask();
  CUDA_CHECK(cudaMemcpy(st->cold, st->cold_host.data(), L * E, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemset(st->record, 0, sizeof(kernels::ExpertPrefetchRecord)));
  CUDA_CHECK(cudaMemset(st->counter, 0, sizeof(unsigned)));
  CUDA_CHECK(cudaMemset(st->log, 0, sizeof(int32_t) * L * kLogStride));
  st->targets.resize(L);
  for (size_t i = 0; i < L; ++i) st->targets[i] = {moe_layer_at(i).prefetch_view(), moe_post_norm_at(i)};
  st->issued.assign(L, 0);
  // The copy runs beside the step's kernels and must not queue behind their blocks (run Z31): one
  // small block per SM at the device's greatest priority, stream and launch both (the prediction
  // shares the stream, so it gets that priority too).
  int least = 0, greatest = 0;
  CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  st->copy_priority = std::clamp(env_int("MOEBIUS_PREFETCH_PRIORITY", greatest), greatest, least);
  st->copy_blocks = std::clamp(env_int("MOEBIUS_PREFETCH_COPY_BLOCKS", kernels::current_device_sm_count()), 1, 1024);
  CUDA_CHECK(cudaStreamCreateWithPriority(&st->stream, cudaStreamNonBlocking, st->copy_priority));
  CUDA_CHECK(cudaEventCreateWithFlags(&st->fork, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventCreateWithFlags(&st->predicted, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventCreateWithFlags(&st->ready, cudaEventDisableTiming));
  const std::string what = st->down_only
                               ? (n == 1 ? "1 expert's down projection" : fmt::format("{} experts' down projections", n))
                               : (n == 1 ? "1 expert" : fmt::format("{} experts", n));
  plan_.expert_prefetch = fmt::format(
      "{} a MoE layer copied ahead in steps of at most {} rows ({:.1f} MB of slots; {} copy blocks at priority {})",
      what, kernels::kExpertPrefetchMaxTokens, static_cast<double>(n * set.stride) / 1e6, st->copy_blocks,
      st->copy_priority);
  prefetch_ = std::move(st);
  return Ok{};
}

void Qwen3MoeCuda::assert_uniform_expert_arrays() const {
  const moe::MoeLayerCuda::PrefetchView v = moe_layer_at(0).prefetch_view();
  for (size_t i = 1; i < moe_layer_ids_.size(); ++i) {  // one geometry for every MoE layer (Qwen3-MoE has one)
    const moe::MoeLayerCuda::PrefetchView w = moe_layer_at(i).prefetch_view();
    MOEBIUS_ASSERT(w.w13_bytes == v.w13_bytes && w.s13_bytes == v.s13_bytes && w.w2_bytes == v.w2_bytes &&
                   w.s2_bytes == v.s2_bytes);
  }
}

std::vector<uint8_t> Qwen3MoeCuda::cold_expert_mask() const {
  const size_t E = static_cast<size_t>(config_.num_experts), L = moe_layer_ids_.size();
  std::vector<uint8_t> cold(L * E, 0);
  for (size_t i = 0; i < L; ++i)
    for (size_t e = 0; e < E; ++e) cold[i * E + e] = expert_resident(moe_layer_ids_[i], static_cast<int>(e)) ? 0 : 1;
  return cold;
}

bool Qwen3MoeCuda::prefetch_step(int rows) const {
  return prefetch_ != nullptr && rows >= 1 && rows <= kernels::kExpertPrefetchMaxTokens;
}

void Qwen3MoeCuda::prefetch_issue(size_t i, const float* resid, const __nv_bfloat16* delta, const int32_t* num_tokens,
                                  int rows, cudaStream_t s) {
  PrefetchState& st = *prefetch_;
  const PrefetchState::Target& t = st.targets.at(i);
  const size_t E = static_cast<size_t>(config_.num_experts);
  kernels::ExpertPrefetchPredictArgs a;
  a.resid = resid;
  a.delta = delta;
  a.norm_weight = t.norm;
  a.eps = config_.rms_norm_eps;
  a.router = t.view.router;
  a.correction_bias = t.view.correction_bias;
  a.cold = st.cold + i * E;
  a.hidden = static_cast<int>(config_.hidden_size);
  a.num_experts = config_.num_experts;
  a.top_k = config_.num_experts_per_tok;
  a.num_tokens = num_tokens;
  a.capacity = rows;
  a.slots = st.slots;
  a.table13 = st.down_only ? nullptr : t.view.table13;
  a.table2 = t.view.table2;
  a.record = st.record;
  a.logits = st.logits;
  a.counter = st.counter;
  a.log = st.log + i * kLogStride;
  MOEBIUS_ASSERT(!st.reading, "a prediction still reads the residual: prefetch_release was not called");
  CUDA_CHECK(cudaEventRecord(st.fork, s));
  CUDA_CHECK(cudaStreamWaitEvent(st.stream, st.fork, 0));
  kernels::launch_expert_prefetch_predict(a, st.stream);
  CUDA_CHECK(cudaEventRecord(st.predicted, st.stream));
  st.reading = true;
  kernels::launch_expert_prefetch_copy(st.record, st.set, st.copy_blocks, st.copy_priority, st.stream);
  kernels::launch_expert_prefetch_publish(st.record, st.set, st.stream);
  CUDA_CHECK(cudaEventRecord(st.ready, st.stream));
  st.issued[i] = 1;
}

void Qwen3MoeCuda::prefetch_release(cudaStream_t s) {
  if (!prefetch_ || !prefetch_->reading) return;
  CUDA_CHECK(cudaStreamWaitEvent(s, prefetch_->predicted, 0));
  prefetch_->reading = false;
}

void Qwen3MoeCuda::prefetch_join(size_t i, moe::MoeLayerCuda& layer, cudaStream_t s) {
  PrefetchState& st = *prefetch_;
  MOEBIUS_ASSERT(!st.reading);  // the copy follows the prediction on the prefetch stream
  if (st.issued.at(i) == 0) return;
  if (st.down_only) layer.wait_before_down(st.ready);
  else CUDA_CHECK(cudaStreamWaitEvent(s, st.ready, 0));
  st.issued[i] = 0;
}

uint64_t Qwen3MoeCuda::prefetch_copy_bytes(const moe::MoeLayerCuda& m) const {
  if (!prefetch_ || !prefetch_->down_only) return m.expert_bytes();
  const moe::MoeLayerCuda::PrefetchView v = m.prefetch_view();
  return v.w2_bytes + v.s2_bytes;
}

void Qwen3MoeCuda::prefetch_restore_all() {
  if (!prefetch_) return;
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  kernels::launch_expert_prefetch_restore(prefetch_->record, stream_);
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

std::vector<std::vector<int>> Qwen3MoeCuda::last_step_prefetched() const {
  std::vector<std::vector<int>> out(moe_layer_ids_.size());
  if (!prefetch_ || !last_step_prefetched_) return out;
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  std::vector<int32_t> log(moe_layer_ids_.size() * kLogStride);
  CUDA_CHECK(cudaMemcpy(log.data(), prefetch_->log, log.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
  for (size_t i = 1; i < out.size(); ++i) {
    const int32_t* r = log.data() + i * kLogStride;
    const int count = std::clamp(r[0], 0, kernels::kExpertPrefetchMaxSlots);
    out[i].assign(r + 1, r + 1 + count);
  }
  return out;
}

Qwen3MoeCuda::PrefetchCounts Qwen3MoeCuda::last_step_prefetch(int rows) const {
  PrefetchCounts c;
  if (!prefetch_ || !last_step_prefetched_) return c;
  const std::vector<std::vector<int>> pre = last_step_prefetched();
  const int k = config_.num_experts_per_tok, E = config_.num_experts;
  MOEBIUS_ASSERT(routing_capture_ != nullptr && rows <= opt_.max_tokens);
  const size_t per_layer = static_cast<size_t>(opt_.max_tokens) * static_cast<size_t>(k);
  std::vector<int32_t> ids(static_cast<size_t>(rows) * static_cast<size_t>(k));
  std::vector<uint8_t> routed(static_cast<size_t>(E));
  for (size_t i = 1; i < pre.size(); ++i) {
    CUDA_CHECK(cudaMemcpy(ids.data(), routing_capture_ + i * per_layer, ids.size() * sizeof(int32_t),
                          cudaMemcpyDeviceToHost));
    std::fill(routed.begin(), routed.end(), uint8_t{0});
    for (int32_t e : ids)
      if (e >= 0 && e < E && prefetch_->cold_host[i * static_cast<size_t>(E) + static_cast<size_t>(e)] != 0)
        routed[static_cast<size_t>(e)] = 1;
    for (uint8_t r : routed) c.routed_cold += r;
    c.copied += static_cast<int64_t>(pre[i].size());
    for (int e : pre[i]) c.hits += routed[static_cast<size_t>(e)];
  }
  return c;
}

}  // namespace moebius::model

#endif  // MOEBIUS_HAS_CUDA
