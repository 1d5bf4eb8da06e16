// keel::hedge on the manual clock: the first acceptable answer wins, losers
// are cancelled and counted, the budget and the write rule stop hedges.
#include "keel/compose/hedge.hpp"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "keel/core/timer.hpp"
#include "keel/compose/executor.hpp"
#include "keel/compose/pipeline.hpp"
#include "keel/core/call.hpp"
#include "keel/policy/backoff.hpp"
#include "keel/policy/retry.hpp"
#include "keel/policy/retry_budget.hpp"
#include "keel/policy/time_limit.hpp"
#include "keel/testing/manual_clock.hpp"
#include "keel/testing/scripted_provider.hpp"
#include "support/alloc_counter.hpp"
#include "support/async.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;
using keel::testing::manual_clock;
namespace kt = keel::testing;
using provider_t = kt::scripted_provider<int>;
constexpr auto sleep_mode = provider_t::mode::sleep;

namespace {

using keel_test::async_call;
using keel_test::eventually;

keel::duration ms(long long n) { return std::chrono::duration_cast<keel::duration>(std::chrono::milliseconds(n)); }

// Waits until every loser of `h`'s races has returned: a call returns with
// its answer while cancelled losers may still run on the executor.
template <class Hedge>
bool losers_returned(const Hedge& h) {
  return eventually([&] { return h.figures().outstanding == 0; });
}

// A thread-safe event log shared by copies of the listener.
struct event_log {
  std::mutex mu;
  std::vector<std::string> lines;
  void add(std::string s) {
    std::lock_guard lock(mu);
    lines.push_back(std::move(s));
  }
  std::vector<std::string> snapshot() {
    std::lock_guard lock(mu);
    return lines;
  }
};

struct recorder {
  event_log* log;
  void operator()(const keel::events::hedge_started& e) const { log->add("started " + std::to_string(e.hedge)); }
  void operator()(const keel::events::hedge_skipped& e) const {
    using why = keel::events::hedge_skipped::reason;
    log->add(std::string("skipped ") + (e.why == why::budget     ? "budget"
                                        : e.why == why::executor ? "executor"
                                                                 : "other"));
  }
  void operator()(const keel::events::hedge_refused_write& e) const {
    log->add(std::string("refused write") + (e.ran_unhedged ? " (ran unhedged)" : ""));
  }
  void operator()(const keel::events::hedge_losers_cancelled& e) const {
    log->add("winner " + std::to_string(e.winner) + ", outstanding " + std::to_string(e.outstanding));
  }
};

// Records the status code each attempt of a wrapped provider returned (codes,
// not absl::Status copies: Debian's libabsl counts a status's references
// where TSan cannot see it, so sharing one across threads looks racy).
struct status_log {
  std::mutex mu;
  std::vector<absl::StatusCode> seen;
  void add(absl::StatusCode c) {
    std::lock_guard lock(mu);
    seen.push_back(c);
  }
  std::vector<absl::StatusCode> snapshot() {
    std::lock_guard lock(mu);
    return seen;
  }
};

auto logged(provider_t& p, status_log& log) {
  return [&p, &log](const keel::attempt& a) {
    absl::StatusOr<int> r = p(a);
    log.add(r.status().code());
    return r;
  };
}

}  // namespace

TEST_CASE("a hedge starts after the delay; the first acceptable success wins over an earlier failure",
          "[hedge][seed]") {
  manual_clock clock;
  keel::bounded_pool pool({.threads = 2, .queue_capacity = 8});
  keel::deadline_timer hedger_timer{clock};
  keel::hedge hedger({.delay = 100ms, .max_hedges = 1}, pool, hedger_timer);
  auto pipe = keel::pipeline(hedger).in(keel::environment{clock});

  SECTION("the hedge fails fast; the slower primary still wins") {
    provider_t primary(clock, {kt::answer(1, 300ms)}, sleep_mode);
    provider_t backup(clock, {kt::unavailable(20ms)}, sleep_mode);
    keel::call call(clock.now(), {.timeout = 1s});
    const keel::time_point t0 = clock.now();
    async_call<absl::StatusOr<int>> run([&] { return pipe.run(call, keel::alternates(std::ref(primary), std::ref(backup))); });
    clock.await_sleepers(2);  // the primary, and the timer waiting for the hedge delay
    clock.advance(100ms);
    REQUIRE(eventually([&] { return backup.calls() == 1; }));
    clock.await_sleepers(2);  // primary and hedge
    clock.advance(20ms);      // the hedge fails at 120 ms...
    clock.await_sleepers(1);
    CHECK_FALSE(run.done());  // ...and the race goes on
    clock.advance(180ms);
    const absl::StatusOr<int> r = run.get();
    REQUIRE(r.ok());
    CHECK(*r == 1);
    CHECK(clock.now() - t0 == ms(300));
    CHECK(backup.attempts()[0].start - t0 == ms(100));
    CHECK(backup.attempts()[0].hedge == 1);
    CHECK(primary.attempts()[0].hedge == 0);
    CHECK(hedger.figures().hedges_started == 1);
    CHECK(hedger.figures().hedge_wins == 0);
  }

  SECTION("the primary fails after the hedge started; the hedge's later success wins") {
    provider_t primary(clock, {kt::unavailable(150ms)}, sleep_mode);
    provider_t backup(clock, {kt::answer(2, 100ms)}, sleep_mode);
    keel::call call(clock.now(), {.timeout = 1s});
    async_call<absl::StatusOr<int>> run([&] { return pipe.run(call, keel::alternates(std::ref(primary), std::ref(backup))); });
    clock.await_sleepers(2);
    clock.advance(100ms);
    REQUIRE(eventually([&] { return backup.calls() == 1; }));
    clock.await_sleepers(2);
    clock.advance(50ms);  // the primary fails at 150 ms
    clock.await_sleepers(1);
    CHECK_FALSE(run.done());
    clock.advance(50ms);
    const absl::StatusOr<int> r = run.get();
    REQUIRE(r.ok());
    CHECK(*r == 2);
    CHECK(hedger.figures().hedge_wins == 1);
    CHECK(call.record().attempts == 2);
  }
}

