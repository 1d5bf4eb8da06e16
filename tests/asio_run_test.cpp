// keel::asio: the same pipelines run synchronously (a thread waits) and
// asynchronously (a fiber parks on the executor), from the same cases; the
// manual clock drives every wait.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <asio/bind_cancellation_slot.hpp>
#include <asio/cancellation_signal.hpp>
#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/executor_work_guard.hpp>
#include <asio/io_context.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/use_future.hpp>
#include <catch2/catch.hpp>

#include "keel/asio/executor.hpp"
#include "keel/asio/fiber_threads.hpp"
#include "keel/asio/run.hpp"
#include "keel/compose/cut_at_deadline.hpp"
#include "keel/compose/executor.hpp"
#include "keel/compose/fallback.hpp"
#include "keel/compose/hedge.hpp"
#include "keel/compose/pipeline.hpp"
#include "keel/policy/bulkhead.hpp"
#include "keel/policy/circuit_breaker.hpp"
#include "keel/policy/retry.hpp"
#include "keel/testing/manual_clock.hpp"
#include "support/async_provider.hpp"
#include "support/threads.hpp"

namespace {

using namespace std::chrono_literals;
using keel_test::gate;

// One io_context run by one thread for the whole test.
struct loop {
  asio::io_context io{1};
  asio::executor_work_guard<asio::io_context::executor_type> work = asio::make_work_guard(io);
  std::thread runner{[this] { io.run(); }};
  ~loop() {
    work.reset();
    runner.join();
  }
  [[nodiscard]] asio::any_io_executor ex() { return io.get_executor(); }
};

enum class mode { sync, async };

// Starts `pipe.run(call, provider)`: on a thread of its own (sync), or as
// an asynchronous run on the loop (async).
template <class Pipe>
std::future<gate::result_type> start(mode m, loop& l, const Pipe& pipe, keel::call& call, gate& g) {
  if (m == mode::sync) {
    return std::async(std::launch::async,
                      [&pipe, &call, p = keel::asio::awaited(g.as_provider(), l.ex())]() mutable {
                        return pipe.run(call, p);
                      });
  }
  return keel::asio::async_run(l.ex(), pipe, call, g.as_provider(), asio::use_future);
}

void await_waiting(const gate& g, std::size_t n) {
  for (int i = 0; i < 60000 && g.waiting() != n; ++i) std::this_thread::sleep_for(1ms);
  REQUIRE(g.waiting() == n);
}

// One slot, a queue of one that waits at most `age`: the bulkhead cases.
keel::bulkhead_options one_slot(keel::duration age) {
  keel::bulkhead_options o;
  o.classes.push_back({.name = "all", .capacity = 1, .max_queue = 1, .max_queue_age = age});
  o.default_class = "all";
  return o;
}

}  // namespace

TEST_CASE("an asynchronous run answers through a callback, a future and a coroutine", "[asio]") {
  loop l;
  gate g;
  const auto pipe = keel::pipeline(keel::retry({.max_attempts = 2}));

  keel::call by_future(keel::real_clock{}.now(), {.timeout = 10s});
  auto f = keel::asio::async_run(l.ex(), pipe, by_future, g.as_provider(), asio::use_future);
  await_waiting(g, 1);
  g.answer(7);
  CHECK(f.get().value() == 7);
  CHECK(by_future.record().attempts == 1);

  keel::call by_callback(keel::real_clock{}.now(), {.timeout = 10s});
  std::promise<int> got;
  keel::asio::async_run(l.ex(), pipe, by_callback, g.as_provider(),
                        [&](gate::result_type r) { got.set_value(r.value_or(-1)); });
  await_waiting(g, 1);
  g.answer(8);
  CHECK(got.get_future().get() == 8);

  keel::call by_coroutine(keel::real_clock{}.now(), {.timeout = 10s});
  auto co = asio::co_spawn(
      l.io,
      [&]() -> asio::awaitable<int> {
        gate::result_type r =
            co_await keel::asio::async_run(l.ex(), pipe, by_coroutine, g.as_provider(), asio::use_awaitable);
        co_return r.value_or(-1);
      },
      asio::use_future);
  await_waiting(g, 1);
  g.answer(9);
  CHECK(co.get() == 9);
}

