// The example gateway's logic without HTTP (examples/gateway/gateway_core.hpp):
// the seed's deadline plan stage by stage on the manual clock, fast and
// named refusals, the adaptive attempt timeout, idempotent decisions and
// the effects they cause, and invalid options.
#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>
#include <sqlite3.h>

#include "gateway_core.hpp"
#include "keel/store/sqlite_jobs.hpp"
#include "keel/testing/manual_clock.hpp"
#include "support/service.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;
namespace kt = keel::testing;
using json = nlohmann::json;
using keel_service::temp_dir;

namespace {

template <class Clock>
using core_t = gateway::gateway_core<Clock, keel::sqlite_job_store<>>;

template <class Clock>
std::unique_ptr<core_t<Clock>> open_core(const gateway::gateway_options& o, Clock clock) {
  auto core = core_t<Clock>::open(
      o, [](const std::string& path) { return keel::sqlite_job_store<>::open(path); }, clock);
  if (!core.ok()) FAIL(std::string(core.status().message()));
  return std::move(*core);
}

std::string feedback_body(const std::string& tenant, const std::string& answer = "One end-to-end deadline: stages "
                                                                                 "get what remains, with a response "
                                                                                 "reserve") {
  return json{{"tenant", tenant}, {"question_id", "q-timeouts"}, {"answer", answer}}.dump();
}

json parse(const gateway::reply& r) { return json::parse(r.body, nullptr, false); }

// A series' value in the gateway's Prometheus text, 0 when it is absent.
template <class Core>
double metric(Core& core, const std::string& series) {
  const std::string text = core.metrics().body;
  const std::size_t at = text.find("\n" + series + " ");
  if (at == std::string::npos) return 0;
  return std::stod(text.substr(at + series.size() + 2));
}

long long ms_of(const json& timeline, const char* stage) {
  return timeline.contains(stage) ? timeline[stage].get<long long>() : -1;
}

// The seed's figures, unscaled; a provider with no latency spread.
gateway::gateway_options seed_options(const std::string& dir) {
  gateway::gateway_options o;
  o.data_dir = dir;
  o.provider.spread = 0;  // every answer takes exactly the median, 400 ms
  o.provider.close_latency = 20ms;
  o.rubric_latency = 5ms;
  o.cut_at_deadline = false;  // the tests auto-advance the clock: its timer would jump every call to its deadline
  return o;
}

}  // namespace

