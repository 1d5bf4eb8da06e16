// keel::adaptive_limit: the first probe sets the baseline, the limit grows
// near it (only when used) and shrinks with queueing or drops, probes
// re-measure at low concurrency and ignore calls admitted before them, the
// drift bound, classes shed in order, the policy's refusals, samples and
// events, and the long incidents on the manual clock: a provider that
// loses capacity for half an hour and one that turns ten times slower,
// each beside the configuration that lets the baseline drift.
#include "keel/policy/adaptive_limit.hpp"

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <mutex>
#include <queue>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "keel/compose/pipeline.hpp"
#include "keel/core/call.hpp"
#include "keel/testing/manual_clock.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;
using keel::testing::manual_clock;

namespace {

// Calls `n` permits of class `cls` through at `latency` each, all admitted
// first and then released together at now + latency. Returns how many were admitted.
int run_batch(keel::adaptive_limit& lim, const manual_clock& clock, int n, keel::duration latency,
              std::size_t cls = 0, keel::limit_sample kind = keel::limit_sample::ok) {
  std::vector<keel::adaptive_limit_permit> held;
  for (int i = 0; i < n; ++i) {
    keel::adaptive_limit_permit p = lim.try_acquire(cls);
    if (p) held.push_back(std::move(p));
  }
  clock.advance(latency);
  for (auto& p : held) p.release(latency, clock.now(), kind);
  return static_cast<int>(held.size());
}

// Ends the first probe: probe_samples calls at `latency`.
void finish_probe(keel::adaptive_limit& lim, const manual_clock& clock, keel::duration latency) {
  REQUIRE(lim.figures().probing);
  while (lim.figures().probing) REQUIRE(run_batch(lim, clock, lim.options().probe_limit, latency) > 0);
}

std::string message(const keel::adaptive_limit_options& o) { return std::string(o.validate().message()); }

}  // namespace

TEST_CASE("adaptive limit: the first probe measures the baseline at probe_limit, then the limit is initial",
          "[adaptive_limit]") {
  manual_clock clock;
  keel::adaptive_limit lim({.initial_limit = 10, .tolerance = 1.5, .window = 4, .probe_limit = 2, .probe_samples = 4});
  CHECK(lim.limit() == 2);
  CHECK(lim.figures().probing);
  auto a = lim.try_acquire(0);
  auto b = lim.try_acquire(0);
  CHECK(!lim.try_acquire(0));  // probing: two at a time
  CHECK(lim.figures().rejected == 1);
  clock.advance(100ms);
  a.release(100ms, clock.now(), keel::limit_sample::ok);
  b.release(120ms, clock.now(), keel::limit_sample::ok);
  CHECK(lim.figures().probing);  // 2 of 4 samples
  REQUIRE(run_batch(lim, clock, 2, 80ms) == 2);
  const keel::adaptive_limit_figures f = lim.figures();
  CHECK(!f.probing);
  CHECK(f.baseline == 95ms);  // the mean of the four: (100 + 120 + 80 + 80) / 4
  CHECK(f.limit == 10);
  CHECK(f.probes == 1);
  CHECK(f.in_flight == 0);
}

TEST_CASE("adaptive limit: grows by sqrt(limit) near the baseline, only when the limit is in use",
          "[adaptive_limit]") {
  manual_clock clock;
  keel::adaptive_limit lim({.initial_limit = 16, .max_limit = 100, .tolerance = 1.5, .window = 16, .probe_limit = 2,
                            .probe_samples = 4});
  finish_probe(lim, clock, 100ms);
  REQUIRE(lim.limit() == 16);
  // All 16 in flight at 140 ms (within tolerance 1.5): 16 + 4 = 20.
  CHECK(run_batch(lim, clock, 16, 140ms) == 16);
  CHECK(lim.limit() == 20);
  // App-limited: only 4 at a time, 16 samples near the baseline: no growth.
  for (int i = 0; i < 4; ++i) run_batch(lim, clock, 4, 100ms);
  CHECK(lim.limit() == 20);
  CHECK(lim.figures().updates == 3);  // the probe's window and two of 16
  // Used again: grows, up to max_limit and no further.
  for (int i = 0; i < 40; ++i) run_batch(lim, clock, lim.limit(), 100ms);
  CHECK(lim.limit() == 100);
}

