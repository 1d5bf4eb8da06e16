// keel/core/format.hpp: keel's values printed with fmt.
#include "keel/core/format.hpp"

#include <chrono>
#include <string>

#include "keel/core/call.hpp"
#include "keel/core/outcome.hpp"
#include "keel/durable/fan_out.hpp"
#include "keel/policy/circuit_breaker.hpp"
#include "keel/testing/manual_clock.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;

TEST_CASE("keel's enums print their names", "[format]") {
  CHECK(fmt::format("{}", keel::outcome_kind::refused) == "refused");
  CHECK(fmt::format("{}", keel::outcome_kind::cancelled) == "cancelled");
  CHECK(fmt::format("{}", keel::breaker_state::half_open) == "half-open");
  CHECK(fmt::format("{}", keel::unit_state::missing) == "missing");
  CHECK(fmt::format("[{:>9}]", keel::outcome_kind::transient) == "[transient]");
  CHECK(fmt::format("[{:>10}]", keel::outcome_kind::refused) == "[   refused]");
}

TEST_CASE("durations print as people read them", "[format]") {
  CHECK(fmt::format("{}", keel::readable(std::chrono::nanoseconds(299'995'796))) == "299.996ms");
  CHECK(fmt::format("{}", keel::readable(1500ms)) == "1.5s");
  CHECK(fmt::format("{}", keel::readable(2s)) == "2s");
  CHECK(fmt::format("{}", keel::readable(750us)) == "750us");
}

TEST_CASE("labels and what happened to a call print in one line", "[format]") {
  keel::testing::manual_clock clock;
  keel::call call(clock.now(), {.timeout = 3s, .labels = {.tenant = "acme", .model = "m-large", .work_class = "interactive"}});
  CHECK(fmt::format("{}", call.labels()) == "tenant=acme model=m-large class=interactive");
  CHECK(fmt::format("{}", keel::labels{}).empty());
  CHECK(fmt::format("{}", call.record()) == "attempts=0 retries=0 cost=0");
  const keel::call_record r{.attempts = 2, .retries = 1, .cost = 412, .served_by = "alt", .degraded = true};
  CHECK(fmt::format("{}", r) == "attempts=2 retries=1 cost=412 served_by=alt degraded");
  // A std::string_view label goes straight in (absl::StrCat on Debian does not take it).
  CHECK(fmt::format("tenant {}", call.labels().tenant) == "tenant acme");
}
