// keel/compose/cut_at_deadline.hpp — deadlines that cut: the pipeline
// policy that stops what runs below it at its deadline, on keel's timer
// (keel/core/timer.hpp).
//
// Without it every keel timeout is cooperative: a provider that watches its
// stop token but not its timeout spends the whole call, and hedges,
// fallbacks and fan-outs wait for it. With it, the attempt's stop token is
// requested at the attempt's deadline, and an adapter that turns a stop
// into an aborted transfer (libcurl, gRPC's TryCancel) returns at once.
//
//   - keel::cut_at_deadline(timer) is a policy: what runs below it gets a
//     plan.stop that fires at plan.deadline, linked to the caller's stop
//     token (a std::stop_callback, no allocation). Below a retry it cuts
//     each attempt at the attempt's deadline; first in the pipeline it cuts
//     the whole pass at the call's work deadline. An attempt that was cut
//     and answered "cancelled" is reported as DeadlineExceeded ("keel: cut
//     at its deadline: ..."), a timeout (transient for a read, ambiguous for
//     a write unless it says it was not started), never as the caller going
//     away: a retry, a fallback and a fan-out treat it as the timeout it is.
//   - keel::hedge (hedge_options::cut), keel::fallback (fallback_options::cut)
//     and keel::fan_out (fan_out_options::cut) cut their attempts, primaries
//     and units the same way: each arms a keel::deadline_cut and reads the
//     answer through its settle(), the one conversion.
//
// Example:
//
//   keel::deadline_timer timer;   // real clock; one thread
//   auto pipe = keel::pipeline(keel::time_limit({.at_most = std::chrono::milliseconds(800)}),
//                              keel::retry({.max_attempts = 2}), keel::cut_at_deadline(timer));
//   keel::call call(keel::real_clock{}.now(), {.timeout = std::chrono::seconds(2)});
//   absl::StatusOr<int> r = pipe.run(call, [](const keel::attempt& a) -> absl::StatusOr<int> {
//     std::mutex m;
//     keel::condition cv;
//     std::unique_lock lock(m);
//     cv.wait(lock, a.stop, [] { return false; });  // watches only its stop token
//     return absl::CancelledError("stopped");       // r: DeadlineExceeded after two cut attempts
//   });
//
// The stop token below a cut_at_deadline belongs to the attempt: its
// stop_source is kept per thread and reused by the next attempt on that
// thread when it was not stopped (a fresh one is allocated only after a
// cut or a cancellation). A provider must not keep the token, or a
// std::stop_callback on it, past its return.
//
// Thread-safety: a cut_at_deadline is shared by any number of calls at
// once; the timer must outlive the pipelines that use it.
#pragma once

#include <array>
#include <optional>
#include <stop_token>
#include <utility>

#include "keel/core/policy.hpp"
#include "keel/core/timer.hpp"

namespace keel {

namespace detail {

// Forwards the caller's stop to an attempt's own stop source.
struct forward_stop_to {
  std::stop_source* target;
  void operator()() const noexcept { target->request_stop(); }
};

// This thread's reusable stop sources, one per level of nesting in use: an
// attempt's source is reused by the next one unless it was stopped.
struct stop_source_pool {
  static constexpr int levels = 4;
  std::array<std::stop_source, levels> sources{std::stop_source(std::nostopstate), std::stop_source(std::nostopstate),
                                               std::stop_source(std::nostopstate), std::stop_source(std::nostopstate)};
  int depth = 0;
};

class stop_source_lease {
 public:
  stop_source_lease() {
    stop_source_pool& p = pool();
    if (p.depth < stop_source_pool::levels) {
      source_ = &p.sources[static_cast<std::size_t>(p.depth++)];
      if (!source_->stop_possible() || source_->stop_requested()) *source_ = std::stop_source();
    } else {
      own_.emplace();  // deeper than the pool: a fresh one
      source_ = &*own_;
    }
  }
  ~stop_source_lease() {
    if (!own_) --pool().depth;
  }
  stop_source_lease(const stop_source_lease&) = delete;
  stop_source_lease& operator=(const stop_source_lease&) = delete;

  [[nodiscard]] std::stop_source& source() noexcept { return *source_; }

 private:
  static stop_source_pool& pool() noexcept {
    thread_local stop_source_pool p;
    return p;
  }
  std::stop_source* source_ = nullptr;
  std::optional<std::stop_source> own_;
};

// Runs `fn(ctx, plan')` where plan'.stop is requested at plan.deadline (or
// when plan.stop is): the body of keel::cut_at_deadline, also used by
// fallback for its primary and alternatives.
template <class Ctx, class Fn>
auto run_cut(deadline_timer_base& timer, Ctx& ctx, const attempt_plan& plan, Fn&& fn) -> decltype(fn(ctx, plan)) {
  if (plan.deadline.is_infinite()) return fn(ctx, plan);
  stop_source_lease lease;
  std::stop_source& mine = lease.source();
  std::optional<std::stop_callback<forward_stop_to>> link;
  if (plan.stop.stop_possible()) link.emplace(plan.stop, forward_stop_to{&mine});
  deadline_cut cut(timer, plan.deadline, mine);
  const std::stop_token mine_token = mine.get_token();  // what plan.stop refers to below
  const stop_ref caller = plan.stop;
  return cut.settle(fn(ctx, attempt_plan{.now = plan.now, .deadline = plan.deadline, .stop = mine_token, .hedge = plan.hedge}),
                    caller, [&](const absl::Status& s) { return ctx.classify(s); });
}

}  // namespace detail

// The policy: what runs below it is stopped at plan.deadline (see the top
// of this header). Holds the timer by pointer; the timer must outlive the
// pipelines that use it.
class cut_at_deadline {
 public:
  explicit cut_at_deadline(deadline_timer_base& timer) noexcept : timer_(&timer) {}

  template <class Ctx, class Next>
  auto execute(Ctx& ctx, const attempt_plan& plan, Next& next) const -> decltype(next(ctx, plan)) {
    return detail::run_cut(*timer_, ctx, plan, next);
  }

 private:
  deadline_timer_base* timer_;
};

}  // namespace keel
