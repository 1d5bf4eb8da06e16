// keel's metrics read by their real consumer: the example gateway on
// loopback, a real Prometheus server (Debian's package) scraping its
// /metrics every second, traffic through a normal and an outage phase, and
// then PromQL over the Prometheus HTTP API. What Prometheus stored must be
// what the gateway reports itself: the request counters, the error-budget
// gauges against /healthz, and histogram_quantile over keel's latency
// histogram against the same interpolation done here over the gateway's
// own bucket counts. Every query of the Grafana dashboard in
// docs/grafana/keel-gateway.json is run too, so the dashboard cannot refer
// to a metric the gateway does not export.
//
// The waits are for the next scrape of an external process (bounded, in
// real time); nothing here measures time.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <memory>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "gateway_service.hpp"
#include "support/catch.hpp"
#include "support/prometheus.hpp"
#include "support/service.hpp"

using namespace std::chrono_literals;
using json = nlohmann::json;

namespace {

// One sample line of Prometheus text: name, labels, value.
struct sample_line {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

// A small independent reader of the text format (enough for keel's output:
// label values here hold no escaped quotes).
std::vector<sample_line> parse_samples(const std::string& text) {
  std::vector<sample_line> out;
  std::istringstream in(text);
  std::string line;
  static const std::regex label_re(R"re(([a-zA-Z_][a-zA-Z0-9_]*)="([^"]*)")re");
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    sample_line s;
    const std::size_t brace = line.find('{');
    const std::size_t space = line.rfind(' ');
    if (brace != std::string::npos && brace < space) {
      s.name = line.substr(0, brace);
      const std::string labels = line.substr(brace + 1, line.rfind('}') - brace - 1);
      for (auto it = std::sregex_iterator(labels.begin(), labels.end(), label_re); it != std::sregex_iterator(); ++it)
        s.labels[(*it)[1]] = (*it)[2];
    } else {
      s.name = line.substr(0, space);
    }
    const std::string v = line.substr(space + 1);
    s.value = v == "+Inf" ? INFINITY : std::stod(v);
    out.push_back(std::move(s));
  }
  return out;
}

// The families a text declares (# TYPE lines).
std::set<std::string> families(const std::string& text) {
  std::set<std::string> out;
  static const std::regex type_re(R"(# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) )");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), type_re); it != std::sregex_iterator(); ++it)
    out.insert((*it)[1]);
  return out;
}

// Sum of `name`'s samples whose labels include every pair of `match`.
double sum_of(const std::vector<sample_line>& samples, const std::string& name,
              const std::map<std::string, std::string>& match = {}) {
  double sum = 0;
  for (const sample_line& s : samples) {
    if (s.name != name) continue;
    bool all = true;
    for (const auto& [k, v] : match) all = all && s.labels.count(k) != 0 && s.labels.at(k) == v;
    if (all) sum += s.value;
  }
  return sum;
}

// Prometheus's histogram_quantile (promql/quantile.go, bucketQuantile) over
// cumulative buckets, written out again so that the two can be compared.
double bucket_quantile(double q, std::vector<std::pair<double, double>> buckets) {  // (le, cumulative count)
  std::sort(buckets.begin(), buckets.end());
  if (buckets.size() < 2 || !std::isinf(buckets.back().first)) return NAN;
  const double total = buckets.back().second;
  if (total == 0) return NAN;
  const double rank = q * total;
  std::size_t b = 0;
  while (b < buckets.size() - 1 && buckets[b].second < rank) ++b;
  if (b == buckets.size() - 1) return buckets[b - 1].first;
  if (b == 0 && buckets[0].first <= 0) return buckets[0].first;
  const double start = b == 0 ? 0 : buckets[b - 1].first;
  const double below = b == 0 ? 0 : buckets[b - 1].second;
  const double in_bucket = buckets[b].second - below;
  return start + (buckets[b].first - start) * ((rank - below) / in_bucket);
}

std::string get_text(int port, const std::string& path) {
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(10s);
  const httplib::Result r = c.Get(path.c_str());
  if (!r || r->status != 200) FAIL("GET " << path << " failed");
  return r->body;
}

