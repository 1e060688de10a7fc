// A Hugging Face generation_config.json: the end-of-sequence ids and the model's default sampling
// parameters. Only the fields generation uses are read; other keys are ignored (HF writes many).
//   eos_token_id: an int or a list of ints (Qwen3 lists <|im_end|> and <|endoftext|>)
//   temperature, top_p, top_k, min_p, repetition_penalty, do_sample: optional defaults that CLI
//   flags and request fields override (the set vLLM takes from it)
// A missing file gives an empty config (no eos ids, no defaults); a malformed one is an Error
// naming the file and field.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace moebius::model {

struct GenerationConfig {
  std::vector<int32_t> eos_token_ids;
  std::optional<float> temperature;
  std::optional<float> top_p;
  std::optional<int> top_k;
  std::optional<float> min_p;
  std::optional<float> repetition_penalty;
  std::optional<bool> do_sample;  // false: HF decodes greedily whatever temperature says
};

// `text` is the JSON; `source` names it in errors.
Result<GenerationConfig> parse_generation_config(std::string_view text, const std::string& source);
// Reads `dir`/generation_config.json; an absent file gives GenerationConfig{}.
Result<GenerationConfig> load_generation_config(const std::string& dir);

}  // namespace moebius::model
