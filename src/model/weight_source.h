// Where a model's weights come from, as the `--model`, `--geometry` and `--load-format` flags of
// `generate`, `bench generate` and `serve` say it: a checkpoint directory, or random weights
// ("dummy") of a directory's config.json or of a named geometry (no directory at all). One place
// checks the combination and resolves the config; Qwen3MoeCuda::open (qwen3_moe_cuda.h) makes the
// runner from it.
#pragma once

#include <string>

#include "core/error.h"
#include "model/qwen3_moe_config.h"

namespace moebius::model {

struct WeightSource {
  std::string model_dir;             // a checkpoint directory (with dummy weights: only its config.json)
  std::string geometry;              // a named geometry (named_qwen3_moe_config) instead; dummy weights only
  std::string load_format = "auto";  // "auto": read the checkpoint; "dummy": random weights (CUDA only)

  bool dummy() const { return load_format == "dummy"; }
  // The model's name in logs and the API: the geometry's, or the directory's.
  std::string name() const { return geometry.empty() ? model_dir : geometry; }
};

// Checks the flags alone (nothing is read): a known load format, exactly one of --model and
// --geometry, --geometry a known name and only with dummy weights. Errors name the flag.
Status validate_weight_source(const WeightSource& source);

// The config the model will have: the named geometry's, or model_dir's config.json.
Result<Qwen3MoeConfig> weight_source_config(const WeightSource& source);

}  // namespace moebius::model
