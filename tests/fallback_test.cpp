// keel::fallback: the remaining deadline only, gates honoured, degraded
// answers marked, deferred and clear-failure endings, writes left alone.
#include "keel/compose/fallback.hpp"

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "keel/core/timer.hpp"
#include "keel/compose/executor.hpp"
#include "keel/compose/hedge.hpp"
#include "keel/compose/pipeline.hpp"
#include "keel/core/call.hpp"
#include "keel/policy/circuit_breaker.hpp"
#include "keel/policy/retry.hpp"
#include "keel/policy/time_limit.hpp"
#include "keel/testing/manual_clock.hpp"
#include "keel/testing/scripted_provider.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;
using keel::testing::manual_clock;
namespace kt = keel::testing;
using text_provider = kt::scripted_provider<std::string>;

namespace {

keel::duration ms(long long n) { return std::chrono::duration_cast<keel::duration>(std::chrono::milliseconds(n)); }

bool contains(absl::string_view haystack, absl::string_view needle) {
  return haystack.find(needle) != absl::string_view::npos;
}

const keel::gate residency("residency", [](const keel::labels& call, const keel::path& p) {
  return call.region.empty() || call.region == p.labels.region;
});

struct recorder {
  std::vector<std::string>* log;
  void operator()(const keel::events::fallback_used& e) const { log->push_back("used " + std::string(e.path)); }
  void operator()(const keel::events::fallback_skipped& e) const {
    using why = keel::events::fallback_skipped::reason;
    log->push_back("skipped " + std::string(e.path) + ": " +
                   (e.why_not == why::gate       ? "gate " + std::string(e.gate)
                    : e.why_not == why::deadline ? std::string("deadline")
                    : e.why_not == why::failed   ? std::string("failed")
                                                 : std::string("cancelled")));
  }
};

}  // namespace

TEST_CASE("the seed's timeline: the fallback gets only what is left of the deadline, and is marked degraded",
          "[fallback][seed]") {
  manual_clock clock;
  const keel::time_point t0 = clock.now();
  keel::call call(t0, {.timeout = 3s, .response_reserve = 200ms, .labels = {.tenant = "learner-7"}});
  clock.advance(300ms);  // admitted and context retrieved

  text_provider model(clock, {kt::stall()});
  // The fallback asks for a fresh 3 s.
  text_provider cached(clock, {kt::answer(std::string("cached rubric feedback"), 1000ms)});
  auto pipe = keel::pipeline(keel::fallback({}, keel::alternate("cached-feedback", cached, {.at_most = 3s})),
                             keel::time_limit({.at_most = 1000ms}))
                  .in(keel::environment{clock});
  const absl::StatusOr<std::string> r = pipe.run(call, model);
  REQUIRE(r.ok());
  CHECK(*r == "cached rubric feedback");
  // The model attempt ran 300 -> 1300 ms; the fallback started at 1300 ms
  // with the work deadline (2800 ms) as its own: 1500 ms, not 3 s.
  REQUIRE(cached.calls() == 1);
  const keel::attempt seen = cached.attempts()[0];
  CHECK(seen.start - t0 == ms(1300));
  CHECK(seen.deadline == call.work_deadline());
  CHECK(seen.timeout == ms(1500));
  CHECK(clock.now() - t0 == ms(2300));
  const keel::call_record rec = call.record();
  CHECK(rec.served_by == "cached-feedback");
  CHECK(rec.degraded);
  CHECK(rec.attempts == 2);  // the model and the fallback provider
}

TEST_CASE("an alternative's at_most narrows what is left, never extends it", "[fallback][deadline]") {
  manual_clock clock;
  clock.auto_advance(true);
  keel::call call(clock.now(), {.timeout = 2s});
  text_provider model(clock, {kt::unavailable(100ms)});
  text_provider quick(clock, {kt::answer(std::string("quick"), 10ms)});
  auto pipe = keel::pipeline(keel::fallback({}, keel::alternate("quick", quick, {.at_most = 250ms}))).in(keel::environment{clock});
  REQUIRE(pipe.run(call, model).value() == "quick");
  CHECK(quick.attempts()[0].timeout == ms(250));
}

