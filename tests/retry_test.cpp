// keel::retry, the backoff strategies and the retry budget.
#include "keel/policy/retry.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "keel/compose/executor.hpp"
#include "keel/compose/hedge.hpp"
#include "keel/compose/pipeline.hpp"
#include "keel/core/call.hpp"
#include "keel/core/internal/thread_slot.hpp"
#include "keel/policy/backoff.hpp"
#include "keel/policy/retry_budget.hpp"
#include "keel/testing/manual_clock.hpp"
#include "keel/testing/scripted_provider.hpp"
#include "keel/testing/seeded_random.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;
using keel::testing::manual_clock;
using keel::testing::scripted_provider;
namespace kt = keel::testing;

namespace {
bool contains(absl::string_view haystack, absl::string_view needle) {
  return haystack.find(needle) != absl::string_view::npos;
}
keel::duration ms(long long n) { return std::chrono::duration_cast<keel::duration>(std::chrono::milliseconds(n)); }
}  // namespace

TEST_CASE("full jitter draws from [0, min(cap, base * 2^k)]: the seed's ranges", "[backoff][seed]") {
  keel::testing::seeded_random rng(1);
  const keel::full_jitter b{.base = 100ms, .cap = 1000ms};
  const keel::duration bounds[] = {ms(100), ms(200), ms(400), ms(800), ms(1000), ms(1000)};
  for (int k = 0; k < 6; ++k) {
    keel::duration lo = keel::duration::max(), hi = keel::duration::zero();
    for (int i = 0; i < 2000; ++i) {
      const keel::duration d = b.delay(k, {}, rng);
      lo = std::min(lo, d);
      hi = std::max(hi, d);
    }
    INFO("k = " << k);
    CHECK(lo >= keel::duration::zero());
    CHECK(hi <= bounds[k]);
    CHECK(lo < bounds[k] / 20);      // the whole range is used,
    CHECK(hi > bounds[k] * 19 / 20);  // from near zero to near the bound
  }
  CHECK(b.delay(1000, {}, rng) <= ms(1000));  // no overflow for large k
}

TEST_CASE("equal, decorrelated and constant backoff stay in their ranges", "[backoff]") {
  keel::testing::seeded_random rng(2);
  const keel::equal_jitter eq{.base = 100ms, .cap = 1s};
  const keel::decorrelated_jitter de{.base = 100ms, .cap = 1s};
  keel::duration previous = keel::duration::zero();
  for (int k = 0; k < 12; ++k) {
    const keel::duration v = std::min(ms(1000), ms(100 * (1LL << k)));
    const keel::duration e = eq.delay(k, {}, rng);
    CHECK(e >= v / 2);
    CHECK(e <= v);
    const keel::duration d = de.delay(k, previous, rng);
    CHECK(d >= ms(100));
    CHECK(d <= std::min(ms(1000), std::max(previous, ms(100)) * 3));
    previous = d;
  }
  CHECK(keel::constant_backoff{.delay_each = 250ms}.delay(7, {}, rng) == ms(250));
}

TEST_CASE("the same seed gives the same jitter", "[backoff]") {
  keel::testing::seeded_random a(99), b(99);
  const keel::full_jitter j{};
  for (int k = 0; k < 10; ++k) REQUIRE(j.delay(k, {}, a) == j.delay(k, {}, b));
}

