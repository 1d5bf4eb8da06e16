// keel/policy/circuit_breaker.hpp — stop calling a dependency that is failing, and
// find out, with a few probes, when it has recovered.
//
// A circuit breaker is a state machine over one failure domain (an
// endpoint/model/region, or a tenant; keel/policy/breaker_registry.hpp keeps one per
// domain):
//
//   closed      calls flow; their outcomes fill a window (the last N calls, or
//               the last T in buckets). Once the window holds `minimum_calls`,
//               a failure rate or slow-call rate at or above its threshold
//               trips the breaker.
//   open        calls fail fast, without touching the dependency, with a
//               status that carries the time left open as a retry-after hint.
//               The open duration is fixed or comes from a function of the
//               number of consecutive trips (for example doubling).
//   half_open   after the open duration, `half_open_probes` calls are let
//               through as probes, each reserved with one compare-and-swap so
//               that concurrent callers can never exceed the number — at once
//               or in the whole half-open period. What a probe's answer means:
//                 - a success, or an answer the breaker does not count as a
//                   failure because it is the caller's (a permanent error: a
//                   bad request, a revoked key, a context too long), proves
//                   the dependency answers: it counts toward closing (Polly
//                   resolved its issue #1979 the same way, PR #1991). When
//                   all probes have answered so, the breaker closes.
//                 - a counted failure reopens it (or, if configured, a
//                   failure rate over the probes does), a new trip.
//                 - throttled (the dependency said "slow down"): it opens
//                   again at once, for the probe's retry-after hint when it
//                   has one (else the open duration), not counted as a trip
//                   unless `throttled` is configured a failure.
//                 - keel's own refusal from further in, the caller's
//                   cancellation, or a permit given back with ignore(): it
//                   never told anything about the dependency, and its slot
//                   goes back.
//                 - another ignored kind (transient or ambiguous configured
//                   `ignore`) used its slot and judges nothing; a period of
//                   those alone opens again for the same duration, not a trip.
//               A probe whose result never comes back is reclaimed
//               `probe_timeout` after the last probe was let through and
//               counts as failed, so the breaker can never stay stuck in
//               half-open. The bound on probes per period holds throughout:
//               only a probe that told nothing gives its slot back.
//
// Operators can force it open (contain an outage), force it closed (disable
// it: everything passes, nothing is counted) and hand it back to automatic
// control: from forced open it goes to half-open, so recovery is verified by
// probes before traffic returns.
//
// What counts is decided by the outcome classification (keel/core/outcome.hpp):
// by default transient and ambiguous outcomes (unavailable, timeouts, a
// thrown provider) are failures; permanent ones (bad credential, invalid
// argument, unsupported model) and throttled ones are ignored — one
// tenant's bad key is not a provider outage. Each of those is configurable.
// Refusals (keel declined before any work) and cancellations (the caller
// left) are never counted, whatever the options say: they say nothing about
// the dependency. A provider's failure marked "not started" (a connection
// refused before the request was sent) does count: that is the dependency
// failing, even though a write may safely be retried.
//
// Standalone:
//
//   keel::circuit_breaker breaker({.name = "llm-eu", .minimum_calls = 10, .open_duration = 5s});
//   keel::time_point now = keel::real_clock{}.now();
//   if (keel::breaker_permit p = breaker.try_acquire(now)) {
//     absl::Status s = call_the_model();
//     p.record(s.ok() ? keel::outcome_kind::success : keel::outcome_kind::transient, keel::real_clock{}.now());
//   } else {
//     absl::Status refused = breaker.refusal(now);   // Unavailable, retry-after = time left open
//   }
//
// As a policy, passed by reference: `keel::pipeline(breaker, ...)`. Where it
// sits decides what it sees, and that is the explicit choice between
// counting attempts and counting calls:
//
//   keel::pipeline(retry, breaker)   every attempt is gated and counted: an
//                                    opening breaker stops the next attempt.
//   keel::pipeline(breaker, retry)   each call is gated once and counted once,
//                                    by its final outcome.
//   keel::pipeline(breaker, retry, breaker.attempt_gate())
//                                    each call counted once by its final
//                                    outcome, and every attempt gated: a
//                                    breaker that opens mid-call (other calls
//                                    tripped it) stops this call's retries.
//
// Its refusal is Unavailable, marked not-started (safe to retry later) and
// classified permanent, so keel::retry never hammers an open breaker; the
// retry-after payload tells the caller when to come back, and refused-by
// names "breaker:<name>".
//
// Events (keel/core/telemetry.hpp), reported to a pipeline's listener:
// events::breaker_state_changed for transitions made by that pipeline's
// calls, events::breaker_rejected for each refused pass. Every transition,
// operator ones included, also goes to options.on_state_change.
//
// Cost: the closed path is lock-free — one load to admit; to record, one
// load, one fetch_add and, when the outcome differs from the sample it
// replaces, one exchange. A success while the count window holds only
// successes writes nothing at all (three loads). Transitions take a mutex
// (they are rare).
//
// Thread-safety: every operation may be called from any thread.
// on_state_change is called with the breaker's transition lock held, in
// transition order: keep it quick and do not call back into this breaker's
// operator controls from it.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "keel/core/call.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/outcome.hpp"
#include "keel/core/policy.hpp"
#include "keel/core/status.hpp"
#include "keel/core/telemetry.hpp"
#include "keel/policy/events.hpp"
#include "keel/policy/internal/outcome_window.hpp"

