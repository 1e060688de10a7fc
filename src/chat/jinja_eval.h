// The interpreter of the Jinja subset: runs a parsed Template against the render variables.
//
// Scoping follows jinja2: {% set %} writes to the innermost scope; every for-loop iteration and
// every macro call opens a new scope, so a set inside a loop is invisible after it (the reason
// templates use namespace()); if/with/filter blocks do not open one (with does). Lookups fall
// back outward, then to the globals.
#pragma once

#include <string>
#include <unordered_map>

#include "chat/jinja_ast.h"
#include "chat/jinja_value.h"

namespace moebius::chat::jinja {

class Context {
 public:
  // Depth of nested evaluation (expressions, statements, macro calls) before failing cleanly.
  static constexpr int kMaxDepth = 1000;

  explicit Context(Dict globals);

  // Renders the template with `vars` as its top-level variables.
  std::string render(const Template& t, const Dict& vars);

  // Calls a Function value with Python-style arguments; calling Undefined fails with its hint.
  Value call(const Value& callee, const CallArgs& args);

  Budget& budget() { return budget_; }

 private:
  struct Frame {
    std::unordered_map<std::string, Value> vars;
    Frame* parent = nullptr;
  };
  enum class Flow { Normal, Break, Continue };

  Value lookup(const Frame& f, const std::string& name) const;
  Value eval(const Expr& e, Frame& f);
  Value eval_inner(const Expr& e, Frame& f);
  Value eval_binary(const Expr& e, const Value& a, const Value& b);
  bool eval_compare(const Expr& e, Frame& f);
  CallArgs eval_args(const Expr& e, Frame& f, size_t first);

  Flow exec(const Body& body, Frame& f, std::string& out);
  Flow exec_stmt(const Stmt& s, Frame& f, std::string& out);
  Flow exec_for(const Stmt& s, Frame& f, std::string& out);
  void assign(const Expr& target, const Value& v, Frame& f);
  void define_macro(const Stmt& s, Frame& f);

  struct Deeper {
    explicit Deeper(Context& c);
    ~Deeper() { --c.depth_; }
    Context& c;
  };

  Frame globals_;
  Frame* root_ = nullptr;
  Budget budget_;
  int depth_ = 0;
};

}  // namespace moebius::chat::jinja
