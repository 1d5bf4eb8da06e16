// keel/store/internal/pg_store.hpp — what every keel PostgreSQL store (the
// idempotency/lease/result store, the job store) does the same way: run one
// prepared statement on a pooled connection, and create or check the tables
// it keeps in its schema.
//
//   absl::StatusOr<pg_result> r = detail::pg_run_pooled(pool, acquire_timeout, command_timeout, who,
//                                                       round_trips, stmt, params, pg_effect::write);
//
// Schema setup:
//
//   in one transaction, under an advisory lock on the schema name (replicas
//   starting together do not race): the component's meta table present ->
//   its version must match; absent but the schema holds other relations ->
//   refused, nothing changed; absent and create allowed -> CREATE SCHEMA
//   (when missing), the meta table with the version, then the tables.
//
//   detail::pg_schema_plan plan{.schema = "keel", .meta_table = "keel_meta", .version = 1, ...};
//   absl::Status s = detail::pg_create_or_check(conn, plan, timeout, who,
//       [](const std::string& schema) { return std::vector<std::string>{"CREATE TABLE " + schema + ".t (...)"}; });
//
// Thread-safety: pg_run_pooled from any thread (the pool lends each
// connection to one holder); pg_create_or_check uses the one connection it
// is given.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "keel/core/clock.hpp"
#include "keel/core/status.hpp"
#include "keel/store/internal/client_pool.hpp"
#include "keel/store/internal/pg_connection.hpp"

