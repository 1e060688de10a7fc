// `moebius eval logprobs --model DIR (--ref FILE | --prompt-ids 1,2,3 | --prompt TEXT)
//                        [--backend cpu|cuda] [--experts FMT] [--dump OUT] [--max-delta X]`
//
// A teacher-forced logprob oracle (model/eval_logprobs.h): one prefill over the ids, log-softmax
// per row at the next token, compared with the --ref dump (mean and max |Δlogprob|, mean logprob
// and perplexity of both) and/or written to --dump, so a bf16 run is the reference of an nvfp4 one.
// The report goes to stdout. Exit status: 0; 1 when --max-delta is given and max |Δ| exceeds it;
// 2 on errors (bad flags, a malformed ref, ids outside the vocabulary, a too long context).
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/progress.h"
#include "core/error.h"
#include "model/eval_logprobs.h"
#include "tokenizer/bpe_tokenizer.h"

namespace moebius::cli {

namespace {

struct EvalLogprobsCliOptions {
  model::EvalLogprobsOptions eval;
  std::string ref;
  std::string prompt;
  std::vector<int32_t> prompt_ids;
  std::string dump;
  double max_delta = 0.0;
  CLI::Option* ref_opt = nullptr;
  CLI::Option* prompt_opt = nullptr;
  CLI::Option* prompt_ids_opt = nullptr;
  CLI::Option* max_delta_opt = nullptr;
};

// 0 or 1 (the --max-delta verdict); errors are returned.
Result<int> run(const EvalLogprobsCliOptions& o) {
  const int sources = static_cast<int>(o.ref_opt->count() > 0) + static_cast<int>(o.prompt_opt->count() > 0) +
                      static_cast<int>(o.prompt_ids_opt->count() > 0);
  if (sources != 1) return Error("give exactly one of --ref, --prompt-ids and --prompt").in_field("--ref");
  if (o.max_delta_opt->count() > 0 && o.ref_opt->count() == 0)
    return Error("needs --ref to compare against").in_field("--max-delta");
  if (o.max_delta_opt->count() > 0 && !(o.max_delta >= 0.0))
    return Error::format("must be >= 0, got {}", o.max_delta).in_field("--max-delta");

  std::vector<int32_t> ids;
  std::optional<model::LogprobDump> ref;
  if (o.ref_opt->count() > 0) {
    MOEBIUS_ASSIGN_OR_RETURN(model::LogprobDump d, model::read_logprob_dump(o.ref));
    ids = d.input_ids;
    ref.emplace(std::move(d));
  } else if (o.prompt_ids_opt->count() > 0) {
    ids = o.prompt_ids;
  } else {
    const std::string tok_path = (std::filesystem::path(o.eval.model_dir) / "tokenizer.json").string();
    std::error_code ec;
    if (!std::filesystem::exists(tok_path, ec))
      return Error::format("--prompt needs a tokenizer, and '{}' does not exist; pass --prompt-ids instead", tok_path)
          .in_field("--prompt");
    MOEBIUS_ASSIGN_OR_RETURN(tokenizer::BpeTokenizer tok, tokenizer::BpeTokenizer::load(tok_path));
    for (tokenizer::TokenId id : tok.encode(o.prompt)) ids.push_back(static_cast<int32_t>(id));
  }

  ProgressBar bar("loading layers");
  model::EvalLogprobsOptions e = o.eval;
  e.on_progress = [&bar](int done, int total) { bar.update(done, total); };
  e.ids_field = o.ref_opt->count() > 0 ? "input_ids" : o.prompt_ids_opt->count() > 0 ? "--prompt-ids" : "--prompt";
  auto got = model::run_eval_logprobs(e, ids);
  if (!got.ok()) {
    Error err = std::move(got).error();
    if (o.ref_opt->count() > 0 && err.field() == "input_ids") err.in_file(o.ref);  // the ids came from the ref
    return err;
  }

  std::optional<model::LogprobComparison> cmp;
  if (ref) {
    MOEBIUS_ASSIGN_OR_RETURN(model::LogprobComparison c, model::compare_logprobs(*got, ref->logprobs));
    cmp = c;
  }
  std::fputs(model::format_logprob_report(ids, *got, cmp ? &*cmp : nullptr).c_str(), stdout);
  std::fflush(stdout);

  if (!o.dump.empty()) {
    model::LogprobDump d{ids, *got, {}};
    d.metadata["source"] = "moebius";
    d.metadata["model"] = o.eval.model_dir;
    d.metadata["backend"] = o.eval.backend;
    d.metadata["experts"] = o.eval.experts.empty() ? "checkpoint" : o.eval.experts;
    MOEBIUS_TRY(model::write_logprob_dump(d, o.dump));
  }
  if (cmp && o.max_delta_opt->count() > 0 && !(cmp->max_abs_delta <= o.max_delta)) {
    std::fprintf(stderr, "moebius eval logprobs: max |dlogprob| %.6g exceeds --max-delta %.6g\n", cmp->max_abs_delta,
                 o.max_delta);
    return 1;
  }
  return 0;
}

void register_eval_logprobs(CLI::App& eval) {
  auto o = std::make_shared<EvalLogprobsCliOptions>();
  CLI::App* cmd = eval.add_subcommand(
      "logprobs", "teacher-forced logprobs of a token sequence, compared with a reference dump and/or dumped");
  cmd->add_option("--model", o->eval.model_dir, "model directory (config.json, *.safetensors)")->required();
  o->ref_opt = cmd->add_option("--ref", o->ref, "reference dump (safetensors: input_ids I32 [N], logprobs F32 [N-1])");
  o->prompt_ids_opt =
      cmd->add_option("--prompt-ids", o->prompt_ids, "token ids, comma-separated (no comparison)")->delimiter(',');
  o->prompt_opt = cmd->add_option("--prompt", o->prompt, "text, encoded with DIR/tokenizer.json (no comparison)");
  cmd->add_option("--dump", o->dump, "write this run's logprobs as a reference dump to this file");
  o->max_delta_opt = cmd->add_option("--max-delta", o->max_delta, "exit 1 when max |dlogprob| against --ref exceeds this");
  cmd->add_option("--experts", o->eval.experts, "re-quantize experts: bf16, nvfp4, int4, int2 (default: as stored)");
  cmd->add_option("--group-size", o->eval.experts_group_size, "int expert formats: group size (-1 = per channel)")
      ->capture_default_str();
  cmd->add_option("--backend", o->eval.backend, "cpu or cuda")->capture_default_str();
  cmd->add_option("--chunk", o->eval.chunk, "tokens per forward (the KV cache is kept between chunks)")
      ->capture_default_str();
  cmd->final_callback([o] {
    auto r = run(*o);
    if (!r.ok()) {
      std::fprintf(stderr, "moebius eval logprobs: error: %s\n", r.error().what().c_str());
      throw CLI::RuntimeError(2);
    }
    if (*r != 0) throw CLI::RuntimeError(*r);
  });
}

}  // namespace

void register_eval(CLI::App& app) {
  CLI::App* eval = app.add_subcommand("eval", "accuracy checks against references");
  eval->require_subcommand(1);
  register_eval_logprobs(*eval);
}

}  // namespace moebius::cli
