// keel/asio/run.hpp — a keel pipeline run that completes through an Asio
// completion token: the same policies, no thread held per call.
//
// keel::asio::async_run(ex, pipeline, call, provider, token) runs
// `pipeline.run(call, ...)` on a fiber on `ex` (keel/asio/fiber.hpp) and
// completes `token` with the result: a callback, asio::use_future, or
// asio::use_awaitable in a coroutine. The pipeline is the one a synchronous
// service builds (keel/compose/pipeline.hpp), its policies unchanged: where
// one waits (a retry's backoff, a bulkhead queue, a hedge's race) the fiber
// parks on the executor's timers instead of sleeping a thread.
//
// The provider is asynchronous: a copyable callable with
//
//   using result_type = R;   // absl::Status or absl::StatusOr<T>
//   template <class CompletionToken>
//   auto operator()(const keel::attempt& a, CompletionToken&& token);   // completes with void(R)
//
// (asio::async_initiate<CompletionToken, void(R)> makes one from any
// operation). It completes once, never inline, and honours the handler's
// cancellation slot: a deadline cut, a hedge's loser, a stopped call or a
// cancelled run emit on it (terminal), so the upstream operation stops at
// once. `a` is valid until it completes.
//
// Cancellation both ways: a cancellation slot bound to `token` (a parallel
// group, `||` on awaitables, asio::bind_cancellation_slot) stops the call (its
// stop token is requested; every policy sees it), and a stop of the call's
// token cancels the provider's operation through its slot.
//
// Example (inside an asio::awaitable<void> coroutine):
//
//   keel::retry_budget budget({.ratio = 0.1, .min_per_second = 5});
//   static const auto pipe = keel::pipeline(keel::retry({.max_attempts = 3, .budget = &budget}));
//   keel::call call(keel::real_clock{}.now(), {.timeout = std::chrono::seconds(2)});
//   absl::StatusOr<std::string> answer =
//       co_await keel::asio::async_run(ex, pipe, call, model, asio::use_awaitable);
//
// The pipeline, the call and what the provider refers to must outlive the
// run (a hedge's losers: see keel/compose/hedge.hpp). The run allocates
// nothing of its own once the thread's fiber pool holds a stack for each
// call in flight; the executor's post of the first switch and the
// provider's own operation are what Asio allocates (recycled per thread).
//
// Thread-safety: async_run from any thread; the call belongs to its run
// until the run completes.
#pragma once

#include <atomic>
#include <concepts>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <stop_token>
#include <type_traits>
#include <utility>

#include <asio/any_io_executor.hpp>
#include <asio/associated_cancellation_slot.hpp>
#include <asio/associated_executor.hpp>
#include <asio/async_result.hpp>
#include <asio/cancellation_signal.hpp>
#include <asio/cancellation_type.hpp>
#include <asio/dispatch.hpp>
#include <asio/io_context.hpp>
#include <asio/post.hpp>

#include "absl/status/status.h"
#include "keel/asio/fiber.hpp"
#include "keel/core/call.hpp"
#include "keel/core/policy.hpp"

namespace keel {
class stream_writer;  // keel/compose/stream.hpp: only a streamed provider needs it whole
}  // namespace keel

namespace keel::asio {

// A provider whose attempts complete through an Asio completion token.
template <class P>
concept async_provider = std::copy_constructible<P> && result<typename P::result_type>;

namespace detail {

template <class P>
struct declared_operation {};
template <class P>
  requires keel::declares_operation<P>
struct declared_operation<P> {
  static constexpr keel::operation operation = keel::declared_provider_t<P>::operation;
};

// One attempt's wait for the provider's answer, on the attempt's fiber (or,
// off any fiber, on its thread).
template <class R>
struct attempt_wait {
  fiber* f = nullptr;  // null: a plain thread waits on `cv`
  const ::asio::any_io_executor* ex = nullptr;  // where the operation completes
  std::optional<R> result;
  ::asio::cancellation_signal cancel;
  std::atomic<bool> stop_asked{false};
  bool emitted = false;
  // off a fiber (std::condition_variable: no allocation, unlike _any's)
  std::mutex mu;
  std::condition_variable cv;
};

// The completion handler the provider's operation gets: the fiber's
// executor, and a cancellation slot the attempt's stop emits on.
// One pointer: what the operation stores and posts stays small, so Asio's
// per-thread recycling of handler memory serves it.
template <class R>
struct answer_handler {
  attempt_wait<R>* w;

  using executor_type = ::asio::any_io_executor;
  [[nodiscard]] executor_type get_executor() const noexcept { return *w->ex; }
  using cancellation_slot_type = ::asio::cancellation_slot;
  [[nodiscard]] cancellation_slot_type get_cancellation_slot() const noexcept { return w->cancel.slot(); }