TEST_CASE("a retry waits out its backoff on the clock in both modes", "[asio]") {
  for (mode m : {mode::sync, mode::async}) {
    INFO((m == mode::sync ? "sync" : "async"));
    loop l;
    gate g;
    keel::testing::manual_clock clock;
    const auto pipe = keel::pipeline(keel::retry({.max_attempts = 3}, keel::constant_backoff{.delay_each = 2s}))
                          .in(keel::environment{clock});
    keel::call call(clock.now(), {.timeout = 60s});
    auto f = start(m, l, pipe, call, g);
    await_waiting(g, 1);
    g.answer(absl::UnavailableError("busy"));
    clock.await_sleepers(1);  // the backoff: a thread, or a fiber parked on the clock
    if (m == mode::async) {
      // The loop's thread is free meanwhile: it runs other work.
      auto other = asio::post(l.io, asio::use_future([] { return 1; }));
      CHECK(other.get() == 1);
    }
    CHECK(g.started() == 1);
    clock.advance(2s);
    await_waiting(g, 1);
    g.answer(5);
    CHECK(f.get().value() == 5);
    CHECK(call.record().attempts == 2);
    CHECK(call.record().retries == 1);
  }
}

TEST_CASE("a bulkhead's queue holds the second call until the first is done, in both modes", "[asio]") {
  for (mode m : {mode::sync, mode::async}) {
    INFO((m == mode::sync ? "sync" : "async"));
    loop l;
    gate g;
    keel::testing::manual_clock clock;
    keel::bulkhead slots(one_slot(10s));
    const auto pipe = keel::pipeline(slots).in(keel::environment{clock});
    keel::call first(clock.now(), {.timeout = 60s});
    keel::call second(clock.now(), {.timeout = 60s});
    auto f1 = start(m, l, pipe, first, g);
    await_waiting(g, 1);
    auto f2 = start(m, l, pipe, second, g);
    clock.await_sleepers(1);  // queued for the slot
    CHECK(g.started() == 1);
    g.answer(1);
    CHECK(f1.get().value() == 1);
    await_waiting(g, 1);  // the slot passed to the second call
    g.answer(2);
    CHECK(f2.get().value() == 2);
  }
}

TEST_CASE("a queued call that waits past its queue age is refused, in both modes", "[asio]") {
  for (mode m : {mode::sync, mode::async}) {
    INFO((m == mode::sync ? "sync" : "async"));
    loop l;
    gate g;
    keel::testing::manual_clock clock;
    keel::bulkhead slots(one_slot(1s));
    const auto pipe = keel::pipeline(slots).in(keel::environment{clock});
    keel::call first(clock.now(), {.timeout = 60s});
    keel::call second(clock.now(), {.timeout = 60s});
    auto f1 = start(m, l, pipe, first, g);
    await_waiting(g, 1);
    auto f2 = start(m, l, pipe, second, g);
    clock.await_sleepers(1);
    clock.advance(1s);
    const gate::result_type refused = f2.get();
    CHECK(absl::IsResourceExhausted(refused.status()));
    CHECK(g.started() == 1);
    g.answer(1);
    CHECK(f1.get().value() == 1);
  }
}

TEST_CASE("stopping the call cancels the provider's operation, in both modes", "[asio]") {
  for (mode m : {mode::sync, mode::async}) {
    INFO((m == mode::sync ? "sync" : "async"));
    loop l;
    gate g;
    std::stop_source stop;
    const auto pipe = keel::pipeline(keel::retry({.max_attempts = 3}));
    keel::call call(keel::real_clock{}.now(), {.timeout = 60s, .stop = stop.get_token()});
    auto f = start(m, l, pipe, call, g);
    await_waiting(g, 1);
    stop.request_stop();
    const gate::result_type r = f.get();
    CHECK(absl::IsCancelled(r.status()));
    CHECK(g.cancelled() == 1);
    CHECK(g.started() == 1);  // a stopped call is not retried
  }
}

