// keel/store/postgres.hpp — idempotency records, leases and results in
// PostgreSQL, shared by every replica of a service. Link keel::postgres.
//
// keel::postgres_store implements keel::idempotency_store, keel::lease_store
// and keel::result_store (docs/stores.md has the contracts; docs/scaleout.md
// the operational side):
//
//   - every begin, claim, extend, renew, commit, abandon, release and save
//     is ONE statement — INSERT ... ON CONFLICT ... DO UPDATE ... WHERE
//     <owner matches or expired> ... RETURNING, or a fenced UPDATE — so it is
//     atomic under READ COMMITTED with no explicit transaction and costs one
//     round trip. When the row it decided on changed under it (a concurrent
//     first insert of the same key), the statement changed nothing and is
//     run again: a second round trip, only under that race;
//   - time is the database server's clock (clock_timestamp()), never the
//     client's; expiries are Unix nanoseconds computed inside the statements;
//   - fences never go backwards: purge_expired() keeps the highest fence it
//     deletes in a reserved row of the lease table (work key: one NUL byte,
//     which no caller can use), and a key with no row starts above it. Purge
//     is one transaction that first locks the record and lease tables
//     against writers (SHARE ROW EXCLUSIVE), so no begin or claim can read
//     the old floor and then insert a row purge deleted; begins and claims
//     wait for it, readers do not;
//   - a bounded pool of connections (pool_size), each lent to one thread at
//     a time, with every statement prepared once per connection; an idle
//     connection the server closed (restart, failover) is noticed before use
//     and replaced;
//   - a versioned schema in its own PostgreSQL schema (options.schema):
//     created on first open (serialised by an advisory lock), checked on
//     every open: another keel schema version, or a schema holding tables
//     that are not keel's, is refused and left untouched;
//   - a client-side command timeout on every statement (the client drops
//     the session; it sends no cancel request, which would block against a
//     frozen server), with the server's statement_timeout one second longer
//     and, on PostgreSQL 14 and later, client_connection_check_interval as
//     backstops that stop a statement whose client gave up or vanished;
//     a write abandoned at its timeout also has its session ended
//     (pg_terminate_backend from an idle pooled connection:
//     end_abandoned_writes), since a commit waiting for a synchronous
//     standby ignores both;
//   - failover: give a multi-host conninfo ("host=a,b port=5432,5432
//     target_session_attrs=read-write") and each new connection goes to the
//     server that accepts writes; with a synchronous standby nothing
//     acknowledged is lost, with an asynchronous one what it had not received
//     is, and fences = postgres_fences::from_clock keeps a fence from ever
//     being handed out twice (docs/scaleout.md, "Failover").
//
// Values always travel as bound parameters (binary format); the only text
// put into a statement is the schema name, validated ([a-z_][a-z0-9_]*, at
// most 63 bytes) and quoted by libpq.
//
// Errors (see keel/store/internal/pg_connection.hpp for the mapping):
//
//   keel::store_unavailable_error   cannot connect, every connection busy past
//                                   acquire_timeout, or a statement that failed
//                                   and was rolled back: nothing applied, safe to repeat
//   keel::unknown_outcome_error     a write whose connection dropped, whose server
//                                   shut down, or that timed out after being sent:
//                                   it may have committed; repeat it (rule 7 of
//                                   docs/stores.md makes repeats safe) or begin again
//   Unavailable / DeadlineExceeded  the same for a read (load_result)
//   PermissionDenied                bad credentials, missing role, no privilege (permanent)
//   FailedPrecondition              schema of another version, foreign schema,
//                                   schema missing with create_schema off
//
// Duplicates waiting for an in-flight request are polled by keel::once with
// jittered exponential backoff (poll_initial .. poll_max), never past the
// holder's lease or the caller's deadline — one short statement per poll.
//
// Example:
//
//   absl::StatusOr<std::unique_ptr<keel::postgres_store>> store = keel::postgres_store::open(
//       {.conninfo = "host=db.internal dbname=inference user=svc", .schema = "keel", .pool_size = 16});
//   if (!store.ok()) return store.status();
//   keel::once decide(**store, {.lease = std::chrono::seconds(30), .policy_revision = "receipts-v4"});
//
// Thread-safety: every operation may be called from any number of threads;
// at most pool_size statements run at once, the others wait for a
// connection (up to acquire_timeout). Do not carry a store across fork():
// open a new one in the child.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "keel/core/clock.hpp"
#include "keel/core/status.hpp"
#include "keel/store/internal/client_pool.hpp"
#include "keel/store/internal/pg_connection.hpp"
#include "keel/store/internal/pg_store.hpp"
#include "keel/store/internal/stored_record.hpp"
#include "keel/durable/digest.hpp"
#include "keel/durable/idempotency.hpp"
#include "keel/durable/lease.hpp"
#include "keel/durable/ownership.hpp"
#include "keel/durable/result_store.hpp"

