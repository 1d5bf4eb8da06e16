// gateway/effect_log.hpp — the downstream systems the gateway changes, kept
// in their own SQLite file so that every effect is counted durably, across
// threads, processes and crashes.
//
// Two effects:
//
//   learner history   one row per feedback decision the gateway records
//                     (kind "feedback"). The gateway writes it after
//                     keel::once committed the decision, and again on each
//                     replay if it is missing (a crash came between the two):
//                     the write adds a row only when (tenant, key) has none,
//                     so a retried request cannot add a second one.
//   report inbox      a report delivered to a learner (kind "report"). The
//                     inbox honours a receiver-side deduplication contract:
//                     the first delivery of a job is applied, later ones
//                     (a worker that took over a job whose first worker died
//                     after delivering) are answered "already delivered" and
//                     change nothing. Every delivery attempt is also logged,
//                     so a test sees the repeats the contract absorbed.
//
// Tests count rows per (kind, tenant, key): no effect may happen twice.
//
// Example:
//
//   auto log = gateway::effect_log::open("/var/lib/gateway/effects.db");
//   (*log)->record_feedback("acme", "key-1", "dec-1f0c");
//   absl::StatusOr<gateway::effect_log::delivery> d = (*log)->deliver_report(42, "acme", "job-7", 1, report);
//   // d->applied: delivered now; otherwise d->report is what was delivered before
//
// Thread-safety: one connection under a mutex; share one object between
// threads, open one per process (SQLite serialises writers across processes).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <sqlite3.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "keel/core/status.hpp"
#include "text.hpp"

namespace gateway {

class effect_log {
 public:
  // What a delivery did.
  struct delivery {
    bool applied = false;  // true: delivered now; false: delivered before, nothing changed
    std::string report;    // the report the learner has (the first one delivered)
  };

  // Opens (creating if needed) the effects file at `path`; a write waits at
  // most `busy_timeout` for another process's.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<effect_log>> open(
      const std::string& path, std::chrono::milliseconds busy_timeout = std::chrono::seconds(2)) {
    std::unique_ptr<effect_log> log(new effect_log());
    if (sqlite3_open_v2(path.c_str(), &log->db_, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX,
                        nullptr) != SQLITE_OK) {
      return absl::UnavailableError(cat("effects: cannot open '", path, "': ",
                                                 log->db_ ? sqlite3_errmsg(log->db_) : "out of memory"));
    }
    sqlite3_busy_timeout(log->db_, static_cast<int>(busy_timeout.count()));
    // A damaged file is refused before anything reads or writes it, as
    // keel's own stores refuse theirs: a bad page found later would fail
    // effects after their decisions were committed.
    if (absl::Status s = log->check_integrity(path); !s.ok()) return s;
    if (absl::Status s = log->exec("PRAGMA journal_mode=WAL;"
                                   "PRAGMA synchronous=NORMAL;"
                                   "CREATE TABLE IF NOT EXISTS effects("
                                   "  kind TEXT NOT NULL, tenant TEXT NOT NULL, key TEXT NOT NULL,"
                                   "  ref TEXT NOT NULL, fence INTEGER NOT NULL, at_ns INTEGER NOT NULL);"
                                   "CREATE TABLE IF NOT EXISTS report_inbox("
                                   "  job_id INTEGER PRIMARY KEY, tenant TEXT NOT NULL, key TEXT NOT NULL,"
                                   "  fence INTEGER NOT NULL, report TEXT NOT NULL);"
                                   "CREATE TABLE IF NOT EXISTS delivery_attempts("
                                   "  job_id INTEGER NOT NULL, fence INTEGER NOT NULL, applied INTEGER NOT NULL);");
        !s.ok()) {
      return keel::annotate(s, cat("effects file '", path, "'"));
    }
    return log;
  }

  effect_log(const effect_log&) = delete;
  effect_log& operator=(const effect_log&) = delete;
  ~effect_log() { sqlite3_close_v2(db_); }

  // Appends a feedback decision to the learner's history unless the row
  // for (tenant, key) is there: true when it wrote it. Idempotent, so every
  // reply carrying the decision (a replay too) may call it.
  absl::StatusOr<bool> record_feedback(std::string_view tenant, std::string_view key, std::string_view decision_id) {
    std::lock_guard lock(mu_);
    sqlite3_stmt* st = nullptr;
    // One statement: the check and the insert under one write lock, across processes too.
    if (sqlite3_prepare_v2(db_,
                           "INSERT INTO effects(kind, tenant, key, ref, fence, at_ns) "
                           "SELECT 'feedback', ?1, ?2, ?3, 0, ?4 WHERE NOT EXISTS "
                           "(SELECT 1 FROM effects WHERE kind = 'feedback' AND tenant = ?1 AND key = ?2)",
                           -1, &st, nullptr) != SQLITE_OK) {
      return error("preparing the feedback row");
    }
    bind_text(st, 1, tenant);
    bind_text(st, 2, key);
    bind_text(st, 3, decision_id);
    sqlite3_bind_int64(st, 4, now_ns());
    const int rc = sqlite3_step(st);
    sqlite3_finalize(st);
    if (rc != SQLITE_DONE) return error("recording the feedback row");
    return sqlite3_changes(db_) == 1;
  }

