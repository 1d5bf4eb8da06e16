// Helpers for the job queue tests: backend fixtures the shared behaviour
// suite (support/jobs_suite.hpp) runs against, and a durable execution log that
// workers in threads or processes append to.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "support/durable.hpp"
#include "keel/durable/job_queue.hpp"
#include "keel/store/sqlite_jobs.hpp"
#include "keel/testing/manual_clock.hpp"

namespace keel_jobs {

using keel::testing::manual_clock;

// A fresh SQLite file per fixture; time is the fixture's manual clock (the
// store's time source and the workers' clock at once).
struct sqlite_backend {
  using store_type = keel::sqlite_job_store<manual_clock>;

  keel_durable::temp_dir dir;
  std::string path = dir.file("jobs.db");
  manual_clock clock;

  // A new handle (connection) on this fixture's data: what another process has.
  std::unique_ptr<store_type> open() {
    auto s = store_type::open(path, {}, clock);
    if (!s.ok()) throw std::runtime_error(std::string(s.status().ToString()));
    return std::move(*s);
  }
  // Moves the store's clock (and the workers') forward.
  void advance(keel::duration d) { clock.advance(d); }
  // How far the store's clock may run on its own during a test.
  static constexpr keel::duration slack = keel::duration::zero();
};

// Appends "<job id> <fence> <what>\n" lines to a file with O_APPEND: every
// write lands whole and survives the writer being killed. Threads and
// processes share one file.
class exec_log {
 public:
  explicit exec_log(std::string path) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd_ < 0) throw std::runtime_error("exec_log: cannot open " + path_);
  }
  ~exec_log() {
    if (fd_ >= 0) ::close(fd_);
  }
  exec_log(const exec_log&) = delete;
  exec_log& operator=(const exec_log&) = delete;

  void record(std::int64_t id, std::int64_t fence, const std::string& what) const {
    const std::string line = std::to_string(id) + " " + std::to_string(fence) + " " + what + "\n";
    if (::write(fd_, line.data(), line.size()) != static_cast<ssize_t>(line.size()))
      throw std::runtime_error("exec_log: short write");
  }

  struct entry {
    std::int64_t id;
    std::int64_t fence;
    std::string what;
  };
  static std::vector<entry> read(const std::string& path) {
    std::vector<entry> out;
    std::istringstream in(keel_durable::read_file(path));
    entry e;
    while (in >> e.id >> e.fence >> e.what) out.push_back(e);
    return out;
  }
  // How many times `what` was logged per job id.
  static std::map<std::int64_t, int> count(const std::string& path, const std::string& what) {
    std::map<std::int64_t, int> n;
    for (const entry& e : read(path))
      if (e.what == what) ++n[e.id];
    return n;
  }

 private:
  std::string path_;
  int fd_ = -1;
};

// Forks a child that runs `body` and exits with its return value (98 if it
// threw). The child never returns into the test framework. Fork only while
// the test process runs no other threads; the child opens its own stores.
template <class Body>
pid_t fork_child(Body&& body) {
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    int code = 99;
    try {
      code = body();
    } catch (...) {
      code = 98;
    }
    ::_exit(code);
  }
  return pid;
}

}  // namespace keel_jobs
