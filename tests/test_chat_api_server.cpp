// The chat route's output parsing, end to end over HTTP (server/api_server.h): a real ApiServer,
// Engine and HttpServer, with a runner whose logits force a scripted answer, so the model "writes"
// Qwen3's think blocks and Hermes tool calls (the random tiny model never would; the node tests
// cover the real model and client). Whole and streamed responses must carry the same
// reasoning_content, content and tool_calls, with finish_reason "tool_calls".
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "server/api_server.h"
#include "server/http_client.h"
#include "server/http_server.h"
#include "serve_test_util.h"
#include "socket_test_util.h"
#include "test_util.h"
#include "tiny_fixture.h"

namespace moebius::server {
namespace {

using json = nlohmann::json;
constexpr int32_t kImEnd = 322;  // tests/data/tiny-serve's <|im_end|>, the eos here

const tokenizer::BpeTokenizer& tiny_tokenizer() { return testing::tiny_serve_tokenizer(); }

// Answers every sequence with the tokens of `script`, then eos: its logits are -1e9 except for
// the next scripted token. The tiny CPU runner provides the config and limits; nothing is computed.
class ScriptedRunner final : public testing::ForwardingRunner {
 public:
  using ForwardingRunner::ForwardingRunner;
  void set_script(const std::string& text) {
    std::lock_guard<std::mutex> lock(mu_);
    script_.clear();
    for (tokenizer::TokenId id : tiny_tokenizer().encode(text)) script_.push_back(static_cast<int32_t>(id));
  }
  // Each step takes this long (a generation the client can leave in the middle of).
  void set_step_delay(std::chrono::milliseconds d) { delay_ms_ = static_cast<int>(d.count()); }
  std::string describe() const override { return "scripted"; }
  Status step(std::span<const RunnerSeq> seqs, std::vector<float>& logits) override {
    if (const int d = delay_ms_.load(); d > 0) std::this_thread::sleep_for(std::chrono::milliseconds(d));
    std::lock_guard<std::mutex> lock(mu_);
    const auto vocab = static_cast<size_t>(config().vocab_size);
    logits.assign(vocab * static_cast<size_t>(std::count_if(seqs.begin(), seqs.end(),
                                                            [](const RunnerSeq& s) { return s.want_logits; })),
                  -1e9f);
    size_t row = 0;
    for (const RunnerSeq& s : seqs) {
      if (!s.want_logits) continue;
      const size_t next = produced_[s.id]++;
      logits[row++ * vocab + static_cast<size_t>(next < script_.size() ? script_[next] : kImEnd)] = 0.0f;
    }
    return Ok{};
  }
  void release(int64_t id) override { produced_.erase(id); }
  // It keeps a count per sequence, not KV: no prefix caching (a cached start would not change it).
  bool shares_kv_blocks() const override { return false; }

 private:
  std::mutex mu_;
  std::vector<int32_t> script_;
  std::unordered_map<int64_t, size_t> produced_;  // tokens answered per sequence
  std::atomic<int> delay_ms_{0};
};

class ChatApiServer : public ::testing::Test {
 protected:
  void SetUp() override {
    RunnerOptions o;
    o.source.model_dir = testing::tiny_fixture_dir();
    o.max_seqs = 2;
    auto inner = load_runner(o);
    ASSERT_TRUE(inner.ok()) << inner.error().what();
    auto runner = std::make_unique<ScriptedRunner>(std::move(inner).value());
    runner_ = runner.get();
    engine_ = std::make_unique<Engine>(std::move(runner), &tiny_tokenizer(), EngineOptions{16, {kImEnd}});
    // The prompt is the messages' contents and the tool names; what matters here is the output.
    ChatRenderer render = [this](const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                                 std::optional<bool>) -> Result<std::string> {
      rendered_tools_ = tools;
      std::string text;
      for (const auto& m : messages) text += m["content"].get<std::string>() + "\n";
      if (tools.is_array())
        for (const auto& t : tools) text += t["function"]["name"].get<std::string>() + "\n";
      return text;
    };
    ApiServerOptions ao;
    ao.served_model_name = "tiny";
    ao.tool_call_parser = ToolCallParser::kHermes;
    ao.reasoning_parser = ReasoningParser::kQwen3;
    api_ = std::make_unique<ApiServer>(engine_.get(), &tiny_tokenizer(), render, ao);
    HttpServerOptions ho;
    ho.port = 0;
    http_ = std::make_unique<HttpServer>(ho, [this](const HttpRequest& req, HttpResponse& res) { api_->handle(req, res); });
    ASSERT_TRUE(http_->listen().ok());
    serving_ = std::thread([this] { http_->serve(); });
  }
  void TearDown() override {
    if (http_) http_->stop();
    if (serving_.joinable()) serving_.join();
    if (engine_) engine_->stop();
  }