TEST_CASE("a primary that answers is not degraded and no alternative runs", "[fallback]") {
  manual_clock clock;
  clock.auto_advance(true);
  keel::call call(clock.now(), {.timeout = 2s});
  text_provider model(clock, {kt::answer(std::string("fresh"), 100ms)});
  text_provider cached(clock, {kt::answer(std::string("cached"))});
  auto pipe = keel::pipeline(keel::fallback({}, keel::alternate("cached", cached))).in(keel::environment{clock});
  CHECK(pipe.run(call, model).value() == "fresh");
  CHECK(cached.calls() == 0);
  CHECK_FALSE(call.record().degraded);
  CHECK(call.record().served_by.empty());
}

TEST_CASE("gates are honoured: a refused alternative is skipped, never called", "[fallback][gates]") {
  manual_clock clock;
  clock.auto_advance(true);
  std::vector<std::string> log;
  const keel::gate permitted("permissions", [](const keel::labels& call, const keel::path& p) -> absl::Status {
    if (call.tenant == "acme" && p.labels.model == "m-experimental")
      return absl::PermissionDeniedError("acme has not consented to experimental models");
    return absl::OkStatus();
  });
  text_provider model(clock, {kt::unavailable(50ms)});
  text_provider us_model(clock, {kt::answer(std::string("from the US"))});
  text_provider experimental(clock, {kt::answer(std::string("experimental"))});
  text_provider eu_small(clock, {kt::answer(std::string("from the EU"), 20ms)});
  auto fb = keel::fallback({residency, permitted},
                           keel::alternate("us-model", us_model, {.labels = {.model = "m-large", .region = "us"}}),
                           keel::alternate("experimental", experimental,
                                           {.labels = {.model = "m-experimental", .region = "eu"}}),
                           keel::alternate("eu-small", eu_small, {.labels = {.model = "m-small", .region = "eu"}}));
  auto pipe = keel::pipeline(fb).in(keel::environment{clock}.with_listener(recorder{&log}));

  keel::call call(clock.now(), {.timeout = 2s, .labels = {.tenant = "acme", .region = "eu"}});
  const absl::StatusOr<std::string> r = pipe.run(call, model);
  REQUIRE(r.ok());
  CHECK(*r == "from the EU");
  CHECK(us_model.calls() == 0);
  CHECK(experimental.calls() == 0);
  CHECK(call.record().served_by == "eu-small");
  CHECK(call.record().degraded);
  CHECK(log == std::vector<std::string>{"skipped us-model: gate residency", "skipped experimental: gate permissions",
                                        "used eu-small"});

  SECTION("when every alternative is refused, the primary's failure comes back, saying why") {
    text_provider model2(clock, {kt::unavailable(50ms)});
    auto only_us = keel::pipeline(keel::fallback(
                                      {residency}, keel::alternate("us-model", us_model, {.labels = {.region = "us"}})))
                       .in(keel::environment{clock});
    keel::call eu(clock.now(), {.timeout = 2s, .labels = {.region = "eu"}});
    const absl::StatusOr<std::string> failed = only_us.run(eu, model2);
    CHECK(failed.status().code() == absl::StatusCode::kUnavailable);
    CHECK(contains(failed.status().message(), "us-model: gate residency refused"));
    CHECK(contains(failed.status().message(), "scripted: provider unavailable"));
    CHECK(us_model.calls() == 0);
    CHECK_FALSE(eu.record().degraded);
  }
}

