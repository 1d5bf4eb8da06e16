// keel::circuit_breaker and keel::breaker_registry: every transition under
// the manual clock, operator controls, what counts, placement around retry,
// scoped health, and the half-open probe bound under contention.
#include "keel/policy/circuit_breaker.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <latch>
#include <string>
#include <thread>
#include <vector>

#include "keel/compose/pipeline.hpp"
#include "keel/core/call.hpp"
#include "keel/policy/breaker_registry.hpp"
#include "keel/policy/retry.hpp"
#include "keel/testing/manual_clock.hpp"
#include "keel/testing/scripted_provider.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;
using keel::breaker_state;
using keel::outcome_kind;
using keel::testing::manual_clock;
namespace kt = keel::testing;

namespace {

// Records n outcomes of one kind through standalone permits.
void feed(keel::circuit_breaker& b, keel::time_point now, outcome_kind kind, int n = 1, keel::duration latency = {}) {
  for (int i = 0; i < n; ++i) {
    keel::breaker_permit p = b.try_acquire(now);
    REQUIRE(p);
    p.record(kind, now, latency);
  }
}

bool contains(absl::string_view haystack, absl::string_view needle) {
  return haystack.find(needle) != absl::string_view::npos;
}

struct transition_log {
  std::vector<std::string>* log;
  void operator()(const keel::breaker_transition& t) const {
    log->push_back(std::string(keel::to_string(t.from)) + "->" + std::string(keel::to_string(t.to)));
  }
};

}  // namespace

TEST_CASE("a count window trips on the failure rate once it holds minimum_calls", "[breaker]") {
  manual_clock clock;
  const keel::time_point t = clock.now();
  keel::circuit_breaker b({.name = "llm", .window_calls = 10, .minimum_calls = 5, .failure_rate_threshold = 0.5});

  feed(b, t, outcome_kind::success);
  feed(b, t, outcome_kind::transient, 3);
  CHECK(b.state() == breaker_state::closed);  // 3 of 4 failed, but 4 calls are too few to judge
  feed(b, t, outcome_kind::transient);        // 4 of 5: judged, over the threshold
  CHECK(b.state() == breaker_state::open);
  CHECK(!b.try_acquire(t));

  keel::circuit_breaker exact({.window_calls = 10, .minimum_calls = 5, .failure_rate_threshold = 0.5});
  feed(exact, t, outcome_kind::success, 3);
  feed(exact, t, outcome_kind::transient, 2);
  CHECK(exact.state() == breaker_state::closed);  // 2 of 5 = 0.4
  feed(exact, t, outcome_kind::transient);
  CHECK(exact.state() == breaker_state::open);  // 3 of 6 = 0.5: at the threshold trips
}

TEST_CASE("a count window judges only the last window_calls calls", "[breaker]") {
  const keel::time_point t = manual_clock().now();
  keel::circuit_breaker b({.window_calls = 4, .minimum_calls = 4, .failure_rate_threshold = 0.75});
  feed(b, t, outcome_kind::transient, 2);
  feed(b, t, outcome_kind::success, 3);  // window: F S S S
  CHECK(b.figures(t).failures == 1);
  CHECK(b.figures(t).calls == 4);
  feed(b, t, outcome_kind::transient, 2);  // S S F F: 0.5
  CHECK(b.state() == breaker_state::closed);
  CHECK(b.figures(t).failure_rate == 0.5);
  feed(b, t, outcome_kind::transient);  // S F F F: 0.75
  CHECK(b.state() == breaker_state::open);
}

TEST_CASE("a time window forgets calls older than its length, bucket by bucket", "[breaker]") {
  manual_clock clock;
  keel::circuit_breaker b({.window = keel::breaker_window::time,
                           .window_length = 10s,
                           .bucket_width = 1s,
                           .minimum_calls = 3,
                           .failure_rate_threshold = 0.6});
  feed(b, clock.now(), outcome_kind::transient);
  clock.advance(1s);
  feed(b, clock.now(), outcome_kind::transient);
  clock.advance(1s);
  feed(b, clock.now(), outcome_kind::success);
  CHECK(b.figures(clock.now()).calls == 3);
  CHECK(b.state() == breaker_state::closed);  // judged on failures; the success only diluted

  clock.advance(8s);  // the first failure's bucket has left the window
  CHECK(b.figures(clock.now()).calls == 2);
  clock.advance(2s);  // all gone
  CHECK(b.figures(clock.now()).calls == 0);
  feed(b, clock.now(), outcome_kind::transient, 2);
  CHECK(b.state() == breaker_state::closed);  // 2 calls: too few
  feed(b, clock.now(), outcome_kind::transient);
  CHECK(b.state() == breaker_state::open);
}

TEST_CASE("slow calls trip the breaker on their own rate", "[breaker]") {
  const keel::time_point t = manual_clock().now();
  keel::circuit_breaker b({.window_calls = 10,
                           .minimum_calls = 4,
                           .failure_rate_threshold = std::nullopt,
                           .slow_call_rate_threshold = 0.5,
                           .slow_call_duration = 1s});
  feed(b, t, outcome_kind::success, 3, 200ms);
  feed(b, t, outcome_kind::transient, 3, 10ms);  // failures alone never trip this breaker
  CHECK(b.state() == breaker_state::closed);
  feed(b, t, outcome_kind::success, 2, 1500ms);  // slow answers are still answers
  CHECK(b.state() == breaker_state::closed);     // 2 slow of 8
  feed(b, t, outcome_kind::success, 2, 1s);      // at the threshold counts as slow: 4 of 10
  CHECK(b.state() == breaker_state::closed);
  feed(b, t, outcome_kind::success, 1, 3s);  // 5 of 10
  CHECK(b.state() == breaker_state::open);
}

TEST_CASE("an open breaker fails fast with the time left open as a retry hint", "[breaker]") {
  manual_clock clock;
  keel::circuit_breaker b({.name = "llm-eu", .window_calls = 2, .minimum_calls = 2, .open_duration = 10s});
  feed(b, clock.now(), outcome_kind::transient, 2);
  REQUIRE(b.state() == breaker_state::open);

  clock.advance(3s);
  CHECK(!b.try_acquire(clock.now()));
  const absl::Status s = b.refusal(clock.now());
  CHECK(s.code() == absl::StatusCode::kUnavailable);
  CHECK(s.message() == "keel: circuit breaker 'llm-eu' is open");
  CHECK(keel::retry_after(s) == std::optional<keel::duration>(7s));
  CHECK(keel::refused_by(s) == std::optional<std::string>("breaker:llm-eu"));
  CHECK(keel::not_started(s));
  CHECK(keel::marked_outcome(s) == outcome_kind::refused);  // retried only after its hint
  CHECK(b.figures(clock.now()).open_remaining == 7s);

  clock.advance(7s - 1ns);
  CHECK(!b.try_acquire(clock.now()));
  clock.advance(1ns);
  keel::breaker_permit probe = b.try_acquire(clock.now());
  CHECK(probe);
  CHECK(probe.probe());
  CHECK(b.state() == breaker_state::half_open);
}

