// keel/policy/retry_budget.hpp — a service-wide cap on retries: at most `ratio`
// retries per request over a sliding window, plus a small floor that accrues
// at `min_per_second`.
//
// Per-call attempt limits cannot stop a retry storm: when a dependency fails
// for everybody, every call retries and load multiplies. A retry budget is
// shared by every call of a service (or of one dependency): requests deposit,
// retries withdraw, and when the budget is spent retries stop until enough
// fresh requests arrive. This is the Finagle/gRPC idea; with ratio 0.1 a total
// outage adds at most 10% load (plus the floor) instead of 3x.
//
// The floor lets a quiet service retry at all. It is a rate, not a reserve:
// it accrues `min_per_second` retries per second and holds at most one
// second's worth (at least one retry), so after a quiet spell it can be spent
// in a burst of about `min_per_second`, never `min_per_second x window`.
// Retries are drawn from the floor first, then from the ratio.
//
// A request deposits once per call: record_request(call, now) remembers in
// the keel::call which budgets it has paid into, so nested keel::retry layers
// and a keel::hedge sharing the budget deposit one request between them.
//
// Example:
//
//   keel::retry_budget budget({.ratio = 0.1, .min_per_second = 5, .window = std::chrono::seconds(10)});
//   keel::time_point now = keel::real_clock{}.now();
//   keel::call call(now, {.timeout = std::chrono::seconds(3)});
//   budget.record_request(call, now);             // each call once, however often asked
//   if (budget.try_acquire_retry(now)) { /* retry */ }
//
// keel::retry and keel::hedge do both when their options name a budget.
//
// Requests are counted in per-thread cells (keel/core/internal/thread_slot.hpp):
// a deposit is a plain load and store on its thread's own cache line, and
// reading the requests (a retry, figures()) sums every thread's cells.
//
// Thread-safety: every operation is lock-free and may be called from any
// thread. try_acquire_retry never admits more than the budget allows, even
// under contention (it may briefly refuse one retry too many when two
// threads race for the last one).
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>

#include "absl/status/status.h"
#include "keel/core/call.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/status.hpp"
#include "keel/core/internal/thread_slot.hpp"

namespace keel {

// What a retry budget holds over its window (retry_budget::figures).
struct retry_budget_figures {
  std::int64_t requests = 0;  // in the window
  std::int64_t retries = 0;   // in the window, from the ratio and the floor
  // Retries the window allows in all: what the ratio allows, plus what the
  // floor granted in the window and holds now. allowed - retries may be
  // spent at once.
  std::int64_t allowed = 0;
};

struct retry_budget_options {
  // Retries allowed per request seen in the window, in [0, 1].
  double ratio = 0.1;
  // Retries per second allowed regardless of traffic, so that a quiet
  // service can still retry; a rate with a burst of one second's worth
  // (at least one). Finite, >= 0; above 1e9 it does not limit.
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
      : ratio_(o.ratio), per_bucket_(reciprocal(o.window / kBuckets)) {
    detail::require_valid(o.validate());
    if (o.min_per_second > 0.0) {
      // The floor as a GCRA: one retry every `interval_`, up to `burst_`
      // ahead of time. Nanosecond resolution: above 1e9/s it cannot limit.
      const double interval = 1e9 / o.min_per_second;
      floor_ = interval < 0.5 ? floor_kind::unlimited : floor_kind::rate;
      if (floor_ == floor_kind::rate) {
        constexpr double kMax = static_cast<double>(std::numeric_limits<std::int64_t>::max() / 4);
        interval_ = static_cast<std::int64_t>(std::llround(std::min(interval, kMax)));
        burst_ = static_cast<std::int64_t>(std::llround(std::min((std::max(1.0, o.min_per_second) - 1.0) * interval, kMax)));
        capacity_ = static_cast<std::int64_t>(std::max(1.0, std::floor(o.min_per_second)));
      } else {
        capacity_ = static_cast<std::int64_t>(std::min(o.min_per_second, 4e18));
      }
    }
  }
  retry_budget(const retry_budget&) = delete;
  retry_budget& operator=(const retry_budget&) = delete;

  // Deposits one request for `c`, unless `c` has deposited into this budget
  // already (nested retry layers, a hedge around a retry). Returns whether it
  // deposited. One relaxed scan of the call's few deposit slots.
  bool record_request(keel::call& c, time_point now) noexcept {
    if (!c.first_deposit(this)) return false;
    record_request(now);
    return true;
  }

  // Deposits one request, whatever deposited before: for callers without a
  // keel::call, which must call it once per request themselves.
  void record_request(time_point now) noexcept {
    const int slot = detail::my_thread_slot();
    if (slot == detail::kSharedSlot) [[unlikely]] {
      add(requests_[slot].b, epoch(now));
    } else {
      add_own(requests_[slot].b, epoch(now));
    }
  }

  // Withdraws one retry if the budget allows it: from the floor when it has
  // a retry to give, otherwise from the ratio.
  [[nodiscard]] bool try_acquire_retry(time_point now) noexcept {
    const std::uint32_t e = epoch(now);
    if (take_floor(now)) {
      add(floor_retries_, e);
      return true;
    }
    add(retries_, e);  // count first, then check: concurrent callers see each other
    if (sum(retries_, e) <= ratio_allows(e)) return true;
    remove(retries_, e);
    return false;
  }