TEST_CASE("a gate reads the caller's request; a failure that passes through is never replaced", "[fallback][gates]") {
  manual_clock clock;
  clock.auto_advance(true);
  struct feedback_request {
    bool accepts_degraded;
  };
  // Built once, for every request: the gate reads each call's own request.
  const keel::gate consent("consent", keel::from_request<feedback_request>(
                                          [](const feedback_request& r, const keel::path&) { return r.accepts_degraded; },
                                          false));
  text_provider cached(clock, {kt::answer(std::string("cached")), kt::answer(std::string("cached"))});
  auto pipe = keel::pipeline(keel::fallback({consent}, keel::alternate("cached", cached, {.provider_call = false})))
                  .in(keel::environment{clock});

  const feedback_request yes{.accepts_degraded = true};
  const feedback_request no{.accepts_degraded = false};
  text_provider failing(clock, {kt::unavailable(10ms), kt::unavailable(10ms), kt::unavailable(10ms)});
  keel::call a(clock.now(), {.timeout = 2s}, yes);
  CHECK(pipe.run(a, failing).value_or("") == "cached");
  keel::call b(clock.now(), {.timeout = 2s}, no);
  CHECK(pipe.run(b, failing).status().code() == absl::StatusCode::kUnavailable);
  keel::call c(clock.now(), {.timeout = 2s});  // no request of that type: the gate's default
  CHECK(pipe.run(c, failing).status().code() == absl::StatusCode::kUnavailable);
  CHECK(cached.calls() == 1);

  // A tenant over its own quota hears its refusal, not a degraded answer;
  // other refusals still fall back.
  auto own_quota = [](const absl::Status& s) { return keel::refused_by(s).value_or("").starts_with("tenant:"); };
  auto strict = keel::pipeline(keel::fallback({.passes_through = own_quota}, {},
                                              keel::alternate("cached", cached, {.provider_call = false})))
                    .in(keel::environment{clock});
  auto refused = [](std::string who) {
    return [who](const keel::attempt&) -> absl::StatusOr<std::string> {
      return keel::refusal(absl::ResourceExhaustedError("over quota"), who, 1s);
    };
  };
  keel::call d(clock.now(), {.timeout = 2s});
  CHECK(keel::refused_by(strict.run(d, refused("tenant:acme:rate")).status()) == "tenant:acme:rate");
  keel::call e(clock.now(), {.timeout = 2s});
  CHECK(strict.run(e, refused("model:m:in_flight")).value_or("") == "cached");
}

TEST_CASE("alternatives are tried in order until one answers", "[fallback]") {
  manual_clock clock;
  clock.auto_advance(true);
  std::vector<std::string> log;
  text_provider model(clock, {kt::unavailable(50ms)});
  text_provider second(clock, {kt::rate_limited(1s, 10ms)});
  text_provider third(clock, {kt::answer(std::string("third"), 10ms)});
  auto pipe = keel::pipeline(keel::fallback({}, keel::alternate("second", second), keel::alternate("third", third)))
                  .in(keel::environment{clock}.with_listener(recorder{&log}));
  keel::call call(clock.now(), {.timeout = 2s, .max_attempts = 5});
  CHECK(pipe.run(call, model).value() == "third");
  CHECK(log == std::vector<std::string>{"skipped second: failed", "used third"});
  CHECK(call.record().served_by == "third");
  CHECK(call.record().attempts == 3);
}

TEST_CASE("an alternative with less than its min_time left is skipped", "[fallback][deadline]") {
  manual_clock clock;
  clock.auto_advance(true);
  std::vector<std::string> log;
  keel::call call(clock.now(), {.timeout = 1s});
  text_provider model(clock, {kt::unavailable(800ms)});
  text_provider big(clock, {kt::answer(std::string("big"))});
  text_provider cached(clock, {kt::answer(std::string("cached"))});
  auto pipe = keel::pipeline(keel::fallback({}, keel::alternate("big-model", big, {.min_time = 500ms}),
                                            keel::alternate("cached", cached, {.provider_call = false})))
                  .in(keel::environment{clock}.with_listener(recorder{&log}));
  CHECK(pipe.run(call, model).value() == "cached");
  CHECK(big.calls() == 0);
  CHECK(log == std::vector<std::string>{"skipped big-model: deadline", "used cached"});
  CHECK(call.record().attempts == 1);  // the local answer spent no attempt
  CHECK(cached.attempts()[0].number == 0);
}

