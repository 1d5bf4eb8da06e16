// keel::postgres_store against a real PostgreSQL server (started by the
// postgres_server CTest fixture): the conformance suite, schema checks,
// bad input and faults.
#include "keel/store/postgres.hpp"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <libpq-fe.h>

#include "keel/testing/store_conformance.hpp"
#include "support/scaleout.hpp"
#include "support/catch.hpp"
#include "support/loopback.hpp"

using namespace std::chrono_literals;

namespace {

std::unique_ptr<keel::postgres_store> open_pg(keel::postgres_options o) {
  auto s = keel::postgres_store::open(std::move(o));
  if (!s.ok()) throw std::runtime_error(std::string(s.status().ToString()));
  return std::move(*s);
}

keel::postgres_options pg_options(std::string schema) {
  return keel::postgres_options{.conninfo = keel_scaleout::pg_conninfo(), .schema = std::move(schema), .pool_size = 4};
}

// Runs SQL on a plain libpq connection (to tamper with a schema).
[[maybe_unused]] void raw_sql(const std::string& sql) {
  PGconn* c = PQconnectdb(keel_scaleout::pg_conninfo().c_str());
  REQUIRE(PQstatus(c) == CONNECTION_OK);
  PGresult* r = PQexec(c, sql.c_str());
  const ExecStatusType st = PQresultStatus(r);
  INFO(PQresultErrorMessage(r));
  PQclear(r);
  PQfinish(c);
  REQUIRE((st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK));
}

}  // namespace

TEST_CASE("the PostgreSQL store passes the conformance suite", "[scaleout][postgres][conformance]") {
  // Both fence modes: previous + 1, and from the server's clock (only "above the previous").
  const bool clock_fences = GENERATE(false, true);
  CAPTURE(clock_fences);
  auto offset = std::make_shared<std::atomic<std::int64_t>>(0);
  keel::testing::store_harness<keel::postgres_store> h{
      .make =
          [&] {
            keel::postgres_options o = pg_options(keel_scaleout::fresh_name("conf"));
            o.testing_clock_offset = offset;
            o.fences = clock_fences ? keel::postgres_fences::from_clock : keel::postgres_fences::sequential;
            return std::shared_ptr<keel::postgres_store>(open_pg(std::move(o)));
          },
      .advance = [&](keel::duration d) { offset->fetch_add(keel::detail::to_ns(d)); },
      .step_back = [&](keel::duration d) { offset->fetch_sub(keel::detail::to_ns(d)); },
      // Another store object (its own pool and connections) on the same schema:
      // what another replica has.
      .peer = [&](keel::postgres_store& s) { return std::shared_ptr<keel::postgres_store>(open_pg(s.options())); },
      .purge =
          [](keel::postgres_store& s) {
            if (auto n = s.purge_expired(); !n.ok()) throw std::runtime_error(n.status().ToString());
          },
      .server_clock = true,
      .dense_fences = !clock_fences,
  };
  const std::vector<std::string> names = keel::testing::conformance_checks<keel::postgres_store>();
  REQUIRE(names.size() == 43);
  for (const std::string& name : names) {
    SECTION(name) {
      const keel::testing::conformance_report r = keel::testing::run_store_conformance(h, name);
      for (const auto& f : r.failures) FAIL_CHECK(f.check << " (line " << f.line << "): " << f.message);
      if (name.find("while the clock is behind") != std::string::npos) {
        // No high-water mark of the server's clock: keel::testing::server_clock_reason.
        REQUIRE(r.skipped.size() == 1);
        CHECK(r.skipped[0].find(keel::testing::server_clock_reason) != std::string::npos);
      } else {
        CHECK(r.passed.size() == 1);
      }
    }
  }
}

namespace {

// A plain libpq session for the test's own SQL (locks, catalog queries).
class raw_pg {
 public:
  raw_pg() : c_(PQconnectdb(keel_scaleout::pg_conninfo().c_str())) {
    if (PQstatus(c_) != CONNECTION_OK) throw std::runtime_error(PQerrorMessage(c_));
  }
  ~raw_pg() { PQfinish(c_); }
  raw_pg(const raw_pg&) = delete;
  raw_pg& operator=(const raw_pg&) = delete;

