// Helpers shared by the durable-state tests: temporary directories, opening
// SQLite stores, and a clock shared by several processes.
#pragma once

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>
#include <stop_token>
#include <system_error>
#include <thread>

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <sstream>
#include <utility>
#include <vector>

#include "keel/core/clock.hpp"
#include "keel/core/condition.hpp"
#include "keel/store/sqlite.hpp"

#include "support/child_process.hpp"
#include "support/temp_dir.hpp"

namespace keel_durable {

using keel_test::temp_dir;

// Opens a SQLite store or throws with the status (tests that expect failure
// call sqlite_store::open themselves).
template <class Time>
std::unique_ptr<keel::sqlite_store<Time>> open_sqlite(const std::string& path, Time time,
                                                      const keel::sqlite_options& o = {}) {
  auto s = keel::sqlite_store<Time>::open(path, o, std::move(time));
  if (!s.ok()) throw std::runtime_error(std::string(s.status().message()));
  return std::move(*s);
}

// A clock whose time lives in a shared memory mapping of a file, so a test
// and the processes it starts see one timeline: the parent moves it, every
// child reads it. It satisfies keel::clock (sleepers poll the shared value
// in real time, briefly) and keel::store_time_source.
class shared_clock {
 public:
  // Creates (or opens) the mapping at `file`.
  explicit shared_clock(const std::string& file, bool create) {
    const int fd = ::open(file.c_str(), O_RDWR | (create ? O_CREAT : 0), 0600);
    if (fd < 0) throw std::runtime_error("shared_clock: open failed");
    if (create && ::ftruncate(fd, sizeof(std::int64_t)) != 0) {
      ::close(fd);
      throw std::runtime_error("shared_clock: ftruncate failed");
    }
    void* p = ::mmap(nullptr, sizeof(std::int64_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) throw std::runtime_error("shared_clock: mmap failed");
    ns_ = std::shared_ptr<std::atomic<std::int64_t>>(static_cast<std::atomic<std::int64_t>*>(p),
                                                      [](std::atomic<std::int64_t>* q) {
                                                        ::munmap(static_cast<void*>(q), sizeof(std::int64_t));
                                                      });
    static_assert(std::atomic<std::int64_t>::is_always_lock_free);
    if (create) ns_->store(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::hours(24 * 365)).count());
  }

  [[nodiscard]] keel::time_point now() const noexcept {
    return keel::time_point(std::chrono::duration_cast<keel::duration>(std::chrono::nanoseconds(ns_->load())));
  }
  void advance(keel::duration d) const { ns_->fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(d).count()); }

  bool sleep_until(keel::time_point t, std::stop_token stop) const {
    while (now() < t) {
      if (stop.stop_requested()) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return true;
  }
  template <class Ready>
  bool wait_until(std::unique_lock<std::mutex>& lock, keel::condition& cv, keel::time_point t,
                  std::stop_token stop, Ready ready) const {
    while (!ready() && now() < t && !stop.stop_requested())
      (void)cv.wait_until(lock, std::chrono::steady_clock::now() + std::chrono::milliseconds(1), ready);
    return ready();
  }

 private:
  std::shared_ptr<std::atomic<std::int64_t>> ns_;
};

static_assert(keel::clock<shared_clock>);
static_assert(keel::store_time_source<shared_clock>);

// ---- processes --------------------------------------------------------------
//
// Multi-process tests re-execute this test binary (a fresh process, never a
// fork of a multi-threaded one) running only the hidden test case "durable
// child process", which dispatches on KEEL_CHILD_ROLE (durable_process_test.cpp).
// Parameters travel in KEEL_CHILD_* environment variables; results come back
// through files.

using keel_test::read_file;

inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

inline pid_t spawn_child(const std::string& role, std::map<std::string, std::string> vars,
                         const std::vector<int>& close_in_child = {}) {
  vars["ROLE"] = role;
  return keel_test::spawn_self({.test_case = "durable child process",
                                .env_prefix = "KEEL_CHILD_",
                                .vars = std::move(vars),
                                .close_in_child = close_in_child});
}

using keel_test::wait_child;

using keel_test::await_line;

}  // namespace keel_durable
