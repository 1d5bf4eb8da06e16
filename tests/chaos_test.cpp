// keel::chaos_fault, chaos_latency and chaos_outcome: off by default and
// untouched when off, rates that hold with a seed and reproduce, labels that
// select, an injected fault classified as its status says (retry retries a
// transient one, not a permanent one), latency slept on the manual clock and
// cut by the deadline and the stop token, outcomes, events and metrics,
// run-time switching under contention, and options refused with the field
// named.
#include "keel/policy/chaos.hpp"

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

#include "keel/compose/pipeline.hpp"
#include "keel/core/call.hpp"
#include "keel/observe/metrics.hpp"
#include "keel/observe/prometheus.hpp"
#include "keel/observe/telemetry_metrics.hpp"
#include "keel/policy/retry.hpp"
#include "keel/testing/manual_clock.hpp"
#include "support/alloc_counter.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;
using keel::testing::manual_clock;

namespace {

std::string message(const absl::Status& s) { return std::string(s.message()); }

// Runs `n` calls with `labels` through `pipe`; returns how many came back
// with a fault injected by a chaos stage, and records the hit pattern.
template <class Pipe>
int run_calls(const Pipe& pipe, manual_clock& clock, int n, keel::labels labels = {},
              std::vector<bool>* pattern = nullptr, int* provider_calls = nullptr) {
  int hits = 0;
  for (int i = 0; i < n; ++i) {
    keel::call call(clock.now(), {.timeout = 10s, .labels = labels});
    const absl::Status s = pipe.run(call, [&](const keel::attempt&) -> absl::Status {
      if (provider_calls != nullptr) ++*provider_calls;
      return absl::OkStatus();
    });
    const bool hit = keel::chaos_injected(s).has_value();
    if (hit) ++hits;
    if (pattern != nullptr) pattern->push_back(hit);
  }
  return hits;
}

struct event_log {
  std::vector<std::string>* stages;
  std::vector<keel::chaos_kind>* kinds;
  std::vector<keel::duration>* delays;
  void operator()(const keel::events::chaos_injected& e) const {
    stages->emplace_back(e.stage);
    kinds->push_back(e.kind);
    delays->push_back(e.delay);
  }
};

}  // namespace

TEST_CASE("chaos: options are validated with the field and the rule named", "[chaos]") {
  CHECK(keel::chaos_fault_options{}.validate().ok());
  CHECK(keel::chaos_latency_options{}.validate().ok());
  CHECK(keel::chaos_outcome_options<int>{}.validate().ok());

  const absl::Status high = keel::chaos_fault_options{.rate = 1.5}.validate();
  CHECK(high.code() == absl::StatusCode::kInvalidArgument);
  CHECK(message(high) == "chaos_fault_options.rate must be in [0, 1] (got 1.5)");
  CHECK(message(keel::chaos_fault_options{.rate = -0.1}.validate()) ==
        "chaos_fault_options.rate must be in [0, 1] (got -0.1)");
  CHECK(message(keel::chaos_fault_options{.rate = std::numeric_limits<double>::quiet_NaN()}.validate())
            .starts_with("chaos_fault_options.rate must be in [0, 1]"));
  CHECK(message(keel::chaos_fault_options{.name = ""}.validate()) == "chaos_fault_options.name must not be empty (got \"\")");
  CHECK(message(keel::chaos_fault_options{.fault = absl::OkStatus()}.validate())
            .starts_with("chaos_fault_options.fault must not be OK"));
  CHECK(message(keel::chaos_latency_options{.delay = -1ms}.validate()) ==
        "chaos_latency_options.delay must be in [0s, 24h] (got -1ms)");
  CHECK(message(keel::chaos_latency_options{.delay = 25h}.validate()) ==
        "chaos_latency_options.delay must be in [0s, 24h] (got 90000s)");
  CHECK(message(keel::chaos_outcome_options<int>{.rate = 2}.validate()) ==
        "chaos_outcome_options.rate must be in [0, 1] (got 2)");

  CHECK_THROWS_AS(keel::chaos_fault({.rate = 7}), keel::invalid_options);
  CHECK_THROWS_AS(keel::chaos_latency({.delay = -1s}), keel::invalid_options);
  CHECK_THROWS_AS(keel::chaos_outcome<int>({.name = ""}), keel::invalid_options);

  // At run time: refused with the field named, and the setting kept.
  keel::chaos_latency slow({.rate = 0.25, .delay = 10ms});
  CHECK(message(slow.set_rate(1.01)) == "chaos_latency.rate must be in [0, 1] (got 1.01)");
  CHECK(slow.rate() == 0.25);
  CHECK(message(slow.set_delay(-5ms)) == "chaos_latency.delay must be in [0s, 24h] (got -5ms)");
  CHECK(slow.delay() == 10ms);
  CHECK(slow.set_rate(1.0).ok());
  CHECK(slow.set_delay(20ms).ok());
  CHECK(slow.rate() == 1.0);
  CHECK(slow.delay() == 20ms);
}

