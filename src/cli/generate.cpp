// `moebius generate --model DIR (--prompt TEXT | --prompt-ids 1,2,3) [--chat [--system TEXT]
//  [--no-thinking]] [sampling flags]`
//
// Prompt: --prompt is encoded with the tokenizer (--tokenizer DIR, default the model's directory:
// DIR/tokenizer.json, required then); --prompt-ids is used as is. With --chat the prompt is the
// user's message of a conversation (after --system's message, if given) rendered with the chat
// template of DIR/tokenizer_config.json and the assistant's turn opened, as a chat client or
// `serve`'s /v1/chat/completions would send it; an instruct model answers rather than continues
// the text. --no-thinking passes enable_thinking=false (Qwen3's template then closes an empty
// think block).
// Output: generated text streams to stdout through the StreamingDecoder as tokens are sampled;
// with --prompt-ids and no DIR/tokenizer.json the generated ids are printed instead, space
// separated. The end-of-run report (token counts, tok/s, GB/s, logits hash) goes to stderr.
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/ep_workers.h"
#include "chat/chat_template.h"
#include "cli/progress.h"
#include "core/error.h"
#include "model/generate.h"
#include "tokenizer/bpe_tokenizer.h"
#include "tokenizer/streaming_decoder.h"

namespace moebius::cli {

namespace {

struct GenerateCliOptions {
  model::GenerateOptions gen;
  std::string prompt;
  std::vector<int32_t> prompt_ids;
  std::string tokenizer_dir;  // "": the model's directory
  bool chat = false;
  std::string system;
  bool no_thinking = false;
  float temperature = 1.0f;
  int top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  float repetition_penalty = 1.0f;
  bool no_autotune = false;
  CLI::Option* prompt_opt = nullptr;
  CLI::Option* prompt_ids_opt = nullptr;
  CLI::Option* temperature_opt = nullptr;
  CLI::Option* top_k_opt = nullptr;
  CLI::Option* top_p_opt = nullptr;
  CLI::Option* min_p_opt = nullptr;
  CLI::Option* repetition_penalty_opt = nullptr;
};

void write_out(const std::string& s) {
  std::fwrite(s.data(), 1, s.size(), stdout);
  std::fflush(stdout);
}

// --chat: the conversation's prompt text, from the tokenizer directory's chat template.
Result<std::string> render_chat_prompt(const GenerateCliOptions& o, const std::string& tok_dir) {
  const std::string config = (std::filesystem::path(tok_dir) / "tokenizer_config.json").string();
  std::error_code ec;
  if (!std::filesystem::exists(config, ec))
    return Error::format("needs a chat template, and '{}' does not exist", config).in_field("--chat");
  try {
    const chat::ChatTemplate tmpl = chat::ChatTemplate::from_tokenizer_config(config);
    nlohmann::ordered_json messages = nlohmann::ordered_json::array();
    if (!o.system.empty()) messages.push_back({{"role", "system"}, {"content", o.system}});
    messages.push_back({{"role", "user"}, {"content", o.prompt}});
    chat::RenderOptions ro;
    if (o.no_thinking) ro.enable_thinking = false;
    return tmpl.render(messages, ro);
  } catch (const Error& e) {
    return Error("the chat template of '" + config + "' failed: " + e.what()).in_field("--chat");
  }
}

Status run(GenerateCliOptions& o) {
  model::GenerateOptions g = o.gen;
  const bool has_text = o.prompt_opt->count() > 0, has_ids = o.prompt_ids_opt->count() > 0;
  if (has_text == has_ids) return Error("give exactly one of --prompt and --prompt-ids").in_field("--prompt");
  if (o.chat && !has_text) return Error("renders a text prompt; give --prompt, not --prompt-ids").in_field("--chat");
  if (!o.chat && !o.system.empty()) return Error("is a chat message; add --chat").in_field("--system");
  if (!o.chat && o.no_thinking) return Error("is a chat template option; add --chat").in_field("--no-thinking");
  if (o.temperature_opt->count() > 0) g.temperature = o.temperature;
  if (o.top_k_opt->count() > 0) g.top_k = o.top_k;
  if (o.top_p_opt->count() > 0) g.top_p = o.top_p;
  if (o.min_p_opt->count() > 0) g.min_p = o.min_p;
  if (o.repetition_penalty_opt->count() > 0) g.repetition_penalty = o.repetition_penalty;
  g.autotune = !o.no_autotune;

  const std::string tok_dir = o.tokenizer_dir.empty() ? g.model_dir : o.tokenizer_dir;
  const std::string tok_path = (std::filesystem::path(tok_dir) / "tokenizer.json").string();
  std::error_code ec;
  std::optional<tokenizer::BpeTokenizer> tok;
  if (!o.tokenizer_dir.empty() && !std::filesystem::exists(tok_path, ec))
    return Error::format("'{}' does not exist", tok_path).in_field("--tokenizer");
  if (has_text || std::filesystem::exists(tok_path, ec)) {
    if (has_text && !std::filesystem::exists(tok_path, ec))
      return Error::format("--prompt needs a tokenizer, and '{}' does not exist; pass --tokenizer DIR or --prompt-ids",
                           tok_path)
          .in_field("--prompt");
    MOEBIUS_ASSIGN_OR_RETURN(tokenizer::BpeTokenizer t, tokenizer::BpeTokenizer::load(tok_path));
    tok.emplace(std::move(t));
  }
  if (has_text) {
    std::string text = o.prompt;
    if (o.chat) {
      MOEBIUS_ASSIGN_OR_RETURN(text, render_chat_prompt(o, tok_dir));
    }
    for (tokenizer::TokenId id : tok->encode(text)) g.prompt_ids.push_back(static_cast<int32_t>(id));
    if (g.prompt_ids.empty()) return Error("the prompt encodes to no tokens").in_field("--prompt");
  } else {
    g.prompt_ids = o.prompt_ids;
  }

  // --ep on the CUDA backend: this process starts one worker per GPU and waits for them, or is
  // one of them (src/cli/ep_workers.h). Only rank 0 prints.
  bool quiet = false;
  if (g.backend == "cuda" && g.ep > 1) {
    MOEBIUS_ASSIGN_OR_RETURN(EpRole role, start_ep_cuda(g.ep, model::WeightSource{g.model_dir, "", g.load_format}));
    if (role.launched) return Ok{};
    g.ep_comm = role.comm;
    quiet = role.comm->rank() != 0;
  }

  std::optional<tokenizer::StreamingDecoder> decoder;
  if (tok) decoder.emplace(*tok);
  bool first = true;
  auto on_token = [&](int32_t id) {
    if (decoder) {
      write_out(decoder->feed(static_cast<tokenizer::TokenId>(id)));
    } else {
      write_out(fmt::format("{}{}", first ? "" : " ", id));
      first = false;
    }
  };
  ProgressBar bar("loading layers");
  if (!quiet) {
    g.on_progress = [&bar](int done, int total) { bar.update(done, total); };
    g.on_report = [](const std::string& text) { std::fputs(text.c_str(), stderr); };
  }
  auto stats = model::run_generate(g, on_token);
  if (!stats.ok()) return std::move(stats).error();
  if (stats->ep_follower) return Ok{};
  if (decoder) write_out(decoder->flush());
  write_out("\n");
  std::fputs(model::format_generate_stats(*stats).c_str(), stderr);
  return Ok{};
}

}  // namespace

void register_generate(CLI::App& app) {
  auto o = std::make_shared<GenerateCliOptions>();
  CLI::App* cmd = app.add_subcommand("generate", "generate text from a prompt (CPU or CUDA backend)");
  cmd->add_option("--model", o->gen.model_dir, "model directory (config.json, *.safetensors, tokenizer.json)")
      ->required();
  o->prompt_opt = cmd->add_option("--prompt", o->prompt, "prompt text (needs DIR/tokenizer.json)");
  o->prompt_ids_opt =
      cmd->add_option("--prompt-ids", o->prompt_ids, "prompt token ids, comma-separated")->delimiter(',');
  o->prompt_opt->excludes(o->prompt_ids_opt);
  cmd->add_option("--tokenizer", o->tokenizer_dir,
                  "directory of tokenizer.json (and tokenizer_config.json for --chat); default: --model's");
  cmd->add_flag("--chat", o->chat,
                "--prompt is a user message: render it with the chat template (tokenizer_config.json) and open the "
                "assistant's turn");
  cmd->add_option("--system", o->system, "--chat: a system message before the user's");
  cmd->add_flag("--no-thinking", o->no_thinking, "--chat: enable_thinking=false (Qwen3: answer without reasoning)");
  cmd->add_option("--max-tokens", o->gen.max_tokens, "tokens to generate at most")->capture_default_str();
  o->temperature_opt = cmd->add_option("--temperature", o->temperature,
                                       "0 = greedy (default: generation_config.json, else 1)");
  o->top_k_opt = cmd->add_option("--top-k", o->top_k, "keep the k most likely tokens; 0 = off");
  o->top_p_opt = cmd->add_option("--top-p", o->top_p, "nucleus sampling mass in (0, 1]; 1 = off");
  o->min_p_opt = cmd->add_option("--min-p", o->min_p,
                                 "drop tokens below min_p * the top probability; 0 = off (default: "
                                 "generation_config.json, else 0)");
  o->repetition_penalty_opt = cmd->add_option(
      "--repetition-penalty", o->repetition_penalty,
      "HF's: a token seen in the prompt or output has its logit divided (> 0) or multiplied (< 0) by it; "
      "1 = off (default: generation_config.json, else 1)");
  cmd->add_option("--presence-penalty", o->gen.presence_penalty,
                  "OpenAI's: subtracted once from the logit of every token already generated; in [-2, 2]")
      ->capture_default_str();
  cmd->add_option("--frequency-penalty", o->gen.frequency_penalty,
                  "OpenAI's: subtracted from a generated token's logit once per time it was generated; in [-2, 2]")
      ->capture_default_str();
  cmd->add_option("--seed", o->gen.seed, "RNG seed (std::mt19937_64)")->capture_default_str();
  cmd->add_option("--experts", o->gen.experts, "re-quantize experts: bf16, nvfp4, int4, int2 (default: as stored)");
  cmd->add_option("--backend", o->gen.backend, "cpu or cuda")->capture_default_str();
  add_offload_options(cmd, &o->gen.gpu_memory_budget, &o->gen.placement_file, &o->gen.expert_cache,
                      &o->gen.expert_prefetch, &o->gen.expert_dma);
  add_ep_option(cmd, &o->gen.ep);
  cmd->add_option("--load-format", o->gen.load_format,
                  "auto (read the checkpoint) or dummy (cuda: random weights of config.json's geometry)")
      ->capture_default_str();
  cmd->add_option("--prefill-chunk", o->gen.prefill_chunk, "cuda: prompt tokens per forward")->capture_default_str();
  cmd->add_flag("--no-autotune", o->no_autotune,
                "cuda: run the MoE kernels' heuristic configurations; no tuning, no tuning cache");
  cmd->final_callback([o] {
    Status s = run(*o);
    if (!s.ok()) {
      std::fprintf(stderr, "moebius generate: error: %s\n", s.error().what().c_str());
      throw CLI::RuntimeError(2);
    }
  });
}

}  // namespace moebius::cli
