#include "chat/jinja_lexer.h"

#include <algorithm>
#include <charconv>
#include <cmath>

#include "chat/jinja_value.h"

namespace moebius::chat::jinja {
namespace {

bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_name_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_name_char(char c) { return is_name_start(c) || is_digit(c); }

// One Python-whitespace code point at s[pos] (Python's \s), or 0.
size_t space_at(std::string_view s, size_t pos) {
  if (pos >= s.size()) return 0;
  const auto b = static_cast<unsigned char>(s[pos]);
  if (b < 0x80) return is_space(s.substr(pos, 1)) ? 1 : 0;
  const size_t n = b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : 2;
  if (pos + n > s.size()) return 0;
  return is_space(s.substr(pos, n)) ? n : 0;
}

size_t skip_spaces(std::string_view s, size_t pos) {
  while (size_t n = space_at(s, pos)) pos += n;
  return pos;
}

// Python's unicode-escape decoding of a string literal's body, which is what jinja2 applies:
// \n \t \r \\ \' \" \a \b \f \v \ooo \xhh \uhhhh \Uhhhhhhhh; any other backslash stays as it is.
std::string unescape(std::string_view body) {
  std::string out;
  for (size_t i = 0; i < body.size(); ++i) {
    if (body[i] != '\\' || i + 1 == body.size()) { out += body[i]; continue; }
    const char c = body[++i];
    auto hex = [&](size_t digits) -> bool {
      if (i + 1 + digits > body.size()) return false;
      uint32_t v = 0;
      for (size_t k = 1; k <= digits; ++k) {
        const char h = body[i + k];
        const int d = is_digit(h) ? h - '0' : (h >= 'a' && h <= 'f') ? h - 'a' + 10 : (h >= 'A' && h <= 'F') ? h - 'A' + 10 : -1;
        if (d < 0) return false;
        v = v * 16 + static_cast<uint32_t>(d);
      }
      if (v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) return false;
      i += digits;
      // UTF-8 encode
      if (v < 0x80) out += static_cast<char>(v);
      else if (v < 0x800) { out += static_cast<char>(0xC0 | (v >> 6)); out += static_cast<char>(0x80 | (v & 0x3F)); }
      else if (v < 0x10000) {
        out += static_cast<char>(0xE0 | (v >> 12));
        out += static_cast<char>(0x80 | ((v >> 6) & 0x3F));
        out += static_cast<char>(0x80 | (v & 0x3F));
      } else {
        out += static_cast<char>(0xF0 | (v >> 18));
        out += static_cast<char>(0x80 | ((v >> 12) & 0x3F));
        out += static_cast<char>(0x80 | ((v >> 6) & 0x3F));
        out += static_cast<char>(0x80 | (v & 0x3F));
      }
      return true;
    };
    switch (c) {
      case 'n': out += '\n'; break;
      case 't': out += '\t'; break;
      case 'r': out += '\r'; break;
      case '\\': out += '\\'; break;
      case '\'': out += '\''; break;
      case '"': out += '"'; break;
      case 'a': out += '\a'; break;
      case 'b': out += '\b'; break;
      case 'f': out += '\f'; break;
      case 'v': out += '\v'; break;
      case '\n': break;  // a backslash-newline continues the line
      case 'x': if (!hex(2)) fail("invalid \\x escape in a string literal"); break;
      case 'u': if (!hex(4)) fail("invalid \\u escape in a string literal"); break;
      case 'U': if (!hex(8)) fail("invalid \\U escape in a string literal"); break;
      default:
        if (c >= '0' && c <= '7') {
          uint32_t v = 0;
          size_t k = 0;
          for (; k < 3 && i + k < body.size() && body[i + k] >= '0' && body[i + k] <= '7'; ++k) v = v * 8 + static_cast<uint32_t>(body[i + k] - '0');
          i += k - 1;
          if (v < 0x80) out += static_cast<char>(v);
          else { out += static_cast<char>(0xC0 | (v >> 6)); out += static_cast<char>(0x80 | (v & 0x3F)); }
        } else {
          out += '\\';
          out += c;
        }
    }
  }
  return out;
}

class Lexer {
 public:
  explicit Lexer(std::string_view raw) {
    // Newlines become \n and one trailing newline goes (keep_trailing_newline=False).
    src_.reserve(raw.size());
    for (size_t i = 0; i < raw.size(); ++i) {
      if (raw[i] == '\r') {
        src_ += '\n';
        if (i + 1 < raw.size() && raw[i + 1] == '\n') ++i;
      } else {
        src_ += raw[i];
      }
    }
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
    line_starts_.push_back(0);
    for (size_t i = 0; i < src_.size(); ++i)
      if (src_[i] == '\n') line_starts_.push_back(i + 1);
  }

