// keel::deadline_timer and keel::cut_at_deadline: a stop requested exactly at
// the deadline on the manual clock, never before and never after a disarm;
// a pipeline attempt that watches only its stop token cut at its deadline
// (manual clock exactly, real clock generously); arms and disarms from many
// threads while the timer fires; no allocation on the success path; an entry
// that runs again (a hedge, a stream's budgets), brought forward or cancelled.
#include "keel/compose/cut_at_deadline.hpp"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <stop_token>
#include <thread>
#include <vector>

#include "keel/compose/pipeline.hpp"
#include "keel/core/call.hpp"
#include "keel/policy/retry.hpp"
#include "keel/policy/time_limit.hpp"
#include "keel/testing/manual_clock.hpp"
#include "support/alloc_counter.hpp"
#include "support/async.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;
using keel::testing::manual_clock;
using keel_test::async_call;
using keel_test::eventually;

namespace {

// Waits for its stop token and nothing else: not its timeout, not a clock.
absl::StatusOr<int> wait_for_stop(const keel::attempt& a) {
  keel_test::block_until_stopped(a.stop);
  return absl::CancelledError("stopped");
}

}  // namespace

TEST_CASE("deadline timer: a stop is requested when the clock reaches the deadline, not before",
          "[deadline_timer]") {
  manual_clock clock;
  keel::deadline_timer timer(clock);
  clock.await_sleepers(0);  // idle: the thread is not a sleeper
  const keel::time_point t0 = clock.now();
  std::stop_source early_src, late_src;
  keel::deadline_cut early(timer, keel::deadline::at(t0 + 99ms), early_src);
  keel::deadline_cut late(timer, keel::deadline::at(t0 + 100ms), late_src);
  clock.await_sleepers(1);  // the timer thread waits for t0 + 99ms

  clock.advance(98ms);
  clock.advance(1ms);  // t0 + 99ms
  REQUIRE(eventually([&] { return early_src.stop_requested(); }));
  // The walk that fired `early` saw `late` not yet due; it sleeps again.
  clock.await_sleepers(1);
  CHECK_FALSE(late_src.stop_requested());
  CHECK(timer.figures().fired == 1);

  clock.advance(1ms);  // t0 + 100ms, exactly
  REQUIRE(eventually([&] { return late_src.stop_requested(); }));
  clock.await_sleepers(0);  // nothing armed: idle again
  CHECK(early.disarm());
  CHECK(late.disarm());
  CHECK(timer.figures().fired == 2);
}

TEST_CASE("deadline timer: a cut disarmed before its deadline never fires", "[deadline_timer]") {
  manual_clock clock;
  keel::deadline_timer timer(clock);
  std::stop_source src;
  {
    keel::deadline_cut cut(timer, keel::deadline::after(clock.now(), 50ms), src);
    clock.await_sleepers(1);
    CHECK_FALSE(cut.disarm());
  }
  clock.advance(1s);  // the thread wakes at the old time, finds nothing
  clock.await_sleepers(0);
  CHECK_FALSE(src.stop_requested());
  CHECK(timer.figures().fired == 0);
}

TEST_CASE("deadline timer: an earlier deadline wakes a thread sleeping until a later one", "[deadline_timer]") {
  manual_clock clock;
  keel::deadline_timer timer(clock);
  std::stop_source later_src, sooner_src;
  keel::deadline_cut later(timer, keel::deadline::after(clock.now(), 1s), later_src);
  clock.await_sleepers(1);
  const std::int64_t wakeups = timer.figures().wakeups;
  keel::deadline_cut sooner(timer, keel::deadline::after(clock.now(), 10ms), sooner_src);
  CHECK(timer.figures().wakeups == wakeups + 1);
  // Woken and re-parked until the sooner time (or, if it has not re-parked
  // yet, its next walk sees the clock past it): 10 ms fires it.
  clock.advance(10ms);
  REQUIRE(eventually([&] { return sooner_src.stop_requested(); }));
  clock.await_sleepers(1);
  CHECK_FALSE(later_src.stop_requested());

  // A later deadline than the one it sleeps until does not wake it.
  std::stop_source third_src;
  const std::int64_t before = timer.figures().wakeups;
  keel::deadline_cut third(timer, keel::deadline::after(clock.now(), 2s), third_src);
  CHECK(timer.figures().wakeups == before);
  CHECK_FALSE(later.disarm());
  CHECK_FALSE(third.disarm());
}

// An entry whose function asks to run `times` times, 100 ms apart.
struct repeating_entry : keel::detail::timer_entry {
  int times = 0;
  std::atomic<int> runs{0};
  std::vector<keel::time_point> at;  // the timer's thread writes; read after cancel()

