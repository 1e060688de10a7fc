#include "chat/jinja_eval.h"

#include <cmath>
#include <functional>

#include "chat/jinja_builtins.h"

namespace moebius::chat::jinja {

Context::Deeper::Deeper(Context& c) : c(c) {
  // The parser bounds a template's own nesting; this bounds recursion through macro calls.
  if (++c.depth_ > kMaxDepth) {
    --c.depth_;
    fail("template recursion too deep (more than " + std::to_string(kMaxDepth) + " nested evaluations)");
  }
}

Context::Context(Dict globals) {
  for (const auto& [k, v] : globals.entries()) globals_.vars[k] = v;
}

std::string Context::render(const Template& t, const Dict& vars) {
  Frame root;
  root.parent = &globals_;
  for (const auto& [k, v] : vars.entries()) root.vars[k] = v;
  root_ = &root;
  std::string out;
  exec(t.body, root, out);
  root_ = nullptr;
  return out;
}

Value Context::call(const Value& callee, const CallArgs& args) {
  if (callee.type() == Type::Function) return callee.as_function().call(args, *this);
  if (callee.is_undefined()) callee.fail_undefined();
  fail(std::string("'") + callee.type_name() + "' object is not callable");
}

Value Context::lookup(const Frame& f, const std::string& name) const {
  for (const Frame* p = &f; p != nullptr; p = p->parent) {
    auto it = p->vars.find(name);
    if (it != p->vars.end()) return it->second;
  }
  return Value::undefined("'" + name + "' is undefined");
}

// ---------------------------------------------------------------------------------------------
// Expressions
// ---------------------------------------------------------------------------------------------
Value Context::eval(const Expr& e, Frame& f) {
  Deeper guard(*this);
  try {
    return eval_inner(e, f);
  } catch (Failure& x) {
    if (x.line == 0) {  // the innermost expression names the place
      x.line = e.line;
      x.column = e.column;
    }
    throw;
  }
}

CallArgs Context::eval_args(const Expr& e, Frame& f, size_t first) {
  CallArgs a;
  for (size_t i = first; i < e.args.size(); ++i) a.positional.push_back(eval(*e.args[i], f));
  for (const auto& [k, v] : e.kwargs) a.keyword.emplace_back(k, eval(*v, f));
  return a;
}

Value Context::eval_inner(const Expr& e, Frame& f) {
  switch (e.kind) {
    case ExprKind::Literal: return e.value;
    case ExprKind::Name: return lookup(f, e.name);
    case ExprKind::List:
    case ExprKind::Tuple: {
      std::vector<Value> items;
      items.reserve(e.args.size());
      for (const auto& a : e.args) items.push_back(eval(*a, f));
      return Value::list(std::move(items), e.kind == ExprKind::Tuple);
    }
    case ExprKind::Dict: {
      Dict d;
      for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
        Value k = eval(*e.args[i], f);
        if (!k.is_string()) fail(std::string("dict keys must be strings here, not ") + k.type_name());
        d.set(k.as_string(), eval(*e.args[i + 1], f));
      }
      return Value::dict(std::move(d));
    }
    case ExprKind::GetAttr: return get_attr(eval(*e.args[0], f), e.name);
    case ExprKind::GetItem: {
      Value obj = eval(*e.args[0], f);
      return get_item(obj, eval(*e.args[1], f));
    }
    case ExprKind::Slice: {
      Value obj = eval(*e.args[0], f);
      Value parts[3];
      const Value* p[3] = {nullptr, nullptr, nullptr};
      for (int i = 0; i < 3; ++i) {
        if (!e.args[static_cast<size_t>(i) + 1]) continue;
        parts[i] = eval(*e.args[static_cast<size_t>(i) + 1], f);
        p[i] = &parts[i];
      }
      return slice(obj, p[0], p[1], p[2], budget_);
    }
    case ExprKind::Call: {
      Value callee = eval(*e.args[0], f);
      return call(callee, eval_args(e, f, 1));
    }
    case ExprKind::Filter: {
      Value subject = eval(*e.args[0], f);
      return apply_filter(*this, e.name, subject, eval_args(e, f, 1));
    }
    case ExprKind::Test: {
      Value subject = eval(*e.args[0], f);
      return Value::boolean(apply_test(*this, e.name, subject, eval_args(e, f, 1)) != e.negated);
    }
    case ExprKind::Neg:
    case ExprKind::Pos: {
      Value v = eval(*e.args[0], f);
      if (v.is_undefined()) v.fail_undefined();
      if (!v.is_number())
        fail(std::string("bad operand type for unary ") + (e.kind == ExprKind::Neg ? "-" : "+") + ": '" + v.type_name() + "'");
      if (e.kind == ExprKind::Pos) return v.is_int() ? Value::integer(v.as_int()) : v;
      if (v.is_int()) {
        if (v.as_int() == INT64_MIN) fail("integer overflow");
        return Value::integer(-v.as_int());
      }
      return Value::number(-v.as_double());
    }
    case ExprKind::Not: return Value::boolean(!eval(*e.args[0], f).truthy());
    case ExprKind::Binary: {
      Value a = eval(*e.args[0], f);
      Value b = eval(*e.args[1], f);
      return eval_binary(e, a, b);
    }
    case ExprKind::Concat: {
      std::string s;
      for (const auto& a : e.args) append_str(s, eval(*a, f), budget_);
      return Value::string(std::move(s));
    }
    case ExprKind::Compare: return Value::boolean(eval_compare(e, f));
    case ExprKind::And: {
      Value a = eval(*e.args[0], f);
      return a.truthy() ? eval(*e.args[1], f) : a;
    }
    case ExprKind::Or: {
      Value a = eval(*e.args[0], f);
      return a.truthy() ? a : eval(*e.args[1], f);
    }
    case ExprKind::Cond:
      if (eval(*e.args[0], f).truthy()) return eval(*e.args[1], f);
      if (e.args[2]) return eval(*e.args[2], f);
      return Value::undefined("the inline if-expression on line " + std::to_string(e.line) +
                              " evaluated to false and no else section was defined");
  }
  fail("unknown expression");
}

