// keel/testing/manual_clock.hpp — a clock that moves only when a test moves it.
//
// Every time-dependent keel component is tested with this clock instead of
// sleeping: a thread that sleeps or waits on it blocks until the test calls
// advance() past its wake time (or its stop token fires, or, for
// wait_until, another thread notifies the condition and it is ready).
//
// Copies share one timeline, so a component holding a copy sees the test's
// advances.
//
// Example:
//
//   keel::testing::manual_clock clock;
//   std::jthread sleeper([&] { clock.sleep_until(clock.now() + std::chrono::seconds(5), {}); });
//   clock.await_sleepers(1);              // the sleeper is parked on the clock
//   clock.advance(std::chrono::seconds(5));   // ...and now it wakes
//
// Thread-safety: every operation may be called from any thread. advance()
// and set() wake every waiter whose time has come.
//
// set() may move time backwards, which a real steady clock never does; tests
// use it to prove that components survive a misbehaving clock.
//
// Single-threaded tests can switch on auto_advance(true): a sleep then jumps
// the clock straight to its wake time (and a wait_until whose condition is
// not ready jumps to its timeout), so a retry loop runs to completion on
// simulated time without a second thread.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <stop_token>
#include <vector>

#include "keel/core/clock.hpp"
#include "keel/core/condition.hpp"

namespace keel::testing {

class manual_clock {
 public:
  // Starts at an arbitrary fixed point, far from zero so that subtracting
  // durations never underflows.
  manual_clock() : manual_clock(time_point(std::chrono::hours(24 * 365))) {}
  explicit manual_clock(time_point start) : state_(std::make_shared<state>()) {
    state_->now_ns.store(start.time_since_epoch().count(), std::memory_order_relaxed);
  }

  [[nodiscard]] time_point now() const noexcept {
    return time_point(duration(state_->now_ns.load(std::memory_order_acquire)));
  }

  // Moves time forward by d and wakes the waiters whose time has come. Const:
  // copies share one timeline, so any handle may move it.
  void advance(duration d) const { set(now() + d); }

  // Moves time to t (forwards or backwards) and wakes waiters.
  void set(time_point t) const {
    state_->now_ns.store(t.time_since_epoch().count(), std::memory_order_release);
    std::lock_guard registry(state_->mu);
    // Locking each waiter's own mutex before notifying closes the window
    // between its "not yet" check and its wait: no wake-up is lost.
    for (const waiter& w : state_->waiters) {
      std::lock_guard lock(*w.mutex);
      w.cv->notify_all();
    }
  }

  // When on, sleeps and timed waits move the clock themselves (see above).
  void auto_advance(bool on) const { state_->auto_advance.store(on, std::memory_order_relaxed); }

  bool sleep_until(time_point t, std::stop_token stop) const {
    if (now() >= t) return true;  // nothing to wait for: never shows up as a sleeper
    if (state_->auto_advance.load(std::memory_order_relaxed)) {
      if (stop.stop_requested()) return false;
      if (now() < t) set(t);
      return true;
    }
    std::mutex m;
    keel::condition cv;
    registration reg(*state_, m, cv);
    std::unique_lock lock(m);
    cv.wait(lock, stop, [&] { return now() >= t; });
    return now() >= t;
  }

  template <class Ready>
  bool wait_until(std::unique_lock<std::mutex>& lock, keel::condition& cv, time_point t,
                  std::stop_token stop, Ready ready) const {
    if (ready()) return true;
    if (state_->auto_advance.load(std::memory_order_relaxed)) {
      if (stop.stop_requested()) return false;
      lock.unlock();
      if (now() < t) set(t);
      lock.lock();
      return ready();
    }
    // The registry lock is never taken while a waiter's mutex is held, so
    // advance() (registry, then waiter mutex) cannot deadlock with us.
    lock.unlock();
    {
      registration reg(*state_, *lock.mutex(), cv);
      lock.lock();
      cv.wait(lock, stop, [&] { return ready() || now() >= t; });
      lock.unlock();
    }
    lock.lock();
    return ready();
  }

  // Number of threads currently blocked in sleep_until or wait_until.
  [[nodiscard]] int sleepers() const {
    std::lock_guard registry(state_->mu);
    return static_cast<int>(state_->waiters.size());
  }

  // Blocks (in real time) until exactly n threads are blocked on this
  // clock. Tests call it before advance() so a worker is known to be parked,
  // and after, to know how many woke.
  //
  // A count that never comes means a broken test or component, and every
  // thread behind it would hang until the test runner's timeout. After
  // `give_up` of real time it prints what it waited for and what it saw to
  // stderr and aborts the process: a failure naming the cause, in a minute.
  void await_sleepers(int n, std::chrono::milliseconds give_up = std::chrono::seconds(60)) const {
    std::unique_lock registry(state_->mu);
    auto count = [&] { return static_cast<int>(state_->waiters.size()); };
    if (state_->changed.wait_for(registry, give_up, [&] { return count() == n; })) return;
    std::fprintf(stderr,
                 "keel::testing::manual_clock: await_sleepers(%d) gave up after %lld ms of real time with %d "
                 "thread(s) blocked on the clock\n",
                 n, static_cast<long long>(give_up.count()), count());
    std::fflush(stderr);
    // Past any test framework's handler: it would report again, and under
    // TSan its unsafe work inside a signal handler muddies the failure.
    std::signal(SIGABRT, SIG_DFL);
    std::abort();
  }

 private:
  struct waiter {
    std::mutex* mutex;
    keel::condition* cv;
  };
  struct state {
    std::atomic<duration::rep> now_ns{0};
    std::atomic<bool> auto_advance{false};
    mutable std::mutex mu;
    std::condition_variable changed;
    std::vector<waiter> waiters;
  };
  struct registration {
    registration(state& s, std::mutex& m, keel::condition& cv) : s_(s), cv_(&cv) {
      std::lock_guard registry(s_.mu);
      s_.waiters.push_back({&m, &cv});
      s_.changed.notify_all();
    }
    ~registration() {
      std::lock_guard registry(s_.mu);
      auto it = std::find_if(s_.waiters.begin(), s_.waiters.end(),
                             [&](const waiter& w) { return w.cv == cv_; });
      if (it != s_.waiters.end()) s_.waiters.erase(it);
      s_.changed.notify_all();
    }
    registration(const registration&) = delete;
    registration& operator=(const registration&) = delete;
    state& s_;
    keel::condition* cv_;
  };

  std::shared_ptr<state> state_;
};

static_assert(keel::clock<manual_clock>);

}  // namespace keel::testing
