#include "model/eval_logprobs.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "formats/safetensors.h"
#include "model/block_allocator.h"
#include "model/generate.h"
#include "model/qwen3_moe_config.h"

namespace moebius::model {
namespace {

std::string shape_text(const Shape& s) {
  std::string out = "[";
  for (int i = 0; i < s.rank; ++i) out += fmt::format("{}{}", i ? ", " : "", s[i]);
  return out + "]";
}

}  // namespace

Result<LogprobDump> parse_logprob_dump(const SafetensorsFile& f) {
  const auto bad = [&f](const char* tensor, std::string msg) {
    return Error(std::move(msg)).in_file(f.name()).in_tensor(tensor);
  };
  const TensorInfo* ids = f.find("input_ids");
  const TensorInfo* lp = f.find("logprobs");
  if (ids == nullptr) return bad("input_ids", "missing: a logprob dump needs input_ids I32 [N]");
  if (lp == nullptr) return bad("logprobs", "missing: a logprob dump needs logprobs F32 [N - 1]");
  if (ids->dtype != DType::kI32)
    return bad("input_ids", fmt::format("dtype is {}; expected I32", dtype_name(ids->dtype)));
  if (ids->shape.rank != 1)
    return bad("input_ids", fmt::format("shape is {}; expected rank 1 [N]", shape_text(ids->shape)));
  const int64_t N = ids->shape[0];
  if (N < 2) return bad("input_ids", fmt::format("has {} tokens; teacher forcing needs at least 2", N));
  if (lp->dtype != DType::kF32)
    return bad("logprobs", fmt::format("dtype is {}; expected F32", dtype_name(lp->dtype)));
  if (lp->shape.rank != 1 || lp->shape[0] != N - 1)
    return bad("logprobs", fmt::format("shape is {}; expected [{}] (N - 1 for input_ids [{}])", shape_text(lp->shape),
                                       N - 1, N));
  LogprobDump d;
  d.input_ids.resize(static_cast<size_t>(N));
  std::memcpy(d.input_ids.data(), ids->data, ids->nbytes());  // copies: no alignment assumption
  d.logprobs.resize(static_cast<size_t>(N - 1));
  std::memcpy(d.logprobs.data(), lp->data, lp->nbytes());
  for (size_t i = 0; i < d.logprobs.size(); ++i)
    if (!std::isfinite(d.logprobs[i]) || d.logprobs[i] > 0.0f)
      return bad("logprobs", fmt::format("logprobs[{}] = {} is not a log-probability (finite, <= 0)", i,
                                         d.logprobs[i]));
  d.metadata = f.metadata();
  return d;
}

Result<LogprobDump> read_logprob_dump(const std::string& path) {
  MOEBIUS_ASSIGN_OR_RETURN(SafetensorsFile f, SafetensorsFile::open(path));
  return parse_logprob_dump(f);
}

namespace {
Result<SafetensorsWriter> dump_writer(const LogprobDump& d) {
  if (d.input_ids.size() < 2 || d.logprobs.size() + 1 != d.input_ids.size())
    return Error::format("a dump needs N >= 2 ids and N - 1 logprobs; got {} and {}", d.input_ids.size(),
                         d.logprobs.size());
  SafetensorsWriter w;
  const auto n = static_cast<int64_t>(d.input_ids.size());
  MOEBIUS_TRY(w.add("input_ids", DType::kI32, Shape{n},
                    std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(d.input_ids.data()),
                                             static_cast<size_t>(n) * 4)));
  MOEBIUS_TRY(w.add("logprobs", DType::kF32, Shape{n - 1},
                    std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(d.logprobs.data()),
                                             static_cast<size_t>(n - 1) * 4)));
  for (const auto& [k, v] : d.metadata)
    if (k != "format") MOEBIUS_TRY(w.set_metadata(k, v));
  MOEBIUS_TRY(w.set_metadata("format", kLogprobDumpFormat));
  return w;
}
}  // namespace

