#include "moe/moe_layer_ep_cuda.h"

#if defined(MOEBIUS_HAS_CUDA) && defined(MOEBIUS_HAS_NCCL)

#include <random>
#include <vector>

#include "core/dtype.h"
#include "kernels/cuda_check.h"
#include "kernels/ep_dispatch.cuh"
#include "kernels/moe_combine.cuh"
#include "moe/ep_moe_cpu.h"

namespace moebius::moe {

const char* ep_phase_name(EpPhase p) {
  switch (p) {
    case EpPhase::kRoute: return "route";
    case EpPhase::kDispatch: return "dispatch";
    case EpPhase::kExperts: return "experts";
    case EpPhase::kReturn: return "return";
    case EpPhase::kCombine: return "combine";
    case EpPhase::kCount: break;
  }
  return "?";
}

namespace {

// The local layer's options: capacity N * slots (every peer's region full), kStore (its combine is
// not run), separate routing kernels (it routes nothing: the ids arrive with the rows).
MoeCudaOptions local_options(const MoeEpCudaOptions& opt, int N, int64_t slots, int local_experts) {
  MoeCudaOptions lo;
  lo.capacity = static_cast<int>(N * slots);
  lo.combine = kernels::MoeCombineMode::kStore;
  lo.bf16_y = 0;  // its fp32 rows go back to the token's rank (expert_outputs)
  lo.fuse_routing = false;
  lo.block_m = opt.block_m;
  lo.gemm_path = opt.gemm_path;
  if (lo.gemm_path == MoeGemmPath::kAuto && opt.block_m == 0 &&
      static_cast<double>(slots) / local_experts < kPrefillMinTokensPerExpert)
    lo.gemm_path = MoeGemmPath::kDecode;  // balanced load: few rows per local expert
  return lo;
}

Status check_ep_shape(const cpu::MoeShape& s, int N, const MoeEpCudaOptions& opt) {
  MOEBIUS_TRY(parallel::check_expert_split(s.num_experts, N));
  if (N > kernels::kEpMaxRanks)
    return Error::format("--ep {} is more than the {} ranks supported", N, kernels::kEpMaxRanks);
  if (opt.capacity < 1) return Error::format("capacity must be >= 1, got {}", opt.capacity);
  if (s.hidden % 8 != 0) return Error::format("expert parallelism needs H % 8 == 0 (16-byte rows), H = {}", s.hidden);
  if (int64_t{opt.capacity} * s.top_k * N > (int64_t{1} << 24))
    return Error::format("capacity {} x k {} x {} ranks is too large for one EP layer", opt.capacity, s.top_k, N);
  return Ok{};
}

}  // namespace

Result<std::unique_ptr<MoeLayerEpCuda>> MoeLayerEpCuda::create(const cpu::MoeLayerReference& layer,
                                                                parallel::NcclCommunicator& comm,
                                                                const MoeEpCudaOptions& opt) {
  const int N = comm.size();
  MOEBIUS_TRY(validate_ep_layer(layer, N));
  const cpu::MoeShape& s = layer.shape;
  MOEBIUS_TRY(check_ep_shape(s, N, opt));
  const int El = s.num_experts / N;
  // The local experts: E / N experts with k = 1 (each received pair is one "token"). Its router is
  // never run.
  cpu::MoeLayerReference local;
  local.shape = cpu::MoeShape{s.hidden, s.intermediate, El, 1};
  local.router.num_experts = El;
  local.router.top_k = 1;
  local.router_weight.assign(static_cast<size_t>(El * s.hidden), 0.0f);
  local.experts = layer.experts;
  local.options = layer.options;
  MOEBIUS_ASSIGN_OR_RETURN(std::unique_ptr<MoeLayerCuda> L,
                           MoeLayerCuda::create(local, local_options(opt, N, int64_t{opt.capacity} * s.top_k, El)));
  std::vector<uint16_t> rw(layer.router_weight.size());
  for (size_t i = 0; i < rw.size(); ++i) rw[i] = float_to_bf16_bits(layer.router_weight[i]);
  return init(s, layer.router, rw, std::move(L), comm, opt);
}

Result<std::unique_ptr<MoeLayerEpCuda>> MoeLayerEpCuda::create_dummy(const cpu::MoeShape& s, KernelFormat format,
                                                                      int group_size, parallel::NcclCommunicator& comm,
                                                                      const MoeEpCudaOptions& opt, uint64_t seed) {
  const int N = comm.size();
  MOEBIUS_TRY(check_ep_shape(s, N, opt));
  const int El = s.num_experts / N;
  MOEBIUS_ASSIGN_OR_RETURN(
      std::unique_ptr<MoeLayerCuda> L,
      MoeLayerCuda::create_dummy(cpu::MoeShape{s.hidden, s.intermediate, El, 1}, format, group_size,
                                 local_options(opt, N, int64_t{opt.capacity} * s.top_k, El),
                                 seed + 7919 * static_cast<uint64_t>(comm.rank())));
  // The same random router on every rank (the seed is shared), roughly uniform routing.
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 0.05f);
  std::vector<uint16_t> rw(static_cast<size_t>(s.num_experts * s.hidden));
  for (auto& v : rw) v = float_to_bf16_bits(d(rng));
  cpu::RouterConfig r;
  r.num_experts = s.num_experts;
  r.top_k = s.top_k;
  return init(s, r, rw, std::move(L), comm, opt);
}