  // POSTs a chat request whose answer is `script`: {status, the body (whole) or the SSE events}.
  std::pair<int, std::vector<json>> chat(const std::string& script, json body) {
    runner_->set_script(script);
    body["model"] = "tiny";
    if (!body.contains("messages")) body["messages"] = {{{"role", "user"}, {"content", "weather?"}}};
    std::string text;
    auto r = http_post(HttpUrl{"127.0.0.1", http_->port(), ""}, "/v1/chat/completions", body.dump(), {},
                       [&](std::string_view part) {
                         text.append(part);
                         return true;
                       },
                       60);
    EXPECT_TRUE(r.ok()) << r.error().what();
    if (!r.ok()) return {0, {}};
    if (r->status != 200) return {r->status, {json::parse(r->body)}};
    if (!body.value("stream", false)) return {200, {json::parse(text)}};
    std::vector<json> events;
    for (size_t at = 0; (at = text.find("data: ", at)) != std::string::npos;) {
      const size_t end = text.find("\n\n", at);
      const std::string data = text.substr(at + 6, end - at - 6);
      if (data != "[DONE]") events.push_back(json::parse(data));
      at = end;
    }
    return {200, events};
  }

  // The streamed deltas of choice `index` put together as an OpenAI client does (tool calls by
  // index). Unless the answer keeps a block as text, no content delta may hold a tool-call tag.
  static json accumulate(const std::vector<json>& events, bool tags_are_text = false, int index = 0) {
    json message = {{"content", ""}, {"reasoning_content", ""}, {"tool_calls", json::array()}};
    json finish = nullptr;
    for (const json& e : events) {
      if (e["choices"].empty() || e["choices"][0]["index"] != index) continue;
      EXPECT_EQ(e["choices"].size(), 1u) << "a chunk carries one choice";
      const json& choice = e["choices"][0];
      const json& d = choice["delta"];
      if (d.contains("content")) {
        const std::string c = d["content"];
        if (!tags_are_text) {
          EXPECT_EQ(c.find("<tool_call"), std::string::npos) << "a tag reached the content: " << c;
        }
        message["content"] = message["content"].get<std::string>() + c;
      }
      if (d.contains("reasoning_content"))
        message["reasoning_content"] = message["reasoning_content"].get<std::string>() + d["reasoning_content"].get<std::string>();
      for (const json& t : d.value("tool_calls", json::array())) {
        const size_t i = t["index"];
        EXPECT_EQ(i, message["tool_calls"].size()) << "one delta per call, in order";
        message["tool_calls"].push_back({{"id", t["id"]}, {"type", t["type"]}, {"function", t["function"]}});
      }
      if (!choice["finish_reason"].is_null()) finish = choice["finish_reason"];
    }
    return {{"message", message}, {"finish_reason", finish}};
  }

  ScriptedRunner* runner_ = nullptr;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<ApiServer> api_;
  std::unique_ptr<HttpServer> http_;
  std::thread serving_;
  nlohmann::ordered_json rendered_tools_;
};

const json kTools = json::parse(R"([{"type": "function", "function": {"name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "now"}}])");
const std::string kAnswer =
    "<think>\nThe user wants the weather.\n</think>\n\nLet me look that up.\n<tool_call>\n{\"name\": \"get_weather\", "
    "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";

