// keel/store/postgres_jobs.hpp — the durable batch job queue in PostgreSQL,
// shared by every replica of a service. Link keel::postgres.
//
// keel::postgres_job_store implements keel::job_store (keel/durable/job_store.hpp
// has the contract), on the connection pool and statement conventions of
// keel::postgres_store (keel/store/postgres.hpp, keel/store/internal/pg_connection.hpp):
//
//   - every submit, claim, renew, complete, fail and purge is ONE statement
//     under READ COMMITTED, with no explicit transaction, and one round trip.
//     claim picks the oldest due job with SELECT ... ORDER BY id LIMIT 1
//     FOR UPDATE SKIP LOCKED and updates it in the same statement, so
//     concurrent claimers (threads, processes, replicas) never get the same
//     job and never wait for each other. A statement that finds its row
//     changed under it (a concurrent first submit of the same key, a takeover
//     racing a re-claim) changed nothing and is sent again: a second round
//     trip, only under that race;
//   - the depth bound is exact: each queue's live-job count is a row
//     upserted as the last step of every statement that moves a job in or
//     out of queued/running, and a submit that would take it past max_depth
//     raises inside the statement, so its insert is rolled back with it
//     (concurrent submitters queue on that row for the length of a statement);
//   - time is the database server's clock (clock_timestamp()), never the
//     client's; a test-only offset (postgres_options::testing_clock_offset)
//     is added inside the statements;
//   - job ids: a sequence (GENERATED ALWAYS AS IDENTITY) by default, which an
//     asynchronous failover can hand out again; with options.job_ids =
//     postgres_job_ids::from_clock, the server's clock (µs << 10, with a
//     sequence's low bits, above the highest id), which it does not unless
//     the promoted server's clock is behind (docs/scaleout.md, "Failover").
//     Chosen when the tables are created; an existing table keeps its kind;
//   - its own versioned tables (job_meta, job, job_depth and the function
//     job_queue_full) in the PostgreSQL schema options.schema, created on
//     first open under the same advisory lock as postgres_store. Give the
//     job store a schema of its own (e.g. "keel_jobs"): a schema holding
//     other tables, or job tables of another version, is refused untouched.
//
// Errors: as keel::postgres_store — keel::store_unavailable_error (cannot
// connect, pool busy, a statement rolled back: nothing applied),
// keel::unknown_outcome_error for a write whose connection dropped or timed
// out (repeat it: repeats with the same ownership are safe, and a claim
// repeated with the same owner returns the job it may have taken).
//
// Example:
//
//   absl::StatusOr<std::unique_ptr<keel::postgres_job_store>> jobs = keel::postgres_job_store::open(
//       {.conninfo = "host=db.internal dbname=inference user=svc", .schema = "keel_jobs", .pool_size = 8});
//   if (!jobs.ok()) return jobs.status();
//   keel::job_queue reports(**jobs, {.queue = "reports", .max_depth = 500});
//
// Thread-safety: every operation may be called from any number of threads;
// at most pool_size statements run at once. Do not carry a store across
// fork(): open a new one in the child.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "keel/core/clock.hpp"
#include "keel/core/status.hpp"
#include "keel/store/internal/client_pool.hpp"
#include "keel/store/internal/pg_connection.hpp"
#include "keel/store/internal/pg_store.hpp"
#include "keel/durable/digest.hpp"
#include "keel/durable/job_store.hpp"
#include "keel/durable/ownership.hpp"
#include "keel/store/postgres.hpp"

namespace keel {

// The version of the job tables this keel reads and writes (table job_meta).
inline constexpr int postgres_jobs_schema_version = 1;

namespace detail {

// Statements in the notation of pg_sql::make: $S the schema, CLOCK the
// statement's one reading of the server clock, NOW that reading.
struct pg_job_sql {
  // Queued jobs of queue $1 past their age become expired (at their
  // deadline). Rows another statement holds are skipped: it is handling them.
  static constexpr const char* expire_cte =
      "expired AS (UPDATE $S.job j SET state = 4, finished_at = j.expires_at WHERE j.id IN ("
      " SELECT x.id FROM $S.job x WHERE x.queue = $1 AND x.state = 0 AND x.expires_at <= NOW%s"
      " FOR UPDATE SKIP LOCKED) RETURNING 1)";