TEST_CASE("the seed's deadline plan, stage by stage, on the manual clock", "[service][plan]") {
  temp_dir dir;
  const gateway::gateway_options o = seed_options(dir.path());
  kt::manual_clock clock;
  clock.auto_advance(true);  // one thread: every wait jumps the clock
  auto core = open_core(o, clock);
  const gateway::deadline_plan& plan = o.interactive;
  REQUIRE(plan.respond_by() == 2600ms);

  // Healthy: retrieve (5 ms) then the model (400 ms); nothing else waits.
  const keel::time_point t0 = clock.now();
  gateway::reply healthy = core->feedback(feedback_body("acme"), "k-healthy");
  REQUIRE(healthy.status == 200);
  json h = parse(healthy);
  CHECK(h["degraded"] == false);
  CHECK(h["served_by"] == "model:feedback-large");
  CHECK(ms_of(h["timeline_ms"], "retrieved") == 5);
  CHECK(ms_of(h["timeline_ms"], "answered") == 405);
  CHECK(clock.now() - t0 == 405ms);

  SECTION("a stalled model: its attempt ends with its stage, the fallback gets what remains") {
    REQUIRE(core->provider().set_fault({.kind = gateway::fault_kind::stall}).ok());
    const keel::time_point t1 = clock.now();
    gateway::reply r = core->feedback(feedback_body("acme"), "k-stalled");
    REQUIRE(r.status == 200);
    json j = parse(r);
    CHECK(j["degraded"] == true);
    CHECK(j["recorded"] == false);
    CHECK(j["served_by"] == "rubric-feedback");
    CHECK(j["note"].get<std::string>().find("stalled") != std::string::npos);
    // The attempt was cut when the model stage (1000 ms from its start at
    // 5 ms) ended, not after a fresh timeout; closing it took 20 ms of the
    // 100 ms cancel window; the local fallback answered at once.
    CHECK(ms_of(j["timeline_ms"], "retrieved") == 5);
    CHECK(ms_of(j["timeline_ms"], "answered") == 5 + 1000 + 20);
    CHECK(clock.now() - t1 == 1025ms);
    CHECK(clock.now() - t1 <= plan.respond_by());
    CHECK(core->provider().figures().timed_out == 1);
  }

  SECTION("a tenant that refuses degraded answers gets a clear failure, still within the plan") {
    REQUIRE(core->provider().set_fault({.kind = gateway::fault_kind::stall}).ok());
    const keel::time_point t1 = clock.now();
    gateway::reply r = core->feedback(feedback_body("strict"), "k-strict");
    CHECK(r.status == 504);
    json j = parse(r);
    CHECK(j["error"]["message"].get<std::string>().find("gate permission refused") != std::string::npos);
    CHECK(clock.now() - t1 == 1025ms);
  }

  SECTION("a tenant whose data must stay in another region is not sent to this region's fallback") {
    REQUIRE(core->provider().set_fault({.kind = gateway::fault_kind::outage}).ok());
    gateway::reply r = core->feedback(feedback_body("us-clinic"), "k-us");
    CHECK(r.status == 503);
    CHECK(parse(r)["error"]["message"].get<std::string>().find("gate residency refused") != std::string::npos);
  }

  SECTION("a full interactive bulkhead refuses at the end of the admit stage, naming itself") {
    std::vector<keel::bulkhead_permit> held;
    const std::size_t interactive = *core->bulkheads().class_index("interactive");
    for (int i = 0; i < o.interactive_slots; ++i) held.push_back(core->bulkheads().try_acquire(interactive));
    REQUIRE(held.back());
    const std::int64_t calls = core->provider().figures().calls;
    const keel::time_point t1 = clock.now();
    gateway::reply r = core->feedback(feedback_body("acme"), "k-full");
    CHECK(clock.now() - t1 == plan.admit);  // waited in the queue for the admit stage, no longer
    CHECK(r.status == 503);
    CHECK(r.retry_after.has_value());
    json j = parse(r);
    CHECK(j["error"]["refused_by"] == "bulkhead:interactive");
    CHECK(core->provider().figures().calls == calls);
    held.clear();
    CHECK(core->feedback(feedback_body("acme"), "k-full").status == 200);  // the key was left free
  }

  SECTION("a tenant over its own quota is refused at once, with 429 and a retry hint") {
    REQUIRE(core->feedback(feedback_body("noisy"), "k-n1").status == 200);
    const keel::time_point t1 = clock.now();
    gateway::reply r = core->feedback(feedback_body("noisy"), "k-n2");
    CHECK(clock.now() == t1);
    CHECK(r.status == 429);
    CHECK(parse(r)["error"]["refused_by"] == "tenant:noisy:rate");
    CHECK(r.retry_after.has_value());
  }

  SECTION("a shed class is refused at once") {
    core->set_shed(gateway::work_class::interactive, true);
    gateway::reply r = core->feedback(feedback_body("acme"), "k-shed");
    CHECK(r.status == 503);
    CHECK(parse(r)["error"]["refused_by"] == "shed:interactive");
    core->set_shed(gateway::work_class::interactive, false);
    CHECK(core->feedback(feedback_body("acme"), "k-shed").status == 200);
  }
}

TEST_CASE("the adaptive timeout cuts an attempt at the learned p99 plus margin, not at the stage's end",
          "[service][plan]") {
  temp_dir dir;
  const gateway::gateway_options o = seed_options(dir.path());
  kt::manual_clock clock;
  clock.auto_advance(true);
  auto core = open_core(o, clock);
  // Twenty answers of exactly 400 ms: p99 400 ms, so attempts get 600 ms.
  for (int i = 0; i < o.model_timeout.min_samples; ++i) {
    REQUIRE(core->feedback(feedback_body("acme", "warm-up " + std::to_string(i)), "warm-" + std::to_string(i))
                .status == 200);
  }
  REQUIRE(core->provider().set_fault({.kind = gateway::fault_kind::slowdown, .factor = 2}).ok());  // 800 ms
  const std::int64_t timed_out = core->provider().figures().timed_out;
  gateway::reply r = core->feedback(feedback_body("acme"), "k-slow");
  REQUIRE(r.status == 200);
  json j = parse(r);
  CHECK(j["degraded"] == true);
  // First attempt cut at 600 ms; the retry fits in what the stage has left
  // (>= the 300 ms lower bound) and is cut at the stage's end. With only the
  // stage's 1000 ms, one attempt would have waited 800 ms and answered.
  CHECK(core->provider().figures().timed_out - timed_out == 2);
  CHECK(j["retries"] == 1);
  CHECK(ms_of(j["timeline_ms"], "answered") <= 5 + 1000 + 100);
}

