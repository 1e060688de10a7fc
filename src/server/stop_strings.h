// Stop strings over streamed text. Generated text arrives in pieces (one token's worth at a time)
// and a stop string may be split across tokens ("<|" + "end|>"), so the matcher holds back the
// tail that could still become a stop string and releases it only once it cannot. What it
// returns never contains anything after the stop string that ended it, nor that string itself
// (as OpenAI's "stop" specifies) unless include_stop asks for it; a stop string lying wholly in
// feed_unchecked() text (the first min_tokens tokens) is not a stop and is returned as text.
// When stop strings overlap, the one that completes first wins (the earliest end; of two ending
// together, the earlier start), so the result does not depend on how the text is cut in pieces.
//
// Held-back text is always a prefix of some stop string, so it starts on a UTF-8 character
// boundary when the input is valid UTF-8: the emitted text stays valid UTF-8.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace moebius::server {

// The length of the longest suffix of `text` that is a proper prefix of `pattern`: how much of a
// streamed text to hold back because `pattern` may still complete there. StopMatcher and the
// chat output parser's tags (server/chat_output_parser.h) hold back with it. [TAG_STREAM_HOLDBACK]
size_t partial_match_suffix(std::string_view text, std::string_view pattern);

class StopMatcher {
 public:
  StopMatcher() = default;
  // Empty strings are ignored. include_stop: the text emitted at a stop ends with the stop string
  // (vLLM's include_stop_str_in_output) instead of right before it.
  explicit StopMatcher(std::vector<std::string> stops, bool include_stop = false);

  struct Out {
    std::string text;      // safe to emit now
    bool stopped = false;  // a stop string completed; `text` ends right before it (or with it)
  };
  // Adds the next piece of text. After a stop, further calls return nothing.
  Out feed(std::string_view text);
  // Adds text that stop strings do not apply to yet (the first min_tokens tokens, vLLM's rule): a
  // stop string lying wholly inside such text is not a stop. One that starts in it and completes
  // in text fed later is (vLLM searches back by the stop string's length), so the tail that could
  // begin one is held back as feed() holds it. Never stops.
  Out feed_unchecked(std::string_view text);
  // The end of generation without a stop: everything still held back.
  std::string flush();

  size_t held_bytes() const { return pending_.size(); }
  bool stopped() const { return stopped_; }

 private:
  std::string release();

  std::vector<std::string> stops_;
  bool include_stop_ = false;
  std::string pending_;
  // pending_[0, unchecked_) arrived through feed_unchecked(): a match must end after it.
  size_t unchecked_ = 0;
  bool stopped_ = false;
};

}  // namespace moebius::server
