// keel/asio/fiber.hpp — the fibers keel's asynchronous runs execute on: a
// stack of their own, switched to and from on an Asio executor, parked
// where keel's policies wait (keel/core/fiber.hpp).
//
// An asynchronous run (keel/asio/run.hpp) executes the very code of a
// synchronous one, keel's policies included, on a fiber. Where that code
// waits (a retry's backoff, a bulkhead queue, a hedge's race, the provider's
// answer) the fiber parks: it switches back to the executor, which runs
// other handlers and other fibers, until a timer of the executor, a notify
// or a stop unparks it and a posted handler switches back in. A call in
// flight costs its fiber's stack (touched pages only), not a thread.
//
// Stacks switch with Boost.Context's fcontext (a few nanoseconds a switch)
// and are pooled per thread, so a run allocates nothing once the pool holds
// enough stacks for the calls in flight. Each stack has a guard page below
// it. Switches are announced to AddressSanitizer and ThreadSanitizer.
//
// A fiber resumes only through its executor: give each thread its own
// single-threaded executor (an io_context run by one thread), as
// thread-per-core services do. A fiber moved between threads would see
// another thread's thread_local state mid-call.
//
// Example (what keel::asio::async_run does; spawn() is all most code needs):
//
//   asio::io_context io(1);
//   keel::asio::spawn(io.get_executor(), [] {
//     keel::real_clock{}.sleep_until(keel::real_clock{}.now() + std::chrono::milliseconds(5), {});  // parks
//   });
//   io.run();
//
// Thread-safety: spawn() from any thread; a fiber's park() from the fiber,
// unpark() from any thread.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <memory>
#include <new>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include <asio/any_io_executor.hpp>
#include <asio/io_context.hpp>
#include <asio/post.hpp>
#include <asio/steady_timer.hpp>
#include <boost/context/detail/fcontext.hpp>

#include "keel/core/fiber.hpp"
#include "keel/core/policy.hpp"

#if defined(__SANITIZE_ADDRESS__)
#define KEEL_FIBER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KEEL_FIBER_ASAN 1
#endif
#endif
#if defined(__SANITIZE_THREAD__)
#define KEEL_FIBER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KEEL_FIBER_TSAN 1
#endif
#endif
#ifdef KEEL_FIBER_ASAN
#include <sanitizer/common_interface_defs.h>
#endif
#ifdef KEEL_FIBER_TSAN
#include <sanitizer/tsan_interface.h>
#endif

namespace keel::asio {

namespace detail {

namespace fctx = boost::context::detail;

// Stack bytes per fiber (a guard page is added below). Sanitizers grow
// frames several times over.
#if defined(KEEL_FIBER_ASAN) || defined(KEEL_FIBER_TSAN)
inline constexpr std::size_t fiber_stack_bytes = 512 * 1024;
#else
inline constexpr std::size_t fiber_stack_bytes = 128 * 1024;
#endif

class fiber final : public keel::detail::fiber {
 public:
  // What runs on the fiber, and what its host runs once the fiber's stack
  // is no longer in use (so it may release what lives there, the fiber too).
  using body_fn = void (*)(void* arg);

  // A fiber from this thread's pool, or a new one; nullptr when no stack
  // could be mapped.
  static fiber* make(::asio::any_io_executor ex) {
    pool& p = thread_pool();
    fiber* f = nullptr;
    if (!p.free.empty()) {
      f = p.free.back();
      p.free.pop_back();
    } else {
      f = new (std::nothrow) fiber();
      if (f != nullptr && !f->map_stack()) {
        delete f;
        return nullptr;
      }
    }
    // Counted as work while the fiber lives: the executor's run() does not
    // return while a fiber waits off it (on a keel::condition another thread
    // notifies). Once, not on every copy of ex_.
    f->work_ = ::asio::prefer(ex, ::asio::execution::outstanding_work.tracked);
    f->ex_ = std::move(ex);
    f->io_ = f->ex_.target<::asio::io_context::executor_type>();
    return f;
  }

