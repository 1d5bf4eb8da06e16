// A SQLite store on a temporary file for the fuzz targets that run a real
// database: opened once per process (on keel::testing::manual_clock, so time
// only moves when the target says), emptied between inputs through a second
// connection, and its files removed at exit.
#pragma once

#include <sqlite3.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "keel/store/sqlite.hpp"
#include "keel/testing/manual_clock.hpp"

namespace keel::fuzz {

class sqlite_fixture {
 public:
  using store_type = keel::sqlite_store<keel::testing::manual_clock>;

  sqlite_fixture() {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/keel-fuzz-XXXXXX";
    if (::mkdtemp(templ.data()) == nullptr) std::abort();
    dir_ = templ;
    path_ = dir_ + "/store.db";
    // No integrity check on open and normal sync: the file is scratch.
    auto s = store_type::open(path_, {.integrity_check = keel::sqlite_integrity_check::off}, clock_);
    if (!s.ok()) {
      std::fprintf(stderr, "sqlite_fixture: %s\n", std::string(s.status().message()).c_str());
      std::abort();
    }
    store_ = std::move(*s);
    if (sqlite3_open_v2(path_.c_str(), &raw_, SQLITE_OPEN_READWRITE, nullptr) != SQLITE_OK) std::abort();
    sqlite3_busy_timeout(raw_, 5000);
  }
  ~sqlite_fixture() {
    store_.reset();
    sqlite3_close(raw_);
    for (const char* suffix : {"", "-wal", "-shm"}) std::remove((path_ + suffix).c_str());
    ::rmdir(dir_.c_str());
  }
  sqlite_fixture(const sqlite_fixture&) = delete;
  sqlite_fixture& operator=(const sqlite_fixture&) = delete;

  // Every row gone (the clock row stays); the clock back to its start.
  void reset() {
    exec("DELETE FROM keel_idempotency; DELETE FROM keel_lease; DELETE FROM keel_result;"
         " UPDATE keel_clock SET high_water = -9223372036854775808 WHERE id = 0;");
    clock_.set(start_);
  }
  void exec(const char* sql) {
    char* err = nullptr;
    if (sqlite3_exec(raw_, sql, nullptr, nullptr, &err) != SQLITE_OK) {
      std::fprintf(stderr, "sqlite_fixture: %s: %s\n", sql, err != nullptr ? err : "?");
      std::abort();
    }
  }

  [[nodiscard]] store_type& store() noexcept { return *store_; }
  [[nodiscard]] sqlite3* raw() const noexcept { return raw_; }
  [[nodiscard]] keel::testing::manual_clock& clock() noexcept { return clock_; }

  // One per process.
  static sqlite_fixture& get() {
    static sqlite_fixture f;
    return f;
  }

 private:
  keel::time_point start_{std::chrono::hours(24 * 365 * 50)};
  keel::testing::manual_clock clock_{start_};
  std::string dir_, path_;
  std::unique_ptr<store_type> store_;
  sqlite3* raw_ = nullptr;
};

}  // namespace keel::fuzz
