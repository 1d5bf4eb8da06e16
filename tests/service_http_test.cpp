// The example gateway as an HTTP service on loopback (examples/gateway/):
// load through normal, slowdown, outage and recovery phases while batch
// floods; bad input to every endpoint; the operator controls; and batch
// workers killed mid-job in child processes (this test binary re-executed).
//
// Times are the seed's plan scaled by keel_service::time_scale (a 750 ms
// deadline). Latency bounds are correctness bounds — no reply may come
// later than its deadline plus keel_service::http_slack — not speed claims.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "gateway_service.hpp"
#include "keel/provider/sse.hpp"
#include "load_generator.hpp"
#include "support/service.hpp"
#include "support/started_service.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;
using json = nlohmann::json;
using keel_service::start;
using keel_service::temp_dir;

namespace {

struct http_result {
  int status = 0;  // 0: transport error
  json body;
  bool retry_after = false;
  std::string text;
};

http_result result_of(const httplib::Result& r) {
  http_result out;
  if (!r) return out;
  out.status = r->status;
  out.text = r->body;
  out.body = json::parse(r->body, nullptr, false);
  out.retry_after = r->has_header("Retry-After");
  return out;
}

class client {
 public:
  explicit client(int port) : c_("127.0.0.1", port) {
    c_.set_read_timeout(10s);
    c_.set_connection_timeout(2s);
  }
  http_result post(const std::string& path, const std::string& body, const std::string* key = nullptr) {
    httplib::Headers h;
    if (key != nullptr) h.emplace("Idempotency-Key", *key);
    return result_of(c_.Post(path.c_str(), h, body, "application/json"));
  }
  http_result post_key(const std::string& path, const std::string& body, const std::string& key) {
    return post(path, body, &key);
  }
  http_result get(const std::string& path) { return result_of(c_.Get(path.c_str())); }

 private:
  httplib::Client c_;
};

std::string feedback(const std::string& tenant, const std::string& answer = "one deadline, stages get what remains") {
  return json{{"tenant", tenant}, {"question_id", "q-timeouts"}, {"answer", answer}}.dump();
}
std::string batch(const std::string& tenant, const std::string& learner = "learner-1") {
  return json{{"tenant", tenant}, {"learner", learner}, {"sessions", {"session one", "session two"}}}.dump();
}

// A counter's value in Prometheus text, 0 when the series is absent.
double metric(const std::string& text, const std::string& series) {
  const std::size_t at = text.find("\n" + series + " ");
  if (at == std::string::npos) return 0;
  return std::stod(text.substr(at + series.size() + 2));
}

bool is_noisy(const gateway::sample& s) { return s.tenant == "noisy"; }

}  // namespace

TEST_CASE("load on loopback: normal, slowdown, outage, recovery, with a batch flood throughout",
          "[service][http][load]") {
  temp_dir dir;
  gateway::gateway_options o = keel_service::options(dir.path());
  std::mutex transitions_mu;
  std::vector<std::pair<keel::breaker_state, keel::breaker_state>> transitions;
  o.breaker.on_state_change = [&](const keel::breaker_transition& t) {
    std::lock_guard lock(transitions_mu);
    transitions.emplace_back(t.from, t.to);
  };
  auto svc = start(o);
  const gateway::deadline_plan& plan = o.interactive;

  gateway::load_generator load({.port = svc->port(), .clients = 48, .client_timeout = 5s});
  auto fault = [&](std::string body) {
    return [&load, body] { (void)load.post("/admin/fault", body); };
  };
  // At the scaled time, 40 interactive requests a second are the seed's 10
  // a second; the batch flood is 40 submissions a second into 8 slots.
  const std::vector<gateway::phase> phases = {
      {.name = "normal", .length = 2s, .interactive_rate = 40, .batch_rate = 40,
       .on_start = fault(R"({"kind":"none"})")},
      {.name = "slowdown", .length = 2s, .interactive_rate = 40, .batch_rate = 40,
       .on_start = fault(R"({"kind":"slowdown","factor":3})")},
      {.name = "outage", .length = 2s, .interactive_rate = 40, .batch_rate = 40,
       .on_start = fault(R"({"kind":"outage"})")},
      {.name = "recovery", .length = 2s, .interactive_rate = 40, .batch_rate = 40,
       .on_start = fault(R"({"kind":"none"})")},
  };
  const std::vector<gateway::phase_report> reports = load.run(phases);
  const std::vector<gateway::sample> samples = load.samples();

  // Let the workers finish the backlog (bounded), then read what happened.
  auto& core = svc->core();
  const auto drain_until = std::chrono::steady_clock::now() + 30s;
  keel::job_counts jobs;
  while (std::chrono::steady_clock::now() < drain_until) {
    jobs = core.queue().counts().value();
    if (jobs.queued + jobs.running == 0) break;
    std::this_thread::sleep_for(20ms);
  }
  client admin(svc->port());
  const http_result metrics = admin.get("/metrics");
  const keel::breaker_state final_breaker = core.provider_breaker().state();
  std::vector<std::pair<keel::breaker_state, keel::breaker_state>> seen;
  {
    std::lock_guard lock(transitions_mu);
    seen = transitions;
  }

  // Per phase, the requests of the tenants within their quota.
  struct tally {
    int n = 0, ok = 0, degraded = 0, rejected = 0, failed = 0;
  };
  std::vector<tally> per_phase(phases.size());
  for (const gateway::sample& s : samples) {
    if (!s.interactive || is_noisy(s)) continue;
    tally& t = per_phase[s.phase];
    ++t.n;
    t.ok += s.what == gateway::verdict::ok;
    t.degraded += s.what == gateway::verdict::degraded;
    t.rejected += s.what == gateway::verdict::rejected;
    t.failed += s.what == gateway::verdict::failed;
  }
  for (std::size_t p = 0; p < phases.size(); ++p) {
    INFO("phase " << phases[p].name << ": " << per_phase[p].n << " requests, " << per_phase[p].ok << " ok, "
                  << per_phase[p].degraded << " degraded, " << per_phase[p].rejected << " rejected, "
                  << per_phase[p].failed << " failed; p99 " << reports[p].interactive.p99.count() / 1'000'000
                  << " ms");
    CHECK(per_phase[p].n >= 40);
    CHECK(per_phase[p].failed == 0);  // every answer is an answer or a named refusal
    // The SLO claim: p99 of answered interactive requests within the deadline.
    CHECK(reports[p].interactive.p99 <= plan.deadline);
  }
  // While batch floods, interactive work keeps its slots: full answers.
  CHECK(per_phase[0].ok >= per_phase[0].n * 9 / 10);
  // The slowdown and the outage become degraded answers, not failures.
  CHECK(per_phase[1].ok + per_phase[1].degraded >= per_phase[1].n * 9 / 10);
  CHECK(per_phase[2].degraded >= per_phase[2].n * 9 / 10);
  CHECK(per_phase[3].ok >= per_phase[3].n / 2);

  // No request runs past its deadline; rejections are fast and say who refused.
  int rejections = 0, tenant_refusals = 0, transport_errors = 0, answers = 0, answers_timed = 0;
  for (const gateway::sample& s : samples) {
    if (s.status == 0) {
      ++transport_errors;
      continue;
    }
    if (s.interactive) {
      INFO("status " << s.status << " after " << s.latency.count() / 1'000'000 << " ms");
      CHECK(s.latency <= plan.deadline + keel_service::http_slack);
      answers += s.what == gateway::verdict::ok || s.what == gateway::verdict::degraded;
      if (s.elapsed) {
        // The service's own clock, from arrival to the reply built: within
        // the deadline with no allowance for HTTP.
        ++answers_timed;
        CHECK(*s.elapsed <= plan.deadline);
      }
    }
    if (s.what == gateway::verdict::rejected && (s.status == 429 || s.status == 503)) {
      ++rejections;
      tenant_refusals += s.interactive && s.refused_by == "tenant:noisy:rate";
      INFO("refused by " << s.refused_by << " after " << s.latency.count() / 1'000'000 << " ms");
      CHECK(!s.refused_by.empty());
      CHECK(s.retry_after);
      CHECK(s.latency <= plan.admit + keel_service::http_slack);
    }
  }
  CHECK(transport_errors == 0);
  CHECK(answers_timed == answers);  // every answer reports its time: the check above ran on each
  CHECK(answers_timed > 0);
  CHECK(tenant_refusals > 0);
  // ...and visible where operators look.
  REQUIRE(metrics.status == 200);
  CHECK(metric(metrics.text, R"(gateway_rejections_total{class="interactive",reason="tenant_quota"})") ==
        tenant_refusals);
  CHECK(metrics.text.find("keel_slo_error_budget_remaining{class=\"interactive\",sli=\"availability\"}") !=
        std::string::npos);

  // The breaker opened on the bad provider and closed again after recovery.
  CHECK(std::count(seen.begin(), seen.end(), std::pair{keel::breaker_state::closed, keel::breaker_state::open}) >= 1);
  CHECK(final_breaker == keel::breaker_state::closed);

  // No effect happened twice: one learner-history row per decided key, and
  // every reply for a key carried the same decision.
  std::map<std::pair<std::string, std::string>, std::set<std::string>> decisions;
  std::map<std::pair<std::string, std::string>, std::set<std::int64_t>> jobs_by_key;
  for (const gateway::sample& s : samples) {
    if (s.interactive && s.what == gateway::verdict::ok) decisions[{s.tenant, s.key}].insert(s.decision_id);
    if (!s.interactive && s.what == gateway::verdict::ok) jobs_by_key[{s.tenant, s.key}].insert(s.job_id);
  }
  for (const auto& [key, ids] : decisions) {
    INFO("feedback key " << key.second);
    CHECK(ids.size() == 1);
  }
  for (const auto& [key, ids] : jobs_by_key) {
    INFO("batch key " << key.second);
    CHECK(ids.size() == 1);
  }
  CHECK(core.effects().count("feedback").value() == static_cast<std::int64_t>(decisions.size()));
  CHECK(core.effects().duplicated_keys("feedback").value() == 0);

  // Every accepted batch job was done, once, and its report delivered once.
  for (const auto& [key, ids] : jobs_by_key) {
    const std::optional<keel::job_info> info = core.queue().get(*ids.begin()).value();
    REQUIRE(info.has_value());
    INFO("job " << info->id << " (" << key.second << "): " << keel::to_string(info->state) << " after "
                << info->attempts << " attempts; last error: " << info->error_message);
    CHECK(info->state == keel::job_state::done);
  }
  CHECK(jobs.queued + jobs.running == 0);
  CHECK(jobs.failed == 0);
  // keel's listener counted the attempts (read before the last ones finished).
  const double done_counted = metric(metrics.text, R"(keel_job_attempts_total{queue="reports",result="done"})");
  CHECK(done_counted > 0);
  CHECK(done_counted <= static_cast<double>(jobs.done));
  CHECK(jobs.done == static_cast<std::int64_t>(jobs_by_key.size()));
  CHECK(core.effects().count("report").value() == static_cast<std::int64_t>(jobs_by_key.size()));
  CHECK(core.effects().duplicated_keys("report").value() == 0);
  svc->stop();
}

