// keel::slo_tracker and keel::error_budget: the 100,000-at-99.9 % example,
// configured eligibility, separate indicators, the rolling window on the
// manual clock, several classes, concurrency and the metrics it exports.
#include "keel/observe/slo.hpp"

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "keel/observe/metrics.hpp"
#include "keel/observe/prometheus.hpp"
#include "keel/testing/manual_clock.hpp"
#include "support/alloc_counter.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;
using keel::counts_as;
using keel::request_outcome;
using keel::testing::manual_clock;

namespace {

keel::slo_options interactive_options() {
  return {.target = 0.999,
          .window = 1h,
          .window_buckets = 60,
          .rejected = counts_as::bad,
          .partial = counts_as::good,
          .abandoned = counts_as::not_eligible};
}

bool contains(const std::string& haystack, std::string_view needle) {
  return haystack.find(needle) != std::string::npos;
}

}  // namespace

TEST_CASE("100,000 eligible requests at 99.9% leave a budget of 100 failures", "[slo][seed]") {
  const keel::error_budget b = keel::error_budget::compute(0.999, 100'000, 0);
  CHECK(b.eligible == 100'000);
  CHECK(b.allowed == 100);
  CHECK(b.remaining == 100);
  CHECK(b.remaining_ratio() == 1.0);
  CHECK_FALSE(b.exhausted());

  // The same through a tracker: 99,960 good and 40 failed requests.
  manual_clock clock;
  keel::work_class_slo slo("interactive", interactive_options());
  for (int i = 0; i < 99'960; ++i) slo.record(request_outcome::success, 20ms, clock.now());
  for (int i = 0; i < 40; ++i) slo.record(request_outcome::failure, 3s, clock.now());
  const keel::slo_report r = slo.report(clock.now());
  CHECK(r.availability.eligible == 100'000);
  CHECK(r.availability.allowed == 100);
  CHECK(r.availability.bad == 40);
  CHECK(r.availability.remaining == 60);
  CHECK(r.availability.remaining_ratio() == Approx(0.6));
  CHECK(r.availability.sli() == Approx(0.9996));
}

TEST_CASE("error budgets are exact where floating point is not", "[slo]") {
  CHECK(keel::error_budget::compute(0.9, 10, 0).allowed == 1);        // 10 * 0.1 in doubles is 0.99999...
  CHECK(keel::error_budget::compute(0.99, 100, 0).allowed == 1);
  CHECK(keel::error_budget::compute(0.999, 999, 0).allowed == 0);     // floor: 0.999 of a failure is none
  CHECK(keel::error_budget::compute(0.999, 1'000, 0).allowed == 1);
  CHECK(keel::error_budget::compute(0.9999, 3'000'000'000'000, 0).allowed == 300'000'000);
  CHECK(keel::error_budget::compute(0.95, 7, 0).allowed == 0);
  const auto over = keel::error_budget::compute(0.99, 990, 10);
  CHECK(over.allowed == 10);
  CHECK(over.remaining == 0);
  CHECK(over.exhausted());
  CHECK(over.remaining_ratio() == Approx(0.0).margin(1e-12));
  const auto overspent = keel::error_budget::compute(0.99, 985, 15);
  CHECK(overspent.remaining == -5);
  CHECK(overspent.remaining_ratio() == Approx(-0.5));
  const auto none = keel::error_budget::compute(0.99, 0, 0);
  CHECK(none.sli() == 1.0);
  CHECK(none.remaining_ratio() == 1.0);
  CHECK_FALSE(none.exhausted());
}

TEST_CASE("what rejected, partial and abandoned requests count as is configured, not assumed", "[slo]") {
  // One mix of outcomes, judged under each configuration.
  struct mix {
    int success = 1000, partial = 50, failure = 5, rejected = 30, abandoned = 7;
  } m;
  auto judge = [&](counts_as rejected, counts_as partial, counts_as abandoned) {
    manual_clock clock;
    keel::work_class_slo slo("c", {.target = 0.99, .window = 1min, .window_buckets = 6, .rejected = rejected,
                                   .partial = partial, .abandoned = abandoned});
    const std::pair<request_outcome, int> plan[] = {{request_outcome::success, m.success},
                                                    {request_outcome::partial, m.partial},
                                                    {request_outcome::failure, m.failure},
                                                    {request_outcome::rejected, m.rejected},
                                                    {request_outcome::abandoned, m.abandoned}};
    for (const auto& [o, n] : plan)
      for (int i = 0; i < n; ++i) slo.record(o, 10ms, clock.now());
    return slo.report(clock.now());
  };
  const counts_as rules[] = {counts_as::good, counts_as::bad, counts_as::not_eligible};
  for (counts_as rej : rules) {
    for (counts_as par : rules) {
      for (counts_as ab : rules) {
        const keel::slo_report r = judge(rej, par, ab);
        std::int64_t good = m.success, bad = m.failure;
        for (auto [rule, n] : {std::pair{rej, m.rejected}, std::pair{par, m.partial}, std::pair{ab, m.abandoned}}) {
          if (rule == counts_as::good) good += n;
          if (rule == counts_as::bad) bad += n;
        }
        INFO("rejected " << keel::to_string(rej) << ", partial " << keel::to_string(par) << ", abandoned "
                         << keel::to_string(ab));
        CHECK(r.availability.good == good);
        CHECK(r.availability.bad == bad);
        CHECK(r.availability.eligible == good + bad);
        CHECK(r.availability.allowed == (good + bad) / 100);
        // The separate indicators do not depend on the configuration.
        CHECK(r.in_window.rejected == m.rejected);
        CHECK(r.in_window.partial == m.partial);
        CHECK(r.in_window.requests() == 1092);
      }
    }
  }
  // Spot check: rejections are failures here, not excluded.
  const keel::slo_report strict = judge(counts_as::bad, counts_as::bad, counts_as::bad);
  CHECK(strict.availability.bad == 5 + 30 + 50 + 7);
  CHECK(strict.availability.exhausted());
  const keel::slo_report lenient = judge(counts_as::not_eligible, counts_as::good, counts_as::not_eligible);
  CHECK(lenient.availability.eligible == 1055);
  CHECK(lenient.availability.bad == 5);
  CHECK_FALSE(lenient.availability.exhausted());
}

TEST_CASE("leaving a rule unset is refused at construction", "[slo][options]") {
  keel::slo_options o = interactive_options();
  o.partial = counts_as::unset;
  CHECK_THROWS_WITH(keel::work_class_slo("c", o),
                    "slo_options.partial must be set to good, bad or not_eligible (got unset)");
  keel::slo_options defaults;  // nothing chosen: refused, the first missing rule named
  CHECK(std::string(defaults.validate().message()) ==
        "slo_options.rejected must be set to good, bad or not_eligible (got unset)");
  o = interactive_options();
  o.abandoned = static_cast<counts_as>(42);
  CHECK_THROWS_AS(keel::work_class_slo("c", o), keel::invalid_options);

  o = interactive_options();
  o.target = 1.0;
  CHECK_THROWS_WITH(keel::work_class_slo("c", o), "slo_options.target must be in (0, 1) (got 1)");
  o = interactive_options();
  o.window = 0s;
  CHECK_THROWS_WITH(keel::work_class_slo("c", o), "slo_options.window must be > 0 (got 0s)");
  o = interactive_options();
  o.window_buckets = 0;
  CHECK_THROWS_WITH(keel::work_class_slo("c", o), "slo_options.window_buckets must be in [1, 100000] (got 0)");
  o = interactive_options();
  o.latency_threshold = 1s;
  o.latency_target = 0;
  CHECK_THROWS_WITH(keel::work_class_slo("c", o), "slo_options.latency_target must be in (0, 1) (got 0)");
  o = interactive_options();
  o.latency.precision_bits = 20;
  CHECK_THROWS_WITH(keel::work_class_slo("c", o),
                    "latency_histogram_options.precision_bits must be in [1, 12] (got 20)");
}

TEST_CASE("the window rolls in steps on the manual clock", "[slo][window]") {
  manual_clock clock;  // starts on a whole number of seconds
  keel::work_class_slo slo("c", {.target = 0.99, .window = 60s, .window_buckets = 6, .rejected = counts_as::bad,
                                 .partial = counts_as::good, .abandoned = counts_as::not_eligible});
  const keel::time_point t0 = clock.now();
  clock.advance(1s);
  for (int i = 0; i < 10; ++i) slo.record(request_outcome::failure, 1ms, clock.now());
  clock.advance(20s);  // t0 + 21 s
  for (int i = 0; i < 100; ++i) slo.record(request_outcome::success, 1ms, clock.now());

  clock.set(t0 + 59s);
  auto r = slo.report(clock.now());
  CHECK(r.availability.bad == 10);
  CHECK(r.availability.good == 100);

  clock.set(t0 + 60s);  // the first bucket [t0, t0 + 10 s) has left the window
  r = slo.report(clock.now());
  CHECK(r.availability.bad == 0);
  CHECK(r.availability.good == 100);
  CHECK(r.since_start.failure == 10);  // still counted since start

  clock.set(t0 + 79s);
  CHECK(slo.report(clock.now()).availability.good == 100);
  clock.set(t0 + 80s);
  CHECK(slo.report(clock.now()).availability.eligible == 0);

  // A bucket reused after a full turn starts from zero.
  for (int i = 0; i < 3; ++i) slo.record(request_outcome::rejected, 1ms, clock.now());
  r = slo.report(clock.now());
  CHECK(r.in_window.rejected == 3);
  CHECK(r.in_window.success == 0);
  CHECK(r.since_start.success == 100);
}

TEST_CASE("a clock stepping backwards loses no request", "[slo][window]") {
  manual_clock clock;
  keel::work_class_slo slo("c", interactive_options());
  const keel::time_point t0 = clock.now();
  slo.record(request_outcome::success, 1ms, t0 + 10min);
  slo.record(request_outcome::failure, 1ms, t0);  // earlier than the last record
  const auto r = slo.report(t0 + 10min);
  CHECK(r.in_window.requests() == 2);
  CHECK(r.availability.bad == 1);
}

TEST_CASE("latency is its own objective, over answered requests only", "[slo][latency]") {
  manual_clock clock;
  keel::slo_options o = interactive_options();
  o.latency_threshold = 300ms;
  o.latency_target = 0.99;
  keel::work_class_slo slo("interactive", o);
  for (int i = 0; i < 985; ++i) slo.record(request_outcome::success, 120ms, clock.now());
  for (int i = 0; i < 10; ++i) slo.record(request_outcome::success, 2s, clock.now());
  for (int i = 0; i < 5; ++i) slo.record(request_outcome::partial, 900ms, clock.now());
  for (int i = 0; i < 400; ++i) slo.record(request_outcome::rejected, 1ms, clock.now());  // fast, but not answers
  const keel::slo_report r = slo.report(clock.now());
  REQUIRE(r.latency.has_value());
  CHECK(r.latency->eligible == 1000);
  CHECK(r.latency->good == 985);
  CHECK(r.latency->allowed == 10);
  CHECK(r.latency->remaining == -5);
  CHECK(r.latency->exhausted());
  // Availability is judged separately: the answers were all good, the 400 rejections bad.
  CHECK(r.availability.bad == 400);
  CHECK(r.rejection_ratio() == Approx(400.0 / 1400.0));
  CHECK(r.partial_ratio() == Approx(5.0 / 1000.0));
  // The distribution holds the answers, not the rejections' 1 ms.
  CHECK(r.latency_distribution.count() == 1000);
  CHECK(r.latency_distribution.percentile(0.5) >= 120ms);
  CHECK(r.latency_distribution.percentile(0.5) <= 121ms);
  CHECK(r.latency_distribution.percentile(0.995) >= 2s);

  keel::slo_options none = interactive_options();
  keel::work_class_slo no_latency("c", none);
  no_latency.record(request_outcome::success, 10s, clock.now());
  CHECK_FALSE(no_latency.report(clock.now()).latency.has_value());
}

TEST_CASE("work classes are tracked apart; unknown classes are an error", "[slo]") {
  manual_clock clock;
  keel::slo_tracker slos({{"interactive", interactive_options()},
                          {"batch",
                           {.target = 0.99,
                            .window = 1h,
                            .window_buckets = 12,
                            .rejected = counts_as::not_eligible,
                            .partial = counts_as::bad,
                            .abandoned = counts_as::not_eligible}}});
  for (int i = 0; i < 50; ++i) REQUIRE(slos.record("batch", request_outcome::rejected, 1ms, clock.now()).ok());
  for (int i = 0; i < 5; ++i) REQUIRE(slos.record("batch", request_outcome::partial, 1s, clock.now()).ok());
  for (int i = 0; i < 100; ++i) REQUIRE(slos.record("interactive", request_outcome::success, 80ms, clock.now()).ok());
  const absl::Status unknown = slos.record("recovery", request_outcome::success, 1ms, clock.now());
  CHECK(unknown.code() == absl::StatusCode::kNotFound);
  CHECK(contains(std::string(unknown.message()), "\"recovery\""));
  CHECK(slos.find("recovery") == nullptr);

  const auto reports = slos.report(clock.now());
  REQUIRE(reports.size() == 2);
  CHECK(reports[0].work_class == "batch");  // sorted by name
  CHECK(reports[0].availability.eligible == 5);  // rejections not eligible for batch
  CHECK(reports[0].availability.bad == 5);       // partial answers are bad for batch
  CHECK(reports[0].in_window.rejected == 50);
  CHECK(reports[1].work_class == "interactive");
  CHECK(reports[1].availability.bad == 0);
  CHECK(reports[1].in_window.rejected == 0);

  CHECK_THROWS_WITH(keel::slo_tracker({{"a", interactive_options()}, {"a", interactive_options()}}),
                    "slo_class.name must be unique (got \"a\")");
  CHECK_THROWS_WITH(keel::slo_tracker({{"", interactive_options()}}), "slo_class.name must not be empty (got \"\")");
  keel::slo_options bad = interactive_options();
  bad.rejected = counts_as::unset;
  CHECK_THROWS_WITH(keel::slo_tracker({{"batch", bad}}),
                    "work class \"batch\": slo_options.rejected must be set to good, bad or not_eligible (got unset)");
}

TEST_CASE("concurrent recording is counted exactly", "[slo][concurrency]") {
  manual_clock clock;
  keel::slo_options o = interactive_options();
  o.latency_threshold = 100ms;
  keel::work_class_slo slo("c", o);
  constexpr int kThreads = 4, kEach = 5'000;
  std::vector<keel::slo_report> mid;
  std::atomic<bool> done{false};
  std::thread reader([&] {
    while (!done.load()) mid.push_back(slo.report(clock.now()));
  });
  std::vector<std::thread> workers;
  for (int t = 0; t < kThreads; ++t) {
    workers.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) {
        const auto outcome = static_cast<request_outcome>((i + t) % 5);
        slo.record(outcome, i % 2 == 0 ? 50ms : 150ms, clock.now());
        if (t == 0 && i % 1000 == 0) clock.advance(1s);  // time moves while others record
      }
    });
  }
  for (auto& w : workers) w.join();
  done = true;
  reader.join();
  const auto r = slo.report(clock.now());
  CHECK(r.in_window.requests() == kThreads * kEach);
  CHECK(r.in_window.success == kThreads * kEach / 5);
  CHECK(r.in_window.rejected == kThreads * kEach / 5);
  CHECK(r.latency_distribution.count() == static_cast<std::uint64_t>(r.in_window.answered()));
  // Answered (success or partial) are 2 of every 5 outcomes; kEach is a
  // multiple of 10, so exactly half of them have an even i, recorded at 50 ms
  // (within the 100 ms threshold); the odd ones took 150 ms.
  static_assert(kEach % 10 == 0);
  CHECK(r.in_window.answered() == 2 * kThreads * kEach / 5);
  CHECK(r.in_window.fast == kThreads * kEach / 5);
  for (const auto& m : mid) CHECK(m.in_window.requests() <= kThreads * kEach);
}

TEST_CASE("recording a request allocates nothing", "[slo][alloc]") {
  if (!keel_test::allocations_counted()) {
    WARN("allocation counting is off in sanitizer builds; the g++ build asserts it");
    return;
  }
  manual_clock clock;
  keel::slo_tracker slos({{"interactive", interactive_options()}});
  keel::work_class_slo& c = *slos.find("interactive");
  c.record(request_outcome::success, 1ms, clock.now());
  keel_test::count_allocations allocations;
  for (int i = 0; i < 1000; ++i) {
    c.record(static_cast<request_outcome>(i % 5), std::chrono::milliseconds(i), clock.now());
    (void)slos.record("interactive", request_outcome::success, 1ms, clock.now());
  }
  CHECK(allocations.count() == 0);
}

TEST_CASE("SLOs export as metrics that render for Prometheus", "[slo][metrics]") {
  manual_clock clock;
  keel::slo_options o = interactive_options();
  o.latency_threshold = 300ms;
  keel::slo_tracker slos({{"interactive", o}});
  for (int i = 0; i < 99'960; ++i) (void)slos.record("interactive", request_outcome::success, 250ms, clock.now());
  for (int i = 0; i < 40; ++i) (void)slos.record("interactive", request_outcome::failure, 1s, clock.now());

  keel::metrics_registry registry;
  registry.add_collector([&](keel::metrics_snapshot& s) { slos.collect(s, clock.now()); });
  const absl::StatusOr<std::string> text = keel::to_prometheus_text(registry.snapshot());
  REQUIRE(text.ok());
  CHECK(contains(*text, "# TYPE keel_slo_requests_total counter\n"));
  CHECK(contains(*text, "keel_slo_requests_total{class=\"interactive\",outcome=\"failure\"} 40\n"));
  CHECK(contains(*text, "keel_slo_window_requests{class=\"interactive\",outcome=\"success\"} 99960\n"));
  CHECK(contains(*text, "keel_slo_error_budget_allowed{class=\"interactive\",sli=\"availability\"} 100\n"));
  CHECK(contains(*text, "keel_slo_error_budget_remaining{class=\"interactive\",sli=\"availability\"} 60\n"));
  CHECK(contains(*text, "keel_slo_objective{class=\"interactive\",sli=\"availability\"} 0.999\n"));
  CHECK(contains(*text, "keel_slo_ratio{class=\"interactive\",sli=\"latency\"} 1\n"));
  CHECK(contains(*text, "# TYPE keel_slo_latency_seconds summary\n"));
  CHECK(contains(*text, "keel_slo_latency_seconds_count{class=\"interactive\"} 99960\n"));
  CHECK(contains(*text, "keel_slo_latency_seconds{class=\"interactive\",quantile=\"0.99\"} 0.25"));
}