TEST_CASE("adaptive limit: shrinks by baseline * tolerance / latency, at most by half; drops shrink it too",
          "[adaptive_limit]") {
  manual_clock clock;
  keel::adaptive_limit lim({.initial_limit = 40, .min_limit = 3, .tolerance = 1.5, .window = 20, .probe_limit = 2,
                            .probe_samples = 4});
  finish_probe(lim, clock, 100ms);
  // Mean 200 ms against 150 ms allowed: 40 * 0.75 = 30.
  CHECK(run_batch(lim, clock, 20, 200ms) == 20);
  CHECK(lim.limit() == 30);
  // Mean 1 s: the gradient would be 0.15, clamped to 0.5.
  CHECK(run_batch(lim, clock, 20, 1s) == 20);
  CHECK(lim.limit() == 15);
  // Fast but half of them throttled: at least 1 - 0.5/2 = 0.75 → 11.25.
  run_batch(lim, clock, 10, 100ms);
  run_batch(lim, clock, 10, 100ms, 0, keel::limit_sample::dropped);
  CHECK(lim.limit() == 11);
  // Never below min_limit.
  for (int i = 0; i < 40; ++i) run_batch(lim, clock, 20, 1s);
  CHECK(lim.limit() == 3);
}

TEST_CASE("adaptive limit: a probe lowers the limit, ignores calls admitted before it, and restores the limit",
          "[adaptive_limit]") {
  manual_clock clock;
  keel::adaptive_limit lim({.initial_limit = 8, .tolerance = 1.5, .window = 4, .probe_interval = 30s,
                            .probe_jitter = 0, .probe_limit = 1, .probe_samples = 2, .max_drift = 100});
  finish_probe(lim, clock, 100ms);
  REQUIRE(lim.figures().baseline == 100ms);
  // Between probes the baseline stays put, whether windows are slow or fast.
  run_batch(lim, clock, 4, 140ms);
  CHECK(lim.figures().baseline == 100ms);
  run_batch(lim, clock, 4, 60ms);
  CHECK(lim.figures().baseline == 100ms);
  // Hold four permits across the start of the next probe.
  std::vector<keel::adaptive_limit_permit> old;
  for (int i = 0; i < 4; ++i) old.push_back(lim.try_acquire(0));
  clock.advance(30s);
  // This window ends after probe_interval: it counts (90 ms is near the
  // baseline and eight were in flight: the limit grows), then the probe starts.
  run_batch(lim, clock, 4, 90ms);
  CHECK(lim.figures().probing);
  CHECK(lim.limit() == 1);
  CHECK(!lim.try_acquire(0));  // four old ones still in flight, above probe_limit
  // The old calls come back slow (they carry the old queue): not probe samples.
  for (auto& p : old) p.release(2s, clock.now(), keel::limit_sample::ok);
  CHECK(lim.figures().probing);
  run_batch(lim, clock, 1, 150ms);
  run_batch(lim, clock, 1, 170ms);
  const keel::adaptive_limit_figures f = lim.figures();
  CHECK(!f.probing);
  CHECK(f.baseline == 160ms);  // re-measured from the probe's own two
  CHECK(f.limit == 14);  // the limit from before the probe: 10.8 + sqrt(10.8)
  CHECK(f.probes == 2);
}

