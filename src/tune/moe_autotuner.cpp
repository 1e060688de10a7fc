#include "tune/moe_autotuner.h"

#ifdef MOEBIUS_HAS_CUDA

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "core/dtype.h"
#include "core/log.h"
#include "kernels/cuda_check.h"
#include "kernels/fill.cuh"
#include "kernels/moe_gemm_wgmma.cuh"

namespace moebius::tune {

namespace {

// [TAG_MOE_GEMM_PATHS] The GEMM paths the tuner tries and their tokens-per-tile values; a new
// MoeGemmPath joins here (and in options_for's name lookup, which walks this list).
struct PathCandidates {
  moe::MoeGemmPath path;
  std::vector<int> block_m;
};
const std::vector<PathCandidates>& tuned_paths() {
  static const std::vector<PathCandidates> paths = [] {
    std::vector<PathCandidates> p = {
        {moe::MoeGemmPath::kDecode, {8, 16, 32, 64}},
        {moe::MoeGemmPath::kPrefill, {64, 128}},
    };
    // The Hopper wgmma kernels where this build and GPU run them (a layer refuses the path
    // otherwise; the mma.sync prefill path takes block_m 128 for bf16 and nvfp4 only, which the
    // layer checks).
    if (kernels::moe_gemm_wgmma_available()) p.push_back({moe::MoeGemmPath::kPrefillWgmma, {64, 128}});
    return p;
  }();
  return paths;
}

// [TAG_DECODE_ROW_TILES] Row tiles per block the tuner tries: the decode kernel's one-token-tile
// case only (block_m 8); 0 is the kernel's heuristic. Elsewhere the knob does nothing.
std::vector<int> rows_candidates(moe::MoeGemmPath path, int block_m) {
  if (path == moe::MoeGemmPath::kDecode && block_m == 8) return {0, 1, 2, 4, 8};
  return {0};
}

// [TAG_DECODE_SPLIT_K] Warps splitting the decode GEMM1's K (a layer where the wide split does not
// apply resolves 8 to 4, and the duplicate is skipped).
std::vector<int> split_k_candidates(moe::MoeGemmPath path, int block_m) {
  if (path == moe::MoeGemmPath::kDecode && block_m == 8) return {4, kernels::kSplitKWarpsWide};
  return {4};
}

std::vector<std::pair<int, int>> grid_of(const std::vector<int>& a, const std::vector<int>& b) {
  std::vector<std::pair<int, int>> out;
  for (int x : a)
    for (int y : b) out.emplace_back(x, y);
  return out;
}

// A candidate that is this many times slower than the best so far after one timing is dropped.
constexpr double kAbandonFactor = 3.0;
// Bytes of random inputs the timing rotates through (at most kMaxInputs inputs).
constexpr size_t kInputBytes = size_t{64} << 20;
constexpr int kMaxInputs = 8;

std::string activation_name(const kernels::MoeActivationParams& a) {
  switch (a.kind) {
    case kernels::MoeActivation::kSiLU: return "silu";
    case kernels::MoeActivation::kSiLUClamped: return fmt::format("silu_clamped({})", a.limit);
    case kernels::MoeActivation::kGptOss: return fmt::format("gptoss({},{})", a.limit, a.alpha);
  }
  return "?";
}

// Device memory for the duration of one tuning.
class DeviceMem {
 public:
  explicit DeviceMem(size_t bytes) { CUDA_CHECK(cudaMalloc(&p_, std::max<size_t>(bytes, 16))); }
  ~DeviceMem() { (void)cudaFree(p_); }
  DeviceMem(const DeviceMem&) = delete;
  DeviceMem& operator=(const DeviceMem&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }

