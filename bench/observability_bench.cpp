// Observability's costs: the core pipeline with no listener, with the null
// listener and with the metrics listener (the default sink must cost
// nothing); the same when a retry happens and events fire; recording into a
// latency histogram, a counter and an SLO; rendering Prometheus text.
// Names are stable; see docs/benchmarks.md.
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <type_traits>

#include <benchmark/benchmark.h>

#include "keel/compose/pipeline.hpp"
#include "keel/core/call.hpp"
#include "keel/core/telemetry.hpp"
#include "keel/observe/latency_histogram.hpp"
#include "keel/observe/metrics.hpp"
#include "keel/observe/prometheus.hpp"
#include "keel/observe/slo.hpp"
#include "keel/observe/telemetry_metrics.hpp"
#include "keel/policy/adaptive_timeout.hpp"
#include "keel/policy/backoff.hpp"
#include "keel/policy/retry.hpp"
#include "keel/policy/retry_budget.hpp"
#include "keel/policy/time_limit.hpp"
#include "support/alloc_counter.hpp"

using namespace std::chrono_literals;

namespace {

// The trivial provider of bench/core_bench.cpp.
struct provider {
  absl::StatusOr<int> operator()(const keel::attempt& a) const { return a.number; }
};

// Fails the first attempt of each call, so one retry (with no wait) and its
// events happen on every call.
struct flaky_provider {
  absl::StatusOr<int> operator()(const keel::attempt& a) const {
    if (a.number == 1) return absl::UnavailableError("blip");
    return a.number;
  }
};

keel::metrics_registry& registry() {
  static keel::metrics_registry r;
  return r;
}

// BM_Pipeline_RetryTimeout_Success of bench/core_bench.cpp, the same
// policies and options, run in an environment with `listener`, or with
// no listener when `observe` is false.
template <bool observe, class Listener>
void run_pipeline(benchmark::State& state, Listener listener) {
  keel_bench::count_allocations allocs(state);
  static keel::retry_budget budget({.ratio = 0.1});
  static keel::adaptive_timeout timeouts;
  auto base = keel::pipeline(keel::time_limit({.at_most = 2s}),
                             keel::retry({.max_attempts = 3, .budget = &budget}), timeouts);
  auto body = [&](const auto& pipe) {
    for (auto _ : state) {
      keel::call call(keel::real_clock{}.now(), {.timeout = 3s, .response_reserve = 200ms});
      absl::StatusOr<int> r = pipe.run(call, provider{});
      benchmark::DoNotOptimize(r);
    }
  };
  // A null listener gives back the very type of the pipeline without one:
  // the two benchmarks below run the same instantiation.
  static_assert(std::is_same_v<decltype(base), decltype(base.in(keel::environment<>{}.with_listener(keel::null_listener{})))>);
  if constexpr (observe) {
    body(base.in(keel::environment<>{}.with_listener(listener)));
  } else {
    body(base);
  }
}

// The same pipeline around flaky_provider: one retry per call, no wait, a
// budget that always grants it.
template <class Listener>
void run_retrying_pipeline(benchmark::State& state, Listener listener) {
  keel_bench::count_allocations allocs(state);
  static keel::retry_budget budget({.ratio = 1.0, .min_per_second = 1e12});
  static keel::adaptive_timeout timeouts;
  auto pipe = keel::pipeline(keel::time_limit({.at_most = 2s}),
                             keel::retry({.max_attempts = 3, .budget = &budget},
                                         keel::constant_backoff{.delay_each = keel::duration::zero()}),
                             timeouts)
                  .in(keel::environment<>{}.with_listener(listener));
  for (auto _ : state) {
    keel::call call(keel::real_clock{}.now(), {.timeout = 3s, .response_reserve = 200ms});
    absl::StatusOr<int> r = pipe.run(call, flaky_provider{});
    benchmark::DoNotOptimize(r);
  }
}

void BM_Pipeline_NoListener(benchmark::State& state) { run_pipeline<false>(state, keel::null_listener{}); }
BENCHMARK(BM_Pipeline_NoListener)->Threads(1)->Threads(2);

void BM_Pipeline_NullListener(benchmark::State& state) { run_pipeline<true>(state, keel::null_listener{}); }
BENCHMARK(BM_Pipeline_NullListener)->Threads(1)->Threads(2);

void BM_Pipeline_MetricsListener(benchmark::State& state) {
  run_pipeline<true>(state, keel::metrics_listener(registry()));
}
BENCHMARK(BM_Pipeline_MetricsListener)->Threads(1)->Threads(2);

// One retry per call: events fire, so the listener does its counting.
void BM_Pipeline_OneRetry_NullListener(benchmark::State& state) {
  run_retrying_pipeline(state, keel::null_listener{});
}
BENCHMARK(BM_Pipeline_OneRetry_NullListener);

void BM_Pipeline_OneRetry_MetricsListener(benchmark::State& state) {
  run_retrying_pipeline(state, keel::metrics_listener(registry()));
}
BENCHMARK(BM_Pipeline_OneRetry_MetricsListener);

// Latencies drawn from a heavy-tailed distribution, replayed in a loop.
const std::array<keel::duration, 4096>& latencies() {
  static const auto values = [] {
    std::array<keel::duration, 4096> v{};
    std::mt19937_64 gen(1);
    std::lognormal_distribution<double> d(std::log(2e7), 1.0);
    for (auto& x : v) x = std::chrono::nanoseconds(static_cast<std::int64_t>(d(gen)));
    return v;
  }();
  return values;
}

void BM_LatencyHistogram_Record(benchmark::State& state) {
  static keel::latency_histogram h;
  const auto& values = latencies();
  keel_bench::count_allocations allocs(state);
  std::size_t i = static_cast<std::size_t>(state.thread_index()) * 1024;
  for (auto _ : state) {
    h.record(values[i++ & 4095]);
  }
}
BENCHMARK(BM_LatencyHistogram_Record)->Threads(1)->Threads(2);

void BM_Counter_Inc(benchmark::State& state) {
  static keel::counter_metric& c =
      registry().counter({.name = "bench_ops_total", .help = "Ops.", .labels = {"kind"}}).with({"bench"});
  keel_bench::count_allocations allocs(state);
  for (auto _ : state) c.inc();
}
BENCHMARK(BM_Counter_Inc)->Threads(1)->Threads(2);

void BM_Slo_Record(benchmark::State& state) {
  static keel::work_class_slo slo("interactive", {.target = 0.999,
                                                  .window = 1h,
                                                  .window_buckets = 60,
                                                  .rejected = keel::counts_as::bad,
                                                  .partial = keel::counts_as::good,
                                                  .abandoned = keel::counts_as::not_eligible,
                                                  .latency_threshold = 3s});
  const auto& values = latencies();
  const keel::time_point now = keel::real_clock{}.now();
  keel_bench::count_allocations allocs(state);
  std::size_t i = 0;
  for (auto _ : state) slo.record(keel::request_outcome::success, values[i++ & 4095], now);
}
BENCHMARK(BM_Slo_Record)->Threads(1)->Threads(2);

// A /metrics scrape: snapshot and render a registry of 3 families x 10
// series (counters, and histograms with the default 13 buckets).
void BM_PrometheusText_Render(benchmark::State& state) {
  keel::metrics_registry r;
  auto& c = r.counter({.name = "app_requests_total", .help = "Requests.", .labels = {"class", "outcome"}});
  auto& g = r.gauge({.name = "app_in_flight", .help = "In flight.", .labels = {"class"}});
  auto& h = r.histogram({.name = "app_latency_seconds", .help = "Latency.", .labels = {"class"}});
  for (int i = 0; i < 10; ++i) {
    const std::string cls = "class" + std::to_string(i);
    c.with({cls, "success"}).inc(1000 + i);
    g.with({cls}).set(i);
    for (int k = 0; k < 100; ++k) h.with({cls}).observe(latencies()[static_cast<std::size_t>(k)]);
  }
  keel_bench::count_allocations allocs(state);
  for (auto _ : state) {
    absl::StatusOr<std::string> text = keel::to_prometheus_text(r.snapshot());
    benchmark::DoNotOptimize(text);
  }
}
BENCHMARK(BM_PrometheusText_Render);

}  // namespace