TEST_CASE("one decision per idempotency key: replays, conflicts, and degraded answers left unrecorded",
          "[service][idempotency]") {
  temp_dir dir;
  const gateway::gateway_options o = seed_options(dir.path());
  kt::manual_clock clock;
  clock.auto_advance(true);
  auto core = open_core(o, clock);

  gateway::reply first = core->feedback(feedback_body("acme"), "k-1");
  REQUIRE(first.status == 200);
  const std::string decision = parse(first)["decision_id"].get<std::string>();
  const std::int64_t calls = core->provider().figures().calls;

  SECTION("the same request again replays the decision without calling the model") {
    gateway::reply again = core->feedback(feedback_body("acme"), "k-1");
    REQUIRE(again.status == 200);
    json j = parse(again);
    CHECK(j["replayed"] == true);
    CHECK(j["decision_id"] == decision);
    CHECK(j["model_digest"] == "feedback-large@sim-2025-06");
    CHECK(j["policy_revision"] == "feedback-policy-v1");
    CHECK(core->provider().figures().calls == calls);
  }

  SECTION("another body under the same key is a conflict, and changes nothing") {
    gateway::reply other = core->feedback(feedback_body("acme", "a different answer"), "k-1");
    CHECK(other.status == 409);
    CHECK(parse(other)["error"]["condition"] == "conflict");
    CHECK(core->provider().figures().calls == calls);
    CHECK(parse(core->feedback(feedback_body("acme"), "k-1"))["decision_id"] == decision);
  }

  SECTION("the same key under another tenant is another request") {
    gateway::reply r = core->feedback(feedback_body("globex"), "k-1");
    REQUIRE(r.status == 200);
    CHECK(parse(r)["decision_id"] != decision);
    CHECK(parse(r)["replayed"] == false);
  }

  SECTION("a degraded answer is not recorded: the retry, once the model is back, decides") {
    REQUIRE(core->provider().set_fault({.kind = gateway::fault_kind::outage}).ok());
    gateway::reply degraded = core->feedback(feedback_body("acme"), "k-2");
    REQUIRE(degraded.status == 200);
    CHECK(parse(degraded)["degraded"] == true);
    CHECK(parse(degraded)["decision_id"].is_null());
    REQUIRE(core->provider().set_fault({.kind = gateway::fault_kind::none}).ok());
    // The breaker may have opened on the outage: let it probe and close.
    clock.advance(o.breaker.open_duration);
    gateway::reply full = core->feedback(feedback_body("acme"), "k-2");
    REQUIRE(full.status == 200);
    CHECK(parse(full)["degraded"] == false);
    CHECK(parse(full)["replayed"] == false);
    CHECK(core->effects().count("feedback", "acme", "k-2").value() == 1);
  }

  // The learner's history got exactly one entry for k-1, whatever happened above.
  CHECK(core->effects().count("feedback", "acme", "k-1").value() == 1);
  CHECK(core->effects().duplicated_keys("feedback").value() == 0);
}

TEST_CASE("the one interactive pipeline gives back its quota on every path: answer, replay, degraded, refusal",
          "[service][plan][quota]") {
  temp_dir dir;
  const gateway::gateway_options o = seed_options(dir.path());
  kt::manual_clock clock;
  clock.auto_advance(true);
  auto core = open_core(o, clock);
  const std::string model = o.models.front().name;
  auto in_flight = [&] {
    return std::pair{core->quotas().tenant_figures("acme", clock.now()).value().in_flight,
                     core->quotas().model_figures(model, clock.now()).value().in_flight};
  };
  auto compute = [&] { return core->quotas().tenant_figures("acme", clock.now()).value().compute_available; };

  REQUIRE(core->feedback(feedback_body("acme"), "k-1").status == 200);
  CHECK(in_flight() == std::pair{0, 0});

  // A replay runs nothing inside the record: its compute estimate comes
  // back whole (the clock does not move, so the budget must be unchanged).
  const double before = compute();
  const gateway::reply replay = core->feedback(feedback_body("acme"), "k-1");
  REQUIRE(parse(replay)["replayed"] == true);
  CHECK(compute() == before);
  CHECK(in_flight() == std::pair{0, 0});

  REQUIRE(core->provider().set_fault({.kind = gateway::fault_kind::outage}).ok());
  REQUIRE(parse(core->feedback(feedback_body("acme"), "k-2"))["degraded"] == true);
  CHECK(in_flight() == std::pair{0, 0});
  REQUIRE(core->provider().set_fault({.kind = gateway::fault_kind::none}).ok());

  std::vector<keel::bulkhead_permit> held;
  const std::size_t interactive = *core->bulkheads().class_index("interactive");
  for (int i = 0; i < o.interactive_slots; ++i) held.push_back(core->bulkheads().try_acquire(interactive));
  REQUIRE(core->feedback(feedback_body("acme"), "k-3").status == 503);
  CHECK(in_flight() == std::pair{0, 0});
  CHECK(metric(*core, R"(gateway_rejections_total{class="interactive",reason="bulkhead"})") == 1);
}

