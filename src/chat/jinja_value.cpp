#include "chat/jinja_value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

namespace moebius::chat::jinja {

void fail(std::string message) { throw Failure{std::move(message)}; }

void append_text(std::string& out, std::string_view s, Budget& budget) {
  budget.check(out.size() + s.size());
  budget.charge(s.size());
  out.append(s);
}

void Budget::check(size_t size) {
  if (size > kMaxString) fail("a string or the output grew past 16 MiB; refusing to go on");
}

void Budget::charge(size_t size) {
  check(size);
  work_ += size;
  if (work_ > kMaxWork) fail("the template copies more than 1 GiB of text; refusing to go on");
}

void Budget::charge_list(size_t items, size_t copied) {
  if (items > kMaxListItems) fail("a list grew past 1,048,576 items; refusing to go on");
  work_ += copied * sizeof(Value);
  if (work_ > kMaxWork) fail("the template copies more than 1 GiB of data; refusing to go on");
}

void Budget::iteration() {
  if (++iterations_ > kMaxIterations) fail("more than 1,000,000 loop iterations and macro calls; refusing to go on");
}

// ---------------------------------------------------------------------------------------------
// Construction and access
// ---------------------------------------------------------------------------------------------
Value Value::undefined(std::string hint) {
  Value v;
  v.ptr_ = std::make_shared<const std::string>(std::move(hint));
  return v;
}
Value Value::none() { Value v; v.type_ = Type::None; return v; }
Value Value::boolean(bool b) { Value v; v.type_ = Type::Bool; v.i_ = b ? 1 : 0; return v; }
Value Value::integer(int64_t i) { Value v; v.type_ = Type::Int; v.i_ = i; return v; }
Value Value::number(double f) { Value v; v.type_ = Type::Float; v.f_ = f; return v; }
Value Value::string(std::string s) {
  Value v;
  v.type_ = Type::String;
  v.ptr_ = std::make_shared<const std::string>(std::move(s));
  return v;
}
Value Value::list(std::vector<Value> items, bool tuple) {
  Value v;
  v.type_ = Type::List;
  v.ptr_ = std::make_shared<const List>(List{std::move(items), tuple});
  return v;
}
Value Value::dict(Dict d) {
  Value v;
  v.type_ = Type::Dict;
  v.ptr_ = std::make_shared<const Dict>(std::move(d));
  return v;
}
Value Value::ns(NamespacePtr n) { Value v; v.type_ = Type::Namespace; v.ptr_ = std::move(n); return v; }
Value Value::function(FunctionPtr f) { Value v; v.type_ = Type::Function; v.ptr_ = std::move(f); return v; }

Value Value::from_json(const nlohmann::ordered_json& j) {
  using T = nlohmann::ordered_json::value_t;
  switch (j.type()) {
    case T::null: return none();
    case T::boolean: return boolean(j.get<bool>());
    case T::number_integer: return integer(j.get<int64_t>());
    case T::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      // Python ints are unbounded; past int64 a float is the closest we keep.
      return u <= static_cast<uint64_t>(INT64_MAX) ? integer(static_cast<int64_t>(u))
                                                   : number(static_cast<double>(u));
    }
    case T::number_float: return number(j.get<double>());
    case T::string: return string(j.get<std::string>());
    case T::array: {
      std::vector<Value> items;
      items.reserve(j.size());
      for (const auto& e : j) items.push_back(from_json(e));
      return list(std::move(items));
    }
    case T::object: {
      Dict d;
      for (const auto& [k, e] : j.items()) d.set(k, from_json(e));
      return dict(std::move(d));
    }
    default: return none();  // binary and discarded values never come from a parsed request
  }
}

double Value::as_double() const { return type_ == Type::Float ? f_ : static_cast<double>(i_); }

const std::string& Value::undefined_hint() const {
  static const std::string kNone = "value is undefined";
  return ptr_ ? as_string() : kNone;
}