namespace keel {

// How the window is kept.
enum class breaker_window : std::uint8_t {
  count,  // the last `window_calls` calls
  time,   // the calls of the last `window_length`, in buckets of `bucket_width`
};

// How one kind of outcome counts.
enum class breaker_verdict : std::uint8_t { failure, success, ignore };

struct circuit_breaker_options {
  // Names the breaker in refusals ("breaker:<name>") and events.
  std::string name = "breaker";

  breaker_window window = breaker_window::count;
  int window_calls = 100;                                   // count window: calls, in [1, 65536]
  duration window_length = std::chrono::seconds(60);        // time window: > 0, a multiple of bucket_width
  duration bucket_width = std::chrono::seconds(1);          // time window: > 0, at most 3600 buckets
  // Calls the window must hold before a rate is judged; >= 1 (and at most
  // window_calls for a count window).
  int minimum_calls = 20;

  // Trip when failures / calls reaches this; in (0, 1]. nullopt: failures
  // alone never trip.
  std::optional<double> failure_rate_threshold = 0.5;
  // Trip when slow calls / calls reaches this; in (0, 1]. nullopt: slowness
  // is not judged. A call is slow when it takes at least slow_call_duration.
  std::optional<double> slow_call_rate_threshold = std::nullopt;
  duration slow_call_duration = std::chrono::seconds(5);    // > 0

  // How long the breaker stays open; > 0. When open_duration_for is set, it
  // is called with the number of consecutive trips (1 for the first, reset
  // when the breaker closes) and its answer is used instead (clamped to at
  // least 1 ns).
  duration open_duration = std::chrono::seconds(30);
  std::function<duration(int trips)> open_duration_for{};

  // Probes let through in one half-open period; in [1, 1000].
  int half_open_probes = 3;
  // nullopt: one failed probe reopens the breaker, and all probes must
  // succeed to close it. A rate in (0, 1]: reopen once failed probes reach
  // that share of half_open_probes, close once they no longer can.
  std::optional<double> half_open_failure_rate = std::nullopt;
  // A probe whose result has not come back this long after the last probe
  // was let through is reclaimed and counted as failed; > 0.
  duration probe_timeout = std::chrono::seconds(30);

  // How each outcome kind counts (success always counts as a success). A
  // slow call counts as slow whatever its verdict, unless ignored.
  breaker_verdict transient = breaker_verdict::failure;
  breaker_verdict ambiguous = breaker_verdict::failure;  // a write's timeout, a thrown provider
  breaker_verdict throttled = breaker_verdict::ignore;
  breaker_verdict permanent = breaker_verdict::ignore;   // bad credential, invalid argument

  // Called on every state change (see the thread-safety note above).
  std::function<void(const breaker_transition&)> on_state_change{};

