// Attribute and item access, slicing, iteration, Python's str/dict/list methods, and the globals.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <optional>
#include <unordered_map>

#include "chat/jinja_builtins.h"
#include "chat/jinja_eval.h"

namespace moebius::chat::jinja {

// ---------------------------------------------------------------------------------------------
// Helpers shared with jinja_filters.cpp
// ---------------------------------------------------------------------------------------------
Params::Params(const CallArgs& args, std::string_view function, std::initializer_list<std::string_view> names)
    : given_(names.size(), nullptr) {
  if (args.positional.size() > names.size())
    fail(std::string(function) + "() takes at most " + std::to_string(names.size()) + " argument(s) (" +
         std::to_string(args.positional.size()) + " given)");
  for (size_t i = 0; i < args.positional.size(); ++i) given_[i] = &args.positional[i];
  for (const auto& [k, v] : args.keyword) {
    auto it = std::find(names.begin(), names.end(), k);
    if (it == names.end()) fail(std::string(function) + "() got an unexpected keyword argument '" + k + "'");
    const auto i = static_cast<size_t>(it - names.begin());
    if (given_[i] != nullptr) fail(std::string(function) + "() got multiple values for argument '" + k + "'");
    given_[i] = &v;
  }
}

const Value& Params::get(size_t i) const {
  static const Value kUndefined = Value::undefined("missing argument");
  return given_[i] != nullptr ? *given_[i] : kUndefined;
}

std::string to_lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  return out;
}

std::string to_upper(std::string_view s) {
  std::string out(s);
  for (char& c : out) if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 'a' + 'A');
  return out;
}

std::vector<std::string> split_lines(std::string_view s) {
  // Python's line boundaries: \n \r \r\n \v \f \x1c \x1d \x1e \x85 \u2028 \u2029.
  std::vector<std::string> lines;
  std::string cur;
  const auto cps = code_points(s);
  for (size_t i = 0; i < cps.size(); ++i) {
    const std::string_view c = cps[i];
    const bool brk = c == "\n" || c == "\r" || c == "\v" || c == "\f" || c == "\x1c" || c == "\x1d" ||
                     c == "\x1e" || c == "\xc2\x85" || c == "\xe2\x80\xa8" || c == "\xe2\x80\xa9";
    if (!brk) { cur.append(c); continue; }
    if (c == "\r" && i + 1 < cps.size() && cps[i + 1] == "\n") ++i;
    lines.push_back(std::move(cur));
    cur.clear();
  }
  if (!cur.empty()) lines.push_back(std::move(cur));
  return lines;
}

std::vector<std::string> split_whitespace(std::string_view s, int64_t maxsplit) {
  std::vector<std::string> out;
  const auto cps = code_points(s);
  size_t i = 0;
  while (true) {
    while (i < cps.size() && is_space(cps[i])) ++i;
    if (i == cps.size()) break;
    if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {  // the rest, as it is
      out.emplace_back(s.substr(static_cast<size_t>(cps[i].data() - s.data())));
      break;
    }
    std::string word;
    while (i < cps.size() && !is_space(cps[i])) word.append(cps[i++]);
    out.push_back(std::move(word));
  }
  return out;
}