namespace {

[[noreturn]] void bad_operands(const std::string& op, const Value& a, const Value& b) {
  fail("unsupported operand type(s) for " + op + ": '" + a.type_name() + "' and '" + b.type_name() + "'");
}

// Python ints do not overflow; ours are 64-bit, so a result that does not fit is an error.
void no_overflow(bool overflow) {
  if (overflow) fail("integer overflow");
}

Value repeat(const Value& seq, int64_t n, Budget& budget) {
  if (seq.is_string()) {
    std::string out;
    for (int64_t i = 0; i < n; ++i) append_text(out, seq.as_string(), budget);
    return Value::string(std::move(out));
  }
  const auto& l = seq.as_list();
  std::vector<Value> items;
  for (int64_t i = 0; i < n && !l.items.empty(); ++i) {
    budget.charge((items.size() + l.items.size()) * sizeof(Value));
    items.insert(items.end(), l.items.begin(), l.items.end());
  }
  return Value::list(std::move(items), l.tuple);
}

}  // namespace

Value Context::eval_binary(const Expr& e, const Value& a, const Value& b) {
  const std::string& op = e.name;
  if (a.is_undefined()) a.fail_undefined();
  if (b.is_undefined()) b.fail_undefined();
  const bool ints = a.is_int() && b.is_int();
  const bool nums = a.is_number() && b.is_number();
  int64_t r = 0;
  if (op == "+") {
    if (ints) {
      no_overflow(__builtin_add_overflow(a.as_int(), b.as_int(), &r));
      return Value::integer(r);
    }
    if (nums) return Value::number(a.as_double() + b.as_double());
    if (a.is_string() && b.is_string()) {
      std::string s;
      append_text(s, a.as_string(), budget_);
      append_text(s, b.as_string(), budget_);
      return Value::string(std::move(s));
    }
    if (a.is_list() && b.is_list() && a.as_list().tuple == b.as_list().tuple) {
      budget_.charge((a.as_list().items.size() + b.as_list().items.size()) * sizeof(Value));
      std::vector<Value> items = a.as_list().items;
      items.insert(items.end(), b.as_list().items.begin(), b.as_list().items.end());
      return Value::list(std::move(items), a.as_list().tuple);
    }
    bad_operands(op, a, b);
  }
  if (op == "-") {
    if (ints) {
      no_overflow(__builtin_sub_overflow(a.as_int(), b.as_int(), &r));
      return Value::integer(r);
    }
    if (nums) return Value::number(a.as_double() - b.as_double());
    bad_operands(op, a, b);
  }
  if (op == "*") {
    if (ints) {
      no_overflow(__builtin_mul_overflow(a.as_int(), b.as_int(), &r));
      return Value::integer(r);
    }
    if (nums) return Value::number(a.as_double() * b.as_double());
    if ((a.is_string() || a.is_list()) && b.is_int()) return repeat(a, b.as_int(), budget_);
    if (a.is_int() && (b.is_string() || b.is_list())) return repeat(b, a.as_int(), budget_);
    bad_operands(op, a, b);
  }
  if (!nums) {
    if (op == "%" && a.is_string()) return percent_format(a.as_string(), b, budget_);
    bad_operands(op, a, b);
  }
  if (op == "/") {
    if (b.as_double() == 0) fail("division by zero");
    return Value::number(a.as_double() / b.as_double());
  }
  if (op == "//" || op == "%") {
    if (b.as_double() == 0) fail(ints ? "integer division or modulo by zero" : "float division by zero");
    if (ints) {
      const int64_t x = a.as_int(), y = b.as_int();
      if (x == INT64_MIN && y == -1) fail("integer overflow");
      int64_t q = x / y, m = x % y;
      if (m != 0 && ((m < 0) != (y < 0))) { --q; m += y; }  // Python floors
      return Value::integer(op == "//" ? q : m);
    }
    const double x = a.as_double(), y = b.as_double();
    if (op == "//") return Value::number(std::floor(x / y));
    double m = std::fmod(x, y);
    if (m != 0 && ((m < 0) != (y < 0))) m += y;
    return Value::number(m);
  }
  if (op == "**") {
    if (ints && b.as_int() >= 0) {
      int64_t base = a.as_int(), exp = b.as_int(), acc = 1;
      while (exp > 0) {
        if (exp & 1) no_overflow(__builtin_mul_overflow(acc, base, &acc));
        exp >>= 1;
        if (exp > 0) no_overflow(__builtin_mul_overflow(base, base, &base));
      }
      return Value::integer(acc);
    }
    return Value::number(std::pow(a.as_double(), b.as_double()));
  }
  fail("unknown operator " + op);
}

