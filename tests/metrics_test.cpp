// keel::metrics_registry: families, label handles, name rules, snapshots,
// collectors, concurrency and allocation-free increments.
#include "keel/observe/metrics.hpp"

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "support/alloc_counter.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;

namespace {
const keel::metric_family_snapshot* find(const keel::metrics_snapshot& s, std::string_view name) {
  for (const auto& f : s.families)
    if (f.name == name) return &f;
  return nullptr;
}
}  // namespace

TEST_CASE("counters, gauges and histograms keep their values per label set", "[metrics]") {
  keel::metrics_registry r;
  auto& requests = r.counter({.name = "app_requests_total", .help = "Requests.", .labels = {"class", "outcome"}});
  keel::counter_metric& ok = requests.with({"interactive", "success"});
  ok.inc();
  ok.inc(4);
  requests.with({"batch", "success"}).inc();
  CHECK(&requests.with({"interactive", "success"}) == &ok);  // the same series every time
  CHECK(ok.value() == 5);

  auto& queued = r.gauge({.name = "app_queued", .help = "Queued jobs."});
  queued.with({}).set(7);
  queued.with({}).dec();
  queued.with({}).add(0.5);
  CHECK(queued.with({}).value() == 6.5);

  auto& latency = r.histogram({.name = "app_latency_seconds", .help = "Latency.", .buckets = {0.1, 0.5, 1}});
  auto& h = latency.with({});
  h.observe(50ms);
  h.observe(0.1);   // on a bound: counted in that bucket (le is inclusive)
  h.observe(0.7);
  h.observe(30.0);  // above every bound: +Inf only
  h.observe(std::nan(""));  // ignored

  const keel::metrics_snapshot s = r.snapshot();
  REQUIRE(s.families.size() == 3);
  CHECK(s.families[0].name == "app_latency_seconds");  // sorted by name
  CHECK(s.families[1].name == "app_queued");
  CHECK(s.families[2].name == "app_requests_total");

  const auto* req = find(s, "app_requests_total");
  REQUIRE(req->series.size() == 2);
  CHECK(req->series[0].labels == std::vector<std::string>{"batch", "success"});  // sorted by label values
  CHECK(req->series[0].value == 1);
  CHECK(req->series[1].value == 5);
  CHECK(req->type == keel::metric_type::counter);
  CHECK(req->label_names == std::vector<std::string>{"class", "outcome"});

  const auto* lat = find(s, "app_latency_seconds");
  REQUIRE(lat->series.size() == 1);
  CHECK(lat->bounds == std::vector<double>{0.1, 0.5, 1});
  CHECK(lat->series[0].buckets == std::vector<std::uint64_t>{2, 0, 1, 1});
  CHECK(lat->series[0].count == 4);
  CHECK(lat->series[0].sum == Approx(0.05 + 0.1 + 0.7 + 30.0));
  CHECK(s.validate().ok());
}

TEST_CASE("an unlabelled metric exists from registration; histograms default to latency buckets", "[metrics]") {
  keel::metrics_registry r;
  (void)r.counter({.name = "x_total", .help = "x"});
  (void)r.histogram({.name = "y_seconds", .help = "y", .labels = {"class"}});
  const auto s = r.snapshot();
  REQUIRE(find(s, "x_total")->series.size() == 1);
  CHECK(find(s, "x_total")->series[0].value == 0);
  CHECK(find(s, "y_seconds")->series.empty());  // labelled: series appear when first used
  CHECK(find(s, "y_seconds")->bounds ==
        std::vector<double>(keel::default_latency_buckets.begin(), keel::default_latency_buckets.end()));
}

TEST_CASE("re-registering a name returns the same family or is refused", "[metrics]") {
  keel::metrics_registry r;
  auto& a = r.counter({.name = "hits_total", .help = "Hits.", .labels = {"route"}});
  auto& b = r.counter({.name = "hits_total", .help = "Hits (again).", .labels = {"route"}});
  CHECK(&a == &b);
  CHECK_THROWS_WITH(r.gauge({.name = "hits_total", .help = "h", .labels = {"route"}}),
                    "metric_options.name must be unique across definitions (got \"hits_total\", already a "
                    "counter with labels {route})");
  CHECK_THROWS_AS(r.counter({.name = "hits_total", .help = "h", .labels = {"path"}}), keel::invalid_options);
  (void)r.histogram({.name = "h_seconds", .help = "h", .buckets = {1, 2}});
  CHECK_THROWS_AS(r.histogram({.name = "h_seconds", .help = "h", .buckets = {1, 3}}), keel::invalid_options);
}

