// What a template can reach besides its own syntax: jinja2's filters and tests, Python's str, dict
// and list methods, attribute and item lookup, and the globals HF provides (range, dict, namespace,
// raise_exception, strftime_now). Each follows the Python original closely enough to render real
// chat templates byte for byte; the few deliberate gaps fail with a message naming them.
//
//   jinja_filters.cpp   filters and tests
//   jinja_methods.cpp   attribute/item access, slicing, str/dict/list methods, globals
#pragma once

#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "chat/jinja_value.h"

namespace moebius::chat::jinja {

// Names the parser accepts; anything else is a syntax error (jinja2 also checks at compile time).
bool is_filter(std::string_view name);
bool is_test(std::string_view name);

Value apply_filter(Context& ctx, const std::string& name, const Value& subject, const CallArgs& args);
bool apply_test(Context& ctx, const std::string& name, const Value& subject, const CallArgs& args);

// jinja2's environment.getattr (x.name: the attribute, e.g. a bound method, else the item) and
// environment.getitem (x[key]: the item, else the attribute). Missing -> Undefined with a hint;
// only on an Undefined object do they fail, as jinja2's default Undefined does.
Value get_attr(const Value& obj, const std::string& name);
Value get_item(const Value& obj, const Value& key);
// x[start:stop:step] on a list, tuple or str (null Value pointers are omitted parts).
Value slice(const Value& obj, const Value* start, const Value* stop, const Value* step, Budget& budget);

// The items a for loop (or list(), join, map, ...) sees: a list's items, a dict's keys, a
// string's characters; Undefined is empty. Anything else fails ("'int' object is not iterable").
std::vector<Value> iterate(const Value& v);

// range, dict, namespace, raise_exception, strftime_now.
void add_globals(Dict& globals);

// Binds Python-style call arguments to named parameters: positional first, then keywords.
class Params {
 public:
  Params(const CallArgs& args, std::string_view function, std::initializer_list<std::string_view> names);
  bool has(size_t i) const { return given_[i] != nullptr; }
  const Value& get(size_t i) const;  // Undefined when not given
  Value get_or(size_t i, Value fallback) const { return has(i) ? *given_[i] : std::move(fallback); }

 private:
  std::vector<const Value*> given_;
};

// Python's printf-style `fmt % args` (also the format filter): %s %r %d %i %f %e %g %x %o %c %%
// with flags, width and precision; args is a tuple of positional values, a dict for %(name)s, or
// a single value.
Value percent_format(const std::string& fmt, const Value& args, Budget& budget);

// Python's str.splitlines() (no keepends) and str.split(sep=None).
std::vector<std::string> split_lines(std::string_view s);
std::vector<std::string> split_whitespace(std::string_view s, int64_t maxsplit);
// ASCII case mapping, as Python maps ASCII (other code points pass through unchanged).
std::string to_lower(std::string_view s);
std::string to_upper(std::string_view s);

}  // namespace moebius::chat::jinja