  // $1 queue $2 tenant $3 key $4 digest $5 payload $6 max_attempts $7 max_age $8 max_depth $9 offset
  // Answers (k, id, digest, state, attempts, expires_at - now): k = 0 created, k = 1 existing; no row: raced
  // (a concurrent first submit of the key, or, with clock ids, a concurrent
  // submit that drew the same id: ON CONFLICT without a target covers both).
  static constexpr const char* submit =
      "WITH CLOCK,"
      " existing AS (SELECT j.id, j.digest, j.state, j.attempts, j.expires_at FROM $S.job j"
      "  WHERE j.queue = $1 AND j.tenant = $2 AND j.key = $3),"
      " EXPIRE,"
      " ins AS (INSERT INTO $S.job (queue, tenant, key, digest, payload, state, attempts, max_attempts, owner, fence,"
      "  lease_expires, took_over, created_at, expires_at, available_at, started_at, finished_at, error_code)"
      "  SELECT $1, $2, $3, $4, $5, 0, 0, $6, NULL, 0, 0, false, clk.now, clk.now + $7, clk.now, 0, 0, 0 FROM clk"
      "  WHERE NOT EXISTS (SELECT 1 FROM existing)"
      "  ON CONFLICT DO NOTHING RETURNING id),"
      " depth AS (INSERT INTO $S.job_depth AS d (queue, live)"
      "  SELECT $1, (SELECT count(*) FROM ins) - (SELECT count(*) FROM expired)"
      "  WHERE EXISTS (SELECT 1 FROM ins) OR EXISTS (SELECT 1 FROM expired)"
      "  ON CONFLICT (queue) DO UPDATE SET live = d.live + excluded.live RETURNING d.live)"
      " SELECT 0::int4, ins.id, NULL::bytea, 0::int8, 0::int8,"
      "  CASE WHEN (SELECT live FROM depth) > $8 THEN $S.job_queue_full((SELECT live FROM depth) - 1, $8)"
      "  ELSE 0::int8 END FROM ins"
      " UNION ALL"
      " SELECT 1, e.id, e.digest, e.state::int8, e.attempts, e.expires_at - NOW FROM existing e";

  // $1 queue $2 owner $3 lease $4 lapsed error code $5 lapsed message $6 offset
  // Answers (k, id, tenant, key, payload, fence, attempts, max_attempts,
  // took_over, created_at, lease left): k = 0 taken, 1 the owner's own job
  // again; k = 2: the owner's job changed under the statement (raced); no row: nothing eligible.
  static constexpr const char* claim =
      "WITH CLOCK,"
      " mine AS MATERIALIZED (SELECT j.id FROM $S.job j WHERE j.owner = $2 AND j.state = 1 AND j.queue = $1"
      "  ORDER BY j.id LIMIT 1),"
      " re AS (UPDATE $S.job j SET lease_expires = greatest(j.lease_expires, NOW + $3) FROM mine"
      "  WHERE j.id = mine.id AND j.owner = $2 AND j.state = 1"
      "  RETURNING j.id, j.tenant, j.key, j.payload, j.fence, j.attempts, j.max_attempts, j.took_over, j.created_at,"
      "   j.lease_expires - NOW AS left_ns),"
      " EXPIRE,"
      " lapsed AS (UPDATE $S.job j SET state = 3, finished_at = NOW, error_code = $4, error_message = $5"
      "  WHERE j.id IN (SELECT x.id FROM $S.job x WHERE x.queue = $1 AND x.state = 1 AND x.lease_expires <= NOW"
      "   AND x.attempts >= x.max_attempts AND NOT EXISTS (SELECT 1 FROM mine) FOR UPDATE SKIP LOCKED) RETURNING 1),"
      " pq AS (SELECT x.id FROM $S.job x WHERE x.queue = $1 AND x.state = 0 AND x.available_at <= NOW"
      "  AND x.expires_at > NOW AND NOT EXISTS (SELECT 1 FROM mine) ORDER BY x.id LIMIT 1 FOR UPDATE SKIP LOCKED),"
      " pl AS (SELECT x.id FROM $S.job x WHERE x.queue = $1 AND x.state = 1 AND x.lease_expires <= NOW"
      "  AND x.attempts < x.max_attempts AND NOT EXISTS (SELECT 1 FROM mine)"
      "  ORDER BY x.id LIMIT 1 FOR UPDATE SKIP LOCKED),"
      " pick AS (SELECT min(u.id) AS id FROM (SELECT id FROM pq UNION ALL SELECT id FROM pl) u),"
      " take AS (UPDATE $S.job j SET took_over = (j.state = 1), state = 1, owner = $2, fence = j.fence + 1,"
      "  attempts = j.attempts + 1, lease_expires = NOW + $3, started_at = NOW FROM pick WHERE j.id = pick.id"
      "  RETURNING j.id, j.tenant, j.key, j.payload, j.fence, j.attempts, j.max_attempts, j.took_over, j.created_at,"
      "   $3 AS left_ns),"
      " depth AS (UPDATE $S.job_depth d SET live = d.live - (SELECT count(*) FROM expired) - (SELECT count(*) FROM lapsed)"
      "  WHERE d.queue = $1 AND (SELECT count(*) FROM expired) + (SELECT count(*) FROM lapsed) > 0 RETURNING 1)"
      " SELECT 0::int4, t.* FROM take t"
      " UNION ALL SELECT 1, r.* FROM re r"
      " UNION ALL SELECT 2, m.id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM mine m"
      "  WHERE NOT EXISTS (SELECT 1 FROM re)";