  [[nodiscard]] absl::Status validate() const {
    constexpr std::string_view who = "circuit_breaker_options";
    if (name.empty()) return detail::invalid_field(who, "name", "not be empty", "\"\"");
    if (window == breaker_window::count) {
      if (window_calls < 1 || window_calls > 65536)
        return detail::invalid_field(who, "window_calls", "be in [1, 65536]", window_calls);
      if (minimum_calls < 1 || minimum_calls > window_calls)
        return detail::invalid_field(who, "minimum_calls", "be in [1, window_calls]", minimum_calls);
    } else {
      if (bucket_width <= duration::zero()) return detail::invalid_field(who, "bucket_width", "be > 0", bucket_width);
      if (window_length < bucket_width)
        return detail::invalid_field(who, "window_length", "be >= bucket_width",
                                     detail::describe(window_length) + " < " + detail::describe(bucket_width));
      if (window_length % bucket_width != duration::zero())
        return detail::invalid_field(who, "window_length", "be a multiple of bucket_width", window_length);
      if (window_length / bucket_width > 3600)
        return detail::invalid_field(who, "window_length", "be at most 3600 buckets",
                                     window_length / bucket_width);
      if (minimum_calls < 1) return detail::invalid_field(who, "minimum_calls", "be >= 1", minimum_calls);
    }
    if (!failure_rate_threshold && !slow_call_rate_threshold)
      return detail::invalid_field(who, "failure_rate_threshold", "be set when slow_call_rate_threshold is not",
                                   "nullopt");
    if (failure_rate_threshold && !(*failure_rate_threshold > 0.0 && *failure_rate_threshold <= 1.0))
      return detail::invalid_field(who, "failure_rate_threshold", "be in (0, 1]", *failure_rate_threshold);
    if (slow_call_rate_threshold && !(*slow_call_rate_threshold > 0.0 && *slow_call_rate_threshold <= 1.0))
      return detail::invalid_field(who, "slow_call_rate_threshold", "be in (0, 1]", *slow_call_rate_threshold);
    if (slow_call_duration <= duration::zero())
      return detail::invalid_field(who, "slow_call_duration", "be > 0", slow_call_duration);
    if (open_duration <= duration::zero())
      return detail::invalid_field(who, "open_duration", "be > 0", open_duration);
    if (half_open_probes < 1 || half_open_probes > 1000)
      return detail::invalid_field(who, "half_open_probes", "be in [1, 1000]", half_open_probes);
    if (half_open_failure_rate && !(*half_open_failure_rate > 0.0 && *half_open_failure_rate <= 1.0))
      return detail::invalid_field(who, "half_open_failure_rate", "be in (0, 1]", *half_open_failure_rate);
    if (probe_timeout <= duration::zero())
      return detail::invalid_field(who, "probe_timeout", "be > 0", probe_timeout);
    return absl::OkStatus();
  }
};

// What a breaker looks like at one moment.
struct breaker_figures {
  breaker_state state = breaker_state::closed;
  int calls = 0;              // in the window (closed state)
  int failures = 0;
  int slow_calls = 0;
  double failure_rate = 0.0;  // failures / calls, 0 when empty
  double slow_call_rate = 0.0;
  duration open_remaining{};  // open: time until probes are let through
  int probes_admitted = 0;    // half-open: probes let through this period
  int probes_succeeded = 0;   // a success, or a permanent error: the dependency answered
  int probes_failed = 0;
  int probes_ignored = 0;     // came back with another outcome the breaker does not count
  int trips = 0;              // consecutive trips without closing
};

class circuit_breaker;

// The right to make one call through a breaker. Move-only. Record its
// outcome once with record() (an ignored kind still uses a probe's slot); a
// probe dropped without a record, or ignore()d, gives its probe slot back
// (counted as neither success nor failure), so an exception between
// acquiring and recording cannot wedge the breaker.
class breaker_permit {
 public:
  breaker_permit() noexcept = default;  // refused
  breaker_permit(breaker_permit&& o) noexcept
      : breaker_(std::exchange(o.breaker_, nullptr)), gen_(o.gen_), probe_(o.probe_) {}
  breaker_permit& operator=(breaker_permit&& o) noexcept {
    if (this != &o) {
      abandon();
      breaker_ = std::exchange(o.breaker_, nullptr);
      gen_ = o.gen_;
      probe_ = o.probe_;
    }
    return *this;
  }
  breaker_permit(const breaker_permit&) = delete;
  breaker_permit& operator=(const breaker_permit&) = delete;
  ~breaker_permit() { abandon(); }

  // True when the call may go ahead.
  [[nodiscard]] explicit operator bool() const noexcept { return breaker_ != nullptr; }
  // True when this call is a half-open probe.
  [[nodiscard]] bool probe() const noexcept { return probe_; }

  // Records the call's outcome, finished at `now` after `latency`. Once.
  void record(outcome_kind kind, time_point now, duration latency = duration::zero()) noexcept;
  // The same with the call's status: a throttled probe's retry-after hint
  // (keel::retry_after) is how long the breaker opens again.
  void record(const absl::Status& status, outcome_kind kind, time_point now,
              duration latency = duration::zero()) noexcept;
  // Records nothing and gives a probe slot back: the call never reached the
  // dependency.
  void ignore() noexcept { abandon(); }

 private:
  friend class circuit_breaker;
  breaker_permit(circuit_breaker* b, std::uint32_t gen, bool probe) noexcept : breaker_(b), gen_(gen), probe_(probe) {}
  void abandon() noexcept;