  // Runs `sql`; the first column of the first row ("" if none).
  std::string exec(const std::string& sql) {
    PGresult* r = PQexec(c_, sql.c_str());
    const ExecStatusType st = PQresultStatus(r);
    std::string out = (st == PGRES_TUPLES_OK && PQntuples(r) > 0) ? PQgetvalue(r, 0, 0) : "";
    const std::string err = PQresultErrorMessage(r);
    PQclear(r);
    if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK) throw std::runtime_error(sql + ": " + err);
    return out;
  }

 private:
  PGconn* c_;
};

// Polls (real time, bounded) until pred() holds: how a test learns that the
// server reached a state (a statement blocked on a lock, a session gone).
template <class Pred>
bool eventually(Pred pred, std::chrono::milliseconds limit = 10s) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(2ms);
  }
  return true;
}

int blocked_sessions(raw_pg& admin, const keel::postgres_store& s) {
  return std::stoi(admin.exec("SELECT count(*) FROM pg_stat_activity WHERE application_name = '" +
                              s.application_name() + "' AND wait_event_type = 'Lock'"));
}

const keel::request_identity receipt{.tenant = "merchant-82", .endpoint = "receipts", .key = "key-47"};
keel::digest receipt_a() { return keel::digest_builder().field("receipt", "A").finish(); }
const keel::begin_options bo{.lease = 10s, .retention = 60s};
keel::decision decided(std::string id) {
  return keel::decision{.id = std::move(id), .model_digest = "m-large", .result = "approve"};
}


}  // namespace

TEST_CASE("postgres options are validated, naming the field and the rule", "[scaleout][postgres]") {
  const std::pair<keel::postgres_options, std::string> bad[] = {
      {{.conninfo = ""}, "postgres_options.conninfo must not be empty (got \"\")"},
      {{.conninfo = "host=x", .schema = ""}, "postgres_options.schema must be 1-63 bytes (got 0)"},
      {{.conninfo = "host=x", .schema = std::string(64, 's')}, "postgres_options.schema must be 1-63 bytes (got 64)"},
      {{.conninfo = "host=x", .schema = "Bad-Name"},
       "postgres_options.schema must match [a-z_][a-z0-9_]* (got \"Bad-Name\")"},
      {{.conninfo = "host=x", .schema = "x'; DROP SCHEMA public; --"},
       "postgres_options.schema must match [a-z_][a-z0-9_]* (got \"x'; DROP SCHEMA public; --\")"},
      {{.conninfo = "host=x", .schema = "9lives"}, "postgres_options.schema must match [a-z_][a-z0-9_]* (got \"9lives\")"},
      {{.conninfo = "host=x", .pool_size = 0}, "postgres_options.pool_size must be in [1, 1000] (got 0)"},
      {{.conninfo = "host=x", .pool_size = 1001}, "postgres_options.pool_size must be in [1, 1000] (got 1001)"},
      {{.conninfo = "host=x", .connect_timeout = 0ms},
       "postgres_options.connect_timeout must be in [1ms, 1h] (got 0s)"},
      {{.conninfo = "host=x", .command_timeout = 0ms},
       "postgres_options.command_timeout must be in [1ms, 1h] (got 0s)"},
      {{.conninfo = "host=x", .command_timeout = 61min},
       "postgres_options.command_timeout must be in [1ms, 1h] (got 3660s)"},
      {{.conninfo = "host=x", .acquire_timeout = -1ms},
       "postgres_options.acquire_timeout must be in [0, 1h] (got -1ms)"},
  };
  for (const auto& [o, message] : bad) {
    const absl::Status v = o.validate();
    CHECK(v.code() == absl::StatusCode::kInvalidArgument);
    CHECK(std::string(v.message()) == message);
    CHECK(keel::postgres_store::open(o).status() == v);  // refused before connecting, with the same status
  }
  // The edges of each range are accepted.
  CHECK(keel::postgres_options{.conninfo = "host=x", .schema = "_ok_9"}.validate().ok());
  CHECK(keel::postgres_options{.conninfo = "host=x", .schema = std::string(63, 's'), .pool_size = 1000}.validate().ok());
  CHECK(keel::postgres_options{.conninfo = "host=x", .connect_timeout = 1s, .command_timeout = 1ms,
                               .acquire_timeout = 0ms}
            .validate()
            .ok());
}

