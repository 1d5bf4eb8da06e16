// cut_latency: how long after its deadline a provider that watches only its
// stop token returns, when keel::deadline_timer cuts it. Real clock, real
// threads; each figure is (time the caller got its answer) - (deadline).
//
//   attempt   keel::cut_at_deadline below a time_limit of 2 ms; 4 threads
//             calling at once, 500 attempts each
//   hedge     keel::hedge (1 hedge after 1 ms) with hedge_options::cut, both
//             attempts stalled, call deadline 4 ms; 500 calls
//   fan_out   keel::fan_out of 2 stalled units with unit_at_most 3 ms and
//             fan_out_options::cut; 500 runs (1000 units; the figure is
//             per run, when the report came back)
//
// Prints p50, p99 and max in microseconds. A shared 2-vCPU machine: the
// tail is the scheduler's as much as keel's.
//
//   build/<dir>/bench/keel_cut_latency
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

#include "keel/compose/cut_at_deadline.hpp"
#include "keel/compose/executor.hpp"
#include "keel/compose/hedge.hpp"
#include "keel/compose/pipeline.hpp"
#include "keel/core/call.hpp"
#include "keel/core/clock.hpp"
#include "keel/durable/digest.hpp"
#include "keel/durable/fan_out.hpp"
#include "keel/policy/time_limit.hpp"
#include "keel/store/memory.hpp"

#include "async.hpp"  // tests/support: block_until_stopped

using namespace std::chrono_literals;

namespace {

using keel_test::block_until_stopped;

absl::StatusOr<int> stall(const keel::attempt& a) {
  block_until_stopped(a.stop);
  return absl::CancelledError("stopped");
}

void report(const char* what, std::vector<keel::duration> late, int cut) {
  std::sort(late.begin(), late.end());
  auto us = [](keel::duration d) { return std::chrono::duration<double, std::micro>(d).count(); };
  auto at = [&](double q) { return late[std::min(late.size() - 1, static_cast<std::size_t>(q * late.size()))]; };
  std::printf("%-8s n=%-5zu cut=%-5d p50 %8.1f us   p99 %8.1f us   max %8.1f us\n", what, late.size(), cut,
              us(at(0.50)), us(at(0.99)), us(late.back()));
}

void attempts(keel::deadline_timer<>& timer) {
  constexpr int threads = 4, each = 500;
  auto pipe = keel::pipeline(keel::time_limit({.at_most = 2ms}), keel::cut_at_deadline(timer));
  std::vector<std::vector<keel::duration>> late(threads);
  std::vector<int> cut(threads, 0);
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      for (int i = 0; i < each; ++i) {
        const keel::time_point now = keel::real_clock{}.now();
        keel::call call(now, {.timeout = 10s});
        absl::StatusOr<int> r = pipe.run(call, now, stall);
        late[t].push_back(keel::real_clock{}.now() - (now + 2ms));
        if (r.status().code() == absl::StatusCode::kDeadlineExceeded) ++cut[t];
      }
    });
  }
  for (auto& w : workers) w.join();
  std::vector<keel::duration> all;
  int cuts = 0;
  for (int t = 0; t < threads; ++t) {
    all.insert(all.end(), late[t].begin(), late[t].end());
    cuts += cut[t];
  }
  report("attempt", std::move(all), cuts);
}

void hedges(keel::deadline_timer<>& timer) {
  keel::bounded_pool pool({.threads = 4});
  keel::hedge hedger({.delay = 1ms, .max_hedges = 1, .cut = true}, pool, timer);
  auto pipe = keel::pipeline(hedger);
  std::vector<keel::duration> late;
  int cuts = 0;
  for (int i = 0; i < 500; ++i) {
    const keel::time_point now = keel::real_clock{}.now();
    keel::call call(now, {.timeout = 4ms});
    absl::StatusOr<int> r = pipe.run(call, now, stall);
    late.push_back(keel::real_clock{}.now() - (now + 4ms));
    if (r.status().code() == absl::StatusCode::kDeadlineExceeded) ++cuts;
  }
  report("hedge", std::move(late), cuts);
}

void fan_outs(keel::deadline_timer<>& timer) {
  keel::memory_store store;
  keel::bounded_pool pool({.threads = 2});
  keel::fan_out<std::string, keel::memory_store, keel::bounded_pool> panel(
      {.width = 2, .unit_at_most = 3ms, .cut = &timer}, store, pool);
  std::vector<keel::unit> units;
  for (const char* n : {"a", "b"}) units.push_back({.name = n, .key = keel::digest_builder().field("u", n).finish()});
  std::vector<keel::duration> late;
  int cuts = 0;
  for (int i = 0; i < 500; ++i) {
    const keel::time_point now = keel::real_clock{}.now();
    keel::call call(now, {.timeout = 10s});
    keel::fan_out_report<std::string> r =
        panel.run(call, units, [](const keel::unit_context& u) -> absl::StatusOr<std::string> {
          block_until_stopped(u.stop);
          return absl::CancelledError("stopped");
        });
    // Each unit's deadline is its start + 3 ms; the first starts at `now`
    // or just after: measured from now + 3 ms, so this slightly overstates.
    late.push_back(keel::real_clock{}.now() - (now + 3ms));
    for (const auto& u : r.units)
      if (u.status.code() == absl::StatusCode::kDeadlineExceeded) ++cuts;
  }
  report("fan_out", std::move(late), cuts);
}

}  // namespace

int main() {
  keel::deadline_timer timer;
  attempts(timer);
  hedges(timer);
  fan_outs(timer);
  const keel::deadline_timer_figures f = timer.figures();
  std::printf("timer: %lld stops requested, %lld early wake-ups\n", static_cast<long long>(f.fired),
              static_cast<long long>(f.wakeups));
  return 0;
}
