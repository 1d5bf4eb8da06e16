// The protection components' costs: the closed breaker's allow + record,
// a bulkhead slot beside a bare std::counting_semaphore, an adaptive limit's
// permit and the adaptive throttle's decision, the token bucket,
// admission across two levels, and the full protection pipeline around a
// trivial provider. Names are stable; see docs/benchmarks.md.
#include <chrono>
#include <semaphore>

#include <benchmark/benchmark.h>

#include "keel/compose/executor.hpp"
#include "keel/compose/fallback.hpp"
#include "keel/compose/hedge.hpp"
#include "keel/compose/pipeline.hpp"
#include "keel/core/call.hpp"
#include "keel/policy/adaptive_limit.hpp"
#include "keel/policy/adaptive_throttle.hpp"
#include "keel/policy/adaptive_timeout.hpp"
#include "keel/policy/admission.hpp"
#include "keel/policy/breaker_registry.hpp"
#include "keel/policy/chaos.hpp"
#include "keel/policy/bulkhead.hpp"
#include "keel/policy/circuit_breaker.hpp"
#include "keel/policy/rate_limiter.hpp"
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

BENCHMARK(BM_Baseline_TimedCall);

// A closed breaker: admit, then record a success (count window, 100 calls).
void BM_Breaker_Closed_AllowRecord(benchmark::State& state) {
  keel_bench::count_allocations allocs(state);
  static keel::circuit_breaker breaker({.name = "bench"});
  const keel::time_point now = keel::real_clock{}.now();
  for (auto _ : state) {
    keel::breaker_permit p = breaker.try_acquire(now);
    p.record(keel::outcome_kind::success, now);
    benchmark::DoNotOptimize(p);
  }
}
BENCHMARK(BM_Breaker_Closed_AllowRecord)->Threads(1)->Threads(2);

// The baseline: a bare counting semaphore, acquire + release.
void BM_Baseline_CountingSemaphore(benchmark::State& state) {
  keel_bench::count_allocations allocs(state);
  static std::counting_semaphore<1 << 20> sem(1 << 20);
  for (auto _ : state) {
    sem.acquire();
    benchmark::ClobberMemory();
    sem.release();
  }
}
BENCHMARK(BM_Baseline_CountingSemaphore)->Threads(1)->Threads(2);

// A bulkhead slot taken and given back (the permit's constructor and
// destructor), with the completed count the semaphore does not keep.
void BM_Bulkhead_AcquireRelease(benchmark::State& state) {
  keel_bench::count_allocations allocs(state);
  static keel::bulkhead pools({.classes = {{.name = "interactive", .capacity = 24}, {.name = "batch", .capacity = 8}}});
  for (auto _ : state) {
    keel::bulkhead_permit p = pools.try_acquire(0);
    benchmark::DoNotOptimize(p);
  }
}
BENCHMARK(BM_Bulkhead_AcquireRelease)->Threads(1)->Threads(2);

// An adaptive limit's permit taken and given back with a latency sample
// (fixed latency and time, so no clock read): one load and one CAS to take,
// a decrement and a CAS on the window to give back, and once per 32 samples
// the limit's update under its mutex. Compare with BM_Bulkhead_AcquireRelease.
void BM_AdaptiveLimiter_AcquireRelease(benchmark::State& state) {
  keel_bench::count_allocations allocs(state);
  static keel::adaptive_limit limit({.initial_limit = 64, .max_limit = 1000});
  const keel::time_point now = keel::real_clock{}.now();
  for (auto _ : state) {
    keel::adaptive_limit_permit p = limit.try_acquire(0);
    benchmark::DoNotOptimize(p);
    p.release(1ms, now, keel::limit_sample::ok);
  }
}
BENCHMARK(BM_AdaptiveLimiter_AcquireRelease)->Threads(1)->Threads(2);