  explicit repeating_entry(int n) : times(n) {
    fire = [](keel::detail::timer_entry& t, keel::time_point now) {
      auto& self = static_cast<repeating_entry&>(t);
      self.at.push_back(now);
      return self.runs.fetch_add(1) + 1 < self.times ? now + 100ms : keel::time_point::max();
    };
  }
};

TEST_CASE("deadline timer: an entry runs again while its function asks, and is brought forward, never back",
          "[deadline_timer]") {
  manual_clock clock;
  keel::deadline_timer timer(clock);
  repeating_entry e(3);
  const keel::time_point t0 = clock.now();
  timer.schedule(e, t0 + 1s);
  clock.await_sleepers(1);
  timer.bring_forward(e, t0 + 300ms);  // earlier: taken, and the sleeping thread woken for it
  timer.bring_forward(e, t0 + 2s);     // later: ignored
  clock.await_sleepers(1);
  clock.advance(299ms);
  clock.await_sleepers(1);
  CHECK(e.runs.load() == 0);
  clock.advance(1ms);
  REQUIRE(eventually([&] { return e.runs.load() == 1; }));
  for (int i = 2; i <= 3; ++i) {
    clock.await_sleepers(1);
    clock.advance(100ms);
    REQUIRE(eventually([&] { return e.runs.load() == i; }));
  }
  CHECK(timer.cancel(e));  // it ran, and is done
  CHECK(e.at == std::vector<keel::time_point>{t0 + 300ms, t0 + 400ms, t0 + 500ms});
  CHECK(timer.figures().fired == 3);
}

TEST_CASE("deadline timer: an entry cancelled between its runs never runs again", "[deadline_timer]") {
  manual_clock clock;
  keel::deadline_timer timer(clock);
  repeating_entry e(1000);
  timer.schedule(e, clock.now() + 100ms);
  clock.await_sleepers(1);
  clock.advance(100ms);
  REQUIRE(eventually([&] { return e.runs.load() == 1; }));
  clock.await_sleepers(1);  // armed again, for 100 ms on
  CHECK_FALSE(timer.cancel(e));  // armed, not done: unlinked
  clock.advance(1s);
  CHECK_FALSE(eventually([&] { return e.runs.load() > 1; }, 50ms));
  CHECK(timer.figures().fired == 1);
}

TEST_CASE("deadline timer: destroyed with cuts armed, it detaches them without firing", "[deadline_timer]") {
  manual_clock clock;
  std::stop_source src;
  keel::deadline_cut cut;
  {
    keel::deadline_timer timer(clock);
    cut.arm(timer, keel::deadline::after(clock.now(), 10ms), src);
    clock.await_sleepers(1);
    CHECK(cut.armed());
  }
  clock.advance(1s);
  CHECK_FALSE(cut.disarm());  // touches nothing of the destroyed timer
  CHECK_FALSE(src.stop_requested());
}

TEST_CASE("deadline timer: an infinite deadline or a source without a stop state arms nothing",
          "[deadline_timer]") {
  manual_clock clock;
  keel::deadline_timer timer(clock);
  std::stop_source src;
  keel::deadline_cut forever(timer, keel::deadline::infinite(), src);
  CHECK_FALSE(forever.armed());
  std::stop_source none(std::nostopstate);
  keel::deadline_cut stateless(timer, keel::deadline::after(clock.now(), 1ms), none);
  CHECK_FALSE(stateless.armed());
}

