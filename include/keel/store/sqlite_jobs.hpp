// keel/store/sqlite_jobs.hpp — the durable batch job queue in SQLite: jobs of
// every queue in one file, safe for several processes on one host, surviving
// restarts. The default backend of keel::job_queue. Link keel::sqlite.
//
// keel::sqlite_job_store implements keel::job_store (keel/durable/job_store.hpp has
// the contract):
//
//   - the same file format, store clock and transactions as
//     keel::sqlite_store (keel/store/internal/sqlite_db.hpp): a job store and an
//     idempotency/lease store may share one file and its clock. The job
//     tables are added to a keel file on first open and versioned on their
//     own (table keel_job_schema, version 1): a file whose job tables are of
//     another version or damaged is refused and left untouched;
//   - every submit, claim, renew, complete, fail and purge is one BEGIN
//     IMMEDIATE transaction: the write lock is taken before anything is read,
//     so the oldest eligible job goes to exactly one of any number of
//     claiming threads and processes, and a depth check cannot race a
//     concurrent submit;
//   - the queue's depth (live jobs) is a counter row updated in the same
//     transaction as every move in or out of queued/running, so the bound
//     costs one row read, not a count;
//   - time from a wall clock (keel::system_time), injectable for tests, with
//     the persisted high-water mark (docs/stores.md, "Time").
//
// get, find and counts are single statements (their own snapshot, no write
// lock). counts scans the queue's jobs: a monitoring call, not a hot path —
// purge finished jobs to keep it small.
//
// Errors: as keel::sqlite_store — a busy file (past busy_timeout) or a
// failure before COMMIT is keel::store_unavailable_error (nothing applied);
// an I/O error at COMMIT is keel::unknown_outcome_error (repeat the write:
// repeats with the same ownership are safe).
//
// Example:
//
//   absl::StatusOr<std::unique_ptr<keel::sqlite_job_store<>>> jobs =
//       keel::sqlite_job_store<>::open("/var/lib/gateway/keel.db");
//   if (!jobs.ok()) return jobs.status();
//   keel::job_queue reports(**jobs, {.queue = "reports", .max_depth = 500});
//
// Thread-safety: one connection per store object, used under a mutex: a
// store may be shared by threads (they take turns); open one per process
// (or per thread, for parallel claims) on the same file. Never carry a store
// across fork(): open a new one in the child.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
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
#include "keel/durable/digest.hpp"
#include "keel/durable/job_store.hpp"
#include "keel/durable/ownership.hpp"

namespace keel {

// The version of the job tables this keel reads and writes.
inline constexpr int sqlite_jobs_schema_version = 1;

template <store_time_source Time = system_time>
class sqlite_job_store {
 public:
  // Opens (creating the file, the keel base schema and the job tables as
  // needed) the job store at `path`. Errors as keel::sqlite_store::open, plus
  // FailedPrecondition for job tables of another version or a damaged set.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<sqlite_job_store>> open(std::string path,
                                                                             const sqlite_options& o = {},
                                                                             Time time = {}) {
    if (absl::Status v = o.validate(); !v.ok()) return v;
    std::unique_ptr<sqlite_job_store> s(new sqlite_job_store(std::move(path), o, std::move(time)));
    if (absl::Status st = s->connect(); !st.ok()) return st;
    return s;
  }

  sqlite_job_store(const sqlite_job_store&) = delete;
  sqlite_job_store& operator=(const sqlite_job_store&) = delete;
  ~sqlite_job_store() = default;

  [[nodiscard]] const std::string& path() const noexcept { return db_.path(); }