Result<std::vector<uint8_t>> serialize_logprob_dump(const LogprobDump& d) {
  MOEBIUS_ASSIGN_OR_RETURN(SafetensorsWriter w, dump_writer(d));
  return w.serialize();
}

Status write_logprob_dump(const LogprobDump& d, const std::string& path) {
  MOEBIUS_ASSIGN_OR_RETURN(SafetensorsWriter w, dump_writer(d));
  return w.write(path);
}

double log_softmax_at(std::span<const float> logits, int32_t id) {
  MOEBIUS_ASSERT(id >= 0 && static_cast<size_t>(id) < logits.size(), "id {} outside [0, {})", id, logits.size());
  double m = -INFINITY;
  for (float x : logits) m = std::max(m, static_cast<double>(x));
  double s = 0.0;
  for (float x : logits) s += std::exp(static_cast<double>(x) - m);
  return static_cast<double>(logits[static_cast<size_t>(id)]) - m - std::log(s);
}

void append_next_token_logprobs(std::span<const float> logits, int64_t V, std::span<const int32_t> ids, int64_t p0,
                                std::vector<float>& out) {
  const int64_t T = static_cast<int64_t>(logits.size()) / V;
  for (int64_t r = 0; r < T; ++r) {
    const int64_t p = p0 + r;
    if (p + 1 >= static_cast<int64_t>(ids.size())) break;
    const std::span<const float> row = logits.subspan(static_cast<size_t>(r * V), static_cast<size_t>(V));
    out.push_back(static_cast<float>(log_softmax_at(row, ids[static_cast<size_t>(p + 1)])));
  }
}

double LogprobComparison::perplexity() const { return std::exp(-mean_logprob); }
double LogprobComparison::ref_perplexity() const { return std::exp(-ref_mean_logprob); }

Result<LogprobComparison> compare_logprobs(std::span<const float> got, std::span<const float> ref) {
  if (got.size() != ref.size())
    return Error::format("{} logprobs against a reference of {}", got.size(), ref.size()).in_tensor("logprobs");
  if (got.empty()) return Error("no logprobs to compare").in_tensor("logprobs");
  LogprobComparison c;
  c.count = static_cast<int64_t>(got.size());
  double sum_abs = 0.0, sum_got = 0.0, sum_ref = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = std::fabs(static_cast<double>(got[i]) - static_cast<double>(ref[i]));
    sum_abs += d;
    sum_got += got[i];
    sum_ref += ref[i];
    if (d > c.max_abs_delta || !std::isfinite(d)) {
      c.max_abs_delta = d;
      c.max_index = static_cast<int64_t>(i);
    }
  }
  const double n = static_cast<double>(c.count);
  c.mean_abs_delta = sum_abs / n;
  c.mean_logprob = sum_got / n;
  c.ref_mean_logprob = sum_ref / n;
  return c;
}

Status validate_eval_ids(std::span<const int32_t> ids, int64_t vocab, int64_t context, const std::string& field) {
  if (ids.size() < 2)
    return Error::format("has {} tokens; teacher forcing needs at least 2", ids.size()).in_field(field);
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= vocab)
      return Error::format("token id {} (position {}) is outside the vocabulary [0, {})", ids[i], i, vocab)
          .in_field(field);
  if (static_cast<int64_t>(ids.size()) > context)
    return Error::format("has {} tokens; the model's context is {}", ids.size(), context).in_field(field);
  return Ok{};
}

