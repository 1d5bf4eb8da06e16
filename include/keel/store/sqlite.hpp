// keel/store/sqlite.hpp — the embedded durable store: idempotency records,
// leases and results in one SQLite file, safe for several processes on one
// host, surviving restarts. Link keel::sqlite.
//
// keel::sqlite_store implements keel::idempotency_store, keel::lease_store
// and keel::result_store (docs/stores.md has the contracts):
//
//   - WAL journal; synchronous NORMAL (default: a power cut may lose the
//     last transactions, never corrupts) or FULL (every commit fsynced);
//   - every claim, begin, commit, extend, renew, release, abandon and save
//     is one BEGIN IMMEDIATE transaction: the write lock is taken before the
//     row is read, so no other process can interleave; a busy file is waited
//     for up to busy_timeout;
//   - a versioned schema (PRAGMA application_id "keel", user_version 1): an
//     empty file gets the schema; another application's database, another
//     schema version, a corrupted file or a read-only path is refused with a
//     clear status and left untouched;
//   - time from a wall clock (keel::system_time), injectable for tests;
//     expiries survive reboots, and a persisted high-water mark keeps store
//     time from going backwards when the clock is stepped back (docs/stores.md,
//     "Time").
//
// Errors: a busy file (past busy_timeout) or a failure before COMMIT is
// keel::store_unavailable_error — nothing was applied, safe to repeat. An
// I/O error at COMMIT is keel::unknown_outcome_error: the transaction may or
// may not be durable; repeat the operation (same owner and fence) to find
// out. Corruption is DataLoss.
//
// Example:
//
//   absl::StatusOr<std::unique_ptr<keel::sqlite_store<>>> store =
//       keel::sqlite_store<>::open("/var/lib/receipts/keel.db", {.synchronous = keel::sqlite_sync::full});
//   if (!store.ok()) return store.status();   // says which file and why
//   keel::once decide(**store, {.lease = std::chrono::seconds(30), .policy_revision = "receipts-v4"});
//
// Thread-safety: one connection per store object, used under a mutex, so a
// store may be shared by threads (they take turns). For parallelism across
// threads or processes open one store per thread or process on the same
// file: SQLite serialises the writers. Never carry a store across fork():
// open a new one in the child.
#pragma once

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <sqlite3.h>
#include <unistd.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "keel/clock.hpp"
#include "keel/digest.hpp"
#include "keel/idempotency.hpp"
#include "keel/lease.hpp"
#include "keel/ownership.hpp"
#include "keel/result_store.hpp"
#include "keel/status.hpp"

namespace keel {

enum class sqlite_sync { normal, full };

struct sqlite_options {
  // PRAGMA synchronous: normal (fsync at checkpoints) or full (at every commit).
  sqlite_sync synchronous = sqlite_sync::normal;
  // How long an operation waits for another writer; in [0, 24h].
  duration busy_timeout = std::chrono::seconds(5);
  // Create the file (and the schema in an empty file). Off: a missing file is NotFound.
  bool create = true;
  // A registered SQLite VFS to open the file with; empty: the default. (Tests
  // use a fault-injecting VFS to make commits fail.)
  std::string vfs{};

  [[nodiscard]] absl::Status validate() const {
    if (busy_timeout < duration::zero() || busy_timeout > std::chrono::hours(24))
      return detail::invalid_field("sqlite_options", "busy_timeout", "be in [0, 24h]", busy_timeout);
    return absl::OkStatus();
  }
};

// The schema version this keel reads and writes.
inline constexpr int sqlite_schema_version = 1;
// PRAGMA application_id of a keel store: "keel" in ASCII.
inline constexpr std::int32_t sqlite_application_id = 0x6B65656C;

namespace detail {

// The high-water mark is written when the clock has moved this far past it
// (so: not on every transaction; see docs/stores.md, "Time").
inline constexpr std::int64_t sqlite_mark_granularity_ns = 10'000'000;

[[nodiscard]] inline absl::StatusCode sqlite_code(int rc) noexcept {
  switch (rc & 0xff) {
    case SQLITE_BUSY:
    case SQLITE_LOCKED:
    case SQLITE_PROTOCOL:
      return absl::StatusCode::kUnavailable;
    case SQLITE_CORRUPT:
    case SQLITE_NOTADB:
      return absl::StatusCode::kDataLoss;
    case SQLITE_READONLY:
    case SQLITE_PERM:
    case SQLITE_AUTH:
      return absl::StatusCode::kPermissionDenied;
    case SQLITE_FULL:
    case SQLITE_NOMEM:
      return absl::StatusCode::kResourceExhausted;
    case SQLITE_CANTOPEN:
      return absl::StatusCode::kUnavailable;
    case SQLITE_SCHEMA:
    case SQLITE_CONSTRAINT:
    case SQLITE_MISMATCH:
      return absl::StatusCode::kFailedPrecondition;
    default:
      return absl::StatusCode::kInternal;
  }
}

// One prepared statement, reset (and unbound) when a use ends.
class sqlite_stmt {
 public:
  sqlite_stmt() = default;
  ~sqlite_stmt() { sqlite3_finalize(s_); }
  sqlite_stmt(const sqlite_stmt&) = delete;
  sqlite_stmt& operator=(const sqlite_stmt&) = delete;

  int prepare(sqlite3* db, std::string_view sql) {
    return sqlite3_prepare_v3(db, sql.data(), static_cast<int>(sql.size()), SQLITE_PREPARE_PERSISTENT, &s_, nullptr);
  }
  [[nodiscard]] sqlite3_stmt* get() const noexcept { return s_; }