TEST_CASE("adaptive limit: a probe raises the baseline to at most max_drift times the floor, for the horizon",
          "[adaptive_limit]") {
  manual_clock clock;
  keel::adaptive_limit lim({.initial_limit = 8, .window = 4, .probe_interval = 1min, .probe_jitter = 0, .probe_limit = 1,
                            .probe_samples = 1, .max_drift = 2, .drift_horizon = 10min});
  finish_probe(lim, clock, 100ms);
  auto probe_at = [&](keel::duration latency) {
    clock.advance(1min);
    // Windows at `latency` until one ends past the interval and starts the probe.
    for (int i = 0; i < 8 && !lim.figures().probing; ++i) run_batch(lim, clock, lim.limit(), latency);
    REQUIRE(lim.figures().probing);
    run_batch(lim, clock, 1, latency);  // its one sample
    REQUIRE(!lim.figures().probing);
    return lim.figures();
  };
  keel::adaptive_limit_figures f = probe_at(1s);
  CHECK(f.baseline == 200ms);  // 2 x the floor of 100 ms, not 1 s
  CHECK(f.floor == 100ms);
  // Ten minutes on, the floor still remembers the last horizon...
  for (int i = 0; i < 10; ++i) f = probe_at(1s);
  CHECK(f.baseline == 200ms);
  // ...and after two horizons of slow probes the slow latency is the floor.
  for (int i = 0; i < 12; ++i) f = probe_at(1s);
  CHECK(f.floor == 1s);
  CHECK(f.baseline == 1s);
  // Faster again: the baseline follows down at once.
  f = probe_at(120ms);
  CHECK(f.baseline == 120ms);
  CHECK(f.floor == 120ms);
}

TEST_CASE("adaptive limit: probes are jittered within probe_jitter of the interval, reproducibly by seed",
          "[adaptive_limit]") {
  // When does the second probe start? Windows of four 10 ms calls end every
  // 10 ms; the probe starts with the first window ending past the interval.
  auto second_probe_after = [](std::uint64_t seed, double jitter) {
    manual_clock clock;
    keel::adaptive_limit lim({.initial_limit = 8, .window = 4, .probe_interval = 10s, .probe_jitter = jitter,
                              .jitter_seed = seed, .probe_limit = 4, .probe_samples = 4});
    finish_probe(lim, clock, 10ms);
    const keel::time_point first = clock.now();
    while (!lim.figures().probing) run_batch(lim, clock, 4, 10ms);
    return clock.now() - first;
  };
  CHECK(second_probe_after(1, 0.0) == 10s);
  std::vector<keel::duration> seen;
  for (std::uint64_t seed = 1; seed <= 8; ++seed) {
    const keel::duration d = second_probe_after(seed, 0.5);
    CHECK(d >= 10s);
    CHECK(d <= 15s + 10ms);
    CHECK(second_probe_after(seed, 0.5) == d);  // the same seed, the same jitter
    seen.push_back(d);
  }
  std::sort(seen.begin(), seen.end());
  CHECK(std::unique(seen.begin(), seen.end()) - seen.begin() >= 6);  // spread, not one instant
  CHECK(seen.back() - seen.front() >= 1s);
}

TEST_CASE("adaptive limit: classes shed in order, batch within its share of the limit", "[adaptive_limit]") {
  manual_clock clock;
  keel::adaptive_limit lim({.initial_limit = 10, .window = 8, .probe_limit = 2, .probe_samples = 2,
                            .classes = {{.name = "interactive"}, {.name = "batch", .share = 0.5}}});
  const std::size_t interactive = *lim.class_index("interactive");
  const std::size_t batch = *lim.class_index("batch");
  finish_probe(lim, clock, 100ms);
  REQUIRE(lim.limit() == 10);
  std::vector<keel::adaptive_limit_permit> held;
  for (int i = 0; i < 10; ++i)
    if (auto p = lim.try_acquire(batch)) held.push_back(std::move(p));
  CHECK(held.size() == 5);  // batch fills half
  for (int i = 0; i < 10; ++i)
    if (auto p = lim.try_acquire(interactive)) held.push_back(std::move(p));
  CHECK(held.size() == 10);  // interactive fills the rest
  CHECK(lim.figures(batch).rejected == 5);
  CHECK(lim.figures(interactive).rejected == 5);
  held.clear();
  // Overload: the limit shrinks to 3. Batch may fill 1, interactive still 3.
  for (int i = 0; i < 40 && lim.limit() > 1; ++i) run_batch(lim, clock, 8, 1s, interactive);
  REQUIRE(lim.limit() == 1);
  CHECK(run_batch(lim, clock, 8, 100ms, batch) == 0);  // floor(0.5 * 1) = 0: batch shed entirely
  CHECK(run_batch(lim, clock, 8, 100ms, interactive) == 1);
}