TEST_CASE("a winning hedge cancels the primary, which observes its stop token", "[hedge][cancel]") {
  manual_clock clock;
  keel::bounded_pool pool({.threads = 2, .queue_capacity = 8});
  event_log events;
  keel::deadline_timer hedger_timer{clock};
  keel::hedge hedger({.delay = 100ms}, pool, hedger_timer);
  auto pipe = keel::pipeline(hedger).in(keel::environment{clock}.with_listener(recorder{&events}));
  provider_t primary(clock, {kt::stall()}, sleep_mode);
  provider_t backup(clock, {kt::answer(7, 30ms)}, sleep_mode);
  status_log primary_saw;
  keel::call call(clock.now(), {.timeout = 2s});
  async_call<absl::StatusOr<int>> run(
      [&] { return pipe.run(call, keel::alternates(logged(primary, primary_saw), std::ref(backup))); });
  clock.await_sleepers(2);
  clock.advance(100ms);
  REQUIRE(eventually([&] { return backup.calls() == 1; }));
  clock.await_sleepers(2);
  clock.advance(30ms);
  const absl::StatusOr<int> r = run.get();
  REQUIRE(r.ok());
  CHECK(*r == 7);
  REQUIRE(losers_returned(hedger));
  // The primary was asked to stop and returned because it honoured that.
  const std::vector<absl::StatusCode> saw = primary_saw.snapshot();
  REQUIRE(saw.size() == 1);
  CHECK(saw[0] == absl::StatusCode::kCancelled);
  CHECK(primary.attempts()[0].stop.stop_requested());
  CHECK_FALSE(backup.attempts()[0].stop.stop_requested());
  CHECK_FALSE(call.stop_token().stop_requested());  // the call itself was not cancelled
  const keel::hedge_figures f = hedger.figures();
  CHECK(f.hedge_wins == 1);
  CHECK(f.cancelled_losers == 1);
  CHECK(f.outstanding == 0);
  CHECK(events.snapshot() == std::vector<std::string>{"started 1", "winner 1, outstanding 1"});
}