TEST_CASE("half-open lets exactly half_open_probes through; all succeeding close it", "[breaker]") {
  manual_clock clock;
  std::vector<std::string> log;
  keel::circuit_breaker b({.window_calls = 4,
                           .minimum_calls = 2,
                           .open_duration = 5s,
                           .half_open_probes = 3,
                           .on_state_change = transition_log{&log}});
  feed(b, clock.now(), outcome_kind::transient, 2);
  clock.advance(5s);
  keel::breaker_permit p1 = b.try_acquire(clock.now());
  keel::breaker_permit p2 = b.try_acquire(clock.now());
  keel::breaker_permit p3 = b.try_acquire(clock.now());
  REQUIRE((p1 && p2 && p3));
  CHECK(!b.try_acquire(clock.now()));  // a fourth caller is refused
  const absl::Status busy = b.refusal(clock.now());
  CHECK(contains(busy.message(), "half-open"));
  CHECK(keel::retry_after(busy) == std::optional<keel::duration>(b.options().probe_timeout));

  p1.record(outcome_kind::success, clock.now());
  p2.record(outcome_kind::success, clock.now());
  CHECK(b.state() == breaker_state::half_open);
  CHECK(b.figures(clock.now()).probes_succeeded == 2);
  p3.record(outcome_kind::success, clock.now());
  CHECK(b.state() == breaker_state::closed);
  CHECK(b.figures(clock.now()).calls == 0);  // a fresh window after closing
  CHECK(b.figures(clock.now()).trips == 0);
  CHECK(log == std::vector<std::string>{"closed->open", "open->half-open", "half-open->closed"});
}

TEST_CASE("one failed probe reopens the breaker; open durations may grow with trips", "[breaker]") {
  manual_clock clock;
  keel::circuit_breaker b({.window_calls = 2,
                           .minimum_calls = 2,
                           .open_duration_for = [](int trips) { return keel::duration(1s) * (1 << (trips - 1)); },
                           .half_open_probes = 2});
  feed(b, clock.now(), outcome_kind::transient, 2);
  CHECK(b.figures(clock.now()).open_remaining == 1s);
  for (keel::duration expected : {2s, 4s, 8s}) {
    clock.advance(b.figures(clock.now()).open_remaining);
    keel::breaker_permit ok = b.try_acquire(clock.now());
    keel::breaker_permit bad = b.try_acquire(clock.now());
    REQUIRE((ok && bad));
    ok.record(outcome_kind::success, clock.now());
    bad.record(outcome_kind::transient, clock.now());
    CHECK(b.state() == breaker_state::open);
    CHECK(b.figures(clock.now()).open_remaining == expected);
  }
  CHECK(b.figures(clock.now()).trips == 4);
  // Closing resets the count: the next trip opens for 1 s again.
  clock.advance(8s);
  feed(b, clock.now(), outcome_kind::success, 2);
  CHECK(b.state() == breaker_state::closed);
  feed(b, clock.now(), outcome_kind::transient, 2);
  CHECK(b.figures(clock.now()).open_remaining == 1s);
}

TEST_CASE("with a half-open failure rate, probes decide by their share of failures", "[breaker]") {
  manual_clock clock;
  keel::circuit_breaker b(
      {.window_calls = 2, .minimum_calls = 2, .open_duration = 1s, .half_open_probes = 4, .half_open_failure_rate = 0.5});
  feed(b, clock.now(), outcome_kind::transient, 2);
  clock.advance(1s);
  std::vector<keel::breaker_permit> probes;
  for (int i = 0; i < 4; ++i) probes.push_back(b.try_acquire(clock.now()));
  probes[0].record(outcome_kind::transient, clock.now());
  CHECK(b.state() == breaker_state::half_open);  // 1 of 4 failed: not yet half
  probes[1].record(outcome_kind::success, clock.now());
  probes[2].record(outcome_kind::success, clock.now());
  CHECK(b.state() == breaker_state::half_open);  // 2 may still fail: undecided
  probes[3].record(outcome_kind::success, clock.now());
  CHECK(b.state() == breaker_state::closed);  // 1 of 4 < 0.5

  feed(b, clock.now(), outcome_kind::transient, 2);
  clock.advance(1s);
  probes.clear();
  for (int i = 0; i < 4; ++i) probes.push_back(b.try_acquire(clock.now()));
  probes[0].record(outcome_kind::transient, clock.now());
  probes[1].record(outcome_kind::transient, clock.now());
  CHECK(b.state() == breaker_state::open);  // 2 of 4 reached 0.5 before the rest came back
}

TEST_CASE("a probe that never reports is reclaimed after probe_timeout: half-open never sticks", "[breaker]") {
  manual_clock clock;
  std::vector<std::string> log;
  keel::circuit_breaker b({.window_calls = 2,
                           .minimum_calls = 2,
                           .open_duration = 10s,
                           .half_open_probes = 2,
                           .probe_timeout = 5s,
                           .on_state_change = transition_log{&log}});
  feed(b, clock.now(), outcome_kind::transient, 2);
  clock.advance(10s);
  keel::breaker_permit lost1 = b.try_acquire(clock.now());
  clock.advance(1s);
  keel::breaker_permit lost2 = b.try_acquire(clock.now());
  REQUIRE((lost1 && lost2));
  // Their calls hang. Until probe_timeout after the last probe, callers wait.
  clock.advance(4s);
  CHECK(!b.try_acquire(clock.now()));
  CHECK(keel::retry_after(b.refusal(clock.now())) == std::optional<keel::duration>(1s));
  clock.advance(1s);
  CHECK(!b.try_acquire(clock.now()));  // reclaimed as failures: reopened
  CHECK(b.state() == breaker_state::open);
  CHECK(b.figures(clock.now()).open_remaining == 10s);

  // The lost probes' late answers belong to a finished period: ignored.
  lost1.record(outcome_kind::success, clock.now());
  lost2.record(outcome_kind::success, clock.now());
  CHECK(b.state() == breaker_state::open);

  clock.advance(10s);
  feed(b, clock.now(), outcome_kind::success, 2);
  CHECK(b.state() == breaker_state::closed);
  CHECK(log == std::vector<std::string>{"closed->open", "open->half-open", "half-open->open", "open->half-open",
                                        "half-open->closed"});
}

TEST_CASE("a probe permit dropped without a result gives its slot back", "[breaker]") {
  manual_clock clock;
  keel::circuit_breaker b({.window_calls = 2, .minimum_calls = 2, .open_duration = 1s, .half_open_probes = 1});
  feed(b, clock.now(), outcome_kind::transient, 2);
  clock.advance(1s);
  {
    keel::breaker_permit p = b.try_acquire(clock.now());
    REQUIRE(p);
    CHECK(!b.try_acquire(clock.now()));
    // An exception between acquire and record unwinds through here.
  }
  keel::breaker_permit again = b.try_acquire(clock.now());
  CHECK(again);
  // Moving a permit does not double-count it.
  keel::breaker_permit moved = std::move(again);
  CHECK(!again);  // NOLINT: testing the moved-from state
  moved.record(outcome_kind::success, clock.now());
  CHECK(b.state() == breaker_state::closed);
}

