// `moebius bench engine`: the serving engine's host time per step, with a model that costs nothing.
//
// A synthetic runner answers every step at once with logits rows of the tokenizer's vocabulary (a
// peaked, language-model-like row: a Gaussian bulk and a few ids far above it, rotated per row so
// the drawn tokens vary; or with --row flat the bulk alone, sigma 1, as a model with random weights
// or a high temperature gives: sampling's worst case), so what is timed is the engine's own work
// between two forward passes on a GPU: scheduling, the draws (model/sampler.h), logprobs, detokenization, stop strings and the
// streams. The rows stay in the runner's pool (StepRunner::step_rows), as the CUDA runner's stay in
// its pinned read-back; --copy-rows copies them into the engine's buffer instead, on the thread
// pool, as a runner without step_rows does (timed apart). N requests of --prompt-len ids and
// --output-len tokens (ignore_eos) are submitted at once; with --seqs running at a time, every step
// after the prefills is a decode step of N sequences.
//
// Prints the steps, the wall time per step split into the runner's copy and the rest (the engine),
// and the output tokens per second the host alone would allow.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cli/commands.h"
#include "core/thread_pool.h"
#include "server/engine.h"
#include "server/step_runner.h"
#include "tokenizer/bpe_tokenizer.h"

namespace moebius::cli {
namespace {

struct BenchEngineOptions {
  std::string tokenizer;  // a directory holding tokenizer.json
  int seqs = 64;
  int requests = 0;  // 0: --seqs
  int prompt_len = 16;
  int output_len = 128;
  double temperature = 0.0;
  int top_k = 0;
  double top_p = 1.0;
  int logprobs = -1;  // top logprobs per token; -1: none
  bool copy_rows = false;
  std::string row = "peaked";  // peaked or flat
};

// Rows of a language-model-like distribution over V ids; each step's rows are copied out of a
// pool of kPoolRows.
class SyntheticRunner final : public server::StepRunner {
 public:
  SyntheticRunner(int64_t vocab, int max_seqs, int max_context, bool copy_rows, bool flat) : copy_rows_(copy_rows) {
    config_.vocab_size = vocab;
    limits_.block_size = 16;
    limits_.max_context = max_context;
    limits_.max_seqs = max_seqs;
    limits_.max_step_tokens = std::max(max_seqs, 256);
    limits_.num_blocks = max_seqs * ((max_context + 15) / 16) + 16;
    const size_t V = static_cast<size_t>(vocab);
    std::mt19937 rng(1);
    std::normal_distribution<float> bulk(0.0f, flat ? 1.0f : 2.5f);
    pool_.resize(kPoolRows * V);
    for (float& x : pool_) x = bulk(rng);
    for (size_t r = 0; r < kPoolRows && !flat; ++r)
      for (int j = 0; j < 8; ++j) pool_[r * V + (rng() % V)] = 14.0f + static_cast<float>(j);
  }
  const model::Qwen3MoeConfig& config() const override { return config_; }
  const server::RunnerLimits& limits() const override { return limits_; }
  std::string describe() const override { return "synthetic (bench engine)"; }
  Status step(std::span<const server::RunnerSeq> seqs, std::vector<float>& logits) override {
    const auto t0 = std::chrono::steady_clock::now();
    const size_t V = static_cast<size_t>(config_.vocab_size);
    size_t rows = 0;
    for (const server::RunnerSeq& s : seqs) rows += server::logits_rows(s);
    logits.resize(rows * V);
    const auto copy = [&](int64_t r) {
      const size_t src = (static_cast<size_t>(r) + step_) % kPoolRows;
      std::memcpy(logits.data() + static_cast<size_t>(r) * V, pool_.data() + src * V, V * sizeof(float));
    };
    ThreadPool::global().parallel_for(0, static_cast<int64_t>(rows), copy);
    ++step_;
    copy_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return Ok{};
  }
  // As the CUDA runner on one GPU: the rows stay where the model left them (here, the pool).
  Status step_rows(std::span<const server::RunnerSeq> seqs, std::vector<float>& scratch,
                   std::vector<const float*>& rows) override {
    if (copy_rows_) return StepRunner::step_rows(seqs, scratch, rows);
    const size_t V = static_cast<size_t>(config_.vocab_size);
    rows.clear();
    for (const server::RunnerSeq& s : seqs)
      for (size_t r = 0; r < server::logits_rows(s); ++r) rows.push_back(pool_.data() + ((rows.size() + step_) % kPoolRows) * V);
    ++step_;
    return Ok{};
  }
  void release(int64_t) override {}
  bool shares_kv_blocks() const override { return true; }
  Result<std::unique_ptr<server::StagedWeights>> stage_weights(const std::string&) const override {
    return Error("a synthetic model has no weights");
  }
  void commit_weights(server::StagedWeights&) override {}
  double copy_seconds() const { return copy_seconds_; }
  int64_t steps() const { return step_; }

