// keel::metrics_listener: keel's events counted as metrics — retries, their
// waits and why retry layers stopped — through real pipelines on the manual
// clock, under contention, without allocating, and rendered for Prometheus.
#include "keel/telemetry_metrics.hpp"

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "keel/backoff.hpp"
#include "keel/call.hpp"
#include "keel/metrics.hpp"
#include "keel/pipeline.hpp"
#include "keel/prometheus.hpp"
#include "keel/retry.hpp"
#include "keel/retry_budget.hpp"
#include "keel/testing/manual_clock.hpp"
#include "keel/testing/scripted_provider.hpp"
#include "support/alloc_counter.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;
using keel::testing::manual_clock;
using keel::testing::scripted_provider;
namespace kt = keel::testing;

namespace {

double counter(const keel::metrics_snapshot& s, std::string_view family, std::string_view label) {
  for (const auto& f : s.families) {
    if (f.name != family) continue;
    for (const auto& series : f.series)
      if (series.labels.size() == 1 && series.labels[0] == label) return series.value;
  }
  return -1;
}

const keel::metric_series* histogram(const keel::metrics_snapshot& s, std::string_view family) {
  for (const auto& f : s.families)
    if (f.name == family && f.series.size() == 1) return &f.series[0];
  return nullptr;
}

bool contains(const std::string& haystack, std::string_view needle) {
  return haystack.find(needle) != std::string::npos;
}

}  // namespace

TEST_CASE("retries, their waits and every reason to stop are counted", "[telemetry][metrics]") {
  manual_clock clock;
  clock.auto_advance(true);
  keel::metrics_registry registry;
  const keel::metrics_listener listener(registry);
  auto pipe = keel::pipeline(keel::retry({.max_attempts = 3, .max_retry_after = 30s},
                                         keel::constant_backoff{.delay_each = 40ms}))
                  .on(clock)
                  .observe(listener);
  keel::retry_budget empty_budget({.ratio = 0.0, .min_per_second = 0.0});
  auto budgeted = keel::pipeline(keel::retry({.max_attempts = 3, .budget = &empty_budget},
                                             keel::constant_backoff{.delay_each = 40ms}))
                      .on(clock)
                      .observe(listener);

  int retries_seen = 0;
  auto run = [&](auto& p, std::vector<keel::testing::step<int>> script) {
    scripted_provider<int> provider(clock, std::move(script));
    keel::call call(clock.now(), {.timeout = 1h});
    const absl::StatusOr<int> r = p.run(call, provider);
    retries_seen += call.record().retries;
    return r.status();
  };
  // Two plain retries, then an answer.
  CHECK(run(pipe, {kt::unavailable(5ms), kt::unavailable(5ms), kt::answer(1, 5ms)}).ok());
  // One retry after the provider's 2 s hint.
  CHECK(run(pipe, {kt::rate_limited(2s), kt::answer(1)}).ok());
  // Never retried.
  CHECK(run(pipe, {kt::bad_credential()}).code() == absl::StatusCode::kUnauthenticated);
  // Out of attempts after two retries.
  CHECK(run(pipe, {kt::unavailable()}).code() == absl::StatusCode::kUnavailable);
  // A hint longer than max_retry_after.
  CHECK(run(pipe, {kt::rate_limited(2min)}).code() == absl::StatusCode::kResourceExhausted);
  // The budget refuses.
  CHECK(run(budgeted, {kt::unavailable(), kt::answer(1)}).code() == absl::StatusCode::kUnavailable);

  const keel::metrics_snapshot s = registry.snapshot();
  CHECK(counter(s, "keel_retries_total", "false") == 4);
  CHECK(counter(s, "keel_retries_total", "true") == 1);
  CHECK(counter(s, "keel_retries_total", "false") + counter(s, "keel_retries_total", "true") == retries_seen);
  CHECK(counter(s, "keel_retry_stops_total", "not_retryable") == 1);
  CHECK(counter(s, "keel_retry_stops_total", "layer_attempts") == 1);
  CHECK(counter(s, "keel_retry_stops_total", "hint_too_long") == 1);
  CHECK(counter(s, "keel_retry_stops_total", "budget") == 1);
  CHECK(counter(s, "keel_retry_stops_total", "deadline") == 0);
  CHECK(counter(s, "keel_retry_stops_total", "cancelled") == 0);
  CHECK(counter(s, "keel_retry_stops_total", "call_attempts") == 0);
  const keel::metric_series* waits = histogram(s, "keel_retry_wait_seconds");
  REQUIRE(waits != nullptr);
  CHECK(waits->count == 5);
  CHECK(waits->sum == Approx(4 * 0.04 + 2.0));

  const std::string text = *keel::to_prometheus_text(s);
  CHECK(contains(text, "# TYPE keel_retries_total counter\n"
                       "keel_retries_total{hinted=\"false\"} 4\n"
                       "keel_retries_total{hinted=\"true\"} 1\n"));
  CHECK(contains(text, "keel_retry_stops_total{reason=\"budget\"} 1\n"));
  CHECK(contains(text, "keel_retry_wait_seconds_bucket{le=\"0.05\"} 4\n"));
  CHECK(contains(text, "keel_retry_wait_seconds_bucket{le=\"2.5\"} 5\n"));
  CHECK(contains(text, "keel_retry_wait_seconds_count 5\n"));
}