  // The numbers at `now`: each read on its own (relaxed), so under
  // concurrent use they are close to, not exactly, one instant's.
  [[nodiscard]] retry_budget_figures figures(time_point now) const noexcept {
    const std::uint32_t e = epoch(now);
    const std::int64_t from_floor = sum(floor_retries_, e);
    return {requests(e), sum(retries_, e) + from_floor, ratio_allows(e) + from_floor + floor_holds(now)};
  }

 private:
  static constexpr int kBuckets = 16;  // a power of two: the bucket of an epoch is a mask
  // Each bucket packs (epoch << 32 | count) in one word, so rolling a bucket
  // over to a new epoch and counting in it is a single CAS.
  using buckets = std::array<std::atomic<std::uint64_t>, kBuckets>;
  struct alignas(64) thread_buckets {
    buckets b{};
  };
  enum class floor_kind : std::uint8_t { none, rate, unlimited };

  // now / (window / kBuckets) as a multiply by a 64.64 fixed-point
  // reciprocal: not a 64-bit division (~40-90 cycles, a third of a
  // deposit's cost), nor a floating-point one (a 12-cycle chain of
  // conversions); monotone in `now`, so buckets stay in order.
  __extension__ using wide = __int128;
  [[nodiscard]] static std::uint64_t reciprocal(duration bucket) noexcept {
    return static_cast<std::uint64_t>((wide{1} << 64) / std::max<std::int64_t>(1, bucket.count()));
  }
  [[nodiscard]] std::uint32_t epoch(time_point now) const noexcept {
    return static_cast<std::uint32_t>(
        static_cast<std::int64_t>((wide{now.time_since_epoch().count()} * wide{per_bucket_}) >> 64));
  }
  [[nodiscard]] std::int64_t ratio_allows(std::uint32_t e) const noexcept {
    return static_cast<std::int64_t>(std::floor(ratio_ * static_cast<double>(requests(e))));
  }
  [[nodiscard]] std::int64_t requests(std::uint32_t e) const noexcept {
    std::int64_t total = 0;
    for (const thread_buckets& t : requests_) total += sum(t.b, e);
    return total;
  }

  // GCRA: `tat_` is when the floor is next empty-handed (the theoretical
  // arrival time); a retry fits while tat_ is at most burst_ ahead of now.
  [[nodiscard]] bool take_floor(time_point now) noexcept {
    if (floor_ != floor_kind::rate) return floor_ == floor_kind::unlimited;
    const std::int64_t t = now.time_since_epoch().count();
    std::int64_t tat = tat_.load(std::memory_order_relaxed);
    for (;;) {
      const std::int64_t from = std::max(tat, t);
      if (from - t > burst_) return false;
      if (tat_.compare_exchange_weak(tat, from + interval_, std::memory_order_relaxed)) return true;
    }
  }
  [[nodiscard]] std::int64_t floor_holds(time_point now) const noexcept {
    if (floor_ != floor_kind::rate) return floor_ == floor_kind::unlimited ? capacity_ : 0;
    const std::int64_t t = now.time_since_epoch().count();
    const std::int64_t ahead = std::max(tat_.load(std::memory_order_relaxed), t) - t;
    if (ahead > burst_) return 0;
    return std::min(capacity_, (burst_ - ahead) / interval_ + 1);
  }

  static void add(buckets& b, std::uint32_t e) noexcept {
    std::atomic<std::uint64_t>& slot = b[e & (kBuckets - 1)];
    std::uint64_t v = slot.load(std::memory_order_relaxed);
    std::uint64_t next = 0;
    do {
      const auto slot_epoch = static_cast<std::uint32_t>(v >> 32);
      // A bucket from an older epoch is stale: restart it. One from a newer
      // epoch (the clock went backwards) keeps counting rather than losing data.
      next = static_cast<std::int32_t>(e - slot_epoch) > 0 ? (std::uint64_t{e} << 32) | 1u : v + 1;
    } while (!slot.compare_exchange_weak(v, next, std::memory_order_relaxed));
  }

  // add() for the one thread that writes `b`: no read-modify-write.
  static void add_own(buckets& b, std::uint32_t e) noexcept {
    std::atomic<std::uint64_t>& slot = b[e & (kBuckets - 1)];
    const std::uint64_t v = slot.load(std::memory_order_relaxed);
    const auto slot_epoch = static_cast<std::uint32_t>(v >> 32);
    slot.store(static_cast<std::int32_t>(e - slot_epoch) > 0 ? (std::uint64_t{e} << 32) | 1u : v + 1,
               std::memory_order_relaxed);
  }

  static void remove(buckets& b, std::uint32_t e) noexcept {
    std::atomic<std::uint64_t>& slot = b[e & (kBuckets - 1)];
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
  std::uint64_t per_bucket_;  // 2^64 / (window / kBuckets in ns)
  floor_kind floor_ = floor_kind::none;
  std::int64_t interval_ = 0;  // ns between floor retries
  std::int64_t burst_ = 0;     // ns the floor may run ahead of now
  std::int64_t capacity_ = 0;  // floor retries held at most, for figures()
  alignas(64) std::atomic<std::int64_t> tat_{std::numeric_limits<std::int64_t>::min() / 2};
  std::array<thread_buckets, detail::kThreadSlots + 1> requests_{};  // by thread slot
  buckets retries_{};        // drawn from the ratio
  buckets floor_retries_{};  // drawn from the floor, for figures()
};

}  // namespace keel