namespace {

Value str_list(std::vector<std::string> parts) {
  std::vector<Value> items;
  items.reserve(parts.size());
  for (auto& p : parts) items.push_back(Value::string(std::move(p)));
  return Value::list(std::move(items));
}

const std::string& need_string(const Value& v, const char* what) {
  if (!v.is_string()) fail(std::string(what) + " must be str, not " + v.type_name());
  return v.as_string();
}

int64_t need_int(const Value& v, const char* what) {
  if (!v.is_int()) fail(std::string(what) + " must be an integer, not " + v.type_name());
  return v.as_int();
}

// Byte offset -> code point index, for find/index.
int64_t cp_index(std::string_view s, size_t byte) { return static_cast<int64_t>(code_point_count(s.substr(0, byte))); }

// ---------------------------------------------------------------------------------------------
// str methods
// ---------------------------------------------------------------------------------------------
using Method = Value (*)(const Value& self, const CallArgs& args, Context& ctx);

bool affix_match(const Value& self, const CallArgs& args, const char* name, bool prefix) {
  Params p(args, name, {"prefix"});
  if (!p.has(0)) fail(std::string(name) + "() takes at least 1 argument");
  const std::string& s = self.as_string();
  auto one = [&](const Value& a) {
    const std::string& x = need_string(a, name);
    if (x.size() > s.size()) return false;
    return prefix ? s.compare(0, x.size(), x) == 0 : s.compare(s.size() - x.size(), x.size(), x) == 0;
  };
  const Value& a = p.get(0);
  if (a.is_list() && a.as_list().tuple) {
    for (const auto& x : a.as_list().items) if (one(x)) return true;
    return false;
  }
  return one(a);
}

Value m_startswith(const Value& self, const CallArgs& a, Context&) { return Value::boolean(affix_match(self, a, "startswith", true)); }
Value m_endswith(const Value& self, const CallArgs& a, Context&) { return Value::boolean(affix_match(self, a, "endswith", false)); }

Value split_impl(const Value& self, const CallArgs& args, Context& ctx, bool from_right) {
  Params p(args, from_right ? "rsplit" : "split", {"sep", "maxsplit"});
  const std::string& s = self.as_string();
  ctx.budget().charge(s.size());
  const int64_t maxsplit = p.has(1) ? need_int(p.get(1), "maxsplit") : -1;
  if (!p.has(0) || p.get(0).is_none()) {
    if (!from_right) return str_list(split_whitespace(s, maxsplit));
    // rsplit(None): split_whitespace on the reversed code points, then reverse back.
    auto cps = code_points(s);
    std::string rev;
    for (auto it = cps.rbegin(); it != cps.rend(); ++it) rev.append(*it);
    auto parts = split_whitespace(rev, maxsplit);
    std::reverse(parts.begin(), parts.end());
    for (auto& part : parts) {
      auto pc = code_points(part);
      std::string back;
      for (auto it = pc.rbegin(); it != pc.rend(); ++it) back.append(*it);
      part = std::move(back);
    }
    return str_list(std::move(parts));
  }
  const std::string& sep = need_string(p.get(0), "sep");
  if (sep.empty()) fail("empty separator");
  std::vector<std::string> parts;
  if (!from_right) {
    size_t start = 0;
    while (true) {
      const size_t at = s.find(sep, start);
      if (at == std::string::npos || (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit)) break;
      parts.push_back(s.substr(start, at - start));
      start = at + sep.size();
    }
    parts.push_back(s.substr(start));
  } else {
    size_t end = s.size();
    while (true) {
      if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) break;
      if (end < sep.size()) break;
      const size_t at = s.rfind(sep, end - sep.size());
      if (at == std::string::npos) break;
      parts.push_back(s.substr(at + sep.size(), end - at - sep.size()));
      end = at;
    }
    parts.push_back(s.substr(0, end));
    std::reverse(parts.begin(), parts.end());
  }
  return str_list(std::move(parts));
}

Value m_split(const Value& self, const CallArgs& a, Context& c) { return split_impl(self, a, c, false); }
Value m_rsplit(const Value& self, const CallArgs& a, Context& c) { return split_impl(self, a, c, true); }

Value strip_impl(const Value& self, const CallArgs& args, const char* name, bool left, bool right) {
  Params p(args, name, {"chars"});
  const std::string* chars = nullptr;
  if (p.has(0) && !p.get(0).is_none()) chars = &need_string(p.get(0), "chars");
  return Value::string(std::string(strip(self.as_string(), chars, left, right)));
}

Value m_strip(const Value& s, const CallArgs& a, Context&) { return strip_impl(s, a, "strip", true, true); }
Value m_lstrip(const Value& s, const CallArgs& a, Context&) { return strip_impl(s, a, "lstrip", true, false); }
Value m_rstrip(const Value& s, const CallArgs& a, Context&) { return strip_impl(s, a, "rstrip", false, true); }

