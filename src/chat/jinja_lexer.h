// The lexer of the Jinja subset: template source -> tokens, with whitespace control applied to the
// text between tags the way jinja2 does it under Hugging Face's settings (trim_blocks=True,
// lstrip_blocks=True, keep_trailing_newline=False):
//   * newlines (\r\n, \r, \n) become \n, and one trailing newline of the template is dropped;
//   * {%- / {{- / {#- strip all whitespace before the tag, -%} / -}} / -#} all whitespace after;
//   * trim_blocks: the first \n after %} or #} is dropped;
//   * lstrip_blocks: spaces and tabs from the start of a line up to {% or {# are dropped (not
//     before {{, and not after {%+).
// {# comments #} produce no tokens; {% raw %}...{% endraw %} produces one Text token.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace moebius::chat::jinja {

enum class Tok { Text, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, String, Int, Float, Op, Eof };

struct Token {
  Tok kind = Tok::Eof;
  std::string text;  // Text: the data; Name/Op: the spelling; String: the unescaped value
  int64_t int_value = 0;
  double float_value = 0;
  int line = 1;
  int column = 1;
};

// Throws Failure (with line and column) for an unterminated tag, comment or string, an
// unexpected character, or unbalanced brackets inside a tag.
std::vector<Token> lex(std::string_view source);

}  // namespace moebius::chat::jinja
