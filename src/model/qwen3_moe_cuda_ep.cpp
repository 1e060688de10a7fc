// Qwen3MoeCuda's expert parallelism: the EP layers, the step header and the empty steps
// (qwen3_moe_cuda.h's header comment, docs/EXPERT_PARALLEL.md).
#include "model/qwen3_moe_cuda_ep.h"

#ifdef MOEBIUS_HAS_CUDA

#include <algorithm>
#include <span>

#include <fmt/format.h>

#include "kernels/cuda_check.h"
#include "parallel/ep_step.h"

namespace moebius::model {

int Qwen3MoeCuda::ep_rank() const { return opt_.ep_comm ? opt_.ep_comm->rank() : 0; }
int Qwen3MoeCuda::ep_size() const { return opt_.ep_comm ? opt_.ep_comm->size() : 1; }

#ifndef MOEBIUS_HAS_NCCL

Status Qwen3MoeCuda::init_ep() {
  if (!opt_.ep_comm) return Ok{};
  return Error("this build of moebius has no NCCL; expert parallelism on the CUDA backend needs it").in_field("--ep");
}
Status Qwen3MoeCuda::add_ep_moe_layer(int, const cpu::MoeLayerReference&) { return Error("no NCCL"); }
Status Qwen3MoeCuda::add_ep_moe_layer_dummy(int, const cpu::MoeShape&, moe::KernelFormat, int, uint64_t) {
  return Error("no NCCL");
}
Status Qwen3MoeCuda::ep_step_header(int32_t, bool*) { return Error("no NCCL"); }
Status Qwen3MoeCuda::ep_moe(int, const __nv_bfloat16*, const int32_t*, __nv_bfloat16*) { return Error("no NCCL"); }
Status Qwen3MoeCuda::ep_run_empty_layers() { return Error("no NCCL"); }

#else  // MOEBIUS_HAS_NCCL

namespace {

// Every rank's `mine` (at most 2 ints), in rank order: an all-gather through the device (NCCL
// collectives take device memory) and back, then a stream synchronize, since the host decides
// with the result. Never called while the stream is capturing.
Result<std::vector<int32_t>> gather_ints(parallel::NcclCommunicator& comm, int32_t* dev, int32_t* host,
                                         std::span<const int32_t> mine, cudaStream_t s) {
  const size_t n = mine.size(), N = static_cast<size_t>(comm.size());
  MOEBIUS_ASSERT(n >= 1 && n <= 2);
  std::copy(mine.begin(), mine.end(), host);
  CUDA_CHECK(cudaMemcpyAsync(dev, host, n * sizeof(int32_t), cudaMemcpyHostToDevice, s));
  comm.set_stream(s);
  MOEBIUS_TRY(comm.all_gather(dev, dev + 2, n * sizeof(int32_t)));
  CUDA_CHECK(cudaMemcpyAsync(host + 2, dev + 2, N * n * sizeof(int32_t), cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
  return std::vector<int32_t>(host + 2, host + 2 + N * n);
}

}  // namespace

Status Qwen3MoeCuda::init_ep() {
  if (!opt_.ep_comm) return Ok{};
  auto* comm = dynamic_cast<parallel::NcclCommunicator*>(opt_.ep_comm.get());
  if (comm == nullptr)
    return Error::format("the CUDA runner's expert parallelism runs over NCCL, not a '{}' communicator",
                         opt_.ep_comm->name())
        .in_field("--ep");
  if (!opt_.gpu_memory_budget.empty() || !opt_.placement_file.empty() || opt_.max_resident_experts >= 0 ||
      opt_.expert_cache || opt_.expert_prefetch != 0 || opt_.expert_dma_slots > 0)
    return Error("expert offload is not supported together with expert parallelism yet").in_field("--ep");
  if (Status st = parallel::check_expert_split(config_.num_experts, comm->size()); !st.ok())
    return std::move(st).error().in_field("--ep");
  const int N = comm->size();
  ep_ = std::make_unique<EpState>();
  ep_->comm = comm;
  ep_->decode_capacity = moe_decode_capacity_;
  ep_->prefill_capacity = std::max(opt_.max_tokens, moe_decode_capacity_);
  ep_->step_capacity = ep_->decode_capacity;
  ep_->decode.resize(static_cast<size_t>(config_.num_hidden_layers));
  ep_->prefill.resize(static_cast<size_t>(config_.num_hidden_layers));
  const size_t header_ints = 2 + 2 * static_cast<size_t>(N);
  MOEBIUS_ASSIGN_OR_RETURN(void* d, device_alloc(header_ints * sizeof(int32_t) + 16, &plan_.workspace));
  ep_->header_dev = static_cast<int32_t*>(d);
  ep_->zero = ep_->header_dev + header_ints;
  CUDA_CHECK(cudaMemset(ep_->zero, 0, sizeof(int32_t)));
  MOEBIUS_ASSIGN_OR_RETURN(Buffer h, Buffer::allocate(MemoryKind::kPinnedHost, header_ints * sizeof(int32_t)));
  ep_->header_host = h.as<int32_t>();
  buffers_.push_back(std::move(h));
  // The capacities fix every EP all-to-all's size, so they must be the same on every rank.
  const int32_t mine[2] = {ep_->decode_capacity, ep_->prefill_capacity};
  MOEBIUS_ASSIGN_OR_RETURN(std::vector<int32_t> all,
                           gather_ints(*comm, ep_->header_dev, ep_->header_host, mine, stream_));
  for (int r = 0; r < N; ++r)
    if (all[2 * static_cast<size_t>(r)] != mine[0] || all[2 * static_cast<size_t>(r) + 1] != mine[1])
      return Error::format("expert-parallel rank {} runs decode/prefill capacities {}/{}, rank {} {}/{}: every rank "
                           "must be started with the same step limits (--max-running, --max-step-tokens, "
                           "--prefill-chunk, prompt)",
                           r, all[2 * static_cast<size_t>(r)], all[2 * static_cast<size_t>(r) + 1], comm->rank(),
                           mine[0], mine[1])
          .in_field("--ep");
  return Ok{};
}

Status Qwen3MoeCuda::attach_ep_layers(int l, std::unique_ptr<moe::MoeLayerEpCuda> decode) {
  const size_t i = static_cast<size_t>(l);
  plan_.experts += decode->local().weight_bytes() + decode->router_bytes();
  plan_.workspace += decode->workspace_bytes();
  if (ep_->prefill_capacity > ep_->decode_capacity) {
    moe::MoeEpCudaOptions o;
    o.capacity = ep_->prefill_capacity;
    auto p = decode->share_weights(o);
    if (!p.ok()) return std::move(p).error().with_context(fmt::format("layer {} (EP, capacity {})", l, o.capacity));
    plan_.workspace += (*p)->workspace_bytes();
    ep_->prefill[i] = std::move(p).value();
  }
  ep_->decode[i] = std::move(decode);
  return Ok{};
}

Status Qwen3MoeCuda::add_ep_moe_layer(int l, const cpu::MoeLayerReference& layer) {
  moe::MoeEpCudaOptions o;
  o.capacity = ep_->decode_capacity;
  auto d = moe::MoeLayerEpCuda::create(layer, *ep_->comm, o);
  if (!d.ok()) return std::move(d).error().with_context(fmt::format("layer {} (EP)", l));
  return attach_ep_layers(l, std::move(d).value());
}

Status Qwen3MoeCuda::add_ep_moe_layer_dummy(int l, const cpu::MoeShape& shape, moe::KernelFormat format,
                                            int group_size, uint64_t seed) {
  moe::MoeEpCudaOptions o;
  o.capacity = ep_->decode_capacity;
  // The seed is the layer's on every rank: the router must be the same everywhere.
  auto d = moe::MoeLayerEpCuda::create_dummy(shape, format, group_size, *ep_->comm, o, seed);
  if (!d.ok()) return std::move(d).error().with_context(fmt::format("layer {} (EP)", l));
  return attach_ep_layers(l, std::move(d).value());
}

Status Qwen3MoeCuda::ep_step_header(int32_t mine, bool* all_done) {
  const int32_t v[1] = {mine};
  MOEBIUS_ASSIGN_OR_RETURN(std::vector<int32_t> states,
                           gather_ints(*ep_->comm, ep_->header_dev, ep_->header_host, v, stream_));
  const parallel::EpStepSummary step = parallel::summarize_ep_step(states);
  *all_done = step.all_done;
  MOEBIUS_ASSIGN_OR_RETURN(ep_->step_capacity,
                           parallel::ep_step_capacity(step, ep_->decode_capacity, ep_->prefill_capacity));
  return Ok{};
}

Status Qwen3MoeCuda::ep_moe(int l, const __nv_bfloat16* x, const int32_t* num_tokens, __nv_bfloat16* out) {
  const size_t i = static_cast<size_t>(l);
  const bool prefill = ep_->step_capacity > ep_->decode_capacity;
  moe::MoeLayerEpCuda& m = prefill ? *ep_->prefill[i] : *ep_->decode[i];
  if (Status st = m.forward(x, num_tokens, out, stream_); !st.ok())
    return std::move(st).error().with_context(fmt::format("layer {} (EP)", l));
  return Ok{};
}

Status Qwen3MoeCuda::ep_run_empty_layers() {
  // No attention and no lm_head: only the MoE layers' collectives, with a live count of 0 (the
  // inputs are never read). Their outputs land in y_, which no step reads before overwriting.
  for (int l : moe_layer_ids_) MOEBIUS_TRY(ep_moe(l, h_, ep_->zero, y_));
  return Ok{};
}

#endif  // MOEBIUS_HAS_NCCL

Status Qwen3MoeCuda::ep_empty_step() {
  if (!ep_) return Error("ep_empty_step on a runner without expert parallelism");
  bool all_done = false;
  MOEBIUS_TRY(ep_step_header(0, &all_done));
  return ep_run_empty_layers();
}

Status Qwen3MoeCuda::ep_idle_until_all_done() {
  if (!ep_) return Ok{};
  for (;;) {
    bool all_done = false;
    MOEBIUS_TRY(ep_step_header(parallel::kEpRankDone, &all_done));
    if (all_done) return Ok{};
    MOEBIUS_TRY(ep_run_empty_layers());
  }
}

}  // namespace moebius::model

#endif  // MOEBIUS_HAS_CUDA
