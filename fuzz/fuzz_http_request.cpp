// libFuzzer target: the HTTP/1.1 request head parser every connection reaches (server/http_message.h):
// find_head_end on the bytes as they arrive, parse_request_head on the head it finds, then
// request_body_length, the way HttpServer::connection calls them.
// The first byte picks the limits: even, the server's defaults; odd, small ones taken from the next
// three bytes (so the 431 and 413 paths are reachable with short inputs). The rest is the buffer.
// Beyond "no crash, no sanitizer report":
//   - find_head_end agrees with a line-by-line reference: the head ends after the first empty line
//     ("\n" or "\r\n" after a "\n") that is not the first line, the one empty line the parser skips;
//   - an error has a documented status (400, 431, 505 for the head; 400, 411, 413 for the body
//     length) with a reason phrase and a non-empty message;
//   - an accepted head keeps the invariants the server relies on: method a token, target and path
//     non-empty with the path a prefix of the target, header names lower-case tokens, values
//     trimmed and free of control characters, at most max_headers of them, the head within
//     max_head_bytes, and every line of the head parsed (none ignored after an early blank line);
//   - an accepted body length is at most max_body_bytes, 0 without Content-Length.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "fuzz_check.h"
#include "server/http_message.h"

using namespace moebius::server;

namespace {

using moebius::fuzz::check;

bool is_tchar(char c) {
  if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')) return true;
  return std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos;
}

// The head's lines as the parser splits them: '\n' ends a line, one '\r' before it is dropped.
// Returns one past the first empty line at index >= 1, or npos; *lines counts the lines up to and
// including that one.
size_t reference_head_end(std::string_view b, size_t* lines) {
  size_t pos = 0, index = 0;
  while (true) {
    const size_t nl = b.find('\n', pos);
    if (nl == std::string_view::npos) return std::string_view::npos;
    std::string_view line = b.substr(pos, nl - pos);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    ++index;
    if (line.empty() && index >= 2) {
      *lines = index;
      return nl + 1;
    }
    pos = nl + 1;
  }
}

void check_error(const HttpError& e, std::initializer_list<int> allowed) {
  bool found = false;
  for (int s : allowed) found |= e.status == s;
  check(found);
  check(!e.message.empty());
  check(status_reason(e.status) != "Unknown");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  HttpLimits limits;
  if (data[0] & 1) {
    limits.max_head_bytes = 8 + size_t{data[1]} * 4;
    limits.max_headers = data[2] % 8;
    limits.max_body_bytes = size_t{data[3]} * 10;
  }
  const std::string_view buffer(reinterpret_cast<const char*>(data + 4), size - 4);

  size_t ref_lines = 0;
  const size_t head_end = find_head_end(buffer);
  check(head_end == reference_head_end(buffer, &ref_lines));
  // What the server hands the parser: the head when it is complete. An incomplete buffer is parsed
  // too (it is never sent there, but the parser must not depend on that for its safety).
  const std::string_view head = head_end == std::string_view::npos ? buffer : buffer.substr(0, head_end);

  HttpRequest r;
  r.method = "sentinel";  // an error leaves *out alone
  if (auto e = parse_request_head(head, limits, &r)) {
    check_error(*e, {400, 431, 505});
    check(r.method == "sentinel");
    return 0;
  }
  check(head.size() <= limits.max_head_bytes);
  check(!r.method.empty());
  for (char c : r.method) check(is_tchar(c));
  check(!r.target.empty() && (r.target[0] == '/' || r.target == "*"));
  for (char c : r.target) check(static_cast<unsigned char>(c) > 0x20 && c != 0x7f);
  check(!r.path.empty() && r.target.compare(0, r.path.size(), r.path) == 0);
  check(r.path.find('?') == std::string::npos);
  check(r.minor_version == 0 || r.minor_version == 1);
  check(r.headers.size() <= limits.max_headers);
  for (const auto& [name, value] : r.headers) {
    check(!name.empty());
    for (char c : name) check(is_tchar(c) && !(c >= 'A' && c <= 'Z'));
    for (char c : value) check((static_cast<unsigned char>(c) >= 0x20 || c == '\t') && c != 0x7f);
    if (!value.empty()) {
      check(value.front() != ' ' && value.front() != '\t');
      check(value.back() != ' ' && value.back() != '\t');
    }
    check(r.header(name) != nullptr);
  }
  if (head_end != std::string_view::npos) {
    // Every line of the head is accounted for: an optional empty first line, the request line,
    // one header per line, the blank line.
    const bool leading_empty = head[0] == '\n' || (head.size() > 1 && head[0] == '\r' && head[1] == '\n');
    check(r.headers.size() + 2 + (leading_empty ? 1 : 0) == ref_lines);
  }
  (void)r.keep_alive();

  size_t length = 12345;
  if (auto e = request_body_length(r, limits, &length)) {
    check_error(*e, {400, 411, 413});
    return 0;
  }
  check(length <= limits.max_body_bytes);
  check(r.header("transfer-encoding") == nullptr);
  if (r.header("content-length") == nullptr) check(length == 0);
  return 0;
}
