// HttpServer (src/server/http_server.h) over real sockets with a trivial handler: what a client
// can do to a connection's lifetime. The parsers have their own tests (test_http_message.cpp) and
// fuzz target; the OpenAI layer is tested through the engine (test_chat_api_server.cpp, the node
// client suite).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include "server/http_server.h"
#include "socket_test_util.h"

namespace moebius::server {
namespace {

using Clock = std::chrono::steady_clock;

int connect_to(int port) { return testing::connect_loopback(port); }

// True once the server has closed its side (a read returns 0 or fails), polling for up to `wait`.
bool closed_by_server(int fd, std::chrono::milliseconds wait) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(wait.count())) <= 0) return false;
  char tmp[4096];
  while (true) {
    const ssize_t n = ::recv(fd, tmp, sizeof(tmp), MSG_DONTWAIT);
    if (n == 0) return true;
    if (n < 0) return errno != EAGAIN && errno != EWOULDBLOCK;
    // A response arrived (an error answer): keep reading until the close.
    if (::poll(&p, 1, static_cast<int>(wait.count())) <= 0) return false;
  }
}

struct Server {
  explicit Server(int io_timeout_s) {
    HttpServerOptions o;
    o.port = 0;
    o.io_timeout_s = io_timeout_s;
    o.idle_timeout_s = 30;
    o.error_body = [](int, const std::string& m) { return "{\"error\": \"" + m + "\"}"; };
    http = std::make_unique<HttpServer>(o, [](const HttpRequest& req, HttpResponse& res) {
      if (req.path == "/abandon") {  // a handler whose client is gone
        res.abandon();
        return;
      }
      if (req.path == "/silent") return;  // a handler bug: no response at all
      if (req.path == "/stream") {
        res.begin_stream(200, "text/plain");
        res.write("abc");
        res.write("def");
        res.end_stream();
        return;
      }
      res.send(200, "text/plain", "got " + std::to_string(req.body.size()));
    });
    EXPECT_TRUE(http->listen().ok());
    serving = std::thread([this] { http->serve(); });
  }
  ~Server() {
    http->stop();
    serving.join();
  }
  std::unique_ptr<HttpServer> http;
  std::thread serving;
};

// A client that drips a body one byte at a time, each byte well inside the old per-read timeout,
// held its connection as long as it liked (with max_connections of them, the whole server). The
// whole request now has io_timeout_s from its first byte.
TEST(HttpServer, ADrippedRequestIsCutAtTheRequestDeadline) {
  Server s(/*io_timeout_s=*/2);
  const int fd = connect_to(s.http->port());
  const std::string head = "POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\n";
  ASSERT_EQ(::send(fd, head.data(), head.size(), MSG_NOSIGNAL), static_cast<ssize_t>(head.size()));
  const auto t0 = Clock::now();
  bool closed = false;
  for (int i = 0; i < 12 && !closed; ++i) {  // 6 s of drip at most, one byte each 0.5 s
    (void)::send(fd, "a", 1, MSG_NOSIGNAL);
    closed = closed_by_server(fd, std::chrono::milliseconds(500));
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_TRUE(closed) << "the connection outlived the request deadline (" << seconds << " s)";
  EXPECT_LT(seconds, 4.0);
  ::close(fd);

  // A request that arrives in time is answered, and the next one on the connection gets its own
  // deadline.
  const int ok = connect_to(s.http->port());
  const std::string req = "POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabc";
  for (int i = 0; i < 2; ++i) {
    ASSERT_EQ(::send(ok, req.data(), req.size(), MSG_NOSIGNAL), static_cast<ssize_t>(req.size()));
    std::string got;
    char tmp[4096];
    while (got.find("got 3") == std::string::npos) {
      pollfd p{ok, POLLIN, 0};
      ASSERT_GT(::poll(&p, 1, 5000), 0);
      const ssize_t n = ::recv(ok, tmp, sizeof(tmp), 0);
      ASSERT_GT(n, 0);
      got.append(tmp, static_cast<size_t>(n));
    }
    EXPECT_EQ(got.rfind("HTTP/1.1 200", 0), 0u) << got;
    std::this_thread::sleep_for(std::chrono::milliseconds(i == 0 ? 2500 : 0));  // idle past io_timeout_s
  }
  ::close(ok);
}

// Sends `request` and reads until `done(text so far)` or the peer closes; the text read.
template <typename Done>
std::string exchange(int fd, const std::string& request, Done done) {
  EXPECT_EQ(::send(fd, request.data(), request.size(), MSG_NOSIGNAL), static_cast<ssize_t>(request.size()));
  std::string got;
  char tmp[4096];
  while (!done(got)) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 5000) <= 0) break;
    const ssize_t n = ::recv(fd, tmp, sizeof(tmp), 0);
    if (n <= 0) break;
    got.append(tmp, static_cast<size_t>(n));
  }
  return got;
}