  circuit_breaker* breaker_ = nullptr;
  std::uint32_t gen_ = 0;
  bool probe_ = false;
};

namespace detail {

// Up to two transitions one operation can cause (half-open, then reopened
// by reclaiming lost probes), for reporting after the lock is released.
struct breaker_changes {
  breaker_transition items[2];
  int count = 0;
  void add(const breaker_transition& t) noexcept {
    if (count < 2) items[count++] = t;
  }
};

}  // namespace detail

template <class Breaker>
class breaker_attempt_gate;

class circuit_breaker : private detail::breaker_word {
 public:
  // Throws keel::invalid_options if `o` is invalid.
  explicit circuit_breaker(circuit_breaker_options o)
      : options_((detail::require_valid(o.validate()), std::move(o))),
        slow_tracked_(options_.slow_call_rate_threshold.has_value()) {
    if (options_.window == breaker_window::count) {
      count_ = std::make_unique<detail::count_window>(options_.window_calls);
    } else {
      time_ = std::make_unique<detail::time_window>(options_.window_length, options_.bucket_width);
    }
  }
  circuit_breaker(const circuit_breaker&) = delete;
  circuit_breaker& operator=(const circuit_breaker&) = delete;

  [[nodiscard]] const circuit_breaker_options& options() const noexcept { return options_; }
  [[nodiscard]] std::string_view name() const noexcept { return options_.name; }
  [[nodiscard]] breaker_state state() const noexcept { return state_of(word_.load(std::memory_order_acquire)); }

  // Asks to make one call at `now`. A closed breaker admits at once
  // (lock-free); an open one refuses until its open duration has passed,
  // then the first caller becomes the first half-open probe.
  [[nodiscard]] breaker_permit try_acquire(time_point now) noexcept { return acquire(now, nullptr); }

  // The status for a call refused at `now`: Unavailable, keel::refusal()
  // (not started, classified refused), refused-by "breaker:<name>", with a retry-after of
  // the time left open (or, half-open, until a lost probe would be reclaimed).
  // Forced open, it carries no retry-after and says to retry once the
  // operator closes the breaker.
  // Allocates: call it on the refusal path only.
  [[nodiscard]] absl::Status refusal(time_point now) const {
    const std::uint64_t w = word_.load(std::memory_order_acquire);
    const breaker_state s = state_of(w);
    absl::Status st;
    std::optional<duration> wait;
    switch (s) {
      case breaker_state::open:
        st = absl::UnavailableError(absl::StrCat("keel: circuit breaker '", options_.name, "' is open"));
        wait = std::max(duration::zero(), time_point(duration(open_until_.load(std::memory_order_relaxed))) - now);
        break;
      case breaker_state::half_open:
        st = absl::UnavailableError(
            absl::StrCat("keel: circuit breaker '", options_.name, "' is half-open and all its probes are out"));
        wait = std::max(duration::zero(), time_point(duration(last_probe_.load(std::memory_order_relaxed))) +
                                              options_.probe_timeout - now);
        break;
      case breaker_state::forced_open:
        // No retry-after: only the operator knows when it ends, and a guess
        // would send callers back to be refused again.
        st = absl::UnavailableError(absl::StrCat("keel: circuit breaker '", options_.name,
                                                 "' is forced open by an operator; retry after the operator closes "
                                                 "it (no retry-after: the breaker cannot know when)"));
        break;
      default:
        st = absl::UnavailableError(absl::StrCat("keel: circuit breaker '", options_.name, "' refused the call"));
        wait = duration::zero();
        break;
    }
    return keel::refusal(std::move(st), absl::StrCat("breaker:", options_.name), wait);
  }

  // Operator controls. Each takes the transition lock and reports the
  // change to on_state_change.
  //
  // force_open: refuse everything until automatic() (contain an outage).
  void force_open(time_point now) { set_forced(breaker_state::forced_open, now); }
  // force_closed: admit everything and count nothing (disable the breaker).
  void force_closed(time_point now) { set_forced(breaker_state::forced_closed, now); }
  // automatic: back to automatic control. From forced open the breaker goes
  // half-open, so recovery is verified by probes; from forced closed it
  // starts closed with an empty window. Otherwise nothing changes.
  void automatic(time_point now) {
    std::lock_guard lock(mu_);
    const std::uint64_t w = word_.load(std::memory_order_acquire);
    const breaker_state s = state_of(w);
    if (s == breaker_state::forced_open) {
      last_probe_.store(now.time_since_epoch().count(), std::memory_order_relaxed);
      publish(w, pack(breaker_state::half_open, gen_of(w) + 1, 0, 0, 0), now, nullptr);
    } else if (s == breaker_state::forced_closed) {
      reset_window();
      publish(w, pack(breaker_state::closed, gen_of(w) + 1, 0, 0, 0), now, nullptr);
    }
  }