  // The fenced writes answer (k, state, same owner, fence): k = 0 applied
  // (state: the state it went to), k = 1 not applied, with the row as the
  // statement's snapshot saw it; no row: no such job.
  static constexpr const char* fenced_tail =
      " SELECT 0::int4, u.state::int8, NULL::bool, NULL::int8 FROM up u"
      " UNION ALL"
      " SELECT 1, j.state::int8, j.owner IS NOT DISTINCT FROM $2, j.fence FROM $S.job j"
      "  WHERE j.id = $1 AND NOT EXISTS (SELECT 1 FROM up)";
  static constexpr const char* holder = " WHERE j.id = $1 AND j.state = 1 AND j.owner = $2 AND j.fence = $3";

  // $1 id $2 owner $3 fence $4 lease $5 offset
  static constexpr const char* renew_head =
      "WITH CLOCK, up AS (UPDATE $S.job j SET lease_expires = greatest(j.lease_expires, NOW + $4)";
  static constexpr const char* renew_returning = " RETURNING j.state)";
  // $1 id $2 owner $3 fence $4 result $5 offset
  static constexpr const char* complete_head =
      "WITH CLOCK, up AS (UPDATE $S.job j SET state = 2, result = $4, finished_at = NOW";
  // $1 id $2 owner $3 fence $4 code $5 message $6 permanent (0/1) $7 retry_after $8 offset
  static constexpr const char* fail_head =
      "WITH CLOCK, up AS (UPDATE $S.job j SET"
      " state = CASE WHEN $6 <> 0 OR j.attempts >= j.max_attempts THEN 3 ELSE 0 END,"
      " finished_at = CASE WHEN $6 <> 0 OR j.attempts >= j.max_attempts THEN NOW ELSE 0 END,"
      " available_at = CASE WHEN $6 <> 0 OR j.attempts >= j.max_attempts THEN j.available_at ELSE NOW + $7 END,"
      " error_code = $4, error_message = $5";
  // complete and fail: the job leaves the live set when it finishes.
  static constexpr const char* finishing_returning =
      " RETURNING j.queue, j.state),"
      " depth AS (UPDATE $S.job_depth d SET live = d.live - 1 FROM up WHERE d.queue = up.queue AND up.state >= 2"
      "  RETURNING 1)";

  static constexpr const char* info_columns =
      " j.id, j.queue, j.tenant, j.key, j.digest, j.payload, j.state::int8, j.attempts, j.max_attempts, j.fence,"
      " j.lease_expires, j.took_over, j.created_at, j.expires_at, j.available_at, j.started_at, j.finished_at,"
      " j.result, j.error_code, j.error_message, clk.now";
  // $1 id $2 offset
  static constexpr const char* get_tail = " FROM $S.job j, clk WHERE j.id = $1";
  // $1 queue $2 tenant $3 key $4 offset
  static constexpr const char* find_tail = " FROM $S.job j, clk WHERE j.queue = $1 AND j.tenant = $2 AND j.key = $3";
  // $1 queue $2 offset
  static constexpr const char* counts =
      "WITH CLOCK SELECT u.s::int8, count(*) FROM (SELECT CASE WHEN j.state = 0 AND j.expires_at <= NOW THEN 4"
      " ELSE j.state END AS s FROM $S.job j WHERE j.queue = $1) u GROUP BY u.s"
      " UNION ALL SELECT -1, d.live FROM $S.job_depth d WHERE d.queue = $1";
  // $1 queue $2 retention $3 offset. Queued jobs that expired more than
  // `retention` ago are deleted at once; more recent ones are marked.
  static constexpr const char* purge =
      "WITH CLOCK, EXPIRE,"
      " gone AS (DELETE FROM $S.job j WHERE j.id IN (SELECT x.id FROM $S.job x WHERE x.queue = $1"
      "  AND ((x.state >= 2 AND x.finished_at <= NOW - $2) OR (x.state = 0 AND x.expires_at <= NOW - $2))"
      "  FOR UPDATE SKIP LOCKED) RETURNING j.state),"
      " depth AS (UPDATE $S.job_depth d SET live = d.live - (SELECT count(*) FROM expired)"
      "  - (SELECT count(*) FROM gone g WHERE g.state = 0)"
      "  WHERE d.queue = $1 AND (SELECT count(*) FROM expired) + (SELECT count(*) FROM gone g WHERE g.state = 0) > 0"
      "  RETURNING 1)"
      " SELECT count(*) FROM gone";