  // Delivers a job's report, once: the first delivery of a job is applied;
  // a later one changes nothing and answers the report delivered first.
  absl::StatusOr<delivery> deliver_report(std::int64_t job_id, std::string_view tenant, std::string_view key,
                                          std::int64_t fence, std::string_view report) {
    std::lock_guard lock(mu_);
    if (absl::Status s = exec("BEGIN IMMEDIATE;"); !s.ok()) return s;
    bool applied = false;
    std::string delivered(report);
    absl::Status s = [&]() -> absl::Status {
      sqlite3_stmt* st = nullptr;
      if (sqlite3_prepare_v2(db_, "INSERT OR IGNORE INTO report_inbox(job_id, tenant, key, fence, report) "
                                  "VALUES(?1, ?2, ?3, ?4, ?5)",
                             -1, &st, nullptr) != SQLITE_OK) {
        return error("preparing the delivery");
      }
      sqlite3_bind_int64(st, 1, job_id);
      bind_text(st, 2, tenant);
      bind_text(st, 3, key);
      sqlite3_bind_int64(st, 4, fence);
      bind_text(st, 5, report);
      const int rc = sqlite3_step(st);
      sqlite3_finalize(st);
      if (rc != SQLITE_DONE) return error("delivering the report");
      applied = sqlite3_changes(db_) == 1;
      if (applied) {
        if (absl::Status e = insert_effect("report", tenant, key, cat(job_id), fence); !e.ok()) return e;
      } else {
        if (sqlite3_prepare_v2(db_, "SELECT report FROM report_inbox WHERE job_id = ?1", -1, &st, nullptr) !=
            SQLITE_OK) {
          return error("preparing the inbox read");
        }
        sqlite3_bind_int64(st, 1, job_id);
        const int rc1 = sqlite3_step(st);
        if (rc1 == SQLITE_ROW) {
          delivered.assign(reinterpret_cast<const char*>(sqlite3_column_text(st, 0)),
                           static_cast<std::size_t>(sqlite3_column_bytes(st, 0)));
        }
        sqlite3_finalize(st);
        if (rc1 != SQLITE_ROW) return error("reading the inbox");
      }
      if (sqlite3_prepare_v2(db_, "INSERT INTO delivery_attempts(job_id, fence, applied) VALUES(?1, ?2, ?3)", -1,
                             &st, nullptr) != SQLITE_OK) {
        return error("preparing the attempt log");
      }
      sqlite3_bind_int64(st, 1, job_id);
      sqlite3_bind_int64(st, 2, fence);
      sqlite3_bind_int(st, 3, applied ? 1 : 0);
      const int rc2 = sqlite3_step(st);
      sqlite3_finalize(st);
      if (rc2 != SQLITE_DONE) return error("logging the attempt");
      return absl::OkStatus();
    }();
    if (!s.ok()) {
      (void)exec("ROLLBACK;");
      return s;
    }
    if (absl::Status c = exec("COMMIT;"); !c.ok()) {
      (void)exec("ROLLBACK;");
      return c;
    }
    return delivery{.applied = applied, .report = std::move(delivered)};
  }

  // Effects of `kind` recorded for (tenant, key).
  absl::StatusOr<std::int64_t> count(std::string_view kind, std::string_view tenant, std::string_view key) {
    return count_query("SELECT COUNT(*) FROM effects WHERE kind = ?1 AND tenant = ?2 AND key = ?3", kind, tenant, key);
  }
  // Every effect of `kind`.
  absl::StatusOr<std::int64_t> count(std::string_view kind) {
    return count_query("SELECT COUNT(*) FROM effects WHERE kind = ?1", kind, {}, {});
  }
  // Distinct (tenant, key) pairs with at least one effect of `kind`.
  absl::StatusOr<std::int64_t> distinct_keys(std::string_view kind) {
    return count_query("SELECT COUNT(*) FROM (SELECT DISTINCT tenant, key FROM effects WHERE kind = ?1)", kind, {},
                       {});
  }
  // (tenant, key) pairs with more than one effect of `kind`: must be zero.
  absl::StatusOr<std::int64_t> duplicated_keys(std::string_view kind) {
    return count_query(
        "SELECT COUNT(*) FROM (SELECT tenant, key FROM effects WHERE kind = ?1 GROUP BY tenant, key "
        "HAVING COUNT(*) > 1)",
        kind, {}, {});
  }
  // Report deliveries tried, applied or absorbed by the inbox's contract.
  absl::StatusOr<std::int64_t> delivery_attempts() {
    return count_query("SELECT COUNT(*) FROM delivery_attempts", {}, {}, {});
  }

