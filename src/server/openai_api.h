// The OpenAI HTTP API's JSON: requests of /v1/chat/completions and /v1/completions parsed and
// validated into a plain struct, errors in OpenAI's shape, and the response bodies (whole and SSE
// chunks). No model, tokenizer or socket here, so every error case is unit-tested and the parser
// is fuzzed (fuzz/fuzz_openai_request.cpp) on its own.
//
// Tools (chat): `tools` is validated (shapes, at most ApiLimits::max_tools definitions and
// max_tools_bytes of JSON) and kept as sent, for the chat template's `tools` variable, as
// transformers' apply_chat_template takes them. `tool_choice` "auto" (the default with tools)
// and "none" are supported; "none" still renders the tools, as vLLM does by default, and only
// turns off the parsing of calls. "required" and a named function need guided decoding and are
// refused with a 400, as are the deprecated `functions` and `function_call`. An assistant message's
// `tool_calls[].function.arguments` arrives as a JSON string (OpenAI's type) and is parsed into
// an object here, as vLLM does, so the template prints it the way the model was trained on
// (`tojson`); the prompt is then the same whether a client echoes the arguments compactly or not.
//
// Errors are {"error": {"message", "type", "param", "code"}} with the HTTP status OpenAI uses:
// 400 invalid_request_error (malformed JSON, wrong types, out-of-range values, invalid UTF-8,
// a prompt plus max_tokens past the context), 401 (missing or wrong API key), 404 (unknown model
// or route), 413 (body too large), 429 (queue full), 503 (engine down).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace moebius::server {

struct ApiError {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // "" -> null
  std::string code;   // "" -> null

  std::string to_json() const;
};

ApiError invalid_request(std::string message, std::string param = "", std::string code = "");
ApiError unauthorized();  // 401 invalid_api_key
ApiError model_not_found(const std::string& model);
ApiError body_too_large(size_t bytes, size_t limit);
ApiError queue_full(size_t depth);
ApiError not_found(const std::string& path);
ApiError method_not_allowed(const std::string& method, const std::string& path);
ApiError server_error(std::string message, int status = 500);
// 400 context_length_exceeded, worded like vLLM's (clients match on it). Its param names what to
// shorten: max_tokens when the prompt alone fits, else prompt_param (chat: "messages",
// completions: "prompt").
ApiError context_exceeded(int64_t prompt_tokens, int64_t max_tokens, int64_t context, const std::string& prompt_param);

enum class Endpoint { kChat, kCompletion };

// vLLM accepts any positive repetition_penalty; past 10 a seen token's logit is crushed to about
// nothing, so a larger value is surely a mistake (e.g. a percentage).
inline constexpr double kMaxRepetitionPenalty = 10.0;

struct ApiLimits {
  size_t max_body_bytes = 4u << 20;
  std::vector<std::string> model_names;  // accepted values of "model"
  int max_stop = 16;                     // stop strings per request
  size_t max_stop_bytes = 256;           // per stop string: it bounds the streaming holdback
  int max_top_logprobs = 20;             // chat's top_logprobs (completions: logprobs <= 5)
  int max_json_depth = 64;               // nesting of arrays/objects in the body
  // Values in the body (json_value_bound, [TAG_JSON_VALUES]), and in a tool call's arguments
  // string: bounds the parsed document to ~26 MB however the 4 MiB are spent. 2^18 holds a
  // 128k-token prompt given as token ids, twice over.
  int64_t max_json_values = int64_t{1} << 18;
  int max_tools = 128;                   // tool definitions per request (OpenAI's limit)
  size_t max_tools_bytes = 256u << 10;   // their JSON, all together (they go into the prompt)
  int max_choices = 128;                 // n: each choice is a sequence of its own (OpenAI's limit)
  int max_stop_token_ids = 64;           // vLLM's stop_token_ids
};

// Chat's tool_choice. "required" and named functions are refused by the parser (no guided
// decoding), so only these two remain.
enum class ToolChoice {
  kNone,  // the tools are rendered; the output is not parsed for calls
  kAuto,  // the model decides; its calls are parsed (server flag --tool-call-parser)
};