  [[nodiscard]] breaker_figures figures(time_point now) const noexcept {
    const std::uint64_t w = word_.load(std::memory_order_acquire);
    breaker_figures s;
    s.state = state_of(w);
    const detail::count_window::totals t = totals(now);
    s.calls = t.calls;
    s.failures = std::min(t.failures, t.calls);
    s.slow_calls = std::min(t.slow, t.calls);
    if (t.calls > 0) {
      s.failure_rate = static_cast<double>(s.failures) / t.calls;
      s.slow_call_rate = static_cast<double>(s.slow_calls) / t.calls;
    }
    if (s.state == breaker_state::open) {
      s.open_remaining =
          std::max(duration::zero(), time_point(duration(open_until_.load(std::memory_order_relaxed))) - now);
    }
    if (s.state == breaker_state::half_open) {
      s.probes_admitted = admitted_of(w);
      s.probes_succeeded = succeeded_of(w);
      s.probes_failed = failed_of(w);
      s.probes_ignored = ignored_of(w);
    }
    s.trips = trips_.load(std::memory_order_relaxed);
    return s;
  }

  // A policy that refuses attempts while this breaker is open or forced
  // open, and counts nothing. Place it inside keel::retry when the breaker
  // itself sits outside (see the header comment).
  [[nodiscard]] breaker_attempt_gate<circuit_breaker> attempt_gate() noexcept;

  // The policy: gate the pass, run it, count its outcome.
  template <class Ctx, class Next>
  auto execute(Ctx& ctx, const attempt_plan& plan, Next& next) -> decltype(next(ctx, plan)) {
    // The healthy path: closed, and slowness not judged, so a success needs
    // no time and no permit; it changes nothing but the window.
    const std::uint64_t w = word_.load(std::memory_order_acquire);
    if (state_of(w) == breaker_state::closed && !slow_tracked_) [[likely]] {
      decltype(next(ctx, plan)) r = next(ctx, plan);
      if (status_of(r).ok()) [[likely]] {
        closed_success(gen_of(w), plan.now);
      } else {
        finish_closed(ctx, plan, status_of(r), gen_of(w));
      }
      return r;
    }
    return execute_any(ctx, plan, next);
  }

  // Internals from here on.
 private:
  friend class breaker_permit;

  template <class Ctx>
  // Not noexcept: the classifier and the listener are the user's and may
  // throw, as they may on execute_any()'s path.
  [[gnu::noinline]] void finish_closed(Ctx& ctx, const attempt_plan& plan, const absl::Status& s,
                                       std::uint32_t gen) {
    // As finish() for a closed breaker's permit (see execute_any()).
    const outcome_kind kind = ctx.classify(s);
    if (kind == outcome_kind::refused) return;
    const breaker_verdict v = verdict(kind);
    if (v == breaker_verdict::ignore) return;
    detail::breaker_changes changes;
    closed_result(gen, v == breaker_verdict::failure, false, ctx.attempt_end(plan.now), &changes);
    report(ctx, changes);
  }

  void closed_success(std::uint32_t gen, time_point now) noexcept {
    const std::uint64_t w = word_.load(std::memory_order_acquire);
    if (state_of(w) != breaker_state::closed || gen_of(w) != gen) return;  // a result from an earlier period
    if (count_) {
      count_->add(false, false);
    } else {
      time_->add(now, false, false);
    }
  }

  template <class Ctx, class Next>
  auto execute_any(Ctx& ctx, const attempt_plan& plan, Next& next) -> decltype(next(ctx, plan)) {
    using R = decltype(next(ctx, plan));
    detail::breaker_changes changes;
    breaker_permit permit = acquire(plan.now, &changes);
    report(ctx, changes);
    if (!permit) {
      observe(ctx.listener, events::breaker_rejected{ctx.call, name(), state()});
      return R(refusal(plan.now));
    }
    R r = next(ctx, plan);
    const absl::Status& s = status_of(r);
    changes.count = 0;
    if (s.ok()) {
      // Success needs the end time only to judge slowness.
      if (slow_tracked_) {
        const time_point end = ctx.attempt_end(plan.now);
        finish(permit, outcome_kind::success, end, end - plan.now, &changes);
      } else {
        finish(permit, outcome_kind::success, plan.now, duration::zero(), &changes);
      }
    } else {
      // Counted whether or not the request went out: a connection refused
      // before sending (not started) is the dependency failing too. keel's
      // own refusals and cancellations are never counted (finish()).
      const time_point end = ctx.attempt_end(plan.now);
      const outcome_kind kind = ctx.classify(s);
      finish(permit, kind, end, end - plan.now, &changes, kind == outcome_kind::throttled ? retry_after(s) : std::nullopt);
    }
    report(ctx, changes);
    return r;
  }