  // Fills in the expiry CTE (`extra` narrows its rows) and then pg_sql's notation.
  static std::string make(std::string_view text, const std::string& schema, int offset_param,
                          std::string_view extra = {}) {
    std::string expire = expire_cte;
    expire.replace(expire.find("%s"), 2, std::string(extra));
    const std::string filled = absl::StrReplaceAll(to_absl(text), {{"EXPIRE", expire}});
    return pg_sql::make(filled, schema, offset_param);
  }
};

inline constexpr const char* pg_job_submit = "keel_job_submit";
inline constexpr const char* pg_job_claim = "keel_job_claim";
inline constexpr const char* pg_job_renew = "keel_job_renew";
inline constexpr const char* pg_job_complete = "keel_job_complete";
inline constexpr const char* pg_job_fail = "keel_job_fail";
inline constexpr const char* pg_job_get = "keel_job_get";
inline constexpr const char* pg_job_find = "keel_job_find";
inline constexpr const char* pg_job_counts = "keel_job_counts";
inline constexpr const char* pg_job_purge = "keel_job_purge";

// SQLSTATE raised by job_queue_full() inside a submit.
inline constexpr std::string_view pg_job_full_sqlstate = "KJ001";

// postgres_job_ids::from_clock: the job table's id default, added after the
// table (the function reads it). An id is the server's time in microseconds
// since 2020-01-01 (1577836800 s) shifted left 10 bits, with the low 10 bits
// of a sequence, so submits of one microsecond differ; and at least the
// highest id in the table + 1, so ids strictly increase on one primary even
// if its clock steps back, and are > 0 even on a clock before 2020. Inside
// int8 until 2^53 µs after 2020 (the year 2305). Two concurrent submits that
// draw the same id (1024 sequence values apart within one microsecond, or
// both past a clock step) do not fail: the second's insert does nothing
// (ON CONFLICT without a target) and the submit is sent again.
// `schema` is quoted (and validated to [a-z_][a-z0-9_]*: no quote inside).
inline std::vector<std::string> pg_job_clock_ids_ddl(const std::string& schema) {
  return {
      absl::StrCat("CREATE SEQUENCE ", schema, ".job_id_low"),
      absl::StrCat("CREATE FUNCTION ", schema, ".job_clock_id() RETURNS int8 LANGUAGE sql VOLATILE AS $f$",
                   " SELECT greatest(coalesce((SELECT max(id) FROM ", schema, ".job), 0) + 1,",
                   " (((extract(epoch FROM clock_timestamp()) * 1000000)::int8 - 1577836800000000) << 10)",
                   " | (nextval('", schema, ".job_id_low') & 1023)) $f$"),
      absl::StrCat("ALTER TABLE ", schema, ".job ALTER COLUMN id SET DEFAULT ", schema, ".job_clock_id()"),
  };
}

}  // namespace detail

class postgres_job_store {
 public:
  // Connects, checks (and if allowed creates) the job tables in
  // options.schema, and keeps the connection for the pool. Errors as
  // keel::postgres_store::open.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<postgres_job_store>> open(postgres_options o) {
    if (absl::Status v = o.validate(); !v.ok()) return v;
    std::unique_ptr<postgres_job_store> s(new postgres_job_store(std::move(o)));
    if (absl::Status st = s->initialise(); !st.ok()) return st;
    return s;
  }

  postgres_job_store(const postgres_job_store&) = delete;
  postgres_job_store& operator=(const postgres_job_store&) = delete;
  ~postgres_job_store() = default;

  [[nodiscard]] const postgres_options& options() const noexcept { return options_; }
  // How the job table numbers new jobs: what it was created with, which an
  // existing table keeps whatever options.job_ids says (from_clock on a table
  // of sequential ids is refused at open).
  [[nodiscard]] postgres_job_ids job_ids() const noexcept { return job_ids_; }
  // Statements sent for operations (each one round trip).
  [[nodiscard]] std::uint64_t round_trips() const noexcept { return round_trips_.load(std::memory_order_relaxed); }

  [[nodiscard]] absl::StatusOr<job_submission> submit(const job_key& k, const digest& payload_digest,
                                                      std::string_view payload, const job_limits& limits) {
    if (absl::Status v = k.validate(); !v.ok()) return v;
    if (absl::Status v = limits.validate(); !v.ok()) return v;
    detail::pg_params<9> p;
    p.add(k.queue).add(k.tenant).add(k.key).add(payload_digest.view()).add(payload);
    p.add(static_cast<std::int64_t>(limits.max_attempts)).add(detail::pg_ns(limits.max_age)).add(limits.max_depth);
    p.add(offset());
    for (int attempt = 0; attempt < max_races; ++attempt) {
      absl::StatusOr<detail::pg_result> r = run(detail::pg_job_submit, p, detail::pg_effect::write);
      if (!r.ok()) {
        if (is_full(r.status())) {
          std::int64_t live = limits.max_depth;
          const std::string_view m = detail::to_std(r.status().message());
          if (const std::size_t at = m.find("queue full: "); at != std::string_view::npos) {
            const std::string_view rest = m.substr(at + 12);
            (void)absl::SimpleAtoi(detail::to_absl(rest.substr(0, rest.find(' '))), &live);
          }
          return job_queue_full_error(k.queue, live, limits.max_depth, limits.overload_retry_after);
        }
        return r.status();
      }
      if (r->rows() == 0) continue;  // a concurrent first submit of this key: look again
      const detail::pg_result& x = *r;
      const std::int64_t id = x.integer(0, 1);
      if (x.integer(0, 0) == 0) return job_submission{.id = id, .created = true, .state = job_state::queued};
      if (x.bytes(0, 2) != payload_digest.view())
        return conflict_error(absl::StrCat("job key '", detail::to_absl(k.key), "' of tenant '",
                                           detail::to_absl(k.tenant), "' in queue '", detail::to_absl(k.queue),
                                           "' was submitted with another payload (job ", id, ")"));
      const std::int64_t state = x.integer(0, 3);
      return job_submission{.id = id,
                            .created = false,
                            .state = state == queued && x.integer(0, 5) <= 0 ? job_state::expired
                                                                             : static_cast<job_state>(state),
                            .attempts = static_cast<int>(x.integer(0, 4))};
    }
    return raced("submit");
  }