TEST_CASE("half-open probes answered with a permanent error close the breaker: the dependency answered (Polly #1979)",
          "[breaker][half-open]") {
  manual_clock clock;
  std::vector<std::string> log;
  keel::circuit_breaker b({.window_calls = 2,
                           .minimum_calls = 2,
                           .open_duration = 5s,
                           .half_open_probes = 2,
                           .on_state_change = transition_log{&log}});
  feed(b, clock.now(), outcome_kind::transient, 2);
  clock.advance(5s);
  keel::breaker_permit p1 = b.try_acquire(clock.now());
  keel::breaker_permit p2 = b.try_acquire(clock.now());
  REQUIRE((p1 && p2));
  CHECK(!b.try_acquire(clock.now()));
  // One client's bad request during recovery: the dependency answered it.
  p1.record(outcome_kind::permanent, clock.now());
  CHECK(b.state() == breaker_state::half_open);
  CHECK(b.figures(clock.now()).probes_succeeded == 1);
  CHECK(!b.try_acquire(clock.now()));  // its slot stays used: the bound holds
  p2.record(outcome_kind::permanent, clock.now());
  CHECK(b.state() == breaker_state::closed);  // not another 5 s open for everyone
  CHECK(b.figures(clock.now()).trips == 0);
  CHECK(log == std::vector<std::string>{"closed->open", "open->half-open", "half-open->closed"});
}

TEST_CASE("through a pipeline, a probe answered with a bad key closes the breaker and traffic flows",
          "[breaker][pipeline][half-open]") {
  manual_clock clock;
  keel::circuit_breaker b({.window_calls = 2, .minimum_calls = 2, .open_duration = 5s, .half_open_probes = 2});
  auto pipe = keel::pipeline(b).in(keel::environment{clock});
  kt::scripted_provider<int> provider(clock, {kt::bad_credential()});
  feed(b, clock.now(), outcome_kind::transient, 2);
  clock.advance(5s);
  for (int i = 0; i < 6; ++i) {
    keel::call call(clock.now(), {.timeout = 1s});
    (void)pipe.run(call, provider);
  }
  CHECK(provider.calls() == 6);  // two probes closed it; the rest went through
  CHECK(b.state() == breaker_state::closed);
}

TEST_CASE("a throttled probe opens the breaker again at once, for its retry-after hint, not as a trip",
          "[breaker][half-open]") {
  manual_clock clock;
  std::vector<std::string> log;
  keel::circuit_breaker b({.window_calls = 2,
                           .minimum_calls = 2,
                           .open_duration = 5s,
                           .half_open_probes = 3,
                           .on_state_change = transition_log{&log}});
  auto pipe = keel::pipeline(b).in(keel::environment{clock});
  feed(b, clock.now(), outcome_kind::transient, 2);
  clock.advance(5s);
  keel::breaker_permit other = b.try_acquire(clock.now());  // a probe still out
  REQUIRE(other);
  kt::scripted_provider<int> provider(clock, {kt::rate_limited(12s)});
  keel::call call(clock.now(), {.timeout = 1s});
  CHECK(absl::IsResourceExhausted(pipe.run(call, provider).status()));
  CHECK(b.state() == breaker_state::open);
  CHECK(b.figures(clock.now()).open_remaining == 12s);  // the hint, not the 5 s open duration
  CHECK(b.figures(clock.now()).trips == 1);
  other.record(outcome_kind::success, clock.now());  // late: the period is over
  CHECK(b.state() == breaker_state::open);
  clock.advance(11s);
  CHECK(!b.try_acquire(clock.now()));
  clock.advance(1s);
  keel::breaker_permit next = b.try_acquire(clock.now());
  REQUIRE(next);
  // Without a hint (a standalone permit, no status): the open duration.
  next.record(outcome_kind::throttled, clock.now());
  CHECK(b.state() == breaker_state::open);
  CHECK(b.figures(clock.now()).open_remaining == 5s);
  CHECK(log == std::vector<std::string>{"closed->open", "open->half-open", "half-open->open", "open->half-open",
                                        "half-open->open"});
  // With its status, a standalone permit passes the hint too.
  clock.advance(5s);
  keel::breaker_permit third = b.try_acquire(clock.now());
  REQUIRE(third);
  third.record(keel::with_retry_after(absl::ResourceExhaustedError("429"), 30s), outcome_kind::throttled,
               clock.now());
  CHECK(b.figures(clock.now()).open_remaining == 30s);

  // Throttled configured as a failure: a trip, open at least for the hint.
  keel::circuit_breaker counted({.window_calls = 2, .minimum_calls = 2, .open_duration = 5s, .half_open_probes = 1,
                                 .throttled = keel::breaker_verdict::failure});
  feed(counted, clock.now(), outcome_kind::transient, 2);
  clock.advance(5s);
  keel::breaker_permit p = counted.try_acquire(clock.now());
  REQUIRE(p);
  p.record(keel::with_retry_after(absl::ResourceExhaustedError("429"), 2s), outcome_kind::throttled, clock.now());
  CHECK(counted.figures(clock.now()).trips == 2);
  CHECK(counted.figures(clock.now()).open_remaining == 5s);
}

TEST_CASE("a cancelled probe hands its slot back: the caller left, the dependency told nothing",
          "[breaker][half-open]") {
  manual_clock clock;
  keel::circuit_breaker b({.window_calls = 2, .minimum_calls = 2, .open_duration = 5s, .half_open_probes = 1});
  auto pipe = keel::pipeline(b).in(keel::environment{clock});
  feed(b, clock.now(), outcome_kind::transient, 2);
  clock.advance(5s);
  for (int i = 0; i < 3; ++i) {
    keel::call call(clock.now(), {.timeout = 1s});
    (void)pipe.run(call, [] { return absl::CancelledError("client went away"); });
    CHECK(b.state() == breaker_state::half_open);
    CHECK(b.figures(clock.now()).probes_admitted == 0);
  }
  keel::breaker_permit next = b.try_acquire(clock.now());
  REQUIRE(next);
  next.record(outcome_kind::success, clock.now());
  CHECK(b.state() == breaker_state::closed);
}

