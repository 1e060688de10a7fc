// The parser of the Jinja subset: tokens -> Template, with jinja2's grammar and operator
// precedence (or < and < not < comparisons < + - < ~ < * / // % < ** < unary - < filters and
// tests < postfix . [] ()).
//
// Hostile input cannot exhaust the stack: expressions and blocks together may nest at most
// kMaxNesting deep, and no expression tree may be taller than kMaxHeight (a chain such as
// a+b+c+... is parsed in a loop but evaluated recursively). Both fail with a clear message.
#pragma once

#include <string_view>

#include "chat/jinja_ast.h"

namespace moebius::chat::jinja {

inline constexpr int kMaxNesting = 128;
inline constexpr int kMaxHeight = 256;

// Throws Failure (with line and column) for a syntax error, an unknown tag, filter or test, or a
// construct outside the subset (call blocks, extends/include/import, *args).
Template parse(std::string_view source);

}  // namespace moebius::chat::jinja
