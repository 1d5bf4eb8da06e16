// The job queue on PostgreSQL (the server started by the postgres_server CTest
// fixture): the shared behaviour suite, with a fresh schema per test and the
// server's clock moved by a test-only offset; then fork()ed worker processes
// (each with its own pool) draining one queue, and the schema checks.
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <libpq-fe.h>

#include "support/jobs_suite.hpp"
#include "support/jobs.hpp"
#include "keel/durable/job_queue.hpp"
#include "keel/store/postgres_jobs.hpp"
#include "support/scaleout.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;
using keel::job_state;

namespace {

keel::postgres_options pg_options(std::string schema) {
  return keel::postgres_options{.conninfo = keel_scaleout::pg_conninfo(), .schema = std::move(schema), .pool_size = 4};
}

// A fresh schema per fixture. Time is the server's clock plus `offset`,
// which advance() moves together with the workers' manual clock.
struct postgres_backend {
  using store_type = keel::postgres_job_store;

  keel_jobs::manual_clock clock;
  std::shared_ptr<std::atomic<std::int64_t>> offset = std::make_shared<std::atomic<std::int64_t>>(0);
  std::string schema = keel_scaleout::fresh_name("jobs");

  // Another store object (its own pool and connections) on the same schema:
  // what another replica has.
  std::unique_ptr<store_type> open() {
    keel::postgres_options o = pg_options(schema);
    o.testing_clock_offset = offset;
    auto s = store_type::open(std::move(o));
    if (!s.ok()) throw std::runtime_error(std::string(s.status().ToString()));
    return std::move(*s);
  }
  void advance(keel::duration d) {
    offset->fetch_add(keel::detail::to_ns(d));
    clock.advance(d);
  }
};

void raw_sql(const std::string& sql) {
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

KEEL_JOBS_SUITE(postgres_backend, "postgres", "[postgres]")

TEST_CASE("postgres: fork()ed worker processes with their own pools drain one queue exactly once",
          "[jobs][postgres][process]") {
  keel_durable::temp_dir dir;
  const std::string log_path = dir.file("exec.log");
  const std::string schema = keel_scaleout::fresh_name("jobs_fork");
  constexpr int jobs = 120, procs = 4;
  {
    auto store = keel::postgres_job_store::open(pg_options(schema));
    REQUIRE(store.ok());
    keel::job_queue q(**store, {.queue = "drain"});
    for (int i = 0; i < jobs; ++i) REQUIRE(q.submit("acme", "job-" + std::to_string(i), "p" + std::to_string(i)).ok());
  }  // pool closed before forking: children connect on their own

  int gate[2];
  REQUIRE(::pipe(gate) == 0);
  std::vector<pid_t> children;
  for (int p = 0; p < procs; ++p) {
    children.push_back(keel_jobs::fork_child([&] {
      ::close(gate[1]);
      char c;
      if (::read(gate[0], &c, 1) != 0) return 10;
      auto store = keel::postgres_job_store::open(pg_options(schema));
      if (!store.ok()) return 11;
      keel::job_queue q(**store, {.queue = "drain"});
      keel_jobs::exec_log log(log_path);
      for (;;) {
        absl::StatusOr<std::optional<keel::job_outcome>> r =
            q.run_one([&](const keel::job_context& j) -> absl::StatusOr<std::string> {
              log.record(j.id, j.ownership.fence, "start");
              return "result of " + std::string(j.payload);
            });
        if (!r.ok()) return 12;
        if (!r->has_value()) return 0;
        if ((*r)->lost || (*r)->state != job_state::done) return 13;
        log.record((*r)->id, 0, "done");
      }
    }));
  }
  ::close(gate[0]);
  ::close(gate[1]);
  for (pid_t pid : children) CHECK(keel_durable::wait_child(pid) == 0);

  const auto starts = keel_jobs::exec_log::count(log_path, "start");
  const auto dones = keel_jobs::exec_log::count(log_path, "done");
  CHECK(starts.size() == static_cast<std::size_t>(jobs));
  CHECK(dones.size() == static_cast<std::size_t>(jobs));
  for (const auto& [id, n] : starts) CHECK(n == 1);
  for (const auto& [id, n] : dones) CHECK(n == 1);
  auto store = keel::postgres_job_store::open(pg_options(schema));
  REQUIRE(store.ok());
  absl::StatusOr<keel::job_counts> c = (*store)->counts("drain");
  REQUIRE(c.ok());
  CHECK(c->done == jobs);
  CHECK(c->depth == 0);
}

TEST_CASE("postgres: job tables of another version or a foreign schema are refused untouched",
          "[jobs][postgres][errors]") {
  const std::string schema = keel_scaleout::fresh_name("jobs_schema");
  {
    auto s = keel::postgres_job_store::open(pg_options(schema));
    REQUIRE(s.ok());
    // Reopening a schema it made is fine (a restart, another replica).
    REQUIRE(keel::postgres_job_store::open(pg_options(schema)).ok());
  }
  SECTION("another version") {
    raw_sql("UPDATE " + schema + ".job_meta SET schema_version = 2");
    auto s = keel::postgres_job_store::open(pg_options(schema));
    INFO(s.status().ToString());
    CHECK(s.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK(std::string(s.status().message()).find("job tables of version 2") != std::string::npos);
  }
  SECTION("a schema holding other tables") {
    const std::string foreign = keel_scaleout::fresh_name("jobs_foreign");
    raw_sql("CREATE SCHEMA " + foreign + "; CREATE TABLE " + foreign + ".invoices (id int PRIMARY KEY)");
    auto s = keel::postgres_job_store::open(pg_options(foreign));
    INFO(s.status().ToString());
    CHECK(s.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK(std::string(s.status().message()).find("not a keel job store") != std::string::npos);
  }
  SECTION("bad options name the field") {
    keel::postgres_options o = pg_options("Bad-Schema");
    auto s = keel::postgres_job_store::open(o);
    CHECK(s.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(std::string(s.status().message()).find("postgres_options.schema must match") != std::string::npos);
  }
}
