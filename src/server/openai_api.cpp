#include "server/openai_api.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include <fmt/format.h>

#include "core/json_depth.h"
#include "tokenizer/unicode.h"

namespace moebius::server {

// Ordered throughout: requests keep their key order for the chat template (tojson), responses
// list fields in the order OpenAI documents them.
using json = nlohmann::ordered_json;

namespace {

constexpr size_t kMaxToolNameBytes = 256;  // OpenAI allows 64 of [a-zA-Z0-9_-]; vLLM any string

// Our own text is valid UTF-8, but a token's bytes may end mid-character: replace rather than
// throw (nlohmann's default) so a logprob entry never breaks a response.
std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

json null_if_empty(const std::string& s) { return s.empty() ? json(nullptr) : json(s); }

std::string type_name(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::string: return "a string";
    case json::value_t::array: return "an array";
    case json::value_t::object: return "an object";
    case json::value_t::binary: return "binary";
    case json::value_t::discarded: return "discarded";
    default: return "a number";
  }
}

ApiError wrong_type(const std::string& field, const char* expected, const json& got) {
  return invalid_request(fmt::format("'{}' must be {}, got {}", field, expected, type_name(got)), field);
}

// The field when present and not null.
const json* field(const json& obj, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

std::optional<ApiError> read_bool(const json& obj, const char* key, std::optional<bool>* out) {
  const json* v = field(obj, key);
  if (v == nullptr) return std::nullopt;
  if (!v->is_boolean()) return wrong_type(key, "a boolean", *v);
  *out = v->get<bool>();
  return std::nullopt;
}

std::optional<ApiError> read_number(const json& obj, const char* key, double lo, double hi, bool lo_open,
                                    std::optional<float>* out) {
  const json* v = field(obj, key);
  if (v == nullptr) return std::nullopt;
  if (!v->is_number()) return wrong_type(key, "a number", *v);
  const double x = v->get<double>();
  if (!std::isfinite(x) || x < lo || x > hi || (lo_open && x == lo))
    return invalid_request(fmt::format("'{}' must be in {}{}, {}], got {}", key, lo_open ? "(" : "[", lo, hi, x), key);
  *out = static_cast<float>(x);
  return std::nullopt;
}

// An integer; also an integral float (5.0), which Python clients send and OpenAI accepts.
std::optional<ApiError> read_int(const json& obj, const char* key, int64_t lo, int64_t hi,
                                 std::optional<int64_t>* out) {
  const json* v = field(obj, key);
  if (v == nullptr) return std::nullopt;
  int64_t x = 0;
  if (v->is_number_unsigned()) {
    const uint64_t u = v->get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      return invalid_request(fmt::format("'{}' must be at most {}, got {}", key, hi, u), key);
    x = static_cast<int64_t>(u);
  } else if (v->is_number_integer()) {
    x = v->get<int64_t>();
  } else if (v->is_number_float()) {
    const double d = v->get<double>();
    if (!std::isfinite(d) || d != std::floor(d) || std::fabs(d) > 9.0e15) return wrong_type(key, "an integer", *v);
    x = static_cast<int64_t>(d);
  } else {
    return wrong_type(key, "an integer", *v);
  }
  if (x < lo || x > hi) return invalid_request(fmt::format("'{}' must be in [{}, {}], got {}", key, lo, hi, x), key);
  *out = x;
  return std::nullopt;
}

std::optional<ApiError> read_stop(const json& obj, const ApiLimits& limits, std::vector<std::string>* out) {
  const json* v = field(obj, "stop");
  if (v == nullptr) return std::nullopt;
  std::vector<const json*> items;
  if (v->is_string()) {
    items.push_back(v);
  } else if (v->is_array()) {
    for (const json& s : *v) items.push_back(&s);
  } else {
    return wrong_type("stop", "a string or an array of strings", *v);
  }
  if (static_cast<int>(items.size()) > limits.max_stop)
    return invalid_request(fmt::format("'stop' has {} strings; at most {}", items.size(), limits.max_stop), "stop");
  for (const json* s : items) {
    if (!s->is_string()) return wrong_type("stop", "a string or an array of strings", *s);
    const std::string& str = s->get_ref<const std::string&>();
    if (str.empty()) continue;  // matches nothing: OpenAI ignores it as well
    if (str.size() > limits.max_stop_bytes)
      return invalid_request(
          fmt::format("a stop string has {} bytes; at most {}", str.size(), limits.max_stop_bytes), "stop");
    out->push_back(str);
  }
  return std::nullopt;
}

// Content: a string, null, or an array of parts of which only {"type": "text"} is supported.
std::optional<ApiError> normalize_content(json& message, size_t index) {
  const std::string param = fmt::format("messages[{}].content", index);
  auto it = message.find("content");
  if (it == message.end() || it->is_null()) {
    // "" so templates that concatenate it work. That includes an assistant turn that only calls
    // tools (OpenAI sends null there): Qwen3's template runs string tests on every assistant
    // content, and its reference rendering of such a turn (tests/data/chat) has "".
    message["content"] = "";
    return std::nullopt;
  }
  if (it->is_string()) return std::nullopt;
  if (!it->is_array()) return wrong_type(param, "a string or an array of content parts", *it);
  std::string text;
  for (const json& part : *it) {
    if (!part.is_object()) return wrong_type(param, "an array of content parts", part);
    const json* type = field(part, "type");
    if (type == nullptr || !type->is_string())
      return invalid_request(fmt::format("{}: every part needs a string 'type'", param), param);
    if (type->get_ref<const std::string&>() != "text")
      return invalid_request(fmt::format("{}: content part type '{}' is not supported; only 'text'", param,
                                         type->get_ref<const std::string&>()),
                             param);
    const json* t = field(part, "text");
    if (t == nullptr || !t->is_string()) return invalid_request(fmt::format("{}: a text part needs 'text'", param), param);
    text += t->get_ref<const std::string&>();
  }
  *it = text;
  return std::nullopt;
}

// An optional string field of a message (tool_call_id, reasoning_content, name).
std::optional<ApiError> check_string(const json& obj, const char* key, const std::string& param) {
  const json* v = field(obj, key);
  if (v != nullptr && !v->is_string()) return wrong_type(param + "." + key, "a string", *v);
  return std::nullopt;
}

// An assistant turn's tool_calls: [{"id"?, "type"?: "function", "function": {"name", "arguments"}}].
// arguments, a JSON string in OpenAI's API, becomes the object it encodes (vLLM does the same;
// missing, null or "" is {}), so templates print it with tojson as in training.
std::optional<ApiError> normalize_tool_calls(json& message, const std::string& param, const ApiLimits& limits) {
  auto calls = message.find("tool_calls");
  if (calls == message.end()) return std::nullopt;
  if (calls->is_null()) {
    message.erase(calls);
    return std::nullopt;
  }
  if (!calls->is_array()) return wrong_type(param + ".tool_calls", "an array", *calls);
  for (size_t j = 0; j < calls->size(); ++j) {
    json& call = (*calls)[j];
    const std::string p = fmt::format("{}.tool_calls[{}]", param, j);
    if (!call.is_object()) return wrong_type(p, "an object", call);
    if (auto e = check_string(call, "id", p)) return e;
    if (const json* type = field(call, "type"); type != nullptr && *type != "function")
      return invalid_request(fmt::format("'{}.type' must be \"function\"", p), p + ".type");
    // {"name", "arguments"} without the "function" wrapper is not OpenAI's shape, but chat
    // templates (Qwen3's) and transformers accept it, so it is read the same way.
    const bool flat = !call.contains("function") && call.contains("name");
    const std::string fp = flat ? p : p + ".function";
    json* fn = &call;
    if (!flat) {
      const auto it = call.find("function");
      if (it == call.end() || it->is_null()) return invalid_request(fmt::format("'{}.function' is required", p), fp);
      if (!it->is_object()) return wrong_type(fp, "an object", *it);
      fn = &*it;
    }
    const json* name = field(*fn, "name");
    if (name == nullptr || !name->is_string() || name->get_ref<const std::string&>().empty())
      return invalid_request(fmt::format("'{}.name' must be a non-empty string", fp), fp + ".name");
    const std::string ap = fp + ".arguments";
    auto args = fn->find("arguments");
    if (args == fn->end() || args->is_null() || (args->is_string() && args->get_ref<const std::string&>().empty())) {
      (*fn)["arguments"] = json::object();
    } else if (args->is_string()) {
      const std::string& text = args->get_ref<const std::string&>();
      const JsonShape shape = json_shape(text);
      if (shape.depth > limits.max_json_depth)
        return invalid_request(fmt::format("'{}' nests deeper than {} levels", ap, limits.max_json_depth), ap);
      if (shape.values > limits.max_json_values)
        return invalid_request(fmt::format("'{}' holds more than {} JSON values", ap, limits.max_json_values), ap);
      json parsed = json::parse(text, nullptr, /*allow_exceptions=*/false);
      if (parsed.is_discarded()) return invalid_request(fmt::format("'{}' is not valid JSON", ap), ap);
      *args = std::move(parsed);
    } else if (!args->is_object()) {
      return wrong_type(ap, "a JSON string", *args);
    }
  }
  return std::nullopt;
}

std::optional<ApiError> read_messages(const json& body, const ApiLimits& limits, GenerationRequest* out) {
  const json* v = field(body, "messages");
  if (v == nullptr) return invalid_request("'messages' is required", "messages");
  if (!v->is_array()) return wrong_type("messages", "an array", *v);
  if (v->empty()) return invalid_request("'messages' must not be empty", "messages");
  json messages = *v;
  for (size_t i = 0; i < messages.size(); ++i) {
    json& m = messages[i];
    const std::string param = fmt::format("messages[{}]", i);
    if (!m.is_object()) return wrong_type(param, "an object", m);
    const json* role = field(m, "role");
    if (role == nullptr) return invalid_request(fmt::format("'{}.role' is required", param), param + ".role");
    if (!role->is_string()) return wrong_type(param + ".role", "a string", *role);
    // A copy: normalize_content may add "content" to the message, which moves its other values
    // (ordered_json keeps an object's members in a vector; found by fuzz_openai_request).
    const std::string r = role->get_ref<const std::string&>();
    if (r != "system" && r != "developer" && r != "user" && r != "assistant" && r != "tool")
      return invalid_request(
          fmt::format("'{}.role' is '{}'; expected system, developer, user, assistant or tool", param, r),
          param + ".role");
    if (auto e = normalize_content(m, i)) return e;
    if (r == "assistant") {
      if (auto e = normalize_tool_calls(m, param, limits)) return e;
      if (auto e = check_string(m, "reasoning_content", param)) return e;
    }
    if (r == "tool")
      if (auto e = check_string(m, "tool_call_id", param)) return e;
  }
  out->messages = std::move(messages);
  if (const json* kw = field(body, "chat_template_kwargs")) {
    if (!kw->is_object()) return wrong_type("chat_template_kwargs", "an object", *kw);
    std::optional<bool> thinking;
    if (auto e = read_bool(*kw, "enable_thinking", &thinking)) {
      e->param = "chat_template_kwargs.enable_thinking";
      return e;
    }
    out->enable_thinking = thinking;
  }
  return std::nullopt;
}

// One entry of `tools`: {"type"?: "function", "function": {"name", "description"?, "parameters"?,
// "strict"?}}. The JSON Schema in parameters is the model's to read, not ours to check; "strict"
// is accepted and has no effect (it needs guided decoding).
std::optional<ApiError> check_tool(const json& tool, size_t index) {
  const std::string p = fmt::format("tools[{}]", index);
  if (!tool.is_object()) return wrong_type(p, "an object", tool);
  if (const json* type = field(tool, "type"); type != nullptr && *type != "function")
    return invalid_request(fmt::format("'{}.type' must be \"function\" (the only tool type supported)", p), p + ".type");
  const json* fn = field(tool, "function");
  if (fn == nullptr) return invalid_request(fmt::format("'{}.function' is required", p), p + ".function");
  if (!fn->is_object()) return wrong_type(p + ".function", "an object", *fn);
  const json* name = field(*fn, "name");
  if (name == nullptr) return invalid_request(fmt::format("'{}.function.name' is required", p), p + ".function.name");
  if (!name->is_string()) return wrong_type(p + ".function.name", "a string", *name);
  const std::string& n = name->get_ref<const std::string&>();
  if (n.empty() || n.size() > kMaxToolNameBytes)
    return invalid_request(fmt::format("'{}.function.name' must have 1 to {} bytes, got {}", p, kMaxToolNameBytes, n.size()),
                           p + ".function.name");
  if (auto e = check_string(*fn, "description", p + ".function")) return e;
  if (const json* params = field(*fn, "parameters"); params != nullptr && !params->is_object())
    return wrong_type(p + ".function.parameters", "an object (a JSON Schema)", *params);
  if (const json* strict = field(*fn, "strict"); strict != nullptr && !strict->is_boolean())
    return wrong_type(p + ".function.strict", "a boolean", *strict);
  return std::nullopt;
}

std::optional<ApiError> read_tools(const json& body, const ApiLimits& limits, GenerationRequest* out) {
  for (const char* legacy : {"functions", "function_call"})
    if (field(body, legacy) != nullptr)
      return invalid_request(fmt::format("'{}' is deprecated and not supported; use 'tools' and 'tool_choice'", legacy),
                             legacy);
  const json* tools = field(body, "tools");
  if (tools != nullptr) {
    if (!tools->is_array()) return wrong_type("tools", "an array", *tools);
    if (tools->size() > static_cast<size_t>(limits.max_tools))
      return invalid_request(fmt::format("'tools' has {} definitions; at most {}", tools->size(), limits.max_tools), "tools");
    for (size_t i = 0; i < tools->size(); ++i)
      if (auto e = check_tool((*tools)[i], i)) return e;
    // Bounded by the body already; this bounds what the template copies into the prompt.
    const size_t bytes = dump(*tools).size();
    if (bytes > limits.max_tools_bytes)
      return invalid_request(fmt::format("'tools' has {} bytes of JSON; at most {}", bytes, limits.max_tools_bytes),
                             "tools");
    if (!tools->empty()) out->tools = *tools;  // [] is no tools, as in transformers' templates
  }
  out->tool_choice = out->tools.is_null() ? ToolChoice::kNone : ToolChoice::kAuto;
  if (const json* choice = field(body, "tool_choice")) {
    if (choice->is_object())  // {"type": "function", "function": {"name": ...}}
      return invalid_request("'tool_choice' naming a function is not supported: forcing a call needs guided decoding, "
                             "which this server does not have. Use \"auto\" (or \"none\").",
                             "tool_choice");
    if (!choice->is_string()) return wrong_type("tool_choice", "a string or an object", *choice);
    const std::string& c = choice->get_ref<const std::string&>();
    if (c == "required")
      return invalid_request("'tool_choice' \"required\" is not supported: forcing a call needs guided decoding, which "
                             "this server does not have. Use \"auto\" (or \"none\").",
                             "tool_choice");
    if (c != "none" && c != "auto")
      return invalid_request(fmt::format("'tool_choice' must be \"none\", \"auto\", \"required\" or a named function, "
                                         "got \"{}\"",
                                         c.substr(0, 64)),
                             "tool_choice");
    if (c == "auto" && tools == nullptr)
      return invalid_request("'tool_choice' \"auto\" needs 'tools'", "tool_choice");
    if (c == "none") out->tool_choice = ToolChoice::kNone;
  }
  std::optional<bool> parallel;
  if (auto e = read_bool(body, "parallel_tool_calls", &parallel)) return e;
  out->parallel_tool_calls = parallel.value_or(true);
  return std::nullopt;
}

std::optional<ApiError> read_token_ids(const json& arr, std::vector<int32_t>* out, const char* param = "prompt") {
  for (const json& t : arr) {
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > std::numeric_limits<int32_t>::max())
      return invalid_request(fmt::format("'{}' token ids must be non-negative integers", param), param);
    out->push_back(static_cast<int32_t>(t.get<int64_t>()));
  }
  return std::nullopt;
}

// A string, a token id array, or a one-element array of either (n prompts are not supported).
// One prompt: text, or an array of token ids.
std::optional<ApiError> read_one_prompt(const json& p, GenerationRequest::Prompt* out) {
  if (p.is_string()) {
    out->text = p.get<std::string>();
    if (out->text.empty()) return invalid_request("'prompt' must not be empty", "prompt");
    return std::nullopt;
  }
  if (p.is_array() && !p.empty() && !p[0].is_string() && !p[0].is_array()) {
    out->is_ids = true;
    return read_token_ids(p, &out->ids);
  }
  if (p.is_array() && p.empty()) return invalid_request("'prompt' must not be empty", "prompt");
  return wrong_type("prompt", "a string or an array of token ids", p);
}

// "prompt": a string, an array of token ids, or a batch (an array of strings or of token-id
// arrays). A batch takes one choice per prompt at least, so its size is bounded by max_choices.
std::optional<ApiError> read_prompt(const json& body, const ApiLimits& limits, GenerationRequest* out) {
  const json* v = field(body, "prompt");
  if (v == nullptr) return invalid_request("'prompt' is required", "prompt");
  out->prompts.clear();
  const bool batch = v->is_array() && !v->empty() && ((*v)[0].is_string() || (*v)[0].is_array());
  if (!batch) {
    out->prompts.emplace_back();
    return read_one_prompt(*v, &out->prompts.back());
  }
  if (v->size() > static_cast<size_t>(limits.max_choices))
    return invalid_request(fmt::format("a batch of {} prompts; at most {}", v->size(), limits.max_choices), "prompt");
  for (const json& p : *v) {
    if (!p.is_string() && !p.is_array()) return wrong_type("prompt", "a batch of strings or of token-id arrays", p);
    out->prompts.emplace_back();
    if (auto e = read_one_prompt(p, &out->prompts.back())) return e;
  }
  return std::nullopt;
}

std::optional<ApiError> read_logprobs(const json& body, const ApiLimits& limits, GenerationRequest* out) {
  if (out->endpoint == Endpoint::kChat) {
    std::optional<bool> logprobs;
    if (auto e = read_bool(body, "logprobs", &logprobs)) return e;
    std::optional<int64_t> top;
    if (auto e = read_int(body, "top_logprobs", 0, limits.max_top_logprobs, &top)) return e;
    if (top && !logprobs.value_or(false))
      return invalid_request("'top_logprobs' needs 'logprobs': true", "top_logprobs");
    if (logprobs.value_or(false)) out->top_logprobs = static_cast<int>(top.value_or(0));
    return std::nullopt;
  }
  // Legacy completions: "logprobs" is the number of alternatives, at most 5.
  std::optional<int64_t> k;
  if (auto e = read_int(body, "logprobs", 0, 5, &k)) return e;
  if (k) out->top_logprobs = static_cast<int>(*k);
  return std::nullopt;
}

// vLLM's stop_token_ids: a list of token ids (checked against the vocabulary by the engine).
std::optional<ApiError> read_stop_token_ids(const json& body, const ApiLimits& limits, std::vector<int32_t>* out) {
  const json* v = field(body, "stop_token_ids");
  if (v == nullptr) return std::nullopt;
  if (!v->is_array()) return wrong_type("stop_token_ids", "an array of token ids", *v);
  if (v->size() > static_cast<size_t>(limits.max_stop_token_ids))
    return invalid_request(fmt::format("'stop_token_ids' has {} ids; at most {} are allowed", v->size(),
                                       limits.max_stop_token_ids),
                           "stop_token_ids");
  for (const json& id : *v) {
    // Integral floats (5.0) count as integers, as read_int takes them.
    const double d = id.is_number() ? id.get<double>() : -1.0;
    if (!id.is_number() || !(d >= 0.0 && d <= std::numeric_limits<int32_t>::max()) || d != std::floor(d))
      return invalid_request("'stop_token_ids' must hold non-negative integer token ids", "stop_token_ids");
    out->push_back(static_cast<int32_t>(d));
  }
  return std::nullopt;
}

// {"<id>": bias}: OpenAI's keys are token ids written as decimal strings.
std::optional<ApiError> read_logit_bias(const json& body, GenerationRequest* out) {
  const json* v = field(body, "logit_bias");
  if (v == nullptr) return std::nullopt;
  if (!v->is_object()) return wrong_type("logit_bias", "an object", *v);
  for (const auto& [key, bias] : v->items()) {
    const std::string param = "logit_bias." + key.substr(0, 32);
    int64_t id = 0;
    bool digits = !key.empty() && key.size() <= 10;
    for (char c : key) {
      if (c < '0' || c > '9') digits = false;
      else id = id * 10 + (c - '0');
    }
    if (!digits || id > std::numeric_limits<int32_t>::max())
      return invalid_request(fmt::format("'logit_bias' keys must be token ids (decimal integers), got '{}'",
                                         key.substr(0, 32)),
                             "logit_bias");
    if (!bias.is_number()) return wrong_type(param, "a number", bias);
    const double b = bias.get<double>();
    if (!std::isfinite(b) || b < -100.0 || b > 100.0)
      return invalid_request(fmt::format("'{}' must be in [-100, 100], got {}", param, b), param);
    out->logit_bias.emplace_back(static_cast<int32_t>(id), static_cast<float>(b));
  }
  // JSON object keys compare as strings ("10" < "9"): order by id for a stable, readable list.
  std::sort(out->logit_bias.begin(), out->logit_bias.end());
  for (size_t i = 1; i < out->logit_bias.size(); ++i)  // "7" and "007"
    if (out->logit_bias[i].first == out->logit_bias[i - 1].first)
      return invalid_request(fmt::format("'logit_bias' names token {} twice", out->logit_bias[i].first), "logit_bias");
  return std::nullopt;
}

std::optional<ApiError> read_sampling(const json& body, GenerationRequest* out) {
  if (auto e = read_number(body, "temperature", 0.0, 2.0, false, &out->temperature)) return e;
  if (auto e = read_number(body, "top_p", 0.0, 1.0, true, &out->top_p)) return e;
  if (auto e = read_number(body, "min_p", 0.0, 1.0, false, &out->min_p)) return e;
  if (out->min_p && *out->min_p >= 1.0f) return invalid_request("'min_p' must be in [0, 1)", "min_p");
  std::optional<int64_t> top_k;
  if (auto e = read_int(body, "top_k", -1, std::numeric_limits<int32_t>::max(), &top_k)) return e;
  if (top_k) out->top_k = static_cast<int>(std::max<int64_t>(*top_k, 0));
  std::optional<int64_t> seed;
  if (auto e = read_int(body, "seed", std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(), &seed))
    return e;
  if (seed) out->seed = static_cast<uint64_t>(*seed);
  if (auto e = read_number(body, "presence_penalty", -2.0, 2.0, false, &out->presence_penalty)) return e;
  if (auto e = read_number(body, "frequency_penalty", -2.0, 2.0, false, &out->frequency_penalty)) return e;
  if (auto e = read_number(body, "repetition_penalty", 0.0, kMaxRepetitionPenalty, true, &out->repetition_penalty))
    return e;
  return read_logit_bias(body, out);
}

// Fields that change what a response means and that this server does not implement. Ignoring
// them would answer a different question than the one asked (JSON mode answered with free text,
// an echo without the prompt), so a request that sets one to anything but its neutral value gets
// a 400 naming it. Fields with no effect on the answer (user, metadata, ...) are ignored, as
// vLLM ignores unknown fields.
enum class Scope { kBoth, kCompletions, kChat };
struct UnsupportedField {
  const char* key;
  Scope scope;
  bool (*neutral)(const json& value, const json& body);  // the value asks for nothing we lack
  const char* why;
};

bool is_false(const json& v, const json&) { return v.is_boolean() && !v.get<bool>(); }
bool is_true(const json& v, const json&) { return v.is_boolean() && v.get<bool>(); }
bool never(const json&, const json&) { return false; }

const UnsupportedField kUnsupportedFields[] = {
    {"echo", Scope::kChat, is_false,
     "'echo' is not supported in chat completions (the completions API echoes the prompt)"},
    {"suffix", Scope::kCompletions, [](const json& v, const json&) { return v.is_string() && v.get_ref<const std::string&>().empty(); },
     "'suffix' (insertion) is not supported"},
    {"best_of", Scope::kBoth,
     [](const json& v, const json& body) {
       const json* n = field(body, "n");
       return v.is_number() && v.get<double>() == (n != nullptr && n->is_number() ? n->get<double>() : 1.0);
     },
     "'best_of' other than n is not supported: every sampled sequence is returned"},
    {"response_format", Scope::kBoth,
     [](const json& v, const json&) { return v.is_object() && v.value("type", json()) == "text"; },
     "'response_format' other than {\"type\": \"text\"} needs guided decoding, which this server does not have"},
    {"structured_outputs", Scope::kBoth, never, "structured outputs need guided decoding, which this server does not have"},
    {"guided_json", Scope::kBoth, never, "guided decoding is not supported"},
    {"guided_regex", Scope::kBoth, never, "guided decoding is not supported"},
    {"guided_choice", Scope::kBoth, never, "guided decoding is not supported"},
    {"guided_grammar", Scope::kBoth, never, "guided decoding is not supported"},
    {"use_beam_search", Scope::kBoth, is_false, "beam search is not supported"},
    {"add_generation_prompt", Scope::kBoth, is_true,
     "'add_generation_prompt' false is not supported: the chat template always renders the assistant turn's start"},
    {"continue_final_message", Scope::kBoth, is_false, "'continue_final_message' is not supported"},
    {"truncate_prompt_tokens", Scope::kBoth, never, "'truncate_prompt_tokens' is not supported: send the prompt to use"},
    {"skip_special_tokens", Scope::kBoth, is_true, "special tokens are always left out of the text ('skip_special_tokens' "
                                            "must be true)"},
};

std::optional<ApiError> refuse_unsupported(Endpoint endpoint, const json& body) {
  for (const UnsupportedField& f : kUnsupportedFields) {
    if ((f.scope == Scope::kCompletions && endpoint != Endpoint::kCompletion) ||
        (f.scope == Scope::kChat && endpoint != Endpoint::kChat))
      continue;
    const json* v = field(body, f.key);
    if (v != nullptr && !f.neutral(*v, body)) return invalid_request(f.why, f.key, "unsupported_parameter");
  }
  return std::nullopt;
}

}  // namespace