// The throttle's decision for a healthy provider (probability 0: no draw):
// the sum of the window's buckets.
void BM_AdaptiveThrottle_Allow(benchmark::State& state) {
  keel_bench::count_allocations allocs(state);
  static keel::adaptive_throttle throttle({});
  const keel::time_point now = keel::real_clock{}.now();
  for (auto _ : state) benchmark::DoNotOptimize(throttle.allow(0, now));
}
BENCHMARK(BM_AdaptiveThrottle_Allow)->Threads(1)->Threads(2);

// The same and the outcome recorded: the throttle's whole cost per call.
void BM_AdaptiveThrottle_AllowRecord(benchmark::State& state) {
  keel_bench::count_allocations allocs(state);
  static keel::adaptive_throttle throttle({});
  const keel::time_point now = keel::real_clock{}.now();
  for (auto _ : state) {
    const bool ok = throttle.allow(0, now);
    benchmark::DoNotOptimize(ok);
    throttle.record(now, true);
  }
}
BENCHMARK(BM_AdaptiveThrottle_AllowRecord)->Threads(1)->Threads(2);

// One token from a bucket that always has one (one CAS).
void BM_RateLimiter_TryAcquire(benchmark::State& state) {
  keel_bench::count_allocations allocs(state);
  static keel::rate_limiter limiter({.rate = 1e9, .burst = 1e12});
  const keel::time_point now = keel::real_clock{}.now();
  for (auto _ : state) benchmark::DoNotOptimize(limiter.try_acquire(now));
}
BENCHMARK(BM_RateLimiter_TryAcquire)->Threads(1)->Threads(2);

// Admission at two levels (tenant rate + in flight, model in flight),
// looked up by key, then released.
void BM_Admission_AdmitRelease(benchmark::State& state) {
  keel_bench::count_allocations allocs(state);
  static keel::admission quotas({.tenant_defaults = {.rate = 1e9, .burst = 1e12, .max_in_flight = 1000},
                                 .model_defaults = {.max_in_flight = 1000}});
  const keel::time_point now = keel::real_clock{}.now();
  for (auto _ : state) {
    keel::admission::refusal_reason why;
    keel::admission_ticket t = quotas.try_admit({.tenant = "acme", .model = "m-large"}, now, why);
    benchmark::DoNotOptimize(t);
  }
}
BENCHMARK(BM_Admission_AdmitRelease)->Threads(1)->Threads(2);

// Admission + bulkhead + breaker as pipeline policies, without the
// time-reading policies: the protection layer's own share of the full
// pipeline (one clock read, by the pipeline, plus the call's construction).
void BM_Pipeline_Protection_Success(benchmark::State& state) {
  keel_bench::count_allocations allocs(state);
  static keel::admission quotas({.tenant_defaults = {.rate = 1e9, .burst = 1e12, .max_in_flight = 1000},
                                 .model_defaults = {.max_in_flight = 1000}});
  static keel::bulkhead pools({.classes = {{.name = "interactive", .capacity = 24}, {.name = "batch", .capacity = 8}}});
  static keel::circuit_breaker breaker({.name = "llm"});
  auto pipe = keel::pipeline(quotas, pools, breaker);
  const keel::labels labels{.tenant = "acme", .model = "m-large", .work_class = "interactive"};
  // Calls made from one time read outside the loop: their deadline must
  // outlast the whole run, or they would all fail as expired.
  const keel::time_point now = keel::real_clock{}.now();
  for (auto _ : state) {
    keel::call call(now, {.timeout = 24h, .response_reserve = 200ms, .labels = labels});
    absl::StatusOr<int> r = pipe.run(call, provider{});
    benchmark::DoNotOptimize(r);
  }
}
BENCHMARK(BM_Pipeline_Protection_Success)->Threads(1)->Threads(2);

