// `moebius profile-experts --model DIR --prompts FILE [--out F] [--prompt-format text|ids]
//                          [--tokenizer DIR] [--experts FMT]`
//
// Prefills every prompt of FILE (one per line) on the CPU model and writes the routing profile
// (counts and mass per MoE layer and expert, offload/routing_profile.h) as JSON to F, or to stdout.
// `--placement F` of generate / serve / bench generate reads it.
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/error.h"
#include "model/generate.h"
#include "model/profile_experts.h"
#include "model/qwen3_moe_cpu.h"
#include "offload/expert_cache.h"
#include "offload/placement.h"
#include "offload/routing_profile.h"
#include "tokenizer/bpe_tokenizer.h"

namespace moebius::cli {

namespace {

struct ProfileCliOptions {
  std::string model_dir, prompts, out, tokenizer_dir, prompt_format = "text", experts;
  int simulate_cache = 0;
  double decay = 0.9;
};

// The dynamic cache policies on the prompts' token-by-token routing, `slots` experts per layer:
// hit rates (share of routed experts found resident) averaged over the MoE layers, starting from
// the uniform placement; "hottest" is the static placement from this same profile (in-sample, an
// upper bound for a static profile placement).
Status simulate_caches(const offload::RoutingProfile& prof, const model::RoutingTrace& trace, int slots, double decay) {
  const int E = prof.num_experts;
  if (slots < 1 || slots > E) return Error::format("must be in [1, {}], got {}", E, slots).in_field("--simulate-cache");
  struct Row {
    const char* name;
    offload::CacheOptions opt;
    bool hottest;
  };
  const Row rows[] = {{"static uniform", {offload::CachePolicy::kStatic, decay, 1}, false},
                      {"static hottest (in-sample)", {offload::CachePolicy::kStatic, decay, 1}, true},
                      {"lru", {offload::CachePolicy::kLru, decay, 4}, false},
                      {"freq (decay)", {offload::CachePolicy::kFreqDecay, decay, 4}, false}};
  std::vector<int> layers;
  for (const offload::LayerRouting& l : prof.layers) layers.push_back(l.layer);
  const std::vector<int> counts(layers.size(), slots);
  const offload::Placement uniform = offload::place_uniform(layers, E, counts);
  MOEBIUS_ASSIGN_OR_RETURN(offload::Placement hottest, offload::place_hottest(prof, layers, E, counts, "profile"));
  std::fprintf(stderr, "dynamic cache simulation: %d of %d experts per layer resident, %zu tokens, decay %.3g, at most "
                       "4 swaps per token\n", slots, E, trace.empty() ? size_t{0} : trace[0].size(), decay);
  for (const Row& r : rows) {
    double sum = 0;
    for (size_t i = 0; i < layers.size(); ++i) {
      const std::vector<uint8_t>& start = r.hottest ? hottest.resident[i] : uniform.resident[i];
      MOEBIUS_ASSIGN_OR_RETURN(double h, offload::simulate_hit_rate(start, r.opt, trace[i]));
      sum += h;
    }
    std::fprintf(stderr, "  %-28s hit rate %.1f%%\n", r.name, layers.empty() ? 0.0 : 100.0 * sum / layers.size());
  }
  return Ok{};
}

Status run(const ProfileCliOptions& o) {
  if (o.prompt_format != "text" && o.prompt_format != "ids")
    return Error::format("'{}': expected text or ids", o.prompt_format).in_field("--prompt-format");
  MOEBIUS_ASSIGN_OR_RETURN(std::vector<std::string> lines, model::read_prompt_lines(o.prompts));
  std::vector<std::vector<int32_t>> prompts;
  if (o.prompt_format == "ids") {
    for (size_t i = 0; i < lines.size(); ++i) {
      auto ids = model::parse_prompt_ids(lines[i], fmt::format("line {}", i + 1));
      if (!ids.ok()) return std::move(ids).error().in_file(o.prompts);
      prompts.push_back(std::move(ids).value());
    }
  } else {
    const std::string dir = o.tokenizer_dir.empty() ? o.model_dir : o.tokenizer_dir;
    const std::string tok_path = (std::filesystem::path(dir) / "tokenizer.json").string();
    std::error_code ec;
    if (!std::filesystem::exists(tok_path, ec))
      return Error::format("text prompts need '{}'; pass --tokenizer DIR or --prompt-format ids", tok_path)
          .in_field("--prompts");
    MOEBIUS_ASSIGN_OR_RETURN(tokenizer::BpeTokenizer tok, tokenizer::BpeTokenizer::load(tok_path));
    for (size_t i = 0; i < lines.size(); ++i) {
      std::vector<int32_t> ids;
      for (tokenizer::TokenId id : tok.encode(lines[i])) ids.push_back(static_cast<int32_t>(id));
      if (ids.empty()) return Error::format("line {} encodes to no tokens", i + 1).in_file(o.prompts);
      prompts.push_back(std::move(ids));
    }
  }
  model::Qwen3MoeLoadOptions lo;
  MOEBIUS_ASSIGN_OR_RETURN(lo.experts_format, model::parse_experts_format(o.experts));
  MOEBIUS_ASSIGN_OR_RETURN(model::Qwen3MoeCpu m, model::Qwen3MoeCpu::load(o.model_dir, lo));
  for (const std::vector<int32_t>& p : prompts)
    for (int32_t id : p)
      if (id >= m.config().vocab_size)
        return Error::format("token id {} is outside the vocabulary [0, {})", id, m.config().vocab_size)
            .in_file(o.prompts);
  model::RoutingTrace trace;
  MOEBIUS_ASSIGN_OR_RETURN(offload::RoutingProfile prof,
                           model::profile_experts(m, prompts, o.simulate_cache > 0 ? &trace : nullptr));
  if (o.out.empty()) {
    const std::string text = offload::profile_to_json(prof);
    std::fwrite(text.data(), 1, text.size(), stdout);
  } else {
    MOEBIUS_TRY(offload::write_profile(prof, o.out));
  }
  std::fprintf(stderr, "profiled %zu prompts, %llu tokens, %zu MoE layers x %d experts%s%s\n", prompts.size(),
               static_cast<unsigned long long>(prof.tokens), prof.layers.size(), prof.num_experts,
               o.out.empty() ? "" : " -> ", o.out.c_str());
  if (o.simulate_cache > 0) MOEBIUS_TRY(simulate_caches(prof, trace, o.simulate_cache, o.decay));
  return Ok{};
}

}  // namespace

void register_profile_experts(CLI::App& app) {
  auto o = std::make_shared<ProfileCliOptions>();
  CLI::App* cmd = app.add_subcommand(
      "profile-experts", "routing counts and mass per layer and expert over a prompts file (CPU), as JSON");
  cmd->add_option("--model", o->model_dir, "model directory")->required();
  cmd->add_option("--prompts", o->prompts, "prompts file, one per line")->required();
  cmd->add_option("--out", o->out, "output JSON file (default: stdout)");
  cmd->add_option("--prompt-format", o->prompt_format, "text (encoded with the tokenizer) or ids (1,2,3 per line)")
      ->capture_default_str();
  cmd->add_option("--tokenizer", o->tokenizer_dir, "directory of tokenizer.json (default: --model)");
  cmd->add_option("--experts", o->experts, "expert format as served: bf16, nvfp4, int4, int2 (default: as stored)");
  cmd->add_option("--simulate-cache", o->simulate_cache,
                  "also replay the prompts' token-by-token routing through the static, LRU and frequency-with-decay "
                  "caches with this many experts per layer resident, and print their hit rates");
  cmd->add_option("--decay", o->decay, "frequency cache: score decay per token, in (0, 1]")->capture_default_str();
  cmd->final_callback([o] {
    Status s = run(*o);
    if (!s.ok()) {
      std::fprintf(stderr, "moebius profile-experts: error: %s\n", s.error().what().c_str());
      throw CLI::RuntimeError(2);
    }
  });
}

}  // namespace moebius::cli
