// jinja2's built-in filters and tests (the ones chat templates use), plus HF's tojson override:
// json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False), which, unlike
// jinja2's own tojson, does not HTML-escape.
#include <algorithm>
#include <charconv>
#include <cctype>
#include <cmath>
#include <optional>
#include <unordered_map>

#include "chat/jinja_builtins.h"
#include "chat/jinja_eval.h"

namespace moebius::chat::jinja {
namespace {

using Filter = Value (*)(Context& ctx, const Value& v, const CallArgs& args);
using Test = bool (*)(Context& ctx, const Value& v, const CallArgs& args);

std::string soft_str(const Value& v, Context& ctx) { return to_str(v, ctx.budget()); }

int64_t int_arg(const Value& v, const char* what) {
  if (!v.is_int()) fail(std::string(what) + " must be an integer, not " + v.type_name());
  return v.as_int();
}

// jinja2's make_attrgetter: "a.b.0" walks items/attributes, digits as list indices.
Value attribute_path(const Value& item, const Value& attribute) {
  if (attribute.is_int()) return get_item(item, attribute);
  if (!attribute.is_string()) fail("attribute must be a string or an integer");
  Value cur = item;
  std::string_view path = attribute.as_string();
  while (true) {
    const size_t dot = path.find('.');
    const std::string_view part = path.substr(0, dot);
    int64_t idx = 0;
    auto r = std::from_chars(part.data(), part.data() + part.size(), idx);
    const bool numeric = !part.empty() && r.ec == std::errc() && r.ptr == part.data() + part.size();
    cur = get_item(cur, numeric ? Value::integer(idx) : Value::string(std::string(part)));
    if (dot == std::string_view::npos) return cur;
    path.remove_prefix(dot + 1);
  }
}

// Sort/unique/min/max compare strings case-insensitively unless case_sensitive=true.
Value sort_key(const Value& v, bool case_sensitive) {
  if (!case_sensitive && v.is_string()) return Value::string(to_lower(v.as_string()));
  return v;
}

// ---------------------------------------------------------------------------------------------
// Filters
// ---------------------------------------------------------------------------------------------
Value f_abs(Context&, const Value& v, const CallArgs& a) {
  Params(a, "abs", {});
  if (v.is_int()) {
    if (v.as_int() == INT64_MIN) fail("integer overflow");
    return Value::integer(v.as_int() < 0 ? -v.as_int() : v.as_int());
  }
  if (v.is_number()) return Value::number(std::fabs(v.as_double()));
  if (v.is_undefined()) v.fail_undefined();
  fail(std::string("bad operand type for abs(): '") + v.type_name() + "'");
}

Value f_attr(Context&, const Value& v, const CallArgs& a) {
  Params p(a, "attr", {"name"});
  const Value& name = p.get(0);
  if (!name.is_string()) fail("attr name must be a string");
  // getattr only: a dict's keys are items, not attributes.
  if (v.is_dict()) {
    Value m = get_attr(Value::dict(Dict()), name.as_string());
    if (m.type() == Type::Function) return get_attr(v, name.as_string());
    return Value::undefined("'dict object' has no attribute '" + name.as_string() + "'");
  }
  return get_attr(v, name.as_string());
}

Value f_batch(Context& ctx, const Value& v, const CallArgs& a) {
  Params p(a, "batch", {"linecount", "fill_with"});
  const int64_t n = int_arg(p.get(0), "linecount");
  if (n <= 0) fail("batch size must be positive");
  std::vector<Value> out, cur;
  for (Value& item : iterate(v)) {
    cur.push_back(std::move(item));
    if (static_cast<int64_t>(cur.size()) == n) { out.push_back(Value::list(std::move(cur))); cur.clear(); }
  }
  if (!cur.empty()) {
    if (p.has(1) && !p.get(1).is_none())
      while (static_cast<int64_t>(cur.size()) < n) {
        ctx.budget().iteration();
        cur.push_back(p.get(1));
      }
    out.push_back(Value::list(std::move(cur)));
  }
  return Value::list(std::move(out));
}

Value f_capitalize(Context& ctx, const Value& v, const CallArgs& a) {
  Params(a, "capitalize", {});
  std::string s = to_lower(soft_str(v, ctx));
  if (!s.empty() && s[0] >= 'a' && s[0] <= 'z') s[0] = static_cast<char>(s[0] - 'a' + 'A');
  return Value::string(std::move(s));
}

Value f_center(Context& ctx, const Value& v, const CallArgs& a) {
  Params p(a, "center", {"width"});
  const std::string s = soft_str(v, ctx);
  const int64_t width = p.has(0) ? int_arg(p.get(0), "width") : 80;
  const auto len = static_cast<int64_t>(code_point_count(s));
  if (width <= len) return Value::string(s);
  ctx.budget().charge(static_cast<size_t>(width - len) + s.size());
  const int64_t marg = width - len;
  const int64_t left = marg / 2 + (marg & width & 1);  // Python's str.center
  return Value::string(std::string(static_cast<size_t>(left), ' ') + s + std::string(static_cast<size_t>(marg - left), ' '));
}

Value f_length(Context&, const Value& v, const CallArgs& a) {
  Params(a, "length", {});
  switch (v.type()) {
    case Type::Undefined: return Value::integer(0);
    case Type::String: return Value::integer(static_cast<int64_t>(code_point_count(v.as_string())));
    case Type::List: return Value::integer(static_cast<int64_t>(v.as_list().items.size()));
    case Type::Dict: return Value::integer(static_cast<int64_t>(v.as_dict().size()));
    case Type::Namespace: return Value::integer(static_cast<int64_t>(v.as_namespace().attrs.size()));
    default: fail(std::string("object of type '") + v.type_name() + "' has no len()");
  }
}

Value f_default(Context&, const Value& v, const CallArgs& a) {
  Params p(a, "default", {"default_value", "boolean"});
  const bool boolean = p.has(1) && p.get(1).truthy();
  if (v.is_undefined() || (boolean && !v.truthy())) return p.get_or(0, Value::string(""));
  return v;
}

Value pairs(const Value& v, const char* name) {
  if (v.is_undefined()) return Value::list({});
  if (!v.is_dict()) fail(std::string(name) + ": can only get item pairs from a mapping");
  std::vector<Value> out;
  for (const auto& [k, x] : v.as_dict().entries()) out.push_back(Value::list({Value::string(k), x}, true));
  return Value::list(std::move(out));
}

Value f_items(Context&, const Value& v, const CallArgs& a) {
  Params(a, "items", {});
  return pairs(v, "items");
}

Value f_dictsort(Context& ctx, const Value& v, const CallArgs& a) {
  Params p(a, "dictsort", {"case_sensitive", "by", "reverse"});
  const bool cs = p.has(0) && p.get(0).truthy();
  const std::string by = p.has(1) ? soft_str(p.get(1), ctx) : "key";
  Value items = pairs(v, "dictsort");
  if (by != "key" && by != "value") fail("You can only sort by either 'key' or 'value'");
  const size_t k = by == "key" ? 0 : 1;
  std::vector<Value> out = items.as_list().items;
  std::stable_sort(out.begin(), out.end(), [&](const Value& x, const Value& y) {
    return less(sort_key(x.as_list().items[k], cs), sort_key(y.as_list().items[k], cs));
  });
  if (p.has(2) && p.get(2).truthy()) std::reverse(out.begin(), out.end());
  return Value::list(std::move(out));
}

Value f_escape(Context& ctx, const Value& v, const CallArgs& a) {
  Params(a, "escape", {});
  std::string out;
  for (char c : soft_str(v, ctx)) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  ctx.budget().charge(out.size());
  return Value::string(std::move(out));
}

Value f_format(Context& ctx, const Value& v, const CallArgs& a) {
  if (!a.positional.empty() && !a.keyword.empty()) fail("format: can't handle positional and keyword arguments at the same time");
  if (!a.keyword.empty()) {
    Dict d;
    for (const auto& [k, x] : a.keyword) d.set(k, x);
    return percent_format(soft_str(v, ctx), Value::dict(std::move(d)), ctx.budget());
  }
  return percent_format(soft_str(v, ctx), Value::list(a.positional, /*tuple=*/true), ctx.budget());
}

Value f_first(Context&, const Value& v, const CallArgs& a) {
  Params(a, "first", {});
  if (v.is_list()) return v.as_list().items.empty() ? Value::undefined("No first item, sequence was empty.") : v.as_list().items.front();
  auto items = iterate(v);
  return items.empty() ? Value::undefined("No first item, sequence was empty.") : items.front();
}

Value f_last(Context&, const Value& v, const CallArgs& a) {
  Params(a, "last", {});
  if (v.is_list()) return v.as_list().items.empty() ? Value::undefined("No last item, sequence was empty.") : v.as_list().items.back();
  auto items = iterate(v);
  return items.empty() ? Value::undefined("No last item, sequence was empty.") : items.back();
}

// Python's float(str): surrounding whitespace, inf/nan, underscores between digits.
std::optional<double> parse_float(std::string_view s) {
  s = strip(s, nullptr, true, true);
  std::string t;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '_' && i > 0 && i + 1 < s.size() && std::isdigit(static_cast<unsigned char>(s[i - 1])) &&
        std::isdigit(static_cast<unsigned char>(s[i + 1]))) continue;
    t += s[i];
  }
  const std::string l = to_lower(t);
  const bool neg = !l.empty() && l[0] == '-';
  const std::string body = (!l.empty() && (l[0] == '-' || l[0] == '+')) ? l.substr(1) : l;
  if (body == "inf" || body == "infinity") return neg ? -HUGE_VAL : HUGE_VAL;
  if (body == "nan") return std::nan("");
  if (t.empty()) return std::nullopt;
  double d = 0;
  const char* b = t.data() + (t[0] == '+' ? 1 : 0);
  auto r = std::from_chars(b, t.data() + t.size(), d);
  if (r.ptr != t.data() + t.size()) return std::nullopt;
  if (r.ec == std::errc::result_out_of_range) return l.find("e-") != std::string::npos ? 0.0 : (neg ? -HUGE_VAL : HUGE_VAL);
  if (r.ec != std::errc()) return std::nullopt;
  return d;
}