  // Carves `n` bytes aligned to `align` off the top of the stack, for what
  // the body works on (a run's operation): valid until finished.
  void* reserve(std::size_t n, std::size_t align) {
    auto top = reinterpret_cast<std::uintptr_t>(top_) - n;
    top &= ~(static_cast<std::uintptr_t>(align) - 1);
    top_ = reinterpret_cast<char*>(top);
    return top_;
  }

  // True when start(..., here = true) would run the fiber at once: this
  // thread runs the fiber's io_context, outside any fiber.
  [[nodiscard]] bool can_start_here() const noexcept {
    return keel::detail::current_fiber == nullptr && io_ != nullptr && io_->running_in_this_thread();
  }

  // Starts `body(arg)` on the fiber: at once when `here` (can_start_here()
  // must have said so), else from a handler posted to the executor.
  // `done(arg)` runs on the host after the body has returned: it must call
  // release() once it no longer needs what lives on the stack.
  void start(body_fn body, body_fn done, void* arg, bool here = false) {
    body_ = body;
    done_ = done;
    arg_ = arg;
    finished_ = false;
    state_.store(running, std::memory_order_relaxed);
    // 64 bytes below what was reserved: make_fcontext puts its own record there.
    const std::size_t usable = static_cast<std::size_t>(top_ - stack_lo_) & ~std::size_t{63};
    self_ = fctx::make_fcontext(stack_lo_ + usable, usable, &entry);
    if (here) {
      resume();
    } else {
      post_resume();
    }
  }

  [[nodiscard]] const ::asio::any_io_executor& executor() const noexcept { return ex_; }
  // The io_context executor behind executor(), or null when it is another kind.
  [[nodiscard]] const ::asio::io_context::executor_type* io_executor() const noexcept { return io_; }

  // --- keel::detail::fiber --------------------------------------------------

  void park() override {
    int s = notified;
    if (state_.compare_exchange_strong(s, running, std::memory_order_acq_rel)) return;
    switch_to_host();
  }

  void unpark() noexcept override {
    if (take_parked()) post_resume();
  }

  // Unparks from a handler that runs on this fiber's executor outside any
  // fiber: resumes it here, without a post.
  void unpark_here() {
    if (keel::detail::current_fiber != nullptr) {
      unpark();
      return;
    }
    if (take_parked()) resume();
  }

  timed_wake& wake_at(keel::detail::steady_time t) override {
    if (!timer_) timer_.emplace(ex_);  // made on first use: a run that never waits makes none
    timer_->arm(*this, t);
    return *timer_;
  }

  // The host side: switches into the fiber until it parks or finishes.
  void resume() {
    for (;;) {
      keel::detail::fiber* const outer_fiber = keel::detail::current_fiber;
      keel::detail::invocation* const outer_invocation = keel::detail::current_invocation;
      keel::detail::current_fiber = this;
      keel::detail::current_invocation = invocation_;
      enter();
      invocation_ = keel::detail::current_invocation;
      keel::detail::current_invocation = outer_invocation;
      keel::detail::current_fiber = outer_fiber;
      if (finished_) {
        done_(arg_);  // releases this fiber: nothing here touches it after
        return;
      }
      int s = running;
      if (state_.compare_exchange_strong(s, parked, std::memory_order_acq_rel)) return;
      // notified while it switched out: back in at once
      state_.store(running, std::memory_order_relaxed);
    }
  }

 private:
  enum : int { running = 0, parked = 1, notified = 2, idle = 3 };

  struct resume_op {
    fiber* f;
    void operator()() const { f->resume(); }
  };
  void post_resume() {
    if (io_ != nullptr) {
      ::asio::post(*io_, resume_op{this});
    } else {
      ::asio::post(ex_, resume_op{this});
    }
  }