  [[nodiscard]] absl::StatusOr<std::optional<job_claim>> claim(std::string_view queue, const owner_id& owner,
                                                               duration lease) {
    if (absl::Status v = validate_key("queue", queue); !v.ok()) return v;
    if (absl::Status v = detail::validate_job_lease("claim", lease); !v.ok()) return v;
    if (owner.is_nil()) return absl::InvalidArgumentError("keel: owner must not be nil");
    detail::pg_params<6> p;
    p.add(queue).add(owner).add(detail::pg_ns(lease));
    p.add(static_cast<std::int64_t>(absl::StatusCode::kDeadlineExceeded)).add(detail::job_lease_lapsed_message);
    p.add(offset());
    for (int attempt = 0; attempt < max_races; ++attempt) {
      absl::StatusOr<detail::pg_result> r = run(detail::pg_job_claim, p, detail::pg_effect::write);
      if (!r.ok()) return r.status();
      if (r->rows() == 0) return std::optional<job_claim>();
      const detail::pg_result& x = *r;
      if (x.integer(0, 0) == 2) continue;  // the owner's job changed under us
      job_claim c;
      c.id = x.integer(0, 1);
      c.tenant = std::string(x.bytes(0, 2));
      c.key = std::string(x.bytes(0, 3));
      c.payload = std::string(x.bytes(0, 4));
      c.ownership = {owner, x.integer(0, 5)};
      c.attempt = static_cast<int>(x.integer(0, 6));
      c.max_attempts = static_cast<int>(x.integer(0, 7));
      c.took_over = x.integer(0, 8) != 0;
      c.created_at_ns = x.integer(0, 9);
      c.lease = x.integer(0, 0) == 0 ? lease : detail::from_ns(x.integer(0, 10));
      return std::optional<job_claim>(std::move(c));
    }
    return raced("claim");
  }

  [[nodiscard]] absl::Status renew(std::int64_t id, const ownership& token, duration lease) {
    if (absl::Status v = detail::validate_job_id(id); !v.ok()) return v;
    if (absl::Status v = detail::validate_job_lease("renew", lease); !v.ok()) return v;
    detail::pg_params<5> p;
    p.add(id).add(token.owner).add(token.fence).add(detail::pg_ns(lease)).add(offset());
    absl::StatusOr<job_state> r = fenced(detail::pg_job_renew, p, id, token, "renew", {});
    return r.ok() ? absl::OkStatus() : r.status();
  }

  [[nodiscard]] absl::Status complete(std::int64_t id, const ownership& token, std::string_view result) {
    if (absl::Status v = detail::validate_job_id(id); !v.ok()) return v;
    detail::pg_params<5> p;
    p.add(id).add(token.owner).add(token.fence).add(result).add(offset());
    absl::StatusOr<job_state> r = fenced(detail::pg_job_complete, p, id, token, "complete", {done});
    return r.ok() ? absl::OkStatus() : r.status();
  }

  [[nodiscard]] absl::StatusOr<job_state> fail(std::int64_t id, const ownership& token, const job_failure& f) {
    if (absl::Status v = detail::validate_job_id(id); !v.ok()) return v;
    if (absl::Status v = f.validate(); !v.ok()) return v;
    detail::pg_params<8> p;
    p.add(id).add(token.owner).add(token.fence).add(static_cast<std::int64_t>(f.code)).add(f.message);
    p.add(std::int64_t{f.permanent ? 1 : 0}).add(detail::pg_ns(f.retry_after)).add(offset());
    return fenced(detail::pg_job_fail, p, id, token, "fail", {queued, failed});
  }

  [[nodiscard]] absl::StatusOr<std::optional<job_info>> get(std::int64_t id) {
    if (absl::Status v = detail::validate_job_id(id); !v.ok()) return v;
    detail::pg_params<2> p;
    p.add(id).add(offset());
    return read_info(detail::pg_job_get, p);
  }

  [[nodiscard]] absl::StatusOr<std::optional<job_info>> find(const job_key& k) {
    if (absl::Status v = k.validate(); !v.ok()) return v;
    detail::pg_params<4> p;
    p.add(k.queue).add(k.tenant).add(k.key).add(offset());
    return read_info(detail::pg_job_find, p);
  }