TEST_CASE("adaptive limit as a policy: refusals, samples by outcome, events", "[adaptive_limit]") {
  manual_clock clock;
  keel::adaptive_limit lim({.name = "llm", .initial_limit = 4, .tolerance = 1.5, .window = 4, .probe_limit = 1,
                            .probe_samples = 1,
                            .classes = {{.name = "interactive"}, {.name = "batch", .share = 0.5}},
                            .default_class = "interactive"});
  struct listener {
    std::vector<std::string>* seen;
    void operator()(const keel::events::adaptive_limit_rejected& e) const {
      seen->push_back("rejected " + std::string(e.work_class) + " " + std::to_string(e.limit));
    }
    void operator()(const keel::events::adaptive_limit_changed& e) const {
      seen->push_back("changed " + std::to_string(e.from) + "->" + std::to_string(e.to) +
                      (e.probing ? " probing" : ""));
    }
  };
  std::vector<std::string> seen;
  auto pipe = keel::pipeline(lim).in(keel::environment{clock}.with_listener(listener{&seen}));
  auto call_with = [&](std::string_view cls, keel::duration took, absl::Status result) {
    keel::call call(clock.now(), {.timeout = 10s, .labels = {.work_class = cls}});
    return pipe.run(call, [&](const keel::attempt&) -> absl::Status {
      clock.advance(took);
      return result;
    });
  };
  REQUIRE(call_with("", 100ms, absl::OkStatus()).ok());  // the probe's one sample, default class
  CHECK(lim.figures().baseline == 100ms);
  CHECK(lim.limit() == 4);
  REQUIRE(seen.size() == 1);
  CHECK(seen[0] == "changed 1->4");
  // Refused further in or cancelled: no sample. Three of those, then a fourth
  // call that is a sample: the window still holds one sample only.
  CHECK(!call_with("batch", 5s, keel::refusal(absl::UnavailableError("breaker"), "breaker:llm")).ok());
  CHECK(!call_with("batch", 5s, absl::CancelledError("gone")).ok());
  CHECK(lim.figures().updates == 1);
  // Throttled and failed ones are samples (dropped ones): a window of four
  // with two throttled at 100 ms shrinks 4 -> 3.
  CHECK(!call_with("interactive", 100ms, absl::ResourceExhaustedError("429")).ok());
  CHECK(!call_with("interactive", 100ms, absl::UnavailableError("503")).ok());
  CHECK(!call_with("interactive", 100ms, absl::InvalidArgumentError("bad")).ok());  // permanent: a plain sample
  CHECK(lim.figures().updates == 1);
  REQUIRE(call_with("interactive", 100ms, absl::OkStatus()).ok());
  CHECK(lim.figures().updates == 2);
  CHECK(lim.limit() == 3);
  CHECK(seen.back() == "changed 4->3");
  // A refusal: not started, refused, names the limiter and class; reported.
  std::vector<keel::adaptive_limit_permit> held;
  held.push_back(lim.try_acquire(0));
  absl::Status r = call_with("batch", 100ms, absl::OkStatus());  // batch may fill floor(1.5) = 1
  CHECK(r.code() == absl::StatusCode::kResourceExhausted);
  CHECK(keel::not_started(r));
  CHECK(keel::default_classifier{}(r, {}) == keel::outcome_kind::refused);
  CHECK(keel::refused_by(r) == "adaptive_limit:llm:batch");
  CHECK(!keel::retry_after(r).has_value());
  CHECK(std::string(r.message()).find("limit 3, of which this class may fill 1") != std::string::npos);
  CHECK(seen.back() == "rejected batch 3");
  // An unknown class: permanent, with the label named.
  absl::Status u = call_with("gold", 100ms, absl::OkStatus());
  CHECK(u.code() == absl::StatusCode::kInvalidArgument);
  CHECK(keel::default_classifier{}(u, {}) == keel::outcome_kind::permanent);
  CHECK(lim.in_flight() == 1);
  held.clear();
  CHECK(lim.in_flight() == 0);
}

