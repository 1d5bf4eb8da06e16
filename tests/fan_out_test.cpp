// keel::fan_out on the in-memory store: saved as they arrive, reruns pay
// only for what is missing, completion rules cancel the rest, the report and
// the progress callback tell the truth.
#include "keel/durable/fan_out.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "keel/compose/executor.hpp"
#include "keel/compose/pipeline.hpp"
#include "keel/core/call.hpp"
#include "keel/durable/digest.hpp"
#include "keel/policy/time_limit.hpp"
#include "keel/store/memory.hpp"
#include "keel/testing/manual_clock.hpp"
#include "keel/testing/scripted_provider.hpp"
#include "support/alloc_counter.hpp"
#include "support/async.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;
using keel::testing::manual_clock;
namespace kt = keel::testing;
using text_provider = kt::scripted_provider<std::string>;
using store_t = keel::memory_store;
using panel_t = keel::fan_out<std::string, store_t, keel::bounded_pool, keel::environment<manual_clock>>;
constexpr auto sleep_mode = text_provider::mode::sleep;

namespace {

using keel_test::async_call;
using keel_test::eventually;

keel::digest unit_key(std::string_view facts, std::string_view model, std::string_view rubric) {
  return keel::digest_builder().field("facts", facts).field("model", model).field("rubric", rubric).finish();
}

std::vector<keel::unit> panel_units(std::initializer_list<std::string_view> models,
                                    std::string_view rubric = "rubric-v1") {
  std::vector<keel::unit> out;
  for (std::string_view m : models) {
    out.push_back({.name = std::string(m), .key = unit_key("product 42: 3 facts", m, rubric), .labels = {.model = m}});
  }
  return out;
}

// A valid answer carries a score: "score:80".
absl::Status has_score(const std::string& r) {
  int score = 0;
  if (r.rfind("score:", 0) != 0 || !absl::SimpleAtoi(r.substr(6), &score))
    return absl::InvalidArgumentError(absl::StrCat("invalid result \"", r, "\": no score"));
  return absl::OkStatus();
}

// Writes a fan-out's events as text ("B running", "C failed", ...), in the
// order they come; the mutex guards the log against the run's last event,
// reported from the caller's thread.
struct event_log {
  std::mutex* mu;
  std::vector<std::string>* log;
  bool only_cancelled = false;

  void add(std::string line) const {
    std::lock_guard lock(*mu);
    log->push_back(std::move(line));
  }
  void operator()(const keel::events::fan_out_unit_started& e) const {
    if (!only_cancelled) add(std::string(e.unit) + " running");
  }
  void operator()(const keel::events::fan_out_unit_cached& e) const {
    if (!only_cancelled) add(std::string(e.unit) + " cached");
  }
  void operator()(const keel::events::fan_out_unit_finished& e) const {
    if (only_cancelled && e.state != keel::unit_state::cancelled) return;
    add(std::string(e.unit) + " " + std::string(keel::to_string(e.state)) +
        (e.outstanding ? ", outstanding" : "") + (e.saved ? ", saved" : "") +
        (e.state == keel::unit_state::failed ? ", " + std::string(keel::to_string(e.kind)) : ""));
  }
  void operator()(const keel::events::fan_out_unit_missing& e) const {
    if (!only_cancelled) add(std::string(e.unit) + " missing, " + std::string(keel::to_string(e.kind)));
  }
  void operator()(const keel::events::fan_out_finished& e) const {
    if (only_cancelled) return;
    add(absl::StrCat("finished: ", e.units, " units, ", e.cached, " cached, ", e.succeeded, " succeeded, ", e.failed,
                     " failed, ", e.missing, " missing, rule ", e.rule_met ? "met" : "not met"));
  }
};

// A service's classifier: a provider over its own quota answers
// FailedPrecondition "over quota", which this service treats as a refusal.
struct over_quota_is_refused {
  keel::outcome_kind operator()(const absl::Status& s, const keel::operation& op) const {
    if (s.message() == "over quota") return keel::outcome_kind::refused;
    return keel::default_classifier{}(s, op);
  }
};

// A pipeline stage that runs a panel on the pass's run context.
template <class Panel>
struct panel_stage {
  Panel* panel;
  const std::vector<keel::unit>* units;
  keel::fan_out_report<std::string>* out;
  template <class Ctx, class Next>
  auto execute(Ctx& ctx, keel::attempt_plan plan, Next& next) const -> decltype(next(ctx, plan)) {
    *out = panel->run(ctx, *units, [](const keel::unit_context& u) -> absl::StatusOr<std::string> {
      if (u.unit.name == "B") return absl::FailedPreconditionError("over quota");
      return std::string("score:1");
    });
    return next(ctx, plan);
  }
};

// Scripted providers by unit name, each behind its own pipeline and call.
struct providers {
  manual_clock clock;
  std::map<std::string, std::unique_ptr<text_provider>> by_name;
  std::mutex mu;
  std::vector<std::string> stop_seen;  // units whose worker saw its stop token requested

  void add(const std::string& name, std::vector<kt::step<std::string>> script) {
    by_name[name] = std::make_unique<text_provider>(clock, std::move(script), sleep_mode);
  }
  int calls(const std::string& name) { return by_name.at(name)->calls(); }
  std::vector<std::string> saw_stop() {
    std::lock_guard lock(mu);
    return stop_seen;
  }