Value m_lower(const Value& s, const CallArgs& a, Context&) { Params(a, "lower", {}); return Value::string(to_lower(s.as_string())); }
Value m_upper(const Value& s, const CallArgs& a, Context&) { Params(a, "upper", {}); return Value::string(to_upper(s.as_string())); }

Value m_title(const Value& self, const CallArgs& a, Context&) {
  Params(a, "title", {});
  std::string out = self.as_string();
  bool prev_cased = false;
  for (char& c : out) {
    const bool lower = c >= 'a' && c <= 'z', upper = c >= 'A' && c <= 'Z';
    if (lower && !prev_cased) c = static_cast<char>(c - 'a' + 'A');
    else if (upper && prev_cased) c = static_cast<char>(c - 'A' + 'a');
    prev_cased = lower || upper;
  }
  return Value::string(std::move(out));
}

Value m_capitalize(const Value& self, const CallArgs& a, Context&) {
  Params(a, "capitalize", {});
  std::string out = to_lower(self.as_string());
  if (!out.empty() && out[0] >= 'a' && out[0] <= 'z') out[0] = static_cast<char>(out[0] - 'a' + 'A');
  return Value::string(std::move(out));
}

Value m_replace(const Value& self, const CallArgs& args, Context& ctx) {
  Params p(args, "replace", {"old", "new", "count"});
  const std::string& s = self.as_string();
  const std::string& old = need_string(p.get(0), "old");
  const std::string& rep = need_string(p.get(1), "new");
  int64_t count = p.has(2) ? need_int(p.get(2), "count") : -1;
  std::string out;
  if (old.empty()) {  // Python inserts `new` around every code point
    for (std::string_view cp : code_points(s)) {
      if (count != 0) { append_text(out, rep, ctx.budget()); --count; }
      append_text(out, cp, ctx.budget());
    }
    if (count != 0) append_text(out, rep, ctx.budget());
    return Value::string(std::move(out));
  }
  size_t start = 0;
  while (count != 0) {
    const size_t at = s.find(old, start);
    if (at == std::string::npos) break;
    append_text(out, std::string_view(s).substr(start, at - start), ctx.budget());
    append_text(out, rep, ctx.budget());
    start = at + old.size();
    --count;
  }
  append_text(out, std::string_view(s).substr(start), ctx.budget());
  return Value::string(std::move(out));
}

Value find_impl(const Value& self, const CallArgs& args, const char* name, bool from_right, bool must) {
  Params p(args, name, {"sub"});
  const std::string& s = self.as_string();
  const std::string& sub = need_string(p.get(0), "sub");
  const size_t at = from_right ? s.rfind(sub) : s.find(sub);
  if (at == std::string::npos) {
    if (must) fail("substring not found");
    return Value::integer(-1);
  }
  return Value::integer(cp_index(s, at));
}

Value m_find(const Value& s, const CallArgs& a, Context&) { return find_impl(s, a, "find", false, false); }
Value m_rfind(const Value& s, const CallArgs& a, Context&) { return find_impl(s, a, "rfind", true, false); }
Value m_index_str(const Value& s, const CallArgs& a, Context&) { return find_impl(s, a, "index", false, true); }

Value m_count_str(const Value& self, const CallArgs& args, Context&) {
  Params p(args, "count", {"sub"});
  const std::string& s = self.as_string();
  const std::string& sub = need_string(p.get(0), "sub");
  if (sub.empty()) return Value::integer(static_cast<int64_t>(code_point_count(s)) + 1);
  int64_t n = 0;
  for (size_t at = s.find(sub); at != std::string::npos; at = s.find(sub, at + sub.size())) ++n;
  return Value::integer(n);
}

Value m_join(const Value& self, const CallArgs& args, Context& ctx) {
  Params p(args, "join", {"iterable"});
  std::string out;
  bool first = true;
  size_t i = 0;
  for (const Value& v : iterate(p.get(0))) {
    if (!v.is_string()) fail("sequence item " + std::to_string(i) + ": expected str instance, " + v.type_name() + " found");
    if (!first) append_text(out, self.as_string(), ctx.budget());
    first = false;
    append_text(out, v.as_string(), ctx.budget());
    ++i;
  }
  return Value::string(std::move(out));
}