Result<std::vector<float>> teacher_forced_logprobs(const Qwen3MoeCpu& model, std::span<const int32_t> ids,
                                                   int chunk) {
  const Qwen3MoeConfig& c = model.config();
  MOEBIUS_TRY(validate_eval_ids(ids, c.vocab_size, c.context_limit(), "input_ids"));
  if (chunk < 1) return Error::format("must be >= 1, got {}", chunk).in_field("--chunk");
  const int64_t N = static_cast<int64_t>(ids.size());
  const int64_t V = c.vocab_size;
  // The last token is never a query that is scored, so the cache needs N - 1 rows; N keeps it simple.
  // Every row of a chunk's logits is kept (each scores the next id): rows x V fp32. Bounded so that
  // a large --chunk is an error naming it, not an allocation the host cannot make.
  constexpr int64_t kMaxChunkLogitsBytes = int64_t{4} << 30;
  const int64_t rows = std::min<int64_t>(chunk, N);
  if (rows * V * static_cast<int64_t>(sizeof(float)) > kMaxChunkLogitsBytes)
    return Error::format("{} tokens per forward need {:.1f} GiB of logits (vocabulary {}); at most {} fit in {} GiB",
                         rows, static_cast<double>(rows * V) * sizeof(float) / (1 << 30), V,
                         kMaxChunkLogitsBytes / (V * static_cast<int64_t>(sizeof(float))), kMaxChunkLogitsBytes >> 30)
        .in_field("--chunk");
  KvCache cache = model.make_cache(N);
  std::vector<float> logits(static_cast<size_t>(rows * V));
  std::vector<float> out;
  out.reserve(static_cast<size_t>(N - 1));
  for (int64_t start = 0; start < N - 1; start += chunk) {
    const int64_t n = std::min<int64_t>(chunk, N - 1 - start);  // rows start .. start+n-1 predict the next id
    MOEBIUS_TRY(model.forward(ids.data() + start, static_cast<int>(n), cache, logits.data()));
    append_next_token_logprobs(std::span<const float>(logits.data(), static_cast<size_t>(n * V)), V, ids, start, out);
  }
  return out;
}

#ifdef MOEBIUS_HAS_CUDA
Result<std::vector<float>> teacher_forced_logprobs(Qwen3MoeCuda& model, std::span<const int32_t> ids) {
  const Qwen3MoeConfig& c = model.config();
  MOEBIUS_TRY(validate_eval_ids(ids, c.vocab_size, model.max_context(), "input_ids"));
  const int chunk = model.max_tokens();
  if (model.max_logit_rows() < chunk)
    return Error::format("the runner returns {} logit rows per step; eval needs max_tokens ({})",
                         model.max_logit_rows(), chunk)
        .in_field("max_logit_rows");
  const int64_t N = static_cast<int64_t>(ids.size());
  const int64_t V = c.vocab_size;
  BlockAllocator blocks(model.num_blocks());
  std::vector<int32_t> table;
  MOEBIUS_TRY(blocks.ensure(table, N, model.block_size()));
  std::vector<float> logits(static_cast<size_t>(std::min<int64_t>(chunk, N) * V));
  std::vector<float> out;
  out.reserve(static_cast<size_t>(N - 1));
  Status st = Ok{};
  for (int64_t start = 0; start < N - 1 && st.ok(); start += chunk) {
    const int64_t n = std::min<int64_t>(chunk, N - 1 - start);
    const SequenceStep seq{ids.subspan(static_cast<size_t>(start), static_cast<size_t>(n)), start, table};
    auto batch = model.make_batch(std::span<const SequenceStep>(&seq, 1), /*all_logits=*/true);
    if (!batch.ok()) {
      st = std::move(batch).error();
      break;
    }
    st = model.forward(*batch, logits.data());
    if (st.ok())
      append_next_token_logprobs(std::span<const float>(logits.data(), static_cast<size_t>(n * V)), V, ids, start,
                                 out);
  }
  blocks.release(table);
  if (!st.ok()) return std::move(st).error();
  return out;
}
#endif  // MOEBIUS_HAS_CUDA

namespace {

// A logprob that is not finite comes from non-finite logits (a NaN or Inf among the checkpoint's
// weights or scales, or an overflow): an error, not a report of `nan` with a zero exit, and never a
// dump that --ref would refuse to read back.
Result<std::vector<float>> finite_or_error(Result<std::vector<float>> got, const std::string& model_dir) {
  if (!got.ok()) return got;
  for (size_t i = 0; i < got->size(); ++i)
    if (!std::isfinite((*got)[i]))
      return Error::format("the logprob of position {} is {}: the model's logits are not finite (a NaN or Inf in "
                           "the checkpoint's weights or scales?)",
                           i + 1, (*got)[i])
          .in_file(model_dir);
  return got;
}

}  // namespace