// The figure: deadline (time_limit) + quota (tenant and model) +
// bulkhead + breaker + retry with budget + adaptive timeout around a trivial
// provider; a new call per request, as in a service. Compare with
// BM_Pipeline_RetryTimeout_Success (keel_bench_core), the same without the
// three protection policies.
//
// Every level is resolved by handle, as the issue asks ("labels resolved
// once per call site, not per call"): the model and the work class where
// the pipeline is built (a call site serves one model and one class), the
// tenant once per client session (admission::tenant_key), carried by the
// service's request and read by the admission stage. _TenantByLabel looks
// the tenant up by the call's label (this benchmark's form until the fourth
// pass); _ByLabel looks up all three per call.
// What a service's request might carry: its tenant resolved once per
// client session (admission::tenant_key), read by the admission stage.
struct session_request {
  const keel::admission_key* tenant = nullptr;
};

enum class resolved { by_label, at_call_site, with_session };

template <resolved How>
void run_full_pipeline(benchmark::State& state) {
  keel_bench::count_allocations allocs(state);
  static keel::admission quotas({.tenant_defaults = {.rate = 1e9, .burst = 1e12, .max_in_flight = 1000},
                                 .model_defaults = {.max_in_flight = 1000}});
  static keel::bulkhead pools({.classes = {{.name = "interactive", .capacity = 24}, {.name = "batch", .capacity = 8}}});
  static keel::circuit_breaker breaker({.name = "llm"});
  static keel::retry_budget budget({.ratio = 0.1});
  static keel::adaptive_timeout timeouts;
  static const keel::admission_key model = *quotas.model_key("m-large", keel::real_clock{}.now());
  static const keel::admission_key tenant = *quotas.tenant_key("acme", keel::real_clock{}.now());
  const session_request session{.tenant = &tenant};
  auto body = [&](const auto& pipe) {
    const keel::labels labels{.tenant = "acme", .model = "m-large", .work_class = "interactive"};
    for (auto _ : state) {
      // One read for the call and its pass, as a service does (run(call, now, ...)),
      // and one when the attempt ends: the two reads of BM_Baseline_TimedCall.
      const keel::time_point now = keel::real_clock{}.now();
      keel::call call(now, {.timeout = 3s, .response_reserve = 200ms, .labels = labels}, session);
      absl::StatusOr<int> r = pipe.run(call, now, provider{});
      benchmark::DoNotOptimize(r);
    }
  };
  if constexpr (How == resolved::with_session) {
    auto tenant_of = keel::from_request<session_request>([](const session_request& r) { return r.tenant; },
                                                         static_cast<const keel::admission_key*>(nullptr));
    body(keel::pipeline(keel::time_limit({.at_most = 2s}), quotas.for_model(model).with_tenant_key(tenant_of),
                        pools.for_class("interactive"), breaker, keel::retry({.max_attempts = 3, .budget = &budget}),
                        timeouts));
  } else if constexpr (How == resolved::at_call_site) {
    body(keel::pipeline(keel::time_limit({.at_most = 2s}), quotas.for_model(model), pools.for_class("interactive"),
                        breaker, keel::retry({.max_attempts = 3, .budget = &budget}), timeouts));
  } else {
    body(keel::pipeline(keel::time_limit({.at_most = 2s}), quotas, pools, breaker,
                        keel::retry({.max_attempts = 3, .budget = &budget}), timeouts));
  }
}
void BM_Pipeline_Full_Success(benchmark::State& state) { run_full_pipeline<resolved::with_session>(state); }
BENCHMARK(BM_Pipeline_Full_Success)->Threads(1)->Threads(2);
void BM_Pipeline_Full_Success_TenantByLabel(benchmark::State& state) {
  run_full_pipeline<resolved::at_call_site>(state);
}
BENCHMARK(BM_Pipeline_Full_Success_TenantByLabel)->Threads(1)->Threads(2);
void BM_Pipeline_Full_Success_ByLabel(benchmark::State& state) { run_full_pipeline<resolved::by_label>(state); }
BENCHMARK(BM_Pipeline_Full_Success_ByLabel)->Threads(1)->Threads(2);