TEST_CASE("metric and label names follow Prometheus' rules", "[metrics][options]") {
  keel::metrics_registry r;
  for (const char* good : {"a", "_a", "a_b:c", ":recorded", "A9_"}) {
    INFO(good);
    CHECK_NOTHROW(r.counter({.name = good, .help = "h"}));
  }
  for (const char* bad : {"", "9lives", "a-b", "a b", "caf\xc3\xa9", "a.b"}) {
    INFO(bad);
    CHECK_THROWS_AS(r.counter({.name = bad, .help = "h"}), keel::invalid_options);
  }
  CHECK_THROWS_WITH(r.counter({.name = "a-b", .help = "h"}),
                    "metric_options.name must match [a-zA-Z_:][a-zA-Z0-9_:]* (got \"a-b\")");
  CHECK_THROWS_WITH(r.counter({.name = "ok_total", .help = ""}),
                    "metric_options.help must not be empty (got \"ok_total\")");
  CHECK_THROWS_WITH(r.counter({.name = "c1", .help = "h", .labels = {"__reserved"}}),
                    "metric_options.labels must match [a-zA-Z_][a-zA-Z0-9_]* and not start with __ (got "
                    "\"__reserved\")");
  CHECK_THROWS_AS(r.counter({.name = "c2", .help = "h", .labels = {"a:b"}}), keel::invalid_options);
  CHECK_THROWS_AS(r.counter({.name = "c3", .help = "h", .labels = {"1a"}}), keel::invalid_options);
  CHECK_THROWS_WITH(r.counter({.name = "c4", .help = "h", .labels = {"x", "x"}}),
                    "metric_options.labels must be unique (got \"x\")");
  CHECK_THROWS_WITH(r.histogram({.name = "h1", .help = "h", .labels = {"le"}}),
                    "metric_options.labels must not contain \"le\" in a histogram (got \"le\")");
  CHECK_NOTHROW(r.counter({.name = "c5", .help = "h", .labels = {"le", "_ok", "q9"}}));  // le is fine elsewhere
  CHECK_THROWS_WITH(r.histogram({.name = "h2", .help = "h", .buckets = {1, 1}}),
                    "metric_options.buckets must be strictly increasing (got 1 then 1)");
  CHECK_THROWS_AS(r.histogram({.name = "h3", .help = "h", .buckets = {1, INFINITY}}), keel::invalid_options);
  CHECK_THROWS_WITH(r.gauge({.name = "g1", .help = "h", .buckets = {1}}),
                    "metric_options.buckets must be empty for a gauge (got 1)");
  // Nothing refused was registered.
  CHECK(find(r.snapshot(), "h2") == nullptr);
}

TEST_CASE("with() refuses the wrong number of label values", "[metrics]") {
  keel::metrics_registry r;
  auto& f = r.counter({.name = "x_total", .help = "x", .labels = {"a", "b"}});
  CHECK_THROWS_WITH(f.with({"1"}), "keel: metric x_total takes 2 label values {a,b}, got 1");
  CHECK_THROWS_AS(f.with({"1", "2", "3"}), keel::invalid_options);
  CHECK(find(r.snapshot(), "x_total")->series.empty());
}

TEST_CASE("collectors add families computed at snapshot time", "[metrics]") {
  keel::metrics_registry r;
  (void)r.counter({.name = "b_total", .help = "b"});
  int calls = 0;
  r.add_collector([&calls](keel::metrics_snapshot& s) {
    ++calls;
    s.families.push_back({.name = "a_in_use",
                          .help = "In use.",
                          .type = keel::metric_type::gauge,
                          .label_names = {"pool"},
                          .series = {{.labels = {"z"}, .value = 2}, {.labels = {"y"}, .value = 1}}});
  });
  const auto s = r.snapshot();
  CHECK(calls == 1);
  REQUIRE(s.families.size() == 2);
  CHECK(s.families[0].name == "a_in_use");
  CHECK(s.families[0].series[0].labels[0] == "y");  // collectors' series are sorted too
  CHECK(s.validate().ok());
}