  // A use of the statement: binds, steps, reads columns; resets at the end.
  class use {
   public:
    explicit use(sqlite_stmt& s) noexcept : s_(s.s_) {}
    ~use() {
      sqlite3_reset(s_);
      sqlite3_clear_bindings(s_);
    }
    use(const use&) = delete;
    use& operator=(const use&) = delete;

    use& bind(int i, std::string_view bytes) {
      // A non-null pointer: a zero-length blob, not NULL.
      rc_ = keep(sqlite3_bind_blob(s_, i, bytes.empty() ? "" : bytes.data(), static_cast<int>(bytes.size()),
                                   SQLITE_STATIC));
      return *this;
    }
    use& bind(int i, std::int64_t v) {
      rc_ = keep(sqlite3_bind_int64(s_, i, v));
      return *this;
    }
    use& bind_null(int i) {
      rc_ = keep(sqlite3_bind_null(s_, i));
      return *this;
    }
    // SQLITE_ROW, SQLITE_DONE or an error code.
    int step() {
      if (rc_ != SQLITE_OK) return rc_;
      return sqlite3_step(s_);
    }
    [[nodiscard]] std::int64_t i64(int col) const { return sqlite3_column_int64(s_, col); }
    [[nodiscard]] bool is_null(int col) const { return sqlite3_column_type(s_, col) == SQLITE_NULL; }
    [[nodiscard]] std::string_view bytes(int col) const {
      const void* p = sqlite3_column_blob(s_, col);
      const int n = sqlite3_column_bytes(s_, col);
      return p == nullptr ? std::string_view() : std::string_view(static_cast<const char*>(p), n);
    }

   private:
    int keep(int rc) const noexcept { return rc_ != SQLITE_OK ? rc_ : rc; }
    sqlite3_stmt* s_;
    int rc_ = SQLITE_OK;
  };

 private:
  sqlite3_stmt* s_ = nullptr;
};

struct sqlite_closer {
  void operator()(sqlite3* db) const noexcept { sqlite3_close_v2(db); }
};

}  // namespace detail

template <store_time_source Time = system_time>
class sqlite_store {
 public:
  // Opens (and, in an empty or new file, creates) a keel store at `path`.
  //
  //   InvalidArgument     invalid options
  //   NotFound            the file does not exist and create is off, or its directory is missing
  //   PermissionDenied    the path cannot be written (read-only file, directory or file system)
  //   DataLoss            not a SQLite database, or corrupted
  //   FailedPrecondition  another application's database, or a keel schema of another version
  //   Unavailable         busy past busy_timeout, or another open failure
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<sqlite_store>> open(std::string path,
                                                                         const sqlite_options& o = {},
                                                                         Time time = {}) {
    if (absl::Status v = o.validate(); !v.ok()) return v;
    std::unique_ptr<sqlite_store> s(new sqlite_store(std::move(path), o, std::move(time)));
    if (absl::Status st = s->connect(); !st.ok()) return st;
    return s;
  }

  sqlite_store(const sqlite_store&) = delete;
  sqlite_store& operator=(const sqlite_store&) = delete;
  // Statements are members declared after the connection, so they are
  // finalized before it closes.
  ~sqlite_store() = default;

  [[nodiscard]] const std::string& path() const noexcept { return path_; }

  // ---- idempotency_store ---------------------------------------------------

  [[nodiscard]] absl::StatusOr<begin_outcome> begin(const request_identity& id, const digest& request,
                                                    const owner_id& owner, const begin_options& o) {
    if (absl::Status v = id.validate(); !v.ok()) return v;
    if (absl::Status v = o.validate(); !v.ok()) return v;
    if (owner.is_nil()) return absl::InvalidArgumentError("keel: owner must not be nil");
    const auto owner_bytes = owner.bytes();
    const std::string_view owner_view(reinterpret_cast<const char*>(owner_bytes.data()), owner_bytes.size());
    std::lock_guard lock(mu_);
    return transact<begin_outcome>("begin", [&](const times& now) -> absl::StatusOr<begin_outcome> {
      const std::int64_t lease = detail::to_ns(o.lease);
      detail::sqlite_stmt::use row(idem_select_);
      row.bind(1, id.tenant).bind(2, id.endpoint).bind(3, id.key);
      const int rc = row.step();
      if (rc != SQLITE_ROW && rc != SQLITE_DONE) return failure(rc, "reading the record");
      if (rc == SQLITE_DONE) return claim_row(id, request, owner_view, owner, 1, now, o, false, false);

      const auto state = static_cast<int>(row.i64(1));
      const ownership holder{owner_from(row.bytes(2)), row.i64(3)};
      const std::int64_t lease_expires = row.i64(4);
      const std::int64_t record_expires = row.i64(5);
      if (record_expires <= now.check || state == abandoned)
        return claim_row(id, request, owner_view, owner, holder.fence + 1, now, o, false, false);
      if (row.bytes(0) != request.view()) {
        begin_outcome out{.state = begin_state::conflict};
        out.conflict_in_flight = state == in_flight;
        return out;
      }
      if (state == in_flight) {
        if (holder.owner == owner) {  // the holder asking again
          const std::int64_t until = std::max(lease_expires, detail::add_ns(now.grant, lease));
          detail::sqlite_stmt::use ext(idem_extend_);
          ext.bind(1, id.tenant).bind(2, id.endpoint).bind(3, id.key).bind(4, until);
          if (int e = ext.step(); e != SQLITE_DONE) return failure(e, "extending the lease");
          return begin_outcome{.state = begin_state::claimed,
                               .ownership = holder,
                               .lease_remaining = detail::from_ns(until - now.check)};
        }
        if (now.check < lease_expires) {
          return begin_outcome{.state = begin_state::in_flight,
                               .ownership = {.owner = {}, .fence = holder.fence},
                               .lease_remaining = detail::from_ns(lease_expires - now.check)};
        }
        return claim_row(id, request, owner_view, owner, holder.fence + 1, now, o, true, false);
      }
      // committed
      if (!o.supersede_revision.empty() && row.bytes(8) != o.supersede_revision)
        return claim_row(id, request, owner_view, owner, holder.fence + 1, now, o, false, true);
      begin_outcome out{.state = begin_state::replay, .ownership = {.owner = {}, .fence = holder.fence}};
      out.decision.id = std::string(row.bytes(6));
      out.decision.model_digest = std::string(row.bytes(7));
      out.decision.policy_revision = std::string(row.bytes(8));
      out.decision.result = std::string(row.bytes(9));
      out.decision.error_code = static_cast<absl::StatusCode>(row.i64(10));
      out.decision.error_message = std::string(row.bytes(11));
      out.committed_at_ns = row.i64(12);
      return out;
    });
  }