  std::vector<Token> run() {
    const std::string_view s = src_;
    size_t pos = 0;
    bool line_starting = true;  // the previous token ended a line (for lstrip_blocks)
    while (pos < s.size()) {
      const size_t open = find_open(pos);
      if (open == std::string_view::npos) {
        emit_text(std::string(s.substr(pos)), pos);
        break;
      }
      const char kind = s[open + 1];  // '{', '%' or '#'
      size_t p = open + 2;
      const char sign = p < s.size() && (s[p] == '-' || s[p] == '+') ? s[p] : 0;
      if (sign) ++p;
      std::string_view text = s.substr(pos, open - pos);
      const bool raw = kind == '%' && is_raw_begin(p);
      text = strip_before(text, sign, kind == '{', line_starting);
      emit_text(std::string(text), pos);

      if (kind == '#') {
        const size_t close = s.find("#}", p);
        if (close == std::string_view::npos) throw at(open, "missing end of comment tag");
        pos = close + 2;
        if (close > p && s[close - 1] == '-') pos = skip_spaces(s, pos);
        else if (!(close > p && s[close - 1] == '+') && pos < s.size() && s[pos] == '\n') ++pos;
        line_starting = s[pos - 1] == '\n';
        continue;
      }
      if (raw) {
        pos = lex_raw(open, p, line_starting);
        continue;
      }
      push(kind == '{' ? Tok::VarBegin : Tok::BlockBegin, open, std::string(s.substr(open, p - open)));
      pos = lex_tag(kind == '{', p, open);
      line_starting = s[pos - 1] == '\n';
    }
    push(Tok::Eof, s.size(), "");
    return std::move(tokens_);
  }

 private:
  Failure at(size_t pos, std::string message) const {
    const auto it = std::upper_bound(line_starts_.begin(), line_starts_.end(), pos) - 1;
    return Failure{std::move(message), static_cast<int>(it - line_starts_.begin()) + 1,
                   static_cast<int>(pos - *it) + 1};
  }

  void push(Tok kind, size_t pos, std::string text) {
    Token t;
    t.kind = kind;
    t.text = std::move(text);
    const Failure where = at(pos, "");
    t.line = where.line;
    t.column = where.column;
    tokens_.push_back(std::move(t));
  }

  void emit_text(std::string text, size_t pos) {
    if (!text.empty()) push(Tok::Text, pos, std::move(text));
  }

  size_t find_open(size_t pos) const {
    for (size_t i = src_.find('{', pos); i != std::string::npos; i = src_.find('{', i + 1))
      if (i + 1 < src_.size() && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) return i;
    return std::string_view::npos;
  }

  // Whitespace control on the text before a tag: '-' strips all trailing whitespace; otherwise,
  // before {% and {#, lstrip_blocks drops the spaces between the start of the line and the tag.
  static std::string_view strip_before(std::string_view text, char sign, bool variable, bool line_starting) {
    if (sign == '-') return strip(text, nullptr, false, true);
    if (sign == '+' || variable) return text;
    const size_t nl = text.rfind('\n');
    const size_t l_pos = nl == std::string_view::npos ? 0 : nl + 1;
    if (l_pos == 0 && !line_starting) return text;
    if (l_pos == text.size()) return text;
    if (skip_spaces(text, l_pos) != text.size()) return text;
    return text.substr(0, l_pos);
  }

