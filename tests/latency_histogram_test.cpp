// keel::latency_histogram: bucket layout, percentiles against exact ones on
// several distributions (heavy tails included), merging, deltas, concurrent
// recording and allocation-free recording.
#include "keel/observe/latency_histogram.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "support/alloc_counter.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;

namespace {

std::uint64_t ns(keel::duration d) {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(d).count());
}

keel::duration from_ns(std::uint64_t v) {
  return std::chrono::duration_cast<keel::duration>(std::chrono::nanoseconds(static_cast<std::int64_t>(v)));
}

// The true nearest-rank percentile of `sorted`: the smallest value with at
// least q of all values at or below it.
std::uint64_t exact_percentile(const std::vector<std::uint64_t>& sorted, double q) {
  if (q <= 0.0) return sorted.front();
  const auto n = static_cast<double>(sorted.size());
  std::size_t r = 1;
  while (static_cast<double>(r) < q * n * (1 - 1e-12) && r < sorted.size()) ++r;
  return sorted[r - 1];
}

struct distribution {
  std::string name;
  std::function<std::uint64_t(std::mt19937_64&)> draw;
};

std::vector<distribution> distributions() {
  auto clamp_ns = [](double x) {
    return static_cast<std::uint64_t>(std::clamp(x, 0.0, 3.0e12));  // keep below `highest` (1 h)
  };
  return {
      {"uniform 1us..10ms",
       [](std::mt19937_64& g) { return std::uniform_int_distribution<std::uint64_t>(1'000, 10'000'000)(g); }},
      {"exponential mean 5ms",
       [=](std::mt19937_64& g) { return clamp_ns(std::exponential_distribution<double>(1.0 / 5e6)(g)); }},
      {"lognormal median 20ms sigma 1.5 (heavy tail)",
       [=](std::mt19937_64& g) { return clamp_ns(std::lognormal_distribution<double>(std::log(2e7), 1.5)(g)); }},
      {"pareto alpha 1.1 from 1ms (very heavy tail)",
       [=](std::mt19937_64& g) {
         const double u = std::uniform_real_distribution<double>(0.0, 1.0)(g);
         return clamp_ns(1e6 / std::pow(1.0 - u, 1.0 / 1.1));
       }},
      {"bimodal: 95% near 2ms, 5% near 800ms",
       [=](std::mt19937_64& g) {
         const bool slow = std::bernoulli_distribution(0.05)(g);
         return clamp_ns(std::normal_distribution<double>(slow ? 8e8 : 2e6, slow ? 1e8 : 3e5)(g));
       }},
      {"sub-microsecond 0..300ns",
       [](std::mt19937_64& g) { return std::uniform_int_distribution<std::uint64_t>(0, 300)(g); }},
      {"constant 1.5s", [](std::mt19937_64&) { return std::uint64_t{1'500'000'000}; }},
  };
}

const double kQuantiles[] = {0.0, 0.0001, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999, 0.9999, 1.0};

}  // namespace

TEST_CASE("nearest rank is ceil(q * n), robust to rounding", "[latency]") {
  CHECK(keel::detail::nearest_rank(0.99, 100) == 99);
  CHECK(keel::detail::nearest_rank(0.999, 100'000) == 99'900);
  CHECK(keel::detail::nearest_rank(0.5, 4) == 2);
  CHECK(keel::detail::nearest_rank(0.5, 3) == 2);
  CHECK(keel::detail::nearest_rank(1.0, 7) == 7);
  CHECK(keel::detail::nearest_rank(1e-9, 7) == 1);
  // Against integer arithmetic for every q = k / 1000 and n up to 400.
  int mismatches = 0;
  for (std::uint64_t n = 1; n <= 400; ++n) {
    for (std::uint64_t k = 1; k <= 1000; ++k) {
      const std::uint64_t want = (k * n + 999) / 1000;
      if (keel::detail::nearest_rank(static_cast<double>(k) / 1000.0, n) != want) ++mismatches;
    }
  }
  CHECK(mismatches == 0);
}

TEST_CASE("log-linear buckets tile the values with width at most value / 2^bits", "[latency]") {
  for (int p : {1, 3, 7, 10}) {
    const keel::detail::log_linear_layout layout(p, std::uint64_t{1} << 40);
    const std::uint64_t s = std::uint64_t{1} << p;
    int gaps = 0, too_wide = 0, misplaced = 0;
    for (std::size_t i = 0; i + 1 < layout.regular; ++i) {
      if (layout.upper(i) + 1 != layout.lower(i + 1)) ++gaps;
      const std::uint64_t width = layout.upper(i) - layout.lower(i) + 1;
      if (layout.lower(i) >= 2 * s ? width > layout.lower(i) / s : width != 1) ++too_wide;
      if (layout.slot(layout.lower(i)) != i || layout.slot(layout.upper(i)) != i) ++misplaced;
    }
    INFO("precision_bits " << p);
    CHECK(gaps == 0);
    CHECK(too_wide == 0);
    CHECK(misplaced == 0);
    CHECK(layout.lower(0) == 0);
    CHECK(layout.upper(layout.regular - 1) >= (std::uint64_t{1} << 40));  // highest is inside the last bucket
    CHECK(layout.slot((std::uint64_t{1} << 40) + 1) == layout.regular);  // above it: overflow
  }
  // The default layout: 7 bits up to one hour.
  const keel::detail::log_linear_layout d(7, ns(1h));
  CHECK(d.slots() == 4563);
}

TEST_CASE("percentiles are never below the exact ones and within 2^-bits above them", "[latency]") {
  for (int bits : {3, 7, 10}) {
    for (const distribution& dist : distributions()) {
      std::mt19937_64 gen(42);
      keel::latency_histogram h({.precision_bits = bits});
      std::vector<std::uint64_t> values(20'000);
      for (auto& v : values) {
        v = dist.draw(gen);
        h.record(from_ns(v));
      }
      std::sort(values.begin(), values.end());
      const keel::latency_histogram_snapshot s = h.snapshot();
      INFO(dist.name << ", precision_bits " << bits);
      REQUIRE(s.count() == values.size());
      for (double q : kQuantiles) {
        const std::uint64_t exact = exact_percentile(values, q);
        const std::uint64_t got = ns(s.percentile(q));
        INFO("q " << q << ": exact " << exact << " ns, reported " << got << " ns");
        CHECK(got >= exact);
        CHECK(got - exact <= (exact >> bits));  // relative error <= 2^-bits
      }
      CHECK(s.relative_error() == std::ldexp(1.0, -bits));
    }
  }
}

TEST_CASE("count, sum, min and max are exact", "[latency]") {
  keel::latency_histogram h;
  std::mt19937_64 gen(7);
  std::uniform_int_distribution<std::uint64_t> d(0, 5'000'000'000);
  std::uint64_t sum = 0, lo = UINT64_MAX, hi = 0;
  for (int i = 0; i < 10'000; ++i) {
    const std::uint64_t v = d(gen);
    h.record(from_ns(v));
    sum += v;
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  const auto s = h.snapshot();
  CHECK(s.count() == 10'000);
  CHECK(ns(s.sum()) == sum);
  CHECK(ns(s.min()) == lo);
  CHECK(ns(s.max()) == hi);
  CHECK(ns(s.mean()) == sum / 10'000);
  CHECK(s.percentile(0.0) == s.min());
  CHECK(s.percentile(1.0) == s.max());
}

TEST_CASE("an empty histogram reports zeros; negative latencies count as zero", "[latency]") {
  keel::latency_histogram h;
  auto s = h.snapshot();
  CHECK(s.count() == 0);
  CHECK(s.percentile(0.99) == keel::duration::zero());
  CHECK(s.min() == keel::duration::zero());
  CHECK(s.max() == keel::duration::zero());
  h.record(-5ms);
  s = h.snapshot();
  CHECK(s.count() == 1);
  CHECK(s.max() == keel::duration::zero());
}

TEST_CASE("values above `highest` go to the overflow bucket and report max, never below", "[latency]") {
  keel::latency_histogram h({.precision_bits = 7, .highest = 1ms});
  for (int i = 0; i < 90; ++i) h.record(500us);
  for (int i = 0; i < 9; ++i) h.record(2s);
  h.record(7s);
  const auto s = h.snapshot();
  CHECK(s.count() == 100);
  CHECK(ns(s.percentile(0.9)) >= ns(500us));
  CHECK(ns(s.percentile(0.9)) <= ns(500us) + ns(500us) / 128);
  CHECK(s.percentile(0.91) == 7s);  // the true value is 2 s: never below, the bound does not hold here
  CHECK(s.percentile(1.0) == 7s);
  std::vector<std::uint64_t> seen;
  s.for_each_bucket([&](std::uint64_t lower, std::uint64_t upper, std::uint64_t n) {
    seen.push_back(n);
    CHECK(lower <= upper);
  });
  CHECK(seen == std::vector<std::uint64_t>{90, 10});
}

TEST_CASE("merging histograms equals recording everything in one", "[latency]") {
  std::mt19937_64 gen(3);
  std::lognormal_distribution<double> d(std::log(1e7), 2.0);
  keel::latency_histogram all, a, b, coarse_all({.precision_bits = 4});
  keel::latency_histogram fine({.precision_bits = 9});
  for (int i = 0; i < 20'000; ++i) {
    const auto v = from_ns(static_cast<std::uint64_t>(std::min(d(gen), 3e12)));
    all.record(v);
    coarse_all.record(v);
    (i % 3 == 0 ? a : b).record(v);
    if (i % 2 == 0) fine.record(v);
  }
  auto same = [](const keel::latency_histogram_snapshot& x, const keel::latency_histogram_snapshot& y) {
    CHECK(x.count() == y.count());
    CHECK(x.sum() == y.sum());
    CHECK(x.min() == y.min());
    CHECK(x.max() == y.max());
    for (double q : kQuantiles) CHECK(x.percentile(q) == y.percentile(q));
  };

  SECTION("live into live") {
    keel::latency_histogram merged;
    REQUIRE(merged.merge(a).ok());
    REQUIRE(merged.merge(b).ok());
    same(merged.snapshot(), all.snapshot());
  }
  SECTION("snapshots, into an empty default snapshot") {
    keel::latency_histogram_snapshot merged;
    REQUIRE(merged.merge(a.snapshot()).ok());
    REQUIRE(merged.merge(b.snapshot()).ok());
    same(merged, all.snapshot());
  }
  SECTION("a finer histogram merges exactly into a coarser one") {
    keel::latency_histogram coarse({.precision_bits = 4});
    keel::latency_histogram rest({.precision_bits = 4});
    // fine holds the even values; record the odd ones at coarse precision.
    std::mt19937_64 again(3);
    for (int i = 0; i < 20'000; ++i) {
      const auto v = from_ns(static_cast<std::uint64_t>(std::min(d(again), 3e12)));
      if (i % 2 == 1) rest.record(v);
    }
    REQUIRE(coarse.merge(fine).ok());
    REQUIRE(coarse.merge(rest).ok());
    same(coarse.snapshot(), coarse_all.snapshot());
  }
  SECTION("a coarser histogram is refused, not smeared") {
    keel::latency_histogram finer({.precision_bits = 9});
    const absl::Status st = finer.merge(coarse_all);
    CHECK(st.code() == absl::StatusCode::kInvalidArgument);
    CHECK(finer.snapshot().count() == 0);
    auto snap = fine.snapshot();
    CHECK(snap.merge(coarse_all.snapshot()).code() == absl::StatusCode::kInvalidArgument);
  }
}

TEST_CASE("since() gives what was recorded in between, percentiles still never below", "[latency]") {
  keel::latency_histogram h;
  for (int i = 0; i < 1000; ++i) h.record(std::chrono::microseconds(100 + i));
  const auto before = h.snapshot();
  std::vector<std::uint64_t> later;
  std::mt19937_64 gen(11);
  std::exponential_distribution<double> d(1.0 / 3e8);
  for (int i = 0; i < 5000; ++i) {
    const auto v = static_cast<std::uint64_t>(d(gen)) + 1'000'000;
    later.push_back(v);
    h.record(from_ns(v));
  }
  std::sort(later.begin(), later.end());
  const absl::StatusOr<keel::latency_histogram_snapshot> delta = h.snapshot().since(before);
  REQUIRE(delta.ok());
  CHECK(delta->count() == 5000);
  std::uint64_t sum = 0;
  for (auto v : later) sum += v;
  CHECK(ns(delta->sum()) == sum);
  CHECK(ns(delta->min()) <= later.front());
  CHECK(ns(delta->max()) >= later.back());
  for (double q : kQuantiles) {
    if (q == 0.0) continue;  // min() is a bound after since()
    const std::uint64_t exact = exact_percentile(later, q);
    const std::uint64_t got = ns(delta->percentile(q));
    INFO("q " << q);
    CHECK(got >= exact);
    CHECK(got - exact <= (exact >> 7));
  }
  // Swapped order is an error, not a wrap-around.
  CHECK(before.since(h.snapshot()).status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("concurrent recording loses nothing", "[latency][concurrency]") {
  keel::latency_histogram h;
  constexpr int kThreads = 4;
  constexpr int kPerThread = 50'000;
  std::atomic<bool> done{false};
  std::vector<std::uint64_t> reader_counts;
  std::thread reader([&] {
    while (!done.load()) reader_counts.push_back(h.snapshot().count());
  });
  std::vector<std::thread> writers;
  for (int t = 0; t < kThreads; ++t) {
    writers.emplace_back([&h, t] {
      for (int i = 0; i < kPerThread; ++i) h.record(std::chrono::microseconds(1 + (i % 1000) + t));
    });
  }
  for (auto& w : writers) w.join();
  done = true;
  reader.join();

  const auto s = h.snapshot();
  CHECK(s.count() == std::uint64_t{kThreads} * kPerThread);
  std::uint64_t sum = 0;
  for (int t = 0; t < kThreads; ++t)
    for (int i = 0; i < kPerThread; ++i) sum += ns(std::chrono::microseconds(1 + (i % 1000) + t));
  CHECK(ns(s.sum()) == sum);
  CHECK(s.min() == 1us);
  CHECK(s.max() == std::chrono::microseconds(1000 + kThreads - 1));
  CHECK(std::is_sorted(reader_counts.begin(), reader_counts.end()));  // counts only grow
}

TEST_CASE("recording allocates nothing", "[latency][alloc]") {
  if (!keel_test::allocations_counted()) {
    WARN("allocation counting is off in sanitizer builds; the g++ build asserts it");
    return;
  }
  keel::latency_histogram h;
  h.record(1ms);  // the thread's sum stripe is chosen on first use
  keel_test::count_allocations allocations;
  for (int i = 0; i < 10'000; ++i) h.record(std::chrono::microseconds(i * 37));
  CHECK(allocations.count() == 0);
}

TEST_CASE("invalid latency histogram options are refused with the field named", "[latency][options]") {
  CHECK_THROWS_WITH(keel::latency_histogram({.precision_bits = 0}),
                    "latency_histogram_options.precision_bits must be in [1, 12] (got 0)");
  CHECK_THROWS_WITH(keel::latency_histogram({.precision_bits = 13}),
                    "latency_histogram_options.precision_bits must be in [1, 12] (got 13)");
  CHECK_THROWS_WITH(keel::latency_histogram({.highest = keel::duration::zero()}),
                    "latency_histogram_options.highest must be > 0 (got 0s)");
  CHECK_THROWS_AS(keel::latency_histogram_snapshot(keel::latency_histogram_options{.precision_bits = -1}),
                  keel::invalid_options);
}
