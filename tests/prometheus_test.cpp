// keel::to_prometheus_text: the exact text for a known registry (HELP/TYPE,
// escaping, histogram buckets, summaries), number forms, ordering, refusal
// of invalid snapshots, and a round trip through an independent parser (the
// prometheus_client Python package's text parser, from Debian).
#include "keel/observe/prometheus.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <unistd.h>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "keel/observe/metrics.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;

namespace {

// The registry every test here renders: labelled counter with awkward label
// values and help text, an unlabelled gauge, a labelled histogram with exact
// binary fractions (so the sum prints exactly), and a summary added by a
// collector.
void fill(keel::metrics_registry& r, bool reverse_order = false) {
  auto counter = [&r] {
    auto& f = r.counter({.name = "keel_demo_requests_total",
                         .help = "Requests, by \"class\".\nSecond line with a \\ backslash.",
                         .labels = {"class", "outcome"}});
    f.with({"interactive", "we\"ird\\val\nue"}).inc();
    f.with({"interactive", "ok"}).inc(10);
    f.with({"batch", "ok"}).inc(3);
  };
  auto gauge = [&r] { r.gauge({.name = "keel_demo_in_flight", .help = "Work in flight."}).with({}).set(2.5); };
  auto histogram = [&r] {
    auto& h = r.histogram({.name = "keel_demo_latency_seconds",
                           .help = "Latency.",
                           .labels = {"class"},
                           .buckets = {0.01, 0.1, 1}})
                  .with({"interactive"});
    for (double v : {0.0078125, 0.0625, 0.5, 1.0, 4.0}) h.observe(v);
  };
  if (reverse_order) {
    histogram();
    gauge();
    counter();
  } else {
    counter();
    gauge();
    histogram();
  }
  r.add_collector([](keel::metrics_snapshot& s) {
    s.families.push_back({.name = "keel_demo_slo_latency_seconds",
                          .help = "Latency percentiles.",
                          .type = keel::metric_type::summary,
                          .label_names = {"class"},
                          .series = {{.labels = {"interactive"},
                                      .quantiles = {{.quantile = 0.99, .value = 1.5}, {.quantile = 0.5, .value = 0.25}},
                                      .sum = 10,
                                      .count = 20}}});
  });
}

const char* const kExpected =
    "# HELP keel_demo_in_flight Work in flight.\n"
    "# TYPE keel_demo_in_flight gauge\n"
    "keel_demo_in_flight 2.5\n"
    "# HELP keel_demo_latency_seconds Latency.\n"
    "# TYPE keel_demo_latency_seconds histogram\n"
    "keel_demo_latency_seconds_bucket{class=\"interactive\",le=\"0.01\"} 1\n"
    "keel_demo_latency_seconds_bucket{class=\"interactive\",le=\"0.1\"} 2\n"
    "keel_demo_latency_seconds_bucket{class=\"interactive\",le=\"1\"} 4\n"
    "keel_demo_latency_seconds_bucket{class=\"interactive\",le=\"+Inf\"} 5\n"
    "keel_demo_latency_seconds_sum{class=\"interactive\"} 5.5703125\n"
    "keel_demo_latency_seconds_count{class=\"interactive\"} 5\n"
    "# HELP keel_demo_requests_total Requests, by \"class\".\\nSecond line with a \\\\ backslash.\n"
    "# TYPE keel_demo_requests_total counter\n"
    "keel_demo_requests_total{class=\"batch\",outcome=\"ok\"} 3\n"
    "keel_demo_requests_total{class=\"interactive\",outcome=\"ok\"} 10\n"
    "keel_demo_requests_total{class=\"interactive\",outcome=\"we\\\"ird\\\\val\\nue\"} 1\n"
    "# HELP keel_demo_slo_latency_seconds Latency percentiles.\n"
    "# TYPE keel_demo_slo_latency_seconds summary\n"
    "keel_demo_slo_latency_seconds{class=\"interactive\",quantile=\"0.5\"} 0.25\n"
    "keel_demo_slo_latency_seconds{class=\"interactive\",quantile=\"0.99\"} 1.5\n"
    "keel_demo_slo_latency_seconds_sum{class=\"interactive\"} 10\n"
    "keel_demo_slo_latency_seconds_count{class=\"interactive\"} 20\n";

std::string hex(std::string_view s) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) {
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  return out;
}

