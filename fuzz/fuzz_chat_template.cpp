// libFuzzer target for the chat-template interpreter (src/chat; see fuzz/README.md). The input is
// a template's source; it is parsed and, when it parses, rendered against a fixed conversation that
// has every message kind (system, user, assistant with reasoning and tool calls, tool) and tools.
//
// Beyond "does not crash" (ASan/UBSan, and no stack overflow from deep nesting), it checks:
//   - every failure is a moebius::Error with a message (no other exception escapes);
//   - the output respects the 16 MiB cap (Budget::kMaxString).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <nlohmann/json.hpp>

#include "chat/chat_template.h"
#include "chat/jinja_value.h"
#include "core/error.h"

namespace {

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "fuzz_chat_template: property violated: %s\n", what);
  std::abort();
}

const nlohmann::ordered_json& conversation() {
  static const auto j = nlohmann::ordered_json::parse(R"([
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Hi {{ x }} 😀"},
    {"role": "assistant", "content": "<think>\nr\n</think>\n\nHello", "reasoning_content": null},
    {"role": "user", "content": "weather?"},
    {"role": "assistant", "content": "", "tool_calls": [
      {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
      {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]},
    {"role": "tool", "content": "18 C"},
    {"role": "assistant", "content": "It is 18 C.", "reasoning_content": "easy"}
  ])");
  return j;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using moebius::chat::ChatTemplate;
  const std::string source(reinterpret_cast<const char*>(data), size);
  moebius::chat::RenderOptions options;
  options.enable_thinking = size % 2 == 0;
  options.add_generation_prompt = size % 3 != 0;
  options.tools = nlohmann::ordered_json::parse(
      R"([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}])");
  try {
    const ChatTemplate t = ChatTemplate::parse(source);
    const std::string out = t.render(conversation(), options);
    if (out.size() > moebius::chat::jinja::Budget::kMaxString) fail("output past the 16 MiB cap");
  } catch (const moebius::Error& e) {
    if (e.message().empty()) fail("empty error message");
  } catch (...) {
    fail("an exception other than moebius::Error escaped");
  }
  return 0;
}