namespace {

// The incident on the manual clock. A provider modelled as a queue with
// `capacity` servers: a call that starts with n calls in flight there
// (itself included) takes base * max(1, n / capacity). `clients` callers in
// a closed loop: each sends, waits for the answer and sends again at once;
// a caller the limiter refuses tries again after `think`. Discrete events,
// in time order, on the manual clock: deterministic.
struct phase {
  keel::duration length;
  keel::duration base;
  int capacity;
};

struct phase_figures {
  // Over the second half of the phase (after the limiter had time to react).
  int max_limit = 0;
  int min_limit = 1 << 30;
  keel::duration max_baseline{};
  std::int64_t completed = 0;
  std::int64_t refused = 0;
  keel::duration latency_sum{};
  [[nodiscard]] keel::duration mean_latency() const {
    return completed == 0 ? keel::duration::zero() : latency_sum / completed;
  }
};

std::vector<phase_figures> run_incident(keel::adaptive_limit& lim, const std::vector<phase>& phases,
                                        int clients = 50, keel::duration think = 500ms) {
  manual_clock clock;
  const keel::time_point t0 = clock.now();
  std::vector<keel::time_point> phase_end;
  keel::time_point end = t0;
  for (const phase& p : phases) phase_end.push_back(end += p.length);
  auto phase_of = [&](keel::time_point t) {
    std::size_t i = 0;
    while (i + 1 < phase_end.size() && t >= phase_end[i]) ++i;
    return i;
  };
  auto second_half = [&](keel::time_point t, std::size_t i) { return t >= phase_end[i] - phases[i].length / 2; };

  using event = std::pair<keel::time_point, int>;
  std::priority_queue<event, std::vector<event>, std::greater<>> events;
  std::vector<keel::adaptive_limit_permit> held(clients);
  std::vector<keel::time_point> started(clients);
  std::vector<phase_figures> out(phases.size());
  int at_provider = 0;
  std::int64_t steps = 0;
  for (int c = 0; c < clients; ++c) events.emplace(t0 + std::chrono::milliseconds(c), c);
  while (!events.empty() && events.top().first < end) {
    const auto [t, c] = events.top();
    events.pop();
    clock.set(t);
    const std::size_t ph = phase_of(t);
    phase_figures& f = out[ph];
    const bool counted = second_half(t, ph);
    if (held[c]) {  // an answer
      const keel::duration took = t - started[c];
      held[c].release(took, clock.now(), keel::limit_sample::ok);
      --at_provider;
      if (counted) {
        ++f.completed;
        f.latency_sum += took;
      }
    }
    if (keel::adaptive_limit_permit p = lim.try_acquire(0)) {
      ++at_provider;
      const phase& now_phase = phases[ph];
      const double load = std::max(1.0, static_cast<double>(at_provider) / now_phase.capacity);
      const auto took = std::chrono::duration_cast<keel::duration>(now_phase.base * load);
      held[c] = std::move(p);
      started[c] = t;
      events.emplace(t + took, c);
    } else {
      if (counted) ++f.refused;
      events.emplace(t + think, c);
    }
    if (counted) {
      f.max_limit = std::max(f.max_limit, lim.limit());
      f.min_limit = std::min(f.min_limit, lim.limit());
      if (++steps % 64 == 0) f.max_baseline = std::max(f.max_baseline, lim.figures().baseline);
    }
  }
  return out;
}

keel::adaptive_limit_options incident_options() {
  return {.initial_limit = 20, .min_limit = 1, .max_limit = 500, .tolerance = 1.5, .window = 32,
          .probe_interval = 30s, .jitter_seed = 1, .probe_limit = 2, .probe_samples = 8, .max_drift = 2,
          .drift_horizon = 1h};
}

}  // namespace