  void operator()(R r) {
    attempt_wait<R>& me = *w;
    if (me.f != nullptr) {
      me.result.emplace(std::move(r));
      // Completed on the attempt's own fiber (a dispatch from inside it): it
      // has not parked, and finds the result without a switch.
      if (keel::detail::current_fiber != me.f) me.f->unpark_here();
      return;
    }
    std::lock_guard lock(me.mu);
    me.result.emplace(std::move(r));
    me.cv.notify_all();
  }
};

}  // namespace detail

// The synchronous face of an asynchronous provider, the one a pipeline
// calls: it starts the operation and parks the attempt's fiber until it
// completes; off a fiber (a plain thread, a synchronous run) the thread
// waits, and `ex` runs the operation. Copied into a hedge's race with the
// provider it owns.
template <class Provider>
class awaited_provider : public detail::declared_operation<Provider> {
 public:
  using R = typename Provider::result_type;

  awaited_provider(Provider p, ::asio::any_io_executor ex) : provider_(std::move(p)), ex_(std::move(ex)) {}

  R operator()(const keel::attempt& a) {
    return wait(a, [&](detail::answer_handler<R> h) { provider_(a, std::move(h)); });
  }

  // A streamed provider (keel::asio::http_client::stream): the writer is fed
  // where the operation runs, on the executor, while this attempt waits.
  R operator()(const keel::attempt& a, stream_writer& out)
    requires std::invocable<Provider&, const keel::attempt&, stream_writer&, detail::answer_handler<R>>
  {
    return wait(a, [&](detail::answer_handler<R> h) { provider_(a, out, std::move(h)); });
  }

 private:
  template <class Start>
  R wait(const keel::attempt& a, Start start) {
    detail::attempt_wait<R> w;
    w.f = detail::current_asio_fiber();
    w.ex = w.f != nullptr ? &w.f->executor() : &ex_;
    start(detail::answer_handler<R>{&w});
    if (w.f != nullptr) {
      std::optional<std::stop_callback<on_stop>> stop;
      if (a.stop.stop_possible()) stop.emplace(a.stop, on_stop{&w});
      while (!w.result) {
        // The slot's handler belongs to the executor: emitted from the fiber, there.
        if (!w.emitted && w.stop_asked.load(std::memory_order_acquire)) {
          w.emitted = true;
          if (w.cancel.slot().has_handler()) w.cancel.emit(::asio::cancellation_type::terminal);
          continue;
        }
        w.f->park();
      }
      return std::move(*w.result);
    }
    // Off a fiber (a hedge on a thread pool): this thread waits, and a stop
    // is emitted on the executor.
    std::optional<std::stop_callback<post_cancel>> stop;
    if (a.stop.stop_possible()) stop.emplace(a.stop, post_cancel{&w, ex_});
    std::unique_lock lock(w.mu);
    w.cv.wait(lock, [&] { return w.result.has_value(); });
    lock.unlock();
    stop.reset();
    return std::move(*w.result);
  }

  struct on_stop {
    detail::attempt_wait<R>* w;
    void operator()() const noexcept {
      w->stop_asked.store(true, std::memory_order_release);
      w->f->unpark();
    }
  };
  // Emits on the executor and waits for it there, so `w` outlives the
  // emission (the attempt's thread is blocked in operator() meanwhile). A
  // stop requested on the executor's own thread would wait for itself: off
  // a fiber, stop an attempt from another thread (a deadline timer, a
  // hedge's pool thread, the caller).
  struct post_cancel {
    detail::attempt_wait<R>* w;
    ::asio::any_io_executor ex;
    void operator()() const {
      std::mutex m;
      std::condition_variable cv;
      bool emitted = false;
      ::asio::post(ex, [&] {
        std::lock_guard lock(w->mu);
        if (!w->result && w->cancel.slot().has_handler()) w->cancel.emit(::asio::cancellation_type::terminal);
        std::lock_guard l(m);
        emitted = true;
        cv.notify_all();
      });
      std::unique_lock l(m);
      cv.wait(l, [&] { return emitted; });
    }
  };

  Provider provider_;
  ::asio::any_io_executor ex_;
};

template <async_provider Provider>
[[nodiscard]] awaited_provider<Provider> awaited(Provider p, ::asio::any_io_executor ex) {
  return {std::move(p), std::move(ex)};
}

namespace detail {

// A run in flight: lives at the top of its fiber's stack.
template <class Pipeline, class Provider, class Handler>
struct run_op {
  using R = typename Provider::result_type;

  struct forward_stop {
    std::stop_source* to;
    void operator()() const noexcept { to->request_stop(); }
  };
  struct on_cancel {
    std::stop_source* to;
    void operator()(::asio::cancellation_type) const noexcept { to->request_stop(); }
  };

  run_op(const Pipeline& p, keel::call& c, Provider pr, Handler h, fiber* fb)
      : pipe(p), call(c), provider(std::move(pr), fb->executor()), handler(std::move(h)), f(fb) {}

