// Fan-out workers running whole pipelines with admission and breakers: a
// refused unit is reported with the limit that refused it, nothing of it is
// saved or called, and the next run pays only for the refused units.
#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "keel/compose/executor.hpp"
#include "keel/compose/pipeline.hpp"
#include "keel/core/call.hpp"
#include "keel/durable/digest.hpp"
#include "keel/durable/fan_out.hpp"
#include "keel/policy/admission.hpp"
#include "keel/policy/circuit_breaker.hpp"
#include "keel/policy/retry.hpp"
#include "keel/store/memory.hpp"
#include "keel/testing/manual_clock.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;
using keel::testing::manual_clock;

TEST_CASE("fan-out workers run pipelines with admission and a breaker per provider", "[fan_out][protection]") {
  manual_clock clock;
  keel::memory_store store(clock);
  keel::bounded_pool pool({.threads = 3, .queue_capacity = 16});
  keel::admission quotas({.models = {{"C", {.max_in_flight = 1}}}});
  std::map<std::string, std::unique_ptr<keel::circuit_breaker>> breakers;
  for (const char* m : {"A", "B", "C"}) {
    breakers[m] = std::make_unique<keel::circuit_breaker>(keel::circuit_breaker_options{.name = m, .minimum_calls = 5});
  }
  std::mutex mu;
  std::map<std::string, int> calls;  // provider invocations by model

  std::vector<keel::unit> units;
  for (std::string_view m : {"A", "B", "C"}) {
    units.push_back({.name = std::string(m),
                     .key = keel::digest_builder().field("facts", "f").field("model", m).finish(),
                     .labels = {.tenant = "shop-7", .model = m}});
  }
  keel::fan_out<std::string, keel::memory_store, keel::bounded_pool, keel::environment<manual_clock>> panel(
      {.width = 3}, store, pool, keel::environment{clock});
  // The worker: admission outermost, then the provider's breaker, then retries.
  auto worker = [&](const keel::unit_context& u) -> absl::StatusOr<std::string> {
    keel::call c(clock.now(), u.call_options());
    auto pipe = keel::pipeline(quotas, *breakers.at(u.unit.name),
                               keel::retry({.max_attempts = 2}, keel::constant_backoff{.delay_each = 0ms}))
                    .in(keel::environment{clock});
    return pipe.run(c, [&](const keel::attempt& a) -> absl::StatusOr<std::string> {
      std::lock_guard lock(mu);
      ++calls[std::string(a.labels().model)];
      return absl::StrCat("score:", a.labels().model == "A" ? 70 : 80);
    });
  };

  // Provider B's breaker is held open by an operator; model C's only
  // in-flight slot is taken by another request.
  breakers.at("B")->force_open(clock.now());
  absl::StatusOr<keel::admission_ticket> other = quotas.admit({.tenant = "shop-9", .model = "C"}, clock.now());
  REQUIRE(other.ok());

  {
    keel::call call(clock.now(), {.timeout = 5s});
    const keel::fan_out_report<std::string> r = panel.run(call, units, worker);
    CHECK(r.units[0].state == keel::unit_state::succeeded);
    // Refused units are missing, not failed: nothing of the provider's was tried.
    REQUIRE(r.units[1].state == keel::unit_state::missing);
    CHECK(keel::refused_by(r.units[1].status) == "breaker:B");
    CHECK(keel::not_started(r.units[1].status));
    CHECK(r.units[1].kind == keel::outcome_kind::refused);
    REQUIRE(r.units[2].state == keel::unit_state::missing);
    CHECK(r.units[2].status.code() == absl::StatusCode::kResourceExhausted);
    CHECK(keel::refused_by(r.units[2].status).value_or("").rfind("model:C", 0) == 0);
    CHECK(r.units[2].kind == keel::outcome_kind::refused);
    CHECK(r.missing() == std::vector<std::string_view>{"B", "C"});
    CHECK(panel.figures().failed == 0);
    CHECK(panel.figures().missing == 2);
    CHECK_FALSE(store.load_result(panel.key_of(units[1])).value().has_value());
    CHECK_FALSE(store.load_result(panel.key_of(units[2])).value().has_value());
    std::lock_guard lock(mu);
    CHECK(calls == std::map<std::string, int>{{"A", 1}});  // refused before any expensive work
  }

  // The outage is over and the slot is free: the rerun calls only B and C.
  breakers.at("B")->force_closed(clock.now());
  *other = keel::admission_ticket();  // releases C's slot
  {
    keel::call call(clock.now(), {.timeout = 5s});
    const keel::fan_out_report<std::string> r = panel.run(call, units, worker);
    CHECK(r.status().ok());
    CHECK(r.units[0].state == keel::unit_state::cached);
    CHECK(r.units[1].state == keel::unit_state::succeeded);
    CHECK(r.units[2].state == keel::unit_state::succeeded);
    std::lock_guard lock(mu);
    CHECK(calls == std::map<std::string, int>{{"A", 1}, {"B", 1}, {"C", 1}});
  }
}

TEST_CASE("a panel refused by an open breaker says retry later, not do-not-retry", "[fan_out][protection][outcome]") {
  manual_clock clock;
  keel::memory_store store(clock);
  keel::bounded_pool pool({.threads = 2, .queue_capacity = 8});
  keel::circuit_breaker breaker({.name = "B", .minimum_calls = 5});
  breaker.force_open(clock.now());
  const std::vector<keel::unit> units{
      {.name = "B", .key = keel::digest_builder().field("model", "B").finish(), .labels = {.model = "B"}}};
  keel::fan_out<std::string, keel::memory_store, keel::bounded_pool, keel::environment<manual_clock>> panel(
      {.width = 1}, store, pool, keel::environment{clock});
  int calls = 0;
  auto worker = [&](const keel::unit_context& u) -> absl::StatusOr<std::string> {
    keel::call c(clock.now(), u.call_options());
    return keel::pipeline(breaker).in(keel::environment{clock}).run(c, [&]() -> absl::StatusOr<std::string> {
      ++calls;
      return std::string("score:80");
    });
  };
  keel::call call(clock.now(), {.timeout = 5s});
  const keel::fan_out_report<std::string> r = panel.run(call, units, worker);
  REQUIRE(r.units[0].state == keel::unit_state::missing);
  CHECK(r.units[0].kind == keel::outcome_kind::refused);
  // Every unit without an answer was refused, none failed: a rerun may well
  // succeed, so this is Unavailable (before: FailedPrecondition, "do not retry").
  CHECK(r.status().code() == absl::StatusCode::kUnavailable);
  CHECK(calls == 0);
  // The control: a unit that failed permanently does make it FailedPrecondition.
  breaker.force_closed(clock.now());
  auto revoked = [&](const keel::unit_context&) -> absl::StatusOr<std::string> {
    return absl::UnauthenticatedError("key revoked");
  };
  keel::call again(clock.now(), {.timeout = 5s});
  CHECK(panel.run(again, units, revoked).status().code() == absl::StatusCode::kFailedPrecondition);
}