TEST_CASE("cut_at_deadline: an attempt that watches only its stop token ends exactly at its deadline",
          "[deadline_timer][pipeline]") {
  manual_clock clock;
  keel::deadline_timer timer(clock);
  auto pipe = keel::pipeline(keel::time_limit({.at_most = 100ms}), keel::cut_at_deadline(timer)).in(keel::environment{clock});
  keel::call call(clock.now(), {.timeout = 10s});
  async_call<absl::StatusOr<int>> run([&] { return pipe.run(call, wait_for_stop); });
  clock.await_sleepers(1);  // the timer, armed for the attempt's deadline
  clock.advance(99ms);
  clock.await_sleepers(1);
  CHECK_FALSE(run.done());
  clock.advance(1ms);
  REQUIRE(eventually([&] { return run.done(); }));
  absl::StatusOr<int> r = run.get();
  REQUIRE(r.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(std::string(r.status().message()).find("cut at its deadline") != std::string::npos);
  // A timeout on a read: transient, so a retry above may try again.
  CHECK(keel::default_classifier{}(r.status(), call.operation()) == keel::outcome_kind::transient);
  CHECK(timer.figures().fired == 1);
}

TEST_CASE("cut_at_deadline: below a retry each attempt is cut at its own deadline", "[deadline_timer][pipeline]") {
  manual_clock clock;
  keel::deadline_timer timer(clock);
  // No backoff wait between the attempts: the only sleeper is the timer.
  auto pipe = keel::pipeline(keel::retry<keel::constant_backoff>({.max_attempts = 2}, {.delay_each = 0ms}),
                             keel::time_limit({.at_most = 100ms}),
                             keel::cut_at_deadline(timer))
                  .in(keel::environment{clock});
  keel::call call(clock.now(), {.timeout = 10s});
  std::atomic<int> attempts{0};
  async_call<absl::StatusOr<int>> run([&] {
    return pipe.run(call, [&](const keel::attempt& a) {
      attempts.fetch_add(1);
      return wait_for_stop(a);
    });
  });
  clock.await_sleepers(1);
  clock.advance(100ms);
  REQUIRE(eventually([&] { return attempts.load() == 2; }));
  clock.await_sleepers(1);  // armed again, for the second attempt's deadline
  clock.advance(100ms);
  REQUIRE(eventually([&] { return run.done(); }));
  absl::StatusOr<int> r = run.get();
  CHECK(r.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(call.record().attempts == 2);
  CHECK(timer.figures().fired == 2);
}

TEST_CASE("cut_at_deadline: the caller's cancellation still reads as cancelled", "[deadline_timer][pipeline]") {
  manual_clock clock;
  keel::deadline_timer timer(clock);
  auto pipe = keel::pipeline(keel::time_limit({.at_most = 100ms}), keel::cut_at_deadline(timer)).in(keel::environment{clock});
  std::stop_source caller;
  keel::call call(clock.now(), {.timeout = 10s, .stop = caller.get_token()});
  async_call<absl::StatusOr<int>> run([&] { return pipe.run(call, wait_for_stop); });
  clock.await_sleepers(1);
  caller.request_stop();  // forwarded to the attempt's own token
  REQUIRE(eventually([&] { return run.done(); }));
  absl::StatusOr<int> r = run.get();
  CHECK(r.status().code() == absl::StatusCode::kCancelled);
  CHECK(timer.figures().fired == 0);
  clock.await_sleepers(1);  // still asleep until the old deadline; nothing to fire there
  clock.advance(100ms);
  clock.await_sleepers(0);
  CHECK(timer.figures().fired == 0);
}

TEST_CASE("cut_at_deadline: an answer in time is untouched and the next attempt reuses the stop source",
          "[deadline_timer][pipeline]") {
  manual_clock clock;
  keel::deadline_timer timer(clock);
  auto pipe = keel::pipeline(keel::time_limit({.at_most = 100ms}), keel::cut_at_deadline(timer)).in(keel::environment{clock});
  for (int i = 0; i < 3; ++i) {
    keel::call call(clock.now(), {.timeout = 10s});
    absl::StatusOr<int> r = pipe.run(call, [](const keel::attempt& a) -> absl::StatusOr<int> {
      return a.stop.stop_possible() && !a.stop.stop_requested() ? 7 : -1;
    });
    REQUIRE(r.ok());
    CHECK(*r == 7);
  }
  CHECK(timer.figures().fired == 0);
}

TEST_CASE("cut_at_deadline: the success path allocates nothing on the heap", "[deadline_timer][alloc]") {
  if (!keel_test::allocations_counted()) {
    WARN("allocation counting is off in sanitizer builds; the g++ build asserts it");
    return;
  }
  keel::deadline_timer timer;
  auto pipe = keel::pipeline(keel::time_limit({.at_most = 1s}), keel::cut_at_deadline(timer));
  auto provider = [](const keel::attempt& a) -> absl::StatusOr<int> { return a.number; };
  std::stop_source caller;
  {
    keel::call warm(keel::real_clock{}.now(), {.timeout = 3s, .stop = caller.get_token()});
    REQUIRE(pipe.run(warm, provider).ok());  // this thread's stop source is made once
  }
  keel_test::count_allocations allocations;
  for (int i = 0; i < 100; ++i) {
    keel::call call(keel::real_clock{}.now(), {.timeout = 3s, .stop = caller.get_token()});
    absl::StatusOr<int> r = pipe.run(call, provider);
    REQUIRE(r.ok());
  }
  CHECK(allocations.count() == 0);
}

TEST_CASE("cut_at_deadline: on the real clock a stop-only provider returns soon after its deadline",
          "[deadline_timer][pipeline]") {
  keel::deadline_timer timer;
  auto pipe = keel::pipeline(keel::time_limit({.at_most = 20ms}), keel::cut_at_deadline(timer));
  keel::call call(keel::real_clock{}.now(), {.timeout = 30s});
  const keel::time_point start = keel::real_clock{}.now();
  absl::StatusOr<int> r = pipe.run(call, wait_for_stop);
  const keel::duration took = keel::real_clock{}.now() - start;
  CHECK(r.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(took >= 20ms);
  CHECK(took < 220ms);  // 20 ms plus a generous 200: a shared machine, not a tight bound
}

TEST_CASE("deadline timer: many threads arm and disarm while it fires", "[deadline_timer][stress]") {
  keel::deadline_timer timer;
  constexpr int threads = 4;
  constexpr int per_thread = 2000;
  std::atomic<int> wrong{0};
  std::atomic<int> fired{0};
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      for (int i = 0; i < per_thread; ++i) {
        std::stop_source src;
        // Some due at once, some in a few microseconds, most far away.
        const keel::duration after = (i % 3 == 0) ? 0us : (i % 3 == 1 ? 20us : 10s);
        keel::deadline_cut cut(timer, keel::deadline::after(keel::real_clock{}.now(), after), src);
        if ((i + t) % 7 == 0) std::this_thread::yield();
        const bool was_fired = cut.disarm();
        // A cut reports firing exactly when it requested the stop, and
        // nothing is requested once it is disarmed.
        if (was_fired != src.stop_requested()) wrong.fetch_add(1);
        if (was_fired) fired.fetch_add(1);
      }
    });
  }
  for (std::thread& w : workers) w.join();
  CHECK(wrong.load() == 0);
  CHECK(timer.figures().fired == fired.load());
}

