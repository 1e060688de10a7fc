#include "chat/jinja_parser.h"

#include <algorithm>
#include <initializer_list>

#include "chat/jinja_builtins.h"
#include "chat/jinja_lexer.h"

namespace moebius::chat::jinja {
namespace {

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : toks_(std::move(tokens)) {}

  Template run() {
    Template t;
    std::string end;
    t.body = subparse({}, &end);
    return t;
  }

 private:
  // -- token stream ---------------------------------------------------------------------------
  const Token& cur() const { return toks_[pos_]; }
  const Token& peek(size_t k = 1) const { return toks_[std::min(pos_ + k, toks_.size() - 1)]; }
  const Token& next() {
    const Token& t = toks_[pos_];
    if (pos_ + 1 < toks_.size()) ++pos_;
    return t;
  }
  bool is_op(std::string_view op) const { return cur().kind == Tok::Op && cur().text == op; }
  bool is_name(std::string_view n) const { return cur().kind == Tok::Name && cur().text == n; }
  bool skip_op(std::string_view op) {
    if (!is_op(op)) return false;
    next();
    return true;
  }
  bool skip_name(std::string_view n) {
    if (!is_name(n)) return false;
    next();
    return true;
  }

  [[noreturn]] void error_at(const Token& t, std::string message) const {
    throw Failure{std::move(message), t.line, t.column};
  }
  static std::string describe(const Token& t) {
    switch (t.kind) {
      case Tok::Eof: return "end of template";
      case Tok::Text: return "template text";
      case Tok::VarEnd: case Tok::BlockEnd: return "end of tag '" + t.text + "'";
      case Tok::String: return "string";
      default: return "'" + t.text + "'";
    }
  }
  void expect_op(std::string_view op) {
    if (!skip_op(op)) error_at(cur(), "expected '" + std::string(op) + "', got " + describe(cur()));
  }
  std::string expect_name() {
    if (cur().kind != Tok::Name) error_at(cur(), "expected a name, got " + describe(cur()));
    return next().text;
  }
  void expect_block_end() {
    if (cur().kind != Tok::BlockEnd) error_at(cur(), "expected end of statement '%}', got " + describe(cur()));
    next();
  }

  // Nesting guard for recursive descent: blocks and bracketed/unary expressions.
  struct Deeper {
    Deeper(Parser& p, const Token& at) : p(p) {
      if (++p.depth_ > kMaxNesting)
        p.error_at(at, "template nested too deeply (more than " + std::to_string(kMaxNesting) + " levels)");
    }
    ~Deeper() { --p.depth_; }
    Parser& p;
  };

  // -- nodes ----------------------------------------------------------------------------------
  ExprPtr node(ExprKind kind, const Token& at) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = at.line;
    e->column = at.column;
    return e;
  }
  // Call after the children are attached: bounds the tree height.
  ExprPtr seal(ExprPtr e) {
    int h = 0;
    for (const auto& a : e->args) if (a) h = std::max(h, a->height);
    for (const auto& [k, a] : e->kwargs) if (a) h = std::max(h, a->height);
    e->height = h + 1;
    if (e->height > kMaxHeight)
      throw Failure{"expression nested too deeply (more than " + std::to_string(kMaxHeight) + " levels)", e->line, e->column};
    return e;
  }
  ExprPtr unary(ExprKind kind, const Token& at, ExprPtr a) {
    auto e = node(kind, at);
    e->args.push_back(std::move(a));
    return seal(std::move(e));
  }
  ExprPtr binary(ExprKind kind, const Token& at, ExprPtr a, ExprPtr b, std::string op = {}) {
    auto e = node(kind, at);
    e->name = std::move(op);
    e->args.push_back(std::move(a));
    e->args.push_back(std::move(b));
    return seal(std::move(e));
  }