namespace keel::detail {

// Ends the server session `pid` (pg_terminate_backend) from an idle pooled
// connection, if one is idle, within min(command_timeout, 250 ms): a write
// abandoned at its timeout must not run on in the server, holding its row
// locks. A commit waiting for a synchronous standby (wait event SyncRep)
// ignores statement_timeout and the client's going away, and would wait
// until the standby is back. Never waits for a connection, never connects
// (the server may be frozen), never reports: it is a courtesy.
inline void pg_end_session(client_pool<pg_connection>& pool, int pid, duration command_timeout) {
  if (pid <= 0) return;
  std::optional<client_pool<pg_connection>::handle> side = pool.try_idle();
  if (!side) return;
  const std::string p = std::to_string(pid);
  pg_params<1> args;
  args.add(p);
  const duration bound = std::min<duration>(command_timeout, std::chrono::milliseconds(250));
  (void)(*side)->exec("SELECT pg_terminate_backend($1::text::int4)", args, pg_effect::read, bound);
  if ((*side)->broken()) side->mark_broken();
}

// One operation: a pooled connection (replaced if the server closed it while
// idle), one prepared statement under the command timeout. A connection the
// statement broke goes back marked broken and is not lent again.
// `end_abandoned`: a write abandoned at command_timeout has its server
// session ended (pg_end_session), which delays the caller's answer by at
// most 250 ms.
template <int N>
absl::StatusOr<pg_result> pg_run_pooled(client_pool<pg_connection>& pool, duration acquire_timeout,
                                        duration command_timeout, std::string_view who,
                                        std::atomic<std::uint64_t>& round_trips, const char* stmt,
                                        const pg_params<N>& p, pg_effect effect, bool end_abandoned = true) {
  absl::StatusOr<client_pool<pg_connection>::handle> h = pool.acquire_alive(acquire_timeout, who);
  if (!h.ok()) return h.status();
  round_trips.fetch_add(1, std::memory_order_relaxed);
  absl::StatusOr<pg_result> r = (*h)->exec_prepared(stmt, p, effect, command_timeout);
  if ((*h)->broken()) h->mark_broken();
  if (end_abandoned && (*h)->abandoned() && effect == pg_effect::write) {
    const int pid = PQbackendPID((*h)->raw());
    *h = client_pool<pg_connection>::handle{};  // discarded (broken): its socket closes now
    pg_end_session(pool, pid, command_timeout);
  }
  return r;
}

struct pg_schema_plan {
  std::string_view schema;          // unquoted; validated by the store's options
  std::string_view meta_table;      // the component's own meta table, e.g. "keel_meta"
  std::int64_t version = 0;         // what this keel writes and expects
  std::string_view version_words;   // "the schema holds <version_words> 3; ..."
  std::string_view not_ours;        // why a schema with other relations is refused
  std::string_view absent;          // "<absent> and create_schema is off"
  bool create = true;               // the store's create_schema option
};

// `tables(quoted_schema)` gives the component's DDL after the meta table.
template <class Tables>
absl::Status pg_create_or_check(pg_connection& c, const pg_schema_plan& plan, duration command_timeout,
                                std::string_view who, Tables&& tables) {
  // Schema changes may wait on other sessions' locks: longer than one operation.
  const duration t = std::max<duration>(command_timeout, std::chrono::seconds(30));
  const std::string schema = c.quote_identifier(plan.schema);
  const std::string meta = absl::StrCat(schema, ".", to_absl(plan.meta_table));  // pg_params keeps a view
  auto exec = [&](std::string_view sql) -> absl::Status {
    auto r = c.exec(sql, pg_effect::write, t);
    return r.ok() ? absl::OkStatus() : r.status();
  };
  absl::StatusOr<pg_transaction> tx = pg_transaction::begin(c, t);
  if (!tx.ok()) return tx.status();
  absl::Status s = [&]() -> absl::Status {
    pg_params<1> name;
    name.add(plan.schema);
    if (auto r = c.exec("SELECT pg_advisory_xact_lock(1801807212, hashtext($1::text))", name, pg_effect::write, t);
        !r.ok())
      return r.status();
    pg_params<2> q;
    q.add(plan.schema).add(meta);
    auto look = c.exec(
        "SELECT (SELECT count(*) FROM pg_namespace WHERE nspname = $1::text),"
        " to_regclass($2::text) IS NOT NULL,"
        " (SELECT count(*) FROM pg_class k JOIN pg_namespace n ON n.oid = k.relnamespace WHERE n.nspname = $1::text)",
        q, pg_effect::read, t);
    if (!look.ok()) return look.status();
    const bool schema_exists = look->integer(0, 0) > 0;
    const bool has_meta = look->integer(0, 1) != 0;
    const std::int64_t relations = look->integer(0, 2);
    if (has_meta) {
      auto v = c.exec(absl::StrCat("SELECT schema_version::int8 FROM ", meta), pg_effect::read, t);
      if (!v.ok()) return v.status();
      if (v->rows() != 1 || v->integer(0, 0) != plan.version)
        return absl::FailedPreconditionError(absl::StrCat(
            "keel: ", to_absl(who), ": the schema holds ", to_absl(plan.version_words), " ",
            v->rows() == 1 ? absl::StrCat(v->integer(0, 0)) : std::string("(none)"), "; this keel uses version ",
            plan.version, ". Nothing was changed."));
      return absl::OkStatus();
    }
    if (relations > 0)
      return absl::FailedPreconditionError(absl::StrCat("keel: ", to_absl(who), ": the schema exists and holds ",
                                                        relations, " relations but no ", to_absl(plan.meta_table),
                                                        " table: ", to_absl(plan.not_ours), ". Nothing was changed."));
    if (!plan.create)
      return absl::FailedPreconditionError(
          absl::StrCat("keel: ", to_absl(who), ": ", to_absl(plan.absent), " and create_schema is off"));
    std::vector<std::string> ddl;
    if (!schema_exists) ddl.push_back(absl::StrCat("CREATE SCHEMA ", schema));
    ddl.push_back(absl::StrCat("CREATE TABLE ", meta,
                               " (singleton bool PRIMARY KEY DEFAULT true CHECK (singleton),"
                               " schema_version int NOT NULL, created_at timestamptz NOT NULL DEFAULT now())"));
    ddl.push_back(absl::StrCat("INSERT INTO ", meta, " (schema_version) VALUES (", plan.version, ")"));
    for (std::string& stmt : tables(schema)) ddl.push_back(std::move(stmt));
    for (const std::string& stmt : ddl) {
      if (absl::Status e = exec(stmt); !e.ok()) return e;
    }
    return absl::OkStatus();
  }();
  if (!s.ok()) return s;  // rolled back by tx
  return tx->commit();
}

}  // namespace keel::detail