  [[nodiscard]] absl::StatusOr<job_submission> submit(const job_key& k, const digest& payload_digest,
                                                      std::string_view payload, const job_limits& limits) {
    if (absl::Status v = k.validate(); !v.ok()) return v;
    if (absl::Status v = limits.validate(); !v.ok()) return v;
    struct answer {
      job_submission s;
      bool full = false;
      std::int64_t live = 0;
    };
    std::lock_guard lock(mu_);
    absl::StatusOr<answer> a = db_.transact("submit", [&](const times& now) -> absl::StatusOr<answer> {
      {
        detail::sqlite_stmt::use row(select_key_);
        row.bind(1, k.queue).bind(2, k.tenant).bind(3, k.key);
        const int rc = row.step();
        if (rc == SQLITE_ROW) {
          const std::int64_t id = row.i64(0);
          if (row.bytes(1) != payload_digest.view())
            return conflict_error(absl::StrCat("job key '", detail::to_absl(k.key), "' of tenant '",
                                               detail::to_absl(k.tenant), "' in queue '", detail::to_absl(k.queue),
                                               "' was submitted with another payload (job ", id, ")"));
          return answer{.s = {.id = id,
                              .created = false,
                              .state = effective(static_cast<int>(row.i64(2)), row.i64(4), now.check),
                              .attempts = static_cast<int>(row.i64(3))}};
        }
        if (rc != SQLITE_DONE) return db_.failure(rc, "reading the job");
      }
      if (absl::Status s = expire_queued(k.queue, now); !s.ok()) return s;
      std::int64_t live = 0;
      {
        detail::sqlite_stmt::use d(depth_read_);
        d.bind(1, k.queue);
        const int rc = d.step();
        if (rc == SQLITE_ROW) live = d.i64(0);
        else if (rc != SQLITE_DONE) return db_.failure(rc, "reading the queue depth");
      }
      // Rejected: commit the expiry marks (they are true), store nothing else.
      if (live >= limits.max_depth) return answer{.s = {}, .full = true, .live = live};
      detail::sqlite_stmt::use ins(insert_);
      ins.bind(1, k.queue).bind(2, k.tenant).bind(3, k.key).bind(4, payload_digest.view()).bind(5, payload);
      ins.bind(6, static_cast<std::int64_t>(limits.max_attempts)).bind(7, now.grant);
      ins.bind(8, detail::add_ns(now.grant, detail::to_ns(limits.max_age)));
      const int rc = ins.step();
      if (rc != SQLITE_ROW) return db_.failure(rc, "inserting the job");
      const std::int64_t id = ins.i64(0);
      if (absl::Status s = add_depth(k.queue, 1); !s.ok()) return s;
      return answer{.s = {.id = id, .created = true, .state = job_state::queued, .attempts = 0}};
    });
    if (!a.ok()) return a.status();
    if (a->full) return job_queue_full_error(k.queue, a->live, limits.max_depth, limits.overload_retry_after);
    return a->s;
  }

