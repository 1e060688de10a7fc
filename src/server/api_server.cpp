#include "server/api_server.h"

#include <algorithm>
#include <chrono>
#include <ctime>
#include <random>

#include <fmt/format.h>

#include "core/log.h"

namespace moebius::server {
namespace {

using namespace std::chrono_literals;
constexpr auto kPollSlice = 20ms;  // how often a waiting handler checks its client's socket

void send_error(HttpResponse& res, const ApiError& e) { res.send(e.status, "application/json", e.to_json()); }

const std::vector<std::string> kSseHeaders = {"Cache-Control: no-cache", "X-Accel-Buffering: no"};

// OpenAI's form: "call_" and 24 letters and digits.
std::string new_call_id() {
  static constexpr std::string_view kChars = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  std::string id = "call_";
  for (int i = 0; i < 24; ++i) id += kChars[rng() % kChars.size()];
  return id;
}

// Adds what the output parser released to a response or chunk. The calls get their ids and
// indices here (the parser knows neither); with parallel_tool_calls false only the first call is
// kept, as vLLM does. *calls counts the calls of the whole response so far.
void add_parsed(ChatOutputDelta&& parsed, const GenerationRequest& req, int* calls, ChoiceDelta* d) {
  d->text += parsed.content;
  d->reasoning += parsed.reasoning;
  for (ParsedToolCall& c : parsed.tool_calls) {
    if (!req.parallel_tool_calls && *calls >= 1) continue;
    d->tool_calls.push_back(ToolCallOut{(*calls)++, new_call_id(), std::move(c.name), std::move(c.arguments)});
  }
}

}  // namespace

ApiServer::ApiServer(Engine* engine, const tokenizer::BpeTokenizer* tokenizer, ChatRenderer chat,
                     ApiServerOptions options)
    : engine_(engine), tokenizer_(tokenizer), chat_(std::move(chat)), options_(std::move(options)) {
  limits_.max_body_bytes = options_.max_body_bytes;
  limits_.model_names = options_.model_aliases;
  limits_.model_names.push_back(options_.served_model_name);
  created_ = static_cast<int64_t>(std::time(nullptr));
}

std::string ApiServer::error_body(int status, const std::string& message) {
  ApiError e;
  e.status = status;
  e.message = message;
  if (status >= 500) e.type = "server_error";
  return e.to_json();
}

void ApiServer::handle(const HttpRequest& req, HttpResponse& res) {
  const std::string& p = req.path;
  const bool guarded = p.rfind("/v1/", 0) == 0 || p == "/update_weights_from_disk";
  if (guarded && !options_.api_key.empty()) {
    const std::string* auth = req.header("authorization");
    if (auth == nullptr || *auth != "Bearer " + options_.api_key) {
      if (p == "/update_weights_from_disk")
        return res.send(401, "application/json", update_weights_error(unauthorized()));
      return send_error(res, unauthorized());
    }
  }
  const auto route = [&](const char* path, const char* method) {
    if (p != path) return false;
    if (req.method != method) {
      send_error(res, method_not_allowed(req.method, p));
      return false;
    }
    return true;
  };
  if (p == "/health") {
    if (req.method != "GET") return send_error(res, method_not_allowed(req.method, p));
    if (!engine_->alive()) return send_error(res, server_error("the engine has stopped", 503));
    return res.send(200, "application/json", "{\"status\":\"ok\"}");
  }
  if (p == "/metrics") {
    if (req.method != "GET") return send_error(res, method_not_allowed(req.method, p));
    return res.send(200, "text/plain; version=0.0.4; charset=utf-8", engine_->metrics().render());
  }
  if (p == "/v1/models") {
    if (route("/v1/models", "GET"))
      res.send(200, "application/json", models_response({options_.served_model_name}, created_, engine_->max_context()));
    return;
  }
  if (p == "/v1/chat/completions") {
    if (route("/v1/chat/completions", "POST")) generate(Endpoint::kChat, req, res);
    return;
  }
  if (p == "/v1/completions") {
    if (route("/v1/completions", "POST")) generate(Endpoint::kCompletion, req, res);
    return;
  }
  if (p == "/update_weights_from_disk") {
    if (route("/update_weights_from_disk", "POST")) update_weights(req, res);
    return;
  }
  // vLLM's tokenizer routes (outside /v1, so --api-key does not guard them, as in vLLM).
  if (p == "/tokenize") {
    if (route("/tokenize", "POST")) tokenize_route(req, res);
    return;
  }
  if (p == "/detokenize") {
    if (route("/detokenize", "POST")) detokenize_route(req, res);
    return;
  }
  send_error(res, not_found(p));
}

void ApiServer::tokenize_route(const HttpRequest& http, HttpResponse& res) {
  GenerationRequest req;
  if (auto e = parse_tokenize_request(http.body, limits_, &req)) return send_error(res, *e);
  std::vector<int32_t> ids;
  bool opens_think = false;
  if (auto e = tokenize(req, 0, &ids, &opens_think)) return send_error(res, *e);
  res.send(200, "application/json", tokenize_response(ids, engine_->max_context()));
}

void ApiServer::detokenize_route(const HttpRequest& http, HttpResponse& res) {
  DetokenizeRequest req;
  if (auto e = parse_detokenize_request(http.body, limits_, &req)) return send_error(res, *e);
  std::vector<tokenizer::TokenId> ids;
  for (int32_t id : req.tokens) {
    if (id >= engine_->vocab_size())
      return send_error(res, invalid_request(fmt::format("token id {} is outside the vocabulary [0, {})", id,
                                                         engine_->vocab_size()),
                                             "tokens"));
    ids.push_back(static_cast<tokenizer::TokenId>(id));
  }
  res.send(200, "application/json", detokenize_response(tokenizer_->decode_text(ids)));
}

void ApiServer::update_weights(const HttpRequest& http, HttpResponse& res) {
  const auto fail = [&res](const ApiError& e) { res.send(e.status, "application/json", update_weights_error(e)); };
  UpdateWeightsRequest req;
  if (auto e = parse_update_weights_request(http.body, limits_, &req)) return fail(*e);
  log_info("weight update from '{}' requested", req.model_path);
  const WeightUpdate u = engine_->update_weights(req.model_path);
  switch (u.outcome) {
    case WeightUpdate::Outcome::kUpdated:
      return res.send(200, "application/json", update_weights_response(u.message, u.paused_requests));
    case WeightUpdate::Outcome::kRefused:
      return fail(invalid_request(fmt::format("The weights were not updated ({}); the old weights keep serving.",
                                              u.message),
                                  "model_path", "invalid_checkpoint"));
    case WeightUpdate::Outcome::kStopped:
      return fail(server_error(u.message, 503));
  }
}

std::optional<ApiError> ApiServer::tokenize(const GenerationRequest& r, size_t index, std::vector<int32_t>* ids,
                                            bool* prompt_opens_think) const {
  std::string text;
  *prompt_opens_think = false;
  if (r.endpoint == Endpoint::kChat) {
    if (!chat_) return invalid_request("This model has no chat template (tokenizer_config.json's chat_template); use "
                                       "/v1/completions.");
    Result<std::string> rendered = chat_(r.messages, r.tools, r.enable_thinking);
    if (!rendered.ok()) return invalid_request("The chat template failed on these messages: " +
                                               rendered.error().what(), "messages");
    text = std::move(rendered).value();
    *prompt_opens_think = ChatOutputParser::prompt_ends_in_think(text);
  } else if (r.prompts.at(index).is_ids) {
    for (int32_t id : r.prompts[index].ids)
      if (id >= engine_->vocab_size())
        return invalid_request(fmt::format("token id {} is outside the vocabulary [0, {})", id, engine_->vocab_size()),
                               "prompt");
    *ids = r.prompts[index].ids;
    return std::nullopt;
  } else {
    text = r.prompts[index].text;
  }
  for (tokenizer::TokenId id : tokenizer_->encode(text)) ids->push_back(static_cast<int32_t>(id));
  if (ids->empty()) return invalid_request("The prompt encodes to no tokens.", "prompt");
  return std::nullopt;
}

void ApiServer::Choices::cancel() const {
  for (const auto& s : streams) s->cancel();
}

std::vector<int> ApiServer::Choices::take(std::vector<RequestUpdate>& updates, const std::vector<bool>& finished) const {
  std::vector<int> got;
  // Read the count before draining: a publish after this read changes it, so the wait below
  // cannot sleep through output that arrived while the streams were being drained.
  const uint64_t seen = listener->events();
  for (size_t i = 0; i < streams.size(); ++i)
    if (!finished[i] && streams[i]->take(&updates[i], std::chrono::milliseconds(0))) got.push_back(static_cast<int>(i));
  if (got.empty()) listener->wait_for_change(seen, kPollSlice);
  return got;
}

EngineRequest ApiServer::engine_request(const GenerationRequest& r, std::vector<int32_t> ids) const {
  EngineRequest e;
  const int64_t prompt = static_cast<int64_t>(ids.size());
  e.prompt = std::move(ids);
  e.max_tokens = r.max_tokens ? *r.max_tokens : engine_->max_context() - prompt;
  e.sampling.temperature = r.temperature.value_or(options_.sampling.temperature);
  e.sampling.top_k = r.top_k.value_or(options_.sampling.top_k);
  e.sampling.top_p = r.top_p.value_or(options_.sampling.top_p);
  e.sampling.min_p = r.min_p.value_or(options_.sampling.min_p);
  e.sampling.repetition_penalty = r.repetition_penalty.value_or(options_.sampling.repetition_penalty);
  e.sampling.presence_penalty = r.presence_penalty.value_or(0.0f);
  e.sampling.frequency_penalty = r.frequency_penalty.value_or(0.0f);
  e.sampling.logit_bias = r.logit_bias;
  if (r.seed) {
    e.sampling.seed = *r.seed;
  } else {
    static thread_local std::mt19937_64 rng{std::random_device{}()};
    e.sampling.seed = rng();
  }
  e.stop = r.stop;
  e.stop_token_ids = r.stop_token_ids;
  e.min_tokens = r.min_tokens;
  e.include_stop_str = r.include_stop_str;
  e.top_logprobs = r.top_logprobs;
  // echo with logprobs scores the prompt's tokens too, with as many alternatives as the rest.
  e.prompt_logprobs = std::max(r.prompt_logprobs, r.echo && r.top_logprobs >= 0 ? r.top_logprobs : -1);
  e.ignore_eos = r.ignore_eos;
  return e;
}

std::string ApiServer::token_text(int32_t id) const {
  return std::string(tokenizer_->token_bytes(static_cast<tokenizer::TokenId>(id)));
}

namespace {
// How many of an entry's top alternatives a request asked for: the engine computes the largest k
// any part of the request wants, and each part shows its own.
size_t top_shown(const GeneratedToken& t, size_t max_top) { return std::min(t.top.size(), max_top); }
}  // namespace

std::vector<TokenLogprob> ApiServer::logprobs_text(const std::vector<GeneratedToken>& tokens, size_t max_top) const {
  std::vector<TokenLogprob> out;
  for (const GeneratedToken& t : tokens) {
    TokenLogprob lp{token_text(t.id), t.logprob, {}};
    for (size_t r = 0; r < top_shown(t, max_top); ++r) lp.top.emplace_back(token_text(t.top[r].first), t.top[r].second);
    out.push_back(std::move(lp));
  }
  return out;
}

PromptLogprobs ApiServer::prompt_logprobs_out(const std::vector<int32_t>& prompt,
                                              const std::vector<GeneratedToken>& computed, size_t max_top) const {
  PromptLogprobs out;
  out.emplace_back(std::nullopt);  // the first token has no context
  for (size_t i = 0; i < computed.size() && i + 1 < prompt.size(); ++i) {
    const GeneratedToken& t = computed[i];
    std::vector<PromptLogprob> ids{{t.id, t.logprob, t.rank, token_text(t.id)}};
    for (size_t r = 0; r < top_shown(t, max_top); ++r)
      if (t.top[r].first != t.id)
        ids.push_back({t.top[r].first, t.top[r].second, static_cast<int64_t>(r + 1), token_text(t.top[r].first)});
    out.emplace_back(std::move(ids));
  }
  return out;
}

void ApiServer::add_prompt_parts(const GenerationRequest& req, const std::vector<int32_t>& prompt,
                                 const std::vector<GeneratedToken>& computed, ChoiceDelta* d) const {
  if (req.echo) {
    std::string text;
    for (int32_t id : prompt) text += token_text(id);
    d->text = text + d->text;
    if (req.top_logprobs >= 0) {
      std::vector<TokenLogprob> lps;
      TokenLogprob first{token_text(prompt[0]), 0.0f, {}};
      first.has_logprob = false;
      lps.push_back(std::move(first));
      for (TokenLogprob& t : logprobs_text(computed, static_cast<size_t>(req.top_logprobs))) lps.push_back(std::move(t));
      d->logprobs.insert(d->logprobs.begin(), lps.begin(), lps.end());
    }
  }
  if (req.prompt_logprobs >= 0 && req.endpoint == Endpoint::kCompletion) {
    d->want_prompt_logprobs = true;
    d->prompt_logprobs = prompt_logprobs_out(prompt, computed, static_cast<size_t>(req.prompt_logprobs));
  }
}

std::optional<ChatOutputOptions> ApiServer::output_parsing(const GenerationRequest& r, bool prompt_opens_think) const {
  if (r.endpoint != Endpoint::kChat) return std::nullopt;
  ChatOutputOptions o;
  o.reasoning = options_.reasoning_parser == ReasoningParser::kQwen3;
  o.prompt_opens_think = o.reasoning && prompt_opens_think;
  // Calls are parsed only when the client offered tools and let the model choose (vLLM's rule):
  // otherwise a <tool_call> the model writes is text the client asked for.
  o.tool_calls = options_.tool_call_parser == ToolCallParser::kHermes && !r.tools.is_null() &&
                 r.tool_choice == ToolChoice::kAuto;
  if (!o.reasoning && !o.tool_calls) return std::nullopt;
  return o;
}

ResponseMeta ApiServer::meta(Endpoint endpoint) {
  const uint64_t n = next_id_++;
  return ResponseMeta{fmt::format("{}-{:x}{:08x}", endpoint == Endpoint::kChat ? "chatcmpl" : "cmpl", created_, n),
                      options_.served_model_name, static_cast<int64_t>(std::time(nullptr))};
}

void ApiServer::generate(Endpoint endpoint, const HttpRequest& http, HttpResponse& res) {
  GenerationRequest req;
  if (auto e = parse_request(endpoint, http.body, limits_, &req)) return send_error(res, *e);
  if (req.tool_choice == ToolChoice::kAuto && options_.tool_call_parser == ToolCallParser::kNone)
    return send_error(res, invalid_request("tool_choice \"auto\" (the default with tools) needs a tool-call parser, and "
                                           "this server has none (--tool-call-parser none, the default when the chat "
                                           "template has no <tool_call> format). Send tool_choice \"none\" to render "
                                           "the tools without parsing calls, or start the server with "
                                           "--tool-call-parser hermes.",
                                           "tool_choice"));
  // A completions batch has several prompts; chat has one (its rendered messages).
  const size_t num_prompts = endpoint == Endpoint::kChat ? 1 : req.prompts.size();
  std::vector<std::vector<int32_t>> prompts(num_prompts);
  bool prompt_opens_think = false;
  const int64_t context = engine_->max_context();
  for (size_t p = 0; p < num_prompts; ++p) {
    if (auto e = tokenize(req, p, &prompts[p], &prompt_opens_think)) return send_error(res, *e);
    const int64_t prompt = static_cast<int64_t>(prompts[p].size());
    if (prompt >= context || (req.max_tokens && prompt + *req.max_tokens > context))
      return send_error(res, context_exceeded(prompt, req.max_tokens.value_or(0), context,
                                              endpoint == Endpoint::kChat ? "messages" : "prompt"));
  }
  const std::optional<ChatOutputOptions> parse = output_parsing(req, prompt_opens_think);
  // n > 1: n sequences of each prompt, all queued together or not at all (the prefix cache shares
  // a prompt's blocks once one of them has computed them).
  const int64_t total = static_cast<int64_t>(num_prompts) * req.n;
  if (total > engine_->max_queue())
    return send_error(res, invalid_request(fmt::format("{} choices ({} prompts x n = {}) exceed this server's queue of {} "
                                                       "requests (--max-queue)",
                                                       total, num_prompts, req.n, engine_->max_queue()),
                                           "n"));
  Choices choices;
  choices.listener = std::make_shared<StreamListener>();
  std::vector<EngineRequest> group;
  for (size_t p = 0; p < num_prompts; ++p)
    for (int i = 0; i < req.n; ++i) {
      EngineRequest e = engine_request(req, prompts[p]);
      if (req.seed) e.sampling.seed = *req.seed + static_cast<uint64_t>(i);
      e.listener = choices.listener;
      group.push_back(std::move(e));
    }
  SubmittedGroup sub = engine_->submit_group(std::move(group));
  if (sub.streams.empty()) {
    if (sub.queue_full) return send_error(res, queue_full(static_cast<size_t>(engine_->metrics().queue_depth.load())));
    if (!engine_->alive()) return send_error(res, server_error(sub.error, 503));
    // The engine names the prompt "prompt"; chat's prompt is its messages.
    const std::string param =
        endpoint == Endpoint::kChat && sub.error_param == "prompt" ? "messages" : sub.error_param;
    return send_error(res, invalid_request(sub.error, param));
  }
  choices.streams = std::move(sub.streams);
  if (req.stream) stream(endpoint, req, prompts, parse, choices, res);
  else whole(endpoint, req, prompts, parse, choices, res);
}

void ApiServer::whole(Endpoint endpoint, const GenerationRequest& req, const std::vector<std::vector<int32_t>>& prompts,
                      const std::optional<ChatOutputOptions>& parse, const Choices& choices, HttpResponse& res) {
  const size_t n = choices.streams.size();
  std::vector<RequestUpdate> u(n);
  std::vector<bool> finished(n, false);
  for (size_t done = 0; done < n;) {
    for (int gi : choices.take(u, finished)) {
      const size_t i = static_cast<size_t>(gi);
      if (!u[i].error.empty()) {
        choices.cancel();  // the others' output would go unanswered
        return send_error(res, server_error(u[i].error));
      }
      if (u[i].finished && !finished[i]) {
        finished[i] = true;
        ++done;
      }
    }
    if (done < n && res.client_gone()) {
      choices.cancel();
      res.abandon();  // nobody to answer: the connection closes without a response
      return;
    }
  }
  std::vector<ChoiceDelta> out(n);
  // Each prompt counts once, its cached part at its best over its n choices.
  Usage usage;
  const size_t per = static_cast<size_t>(req.n);
  for (size_t p = 0; p * per < n; ++p) {
    usage.prompt_tokens += u[p * per].prompt_tokens;
    int64_t cached = 0;
    for (size_t j = 0; j < per; ++j) cached = std::max(cached, u[p * per + j].cached_tokens);
    usage.cached_tokens += cached;
  }
  for (size_t i = 0; i < n; ++i) {
    ChoiceDelta& c = out[i];
    c.index = static_cast<int>(i);
    c.want_logprobs = req.top_logprobs >= 0;
    c.logprobs = logprobs_text(u[i].tokens);
    c.finish_reason = u[i].finish_reason;
    usage.completion_tokens += u[i].completion_tokens;
    if (parse) {
      ChatOutputParser parser(*parse);
      ChatOutputDelta parsed = parser.feed(u[i].text);
      parsed.append(parser.finish());
      int calls = 0;
      add_parsed(std::move(parsed), req, &calls, &c);
      c.reasoning_field = parse->reasoning;
      c.null_empty_content = !c.tool_calls.empty() || !c.reasoning.empty();
      if (calls > 0) c.finish_reason = "tool_calls";  // even after a length limit, as vLLM reports it
    } else {
      c.text = std::move(u[i].text);
    }
    add_prompt_parts(req, prompts[i / per], u[i].prompt_logprobs, &c);
  }
  const ResponseMeta m = meta(endpoint);
  // Chat's prompt_logprobs sit at the top level (vLLM): the prompt is the same for every choice.
  std::optional<PromptLogprobs> chat_prompt;
  if (endpoint == Endpoint::kChat && req.prompt_logprobs >= 0) {
    chat_prompt = prompt_logprobs_out(prompts[0], u[0].prompt_logprobs, static_cast<size_t>(req.prompt_logprobs));
  }
  res.send(200, "application/json",
           endpoint == Endpoint::kChat ? chat_response(m, out, usage, chat_prompt ? &*chat_prompt : nullptr)
                                       : completion_response(m, out, usage));
}

void ApiServer::stream(Endpoint endpoint, const GenerationRequest& req, const std::vector<std::vector<int32_t>>& prompts,
                       const std::optional<ChatOutputOptions>& parse, const Choices& choices, HttpResponse& res) {
  const size_t n = choices.streams.size();
  int64_t prompt_tokens = 0;
  for (const std::vector<int32_t>& p : prompts) prompt_tokens += static_cast<int64_t>(p.size());
  const ResponseMeta m = meta(endpoint);
  const bool usage = req.include_usage;
  const auto chunk = [&](const ChoiceDelta& d, bool first) {
    return endpoint == Endpoint::kChat ? chat_chunk(m, d, first, usage) : completion_chunk(m, d, usage);
  };
  bool ok = res.begin_stream(200, "text/event-stream", kSseHeaders);
  // Chat streams open with the assistant role, per choice, as OpenAI's do.
  for (size_t i = 0; ok && endpoint == Endpoint::kChat && i < n; ++i) {
    ChoiceDelta first;
    first.index = static_cast<int>(i);
    ok = res.write(chunk(first, true));
  }
  // Per choice: its output parser, the tool calls it has sent, its text's bytes so far (the
  // completions logprobs' text_offset), its tokens.
  std::vector<std::optional<ChatOutputParser>> parsers(n);
  if (parse)
    for (auto& p : parsers) p.emplace(*parse);
  std::vector<int> calls(n, 0);
  std::vector<size_t> text_bytes(n, 0);
  std::vector<int64_t> completion_tokens(n, 0);
  std::vector<int64_t> cached_tokens(n, 0);
  std::vector<bool> finished(n, false);
  // Completions' echo and prompt_logprobs go in a choice's first chunk; with logprobs they wait
  // for the engine's prompt logprobs, which come before the first generated token.
  const bool prompt_parts = req.endpoint == Endpoint::kCompletion && (req.echo || req.prompt_logprobs >= 0);
  const bool prompt_scored = req.prompt_logprobs >= 0 || (req.echo && req.top_logprobs >= 0);
  std::vector<bool> prompt_sent(n, !prompt_parts);
  size_t done = 0;
  bool failed = false;  // an engine error was sent as an error chunk
  while (ok && !failed && done < n) {
    std::vector<RequestUpdate> parts(n);
    const std::vector<int> got = choices.take(parts, finished);
    if (got.empty()) {
      if (res.client_gone()) break;
      continue;
    }
    for (int gi : got) {
      const size_t i = static_cast<size_t>(gi);
      RequestUpdate& part = parts[i];
      completion_tokens[i] = part.completion_tokens;
      cached_tokens[i] = std::max(cached_tokens[i], part.cached_tokens);
      if (!part.error.empty()) {
        ok = res.write(error_chunk(server_error(part.error)));
        failed = true;
        break;
      }
      ChoiceDelta d;
      d.index = static_cast<int>(i);
      if (parsers[i]) {
        ChatOutputDelta parsed = parsers[i]->feed(part.text);
        if (part.finished) parsed.append(parsers[i]->finish());
        add_parsed(std::move(parsed), req, &calls[i], &d);
      } else {
        d.text = std::move(part.text);
      }
      d.want_logprobs = req.top_logprobs >= 0;
      d.logprobs = logprobs_text(part.tokens);
      const bool with_prompt = !prompt_sent[i] && (!prompt_scored || part.prompt_logprobs_ready);
      if (with_prompt) {
        add_prompt_parts(req, prompts[i / static_cast<size_t>(req.n)], part.prompt_logprobs, &d);
        prompt_sent[i] = true;
      }
      d.text_offset = text_bytes[i];
      for (const TokenLogprob& t : d.logprobs) text_bytes[i] += t.token.size();
      if (part.finished) d.finish_reason = calls[i] > 0 ? "tool_calls" : part.finish_reason;
      // A piece that is all held back (stop-string prefix, half a character, a partial tag, an
      // open tool call) sends nothing yet.
      if (!d.text.empty() || !d.reasoning.empty() || !d.tool_calls.empty() || !d.logprobs.empty() || with_prompt ||
          part.finished)
        ok = res.write(chunk(d, false));
      if (part.finished) {
        finished[i] = true;
        ++done;
      }
      if (!ok) break;
    }
  }
  if (ok && done == n && usage) {
    int64_t completion = 0;
    for (int64_t c : completion_tokens) completion += c;
    int64_t cached = 0;  // each prompt's best over its n choices
    const size_t per = static_cast<size_t>(req.n);
    for (size_t p = 0; p * per < n; ++p)
      cached += *std::max_element(cached_tokens.begin() + static_cast<std::ptrdiff_t>(p * per),
                                  cached_tokens.begin() + static_cast<std::ptrdiff_t>((p + 1) * per));
    ok = res.write(usage_chunk(m, endpoint, Usage{prompt_tokens, completion, cached}));
  }
  if (done < n) {
    choices.cancel();  // client gone, a write failed, or an engine error: free the KV now
    if (!ok || res.client_gone()) {
      res.abandon();  // the stream stays unterminated: the connection closes
      return;
    }
  }
  if (ok) ok = res.write(kSseDone);
  if (ok) res.end_stream();
}

}  // namespace moebius::server
