#include "tune/moe_layer_set.h"

#ifdef MOEBIUS_HAS_CUDA

#include <utility>

#include "core/log.h"

namespace moebius::tune {

Result<moe::MoeLayerCuda*> MoeLayerSet::find(int tokens) const {
  if (!buckets_) return Error("an empty MoE layer set");
  MOEBIUS_ASSIGN_OR_RETURN(size_t i, buckets_->index_for(tokens));
  return layers_[i].get();
}

moe::MoeLayerCuda& MoeLayerSet::for_tokens(int tokens) const {
  auto r = find(tokens);
  MOEBIUS_ASSERT(r.ok(), "{}", r.error().what());
  return **r;
}

Result<std::unique_ptr<MoeLayerFactory>> MoeLayerFactory::create(const MoeLayerFactoryOptions& options) {
  std::unique_ptr<MoeLayerFactory> f(new MoeLayerFactory());
  f->opt_ = options;
  MOEBIUS_ASSIGN_OR_RETURN(CapacityBuckets b,
                           CapacityBuckets::make(options.max_decode_batch, options.verify_width, options.prefill_chunk));
  f->buckets_ = std::make_shared<const CapacityBuckets>(std::move(b));
  f->pool_ = std::make_shared<moe::MoeWorkspacePool>();
  if (options.autotune) {
    MOEBIUS_ASSIGN_OR_RETURN(f->tuner_, MoeAutotuner::create(options.tuner));
    log_info("MoE autotuning: buckets {}; cache {}", f->buckets_->describe(),
             options.tuner.persist ? f->tuner_->cache().path() : std::string("off (memory only)"));
  }
  return f;
}

moe::MoeCudaOptions MoeLayerFactory::heuristic(int bucket) const {
  moe::MoeCudaOptions o;
  o.capacity = bucket;
  o.combine = opt_.combine;
  o.workspace_pool = pool_;
  return o;
}

moe::MoeCudaOptions MoeLayerFactory::options_for(const moe::MoeLayerCuda& seed, int bucket) {
  const int tb = tuning_bucket(bucket);
  const std::string key = MoeAutotuner::key_for(seed, tb, opt_.combine).str();
  if (auto it = chosen_.find(key); it != chosen_.end()) {
    moe::MoeCudaOptions o = it->second;
    o.capacity = bucket;
    return o;
  }
  moe::MoeCudaOptions o = heuristic(bucket);
  if (tuner_) {
    auto r = tuner_->tune(seed, tb, opt_.combine);
    if (!r.ok()) {
      log_warn("MoE autotuning of '{}' failed, using the heuristic: {}", key, r.error().what());
    } else {
      auto t = MoeAutotuner::options_for(r->choice.winner, bucket, opt_.combine);
      if (t.ok()) {
        o = std::move(t).value();
        o.workspace_pool = pool_;
      } else {
        log_warn("MoE tuning choice for '{}' is unusable, using the heuristic: {}", key, t.error().what());
      }
    }
  }
  chosen_[key] = o;
  return o;
}

Result<MoeLayerSet> MoeLayerFactory::make_set(std::unique_ptr<moe::MoeLayerCuda> seed) {
  MoeLayerSet set;
  set.buckets_ = buckets_;
  last_options_.clear();
  for (int bucket : buckets_->sizes()) {
    moe::MoeCudaOptions o = options_for(*seed, bucket);
    auto layer = seed->share_weights(o);
    if (!layer.ok() && (o.gemm_path != moe::MoeGemmPath::kAuto || o.block_m != 0 || !o.fuse_routing)) {
      // A cached choice this build no longer runs: the heuristic instead, from now on.
      log_warn("MoE configuration {} block_m {} for {} tokens refused ({}); using the heuristic",
               moe::moe_gemm_path_name(o.gemm_path), o.block_m, bucket, layer.error().what());
      o = heuristic(bucket);
      chosen_[MoeAutotuner::key_for(*seed, tuning_bucket(bucket), opt_.combine).str()] = o;
      layer = seed->share_weights(o);
    }
    if (!layer.ok()) return std::move(layer).error().with_context(fmt::format("MoE layer for {} tokens", bucket));
    set.layers_.push_back(std::move(layer).value());
    last_options_.push_back(o);
  }
  return set;  // the seed goes; the weights live on in the set's layers
}

Result<MoeLayerSet> MoeLayerFactory::make(const cpu::MoeLayerReference& layer) {
  // The seed uploads the weights once with a one-token workspace; the bucket layers share them.
  moe::MoeCudaOptions seed;
  seed.capacity = 1;
  MOEBIUS_ASSIGN_OR_RETURN(std::unique_ptr<moe::MoeLayerCuda> s, moe::MoeLayerCuda::create(layer, seed));
  return make_set(std::move(s));
}

Result<MoeLayerSet> MoeLayerFactory::make(const moe::PackedMoeLayer& packed, const moe::ExpertResidency& residency) {
  moe::MoeCudaOptions seed;
  seed.capacity = 1;
  MOEBIUS_ASSIGN_OR_RETURN(std::unique_ptr<moe::MoeLayerCuda> s, moe::MoeLayerCuda::create(packed, seed, residency));
  return make_set(std::move(s));
}

Result<MoeLayerSet> MoeLayerFactory::make_dummy(const cpu::MoeShape& shape, moe::KernelFormat format, int group_size,
                                                uint64_t seed, const moe::ExpertResidency& residency) {
  moe::MoeCudaOptions o;
  o.capacity = 1;
  MOEBIUS_ASSIGN_OR_RETURN(std::unique_ptr<moe::MoeLayerCuda> s,
                           moe::MoeLayerCuda::create_dummy(shape, format, group_size, o, seed, residency));
  return make_set(std::move(s));
}

}  // namespace moebius::tune

#endif  // MOEBIUS_HAS_CUDA