  // The worker: the unit's own call and pipeline, as a service would run it.
  auto worker(keel::duration per_attempt = 1s) {
    return [this, per_attempt](const keel::unit_context& u) -> absl::StatusOr<std::string> {
      keel::call c(clock.now(), u.call_options());
      auto pipe = keel::pipeline(keel::time_limit({.at_most = per_attempt})).in(keel::environment{clock});
      absl::StatusOr<std::string> r = pipe.run(c, *by_name.at(u.unit.name));
      if (u.stop.stop_requested()) {
        std::lock_guard lock(mu);
        stop_seen.push_back(u.unit.name);
      }
      return r;
    };
  }
};

}  // namespace

TEST_CASE("the seed's panel: B times out, A and C are saved; the rerun calls only B", "[fan_out][seed]") {
  providers p;
  store_t store(p.clock);
  keel::bounded_pool pool({.threads = 3, .queue_capacity = 16});
  panel_t panel({.width = 3, .validator = has_score}, store, pool, keel::environment{p.clock});
  const std::vector<keel::unit> units = panel_units({"A", "B", "C"});

  p.add("A", {kt::answer(std::string("score:80"), 100ms)});
  p.add("B", {kt::stall(), kt::answer(std::string("score:81"), 100ms)});
  p.add("C", {kt::answer(std::string("score:78"), 200ms)});

  {
    keel::call call(p.clock.now(), {.timeout = 5s});
    async_call<keel::fan_out_report<std::string>> run([&] { return panel.run(call, units, p.worker(1s)); });
    p.clock.await_sleepers(4);  // the collector and three workers
    p.clock.advance(1s);        // A and C answer; B times out
    const keel::fan_out_report<std::string> r = run.get();
    CHECK(r.units[0].state == keel::unit_state::succeeded);
    CHECK(r.units[1].state == keel::unit_state::failed);
    CHECK(r.units[2].state == keel::unit_state::succeeded);
    CHECK(r.units[0].saved);
    CHECK(r.units[2].saved);
    CHECK(r.units[1].kind == keel::outcome_kind::transient);
    CHECK(r.units[1].status.code() == absl::StatusCode::kDeadlineExceeded);
    CHECK_FALSE(r.complete());
    CHECK(r.missing() == std::vector<std::string_view>{"B"});
    const absl::Status s = r.status();
    CHECK(s.code() == absl::StatusCode::kUnavailable);
    CHECK(s.message().find("1 of 3 missing: B (failed, transient") != absl::string_view::npos);
    CHECK(call.record().missing == 1);
    // Saved at once, under their keys; B has nothing.
    CHECK(store.load_result(panel.key_of(units[0])).value() == "score:80");
    CHECK(store.load_result(panel.key_of(units[2])).value() == "score:78");
    CHECK_FALSE(store.load_result(panel.key_of(units[1])).value().has_value());
  }
  {
    keel::call call(p.clock.now(), {.timeout = 5s});
    async_call<keel::fan_out_report<std::string>> run([&] { return panel.run(call, units, p.worker(1s)); });
    p.clock.await_sleepers(2);  // the collector and B: nobody else was called
    p.clock.advance(100ms);
    const keel::fan_out_report<std::string> r = run.get();
    REQUIRE(r.status().ok());
    CHECK(r.complete());
    CHECK(r.units[0].state == keel::unit_state::cached);
    CHECK(r.units[1].state == keel::unit_state::succeeded);
    CHECK(r.units[2].state == keel::unit_state::cached);
    CHECK(*r.units[0].value == "score:80");
    CHECK(*r.units[1].value == "score:81");
    CHECK(p.calls("A") == 1);
    CHECK(p.calls("B") == 2);
    CHECK(p.calls("C") == 1);
  }
  const keel::fan_out_figures f = panel.figures();
  CHECK(f.cached == 2);
  CHECK(f.started == 4);
  CHECK(f.saved == 3);
}

TEST_CASE("an invalid answer is a failure, like a timeout, and is never saved", "[fan_out][validate]") {
  providers p;
  store_t store(p.clock);
  keel::bounded_pool pool({.threads = 2, .queue_capacity = 16});
  panel_t panel({.width = 2, .validator = has_score}, store, pool, keel::environment{p.clock});
  const std::vector<keel::unit> units = panel_units({"A", "B"});
  p.add("A", {kt::answer(std::string("score:80"), 10ms)});
  p.add("B", {kt::answer(std::string("I think it's fine"), 10ms), kt::answer(std::string("score:60"), 10ms)});

  keel::call call(p.clock.now(), {.timeout = 5s});
  async_call<keel::fan_out_report<std::string>> run([&] { return panel.run(call, units, p.worker()); });
  p.clock.await_sleepers(3);
  p.clock.advance(10ms);
  const keel::fan_out_report<std::string> r = run.get();
  CHECK(r.units[1].state == keel::unit_state::failed);
  CHECK(r.units[1].status.code() == absl::StatusCode::kInvalidArgument);
  CHECK(r.units[1].status.message() == "invalid result \"I think it's fine\": no score");
  CHECK_FALSE(r.units[1].value.has_value());
  CHECK_FALSE(store.load_result(panel.key_of(units[1])).value().has_value());

  keel::call again(p.clock.now(), {.timeout = 5s});
  async_call<keel::fan_out_report<std::string>> rerun([&] { return panel.run(again, units, p.worker()); });
  p.clock.await_sleepers(2);
  p.clock.advance(10ms);
  const keel::fan_out_report<std::string> r2 = rerun.get();
  CHECK(r2.status().ok());
  CHECK(r2.units[0].state == keel::unit_state::cached);
  CHECK(*r2.units[1].value == "score:60");
  CHECK(p.calls("B") == 2);
}

