// libFuzzer target: server::parse_request, the OpenAI request parser every HTTP body reaches (and
// parse_update_weights_request, parse_tokenize_request and parse_detokenize_request on the same
// bytes).
// The first byte picks the endpoint (chat or completions); the rest is the body. Beyond "no
// crash, no sanitizer report": an error has a 4xx status and serializes to JSON in OpenAI's
// shape; an accepted request satisfies the invariants the engine and the chat template rely on
// (ranges, string contents, parsed tool-call arguments, bounded tools), and its strings round-trip
// through the response builders.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include <nlohmann/json.hpp>

#include "fuzz_check.h"
#include "server/openai_api.h"

using namespace moebius::server;

using moebius::fuzz::check;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const Endpoint endpoint = (data[0] & 1) ? Endpoint::kChat : Endpoint::kCompletion;
  const std::string_view body(reinterpret_cast<const char*>(data + 1), size - 1);
  ApiLimits limits;
  limits.model_names = {"tiny", "m"};
  limits.max_body_bytes = 1 << 16;
  // The same body as POST /update_weights_from_disk: a 4xx with both error shapes, or a path.
  UpdateWeightsRequest u;
  if (auto e = parse_update_weights_request(body, limits, &u)) {
    check(e->status == 400 || e->status == 413);
    const nlohmann::json j = nlohmann::json::parse(update_weights_error(*e));
    check(j["success"] == false && j["message"] == j["error"]["message"]);
  } else {
    check(!u.model_path.empty());
    check(nlohmann::json::parse(update_weights_response(u.model_path, 0))["message"] == u.model_path);
  }
  // The same body as POST /tokenize and /detokenize: a 4xx, or a prompt / chat / id list.
  GenerationRequest t;
  if (auto e = parse_tokenize_request(body, limits, &t)) {
    check(e->status == 400 || e->status == 404 || e->status == 413);
  } else if (t.endpoint == Endpoint::kChat) {
    check(t.messages.is_array() && !t.messages.empty());
  } else {
    check(t.prompts.size() == 1 && (t.prompts[0].is_ids ? !t.prompts[0].ids.empty() : !t.prompts[0].text.empty()));
  }
  DetokenizeRequest dt;
  if (auto e = parse_detokenize_request(body, limits, &dt)) {
    check(e->status == 400 || e->status == 404 || e->status == 413);
  } else {
    for (int32_t id : dt.tokens) check(id >= 0);
    check(nlohmann::json::parse(tokenize_response(dt.tokens, 1))["count"] == dt.tokens.size());
  }
  GenerationRequest r;
  if (auto e = parse_request(endpoint, body, limits, &r)) {
    check(e->status == 400 || e->status == 404 || e->status == 413);
    const nlohmann::json j = nlohmann::json::parse(e->to_json());
    check(j["error"]["message"].is_string() && !j["error"]["message"].get<std::string>().empty());
    return 0;
  }
  check(r.model == "tiny" || r.model == "m");
  check(!r.max_tokens || *r.max_tokens >= 1);
  check(static_cast<int>(r.stop.size()) <= limits.max_stop);
  for (const std::string& s : r.stop) check(!s.empty() && s.size() <= limits.max_stop_bytes);
  check(r.top_logprobs >= -1 && r.top_logprobs <= limits.max_top_logprobs);
  check(!r.temperature || (*r.temperature >= 0.0f && *r.temperature <= 2.0f));
  check(!r.top_p || (*r.top_p > 0.0f && *r.top_p <= 1.0f));
  check(!r.min_p || (*r.min_p >= 0.0f && *r.min_p < 1.0f));
  check(!r.top_k || *r.top_k >= 0);
  check(!r.presence_penalty || std::fabs(*r.presence_penalty) <= 2.0f);
  check(!r.frequency_penalty || std::fabs(*r.frequency_penalty) <= 2.0f);
  check(!r.repetition_penalty || (*r.repetition_penalty > 0.0f && *r.repetition_penalty <= kMaxRepetitionPenalty));
  for (size_t i = 0; i < r.logit_bias.size(); ++i) {  // ascending, unique ids; biases in range
    check(r.logit_bias[i].first >= 0 && std::fabs(r.logit_bias[i].second) <= 100.0f);
    check(i == 0 || r.logit_bias[i - 1].first < r.logit_bias[i].first);
  }
  check(!r.include_usage || r.stream);
  check(endpoint == Endpoint::kChat ? r.prompts.empty() : !r.prompts.empty());
  check(r.prompts.size() * static_cast<size_t>(r.n) <= static_cast<size_t>(limits.max_choices));
  for (const GenerationRequest::Prompt& p : r.prompts) check(p.is_ids ? !p.ids.empty() : !p.text.empty());
  check(r.prompt_logprobs >= -1 && r.prompt_logprobs <= limits.max_top_logprobs);
  check(!r.echo || endpoint == Endpoint::kCompletion);
  if (endpoint == Endpoint::kChat) {
    check(r.messages.is_array() && !r.messages.empty());
    for (const auto& m : r.messages) {
      check(m.is_object() && m.contains("role") && m.at("role").is_string());
      // Always a string, on a turn that only calls tools too (the template concatenates it).
      const auto c = m.find("content");
      check(c != m.end() && c->is_string());
      // An assistant's calls: named functions whose arguments were parsed from their JSON string.
      const auto calls = m.find("tool_calls");
      if (m.at("role") == "assistant" && calls != m.end()) {
        check(calls->is_array());
        for (const auto& call : *calls) {
          const auto& fn = call.at("function");
          check(fn.at("name").is_string() && !fn.at("name").get<std::string>().empty());
          check(fn.contains("arguments") && !fn.at("arguments").is_null());
        }
      }
    }
    // Tools: null, or a bounded non-empty array of named functions; "auto" only with tools.
    if (!r.tools.is_null()) {
      check(r.tools.is_array() && !r.tools.empty() && static_cast<int>(r.tools.size()) <= limits.max_tools);
      check(r.tools.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace).size() <=
            limits.max_tools_bytes);
      for (const auto& t : r.tools) {
        const auto& name = t.at("function").at("name");
        check(name.is_string() && !name.get<std::string>().empty());
      }
    }
    check(r.tool_choice == ToolChoice::kNone || !r.tools.is_null());
  } else {
    check(r.tools.is_null() && r.tool_choice == ToolChoice::kNone);
  }
  // Request text echoed into responses (stop strings as text, the model name) stays valid JSON.
  ChoiceDelta d;
  for (const std::string& s : r.stop) d.text += s;
  d.finish_reason = "stop";
  const ResponseMeta meta{"id", r.model, 0};
  check(nlohmann::json::parse(completion_response(meta, d, Usage{1, 2}))["choices"][0]["text"] == d.text);
  check(nlohmann::json::parse(chat_chunk(meta, d, true, true).substr(6)).is_object());
  // Tool names from the request echoed as calls, with the body as their arguments text.
  if (!r.tools.is_null()) {
    d.tool_calls.push_back(ToolCallOut{0, "call_x", r.tools[0]["function"]["name"].get<std::string>(), std::string(body)});
    d.null_empty_content = true;
    const nlohmann::json j = nlohmann::json::parse(chat_response(meta, d, Usage{1, 2}));
    check(j["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == d.tool_calls[0].name);
  }
  return 0;
}