Result<std::unique_ptr<MoeLayerEpCuda>> MoeLayerEpCuda::init(const cpu::MoeShape& s, const cpu::RouterConfig& r,
                                                              const std::vector<uint16_t>& router_bits,
                                                              std::unique_ptr<MoeLayerCuda> local,
                                                              parallel::NcclCommunicator& comm,
                                                              const MoeEpCudaOptions& opt) {
  std::unique_ptr<MoeLayerEpCuda> L(new MoeLayerEpCuda());
  const int E = s.num_experts;
  const int64_t H = s.hidden;
  L->local_ = std::move(local);
  L->weights_ = std::make_shared<std::vector<Buffer>>();
  auto take = [&](auto*& ptr, size_t count) -> Status {
    MOEBIUS_ASSIGN_OR_RETURN(Buffer b, Buffer::allocate(MemoryKind::kDevice, count * sizeof(*ptr)));
    ptr = static_cast<std::remove_reference_t<decltype(ptr)>>(b.data());
    L->weights_->push_back(std::move(b));
    return Ok{};
  };
  MOEBIUS_TRY(take(L->router_weight_, static_cast<size_t>(E * H)));
  if (!r.correction_bias.empty()) MOEBIUS_TRY(take(L->correction_bias_, static_cast<size_t>(E)));
  MOEBIUS_ASSERT(router_bits.size() == static_cast<size_t>(E * H));
  CUDA_CHECK(cudaMemcpy(L->router_weight_, router_bits.data(), router_bits.size() * 2, cudaMemcpyHostToDevice));
  if (L->correction_bias_ != nullptr)
    CUDA_CHECK(cudaMemcpy(L->correction_bias_, r.correction_bias.data(), sizeof(float) * E, cudaMemcpyHostToDevice));
  MOEBIUS_TRY(allocate(*L, s, r, comm, opt));
  return L;
}

Result<std::unique_ptr<MoeLayerEpCuda>> MoeLayerEpCuda::share_weights(const MoeEpCudaOptions& opt) const {
  MOEBIUS_TRY(check_ep_shape(shape_, N_, opt));
  std::unique_ptr<MoeLayerEpCuda> L(new MoeLayerEpCuda());
  MOEBIUS_ASSIGN_OR_RETURN(L->local_,
                           local_->share_weights(local_options(opt, N_, int64_t{opt.capacity} * shape_.top_k,
                                                               shape_.num_experts / N_)));
  L->weights_ = weights_;
  L->router_weight_ = router_weight_;
  L->correction_bias_ = correction_bias_;
  MOEBIUS_TRY(allocate(*L, shape_, router_, *comm_, opt));
  return L;
}