namespace keel {

// The schema version this keel reads and writes (table keel_meta).
inline constexpr int postgres_schema_version = 1;

// How a new owner's fence is made (docs/stores.md, rule 4; docs/scaleout.md,
// "Failover").
enum class postgres_fences {
  // The previous fence + 1 (a key with no row: above the purge floor), as on
  // every backend. After a failover to an asynchronous standby that lacks
  // the last commits, a fence those commits handed out can be handed out again.
  sequential,
  // max(that, the server's clock in microseconds). A fence handed out by a
  // primary whose commits a failover lost is then below every fence the
  // promoted standby hands out later, as long as the standby's clock is not
  // behind the old primary's by more than the failover took. Fences grow by
  // more than 1 per owner (about 1.8e15); nothing else changes. With a
  // synchronous standby nothing acknowledged is lost, and either mode holds.
  from_clock,
};

// How keel::postgres_job_store numbers new jobs (docs/stores.md, "Job ids";
// docs/scaleout.md, "Failover"). Decided when the job tables are created:
// an existing table keeps what it was created with.
enum class postgres_job_ids {
  // id int8 GENERATED ALWAYS AS IDENTITY: 1, 2, 3, ... After a failover to
  // an asynchronous standby that lacks the last commits, the ids those
  // commits handed out are handed out again, to other jobs.
  sequential,
  // ((server time in µs since 2020-01-01) << 10 | a sequence's low 10 bits),
  // at least the highest id in the table + 1: strictly increasing on one
  // primary, > 0, inside int8 until the year 2305. An id handed out by a
  // primary whose commits a failover lost is not handed out again unless the
  // promoted server's clock is behind the old primary's by at least the time
  // from that id's submission to the first submission after the promotion.
  // Ids are large (about 2e17) and not dense. Opening a table created with
  // sequential ids with this option is refused (FailedPrecondition).
  from_clock,
};

// What sits between keel and the server.
enum class postgres_pooling {
  // keel's sessions are its own (a direct connection, or a pooler in
  // session mode): each statement is prepared once per connection, and the
  // session carries statement_timeout and client_connection_check_interval
  // as backstops.
  session,
  // A pooler in transaction mode (PgBouncer's pool_mode = transaction, the
  // usual way fleets run it): consecutive statements of one keel connection
  // may run on different server connections. Every statement is sent with
  // its text (an unnamed statement; a prepared one would exist on one server
  // connection only), nothing is set on the session (give the role a
  // statement_timeout instead: ALTER ROLE ... SET statement_timeout = '6s'),
  // and abandoned writes are not ended (the backend behind keel's connection
  // changes). Costs the statement's parse and plan on every execution.
  transaction,
};

struct postgres_options {
  // libpq connection string or URI ("host=... port=... dbname=... user=...").
  std::string conninfo{};
  // The PostgreSQL schema keel's tables live in: [a-z_][a-z0-9_]*, 1-63 bytes.
  // One schema per keel namespace (service, environment, test run).
  std::string schema = "keel";
  // Connections at most; in [1, 1000].
  int pool_size = 8;
  // Connecting, per host, to the millisecond (keel's own deadline around
  // libpq's non-blocking connect; libpq alone counts whole seconds, at
  // least 2); in [1 ms, 1 h].
  duration connect_timeout = std::chrono::seconds(5);
  // Every statement, from send to result; in [1 ms, 1 h]. The server's
  // statement_timeout is set one second longer (a backstop).
  duration command_timeout = std::chrono::seconds(5);
  // Waiting for a free connection when all pool_size are lent; in [0, 1 h].
  duration acquire_timeout = std::chrono::seconds(5);
  // Create the schema and tables when missing. Off: a missing schema is FailedPrecondition.
  bool create_schema = true;
  // A write abandoned at command_timeout has its server session ended
  // (pg_terminate_backend from an idle pooled connection, within 250 ms,
  // when one is idle). Without it, a commit waiting for a synchronous
  // standby that is gone waits in the server (wait event SyncRep) until the
  // standby is back, holding its row locks: neither statement_timeout nor
  // the client's going away ends that wait. Ending it makes that commit
  // visible on the primary while the standby lacks it (as any end of that
  // wait does); keel answered unknown outcome for it, so nothing was
  // acknowledged. The answer comes at most 250 ms after command_timeout.
  bool end_abandoned_writes = true;
  // How a new owner's fence is made (postgres_store; see postgres_fences).
  postgres_fences fences = postgres_fences::sequential;
  // How postgres_job_store numbers new jobs in tables it creates; with
  // from_clock, also a requirement on existing tables (see postgres_job_ids).
  // postgres_store ignores it.
  postgres_job_ids job_ids = postgres_job_ids::sequential;
  // A pooler in transaction mode between keel and the server? (postgres_pooling)
  postgres_pooling pooling = postgres_pooling::session;
  // Tests only: nanoseconds added to the server's clock inside every
  // statement, shared by every store given the same pointer (the
  // conformance suite's `advance`). Leave empty in production.
  std::shared_ptr<std::atomic<std::int64_t>> testing_clock_offset{};

  [[nodiscard]] absl::Status validate() const {
    constexpr std::string_view who = "postgres_options";
    if (conninfo.empty()) return detail::invalid_field(who, "conninfo", "not be empty", "\"\"");
    if (schema.empty() || schema.size() > 63)
      return detail::invalid_field(who, "schema", "be 1-63 bytes", schema.size());
    for (std::size_t i = 0; i < schema.size(); ++i) {
      const char c = schema[i];
      const bool ok = (c >= 'a' && c <= 'z') || c == '_' || (i > 0 && c >= '0' && c <= '9');
      if (!ok) return detail::invalid_field(who, "schema", "match [a-z_][a-z0-9_]*", absl::StrCat("\"", schema, "\""));
    }
    if (pool_size < 1 || pool_size > 1000) return detail::invalid_field(who, "pool_size", "be in [1, 1000]", pool_size);
    if (connect_timeout < std::chrono::milliseconds(1) || connect_timeout > std::chrono::hours(1))
      return detail::invalid_field(who, "connect_timeout", "be in [1ms, 1h]", connect_timeout);
    if (command_timeout < std::chrono::milliseconds(1) || command_timeout > std::chrono::hours(1))
      return detail::invalid_field(who, "command_timeout", "be in [1ms, 1h]", command_timeout);
    if (acquire_timeout < duration::zero() || acquire_timeout > std::chrono::hours(1))
      return detail::invalid_field(who, "acquire_timeout", "be in [0, 1h]", acquire_timeout);
    if (job_ids != postgres_job_ids::sequential && job_ids != postgres_job_ids::from_clock)
      return detail::invalid_field(who, "job_ids", "be postgres_job_ids::sequential or ::from_clock",
                                   static_cast<int>(job_ids));
    return absl::OkStatus();
  }
};

namespace detail {

// Durations sent to the server are capped at ~126 years so that now +
// duration stays inside int8.
[[nodiscard]] constexpr std::int64_t pg_ns(duration d) noexcept {
  return std::min<std::int64_t>(to_ns(d), 4'000'000'000'000'000'000);
}

// The statements, with $S for the quoted schema and NOW for the statement's
// one reading of the server clock (plus the test offset, the last parameter).
struct pg_sql {
  static constexpr const char* clock =
      "clk AS MATERIALIZED (SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::int8 * 1000 + $OFF::int8 AS now)";