TEST_CASE("a terminal alternative may answer with a deferred result or a clear failure", "[fallback][deferred]") {
  manual_clock clock;
  clock.auto_advance(true);
  text_provider model(clock, {kt::unavailable(50ms)});
  text_provider after(clock, {kt::answer(std::string("never reached"))});

  SECTION("deferred: accepted, check back") {
    auto queue_job = [](const keel::attempt&) -> absl::StatusOr<std::string> {
      return keel::deferred("job-42", 30s, "feedback queued; check back in 30 s");
    };
    auto pipe = keel::pipeline(keel::fallback({}, keel::alternate("deferred", queue_job,
                                                                  {.provider_call = false, .terminal = true}),
                                              keel::alternate("after", after)))
                    .in(keel::environment{clock});
    keel::call call(clock.now(), {.timeout = 2s});
    const absl::StatusOr<std::string> r = pipe.run(call, model);
    REQUIRE_FALSE(r.ok());
    CHECK(keel::deferred_ticket(r.status()) == "job-42");
    CHECK(keel::retry_after(r.status()) == std::chrono::duration_cast<keel::duration>(30s));
    CHECK(keel::default_classifier{}(r.status(), {}) == keel::outcome_kind::permanent);
    CHECK(call.record().served_by == "deferred");
    CHECK(call.record().degraded);
    CHECK(after.calls() == 0);
  }

  SECTION("a clear failure written for the user") {
    auto apologise = [] {
      return absl::StatusOr<std::string>(absl::UnavailableError("feedback is unavailable right now; nothing was charged"));
    };
    auto pipe = keel::pipeline(keel::fallback({}, keel::alternate("apology", apologise,
                                                                  {.provider_call = false, .terminal = true})))
                    .in(keel::environment{clock});
    keel::call call(clock.now(), {.timeout = 2s});
    const absl::StatusOr<std::string> r = pipe.run(call, model);
    CHECK(r.status().message() == "feedback is unavailable right now; nothing was charged");
    CHECK(call.record().served_by == "apology");
  }
}

TEST_CASE("a write whose effect is unknown does not fail over", "[fallback][write]") {
  manual_clock clock;
  clock.auto_advance(true);
  text_provider charge(clock, {kt::lost_write(50ms)});
  text_provider other(clock, {kt::answer(std::string("charged again"))});
  auto pipe = keel::pipeline(keel::fallback({}, keel::alternate("other-processor", other))).in(keel::environment{clock});
  keel::call write(clock.now(), {.timeout = 2s, .operation = {.effect = keel::effect::write}});
  const absl::StatusOr<std::string> r = pipe.run(write, charge);
  CHECK(r.status().code() == absl::StatusCode::kUnknown);
  CHECK(other.calls() == 0);

  // With an idempotency identity the same failure may fail over.
  text_provider charge2(clock, {kt::lost_write(50ms)});
  keel::call keyed(clock.now(),
                   {.timeout = 2s, .operation = {.effect = keel::effect::write, .idempotent = true}});
  CHECK(pipe.run(keyed, charge2).value() == "charged again");
}

TEST_CASE("a cancelled call does not fall back; permanent failures may be excluded", "[fallback]") {
  manual_clock clock;
  clock.auto_advance(true);
  text_provider alt(clock, {kt::answer(std::string("alt"))});
  std::stop_source stop;
  keel::call call(clock.now(), {.timeout = 2s, .stop = stop.get_token()});
  auto cancelling = [&]() -> absl::StatusOr<std::string> {
    stop.request_stop();
    return absl::CancelledError("caller went away");
  };
  auto pipe = keel::pipeline(keel::fallback({}, keel::alternate("alt", alt))).in(keel::environment{clock});
  CHECK(pipe.run(call, cancelling).status().code() == absl::StatusCode::kCancelled);
  CHECK(alt.calls() == 0);

  text_provider bad_key(clock, {kt::bad_credential()});
  auto strict = keel::pipeline(keel::fallback(keel::fallback_options{.on_permanent = false}, {},
                                              keel::alternate("alt", alt)))
                    .in(keel::environment{clock});
  keel::call c2(clock.now(), {.timeout = 2s});
  CHECK(strict.run(c2, bad_key).status().code() == absl::StatusCode::kUnauthenticated);
  CHECK(alt.calls() == 0);
  keel::call c3(clock.now(), {.timeout = 2s});
  CHECK(pipe.run(c3, bad_key).value() == "alt");  // on by default: another provider may hold a good key
}