Value f_float(Context&, const Value& v, const CallArgs& a) {
  Params p(a, "float", {"default"});
  if (v.is_number()) return Value::number(v.as_double());
  if (v.is_string())
    if (auto d = parse_float(v.as_string())) return Value::number(*d);
  return p.get_or(0, Value::number(0.0));
}

Value f_int(Context&, const Value& v, const CallArgs& a) {
  Params p(a, "int", {"default", "base"});
  const Value fallback = p.get_or(0, Value::integer(0));
  const int64_t base = p.has(1) ? int_arg(p.get(1), "base") : 10;
  auto from_double = [&](double d) {
    if (std::isnan(d)) return fallback;
    if (std::isinf(d) || std::fabs(d) >= 9.2e18) fail("cannot convert float to integer: out of range");
    return Value::integer(static_cast<int64_t>(d));
  };
  if (v.is_int()) return Value::integer(v.as_int());
  if (v.type() == Type::Float) return from_double(v.as_double());
  if (!v.is_string()) return fallback;
  std::string_view s = strip(v.as_string(), nullptr, true, true);
  if (base == 10 || base == 16 || base == 8 || base == 2) {
    std::string t;
    for (char c : s) if (c != '_') t += c;
    bool neg = false;
    size_t i = 0;
    if (!t.empty() && (t[0] == '-' || t[0] == '+')) { neg = t[0] == '-'; i = 1; }
    if (base != 10 && t.size() > i + 1 && t[i] == '0' && (t[i + 1] | 0x20) == (base == 16 ? 'x' : base == 8 ? 'o' : 'b')) i += 2;
    int64_t x = 0;
    auto r = std::from_chars(t.data() + i, t.data() + t.size(), x, static_cast<int>(base));
    if (i < t.size() && r.ec == std::errc() && r.ptr == t.data() + t.size()) return Value::integer(neg ? -x : x);
  }
  if (auto d = parse_float(s)) return from_double(*d);
  return fallback;
}