TEST_CASE("chaos: off by default; off, every call goes through untouched and nothing is evaluated", "[chaos]") {
  manual_clock clock;
  keel::chaos_fault fault({.rate = 1.0});
  keel::chaos_latency slow({.rate = 1.0, .delay = 1h});
  keel::chaos_outcome<std::string> fake({.rate = 1.0, .outcome = "canned"});
  CHECK_FALSE(fault.enabled());
  CHECK_FALSE(slow.enabled());
  CHECK_FALSE(fake.enabled());
  auto pipe = keel::pipeline(fault, slow, fake).in(keel::environment{clock});
  int calls = 0;
  for (int i = 0; i < 100; ++i) {
    keel::call call(clock.now(), {.timeout = 1s});
    absl::StatusOr<std::string> r = pipe.run(call, [&](const keel::attempt& a) -> absl::StatusOr<std::string> {
      ++calls;
      CHECK(a.start == clock.now());
      return std::string("real");
    });
    REQUIRE(r.ok());
    CHECK(*r == "real");
    CHECK(call.record().attempts == 1);
  }
  CHECK(calls == 100);
  CHECK(clock.now() == manual_clock().now());  // no time passed: nothing slept
  CHECK(fault.figures().evaluated == 0);
  CHECK(slow.figures().evaluated == 0);
  CHECK(fake.figures().evaluated == 0);

  // Enabled, then disabled again: untouched once more.
  fault.enable();
  keel::call hit(clock.now(), {.timeout = 1s});
  CHECK(pipe.run(hit, [](const keel::attempt&) -> absl::StatusOr<std::string> { return std::string("real"); })
            .status()
            .code() == absl::StatusCode::kUnavailable);
  fault.disable();
  keel::call untouched(clock.now(), {.timeout = 1s});
  CHECK(*pipe.run(untouched, [](const keel::attempt&) -> absl::StatusOr<std::string> { return std::string("real"); }) ==
        "real");
  CHECK(fault.figures().evaluated == 1);
  CHECK(fault.figures().injected == 1);
}

TEST_CASE("chaos: off, and injecting a fault, cost no allocation", "[chaos][alloc]") {
  if (!keel_test::allocations_counted()) {
    WARN("allocation counting is off in sanitizer builds; the g++ build asserts it");
    return;
  }
  keel::chaos_fault fault({.rate = 1.0});
  keel::chaos_latency slow({.rate = 1.0});
  keel::real_clock clock;
  auto pipe = keel::pipeline(fault, slow);
  const keel::time_point now = clock.now();
  keel_test::count_allocations allocs;
  for (int i = 0; i < 100; ++i) {
    keel::call call(now, {.timeout = 1h});
    absl::StatusOr<int> r = pipe.run(call, [](const keel::attempt&) -> absl::StatusOr<int> { return 1; });
    REQUIRE(r.ok());
  }
  CHECK(allocs.count() == 0);
  fault.enable();
  keel_test::count_allocations on;
  for (int i = 0; i < 100; ++i) {
    keel::call call(now, {.timeout = 1h});
    absl::StatusOr<int> r = pipe.run(call, [](const keel::attempt&) -> absl::StatusOr<int> { return 1; });
    REQUIRE(r.status().code() == absl::StatusCode::kUnavailable);
  }
  CHECK(on.count() == 0);
}

