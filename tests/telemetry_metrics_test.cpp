// keel::metrics_listener: keel's events counted as metrics — retries, their
// waits and why retry layers stopped — through real pipelines on the manual
// clock, under contention, without allocating, and rendered for Prometheus.
#include "keel/observe/telemetry_metrics.hpp"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <vector>

#include "keel/core/timer.hpp"
#include "keel/compose/executor.hpp"
#include "keel/compose/fallback.hpp"
#include "keel/compose/hedge.hpp"
#include "keel/compose/pipeline.hpp"
#include "keel/core/call.hpp"
#include "keel/durable/digest.hpp"
#include "keel/durable/fan_out.hpp"
#include "keel/durable/job_queue.hpp"
#include "keel/durable/lease.hpp"
#include "keel/durable/once.hpp"
#include "keel/observe/metrics.hpp"
#include "keel/observe/prometheus.hpp"
#include "keel/policy/adaptive_limit.hpp"
#include "keel/policy/adaptive_throttle.hpp"
#include "keel/policy/admission.hpp"
#include "keel/policy/backoff.hpp"
#include "keel/policy/bulkhead.hpp"
#include "keel/policy/circuit_breaker.hpp"
#include "keel/policy/retry.hpp"
#include "keel/policy/retry_budget.hpp"
#include "keel/store/memory.hpp"
#include "keel/testing/manual_clock.hpp"
#include "keel/testing/scripted_provider.hpp"
#include "keel/testing/seeded_random.hpp"
#include "support/alloc_counter.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;
using keel::testing::manual_clock;
using keel::testing::scripted_provider;
namespace kt = keel::testing;

