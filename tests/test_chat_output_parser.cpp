// ChatOutputParser (server/chat_output_parser.h): Qwen3's <think> blocks and Hermes <tool_call>
// blocks split out of generated text. The outputs below are what Qwen3 writes (the shapes its
// chat template renders back). The central property: however the text is cut into stream pieces,
// even inside a tag or a UTF-8 character, what the pieces release adds up to what the whole text
// gives; checked at every split point, with every piece a single byte, and on random texts.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "server/chat_output_parser.h"
#include "tokenizer/unicode.h"

namespace moebius::server {
namespace {

ChatOutputOptions opts(bool reasoning, bool tools, bool prompt_opens_think = false) {
  ChatOutputOptions o;
  o.reasoning = reasoning;
  o.tool_calls = tools;
  o.prompt_opens_think = prompt_opens_think;
  return o;
}
const ChatOutputOptions kBoth = opts(true, true);

ChatOutputDelta whole(const ChatOutputOptions& o, const std::string& text) {
  ChatOutputParser p(o);
  ChatOutputDelta d = p.feed(text);
  d.append(p.finish());
  return d;
}

// Feeds the pieces one by one; every released piece must be valid UTF-8 (the input is).
ChatOutputDelta pieces(const ChatOutputOptions& o, const std::vector<std::string>& parts) {
  ChatOutputParser p(o);
  ChatOutputDelta all;
  for (const std::string& part : parts) {
    ChatOutputDelta d = p.feed(part);
    EXPECT_TRUE(unicode::is_valid_utf8(d.content)) << d.content;
    EXPECT_TRUE(unicode::is_valid_utf8(d.reasoning)) << d.reasoning;
    all.append(std::move(d));
  }
  all.append(p.finish());
  return all;
}

std::string show(const ChatOutputDelta& d) {
  std::string s = "content=[" + d.content + "] reasoning=[" + d.reasoning + "] calls=";
  for (const ParsedToolCall& c : d.tool_calls) s += "(" + c.name + " " + c.arguments + ")";
  return s;
}

void expect_same(const ChatOutputDelta& got, const ChatOutputDelta& want, const std::string& what) {
  EXPECT_EQ(got.content, want.content) << what;
  EXPECT_EQ(got.reasoning, want.reasoning) << what;
  EXPECT_EQ(got.tool_calls, want.tool_calls) << what << "\n got " << show(got) << "\nwant " << show(want);
}

const std::string kWeatherCall =
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>";
const std::string kSearchCall =
    "<tool_call>\n{\"name\": \"web_search\", \"arguments\": {\"query\": \"Qwen3 検索 🔍\", \"max_results\": 3}}\n</tool_call>";
const ParsedToolCall kWeather{"get_weather", R"({"city":"Paris","unit":"celsius"})"};
const ParsedToolCall kSearch{"web_search", R"({"query":"Qwen3 検索 🔍","max_results":3})"};

struct Case {
  const char* name;
  ChatOutputOptions options;
  std::string text;
  std::string content, reasoning;
  std::vector<ParsedToolCall> calls;
};

std::vector<Case> cases() {
  const std::string bad_json = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {city: Paris}}\n</tool_call>";
  return {
      {"plain", kBoth, "Paris is the capital of France.", "Paris is the capital of France.", "", {}},
      {"thinking", kBoth, "<think>\nThe user asks about France.\n</think>\n\nParis.", "Paris.",
       "The user asks about France.", {}},
      {"empty think block", kBoth, "<think>\n\n</think>\n\nHello!", "Hello!", "", {}},
      {"no think: all content", kBoth, "Hello! <think>not reasoning</think>", "Hello! <think>not reasoning</think>", "",
       {}},
      {"whitespace before think", kBoth, "\n <think>r</think>c", "c", "r", {}},
      {"unterminated think is reasoning", kBoth, "<think>\nStill thinking about </thi", "",
       "Still thinking about </thi", {}},
      {"only a close tag: content", kBoth, "</think>\n\nAnswer", "</think>\n\nAnswer", "", {}},
      {"prompt opened the think block", opts(true, true, true), "reasoning here\n</think>\n\nAnswer.", "Answer.",
       "reasoning here", {}},
      {"prompt opened, never closed", opts(true, false, true), "\nall reasoning\n\n", "", "all reasoning", {}},
      {"second think block is content", kBoth, "<think>a</think>b<think>c</think>", "b<think>c</think>", "a", {}},
      {"newlines inside reasoning kept", kBoth, "<think>\n\nline 1\n\nline 2\n\n</think>\n\n\nx", "x",
       "line 1\n\nline 2", {}},
      {"one call", kBoth, kWeatherCall, "", "", {kWeather}},
      {"text then two calls", kBoth, "Let me check both.\n" + kWeatherCall + "\n" + kSearchCall, "Let me check both.", "",
       {kWeather, kSearch}},
      {"think then call", kBoth, "<think>\nI need the weather.\n</think>\n\n" + kWeatherCall, "",
       "I need the weather.", {kWeather}},
      {"text after the calls", kBoth, kWeatherCall + "\n\nDone, see above.", "Done, see above.", "", {kWeather}},
      {"compact call", kBoth, R"(<tool_call>{"name":"f","arguments":{}}</tool_call>)", "", "", {{"f", "{}"}}},
      {"malformed JSON stays text", kBoth, "Checking.\n" + bad_json, "Checking.\n" + bad_json, "", {}},
      {"malformed between good calls", kBoth, kWeatherCall + "\n" + bad_json + "\n" + kSearchCall, bad_json, "",
       {kWeather, kSearch}},
      {"arguments not an object", kBoth, R"(<tool_call>{"name": "f", "arguments": "{}"}</tool_call>)",
       R"(<tool_call>{"name": "f", "arguments": "{}"}</tool_call>)", "", {}},
      {"no name", kBoth, R"(<tool_call>{"arguments": {}}</tool_call>)", R"(<tool_call>{"arguments": {}}</tool_call>)", "",
       {}},
      {"empty name", kBoth, R"(<tool_call>{"name": "", "arguments": {}}</tool_call>)",
       R"(<tool_call>{"name": "", "arguments": {}}</tool_call>)", "", {}},
      {"a JSON array", kBoth, "<tool_call>[1, 2]</tool_call>", "<tool_call>[1, 2]</tool_call>", "", {}},
      {"empty block", kBoth, "a <tool_call></tool_call> b", "a <tool_call></tool_call> b", "", {}},
      {"unterminated call stays text", kBoth, "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"argu",
       "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"argu", "", {}},
      {"nested open tag", kBoth, "<tool_call>\n" + kWeatherCall, "<tool_call>\n" + kWeatherCall, "", {}},
      {"close tag without open", kBoth, "text </tool_call> more", "text </tool_call> more", "", {}},
      {"call inside reasoning is reasoning", kBoth, "<think>" + kWeatherCall + "</think>ok", "ok", kWeatherCall, {}},
      {"partial open tag at the end", kBoth, "see <tool_", "see <tool_", "", {}},
      {"trailing whitespace kept", kBoth, "Hello \n\t", "Hello \n\t", "", {}},
      {"whitespace only", kBoth, " \n", " \n", "", {}},
      {"empty", kBoth, "", "", "", {}},
      {"tools off: calls are text", opts(true, false), "<think>x</think>" + kWeatherCall, kWeatherCall, "x", {}},
      {"reasoning off: think is text", opts(false, true), "<think>x</think>\n" + kWeatherCall, "<think>x</think>", "",
       {kWeather}},
      {"both off", opts(false, false), "<think>x</think>" + kWeatherCall, "<think>x</think>" + kWeatherCall, "", {}},
      {"unicode", kBoth, "<think>考え中 🤔</think>\n\n答え: é" + kSearchCall, "答え: é", "考え中 🤔", {kSearch}},
      {"too deep to parse", kBoth,
       "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": " + std::string(100, '[') + std::string(100, ']') +
           "}}</tool_call>",
       "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": " + std::string(100, '[') + std::string(100, ']') +
           "}}</tool_call>",
       "", {}},
  };
}

TEST(ChatOutputParser, RepresentativeOutputs) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const ChatOutputDelta d = whole(c.options, c.text);
    EXPECT_EQ(d.content, c.content);
    EXPECT_EQ(d.reasoning, c.reasoning);
    EXPECT_EQ(d.tool_calls, c.calls) << show(d);
  }
}