std::string ApiError::to_json() const {
  json e = {{"message", message}, {"type", type}, {"param", null_if_empty(param)}, {"code", null_if_empty(code)}};
  return dump(json{{"error", std::move(e)}});
}

ApiError invalid_request(std::string message, std::string param, std::string code) {
  return ApiError{400, std::move(message), "invalid_request_error", std::move(param), std::move(code)};
}

ApiError unauthorized() {
  return ApiError{401, "Incorrect or missing API key. Pass it as 'Authorization: Bearer <key>'.",
                  "invalid_request_error", "", "invalid_api_key"};
}

ApiError model_not_found(const std::string& model) {
  return ApiError{404, fmt::format("The model '{}' does not exist.", model), "invalid_request_error", "model",
                  "model_not_found"};
}

ApiError body_too_large(size_t bytes, size_t limit) {
  return ApiError{413, fmt::format("The request body has {} bytes; the limit is {}.", bytes, limit),
                  "invalid_request_error", "", "request_too_large"};
}

ApiError queue_full(size_t depth) {
  return ApiError{429, fmt::format("The server is busy: {} requests are already waiting. Retry later.", depth),
                  "rate_limit_error", "", "queue_full"};
}

ApiError not_found(const std::string& path) {
  return ApiError{404, fmt::format("No route for '{}'.", path), "invalid_request_error", "", "not_found"};
}

