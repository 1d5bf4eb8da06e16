// Fan-out and hedging costs, each beside a baseline measured in the same run:
//
//   BM_FanOut_8Units_AllCached   a rerun whose 8 units are all in the
//                                in-memory store: 8 loads, no work
//   BM_FanOut_8Units_Fresh       8 units run on a 4-thread pool, each result
//                                validated and saved
//   BM_Baseline_Pool_8Tasks      the executor alone: 8 empty tasks through the
//                                same pool and a wait for them
//   BM_Executor_TaskRoundTrip    one task made, queued, taken, run and
//                                destroyed, on one thread (no pool)
//   BM_Baseline_Store_8Saves     the store alone: 8 saves and 8 loads inline
//   BM_Hedge_PrimaryWins         a hedged pipeline whose primary answers
//                                before the delay (the primary runs on the
//                                pool; the caller waits for it)
//   BM_Hedge_PrimaryWins_OnCallerThread
//                                the same with primary_on_caller_thread
//   BM_Hedge_Baseline_NoHedge    the same provider through a pipeline
//                                without the hedge
//
// allocs/iter counts the calling thread's allocations only (pool threads
// allocate the saved strings). Names are stable; see docs/benchmarks.md.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <benchmark/benchmark.h>

#include "absl/functional/any_invocable.h"
#include "absl/strings/str_cat.h"
#include "keel/compose/executor.hpp"
#include "keel/compose/hedge.hpp"
#include "keel/compose/pipeline.hpp"
#include "keel/core/call.hpp"
#include "keel/durable/digest.hpp"
#include "keel/durable/fan_out.hpp"
#include "keel/policy/retry_budget.hpp"
#include "keel/store/memory.hpp"
#include "support/alloc_counter.hpp"
#include "support/baselines.hpp"

using namespace std::chrono_literals;