TEST_CASE("adaptive limit: a provider that loses capacity for 30 minutes is shed the whole time",
          "[adaptive_limit][incident]") {
  // Normal: 20 servers, 100 ms. The incident: 4 servers for 30 minutes
  // (latency grows with the queue our 50 callers make). Then normal again.
  const std::vector<phase> phases{{10min, 100ms, 20}, {30min, 100ms, 4}, {10min, 100ms, 20}};
  keel::adaptive_limit guarded(incident_options());
  const std::vector<phase_figures> g = run_incident(guarded, phases);
  // Before: near the provider's 20, latency near 100 ms.
  CHECK(g[0].max_limit >= 20);
  CHECK(g[0].mean_latency() < 200ms);
  // During, through its last fifteen minutes: the limit stays near the 4
  // servers (probes re-measure at 2 in flight, below the queue), the
  // baseline stays at the provider's 100 ms, and callers are still shed.
  CHECK(g[1].max_limit <= 12);
  CHECK(g[1].max_baseline <= 110ms);
  CHECK(g[1].mean_latency() < 200ms);
  CHECK(g[1].refused > g[1].completed);
  // After: the limit is back up and latency is back down.
  CHECK(g[2].max_limit >= 20);
  CHECK(g[2].mean_latency() < 200ms);

#ifndef KEEL_PROTECTION_STRESS_OPS  // sanitizer legs: the guarded run only (single-threaded; g++ runs all)
  // Beside it, what re-measuring at low concurrency prevents: probes that
  // keep the limit up (probe_limit = max_limit) and no drift bound measure
  // our own queue as the provider's speed.
  keel::adaptive_limit_options drifting = incident_options();
  drifting.probe_limit = drifting.max_limit;
  drifting.max_drift = std::numeric_limits<double>::infinity();
  keel::adaptive_limit naive(drifting);
  const std::vector<phase_figures> n = run_incident(naive, phases);
  CHECK(n[1].max_baseline > 2 * g[1].max_baseline);
#endif
}

TEST_CASE("adaptive limit: a provider ten times slower for 30 minutes stays shed; after two horizons it is normal",
          "[adaptive_limit][incident]") {
  // The provider is slow at any load (1 s instead of 100 ms): a probe at low
  // concurrency measures 1 s. Bounded drift keeps the baseline at 200 ms, so
  // the limit stays at its floor and the limiter keeps shedding.
  const std::vector<phase> phases{{10min, 100ms, 20}, {30min, 1s, 20}, {10min, 100ms, 20}};
  keel::adaptive_limit guarded(incident_options());
  const std::vector<phase_figures> g = run_incident(guarded, phases);
  CHECK(g[1].max_baseline <= 200ms);
  CHECK(g[1].max_limit <= 2);  // the floor, and probe_limit during probes
  CHECK(g[1].refused > 0);
  CHECK(g[2].max_limit >= 20);
  CHECK(g[2].mean_latency() < 200ms);

#ifndef KEEL_PROTECTION_STRESS_OPS  // sanitizer legs: the guarded run only (single-threaded; g++ runs all)
  // With no bound the baseline follows the probe to 1 s and the limiter
  // stops shedding: the limit climbs to the provider's 20 and beyond.
  keel::adaptive_limit_options unbounded = incident_options();
  unbounded.max_drift = std::numeric_limits<double>::infinity();
  keel::adaptive_limit naive(unbounded);
  const std::vector<phase_figures> n = run_incident(naive, phases);
  CHECK(n[1].max_baseline >= 900ms);
  CHECK(n[1].max_limit >= 20);
  CHECK(n[1].completed > 10 * g[1].completed);

  // A slowness that lasts beyond two drift horizons is the new normal: with
  // a 10-minute horizon the bounded limiter follows it within the incident.
  keel::adaptive_limit_options short_horizon = incident_options();
  short_horizon.drift_horizon = 10min;
  keel::adaptive_limit follows(short_horizon);
  const std::vector<phase_figures> s = run_incident(follows, phases);
  CHECK(s[1].max_baseline >= 900ms);
  CHECK(s[1].max_limit >= 20);
#endif
}

