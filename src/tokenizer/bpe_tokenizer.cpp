#include "tokenizer/bpe_tokenizer.h"

#include <algorithm>
#include <array>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include <nlohmann/json.hpp>

#include "core/json_depth.h"
#include "core/memory.h"
#include "tokenizer/pretokenizer.h"
#include "tokenizer/unicode.h"

namespace moebius::tokenizer {

// ---- Byte-level alphabet ----------------------------------------------------------------------

namespace {

struct ByteAlphabet {
  std::array<char32_t, 256> to_cp{};
  std::array<int16_t, 324> to_byte{};  // code points 0..323 cover the whole alphabet
};

const ByteAlphabet& alphabet() {
  static const ByteAlphabet a = [] {
    ByteAlphabet t;
    t.to_byte.fill(-1);
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      t.to_cp[static_cast<size_t>(b)] = printable ? static_cast<char32_t>(b) : next++;
      t.to_byte[t.to_cp[static_cast<size_t>(b)]] = static_cast<int16_t>(b);
    }
    return t;
  }();
  return a;
}

}  // namespace

char32_t byte_to_unicode(uint8_t b) { return alphabet().to_cp[b]; }

int unicode_to_byte(char32_t cp) { return cp < 324 ? alphabet().to_byte[cp] : -1; }

namespace {

// The byte-level form of raw bytes: each byte as its alphabet character, UTF-8 encoded.
std::string to_byte_level(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) unicode::append_utf8(out, byte_to_unicode(static_cast<uint8_t>(c)));
  return out;
}

// What the ByteLevel decoder turns a token string into: the bytes its characters stand for when
// every character is in the alphabet, otherwise the token's own UTF-8 (HF's rule; it matters for
// added tokens such as "<|im_start|>" whose characters need not be in the alphabet).
std::string from_byte_level(std::string_view token) {
  std::string out;
  for (size_t i = 0; i < token.size();) {
    const unicode::Utf8Char c = unicode::decode_utf8(token, i);
    const int b = c.status == unicode::Utf8Status::kValid ? unicode_to_byte(c.cp) : -1;
    if (b < 0) return std::string(token);
    out.push_back(static_cast<char>(b));
    i += c.length;
  }
  return out;
}

// ---- Merge table: open addressing over (left id, right id) -------------------------------------
// The BPE loop looks a pair up after every merge, so this is the hottest lookup of encoding; a flat
// table with linear probing beats std::unordered_map's node chasing by a wide margin.
struct MergeTable {
  struct Slot {
    uint64_t key = kEmpty;
    uint32_t rank = 0;
    TokenId merged = 0;
  };
  static constexpr uint64_t kEmpty = ~uint64_t{0};  // would need two ids of 2^32 - 1

  std::vector<Slot> slots;
  uint64_t mask = 0;
  size_t count = 0;

  static uint64_t key(TokenId a, TokenId b) { return (uint64_t{a} << 32) | b; }
  static uint64_t hash(uint64_t k) {  // splitmix64 finalizer: ids are dense, spread them
    k ^= k >> 30; k *= 0xbf58476d1ce4e5b9ull;
    k ^= k >> 27; k *= 0x94d049bb133111ebull;
    return k ^ (k >> 31);
  }
  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < n * 2) cap <<= 1;
    slots.assign(cap, Slot{});
    mask = cap - 1;
  }
  // False when the pair is already present.
  bool insert(TokenId a, TokenId b, uint32_t rank, TokenId merged) {
    const uint64_t k = key(a, b);
    for (uint64_t i = hash(k) & mask;; i = (i + 1) & mask) {
      if (slots[i].key == k) return false;
      if (slots[i].key == kEmpty) {
        slots[i] = {k, rank, merged};
        ++count;
        return true;
      }
    }
  }
  const Slot* find(TokenId a, TokenId b) const {
    const uint64_t k = key(a, b);
    for (uint64_t i = hash(k) & mask;; i = (i + 1) & mask) {
      if (slots[i].key == k) return &slots[i];
      if (slots[i].key == kEmpty) return nullptr;
    }
  }
};

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

}  // namespace

// ---- Implementation state ---------------------------------------------------------------------

