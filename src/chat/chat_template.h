// Chat templates: renders a conversation into the prompt text the model was trained on, from the
// Jinja template in a checkpoint's tokenizer_config.json ("chat_template"), with a Jinja-subset
// interpreter of our own (no Python, no vendored Jinja). The subset is what real Hugging Face chat
// templates use (Qwen3's first): it must render them byte-for-byte as transformers'
// apply_chat_template does (jinja2 with trim_blocks and lstrip_blocks, loopcontrols, tojson with
// ensure_ascii=False, raise_exception, strftime_now).
#pragma once

#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

namespace moebius::chat {

struct RenderOptions {
  bool add_generation_prompt = true;
  // Passed to the template as `enable_thinking` when set; undefined in the template otherwise
  // (Qwen3's template treats undefined as true).
  std::optional<bool> enable_thinking;
  // OpenAI-style tool definitions, passed as `tools` (None when null, as transformers does).
  nlohmann::ordered_json tools = nullptr;
};

class ChatTemplate {
 public:
  // Parses the template source. Throws moebius::Error naming the line and column of a syntax
  // error or of a construct outside the supported subset.
  static ChatTemplate parse(const std::string& source);
  // Reads tokenizer_config.json: "chat_template" as a string, or the list form
  // [{"name": "default", "template": ...}, ...] (the "default" entry). bos_token and eos_token,
  // when present, become template variables. Throws moebius::Error when the file has no template.
  static ChatTemplate from_tokenizer_config(const std::string& path);

  // messages: the OpenAI "messages" array (role, content, optional reasoning_content, tool_calls,
  // ...). Throws moebius::Error for a template error at render time (raise_exception, type errors,
  // attribute access on an undefined value, as jinja2's default Undefined) with the message the
  // template gave. ordered_json because key order shows: `tool | tojson` prints a dict's keys in
  // the request's order, as Python does; a plain nlohmann::json converts implicitly but arrives
  // with its keys sorted.
  std::string render(const nlohmann::ordered_json& messages, const RenderOptions& options = {}) const;

  // The template's text (the server reads which output formats it teaches, e.g. <tool_call>).
  const std::string& source() const;

  ChatTemplate(ChatTemplate&&) noexcept;
  ChatTemplate& operator=(ChatTemplate&&) noexcept;
  ~ChatTemplate();

 private:
  struct Impl;
  explicit ChatTemplate(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  nlohmann::json globals_;  // bos_token, eos_token
};

}  // namespace moebius::chat