// Chaos stages (keel/policy/chaos.hpp) as a drill leaves them between
// drills: a fault and a latency stage next to the provider, switched off.
// BM_Chaos_Without is the same pipeline without them, in the same run: the
// difference is what "off" costs (one relaxed load per stage).
// BM_Chaos_On_Fault is a fault injected on every call, outermost: the
// labels checked, one draw, the status copied (its representation shared),
// nothing inward run.
keel::circuit_breaker& chaos_bench_breaker() {
  static keel::circuit_breaker breaker({.name = "chaos-bench"});
  return breaker;
}
keel::retry_budget& chaos_bench_budget() {
  static keel::retry_budget budget({.ratio = 0.1});
  return budget;
}
keel::adaptive_timeout& chaos_bench_timeouts() {
  static keel::adaptive_timeout timeouts;
  return timeouts;
}

template <class Pipe>
void run_chaos_bench(benchmark::State& state, const Pipe& pipe) {
  keel_bench::count_allocations allocs(state);
  const keel::labels labels{.tenant = "acme", .model = "m-large", .work_class = "interactive"};
  for (auto _ : state) {
    const keel::time_point now = keel::real_clock{}.now();
    keel::call call(now, {.timeout = 3s, .response_reserve = 200ms, .labels = labels});
    absl::StatusOr<int> r = pipe.run(call, now, provider{});
    benchmark::DoNotOptimize(r);
  }
}

void BM_Chaos_Without(benchmark::State& state) {
  run_chaos_bench(state, keel::pipeline(keel::time_limit({.at_most = 2s}), chaos_bench_breaker(),
                                        keel::retry({.max_attempts = 3, .budget = &chaos_bench_budget()}),
                                        chaos_bench_timeouts()));
}
BENCHMARK(BM_Chaos_Without)->Threads(1)->Threads(2);

void BM_Chaos_Off(benchmark::State& state) {
  static keel::chaos_fault fault({.name = "drill-fault", .rate = 0.05});
  static keel::chaos_latency slow({.name = "drill-latency", .rate = 0.05, .delay = 800ms});
  run_chaos_bench(state, keel::pipeline(keel::time_limit({.at_most = 2s}), chaos_bench_breaker(),
                                        keel::retry({.max_attempts = 3, .budget = &chaos_bench_budget()}),
                                        chaos_bench_timeouts(), fault, slow));
}
BENCHMARK(BM_Chaos_Off)->Threads(1)->Threads(2);

// The same two stages, off, outermost instead of next to the provider.
void BM_Chaos_Off_Outermost(benchmark::State& state) {
  static keel::chaos_fault fault({.name = "drill-fault", .rate = 0.05});
  static keel::chaos_latency slow({.name = "drill-latency", .rate = 0.05, .delay = 800ms});
  run_chaos_bench(state, keel::pipeline(fault, slow, keel::time_limit({.at_most = 2s}), chaos_bench_breaker(),
                                        keel::retry({.max_attempts = 3, .budget = &chaos_bench_budget()}),
                                        chaos_bench_timeouts()));
}
BENCHMARK(BM_Chaos_Off_Outermost)->Threads(1)->Threads(2);

void BM_Chaos_On_Fault(benchmark::State& state) {
  static keel::chaos_fault fault({.name = "drill-fault", .enabled = true, .rate = 1.0,
                                  .when = {.tenant = "acme", .model = "m-large"}});
  run_chaos_bench(state, keel::pipeline(fault, keel::time_limit({.at_most = 2s}), chaos_bench_breaker(),
                                        keel::retry({.max_attempts = 3, .budget = &chaos_bench_budget()}),
                                        chaos_bench_timeouts()));
}
BENCHMARK(BM_Chaos_On_Fault)->Threads(1)->Threads(2);