  [[nodiscard]] absl::StatusOr<std::optional<job_claim>> claim(std::string_view queue, const owner_id& owner,
                                                               duration lease) {
    if (absl::Status v = validate_key("queue", queue); !v.ok()) return v;
    if (absl::Status v = detail::validate_job_lease("claim", lease); !v.ok()) return v;
    if (owner.is_nil()) return absl::InvalidArgumentError("keel: owner must not be nil");
    const auto ob = owner.bytes();
    const std::string_view owner_view(reinterpret_cast<const char*>(ob.data()), ob.size());
    using result = std::optional<job_claim>;
    std::lock_guard lock(mu_);
    return db_.transact("claim", [&](const times& now) -> absl::StatusOr<result> {
      const std::int64_t until = detail::add_ns(now.grant, detail::to_ns(lease));
      // The owner asking again (a lost reply): its job, same fence, lease extended.
      {
        std::int64_t mine = 0;
        {
          detail::sqlite_stmt::use m(select_mine_);
          m.bind(1, queue).bind(2, owner_view);
          const int rc = m.step();
          if (rc == SQLITE_ROW) mine = m.i64(0);
          else if (rc != SQLITE_DONE) return db_.failure(rc, "looking for the owner's job");
        }
        if (mine != 0) {
          detail::sqlite_stmt::use u(extend_mine_);
          u.bind(1, mine).bind(2, until);
          const int rc = u.step();
          if (rc != SQLITE_ROW) return db_.failure(rc, "extending the lease");
          job_claim c = claim_from(u, owner);
          c.lease = detail::from_ns(u.i64(9) - now.check);
          return result(std::move(c));
        }
      }
      if (absl::Status s = expire_queued(queue, now); !s.ok()) return s;
      {
        detail::sqlite_stmt::use f(fail_lapsed_);
        f.bind(1, queue).bind(2, now.check).bind(3, static_cast<std::int64_t>(absl::StatusCode::kDeadlineExceeded));
        f.bind(4, detail::job_lease_lapsed_message);
        if (int rc = f.step(); rc != SQLITE_DONE) return db_.failure(rc, "failing lapsed jobs");
        if (const std::int64_t n = db_.changes(); n > 0) {
          if (absl::Status s = add_depth(queue, -n); !s.ok()) return s;
        }
      }
      std::int64_t pick = 0;
      for (detail::sqlite_stmt* st : {&pick_queued_, &pick_lapsed_}) {
        detail::sqlite_stmt::use p(*st);
        p.bind(1, queue).bind(2, now.check);
        const int rc = p.step();
        if (rc == SQLITE_ROW) pick = pick == 0 ? p.i64(0) : std::min(pick, p.i64(0));
        else if (rc != SQLITE_DONE) return db_.failure(rc, "picking a job");
      }
      if (pick == 0) return result();
      detail::sqlite_stmt::use t(take_);
      t.bind(1, pick).bind(2, owner_view).bind(3, until).bind(4, now.grant);
      const int rc = t.step();
      if (rc != SQLITE_ROW) return db_.failure(rc, "claiming the job");
      job_claim c = claim_from(t, owner);
      c.lease = lease;
      return result(std::move(c));
    });
  }

  [[nodiscard]] absl::Status renew(std::int64_t id, const ownership& token, duration lease) {
    if (absl::Status v = detail::validate_job_id(id); !v.ok()) return v;
    if (absl::Status v = detail::validate_job_lease("renew", lease); !v.ok()) return v;
    const auto ob = token.owner.bytes();
    const std::string_view owner(reinterpret_cast<const char*>(ob.data()), ob.size());
    std::lock_guard lock(mu_);
    return status_of(db_.transact("renew", [&](const times& now) -> absl::StatusOr<job_state> {
      detail::sqlite_stmt::use u(renew_);
      u.bind(1, id).bind(2, owner).bind(3, token.fence).bind(4, detail::add_ns(now.grant, detail::to_ns(lease)));
      if (int rc = u.step(); rc != SQLITE_DONE) return db_.failure(rc, "renewing the lease");
      if (db_.changes() == 1) return job_state::running;
      return diagnose(id, token, "renew", -1);
    }));
  }

  [[nodiscard]] absl::Status complete(std::int64_t id, const ownership& token, std::string_view result) {
    if (absl::Status v = detail::validate_job_id(id); !v.ok()) return v;
    const auto ob = token.owner.bytes();
    const std::string_view owner(reinterpret_cast<const char*>(ob.data()), ob.size());
    std::lock_guard lock(mu_);
    return status_of(db_.transact("complete", [&](const times& now) -> absl::StatusOr<job_state> {
      std::string queue;
      {
        detail::sqlite_stmt::use u(complete_);
        u.bind(1, id).bind(2, owner).bind(3, token.fence).bind(4, result).bind(5, now.grant);
        const int rc = u.step();
        if (rc == SQLITE_DONE) return diagnose(id, token, "complete", done);
        if (rc != SQLITE_ROW) return db_.failure(rc, "completing the job");
        queue = std::string(u.bytes(0));
      }
      if (absl::Status s = add_depth(queue, -1); !s.ok()) return s;
      return job_state::done;
    }));
  }