 private:
  effect_log() = default;

  static void bind_text(sqlite3_stmt* st, int i, std::string_view s) {
    sqlite3_bind_text(st, i, s.data(), static_cast<int>(s.size()), SQLITE_TRANSIENT);
  }

  static std::int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
        .count();
  }

  absl::Status error(std::string_view what) const {
    return absl::UnavailableError(cat("effects: ", what, ": ", sqlite3_errmsg(db_)));
  }

  // PRAGMA quick_check: every page and b-tree read and checked (linear in
  // the file's size; a new file is empty). DataLoss naming the file.
  absl::Status check_integrity(const std::string& path) {
    sqlite3_stmt* q = nullptr;
    std::vector<std::string> found;
    int rc = sqlite3_prepare_v2(db_, "PRAGMA quick_check(8)", -1, &q, nullptr);
    if (rc == SQLITE_OK) {
      while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
        const unsigned char* t = sqlite3_column_text(q, 0);
        found.emplace_back(t != nullptr ? reinterpret_cast<const char*>(t) : "");
      }
    }
    sqlite3_finalize(q);
    if (rc == SQLITE_DONE && found.size() == 1 && found[0] == "ok") return absl::OkStatus();
    if (rc != SQLITE_DONE) found.emplace_back(sqlite3_errmsg(db_));
    std::string what;
    for (std::size_t i = 0; i < found.size() && i < 3; ++i) absl::StrAppend(&what, i > 0 ? "; " : "", found[i]);
    return absl::DataLossError(cat("effects file '", path, "' is damaged: PRAGMA quick_check found: ", what,
                                   "; the gateway will not use it and has not changed it (restore it from a backup, "
                                   "or move it aside)"));
  }

  absl::Status exec(const char* sql) {
    char* msg = nullptr;
    if (sqlite3_exec(db_, sql, nullptr, nullptr, &msg) != SQLITE_OK) {
      absl::Status s = absl::UnavailableError(cat("effects: ", msg ? msg : "error"));
      sqlite3_free(msg);
      return s;
    }
    return absl::OkStatus();
  }

  // Under mu_.
  absl::Status insert_effect(std::string_view kind, std::string_view tenant, std::string_view key,
                             std::string_view ref, std::int64_t fence) {
    sqlite3_stmt* st = nullptr;
    if (sqlite3_prepare_v2(db_, "INSERT INTO effects(kind, tenant, key, ref, fence, at_ns) VALUES(?1,?2,?3,?4,?5,?6)",
                           -1, &st, nullptr) != SQLITE_OK) {
      return error("preparing the effect");
    }
    bind_text(st, 1, kind);
    bind_text(st, 2, tenant);
    bind_text(st, 3, key);
    bind_text(st, 4, ref);
    sqlite3_bind_int64(st, 5, fence);
    sqlite3_bind_int64(st, 6, now_ns());
    const int rc = sqlite3_step(st);
    sqlite3_finalize(st);
    if (rc != SQLITE_DONE) return error("recording the effect");
    return absl::OkStatus();
  }

  absl::StatusOr<std::int64_t> count_query(const char* sql, std::string_view a, std::string_view b,
                                           std::string_view c) {
    std::lock_guard lock(mu_);
    sqlite3_stmt* st = nullptr;
    if (sqlite3_prepare_v2(db_, sql, -1, &st, nullptr) != SQLITE_OK) return error("preparing a count");
    const int params = sqlite3_bind_parameter_count(st);
    const std::string_view args[] = {a, b, c};
    for (int i = 0; i < params && i < 3; ++i) bind_text(st, i + 1, args[i]);
    std::int64_t n = 0;
    const int rc = sqlite3_step(st);
    if (rc == SQLITE_ROW) n = sqlite3_column_int64(st, 0);
    sqlite3_finalize(st);
    if (rc != SQLITE_ROW) return error("counting");
    return n;
  }

  std::mutex mu_;
  sqlite3* db_ = nullptr;
};

}  // namespace gateway
