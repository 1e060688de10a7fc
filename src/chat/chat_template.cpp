#include "chat/chat_template.h"

#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "chat/jinja_builtins.h"
#include "chat/jinja_eval.h"
#include "chat/jinja_parser.h"
#include "core/error.h"
#include "core/json_depth.h"
#include "core/memory.h"

namespace moebius::chat {

struct ChatTemplate::Impl {
  jinja::Template tmpl;
  std::string source;
};

namespace {

Error template_error(const jinja::Failure& f) {
  if (f.line > 0) return Error::format("chat template, line {}, column {}: {}", f.line, f.column, f.message);
  return Error::format("chat template: {}", f.message);
}

// A special token in tokenizer_config.json: a string, or an AddedToken object {"content": ...}.
nlohmann::json token_text(const nlohmann::ordered_json& t) {
  if (t.is_string()) return t.get<std::string>();
  if (t.is_object() && t.contains("content") && t["content"].is_string()) return t["content"].get<std::string>();
  return nullptr;
}

}  // namespace

ChatTemplate::ChatTemplate(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;
ChatTemplate& ChatTemplate::operator=(ChatTemplate&&) noexcept = default;
ChatTemplate::~ChatTemplate() = default;

ChatTemplate ChatTemplate::parse(const std::string& source) {
  auto impl = std::make_unique<Impl>();
  try {
    impl->tmpl = jinja::parse(source);
  } catch (const jinja::Failure& f) {
    throw template_error(f);
  }
  impl->source = source;
  return ChatTemplate(std::move(impl));
}

ChatTemplate ChatTemplate::from_tokenizer_config(const std::string& path) {
  auto read = read_small_file(path);
  if (!read.ok()) throw std::move(read).error();
  const std::string& text = read.value();
  // [TAG_JSON_DEPTH] An ordered_json object copies its values when it grows (its pairs have a
  // const key), recursing once per level: a deeply nested file would overflow the stack in parse.
  if (Status depth = check_json_depth(text); !depth.ok()) throw std::move(depth).error().in_file(path);
  const auto cfg = nlohmann::ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (cfg.is_discarded() || !cfg.is_object()) throw Error("not a JSON object").in_file(path);
  if (!cfg.contains("chat_template")) throw Error("the file has no chat template").in_file(path).in_field("chat_template");
  const auto& ct = cfg["chat_template"];
  std::string source;
  if (ct.is_string()) {
    source = ct.get<std::string>();
  } else if (ct.is_array()) {  // [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
    for (const auto& e : ct)
      if (e.is_object() && e.value("name", "") == "default" && e.contains("template") && e["template"].is_string())
        source = e["template"].get<std::string>();
    if (source.empty()) throw Error("no template named 'default'").in_file(path).in_field("chat_template");
  } else {
    throw Error("expected a string or a list of named templates").in_file(path).in_field("chat_template");
  }
  ChatTemplate t = [&] {
    try {
      return parse(source);
    } catch (Error& e) {
      throw std::move(e).in_file(path).in_field("chat_template");
    }
  }();
  // transformers passes its special_tokens_map: the tokens that are set, by name.
  t.globals_ = nlohmann::json::object();
  for (const char* name : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"}) {
    if (!cfg.contains(name)) continue;
    nlohmann::json v = token_text(cfg[name]);
    if (!v.is_null()) t.globals_[name] = std::move(v);
  }
  if (cfg.contains("additional_special_tokens") && cfg["additional_special_tokens"].is_array()) {
    nlohmann::json list = nlohmann::json::array();
    for (const auto& e : cfg["additional_special_tokens"]) {
      nlohmann::json v = token_text(e);
      if (!v.is_null()) list.push_back(std::move(v));
    }
    if (!list.empty()) t.globals_["additional_special_tokens"] = std::move(list);
  }
  return t;
}

const std::string& ChatTemplate::source() const { return impl_->source; }

std::string ChatTemplate::render(const nlohmann::ordered_json& messages, const RenderOptions& options) const {
  if (!messages.is_array()) throw Error("messages must be a JSON array").in_field("messages");
  using jinja::Value;
  jinja::Dict vars;
  if (globals_.is_object())
    for (const auto& [k, v] : globals_.items()) vars.set(k, Value::from_json(nlohmann::ordered_json(v)));
  // The variables transformers' apply_chat_template passes to template.render().
  vars.set("messages", Value::from_json(messages));
  vars.set("tools", Value::from_json(options.tools));
  vars.set("documents", Value::none());
  vars.set("add_generation_prompt", Value::boolean(options.add_generation_prompt));
  if (options.enable_thinking.has_value()) vars.set("enable_thinking", Value::boolean(*options.enable_thinking));
  jinja::Dict globals;
  jinja::add_globals(globals);
  jinja::Context ctx(std::move(globals));
  try {
    return ctx.render(impl_->tmpl, vars);
  } catch (const jinja::Failure& f) {
    throw template_error(f);
  }
}

}  // namespace moebius::chat
