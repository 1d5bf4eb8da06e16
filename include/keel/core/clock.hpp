// keel/core/clock.hpp — the time source every time-dependent keel component takes.
//
// keel measures time only on a steady clock: deadlines, backoff, breaker
// cool-downs and lease expiry must not jump when the wall clock is adjusted.
// Every component that reads or waits on time takes a type satisfying
// `keel::clock`; production code uses `keel::real_clock`, tests use
// `keel::testing::manual_clock`, whose sleepers wake only when the test
// advances time.
//
// All clocks share one time-point type, `keel::time_point`
// (std::chrono::steady_clock::time_point), so a deadline made from one clock
// can be compared with any other without templates.
//
// Example:
//
//   keel::real_clock clock;
//   keel::time_point start = clock.now();
//   std::stop_source stop;
//   bool reached = clock.sleep_until(start + std::chrono::milliseconds(5),
//                                    stop.get_token());   // true: time reached
//
// Thread-safety: `real_clock` is stateless; every operation may be called
// from any thread.
#pragma once

#include <chrono>
#include <concepts>
#include <condition_variable>
#include <mutex>
#include <stop_token>
#include <thread>

#include "keel/core/condition.hpp"
#include "keel/core/fiber.hpp"

namespace keel {

using time_point = std::chrono::steady_clock::time_point;
using duration = std::chrono::steady_clock::duration;

namespace detail {
struct never_ready {
  bool operator()() const noexcept { return false; }
};
}  // namespace detail

// A steady time source that can also wait.
//
//   now()                                  current time; must not go backwards
//   sleep_until(t, stop)                   blocks until t or stop; true if t was reached
//   wait_until(lock, cv, t, stop, ready)   condition wait on (lock, cv) until ready(),
//                                          t or stop; returns ready() on wake
//
// wait_until is how a component's waiters (a bulkhead queue, a duplicate
// waiting for the first request) wake when either another thread notifies cv
// or time passes, on a real or a manual clock alike. Both waits park a fiber
// instead of blocking its thread when a pipeline runs asynchronously
// (keel/core/fiber.hpp): a clock's sleep goes through the fiber's timers,
// and cv is a keel::condition.
template <class C>
concept clock = requires(const C& c, time_point t, std::stop_token stop,
                         std::unique_lock<std::mutex>& lock,
                         keel::condition& cv) {
  { c.now() } noexcept -> std::same_as<time_point>;
  { c.sleep_until(t, stop) } -> std::same_as<bool>;
  { c.wait_until(lock, cv, t, stop, detail::never_ready{}) } -> std::same_as<bool>;
};

// The production clock: std::chrono::steady_clock.
struct real_clock {
  [[nodiscard]] time_point now() const noexcept { return std::chrono::steady_clock::now(); }

  // Returns true when t was reached, false when stop was requested first.
  bool sleep_until(time_point t, std::stop_token stop) const {
    if (detail::fiber* f = detail::current_fiber) return detail::fiber_sleep_until(*f, t, stop);
    if (!stop.stop_possible()) {
      std::this_thread::sleep_until(t);
      return true;
    }
    std::mutex m;
    std::condition_variable_any cv;
    std::unique_lock lock(m);
    cv.wait_until(lock, stop, t, detail::never_ready{});
    return !stop.stop_requested();
  }

  template <class Ready>
  bool wait_until(std::unique_lock<std::mutex>& lock, keel::condition& cv, time_point t, std::stop_token stop,
                  Ready ready) const {
    return cv.wait_until(lock, std::move(stop), t, std::move(ready));
  }
};

static_assert(clock<real_clock>);

}  // namespace keel