ApiError method_not_allowed(const std::string& method, const std::string& path) {
  return ApiError{405, fmt::format("Method {} is not allowed on '{}'.", method, path), "invalid_request_error", "",
                  "method_not_allowed"};
}

ApiError server_error(std::string message, int status) {
  return ApiError{status, std::move(message), "server_error", "", ""};
}

ApiError context_exceeded(int64_t prompt_tokens, int64_t max_tokens, int64_t context, const std::string& prompt_param) {
  if (max_tokens <= 0)
    return invalid_request(fmt::format("This model's maximum context length is {} tokens. However, your prompt has {} "
                                       "tokens, which leaves no room for a completion.",
                                       context, prompt_tokens),
                           prompt_param, "context_length_exceeded");
  return invalid_request(fmt::format("This model's maximum context length is {} tokens. However, you requested {} "
                                     "tokens ({} in the prompt, {} in the completion). Please reduce the length of "
                                     "the prompt or of max_tokens.",
                                     context, prompt_tokens + max_tokens, prompt_tokens, max_tokens),
                         "max_tokens", "context_length_exceeded");
}

namespace {

// The checks every JSON body gets: size, UTF-8, nesting, syntax, an object at the top.
std::optional<ApiError> parse_body(std::string_view body, const ApiLimits& limits, json* doc) {
  if (body.size() > limits.max_body_bytes) return body_too_large(body.size(), limits.max_body_bytes);
  if (!unicode::is_valid_utf8(body)) return invalid_request("The request body is not valid UTF-8.", "", "invalid_utf8");
  // nlohmann parses iteratively, but deep documents still cost recursion when copied and dumped; a
  // request never needs more than a few levels [TAG_JSON_DEPTH].
  const JsonShape shape = json_shape(body);
  if (shape.depth > limits.max_json_depth)
    return invalid_request(fmt::format("The request body nests deeper than {} levels.", limits.max_json_depth));
  if (shape.values > limits.max_json_values)
    return invalid_request(fmt::format("The request body holds more than {} JSON values.", limits.max_json_values));
  try {
    *doc = json::parse(body);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for numbers like 1e999
    return invalid_request(fmt::format("The request body is not valid JSON: {}", e.what()), "", "invalid_json");
  }
  if (!doc->is_object()) return invalid_request("The request body must be a JSON object, got " + type_name(*doc) + ".");
  return std::nullopt;
}

}  // namespace