  [[nodiscard]] absl::Status extend(const request_identity& id, const ownership& token, duration ttl) {
    if (absl::Status v = id.validate(); !v.ok()) return v;
    if (ttl <= duration::zero()) return detail::invalid_field("extend", "ttl", "be > 0", ttl);
    const auto ob = token.owner.bytes();
    const std::string_view owner(reinterpret_cast<const char*>(ob.data()), ob.size());
    std::lock_guard lock(mu_);
    return status_of(transact<bool>("extend", [&](const times& now) -> absl::StatusOr<bool> {
      detail::sqlite_stmt::use u(idem_extend_fenced_);
      u.bind(1, id.tenant).bind(2, id.endpoint).bind(3, id.key).bind(4, detail::add_ns(now.grant, detail::to_ns(ttl)));
      u.bind(5, owner).bind(6, token.fence).bind(7, now.check);
      if (int rc = u.step(); rc != SQLITE_DONE) return failure(rc, "extending the lease");
      if (changes() == 1) return true;
      return diagnose_record(id, token, now, "extend", /*done_state=*/-1);
    }));
  }

  [[nodiscard]] absl::Status commit(const request_identity& id, const ownership& token, const decision& d,
                                    duration retention) {
    if (absl::Status v = id.validate(); !v.ok()) return v;
    if (absl::Status v = d.validate(); !v.ok()) return v;
    if (retention <= duration::zero()) return detail::invalid_field("commit", "retention", "be > 0", retention);
    const auto ob = token.owner.bytes();
    const std::string_view owner(reinterpret_cast<const char*>(ob.data()), ob.size());
    std::lock_guard lock(mu_);
    return status_of(transact<bool>("commit", [&](const times& now) -> absl::StatusOr<bool> {
      detail::sqlite_stmt::use u(idem_commit_);
      u.bind(1, id.tenant).bind(2, id.endpoint).bind(3, id.key);
      u.bind(4, d.id).bind(5, d.model_digest).bind(6, d.policy_revision).bind(7, d.result);
      u.bind(8, static_cast<std::int64_t>(d.error_code)).bind(9, d.error_message).bind(10, now.grant);
      u.bind(11, detail::add_ns(now.grant, detail::to_ns(retention)));
      u.bind(12, owner).bind(13, token.fence).bind(14, now.check);
      if (int rc = u.step(); rc != SQLITE_DONE) return failure(rc, "committing the decision");
      if (changes() == 1) return true;
      return diagnose_record(id, token, now, "commit", committed);
    }));
  }

  [[nodiscard]] absl::Status abandon(const request_identity& id, const ownership& token) {
    if (absl::Status v = id.validate(); !v.ok()) return v;
    const auto ob = token.owner.bytes();
    const std::string_view owner(reinterpret_cast<const char*>(ob.data()), ob.size());
    std::lock_guard lock(mu_);
    return status_of(transact<bool>("abandon", [&](const times& now) -> absl::StatusOr<bool> {
      detail::sqlite_stmt::use u(idem_abandon_);
      u.bind(1, id.tenant).bind(2, id.endpoint).bind(3, id.key).bind(4, owner).bind(5, token.fence).bind(6, now.check);
      if (int rc = u.step(); rc != SQLITE_DONE) return failure(rc, "abandoning the record");
      if (changes() == 1) return true;
      return diagnose_record(id, token, now, "abandon", abandoned);
    }));
  }

  // ---- lease_store ---------------------------------------------------------