  [[nodiscard]] absl::StatusOr<job_state> fail(std::int64_t id, const ownership& token, const job_failure& f) {
    if (absl::Status v = detail::validate_job_id(id); !v.ok()) return v;
    if (absl::Status v = f.validate(); !v.ok()) return v;
    std::lock_guard lock(mu_);
    return db_.transact("fail", [&](const times& now) -> absl::StatusOr<job_state> {
      std::int64_t attempts = 0, max_attempts = 0;
      std::string queue;
      {
        detail::sqlite_stmt::use row(select_holder_);
        row.bind(1, id);
        const int rc = row.step();
        if (rc == SQLITE_DONE) return no_job(id, token, "fail");
        if (rc != SQLITE_ROW) return db_.failure(rc, "reading the job");
        const int state = static_cast<int>(row.i64(0));
        const ownership holder{owner_from(row.bytes(1)), row.i64(2)};
        if (state != running || holder != token) {
          if ((state == queued || state == failed) && holder == token)  // a repeat
            return state == queued ? job_state::queued : job_state::failed;
          return lost(id, token, "fail", state, holder);
        }
        attempts = row.i64(3);
        max_attempts = row.i64(4);
        queue = std::string(row.bytes(5));
      }
      const bool final = f.permanent || attempts >= max_attempts;
      detail::sqlite_stmt::use u(final ? fail_final_ : fail_retry_);
      u.bind(1, id).bind(2, final ? now.grant : detail::add_ns(now.grant, detail::to_ns(f.retry_after)));
      u.bind(3, static_cast<std::int64_t>(f.code)).bind(4, f.message);
      if (int rc = u.step(); rc != SQLITE_DONE) return db_.failure(rc, "failing the job");
      if (!final) return job_state::queued;
      if (absl::Status s = add_depth(queue, -1); !s.ok()) return s;
      return job_state::failed;
    });
  }

  [[nodiscard]] absl::StatusOr<std::optional<job_info>> get(std::int64_t id) {
    if (absl::Status v = detail::validate_job_id(id); !v.ok()) return v;
    std::lock_guard lock(mu_);
    detail::sqlite_stmt::use q(get_id_);
    q.bind(1, id).bind(2, detail::store_now_ns(db_.time()));
    return read_info(q);
  }

  [[nodiscard]] absl::StatusOr<std::optional<job_info>> find(const job_key& k) {
    if (absl::Status v = k.validate(); !v.ok()) return v;
    std::lock_guard lock(mu_);
    detail::sqlite_stmt::use q(get_key_);
    q.bind(1, k.queue).bind(2, k.tenant).bind(3, k.key).bind(4, detail::store_now_ns(db_.time()));
    return read_info(q);
  }

  [[nodiscard]] absl::StatusOr<job_counts> counts(std::string_view queue) {
    if (absl::Status v = validate_key("queue", queue); !v.ok()) return v;
    std::lock_guard lock(mu_);
    detail::sqlite_stmt::use q(counts_);
    q.bind(1, queue).bind(2, detail::store_now_ns(db_.time()));
    job_counts c;
    int rc;
    while ((rc = q.step()) == SQLITE_ROW) {
      const std::int64_t n = q.i64(1);
      switch (q.i64(0)) {
        case queued: c.queued = n; break;
        case running: c.running = n; break;
        case done: c.done = n; break;
        case failed: c.failed = n; break;
        case expired: c.expired = n; break;
        default: c.depth = n; break;  // -1: the depth counter
      }
    }
    if (rc != SQLITE_DONE) return db_.failure(rc, "counting jobs");
    return c;
  }

  [[nodiscard]] absl::StatusOr<std::int64_t> purge_finished(std::string_view queue, duration retention) {
    if (absl::Status v = validate_key("queue", queue); !v.ok()) return v;
    if (retention < duration::zero())
      return detail::invalid_field("purge_finished", "retention", "be >= 0", retention);
    std::lock_guard lock(mu_);
    return db_.transact("purge_finished", [&](const times& now) -> absl::StatusOr<std::int64_t> {
      if (absl::Status s = expire_queued(queue, now); !s.ok()) return s;
      detail::sqlite_stmt::use d(purge_);
      d.bind(1, queue).bind(2, detail::add_ns(now.check, -detail::to_ns(retention)));
      if (int rc = d.step(); rc != SQLITE_DONE) return db_.failure(rc, "purging jobs");
      return db_.changes();
    });
  }