TEST_CASE("a cancellation slot on the run's token stops the call and its operation", "[asio]") {
  loop l;
  gate g;
  const auto pipe = keel::pipeline(keel::retry({.max_attempts = 3}));
  keel::call call(keel::real_clock{}.now(), {.timeout = 60s});
  asio::cancellation_signal cancel;
  auto f = keel::asio::async_run(l.ex(), pipe, call, g.as_provider(),
                                 asio::bind_cancellation_slot(cancel.slot(), asio::use_future));
  await_waiting(g, 1);
  // Emitted on the loop, as Asio requires.
  asio::post(l.io, [&] { cancel.emit(asio::cancellation_type::terminal); });
  const gate::result_type r = f.get();
  CHECK(absl::IsCancelled(r.status()));
  CHECK(g.cancelled() == 1);
  CHECK(g.started() == 1);
  CHECK(!call.stop_token().stop_possible());  // the call's own token is back
}

TEST_CASE("two thousand runs in flight park on one thread", "[asio]") {
  loop l;
  gate g;
  const auto pipe = keel::pipeline(keel::retry({.max_attempts = 2}));
  constexpr int n = 2000;
  std::vector<std::optional<keel::call>> calls(n);
  std::atomic<int> ok{0};
  std::atomic<int> finished{0};
  const int threads_before = keel_test::threads_in_process();
  for (int i = 0; i < n; ++i) {
    calls[static_cast<std::size_t>(i)].emplace(keel::real_clock{}.now(), keel::call_options{.timeout = 60s});
    keel::asio::async_run(l.ex(), pipe, *calls[static_cast<std::size_t>(i)], g.as_provider(),
                          [&](gate::result_type r) {
                            if (r.ok()) ok.fetch_add(1);
                            finished.fetch_add(1);
                          });
  }
  await_waiting(g, n);
  // No thread for any of them (see support/threads.hpp for why not "equal").
  CHECK(keel_test::threads_in_process() <= threads_before);
  for (int i = 0; i < n; ++i) g.answer(i);
  for (int i = 0; i < 60000 && finished.load() != n; ++i) std::this_thread::sleep_for(1ms);
  CHECK(finished.load() == n);
  CHECK(ok.load() == n);
}

namespace {

// A hedge on the manual clock: its primary waits at the gate, the hedge
// starts after 1 s and wins, and the primary is cancelled through its
// operation's slot. Run synchronously with a thread pool for the attempts,
// and asynchronously with fibers.
template <class Executor>
void hedge_case(mode m, loop& l, Executor& attempts, bool primary_on_caller) {
  gate g;
  keel::testing::manual_clock clock;
  keel::retry_budget budget({.ratio = 1.0, .min_per_second = 10});
  keel::deadline_timer timer{clock};
  keel::hedge<Executor> hedger(
      {.delay = 1s, .max_hedges = 1, .budget = &budget, .primary_on_caller_thread = primary_on_caller}, attempts,
      timer);
  const auto pipe = keel::pipeline(hedger).in(keel::environment{clock});
  keel::call call(clock.now(), {.timeout = 60s});
  auto f = start(m, l, pipe, call, g);
  await_waiting(g, 1);
  clock.await_sleepers(1);  // the hedge's timer, armed for this call
  clock.advance(1s);
  await_waiting(g, 2);
  CHECK(g.last_hedge() == 1);
  g.answer_newest(11);  // the hedge wins
  const gate::result_type r = f.get();
  CHECK(r.value() == 11);
  CHECK(call.record().attempts == 2);
  for (int i = 0; i < 60000 && g.cancelled() != 1; ++i) std::this_thread::sleep_for(1ms);
  CHECK(g.cancelled() == 1);  // the primary, stopped through its slot
  for (int i = 0; i < 60000 && hedger.figures().outstanding != 0; ++i) std::this_thread::sleep_for(1ms);
  CHECK(hedger.figures().hedge_wins == 1);
  CHECK(hedger.figures().outstanding == 0);
}

}  // namespace

TEST_CASE("a hedge races its attempts and stops the loser, in both modes", "[asio][hedge]") {
  for (bool on_caller : {false, true}) {
    INFO("primary_on_caller_thread " << on_caller);
    {
      INFO("sync, attempts on a thread pool");
      loop l;
      keel::bounded_pool pool({.threads = 2, .queue_capacity = 8});
      hedge_case(mode::sync, l, pool, on_caller);
    }
    {
      INFO("async, attempts on fibers");
      loop l;
      keel::asio::fiber_executor fibers(l.ex());
      hedge_case(mode::async, l, fibers, on_caller);
    }
  }
}