TEST_CASE("transient failures are retried until an answer", "[retry]") {
  manual_clock clock;
  clock.auto_advance(true);
  scripted_provider<int> provider(clock, {kt::unavailable(30ms), kt::unavailable(30ms), kt::answer(42, 80ms)});
  auto pipe = keel::pipeline(keel::retry({.max_attempts = 3}, keel::full_jitter{.base = 100ms, .cap = 1s},
                                         kt::seeded_random(3)))
                  .in(keel::environment{clock});
  keel::call call(clock.now(), {.timeout = 10s});
  absl::StatusOr<int> r = pipe.run(call, provider);
  REQUIRE(r.ok());
  CHECK(*r == 42);
  CHECK(provider.calls() == 3);
  CHECK(call.record().attempts == 3);
  CHECK(call.record().retries == 2);
  // Each wait is inside its full-jitter range: 0-100 ms, then 0-200 ms.
  const auto seen = provider.attempts();
  CHECK(seen[1].start - seen[0].start - ms(30) <= ms(100));
  CHECK(seen[2].start - seen[1].start - ms(30) <= ms(200));
  CHECK(seen[0].number == 1);
  CHECK(seen[2].number == 3);
}

TEST_CASE("a provider's retry-after hint is honoured exactly", "[retry][seed]") {
  manual_clock clock;
  clock.auto_advance(true);
  scripted_provider<int> provider(clock, {kt::rate_limited(2s, 10ms), kt::answer(7, 50ms)});
  auto pipe = keel::pipeline(keel::retry({.max_attempts = 3})).in(keel::environment{clock});
  keel::call call(clock.now(), {.timeout = 10s});
  REQUIRE(pipe.run(call, provider).value() == 7);
  const auto seen = provider.attempts();
  REQUIRE(seen.size() == 2);
  CHECK(seen[1].start - seen[0].start == ms(10) + ms(2000));
}

