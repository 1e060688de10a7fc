// A teacher-forced logprob oracle: run ONE prefill over a fixed token sequence, take the
// log-softmax of every row's logits (in double) at the next token, and compare the N-1 logprobs
// with a reference dump (HF transformers, or another moebius configuration, e.g. bf16 experts as
// the reference for nvfp4 ones). `moebius eval logprobs` (src/cli/eval.cpp) wraps it.
//
// Reference dump (a safetensors file; docs/FORMATS.md, "Teacher-forced logprob dumps"):
//   input_ids  I32 [N], N >= 2       the token sequence
//   logprobs   F32 [N - 1]           logprobs[i] = log p(input_ids[i+1] | input_ids[0..i]), finite
//   __metadata__ (optional, informational): format = "moebius.logprobs.v1", source (moebius or
//   transformers), model, backend, experts, dtype.
// Other tensors (e.g. a future top_logprobs) are ignored by the reader.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/qwen3_moe_cpu.h"
#include "model/qwen3_moe_cuda.h"

namespace moebius {
class SafetensorsFile;
}

namespace moebius::model {

inline constexpr const char* kLogprobDumpFormat = "moebius.logprobs.v1";

struct LogprobDump {
  std::vector<int32_t> input_ids;  // [N]
  std::vector<float> logprobs;     // [N - 1]
  std::map<std::string, std::string> metadata;
};

// Reads and validates a dump: errors name the file and the tensor (input_ids / logprobs) and say
// what is wrong (missing, dtype, rank, length, N < 2, a non-finite or positive logprob).
Result<LogprobDump> read_logprob_dump(const std::string& path);
Result<LogprobDump> parse_logprob_dump(const SafetensorsFile& file);
// The dump as a safetensors file (metadata copied, "format" set); write_ is atomic.
Result<std::vector<uint8_t>> serialize_logprob_dump(const LogprobDump& dump);
Status write_logprob_dump(const LogprobDump& dump, const std::string& path);

// log_softmax(logits)[id], computed in double (max-shifted log-sum-exp).
double log_softmax_at(std::span<const float> logits, int32_t id);

// Rows [T, V] of logits for positions p0 .. p0+T-1 of `ids`: appends logprobs of ids[p+1] for every
// row whose next token exists (p + 1 < ids.size()), rounded to fp32.
void append_next_token_logprobs(std::span<const float> logits, int64_t V, std::span<const int32_t> ids, int64_t p0,
                                std::vector<float>& out);

struct LogprobComparison {
  int64_t count = 0;            // N - 1 scored tokens
  double mean_abs_delta = 0.0;  // mean |got - ref|
  double max_abs_delta = 0.0;
  int64_t max_index = 0;        // logprobs index of the max (predicts input_ids[max_index + 1])
  double mean_logprob = 0.0;    // of got
  double ref_mean_logprob = 0.0;
  double perplexity() const;    // exp(-mean_logprob)
  double ref_perplexity() const;
};

// Compares two logprob vectors of the same (non-zero) length; the deltas are taken in double on
// the fp32 values, so identical dumps give exactly 0.
Result<LogprobComparison> compare_logprobs(std::span<const float> got, std::span<const float> ref);

// Token-sequence checks shared by every entry point: N >= 2, ids in [0, vocab), N <= context.
// `field` names where the ids came from (input_ids, --prompt-ids).
Status validate_eval_ids(std::span<const int32_t> ids, int64_t vocab, int64_t context, const std::string& field);

// The teacher-forced logprobs [N - 1] of `ids` on a loaded model, `chunk` tokens per forward
// (the KV cache is kept between chunks, so the result is one prefill's up to rounding).
Result<std::vector<float>> teacher_forced_logprobs(const Qwen3MoeCpu& model, std::span<const int32_t> ids,
                                                   int chunk = 512);
#ifdef MOEBIUS_HAS_CUDA
// Needs model.max_logit_rows() == model.max_tokens() (every row of a chunk is scored); chunks of
// model.max_tokens() tokens.
Result<std::vector<float>> teacher_forced_logprobs(Qwen3MoeCuda& model, std::span<const int32_t> ids);
#endif

struct EvalLogprobsOptions {
  std::string model_dir;
  std::string backend = "cpu";  // cpu or cuda
  std::string experts;          // "" keeps the checkpoint's precision; bf16, nvfp4, int4, int2
  int experts_group_size = 128; // int formats (-1: per channel)
  int chunk = 512;              // tokens per forward (and logit rows per step on cuda)
  std::string ids_field = "input_ids";  // where the ids came from, for errors (e.g. --prompt-ids)
  std::function<void(int done, int total)> on_progress;
};

// Validates the options and `ids` (against config.json, before the slow load), loads the model
// and returns the teacher-forced logprobs [N - 1].
Result<std::vector<float>> run_eval_logprobs(const EvalLogprobsOptions& options, std::span<const int32_t> ids);

// The report printed by `moebius eval logprobs` (newline-terminated lines). `ids` for naming the
// token at the max; `ref` may be null (no comparison: just the run's mean logprob / perplexity).
std::string format_logprob_report(std::span<const int32_t> ids, std::span<const float> got,
                                  const LogprobComparison* cmp);

}  // namespace moebius::model