  [[nodiscard]] absl::StatusOr<job_counts> counts(std::string_view queue) {
    if (absl::Status v = validate_key("queue", queue); !v.ok()) return v;
    detail::pg_params<2> p;
    p.add(queue).add(offset());
    absl::StatusOr<detail::pg_result> r = run(detail::pg_job_counts, p, detail::pg_effect::read);
    if (!r.ok()) return r.status();
    job_counts c;
    for (int i = 0; i < r->rows(); ++i) {
      const std::int64_t n = r->integer(i, 1);
      switch (r->integer(i, 0)) {
        case queued: c.queued = n; break;
        case running: c.running = n; break;
        case done: c.done = n; break;
        case failed: c.failed = n; break;
        case expired: c.expired = n; break;
        default: c.depth = n; break;  // -1: the depth counter
      }
    }
    return c;
  }

  [[nodiscard]] absl::StatusOr<std::int64_t> purge_finished(std::string_view queue, duration retention) {
    if (absl::Status v = validate_key("queue", queue); !v.ok()) return v;
    if (retention < duration::zero())
      return detail::invalid_field("purge_finished", "retention", "be >= 0", retention);
    detail::pg_params<3> p;
    p.add(queue).add(detail::pg_ns(retention)).add(offset());
    absl::StatusOr<detail::pg_result> r = run(detail::pg_job_purge, p, detail::pg_effect::write);
    if (!r.ok()) return r.status();
    return r->integer(0, 0);
  }

 private:
  static constexpr std::int64_t queued = 0, running = 1, done = 2, failed = 3, expired = 4;
  static constexpr int max_races = 8;

  explicit postgres_job_store(postgres_options o)
      : options_(std::move(o)),
        who_(absl::StrCat("postgres job store '", options_.schema, "'")),
        pool_(static_cast<std::size_t>(options_.pool_size), [this] { return connect(); }) {}

  [[nodiscard]] std::int64_t offset() const noexcept {
    return options_.testing_clock_offset ? options_.testing_clock_offset->load(std::memory_order_relaxed) : 0;
  }

  absl::Status raced(std::string_view op) const {
    return store_unavailable_error(
        absl::StrCat(who_, ": ", detail::to_absl(op), ": the row kept changing under the statement; nothing applied"));
  }

  static bool is_full(const absl::Status& s) {
    return absl::StrContains(s.message(), absl::StrCat("(SQLSTATE ", detail::to_absl(detail::pg_job_full_sqlstate), ")"));
  }

  static std::string_view state_name(std::int64_t s) noexcept {
    return s >= queued && s <= expired ? to_string(static_cast<job_state>(s)) : std::string_view("unknown");
  }

  // A fenced write (renew, complete, fail). `repeat_states` are the states a
  // repeat of a successful write by the same holder finds (answered OK).
  template <int N>
  absl::StatusOr<job_state> fenced(const char* stmt, const detail::pg_params<N>& p, std::int64_t id,
                                   const ownership& token, std::string_view op,
                                   std::initializer_list<std::int64_t> repeat_states) {
    for (int attempt = 0; attempt < max_races; ++attempt) {
      absl::StatusOr<detail::pg_result> r = run(stmt, p, detail::pg_effect::write);
      if (!r.ok()) return r.status();
      if (r->rows() == 0)
        return lost_ownership_error(absl::StrCat(detail::to_absl(op), " of job ", id, " by fence ", token.fence,
                                                 ": no such job (purged?)"));
      const detail::pg_result& x = *r;
      const std::int64_t state = x.integer(0, 1);
      if (x.integer(0, 0) == 0) return static_cast<job_state>(state);
      const bool holder = x.integer(0, 2) != 0 && x.integer(0, 3) == token.fence;
      if (holder && state == running) continue;  // it matched in the snapshot: it changed under us
      if (holder && std::find(repeat_states.begin(), repeat_states.end(), state) != repeat_states.end())
        return static_cast<job_state>(state);  // a repeat
      const bool other_owner = x.integer(0, 3) == token.fence && x.integer(0, 2) == 0;
      return lost_ownership_error(absl::StrCat(detail::to_absl(op), " of job ", id, " by fence ", token.fence,
                                               ": the job is ", detail::to_absl(state_name(state)), " under fence ",
                                               x.integer(0, 3), other_owner ? " and another owner" : ""));
    }
    return raced(op);
  }