TEST_CASE("a deadline cut stops the provider's operation at the deadline, in both modes", "[asio][cut]") {
  for (mode m : {mode::sync, mode::async}) {
    INFO((m == mode::sync ? "sync" : "async"));
    loop l;
    gate g;
    keel::testing::manual_clock clock;
    keel::deadline_timer timer(clock);
    const auto pipe = keel::pipeline(keel::cut_at_deadline(timer)).in(keel::environment{clock});
    keel::call call(clock.now(), {.timeout = 2s});
    auto f = start(m, l, pipe, call, g);
    await_waiting(g, 1);
    clock.await_sleepers(1);  // the timer, armed for this attempt
    clock.advance(2s);
    const gate::result_type r = f.get();
    CHECK(absl::IsDeadlineExceeded(r.status()));
    CHECK(g.cancelled() == 1);  // the operation itself was stopped, through its slot
  }
}

TEST_CASE("a fallback answers when the provider fails, in both modes", "[asio]") {
  for (mode m : {mode::sync, mode::async}) {
    INFO((m == mode::sync ? "sync" : "async"));
    loop l;
    gate g;
    auto cached = [](const keel::attempt&) -> absl::StatusOr<int> { return 99; };
    const auto pipe = keel::pipeline(keel::fallback({}, keel::alternate("cached", cached)));
    keel::call call(keel::real_clock{}.now(), {.timeout = 10s});
    auto f = start(m, l, pipe, call, g);
    await_waiting(g, 1);
    g.answer(absl::UnavailableError("down"));
    CHECK(f.get().value() == 99);
    CHECK(call.record().degraded);
    CHECK(call.record().served_by == "cached");
  }
}

TEST_CASE("an open breaker refuses without starting the operation, in both modes", "[asio]") {
  for (mode m : {mode::sync, mode::async}) {
    INFO((m == mode::sync ? "sync" : "async"));
    loop l;
    gate g;
    keel::circuit_breaker breaker({.name = "model"});
    breaker.force_open(keel::real_clock{}.now());
    const auto pipe = keel::pipeline(breaker);
    keel::call call(keel::real_clock{}.now(), {.timeout = 10s});
    const gate::result_type r = start(m, l, pipe, call, g).get();
    CHECK(keel::refused_by(r.status()) == std::optional<std::string>("breaker:model"));
    CHECK(g.started() == 0);
  }
}

TEST_CASE("on the real clock a fiber's backoff waits on the executor's timer, and a stop ends it", "[asio]") {
  loop l;
  gate g;
  // The retry's backoff sleeps on keel::real_clock: on a fiber, a timer of
  // the executor (keel/asio/fiber.hpp), not the thread.
  const auto pipe = keel::pipeline(keel::retry({.max_attempts = 2}, keel::constant_backoff{.delay_each = 1h}));
  std::stop_source stop;
  keel::call call(keel::real_clock{}.now(), {.timeout = 2h, .stop = stop.get_token()});
  auto f = keel::asio::async_run(l.ex(), pipe, call, g.as_provider(), asio::use_future);
  await_waiting(g, 1);
  g.answer(absl::UnavailableError("busy"));
  // The loop's one thread runs other work while the fiber waits out its hour.
  for (int i = 0; i < 3; ++i) {
    auto other = asio::post(l.io, asio::use_future([] { return 1; }));
    REQUIRE(other.wait_for(60s) == std::future_status::ready);  // a blocked thread would never run it
  }
  CHECK(f.wait_for(0s) == std::future_status::timeout);
  stop.request_stop();  // the timer is cancelled and its handler waited for
  REQUIRE(f.wait_for(60s) == std::future_status::ready);
  const absl::Status stopped = f.get().status();
  CHECK(absl::IsUnavailable(stopped));  // the last failure, marked as ended by the stop
  CHECK(std::string(stopped.message()).find("cancelled while waiting to retry") != std::string::npos);
  CHECK(g.started() == 1);

  // A short backoff runs out on the timer, and the retry goes on.
  const auto quick = keel::pipeline(keel::retry({.max_attempts = 2}, keel::constant_backoff{.delay_each = 5ms}));
  keel::call again(keel::real_clock{}.now(), {.timeout = 60s});
  auto r = keel::asio::async_run(l.ex(), quick, again, g.as_provider(), asio::use_future);
  await_waiting(g, 1);
  g.answer(absl::UnavailableError("busy"));
  await_waiting(g, 1);
  g.answer(3);
  CHECK(r.get().value() == 3);
  CHECK(again.record().retries == 1);
}

