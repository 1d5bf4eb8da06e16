// Deadlines and the call's budget: the seed's 3-second plan.
#include "keel/core/deadline.hpp"

#include <chrono>

#include "keel/core/call.hpp"
#include "keel/core/status.hpp"
#include "keel/testing/manual_clock.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;

TEST_CASE("the seed's 3-second timeline spends one deadline", "[deadline][seed]") {
  keel::testing::manual_clock clock;
  const keel::time_point t0 = clock.now();
  keel::call call(t0, {.timeout = 3s, .response_reserve = 200ms});
  REQUIRE(call.end().when() == t0 + 3s);
  REQUIRE(call.work_deadline().when() == t0 + 2800ms);

  // 0-100 ms: authenticate and admit.
  REQUIRE(call.stage(clock.now(), 100ms).when() == t0 + 100ms);
  clock.advance(100ms);
  // 100-300 ms: retrieve.
  REQUIRE(call.stage(clock.now(), 200ms).when() == t0 + 300ms);
  clock.advance(200ms);
  // 300-1300 ms: the model attempt.
  const keel::deadline model = call.stage(clock.now(), 1000ms);
  REQUIRE(model.when() == t0 + 1300ms);
  clock.advance(1000ms);
  REQUIRE(model.expired(clock.now()));
  // 1300-1400 ms: cancel and close the failed read.
  REQUIRE(call.stage(clock.now(), 100ms).when() == t0 + 1400ms);
  clock.advance(100ms);

  // 1400 ms: a fallback asking for a "fresh" 3 s gets only what is left of
  // the work budget: it ends at 2800 ms, not at 4400 ms.
  const keel::deadline greedy = call.stage(clock.now(), 3s);
  REQUIRE(greedy.when() == call.work_deadline().when());
  REQUIRE(greedy.remaining(clock.now()) == 1400ms);
  REQUIRE(greedy.when() < t0 + 1400ms + 3s);

  // 1400-2400 ms: the evaluated fallback, given 1000 ms.
  const keel::deadline fallback = call.stage(clock.now(), 1000ms);
  REQUIRE(fallback.when() == t0 + 2400ms);
  clock.advance(1000ms);
  // By 2600 ms: validate and finish, 400 ms left of the request's deadline.
  clock.advance(200ms);
  REQUIRE(call.end().remaining(clock.now()) == 400ms);
  REQUIRE(call.remaining(clock.now()) == 200ms);  // work time: 400 ms minus the 200 ms reserve
}

TEST_CASE("a child deadline never outlives its parent", "[deadline]") {
  const keel::time_point t0{std::chrono::hours(1)};
  const keel::deadline parent = keel::deadline::after(t0, 1s);
  for (keel::duration at_most : {keel::duration(1ms), keel::duration(500ms), keel::duration(1s), keel::duration(2s),
                                 keel::duration(1h)}) {
    for (keel::duration offset : {keel::duration(0ms), keel::duration(300ms), keel::duration(999ms),
                                  keel::duration(1500ms)}) {
      const keel::deadline child = parent.within(t0 + offset, at_most);
      REQUIRE(child <= parent);
      REQUIRE(child.when() <= t0 + offset + at_most);
    }
  }
  REQUIRE(parent.minus(200ms).when() == t0 + 800ms);
  REQUIRE(parent.minus(-5s) == parent);  // a negative reserve cannot extend it
  REQUIRE(parent.earliest(keel::deadline::after(t0, 5s)) == parent);
}

TEST_CASE("remaining time is never negative and infinity saturates", "[deadline]") {
  const keel::time_point t0{std::chrono::hours(1)};
  const keel::deadline d = keel::deadline::after(t0, 100ms);
  REQUIRE(d.remaining(t0 + 50ms) == 50ms);
  REQUIRE(d.remaining(t0 + 5s) == keel::duration::zero());
  REQUIRE(d.expired(t0 + 100ms));
  REQUIRE_FALSE(d.expired(t0 + 99ms));

  const keel::deadline none = keel::deadline::infinite();
  REQUIRE(none.is_infinite());
  REQUIRE(none.remaining(t0) == keel::duration::max());
  REQUIRE(none.within(t0, 2s).when() == t0 + 2s);
  REQUIRE(keel::deadline::after(t0, keel::duration::max()).is_infinite());
  REQUIRE(none.minus(1s).is_infinite());
}

TEST_CASE("a call takes the earlier of an upstream deadline and its own timeout", "[deadline][call]") {
  keel::testing::manual_clock clock;
  const keel::time_point t0 = clock.now();
  keel::call upstream_wins(t0, {.deadline = keel::deadline::after(t0, 1s), .timeout = 3s});
  REQUIRE(upstream_wins.end().when() == t0 + 1s);
  keel::call timeout_wins(t0, {.deadline = keel::deadline::after(t0, 10s), .timeout = 3s});
  REQUIRE(timeout_wins.end().when() == t0 + 3s);
}

TEST_CASE("invalid call options are refused with the field named", "[deadline][call][options]") {
  const keel::time_point t0{std::chrono::hours(1)};
  auto refused = [&](const keel::call_options& o, std::string_view field) {
    try {
      keel::call c(t0, o);
    } catch (const keel::invalid_options& e) {
      CHECK(e.status().code() == absl::StatusCode::kInvalidArgument);
      CHECK(std::string(e.status().message()).find(field) != std::string::npos);
      return true;
    }
    return false;
  };
  REQUIRE(refused({.timeout = 3s, .response_reserve = 3s}, "response_reserve"));
  REQUIRE(refused({.timeout = 3s, .response_reserve = 5s}, "response_reserve"));
  REQUIRE(refused({.response_reserve = -1ms}, "response_reserve"));
  REQUIRE(refused({.timeout = -1s}, "timeout"));
  REQUIRE(refused({.max_attempts = 0}, "max_attempts"));
  REQUIRE_FALSE(refused({.timeout = 3s, .response_reserve = 200ms}, ""));
  REQUIRE(keel::call_options{.timeout = 3s, .response_reserve = 3s}.validate().message() ==
          "call_options.response_reserve must be below timeout (got 3s >= 3s)");
}