TEST_CASE("a stored result that no longer passes validation is reported, not used", "[fan_out][validate]") {
  manual_clock clock;
  store_t store(clock);
  keel::bounded_pool pool({.threads = 2, .queue_capacity = 16});
  const std::vector<keel::unit> units = panel_units({"A"});
  std::atomic<int> calls{0};
  auto worker = [&](const keel::unit_context&) -> absl::StatusOr<std::string> {
    ++calls;
    return std::string("score:70");
  };

  SECTION("reported as a failure, the store left alone") {
    panel_t panel({.validator = has_score}, store, pool, keel::environment{clock});
    REQUIRE(store.save_result(panel.key_of(units[0]), "legacy verdict: good", {}).value());
    keel::call call(clock.now(), {.timeout = 5s});
    const keel::fan_out_report<std::string> r = panel.run(call, units, worker);
    CHECK(r.units[0].state == keel::unit_state::failed);
    CHECK(r.units[0].status.message().find("stored result fails validation") != absl::string_view::npos);
    CHECK(calls == 0);
    CHECK(store.load_result(panel.key_of(units[0])).value() == "legacy verdict: good");
  }
  SECTION("or replaced when the options say so") {
    panel_t panel({.replace_invalid_cached = true, .validator = has_score}, store, pool, keel::environment{clock});
    REQUIRE(store.save_result(panel.key_of(units[0]), "legacy verdict: good", {}).value());
    keel::call call(clock.now(), {.timeout = 5s});
    const keel::fan_out_report<std::string> r = panel.run(call, units, worker);
    CHECK(r.units[0].state == keel::unit_state::succeeded);
    CHECK(calls == 1);
    CHECK(store.load_result(panel.key_of(units[0])).value() == "score:70");
  }
}

TEST_CASE("unit keys are digests of what determines the result", "[fan_out][keys]") {
  manual_clock clock;
  store_t store(clock);
  keel::bounded_pool pool({.threads = 1, .queue_capacity = 4});
  panel_t panel({}, store, pool, keel::environment{clock});
  const auto v1 = panel_units({"A"}, "rubric-v1");
  const auto v1_again = panel_units({"A"}, "rubric-v1");
  const auto v2 = panel_units({"A"}, "rubric-v2");
  CHECK(panel.key_of(v1[0]) == panel.key_of(v1_again[0]));
  CHECK(panel.key_of(v1[0]) == "fanout:" + unit_key("product 42: 3 facts", "A", "rubric-v1").hex());
  CHECK(panel.key_of(v1[0]) != panel.key_of(v2[0]));
  std::atomic<int> calls{0};
  auto worker = [&](const keel::unit_context&) -> absl::StatusOr<std::string> {
    ++calls;
    return std::string("score:1");
  };
  keel::call a(clock.now(), {.timeout = 5s});
  REQUIRE(panel.run(a, v1, worker).status().ok());
  keel::call b(clock.now(), {.timeout = 5s});
  REQUIRE(panel.run(b, v1_again, worker).status().ok());
  CHECK(calls == 1);  // same facts, model and rubric: cached
  keel::call c(clock.now(), {.timeout = 5s});
  REQUIRE(panel.run(c, v2, worker).status().ok());
  CHECK(calls == 2);  // a new rubric is new work
}

TEST_CASE("a quorum cancels the rest; the workers observe it; outstanding work is counted", "[fan_out][quorum]") {
  providers p;
  store_t store(p.clock);
  keel::bounded_pool pool({.threads = 4, .queue_capacity = 16});
  std::mutex log_mu;
  std::vector<std::string> log;
  keel::fan_out panel(
      keel::fan_out_options<std::string>{
          .width = 4, .complete_when = keel::completion::quorum(2), .validator = has_score},
      store, pool, keel::environment{p.clock}.with_listener(event_log{&log_mu, &log, /*only_cancelled=*/true}));
  const std::vector<keel::unit> units = panel_units({"A", "B", "C", "D"});
  p.add("A", {kt::answer(std::string("score:70"), 100ms)});
  p.add("B", {kt::answer(std::string("score:75"), 200ms)});
  p.add("C", {kt::stall()});
  p.add("D", {kt::stall()});

  keel::call call(p.clock.now(), {.timeout = 5s});
  const keel::time_point t0 = p.clock.now();
  async_call<keel::fan_out_report<std::string>> run([&] { return panel.run(call, units, p.worker(3s)); });
  p.clock.await_sleepers(5);
  p.clock.advance(100ms);
  p.clock.await_sleepers(4);
  p.clock.advance(100ms);  // B answers: two results, the quorum is met
  const keel::fan_out_report<std::string> r = run.get();
  REQUIRE(r.status().ok());
  CHECK(r.rule_met);
  CHECK(r.units[2].state == keel::unit_state::cancelled);
  CHECK(r.units[3].state == keel::unit_state::cancelled);
  CHECK(r.units[2].outstanding);
  CHECK(r.units[3].outstanding);
  CHECK(r.outstanding() == 2);
  CHECK(panel.figures().outstanding == 2);
  CHECK(panel.figures().cancelled == 2);
  std::vector<std::string> saw = p.saw_stop();
  std::sort(saw.begin(), saw.end());
  CHECK(saw == std::vector<std::string>{"C", "D"});  // both workers saw their stop token
  CHECK(p.clock.now() - t0 == std::chrono::duration_cast<keel::duration>(200ms));  // no wait for C's or D's timeout
  std::sort(log.begin(), log.end());
  CHECK(log == std::vector<std::string>{"C cancelled, outstanding", "D cancelled, outstanding"});
}

