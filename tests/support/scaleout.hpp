// Helpers for the scale-out tests: where the CTest fixtures put the
// throwaway PostgreSQL and Redis servers, fresh namespaces per test, and the
// server scripts' kill/restart for crash tests.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <map>
#include <sstream>
#include <string_view>
#include <thread>
#include <vector>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>

#include "absl/strings/str_cat.h"

#include "support/child_process.hpp"

namespace keel_scaleout {

// $KEEL_TEST_SERVERS (the fixtures' state directory); the tests refuse to
// run without it rather than pass vacuously.
inline std::string servers_dir() {
  const char* d = std::getenv("KEEL_TEST_SERVERS");
  if (d == nullptr || *d == '\0')
    throw std::runtime_error(
        "KEEL_TEST_SERVERS is not set: run through ctest (fixtures postgres_server, redis_server) or start the "
        "servers with tests/servers/{postgres,redis}.sh start <dir>/{postgres,redis} and export KEEL_TEST_SERVERS=<dir> "
        "KEEL_TEST_SERVER_SCRIPTS=<repo>/tests/servers");
  return d;
}

inline std::string read_first_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) throw std::runtime_error("cannot read " + path + " (is the server running?)");
  return line;
}

inline std::string pg_conninfo() { return read_first_line(servers_dir() + "/postgres/conninfo"); }
inline int redis_port() { return std::stoi(read_first_line(servers_dir() + "/redis/port")); }

// A name no other test, process or CI leg uses: schema or key prefix.
inline std::string fresh_name(const std::string& prefix) {
  static std::atomic<int> counter{0};
  static const std::uint32_t salt = std::random_device{}();
  return absl::StrCat(prefix, "_", ::getpid(), "_", counter.fetch_add(1), "_", absl::Hex(salt & 0xffffff));
}

// tests/servers/<server>.sh <cmd> <state-dir>; true on success.
inline bool server_control(const std::string& server, const std::string& cmd) {
  const char* scripts = std::getenv("KEEL_TEST_SERVER_SCRIPTS");
  if (scripts == nullptr || *scripts == '\0') throw std::runtime_error("KEEL_TEST_SERVER_SCRIPTS is not set");
  const std::string line = absl::StrCat(scripts, "/", server, ".sh ", cmd, " ", servers_dir(), "/", server,
                                        " >/dev/null 2>&1");
  return std::system(line.c_str()) == 0;
}

// Puts a killed server back, whatever happens in the test that killed it.
class restart_guard {
 public:
  explicit restart_guard(std::string server) : server_(std::move(server)) {}
  ~restart_guard() {
    if (down_) (void)server_control(server_, "restart");
  }
  restart_guard(const restart_guard&) = delete;
  restart_guard& operator=(const restart_guard&) = delete;
  bool kill() {
    down_ = true;
    return server_control(server_, "kill");
  }
  bool restart() {
    const bool ok = server_control(server_, "restart");
    if (ok) down_ = false;
    return ok;
  }

 private:
  std::string server_;
  bool down_ = false;
};

}  // namespace keel_scaleout

// ---- processes --------------------------------------------------------------
//
// Multi-process tests re-execute this test binary (posix_spawn of
// /proc/self/exe: a clean single-threaded process, never a fork of a
// threaded one) running only the hidden test case "scaleout child process",
// which dispatches on KEEL_SCALE_ROLE. Parameters travel in KEEL_SCALE_*
// environment variables; results come back through files.

namespace keel_scaleout {

inline std::string child_env(const char* name) { return keel_test::child_var("KEEL_SCALE_", name); }

inline pid_t spawn_child(const std::string& role, std::map<std::string, std::string> vars,
                         const std::vector<int>& close_in_child = {}) {
  vars["ROLE"] = role;
  return keel_test::spawn_self({.test_case = "scaleout child process",
                                .env_prefix = "KEEL_SCALE_",
                                .vars = std::move(vars),
                                .close_in_child = close_in_child});
}

using keel_test::wait_child;

using keel_test::read_file;

using keel_test::await_line;

// A fresh temporary file path (the file is not created).
inline std::string temp_path(const std::string& stem) {
  const char* base = std::getenv("TMPDIR");
  return absl::StrCat(base && *base ? base : "/tmp", "/", fresh_name(stem));
}

}  // namespace keel_scaleout