std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Prints, for each family the parser finds, "F name type hex(help)" and for
// each sample "S name k=hex(v),... value", labels sorted by name.
const char* const kParser = R"PY(
import sys
from prometheus_client.parser import text_string_to_metric_families
text = open(sys.argv[1], encoding="utf-8").read()
for fam in text_string_to_metric_families(text):
    print("F", fam.name, fam.type, fam.documentation.encode().hex())
    for s in fam.samples:
        labels = ",".join(k + "=" + v.encode().hex() for k, v in sorted(s.labels.items()))
        print("S", s.name, labels or "-", repr(float(s.value)))
)PY";

}  // namespace

TEST_CASE("the text format, exactly", "[prometheus]") {
  keel::metrics_registry r;
  fill(r);
  const absl::StatusOr<std::string> text = keel::to_prometheus_text(r.snapshot());
  REQUIRE(text.ok());
  CHECK(*text == kExpected);
  CHECK(keel::prometheus_content_type == "text/plain; version=0.0.4; charset=utf-8");
}

TEST_CASE("the same metrics render the same bytes, whatever order they were made in", "[prometheus]") {
  keel::metrics_registry a, b;
  fill(a);
  fill(b, /*reverse_order=*/true);
  CHECK(*keel::to_prometheus_text(a.snapshot()) == *keel::to_prometheus_text(b.snapshot()));

  keel::metrics_snapshot shuffled = a.snapshot();
  std::mt19937 gen(5);
  for (int i = 0; i < 10; ++i) {
    std::shuffle(shuffled.families.begin(), shuffled.families.end(), gen);
    for (auto& f : shuffled.families) std::shuffle(f.series.begin(), f.series.end(), gen);
    CHECK(*keel::to_prometheus_text(shuffled) == kExpected);
  }
}

TEST_CASE("numbers are written in their shortest exact form", "[prometheus]") {
  keel::metrics_snapshot s;
  s.families.push_back({.name = "g",
                        .help = "Numbers.",
                        .type = keel::metric_type::gauge,
                        .label_names = {"n"},
                        .series = {{.labels = {"a"}, .value = 0.1},
                                   {.labels = {"b"}, .value = 1e-05},
                                   {.labels = {"c"}, .value = 1e21},
                                   {.labels = {"d"}, .value = 123456789},
                                   {.labels = {"e"}, .value = std::nan("")},
                                   {.labels = {"f"}, .value = INFINITY},
                                   {.labels = {"g"}, .value = -INFINITY},
                                   {.labels = {"h"}, .value = -2.5},
                                   {.labels = {"i"}, .value = 0}}});
  CHECK(*keel::to_prometheus_text(s) ==
        "# HELP g Numbers.\n"
        "# TYPE g gauge\n"
        "g{n=\"a\"} 0.1\n"
        "g{n=\"b\"} 1e-05\n"
        "g{n=\"c\"} 1e+21\n"
        "g{n=\"d\"} 123456789\n"
        "g{n=\"e\"} NaN\n"
        "g{n=\"f\"} +Inf\n"
        "g{n=\"g\"} -Inf\n"
        "g{n=\"h\"} -2.5\n"
        "g{n=\"i\"} 0\n");
}

TEST_CASE("histogram buckets are cumulative, end with +Inf and agree with _count", "[prometheus]") {
  keel::metrics_registry r;
  auto& h = r.histogram({.name = "lat_seconds", .help = "Latency.", .buckets = {0.005, 0.25, 2.5}}).with({});
  for (int i = 0; i < 7; ++i) h.observe(0.005);  // on the bound: le is inclusive
  for (int i = 0; i < 3; ++i) h.observe(3.0);    // above every bound
  h.observe(1ms);
  CHECK(*keel::to_prometheus_text(r.snapshot()) ==
        "# HELP lat_seconds Latency.\n"
        "# TYPE lat_seconds histogram\n"
        "lat_seconds_bucket{le=\"0.005\"} 8\n"
        "lat_seconds_bucket{le=\"0.25\"} 8\n"
        "lat_seconds_bucket{le=\"2.5\"} 8\n"
        "lat_seconds_bucket{le=\"+Inf\"} 11\n"
        "lat_seconds_sum 9.036\n"
        "lat_seconds_count 11\n");
}

