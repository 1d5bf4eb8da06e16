// The seed's whole plan as one pipeline, built once, outer to inner:
//
//   fallback -> admission -> bulkhead -> time_limit -> hedge -> retry
//            -> breaker registry -> adaptive timeout -> provider
//
// run end to end on the manual clock: the happy path, the seed's timeline
// (a stalled model, one deadline spent once, a degraded answer), an open
// breaker and an admission refusal; and how often one successful call reads
// the clock. examples/seed_timeline.cpp is the same plan as a story.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <stop_token>
#include <string>
#include <thread>
#include <utility>

#include "keel/core/timer.hpp"
#include "keel/compose/executor.hpp"
#include "keel/compose/fallback.hpp"
#include "keel/compose/hedge.hpp"
#include "keel/compose/pipeline.hpp"
#include "keel/core/call.hpp"
#include "keel/core/condition.hpp"
#include "keel/policy/adaptive_timeout.hpp"
#include "keel/policy/admission.hpp"
#include "keel/policy/breaker_registry.hpp"
#include "keel/policy/bulkhead.hpp"
#include "keel/policy/circuit_breaker.hpp"
#include "keel/policy/retry.hpp"
#include "keel/policy/retry_budget.hpp"
#include "keel/policy/time_limit.hpp"
#include "keel/testing/manual_clock.hpp"
#include "keel/testing/scripted_provider.hpp"
#include "support/async.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;
using keel::testing::manual_clock;
namespace kt = keel::testing;
using text_provider = kt::scripted_provider<std::string>;
constexpr auto sleep_mode = text_provider::mode::sleep;

namespace {

using keel_test::async_call;
using keel_test::eventually;

keel::duration ms(long long n) { return std::chrono::duration_cast<keel::duration>(std::chrono::milliseconds(n)); }

// A manual clock that counts the reads made through this handle. The hedge's
// timer thread gets a handle that counts nothing: only the call's own reads
// are counted.
class counting_clock {
 public:
  counting_clock(manual_clock clock, std::atomic<int>* reads) : clock_(std::move(clock)), reads_(reads) {}

  [[nodiscard]] keel::time_point now() const noexcept {
    if (reads_ != nullptr) reads_->fetch_add(1, std::memory_order_relaxed);
    return clock_.now();
  }
  bool sleep_until(keel::time_point t, std::stop_token stop) const { return clock_.sleep_until(t, std::move(stop)); }
  template <class Ready>
  bool wait_until(std::unique_lock<std::mutex>& lock, keel::condition& cv, keel::time_point t,
                  std::stop_token stop, Ready ready) const {
    return clock_.wait_until(lock, cv, t, std::move(stop), std::move(ready));
  }

 private:
  manual_clock clock_;
  std::atomic<int>* reads_;
};
static_assert(keel::clock<counting_clock>);

constexpr keel::labels learner{.tenant = "learner-7",
                               .model = "m-large",
                               .endpoint = "api.provider",
                               .region = "eu",
                               .work_class = "interactive"};

// The plan's shared parts, built once at startup.
template <class Clock>
struct seed_parts {
  explicit seed_parts(Clock timer_clock, bool primary_on_caller_thread = false)
      : hedge_timer(std::move(timer_clock)),
        quotas({.tenant_defaults = {.rate = 20, .burst = 40, .max_in_flight = 8},
                .model_defaults = {.max_in_flight = 64},
                .tenants = {{"learner-7", {.rate = 20, .burst = 40, .max_in_flight = 1}}}}),
        pools({.classes = {{.name = "interactive", .capacity = 24, .max_queue = 48},
                           {.name = "batch", .capacity = 8, .max_queue = 16},
                           {.name = "recovery", .capacity = 8}}}),
        budget({.ratio = 0.1}),
        hedge_pool({.threads = 2, .queue_capacity = 8}),
        // The retry inside deposits each call's request; the hedge only spends.
        hedger({.delay = 400ms, .percentile = 0.95, .min_delay = 100ms, .max_hedges = 1, .budget = &budget,
                .deposit_requests = false, .min_attempt_time = 500ms,
                .primary_on_caller_thread = primary_on_caller_thread},
               hedge_pool, hedge_timer),
        breakers({.breaker = {.minimum_calls = 20, .open_duration = 10s}}),
        timeouts({.margin = 200ms, .lower = 500ms, .upper = 1500ms, .initial = 1s}) {}

