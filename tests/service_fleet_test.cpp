// The example gateway given a Redis (gateway_options.fleet, `--redis
// host:port`): two gateway replicas share the provider's concurrency limit
// and its state through the real Redis the ctest fixture starts.
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gateway_core.hpp"
#include "keel/fleet/shared_concurrency.hpp"
#include "keel/store/sqlite_jobs.hpp"
#include "keel/testing/manual_clock.hpp"
#include "support/catch.hpp"
#include "support/scaleout.hpp"
#include "support/service.hpp"

using namespace std::chrono_literals;
namespace kt = keel::testing;
using json = nlohmann::json;

namespace {

using core_t = gateway::gateway_core<kt::manual_clock, keel::sqlite_job_store<>>;

std::unique_ptr<core_t> open_core(const gateway::gateway_options& o, kt::manual_clock clock) {
  auto core = core_t::open(
      o, [](const std::string& path) { return keel::sqlite_job_store<>::open(path); }, clock);
  if (!core.ok()) FAIL(std::string(core.status().message()));
  return std::move(*core);
}

std::string feedback_body(const std::string& tenant) {
  return json{{"tenant", tenant}, {"question_id", "q-timeouts"}, {"answer", "One end-to-end deadline"}}.dump();
}

json parse(const gateway::reply& r) { return json::parse(r.body, nullptr, false); }

gateway::gateway_options replica_options(const std::string& dir, const std::string& prefix) {
  gateway::gateway_options o;
  o.data_dir = dir;
  o.provider.spread = 0;
  o.batch_workers = 0;
  o.cut_at_deadline = false;  // the test's clocks auto-advance: the cut's timer would jump them
  o.fleet = {.redis = "127.0.0.1:" + std::to_string(keel_scaleout::redis_port()),
             .key_prefix = prefix,
             .provider_concurrency = 4,
             .expected_replicas = 2,
             .refresh_every = 0ms};  // every attempt reads the fleet's state: no staleness in this test
  return o;
}

}  // namespace

TEST_CASE("the gateway's fleet options are validated, naming the field and the rule", "[service][fleet][options]") {
  gateway::gateway_options o;
  o.data_dir = "/tmp";
  o.fleet.redis = "no-port";
  CHECK(std::string(o.validate().message()) == "gateway_options.fleet.redis must be host:port (got no-port)");
  o.fleet.redis = "127.0.0.1:6379";
  o.fleet.provider_concurrency = 0;
  CHECK(std::string(o.validate().message()) ==
        "gateway_options.fleet: shared_concurrency_options.limit must be in [1, 1000000] (got 0)");
  o.fleet.provider_concurrency = 8;
  o.fleet.refresh_every = 2min;
  CHECK(std::string(o.validate().message()) ==
        "gateway_options.fleet: shared_provider_state_options.refresh_every must be in [0, 1min] (got 120s)");
  o.fleet.refresh_every = 100ms;
  CHECK(o.validate().ok());
  o.fleet.redis.clear();  // no Redis: the gateway runs alone
  CHECK(o.validate().ok());
}

TEST_CASE("two gateway replicas with a Redis share the provider's concurrency limit and its cooldown",
          "[service][fleet]") {
  keel_service::temp_dir dir_a, dir_b;
  const std::string prefix = keel_scaleout::fresh_name("gw") + ":";
  kt::manual_clock clock_a, clock_b;
  clock_a.auto_advance(true);
  clock_b.auto_advance(true);
  auto a = open_core(replica_options(dir_a.path(), prefix), clock_a);
  auto b = open_core(replica_options(dir_b.path(), prefix), clock_b);
  REQUIRE(a->fleet() != nullptr);
  REQUIRE(b->fleet() != nullptr);

  // Healthy: each answers from the model, taking the fleet's permits.
  CHECK(parse(a->feedback(feedback_body("acme"), "k-a1"))["degraded"] == false);
  CHECK(parse(b->feedback(feedback_body("acme"), "k-b1"))["degraded"] == false);
  CHECK(a->fleet()->concurrency().shared_decisions() == 1);
  CHECK(b->fleet()->concurrency().shared_decisions() == 1);
  const json health = parse(b->health());
  CHECK(health["fleet"]["concurrency"]["source"] == "shared");
  CHECK(health["fleet"]["concurrency"]["limit"] == 4);
  CHECK(health["fleet"]["provider_state"]["deciding_alone"] == false);

  // Another replica holds every permit of the fleet's limit: b's request is
  // refused before the provider and served by the fallback.
  keel::shared_concurrency other({.port = keel_scaleout::redis_port(), .key_prefix = prefix},
                                 {.name = "provider:" + b->provider().name(), .limit = 4});
  std::vector<keel::shared_permit> held;
  for (int i = 0; i < 4; ++i) {
    held.push_back(other.try_acquire(keel::real_clock{}.now()));
    REQUIRE(held.back());
  }
  const std::int64_t calls_b = b->provider().figures().calls;
  const json limited = parse(b->feedback(feedback_body("acme"), "k-b2"));
  CHECK(limited["degraded"] == true);
  CHECK(limited["served_by"] == "rubric-feedback");
  CHECK(b->provider().figures().calls == calls_b);  // never sent
  held.clear();
  CHECK(parse(b->feedback(feedback_body("acme"), "k-b3"))["degraded"] == false);

  // The provider tells replica a to wait 20 s: b stops sending too.
  REQUIRE(a->provider().set_fault({.kind = gateway::fault_kind::rate_limit, .retry_after = 20s}).ok());
  CHECK(parse(a->feedback(feedback_body("acme"), "k-a2"))["degraded"] == true);
  CHECK(a->provider().figures().rate_limited >= 1);
  const std::int64_t before = b->provider().figures().calls;
  const json cooled = parse(b->feedback(feedback_body("acme"), "k-b4"));
  CHECK(cooled["degraded"] == true);
  CHECK(b->provider().figures().calls == before);  // b's own provider is healthy, and was not called
}
