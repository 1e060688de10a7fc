// Byte-level BPE tokenizer for Qwen2/Qwen3 tokenizer.json files (HF tokenizers format).
//
// Encoding, in the order HF tokenizers applies it:
//   1. invalid UTF-8 becomes U+FFFD, one per maximal subpart (see "Invalid UTF-8" below);
//   2. added tokens are split out of the raw text, longest match first (special ones only when
//      EncodeOptions::parse_special);
//   3. the rest is NFC-normalized, then cut by the Qwen2 Split regex (pretokenizer.h);
//   4. each piece's UTF-8 bytes are BPE-merged by merge rank, starting from the 256 byte tokens
//      of the GPT-2 byte-level alphabet.
// Decoding maps every token back to its bytes (the byte-level inverse).
//
// Invalid UTF-8: HF tokenizers only ever sees Rust Strings, so invalid bytes never reach it; a
// Python caller has to decode first, and bytes.decode("utf-8", errors="replace") replaces each
// maximal ill-formed subpart with one U+FFFD. encode() does exactly that, so encoding raw bytes
// here gives the ids HF gives for the Python-decoded string. Decoding can produce invalid UTF-8
// (a token may hold half a character); decode() returns the raw bytes, decode_text() and the
// StreamingDecoder return valid UTF-8 with the same U+FFFD rule.
//
// We only claim Qwen2/Qwen3-style tokenizers: a file with any other model type, normalizer,
// pre-tokenizer, post-processor or decoder is refused with an error naming the component, never
// approximated.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace moebius::tokenizer {

using TokenId = uint32_t;

struct AddedToken {
  TokenId id = 0;
  std::string content;
  bool special = false;      // control token (<|im_start|>); skipped by skip_special_tokens
  bool normalized = false;   // matched in the NFC-normalized text instead of the raw text
  bool lstrip = false;       // the match swallows whitespace on its left
  bool rstrip = false;       // ... and on its right
  bool single_word = false;  // only matches when not inside a word
};

struct EncodeOptions {
  // When false, the text of special added tokens ("<|im_start|>") is encoded as plain text, so
  // user content cannot inject control tokens. Non-special added tokens (Qwen3's <think>,
  // <tool_call>) are still matched. false is HF tokenizers' encode_special_tokens = True
  // (transformers' split_special_tokens=True).
  bool parse_special = true;
};

struct DecodeOptions {
  bool skip_special_tokens = false;
};

class BpeTokenizer {
 public:
  ~BpeTokenizer();
  BpeTokenizer(BpeTokenizer&&) noexcept;
  BpeTokenizer& operator=(BpeTokenizer&&) noexcept;
  BpeTokenizer(const BpeTokenizer&) = delete;
  BpeTokenizer& operator=(const BpeTokenizer&) = delete;

  // Loads a tokenizer.json. Errors name the file and the offending field.
  static Result<BpeTokenizer> load(const std::string& path);
  // Parses tokenizer.json text; `source` names it in errors.
  static Result<BpeTokenizer> from_json(std::string_view json_text, const std::string& source);

  // Never fails: every byte sequence has an encoding. Thread-safe.
  std::vector<TokenId> encode(std::string_view text, const EncodeOptions& options = {}) const;

  // The bytes the ids stand for, concatenated; may be invalid UTF-8 (see above). Ids that are
  // neither in the vocabulary nor added tokens (e.g. an embedding's padding rows, which a model
  // can sample) are skipped, as HF tokenizers skips them.
  std::string decode(std::span<const TokenId> ids, const DecodeOptions& options = {}) const;
  // decode() with ill-formed sequences replaced by U+FFFD (maximal subparts): valid UTF-8, what HF
  // tokenizers' decode returns.
  std::string decode_text(std::span<const TokenId> ids, const DecodeOptions& options = {}) const;

  // The bytes of one token (empty for an unknown id); what decode() concatenates.
  std::string_view token_bytes(TokenId id) const;
  // The token's string as written in tokenizer.json (byte-level alphabet for vocabulary tokens).
  std::optional<std::string_view> id_to_token(TokenId id) const;
  std::optional<TokenId> token_to_id(std::string_view token) const;
  bool is_special(TokenId id) const;
  bool is_known(TokenId id) const;

  // One past the largest id (vocabulary and added tokens): the rows an embedding needs at least.
  size_t vocab_size() const;
  size_t merge_count() const;
  const std::vector<AddedToken>& added_tokens() const;

  struct Impl;  // opaque; defined in bpe_tokenizer.cpp

 private:
  BpeTokenizer();  // only load() and from_json() make one: there is no empty tokenizer
  std::unique_ptr<Impl> impl_;
};

// GPT-2's byte-level alphabet: byte b <-> one printable code point. Printable bytes (! .. ~,
// ¡ .. ¬, ® .. ÿ) map to themselves, the other 68 to U+0100.. in byte order, so every byte has a
// visible, non-whitespace stand-in in the vocabulary.
char32_t byte_to_unicode(uint8_t b);
// The byte a code point of that alphabet stands for, or -1.
int unicode_to_byte(char32_t cp);

}  // namespace moebius::tokenizer