struct GenerationRequest {
  Endpoint endpoint = Endpoint::kCompletion;
  std::string model;
  // Chat: the messages array, each content normalized to a string (text parts joined). Ordered:
  // a template's `tojson` prints keys in the request's order, as Python does.
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  std::optional<bool> enable_thinking;  // chat_template_kwargs.enable_thinking (vLLM/SGLang)
  // Chat: the validated `tools` array as sent (null when absent, null or empty), the template's
  // `tools`; tool_choice defaults to kAuto with tools, kNone without.
  nlohmann::ordered_json tools = nullptr;
  ToolChoice tool_choice = ToolChoice::kNone;
  bool parallel_tool_calls = true;  // false: at most one call is returned
  // Completions: the prompts, each as text or as token ids. One, or a batch (OpenAI's array of
  // strings or of token arrays, at most ApiLimits::max_choices choices in all): choice p * n + j is
  // the j-th sample of prompt p, and usage counts every prompt once.
  struct Prompt {
    std::string text;
    std::vector<int32_t> ids;
    bool is_ids = false;
  };
  std::vector<Prompt> prompts;
  std::optional<int64_t> max_tokens;  // max_tokens or max_completion_tokens; unset: up to the context
  std::vector<std::string> stop;
  // vLLM's extensions: generation also stops at these ids (like eos: the id is not returned), and
  // neither eos, these ids nor the stop strings end it before min_tokens tokens (a stop string
  // completing after them ends it even when it began inside them).
  std::vector<int32_t> stop_token_ids;
  int64_t min_tokens = 0;
  bool include_stop_str = false;  // vLLM's include_stop_str_in_output: the stop string ends the text
  std::optional<float> temperature;
  std::optional<float> top_p;
  std::optional<int> top_k;  // -1 (vLLM's "off") becomes 0
  std::optional<float> min_p;
  std::optional<uint64_t> seed;
  // OpenAI's penalties, in [-2, 2], and vLLM's repetition_penalty (> 0, at most
  // kMaxRepetitionPenalty); model::SamplerParams says how each acts.
  std::optional<float> presence_penalty;
  std::optional<float> frequency_penalty;
  std::optional<float> repetition_penalty;
  // logit_bias: {"<token id>": bias in [-100, 100]}, ascending ids. Ids are checked against the
  // vocabulary by the engine (the parser does not know it).
  std::vector<std::pair<int32_t, float>> logit_bias;
  // -1: no logprobs; k >= 0: the chosen token's logprob plus the k most likely alternatives.
  int top_logprobs = -1;
  // Completions' echo: the text (and, with logprobs, the logprobs arrays) start with the prompt;
  // its first token's logprob is null (lm-evaluation-harness scores continuations this way).
  bool echo = false;
  // vLLM's prompt_logprobs: -1 none; k >= 0: per prompt token (null for the first) its logprob and
  // rank plus the k most likely ids, as {"<id>": {"logprob", "rank", "decoded_token"}}.
  // Completions: in each choice; chat: at the response's top level (not in chat streams).
  int prompt_logprobs = -1;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  bool ignore_eos = false;     // vLLM extension: generate max_tokens even past eos (benchmarks)
  // n: choices sampled for the one prompt, each its own sequence; with a seed, choice i samples
  // with seed + i (vLLM's rule), so choices differ and a request replays.
  int n = 1;
};

// Parses and validates a request body. On success fills *out and returns nullopt.
std::optional<ApiError> parse_request(Endpoint endpoint, std::string_view body, const ApiLimits& limits,
                                      GenerationRequest* out);

// POST /update_weights_from_disk, SGLang's native weight-update route: {"model_path": DIR}, plus
// an optional "load_format" that may only be null or "auto" (this server reads safetensors
// checkpoints). SGLang's other fields (flush_cache, abort_all_requests, ...) are ignored.
struct UpdateWeightsRequest {
  std::string model_path;
};
std::optional<ApiError> parse_update_weights_request(std::string_view body, const ApiLimits& limits,
                                                     UpdateWeightsRequest* out);
// Success: SGLang's {"success": true, "message": ..., "num_paused_requests": n}.
std::string update_weights_response(const std::string& message, int64_t num_paused_requests);
// Failure: SGLang's {"success": false, "message": ...} and OpenAI's "error" object in one body, so
// both kinds of client read it; the HTTP status is the error's.
std::string update_weights_error(const ApiError& error);

// ---------------------------------------------------------------------------------------------
// Responses
// ---------------------------------------------------------------------------------------------

struct Usage {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  // Prompt tokens whose KV the prefix cache held: OpenAI's usage.prompt_tokens_details.
  int64_t cached_tokens = 0;
};

// One sampled token's logprob and its top alternatives (already decoded to text).
struct TokenLogprob {
  std::string token;  // the token's bytes, possibly part of a UTF-8 character
  float logprob = 0.0f;
  std::vector<std::pair<std::string, float>> top;
  bool has_logprob = true;  // false: an echoed prompt's first token (logprob and top are null)
};

// One id of a prompt position's vLLM prompt_logprobs entry.
struct PromptLogprob {
  int32_t id = 0;
  float logprob = 0.0f;
  int64_t rank = 0;
  std::string decoded;  // the token's bytes
};
// Per prompt token: null for the first, else the token itself and the k most likely ids.
using PromptLogprobs = std::vector<std::optional<std::vector<PromptLogprob>>>;

