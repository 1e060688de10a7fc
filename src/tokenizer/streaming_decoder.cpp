#include "tokenizer/streaming_decoder.h"

#include "tokenizer/unicode.h"

namespace moebius::tokenizer {

StreamingDecoder::StreamingDecoder(const BpeTokenizer& tokenizer, DecodeOptions options)
    : tokenizer_(&tokenizer), options_(options) {}

std::string StreamingDecoder::feed(TokenId id) {
  if (!tokenizer_->is_known(id)) return {};
  if (options_.skip_special_tokens && tokenizer_->is_special(id)) return {};
  pending_.append(tokenizer_->token_bytes(id));

  std::string out;
  size_t i = 0;
  while (i < pending_.size()) {
    const unicode::Utf8Char c = unicode::decode_utf8(pending_, i);
    // A truncated sequence at the end may still be completed by the next token: keep it. Since
    // it is a well-formed prefix, it is at most 3 bytes.
    if (c.status == unicode::Utf8Status::kTruncated) break;
    if (c.status == unicode::Utf8Status::kValid) {
      out.append(pending_, i, c.length);
    } else {
      unicode::append_utf8(out, unicode::kReplacementChar);
    }
    i += c.length;
  }
  pending_.erase(0, i);
  return out;
}

std::string StreamingDecoder::flush() {
  // Whatever is left is a truncated sequence: one maximal subpart, so one U+FFFD.
  std::string out = unicode::sanitize_utf8(pending_);
  pending_.clear();
  return out;
}

}  // namespace moebius::tokenizer
