// keel/core/fiber.hpp — where keel waits when a pipeline runs on a fiber
// instead of a thread of its own.
//
// keel's policies are written once, in direct style: a retry sleeps out its
// backoff, a bulkhead queues, a hedge waits for its race. A synchronous run
// does that on the caller's thread. An asynchronous run (keel/asio/run.hpp)
// runs the same code on a fiber, a stack of its own on an Asio executor, and
// every wait goes through this interface instead of blocking the thread: the
// clocks (keel/core/clock.hpp) and keel::condition (keel/core/condition.hpp)
// ask detail::current_fiber, and when it is set they park the fiber and let
// its executor run other work until a timer, a notify or a stop wakes it.
// The core knows only this interface; keel::asio implements it.
//
// Example (what a clock does on a fiber; keel::real_clock::sleep_until):
//
//   if (keel::detail::fiber* f = keel::detail::current_fiber) {
//     bool reached = keel::detail::fiber_sleep_until(*f, t, stop);
//   }
//
// Thread-safety: park() only from the fiber itself; unpark() and the wake
// handles from any thread.
#pragma once

#include <chrono>
#include <optional>
#include <stop_token>

namespace keel::detail {

using steady_time = std::chrono::steady_clock::time_point;

// A fiber keel's waits can park. park() returns after unpark() (a permit:
// an unpark that comes first makes the next park return at once) and may
// return spuriously, so every caller loops on its own condition.
class fiber {
 public:
  virtual void park() = 0;
  virtual void unpark() noexcept = 0;

  // A wake at `t` on the steady clock, from the fiber's executor's timers:
  // unparks this fiber then. Cancel it before the waiting frame returns.
  class timed_wake {
   public:
    virtual void cancel() noexcept = 0;
    [[nodiscard]] virtual bool fired() const noexcept = 0;

   protected:
    ~timed_wake() = default;
  };
  // The returned wake lives until cancel(); at most one per fiber at a time.
  // cancel() may park the fiber until the host's timer has let go of the
  // wake: call it holding no lock another fiber may take.
  virtual timed_wake& wake_at(steady_time t) = 0;

 protected:
  ~fiber() = default;
};

// The fiber running on this thread, or null on a plain thread. Set by the
// fiber's host each time it switches into the fiber.
inline thread_local fiber* current_fiber = nullptr;

struct unpark_fiber {
  fiber* f;
  void operator()() const noexcept { f->unpark(); }
};

// Parks `f` until the steady clock reaches `t` or `stop` is requested; true
// when `t` was reached.
inline bool fiber_sleep_until(fiber& f, steady_time t, const std::stop_token& stop) {
  if (stop.stop_requested()) return false;
  fiber::timed_wake& wake = f.wake_at(t);
  {
    std::optional<std::stop_callback<unpark_fiber>> on_stop;
    if (stop.stop_possible()) on_stop.emplace(stop, unpark_fiber{&f});
    while (!wake.fired() && !stop.stop_requested()) f.park();
  }
  const bool reached = wake.fired();
  wake.cancel();
  return reached;
}

}  // namespace keel::detail
