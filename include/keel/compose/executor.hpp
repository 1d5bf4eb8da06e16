// keel/compose/executor.hpp — where fan-out units and hedge attempts run: an
// executor concept, the move-only task it runs, and the small bounded thread
// pool keel ships.
//
// keel never starts threads per request. Fan-out (keel/durable/fan_out.hpp) and
// hedging (keel/compose/hedge.hpp) hand work to an executor: any type with
//
//   absl::Status try_execute(absl::AnyInvocable<void() &&> task);
//
// OK means the executor accepted the task and will invoke it exactly once, on
// some other thread, even if it is shut down meanwhile. Any other status
// means it refused: the task was not and will not be invoked, and the status
// says why. A refusal must not block for long (a full queue refuses; it does
// not wait for room), so a caller inside a deadline is never stuck behind
// someone else's backlog.
//
// keel::bounded_pool is that executor: a fixed number of threads and a
// bounded queue of waiting tasks. When the queue is full it refuses with
// ResourceExhausted (classified throttled, marked "not started", refused by
// "executor:queue"); after shutdown it refuses with Unavailable. Its
// destructor stops accepting, runs every task already accepted, and joins
// its threads.
//
// Bring your own executor by writing an adapter with try_execute (a thread
// pool you already run, an io_context, a fiber scheduler); it must run tasks
// on threads other than the caller's, because fan-out and hedging wait for
// them.
//
// Example:
//
//   keel::bounded_pool pool({.threads = 4, .queue_capacity = 64});
//   std::atomic<int> done{0};
//   absl::Status s = pool.try_execute([&done] { ++done; });   // OK: it will run
//   static_assert(keel::executor<keel::bounded_pool>);
//
// A task is abseil's move-only `absl::AnyInvocable<void() &&>`: invoked at
// most once, as an rvalue (`std::move(task)()`). It stores callables of up
// to two pointers (16 bytes) inline; keel's own tasks fit, so submitting
// them allocates nothing. A larger capture is moved to the heap: capture one
// pointer to your state rather than several references.
//
// Thread-safety: bounded_pool::try_execute, the figures and shutdown() may be
// called from any thread, including from the pool's own tasks (a task may
// submit another; it gets a refusal rather than a deadlock when the queue is
// full). Never destroy a pool from one of its own tasks. A task is a value:
// one thread at a time.
#pragma once

#include <atomic>
#include <concepts>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "keel/core/status.hpp"

namespace keel {

// Something that runs keel's tasks on other threads. See the header comment
// for the contract of try_execute.
template <class E>
concept executor = requires(E& e, absl::AnyInvocable<void() &&> t) {
  { e.try_execute(std::move(t)) } -> std::same_as<absl::Status>;
};

struct pool_options {
  int threads = 4;          // worker threads, in [1, 1024]
  int queue_capacity = 64;  // tasks waiting for a thread, in [1, 1 << 20]

  [[nodiscard]] absl::Status validate() const {
    if (threads < 1 || threads > 1024) return detail::invalid_field("pool_options", "threads", "be in [1, 1024]", threads);
    if (queue_capacity < 1 || queue_capacity > (1 << 20))
      return detail::invalid_field("pool_options", "queue_capacity", "be in [1, 1048576]", queue_capacity);
    return absl::OkStatus();
  }
};

// A fixed set of threads and a bounded FIFO of waiting tasks.
class bounded_pool {
 public:
  // Starts the threads. Throws keel::invalid_options if `o` is invalid.
  explicit bounded_pool(const pool_options& o = {})
      : capacity_((detail::require_valid(o.validate()), static_cast<std::size_t>(o.queue_capacity))),
        thread_count_(o.threads),
        ring_(capacity_) {
    threads_.reserve(static_cast<std::size_t>(o.threads));
    try {
      for (int i = 0; i < o.threads; ++i) threads_.emplace_back([this] { work(); });
    } catch (...) {
      shutdown();  // join the threads already started before reporting the failure
      throw;
    }
  }
  bounded_pool(const bounded_pool&) = delete;
  bounded_pool& operator=(const bounded_pool&) = delete;
  ~bounded_pool() { shutdown(); }

