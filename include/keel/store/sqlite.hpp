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
//     clear status and left untouched; an existing file is integrity-checked
//     when it opens (PRAGMA quick_check by default, with a time limit:
//     sqlite_options::integrity_check), so a damaged page anywhere in it is
//     refused at open (DataLoss naming the file), not at the first request;
//   - fences never go backwards: purge_expired() keeps the highest fence it
//     deletes in a reserved row of keel_lease (work key: one NUL byte, which
//     no caller can use), and a key with no row starts above it;
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
#include <chrono>
#include <climits>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include <sqlite3.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "keel/core/clock.hpp"
#include "keel/core/status.hpp"
#include "keel/store/internal/sqlite_db.hpp"
#include "keel/store/internal/stored_record.hpp"
#include "keel/durable/digest.hpp"
#include "keel/durable/idempotency.hpp"
#include "keel/durable/lease.hpp"
#include "keel/durable/ownership.hpp"
#include "keel/durable/result_store.hpp"

namespace keel {

template <store_time_source Time = system_time>
class sqlite_store {
 public:
  // Opens (and, in an empty or new file, creates) a keel store at `path`.
  //
  //   InvalidArgument     invalid options
  //   NotFound            the file does not exist and create is off, or its directory is missing
  //   PermissionDenied    the path cannot be written (read-only file, directory or file system)
  //   DataLoss            not a SQLite database, or corrupted (the integrity check found damage)
  //   DeadlineExceeded    the integrity check did not finish within integrity_check_timeout
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

  [[nodiscard]] const std::string& path() const noexcept { return db_.path(); }

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
      if (rc == SQLITE_DONE) {
        absl::StatusOr<std::int64_t> fence = first_fence();
        if (!fence.ok()) return fence.status();
        return claim_row(id, request, owner_view, owner, *fence, now, o, false, false);
      }

