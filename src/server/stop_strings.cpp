#include "server/stop_strings.h"

#include <algorithm>

namespace moebius::server {

size_t partial_match_suffix(std::string_view text, std::string_view pattern) {
  if (pattern.empty()) return 0;
  for (size_t k = std::min(pattern.size() - 1, text.size()); k > 0; --k)
    if (text.substr(text.size() - k) == pattern.substr(0, k)) return k;
  return 0;
}

StopMatcher::StopMatcher(std::vector<std::string> stops, bool include_stop) : include_stop_(include_stop) {
  for (std::string& s : stops)
    if (!s.empty()) stops_.push_back(std::move(s));
}

StopMatcher::Out StopMatcher::feed(std::string_view text) {
  Out out;
  if (stopped_) return out;
  pending_.append(text);
  // The stop string that completes first wins: the earliest end, then the earliest start (a
  // stream cut token by token would have met it first, whatever the cuts). Earlier text was
  // released only when no stop string could start in it, so a match can only start inside
  // pending_. A match must end past the unchecked text: one wholly inside it was not a stop when
  // it arrived.
  size_t first = std::string::npos, length = 0;
  for (const std::string& s : stops_) {
    const size_t from = unchecked_ >= s.size() ? unchecked_ - s.size() + 1 : 0;
    const size_t at = pending_.find(s, from);
    if (at == std::string::npos) continue;
    const size_t end = at + s.size();
    if (first == std::string::npos || end < first + length || (end == first + length && at < first)) {
      first = at;
      length = s.size();
    }
  }
  if (first != std::string::npos) {
    out.text = pending_.substr(0, include_stop_ ? first + length : first);
    out.stopped = stopped_ = true;
    pending_.clear();
    unchecked_ = 0;
    return out;
  }
  out.text = release();
  return out;
}

StopMatcher::Out StopMatcher::feed_unchecked(std::string_view text) {
  Out out;
  if (stopped_) return out;
  pending_.append(text);
  unchecked_ = pending_.size();
  out.text = release();
  return out;
}

// Releases all of pending_ but its longest suffix that is a proper prefix of some stop string.
std::string StopMatcher::release() {
  size_t hold = 0;
  for (const std::string& s : stops_) hold = std::max(hold, partial_match_suffix(pending_, s));
  const size_t n = pending_.size() - hold;
  std::string out = pending_.substr(0, n);
  pending_.erase(0, n);
  unchecked_ = unchecked_ > n ? unchecked_ - n : 0;
  return out;
}

std::string StopMatcher::flush() {
  std::string rest;
  rest.swap(pending_);
  unchecked_ = 0;
  return rest;
}

}  // namespace moebius::server