  // -- statements -----------------------------------------------------------------------------
  // Parses until a {% tag %} whose name is in `ends`, consuming `{% name` (the caller reads the
  // rest of that tag), and stores the name in *end. With `ends` empty, parses to the end.
  Body subparse(std::initializer_list<std::string_view> ends, std::string* end) {
    Body body;
    while (true) {
      const Token& t = cur();
      if (t.kind == Tok::Eof) {
        if (ends.size() == 0) return body;
        std::string names;
        for (auto e : ends) names += (names.empty() ? "'" : " or '") + std::string(e) + "'";
        error_at(t, "unexpected end of template; expected " + names);
      }
      if (t.kind == Tok::Text) {
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::Text;
        s->line = t.line;
        s->column = t.column;
        s->text = t.text;
        body.push_back(std::move(s));
        next();
        continue;
      }
      if (t.kind == Tok::VarBegin) {
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::Output;
        s->line = t.line;
        s->column = t.column;
        next();
        s->expr = parse_tuple();
        if (cur().kind != Tok::VarEnd) error_at(cur(), "expected end of print statement '}}', got " + describe(cur()));
        next();
        body.push_back(std::move(s));
        continue;
      }
      if (t.kind != Tok::BlockBegin) error_at(t, "unexpected " + describe(t));
      const Token& name = peek();
      if (name.kind == Tok::Name && std::find(ends.begin(), ends.end(), name.text) != ends.end()) {
        next();
        *end = next().text;
        return body;
      }
      next();
      body.push_back(parse_statement());
    }
  }

  StmtPtr stmt(StmtKind kind, const Token& at) {
    auto s = std::make_unique<Stmt>();
    s->kind = kind;
    s->line = at.line;
    s->column = at.column;
    return s;
  }

  StmtPtr parse_statement() {
    const Token& t = cur();
    if (t.kind != Tok::Name) error_at(t, "expected a tag name, got " + describe(t));
    Deeper guard(*this, t);
    const std::string& n = t.text;
    if (n == "if") return parse_if();
    if (n == "for") return parse_for();
    if (n == "set") return parse_set();
    if (n == "macro") return parse_macro();
    if (n == "with") return parse_with();
    if (n == "filter") return parse_filter_block();
    if (n == "generation") {
      auto s = stmt(StmtKind::Scope, next());
      expect_block_end();
      std::string end;
      s->body = subparse({"endgeneration"}, &end);
      expect_block_end();
      return s;
    }
    if (n == "break" || n == "continue") {
      if (loops_ == 0) error_at(t, "'" + n + "' outside of a loop");
      auto s = stmt(n == "break" ? StmtKind::Break : StmtKind::Continue, next());
      expect_block_end();
      return s;
    }
    if (n.rfind("end", 0) == 0 || n == "elif" || n == "else")
      error_at(t, "unexpected '" + n + "' (no block to close)");
    error_at(t, "unsupported or unknown tag '" + n + "'");
  }

  StmtPtr parse_if() {
    auto s = stmt(StmtKind::If, next());
    while (true) {
      ExprPtr cond = parse_tuple();
      expect_block_end();
      std::string end;
      Body body = subparse({"elif", "else", "endif"}, &end);
      s->branches.emplace_back(std::move(cond), std::move(body));
      if (end == "elif") continue;
      if (end == "else") {
        expect_block_end();
        s->else_body = subparse({"endif"}, &end);
      }
      expect_block_end();
      return s;
    }
  }

  StmtPtr parse_for() {
    auto s = stmt(StmtKind::For, next());
    s->target = parse_assign_target(/*allow_attr=*/false, /*stop_at_in=*/true);
    if (!skip_name("in")) error_at(cur(), "expected 'in' in for loop, got " + describe(cur()));
    s->expr = parse_tuple(/*with_condexpr=*/false);
    if (skip_name("if")) s->cond = parse_expression();
    if (is_name("recursive")) error_at(cur(), "recursive for loops are not supported");
    expect_block_end();
    std::string end;
    ++loops_;
    s->body = subparse({"else", "endfor"}, &end);
    --loops_;
    if (end == "else") {
      expect_block_end();
      s->else_body = subparse({"endfor"}, &end);
    }
    expect_block_end();
    return s;
  }