std::optional<ApiError> parse_update_weights_request(std::string_view body, const ApiLimits& limits,
                                                     UpdateWeightsRequest* out) {
  json doc;
  if (auto e = parse_body(body, limits, &doc)) return e;
  const json* path = field(doc, "model_path");
  if (path == nullptr) return invalid_request("'model_path' is required", "model_path");
  if (!path->is_string()) return wrong_type("model_path", "a string", *path);
  if (path->get_ref<const std::string&>().empty()) return invalid_request("'model_path' is empty", "model_path");
  if (const json* f = field(doc, "load_format")) {
    if (!f->is_string()) return wrong_type("load_format", "a string", *f);
    if (*f != "auto")
      return invalid_request(fmt::format("load_format '{}' is not supported; this server reads safetensors "
                                         "checkpoints (\"auto\")",
                                         f->get<std::string>()),
                             "load_format");
  }
  out->model_path = path->get<std::string>();
  return std::nullopt;
}

std::string update_weights_response(const std::string& message, int64_t num_paused_requests) {
  return dump({{"success", true}, {"message", message}, {"num_paused_requests", num_paused_requests}});
}

std::string update_weights_error(const ApiError& e) {
  json err = {{"message", e.message}, {"type", e.type}, {"param", null_if_empty(e.param)},
              {"code", null_if_empty(e.code)}};
  return dump({{"success", false}, {"message", e.message}, {"error", std::move(err)}});
}