TEST_CASE("a tenant over its own quota hears its refusal as it is, never the fallback, even with the model down",
          "[service][plan][quota]") {
  temp_dir dir;
  const gateway::gateway_options o = seed_options(dir.path());
  kt::manual_clock clock;
  clock.auto_advance(true);
  auto core = open_core(o, clock);
  REQUIRE(core->provider().set_fault({.kind = gateway::fault_kind::outage}).ok());
  // Within its quota, the outage gets the rubric-only answer...
  const gateway::reply first = core->feedback(feedback_body("noisy"), "k-n1");
  REQUIRE(first.status == 200);
  CHECK(parse(first)["degraded"] == true);
  // ...over it, the 429 itself: the fallback is not even tried.
  const gateway::reply over = core->feedback(feedback_body("noisy"), "k-n2");
  CHECK(over.status == 429);
  const json error = parse(over)["error"];
  CHECK(error["refused_by"] == "tenant:noisy:rate");
  CHECK(error["message"].get<std::string>().starts_with("keel: tenant 'noisy' is over its rate quota"));
  CHECK(metric(*core, R"(keel_fallback_skips_total{path="rubric-feedback",reason="gate",gate="schema"})") == 0);
  CHECK(metric(*core, R"(gateway_rejections_total{class="interactive",reason="tenant_quota"})") == 1);
  // Its own doing: not in the availability SLO.
  CHECK(core->slos().find("interactive")->report(clock.now()).in_window.rejected == 0);
}

TEST_CASE("a model over its compute quota: 503 naming the model's limit, counted against the service's SLO",
          "[service][plan][quota]") {
  temp_dir dir;
  gateway::gateway_options o = seed_options(dir.path());
  // One request's estimate (600 tokens) a minute.
  o.models.front().limits = {.compute_budget = o.models.front().token_estimate};
  kt::manual_clock clock;
  clock.auto_advance(true);
  auto core = open_core(o, clock);
  REQUIRE(core->feedback(feedback_body("acme"), "k-m1").status == 200);
  const std::int64_t calls = core->provider().figures().calls;
  const gateway::reply r = core->feedback(feedback_body("acme"), "k-m2");
  CHECK(r.status == 503);
  CHECK(r.retry_after.has_value());
  CHECK(parse(r)["error"]["refused_by"] == "model:feedback-large:compute");
  CHECK(core->provider().figures().calls == calls);
  CHECK(metric(*core, R"(gateway_rejections_total{class="interactive",reason="model_quota"})") == 1);
  CHECK(core->slos().find("interactive")->report(clock.now()).in_window.rejected == 1);
}

TEST_CASE("concurrent duplicates wait for the first request: one model call, one decision, one effect",
          "[service][idempotency][concurrency]") {
  temp_dir dir;
  gateway::gateway_options o = keel_service::options(dir.path());
  o.provider.spread = 0;
  auto core = open_core(o, keel::real_clock{});
  constexpr int kThreads = 8;
  std::vector<gateway::reply> replies(kThreads);
  std::atomic<bool> go{false};
  {
    std::vector<std::jthread> threads;
    for (int i = 0; i < kThreads; ++i) {
      threads.emplace_back([&, i] {
        while (!go.load()) std::this_thread::yield();
        replies[i] = core->feedback(feedback_body("acme"), "same-key");
      });
    }
    go = true;
  }
  std::string decision;
  int fresh = 0;
  for (const gateway::reply& r : replies) {
    REQUIRE(r.status == 200);
    json j = parse(r);
    if (decision.empty()) decision = j["decision_id"].get<std::string>();
    CHECK(j["decision_id"] == decision);
    fresh += j["replayed"] == false ? 1 : 0;
  }
  CHECK(fresh == 1);
  CHECK(core->provider().figures().calls == 1);
  CHECK(core->effects().count("feedback", "acme", "same-key").value() == 1);
}