  // The internals behind try_acquire / breaker_permit::record, with the
  // transitions they cause reported to `changes`.
  [[nodiscard]] breaker_permit acquire(time_point now, detail::breaker_changes* changes) noexcept {
    for (;;) {
      std::uint64_t w = word_.load(std::memory_order_acquire);
      switch (state_of(w)) {
        case breaker_state::closed:
        case breaker_state::forced_closed:
          return breaker_permit(this, gen_of(w), false);
        case breaker_state::forced_open:
          return {};
        case breaker_state::open: {
          if (now.time_since_epoch().count() < open_until_.load(std::memory_order_relaxed)) return {};
          std::lock_guard lock(mu_);
          const std::uint64_t cur = word_.load(std::memory_order_acquire);
          if (cur != w) continue;  // someone else moved it on: look again
          // This caller is the period's first probe.
          last_probe_.store(now.time_since_epoch().count(), std::memory_order_relaxed);
          const std::uint64_t half = pack(breaker_state::half_open, gen_of(w) + 1, 1, 0, 0);
          publish(w, half, now, changes);
          return breaker_permit(this, gen_of(half), true);
        }
        case breaker_state::half_open: {
          const int admitted = admitted_of(w);
          if (admitted < options_.half_open_probes) {
            // Reserve a probe: count first, in the same word as the state,
            // so concurrent callers can never take more than there are.
            note_probe_time(now);
            if (word_.compare_exchange_weak(w, w + kAdmittedOne, std::memory_order_acq_rel)) {
              return breaker_permit(this, gen_of(w), true);
            }
            continue;
          }
          const int outstanding = admitted - returned_of(w);
          const std::int64_t since = now.time_since_epoch().count() - last_probe_.load(std::memory_order_relaxed);
          if (outstanding > 0 && since >= options_.probe_timeout.count()) {
            // Lost probes: count them failed so the period can end.
            const std::uint64_t reclaimed = w + static_cast<std::uint64_t>(outstanding) * kFailedOne;
            if (word_.compare_exchange_strong(w, reclaimed, std::memory_order_acq_rel)) decide(reclaimed, now, changes);
            continue;
          }
          return {};
        }
      }
    }
  }

  void finish(breaker_permit& p, outcome_kind kind, time_point now, duration latency,
              detail::breaker_changes* changes, std::optional<duration> hint = std::nullopt) noexcept {
    if (p.breaker_ != this) return;
    const bool probe = p.probe_;
    const std::uint32_t gen = p.gen_;
    p.breaker_ = nullptr;
    if (kind == outcome_kind::refused || kind == outcome_kind::cancelled) {
      // keel declined further in, or the caller left: the probe told nothing
      // about the dependency, so its slot goes back.
      if (probe) return_probe(gen);
      return;
    }
    const breaker_verdict v = verdict(kind);
    if (probe && kind == outcome_kind::throttled) {
      // "Slow down": open again at once, for as long as it asked.
      throttled_probe(gen, now, v == breaker_verdict::failure, hint, changes);
      return;
    }
    if (probe && kind == outcome_kind::permanent && v == breaker_verdict::ignore) {
      // The caller's error, answered by the dependency: it is reachable.
      probe_result(gen, kSucceededOne, now, changes);
      return;
    }
    if (v == breaker_verdict::ignore) {
      // The probe reached the dependency: it keeps its slot, so ignored
      // outcomes cannot let more than half_open_probes through a period.
      if (probe) probe_result(gen, kIgnoredOne, now, changes);
      return;
    }
    const bool slow = slow_tracked_ && latency >= options_.slow_call_duration;
    if (probe) {
      probe_result(gen, v == breaker_verdict::failure || slow ? kFailedOne : kSucceededOne, now, changes);
    } else {
      closed_result(gen, v == breaker_verdict::failure, slow, now, changes);
    }
  }

  [[nodiscard]] breaker_verdict verdict(outcome_kind k) const noexcept {
    switch (k) {
      case outcome_kind::success: return breaker_verdict::success;
      case outcome_kind::transient: return options_.transient;
      case outcome_kind::throttled: return options_.throttled;
      case outcome_kind::permanent: return options_.permanent;
      case outcome_kind::ambiguous: return options_.ambiguous;
      // Not the dependency's doing: the caller left (a refusal never gets
      // here: finish() hands its probe slot back first).
      case outcome_kind::refused:
      case outcome_kind::cancelled: return breaker_verdict::ignore;
    }
    return breaker_verdict::ignore;
  }

  [[nodiscard]] detail::count_window::totals totals(time_point now) const noexcept {
    return count_ ? count_->read() : time_->read(now);
  }
  void reset_window() noexcept {
    if (count_) {
      count_->reset();
    } else {
      time_->reset();
    }
  }

  void note_probe_time(time_point now) noexcept {
    // The latest admission time; a probe is reclaimed probe_timeout after it.
    std::int64_t seen = last_probe_.load(std::memory_order_relaxed);
    const std::int64_t t = now.time_since_epoch().count();
    while (seen < t && !last_probe_.compare_exchange_weak(seen, t, std::memory_order_relaxed)) {
    }
  }