// HEAD gets the head only: a body after it would be read as the start of the next response on a
// keep-alive connection (curl: "Excess found"). An HTTP/1.0 client gets a stream as the raw body
// ended by the close: RFC 9112 forbids chunked framing towards 1.0.
TEST(HttpServer, HeadHasNoBodyAndHttp10StreamsAreNotChunked) {
  Server s(/*io_timeout_s=*/10);
  const int fd = connect_to(s.http->port());
  const std::string head =
      exchange(fd, "HEAD /x HTTP/1.1\r\nHost: a\r\n\r\n", [](const std::string& t) { return t.find("\r\n\r\n") != std::string::npos; });
  EXPECT_EQ(head.rfind("HTTP/1.1 200", 0), 0u) << head;
  EXPECT_NE(head.find("Content-Length: 5"), std::string::npos) << head;  // "got 0", not sent
  EXPECT_EQ(head.substr(head.find("\r\n\r\n") + 4), "") << "a body after the HEAD response";
  // The same connection answers the next request correctly (nothing left over from the HEAD).
  const std::string next = exchange(fd, "POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nab",
                                    [](const std::string& t) { return t.find("got 2") != std::string::npos; });
  EXPECT_EQ(next.rfind("HTTP/1.1 200", 0), 0u) << next;
  EXPECT_NE(next.find("got 2"), std::string::npos) << next;
  ::close(fd);

  const int old = connect_to(s.http->port());
  const std::string body = exchange(old, "GET /stream HTTP/1.0\r\n\r\n", [](const std::string&) { return false; });
  EXPECT_EQ(body.find("Transfer-Encoding"), std::string::npos) << body;
  EXPECT_NE(body.find("Connection: close"), std::string::npos) << body;
  EXPECT_EQ(body.substr(body.find("\r\n\r\n") + 4), "abcdef") << body;
  ::close(old);
  const int v11 = connect_to(s.http->port());
  const std::string chunked = exchange(v11, "GET /stream HTTP/1.1\r\nHost: a\r\n\r\n",
                                       [](const std::string& t) { return t.find("0\r\n\r\n") != std::string::npos; });
  EXPECT_NE(chunked.find("Transfer-Encoding: chunked"), std::string::npos) << chunked;
  EXPECT_NE(chunked.find("3\r\nabc\r\n3\r\ndef\r\n0\r\n\r\n"), std::string::npos) << chunked;
  ::close(v11);
}

// A handler that abandons its request (its client is gone) gets the connection closed with
// nothing written, even on keep-alive; one that just returns without answering is a bug and its
// client gets a 500. (Before abandon(), the API's give-up path looked like the bug: a client that
// had only half-closed its side and still read saw "500 no response".)
TEST(HttpServer, AnAbandonedRequestIsClosedWithoutAnAnswer) {
  Server s(/*io_timeout_s=*/10);
  const int fd = connect_to(s.http->port());
  const std::string got = exchange(fd, "GET /abandon HTTP/1.1\r\nHost: a\r\n\r\n", [](const std::string&) { return false; });
  EXPECT_EQ(got, "") << "an abandoned request was answered";
  EXPECT_TRUE(closed_by_server(fd, std::chrono::milliseconds(2000)));
  ::close(fd);

  const int bug = connect_to(s.http->port());
  const std::string answer = exchange(bug, "GET /silent HTTP/1.1\r\nHost: a\r\n\r\n",
                                      [](const std::string& t) { return t.find("no response") != std::string::npos; });
  EXPECT_EQ(answer.rfind("HTTP/1.1 500", 0), 0u) << answer;
  EXPECT_NE(answer.find("no response"), std::string::npos) << answer;
  ::close(bug);
}

// [TAG_HTTP_SERVER_LIFETIME] serve() stops waiting for connections after io_timeout_s, while a
// handler may still be inside its work (in `moebius serve`, a generation the engine fails only
// after serve() returns). The connection threads are detached and use the server and the handler:
// its destructor must wait for them, not free what they use (an ASan use-after-free before).
TEST(HttpServer, DestructionWaitsForAHandlerStillRunningAfterServeReturned) {
  HttpServerOptions o;
  o.port = 0;
  o.io_timeout_s = 1;
  o.error_body = [](int, const std::string& m) { return "{\"error\": \"" + m + "\"}"; };
  std::atomic<bool> entered{false}, release{false};
  auto http = std::make_unique<HttpServer>(o, [&](const HttpRequest&, HttpResponse& res) {
    entered = true;
    while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    res.send(200, "text/plain", "done");
  });
  ASSERT_TRUE(http->listen().ok());
  std::thread serving([&] { http->serve(); });
  const int fd = connect_to(http->port());
  const std::string req = "GET /slow HTTP/1.1\r\nHost: a\r\n\r\n";
  ASSERT_EQ(::send(fd, req.data(), req.size(), 0), static_cast<ssize_t>(req.size()));
  for (int i = 0; i < 400 && !entered; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_TRUE(entered);

  const auto t0 = Clock::now();
  http->stop();
  serving.join();  // gives up on the connection after io_timeout_s
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(5));
  EXPECT_EQ(http->open_connections(), 1);
  EXPECT_FALSE(http->wait_connections_closed(std::chrono::milliseconds(100)));

  std::atomic<bool> destroyed{false};
  std::thread destroying([&] {
    http.reset();
    destroyed = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_FALSE(destroyed) << "the server was destroyed under a running connection";
  release = true;
  destroying.join();
  EXPECT_TRUE(destroyed);
  // The handler's answer still went out before the connection closed.
  std::string got;
  char buf[4096];
  pollfd p{fd, POLLIN, 0};
  while (::poll(&p, 1, 2000) > 0) {
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    got.append(buf, static_cast<size_t>(n));
  }
  EXPECT_NE(got.find("done"), std::string::npos) << got;
  ::close(fd);
}

}  // namespace
}  // namespace moebius::server
