#include "moe/moe_layer_cuda.h"

#ifdef MOEBIUS_HAS_CUDA

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>

#include "core/dtype.h"
#include "kernels/cuda_check.h"
#include "kernels/fill.cuh"
#include "kernels/moe_combine.cuh"
#include "kernels/moe_fused_experts.cuh"
#include "kernels/moe_gemm_prefill.cuh"
#include "kernels/moe_gemm_wgmma.cuh"
#include "kernels/moe_router_gemm.cuh"

namespace moebius::moe {

namespace {

kernels::MoeWeightFormat to_kernel(KernelFormat f) {
  switch (f) {
    case KernelFormat::kBF16: return kernels::MoeWeightFormat::kBF16;
    case KernelFormat::kNvFp4: return kernels::MoeWeightFormat::kNvFp4;
    case KernelFormat::kInt4: return kernels::MoeWeightFormat::kInt4;
    case KernelFormat::kInt2: return kernels::MoeWeightFormat::kInt2;
  }
  return kernels::MoeWeightFormat::kBF16;
}

kernels::MoeActivationParams to_kernel(const cpu::ActivationConfig& a) {
  kernels::MoeActivationParams p;
  p.kind = a.kind == cpu::Activation::kSiLU          ? kernels::MoeActivation::kSiLU
           : a.kind == cpu::Activation::kSiLUClamped ? kernels::MoeActivation::kSiLUClamped
                                                     : kernels::MoeActivation::kGptOss;
  p.limit = a.limit;
  p.alpha = a.alpha;
  return p;
}

// Average tokens per expert at full capacity, rounded up.
int64_t tokens_per_expert(int capacity, int top_k, int num_experts) {
  return (static_cast<int64_t>(capacity) * top_k + num_experts - 1) / num_experts;
}

// Decode: 8-token tiles below 16 tokens per expert: only they take the row-tile kernel (several
// 16-row weight tiles per block share one staging of the tokens), so a 16-token tile, which
// stages 16 activation rows for every 16 weight rows, lost to two 8-token tiles at every size
// measured (docs/PERF.md run S5, Qwen3-30B-A3B, T = 96-224, 9-14 tokens per expert: nvfp4 bm 8
// 155-259 us against bm 16 291-410, int4 156-265 against 343-468). From 16 on, a tile of about
// the average tokens per expert (the layer runs prefill kernels there unless decode is forced).
int pick_block_m(int capacity, int top_k, int num_experts) {
  const int64_t avg = tokens_per_expert(capacity, top_k, num_experts);
  return avg < 16 ? 8 : avg == 16 ? 16 : avg <= 32 ? 32 : 64;
}

// kAuto's decode -> prefill crossover in expected tokens per expert. The mma.sync prefill kernel:
// kPrefillMinTokensPerExpert. The wgmma kernel costs about the same from 6 to 64 tokens per expert
// (one 64-token tile per expert, bound by dequantizing every weight once), so it wins as soon as
// the decode kernel's cost, which grows with the tokens, passes it (run S5, Qwen3-30B-A3B, layer
// us, decode bm 8 / wgmma at 10 and 12 tokens per expert: nvfp4 208.5 / 224.1, 234.6 / 226.1;
// int2 261.1 / 257.7, 294.7 / 259.5; int4 still decode at 14: 265.5 / 274.5; Qwen3-235B-A22B
// nvfp4 at 8: 1098.6 / 749.0). 12 for every format but int4 (exact decode dequantization at 2
// ops a register against the wgmma fold's ~4.75), which stays at 16.
int prefill_min_tokens_per_expert(KernelFormat format, MoeGemmPath prefill_path) {
  if (prefill_path != MoeGemmPath::kPrefillWgmma) return kPrefillMinTokensPerExpert;
  return format == KernelFormat::kInt4 ? 16 : 12;
}

// Prefill: 64 tokens, except bf16 with >= 128 tokens per expert, whose weights are 4x the bytes
// of nvfp4/int4 per flop, so it needs 128-token tiles to keep L2 traffic below the L2 bandwidth
// (moe_gemm_prefill.cu). Padding costs (block_m - 1) / 2 rows per expert on average, which is why
// the quantized formats stay at 64.
int pick_prefill_block_m(KernelFormat format, int capacity, int top_k, int num_experts) {
  const int64_t avg = tokens_per_expert(capacity, top_k, num_experts);
  return format == KernelFormat::kBF16 && avg >= 128 ? 128 : 64;
}

// wgmma: 128-token tiles for every format once the expected tokens per expert reach 64 (L2
// intensity, half the dequantization per flop, and a wider wgmma); an expert's last tile runs at
// N = 64 when it is at most half full, which halves the padding cost of the wider tile. The int
// formats take 128 since their group scale is folded into the weight ([TAG_INT_FOLDED_SCALE]).
// Measured on the H200 (docs/PERF.md run S2, Qwen3-30B-A3B, layer us at bm 64 / 128): T = 512
// (32 per expert) nvfp4 233 / 267, int4 279 / 292; T = 1024 (64) nvfp4 340 / 323, bf16 401 / 395,
// int4 409 / 370, int2 387 / 364; T = 2048 (128) nvfp4 557 / 491. The autotuner measures both.
int pick_wgmma_block_m(int capacity, int top_k, int num_experts) {
  return tokens_per_expert(capacity, top_k, num_experts) >= 64 ? 128 : 64;
}

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

// A layer option that an environment variable may override for A/B runs: unset, the option;
// "0" or "1", that; anything else is an error naming the variable.
Result<bool> option_or_env(const char* name, bool option) {
  const char* v = std::getenv(name);
  if (v == nullptr) return option;
  const std::string s(v);
  if (s != "0" && s != "1") return Error::format("{} must be 0 or 1, got '{}'", name, s);
  return s == "1";
}

// The routing stages of a forward in order; uses_stage() picks the ones this layer runs.
constexpr MoeStage kRoutingStages[] = {MoeStage::kRouteFused, MoeStage::kRouterLogits, MoeStage::kTopKAlign,
                                       MoeStage::kTopK, MoeStage::kAlign};

}  // namespace

int ExpertResidency::cold_count() const {
  return static_cast<int>(std::count(resident.begin(), resident.end(), uint8_t{0}));
}

size_t expert_region_bytes(const PackedMatrix& w13, const PackedMatrix& w2, int n) {
  const size_t c = static_cast<size_t>(std::max(n, 0));
  return align256(packed_weight_bytes(w13) * c) + align256(packed_scale_bytes(w13) * c) +
         align256(packed_weight_bytes(w2) * c) + align256(packed_scale_bytes(w2) * c);
}

std::pair<PackedMatrix, PackedMatrix> dummy_expert_shapes(const cpu::MoeShape& s, KernelFormat format,
                                                          int group_size) {
  const int g = (format == KernelFormat::kInt4 || format == KernelFormat::kInt2) ? group_size : 0;
  const int64_t I8 = (s.intermediate + 7) / 8 * 8;
  return {packed_shape(format, 2 * I8, s.hidden, g), packed_shape(format, s.hidden, s.intermediate, g)};
}

const char* moe_gemm_path_name(MoeGemmPath p) {
  switch (p) {
    case MoeGemmPath::kAuto: return "auto";
    case MoeGemmPath::kDecode: return "decode";
    case MoeGemmPath::kPrefill: return "prefill";
    case MoeGemmPath::kPrefillWgmma: return "wgmma";
  }
  return "?";
}

const char* moe_stage_name(MoeStage s) {
  switch (s) {
    case MoeStage::kRouteFused: return "route(fused)";
    case MoeStage::kRouterLogits: return "router";
    case MoeStage::kTopKAlign: return "topk+align";
    case MoeStage::kTopK: return "topk";
    case MoeStage::kAlign: return "align";
    case MoeStage::kExpertsFused: return "experts(fused)";
    case MoeStage::kGateUp: return "gemm1";
    case MoeStage::kDown: return "gemm2";
    case MoeStage::kCombine: return "combine";
    case MoeStage::kCount: break;
  }
  return "?";
}

MoeLayerCuda::~MoeLayerCuda() = default;

Status MoeLayerCuda::allocate(const cpu::MoeShape& shape, KernelFormat format, const PackedMatrix& w13,
                              const PackedMatrix& w2, const MoeCudaOptions& opt, const ExpertResidency& residency) {
  if (shape.num_experts > kernels::kRouteMaxExperts || shape.top_k > kernels::kRouteMaxTopK)
    return Error::format("the CUDA router supports E <= {} and k <= {}; got E={} k={}", kernels::kRouteMaxExperts,
                         kernels::kRouteMaxTopK, shape.num_experts, shape.top_k);
  shape_ = shape;
  format_ = format;
  const int E = shape.num_experts;
  const int64_t H = shape.hidden, I = shape.intermediate;
  dims13_ = {static_cast<int>(w13.row_tiles()), static_cast<int>(H), static_cast<int>(w13.chunks()),
             static_cast<int>(w13.groups()), w13.group_size, static_cast<int>(I)};
  dims2_ = {static_cast<int>(w2.row_tiles()), static_cast<int>(I), static_cast<int>(w2.chunks()),
            static_cast<int>(w2.groups()), w2.group_size, static_cast<int>(H)};
  h_stride_ = static_cast<int>(w2.cols_padded);
  w13_bytes_ = packed_weight_bytes(w13);
  s13_bytes_ = packed_scale_bytes(w13);
  w2_bytes_ = packed_weight_bytes(w2);
  s2_bytes_ = packed_scale_bytes(w2);
  expert_bytes_ = w13_bytes_ + s13_bytes_ + w2_bytes_ + s2_bytes_;
  route_.num_experts = E;
  route_.top_k = shape.top_k;

  weights_ = std::make_shared<std::vector<Buffer>>();
  auto alloc = [this](size_t bytes) -> Result<uint8_t*> {
    MOEBIUS_ASSIGN_OR_RETURN(Buffer b, Buffer::allocate(MemoryKind::kDevice, bytes == 0 ? 16 : bytes));
    uint8_t* p = b.as<uint8_t>();
    weights_->push_back(std::move(b));
    return p;
  };
#define MOEBIUS_ALLOC(ptr, type, count)                                      \
  do {                                                                       \
    MOEBIUS_ASSIGN_OR_RETURN(uint8_t* p_, alloc(sizeof(type) * (count)));    \
    ptr = reinterpret_cast<type*>(p_);                                       \
  } while (0)
  // [TAG_EXPERT_OFFLOAD] Device slots for the resident experts; the cold ones in the caller's
  // pinned region, carved in the same matrix-major layout.
  if (!residency.resident.empty() && residency.resident.size() != static_cast<size_t>(E))
    return Error::format("a residency mask of {} experts for E={}", residency.resident.size(), E);
  const int cold = residency.resident.empty() ? 0 : residency.cold_count();
  if (cold > 0 && residency.cold_host == nullptr) return Error("cold experts need a pinned host region");
  slots_ = E - cold;
  res_ = std::make_shared<Residency>();
  res_->home.resize(static_cast<size_t>(E));
  res_->table13.resize(static_cast<size_t>(E));
  res_->table2.resize(static_cast<size_t>(E));
  {
    int slot = 0, c = 0;
    for (int e = 0; e < E; ++e)
      res_->home[static_cast<size_t>(e)] =
          residency.resident.empty() || residency.resident[static_cast<size_t>(e)] ? slot++ : -1 - c++;
  }
  const size_t n = static_cast<size_t>(slots_);
  MOEBIUS_ALLOC(w13_, uint8_t, w13_bytes_ * n);
  MOEBIUS_ALLOC(s13_, uint8_t, s13_bytes_ * n);
  MOEBIUS_ALLOC(w2_, uint8_t, w2_bytes_ * n);
  MOEBIUS_ALLOC(s2_, uint8_t, s2_bytes_ * n);
  if (cold > 0) {
    const size_t nc = static_cast<size_t>(cold);
    cold_bytes_ = expert_region_bytes(w13, w2, cold);
    cw13_ = residency.cold_host;
    cs13_ = cw13_ + align256(w13_bytes_ * nc);
    cw2_ = cs13_ + align256(s13_bytes_ * nc);
    cs2_ = cw2_ + align256(w2_bytes_ * nc);
    // The kernels' address of the same bytes (equal to the host pointer under UVA; asked anyway).
    void* alias = nullptr;
    CUDA_CHECK(cudaHostGetDevicePointer(&alias, residency.cold_host, 0));
    dcw13_ = static_cast<uint8_t*>(alias);
    dcs13_ = dcw13_ + (cs13_ - cw13_);
    dcw2_ = dcw13_ + (cw2_ - cw13_);
    dcs2_ = dcw13_ + (cs2_ - cw13_);
  }
  MOEBIUS_ALLOC(table13_, kernels::ExpertMatrixPtrs, E);
  MOEBIUS_ALLOC(table2_, kernels::ExpertMatrixPtrs, E);
  MOEBIUS_ALLOC(router_weight_, __nv_bfloat16, static_cast<size_t>(E) * H);
#undef MOEBIUS_ALLOC
  for (int e = 0; e < E; ++e) set_table_entry(e);
  return allocate_workspace(opt);
}

MoeLayerCuda::ExpertAddr MoeLayerCuda::copy_addr(int e) const {
  const int h = res_->home[static_cast<size_t>(e)];
  if (h >= 0) {
    const size_t i = static_cast<size_t>(h);
    return {w13_ + w13_bytes_ * i, s13_ + s13_bytes_ * i, w2_ + w2_bytes_ * i, s2_ + s2_bytes_ * i};
  }
  const size_t c = static_cast<size_t>(-1 - h);
  return {cw13_ + w13_bytes_ * c, cs13_ + s13_bytes_ * c, cw2_ + w2_bytes_ * c, cs2_ + s2_bytes_ * c};
}

MoeLayerCuda::ExpertAddr MoeLayerCuda::kernel_addr(int e) const {
  const int h = res_->home[static_cast<size_t>(e)];
  if (h >= 0) return copy_addr(e);
  const size_t c = static_cast<size_t>(-1 - h);
  return {dcw13_ + w13_bytes_ * c, dcs13_ + s13_bytes_ * c, dcw2_ + w2_bytes_ * c, dcs2_ + s2_bytes_ * c};
}

void MoeLayerCuda::set_table_entry(int e) {
  const ExpertAddr a = kernel_addr(e);
  kernels::ExpertMatrixPtrs& t13 = res_->table13[static_cast<size_t>(e)];
  kernels::ExpertMatrixPtrs& t2 = res_->table2[static_cast<size_t>(e)];
  t13.weight = a.w13;
  t13.scales = s13_bytes_ ? a.s13 : nullptr;
  t2.weight = a.w2;
  t2.scales = s2_bytes_ ? a.s2 : nullptr;
}

kernels::ExpertMatrixPtrs MoeLayerCuda::staged_entry(int e, bool w13) const {
  kernels::ExpertMatrixPtrs t = w13 ? res_->table13[static_cast<size_t>(e)] : res_->table2[static_cast<size_t>(e)];
  if (res_->home[static_cast<size_t>(e)] >= 0) return t;
  // The same offsets in the slot as in the cold region (a verbatim copy of it).
  const ExpertAddr a = copy_addr(e);
  uint8_t* slot = res_->staging_slot;
  if (w13) {
    t.weight = slot + (a.w13 - cw13_);
    t.scales = s13_bytes_ ? slot + (a.s13 - cw13_) : nullptr;
  } else {
    t.weight = slot + (a.w2 - cw13_);
    t.scales = s2_bytes_ ? slot + (a.s2 - cw13_) : nullptr;
  }
  return t;
}

Status MoeLayerCuda::set_staging_slot(uint8_t* slot) {
  if (cold_experts() == 0) return Ok{};  // nothing to stage
  MOEBIUS_ASSERT(slot != nullptr && res_->staged13 == nullptr, "set_staging_slot once per weights");
  const size_t E = static_cast<size_t>(shape_.num_experts);
  MOEBIUS_ASSIGN_OR_RETURN(Buffer b13, Buffer::allocate(MemoryKind::kDevice, sizeof(kernels::ExpertMatrixPtrs) * E));
  MOEBIUS_ASSIGN_OR_RETURN(Buffer b2, Buffer::allocate(MemoryKind::kDevice, sizeof(kernels::ExpertMatrixPtrs) * E));
  res_->staged13 = b13.as<kernels::ExpertMatrixPtrs>();
  res_->staged2 = b2.as<kernels::ExpertMatrixPtrs>();
  weights_->push_back(std::move(b13));
  weights_->push_back(std::move(b2));
  res_->staging_slot = slot;
  write_staged_tables();
  return Ok{};
}

void MoeLayerCuda::write_staged_tables() {
  if (res_->staged13 == nullptr) return;
  const size_t E = static_cast<size_t>(shape_.num_experts);
  std::vector<kernels::ExpertMatrixPtrs> t13(E), t2(E);
  for (size_t e = 0; e < E; ++e) {
    t13[e] = staged_entry(static_cast<int>(e), true);
    t2[e] = staged_entry(static_cast<int>(e), false);
  }
  CUDA_CHECK(cudaMemcpy(res_->staged13, t13.data(), sizeof(t13[0]) * E, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(res_->staged2, t2.data(), sizeof(t2[0]) * E, cudaMemcpyHostToDevice));
}

size_t MoeLayerCuda::device_weight_bytes() const {
  return weight_bytes() - expert_bytes_ * static_cast<size_t>(shape_.num_experts - slots_);
}

Status MoeLayerCuda::swap_experts(int cold, int resident, uint8_t* scratch, cudaStream_t stream) {
  const int E = shape_.num_experts;
  if (cold < 0 || cold >= E || resident < 0 || resident >= E)
    return Error::format("experts {} and {} outside [0, {})", cold, resident, E);
  if (expert_resident(cold) || !expert_resident(resident))
    return Error::format("swap_experts({}, {}): the first must be cold and the second resident", cold, resident);
  MOEBIUS_ASSERT(scratch != nullptr);
  const ExpertAddr dev = copy_addr(resident), host = copy_addr(cold);
  // scratch <- resident's slot; slot <- cold's pinned bytes; pinned <- scratch. The pieces sit at
  // the same offsets in the scratch as in an expert of a one-expert region.
  const size_t sizes[4] = {w13_bytes_, s13_bytes_, w2_bytes_, s2_bytes_};
  uint8_t* const d[4] = {dev.w13, dev.s13, dev.w2, dev.s2};
  uint8_t* const h[4] = {host.w13, host.s13, host.w2, host.s2};
  size_t off = 0;
  for (int i = 0; i < 4; ++i) {
    if (sizes[i] == 0) continue;
    CUDA_CHECK(cudaMemcpyAsync(scratch + off, d[i], sizes[i], cudaMemcpyDeviceToDevice, stream));
    CUDA_CHECK(cudaMemcpyAsync(d[i], h[i], sizes[i], cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaMemcpyAsync(h[i], scratch + off, sizes[i], cudaMemcpyDeviceToHost, stream));
    off += sizes[i];
  }
  std::swap(res_->home[static_cast<size_t>(cold)], res_->home[static_cast<size_t>(resident)]);
  set_table_entry(cold);
  set_table_entry(resident);
  if (res_->staged13 != nullptr)
    for (int e : {cold, resident}) {
      const kernels::ExpertMatrixPtrs a = staged_entry(e, true), b = staged_entry(e, false);
      // Pageable sources: staged before the call returns, so locals are fine.
      CUDA_CHECK(cudaMemcpyAsync(res_->staged13 + e, &a, sizeof(a), cudaMemcpyHostToDevice, stream));
      CUDA_CHECK(cudaMemcpyAsync(res_->staged2 + e, &b, sizeof(b), cudaMemcpyHostToDevice, stream));
    }
  // The table write: two entries per table. From pageable memory, so cudaMemcpyAsync stages the
  // source before it returns and the host mirrors may change again at once.
  for (int e : {cold, resident}) {
    CUDA_CHECK(cudaMemcpyAsync(table13_ + e, &res_->table13[static_cast<size_t>(e)], sizeof(kernels::ExpertMatrixPtrs),
                               cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaMemcpyAsync(table2_ + e, &res_->table2[static_cast<size_t>(e)], sizeof(kernels::ExpertMatrixPtrs),
                               cudaMemcpyHostToDevice, stream));
  }
  return Ok{};
}

Status MoeLayerCuda::allocate_workspace(const MoeCudaOptions& opt) {
  if (opt.capacity < 1) return Error::format("capacity must be >= 1, got {}", opt.capacity);
  opt_ = opt;
  const int E = shape_.num_experts, k = shape_.top_k, cap = opt.capacity;
  const int64_t H = shape_.hidden;
  const kernels::MoeWeightFormat kf = to_kernel(format_);
  // The prefill regime runs on wgmma where this build and the device allow it (sm_90a).
  const MoeGemmPath prefill_path =
      kernels::moe_gemm_wgmma_available() ? MoeGemmPath::kPrefillWgmma : MoeGemmPath::kPrefill;
  switch (opt.gemm_path) {
    case MoeGemmPath::kDecode: path_ = MoeGemmPath::kDecode; break;
    case MoeGemmPath::kPrefill: path_ = MoeGemmPath::kPrefill; break;
    case MoeGemmPath::kPrefillWgmma:
      if (!kernels::moe_gemm_wgmma_available())
        return Error("the wgmma GEMM path needs a build with 90a in MOEBIUS_CUDA_ARCHS and a compute capability 9.0 "
                     "GPU (H100/H200)");
      path_ = MoeGemmPath::kPrefillWgmma;
      break;
    case MoeGemmPath::kAuto:
      if (opt.block_m != 0 && opt.block_m != 64) {  // a block_m only one path runs decides it
        const bool prefill_takes = prefill_path == MoeGemmPath::kPrefillWgmma
                                       ? kernels::moe_gemm_wgmma_supports(kf, opt.block_m)
                                       : kernels::moe_gemm_prefill_supports(kf, opt.block_m);
        path_ = prefill_takes ? prefill_path : MoeGemmPath::kDecode;
      } else {
        path_ = tokens_per_expert(cap, k, E) >= prefill_min_tokens_per_expert(format_, prefill_path)
                    ? prefill_path
                    : MoeGemmPath::kDecode;
      }
      break;
  }
  if (path_ == MoeGemmPath::kPrefillWgmma) {
    block_m_ = opt.block_m ? opt.block_m : pick_wgmma_block_m(cap, k, E);
    if (!kernels::moe_gemm_wgmma_supports(kf, block_m_))
      return Error::format("the wgmma GEMMs take block_m 64 or 128; got {} for {}", block_m_,
                           kernel_format_name(format_));
  } else if (path_ == MoeGemmPath::kPrefill) {
    block_m_ = opt.block_m ? opt.block_m : pick_prefill_block_m(format_, cap, k, E);
    if (!kernels::moe_gemm_prefill_supports(kf, block_m_))
      return Error::format("the prefill GEMMs take block_m 64 (any format) or 128 (bf16, nvfp4); got {} for {}",
                           block_m_, kernel_format_name(format_));
  } else {
    block_m_ = opt.block_m ? opt.block_m : pick_block_m(cap, k, E);
    if (block_m_ != 8 && block_m_ != 16 && block_m_ != 32 && block_m_ != 64)
      return Error::format("the decode GEMMs take block_m 8, 16, 32 or 64; got {}", block_m_);
  }
  const int rpb = opt.decode_rows_per_block;
  if (rpb != 0 && rpb != 1 && rpb != 2 && rpb != 4 && rpb != 8)
    return Error::format("decode rows per block must be 0 (heuristic), 1, 2, 4 or 8; got {}", rpb);
  // [TAG_DECODE_SPLIT_K] What the decode GEMM1 launcher will run: the wide split needs one token
  // tile and K in exactly 8 x 4 chunks (8 x 2 for int2; the launcher also needs the activations
  // staged, which holds for the layer's own aligned x buffers at these sizes).
  int want_split = opt.decode_split_k_warps;
  if (want_split != 0 && want_split != 4 && want_split != kernels::kSplitKWarpsWide)
    return Error::format("decode split-K warps must be 0 (default), 4 or {}; got {}", kernels::kSplitKWarpsWide,
                         want_split);
  if (want_split == 0) {
    const char* env = std::getenv("MOEBIUS_DECODE_SPLIT_K_WARPS");
    if (env != nullptr && *env != '\0') {
      const std::string v(env);
      if (v != "4" && v != "8") return Error::format("MOEBIUS_DECODE_SPLIT_K_WARPS must be 4 or 8, got '{}'", v);
      want_split = std::stoi(v);
    }
  }
  split_k_warps_ = want_split == kernels::kSplitKWarpsWide && path_ == MoeGemmPath::kDecode && block_m_ == 8 &&
                           kernels::moe_gemm_gate_up_split_k_applies(kf, dims13_.chunks)
                       ? kernels::kSplitKWarpsWide
                       : 4;
  max_padded_ = kernels::moe_align_max_padded(cap, k, E, block_m_);
  max_tiles_ = kernels::moe_align_max_tiles(cap, k, E, block_m_);
  // The GEMM grid covers the live-tile bound, and never more entries than tile_expert holds.
  grid_tiles_ = std::min(kernels::moe_gemm_grid_tiles(cap, k, E, block_m_), max_tiles_);
  if (grid_tiles_ > 65535 || max_padded_ >= (int64_t{1} << 30))
    return Error::format("capacity {} is too large for one MoE launch", cap);

  // One block carved into 256-byte aligned pieces; the pieces' sizes are its layout, and layers
  // with the same layout share the block through opt.workspace_pool [TAG_MOE_WORKSPACE_POOL].
  size_t total = 0;
  std::string layout = fmt::format("moe H={} I={}:", H, shape_.intermediate);
  std::vector<std::function<void(uint8_t*)>> place;
  auto take = [&](auto*& ptr, size_t count) {
    using T = std::remove_reference_t<decltype(*ptr)>;
    const size_t off = total, bytes = sizeof(T) * std::max<size_t>(count, 1);
    total += (bytes + 255) / 256 * 256;
    layout += fmt::format(" {}", bytes);
    place.push_back([&ptr, off](uint8_t* base) { ptr = reinterpret_cast<T*>(base + off); });
  };
  take(logits_, static_cast<size_t>(cap) * E);
  take(topk_ids_, static_cast<size_t>(cap) * k);
  take(topk_weights_, static_cast<size_t>(cap) * k);
  take(expert_offsets_, static_cast<size_t>(E) + 1);
  take(sorted_pair_ids_, static_cast<size_t>(cap) * k);
  take(padded_offsets_, static_cast<size_t>(E) + 1);
  take(padded_pair_ids_, static_cast<size_t>(max_padded_));
  take(tile_expert_, static_cast<size_t>(max_tiles_));
  take(num_tiles_, 1);
  take(work_counters_, 4);
  take(fused_sync_, kernels::kFusedExpertsSyncWords);
  take(h_, static_cast<size_t>(max_padded_) * h_stride_);  // zeroed: columns past I are never written
  // y doubles as the aligned copy of an unaligned x for the wgmma GEMM1 (enqueue_stage): it is free
  // until GEMM2 writes it, and cap x H fp32 per slot is >= cap x round8(H) bf16 once H >= 8.
  take(y_, std::max(static_cast<size_t>(cap) * k * H, (static_cast<size_t>(cap) * aligned_x_stride() + 1) / 2));
  if (opt.workspace_pool) {
    MOEBIUS_ASSIGN_OR_RETURN(workspace_, opt.workspace_pool->acquire(layout, total));
  } else {
    DeviceZeroAllocator a;
    MOEBIUS_ASSIGN_OR_RETURN(void* p, a.allocate(total));
    workspace_ = std::make_shared<const MoeWorkspacePool::Block>(p, total, a);
  }
  workspace_bytes_ = total;
  for (auto& f : place) f(static_cast<uint8_t*>(workspace_->data()));
  fused_routing_ = opt.fuse_routing && cap <= kFusedRoutingMaxTokens && kernels::moe_route_small_supported(cap, route_);
  MOEBIUS_ASSIGN_OR_RETURN(const bool want_topk_align, option_or_env("MOEBIUS_ROUTE_TOPK_ALIGN", opt.fuse_topk_align));
  topk_align_ = !fused_routing_ && want_topk_align && cap <= kTopKAlignMaxTokens &&
                kernels::moe_route_topk_align_supported(cap, route_);
  // The fused kernel reads experts with the copy engine from device memory only (cold experts in
  // mapped host memory keep the three kernels) and needs 16-byte rows of x for its staging.
  // MOEBIUS_FUSED_EXPERTS=0|1 overrides the option in every layer (an experiment knob for
  // whole-model runs; the GPU tests expect it unset).
  MOEBIUS_ASSIGN_OR_RETURN(const bool want_fused, option_or_env("MOEBIUS_FUSED_EXPERTS", opt.fuse_experts));
  fused_experts_ = want_fused && path_ == MoeGemmPath::kDecode &&
                   opt.combine == kernels::MoeCombineMode::kStore && slots_ == E && H % 8 == 0 &&
                   kernels::moe_fused_experts_supported(kf, dims13_, dims2_, cap, block_m_, k, E, static_cast<int>(max_tiles_));
  if (fused_experts_) split_k_warps_ = 4;  // GEMM1 runs inside the fused kernel ([TAG_DECODE_SPLIT_K])
  return Ok{};
}

Result<std::unique_ptr<MoeLayerCuda>> MoeLayerCuda::share_weights(const MoeCudaOptions& opt) const {
  std::unique_ptr<MoeLayerCuda> L(new MoeLayerCuda());
  L->shape_ = shape_;
  L->format_ = format_;
  L->route_ = route_;
  L->act_ = act_;
  L->dims13_ = dims13_;
  L->dims2_ = dims2_;
  L->expert_bytes_ = expert_bytes_;
  L->h_stride_ = h_stride_;
  L->weights_ = weights_;
  L->w13_ = w13_;
  L->s13_ = s13_;
  L->w2_ = w2_;
  L->s2_ = s2_;
  L->w13_bytes_ = w13_bytes_;
  L->s13_bytes_ = s13_bytes_;
  L->w2_bytes_ = w2_bytes_;
  L->s2_bytes_ = s2_bytes_;
  L->table13_ = table13_;
  L->table2_ = table2_;
  L->res_ = res_;
  L->slots_ = slots_;
  L->cold_bytes_ = cold_bytes_;
  L->cw13_ = cw13_;
  L->cs13_ = cs13_;
  L->cw2_ = cw2_;
  L->cs2_ = cs2_;
  L->dcw13_ = dcw13_;
  L->dcs13_ = dcs13_;
  L->dcw2_ = dcw2_;
  L->dcs2_ = dcs2_;
  L->router_weight_ = router_weight_;
  L->correction_bias_ = correction_bias_;
  MOEBIUS_TRY(L->allocate_workspace(opt));
  return L;
}

Result<std::unique_ptr<MoeLayerCuda>> MoeLayerCuda::create(const cpu::MoeLayerReference& layer,
                                                           const MoeCudaOptions& opt, const ExpertResidency& residency) {
  MOEBIUS_ASSIGN_OR_RETURN(PackedMoeLayer packed, pack_moe_layer(layer));
  return create(packed, opt, residency);
}

Result<std::unique_ptr<MoeLayerCuda>> MoeLayerCuda::create(const PackedMoeLayer& p, const MoeCudaOptions& opt,
                                                           const ExpertResidency& residency) {
  const int E = p.shape.num_experts;
  if (E < 1 || static_cast<int>(p.w13.size()) != E || static_cast<int>(p.w2.size()) != E ||
      p.router.size() != static_cast<size_t>(E) * static_cast<size_t>(p.shape.hidden))
    return Error::format("a packed MoE layer of E={} holds {} gate/up, {} down and {} router values", E, p.w13.size(),
                         p.w2.size(), p.router.size());
  std::unique_ptr<MoeLayerCuda> L(new MoeLayerCuda());
  MOEBIUS_TRY(L->allocate(p.shape, p.format, p.w13[0], p.w2[0], opt, residency));
  const cpu::RouterConfig& r = p.routing;
  L->route_.scoring = r.scoring == cpu::RouterScoring::kSoftmax ? kernels::RouteScoring::kSoftmax
                                                                : kernels::RouteScoring::kSigmoid;
  L->route_.renormalize = r.renormalize;
  L->route_.n_groups = r.n_groups;
  L->route_.topk_groups = r.topk_groups;
  L->route_.routed_scaling_factor = r.routed_scaling_factor;
  if (!r.correction_bias.empty()) {
    MOEBIUS_ASSIGN_OR_RETURN(Buffer b, Buffer::allocate(MemoryKind::kDevice, sizeof(float) * E));
    L->correction_bias_ = b.as<float>();
    L->weights_->push_back(std::move(b));
  }
  L->act_ = to_kernel(p.activation);
  MOEBIUS_TRY(L->check_compatible(p));
  L->upload(p);
  return L;
}

Status MoeLayerCuda::check_compatible(const PackedMoeLayer& p) const {
  const cpu::MoeShape& s = p.shape;
  if (s.hidden != shape_.hidden || s.intermediate != shape_.intermediate || s.num_experts != shape_.num_experts ||
      s.top_k != shape_.top_k)
    return Error::format("the MoE layer is H={} I={} E={} k={}, the serving one H={} I={} E={} k={}", s.hidden,
                         s.intermediate, s.num_experts, s.top_k, shape_.hidden, shape_.intermediate,
                         shape_.num_experts, shape_.top_k);
  if (p.format != format_)
    return Error::format("the experts are {}, the serving ones {}; a weight update keeps the expert format",
                         kernel_format_name(p.format), kernel_format_name(format_));
  const size_t E = static_cast<size_t>(shape_.num_experts);
  if (p.w13.size() != E || p.w2.size() != E || p.router.size() != E * static_cast<size_t>(shape_.hidden))
    return Error::format("the packed layer holds {} gate/up, {} down and {} router values for E={}", p.w13.size(),
                         p.w2.size(), p.router.size(), E);
  for (size_t e = 0; e < E; ++e) {
    const PackedMatrix& a = p.w13[e];
    const PackedMatrix& b = p.w2[e];
    // The group size decides the scale bytes and the kernels' group stride (dims13_/dims2_).
    if (a.weight.size() != w13_bytes_ || a.scales.size() != s13_bytes_ || b.weight.size() != w2_bytes_ ||
        b.scales.size() != s2_bytes_ || a.group_size != dims13_.group_size || b.group_size != dims2_.group_size)
      return Error::format("expert {} packs to {} + {} / {} + {} bytes with group size {} / {}; the serving "
                           "layer holds {} + {} / {} + {} bytes with group size {} / {} (gate/up, down: weights + "
                           "scales)",
                           e, a.weight.size(), a.scales.size(), b.weight.size(), b.scales.size(), a.group_size,
                           b.group_size, w13_bytes_, s13_bytes_, w2_bytes_, s2_bytes_, dims13_.group_size,
                           dims2_.group_size);
  }
  const cpu::RouterConfig& r = p.routing;
  const bool softmax = r.scoring == cpu::RouterScoring::kSoftmax;
  if (softmax != (route_.scoring == kernels::RouteScoring::kSoftmax) || r.renormalize != route_.renormalize ||
      r.n_groups != route_.n_groups || r.topk_groups != route_.topk_groups ||
      r.routed_scaling_factor != route_.routed_scaling_factor ||
      r.correction_bias.empty() != (correction_bias_ == nullptr))
    return Error("the routing settings (scoring, renormalization, groups, scaling, correction bias) differ from the "
                 "serving layer's");
  if (r.correction_bias.size() != (correction_bias_ == nullptr ? 0 : E))
    return Error::format("the router's correction bias has {} values for E={}", r.correction_bias.size(), E);
  const kernels::MoeActivationParams act = to_kernel(p.activation);
  if (act.kind != act_.kind || act.limit != act_.limit || act.alpha != act_.alpha)
    return Error("the expert activation differs from the serving layer's");
  return Ok{};
}

Status MoeLayerCuda::update_weights(const PackedMoeLayer& p) {
  MOEBIUS_TRY(check_compatible(p));
  upload(p);
  return Ok{};
}

// [TAG_MOE_WEIGHTS_IN_PLACE] Writes every weight byte of `p` into the buffers allocate() made, at
// the same addresses: a captured graph that reads them stays valid. The expert tables are
// rewritten whole because they carry the NVFP4 global scales next to the (unchanged) pointers.
// Synchronous (cudaMemcpy from pageable memory, then a device synchronize): the caller makes sure
// no forward that reads these weights is in flight.
void MoeLayerCuda::upload(const PackedMoeLayer& p) {
  const int E = shape_.num_experts;
  for (int e = 0; e < E; ++e) {
    const PackedMatrix& a = p.w13[static_cast<size_t>(e)];
    const PackedMatrix& b = p.w2[static_cast<size_t>(e)];
    MOEBIUS_ASSERT(a.weight.size() == w13_bytes_ && a.scales.size() == s13_bytes_ && b.weight.size() == w2_bytes_ &&
                   b.scales.size() == s2_bytes_);
    // Wherever the expert lives now (a device slot or pinned host memory: cudaMemcpyDefault).
    const ExpertAddr dst = copy_addr(e);
    CUDA_CHECK(cudaMemcpy(dst.w13, a.weight.data(), a.weight.size(), cudaMemcpyDefault));
    if (!a.scales.empty()) CUDA_CHECK(cudaMemcpy(dst.s13, a.scales.data(), a.scales.size(), cudaMemcpyDefault));
    CUDA_CHECK(cudaMemcpy(dst.w2, b.weight.data(), b.weight.size(), cudaMemcpyDefault));
    if (!b.scales.empty()) CUDA_CHECK(cudaMemcpy(dst.s2, b.scales.data(), b.scales.size(), cudaMemcpyDefault));
    res_->table13[static_cast<size_t>(e)].global_scale[0] = a.global_scale[0];
    res_->table13[static_cast<size_t>(e)].global_scale[1] = a.global_scale[1];
    res_->table2[static_cast<size_t>(e)].global_scale[0] = b.global_scale[0];
    res_->table2[static_cast<size_t>(e)].global_scale[1] = b.global_scale[1];
  }
  CUDA_CHECK(cudaMemcpy(table13_, res_->table13.data(), sizeof(kernels::ExpertMatrixPtrs) * E, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(table2_, res_->table2.data(), sizeof(kernels::ExpertMatrixPtrs) * E, cudaMemcpyHostToDevice));
  write_staged_tables();  // they carry the same global scales
  CUDA_CHECK(cudaMemcpy(router_weight_, p.router.data(), p.router.size() * 2, cudaMemcpyHostToDevice));
  if (correction_bias_ != nullptr)
    CUDA_CHECK(cudaMemcpy(correction_bias_, p.routing.correction_bias.data(), sizeof(float) * E,
                          cudaMemcpyHostToDevice));
  // cudaMemcpy from pageable memory may return before its DMA lands, and the model's stream does
  // not wait for the legacy stream: finish every copy before the next forward.
  CUDA_CHECK(cudaDeviceSynchronize());
}

Result<std::unique_ptr<MoeLayerCuda>> MoeLayerCuda::create_dummy(const cpu::MoeShape& s, KernelFormat format,
                                                                 int group_size, const MoeCudaOptions& opt,
                                                                 uint64_t seed, const ExpertResidency& residency) {
  if (s.hidden <= 0 || s.intermediate <= 0 || s.num_experts <= 0 || s.top_k <= 0 || s.top_k > s.num_experts)
    return Error::format("bad MoE shape H={} I={} E={} k={}", s.hidden, s.intermediate, s.num_experts, s.top_k);
  if (format == KernelFormat::kNvFp4 && (s.hidden % 16 != 0 || s.intermediate % 16 != 0))
    return Error("NVFP4 needs H and I to be multiples of 16");
  const int g = (format == KernelFormat::kInt4 || format == KernelFormat::kInt2) ? group_size : 0;
  if (g != 0 && (g % 16 != 0 || s.hidden % g != 0 || s.intermediate % g != 0))
    return Error::format("group size {} must be a multiple of 16 dividing H={} and I={}", g, s.hidden, s.intermediate);
  const auto [w13, w2] = dummy_expert_shapes(s, format, group_size);
  std::unique_ptr<MoeLayerCuda> L(new MoeLayerCuda());
  MOEBIUS_TRY(L->allocate(s, format, w13, w2, opt, residency));
  const int E = s.num_experts;
  cudaStream_t st = nullptr;
  // The device slots, then the cold region through its mapped alias (the fill kernels write it
  // over PCIe, once at load) [TAG_EXPERT_OFFLOAD].
  struct Region {
    uint8_t *w13, *s13, *w2, *s2;
    size_t n;
    uint64_t seed;
  };
  const Region regions[2] = {{L->w13_, L->s13_, L->w2_, L->s2_, static_cast<size_t>(L->slots_), seed},
                             {L->dcw13_, L->dcs13_, L->dcw2_, L->dcs2_, static_cast<size_t>(E - L->slots_), seed + 3}};
  for (const Region& r : regions) {
    if (r.n == 0) continue;
    if (format == KernelFormat::kBF16) {
      kernels::launch_fill_random_bf16(r.w13, L->w13_bytes_ * r.n / 2, 0.03f, r.seed, st);
      kernels::launch_fill_random_bf16(r.w2, L->w2_bytes_ * r.n / 2, 0.03f, r.seed + 1, st);
    } else {
      kernels::launch_fill_random_bytes(r.w13, L->w13_bytes_ * r.n, r.seed, st);
      kernels::launch_fill_random_bytes(r.w2, L->w2_bytes_ * r.n, r.seed + 1, st);
    }
    if (format == KernelFormat::kNvFp4) {  // e4m3 1.0 block scales; global scale 1
      CUDA_CHECK(cudaMemset(r.s13, 0x38, L->s13_bytes_ * r.n));
      CUDA_CHECK(cudaMemset(r.s2, 0x38, L->s2_bytes_ * r.n));
    } else if (g != 0) {  // fp16 1/64 group scales
      kernels::launch_fill_u16(r.s13, L->s13_bytes_ * r.n / 2, 0x2400, st);
      kernels::launch_fill_u16(r.s2, L->s2_bytes_ * r.n / 2, 0x2400, st);
    }
  }
  kernels::launch_fill_random_bf16(L->router_weight_, static_cast<size_t>(E) * s.hidden, 0.05f, seed + 2, st);
  CUDA_CHECK(cudaMemcpy(L->table13_, L->res_->table13.data(), sizeof(kernels::ExpertMatrixPtrs) * E,
                        cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(L->table2_, L->res_->table2.data(), sizeof(kernels::ExpertMatrixPtrs) * E,
                        cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaDeviceSynchronize());
  return L;
}

bool MoeLayerCuda::uses_stage(MoeStage stage) const {
  switch (stage) {
    case MoeStage::kRouteFused: return fused_routing_;
    case MoeStage::kRouterLogits: return !fused_routing_;
    case MoeStage::kTopKAlign: return topk_align_;
    case MoeStage::kTopK:
    case MoeStage::kAlign: return !fused_routing_ && !topk_align_;
    case MoeStage::kExpertsFused: return fused_experts_;
    case MoeStage::kGateUp:
    case MoeStage::kDown: return !fused_experts_;
    case MoeStage::kCombine: return !fused_experts_ && opt_.combine == kernels::MoeCombineMode::kStore;
    case MoeStage::kCount: break;
  }
  return false;
}

// The expert stages of a forward over x: the fused kernel, or GEMM1, GEMM2 and the combine.
void MoeLayerCuda::enqueue_experts(const __nv_bfloat16* x, const int32_t* num_tokens, const int32_t* topk_ids,
                                   const float* topk_weights, __nv_bfloat16* out, cudaStream_t stream,
                                   bool with_combine) {
  auto wait_down = [&] {
    if (down_wait_ == nullptr) return;
    CUDA_CHECK(cudaStreamWaitEvent(stream, down_wait_, 0));
    down_wait_ = nullptr;
  };
  if (fused_experts_ && reinterpret_cast<uintptr_t>(x) % 16 == 0) {
    MOEBIUS_ASSERT(with_combine, "the fused experts kernel cannot defer its combine");
    wait_down();
    enqueue_stage(MoeStage::kExpertsFused, x, num_tokens, topk_ids, topk_weights, out, stream);
    return;
  }
  for (MoeStage s : {MoeStage::kGateUp, MoeStage::kDown, MoeStage::kCombine}) {
    if (s == MoeStage::kDown) wait_down();
    if (s != MoeStage::kCombine || (with_combine && opt_.combine == kernels::MoeCombineMode::kStore))
      enqueue_stage(s, x, num_tokens, topk_ids, topk_weights, out, stream);
  }
}

bool MoeLayerCuda::bf16_y() const {
  // MOEBIUS_MOE_BF16_Y: "0" never, "1" on every wgmma layer, unset: the default rule below.
  static const int env = [] {
    const char* v = std::getenv("MOEBIUS_MOE_BF16_Y");
    if (v == nullptr || v[0] == '\0' || v[1] != '\0') return -1;
    return v[0] == '0' ? 0 : v[0] == '1' ? 1 : -1;
  }();
  const bool wgmma = path_ == MoeGemmPath::kPrefillWgmma;
  // The default: 128-token tiles only (PERF.md run Z6, H100: T = 1024-4096 3-5% faster in every
  // format; at block_m 64, T = 256, the paired bf16 stores cost GEMM2 more than the combine saves).
  const bool wanted = opt_.bf16_y > 0 || (opt_.bf16_y < 0 && (env >= 0 ? env == 1 : block_m_ == 128));
  return wanted && wgmma && opt_.combine == kernels::MoeCombineMode::kStore && shape_.hidden % 8 == 0 &&
         reinterpret_cast<uintptr_t>(y_) % 16 == 0;
}

bool MoeLayerCuda::defers_combine(const __nv_bfloat16* x) const {
  // The kStore rows must exist (not the atomic combine, not the fused experts, which combine in
  // their own kernel) and suit the folding kernel's 16-byte loads.
  const bool fused = fused_experts_ && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  return opt_.combine == kernels::MoeCombineMode::kStore && !fused && !bf16_y() && shape_.hidden % 4 == 0 &&
         reinterpret_cast<uintptr_t>(y_) % 16 == 0;
}

kernels::MoeCombineSource MoeLayerCuda::forward_deferring_combine(const __nv_bfloat16* x, const int32_t* num_tokens,
                                                                  cudaStream_t stream) {
  MOEBIUS_ASSERT(defers_combine(x), "forward_deferring_combine: this layer cannot defer its combine");
  for (MoeStage s : kRoutingStages)
    if (uses_stage(s)) enqueue_stage(s, x, num_tokens, topk_ids_, topk_weights_, nullptr, stream);
  run_after_routing_hook(stream);
  enqueue_experts(x, num_tokens, topk_ids_, topk_weights_, nullptr, stream, /*with_combine=*/false);
  kernels::MoeCombineSource c;
  c.y = y_;
  c.y_stride = static_cast<int>(shape_.hidden);
  c.weights = topk_weights_;
  c.top_k = shape_.top_k;
  c.num_tokens = num_tokens;
  c.capacity = opt_.capacity;
  return c;
}

void MoeLayerCuda::forward(const __nv_bfloat16* x, const int32_t* num_tokens, __nv_bfloat16* out,
                           cudaStream_t stream) {
  for (MoeStage s : kRoutingStages)
    if (uses_stage(s)) enqueue_stage(s, x, num_tokens, topk_ids_, topk_weights_, out, stream);
  run_after_routing_hook(stream);
  enqueue_experts(x, num_tokens, topk_ids_, topk_weights_, out, stream);
}

void MoeLayerCuda::run_after_routing_hook(cudaStream_t stream) {
  if (!after_routing_) return;
  const std::function<void(cudaStream_t)> f = std::move(after_routing_);
  after_routing_ = nullptr;
  f(stream);
}

void MoeLayerCuda::forward_routed(const __nv_bfloat16* x, const int32_t* num_tokens, const int32_t* topk_ids,
                                  const float* topk_weights, __nv_bfloat16* out, cudaStream_t stream) {
  enqueue_stage(MoeStage::kAlign, x, num_tokens, topk_ids, topk_weights, out, stream);
  enqueue_experts(x, num_tokens, topk_ids, topk_weights, out, stream);
}

bool router_takes_gemm(int capacity, int hidden, int num_experts) {
  const double tiles_us = 2.5 + 4.7e-8 * static_cast<double>(capacity) * num_experts * hidden;
  const double gemm_floor_us = 0.8 + 4.2 * hidden / 1024.0;
  return capacity >= kRouterGemmMinTokens && tiles_us > gemm_floor_us;
}

void enqueue_router_logits(const __nv_bfloat16* x, int x_stride, const __nv_bfloat16* router_weight,
                           const int32_t* num_tokens, int capacity, int hidden, int num_experts, float* logits,
                           cudaStream_t stream) {
  if (router_takes_gemm(capacity, hidden, num_experts) &&
      kernels::moe_router_gemm_supported(x, x_stride, hidden, num_experts))
    kernels::launch_moe_router_gemm(x, x_stride, router_weight, num_tokens, capacity, hidden, num_experts, logits,
                                    stream);
  else
    kernels::launch_moe_router_logits(x, x_stride, router_weight, num_tokens, capacity, hidden, num_experts, logits,
                                      stream);
}

void MoeLayerCuda::enqueue_stage(MoeStage stage, const __nv_bfloat16* x, const int32_t* num_tokens,
                                 const int32_t* topk_ids, const float* topk_weights, __nv_bfloat16* out,
                                 cudaStream_t stream) {
  const int E = shape_.num_experts, k = shape_.top_k, cap = opt_.capacity;
  const int H = static_cast<int>(shape_.hidden);
  kernels::MoeTiles tiles;
  tiles.padded_pair_ids = padded_pair_ids_;
  tiles.tile_expert = tile_expert_;
  tiles.block_m = block_m_;
  tiles.grid_tiles = static_cast<int>(grid_tiles_);
  tiles.top_k = k;
  tiles.max_tile_rows = std::min(block_m_, cap);
  tiles.rows_per_block = opt_.decode_rows_per_block;
  tiles.split_k_warps = split_k_warps_;  // GEMM1 only ([TAG_DECODE_SPLIT_K])
  const kernels::MoeWeightFormat f = to_kernel(format_);
  const bool store = opt_.combine == kernels::MoeCombineMode::kStore;
  // All paths take the same arguments; pick the launcher pair once.
  auto* gate_up = &kernels::launch_moe_gemm_gate_up;
  auto* down = &kernels::launch_moe_gemm_down;
  if (path_ == MoeGemmPath::kPrefill) {
    gate_up = &kernels::launch_moe_gemm_prefill_gate_up;
    down = &kernels::launch_moe_gemm_prefill_down;
  } else if (path_ == MoeGemmPath::kPrefillWgmma) {
    gate_up = &kernels::launch_moe_gemm_wgmma_gate_up;
    down = &kernels::launch_moe_gemm_wgmma_down;
  }
  switch (stage) {
    case MoeStage::kRouteFused:
      MOEBIUS_ASSERT(fused_routing_);
      kernels::launch_moe_route_small(x, H, router_weight_, H, correction_bias_, num_tokens, cap, route_, block_m_,
                                      logits_, topk_ids_, topk_weights_, expert_offsets_,
                                      sorted_pair_ids_, padded_offsets_, padded_pair_ids_, tile_expert_, num_tiles_,
                                      stream);
      return;
    case MoeStage::kRouterLogits:
      enqueue_router_logits(x, H, router_weight_, num_tokens, cap, H, E, logits_, stream);
      return;
    case MoeStage::kTopKAlign:
      MOEBIUS_ASSERT(topk_align_);
      kernels::launch_moe_route_topk_align(logits_, correction_bias_, num_tokens, cap, route_, block_m_, topk_ids_,
                                           topk_weights_, expert_offsets_, sorted_pair_ids_, padded_offsets_,
                                           padded_pair_ids_, tile_expert_, num_tiles_, stream);
      return;
    case MoeStage::kTopK:
      kernels::launch_moe_route_topk(logits_, correction_bias_, num_tokens, cap, route_, topk_ids_, topk_weights_,
                                     stream);
      return;
    case MoeStage::kAlign:
      kernels::launch_moe_align(topk_ids, num_tokens, cap, k, E, block_m_, expert_offsets_, sorted_pair_ids_,
                                padded_offsets_, padded_pair_ids_, tile_expert_, num_tiles_, stream);
      return;
    case MoeStage::kExpertsFused: {
      MOEBIUS_ASSERT(fused_experts_);
      kernels::MoeFusedExpertsArgs a;
      a.format = f;
      a.experts13 = table13_;
      a.experts2 = table2_;
      a.num_experts = E;
      a.dims13 = dims13_;
      a.dims2 = dims2_;
      a.padded_pair_ids = padded_pair_ids_;
      a.tile_expert = tile_expert_;
      a.num_tiles = num_tiles_;
      a.max_tiles = static_cast<int>(max_tiles_);
      a.top_k = k;
      a.num_tokens = num_tokens;
      a.capacity = cap;
      a.x = x;
      a.x_stride = H;
      a.act = act_;
      a.h = h_;
      a.h_stride = h_stride_;
      a.topk_weights = topk_weights;
      a.out = out;
      a.out_stride = H;
      a.sync = fused_sync_;
      kernels::launch_moe_fused_experts(a, stream);
      return;
    }
    case MoeStage::kGateUp: {
      tiles.work_counter = work_counters_;
      const __nv_bfloat16* gx = x;
      int gx_stride = H;
      if (path_ == MoeGemmPath::kPrefillWgmma && !kernels::moe_gemm_wgmma_rows_aligned(x, H)) {
        // wgmma gathers x rows with 16-byte copies and x is the caller's: a forward with unaligned
        // rows copies them (all capacity rows, the live count is on the device) into y, which is
        // free until GEMM2, at an aligned stride. A copy node, so graph capture still holds.
        gx_stride = aligned_x_stride();
        auto* staged = reinterpret_cast<__nv_bfloat16*>(y_);
        CUDA_CHECK(cudaMemcpy2DAsync(staged, sizeof(__nv_bfloat16) * gx_stride, x, sizeof(__nv_bfloat16) * H,
                                     sizeof(__nv_bfloat16) * H, cap, cudaMemcpyDeviceToDevice, stream));
        gx = staged;
      }
      gate_up(f, use_staging_ ? res_->staged13 : table13_, dims13_, tiles, gx, gx_stride, act_, h_, h_stride_, stream);
      return;
    }
    case MoeStage::kDown:
      tiles.work_counter = work_counters_ + 2;
      if (store) {
        down(f, use_staging_ ? res_->staged2 : table2_, dims2_, tiles, h_, h_stride_,
             bf16_y() ? kernels::MoeCombineMode::kStoreBf16 : kernels::MoeCombineMode::kStore, y_, H, nullptr, nullptr,
             0, stream);
      } else {
        // The atomic combine accumulates into out, so the capacity rows are zeroed first.
        CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(__nv_bfloat16) * static_cast<size_t>(cap) * H, stream));
        down(f, use_staging_ ? res_->staged2 : table2_, dims2_, tiles, h_, h_stride_, kernels::MoeCombineMode::kAtomic,
             nullptr, 0, topk_weights, out, H, stream);
      }
      return;
    case MoeStage::kCombine:
      if (store && bf16_y())
        kernels::launch_moe_combine(reinterpret_cast<const __nv_bfloat16*>(y_), H, topk_weights, num_tokens, cap, k, H,
                                    out, H, stream, combine_trigger_early_);
      else if (store)
        kernels::launch_moe_combine(y_, H, topk_weights, num_tokens, cap, k, H, out, H, stream, combine_trigger_early_);
      return;
    case MoeStage::kCount:
      return;
  }
}

}  // namespace moebius::moe

#endif  // MOEBIUS_HAS_CUDA