TEST_CASE("a hint longer than max_retry_after ends the retries", "[retry]") {
  manual_clock clock;
  clock.auto_advance(true);
  scripted_provider<int> provider(clock, {kt::rate_limited(2min), kt::answer(7)});
  auto pipe = keel::pipeline(keel::retry({.max_attempts = 3, .max_retry_after = 30s})).in(keel::environment{clock});
  keel::call call(clock.now(), {.timeout = 1h});
  absl::StatusOr<int> r = pipe.run(call, provider);
  REQUIRE(r.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK(contains(r.status().message(), "max_retry_after"));
  CHECK(keel::retry_after(r.status()).has_value());  // the hint still reaches the caller
  CHECK(provider.calls() == 1);
}

TEST_CASE("a keel refusal ends the retries by default; waited out, only after its own hint", "[retry]") {
  manual_clock clock;
  clock.auto_advance(true);
  // By default a refusal from inside (an open breaker) is not retried: the
  // caller hears its retry-after, and a fallback outside serves at once.
  int breaker_calls = 0;
  auto open_breaker = [&]() -> absl::Status {
    ++breaker_calls;
    return keel::refusal(absl::UnavailableError("keel: circuit breaker 'llm' is open"), "breaker:llm", 300ms);
  };
  keel::call first(clock.now(), {.timeout = 10s});
  const absl::Status refused = keel::pipeline(keel::retry({.max_attempts = 3})).in(keel::environment{clock}).run(first, open_breaker);
  CHECK(keel::retry_after(refused) == ms(300));
  CHECK(breaker_calls == 1);

  // wait_out_refusals: a full bulkhead further in said when a slot is
  // expected: waited exactly, even with provider hints turned off.
  int calls = 0;
  std::vector<keel::time_point> starts;
  auto hinted = [&](const keel::attempt& a) -> absl::StatusOr<int> {
    starts.push_back(a.start);
    if (++calls == 1)
      return keel::refusal(absl::ResourceExhaustedError("bulkhead full"), "bulkhead:batch", 300ms);
    return 7;
  };
  auto pipe = keel::pipeline(keel::retry({.max_attempts = 3, .honour_retry_after = false, .wait_out_refusals = true}))
                  .in(keel::environment{clock});
  keel::call call(clock.now(), {.timeout = 10s});
  REQUIRE(pipe.run(call, hinted).value() == 7);
  REQUIRE(starts.size() == 2);
  CHECK(starts[1] - starts[0] == ms(300));

  // No hint: keel declined and said nothing of coming back (the attempt
  // cap, no time left): not hammered. Before refusals had their own kind,
  // this full bulkhead (ResourceExhausted) was "throttled" and retried.
  int plain_calls = 0;
  auto unhinted = [&]() -> absl::Status {
    ++plain_calls;
    return keel::with_refused_by(keel::mark_not_started(absl::ResourceExhaustedError("bulkhead full")),
                                 "bulkhead:batch");
  };
  keel::call second(clock.now(), {.timeout = 10s});
  const absl::Status r = pipe.run(second, unhinted);
  CHECK(keel::refused_by(r) == "bulkhead:batch");
  CHECK(plain_calls == 1);

  // The caller's cancellation reported by the provider is never retried.
  int cancelled_calls = 0;
  keel::call third(clock.now(), {.timeout = 10s});
  CHECK(pipe.run(third, [&]() -> absl::Status {
              ++cancelled_calls;
              return absl::CancelledError("client went away");
            }).code() == absl::StatusCode::kCancelled);
  CHECK(cancelled_calls == 1);
}

TEST_CASE("permanent failures are never retried", "[retry]") {
  manual_clock clock;
  clock.auto_advance(true);
  for (kt::failure f : {kt::bad_credential(), kt::unsupported_model()}) {
    scripted_provider<int> provider(clock, {f, kt::answer(1)});
    auto pipe = keel::pipeline(keel::retry({.max_attempts = 5})).in(keel::environment{clock});
    keel::call call(clock.now(), {.timeout = 10s, .max_attempts = 5});
    CHECK_FALSE(pipe.run(call, provider).ok());
    CHECK(provider.calls() == 1);
  }
}

TEST_CASE("an ambiguous write is not retried unless it is idempotent", "[retry]") {
  manual_clock clock;
  clock.auto_advance(true);
  auto pipe = keel::pipeline(keel::retry({.max_attempts = 3})).in(keel::environment{clock});

  SECTION("lost connection after sending a write") {
    scripted_provider<int> provider(clock, {kt::lost_write(), kt::answer(1)});
    keel::call call(clock.now(), {.timeout = 10s, .operation = {.effect = keel::effect::write}});
    const absl::StatusOr<int> r = pipe.run(call, provider);
    CHECK(r.status().code() == absl::StatusCode::kUnknown);
    CHECK(provider.calls() == 1);
  }
  SECTION("a write that timed out") {
    scripted_provider<int> provider(clock, {kt::stall(), kt::answer(1)});
    keel::call call(clock.now(), {.timeout = 10s, .operation = {.effect = keel::effect::write}});
    CHECK(pipe.run(call, provider).status().code() == absl::StatusCode::kDeadlineExceeded);
    CHECK(provider.calls() == 1);
  }
  SECTION("the same write carrying an idempotency identity") {
    scripted_provider<int> provider(clock, {kt::lost_write(), kt::answer(1)});
    keel::call call(clock.now(),
                    {.timeout = 10s, .operation = {.effect = keel::effect::write, .idempotent = true}});
    CHECK(pipe.run(call, provider).value() == 1);
    CHECK(provider.calls() == 2);
  }
  SECTION("a read that timed out is retried") {
    scripted_provider<int> provider(clock, {kt::fail(absl::DeadlineExceededError("read timed out")), kt::answer(1)});
    keel::call call(clock.now(), {.timeout = 10s});
    CHECK(pipe.run(call, provider).value() == 1);
    CHECK(provider.calls() == 2);
  }
}

TEST_CASE("a retry that cannot finish in time is not started", "[retry]") {
  manual_clock clock;
  clock.auto_advance(true);
  const keel::time_point t0 = clock.now();
  scripted_provider<int> provider(clock, {kt::unavailable(100ms), kt::answer(1)});
  auto pipe = keel::pipeline(keel::retry({.max_attempts = 3, .min_attempt_time = 300ms},
                                         keel::constant_backoff{.delay_each = 800ms}))
                  .in(keel::environment{clock});
  keel::call call(t0, {.timeout = 1s});
  const absl::StatusOr<int> r = pipe.run(call, provider);
  REQUIRE(r.status().code() == absl::StatusCode::kUnavailable);  // the real failure, explained
  CHECK(contains(r.status().message(), "retry not started"));
  CHECK(provider.calls() == 1);
  CHECK(clock.now() - t0 == ms(100));  // it did not sleep the 800 ms it could not use
}

TEST_CASE("waits are clipped to the deadline, never past it", "[retry]") {
  manual_clock clock;
  clock.auto_advance(true);
  const keel::time_point t0 = clock.now();
  scripted_provider<int> provider(clock, {kt::unavailable(50ms)});
  auto pipe = keel::pipeline(keel::retry({.max_attempts = 50}, keel::full_jitter{.base = 100ms, .cap = 400ms},
                                         kt::seeded_random(5)))
                  .in(keel::environment{clock});
  keel::call call(t0, {.timeout = 2s, .response_reserve = 200ms, .max_attempts = 50});
  CHECK_FALSE(pipe.run(call, provider).ok());
  CHECK(clock.now() <= call.work_deadline().when());
  for (const keel::attempt& a : provider.attempts()) CHECK(a.deadline <= call.work_deadline());
  CHECK(provider.calls() > 3);
}

TEST_CASE("nested retry layers share the call's attempt cap: 3 x 3 stays 3", "[retry][seed]") {
  manual_clock clock;
  clock.auto_advance(true);
  scripted_provider<int> downstream(clock, {kt::unavailable(10ms)});
  const keel::retry three({.max_attempts = 3}, keel::constant_backoff{.delay_each = 10ms});
  auto sdk = keel::pipeline(three).in(keel::environment{clock});
  auto application = keel::pipeline(three).in(keel::environment{clock});

  keel::call call(clock.now(), {.timeout = 1min, .max_attempts = 3});
  // The application retries a step that itself uses an SDK with retries.
  const absl::StatusOr<int> r =
      application.run(call, [&](const keel::attempt&) { return sdk.run(call, downstream); });
  CHECK_FALSE(r.ok());
  // The application's attempt is handed to the SDK's first attempt, so the
  // cap counts downstream calls: three, not nine and not fewer than three.
  CHECK(downstream.calls() == 3);
  CHECK(call.record().attempts == 3);

  // Without the shared cap the same layers would make nine calls.
  scripted_provider<int> uncapped(clock, {kt::unavailable(10ms)});
  keel::call roomy(clock.now(), {.timeout = 1min, .max_attempts = 100});
  (void)application.run(roomy, [&](const keel::attempt&) {
    keel::call inner(clock.now(), {.timeout = 1min, .max_attempts = 100});
    return sdk.run(inner, uncapped);
  });
  CHECK(uncapped.calls() == 9);
}

TEST_CASE("two retry layers in one pipeline share the cap", "[retry]") {
  manual_clock clock;
  clock.auto_advance(true);
  scripted_provider<int> provider(clock, {kt::unavailable(10ms)});
  auto pipe = keel::pipeline(keel::retry({.max_attempts = 3}, keel::constant_backoff{.delay_each = 1ms}),
                             keel::retry({.max_attempts = 3}, keel::constant_backoff{.delay_each = 1ms}))
                  .in(keel::environment{clock});
  keel::call call(clock.now(), {.timeout = 1min, .max_attempts = 3});
  const absl::StatusOr<int> r = pipe.run(call, provider);
  CHECK(provider.calls() == 3);
  CHECK(r.status().code() == absl::StatusCode::kUnavailable);
}

TEST_CASE("a spent retry budget stops retries and says so", "[retry][budget]") {
  manual_clock clock;
  clock.auto_advance(true);
  keel::retry_budget budget({.ratio = 0.0, .min_per_second = 0.0});
  scripted_provider<int> provider(clock, {kt::unavailable(10ms), kt::answer(1)});
  auto pipe = keel::pipeline(keel::retry({.max_attempts = 3, .budget = &budget})).in(keel::environment{clock});
  keel::call call(clock.now(), {.timeout = 10s});
  const absl::StatusOr<int> r = pipe.run(call, provider);
  REQUIRE(r.status().code() == absl::StatusCode::kUnavailable);
  CHECK(contains(r.status().message(), "retry budget exhausted"));
  CHECK(keel::refused_by(r.status()) == "retry_budget");
  CHECK(provider.calls() == 1);
  CHECK(budget.figures(clock.now()).requests == 1);
}

TEST_CASE("the retry budget allows ratio x requests plus the floor, over its window", "[budget]") {
  manual_clock clock;
  keel::retry_budget budget({.ratio = 0.5, .min_per_second = 0.2, .window = 10s});  // floor: one per 5 s
  for (int i = 0; i < 10; ++i) budget.record_request(clock.now());
  int granted = 0;
  while (budget.try_acquire_retry(clock.now())) ++granted;
  CHECK(granted == 5 + 1);
  CHECK(budget.figures(clock.now()).retries == 6);
  CHECK(budget.figures(clock.now()).allowed == 6);

  // A window later the old requests and retries have aged out: only the floor remains.
  clock.advance(11s);
  CHECK(budget.figures(clock.now()).requests == 0);
  CHECK(budget.figures(clock.now()).allowed == 1);
  granted = 0;
  while (budget.try_acquire_retry(clock.now())) ++granted;
  CHECK(granted == 1);
}

TEST_CASE("the retry budget's floor accrues as a rate: min_per_second, not min x window in one burst", "[budget]") {
  manual_clock clock;
  keel::retry_budget budget({.ratio = 0.0, .min_per_second = 5, .window = 10s});
  auto drain = [&] {
    int n = 0;
    while (n < 1000 && budget.try_acquire_retry(clock.now())) ++n;
    return n;
  };
  // A quiet service holds one second's worth (5), not the window's (50).
  CHECK(budget.figures(clock.now()).allowed == 5);
  CHECK(drain() == 5);
  // Then it earns one every 200 ms.
  clock.advance(199ms);
  CHECK(drain() == 0);
  clock.advance(1ms);
  CHECK(drain() == 1);
  clock.advance(1s);
  CHECK(drain() == 5);
  // A long quiet spell still holds one second's worth.
  clock.advance(1h);
  CHECK(drain() == 5);
  // Over the window: at most the burst plus the rate.
  int total = 0;
  for (int i = 0; i < 100; ++i) {
    clock.advance(100ms);
    total += drain();
  }
  CHECK(total == 50);  // ten seconds at 5 per second
}

TEST_CASE("a fractional floor still grants one retry, then one per 1 / min_per_second", "[budget]") {
  manual_clock clock;
  keel::retry_budget budget({.ratio = 0.0, .min_per_second = 0.5, .window = 10s});
  CHECK(budget.try_acquire_retry(clock.now()));
  CHECK_FALSE(budget.try_acquire_retry(clock.now()));
  clock.advance(1999ms);
  CHECK_FALSE(budget.try_acquire_retry(clock.now()));
  clock.advance(1ms);
  CHECK(budget.try_acquire_retry(clock.now()));
}

TEST_CASE("a call deposits one request into a budget, however many retry layers share it", "[budget][retry]") {
  manual_clock clock;
  clock.auto_advance(true);
  keel::retry_budget budget({.ratio = 1.0, .min_per_second = 0.0});
  const keel::retry two({.max_attempts = 2, .budget = &budget}, keel::constant_backoff{.delay_each = 1ms});
  scripted_provider<int> provider(clock, {kt::unavailable(10ms)});

  SECTION("nested layers in one pipeline") {
    auto pipe = keel::pipeline(two, two).in(keel::environment{clock});
    keel::call call(clock.now(), {.timeout = 1min, .max_attempts = 4});
    CHECK_FALSE(pipe.run(call, provider).ok());
    CHECK(provider.calls() == 2);  // ratio 1, one request: the one retry the deposit bought
    CHECK(budget.figures(clock.now()).requests == 1);
  }
  SECTION("an application pipeline around an SDK pipeline, one call") {
    auto sdk = keel::pipeline(two).in(keel::environment{clock});
    auto application = keel::pipeline(two).in(keel::environment{clock});
    keel::call call(clock.now(), {.timeout = 1min, .max_attempts = 4});
    CHECK_FALSE(application.run(call, [&](const keel::attempt&) { return sdk.run(call, provider); }).ok());
    CHECK(budget.figures(clock.now()).requests == 1);
  }
  SECTION("each call deposits once; another budget gets its own deposit") {
    keel::retry_budget other({.ratio = 1.0, .min_per_second = 0.0});
    auto pipe = keel::pipeline(two, keel::retry({.max_attempts = 2, .budget = &other})).in(keel::environment{clock});
    for (int i = 0; i < 3; ++i) {
      keel::call call(clock.now(), {.timeout = 1min, .max_attempts = 4});
      (void)pipe.run(call, provider);
    }
    CHECK(budget.figures(clock.now()).requests == 3);
    CHECK(other.figures(clock.now()).requests == 3);
  }
  SECTION("record_request(call, now) says whether it deposited") {
    keel::call call(clock.now(), {.timeout = 1min});
    CHECK(budget.record_request(call, clock.now()));
    CHECK_FALSE(budget.record_request(call, clock.now()));
    CHECK(budget.figures(clock.now()).requests == 1);
  }
}

TEST_CASE("a hedge and a retry sharing a budget deposit once per call, deposit_requests left on", "[budget][hedge]") {
  keel::retry_budget budget({.ratio = 0.1});
  keel::bounded_pool pool({.threads = 1, .queue_capacity = 4});
  keel::hedge hedger({.delay = 10min, .budget = &budget}, pool);  // never due: the answer is instant
  const keel::retry retrier({.max_attempts = 2, .budget = &budget});
  auto answer = [](const keel::attempt&) -> absl::StatusOr<int> { return 7; };
  auto hedge_outside = keel::pipeline(hedger, retrier);
  auto retry_outside = keel::pipeline(retrier, hedger);
  for (int i = 0; i < 3; ++i) {
    keel::call a(keel::real_clock{}.now(), {.timeout = 1min});
    REQUIRE(hedge_outside.run(a, answer).value() == 7);
    keel::call b(keel::real_clock{}.now(), {.timeout = 1min});
    REQUIRE(retry_outside.run(b, answer).value() == 7);
  }
  CHECK(budget.figures(keel::real_clock{}.now()).requests == 6);
}

TEST_CASE("the retry budget never over-admits under contention", "[budget][concurrency]") {
  keel::retry_budget budget({.ratio = 0.1, .min_per_second = 0.0, .window = 10s});
  const keel::time_point now{std::chrono::hours(5)};
  for (int i = 0; i < 1000; ++i) budget.record_request(now);  // allows exactly 100 retries
  constexpr int kThreads = 4;
  std::vector<int> granted(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 5000; ++i) granted[t] += budget.try_acquire_retry(now) ? 1 : 0;
    });
  }
  for (auto& th : threads) th.join();
  int total = 0;
  for (int g : granted) total += g;
  CHECK(total <= 100);
  CHECK(total >= 100 - kThreads);  // at most a last retry or two lost to a race, never more granted
  CHECK(budget.figures(now).retries == total);
}