  // The one timed wake a fiber may have armed: the executor's timer.
  class timer_wake final : public timed_wake {
   public:
    explicit timer_wake(const ::asio::any_io_executor& ex) : timer_(ex) {}
    void arm(fiber& f, keel::detail::steady_time t) {
      owner_ = &f;
      fired_.store(false, std::memory_order_relaxed);
      pending_ = true;
      timer_.expires_at(t);
      timer_.async_wait(on_expiry{this});
    }
    // Waits for the timer's handler, cancelled or already queued: it refers
    // to this wake, which may be reused or freed next.
    void cancel() noexcept override {
      if (!pending_) return;
      (void)timer_.cancel();
      while (pending_) owner_->park();
    }
    [[nodiscard]] bool fired() const noexcept override { return fired_.load(std::memory_order_acquire); }

   private:
    struct on_expiry {
      timer_wake* self;
      void operator()(const std::error_code& ec) const {
        self->pending_ = false;
        if (!ec) self->fired_.store(true, std::memory_order_release);
        self->owner_->unpark_here();
      }
    };
    ::asio::steady_timer timer_;
    fiber* owner_ = nullptr;
    std::atomic<bool> fired_{false};
    bool pending_ = false;  // a wait is outstanding (on the executor's thread only)
  };

  struct pool {
    std::vector<fiber*> free;
    pool() = default;
    pool(const pool&) = delete;
    pool& operator=(const pool&) = delete;
    ~pool() {
      for (fiber* f : free) delete f;
    }
  };
  static pool& thread_pool() {
    thread_local pool p;
    return p;
  }
  static constexpr std::size_t kept_per_thread = 256;

  fiber() = default;
  fiber(const fiber&) = delete;
  fiber& operator=(const fiber&) = delete;
  ~fiber() {
    timer_.reset();
    if (map_ != nullptr) ::munmap(map_, map_bytes_);
#ifdef KEEL_FIBER_TSAN
    if (tsan_fiber_ != nullptr) __tsan_destroy_fiber(tsan_fiber_);
#endif
  }

  bool map_stack() {
    const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    map_bytes_ = fiber_stack_bytes + page;
    void* m = ::mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
    if (m == MAP_FAILED) return false;
    map_ = m;
    (void)::mprotect(map_, page, PROT_NONE);  // the guard page
    stack_lo_ = static_cast<char*>(map_) + page;
    top_ = stack_lo_ + fiber_stack_bytes;
#ifdef KEEL_FIBER_TSAN
    tsan_fiber_ = __tsan_create_fiber(0);
#endif
    return true;
  }

 public:
  // Back to this thread's pool (or freed); from the host, once the body's
  // stack is no longer needed.
  void release() {
    state_.store(idle, std::memory_order_release);
    timer_.reset();  // its executor may not outlive the pool
    top_ = stack_lo_ + fiber_stack_bytes;
    invocation_ = nullptr;
    io_ = nullptr;
    ex_ = {};
    work_ = {};
    pool& p = thread_pool();
    if (p.free.size() < kept_per_thread) {
      p.free.push_back(this);
    } else {
      delete this;
    }
  }

 private:
  // Unparked -> running, by whoever wins; true when the caller must resume it.
  bool take_parked() noexcept {
    int s = state_.load(std::memory_order_acquire);
    for (;;) {
      if (s == parked) {
        if (state_.compare_exchange_weak(s, running, std::memory_order_acq_rel)) return true;
      } else if (s == running) {
        if (state_.compare_exchange_weak(s, notified, std::memory_order_acq_rel)) return false;
      } else {
        return false;  // a permit is pending, or the fiber is idle
      }
    }
  }

  // --- switching ------------------------------------------------------------

  void enter() {
#ifdef KEEL_FIBER_TSAN
    host_tsan_ = __tsan_get_current_fiber();
    __tsan_switch_to_fiber(tsan_fiber_, 0);
#endif
#ifdef KEEL_FIBER_ASAN
    void* host_fake = nullptr;
    __sanitizer_start_switch_fiber(&host_fake, stack_lo_, fiber_stack_bytes);
#endif
    const fctx::transfer_t t = fctx::jump_fcontext(self_, this);
#ifdef KEEL_FIBER_ASAN
    __sanitizer_finish_switch_fiber(host_fake, nullptr, nullptr);
#endif
    self_ = t.fctx;
  }

