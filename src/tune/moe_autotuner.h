// The MoE autotuner: for one layer geometry at one capacity bucket, time every configuration of
// the knobs MoeCudaOptions exposes on the GPU, check each one's output against the heuristic
// configuration's, and keep the fastest in the persistent cache (tune_cache.h), so that a warm
// start tunes nothing.
//
// Key (moe_tune_key.h): H, I, E, k, expert format and group size, activation, combine mode,
// capacity bucket. Candidates: the GEMM path (decode, prefill) x tokens per tile (decode 8, 16,
// 32, 64; prefill 64, 128) x fused routing on/off, and for decode with 8-token tiles the row
// tiles per block (heuristic, 1, 2, 4, 8) x the warps splitting GEMM1's K (4, 8:
// [TAG_DECODE_SPLIT_K]); the wgmma kernels' pipeline depth is not a candidate: it is the most
// stages that fit shared memory, one persistent block per SM, where fewer stages only hide less
// latency. Configurations the layer refuses (prefill
// 128-token tiles for the int formats, fused routing past 16 tokens) and ones that resolve to a
// configuration already seen are skipped.
//
// Method, per candidate: a layer over the SAME device weights (MoeLayerCuda::share_weights) with
// the bucket as its capacity and its own workspace; one forward on input 0, compared with the
// heuristic layer's output (normalized MSE, every value finite); then R forwards on R different
// random inputs (so consecutive forwards route to different experts and the L2 cannot serve the
// previous forward's weights) captured in a CUDA graph, replayed between CUDA events; the minimum
// over `samples` timings of `target_ms` each is kept. A candidate whose first timing is 3x the
// best so far is not timed further. The winner must beat the heuristic by `min_gain`, else the
// heuristic stays: ties and noise never change the choice.
#pragma once

#ifdef MOEBIUS_HAS_CUDA

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "kernels/moe_gemm.cuh"
#include "moe/moe_layer_cuda.h"
#include "tune/moe_tune_key.h"
#include "tune/tune_cache.h"

namespace moebius::tune {

// The GPU this process runs on: its cache file and namespace.
struct DeviceIdentity {
  int device = 0;
  std::string uuid;          // "GPU-8a1c2d3e-...", as nvidia-smi -L prints it
  std::string name;          // "NVIDIA H200"
  std::string cuda_runtime;  // "12.8"
};
Result<DeviceIdentity> current_device_identity();

struct MoeAutotunerOptions {
  std::string cache_dir;  // "" = default_cache_dir()
  bool persist = true;    // write winners to the cache file (false: memory only)
  // A candidate's output against the heuristic configuration's, same input and routing:
  // normalized MSE at most this. Every GPU path is within 5e-5 of the CPU oracle
  // (tests/gpu/test_moe_layer.cu kNmseBound), so two correct paths are within
  // (2 sqrt(5e-5))^2 = 2e-4 of each other.
  double max_nmse = 2e-4;
  double min_gain = 0.03;  // fraction the winner must beat the heuristic by
  double target_ms = 2.0;  // GPU time of one timing sample
  int samples = 5;         // timing samples per candidate; the minimum is kept
  uint64_t seed = 1;       // the random inputs
};

// One candidate configuration as tuned.
struct MoeCandidateRun {
  MoeTuneConfig config;
  double us = 0;           // per forward (0: not timed)
  double nmse = 0;         // against the heuristic's output
  bool valid = false;      // ran and passed the check
  bool heuristic = false;  // the configuration the heuristic picks
  std::string note;        // why it was rejected, or "abandoned" (slower than 3x the best)
};

struct MoeTuneResult {
  MoeTuneKey key;
  MoeTuneChoice choice;
  bool from_cache = false;
  std::vector<MoeCandidateRun> runs;  // empty when the choice came from the cache
};

class MoeAutotuner {
 public:
  // Identifies the current device and opens its cache file (unless !persist, where nothing is
  // read or written).
  static Result<std::unique_ptr<MoeAutotuner>> create(const MoeAutotunerOptions& options);

  static MoeTuneKey key_for(const moe::MoeLayerCuda& layer, int bucket, kernels::MoeCombineMode combine);
  // The layer's resolved configuration (path, block_m, fused routing).
  static MoeTuneConfig config_of(const moe::MoeLayerCuda& layer);
  // Options that run `config` at `capacity`; an unknown path name is an error.
  static Result<moe::MoeCudaOptions> options_for(const MoeTuneConfig& config, int capacity,
                                                 kernels::MoeCombineMode combine);

  // The choice for key_for(layer, bucket, combine): from this tuner's memory or the cache file,
  // else tuned now on `layer`'s weights and stored. force: tune even when cached. No stream of the
  // caller's is touched; the device is synchronized.
  Result<MoeTuneResult> tune(const moe::MoeLayerCuda& layer, int bucket, kernels::MoeCombineMode combine,
                             bool force = false);

  int64_t tuning_runs() const { return tuning_runs_; }            // keys tuned (cache misses)
  int64_t candidates_timed() const { return candidates_timed_; }  // forwards configurations timed
  const TuneCache& cache() const { return cache_; }
  const DeviceIdentity& device() const { return device_; }
  const MoeAutotunerOptions& options() const { return opt_; }

 private:
  MoeAutotuner() = default;
  Result<MoeTuneResult> tune_now(const moe::MoeLayerCuda& layer, const MoeTuneKey& key,
                                 kernels::MoeCombineMode combine);

  MoeAutotunerOptions opt_;
  DeviceIdentity device_;
  TuneCache cache_;
  int64_t tuning_runs_ = 0, candidates_timed_ = 0;
};

}  // namespace moebius::tune

#endif  // MOEBIUS_HAS_CUDA
