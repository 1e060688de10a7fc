// The syntax tree of the Jinja subset (jinja_parser.h builds it, jinja_eval.h runs it). One tagged
// node type for expressions and one for statements keep the interpreter a pair of switches.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "chat/jinja_value.h"

namespace moebius::chat::jinja {

enum class ExprKind {
  Literal,   // value
  Name,      // name
  List,      // args: items
  Tuple,     // args: items
  Dict,      // args: key0, value0, key1, value1, ...
  GetAttr,   // args[0].name  (x.y; also x.0, which is an item)
  GetItem,   // args[0][args[1]]
  Slice,     // args[0][args[1]:args[2]:args[3]], missing parts are null
  Call,      // args[0](args[1:], kwargs)
  Filter,    // args[0] | name(args[1:], kwargs); args[0] is null in {% filter %} blocks
  Test,      // args[0] is [not] name(args[1:], kwargs)
  Neg,       // -args[0]
  Pos,       // +args[0]
  Not,       // not args[0]
  Binary,    // args[0] op args[1] for op in + - * / // % **
  Concat,    // args[0] ~ args[1] ~ ...
  Compare,   // args[0] ops[0] args[1] ops[1] args[2] ... (chained, as Python)
  And,       // args[0] and args[1]
  Or,        // args[0] or args[1]
  Cond,      // args[1] if args[0] else args[2]; args[2] is null without else
};

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  ExprKind kind = ExprKind::Literal;
  int line = 0;
  int column = 0;
  int height = 1;       // of the subtree; the parser bounds it so evaluation cannot overflow the stack
  std::string name;     // Name, GetAttr, Filter, Test; the operator of Binary
  Value value;          // Literal
  std::vector<ExprPtr> args;
  std::vector<std::string> ops;  // Compare: ==, !=, <, <=, >, >=, in, notin
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  bool negated = false;  // Test: `is not`
};

enum class StmtKind {
  Text,         // text
  Output,       // {{ expr }}
  If,           // branches (condition, body) ..., else_body
  For,          // for target in expr [if cond]: body, else_body
  Set,          // set target = expr (target: Name, Tuple of Names, or GetAttr on a namespace)
  SetBlock,     // set text %}body{% endset  (text is the variable)
  Macro,        // macro text(params): body
  Break,
  Continue,
  With,         // with params: body (params are assignments)
  FilterBlock,  // filter expr: body (expr is a Filter whose subject is null)
  Scope,        // body run in place ({% generation %}, HF's assistant-mask marker)
};

struct Stmt;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

struct Stmt {
  StmtKind kind = StmtKind::Text;
  int line = 0;
  int column = 0;
  std::string text;
  ExprPtr expr;
  ExprPtr target;
  ExprPtr cond;
  std::vector<std::pair<ExprPtr, Body>> branches;
  Body body;
  Body else_body;
  std::vector<std::pair<std::string, ExprPtr>> params;  // Macro: defaults may be null
};

struct Template {
  Body body;
};

}  // namespace moebius::chat::jinja