TEST_CASE("cancellation while waiting to retry ends the call at once", "[retry][concurrency]") {
  manual_clock clock;
  scripted_provider<int> provider(clock, {kt::unavailable(), kt::answer(1)}, scripted_provider<int>::mode::sleep);
  auto pipe = keel::pipeline(keel::retry({.max_attempts = 3}, keel::constant_backoff{.delay_each = 5s})).in(keel::environment{clock});
  std::stop_source stop;
  absl::StatusOr<int> result = 0;
  std::thread caller([&] {
    keel::call call(clock.now(), {.timeout = 1min, .stop = stop.get_token()});
    result = pipe.run(call, provider);
  });
  clock.await_sleepers(1);  // parked in the 5 s backoff
  stop.request_stop();
  caller.join();
  CHECK(result.status().code() == absl::StatusCode::kUnavailable);
  CHECK(contains(result.status().message(), "cancelled while waiting to retry"));
  CHECK(provider.calls() == 1);
}

TEST_CASE("invalid retry options are refused with the field named", "[retry][options]") {
  auto message = [](auto make) -> std::string {
    try {
      make();
    } catch (const keel::invalid_options& e) {
      return std::string(e.status().message());
    }
    return "accepted";
  };
  CHECK(message([] { keel::retry r({.max_attempts = 0}); }) == "retry_options.max_attempts must be >= 1 (got 0)");
  CHECK(contains(message([] { keel::retry r({.max_retry_after = -1s}); }), "max_retry_after"));
  CHECK(contains(message([] { keel::retry r({.min_attempt_time = -1ms}); }), "min_attempt_time"));
  CHECK(message([] { keel::retry r({}, keel::full_jitter{.base = 2s, .cap = 1s}); }) ==
        "full_jitter.cap must be >= base (got 1s < 2s)");
  CHECK(contains(message([] { keel::retry r({}, keel::equal_jitter{.base = 0ms}); }), "equal_jitter.base"));
  CHECK(contains(message([] { keel::retry r({}, keel::constant_backoff{.delay_each = -1ms}); }), "delay_each"));
  CHECK(contains(message([] { keel::retry_budget b({.ratio = 1.5}); }), "retry_budget_options.ratio must be in [0, 1]"));
  CHECK(contains(message([] { keel::retry_budget b({.ratio = -0.1}); }), "ratio"));
  CHECK(contains(message([] { keel::retry_budget b({.min_per_second = -1}); }), "min_per_second"));
  CHECK(contains(message([] { keel::retry_budget b({.window = 1ms}); }), "window"));
  CHECK(message([] { keel::retry r({.max_attempts = 2}); }) == "accepted");
}

