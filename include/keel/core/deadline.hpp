// keel/core/deadline.hpp — an absolute deadline, and the rule that stages only ever
// get what remains of it.
//
// A request has one end-to-end deadline. Every stage after it (admission,
// retrieval, the model attempt, a fallback) gets a child deadline that can
// never be later than its parent's: `parent.within(now, at_most)`. There is no
// operation that extends a deadline, so "give the fallback a fresh 3 s" cannot
// be written by accident; the only way to start a clock is
// `deadline::after(now, budget)`, which belongs at the edge of the service.
//
// Example (the seed's 3-second plan; the 200 ms response reserve lives in
// keel::call, see keel/core/call.hpp):
//
//   keel::time_point t0 = clock.now();
//   keel::deadline request = keel::deadline::after(t0, std::chrono::seconds(3));
//   keel::deadline model = request.within(t0 + 300ms, 1000ms);    // ends at t0+1300ms
//   keel::deadline fallback = request.within(t0 + 1400ms, 3s);    // ends at t0+3s, not t0+4.4s
//
// Thread-safety: `deadline` is an immutable value; share it freely.
#pragma once

#include <algorithm>
#include <chrono>

#include "keel/core/clock.hpp"

namespace keel {

class deadline {
 public:
  // No deadline: remaining() is effectively unbounded.
  constexpr deadline() noexcept = default;

  // The request's own deadline, set once at the edge of the service.
  [[nodiscard]] static constexpr deadline after(time_point now, duration budget) noexcept {
    return deadline(saturating_add(now, budget));
  }
  // A deadline received from upstream (for example a propagated RPC deadline).
  [[nodiscard]] static constexpr deadline at(time_point when) noexcept { return deadline(when); }
  [[nodiscard]] static constexpr deadline infinite() noexcept { return deadline(); }

  [[nodiscard]] constexpr time_point when() const noexcept { return when_; }
  [[nodiscard]] constexpr bool is_infinite() const noexcept { return when_ == time_point::max(); }

  // Time left at `now`; zero once expired, never negative.
  [[nodiscard]] constexpr duration remaining(time_point now) const noexcept {
    if (is_infinite()) return duration::max();
    return now >= when_ ? duration::zero() : when_ - now;
  }
  [[nodiscard]] constexpr bool expired(time_point now) const noexcept { return now >= when_; }

  // A stage's deadline: at most `at_most` from now, and never past this one.
  [[nodiscard]] constexpr deadline within(time_point now, duration at_most) const noexcept {
    return deadline(std::min(when_, saturating_add(now, at_most)));
  }
  // This deadline moved earlier by `d` (a response reserve); never later.
  [[nodiscard]] constexpr deadline minus(duration d) const noexcept {
    if (is_infinite() || d <= duration::zero()) return *this;
    return deadline(when_ - d);
  }
  // The earlier of two deadlines.
  [[nodiscard]] constexpr deadline earliest(deadline other) const noexcept {
    return deadline(std::min(when_, other.when_));
  }

  friend constexpr bool operator==(deadline, deadline) noexcept = default;
  friend constexpr auto operator<=>(deadline a, deadline b) noexcept { return a.when_ <=> b.when_; }

 private:
  constexpr explicit deadline(time_point when) noexcept : when_(when) {}
  static constexpr time_point saturating_add(time_point t, duration d) noexcept {
    if (d <= duration::zero()) return t;
    return time_point::max() - t < d ? time_point::max() : t + d;
  }

  time_point when_ = time_point::max();
};

}  // namespace keel