  [[nodiscard]] absl::StatusOr<lease_claim> claim(std::string_view work_key, const owner_id& owner, duration ttl) {
    if (absl::Status v = validate_key("work key", work_key); !v.ok()) return v;
    if (ttl <= duration::zero()) return detail::invalid_field("claim", "ttl", "be > 0", ttl);
    if (owner.is_nil()) return absl::InvalidArgumentError("keel: owner must not be nil");
    const auto ob = owner.bytes();
    const std::string_view owner_view(reinterpret_cast<const char*>(ob.data()), ob.size());
    std::lock_guard lock(mu_);
    return transact<lease_claim>("claim", [&](const times& now) -> absl::StatusOr<lease_claim> {
      const std::int64_t until = detail::add_ns(now.grant, detail::to_ns(ttl));
      std::int64_t fence = 1;
      bool took_over = false;
      {
        detail::sqlite_stmt::use row(lease_select_);
        row.bind(1, work_key);
        const int rc = row.step();
        if (rc != SQLITE_ROW && rc != SQLITE_DONE) return failure(rc, "reading the lease");
        if (rc == SQLITE_ROW) {
          const ownership holder{owner_from(row.bytes(0)), row.i64(1)};
          const std::int64_t expires = row.i64(2);
          const bool held = row.i64(3) != 0;
          if (held && holder.owner == owner) {  // the holder claiming again
            const std::int64_t later = std::max(expires, until);
            detail::sqlite_stmt::use u(lease_renew_);
            u.bind(1, work_key).bind(2, later).bind(3, owner_view).bind(4, holder.fence);
            if (int e = u.step(); e != SQLITE_DONE) return failure(e, "extending the lease");
            return lease_claim{.acquired = true, .ownership = holder, .remaining = detail::from_ns(later - now.check)};
          }
          if (held && now.check < expires) {
            return lease_claim{.acquired = false,
                               .ownership = {.owner = {}, .fence = holder.fence},
                               .remaining = detail::from_ns(expires - now.check)};
          }
          fence = holder.fence + 1;
          took_over = held;
        }
      }
      detail::sqlite_stmt::use up(lease_upsert_);
      up.bind(1, work_key).bind(2, owner_view).bind(3, fence).bind(4, until);
      if (int e = up.step(); e != SQLITE_DONE) return failure(e, "writing the lease");
      return lease_claim{.acquired = true, .ownership = {owner, fence}, .took_over = took_over, .remaining = ttl};
    });
  }

  [[nodiscard]] absl::Status renew(std::string_view work_key, const ownership& token, duration ttl) {
    if (absl::Status v = validate_key("work key", work_key); !v.ok()) return v;
    if (ttl <= duration::zero()) return detail::invalid_field("renew", "ttl", "be > 0", ttl);
    const auto ob = token.owner.bytes();
    const std::string_view owner(reinterpret_cast<const char*>(ob.data()), ob.size());
    std::lock_guard lock(mu_);
    return status_of(transact<bool>("renew", [&](const times& now) -> absl::StatusOr<bool> {
      detail::sqlite_stmt::use u(lease_renew_);
      u.bind(1, work_key).bind(2, detail::add_ns(now.grant, detail::to_ns(ttl))).bind(3, owner).bind(4, token.fence);
      if (int rc = u.step(); rc != SQLITE_DONE) return failure(rc, "renewing the lease");
      if (changes() == 1) return true;
      return diagnose_lease(work_key, token, "renew", false);
    }));
  }

  [[nodiscard]] absl::Status release(std::string_view work_key, const ownership& token) {
    if (absl::Status v = validate_key("work key", work_key); !v.ok()) return v;
    const auto ob = token.owner.bytes();
    const std::string_view owner(reinterpret_cast<const char*>(ob.data()), ob.size());
    std::lock_guard lock(mu_);
    return status_of(transact<bool>("release", [&](const times& now) -> absl::StatusOr<bool> {
      detail::sqlite_stmt::use u(lease_release_);
      u.bind(1, work_key).bind(2, now.check).bind(3, owner).bind(4, token.fence);
      if (int rc = u.step(); rc != SQLITE_DONE) return failure(rc, "releasing the lease");
      if (changes() == 1) return true;
      return diagnose_lease(work_key, token, "release", true);
    }));
  }

  // ---- result_store --------------------------------------------------------

  [[nodiscard]] absl::StatusOr<bool> save_result(std::string_view key, std::string_view value, duration retention) {
    if (absl::Status v = validate_key("result key", key); !v.ok()) return v;
    if (retention < duration::zero())
      return detail::invalid_field("save_result", "retention", "be >= 0", retention);
    std::lock_guard lock(mu_);
    return transact<bool>("save_result", [&](const times& now) -> absl::StatusOr<bool> {
      const std::int64_t expires =
          retention == duration::zero() ? INT64_MAX : detail::add_ns(now.grant, detail::to_ns(retention));
      detail::sqlite_stmt::use u(result_save_);
      u.bind(1, key).bind(2, value).bind(3, now.grant).bind(4, expires).bind(5, now.check);
      if (int rc = u.step(); rc != SQLITE_DONE) return failure(rc, "saving the result");
      return changes() == 1;
    });
  }

  [[nodiscard]] absl::StatusOr<std::optional<std::string>> load_result(std::string_view key) {
    if (absl::Status v = validate_key("result key", key); !v.ok()) return v;
    std::lock_guard lock(mu_);
    // One statement: its own snapshot, no write lock.
    detail::sqlite_stmt::use q(result_load_);
    q.bind(1, key).bind(2, detail::store_now_ns(time_));
    const int rc = q.step();
    if (rc == SQLITE_DONE) return std::optional<std::string>();
    if (rc != SQLITE_ROW) return failure(rc, "loading the result");
    return std::optional<std::string>(std::string(q.bytes(0)));
  }

  [[nodiscard]] absl::Status erase_result(std::string_view key) {
    if (absl::Status v = validate_key("result key", key); !v.ok()) return v;
    std::lock_guard lock(mu_);
    detail::sqlite_stmt::use u(result_erase_);
    u.bind(1, key);
    if (int rc = u.step(); rc != SQLITE_DONE) return failure(rc, "erasing the result");
    return absl::OkStatus();
  }

  // ---- housekeeping --------------------------------------------------------