TEST_CASE("chaos: the rate holds, and the same seed hits the same calls", "[chaos]") {
  manual_clock clock;
  auto pattern_of = [&](std::uint64_t seed, double rate, int n, int* hits) {
    keel::chaos_fault fault({.enabled = true, .rate = rate, .seed = seed});
    auto pipe = keel::pipeline(fault).in(keel::environment{clock});
    std::vector<bool> pattern;
    *hits = run_calls(pipe, clock, n, {}, &pattern);
    CHECK(fault.figures().evaluated == n);
    CHECK(fault.figures().injected == *hits);
    return pattern;
  };
  int hits = 0;
  int again = 0;
  int other = 0;
  const std::vector<bool> a = pattern_of(7, 0.3, 10'000, &hits);
  const std::vector<bool> b = pattern_of(7, 0.3, 10'000, &again);
  const std::vector<bool> c = pattern_of(8, 0.3, 10'000, &other);
  CHECK(a == b);  // the drill reproduces
  CHECK(hits == again);
  CHECK(a != c);  // another seed, other calls
  // Binomial(10000, 0.3): sd 46; +-200 is over 4 sd. The draws are
  // deterministic, so this cannot flake; it checks the mapping to a rate.
  CHECK(std::abs(hits - 3000) < 200);
  CHECK(std::abs(other - 3000) < 200);
  int low = 0;
  (void)pattern_of(3, 0.01, 20'000, &low);  // sd 14
  CHECK(std::abs(low - 200) < 60);

  int none = 0;
  int all = 0;
  (void)pattern_of(1, 0.0, 2000, &none);
  (void)pattern_of(1, 1.0, 2000, &all);
  CHECK(none == 0);
  CHECK(all == 2000);
}

TEST_CASE("chaos: labels select the calls; others are not even evaluated", "[chaos]") {
  manual_clock clock;
  keel::chaos_fault fault({.enabled = true, .rate = 1.0, .when = {.tenant = "acme", .model = "m-large"}});
  auto pipe = keel::pipeline(fault).in(keel::environment{clock});
  int provider_calls = 0;
  CHECK(run_calls(pipe, clock, 10, {.tenant = "acme", .model = "m-large"}, nullptr, &provider_calls) == 10);
  CHECK(provider_calls == 0);
  CHECK(run_calls(pipe, clock, 10, {.tenant = "acme", .model = "m-small"}, nullptr, &provider_calls) == 0);
  CHECK(run_calls(pipe, clock, 10, {.tenant = "globex", .model = "m-large"}, nullptr, &provider_calls) == 0);
  CHECK(run_calls(pipe, clock, 10, {.model = "m-large"}, nullptr, &provider_calls) == 0);
  CHECK(provider_calls == 30);
  CHECK(run_calls(pipe, clock, 10,
                  {.tenant = "acme", .model = "m-large", .region = "eu", .work_class = "batch"}) == 10);
  CHECK(fault.figures().evaluated == 20);

  keel::chaos_latency batch_only({.enabled = true, .rate = 1.0, .delay = 1s, .when = {.work_class = "batch"}});
  auto slow = keel::pipeline(batch_only).in(keel::environment{clock});
  keel::call interactive(clock.now(), {.timeout = 10s, .labels = {.work_class = "interactive"}});
  CHECK(slow.run(interactive, [](const keel::attempt&) { return absl::OkStatus(); }).ok());
  CHECK(batch_only.figures().evaluated == 0);
}

TEST_CASE("chaos: an injected fault is classified as its status says; retry retries a transient one only",
          "[chaos]") {
  manual_clock clock;
  clock.auto_advance(true);  // retry's backoff jumps the clock

  SECTION("unavailable: transient, retried to the layer's limit") {
    keel::chaos_fault fault({.enabled = true, .rate = 1.0, .fault = absl::UnavailableError("drill: provider down")});
    auto pipe = keel::pipeline(keel::retry({.max_attempts = 3}), fault).in(keel::environment{clock});
    keel::call call(clock.now(), {.timeout = 1h});
    int provider_calls = 0;
    const absl::Status s = pipe.run(call, [&](const keel::attempt&) {
      ++provider_calls;
      return absl::OkStatus();
    });
    CHECK(s.code() == absl::StatusCode::kUnavailable);
    CHECK(message(s) == "drill: provider down");
    CHECK(keel::chaos_injected(s) == "fault");
    CHECK(keel::default_classifier{}(s, {}) == keel::outcome_kind::transient);
    CHECK(fault.figures().injected == 3);
    CHECK(call.record().retries == 2);
    CHECK(call.record().attempts == 0);  // the provider was never invoked
    CHECK(provider_calls == 0);
  }
  SECTION("a transient fault at a rate: retry recovers") {
    keel::chaos_fault fault({.enabled = true, .rate = 0.5, .seed = 11});
    auto pipe = keel::pipeline(keel::retry({.max_attempts = 10}), fault).in(keel::environment{clock});
    int recovered_after_retry = 0;
    for (int i = 0; i < 50; ++i) {
      keel::call call(clock.now(), {.timeout = 1h, .max_attempts = 10});
      const absl::Status s = pipe.run(call, [](const keel::attempt&) { return absl::OkStatus(); });
      REQUIRE(s.ok());  // 10 faults in a row at 0.5: 1 in 1024 per call; the seed has none
      CHECK(call.record().attempts == 1);
      if (call.record().retries > 0) ++recovered_after_retry;
    }
    CHECK(recovered_after_retry > 10);
  }
  SECTION("invalid argument: permanent, not retried") {
    keel::chaos_fault fault({.enabled = true, .rate = 1.0, .fault = absl::InvalidArgumentError("drill: bad key")});
    auto pipe = keel::pipeline(keel::retry({.max_attempts = 3}), fault).in(keel::environment{clock});
    keel::call call(clock.now(), {.timeout = 1h});
    const absl::Status s = pipe.run(call, [](const keel::attempt&) { return absl::OkStatus(); });
    CHECK(s.code() == absl::StatusCode::kInvalidArgument);
    CHECK(keel::default_classifier{}(s, {}) == keel::outcome_kind::permanent);
    CHECK(fault.figures().injected == 1);
    CHECK(call.record().retries == 0);
  }
  SECTION("a timeout on a write: ambiguous, not retried; marked not started: transient, retried") {
    const keel::operation write{.effect = keel::effect::write};
    keel::chaos_fault after_send({.enabled = true, .rate = 1.0, .fault = absl::DeadlineExceededError("drill")});
    auto pipe = keel::pipeline(keel::retry({.max_attempts = 3}), after_send).in(keel::environment{clock});
    keel::call call(clock.now(), {.timeout = 1h, .operation = write});
    CHECK(pipe.run(call, [](const keel::attempt&) { return absl::OkStatus(); }).code() ==
          absl::StatusCode::kDeadlineExceeded);
    CHECK(call.record().retries == 0);

    keel::chaos_fault before_send(
        {.enabled = true, .rate = 1.0, .fault = keel::mark_not_started(absl::DeadlineExceededError("drill"))});
    auto pipe2 = keel::pipeline(keel::retry({.max_attempts = 3}), before_send).in(keel::environment{clock});
    keel::call call2(clock.now(), {.timeout = 1h, .operation = write});
    const absl::Status s = pipe2.run(call2, [](const keel::attempt&) { return absl::OkStatus(); });
    CHECK(keel::not_started(s));
    CHECK(call2.record().retries == 2);
  }
}

TEST_CASE("chaos: latency waits on the manual clock, then the attempt starts at the later time", "[chaos]") {
  manual_clock clock;
  keel::chaos_latency slow({.enabled = true, .rate = 1.0, .delay = 500ms});
  auto pipe = keel::pipeline(slow).in(keel::environment{clock});
  const keel::time_point start = clock.now();
  std::atomic<int> provider_calls{0};
  keel::time_point attempt_start{};
  absl::Status result = absl::UnknownError("not run");
  std::thread worker([&] {
    keel::call call(start, {.timeout = 10s});
    result = pipe.run(call, start, [&](const keel::attempt& a) {
      attempt_start = a.start;
      provider_calls.fetch_add(1);
      return absl::OkStatus();
    });
  });
  clock.await_sleepers(1);
  clock.advance(499ms);
  clock.await_sleepers(1);  // still waiting: 1 ms short
  CHECK(provider_calls.load() == 0);
  clock.advance(1ms);
  worker.join();
  CHECK(result.ok());
  CHECK(provider_calls.load() == 1);
  CHECK(attempt_start == start + 500ms);
  CHECK(slow.figures().injected == 1);

  // Tuned at run time: a shorter delay.
  REQUIRE(slow.set_delay(100ms).ok());
  std::thread again([&] {
    keel::call call(clock.now(), {.timeout = 10s});
    result = pipe.run(call, [](const keel::attempt&) { return absl::OkStatus(); });
  });
  clock.await_sleepers(1);
  clock.advance(100ms);
  again.join();
  CHECK(result.ok());

  // A zero delay goes straight through.
  REQUIRE(slow.set_delay(0ms).ok());
  keel::call call(clock.now(), {.timeout = 10s});
  CHECK(pipe.run(call, [](const keel::attempt&) { return absl::OkStatus(); }).ok());
}

TEST_CASE("chaos: the caller's deadline and stop token cut injected latency", "[chaos]") {
  manual_clock clock;
  keel::chaos_latency slow({.enabled = true, .rate = 1.0, .delay = 5s});
  auto pipe = keel::pipeline(slow).in(keel::environment{clock});
  std::atomic<int> provider_calls{0};
  auto provider = [&](const keel::attempt&) {
    provider_calls.fetch_add(1);
    return absl::OkStatus();
  };

  SECTION("the deadline: DeadlineExceeded, not started, transient even for a write") {
    const keel::time_point start = clock.now();
    absl::Status result;
    std::thread worker([&] {
      keel::call call(start, {.timeout = 200ms, .operation = {.effect = keel::effect::write}});
      result = pipe.run(call, start, provider);
    });
    clock.await_sleepers(1);
    clock.advance(200ms);
    worker.join();
    CHECK(result.code() == absl::StatusCode::kDeadlineExceeded);
    CHECK(keel::not_started(result));
    CHECK(keel::default_classifier{}(result, {.effect = keel::effect::write}) == keel::outcome_kind::transient);
    CHECK(clock.now() == start + 200ms);
  }
  SECTION("the stop token: Cancelled, not started") {
    std::stop_source stop;
    absl::Status result;
    std::thread worker([&] {
      keel::call call(clock.now(), {.timeout = 10s, .stop = stop.get_token()});
      result = pipe.run(call, provider);
    });
    clock.await_sleepers(1);
    stop.request_stop();
    worker.join();
    CHECK(result.code() == absl::StatusCode::kCancelled);
    CHECK(keel::not_started(result));
    CHECK(keel::default_classifier{}(result, {}) == keel::outcome_kind::cancelled);
  }
  CHECK(provider_calls.load() == 0);
}

TEST_CASE("chaos: an outcome replaces the provider's answer with the chosen one", "[chaos]") {
  manual_clock clock;
  keel::chaos_outcome<std::string> fake({.enabled = true, .rate = 1.0, .outcome = "canned answer"});
  auto pipe = keel::pipeline(fake).in(keel::environment{clock});
  int provider_calls = 0;
  keel::call call(clock.now(), {.timeout = 1s});
  absl::StatusOr<std::string> r = pipe.run(call, [&](const keel::attempt&) -> absl::StatusOr<std::string> {
    ++provider_calls;
    return std::string("real");
  });
  REQUIRE(r.ok());
  CHECK(*r == "canned answer");
  CHECK(provider_calls == 0);

  // On a pipeline of absl::Status: a status, OK by default.
  keel::chaos_outcome<absl::Status> done({.enabled = true, .rate = 1.0});
  auto status_pipe = keel::pipeline(done).in(keel::environment{clock});
  keel::call call2(clock.now(), {.timeout = 1s});
  CHECK(status_pipe.run(call2, [](const keel::attempt&) { return absl::InternalError("real failure"); }).ok());
  CHECK(done.figures().injected == 1);
  CHECK(done.figures().kind == keel::chaos_kind::outcome);
}

TEST_CASE("chaos: each injection is reported to the listener and counted by metrics_listener", "[chaos]") {
  manual_clock clock;
  std::vector<std::string> stages;
  std::vector<keel::chaos_kind> kinds;
  std::vector<keel::duration> delays;
  keel::metrics_registry registry;
  keel::metrics_listener metrics(registry);
  keel::chaos_fault fault({.name = "outage", .enabled = true, .rate = 0.5, .seed = 3});
  keel::chaos_latency slow({.name = "slow", .enabled = true, .rate = 1.0, .delay = 0ms});
  auto logged = keel::pipeline(slow, fault).in(keel::environment{clock}.with_listener(event_log{&stages, &kinds, &delays}));
  auto counted = keel::pipeline(slow, fault).in(keel::environment{clock}.with_listener(metrics));
  const int hits = run_calls(logged, clock, 40);
  REQUIRE(hits > 0);
  REQUIRE(hits < 40);
  REQUIRE(stages.size() == static_cast<std::size_t>(40 + hits));
  int fault_events = 0;
  for (std::size_t i = 0; i < stages.size(); ++i) {
    if (kinds[i] == keel::chaos_kind::fault) {
      ++fault_events;
      CHECK(stages[i] == "outage");
    } else {
      CHECK(stages[i] == "slow");
      CHECK(kinds[i] == keel::chaos_kind::latency);
      CHECK(delays[i] == 0ms);
    }
  }
  CHECK(fault_events == hits);

  const int counted_hits = run_calls(counted, clock, 40);
  const std::string text = *keel::to_prometheus_text(registry.snapshot());
  CHECK(text.find("keel_chaos_injections_total{stage=\"outage\",kind=\"fault\"} " + std::to_string(counted_hits) +
                  "\n") != std::string::npos);
  CHECK(text.find("keel_chaos_injections_total{stage=\"slow\",kind=\"latency\"} 40\n") != std::string::npos);
}

TEST_CASE("chaos: enabled, tuned and disabled at run time while calls run on other threads", "[chaos]") {
  keel::real_clock clock;
  keel::chaos_fault fault({.name = "toggled", .rate = 1.0});
  keel::chaos_latency slow({.name = "zero", .rate = 1.0, .delay = 0ms});
  keel::chaos_outcome<int> fake({.name = "fake", .rate = 0.0, .outcome = -1});
  auto pipe = keel::pipeline(fault, slow, fake);
  constexpr int kWorkers = 4;
  std::atomic<bool> done{false};
  std::atomic<std::int64_t> calls{0};
  std::vector<std::int64_t> faults(kWorkers, 0);
  std::vector<std::int64_t> fakes(kWorkers, 0);
  std::vector<std::int64_t> real(kWorkers, 0);
  std::vector<std::int64_t> other(kWorkers, 0);
  std::vector<std::thread> workers;
  for (int w = 0; w < kWorkers; ++w) {
    workers.emplace_back([&, w] {
      while (!done.load(std::memory_order_acquire)) {
        keel::call call(clock.now(), {.timeout = 1h});
        const absl::StatusOr<int> r = pipe.run(call, [](const keel::attempt&) -> absl::StatusOr<int> { return 1; });
        if (!r.ok() && keel::chaos_injected(r.status()) == "toggled") {
          ++faults[w];
        } else if (r.ok() && *r == -1) {
          ++fakes[w];
        } else if (r.ok() && *r == 1) {
          ++real[w];
        } else {
          ++other[w];
        }
        calls.fetch_add(1, std::memory_order_relaxed);
      }
    });
  }
  // Each phase lasts until the workers have made 200 more calls, so every
  // setting is seen by calls that started after it.
  auto phase = [&] {
    const std::int64_t until = calls.load() + 200;
    while (calls.load() < until) std::this_thread::yield();
  };
  for (int round = 0; round < 10; ++round) {
    fault.enable();
    slow.enable();
    phase();
    REQUIRE(fault.set_rate(round % 2 == 0 ? 1.0 : 0.5).ok());
    REQUIRE(slow.set_delay(0ms).ok());
    phase();
    fault.disable();
    fake.enable();
    REQUIRE(fake.set_rate(0.5).ok());
    phase();
    fake.disable();
    slow.disable();
    phase();
  }
  done.store(true, std::memory_order_release);
  for (auto& t : workers) t.join();

  std::int64_t total_faults = 0, total_fakes = 0, total_real = 0, total_other = 0;
  for (int w = 0; w < kWorkers; ++w) {
    total_faults += faults[w];
    total_fakes += fakes[w];
    total_real += real[w];
    total_other += other[w];
  }
  CHECK(total_other == 0);
  CHECK(total_faults + total_fakes + total_real == calls.load());
  CHECK(total_faults == fault.figures().injected);
  CHECK(total_fakes == fake.figures().injected);
  CHECK(total_faults > 0);
  CHECK(total_fakes > 0);
  CHECK(total_real > 0);
  // Off again: untouched.
  keel::call call(clock.now(), {.timeout = 1h});
  CHECK(*pipe.run(call, [](const keel::attempt&) -> absl::StatusOr<int> { return 1; }) == 1);
}