// A tool call the model made, as a chat response reports it.
struct ToolCallOut {
  int index = 0;          // its position in the choice's calls (streams: deltas name it)
  std::string id;         // "call_..."
  std::string name;
  std::string arguments;  // a JSON object, serialized (OpenAI's type)
};

// What one response (or one SSE chunk) carries.
struct ChoiceDelta {
  std::string text;  // chat: `content`
  std::vector<TokenLogprob> logprobs;
  bool want_logprobs = false;        // emit "logprobs" (else null)
  std::optional<std::string> finish_reason;  // "stop", "length", "tool_calls"
  // Chat with the output parsers (server/chat_output_parser.h):
  std::string reasoning;            // `reasoning_content`
  bool reasoning_field = false;     // whole responses: emit reasoning_content (null when empty)
  std::vector<ToolCallOut> tool_calls;
  // Whole responses: an empty content is null (OpenAI's message of only calls, vLLM's message of
  // only reasoning); otherwise content is always a string.
  bool null_empty_content = false;
  int index = 0;  // the choice (n > 1)
  // Completion streams: bytes of this choice's tokens sent before this chunk, where its logprobs'
  // text_offset continues.
  size_t text_offset = 0;
  // Completions' prompt_logprobs (emitted only when want_prompt_logprobs: whole responses, and a
  // stream's first chunk of the choice).
  bool want_prompt_logprobs = false;
  PromptLogprobs prompt_logprobs;
};

struct ResponseMeta {
  std::string id;  // "chatcmpl-..." / "cmpl-..."
  std::string model;
  int64_t created = 0;  // unix seconds
};

// Whole (non-streaming) response bodies. Chat's prompt_logprobs (vLLM: top level) is emitted when
// given.
std::string chat_response(const ResponseMeta& meta, std::span<const ChoiceDelta> choices, const Usage& usage,
                          const PromptLogprobs* prompt_logprobs = nullptr);
std::string completion_response(const ResponseMeta& meta, std::span<const ChoiceDelta> choices, const Usage& usage);
inline std::string chat_response(const ResponseMeta& meta, const ChoiceDelta& choice, const Usage& usage) {
  return chat_response(meta, std::span<const ChoiceDelta>(&choice, 1), usage);
}
inline std::string completion_response(const ResponseMeta& meta, const ChoiceDelta& choice, const Usage& usage) {
  return completion_response(meta, std::span<const ChoiceDelta>(&choice, 1), usage);
}

// One SSE event ("data: {...}\n\n"). Chat: `first` adds the assistant role to the delta.
// include_usage: every chunk carries "usage": null, as OpenAI sends it.
std::string chat_chunk(const ResponseMeta& meta, const ChoiceDelta& delta, bool first, bool include_usage);
std::string completion_chunk(const ResponseMeta& meta, const ChoiceDelta& delta, bool include_usage);
// The final usage chunk (empty choices) of a stream with include_usage.
std::string usage_chunk(const ResponseMeta& meta, Endpoint endpoint, const Usage& usage);
// An error inside a started stream, then [DONE] is still sent by the caller.
std::string error_chunk(const ApiError& error);
inline constexpr std::string_view kSseDone = "data: [DONE]\n\n";

// POST /tokenize and /detokenize (vLLM's routes, outside /v1): what a prompt or a chat costs in
// tokens before it is sent. "model" is optional (checked when given). /tokenize takes either
// "prompt" (a string, or token ids: returned as they are) or "messages" with the chat fields
// "tools" and "chat_template_kwargs", refused as chat completions refuse it (e.g.
// "add_generation_prompt" false: the template always renders the assistant turn's start);
// "add_special_tokens" is accepted (Qwen's tokenizer adds none). /detokenize takes "tokens", ids in [0, vocab); the text keeps special
// tokens, with ill-formed UTF-8 replaced by U+FFFD.
std::optional<ApiError> parse_tokenize_request(std::string_view body, const ApiLimits& limits, GenerationRequest* out);
struct DetokenizeRequest {
  std::vector<int32_t> tokens;
};
std::optional<ApiError> parse_detokenize_request(std::string_view body, const ApiLimits& limits,
                                                 DetokenizeRequest* out);
// {"count", "max_model_len", "tokens", "token_strs": null} and {"prompt"}.
std::string tokenize_response(const std::vector<int32_t>& ids, int64_t max_model_len);
std::string detokenize_response(const std::string& text);

// /v1/models.
std::string models_response(const std::vector<std::string>& names, int64_t created, int64_t max_model_len);

}  // namespace moebius::server