TEST_CASE("fiber_threads spreads fibers over its threads, each fiber stays on its own, and stop waits for them",
          "[asio][fiber_threads]") {
  CHECK_THROWS_WITH(keel::asio::fiber_threads({.threads = 0}),
                    Catch::Contains("fiber_threads_options.threads must be in [1, 1024]"));
  CHECK(keel::asio::fiber_threads::index_here() == -1);  // the test's thread is none of them
  keel::asio::fiber_threads fibers({.threads = 2});
  REQUIRE(fibers.size() == 2);
  constexpr int n = 8;
  std::atomic<int> on[2] = {0, 0};
  std::atomic<int> moved{0}, finished{0};
  keel::testing::manual_clock clock;  // parks each fiber until the test advances it
  for (int i = 0; i < n; ++i) {
    REQUIRE(fibers.spawn([&] {  // no Catch2 assertion here: another thread
      const int here = keel::asio::fiber_threads::index_here();
      if (here != 0 && here != 1) return;  // counted as neither below
      if (keel::asio::current_executor() == nullptr) return;
      on[here].fetch_add(1);
      clock.sleep_until(clock.now() + 1s, {});  // parked: its thread runs the others meanwhile
      if (keel::asio::fiber_threads::index_here() != here) moved.fetch_add(1);
      finished.fetch_add(1);
    }));
  }
  // All eight park at once on two threads: none holds its thread.
  clock.await_sleepers(n);
  CHECK(on[0].load() == n / 2);  // in turn
  CHECK(on[1].load() == n / 2);
  CHECK(finished.load() == 0);
  clock.advance(1s);
  fibers.stop();  // returns once every fiber has finished
  CHECK(finished.load() == n);
  CHECK(moved.load() == 0);
  CHECK_FALSE(fibers.spawn([] {}));  // stopped: refused
}

namespace {

// Answers 1 through a post on the handler's executor: a provider that is
// done at once, so many runs cross the bulkhead in quick turns.
struct posted_answer {
  using result_type = absl::StatusOr<int>;
  template <class Token>
  auto operator()(const keel::attempt& /*a*/, Token&& token) const {
    return asio::async_initiate<Token, void(result_type)>(
        [](auto handler) {
          auto ex = asio::get_associated_executor(handler);
          asio::post(ex, [h = std::move(handler)]() mutable { std::move(h)(result_type(1)); });
        },
        token);
  }
};

}  // namespace

TEST_CASE("fibers queued on a bulkhead with a real-clock queue age take turns on one thread without deadlock",
          "[asio]") {
  // A queued fiber that gets the slot cancels its queue-age timer, which
  // parks it until the timer's handler has run: it must not hold the
  // bulkhead's lock meanwhile, or the next fiber on the thread to take the
  // lock blocks the thread for good (the gateway's fiber mode under load).
  loop l;
  keel::bulkhead_options o;
  o.classes.push_back({.name = "all", .capacity = 1, .max_queue = 64, .max_queue_age = 1h});
  o.default_class = "all";
  keel::bulkhead slots(o);
  const auto pipe = keel::pipeline(slots);
  constexpr int n = 64;
  std::vector<std::unique_ptr<keel::call>> calls;
  std::vector<std::future<absl::StatusOr<int>>> done;
  for (int i = 0; i < n; ++i) {
    calls.push_back(std::make_unique<keel::call>(keel::real_clock{}.now(), keel::call_options{.timeout = 1h}));
    done.push_back(keel::asio::async_run(l.ex(), pipe, *calls.back(), posted_answer{}, asio::use_future));
  }
  int answered = 0;
  for (auto& f : done) {
    if (f.wait_for(60s) != std::future_status::ready) {
      // The loop's thread is stuck: the loop cannot be joined, so say so and end.
      std::fprintf(stderr, "asio_run_test: %d of %d runs answered, the rest stuck after 60 s: a deadlock\n",
                   answered, n);
      std::_Exit(1);
    }
    answered += f.get().value_or(0);
  }
  CHECK(answered == n);
}