// A client that half-closes its side after sending a whole (not streamed) request is taken for
// gone, as uvicorn does: its generation is cancelled and the connection closes with no answer.
// Before HttpResponse::abandon() it got the HTTP layer's 500 "no response", meant for handler bugs.
TEST_F(ChatApiServer, AHalfClosedClientIsLeftWithoutAnAnswerNotA500) {
  std::string script;
  for (int i = 0; i < 150; ++i) script += "word ";
  runner_->set_script(script);
  runner_->set_step_delay(std::chrono::milliseconds(20));  // ~3 s of generation unless cancelled
  const json body = {{"model", "tiny"}, {"max_tokens", 200}, {"messages", {{{"role", "user"}, {"content", "hi"}}}}};
  const std::string payload = body.dump();
  const std::string request = "POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
                              "Content-Length: " + std::to_string(payload.size()) + "\r\n\r\n" + payload;
  const int fd = testing::connect_loopback(http_->port());
  ASSERT_EQ(::send(fd, request.data(), request.size(), MSG_NOSIGNAL), static_cast<ssize_t>(request.size()));
  const auto t0 = std::chrono::steady_clock::now();
  ::shutdown(fd, SHUT_WR);
  const testing::Drained reply = testing::read_until_close(fd, std::chrono::milliseconds(10000));
  const bool closed = reply.closed;
  const std::string& got = reply.bytes;
  ::close(fd);
  EXPECT_TRUE(closed) << "the server kept the connection open";
  EXPECT_EQ(got, "") << "a client taken for gone was answered";
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2)) << "the generation ran on";
  runner_->set_step_delay(std::chrono::milliseconds(0));
  // The cancelled sequence freed its slot: a normal request is served.
  const auto [status, events] = chat("ok", {});
  EXPECT_EQ(status, 200);
}

