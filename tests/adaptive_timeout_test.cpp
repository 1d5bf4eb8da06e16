// keel::adaptive_timeout: the seed's formula, the deadline clip, skipping
// attempts that cannot finish, and censored samples.
#include "keel/policy/adaptive_timeout.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "keel/compose/pipeline.hpp"
#include "keel/core/call.hpp"
#include "keel/policy/latency_tracker.hpp"
#include "keel/policy/retry.hpp"
#include "keel/testing/manual_clock.hpp"
#include "keel/testing/scripted_provider.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;
using keel::testing::manual_clock;
using keel::testing::scripted_provider;
namespace kt = keel::testing;

namespace {
keel::duration ms(long long n) { return std::chrono::duration_cast<keel::duration>(std::chrono::milliseconds(n)); }

// 100 samples whose nearest-rank p99 is exactly 800 ms.
void feed_p99_800(keel::adaptive_timeout& t) {
  for (int i = 0; i < 98; ++i) t.record(500ms);
  t.record(800ms);
  t.record(2000ms);
}

const keel::adaptive_timeout_options seed{
    .margin = 200ms, .lower = 500ms, .upper = 1500ms, .min_samples = 20, .refresh_every = 1};
}  // namespace

TEST_CASE("the seed's figures: p99 800 ms + 200 ms margin within 500-1500 ms is 1000 ms", "[timeout][seed]") {
  keel::adaptive_timeout timeouts(seed);
  feed_p99_800(timeouts);
  REQUIRE(timeouts.observed() == ms(800));
  CHECK(timeouts.current() == ms(1000));
  CHECK(timeouts.attempt_timeout(5s) == ms(1000));
  // 700 ms left with a 200 ms reserve: at most 500 ms.
  CHECK(timeouts.attempt_timeout(700ms - 200ms) == ms(500));
  // Less than the lower bound: the attempt cannot plausibly finish.
  CHECK_FALSE(timeouts.attempt_timeout(650ms - 200ms).has_value());
  CHECK(seed.desired(100ms) == ms(500));   // clamped up to the lower bound
  CHECK(seed.desired(1900ms) == ms(1500));  // and down to the upper
}

