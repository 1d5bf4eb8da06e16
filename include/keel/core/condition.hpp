// keel/core/condition.hpp — the condition variable keel's waiters use: it
// blocks a thread, and parks a fiber (keel/core/fiber.hpp) without
// blocking the thread that runs it.
//
// A bulkhead's queue, a hedge's caller waiting for its race, a store's
// duplicate waiting for the first request: each waits on a keel::condition
// through its clock (keel/core/clock.hpp, wait_until), so the same code waits
// on a thread in a synchronous run and on a fiber in an asynchronous one
// (keel/asio/run.hpp). On a thread it is a std::condition_variable_any; a
// fiber links itself into the condition's list, and notify_one/notify_all
// unpark the fibers in it as well as waking the threads.
//
// Example:
//
//   std::mutex m;
//   keel::condition ready_cv;
//   bool ready = false;
//   std::jthread t([&] { std::lock_guard l(m); ready = true; ready_cv.notify_all(); });
//   std::unique_lock lock(m);
//   ready_cv.wait(lock, [&] { return ready; });
//
// Waits may wake spuriously; each takes the predicate it waits for, as
// std::condition_variable_any's do. A notify with no fiber waiting costs one
// atomic load more than the standard one.
//
// Thread-safety: as std::condition_variable_any: notify from any thread, with
// or without the waiters' mutex held; wait with that mutex locked.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <stop_token>
#include <utility>

#include "keel/core/fiber.hpp"

namespace keel {

class condition {
 public:
  condition() = default;
  condition(const condition&) = delete;
  condition& operator=(const condition&) = delete;

  void notify_one() noexcept {
    cv_.notify_one();
    if (fibers_.load(std::memory_order_seq_cst) != 0) wake(/*all=*/false);
  }
  void notify_all() noexcept {
    cv_.notify_all();
    if (fibers_.load(std::memory_order_seq_cst) != 0) wake(/*all=*/true);
  }

  // Until ready().
  template <class Ready>
  void wait(std::unique_lock<std::mutex>& lock, Ready ready) {
    if (detail::fiber* f = detail::current_fiber) {
      (void)park(*f, lock, nullptr, nullptr, ready);
      return;
    }
    cv_.wait(lock, std::move(ready));
  }
  // Until ready() or a stop request; returns ready().
  template <class Ready>
  bool wait(std::unique_lock<std::mutex>& lock, std::stop_token stop, Ready ready) {
    if (detail::fiber* f = detail::current_fiber) return park(*f, lock, &stop, nullptr, ready);
    return cv_.wait(lock, std::move(stop), std::move(ready));
  }
  // Until ready(), `t` on the steady clock, or a stop request; returns ready().
  template <class Ready>
  bool wait_until(std::unique_lock<std::mutex>& lock, std::stop_token stop, detail::steady_time t, Ready ready) {
    if (detail::fiber* f = detail::current_fiber) return park(*f, lock, &stop, &t, ready);
    return cv_.wait_until(lock, std::move(stop), t, std::move(ready));
  }
  template <class Ready>
  bool wait_until(std::unique_lock<std::mutex>& lock, detail::steady_time t, Ready ready) {
    if (detail::fiber* f = detail::current_fiber) return park(*f, lock, nullptr, &t, ready);
    return cv_.wait_until(lock, t, std::move(ready));
  }

 private:
  struct waiter {
    detail::fiber* f;
    waiter* next = nullptr;
    waiter* prev = nullptr;
    bool linked = false;
  };

  template <class Ready>
  bool park(detail::fiber& f, std::unique_lock<std::mutex>& lock, const std::stop_token* stop,
            const detail::steady_time* t, Ready& ready) {
    if (ready()) return true;
    detail::fiber::timed_wake* timer = t != nullptr ? &f.wake_at(*t) : nullptr;
    waiter me{&f};
    {
      std::optional<std::stop_callback<detail::unpark_fiber>> on_stop;
      if (stop != nullptr && stop->stop_possible()) on_stop.emplace(*stop, detail::unpark_fiber{&f});
      // Linked while the waiters' mutex is held, so a notify that follows a
      // change made under it finds this fiber.
      while (!ready() && !(stop != nullptr && stop->stop_requested()) && !(timer != nullptr && timer->fired())) {
        link(me);
        lock.unlock();
        f.park();
        unlink(me);
        lock.lock();
      }
    }
    if (timer != nullptr) {
      // Not under the caller's lock: cancel() parks until the timer's handler
      // has run, and a fiber parked holding the lock would block every
      // thread that takes it next, the one that must resume this fiber too.
      lock.unlock();
      timer->cancel();
      lock.lock();
    }
    return ready();
  }

  void link(waiter& w) {
    std::lock_guard g(mu_);
    w.prev = tail_;
    w.next = nullptr;
    (tail_ != nullptr ? tail_->next : head_) = &w;
    tail_ = &w;
    w.linked = true;
    fibers_.fetch_add(1, std::memory_order_seq_cst);
  }
  void unlink_locked(waiter& w) noexcept {
    (w.prev != nullptr ? w.prev->next : head_) = w.next;
    (w.next != nullptr ? w.next->prev : tail_) = w.prev;
    w.linked = false;
    fibers_.fetch_sub(1, std::memory_order_seq_cst);
  }
  void unlink(waiter& w) {
    std::lock_guard g(mu_);
    if (w.linked) unlink_locked(w);
  }
  // Unparked under mu_: a waiter leaves only after taking mu_ (unlink), so
  // its node and fiber are alive here.
  void wake(bool all) noexcept {
    std::lock_guard g(mu_);
    while (head_ != nullptr) {
      waiter& w = *head_;
      unlink_locked(w);
      w.f->unpark();
      if (!all) break;
    }
  }

  std::condition_variable_any cv_;
  std::mutex mu_;  // the fiber list
  waiter* head_ = nullptr;
  waiter* tail_ = nullptr;
  std::atomic<int> fibers_{0};
};

}  // namespace keel
