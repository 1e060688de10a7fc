#include "server/http_server.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <system_error>
#include <optional>
#include <thread>

#include "core/log.h"

namespace moebius::server {

// ---------------------------------------------------------------------------------------------
// HttpResponse
// ---------------------------------------------------------------------------------------------

bool HttpResponse::write_all(std::string_view data) {
  while (!data.empty() && !failed_) {
    // MSG_NOSIGNAL: a closed peer is an error return, not a SIGPIPE that kills the server.
    const ssize_t n = ::send(fd_, data.data(), data.size(), MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      failed_ = true;  // the peer is gone, or SO_SNDTIMEO expired on a stalled one
      break;
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
  return !failed_;
}

void HttpResponse::send(int status, std::string_view content_type, std::string_view body,
                        const std::vector<std::string>& extra) {
  MOEBIUS_ASSERT(!started_, "a second response on one request");
  started_ = true;
  status_ = status;
  std::string msg = response_head(status, content_type, body.size(), keep_alive_, extra);
  if (!head_only_) msg.append(body);
  write_all(msg);
}

bool HttpResponse::begin_stream(int status, std::string_view content_type, const std::vector<std::string>& extra) {
  MOEBIUS_ASSERT(!started_, "a second response on one request");
  started_ = streaming_ = true;
  status_ = status;
  if (http10_) keep_alive_ = false;  // the body ends with the connection
  return write_all(response_head(status, content_type, std::nullopt, keep_alive_, extra, /*chunked=*/!http10_));
}

bool HttpResponse::write(std::string_view data) {
  MOEBIUS_ASSERT(streaming_, "write() outside a stream");
  if (data.empty()) return !failed_;  // an empty chunk would end the body
  if (head_only_) return !failed_;
  return write_all(http10_ ? std::string(data) : http_chunk(data));
}

void HttpResponse::end_stream() {
  MOEBIUS_ASSERT(streaming_, "end_stream() outside a stream");
  if (!head_only_ && !http10_) write_all(http_chunk(""));
  streaming_ = false;
}

bool HttpResponse::client_gone() const {
  if (failed_) return true;
  pollfd p{fd_, POLLRDHUP, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

// ---------------------------------------------------------------------------------------------
// HttpServer
// ---------------------------------------------------------------------------------------------

HttpServer::HttpServer(HttpServerOptions options, HttpHandler handler)
    : options_(std::move(options)), handler_(std::move(handler)) {
  if (!options_.error_body)
    options_.error_body = [](int, const std::string& message) { return message + "\n"; };
}

HttpServer::~HttpServer() {
  stop();
  if (listen_fd_ >= 0) ::close(listen_fd_);
  // [TAG_HTTP_SERVER_LIFETIME]
  const auto bound = std::chrono::seconds(2 * static_cast<int64_t>(options_.io_timeout_s) + 1);
  if (!wait_connections_closed(bound)) {
    log_error("{} connection(s) still running {} s after the server stopped; exiting now rather than freeing "
              "memory they use",
              active_.load(), bound.count());
    std::fflush(stderr);
    std::_Exit(2);
  }
}

bool HttpServer::wait_connections_closed(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  return drained_.wait_for(lock, timeout, [&] { return active_.load() == 0; });
}

Status HttpServer::listen() {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(options_.port);
  if (int rc = ::getaddrinfo(options_.host.c_str(), port.c_str(), &hints, &res); rc != 0)
    return Error::format("cannot resolve '{}': {}", options_.host, gai_strerror(rc)).in_field("--host");
  std::string last_error = "no address";
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 512) == 0) {
      listen_fd_ = fd;
      break;
    }
    last_error = std::strerror(errno);
    ::close(fd);
  }
  ::freeaddrinfo(res);
  if (listen_fd_ < 0)
    return Error::format("cannot listen on {}:{}: {}", options_.host, options_.port, last_error).in_field("--port");
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  port_ = ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                           : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  return Ok{};
}

void HttpServer::stop() { stopping_ = true; }

void HttpServer::serve() {
  MOEBIUS_ASSERT(listen_fd_ >= 0, "serve() before listen()");
  while (!stopping_) {
    // Poll in slices so stop() is noticed without closing the socket under accept().
    pollfd p{listen_fd_, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));  // SSE events go out at once
    timeval tv{options_.io_timeout_s, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    if (active_.load() >= options_.max_connections) {
      HttpResponse r(fd, false);
      r.send(503, "application/json", options_.error_body(503, "too many open connections"));
      ::close(fd);
      continue;
    }
    ++active_;
    try {
      std::thread([this, fd] {
        connection(fd);
        ::close(fd);
        std::lock_guard<std::mutex> lock(mu_);
        --active_;
        drained_.notify_all();
      }).detach();
    } catch (const std::system_error& e) {
      // No thread for this connection (a process, thread or memory limit below max_connections):
      // refuse it as a full server would, instead of letting the exception end the process.
      {
        std::lock_guard<std::mutex> lock(mu_);
        --active_;
      }
      HttpResponse r(fd, false);
      r.send(503, "application/json", options_.error_body(503, "cannot start a connection thread"));
      ::close(fd);
      log_warn("connection refused: cannot start its thread ({})", e.what());
    }
  }
  ::close(listen_fd_);
  listen_fd_ = -1;
  // Connections see stopping_ between requests; handlers end when the engine fails their requests.
  wait_connections_closed(std::chrono::seconds(options_.io_timeout_s));
}

// Reads more bytes into `buffer`. Waits until `deadline` at most; while `idle` (between requests),
// gives up early when the server stops. False on EOF, error, timeout or stop.
bool HttpServer::read_more(int fd, std::string& buffer, std::chrono::steady_clock::time_point deadline, bool idle) {
  while (true) {
    if (idle && stopping_) return false;
    pollfd p{fd, POLLIN, 0};
    const int rc = ::poll(&p, 1, 100);
    if (rc < 0 && errno != EINTR) return false;
    if (rc > 0) {
      char tmp[16384];
      const ssize_t n = ::recv(fd, tmp, sizeof(tmp), 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      buffer.append(tmp, static_cast<size_t>(n));
      return true;
    }
    if (std::chrono::steady_clock::now() > deadline) return false;
  }
}

namespace {

// After an error answered before the body was read: stop sending, then read and discard what the
// client still sends (for at most a few seconds). Closing at once would reset the connection
// under a client that is still uploading, and it would never see the response (a 413 above all).
void lingering_close(int fd) {
  ::shutdown(fd, SHUT_WR);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(3);
  char tmp[65536];
  while (std::chrono::steady_clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    const ssize_t n = ::recv(fd, tmp, sizeof(tmp), 0);
    if (n <= 0 && !(n < 0 && errno == EINTR)) return;
  }
}

}  // namespace

void HttpServer::connection(int fd) {
  const HttpLimits& limits = options_.limits;
  std::string buffer;
  using Clock = std::chrono::steady_clock;
  while (true) {
    // A request's head and body must arrive within io_timeout_s of its first byte, however the
    // bytes are spaced: a per-read timeout let a client dripping one byte every few seconds hold
    // its connection (and with max_connections of them, the server) forever.
    std::optional<Clock::time_point> request_deadline;
    if (!buffer.empty()) request_deadline = Clock::now() + std::chrono::seconds(options_.io_timeout_s);
    size_t head_end;
    while ((head_end = find_head_end(buffer)) == std::string::npos) {
      if (buffer.size() > limits.max_head_bytes) {
        HttpResponse(fd, false).send(431, "application/json", options_.error_body(431, "the request head is too large"));
        return;
      }
      const bool idle = buffer.empty();
      const auto deadline =
          idle ? Clock::now() + std::chrono::seconds(options_.idle_timeout_s) : *request_deadline;
      if (!read_more(fd, buffer, deadline, idle)) return;
      if (!request_deadline) request_deadline = Clock::now() + std::chrono::seconds(options_.io_timeout_s);
    }
    HttpRequest req;
    if (auto e = parse_request_head(std::string_view(buffer).substr(0, head_end), limits, &req)) {
      HttpResponse(fd, false).send(e->status, "application/json", options_.error_body(e->status, e->message));
      return;
    }
    size_t length = 0;
    if (auto e = request_body_length(req, limits, &length)) {
      // The body is not read, so the connection cannot be reused.
      HttpResponse(fd, false).send(e->status, "application/json", options_.error_body(e->status, e->message));
      lingering_close(fd);
      return;
    }
    if (const std::string* expect = req.header("expect"); expect != nullptr && *expect == "100-continue" &&
                                                          buffer.size() - head_end < length) {
      if (::send(fd, "HTTP/1.1 100 Continue\r\n\r\n", 25, MSG_NOSIGNAL) != 25) return;
    }
    while (buffer.size() - head_end < length)
      if (!read_more(fd, buffer, *request_deadline, false)) return;
    req.body = buffer.substr(head_end, length);
    buffer.erase(0, head_end + length);

    HttpResponse res(fd, req.keep_alive() && !stopping_);
    res.set_request(req.method, req.minor_version);
    try {
      handler_(req, res);
    } catch (const std::exception& e) {
      log_error("handler for {} {} threw: {}", req.method, req.path, e.what());
      if (!res.started()) res.send(500, "application/json", options_.error_body(500, "internal error"));
      return;
    }
    if (res.abandoned()) return;  // closed with nothing more written (abandon())
    if (!res.started()) res.send(500, "application/json", options_.error_body(500, "no response"));
    if (!res.keep_alive()) return;
  }
}

}  // namespace moebius::server
