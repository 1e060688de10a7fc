// How a model makes its CUDA MoE layers: one MoeLayerCuda per capacity bucket (capacity_buckets.h)
// over one copy of the expert weights (share_weights), each run with the autotuner's choice for
// its bucket (or the heuristic's, without autotuning), and every workspace taken from one pool so
// that the model's layers of one geometry share one workspace per bucket
// [TAG_MOE_WORKSPACE_POOL]. Everything is allocated at model load, before any CUDA graph is
// captured, and keeps its address for the model's life [TAG_MOE_GRAPH_CAPACITY]. A bucket that is
// not a power of two is tuned at the next power of two up (tuning_bucket()).
//
//   auto f = MoeLayerFactory::create(opts);          // opens the tuning cache once
//   MoeLayerSet set = f->make(reference).value();    // per model layer; the first one tunes
//   set.for_tokens(rows).forward(x, num_tokens, out, stream);
#pragma once

#ifdef MOEBIUS_HAS_CUDA

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "cpu/moe_layer.h"
#include "moe/moe_layer_cuda.h"
#include "tune/capacity_buckets.h"
#include "tune/moe_autotuner.h"

namespace moebius::tune {

// One model layer's MoE: a layer per capacity bucket, sharing the weights.
class MoeLayerSet {
 public:
  MoeLayerSet() = default;

  // The layer of the smallest bucket >= tokens. `tokens` must be within [1, buckets().largest()]
  // (the runner checks each step against its capacities first); find() is the checked form.
  moe::MoeLayerCuda& for_tokens(int tokens) const;
  Result<moe::MoeLayerCuda*> find(int tokens) const;

  bool empty() const { return layers_.empty(); }
  size_t size() const { return layers_.size(); }
  moe::MoeLayerCuda& layer(size_t i) const { return *layers_.at(i); }
  const CapacityBuckets& buckets() const { return *buckets_; }
  // A layer of the set, for weight checks and in-place weight updates: all buckets share its
  // device weights (share_weights), so an update through one is seen by all.
  moe::MoeLayerCuda& primary() const { return *layers_.front(); }
  // Per-expert and whole-layer weight bytes (stored once for all buckets).
  size_t expert_bytes() const { return layers_.front()->expert_bytes(); }
  size_t weight_bytes() const { return layers_.front()->weight_bytes(); }

 private:
  friend class MoeLayerFactory;
  std::shared_ptr<const CapacityBuckets> buckets_;
  std::vector<std::unique_ptr<moe::MoeLayerCuda>> layers_;  // [bucket]
};

struct MoeLayerFactoryOptions {
  int max_decode_batch = 1;  // the largest decode CUDA-graph batch
  int verify_width = 1;      // tokens per sequence in a decode step (speculative verify)
  int prefill_chunk = 2048;  // tokens per step
  kernels::MoeCombineMode combine = kernels::MoeCombineMode::kStore;
  bool autotune = false;     // false: every bucket runs the heuristic's configuration
  MoeAutotunerOptions tuner;
};

class MoeLayerFactory {
 public:
  static Result<std::unique_ptr<MoeLayerFactory>> create(const MoeLayerFactoryOptions& options);

  // The set for one layer's reference weights / for random weights of a geometry (benchmarks).
  Result<MoeLayerSet> make(const cpu::MoeLayerReference& layer);
  // `residency`: which experts stay on the GPU and where the cold ones live [TAG_EXPERT_OFFLOAD].
  Result<MoeLayerSet> make(const moe::PackedMoeLayer& packed,  // weights packed on the host (staging)
                           const moe::ExpertResidency& residency = {});
  Result<MoeLayerSet> make_dummy(const cpu::MoeShape& shape, moe::KernelFormat format, int group_size,
                                 uint64_t seed, const moe::ExpertResidency& residency = {});

  const CapacityBuckets& buckets() const { return *buckets_; }
  // Device bytes of the shared workspaces alive now.
  size_t workspace_bytes() const { return pool_->live_bytes(); }
  const moe::MoeWorkspacePool& pool() const { return *pool_; }
  MoeAutotuner* tuner() const { return tuner_.get(); }  // null without autotuning
  // The options each bucket's layer was made with (for the last geometry made).
  const std::vector<moe::MoeCudaOptions>& bucket_options() const { return last_options_; }

 private:
  MoeLayerFactory() = default;
  Result<MoeLayerSet> make_set(std::unique_ptr<moe::MoeLayerCuda> seed);
  moe::MoeCudaOptions heuristic(int bucket) const;
  moe::MoeCudaOptions options_for(const moe::MoeLayerCuda& seed, int bucket);

  MoeLayerFactoryOptions opt_;
  std::shared_ptr<const CapacityBuckets> buckets_;
  std::shared_ptr<moe::MoeWorkspacePool> pool_;
  std::unique_ptr<MoeAutotuner> tuner_;
  std::map<std::string, moe::MoeCudaOptions> chosen_;  // tune key -> options (one tuning per geometry)
  std::vector<moe::MoeCudaOptions> last_options_;
};

}  // namespace moebius::tune

#endif  // MOEBIUS_HAS_CUDA
