// `moebius tune`: tune the CUDA MoE layer offline for every capacity bucket of a serving setup and
// print, per bucket, the winning configuration and its time against the heuristic's.
//
//   moebius tune --geometry qwen3-30b-a3b --format nvfp4 [--max-batch 64] [--prefill-chunk 2048]
//   moebius tune --model DIR [--experts nvfp4]
//
// --geometry tunes random weights of that shape (create_dummy); --model tunes the checkpoint's
// first MoE layer as the model would load it. Winners go to the per-GPU cache
// ($MOEBIUS_CACHE_DIR, default ~/.cache/moebius; --cache-dir) that `generate`, `serve` and
// `bench generate` read, so a second run (or a model load) tunes nothing: the last line says how
// many tuning runs happened.
#include <cstdio>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "cli/geometry.h"
#include "core/error.h"

#ifdef MOEBIUS_HAS_CUDA
#include "formats/quant_config.h"
#include "formats/safetensors.h"
#include "model/generate.h"
#include "model/qwen3_moe_config.h"
#include "model/qwen3_moe_cpu.h"
#include "moe/moe_layer_cuda.h"
#include "tune/capacity_buckets.h"
#include "tune/moe_autotuner.h"
#endif

namespace moebius::cli {

namespace {

struct TuneOptions {
  std::string model_dir;
  std::string experts;  // --model: re-quantize as generate does ("" keeps the checkpoint's)
  std::string geometry;
  std::string format = "nvfp4";
  int group_size = 128;
  std::string combine = "store";
  int max_batch = 64;
  int verify_width = 1;
  int prefill_chunk = 2048;
  std::string cache_dir;
  bool retune = false;
  bool no_cache = false;
  bool verbose = false;
  uint64_t seed = 1;
};

#ifdef MOEBIUS_HAS_CUDA

Result<moe::KernelFormat> parse_format(const std::string& s) {
  if (s == "bf16") return moe::KernelFormat::kBF16;
  if (s == "nvfp4") return moe::KernelFormat::kNvFp4;
  if (s == "int4") return moe::KernelFormat::kInt4;
  if (s == "int2") return moe::KernelFormat::kInt2;
  return Error::format("expected bf16, nvfp4, int4 or int2, not '{}'", s).in_field("--format");
}

// The checkpoint's first MoE layer, loaded as Qwen3MoeCuda::load does, with a one-token workspace.
Result<std::unique_ptr<moe::MoeLayerCuda>> load_first_moe_layer(const TuneOptions& o, std::string* what) {
  MOEBIUS_ASSIGN_OR_RETURN(std::optional<WeightFormat> experts, model::parse_experts_format(o.experts));
  MOEBIUS_ASSIGN_OR_RETURN(model::Qwen3MoeConfig c, model::load_qwen3_moe_config(o.model_dir));
  MOEBIUS_ASSIGN_OR_RETURN(QuantConfig quant, load_quant_config(o.model_dir));
  MOEBIUS_ASSIGN_OR_RETURN(SafetensorsCheckpoint opened, SafetensorsCheckpoint::open(o.model_dir));
  auto ck = std::make_shared<const SafetensorsCheckpoint>(std::move(opened));
  int layer = -1;
  for (int l = 0; l < c.num_hidden_layers && layer < 0; ++l)
    if (c.is_moe_layer(l)) layer = l;
  if (layer < 0) return Error("the model has no MoE layer to tune").in_file(o.model_dir);
  model::Qwen3MoeLoadOptions lo;
  lo.experts_format = experts;
  lo.experts_group_size = o.group_size;
  lo.unquantized_experts_bf16 = true;
  MOEBIUS_ASSIGN_OR_RETURN(model::Qwen3MoeLayerWeights w, model::load_qwen3_moe_layer(ck, c, quant, layer, lo));
  if (!w.is_moe) return Error::format("layer {} has no MoE weights", layer).in_file(o.model_dir);
  moe::MoeCudaOptions seed;
  seed.capacity = 1;
  *what = fmt::format("{} layer {}", o.model_dir, layer);
  return moe::MoeLayerCuda::create(w.moe, seed);
}

Status run(const TuneOptions& o) {
  if (o.model_dir.empty() == o.geometry.empty())
    return Error("give exactly one of --model and --geometry").in_field("--geometry");
  if (o.combine != "store" && o.combine != "atomic")
    return Error::format("expected store or atomic, not '{}'", o.combine).in_field("--combine");
  const kernels::MoeCombineMode combine =
      o.combine == "store" ? kernels::MoeCombineMode::kStore : kernels::MoeCombineMode::kAtomic;
  MOEBIUS_ASSIGN_OR_RETURN(tune::CapacityBuckets buckets,
                           tune::CapacityBuckets::make(o.max_batch, o.verify_width, o.prefill_chunk));
  if (!cuda_available()) return Error("no CUDA device is visible");

  std::unique_ptr<moe::MoeLayerCuda> seed;
  std::string what;
  if (!o.geometry.empty()) {
    MOEBIUS_ASSIGN_OR_RETURN(MoeGeometry g, parse_geometry(o.geometry));
    MOEBIUS_ASSIGN_OR_RETURN(moe::KernelFormat f, parse_format(o.format));
    moe::MoeCudaOptions one;
    one.capacity = 1;
    MOEBIUS_ASSIGN_OR_RETURN(seed, moe::MoeLayerCuda::create_dummy(cpu::MoeShape{g.hidden, g.intermediate,
                                                                                 g.num_experts, g.top_k},
                                                                   f, o.group_size, one, o.seed));
    what = fmt::format("{} (dummy weights)", g.name);
  } else {
    MOEBIUS_ASSIGN_OR_RETURN(seed, load_first_moe_layer(o, &what));
  }

  tune::MoeAutotunerOptions to;
  to.cache_dir = o.cache_dir;
  to.persist = !o.no_cache;
  to.seed = o.seed;
  MOEBIUS_ASSIGN_OR_RETURN(std::unique_ptr<tune::MoeAutotuner> tuner, tune::MoeAutotuner::create(to));
  const tune::DeviceIdentity& dev = tuner->device();
  const cpu::MoeShape& s = seed->shape();
  std::printf("moebius tune  %s  %s (CUDA %s)\n", what.c_str(), dev.name.c_str(), dev.cuda_runtime.c_str());
  std::printf("layer H=%lld I=%lld E=%d k=%d  format=%s  combine=%s  buckets %s\n",
              static_cast<long long>(s.hidden), static_cast<long long>(s.intermediate), s.num_experts, s.top_k,
              moe::kernel_format_name(seed->format()), o.combine.c_str(), buckets.describe().c_str());
  std::printf("cache: %s\n", o.no_cache ? "off (--no-cache)" : tuner->cache().path().c_str());
  std::printf("%7s %-7s %-32s %10s   %-32s %10s %7s %5s\n", "bucket", "source", "winner", "us", "heuristic", "us",
              "gain", "cands");
  for (int b : buckets.sizes()) {
    const int tb = tune::tuning_bucket(b);
    MOEBIUS_ASSIGN_OR_RETURN(tune::MoeTuneResult r, tuner->tune(*seed, tb, combine, o.retune));
    const tune::MoeTuneChoice& c = r.choice;
    const double gain = c.winner_us > 0 ? c.heuristic_us / c.winner_us : 0.0;
    std::printf("%7s %-7s %-32s %10.2f   %-32s %10.2f %6.2fx %5d\n",
                (b == tb ? std::to_string(b) : fmt::format("{}>{}", b, tb)).c_str(), r.from_cache ? "cached" : "tuned",
                c.winner.str().c_str(), c.winner_us, c.heuristic.str().c_str(), c.heuristic_us, gain, c.candidates);
    if (o.verbose)
      for (const tune::MoeCandidateRun& run : r.runs)
        std::printf("          %-32s %10.2f us  nmse %.2e %s%s\n", run.config.str().c_str(), run.us, run.nmse,
                    run.heuristic ? "[heuristic] " : "", run.note.c_str());
    std::fflush(stdout);
  }
  std::printf("tuning runs: %lld (configurations timed: %lld)\n", static_cast<long long>(tuner->tuning_runs()),
              static_cast<long long>(tuner->candidates_timed()));
  return Ok{};
}

#else

Status run(const TuneOptions&) { return Error("this build of moebius has no CUDA support; tune needs a GPU"); }

#endif  // MOEBIUS_HAS_CUDA

}  // namespace

void register_tune(CLI::App& app) {
  auto o = std::make_shared<TuneOptions>();
  CLI::App* cmd = app.add_subcommand("tune", "tune the CUDA MoE kernels per capacity bucket and cache the winners");
  cmd->add_option("--model", o->model_dir, "model directory: tune its first MoE layer");
  cmd->add_option("--experts", o->experts, "--model: re-quantize experts (bf16, nvfp4, int4, int2)");
  cmd->add_option("--geometry", o->geometry, "qwen3-30b-a3b, qwen3-235b-a22b or H,I,E,k (random weights)");
  cmd->add_option("--format", o->format, "--geometry: bf16, nvfp4, int4, int2")->capture_default_str();
  cmd->add_option("--group-size", o->group_size, "int formats: K elements per scale")->capture_default_str();
  cmd->add_option("--combine", o->combine, "store (deterministic) or atomic")->capture_default_str();
  cmd->add_option("--max-batch", o->max_batch, "largest decode graph batch")->capture_default_str();
  cmd->add_option("--verify-width", o->verify_width, "tokens per sequence per decode step")->capture_default_str();
  cmd->add_option("--prefill-chunk", o->prefill_chunk, "tokens per prefill step (serve: --max-step-tokens)")
      ->capture_default_str();
  cmd->add_option("--cache-dir", o->cache_dir, "tuning cache directory (default: $MOEBIUS_CACHE_DIR or ~/.cache/moebius)");
  cmd->add_flag("--retune", o->retune, "tune every bucket again, replacing cached winners");
  cmd->add_flag("--no-cache", o->no_cache, "neither read nor write the cache");
  cmd->add_flag("-v,--verbose", o->verbose, "print every candidate");
  cmd->add_option("--seed", o->seed, "random weights and inputs")->capture_default_str();
  cmd->final_callback([o] {
    Status s = run(*o);
    if (!s.ok()) {
      std::fprintf(stderr, "moebius tune: error: %s\n", s.error().what().c_str());
      throw CLI::RuntimeError(2);
    }
  });
}

}  // namespace moebius::cli
