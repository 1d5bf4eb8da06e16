// The job queue on SQLite: the shared behaviour suite, then what only a file
// shared by processes shows — fork()ed workers draining one queue exactly
// once, a worker SIGKILLed mid-job taken over after its lease with its late
// completion refused, the file shared with the idempotency store, restarts,
// and refusal of job tables this keel does not know.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <sqlite3.h>

#include "support/jobs_suite.hpp"
#include "support/jobs.hpp"
#include "keel/durable/job_queue.hpp"
#include "keel/store/sqlite.hpp"
#include "keel/store/sqlite_jobs.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;
using keel::job_state;

KEEL_JOBS_SUITE(keel_jobs::sqlite_backend, "sqlite", "[sqlite]")

namespace {

void raw_sql(const std::string& path, const std::string& sql) {
  sqlite3* db = nullptr;
  REQUIRE(sqlite3_open(path.c_str(), &db) == SQLITE_OK);
  char* err = nullptr;
  const int rc = sqlite3_exec(db, sql.c_str(), nullptr, nullptr, &err);
  INFO((err ? err : ""));
  sqlite3_free(err);
  sqlite3_close(db);
  REQUIRE(rc == SQLITE_OK);
}

}  // namespace

TEST_CASE("sqlite: fork()ed worker processes drain one queue exactly once", "[jobs][sqlite][process]") {
  keel_durable::temp_dir dir;
  const std::string db = dir.file("jobs.db");
  const std::string log_path = dir.file("exec.log");
  constexpr int jobs = 150, procs = 4;
  {
    auto store = keel::sqlite_job_store<>::open(db);
    REQUIRE(store.ok());
    keel::job_queue q(**store, {.queue = "drain"});
    for (int i = 0; i < jobs; ++i) REQUIRE(q.submit("acme", "job-" + std::to_string(i), "p" + std::to_string(i)).ok());
  }  // closed before forking: children open their own

  int gate[2];
  REQUIRE(::pipe(gate) == 0);
  std::vector<pid_t> children;
  for (int p = 0; p < procs; ++p) {
    children.push_back(keel_jobs::fork_child([&] {
      ::close(gate[1]);
      char c;
      if (::read(gate[0], &c, 1) != 0) return 10;  // wait until the parent opens the gate (EOF)
      auto store = keel::sqlite_job_store<>::open(db);
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
  ::close(gate[1]);  // all children start together
  for (pid_t pid : children) CHECK(keel_durable::wait_child(pid) == 0);

  const auto starts = keel_jobs::exec_log::count(log_path, "start");
  const auto dones = keel_jobs::exec_log::count(log_path, "done");
  CHECK(starts.size() == static_cast<std::size_t>(jobs));
  CHECK(dones.size() == static_cast<std::size_t>(jobs));
  for (const auto& [id, n] : starts) CHECK(n == 1);
  for (const auto& [id, n] : dones) CHECK(n == 1);

  auto store = keel::sqlite_job_store<>::open(db);
  REQUIRE(store.ok());
  absl::StatusOr<keel::job_counts> c = (*store)->counts("drain");
  REQUIRE(c.ok());
  CHECK(c->done == jobs);
  CHECK(c->total() == jobs);
  CHECK(c->depth == 0);
  for (const auto& [id, n] : dones) {
    absl::StatusOr<std::optional<keel::job_info>> j = (*store)->get(id);
    REQUIRE(j.ok());
    REQUIRE(j->has_value());
    CHECK((*j)->result == "result of " + (*j)->payload);
    CHECK((*j)->attempts == 1);
  }
}

TEST_CASE("sqlite: a worker process SIGKILLed mid-job loses nothing; the takeover's result is written once",
          "[jobs][sqlite][process]") {
  keel_durable::temp_dir dir;
  const std::string db = dir.file("jobs.db");
  const std::string log_path = dir.file("exec.log");
  const std::string claimed_path = dir.file("claimed");
  // One timeline for the parent and the child: the store's time source and
  // the workers' clock, moved only by the parent.
  keel_durable::shared_clock clock(dir.file("clock"), true);
  using store_type = keel::sqlite_job_store<keel_durable::shared_clock>;
  const keel::job_queue_options options{.queue = "q", .lease = 10s};

  std::vector<std::int64_t> ids;
  {
    auto store = store_type::open(db, {}, clock);
    REQUIRE(store.ok());
    keel::job_queue q(**store, options, keel::environment{clock});
    for (int i = 0; i < 5; ++i) ids.push_back(q.submit("acme", "job-" + std::to_string(i), "p" + std::to_string(i))->id);
  }

  const pid_t victim = keel_jobs::fork_child([&] {
    keel_durable::shared_clock child_clock(dir.file("clock"), false);
    auto store = store_type::open(db, {}, child_clock);
    if (!store.ok()) return 11;
    keel::job_queue q(**store, options, keel::environment{child_clock});
    keel_jobs::exec_log log(log_path);
    (void)q.run_one([&](const keel::job_context& j) -> absl::StatusOr<std::string> {
      log.record(j.id, j.ownership.fence, "start");
      keel_durable::write_file(claimed_path, std::to_string(j.id) + " " + j.ownership.owner.hex() + " " +
                                                 std::to_string(j.ownership.fence) + "\n");
      for (;;) ::pause();  // mid-job, until killed
    });
    return 12;
  });
  const std::string line = keel_durable::await_line(claimed_path);
  REQUIRE_FALSE(line.empty());
  std::istringstream in(line);
  std::int64_t id = 0, fence = 0;
  std::string owner_hex;
  in >> id >> owner_hex >> fence;
  const std::optional<keel::owner_id> owner = keel::owner_id::from_hex(owner_hex);
  REQUIRE(owner.has_value());
  const keel::ownership dead{*owner, fence};
  CHECK(id == ids[0]);
  CHECK(fence == 1);

  REQUIRE(::kill(victim, SIGKILL) == 0);
  CHECK(keel_durable::wait_child(victim) == 128 + SIGKILL);

  auto store = store_type::open(db, {}, clock);
  REQUIRE(store.ok());
  keel::job_queue q(**store, options, keel::environment{clock});
  keel_jobs::exec_log log(log_path);
  auto handler = [&](const keel::job_context& j) -> absl::StatusOr<std::string> {
    log.record(j.id, j.ownership.fence, "start");
    return "result of " + std::string(j.payload) + " by fence " + std::to_string(j.ownership.fence);
  };
  auto info = [&](std::int64_t job) {
    absl::StatusOr<std::optional<keel::job_info>> j = (*store)->get(job);
    REQUIRE(j.ok());
    REQUIRE(j->has_value());
    return **j;
  };

  // While the dead worker's lease runs, its job is not handed out; the others are.
  for (int i = 1; i < 5; ++i) {
    absl::StatusOr<std::optional<keel::job_outcome>> r = q.run_one(handler);
    REQUIRE(r.ok());
    REQUIRE(r->has_value());
    CHECK((*r)->id == ids[static_cast<std::size_t>(i)]);
  }
  CHECK_FALSE(q.run_one(handler)->has_value());
  CHECK(info(id).state == job_state::running);

  clock.advance(11s);  // the dead worker's lease lapses
  absl::StatusOr<std::optional<keel::job_outcome>> r = q.run_one(handler);
  REQUIRE(r.ok());
  REQUIRE(r->has_value());
  CHECK((*r)->id == id);
  CHECK((*r)->took_over);
  CHECK((*r)->attempt == 2);
  CHECK((*r)->state == job_state::done);

  // The killed worker's late completion (its old owner and fence) is refused.
  absl::Status late = (*store)->complete(id, dead, "result from the dead");
  INFO(late.ToString());
  CHECK(keel::is_lost_ownership(late));
  CHECK(keel::is_lost_ownership((*store)->fail(id, dead, {.code = absl::StatusCode::kInternal}).status()));

  keel::job_info j = info(id);
  CHECK(j.state == job_state::done);
  CHECK(j.fence == 2);
  CHECK(j.attempts == 2);
  CHECK(j.took_over);
  CHECK(j.result == "result of p0 by fence 2");

  // No job lost: all five done, each completed once; the killed one started twice.
  absl::StatusOr<keel::job_counts> c = (*store)->counts("q");
  CHECK(c->done == 5);
  CHECK(c->depth == 0);
  const auto starts = keel_jobs::exec_log::count(log_path, "start");
  CHECK(starts.size() == 5);
  for (std::int64_t job : ids) CHECK(starts.at(job) == (job == id ? 2 : 1));
  std::vector<std::int64_t> fences;
  for (const auto& e : keel_jobs::exec_log::read(log_path))
    if (e.id == id) fences.push_back(e.fence);
  CHECK(fences == std::vector<std::int64_t>{1, 2});
}

TEST_CASE("sqlite: jobs share a keel file with the idempotency store and survive reopening", "[jobs][sqlite]") {
  keel_durable::temp_dir dir;
  const std::string db = dir.file("keel.db");
  keel_jobs::manual_clock clock;

  SECTION("job store first") {
    auto jobs = keel::sqlite_job_store<keel_jobs::manual_clock>::open(db, {}, clock);
    REQUIRE(jobs.ok());
    REQUIRE(keel_jobs::suite::submit(**jobs, "q", "k", "p") > 0);
    auto records = keel::sqlite_store<keel_jobs::manual_clock>::open(db, {}, clock);
    INFO(records.status().ToString());
    REQUIRE(records.ok());
    REQUIRE((*records)->claim("work", keel::owner_id::random(), 10s).ok());
  }
  SECTION("idempotency store first") {
    auto records = keel::sqlite_store<keel_jobs::manual_clock>::open(db, {}, clock);
    REQUIRE(records.ok());
    REQUIRE((*records)->claim("work", keel::owner_id::random(), 10s).ok());
    auto jobs = keel::sqlite_job_store<keel_jobs::manual_clock>::open(db, {}, clock);
    INFO(jobs.status().ToString());
    REQUIRE(jobs.ok());
    REQUIRE(keel_jobs::suite::submit(**jobs, "q", "k", "p") > 0);
  }
  // Reopened (a restart): the job is there, claimable, and both stores still open the file.
  auto jobs = keel::sqlite_job_store<keel_jobs::manual_clock>::open(db, {}, clock);
  REQUIRE(jobs.ok());
  std::optional<keel::job_claim> c = keel_jobs::suite::claim(**jobs, "q");
  REQUIRE(c.has_value());
  CHECK(c->key == "k");
  CHECK(keel::sqlite_store<keel_jobs::manual_clock>::open(db, {}, clock).ok());
}

TEST_CASE("sqlite: job tables of another version, a damaged set or a foreign file are refused untouched",
          "[jobs][sqlite][errors]") {
  keel_durable::temp_dir dir;
  const std::string db = dir.file("jobs.db");
  {
    auto s = keel::sqlite_job_store<>::open(db);
    REQUIRE(s.ok());
    keel::job_queue q(**s, {.queue = "q"});
    REQUIRE(q.submit("acme", "k", "p").ok());
  }
  SECTION("another version") {
    raw_sql(db, "UPDATE keel_job_schema SET version = 2");
    const std::string before = keel_durable::read_file(db);
    auto s = keel::sqlite_job_store<>::open(db);
    INFO(s.status().ToString());
    CHECK(s.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK(std::string(s.status().message()).find("job tables of version 2") != std::string::npos);
    CHECK(keel_durable::read_file(db) == before);
  }
  SECTION("a damaged set") {
    raw_sql(db, "DROP TABLE keel_job_depth");
    const std::string before = keel_durable::read_file(db);
    auto s = keel::sqlite_job_store<>::open(db);
    INFO(s.status().ToString());
    CHECK(s.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK(std::string(s.status().message()).find("damaged set of job tables (2 of 3)") != std::string::npos);
    CHECK(keel_durable::read_file(db) == before);
  }
  SECTION("another application's database") {
    const std::string foreign = dir.file("foreign.db");
    raw_sql(foreign, "CREATE TABLE invoices(id INTEGER PRIMARY KEY)");
    auto s = keel::sqlite_job_store<>::open(foreign);
    INFO(s.status().ToString());
    CHECK(s.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK(std::string(s.status().message()).find("another application's database") != std::string::npos);
  }
}

TEST_CASE("sqlite: a job file with a damaged page is refused when it opens, naming the file, and left untouched",
          "[jobs][sqlite][errors][integrity]") {
  keel_durable::temp_dir dir;
  const std::string db = dir.file("jobs.db");
  {
    auto s = keel::sqlite_job_store<>::open(db);
    REQUIRE(s.ok());
    keel::job_queue q(**s, {.queue = "q", .max_depth = 1000});
    for (int i = 0; i < 300; ++i) REQUIRE(q.submit("acme", "k" + std::to_string(i), std::string(400, 'p')).ok());
  }
  const std::string header = keel_durable::read_file(db).substr(0, 100);
  const std::size_t page = (static_cast<unsigned char>(header[16]) << 8) | static_cast<unsigned char>(header[17]);
  const std::size_t pages = keel_durable::read_file(db).size() / page;
  REQUIRE(pages >= 8);
  std::string garbage(page, '\0');
  for (std::size_t i = 0; i < garbage.size(); ++i) garbage[i] = static_cast<char>((i * 7919 + 13) % 251);
  const int fd = ::open(db.c_str(), O_WRONLY);
  REQUIRE(fd >= 0);
  const ssize_t n = ::pwrite(fd, garbage.data(), garbage.size(), static_cast<off_t>(pages / 2 * page));
  ::close(fd);
  REQUIRE(n == static_cast<ssize_t>(page));
  const std::string before = keel_durable::read_file(db);

  auto s = keel::sqlite_job_store<>::open(db);
  INFO(s.status().ToString());
  REQUIRE_FALSE(s.ok());
  CHECK(s.status().code() == absl::StatusCode::kDataLoss);
  const std::string message(s.status().message());
  CHECK(message.find("sqlite store '" + db + "' is damaged: PRAGMA quick_check found: ") != std::string::npos);
  CHECK(keel_durable::read_file(db) == before);
}
