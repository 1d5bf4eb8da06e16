// A program run as a child process for a test: a server the test talks to
// over the network (the mock upstream, the gateway), started with
// posix_spawn, its stdout read line by line through a pipe (how a test
// learns the port of a server started on port 0), stopped with a signal.
//
//   keel_test::child_program mock({KEEL_MOCK_UPSTREAM, "--port", "0"});
//   std::optional<std::string> line = mock.read_line();  // "mock_upstream mock listening on 127.0.0.1:41234"
//   int port = keel_test::port_in(*line);                 // 41234, or -1
//   ...
//   REQUIRE(mock.terminate() == 0);                       // SIGTERM, then its exit code
//
// keel_test::mock_upstream_process (support/mock_upstream.hpp) does the
// above for the mock upstream.
//
// The child's stdin is /dev/null; stderr goes to `stderr_path` or, when it
// is empty, to the test's own stderr. A child still running when its
// child_program is destroyed gets SIGKILL (a failed test leaves no server).
//
// Thread-safety: one child_program is used by one thread at a time; distinct
// ones are independent (posix_spawn reads `environ`: do not change the
// environment meanwhile).
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "support/child_process.hpp"

extern char** environ;

namespace keel_test {

class child_program {
 public:
  // Starts argv[0] (a path) with the rest as its arguments. Throws
  // std::runtime_error when the pipe or posix_spawn fails.
  explicit child_program(std::vector<std::string> argv, const std::string& stderr_path = {}) {
    if (argv.empty()) throw std::runtime_error("child_program: no program");
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("child_program: pipe2 failed");
    out_ = fds[0];
    std::vector<char*> args;
    for (std::string& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_adddup2(&fa, fds[1], 1);  // dup2 clears O_CLOEXEC on fd 1
    if (!stderr_path.empty())
      posix_spawn_file_actions_addopen(&fa, 2, stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    const int rc = posix_spawn(&pid_, args[0], &fa, nullptr, args.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    ::close(fds[1]);
    if (rc != 0) {
      ::close(out_);
      throw std::runtime_error("child_program: posix_spawn of " + argv[0] + " failed");
    }
  }
  ~child_program() {
    if (pid_ > 0 && exit_code_ < 0) {
      ::kill(pid_, SIGKILL);
      int status = 0;
      ::waitpid(pid_, &status, 0);
    }
    if (out_ >= 0) ::close(out_);
  }
  child_program(const child_program&) = delete;
  child_program& operator=(const child_program&) = delete;

  [[nodiscard]] pid_t pid() const noexcept { return pid_; }

  // The next line the child writes to stdout, without its '\n'; nullopt when
  // stdout closed (the child exited) or no whole line came within `limit`.
  std::optional<std::string> read_line(std::chrono::milliseconds limit = std::chrono::seconds(30)) {
    const auto end = std::chrono::steady_clock::now() + limit;
    for (;;) {
      if (const std::size_t nl = buffer_.find('\n'); nl != std::string::npos) {
        std::string line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        return line;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - std::chrono::steady_clock::now());
      if (left.count() <= 0) return std::nullopt;
      pollfd p{.fd = out_, .events = POLLIN, .revents = 0};
      const int r = ::poll(&p, 1, static_cast<int>(left.count()));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) return std::nullopt;
      char buf[4096];
      const ssize_t n = ::read(out_, buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return std::nullopt;  // EOF: the child closed stdout
      buffer_.append(buf, static_cast<std::size_t>(n));
    }
  }

  // Sends `sig` and waits for the child: its exit code, 128 + signal when a
  // signal ended it, or -1 when it was still running after `limit` (it is then killed).
  int terminate(int sig = SIGTERM, std::chrono::milliseconds limit = std::chrono::seconds(30)) {
    if (exit_code_ < 0) ::kill(pid_, sig);
    return wait(limit);
  }

  // Waits for the child to exit on its own (see terminate() for the result).
  int wait(std::chrono::milliseconds limit = std::chrono::seconds(30)) {
    if (exit_code_ >= 0) return exit_code_;
    const int rc = keel_test::wait_child(pid_, limit);  // killed, and -1, past the limit
    exit_code_ = rc >= 0 ? rc : 128 + SIGKILL;
    return rc;
  }

  // False once the child has been waited for.
  [[nodiscard]] bool running() const noexcept { return exit_code_ < 0; }

 private:
  pid_t pid_ = -1;
  int out_ = -1;
  int exit_code_ = -1;
  std::string buffer_;
};

// The port of a "... listening on 127.0.0.1:PORT" (or "http://127.0.0.1:PORT") line; -1 when none.
[[nodiscard]] inline int port_in(std::string_view line) {
  const std::size_t at = line.rfind("127.0.0.1:");
  if (at == std::string_view::npos) return -1;
  int port = 0, digits = 0;
  for (std::size_t i = at + 10; i < line.size() && line[i] >= '0' && line[i] <= '9' && digits < 6; ++i, ++digits)
    port = port * 10 + (line[i] - '0');
  return digits == 0 || port > 65535 ? -1 : port;
}

}  // namespace keel_test