void Value::fail_undefined() const { fail(undefined_hint()); }

bool Value::truthy() const {
  switch (type_) {
    case Type::Undefined: case Type::None: return false;
    case Type::Bool: case Type::Int: return i_ != 0;
    case Type::Float: return f_ != 0.0;
    case Type::String: return !as_string().empty();
    case Type::List: return !as_list().items.empty();
    case Type::Dict: return as_dict().size() != 0;
    case Type::Namespace: case Type::Function: return true;
  }
  return false;
}

const char* Value::type_name() const {
  switch (type_) {
    case Type::Undefined: return "Undefined";
    case Type::None: return "NoneType";
    case Type::Bool: return "bool";
    case Type::Int: return "int";
    case Type::Float: return "float";
    case Type::String: return "str";
    case Type::List: return as_list().tuple ? "tuple" : "list";
    case Type::Dict: return "dict";
    case Type::Namespace: return "Namespace";
    case Type::Function: return "function";
  }
  return "object";
}

const Value* Dict::find(const std::string& key) const {
  auto it = index_.find(key);
  return it == index_.end() ? nullptr : &entries_[it->second].second;
}

void Dict::set(const std::string& key, Value v) {
  auto [it, inserted] = index_.emplace(key, entries_.size());
  if (inserted) entries_.emplace_back(key, std::move(v));
  else entries_[it->second].second = std::move(v);  // a repeated key keeps its first position
}

// ---------------------------------------------------------------------------------------------
// UTF-8
// ---------------------------------------------------------------------------------------------
namespace {

// Length of the well-formed UTF-8 sequence at s[i], or 1 for a malformed byte.
size_t sequence_length(std::string_view s, size_t i) {
  const auto b = static_cast<unsigned char>(s[i]);
  size_t n = b < 0x80 ? 1 : (b >> 5) == 0x6 ? 2 : (b >> 4) == 0xE ? 3 : (b >> 3) == 0x1E ? 4 : 1;
  if (i + n > s.size()) return 1;
  for (size_t k = 1; k < n; ++k)
    if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return 1;
  return n;
}

char32_t decode(std::string_view cp) {
  const auto b0 = static_cast<unsigned char>(cp[0]);
  if (cp.size() == 1) return b0;
  char32_t c = b0 & (0xFF >> (cp.size() + 1));
  for (size_t k = 1; k < cp.size(); ++k) c = (c << 6) | (static_cast<unsigned char>(cp[k]) & 0x3F);
  return c;
}

}  // namespace