Value f_indent(Context& ctx, const Value& v, const CallArgs& a) {
  Params p(a, "indent", {"width", "first", "blank"});
  std::string ind;
  if (p.has(0) && p.get(0).is_string()) ind = p.get(0).as_string();
  else {
    const int64_t w = p.has(0) ? int_arg(p.get(0), "width") : 4;
    if (w > 0) {
      ctx.budget().check(static_cast<size_t>(w));
      ind.assign(static_cast<size_t>(w), ' ');
    }
  }
  const bool first = p.has(1) && p.get(1).truthy();
  const bool blank = p.has(2) && p.get(2).truthy();
  // jinja2 appends a newline before splitlines(), so a trailing newline yields an empty last line.
  const auto lines = split_lines(soft_str(v, ctx) + "\n");
  std::string out;
  for (size_t i = 0; i < lines.size(); ++i) {
    if (i > 0) {
      append_text(out, "\n", ctx.budget());
      if (blank || !lines[i].empty()) append_text(out, ind, ctx.budget());
    }
    append_text(out, lines[i], ctx.budget());
  }
  if (first) out = ind + out;
  return Value::string(std::move(out));
}

Value f_join(Context& ctx, const Value& v, const CallArgs& a) {
  Params p(a, "join", {"d", "attribute"});
  const std::string sep = p.has(0) ? soft_str(p.get(0), ctx) : "";
  std::string out;
  bool first = true;
  for (const Value& item : iterate(v)) {
    if (!first) append_text(out, sep, ctx.budget());
    first = false;
    append_str(out, p.has(1) && !p.get(1).is_none() ? attribute_path(item, p.get(1)) : item, ctx.budget());
  }
  return Value::string(std::move(out));
}