  keel::deadline_timer<Clock> hedge_timer;  // first: outlives the hedge
  keel::admission quotas;
  keel::bulkhead pools;
  keel::retry_budget budget;
  keel::bounded_pool hedge_pool;  // before the hedge: the hedge stops first
  keel::hedge<keel::bounded_pool> hedger;
  keel::breaker_registry breakers;
  keel::adaptive_timeout timeouts;
};

const keel::gate residency("residency", [](const keel::labels& call, const keel::path& p) {
  return call.region.empty() || call.region == p.labels.region;
});

// The seed's plan in the documented order: the fallback sees the primary
// path's final outcome; quotas and the bulkhead refuse before any work; the
// model stage gets at most 1000 ms of what is left; the hedge races attempts
// inside it; each attempt is retried, gated and counted by its domain's
// breaker, and timed by the adaptive timeout.
template <class Clock, class SmallModel, class Cached>
auto seed_plan(seed_parts<Clock>& p, SmallModel& small_model, Cached& cached, Clock clock) {
  return keel::pipeline(
             keel::fallback({residency},
                            keel::alternate("small-model", small_model, {.labels = {.region = "eu"}, .at_most = 3s}),
                            keel::alternate("cached-feedback", cached, {.provider_call = false})),
             p.quotas, p.pools, keel::time_limit({.at_most = 1000ms}), p.hedger,
             keel::retry({.max_attempts = 2, .budget = &p.budget, .min_attempt_time = 500ms}), p.breakers,
             p.timeouts)
      .in(keel::environment{std::move(clock)});
}

absl::StatusOr<std::string> cached_feedback(const keel::attempt&) { return std::string("cached rubric feedback"); }

// The model as a client sees it: a read that times out is then cancelled and
// its connection closed, which takes 100 ms (the seed's 1,300-1,400 ms).
struct closing_model {
  text_provider* model;
  manual_clock clock;
  std::atomic<int>* closing;
  absl::StatusOr<std::string> operator()(const keel::attempt& a) const {
    absl::StatusOr<std::string> r = (*model)(a);
    if (r.status().code() == absl::StatusCode::kDeadlineExceeded) {
      closing->fetch_add(1);
      clock.sleep_until(clock.now() + 100ms, {});
    }
    return r;
  }
};

}  // namespace

TEST_CASE("seed plan, happy path: the primary answers; hedge and fallback armed, neither fires", "[seed_plan][seed]") {
  manual_clock clock;
  seed_parts<manual_clock> parts(clock);
  text_provider small_model(clock, {kt::answer(std::string("small-model feedback"), 600ms)});
  auto cached = cached_feedback;
  const auto plan = seed_plan(parts, small_model, cached, clock);
  text_provider model(clock, {kt::answer(std::string("model feedback"), 250ms)});

  const keel::time_point t0 = clock.now();
  keel::call call(t0, {.timeout = 3s, .response_reserve = 200ms, .labels = learner});
  clock.advance(300ms);  // authenticated, context retrieved
  const absl::StatusOr<std::string> r = plan.run(call, std::ref(model));

  REQUIRE(r.ok());
  CHECK(*r == "model feedback");
  CHECK(clock.now() - t0 == ms(550));
  const keel::call_record rec = call.record();
  CHECK(rec.attempts == 1);
  CHECK(rec.retries == 0);
  CHECK(rec.served_by.empty());
  CHECK_FALSE(rec.degraded);
  REQUIRE(model.calls() == 1);
  const keel::attempt a = model.attempts()[0];
  CHECK(a.number == 1);
  CHECK(a.hedge == 0);
  CHECK(a.start - t0 == ms(300));
  // min(stage: 300 + 1000, adaptive timeout's initial 1000 ms from 300)
  CHECK(a.deadline.when() - t0 == ms(1300));
  CHECK(a.timeout == ms(1000));
  CHECK(small_model.calls() == 0);
  CHECK(parts.hedger.figures().calls == 1);
  CHECK(parts.hedger.figures().hedges_started == 0);
  CHECK(parts.breakers.breaker_for(learner).figures(clock.now()).calls == 1);
  // Admission and the bulkhead gave everything back.
  CHECK(parts.quotas.tenant_figures("learner-7", clock.now())->in_flight == 0);
}