  // $1 tenant $2 endpoint $3 key $4 request $5 owner $6 lease $7 retention $8 supersede $9 offset
  static constexpr const char* begin =
      "WITH CLOCK, up AS ("
      " INSERT INTO $S.idempotency AS r (tenant, endpoint, key, request, state, owner, fence, lease_expires,"
      "  record_expires, claim_kind)"
      " SELECT $1, $2, $3, $4, 0, $5, FIRST_FENCE, clk.now + $6, clk.now + $7, 0 FROM clk"
      " ON CONFLICT (tenant, endpoint, key) DO UPDATE SET"
      "  claim_kind = CASE WHEN r.record_expires <= NOW OR r.state = 2 THEN 0"
      "    WHEN r.state = 0 AND r.owner = excluded.owner THEN 3 WHEN r.state = 0 THEN 1 ELSE 2 END,"
      "  fence = CASE WHEN r.record_expires > NOW AND r.state = 0 AND r.owner = excluded.owner"
      "    THEN r.fence ELSE r.fence + 1 END,"
      "  lease_expires = CASE WHEN r.record_expires > NOW AND r.state = 0 AND r.owner = excluded.owner"
      "    THEN greatest(r.lease_expires, excluded.lease_expires) ELSE excluded.lease_expires END,"
      "  record_expires = CASE WHEN r.record_expires > NOW AND r.state = 0 AND r.owner = excluded.owner"
      "    THEN greatest(r.record_expires, r.lease_expires, excluded.lease_expires) ELSE excluded.record_expires END,"
      "  request = excluded.request, state = 0, owner = excluded.owner, decision_id = NULL, model_digest = NULL,"
      "  policy_revision = NULL, result = NULL, error_code = 0, error_message = NULL, committed_at = 0"
      " WHERE r.record_expires <= NOW OR r.state = 2"
      "  OR (r.request = excluded.request AND r.state = 0 AND (r.owner = excluded.owner OR r.lease_expires <= NOW))"
      "  OR (r.request = excluded.request AND r.state = 1 AND length($8) > 0"
      "      AND r.policy_revision IS DISTINCT FROM $8)"
      " RETURNING r.fence, r.lease_expires, r.claim_kind)"
      " SELECT 0::int4, up.fence, up.lease_expires - NOW, up.claim_kind::int4, NULL::bool, NULL::int8, NULL::bool,"
      "  NULL::bytea, NULL::bytea, NULL::bytea, NULL::bytea, NULL::int8, NULL::bytea, NULL::int8 FROM up"
      " UNION ALL"
      " SELECT 1, r.fence, r.lease_expires - NOW, r.state::int4, r.request = $4, r.record_expires - NOW,"
      "  r.owner = $5, r.decision_id, r.model_digest, r.policy_revision, r.result, r.error_code, r.error_message,"
      "  r.committed_at"
      " FROM $S.idempotency r WHERE r.tenant = $1 AND r.endpoint = $2 AND r.key = $3"
      "  AND NOT EXISTS (SELECT 1 FROM up)";

  // The fenced record writes answer (k, state, same owner, fence, ns left
  // on the record): k = 0 applied; k = 1 not applied, with the row as this
  // statement's snapshot saw it (to tell a repeat from lost ownership).
  static constexpr const char* record_tail =
      " SELECT 0::int4, NULL::int4, NULL::bool, NULL::int8, NULL::int8 FROM up"
      " UNION ALL"
      " SELECT 1, r.state::int4, r.owner = $4, r.fence, r.record_expires - NOW"
      " FROM $S.idempotency r WHERE r.tenant = $1 AND r.endpoint = $2 AND r.key = $3"
      "  AND NOT EXISTS (SELECT 1 FROM up)";
  static constexpr const char* record_match =
      " WHERE r.tenant = $1 AND r.endpoint = $2 AND r.key = $3 AND r.state = 0 AND r.owner = $4 AND r.fence = $5"
      "  AND r.record_expires > NOW RETURNING 1)";

  // $1-3 identity $4 owner $5 fence $6 ttl $7 offset
  static constexpr const char* extend_head =
      "WITH CLOCK, up AS (UPDATE $S.idempotency r SET lease_expires = greatest(r.lease_expires, NOW + $6),"
      " record_expires = greatest(r.record_expires, r.lease_expires, NOW + $6)";
  // $1-3 identity $4 owner $5 fence $6 id $7 model $8 revision $9 result $10 code $11 message $12 retention $13 offset
  static constexpr const char* commit_head =
      "WITH CLOCK, up AS (UPDATE $S.idempotency r SET state = 1, decision_id = $6, model_digest = $7,"
      " policy_revision = $8, result = $9, error_code = $10, error_message = $11, committed_at = NOW,"
      " record_expires = NOW + $12";
  // $1-3 identity $4 owner $5 fence $6 offset
  static constexpr const char* abandon_head =
      "WITH CLOCK, up AS (UPDATE $S.idempotency r SET state = 2, decision_id = NULL, model_digest = NULL,"
      " policy_revision = NULL, result = NULL, error_code = 0, error_message = NULL";

  // $1 key $2 owner $3 ttl $4 offset
  static constexpr const char* claim =
      "WITH CLOCK, up AS ("
      " INSERT INTO $S.lease AS l (work_key, owner, fence, expires, held, claim_kind)"
      " SELECT $1, $2, FIRST_FENCE, clk.now + $3, true, 0 FROM clk"
      " ON CONFLICT (work_key) DO UPDATE SET"
      "  fence = CASE WHEN l.held AND l.owner = excluded.owner THEN l.fence ELSE l.fence + 1 END,"
      "  expires = CASE WHEN l.held AND l.owner = excluded.owner THEN greatest(l.expires, excluded.expires)"
      "    ELSE excluded.expires END,"
      "  claim_kind = CASE WHEN l.held AND l.owner = excluded.owner THEN 3 WHEN l.held THEN 1 ELSE 0 END,"
      "  owner = excluded.owner, held = true"
      " WHERE NOT l.held OR l.owner = excluded.owner OR l.expires <= NOW"
      " RETURNING l.fence, l.expires, l.claim_kind)"
      " SELECT 0::int4, up.fence, up.expires - NOW, up.claim_kind::int4, NULL::bool FROM up"
      " UNION ALL"
      " SELECT 1, l.fence, l.expires - NOW, l.held::int4, l.owner = $2 FROM $S.lease l"
      " WHERE l.work_key = $1 AND NOT EXISTS (SELECT 1 FROM up)";

