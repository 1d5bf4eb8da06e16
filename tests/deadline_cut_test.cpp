// Deadlines that cut, in the composition: a hedge race, a fallback's primary
// and a fan-out's units whose providers watch only their stop tokens end at
// their deadlines (keel::deadline_timer), exactly on the manual clock and
// soon after on the real one, and report a timeout, not a cancellation.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <stop_token>
#include <string>
#include <vector>

#include "keel/core/timer.hpp"
#include "keel/compose/executor.hpp"
#include "keel/compose/fallback.hpp"
#include "keel/compose/hedge.hpp"
#include "keel/compose/pipeline.hpp"
#include "keel/core/call.hpp"
#include "keel/durable/digest.hpp"
#include "keel/durable/fan_out.hpp"
#include "keel/store/memory.hpp"
#include "keel/testing/manual_clock.hpp"
#include "support/async.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;
using keel::testing::manual_clock;
using keel_test::async_call;
using keel_test::eventually;

namespace {

using keel_test::block_until_stopped;

// Watches its stop token and nothing else.
absl::StatusOr<int> stall(const keel::attempt& a) {
  block_until_stopped(a.stop);
  return absl::CancelledError("stopped");
}

// The same, counting the attempts that have started (a hedge copies it).
struct counted_stall {
  std::atomic<int>* started;
  absl::StatusOr<int> operator()(const keel::attempt& a) const {
    started->fetch_add(1);
    return stall(a);
  }
};

bool says_cut(const absl::Status& s) {
  return s.code() == absl::StatusCode::kDeadlineExceeded &&
         std::string(s.message()).find("cut at its deadline") != std::string::npos;
}

std::vector<keel::unit> units_named(std::initializer_list<std::string_view> names) {
  std::vector<keel::unit> out;
  for (std::string_view n : names)
    out.push_back({.name = std::string(n), .key = keel::digest_builder().field("unit", n).finish()});
  return out;
}

}  // namespace

TEST_CASE("hedge with a cut: a race of stalled attempts ends exactly at its deadline, on one timer thread",
          "[deadline_cut][hedge]") {
  manual_clock clock;
  keel::deadline_timer timer(clock);  // starts the hedge and cuts both attempts
  keel::bounded_pool pool({.threads = 4});
  keel::hedge hedger({.delay = 10ms, .max_hedges = 1, .cut = true}, pool, timer);
  auto pipe = keel::pipeline(hedger).in(keel::environment{clock});
  keel::call call(clock.now(), {.timeout = 100ms});
  std::atomic<int> started{0};
  async_call<absl::StatusOr<int>> run([&] { return pipe.run(call, counted_stall{&started}); });
  REQUIRE(eventually([&] { return started.load() == 1; }));
  clock.await_sleepers(1);  // the one timer thread: the hedge at 10 ms, the primary's cut at 100 ms
  CHECK(timer.figures().fired == 0);
  clock.advance(10ms);
  REQUIRE(eventually([&] { return started.load() == 2; }));  // the hedge runs
  CHECK(timer.figures().fired == 1);                            // started by the timer
  clock.await_sleepers(1);  // the same thread, armed for the cuts
  clock.advance(89ms);
  clock.await_sleepers(1);
  CHECK_FALSE(run.done());
  clock.advance(1ms);
  REQUIRE(eventually([&] { return run.done(); }));
  absl::StatusOr<int> r = run.get();
  CHECK(says_cut(r.status()));
  CHECK(timer.figures().fired == 3);  // the hedge's start, then the primary's and the hedge's cuts
  REQUIRE(eventually([&] { return hedger.figures().outstanding == 0; }));
}

TEST_CASE("hedge without a cut: a stalled race waits for its attempts (the control)", "[deadline_cut][hedge]") {
  manual_clock clock;
  keel::bounded_pool pool({.threads = 4});
  keel::deadline_timer hedger_timer{clock};
  keel::hedge hedger({.delay = 10ms, .max_hedges = 1}, pool, hedger_timer);
  auto pipe = keel::pipeline(hedger).in(keel::environment{clock});
  std::stop_source caller;
  keel::call call(clock.now(), {.timeout = 100ms, .stop = caller.get_token()});
  std::atomic<int> started{0};
  async_call<absl::StatusOr<int>> run([&] { return pipe.run(call, counted_stall{&started}); });
  REQUIRE(eventually([&] { return started.load() == 1; }));
  clock.await_sleepers(1);
  clock.advance(10ms);
  REQUIRE(eventually([&] { return started.load() == 2; }));
  clock.advance(1s);  // far past the deadline: nothing stops them
  CHECK_FALSE(eventually([&] { return run.done(); }, 50ms));
  caller.request_stop();
  REQUIRE(eventually([&] { return run.done(); }));
  CHECK(run.get().status().code() == absl::StatusCode::kCancelled);
}