  // Queues `task` for a worker thread, or refuses at once: ResourceExhausted
  // when queue_capacity tasks are already waiting, Unavailable after
  // shutdown. Both are marked "not started" and name the refusing limit.
  [[nodiscard]] absl::Status try_execute(absl::AnyInvocable<void() &&> task) {
    {
      std::lock_guard lock(mu_);
      if (closing_) {
        refused_.fetch_add(1, std::memory_order_relaxed);
        return with_refused_by(mark_not_started(absl::UnavailableError("keel: bounded_pool is shut down")),
                               "executor:shutdown");
      }
      if (size_ == capacity_) {
        refused_.fetch_add(1, std::memory_order_relaxed);
        return with_refused_by(mark_not_started(absl::ResourceExhaustedError(absl::StrCat(
                                   "keel: bounded_pool queue full: ", capacity_, " tasks already waiting"))),
                               "executor:queue");
      }
      ring_[(head_ + size_) % capacity_] = std::move(task);
      ++size_;
    }
    ready_.notify_one();
    return absl::OkStatus();
  }

  // Stops accepting tasks, runs every task already accepted, and joins the
  // threads. Idempotent; the destructor calls it.
  void shutdown() {
    {
      std::lock_guard lock(mu_);
      closing_ = true;
    }
    ready_.notify_all();
    // A second caller waits here until the first has joined every thread.
    std::lock_guard join(join_mu_);
    for (std::thread& t : threads_) t.join();
    threads_.clear();
  }

  [[nodiscard]] int threads() const noexcept { return thread_count_; }
  [[nodiscard]] int queue_capacity() const noexcept { return static_cast<int>(capacity_); }
  // Tasks waiting for a thread.
  [[nodiscard]] int queued() const {
    std::lock_guard lock(mu_);
    return static_cast<int>(size_);
  }
  // Tasks being run right now.
  [[nodiscard]] int running() const noexcept { return running_.load(std::memory_order_relaxed); }
  [[nodiscard]] std::int64_t completed() const noexcept { return completed_.load(std::memory_order_relaxed); }
  [[nodiscard]] std::int64_t refused() const noexcept { return refused_.load(std::memory_order_relaxed); }
  // Tasks that ended with an exception (caught so the thread survives).
  [[nodiscard]] std::int64_t threw() const noexcept { return threw_.load(std::memory_order_relaxed); }

 private:
  void work() {
    for (;;) {
      absl::AnyInvocable<void() &&> task;
      {
        std::unique_lock lock(mu_);
        ready_.wait(lock, [&] { return size_ > 0 || closing_; });
        if (size_ == 0) return;  // closing and drained
        task = std::move(ring_[head_]);
        head_ = (head_ + 1) % capacity_;
        --size_;
        running_.fetch_add(1, std::memory_order_relaxed);
      }
      try {
        std::move(task)();
      } catch (...) {
        threw_.fetch_add(1, std::memory_order_relaxed);
      }
      task = nullptr;  // destroy the callable before counting it done
      running_.fetch_sub(1, std::memory_order_relaxed);
      completed_.fetch_add(1, std::memory_order_relaxed);
    }
  }

  const std::size_t capacity_;
  const int thread_count_;
  mutable std::mutex mu_;
  std::condition_variable ready_;
  std::vector<absl::AnyInvocable<void() &&>> ring_;  // guarded by mu_
  std::size_t head_ = 0;           // guarded by mu_
  std::size_t size_ = 0;           // guarded by mu_
  bool closing_ = false;           // guarded by mu_
  std::mutex join_mu_;
  std::vector<std::thread> threads_;  // guarded by join_mu_ after construction
  std::atomic<int> running_{0};
  std::atomic<std::int64_t> completed_{0};
  std::atomic<std::int64_t> refused_{0};
  std::atomic<std::int64_t> threw_{0};
};

static_assert(executor<bounded_pool>);

}  // namespace keel
