// The clocks: the real steady clock, the manual clock every other test
// drives time with, and any_clock, which holds either.
#include "keel/core/clock.hpp"
#include "keel/core/any_clock.hpp"
#include "keel/core/condition.hpp"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdlib>
#include <mutex>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "keel/testing/manual_clock.hpp"
#include "support/catch.hpp"
#include "support/child_process.hpp"

using namespace std::chrono_literals;
using keel::testing::manual_clock;

TEST_CASE("real_clock sleeps until the time and stops early on request", "[clock]") {
  keel::real_clock clock;
  const keel::time_point start = clock.now();
  REQUIRE(clock.sleep_until(start + 1ms, std::stop_token{}));
  REQUIRE(clock.now() >= start + 1ms);

  std::stop_source stop;
  stop.request_stop();
  // Already stopped: returns false at once instead of sleeping an hour.
  REQUIRE_FALSE(clock.sleep_until(clock.now() + 1h, stop.get_token()));
}

TEST_CASE("manual_clock moves only when advanced", "[clock]") {
  manual_clock clock;
  const keel::time_point t0 = clock.now();
  REQUIRE(clock.now() == t0);
  clock.advance(250ms);
  REQUIRE(clock.now() - t0 == 250ms);
  manual_clock copy = clock;  // copies share the timeline
  copy.advance(1s);
  REQUIRE(clock.now() - t0 == 1250ms);
}

TEST_CASE("manual_clock wakes a sleeper only when its time comes", "[clock]") {
  manual_clock clock;
  const keel::time_point wake = clock.now() + 5s;
  std::atomic<bool> woke{false};
  bool reached = false;
  std::thread sleeper([&] {
    reached = clock.sleep_until(wake, {});
    woke = true;
  });
  clock.await_sleepers(1);
  clock.advance(4s);
  REQUIRE(clock.sleepers() == 1);  // still parked: 1 s to go
  REQUIRE_FALSE(woke.load());
  clock.advance(1s);
  sleeper.join();
  REQUIRE(woke.load());
  REQUIRE(reached);
}

TEST_CASE("manual_clock wakes each sleeper when its own time comes, not before", "[clock]") {
  manual_clock clock;
  const keel::time_point t0 = clock.now();
  std::atomic<int> reached{0};
  std::vector<std::thread> threads;
  for (int i : {3, 1, 2}) {
    threads.emplace_back([&, i] {
      if (clock.sleep_until(t0 + i * 1s, {}) && clock.now() >= t0 + i * 1s) ++reached;
    });
  }
  clock.await_sleepers(3);
  for (int step = 1; step <= 3; ++step) {
    clock.advance(1s);
    // Exactly one sleeper's time has come per second; the others stay parked.
    clock.await_sleepers(3 - step);
  }
  for (auto& t : threads) t.join();
  REQUIRE(reached.load() == 3);
}

TEST_CASE("manual_clock sleep ends early when stop is requested", "[clock]") {
  manual_clock clock;
  std::stop_source stop;
  bool reached = true;
  std::thread sleeper([&] { reached = clock.sleep_until(clock.now() + 1h, stop.get_token()); });
  clock.await_sleepers(1);
  stop.request_stop();
  sleeper.join();
  REQUIRE_FALSE(reached);
}

TEST_CASE("manual_clock wait_until wakes on notify, on time, and on stop", "[clock]") {
  manual_clock clock;
  std::mutex mu;
  keel::condition cv;
  bool ready = false;

  SECTION("notified by another thread") {
    bool result = false;
    std::thread waiter([&] {
      std::unique_lock lock(mu);
      result = clock.wait_until(lock, cv, clock.now() + 1h, {}, [&] { return ready; });
    });
    clock.await_sleepers(1);
    {
      std::lock_guard lock(mu);
      ready = true;
    }
    cv.notify_all();
    waiter.join();
    REQUIRE(result);
  }
  SECTION("time runs out") {
    bool result = true;
    std::thread waiter([&] {
      std::unique_lock lock(mu);
      result = clock.wait_until(lock, cv, clock.now() + 2s, {}, [&] { return ready; });
    });
    clock.await_sleepers(1);
    clock.advance(2s);
    waiter.join();
    REQUIRE_FALSE(result);
  }
  SECTION("stop requested") {
    std::stop_source stop;
    bool result = true;
    std::thread waiter([&] {
      std::unique_lock lock(mu);
      result = clock.wait_until(lock, cv, clock.now() + 1h, stop.get_token(), [&] { return ready; });
    });
    clock.await_sleepers(1);
    stop.request_stop();
    waiter.join();
    REQUIRE_FALSE(result);
  }
  SECTION("already ready: returns at once without registering") {
    ready = true;
    std::unique_lock lock(mu);
    REQUIRE(clock.wait_until(lock, cv, clock.now() + 1h, {}, [&] { return ready; }));
    REQUIRE(lock.owns_lock());
  }
}