struct BpeTokenizer::Impl {
  // Vocabulary and added tokens, by id. Holes (ids nobody uses) have known[id] == false.
  std::vector<std::string> id_to_token;
  std::vector<uint8_t> known;
  std::vector<uint8_t> special;
  std::unordered_map<std::string, TokenId, StringHash, std::equal_to<>> token_to_id;
  // Decoded bytes of every id, back to back: token i is bytes[offsets[i] .. offsets[i + 1]).
  std::string bytes;
  std::vector<uint32_t> offsets;

  std::array<TokenId, 256> byte_ids{};  // the token of each single byte
  MergeTable merges;
  bool ignore_merges = false;
  bool nfc = false;

  std::vector<AddedToken> added_tokens;  // as listed in the file
  struct AddedMatcher {
    AddedToken token;
    std::string match;  // the content, NFC-normalized for normalized tokens (matched in NFC text)
  };
  std::vector<AddedMatcher> added;
  // Indices into `added` by first byte of `match`, longest first, split by where they are matched.
  std::array<std::vector<uint32_t>, 256> raw_by_first;
  std::array<std::vector<uint32_t>, 256> normalized_by_first;
  bool has_normalized_added = false;

  // Word -> ids cache. Natural text repeats a few thousand words over and over; a hit skips the
  // merge loop entirely. Bounded: cleared when full, which is cheap and keeps memory flat.
  static constexpr size_t kCacheMaxEntries = 1 << 16;
  static constexpr size_t kCacheMaxWordBytes = 64;
  mutable std::mutex cache_mutex;
  mutable std::unordered_map<std::string, std::vector<TokenId>, StringHash, std::equal_to<>> cache;

  void bpe(std::string_view word, std::vector<TokenId>& out) const;
  void bpe_cached(std::string_view word, std::vector<TokenId>& out) const;
  void encode_text(std::string_view text, const EncodeOptions& options, std::vector<TokenId>& out,
                   std::vector<std::string_view>& scratch) const;
  void split_added(std::string_view text, bool normalized_pass, const EncodeOptions& options,
                   std::vector<TokenId>& out, std::vector<std::string_view>& scratch) const;
};

// ---- BPE --------------------------------------------------------------------------------------

// Merges the bytes of one pre-tokenized piece. At every step the pair with the lowest merge rank
// is merged, the leftmost one among equal ranks (the same pair at several places), until no pair
// has a merge. A min-heap of candidate pairs keeps that O(n log n) for long pieces (a 100k-space
// run is one piece); entries made stale by an earlier merge are detected on pop and dropped.
void BpeTokenizer::Impl::bpe(std::string_view word, std::vector<TokenId>& out) const {
  const size_t n = word.size();
  if (n == 1) {
    out.push_back(byte_ids[static_cast<uint8_t>(word[0])]);
    return;
  }
  if (ignore_merges) {
    // Llama-3 style: a piece that is itself a token is emitted whole.
    if (auto it = token_to_id.find(to_byte_level(word)); it != token_to_id.end()) {
      out.push_back(it->second);
      return;
    }
  }
  struct Symbol {
    TokenId id;
    int32_t prev, next;  // -1 at the ends; a merged-away symbol has id == kDead
  };
  struct Candidate {
    uint32_t rank;
    int32_t pos;  // left symbol; ties on rank go to the smaller position (leftmost)
    TokenId left, right;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  static constexpr TokenId kDead = ~TokenId{0};
  thread_local std::vector<Symbol> sym;
  thread_local std::vector<Candidate> heap;
  sym.clear();
  heap.clear();
  for (size_t i = 0; i < n; ++i) {
    sym.push_back({byte_ids[static_cast<uint8_t>(word[i])], static_cast<int32_t>(i) - 1,
                   i + 1 < n ? static_cast<int32_t>(i + 1) : -1});
  }
  const auto push = [&](int32_t left) {
    const int32_t right = sym[static_cast<size_t>(left)].next;
    if (right < 0) return;
    const TokenId a = sym[static_cast<size_t>(left)].id, b = sym[static_cast<size_t>(right)].id;
    if (const MergeTable::Slot* m = merges.find(a, b)) {
      heap.push_back({m->rank, left, a, b});
      std::push_heap(heap.begin(), heap.end(), std::greater<>{});
    }
  };
  for (size_t i = 0; i + 1 < n; ++i) push(static_cast<int32_t>(i));
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<>{});
    const Candidate c = heap.back();
    heap.pop_back();
    Symbol& left = sym[static_cast<size_t>(c.pos)];
    if (left.id != c.left || left.next < 0) continue;  // stale: left symbol changed or died
    Symbol& right = sym[static_cast<size_t>(left.next)];
    if (right.id != c.right) continue;  // stale: right neighbour changed
    left.id = merges.find(c.left, c.right)->merged;
    right.id = kDead;
    left.next = right.next;
    if (right.next >= 0) sym[static_cast<size_t>(right.next)].prev = c.pos;
    if (left.prev >= 0) push(left.prev);
    push(c.pos);
  }
  for (int32_t i = 0; i >= 0; i = sym[static_cast<size_t>(i)].next) out.push_back(sym[static_cast<size_t>(i)].id);
}

