// The worker processes of the failover tests (support/failover.hpp): this
// binary re-executed, running only this hidden test case, on the backend
// KEEL_FAILOVER_BACKEND names.
#include <chrono>
#include <cstdio>
#include <thread>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "keel/store/postgres.hpp"
#include "keel/store/postgres_jobs.hpp"
#include "keel/store/redis.hpp"
#include "keel/fleet/shared_concurrency.hpp"
#include "support/catch.hpp"
#include "support/failover.hpp"

using keel_failover::child_env;
using namespace std::chrono_literals;

namespace {

// tests/failover_partition_test.cpp: inside the namespace, take the lease
// over once it expires, say so on stdout, release it.
template <class Store>
void take_over(Store& s) {
  const keel::owner_id me = keel::owner_id::random();
  const auto end = std::chrono::steady_clock::now() + 20s;
  for (;;) {
    auto c = s.claim("report", me, 5s);
    REQUIRE(c.ok());
    if (c->acquired) {
      std::printf("acquired %lld\n", static_cast<long long>(c->ownership.fence));
      std::fflush(stdout);
      REQUIRE(s.release("report", c->ownership).ok());
      return;
    }
    REQUIRE(std::chrono::steady_clock::now() < end);
    std::this_thread::sleep_for(20ms);
  }
}

}  // namespace

TEST_CASE("failover child process", "[.]") {
  const std::string backend = child_env("BACKEND");
  const int threads = std::stoi(child_env("THREADS"));
  if (backend == "postgres") {
    auto s = keel::postgres_store::open({.conninfo = child_env("CONNINFO"),
                                         .schema = child_env("NS"),
                                         .pool_size = threads,
                                         .connect_timeout = 1s,
                                         .command_timeout = 1s,
                                         .acquire_timeout = 2s,
                                         .fences = child_env("FENCES") == "from_clock"
                                                       ? keel::postgres_fences::from_clock
                                                       : keel::postgres_fences::sequential});
    REQUIRE(s.ok());
    // The job store on the same server: every key submits a job (the same
    // key from every thread: one is created), then one job is claimed and
    // completed.
    auto jobs = keel::postgres_job_store::open({.conninfo = child_env("CONNINFO"),
                                                .schema = child_env("NS") + "_jobs",
                                                .pool_size = threads,
                                                .connect_timeout = 1s,
                                                .command_timeout = 1s,
                                                .acquire_timeout = 2s});
    REQUIRE(jobs.ok());
    auto job_step = [&](const std::string& phase, int n, std::ostream& log) {
      const std::string key = "j-" + phase + "-" + std::to_string(n);
      auto sub = (*jobs)->submit({.queue = "q", .tenant = "t", .key = key}, keel_failover::digest_of(key), key,
                                 {.max_depth = 1'000'000});
      if (sub.ok() && sub->created) log << "S " << phase << " " << sub->id << " " << key << "\n";
      const keel::owner_id me = keel::owner_id::random();
      auto c = (*jobs)->claim("q", me, 5s);
      if (c.ok() && c->has_value() && (*jobs)->complete((*c)->id, (*c)->ownership, "done").ok())
        log << "J " << phase << " " << (*c)->id << " " << me.hex() << " " << (*c)->ownership.fence << " " << (*c)->key
            << "\n";
    };
    REQUIRE(keel_failover::run_worker(**s, job_step) == 0);
  } else if (backend == "redis") {
    keel::redis_options o{.key_prefix = child_env("NS"),
                          .pool_size = threads,
                          .connect_timeout = 500ms,
                          .command_timeout = 1s,
                          .acquire_timeout = 2s,
                          .fences = child_env("FENCES") == "from_clock" ? keel::redis_fences::from_clock
                                                                         : keel::redis_fences::sequential,
                          .wait_replicas = std::stoi(child_env("WAIT")),
                          .wait_timeout = 200ms};
    for (absl::string_view port : absl::StrSplit(child_env("PORTS"), ','))
      o.endpoints.push_back({.host = "127.0.0.1", .port = std::stoi(std::string(port))});
    auto s = keel::redis_store::open(std::move(o));
    REQUIRE(s.ok());
    REQUIRE(keel_failover::run_worker(**s) == 0);
  } else if (backend == "taker") {
    if (child_env("KIND") == "postgres") {
      auto s = keel::postgres_store::open(
          {.conninfo = "host=" + child_env("HOST") + " port=5432 user=keel dbname=postgres", .schema = "part"});
      REQUIRE(s.ok());
      take_over(**s);
    } else {
      auto s = keel::redis_store::open({.host = child_env("HOST"), .key_prefix = "part:"});
      REQUIRE(s.ok());
      take_over(**s);
    }
  } else if (backend == "fleet-holder") {
    // tests/failover_partition_test.cpp: a replica on Redis's side of the
    // cut takes the whole limit, says so, and holds it until killed.
    keel::shared_concurrency fleet({.host = child_env("HOST"), .key_prefix = "part:"},
                                   {.name = "m", .limit = 4, .permit_ttl = 30s, .expected_replicas = 2});
    std::vector<keel::shared_permit> held;
    for (;;) {
      keel::shared_permit p = fleet.try_acquire(keel::real_clock{}.now());
      REQUIRE_FALSE(p.local_share());
      if (!p) break;
      held.push_back(std::move(p));
    }
    std::printf("held %zu\n", held.size());
    std::fflush(stdout);
    std::this_thread::sleep_for(60s);  // killed long before
  } else {
    FAIL("unknown backend " << backend);
  }
}