std::vector<std::string_view> code_points(std::string_view s) {
  std::vector<std::string_view> out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const size_t n = sequence_length(s, i);
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

size_t code_point_count(std::string_view s) {
  size_t n = 0;
  for (size_t i = 0; i < s.size(); i += sequence_length(s, i)) ++n;
  return n;
}

bool is_space(std::string_view cp) {
  const char32_t c = decode(cp);
  if (cp.size() == 1) return c == ' ' || (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x1F);
  return c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 ||
         c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

std::string_view strip(std::string_view s, const std::string* chars, bool left, bool right) {
  std::vector<std::string_view> set;
  if (chars != nullptr) set = code_points(*chars);
  auto strippable = [&](std::string_view cp) {
    if (chars == nullptr) return is_space(cp);
    return std::find(set.begin(), set.end(), cp) != set.end();
  };
  const auto cps = code_points(s);
  size_t b = 0, e = cps.size();
  if (left) while (b < e && strippable(cps[b])) ++b;
  if (right) while (e > b && strippable(cps[e - 1])) --e;
  if (b == e) return {};
  const size_t start = static_cast<size_t>(cps[b].data() - s.data());
  const size_t end = static_cast<size_t>(cps[e - 1].data() - s.data()) + cps[e - 1].size();
  return s.substr(start, end - start);
}

// ---------------------------------------------------------------------------------------------
// str(), repr(), json.dumps()
// ---------------------------------------------------------------------------------------------
namespace {

void append_hex(std::string& out, const char* prefix, unsigned value, int digits) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%s%0*x", prefix, digits, value);
  out += buf;
}

// Python's repr(str): single quotes unless the text has ' and no ".
void append_string_repr(std::string& out, const std::string& s, Budget& budget) {
  const bool dq = s.find('\'') != std::string::npos && s.find('"') == std::string::npos;
  const char q = dq ? '"' : '\'';
  std::string r;
  r.reserve(s.size() + 2);
  r += q;
  for (std::string_view cp : code_points(s)) {
    const char32_t c = decode(cp);
    if (c == static_cast<char32_t>(q) || c == '\\') { r += '\\'; r += static_cast<char>(c); }
    else if (c == '\n') r += "\\n";
    else if (c == '\r') r += "\\r";
    else if (c == '\t') r += "\\t";
    else if (c < 0x20 || c == 0x7F || (c >= 0x80 && c <= 0xA0) || c == 0xAD) append_hex(r, "\\x", c, 2);
    else if (c == 0x2028 || c == 0x2029) append_hex(r, "\\u", c, 4);  // not printable in Python
    else r.append(cp);
  }
  r += q;
  append_text(out, r, budget);
}

void append_items_repr(std::string& out, const List& l, Budget& budget) {
  out += l.tuple ? '(' : '[';
  for (size_t i = 0; i < l.items.size(); ++i) {
    if (i) out += ", ";
    append_repr(out, l.items[i], budget);
  }
  if (l.tuple && l.items.size() == 1) out += ',';
  out += l.tuple ? ')' : ']';
  budget.check(out.size());
}

void append_dict_repr(std::string& out, const Dict& d, Budget& budget) {
  out += '{';
  bool first = true;
  for (const auto& [k, v] : d.entries()) {
    if (!first) out += ", ";
    first = false;
    append_string_repr(out, k, budget);
    out += ": ";
    append_repr(out, v, budget);
  }
  out += '}';
  budget.check(out.size());
}

}  // namespace

std::string format_float(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string_view sci(buf, static_cast<size_t>(res.ptr - buf));  // "-1.2345e+02"
  std::string out;
  if (sci[0] == '-') { out += '-'; sci.remove_prefix(1); }
  const size_t e = sci.find('e');
  std::string digits;
  for (char c : sci.substr(0, e)) if (c != '.') digits += c;
  int exp = 0;
  std::from_chars(sci.data() + e + (sci[e + 1] == '+' ? 2 : 1), sci.data() + sci.size(), exp);
  const int decpt = exp + 1;  // digits d1 d2 ... with the point after decpt of them
  const int n = static_cast<int>(digits.size());
  if (decpt > -4 && decpt <= 16) {  // Python's repr switches to exponents outside this range
    // Appends rather than "literal" + std::string: gcc 12 at -O3 reports a false -Wrestrict there.
    if (decpt <= 0) {
      out += "0.";
      out.append(static_cast<size_t>(-decpt), '0');
      out += digits;
    } else if (decpt >= n) {
      out += digits;
      out.append(static_cast<size_t>(decpt - n), '0');
      out += ".0";
    } else {
      out.append(digits, 0, static_cast<size_t>(decpt));
      out += '.';
      out.append(digits, static_cast<size_t>(decpt));
    }
  } else {
    out += digits.substr(0, 1);
    if (n > 1) {
      out += '.';
      out.append(digits, 1);
    }
    char ebuf[16];
    std::snprintf(ebuf, sizeof ebuf, "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
    out += ebuf;
  }
  return out;
}

void append_str(std::string& out, const Value& v, Budget& budget) {
  switch (v.type()) {
    case Type::Undefined: return;
    case Type::String: append_text(out, v.as_string(), budget); return;
    case Type::None: append_text(out, "None", budget); return;
    case Type::Bool: append_text(out, v.as_bool() ? "True" : "False", budget); return;
    case Type::Int: append_text(out, std::to_string(v.as_int()), budget); return;
    case Type::Float: append_text(out, format_float(v.as_double()), budget); return;
    default: append_repr(out, v, budget); return;
  }
}

void append_repr(std::string& out, const Value& v, Budget& budget) {
  switch (v.type()) {
    case Type::Undefined: append_text(out, "Undefined", budget); return;
    case Type::String: append_string_repr(out, v.as_string(), budget); return;
    case Type::List: append_items_repr(out, v.as_list(), budget); return;
    case Type::Dict: append_dict_repr(out, v.as_dict(), budget); return;
    case Type::Namespace:
      out += "<Namespace ";
      append_dict_repr(out, v.as_namespace().attrs, budget);
      out += '>';
      return;
    case Type::Function: append_text(out, "<function " + v.as_function().name + ">", budget); return;
    default: append_str(out, v, budget); return;
  }
}

std::string to_str(const Value& v, Budget& budget) {
  if (v.is_string()) return v.as_string();
  std::string s;
  append_str(s, v, budget);
  return s;
}

namespace {

void append_json_string(std::string& out, const std::string& s, bool ensure_ascii, Budget& budget) {
  std::string r;
  r.reserve(s.size() + 2);
  r += '"';
  for (std::string_view cp : code_points(s)) {
    const char32_t c = decode(cp);
    switch (c) {
      case '"': r += "\\\""; break;
      case '\\': r += "\\\\"; break;
      case '\n': r += "\\n"; break;
      case '\r': r += "\\r"; break;
      case '\t': r += "\\t"; break;
      case '\b': r += "\\b"; break;
      case '\f': r += "\\f"; break;
      default:
        if (c < 0x20) append_hex(r, "\\u", c, 4);
        else if (c < 0x80 || !ensure_ascii) r.append(cp);
        else if (c < 0x10000) append_hex(r, "\\u", c, 4);
        else {  // a surrogate pair, as Python writes astral code points
          const char32_t u = c - 0x10000;
          append_hex(r, "\\u", 0xD800 + (u >> 10), 4);
          append_hex(r, "\\u", 0xDC00 + (u & 0x3FF), 4);
        }
    }
  }
  r += '"';
  append_text(out, r, budget);
}

void append_json_at(std::string& out, const Value& v, const JsonOptions& o, int level, Budget& budget) {
  const std::string item_sep = o.has_separators ? o.item_separator : (o.has_indent ? "," : ", ");
  const std::string key_sep = o.has_separators ? o.key_separator : ": ";
  auto newline = [&](int lvl) {
    if (!o.has_indent) return;
    out += '\n';
    for (int i = 0; i < lvl; ++i) append_text(out, o.indent, budget);
  };
  switch (v.type()) {
    case Type::None: out += "null"; return;
    case Type::Bool: out += v.as_bool() ? "true" : "false"; return;
    case Type::Int: out += std::to_string(v.as_int()); return;
    case Type::Float: {
      const double d = v.as_double();
      if (std::isnan(d)) out += "NaN";
      else if (std::isinf(d)) out += d < 0 ? "-Infinity" : "Infinity";
      else out += format_float(d);
      return;
    }
    case Type::String: append_json_string(out, v.as_string(), o.ensure_ascii, budget); return;
    case Type::List: {
      const auto& items = v.as_list().items;
      if (items.empty()) { out += "[]"; return; }
      out += '[';
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) append_text(out, item_sep, budget);
        newline(level + 1);
        append_json_at(out, items[i], o, level + 1, budget);
      }
      newline(level);
      out += ']';
      budget.check(out.size());
      return;
    }
    case Type::Dict: {
      const auto& d = v.as_dict();
      if (d.size() == 0) { out += "{}"; return; }
      std::vector<const std::pair<std::string, Value>*> entries;
      for (const auto& e : d.entries()) entries.push_back(&e);
      if (o.sort_keys)
        std::stable_sort(entries.begin(), entries.end(), [](auto* a, auto* b) { return a->first < b->first; });
      out += '{';
      for (size_t i = 0; i < entries.size(); ++i) {
        if (i) append_text(out, item_sep, budget);
        newline(level + 1);
        append_json_string(out, entries[i]->first, o.ensure_ascii, budget);
        append_text(out, key_sep, budget);
        append_json_at(out, entries[i]->second, o, level + 1, budget);
      }
      newline(level);
      out += '}';
      budget.check(out.size());
      return;
    }
    default: fail(std::string("Object of type ") + v.type_name() + " is not JSON serializable");
  }
}

}  // namespace