void BpeTokenizer::Impl::bpe_cached(std::string_view word, std::vector<TokenId>& out) const {
  if (word.size() == 1 || word.size() > kCacheMaxWordBytes) {
    bpe(word, out);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(cache_mutex);
    if (auto it = cache.find(word); it != cache.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t begin = out.size();
  bpe(word, out);
  std::lock_guard<std::mutex> lock(cache_mutex);
  if (cache.size() >= kCacheMaxEntries) cache.clear();
  cache.emplace(std::string(word), std::vector<TokenId>(out.begin() + static_cast<ptrdiff_t>(begin), out.end()));
}

// ---- Encoding ---------------------------------------------------------------------------------

// Normalized text (no added tokens in it) -> pieces -> BPE.
void BpeTokenizer::Impl::encode_text(std::string_view text, const EncodeOptions&,
                                     std::vector<TokenId>& out, std::vector<std::string_view>& scratch) const {
  scratch.clear();
  split_qwen2(text, scratch);
  for (std::string_view piece : scratch) bpe_cached(piece, out);
}

namespace {

bool is_space_at(std::string_view s, size_t i, size_t* len) {
  const unicode::Utf8Char c = unicode::decode_utf8(s, i);
  *len = c.length;
  return unicode::is_whitespace(c.cp);
}

// Start of the character that ends at `end` (exclusive), for valid UTF-8.
size_t prev_char_start(std::string_view s, size_t end) {
  size_t i = end - 1;
  while (i > 0 && (static_cast<uint8_t>(s[i]) & 0xC0) == 0x80) --i;
  return i;
}

// \w of Rust's regex, which HF uses for single_word: letters, marks, decimal and letter numbers,
// connector punctuation and the joiners (Alphabetic's few non-letter, non-mark members aside).
bool is_word_char(char32_t cp) {
  using G = unicode::GeneralCategory;
  if (cp < 0x80) return (cp >= '0' && cp <= '9') || (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') || cp == '_';
  switch (unicode::general_category(cp)) {
    case G::Lu: case G::Ll: case G::Lt: case G::Lm: case G::Lo:
    case G::Mn: case G::Mc: case G::Me: case G::Nd: case G::Nl: case G::Pc:
      return true;
    default:
      return cp == 0x200C || cp == 0x200D;
  }
}

}  // namespace

// Splits `text` on added tokens (leftmost, then longest match) and encodes the text between them:
// in the raw pass (normalized_pass == false) only tokens with normalized == false are matched and
// each gap is NFC-normalized and handed to the normalized pass, which matches the others and
// BPE-encodes what is left. This is HF tokenizers' order. When a special token is matched but
// options.parse_special is false, the match is skipped as a whole (not searched again for shorter
// tokens inside it), as HF's encode_special_tokens does.
void BpeTokenizer::Impl::split_added(std::string_view text, bool normalized_pass, const EncodeOptions& options,
                                     std::vector<TokenId>& out, std::vector<std::string_view>& scratch) const {
  const auto& by_first = normalized_pass ? normalized_by_first : raw_by_first;
  const auto emit_gap = [&](std::string_view gap) {
    if (gap.empty()) return;
    if (normalized_pass) {
      encode_text(gap, options, out, scratch);
    } else if (nfc && !unicode::is_nfc_quick(gap)) {
      const std::string normalized = unicode::nfc(gap);
      if (has_normalized_added) split_added(normalized, true, options, out, scratch);
      else encode_text(normalized, options, out, scratch);
    } else if (has_normalized_added) {
      split_added(gap, true, options, out, scratch);
    } else {
      encode_text(gap, options, out, scratch);
    }
  };

  size_t gap_start = 0;  // start of the text not yet emitted
  size_t i = 0;
  while (i < text.size()) {
    const AddedMatcher* match = nullptr;
    for (uint32_t idx : by_first[static_cast<uint8_t>(text[i])]) {  // longest first
      const AddedMatcher& t = added[idx];
      if (text.compare(i, t.match.size(), t.match) == 0) {
        match = &t;
        break;
      }
    }
    if (match == nullptr) {
      ++i;
      continue;
    }
    size_t start = i, end = i + match->match.size();
    // A match we may not use stays part of the gap, and so does all of it: the search resumes at
    // its end, as HF's non-overlapping leftmost-longest scan does.
    if (match->token.special && !options.parse_special) {
      i = end;
      continue;
    }
    if (match->token.single_word) {
      const bool word_before = start > 0 && is_word_char(unicode::decode_utf8(text, prev_char_start(text, start)).cp);
      const bool word_after = end < text.size() && is_word_char(unicode::decode_utf8(text, end).cp);
      if (word_before || word_after) {
        i = end;
        continue;
      }
    }
    if (match->token.lstrip) {
      while (start > gap_start) {
        const size_t p = prev_char_start(text, start);
        size_t len;
        if (!is_space_at(text, p, &len)) break;
        start = p;
      }
    }
    if (match->token.rstrip) {
      size_t len;
      while (end < text.size() && is_space_at(text, end, &len)) end += len;
    }
    emit_gap(text.substr(gap_start, start - gap_start));
    out.push_back(match->token.id);
    gap_start = i = end;
  }
  emit_gap(text.substr(gap_start));
}

std::vector<TokenId> BpeTokenizer::encode(std::string_view text, const EncodeOptions& options) const {
  std::vector<TokenId> out;
  out.reserve(text.size() / 3 + 4);
  std::vector<std::string_view> scratch;
  // [TAG_TOKENIZER_INVALID_UTF8] Same substitution as Python's errors="replace"; see the header.
  if (!unicode::is_valid_utf8(text)) {
    const std::string clean = unicode::sanitize_utf8(text);
    impl_->split_added(clean, false, options, out, scratch);
  } else {
    impl_->split_added(text, false, options, out, scratch);
  }
  return out;
}

// ---- Decoding ---------------------------------------------------------------------------------

std::string_view BpeTokenizer::token_bytes(TokenId id) const {
  if (!is_known(id)) return {};
  return std::string_view(impl_->bytes).substr(impl_->offsets[id], impl_->offsets[id + 1] - impl_->offsets[id]);
}

std::string BpeTokenizer::decode(std::span<const TokenId> ids, const DecodeOptions& options) const {
  std::string out;
  for (TokenId id : ids) {
    if (!is_known(id)) continue;
    if (options.skip_special_tokens && impl_->special[id]) continue;
    out.append(token_bytes(id));
  }
  return out;
}

std::string BpeTokenizer::decode_text(std::span<const TokenId> ids, const DecodeOptions& options) const {
  return unicode::sanitize_utf8(decode(ids, options));
}

bool BpeTokenizer::is_known(TokenId id) const { return id < impl_->known.size() && impl_->known[id]; }
bool BpeTokenizer::is_special(TokenId id) const { return is_known(id) && impl_->special[id]; }
size_t BpeTokenizer::vocab_size() const { return impl_->id_to_token.size(); }
size_t BpeTokenizer::merge_count() const { return impl_->merges.count; }
const std::vector<AddedToken>& BpeTokenizer::added_tokens() const { return impl_->added_tokens; }

std::optional<std::string_view> BpeTokenizer::id_to_token(TokenId id) const {
  if (!is_known(id)) return std::nullopt;
  return std::string_view(impl_->id_to_token[id]);
}

std::optional<TokenId> BpeTokenizer::token_to_id(std::string_view token) const {
  auto it = impl_->token_to_id.find(token);
  if (it == impl_->token_to_id.end()) return std::nullopt;
  return it->second;
}

BpeTokenizer::BpeTokenizer() : impl_(std::make_unique<Impl>()) {}
BpeTokenizer::~BpeTokenizer() = default;
BpeTokenizer::BpeTokenizer(BpeTokenizer&&) noexcept = default;
BpeTokenizer& BpeTokenizer::operator=(BpeTokenizer&&) noexcept = default;

// ---- Loading ----------------------------------------------------------------------------------

namespace {

using nlohmann::json;

const char* type_name(const json& j) { return j.type_name(); }

// The "type" of a component object, or an error naming the field.
Result<std::string> component_type(const json& j, const std::string& field) {
  if (!j.is_object()) return Error::format("expected an object, got {}", type_name(j)).in_field(field);
  auto it = j.find("type");
  if (it == j.end() || !it->is_string()) return Error("missing string field 'type'").in_field(field);
  return it->get<std::string>();
}

Result<bool> optional_bool(const json& obj, const char* key, bool fallback, const std::string& field) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) return Error::format("'{}' must be a boolean, got {}", key, type_name(*it)).in_field(field);
  return it->get<bool>();
}

// Ids must be below `bound`, the number of tokens the file defines (vocabulary plus added tokens):
// the id space is dense, as in every Qwen file. That turns a corrupt id such as 4294967295 into an
// error instead of a multi-gigabyte id table.
Result<TokenId> parse_id(const json& j, size_t bound, const std::string& field) {
  if (!j.is_number_integer()) return Error::format("id must be an integer, got {}", j.dump()).in_field(field);
  const int64_t v = j.is_number_unsigned() ? static_cast<int64_t>(std::min<uint64_t>(j.get<uint64_t>(), INT64_MAX))
                                           : j.get<int64_t>();
  if (v < 0 || v >= static_cast<int64_t>(bound)) {
    return Error::format("id {} is out of range: the file defines {} tokens, so ids must be in [0, {})", v,
                         bound, bound).in_field(field);
  }
  return static_cast<TokenId>(v);
}

// Checks the pre_tokenizer is exactly Qwen2's: Sequence[Split(kQwen2SplitPattern, Isolated),
// ByteLevel(add_prefix_space=false, use_regex=false)].
Status check_pre_tokenizer(const json& j) {
  const std::string f = "pre_tokenizer";
  const auto unsupported = [&](const std::string& why) {
    return Error::format("unsupported pre-tokenizer: {}; only the Qwen2/Qwen3 Sequence[Split(Qwen2 "
                         "regex, Isolated), ByteLevel(add_prefix_space=false, use_regex=false)] is "
                         "implemented", why).in_field(f);
  };
  if (j.is_null()) return unsupported("none given");
  MOEBIUS_ASSIGN_OR_RETURN(const std::string type, component_type(j, f));
  if (type != "Sequence") return unsupported("type '" + type + "'");
  auto list = j.find("pretokenizers");
  if (list == j.end() || !list->is_array() || list->size() != 2) {
    return unsupported("a Sequence that is not [Split, ByteLevel]");
  }
  const json& split = (*list)[0];
  const json& byte_level = (*list)[1];
  MOEBIUS_ASSIGN_OR_RETURN(const std::string t0, component_type(split, f + ".pretokenizers[0]"));
  MOEBIUS_ASSIGN_OR_RETURN(const std::string t1, component_type(byte_level, f + ".pretokenizers[1]"));
  if (t0 != "Split" || t1 != "ByteLevel") return unsupported("Sequence[" + t0 + ", " + t1 + "]");
  const json pattern = split.value("pattern", json());
  if (!pattern.is_object() || !pattern.contains("Regex") || !pattern["Regex"].is_string()) {
    return unsupported("Split pattern is not a {\"Regex\": ...}");
  }
  if (pattern["Regex"].get<std::string>() != kQwen2SplitPattern) {
    return unsupported("Split regex " + pattern["Regex"].dump() + " is not the Qwen2 pattern");
  }
  if (split.value("behavior", std::string()) != "Isolated") return unsupported("Split behavior is not Isolated");
  if (split.value("invert", false)) return unsupported("Split invert is true");
  if (byte_level.value("add_prefix_space", false)) return unsupported("ByteLevel add_prefix_space is true");
  if (byte_level.value("use_regex", true)) return unsupported("ByteLevel use_regex is true (the GPT-2 regex)");
  return Ok{};
}

Status check_components(const json& root, bool* nfc) {
  // Normalizer: NFC (Qwen2/3) or none.
  *nfc = false;
  if (auto it = root.find("normalizer"); it != root.end() && !it->is_null()) {
    MOEBIUS_ASSIGN_OR_RETURN(const std::string type, component_type(*it, "normalizer"));
    if (type != "NFC") {
      return Error::format("unsupported normalizer '{}' (only NFC or none)", type).in_field("normalizer");
    }
    *nfc = true;
  }
  MOEBIUS_TRY(check_pre_tokenizer(root.value("pre_tokenizer", json())));
  // ByteLevel post-processing only adjusts offsets; anything else (TemplateProcessing, ...) would
  // add tokens we do not add, so it is refused rather than ignored.
  if (auto it = root.find("post_processor"); it != root.end() && !it->is_null()) {
    MOEBIUS_ASSIGN_OR_RETURN(const std::string type, component_type(*it, "post_processor"));
    if (type != "ByteLevel") {
      return Error::format("unsupported post-processor '{}' (only ByteLevel or none)", type).in_field("post_processor");
    }
  }
  const json decoder = root.value("decoder", json());
  if (decoder.is_null()) return Error("missing decoder (expected ByteLevel)").in_field("decoder");
  MOEBIUS_ASSIGN_OR_RETURN(const std::string dtype, component_type(decoder, "decoder"));
  if (dtype != "ByteLevel") {
    return Error::format("unsupported decoder '{}' (only ByteLevel)", dtype).in_field("decoder");
  }
  for (const char* key : {"truncation", "padding"}) {
    if (auto it = root.find(key); it != root.end() && !it->is_null()) {
      return Error::format("'{}' is set; moebius never truncates or pads implicitly", key).in_field(key);
    }
  }
  return Ok{};
}

// "a b" or ["a", "b"].
Result<std::pair<std::string, std::string>> parse_merge(const json& m, const std::string& field) {
  if (m.is_string()) {
    const std::string& s = m.get_ref<const std::string&>();
    const size_t sp = s.find(' ');
    if (sp == std::string::npos || sp == 0 || sp + 1 == s.size() || s.find(' ', sp + 1) != std::string::npos) {
      return Error::format("merge {} is not two tokens separated by one space", m.dump()).in_field(field);
    }
    return std::make_pair(s.substr(0, sp), s.substr(sp + 1));
  }
  const auto nonempty_string = [](const json& x) { return x.is_string() && !x.get_ref<const std::string&>().empty(); };
  if (m.is_array() && m.size() == 2 && nonempty_string(m[0]) && nonempty_string(m[1])) {
    return std::make_pair(m[0].get<std::string>(), m[1].get<std::string>());
  }
  return Error::format("merge {} is neither \"a b\" nor [\"a\", \"b\"]", m.dump()).in_field(field);
}

// Fills `im` from a parsed tokenizer.json, validating as it goes.
Status build(const json& root, BpeTokenizer::Impl& im) {
  // ---- model --------------------------------------------------------------------------------
  // First, so that a file that is no tokenizer.json at all says so before anything else.
  auto model_it = root.find("model");
  if (model_it == root.end() || model_it->is_null()) return Error("missing 'model'").in_field("model");
  const json& model = *model_it;
  MOEBIUS_ASSIGN_OR_RETURN(const std::string mtype, component_type(model, "model"));
  if (mtype != "BPE") {
    return Error::format("unsupported model type '{}' (only BPE)", mtype).in_field("model.type");
  }
  MOEBIUS_TRY(check_components(root, &im.nfc));
  if (auto d = model.find("dropout");
      d != model.end() && !d->is_null() && !(d->is_number() && d->get<double>() == 0.0)) {
    return Error("BPE dropout is not supported (encoding must be deterministic)").in_field("model.dropout");
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (auto it = model.find(key);
        it != model.end() && !it->is_null() && !(it->is_string() && it->get_ref<const std::string&>().empty())) {
      return Error::format("non-empty {} is not supported by byte-level BPE", key)
          .in_field(std::string("model.") + key);
    }
  }
  MOEBIUS_ASSIGN_OR_RETURN(im.ignore_merges, optional_bool(model, "ignore_merges", false, "model"));

  auto vocab_it = model.find("vocab");
  if (vocab_it == model.end() || !vocab_it->is_object()) {
    return Error("missing or not an object (expected {token: id, ...})").in_field("model.vocab");
  }
  const json added_json = root.value("added_tokens", json());
  if (!added_json.is_null() && !added_json.is_array()) return Error("must be an array").in_field("added_tokens");
  const size_t id_bound = vocab_it->size() + added_json.size();
  // Ids: vocabulary first, then added tokens; the tables grow to the largest id seen.
  const auto grow = [&](TokenId id) {
    if (id >= im.id_to_token.size()) {
      im.id_to_token.resize(size_t{id} + 1);
      im.known.resize(size_t{id} + 1, 0);
      im.special.resize(size_t{id} + 1, 0);
    }
  };
  im.token_to_id.reserve(vocab_it->size() * 2);
  for (const auto& [token, idj] : vocab_it->items()) {
    MOEBIUS_ASSIGN_OR_RETURN(const TokenId id, parse_id(idj, id_bound, "model.vocab[\"" + token + "\"]"));
    grow(id);
    if (im.known[id]) {
      return Error::format("duplicate id {}: tokens {} and {}", id, json(im.id_to_token[id]).dump(), json(token).dump())
          .in_field("model.vocab");
    }
    im.known[id] = 1;
    im.id_to_token[id] = token;
    im.token_to_id.emplace(token, id);
  }
  for (int b = 0; b < 256; ++b) {
    std::string s;
    unicode::append_utf8(s, byte_to_unicode(static_cast<uint8_t>(b)));
    auto it = im.token_to_id.find(s);
    if (it == im.token_to_id.end()) {
      return Error::format("byte-level token {} for byte 0x{:02X} is missing; a byte-level BPE needs all 256",
                           json(s).dump(), b).in_field("model.vocab");
    }
    im.byte_ids[static_cast<size_t>(b)] = it->second;
  }

  auto merges_it = model.find("merges");
  if (merges_it == model.end() || !merges_it->is_array()) {
    return Error("missing or not an array").in_field("model.merges");
  }
  im.merges.reserve(merges_it->size());
  for (size_t r = 0; r < merges_it->size(); ++r) {
    const std::string field = fmt::format("model.merges[{}]", r);
    MOEBIUS_ASSIGN_OR_RETURN(auto pair, parse_merge((*merges_it)[r], field));
    const auto a = im.token_to_id.find(pair.first), b = im.token_to_id.find(pair.second);
    const auto ab = im.token_to_id.find(pair.first + pair.second);
    for (const auto& [it, name] : {std::pair{a, &pair.first}, std::pair{b, &pair.second}}) {
      if (it == im.token_to_id.end()) {
        return Error::format("token {} is not in the vocabulary", json(*name).dump()).in_field(field);
      }
    }
    if (ab == im.token_to_id.end()) {
      return Error::format("merged token {} is not in the vocabulary", json(pair.first + pair.second).dump())
          .in_field(field);
    }
    if (!im.merges.insert(a->second, b->second, static_cast<uint32_t>(r), ab->second)) {
      return Error::format("duplicate merge {} {}", json(pair.first).dump(), json(pair.second).dump()).in_field(field);
    }
  }

  // ---- added tokens -------------------------------------------------------------------------
  std::unordered_set<TokenId> added_ids;
  std::unordered_set<std::string> added_contents;
  if (added_json.is_array()) {
    for (size_t k = 0; k < added_json.size(); ++k) {
      const json& t = added_json[k];
      const std::string field = fmt::format("added_tokens[{}]", k);
      if (!t.is_object()) return Error("must be an object").in_field(field);
      AddedToken a;
      MOEBIUS_ASSIGN_OR_RETURN(a.id, parse_id(t.value("id", json()), id_bound, field + ".id"));
      if (!t.contains("content") || !t["content"].is_string() || t["content"].get_ref<const std::string&>().empty()) {
        return Error("content must be a non-empty string").in_field(field + ".content");
      }
      a.content = t["content"].get<std::string>();
      if (!unicode::is_valid_utf8(a.content)) return Error("content is not valid UTF-8").in_field(field + ".content");
      MOEBIUS_ASSIGN_OR_RETURN(a.special, optional_bool(t, "special", false, field));
      // HF's default: special tokens are matched in the raw text, others after normalization.
      MOEBIUS_ASSIGN_OR_RETURN(a.normalized, optional_bool(t, "normalized", !a.special, field));
      MOEBIUS_ASSIGN_OR_RETURN(a.lstrip, optional_bool(t, "lstrip", false, field));
      MOEBIUS_ASSIGN_OR_RETURN(a.rstrip, optional_bool(t, "rstrip", false, field));
      MOEBIUS_ASSIGN_OR_RETURN(a.single_word, optional_bool(t, "single_word", false, field));
      if (!added_ids.insert(a.id).second) {
        return Error::format("duplicate added-token id {}", a.id).in_field(field + ".id");
      }
      if (!added_contents.insert(a.content).second) {
        return Error::format("duplicate added token {}", json(a.content).dump()).in_field(field + ".content");
      }
      grow(a.id);
      if (im.known[a.id] && im.id_to_token[a.id] != a.content) {
        return Error::format("id {} of {} is already the vocabulary token {}", a.id, json(a.content).dump(),
                             json(im.id_to_token[a.id]).dump()).in_field(field + ".id");
      }
      im.known[a.id] = 1;
      im.special[a.id] = a.special ? 1 : 0;
      im.id_to_token[a.id] = a.content;
      im.token_to_id[a.content] = a.id;
      im.added_tokens.push_back(std::move(a));
    }
  }
  for (const AddedToken& a : im.added_tokens) {
    std::string match = a.normalized && im.nfc ? unicode::nfc(a.content) : a.content;
    const auto k = static_cast<uint32_t>(im.added.size());
    auto& by_first = a.normalized ? im.normalized_by_first : im.raw_by_first;
    by_first[static_cast<uint8_t>(match[0])].push_back(k);
    im.has_normalized_added |= a.normalized;
    im.added.push_back({a, std::move(match)});
  }
  for (auto* table : {&im.raw_by_first, &im.normalized_by_first}) {
    for (auto& list : *table) {
      std::stable_sort(list.begin(), list.end(), [&](uint32_t x, uint32_t y) {
        return im.added[x].match.size() > im.added[y].match.size();
      });
    }
  }

  // ---- decoded bytes of every id ---------------------------------------------------------------
  im.offsets.assign(im.id_to_token.size() + 1, 0);
  for (size_t id = 0; id < im.id_to_token.size(); ++id) {
    im.offsets[id] = static_cast<uint32_t>(im.bytes.size());
    if (im.known[id]) im.bytes += from_byte_level(im.id_to_token[id]);
  }
  im.offsets.back() = static_cast<uint32_t>(im.bytes.size());
  return Ok{};
}

}  // namespace

Result<BpeTokenizer> BpeTokenizer::load(const std::string& path) {
  MOEBIUS_ASSIGN_OR_RETURN(MappedFile file, MappedFile::open(path));
  return from_json(std::string_view(reinterpret_cast<const char*>(file.data()), file.size()), path);
}

Result<BpeTokenizer> BpeTokenizer::from_json(std::string_view json_text, const std::string& source) {
  // [TAG_JSON_DEPTH] The loader copies components (root.value()), which recurses per level.
  if (Status depth = check_json_depth(json_text); !depth.ok()) return std::move(depth).error().in_file(source);
  json root = json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return Error("not valid JSON").in_file(source);
  if (!root.is_object()) return Error("top level is not a JSON object").in_file(source);
  BpeTokenizer tok;
  Status st;
  try {
    st = build(root, *tok.impl_);
  } catch (const json::exception& e) {
    // A field of the wrong JSON type that a check above did not anticipate.
    st = Error::format("malformed tokenizer.json: {}", e.what());
  }
  if (!st.ok()) return std::move(st).error().in_file(source);
  return tok;
}

}  // namespace moebius::tokenizer