 private:
  void* p_ = nullptr;
};

class Stream {
 public:
  Stream() { CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
  ~Stream() { (void)cudaStreamDestroy(s_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  operator cudaStream_t() const { return s_; }  // NOLINT(google-explicit-constructor)

 private:
  cudaStream_t s_ = nullptr;
};

class Events {
 public:
  Events() {
    CUDA_CHECK(cudaEventCreate(&start));
    CUDA_CHECK(cudaEventCreate(&stop));
  }
  ~Events() {
    (void)cudaEventDestroy(start);
    (void)cudaEventDestroy(stop);
  }
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
  cudaEvent_t start = nullptr, stop = nullptr;
};

// Everything one tuning shares between candidates: the inputs, the live count, the output.
struct Bench {
  int tokens = 0;
  int64_t hidden = 0;
  int inputs = 1;
  const __nv_bfloat16* x = nullptr;  // [inputs][tokens, H]
  const int32_t* num_tokens = nullptr;
  __nv_bfloat16* out = nullptr;      // [tokens, H]
  cudaStream_t stream = nullptr;
  const Events* events = nullptr;

  const __nv_bfloat16* input(int i) const { return x + static_cast<int64_t>(i) * tokens * hidden; }
};

// One forward on input 0; the output [tokens, H] as floats.
std::vector<float> run_once(moe::MoeLayerCuda& layer, const Bench& b) {
  layer.forward(b.input(0), b.num_tokens, b.out, b.stream);
  CUDA_CHECK(cudaStreamSynchronize(b.stream));
  std::vector<uint16_t> bits(static_cast<size_t>(b.tokens) * static_cast<size_t>(b.hidden));
  CUDA_CHECK(cudaMemcpy(bits.data(), b.out, bits.size() * 2, cudaMemcpyDeviceToHost));
  std::vector<float> f(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) f[i] = bf16_bits_to_float(bits[i]);
  return f;
}

// sum (a - ref)^2 / sum ref^2; infinity when a value of `a` is not finite.
double nmse(const std::vector<float>& a, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return std::numeric_limits<double>::infinity();
    const double d = static_cast<double>(a[i]) - ref[i];
    num += d * d;
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return den > 0 ? num / den : (num > 0 ? std::numeric_limits<double>::infinity() : 0.0);
}

// Microseconds per forward: `inputs` forwards (one per input) captured in a graph and replayed;
// the minimum over `samples` samples of about target_ms each. Sets *abandoned (and returns the
// first measurement) when that is above abandon_us.
double time_forward_us(moe::MoeLayerCuda& layer, const Bench& b, double target_ms, int samples, double abandon_us,
                       bool* abandoned) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CUDA_CHECK(cudaStreamBeginCapture(b.stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < b.inputs; ++i) layer.forward(b.input(i), b.num_tokens, b.out, b.stream);
  CUDA_CHECK(cudaStreamEndCapture(b.stream, &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_CHECK(cudaGraphLaunch(exec, b.stream));  // warm-up: first-launch costs stay out of the timing
  auto sample = [&](int replays) {
    CUDA_CHECK(cudaEventRecord(b.events->start, b.stream));
    for (int i = 0; i < replays; ++i) CUDA_CHECK(cudaGraphLaunch(exec, b.stream));
    CUDA_CHECK(cudaEventRecord(b.events->stop, b.stream));
    CUDA_CHECK(cudaEventSynchronize(b.events->stop));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, b.events->start, b.events->stop));
    return static_cast<double>(ms);
  };
  const double first_ms = sample(1);
  double best = 1e3 * first_ms / b.inputs;
  *abandoned = best > abandon_us;
  if (!*abandoned) {
    const int replays = static_cast<int>(std::clamp(std::ceil(target_ms / std::max(first_ms, 1e-3)), 1.0, 1000.0));
    for (int s = 0; s < samples; ++s) best = std::min(best, 1e3 * sample(replays) / (replays * b.inputs));
  }
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  return best;
}

}  // namespace

Result<DeviceIdentity> current_device_identity() {
  DeviceIdentity d;
  if (cudaGetDevice(&d.device) != cudaSuccess) {
    (void)cudaGetLastError();
    return Error("no CUDA device is visible");
  }
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, d.device));
  d.name = prop.name;
  const auto* u = reinterpret_cast<const unsigned char*>(prop.uuid.bytes);
  std::string hex;
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) hex += '-';
    hex += fmt::format("{:02x}", u[i]);
  }
  d.uuid = "GPU-" + hex;
  int v = 0;
  CUDA_CHECK(cudaRuntimeGetVersion(&v));
  d.cuda_runtime = fmt::format("{}.{}", v / 1000, (v % 1000) / 10);
  return d;
}

Result<std::unique_ptr<MoeAutotuner>> MoeAutotuner::create(const MoeAutotunerOptions& options) {
  std::unique_ptr<MoeAutotuner> t(new MoeAutotuner());
  t->opt_ = options;
  MOEBIUS_ASSIGN_OR_RETURN(t->device_, current_device_identity());
  if (options.persist) {
    std::string dir = options.cache_dir;
    if (dir.empty()) {
      MOEBIUS_ASSIGN_OR_RETURN(dir, default_cache_dir());
    }
    t->opt_.cache_dir = dir;
    t->cache_ = TuneCache::open(dir, t->device_.uuid, CacheNamespace{MOEBIUS_VERSION, t->device_.cuda_runtime,
                                                                     t->device_.name});
  }
  return t;
}