  StmtPtr parse_set() {
    const Token& at = next();
    ExprPtr target = parse_assign_target(/*allow_attr=*/true, /*stop_at_in=*/false);
    if (skip_op("=")) {
      auto s = stmt(StmtKind::Set, at);
      s->target = std::move(target);
      s->expr = parse_tuple();
      expect_block_end();
      return s;
    }
    if (target->kind != ExprKind::Name) error_at(cur(), "expected '=' in set");
    auto s = stmt(StmtKind::SetBlock, at);
    s->text = target->name;
    if (is_op("|")) {
      // {% set x | filter %}...{% endset %}: the filters apply to the rendered body.
      next();
      s->expr = parse_filter_chain(nullptr, /*one=*/false);
    }
    expect_block_end();
    std::string end;
    const int saved = loops_;
    loops_ = 0;  // break/continue cannot cross a set block
    s->body = subparse({"endset"}, &end);
    loops_ = saved;
    expect_block_end();
    return s;
  }

  StmtPtr parse_macro() {
    auto s = stmt(StmtKind::Macro, next());
    s->text = expect_name();
    expect_op("(");
    while (!is_op(")")) {
      if (!s->params.empty()) expect_op(",");
      if (is_op(")")) break;
      std::string p = expect_name();
      ExprPtr def;
      if (skip_op("=")) def = parse_expression();
      s->params.emplace_back(std::move(p), std::move(def));
    }
    next();
    expect_block_end();
    std::string end;
    const int saved = loops_;
    loops_ = 0;
    s->body = subparse({"endmacro"}, &end);
    loops_ = saved;
    if (cur().kind == Tok::Name) next();  // {% endmacro name %}
    expect_block_end();
    return s;
  }

  StmtPtr parse_with() {
    auto s = stmt(StmtKind::With, next());
    while (cur().kind != Tok::BlockEnd) {
      if (!s->params.empty()) expect_op(",");
      std::string n = expect_name();
      expect_op("=");
      s->params.emplace_back(std::move(n), parse_expression());
    }
    expect_block_end();
    std::string end;
    s->body = subparse({"endwith"}, &end);
    expect_block_end();
    return s;
  }

  StmtPtr parse_filter_block() {
    auto s = stmt(StmtKind::FilterBlock, next());
    s->expr = parse_filter_chain(nullptr, /*one=*/false);
    expect_block_end();
    std::string end;
    s->body = subparse({"endfilter"}, &end);
    expect_block_end();
    return s;
  }

  // `x`, `a, b`, `(a, b)` or (set only) `ns.attr`.
  ExprPtr parse_assign_target(bool allow_attr, bool stop_at_in) {
    const Token& at = cur();
    auto one = [&]() -> ExprPtr {
      const Token& t = cur();
      std::string n = expect_name();
      auto e = node(ExprKind::Name, t);
      e->name = std::move(n);
      if (allow_attr && is_op(".")) {
        next();
        auto g = node(ExprKind::GetAttr, t);
        g->name = expect_name();
        g->args.push_back(std::move(e));
        return seal(std::move(g));
      }
      return e;
    };
    if (skip_op("(")) {
      auto tup = node(ExprKind::Tuple, at);
      while (!is_op(")")) {
        if (!tup->args.empty()) expect_op(",");
        if (is_op(")")) break;
        tup->args.push_back(one());
      }
      next();
      return seal(std::move(tup));
    }
    ExprPtr first = one();
    if (!is_op(",")) return first;
    auto tup = node(ExprKind::Tuple, at);
    tup->args.push_back(std::move(first));
    while (skip_op(",")) {
      if (cur().kind != Tok::Name || (stop_at_in && is_name("in"))) break;
      tup->args.push_back(one());
    }
    return seal(std::move(tup));
  }

  // -- expressions ----------------------------------------------------------------------------
  bool is_tuple_end() const {
    return cur().kind == Tok::VarEnd || cur().kind == Tok::BlockEnd || cur().kind == Tok::Eof || is_op(")");
  }