Value f_list(Context&, const Value& v, const CallArgs& a) {
  Params(a, "list", {});
  return Value::list(iterate(v));
}

Value f_lower(Context& ctx, const Value& v, const CallArgs& a) {
  Params(a, "lower", {});
  return Value::string(to_lower(soft_str(v, ctx)));
}

Value f_upper(Context& ctx, const Value& v, const CallArgs& a) {
  Params(a, "upper", {});
  return Value::string(to_upper(soft_str(v, ctx)));
}

Value f_title(Context& ctx, const Value& v, const CallArgs& a) {
  Params(a, "title", {});
  // jinja2's do_title: words start after runs of '-', whitespace, '(', '{', '[' or '<'.
  const std::string s = soft_str(v, ctx);
  std::string out;
  bool start = true;
  for (std::string_view cp : code_points(s)) {
    const bool delim = cp == "-" || cp == "(" || cp == "{" || cp == "[" || cp == "<" || is_space(cp);
    if (delim) { out.append(cp); start = true; continue; }
    out += start ? to_upper(cp) : to_lower(cp);
    start = false;
  }
  return Value::string(std::move(out));
}

Value aggregate(const Value& v, const CallArgs& a, const char* name, bool want_max) {
  Params p(a, name, {"case_sensitive", "attribute"});
  const bool cs = p.has(0) && p.get(0).truthy();
  auto key = [&](const Value& x) { return sort_key(p.has(1) && !p.get(1).is_none() ? attribute_path(x, p.get(1)) : x, cs); };
  auto items = iterate(v);
  if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
  size_t best = 0;
  for (size_t i = 1; i < items.size(); ++i) {
    const bool better = want_max ? less(key(items[best]), key(items[i])) : less(key(items[i]), key(items[best]));
    if (better) best = i;
  }
  return items[best];
}

Value f_max(Context&, const Value& v, const CallArgs& a) { return aggregate(v, a, "max", true); }
Value f_min(Context&, const Value& v, const CallArgs& a) { return aggregate(v, a, "min", false); }

Value f_replace(Context& ctx, const Value& v, const CallArgs& a) {
  Params p(a, "replace", {"old", "new", "count"});
  CallArgs m;
  m.positional = {Value::string(soft_str(p.get(0), ctx)), Value::string(soft_str(p.get(1), ctx))};
  if (p.has(2) && !p.get(2).is_none()) m.positional.push_back(p.get(2));
  return ctx.call(get_attr(Value::string(soft_str(v, ctx)), "replace"), m);
}

