// keel/policy/retry.hpp — classified, bounded, budgeted retries.
//
// keel::retry tries again only what may be tried again (keel/core/outcome.hpp:
// transient and throttled results, ambiguous ones only for repeatable
// operations, and, with wait_out_refusals, keel's own refusals that say when
// to come back, after that wait), and bounds repetition three ways:
//
//   - attempts per layer (retry_options::max_attempts);
//   - the call's attempt cap, shared by every nested layer (keel::call), so
//     three attempts inside three attempts stay three provider calls;
//   - a service-wide keel::retry_budget, when the options name one; the
//     call deposits one request into it however many layers share it.
//
// Between attempts it waits the provider's retry-after hint when there is
// one, otherwise a delay from its backoff strategy (full jitter by default).
// Every wait is clipped to the deadline: a retry whose wait would leave less
// than `min_attempt_time` is not started, and the caller gets the last
// error annotated with why the retries stopped.
//
// Example:
//
//   keel::retry_budget budget({.ratio = 0.1});
//   keel::retry r({.max_attempts = 3, .budget = &budget, .min_attempt_time = std::chrono::milliseconds(500)},
//                 keel::full_jitter{.base = std::chrono::milliseconds(100), .cap = std::chrono::seconds(1)});
//   auto pipe = keel::pipeline(r);   // keel/compose/pipeline.hpp
//
// Events (keel/core/telemetry.hpp): events::retry_scheduled before each wait,
// events::retry_stopped with the reason when the layer gives up.
//
// Thread-safety: execute() is const and may run for many calls at once; the
// budget is lock-free; the random source must be thread-safe (the default
// one is).
#pragma once

#include <chrono>
#include <optional>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "keel/core/call.hpp"
#include "keel/core/outcome.hpp"
#include "keel/core/policy.hpp"
#include "keel/core/status.hpp"
#include "keel/core/telemetry.hpp"
#include "keel/policy/backoff.hpp"
#include "keel/policy/events.hpp"
#include "keel/policy/retry_budget.hpp"

namespace keel {

struct retry_options {
  // Attempts made by this layer, the first included; >= 1.
  int max_attempts = 3;
  // Service-wide budget this layer spends from; null: no budget.
  keel::retry_budget* budget = nullptr;
  // Wait what a throttled provider asks for instead of the drawn delay.
  bool honour_retry_after = true;
  // A keel refusal from a stage inside this layer (an open breaker, the
  // shared quota) ends the retries at once by default: the caller hears its
  // retry-after and a fallback outside serves now, instead of every waiting
  // call spending its deadline on the breaker's cooldown. Set this to wait
  // out a refusal's hint, when it fits the deadline, and try again.
  bool wait_out_refusals = false;
  // A provider asking for a longer wait ends the retries; >= 0.
  duration max_retry_after = std::chrono::seconds(30);
  // Do not start an attempt with less time left than this; >= 0.
  duration min_attempt_time = duration::zero();

  [[nodiscard]] absl::Status validate() const {
    if (max_attempts < 1) return detail::invalid_field("retry_options", "max_attempts", "be >= 1", max_attempts);
    if (max_retry_after < duration::zero())
      return detail::invalid_field("retry_options", "max_retry_after", "be >= 0", max_retry_after);
    if (min_attempt_time < duration::zero())
      return detail::invalid_field("retry_options", "min_attempt_time", "be >= 0", min_attempt_time);
    return absl::OkStatus();
  }
};

template <keel::backoff Backoff = full_jitter, keel::random_source Random = thread_local_random>
class retry {
 public:
  // Throws keel::invalid_options if the options or the backoff are invalid.
  explicit retry(const retry_options& o = {}, Backoff b = {}, Random r = {})
      : options_(o), backoff_(std::move(b)), random_(std::move(r)) {
    detail::require_valid(o.validate());
    detail::require_valid(backoff_.validate());
  }

  [[nodiscard]] const retry_options& options() const noexcept { return options_; }

  template <class Ctx, class Next>
  auto execute(Ctx& ctx, const attempt_plan& plan, Next& next) const -> decltype(next(ctx, plan)) {
    // Once per call: an outer layer or a hedge sharing the budget may have paid.
    if (options_.budget != nullptr) options_.budget->record_request(ctx.call, plan.now);
    // The first attempt inline, the retries out of line: one return of one
    // local, so the result is built in place (no move of a StatusOr).
    decltype(next(ctx, plan)) r = next(ctx, plan);
    if (!status_of(r).ok()) [[unlikely]] after_failure(ctx, plan, next, r);
    return r;
  }

 private:
  // Decides on `r`, the failed result of an attempt that started at
  // first.now, and retries while it may: `r` ends as the answer.
  template <class Ctx, class Next, class R>
  [[gnu::noinline]] void after_failure(Ctx& ctx, const attempt_plan& first, Next& next, R& r) const {
    attempt_plan plan = first;
    duration previous = duration::zero();
    using stop = events::retry_stopped::reason;
    auto stopped = [&](stop why) { observe(ctx.listener, events::retry_stopped{ctx.call, why, status_of(r)}); };
    for (int k = 0;; ++k) {
      const absl::Status& s = status_of(r);
      if (s.ok()) return;
      const outcome_kind kind = ctx.classify(s);
      if (kind == outcome_kind::cancelled) return stopped(stop::cancelled);
      if (kind == outcome_kind::refused && !options_.wait_out_refusals) return stopped(stop::not_retryable);
      if (!retryable(s, kind, ctx.call.operation())) return stopped(stop::not_retryable);
      if (k + 1 >= options_.max_attempts) return stopped(stop::layer_attempts);
      if (ctx.call.attempts_exhausted()) return stopped(stop::call_attempts);
      if (plan.stop.stop_requested()) return stopped(stop::cancelled);

      // A refusal is retried only by its own hint (retryable() checked it has one).
      std::optional<duration> hint =
          options_.honour_retry_after || kind == outcome_kind::refused ? retry_after(s) : std::nullopt;
      if (hint && *hint > options_.max_retry_after) {
        r = R(annotate(s, absl::StrCat("keel: not retrying: asked to wait ", detail::describe(*hint),
                                       ", more than max_retry_after ", detail::describe(options_.max_retry_after))));
        return stopped(stop::hint_too_long);
      }
      const duration wait = hint ? *hint : backoff_.delay(k, previous, random_);
      previous = wait;

      const time_point now = ctx.attempt_end(plan.now);  // read once, shared with the policies inside
      const duration left = plan.deadline.remaining(now);
      if (left <= wait || left - wait < options_.min_attempt_time) {
        r = R(annotate(s, absl::StrCat("keel: retry not started: waiting ", detail::describe(wait),
                                       " would leave too little of the ", detail::describe(left),
                                       " left for an attempt")));
        return stopped(stop::deadline);
      }
      if (options_.budget != nullptr && !options_.budget->try_acquire_retry(now)) {
        r = R(with_refused_by(annotate(s, "keel: retry budget exhausted, not retrying"), "retry_budget"));
        return stopped(stop::budget);
      }
      observe(ctx.listener, events::retry_scheduled{ctx.call, k + 1, wait, hint.has_value(), s});
      if (wait > duration::zero()) {
        if (!ctx.clock.sleep_until(now + wait, plan.stop)) {
          r = R(annotate(s, "keel: call cancelled while waiting to retry"));
          return stopped(stop::cancelled);
        }
        plan.now = ctx.clock.now();
      } else {
        plan.now = now;
      }
      ctx.call.note_retry();
      r = next(ctx, plan);
    }
  }

  retry_options options_;
  Backoff backoff_;
  Random random_;
};

}  // namespace keel
