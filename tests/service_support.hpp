// Shared by the service tests (keel_service_tests): the gateway's options
// at test speed, temporary directories, child processes (this test binary
// re-executed as a batch worker) and small file helpers.
#pragma once

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gateway_options.hpp"

extern char** environ;

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

// A fresh directory under $TMPDIR (or /tmp), removed with everything in it.
class temp_dir {
 public:
  temp_dir() {
    const char* base = std::getenv("TMPDIR");
    std::string pattern = std::string(base && *base ? base : "/tmp") + "/keel-service-XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = pattern;
  }
  ~temp_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  [[nodiscard]] const std::string& path() const noexcept { return path_; }
  [[nodiscard]] std::string file(std::string_view name) const { return path_ + "/" + std::string(name); }

 private:
  std::string path_;
};

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// One line appended with O_APPEND: visible to other processes at once.
inline void append_line(const std::string& path, const std::string& line) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  if (fd < 0) std::_Exit(90);
  const std::string l = line + "\n";
  if (::write(fd, l.data(), l.size()) != static_cast<ssize_t>(l.size())) std::_Exit(91);
  ::close(fd);
}

// Waits (in real time, bounded) until `path` holds a line containing
// `needle`. Returns the file's contents.
inline std::string await_text(const std::string& path, std::string_view needle,
                              std::chrono::seconds limit = std::chrono::seconds(30)) {
  const auto end = std::chrono::steady_clock::now() + limit;
  for (;;) {
    std::string s = read_file(path);
    if (s.find(needle) != std::string::npos) return s;
    if (std::chrono::steady_clock::now() > end) return s;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

// This test binary, re-executed to run only the hidden test case
// "service child process" with KEEL_SERVICE_<name> variables: a clean
// single-threaded process (fork() in a threaded test binary is not).
inline pid_t spawn_child(const std::map<std::string, std::string>& vars) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::string_view(*e).rfind("KEEL_SERVICE_", 0) != 0) env.emplace_back(*e);
  }
  for (const auto& [k, v] : vars) env.push_back("KEEL_SERVICE_" + k + "=" + v);
  std::vector<char*> envp;
  for (std::string& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::string exe = "/proc/self/exe", name = "service child process";
  char* argv[] = {exe.data(), name.data(), nullptr};
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, exe.c_str(), &fa, nullptr, argv, envp.data());
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) throw std::runtime_error("posix_spawn failed");
  return pid;
}

inline std::string child_env(const char* name) {
  const char* v = std::getenv((std::string("KEEL_SERVICE_") + name).c_str());
  return v ? v : "";
}

// The child's exit code, or 128 + signal when it was killed; -1 if it is
// still running after `limit`.
inline int wait_child(pid_t pid, std::chrono::seconds limit = std::chrono::seconds(60)) {
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
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

}  // namespace keel_service