TEST_CASE("seed plan, the seed's timeline: a stalled model, one deadline spent once, a degraded answer",
          "[seed_plan][seed]") {
  manual_clock clock;
  seed_parts<manual_clock> parts(clock);
  text_provider small_model(clock, {kt::answer(std::string("small-model feedback"), 1000ms)});
  auto cached = cached_feedback;
  const auto plan = seed_plan(parts, small_model, cached, clock);
  text_provider stalled(clock, {kt::stall()}, sleep_mode);
  std::atomic<int> closing{0};
  const closing_model model{&stalled, clock, &closing};

  const keel::time_point t0 = clock.now();
  keel::call call(t0, {.timeout = 3s, .response_reserve = 200ms, .labels = learner});
  clock.advance(300ms);
  async_call<absl::StatusOr<std::string>> run([&] { return plan.run(call, std::ref(model)); });

  clock.await_sleepers(2);  // the primary attempt, and the hedge timer waiting for 700 ms
  clock.advance(400ms);     // 700 ms: the hedge starts with what is left of the model stage
  REQUIRE(eventually([&] { return stalled.calls() == 2; }));
  clock.await_sleepers(2);  // primary and hedge, both stalled
  clock.advance(600ms);     // 1300 ms: the model stage is over; both reads time out...
  REQUIRE(eventually([&] { return closing.load() == 2; }));
  clock.await_sleepers(2);  // ...and are cancelled and closed
  clock.advance(100ms);     // 1400 ms: the fallback starts; the small model answers at 2400 ms
  const absl::StatusOr<std::string> r = run.get();

  REQUIRE(r.ok());
  CHECK(*r == "small-model feedback");
  const keel::call_record rec = call.record();
  CHECK(rec.served_by == "small-model");
  CHECK(rec.degraded);
  CHECK(rec.attempts == 3);  // primary, hedge, fallback: the call's whole cap
  CHECK(rec.retries == 0);   // no time was left in the stage for a retry

  // Primary and hedge share the model stage's one deadline (1300 ms).
  REQUIRE(stalled.calls() == 2);
  const keel::attempt primary = stalled.attempts()[0];
  const keel::attempt hedged = stalled.attempts()[1];
  CHECK(primary.number == 1);
  CHECK(primary.hedge == 0);
  CHECK(primary.start - t0 == ms(300));
  CHECK(primary.deadline.when() - t0 == ms(1300));
  CHECK(primary.timeout == ms(1000));
  CHECK(hedged.number == 2);
  CHECK(hedged.hedge == 1);
  CHECK(hedged.start - t0 == ms(700));
  CHECK(hedged.deadline.when() - t0 == ms(1300));
  CHECK(hedged.timeout == ms(600));
  CHECK(parts.hedger.figures().hedges_started == 1);

  // The fallback asked for 3 s and got what remains: 2800 - 1400 ms.
  REQUIRE(small_model.calls() == 1);
  const keel::attempt fb = small_model.attempts()[0];
  CHECK(fb.number == 3);
  CHECK(fb.start - t0 == ms(1400));
  CHECK(fb.deadline.when() == call.work_deadline().when());
  CHECK(fb.deadline.when() - t0 == ms(2800));
  CHECK(fb.timeout == ms(1400));

  CHECK(clock.now() - t0 == ms(2400));
  clock.advance(200ms);  // validated and sent
  CHECK(call.end().remaining(clock.now()) == ms(400));
}