TEST_CASE("first acceptable: an invalid answer does not count; units not started are never started",
          "[fan_out][first]") {
  providers p;
  store_t store(p.clock);
  keel::bounded_pool pool({.threads = 3, .queue_capacity = 16});
  panel_t panel({.width = 3, .complete_when = keel::completion::first_acceptable(), .validator = has_score}, store,
                pool, keel::environment{p.clock});
  const std::vector<keel::unit> units = panel_units({"A", "B", "C", "D"});
  p.add("A", {kt::stall()});
  p.add("B", {kt::answer(std::string("no idea"), 30ms)});
  p.add("C", {kt::answer(std::string("score:90"), 60ms)});
  p.add("D", {kt::answer(std::string("score:99"), 1ms)});

  keel::call call(p.clock.now(), {.timeout = 5s});
  async_call<keel::fan_out_report<std::string>> run([&] { return panel.run(call, units, p.worker(3s)); });
  p.clock.await_sleepers(4);  // the collector and A, B, C (width 3)
  p.clock.advance(30ms);      // B answers, invalid: D takes its place
  REQUIRE(eventually([&] { return p.calls("D") == 1; }));
  p.clock.await_sleepers(4);  // the collector, A, C and D
  p.clock.advance(1ms);       // D answers first among the valid ones
  const keel::fan_out_report<std::string> r = run.get();
  REQUIRE(r.status().ok());
  REQUIRE(r.best.has_value());
  CHECK(*r.best == 3);
  CHECK(*r.units[*r.best].value == "score:99");
  CHECK(r.units[1].state == keel::unit_state::failed);
  CHECK(r.units[0].state == keel::unit_state::cancelled);
  CHECK(r.units[2].state == keel::unit_state::cancelled);
  CHECK(r.units[0].outstanding);

  SECTION("with width 1, units after the winner are never started") {
    providers q;
    store_t fresh(q.clock);
    panel_t narrow({.width = 1, .complete_when = keel::completion::first_acceptable(), .validator = has_score},
                   fresh, pool, keel::environment{q.clock});
    q.add("A", {kt::answer(std::string("score:50"), 10ms)});
    q.add("B", {kt::answer(std::string("score:60"), 10ms)});
    q.add("C", {kt::answer(std::string("score:70"), 10ms)});
    q.add("D", {kt::answer(std::string("score:80"), 10ms)});
    keel::call c2(q.clock.now(), {.timeout = 5s});
    async_call<keel::fan_out_report<std::string>> run2([&] { return narrow.run(c2, units, q.worker()); });
    q.clock.await_sleepers(2);
    q.clock.advance(10ms);
    const keel::fan_out_report<std::string> r2 = run2.get();
    CHECK(*r2.best == 0);
    CHECK(r2.units[1].state == keel::unit_state::cancelled);
    CHECK_FALSE(r2.units[1].outstanding);
    CHECK(q.calls("B") + q.calls("C") + q.calls("D") == 0);
  }
}

namespace {
struct verdict {
  int score = 0;
  std::string model;
};
}  // namespace

TEST_CASE("best of n by a user score, with a result type of its own", "[fan_out][best]") {
  manual_clock clock;
  keel::memory_store store(clock);
  keel::bounded_pool pool({.threads = 3, .queue_capacity = 16});
  keel::fan_out<verdict, store_t, keel::bounded_pool, keel::environment<manual_clock>> panel(
      {.width = 3,
       .complete_when = keel::completion::best_of(2),
       .score = [](const verdict& v) { return static_cast<double>(v.score); },
       .encode = [](const verdict& v) { return absl::StrCat(v.score, "|", v.model); },
       .decode = [](std::string_view s) -> absl::StatusOr<verdict> {
         const auto bar = s.find('|');
         verdict v;
         if (bar == std::string_view::npos || !absl::SimpleAtoi(keel::detail::to_absl(s.substr(0, bar)), &v.score))
           return absl::DataLossError("bad verdict bytes");
         v.model = std::string(s.substr(bar + 1));
         return v;
       }},
      store, pool, keel::environment{clock});
  const std::vector<keel::unit> units = panel_units({"A", "B", "C"});
  std::atomic<int> c_saw_stop{0};
  auto worker = [&](const keel::unit_context& u) -> absl::StatusOr<verdict> {
    if (u.unit.name == "A") {
      clock.sleep_until(u.start + 50ms, u.stop);
      return verdict{70, "A"};
    }
    if (u.unit.name == "B") {
      clock.sleep_until(u.start + 100ms, u.stop);
      return verdict{90, "B"};
    }
    if (!clock.sleep_until(u.deadline.when(), u.stop)) ++c_saw_stop;
    return absl::CancelledError("C stopped");
  };
  keel::call call(clock.now(), {.timeout = 5s});
  async_call<keel::fan_out_report<verdict>> run([&] { return panel.run(call, units, worker); });
  clock.await_sleepers(4);
  clock.advance(100ms);
  const keel::fan_out_report<verdict> r = run.get();
  REQUIRE(r.status().ok());
  REQUIRE(r.best.has_value());
  CHECK(r.units[*r.best].value->model == "B");
  CHECK(r.units[2].state == keel::unit_state::cancelled);
  CHECK(c_saw_stop == 1);
  CHECK(store.load_result(panel.key_of(units[1])).value() == "90|B");

  // The rerun decodes what was saved.
  keel::call again(clock.now(), {.timeout = 5s});
  async_call<keel::fan_out_report<verdict>> rerun([&] { return panel.run(again, units, worker); });
  const keel::fan_out_report<verdict> r2 = rerun.get();
  CHECK(r2.units[0].state == keel::unit_state::cached);
  CHECK(r2.units[1].state == keel::unit_state::cached);
  CHECK(r2.units[*r2.best].value->score == 90);
}