Status MoeLayerEpCuda::allocate(MoeLayerEpCuda& L, const cpu::MoeShape& s, const cpu::RouterConfig& r,
                                parallel::NcclCommunicator& comm, const MoeEpCudaOptions& opt) {
  const int N = comm.size();
  L.comm_ = &comm;
  L.shape_ = s;
  L.opt_ = opt;
  L.router_ = r;
  L.N_ = N;
  L.me_ = comm.rank();
  const int E = s.num_experts, k = s.top_k, C = opt.capacity;
  const int64_t H = s.hidden;
  L.slots_ = C * k;
  const int64_t S = L.slots_;
  L.route_.num_experts = E;
  L.route_.top_k = k;
  L.route_.scoring =
      r.scoring == cpu::RouterScoring::kSoftmax ? kernels::RouteScoring::kSoftmax : kernels::RouteScoring::kSigmoid;
  L.route_.renormalize = r.renormalize;
  L.route_.n_groups = r.n_groups;
  L.route_.topk_groups = r.topk_groups;
  L.route_.routed_scaling_factor = r.routed_scaling_factor;

  auto take = [&](auto*& ptr, size_t count) -> Status {
    MOEBIUS_ASSIGN_OR_RETURN(Buffer b, Buffer::allocate(MemoryKind::kDevice, count * sizeof(*ptr)));
    ptr = static_cast<std::remove_reference_t<decltype(ptr)>>(b.data());
    L.buffers_.push_back(std::move(b));
    return Ok{};
  };
  const size_t n = static_cast<size_t>(N), region = static_cast<size_t>(S * H);
  MOEBIUS_TRY(take(L.logits_, static_cast<size_t>(C) * E));
  MOEBIUS_TRY(take(L.topk_ids_, static_cast<size_t>(S)));
  MOEBIUS_TRY(take(L.topk_weights_, static_cast<size_t>(S)));
  MOEBIUS_TRY(take(L.send_pos_, static_cast<size_t>(S)));
  MOEBIUS_TRY(take(L.send_counts_, n));
  MOEBIUS_TRY(take(L.counts_, n * n));
  MOEBIUS_TRY(take(L.send_x_, n * region));
  MOEBIUS_TRY(take(L.recv_x_, n * region));
  MOEBIUS_TRY(take(L.send_meta_, n * static_cast<size_t>(S)));
  MOEBIUS_TRY(take(L.recv_meta_, n * static_cast<size_t>(S)));
  MOEBIUS_TRY(take(L.x_local_, n * region));
  MOEBIUS_TRY(take(L.local_ids_, n * static_cast<size_t>(S)));
  MOEBIUS_TRY(take(L.local_w_, n * static_cast<size_t>(S)));
  MOEBIUS_TRY(take(L.num_local_, 1));
  MOEBIUS_TRY(take(L.ret_send_, n * region));
  MOEBIUS_TRY(take(L.ret_recv_, n * region));
  MOEBIUS_TRY(take(L.y_pairs_, region));

  const std::vector<float> ones(n * static_cast<size_t>(S), 1.0f);
  CUDA_CHECK(cudaMemcpy(L.local_w_, ones.data(), ones.size() * 4, cudaMemcpyHostToDevice));
  // Rows past the live counts are sent as they are; zero them once so no uninitialized memory
  // ever crosses the wire.
  CUDA_CHECK(cudaMemset(L.send_x_, 0, n * region * 2));
  CUDA_CHECK(cudaMemset(L.send_meta_, 0, n * static_cast<size_t>(S) * 4));
  CUDA_CHECK(cudaMemset(L.ret_send_, 0, n * region * 4));
  return Ok{};
}

MoeLayerEpCuda::~MoeLayerEpCuda() = default;

size_t MoeLayerEpCuda::dispatch_wire_bytes() const {
  return static_cast<size_t>(N_) * static_cast<size_t>(slots_) * (static_cast<size_t>(shape_.hidden) * 2 + 4);
}
size_t MoeLayerEpCuda::return_wire_bytes() const {
  return static_cast<size_t>(N_) * static_cast<size_t>(slots_) * static_cast<size_t>(shape_.hidden) * 4;
}
size_t MoeLayerEpCuda::router_bytes() const {
  size_t n = 0;
  for (const Buffer& b : *weights_) n += b.size();
  return n;
}
size_t MoeLayerEpCuda::workspace_bytes() const {
  size_t n = local_->workspace_bytes();
  for (const Buffer& b : buffers_) n += b.size();
  return n;
}

