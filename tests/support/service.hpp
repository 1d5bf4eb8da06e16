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

}  // namespace keel_service