void append_json(std::string& out, const Value& v, const JsonOptions& options, Budget& budget) {
  append_json_at(out, v, options, 0, budget);
}

// ---------------------------------------------------------------------------------------------
// Comparison
// ---------------------------------------------------------------------------------------------
bool equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_int() && b.is_int()) return a.as_int() == b.as_int();
    return a.as_double() == b.as_double();
  }
  if (a.type() != b.type()) return false;
  switch (a.type()) {
    case Type::Undefined: case Type::None: return true;
    case Type::String: return a.as_string() == b.as_string();
    case Type::List: {
      const auto& x = a.as_list();
      const auto& y = b.as_list();
      if (x.tuple != y.tuple || x.items.size() != y.items.size()) return false;
      for (size_t i = 0; i < x.items.size(); ++i)
        if (!equal(x.items[i], y.items[i])) return false;
      return true;
    }
    case Type::Dict: {
      const auto& x = a.as_dict();
      const auto& y = b.as_dict();
      if (x.size() != y.size()) return false;
      for (const auto& [k, v] : x.entries()) {
        const Value* w = y.find(k);
        if (w == nullptr || !equal(v, *w)) return false;
      }
      return true;
    }
    case Type::Namespace: case Type::Function: return a.identity() == b.identity();
    default: return false;
  }
}