TEST_CASE("on_permanent off still falls back when the breaker opens: a refusal is when the alternate serves",
          "[fallback][breaker][outcome]") {
  manual_clock clock;
  clock.auto_advance(true);
  text_provider alt(clock, {kt::answer(std::string("alt"))});
  keel::circuit_breaker breaker({.name = "primary", .window_calls = 2, .minimum_calls = 2,
                                 .failure_rate_threshold = 0.5, .open_duration = 30s});
  // Fall back on outages, not on bad keys; the breaker sits inside the fallback.
  auto pipe = keel::pipeline(keel::fallback(keel::fallback_options{.on_permanent = false}, {},
                                            keel::alternate("alt", alt)),
                             breaker)
                  .in(keel::environment{clock});
  int primary_calls = 0;
  auto outage = [&]() -> absl::StatusOr<std::string> {
    ++primary_calls;
    return absl::UnavailableError("503");
  };
  for (int i = 0; i < 2; ++i) {
    keel::call c(clock.now(), {.timeout = 2s});
    CHECK(pipe.run(c, outage).value() == "alt");  // a plain 503 fails over
  }
  REQUIRE(breaker.state() == keel::breaker_state::open);
  // Now the breaker refuses before any work: before refusals had their own
  // kind this was "permanent" and on_permanent = false stopped failing over.
  keel::call c(clock.now(), {.timeout = 2s});
  auto r = pipe.run(c, outage);
  REQUIRE(r.ok());
  CHECK(*r == "alt");
  CHECK(c.record().degraded);
  CHECK(c.record().served_by == "alt");
  CHECK(primary_calls == 2);
  CHECK(alt.calls() == 3);
}

TEST_CASE("an alternative that runs its own pipeline on the call uses one attempt", "[fallback][attempts]") {
  manual_clock clock;
  clock.auto_advance(true);
  text_provider model(clock, {kt::unavailable(10ms)});
  text_provider backup(clock, {kt::unavailable(10ms), kt::answer(std::string("backup"), 10ms)});
  keel::call call(clock.now(), {.timeout = 2s, .max_attempts = 3});
  auto backup_stage = keel::pipeline(keel::retry({.max_attempts = 3}, keel::constant_backoff{.delay_each = 1ms})).in(keel::environment{clock});
  auto via_pipeline = [&](const keel::attempt&) { return backup_stage.run(call, backup); };
  auto pipe = keel::pipeline(keel::fallback({}, keel::alternate("backup", via_pipeline))).in(keel::environment{clock});
  CHECK(pipe.run(call, model).value() == "backup");
  // model 1 + the fallback's invocation handed to the inner first attempt + one retry.
  CHECK(call.record().attempts == 3);
  CHECK(backup.calls() == 2);
}

TEST_CASE("invalid alternative options are refused naming the field", "[fallback][options]") {
  CHECK(keel::alternative_options{.at_most = 0ms}.validate().message() ==
        "alternative_options.at_most must be > 0 (got 0s)");
  CHECK(keel::alternative_options{.min_time = -1ms}.validate().message() ==
        "alternative_options.min_time must be >= 0 (got -1ms)");
  auto p = [] { return absl::OkStatus(); };
  CHECK_THROWS_AS(keel::alternate("x", p, {.at_most = -1s}), keel::invalid_options);
}

TEST_CASE("fallback outside a hedge: when the race has no acceptable answer, the alternative serves",
          "[fallback][hedge]") {
  manual_clock clock;
  keel::bounded_pool pool({.threads = 2, .queue_capacity = 8});
  keel::deadline_timer hedger_timer{clock};
  keel::hedge hedger({.delay = 100ms}, pool, hedger_timer);
  text_provider model(clock, {kt::bad_credential(10ms)});  // permanent: the race ends at once, no hedge
  text_provider backup(clock, {kt::answer(std::string("from the backup"), 10ms)});
  auto pipe = keel::pipeline(keel::fallback({}, keel::alternate("backup", backup)), hedger).in(keel::environment{clock});
  keel::call call(clock.now(), {.timeout = 2s});
  // std::ref: a hedged pipeline copies its provider (keel/compose/hedge.hpp); this one outlives the race.
  const absl::StatusOr<std::string> r = pipe.run(call, std::ref(model));
  REQUIRE(r.ok());
  CHECK(*r == "from the backup");
  CHECK(call.record().served_by == "backup");
  CHECK(call.record().degraded);
  CHECK(hedger.figures().hedges_started == 0);
  CHECK(model.calls() == 1);
}