Result<std::vector<float>> run_eval_logprobs(const EvalLogprobsOptions& o, std::span<const int32_t> ids) {
  if (o.backend != "cpu" && o.backend != "cuda")
    return Error::format("unknown backend '{}'; expected cpu or cuda", o.backend).in_field("--backend");
#ifndef MOEBIUS_HAS_CUDA
  if (o.backend == "cuda") return Error("this build of moebius has no CUDA support").in_field("--backend");
#endif
  if (o.model_dir.empty()) return Error("is required").in_field("--model");
  if (o.chunk < 1) return Error::format("must be >= 1, got {}", o.chunk).in_field("--chunk");
  MOEBIUS_ASSIGN_OR_RETURN(std::optional<WeightFormat> experts, parse_experts_format(o.experts));
  MOEBIUS_ASSIGN_OR_RETURN(Qwen3MoeConfig config, load_qwen3_moe_config(o.model_dir));
  MOEBIUS_TRY(validate_eval_ids(ids, config.vocab_size, config.context_limit(), o.ids_field));
  [[maybe_unused]] const int64_t N = static_cast<int64_t>(ids.size());

#ifdef MOEBIUS_HAS_CUDA
  if (o.backend == "cuda") {
    Qwen3MoeCudaOptions co;
    co.experts_format = experts;
    co.experts_group_size = o.experts_group_size;
    co.max_context = static_cast<int>(N);
    co.max_tokens = static_cast<int>(std::min<int64_t>(N - 1, o.chunk));
    co.max_logit_rows = co.max_tokens;
    co.max_seqs = 1;
    co.graph_batches = {1};
    co.progress = o.on_progress;
    MOEBIUS_ASSIGN_OR_RETURN(std::unique_ptr<Qwen3MoeCuda> model, Qwen3MoeCuda::load(o.model_dir, co));
    return finite_or_error(teacher_forced_logprobs(*model, ids), o.model_dir);
  }
#endif
  Qwen3MoeLoadOptions load;
  load.experts_format = experts;
  load.experts_group_size = o.experts_group_size;
  MOEBIUS_ASSIGN_OR_RETURN(Qwen3MoeCpu model, Qwen3MoeCpu::load(o.model_dir, load));
  return finite_or_error(teacher_forced_logprobs(model, ids, o.chunk), o.model_dir);
}

std::string format_logprob_report(std::span<const int32_t> ids, std::span<const float> got,
                                  const LogprobComparison* cmp) {
  std::string out;
  double sum = 0.0;
  for (float x : got) sum += x;
  const double mean = got.empty() ? 0.0 : sum / static_cast<double>(got.size());
  out += fmt::format("tokens:           {} ({} scored)\n", ids.size(), got.size());
  if (cmp != nullptr) {
    const int64_t at = cmp->max_index + 1;
    out += fmt::format("mean |dlogprob|:  {:.6g}\n", cmp->mean_abs_delta);
    out += fmt::format("max |dlogprob|:   {:.6g} at position {} (token {})\n", cmp->max_abs_delta, at,
                       ids[static_cast<size_t>(at)]);
    out += fmt::format("mean logprob:     {:.6f} (ref {:.6f})\n", cmp->mean_logprob, cmp->ref_mean_logprob);
    out += fmt::format("perplexity:       {:.6g} (ref {:.6g})\n", cmp->perplexity(), cmp->ref_perplexity());
  } else {
    out += fmt::format("mean logprob:     {:.6f}\n", mean);
    out += fmt::format("perplexity:       {:.6g}\n", std::exp(-mean));
  }
  out += fmt::format("logprobs hash:    #{:08x}\n", fnv1a_logits(got));
  return out;
}

}  // namespace moebius::model
