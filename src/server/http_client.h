// A minimal blocking HTTP/1.1 client for `moebius bench serve`: one POST per connection
// (Connection: close), the response body delivered as it arrives (chunked or not), so a benchmark
// can time each SSE event. http:// only; no TLS, no redirects, no proxies.
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace moebius::server {

struct HttpUrl {
  std::string host;
  int port = 80;
  std::string path;  // "" when the URL has none
};
// "http://host[:port][/path]". Errors name the URL.
Result<HttpUrl> parse_http_url(const std::string& url);

struct HttpClientResponse {
  int status = 0;
  std::string body;  // the whole body when status != 200 (the error), else empty
};

// POSTs `body` (application/json) to url.host:url.port `path` with `headers` ("Name: value"
// lines). For a 200, on_body gets the decoded body as it arrives; returning false stops reading.
// Errors for connection and framing failures.
Result<HttpClientResponse> http_post(const HttpUrl& url, const std::string& path, const std::string& body,
                                     const std::vector<std::string>& headers,
                                     const std::function<bool(std::string_view)>& on_body, int timeout_s = 600);

}  // namespace moebius::server