TEST_CASE("bad input to every endpoint: a clear 4xx, and nothing changed", "[service][http][errors]") {
  temp_dir dir;
  const gateway::gateway_options o = keel_service::options(dir.path());
  auto svc = start(o);
  client c(svc->port());
  auto& core = svc->core();
  const std::string key = "key-1";
  const std::string long_key(256, 'k');
  const std::string huge(o.max_body_bytes + 1, 'x');

  struct bad {
    const char* what;
    std::string method, path, body;
    std::optional<std::string> key;
    int status;
  };
  const std::string fb = "/v1/feedback", b = "/v1/batch";
  const std::vector<bad> cases = {
      {"malformed JSON", "POST", fb, "{\"tenant\": ", key, 400},
      {"not an object", "POST", fb, "[1, 2]", key, 400},
      {"no idempotency key", "POST", fb, feedback("acme"), std::nullopt, 400},
      {"an empty idempotency key", "POST", fb, feedback("acme"), std::string(), 400},
      {"an oversized idempotency key", "POST", fb, feedback("acme"), long_key, 400},
      {"a key with spaces", "POST", fb, feedback("acme"), std::string("a key"), 400},
      {"an unknown class", "POST", fb, json{{"tenant", "acme"}, {"question_id", "q"}, {"answer", "a"}, {"class", "gold"}}.dump(), key, 400},
      {"the batch class on the feedback endpoint", "POST", fb, json{{"tenant", "acme"}, {"question_id", "q"}, {"answer", "a"}, {"class", "batch"}}.dump(), key, 400},
      {"no tenant", "POST", fb, json{{"question_id", "q"}, {"answer", "a"}}.dump(), key, 400},
      {"a tenant of the wrong type", "POST", fb, json{{"tenant", 7}, {"question_id", "q"}, {"answer", "a"}}.dump(), key, 400},
      {"a tenant with a slash", "POST", fb, json{{"tenant", "a/b"}, {"question_id", "q"}, {"answer", "a"}}.dump(), key, 400},
      {"an unknown model", "POST", fb, json{{"tenant", "acme"}, {"question_id", "q"}, {"answer", "a"}, {"model", "gpt-9"}}.dump(), key, 400},
      {"an answer over 8 KiB", "POST", fb, json{{"tenant", "acme"}, {"question_id", "q"}, {"answer", std::string(9000, 'a')}}.dump(), key, 400},
      {"a huge body", "POST", fb, huge, key, 413},
      {"malformed JSON", "POST", b, "not json", key, 400},
      {"no idempotency key", "POST", b, batch("acme"), std::nullopt, 400},
      {"an oversized idempotency key", "POST", b, batch("acme"), long_key, 400},
      {"an unknown class", "POST", b, json{{"tenant", "acme"}, {"learner", "l"}, {"sessions", {"s"}}, {"class", "vip"}}.dump(), key, 400},
      {"no sessions", "POST", b, json{{"tenant", "acme"}, {"learner", "l"}, {"sessions", json::array()}}.dump(), key, 400},
      {"sessions of the wrong type", "POST", b, json{{"tenant", "acme"}, {"learner", "l"}, {"sessions", {1, 2}}}.dump(), key, 400},
      {"a huge body", "POST", b, huge, key, 413},
      {"a job id that is not a number", "GET", "/v1/batch/abc?tenant=acme", "", std::nullopt, 400},
      {"a negative job id", "GET", "/v1/batch/-3?tenant=acme", "", std::nullopt, 400},
      {"no tenant", "GET", "/v1/batch/1", "", std::nullopt, 400},
      {"a job that does not exist", "GET", "/v1/batch/999999?tenant=acme", "", std::nullopt, 404},
      {"malformed JSON", "POST", "/admin/breaker", "{", std::nullopt, 400},
      {"an unknown mode", "POST", "/admin/breaker", R"({"mode":"sideways"})", std::nullopt, 400},
      {"an unknown provider", "POST", "/admin/breaker", R"({"provider":"other","mode":"open"})", std::nullopt, 404},
      {"an unknown class", "POST", "/admin/shed", R"({"class":"gold","shed":true})", std::nullopt, 400},
      {"shed not a boolean", "POST", "/admin/shed", R"({"class":"batch","shed":"yes"})", std::nullopt, 400},
      {"the recovery class", "POST", "/admin/shed", R"({"class":"recovery","shed":true})", std::nullopt, 400},
      {"an unknown fault", "POST", "/admin/fault", R"({"kind":"meteor"})", std::nullopt, 400},
      {"a slowdown below 1", "POST", "/admin/fault", R"({"kind":"slowdown","factor":0.5})", std::nullopt, 400},
      {"a ratio that is not a number", "POST", "/admin/fault", R"({"kind":"outage","ratio":"all"})", std::nullopt, 400},
      {"a negative retry-after", "POST", "/admin/fault", R"({"kind":"rate_limit","retry_after_ms":-1})", std::nullopt, 400},
      {"a huge body", "POST", "/admin/fault", huge, std::nullopt, 413},
      {"an unknown path", "GET", "/v2/everything", "", std::nullopt, 404},
  };
  const gateway::provider_figures before = core.provider().figures();
  for (const bad& t : cases) {
    INFO(t.method << " " << t.path.substr(0, 40) << ": " << t.what);
    const http_result r = t.method == "GET" ? c.get(t.path) : c.post(t.path, t.body, t.key ? &*t.key : nullptr);
    CHECK(r.status == t.status);
    REQUIRE(r.body.is_object());
    REQUIRE(r.body.contains("error"));
    CHECK(!r.body["error"]["message"].get<std::string>().empty());
  }
  // Nothing changed: no provider call, no job, no effect, no recorded request,
  // no operator state; the keys used above are still free.
  CHECK(core.provider().figures().calls == before.calls);
  CHECK(core.queue().counts().value().total() == 0);
  CHECK(core.effects().count("feedback").value() == 0);
  CHECK(core.provider_breaker().state() == keel::breaker_state::closed);
  CHECK(core.provider().current_fault().kind == gateway::fault_kind::none);
  for (const keel::slo_report& s : core.slos().report(core.clock().now())) CHECK(s.in_window.requests() == 0);
  const http_result health = c.get("/healthz");
  CHECK(health.body["shed"].empty());
  const http_result fresh = c.post_key(fb, feedback("acme"), key);
  CHECK(fresh.status == 200);
  CHECK(fresh.body["replayed"] == false);
  const http_result job = c.post_key(b, batch("acme"), key);
  CHECK(job.status == 202);
  CHECK(job.body["created"] == true);
  svc->stop();
}