 private:
  using times = detail::sqlite_times;
  static constexpr int queued = 0, running = 1, done = 2, failed = 3, expired = 4;

  sqlite_job_store(std::string path, const sqlite_options& o, Time time) : db_(std::move(path), o, std::move(time)) {}

  static job_state effective(int state, std::int64_t expires_at, std::int64_t now) noexcept {
    if (state == queued && expires_at <= now) return job_state::expired;
    return static_cast<job_state>(state);
  }

  static owner_id owner_from(std::string_view b) noexcept {
    std::array<unsigned char, 16> a{};
    if (b.size() == a.size()) std::copy(b.begin(), b.end(), reinterpret_cast<char*>(a.data()));
    return owner_id::from_bytes(a);
  }

  static absl::Status status_of(const absl::StatusOr<job_state>& r) { return r.ok() ? absl::OkStatus() : r.status(); }

  // Columns of claim_columns: id, tenant, key, payload, fence, attempts,
  // max_attempts, took_over, created_at, lease_expires.
  static job_claim claim_from(const detail::sqlite_stmt::use& r, const owner_id& owner) {
    job_claim c;
    c.id = r.i64(0);
    c.tenant = std::string(r.bytes(1));
    c.key = std::string(r.bytes(2));
    c.payload = std::string(r.bytes(3));
    c.ownership = {owner, r.i64(4)};
    c.attempt = static_cast<int>(r.i64(5));
    c.max_attempts = static_cast<int>(r.i64(6));
    c.took_over = r.i64(7) != 0;
    c.created_at_ns = r.i64(8);
    return c;
  }

  // Queued jobs of `queue` past their age become expired (at their
  // deadline); the depth counter follows. Inside a transaction.
  absl::Status expire_queued(std::string_view queue, const times& now) {
    detail::sqlite_stmt::use u(expire_);
    u.bind(1, queue).bind(2, now.check);
    if (int rc = u.step(); rc != SQLITE_DONE) return db_.failure(rc, "expiring jobs");
    if (const std::int64_t n = db_.changes(); n > 0) return add_depth(queue, -n);
    return absl::OkStatus();
  }

  absl::Status add_depth(std::string_view queue, std::int64_t delta) {
    detail::sqlite_stmt::use u(depth_add_);
    u.bind(1, queue).bind(2, delta);
    if (int rc = u.step(); rc != SQLITE_DONE) return db_.failure(rc, "updating the queue depth");
    return absl::OkStatus();
  }

  static std::string_view state_name(int s) noexcept {
    return s >= queued && s <= expired ? to_string(static_cast<job_state>(s)) : std::string_view("unknown");
  }

  static absl::Status no_job(std::int64_t id, const ownership& token, std::string_view op) {
    return lost_ownership_error(
        absl::StrCat(detail::to_absl(op), " of job ", id, " by fence ", token.fence, ": no such job (purged?)"));
  }

  static absl::Status lost(std::int64_t id, const ownership& token, std::string_view op, int state,
                           const ownership& holder) {
    return lost_ownership_error(absl::StrCat(
        detail::to_absl(op), " of job ", id, " by fence ", token.fence, ": the job is ",
        detail::to_absl(state_name(state)), " under fence ", holder.fence,
        holder.fence == token.fence && holder.owner != token.owner ? " and another owner" : ""));
  }

  // After a fenced update changed nothing: a repeat of a done operation (its
  // state) or lost ownership.
  absl::StatusOr<job_state> diagnose(std::int64_t id, const ownership& token, std::string_view op, int done_state) {
    detail::sqlite_stmt::use row(select_holder_);
    row.bind(1, id);
    const int rc = row.step();
    if (rc == SQLITE_DONE) return no_job(id, token, op);
    if (rc != SQLITE_ROW) return db_.failure(rc, "reading the job");
    const int state = static_cast<int>(row.i64(0));
    const ownership holder{owner_from(row.bytes(1)), row.i64(2)};
    if (state == done_state && holder == token) return static_cast<job_state>(state);  // a repeat
    return lost(id, token, op, state, holder);
  }

