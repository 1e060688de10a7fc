#include "tokenizer/unicode.h"

#include <algorithm>
#include <array>
#include <memory>
#include <unordered_map>
#include <vector>

namespace moebius::unicode {

// ---- UTF-8 ------------------------------------------------------------------------------------

namespace {

// The well-formed byte sequences of Unicode 15, Table 3-7. The second byte's range depends on
// the lead byte: that is what excludes overlong forms (E0 80..9F, F0 80..8F), surrogates
// (ED A0..BF) and code points above U+10FFFF (F4 90..BF). Later bytes are always 80..BF.
struct LeadInfo {
  uint8_t length;        // 0: not a lead byte
  uint8_t second_lo, second_hi;
};

constexpr LeadInfo lead_info(uint8_t b) {
  if (b < 0x80) return {1, 0, 0};
  if (b < 0xC2) return {0, 0, 0};  // continuation bytes, and C0/C1 (always overlong)
  if (b < 0xE0) return {2, 0x80, 0xBF};
  if (b == 0xE0) return {3, 0xA0, 0xBF};
  if (b == 0xED) return {3, 0x80, 0x9F};
  if (b < 0xF0) return {3, 0x80, 0xBF};
  if (b == 0xF0) return {4, 0x90, 0xBF};
  if (b < 0xF4) return {4, 0x80, 0xBF};
  if (b == 0xF4) return {4, 0x80, 0x8F};
  return {0, 0, 0};  // F5..FF never occur in UTF-8
}

}  // namespace

Utf8Char decode_utf8(std::string_view s, size_t pos) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data()) + pos;
  const size_t avail = s.size() - pos;
  const uint8_t b0 = p[0];
  if (b0 < 0x80) return {b0, 1, Utf8Status::kValid};
  const LeadInfo li = lead_info(b0);
  if (li.length == 0) return {kReplacementChar, 1, Utf8Status::kInvalid};
  char32_t cp = b0 & (0xFF >> (li.length + 1));
  for (uint32_t i = 1; i < li.length; ++i) {
    if (i >= avail) return {kReplacementChar, i, Utf8Status::kTruncated};
    const uint8_t b = p[i];
    const uint8_t lo = i == 1 ? li.second_lo : 0x80;
    const uint8_t hi = i == 1 ? li.second_hi : 0xBF;
    // The maximal subpart ends before the first byte that cannot continue the sequence; that
    // byte starts the next character.
    if (b < lo || b > hi) return {kReplacementChar, i, Utf8Status::kInvalid};
    cp = (cp << 6) | (b & 0x3F);
  }
  return {cp, li.length, Utf8Status::kValid};
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp > kMaxCodePoint || (cp >= 0xD800 && cp <= 0xDFFF)) cp = kReplacementChar;
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

namespace {
// Index of the first ill-formed byte, or s.size().
size_t first_invalid(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    if (static_cast<uint8_t>(s[i]) < 0x80) { ++i; continue; }
    const Utf8Char c = decode_utf8(s, i);
    if (c.status != Utf8Status::kValid) return i;
    i += c.length;
  }
  return s.size();
}
}  // namespace

bool is_valid_utf8(std::string_view s) { return first_invalid(s) == s.size(); }

std::string sanitize_utf8(std::string_view s) {
  size_t i = first_invalid(s);
  if (i == s.size()) return std::string(s);
  std::string out(s.substr(0, i));
  out.reserve(s.size() + 16);
  while (i < s.size()) {
    const Utf8Char c = decode_utf8(s, i);
    if (c.status == Utf8Status::kValid) {
      out.append(s.substr(i, c.length));
    } else {
      append_utf8(out, kReplacementChar);  // a truncated tail is ill-formed in a complete input
    }
    i += c.length;
  }
  return out;
}

// ---- Character properties ---------------------------------------------------------------------

GeneralCategory general_category(char32_t cp) {
  const auto ranges = tables::category_ranges();
  auto it = std::lower_bound(ranges.begin(), ranges.end(), cp,
                             [](const tables::CategoryRange& r, char32_t c) { return r.last < c; });
  if (it == ranges.end() || it->first > cp) return GeneralCategory::Cn;
  return it->category;
}