Value f_reverse(Context& ctx, const Value& v, const CallArgs& a) {
  Params(a, "reverse", {});
  if (v.is_string()) {
    const auto cps = code_points(v.as_string());
    std::string out;
    for (auto it = cps.rbegin(); it != cps.rend(); ++it) append_text(out, *it, ctx.budget());
    return Value::string(std::move(out));
  }
  auto items = iterate(v);
  std::reverse(items.begin(), items.end());
  return Value::list(std::move(items));
}

Value f_round(Context&, const Value& v, const CallArgs& a) {
  Params p(a, "round", {"precision", "method"});
  const int64_t precision = p.has(0) ? int_arg(p.get(0), "precision") : 0;
  const std::string method = p.has(1) && p.get(1).is_string() ? p.get(1).as_string() : "common";
  if (method != "common" && method != "ceil" && method != "floor")
    fail("method must be 'common', 'ceil' or 'floor'");
  if (!v.is_number()) fail(std::string("round: expected a number, got ") + v.type_name());
  if (v.is_int() && method == "common") return Value::integer(v.as_int());
  const double scale = std::pow(10.0, static_cast<double>(precision));
  const double x = v.as_double() * scale;
  const double r = method == "ceil" ? std::ceil(x) : method == "floor" ? std::floor(x) : std::nearbyint(x);
  return Value::number(r / scale);
}

Value f_safe(Context&, const Value& v, const CallArgs& a) {
  Params(a, "safe", {});
  return v;
}

Value f_sort(Context&, const Value& v, const CallArgs& a) {
  Params p(a, "sort", {"reverse", "case_sensitive", "attribute"});
  const bool rev = p.has(0) && p.get(0).truthy();
  const bool cs = p.has(1) && p.get(1).truthy();
  auto key = [&](const Value& x) { return sort_key(p.has(2) && !p.get(2).is_none() ? attribute_path(x, p.get(2)) : x, cs); };
  auto items = iterate(v);
  // stable_sort: Python's sort is stable, and an inconsistent order (NaN) cannot run out of bounds.
  std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
    return rev ? less(key(y), key(x)) : less(key(x), key(y));
  });
  return Value::list(std::move(items));
}

Value f_string(Context& ctx, const Value& v, const CallArgs& a) {
  Params(a, "string", {});
  return Value::string(soft_str(v, ctx));
}

Value f_sum(Context&, const Value& v, const CallArgs& a) {
  Params p(a, "sum", {"attribute", "start"});
  Value acc = p.get_or(1, Value::integer(0));
  for (const Value& item : iterate(v)) {
    const Value x = p.has(0) && !p.get(0).is_none() ? attribute_path(item, p.get(0)) : item;
    if (acc.is_int() && x.is_int()) {
      int64_t r = 0;
      if (__builtin_add_overflow(acc.as_int(), x.as_int(), &r)) fail("integer overflow");
      acc = Value::integer(r);
    } else if (acc.is_number() && x.is_number()) {
      acc = Value::number(acc.as_double() + x.as_double());
    } else {
      fail(std::string("unsupported operand type(s) for +: '") + acc.type_name() + "' and '" + x.type_name() + "'");
    }
  }
  return acc;
}

Value f_tojson(Context& ctx, const Value& v, const CallArgs& a) {
  Params p(a, "tojson", {"ensure_ascii", "indent", "separators", "sort_keys"});
  JsonOptions o;
  o.ensure_ascii = p.has(0) && p.get(0).truthy();
  if (p.has(1) && !p.get(1).is_none()) {
    o.has_indent = true;
    if (p.get(1).is_string()) o.indent = p.get(1).as_string();
    else {
      const int64_t n = int_arg(p.get(1), "indent");
      if (n > 0) {
        ctx.budget().check(static_cast<size_t>(n));
        o.indent.assign(static_cast<size_t>(n), ' ');
      }
    }
  }
  if (p.has(2) && !p.get(2).is_none()) {
    const auto seps = iterate(p.get(2));
    if (seps.size() != 2 || !seps[0].is_string() || !seps[1].is_string()) fail("tojson: separators must be a pair of strings");
    o.has_separators = true;
    o.item_separator = seps[0].as_string();
    o.key_separator = seps[1].as_string();
  }
  o.sort_keys = p.has(3) && p.get(3).truthy();
  std::string out;
  append_json(out, v, o, ctx.budget());
  return Value::string(std::move(out));
}