TEST_CASE("invalid gateway options are refused, naming the field and the rule", "[service][options]") {
  temp_dir dir;
  gateway::gateway_options o;
  o.data_dir = dir.path();
  REQUIRE(o.validate().ok());

  gateway::gateway_options no_dir = o;
  no_dir.data_dir.clear();
  CHECK(no_dir.validate().message() == "gateway_options.data_dir must name a directory (got \"\")");

  gateway::gateway_options over = o;
  over.interactive.fallback = 2000ms;  // the stages no longer fit in 3 s - 200 ms
  const absl::Status s = over.validate();
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(s.message()).find("deadline_plan.respond must leave the stages within deadline - "
                                      "response_reserve (got 3.6s > 2.8s)") != std::string::npos);

  gateway::gateway_options lease = o;
  lease.idempotency_lease = 1s;
  CHECK(std::string(lease.validate().message()).find("gateway_options.idempotency_lease must exceed the "
                                                     "interactive deadline") != std::string::npos);

  auto refused = core_t<keel::real_clock>::open(
      over, [](const std::string& path) { return keel::sqlite_job_store<>::open(path); });
  CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);

  const gateway::fault bad{.kind = gateway::fault_kind::slowdown, .factor = 0.5};
  CHECK(bad.validate().message() == "fault.factor must be in [1, 1000] (got 0.5)");
}

TEST_CASE("a job store that cannot answer its counts shows in /healthz and /metrics, not as ok",
          "[service][health]") {
  temp_dir dir;
  kt::manual_clock clock;
  auto core = open_core(seed_options(dir.path()), clock);
  const json before = parse(core->health());
  CHECK(before["status"] == "ok");
  CHECK(before["batch_queue"]["queued"] == 0);
  CHECK(core->metrics().body.find("gateway_batch_queue_readable 1") != std::string::npos);

  // Someone renames the job table under the running gateway: counts fail.
  sqlite3* db = nullptr;
  REQUIRE(sqlite3_open(dir.file("jobs.db").c_str(), &db) == SQLITE_OK);
  const int rc = sqlite3_exec(db, "ALTER TABLE keel_job RENAME TO keel_job_moved", nullptr, nullptr, nullptr);
  sqlite3_close(db);
  REQUIRE(rc == SQLITE_OK);
  REQUIRE_FALSE(core->queue().counts().ok());

  const json after = parse(core->health());
  CHECK(after["status"] == "degraded");
  REQUIRE(after["batch_queue"].contains("error"));
  CHECK(after["batch_queue"]["error"].get<std::string>().find(dir.file("jobs.db")) != std::string::npos);
  CHECK(core->metrics().body.find("gateway_batch_queue_readable 0") != std::string::npos);
}