namespace {

// "model", when present: a string naming this server's model (404 otherwise).
std::optional<ApiError> read_model(const json& doc, const ApiLimits& limits, std::string* out) {
  const json* model = field(doc, "model");
  if (model == nullptr) return std::nullopt;
  if (!model->is_string()) return wrong_type("model", "a string", *model);
  *out = model->get<std::string>();
  if (std::find(limits.model_names.begin(), limits.model_names.end(), *out) == limits.model_names.end())
    return model_not_found(*out);
  return std::nullopt;
}

// "model" is optional on the tokenizer routes; when given it must name this server's model.
std::optional<ApiError> check_optional_model(const json& doc, const ApiLimits& limits) {
  std::string unused;
  return read_model(doc, limits, &unused);
}

}  // namespace

std::optional<ApiError> parse_tokenize_request(std::string_view body, const ApiLimits& limits, GenerationRequest* out) {
  json doc;
  if (auto e = parse_body(body, limits, &doc)) return e;
  if (auto e = check_optional_model(doc, limits)) return e;
  GenerationRequest r;
  std::optional<bool> special;
  if (auto e = read_bool(doc, "add_special_tokens", &special)) return e;
  if (field(doc, "messages") != nullptr) {
    if (field(doc, "prompt") != nullptr)
      return invalid_request("give either 'prompt' or 'messages', not both", "prompt");
    // What chat completions refuse (add_generation_prompt false, ...) would count another prompt.
    if (auto e = refuse_unsupported(Endpoint::kChat, doc)) return e;
    r.endpoint = Endpoint::kChat;
    if (auto e = read_messages(doc, limits, &r)) return e;
    if (auto e = read_tools(doc, limits, &r)) return e;
  } else {
    r.endpoint = Endpoint::kCompletion;
    if (auto e = read_prompt(doc, limits, &r)) return e;
    if (r.prompts.size() != 1) return invalid_request("/tokenize takes one prompt, not a batch", "prompt");
  }
  *out = std::move(r);
  return std::nullopt;
}