TEST_CASE("ignored probe outcomes other than answers keep their slots and judge nothing", "[breaker][half-open]") {
  manual_clock clock;
  std::vector<std::string> log;
  keel::circuit_breaker b({.window_calls = 2,
                           .minimum_calls = 2,
                           .open_duration = 5s,
                           .half_open_probes = 2,
                           .ambiguous = keel::breaker_verdict::ignore,
                           .on_state_change = transition_log{&log}});
  feed(b, clock.now(), outcome_kind::transient, 2);
  clock.advance(5s);
  // Every probe times out after sending (ambiguous, ignored here): none may
  // be replaced by another probe in the same period.
  int reached = 0;
  for (int i = 0; i < 10; ++i) {
    keel::breaker_permit p = b.try_acquire(clock.now());
    if (!p) continue;
    ++reached;
    p.record(outcome_kind::ambiguous, clock.now());
  }
  CHECK(reached == 2);
  // Nothing was proved either way: open again for the same time, no new trip.
  CHECK(b.state() == breaker_state::open);
  CHECK(b.figures(clock.now()).open_remaining == 5s);
  CHECK(b.figures(clock.now()).trips == 1);

  // Next period: one ignored and one success close it (the counted probe decides).
  clock.advance(5s);
  keel::breaker_permit p1 = b.try_acquire(clock.now());
  keel::breaker_permit p2 = b.try_acquire(clock.now());
  REQUIRE((p1 && p2));
  p1.record(outcome_kind::ambiguous, clock.now());
  CHECK(b.figures(clock.now()).probes_ignored == 1);
  CHECK(!b.try_acquire(clock.now()));  // the ignored probe's slot is not handed out again
  p2.record(outcome_kind::success, clock.now());
  CHECK(b.state() == breaker_state::closed);
  CHECK(log == std::vector<std::string>{"closed->open", "open->half-open", "half-open->open", "open->half-open",
                                        "half-open->closed"});
}

TEST_CASE("with a failure rate, ignored probes leave the decision to the counted ones", "[breaker]") {
  manual_clock clock;
  keel::circuit_breaker b({.window_calls = 2,
                           .minimum_calls = 2,
                           .open_duration = 1s,
                           .half_open_probes = 4,
                           .half_open_failure_rate = 0.5,
                           .ambiguous = keel::breaker_verdict::ignore});
  feed(b, clock.now(), outcome_kind::transient, 2);
  clock.advance(1s);
  std::vector<keel::breaker_permit> probes;
  for (int i = 0; i < 4; ++i) probes.push_back(b.try_acquire(clock.now()));
  CHECK(!b.try_acquire(clock.now()));
  probes[0].record(outcome_kind::ambiguous, clock.now());
  CHECK(!b.try_acquire(clock.now()));  // its slot stays used
  probes[1].record(outcome_kind::transient, clock.now());
  probes[2].record(outcome_kind::success, clock.now());
  CHECK(b.state() == breaker_state::half_open);  // 1 failed; the last could make it 2 of 4
  probes[3].record(outcome_kind::success, clock.now());
  CHECK(b.state() == breaker_state::closed);  // 1 failed of 4 < 0.5; the ignored one judged nothing
}

TEST_CASE("operators force open, force closed and hand back to automatic via probes", "[breaker]") {
  manual_clock clock;
  std::vector<std::string> log;
  keel::circuit_breaker b({.name = "provider",
                           .window_calls = 4,
                           .minimum_calls = 2,
                           .half_open_probes = 2,
                           .on_state_change = transition_log{&log}});
  b.force_open(clock.now());
  CHECK(!b.try_acquire(clock.now()));
  const absl::Status s = b.refusal(clock.now());
  // No retry-after (only the operator knows), but the caller is told what to do.
  CHECK(s.message() ==
        "keel: circuit breaker 'provider' is forced open by an operator; retry after the operator closes it "
        "(no retry-after: the breaker cannot know when)");
  CHECK(!keel::retry_after(s).has_value());
  CHECK(keel::refused_by(s) == "breaker:provider");
  clock.advance(1h);
  CHECK(!b.try_acquire(clock.now()));  // no cool-down ends a forced open

  b.automatic(clock.now());
  CHECK(b.state() == breaker_state::half_open);  // recovery is verified, not assumed
  feed(b, clock.now(), outcome_kind::success, 2);
  CHECK(b.state() == breaker_state::closed);

  b.force_closed(clock.now());
  feed(b, clock.now(), outcome_kind::transient, 50);
  CHECK(b.state() == breaker_state::forced_closed);  // disabled: nothing counted
  b.automatic(clock.now());
  CHECK(b.state() == breaker_state::closed);
  CHECK(b.figures(clock.now()).calls == 0);
  b.automatic(clock.now());  // already automatic: nothing happens
  CHECK(log == std::vector<std::string>{"closed->forced-open", "forced-open->half-open", "half-open->closed",
                                        "closed->forced-closed", "forced-closed->closed"});
}

TEST_CASE("operator controls act from every state, and late results from before them are ignored", "[breaker]") {
  manual_clock clock;
  keel::circuit_breaker b({.window_calls = 2, .minimum_calls = 2, .open_duration = 10s, .half_open_probes = 2});
  // open -> forced closed: everything passes at once, no cool-down.
  feed(b, clock.now(), outcome_kind::transient, 2);
  REQUIRE(b.state() == breaker_state::open);
  b.force_closed(clock.now());
  CHECK(b.try_acquire(clock.now()));
  // half-open -> forced open: probes already out are void.
  b.automatic(clock.now());
  feed(b, clock.now(), outcome_kind::transient, 2);
  clock.advance(10s);
  keel::breaker_permit probe = b.try_acquire(clock.now());
  REQUIRE(probe.probe());
  b.force_open(clock.now());
  probe.record(outcome_kind::success, clock.now());
  CHECK(b.state() == breaker_state::forced_open);
  // forced open -> forced closed -> forced open: each is one transition.
  b.force_closed(clock.now());
  CHECK(b.state() == breaker_state::forced_closed);
  keel::breaker_permit during = b.try_acquire(clock.now());
  b.force_open(clock.now());
  CHECK(b.state() == breaker_state::forced_open);
  b.force_open(clock.now());  // already: nothing happens
  // Back to automatic goes through probes; a permit from the forced period
  // reporting late changes nothing.
  b.automatic(clock.now());
  during.record(outcome_kind::transient, clock.now());
  CHECK(b.state() == breaker_state::half_open);
  CHECK(b.figures(clock.now()).probes_failed == 0);
}

TEST_CASE("what counts follows the classification: client errors never trip a provider breaker", "[breaker]") {
  const keel::time_point t = manual_clock().now();
  keel::circuit_breaker provider({.window_calls = 10, .minimum_calls = 2});
  feed(provider, t, outcome_kind::permanent, 20);  // bad keys, unsupported models
  feed(provider, t, outcome_kind::throttled, 20);  // rate limited: configurable, ignored by default
  CHECK(provider.state() == breaker_state::closed);
  CHECK(provider.figures(t).calls == 0);
  feed(provider, t, outcome_kind::ambiguous, 2);  // a write's timeout is a failure of the dependency
  CHECK(provider.state() == breaker_state::open);

  keel::circuit_breaker strict({.window_calls = 10, .minimum_calls = 2, .throttled = keel::breaker_verdict::failure});
  feed(strict, t, outcome_kind::throttled, 2);
  CHECK(strict.state() == breaker_state::open);

  keel::circuit_breaker lenient(
      {.window_calls = 10, .minimum_calls = 2, .transient = keel::breaker_verdict::success});
  feed(lenient, t, outcome_kind::transient, 5);
  CHECK(lenient.state() == breaker_state::closed);
  CHECK(lenient.figures(t).calls == 5);
}