  // Lease writes answer (k, held, same owner, fence).
  static constexpr const char* lease_tail =
      " SELECT 0::int4, NULL::bool, NULL::bool, NULL::int8 FROM up"
      " UNION ALL"
      " SELECT 1, l.held, l.owner = $2, l.fence FROM $S.lease l"
      " WHERE l.work_key = $1 AND NOT EXISTS (SELECT 1 FROM up)";
  // $1 key $2 owner $3 fence $4 ttl $5 offset
  static constexpr const char* renew_head =
      "WITH CLOCK, up AS (UPDATE $S.lease l SET expires = greatest(l.expires, NOW + $4)"
      " WHERE l.work_key = $1 AND l.held AND l.owner = $2 AND l.fence = $3 RETURNING 1)";
  // $1 key $2 owner $3 fence $4 offset
  static constexpr const char* release_head =
      "WITH CLOCK, up AS (UPDATE $S.lease l SET held = false, expires = NOW"
      " WHERE l.work_key = $1 AND l.held AND l.owner = $2 AND l.fence = $3 RETURNING 1)";

  // $1 key $2 value $3 retention (0: forever) $4 offset
  static constexpr const char* save =
      "WITH CLOCK INSERT INTO $S.result AS x (key, value, saved_at, expires)"
      " SELECT $1, $2, clk.now, CASE WHEN $3 = 0 THEN 9223372036854775807 ELSE clk.now + $3 END FROM clk"
      " ON CONFLICT (key) DO UPDATE SET value = excluded.value, saved_at = excluded.saved_at,"
      "  expires = excluded.expires WHERE x.expires <= excluded.saved_at"
      " RETURNING 1";
  // $1 key $2 offset
  static constexpr const char* load =
      "WITH CLOCK SELECT x.value FROM $S.result x, clk WHERE x.key = $1 AND x.expires > clk.now";
  // $1 key
  static constexpr const char* erase = "DELETE FROM $S.result WHERE key = $1";
  // $1 offset. Run after purge_lock, in its transaction: the floor row
  // (work key '\x00') rises to the highest fence deleted.
  static constexpr const char* purge =
      "WITH CLOCK,"
      " a AS (DELETE FROM $S.idempotency WHERE record_expires <= NOW RETURNING fence),"
      " b AS (DELETE FROM $S.lease WHERE (NOT held OR expires <= NOW) AND work_key <> '\\x00'::bytea"
      "  RETURNING fence),"
      " c AS (DELETE FROM $S.result WHERE expires <= NOW RETURNING 1),"
      " m AS (SELECT max(fence) AS top FROM (SELECT fence FROM a UNION ALL SELECT fence FROM b) x),"
      " f AS (INSERT INTO $S.lease AS l (work_key, owner, fence, expires, held, claim_kind)"
      "  SELECT '\\x00'::bytea, ''::bytea, m.top, 9223372036854775807, false, 0 FROM m WHERE m.top IS NOT NULL"
      "  ON CONFLICT (work_key) DO UPDATE SET fence = greatest(l.fence, excluded.fence) RETURNING 1)"
      " SELECT (SELECT count(*) FROM a) + (SELECT count(*) FROM b) + (SELECT count(*) FROM c),"
      "  (SELECT count(*) FROM f)";
  // Keeps begins and claims out while purge deletes and raises the floor.
  static constexpr const char* purge_lock = "LOCK TABLE $S.idempotency, $S.lease IN SHARE ROW EXCLUSIVE MODE";
  // The fence of a key with no row: above every fence purge ever deleted.
  static constexpr const char* first_fence =
      "(COALESCE((SELECT z.fence FROM $S.lease z WHERE z.work_key = '\\x00'::bytea), 0) + 1)";

