// stream_ttft_sim: what first-token hedging (keel::stream_guard with
// stream_options::hedge_delay) does to time to first token on a
// heavy-tailed streaming provider, against the extra streams it starts.
//
// Real threads, real time, latencies scaled down ~1:10 from what hosted
// models show so a run takes seconds:
//
//   each stream, independently: time to first token 97% 10 ms + exp(mean
//   3 ms), 3% queued for 100-400 ms (a cold replica, a long prefill queue);
//   then 16 tokens 1 ms apart. Stops are honoured at once.
//
// The same requests run three ways: no hedge, a hedge at a fixed delay (the
// p95 time to first token measured without hedging) and at the learned p95.
// One hedge at most per stream, spending a keel::retry_budget (10% of
// requests). It prints p50, p99, p99.9 and max of the caller's time to first
// token (from the call's start to the first token relayed) and of the whole
// stream, and the extra streams started.
//
//   build/h/bench/keel_stream_ttft_sim
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "keel/compose/executor.hpp"
#include "keel/compose/pipeline.hpp"
#include "keel/compose/stream.hpp"
#include "keel/core/call.hpp"
#include "keel/core/clock.hpp"
#include "keel/policy/retry.hpp"
#include "keel/policy/retry_budget.hpp"

using namespace std::chrono_literals;

namespace {

constexpr int kRequests = 3000;
constexpr int kCallers = 16;
constexpr int kTokens = 16;

std::atomic<std::uint64_t> seeds{0x5eed};
std::atomic<std::int64_t> streams{0};

keel::duration ms(double v) {
  return std::chrono::duration_cast<keel::duration>(std::chrono::duration<double, std::milli>(v));
}

keel::duration draw_ttft() {
  thread_local std::mt19937_64 rng(seeds.fetch_add(0x9e3779b97f4a7c15ULL));
  std::uniform_real_distribution<double> u(0.0, 1.0);
  if (u(rng) < 0.03) return ms(100.0 + 300.0 * u(rng));
  std::exponential_distribution<double> tail(1.0 / 3.0);
  return ms(10.0 + tail(rng));
}

absl::Status provider(const keel::attempt&, keel::stream_writer& w) {
  streams.fetch_add(1, std::memory_order_relaxed);
  const keel::real_clock clock;
  keel::time_point t = clock.now() + draw_ttft();
  for (int i = 0; i < kTokens; ++i) {
    if (!clock.sleep_until(t, w.stop_token())) return absl::CancelledError("stopped");
    if (!w.token(" tok", clock.now())) return absl::CancelledError("stopped");
    t += 1ms;
  }
  return absl::OkStatus();
}

struct result {
  std::vector<double> ttft_ms, total_ms;
  std::int64_t streams = 0;
  double seconds = 0;
};

template <class Guard>
result run(Guard& guard) {
  streams = 0;
  std::atomic<int> next{0};
  std::vector<result> per_caller(kCallers);
  const auto t0 = std::chrono::steady_clock::now();
  const auto pipe = keel::pipeline(keel::retry({.max_attempts = 2}));
  {
    std::vector<std::thread> callers;
    for (int c = 0; c < kCallers; ++c) {
      callers.emplace_back([&, c] {
        result& mine = per_caller[static_cast<std::size_t>(c)];
        while (next.fetch_add(1) < kRequests) {
          const keel::time_point start = keel::real_clock{}.now();
          keel::time_point first{};
          keel::call call(start, {.timeout = 5s});
          keel::token_stream stream(guard, [&](std::string_view) {
            if (first == keel::time_point{}) first = keel::real_clock{}.now();
          });
          auto p = &provider;
          const absl::StatusOr<keel::stream_result> r = pipe.run(call, stream.attempts(p));
          const keel::time_point end = keel::real_clock{}.now();
          if (!r.ok() || !r->complete) {
            std::fprintf(stderr, "request failed: %s\n", std::string(r.status().message()).c_str());
            std::exit(1);
          }
          mine.ttft_ms.push_back(std::chrono::duration<double, std::milli>(first - start).count());
          mine.total_ms.push_back(std::chrono::duration<double, std::milli>(end - start).count());
        }
      });
    }
    for (std::thread& t : callers) t.join();
  }
  result out;
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (auto& v : per_caller) {
    out.ttft_ms.insert(out.ttft_ms.end(), v.ttft_ms.begin(), v.ttft_ms.end());
    out.total_ms.insert(out.total_ms.end(), v.total_ms.begin(), v.total_ms.end());
  }
  std::sort(out.ttft_ms.begin(), out.ttft_ms.end());
  std::sort(out.total_ms.begin(), out.total_ms.end());
  out.streams = streams.load();
  return out;
}

double percentile(const std::vector<double>& sorted, double p) {
  const auto rank = static_cast<std::size_t>(std::ceil(p * static_cast<double>(sorted.size())));
  return sorted[std::max<std::size_t>(rank, 1) - 1];
}

void print(const char* name, const result& r) {
  const std::int64_t extra = r.streams - static_cast<std::int64_t>(r.ttft_ms.size());
  std::printf("%-30s %6.1f %7.1f %7.1f %7.1f | %7.1f %7.1f   %5lld (%4.1f%%)   [%.1f s]\n", name,
              percentile(r.ttft_ms, 0.50), percentile(r.ttft_ms, 0.99), percentile(r.ttft_ms, 0.999), r.ttft_ms.back(),
              percentile(r.total_ms, 0.50), percentile(r.total_ms, 0.99), static_cast<long long>(extra),
              100.0 * static_cast<double>(extra) / static_cast<double>(r.ttft_ms.size()), r.seconds);
}

}  // namespace

int main() {
  std::printf("first-token hedging simulation: real threads and real time, latencies scaled ~1:10\n");
  std::printf("each stream: first token 97%% after 10 ms + exp(mean 3 ms), 3%% after 100-400 ms; then %d tokens 1 ms apart\n",
              kTokens);
  std::printf("%d requests from %d concurrent callers; hedges on a keel::bounded_pool of 32 threads\n\n", kRequests,
              kCallers);
  std::printf("%-30s %6s %7s %7s %7s | %7s %7s   %s\n", "run (ms)", "ttft50", "ttft99", "ttft999", "max", "all50",
              "all99", "extra streams");

  const keel::stream_options budgets{.first_token = 2s, .stall = 1s};
  double p95 = 0;
  {
    keel::stream_guard guard(budgets);
    const result plain = run(guard);
    print("no hedge", plain);
    p95 = percentile(plain.ttft_ms, 0.95);
  }
  keel::bounded_pool pool({.threads = 32, .queue_capacity = 256});
  {
    keel::retry_budget budget({.ratio = 0.1, .min_per_second = 10});
    keel::stream_options o = budgets;
    o.hedge_delay = ms(p95);
    o.budget = &budget;
    keel::stream_guard guard(o, pool);
    const result r = run(guard);
    char name[64];
    std::snprintf(name, sizeof name, "hedge @ fixed p95 (%.1f ms)", p95);
    print(name, r);
  }
  {
    keel::retry_budget budget({.ratio = 0.1, .min_per_second = 10});
    keel::stream_options o = budgets;
    o.hedge_delay = 20ms;
    o.hedge_percentile = 0.95;
    o.budget = &budget;
    keel::stream_guard guard(o, pool);
    const result r = run(guard);
    char name[64];
    std::snprintf(name, sizeof name, "hedge @ learned p95 (%.1f ms)",
                  std::chrono::duration<double, std::milli>(guard.current_hedge_delay()).count());
    print(name, r);
  }
  return 0;
}