TEST_CASE("operator controls: force the breaker, shed a class, switch the provider's faults",
          "[service][http][operator]") {
  temp_dir dir;
  gateway::gateway_options o = keel_service::options(dir.path());
  o.batch_workers = 0;
  // A fast provider: its answers (valid or not) come far inside every
  // timeout, however loaded the machine, so each reply says what the fault did.
  o.provider.median_latency = 5ms;
  auto svc = start(o);
  client c(svc->port());
  auto& core = svc->core();
  int n = 0;
  auto next_key = [&] { return "op-" + std::to_string(++n); };

  SECTION("forced open: no call reaches the provider; answers are degraded and say why; auto probes first") {
    REQUIRE(c.post("/admin/breaker", R"({"mode":"open"})").body["state"] == "forced-open");
    const std::int64_t calls = core.provider().figures().calls;
    const http_result r = c.post_key("/v1/feedback", feedback("acme"), next_key());
    REQUIRE(r.status == 200);
    CHECK(r.body["degraded"] == true);
    CHECK(r.body["served_by"] == "rubric-feedback");
    CHECK(r.body["note"].get<std::string>().find("forced-open") != std::string::npos);
    const http_result strict = c.post_key("/v1/feedback", feedback("strict"), next_key());
    CHECK(strict.status == 503);
    CHECK(strict.body["error"]["refused_by"] == "breaker:endpoint=sim-llm");
    CHECK(core.provider().figures().calls == calls);
    CHECK(c.get("/healthz").body["status"] == "degraded");
    // Back to automatic: half-open, so recovery is verified by probes.
    CHECK(c.post("/admin/breaker", R"({"mode":"auto"})").body["state"] == "half-open");
    for (int i = 0; i < o.breaker.half_open_probes; ++i) {
      CHECK(c.post_key("/v1/feedback", feedback("acme"), next_key()).body["degraded"] == false);
    }
    CHECK(core.provider_breaker().state() == keel::breaker_state::closed);
  }

  SECTION("forced closed: the breaker counts nothing, even through an outage") {
    REQUIRE(c.post("/admin/breaker", R"({"mode":"closed"})").body["state"] == "forced-closed");
    REQUIRE(c.post("/admin/fault", R"({"kind":"outage"})").status == 200);
    for (int i = 0; i < o.breaker.minimum_calls + 2; ++i) {
      CHECK(c.post_key("/v1/feedback", feedback("acme"), next_key()).body["degraded"] == true);
    }
    CHECK(core.provider_breaker().state() == keel::breaker_state::forced_closed);
    CHECK(c.post("/admin/breaker", R"({"mode":"auto"})").body["state"] == "closed");
  }

  SECTION("shedding a class refuses it at once, with a retry hint; the other class is untouched") {
    REQUIRE(c.post("/admin/shed", R"({"class":"interactive","shed":true})").status == 200);
    const http_result shed = c.post_key("/v1/feedback", feedback("acme"), next_key());
    CHECK(shed.status == 503);
    CHECK(shed.retry_after);
    CHECK(shed.body["error"]["refused_by"] == "shed:interactive");
    CHECK(c.post_key("/v1/batch", batch("acme"), next_key()).status == 202);
    REQUIRE(c.post("/admin/shed", R"({"class":"batch","shed":true})").status == 200);
    CHECK(c.post_key("/v1/batch", batch("acme", "learner-2"), next_key()).body["error"]["refused_by"] ==
          "shed:batch");
    CHECK(core.queue().counts().value().total() == 1);
    const json health = c.get("/healthz").body;
    CHECK(health["shed"] == json({"interactive", "batch"}));
    REQUIRE(c.post("/admin/shed", R"({"class":"interactive","shed":false})").status == 200);
    CHECK(c.post_key("/v1/feedback", feedback("acme"), next_key()).status == 200);
    const std::string text = c.get("/metrics").text;
    CHECK(metric(text, R"(gateway_rejections_total{class="interactive",reason="shed"})") == 1);
    CHECK(metric(text, R"(gateway_shed{class="batch"})") == 1);
  }

  SECTION("faults switched at run time: invalid output and rate limits end in honest degraded answers") {
    REQUIRE(c.post("/admin/fault", R"({"kind":"invalid_output"})").status == 200);
    const http_result invalid = c.post_key("/v1/feedback", feedback("acme"), next_key());
    INFO(invalid.text);
    CHECK(invalid.body["degraded"] == true);
    CHECK(invalid.body["note"].get<std::string>().find("broke the contract") != std::string::npos);
    // A 429 asking for longer than the model stage has: not waited for.
    REQUIRE(c.post("/admin/fault", R"({"kind":"rate_limit","retry_after_ms":5000})").status == 200);
    const http_result limited = c.post_key("/v1/feedback", feedback("acme"), next_key());
    INFO(limited.text);
    CHECK(limited.body["degraded"] == true);
    CHECK(limited.body["note"].get<std::string>().find("429") != std::string::npos);
    CHECK(limited.body["attempts"] == 2);  // the rubric read and one model attempt
    REQUIRE(c.post("/admin/fault", R"({"kind":"none"})").status == 200);
    CHECK(c.post_key("/v1/feedback", feedback("acme"), next_key()).body["degraded"] == false);
    const std::string text = c.get("/metrics").text;
    CHECK(metric(text, R"(gateway_provider_calls_total{result="invalid_output"})") >= 1);
    CHECK(metric(text, R"(keel_fallbacks_total{path="rubric-feedback"})") >= 2);
  }
  svc->stop();
}

// ---- batch workers in child processes ---------------------------------------

namespace {

gateway::gateway_options worker_options(const std::string& dir) {
  gateway::gateway_options o = keel_service::options(dir);
  o.batch_workers = 0;        // the gateway itself runs none: the children do
  o.batch_lease = 600ms;      // a dead worker's job is taken over this long after its last renewal
  o.provider.spread = 0;
  return o;
}

}  // namespace

// The child: a batch worker process. KEEL_SERVICE_MODE:
//   drain         run jobs until the queue has nothing live, then exit 0
//   run           run jobs until killed
//   hold          like run, but after delivering a report, wait forever
//                 (until killed) before completing the job
// Progress lines ("start <id>", "delivered <id>", "already-delivered <id>",
// "outcome <id> <state>") go to KEEL_SERVICE_OUT.
TEST_CASE("service child process", "[.][child]") {
  const std::string dir = keel_service::child_env("DIR"), out = keel_service::child_env("OUT"),
                    mode = keel_service::child_env("MODE");
  gateway::gateway_options o = worker_options(dir);
  o.provider.median_latency = std::chrono::milliseconds(std::stoi(keel_service::child_env("LATENCY_MS")));
  auto w = gateway::worker_process<keel::sqlite_job_store<>>::open(
      o, [](const std::string& path) { return keel::sqlite_job_store<>::open(path); });
  if (!w.ok()) {
    keel_service::append_line(out, "open-failed " + std::string(w.status().message()));
    std::_Exit(2);
  }
  (*w)->workers().set_progress_hook([&](std::string_view event, std::int64_t id) {
    keel_service::append_line(out, std::string(event) + " " + std::to_string(id));
    if (mode == "hold" && event == "delivered") {
      for (;;) std::this_thread::sleep_for(1s);  // killed here, before completing
    }
  });
  for (;;) {
    std::optional<keel::job_outcome> r = (*w)->workers().run_once({});
    if (r) {
      keel_service::append_line(out, "outcome " + std::to_string(r->id) + " " +
                                         std::string(keel::to_string(r->state)) + (r->lost ? " lost" : ""));
      continue;
    }
    if (mode == "drain") {
      absl::StatusOr<keel::job_counts> c = (*w)->queue().counts();
      if (c.ok() && c->queued + c->running == 0) break;
    }
    std::this_thread::sleep_for(10ms);
  }
  SUCCEED();
}

TEST_CASE("a batch worker SIGKILLed mid-job loses nothing: the job is taken over and done once",
          "[service][http][process]") {
  temp_dir dir;
  const gateway::gateway_options o = worker_options(dir.path());
  auto svc = start(o);
  client c(svc->port());
  constexpr int kJobs = 5;
  std::vector<std::int64_t> ids;
  for (int i = 0; i < kJobs; ++i) {
    const http_result r = c.post_key("/v1/batch", batch("acme", "learner-" + std::to_string(i)),
                                     "report-" + std::to_string(i));
    REQUIRE(r.status == 202);
    ids.push_back(r.body["job_id"].get<std::int64_t>());
  }

  // Worker 1 takes the first job and is killed while the model works on it.
  const std::string out1 = dir.file("worker1.log");
  const pid_t w1 = keel_service::spawn_child(
      {{"DIR", dir.path()}, {"OUT", out1}, {"MODE", "run"}, {"LATENCY_MS", "300"}});
  const std::string started = keel_service::await_text(out1, "start ");
  REQUIRE(started.find("start ") != std::string::npos);
  const std::int64_t killed_job = std::stoll(started.substr(started.find("start ") + 6));
  ::kill(w1, SIGKILL);
  CHECK(keel_service::wait_child(w1) == 128 + SIGKILL);

  // Worker 2 drains the queue: it takes the dead worker's job over once its lease lapses.
  const std::string out2 = dir.file("worker2.log");
  const pid_t w2 = keel_service::spawn_child(
      {{"DIR", dir.path()}, {"OUT", out2}, {"MODE", "drain"}, {"LATENCY_MS", "20"}});
  CHECK(keel_service::wait_child(w2) == 0);

  const keel::job_counts counts = svc->core().queue().counts().value();
  CHECK(counts.done == kJobs);
  CHECK(counts.failed == 0);
  for (std::int64_t id : ids) {
    const http_result st = c.get("/v1/batch/" + std::to_string(id) + "?tenant=acme");
    INFO("job " << id);
    REQUIRE(st.status == 200);
    CHECK(st.body["state"] == "done");
    CHECK(st.body["report"]["job_id"] == id);
    if (id == killed_job) {
      CHECK(st.body["attempts"] == 2);
      CHECK(st.body["took_over"] == true);
      CHECK(st.body["fence"] == 2);
    } else {
      CHECK(st.body["attempts"] == 1);
    }
  }
  // Every report delivered exactly once; the killed worker never got that far.
  auto& effects = svc->core().effects();
  CHECK(effects.count("report").value() == kJobs);
  CHECK(effects.duplicated_keys("report").value() == 0);
  CHECK(effects.delivery_attempts().value() == kJobs);
  svc->stop();
}

TEST_CASE("a worker killed after delivering, before completing: the takeover's delivery is absorbed",
          "[service][http][process]") {
  temp_dir dir;
  const gateway::gateway_options o = worker_options(dir.path());
  auto svc = start(o);
  client c(svc->port());
  const http_result submitted = c.post_key("/v1/batch", batch("acme"), "report-x");
  REQUIRE(submitted.status == 202);
  const std::int64_t id = submitted.body["job_id"].get<std::int64_t>();

  const std::string out1 = dir.file("worker1.log");
  const pid_t w1 = keel_service::spawn_child(
      {{"DIR", dir.path()}, {"OUT", out1}, {"MODE", "hold"}, {"LATENCY_MS", "20"}});
  REQUIRE(keel_service::await_text(out1, "delivered ").find("delivered " + std::to_string(id)) != std::string::npos);
  ::kill(w1, SIGKILL);
  CHECK(keel_service::wait_child(w1) == 128 + SIGKILL);

  const std::string out2 = dir.file("worker2.log");
  const pid_t w2 = keel_service::spawn_child(
      {{"DIR", dir.path()}, {"OUT", out2}, {"MODE", "drain"}, {"LATENCY_MS", "20"}});
  CHECK(keel_service::wait_child(w2) == 0);
  CHECK(keel_service::read_file(out2).find("already-delivered " + std::to_string(id)) != std::string::npos);

  const http_result st = c.get("/v1/batch/" + std::to_string(id) + "?tenant=acme");
  REQUIRE(st.status == 200);
  CHECK(st.body["state"] == "done");
  CHECK(st.body["fence"] == 2);
  // The job's result is the report the learner has: the first worker's.
  CHECK(st.body["report"]["fence"] == 1);
  auto& effects = svc->core().effects();
  CHECK(effects.count("report", "acme", "report-x").value() == 1);
  CHECK(effects.delivery_attempts().value() == 2);
  // The same submission again is the same job, not a second one.
  const http_result again = c.post_key("/v1/batch", batch("acme"), "report-x");
  CHECK(again.status == 200);
  CHECK(again.body["job_id"] == id);
  CHECK(again.body["replayed"] == true);
  CHECK(c.post_key("/v1/batch", batch("acme", "someone-else"), "report-x").status == 409);
  svc->stop();
}