TEST_CASE("adaptive limit: under contention the limit is never exceeded and every permit comes back",
          "[adaptive_limit][contention]") {
  // Rounds of eight threads racing for a limit pinned at 5 (min = max):
  // each takes at most one permit and holds it until all have tried, so
  // every round exactly five win.
  keel::adaptive_limit pinned({.initial_limit = 5, .min_limit = 5, .max_limit = 5, .window = 8,
                               .probe_limit = 5, .probe_samples = 4});
  // And, in the same threads, one whose limit moves with every window and
  // probes every millisecond of (manual) time.
  keel::adaptive_limit moving({.initial_limit = 16, .min_limit = 1, .max_limit = 64, .window = 4,
                               .probe_interval = 1ms, .probe_limit = 2, .probe_samples = 2});
  constexpr int kThreads = 8;
#ifdef KEEL_PROTECTION_STRESS_OPS
  constexpr int kRounds = 300;
#else
  constexpr int kRounds = 2000;
#endif
  manual_clock clock;
  std::barrier tried(kThreads);
  std::barrier released(kThreads);
  std::vector<std::vector<int>> held_per_round(kThreads, std::vector<int>(kRounds, 0));
  std::vector<int> winners(kRounds, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < kRounds; ++round) {
        keel::adaptive_limit_permit p = pinned.try_acquire(0);
        held_per_round[t][round] = p ? 1 : 0;
        if (keel::adaptive_limit_permit q = moving.try_acquire(0)) {
          const auto latency = std::chrono::milliseconds((round + t) % 5 == 0 ? 900 : 100);
          if (round % 3 == 0) {
            q.release();  // no sample
          } else {
            q.release(latency, clock.now() + std::chrono::milliseconds(round), keel::limit_sample::ok);
          }
        }
        tried.arrive_and_wait();
        if (p) p.release(100ms, clock.now(), keel::limit_sample::ok);
        released.arrive_and_wait();
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int round = 0; round < kRounds; ++round)
    for (int t = 0; t < kThreads; ++t) winners[round] += held_per_round[t][round];
  int exact = 0;
  for (int w : winners) exact += w == 5 ? 1 : 0;
  CHECK(exact == kRounds);
  const keel::adaptive_limit_figures p = pinned.figures();
  CHECK(p.in_flight == 0);
  CHECK(p.admitted == 5 * kRounds);
  CHECK(p.rejected == 3 * kRounds);
  const keel::adaptive_limit_figures m = moving.figures();
  CHECK(m.in_flight == 0);
  CHECK(m.admitted + m.rejected == kThreads * kRounds);
  CHECK(m.updates > 100);
  CHECK(m.limit >= 1);
  CHECK(m.limit <= 64);
}

TEST_CASE("adaptive limit: under contention every sample lands in exactly one window, with its latency",
          "[adaptive_limit][contention]") {
  // The in-flight count, the peak and the window share one cache line and
  // admissions are counted per thread: threads that acquire and release
  // at once must still have every admission counted and every sample
  // counted once, its latency with it. The probe ends first, on this
  // thread (an epoch change drops the samples racing it, by design); then
  // four threads against a limit of 4 (never full, never moving) and
  // windows of 16, at a time that never reaches the next probe.
  constexpr int kThreads = 4;
  constexpr int kWindow = 16;
#ifdef KEEL_PROTECTION_STRESS_OPS
  constexpr int kPerThread = 5000;
#else
  constexpr int kPerThread = 100000;
#endif
  keel::adaptive_limit lim({.initial_limit = kThreads, .min_limit = kThreads, .max_limit = kThreads,
                            .window = kWindow, .probe_interval = 24h, .probe_jitter = 0,
                            .probe_limit = kThreads, .probe_samples = 8, .drift_horizon = 24h});
  manual_clock clock;
  finish_probe(lim, clock, 1ms);
  const keel::adaptive_limit_figures before = lim.figures();
  REQUIRE(before.baseline == 1ms);
  const keel::time_point now = clock.now();
  std::barrier start(kThreads);
  std::vector<int> refused(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      start.arrive_and_wait();
      for (int i = 0; i < kPerThread; ++i) {
        keel::adaptive_limit_permit p = lim.try_acquire(0);
        if (!p) {
          ++refused[t];
          continue;
        }
        p.release(1ms, now, keel::limit_sample::ok);
      }
    });
  }
  for (auto& th : threads) th.join();
  int refusals = 0;
  for (int r : refused) refusals += r;
  CHECK(refusals == 0);  // at most kThreads in flight: the limit is never reached
  const keel::adaptive_limit_figures f = lim.figures();
  constexpr std::int64_t samples = std::int64_t{kThreads} * kPerThread;
  CHECK(f.in_flight == 0);
  CHECK(f.admitted - before.admitted == samples);
  CHECK(f.rejected == 0);
  CHECK(f.probes == 1);
  CHECK_FALSE(f.probing);
  CHECK(f.limit == kThreads);
  // Every sample in one window: samples is a multiple of kWindow, so a
  // single lost sample leaves a window short.
  static_assert(samples % kWindow == 0);
  CHECK(f.updates - before.updates == samples / kWindow);
  // A sample counted without its latency, or a latency without its count,
  // would move a window's mean off 1 ms.
  CHECK(f.last_sample == 1ms);
  CHECK(f.baseline == 1ms);
}

