// Incremental detokenization for generation: ids arrive one at a time, text leaves as soon as it
// is complete. A byte-level token can end in the middle of a UTF-8 character (CJK and emoji are
// often split over two or three tokens), so the decoder holds back an incomplete tail and never
// emits half a character.
//
// Output is always valid UTF-8. Bytes that can never become a character (an ill-formed maximal
// subpart) are emitted as U+FFFD as soon as they are known to be ill-formed. The concatenation of
// everything feed() and flush() return equals BpeTokenizer::decode_text() of the same ids.
#pragma once

#include <string>

#include "tokenizer/bpe_tokenizer.h"

namespace moebius::tokenizer {

class StreamingDecoder {
 public:
  // `tokenizer` must outlive the decoder.
  explicit StreamingDecoder(const BpeTokenizer& tokenizer, DecodeOptions options = {});

  // Adds one token; returns the text it completes (possibly empty). Unknown ids add nothing.
  std::string feed(TokenId id);
  // Ends the stream: returns the held-back tail, an incomplete character becoming one U+FFFD.
  // The decoder is then empty and can start a new stream.
  std::string flush();
  // Drops the held-back bytes without emitting them.
  void reset() { pending_.clear(); }

  // Bytes held back (at most 3: the start of one UTF-8 character).
  size_t pending_bytes() const { return pending_.size(); }

 private:
  const BpeTokenizer* tokenizer_;
  DecodeOptions options_;
  std::string pending_;
};

}  // namespace moebius::tokenizer
