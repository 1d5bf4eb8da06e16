// A loopback TCP port nothing listens on (bound to port 0, then closed), for
// tests that need a connection to be refused or a server to start on a
// known-free port.
//
//   const int port = keel_test::unused_loopback_port();
//
// Thread-safety: a free function; the port is free only for a moment (another
// process may take it), which is all a refused-connection test needs.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace keel_test {

inline int unused_loopback_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

}  // namespace keel_test