  // Deletes records past their retention, expired results, and leases that
  // are released or expired (their fences start again at 1; stale owners
  // still cannot match). Returns the number of rows deleted.
  absl::StatusOr<std::int64_t> purge_expired() {
    std::lock_guard lock(mu_);
    return transact<std::int64_t>("purge_expired", [&](const times& now) -> absl::StatusOr<std::int64_t> {
      std::int64_t n = 0;
      for (detail::sqlite_stmt* st : {&purge_records_, &purge_leases_, &purge_results_}) {
        detail::sqlite_stmt::use u(*st);
        u.bind(1, now.check);
        if (int rc = u.step(); rc != SQLITE_DONE) return failure(rc, "purging");
        n += changes();
      }
      return n;
    });
  }

 private:
  static constexpr int in_flight = 0, committed = 1, abandoned = 2;

  // Store time inside a transaction: `check` decides what has expired,
  // `grant` is the base of new expiries (see docs/stores.md, "Time").
  struct times {
    std::int64_t check;
    std::int64_t grant;
  };

  sqlite_store(std::string path, const sqlite_options& o, Time time)
      : path_(std::move(path)), options_(o), time_(std::move(time)) {}

  // ---- opening -------------------------------------------------------------

  absl::Status open_error(int rc, std::string_view what) const {
    const int sys = db_ ? sqlite3_system_errno(db_.get()) : 0;
    const std::string msg = db_ ? sqlite3_errmsg(db_.get()) : sqlite3_errstr(rc);
    absl::StatusCode code = detail::sqlite_code(rc);
    if ((rc & 0xff) == SQLITE_CANTOPEN) {
      if (sys == EACCES || sys == EPERM || sys == EROFS) {
        code = absl::StatusCode::kPermissionDenied;
      } else if (sys == ENOENT) {
        // SQLite retries a create it may not make as a read-only open, which
        // then fails with ENOENT: a directory this process may not write is
        // PermissionDenied, a missing one NotFound.
        const std::size_t slash = path_.rfind('/');
        const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path_.substr(0, slash);
        const bool unwritable = ::access(dir.c_str(), F_OK) == 0 && ::access(dir.c_str(), W_OK) != 0;
        code = options_.create && unwritable ? absl::StatusCode::kPermissionDenied : absl::StatusCode::kNotFound;
      }
    }
    return absl::Status(code, absl::StrCat("keel: sqlite store '", path_, "': ", detail::to_absl(what), ": ", msg,
                                           sys != 0 ? absl::StrCat(" (errno ", sys, ")") : std::string()));
  }

  absl::Status connect() {
    sqlite3* raw = nullptr;
    const int flags = SQLITE_OPEN_READWRITE | (options_.create ? SQLITE_OPEN_CREATE : 0) | SQLITE_OPEN_NOMUTEX |
                      SQLITE_OPEN_EXRESCODE;
    const int rc = sqlite3_open_v2(path_.c_str(), &raw, flags, options_.vfs.empty() ? nullptr : options_.vfs.c_str());
    db_.reset(raw);
    if (rc != SQLITE_OK) return open_error(rc, options_.create ? "cannot open or create" : "cannot open");
    sqlite3_busy_timeout(db_.get(),
                         static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(options_.busy_timeout).count()));
    sqlite3_db_config(db_.get(), SQLITE_DBCONFIG_DEFENSIVE, 1, nullptr);

    // Look before touching anything: a foreign or damaged file is refused
    // before a single byte of it is written.
    absl::StatusOr<file_kind> kind = inspect();
    if (!kind.ok()) return kind.status();
    if (sqlite3_db_readonly(db_.get(), "main") == 1)
      return absl::PermissionDeniedError(absl::StrCat("keel: sqlite store '", path_,
                                                      "' can only be opened read-only; keel needs to write"));
    if (absl::Status s = exec("PRAGMA journal_mode=WAL", "enabling WAL"); !s.ok()) return s;
    if (absl::Status s = check_wal(); !s.ok()) return s;
    if (absl::Status s = exec(options_.synchronous == sqlite_sync::full ? "PRAGMA synchronous=FULL"
                                                                         : "PRAGMA synchronous=NORMAL",
                              "setting synchronous");
        !s.ok())
      return s;
    if (*kind == file_kind::empty) {
      if (absl::Status s = create_schema(); !s.ok()) return s;
    }
    return prepare_all();
  }

  enum class file_kind { empty, keel };

  absl::StatusOr<file_kind> inspect() {
    absl::StatusOr<std::int64_t> app = pragma_int("PRAGMA application_id");
    if (!app.ok()) return app.status();
    absl::StatusOr<std::int64_t> version = pragma_int("PRAGMA user_version");
    if (!version.ok()) return version.status();
    std::vector<std::string> tables;
    {
      detail::sqlite_stmt q;
      int rc = q.prepare(db_.get(), "SELECT name FROM sqlite_schema WHERE type = 'table' ORDER BY name");
      if (rc != SQLITE_OK) return open_error(rc, "reading the schema");
      detail::sqlite_stmt::use u(q);
      while ((rc = u.step()) == SQLITE_ROW) tables.emplace_back(u.bytes(0));
      if (rc != SQLITE_DONE) return open_error(rc, "reading the schema");
    }
    if (*app == 0 && tables.empty() && *version == 0) return file_kind::empty;
    if (*app != sqlite_application_id) {
      return absl::FailedPreconditionError(absl::StrCat(
          "keel: sqlite store '", path_, "' is another application's database (application_id ", *app,
          ", tables: ", tables.empty() ? "none" : absl::StrJoin(tables, ", "), "); keel will not touch it"));
    }
    if (*version != sqlite_schema_version) {
      return absl::FailedPreconditionError(absl::StrCat("keel: sqlite store '", path_, "' has keel schema version ",
                                                        *version, "; this keel reads version ",
                                                        sqlite_schema_version, " only; refusing to change it"));
    }
    for (const char* t : {"keel_clock", "keel_idempotency", "keel_lease", "keel_result"}) {
      if (std::find(tables.begin(), tables.end(), t) == tables.end())
        return absl::FailedPreconditionError(absl::StrCat("keel: sqlite store '", path_,
                                                          "' is a keel store with a damaged schema: table ", t,
                                                          " is missing"));
    }
    return file_kind::keel;
  }