TEST_CASE("a loser that ignores its stop token does not hold the caller once a hedge answered",
          "[hedge][cancel][outstanding]") {
  manual_clock clock;
  keel::bounded_pool pool({.threads = 2, .queue_capacity = 8});
  event_log events;
  std::atomic<bool> saw_stop{false};
  std::atomic<int> stubborn_returned{0};
  // Ignores its stop token for 10 s, like an upstream call that cannot be
  // interrupted.
  auto stubborn = [&](const keel::attempt& a) -> absl::StatusOr<int> {
    a.charge(5);
    clock.sleep_until(a.start + 10s, {});
    saw_stop = a.stop.stop_requested();
    a.charge(100);  // after the call has its answer: not on its record
    ++stubborn_returned;
    return absl::CancelledError("stubborn: gave up late");
  };
  provider_t backup(clock, {kt::answer(7, 30ms)}, sleep_mode);

  SECTION("the primary runs on the executor: the call returns with the hedge's answer at once") {
    keel::deadline_timer hedger_timer{clock};
    keel::hedge hedger({.delay = 100ms}, pool, hedger_timer);
    auto pipe = keel::pipeline(hedger).in(keel::environment{clock}.with_listener(recorder{&events}));
    keel::call call(clock.now(), {.timeout = 20s});
    const keel::time_point t0 = clock.now();
    async_call<absl::StatusOr<int>> run([&] { return pipe.run(call, keel::alternates(stubborn, std::ref(backup))); });
    clock.await_sleepers(2);
    clock.advance(100ms);
    REQUIRE(eventually([&] { return backup.calls() == 1; }));
    clock.await_sleepers(2);
    clock.advance(30ms);  // the hedge wins at 130 ms; the primary sleeps on until 10 s
    const bool returned_at_once = eventually([&] { return run.done(); });
    CHECK(returned_at_once);
    if (!returned_at_once) clock.advance(10s);  // held by the loser: let it go, so the test ends
    const absl::StatusOr<int> r = run.get();
    REQUIRE(r.ok());
    CHECK(*r == 7);
    CHECK(clock.now() - t0 == ms(130));
    CHECK(stubborn_returned == 0);  // still running...
    const keel::hedge_figures f = hedger.figures();
    CHECK(f.cancelled_losers == 1);
    CHECK(f.outstanding == 1);      // ...and counted
    CHECK(f.hedge_wins == 1);
    CHECK(call.record().attempts == 2);
    CHECK(call.record().cost == 5);
    CHECK(events.snapshot() == std::vector<std::string>{"started 1", "winner 1, outstanding 1"});
    clock.await_sleepers(1);
    clock.advance(10s);
    REQUIRE(losers_returned(hedger));
    CHECK(stubborn_returned == 1);
    CHECK(saw_stop);
    CHECK(hedger.figures().cancelled_losers == 1);
    CHECK(call.record().cost == 5);  // the loser's later charge stayed off the call's record
  }

  SECTION("primary_on_caller_thread: the caller is the loser's thread, and waits for it") {
    keel::deadline_timer hedger_timer{clock};
    keel::hedge hedger({.delay = 100ms, .primary_on_caller_thread = true}, pool, hedger_timer);
    auto pipe = keel::pipeline(hedger).in(keel::environment{clock});
    keel::call call(clock.now(), {.timeout = 20s});
    const keel::time_point t0 = clock.now();
    std::atomic<std::thread::id> primary_thread{};
    auto stubborn_here = [&](const keel::attempt& a) -> absl::StatusOr<int> {
      primary_thread = std::this_thread::get_id();
      return stubborn(a);
    };
    std::atomic<std::thread::id> caller_thread{};
    async_call<absl::StatusOr<int>> run([&] {
      caller_thread = std::this_thread::get_id();
      return pipe.run(call, keel::alternates(stubborn_here, std::ref(backup)));
    });
    clock.await_sleepers(2);
    clock.advance(100ms);
    REQUIRE(eventually([&] { return backup.calls() == 1; }));
    clock.await_sleepers(2);
    clock.advance(30ms);
    REQUIRE(eventually([&] { return hedger.figures().hedge_wins == 1; }));
    clock.await_sleepers(1);  // the primary, on the caller's thread
    CHECK(primary_thread.load() == caller_thread.load());
    clock.advance(10s - 130ms);
    const absl::StatusOr<int> r = run.get();
    CHECK(r.value() == 7);
    CHECK(clock.now() - t0 == ms(10'000));
    CHECK(hedger.figures().outstanding == 0);
  }
}

TEST_CASE("two hedges, one per delay; the winner cancels both others", "[hedge][cancel]") {
  manual_clock clock;
  keel::bounded_pool pool({.threads = 3, .queue_capacity = 8});
  event_log events;
  keel::deadline_timer hedger_timer{clock};
  keel::hedge hedger({.delay = 100ms, .max_hedges = 2}, pool, hedger_timer);
  auto pipe = keel::pipeline(hedger).in(keel::environment{clock}.with_listener(recorder{&events}));
  provider_t primary(clock, {kt::stall()}, sleep_mode);
  provider_t first(clock, {kt::stall()}, sleep_mode);
  provider_t second(clock, {kt::answer(3, 10ms)}, sleep_mode);
  keel::call call(clock.now(), {.timeout = 2s, .max_attempts = 3});
  const keel::time_point t0 = clock.now();
  async_call<absl::StatusOr<int>> run([&] {
    return pipe.run(call, keel::alternates(std::ref(primary), std::ref(first), std::ref(second)));
  });
  clock.await_sleepers(2);
  clock.advance(100ms);
  REQUIRE(eventually([&] { return first.calls() == 1; }));
  clock.await_sleepers(3);  // primary, first hedge, and the timer for the second
  clock.advance(100ms);
  REQUIRE(eventually([&] { return second.calls() == 1; }));
  clock.await_sleepers(3);
  clock.advance(10ms);
  const absl::StatusOr<int> r = run.get();
  REQUIRE(r.ok());
  CHECK(*r == 3);
  CHECK(second.attempts()[0].start - t0 == ms(200));
  CHECK(primary.attempts()[0].stop.stop_requested());
  CHECK(first.attempts()[0].stop.stop_requested());
  CHECK(hedger.figures().cancelled_losers == 2);
  CHECK(events.snapshot() == std::vector<std::string>{"started 1", "started 2", "winner 2, outstanding 2"});
  CHECK(call.record().attempts == 3);
  CHECK(losers_returned(hedger));
}

TEST_CASE("the retry budget stops hedges", "[hedge][budget]") {
  manual_clock clock;
  keel::bounded_pool pool({.threads = 2, .queue_capacity = 8});
  // No ratio, and a floor of one retry (then one per 10 s).
  keel::retry_budget budget({.ratio = 0.0, .min_per_second = 0.1, .window = 10s});
  event_log events;
  keel::deadline_timer hedger_timer{clock};
  keel::hedge hedger({.delay = 100ms, .budget = &budget}, pool, hedger_timer);
  auto pipe = keel::pipeline(hedger).in(keel::environment{clock}.with_listener(recorder{&events}));
  provider_t primary(clock, {kt::answer(1, 300ms)}, sleep_mode);
  provider_t backup(clock, {kt::answer(2, 10ms)}, sleep_mode);
  auto both = keel::alternates(std::ref(primary), std::ref(backup));

  {  // the first slow call may hedge: the budget has one retry
    keel::call call(clock.now(), {.timeout = 1s});
    async_call<absl::StatusOr<int>> run([&] { return pipe.run(call, both); });
    clock.await_sleepers(2);
    clock.advance(100ms);
    REQUIRE(eventually([&] { return backup.calls() == 1; }));
    clock.await_sleepers(2);
    clock.advance(10ms);
    CHECK(run.get().value() == 2);
    REQUIRE(losers_returned(hedger));
  }
  {  // the second may not: the primary runs alone
    keel::call call(clock.now(), {.timeout = 1s});
    async_call<absl::StatusOr<int>> run([&] { return pipe.run(call, both); });
    clock.await_sleepers(2);
    clock.advance(100ms);
    REQUIRE(eventually([&] { return hedger.figures().skipped_budget == 1; }));
    clock.advance(200ms);
    CHECK(run.get().value() == 1);
  }
  CHECK(backup.calls() == 1);
  CHECK(primary.calls() == 2);
  CHECK(hedger.figures().hedges_started == 1);
  CHECK(budget.figures(clock.now()).requests == 2);  // the hedge deposits each call
  CHECK(events.snapshot() == std::vector<std::string>{"started 1", "winner 1, outstanding 1", "skipped budget"});
}

TEST_CASE("retries and hedges spend one retry budget: retries that drained it stop the hedge",
          "[hedge][budget][retry]") {
  manual_clock clock;
  keel::bounded_pool pool({.threads = 2, .queue_capacity = 8});
  // No ratio, and a floor of two retries at once (then one per 500 ms).
  keel::retry_budget shared({.ratio = 0.0, .min_per_second = 2, .window = 10s});
  keel::retry_budget elsewhere({.ratio = 0.0, .min_per_second = 2, .window = 10s});
  event_log events;
  keel::deadline_timer hedger_timer{clock};
  keel::hedge hedger({.delay = 100ms, .budget = &shared}, pool, hedger_timer);
  // The primary's first two tries fail after 10 ms each and are retried
  // without a wait; its third is slow (300 ms). A hedge answers in 10 ms.
  provider_t primary(clock, {kt::unavailable(10ms), kt::unavailable(10ms), kt::answer(1, 300ms)}, sleep_mode);
  provider_t backup(clock, {kt::answer(2, 10ms)}, sleep_mode);
  auto both = keel::alternates(std::ref(primary), std::ref(backup));
  keel::call call(clock.now(), {.timeout = 1s, .max_attempts = 5});  // the attempt cap is not what stops it
  const keel::time_point t0 = clock.now();

  // Hedge outside, retry inside: each attempt of the race is a retry loop,
  // so the primary's retries happen before the hedge is due.
  auto retry_until_the_hedge_is_due = [&] {
    clock.await_sleepers(2);  // the primary's first try, and the timer waiting for the hedge delay
    clock.advance(10ms);
    REQUIRE(eventually([&] { return primary.calls() == 2; }));
    clock.await_sleepers(2);
    clock.advance(10ms);
    REQUIRE(eventually([&] { return primary.calls() == 3; }));
    clock.await_sleepers(2);  // the slow third try, and the timer
    clock.advance(80ms);      // 100 ms: the hedge is due
  };
  constexpr keel::constant_backoff at_once{.delay_each = keel::duration::zero()};

  SECTION("the retries spent the shared budget: the hedge is skipped for the budget") {
    keel::retry retrier({.max_attempts = 3, .budget = &shared}, at_once);
    auto pipe = keel::pipeline(hedger, retrier).in(keel::environment{clock}.with_listener(recorder{&events}));
    async_call<absl::StatusOr<int>> run([&] { return pipe.run(call, both); });
    retry_until_the_hedge_is_due();
    // Decided either way (not REQUIRE'd: a started hedge must fail the checks
    // below, not leave the call waiting on the clock).
    REQUIRE(eventually([&] {
      const keel::hedge_figures f = hedger.figures();
      return f.hedges_started + f.skipped_budget + f.skipped_executor + f.skipped_other == 1;
    }));
    CHECK(hedger.figures().skipped_budget == 1);
    CHECK(shared.figures(clock.now()).retries == 2);  // both spent by the retries; none by the hedge
    clock.advance(220ms);
    CHECK(run.get().value() == 1);  // the slow primary's answer, at 320 ms
    CHECK(clock.now() - t0 == ms(320));
    CHECK(backup.calls() == 0);
    const keel::hedge_figures f = hedger.figures();
    CHECK(f.hedges_started == 0);
    CHECK(f.skipped_other == 0);
    CHECK(events.snapshot() == std::vector<std::string>{"skipped budget"});
  }

  SECTION("control: retries spending another budget leave room, and the same hedge starts") {
    keel::retry retrier({.max_attempts = 3, .budget = &elsewhere}, at_once);
    auto pipe = keel::pipeline(hedger, retrier).in(keel::environment{clock}.with_listener(recorder{&events}));
    async_call<absl::StatusOr<int>> run([&] { return pipe.run(call, both); });
    retry_until_the_hedge_is_due();
    REQUIRE(eventually([&] { return backup.calls() == 1; }));
    clock.await_sleepers(2);  // the primary's third try and the hedge
    clock.advance(10ms);
    CHECK(run.get().value() == 2);  // the hedge's answer, at 110 ms
    CHECK(elsewhere.figures(clock.now()).retries == 2);
    CHECK(shared.figures(clock.now()).retries == 1);  // the hedge's
    CHECK(hedger.figures().hedges_started == 1);
    CHECK(hedger.figures().skipped_budget == 0);
    CHECK(events.snapshot() == std::vector<std::string>{"started 1", "winner 1, outstanding 1"});
    REQUIRE(losers_returned(hedger));  // the retrier below the hedge is this section's pipeline's
  }
  CHECK(call.record().retries == 2);
}

TEST_CASE("a consequential write without an idempotency identity is never hedged", "[hedge][write]") {
  manual_clock clock;
  keel::bounded_pool pool({.threads = 2, .queue_capacity = 8});
  event_log events;
  provider_t primary(clock, {kt::stall()}, sleep_mode);
  provider_t backup(clock, {kt::answer(2, 10ms)}, sleep_mode);
  auto both = keel::alternates(std::ref(primary), std::ref(backup));

  SECTION("refused with a clear status, nothing called") {
    keel::deadline_timer hedger_timer{clock};
    keel::hedge hedger({.delay = 100ms}, pool, hedger_timer);
    auto pipe = keel::pipeline(hedger).in(keel::environment{clock}.with_listener(recorder{&events}));
    keel::call write(clock.now(), {.timeout = 1s, .operation = {.effect = keel::effect::write}});
    const absl::StatusOr<int> r = pipe.run(write, both);
    CHECK(r.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK(keel::not_started(r.status()));
    CHECK(keel::default_classifier{}(r.status(), write.operation()) == keel::outcome_kind::permanent);
    CHECK(r.status().message().find("never hedged") != absl::string_view::npos);
    CHECK(primary.calls() + backup.calls() == 0);
    CHECK(hedger.figures().refused_writes == 1);
    CHECK(events.snapshot() == std::vector<std::string>{"refused write"});
  }

  SECTION("or run as a single attempt when the options say so") {
    provider_t slow(clock, {kt::answer(5, 300ms)}, sleep_mode);
    keel::deadline_timer hedger_timer{clock};
    keel::hedge hedger({.delay = 100ms, .run_unsafe_writes_unhedged = true}, pool, hedger_timer);
    auto pipe = keel::pipeline(hedger).in(keel::environment{clock}.with_listener(recorder{&events}));
    keel::call write(clock.now(), {.timeout = 1s, .operation = {.effect = keel::effect::write}});
    async_call<absl::StatusOr<int>> run([&] { return pipe.run(write, keel::alternates(std::ref(slow), std::ref(backup))); });
    clock.await_sleepers(1);  // the attempt only: no hedge timer armed
    clock.advance(300ms);
    CHECK(run.get().value() == 5);
    CHECK(backup.calls() == 0);
    CHECK(hedger.figures().hedges_started == 0);
    CHECK(events.snapshot() == std::vector<std::string>{"refused write (ran unhedged)"});
  }

  SECTION("an idempotent write is hedged") {
    keel::deadline_timer hedger_timer{clock};
    keel::hedge hedger({.delay = 100ms}, pool, hedger_timer);
    auto pipe = keel::pipeline(hedger).in(keel::environment{clock});
    keel::call write(clock.now(),
                     {.timeout = 1s, .operation = {.effect = keel::effect::write, .idempotent = true}});
    async_call<absl::StatusOr<int>> run([&] { return pipe.run(write, both); });
    clock.await_sleepers(2);
    clock.advance(100ms);
    REQUIRE(eventually([&] { return backup.calls() == 1; }));
    clock.await_sleepers(2);
    clock.advance(10ms);
    CHECK(run.get().value() == 2);
    REQUIRE(losers_returned(hedger));
  }
}

namespace {
struct charge_card {
  static constexpr keel::operation operation{.effect = keel::effect::write};
  absl::StatusOr<int> operator()(const keel::attempt&) const { return 1; }
};
struct charge_card_with_key {
  static constexpr keel::operation operation{.effect = keel::effect::write, .idempotent = true};
  absl::StatusOr<int> operator()(const keel::attempt&) const { return 1; }
};
}  // namespace

TEST_CASE("a provider type that declares a non-idempotent write is rejected at compile time", "[hedge][write]") {
  // The pipeline's static_assert fires on exactly this combination; the
  // build test fanout_unsafe_write_does_not_compile proves it does.
  STATIC_REQUIRE(keel::declares_unsafe_write<charge_card>());
  STATIC_REQUIRE(keel::declares_unsafe_write<charge_card&>());
  STATIC_REQUIRE_FALSE(keel::declares_unsafe_write<charge_card_with_key>());
  STATIC_REQUIRE_FALSE(keel::declares_unsafe_write<provider_t>());
  STATIC_REQUIRE(keel::concurrent_policy<keel::hedge<keel::bounded_pool>&>);
  STATIC_REQUIRE_FALSE(keel::concurrent_policy<keel::time_limit>);
}

namespace {
absl::StatusOr<int> answer_hedge_number(const keel::attempt& a) { return a.hedge; }
}  // namespace

TEST_CASE("a hedged pipeline copies its provider: a function, a copyable callable or std::ref of one",
          "[hedge][provider]") {
  keel::bounded_pool pool({.threads = 2, .queue_capacity = 8});
  keel::hedge hedger({.delay = 10s}, pool);
  auto pipe = keel::pipeline(hedger);
  keel::call first(keel::real_clock{}.now(), {.timeout = 30s});
  CHECK(pipe.run(first, answer_hedge_number).value() == 0);  // a function: its pointer is copied
  // The copy is what the attempts call: state the caller's object changes
  // afterwards is not seen, state shared through std::ref is.
  struct counter {
    std::shared_ptr<std::atomic<int>> calls = std::make_shared<std::atomic<int>>(0);
    absl::StatusOr<int> operator()(const keel::attempt&) const { return ++*calls; }
  };
  counter c;
  keel::call second(keel::real_clock{}.now(), {.timeout = 30s});
  CHECK(pipe.run(second, c).value() == 1);
  CHECK(*c.calls == 1);  // shared by the copy
  struct not_copyable {
    std::mutex mu;
    int calls = 0;
    absl::StatusOr<int> operator()(const keel::attempt&) {
      std::lock_guard lock(mu);
      return 5 + calls++;
    }
  } shared;
  keel::call third(keel::real_clock{}.now(), {.timeout = 30s});
  CHECK(pipe.run(third, std::ref(shared)).value() == 5);  // not copyable: shared by reference
  std::lock_guard lock(shared.mu);
  CHECK(shared.calls == 1);
}

TEST_CASE("a fast retryable failure with nothing else running starts the hedge at once", "[hedge]") {
  manual_clock clock;
  keel::bounded_pool pool({.threads = 2, .queue_capacity = 8});
  keel::deadline_timer hedger_timer{clock};
  keel::hedge hedger({.delay = 100ms}, pool, hedger_timer);
  auto pipe = keel::pipeline(hedger).in(keel::environment{clock});
  provider_t primary(clock, {kt::unavailable(10ms)}, sleep_mode);
  provider_t backup(clock, {kt::answer(5, 20ms)}, sleep_mode);
  keel::call call(clock.now(), {.timeout = 1s});
  const keel::time_point t0 = clock.now();
  async_call<absl::StatusOr<int>> run([&] { return pipe.run(call, keel::alternates(std::ref(primary), std::ref(backup))); });
  clock.await_sleepers(2);
  clock.advance(10ms);
  REQUIRE(eventually([&] { return backup.calls() == 1; }));
  clock.await_sleepers(2);  // the hedge, and the timer still armed for 100 ms
  clock.advance(20ms);
  CHECK(run.get().value() == 5);
  CHECK(backup.attempts()[0].start - t0 == ms(10));
}

TEST_CASE("a permanent failure with nothing else running ends the race", "[hedge]") {
  manual_clock clock;
  keel::bounded_pool pool({.threads = 2, .queue_capacity = 8});
  keel::deadline_timer hedger_timer{clock};
  keel::hedge hedger({.delay = 100ms}, pool, hedger_timer);
  auto pipe = keel::pipeline(hedger).in(keel::environment{clock});
  provider_t primary(clock, {kt::bad_credential(10ms)}, sleep_mode);
  provider_t backup(clock, {kt::answer(5, 20ms)}, sleep_mode);
  keel::call call(clock.now(), {.timeout = 1s});
  async_call<absl::StatusOr<int>> run([&] { return pipe.run(call, keel::alternates(std::ref(primary), std::ref(backup))); });
  clock.await_sleepers(2);
  clock.advance(10ms);
  CHECK(run.get().status().code() == absl::StatusCode::kUnauthenticated);
  CHECK(backup.calls() == 0);
}

TEST_CASE("an answer the acceptance check refuses does not win", "[hedge][accept]") {
  manual_clock clock;
  keel::bounded_pool pool({.threads = 2, .queue_capacity = 8});
  keel::deadline_timer hedger_timer{clock};
  keel::hedge hedger({.delay = 100ms}, pool, hedger_timer, [](int v) { return v > 0; });
  auto pipe = keel::pipeline(hedger).in(keel::environment{clock});

  SECTION("a later acceptable answer wins") {
    provider_t primary(clock, {kt::answer(0, 150ms)}, sleep_mode);
    provider_t backup(clock, {kt::answer(9, 100ms)}, sleep_mode);
    keel::call call(clock.now(), {.timeout = 1s});
    async_call<absl::StatusOr<int>> run([&] { return pipe.run(call, keel::alternates(std::ref(primary), std::ref(backup))); });
    clock.await_sleepers(2);
    clock.advance(100ms);
    REQUIRE(eventually([&] { return backup.calls() == 1; }));
    clock.await_sleepers(2);
    clock.advance(50ms);  // the primary answers 0: finished, but not acceptable
    clock.await_sleepers(1);
    CHECK_FALSE(run.done());
    clock.advance(50ms);
    CHECK(run.get().value() == 9);
  }

  SECTION("no acceptable answer: a clear failure, not the unacceptable value") {
    provider_t primary(clock, {kt::answer(0, 150ms)}, sleep_mode);
    provider_t backup(clock, {kt::answer(-1, 100ms)}, sleep_mode);
    keel::call call(clock.now(), {.timeout = 1s});
    async_call<absl::StatusOr<int>> run([&] { return pipe.run(call, keel::alternates(std::ref(primary), std::ref(backup))); });
    clock.await_sleepers(2);
    clock.advance(100ms);
    REQUIRE(eventually([&] { return backup.calls() == 1; }));
    clock.await_sleepers(2);
    clock.advance(100ms);
    const absl::StatusOr<int> r = run.get();
    CHECK(r.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK(r.status().message().find("acceptance check") != absl::string_view::npos);
  }
}

TEST_CASE("cancelling the call stops every attempt of the race", "[hedge][cancel]") {
  manual_clock clock;
  keel::bounded_pool pool({.threads = 2, .queue_capacity = 8});
  keel::deadline_timer hedger_timer{clock};
  keel::hedge hedger({.delay = 100ms}, pool, hedger_timer);
  auto pipe = keel::pipeline(hedger).in(keel::environment{clock});
  provider_t primary(clock, {kt::stall()}, sleep_mode);
  provider_t backup(clock, {kt::stall()}, sleep_mode);
  status_log saw;
  std::stop_source caller;
  keel::call call(clock.now(), {.timeout = 5s, .stop = caller.get_token()});
  async_call<absl::StatusOr<int>> run(
      [&] { return pipe.run(call, keel::alternates(logged(primary, saw), logged(backup, saw))); });
  clock.await_sleepers(2);
  clock.advance(100ms);
  REQUIRE(eventually([&] { return backup.calls() == 1; }));
  clock.await_sleepers(2);
  caller.request_stop();
  CHECK(run.get().status().code() == absl::StatusCode::kCancelled);
  REQUIRE(losers_returned(hedger));
  const std::vector<absl::StatusCode> statuses = saw.snapshot();
  REQUIRE(statuses.size() == 2);
  CHECK(statuses[0] == absl::StatusCode::kCancelled);
  CHECK(statuses[1] == absl::StatusCode::kCancelled);
}

TEST_CASE("the hedge delay can be a percentile of recent latency, learned online", "[hedge][percentile]") {
  manual_clock clock;
  keel::bounded_pool pool({.threads = 2, .queue_capacity = 8});
  keel::deadline_timer hedger_timer{clock};
  keel::hedge hedger({.delay = 100ms, .percentile = 0.9, .samples = 16, .min_samples = 16}, pool, hedger_timer);
  auto pipe = keel::pipeline(hedger).in(keel::environment{clock});
  CHECK(hedger.current_delay() == ms(100));  // nothing learned yet
  for (int i = 0; i < 16; ++i) {
    keel::call call(clock.now(), {.timeout = 1s});
    const absl::StatusOr<int> r = pipe.run(call, [&](const keel::attempt&) -> absl::StatusOr<int> {
      clock.advance(ms(10 + i));  // 10 ... 25 ms, all below the 100 ms delay
      return i;
    });
    REQUIRE(r.ok());
  }
  // Nearest rank of p90 over 16 samples is the 15th smallest: 24 ms.
  CHECK(hedger.current_delay() == ms(24));
  CHECK(hedger.figures().hedges_started == 0);

  provider_t primary(clock, {kt::stall()}, sleep_mode);
  provider_t backup(clock, {kt::answer(1, 5ms)}, sleep_mode);
  keel::call call(clock.now(), {.timeout = 1s});
  const keel::time_point t0 = clock.now();
  async_call<absl::StatusOr<int>> run([&] { return pipe.run(call, keel::alternates(std::ref(primary), std::ref(backup))); });
  clock.await_sleepers(2);
  clock.advance(24ms);
  REQUIRE(eventually([&] { return backup.calls() == 1; }));
  clock.await_sleepers(2);
  clock.advance(5ms);
  CHECK(run.get().value() == 1);
  CHECK(backup.attempts()[0].start - t0 == ms(24));
  REQUIRE(losers_returned(hedger));
}

TEST_CASE("a hedge the executor refuses is skipped; the primary goes on", "[hedge][executor]") {
  manual_clock clock;
  // Declared before the pool: the pool (destroyed first) joins the task that uses them.
  std::mutex hold_mu;
  std::condition_variable hold_cv;
  bool release = false;
  std::atomic<bool> busy{false};
  keel::bounded_pool pool({.threads = 1, .queue_capacity = 1});
  REQUIRE(pool.try_execute([&] {
                busy = true;
                std::unique_lock lock(hold_mu);
                hold_cv.wait(lock, [&] { return release; });
              }).ok());
  REQUIRE(eventually([&] { return busy.load(); }));
  REQUIRE(pool.try_execute([] {}).ok());  // the queue is now full

  event_log events;
  keel::deadline_timer hedger_timer{clock};
  keel::hedge hedger({.delay = 100ms}, pool, hedger_timer);
  auto pipe = keel::pipeline(hedger).in(keel::environment{clock}.with_listener(recorder{&events}));
  provider_t primary(clock, {kt::answer(1, 300ms)}, sleep_mode);
  provider_t backup(clock, {kt::answer(2, 10ms)}, sleep_mode);
  keel::call call(clock.now(), {.timeout = 1s});
  async_call<absl::StatusOr<int>> run([&] { return pipe.run(call, keel::alternates(std::ref(primary), std::ref(backup))); });
  clock.await_sleepers(2);
  clock.advance(100ms);
  REQUIRE(eventually([&] { return hedger.figures().skipped_executor == 1; }));
  clock.advance(200ms);
  CHECK(run.get().value() == 1);
  CHECK(backup.calls() == 0);
  CHECK(call.record().attempts == 1);
  CHECK(hedger.figures().hedges_started == 0);
  CHECK(events.snapshot() == std::vector<std::string>{"skipped executor"});
  {
    std::lock_guard lock(hold_mu);
    release = true;
  }
  hold_cv.notify_all();
}

TEST_CASE("a refused hedge is not the answer: the primary's own failure is, and no hedge counts as started",
          "[hedge][executor]") {
  manual_clock clock;
  // Declared before the pool: the pool (destroyed first) joins the task that uses them.
  std::mutex hold_mu;
  std::condition_variable hold_cv;
  bool release = false;
  std::atomic<bool> busy{false};
  keel::bounded_pool pool({.threads = 1, .queue_capacity = 1});
  REQUIRE(pool.try_execute([&] {
                busy = true;
                std::unique_lock lock(hold_mu);
                hold_cv.wait(lock, [&] { return release; });
              }).ok());
  REQUIRE(eventually([&] { return busy.load(); }));
  REQUIRE(pool.try_execute([] {}).ok());  // the queue is now full: the primary runs on the caller's thread

  event_log events;
  keel::deadline_timer hedger_timer{clock};
  keel::hedge hedger({.delay = 100ms}, pool, hedger_timer);
  auto pipe = keel::pipeline(hedger).in(keel::environment{clock}.with_listener(recorder{&events}));
  // Fails fast and retryably with nothing else running: the hedge is due at
  // once, and the executor refuses it.
  provider_t primary(clock, {kt::unavailable(10ms)}, sleep_mode);
  provider_t backup(clock, {kt::answer(2, 10ms)}, sleep_mode);
  keel::call call(clock.now(), {.timeout = 1s});
  async_call<absl::StatusOr<int>> run([&] { return pipe.run(call, keel::alternates(std::ref(primary), std::ref(backup))); });
  clock.await_sleepers(2);
  clock.advance(10ms);
  const absl::StatusOr<int> r = run.get();
  CHECK(r.status().code() == absl::StatusCode::kUnavailable);  // the provider's failure, not the executor's
  CHECK(backup.calls() == 0);
  CHECK(call.record().attempts == 1);
  const keel::hedge_figures f = hedger.figures();
  CHECK(f.hedges_started == 0);
  CHECK(f.skipped_executor == 1);
  CHECK(events.snapshot() == std::vector<std::string>{"skipped executor"});  // never "started"
  {
    std::lock_guard lock(hold_mu);
    release = true;
  }
  hold_cv.notify_all();
}

TEST_CASE("when the primary answers first, the hedged path allocates nothing", "[hedge][alloc]") {
  if (!keel_test::allocations_counted()) {
    WARN("allocation counting is off in sanitizer builds; the g++ build asserts it");
    return;
  }
  keel::bounded_pool pool({.threads = 1, .queue_capacity = 4});
  keel::retry_budget budget({.ratio = 0.1});
  keel::hedge hedger({.delay = 10s, .budget = &budget}, pool);
  auto pipe = keel::pipeline(keel::time_limit({.at_most = 20s}), hedger);
  auto provider = [](const keel::attempt& a) -> absl::StatusOr<int> { return a.number; };
  for (int i = 0; i < 3; ++i) {  // warm: the thread's spare stop source
    keel::call warm(keel::real_clock{}.now(), {.timeout = 30s});
    REQUIRE(pipe.run(warm, provider).ok());
  }
  keel_test::count_allocations allocations;
  for (int i = 0; i < 1000; ++i) {
    keel::call call(keel::real_clock{}.now(), {.timeout = 30s});
    const absl::StatusOr<int> r = pipe.run(call, provider);
    if (!r.ok()) FAIL("hedged call failed");
  }
  CHECK(allocations.count() == 0);
}

namespace {
struct stress_seen {
  std::atomic<unsigned> answered{0};  // bit k: attempt k returned its answer
  std::atomic<bool> primary_invoked{false};
  std::atomic<bool> primary_stopped{false};
};
}  // namespace

TEST_CASE("hedged calls race correctly under contention", "[hedge][stress]") {
  // Sized for every attempt of every call at once (4 callers, a primary and
  // two hedges each): a primary stalled on a thread must not keep the hedge
  // that would beat it waiting in the queue.
  keel::bounded_pool pool({.threads = 12, .queue_capacity = 256});
  keel::retry_budget budget({.ratio = 1.0, .min_per_second = 1e6});
  const bool on_caller = GENERATE(false, true);
  CAPTURE(on_caller);
  keel::hedge hedger({.delay = 1ms, .max_hedges = 2, .budget = &budget, .primary_on_caller_thread = on_caller}, pool);
  auto pipe = keel::pipeline(hedger);
  std::atomic<int> invocations{0};
  constexpr int threads = 4;
  constexpr int per_thread = 60;
  // Every answer names its call and its attempt: call * 4 + attempt.hedge.
  constexpr int attempt_slots = 4;
  std::vector<int> ok(threads, 0);
  std::vector<int> hedge_wins(threads, 0);
  std::vector<int> attempts(threads, 0);
  std::vector<std::vector<std::string>> wrong(threads);
  std::vector<std::vector<std::shared_ptr<stress_seen>>> stalled(threads);
  {
    std::vector<std::thread> callers;
    for (int t = 0; t < threads; ++t) {
      callers.emplace_back([&, t] {
        const auto ti = static_cast<std::size_t>(t);
        std::minstd_rand rng(static_cast<unsigned>(t + 1));
        for (int i = 0; i < per_thread; ++i) {
          const int id = t * per_thread + i;
          keel::call call(keel::real_clock{}.now(), {.timeout = 5s});
          // One call in four has a primary that never answers on its own (it
          // waits for its stop token): a hedge must win those. The others
          // take up to 3 ms, so either side may win.
          const bool primary_stalls = rng() % 4 == 0;
          const int latency_us = static_cast<int>(rng() % 3000);
          // A loser may outlive this iteration: what it writes is shared, the rest copied.
          auto state = std::make_shared<stress_seen>();
          std::atomic<unsigned>& answered = state->answered;
          if (primary_stalls) stalled[ti].push_back(state);
          const absl::StatusOr<int> r = pipe.run(call, [&invocations, state, id, primary_stalls, latency_us](
                                                           const keel::attempt& a) -> absl::StatusOr<int> {
            ++invocations;
            if (a.hedge == 0) state->primary_invoked = true;
            // Hedges answer fast; the primary may be slow, or stall until its deadline.
            const keel::time_point now = keel::real_clock{}.now();
            const keel::time_point until = a.hedge > 0      ? now + std::chrono::microseconds(200)
                                           : primary_stalls ? a.deadline.when()
                                                            : now + std::chrono::microseconds(latency_us);
            if (!keel::real_clock{}.sleep_until(until, a.stop)) {
              if (a.hedge == 0) state->primary_stopped = true;
              return absl::CancelledError("lost the race");
            }
            if (a.hedge == 0 && primary_stalls) return absl::DeadlineExceededError("stalled primary ran out");
            state->answered.fetch_or(1u << a.hedge);
            return id * attempt_slots + a.hedge;
          });
          attempts[ti] += call.record().attempts;
          if (!r.ok()) {
            wrong[ti].push_back(absl::StrCat("call ", id, ": ", r.status().ToString()));
            continue;
          }
          ++ok[ti];
          const int winner = *r % attempt_slots;
          if (*r / attempt_slots != id) wrong[ti].push_back(absl::StrCat("call ", id, ": another call's answer ", *r));
          if (((answered.load() >> winner) & 1u) == 0)
            wrong[ti].push_back(absl::StrCat("call ", id, ": attempt ", winner, " won but never answered"));
          if (primary_stalls && winner == 0)
            wrong[ti].push_back(absl::StrCat("call ", id, ": the stalled primary was not beaten and stopped"));
          if (winner > 0) ++hedge_wins[ti];
        }
      });
    }
    for (std::thread& c : callers) c.join();
  }
  REQUIRE(losers_returned(hedger));
  for (const auto& per_thread_stalled : stalled) {
    // Beaten, then stopped (unless the race was decided before it began).
    for (const auto& st : per_thread_stalled) CHECK(st->primary_stopped.load() == st->primary_invoked.load());
  }
  int total_ok = 0;
  int total_hedge_wins = 0;
  int total_attempts = 0;
  for (int t = 0; t < threads; ++t) {
    const auto ti = static_cast<std::size_t>(t);
    total_ok += ok[ti];
    total_hedge_wins += hedge_wins[ti];
    total_attempts += attempts[ti];
    for (const std::string& w : wrong[ti]) FAIL_CHECK(w);
  }
  const keel::hedge_figures f = hedger.figures();
  CHECK(total_ok == threads * per_thread);
  CHECK(f.hedge_wins == total_hedge_wins);  // the figures agree with the answers callers got
  CHECK(total_hedge_wins > 0);              // at least the stalled primaries lost
  CHECK(f.calls == threads * per_thread);
  CHECK(f.outstanding == 0);
  CHECK(f.hedges_started > 0);
  CHECK(f.hedges_started <= 2 * threads * per_thread);
  // Every provider invocation up to the answer was counted on its call (a
  // loser that begins after the race is decided is not); a hedge cancelled
  // before it began never reached the provider.
  CHECK(invocations >= total_attempts);
  CHECK(total_attempts >= threads * per_thread);
  CHECK(invocations >= threads * per_thread);
  CHECK(invocations <= threads * per_thread + f.hedges_started);
  CHECK(f.cancelled_losers <= f.hedges_started);
}

TEST_CASE("invalid hedge options are refused naming the field", "[hedge][options]") {
  CHECK(keel::hedge_options{.max_hedges = 8}.validate().message() == "hedge_options.max_hedges must be in [0, 7] (got 8)");
  CHECK(keel::hedge_options{.percentile = 1.0}.validate().message() ==
        "hedge_options.percentile must be 0 (fixed delay) or in (0, 1) (got 1)");
  CHECK(keel::hedge_options{.delay = -1ms}.validate().message() == "hedge_options.delay must be >= 0 (got -1ms)");
  CHECK(keel::hedge_options{.percentile = 0.5, .samples = 8}.validate().message() ==
        "hedge_options.samples must be in [16, 65536] (got 8)");
  keel::bounded_pool pool({.threads = 1});
  CHECK_THROWS_AS(keel::hedge(keel::hedge_options{.max_hedges = -1}, pool), keel::invalid_options);
}

TEST_CASE("a hedge whose timer runs on another clock than its pipeline refuses the call before any attempt",
          "[hedge]") {
  manual_clock clock;
  keel::bounded_pool pool({.threads = 2, .queue_capacity = 8});
  keel::hedge hedger({.delay = 100ms}, pool);  // keel::process_timer(): the real clock
  const auto pipe = keel::pipeline(hedger).in(keel::environment{clock});
  keel::call call(clock.now(), {.timeout = 1s});
  std::atomic<int> invoked{0};
  const absl::StatusOr<int> r = pipe.run(call, [&invoked](const keel::attempt&) -> absl::StatusOr<int> {
    ++invoked;
    return 1;
  });
  CHECK(r.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(absl::StrContains(r.status().message(), "another clock"));
  CHECK(keel::marked_outcome(r.status()) == keel::outcome_kind::permanent);
  CHECK(invoked.load() == 0);
}

TEST_CASE("a hedged pipeline run inside a provider on the same call takes over that provider's attempt",
          "[hedge][attempts]") {
  manual_clock clock;
  keel::bounded_pool pool({.threads = 2, .queue_capacity = 8});
  keel::deadline_timer timer{clock};
  keel::hedge hedger({.delay = 1s, .max_hedges = 1}, pool, timer);
  const auto sdk = keel::pipeline(hedger).in(keel::environment{clock});   // the SDK's own layer
  const auto app = keel::pipeline().in(keel::environment{clock});          // the application's layer around it
  // One downstream call allowed: three layers must not make it two.
  keel::call call(clock.now(), {.timeout = 10s, .max_attempts = 1});
  std::atomic<int> downstream{0};
  const absl::StatusOr<int> r = app.run(call, [&](const keel::attempt&) -> absl::StatusOr<int> {
    return sdk.run(call, [&downstream](const keel::attempt& a) -> absl::StatusOr<int> {
      downstream.fetch_add(1);
      return a.number;
    });
  });
  REQUIRE(r.ok());  // before: refused, "attempt cap of 1 reached for this call"
  CHECK(*r == 1);   // the application's attempt number, taken over
  CHECK(downstream.load() == 1);
  CHECK(call.record().attempts == 1);
  REQUIRE(losers_returned(hedger));
}

TEST_CASE("a hedge's destructor waits for a loser still running, and returns once it lets go", "[hedge][concurrency]") {
  // The primary ignores its stop token and holds until released; the hedge
  // answers at once and wins. The call returns with the loser still out.
  struct gate {
    std::mutex mu;
    std::condition_variable cv;
    bool open = false;
  };
  auto g = std::make_shared<gate>();
  auto provider = [g](const keel::attempt& a) -> absl::StatusOr<int> {
    if (a.hedge > 0) return 7;
    std::unique_lock lock(g->mu);
    g->cv.wait(lock, [&] { return g->open; });
    return 1;
  };
  keel::deadline_timer timer;
  keel::bounded_pool pool({.threads = 2});
  auto hedger = std::make_unique<keel::hedge<keel::bounded_pool>>(
      keel::hedge_options{.delay = 1ms, .max_hedges = 1}, pool, timer);
  {
    auto pipe = keel::pipeline(*hedger);
    keel::call call(keel::real_clock{}.now(), {.timeout = 10s});
    absl::StatusOr<int> r = pipe.run(call, provider);
    REQUIRE(r.ok());
    CHECK(*r == 7);
  }
  REQUIRE(hedger->figures().outstanding == 1);
  std::atomic<bool> destroyed{false};
  std::thread destroyer([&] {
    hedger.reset();
    destroyed = true;
  });
  CHECK_FALSE(eventually([&] { return destroyed.load(); }, 50ms));  // the loser still holds its race
  {
    std::lock_guard lock(g->mu);
    g->open = true;
  }
  g->cv.notify_all();
  destroyer.join();
  CHECK(destroyed.load());
}