  // `raw` then the end of the tag, right after {% (and its sign).
  bool is_raw_begin(size_t p) const {
    const std::string_view s = src_;
    p = skip_spaces(s, p);
    if (s.compare(p, 3, "raw") != 0) return false;
    p = skip_spaces(s, p + 3);
    return s.compare(p, 2, "%}") == 0 || s.compare(p, 3, "-%}") == 0;
  }

  size_t lex_raw(size_t open, size_t p, bool& line_starting) {
    const std::string_view s = src_;
    p = skip_spaces(s, skip_spaces(s, p) + 3);
    p = s[p] == '-' ? skip_spaces(s, p + 3) : p + 2;  // no trim_blocks after {% raw %}, as jinja2
    const bool body_line_starting = s[p - 1] == '\n';
    for (size_t q = s.find("{%", p); q != std::string_view::npos; q = s.find("{%", q + 1)) {
      size_t r = q + 2;
      const char sign = r < s.size() && (s[r] == '-' || s[r] == '+') ? s[r] : 0;
      if (sign) ++r;
      r = skip_spaces(s, r);
      if (s.compare(r, 6, "endraw") != 0) continue;
      r = skip_spaces(s, r + 6);
      size_t end;
      if (s.compare(r, 3, "+%}") == 0) end = r + 3;
      else if (s.compare(r, 3, "-%}") == 0) end = skip_spaces(s, r + 3);
      else if (s.compare(r, 2, "%}") == 0) end = r + 2 + (r + 2 < s.size() && s[r + 2] == '\n' ? 1 : 0);
      else continue;
      emit_text(std::string(strip_before(s.substr(p, q - p), sign, false, body_line_starting)), p);
      line_starting = s[end - 1] == '\n';
      return end;
    }
    throw at(open, "missing end of raw directive");
  }

  // Tokens inside {{ }} or {% %}, from p to the end of the tag; returns the position after it.
  size_t lex_tag(bool variable, size_t p, size_t open) {
    const std::string_view s = src_;
    std::vector<char> balance;  // closing brackets still expected; the tag cannot end inside them
    while (true) {
      if (p >= s.size()) throw at(open, variable ? "unexpected end of template: '}}' expected" : "unexpected end of template: '%}' expected");
      if (balance.empty()) {
        const std::string_view close = variable ? "}}" : "%}";
        if (!variable && s.compare(p, 3, "+%}") == 0) {
          push(Tok::BlockEnd, p, "+%}");
          return p + 3;
        }
        if (s.compare(p, 1, "-") == 0 && s.compare(p + 1, 2, close) == 0) {
          push(variable ? Tok::VarEnd : Tok::BlockEnd, p, std::string(s.substr(p, 3)));
          return skip_spaces(s, p + 3);
        }
        if (s.compare(p, 2, close) == 0) {
          push(variable ? Tok::VarEnd : Tok::BlockEnd, p, std::string(close));
          p += 2;
          if (!variable && p < s.size() && s[p] == '\n') ++p;  // trim_blocks
          return p;
        }
      }
      if (size_t n = space_at(s, p)) { p += n; continue; }
      const char c = s[p];
      if (is_digit(c)) { p = lex_number(p); continue; }
      if (is_name_start(c)) {
        size_t e = p;
        while (e < s.size() && is_name_char(s[e])) ++e;
        push(Tok::Name, p, std::string(s.substr(p, e - p)));
        p = e;
        continue;
      }
      if (c == '\'' || c == '"') {
        size_t e = p + 1;
        while (e < s.size() && s[e] != c) e += s[e] == '\\' ? 2 : 1;
        if (e >= s.size()) throw at(p, "unterminated string literal");
        try {
          push(Tok::String, p, unescape(s.substr(p + 1, e - p - 1)));
        } catch (Failure& f) {
          throw at(p, f.message);
        }
        p = e + 1;
        continue;
      }
      static constexpr std::string_view kTwo[] = {"//", "**", "==", "!=", ">=", "<="};
      size_t len = 0;
      for (std::string_view op : kTwo)
        if (s.compare(p, 2, op) == 0) len = 2;
      if (len == 0 && std::string_view("+-/*%~[](){}<>=.:|,;").find(c) != std::string_view::npos) len = 1;
      if (len == 0) throw at(p, std::string("unexpected character '") + c + "'");
      if (c == '(' || c == '[' || c == '{') {
        balance.push_back(c == '(' ? ')' : c == '[' ? ']' : '}');
      } else if (c == ')' || c == ']' || c == '}') {
        if (balance.empty()) throw at(p, std::string("unexpected '") + c + "'");
        if (balance.back() != c) throw at(p, std::string("unexpected '") + c + "', expected '" + balance.back() + "'");
        balance.pop_back();
      }
      push(Tok::Op, p, std::string(s.substr(p, len)));
      p += len;
    }
  }