  absl::StatusOr<std::int64_t> pragma_int(const char* sql) {
    detail::sqlite_stmt q;
    int rc = q.prepare(db_.get(), sql);
    if (rc != SQLITE_OK) return open_error(rc, "reading the file header");
    detail::sqlite_stmt::use u(q);
    rc = u.step();
    if (rc != SQLITE_ROW) return open_error(rc, "reading the file header");
    return u.i64(0);
  }

  absl::Status check_wal() {
    detail::sqlite_stmt q;
    int rc = q.prepare(db_.get(), "PRAGMA journal_mode");
    if (rc != SQLITE_OK) return open_error(rc, "reading the journal mode");
    detail::sqlite_stmt::use u(q);
    rc = u.step();
    if (rc != SQLITE_ROW) return open_error(rc, "reading the journal mode");
    if (u.bytes(0) != "wal")
      return absl::FailedPreconditionError(absl::StrCat("keel: sqlite store '", path_,
                                                        "': WAL journal mode is not available here (got ",
                                                        std::string(u.bytes(0)), ")"));
    return absl::OkStatus();
  }

  absl::Status exec(const char* sql, std::string_view what) {
    char* err = nullptr;
    const int rc = sqlite3_exec(db_.get(), sql, nullptr, nullptr, &err);
    if (rc == SQLITE_OK) return absl::OkStatus();
    std::string msg = err ? err : sqlite3_errstr(rc);
    sqlite3_free(err);
    if (sqlite3_get_autocommit(db_.get()) == 0) sqlite3_exec(db_.get(), "ROLLBACK", nullptr, nullptr, nullptr);
    return absl::Status(detail::sqlite_code(rc), absl::StrCat("keel: sqlite store '", path_, "': ", detail::to_absl(what), ": ", msg));
  }

  absl::Status create_schema() {
    // Another process may be creating it at the same moment: take the write
    // lock, then look again.
    if (absl::Status s = exec("BEGIN IMMEDIATE", "creating the schema"); !s.ok()) return s;
    absl::StatusOr<std::int64_t> app = pragma_int("PRAGMA application_id");
    if (!app.ok()) {
      (void)exec("ROLLBACK", "creating the schema");
      return app.status();
    }
    if (*app == sqlite_application_id) return exec("COMMIT", "creating the schema");
    static constexpr const char* schema =
        "CREATE TABLE keel_clock(id INTEGER PRIMARY KEY CHECK (id = 0), high_water INTEGER NOT NULL);"
        "INSERT INTO keel_clock VALUES (0, -9223372036854775808);"
        "CREATE TABLE keel_idempotency("
        "  tenant BLOB NOT NULL, endpoint BLOB NOT NULL, key BLOB NOT NULL,"
        "  request BLOB NOT NULL, state INTEGER NOT NULL, owner BLOB NOT NULL, fence INTEGER NOT NULL,"
        "  lease_expires INTEGER NOT NULL, record_expires INTEGER NOT NULL,"
        "  decision_id BLOB, model_digest BLOB, policy_revision BLOB, result BLOB,"
        "  error_code INTEGER NOT NULL DEFAULT 0, error_message BLOB, committed_at INTEGER NOT NULL DEFAULT 0,"
        "  PRIMARY KEY (tenant, endpoint, key)) WITHOUT ROWID;"
        "CREATE TABLE keel_lease(work_key BLOB PRIMARY KEY, owner BLOB NOT NULL, fence INTEGER NOT NULL,"
        "  expires INTEGER NOT NULL, held INTEGER NOT NULL) WITHOUT ROWID;"
        "CREATE TABLE keel_result(key BLOB PRIMARY KEY, value BLOB NOT NULL, saved_at INTEGER NOT NULL,"
        "  expires INTEGER NOT NULL) WITHOUT ROWID;"
        "PRAGMA application_id = 1801807212;"  // 0x6B65656C
        "PRAGMA user_version = 1;"
        "COMMIT;";
    static_assert(sqlite_application_id == 1801807212 && sqlite_schema_version == 1);
    return exec(schema, "creating the schema");
  }