// ---- the gateway under hostile clients (issue 16) ----------------------------
//
// Each client below does what a hostile but realistic one would, with raw
// bytes (keel_service::raw_connection) where an HTTP library would tidy them.

namespace {

using keel_service::raw_connection;

std::string head_of(const std::string& method, const std::string& path, const std::string& headers) {
  return method + " " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\n" + headers + "\r\n";
}

json error_of(const raw_connection::response& r) {
  const json j = json::parse(r.body, nullptr, false);
  return j.is_object() && j.contains("error") ? j["error"] : json();
}

}  // namespace

TEST_CASE("hostile bodies: a chunked body past the limit and an encoded body are refused before they are read",
          "[service][http][hostile]") {
  temp_dir dir;
  gateway::gateway_options o = keel_service::options(dir.path());
  o.batch_workers = 0;
  auto svc = start(o);
  auto& core = svc->core();
  const std::string chunk(64 * 1024, 'x');
  const std::string framed_chunk = "10000\r\n" + chunk + "\r\n";  // 0x10000 = 64 KiB

  SECTION("chunked, 100 MB offered: 413 after the first 64 KiB, and memory does not grow with the body") {
    const std::int64_t rss_before = keel_service::rss_bytes();
    raw_connection c(svc->port());
    REQUIRE(c.send(head_of("POST", "/v1/feedback",
                           "Idempotency-Key: big-1\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n")));
    // Keep sending until the gateway answers or stops taking bytes.
    std::uint64_t offered = 0;
    while (offered < 100ull * 1024 * 1024 && !c.readable()) {
      if (!c.send(framed_chunk, 2s)) break;
      offered += chunk.size();
    }
    const raw_connection::response r = c.read_response();
    const std::int64_t rss_after = keel_service::rss_bytes();
    INFO(r.head << "\n" << r.body << "\noffered " << offered << " bytes; RSS " << rss_before << " -> " << rss_after);
    REQUIRE(r.status == 413);
    const json e = error_of(r);
    CHECK(e["refused_by"] == "http:body_too_large");
    const std::string message = e["message"].get<std::string>();
    CHECK(message.find("chunked") != std::string::npos);
    CHECK(message.find("65536") != std::string::npos);
    CHECK(message.find("max_body_bytes") != std::string::npos);
    CHECK(r.has_header("Connection: close"));
    // Refused while most of the 100 MB was still with the client.
    CHECK(offered < 64ull * 1024 * 1024);
    // The gateway held at most its limit of it: no growth anywhere near the body's size.
    CHECK(rss_after - rss_before < 32 * 1024 * 1024);
  }

  SECTION("a chunk size that alone exceeds the limit is refused before its data") {
    raw_connection c(svc->port());
    REQUIRE(c.send(head_of("POST", "/v1/feedback", "Idempotency-Key: big-2\r\nTransfer-Encoding: chunked\r\n") +
                   "6400000\r\n"));  // 100 MiB in one chunk
    const raw_connection::response r = c.read_response();
    REQUIRE(r.status == 413);
    CHECK(error_of(r)["refused_by"] == "http:body_too_large");
  }

  SECTION("a Content-Length of 100 MB: 413 from the head alone") {
    raw_connection c(svc->port());
    REQUIRE(c.send(head_of("POST", "/v1/batch", "Idempotency-Key: big-3\r\nContent-Length: 104857600\r\n")));
    const raw_connection::response r = c.read_response();
    REQUIRE(r.status == 413);
    const std::string message = error_of(r)["message"].get<std::string>();
    CHECK(message.find("104857600") != std::string::npos);
    CHECK(message.find("65536") != std::string::npos);
  }

  SECTION("a gzip body (58 KB that would inflate to 60 MB): 415, never inflated") {
    raw_connection c(svc->port());
    const std::string gz(58 * 1024, '\x1f');
    REQUIRE(c.send(head_of("POST", "/v1/feedback",
                           "Idempotency-Key: gz-1\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\n"
                           "Content-Length: " + std::to_string(gz.size()) + "\r\n")));
    (void)c.send(gz, 2s);  // the gateway may have answered and stopped reading already
    const raw_connection::response r = c.read_response();
    REQUIRE(r.status == 415);
    const json e = error_of(r);
    CHECK(e["refused_by"] == "http:encoded_body");
    CHECK(e["message"].get<std::string>().find("Content-Encoding 'gzip'") != std::string::npos);
  }

  SECTION("Transfer-Encoding other than chunked: 415; both framings at once: 400") {
    raw_connection a(svc->port());
    REQUIRE(a.send(head_of("POST", "/v1/feedback", "Idempotency-Key: gz-2\r\nTransfer-Encoding: gzip, chunked\r\n")));
    CHECK(a.read_response().status == 415);
    raw_connection b(svc->port());
    REQUIRE(b.send(head_of("POST", "/v1/feedback",
                           "Idempotency-Key: gz-3\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n")));
    CHECK(b.read_response().status == 400);
  }

  SECTION("a chunked body within the limit is served") {
    raw_connection c(svc->port());
    const std::string body = feedback("acme");
    std::string framed;
    for (std::size_t at = 0; at < body.size(); at += 10) {
      const std::string part = body.substr(at, 10);
      char size[16];
      std::snprintf(size, sizeof size, "%zx", part.size());
      framed += std::string(size) + "\r\n" + part + "\r\n";
    }
    framed += "0\r\n\r\n";
    REQUIRE(c.send(head_of("POST", "/v1/feedback", "Idempotency-Key: chunked-ok\r\nTransfer-Encoding: chunked\r\n") +
                   framed));
    const raw_connection::response r = c.read_response();
    INFO(r.body);
    CHECK(r.status == 200);
  }
  // Nothing refused reached the gateway's logic.
  CHECK(core.effects().count("feedback", "acme", "big-1").value() == 0);
  CHECK(core.queue().counts().value().total() == 0);
  svc->stop();
}

TEST_CASE("slow clients: 100 trickling connections hold no worker; health and admin answer; each is cut per request",
          "[service][http][hostile]") {
  temp_dir dir;
  gateway::gateway_options o = keel_service::options(dir.path());
  o.batch_workers = 0;
  o.http_threads = 8;  // fewer workers than slow clients by far
  o.http_header_timeout = 3s;
  o.http_body_timeout = 2s;
  o.provider.median_latency = 5ms;
  auto svc = start(o);
  const int port = svc->port();
  constexpr int kSlow = 100, kSlowBodies = 5;

  // 100 heads and 5 bodies, one byte per connection every 100 ms.
  std::vector<std::unique_ptr<raw_connection>> slow;
  std::vector<std::chrono::steady_clock::time_point> first_byte;
  for (int i = 0; i < kSlow + kSlowBodies; ++i) {
    slow.push_back(std::make_unique<raw_connection>(port));
    const bool body = i >= kSlow;
    // Read before the send: the server's clock starts when the byte lands,
    // which a thread preempted after send() would otherwise read as later.
    first_byte.push_back(std::chrono::steady_clock::now());
    REQUIRE(slow.back()->send(body ? head_of("POST", "/v1/feedback", "Idempotency-Key: slow-body\r\nContent-Length: 1000\r\n")
                                   : "POST /v1/feedback HTTP/1.1\r\nX-Slow: "));
  }
  std::atomic<bool> trickling{true};
  std::thread trickle([&] {
    while (trickling.load()) {
      for (auto& c : slow) (void)c->send("a", 0ms);  // a connection the gateway closed just fails
      std::this_thread::sleep_for(100ms);
    }
  });

  // While they trickle: the front door holds them all, and everyone else is served.
  client c(port);
  const http_result health = c.get("/healthz");
  const http_result shed = c.post("/admin/shed", R"({"class":"batch","shed":false})");
  const gateway::http_server_figures during = svc->http_figures();  // no ordinary request sent yet
  const http_result answer = c.post_key("/v1/feedback", feedback("acme"), "fast-1");
  INFO(health.text);
  CHECK(health.status == 200);
  CHECK(health.body["http"]["connections"].get<int>() >= kSlow + kSlowBodies);
  CHECK(shed.status == 200);
  CHECK(answer.status == 200);
  CHECK(during.connections >= kSlow + kSlowBodies);
  CHECK(during.busy + during.queued == 0);  // not one worker held by a slow client

  // Each is cut when its request's time is up, although a byte came every 100 ms.
  int heads_cut = 0, bodies_cut = 0;
  for (int i = 0; i < kSlow + kSlowBodies; ++i) {
    const raw_connection::response r = slow[i]->read_response(30s);
    const auto waited = std::chrono::steady_clock::now() - first_byte[i];
    const bool body = i >= kSlow;
    INFO("slow client " << i << ": " << r.head << " " << r.body);
    CHECK(r.status == 408);
    CHECK(error_of(r)["refused_by"] == (body ? "http:body_timeout" : "http:header_timeout"));
    CHECK(waited >= (body ? o.http_body_timeout : o.http_header_timeout));
    (body ? bodies_cut : heads_cut) += r.status == 408;
  }
  trickling.store(false);
  trickle.join();
  CHECK(heads_cut == kSlow);
  CHECK(bodies_cut == kSlowBodies);
  const std::string text = c.get("/metrics").text;
  CHECK(metric(text, R"(gateway_http_requests_total{endpoint="feedback",code="408"})") == kSlow + kSlowBodies);
  CHECK(metric(text, R"(gateway_http_refusals_total{reason="header_timeout"})") == kSlow);
  CHECK(metric(text, R"(gateway_http_refusals_total{reason="body_timeout"})") == kSlowBodies);
  svc->stop();
}