TEST_CASE("seed plan, breaker open: refused before any work, the fallback serves", "[seed_plan][seed]") {
  manual_clock clock;
  seed_parts<manual_clock> parts(clock);
  text_provider small_model(clock, {kt::answer(std::string("small-model feedback"), 600ms)});
  auto cached = cached_feedback;
  const auto plan = seed_plan(parts, small_model, cached, clock);
  text_provider model(clock, {kt::answer(std::string("model feedback"), 250ms)});

  parts.breakers.breaker_for(learner).force_open(clock.now());
  const keel::time_point t0 = clock.now();
  keel::call call(t0, {.timeout = 3s, .response_reserve = 200ms, .labels = learner});
  clock.advance(300ms);
  const absl::StatusOr<std::string> r = plan.run(call, std::ref(model));

  REQUIRE(r.ok());
  CHECK(*r == "small-model feedback");
  CHECK(model.calls() == 0);
  const keel::call_record rec = call.record();
  CHECK(rec.served_by == "small-model");
  CHECK(rec.degraded);
  CHECK(rec.attempts == 1);  // the refusal spent none
  CHECK(rec.retries == 0);   // an open breaker is never retried
  REQUIRE(small_model.calls() == 1);
  const keel::attempt fb = small_model.attempts()[0];
  CHECK(fb.number == 1);
  CHECK(fb.start - t0 == ms(300));
  CHECK(fb.timeout == ms(2500));  // all the work time left: nothing was spent
  CHECK(parts.hedger.figures().hedges_started == 0);
  // The refused pass did no work, so admission rolled it back.
  CHECK(parts.quotas.tenant_figures("learner-7", clock.now())->in_flight == 0);
}

TEST_CASE("seed plan, admission refusal: the primary provider is never called", "[seed_plan][seed]") {
  manual_clock clock;
  seed_parts<manual_clock> parts(clock);
  text_provider small_model(clock, {kt::answer(std::string("small-model feedback"), 600ms)});
  auto cached = cached_feedback;
  text_provider model(clock, {kt::answer(std::string("model feedback"), 250ms)});
  // learner-7 may have one request in flight; this one holds it.
  absl::StatusOr<keel::admission_ticket> held =
      parts.quotas.admit({.tenant = "learner-7", .model = "m-large"}, clock.now());
  REQUIRE(held.ok());
  const keel::time_point t0 = clock.now();
  keel::call call(t0, {.timeout = 3s, .response_reserve = 200ms, .labels = learner});

  SECTION("documented order (fallback outside admission): the refusal falls back to the small model") {
    // The quota's refusal is keel's own (outcome_kind::refused), and a
    // refusal is exactly when an allowed alternate path serves: the small
    // model answers, degraded. Where a tenant over its quota must get
    // nothing, admission goes outside the fallback (the next section) or the
    // alternative gets a gate.
    const auto plan = seed_plan(parts, small_model, cached, clock);
    const absl::StatusOr<std::string> r = plan.run(call, std::ref(model));
    REQUIRE(r.ok());
    CHECK(model.calls() == 0);
    CHECK(small_model.calls() == 1);
    CHECK(call.record().attempts == 1);
    CHECK(call.record().served_by == "small-model");
    CHECK(call.record().degraded);
  }

  SECTION("admission outside the fallback (as the gateway does): refused, no provider call at all") {
    const auto admitted_first = keel::pipeline(parts.quotas,
                                               keel::fallback({residency},
                                                              keel::alternate("small-model", small_model,
                                                                              {.labels = {.region = "eu"},
                                                                               .at_most = 3s}),
                                                              keel::alternate("cached-feedback", cached,
                                                                              {.provider_call = false})),
                                               parts.pools, keel::time_limit({.at_most = 1000ms}), parts.hedger,
                                               keel::retry({.max_attempts = 2, .budget = &parts.budget,
                                                            .min_attempt_time = 500ms}),
                                               parts.breakers, parts.timeouts)
                                    .in(keel::environment{clock});
    const absl::StatusOr<std::string> r = admitted_first.run(call, std::ref(model));
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == absl::StatusCode::kResourceExhausted);
    CHECK(keel::refused_by(r.status()) == "tenant:learner-7:in_flight");
    CHECK(model.calls() == 0);
    CHECK(small_model.calls() == 0);
    CHECK(call.record().attempts == 0);
    CHECK(call.record().served_by.empty());
    CHECK_FALSE(call.record().degraded);
  }
}

