// Values of the Jinja-subset interpreter (chat_template.h): what jinja2 sees when Hugging Face
// renders a chat template, i.e. Python objects built from the request's JSON (None, bool, int,
// float, str, list, dict) plus jinja2's own Undefined, namespace() and callables.
//
// Python semantics are kept where a chat template can observe them: str() and repr() of every
// type (a list prints as "['a', 1, None]"), truthiness, == between int, float and bool, dicts in
// insertion order, strings indexed by code point. Strings, lists and dicts are shared, immutable
// values (HF renders in an ImmutableSandboxedEnvironment, where list.append and friends are
// refused), so copying a Value is O(1); only namespace() objects are mutable.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace moebius::chat::jinja {

// A template error: the message jinja2 would give, and where (0 when not known yet; the
// interpreter fills in the innermost statement or expression it was evaluating).
struct Failure {
  std::string message;
  int line = 0;
  int column = 0;
};
[[noreturn]] void fail(std::string message);

// Caps on what one render may build, so a hostile template (or a fuzzer) cannot exhaust memory:
// no string longer than kMaxString, and at most kMaxWork bytes copied into strings over the whole
// render (a loop that concatenates a large string 100,000 times stops here).
class Budget {
 public:
  static constexpr size_t kMaxString = size_t{16} << 20;  // 16 MiB, the output included
  static constexpr size_t kMaxWork = size_t{1} << 30;     // 1 GiB copied in total
  static constexpr int64_t kMaxIterations = 1'000'000;    // loop iterations and macro calls
  // Throws when a string of `size` bytes is too long.
  void check(size_t size);
  // check(), and counts `size` bytes copied against kMaxWork.
  void charge(size_t size);
  void iteration();

 private:
  size_t work_ = 0;
  int64_t iterations_ = 0;
};

class Value;
struct List;
class Dict;
struct Namespace;
struct Function;
using ListPtr = std::shared_ptr<const List>;
using DictPtr = std::shared_ptr<const Dict>;
using NamespacePtr = std::shared_ptr<Namespace>;
using FunctionPtr = std::shared_ptr<const Function>;

enum class Type { Undefined, None, Bool, Int, Float, String, List, Dict, Namespace, Function };

class Value {
 public:
  Value() = default;  // undefined
  static Value undefined(std::string hint);
  static Value none();
  static Value boolean(bool b);
  static Value integer(int64_t i);
  static Value number(double f);
  static Value string(std::string s);
  static Value list(std::vector<Value> items, bool tuple = false);
  static Value dict(Dict d);
  static Value ns(NamespacePtr n);
  static Value function(FunctionPtr f);
  // JSON null/bool/number/string/array/object -> None/bool/int|float/str/list/dict, key order kept.
  static Value from_json(const nlohmann::ordered_json& j);

  Type type() const { return type_; }
  bool is_undefined() const { return type_ == Type::Undefined; }
  bool is_none() const { return type_ == Type::None; }
  bool is_string() const { return type_ == Type::String; }
  bool is_list() const { return type_ == Type::List; }
  bool is_dict() const { return type_ == Type::Dict; }
  // Python's int includes bool (True + 1 == 2, `true is number`).
  bool is_int() const { return type_ == Type::Int || type_ == Type::Bool; }
  bool is_number() const { return is_int() || type_ == Type::Float; }

  bool as_bool() const { return i_ != 0; }
  int64_t as_int() const { return i_; }          // Bool and Int
  double as_double() const;                      // Bool, Int and Float
  const std::string& as_string() const { return *static_cast<const std::string*>(ptr_.get()); }
  const List& as_list() const { return *static_cast<const List*>(ptr_.get()); }
  const Dict& as_dict() const { return *static_cast<const Dict*>(ptr_.get()); }
  // namespace() objects are the one mutable value.
  Namespace& as_namespace() const { return *const_cast<Namespace*>(static_cast<const Namespace*>(ptr_.get())); }
  const Function& as_function() const { return *static_cast<const Function*>(ptr_.get()); }
  // Identity, for == between namespaces and functions (Python's default).
  const void* identity() const { return ptr_.get(); }
  // Why it is undefined: "'x' is undefined", "'dict object' has no attribute 'y'".
  const std::string& undefined_hint() const;
  [[noreturn]] void fail_undefined() const;

  // Python bool(x); Undefined is false.
  bool truthy() const;
  // Python type(x).__name__, for error messages.
  const char* type_name() const;

 private:
  // 32 bytes: values are copied a lot and the interpreter's recursion keeps many on the stack.
  Type type_ = Type::Undefined;
  union {
    int64_t i_ = 0;  // Bool, Int
    double f_;       // Float
  };
  // String (std::string, also the Undefined hint), List, Dict, Namespace or Function.
  std::shared_ptr<const void> ptr_;
};

struct List {
  std::vector<Value> items;
  bool tuple = false;  // prints as (a, b) and is never == a list, as in Python
};

// A Python dict with string keys, in insertion order, with O(1) lookup.
class Dict {
 public:
  const Value* find(const std::string& key) const;
  void set(const std::string& key, Value v);
  size_t size() const { return entries_.size(); }
  const std::vector<std::pair<std::string, Value>>& entries() const { return entries_; }

 private:
  std::vector<std::pair<std::string, Value>> entries_;
  std::unordered_map<std::string, size_t> index_;
};

// jinja2's namespace(): the one mutable object, assigned with {% set ns.attr = ... %}.
struct Namespace {
  Dict attrs;
};

// Something a template can call: a global (range, namespace, raise_exception), a macro, or a
// method bound to its object ('a,b'.split(','), message.get('x')).
class Context;
struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
};
struct Function {
  std::string name;
  std::function<Value(const CallArgs&, Context&)> call;
};

// out += s, within the budget (every string the interpreter builds grows through this).
void append_text(std::string& out, std::string_view s, Budget& budget);
// Python's str(x) and repr(x), appended to out.
void append_str(std::string& out, const Value& v, Budget& budget);
void append_repr(std::string& out, const Value& v, Budget& budget);
std::string to_str(const Value& v, Budget& budget);
// Python's repr() of a float: the shortest text that round-trips ("0.1", "1e+16", "1.0").
std::string format_float(double d);

// json.dumps(v, ensure_ascii, indent, separators, sort_keys), the way HF's tojson filter calls it.
struct JsonOptions {
  bool ensure_ascii = false;
  bool has_indent = false;
  std::string indent;  // the text of one level ("  " for indent=2)
  bool has_separators = false;
  std::string item_separator, key_separator;
  bool sort_keys = false;
};
void append_json(std::string& out, const Value& v, const JsonOptions& options, Budget& budget);

// Python ==, <, `in`; `less` throws a TypeError-like Failure for types Python cannot order.
bool equal(const Value& a, const Value& b);
bool less(const Value& a, const Value& b);
bool contains(const Value& container, const Value& item);

// UTF-8 helpers: strings are indexed, sliced and stripped by code point, as Python does.
// Malformed bytes decode as one code point each (U+FFFD-like) so no input can loop or overrun.
std::vector<std::string_view> code_points(std::string_view s);
size_t code_point_count(std::string_view s);
// Python's str.isspace() for one code point given as its UTF-8 text.
bool is_space(std::string_view cp);
// Python's str.strip/lstrip/rstrip: chars == nullptr strips whitespace.
std::string_view strip(std::string_view s, const std::string* chars, bool left, bool right);

}  // namespace moebius::chat::jinja
