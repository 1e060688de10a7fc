// The OpenAI-compatible routes over the engine: what each HTTP request becomes.
//
//   POST /v1/chat/completions   messages (+ tools) -> chat template -> tokens -> engine -> output
//                               parsers (reasoning_content, tool_calls) -> SSE or whole
//   POST /v1/completions        prompt text or ids -> engine (SSE or whole)
//   GET  /v1/models             the served model
//   GET  /health                200 while the engine runs
//   GET  /metrics               Prometheus text (engine gauges, counters, TTFT/ITL histograms)
//   POST /update_weights_from_disk  {"model_path": DIR}: reload the weights in place (SGLang's
//                               route; Engine::update_weights). 200 {"success": true, "message",
//                               "num_paused_requests"}; a refused checkpoint is a 400 naming the
//                               problem ({"success": false, "message", "error": {...}}), and the
//                               old weights keep serving.
// With an API key, /v1/* and /update_weights_from_disk need "Authorization: Bearer KEY" (401
// otherwise); /health and /metrics stay open for probes and scrapers, as in vLLM.
//
// A handler thread waits on its request's RequestStream in short slices and checks the socket in
// between: when the client is gone the request is cancelled, and the engine frees its KV at its
// next iteration.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/sampler.h"
#include "server/chat_output_parser.h"
#include "server/engine.h"
#include "server/http_server.h"
#include "server/openai_api.h"
#include "tokenizer/bpe_tokenizer.h"

namespace moebius::server {

// Renders chat messages and tool definitions (null: none) to prompt text (the model's chat
// template); an Error is the client's fault (e.g. the template raised on its messages).
using ChatRenderer = std::function<Result<std::string>(
    const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools, std::optional<bool> enable_thinking)>;

// What the chat output is parsed for (vLLM's --tool-call-parser and --reasoning-parser; the
// formats are in server/chat_output_parser.h).
enum class ToolCallParser { kNone, kHermes };
enum class ReasoningParser { kNone, kQwen3 };

struct SamplingDefaults {  // generation_config.json's, applied where a request sets nothing
  float temperature = 1.0f;
  int top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  float repetition_penalty = 1.0f;
};

struct ApiServerOptions {
  std::string served_model_name;  // listed by /v1/models
  std::vector<std::string> model_aliases;  // also accepted as "model" (e.g. the --model path)
  std::string api_key;            // empty: no authentication
  size_t max_body_bytes = 4u << 20;
  SamplingDefaults sampling;
  // kNone: a chat request with tools and tool_choice "auto" is a 400 (nothing would turn the
  // model's calls into tool_calls); "none" is still served.
  ToolCallParser tool_call_parser = ToolCallParser::kNone;
  ReasoningParser reasoning_parser = ReasoningParser::kNone;
};

class ApiServer {
 public:
  // `engine` and `tokenizer` must outlive the server; `chat` may be empty (no chat template:
  // /v1/chat/completions answers 400).
  ApiServer(Engine* engine, const tokenizer::BpeTokenizer* tokenizer, ChatRenderer chat, ApiServerOptions options);

  void handle(const HttpRequest& request, HttpResponse& response);
  // The body of an error the HTTP layer answers by itself, in OpenAI's shape.
  static std::string error_body(int status, const std::string& message);

 private:
  void generate(Endpoint endpoint, const HttpRequest& request, HttpResponse& response);
  void update_weights(const HttpRequest& request, HttpResponse& response);
  // A request's n choices: their engine streams (choice i is streams[i]), and the listener they
  // all notify, on which the handler waits.
  struct Choices {
    std::vector<std::shared_ptr<RequestStream>> streams;
    std::shared_ptr<StreamListener> listener;
    Choices() = default;
    Choices(const Choices&) = delete;
    Choices& operator=(const Choices&) = delete;
    // Every way out of a handler (an exception too) frees the KV of unfinished choices; a finished
    // stream's cancel is a no-op for the engine.
    ~Choices() { cancel(); }
    void cancel() const;
    // Takes what any unfinished choice produced into updates[i] (finished[i] marks those done);
    // waits up to one poll slice when none had anything. Returns the choices that gave output.
    std::vector<int> take(std::vector<RequestUpdate>& updates, const std::vector<bool>& finished) const;
  };
  // `prompts`: each prompt's ids; choice i answers prompts[i / req.n].
  void stream(Endpoint endpoint, const GenerationRequest& req, const std::vector<std::vector<int32_t>>& prompts,
              const std::optional<ChatOutputOptions>& parse, const Choices& choices, HttpResponse& response);
  void whole(Endpoint endpoint, const GenerationRequest& req, const std::vector<std::vector<int32_t>>& prompts,
             const std::optional<ChatOutputOptions>& parse, const Choices& choices, HttpResponse& response);
  // Prompt `index`'s token ids (chat: the rendered messages); *prompt_opens_think: a chat prompt
  // that ends inside <think>.
  void tokenize_route(const HttpRequest& req, HttpResponse& res);    // POST /tokenize
  void detokenize_route(const HttpRequest& req, HttpResponse& res);  // POST /detokenize
  std::optional<ApiError> tokenize(const GenerationRequest& req, size_t index, std::vector<int32_t>* ids,
                                   bool* prompt_opens_think) const;
  // How a chat response is parsed (nullopt: its text is all content, as for completions).
  std::optional<ChatOutputOptions> output_parsing(const GenerationRequest& req, bool prompt_opens_think) const;
  EngineRequest engine_request(const GenerationRequest& req, std::vector<int32_t> ids) const;
  // Each entry with at most max_top alternatives.
  std::vector<TokenLogprob> logprobs_text(const std::vector<GeneratedToken>& tokens,
                                          size_t max_top = SIZE_MAX) const;
  // What an answer puts before its first generated token: completions' echo (the prompt's text and,
  // with logprobs, its tokens' logprobs, the first null) and vLLM's prompt_logprobs. `computed`:
  // the engine's prompt logprobs (tokens 1..P-1), when it was asked for them.
  void add_prompt_parts(const GenerationRequest& req, const std::vector<int32_t>& prompt,
                        const std::vector<GeneratedToken>& computed, ChoiceDelta* out) const;
  // The first prompt token gets null; each other gets its logprob, rank and at most max_top alternatives.
  PromptLogprobs prompt_logprobs_out(const std::vector<int32_t>& prompt, const std::vector<GeneratedToken>& computed,
                                     size_t max_top) const;
  std::string token_text(int32_t id) const;
  ResponseMeta meta(Endpoint endpoint);

  Engine* engine_;
  const tokenizer::BpeTokenizer* tokenizer_;
  ChatRenderer chat_;
  ApiServerOptions options_;
  ApiLimits limits_;
  int64_t created_ = 0;
  std::atomic<uint64_t> next_id_{0};
};

}  // namespace moebius::server
