#include "server/stop_strings.h"

#include <algorithm>

namespace moebius::server {

size_t partial_match_suffix(std::string_view text, std::string_view pattern) {
  if (pattern.empty()) return 0;
  for (size_t k = std::min(pattern.size() - 1, text.size()); k > 0; --k)
    if (text.substr(text.size() - k) == pattern.substr(0, k)) return k;
  return 0;
}

StopMatcher::StopMatcher(std::vector<std::string> stops) {
  for (std::string& s : stops)
    if (!s.empty()) stops_.push_back(std::move(s));
}

StopMatcher::Out StopMatcher::feed(std::string_view text) {
  Out out;
  if (stopped_) return out;
  pending_.append(text);
  // The earliest complete stop string wins, whichever it is. Earlier text was released only when
  // no stop string could start in it, so a match can only start inside pending_.
  size_t first = std::string::npos;
  for (const std::string& s : stops_) first = std::min(first, pending_.find(s));
  if (first != std::string::npos) {
    out.text = pending_.substr(0, first);
    out.stopped = stopped_ = true;
    pending_.clear();
    return out;
  }
  // Hold back the longest suffix that is a proper prefix of some stop string.
  size_t hold = 0;
  for (const std::string& s : stops_) hold = std::max(hold, partial_match_suffix(pending_, s));
  out.text = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  return out;
}

std::string StopMatcher::flush() {
  std::string rest;
  rest.swap(pending_);
  return rest;
}

}  // namespace moebius::server