namespace {

// The value of the series of `family` with these label values; -1 if absent.
double value(const keel::metrics_snapshot& s, std::string_view family, std::vector<std::string> labels) {
  for (const auto& f : s.families) {
    if (f.name != family) continue;
    for (const auto& series : f.series)
      if (series.labels == labels) return series.value;
  }
  return -1;
}

double counter(const keel::metrics_snapshot& s, std::string_view family, std::string_view label) {
  return value(s, family, {std::string(label)});
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
                  .in(keel::environment{clock}.with_listener(listener));
  keel::retry_budget empty_budget({.ratio = 0.0, .min_per_second = 0.0});
  auto budgeted = keel::pipeline(keel::retry({.max_attempts = 3, .budget = &empty_budget},
                                             keel::constant_backoff{.delay_each = 40ms}))
                      .in(keel::environment{clock}.with_listener(listener));

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
                    .in(keel::environment{clock}.with_listener(listener));
    scripted_provider<int> provider(clock, {kt::unavailable(10ms)});
    keel::call call(clock.now(), {.timeout = 1s});
    CHECK_FALSE(pipe.run(call, provider).ok());
    CHECK(counter(registry.snapshot(), "keel_retry_stops_total", "deadline") == 1);
  }
  SECTION("cancelled while waiting") {
    auto pipe = keel::pipeline(keel::retry({.max_attempts = 3}, keel::constant_backoff{.delay_each = 10s}))
                    .in(keel::environment{clock}.with_listener(listener));
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
                  .in(keel::environment<>{}.with_listener(listener));
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

TEST_CASE("breaker transitions and rejections are counted by breaker and state", "[telemetry][breaker]") {
  manual_clock clock;
  clock.auto_advance(true);
  keel::metrics_registry registry;
  const keel::metrics_listener listener(registry);
  keel::circuit_breaker breaker({.name = "llm-eu",
                                 .window_calls = 4,
                                 .minimum_calls = 4,
                                 .failure_rate_threshold = 0.5,
                                 .open_duration = 5s,
                                 .half_open_probes = 1});
  auto pipe = keel::pipeline(breaker).in(keel::environment{clock}.with_listener(listener));
  auto run = [&](absl::Status result) {
    keel::call call(clock.now(), {.timeout = 1s});
    return pipe.run(call, [&](const keel::attempt&) { return result; });
  };
  for (int i = 0; i < 4; ++i) (void)run(absl::UnavailableError("down"));  // trips: closed -> open
  const absl::Status refused = run(absl::OkStatus());
  CHECK(refused.code() == absl::StatusCode::kUnavailable);
  CHECK(keel::not_started(refused));
  clock.advance(5s);
  CHECK(run(absl::OkStatus()).ok());  // the probe: open -> half-open -> closed

  const auto s = registry.snapshot();
  CHECK(value(s, "keel_breaker_transitions_total", {"llm-eu", "closed", "open"}) == 1);
  CHECK(value(s, "keel_breaker_transitions_total", {"llm-eu", "half-open", "closed"}) == 1);
  CHECK(value(s, "keel_breaker_rejections_total", {"llm-eu", "open"}) == 1);
  CHECK(keel::to_prometheus_text(s).ok());
}

TEST_CASE("names past max_series are folded into _other", "[telemetry][breaker]") {
  keel::metrics_registry registry;
  const keel::metrics_listener listener(registry, {.max_series = 2});
  keel::call call(keel::real_clock{}.now(), {.timeout = 1s});
  for (const char* name : {"a", "b", "c", "d", "a"}) {
    listener(keel::events::breaker_rejected{call, name, keel::breaker_state::open});
  }
  const auto s = registry.snapshot();
  CHECK(value(s, "keel_breaker_rejections_total", {"a", "open"}) == 2);
  CHECK(value(s, "keel_breaker_rejections_total", {"b", "open"}) == 1);
  CHECK(value(s, "keel_breaker_rejections_total", {"_other", "open"}) == 2);
  CHECK(value(s, "keel_breaker_rejections_total", {"c", "open"}) == -1);
}

TEST_CASE("fallbacks used and skipped are counted by path, reason and gate", "[telemetry][fallback]") {
  manual_clock clock;
  clock.auto_advance(true);
  keel::metrics_registry registry;
  const keel::metrics_listener listener(registry);
  const keel::gate residency("residency", [](const keel::labels& call, const keel::path& p) {
    return call.region.empty() || call.region == p.labels.region;
  });
  scripted_provider<std::string> model(clock, {kt::unavailable(10ms)});
  scripted_provider<std::string> us_model(clock, {kt::answer(std::string("us"))});
  scripted_provider<std::string> cached(clock, {kt::answer(std::string("cached"))});
  auto pipe = keel::pipeline(keel::fallback({residency},
                                            keel::alternate("us-model", us_model, {.labels = {.region = "us"}}),
                                            keel::alternate("cached", cached, {.labels = {.region = "eu"}, .provider_call = false})))
                  .in(keel::environment{clock}.with_listener(listener));
  keel::call call(clock.now(), {.timeout = 2s, .labels = {.region = "eu"}});
  REQUIRE(pipe.run(call, model).value() == "cached");
  CHECK(us_model.calls() == 0);
  const auto s = registry.snapshot();
  CHECK(value(s, "keel_fallback_skips_total", {"us-model", "gate", "residency"}) == 1);
  CHECK(value(s, "keel_fallbacks_total", {"cached"}) == 1);
  CHECK(value(s, "keel_fallbacks_total", {"us-model"}) == -1);
}

TEST_CASE("hedges started, losers cancelled and outstanding work are reported", "[telemetry][hedge]") {
  manual_clock clock;
  keel::bounded_pool pool({.threads = 2, .queue_capacity = 8});
  keel::deadline_timer hedger_timer{clock};
  keel::hedge hedger({.delay = 100ms}, pool, hedger_timer);
  keel::metrics_registry registry;
  const keel::metrics_listener listener(registry);
  keel::watch_hedge(registry, "llm", hedger);
  auto pipe = keel::pipeline(hedger).in(keel::environment{clock}.with_listener(listener));
  // The primary waits for its stop token (up to 10 s); the hedge answers at once.
  auto provider = [&clock](const keel::attempt& a) -> absl::StatusOr<int> {
    if (a.hedge == 0) {
      clock.sleep_until(a.start + 10s, a.stop);
      return absl::CancelledError("primary stopped");
    }
    return 7;
  };
  keel::call call(clock.now(), {.timeout = 20s});
  absl::StatusOr<int> r;
  std::thread caller([&] { r = pipe.run(call, provider); });
  clock.await_sleepers(2);  // the primary and the hedge's timer
  clock.advance(100ms);     // the hedge starts, wins, and the primary is asked to stop
  caller.join();
  REQUIRE(r.ok());
  CHECK(*r == 7);
  // The call returned with the hedge's answer; the cancelled primary returns on its own thread.
  const auto give_up = std::chrono::steady_clock::now() + 20s;
  while (hedger.figures().outstanding != 0 && std::chrono::steady_clock::now() < give_up) std::this_thread::yield();
  const auto s = registry.snapshot();
  CHECK(value(s, "keel_hedges_started_total", {}) == 1);
  CHECK(value(s, "keel_hedge_losers_cancelled_total", {}) == 1);
  CHECK(value(s, "keel_hedge_outstanding", {"llm"}) == 0);  // the primary has returned
  CHECK(value(s, "keel_hedge_wins_total", {"llm"}) == 1);
  CHECK(keel::to_prometheus_text(s).ok());
}

TEST_CASE("hedge skips and refused writes are counted by reason", "[telemetry][hedge]") {
  keel::metrics_registry registry;
  const keel::metrics_listener listener(registry);
  keel::call call(keel::real_clock{}.now(), {.timeout = 1s});
  using why = keel::events::hedge_skipped::reason;
  for (why w : {why::budget, why::budget, why::executor, why::attempt_cap, why::deadline, why::cancelled}) {
    keel::observe(listener, keel::events::hedge_skipped{call, 1, w});
  }
  keel::observe(listener, keel::events::hedge_refused_write{call, true});
  const auto s = registry.snapshot();
  CHECK(counter(s, "keel_hedges_skipped_total", "budget") == 2);
  CHECK(counter(s, "keel_hedges_skipped_total", "executor") == 1);
  CHECK(counter(s, "keel_hedges_skipped_total", "cancelled") == 1);
  CHECK(counter(s, "keel_hedge_refused_writes_total", "true") == 1);
  CHECK(counter(s, "keel_hedge_refused_writes_total", "false") == 0);
}

TEST_CASE("a lease keeper that loses its lease is counted", "[telemetry][lease]") {
  manual_clock clock;
  keel::metrics_registry registry;
  const keel::metrics_listener listener(registry);
  std::stop_source work;
  std::atomic<int> renewals{0};
  keel::lease_keeper keeper(
      "job-42",
      [&renewals](keel::duration) {
        ++renewals;
        return keel::lost_ownership_error("taken over by another worker");
      },
      work, clock.now(), {.ttl = 30s, .renew_every = 10s}, keel::environment{clock}.with_listener(listener));
  clock.await_sleepers(1);
  clock.advance(10s);
  for (int i = 0; i < 1'000'000 && !keeper.lost(); ++i) std::this_thread::yield();
  keeper.stop();
  REQUIRE(keeper.lost());
  CHECK(work.stop_requested());
  CHECK(value(registry.snapshot(), "keel_leases_lost_total", {}) == 1);
}

TEST_CASE("idempotent begins are counted by what the store answered", "[telemetry][idempotency]") {
  manual_clock clock;
  keel::memory_store store(clock);
  keel::metrics_registry registry;
  const keel::metrics_listener listener(registry);
  keel::once decide(store, {.lease = 30s, .retention = 24h, .retry_window = 1h},
                    keel::environment{clock}.with_listener(listener));
  const keel::request_identity id{.tenant = "merchant-82", .endpoint = "receipts", .key = "key-47"};
  const keel::digest a = keel::digest_builder().field("receipt", "A").finish();
  const keel::digest b = keel::digest_builder().field("receipt", "B").finish();
  int provider_calls = 0;
  auto decide_once = [&](const keel::digest& d) {
    keel::call call(clock.now(), {.timeout = 3s});
    return decide.run(call, id, d, [&](const keel::claim_context&) -> absl::StatusOr<keel::decision> {
      ++provider_calls;
      return keel::decision{.model_digest = "m@1", .result = "approved"};
    });
  };
  REQUIRE(decide_once(a).ok());                            // claimed
  REQUIRE(decide_once(a).ok());                            // replay
  CHECK(keel::is_conflict(decide_once(b).status()));       // conflict
  CHECK(provider_calls == 1);
  const auto s = registry.snapshot();
  CHECK(counter(s, "keel_idempotency_begins_total", "claimed") == 1);
  CHECK(counter(s, "keel_idempotency_begins_total", "replay") == 1);
  CHECK(counter(s, "keel_idempotency_begins_total", "conflict") == 1);
  CHECK(counter(s, "keel_idempotency_begins_total", "in-flight") == 0);
}

TEST_CASE("the default sink is no sink: observing null_listener changes nothing", "[telemetry]") {
  auto pipe = keel::pipeline(keel::retry({.max_attempts = 3}));
  // The same type, so the same code: the events are never built.
  STATIC_REQUIRE(std::is_same_v<decltype(pipe), decltype(pipe.in(keel::environment<>{}.with_listener(keel::null_listener{})))>);
  STATIC_REQUIRE_FALSE(keel::wants<keel::null_listener, keel::events::retry_scheduled>);
  STATIC_REQUIRE(keel::wants<keel::metrics_listener, keel::events::retry_scheduled>);
  STATIC_REQUIRE(keel::wants<keel::metrics_listener, keel::events::breaker_state_changed>);
  STATIC_REQUIRE(keel::wants<keel::metrics_listener, keel::events::lease_lost>);
  STATIC_REQUIRE(std::is_nothrow_copy_constructible_v<keel::metrics_listener>);
}

TEST_CASE("a fan-out's units, saves and outstanding work are reported", "[telemetry][fan_out]") {
  keel::memory_store store;
  keel::bounded_pool pool({.threads = 2, .queue_capacity = 8});
  keel::metrics_registry registry;
  const keel::metrics_listener listener(registry);
  keel::fan_out panel(keel::fan_out_options<std::string>{.width = 3}, store, pool,
                      keel::environment<>{}.with_listener(listener));
  keel::watch_fan_out(registry, "panel", panel);
  std::vector<keel::unit> units;
  for (const char* name : {"A", "B", "C"}) {
    units.push_back({.name = name, .key = keel::digest_builder().field("model", name).finish()});
  }
  std::atomic<bool> b_fails{true};
  auto worker = [&](const keel::unit_context& u) -> absl::StatusOr<std::string> {
    if (u.unit.name == "B" && b_fails.load()) return absl::UnavailableError("B is down");
    return "score:" + u.unit.name;
  };
  {
    keel::call call(keel::real_clock{}.now(), {.timeout = 10s});
    CHECK_FALSE(panel.run(call, units, worker).complete());
  }
  b_fails = false;
  {
    keel::call call(keel::real_clock{}.now(), {.timeout = 10s});
    CHECK(panel.run(call, units, worker).complete());  // A and C from the store, B again
  }
  const auto s = registry.snapshot();
  CHECK(value(s, "keel_fan_out_units_total", {"panel", "started"}) == 4);
  CHECK(value(s, "keel_fan_out_units_total", {"panel", "succeeded"}) == 3);
  CHECK(value(s, "keel_fan_out_units_total", {"panel", "failed"}) == 1);
  CHECK(value(s, "keel_fan_out_units_total", {"panel", "cached"}) == 2);
  CHECK(value(s, "keel_fan_out_saved_total", {"panel"}) == 3);
  CHECK(value(s, "keel_fan_out_outstanding", {"panel"}) == 0);
  // The same runs, counted from the fan-out's events on the environment's listener.
  CHECK(value(s, "keel_fan_out_units_started_total", {}) == 4);
  CHECK(counter(s, "keel_fan_out_unit_results_total", "succeeded") == 3);
  CHECK(counter(s, "keel_fan_out_unit_results_total", "failed") == 1);
  CHECK(counter(s, "keel_fan_out_unit_results_total", "cached") == 2);
  CHECK(counter(s, "keel_fan_out_unit_results_total", "missing") == 0);
  CHECK(counter(s, "keel_fan_out_runs_total", "false") == 1);
  CHECK(counter(s, "keel_fan_out_runs_total", "true") == 1);
  CHECK(keel::to_prometheus_text(s).ok());
}

TEST_CASE("admission and bulkhead rejections are counted with the limit that refused", "[telemetry][admission]") {
  keel::metrics_registry registry;
  const keel::metrics_listener listener(registry);
  auto ok = [](const keel::attempt&) -> absl::StatusOr<int> { return 1; };

  keel::admission quotas({.tenant_defaults = {.max_in_flight = 1}});
  auto admitted = keel::pipeline(quotas).in(keel::environment<>{}.with_listener(listener));
  {
    // acme's one in-flight slot is held; its next call is refused, globex's is not.
    absl::StatusOr<keel::admission_ticket> held =
        quotas.admit({.tenant = "acme", .model = "m"}, keel::real_clock{}.now());
    REQUIRE(held.ok());
    keel::call acme(keel::real_clock{}.now(), {.timeout = 1s, .labels = {.tenant = "acme", .model = "m"}});
    const absl::Status refused = admitted.run(acme, ok).status();
    CHECK(refused.code() == absl::StatusCode::kResourceExhausted);
    CHECK(keel::refused_by(refused) == "tenant:acme:in_flight");
    keel::call globex(keel::real_clock{}.now(), {.timeout = 1s, .labels = {.tenant = "globex", .model = "m"}});
    CHECK(admitted.run(globex, ok).ok());
  }

  keel::bulkhead pools({.classes = {{.name = "batch", .capacity = 1, .max_queue = 0}}});
  auto isolated = keel::pipeline(pools).in(keel::environment<>{}.with_listener(listener));
  {
    keel::bulkhead_permit busy = pools.try_acquire(*pools.class_index("batch"));
    REQUIRE(busy);
    keel::call batch(keel::real_clock{}.now(), {.timeout = 1s, .labels = {.work_class = "batch"}});
    CHECK(isolated.run(batch, ok).status().code() == absl::StatusCode::kResourceExhausted);
    keel::call unknown(keel::real_clock{}.now(), {.timeout = 1s, .labels = {.work_class = "reports"}});
    CHECK_FALSE(isolated.run(unknown, ok).ok());
  }

  const auto s = registry.snapshot();
  CHECK(value(s, "keel_admission_rejections_total", {"tenant", "acme", "in_flight"}) == 1);
  CHECK(value(s, "keel_admission_rejections_total", {"tenant", "globex", "in_flight"}) == -1);
  CHECK(value(s, "keel_bulkhead_rejections_total", {"batch", "queue_full"}) == 1);
  CHECK(value(s, "keel_bulkhead_rejections_total", {"reports", "unknown_class"}) == 1);
  CHECK(keel::to_prometheus_text(s).ok());
}

namespace {

// A job store that always has a job to claim and answers each fenced write as
// the test says: enough to drive a real keel::job_queue through every event.
struct scripted_job_store {
  bool full = false;                                   // submit() refuses: the queue is full
  absl::Status complete_answer = absl::OkStatus();     // what complete() answers
  keel::job_state fail_answer = keel::job_state::queued;  // where fail() sends the job
  std::int64_t next_id = 0;
  int claims = 0;

  absl::StatusOr<keel::job_submission> submit(const keel::job_key& k, const keel::digest&, std::string_view,
                                              const keel::job_limits& limits) {
    if (full) return keel::job_queue_full_error(k.queue, limits.max_depth, limits.max_depth, 1s);
    return keel::job_submission{.id = ++next_id, .created = true};
  }
  absl::StatusOr<std::optional<keel::job_claim>> claim(std::string_view, const keel::owner_id& owner,
                                                       keel::duration lease) {
    ++claims;
    return std::optional<keel::job_claim>(keel::job_claim{.id = claims,
                                                          .tenant = "acme",
                                                          .key = "k",
                                                          .ownership = {.owner = owner, .fence = claims},
                                                          .attempt = 1,
                                                          .max_attempts = 3,
                                                          .lease = lease});
  }
  absl::Status renew(std::int64_t, const keel::ownership&, keel::duration) { return absl::OkStatus(); }
  absl::Status complete(std::int64_t, const keel::ownership&, std::string_view) { return complete_answer; }
  absl::StatusOr<keel::job_state> fail(std::int64_t, const keel::ownership&, const keel::job_failure&) {
    return fail_answer;
  }
  absl::StatusOr<std::optional<keel::job_info>> get(std::int64_t) { return std::optional<keel::job_info>(); }
  absl::StatusOr<std::optional<keel::job_info>> find(const keel::job_key&) {
    return std::optional<keel::job_info>();
  }
  absl::StatusOr<keel::job_counts> counts(std::string_view) { return keel::job_counts{}; }
  absl::StatusOr<std::int64_t> purge_finished(std::string_view, keel::duration) { return std::int64_t{0}; }
};
static_assert(keel::job_store<scripted_job_store>);

}  // namespace

TEST_CASE("job attempts are counted by queue and where the job went; full-queue rejections by queue",
          "[telemetry][jobs]") {
  manual_clock clock;
  keel::metrics_registry registry;
  const keel::metrics_listener listener(registry);

  SECTION("a job queue's own events, through a real keel::job_queue") {
    scripted_job_store store;
    keel::job_queue reports(store, {.queue = "reports"}, keel::environment{clock}.with_listener(listener));
    auto ok = [](const keel::job_context&) -> absl::StatusOr<std::string> { return std::string("report"); };
    auto down = [](const keel::job_context&) -> absl::StatusOr<std::string> {
      return absl::UnavailableError("upstream down");
    };
    auto bad = [](const keel::job_context&) -> absl::StatusOr<std::string> {
      return absl::InvalidArgumentError("no such report");
    };

    REQUIRE(reports.submit("acme", "a", "{}").ok());
    store.full = true;
    CHECK(keel::is_job_queue_full(reports.submit("acme", "b", "{}").status()));
    CHECK(keel::is_job_queue_full(reports.submit("acme", "c", "{}").status()));

    for (int i = 0; i < 3; ++i) CHECK(reports.run_one(ok).value()->state == keel::job_state::done);
    CHECK(reports.run_one(down).value()->state == keel::job_state::queued);  // tried again later
    store.fail_answer = keel::job_state::failed;
    CHECK(reports.run_one(bad).value()->state == keel::job_state::failed);
    store.complete_answer = keel::lost_ownership_error("job taken over by another worker");
    CHECK(reports.run_one(ok).value()->lost);

    const auto s = registry.snapshot();
    CHECK(value(s, "keel_job_attempts_total", {"reports", "done"}) == 3);
    CHECK(value(s, "keel_job_attempts_total", {"reports", "requeued"}) == 1);
    CHECK(value(s, "keel_job_attempts_total", {"reports", "failed"}) == 1);
    CHECK(value(s, "keel_job_attempts_total", {"reports", "lost"}) == 1);
    CHECK(value(s, "keel_job_rejections_total", {"reports"}) == 2);
    const absl::StatusOr<std::string> text = keel::to_prometheus_text(s);
    REQUIRE(text.ok());
    CHECK(contains(*text, "# TYPE keel_job_attempts_total counter\n"));
    CHECK(contains(*text, "keel_job_attempts_total{queue=\"reports\",result=\"done\"} 3\n"));
    CHECK(contains(*text, "keel_job_attempts_total{queue=\"reports\",result=\"requeued\"} 1\n"));
    CHECK(contains(*text, "keel_job_attempts_total{queue=\"reports\",result=\"failed\"} 1\n"));
    CHECK(contains(*text, "keel_job_attempts_total{queue=\"reports\",result=\"lost\"} 1\n"));
    CHECK(contains(*text, "# TYPE keel_job_rejections_total counter\n"));
    CHECK(contains(*text, "keel_job_rejections_total{queue=\"reports\"} 2\n"));
  }

  SECTION("events fed directly, queues kept apart and capped like other names") {
    const keel::metrics_listener capped(registry, {.max_series = 1});  // the same families, capped at one series
    const absl::Status full = keel::job_queue_full_error("exports", 10, 10, 1s);
    const absl::Status taken = keel::lost_ownership_error("taken over");
    keel::observe(listener, keel::events::job_finished{"exports", 1, 1, keel::job_state::queued});
    keel::observe(listener, keel::events::job_finished{"exports", 1, 2, keel::job_state::done});
    keel::observe(listener, keel::events::job_finished{"imports", 2, 1, keel::job_state::failed});
    keel::observe(listener, keel::events::job_lost{"imports", 3, taken});
    keel::observe(listener, keel::events::job_rejected{"exports", full});
    keel::observe(capped, keel::events::job_rejected{"exports", full});
    keel::observe(capped, keel::events::job_rejected{"third", full});  // a second queue: past max_series

    const auto s = registry.snapshot();
    CHECK(value(s, "keel_job_attempts_total", {"exports", "requeued"}) == 1);
    CHECK(value(s, "keel_job_attempts_total", {"exports", "done"}) == 1);
    CHECK(value(s, "keel_job_attempts_total", {"exports", "failed"}) == -1);
    CHECK(value(s, "keel_job_attempts_total", {"imports", "failed"}) == 1);
    CHECK(value(s, "keel_job_attempts_total", {"imports", "lost"}) == 1);
    CHECK(value(s, "keel_job_rejections_total", {"exports"}) == 2);
    CHECK(value(s, "keel_job_rejections_total", {"third"}) == -1);
    CHECK(value(s, "keel_job_rejections_total", {"_other"}) == 1);
    const absl::StatusOr<std::string> text = keel::to_prometheus_text(s);
    REQUIRE(text.ok());
    CHECK(contains(*text, "keel_job_attempts_total{queue=\"imports\",result=\"lost\"} 1\n"));
    CHECK(contains(*text, "keel_job_rejections_total{queue=\"_other\"} 1\n"));
  }
  STATIC_REQUIRE(keel::wants<keel::metrics_listener, keel::events::job_finished>);
  STATIC_REQUIRE(keel::wants<keel::metrics_listener, keel::events::job_lost>);
  STATIC_REQUIRE(keel::wants<keel::metrics_listener, keel::events::job_rejected>);
}

TEST_CASE("adaptive limits: the limit as a gauge, refusals by limiter or throttle and class",
          "[telemetry][adaptive]") {
  manual_clock clock;
  keel::metrics_registry registry;
  const keel::metrics_listener listener(registry);
  keel::adaptive_limit limit({.name = "llm", .initial_limit = 3, .window = 4, .probe_limit = 1, .probe_samples = 1,
                              .classes = {{.name = "interactive"}, {.name = "batch", .share = 0.5}},
                              .default_class = "interactive"});
  keel::adaptive_throttle throttle({.name = "llm", .window = 1min}, keel::testing::seeded_random(4));
  auto pipe = keel::pipeline(throttle, limit).in(keel::environment{clock}.with_listener(listener));
  auto run = [&](std::string_view cls, absl::Status result) {
    keel::call call(clock.now(), {.timeout = 10s, .labels = {.work_class = cls}});
    return pipe.run(call, [&](const keel::attempt&) -> absl::Status {
      clock.advance(100ms);
      return result;
    });
  };
  REQUIRE(run("", absl::OkStatus()).ok());  // the first probe ends: the limit goes 1 -> 3
  CHECK(value(registry.snapshot(), "keel_adaptive_limit", {"llm"}) == 3);
  // Batch may fill one of the three: with one held, a batch call is refused.
  keel::adaptive_limit_permit held = limit.try_acquire(0);
  CHECK(keel::refused_by(run("batch", absl::OkStatus())) == "adaptive_limit:llm:batch");
  held.release();
  // A provider that throttles everything: the throttle starts rejecting.
  int rejected = 0;
  for (int i = 0; i < 40; ++i) {
    const absl::Status s = run("interactive", absl::ResourceExhaustedError("429"));
    if (keel::refused_by(s) == "adaptive_throttle:llm:default") ++rejected;
  }
  REQUIRE(rejected > 0);
  const auto s = registry.snapshot();
  CHECK(value(s, "keel_adaptive_limit_rejections_total", {"llm", "batch"}) == 1);
  CHECK(value(s, "keel_adaptive_throttle_rejections_total", {"llm", "default"}) == rejected);
  // The throttled windows shrank the limit: the gauge followed.
  CHECK(value(s, "keel_adaptive_limit", {"llm"}) == limit.limit());
  CHECK(limit.limit() < 3);
  CHECK(keel::to_prometheus_text(s).ok());
}
