// keel/policy/backoff.hpp — how long to wait before retry k, and where the
// randomness comes from.
//
// Four strategies, each an aggregate of options:
//
//   full_jitter      uniform in [0, min(cap, base * 2^k)]           (the default)
//   equal_jitter     v = min(cap, base * 2^k); v/2 + uniform in [0, v/2]
//   decorrelated     min(cap, uniform in [base, 3 * previous delay])
//   constant_backoff always `delay`
//
// k counts retries from 0: with base 100 ms and cap 1 s, full jitter draws
// from 0-100, 0-200, 0-400, 0-800, then 0-1000 ms. A provider's retry-after
// hint, when present, replaces the drawn delay (keel/policy/retry.hpp).
//
// Randomness is a `keel::random_source`: a thread-safe object drawing
// uniform integers. The default draws from a per-thread absl::InsecureBitGen;
// tests pass keel::testing::seeded_random to make jitter reproducible.
//
// Example:
//
//   keel::full_jitter b{.base = std::chrono::milliseconds(100), .cap = std::chrono::seconds(1)};
//   keel::duration wait = b.delay(2, keel::duration::zero(), keel::thread_local_random{});  // in [0, 400ms]
//
// Thread-safety: strategies are immutable; delay() may be called from any
// thread with a thread-safe random source.
#pragma once

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstdint>

#include "absl/random/random.h"
#include "absl/status/status.h"
#include "keel/core/clock.hpp"
#include "keel/core/status.hpp"

namespace keel {

// Draws a uniform integer in [lo, hi]. Must be safe to call from many threads.
template <class R>
concept random_source = requires(const R& r, std::int64_t lo, std::int64_t hi) {
  { r.uniform(lo, hi) } -> std::same_as<std::int64_t>;
};

// The default source: one generator per thread, no locking.
struct thread_local_random {
  [[nodiscard]] std::int64_t uniform(std::int64_t lo, std::int64_t hi) const {
    thread_local absl::InsecureBitGen gen;
    return absl::Uniform(absl::IntervalClosed, gen, lo, hi);
  }
};

static_assert(random_source<thread_local_random>);

// A backoff strategy: delay before retry k (0-based), given the previous delay.
template <class B>
concept backoff = requires(const B& b, int k, duration previous, const thread_local_random& r) {
  { b.delay(k, previous, r) } -> std::same_as<duration>;
  { b.validate() } -> std::same_as<absl::Status>;
};

namespace detail {

// min(cap, base * 2^k) without overflow.
[[nodiscard]] constexpr duration exponential(duration base, duration cap, int k) noexcept {
  if (k < 0) k = 0;
  if (k >= 62) return cap;
  const auto limit = cap.count() >> k;
  if (base.count() > limit) return cap;
  return std::min(cap, duration(base.count() << k));
}

template <random_source R>
[[nodiscard]] duration uniform(const R& r, duration lo, duration hi) {
  if (hi <= lo) return lo;
  return duration(r.uniform(lo.count(), hi.count()));
}

[[nodiscard]] inline absl::Status validate_base_cap(std::string_view who, duration base, duration cap) {
  if (base <= duration::zero()) return invalid_field(who, "base", "be > 0", base);
  if (cap < base) return invalid_field(who, "cap", "be >= base", describe(cap) + " < " + describe(base));
  return absl::OkStatus();
}

}  // namespace detail

struct full_jitter {
  duration base = std::chrono::milliseconds(100);
  duration cap = std::chrono::seconds(10);

  [[nodiscard]] absl::Status validate() const { return detail::validate_base_cap("full_jitter", base, cap); }
  template <random_source R>
  [[nodiscard]] duration delay(int k, duration /*previous*/, const R& r) const {
    return detail::uniform(r, duration::zero(), detail::exponential(base, cap, k));
  }
};

struct equal_jitter {
  duration base = std::chrono::milliseconds(100);
  duration cap = std::chrono::seconds(10);

  [[nodiscard]] absl::Status validate() const { return detail::validate_base_cap("equal_jitter", base, cap); }
  template <random_source R>
  [[nodiscard]] duration delay(int k, duration /*previous*/, const R& r) const {
    const duration v = detail::exponential(base, cap, k);
    return v / 2 + detail::uniform(r, duration::zero(), v - v / 2);
  }
};

struct decorrelated_jitter {
  duration base = std::chrono::milliseconds(100);
  duration cap = std::chrono::seconds(10);

  [[nodiscard]] absl::Status validate() const {
    return detail::validate_base_cap("decorrelated_jitter", base, cap);
  }
  template <random_source R>
  [[nodiscard]] duration delay(int /*k*/, duration previous, const R& r) const {
    const duration prev = std::max(previous, base);
    const duration hi = prev > cap / 3 ? cap : prev * 3;
    return std::min(cap, detail::uniform(r, base, std::max(base, hi)));
  }
};

struct constant_backoff {
  duration delay_each = std::chrono::milliseconds(100);

  [[nodiscard]] absl::Status validate() const {
    if (delay_each < duration::zero())
      return detail::invalid_field("constant_backoff", "delay_each", "be >= 0", delay_each);
    return absl::OkStatus();
  }
  template <random_source R>
  [[nodiscard]] duration delay(int /*k*/, duration /*previous*/, const R& /*r*/) const {
    return delay_each;
  }
};

static_assert(backoff<full_jitter> && backoff<equal_jitter> && backoff<decorrelated_jitter> &&
              backoff<constant_backoff>);

}  // namespace keel
