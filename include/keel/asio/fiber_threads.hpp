// keel/asio/fiber_threads.hpp — a fixed set of threads for fibers, one
// single-threaded io_context each, as thread-per-core services run them.
//
// A fiber resumes only on the executor it started on (keel/asio/fiber.hpp),
// so a service that wants more than one core for its calls runs several
// io_contexts, each on its own thread, and spreads new calls over them.
// fiber_threads is that: spawn() starts a fiber on the next thread in turn;
// here() is the io_context of the calling thread, so that what a fiber
// starts (an HTTP transfer on keel::asio::http_client, a hedge's attempt)
// stays on its own thread. Per-thread things (one HTTP client per loop)
// index by index_here().
//
// Example:
//
//   keel::asio::fiber_threads fibers({.threads = 2});
//   fibers.spawn([] { /* a synchronous keel call: it parks where it waits */ });
//   ...
//   fibers.stop();  // or the destructor: waits for the fibers to finish
//
// Thread-safety: spawn(), size(), context() and here() from any thread;
// stop() from one controlling thread, not from one of these threads.
#pragma once

#include <pthread.h>

#include <atomic>
#include <cstddef>
#include <memory>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include <asio/executor_work_guard.hpp>
#include <asio/io_context.hpp>

#include "absl/status/status.h"
#include "keel/asio/fiber.hpp"
#include "keel/core/status.hpp"

namespace keel::asio {

struct fiber_threads_options {
  int threads = 2;  // each runs one io_context; fibers never move between them

  [[nodiscard]] absl::Status validate() const {
    if (threads < 1 || threads > 1024) return invalid_option("fiber_threads_options", "threads", "be in [1, 1024]", threads);
    return absl::OkStatus();
  }
};

class fiber_threads {
 public:
  // Throws keel::invalid_options if `o` is invalid. The threads start here.
  explicit fiber_threads(fiber_threads_options o) {
    require_valid_options(o.validate());
    loops_.reserve(static_cast<std::size_t>(o.threads));
    for (int i = 0; i < o.threads; ++i) loops_.push_back(std::make_unique<loop>());
    for (std::size_t i = 0; i < loops_.size(); ++i) {
      loop& l = *loops_[i];
      l.thread = std::thread([&l, i] {
        index_ = static_cast<int>(i);
        l.io.run();
        index_ = -1;
      });
      ::pthread_setname_np(l.thread.native_handle(), "keel-fiber");  // for top -H and /proc/PID/task/*/comm
    }
  }

  fiber_threads(const fiber_threads&) = delete;
  fiber_threads& operator=(const fiber_threads&) = delete;
  ~fiber_threads() { stop(); }

  [[nodiscard]] int size() const noexcept { return static_cast<int>(loops_.size()); }
  [[nodiscard]] ::asio::io_context& context(int i) noexcept { return loops_[static_cast<std::size_t>(i)]->io; }

  // The index of the calling thread among these, or -1 for any other thread.
  // (One set of fiber_threads per process is what this tells apart.)
  [[nodiscard]] static int index_here() noexcept { return index_; }

  // Starts `fn()` on a new fiber on the next thread in turn. false when
  // stopped or no stack could be mapped (fn is then not run).
  template <class Fn>
  bool spawn(Fn fn) {
    if (stopped_.load(std::memory_order_acquire)) return false;
    const std::size_t i = next_.fetch_add(1, std::memory_order_relaxed) % loops_.size();
    return keel::asio::spawn(loops_[i]->io.get_executor(), std::move(fn));
  }

  // Lets every thread finish what it holds (fibers included), then joins
  // them. Idempotent.
  void stop() {
    if (stopped_.exchange(true)) return;
    for (auto& l : loops_) l->guard.reset();
    for (auto& l : loops_) {
      if (l->thread.joinable()) l->thread.join();
    }
  }

 private:
  struct loop {
    ::asio::io_context io{1};
    std::optional<::asio::executor_work_guard<::asio::io_context::executor_type>> guard{io.get_executor()};
    std::thread thread;
  };

  static inline thread_local int index_ = -1;
  std::vector<std::unique_ptr<loop>> loops_;
  std::atomic<std::size_t> next_{0};
  std::atomic<bool> stopped_{false};
};

}  // namespace keel::asio
