// Heap allocations per iteration, reported as the "allocs/iter" counter.
// The benchmark binaries replace global operator new (alloc_counter.cpp).
#pragma once

#include <cstdint>

#include <benchmark/benchmark.h>

namespace keel_bench {

std::int64_t thread_allocations() noexcept;
// False in sanitizer builds, where operator new belongs to the sanitizer.
bool allocations_counted() noexcept;

// Open for the whole benchmark loop; reports when it closes.
class count_allocations {
 public:
  explicit count_allocations(benchmark::State& state) noexcept : state_(state), start_(thread_allocations()) {}
  ~count_allocations() {
    state_.counters["allocs/iter"] = benchmark::Counter(static_cast<double>(thread_allocations() - start_),
                                                        benchmark::Counter::kAvgIterations);
  }
  count_allocations(const count_allocations&) = delete;
  count_allocations& operator=(const count_allocations&) = delete;

 private:
  benchmark::State& state_;
  std::int64_t start_;
};

}  // namespace keel_bench
