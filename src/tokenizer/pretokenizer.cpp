#include "tokenizer/pretokenizer.h"

#include <array>
#include <cstdint>

#include "tokenizer/unicode.h"

namespace moebius::tokenizer {

namespace {

using unicode::CharClass;

struct Char {
  char32_t cp;
  uint32_t len;  // bytes; 0 at the end of the text
  CharClass cls;
};

constexpr std::array<CharClass, 128> make_ascii_classes() {
  std::array<CharClass, 128> t{};
  for (int c = 0; c < 128; ++c) {
    CharClass k = CharClass::kOther;
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) k = CharClass::kLetter;
    else if (c >= '0' && c <= '9') k = CharClass::kNumber;
    else if (c == ' ' || (c >= 0x09 && c <= 0x0D)) k = CharClass::kWhitespace;
    t[static_cast<size_t>(c)] = k;
  }
  return t;
}
constexpr std::array<CharClass, 128> kAsciiClasses = make_ascii_classes();

// The character at byte offset i, or {0, 0, kOther} at the end. Input is valid UTF-8.
inline Char char_at(std::string_view s, size_t i) {
  if (i >= s.size()) return {0, 0, CharClass::kOther};
  const auto b = static_cast<uint8_t>(s[i]);
  if (b < 0x80) return {b, 1, kAsciiClasses[b]};
  const unicode::Utf8Char u = unicode::decode_utf8(s, i);
  return {u.cp, u.length, unicode::char_class(u.cp)};
}

inline bool is_newline(char32_t cp) { return cp == '\r' || cp == '\n'; }

// End of the run of characters of class `cls` that starts at i.
inline size_t run_end(std::string_view s, size_t i, CharClass cls) {
  for (;;) {
    const Char c = char_at(s, i);
    if (c.len == 0 || c.cls != cls) return i;
    i += c.len;
  }
}

// Case-insensitive match of one ASCII letter of a contraction. (?i) in Oniguruma and Rust's regex
// uses Unicode simple case folding, under which U+017F LATIN SMALL LETTER LONG S also folds to
// 's'; no other code point folds to s, t, r, e, v, m, l or d.
inline size_t fold_match(std::string_view s, size_t i, char lower) {
  if (i >= s.size()) return 0;
  const char c = s[i];
  if (c == lower || c == lower - ('a' - 'A')) return 1;
  if (lower == 's' && s.substr(i, 2) == "\xC5\xBF") return 2;  // U+017F
  return 0;
}

// Alternative 1: (?i:'s|'t|'re|'ve|'m|'ll|'d). Returns the match length in bytes, 0 for none.
// No alternative is a prefix of another, so their order does not matter.
size_t match_contraction(std::string_view s, size_t i) {
  if (s[i] != '\'') return 0;
  const size_t j = i + 1;
  for (char c : {'s', 't', 'm', 'd'}) {
    if (size_t n = fold_match(s, j, c)) return 1 + n;
  }
  static constexpr char kPairs[][2] = {{'r', 'e'}, {'v', 'e'}, {'l', 'l'}};
  for (const auto& p : kPairs) {
    if (size_t n1 = fold_match(s, j, p[0])) {
      if (size_t n2 = fold_match(s, j + n1, p[1])) return 1 + n1 + n2;
    }
  }
  return 0;
}

// The end (byte offset) of the match that starts at i < s.size(). The alternatives, in order:
//   1 (?i:'s|'t|'re|'ve|'m|'ll|'d)   contractions
//   2 [^\r\n\p{L}\p{N}]?\p{L}+        a word, with one optional leading non-letter (" word",
//                                     "\tword", "(word"); never a newline
//   3 \p{N}                           one digit: numbers split digit by digit
//   4  ?[^\s\p{L}\p{N}]+[\r\n]*       punctuation/symbol run, optional leading space, trailing
//                                     newlines
//   5 \s*[\r\n]+                      whitespace up to and including its last newline
//   6 \s+(?!\S)                       whitespace not followed by a non-space: at the end of the
//                                     text all of it, else all but its last character, which is
//                                     left to lead the next word (" word" via alternative 2)
//   7 \s+                             the single whitespace character 6 leaves
size_t match_end(std::string_view s, size_t i) {
  if (size_t n = match_contraction(s, i)) return i + n;

  const Char c0 = char_at(s, i);
  const size_t i1 = i + c0.len;

  // Alternative 2. With the optional character taken, c0 is anything but a letter, a number or a
  // newline and c1 must be a letter. Without it, c0 must be a letter. Greedy \p{L}+ never needs
  // to give characters back: nothing follows it in this alternative.
  if (c0.cls == CharClass::kLetter) return run_end(s, i1, CharClass::kLetter);
  if (c0.cls != CharClass::kNumber && !is_newline(c0.cp)) {
    if (char_at(s, i1).cls == CharClass::kLetter) return run_end(s, i1, CharClass::kLetter);
  }

  // Alternative 3.
  if (c0.cls == CharClass::kNumber) return i1;

  // Alternative 4. An optional ' ' (U+0020 only) must be followed by an "other" character;
  // without the space, a space cannot start the run.
  size_t other_start = SIZE_MAX;
  if (c0.cls == CharClass::kOther) {
    other_start = i;
  } else if (c0.cp == ' ' && char_at(s, i1).cls == CharClass::kOther) {
    other_start = i1;
  }
  if (other_start != SIZE_MAX) {
    size_t j = run_end(s, other_start, CharClass::kOther);
    while (j < s.size() && (s[j] == '\r' || s[j] == '\n')) ++j;
    return j;
  }

  // Only whitespace is left (c0 is whitespace). Scan its maximal run once, remembering the end of
  // the last newline and the start of the last character.
  size_t j = i;
  size_t after_last_newline = SIZE_MAX;
  size_t last_char_start = i;
  size_t count = 0;
  for (;;) {
    const Char c = char_at(s, j);
    if (c.len == 0 || c.cls != CharClass::kWhitespace) break;
    last_char_start = j;
    j += c.len;
    ++count;
    if (is_newline(c.cp)) after_last_newline = j;
  }
  // Alternative 5: greedy \s* backtracks from the end of the run to its last newline; [\r\n]+
  // then takes that newline and cannot go further (it was the last one in the run).
  if (after_last_newline != SIZE_MAX) return after_last_newline;
  // Alternative 6: \s+ is followed by the end of the text (the lookahead succeeds) or by a
  // non-space, in which case backtracking one character makes (?!\S) see a space.
  if (j == s.size()) return j;
  if (count >= 2) return last_char_start;
  // Alternative 7.
  return j;
}

}  // namespace

void split_qwen2(std::string_view text, std::vector<std::string_view>& pieces) {
  size_t i = 0;
  while (i < text.size()) {
    const size_t end = match_end(text, i);
    pieces.push_back(text.substr(i, end - i));
    i = end;
  }
}

}  // namespace moebius::tokenizer