  // from_clock (postgres_fences): every new owner's fence is at least the
  // statement's time in microseconds.
  static std::string make(std::string_view text, const std::string& schema, int offset_param, bool clock_fences = false) {
    const std::string off = absl::StrCat("$", offset_param);
    std::string clock_cte = absl::StrReplaceAll(clock, {{"$OFF", off}});
    const std::string first = clock_fences ? absl::StrCat("greatest(", first_fence, ", NOW / 1000)") : first_fence;
    const std::string with_fence = absl::StrReplaceAll(
        to_absl(text), {{"FIRST_FENCE", first},
                        {"r.fence + 1", clock_fences ? "greatest(r.fence + 1, NOW / 1000)" : "r.fence + 1"},
                        {"l.fence + 1", clock_fences ? "greatest(l.fence + 1, NOW / 1000)" : "l.fence + 1"}});
    return absl::StrReplaceAll(with_fence, {{"CLOCK", clock_cte}, {"$S", schema}, {"NOW", "(SELECT now FROM clk)"}});
  }
};

// What one run of the begin statement (pg_sql::begin) answered, checked
// before it is trusted: nullopt when the row changed under the statement
// (run it again); otherwise the outcome, or DataLoss naming the record when
// the row read back is one no keel would have written — a fence no claim
// could issue, a state keel does not use, a replayed decision commit()
// would refuse, or a result of another shape (detail/stored_record.hpp).
[[nodiscard]] inline std::optional<absl::StatusOr<begin_outcome>> pg_begin_outcome(const pg_result& x,
                                                                                  const request_identity& id,
                                                                                  const owner_id& owner,
                                                                                  const begin_options& o,
                                                                                  std::string_view who) {
  constexpr std::int64_t in_flight = 0, abandoned = 2;
  if (x.rows() == 0) return std::nullopt;  // a concurrent first insert: look again
  const auto damaged = [&](std::string_view why) -> absl::StatusOr<begin_outcome> {
    return stored_damage(who, record_words(id), why);
  };
  // Integers come back binary, 1-8 bytes by their type; NULL only where the statement puts it.
  const auto integer_at = [&](int col) { return !x.is_null(0, col) && !x.bytes(0, col).empty() && x.bytes(0, col).size() <= 8; };
  if (x.columns() != 14) return damaged(absl::StrCat("the begin statement answered ", x.columns(), " columns, not 14"));
  for (int c : {0, 1, 2, 3})
    if (!integer_at(c)) return damaged("kind, fence, lease or state is not an integer");
  const std::int64_t fence = x.integer(0, 1);
  if (std::string why = stored_fence_problem(fence); !why.empty()) return damaged(why);
  const duration lease_left = from_ns(x.integer(0, 2));
  const std::int64_t kind = x.integer(0, 3);
  if (x.integer(0, 0) == 0) {  // claimed
    begin_outcome out{.state = begin_state::claimed, .ownership = {owner, fence}};
    out.took_over = kind == 1;
    out.superseded = kind == 2;
    out.lease_remaining = kind == 3 ? lease_left : o.lease;
    return out;
  }
  // Not applied: the row as the statement's snapshot saw it.
  for (int c : {4, 5, 6})
    if (!integer_at(c)) return damaged("same request, record left or same owner is not an answer");
  const std::int64_t state = kind;
  if (std::string why = stored_state_problem(state); !why.empty()) return damaged(why);
  const bool same_request = x.integer(0, 4) != 0;
  const bool live = x.integer(0, 5) > 0;
  const bool same_owner = x.integer(0, 6) != 0;
  if (!live || state == abandoned) return std::nullopt;  // claimable: it changed under us
  if (!same_request) {
    begin_outcome out{.state = begin_state::conflict};
    out.conflict_in_flight = state == in_flight;
    return out;
  }
  if (state == in_flight) {
    if (same_owner || lease_left <= duration::zero()) return std::nullopt;
    return begin_outcome{.state = begin_state::in_flight,
                         .ownership = {.owner = {}, .fence = fence},
                         .lease_remaining = lease_left};
  }
  const std::string_view revision = x.bytes(0, 9);  // committed
  if (!o.supersede_revision.empty() && (x.is_null(0, 9) || revision != o.supersede_revision)) return std::nullopt;
  if (x.is_null(0, 7)) return damaged("a committed record has no decision id");
  if (!integer_at(11) || !integer_at(13)) return damaged("error code or commit time is not an integer");
  const std::int64_t code = x.integer(0, 11);
  if (!known_status_code(code)) return damaged(absl::StrCat("error code ", code, " is not a status code"));
  begin_outcome out{.state = begin_state::replay, .ownership = {.owner = {}, .fence = fence}};
  out.decision.id = std::string(x.bytes(0, 7));
  out.decision.model_digest = std::string(x.bytes(0, 8));
  out.decision.policy_revision = std::string(revision);
  out.decision.result = std::string(x.bytes(0, 10));
  out.decision.error_code = static_cast<absl::StatusCode>(code);
  out.decision.error_message = std::string(x.bytes(0, 12));
  out.committed_at_ns = x.integer(0, 13);
  if (std::string why = stored_decision_problem(out.decision); !why.empty()) return damaged(why);
  return out;
}

// Prepared statement names.
inline constexpr const char* pg_begin = "keel_begin";
inline constexpr const char* pg_extend = "keel_extend";
inline constexpr const char* pg_commit = "keel_commit";
inline constexpr const char* pg_abandon = "keel_abandon";
inline constexpr const char* pg_claim = "keel_claim";
inline constexpr const char* pg_renew = "keel_renew";
inline constexpr const char* pg_release = "keel_release";
inline constexpr const char* pg_save = "keel_save";
inline constexpr const char* pg_load = "keel_load";
inline constexpr const char* pg_erase = "keel_erase";
inline constexpr const char* pg_purge = "keel_purge";

}  // namespace detail

class postgres_store {
 public:
  // Connects, checks (and if allowed creates) the schema, and keeps the
  // connection for the pool.
  //
  //   InvalidArgument     invalid options
  //   Unavailable         the server cannot be reached (not started)
  //   PermissionDenied    credentials refused, or no privilege to create the schema
  //   FailedPrecondition  a keel schema of another version, a schema holding other
  //                       tables, or no schema and create_schema off
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<postgres_store>> open(postgres_options o) {
    if (absl::Status v = o.validate(); !v.ok()) return v;
    std::unique_ptr<postgres_store> s(new postgres_store(std::move(o)));
    if (absl::Status st = s->initialise(); !st.ok()) return st;
    return s;
  }

  postgres_store(const postgres_store&) = delete;
  postgres_store& operator=(const postgres_store&) = delete;
  ~postgres_store() = default;

  [[nodiscard]] const postgres_options& options() const noexcept { return options_; }
  // Statements sent for store operations (each one round trip), over the
  // store's life: what benchmarks divide by operations.
  [[nodiscard]] std::uint64_t round_trips() const noexcept { return round_trips_.load(std::memory_order_relaxed); }
  // Connections open now.
  [[nodiscard]] std::size_t connections() const { return pool_.open(); }
  // "keel/<schema>", the application_name of this store's sessions: how an
  // operator tells them apart in pg_stat_activity.
  [[nodiscard]] std::string application_name() const { return absl::StrCat("keel/", options_.schema); }

  // ---- idempotency_store ---------------------------------------------------