TEST_CASE("a tenant refused because the quota table is full of other tenants' keys: 503, and it counts in the SLO",
          "[service][quota]") {
  temp_dir dir;
  kt::manual_clock clock;  // never moved: every made-up tenant's rate token stays spent
  gateway::gateway_options o = seed_options(dir.path());
  o.batch_max_depth = 20'000;
  auto core = open_core(o, clock);
  auto submit = [&](const std::string& tenant) {
    return core->batch_submit(json{{"tenant", tenant}, {"learner", "l-1"}, {"sessions", {"s"}}}.dump(),
                              "k-" + tenant);
  };
  // One client invents 10,000 tenant names (the table's size), one job each.
  for (int i = 0; i < 10'000; ++i) REQUIRE(submit("made-up-" + std::to_string(i)).status == 202);
  const gateway::reply r = submit("acme");
  const json error = parse(r)["error"];
  CHECK(r.status == 503);  // the service's limit, not acme's own quota
  CHECK(error["refused_by"] == "tenant:acme:table_full");
  CHECK(error.contains("retry_after_ms"));
  const keel::slo_report batch = core->slos().find("batch")->report(clock.now());
  CHECK(batch.in_window.rejected == 1);
}

// ---- hostile input (issue 16) ------------------------------------------------

TEST_CASE("a body of valid JSON followed by a NUL and garbage is refused, on every endpoint that reads one",
          "[service][errors][hostile]") {
  temp_dir dir;
  const gateway::gateway_options o = seed_options(dir.path());
  kt::manual_clock clock;
  clock.auto_advance(true);
  auto core = open_core(o, clock);
  const std::string tail("\0garbage", 8);
  const gateway::reply f = core->feedback(feedback_body("acme") + tail, "k-nul");
  CHECK(f.status == 400);
  CHECK(parse(f)["error"]["message"].get<std::string>().find("NUL byte") != std::string::npos);
  CHECK(core->batch_submit(R"({"tenant":"acme","learner":"l","sessions":["s"]})" + tail, "k-nul").status == 400);
  CHECK(core->admin_shed(R"({"class":"batch","shed":true})" + tail).status == 400);
  CHECK(core->admin_fault(R"({"kind":"outage"})" + tail).status == 400);
  // A NUL escaped inside a string is JSON, and fine.
  CHECK(core->feedback(json{{"tenant", "acme"}, {"question_id", "q-timeouts"}, {"answer", std::string("a\0b", 3)}}.dump(),
                       "k-escaped")
            .status == 200);
  CHECK(core->provider().current_fault().kind == gateway::fault_kind::none);
  CHECK(core->effects().count("feedback", "acme", "k-nul").value() == 0);
  CHECK(core->queue().counts().value().total() == 0);
}

TEST_CASE("a body nested deeper than 64 arrays and objects is refused before it is parsed; brackets in strings do not count",
          "[service][errors][hostile]") {
  temp_dir dir;
  const gateway::gateway_options o = seed_options(dir.path());
  kt::manual_clock clock;
  clock.auto_advance(true);
  auto core = open_core(o, clock);
  auto nested = [](int levels) { return std::string(levels, '[') + std::string(levels, ']'); };
  // The object is one level: 64 arrays inside it make 65.
  const std::string prefix = R"({"tenant":"acme","question_id":"q-timeouts","answer":)";
  const gateway::reply deep = core->feedback(prefix + nested(64) + "}", "k-deep");
  CHECK(deep.status == 400);
  CHECK(parse(deep)["error"]["message"].get<std::string>().find("deeper than 64 levels") != std::string::npos);
  CHECK(core->batch_submit(R"({"tenant":"acme","learner":"l","sessions":)" + nested(64) + "}", "k-deep").status == 400);
  CHECK(core->effects().count("feedback", "acme", "k-deep").value() == 0);
  // 64 levels in all pass the depth check (and are then refused for what they hold, not their depth).
  const gateway::reply at_limit = core->feedback(prefix + nested(63) + "}", "k-at-limit");
  CHECK(at_limit.status == 400);
  CHECK(parse(at_limit)["error"]["message"].get<std::string>().find("deeper than") == std::string::npos);
  // Brackets inside a string, escaped quotes among them, are text.
  const std::string text = std::string(100, '[') + "\\\"" + std::string(100, '{');
  CHECK(core->feedback(prefix + "\"" + text + "\"}", "k-text").status == 200);
}

TEST_CASE("idempotency keys are checked as the bytes given: a NUL or a control byte is refused, %xx is kept",
          "[service][idempotency][hostile]") {
  CHECK(!gateway::detail::check_idempotency_key(std::string_view("u1\0AAA", 6)).ok());
  CHECK(!gateway::detail::check_idempotency_key(std::string_view("u1\x7f")).ok());
  CHECK(gateway::detail::check_idempotency_key(std::string_view("pct%41")).value() == "pct%41");
  temp_dir dir;
  const gateway::gateway_options o = seed_options(dir.path());
  kt::manual_clock clock;
  clock.auto_advance(true);
  auto core = open_core(o, clock);
  const json a = parse(core->feedback(feedback_body("acme"), "pct%41"));
  const json b = parse(core->feedback(feedback_body("acme"), "pctA"));
  CHECK(a["replayed"] == false);
  CHECK(b["replayed"] == false);
  CHECK(a["decision_id"] != b["decision_id"]);
}

TEST_CASE("the learner-history row is written by a replay when it is missing, and never twice",
          "[service][idempotency][hostile]") {
  temp_dir dir;
  const gateway::gateway_options o = seed_options(dir.path());
  kt::manual_clock clock;
  clock.auto_advance(true);
  auto core = open_core(o, clock);
  // The first reply's row write fails as if the process died there: the
  // hook throws past it (the decision is committed).
  core->set_effect_hook([](std::string_view stage) {
    if (stage == "decided") throw std::runtime_error("crash");
  });
  CHECK_THROWS(core->feedback(feedback_body("acme"), "k-lost"));
  CHECK(core->effects().count("feedback", "acme", "k-lost").value() == 0);
  core->set_effect_hook({});
  const gateway::reply retry = core->feedback(feedback_body("acme"), "k-lost");
  REQUIRE(retry.status == 200);
  CHECK(parse(retry)["replayed"] == true);
  CHECK(core->effects().count("feedback", "acme", "k-lost").value() == 1);
  CHECK(parse(core->feedback(feedback_body("acme"), "k-lost"))["replayed"] == true);
  CHECK(core->effects().count("feedback", "acme", "k-lost").value() == 1);
  CHECK(metric(*core, "gateway_effects_replayed_total") == 1);
}

TEST_CASE("question ids with a fallback rubric degrade in an outage; ids without one fail and say why",
          "[service][fallback][hostile]") {
  temp_dir dir;
  const gateway::gateway_options o = seed_options(dir.path());
  kt::manual_clock clock;
  clock.auto_advance(true);
  auto core = open_core(o, clock);
  core->force_breaker("open");
  // The rubric store's ids (docs/gateway.md lists them): a degraded answer.
  for (const char* q : {"q-design-cache", "q-rate-limit", "q-idempotency", "q-timeouts"}) {
    INFO(q);
    const gateway::reply r =
        core->feedback(json{{"tenant", "acme"}, {"question_id", q}, {"answer", "bounds memory"}}.dump(), std::string("k-") + q);
    CHECK(r.status == 200);
    CHECK(parse(r)["degraded"] == true);
  }
  // Any other id has no fallback: the outage is the answer, and it says so.
  const gateway::reply r =
      core->feedback(json{{"tenant", "acme"}, {"question_id", "q-unknown"}, {"answer", "x"}}.dump(), "k-unknown");
  INFO(r.body);
  CHECK(r.status == 503);
  const std::string message = parse(r)["error"]["message"].get<std::string>();
  CHECK(message.find("no rubric-only fallback") != std::string::npos);
  CHECK(message.find("no rubric for question 'q-unknown'") != std::string::npos);
  CHECK(parse(r)["error"]["refused_by"] == "breaker:endpoint=sim-llm");
}

TEST_CASE("a write the store lost in transit is 503 unknown_outcome, not a bare 500", "[service][faults]") {
  // What tests/service_faults_test.cpp meets only when a kill lands mid-commit.
  const absl::Status lost =
      keel::unknown_outcome_error("postgres job store 'reports'", absl::UnavailableError("connection lost"));
  const gateway::reply r = gateway::detail::error_reply(lost);
  CHECK(r.status == 503);
  const json e = parse(r).at("error");
  CHECK(e.at("status") == "UNKNOWN");
  CHECK(e.at("condition") == "unknown_outcome");
  // Other failures keep their mapping.
  CHECK(gateway::detail::error_reply(absl::UnknownError("a bug")).status == 500);
  CHECK(gateway::detail::error_reply(absl::UnavailableError("down")).status == 503);
}

TEST_CASE("a batch job has one spelling: a sign, a leading zero or a non-digit is not its id", "[service][batch]") {
  temp_dir dir;
  gateway::gateway_options o = seed_options(dir.path());
  o.batch_workers = 0;
  kt::manual_clock clock;
  clock.auto_advance(true);
  auto core = open_core(o, clock);
  const gateway::reply queued = core->batch_submit(
      json{{"tenant", "acme"}, {"learner", "l-1"}, {"sessions", {"s-1"}}}.dump(), "report-1");
  REQUIRE(queued.status == 202);
  const std::string id = std::to_string(parse(queued)["job_id"].get<std::int64_t>());
  REQUIRE(id == "1");
  CHECK(core->batch_status(id, "acme").status == 200);
  for (const std::string bad : {"+1", "01", "1 ", " 1", "0x1", "1e0", "-1", "0", "", "99999999999999999999"}) {
    INFO("id '" << bad << "'");
    CHECK(core->batch_status(bad, "acme").status == 400);
  }
}