  // Columns of info_columns, then the store's now.
  absl::StatusOr<std::optional<job_info>> read_info(detail::sqlite_stmt::use& q) {
    const int rc = q.step();
    if (rc == SQLITE_DONE) return std::optional<job_info>();
    if (rc != SQLITE_ROW) return db_.failure(rc, "reading the job");
    job_info j;
    j.id = q.i64(0);
    j.queue = std::string(q.bytes(1));
    j.tenant = std::string(q.bytes(2));
    j.key = std::string(q.bytes(3));
    const std::string_view d = q.bytes(4);
    if (d.size() == j.payload_digest.bytes.size()) std::copy(d.begin(), d.end(), j.payload_digest.bytes.begin());
    j.payload = std::string(q.bytes(5));
    const int state = static_cast<int>(q.i64(6));
    j.attempts = static_cast<int>(q.i64(7));
    j.max_attempts = static_cast<int>(q.i64(8));
    j.fence = q.i64(9);
    const std::int64_t lease_expires = q.i64(10);
    j.took_over = q.i64(11) != 0;
    j.created_at_ns = q.i64(12);
    j.expires_at_ns = q.i64(13);
    j.available_at_ns = q.i64(14);
    j.started_at_ns = q.i64(15);
    j.finished_at_ns = q.i64(16);
    if (!q.is_null(17)) j.result = std::string(q.bytes(17));
    j.error_code = static_cast<absl::StatusCode>(q.i64(18));
    if (!q.is_null(19)) j.error_message = std::string(q.bytes(19));
    const std::int64_t now = q.i64(20);
    j.state = effective(state, j.expires_at_ns, now);
    if (j.state == job_state::expired && state == queued) j.finished_at_ns = j.expires_at_ns;
    if (j.state == job_state::running && lease_expires > now) j.lease_remaining = detail::from_ns(lease_expires - now);
    return std::optional<job_info>(std::move(j));
  }

  absl::Status connect() {
    if (absl::Status s = db_.connect(); !s.ok()) return s;
    if (absl::Status s = ensure_tables(); !s.ok()) return s;
    return prepare_all();
  }

