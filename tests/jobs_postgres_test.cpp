// The job queue on PostgreSQL (the server started by the postgres_server CTest
// fixture): the shared behaviour suite, with a fresh schema per test and the
// server's clock moved by a test-only offset; then fork()ed worker processes
// (each with its own pool) draining one queue, and the schema checks.
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <set>
#include <string>
#include <thread>
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

// The same, on job tables created with ids from the server's clock
// (postgres_job_ids::from_clock).
struct postgres_clock_ids_backend : postgres_backend {
  std::unique_ptr<store_type> open() {
    keel::postgres_options o = pg_options(schema);
    o.testing_clock_offset = offset;
    o.job_ids = keel::postgres_job_ids::from_clock;
    auto s = store_type::open(std::move(o));
    if (!s.ok()) throw std::runtime_error(std::string(s.status().ToString()));
    if ((*s)->job_ids() != keel::postgres_job_ids::from_clock) throw std::runtime_error("not clock ids");
    return std::move(*s);
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
KEEL_JOBS_SUITE(postgres_clock_ids_backend, "postgres, clock ids", "[postgres][clock_ids]")

TEST_CASE("postgres: job ids from the clock strictly increase, are > 0 and near the server's time",
          "[jobs][postgres][clock_ids]") {
  keel::postgres_options o = pg_options(keel_scaleout::fresh_name("jobs_clock"));
  o.job_ids = keel::postgres_job_ids::from_clock;
  auto s = keel::postgres_job_store::open(o);
  REQUIRE(s.ok());
  REQUIRE((*s)->job_ids() == keel::postgres_job_ids::from_clock);
  auto submit = [](keel::postgres_job_store& st, const std::string& queue, const std::string& key) {
    auto r = st.submit({.queue = queue, .tenant = "acme", .key = key}, keel::sha256(key), key,
                       {.max_depth = 1'000'000});
    REQUIRE(r.ok());
    REQUIRE(r->created);
    return r->id;
  };
  // One after another, across queues and store objects (two replicas): each id above the last.
  auto other = keel::postgres_job_store::open(o);
  REQUIRE(other.ok());
  std::vector<std::int64_t> ids;
  for (int i = 0; i < 200; ++i)
    ids.push_back(submit(i % 2 ? **other : **s, i % 3 ? "a" : "b", "k" + std::to_string(i)));
  for (std::size_t i = 1; i < ids.size(); ++i) CHECK(ids[i] > ids[i - 1]);
  CHECK(ids.front() > 0);
  // The clock part: microseconds since 2020-01-01, shifted left 10 bits.
  const std::int64_t now_us =
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count() -
      1'577'836'800'000'000;
  CHECK(std::abs((ids.back() >> 10) - now_us) < 60'000'000);  // the test server is this host: same clock
  // Concurrent submitters (4 threads, 2 stores): every id distinct, every one created.
  std::vector<std::vector<std::int64_t>> got(4);
  std::vector<int> errors(4, 0);
  {
    std::vector<std::jthread> ts;
    for (int t = 0; t < 4; ++t)
      ts.emplace_back([&, t] {
        keel::postgres_job_store& st = t % 2 ? **other : **s;
        for (int i = 0; i < 100; ++i) {
          const std::string key = "c" + std::to_string(t) + "-" + std::to_string(i);
          auto r = st.submit({.queue = "c", .tenant = "acme", .key = key}, keel::sha256(key), key,
                             {.max_depth = 1'000'000});
          if (r.ok() && r->created) got[t].push_back(r->id);
          else ++errors[t];
        }
      });
  }
  std::set<std::int64_t> all(ids.begin(), ids.end());
  std::size_t n = ids.size();
  for (int t = 0; t < 4; ++t) {
    CHECK(errors[t] == 0);
    CHECK(std::is_sorted(got[t].begin(), got[t].end()));  // each thread's ids increase
    for (std::int64_t id : got[t]) CHECK(id > ids.back());
    all.insert(got[t].begin(), got[t].end());
    n += got[t].size();
  }
  CHECK(all.size() == n);
}

TEST_CASE("postgres: a table keeps the job ids it was created with; clock ids on a sequential table are refused",
          "[jobs][postgres][clock_ids][errors]") {
  const std::string schema = keel_scaleout::fresh_name("jobs_kind");
  keel::postgres_options sequential = pg_options(schema);
  keel::postgres_options clock = pg_options(schema);
  clock.job_ids = keel::postgres_job_ids::from_clock;
  {
    auto s = keel::postgres_job_store::open(sequential);
    REQUIRE(s.ok());
    CHECK((*s)->job_ids() == keel::postgres_job_ids::sequential);
  }
  auto refused = keel::postgres_job_store::open(clock);
  INFO(refused.status().ToString());
  CHECK(refused.status().code() == absl::StatusCode::kFailedPrecondition);
  const std::string m(refused.status().message());
  CHECK(m.find("postgres_options.job_ids is from_clock") != std::string::npos);
  CHECK(m.find("table \"" + schema + "\".job") != std::string::npos);
  CHECK(m.find("Nothing was changed") != std::string::npos);

  SECTION("a clock table opened with the default keeps clock ids") {
    const std::string cs = keel_scaleout::fresh_name("jobs_kind_clock");
    keel::postgres_options made = pg_options(cs);
    made.job_ids = keel::postgres_job_ids::from_clock;
    REQUIRE(keel::postgres_job_store::open(made).ok());
    auto s = keel::postgres_job_store::open(pg_options(cs));
    REQUIRE(s.ok());
    CHECK((*s)->job_ids() == keel::postgres_job_ids::from_clock);
    auto r = (*s)->submit({.queue = "q", .tenant = "t", .key = "k"}, keel::sha256("k"), "p", {});
    REQUIRE(r.ok());
    CHECK(r->id > (std::int64_t{1} << 50));
  }
  SECTION("the statements of docs/stores.md convert a sequential table") {
    auto s = keel::postgres_job_store::open(sequential);
    REQUIRE(s.ok());
    auto before = (*s)->submit({.queue = "q", .tenant = "t", .key = "before"}, keel::sha256("b"), "p", {});
    REQUIRE(before.ok());
    raw_sql("BEGIN;"
            " CREATE SEQUENCE " + schema + ".job_id_low;"
            " CREATE FUNCTION " + schema + ".job_clock_id() RETURNS int8 LANGUAGE sql VOLATILE AS $f$"
            " SELECT greatest(coalesce((SELECT max(id) FROM " + schema + ".job), 0) + 1,"
            " (((extract(epoch FROM clock_timestamp()) * 1000000)::int8 - 1577836800000000) << 10)"
            " | (nextval('" + schema + ".job_id_low') & 1023)) $f$;"
            " ALTER TABLE " + schema + ".job ALTER COLUMN id DROP IDENTITY,"
            " ALTER COLUMN id SET DEFAULT " + schema + ".job_clock_id();"
            " COMMIT");
    auto c = keel::postgres_job_store::open(clock);
    INFO(c.status().ToString());
    REQUIRE(c.ok());
    CHECK((*c)->job_ids() == keel::postgres_job_ids::from_clock);
    auto after = (*c)->submit({.queue = "q", .tenant = "t", .key = "after"}, keel::sha256("a"), "p", {});
    REQUIRE(after.ok());
    CHECK(after->id > (std::int64_t{1} << 50));
    CHECK(after->id > before->id);
    // The old job is still there under its id.
    auto j = (*c)->get(before->id);
    REQUIRE(j.ok());
    REQUIRE(j->has_value());
    CHECK((*j)->key == "before");
  }
}

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
  SECTION("a job_ids value outside the enumeration names the field") {
    keel::postgres_options o = pg_options(schema);
    o.job_ids = static_cast<keel::postgres_job_ids>(7);
    auto s = keel::postgres_job_store::open(o);
    INFO(s.status().ToString());
    CHECK(s.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(std::string(s.status().message()).find("postgres_options.job_ids must be") != std::string::npos);
  }
}