Value m_splitlines(const Value& self, const CallArgs& a, Context&) {
  Params(a, "splitlines", {});
  return str_list(split_lines(self.as_string()));
}

template <bool (*Pred)(std::string_view)>
Value char_class(const Value& self, const CallArgs& a, Context&) {
  Params(a, "is...", {});
  const auto cps = code_points(self.as_string());
  if (cps.empty()) return Value::boolean(false);
  for (auto cp : cps) if (!Pred(cp)) return Value::boolean(false);
  return Value::boolean(true);
}
bool cp_digit(std::string_view c) { return c.size() == 1 && c[0] >= '0' && c[0] <= '9'; }
bool cp_alpha(std::string_view c) { return c.size() == 1 && ((c[0] | 0x20) >= 'a' && (c[0] | 0x20) <= 'z'); }
bool cp_alnum(std::string_view c) { return cp_digit(c) || cp_alpha(c); }

Value case_check(const Value& self, bool want_lower) {
  // Python: at least one cased character, and none of the other case.
  bool cased = false;
  for (char c : self.as_string()) {
    if (c >= 'a' && c <= 'z') { if (!want_lower) return Value::boolean(false); cased = true; }
    if (c >= 'A' && c <= 'Z') { if (want_lower) return Value::boolean(false); cased = true; }
  }
  return Value::boolean(cased);
}
Value m_islower(const Value& s, const CallArgs& a, Context&) { Params(a, "islower", {}); return case_check(s, true); }
Value m_isupper(const Value& s, const CallArgs& a, Context&) { Params(a, "isupper", {}); return case_check(s, false); }

const std::unordered_map<std::string, Method>& str_methods() {
  static const std::unordered_map<std::string, Method> m = {
      {"startswith", m_startswith}, {"endswith", m_endswith}, {"split", m_split}, {"rsplit", m_rsplit},
      {"strip", m_strip}, {"lstrip", m_lstrip}, {"rstrip", m_rstrip}, {"lower", m_lower}, {"upper", m_upper},
      {"title", m_title}, {"capitalize", m_capitalize}, {"replace", m_replace}, {"find", m_find},
      {"rfind", m_rfind}, {"index", m_index_str}, {"count", m_count_str}, {"join", m_join},
      {"splitlines", m_splitlines}, {"isdigit", char_class<cp_digit>}, {"isalpha", char_class<cp_alpha>},
      {"isalnum", char_class<cp_alnum>}, {"isspace", char_class<is_space>}, {"islower", m_islower},
      {"isupper", m_isupper},
  };
  return m;
}

// ---------------------------------------------------------------------------------------------
// dict and list methods
// ---------------------------------------------------------------------------------------------
Value m_items(const Value& self, const CallArgs& a, Context&) {
  Params(a, "items", {});
  std::vector<Value> out;
  for (const auto& [k, v] : self.as_dict().entries()) out.push_back(Value::list({Value::string(k), v}, true));
  return Value::list(std::move(out));
}

Value m_keys(const Value& self, const CallArgs& a, Context&) {
  Params(a, "keys", {});
  std::vector<Value> out;
  for (const auto& e : self.as_dict().entries()) out.push_back(Value::string(e.first));
  return Value::list(std::move(out));
}

Value m_values(const Value& self, const CallArgs& a, Context&) {
  Params(a, "values", {});
  std::vector<Value> out;
  for (const auto& e : self.as_dict().entries()) out.push_back(e.second);
  return Value::list(std::move(out));
}

Value m_get(const Value& self, const CallArgs& args, Context&) {
  Params p(args, "get", {"key", "default"});
  if (!p.has(0)) fail("get expected at least 1 argument, got 0");
  const Value* v = p.get(0).is_string() ? self.as_dict().find(p.get(0).as_string()) : nullptr;
  return v != nullptr ? *v : p.get_or(1, Value::none());
}