TEST_CASE("inside retry the breaker counts attempts; outside it counts calls", "[breaker][pipeline]") {
  manual_clock clock;
  clock.auto_advance(true);
  const keel::retry retry3({.max_attempts = 3}, keel::constant_backoff{.delay_each = 10ms});
  auto failing = [](const keel::attempt&) -> absl::StatusOr<int> { return absl::UnavailableError("down"); };

  keel::circuit_breaker per_attempt({.window_calls = 100, .minimum_calls = 100});
  keel::call c1(clock.now(), {.timeout = 10s});
  CHECK(!keel::pipeline(retry3, per_attempt).in(keel::environment{clock}).run(c1, failing).ok());
  CHECK(per_attempt.figures(clock.now()).calls == 3);
  CHECK(per_attempt.figures(clock.now()).failures == 3);

  keel::circuit_breaker per_call({.window_calls = 100, .minimum_calls = 100});
  keel::call c2(clock.now(), {.timeout = 10s});
  CHECK(!keel::pipeline(per_call, retry3).in(keel::environment{clock}).run(c2, failing).ok());
  CHECK(per_call.figures(clock.now()).calls == 1);
  CHECK(per_call.figures(clock.now()).failures == 1);

  // A call that fails twice and then succeeds is one success for the
  // per-call breaker.
  int n = 0;
  auto flaky = [&](const keel::attempt&) -> absl::StatusOr<int> {
    return ++n < 3 ? absl::StatusOr<int>(absl::UnavailableError("blip")) : absl::StatusOr<int>(7);
  };
  keel::call c3(clock.now(), {.timeout = 10s});
  CHECK(keel::pipeline(per_call, retry3).in(keel::environment{clock}).run(c3, flaky).ok());
  CHECK(per_call.figures(clock.now()).calls == 2);
  CHECK(per_call.figures(clock.now()).failures == 1);
}

TEST_CASE("a breaker that opens inside retry stops the remaining attempts", "[breaker][pipeline]") {
  manual_clock clock;
  clock.auto_advance(true);
  const keel::retry retry5({.max_attempts = 5}, keel::constant_backoff{.delay_each = 10ms});
  keel::circuit_breaker b({.name = "dep", .window_calls = 10, .minimum_calls = 2, .open_duration = 30s});
  int calls = 0;
  auto failing = [&](const keel::attempt&) -> absl::StatusOr<int> {
    ++calls;
    return absl::UnavailableError("down");
  };
  keel::call call(clock.now(), {.timeout = 10s, .max_attempts = 5});
  const absl::StatusOr<int> r = keel::pipeline(retry5, b).in(keel::environment{clock}).run(call, failing);
  CHECK(calls == 2);  // the second failure tripped it; attempt 3 was refused, and retry stopped
  CHECK(r.status().code() == absl::StatusCode::kUnavailable);
  CHECK(keel::refused_by(r.status()) == std::optional<std::string>("breaker:dep"));
  CHECK(keel::retry_after(r.status()).has_value());
  CHECK(call.record().attempts == 2);
}

TEST_CASE("counting calls and gating attempts: breaker outside retry, attempt_gate inside", "[breaker][pipeline]") {
  manual_clock clock;
  clock.auto_advance(true);
  keel::circuit_breaker b({.name = "dep", .window_calls = 10, .minimum_calls = 2});
  const keel::retry retry3({.max_attempts = 3}, keel::constant_backoff{.delay_each = 10ms});
  auto pipe = keel::pipeline(b, retry3, b.attempt_gate()).in(keel::environment{clock});
  int calls = 0;
  // While this call's first attempt runs, other calls trip the breaker.
  auto provider = [&](const keel::attempt&) -> absl::StatusOr<int> {
    if (++calls == 1) feed(b, clock.now(), outcome_kind::transient, 2);
    return absl::UnavailableError("down");
  };
  keel::call call(clock.now(), {.timeout = 10s});
  const absl::StatusOr<int> r = pipe.run(call, provider);
  CHECK(calls == 1);  // the gate stopped attempt 2
  CHECK(keel::refused_by(r.status()) == std::optional<std::string>("breaker:dep"));
  CHECK(b.state() == breaker_state::open);
}

TEST_CASE("keel's refusals to start never count; a dependency refusing the connection does", "[breaker][pipeline]") {
  manual_clock clock;
  keel::circuit_breaker b({.window_calls = 10, .minimum_calls = 1, .failure_rate_threshold = 0.1});
  auto pipe = keel::pipeline(b).in(keel::environment{clock});
  keel::call expired(clock.now(), {.timeout = 1ms});
  clock.advance(5ms);
  // The pipeline refuses to start an attempt with no time left; the breaker
  // must not read that as the dependency failing.
  const absl::StatusOr<int> r = pipe.run(expired, [](const keel::attempt&) -> absl::StatusOr<int> { return 1; });
  CHECK(keel::not_started(r.status()));
  CHECK(b.figures(clock.now()).calls == 0);
  CHECK(b.state() == breaker_state::closed);

  // Nothing was sent either, but the dependency is what failed: counted.
  keel::call c(clock.now(), {.timeout = 1s});
  const absl::StatusOr<int> refused = pipe.run(c, [](const keel::attempt&) -> absl::StatusOr<int> {
    return keel::mark_not_started(absl::UnavailableError("connect: connection refused"));
  });
  CHECK(keel::not_started(refused.status()));
  CHECK(b.figures(clock.now()).calls == 1);
  CHECK(b.state() == breaker_state::open);
}

TEST_CASE("a pipeline's listener hears the breaker's transitions and refusals", "[breaker][telemetry]") {
  manual_clock clock;
  std::vector<std::string> heard;
  struct listener {
    std::vector<std::string>* heard;
    void operator()(const keel::events::breaker_state_changed& e) const {
      heard->push_back(std::string(e.breaker) + ": " + std::string(keel::to_string(e.change.to)));
    }
    void operator()(const keel::events::breaker_rejected& e) const {
      heard->push_back(std::string(e.breaker) + ": rejected while " + std::string(keel::to_string(e.state)));
    }
  };
  keel::circuit_breaker b({.name = "b", .window_calls = 2, .minimum_calls = 1, .open_duration = 1s,
                           .half_open_probes = 1});
  auto pipe = keel::pipeline(b).in(keel::environment{clock}.with_listener(listener{&heard}));
  auto fail = [](const keel::attempt&) -> absl::Status { return absl::UnavailableError("x"); };
  auto ok = [](const keel::attempt&) -> absl::Status { return absl::OkStatus(); };
  keel::call c1(clock.now(), {});
  (void)pipe.run(c1, fail);
  keel::call c2(clock.now(), {});
  (void)pipe.run(c2, ok);
  clock.advance(1s);
  keel::call c3(clock.now(), {});
  (void)pipe.run(c3, ok);
  CHECK(heard == std::vector<std::string>{"b: open", "b: rejected while open", "b: half-open", "b: closed"});
}