std::optional<ApiError> parse_detokenize_request(std::string_view body, const ApiLimits& limits,
                                                 DetokenizeRequest* out) {
  json doc;
  if (auto e = parse_body(body, limits, &doc)) return e;
  if (auto e = check_optional_model(doc, limits)) return e;
  const json* t = field(doc, "tokens");
  if (t == nullptr) return invalid_request("'tokens' is required", "tokens");
  if (!t->is_array()) return wrong_type("tokens", "an array of token ids", *t);
  DetokenizeRequest r;
  if (auto e = read_token_ids(*t, &r.tokens, "tokens")) return e;
  *out = std::move(r);
  return std::nullopt;
}

std::optional<ApiError> parse_request(Endpoint endpoint, std::string_view body, const ApiLimits& limits,
                                      GenerationRequest* out) {
  json doc;
  if (auto e = parse_body(body, limits, &doc)) return e;

  GenerationRequest r;
  r.endpoint = endpoint;
  if (field(doc, "model") == nullptr) return invalid_request("'model' is required", "model");
  if (auto e = read_model(doc, limits, &r.model)) return e;

  if (auto e = refuse_unsupported(endpoint, doc)) return e;
  if (endpoint == Endpoint::kChat) {
    if (auto e = read_messages(doc, limits, &r)) return e;
    if (auto e = read_tools(doc, limits, &r)) return e;
  } else {
    if (auto e = read_prompt(doc, limits, &r)) return e;
  }
  // max_completion_tokens is the chat API's newer name; either may be given.
  std::optional<int64_t> max_tokens, max_completion_tokens;
  if (auto e = read_int(doc, "max_tokens", 1, std::numeric_limits<int32_t>::max(), &max_tokens)) return e;
  if (auto e = read_int(doc, "max_completion_tokens", 1, std::numeric_limits<int32_t>::max(), &max_completion_tokens))
    return e;
  r.max_tokens = max_completion_tokens ? max_completion_tokens : max_tokens;
  if (auto e = read_stop(doc, limits, &r.stop)) return e;
  if (auto e = read_stop_token_ids(doc, limits, &r.stop_token_ids)) return e;
  std::optional<int64_t> min_tokens;
  if (auto e = read_int(doc, "min_tokens", 0, std::numeric_limits<int32_t>::max(), &min_tokens)) return e;
  r.min_tokens = min_tokens.value_or(0);
  if (r.max_tokens && r.min_tokens > *r.max_tokens)
    return invalid_request(fmt::format("'min_tokens' ({}) must not exceed 'max_tokens' ({})", r.min_tokens, *r.max_tokens),
                           "min_tokens");
  std::optional<int64_t> n;
  if (auto e = read_int(doc, "n", 1, limits.max_choices, &n)) return e;
  r.n = static_cast<int>(n.value_or(1));
  if (r.prompts.size() * static_cast<size_t>(r.n) > static_cast<size_t>(limits.max_choices))
    return invalid_request(fmt::format("{} prompts x n = {} is {} choices; at most {}", r.prompts.size(), r.n,
                                       r.prompts.size() * static_cast<size_t>(r.n), limits.max_choices),
                           "n");
  if (auto e = read_sampling(doc, &r)) return e;
  if (auto e = read_logprobs(doc, limits, &r)) return e;
  if (endpoint == Endpoint::kCompletion) {
    std::optional<bool> echo;
    if (auto e = read_bool(doc, "echo", &echo)) return e;
    r.echo = echo.value_or(false);
  }
  std::optional<int64_t> prompt_logprobs;
  if (auto e = read_int(doc, "prompt_logprobs", 0, limits.max_top_logprobs, &prompt_logprobs)) return e;
  r.prompt_logprobs = prompt_logprobs ? static_cast<int>(*prompt_logprobs) : -1;
  std::optional<bool> stream, ignore_eos, include_stop;
  if (auto e = read_bool(doc, "stream", &stream)) return e;
  if (auto e = read_bool(doc, "ignore_eos", &ignore_eos)) return e;
  if (auto e = read_bool(doc, "include_stop_str_in_output", &include_stop)) return e;
  r.include_stop_str = include_stop.value_or(false);
  r.stream = stream.value_or(false);
  r.ignore_eos = ignore_eos.value_or(false);
  if (endpoint == Endpoint::kChat && r.stream && r.prompt_logprobs >= 0)
    return invalid_request("'prompt_logprobs' is not supported in chat streams (chat puts them at the response's top "
                           "level); send stream false",
                           "prompt_logprobs", "unsupported_parameter");
  if (const json* so = field(doc, "stream_options")) {
    if (!so->is_object()) return wrong_type("stream_options", "an object", *so);
    if (!r.stream) return invalid_request("'stream_options' is only allowed when 'stream' is true", "stream_options");
    std::optional<bool> usage;
    if (auto e = read_bool(*so, "include_usage", &usage)) {
      e->param = "stream_options.include_usage";
      return e;
    }
    r.include_usage = usage.value_or(false);
  }
  *out = std::move(r);
  return std::nullopt;
}