  template <int N>
  absl::StatusOr<std::optional<job_info>> read_info(const char* stmt, const detail::pg_params<N>& p) {
    absl::StatusOr<detail::pg_result> r = run(stmt, p, detail::pg_effect::read);
    if (!r.ok()) return r.status();
    if (r->rows() == 0) return std::optional<job_info>();
    const detail::pg_result& q = *r;
    job_info j;
    j.id = q.integer(0, 0);
    j.queue = std::string(q.bytes(0, 1));
    j.tenant = std::string(q.bytes(0, 2));
    j.key = std::string(q.bytes(0, 3));
    const std::string_view d = q.bytes(0, 4);
    if (d.size() == j.payload_digest.bytes.size()) std::copy(d.begin(), d.end(), j.payload_digest.bytes.begin());
    j.payload = std::string(q.bytes(0, 5));
    const std::int64_t state = q.integer(0, 6);
    j.attempts = static_cast<int>(q.integer(0, 7));
    j.max_attempts = static_cast<int>(q.integer(0, 8));
    j.fence = q.integer(0, 9);
    const std::int64_t lease_expires = q.integer(0, 10);
    j.took_over = q.integer(0, 11) != 0;
    j.created_at_ns = q.integer(0, 12);
    j.expires_at_ns = q.integer(0, 13);
    j.available_at_ns = q.integer(0, 14);
    j.started_at_ns = q.integer(0, 15);
    j.finished_at_ns = q.integer(0, 16);
    if (!q.is_null(0, 17)) j.result = std::string(q.bytes(0, 17));
    j.error_code = static_cast<absl::StatusCode>(q.integer(0, 18));
    if (!q.is_null(0, 19)) j.error_message = std::string(q.bytes(0, 19));
    const std::int64_t now = q.integer(0, 20);
    j.state = state == queued && j.expires_at_ns <= now ? job_state::expired : static_cast<job_state>(state);
    if (j.state == job_state::expired && state == queued) j.finished_at_ns = j.expires_at_ns;
    if (j.state == job_state::running && lease_expires > now) j.lease_remaining = detail::from_ns(lease_expires - now);
    return std::optional<job_info>(std::move(j));
  }

  [[nodiscard]] std::string application_name() const { return absl::StrCat("keel-jobs/", options_.schema); }

  // A new pooled connection: statement timeout, then every statement prepared.
  absl::StatusOr<std::unique_ptr<detail::pg_connection>> connect() {
    absl::StatusOr<std::unique_ptr<detail::pg_connection>> c =
        detail::pg_connection::connect(options_.conninfo, options_.connect_timeout, application_name(), who_);
    if (!c.ok()) return c.status();
    detail::pg_connection& conn = **c;
    if (options_.pooling == postgres_pooling::transaction) {
      conn.keep_statements_unprepared();  // postgres_pooling::transaction: no prepared statements, no session settings
    } else if (absl::Status s = conn.set_backstops(options_.command_timeout, options_.command_timeout); !s.ok()) {
      return s;
    }
    const std::string schema = conn.quote_identifier(options_.schema);
    using S = detail::pg_job_sql;
    constexpr unsigned b = detail::pg_bytea_oid, i = detail::pg_int8_oid;
    struct item {
      const char* name;
      std::string sql;
      std::vector<unsigned> types;
    };
    const item items[] = {
        {detail::pg_job_submit, S::make(S::submit, schema, 9, " AND NOT EXISTS (SELECT 1 FROM existing)"),
         {b, b, b, b, b, i, i, i, i}},
        {detail::pg_job_claim, S::make(S::claim, schema, 6, " AND NOT EXISTS (SELECT 1 FROM mine)"), {b, b, i, i, b, i}},
        {detail::pg_job_renew, S::make(absl::StrCat(S::renew_head, S::holder, S::renew_returning, S::fenced_tail), schema, 5),
         {i, b, i, i, i}},
        {detail::pg_job_complete,
         S::make(absl::StrCat(S::complete_head, S::holder, S::finishing_returning, S::fenced_tail), schema, 5),
         {i, b, i, b, i}},
        {detail::pg_job_fail, S::make(absl::StrCat(S::fail_head, S::holder, S::finishing_returning, S::fenced_tail), schema, 8),
         {i, b, i, i, b, i, i, i}},
        {detail::pg_job_get, S::make(absl::StrCat("WITH CLOCK SELECT", S::info_columns, S::get_tail), schema, 2), {i, i}},
        {detail::pg_job_find, S::make(absl::StrCat("WITH CLOCK SELECT", S::info_columns, S::find_tail), schema, 4),
         {b, b, b, i}},
        {detail::pg_job_counts, S::make(S::counts, schema, 2), {b, i}},
        {detail::pg_job_purge, S::make(S::purge, schema, 3, " AND x.expires_at > NOW - $2"), {b, i, i}},
    };
    for (const item& it : items) {
      if (absl::Status s = conn.prepare(it.name, it.sql, static_cast<int>(it.types.size()), it.types.data()); !s.ok())
        return annotate(s, absl::StrCat("keel: ", who_, ": preparing ", it.name));
    }
    return c;
  }