TEST_CASE("any_clock holds a manual clock by value: copies share its timeline, and its waits are the clock's",
          "[clock][any_clock]") {
  manual_clock clock;
  const keel::any_clock held(clock);
  keel::any_clock copy = held;
  clock.advance(3s);
  CHECK(held.now() == clock.now());
  CHECK(copy.now() == clock.now());
  CHECK(held.target<manual_clock>() != nullptr);
  CHECK(held.target<keel::real_clock>() == nullptr);

  // A sleep through it is a sleeper on the manual clock, woken by advance().
  std::atomic<bool> reached{false};
  std::thread sleeper([&] { reached = held.sleep_until(clock.now() + 5s, {}); });
  clock.await_sleepers(1);
  CHECK_FALSE(reached.load());
  clock.advance(5s);
  sleeper.join();
  CHECK(reached.load());

  // A condition wait through it wakes on notify with the predicate true.
  std::mutex mu;
  keel::condition cv;
  bool ready = false;
  bool result = false;
  std::thread waiter([&] {
    std::unique_lock lock(mu);
    result = copy.wait_until(lock, cv, clock.now() + 1h, {}, [&] { return ready; });
  });
  clock.await_sleepers(1);
  {
    std::lock_guard lock(mu);
    ready = true;
  }
  cv.notify_all();
  waiter.join();
  CHECK(result);

  // Assigned the real clock, it reads steady time, not the manual clock's.
  copy = keel::any_clock{};
  CHECK(copy.target<keel::real_clock>() != nullptr);
  const keel::time_point real = keel::real_clock{}.now();
  CHECK(copy.now() >= real);
  CHECK(copy.now() < real + 1h);
}

TEST_CASE("manual_clock can be hammered by many sleepers and an advancing thread", "[clock][concurrency]") {
  manual_clock clock;
  const keel::time_point t0 = clock.now();
  constexpr int kThreads = 8;
  constexpr int kSleeps = 200;
  std::atomic<int> done{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      for (int s = 1; s <= kSleeps; ++s) clock.sleep_until(t0 + (s * kThreads + i) * 1ms, {});
      ++done;
    });
  }
  while (done.load() < kThreads) clock.advance(1ms);
  for (auto& t : threads) t.join();
  REQUIRE(clock.now() >= t0 + kSleeps * kThreads * 1ms);
}

// Run only as a child of the test below (hidden: "[.]").
TEST_CASE("manual_clock child: awaits a sleeper that never comes", "[.][manual_clock_child]") {
  manual_clock clock;
  clock.await_sleepers(1, 50ms);
  FAIL("await_sleepers returned without its sleeper");
}

TEST_CASE("await_sleepers gives up in real time, naming the count, instead of hanging the suite",
          "[clock][manual_clock]") {
  char err_path[] = "/tmp/keel-clock-child-XXXXXX";
  const int err_fd = ::mkstemp(err_path);
  REQUIRE(err_fd >= 0);
  ::close(err_fd);
  // Bounded: a child that never gives up is the failure under test, not a hang.
  const int code = keel_test::wait_child(
      keel_test::spawn_self({.test_case = "[manual_clock_child]", .stderr_path = err_path}), std::chrono::seconds(30));
  const std::string err = keel_test::read_file(err_path);
  ::unlink(err_path);
  INFO("child stderr: " << err);
  REQUIRE(code != -1);  // -1: still waiting after 30 s, and killed
  CHECK(code == 128 + SIGABRT);
  CHECK(err.find("await_sleepers(1) gave up after 50 ms of real time with 0 thread(s) blocked on the clock") !=
        std::string::npos);
}