Value f_trim(Context& ctx, const Value& v, const CallArgs& a) {
  Params p(a, "trim", {"chars"});
  const std::string s = soft_str(v, ctx);
  const std::string* chars = nullptr;
  if (p.has(0) && !p.get(0).is_none()) {
    if (!p.get(0).is_string()) fail("trim: chars must be a string");
    chars = &p.get(0).as_string();
  }
  return Value::string(std::string(strip(s, chars, true, true)));
}

Value f_unique(Context&, const Value& v, const CallArgs& a) {
  Params p(a, "unique", {"case_sensitive", "attribute"});
  const bool cs = p.has(0) && p.get(0).truthy();
  std::vector<Value> out, seen;
  for (Value& item : iterate(v)) {
    Value k = sort_key(p.has(1) && !p.get(1).is_none() ? attribute_path(item, p.get(1)) : item, cs);
    if (std::any_of(seen.begin(), seen.end(), [&](const Value& s) { return equal(s, k); })) continue;
    seen.push_back(std::move(k));
    out.push_back(std::move(item));
  }
  return Value::list(std::move(out));
}

Value f_wordcount(Context& ctx, const Value& v, const CallArgs& a) {
  Params(a, "wordcount", {});
  return Value::integer(static_cast<int64_t>(split_whitespace(soft_str(v, ctx), -1).size()));
}

// map(attribute='x', default=...) or map('filter', args...).
Value f_map(Context& ctx, const Value& v, const CallArgs& a) {
  std::vector<Value> out;
  const Value* attribute = nullptr;
  const Value* fallback = nullptr;
  for (const auto& [k, x] : a.keyword) {
    if (k == "attribute") attribute = &x;
    else if (k == "default") fallback = &x;
  }
  if (attribute != nullptr) {
    for (const Value& item : iterate(v)) {
      Value x = attribute_path(item, *attribute);
      out.push_back(x.is_undefined() && fallback != nullptr ? *fallback : x);
    }
    return Value::list(std::move(out));
  }
  if (a.positional.empty() || !a.positional[0].is_string()) fail("map: expected a filter name or attribute=");
  CallArgs rest;
  rest.positional.assign(a.positional.begin() + 1, a.positional.end());
  rest.keyword = a.keyword;
  for (const Value& item : iterate(v)) out.push_back(apply_filter(ctx, a.positional[0].as_string(), item, rest));
  return Value::list(std::move(out));
}

// select/reject/selectattr/rejectattr: `by_attr` takes the attribute first, then the test.
Value select_impl(Context& ctx, const Value& v, const CallArgs& a, bool by_attr, bool keep) {
  size_t i = 0;
  const Value* attribute = nullptr;
  if (by_attr) {
    if (a.positional.empty()) fail("selectattr/rejectattr: missing attribute");
    attribute = &a.positional[i++];
  }
  std::string test;
  if (i < a.positional.size()) {
    if (!a.positional[i].is_string()) fail("select: the test name must be a string");
    test = a.positional[i++].as_string();
  }
  CallArgs rest;
  rest.positional.assign(a.positional.begin() + static_cast<std::ptrdiff_t>(i), a.positional.end());
  rest.keyword = a.keyword;
  std::vector<Value> out;
  for (Value& item : iterate(v)) {
    const Value x = attribute != nullptr ? attribute_path(item, *attribute) : item;
    const bool ok = test.empty() ? x.truthy() : apply_test(ctx, test, x, rest);
    if (ok == keep) out.push_back(std::move(item));
  }
  return Value::list(std::move(out));
}

