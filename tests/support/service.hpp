// Shared by the service tests (keel_service_tests): the gateway's options
// at test speed, temporary directories, child processes (this test binary
// re-executed as a batch worker, the gateway's command line), small file
// helpers, and a raw HTTP client for the hostile-client tests (bytes exactly
// as given, sent as slowly or as wrongly as the test wants).
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <unistd.h>

#include "gateway_options.hpp"

#include "support/child_process.hpp"
#include "support/temp_dir.hpp"

namespace keel_service {

using namespace std::chrono_literals;

// Every duration of the seed's plan times this: a 750 ms deadline, a 250 ms
// model stage, an 80 ms median provider latency. The same plan, 4x faster.
inline constexpr double time_scale = 0.25;

// What a reply may take beyond the service's own deadline: the HTTP client
// and server (connection, parsing, writing) and the work after the last
// deadline check (JSON, one SQLite commit bounded by its busy timeout).
// A correctness bound, not a speed claim: generous enough for the
// sanitizer builds on a loaded machine.
inline constexpr std::chrono::milliseconds http_slack{250};

inline gateway::gateway_options options(const std::string& data_dir) {
  gateway::gateway_options o;
  o.data_dir = data_dir;
  gateway::scale_time(o, time_scale);
  o.http_threads = 64;
  return o;
}

using keel_test::temp_dir;

using keel_test::read_file;

// One line appended with O_APPEND: visible to other processes at once.
inline void append_line(const std::string& path, const std::string& line) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  if (fd < 0) std::_Exit(90);
  const std::string l = line + "\n";
  if (::write(fd, l.data(), l.size()) != static_cast<ssize_t>(l.size())) std::_Exit(91);
  ::close(fd);
}

using keel_test::await_text;

// This test binary, re-executed to run only the hidden test case
// "service child process" with KEEL_SERVICE_<name> variables: a clean
// single-threaded process (fork() in a threaded test binary is not).
inline pid_t spawn_child(const std::map<std::string, std::string>& vars) {
  return keel_test::spawn_self({.test_case = "service child process", .env_prefix = "KEEL_SERVICE_", .vars = vars});
}

inline std::string child_env(const char* name) { return keel_test::child_var("KEEL_SERVICE_", name); }

// A stuck child is killed after a minute.
inline int wait_child(pid_t pid, std::chrono::seconds limit = std::chrono::seconds(60)) {
  return keel_test::wait_child(pid, limit);
}

// ---- raw HTTP ---------------------------------------------------------------