// The property: every cut into two pieces, and one byte per piece, gives the whole text's result.
TEST(ChatOutputParser, EverySplitGivesTheWholeResult) {
  for (const Case& c : cases()) {
    const ChatOutputDelta want = whole(c.options, c.text);
    for (size_t cut = 0; cut <= c.text.size(); ++cut)
      expect_same(pieces(c.options, {c.text.substr(0, cut), c.text.substr(cut)}), want,
                  std::string(c.name) + ", cut at " + std::to_string(cut));
    std::vector<std::string> bytes;
    for (char ch : c.text) bytes.emplace_back(1, ch);
    expect_same(pieces(c.options, bytes), want, std::string(c.name) + ", byte by byte");
    // Three pieces: every pair of cuts (the texts are short enough).
    if (c.text.size() > 200) continue;
    for (size_t a = 0; a <= c.text.size(); ++a)
      for (size_t b = a; b <= c.text.size(); b += 3)
        expect_same(pieces(c.options, {c.text.substr(0, a), c.text.substr(a, b - a), c.text.substr(b)}), want,
                    std::string(c.name) + ", cuts at " + std::to_string(a) + " and " + std::to_string(b));
  }
}

TEST(ChatOutputParser, NeverReleasesAPartialTag) {
  ChatOutputParser p(kBoth);
  EXPECT_TRUE(p.feed("<thi").empty());
  ChatOutputDelta d = p.feed("nk>\nStep one.\n</th");
  EXPECT_EQ(d.reasoning, "Step one.");  // the newline and "</th" wait
  d = p.feed("ink>\n\nThe answer is 4.\n<tool");
  EXPECT_EQ(d.reasoning, "");
  EXPECT_EQ(d.content, "The answer is 4.");  // "\n<tool" waits: it may start a call
  d = p.feed("_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_ca");
  EXPECT_TRUE(d.empty()) << show(d);  // the open block waits for its end
  d = p.feed("ll>");
  EXPECT_EQ(d.tool_calls, (std::vector<ParsedToolCall>{{"f", "{}"}}));
  EXPECT_EQ(d.content, "");
  EXPECT_TRUE(p.finish().empty());
}