TEST_CASE("valid UTF-8 passes through; invalid bytes become U+FFFD", "[prometheus]") {
  keel::metrics_snapshot s;
  s.families.push_back({.name = "u",
                        .help = "caf\xc3\xa9 \xff help",
                        .type = keel::metric_type::gauge,
                        .label_names = {"v"},
                        .series = {{.labels = {"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"}, .value = 1},
                                   {.labels = {"bad\xff"}, .value = 2},
                                   {.labels = {"cut\xe2\x82"}, .value = 3},
                                   {.labels = {"overlong\xc0\xaf"}, .value = 4},
                                   {.labels = {"surrogate\xed\xa0\x80"}, .value = 5}}});
  CHECK(*keel::to_prometheus_text(s) ==
        "# HELP u caf\xc3\xa9 \xef\xbf\xbd help\n"
        "# TYPE u gauge\n"
        "u{v=\"bad\xef\xbf\xbd\"} 2\n"
        "u{v=\"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80\"} 1\n"
        "u{v=\"cut\xef\xbf\xbd\xef\xbf\xbd\"} 3\n"
        "u{v=\"overlong\xef\xbf\xbd\xef\xbf\xbd\"} 4\n"
        "u{v=\"surrogate\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\"} 5\n");
}

TEST_CASE("an invalid snapshot is refused and nothing is written", "[prometheus]") {
  keel::metrics_snapshot s;
  s.families.push_back({.name = "bad-name", .help = "h", .type = keel::metric_type::gauge});
  std::string out = "kept";
  const absl::Status st = keel::append_prometheus_text(s, out);
  CHECK(st.code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(st.message()).find("metric_options.name must match") != std::string::npos);
  CHECK(out == "kept");
  CHECK(keel::to_prometheus_text(s).status().code() == absl::StatusCode::kInvalidArgument);

  keel::metrics_snapshot missing_help;
  missing_help.families.push_back({.name = "x", .help = "", .type = keel::metric_type::gauge});
  CHECK(keel::to_prometheus_text(missing_help).status().code() == absl::StatusCode::kInvalidArgument);
}

// Found by the prometheus fuzz target (tests/fuzz/corpus/prometheus/
// regression_invalid_utf8_label_collision): label values that differ only
// in bytes the writer replaces were written as one series twice, and
// Prometheus refuses a scrape with a duplicate series.
TEST_CASE("series whose labels differ only in invalid UTF-8 are never written twice", "[prometheus][fuzz]") {
  keel::metrics_snapshot s;
  s.families.push_back({.name = "a",
                        .help = "h",
                        .type = keel::metric_type::counter,
                        .label_names = {"l"},
                        .series = {{.labels = {"\xff"}, .value = 1}, {.labels = {"\xfe"}, .value = 2}}});
  const absl::StatusOr<std::string> text = keel::to_prometheus_text(s);
  REQUIRE(text.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(text.status().message()).find("two series of a have the labels") != std::string::npos);
  // The literal replacement character and an invalid byte are written alike too.
  s.families[0].series[1].labels = {"\xef\xbf\xbd"};
  CHECK(keel::to_prometheus_text(s).status().code() == absl::StatusCode::kInvalidArgument);
  // Distinct as written: accepted.
  s.families[0].series[1].labels = {"\xffx"};
  CHECK(keel::to_prometheus_text(s).ok());

  // The registry files such values under the series they are written as.
  keel::metrics_registry r;
  auto& f = r.counter({.name = "tenant_requests_total", .help = "h", .labels = {"tenant"}});
  keel::counter_metric& one = f.with({"t\xff"});
  CHECK(&f.with({"t\xfe"}) == &one);
  CHECK(&f.with({"t\xef\xbf\xbd"}) == &one);
  CHECK(f.with_at_most(std::vector<std::string_view>{"t\xc0"}, 10) == &one);
  CHECK(&f.with({"t"}) != &one);
  one.inc();
  f.with({"t\xfe"}).inc();
  const absl::StatusOr<std::string> body = keel::to_prometheus_text(r.snapshot());
  REQUIRE(body.ok());
  CHECK(body->find("tenant_requests_total{tenant=\"t\xef\xbf\xbd\"} 2\n") != std::string::npos);
}

// Found by the prometheus fuzz target (tests/fuzz/corpus/prometheus/
// regression_summary_quantile_twice): a summary series with one quantile
// twice was written as two identical samples.
TEST_CASE("a summary series with a quantile twice is refused", "[prometheus][fuzz]") {
  keel::metrics_snapshot s;
  s.families.push_back({.name = "lat",
                        .help = "h",
                        .type = keel::metric_type::summary,
                        .series = {{.quantiles = {{.quantile = 0.5, .value = 1}, {.quantile = 0.5, .value = 2}}}}});
  const absl::StatusOr<std::string> text = keel::to_prometheus_text(s);
  REQUIRE(text.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(text.status().message()).find("has quantile 0.5 twice") != std::string::npos);
  s.families[0].series[0].quantiles[1].quantile = 0.9;
  CHECK(keel::to_prometheus_text(s).ok());
}