TEST_CASE("invalid breaker options are refused with the field named", "[breaker][options]") {
  auto message = [](keel::circuit_breaker_options o) { return std::string(o.validate().message()); };
  CHECK(message({.window_calls = 0}) == "circuit_breaker_options.window_calls must be in [1, 65536] (got 0)");
  CHECK(message({.window_calls = 10, .minimum_calls = 11}) ==
        "circuit_breaker_options.minimum_calls must be in [1, window_calls] (got 11)");
  CHECK(message({.failure_rate_threshold = 1.5}) ==
        "circuit_breaker_options.failure_rate_threshold must be in (0, 1] (got 1.5)");
  CHECK(message({.failure_rate_threshold = -0.1}) ==
        "circuit_breaker_options.failure_rate_threshold must be in (0, 1] (got -0.1)");
  CHECK(message({.slow_call_rate_threshold = 0.0}) ==
        "circuit_breaker_options.slow_call_rate_threshold must be in (0, 1] (got 0)");
  CHECK(message({.window = keel::breaker_window::time, .window_length = 500ms, .bucket_width = 1s}) ==
        "circuit_breaker_options.window_length must be >= bucket_width (got 500ms < 1s)");
  CHECK(message({.window = keel::breaker_window::time, .window_length = 1500ms, .bucket_width = 1s}) ==
        "circuit_breaker_options.window_length must be a multiple of bucket_width (got 1.5s)");
  CHECK(message({.window = keel::breaker_window::time, .bucket_width = keel::duration::zero()}) ==
        "circuit_breaker_options.bucket_width must be > 0 (got 0s)");
  CHECK(message({.open_duration = -1s}) == "circuit_breaker_options.open_duration must be > 0 (got -1s)");
  CHECK(message({.half_open_probes = 0}) == "circuit_breaker_options.half_open_probes must be in [1, 1000] (got 0)");
  CHECK(message({.half_open_failure_rate = 2.0}) ==
        "circuit_breaker_options.half_open_failure_rate must be in (0, 1] (got 2)");
  CHECK(message({.probe_timeout = keel::duration::zero()}) ==
        "circuit_breaker_options.probe_timeout must be > 0 (got 0s)");
  CHECK(message({.failure_rate_threshold = std::nullopt}) ==
        "circuit_breaker_options.failure_rate_threshold must be set when slow_call_rate_threshold is not (got "
        "nullopt)");
  CHECK(message({.name = ""}) == "circuit_breaker_options.name must not be empty (got \"\")");
  CHECK_THROWS_AS(keel::circuit_breaker({.window_calls = -5}), keel::invalid_options);
  CHECK_THROWS_AS(keel::circuit_breaker({.minimum_calls = 0}), keel::invalid_options);
  CHECK_THROWS_WITH(keel::circuit_breaker({.minimum_calls = 0}),
                    "circuit_breaker_options.minimum_calls must be in [1, window_calls] (got 0)");
  // The exception carries the status: InvalidArgument, with the same message.
  auto thrown = [](const keel::circuit_breaker_options& o) -> absl::Status {
    try {
      keel::circuit_breaker b(o);
    } catch (const keel::invalid_options& e) {
      return e.status();
    }
    return absl::OkStatus();  // nothing thrown: the check below fails
  };
  CHECK(thrown({.minimum_calls = 0}) ==
        absl::InvalidArgumentError("circuit_breaker_options.minimum_calls must be in [1, window_calls] (got 0)"));
}

// --- scoped health ------------------------------------------------------------

TEST_CASE("one tenant's bad key trips that tenant's breaker, not the provider's", "[breaker][registry]") {
  manual_clock clock;
  keel::breaker_registry providers({.breaker = {.window_calls = 10, .minimum_calls = 3}});
  keel::breaker_registry tenants({.breaker = {.window_calls = 10, .minimum_calls = 3,
                                              .permanent = keel::breaker_verdict::failure},
                                  .scope = {.endpoint = false, .model = false, .region = false, .tenant = true}});
  auto pipe = keel::pipeline(tenants, providers).in(keel::environment{clock});
  auto provider = [](const keel::attempt& a) -> absl::StatusOr<int> {
    if (a.labels().tenant == "revoked") return absl::UnauthenticatedError("invalid API key");
    return 1;
  };
  const keel::labels bad{.tenant = "revoked", .model = "m", .endpoint = "api", .region = "eu"};
  const keel::labels good{.tenant = "acme", .model = "m", .endpoint = "api", .region = "eu"};
  for (int i = 0; i < 5; ++i) {
    keel::call c(clock.now(), {.labels = bad});
    (void)pipe.run(c, provider);
  }
  keel::call c(clock.now(), {.labels = good});
  CHECK(pipe.run(c, provider).ok());

  CHECK(tenants.breaker_for(bad).state() == breaker_state::open);
  CHECK(tenants.breaker_for(good).state() == breaker_state::closed);
  CHECK(providers.breaker_for(good).state() == breaker_state::closed);
  CHECK(providers.breaker_for(good).figures(clock.now()).calls == 1);  // the bad key's 3 calls were ignored
  CHECK(&providers.breaker_for(good) == &providers.breaker_for(bad));   // same endpoint/model/region
  CHECK(tenants.breaker_for(bad).name() == "tenant=revoked");
}

TEST_CASE("breakers are scoped to endpoint/model/region and listed with their states", "[breaker][registry]") {
  manual_clock clock;
  keel::breaker_registry reg({.breaker = {.window_calls = 4, .minimum_calls = 2}});
  const keel::failure_domain eu{.endpoint = "api", .model = "m", .region = "eu"};
  const keel::failure_domain us{.endpoint = "api", .model = "m", .region = "us"};
  const keel::failure_domain other_model{.endpoint = "api", .model = "n", .region = "eu"};
  feed(reg.breaker_for(eu), clock.now(), outcome_kind::transient, 2);
  feed(reg.breaker_for(us), clock.now(), outcome_kind::success, 2);
  (void)reg.breaker_for(other_model);
  CHECK(reg.find(eu) != nullptr);
  CHECK(reg.find({.endpoint = "nowhere"}) == nullptr);
  // The tenant label is not part of this registry's scope.
  CHECK(&reg.breaker_for(keel::failure_domain{.endpoint = "api", .model = "m", .region = "eu", .tenant = "x"}) == &reg.breaker_for(eu));

  const std::vector<keel::breaker_entry> all = reg.list(clock.now());
  REQUIRE(all.size() == 3);
  CHECK(all[0].domain == "endpoint=api,model=m,region=eu");
  CHECK(all[0].state.state == breaker_state::open);
  CHECK(all[1].domain == "endpoint=api,model=m,region=us");
  CHECK(all[1].state.state == breaker_state::closed);
  CHECK(all[1].state.calls == 2);
  CHECK(all[2].domain == "endpoint=api,model=n,region=eu");

  REQUIRE(reg.force_open(us, clock.now()).ok());
  CHECK(reg.breaker_for(us).state() == breaker_state::forced_open);
  reg.automatic(us, clock.now());
  CHECK(reg.breaker_for(us).state() == breaker_state::half_open);
}