namespace {

constexpr bool category_is_letter(GeneralCategory g) {
  return g == GeneralCategory::Lu || g == GeneralCategory::Ll || g == GeneralCategory::Lt ||
         g == GeneralCategory::Lm || g == GeneralCategory::Lo;
}
constexpr bool category_is_number(GeneralCategory g) {
  return g == GeneralCategory::Nd || g == GeneralCategory::Nl || g == GeneralCategory::No;
}

CharClass classify_slow(char32_t cp) {
  if ((cp >= 0x09 && cp <= 0x0D) || cp == 0x85) return CharClass::kWhitespace;
  const GeneralCategory g = general_category(cp);
  if (category_is_letter(g)) return CharClass::kLetter;
  if (category_is_number(g)) return CharClass::kNumber;
  if (g == GeneralCategory::Zs || g == GeneralCategory::Zl || g == GeneralCategory::Zp) {
    return CharClass::kWhitespace;
  }
  return CharClass::kOther;
}

// The pre-tokenizer classifies every character of the input; a flat table makes that one load for
// the BMP, where nearly all text lives. 64 KiB, built once on first use (thread-safe static init).
const std::array<CharClass, 0x10000>& bmp_classes() {
  static const auto table = [] {
    auto t = std::make_unique<std::array<CharClass, 0x10000>>();
    for (char32_t cp = 0; cp < 0x10000; ++cp) (*t)[cp] = classify_slow(cp);
    return t;
  }();
  return *table;
}

}  // namespace

CharClass char_class(char32_t cp) {
  if (cp < 0x10000) return bmp_classes()[cp];
  return classify_slow(cp);
}

bool is_letter(char32_t cp) { return char_class(cp) == CharClass::kLetter; }
bool is_number(char32_t cp) { return char_class(cp) == CharClass::kNumber; }
bool is_whitespace(char32_t cp) { return char_class(cp) == CharClass::kWhitespace; }

namespace {
uint8_t range_value(std::span<const tables::ValueRange> ranges, char32_t cp) {
  auto it = std::lower_bound(ranges.begin(), ranges.end(), cp,
                             [](const tables::ValueRange& r, char32_t c) { return r.last < c; });
  if (it == ranges.end() || it->first > cp) return 0;
  return it->value;
}
}  // namespace

uint8_t combining_class(char32_t cp) {
  if (cp < 0x300) return 0;  // nothing below the combining diacritical marks block has a class
  return range_value(tables::combining_class_ranges(), cp);
}

const char* unicode_version() { return tables::kUnicodeVersion; }

// ---- Normalization ----------------------------------------------------------------------------

namespace {

// Hangul syllables decompose and compose algorithmically (Unicode 15, section 3.12); the UCD
// does not list their 11172 mappings.
constexpr char32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr char32_t kLCount = 19, kVCount = 21, kTCount = 28;
constexpr char32_t kNCount = kVCount * kTCount, kSCount = kLCount * kNCount;

const tables::Decomposition* find_decomposition(char32_t cp) {
  const auto d = tables::decompositions();
  auto it = std::lower_bound(d.begin(), d.end(), cp,
                             [](const tables::Decomposition& e, char32_t c) { return e.cp < c; });
  if (it == d.end() || it->cp != cp) return nullptr;
  return &*it;
}

void decompose(char32_t cp, std::vector<char32_t>& out) {
  if (cp >= kSBase && cp < kSBase + kSCount) {
    const char32_t s = cp - kSBase;
    out.push_back(kLBase + s / kNCount);
    out.push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount != 0) out.push_back(kTBase + s % kTCount);
    return;
  }
  const tables::Decomposition* d = cp < 0xC0 ? nullptr : find_decomposition(cp);
  if (d == nullptr) {
    out.push_back(cp);
    return;
  }
  // The table holds one level of the mapping; the full decomposition applies it recursively.
  decompose(d->first, out);
  if (d->second != 0) decompose(d->second, out);
}

uint64_t pair_key(char32_t a, char32_t b) { return (static_cast<uint64_t>(a) << 21) | b; }