bool Context::eval_compare(const Expr& e, Frame& f) {
  Value left = eval(*e.args[0], f);
  for (size_t i = 0; i < e.ops.size(); ++i) {
    Value right = eval(*e.args[i + 1], f);
    const std::string& op = e.ops[i];
    bool ok;
    if (op == "==") ok = equal(left, right);
    else if (op == "!=") ok = !equal(left, right);
    else if (op == "<") ok = less(left, right);
    else if (op == "<=") ok = less(left, right) || equal(left, right);
    else if (op == ">") ok = less(right, left);
    else if (op == ">=") ok = less(right, left) || equal(left, right);
    else if (op == "in") ok = contains(right, left);
    else ok = !contains(right, left);  // notin
    if (!ok) return false;
    left = std::move(right);
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// Statements
// ---------------------------------------------------------------------------------------------
Context::Flow Context::exec(const Body& body, Frame& f, std::string& out) {
  for (const auto& s : body) {
    const Flow flow = exec_stmt(*s, f, out);
    if (flow != Flow::Normal) return flow;
  }
  return Flow::Normal;
}

namespace {

// Applies a filter chain whose innermost subject is the placeholder (null) to `subject`.
Value apply_chain(Context& ctx, const Expr& filter, Value subject, const std::function<CallArgs(const Expr&)>& args) {
  if (filter.args[0]) subject = apply_chain(ctx, *filter.args[0], std::move(subject), args);
  return apply_filter(ctx, filter.name, subject, args(filter));
}

}  // namespace

Context::Flow Context::exec_stmt(const Stmt& s, Frame& f, std::string& out) {
  Deeper guard(*this);
  try {
    switch (s.kind) {
      case StmtKind::Text: append_text(out, s.text, budget_); return Flow::Normal;
      case StmtKind::Output: append_str(out, eval(*s.expr, f), budget_); return Flow::Normal;
      case StmtKind::If:
        for (const auto& [cond, body] : s.branches)
          if (eval(*cond, f).truthy()) return exec(body, f, out);
        return exec(s.else_body, f, out);
      case StmtKind::For: return exec_for(s, f, out);
      case StmtKind::Set: assign(*s.target, eval(*s.expr, f), f); return Flow::Normal;
      case StmtKind::SetBlock:
      case StmtKind::FilterBlock: {
        std::string buf;
        exec(s.body, f, buf);
        Value v = Value::string(std::move(buf));
        if (s.expr) v = apply_chain(*this, *s.expr, std::move(v), [&](const Expr& x) { return eval_args(x, f, 1); });
        if (s.kind == StmtKind::SetBlock) f.vars[s.text] = std::move(v);
        else append_str(out, v, budget_);
        return Flow::Normal;
      }
      case StmtKind::Macro: define_macro(s, f); return Flow::Normal;
      case StmtKind::Break: return Flow::Break;
      case StmtKind::Continue: return Flow::Continue;
      case StmtKind::With: {
        Frame inner;
        inner.parent = &f;
        for (const auto& [name, expr] : s.params) inner.vars[name] = eval(*expr, f);
        return exec(s.body, inner, out);
      }
      case StmtKind::Scope: return exec(s.body, f, out);
    }
  } catch (Failure& x) {
    if (x.line == 0) {
      x.line = s.line;
      x.column = s.column;
    }
    throw;
  }
  return Flow::Normal;
}

Context::Flow Context::exec_for(const Stmt& s, Frame& f, std::string& out) {
  std::vector<Value> items = iterate(eval(*s.expr, f));
  if (s.cond) {  // {% for x in xs if cond %}: loop.length counts only the kept items
    std::vector<Value> kept;
    for (auto& item : items) {
      budget_.iteration();
      Frame probe;
      probe.parent = &f;
      assign(*s.target, item, probe);
      if (eval(*s.cond, probe).truthy()) kept.push_back(std::move(item));
    }
    items = std::move(kept);
  }
  if (items.empty()) return exec(s.else_body, f, out);
  const auto n = static_cast<int64_t>(items.size());
  for (int64_t i = 0; i < n; ++i) {
    budget_.iteration();
    Frame inner;
    inner.parent = &f;
    assign(*s.target, items[static_cast<size_t>(i)], inner);
    Dict loop;
    loop.set("index", Value::integer(i + 1));
    loop.set("index0", Value::integer(i));
    loop.set("revindex", Value::integer(n - i));
    loop.set("revindex0", Value::integer(n - i - 1));
    loop.set("first", Value::boolean(i == 0));
    loop.set("last", Value::boolean(i == n - 1));
    loop.set("length", Value::integer(n));
    loop.set("depth", Value::integer(1));
    loop.set("depth0", Value::integer(0));
    if (i > 0) loop.set("previtem", items[static_cast<size_t>(i - 1)]);
    if (i + 1 < n) loop.set("nextitem", items[static_cast<size_t>(i + 1)]);
    loop.set("cycle", Value::function(std::make_shared<const Function>(Function{
                          "cycle", [i](const CallArgs& a, Context&) {
                            if (a.positional.empty()) fail("no items for cycling given");
                            return a.positional[static_cast<size_t>(i) % a.positional.size()];
                          }})));
    inner.vars["loop"] = Value::dict(std::move(loop));
    if (exec(s.body, inner, out) == Flow::Break) break;
  }
  return Flow::Normal;
}

void Context::assign(const Expr& target, const Value& v, Frame& f) {
  if (target.kind == ExprKind::Name) {
    f.vars[target.name] = v;
    return;
  }
  if (target.kind == ExprKind::Tuple) {
    if (!v.is_list() && !v.is_string() && !v.is_dict())
      fail(std::string("cannot unpack non-iterable ") + v.type_name() + " object");
    const std::vector<Value> items = iterate(v);
    const size_t want = target.args.size();
    if (items.size() > want) fail("too many values to unpack (expected " + std::to_string(want) + ")");
    if (items.size() < want)
      fail("not enough values to unpack (expected " + std::to_string(want) + ", got " + std::to_string(items.size()) + ")");
    for (size_t i = 0; i < want; ++i) assign(*target.args[i], items[i], f);
    return;
  }
  // {% set ns.attr = v %}
  const Value obj = lookup(f, target.args[0]->name);
  if (obj.type() != Type::Namespace) fail("cannot assign attribute on non-namespace object");
  obj.as_namespace().attrs.set(target.name, v);
}

void Context::define_macro(const Stmt& s, Frame& f) {
  const Stmt* macro = &s;
  auto fn = std::make_shared<Function>();
  fn->name = s.text;
  // Macros see the template's top-level scope (never a loop frame that may be gone by the time a
  // macro stored in a namespace is called).
  fn->call = [macro](const CallArgs& a, Context& ctx) -> Value {
    ctx.budget_.iteration();
    Deeper guard(ctx);
    const auto& params = macro->params;
    if (a.positional.size() > params.size())
      fail("macro '" + macro->text + "' takes not more than " + std::to_string(params.size()) + " argument(s)");
    Frame frame;
    frame.parent = ctx.root_;
    std::vector<const Value*> given(params.size(), nullptr);
    for (size_t i = 0; i < a.positional.size(); ++i) given[i] = &a.positional[i];
    for (const auto& [k, v] : a.keyword) {
      size_t i = 0;
      while (i < params.size() && params[i].first != k) ++i;
      if (i == params.size()) fail("macro '" + macro->text + "' has no argument '" + k + "'");
      if (given[i] != nullptr) fail("macro '" + macro->text + "' got multiple values for argument '" + k + "'");
      given[i] = &v;
    }
    for (size_t i = 0; i < params.size(); ++i) {
      if (given[i] != nullptr) frame.vars[params[i].first] = *given[i];
      else if (params[i].second) frame.vars[params[i].first] = ctx.eval(*params[i].second, frame);
      else frame.vars[params[i].first] = Value::undefined("parameter '" + params[i].first + "' was not provided");
    }
    std::string out;
    ctx.exec(macro->body, frame, out);
    return Value::string(std::move(out));
  };
  f.vars[s.text] = Value::function(std::move(fn));
}

}  // namespace moebius::chat::jinja
