// The foundation's costs: a provider called directly, the same provider
// behind deadline + retry + adaptive timeout, one backoff draw, one retry
// budget check, a deadline timer's arm + disarm and the same pipeline with
// its attempts cut at their deadlines. Names are stable; see docs/benchmarks.md.
#include <chrono>
#include <stop_token>

#include <benchmark/benchmark.h>

#include "keel/compose/cut_at_deadline.hpp"
#include "keel/compose/pipeline.hpp"
#include "keel/core/call.hpp"
#include "keel/policy/adaptive_timeout.hpp"
#include "keel/policy/backoff.hpp"
#include "keel/policy/retry.hpp"
#include "keel/policy/retry_budget.hpp"
#include "keel/policy/time_limit.hpp"
#include "support/alloc_counter.hpp"
#include "support/baselines.hpp"

using namespace std::chrono_literals;

namespace {

using provider = keel_bench::trivial_provider;
using keel_bench::BM_Baseline_SteadyClockNow;
using keel_bench::BM_Baseline_TimedCall;

BENCHMARK(BM_Baseline_SteadyClockNow);

void BM_DirectCall(benchmark::State& state) {
  keel_bench::count_allocations allocs(state);
  keel::call call(keel::real_clock{}.now(), {.timeout = 3s});
  const keel::attempt a{.owner = &call};
  provider p;
  for (auto _ : state) {
    benchmark::DoNotOptimize(a);
    absl::StatusOr<int> r = p(a);
    benchmark::DoNotOptimize(r);
  }
}
BENCHMARK(BM_DirectCall);

BENCHMARK(BM_Baseline_TimedCall);

// A new call per request, then deadline + retry + adaptive timeout: one
// clock read for the call and its pass, one at the end of the attempt.
void BM_Pipeline_RetryTimeout_Success(benchmark::State& state) {
  keel_bench::count_allocations allocs(state);
  static keel::retry_budget budget({.ratio = 0.1});
  static keel::adaptive_timeout timeouts;
  auto pipe = keel::pipeline(keel::time_limit({.at_most = 2s}),
                             keel::retry({.max_attempts = 3, .budget = &budget}), timeouts);
  for (auto _ : state) {
    // One read for the call and its pass, as a service does (run(call, now, ...)),
    // and one when the attempt ends: the two reads of BM_Baseline_TimedCall.
    const keel::time_point now = keel::real_clock{}.now();
    keel::call call(now, {.timeout = 3s, .response_reserve = 200ms});
    absl::StatusOr<int> r = pipe.run(call, now, provider{});
    benchmark::DoNotOptimize(r);
  }
}
BENCHMARK(BM_Pipeline_RetryTimeout_Success)->Threads(1)->Threads(2);

// The same with a stop token on the call, as a service has (its shutdown or
// the client's disconnect): what carrying cancellation down the stages costs.
void BM_Pipeline_RetryTimeout_Success_WithStop(benchmark::State& state) {
  keel_bench::count_allocations allocs(state);
  static keel::retry_budget budget({.ratio = 0.1});
  static keel::adaptive_timeout timeouts;
  auto pipe = keel::pipeline(keel::time_limit({.at_most = 2s}),
                             keel::retry({.max_attempts = 3, .budget = &budget}), timeouts);
  std::stop_source shutdown;
  for (auto _ : state) {
    const keel::time_point now = keel::real_clock{}.now();
    keel::call call(now, {.timeout = 3s, .response_reserve = 200ms, .stop = shutdown.get_token()});
    absl::StatusOr<int> r = pipe.run(call, now, provider{});
    benchmark::DoNotOptimize(r);
  }
}
BENCHMARK(BM_Pipeline_RetryTimeout_Success_WithStop)->Threads(1)->Threads(2);

// One attempt's deadline armed on the timer and disarmed before it passes:
// what keel::cut_at_deadline adds per attempt beside its stop source. The
// deadline is far away, so the timer thread sleeps through the loop.
void BM_DeadlineTimer_ArmDisarm(benchmark::State& state) {
  keel_bench::count_allocations allocs(state);
  static keel::deadline_timer timer;
  std::stop_source source;
  const keel::deadline d = keel::deadline::after(keel::real_clock{}.now(), 60s);
  keel::deadline_cut cut;
  for (auto _ : state) {
    cut.arm(timer, d, source);
    benchmark::DoNotOptimize(cut.disarm());
  }
}
BENCHMARK(BM_DeadlineTimer_ArmDisarm)->Threads(1)->Threads(2);

// BM_Pipeline_RetryTimeout_Success with keel::cut_at_deadline next to the
// provider: the attempt's own stop token (reused per thread), linked to the
// caller's, armed on the timer at the attempt's deadline and disarmed.
void BM_Pipeline_CutAtDeadline_Success(benchmark::State& state) {
  keel_bench::count_allocations allocs(state);
  static keel::retry_budget budget({.ratio = 0.1});
  static keel::adaptive_timeout timeouts;
  static keel::deadline_timer timer;
  auto pipe = keel::pipeline(keel::time_limit({.at_most = 2s}), keel::retry({.max_attempts = 3, .budget = &budget}),
                             timeouts, keel::cut_at_deadline(timer));
  std::stop_source caller;
  for (auto _ : state) {
    const keel::time_point now = keel::real_clock{}.now();
    keel::call call(now, {.timeout = 3s, .response_reserve = 200ms, .stop = caller.get_token()});
    absl::StatusOr<int> r = pipe.run(call, now, provider{});
    benchmark::DoNotOptimize(r);
  }
}
BENCHMARK(BM_Pipeline_CutAtDeadline_Success)->Threads(1)->Threads(2);

void BM_Backoff_FullJitter(benchmark::State& state) {
  keel_bench::count_allocations allocs(state);
  const keel::full_jitter backoff{.base = 100ms, .cap = 10s};
  const keel::thread_local_random random;
  int k = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(backoff.delay(k, {}, random));
    k = (k + 1) & 7;
  }
}
BENCHMARK(BM_Backoff_FullJitter);

// The retry path's budget check; the floor is high enough that it always
// admits, so this is the cost of a granted retry (count, sum, compare).
void BM_RetryBudget_TryAcquire(benchmark::State& state) {
  keel_bench::count_allocations allocs(state);
  static keel::retry_budget budget({.ratio = 1.0, .min_per_second = 1e12});
  const keel::time_point now = keel::real_clock{}.now();
  for (auto _ : state) benchmark::DoNotOptimize(budget.try_acquire_retry(now));
}
BENCHMARK(BM_RetryBudget_TryAcquire)->Threads(1)->Threads(2);

}  // namespace
