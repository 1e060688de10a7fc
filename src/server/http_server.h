// A small HTTP/1.1 server over POSIX sockets: one thread per connection, keep-alive, whole and
// chunked (SSE) responses, and a way for a handler to notice that its client went away
// (client_gone()), which the API uses to cancel generation and free KV at once.
//
// Why not a library: Debian 12's cpp-httplib (libcpp-httplib-dev 0.11) is built as a shared
// library linked to OpenSSL, brotli and zlib, and our binaries must run on the GPU machine with
// nothing installed (README: static runtimes, header-only dependencies). Its 0.11 API also has
// no way to see a disconnect while a handler waits for tokens. What we need of HTTP is small.
//
// One thread per connection suits this server: connections are few (clients of one model),
// handlers mostly wait on the engine, and a blocking handler per stream keeps the SSE code
// straight-line. max_connections bounds the threads; past it a connection gets a 503.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "server/http_message.h"

namespace moebius::server {

// One response on a connection: send() once, or begin_stream(), write()..., end_stream().
class HttpResponse {
 public:
  HttpResponse(int fd, bool keep_alive) : fd_(fd), keep_alive_(keep_alive) {}
  // What the request asks of the response's framing: HEAD gets the head only (the same headers,
  // Content-Length included, no body: a body would be read as the next response); an HTTP/1.0
  // client cannot read chunks, so its stream is the raw body, ended by closing the connection.
  void set_request(std::string_view method, int minor_version) {
    head_only_ = method == "HEAD";
    http10_ = minor_version == 0;
  }

  void send(int status, std::string_view content_type, std::string_view body,
            const std::vector<std::string>& extra_headers = {});
  // Starts a chunked response. Returns false when the client is gone.
  bool begin_stream(int status, std::string_view content_type, const std::vector<std::string>& extra_headers = {});
  bool write(std::string_view data);  // one chunk; false when the client is gone
  void end_stream();
  // True when the peer closed or reset the connection (checked without blocking).
  bool client_gone() const;
  // The handler gives up on this request without an answer, because its client is gone
  // (client_gone()): the connection is closed with nothing more written. Without it, a handler
  // that returns before responding gets a 500 "no response", which is for handler bugs; a client
  // that only half-closed its side and still reads would see that 500 instead of a close.
  void abandon() { abandoned_ = true; }
  bool abandoned() const { return abandoned_; }

  bool started() const { return started_; }
  bool failed() const { return failed_; }
  bool keep_alive() const { return keep_alive_ && !failed_; }
  int status() const { return status_; }

 private:
  bool write_all(std::string_view data);
  int fd_;
  bool keep_alive_;
  bool started_ = false;
  bool streaming_ = false;
  bool head_only_ = false;
  bool http10_ = false;
  bool failed_ = false;
  bool abandoned_ = false;
  int status_ = 0;
};

using HttpHandler = std::function<void(const HttpRequest&, HttpResponse&)>;

struct HttpServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;  // 0: any free port (port() tells which)
  HttpLimits limits;
  int max_connections = 1024;
  int idle_timeout_s = 60;  // keep-alive connections idle this long are closed
  int io_timeout_s = 60;    // one whole request (head and body, from its first byte), or one write to a stalled client
  // The body of an error the server answers by itself (bad head, body too large, ...).
  std::function<std::string(int status, const std::string& message)> error_body;
};

class HttpServer {
 public:
  HttpServer(HttpServerOptions options, HttpHandler handler);
  // Stops, then waits for the connection threads: they are detached and use this object and the
  // handler (and what it refers to) until they end, so the server must not go away under them
  // ([TAG_HTTP_SERVER_LIFETIME]). Their blocking steps are bounded (a read by the stop flag, each
  // write by io_timeout_s), so the wait is bounded once whatever the handlers wait on has stopped;
  // a thread still running 2 * io_timeout_s + 1 s later ends the process (exit 2) rather than
  // letting it touch freed memory. Owners destroy the server before what its handler refers to.
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds and listens. Errors name --host/--port.
  Status listen();
  int port() const { return port_; }
  // Accepts connections until stop(); then waits (io_timeout_s at most) for open connections to
  // finish. Some may still run when it returns: a handler that waits for something its owner has
  // not stopped yet (the engine's generation).
  void serve();
  // Waits until every connection thread has ended, for at most `timeout`; true when none is left.
  bool wait_connections_closed(std::chrono::milliseconds timeout);
  // Safe from any thread (not from a signal handler: set a flag and call it from a thread).
  void stop();
  int open_connections() const { return active_.load(); }

 private:
  void connection(int fd);
  bool read_more(int fd, std::string& buffer, std::chrono::steady_clock::time_point deadline, bool idle);

  HttpServerOptions options_;
  HttpHandler handler_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::atomic<int> active_{0};
  std::mutex mu_;
  std::condition_variable drained_;
};

}  // namespace moebius::server