  // `a` or `a, b, ...` (a tuple without parentheses).
  ExprPtr parse_tuple(bool with_condexpr = true) {
    const Token& at = cur();
    std::vector<ExprPtr> items;
    bool tuple = false;
    while (true) {
      if (!items.empty()) {
        if (!skip_op(",")) break;
        tuple = true;
      }
      if (!items.empty() && is_tuple_end()) break;
      items.push_back(with_condexpr ? parse_expression() : parse_or());
      if (!is_op(",")) break;
    }
    if (!tuple) return std::move(items[0]);
    auto e = node(ExprKind::Tuple, at);
    e->args = std::move(items);
    return seal(std::move(e));
  }

  ExprPtr parse_expression() {
    Deeper guard(*this, cur());
    ExprPtr e = parse_or();
    while (is_name("if")) {
      const Token& at = next();
      ExprPtr cond = parse_or();
      ExprPtr other;
      if (skip_name("else")) other = parse_expression();
      auto c = node(ExprKind::Cond, at);
      c->args.push_back(std::move(cond));
      c->args.push_back(std::move(e));
      c->args.push_back(std::move(other));
      e = seal(std::move(c));
    }
    return e;
  }

  ExprPtr parse_or() {
    ExprPtr e = parse_and();
    while (is_name("or")) {
      const Token& at = next();
      e = binary(ExprKind::Or, at, std::move(e), parse_and());
    }
    return e;
  }

  ExprPtr parse_and() {
    ExprPtr e = parse_not();
    while (is_name("and")) {
      const Token& at = next();
      e = binary(ExprKind::And, at, std::move(e), parse_not());
    }
    return e;
  }

  ExprPtr parse_not() {
    if (is_name("not")) {
      const Token& at = next();
      Deeper guard(*this, at);
      return unary(ExprKind::Not, at, parse_not());
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    const Token& at = cur();
    ExprPtr first = parse_math1();
    std::vector<std::string> ops;
    std::vector<ExprPtr> rest;
    while (true) {
      if (cur().kind == Tok::Op && (cur().text == "==" || cur().text == "!=" || cur().text == "<" ||
                                    cur().text == "<=" || cur().text == ">" || cur().text == ">=")) {
        ops.push_back(next().text);
      } else if (is_name("in")) {
        next();
        ops.push_back("in");
      } else if (is_name("not") && peek().kind == Tok::Name && peek().text == "in") {
        next();
        next();
        ops.push_back("notin");
      } else {
        break;
      }
      rest.push_back(parse_math1());
    }
    if (ops.empty()) return first;
    auto e = node(ExprKind::Compare, at);
    e->args.push_back(std::move(first));
    for (auto& r : rest) e->args.push_back(std::move(r));
    e->ops = std::move(ops);
    return seal(std::move(e));
  }

  ExprPtr parse_math1() {
    ExprPtr e = parse_concat();
    while (is_op("+") || is_op("-")) {
      const Token& at = next();
      e = binary(ExprKind::Binary, at, std::move(e), parse_concat(), at.text);
    }
    return e;
  }

  ExprPtr parse_concat() {
    const Token& at = cur();
    ExprPtr e = parse_math2();
    if (!is_op("~")) return e;
    auto c = node(ExprKind::Concat, at);
    c->args.push_back(std::move(e));
    while (skip_op("~")) c->args.push_back(parse_math2());
    return seal(std::move(c));
  }

  ExprPtr parse_math2() {
    ExprPtr e = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Token& at = next();
      e = binary(ExprKind::Binary, at, std::move(e), parse_pow(), at.text);
    }
    return e;
  }

  ExprPtr parse_pow() {
    ExprPtr e = parse_unary();
    while (is_op("**")) {
      const Token& at = next();
      e = binary(ExprKind::Binary, at, std::move(e), parse_unary(), "**");
    }
    return e;
  }

