#include "server/http_message.h"

#include <algorithm>
#include <charconv>

#include <fmt/format.h>

namespace moebius::server {
namespace {

bool is_tchar(char c) {  // RFC 9110 token characters
  if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')) return true;
  return std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos;
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  return out;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// Splits off the next line (without its "\r\n" or "\n").
std::string_view next_line(std::string_view& rest) {
  const size_t nl = rest.find('\n');
  std::string_view line = rest.substr(0, nl);
  rest.remove_prefix(nl == std::string_view::npos ? rest.size() : nl + 1);
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  return line;
}

bool contains_token(std::string_view list, std::string_view token) {
  // Comma-separated, case-insensitive ("Connection: keep-alive, Upgrade").
  while (!list.empty()) {
    const size_t comma = list.find(',');
    if (lower(trim(list.substr(0, comma))) == token) return true;
    list.remove_prefix(comma == std::string_view::npos ? list.size() : comma + 1);
  }
  return false;
}

}  // namespace

const std::string* HttpRequest::header(std::string_view name) const {
  for (const auto& [k, v] : headers)
    if (k == name) return &v;
  return nullptr;
}

bool HttpRequest::keep_alive() const {
  const std::string* c = header("connection");
  if (minor_version == 0) return c != nullptr && contains_token(*c, "keep-alive");
  return c == nullptr || !contains_token(*c, "close");
}

size_t find_head_end(std::string_view b) {
  // The blank line as next_line() sees it: "\n" or "\r\n" right after a "\n", whatever ended the
  // line before ("\n\r\n" too, not only "\r\n\r\n" and "\n\n"). Anything else would let the
  // parser stop at a blank line this search skipped, dropping the lines between.
  for (size_t nl = b.find('\n'); nl != std::string_view::npos; nl = b.find('\n', nl + 1)) {
    if (nl + 1 < b.size() && b[nl + 1] == '\n') return nl + 2;
    if (nl + 2 < b.size() && b[nl + 1] == '\r' && b[nl + 2] == '\n') return nl + 3;
  }
  return std::string_view::npos;
}

std::optional<HttpError> parse_request_head(std::string_view head, const HttpLimits& limits, HttpRequest* out) {
  if (head.size() > limits.max_head_bytes)
    return HttpError{431, fmt::format("the request head has more than {} bytes", limits.max_head_bytes)};
  HttpRequest r;
  std::string_view rest = head;
  // RFC 9112 2.2: a server SHOULD ignore at least one empty line before the request line.
  std::string_view line = next_line(rest);
  if (line.empty()) line = next_line(rest);
  const size_t sp1 = line.find(' ');
  const size_t sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp1 == std::string_view::npos || sp2 == std::string_view::npos || line.find(' ', sp2 + 1) != std::string_view::npos)
    return HttpError{400, "malformed request line"};
  const std::string_view method = line.substr(0, sp1), target = line.substr(sp1 + 1, sp2 - sp1 - 1),
                         version = line.substr(sp2 + 1);
  if (method.empty() || !std::all_of(method.begin(), method.end(), is_tchar)) return HttpError{400, "malformed method"};
  if (target.empty() || (target[0] != '/' && target != "*")) return HttpError{400, "malformed request target"};
  for (char c : target)
    if (static_cast<unsigned char>(c) <= 0x20 || c == 0x7f) return HttpError{400, "malformed request target"};
  if (version.size() != 8 || version.substr(0, 7) != "HTTP/1." || (version[7] != '0' && version[7] != '1'))
    return HttpError{505, "only HTTP/1.0 and HTTP/1.1 are supported"};
  r.method = std::string(method);
  r.target = std::string(target);
  r.path = std::string(target.substr(0, target.find('?')));
  r.minor_version = version[7] - '0';
  while (!rest.empty()) {
    line = next_line(rest);
    if (line.empty()) break;  // the blank line ending the head
    if (line[0] == ' ' || line[0] == '\t') return HttpError{400, "obsolete header line folding"};
    const size_t colon = line.find(':');
    if (colon == std::string_view::npos || colon == 0) return HttpError{400, "malformed header line"};
    const std::string_view name = line.substr(0, colon);
    if (!std::all_of(name.begin(), name.end(), is_tchar)) return HttpError{400, "malformed header name"};
    const std::string_view value = trim(line.substr(colon + 1));
    for (char c : value)
      if ((static_cast<unsigned char>(c) < 0x20 && c != '\t') || c == 0x7f)
        return HttpError{400, "control character in a header value"};
    if (r.headers.size() >= limits.max_headers)
      return HttpError{431, fmt::format("more than {} header fields", limits.max_headers)};
    r.headers.emplace_back(lower(name), std::string(value));
  }
  *out = std::move(r);
  return std::nullopt;
}

std::optional<HttpError> request_body_length(const HttpRequest& r, const HttpLimits& limits, size_t* length) {
  if (r.header("transfer-encoding") != nullptr)
    return HttpError{411, "chunked request bodies are not supported; send Content-Length"};
  *length = 0;
  bool seen = false;
  for (const auto& [k, v] : r.headers) {
    if (k != "content-length") continue;
    uint64_t n = 0;
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
    if (v.empty() || ec != std::errc() || end != v.data() + v.size()) return HttpError{400, "malformed Content-Length"};
    if (seen && n != *length) return HttpError{400, "conflicting Content-Length headers"};
    if (n > limits.max_body_bytes)
      return HttpError{413, fmt::format("the request body has {} bytes; the limit is {}", n, limits.max_body_bytes)};
    *length = static_cast<size_t>(n);
    seen = true;
  }
  return std::nullopt;
}

std::string_view status_reason(int status) {
  switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 411: return "Length Required";
    case 413: return "Content Too Large";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    default: return "Unknown";
  }
}

std::string response_head(int status, std::string_view content_type, std::optional<size_t> content_length,
                          bool keep_alive, const std::vector<std::string>& extra, bool chunked) {
  std::string h = fmt::format("HTTP/1.1 {} {}\r\n", status, status_reason(status));
  if (!content_type.empty()) h += fmt::format("Content-Type: {}\r\n", content_type);
  if (content_length) h += fmt::format("Content-Length: {}\r\n", *content_length);
  else if (chunked) h += "Transfer-Encoding: chunked\r\n";
  h += keep_alive ? "Connection: keep-alive\r\n" : "Connection: close\r\n";
  for (const std::string& e : extra) h += e + "\r\n";
  h += "\r\n";
  return h;
}

std::string http_chunk(std::string_view data) {
  if (data.empty()) return "0\r\n\r\n";
  return fmt::format("{:x}\r\n{}\r\n", data.size(), data);
}

}  // namespace moebius::server