MoeTuneKey MoeAutotuner::key_for(const moe::MoeLayerCuda& layer, int bucket, kernels::MoeCombineMode combine) {
  MoeTuneKey k;
  const cpu::MoeShape& s = layer.shape();
  k.hidden = s.hidden;
  k.intermediate = s.intermediate;
  k.num_experts = s.num_experts;
  k.top_k = s.top_k;
  k.format = moe::kernel_format_name(layer.format());
  const bool int_format = layer.format() == moe::KernelFormat::kInt4 || layer.format() == moe::KernelFormat::kInt2;
  k.group_size = int_format ? layer.group_size() : 0;
  k.activation = activation_name(layer.activation());
  k.combine = combine == kernels::MoeCombineMode::kStore ? "store" : "atomic";
  k.bucket = bucket;
  return k;
}

MoeTuneConfig MoeAutotuner::config_of(const moe::MoeLayerCuda& layer) {
  return MoeTuneConfig{moe::moe_gemm_path_name(layer.gemm_path()), layer.block_m(), layer.fused_routing(),
                       layer.options().decode_rows_per_block, layer.decode_split_k_warps()};
}

Result<moe::MoeCudaOptions> MoeAutotuner::options_for(const MoeTuneConfig& config, int capacity,
                                                      kernels::MoeCombineMode combine) {
  moe::MoeCudaOptions o;
  o.capacity = capacity;
  o.combine = combine;
  o.block_m = config.block_m;
  o.fuse_routing = config.fuse_routing;
  o.decode_rows_per_block = config.rows_per_block;
  o.decode_split_k_warps = config.split_k_warps;
  bool found = false;
  for (const PathCandidates& p : tuned_paths())
    if (config.gemm_path == moe::moe_gemm_path_name(p.path)) {
      o.gemm_path = p.path;
      found = true;
    }
  if (!found) return Error::format("unknown MoE GEMM path '{}'", config.gemm_path).in_field("gemm_path");
  return o;
}

Result<MoeTuneResult> MoeAutotuner::tune(const moe::MoeLayerCuda& layer, int bucket, kernels::MoeCombineMode combine,
                                         bool force) {
  if (bucket < 1) return Error::format("capacity bucket {} is not >= 1", bucket);
  const MoeTuneKey key = key_for(layer, bucket, combine);
  const std::string ks = key.str();
  if (!force) {
    std::optional<nlohmann::json> cached = cache_.get(ks);
    if (cached) {
      auto c = MoeTuneChoice::from_json(*cached);
      if (c.ok()) {
        MoeTuneResult r;
        r.key = key;
        r.choice = std::move(c).value();
        r.from_cache = true;
        return r;
      }
      log_warn("tuning cache '{}': entry '{}' is unreadable ({}); tuning again", cache_.path(), ks, c.error().what());
    }
  }
  MOEBIUS_ASSIGN_OR_RETURN(MoeTuneResult r, tune_now(layer, key, combine));
  // In memory always (a failed write must not make us tune again); in the file when persisting.
  const nlohmann::json j = r.choice.to_json();
  if (opt_.persist) {
    const Status st = cache_.put(ks, j);
    if (!st.ok()) log_warn("the MoE tuning result for '{}' stays in memory: {}", ks, st.error().what());
  } else {
    cache_.remember(ks, j);
  }
  return r;
}

