// HTTP/1.1 messages, the part that is plain text processing: parsing a request head, formatting a
// response head, chunked transfer encoding. No sockets here (http_server.h has them), so the
// parser is unit-tested and fuzzed on its own.
//
// The subset: request line "METHOD SP request-target SP HTTP/1.x", header fields, a body of
// Content-Length bytes. Chunked request bodies are refused (411): the clients we serve (the
// OpenAI SDKs, curl, benchmark tools) send Content-Length. Responses are either whole
// (Content-Length) or chunked (SSE streams), so keep-alive works for both.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace moebius::server {

struct HttpRequest {
  std::string method;  // as sent, e.g. "POST"
  std::string target;  // "/v1/completions?x=1"
  std::string path;    // "/v1/completions"
  int minor_version = 1;  // HTTP/1.<minor>
  std::vector<std::pair<std::string, std::string>> headers;  // names lower-cased, values trimmed
  std::string body;

  // The first header of that (lower-case) name.
  const std::string* header(std::string_view name) const;
  // HTTP/1.1 keeps the connection unless "Connection: close"; 1.0 only with "keep-alive".
  bool keep_alive() const;
};

struct HttpError {
  int status = 400;
  std::string message;
};

struct HttpLimits {
  size_t max_head_bytes = 16 * 1024;
  size_t max_headers = 100;
  size_t max_body_bytes = 4u << 20;
};

// Parses the head: everything up to and including the blank line ("\r\n\r\n"; bare "\n" line
// ends are accepted too). Errors: 400 malformed, 431 too many or too long headers, 505 not
// HTTP/1.x.
std::optional<HttpError> parse_request_head(std::string_view head, const HttpLimits& limits, HttpRequest* out);

// The body length the head announces: 0 without Content-Length. Errors: 411 for
// Transfer-Encoding (chunked bodies are not supported), 400 for a malformed or conflicting
// Content-Length, 413 past limits.max_body_bytes.
std::optional<HttpError> request_body_length(const HttpRequest& request, const HttpLimits& limits, size_t* length);

// The end of the head in `buffer` (one past the first blank line, "\r\n" or "\n" after a "\n";
// a first line that is empty is the one parse_request_head skips), or npos while incomplete.
size_t find_head_end(std::string_view buffer);

std::string_view status_reason(int status);

// "HTTP/1.1 <status> <reason>" plus Content-Type, Content-Length (or, when content_length is
// nullopt, Transfer-Encoding: chunked, or no framing header at all when !chunked: a body that ends
// with the connection, for HTTP/1.0 clients, who cannot read chunks), Connection, and `extra`
// header lines ("Name: value").
std::string response_head(int status, std::string_view content_type, std::optional<size_t> content_length,
                          bool keep_alive, const std::vector<std::string>& extra = {}, bool chunked = true);

// One chunk of a chunked body; the empty string's chunk ends the body ("0\r\n\r\n").
std::string http_chunk(std::string_view data);

}  // namespace moebius::server