TEST_CASE("blank lines before a request do not hold an idle connection past its idle time",
          "[service][http][hostile]") {
  temp_dir dir;
  gateway::gateway_options o = keel_service::options(dir.path());
  o.batch_workers = 0;
  o.http_idle_timeout = 1s;
  o.http_header_timeout = 5s;  // longer than the idle time: only the idle clock may cut it
  auto svc = start(o);
  raw_connection c(svc->port());
  const auto opened = std::chrono::steady_clock::now();
  // "\r\n" every 100 ms: allowed before a request line (RFC 9112 2.2), but not a request.
  bool closed = false;
  while (!closed && std::chrono::steady_clock::now() - opened < 10s) {
    (void)c.send("\r\n", 0ms);
    closed = c.closed_by_peer(100ms);
  }
  const auto held = std::chrono::steady_clock::now() - opened;
  INFO("held " << std::chrono::duration_cast<std::chrono::milliseconds>(held).count() << " ms");
  CHECK(closed);
  CHECK(held >= o.http_idle_timeout);
  CHECK(held < o.http_header_timeout);
  // A connection idle the same way that then sends a request is served.
  raw_connection d(svc->port());
  REQUIRE(d.send("\r\n" + head_of("GET", "/healthz", "")));
  CHECK(d.read_response().status == 200);
  svc->stop();
}

TEST_CASE("the reserved lane: with every ordinary worker busy, /healthz and /admin still answer; excess is a named 503",
          "[service][http][hostile]") {
  temp_dir dir;
  gateway::gateway_options o;
  o.data_dir = dir.path();
  gateway::scale_time(o, 2.0);  // a 6 s deadline, a 2 s model stage: stalled requests hold their workers for long
  o.batch_workers = 0;
  o.http_threads = 4;
  o.http_queue = 2;
  auto svc = start(o);
  const int port = svc->port();
  client admin(port);
  REQUIRE(admin.post("/admin/fault", R"({"kind":"stall"})").status == 200);

  // Four stalled requests take the four ordinary workers, two more wait.
  std::vector<std::thread> held;
  std::vector<int> statuses(6, 0);
  for (int i = 0; i < 6; ++i) {
    held.emplace_back([&, i] {
      client c(port);
      statuses[i] = c.post_key("/v1/feedback", feedback("acme"), "held-" + std::to_string(i)).status;
    });
  }
  const auto until = std::chrono::steady_clock::now() + 20s;
  gateway::http_server_figures f;
  while (std::chrono::steady_clock::now() < until) {
    f = svc->http_figures();
    if (f.busy == 4 && f.queued == 2) break;
    std::this_thread::sleep_for(5ms);
  }
  UNSCOPED_INFO("ordinary lane: " << f.busy << " busy, " << f.queued << " queued");
  // A seventh finds the lane full: refused at once, naming the limit.
  client extra(port);
  const http_result refused = extra.post_key("/v1/feedback", feedback("acme"), "held-7");
  // The operator's requests have workers of their own.
  const http_result health = admin.get("/healthz");
  const http_result fault = admin.post("/admin/fault", R"({"kind":"none"})");
  const gateway::http_server_figures still = svc->http_figures();
  for (std::thread& t : held) t.join();

  REQUIRE(f.busy == 4);
  REQUIRE(f.queued == 2);
  INFO(refused.text);
  CHECK(refused.status == 503);
  CHECK(refused.body["error"]["refused_by"] == "http:busy");
  CHECK(refused.retry_after);
  CHECK(health.status == 200);
  CHECK(health.body["http"]["busy"] == 4);
  CHECK(fault.status == 200);
  CHECK(still.busy == 4);  // all of it while the ordinary lane was still full
  for (int s : statuses) CHECK(s == 200);  // the held ones end as degraded answers, within their deadline
  const std::string text = admin.get("/metrics").text;
  CHECK(metric(text, R"(gateway_http_requests_total{endpoint="feedback",code="503"})") == 1);
  CHECK(metric(text, R"(gateway_http_refusals_total{reason="busy"})") == 1);
  svc->stop();
}

TEST_CASE("a burst of 500 connects: the backlog holds them and every one is answered", "[service][http][hostile]") {
  temp_dir dir;
  gateway::gateway_options o = keel_service::options(dir.path());
  o.batch_workers = 0;
  auto svc = start(o);
  // What the kernel gives the listener: the gateway asked for 1024 (at most net.core.somaxconn).
  const int backlog = keel_service::listen_backlog(svc->port());
  INFO("listen backlog " << backlog);
  CHECK(backlog >= 500);

  constexpr int kBurst = 500;
  std::vector<std::unique_ptr<raw_connection>> burst;
  for (int i = 0; i < kBurst; ++i) burst.push_back(std::make_unique<raw_connection>(svc->port(), false));
  int connected = 0, answered = 0;
  for (auto& c : burst) {
    if (!c->connected(30s)) continue;
    ++connected;
    (void)c->send(head_of("GET", "/v2/nothing", "Connection: close\r\n"));
  }
  for (auto& c : burst) {
    const raw_connection::response r = c->read_response(60s);
    answered += r.status == 404 || r.status == 503;  // not found, or the lane's queue full: an answer either way
  }
  CHECK(connected == kBurst);
  CHECK(answered == kBurst);
  svc->stop();
}

TEST_CASE("idempotency keys are the bytes that were sent: no NUL truncation, no %xx decoding",
          "[service][http][hostile]") {
  temp_dir dir;
  gateway::gateway_options o = keel_service::options(dir.path());
  o.batch_workers = 0;
  o.provider.median_latency = 5ms;
  auto svc = start(o);
  auto& core = svc->core();
  const std::string body = feedback("acme");
  auto post_raw = [&](const std::string& key_header) {
    raw_connection c(svc->port());
    (void)c.send(head_of("POST", "/v1/feedback",
                         key_header + "Content-Type: application/json\r\nContent-Length: " +
                             std::to_string(body.size()) + "\r\n") +
                 body);
    return c.read_response();
  };

  // A NUL in a header: refused, so u1\0AAA and u1\0BBB can never be one key.
  for (const std::string& key : {std::string("u1\0AAA", 6), std::string("u1\0BBB", 6)}) {
    const raw_connection::response r = post_raw("Idempotency-Key: " + key + "\r\n");
    INFO(r.body);
    CHECK(r.status == 400);
    CHECK(error_of(r)["message"].get<std::string>().find("NUL") != std::string::npos);
  }
  CHECK(core.effects().count("feedback", "acme", "u1").value() == 0);

  // pct%41 is not pctA: two keys, two decisions.
  const raw_connection::response pct = post_raw("Idempotency-Key: pct%41\r\n");
  const raw_connection::response plain = post_raw("Idempotency-Key: pctA\r\n");
  const json a = json::parse(pct.body, nullptr, false), b = json::parse(plain.body, nullptr, false);
  REQUIRE(pct.status == 200);
  REQUIRE(plain.status == 200);
  CHECK(a["replayed"] == false);
  CHECK(b["replayed"] == false);
  CHECK(a["decision_id"] != b["decision_id"]);
  CHECK(core.effects().count("feedback", "acme", "pct%41").value() == 1);
  CHECK(core.effects().count("feedback", "acme", "pctA").value() == 1);
  // ...and pct%41 again is a replay of its own decision.
  const raw_connection::response again = post_raw("Idempotency-Key: pct%41\r\n");
  CHECK(json::parse(again.body, nullptr, false)["decision_id"] == a["decision_id"]);

  // Two keys on one request are not one key; a control byte is refused too.
  CHECK(post_raw("Idempotency-Key: k-1\r\nIdempotency-Key: k-2\r\n").status == 400);
  CHECK(post_raw("Idempotency-Key: k\x01x\r\n").status == 400);
  svc->stop();
}

TEST_CASE("bodies: JSON followed by NUL and garbage is refused; 413 names the real limit; a form content type is no limit",
          "[service][http][hostile]") {
  temp_dir dir;
  gateway::gateway_options o = keel_service::options(dir.path());
  o.batch_workers = 0;
  o.provider.median_latency = 5ms;
  auto svc = start(o);
  auto& core = svc->core();
  httplib::Client c("127.0.0.1", svc->port());
  c.set_read_timeout(10s);
  auto post = [&](const std::string& path, const std::string& body, const std::string& key, const char* type) {
    return result_of(c.Post(path.c_str(), httplib::Headers{{"Idempotency-Key", key}}, body, type));
  };

  const http_result nul = post("/v1/feedback", feedback("acme") + std::string("\0garbage", 8), "nul-1", "application/json");
  INFO(nul.text);
  CHECK(nul.status == 400);
  CHECK(nul.body["error"]["message"].get<std::string>().find("NUL") != std::string::npos);
  CHECK(post("/v1/batch", batch("acme") + std::string("\0{}", 3), "nul-2", "application/json").status == 400);
  CHECK(core.effects().count("feedback").value() == 0);
  CHECK(core.queue().counts().value().total() == 0);

  // A valid 20 KB request with curl's default content type (form-encoded): served.
  const std::string answer(7000, 'a');
  std::string big = json{{"tenant", "acme"}, {"question_id", "q-timeouts"}, {"answer", answer},
                         {"padding", std::string(13000, ' ')}}.dump();
  REQUIRE(big.size() > 20000);
  const http_result form = post("/v1/feedback", big, "form-1", "application/x-www-form-urlencoded");
  INFO(form.text);
  CHECK(form.status == 200);
  // Over keel's limit: the message names that limit and the body's size.
  const std::string huge(70000, ' ');
  const http_result over = post("/v1/feedback", "{" + huge + "}", "form-2", "application/x-www-form-urlencoded");
  CHECK(over.status == 413);
  const std::string message = over.body["error"]["message"].get<std::string>();
  CHECK(message.find("70002 bytes") != std::string::npos);
  CHECK(message.find("65536") != std::string::npos);
  CHECK(message.find("max_body_bytes") != std::string::npos);

  // The front door's refusals are counted with every other reply.
  const std::string text = client(svc->port()).get("/metrics").text;
  CHECK(metric(text, R"(gateway_http_requests_total{endpoint="feedback",code="413"})") == 1);
  CHECK(metric(text, R"(gateway_http_requests_total{endpoint="feedback",code="400"})") == 1);
  CHECK(metric(text, R"(gateway_http_refusals_total{reason="body_too_large"})") == 1);
  svc->stop();
}