  // Creates or checks the job tables (detail::pg_create_or_check, under the
  // advisory lock keel::postgres_store takes for the same schema name).
  absl::Status initialise() {
    absl::StatusOr<std::unique_ptr<detail::pg_connection>> made =
        detail::pg_connection::connect(options_.conninfo, options_.connect_timeout, application_name(), who_);
    if (!made.ok()) return made.status();
    const detail::pg_schema_plan plan{
        .schema = options_.schema,
        .meta_table = "job_meta",
        .version = postgres_jobs_schema_version,
        .version_words = "job tables of version",
        .not_ours = "it is not a keel job store (give the job store a schema of its own)",
        .absent = "no keel job tables here",
        .create = options_.create_schema};
    const bool clock_ids = options_.job_ids == postgres_job_ids::from_clock;
    auto tables = [clock_ids](const std::string& schema) {
      std::vector<std::string> ddl{
          absl::StrCat("CREATE TABLE ", schema, ".job (id int8 ",
                       clock_ids ? "PRIMARY KEY," : "GENERATED ALWAYS AS IDENTITY PRIMARY KEY,",
                       " queue bytea NOT NULL, tenant bytea NOT NULL, key bytea NOT NULL, digest bytea NOT NULL,"
                       " payload bytea NOT NULL, state smallint NOT NULL, attempts int8 NOT NULL,"
                       " max_attempts int8 NOT NULL, owner bytea, fence int8 NOT NULL, lease_expires int8 NOT NULL,"
                       " took_over bool NOT NULL, created_at int8 NOT NULL, expires_at int8 NOT NULL,"
                       " available_at int8 NOT NULL, started_at int8 NOT NULL, finished_at int8 NOT NULL,"
                       " result bytea, error_code int8 NOT NULL, error_message bytea,"
                       " UNIQUE (queue, tenant, key))"),
          // Claim order, age expiry, lapsed leases, a re-claim by the owner, purge.
          absl::StrCat("CREATE INDEX job_queued ON ", schema, ".job (queue, id) WHERE state = 0"),
          absl::StrCat("CREATE INDEX job_aging ON ", schema, ".job (queue, expires_at) WHERE state = 0"),
          absl::StrCat("CREATE INDEX job_running ON ", schema, ".job (queue, lease_expires) WHERE state = 1"),
          absl::StrCat("CREATE INDEX job_owner ON ", schema, ".job (owner) WHERE state = 1"),
          absl::StrCat("CREATE INDEX job_finished ON ", schema, ".job (queue, finished_at) WHERE state >= 2"),
          absl::StrCat("CREATE TABLE ", schema, ".job_depth (queue bytea PRIMARY KEY, live int8 NOT NULL)"),
          // Raised inside a submit that would overfill its queue: the insert is rolled back with it.
          absl::StrCat("CREATE FUNCTION ", schema,
                       ".job_queue_full(live int8, max_depth int8) RETURNS int8 LANGUAGE plpgsql AS $f$ BEGIN"
                       " RAISE EXCEPTION 'keel job queue full: % live jobs, max_depth %', live, max_depth"
                       " USING ERRCODE = '",
                       detail::to_absl(detail::pg_job_full_sqlstate), "'; END $f$"),
      };
      if (clock_ids) {
        for (std::string& stmt : detail::pg_job_clock_ids_ddl(schema)) ddl.push_back(std::move(stmt));
      }
      return ddl;
    };
    if (absl::Status s = detail::pg_create_or_check(**made, plan, options_.command_timeout, who_, tables); !s.ok())
      return s;
    // How the table numbers jobs is what it was created with (the identity
    // column, or the clock default); asking for clock ids on a table of
    // sequential ones is refused: keel does not change a table it did not
    // just create (the statements that do are in docs/stores.md, "Job ids").
    const std::string job_table = absl::StrCat((*made)->quote_identifier(options_.schema), ".job");
    detail::pg_params<1> q;
    q.add(job_table);
    absl::StatusOr<detail::pg_result> ident = (*made)->exec(
        "SELECT (SELECT count(*) FROM pg_attribute WHERE attrelid = to_regclass($1::text) AND attname = 'id'"
        " AND attidentity <> '')",
        q, detail::pg_effect::read, options_.command_timeout);
    if (!ident.ok()) return ident.status();
    job_ids_ = ident->integer(0, 0) > 0 ? postgres_job_ids::sequential : postgres_job_ids::from_clock;
    if (options_.job_ids == postgres_job_ids::from_clock && job_ids_ == postgres_job_ids::sequential)
      return absl::FailedPreconditionError(absl::StrCat(
          "keel: ", who_, ": postgres_options.job_ids is from_clock, but table ", job_table,
          " was created with sequential ids (GENERATED ALWAYS AS IDENTITY), which an asynchronous failover can hand"
          " out again; keel does not change an existing table: use a new schema, or convert this one with the"
          " statements in docs/stores.md (\"Job ids\"). Nothing was changed."));
    absl::StatusOr<detail::client_pool<detail::pg_connection>::handle> h = pool_.acquire(options_.acquire_timeout, who_);
    return h.ok() ? absl::OkStatus() : h.status();
  }

  // One operation: a pooled connection (replaced if the server closed it
  // while idle), one statement.
  template <int N>
  absl::StatusOr<detail::pg_result> run(const char* stmt, const detail::pg_params<N>& p, detail::pg_effect effect) {
    return detail::pg_run_pooled(pool_, options_.acquire_timeout, options_.command_timeout, who_, round_trips_, stmt,
                                 p, effect,
                                 options_.end_abandoned_writes && options_.pooling == postgres_pooling::session);
  }

  postgres_options options_;
  postgres_job_ids job_ids_ = postgres_job_ids::sequential;  // what the table uses (initialise)
  std::string who_;
  detail::client_pool<detail::pg_connection> pool_;
  std::atomic<std::uint64_t> round_trips_{0};
};

static_assert(job_store<postgres_job_store>);

}  // namespace keel