namespace {

using panel_t = keel::fan_out<std::string, keel::memory_store, keel::bounded_pool>;

std::vector<keel::unit> eight_units(std::string_view facts) {
  std::vector<keel::unit> units;
  for (int i = 0; i < 8; ++i) {
    const std::string model = absl::StrCat("model-", i);
    units.push_back({.name = model,
                     .key = keel::digest_builder().field("facts", facts).field("model", model).field("rubric", "r1").finish()});
  }
  return units;
}

absl::Status has_score(const std::string& r) {
  return r.rfind("score:", 0) == 0 ? absl::OkStatus() : absl::InvalidArgumentError("no score");
}

auto trivial_worker() {
  return [](const keel::unit_context& u) -> absl::StatusOr<std::string> {
    return absl::StrCat("score:", u.index);
  };
}

void BM_FanOut_8Units_AllCached(benchmark::State& state) {
  keel::memory_store store;
  keel::bounded_pool pool({.threads = 4, .queue_capacity = 64});
  panel_t panel({.width = 8, .validator = has_score}, store, pool);
  const std::vector<keel::unit> units = eight_units("product-1");
  {
    keel::call warm(keel::real_clock{}.now(), {.timeout = 10s});
    if (!panel.run(warm, units, trivial_worker()).status().ok()) state.SkipWithError("warm-up failed");
  }
  keel_bench::count_allocations allocs(state);
  for (auto _ : state) {
    keel::call call(keel::real_clock{}.now(), {.timeout = 10s});
    keel::fan_out_report<std::string> r = panel.run(call, units, trivial_worker());
    if (r.count(keel::unit_state::cached) != 8) state.SkipWithError("not all cached");
    benchmark::DoNotOptimize(r);
  }
}
BENCHMARK(BM_FanOut_8Units_AllCached);

void BM_FanOut_8Units_Fresh(benchmark::State& state) {
  keel::memory_store store;
  keel::bounded_pool pool({.threads = 4, .queue_capacity = 64});
  panel_t panel({.width = 8, .validator = has_score}, store, pool);
  const std::vector<keel::unit> units = eight_units("product-2");
  std::vector<std::string> keys;
  for (const keel::unit& u : units) keys.push_back(panel.key_of(u));
  keel_bench::count_allocations allocs(state);
  for (auto _ : state) {
    keel::call call(keel::real_clock{}.now(), {.timeout = 10s});
    keel::fan_out_report<std::string> r = panel.run(call, units, trivial_worker());
    if (r.count(keel::unit_state::succeeded) != 8) state.SkipWithError("not all fresh");
    benchmark::DoNotOptimize(r);
    state.PauseTiming();  // forget the results so the next run is fresh again
    for (const std::string& k : keys) (void)store.erase_result(k);
    state.ResumeTiming();
  }
}
BENCHMARK(BM_FanOut_8Units_Fresh)->UseRealTime();

// The executor alone: 8 tasks handed to the same kind of pool, then a wait.
// Each task captures one pointer, as a task should to be stored inline.
void BM_Baseline_Pool_8Tasks(benchmark::State& state) {
  keel::bounded_pool pool({.threads = 4, .queue_capacity = 64});
  struct countdown {
    std::mutex mu;
    std::condition_variable done;
    int left = 0;
  } c;
  keel_bench::count_allocations allocs(state);
  for (auto _ : state) {
    {
      std::lock_guard lock(c.mu);
      c.left = 8;
    }
    for (int i = 0; i < 8; ++i) {
      (void)pool.try_execute([&c] {
        std::lock_guard lock(c.mu);
        if (--c.left == 0) c.done.notify_one();
      });
    }
    std::unique_lock lock(c.mu);
    c.done.wait(lock, [&] { return c.left == 0; });
  }
}
BENCHMARK(BM_Baseline_Pool_8Tasks)->UseRealTime();

// One task's life in the executor apart from locking and waking: made from
// a callable of keel's shape (an object and an index), moved into the queue
// and out, run once, destroyed.
void BM_Executor_TaskRoundTrip(benchmark::State& state) {
  std::vector<absl::AnyInvocable<void() &&>> ring(1);
  int hits = 0;
  std::size_t index = 1;
  keel_bench::count_allocations allocs(state);
  for (auto _ : state) {
    benchmark::DoNotOptimize(index);
    ring[0] = [&hits, index] { hits += static_cast<int>(index); };
    absl::AnyInvocable<void() &&> taken = std::move(ring[0]);
    benchmark::DoNotOptimize(taken);
    std::move(taken)();
    taken = nullptr;
  }
  benchmark::DoNotOptimize(hits);
}
BENCHMARK(BM_Executor_TaskRoundTrip);

// The store alone: what saving and loading 8 results costs inline.
void BM_Baseline_Store_8Saves(benchmark::State& state) {
  keel::memory_store store;
  std::vector<std::string> keys;
  for (const keel::unit& u : eight_units("product-3")) keys.push_back("fanout:" + u.key.hex());
  keel_bench::count_allocations allocs(state);
  for (auto _ : state) {
    for (std::size_t i = 0; i < keys.size(); ++i) {
      benchmark::DoNotOptimize(store.save_result(keys[i], absl::StrCat("score:", i), {}));
      benchmark::DoNotOptimize(store.load_result(keys[i]));
    }
    state.PauseTiming();
    for (const std::string& k : keys) (void)store.erase_result(k);
    state.ResumeTiming();
  }
}
BENCHMARK(BM_Baseline_Store_8Saves);

using provider = keel_bench::trivial_provider;

// A new call per request, then the hedge's race, the timer armed and
// disarmed, no hedge (the delay is 1 s). By default the primary is handed to
// the pool and waited for; _OnCallerThread runs it on the calling thread.
template <bool PrimaryOnCaller>
void hedge_primary_wins(benchmark::State& state) {
  static keel::bounded_pool pool({.threads = 2, .queue_capacity = 64});
  static keel::retry_budget budget({.ratio = 0.1});
  static keel::hedge hedger(
      {.delay = 1s, .max_hedges = 1, .budget = &budget, .primary_on_caller_thread = PrimaryOnCaller}, pool);
  auto pipe = keel::pipeline(hedger);
  keel_bench::count_allocations allocs(state);
  for (auto _ : state) {
    keel::call call(keel::real_clock{}.now(), {.timeout = 3s});
    absl::StatusOr<int> r = pipe.run(call, provider{});
    benchmark::DoNotOptimize(r);
  }
}
void BM_Hedge_PrimaryWins(benchmark::State& state) { hedge_primary_wins<false>(state); }
void BM_Hedge_PrimaryWins_OnCallerThread(benchmark::State& state) { hedge_primary_wins<true>(state); }
BENCHMARK(BM_Hedge_PrimaryWins)->Threads(1)->Threads(2);
BENCHMARK(BM_Hedge_PrimaryWins_OnCallerThread)->Threads(1)->Threads(2);

void BM_Hedge_Baseline_NoHedge(benchmark::State& state) {
  auto pipe = keel::pipeline();
  keel_bench::count_allocations allocs(state);
  for (auto _ : state) {
    keel::call call(keel::real_clock{}.now(), {.timeout = 3s});
    absl::StatusOr<int> r = pipe.run(call, provider{});
    benchmark::DoNotOptimize(r);
  }
}
BENCHMARK(BM_Hedge_Baseline_NoHedge)->Threads(1)->Threads(2);

}  // namespace