  void closed_result(std::uint32_t gen, bool failed, bool slow, time_point now,
                     detail::breaker_changes* changes) noexcept {
    const std::uint64_t w = word_.load(std::memory_order_acquire);
    if (state_of(w) != breaker_state::closed || gen_of(w) != gen) return;  // a result from an earlier period
    if (count_) {
      count_->add(failed, slow);
    } else {
      time_->add(now, failed, slow);
    }
    // Only a failure or a slow call can raise a rate: judge then.
    if (!failed && !slow) return;
    const detail::count_window::totals t = totals(now);
    if (t.calls < options_.minimum_calls) return;
    const double calls = t.calls;
    const bool trip = (options_.failure_rate_threshold && t.failures >= *options_.failure_rate_threshold * calls) ||
                      (options_.slow_call_rate_threshold && t.slow >= *options_.slow_call_rate_threshold * calls);
    if (!trip) return;
    std::lock_guard lock(mu_);
    const std::uint64_t cur = word_.load(std::memory_order_acquire);
    if (state_of(cur) != breaker_state::closed || gen_of(cur) != gen) return;  // tripped by someone else
    open_from(cur, now, changes);
  }

  // `one`: kSucceededOne, kFailedOne or kIgnoredOne.
  void probe_result(std::uint32_t gen, std::uint64_t one, time_point now, detail::breaker_changes* changes) noexcept {
    std::uint64_t w = word_.load(std::memory_order_acquire);
    for (;;) {
      if (state_of(w) != breaker_state::half_open || gen_of(w) != gen) return;  // period over
      // Reclaimed probes were already counted; a late result is dropped.
      if (returned_of(w) >= admitted_of(w)) return;
      const std::uint64_t next = w + one;
      if (word_.compare_exchange_weak(w, next, std::memory_order_acq_rel)) {
        decide(next, now, changes);
        return;
      }
    }
  }

  // A half-open probe came back throttled: the period ends, the breaker
  // opens for the hint (else as a trip would), a trip only when `counted`.
  void throttled_probe(std::uint32_t gen, time_point now, bool counted, std::optional<duration> hint,
                       detail::breaker_changes* changes) noexcept {
    std::lock_guard lock(mu_);
    const std::uint64_t cur = word_.load(std::memory_order_acquire);
    if (state_of(cur) != breaker_state::half_open || gen_of(cur) != gen) return;  // decided already
    open_from(cur, now, changes, counted, hint);
  }

  void return_probe(std::uint32_t gen) noexcept {
    std::uint64_t w = word_.load(std::memory_order_acquire);
    for (;;) {
      if (state_of(w) != breaker_state::half_open || gen_of(w) != gen) return;
      if (returned_of(w) >= admitted_of(w)) return;
      if (word_.compare_exchange_weak(w, w - kAdmittedOne, std::memory_order_acq_rel)) return;
    }
  }

  // After a probe result: close, reopen, or keep probing. Ignored probes
  // (other than permanent errors, which count as answers) used their slots
  // but judge nothing: the counted ones decide, and once every slot is back
  // with nothing counted against and nothing for, the period is
  // inconclusive and the breaker opens again without a new trip.
  void decide(std::uint64_t w, time_point now, detail::breaker_changes* changes) noexcept {
    const int n = options_.half_open_probes;
    const int ok = succeeded_of(w), bad = failed_of(w), ign = ignored_of(w);
    bool reopen = false, close = false;
    if (!options_.half_open_failure_rate) {
      reopen = bad >= 1;
      close = !reopen && ok >= 1 && ok + ign >= n;
    } else {
      const double limit = *options_.half_open_failure_rate * n;
      reopen = bad >= limit;
      close = !reopen && ok >= 1 && static_cast<double>(n - ok - ign) < limit;
    }
    const bool inconclusive = !reopen && !close && ok + bad + ign >= n;
    if (!reopen && !close && !inconclusive) return;
    std::lock_guard lock(mu_);
    std::uint64_t cur = word_.load(std::memory_order_acquire);
    if (state_of(cur) != breaker_state::half_open || gen_of(cur) != gen_of(w)) return;  // decided already
    if (reopen || inconclusive) {
      open_from(cur, now, changes, /*trip=*/reopen);
    } else {
      trips_.store(0, std::memory_order_relaxed);
      reset_window();
      publish(cur, pack(breaker_state::closed, gen_of(cur) + 1, 0, 0, 0), now, changes);
    }
  }

