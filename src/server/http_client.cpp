#include "server/http_client.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cstring>
#include <vector>

#include <fmt/format.h>

#include "server/http_message.h"

namespace moebius::server {

Result<HttpUrl> parse_http_url(const std::string& url) {
  constexpr std::string_view scheme = "http://";
  if (url.rfind(scheme, 0) != 0) return Error::format("'{}': only http:// URLs are supported", url).in_field("--url");
  std::string_view rest = std::string_view(url).substr(scheme.size());
  HttpUrl u;
  const size_t slash = rest.find('/');
  if (slash != std::string_view::npos) {
    u.path = std::string(rest.substr(slash));
    if (u.path == "/") u.path.clear();
    rest = rest.substr(0, slash);
  }
  const size_t colon = rest.rfind(':');
  if (colon != std::string_view::npos && rest.find(']') == std::string_view::npos) {
    const std::string_view p = rest.substr(colon + 1);
    const auto [end, ec] = std::from_chars(p.data(), p.data() + p.size(), u.port);
    if (ec != std::errc() || end != p.data() + p.size() || u.port < 1 || u.port > 65535)
      return Error::format("'{}': bad port", url).in_field("--url");
    rest = rest.substr(0, colon);
  }
  u.host = std::string(rest);
  if (u.host.empty()) return Error::format("'{}': no host", url).in_field("--url");
  return u;
}

namespace {

class Socket {
 public:
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket() {
    if (fd_ >= 0) ::close(fd_);
  }
  int fd() const { return fd_; }

 private:
  int fd_;
};

Result<int> connect_to(const HttpUrl& u) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(u.port);
  if (int rc = ::getaddrinfo(u.host.c_str(), port.c_str(), &hints, &res); rc != 0)
    return Error::format("cannot resolve '{}': {}", u.host, gai_strerror(rc));
  int fd = -1;
  std::string err = "no address";
  for (addrinfo* a = res; a != nullptr && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    if (::connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      err = std::strerror(errno);
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(res);
  if (fd < 0) return Error::format("cannot connect to {}:{}: {}", u.host, u.port, err);
  return fd;
}

}  // namespace

Result<HttpClientResponse> http_post(const HttpUrl& url, const std::string& path, const std::string& body,
                                     const std::vector<std::string>& headers,
                                     const std::function<bool(std::string_view)>& on_body, int timeout_s) {
  MOEBIUS_ASSIGN_OR_RETURN(int fd, connect_to(url));
  Socket sock(fd);
  std::string req = fmt::format(
      "POST {} HTTP/1.1\r\nHost: {}:{}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n"
      "Connection: close\r\n",
      path, url.host, url.port, body.size());
  for (const std::string& h : headers) req += h + "\r\n";
  req += "\r\n" + body;
  for (std::string_view rest = req; !rest.empty();) {
    const ssize_t n = ::send(fd, rest.data(), rest.size(), MSG_NOSIGNAL);
    if (n <= 0) return Error::format("sending the request failed: {}", std::strerror(errno));
    rest.remove_prefix(static_cast<size_t>(n));
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  std::string buf;
  bool eof = false;
  const auto read_more = [&]() -> Status {
    while (true) {
      if (std::chrono::steady_clock::now() > deadline) return Error("timed out reading the response");
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 200) <= 0) continue;
      char tmp[16384];
      const ssize_t n = ::recv(fd, tmp, sizeof(tmp), 0);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return Error::format("reading the response failed: {}", std::strerror(errno));
      if (n == 0) eof = true;
      else buf.append(tmp, static_cast<size_t>(n));
      return Ok{};
    }
  };
  size_t head_end;
  while ((head_end = find_head_end(buf)) == std::string::npos) {
    if (eof) return Error("the connection closed before a response head");
    MOEBIUS_TRY(read_more());
  }
  // "HTTP/1.1 200 OK": the status is the second word.
  HttpClientResponse out;
  const std::string_view status_line = std::string_view(buf).substr(0, buf.find('\n'));
  if (status_line.size() < 12) return Error("malformed status line");
  std::from_chars(status_line.data() + 9, status_line.data() + 12, out.status);
  const std::string head = buf.substr(0, head_end);
  std::string lower_head = head;
  for (char& c : lower_head) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const bool chunked = lower_head.find("transfer-encoding: chunked") != std::string::npos;
  buf.erase(0, head_end);
  const auto deliver = [&](std::string_view data) {
    if (out.status != 200) {
      out.body.append(data);
      return true;
    }
    return on_body(data);
  };
  if (!chunked) {  // Content-Length or until close; either way, everything up to EOF
    while (true) {
      if (!buf.empty() && !deliver(buf)) return out;
      buf.clear();
      if (eof) return out;
      MOEBIUS_TRY(read_more());
    }
  }
  while (true) {
    size_t eol;
    while ((eol = buf.find("\r\n")) == std::string::npos) {
      if (eof) return Error("the connection closed inside a chunked body");
      MOEBIUS_TRY(read_more());
    }
    size_t size = 0;
    const auto [end, ec] = std::from_chars(buf.data(), buf.data() + eol, size, 16);
    if (ec != std::errc()) return Error("malformed chunk size");
    (void)end;
    if (size == 0) return out;
    while (buf.size() < eol + 2 + size + 2) {
      if (eof) return Error("the connection closed inside a chunk");
      MOEBIUS_TRY(read_more());
    }
    if (!deliver(std::string_view(buf).substr(eol + 2, size))) return out;
    buf.erase(0, eol + 2 + size + 2);
  }
}

}  // namespace moebius::server