// Clock reads per successful single-attempt call, counted through the
// pipeline's clock (the keel::call's construction, one more read in a
// service, is not counted here: the test makes the call from the manual
// clock directly).
//
// The target is at most 2 reads per successful call, shared by every
// policy: the call's start (the caller's read, handed to
// run(call, now, provider)) and the attempt's end (run_context::attempt_end,
// read by the first policy that asks and shared by the rest: the adaptive
// timeout, the breaker, the hedge, the retry's wait). Who else reads the
// clock (grep ctx.clock.now / clock->now in include/keel):
//   pipeline.hpp        run(call, provider) without a time: plan.now
//   hedge               a hedge's start, and the primary's when it runs on
//                       the executor (it may have waited for a thread)
//   retry               after a wait
//   fallback            each alternative's start (failure path only)
//   bulkhead            after a wait in its queue (and while waiting)
// These assert the counts exactly, so a new read fails here.
TEST_CASE("clock reads per successful call: the full protection pipeline and the seed plan", "[seed_plan][clock]") {
  manual_clock base;
  std::atomic<int> reads{0};
  const counting_clock clock(base, &reads);
  struct trivial {
    absl::StatusOr<int> operator()(const keel::attempt& a) const { return a.number; }
  };

  SECTION("BM_Pipeline_Full_Success's pipeline: 2 reads (start, attempt end)") {
    keel::admission quotas({.tenant_defaults = {.rate = 1e9, .burst = 1e12, .max_in_flight = 1000},
                            .model_defaults = {.max_in_flight = 1000}});
    keel::bulkhead pools({.classes = {{.name = "interactive", .capacity = 24}, {.name = "batch", .capacity = 8}}});
    // A slow-call threshold makes the breaker want the attempt's end too.
    keel::circuit_breaker breaker({.name = "llm", .slow_call_rate_threshold = 0.5, .slow_call_duration = 1s});
    keel::retry_budget budget({.ratio = 0.1});
    keel::adaptive_timeout timeouts;
    const auto pipe = keel::pipeline(keel::time_limit({.at_most = 2s}), quotas, pools, breaker,
                                     keel::retry({.max_attempts = 3, .budget = &budget}), timeouts)
                          .in(keel::environment{clock});
    keel::call call(base.now(), {.timeout = 3s, .response_reserve = 200ms,
                                 .labels = {.tenant = "acme", .model = "m-large", .work_class = "interactive"}});
    const absl::StatusOr<int> r = pipe.run(call, trivial{});
    REQUIRE(r.ok());
    CHECK(call.record().attempts == 1);
    // The pass's start and the attempt's end, which the breaker (with a
    // slow-call threshold) and the adaptive timeout share.
    CHECK(reads.load() == 2);
    // Given the time the caller read to make the call: one read in all.
    reads = 0;
    keel::call second(base.now(), {.timeout = 3s, .response_reserve = 200ms,
                                   .labels = {.tenant = "acme", .model = "m-large", .work_class = "interactive"}});
    REQUIRE(pipe.run(second, base.now(), trivial{}).ok());
    CHECK(reads.load() == 1);
  }

  SECTION("the seed plan, primary on the executor (the default)") {
    seed_parts<counting_clock> parts(counting_clock(base, nullptr));
    trivial small_model;
    auto cached = [](const keel::attempt&) -> absl::StatusOr<int> { return 0; };
    const auto plan = seed_plan(parts, small_model, cached, clock);
    keel::call call(base.now(), {.timeout = 3s, .response_reserve = 200ms, .labels = learner});
    const absl::StatusOr<int> r = plan.run(call, trivial{});
    REQUIRE(r.ok());
    CHECK(call.record().attempts == 1);
    CHECK_FALSE(call.record().degraded);
    // The pass's start, the primary's start on the executor, and the
    // attempt's end (shared by the adaptive timeout and the hedge).
    CHECK(reads.load() == 3);
    reads = 0;
    keel::call second(base.now(), {.timeout = 3s, .response_reserve = 200ms, .labels = learner});
    REQUIRE(plan.run(second, base.now(), trivial{}).ok());
    CHECK(reads.load() == 2);
  }

  SECTION("the seed plan with the primary on the caller's thread: the attempt's end only") {
    seed_parts<counting_clock> parts(counting_clock(base, nullptr), /*primary_on_caller_thread=*/true);
    trivial small_model;
    auto cached = [](const keel::attempt&) -> absl::StatusOr<int> { return 0; };
    const auto plan = seed_plan(parts, small_model, cached, clock);
    keel::call call(base.now(), {.timeout = 3s, .response_reserve = 200ms, .labels = learner});
    REQUIRE(plan.run(call, base.now(), trivial{}).ok());
    CHECK(call.record().attempts == 1);
    CHECK(reads.load() == 1);
  }
}