Result<MoeTuneResult> MoeAutotuner::tune_now(const moe::MoeLayerCuda& layer, const MoeTuneKey& key,
                                             kernels::MoeCombineMode combine) {
  ++tuning_runs_;
  MoeTuneResult result;
  result.key = key;
  const int T = key.bucket;
  const int64_t H = key.hidden;

  moe::MoeCudaOptions heur_opt;
  heur_opt.capacity = T;
  heur_opt.combine = combine;
  auto made = layer.share_weights(heur_opt);
  if (!made.ok()) return std::move(made).error().with_context(fmt::format("tuning {}", key.str()));
  std::unique_ptr<moe::MoeLayerCuda> heur = std::move(made).value();
  const MoeTuneConfig heur_config = config_of(*heur);

  Stream stream;
  Events events;
  Bench b;
  b.tokens = T;
  b.hidden = H;
  const size_t input_bytes = sizeof(uint16_t) * static_cast<size_t>(T) * static_cast<size_t>(H);
  b.inputs = static_cast<int>(std::clamp<size_t>(kInputBytes / std::max<size_t>(input_bytes, 1), 1, kMaxInputs));
  DeviceMem x(input_bytes * static_cast<size_t>(b.inputs)), out(input_bytes), n(sizeof(int32_t));
  kernels::launch_fill_random_bf16(x.as<void>(), static_cast<size_t>(b.inputs) * T * H, 1.0f, opt_.seed, stream);
  const int32_t live = T;
  CUDA_CHECK(cudaMemcpyAsync(n.as<void>(), &live, sizeof(live), cudaMemcpyHostToDevice, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  b.x = x.as<__nv_bfloat16>();
  b.num_tokens = n.as<int32_t>();
  b.out = out.as<__nv_bfloat16>();
  b.stream = stream;
  b.events = &events;

  // The heuristic's configuration is the reference and always a valid candidate.
  const std::vector<float> ref = run_once(*heur, b);
  const bool ref_finite = std::all_of(ref.begin(), ref.end(), [](float v) { return std::isfinite(v); });
  if (!ref_finite)
    log_warn("tuning {}: the heuristic configuration's output is not finite; keeping it untuned", key.str());
  double best_us = std::numeric_limits<double>::infinity();
  {
    MoeCandidateRun run;
    run.config = heur_config;
    run.heuristic = true;
    run.valid = true;
    bool abandoned = false;
    run.us = time_forward_us(*heur, b, opt_.target_ms, opt_.samples, std::numeric_limits<double>::infinity(),
                             &abandoned);
    best_us = run.us;
    ++candidates_timed_;
    result.runs.push_back(run);
  }
  heur.reset();  // its workspace goes before the candidates allocate theirs

  std::vector<MoeTuneConfig> seen{heur_config};
  for (const PathCandidates& p : tuned_paths()) {
    for (int bm : p.block_m) {
      for (bool fuse : {true, false}) {
        for (const auto& [rows, warps] : grid_of(rows_candidates(p.path, bm), split_k_candidates(p.path, bm))) {
          if (!ref_finite) continue;
          const MoeTuneConfig want{moe::moe_gemm_path_name(p.path), bm, fuse, rows, warps};
          MOEBIUS_ASSIGN_OR_RETURN(moe::MoeCudaOptions o, options_for(want, T, combine));
          auto cand = layer.share_weights(o);
          if (!cand.ok()) {  // a configuration this format or capacity does not run
            log_debug("tuning {}: {} skipped: {}", key.str(), want.str(), cand.error().what());
            continue;
          }
          const MoeTuneConfig got = config_of(**cand);
          if (std::find(seen.begin(), seen.end(), got) != seen.end()) continue;
          seen.push_back(got);
          MoeCandidateRun run;
          run.config = got;
          run.nmse = nmse(run_once(**cand, b), ref);
          if (!(run.nmse <= opt_.max_nmse)) {
            run.note = fmt::format("rejected: nmse {:.3g} > {:.3g} against the heuristic's output", run.nmse,
                                   opt_.max_nmse);
            log_warn("tuning {}: {} {}", key.str(), got.str(), run.note);
            result.runs.push_back(run);
            continue;
          }
          run.valid = true;
          bool abandoned = false;
          run.us = time_forward_us(**cand, b, opt_.target_ms, opt_.samples, kAbandonFactor * best_us, &abandoned);
          ++candidates_timed_;
          if (abandoned) run.note = "abandoned (slower than 3x the best)";
          best_us = std::min(best_us, run.us);
          result.runs.push_back(run);
        }
      }
    }
  }

  const MoeCandidateRun& h = result.runs.front();
  const MoeCandidateRun* win = &h;
  for (const MoeCandidateRun& r : result.runs)
    if (r.valid && r.note.empty() && r.us < win->us) win = &r;
  if (win->us > h.us * (1.0 - opt_.min_gain)) win = &h;
  result.choice.winner = win->config;
  result.choice.heuristic = h.config;
  result.choice.winner_us = win->us;
  result.choice.heuristic_us = h.us;
  result.choice.candidates = static_cast<int>(result.runs.size());
  log_info("tuned MoE {}: {} {:.1f} us (heuristic {} {:.1f} us, {} candidates)", key.str(), win->config.str(),
           win->us, h.config.str(), h.us, result.runs.size());
  return result;
}

}  // namespace moebius::tune

#endif  // MOEBIUS_HAS_CUDA
