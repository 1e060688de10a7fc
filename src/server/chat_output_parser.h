// The chat output parsers of `moebius serve --reasoning-parser qwen3 --tool-call-parser hermes`
// (vLLM's names): generated text in, OpenAI's message fields out. Fed the decoded text piece by
// piece as the engine streams it, the parser returns what may be sent now as `content`,
// `reasoning_content` and `tool_calls`; whole responses feed the whole text once. Plain C++ with no
// model or tokenizer, so every split of a text is unit-tested (tests/test_chat_output_parser.cpp).
//
// Formats (Qwen3's; its chat template renders history in the same shapes):
//
//   <think>\nREASONING\n</think>\n\nCONTENT
//   CONTENT\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>...
//
// Reasoning (qwen3): a `<think>` at the very start of the output (after optional whitespace)
// opens the reasoning; it runs to `</think>`, or to the end of the output when the generation
// stopped first (a length limit: all of it is reasoning). An output that starts with anything
// else is all content (Qwen3 with enable_thinking=false: the template already closed an empty
// think block in the prompt). When the prompt itself ends inside an open `<think>` (templates that
// start the block for the model, as Qwen3-Thinking-2507's does) the output starts in reasoning.
// Newlines that open or close the reasoning, and those right after `</think>`, are dropped: the
// template strips exactly those (reasoning_content.strip('\n'), content.lstrip('\n')) when it
// renders the turn back, so a client that returns reasoning_content and content gets the prompt
// the model saw. Only the first think block is reasoning; later tags are content.
//
// Tool calls (hermes), in the content only: each `<tool_call>...</tool_call>` whose inside is a
// JSON object {"name": non-empty string, "arguments": object} becomes a call with `arguments`
// re-serialized as a JSON string (OpenAI's type). Whitespace between a call and the text or call
// next to it is dropped (the template writes a '\n' there). Anything else stays text, tags and
// all, so nothing is lost: a block that is not such an object (malformed JSON, a nested tag),
// or one left open when the generation ended.
//
// Holding back: text that may still turn into a tag (a suffix that is a prefix of `<think>`,
// `</think>` or `<tool_call>`), whitespace that may turn out to border a tag, an open tool-call
// block, and an incomplete UTF-8 character at the end of a piece wait for the next piece or
// finish(); everything else is returned at once. So a partial tag is never sent as content, and
// the concatenation of what feed() and finish() return is the same however the text is split.
// [TAG_STREAM_HOLDBACK]
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace moebius::server {

struct ParsedToolCall {
  std::string name;
  std::string arguments;  // a JSON object, serialized

  bool operator==(const ParsedToolCall&) const = default;
};

// What one feed() or finish() releases.
struct ChatOutputDelta {
  std::string content;
  std::string reasoning;
  std::vector<ParsedToolCall> tool_calls;  // in order; content and calls of one delta interleave
                                           // only in whitespace, which is dropped

  bool empty() const { return content.empty() && reasoning.empty() && tool_calls.empty(); }
  void append(ChatOutputDelta&& later);
};

struct ChatOutputOptions {
  bool reasoning = false;           // split off <think>...</think> (qwen3)
  bool prompt_opens_think = false;  // the prompt ends inside <think>: start in reasoning
  bool tool_calls = false;          // parse <tool_call> blocks (hermes)
  int max_json_depth = 64;          // deeper tool-call JSON is treated as malformed (stays text)
};

class ChatOutputParser {
 public:
  explicit ChatOutputParser(ChatOutputOptions options);

  // The next piece of generated text (any split, even inside a UTF-8 character).
  ChatOutputDelta feed(std::string_view piece);
  // The end of the generation: releases everything held back.
  ChatOutputDelta finish();

  // Whether the rendered prompt ends inside an open think block (only whitespace after the last
  // `<think>`), for ChatOutputOptions::prompt_opens_think.
  static bool prompt_ends_in_think(std::string_view prompt);

 private:
  enum class Phase { kStart, kReasoning, kContent };
  void run_reasoning(std::string_view text, ChatOutputDelta* out, bool final);
  void emit_reasoning(std::string_view text, ChatOutputDelta* out);
  void run_content(std::string_view text, ChatOutputDelta* out, bool final);
  void run_tool_calls(std::string_view text, ChatOutputDelta* out, bool final);
  void emit_text(std::string_view text, ChatOutputDelta* out);
  bool parse_call(std::string_view body, ParsedToolCall* call) const;

  ChatOutputOptions options_;
  std::string utf8_tail_;  // an incomplete UTF-8 character at the end of the last piece
  Phase phase_ = Phase::kStart;
  std::string start_;      // kStart: the output so far (whitespace, maybe part of "<think>")
  std::string reasoning_;  // kReasoning: held back (a partial "</think>", trailing newlines)
  bool reasoning_begun_ = false;     // some reasoning was emitted (leading newlines are dropped)
  bool drop_newlines_ = false;       // right after </think>: the content's leading newlines go
  std::string text_;                 // tool calls: text held back (a partial tag, whitespace)
  bool in_call_ = false;             // inside <tool_call>, collecting call_
  std::string call_;                 // the open block's inside
  std::string space_before_call_;    // whitespace dropped before the open block (restored if it fails)
  bool after_call_ = false;          // the last thing released was a call: drop whitespace
};

}  // namespace moebius::server