  // Under mu_: to open from `cur` (closed or half-open). `trip`: a new
  // consecutive trip (false: an inconclusive half-open period waits again).
  // `hint`: a throttled probe's retry-after, how long to stay open (at
  // least that long when it is also a trip).
  void open_from(std::uint64_t cur, time_point now, detail::breaker_changes* changes, bool trip = true,
                 std::optional<duration> hint = std::nullopt) noexcept {
    const int trips = std::max(1, trips_.load(std::memory_order_relaxed) + (trip ? 1 : 0));
    trips_.store(trips, std::memory_order_relaxed);
    duration d = options_.open_duration;
    if (options_.open_duration_for) {
      try {
        d = std::max(duration(1), options_.open_duration_for(trips));
      } catch (...) {
        d = options_.open_duration;  // a throwing policy function must not wedge the breaker
      }
    }
    if (hint) d = trip ? std::max(d, *hint) : std::max(duration(1), *hint);
    open_until_.store(saturating(now, d).time_since_epoch().count(), std::memory_order_relaxed);
    publish(cur, pack(breaker_state::open, gen_of(cur) + 1, 0, 0, 0), now, changes);
  }

  // Under mu_: installs `next` over `cur` (retrying while only probe counts
  // move underneath) and reports the change.
  void publish(std::uint64_t cur, std::uint64_t next, time_point now, detail::breaker_changes* changes) noexcept {
    while (!word_.compare_exchange_weak(cur, next, std::memory_order_acq_rel)) {
    }
    const breaker_transition t{state_of(cur), state_of(next), now, trips_.load(std::memory_order_relaxed)};
    if (changes != nullptr) changes->add(t);
    if (options_.on_state_change) {
      try {
        options_.on_state_change(t);
      } catch (...) {
        // A listener's failure is not the breaker's: the transition stands.
      }
    }
  }

  void set_forced(breaker_state s, time_point now) {
    std::lock_guard lock(mu_);
    const std::uint64_t w = word_.load(std::memory_order_acquire);
    if (state_of(w) == s) return;
    publish(w, pack(s, gen_of(w) + 1, 0, 0, 0), now, nullptr);
  }

  template <class Ctx>
  void report(Ctx& ctx, const detail::breaker_changes& changes) const {
    for (int i = 0; i < changes.count; ++i) {
      observe(ctx.listener, events::breaker_state_changed{name(), changes.items[i]});
    }
  }

  static time_point saturating(time_point t, duration d) noexcept {
    return time_point::max() - t < d ? time_point::max() : t + d;
  }

  circuit_breaker_options options_;
  bool slow_tracked_;
  std::unique_ptr<detail::count_window> count_;
  std::unique_ptr<detail::time_window> time_;
  alignas(64) std::atomic<std::uint64_t> word_{pack(breaker_state::closed, 0, 0, 0, 0)};
  alignas(64) std::atomic<std::int64_t> open_until_{0};   // ns since epoch
  std::atomic<std::int64_t> last_probe_{0};               // ns since epoch
  std::atomic<int> trips_{0};
  std::mutex mu_;  // transitions
};

inline void breaker_permit::record(outcome_kind kind, time_point now, duration latency) noexcept {
  if (breaker_ != nullptr) breaker_->finish(*this, kind, now, latency, nullptr);
}

inline void breaker_permit::record(const absl::Status& status, outcome_kind kind, time_point now,
                                   duration latency) noexcept {
  if (breaker_ == nullptr) return;
  std::optional<duration> hint;
  if (kind == outcome_kind::throttled) hint = retry_after(status);
  breaker_->finish(*this, kind, now, latency, nullptr, hint);
}

inline void breaker_permit::abandon() noexcept {
  if (breaker_ == nullptr) return;
  circuit_breaker* b = std::exchange(breaker_, nullptr);
  if (probe_) b->return_probe(gen_);
}

// See circuit_breaker::attempt_gate().
template <class Breaker>
class breaker_attempt_gate {
 public:
  explicit breaker_attempt_gate(Breaker& b) noexcept : breaker_(&b) {}

  template <class Ctx, class Next>
  auto execute(Ctx& ctx, const attempt_plan& plan, Next& next) const -> decltype(next(ctx, plan)) {
    using R = decltype(next(ctx, plan));
    const breaker_state s = breaker_->state();
    if (s == breaker_state::open || s == breaker_state::forced_open) {
      observe(ctx.listener, events::breaker_rejected{ctx.call, breaker_->name(), s});
      return R(breaker_->refusal(plan.now));
    }
    return next(ctx, plan);
  }

 private:
  Breaker* breaker_;
};

inline breaker_attempt_gate<circuit_breaker> circuit_breaker::attempt_gate() noexcept {
  return breaker_attempt_gate<circuit_breaker>(*this);
}

}  // namespace keel