TEST_CASE("snapshot validation catches what would not parse or would clash", "[metrics]") {
  keel::metrics_snapshot s;
  s.families.push_back({.name = "x", .help = "x", .type = keel::metric_type::histogram, .bounds = {1}});
  s.families.push_back({.name = "x_count", .help = "c", .type = keel::metric_type::counter});
  CHECK(s.validate().code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(s.validate().message()) == "keel: metric families x and x_count both render x_count");

  keel::metrics_snapshot arity;
  arity.families.push_back({.name = "y", .help = "y", .label_names = {"a"}, .series = {{.labels = {}}}});
  CHECK(arity.validate().code() == absl::StatusCode::kInvalidArgument);

  keel::metrics_snapshot dup;
  dup.families.push_back({.name = "y", .help = "y", .label_names = {"a"}, .series = {{.labels = {"1"}}, {.labels = {"1"}}}});
  CHECK(std::string(dup.validate().message()) == "keel: two series of y have the labels {1}");

  keel::metrics_snapshot buckets;
  buckets.families.push_back(
      {.name = "h", .help = "h", .type = keel::metric_type::histogram, .bounds = {1, 2}, .series = {{.buckets = {1, 2}}}});
  CHECK(buckets.validate().code() == absl::StatusCode::kInvalidArgument);

  keel::metrics_snapshot quantile;
  quantile.families.push_back({.name = "s", .help = "s", .type = keel::metric_type::summary, .label_names = {"quantile"}});
  CHECK(quantile.validate().code() == absl::StatusCode::kInvalidArgument);
  keel::metrics_snapshot q2;
  q2.families.push_back({.name = "s", .help = "s", .type = keel::metric_type::summary,
                         .series = {{.quantiles = {{.quantile = 1.5, .value = 1}}}}});
  CHECK(q2.validate().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("concurrent increments and series creation lose nothing", "[metrics][concurrency]") {
  keel::metrics_registry r;
  auto& f = r.counter({.name = "ops_total", .help = "Ops.", .labels = {"worker"}});
  auto& g = r.gauge({.name = "in_flight", .help = "In flight."});
  auto& h = r.histogram({.name = "lat_seconds", .help = "Latency.", .buckets = {0.5}});
  constexpr int kThreads = 4, kOps = 20'000;
  std::atomic<bool> done{false};
  std::vector<std::size_t> snapshot_sizes;
  std::thread reader([&] {
    while (!done.load()) snapshot_sizes.push_back(r.snapshot().families.size());
  });
  std::vector<std::thread> workers;
  for (int t = 0; t < kThreads; ++t) {
    workers.emplace_back([&, t] {
      const std::string mine = "w" + std::to_string(t);
      keel::counter_metric& shared = f.with({"shared"});
      for (int i = 0; i < kOps; ++i) {
        shared.inc();
        f.with({mine}).inc();  // looked up every time: the mutex path
        g.with({}).inc();
        h.with({}).observe(i % 2 == 0 ? 0.25 : 1.0);
        g.with({}).dec();
      }
    });
  }
  for (auto& w : workers) w.join();
  done = true;
  reader.join();

  CHECK(f.with({"shared"}).value() == std::uint64_t{kThreads} * kOps);
  for (int t = 0; t < kThreads; ++t) CHECK(f.with({"w" + std::to_string(t)}).value() == std::uint64_t{kOps});
  CHECK(g.with({}).value() == 0.0);
  const auto s = r.snapshot();
  const auto* lat = find(s, "lat_seconds");
  CHECK(lat->series[0].buckets == std::vector<std::uint64_t>{kThreads * kOps / 2, kThreads * kOps / 2});
  CHECK(lat->series[0].sum == Approx(kThreads * kOps / 2 * 1.25));
  CHECK(!snapshot_sizes.empty());
}

TEST_CASE("incrementing a series, or finding an existing one, allocates nothing", "[metrics][alloc]") {
  if (!keel_test::allocations_counted()) {
    WARN("allocation counting is off in sanitizer builds; the g++ build asserts it");
    return;
  }
  keel::metrics_registry r;
  auto& f = r.counter({.name = "ops_total", .help = "Ops.", .labels = {"reason"}});
  auto& h = r.histogram({.name = "lat_seconds", .help = "Latency.", .labels = {"class"}});
  auto& g = r.gauge({.name = "level", .help = "Level."});
  keel::counter_metric& c = f.with({"budget"});
  keel::histogram_metric& hs = h.with({"interactive"});
  keel::gauge_metric& gs = g.with({});
  const std::string reason = "budget";
  keel_test::count_allocations allocations;
  for (int i = 0; i < 1000; ++i) {
    c.inc();
    hs.observe(std::chrono::microseconds(i * 100));
    gs.add(1);
    f.with({reason}).inc();  // existing series: found by string_view, no key built
  }
  CHECK(allocations.count() == 0);
  CHECK(c.value() == 2000);
}