// Primary composites: every two-character canonical decomposition not excluded from composition.
const std::unordered_map<uint64_t, char32_t>& composition_map() {
  static const auto map = [] {
    std::unordered_map<uint64_t, char32_t> m;
    for (const auto& d : tables::decompositions()) {
      if (d.second != 0 && !d.excluded) m.emplace(pair_key(d.first, d.second), d.cp);
    }
    return m;
  }();
  return map;
}

// The composite of a starter and a following character, or 0.
char32_t compose_pair(char32_t a, char32_t b) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount) {
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  }
  if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 && b > kTBase &&
      b < kTBase + kTCount) {
    return a + (b - kTBase);
  }
  const auto& m = composition_map();
  auto it = m.find(pair_key(a, b));
  return it == m.end() ? 0 : it->second;
}

}  // namespace

bool is_nfc_quick(std::string_view s) {
  uint8_t last_ccc = 0;
  size_t i = 0;
  while (i < s.size()) {
    // Everything below U+0300 is NFC_QC=Yes with class 0, so ASCII and Latin-1 runs need no lookup.
    if (static_cast<uint8_t>(s[i]) < 0xCC) {
      i += static_cast<uint8_t>(s[i]) < 0x80 ? 1 : 2;
      last_ccc = 0;
      continue;
    }
    const Utf8Char c = decode_utf8(s, i);
    i += c.length;
    const uint8_t ccc = combining_class(c.cp);
    if (ccc != 0 && last_ccc > ccc) return false;
    if (range_value(tables::nfc_quick_check_ranges(), c.cp) != 0) return false;  // No or Maybe
    last_ccc = ccc;
  }
  return true;
}

std::string nfc(std::string_view s) {
  if (is_nfc_quick(s)) return std::string(s);

  // 1. Full canonical decomposition.
  std::vector<char32_t> buf;
  buf.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const Utf8Char c = decode_utf8(s, i);
    i += c.length;
    decompose(c.cp, buf);
  }

  // 2. Canonical ordering: stable-sort every run of non-starters by combining class. Runs are
  // sorted with std::stable_sort so a hostile run of a million marks stays O(n log n).
  std::vector<uint8_t> ccc(buf.size());
  for (size_t i = 0; i < buf.size(); ++i) ccc[i] = combining_class(buf[i]);
  for (size_t i = 0; i < buf.size();) {
    if (ccc[i] == 0) { ++i; continue; }
    size_t j = i;
    while (j < buf.size() && ccc[j] != 0) ++j;
    if (j - i > 1) {
      std::vector<std::pair<uint8_t, char32_t>> run;
      for (size_t k = i; k < j; ++k) run.emplace_back(ccc[k], buf[k]);
      std::stable_sort(run.begin(), run.end(),
                       [](const auto& a, const auto& b) { return a.first < b.first; });
      for (size_t k = i; k < j; ++k) { ccc[k] = run[k - i].first; buf[k] = run[k - i].second; }
    }
    i = j;
  }

  // 3. Canonical composition. A character C combines with the last starter S when nothing between
  // them blocks it: no character in between has class 0 or a class >= C's.
  size_t out_len = 0;
  size_t starter = SIZE_MAX;  // index into the output of the last starter
  int last_ccc = -1;          // class of the last character appended after the starter
  for (size_t i = 0; i < buf.size(); ++i) {
    const char32_t ch = buf[i];
    const int cc = ccc[i];
    if (starter != SIZE_MAX) {
      const bool blocked = last_ccc != -1 && (last_ccc == 0 || last_ccc >= cc);
      if (!blocked) {
        if (const char32_t comp = compose_pair(buf[starter], ch); comp != 0) {
          buf[starter] = comp;
          continue;
        }
      }
    }
    if (cc == 0) {
      starter = out_len;
      last_ccc = -1;
    } else {
      last_ccc = cc;
    }
    ccc[out_len] = static_cast<uint8_t>(cc);
    buf[out_len++] = ch;
  }
  // A starter followed by another starter that did not combine: the second becomes the new
  // starter above (cc == 0 branch), which is what makes "blocked by a starter" hold.

  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < out_len; ++i) append_utf8(out, buf[i]);
  return out;
}

}  // namespace moebius::unicode
