// The small part of Unicode the tokenizer needs: UTF-8 decoding that never fails (invalid input
// becomes U+FFFD, one per maximal subpart), the general category for the pre-tokenizer's \p{L},
// \p{N} and \s, and NFC normalization. The tables are generated from the Unicode Character
// Database (unicode_data.cpp, tools/unicode/gen_unicode_tables.py).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace moebius::unicode {

inline constexpr char32_t kReplacementChar = 0xFFFD;
inline constexpr char32_t kMaxCodePoint = 0x10FFFF;

// ---- UTF-8 ------------------------------------------------------------------------------------

enum class Utf8Status : uint8_t {
  kValid,      // a well-formed sequence
  kInvalid,    // an ill-formed maximal subpart: replace it with one U+FFFD
  kTruncated,  // a well-formed prefix cut off by the end of the input (more bytes could finish it)
};

struct Utf8Char {
  char32_t cp;      // the code point, or kReplacementChar unless kValid
  uint32_t length;  // bytes consumed, >= 1
  Utf8Status status;
};

// Decodes the character that starts at s[pos] (pos < s.size()). For ill-formed input, `length`
// is the length of the maximal subpart (Unicode 15, section 3.9, "U+FFFD substitution of maximal
// subparts"), the practice Python's errors='replace', Rust's from_utf8_lossy and the WHATWG
// decoder share, so one bad byte sequence becomes the same number of U+FFFD everywhere.
Utf8Char decode_utf8(std::string_view s, size_t pos);

void append_utf8(std::string& out, char32_t cp);

bool is_valid_utf8(std::string_view s);

// s with every ill-formed maximal subpart (a truncated sequence at the end included) replaced by
// U+FFFD. Returns s unchanged (one copy) when it is already valid.
std::string sanitize_utf8(std::string_view s);

// ---- Character properties ---------------------------------------------------------------------

// [TAG_UNICODE_GENERAL_CATEGORY] The order matches CATEGORIES in gen_unicode_tables.py.
enum class GeneralCategory : uint8_t {
  Cn, Lu, Ll, Lt, Lm, Lo, Mn, Mc, Me, Nd, Nl, No, Pc, Pd, Ps, Pe,
  Pi, Pf, Po, Sm, Sc, Sk, So, Zs, Zl, Zp, Cc, Cf, Cs, Co,
};

GeneralCategory general_category(char32_t cp);

// \p{L}: Lu, Ll, Lt, Lm, Lo.
bool is_letter(char32_t cp);
// \p{N}: Nd, Nl, No.
bool is_number(char32_t cp);
// \s as Oniguruma (HF tokenizers) and Rust's regex define it for Unicode text: the White_Space
// property, i.e. U+0009..U+000D, U+0085 and the categories Zs, Zl, Zp. Note that JavaScript's \s
// differs (it adds U+FEFF and drops U+0085).
bool is_whitespace(char32_t cp);

// The pre-tokenizer asks about every character; this answers all three questions with one lookup
// (an O(1) table for the BMP, binary search above it).
enum class CharClass : uint8_t { kOther = 0, kLetter = 1, kNumber = 2, kWhitespace = 3 };
CharClass char_class(char32_t cp);

uint8_t combining_class(char32_t cp);

// ---- Normalization ----------------------------------------------------------------------------

// True when `s` (valid UTF-8) is certainly in NFC by the quick-check algorithm (UAX #15, 9.1).
// A false answer means "maybe not": nfc() must then run.
bool is_nfc_quick(std::string_view s);

// Canonical composition of the canonical decomposition (UAX #15), for valid UTF-8 input. Returns
// the input unchanged when the quick check says it is NFC already, which is the common case.
std::string nfc(std::string_view s);

// The Unicode version of the tables, e.g. "15.0.0".
const char* unicode_version();

// ---- Generated tables (unicode_data.cpp); internal to unicode.cpp ------------------------------
namespace tables {
struct CategoryRange {
  uint32_t first, last;
  GeneralCategory category;
};
struct ValueRange {
  uint32_t first, last;
  uint8_t value;
};
struct Decomposition {
  uint32_t cp, first, second;  // second == 0: a singleton decomposition
  uint8_t excluded;            // Full_Composition_Exclusion: never recomposed
};
extern const char* const kUnicodeVersion;
std::span<const CategoryRange> category_ranges();
std::span<const ValueRange> combining_class_ranges();
std::span<const ValueRange> nfc_quick_check_ranges();
std::span<const Decomposition> decompositions();
}  // namespace tables

}  // namespace moebius::unicode