#ifdef KEEL_GATEWAY_CLI
TEST_CASE("gateway --serve: a port out of range or not a number is refused; the serving line comes at once",
          "[service][http][hostile][cli]") {
  temp_dir dir;
  for (const char* bad : {"70000", "abc", "-1", "80x", ""}) {
    INFO("--serve '" << bad << "'");
    const pid_t pid = keel_service::spawn_program({KEEL_GATEWAY_CLI, "--serve", bad, dir.path()},
                                                  dir.file("out.txt"), dir.file("err.txt"));
    CHECK(keel_service::wait_child(pid) == 2);
    const std::string err = keel_service::read_file(dir.file("err.txt"));
    CHECK(err.find("the port must be a number in [0, 65535]") != std::string::npos);
    CHECK(err.find(std::string("'") + bad + "'") != std::string::npos);
  }
  // --serve 0: a free port, and the line that names it while the gateway runs.
  const std::string out = dir.file("serve.txt");
  const pid_t pid = keel_service::spawn_program({KEEL_GATEWAY_CLI, "--serve", "0", dir.path()}, out,
                                                dir.file("serve.err"));
  const std::string line = keel_service::await_text(out, "Ctrl-C stops it");
  INFO(line << keel_service::read_file(dir.file("serve.err")));
  const std::size_t at = line.find("http://127.0.0.1:");
  REQUIRE(at != std::string::npos);
  const int port = std::stoi(line.substr(at + 17));
  CHECK(port > 0);
  CHECK(client(port).get("/healthz").status == 200);  // it is serving on the port it printed
  ::kill(pid, SIGTERM);
  CHECK(keel_service::wait_child(pid) == 0);
}
#endif

// The learner-history row and the decision are in two files; a crash between
// their commits (injected in a child process) is repaired by the retry.
TEST_CASE("service crash child", "[.][crash-child]") {
  gateway::gateway_options o = keel_service::options(keel_service::child_env("DIR"));
  o.batch_workers = 0;
  o.provider.median_latency = 5ms;
  auto core = gateway::gateway_core<keel::real_clock, keel::sqlite_job_store<>>::open(
      o, [](const std::string& path) { return keel::sqlite_job_store<>::open(path); });
  if (!core.ok()) std::_Exit(2);
  (*core)->set_effect_hook([](std::string_view stage) {
    if (stage == "decided") std::_Exit(3);  // the decision is committed, its row not yet written
  });
  const std::string key = "crash-1";
  (void)(*core)->feedback(feedback("acme"), std::string_view(key));
  std::_Exit(4);  // the hook never ran
}

TEST_CASE("a crash between the decision and its learner-history row: the retry replays the decision and writes the row",
          "[service][http][process][hostile]") {
  temp_dir dir;
  const pid_t pid = keel_test::spawn_self({.test_case = "service crash child", .env_prefix = "KEEL_SERVICE_",
                                           .vars = {{"DIR", dir.path()}}});
  REQUIRE(keel_service::wait_child(pid) == 3);

  gateway::gateway_options o = keel_service::options(dir.path());
  o.batch_workers = 0;
  o.provider.median_latency = 5ms;
  auto svc = start(o);
  auto& effects = svc->core().effects();
  CHECK(effects.count("feedback", "acme", "crash-1").value() == 0);  // the crash came between the two
  client c(svc->port());
  const http_result retry = c.post_key("/v1/feedback", feedback("acme"), "crash-1");
  INFO(retry.text);
  REQUIRE(retry.status == 200);
  CHECK(retry.body["replayed"] == true);  // the decision the crashed process committed
  CHECK(effects.count("feedback", "acme", "crash-1").value() == 1);
  // Further replays add nothing.
  CHECK(c.post_key("/v1/feedback", feedback("acme"), "crash-1").body["replayed"] == true);
  CHECK(effects.count("feedback", "acme", "crash-1").value() == 1);
  CHECK(effects.duplicated_keys("feedback").value() == 0);
  CHECK(metric(c.get("/metrics").text, "gateway_effects_replayed_total") == 1);
  svc->stop();
}

TEST_CASE("the front door's request framing: the same outcome however the bytes are split",
          "[service][http][hostile][parser]") {
  using parser = gateway::detail::request_parser;
  struct expected {
    std::string what, bytes;
    parser::state state;
    int status;             // for a refusal
    std::string body = {};  // for a request
  };
  const std::vector<expected> cases = {
      {"content-length", "POST /v1/feedback HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello", parser::state::done, 0, "hello"},
      {"chunked with an extension and a trailer",
       "POST /v1/batch HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5;x=1\r\nhello\r\n6\r\n world\r\n0\r\nT: x\r\n\r\n",
       parser::state::done, 0, "hello world"},
      {"chunked past the limit", "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n500\r\n", parser::state::failed, 413},
      {"chunks adding up past the limit",
       "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n200\r\n" + std::string(512, 'x') + "\r\n200\r\n" +
           std::string(512, 'x') + "\r\n1\r\n",
       parser::state::failed, 413},
      {"content-length past the limit", "POST / HTTP/1.1\r\nContent-Length: 1025\r\n\r\n", parser::state::failed, 413},
      {"gzip", "POST / HTTP/1.1\r\nContent-Encoding: gzip\r\nContent-Length: 2\r\n\r\nxx", parser::state::failed, 415},
      {"a NUL in a header", std::string("GET / HTTP/1.1\r\nIdempotency-Key: u1\0AAA\r\n\r\n", 43), parser::state::failed,
       400},
      {"a bare LF", "GET / HTTP/1.1\nHost: x\r\n\r\n", parser::state::failed, 400},
      {"an obsolete fold", "GET / HTTP/1.1\r\nA: b\r\n c\r\n\r\n", parser::state::failed, 400},
      {"both framings", "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 1\r\n\r\n",
       parser::state::failed, 400},
      {"lengths that disagree", "POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
       parser::state::failed, 400},
      {"a head past the limit", "GET / HTTP/1.1\r\nX: " + std::string(600, 'a') + "\r\n\r\n", parser::state::failed,
       431},
      {"HTTP/2 preface", "PRI * HTTP/2.0\r\n\r\n", parser::state::failed, 400},
      {"an unknown version", "GET / HTTP/3.0\r\n\r\n", parser::state::failed, 505},
      {"blank lines first", "\r\n\r\nGET /healthz HTTP/1.1\r\n\r\n", parser::state::done, 0, ""},
      {"a head still coming", "GET /healthz HTTP/1.1\r\nHost: x\r\n", parser::state::head, 0},
  };
  for (const expected& e : cases) {
    for (std::size_t step : {e.bytes.size() + 1, std::size_t{1}, std::size_t{3}, std::size_t{7}}) {
      INFO(e.what << ", fed " << step << " bytes at a time");
      parser p(1024, 512);
      std::size_t used = 0;
      while (used < e.bytes.size() && (p.current() == parser::state::head || p.current() == parser::state::body)) {
        used += p.feed(std::string_view(e.bytes).substr(used, step));
      }
      CHECK(p.current() == e.state);
      if (e.state == parser::state::failed) {
        CHECK(p.error().status == e.status);
        CHECK(!p.error().message.empty());
      }
      if (e.state == parser::state::done) {
        CHECK(p.request().body == e.body);
        CHECK(used == e.bytes.size());
      }
    }
  }
  // Raw bytes kept: no %xx decoding of the target or its query.
  parser p;
  p.feed("GET /v1/batch/7?tenant=ac%41me HTTP/1.1\r\nIdempotency-Key: pct%41\r\n\r\n");
  REQUIRE(p.current() == parser::state::done);
  CHECK(p.request().query_param("tenant") == "ac%41me");
  CHECK(p.request().header("idempotency-key") == "pct%41");
  // A pipelined request is left for the next parse.
  parser q;
  const std::string two = "GET /a HTTP/1.1\r\n\r\nGET /b HTTP/1.1\r\n\r\n";
  CHECK(q.feed(two) == two.size() / 2);
}

// --- the streaming endpoint through the front door ---------------------------

namespace {

// The body of a chunked response (after its head), and whether it ended
// with the last chunk.
std::pair<std::string, bool> dechunk(std::string_view in) {
  std::string body;
  for (;;) {
    const std::size_t eol = in.find("\r\n");
    if (eol == std::string_view::npos) return {body, false};
    const std::size_t n = std::stoul(std::string(in.substr(0, eol)), nullptr, 16);
    if (n == 0) return {body, in.substr(eol + 2, 2) == "\r\n"};
    if (in.size() < eol + 2 + n + 2) return {body, false};
    body.append(in.substr(eol + 2, n));
    in.remove_prefix(eol + 2 + n + 2);
  }
}

std::string chat_request(const std::string& body) {
  return "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " +
         std::to_string(body.size()) + "\r\n\r\n" + body;
}

std::string chat_body(int max_tokens) {
  return json{{"tenant", "acme"},
              {"messages", {{{"role", "user"}, {"content", "How long may one stage take?"}}}},
              {"max_tokens", max_tokens},
              {"stream", true}}
      .dump();
}

}  // namespace

