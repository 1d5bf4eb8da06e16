// The yardsticks every pipeline benchmark is read against, shared so that
// each binary measures them in the same run as its own figures:
//
//   trivial_provider            the provider every pipeline benchmark wraps
//   BM_Baseline_SteadyClockNow  one steady_clock read (a pipeline makes two)
//   BM_Baseline_TimedCall       trivial_provider called directly between two
//                               clock reads, as a hand-timed call would be: a
//                               pipeline's cost over this is what keel adds
//
//   using keel_bench::BM_Baseline_TimedCall;
//   BENCHMARK(BM_Baseline_TimedCall);   // registered under that name
//
// Thread-safety: each benchmark runs on its own benchmark threads.
#pragma once

#include <chrono>

#include <benchmark/benchmark.h>

#include "absl/status/statusor.h"
#include "keel/core/call.hpp"
#include "keel/core/clock.hpp"
#include "support/alloc_counter.hpp"

namespace keel_bench {

struct trivial_provider {
  absl::StatusOr<int> operator()(const keel::attempt& a) const { return a.number; }
};

inline void BM_Baseline_SteadyClockNow(benchmark::State& state) {
  count_allocations allocs(state);
  for (auto _ : state) benchmark::DoNotOptimize(keel::real_clock{}.now());
}

inline void BM_Baseline_TimedCall(benchmark::State& state) {
  count_allocations allocs(state);
  keel::call call(keel::real_clock{}.now(), {.timeout = std::chrono::seconds(3)});
  const keel::attempt a{.owner = &call};
  trivial_provider p;
  for (auto _ : state) {
    const std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(start);
    benchmark::DoNotOptimize(a);
    absl::StatusOr<int> r = p(a);
    benchmark::DoNotOptimize(r);
    const std::chrono::steady_clock::time_point end = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(end);
  }
}

}  // namespace keel_bench