// One TCP connection to 127.0.0.1:port, non-blocking, sending exactly the
// bytes given. Not thread-safe: one thread per connection (or one for all).
class raw_connection {
 public:
  explicit raw_connection(int port, bool wait_connected = true) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd_ < 0) throw std::runtime_error("socket failed");
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<std::uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 && errno != EINPROGRESS) failed_ = true;
    if (wait_connected) (void)connected(std::chrono::seconds(30));
  }
  raw_connection(const raw_connection&) = delete;
  raw_connection& operator=(const raw_connection&) = delete;
  ~raw_connection() {
    if (fd_ >= 0) ::close(fd_);
  }

  [[nodiscard]] int fd() const noexcept { return fd_; }

  // True once the handshake is done (within `limit`), false if it failed.
  bool connected(std::chrono::milliseconds limit) {
    if (failed_) return false;
    pollfd p{.fd = fd_, .events = POLLOUT, .revents = 0};
    if (::poll(&p, 1, static_cast<int>(limit.count())) != 1) return false;
    int err = 0;
    socklen_t len = sizeof err;
    ::getsockopt(fd_, SOL_SOCKET, SO_ERROR, &err, &len);
    return err == 0;
  }

  // Sends all of `bytes` (waiting up to `limit` for room); false if the
  // connection refused them (closed, reset) or had no room in time.
  bool send(std::string_view bytes, std::chrono::milliseconds limit = std::chrono::seconds(10)) {
    const auto until = std::chrono::steady_clock::now() + limit;
    while (!bytes.empty()) {
      const ssize_t n = ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
      if (n > 0) {
        bytes.remove_prefix(static_cast<std::size_t>(n));
        sent_ += static_cast<std::uint64_t>(n);
        continue;
      }
      if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return false;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
      if (left.count() <= 0) return false;
      pollfd p{.fd = fd_, .events = POLLOUT, .revents = 0};
      ::poll(&p, 1, static_cast<int>(std::min<long long>(left.count(), 100)));
    }
    return true;
  }

  // True when something (an answer, or the end) can be read now.
  [[nodiscard]] bool readable(std::chrono::milliseconds wait = std::chrono::milliseconds(0)) const {
    pollfd p{.fd = fd_, .events = POLLIN, .revents = 0};
    return ::poll(&p, 1, static_cast<int>(wait.count())) == 1;
  }

  struct response {
    int status = 0;  // 0: no complete response
    std::string head, body;
    [[nodiscard]] bool has_header(std::string_view name_colon) const { return head.find(name_colon) != std::string::npos; }
  };

  // Reads one response (head and a Content-Length body) within `limit`.
  response read_response(std::chrono::milliseconds limit = std::chrono::seconds(30)) {
    const auto until = std::chrono::steady_clock::now() + limit;
    response r;
    for (;;) {
      const std::size_t end = in_.find("\r\n\r\n");
      if (end != std::string::npos) {
        r.head = in_.substr(0, end);
        const std::size_t cl = r.head.find("Content-Length: ");
        const std::size_t length = cl == std::string::npos ? 0 : std::stoul(r.head.substr(cl + 16));
        if (in_.size() >= end + 4 + length) {
          r.body = in_.substr(end + 4, length);
          if (r.head.rfind("HTTP/1.1 ", 0) == 0) r.status = std::stoi(r.head.substr(9, 3));
          in_.erase(0, end + 4 + length);
          if (r.status == 100) return read_response(limit);  // 100 Continue: the real answer follows
          return r;
        }
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
      if (left.count() <= 0) return r;
      if (!readable(std::min(left, std::chrono::milliseconds(100)))) continue;
      char buf[65536];
      const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n == 0) return r;
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
        return r;
      }
      in_.append(buf, static_cast<std::size_t>(n));
    }
  }

  // Reads until what came holds `marker` (within `limit`); returns it all
  // and forgets it. Shorter (no marker) if the time ran out or the peer closed.
  std::string read_until(std::string_view marker, std::chrono::milliseconds limit = std::chrono::seconds(30)) {
    const auto until = std::chrono::steady_clock::now() + limit;
    while (in_.find(marker) == std::string::npos && std::chrono::steady_clock::now() < until) {
      if (!readable(std::chrono::milliseconds(20))) continue;
      char buf[65536];
      const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n == 0) break;
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
        break;
      }
      in_.append(buf, static_cast<std::size_t>(n));
    }
    return std::exchange(in_, {});
  }

  // Closes the connection now (a client that hangs up).
  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

  // True when the server closed the connection (reads end) within `limit`.
  bool closed_by_peer(std::chrono::milliseconds limit) {
    const auto until = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < until) {
      if (!readable(std::chrono::milliseconds(50))) continue;
      char buf[4096];
      const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return true;
      if (n > 0) in_.append(buf, static_cast<std::size_t>(n));
    }
    return false;
  }

  [[nodiscard]] std::uint64_t sent() const noexcept { return sent_; }

 private:
  int fd_ = -1;
  bool failed_ = false;
  std::uint64_t sent_ = 0;
  std::string in_;
};

// This process's resident set (VmRSS), in bytes.
inline std::int64_t rss_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return -1;
}

// The accept-queue size the kernel gives the listening socket of this
// process on `port` (TCP_INFO on a listener reports it in tcpi_sacked), or
// -1 when no such socket is open.
inline int listen_backlog(int port) {
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    const int fd = std::atoi(e.path().filename().c_str());
    int listening = 0;
    socklen_t len = sizeof listening;
    if (::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0 || listening == 0) continue;
    sockaddr_in a{};
    socklen_t alen = sizeof a;
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &alen) != 0 || a.sin_family != AF_INET ||
        ntohs(a.sin_port) != port) {
      continue;
    }
    tcp_info info{};
    socklen_t ilen = sizeof info;
    if (::getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &ilen) != 0) return -1;
    return static_cast<int>(info.tcpi_sacked);
  }
  return -1;
}

// Runs `program args...` with stdout and stderr to the files given.
inline pid_t spawn_program(const std::vector<std::string>& argv_in, const std::string& out, const std::string& err) {
  std::vector<std::string> args = argv_in;
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_addopen(&fa, 2, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) throw std::runtime_error("posix_spawn failed");
  return pid;
}

}  // namespace keel_service