TEST_CASE("a domain's breaker can be made with options of its own; an existing one keeps its own",
          "[breaker][registry]") {
  manual_clock clock;
  keel::breaker_registry reg({.breaker = {.window_calls = 4, .minimum_calls = 2}});
  const keel::failure_domain slow{.endpoint = "slow-model", .model = "m", .region = "eu"};
  const keel::failure_domain usual{.endpoint = "api", .model = "m", .region = "eu"};
  keel::circuit_breaker& s = reg.breaker_for(slow, {.window_calls = 20, .minimum_calls = 10});
  CHECK(s.name() == "endpoint=slow-model,model=m,region=eu");
  CHECK(&reg.breaker_for(slow) == &s);  // the pipeline's lookup finds it
  // Two failures open the registry's usual breaker; the slow one needs ten.
  feed(reg.breaker_for(usual), clock.now(), outcome_kind::transient, 2);
  feed(s, clock.now(), outcome_kind::transient, 2);
  CHECK(reg.breaker_for(usual).state() == breaker_state::open);
  CHECK(s.state() == breaker_state::closed);
  feed(s, clock.now(), outcome_kind::transient, 8);
  CHECK(s.state() == breaker_state::open);
  // Made already: other options do not remake it.
  CHECK(&reg.breaker_for(slow, {.window_calls = 1, .minimum_calls = 1}) == &s);
  // Invalid options are refused, naming the field, and make nothing.
  const keel::failure_domain bad{.endpoint = "bad"};
  CHECK_THROWS_WITH((void)reg.breaker_for(bad, {.window_calls = 0}),
                    "circuit_breaker_options.window_calls must be in [1, 65536] (got 0)");
  CHECK(reg.find(bad) == nullptr);
}

TEST_CASE("a registry outside retry counts calls; its attempt gate stops retries once the domain opens",
          "[breaker][registry][pipeline]") {
  manual_clock clock;
  clock.auto_advance(true);
  keel::breaker_registry reg({.breaker = {.window_calls = 10, .minimum_calls = 2}});
  const keel::retry retry3({.max_attempts = 3}, keel::constant_backoff{.delay_each = 10ms});
  auto pipe = keel::pipeline(reg, retry3, reg.attempt_gate()).in(keel::environment{clock});
  const keel::labels eu{.model = "m", .endpoint = "api", .region = "eu"};
  int calls = 0;
  auto provider = [&](const keel::attempt&) -> absl::StatusOr<int> {
    if (++calls == 1) feed(reg.breaker_for(eu), clock.now(), outcome_kind::transient, 2);  // others trip it
    return absl::UnavailableError("down");
  };
  keel::call call(clock.now(), {.timeout = 10s, .labels = eu});
  const absl::StatusOr<int> r = pipe.run(call, provider);
  CHECK(calls == 1);
  CHECK(keel::refused_by(r.status()) == std::optional<std::string>("breaker:endpoint=api,model=m,region=eu"));
  // Another domain is untouched by this one's gate.
  keel::call us(clock.now(), {.timeout = 10s, .labels = {.model = "m", .endpoint = "api", .region = "us"}});
  calls = 1;
  CHECK(pipe.run(us, [&](const keel::attempt&) -> absl::StatusOr<int> { return ++calls; }).ok());
}

TEST_CASE("the registry is bounded: extra domains share an overflow breaker", "[breaker][registry]") {
  manual_clock clock;
  keel::breaker_registry reg({.breaker = {.window_calls = 4, .minimum_calls = 2}, .max_breakers = 2});
  keel::circuit_breaker& a = reg.breaker_for(keel::failure_domain{.endpoint = "a"});
  keel::circuit_breaker& b = reg.breaker_for(keel::failure_domain{.endpoint = "b"});
  keel::circuit_breaker& c = reg.breaker_for(keel::failure_domain{.endpoint = "c"});
  keel::circuit_breaker& d = reg.breaker_for(keel::failure_domain{.endpoint = "d"});
  CHECK(&a != &b);
  CHECK(&c == &d);
  CHECK(c.name() == "(overflow)");
  CHECK(reg.size() == 2);
  CHECK(reg.overflowed() == 2);
  const std::vector<keel::breaker_entry> all = reg.list(clock.now());
  REQUIRE(all.size() == 3);
  CHECK(all.back().domain == "(overflow)");

  CHECK(std::string(keel::breaker_registry_options{.max_breakers = 0}.validate().message()) ==
        "breaker_registry_options.max_breakers must be in [1, 1048576] (got 0)");
  CHECK(std::string(keel::breaker_registry_options{.breaker = {.window_calls = 0}}.validate().message()) ==
        "breaker_registry_options.breaker: circuit_breaker_options.window_calls must be in [1, 65536] (got 0)");
  CHECK(std::string(keel::breaker_registry_options{
                        .scope = {.endpoint = false, .model = false, .region = false, .tenant = false}}
                        .validate()
                        .message()) == "breaker_registry_options.scope must name at least one label (got none)");
}

TEST_CASE("forcing open a domain of a full registry affects that domain alone, never the overflow breaker",
          "[breaker][registry]") {
  manual_clock clock;
  keel::breaker_registry reg(
      {.breaker = {.window_calls = 4, .minimum_calls = 2}, .max_breakers = 2, .operator_breakers = 1});
  const keel::failure_domain a{.endpoint = "a"}, b{.endpoint = "b"}, c{.endpoint = "c"}, d{.endpoint = "d"},
      e{.endpoint = "e"};
  (void)reg.breaker_for(a);
  (void)reg.breaker_for(b);
  REQUIRE(reg.breaker_for(c).name() == "(overflow)");
  REQUIRE(reg.breaker_for(d).name() == "(overflow)");

  // c has overflowed; the operator contains an outage of c.
  REQUIRE(reg.force_open(c, clock.now()).ok());
  CHECK(reg.breaker_for(c).name() == "endpoint=c,model=,region=");
  CHECK(reg.breaker_for(c).state() == breaker_state::forced_open);
  CHECK(reg.find(c) == &reg.breaker_for(c));
  // d still shares the overflow breaker, and it was not touched.
  CHECK(reg.breaker_for(d).name() == "(overflow)");
  CHECK(reg.breaker_for(d).state() == breaker_state::closed);
  CHECK(reg.breaker_for(d).try_acquire(clock.now()));
  CHECK(reg.size() == 3);

  // The operator reserve is used up: refused, saying why, and nothing moves.
  const absl::Status refused = reg.force_open(e, clock.now());
  CHECK(refused.code() == absl::StatusCode::kResourceExhausted);
  CHECK(contains(refused.message(), "domain 'endpoint=e,model=,region='"));
  CHECK(contains(refused.message(), "overflow breaker"));
  CHECK(reg.breaker_for(e).state() == breaker_state::closed);
  CHECK(reg.breaker_for(d).state() == breaker_state::closed);

  // Back to automatic: c's own breaker probes; the overflow one never moved.
  reg.automatic(c, clock.now());
  CHECK(reg.breaker_for(c).state() == breaker_state::half_open);
  reg.automatic(e, clock.now());  // no breaker of its own: nothing to undo
  CHECK(reg.breaker_for(e).state() == breaker_state::closed);
  const std::vector<keel::breaker_entry> all = reg.list(clock.now());
  REQUIRE(all.size() == 4);
  CHECK(all.back().domain == "(overflow)");
  CHECK(all.back().state.state == breaker_state::closed);
}

