// keel/policy/rate_limiter.hpp — a lock-free token bucket.
//
// keel::rate_limiter admits at most `burst` units at once and `rate` units per
// `per` (a second by default) sustained. It is the generic cell rate algorithm (GCRA): one atomic
// word holds the "theoretical arrival time" (TAT) of the next unit, and
// taking n units is one compare-and-swap that moves it n intervals forward
// if it stays within `burst` intervals of now. There is no refill thread and
// no per-token state, so it is exact under any contention: concurrent
// callers can never take more than the bucket holds.
//
// keel uses it for request rate (one unit per request) and, in
// keel/policy/admission.hpp, for compute budgets (units = model tokens, with
// `rate = budget`, `per = window` and `burst = budget`).
//
// Example:
//
//   keel::rate_limiter limiter({.rate = 50, .burst = 10});   // 50/s, bursts of 10
//   keel::time_point now = keel::real_clock{}.now();
//   keel::rate_decision d = limiter.try_acquire(now);
//   if (!d) { /* refuse; d.retry_after says when one unit will be there */ }
//   limiter.refund(1);   // give a unit back (an all-or-nothing admission rolled back)
//
// Time is passed in: the limiter never reads a clock (pass the time your
// request already read).
//
// Thread-safety: every operation is lock-free and may be called from any
// thread. try_acquire never grants more than the bucket holds at `now`;
// under contention it retries its CAS (it never refuses spuriously).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>

#include "absl/status/status.h"
#include "keel/core/clock.hpp"
#include "keel/core/status.hpp"

namespace keel {

struct rate_limiter_options {
  // Units per `per`, sustained; > 0, and at most one unit per nanosecond.
  double rate = 100.0;
  duration per = std::chrono::seconds(1);  // > 0
  // Units that may be taken at once from a full bucket; >= 1.
  double burst = 1.0;

  [[nodiscard]] absl::Status validate() const {
    if (per <= duration::zero()) return detail::invalid_field("rate_limiter_options", "per", "be > 0", per);
    const double per_ns = std::chrono::duration<double, std::nano>(per).count();
    if (!(rate > 0.0) || !(rate <= per_ns)) {
      return detail::invalid_field("rate_limiter_options", "rate",
                                   "be in (0, 1e9] units per second", rate * 1e9 / per_ns);
    }
    if (!(burst >= 1.0) || !std::isfinite(burst)) {
      return detail::invalid_field("rate_limiter_options", "burst", "be a finite number >= 1", burst);
    }
    // The bucket's depth in nanoseconds must fit comfortably in 64 bits.
    if (burst * per_ns / rate > 1e17) {
      return detail::invalid_field("rate_limiter_options", "burst", "be at most 1e8 seconds of rate", burst);
    }
    return absl::OkStatus();
  }
};

// The answer of try_acquire: granted, or refused with how long until the
// requested units will be there.
struct rate_decision {
  bool granted = false;
  duration retry_after{};
  [[nodiscard]] explicit constexpr operator bool() const noexcept { return granted; }
};

class rate_limiter {
 public:
  // Throws keel::invalid_options if `o` is invalid. The bucket starts full.
  explicit rate_limiter(const rate_limiter_options& o = {})
      : interval_ns_((detail::require_valid(o.validate()), std::chrono::duration<double, std::nano>(o.per).count() / o.rate)),
        depth_ns_(static_cast<std::int64_t>(std::llround(o.burst * interval_ns_))),
        unit_ns_(static_cast<std::int64_t>(std::llround(interval_ns_))),
        options_(o) {}
  rate_limiter(const rate_limiter&) = delete;
  rate_limiter& operator=(const rate_limiter&) = delete;

  [[nodiscard]] const rate_limiter_options& options() const noexcept { return options_; }

  // Takes `units` (> 0) if the bucket holds them at `now`. Lock-free. More
  // units than the burst are never granted (retry_after is duration::max()).
  [[nodiscard]] rate_decision try_acquire(time_point now, double units = 1.0) noexcept {
    const std::int64_t t = now.time_since_epoch().count();
    const std::int64_t cost = cost_ns(units);
    if (cost > depth_ns_) return {false, duration::max()};
    std::int64_t tat = tat_.load(std::memory_order_relaxed);
    for (;;) {
      const std::int64_t next = std::max(tat, t) + cost;
      // Granted while the debt stays within the bucket's depth.
      if (next - t > depth_ns_) return {false, duration(next - t - depth_ns_)};
      if (tat_.compare_exchange_weak(tat, next, std::memory_order_relaxed)) return {true, {}};
    }
  }

  // Gives `units` back, for example when another level of an all-or-nothing
  // admission refused. Never fills the bucket beyond full.
  void refund(double units = 1.0) noexcept { tat_.fetch_sub(cost_ns(units), std::memory_order_relaxed); }

  // Takes `units` at `now` unconditionally: the bucket may go into debt,
  // and later callers wait it off. Used to charge an actual cost above its
  // estimate.
  void charge(time_point now, double units) noexcept {
    const std::int64_t t = now.time_since_epoch().count();
    const std::int64_t cost = cost_ns(units);
    std::int64_t tat = tat_.load(std::memory_order_relaxed);
    while (!tat_.compare_exchange_weak(tat, std::max(tat, t) + cost, std::memory_order_relaxed)) {
    }
  }

  // Units the bucket holds at `now` (negative while in debt).
  [[nodiscard]] double available(time_point now) const noexcept {
    const std::int64_t t = now.time_since_epoch().count();
    const std::int64_t tat = std::max(tat_.load(std::memory_order_relaxed), t);
    return static_cast<double>(depth_ns_ - (tat - t)) / interval_ns_;
  }

 private:
  [[nodiscard]] std::int64_t cost_ns(double units) const noexcept {
    if (units == 1.0) return unit_ns_;  // one request: the common case, no rounding call
    return static_cast<std::int64_t>(std::llround(units * interval_ns_));
  }

  // The word every caller touches comes first, next to what it needs.
  // Theoretical arrival time of the next unit, ns since the clock's epoch.
  // Zero: long ago, so the bucket starts full.
  std::atomic<std::int64_t> tat_{0};
  double interval_ns_;      // nanoseconds per unit
  std::int64_t depth_ns_;   // burst * interval
  std::int64_t unit_ns_;    // interval, rounded
  rate_limiter_options options_;
};

}  // namespace keel