  // Adds the job tables to a keel file that lacks them, or checks their
  // version; under the write lock, so processes opening together agree.
  absl::Status ensure_tables() {
    if (absl::Status s = db_.exec("BEGIN IMMEDIATE", "creating the job tables"); !s.ok()) return s;
    absl::Status s = [&]() -> absl::Status {
      int present = 0;
      {
        detail::sqlite_stmt q;
        if (absl::Status p = db_.prepare(q,
                                         "SELECT count(*) FROM sqlite_schema WHERE type = 'table' AND name IN"
                                         " ('keel_job_schema', 'keel_job', 'keel_job_depth')");
            !p.ok())
          return p;
        detail::sqlite_stmt::use u(q);
        if (int rc = u.step(); rc != SQLITE_ROW) return db_.open_error(rc, "reading the schema");
        present = static_cast<int>(u.i64(0));
      }
      if (present == 0) {
        return db_.exec(
            "CREATE TABLE keel_job_schema(id INTEGER PRIMARY KEY CHECK (id = 0), version INTEGER NOT NULL);"
            "INSERT INTO keel_job_schema VALUES (0, 1);"
            "CREATE TABLE keel_job("
            "  id INTEGER PRIMARY KEY AUTOINCREMENT,"
            "  queue BLOB NOT NULL, tenant BLOB NOT NULL, key BLOB NOT NULL, digest BLOB NOT NULL,"
            "  payload BLOB NOT NULL, state INTEGER NOT NULL, attempts INTEGER NOT NULL,"
            "  max_attempts INTEGER NOT NULL, owner BLOB, fence INTEGER NOT NULL,"
            "  lease_expires INTEGER NOT NULL, took_over INTEGER NOT NULL, created_at INTEGER NOT NULL,"
            "  expires_at INTEGER NOT NULL, available_at INTEGER NOT NULL, started_at INTEGER NOT NULL,"
            "  finished_at INTEGER NOT NULL, result BLOB, error_code INTEGER NOT NULL, error_message BLOB,"
            "  UNIQUE (queue, tenant, key));"
            // Claim order, age expiry, lapsed leases, a re-claim by the owner, purge.
            "CREATE INDEX keel_job_queued ON keel_job(queue, id) WHERE state = 0;"
            "CREATE INDEX keel_job_aging ON keel_job(queue, expires_at) WHERE state = 0;"
            "CREATE INDEX keel_job_running ON keel_job(queue, lease_expires) WHERE state = 1;"
            "CREATE INDEX keel_job_owner ON keel_job(owner) WHERE state = 1;"
            "CREATE INDEX keel_job_finished ON keel_job(queue, finished_at) WHERE state >= 2;"
            "CREATE TABLE keel_job_depth(queue BLOB PRIMARY KEY, live INTEGER NOT NULL) WITHOUT ROWID;",
            "creating the job tables");
      }
      if (present != 3)
        return absl::FailedPreconditionError(absl::StrCat("keel: sqlite store '", db_.path(),
                                                          "' has a damaged set of job tables (", present,
                                                          " of 3); refusing to change it"));
      detail::sqlite_stmt q;
      if (absl::Status p = db_.prepare(q, "SELECT version FROM keel_job_schema WHERE id = 0"); !p.ok()) return p;
      detail::sqlite_stmt::use u(q);
      const int rc = u.step();
      if (rc != SQLITE_ROW && rc != SQLITE_DONE) return db_.open_error(rc, "reading the job schema version");
      const std::int64_t version = rc == SQLITE_ROW ? u.i64(0) : 0;
      if (version != sqlite_jobs_schema_version)
        return absl::FailedPreconditionError(absl::StrCat("keel: sqlite store '", db_.path(),
                                                          "' has job tables of version ", version, "; this keel reads version ",
                                                          sqlite_jobs_schema_version, " only; refusing to change it"));
      return absl::OkStatus();
    }();
    static_assert(sqlite_jobs_schema_version == 1);
    if (!s.ok()) {
      db_.rollback();
      return s;
    }
    return db_.exec("COMMIT", "creating the job tables");
  }