TEST_CASE("postgres: a server nobody listens on is unavailable and nothing started", "[scaleout][postgres][faults]") {
  const auto t0 = std::chrono::steady_clock::now();
  auto s = keel::postgres_store::open(
      {.conninfo = "host=127.0.0.1 port=" + std::to_string(keel_test::unused_loopback_port()) + " user=keel dbname=postgres",
       .schema = keel_scaleout::fresh_name("down")});
  REQUIRE_FALSE(s.ok());
  INFO(s.status().ToString());
  CHECK(s.status().code() == absl::StatusCode::kUnavailable);
  CHECK(keel::not_started(s.status()));
  CHECK(keel::default_classifier{}(s.status(), {.effect = keel::effect::write}) == keel::outcome_kind::transient);
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);  // refused at once, not after the connect timeout
}

TEST_CASE("postgres: refused credentials are permanent, a missing database is a precondition",
          "[scaleout][postgres][faults]") {
  const std::string base = keel_scaleout::pg_conninfo();
  auto role = keel::postgres_store::open({.conninfo = base + " user=keel_no_such_role", .schema = "k"});
  REQUIRE_FALSE(role.ok());
  INFO(role.status().ToString());
  CHECK(role.status().code() == absl::StatusCode::kPermissionDenied);
  CHECK(keel::default_classifier{}(role.status(), {}) == keel::outcome_kind::permanent);
  auto db = keel::postgres_store::open({.conninfo = base + " dbname=keel_no_such_db", .schema = "k"});
  REQUIRE_FALSE(db.ok());
  INFO(db.status().ToString());
  CHECK(db.status().code() == absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("postgres: another schema version, a foreign schema, or a missing one with create off is refused untouched",
          "[scaleout][postgres][faults]") {
  raw_pg admin;
  SECTION("another keel schema version") {
    const std::string schema = keel_scaleout::fresh_name("ver");
    {
      auto s = open_pg(pg_options(schema));
      REQUIRE(s->save_result("kept", "v", 0s).value_or(false));
    }
    admin.exec("UPDATE " + schema + ".keel_meta SET schema_version = 99");
    auto again = keel::postgres_store::open(pg_options(schema));
    REQUIRE_FALSE(again.ok());
    INFO(again.status().ToString());
    CHECK(again.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK(std::string(again.status().message()).find("version 99") != std::string::npos);
    CHECK(admin.exec("SELECT value FROM " + schema + ".result WHERE key = 'kept'") == "\\x76");
  }
  SECTION("a schema holding someone else's tables") {
    const std::string schema = keel_scaleout::fresh_name("foreign");
    admin.exec("CREATE SCHEMA " + schema + "; CREATE TABLE " + schema + ".orders (id int); INSERT INTO " + schema +
               ".orders VALUES (7)");
    auto s = keel::postgres_store::open(pg_options(schema));
    REQUIRE_FALSE(s.ok());
    INFO(s.status().ToString());
    CHECK(s.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK(admin.exec("SELECT count(*) FROM pg_tables WHERE schemaname = '" + schema + "'") == "1");
    CHECK(admin.exec("SELECT id FROM " + schema + ".orders") == "7");
  }
  SECTION("no schema and create_schema off") {
    keel::postgres_options o = pg_options(keel_scaleout::fresh_name("absent"));
    o.create_schema = false;
    auto s = keel::postgres_store::open(o);
    REQUIRE_FALSE(s.ok());
    CHECK(s.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK(admin.exec("SELECT count(*) FROM pg_namespace WHERE nspname = '" + o.schema + "'") == "0");
  }
  SECTION("replicas opening a new schema at once all succeed") {
    const std::string schema = keel_scaleout::fresh_name("race");
    std::vector<absl::Status> got(6);
    {
      std::vector<std::jthread> threads;
      for (std::size_t i = 0; i < got.size(); ++i)
        threads.emplace_back([&, i] { got[i] = keel::postgres_store::open(pg_options(schema)).status(); });
    }
    for (const absl::Status& s : got) CHECK(s.ok());
  }
}

TEST_CASE("postgres: SQL in keys and values is data, never code", "[scaleout][postgres]") {
  auto s = open_pg(pg_options(keel_scaleout::fresh_name("inject")));
  const std::string evil = "x'); DROP TABLE idempotency; --";
  const keel::request_identity id{.tenant = evil, .endpoint = "$1 ' \" \\", .key = "'; DELETE FROM result; --"};
  auto b = s->begin(id, receipt_a(), keel::owner_id::random(), bo);
  REQUIRE(b.ok());
  REQUIRE(b->state == keel::begin_state::claimed);
  keel::decision d = decided("dec-'; --");
  d.result = evil;
  REQUIRE(s->commit(id, b->ownership, d, 60s).ok());
  REQUIRE(s->save_result(evil, evil, 0s).value_or(false));
  auto r = s->begin(id, receipt_a(), keel::owner_id::random(), bo);
  REQUIRE(r.ok());
  CHECK(r->state == keel::begin_state::replay);
  CHECK(r->decision == d);
  auto l = s->load_result(evil);
  REQUIRE(l.ok());
  CHECK(l->value_or("") == evil);
}

TEST_CASE("postgres: purging while owners claim and release one key never sends its fence backwards",
          "[scaleout][postgres]") {
  // A claim of a key with no row reads the floor and inserts in one
  // statement; a purge running between the two must not let it insert below
  // the fence it deleted (purge locks the tables first).
  keel::postgres_options o = pg_options(keel_scaleout::fresh_name("purgerace"));
  o.pool_size = 6;
  auto s = open_pg(std::move(o));
  constexpr int claimers = 4, rounds = 150;
  std::atomic<std::int64_t> last{0};
  std::atomic<int> acquired{0}, backwards{0}, errors{0}, done{0};
  std::atomic<std::int64_t> purged{0};
  {
    std::vector<std::jthread> threads;
    threads.emplace_back([&] {
      while (done.load() < claimers) {
        auto n = s->purge_expired();
        if (n.ok()) purged += *n; else ++errors;
      }
    });
    for (int t = 0; t < claimers; ++t)
      threads.emplace_back([&] {
        for (int i = 0; i < rounds; ++i) {
          auto c = s->claim("hot", keel::owner_id::random(), 60s);
          if (!c.ok()) {
            ++errors;
            continue;
          }
          if (!c->acquired) continue;
          // One holder at a time (nobody's lease expires): the previous
          // holder stored its fence before it released.
          if (c->ownership.fence <= last.load()) ++backwards;
          last.store(c->ownership.fence);
          ++acquired;
          if (!s->release("hot", c->ownership).ok()) ++errors;
        }
        ++done;
      });
  }
  INFO("acquired " << acquired.load() << ", rows purged " << purged.load() << ", last fence " << last.load());
  CHECK(errors.load() == 0);
  CHECK(backwards.load() == 0);
  CHECK(acquired.load() >= rounds);
  CHECK(purged.load() > 0);
}

TEST_CASE("postgres: an idle connection the server closed is replaced before use", "[scaleout][postgres][faults]") {
  keel::postgres_options o = pg_options(keel_scaleout::fresh_name("idle"));
  o.pool_size = 1;
  auto s = open_pg(o);
  REQUIRE(s->save_result("before", "v", 0s).value_or(false));
  raw_pg admin;
  const std::string mine = "application_name = '" + s->application_name() + "'";
  CHECK(admin.exec("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE " + mine) == "1");
  REQUIRE(eventually([&] { return admin.exec("SELECT count(*) FROM pg_stat_activity WHERE " + mine) == "0"; }));
  const std::uint64_t before = s->round_trips();
  auto l = s->load_result("before");
  REQUIRE(l.ok());
  CHECK(l->value_or("") == "v");
  CHECK(s->round_trips() == before + 1);  // no failed attempt: the dead session was noticed before sending
}

TEST_CASE("postgres: a commit whose connection drops is an unknown outcome, and repeating it settles it",
          "[scaleout][postgres][faults]") {
  const std::string schema = keel_scaleout::fresh_name("drop");
  keel::postgres_options o = pg_options(schema);
  o.pool_size = 1;
  auto s = open_pg(o);
  auto b = s->begin(receipt, receipt_a(), keel::owner_id::random(), bo);
  REQUIRE(b.ok());
  raw_pg locker, admin;
  locker.exec("BEGIN; SELECT 1 FROM " + schema + ".idempotency FOR UPDATE");
  absl::Status commit;
  std::jthread t([&] { commit = s->commit(receipt, b->ownership, decided("dec-1"), 60s); });
  REQUIRE(eventually([&] { return blocked_sessions(admin, *s) == 1; }));
  admin.exec("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = '" +
             s->application_name() + "'");
  t.join();
  locker.exec("ROLLBACK");
  INFO(commit.ToString());
  CHECK(keel::is_unknown_outcome(commit));
  CHECK(keel::default_classifier{}(commit, {.effect = keel::effect::write}) == keel::outcome_kind::ambiguous);
  // The truth: the killed statement did not commit; the record is still ours.
  auto other = s->begin(receipt, receipt_a(), keel::owner_id::random(), bo);
  REQUIRE(other.ok());
  CHECK(other->state == keel::begin_state::in_flight);
  CHECK(s->commit(receipt, b->ownership, decided("dec-1"), 60s).ok());
  CHECK(s->commit(receipt, b->ownership, decided("dec-1"), 60s).ok());  // and again: a repeat
  auto r = s->begin(receipt, receipt_a(), keel::owner_id::random(), bo);
  REQUIRE(r.ok());
  CHECK((r->state == keel::begin_state::replay && r->decision.id == "dec-1"));
}

TEST_CASE("postgres: past the command timeout a write is an unknown outcome and a read is transient",
          "[scaleout][postgres][faults]") {
  const std::string schema = keel_scaleout::fresh_name("slow");
  keel::postgres_options o = pg_options(schema);
  o.command_timeout = 300ms;
  auto s = open_pg(o);
  auto b = s->begin(receipt, receipt_a(), keel::owner_id::random(), bo);
  REQUIRE(b.ok());
  REQUIRE(s->save_result("r", "v", 0s).value_or(false));
  raw_pg locker;
  locker.exec("BEGIN; SELECT 1 FROM " + schema + ".idempotency FOR UPDATE");
  const absl::Status commit = s->commit(receipt, b->ownership, decided("dec-1"), 60s);
  INFO(commit.ToString());
  CHECK(keel::is_unknown_outcome(commit));
  CHECK(std::string(commit.message()).find("command timeout") != std::string::npos);
  locker.exec("ROLLBACK");
  REQUIRE(s->load_result("r").ok());  // a fresh session, prepared before the table is locked
  locker.exec("BEGIN; LOCK TABLE " + schema + ".result IN ACCESS EXCLUSIVE MODE");
  auto l = s->load_result("r");
  INFO(l.status().ToString());
  CHECK(l.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK_FALSE(keel::is_unknown_outcome(l.status()));
  CHECK(keel::default_classifier{}(l.status(), {.effect = keel::effect::read}) == keel::outcome_kind::transient);
  locker.exec("ROLLBACK");
  // The timed-out sessions were discarded; the store carries on.
  CHECK(s->commit(receipt, b->ownership, decided("dec-1"), 60s).ok());
  CHECK(s->load_result("r").value_or(std::nullopt) == std::optional<std::string>("v"));
}

TEST_CASE("postgres: the pool never exceeds pool_size and refuses after acquire_timeout",
          "[scaleout][postgres][faults]") {
  const std::string schema = keel_scaleout::fresh_name("pool");
  keel::postgres_options o = pg_options(schema);
  o.pool_size = 2;
  o.acquire_timeout = 200ms;
  auto s = open_pg(o);
  auto b = s->begin(receipt, receipt_a(), keel::owner_id::random(), bo);
  REQUIRE(b.ok());
  raw_pg locker, admin;
  locker.exec("BEGIN; SELECT 1 FROM " + schema + ".idempotency FOR UPDATE");
  std::vector<absl::Status> extended(2);
  {
    std::vector<std::jthread> holders;
    for (int i = 0; i < 2; ++i) holders.emplace_back([&, i] { extended[i] = s->extend(receipt, b->ownership, 20s); });
    REQUIRE(eventually([&] { return blocked_sessions(admin, *s) == 2; }));
    CHECK(s->connections() == 2);
    const auto t0 = std::chrono::steady_clock::now();
    auto l = s->load_result("anything");
    INFO(l.status().ToString());
    CHECK(l.status().code() == absl::StatusCode::kUnavailable);
    CHECK(keel::not_started(l.status()));
    CHECK(std::chrono::steady_clock::now() - t0 >= 200ms);
    locker.exec("ROLLBACK");
  }
  CHECK(extended[0].ok());
  CHECK(extended[1].ok());
  CHECK(s->connections() == 2);
}

TEST_CASE("postgres: begin and claim are one round trip each, reading the fence floor inside the statement",
          "[scaleout][postgres]") {
  auto offset = std::make_shared<std::atomic<std::int64_t>>(0);
  keel::postgres_options o = pg_options(keel_scaleout::fresh_name("trips"));
  o.testing_clock_offset = offset;
  auto s = open_pg(std::move(o));
  // A lease and a record that end, are purged (raising the floor), and are
  // claimed again from no row: the floor read is part of the one statement.
  auto c1 = s->claim("job-7", keel::owner_id::random(), 60s);
  REQUIRE((c1.ok() && c1->acquired));
  REQUIRE(s->release("job-7", c1->ownership).ok());
  auto b1 = s->begin(receipt, receipt_a(), keel::owner_id::random(), bo);
  REQUIRE((b1.ok() && b1->state == keel::begin_state::claimed));
  offset->fetch_add(keel::detail::to_ns(1h));
  auto purged = s->purge_expired();
  REQUIRE(purged.ok());
  REQUIRE(*purged == 2);

  std::uint64_t before = s->round_trips();
  auto c2 = s->claim("job-7", keel::owner_id::random(), 60s);
  CHECK(s->round_trips() == before + 1);
  REQUIRE((c2.ok() && c2->acquired));
  CHECK(c2->ownership.fence > c1->ownership.fence);
  before = s->round_trips();
  auto b2 = s->begin(receipt, receipt_a(), keel::owner_id::random(), bo);
  CHECK(s->round_trips() == before + 1);
  REQUIRE((b2.ok() && b2->state == keel::begin_state::claimed));
  CHECK(b2->ownership.fence > b1->ownership.fence);
}

namespace {
std::unique_ptr<keel::detail::pg_connection> raw_connection() {
  auto c = keel::detail::pg_connection::connect(keel_scaleout::pg_conninfo(), 5s, "keel-test", "test connection");
  if (!c.ok()) throw std::runtime_error(std::string(c.status().ToString()));
  return std::move(*c);
}
}  // namespace

TEST_CASE("postgres: a transaction commits only when told to and rolls back on every other way out",
          "[scaleout][postgres]") {
  using keel::detail::pg_effect;
  using keel::detail::pg_transaction;
  auto c = raw_connection();
  raw_pg admin;
  const std::string table = keel_scaleout::fresh_name("tx");
  auto exists = [&] { return admin.exec("SELECT to_regclass('public." + table + "') IS NOT NULL") == "t"; };
  auto idle = [&] { return PQtransactionStatus(c->raw()) == PQTRANS_IDLE; };
  const std::string create = "CREATE TABLE public." + table + " (x int)";

  SECTION("left without commit: rolled back") {
    {
      auto tx = pg_transaction::begin(*c, 5s);
      REQUIRE(tx.ok());
      REQUIRE(c->exec(create, pg_effect::write, 5s).ok());
      CHECK(PQtransactionStatus(c->raw()) == PQTRANS_INTRANS);
    }
    CHECK(idle());
    CHECK_FALSE(c->broken());
    CHECK_FALSE(exists());
  }
  SECTION("left by an exception: rolled back") {
    try {
      auto tx = pg_transaction::begin(*c, 5s);
      REQUIRE(tx.ok());
      REQUIRE(c->exec(create, pg_effect::write, 5s).ok());
      throw std::runtime_error("the caller failed");
    } catch (const std::runtime_error&) {
    }
    CHECK(idle());
    CHECK_FALSE(exists());
  }
  SECTION("a failed statement, then commit: nothing applied, said so, and the session is usable") {
    auto tx = pg_transaction::begin(*c, 5s);
    REQUIRE(tx.ok());
    REQUIRE(c->exec(create, pg_effect::write, 5s).ok());
    CHECK_FALSE(c->exec("SELECT 1 / 0", pg_effect::read, 5s).ok());
    const absl::Status s = tx->commit();
    INFO(s.ToString());
    CHECK(s.code() == absl::StatusCode::kUnavailable);
    CHECK(keel::not_started(s));
    CHECK(idle());
    CHECK_FALSE(exists());
    CHECK(c->exec("SELECT 1", pg_effect::read, 5s).ok());
  }
  SECTION("commit applies; a second commit is refused") {
    auto tx = pg_transaction::begin(*c, 5s);
    REQUIRE(tx.ok());
    REQUIRE(c->exec(create, pg_effect::write, 5s).ok());
    CHECK(tx->commit().ok());
    CHECK(idle());
    CHECK(exists());
    CHECK(tx->commit().code() == absl::StatusCode::kFailedPrecondition);
    admin.exec("DROP TABLE public." + table);
  }
}

namespace {

// A begin-statement result built client-side, as libpq hands it over:
// binary values, nullopt for NULL.
keel::detail::pg_result pg_row(const std::vector<std::optional<std::string>>& values) {
  PGresult* res = PQmakeEmptyPGresult(nullptr, PGRES_TUPLES_OK);
  REQUIRE(res != nullptr);
  std::vector<std::string> names;
  for (std::size_t c = 0; c < values.size(); ++c) names.push_back("c" + std::to_string(c));
  std::vector<PGresAttDesc> attrs;
  for (std::string& n : names)
    attrs.push_back({.name = n.data(), .tableid = 0, .columnid = 0, .format = 1, .typid = 17, .typlen = -1, .atttypmod = -1});
  REQUIRE(PQsetResultAttrs(res, static_cast<int>(attrs.size()), attrs.data()) != 0);
  for (std::size_t c = 0; c < values.size(); ++c) {
    const auto& v = values[c];
    REQUIRE(PQsetvalue(res, 0, static_cast<int>(c), v ? const_cast<char*>(v->data()) : nullptr,
                       v ? static_cast<int>(v->size()) : -1) != 0);
  }
  return keel::detail::pg_result(res);
}

std::string int_be(std::int64_t v, std::size_t width) {
  std::string out(width, '\0');
  for (std::size_t i = 0; i < width; ++i) out[width - 1 - i] = static_cast<char>(static_cast<std::uint64_t>(v) >> (8 * i));
  return out;
}

// The row a committed record answers with (k = 1), with the given fence and error code.
std::vector<std::optional<std::string>> committed_row(std::int64_t fence, std::int64_t code,
                                                      std::optional<std::string> id) {
  return {int_be(1, 4), int_be(fence, 8), int_be(-5, 8), int_be(1, 4), int_be(1, 1), int_be(1000, 8), int_be(0, 1),
          id, std::string(), std::string("rev"), std::string("result"), int_be(code, 8), std::string(), int_be(42, 8)};
}

}  // namespace

// Found while factoring the decoding out for the pg_records fuzz target
// (tests/fuzz/pg_records_fuzz.cpp): the begin row's decision was trusted as
// read, so a status code absl does not have or a NULL decision id came
// back as a replay.
TEST_CASE("a PostgreSQL begin row no keel would write is DataLoss, never an outcome", "[postgres][fuzz]") {
  const keel::request_identity id{.tenant = "t", .endpoint = "e", .key = "k"};
  const keel::owner_id me{1, 2};
  const auto decode = [&](const std::vector<std::optional<std::string>>& row) {
    return keel::detail::pg_begin_outcome(pg_row(row), id, me, {}, "postgres store 'test'");
  };
  const auto good = decode(committed_row(3, 0, "d1"));
  REQUIRE(good.has_value());
  REQUIRE(good->ok());
  CHECK((*good)->state == keel::begin_state::replay);
  CHECK((*good)->decision.id == "d1");
  CHECK((*good)->committed_at_ns == 42);

  struct bad {
    std::vector<std::optional<std::string>> row;
    const char* says;
  };
  const bad cases[] = {
      {committed_row(3, 99, "d1"), "error code 99 is not a status code"},
      {committed_row(3, 0, std::nullopt), "has no decision id"},
      {committed_row(3, 0, ""), "decision id must not be empty"},
      {committed_row(0, 0, "d1"), "fence 0 is outside"},
      {committed_row(INT64_MAX, 0, "d1"), "fence 9223372036854775807 is outside"},
      {{int_be(0, 4), int_be(3, 8)}, "answered 2 columns, not 14"},
  };
  for (const bad& b : cases) {
    INFO(b.says);
    const auto out = decode(b.row);
    REQUIRE(out.has_value());
    REQUIRE(out->status().code() == absl::StatusCode::kDataLoss);
    CHECK(std::string(out->status().message()).find(b.says) != std::string::npos);
  }
  std::vector<std::optional<std::string>> state_nine = committed_row(3, 0, "d1");
  state_nine[3] = int_be(9, 4);
  CHECK(decode(state_nine)->status().code() == absl::StatusCode::kDataLoss);
}