  [[nodiscard]] absl::StatusOr<begin_outcome> begin(const request_identity& id, const digest& request,
                                                    const owner_id& owner, const begin_options& o) {
    if (absl::Status v = id.validate(); !v.ok()) return v;
    if (absl::Status v = o.validate(); !v.ok()) return v;
    if (owner.is_nil()) return absl::InvalidArgumentError("keel: owner must not be nil");
    detail::pg_params<9> p;
    p.add(id.tenant).add(id.endpoint).add(id.key).add(request.view()).add(owner);
    p.add(detail::pg_ns(o.lease)).add(detail::pg_ns(o.retention)).add(o.supersede_revision).add(offset());
    for (int attempt = 0; attempt < max_races; ++attempt) {
      absl::StatusOr<detail::pg_result> r = run(detail::pg_begin, p, detail::pg_effect::write);
      if (!r.ok()) return r.status();
      if (std::optional<absl::StatusOr<begin_outcome>> out = detail::pg_begin_outcome(*r, id, owner, o, who_))
        return *std::move(out);
    }
    return raced("begin");
  }

  [[nodiscard]] absl::Status extend(const request_identity& id, const ownership& token, duration ttl) {
    if (absl::Status v = id.validate(); !v.ok()) return v;
    if (ttl <= duration::zero()) return detail::invalid_field("extend", "ttl", "be > 0", ttl);
    detail::pg_params<7> p;
    p.add(id.tenant).add(id.endpoint).add(id.key).add(token.owner).add(token.fence).add(detail::pg_ns(ttl)).add(offset());
    return fenced_record(detail::pg_extend, p, token, "extend", -1);
  }

  [[nodiscard]] absl::Status commit(const request_identity& id, const ownership& token, const decision& d,
                                    duration retention) {
    if (absl::Status v = id.validate(); !v.ok()) return v;
    if (absl::Status v = d.validate(); !v.ok()) return v;
    if (retention <= duration::zero()) return detail::invalid_field("commit", "retention", "be > 0", retention);
    detail::pg_params<13> p;
    p.add(id.tenant).add(id.endpoint).add(id.key).add(token.owner).add(token.fence);
    p.add(d.id).add(d.model_digest).add(d.policy_revision).add(d.result);
    p.add(static_cast<std::int64_t>(d.error_code)).add(d.error_message).add(detail::pg_ns(retention)).add(offset());
    return fenced_record(detail::pg_commit, p, token, "commit", committed);
  }

  [[nodiscard]] absl::Status abandon(const request_identity& id, const ownership& token) {
    if (absl::Status v = id.validate(); !v.ok()) return v;
    detail::pg_params<6> p;
    p.add(id.tenant).add(id.endpoint).add(id.key).add(token.owner).add(token.fence).add(offset());
    return fenced_record(detail::pg_abandon, p, token, "abandon", abandoned);
  }

  // ---- lease_store ---------------------------------------------------------

  [[nodiscard]] absl::StatusOr<lease_claim> claim(std::string_view work_key, const owner_id& owner, duration ttl) {
    if (absl::Status v = validate_key("work key", work_key); !v.ok()) return v;
    if (ttl <= duration::zero()) return detail::invalid_field("claim", "ttl", "be > 0", ttl);
    if (owner.is_nil()) return absl::InvalidArgumentError("keel: owner must not be nil");
    detail::pg_params<4> p;
    p.add(work_key).add(owner).add(detail::pg_ns(ttl)).add(offset());
    for (int attempt = 0; attempt < max_races; ++attempt) {
      absl::StatusOr<detail::pg_result> r = run(detail::pg_claim, p, detail::pg_effect::write);
      if (!r.ok()) return r.status();
      if (r->rows() == 0) continue;
      const detail::pg_result& x = *r;
      const std::int64_t fence = x.integer(0, 1);
      const duration left = detail::from_ns(x.integer(0, 2));
      const std::int64_t kind = x.integer(0, 3);
      if (x.integer(0, 0) == 0) {
        return lease_claim{.acquired = true,
                           .ownership = {owner, fence},
                           .took_over = kind == 1,
                           .remaining = kind == 3 ? left : ttl};
      }
      const bool held = kind != 0;
      const bool same_owner = x.integer(0, 4) != 0;
      if (!held || same_owner || left <= duration::zero()) continue;  // changed under us
      return lease_claim{.acquired = false, .ownership = {.owner = {}, .fence = fence}, .remaining = left};
    }
    return raced("claim");
  }

  [[nodiscard]] absl::Status renew(std::string_view work_key, const ownership& token, duration ttl) {
    if (absl::Status v = validate_key("work key", work_key); !v.ok()) return v;
    if (ttl <= duration::zero()) return detail::invalid_field("renew", "ttl", "be > 0", ttl);
    detail::pg_params<5> p;
    p.add(work_key).add(token.owner).add(token.fence).add(detail::pg_ns(ttl)).add(offset());
    return fenced_lease(detail::pg_renew, p, token, "renew", false);
  }

  [[nodiscard]] absl::Status release(std::string_view work_key, const ownership& token) {
    if (absl::Status v = validate_key("work key", work_key); !v.ok()) return v;
    detail::pg_params<4> p;
    p.add(work_key).add(token.owner).add(token.fence).add(offset());
    return fenced_lease(detail::pg_release, p, token, "release", true);
  }

  // ---- result_store --------------------------------------------------------

  [[nodiscard]] absl::StatusOr<bool> save_result(std::string_view key, std::string_view value, duration retention) {
    if (absl::Status v = validate_key("result key", key); !v.ok()) return v;
    if (retention < duration::zero())
      return detail::invalid_field("save_result", "retention", "be >= 0", retention);
    detail::pg_params<4> p;
    p.add(key).add(value).add(detail::pg_ns(retention)).add(offset());
    absl::StatusOr<detail::pg_result> r = run(detail::pg_save, p, detail::pg_effect::write);
    if (!r.ok()) return r.status();
    return r->rows() == 1;
  }

  [[nodiscard]] absl::StatusOr<std::optional<std::string>> load_result(std::string_view key) {
    if (absl::Status v = validate_key("result key", key); !v.ok()) return v;
    detail::pg_params<2> p;
    p.add(key).add(offset());
    absl::StatusOr<detail::pg_result> r = run(detail::pg_load, p, detail::pg_effect::read);
    if (!r.ok()) return r.status();
    if (r->rows() == 0) return std::optional<std::string>();
    return std::optional<std::string>(std::string(r->bytes(0, 0)));
  }