TEST_CASE("the call's deadline bounds the fan-out: units with no time left are missing", "[fan_out][deadline]") {
  providers p;
  store_t store(p.clock);
  keel::bounded_pool pool({.threads = 1, .queue_capacity = 16});
  panel_t panel({.width = 1, .validator = has_score}, store, pool, keel::environment{p.clock});
  const std::vector<keel::unit> units = panel_units({"A", "B", "C"});
  p.add("A", {kt::answer(std::string("score:70"), 100ms)});
  p.add("B", {kt::stall()});  // runs into the call's deadline
  p.add("C", {kt::answer(std::string("score:70"), 100ms)});

  keel::call call(p.clock.now(), {.timeout = 1s, .response_reserve = 100ms});
  async_call<keel::fan_out_report<std::string>> run([&] { return panel.run(call, units, p.worker(5s)); });
  p.clock.await_sleepers(2);
  p.clock.advance(100ms);
  REQUIRE(eventually([&] { return p.calls("B") == 1; }));
  p.clock.await_sleepers(2);
  CHECK(p.by_name.at("B")->attempts()[0].deadline == call.work_deadline());  // never a fresh deadline
  p.clock.advance(800ms);  // the work deadline (900 ms)
  const keel::fan_out_report<std::string> r = run.get();
  CHECK(r.units[0].state == keel::unit_state::succeeded);
  CHECK(r.units[1].state == keel::unit_state::failed);
  CHECK(r.units[1].status.code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(r.units[2].state == keel::unit_state::missing);
  CHECK(keel::not_started(r.units[2].status));
  CHECK(p.calls("C") == 0);
  CHECK(r.missing() == std::vector<std::string_view>{"B", "C"});
  CHECK(r.status().message().find("C (missing, refused: keel: not started: no time left)") != absl::string_view::npos);
  CHECK(call.record().missing == 2);
}

TEST_CASE("a unit still queued in the executor at the deadline is missing, not failed", "[fan_out][deadline][outcome]") {
  providers p;
  store_t store(p.clock);
  keel::bounded_pool pool({.threads = 1, .queue_capacity = 16});  // B waits in the queue behind A
  panel_t panel({.width = 2, .validator = has_score}, store, pool, keel::environment{p.clock});
  const std::vector<keel::unit> units = panel_units({"A", "B"});
  p.add("A", {kt::stall()});
  p.add("B", {kt::answer(std::string("score:70"), 10ms)});
  keel::call call(p.clock.now(), {.timeout = 1s});
  async_call<keel::fan_out_report<std::string>> run([&] { return panel.run(call, units, p.worker(5s)); });
  p.clock.await_sleepers(2);  // the collector and A
  p.clock.advance(1s);
  const keel::fan_out_report<std::string> r = run.get();
  CHECK(r.units[0].state == keel::unit_state::failed);  // A ran into the deadline: the provider's failure
  CHECK(r.units[0].kind == keel::outcome_kind::transient);
  REQUIRE(r.units[1].state == keel::unit_state::missing);
  CHECK(r.units[1].kind == keel::outcome_kind::refused);
  // Refused by the fan-out's own deadline check, or (when the executor took
  // it up just before the collector stopped it) by the worker's time_limit.
  const std::string by = keel::refused_by(r.units[1].status).value_or("");
  CHECK((by == "deadline" || by == "time_limit"));
  CHECK(keel::not_started(r.units[1].status));
  CHECK(p.calls("B") == 0);
  CHECK(r.status().code() == absl::StatusCode::kUnavailable);
  CHECK(panel.figures().failed == 1);
  CHECK(panel.figures().missing == 1);
}

TEST_CASE("a partial panel may be accepted: OK, degraded, and it names what is missing", "[fan_out][partial]") {
  manual_clock clock;
  store_t store(clock);
  keel::bounded_pool pool({.threads = 2, .queue_capacity = 16});
  panel_t panel({.width = 2, .require_complete = false, .validator = has_score}, store, pool, keel::environment{clock});
  const std::vector<keel::unit> units = panel_units({"A", "B", "C"});
  auto worker = [](const keel::unit_context& u) -> absl::StatusOr<std::string> {
    if (u.unit.name == "B") return absl::UnauthenticatedError("B: invalid API key");
    return std::string("score:60");
  };
  keel::call call(clock.now(), {.timeout = 5s});
  const keel::fan_out_report<std::string> r = panel.run(call, units, worker);
  CHECK(r.status().ok());
  CHECK_FALSE(r.complete());
  CHECK(r.missing() == std::vector<std::string_view>{"B"});
  CHECK(r.units[1].kind == keel::outcome_kind::permanent);
  CHECK(call.record().degraded);
  CHECK(call.record().missing == 1);

  keel::call strict_call(clock.now(), {.timeout = 5s});
  panel_t strict({.width = 2, .validator = has_score}, store, pool, keel::environment{clock});
  const keel::fan_out_report<std::string> r2 = strict.run(strict_call, units, worker);
  CHECK(r2.status().code() == absl::StatusCode::kFailedPrecondition);  // every failure is permanent
  CHECK(r2.status().message().find("B (failed, permanent: B: invalid API key)") != absl::string_view::npos);
}

TEST_CASE("the environment's listener sees each unit's real state changes, in order, and the run's figures",
          "[fan_out][progress][events]") {
  manual_clock clock;
  store_t store(clock);
  keel::bounded_pool pool({.threads = 2, .queue_capacity = 16});
  std::mutex log_mu;
  std::vector<std::string> log;
  keel::fan_out panel(keel::fan_out_options<std::string>{.width = 1, .validator = has_score}, store, pool,
                      keel::environment{clock}.with_listener(event_log{&log_mu, &log}));
  const std::vector<keel::unit> units = panel_units({"A", "B", "C"});
  REQUIRE(store.save_result(panel.key_of(units[0]), "score:10", {}).value());
  auto worker = [](const keel::unit_context& u) -> absl::StatusOr<std::string> {
    if (u.unit.name == "C") return absl::UnavailableError("C is down");
    return std::string("score:20");
  };
  keel::call call(clock.now(), {.timeout = 5s});
  const keel::fan_out_report<std::string> r = panel.run(call, units, worker);
  CHECK(log == std::vector<std::string>{"A cached", "B running", "B succeeded, saved", "C running",
                                        "C failed, transient",
                                        "finished: 3 units, 1 cached, 1 succeeded, 1 failed, 0 missing, rule not met"});
  CHECK(r.count(keel::unit_state::cached) == 1);
  CHECK(r.count(keel::unit_state::succeeded) == 1);
  CHECK(r.count(keel::unit_state::failed) == 1);
}

TEST_CASE("cancelling the call cancels running units; those not started are missing", "[fan_out][cancel]") {
  providers p;
  store_t store(p.clock);
  keel::bounded_pool pool({.threads = 2, .queue_capacity = 16});
  panel_t panel({.width = 2}, store, pool, keel::environment{p.clock});
  const std::vector<keel::unit> units = panel_units({"A", "B", "C"});
  p.add("A", {kt::stall()});
  p.add("B", {kt::stall()});
  p.add("C", {kt::stall()});
  std::stop_source caller;
  keel::call call(p.clock.now(), {.timeout = 5s, .stop = caller.get_token()});
  async_call<keel::fan_out_report<std::string>> run([&] { return panel.run(call, units, p.worker(3s)); });
  p.clock.await_sleepers(3);
  caller.request_stop();
  const keel::fan_out_report<std::string> r = run.get();
  CHECK(r.units[0].state == keel::unit_state::cancelled);
  CHECK(r.units[1].state == keel::unit_state::cancelled);
  CHECK(r.units[2].state == keel::unit_state::missing);
  CHECK(r.units[2].status.code() == absl::StatusCode::kCancelled);
  CHECK(p.calls("C") == 0);
  CHECK(p.saw_stop().size() == 2);
}

TEST_CASE("a full executor delays units but never loses them", "[fan_out][executor]") {
  keel::memory_store store;
  keel::bounded_pool pool({.threads = 1, .queue_capacity = 1});
  keel::fan_out<std::string, keel::memory_store, keel::bounded_pool> panel({.width = 6}, store, pool);
  const std::vector<keel::unit> units = panel_units({"A", "B", "C", "D", "E", "F"});
  std::atomic<int> calls{0};
  auto worker = [&](const keel::unit_context& u) -> absl::StatusOr<std::string> {
    ++calls;
    return "score:" + u.unit.name;
  };
  keel::call call(keel::real_clock{}.now(), {.timeout = 30s});
  const keel::fan_out_report<std::string> r = panel.run(call, units, worker);
  CHECK(r.status().ok());
  CHECK(r.count(keel::unit_state::succeeded) == 6);
  CHECK(calls == 6);
}

namespace {
// A pool that answers a refusal only once everything it took has finished:
// the refusal is stale by the time fan_out hears of it, which on a real
// pool happens when the units ahead finish while fan_out submits.
struct stale_refusal_pool {
  keel::bounded_pool& pool;
  std::atomic<int> stale_refusals{0};
  absl::Status try_execute(absl::AnyInvocable<void() &&> task) {
    absl::Status s = pool.try_execute(std::move(task));
    if (s.ok()) return s;
    stale_refusals.fetch_add(1);  // lets the held worker go
    while (pool.queued() > 0 || pool.running() > 0) std::this_thread::yield();
    return s;
  }
};
}  // namespace

TEST_CASE("a refusal that goes stale while fan_out submits is tried again, not reported missing",
          "[fan_out][executor]") {
  keel::memory_store store;
  keel::bounded_pool inner({.threads = 1, .queue_capacity = 1});
  stale_refusal_pool pool{inner};
  keel::fan_out<std::string, keel::memory_store, stale_refusal_pool> panel({.width = 6}, store, pool);
  const std::vector<keel::unit> units = panel_units({"A", "B", "C", "D", "E", "F"});
  std::atomic<int> calls{0};
  auto worker = [&](const keel::unit_context& u) -> absl::StatusOr<std::string> {
    ++calls;
    // The first unit holds the one thread until the queue behind it has
    // refused, so a refusal happens on every run.
    while (pool.stale_refusals.load() == 0) std::this_thread::yield();
    return "score:" + u.unit.name;
  };
  keel::call call(keel::real_clock{}.now(), {.timeout = 30s});
  const keel::fan_out_report<std::string> r = panel.run(call, units, worker);
  REQUIRE(pool.stale_refusals > 0);  // the case under test happened
  CHECK(r.status().ok());
  CHECK(r.count(keel::unit_state::succeeded) == 6);
  CHECK(r.count(keel::unit_state::missing) == 0);
  CHECK(calls == 6);
}

namespace {
// An executor that sees the callable fan_out hands it before it becomes a
// task, and counts what making the task allocates.
struct task_probe {
  keel::bounded_pool& pool;
  std::atomic<int> tasks{0};
  std::atomic<std::int64_t> allocations{0};
  template <class F>
  absl::Status try_execute(F&& f) {
    keel_test::count_allocations count;
    absl::AnyInvocable<void() &&> task(std::forward<F>(f));
    allocations.fetch_add(count.count());
    tasks.fetch_add(1);
    return pool.try_execute(std::move(task));
  }
};
}  // namespace

TEST_CASE("fan_out's tasks fit the executor's task inline: submitting a unit allocates nothing",
          "[fan_out][executor][alloc]") {
  keel::memory_store store;
  keel::bounded_pool inner({.threads = 2, .queue_capacity = 8});
  task_probe pool{inner};
  STATIC_REQUIRE(keel::executor<task_probe>);
  keel::fan_out<std::string, keel::memory_store, task_probe> panel({.width = 3}, store, pool);
  const std::vector<keel::unit> units = panel_units({"A", "B", "C"});
  auto worker = [](const keel::unit_context& u) -> absl::StatusOr<std::string> { return "score:" + u.unit.name; };
  keel::call call(keel::real_clock{}.now(), {.timeout = 30s});
  const keel::fan_out_report<std::string> r = panel.run(call, units, worker);
  CHECK(r.count(keel::unit_state::succeeded) == 3);
  CHECK(pool.tasks == 3);
  if (keel_test::allocations_counted()) CHECK(pool.allocations == 0);
}

TEST_CASE("concurrent fan-outs on one pool and store stay consistent", "[fan_out][stress]") {
  keel::memory_store store;
  keel::bounded_pool pool({.threads = 4, .queue_capacity = 64});
  keel::fan_out<std::string, keel::memory_store, keel::bounded_pool> panel(
      {.width = 3, .complete_when = keel::completion::quorum(3), .validator = has_score}, store, pool);
  std::atomic<int> worker_calls{0};
  constexpr int callers = 4;
  constexpr int rounds = 25;
  std::vector<int> ok(callers, 0);
  std::vector<int> consistent(callers, 0);
  {
    std::vector<std::thread> threads;
    for (int t = 0; t < callers; ++t) {
      threads.emplace_back([&, t] {
        std::minstd_rand rng(static_cast<unsigned>(t) + 7);
        for (int round = 0; round < rounds; ++round) {
          // Callers share half their units, so saves race on the same keys.
          std::vector<keel::unit> units;
          for (int u = 0; u < 6; ++u) {
            const std::string model = absl::StrCat("m", u);
            const std::string facts = u % 2 == 0 ? absl::StrCat("shared-", round) : absl::StrCat("own-", t, "-", round);
            units.push_back({.name = model, .key = unit_key(facts, model, "r")});
          }
          std::vector<std::chrono::microseconds> waits;
          for (int u = 0; u < 6; ++u) waits.emplace_back(static_cast<int>(rng() % 500));
          keel::call call(keel::real_clock{}.now(), {.timeout = 10s});
          const keel::fan_out_report<std::string> r =
              panel.run(call, units, [&](const keel::unit_context& u) -> absl::StatusOr<std::string> {
                ++worker_calls;
                const auto wait = waits[u.index];
                if (!keel::real_clock{}.sleep_until(keel::real_clock{}.now() + wait, u.stop))
                  return keel::mark_not_started(absl::CancelledError("stopped before sending"));
                if (u.index == 5) return std::string("garbage");
                return absl::StrCat("score:", u.index);
              });
          int accounted = 0;
          for (const auto& u : r.units) {
            accounted += u.state == keel::unit_state::cached || u.state == keel::unit_state::succeeded ||
                                 u.state == keel::unit_state::failed || u.state == keel::unit_state::cancelled ||
                                 u.state == keel::unit_state::missing
                             ? 1
                             : 0;
          }
          if (r.status().ok()) ++ok[static_cast<std::size_t>(t)];
          if (accounted == 6 && r.results() >= 3) ++consistent[static_cast<std::size_t>(t)];
        }
      });
    }
    for (std::thread& t : threads) t.join();
  }
  for (int t = 0; t < callers; ++t) {
    CHECK(ok[static_cast<std::size_t>(t)] == rounds);
    CHECK(consistent[static_cast<std::size_t>(t)] == rounds);
  }
  // Every stored value is the one valid answer for its unit: "score:<index>"
  // for units 0-4, nothing for unit 5 (its answer fails validation), and each
  // key holds the answer of the one save that created it.
  const keel::fan_out_figures f = panel.figures();
  CHECK(f.save_errors == 0);
  std::set<std::string> seen;  // shared keys are looked at once
  std::vector<std::string> wrong;
  for (int t = 0; t < callers; ++t) {
    for (int round = 0; round < rounds; ++round) {
      int kept = 0;
      for (int u = 0; u < 6; ++u) {
        const std::string model = absl::StrCat("m", u);
        const std::string facts = u % 2 == 0 ? absl::StrCat("shared-", round) : absl::StrCat("own-", t, "-", round);
        const std::string key = panel.key_of({.name = model, .key = unit_key(facts, model, "r")});
        const absl::StatusOr<std::optional<std::string>> value = store.load_result(key);
        REQUIRE(value.ok());
        if (!value->has_value()) continue;  // cancelled once the quorum was met: never saved
        ++kept;
        seen.insert(key);
        if (u == 5 || **value != absl::StrCat("score:", u)) {
          wrong.push_back(absl::StrCat(facts, "/", model, ": ", **value));
        }
      }
      if (kept < 3) wrong.push_back(absl::StrCat("caller ", t, " round ", round, ": only ", kept, " results stored"));
    }
  }
  CHECK(wrong.empty());
  CHECK(static_cast<std::int64_t>(seen.size()) == f.saved);  // no key holds a result no save created
  CHECK(worker_calls.load() <= f.started);  // a unit cancelled before it ran never calls the worker
  CHECK(f.started + f.cached >= callers * rounds * 3);
}

TEST_CASE("invalid fan-out options and rules are refused naming the field", "[fan_out][options]") {
  using opts = keel::fan_out_options<std::string>;
  CHECK(opts{.width = 0}.validate().message() == "fan_out_options.width must be in [1, 1024] (got 0)");
  CHECK(opts{.complete_when = keel::completion::quorum(0)}.validate().message() ==
        "fan_out_options.complete_when.k must be >= 1 for quorum and best_of (got 0)");
  CHECK(opts{.complete_when = keel::completion::best_of(2)}.validate().message() ==
        "fan_out_options.score must be set for completion::best_of (got empty)");
  CHECK(keel::fan_out_options<int>{}.validate().message() ==
        "fan_out_options.encode must be set for a result type other than std::string (got empty)");
  manual_clock clock;
  store_t store(clock);
  keel::bounded_pool pool({.threads = 1});
  CHECK_THROWS_AS(panel_t({.width = -3}, store, pool, keel::environment{clock}), keel::invalid_options);

  panel_t quorum({.complete_when = keel::completion::quorum(4)}, store, pool, keel::environment{clock});
  keel::call call(clock.now(), {.timeout = 5s});
  const auto r = quorum.run(call, panel_units({"A", "B"}),
                            [](const keel::unit_context&) -> absl::StatusOr<std::string> { return std::string("x"); });
  CHECK(r.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(r.status().message() == "fan_out.complete_when.k must be at most the number of units (got 4 > 2)");
}

TEST_CASE("a fan-out run in a pipeline stage takes the pipeline's environment", "[fan_out][events][environment]") {
  manual_clock clock;
  store_t store(clock);
  keel::bounded_pool pool({.threads = 2, .queue_capacity = 16});
  // Built with the default environment: the real clock, the default
  // classifier (FailedPrecondition is permanent), no listener.
  keel::fan_out<std::string, store_t, keel::bounded_pool> panel({.width = 2, .validator = has_score}, store, pool);
  const std::vector<keel::unit> units = panel_units({"A", "B"});
  std::mutex log_mu;
  std::vector<std::string> log;
  keel::fan_out_report<std::string> r;
  auto pipe = keel::pipeline(panel_stage<decltype(panel)>{&panel, &units, &r})
                  .in(keel::environment{clock, over_quota_is_refused{}, event_log{&log_mu, &log}});
  keel::call call(clock.now(), {.timeout = 5s});
  REQUIRE(pipe.run(call, [](const keel::attempt&) { return absl::OkStatus(); }).ok());
  // The pipeline's classifier: B was refused, so it is missing, not failed.
  CHECK(r.units[1].state == keel::unit_state::missing);
  CHECK(r.units[1].kind == keel::outcome_kind::refused);
  // The pipeline's clock: no time passes on the manual clock.
  CHECK(r.units[0].latency == keel::duration::zero());
  // The pipeline's listener.
  std::sort(log.begin(), log.end() - 1);  // two workers: their events interleave; the run's figures come last
  CHECK(log == std::vector<std::string>{"A running", "A succeeded, saved", "B missing, refused", "B running",
                                        "finished: 2 units, 0 cached, 1 succeeded, 0 failed, 1 missing, rule not met"});
}