TEST_CASE("hedge with a cut: on the real clock the stalled race returns soon after its deadline",
          "[deadline_cut][hedge]") {
  keel::deadline_timer timer;
  keel::bounded_pool pool({.threads = 4});
  keel::hedge hedger({.delay = 5ms, .max_hedges = 1, .cut = true}, pool, timer);
  auto pipe = keel::pipeline(hedger);
  const keel::time_point start = keel::real_clock{}.now();
  keel::call call(start, {.timeout = 30ms});
  absl::StatusOr<int> r = pipe.run(call, start, stall);
  const keel::duration took = keel::real_clock{}.now() - start;
  CHECK(says_cut(r.status()));
  CHECK(took >= 30ms);
  CHECK(took < 230ms);  // the deadline plus a generous 200 ms
  CHECK(hedger.figures().hedges_started == 1);
}

TEST_CASE("fallback with a cut: a stalled primary is stopped at its share and the alternative serves",
          "[deadline_cut][fallback]") {
  manual_clock clock;
  keel::deadline_timer timer(clock);
  auto backup = [](const keel::attempt& a) -> absl::StatusOr<int> {
    return a.stop.stop_possible() && !a.stop.stop_requested() ? 2 : -1;
  };
  auto pipe = keel::pipeline(keel::fallback({.primary_at_most = 50ms, .cut = &timer}, {},
                                            keel::alternate("backup", backup)))
                  .in(keel::environment{clock});
  keel::call call(clock.now(), {.timeout = 1s});
  async_call<absl::StatusOr<int>> run([&] { return pipe.run(call, stall); });
  clock.await_sleepers(1);  // the deadline timer, for the primary's 50 ms
  clock.advance(49ms);
  clock.await_sleepers(1);
  CHECK_FALSE(run.done());
  clock.advance(1ms);
  REQUIRE(eventually([&] { return run.done(); }));
  absl::StatusOr<int> r = run.get();
  REQUIRE(r.ok());
  CHECK(*r == 2);
  CHECK(call.record().served_by == "backup");
  CHECK(call.record().degraded);
}

TEST_CASE("fallback: primary_at_most must be positive", "[deadline_cut][fallback]") {
  CHECK(keel::fallback_options{.primary_at_most = 0ms}.validate().message() ==
        "fallback_options.primary_at_most must be > 0 (got 0s)");
}

TEST_CASE("fan_out with a cut: a stalled unit ends exactly at its deadline, failed as a timeout",
          "[deadline_cut][fan_out]") {
  manual_clock clock;
  keel::deadline_timer timer(clock);
  keel::memory_store store(clock);
  keel::bounded_pool pool({.threads = 3});
  keel::fan_out<std::string, keel::memory_store, keel::bounded_pool, keel::environment<manual_clock>>
      panel({.width = 3, .require_complete = false, .unit_at_most = 50ms, .cut = &timer}, store, pool,
            keel::environment{clock});
  const std::vector<keel::unit> units = units_named({"fast", "stalled"});
  keel::call call(clock.now(), {.timeout = 10s});
  async_call<keel::fan_out_report<std::string>> run([&] {
    return panel.run(call, units, [](const keel::unit_context& u) -> absl::StatusOr<std::string> {
      if (u.unit.name == "fast") return std::string("ok");
      block_until_stopped(u.stop);
      return absl::CancelledError("stopped");
    });
  });
  // The collector (until the call's 10 s) and the deadline timer (50 ms).
  REQUIRE(eventually([&] { return timer.figures().fired == 0 && clock.sleepers() == 2; }));
  clock.advance(49ms);
  clock.await_sleepers(2);
  CHECK_FALSE(run.done());
  clock.advance(1ms);
  REQUIRE(eventually([&] { return run.done(); }));
  keel::fan_out_report<std::string> report = run.get();
  REQUIRE(report.units.size() == 2);
  CHECK(report.units[0].state == keel::unit_state::succeeded);
  CHECK(report.units[1].state == keel::unit_state::failed);
  CHECK(says_cut(report.units[1].status));
  CHECK(report.units[1].kind == keel::outcome_kind::transient);
  CHECK_FALSE(report.units[1].outstanding);
  CHECK(timer.figures().fired == 1);
}

TEST_CASE("fan_out with a cut: on the real clock a stalled unit returns soon after its deadline",
          "[deadline_cut][fan_out]") {
  keel::deadline_timer timer;
  keel::memory_store store;
  keel::bounded_pool pool({.threads = 2});
  keel::fan_out<std::string, keel::memory_store, keel::bounded_pool> panel(
      {.width = 2, .unit_at_most = 30ms, .cut = &timer}, store, pool);
  const std::vector<keel::unit> units = units_named({"stalled-a", "stalled-b"});
  const keel::time_point start = keel::real_clock{}.now();
  keel::call call(start, {.timeout = 30s});
  keel::fan_out_report<std::string> report =
      panel.run(call, units, [](const keel::unit_context& u) -> absl::StatusOr<std::string> {
        block_until_stopped(u.stop);
        return absl::CancelledError("stopped");
      });
  const keel::duration took = keel::real_clock{}.now() - start;
  CHECK(took >= 30ms);
  CHECK(took < 230ms);
  CHECK(report.count(keel::unit_state::failed) == 2);
  for (const auto& u : report.units) CHECK(says_cut(u.status));
}