  [[nodiscard]] absl::Status erase_result(std::string_view key) {
    if (absl::Status v = validate_key("result key", key); !v.ok()) return v;
    detail::pg_params<1> p;
    p.add(key);
    absl::StatusOr<detail::pg_result> r = run(detail::pg_erase, p, detail::pg_effect::write);
    return r.ok() ? absl::OkStatus() : r.status();
  }

  // ---- housekeeping --------------------------------------------------------

  // Deletes expired records, free or expired leases (held ones too: their
  // holder may only be paused) and expired results, and raises the floor
  // row to the highest fence deleted, so a key claimed again starts above
  // every fence it ever had. One transaction of four statements (BEGIN,
  // LOCK TABLE, the purge, COMMIT; detail::pg_transaction rolls it back on
  // any failure); begins and claims wait while it runs.
  // Returns how many rows went (the floor row is not counted). Run it
  // periodically from one replica.
  absl::StatusOr<std::int64_t> purge_expired() {
    absl::StatusOr<detail::client_pool<detail::pg_connection>::handle> h =
        pool_.acquire_alive(options_.acquire_timeout, who_);
    if (!h.ok()) return h.status();
    detail::pg_connection& c = **h;
    detail::pg_params<1> p;
    p.add(offset());
    const std::string lock = detail::pg_sql::make(detail::pg_sql::purge_lock, c.quote_identifier(options_.schema), 0);
    const std::uint64_t sent = c.sent();
    absl::StatusOr<std::int64_t> purged = [&]() -> absl::StatusOr<std::int64_t> {
      absl::StatusOr<detail::pg_transaction> tx = detail::pg_transaction::begin(c, options_.command_timeout);
      if (!tx.ok()) return tx.status();
      if (auto l = c.exec(lock, detail::pg_effect::read, options_.command_timeout); !l.ok()) return l.status();
      absl::StatusOr<detail::pg_result> out =
          c.exec_prepared(detail::pg_purge, p, detail::pg_effect::write, options_.command_timeout);
      if (!out.ok()) return out.status();
      if (absl::Status s = tx->commit(); !s.ok()) return s;
      return out->integer(0, 0);
    }();  // a transaction not committed was rolled back (or its session marked broken) on the way out
    round_trips_.fetch_add(c.sent() - sent, std::memory_order_relaxed);
    if (c.broken()) h->mark_broken();
    return purged;
  }

 private:
  static constexpr std::int64_t in_flight = 0, committed = 1, abandoned = 2;
  static constexpr int max_races = 8;

  explicit postgres_store(postgres_options o)
      : options_(std::move(o)),
        who_(absl::StrCat("postgres store '", options_.schema, "'")),
        pool_(static_cast<std::size_t>(options_.pool_size), [this] { return connect(); }) {}

  [[nodiscard]] std::int64_t offset() const noexcept {
    return options_.testing_clock_offset ? options_.testing_clock_offset->load(std::memory_order_relaxed) : 0;
  }

  absl::Status raced(std::string_view op) const {
    return store_unavailable_error(
        absl::StrCat(who_, ": ", detail::to_absl(op), ": the row kept changing under the statement; nothing applied"));
  }

  // A new pooled connection: statement timeout, then every statement prepared.
  absl::StatusOr<std::unique_ptr<detail::pg_connection>> connect() {
    absl::StatusOr<std::unique_ptr<detail::pg_connection>> c =
        detail::pg_connection::connect(options_.conninfo, options_.connect_timeout, application_name(), who_);
    if (!c.ok()) return c.status();
    detail::pg_connection& conn = **c;
    if (options_.pooling == postgres_pooling::transaction) {
      conn.keep_statements_unprepared();  // and no session settings: the next statement may be on another session
    } else if (absl::Status s = conn.set_backstops(options_.command_timeout + std::chrono::seconds(1),
                                                   options_.command_timeout);
               !s.ok()) {
      // The client's timeout fires first (it gives up and knows why); the
      // server's stop statements whose client has gone.
      return s;
    }
    const std::string schema = conn.quote_identifier(options_.schema);
    using S = detail::pg_sql;
    constexpr unsigned b = detail::pg_bytea_oid, i = detail::pg_int8_oid;
    struct item {
      const char* name;
      std::string sql;
      std::vector<unsigned> types;
    };
    const std::string rec_match = S::record_match;
    const bool clock_fences = options_.fences == postgres_fences::from_clock;
    const item items[] = {
        {detail::pg_begin, S::make(S::begin, schema, 9, clock_fences), {b, b, b, b, b, i, i, b, i}},
        {detail::pg_extend, S::make(absl::StrCat(S::extend_head, rec_match, S::record_tail), schema, 7),
         {b, b, b, b, i, i, i}},
        {detail::pg_commit, S::make(absl::StrCat(S::commit_head, rec_match, S::record_tail), schema, 13),
         {b, b, b, b, i, b, b, b, b, i, b, i, i}},
        {detail::pg_abandon, S::make(absl::StrCat(S::abandon_head, rec_match, S::record_tail), schema, 6),
         {b, b, b, b, i, i}},
        {detail::pg_claim, S::make(S::claim, schema, 4, clock_fences), {b, b, i, i}},
        {detail::pg_renew, S::make(absl::StrCat(S::renew_head, S::lease_tail), schema, 5), {b, b, i, i, i}},
        {detail::pg_release, S::make(absl::StrCat(S::release_head, S::lease_tail), schema, 4), {b, b, i, i}},
        {detail::pg_save, S::make(S::save, schema, 4), {b, b, i, i}},
        {detail::pg_load, S::make(S::load, schema, 2), {b, i}},
        {detail::pg_erase, S::make(S::erase, schema, 0), {b}},
        {detail::pg_purge, S::make(S::purge, schema, 1), {i}},
    };
    for (const item& it : items) {
      if (absl::Status s = conn.prepare(it.name, it.sql, static_cast<int>(it.types.size()), it.types.data()); !s.ok())
        return s;
    }
    return c;
  }

