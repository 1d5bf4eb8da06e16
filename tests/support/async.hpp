// Helpers for tests that drive another thread: async_call runs a call (a
// request whose attempts sleep on the manual clock) on its own thread while
// the test moves the clock; eventually() waits, in real time and bounded, for
// a state that thread will reach.
//
//   async_call<absl::Status> run([&] { return pipe.run(call, provider); });
//   clock.await_sleepers(1);
//   clock.advance(100ms);
//   REQUIRE(eventually([&] { return run.done(); }));
//   absl::Status s = run.get();
//
// block_until_stopped(stop) parks the calling thread until its stop token
// is stopped and watches nothing else (no timeout, no clock): the provider
// that only a cut, a cancel or a hedge's win can end.
//
// Thread-safety: done() from any thread; get() once, from the test's thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <stop_token>
#include <thread>
#include <utility>

#include "keel/core/condition.hpp"

namespace keel_test {

inline void block_until_stopped(const std::stop_token& stop) {
  std::mutex m;
  keel::condition cv;
  std::unique_lock lock(m);
  cv.wait(lock, stop, [] { return false; });
}

template <class R>
class async_call {
 public:
  template <class F>
  explicit async_call(F f) : thread_([this, f = std::move(f)]() mutable {
      result_.emplace(f());
      done_ = true;
    }) {}
  async_call(const async_call&) = delete;
  async_call& operator=(const async_call&) = delete;
  ~async_call() {
    if (thread_.joinable()) thread_.join();
  }
  [[nodiscard]] bool done() const { return done_.load(); }
  R get() {
    thread_.join();
    return std::move(*result_);
  }

 private:
  std::optional<R> result_;
  std::atomic<bool> done_{false};
  std::thread thread_;
};

// True once pred() holds; false after `limit` of real time (a test then
// fails instead of hanging).
template <class Pred>
bool eventually(Pred pred, std::chrono::milliseconds limit = std::chrono::seconds(20)) {
  const auto give_up = std::chrono::steady_clock::now() + limit;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > give_up) return false;
    std::this_thread::yield();
  }
  return true;
}

}  // namespace keel_test
