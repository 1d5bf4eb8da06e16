// Child processes for multi-process tests: this test binary re-executed
// (posix_spawn of /proc/self/exe: a clean single-threaded process, never a
// fork of a threaded one) to run one hidden test case. Parameters travel in
// environment variables under the area's prefix; results come back through
// files, the exit code or the signal.
//
//   pid_t pid = keel_test::spawn_self({.test_case = "durable child process", .env_prefix = "KEEL_CHILD_",
//                                      .vars = {{"ROLE", "writer"}, {"DB", path}}});
//   REQUIRE(keel_test::wait_child(pid) == 0);
//   // in the child: keel_test::child_var("KEEL_CHILD_", "DB")
//
// Thread-safety: spawn_self and wait_child from any thread (posix_spawn
// reads `environ`; do not change the environment meanwhile).
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

extern char** environ;

namespace keel_test {

struct child_spec {
  std::string test_case{};                    // the hidden test case to run: a name or a [tag]
  std::string env_prefix{};                   // inherited variables with it are dropped; `vars` get it
  std::map<std::string, std::string> vars{};  // name (without the prefix) -> value
  std::vector<int> close_in_child{};          // fds the child must not inherit (a start-gate pipe's write end)
  std::string stderr_path{};                  // where the child's stderr goes; empty: inherited
};

// Starts the child; its stdout goes to /dev/null. Throws std::runtime_error
// when posix_spawn fails.
inline pid_t spawn_self(const child_spec& c) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    if (c.env_prefix.empty() || std::string_view(*e).rfind(c.env_prefix, 0) != 0) env.emplace_back(*e);
  }
  for (const auto& [k, v] : c.vars) env.push_back(c.env_prefix + k + "=" + v);
  std::vector<char*> envp;
  for (std::string& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::string exe = "/proc/self/exe", test_case = c.test_case;
  char* argv[] = {exe.data(), test_case.data(), nullptr};
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
  if (!c.stderr_path.empty())
    posix_spawn_file_actions_addopen(&fa, 2, c.stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  for (int fd : c.close_in_child) posix_spawn_file_actions_addclose(&fa, fd);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, exe.c_str(), &fa, nullptr, argv, envp.data());
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) throw std::runtime_error("posix_spawn failed");
  return pid;
}

// The child's exit code, or 128 + signal when it was killed; -1 when it was
// still running after `limit` (it is then killed, so a stuck child fails the
// test instead of hanging it).
inline int wait_child(pid_t pid, std::chrono::milliseconds limit = std::chrono::seconds(300)) {
  const auto end = std::chrono::steady_clock::now() + limit;
  int status = 0;
  for (;;) {
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (r < 0 && errno != EINTR) return -1;
    if (std::chrono::steady_clock::now() > end) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

// In the child: the variable `name` that spawn_self passed, or "".
inline std::string child_var(std::string_view prefix, std::string_view name) {
  const char* v = std::getenv(std::string(prefix).append(name).c_str());
  return v != nullptr ? v : "";
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

// Waits (in real time, bounded) until `path`'s contents satisfy `done`; returns
// them, whatever they are when it stops waiting. How a test learns that a
// child reached a point.
template <class Done>
std::string await_file(const std::string& path, std::chrono::seconds limit, Done done) {
  const auto end = std::chrono::steady_clock::now() + limit;
  for (;;) {
    std::string s = read_file(path);
    if (done(s) || std::chrono::steady_clock::now() > end) return s;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

// ...until `path` holds `needle`.
inline std::string await_text(const std::string& path, std::string_view needle,
                              std::chrono::seconds limit = std::chrono::seconds(60)) {
  return await_file(path, limit, [&](const std::string& s) { return s.find(needle) != std::string::npos; });
}

// ...until `path` ends with a complete line.
inline std::string await_line(const std::string& path, std::chrono::seconds limit = std::chrono::seconds(60)) {
  return await_file(path, limit, [](const std::string& s) { return !s.empty() && s.back() == '\n'; });
}

}  // namespace keel_test