Value f_select(Context& c, const Value& v, const CallArgs& a) { return select_impl(c, v, a, false, true); }
Value f_reject(Context& c, const Value& v, const CallArgs& a) { return select_impl(c, v, a, false, false); }
Value f_selectattr(Context& c, const Value& v, const CallArgs& a) { return select_impl(c, v, a, true, true); }
Value f_rejectattr(Context& c, const Value& v, const CallArgs& a) { return select_impl(c, v, a, true, false); }

const std::unordered_map<std::string_view, Filter>& filters() {
  static const std::unordered_map<std::string_view, Filter> m = {
      {"abs", f_abs}, {"attr", f_attr}, {"batch", f_batch}, {"capitalize", f_capitalize}, {"center", f_center},
      {"count", f_length}, {"length", f_length}, {"d", f_default}, {"default", f_default},
      {"dictsort", f_dictsort}, {"e", f_escape}, {"escape", f_escape}, {"forceescape", f_escape},
      {"first", f_first}, {"format", f_format}, {"last", f_last}, {"float", f_float}, {"int", f_int}, {"indent", f_indent},
      {"items", f_items}, {"join", f_join}, {"list", f_list}, {"lower", f_lower}, {"upper", f_upper},
      {"title", f_title}, {"map", f_map}, {"max", f_max}, {"min", f_min}, {"replace", f_replace},
      {"reverse", f_reverse}, {"round", f_round}, {"safe", f_safe}, {"select", f_select},
      {"reject", f_reject}, {"selectattr", f_selectattr}, {"rejectattr", f_rejectattr}, {"sort", f_sort},
      {"string", f_string}, {"sum", f_sum}, {"tojson", f_tojson}, {"trim", f_trim}, {"unique", f_unique},
      {"wordcount", f_wordcount},
  };
  return m;
}

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------
const Value& test_arg(const CallArgs& a, const char* name) {
  Params p(a, name, {"other"});
  if (!p.has(0)) fail(std::string("test '") + name + "' needs an argument");
  return p.get(0);
}

bool t_defined(Context&, const Value& v, const CallArgs&) { return !v.is_undefined(); }
bool t_undefined(Context&, const Value& v, const CallArgs&) { return v.is_undefined(); }
bool t_none(Context&, const Value& v, const CallArgs&) { return v.is_none(); }
bool t_boolean(Context&, const Value& v, const CallArgs&) { return v.type() == Type::Bool; }
bool t_true(Context&, const Value& v, const CallArgs&) { return v.type() == Type::Bool && v.as_bool(); }
bool t_false(Context&, const Value& v, const CallArgs&) { return v.type() == Type::Bool && !v.as_bool(); }
bool t_integer(Context&, const Value& v, const CallArgs&) { return v.type() == Type::Int; }  // not bool
bool t_float(Context&, const Value& v, const CallArgs&) { return v.type() == Type::Float; }
bool t_number(Context&, const Value& v, const CallArgs&) { return v.is_number(); }
bool t_string(Context&, const Value& v, const CallArgs&) { return v.is_string(); }
bool t_mapping(Context&, const Value& v, const CallArgs&) { return v.is_dict(); }
bool t_iterable(Context&, const Value& v, const CallArgs&) {
  return v.is_undefined() || v.is_list() || v.is_dict() || v.is_string();
}
bool t_sequence(Context&, const Value& v, const CallArgs&) { return v.is_list() || v.is_dict() || v.is_string(); }
bool t_callable(Context&, const Value& v, const CallArgs&) { return v.type() == Type::Function; }
bool t_sameas(Context&, const Value& v, const CallArgs& a) {
  const Value& o = test_arg(a, "sameas");
  if (v.type() != o.type()) return false;
  switch (v.type()) {
    case Type::None: case Type::Undefined: return true;
    case Type::Bool: return v.as_bool() == o.as_bool();
    case Type::Int: return v.as_int() == o.as_int() && v.as_int() >= -5 && v.as_int() <= 256;  // CPython's small ints
    default: return v.identity() != nullptr && v.identity() == o.identity();
  }
}
bool t_eq(Context&, const Value& v, const CallArgs& a) { return equal(v, test_arg(a, "eq")); }
bool t_ne(Context&, const Value& v, const CallArgs& a) { return !equal(v, test_arg(a, "ne")); }
bool t_lt(Context&, const Value& v, const CallArgs& a) { return less(v, test_arg(a, "lt")); }
bool t_le(Context&, const Value& v, const CallArgs& a) { const Value& o = test_arg(a, "le"); return less(v, o) || equal(v, o); }
bool t_gt(Context&, const Value& v, const CallArgs& a) { return less(test_arg(a, "gt"), v); }
bool t_ge(Context&, const Value& v, const CallArgs& a) { const Value& o = test_arg(a, "ge"); return less(o, v) || equal(v, o); }
bool t_in(Context&, const Value& v, const CallArgs& a) { return contains(test_arg(a, "in"), v); }
bool t_divisibleby(Context&, const Value& v, const CallArgs& a) {
  const Value& o = test_arg(a, "divisibleby");
  if (!v.is_int() || !o.is_int()) fail("divisibleby: expected integers");
  if (o.as_int() == 0) fail("integer division or modulo by zero");
  if (o.as_int() == -1) return true;
  return v.as_int() % o.as_int() == 0;
}
bool t_even(Context&, const Value& v, const CallArgs&) {
  if (!v.is_int()) fail("even: expected an integer");
  return v.as_int() % 2 == 0;
}
bool t_odd(Context&, const Value& v, const CallArgs&) {
  if (!v.is_int()) fail("odd: expected an integer");
  return v.as_int() % 2 != 0;
}
bool t_lower(Context& c, const Value& v, const CallArgs&) {
  const std::string s = to_str(v, c.budget());
  return to_lower(s) == s && to_upper(s) != s;
}
bool t_upper(Context& c, const Value& v, const CallArgs&) {
  const std::string s = to_str(v, c.budget());
  return to_upper(s) == s && to_lower(s) != s;
}
bool t_escaped(Context&, const Value&, const CallArgs&) { return false; }
bool t_filter(Context&, const Value& v, const CallArgs&) { return v.is_string() && is_filter(v.as_string()); }
bool t_test(Context&, const Value& v, const CallArgs&) { return v.is_string() && is_test(v.as_string()); }

