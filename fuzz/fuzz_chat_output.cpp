// libFuzzer target: server::ChatOutputParser, which every generated token of a chat response with
// tools or a reasoning parser goes through. The first byte picks the options (reasoning, tool
// calls, prompt_opens_think), the second seeds the cuts, the rest is the model's text. Beyond "no
// crash": the text cut into pieces gives what the whole text gives (the streaming property the
// unit tests check on known outputs); released pieces of valid UTF-8 are valid UTF-8; with no
// reasoning split off and no call parsed, the content is the text, byte for byte (nothing lost).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "fuzz_check.h"
#include "server/chat_output_parser.h"
#include "tokenizer/unicode.h"

using namespace moebius::server;

using moebius::fuzz::check;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  ChatOutputOptions o;
  o.reasoning = data[0] & 1;
  o.tool_calls = data[0] & 2;
  o.prompt_opens_think = data[0] & 4;
  uint32_t seed = data[1];
  const std::string_view text(reinterpret_cast<const char*>(data + 2), size - 2);
  const bool valid = moebius::unicode::is_valid_utf8(text);

  ChatOutputParser whole_parser(o);
  ChatOutputDelta whole = whole_parser.feed(text);
  whole.append(whole_parser.finish());

  ChatOutputParser parser(o);
  ChatOutputDelta cut;
  for (size_t at = 0; at < text.size();) {
    seed = seed * 1103515245u + 12345u;
    const size_t len = 1 + (seed >> 16) % 13;
    ChatOutputDelta d = parser.feed(text.substr(at, len));
    if (valid) check(moebius::unicode::is_valid_utf8(d.content) && moebius::unicode::is_valid_utf8(d.reasoning));
    cut.append(std::move(d));
    at += len;
  }
  cut.append(parser.finish());
  check(cut.content == whole.content && cut.reasoning == whole.reasoning && cut.tool_calls == whole.tool_calls);
  if (!o.reasoning) check(whole.reasoning.empty());
  if (!o.tool_calls) check(whole.tool_calls.empty());
  if (!o.reasoning && whole.tool_calls.empty()) check(whole.content == text);
  for (const ParsedToolCall& c : whole.tool_calls) check(!c.name.empty() && c.arguments.front() == '{');
  return 0;
}