  ExprPtr parse_unary(bool with_filter = true) {
    ExprPtr e;
    if (is_op("-") || is_op("+")) {
      const Token& at = next();
      Deeper guard(*this, at);
      e = unary(at.text == "-" ? ExprKind::Neg : ExprKind::Pos, at, parse_unary(false));
    } else {
      e = parse_primary();
    }
    e = parse_postfix(std::move(e));
    if (with_filter) e = parse_filter_expr(std::move(e));
    return e;
  }

  ExprPtr parse_primary() {
    const Token& t = cur();
    switch (t.kind) {
      case Tok::Name: {
        next();
        if (t.text == "true" || t.text == "True") return literal(t, Value::boolean(true));
        if (t.text == "false" || t.text == "False") return literal(t, Value::boolean(false));
        if (t.text == "none" || t.text == "None") return literal(t, Value::none());
        auto e = node(ExprKind::Name, t);
        e->name = t.text;
        return e;
      }
      case Tok::String: {
        std::string s = next().text;
        while (cur().kind == Tok::String) s += next().text;  // "a" "b" is "ab"
        return literal(t, Value::string(std::move(s)));
      }
      case Tok::Int: next(); return literal(t, Value::integer(t.int_value));
      case Tok::Float: next(); return literal(t, Value::number(t.float_value));
      case Tok::Op:
        if (t.text == "(") {
          next();
          Deeper guard(*this, t);
          if (skip_op(")")) {
            auto e = node(ExprKind::Tuple, t);
            return e;
          }
          ExprPtr e = parse_tuple();
          expect_op(")");
          return e;
        }
        if (t.text == "[") {
          next();
          Deeper guard(*this, t);
          auto e = node(ExprKind::List, t);
          while (!is_op("]")) {
            if (!e->args.empty()) expect_op(",");
            if (is_op("]")) break;
            e->args.push_back(parse_expression());
          }
          next();
          return seal(std::move(e));
        }
        if (t.text == "{") {
          next();
          Deeper guard(*this, t);
          auto e = node(ExprKind::Dict, t);
          while (!is_op("}")) {
            if (!e->args.empty()) expect_op(",");
            if (is_op("}")) break;
            e->args.push_back(parse_expression());
            expect_op(":");
            e->args.push_back(parse_expression());
          }
          next();
          return seal(std::move(e));
        }
        break;
      default: break;
    }
    error_at(t, "unexpected " + describe(t) + "; expected an expression");
  }

  ExprPtr literal(const Token& t, Value v) {
    auto e = node(ExprKind::Literal, t);
    e->value = std::move(v);
    return e;
  }