bool less(const Value& a, const Value& b) {
  if (a.is_undefined()) a.fail_undefined();
  if (b.is_undefined()) b.fail_undefined();
  if (a.is_number() && b.is_number()) {
    if (a.is_int() && b.is_int()) return a.as_int() < b.as_int();
    return a.as_double() < b.as_double();
  }
  // UTF-8 byte order is code point order, which is how Python orders str.
  if (a.is_string() && b.is_string()) return a.as_string() < b.as_string();
  if (a.is_list() && b.is_list() && a.as_list().tuple == b.as_list().tuple) {
    const auto& x = a.as_list().items;
    const auto& y = b.as_list().items;
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (equal(x[i], y[i])) continue;
      return less(x[i], y[i]);
    }
    return x.size() < y.size();
  }
  fail(std::string("'<' not supported between instances of '") + a.type_name() + "' and '" + b.type_name() + "'");
}

bool contains(const Value& container, const Value& item) {
  switch (container.type()) {
    case Type::Undefined: return false;  // jinja2's Undefined iterates as empty
    case Type::String:
      if (!item.is_string())
        fail(std::string("'in <string>' requires string as left operand, not ") + item.type_name());
      return container.as_string().find(item.as_string()) != std::string::npos;
    case Type::List:
      for (const auto& e : container.as_list().items)
        if (equal(e, item)) return true;
      return false;
    case Type::Dict: return item.is_string() && container.as_dict().find(item.as_string()) != nullptr;
    case Type::Namespace:
      return item.is_string() && container.as_namespace().attrs.find(item.as_string()) != nullptr;
    default: fail(std::string("argument of type '") + container.type_name() + "' is not iterable");
  }
}

}  // namespace moebius::chat::jinja