TEST_CASE("deadline and cancellation stops are counted", "[telemetry][metrics]") {
  manual_clock clock;
  keel::metrics_registry registry;
  const keel::metrics_listener listener(registry);

  SECTION("deadline") {
    clock.auto_advance(true);
    auto pipe = keel::pipeline(keel::retry({.max_attempts = 3}, keel::constant_backoff{.delay_each = 2s}))
                    .on(clock)
                    .observe(listener);
    scripted_provider<int> provider(clock, {kt::unavailable(10ms)});
    keel::call call(clock.now(), {.timeout = 1s});
    CHECK_FALSE(pipe.run(call, provider).ok());
    CHECK(counter(registry.snapshot(), "keel_retry_stops_total", "deadline") == 1);
  }
  SECTION("cancelled while waiting") {
    auto pipe = keel::pipeline(keel::retry({.max_attempts = 3}, keel::constant_backoff{.delay_each = 10s}))
                    .on(clock)
                    .observe(listener);
    std::stop_source stop;
    absl::Status got;
    std::thread worker([&] {
      keel::call call(clock.now(), {.timeout = 1h, .stop = stop.get_token()});
      got = pipe.run(call, [](const keel::attempt&) -> absl::StatusOr<int> {
                  return absl::UnavailableError("down");
                }).status();
    });
    clock.await_sleepers(1);
    stop.request_stop();
    worker.join();
    CHECK(got.code() == absl::StatusCode::kUnavailable);
    const auto s = registry.snapshot();
    CHECK(counter(s, "keel_retry_stops_total", "cancelled") == 1);
    CHECK(counter(s, "keel_retries_total", "false") == 1);  // scheduled, then cancelled during the wait
  }
}

TEST_CASE("counts stay exact with many threads running pipelines", "[telemetry][concurrency]") {
  keel::metrics_registry registry;
  const keel::metrics_listener listener(registry);
  auto pipe = keel::pipeline(keel::retry({.max_attempts = 3}, keel::constant_backoff{.delay_each = 0s}))
                  .observe(listener);
  constexpr int kThreads = 4, kCalls = 500;
  std::vector<int> failures(kThreads, 0);
  std::vector<std::thread> workers;
  for (int t = 0; t < kThreads; ++t) {
    workers.emplace_back([&, t] {
      for (int i = 0; i < kCalls; ++i) {
        keel::call call(keel::real_clock{}.now(), {.timeout = 10s});
        // The first attempt of every call fails; every fourth call is refused for good.
        const auto r = pipe.run(call, [i](const keel::attempt& a) -> absl::StatusOr<int> {
          if (i % 4 == 0) return absl::PermissionDeniedError("no");
          if (a.number == 1) return absl::UnavailableError("blip");
          return a.number;
        });
        if (!r.ok()) ++failures[t];
      }
    });
  }
  for (auto& w : workers) w.join();
  const auto s = registry.snapshot();
  CHECK(counter(s, "keel_retries_total", "false") == kThreads * kCalls * 3 / 4);
  CHECK(counter(s, "keel_retry_stops_total", "not_retryable") == kThreads * kCalls / 4);
  for (int f : failures) CHECK(f == kCalls / 4);
  CHECK(histogram(s, "keel_retry_wait_seconds")->buckets[0] == kThreads * kCalls * 3 / 4);
}

TEST_CASE("handling an event allocates nothing", "[telemetry][alloc]") {
  if (!keel_test::allocations_counted()) {
    WARN("allocation counting is off in sanitizer builds; the g++ build asserts it");
    return;
  }
  keel::metrics_registry registry;
  const keel::metrics_listener listener(registry);
  keel::call call(keel::real_clock{}.now(), {.timeout = 1s});
  const absl::Status cause = absl::UnavailableError("down");
  const keel::events::retry_scheduled scheduled{call, 1, 25ms, false, cause};
  const keel::events::retry_stopped stopped{call, keel::events::retry_stopped::reason::budget, cause};
  keel_test::count_allocations allocations;
  for (int i = 0; i < 1000; ++i) {
    keel::observe(listener, scheduled);
    keel::observe(listener, stopped);
  }
  CHECK(allocations.count() == 0);
  const auto s = registry.snapshot();
  CHECK(counter(s, "keel_retries_total", "false") == 1000);
  CHECK(counter(s, "keel_retry_stops_total", "budget") == 1000);
}

TEST_CASE("listener options: prefix and buckets are checked, clashes refused", "[telemetry][options]") {
  keel::metrics_registry registry;
  const keel::metrics_listener a(registry, {.prefix = "svc_"});
  const keel::metrics_listener b(registry, {.prefix = "svc_"});  // same families: shared
  const keel::metrics_listener bare(registry, {.prefix = ""});
  keel::call call(keel::real_clock{}.now(), {.timeout = 1s});
  const absl::Status cause = absl::UnavailableError("down");
  a(keel::events::retry_scheduled{call, 1, 1ms, true, cause});
  b(keel::events::retry_scheduled{call, 1, 1ms, true, cause});
  const auto s = registry.snapshot();
  CHECK(counter(s, "svc_retries_total", "true") == 2);
  CHECK(counter(s, "retries_total", "true") == 0);

  CHECK_THROWS_WITH(keel::metrics_listener(registry, {.prefix = "9x_"}),
                    "metrics_listener_options.prefix must make valid metric names (got \"9x_\")");
  CHECK_THROWS_WITH(keel::metrics_listener(registry, {.prefix = "p_", .retry_wait_buckets = {1, 0.5}}),
                    "metrics_listener_options.retry_wait_buckets must be finite and strictly increasing (got 2)");
  keel::metrics_registry taken;
  (void)taken.gauge({.name = "keel_retries_total", .help = "not a counter"});
  CHECK_THROWS_AS(keel::metrics_listener(taken), keel::invalid_options);
}