      absl::StatusOr<record_row> read = read_record(row, id, true);
      if (!read.ok()) return read.status();
      const int state = read->state;
      const ownership holder = read->holder;
      const std::int64_t lease_expires = read->lease_expires;
      const std::int64_t record_expires = read->record_expires;
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
      out.decision = std::move(read->decision);
      out.committed_at_ns = read->committed_at;
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
      std::int64_t fence = 0;
      bool took_over = false;
      {
        detail::sqlite_stmt::use row(lease_select_);
        row.bind(1, work_key);
        const int rc = row.step();
        if (rc != SQLITE_ROW && rc != SQLITE_DONE) return failure(rc, "reading the lease");
        if (rc == SQLITE_DONE) {
          absl::StatusOr<std::int64_t> first = first_fence();
          if (!first.ok()) return first.status();
          fence = *first;
        } else {
          absl::StatusOr<lease_row> read = read_lease(row, work_key);
          if (!read.ok()) return read.status();
          const ownership holder = read->holder;
          const std::int64_t expires = read->expires;
          const bool held = read->held;
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
    q.bind(1, key).bind(2, detail::store_now_ns(db_.time()));
    const int rc = q.step();
    if (rc == SQLITE_DONE) return std::optional<std::string>();
    if (rc != SQLITE_ROW) return failure(rc, "loading the result");
    if (q.type(0) != SQLITE_BLOB && q.type(0) != SQLITE_TEXT)
      return detail::stored_damage(who(), absl::StrCat("the result for key '", detail::to_absl(key), "'"),
                                   "value is not bytes");
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
  // are released or expired (held ones too: their holder may only be
  // paused). In the same transaction it raises the reserved floor row to the
  // highest fence deleted, so a key claimed again starts above every fence
  // it ever had. Returns the number of rows deleted (the floor row is not
  // counted).
  absl::StatusOr<std::int64_t> purge_expired() {
    std::lock_guard lock(mu_);
    return transact<std::int64_t>("purge_expired", [&](const times& now) -> absl::StatusOr<std::int64_t> {
      {
        detail::sqlite_stmt::use f(purge_floor_);
        f.bind(1, now.check);
        if (int rc = f.step(); rc != SQLITE_DONE) return failure(rc, "keeping the highest fence");
      }
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

  using times = detail::sqlite_times;

  sqlite_store(std::string path, const sqlite_options& o, Time time) : db_(std::move(path), o, std::move(time)) {}

  // ---- opening -------------------------------------------------------------

  absl::Status connect() {
    if (absl::Status s = db_.connect(); !s.ok()) return s;
    return prepare_all();
  }

  absl::Status prepare_all() {
    struct item {
      detail::sqlite_stmt* st;
      const char* sql;
    };
    const item items[] = {
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
        {&fence_floor_, "SELECT fence FROM keel_lease WHERE work_key = X'00'"},
        {&purge_floor_,
         "INSERT INTO keel_lease(work_key, owner, fence, expires, held)"
         " SELECT X'00', X'', m, 9223372036854775807, 0 FROM (SELECT max(f) AS m FROM ("
         "  SELECT max(fence) AS f FROM keel_idempotency WHERE record_expires <= ?1 UNION ALL"
         "  SELECT max(fence) FROM keel_lease WHERE (held = 0 OR expires <= ?1) AND work_key <> X'00'))"
         " WHERE m IS NOT NULL"
         " ON CONFLICT (work_key) DO UPDATE SET fence = max(fence, excluded.fence)"},
        {&purge_leases_, "DELETE FROM keel_lease WHERE (held = 0 OR expires <= ?1) AND work_key <> X'00'"},
        {&purge_results_, "DELETE FROM keel_result WHERE expires <= ?1"},
    };
    for (const item& i : items) {
      if (absl::Status s = db_.prepare(*i.st, i.sql); !s.ok()) return s;
    }
    return absl::OkStatus();
  }

  // ---- transactions --------------------------------------------------------

  [[nodiscard]] std::int64_t changes() const noexcept { return db_.changes(); }
  absl::Status failure(int rc, std::string_view what) const { return db_.failure(rc, what); }
  template <class T, class Body>
  absl::StatusOr<T> transact(std::string_view op, Body&& body) {
    return db_.transact(op, std::forward<Body>(body));
  }

  static owner_id owner_from(std::string_view b) noexcept {
    std::array<unsigned char, 16> a{};
    if (b.size() == a.size()) std::copy(b.begin(), b.end(), reinterpret_cast<char*>(a.data()));
    return owner_id::from_bytes(a);
  }

  [[nodiscard]] std::string who() const { return absl::StrCat("sqlite store '", db_.path(), "'"); }

  // A keel_idempotency row (idem_select_'s columns) as read back, checked
  // (detail/stored_record.hpp): integers where keel writes integers, bytes
  // where it writes bytes, a known state, a 16-byte owner, a fence a claim
  // could have issued, and (with_decision, committed) a decision commit()
  // would have accepted. Anything else is DataLoss; the row is left alone.
  struct record_row {
    int state = 0;
    ownership holder{};
    std::int64_t lease_expires = 0, record_expires = 0, committed_at = 0;
    keel::decision decision{};
  };
  absl::StatusOr<record_row> read_record(const detail::sqlite_stmt::use& row, const request_identity& id,
                                         bool with_decision) const {
    const auto damaged = [&](std::string_view why) { return detail::stored_damage(who(), detail::record_words(id), why); };
    const auto is_bytes = [&](int c) { return row.type(c) == SQLITE_BLOB || row.type(c) == SQLITE_TEXT; };
    static constexpr const char* names[] = {"request", "state", "owner", "fence", "lease_expires", "record_expires",
                                            "decision_id", "model_digest", "policy_revision", "result", "error_code",
                                            "error_message", "committed_at"};
    for (int c : {1, 3, 4, 5})
      if (row.type(c) != SQLITE_INTEGER) return damaged(absl::StrCat(names[c], " is not an integer"));
    for (int c : {0, 2})
      if (!is_bytes(c)) return damaged(absl::StrCat(names[c], " is not bytes"));
    if (row.bytes(0).size() != 32) return damaged(absl::StrCat("request digest is ", row.bytes(0).size(), " bytes, not 32"));
    record_row out;
    if (std::string why = detail::stored_state_problem(row.i64(1)); !why.empty()) return damaged(why);
    if (std::string why = detail::stored_owner_problem(row.bytes(2)); !why.empty()) return damaged(why);
    if (std::string why = detail::stored_fence_problem(row.i64(3)); !why.empty()) return damaged(why);
    out.state = static_cast<int>(row.i64(1));
    out.holder = {owner_from(row.bytes(2)), row.i64(3)};
    out.lease_expires = row.i64(4);
    out.record_expires = row.i64(5);
    if (!with_decision || out.state != committed) return out;
    for (int c : {10, 12})
      if (row.type(c) != SQLITE_INTEGER) return damaged(absl::StrCat(names[c], " is not an integer"));
    for (int c : {6, 7, 8, 9, 11})
      if (!is_bytes(c) && !(row.type(c) == SQLITE_NULL && c != 6)) return damaged(absl::StrCat(names[c], " is not bytes"));
    if (!detail::known_status_code(row.i64(10)))
      return damaged(absl::StrCat("error code ", row.i64(10), " is not a status code"));
    out.decision.id = std::string(row.bytes(6));
    out.decision.model_digest = std::string(row.bytes(7));
    out.decision.policy_revision = std::string(row.bytes(8));
    out.decision.result = std::string(row.bytes(9));
    out.decision.error_code = static_cast<absl::StatusCode>(row.i64(10));
    out.decision.error_message = std::string(row.bytes(11));
    out.committed_at = row.i64(12);
    if (std::string why = detail::stored_decision_problem(out.decision); !why.empty()) return damaged(why);
    return out;
  }

  // A keel_lease row (lease_select_'s columns), checked the same way.
  struct lease_row {
    ownership holder{};
    std::int64_t expires = 0;
    bool held = false;
  };
  absl::StatusOr<lease_row> read_lease(const detail::sqlite_stmt::use& row, std::string_view work_key) const {
    const auto damaged = [&](std::string_view why) {
      return detail::stored_damage(who(), absl::StrCat("the lease of work key '", detail::to_absl(work_key), "'"), why);
    };
    static constexpr const char* names[] = {"owner", "fence", "expires", "held"};
    for (int c : {1, 2, 3})
      if (row.type(c) != SQLITE_INTEGER) return damaged(absl::StrCat(names[c], " is not an integer"));
    if (row.type(0) != SQLITE_BLOB && row.type(0) != SQLITE_TEXT) return damaged("owner is not bytes");
    if (std::string why = detail::stored_owner_problem(row.bytes(0)); !why.empty()) return damaged(why);
    if (std::string why = detail::stored_fence_problem(row.i64(1)); !why.empty()) return damaged(why);
    if (row.i64(3) != 0 && row.i64(3) != 1) return damaged(absl::StrCat("held is ", row.i64(3), ", not 0 or 1"));
    return lease_row{.holder = {owner_from(row.bytes(0)), row.i64(1)}, .expires = row.i64(2), .held = row.i64(3) == 1};
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

  // The fence of a key the store has no row for: above every fence purge
  // ever deleted (1 in a store never purged).
  absl::StatusOr<std::int64_t> first_fence() {
    detail::sqlite_stmt::use q(fence_floor_);
    const int rc = q.step();
    if (rc == SQLITE_DONE) return 1;
    if (rc != SQLITE_ROW) return failure(rc, "reading the highest purged fence");
    // The floor may be 0 (nothing purged had a fence yet); the next is one above.
    if (q.type(0) != SQLITE_INTEGER || q.i64(0) < 0 || q.i64(0) >= detail::max_stored_fence)
      return detail::stored_damage(who(), "the highest purged fence (keel_lease, work key X'00')",
                                   q.type(0) != SQLITE_INTEGER ? std::string("fence is not an integer")
                                                               : absl::StrCat("fence ", q.i64(0), " is out of range"));
    return q.i64(0) + 1;
  }

  // After a fenced update changed no row: a repeat of a done operation (OK)
  // or lost ownership (with why).
  absl::StatusOr<bool> diagnose_record(const request_identity& id, const ownership& token, const times& now,
                                       std::string_view op, int done_state) {
    detail::sqlite_stmt::use row(idem_select_);
    row.bind(1, id.tenant).bind(2, id.endpoint).bind(3, id.key);
    const int rc = row.step();
    if (rc != SQLITE_ROW && rc != SQLITE_DONE) return failure(rc, "reading the record");
    absl::StatusOr<record_row> read =
        rc == SQLITE_ROW ? read_record(row, id, false) : absl::StatusOr<record_row>(record_row{});
    if (!read.ok()) return read.status();
    if (rc == SQLITE_DONE || read->record_expires <= now.check)
      return lost_ownership_error(absl::StrCat(detail::to_absl(op), " by fence ", token.fence,
                                               ": no live record for this key (expired or never claimed)"));
    const int state = read->state;
    const ownership holder = read->holder;
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
    absl::StatusOr<lease_row> read = read_lease(row, work_key);
    if (!read.ok()) return read.status();
    const ownership holder = read->holder;
    const bool held = read->held;
    if (release && !held && holder == token) return true;  // a repeated release
    return lost_ownership_error(absl::StrCat(detail::to_absl(op), " by fence ", token.fence, ": the lease is ", held ? "held" : "free",
                                             " at fence ", holder.fence,
                                             held && holder.fence == token.fence ? " by another owner" : ""));
  }

  static absl::Status status_of(const absl::StatusOr<bool>& r) { return r.ok() ? absl::OkStatus() : r.status(); }

  std::mutex mu_;
  detail::sqlite_db<Time> db_;
  detail::sqlite_stmt idem_select_, idem_claim_, idem_extend_, idem_extend_fenced_, idem_commit_, idem_abandon_;
  detail::sqlite_stmt lease_select_, lease_upsert_, lease_renew_, lease_release_;
  detail::sqlite_stmt result_save_, result_load_, result_erase_;
  detail::sqlite_stmt fence_floor_, purge_floor_, purge_records_, purge_leases_, purge_results_;
};

static_assert(idempotency_store<sqlite_store<>>);
static_assert(lease_store<sqlite_store<>>);
static_assert(result_store<sqlite_store<>>);

}  // namespace keel