TEST_F(ChatApiServer, ToolCallsWholeAndStreamed) {
  auto [status, whole] = chat(kAnswer, {{"tools", kTools}});
  ASSERT_EQ(status, 200) << whole[0].dump();
  EXPECT_EQ(rendered_tools_.size(), 2u);  // the template got the tools
  const json& choice = whole[0]["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "tool_calls");
  const json& msg = choice["message"];
  EXPECT_EQ(msg["reasoning_content"], "The user wants the weather.");
  EXPECT_EQ(msg["content"], "Let me look that up.");
  ASSERT_EQ(msg["tool_calls"].size(), 2u);
  EXPECT_EQ(msg["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(json::parse(msg["tool_calls"][0]["function"]["arguments"].get<std::string>()), json({{"city", "Paris"}}));
  EXPECT_EQ(msg["tool_calls"][1]["function"]["arguments"], "{}");
  EXPECT_EQ(msg["tool_calls"][0]["type"], "function");
  const std::string id = msg["tool_calls"][0]["id"];
  EXPECT_EQ(id.rfind("call_", 0), 0u);
  EXPECT_EQ(id.size(), 29u);
  EXPECT_NE(msg["tool_calls"][1]["id"], id);

  auto [s2, events] = chat(kAnswer, {{"tools", kTools}, {"stream", true}});
  ASSERT_EQ(s2, 200);
  const json streamed = accumulate(events);
  EXPECT_EQ(streamed["finish_reason"], "tool_calls");
  EXPECT_EQ(streamed["message"]["reasoning_content"], msg["reasoning_content"]);
  EXPECT_EQ(streamed["message"]["content"], msg["content"]);
  ASSERT_EQ(streamed["message"]["tool_calls"].size(), 2u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(streamed["message"]["tool_calls"][i]["function"], msg["tool_calls"][i]["function"]);
    EXPECT_EQ(streamed["message"]["tool_calls"][i]["id"].get<std::string>().rfind("call_", 0), 0u);
  }
}

// Without tools, or with tool_choice "none", a <tool_call> is text the client gets as content
// (the reasoning is still split off).
TEST_F(ChatApiServer, NoParsingWithoutToolsOrWithChoiceNone) {
  const std::string content = kAnswer.substr(kAnswer.find("Let me"));
  for (const json& extra : {json::object(), json{{"tools", kTools}, {"tool_choice", "none"}}}) {
    SCOPED_TRACE(extra.dump());
    auto [status, whole] = chat(kAnswer, extra);
    ASSERT_EQ(status, 200);
    const json& choice = whole[0]["choices"][0];
    EXPECT_EQ(choice["finish_reason"], "stop");
    EXPECT_EQ(choice["message"]["content"], content);
    EXPECT_EQ(choice["message"]["reasoning_content"], "The user wants the weather.");
    EXPECT_FALSE(choice["message"].contains("tool_calls"));
    json streaming = extra;
    streaming["stream"] = true;
    auto [s2, events] = chat(kAnswer, streaming);
    const json streamed = accumulate(events, true);
    EXPECT_EQ(streamed["message"]["content"], content);
    EXPECT_EQ(streamed["finish_reason"], "stop");
  }
  EXPECT_EQ(rendered_tools_.size(), 2u);  // "none" still renders the tools
}

TEST_F(ChatApiServer, ParallelToolCallsFalseKeepsTheFirst) {
  auto [status, whole] = chat(kAnswer, {{"tools", kTools}, {"parallel_tool_calls", false}});
  ASSERT_EQ(status, 200);
  ASSERT_EQ(whole[0]["choices"][0]["message"]["tool_calls"].size(), 1u);
  EXPECT_EQ(whole[0]["choices"][0]["message"]["tool_calls"][0]["function"]["name"], "get_weather");
}

// Malformed JSON in a block, and a block cut off by max_tokens, come back as content, whole.
TEST_F(ChatApiServer, MalformedAndUnfinishedCallsStayContent) {
  const std::string bad = "Checking.\n<tool_call>\n{\"name\": get_weather}\n</tool_call>";
  auto [status, whole] = chat(bad, {{"tools", kTools}});
  ASSERT_EQ(status, 200);
  EXPECT_EQ(whole[0]["choices"][0]["message"]["content"], bad);
  EXPECT_EQ(whole[0]["choices"][0]["finish_reason"], "stop");
  // The script ends inside the block; then eos, ignored, until max_tokens: a length limit.
  const std::string open = "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par";
  const auto limit = static_cast<int>(tiny_tokenizer().encode(open).size()) + 2;
  auto [s2, events] = chat(open, {{"tools", kTools}, {"stream", true}, {"max_tokens", limit}, {"ignore_eos", true}});
  const json streamed = accumulate(events, true);
  EXPECT_EQ(streamed["message"]["content"], open);
  EXPECT_EQ(streamed["finish_reason"], "length");
  EXPECT_TRUE(streamed["message"]["tool_calls"].empty());
}

// n choices: each its own sequence (3 here over a runner of 2 slots, so one waits), each parsed on
// its own; whole responses list them by index, streams interleave chunks that name theirs, and
// the usage counts the prompt once and every choice's tokens.
TEST_F(ChatApiServer, NChoicesWholeAndStreamed) {
  auto [status, whole] = chat(kAnswer, {{"tools", kTools}, {"n", 3}});
  ASSERT_EQ(status, 200) << whole[0].dump();
  const json& choices = whole[0]["choices"];
  ASSERT_EQ(choices.size(), 3u);
  auto [s1, single] = chat(kAnswer, {{"tools", kTools}});
  ASSERT_EQ(s1, 200);
  const json& one = single[0]["choices"][0];
  for (int i = 0; i < 3; ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(choices[i]["index"], i);
    EXPECT_EQ(choices[i]["finish_reason"], "tool_calls");
    EXPECT_EQ(choices[i]["message"]["content"], one["message"]["content"]);
    EXPECT_EQ(choices[i]["message"]["reasoning_content"], one["message"]["reasoning_content"]);
    ASSERT_EQ(choices[i]["message"]["tool_calls"].size(), 2u);
    EXPECT_EQ(choices[i]["message"]["tool_calls"][1]["function"], one["message"]["tool_calls"][1]["function"]);
  }
  const json& u1 = single[0]["usage"];
  EXPECT_EQ(whole[0]["usage"]["prompt_tokens"], u1["prompt_tokens"]);
  EXPECT_EQ(whole[0]["usage"]["completion_tokens"], 3 * u1["completion_tokens"].get<int>());

  auto [s2, events] = chat(kAnswer, {{"tools", kTools}, {"n", 3}, {"stream", true},
                                     {"stream_options", {{"include_usage", true}}}});
  ASSERT_EQ(s2, 200);
  for (int i = 0; i < 3; ++i) {
    SCOPED_TRACE(i);
    int roles = 0;
    for (const json& e : events)
      if (!e["choices"].empty() && e["choices"][0]["index"] == i && e["choices"][0]["delta"].contains("role")) ++roles;
    EXPECT_EQ(roles, 1);
    const json streamed = accumulate(events, false, i);
    EXPECT_EQ(streamed["finish_reason"], "tool_calls");
    EXPECT_EQ(streamed["message"]["content"], one["message"]["content"]);
    EXPECT_EQ(streamed["message"]["tool_calls"].size(), 2u);
  }
  // More choices than the queue holds (16 here) could never all wait: a 400, not a 429 to retry.
  auto [s3, refused] = chat(kAnswer, {{"n", 17}});
  EXPECT_EQ(s3, 400);
  EXPECT_EQ(refused[0]["error"]["param"], "n");
  ASSERT_FALSE(events.empty());
  EXPECT_TRUE(events.back()["choices"].empty());  // the usage chunk comes last, once
  EXPECT_EQ(events.back()["usage"]["completion_tokens"], 3 * u1["completion_tokens"].get<int>());
}

// vLLM's stop_token_ids end the answer at that id (not returned, finish_reason "stop"); min_tokens
// holds off eos, those ids and the stop strings until that many tokens came.
TEST_F(ChatApiServer, StopTokenIdsAndMinTokens) {
  const std::string script = "one two three";
  const std::vector<tokenizer::TokenId> ids = tiny_tokenizer().encode(script);
  // A token of the script (not its first) that occurs once in it.
  size_t p = 1;
  while (p < ids.size() && std::count(ids.begin(), ids.end(), ids[p]) != 1) ++p;
  ASSERT_LT(p, ids.size());
  const auto stop_id = static_cast<int32_t>(ids[p]);
  auto [s0, plain] = chat(script, json::object());
  ASSERT_EQ(s0, 200);
  const int64_t full = plain[0]["usage"]["completion_tokens"];
  EXPECT_EQ(full, static_cast<int64_t>(ids.size()));
  auto [s1, stopped] = chat(script, {{"stop_token_ids", {stop_id}}});
  ASSERT_EQ(s1, 200);
  EXPECT_EQ(stopped[0]["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(stopped[0]["usage"]["completion_tokens"], static_cast<int64_t>(p));
  EXPECT_EQ(stopped[0]["choices"][0]["message"]["content"],
            tiny_tokenizer().decode(std::vector<tokenizer::TokenId>(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(p))));
  // min_tokens past the script: eos cannot be sampled, so the answer runs on to min_tokens and
  // then stops at the first eos the runner offers.
  const int64_t min = full + 3;
  auto [s2, longer] = chat(script, {{"min_tokens", min}, {"max_tokens", min + 5}, {"temperature", 0}});
  ASSERT_EQ(s2, 200);
  EXPECT_EQ(longer[0]["usage"]["completion_tokens"], min);
  EXPECT_EQ(longer[0]["choices"][0]["finish_reason"], "stop");
  // The stop id inside the first min_tokens does not end it, nor does a stop string there.
  auto [s3, held] = chat(script, {{"min_tokens", p + 1}, {"stop_token_ids", {stop_id}}, {"stop", "one"},
                                  {"temperature", 0}});
  ASSERT_EQ(s3, 200);
  EXPECT_EQ(held[0]["usage"]["completion_tokens"], full);
  // vLLM's boundary: with min_tokens k, a stop string counts when it completes in the text of a
  // token after the k-th, even when it began earlier; one wholly inside the first k tokens' text
  // does not. At a token m (1-based) with text on both sides: "across" runs from the last byte
  // before token m through the first byte after it, "inside" is token m's own text; min_tokens m.
  const auto text_of = [&](size_t n) {
    return tiny_tokenizer().decode(std::vector<tokenizer::TokenId>(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(n)));
  };
  const auto once = [&](const std::string& t) {
    const size_t at = script.find(t);
    return at != std::string::npos && script.find(t, at + 1) == std::string::npos;
  };
  std::string across, inside, kept;
  size_t m = 2;
  for (; m + 1 < ids.size(); ++m) {
    const std::string a = text_of(m - 1), b = text_of(m), c = text_of(m + 1);
    if (a.empty() || b.size() == a.size() || c.size() == b.size()) continue;
    across = c.substr(a.size() - 1, b.size() - a.size() + 2);
    inside = b.substr(a.size());
    kept = a.substr(0, a.size() - 1);
    if (once(across) && once(inside)) break;
  }
  ASSERT_LT(m + 1, ids.size()) << "the script has no token whose text occurs once";
  for (bool streamed : {false, true}) {
    SCOPED_TRACE(streamed ? "streamed" : "whole");
    auto [s4, r4] = chat(script, {{"min_tokens", m}, {"stop", across}, {"temperature", 0}, {"stream", streamed}});
    ASSERT_EQ(s4, 200);
    const json got = streamed ? accumulate(r4) : r4[0]["choices"][0];
    EXPECT_EQ(got["finish_reason"], "stop");
    EXPECT_EQ(got["message"]["content"], kept);
  }
  auto [s5, r5] = chat(script, {{"min_tokens", m}, {"stop", inside}, {"temperature", 0}});
  ASSERT_EQ(s5, 200);
  EXPECT_EQ(r5[0]["usage"]["completion_tokens"], full);
  // include_stop_str_in_output keeps the stop string, whole and streamed.
  for (bool streamed : {false, true}) {
    SCOPED_TRACE(streamed ? "streamed, include" : "whole, include");
    auto [s6, r6] = chat(script, {{"stop", "two"}, {"include_stop_str_in_output", true}, {"temperature", 0},
                                  {"stream", streamed}});
    ASSERT_EQ(s6, 200);
    const json got = streamed ? accumulate(r6) : r6[0]["choices"][0];
    EXPECT_EQ(got["finish_reason"], "stop");
    EXPECT_EQ(got["message"]["content"], "one two");
  }
  // Bad values are 400s.
  for (const json& bad : {json{{"stop_token_ids", "7"}}, json{{"stop_token_ids", {-1}}},
                          json{{"stop_token_ids", {100000}}}, json{{"min_tokens", -1}},
                          json{{"min_tokens", 5}, {"max_tokens", 4}}, json{{"include_stop_str_in_output", 1}}}) {
    SCOPED_TRACE(bad.dump());
    auto [st, body] = chat(script, bad);
    EXPECT_EQ(st, 400);
  }
}

// POST /tokenize counts what the generation routes would send the engine (the same rendered chat
// prompt, the same ids), and POST /detokenize turns ids back into text.
TEST_F(ChatApiServer, TokenizeAndDetokenizeRoutes) {
  const auto post = [&](const char* path, const json& body) {
    std::string text;
    auto r = http_post(HttpUrl{"127.0.0.1", http_->port(), ""}, path, body.dump(), {},
                       [&](std::string_view part) {
                         text.append(part);
                         return true;
                       },
                       60);
    EXPECT_TRUE(r.ok()) << r.error().what();
    if (!r.ok()) return std::make_pair(0, json());
    return std::make_pair(r->status, json::parse(r->status == 200 ? text : r->body));
  };
  const std::string text = "one two three";
  const std::vector<tokenizer::TokenId> want = tiny_tokenizer().encode(text);
  auto [s1, t1] = post("/tokenize", {{"model", "tiny"}, {"prompt", text}});
  ASSERT_EQ(s1, 200) << t1.dump();
  EXPECT_EQ(t1["count"], want.size());
  EXPECT_EQ(t1["tokens"], json(want));
  EXPECT_EQ(t1["max_model_len"], engine_->max_context());
  auto [s2, t2] = post("/detokenize", {{"tokens", t1["tokens"]}});
  ASSERT_EQ(s2, 200) << t2.dump();
  EXPECT_EQ(t2["prompt"], text);
  // A chat counts as its rendered prompt: what a chat completion of the same messages reports.
  const json messages = {{{"role", "user"}, {"content", "weather?"}}};
  auto [s3, t3] = post("/tokenize", {{"messages", messages}});
  ASSERT_EQ(s3, 200) << t3.dump();
  auto [s4, answer] = chat("ok", {{"messages", messages}});
  ASSERT_EQ(s4, 200);
  EXPECT_EQ(t3["count"], answer[0]["usage"]["prompt_tokens"]);
  // Bad input: 4xx naming the problem.
  EXPECT_EQ(post("/detokenize", {{"tokens", {100000}}}).first, 400);
  EXPECT_EQ(post("/tokenize", {{"model", "nope"}, {"prompt", "x"}}).first, 404);
  EXPECT_EQ(post("/tokenize", json::object()).first, 400);
}

// The server refuses tools it cannot parse: tool_choice "auto" without a tool-call parser.
TEST_F(ChatApiServer, ToolsNeedAParser) {
  ApiServerOptions ao;
  ao.served_model_name = "tiny";
  ApiServer plain(engine_.get(), &tiny_tokenizer(),
                  [](const nlohmann::ordered_json&, const nlohmann::ordered_json&, std::optional<bool>)
                      -> Result<std::string> { return std::string("x"); },
                  ao);
  HttpServerOptions ho;
  ho.port = 0;
  HttpServer http(ho, [&plain](const HttpRequest& req, HttpResponse& res) { plain.handle(req, res); });
  ASSERT_TRUE(http.listen().ok());
  std::thread serving([&http] { http.serve(); });
  const json body = {{"model", "tiny"}, {"messages", {{{"role", "user"}, {"content", "x"}}}}, {"tools", kTools}};
  auto r = http_post(HttpUrl{"127.0.0.1", http.port(), ""}, "/v1/chat/completions", body.dump(), {},
                     [](std::string_view) { return true; }, 60);
  http.stop();
  serving.join();
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status, 400);
  EXPECT_EQ(json::parse(r->body)["error"]["param"], "tool_choice");
}

}  // namespace
}  // namespace moebius::server