  absl::Status prepare_all() {
    struct item {
      detail::sqlite_stmt* st;
      const char* sql;
    };
    const item items[] = {
        {&begin_, "BEGIN IMMEDIATE"},
        {&commit_, "COMMIT"},
        {&rollback_, "ROLLBACK"},
        {&clock_read_, "SELECT high_water FROM keel_clock WHERE id = 0"},
        {&clock_write_, "UPDATE keel_clock SET high_water = ?1 WHERE id = 0 AND high_water < ?1"},
        {&idem_select_,
         "SELECT request, state, owner, fence, lease_expires, record_expires, decision_id, model_digest,"
         " policy_revision, result, error_code, error_message, committed_at"
         " FROM keel_idempotency WHERE tenant = ?1 AND endpoint = ?2 AND key = ?3"},
        {&idem_claim_,
         "INSERT INTO keel_idempotency(tenant, endpoint, key, request, state, owner, fence, lease_expires,"
         " record_expires) VALUES (?1, ?2, ?3, ?4, 0, ?5, ?6, ?7, ?8)"
         " ON CONFLICT (tenant, endpoint, key) DO UPDATE SET request = excluded.request, state = 0,"
         " owner = excluded.owner, fence = excluded.fence, lease_expires = excluded.lease_expires,"
         " record_expires = excluded.record_expires, decision_id = NULL, model_digest = NULL,"
         " policy_revision = NULL, result = NULL, error_code = 0, error_message = NULL, committed_at = 0"},
        {&idem_extend_,
         "UPDATE keel_idempotency SET lease_expires = ?4, record_expires = max(record_expires, ?4)"
         " WHERE tenant = ?1 AND endpoint = ?2 AND key = ?3"},
        {&idem_extend_fenced_,
         "UPDATE keel_idempotency SET lease_expires = max(lease_expires, ?4),"
         " record_expires = max(record_expires, max(lease_expires, ?4))"
         " WHERE tenant = ?1 AND endpoint = ?2 AND key = ?3 AND state = 0 AND owner = ?5 AND fence = ?6"
         " AND record_expires > ?7"},
        {&idem_commit_,
         "UPDATE keel_idempotency SET state = 1, decision_id = ?4, model_digest = ?5, policy_revision = ?6,"
         " result = ?7, error_code = ?8, error_message = ?9, committed_at = ?10, record_expires = ?11"
         " WHERE tenant = ?1 AND endpoint = ?2 AND key = ?3 AND state = 0 AND owner = ?12 AND fence = ?13"
         " AND record_expires > ?14"},
        {&idem_abandon_,
         "UPDATE keel_idempotency SET state = 2, decision_id = NULL, model_digest = NULL, policy_revision = NULL,"
         " result = NULL, error_code = 0, error_message = NULL"
         " WHERE tenant = ?1 AND endpoint = ?2 AND key = ?3 AND state = 0 AND owner = ?4 AND fence = ?5"
         " AND record_expires > ?6"},
        {&lease_select_, "SELECT owner, fence, expires, held FROM keel_lease WHERE work_key = ?1"},
        {&lease_upsert_,
         "INSERT INTO keel_lease(work_key, owner, fence, expires, held) VALUES (?1, ?2, ?3, ?4, 1)"
         " ON CONFLICT (work_key) DO UPDATE SET owner = excluded.owner, fence = excluded.fence,"
         " expires = excluded.expires, held = 1"},
        {&lease_renew_,
         "UPDATE keel_lease SET expires = max(expires, ?2)"
         " WHERE work_key = ?1 AND held = 1 AND owner = ?3 AND fence = ?4"},
        {&lease_release_,
         "UPDATE keel_lease SET held = 0, expires = ?2 WHERE work_key = ?1 AND held = 1 AND owner = ?3 AND fence = ?4"},
        {&result_save_,
         "INSERT INTO keel_result(key, value, saved_at, expires) VALUES (?1, ?2, ?3, ?4)"
         " ON CONFLICT (key) DO UPDATE SET value = excluded.value, saved_at = excluded.saved_at,"
         " expires = excluded.expires WHERE keel_result.expires <= ?5"},
        {&result_load_,
         "SELECT value FROM keel_result WHERE key = ?1"
         " AND expires > max(?2, (SELECT high_water FROM keel_clock WHERE id = 0))"},
        {&result_erase_, "DELETE FROM keel_result WHERE key = ?1"},
        {&purge_records_, "DELETE FROM keel_idempotency WHERE record_expires <= ?1"},
        {&purge_leases_, "DELETE FROM keel_lease WHERE held = 0 OR expires <= ?1"},
        {&purge_results_, "DELETE FROM keel_result WHERE expires <= ?1"},
    };
    for (const item& i : items) {
      if (int rc = i.st->prepare(db_.get(), i.sql); rc != SQLITE_OK) return open_error(rc, "preparing statements");
    }
    return absl::OkStatus();
  }

  // ---- transactions --------------------------------------------------------

  [[nodiscard]] std::int64_t changes() const noexcept { return sqlite3_changes64(db_.get()); }

  // A failure inside a transaction: the caller rolls back, so nothing was applied.
  absl::Status failure(int rc, std::string_view what) const {
    absl::Status s(detail::sqlite_code(rc), absl::StrCat("keel: sqlite store '", path_, "': ", detail::to_absl(what), ": ",
                                                         sqlite3_errmsg(db_.get())));
    return s.code() == absl::StatusCode::kUnavailable ? mark_not_started(std::move(s)) : s;
  }

  // BEGIN IMMEDIATE; read (and maybe move) the high-water mark; body; COMMIT.
  template <class T, class Body>
  absl::StatusOr<T> transact(std::string_view op, Body&& body) {
    {
      detail::sqlite_stmt::use b(begin_);
      if (int rc = b.step(); rc != SQLITE_DONE) return failure(rc, absl::StrCat(detail::to_absl(op), ": taking the write lock"));
    }
    absl::StatusOr<T> out = [&]() -> absl::StatusOr<T> {
      absl::StatusOr<times> now = read_time();
      if (!now.ok()) return now.status();
      return body(*now);
    }();
    if (!out.ok()) {
      rollback();
      return out;
    }
    detail::sqlite_stmt::use c(commit_);
    const int rc = c.step();
    if (rc == SQLITE_DONE) return out;
    const absl::Status cause = failure(rc, absl::StrCat(detail::to_absl(op), ": COMMIT"));
    if ((rc & 0xff) == SQLITE_IOERR) {
      rollback();
      return unknown_outcome_error(absl::StrCat("sqlite store '", path_, "': ", detail::to_absl(op)), cause);
    }
    rollback();  // BUSY, FULL, ...: the transaction did not commit
    return cause.code() == absl::StatusCode::kUnavailable ? cause : mark_not_started(cause);
  }