Status MoeLayerEpCuda::all_to_all_fixed(const void* send, void* recv, size_t bytes_per_peer) {
  std::vector<size_t> sizes(static_cast<size_t>(N_), bytes_per_peer), offsets(sizes.size());
  for (size_t r = 0; r < offsets.size(); ++r) offsets[r] = r * bytes_per_peer;
  return comm_->all_to_all_v(send, sizes, offsets, recv, sizes, offsets);
}

Status MoeLayerEpCuda::enqueue_phase(EpPhase phase, const __nv_bfloat16* x, const int32_t* num_tokens,
                                     __nv_bfloat16* out, cudaStream_t stream) {
  const int E = shape_.num_experts, k = shape_.top_k, C = opt_.capacity, H = static_cast<int>(shape_.hidden);
  const size_t S = static_cast<size_t>(slots_);
  comm_->set_stream(stream);
  switch (phase) {
    case EpPhase::kRoute:
      enqueue_router_logits(x, H, router_weight_, num_tokens, C, H, E, logits_, stream);
      kernels::launch_moe_route_topk(logits_, correction_bias_, num_tokens, C, route_, topk_ids_, topk_weights_,
                                     stream);
      kernels::launch_ep_plan(topk_ids_, num_tokens, C, k, E, N_, send_pos_, send_counts_, send_meta_, stream);
      return Ok{};
    case EpPhase::kDispatch:
      kernels::launch_ep_pack_rows(x, topk_ids_, send_pos_, num_tokens, C, H, k, E, N_, send_x_, stream);
      MOEBIUS_TRY(comm_->all_gather(send_counts_, counts_, static_cast<size_t>(N_) * sizeof(int32_t)));
      MOEBIUS_TRY(all_to_all_fixed(send_x_, recv_x_, S * static_cast<size_t>(H) * 2));
      MOEBIUS_TRY(all_to_all_fixed(send_meta_, recv_meta_, S * 4));
      return Ok{};
    case EpPhase::kExperts:
      kernels::launch_ep_compact(recv_x_, recv_meta_, counts_, me_, N_, slots_, H, x_local_, local_ids_, num_local_,
                                 stream);
      local_->enqueue_stage(MoeStage::kAlign, x_local_, num_local_, local_ids_, local_w_, nullptr, stream);
      local_->enqueue_stage(MoeStage::kGateUp, x_local_, num_local_, local_ids_, local_w_, nullptr, stream);
      local_->enqueue_stage(MoeStage::kDown, x_local_, num_local_, local_ids_, local_w_, nullptr, stream);
      return Ok{};
    case EpPhase::kReturn:
      kernels::launch_ep_return_pack(local_->expert_outputs(), counts_, me_, N_, slots_, H, ret_send_, stream);
      return all_to_all_fixed(ret_send_, ret_recv_, S * static_cast<size_t>(H) * 4);
    case EpPhase::kCombine:
      kernels::launch_ep_unpack_return(ret_recv_, topk_ids_, send_pos_, num_tokens, C, k, E, N_, H, y_pairs_, stream);
      kernels::launch_moe_combine(y_pairs_, H, topk_weights_, num_tokens, C, k, H, out, H, stream);
      return Ok{};
    case EpPhase::kCount:
      break;
  }
  return Error("bad EP phase");
}

Status MoeLayerEpCuda::forward(const __nv_bfloat16* x, const int32_t* num_tokens, __nv_bfloat16* out,
                               cudaStream_t stream) {
  for (int p = 0; p < static_cast<int>(EpPhase::kCount); ++p)
    MOEBIUS_TRY(enqueue_phase(static_cast<EpPhase>(p), x, num_tokens, out, stream));
  return Ok{};
}

}  // namespace moebius::moe

#endif  // MOEBIUS_HAS_CUDA && MOEBIUS_HAS_NCCL
