// `moebius serve --model DIR [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--backend cpu|cuda]`
// `moebius serve --geometry qwen3-30b-a3b --load-format dummy --experts nvfp4 --backend cuda --tokenizer DIR`
//
// Loads the model into a StepRunner, starts the engine thread (server/engine.h) and serves the
// OpenAI API (server/api_server.h) until SIGINT or SIGTERM. The tokenizer (tokenizer.json) and
// chat template (tokenizer_config.json) come from --tokenizer DIR, by default the model's; with
// --geometry (random weights of a named model, no directory: benchmarks, or a server whose real
// weights arrive by POST /update_weights_from_disk) --tokenizer is required and the sampling
// defaults are the API's (no generation_config.json).
// Once listening it prints "moebius serve: listening on http://HOST:PORT" to stderr (with
// --port 0 the port is the one the system chose; the server tests read it from there).
#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <string_view>
#include <thread>

#include <nlohmann/json.hpp>

#include "chat/chat_template.h"
#include "cli/commands.h"
#include "cli/ep_workers.h"
#include "core/error.h"
#include "core/log.h"
#include "core/memory.h"
#include "model/generation_config.h"
#include "model/weight_source.h"
#include "server/api_server.h"
#include "server/http_server.h"
#include "server/step_runner.h"

namespace moebius::cli {
namespace {

struct ServeOptions {
  server::RunnerOptions runner;
  std::string tokenizer_dir;
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string api_key;
  std::string served_model_name;
  int max_queue = 256;
  size_t max_body_bytes = 4u << 20;
  int max_connections = 1024;
  bool no_autotune = false;
  bool no_prefix_caching = false;
  std::string tool_call_parser = "auto";
  std::string reasoning_parser = "auto";
  bool enable_auto_tool_choice = false;  // vLLM's flag; accepted so its command lines work
};

// --tool-call-parser and --reasoning-parser. "auto" (the default) reads the chat template: a
// template that writes <tool_call> blocks taught the model the hermes format, one that writes
// <think> the qwen3 reasoning format. vLLM asks for both flags because it serves dozens of
// formats it cannot tell apart; this server knows one of each, and the template is the model's
// own statement of what it emits, so detecting them never parses a format the model was not
// taught, and a Qwen3 checkpoint answers as vLLM's recommended Qwen3 command line does (`vllm
// serve ... --enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3`).
// "none" turns a parser off.
Status check_output_parser_flags(const ServeOptions& o) {
  if (o.tool_call_parser != "auto" && o.tool_call_parser != "hermes" && o.tool_call_parser != "none")
    return Error::format("must be auto, hermes or none, got '{}'", o.tool_call_parser).in_field("--tool-call-parser");
  if (o.reasoning_parser != "auto" && o.reasoning_parser != "qwen3" && o.reasoning_parser != "none")
    return Error::format("must be auto, qwen3 or none, got '{}'", o.reasoning_parser).in_field("--reasoning-parser");
  return Ok{};
}

void choose_output_parsers(const ServeOptions& o, const chat::ChatTemplate* tmpl, server::ApiServerOptions* ao) {
  const auto taught = [tmpl](std::string_view tag) {
    return tmpl != nullptr && tmpl->source().find(tag) != std::string::npos;
  };
  if (o.tool_call_parser == "hermes" || (o.tool_call_parser == "auto" && taught("<tool_call>")))
    ao->tool_call_parser = server::ToolCallParser::kHermes;
  if (o.reasoning_parser == "qwen3" || (o.reasoning_parser == "auto" && taught("<think>")))
    ao->reasoning_parser = server::ReasoningParser::kQwen3;
}

// tokenizer_config.json's eos_token ("<|im_end|>" or {"content": ...}) as an id, when there is one.
std::optional<int32_t> tokenizer_eos(const std::string& dir, const tokenizer::BpeTokenizer& tok) {
  // A missing, unreadable or oversized file means no id here; the chat template's loader reports it.
  auto file = read_small_file((std::filesystem::path(dir) / "tokenizer_config.json").string());
  if (!file.ok()) return std::nullopt;
  const nlohmann::json j = nlohmann::json::parse(*file, nullptr, false);
  if (!j.is_object() || !j.contains("eos_token")) return std::nullopt;
  const nlohmann::json& e = j["eos_token"];
  std::string text;
  if (e.is_string()) text = e.get<std::string>();
  else if (e.is_object() && e.contains("content") && e["content"].is_string()) text = e["content"].get<std::string>();
  if (text.empty()) return std::nullopt;
  if (auto id = tok.token_to_id(text)) return static_cast<int32_t>(*id);
  return std::nullopt;
}

Status run(ServeOptions& o) {
  const model::WeightSource& source = o.runner.source;
  MOEBIUS_TRY(model::validate_weight_source(source));
  if (o.tokenizer_dir.empty()) o.tokenizer_dir = source.model_dir;
  if (o.tokenizer_dir.empty())
    return Error("is required with --geometry (there is no model directory to read tokenizer.json from)")
        .in_field("--tokenizer");
  if (o.port < 0 || o.port > 65535) return Error::format("must be in [0, 65535], got {}", o.port).in_field("--port");
  if (o.max_queue < 1) return Error::format("must be >= 1, got {}", o.max_queue).in_field("--max-queue");
  if (o.max_connections < 1)
    return Error::format("must be >= 1, got {} (every request would get a 503)", o.max_connections)
        .in_field("--max-connections");
  MOEBIUS_TRY(check_output_parser_flags(o));
  const std::string tok_path = (std::filesystem::path(o.tokenizer_dir) / "tokenizer.json").string();
  std::error_code ec;
  if (!std::filesystem::exists(tok_path, ec))
    return Error::format("'{}' does not exist; serving needs a tokenizer", tok_path).in_field("--tokenizer");
  MOEBIUS_ASSIGN_OR_RETURN(tokenizer::BpeTokenizer tok, tokenizer::BpeTokenizer::load(tok_path));
  model::GenerationConfig gen;
  if (!source.model_dir.empty()) {
    MOEBIUS_ASSIGN_OR_RETURN(gen, model::load_generation_config(source.model_dir));
  }

  o.runner.autotune = !o.no_autotune;
  // --ep on the CUDA backend: this process starts one worker per GPU and waits for them, or is one
  // of them (src/cli/ep_workers.h). Rank 0 serves HTTP and schedules; every rank runs the
  // sequences placed on it and its experts, data parallel, until rank 0's runner goes
  // (docs/EXPERT_PARALLEL.md, [TAG_SERVE_DP]). The followers
  // ignore SIGINT (a Ctrl-C reaches the whole process group): rank 0 shuts down cleanly and
  // releases them; the launcher's SIGTERM still ends them.
  if (o.runner.backend == "cuda" && o.runner.ep > 1) {
    MOEBIUS_ASSIGN_OR_RETURN(EpRole role, start_ep_cuda(o.runner.ep, source));
    if (role.launched) return Ok{};
    o.runner.ep_comm = role.comm;
    if (role.comm->rank() != 0) {
      ::signal(SIGINT, SIG_IGN);
      return server::run_ep_follower(o.runner);
    }
  }

  // SIGINT/SIGTERM are taken by one thread with sigwait(); blocked before any thread starts so
  // none of the others is interrupted by them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  // The signal thread starts now, not once the server listens: loading can take minutes, and a
  // signal then (nothing served yet, nothing to lose) ends the process at once. Once the server
  // listens, a signal stops it gracefully. On an early error return the guard wakes the thread
  // (a signal aimed at it, with `leaving` set) and joins it.
  std::atomic<server::HttpServer*> listening{nullptr};
  std::atomic<bool> leaving{false};
  std::thread waiter([&] {
    int sig = 0;
    sigwait(&signals, &sig);
    if (leaving.load()) return;
    server::HttpServer* http = listening.load();
    if (http == nullptr) {
      std::fprintf(stderr, "moebius serve: signal %d while starting: exiting\n", sig);
      std::_Exit(128 + sig);
    }
    log_info("signal {}: shutting down", sig);
    http->stop();
  });
  struct WaiterGuard {
    std::thread& t;
    std::atomic<bool>& leaving;
    ~WaiterGuard() {
      if (!t.joinable()) return;
      leaving = true;
      pthread_kill(t.native_handle(), SIGTERM);  // a no-op if it already returned after a signal
      t.join();
    }
  } guard{waiter, leaving};

  log_info("loading {} ({} backend{})", source.name(), o.runner.backend, source.dummy() ? ", dummy weights" : "");
  if (const std::string f =
          offload::first_offload_flag(o.runner.gpu_memory_budget, o.runner.placement_file, o.runner.expert_cache,
                                      o.runner.expert_prefetch, o.runner.expert_dma);
      !f.empty() && o.runner.backend != "cuda")
    return Error("expert offload needs --backend cuda").in_field(f);
  MOEBIUS_ASSIGN_OR_RETURN(std::unique_ptr<server::StepRunner> runner, server::load_runner(o.runner));
  log_info("{}", runner->describe());
  // Ids the tokenizer can produce that the model has no embedding for: every text request that
  // hits one is refused (400); said once here, where the cause is visible.
  if (const size_t model_vocab = static_cast<size_t>(runner->config().vocab_size); tok.vocab_size() > model_vocab)
    log_warn("the tokenizer ({}) has ids up to {} but the model's vocabulary is {}: requests whose text encodes to "
             "such ids will be refused; is --tokenizer the model's own?",
             o.tokenizer_dir, tok.vocab_size() - 1, model_vocab);

  server::EngineOptions eo;
  eo.max_queue = o.max_queue;
  eo.eos_ids = gen.eos_token_ids;
  if (auto id = tokenizer_eos(o.tokenizer_dir, tok))
    if (std::find(eo.eos_ids.begin(), eo.eos_ids.end(), *id) == eo.eos_ids.end()) eo.eos_ids.push_back(*id);
  eo.prefix_caching = !o.no_prefix_caching;
  server::Engine engine(std::move(runner), &tok, eo);
  if (engine.prefix_caching())
    log_info("prefix caching on: whole {}-token blocks of computed KV are reused across requests",
             engine.limits().block_size);
  else if (!o.no_prefix_caching)
    log_info("prefix caching off: this runner keeps a cache per sequence");

  server::ApiServerOptions ao;
  ao.served_model_name = o.served_model_name;
  if (ao.served_model_name.empty() && !source.model_dir.empty())
    ao.served_model_name = std::filesystem::path(source.model_dir).lexically_normal().filename().string();
  if (ao.served_model_name.empty()) ao.served_model_name = source.name();
  ao.model_aliases = {source.name()};
  ao.api_key = o.api_key;
  ao.max_body_bytes = o.max_body_bytes;
  if (gen.do_sample.has_value() && !*gen.do_sample) ao.sampling.temperature = 0.0f;
  else if (gen.temperature) ao.sampling.temperature = *gen.temperature;
  if (gen.top_k) ao.sampling.top_k = *gen.top_k;
  if (gen.top_p) ao.sampling.top_p = *gen.top_p;
  if (gen.min_p) ao.sampling.min_p = *gen.min_p;
  if (gen.repetition_penalty) ao.sampling.repetition_penalty = *gen.repetition_penalty;
  server::ChatRenderer chat;  // stays empty without a template: /v1/chat/completions answers 400
  std::shared_ptr<chat::ChatTemplate> tmpl;
  const std::string tok_config = (std::filesystem::path(o.tokenizer_dir) / "tokenizer_config.json").string();
  if (std::filesystem::exists(tok_config, ec)) {
    try {
      tmpl = std::make_shared<chat::ChatTemplate>(chat::ChatTemplate::from_tokenizer_config(tok_config));
      chat = [tmpl](const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                    std::optional<bool> thinking) -> Result<std::string> {
        try {
          chat::RenderOptions ro;
          ro.enable_thinking = thinking;
          ro.tools = tools;
          return tmpl->render(messages, ro);
        } catch (const Error& e) {
          return e;
        } catch (const std::exception& e) {  // the renderer's own bug; still the client's answer
          return Error(e.what());
        }
      };
    } catch (const Error& e) {
      log_warn("no chat template, /v1/chat/completions is off: {}", e.what());
    }
  } else {
    log_warn("'{}' does not exist: no chat template, /v1/chat/completions is off", tok_config);
  }
  choose_output_parsers(o, tmpl.get(), &ao);
  if (tmpl)
    log_info("chat output: tool-call parser {}, reasoning parser {}",
             ao.tool_call_parser == server::ToolCallParser::kHermes ? "hermes" : "none",
             ao.reasoning_parser == server::ReasoningParser::kQwen3 ? "qwen3" : "none");
  server::ApiServer api(&engine, &tok, chat, ao);

  server::HttpServerOptions ho;
  ho.host = o.host;
  ho.port = o.port;
  ho.limits.max_body_bytes = o.max_body_bytes;
  ho.max_connections = o.max_connections;
  ho.error_body = &server::ApiServer::error_body;
  server::HttpServer http(ho, [&api](const server::HttpRequest& req, server::HttpResponse& res) { api.handle(req, res); });
  MOEBIUS_TRY(http.listen());
  std::fprintf(stderr, "moebius serve: listening on http://%s:%d (model '%s')\n", o.host.c_str(), http.port(),
               ao.served_model_name.c_str());
  std::fflush(stderr);

  listening = &http;
  // serve() returns after stop(), once connections drained or io_timeout_s passed; engine.stop()
  // then fails the requests still generating, and `http`, declared after `api` and `engine`, is
  // destroyed first: its destructor waits for those connections to end ([TAG_HTTP_SERVER_LIFETIME]).
  http.serve();
  engine.stop();
  waiter.join();
  // A failed runner (--ep: its ranks out of step) ends the process with an error, so the launcher
  // or mpirun also ends follower ranks that may still wait inside a collective.
  if (!engine.alive()) return Error("the model runner failed while serving (the reason is in the log above)");
  return Ok{};
}

}  // namespace

void register_serve(CLI::App& app) {
  auto o = std::make_shared<ServeOptions>();
  CLI::App* cmd = app.add_subcommand("serve", "serve the OpenAI API (chat and completions) with continuous batching");
  cmd->add_option("--model", o->runner.source.model_dir, "model directory (config.json, *.safetensors)");
  cmd->add_option("--geometry", o->runner.source.geometry,
                  "instead of --model: qwen3-30b-a3b or qwen3-235b-a22b with --load-format dummy (needs --tokenizer)");
  cmd->add_option("--tokenizer", o->tokenizer_dir, "directory of tokenizer.json and tokenizer_config.json (default: --model)");
  cmd->add_option("--host", o->host, "address to bind (0.0.0.0 exposes the server)")->capture_default_str();
  cmd->add_option("--port", o->port, "port; 0 picks a free one")->capture_default_str();
  cmd->add_option("--api-key", o->api_key, "require 'Authorization: Bearer KEY' on /v1/*");
  cmd->add_option("--served-model-name", o->served_model_name, "the model's name in the API (default: DIR's name)");
  cmd->add_option("--backend", o->runner.backend, "cpu or cuda")->capture_default_str();
  add_offload_options(cmd, &o->runner.gpu_memory_budget, &o->runner.placement_file, &o->runner.expert_cache,
                      &o->runner.expert_prefetch, &o->runner.expert_dma);
  add_ep_option(cmd, &o->runner.ep);
  cmd->add_option("--experts", o->runner.experts, "re-quantize experts: bf16, nvfp4, int4, int2 (default: as stored)");
  cmd->add_option("--load-format", o->runner.source.load_format, "auto, or dummy (cuda: random weights)")
      ->capture_default_str();
  cmd->add_option("--max-context", o->runner.max_context,
                  "tokens per sequence, at most the model's positions (max_position_embeddings, stretched by rope "
                  "scaling); default: max_position_embeddings (cuda: at most 8192)");
  cmd->add_option("--max-running", o->runner.max_seqs,
                  "sequences per step (cpu --ep N: per rank, the server runs N times as many)")
      ->capture_default_str();
  cmd->add_option("--max-step-tokens", o->runner.max_step_tokens, "tokens per step (the prefill chunk)")
      ->capture_default_str();
  cmd->add_option("--kv-blocks", o->runner.num_blocks, "KV blocks in the pool (default: max-running full contexts)");
  cmd->add_option("--prompt-logprob-rows", o->runner.prompt_logprob_rows,
                  "cuda: logits rows a step may compute for prompt logprobs (echo with logprobs, prompt_logprobs), "
                  "beyond one per sequence; each holds a vocab-sized fp32 row on the GPU; 0 refuses such requests "
                  "(default 128). cpu: no effect (a prompt chunk's rows are computed as its tokens)");
  cmd->add_option("--block-size", o->runner.block_size, "tokens per KV block")->capture_default_str();
  cmd->add_option("--max-queue", o->max_queue, "waiting requests before answering 429")->capture_default_str();
  cmd->add_option("--max-body-bytes", o->max_body_bytes, "largest request body (413 past it)")->capture_default_str();
  cmd->add_option("--max-connections", o->max_connections, "open connections (503 past it)")->capture_default_str();
  cmd->add_flag("--no-autotune", o->no_autotune,
                "cuda: run the MoE kernels' heuristic configurations; no tuning, no tuning cache");
  cmd->add_option("--tool-call-parser", o->tool_call_parser,
                  "auto (hermes when the chat template writes <tool_call>, else none), hermes or none: turn "
                  "<tool_call> blocks into tool_calls when a request has tools")
      ->capture_default_str();
  cmd->add_option("--reasoning-parser", o->reasoning_parser,
                  "auto (qwen3 when the chat template writes <think>, else none), qwen3 or none: return "
                  "<think>...</think> as reasoning_content")
      ->capture_default_str();
  cmd->add_flag("--enable-auto-tool-choice", o->enable_auto_tool_choice,
                "accepted for vLLM command lines; tool_choice \"auto\" is on whenever a tool-call parser is");
  cmd->add_flag("--no-prefix-caching", o->no_prefix_caching,
                "compute every prompt token; by default whole KV blocks of a prompt prefix another request "
                "computed are reused");
  cmd->final_callback([o] {
    Status s = run(*o);
    if (!s.ok()) {
      std::fprintf(stderr, "moebius serve: error: %s\n", s.error().what().c_str());
      throw CLI::RuntimeError(2);
    }
  });
}

}  // namespace moebius::cli
