#include "server/chat_output_parser.h"

#include <nlohmann/json.hpp>

#include "core/json_depth.h"
#include "server/openai_api.h"
#include "server/stop_strings.h"

namespace moebius::server {
namespace {

constexpr std::string_view kThinkOpen = "<think>";
constexpr std::string_view kThinkClose = "</think>";
constexpr std::string_view kCallOpen = "<tool_call>";
constexpr std::string_view kCallClose = "</tool_call>";
constexpr std::string_view kSpace = " \t\r\n";

bool is_space(char c) { return kSpace.find(c) != std::string_view::npos; }

// Bytes at the end of `s` that begin a UTF-8 character whose continuation bytes have not arrived.
// An invalid lead byte, or a sequence already too long, is left alone (passed on as it is).
size_t incomplete_utf8_tail(std::string_view s) {
  for (size_t back = 1; back <= 3 && back <= s.size(); ++back) {
    const auto c = static_cast<unsigned char>(s[s.size() - back]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte: look further back for the lead
    const size_t need = c >= 0xF8 ? 1 : c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    return need > back ? back : 0;
  }
  return 0;
}

// How much of `s` to hold back: a suffix that may still become `tag`, plus the characters of
// `keep` (newlines, whitespace) right before it, which may turn out to border the tag.
size_t holdback(std::string_view s, std::string_view tag, bool (*keep)(char)) {
  size_t hold = partial_match_suffix(s, tag);
  while (hold < s.size() && keep(s[s.size() - hold - 1])) ++hold;
  return hold;
}

bool is_newline(char c) { return c == '\n'; }

std::string_view strip_trailing_newlines(std::string_view s) {
  while (!s.empty() && s.back() == '\n') s.remove_suffix(1);
  return s;
}

}  // namespace

void ChatOutputDelta::append(ChatOutputDelta&& later) {
  content += later.content;
  reasoning += later.reasoning;
  for (ParsedToolCall& c : later.tool_calls) tool_calls.push_back(std::move(c));
}

ChatOutputParser::ChatOutputParser(ChatOutputOptions options) : options_(options) {
  phase_ = !options_.reasoning ? Phase::kContent : options_.prompt_opens_think ? Phase::kReasoning : Phase::kStart;
}

bool ChatOutputParser::prompt_ends_in_think(std::string_view prompt) {
  const size_t open = prompt.rfind(kThinkOpen);
  if (open == std::string_view::npos) return false;
  return prompt.find_first_not_of(kSpace, open + kThinkOpen.size()) == std::string_view::npos;
}

ChatOutputDelta ChatOutputParser::feed(std::string_view piece) {
  std::string text = std::move(utf8_tail_);
  utf8_tail_.clear();
  text.append(piece);
  const size_t tail = incomplete_utf8_tail(text);
  utf8_tail_.assign(text, text.size() - tail, tail);
  text.resize(text.size() - tail);
  ChatOutputDelta out;
  if (text.empty()) return out;
  switch (phase_) {
    case Phase::kStart: {
      start_ += text;
      const size_t first = start_.find_first_not_of(kSpace);
      if (first == std::string::npos) return out;  // only whitespace so far: a <think> may follow
      const std::string_view rest = std::string_view(start_).substr(first);
      if (rest.substr(0, kThinkOpen.size()) == kThinkOpen) {
        phase_ = Phase::kReasoning;
        const std::string after(rest.substr(kThinkOpen.size()));
        start_.clear();
        run_reasoning(after, &out, false);
      } else if (rest.size() < kThinkOpen.size() && kThinkOpen.substr(0, rest.size()) == rest) {
        return out;  // "<thi": wait
      } else {
        phase_ = Phase::kContent;
        const std::string all = std::move(start_);
        start_.clear();
        run_content(all, &out, false);
      }
      return out;
    }
    case Phase::kReasoning: run_reasoning(text, &out, false); return out;
    case Phase::kContent: run_content(text, &out, false); return out;
  }
  return out;
}

ChatOutputDelta ChatOutputParser::finish() {
  // What is still held is final: an incomplete character, a partial tag, an open block.
  std::string text = std::move(utf8_tail_);
  utf8_tail_.clear();
  ChatOutputDelta out;
  switch (phase_) {
    case Phase::kStart: {  // whitespace or part of "<think>": plain content
      phase_ = Phase::kContent;
      const std::string all = std::move(start_) + text;
      start_.clear();
      run_content(all, &out, true);
      break;
    }
    case Phase::kReasoning: run_reasoning(text, &out, true); break;
    case Phase::kContent: run_content(text, &out, true); break;
  }
  return out;
}

void ChatOutputParser::run_reasoning(std::string_view text, ChatOutputDelta* out, bool final) {
  reasoning_ += text;
  const size_t close = reasoning_.find(kThinkClose);
  if (close != std::string::npos) {
    emit_reasoning(strip_trailing_newlines(std::string_view(reasoning_).substr(0, close)), out);
    const std::string rest = reasoning_.substr(close + kThinkClose.size());
    reasoning_.clear();
    phase_ = Phase::kContent;
    drop_newlines_ = true;
    run_content(rest, out, final);
    return;
  }
  if (final) {  // never closed (a length limit): all of it is reasoning
    emit_reasoning(strip_trailing_newlines(reasoning_), out);
    reasoning_.clear();
    return;
  }
  const size_t hold = holdback(reasoning_, kThinkClose, is_newline);
  emit_reasoning(std::string_view(reasoning_).substr(0, reasoning_.size() - hold), out);
  reasoning_.erase(0, reasoning_.size() - hold);
}

void ChatOutputParser::emit_reasoning(std::string_view text, ChatOutputDelta* out) {
  if (!reasoning_begun_) {
    while (!text.empty() && text.front() == '\n') text.remove_prefix(1);
    if (text.empty()) return;
    reasoning_begun_ = true;
  }
  out->reasoning.append(text);
}

void ChatOutputParser::run_content(std::string_view text, ChatOutputDelta* out, bool final) {
  if (drop_newlines_) {
    while (!text.empty() && text.front() == '\n') text.remove_prefix(1);
    if (!text.empty()) drop_newlines_ = false;
  }
  if (options_.tool_calls) run_tool_calls(text, out, final);
  else out->content.append(text);
}

void ChatOutputParser::run_tool_calls(std::string_view input, ChatOutputDelta* out, bool final) {
  std::string text(input);
  while (true) {
    if (in_call_) {
      // The close tag may straddle the previous piece: search from just before its end.
      const size_t from = call_.size() >= kCallClose.size() ? call_.size() - kCallClose.size() + 1 : 0;
      call_ += text;
      text.clear();
      const size_t close = call_.find(kCallClose, from);
      if (close == std::string::npos) {
        if (final) {  // left open: it was text after all
          emit_text(space_before_call_ + std::string(kCallOpen) + call_, out);
          call_.clear();
          space_before_call_.clear();
          in_call_ = false;
        }
        return;
      }
      const std::string_view body = std::string_view(call_).substr(0, close);
      ParsedToolCall call;
      if (parse_call(body, &call)) {
        out->tool_calls.push_back(std::move(call));
        after_call_ = true;
      } else {
        emit_text(space_before_call_ + std::string(kCallOpen) + std::string(body) + std::string(kCallClose), out);
      }
      text = call_.substr(close + kCallClose.size());
      call_.clear();
      space_before_call_.clear();
      in_call_ = false;
      continue;
    }
    text_ += text;
    text.clear();
    const size_t open = text_.find(kCallOpen);
    if (open != std::string::npos) {
      size_t space = open;
      while (space > 0 && is_space(text_[space - 1])) --space;
      emit_text(std::string_view(text_).substr(0, space), out);
      space_before_call_ = text_.substr(space, open - space);
      text = text_.substr(open + kCallOpen.size());
      text_.clear();
      in_call_ = true;
      continue;
    }
    const size_t hold = final ? 0 : holdback(text_, kCallOpen, is_space);
    emit_text(std::string_view(text_).substr(0, text_.size() - hold), out);
    text_.erase(0, text_.size() - hold);
    return;
  }
}

void ChatOutputParser::emit_text(std::string_view text, ChatOutputDelta* out) {
  if (after_call_) {
    while (!text.empty() && is_space(text.front())) text.remove_prefix(1);
    if (text.empty()) return;
    after_call_ = false;
  }
  out->content.append(text);
}

bool ChatOutputParser::parse_call(std::string_view body, ParsedToolCall* call) const {
  using json = nlohmann::ordered_json;
  if (json_nesting_depth(body) > options_.max_json_depth) return false;
  json j;
  try {
    j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  } catch (const json::exception&) {
    return false;
  }
  if (!j.is_object()) return false;
  const auto name = j.find("name");
  const auto arguments = j.find("arguments");
  if (name == j.end() || !name->is_string() || name->get_ref<const std::string&>().empty()) return false;
  if (arguments == j.end() || !arguments->is_object()) return false;
  call->name = name->get<std::string>();
  call->arguments = arguments->dump(-1, ' ', false, json::error_handler_t::replace);
  return true;
}

}  // namespace moebius::server