  // Creates or checks the schema (detail::pg_create_or_check).
  absl::Status initialise() {
    absl::StatusOr<std::unique_ptr<detail::pg_connection>> made =
        detail::pg_connection::connect(options_.conninfo, options_.connect_timeout, application_name(), who_);
    if (!made.ok()) return made.status();
    const detail::pg_schema_plan plan{.schema = options_.schema,
                                      .meta_table = "keel_meta",
                                      .version = postgres_schema_version,
                                      .version_words = "keel schema version",
                                      .not_ours = "it is not a keel store",
                                      .absent = "no keel schema here",
                                      .create = options_.create_schema};
    auto tables = [](const std::string& schema) {
      return std::vector<std::string>{
          absl::StrCat("CREATE TABLE ", schema,
                       ".idempotency (tenant bytea NOT NULL, endpoint bytea NOT NULL, key bytea NOT NULL,"
                       " request bytea NOT NULL, state smallint NOT NULL, owner bytea NOT NULL, fence int8 NOT NULL,"
                       " lease_expires int8 NOT NULL, record_expires int8 NOT NULL, claim_kind smallint NOT NULL,"
                       " decision_id bytea, model_digest bytea, policy_revision bytea, result bytea,"
                       " error_code int8 NOT NULL DEFAULT 0, error_message bytea, committed_at int8 NOT NULL DEFAULT 0,"
                       " PRIMARY KEY (tenant, endpoint, key))"),
          absl::StrCat("CREATE TABLE ", schema,
                       ".lease (work_key bytea PRIMARY KEY, owner bytea NOT NULL, fence int8 NOT NULL,"
                       " expires int8 NOT NULL, held bool NOT NULL, claim_kind smallint NOT NULL)"),
          absl::StrCat("CREATE TABLE ", schema,
                       ".result (key bytea PRIMARY KEY, value bytea NOT NULL, saved_at int8 NOT NULL,"
                       " expires int8 NOT NULL)"),
      };
    };
    if (absl::Status s = detail::pg_create_or_check(**made, plan, options_.command_timeout, who_, tables); !s.ok())
      return s;
    // The setup connection is not prepared for operations; let it go and
    // make the pool's first connection now, so open() reports a broken setup.
    absl::StatusOr<detail::client_pool<detail::pg_connection>::handle> h = pool_.acquire(options_.acquire_timeout, who_);
    return h.ok() ? absl::OkStatus() : h.status();
  }

  // One operation: a connection from the pool (replaced if the server
  // closed it while idle), one statement.
  template <int N>
  absl::StatusOr<detail::pg_result> run(const char* stmt, const detail::pg_params<N>& p, detail::pg_effect effect) {
    return detail::pg_run_pooled(pool_, options_.acquire_timeout, options_.command_timeout, who_, round_trips_, stmt,
                                 p, effect,
                                 options_.end_abandoned_writes && options_.pooling == postgres_pooling::session);
  }

  // A fenced write on a record; `done_state` is the state a repeat of it
  // finds (-1: none, extend is not repeatable-by-state).
  template <int N>
  absl::Status fenced_record(const char* stmt, const detail::pg_params<N>& p, const ownership& token,
                             std::string_view op, std::int64_t done_state) {
    for (int attempt = 0; attempt < max_races; ++attempt) {
      absl::StatusOr<detail::pg_result> r = run(stmt, p, detail::pg_effect::write);
      if (!r.ok()) return r.status();
      if (r->rows() == 0)
        return lost_ownership_error(absl::StrCat(detail::to_absl(op), " by fence ", token.fence,
                                                 ": no live record for this key (expired or never claimed)"));
      const detail::pg_result& x = *r;
      if (x.integer(0, 0) == 0) return absl::OkStatus();
      const std::int64_t state = x.integer(0, 1);
      const bool same_owner = x.integer(0, 2) != 0;
      const std::int64_t fence = x.integer(0, 3);
      const bool live = x.integer(0, 4) > 0;
      if (!live)
        return lost_ownership_error(absl::StrCat(detail::to_absl(op), " by fence ", token.fence,
                                                 ": no live record for this key (expired or never claimed)"));
      const bool holder = same_owner && fence == token.fence;
      if (holder && state == in_flight) continue;  // it matched in the snapshot: it changed under us
      if (holder && state == done_state) return absl::OkStatus();  // a repeat
      const std::string_view name = state == in_flight ? "in flight" : state == committed ? "committed" : "abandoned";
      return lost_ownership_error(absl::StrCat(detail::to_absl(op), " by fence ", token.fence, ": the record is ",
                                               detail::to_absl(name), " under fence ", fence,
                                               fence == token.fence ? " and another owner" : ""));
    }
    return raced(op);
  }

  template <int N>
  absl::Status fenced_lease(const char* stmt, const detail::pg_params<N>& p, const ownership& token,
                            std::string_view op, bool release) {
    for (int attempt = 0; attempt < max_races; ++attempt) {
      absl::StatusOr<detail::pg_result> r = run(stmt, p, detail::pg_effect::write);
      if (!r.ok()) return r.status();
      if (r->rows() == 0)
        return lost_ownership_error(
            absl::StrCat(detail::to_absl(op), " by fence ", token.fence, ": no lease for this key"));
      const detail::pg_result& x = *r;
      if (x.integer(0, 0) == 0) return absl::OkStatus();
      const bool held = x.integer(0, 1) != 0;
      const bool holder = x.integer(0, 2) != 0 && x.integer(0, 3) == token.fence;
      if (holder && held) continue;  // changed under us
      if (holder && !held && release) return absl::OkStatus();  // a repeated release
      return lost_ownership_error(absl::StrCat(detail::to_absl(op), " by fence ", token.fence, ": the lease is ",
                                               held ? "held" : "free", " at fence ", x.integer(0, 3),
                                               held && x.integer(0, 3) == token.fence ? " by another owner" : ""));
    }
    return raced(op);
  }

  postgres_options options_;
  std::string who_;
  detail::client_pool<detail::pg_connection> pool_;
  std::atomic<std::uint64_t> round_trips_{0};
};

static_assert(idempotency_store<postgres_store>);
static_assert(lease_store<postgres_store>);
static_assert(result_store<postgres_store>);

}  // namespace keel