TEST_CASE("through a pipeline the attempt gets the clipped timeout, or is skipped", "[timeout][seed]") {
  manual_clock clock;
  keel::adaptive_timeout timeouts(seed);
  feed_p99_800(timeouts);
  auto pipe = keel::pipeline(timeouts).in(keel::environment{clock});
  scripted_provider<int> provider(clock, {kt::answer(1, 100ms)});

  keel::call roomy(clock.now(), {.timeout = 3s, .response_reserve = 200ms});
  REQUIRE(pipe.run(roomy, provider).ok());
  CHECK(provider.attempts().back().timeout == ms(1000));

  keel::call tight(clock.now(), {.timeout = 700ms, .response_reserve = 200ms});
  REQUIRE(pipe.run(tight, provider).ok());
  CHECK(provider.attempts().back().timeout == ms(500));

  keel::call too_tight(clock.now(), {.timeout = 650ms, .response_reserve = 200ms});
  const absl::StatusOr<int> skipped = pipe.run(too_tight, provider);
  CHECK(skipped.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(keel::not_started(skipped.status()));  // "not processed", not "unknown"
  CHECK(std::string(skipped.status().message()).find("attempt not started") != std::string::npos);
  CHECK(provider.calls() == 2);  // the skipped attempt never reached the provider
  CHECK(too_tight.record().attempts == 0);
}

TEST_CASE("a skipped attempt is not retried by an outer layer", "[timeout]") {
  manual_clock clock;
  clock.auto_advance(true);
  keel::adaptive_timeout timeouts(seed);
  scripted_provider<int> provider(clock, {kt::answer(1)});
  auto pipe = keel::pipeline(keel::retry({.max_attempts = 5}), timeouts).in(keel::environment{clock});
  keel::call call(clock.now(), {.timeout = 400ms});
  const keel::time_point t0 = clock.now();
  CHECK_FALSE(pipe.run(call, provider).ok());
  CHECK(provider.calls() == 0);
  CHECK(clock.now() == t0);  // no backoff was slept for nothing
}

TEST_CASE("before min_samples the initial timeout is used", "[timeout]") {
  keel::adaptive_timeout timeouts({.initial = 1200ms, .min_samples = 20});
  for (int i = 0; i < 19; ++i) timeouts.record(100ms);
  CHECK_FALSE(timeouts.observed().has_value());
  CHECK(timeouts.current() == ms(1200));
  timeouts.record(100ms);
  CHECK(timeouts.observed() == ms(100));
  CHECK(timeouts.current() == ms(500));  // 100 + 200 margin, clamped up to the lower bound
}

TEST_CASE("timeouts cannot ratchet the estimate past the upper bound", "[timeout]") {
  manual_clock clock;
  keel::adaptive_timeout timeouts({.margin = 200ms, .lower = 500ms, .upper = 1500ms, .initial = 1s,
                                   .min_samples = 16, .samples = 64, .refresh_every = 16});
  auto pipe = keel::pipeline(timeouts).in(keel::environment{clock});
  scripted_provider<int> outage(clock, {kt::stall()});
  keel::duration previous = timeouts.current();
  for (int i = 0; i < 400; ++i) {
    keel::call call(clock.now(), {.timeout = 1h});
    CHECK(pipe.run(call, outage).status().code() == absl::StatusCode::kDeadlineExceeded);
    const keel::duration now = timeouts.current();
    CHECK(now <= ms(1500));
    CHECK(now - previous <= ms(200));  // at most one margin per refresh
    previous = now;
  }
  CHECK(timeouts.current() == ms(1500));
  for (const keel::attempt& a : outage.attempts()) CHECK(a.timeout <= ms(1500));

  // Recovery: fast answers fill the window and bring the estimate back down.
  scripted_provider<int> healthy(clock, {kt::answer(1, 200ms)});
  for (int i = 0; i < 64; ++i) {
    keel::call call(clock.now(), {.timeout = 1h});
    REQUIRE(pipe.run(call, healthy).ok());
  }
  CHECK(timeouts.current() == ms(500));
}

TEST_CASE("recording from many threads keeps the estimate within the samples", "[timeout][concurrency]") {
  keel::adaptive_timeout timeouts({.min_samples = 16, .samples = 256, .refresh_every = 8});
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 20000; ++i) timeouts.record(std::chrono::milliseconds(100 + (i + t) % 200));
    });
  }
  for (auto& th : threads) th.join();
  const auto p = timeouts.observed();
  REQUIRE(p.has_value());
  CHECK(*p >= ms(100));
  CHECK(*p <= ms(299));
}

TEST_CASE("invalid adaptive timeout options are refused with the field named", "[timeout][options]") {
  auto message = [](const keel::adaptive_timeout_options& o) { return std::string(o.validate().message()); };
  CHECK(message({.lower = 0ms}) == "adaptive_timeout_options.lower must be > 0 (got 0s)");
  CHECK(message({.lower = 2s, .upper = 1s, .initial = 1s}) ==
        "adaptive_timeout_options.upper must be >= lower (got 1s < 2s)");
  CHECK(message({.percentile = 1.0}).find("percentile") != std::string::npos);
  CHECK(message({.margin = -1ms}).find("margin") != std::string::npos);
  CHECK(message({.initial = 5s}).find("initial") != std::string::npos);
  CHECK(message({.min_samples = 0}).find("min_samples") != std::string::npos);
  CHECK(message({.samples = 8}).find("samples") != std::string::npos);
  CHECK(message({.samples = 300}) == "adaptive_timeout_options.samples must be a power of two in [16, 65536] (got 300)");
  CHECK(message({.refresh_every = 48}).find("refresh_every") != std::string::npos);
  CHECK(message({.refresh_every = 0}).find("refresh_every") != std::string::npos);
  CHECK_THROWS_AS(keel::adaptive_timeout({.lower = -1s}), keel::invalid_options);
  CHECK(keel::adaptive_timeout_options{}.validate().ok());
}

TEST_CASE("observed() follows recent samples: after 100 it does not still reflect the first 64", "[timeout]") {
  // The defaults: refresh_every 64 over a window of 256.
  keel::adaptive_timeout timeouts({.min_samples = 20});
  for (int i = 0; i < 64; ++i) timeouts.record(100ms);
  REQUIRE(timeouts.observed() == ms(100));
  for (int i = 0; i < 36; ++i) timeouts.record(900ms);  // the dependency slowed down
  // p99 over what was recorded is 900 ms; the estimate must have seen it.
  CHECK(timeouts.observed() == ms(900));
  CHECK(timeouts.latencies().recorded() == 100);
}