int post_feedback(httplib::Client& c, const std::string& tenant, const std::string& key,
                  const std::string& question = "q-timeouts") {
  const std::string body =
      json{{"tenant", tenant}, {"question_id", question}, {"answer", "one deadline, stages get what remains"}}.dump();
  const httplib::Result r =
      c.Post("/v1/feedback", httplib::Headers{{"Idempotency-Key", key}}, body, "application/json");
  return r ? r->status : 0;
}

// The metric names a PromQL expression refers to: identifiers followed by
// `{`, `[`, `)` or whitespace that are not PromQL's own words.
std::set<std::string> metric_names(const std::string& expr) {
  static const std::set<std::string> promql = {"sum", "by", "rate", "increase", "histogram_quantile", "le", "without",
                                               "avg", "max", "min"};
  static const std::regex ident_re(R"(([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{|\[|\)|$))");
  std::set<std::string> out;
  // Label names inside by (...) are followed by `,` or `)`: drop what sits in by-clauses first.
  const std::string no_by = std::regex_replace(expr, std::regex(R"(by \([^)]*\))"), "");
  const std::string no_matchers = std::regex_replace(no_by, std::regex(R"(\{[^}]*\})"), "{}");
  for (auto it = std::sregex_iterator(no_matchers.begin(), no_matchers.end(), ident_re); it != std::sregex_iterator();
       ++it) {
    const std::string name = (*it)[1];
    if (promql.count(name) == 0) out.insert(name);
  }
  return out;
}

// A histogram's family name from one of its series names.
std::string family_of(const std::string& series) {
  for (const char* suffix : {"_bucket", "_sum", "_count"}) {
    const std::string s = suffix;
    if (series.size() > s.size() && series.compare(series.size() - s.size(), s.size(), s) == 0)
      return series.substr(0, series.size() - s.size());
  }
  return series;
}

}  // namespace