// ---------------------------------------------------------------------------------------------
// Responses
// ---------------------------------------------------------------------------------------------

namespace {

json usage_json(const Usage& u) {
  return {{"prompt_tokens", u.prompt_tokens},
          {"completion_tokens", u.completion_tokens},
          {"total_tokens", u.prompt_tokens + u.completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", u.cached_tokens}}}};
}

json token_bytes(const std::string& s) {
  json b = json::array();
  for (unsigned char c : s) b.push_back(static_cast<int>(c));
  return b;
}

// Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}.
json chat_logprobs(const ChoiceDelta& c) {
  if (!c.want_logprobs) return nullptr;
  json content = json::array();
  for (const TokenLogprob& t : c.logprobs) {
    json top = json::array();
    for (const auto& [tok, lp] : t.top) top.push_back({{"token", tok}, {"logprob", lp}, {"bytes", token_bytes(tok)}});
    content.push_back(
        {{"token", t.token}, {"logprob", t.logprob}, {"bytes", token_bytes(t.token)}, {"top_logprobs", std::move(top)}});
  }
  return {{"content", std::move(content)}};
}

// Legacy completions: parallel arrays; top_logprobs maps token -> logprob per position.
json completion_logprobs(const ChoiceDelta& c, size_t text_offset) {
  if (!c.want_logprobs) return nullptr;
  json tokens = json::array(), lps = json::array(), tops = json::array(), offsets = json::array();
  size_t off = text_offset;
  for (const TokenLogprob& t : c.logprobs) {
    tokens.push_back(t.token);
    if (!t.has_logprob) {  // an echoed prompt's first token: nothing before it to predict it from
      lps.push_back(nullptr);
      tops.push_back(nullptr);
      offsets.push_back(off);
      off += t.token.size();
      continue;
    }
    lps.push_back(t.logprob);
    json top = json::object();
    for (const auto& [tok, lp] : t.top) top[tok] = lp;
    tops.push_back(std::move(top));
    offsets.push_back(off);
    off += t.token.size();
  }
  return {{"tokens", std::move(tokens)},
          {"token_logprobs", std::move(lps)},
          {"top_logprobs", std::move(tops)},
          {"text_offset", std::move(offsets)}};
}

// [{"id", "type": "function", "function": {"name", "arguments"}}]; stream deltas lead with the
// call's index (OpenAI's ChoiceDeltaToolCall), by which clients accumulate the calls.
json tool_calls_json(const std::vector<ToolCallOut>& calls, bool with_index) {
  json out = json::array();
  for (const ToolCallOut& c : calls) {
    json j = json::object();
    if (with_index) j["index"] = c.index;
    j["id"] = c.id;
    j["type"] = "function";
    j["function"] = {{"name", c.name}, {"arguments", c.arguments}};
    out.push_back(std::move(j));
  }
  return out;
}

json finish(const ChoiceDelta& c) { return c.finish_reason ? json(*c.finish_reason) : json(nullptr); }

// vLLM's prompt_logprobs: [null, {"<id>": {"logprob", "rank", "decoded_token"}, ...}, ...].
json prompt_logprobs_json(const PromptLogprobs& p) {
  json out = json::array();
  for (const auto& position : p) {
    if (!position) {
      out.push_back(nullptr);
      continue;
    }
    json ids = json::object();
    for (const PromptLogprob& e : *position)
      ids[std::to_string(e.id)] = {{"logprob", e.logprob}, {"rank", e.rank}, {"decoded_token", e.decoded}};
    out.push_back(std::move(ids));
  }
  return out;
}

std::string sse(const json& j) { return "data: " + dump(j) + "\n\n"; }

}  // namespace

std::string chat_response(const ResponseMeta& m, std::span<const ChoiceDelta> choices, const Usage& usage,
                          const PromptLogprobs* prompt_logprobs) {
  json out = json::array();
  for (const ChoiceDelta& c : choices) {
    json message = {{"role", "assistant"},
                    {"content", c.null_empty_content && c.text.empty() ? json(nullptr) : json(c.text)}};
    if (c.reasoning_field) message["reasoning_content"] = null_if_empty(c.reasoning);
    if (!c.tool_calls.empty()) message["tool_calls"] = tool_calls_json(c.tool_calls, false);
    out.push_back(
        {{"index", c.index}, {"message", std::move(message)}, {"logprobs", chat_logprobs(c)}, {"finish_reason", finish(c)}});
  }
  json body = {{"id", m.id},
               {"object", "chat.completion"},
               {"created", m.created},
               {"model", m.model},
               {"choices", std::move(out)},
               {"usage", usage_json(usage)}};
  if (prompt_logprobs != nullptr) body["prompt_logprobs"] = prompt_logprobs_json(*prompt_logprobs);
  return dump(body);
}

std::string completion_response(const ResponseMeta& m, std::span<const ChoiceDelta> choices, const Usage& usage) {
  json out = json::array();
  for (const ChoiceDelta& c : choices) {
    json choice = {{"index", c.index},
                   {"text", c.text},
                   {"logprobs", completion_logprobs(c, c.text_offset)},
                   {"finish_reason", finish(c)}};
    if (c.want_prompt_logprobs) choice["prompt_logprobs"] = prompt_logprobs_json(c.prompt_logprobs);
    out.push_back(std::move(choice));
  }
  return dump({{"id", m.id},
               {"object", "text_completion"},
               {"created", m.created},
               {"model", m.model},
               {"choices", std::move(out)},
               {"usage", usage_json(usage)}});
}

std::string chat_chunk(const ResponseMeta& m, const ChoiceDelta& d, bool first, bool include_usage) {
  json delta = json::object();
  if (first) delta["role"] = "assistant";
  if (first || !d.text.empty()) delta["content"] = d.text;
  if (!d.reasoning.empty()) delta["reasoning_content"] = d.reasoning;
  if (!d.tool_calls.empty()) delta["tool_calls"] = tool_calls_json(d.tool_calls, true);
  json choice = {{"index", d.index}, {"delta", std::move(delta)}, {"logprobs", chat_logprobs(d)}, {"finish_reason", finish(d)}};
  json j = {{"id", m.id},
            {"object", "chat.completion.chunk"},
            {"created", m.created},
            {"model", m.model},
            {"choices", json::array({std::move(choice)})}};
  if (include_usage) j["usage"] = nullptr;
  return sse(j);
}

std::string completion_chunk(const ResponseMeta& m, const ChoiceDelta& d, bool include_usage) {
  json choice = {{"index", d.index},
                 {"text", d.text},
                 {"logprobs", completion_logprobs(d, d.text_offset)},
                 {"finish_reason", finish(d)}};
  if (d.want_prompt_logprobs) choice["prompt_logprobs"] = prompt_logprobs_json(d.prompt_logprobs);
  json j = {{"id", m.id},
            {"object", "text_completion"},
            {"created", m.created},
            {"model", m.model},
            {"choices", json::array({std::move(choice)})}};
  if (include_usage) j["usage"] = nullptr;
  return sse(j);
}

std::string usage_chunk(const ResponseMeta& m, Endpoint endpoint, const Usage& usage) {
  return sse({{"id", m.id},
              {"object", endpoint == Endpoint::kChat ? "chat.completion.chunk" : "text_completion"},
              {"created", m.created},
              {"model", m.model},
              {"choices", json::array()},
              {"usage", usage_json(usage)}});
}

std::string error_chunk(const ApiError& error) { return "data: " + error.to_json() + "\n\n"; }

std::string tokenize_response(const std::vector<int32_t>& ids, int64_t max_model_len) {
  return dump({{"count", ids.size()}, {"max_model_len", max_model_len}, {"tokens", ids}, {"token_strs", nullptr}});
}

std::string detokenize_response(const std::string& text) { return dump({{"prompt", text}}); }

std::string models_response(const std::vector<std::string>& names, int64_t created, int64_t max_model_len) {
  json data = json::array();
  for (const std::string& n : names)
    data.push_back(
        {{"id", n}, {"object", "model"}, {"created", created}, {"owned_by", "moebius"}, {"max_model_len", max_model_len}});
  return dump({{"object", "list"}, {"data", std::move(data)}});
}

}  // namespace moebius::server