TEST_CASE("adaptive limit options: refused at construction with the field and rule named", "[adaptive_limit]") {
  CHECK(message({.name = ""}) == "adaptive_limit_options.name must not be empty (got \"\")");
  CHECK(message({.max_limit = 0}) == "adaptive_limit_options.max_limit must be in [1, 1000000] (got 0)");
  CHECK(message({.min_limit = 2000}) == "adaptive_limit_options.min_limit must be in [1, max_limit] (got 2000)");
  CHECK(message({.initial_limit = 20, .min_limit = 30}) ==
        "adaptive_limit_options.initial_limit must be in [min_limit, max_limit] (got 20)");
  CHECK(message({.tolerance = 0.9}) == "adaptive_limit_options.tolerance must be in [1, 100] (got 0.9)");
  CHECK(message({.window = 3}) == "adaptive_limit_options.window must be in [4, 255] (got 3)");
  CHECK(message({.probe_interval = 0s}) == "adaptive_limit_options.probe_interval must be in [1ms, 24h] (got 0s)");
  CHECK(message({.probe_jitter = 1.5}) == "adaptive_limit_options.probe_jitter must be in [0, 1] (got 1.5)");
  CHECK(message({.probe_limit = 0}) == "adaptive_limit_options.probe_limit must be in [1, 1000000] (got 0)");
  CHECK(message({.initial_limit = 2, .max_limit = 2}).empty());  // probe_limit 4 is then 2
  CHECK(message({.probe_samples = 256}) == "adaptive_limit_options.probe_samples must be in [1, 255] (got 256)");
  CHECK(message({.max_drift = 0.5}) == "adaptive_limit_options.max_drift must be >= 1 (got 0.5)");
  CHECK(message({.probe_interval = 2min, .drift_horizon = 1min}) ==
        "adaptive_limit_options.drift_horizon must be >= probe_interval (got 60s)");
  CHECK(message({.classes = {{.name = "a", .share = 0.5}}}) ==
        "adaptive_limit_options.classes must give at least one class share 1 (got 1)");
  CHECK(message({.classes = {{.name = "a"}, {.name = "b", .share = 0}}}) ==
        "adaptive_limit_options.classes[1].share must be in (0, 1] (got 0)");
  CHECK(message({.classes = {{.name = "a"}, {.name = "a"}}}) ==
        "adaptive_limit_options.classes[1].name must be unique (got a)");
  CHECK(message({.classes = {{.name = "a"}}, .default_class = "b"}) ==
        "adaptive_limit_options.default_class must name a class (got b)");
  CHECK(message({}).empty());
  CHECK(message({.max_drift = std::numeric_limits<double>::infinity()}).empty());
  CHECK_THROWS_AS(keel::adaptive_limit({.window = 1}), keel::invalid_options);
}