  // Digits with single underscores between them: (\d+_)*\d+.
  size_t digits(size_t p) const {
    const std::string_view s = src_;
    if (p >= s.size() || !is_digit(s[p])) return p;
    while (p < s.size()) {
      while (p < s.size() && is_digit(s[p])) ++p;
      if (p + 1 < s.size() && s[p] == '_' && is_digit(s[p + 1])) { ++p; continue; }
      break;
    }
    return p;
  }

  size_t lex_number(size_t p) {
    const std::string_view s = src_;
    auto clean = [](std::string_view t) {
      std::string out;
      for (char c : t) if (c != '_') out += c;
      return out;
    };
    // 0b / 0o / 0x integers
    if (s[p] == '0' && p + 2 < s.size()) {
      const char k = static_cast<char>(s[p + 1] | 0x20);
      const int base = k == 'b' ? 2 : k == 'o' ? 8 : k == 'x' ? 16 : 0;
      if (base) {
        size_t e = p + 2;
        auto ok = [&](char c) {
          const char l = static_cast<char>(c | 0x20);
          return base == 16 ? (is_digit(c) || (l >= 'a' && l <= 'f')) : (c >= '0' && c < '0' + base);
        };
        while (e < s.size() && (ok(s[e]) || (s[e] == '_' && e + 1 < s.size() && ok(s[e + 1])))) ++e;
        if (e > p + 2) {
          const std::string t = clean(s.substr(p + 2, e - p - 2));
          uint64_t v = 0;
          auto r = std::from_chars(t.data(), t.data() + t.size(), v, base);
          if (r.ec != std::errc() || v > static_cast<uint64_t>(INT64_MAX)) throw at(p, "integer literal too large");
          push(Tok::Int, p, std::string(s.substr(p, e - p)));
          tokens_.back().int_value = static_cast<int64_t>(v);
          return e;
        }
      }
    }
    size_t e = digits(p);
    bool is_float = false;
    // A number right after '.' is never a float (jinja2: x.0.1 is x[0][1]).
    const bool after_dot = p > 0 && s[p - 1] == '.';
    if (!after_dot) {
      size_t f = e;
      if (f + 1 < s.size() && s[f] == '.' && is_digit(s[f + 1])) { f = digits(f + 1); is_float = true; }
      if (f < s.size() && (s[f] == 'e' || s[f] == 'E')) {
        size_t x = f + 1;
        if (x < s.size() && (s[x] == '+' || s[x] == '-')) ++x;
        if (x < s.size() && is_digit(s[x])) { f = digits(x); is_float = true; }
      }
      if (is_float) e = f;
    }
    const std::string t = clean(s.substr(p, e - p));
    if (is_float) {
      push(Tok::Float, p, std::string(s.substr(p, e - p)));
      double v = 0;
      auto r = std::from_chars(t.data(), t.data() + t.size(), v);
      // Python reads 1e999 as inf and 1e-999 as 0.0.
      if (r.ec == std::errc::result_out_of_range) v = t.find("e-") != std::string::npos || t.find("E-") != std::string::npos ? 0.0 : HUGE_VAL;
      tokens_.back().float_value = v;
    } else {
      int64_t v = 0;
      auto r = std::from_chars(t.data(), t.data() + t.size(), v);
      if (r.ec != std::errc()) throw at(p, "integer literal too large");
      push(Tok::Int, p, std::string(s.substr(p, e - p)));
      tokens_.back().int_value = v;
    }
    return e;
  }

  std::string src_;
  std::vector<size_t> line_starts_;
  std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> lex(std::string_view source) { return Lexer(source).run(); }

}  // namespace moebius::chat::jinja