const std::unordered_map<std::string_view, Test>& tests() {
  static const std::unordered_map<std::string_view, Test> m = {
      {"defined", t_defined}, {"undefined", t_undefined}, {"none", t_none}, {"boolean", t_boolean},
      {"true", t_true}, {"false", t_false}, {"integer", t_integer}, {"float", t_float}, {"number", t_number},
      {"string", t_string}, {"mapping", t_mapping}, {"iterable", t_iterable}, {"sequence", t_sequence},
      {"callable", t_callable}, {"sameas", t_sameas}, {"eq", t_eq}, {"equalto", t_eq}, {"==", t_eq},
      {"ne", t_ne}, {"!=", t_ne}, {"lt", t_lt}, {"lessthan", t_lt}, {"<", t_lt}, {"le", t_le}, {"<=", t_le},
      {"gt", t_gt}, {"greaterthan", t_gt}, {">", t_gt}, {"ge", t_ge}, {">=", t_ge}, {"in", t_in},
      {"divisibleby", t_divisibleby}, {"even", t_even}, {"odd", t_odd}, {"lower", t_lower},
      {"upper", t_upper}, {"escaped", t_escaped}, {"filter", t_filter}, {"test", t_test},
  };
  return m;
}

}  // namespace

bool is_filter(std::string_view name) { return filters().count(name) != 0; }
bool is_test(std::string_view name) { return tests().count(name) != 0; }

Value apply_filter(Context& ctx, const std::string& name, const Value& subject, const CallArgs& args) {
  auto it = filters().find(name);
  if (it == filters().end()) fail("no filter named '" + name + "'");
  return it->second(ctx, subject, args);
}

bool apply_test(Context& ctx, const std::string& name, const Value& subject, const CallArgs& args) {
  auto it = tests().find(name);
  if (it == tests().end()) fail("no test named '" + name + "'");
  return it->second(ctx, subject, args);
}

}  // namespace moebius::chat::jinja