  ExprPtr parse_postfix(ExprPtr e) {
    while (true) {
      if (is_op(".")) {
        const Token& at = next();
        if (cur().kind == Tok::Name) {
          auto g = node(ExprKind::GetAttr, at);
          g->name = next().text;
          g->args.push_back(std::move(e));
          e = seal(std::move(g));
        } else if (cur().kind == Tok::Int) {
          auto g = node(ExprKind::GetItem, at);
          g->args.push_back(std::move(e));
          g->args.push_back(literal(cur(), Value::integer(cur().int_value)));
          next();
          e = seal(std::move(g));
        } else {
          error_at(cur(), "expected an attribute name after '.', got " + describe(cur()));
        }
      } else if (is_op("[")) {
        e = parse_subscript(std::move(e));
      } else if (is_op("(")) {
        e = parse_call(std::move(e));
      } else {
        return e;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr e) {
    const Token& at = next();  // [
    Deeper guard(*this, at);
    auto slice_part = [&]() -> ExprPtr {
      if (is_op(":") || is_op("]") || is_op(",")) return nullptr;
      return parse_expression();
    };
    ExprPtr start = slice_part();
    if (is_op(":")) {
      next();
      auto s = node(ExprKind::Slice, at);
      s->args.push_back(std::move(e));
      s->args.push_back(std::move(start));
      s->args.push_back(slice_part());
      if (skip_op(":")) s->args.push_back(slice_part());
      else s->args.push_back(nullptr);
      expect_op("]");
      return seal(std::move(s));
    }
    if (!start) error_at(cur(), "expected an index, got " + describe(cur()));
    if (is_op(",")) {  // x[a, b] indexes with a tuple
      auto tup = node(ExprKind::Tuple, at);
      tup->args.push_back(std::move(start));
      while (skip_op(",")) {
        if (is_op("]")) break;
        tup->args.push_back(parse_expression());
      }
      start = seal(std::move(tup));
    }
    expect_op("]");
    auto g = node(ExprKind::GetItem, at);
    g->args.push_back(std::move(e));
    g->args.push_back(std::move(start));
    return seal(std::move(g));
  }

  // (args) appended to `e`'s positional args / kwargs; e is a Call, Filter or Test node.
  void parse_args(Expr& e) {
    expect_op("(");
    Deeper guard(*this, cur());
    bool first = true;
    while (!is_op(")")) {
      if (!first) expect_op(",");
      first = false;
      if (is_op(")")) break;
      if (is_op("*") || is_op("**")) error_at(cur(), "*args and **kwargs in calls are not supported");
      if (cur().kind == Tok::Name && peek().kind == Tok::Op && peek().text == "=") {
        std::string k = next().text;
        next();
        e.kwargs.emplace_back(std::move(k), parse_expression());
      } else {
        if (!e.kwargs.empty()) error_at(cur(), "positional argument after keyword argument");
        e.args.push_back(parse_expression());
      }
    }
    next();
  }

  ExprPtr parse_call(ExprPtr callee) {
    auto c = node(ExprKind::Call, cur());
    c->args.push_back(std::move(callee));
    parse_args(*c);
    return seal(std::move(c));
  }

  ExprPtr parse_filter_expr(ExprPtr e) {
    while (true) {
      if (is_op("|")) {
        next();
        e = parse_filter_chain(std::move(e), /*one=*/true);
      } else if (is_name("is")) {
        e = parse_test(std::move(e));
      } else if (is_op("(")) {
        e = parse_call(std::move(e));
      } else {
        return e;
      }
    }
  }

  // name[(args)] [| name[(args)] ...]; with one=true only the first filter.
  ExprPtr parse_filter_chain(ExprPtr subject, bool one) {
    while (true) {
      const Token& nt = cur();
      std::string name = expect_name();
      if (!is_filter(name)) error_at(nt, "no filter named '" + name + "' (not supported)");
      auto f = node(ExprKind::Filter, nt);
      f->name = std::move(name);
      f->args.push_back(std::move(subject));
      if (is_op("(")) parse_args(*f);
      subject = seal(std::move(f));
      if (one || !skip_op("|")) return subject;
    }
  }

  ExprPtr parse_test(ExprPtr subject) {
    next();  // is
    const bool negated = skip_name("not");
    const Token& nt = cur();
    std::string name = expect_name();
    if (!is_test(name)) error_at(nt, "no test named '" + name + "' (not supported)");
    auto t = node(ExprKind::Test, nt);
    t->name = std::move(name);
    t->negated = negated;
    t->args.push_back(std::move(subject));
    if (is_op("(")) {
      parse_args(*t);
    } else if ((cur().kind == Tok::Name || cur().kind == Tok::String || cur().kind == Tok::Int ||
                cur().kind == Tok::Float || is_op("(") || is_op("[") || is_op("{")) &&
               !is_name("else") && !is_name("or") && !is_name("and") && !is_name("if")) {
      // `x is divisibleby 3`, `x is sameas false`: one argument without parentheses.
      if (is_name("is")) error_at(cur(), "unexpected 'is'");
      t->args.push_back(parse_postfix(parse_primary()));
    }
    return seal(std::move(t));
  }

  std::vector<Token> toks_;
  size_t pos_ = 0;
  int depth_ = 0;
  int loops_ = 0;
};

}  // namespace

Template parse(std::string_view source) { return Parser(lex(source)).run(); }

}  // namespace moebius::chat::jinja