TEST_CASE("a chat stream through the front door: chunked server-sent events that an SSE client reads whole",
          "[service][http][chat]") {
  temp_dir dir;
  gateway::gateway_options o = keel_service::options(dir.path());
  auto svc = start(o);
  raw_connection c(svc->port());
  REQUIRE(c.send(chat_request(chat_body(12))));
  const std::string got = c.read_until("\r\n0\r\n\r\n");
  const std::size_t head_end = got.find("\r\n\r\n");
  REQUIRE(head_end != std::string::npos);
  const std::string head = got.substr(0, head_end);
  CHECK(head.rfind("HTTP/1.1 200 ", 0) == 0);
  CHECK(head.find("Content-Type: text/event-stream") != std::string::npos);
  CHECK(head.find("Transfer-Encoding: chunked") != std::string::npos);
  CHECK(head.find("Content-Length") == std::string::npos);
  const auto [body, ended] = dechunk(std::string_view(got).substr(head_end + 4));
  CHECK(ended);

  // keel's own SSE parser, in pieces of 7 bytes: the gateway speaks the format.
  keel::sse_parser parser;
  std::string text;
  int contents = 0, roles = 0, usage = 0, done = 0;
  json keel_view;
  auto on = [&](const keel::chat_chunk& ch) {
    switch (ch.kind) {
      case keel::chunk_kind::content: text.append(ch.text); ++contents; break;
      case keel::chunk_kind::role: ++roles; break;
      case keel::chunk_kind::usage: ++usage; CHECK(ch.usage.completion_tokens == 12); break;
      case keel::chunk_kind::done: ++done; break;
      default: break;
    }
    return true;
  };
  for (std::size_t at = 0; at < body.size(); at += 7) REQUIRE(parser.feed(std::string_view(body).substr(at, 7), on).ok());
  CHECK(roles == 1);
  CHECK(contents == 12);
  CHECK(usage == 1);
  CHECK(done == 1);
  CHECK_FALSE(text.empty());
  const std::size_t k = body.find("\"keel\":");
  REQUIRE(k != std::string::npos);
  CHECK(body.find("\"complete\":true", k) != std::string::npos);

  // The stream ended properly: the kept-alive connection carries the next request.
  REQUIRE(c.send("GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"));
  const raw_connection::response h = c.read_response();
  CHECK(h.status == 200);
  CHECK(json::parse(h.body)["streams"]["committed"].get<int>() >= 1);

  SECTION("an error before the first token is an ordinary JSON reply with its status, not a stream") {
    client admin(svc->port());
    REQUIRE(admin.post("/admin/fault", R"({"kind":"outage"})").status == 200);
    REQUIRE(admin.post("/admin/fault", R"({"kind":"outage","provider":"sim-llm-backup"})").status == 200);
    raw_connection e(svc->port());
    REQUIRE(e.send(chat_request(chat_body(12))));
    const raw_connection::response r = e.read_response();
    CHECK(r.status == 503);
    CHECK(r.has_header("Content-Type: application/json"));
    CHECK_FALSE(r.has_header("chunked"));
    CHECK(json::parse(r.body)["error"]["message"].get<std::string>().find("503") != std::string::npos);
    CHECK(admin.post("/admin/fault", R"({"kind":"outage","provider":"sim-llm-3"})").status == 404);
  }
}

TEST_CASE("a client that hangs up mid-stream stops the upstream transfer within milliseconds",
          "[service][http][chat][cancel]") {
  temp_dir dir;
  gateway::gateway_options o = keel_service::options(dir.path());
  o.provider.stream_tokens = 4000;  // minutes of tokens: only the hang-up ends it
  o.chat.max_tokens_limit = 4096;
  o.chat.whole = 1h;
  o.chat.deadline = 2h;
  // No hedge: a first token in the simulation's slow tail (3% of streams)
  // would start one, and its stopped loser would count before the hang-up.
  o.chat.hedge_delay = 0ms;
  o.chat.hedge_percentile = 0;
  // Nor a stall cut: a 400 ms gap between tokens on a loaded sanitizer run
  // would stop the stream (and continue it elsewhere) before the hang-up.
  o.chat.stall = 10min;
  auto svc = start(o);
  raw_connection c(svc->port());
  REQUIRE(c.send(chat_request(chat_body(4000))));
  const std::string first = c.read_until("\"content\":\"", 30s);  // the first content token
  REQUIRE(first.find("\"content\":\"") != std::string::npos);
  REQUIRE(svc->core().provider().figures().streams_stopped == 0);
  const auto gone = std::chrono::steady_clock::now();
  c.close();
  const auto until = gone + 30s;
  while (svc->core().provider().figures().streams_stopped == 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(100us);
  }
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - gone).count();
  REQUIRE(svc->core().provider().figures().streams_stopped == 1);
  std::printf("chat hang-up to upstream stop: %.2f ms (token gap %.1f ms)\n", ms,
              std::chrono::duration<double, std::milli>(o.provider.token_gap).count());
  // Correctness bound, not a speed claim: well before the next token would have been written.
  CHECK(ms < std::chrono::duration<double, std::milli>(keel_service::http_slack).count());
  CHECK(svc->core().backup_provider().figures().streams == 0);  // a lost client is not continued
}

// --- the front door on Beast: what a hostile client's probe found -------------

namespace {

// This process's threads whose name starts with `prefix` (/proc/self/task/*/comm).
int threads_named(std::string_view prefix) {
  int n = 0;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream in(task.path() / "comm");
    std::string name;
    std::getline(in, name);
    n += name.rfind(prefix, 0) == 0 ? 1 : 0;
  }
  return n;
}

}  // namespace

TEST_CASE("Beast's leniencies are refused by the adapter, at once and however the bytes are split",
          "[service][http][hostile][parser]") {
  using parser = gateway::detail::request_parser;
  struct expected {
    std::string what, bytes;
    parser::state state;
    int status;  // for a refusal
  };
  std::string many_fields = "GET / HTTP/1.1\r\n";
  for (int i = 0; i < 101; ++i) many_fields += "X-" + std::to_string(i) + ": v\r\n";
  many_fields += "\r\n";
  const std::vector<expected> cases = {
      // Beast waits for a CRLF CRLF that never comes: a 408 after header_timeout.
      {"bare LF line endings throughout", "GET /healthz HTTP/1.1\nHost: x\n\n", parser::state::failed, 400},
      {"a bare LF ending the head", "GET /healthz HTTP/1.1\r\nHost: x\n\n", parser::state::failed, 400},
      {"a bare CR inside a value", "GET / HTTP/1.1\r\nA: b\rc\r\n\r\n", parser::state::failed, 400},
      // Beast reads a request with a Transfer-Encoding it does not know as one without a body.
      {"a Transfer-Encoding that is not chunked", "POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
       parser::state::failed, 415},
      {"chunked twice over", "POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n",
       parser::state::failed, 415},
      {"chunked with HTTP/1.0", "POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", parser::state::failed,
       400},
      {"more than 100 fields", many_fields, parser::state::failed, 431},
      {"a DEL byte in a value", "GET / HTTP/1.1\r\nA: b\x7f\r\n\r\n", parser::state::failed, 400},
      {"an absolute-form target", "GET http://example.com/ HTTP/1.1\r\n\r\n", parser::state::failed, 400},
      // Beast buffers a chunk-size line without a limit.
      {"a chunk extension over 4 KiB",
       "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1;x=" + std::string(5000, 'a') + "\r\n",
       parser::state::failed, 400},
      {"equal duplicate lengths", "POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\nx",
       parser::state::done, 0},
  };
  for (const expected& e : cases) {
    for (std::size_t step : {e.bytes.size() + 1, std::size_t{1}, std::size_t{5}}) {
      INFO(e.what << ", fed " << step << " bytes at a time");
      parser p(1024, 4096);
      std::size_t used = 0;
      while (used < e.bytes.size() && (p.current() == parser::state::head || p.current() == parser::state::body)) {
        used += p.feed(std::string_view(e.bytes).substr(used, step));
      }
      CHECK(p.current() == e.state);
      if (e.state == parser::state::failed) {
        CHECK(p.error().status == e.status);
        CHECK(!p.error().message.empty());
      }
    }
  }
  // The refusal names the header that held the control byte, and the path.
  parser p;
  p.feed(std::string("POST /v1/feedback HTTP/1.1\r\nIdempotency-Key: a\0b\r\n\r\n", 50));
  REQUIRE(p.current() == parser::state::failed);
  CHECK(p.error().message == "the header 'Idempotency-Key' contains a NUL byte");
  CHECK(p.error().path == "/v1/feedback");
  // Headers are kept in order, as sent; Expect and Connection are read.
  parser q;
  q.feed("POST /x?a=1 HTTP/1.0\r\nX-Two: 2\r\nx-one:  1 \r\nConnection: keep-alive\r\nExpect: 100-continue\r\n"
         "Content-Length: 2\r\n\r\n");
  REQUIRE(q.current() == parser::state::body);
  CHECK(q.request().expect_continue);
  q.feed("ok");
  REQUIRE(q.current() == parser::state::done);
  const gateway::http_request r = q.take();
  CHECK(r.keep_alive);  // HTTP/1.0 asked for it
  CHECK(r.version == "HTTP/1.0");
  CHECK(r.query == "a=1");
  REQUIRE(r.headers.size() == 5);
  CHECK(r.headers[0] == std::pair<std::string, std::string>("X-Two", "2"));
  CHECK(r.headers[1] == std::pair<std::string, std::string>("x-one", "1"));
  CHECK(r.body == "ok");
}

TEST_CASE("a head with bare LF line endings gets an immediate 400, not a 408 after the header time",
          "[service][http][hostile]") {
  temp_dir dir;
  gateway::gateway_options o = keel_service::options(dir.path());
  o.batch_workers = 0;
  o.http_header_timeout = 10s;
  auto svc = start(o);
  raw_connection c(svc->port());
  REQUIRE(c.send("GET /healthz HTTP/1.1\nHost: x\n\n"));
  // Well inside the header time: an answer now, or the test fails.
  const raw_connection::response r = c.read_response(5s);
  INFO(r.head << "\n" << r.body);
  CHECK(r.status == 400);
  CHECK(error_of(r)["refused_by"] == "http:malformed");
  CHECK(error_of(r)["message"].get<std::string>().find("bare LF") != std::string::npos);
  svc->stop();
}