// Requests are counted in per-thread cells (keel/core/internal/thread_slot.hpp):
// more threads than there are cells, some alive at once and some after
// others have exited, all deposit, and the cells go back when threads end.
TEST_CASE("the retry budget counts the requests of more threads than it has cells", "[budget][concurrency]") {
  keel::retry_budget budget({.ratio = 1.0, .min_per_second = 0.0, .window = 10s});
  keel::testing::manual_clock clock;
  const int before = keel::detail::thread_slot_pool::taken();
  constexpr int kThreads = keel::detail::kThreadSlots + 16;
  constexpr int kEach = 500;
  std::atomic<int> started{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      started.fetch_add(1);
      while (!go.load()) std::this_thread::yield();
      for (int i = 0; i < kEach; ++i) budget.record_request(clock.now());
    });
  }
  while (started.load() < kThreads) std::this_thread::yield();
  go.store(true);
  for (auto& t : threads) t.join();
  threads.clear();
  // A second wave on slots the first gave back.
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kEach; ++i) budget.record_request(clock.now());
    });
  }
  for (auto& t : threads) t.join();
  CHECK(budget.figures(clock.now()).requests == std::int64_t{kThreads + 8} * kEach);
  CHECK(budget.figures(clock.now()).allowed == std::int64_t{kThreads + 8} * kEach);
  CHECK(keel::detail::thread_slot_pool::taken() <= before);  // threads of earlier tests may have ended since
  // And they age out with the window, as the shared count did.
  clock.advance(11s);
  CHECK(budget.figures(clock.now()).requests == 0);
}