TEST(ChatOutputParser, ReleasesTextAsSoonAsItCannotBeATag) {
  ChatOutputParser p(kBoth);
  EXPECT_TRUE(p.feed("<").empty());
  EXPECT_EQ(p.feed("b>bold").content, "<b>bold");
  EXPECT_EQ(p.feed(" <tool_cal").content, "");
  EXPECT_EQ(p.feed("culator>").content, " <tool_calculator>");
  ChatOutputParser q(opts(false, false));  // nothing to parse: everything at once
  EXPECT_EQ(q.feed("<think>a<tool_").content, "<think>a<tool_");
}

TEST(ChatOutputParser, HoldsAnIncompleteUtf8Character) {
  const std::string text = "é🔍";  // 2 + 4 bytes
  ChatOutputParser p(opts(false, false));
  EXPECT_EQ(p.feed(text.substr(0, 1)).content, "");
  EXPECT_EQ(p.feed(text.substr(1, 2)).content, "é");
  EXPECT_EQ(p.feed(text.substr(3, 2)).content, "");
  EXPECT_EQ(p.feed(text.substr(5)).content, "🔍");
  // At the end an incomplete character is released as it is (the engine's decoder sends none).
  ChatOutputParser q(opts(true, true));
  EXPECT_EQ(q.feed("ab\xE6\xA4").content, "ab");
  EXPECT_EQ(q.finish().content, "\xE6\xA4");
}

TEST(ChatOutputParser, PromptEndsInThink) {
  EXPECT_TRUE(ChatOutputParser::prompt_ends_in_think("<|im_start|>assistant\n<think>\n"));
  EXPECT_TRUE(ChatOutputParser::prompt_ends_in_think("x<think>"));
  EXPECT_FALSE(ChatOutputParser::prompt_ends_in_think("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
  EXPECT_FALSE(ChatOutputParser::prompt_ends_in_think("<|im_start|>assistant\n"));
  EXPECT_FALSE(ChatOutputParser::prompt_ends_in_think("<think>x"));
}

// Random texts from the pieces the formats are made of (tags, their prefixes, JSON, whitespace,
// multi-byte characters), cut at random: the same result as whole, and no text lost when no call
// was parsed.
TEST(ChatOutputParser, RandomTextsAndSplits) {
  const std::vector<std::string> atoms = {
      "<think>", "</think>", "<tool_call>", "</tool_call>", "<", "</", "<t", "<tool", "</tool_call", "<thin", ">",
      "\n", "\n\n", " ", "\t", "a", "Hello", "é", "🔍", "検", "{", "}", "[", "]", ":", ",", "\"", "\\",
      "\"name\"", "\"arguments\"", "\"f\"", "{}", "{\"name\": \"f\", \"arguments\": {\"x\": 1}}",
      "{\"name\": \"g\", \"arguments\": {}}"};
  std::mt19937 rng(20240607);
  for (int iter = 0; iter < 4000; ++iter) {
    std::string text;
    const int n = static_cast<int>(rng() % 24);
    for (int i = 0; i < n; ++i) text += atoms[rng() % atoms.size()];
    const ChatOutputOptions o = opts(rng() % 2, rng() % 2, rng() % 4 == 0);
    const ChatOutputDelta want = whole(o, text);
    std::vector<std::string> parts;
    for (size_t at = 0; at < text.size();) {
      const size_t len = 1 + rng() % 8;
      parts.push_back(text.substr(at, len));
      at += len;
    }
    const std::string what = "text [" + text + "] reasoning " + std::to_string(o.reasoning) + " tools " +
                             std::to_string(o.tool_calls) + " prompt_opens_think " +
                             std::to_string(o.prompt_opens_think);
    expect_same(pieces(o, parts), want, what);
    const size_t first = text.find_first_not_of(" \t\r\n");
    const bool opens_think = o.prompt_opens_think || (first != std::string::npos && text.compare(first, 7, "<think>") == 0);
    if ((!o.reasoning || !opens_think) && want.tool_calls.empty()) {
      EXPECT_EQ(want.content, text) << what;
    }
    if (!o.reasoning) {
      EXPECT_EQ(want.reasoning, "") << what;
    }
    if (!o.tool_calls) {
      EXPECT_TRUE(want.tool_calls.empty()) << what;
    }
    if (HasFailure()) break;
  }
}

}  // namespace
}  // namespace moebius::server