  void rollback() {
    if (sqlite3_get_autocommit(db_.get()) != 0) return;  // SQLite already rolled back
    detail::sqlite_stmt::use r(rollback_);
    (void)r.step();
  }

  absl::StatusOr<times> read_time() {
    const std::int64_t s = detail::store_now_ns(time_);
    std::int64_t mark = INT64_MIN;
    {
      detail::sqlite_stmt::use q(clock_read_);
      const int rc = q.step();
      if (rc != SQLITE_ROW) return failure(rc == SQLITE_DONE ? SQLITE_CORRUPT : rc, "reading the store clock");
      mark = q.i64(0);
    }
    if (s < mark) return times{mark, detail::add_ns(mark, detail::sqlite_mark_granularity_ns)};  // stepped back
    if (mark == INT64_MIN || s - mark >= detail::sqlite_mark_granularity_ns) {
      detail::sqlite_stmt::use w(clock_write_);
      w.bind(1, s);
      if (int rc = w.step(); rc != SQLITE_DONE) return failure(rc, "moving the store clock");
    }
    return times{s, s};
  }

  static owner_id owner_from(std::string_view b) noexcept {
    std::array<unsigned char, 16> a{};
    if (b.size() == a.size()) std::copy(b.begin(), b.end(), reinterpret_cast<char*>(a.data()));
    return owner_id::from_bytes(a);
  }

  absl::StatusOr<begin_outcome> claim_row(const request_identity& id, const digest& request,
                                          std::string_view owner_view, const owner_id& owner, std::int64_t fence,
                                          const times& now, const begin_options& o, bool took_over, bool superseded) {
    detail::sqlite_stmt::use u(idem_claim_);
    u.bind(1, id.tenant).bind(2, id.endpoint).bind(3, id.key).bind(4, request.view()).bind(5, owner_view);
    u.bind(6, fence).bind(7, detail::add_ns(now.grant, detail::to_ns(o.lease)));
    u.bind(8, detail::add_ns(now.grant, detail::to_ns(o.retention)));
    if (int rc = u.step(); rc != SQLITE_DONE) return failure(rc, "claiming the record");
    return begin_outcome{.state = begin_state::claimed,
                         .ownership = {owner, fence},
                         .took_over = took_over,
                         .superseded = superseded,
                         .lease_remaining = o.lease};
  }

  // After a fenced update changed no row: a repeat of a done operation (OK)
  // or lost ownership (with why).
  absl::StatusOr<bool> diagnose_record(const request_identity& id, const ownership& token, const times& now,
                                       std::string_view op, int done_state) {
    detail::sqlite_stmt::use row(idem_select_);
    row.bind(1, id.tenant).bind(2, id.endpoint).bind(3, id.key);
    const int rc = row.step();
    if (rc != SQLITE_ROW && rc != SQLITE_DONE) return failure(rc, "reading the record");
    if (rc == SQLITE_DONE || row.i64(5) <= now.check)
      return lost_ownership_error(absl::StrCat(detail::to_absl(op), " by fence ", token.fence,
                                               ": no live record for this key (expired or never claimed)"));
    const auto state = static_cast<int>(row.i64(1));
    const ownership holder{owner_from(row.bytes(2)), row.i64(3)};
    if (state == done_state && holder == token) return true;  // a repeat
    const std::string_view name = state == in_flight ? "in flight" : state == committed ? "committed" : "abandoned";
    return lost_ownership_error(absl::StrCat(detail::to_absl(op), " by fence ", token.fence, ": the record is ", detail::to_absl(name),
                                             " under fence ", holder.fence,
                                             holder.fence == token.fence ? " and another owner" : ""));
  }

  absl::StatusOr<bool> diagnose_lease(std::string_view work_key, const ownership& token, std::string_view op,
                                      bool release) {
    detail::sqlite_stmt::use row(lease_select_);
    row.bind(1, work_key);
    const int rc = row.step();
    if (rc != SQLITE_ROW && rc != SQLITE_DONE) return failure(rc, "reading the lease");
    if (rc == SQLITE_DONE)
      return lost_ownership_error(absl::StrCat(detail::to_absl(op), " by fence ", token.fence, ": no lease for this key"));
    const ownership holder{owner_from(row.bytes(0)), row.i64(1)};
    const bool held = row.i64(3) != 0;
    if (release && !held && holder == token) return true;  // a repeated release
    return lost_ownership_error(absl::StrCat(detail::to_absl(op), " by fence ", token.fence, ": the lease is ", held ? "held" : "free",
                                             " at fence ", holder.fence,
                                             held && holder.fence == token.fence ? " by another owner" : ""));
  }

  static absl::Status status_of(const absl::StatusOr<bool>& r) { return r.ok() ? absl::OkStatus() : r.status(); }

  std::string path_;
  sqlite_options options_;
  Time time_;
  std::mutex mu_;
  std::unique_ptr<sqlite3, detail::sqlite_closer> db_;
  detail::sqlite_stmt begin_, commit_, rollback_, clock_read_, clock_write_;
  detail::sqlite_stmt idem_select_, idem_claim_, idem_extend_, idem_extend_fenced_, idem_commit_, idem_abandon_;
  detail::sqlite_stmt lease_select_, lease_upsert_, lease_renew_, lease_release_;
  detail::sqlite_stmt result_save_, result_load_, result_erase_;
  detail::sqlite_stmt purge_records_, purge_leases_, purge_results_;
};

static_assert(idempotency_store<sqlite_store<>>);
static_assert(lease_store<sqlite_store<>>);
static_assert(result_store<sqlite_store<>>);

}  // namespace keel