TEST_CASE("a latency_tracker lags at most an eighth of its samples while its window fills", "[timeout][tracker]") {
  keel::latency_tracker p50({.percentile = 0.5, .samples = 1024, .min_samples = 1, .refresh_every = 256});
  int checked = 0;
  for (int n = 1; n <= 2048; ++n) {
    p50.record(ms(n));
    // The true median of 1..n (nearest rank) is ceil(n / 2) ms, over at most the last 1024.
    const long long seen = std::min(n, 1024);
    const long long truth = n - seen + (seen + 1) / 2;
    const long long lag_allowed = std::min<long long>(256, std::max<long long>(1, n / 8));
    const long long got = p50.percentile()->count() / 1'000'000;
    if (got > truth || truth - got > lag_allowed) FAIL("n = " << n << ": median " << got << " ms, truth " << truth);
    ++checked;
  }
  CHECK(checked == 2048);
}

TEST_CASE("a refused attempt says how much time was left in units people read", "[timeout][describe]") {
  manual_clock clock;
  keel::adaptive_timeout timeouts(seed);
  auto pipe = keel::pipeline(timeouts).in(keel::environment{clock});
  scripted_provider<int> provider(clock, {kt::answer(1)});
  keel::call call(clock.now(), {.timeout = std::chrono::nanoseconds(299'995'796)});
  const absl::StatusOr<int> r = pipe.run(call, provider);
  CHECK(std::string(r.status().message()) == "keel: attempt not started: 299.996ms left, below the 500ms an attempt needs");

  using keel::detail::describe;
  CHECK(describe(std::chrono::nanoseconds(299'995'796)) == "299.996ms");
  CHECK(describe(2s) == "2s");
  CHECK(describe(1500ms) == "1.5s");
  CHECK(describe(750us) == "750us");
  CHECK(describe(std::chrono::nanoseconds(1'001)) == "1.001us");
  CHECK(describe(std::chrono::nanoseconds(999)) == "999ns");
  CHECK(describe(std::chrono::nanoseconds(999'999'600)) == "1s");  // rounds into the next unit
  CHECK(describe(-1500ms) == "-1.5s");
  CHECK(describe(0s) == "0s");
  CHECK(describe(2h) == "7200s");
}

// Every refresh is exact (nearest rank over the window), whatever the last
// one left: heavy tails, ties, and a window that jumps up and then down
// below everything it held, for a small top k (p99 of 256: the heap) and a
// large one (p50 and p95 of 512: the candidates above the last floor).
TEST_CASE("a latency_tracker's every refresh is the exact percentile of its window", "[timeout][tracker]") {
  for (const double q : {0.99, 0.95, 0.5}) {
    const int samples = q == 0.99 ? 256 : 512;
    keel::latency_tracker t({.percentile = q, .samples = samples, .min_samples = samples, .refresh_every = 1});
    std::vector<long long> window;
    std::uint64_t x = 88172645463325252ull;  // xorshift: the same sequence every run
    auto next = [&] {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      return static_cast<long long>(x % 1000);
    };
    int checked = 0;
    for (int i = 0; i < 6 * samples; ++i) {
      const int phase = i / samples;
      long long v = next();
      if (phase == 1) v = v % 4;                   // ties: four values
      if (phase == 2) v = 1'000'000 + v * v * v;   // far above, heavy-tailed
      if (phase == 3) v = v % 7;                   // below everything the last floor saw
      t.record(std::chrono::nanoseconds(v));
      window.push_back(v);
      if (window.size() > static_cast<std::size_t>(samples)) window.erase(window.begin());
      if (window.size() < static_cast<std::size_t>(samples)) continue;
      std::vector<long long> sorted = window;
      std::sort(sorted.begin(), sorted.end());
      const auto rank = static_cast<std::size_t>(std::ceil(q * static_cast<double>(samples)));
      const long long truth = sorted[rank - 1];
      if (t.percentile()->count() != truth)
        FAIL("q " << q << ", sample " << i << ": " << t.percentile()->count() << " != " << truth);
      ++checked;
    }
    CHECK(checked == 5 * samples + 1);
  }
}