TEST_CASE("HEAD is answered with the head alone: no body bytes before the next response",
          "[service][http][hostile]") {
  temp_dir dir;
  gateway::gateway_options o = keel_service::options(dir.path());
  o.batch_workers = 0;
  auto svc = start(o);
  raw_connection c(svc->port());
  REQUIRE(c.send(head_of("HEAD", "/healthz", "")));
  const std::string head = c.read_until("\r\n\r\n", 10s);
  INFO(head);
  REQUIRE(head.find("\r\n\r\n") != std::string::npos);
  CHECK(head.rfind("HTTP/1.1 ", 0) == 0);
  CHECK(head.find("Content-Length: ") != std::string::npos);
  CHECK(head.size() == head.find("\r\n\r\n") + 4);  // nothing after the head in what came
  // The same connection's next response starts right where the head ended.
  REQUIRE(c.send(head_of("GET", "/healthz", "")));
  const raw_connection::response r = c.read_response(10s);
  CHECK(r.status == 200);
  CHECK(json::parse(r.body, nullptr, false).is_object());
  svc->stop();
}

TEST_CASE("Connection: close closes right after the response, every time", "[service][http][hostile]") {
  temp_dir dir;
  gateway::gateway_options o = keel_service::options(dir.path());
  o.batch_workers = 0;
  auto svc = start(o);
  int answered = 0, late = 0;
  for (int i = 0; i < 200; ++i) {
    raw_connection c(svc->port());
    REQUIRE(c.send(head_of("GET", "/healthz", "Connection: close\r\n")));
    const raw_connection::response r = c.read_response(10s);
    answered += r.status == 200 && r.has_header("Connection: close");
    // The end of the stream follows the body at once (500 ms is generous on loopback).
    late += c.closed_by_peer(500ms) ? 0 : 1;
  }
  CHECK(answered == 200);
  CHECK(late == 0);
  svc->stop();
}

TEST_CASE("health answers while idle connections fill the connection table: the longest idle makes room",
          "[service][http][hostile]") {
  temp_dir dir;
  gateway::gateway_options o = keel_service::options(dir.path());
  o.batch_workers = 0;
  o.http_max_connections = 64;
  o.http_idle_timeout = 60s;  // the idle ones would hold their places for a minute
  auto svc = start(o);
  std::vector<std::unique_ptr<raw_connection>> idle;
  for (int i = 0; i < 80; ++i) idle.push_back(std::make_unique<raw_connection>(svc->port()));
  raw_connection h(svc->port());
  REQUIRE(h.send(head_of("GET", "/healthz", "")));
  const raw_connection::response r = h.read_response(10s);
  INFO(r.head);
  CHECK(r.status == 200);
  const gateway::http_server_figures f = svc->http_figures();
  CHECK(f.connections <= o.http_max_connections + 1);  // one over while an eviction is under way
  CHECK(f.evicted >= 80 + 1 - o.http_max_connections);
  // Those closed were idle: they see the end of the stream, not an answer.
  int closed = 0;
  for (auto& c : idle) closed += c->closed_by_peer(20ms) ? 1 : 0;
  CHECK(closed >= 80 + 1 - o.http_max_connections);
  svc->stop();
}

TEST_CASE("admin keeps capacity of its own: 128 clients polling /metrics and /healthz do not push /admin off",
          "[service][http][hostile]") {
  temp_dir dir;
  gateway::gateway_options o = keel_service::options(dir.path());
  o.batch_workers = 0;
  auto svc = start(o);
  const int port = svc->port();
  std::atomic<bool> polling{true};
  std::atomic<int> polls{0}, busy{0};
  std::vector<std::thread> pollers;
  for (int i = 0; i < 128; ++i) {
    pollers.emplace_back([&, i] {
      client c(port);
      while (polling.load()) {
        const int s = c.get(i % 2 == 0 ? "/metrics" : "/healthz").status;
        polls.fetch_add(1);
        busy.fetch_add(s == 503 ? 1 : 0);
      }
    });
  }
  while (polls.load() < 256) std::this_thread::sleep_for(1ms);  // the pollers are at it
  client admin(port);
  int refused = 0, ok = 0;
  for (int i = 0; i < 30; ++i) {
    const http_result r = admin.post("/admin/shed", R"({"class":"batch","shed":false})");
    ok += r.status == 200;
    refused += r.status == 503;
  }
  polling.store(false);
  for (std::thread& t : pollers) t.join();
  UNSCOPED_INFO(polls.load() << " polls, " << busy.load() << " refused busy");
  CHECK(refused == 0);
  CHECK(ok == 30);
  svc->stop();
}

TEST_CASE("threads at rest: the workers the options ask for and a handful for I/O", "[service][http]") {
  REQUIRE(threads_named("http-") == 0);  // no other server runs now
  gateway::http_server server(
      {}, [](const gateway::http_request&) { return gateway::http_response{}; },
      [](const gateway::http_refusal& f) { return gateway::http_response{.status = f.status}; });
  REQUIRE(server.start("127.0.0.1", 0).ok());
  const gateway::http_server_options d;
  const gateway::http_server_figures f = server.figures();
  CHECK(f.io_threads == d.io_threads);
  CHECK(f.io_threads <= 4);
  // Named for top -H: http-io, http-work, http-reserved, http-admin.
  CHECK(threads_named("http-io") == f.io_threads);
  CHECK(threads_named("http-") == d.threads + d.reserved_threads + d.admin_threads + f.io_threads);
  // 300 idle connections add no thread.
  std::vector<std::unique_ptr<raw_connection>> idle;
  for (int i = 0; i < 300; ++i) idle.push_back(std::make_unique<raw_connection>(server.port()));
  raw_connection last(server.port());
  REQUIRE(last.send(head_of("GET", "/", "")));
  CHECK(last.read_response(10s).status == 200);
  CHECK(server.figures().connections == 301);
  CHECK(threads_named("http-") == d.threads + d.reserved_threads + d.admin_threads + f.io_threads);
  server.stop();
  CHECK(threads_named("http-") == 0);
}

TEST_CASE("pipelined requests are answered in order, across lanes; Expect: 100-continue gets its 100 after the head passed",
          "[service][http][hostile]") {
  temp_dir dir;
  gateway::gateway_options o = keel_service::options(dir.path());
  o.batch_workers = 0;
  o.provider.median_latency = 5ms;
  auto svc = start(o);
  const std::string body = feedback("acme");

  SECTION("four requests in one write, for the reserved and the ordinary lane: four answers, in order") {
    raw_connection c(svc->port());
    REQUIRE(c.send(head_of("GET", "/healthz", "") +
                   head_of("POST", "/v1/feedback",
                           "Idempotency-Key: pipe-1\r\nContent-Type: application/json\r\nContent-Length: " +
                               std::to_string(body.size()) + "\r\n") +
                   body + head_of("GET", "/v2/nothing", "") + head_of("GET", "/metrics", "")));
    const raw_connection::response health = c.read_response(10s), answer = c.read_response(10s),
                                    missing = c.read_response(10s), metrics = c.read_response(10s);
    CHECK(health.status == 200);
    CHECK(json::parse(health.body, nullptr, false).contains("streams"));
    CHECK(answer.status == 200);
    CHECK(json::parse(answer.body, nullptr, false).contains("decision_id"));
    CHECK(missing.status == 404);
    CHECK(metrics.status == 200);
    CHECK(metrics.body.find("gateway_http_requests_total") != std::string::npos);
  }

  SECTION("100 Continue once the head passed, then the answer; a refused head gets its refusal, no 100") {
    raw_connection c(svc->port());
    REQUIRE(c.send(head_of("POST", "/v1/feedback",
                           "Idempotency-Key: cont-1\r\nExpect: 100-continue\r\nContent-Type: application/json\r\n"
                           "Content-Length: " + std::to_string(body.size()) + "\r\n")));
    const std::string interim = c.read_until("\r\n\r\n", 10s);
    CHECK(interim == "HTTP/1.1 100 Continue\r\n\r\n");
    REQUIRE(c.send(body));
    CHECK(c.read_response(10s).status == 200);

    raw_connection big(svc->port());
    REQUIRE(big.send(head_of("POST", "/v1/feedback", "Idempotency-Key: cont-2\r\nExpect: 100-continue\r\n"
                                                     "Content-Length: 104857600\r\n")));
    const std::string refused = big.read_until("\r\n\r\n", 10s);
    CHECK(refused.rfind("HTTP/1.1 413 ", 0) == 0);
  }
  svc->stop();
}

TEST_CASE("a 408 from the front door carries one Retry-After: the refusal's own, or the server's when it has none",
          "[service][http][hostile]") {
  temp_dir dir;
  gateway::gateway_options o = keel_service::options(dir.path());
  o.batch_workers = 0;
  o.http_header_timeout = 1s;
  auto svc = start(o);
  auto count = [](const std::string& head, std::string_view name) {
    int n = 0;
    for (std::size_t at = head.find(name); at != std::string::npos; at = head.find(name, at + 1)) ++n;
    return n;
  };
  raw_connection c(svc->port());
  REQUIRE(c.send("GET /healthz HTTP/1.1\r\nX-Slow: a"));
  const raw_connection::response r = c.read_response(10s);
  INFO(r.head);
  REQUIRE(r.status == 408);
  CHECK(count(r.head, "\r\nRetry-After:") == 1);
  CHECK(count(r.head, "\r\nretry-after-ms:") == 1);
  // The server adds one only when the refusal has none (its handler's own, here).
  gateway::http_server bare({.threads = 1, .max_queue = 1, .header_timeout = std::chrono::milliseconds(300)},
                            [](const gateway::http_request&) { return gateway::http_response{}; },
                            [](const gateway::http_refusal& f) { return gateway::http_response{.status = f.status}; });
  REQUIRE(bare.start("127.0.0.1", 0).ok());
  raw_connection d(bare.port());
  REQUIRE(d.send("GET / HTTP/1.1\r\nX-Slow: a"));
  const raw_connection::response s = d.read_response(10s);
  REQUIRE(s.status == 408);
  CHECK(count(s.head, "\r\nRetry-After: 1\r\n") == 1);
  bare.stop();
  svc->stop();
}