TEST_CASE("a real Prometheus scraping the gateway stores the values the gateway reports",
          "[service][prometheus]") {
  keel_service::temp_dir dir;
  gateway::gateway_options o = keel_service::options(dir.path());
  auto opened = gateway::service::open(o);
  REQUIRE(opened.ok());
  std::unique_ptr<gateway::service> svc = std::move(*opened);
  REQUIRE(svc->start("127.0.0.1", 0).ok());
  const int port = svc->port();

  keel_test::prometheus_server prom({.dir = dir.path(), .target = "127.0.0.1:" + std::to_string(port)});
  REQUIRE(prom.await_up(60s));

  // Traffic: a normal phase, then an outage (fallback answers for a question
  // with a rubric, failures for one without), then the provider back. The
  // test counts the codes it received.
  std::map<int, int> codes;
  {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(10s);
    for (int i = 0; i < 60; ++i) ++codes[post_feedback(c, "tenant-" + std::to_string(i % 4), "n-" + std::to_string(i))];
    REQUIRE(c.Post("/admin/fault", R"({"kind":"outage"})", "application/json")->status == 200);
    for (int i = 0; i < 30; ++i)
      ++codes[post_feedback(c, "tenant-" + std::to_string(i % 4), "o-" + std::to_string(i),
                            i % 2 == 0 ? "q-timeouts" : "q-without-rubric")];
    REQUIRE(c.Post("/admin/fault", R"({"kind":"none"})", "application/json")->status == 200);
  }
  std::string seen;
  for (const auto& [code, n] : codes) seen += std::to_string(code) + ": " + std::to_string(n) + "; ";
  INFO("HTTP codes " << seen);
  REQUIRE(codes.count(0) == 0);  // every request got an HTTP answer
  REQUIRE(codes[200] > 0);
  REQUIRE(codes[200] < 90);  // the outage failed some

  // The gateway's own view once traffic has stopped: feedback counters no
  // longer change, so the next scrape must hold exactly these.
  const std::vector<sample_line> own = parse_samples(get_text(port, "/metrics"));
  const double feedback_total = sum_of(own, "gateway_http_requests_total", {{"endpoint", "feedback"}});
  REQUIRE(feedback_total == 90);
  for (const auto& [code, n] : codes) {
    INFO("code " << code);
    CHECK(sum_of(own, "gateway_http_requests_total", {{"endpoint", "feedback"}, {"code", std::to_string(code)}}) == n);
  }
  REQUIRE(prom.await(30s, [&] {
    return prom.scalar(R"(sum(gateway_http_requests_total{endpoint="feedback"}))") == feedback_total;
  }));

  {  // the counters
    for (const auto& [code, n] : codes) {
      INFO("code " << code);
      CHECK(prom.scalar("sum(gateway_http_requests_total{endpoint=\"feedback\",code=\"" + std::to_string(code) +
                        "\"})") == n);
    }
    CHECK(prom.scalar("sum(gateway_answers_total)") == sum_of(own, "gateway_answers_total"));
    CHECK(prom.scalar(R"(sum(gateway_rejections_total) or vector(0))") == sum_of(own, "gateway_rejections_total"));
    CHECK(prom.scalar(R"(sum(keel_slo_requests_total{class="interactive"}))") ==
          sum_of(own, "keel_slo_requests_total", {{"class", "interactive"}}));
  }

  {  // the error budget
    // /healthz reports the same budget as JSON; nothing has left the SLO
    // window (150 s at this scale), so the gauges have not moved since.
    const json health = json::parse(get_text(port, "/healthz"));
    const json& slo = health.at("slo").at("interactive");
    CHECK(prom.scalar(R"(keel_slo_error_budget_remaining{class="interactive",sli="availability"})") ==
          Approx(slo.at("error_budget_remaining").get<double>()).epsilon(1e-12));
    CHECK(prom.scalar(R"(keel_slo_error_budget_allowed{class="interactive",sli="availability"})") ==
          Approx(slo.at("error_budget_allowed").get<double>()).epsilon(1e-12));
    // The outage's failures spent it (an integer budget: 1% of 90 is none, so overspent).
    CHECK(slo.at("error_budget_remaining").get<double>() < slo.at("error_budget_allowed").get<double>());
  }

  {  // histogram_quantile over keel's latency histogram
    const std::vector<sample_line> now = parse_samples(get_text(port, "/metrics"));
    std::vector<std::pair<double, double>> buckets;
    for (const sample_line& s : now) {
      if (s.name == "gateway_request_seconds_bucket" && s.labels.at("class") == "interactive")
        buckets.emplace_back(s.labels.at("le") == "+Inf" ? INFINITY : std::stod(s.labels.at("le")), s.value);
    }
    REQUIRE(buckets.size() > 2);
    REQUIRE(prom.await(30s, [&] {
      return prom.scalar(R"(sum(gateway_request_seconds_count{class="interactive"}))") ==
             sum_of(now, "gateway_request_seconds_count", {{"class", "interactive"}});
    }));
    for (double q : {0.5, 0.9, 0.99}) {
      INFO("quantile " << q);
      const double expected = bucket_quantile(q, buckets);
      REQUIRE(std::isfinite(expected));
      CHECK(prom.scalar("histogram_quantile(" + std::to_string(q) +
                        R"(, sum by (le) (gateway_request_seconds_bucket{class="interactive"})))") ==
            Approx(expected).epsilon(1e-9));
    }
  }

  {  // every query of the dashboard
    std::ifstream f(KEEL_GRAFANA_DASHBOARD);
    REQUIRE(f.good());
    const json dashboard = json::parse(f);
    const std::set<std::string> exported = families(get_text(port, "/metrics"));
    int queries = 0;
    for (const json& panel : dashboard.at("panels")) {
      for (const json& target : panel.at("targets")) {
        const std::string expr = target.at("expr");
        INFO("panel \"" << panel.at("title").get<std::string>() << "\": " << expr);
        ++queries;
        json result;
        REQUIRE_NOTHROW(result = prom.query(expr));  // Prometheus accepts it
        for (const std::string& name : metric_names(expr)) {
          INFO("metric " << name);
          CHECK((name == "up" || exported.count(family_of(name)) == 1));
        }
        // The panels over what this traffic produced show data.
        for (const char* produced : {"gateway_http_requests_total", "gateway_answers_total",
                                     "gateway_request_seconds", "keel_slo_", "up{"}) {
          if (expr.find(produced) != std::string::npos) CHECK_FALSE(result.empty());
        }
      }
    }
    CHECK(queries >= 10);
  }
}
