// Raw loopback sockets for the server tests that must do what an HTTP client library will not:
// drip bytes, half-close, read until the server closes.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <string>

namespace moebius::testing {

// A TCP connection to 127.0.0.1:port (the test fails if it cannot connect).
inline int connect_loopback(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  return fd;
}

// Everything the peer sends until it closes the connection (closed) or `quiet` passes without a
// byte (not closed).
struct Drained {
  std::string bytes;
  bool closed = false;
};
inline Drained read_until_close(int fd, std::chrono::milliseconds quiet) {
  Drained d;
  char tmp[4096];
  while (true) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(quiet.count())) <= 0) return d;
    const ssize_t n = ::recv(fd, tmp, sizeof(tmp), 0);
    if (n <= 0) {
      d.closed = true;
      return d;
    }
    d.bytes.append(tmp, static_cast<size_t>(n));
  }
}

}  // namespace moebius::testing