Value m_index_list(const Value& self, const CallArgs& args, Context&) {
  Params p(args, "index", {"value"});
  const auto& items = self.as_list().items;
  for (size_t i = 0; i < items.size(); ++i)
    if (equal(items[i], p.get(0))) return Value::integer(static_cast<int64_t>(i));
  fail("value is not in list");
}

Value m_count_list(const Value& self, const CallArgs& args, Context&) {
  Params p(args, "count", {"value"});
  int64_t n = 0;
  for (const auto& v : self.as_list().items) n += equal(v, p.get(0)) ? 1 : 0;
  return Value::integer(n);
}

const std::unordered_map<std::string, Method>& dict_methods() {
  static const std::unordered_map<std::string, Method> m = {
      {"items", m_items}, {"keys", m_keys}, {"values", m_values}, {"get", m_get}};
  return m;
}

const std::unordered_map<std::string, Method>& list_methods() {
  static const std::unordered_map<std::string, Method> m = {{"index", m_index_list}, {"count", m_count_list}};
  return m;
}

// Methods that would modify their object: HF's ImmutableSandboxedEnvironment refuses them.
bool is_mutator(Type t, const std::string& name) {
  static const char* const kList[] = {"append", "extend", "insert", "pop", "remove", "reverse", "sort", "clear"};
  static const char* const kDict[] = {"pop", "popitem", "setdefault", "update", "clear"};
  if (t == Type::List) return std::find(std::begin(kList), std::end(kList), name) != std::end(kList);
  if (t == Type::Dict) return std::find(std::begin(kDict), std::end(kDict), name) != std::end(kDict);
  return false;
}

Value bind(const Value& self, const std::string& name, Method m) {
  return Value::function(std::make_shared<const Function>(
      Function{name, [self, m](const CallArgs& a, Context& ctx) { return m(self, a, ctx); }}));
}

Value no_attribute(const Value& obj, const std::string& name) {
  return Value::undefined(std::string("'") + obj.type_name() + " object' has no attribute '" + name + "'");
}