  void switch_to_host() {
#ifdef KEEL_FIBER_TSAN
    __tsan_switch_to_fiber(host_tsan_, 0);
#endif
#ifdef KEEL_FIBER_ASAN
    __sanitizer_start_switch_fiber(finished_ ? nullptr : &fake_stack_, host_stack_lo_, host_stack_size_);
#endif
    const fctx::transfer_t t = fctx::jump_fcontext(host_, nullptr);
    host_ = t.fctx;
#ifdef KEEL_FIBER_ASAN
    __sanitizer_finish_switch_fiber(fake_stack_, &host_stack_lo_, &host_stack_size_);
#endif
  }

  static void entry(fctx::transfer_t t) {
    auto* self = static_cast<fiber*>(t.data);
    self->host_ = t.fctx;
#ifdef KEEL_FIBER_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &self->host_stack_lo_, &self->host_stack_size_);
#endif
    for (;;) {  // a fiber's stack is made afresh for each body: this runs once per start()
      self->body_(self->arg_);
      self->finished_ = true;
      self->switch_to_host();
    }
  }

  ::asio::any_io_executor ex_;
  ::asio::any_io_executor work_;  // ex_, tracked
  // ex_'s io_context executor, when it is one: posted to without the
  // type-erased wrapper's conversions (a third of a run's cost otherwise).
  const ::asio::io_context::executor_type* io_ = nullptr;
  std::atomic<int> state_{idle};
  fctx::fcontext_t self_ = nullptr;  // the fiber, while it is switched out
  fctx::fcontext_t host_ = nullptr;  // its host, while it runs
  body_fn body_ = nullptr;
  body_fn done_ = nullptr;
  void* arg_ = nullptr;
  bool finished_ = false;
  keel::detail::invocation* invocation_ = nullptr;  // the fiber's, kept across switches
  std::optional<timer_wake> timer_;
  void* map_ = nullptr;
  std::size_t map_bytes_ = 0;
  char* stack_lo_ = nullptr;
  char* top_ = nullptr;
#ifdef KEEL_FIBER_ASAN
  void* fake_stack_ = nullptr;
  const void* host_stack_lo_ = nullptr;
  std::size_t host_stack_size_ = 0;
#endif
#ifdef KEEL_FIBER_TSAN
  void* tsan_fiber_ = nullptr;
  void* host_tsan_ = nullptr;
#endif
};

// The keel::asio fiber running on this thread, if any.
[[nodiscard]] inline fiber* current_asio_fiber() noexcept {
  // Every keel::detail::fiber is one of these: keel::asio is its only host.
  return static_cast<fiber*>(keel::detail::current_fiber);
}

template <class Fn>
struct spawned {
  Fn fn;
  fiber* f;
  static void body(void* self) { static_cast<spawned*>(self)->fn(); }
  static void done(void* self) {
    fiber* const f = static_cast<spawned*>(self)->f;
    static_cast<spawned*>(self)->~spawned();
    f->release();
  }
};

}  // namespace detail

// The executor of the keel::asio fiber running on this thread, or null off
// any fiber: where what a fiber starts (an HTTP transfer, a timer) belongs.
[[nodiscard]] inline const ::asio::any_io_executor* current_executor() noexcept {
  const detail::fiber* f = detail::current_asio_fiber();
  return f != nullptr ? &f->executor() : nullptr;
}

// Runs `fn()` on a new fiber on `ex`. false when no stack could be mapped
// (fn is then not run). What fn captures lives on the fiber's stack.
template <class Fn>
bool spawn(::asio::any_io_executor ex, Fn fn) {
  detail::fiber* f = detail::fiber::make(std::move(ex));
  if (f == nullptr) return false;
  using S = detail::spawned<Fn>;
  auto* s = ::new (f->reserve(sizeof(S), alignof(S))) S{std::move(fn), f};
  f->start(&S::body, &S::done, s);
  return true;
}

}  // namespace keel::asio