  absl::Status prepare_all() {
    // Returned by claim (claim_from) and by read_info.
    constexpr std::string_view claim_columns =
        " id, tenant, key, payload, fence, attempts, max_attempts, took_over, created_at, lease_expires";
    constexpr std::string_view info_columns =
        " id, queue, tenant, key, digest, payload, state, attempts, max_attempts, fence, lease_expires, took_over,"
        " created_at, expires_at, available_at, started_at, finished_at, result, error_code, error_message";
    // The store's now for a read outside a transaction: never below the high-water mark.
    auto read_now = [](int param) {
      return absl::StrCat("max(?", param, ", (SELECT high_water FROM keel_clock WHERE id = 0))");
    };
    struct item {
      detail::sqlite_stmt* st;
      std::string sql;
    };
    const item items[] = {
        {&select_key_,
         "SELECT id, digest, state, attempts, expires_at FROM keel_job WHERE queue = ?1 AND tenant = ?2 AND key = ?3"},
        {&expire_,
         "UPDATE keel_job SET state = 4, finished_at = expires_at WHERE queue = ?1 AND state = 0 AND expires_at <= ?2"},
        {&depth_read_, "SELECT live FROM keel_job_depth WHERE queue = ?1"},
        {&depth_add_,
         "INSERT INTO keel_job_depth(queue, live) VALUES (?1, ?2)"
         " ON CONFLICT (queue) DO UPDATE SET live = live + excluded.live"},
        {&insert_,
         "INSERT INTO keel_job(queue, tenant, key, digest, payload, state, attempts, max_attempts, owner, fence,"
         " lease_expires, took_over, created_at, expires_at, available_at, started_at, finished_at, error_code)"
         " VALUES (?1, ?2, ?3, ?4, ?5, 0, 0, ?6, NULL, 0, 0, 0, ?7, ?8, ?7, 0, 0, 0) RETURNING id"},
        {&select_mine_, "SELECT id FROM keel_job WHERE owner = ?2 AND state = 1 AND queue = ?1 ORDER BY id LIMIT 1"},
        {&extend_mine_,
         absl::StrCat("UPDATE keel_job SET lease_expires = max(lease_expires, ?2) WHERE id = ?1 RETURNING",
                      detail::to_absl(claim_columns))},
        {&fail_lapsed_,
         "UPDATE keel_job SET state = 3, finished_at = ?2, error_code = ?3, error_message = ?4"
         " WHERE queue = ?1 AND state = 1 AND lease_expires <= ?2 AND attempts >= max_attempts"},
        {&pick_queued_,
         "SELECT id FROM keel_job WHERE queue = ?1 AND state = 0 AND available_at <= ?2 AND expires_at > ?2"
         " ORDER BY id LIMIT 1"},
        {&pick_lapsed_, "SELECT id FROM keel_job WHERE queue = ?1 AND state = 1 AND lease_expires <= ?2 ORDER BY id LIMIT 1"},
        {&take_,
         absl::StrCat("UPDATE keel_job SET took_over = (state = 1), state = 1, owner = ?2, fence = fence + 1,"
                      " attempts = attempts + 1, lease_expires = ?3, started_at = ?4 WHERE id = ?1 RETURNING",
                      detail::to_absl(claim_columns))},
        {&renew_,
         "UPDATE keel_job SET lease_expires = max(lease_expires, ?4)"
         " WHERE id = ?1 AND state = 1 AND owner = ?2 AND fence = ?3"},
        {&complete_,
         "UPDATE keel_job SET state = 2, result = ?4, finished_at = ?5"
         " WHERE id = ?1 AND state = 1 AND owner = ?2 AND fence = ?3 RETURNING queue"},
        {&select_holder_, "SELECT state, owner, fence, attempts, max_attempts, queue FROM keel_job WHERE id = ?1"},
        {&fail_final_, "UPDATE keel_job SET state = 3, finished_at = ?2, error_code = ?3, error_message = ?4 WHERE id = ?1"},
        {&fail_retry_, "UPDATE keel_job SET state = 0, available_at = ?2, error_code = ?3, error_message = ?4 WHERE id = ?1"},
        {&get_id_, absl::StrCat("SELECT", detail::to_absl(info_columns), ", ", read_now(2), " FROM keel_job WHERE id = ?1")},
        {&get_key_, absl::StrCat("SELECT", detail::to_absl(info_columns), ", ", read_now(4),
                                 " FROM keel_job WHERE queue = ?1 AND tenant = ?2 AND key = ?3")},
        {&counts_, absl::StrCat("SELECT s, count(*) FROM (SELECT CASE WHEN state = 0 AND expires_at <= ", read_now(2),
                                " THEN 4 ELSE state END AS s FROM keel_job WHERE queue = ?1) GROUP BY s"
                                " UNION ALL SELECT -1, live FROM keel_job_depth WHERE queue = ?1")},
        {&purge_, "DELETE FROM keel_job WHERE queue = ?1 AND state >= 2 AND finished_at <= ?2"},
    };
    for (const item& i : items) {
      if (absl::Status s = db_.prepare(*i.st, i.sql.c_str()); !s.ok()) return s;
    }
    return absl::OkStatus();
  }

  std::mutex mu_;
  detail::sqlite_db<Time> db_;
  // Declared after db_: finalized before the connection closes.
  detail::sqlite_stmt select_key_, expire_, depth_read_, depth_add_, insert_;
  detail::sqlite_stmt select_mine_, extend_mine_, fail_lapsed_, pick_queued_, pick_lapsed_, take_;
  detail::sqlite_stmt renew_, complete_, select_holder_, fail_final_, fail_retry_;
  detail::sqlite_stmt get_id_, get_key_, counts_, purge_;
};

static_assert(job_store<sqlite_job_store<>>);

}  // namespace keel