TEST_CASE("an independent parser reads back every family, label and value", "[prometheus][interop]") {
  keel::metrics_registry r;
  fill(r);
  // Label values that need every escape, and UTF-8.
  r.counter({.name = "odd_total", .help = "Odd\\ly \"named\"\nthings.", .labels = {"v"}})
      .with({"back\\slash \"quoted\"\nnew line, caf\xc3\xa9 \\n"})
      .inc(2);
  const keel::metrics_snapshot snap = r.snapshot();
  const std::string text = *keel::to_prometheus_text(snap);

  const auto dir = std::filesystem::temp_directory_path() / ("keel_prom_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  {
    std::ofstream(dir / "metrics.txt", std::ios::binary) << text;
    std::ofstream(dir / "parse.py") << kParser;
  }
  const std::string cmd = "/usr/bin/python3 " + (dir / "parse.py").string() + " " + (dir / "metrics.txt").string() +
                          " > " + (dir / "out.txt").string() + " 2> " + (dir / "err.txt").string();
  const int rc = std::system(cmd.c_str());
  const std::string parsed = slurp(dir / "out.txt");
  const std::string errors = slurp(dir / "err.txt");
  std::filesystem::remove_all(dir);
  INFO("parser stderr (needs Debian's python3-prometheus-client): " << errors);
  REQUIRE(rc == 0);

  // What the parser must have found, built from the snapshot's data (not from
  // the text): label values raw, numbers compared as numbers.
  std::vector<std::string> want;
  auto number = [](double v) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.17g", v);
    return std::string(buf);
  };
  for (const auto& f : snap.families) {  // the snapshot is sorted by name, as rendered
    std::string fam = f.name;
    if (f.type == keel::metric_type::counter && fam.ends_with("_total")) fam.resize(fam.size() - 6);
    want.push_back("F " + fam + " " + std::string(keel::to_string(f.type)) + " " + hex(f.help));
    for (const auto& s : f.series) {
      auto labels = [&](std::string_view extra_name = {}, std::string_view extra_value = {}) {
        std::vector<std::pair<std::string, std::string>> kv;
        for (std::size_t i = 0; i < f.label_names.size(); ++i) kv.emplace_back(f.label_names[i], s.labels[i]);
        if (!extra_name.empty()) kv.emplace_back(extra_name, extra_value);
        std::sort(kv.begin(), kv.end());
        std::string out;
        for (const auto& [k, v] : kv) out += (out.empty() ? "" : ",") + k + "=" + hex(v);
        return out.empty() ? std::string("-") : out;
      };
      switch (f.type) {
        case keel::metric_type::counter:
        case keel::metric_type::gauge:
          want.push_back("S " + f.name + " " + labels() + " " + number(s.value));
          break;
        case keel::metric_type::histogram: {
          std::uint64_t c = 0;
          for (std::size_t i = 0; i < f.bounds.size(); ++i) {
            c += s.buckets[i];
            char le[32];
            std::snprintf(le, sizeof le, "%g", f.bounds[i]);
            want.push_back("S " + f.name + "_bucket " + labels("le", le) + " " + number(double(c)));
          }
          c += s.buckets.back();
          want.push_back("S " + f.name + "_bucket " + labels("le", "+Inf") + " " + number(double(c)));
          want.push_back("S " + f.name + "_sum " + labels() + " " + number(s.sum));
          want.push_back("S " + f.name + "_count " + labels() + " " + number(double(c)));
          break;
        }
        case keel::metric_type::summary: {
          auto qs = s.quantiles;
          std::sort(qs.begin(), qs.end(), [](auto& a, auto& b) { return a.quantile < b.quantile; });
          for (const auto& q : qs) {
            char qq[32];
            std::snprintf(qq, sizeof qq, "%g", q.quantile);
            want.push_back("S " + f.name + " " + labels("quantile", qq) + " " + number(q.value));
          }
          want.push_back("S " + f.name + "_sum " + labels() + " " + number(s.sum));
          want.push_back("S " + f.name + "_count " + labels() + " " + number(double(s.count)));
          break;
        }
      }
    }
  }

  // The parser's values, reprinted through the same number format.
  std::vector<std::string> got;
  std::istringstream lines(parsed);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("S ", 0) == 0) {
      const auto last = line.rfind(' ');
      line = line.substr(0, last + 1) + number(std::strtod(line.c_str() + last + 1, nullptr));
    }
    got.push_back(line);
  }
  CHECK(got == want);
}