// The seed's whole plan, built once, outer to inner: fallback (a small model
// behind a residency gate, then cached feedback) + admission + bulkhead +
// time_limit + hedge (p95, one hedge, budgeted) + retry + breaker registry +
// adaptive timeout around the trivial provider, on the real clock. The
// primary answers at once, so the hedge is armed but never starts and the
// fallback never runs (examples/seed_timeline.cpp tells the failure story).
//
// The hedge runs its primary on the executor by default (the caller returns
// as soon as any attempt answers acceptably, even when the primary ignores
// its stop token): a thread hand-off per call. _PrimaryOnCaller runs the
// primary on the caller's thread (no hand-off; a winning hedge then waits
// for the primary to return).
template <bool PrimaryOnCaller>
void seed_plan_success(benchmark::State& state) {
  keel_bench::count_allocations allocs(state);
  static keel::admission quotas({.tenant_defaults = {.rate = 1e9, .burst = 1e12, .max_in_flight = 1000},
                                 .model_defaults = {.max_in_flight = 1000}});
  static keel::bulkhead pools({.classes = {{.name = "interactive", .capacity = 24},
                                           {.name = "batch", .capacity = 8},
                                           {.name = "recovery", .capacity = 8}}});
  static keel::retry_budget budget({.ratio = 0.1});
  static keel::bounded_pool hedge_pool({.threads = 2, .queue_capacity = 8});
  // The learned p95 of a provider that answers at once is ~0; min_delay keeps
  // a descheduled caller on this loaded machine from being hedged.
  static keel::hedge hedger({.delay = 400ms, .percentile = 0.95, .min_delay = 100ms, .max_hedges = 1,
                             .budget = &budget, .deposit_requests = false, .min_attempt_time = 500ms,
                             .primary_on_caller_thread = PrimaryOnCaller},
                            hedge_pool);
  static keel::breaker_registry breakers({});
  static keel::adaptive_timeout timeouts;
  static provider small_model;
  static auto cached = [](const keel::attempt&) -> absl::StatusOr<int> { return 0; };
  // The call site's model and class, resolved once (as BM_Pipeline_Full_Success).
  static const keel::admission_key model = *quotas.model_key("m-large", keel::real_clock{}.now());
  // Built once, like the parts: the fallback's gate list is its one allocation.
  static const auto pipe = keel::pipeline(
      keel::fallback({keel::gate("residency",
                                 [](const keel::labels& call, const keel::path& p) {
                                   return call.region.empty() || call.region == p.labels.region;
                                 })},
                     keel::alternate("small-model", small_model, {.labels = {.region = "eu"}, .at_most = 3s}),
                     keel::alternate("cached-feedback", cached, {.provider_call = false})),
      quotas.for_model(model), pools.for_class("interactive"), keel::time_limit({.at_most = 1000ms}), hedger,
      keel::retry({.max_attempts = 2, .budget = &budget, .min_attempt_time = 500ms}), breakers, timeouts);
  const keel::labels labels{.tenant = "acme", .model = "m-large", .endpoint = "api.provider", .region = "eu",
                            .work_class = "interactive"};
  for (auto _ : state) {
    // One read for the call and its pass, as a service does (run(call, now, ...)),
    // and one when the attempt ends: the two reads of BM_Baseline_TimedCall.
    const keel::time_point now = keel::real_clock{}.now();
    keel::call call(now, {.timeout = 3s, .response_reserve = 200ms, .labels = labels});
    absl::StatusOr<int> r = pipe.run(call, now, provider{});
    benchmark::DoNotOptimize(r);
  }
  state.counters["hedges"] = static_cast<double>(hedger.figures().hedges_started);
}
void BM_Pipeline_SeedPlan_Success(benchmark::State& state) { seed_plan_success<false>(state); }
void BM_Pipeline_SeedPlan_Success_PrimaryOnCaller(benchmark::State& state) { seed_plan_success<true>(state); }
BENCHMARK(BM_Pipeline_SeedPlan_Success)->Threads(1)->Threads(2);
BENCHMARK(BM_Pipeline_SeedPlan_Success_PrimaryOnCaller)->Threads(1)->Threads(2);

}  // namespace