  const Pipeline& pipe;
  keel::call& call;
  awaited_provider<Provider> provider;
  Handler handler;
  fiber* f;
  std::optional<R> result;
  bool* initiating = nullptr;  // while async_run has not returned: set when the run ends
  // A cancellation slot on the handler stops the call: through a source of
  // the run's own, linked to the call's token (`outer`, restored after).
  std::optional<std::stop_source> stop;
  std::stop_token outer;
  std::optional<std::stop_callback<forward_stop>> link;

  static void body(void* self) {
    auto& op = *static_cast<run_op*>(self);
    op.result.emplace(op.pipe.run(op.call, op.provider));
  }

  // On the host once the body has returned: the completion runs next (here,
  // or posted when async_run has not returned yet); it takes the handler and
  // the result out of the op, which stays on the fiber's stack until then.
  static void done(void* self) {
    auto* op = static_cast<run_op*>(self);
    fiber* const f = op->f;
    if (op->stop) {
      op->call.stop_with(op->outer);
      auto slot = ::asio::get_associated_cancellation_slot(op->handler);
      if (slot.is_connected()) slot.clear();
    }
    const bool initiating = op->initiating != nullptr;
    if (initiating) *op->initiating = true;
    // A handler without an executor of its own runs on the run's: on its
    // io_context's executor directly when it is one (no type erasure).
    using own_executor = ::asio::associated_executor_t<Handler, no_executor>;
    if constexpr (std::is_same_v<own_executor, no_executor>) {
      if (const ::asio::io_context::executor_type* io = f->io_executor()) {
        complete(*io, initiating, completion(op));
        return;
      }
    }
    complete(::asio::get_associated_executor(op->handler, f->executor()), initiating, completion(op));
  }

  // A marker: the handler has no associated executor of its own.
  struct no_executor {};

  template <class Executor, class Completion>
  static void complete(const Executor& ex, bool initiating, Completion c) {
    if (initiating) {
      ::asio::post(ex, std::move(c));  // never inside async_run
    } else {
      ::asio::dispatch(ex, std::move(c));
    }
  }

  // Owns the finished op (and its fiber) until it runs or is destroyed
  // unrun (an io_context destroyed with it queued).
  class completion {
   public:
    explicit completion(run_op* op) noexcept : op_(op) {}
    completion(completion&& o) noexcept : op_(std::exchange(o.op_, nullptr)) {}
    completion& operator=(completion&&) = delete;
    ~completion() {
      if (op_ != nullptr) finish(op_);
    }
    void operator()() {
      run_op* const op = std::exchange(op_, nullptr);
      Handler h = std::move(op->handler);
      std::optional<R> r = std::move(op->result);
      finish(op);
      std::move(h)(std::move(*r));
    }

   private:
    static void finish(run_op* op) {
      fiber* const f = op->f;
      op->~run_op();
      f->release();
    }
    run_op* op_;
  };
};

}  // namespace detail

// Runs `provider` through `pipeline` for `call` on a fiber on `ex`; completes
// `token` with the provider's result type. See the header comment.
template <class Pipeline, async_provider Provider, class CompletionToken>
auto async_run(::asio::any_io_executor ex, const Pipeline& pipeline, keel::call& call, Provider provider,
               CompletionToken&& token) {
  using R = typename Provider::result_type;
  return ::asio::async_initiate<CompletionToken, void(R)>(
      [&pipeline, &call](auto handler, ::asio::any_io_executor ex, Provider provider) {
        using Handler = decltype(handler);
        using Op = detail::run_op<Pipeline, Provider, Handler>;
        detail::fiber* f = detail::fiber::make(ex);
        if (f == nullptr) {
          const auto hex = ::asio::get_associated_executor(handler, ex);
          ::asio::post(hex, [h = std::move(handler)]() mutable {
            std::move(h)(R(absl::ResourceExhaustedError("keel::asio: no stack could be mapped for the run's fiber")));
          });
          return;
        }
        auto* op = ::new (f->reserve(sizeof(Op), alignof(Op))) Op(pipeline, call, std::move(provider), std::move(handler), f);
        auto slot = ::asio::get_associated_cancellation_slot(op->handler);
        if (slot.is_connected()) {
          op->stop.emplace();
          op->outer = call.stop_token();
          if (op->outer.stop_possible()) op->link.emplace(op->outer, typename Op::forward_stop{&*op->stop});
          call.stop_with(op->stop->get_token());
          slot.template emplace<typename Op::on_cancel>(typename Op::on_cancel{&*op->stop});
        }
        // A run that ends before this returns (a refusal) completes through
        // a post: never inside async_run.
        // Started at once when this thread runs the executor, else posted
        // (and then op belongs to the executor's thread from here on).
        const bool here = f->can_start_here();
        bool ended = false;
        if (here) op->initiating = &ended;
        f->start(&Op::body, &Op::done, op, here);
        if (here && !ended) op->initiating = nullptr;
      },
      token, std::move(ex), std::move(provider));
}

}  // namespace keel::asio