TEST_CASE("cut_at_deadline: a cut write is ambiguous unless it says nothing was sent", "[deadline_timer][pipeline]") {
  manual_clock clock;
  keel::deadline_timer timer(clock);
  auto pipe = keel::pipeline(keel::time_limit({.at_most = 100ms}), keel::cut_at_deadline(timer)).in(keel::environment{clock});
  for (const bool before_sending : {false, true}) {
    keel::call call(clock.now(), {.timeout = 10s, .operation = {.effect = keel::effect::write}});
    std::atomic<bool> entered{false};
    async_call<absl::StatusOr<int>> run([&] {
      return pipe.run(call, [&](const keel::attempt& a) -> absl::StatusOr<int> {
        entered = true;
        absl::Status stopped = wait_for_stop(a).status();
        return before_sending ? keel::mark_not_started(stopped) : stopped;
      });
    });
    // The timer's thread sleeping is not enough: cut before the attempt
    // began, the pipeline rightly reports it not started.
    REQUIRE(eventually([&] { return entered.load(); }));
    clock.await_sleepers(1);
    clock.advance(100ms);
    REQUIRE(eventually([&] { return run.done(); }));
    const absl::Status s = run.get().status();
    REQUIRE(s.code() == absl::StatusCode::kDeadlineExceeded);
    CHECK(keel::not_started(s) == before_sending);  // the payload is kept
    CHECK(keel::default_classifier{}(s, call.operation()) ==
          (before_sending ? keel::outcome_kind::transient : keel::outcome_kind::ambiguous));
  }
}

TEST_CASE("cut_at_deadline: nested, the outer cuts the pass at the call's deadline and the inner each attempt",
          "[deadline_timer][pipeline]") {
  manual_clock clock;
  keel::deadline_timer timer(clock);
  auto pipe = keel::pipeline(keel::cut_at_deadline(timer),
                             keel::retry<keel::constant_backoff>({.max_attempts = 3}, {.delay_each = 0ms}),
                             keel::time_limit({.at_most = 30ms}), keel::cut_at_deadline(timer))
                  .in(keel::environment{clock});
  keel::call call(clock.now(), {.timeout = 70ms});
  std::atomic<int> attempts{0};
  async_call<absl::StatusOr<int>> run([&] {
    return pipe.run(call, [&](const keel::attempt& a) {
      attempts.fetch_add(1);
      return wait_for_stop(a);
    });
  });
  REQUIRE(eventually([&] { return attempts.load() == 1; }));
  clock.await_sleepers(1);  // until 30 ms: the first attempt's deadline, before the pass's 70
  clock.advance(30ms);
  REQUIRE(eventually([&] { return attempts.load() == 2; }));
  clock.await_sleepers(1);
  clock.advance(30ms);
  REQUIRE(eventually([&] { return attempts.load() == 3; }));
  clock.await_sleepers(1);
  clock.advance(9ms);
  clock.await_sleepers(1);
  CHECK_FALSE(run.done());
  clock.advance(1ms);  // 70 ms: the third attempt's deadline is the call's
  REQUIRE(eventually([&] { return run.done(); }));
  CHECK(run.get().status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(call.record().attempts == 3);
  CHECK(timer.figures().fired == 4);  // three attempts, and the pass at 70 ms
}
