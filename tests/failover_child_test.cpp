// The worker processes of the failover tests (support/failover.hpp): this
// binary re-executed, running only this hidden test case, on the backend
// KEEL_FAILOVER_BACKEND names.
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "keel/store/postgres.hpp"
#include "keel/store/redis.hpp"
#include "support/catch.hpp"
#include "support/failover.hpp"

using keel_failover::child_env;
using namespace std::chrono_literals;

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
    REQUIRE(keel_failover::run_worker(**s) == 0);
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
  } else {
    FAIL("unknown backend " << backend);
  }
}
