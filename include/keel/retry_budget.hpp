// keel/retry_budget.hpp — a service-wide cap on retries: at most `ratio`
// retries per request over a sliding window, plus a small floor per second.
//
// Per-call attempt limits cannot stop a retry storm: when a dependency fails
// for everybody, every call retries and load multiplies. A retry budget is
// shared by every call of a service (or of one dependency): requests deposit,
// retries withdraw, and when the budget is spent retries stop until enough
// fresh requests arrive. This is the Finagle/gRPC idea; with ratio 0.1 a total
// outage adds at most 10% load (plus the floor) instead of 3x.
//
// Example:
//
//   keel::retry_budget budget({.ratio = 0.1, .min_per_second = 5, .window = std::chrono::seconds(10)});
//   keel::time_point now = keel::real_clock{}.now();
//   budget.record_request(now);                   // every call, once
//   if (budget.try_acquire_retry(now)) { /* retry */ }
//
// keel::retry does both when its options name a budget.
//
// Thread-safety: every operation is lock-free and may be called from any
// thread. try_acquire_retry never admits more than the budget allows, even
// under contention (it may briefly refuse one retry too many when two
// threads race for the last one).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>

#include "absl/status/status.h"
#include "keel/clock.hpp"
#include "keel/status.hpp"

namespace keel {

struct retry_budget_options {
  // Retries allowed per request seen in the window, in [0, 1].
  double ratio = 0.1;
  // Retries allowed per second regardless of traffic, so that a quiet
  // service can still retry; >= 0.
  double min_per_second = 10.0;
  // How far back requests and retries count; at least 10 ms.
  duration window = std::chrono::seconds(10);

  [[nodiscard]] absl::Status validate() const {
    if (!(ratio >= 0.0 && ratio <= 1.0))
      return detail::invalid_field("retry_budget_options", "ratio", "be in [0, 1]", ratio);
    if (!(min_per_second >= 0.0) || !std::isfinite(min_per_second))
      return detail::invalid_field("retry_budget_options", "min_per_second", "be a finite number >= 0",
                                   min_per_second);
    if (window < std::chrono::milliseconds(10))
      return detail::invalid_field("retry_budget_options", "window", "be >= 10ms", window);
    return absl::OkStatus();
  }
};

class retry_budget {
 public:
  // Throws keel::invalid_options if `o` is invalid.
  explicit retry_budget(const retry_budget_options& o = {})
      : ratio_(o.ratio),
        floor_(o.min_per_second * std::chrono::duration<double>(o.window).count()),
        bucket_width_(o.window / kBuckets) {
    detail::require_valid(o.validate());
  }
  retry_budget(const retry_budget&) = delete;
  retry_budget& operator=(const retry_budget&) = delete;

  // Deposits one request.
  void record_request(time_point now) noexcept { add(requests_, epoch(now)); }

  // Withdraws one retry if the budget allows it.
  [[nodiscard]] bool try_acquire_retry(time_point now) noexcept {
    const std::uint32_t e = epoch(now);
    add(retries_, e);  // count first, then check: concurrent callers see each other
    if (static_cast<double>(sum(retries_, e)) <= allowed(e)) return true;
    remove(retries_, e);
    return false;
  }

  struct snapshot {
    std::int64_t requests = 0;  // in the window
    std::int64_t retries = 0;   // in the window
    std::int64_t allowed = 0;   // retries the window allows in all
  };
  [[nodiscard]] snapshot read(time_point now) const noexcept {
    const std::uint32_t e = epoch(now);
    return {sum(requests_, e), sum(retries_, e), static_cast<std::int64_t>(allowed(e))};
  }

 private:
  static constexpr int kBuckets = 10;
  // Each bucket packs (epoch << 32 | count) in one word, so rolling a bucket
  // over to a new epoch and counting in it is a single CAS.
  using buckets = std::array<std::atomic<std::uint64_t>, kBuckets>;

  [[nodiscard]] std::uint32_t epoch(time_point now) const noexcept {
    return static_cast<std::uint32_t>(now.time_since_epoch() / bucket_width_);
  }
  [[nodiscard]] double allowed(std::uint32_t e) const noexcept {
    return std::floor(floor_ + ratio_ * static_cast<double>(sum(requests_, e)));
  }

  static void add(buckets& b, std::uint32_t e) noexcept {
    std::atomic<std::uint64_t>& slot = b[e % kBuckets];
    std::uint64_t v = slot.load(std::memory_order_relaxed);
    std::uint64_t next = 0;
    do {
      const auto slot_epoch = static_cast<std::uint32_t>(v >> 32);
      // A bucket from an older epoch is stale: restart it. One from a newer
      // epoch (the clock went backwards) keeps counting rather than losing data.
      next = static_cast<std::int32_t>(e - slot_epoch) > 0 ? (std::uint64_t{e} << 32) | 1u : v + 1;
    } while (!slot.compare_exchange_weak(v, next, std::memory_order_relaxed));
  }

  static void remove(buckets& b, std::uint32_t e) noexcept {
    std::atomic<std::uint64_t>& slot = b[e % kBuckets];
    std::uint64_t v = slot.load(std::memory_order_relaxed);
    while (static_cast<std::uint32_t>(v >> 32) == e && static_cast<std::uint32_t>(v) > 0) {
      if (slot.compare_exchange_weak(v, v - 1, std::memory_order_relaxed)) return;
    }
  }

  static std::int64_t sum(const buckets& b, std::uint32_t e) noexcept {
    std::int64_t total = 0;
    for (const auto& slot : b) {
      const std::uint64_t v = slot.load(std::memory_order_relaxed);
      const std::uint32_t age = e - static_cast<std::uint32_t>(v >> 32);
      if (age < kBuckets || static_cast<std::int32_t>(age) < 0) total += static_cast<std::uint32_t>(v);
    }
    return total;
  }

  double ratio_;
  double floor_;
  duration bucket_width_;
  buckets requests_{};
  buckets retries_{};
};

}  // namespace keel
