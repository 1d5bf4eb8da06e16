// keel/policy/adaptive_timeout.hpp — an attempt timeout learned from recent latency
// and clipped to what is left of the deadline.
//
//   timeout = min(remaining work time, clamp(rolling p99 + margin, lower, upper))
//
// The remaining work time already excludes the call's response reserve
// (keel::call::work_deadline). With the seed's figures — p99 800 ms, margin
// 200 ms, bounds 500-1500 ms — the timeout is 1000 ms; with 700 ms left and a
// 200 ms reserve (500 ms of work time) it is 500 ms; with less than the lower
// bound left, the attempt cannot plausibly finish and is not started (a
// "not started" DeadlineExceeded, classified permanent so no layer retries it).
//
// Until `min_samples` latencies are known the estimate is `initial`. The
// percentile is exact over the last `samples` successful attempts, kept by a
// keel::latency_tracker (keel/policy/latency_tracker.hpp: it refreshes every
// `refresh_every` samples and every eighth of them while the window fills,
// so after 100 samples the estimate reflects 96 of them). An attempt
// cut off by its timeout is recorded at the time it was cut (a lower bound of
// its true latency), so a run of timeouts can raise the estimate by at most
// one margin per refresh and never past `upper`: an outage cannot ratchet
// every later deadline upward.
//
// Example:
//
//   keel::adaptive_timeout timeouts({.margin = std::chrono::milliseconds(200),
//                                    .lower = std::chrono::milliseconds(500),
//                                    .upper = std::chrono::milliseconds(1500)});
//   std::optional<keel::duration> t = timeouts.attempt_timeout(std::chrono::milliseconds(700));
//   timeouts.record(std::chrono::milliseconds(640));
//
// Used as a policy (keel::pipeline(..., timeouts)) it sets each attempt's
// deadline, records its latency and skips attempts that cannot finish.
//
// Thread-safety: every operation may be called from any thread. record() is
// lock-free; when a refresh is due one recording thread recomputes the
// percentile (others skip, never wait).
#pragma once

#include <algorithm>
#include <bit>
#include <chrono>
#include <optional>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "keel/core/clock.hpp"
#include "keel/core/policy.hpp"
#include "keel/core/status.hpp"
#include "keel/policy/latency_tracker.hpp"

namespace keel {

struct adaptive_timeout_options {
  double percentile = 0.99;                             // in (0, 1)
  duration margin = std::chrono::milliseconds(200);     // >= 0
  duration lower = std::chrono::milliseconds(500);      // > 0
  duration upper = std::chrono::milliseconds(1500);     // >= lower
  duration initial = std::chrono::seconds(1);           // in [lower, upper]
  int min_samples = 20;                                 // >= 1, <= samples
  int samples = 256;        // rolling window size: a power of two in [16, 65536]
  int refresh_every = 64;   // recompute period in samples: a power of two in [1, samples]

  [[nodiscard]] absl::Status validate() const {
    constexpr std::string_view who = "adaptive_timeout_options";
    if (!(percentile > 0.0 && percentile < 1.0))
      return detail::invalid_field(who, "percentile", "be in (0, 1)", percentile);
    if (margin < duration::zero()) return detail::invalid_field(who, "margin", "be >= 0", margin);
    if (lower <= duration::zero()) return detail::invalid_field(who, "lower", "be > 0", lower);
    if (upper < lower)
      return detail::invalid_field(who, "upper", "be >= lower",
                                   detail::describe(upper) + " < " + detail::describe(lower));
    if (initial < lower || initial > upper)
      return detail::invalid_field(who, "initial", "be within [lower, upper]", initial);
    if (samples < 16 || samples > 65536 || !std::has_single_bit(static_cast<unsigned>(samples)))
      return detail::invalid_field(who, "samples", "be a power of two in [16, 65536]", samples);
    if (min_samples < 1 || min_samples > samples)
      return detail::invalid_field(who, "min_samples", "be in [1, samples]", min_samples);
    if (refresh_every < 1 || refresh_every > samples || !std::has_single_bit(static_cast<unsigned>(refresh_every)))
      return detail::invalid_field(who, "refresh_every", "be a power of two in [1, samples]", refresh_every);
    return absl::OkStatus();
  }

  // The seed's formula for an observed percentile, before the deadline clip.
  [[nodiscard]] duration desired(duration observed) const noexcept {
    return std::clamp(observed + margin, lower, upper);
  }
};

class adaptive_timeout {
 public:
  // Throws keel::invalid_options if `o` is invalid.
  explicit adaptive_timeout(const adaptive_timeout_options& o = {})
      : options_((detail::require_valid(o.validate()), o)),
        latencies_({.percentile = o.percentile,
                    .samples = o.samples,
                    .min_samples = o.min_samples,
                    .refresh_every = o.refresh_every}) {}
  adaptive_timeout(const adaptive_timeout&) = delete;
  adaptive_timeout& operator=(const adaptive_timeout&) = delete;

  [[nodiscard]] const adaptive_timeout_options& options() const noexcept { return options_; }

  // The observed percentile, once min_samples are known.
  [[nodiscard]] std::optional<duration> observed() const noexcept { return latencies_.percentile(); }

  // The estimator behind observed().
  [[nodiscard]] const latency_tracker& latencies() const noexcept { return latencies_; }

  // clamp(observed + margin, lower, upper), or `initial` before enough samples.
  [[nodiscard]] duration current() const noexcept {
    const std::optional<duration> p = observed();
    return p ? options_.desired(*p) : options_.initial;
  }

  // The timeout for an attempt with `remaining` work time, or nullopt when
  // less than `lower` remains: the attempt cannot plausibly finish.
  [[nodiscard]] std::optional<duration> attempt_timeout(duration remaining) const noexcept {
    if (remaining < options_.lower) return std::nullopt;
    return std::min(remaining, current());
  }

  // Records one attempt's latency. `censored`: the attempt was cut off by its
  // timeout, so `latency` is only a lower bound.
  void record(duration latency, bool censored = false) noexcept {
    (void)censored;  // recorded at the cut: see the header comment
    latencies_.record(latency);
  }

  template <class Ctx, class Next>
  auto execute(Ctx& ctx, const attempt_plan& plan, Next& next) -> decltype(next(ctx, plan)) {
    using R = decltype(next(ctx, plan));
    const duration left = plan.deadline.remaining(plan.now);
    // attempt_timeout() without its std::optional: copying one through the
    // stack costs a store-forwarding stall on the hot path.
    if (left < options_.lower) [[unlikely]] return R(too_little_left(left));
    const duration timeout = std::min(left, current());
    const time_point start = plan.now;
    R r = next(ctx, plan.narrowed(plan.deadline.within(start, timeout)));
    const absl::Status& s = status_of(r);
    if (s.ok()) [[likely]] {
      record(ctx.attempt_end(start) - start);
    } else if (s.code() == absl::StatusCode::kDeadlineExceeded && !not_started(s)) {
      const duration took = ctx.attempt_end(start) - start;
      if (took >= timeout) record(took, /*censored=*/true);
    }
    return r;
  }

 private:
  [[gnu::cold, gnu::noinline]] absl::Status too_little_left(duration left) const {
    return refusal(absl::DeadlineExceededError(absl::StrCat("keel: attempt not started: ", detail::describe(left),
                                                            " left, below the ", detail::describe(options_.lower),
                                                            " an attempt needs")),
                   "adaptive_timeout");
  }

  adaptive_timeout_options options_;
  latency_tracker latencies_;
};

}  // namespace keel
