// keel::postgres_store against a real PostgreSQL server (started by the
// postgres_server CTest fixture): the conformance suite, schema checks,
// bad input and faults.
#include "keel/store/postgres.hpp"

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <libpq-fe.h>

#include "keel/testing/store_conformance.hpp"
#include "scaleout_support.hpp"
#include "support/catch.hpp"

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
  auto offset = std::make_shared<std::atomic<std::int64_t>>(0);
  keel::testing::store_harness<keel::postgres_store> h{
      .make =
          [&] {
            keel::postgres_options o = pg_options(keel_scaleout::fresh_name("conf"));
            o.testing_clock_offset = offset;
            return std::shared_ptr<keel::postgres_store>(open_pg(std::move(o)));
          },
      .advance = [&](keel::duration d) { offset->fetch_add(keel::detail::to_ns(d)); },
      // Another store object (its own pool and connections) on the same schema:
      // what another replica has.
      .peer = [&](keel::postgres_store& s) { return std::shared_ptr<keel::postgres_store>(open_pg(s.options())); },
  };
  const std::vector<std::string> names = keel::testing::conformance_checks<keel::postgres_store>();
  REQUIRE(names.size() == 39);
  for (const std::string& name : names) {
    SECTION(name) {
      const keel::testing::conformance_report r = keel::testing::run_store_conformance(h, name);
      for (const auto& f : r.failures) FAIL_CHECK(f.check << " (line " << f.line << "): " << f.message);
      if (name.find("clock stepping backwards") != std::string::npos) {
        CHECK(r.skipped.size() == 1);  // see docs/scaleout.md: the server's clock is trusted
      } else {
        CHECK(r.passed.size() == 1);
      }
    }
  }
}