 private:
  static constexpr size_t kPoolRows = 61;
  bool copy_rows_;
  model::Qwen3MoeConfig config_;
  server::RunnerLimits limits_;
  std::vector<float> pool_;
  int64_t step_ = 0;
  double copy_seconds_ = 0.0;
};

Status run(const BenchEngineOptions& o) {
  MOEBIUS_ASSIGN_OR_RETURN(tokenizer::BpeTokenizer tok, tokenizer::BpeTokenizer::load(o.tokenizer + "/tokenizer.json"));
  const int64_t V = static_cast<int64_t>(tok.vocab_size());
  const int requests = o.requests > 0 ? o.requests : o.seqs;
  auto runner = std::make_unique<SyntheticRunner>(V, o.seqs, o.prompt_len + o.output_len + 16, o.copy_rows,
                                                 o.row == "flat");
  SyntheticRunner* synthetic = runner.get();
  server::EngineOptions eo;
  eo.max_queue = requests;
  server::Engine engine(std::move(runner), &tok, eo);
  std::mt19937 rng(2);
  std::vector<std::shared_ptr<server::RequestStream>> streams;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < requests; ++i) {
    server::EngineRequest r;
    for (int k = 0; k < o.prompt_len; ++k) r.prompt.push_back(static_cast<int32_t>(rng() % static_cast<uint32_t>(V)));
    r.max_tokens = o.output_len;
    r.ignore_eos = true;
    r.sampling.temperature = static_cast<float>(o.temperature);
    r.sampling.top_k = o.top_k;
    r.sampling.top_p = static_cast<float>(o.top_p);
    r.sampling.seed = static_cast<uint64_t>(i);
    r.top_logprobs = o.logprobs;
    server::Submitted s = engine.submit(std::move(r));
    if (!s.stream) return Error::format("request {} was refused: {}", i, s.error);
    streams.push_back(s.stream);
  }
  int64_t tokens = 0;
  for (auto& s : streams) {
    server::RequestUpdate u;
    while (!u.finished) s->take(&u, std::chrono::milliseconds(100));
    if (!u.error.empty()) return Error::format("a request failed: {}", u.error);
    tokens += u.completion_tokens;
  }
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int64_t steps = synthetic->steps();
  const double copy = synthetic->copy_seconds();
  std::printf("bench engine: V %lld, %s rows, %d requests (%d running), prompt %d, output %d, %s%s, %u threads\n",
              static_cast<long long>(V), o.row.c_str(), requests, o.seqs, o.prompt_len, o.output_len,
              o.temperature == 0.0 ? "greedy"
                                   : fmt::format("temperature {}, top_k {}, top_p {}", o.temperature, o.top_k,
                                                 o.top_p)
                                         .c_str(),
              o.logprobs >= 0 ? fmt::format(", logprobs {}", o.logprobs).c_str() : "", ThreadPool::global().size());
  std::printf("steps %lld, output tokens %lld, wall %.3f s\n", static_cast<long long>(steps),
              static_cast<long long>(tokens), wall);
  std::printf("per step: %.1f us (runner's row copy %.1f us, engine %.1f us); host-bound output %.0f tok/s\n",
              1e6 * wall / static_cast<double>(steps), 1e6 * copy / static_cast<double>(steps),
              1e6 * (wall - copy) / static_cast<double>(steps), static_cast<double>(tokens) / wall);
  return Ok{};
}

}  // namespace

void register_bench_engine(CLI::App& bench) {
  auto o = std::make_shared<BenchEngineOptions>();
  CLI::App* cmd = bench.add_subcommand(
      "engine", "time the serving engine's host work per step (scheduling, sampling, detokenizing, streams) "
                "against a synthetic model that answers at once");
  cmd->add_option("--tokenizer", o->tokenizer, "directory with tokenizer.json (its vocabulary sizes the rows)")
      ->required();
  cmd->add_option("--seqs", o->seqs, "sequences running at once")->check(CLI::Range(1, 4096))->capture_default_str();
  cmd->add_option("--requests", o->requests, "requests submitted (0: --seqs)")->check(CLI::Range(0, 1 << 20));
  cmd->add_option("--prompt-len", o->prompt_len, "prompt ids per request")->check(CLI::Range(1, 1 << 16))
      ->capture_default_str();
  cmd->add_option("--output-len", o->output_len, "tokens per request (ignore_eos)")->check(CLI::Range(1, 1 << 16))
      ->capture_default_str();
  cmd->add_option("--temperature", o->temperature, "0: greedy")->check(CLI::Range(0.0, 100.0))->capture_default_str();
  cmd->add_option("--top-k", o->top_k, "0: off")->check(CLI::Range(0, 1 << 30))->capture_default_str();
  cmd->add_option("--top-p", o->top_p, "in (0, 1]")->check(CLI::Range(1e-9, 1.0))->capture_default_str();
  cmd->add_option("--logprobs", o->logprobs, "top logprobs per token (-1: none)")->check(CLI::Range(-1, 20))
      ->capture_default_str();
  cmd->add_option("--row", o->row, "the rows' shape: peaked (a language model's) or flat (random weights)")
      ->check(CLI::IsMember({"peaked", "flat"}))
      ->capture_default_str();
  cmd->add_flag("--copy-rows", o->copy_rows, "the runner copies its rows into the engine's buffer (a runner without "
                                              "step_rows) instead of leaving them in place");
  cmd->final_callback([o] {
    Status s = run(*o);
    if (!s.ok()) {
      std::fprintf(stderr, "moebius bench engine: error: %s\n", s.error().what().c_str());
      throw CLI::RuntimeError(2);
    }
  });
}

}  // namespace moebius::cli