std::optional<Value> method_of(const Value& obj, const std::string& name) {
  const std::unordered_map<std::string, Method>* table = nullptr;
  if (obj.is_string()) table = &str_methods();
  else if (obj.is_dict()) table = &dict_methods();
  else if (obj.is_list()) table = &list_methods();
  if (table != nullptr) {
    auto it = table->find(name);
    if (it != table->end()) return bind(obj, name, it->second);
  }
  if (is_mutator(obj.type(), name))
    return Value::undefined("access to attribute '" + name + "' of '" + obj.type_name() + "' object is unsafe.");
  return std::nullopt;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Access
// ---------------------------------------------------------------------------------------------
Value get_attr(const Value& obj, const std::string& name) {
  if (obj.is_undefined()) obj.fail_undefined();
  if (auto m = method_of(obj, name)) return *m;
  if (obj.is_dict()) {
    if (const Value* v = obj.as_dict().find(name)) return *v;
  } else if (obj.type() == Type::Namespace) {
    if (const Value* v = obj.as_namespace().attrs.find(name)) return *v;
  }
  return no_attribute(obj, name);
}

Value get_item(const Value& obj, const Value& key) {
  if (obj.is_undefined()) obj.fail_undefined();
  if (key.is_int() && (obj.is_list() || obj.is_string())) {
    int64_t i = key.as_int();
    if (obj.is_list()) {
      const auto n = static_cast<int64_t>(obj.as_list().items.size());
      if (i < 0) i += n;
      if (i >= 0 && i < n) return obj.as_list().items[static_cast<size_t>(i)];
      return Value::undefined(std::string(obj.type_name()) + " object has no element " + std::to_string(key.as_int()));
    }
    const auto cps = code_points(obj.as_string());
    const auto n = static_cast<int64_t>(cps.size());
    if (i < 0) i += n;
    if (i >= 0 && i < n) return Value::string(std::string(cps[static_cast<size_t>(i)]));
    return Value::undefined("str object has no element " + std::to_string(key.as_int()));
  }
  if (key.is_string()) {
    if (obj.is_dict())
      if (const Value* v = obj.as_dict().find(key.as_string())) return *v;
    return get_attr(obj, key.as_string());
  }
  return Value::undefined(std::string(obj.type_name()) + " object has no element");
}

Value slice(const Value& obj, const Value* start, const Value* stop, const Value* step, Budget& budget) {
  if (obj.is_undefined()) obj.fail_undefined();
  auto part = [](const Value* v, bool& bad) -> std::optional<int64_t> {
    if (v == nullptr || v->is_none()) return std::nullopt;
    if (!v->is_int()) { bad = true; return std::nullopt; }
    return v->as_int();
  };
  bool bad = false;
  const auto b = part(start, bad), e = part(stop, bad), s = part(step, bad);
  if (bad) fail("slice indices must be integers or None or have an __index__ method");
  // Python raises TypeError, which jinja2's getitem turns into Undefined.
  if (!(obj.is_list() || obj.is_string())) return Value::undefined("object cannot be sliced");
  const int64_t st = s.value_or(1);
  if (st == 0) fail("slice step cannot be zero");
  std::vector<std::string_view> cps;
  if (obj.is_string()) cps = code_points(obj.as_string());
  const int64_t n = obj.is_string() ? static_cast<int64_t>(cps.size()) : static_cast<int64_t>(obj.as_list().items.size());
  // Python's PySlice_AdjustIndices.
  auto adjust = [&](std::optional<int64_t> v, int64_t dflt) {
    if (!v) return dflt;
    int64_t x = *v;
    if (x < 0) {
      x += n;
      if (x < 0) x = st < 0 ? -1 : 0;
    } else if (x >= n) {
      x = st < 0 ? n - 1 : n;
    }
    return x;
  };
  const int64_t from = adjust(b, st < 0 ? n - 1 : 0);
  const int64_t to = adjust(e, st < 0 ? -1 : n);
  int64_t count = 0;
  if (st > 0 && from < to) count = (to - from - 1) / st + 1;
  if (st < 0 && from > to) count = st == INT64_MIN ? 1 : (from - to - 1) / (-st) + 1;
  if (obj.is_string()) {
    std::string out;
    for (int64_t k = 0; k < count; ++k) append_text(out, cps[static_cast<size_t>(from + k * st)], budget);
    return Value::string(std::move(out));
  }
  budget.charge(static_cast<size_t>(count) * sizeof(Value));
  std::vector<Value> items;
  items.reserve(static_cast<size_t>(count));
  for (int64_t k = 0; k < count; ++k) items.push_back(obj.as_list().items[static_cast<size_t>(from + k * st)]);
  return Value::list(std::move(items), obj.as_list().tuple);
}

std::vector<Value> iterate(const Value& v) {
  switch (v.type()) {
    case Type::Undefined: return {};
    case Type::List: return v.as_list().items;
    case Type::Dict: {
      std::vector<Value> keys;
      keys.reserve(v.as_dict().size());
      for (const auto& e : v.as_dict().entries()) keys.push_back(Value::string(e.first));
      return keys;
    }
    case Type::String: {
      std::vector<Value> chars;
      for (std::string_view cp : code_points(v.as_string())) chars.push_back(Value::string(std::string(cp)));
      return chars;
    }
    default: fail(std::string("'") + v.type_name() + "' object is not iterable");
  }
}

Value percent_format(const std::string& fmt, const Value& args, Budget& budget) {
  std::vector<Value> positional;
  const Dict* mapping = nullptr;
  if (args.is_list() && args.as_list().tuple) positional = args.as_list().items;
  else if (args.is_dict()) mapping = &args.as_dict();
  else positional.push_back(args);
  size_t next = 0;
  std::string out;
  for (size_t i = 0; i < fmt.size(); ++i) {
    if (fmt[i] != '%') { out += fmt[i]; continue; }
    if (++i >= fmt.size()) fail("incomplete format");
    const Value* arg = nullptr;
    if (fmt[i] == '(') {
      const size_t close = fmt.find(')', i);
      if (close == std::string::npos) fail("incomplete format key");
      if (mapping == nullptr) fail("format requires a mapping");
      arg = mapping->find(fmt.substr(i + 1, close - i - 1));
      if (arg == nullptr) fail("KeyError: '" + fmt.substr(i + 1, close - i - 1) + "'");
      i = close + 1;
    }
    std::string flags;
    while (i < fmt.size() && std::string_view("-+ #0").find(fmt[i]) != std::string_view::npos) flags += fmt[i++];
    int width = 0, precision = -1;
    while (i < fmt.size() && fmt[i] >= '0' && fmt[i] <= '9') width = std::min(width * 10 + (fmt[i++] - '0'), 100000);
    if (i < fmt.size() && fmt[i] == '.') {
      precision = 0;
      ++i;
      while (i < fmt.size() && fmt[i] >= '0' && fmt[i] <= '9') precision = std::min(precision * 10 + (fmt[i++] - '0'), 1000);
    }
    if (i >= fmt.size()) fail("incomplete format");
    const char conv = fmt[i];
    if (conv == '%') { out += '%'; continue; }
    if (arg == nullptr) {
      if (mapping != nullptr || next >= positional.size()) fail("not enough arguments for format string");
      arg = &positional[next++];
    }
    std::string text;
    const bool left = flags.find('-') != std::string::npos;
    bool numeric = false;
    if (conv == 's' || conv == 'r') {
      text = conv == 's' ? to_str(*arg, budget) : [&] { std::string r; append_repr(r, *arg, budget); return r; }();
      if (precision >= 0) {
        const auto cps = code_points(text);
        if (cps.size() > static_cast<size_t>(precision)) {
          std::string cut;
          for (int k = 0; k < precision; ++k) cut.append(cps[static_cast<size_t>(k)]);
          text = std::move(cut);
        }
      }
    } else if (std::string_view("diouxXeEfFgGc").find(conv) != std::string_view::npos) {
      if (!arg->is_number()) fail(std::string("%") + conv + " format: a real number is required, not " + arg->type_name());
      numeric = true;
      std::string spec = "%" + flags;
      if (precision >= 0) spec += "." + std::to_string(precision);
      char buf[1200];
      if (conv == 'd' || conv == 'i' || conv == 'u' || conv == 'o' || conv == 'x' || conv == 'X' || conv == 'c') {
        const long long v = arg->is_int() ? arg->as_int() : static_cast<long long>(std::trunc(arg->as_double()));
        if (conv == 'c') { text = std::string(1, static_cast<char>(v)); numeric = false; }
        else {
          spec += std::string("ll") + (conv == 'i' || conv == 'u' ? 'd' : conv);
          std::snprintf(buf, sizeof buf, spec.c_str(), v);
          text = buf;
        }
      } else {
        spec += conv;
        std::snprintf(buf, sizeof buf, spec.c_str(), arg->as_double());
        text = buf;
      }
    } else {
      fail(std::string("unsupported format character '") + conv + "'");
    }
    const size_t len = code_point_count(text);
    if (static_cast<size_t>(width) > len) {
      const std::string pad(static_cast<size_t>(width) - len, ' ');
      if (left) text += pad;
      else if (numeric && flags.find('0') != std::string::npos) {
        const size_t sign = !text.empty() && (text[0] == '-' || text[0] == '+' || text[0] == ' ') ? 1 : 0;
        text.insert(sign, std::string(pad.size(), '0'));
      } else text = pad + text;
    }
    append_text(out, text, budget);
  }
  if (mapping == nullptr && next < positional.size()) fail("not all arguments converted during string formatting");
  return Value::string(std::move(out));
}

// ---------------------------------------------------------------------------------------------
// Globals
// ---------------------------------------------------------------------------------------------
namespace {

Value g_range(const CallArgs& a, Context&) {
  if (!a.keyword.empty()) fail("range() takes no keyword arguments");
  if (a.positional.empty() || a.positional.size() > 3)
    fail("range expected 1 to 3 arguments, got " + std::to_string(a.positional.size()));
  int64_t v[3] = {0, 0, 1};
  for (size_t i = 0; i < a.positional.size(); ++i) v[i] = need_int(a.positional[i], "range() argument");
  int64_t start = 0, stop = v[0], step = 1;
  if (a.positional.size() >= 2) { start = v[0]; stop = v[1]; }
  if (a.positional.size() == 3) step = v[2];
  if (step == 0) fail("range() arg 3 must not be zero");
  // jinja2's sandbox refuses ranges longer than MAX_RANGE (100000); so do we, before allocating.
  uint64_t len = 0;
  if (step > 0 && start < stop) {
    const uint64_t diff = static_cast<uint64_t>(stop) - static_cast<uint64_t>(start);
    const auto ustep = static_cast<uint64_t>(step);
    len = diff / ustep + (diff % ustep != 0);
  } else if (step < 0 && start > stop) {
    const uint64_t diff = static_cast<uint64_t>(start) - static_cast<uint64_t>(stop);
    const uint64_t ustep = step == INT64_MIN ? (uint64_t{1} << 63) : static_cast<uint64_t>(-step);
    len = diff / ustep + (diff % ustep != 0);
  }
  if (len > 100000) fail("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
  std::vector<Value> items;
  items.reserve(len);
  for (uint64_t k = 0; k < len; ++k) items.push_back(Value::integer(start + static_cast<int64_t>(k) * step));
  return Value::list(std::move(items));
}

Dict dict_from(const CallArgs& a, const char* name) {
  if (a.positional.size() > 1) fail(std::string(name) + "() takes at most 1 positional argument");
  Dict d;
  if (!a.positional.empty()) {
    const Value& src = a.positional[0];
    if (src.is_dict()) {
      for (const auto& [k, v] : src.as_dict().entries()) d.set(k, v);
    } else {
      for (const Value& pair : iterate(src)) {
        const auto kv = iterate(pair);
        if (kv.size() != 2 || !kv[0].is_string()) fail(std::string(name) + "(): expected (str, value) pairs");
        d.set(kv[0].as_string(), kv[1]);
      }
    }
  }
  for (const auto& [k, v] : a.keyword) d.set(k, v);
  return d;
}

Value g_dict(const CallArgs& a, Context&) { return Value::dict(dict_from(a, "dict")); }

Value g_namespace(const CallArgs& a, Context&) {
  auto ns = std::make_shared<Namespace>();
  ns->attrs = dict_from(a, "namespace");
  return Value::ns(std::move(ns));
}

Value g_raise_exception(const CallArgs& a, Context& ctx) {
  Params p(a, "raise_exception", {"message"});
  fail(to_str(p.get(0), ctx.budget()));
}

Value g_strftime_now(const CallArgs& a, Context& ctx) {
  Params p(a, "strftime_now", {"format"});
  const std::string& fmt = need_string(p.get(0), "format");
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  if (fmt.empty()) return Value::string("");
  // strftime has no way to ask for the size; grow until the text fits (or give up at 1 MiB).
  for (size_t cap = fmt.size() * 8 + 64; cap <= (size_t{1} << 20); cap *= 4) {
    std::string buf(cap, '\0');
    const size_t n = std::strftime(buf.data(), buf.size(), fmt.c_str(), &local);
    if (n > 0) {
      buf.resize(n);
      ctx.budget().charge(n);
      return Value::string(std::move(buf));
    }
  }
  return Value::string("");
}

void add(Dict& g, const char* name, Value (*fn)(const CallArgs&, Context&)) {
  g.set(name, Value::function(std::make_shared<const Function>(Function{name, fn})));
}

}  // namespace

void add_globals(Dict& globals) {
  add(globals, "range", g_range);
  add(globals, "dict", g_dict);
  add(globals, "namespace", g_namespace);
  add(globals, "raise_exception", g_raise_exception);
  add(globals, "strftime_now", g_strftime_now);
}

}  // namespace moebius::chat::jinja