// --- concurrency --------------------------------------------------------------

TEST_CASE("many threads hammering half-open never get more than half_open_probes", "[breaker][concurrency]") {
  manual_clock clock;
  constexpr int kProbes = 3;
  constexpr int kThreads = 8;
  constexpr int kRounds = 200;
  keel::circuit_breaker b({.window_calls = 4, .minimum_calls = 1, .half_open_probes = kProbes});
  std::vector<int> granted_per_round;
  std::vector<int> max_outstanding_per_round;
  for (int round = 0; round < kRounds; ++round) {
    b.force_open(clock.now());
    b.automatic(clock.now());  // half-open, no probe out
    std::atomic<int> granted{0};
    std::atomic<int> outstanding{0};
    std::atomic<int> max_outstanding{0};
    std::atomic<bool> go{false};
    std::latch tried(kThreads);  // held probes are kept until every thread has tried
    // Odd rounds: each probe reports at once with an answer that tells
    // nothing (the caller cancelled), so its slot comes back and the
    // breaker stays half-open. (A permanent error would count toward
    // closing, and a closed breaker admits every thread.)
    const bool report = round % 2 == 1;
    {
      std::vector<std::jthread> threads;
      for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&] {
          while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
          std::vector<keel::breaker_permit> held;
          for (int i = 0; i < 50; ++i) {
            keel::breaker_permit p = b.try_acquire(clock.now());
            if (!p) continue;
            granted.fetch_add(1);
            const int now_out = outstanding.fetch_add(1) + 1;
            int seen = max_outstanding.load();
            while (now_out > seen && !max_outstanding.compare_exchange_weak(seen, now_out)) {
            }
            if (report) {
              outstanding.fetch_sub(1);
              p.record(outcome_kind::cancelled, clock.now());  // told nothing: the slot comes back
            } else {
              held.push_back(std::move(p));
            }
          }
          tried.arrive_and_wait();
          for (auto& p : held) {
            outstanding.fetch_sub(1);
            p.ignore();
          }
        });
      }
      go.store(true, std::memory_order_release);
    }
    if (!report) granted_per_round.push_back(granted.load());
    max_outstanding_per_round.push_back(max_outstanding.load());
  }
  for (int g : granted_per_round) CHECK(g == kProbes);  // held probes: exactly the bound, never more
  for (int m : max_outstanding_per_round) CHECK(m <= kProbes);
}

TEST_CASE("concurrent closed-state records keep exact window totals", "[breaker][concurrency]") {
  const keel::time_point t = manual_clock().now();
  // Never trips (slow calls only, none slow), so every record lands.
  keel::circuit_breaker b({.window_calls = 64,
                           .minimum_calls = 1,
                           .failure_rate_threshold = std::nullopt,
                           .slow_call_rate_threshold = 1.0});
  auto hammer = [&](bool mixed) {
    std::vector<std::jthread> threads;
    for (int th = 0; th < 4; ++th) {
      threads.emplace_back([&, th] {
        for (int i = 0; i < 5000; ++i) {
          keel::breaker_permit p = b.try_acquire(t);
          p.record(mixed && (i + th) % 3 == 0 ? outcome_kind::transient : outcome_kind::success, t);
        }
      });
    }
  };
  hammer(true);
  const keel::breaker_figures mixed = b.figures(t);
  CHECK(mixed.calls == 64);
  CHECK(mixed.failures > 0);
  CHECK(mixed.failures < 64);
  hammer(false);
  const keel::breaker_figures clean = b.figures(t);
  CHECK(clean.calls == 64);
  CHECK(clean.failures == 0);  // no drift: every failure replaced exactly once
}

TEST_CASE("the count window's division-free index matches i mod n", "[breaker]") {
  for (std::uint32_t n : {1u, 2u, 3u, 7u, 10u, 100u, 999u, 4096u, 65535u, 65536u}) {
    const std::uint64_t magic = keel::detail::fast_mod_magic(n);
    for (std::uint32_t i : {0u, 1u, n - 1, n, n + 1, 12345u, 0x7fffffffu, 0xfffffffeu, 0xffffffffu}) {
      INFO("i=" << i << " n=" << n);
      CHECK(keel::detail::fast_mod(i, magic, n) == i % n);
    }
    for (std::uint32_t i = 0; i < 200000; i += 7) {
      if (keel::detail::fast_mod(i * 2654435761u, magic, n) != (i * 2654435761u) % n) FAIL("mismatch at " << i);
    }
  }
}

TEST_CASE("refusals and cancellations are never counted, whatever the options say", "[breaker][outcome]") {
  manual_clock clock;
  // Even a breaker told to count permanent and throttled outcomes as failures.
  keel::circuit_breaker b({.name = "llm", .window_calls = 4, .minimum_calls = 2, .failure_rate_threshold = 0.5,
                           .throttled = keel::breaker_verdict::failure,
                           .permanent = keel::breaker_verdict::failure});
  auto pipe = keel::pipeline(b).in(keel::environment{clock});
  // A refusal from a stage further in (a quota, a bulkhead: started inside
  // the breaker's pass, so not marked on the way in), a caller that left,
  // and a refusal that does not say "not started" but is marked refused.
  const absl::Status seen[] = {
      keel::refusal(absl::ResourceExhaustedError("tenant quota"), "tenant:acme:rate", 1s),
      absl::CancelledError("client went away"),
      keel::with_outcome(absl::UnavailableError("keel: declined"), keel::outcome_kind::refused),
  };
  for (int round = 0; round < 4; ++round) {
    for (const absl::Status& s : seen) {
      keel::call c(clock.now(), {.timeout = 1s});
      CHECK(pipe.run(c, [&] { return s; }).code() == s.code());
    }
  }
  CHECK(b.state() == keel::breaker_state::closed);
  CHECK(b.figures(clock.now()).failure_rate == 0.0);
  // The control: two real failures open it.
  for (int i = 0; i < 2; ++i) {
    keel::call c(clock.now(), {.timeout = 1s});
    (void)pipe.run(c, [] { return absl::UnavailableError("503"); });
  }
  CHECK(b.state() == keel::breaker_state::open);
}

TEST_CASE("a probe refused further in never reached the dependency: its half-open slot goes back", "[breaker][outcome]") {
  manual_clock clock;
  keel::circuit_breaker b({.window_calls = 2, .minimum_calls = 2, .open_duration = 5s, .half_open_probes = 1});
  feed(b, clock.now(), outcome_kind::transient, 2);
  clock.advance(5s);
  keel::breaker_permit first = b.try_acquire(clock.now());
  REQUIRE(first);
  CHECK(!b.try_acquire(clock.now()));  // the one probe is out
  first.record(outcome_kind::refused, clock.now());  // a quota further in declined it
  CHECK(b.state() == breaker_state::half_open);
  CHECK(b.figures(clock.now()).probes_ignored == 0);
  keel::breaker_permit second = b.try_acquire(clock.now());
  REQUIRE(second);  // the slot came back: the dependency has still seen no probe
  second.record(outcome_kind::success, clock.now());
  CHECK(b.state() == breaker_state::closed);
}
