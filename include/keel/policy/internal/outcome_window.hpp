// keel/policy/internal/outcome_window.hpp — the circuit breaker's state as
// numbers: its sliding windows of recent outcomes, the last N calls
// (count_window) or the calls of the last T (time_window, in buckets), and
// its state word (breaker_word: state, generation and probe counts in one
// 64-bit word, so one CAS moves any of them). The windows keep exact
// failure and slow-call totals under concurrent updates without a lock, so
// recording an outcome is a few relaxed atomics (keel/policy/circuit_breaker.hpp).
//
//   keel::detail::count_window w(100);
//   w.add(/*failed=*/true, /*slow=*/false);
//
// Thread-safety: add() and the readers may run from any thread at once; a
// reader may see a total mid-update, never one that drifts.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "keel/core/clock.hpp"
#include "keel/policy/events.hpp"

namespace keel::detail {

// i mod n without a division (Lemire's fastmod): `magic` is
// fast_mod_magic(n), n in [1, 65536].
[[nodiscard]] constexpr std::uint64_t fast_mod_magic(std::uint32_t n) noexcept { return ~std::uint64_t{0} / n + 1; }
[[nodiscard]] constexpr std::uint32_t fast_mod(std::uint32_t i, std::uint64_t magic, std::uint32_t n) noexcept {
  const std::uint64_t low = magic * i;
  // the high 64 bits of low * n, from two 32x32 products
  const std::uint64_t lo = (low & 0xffffffffu) * n;
  const std::uint64_t hi = (low >> 32) * n;
  return static_cast<std::uint32_t>((hi + (lo >> 32)) >> 32);
}

// Last N outcomes. Each slot holds bits (counted, failed, slow); the totals
// follow every slot change through exchange, so they stay exact under
// concurrency (a reader may see them mid-update, never drifting).
class count_window {
 public:
  explicit count_window(int n)
      : n_(static_cast<std::uint32_t>(n)),
        mod_(fast_mod_magic(static_cast<std::uint32_t>(n))),
        slots_(std::make_unique<std::atomic<std::uint8_t>[]>(static_cast<std::size_t>(n))) {}

  void add(bool failed, bool slow) noexcept {
    // A success into a window of successes only: it stays one whichever
    // slot it replaces, so skip the slot's claim (a locked increment shared
    // by every thread) and the write. A concurrent failure may then replace
    // a success as if it had come just after this one.
    if (!failed && !slow && calls_.load(std::memory_order_relaxed) == static_cast<int>(n_) &&
        failures_.load(std::memory_order_relaxed) == 0 && slow_.load(std::memory_order_relaxed) == 0)
      return;
    const auto v = static_cast<std::uint8_t>(1u | (failed ? 2u : 0u) | (slow ? 4u : 0u));
    const auto i = next_.fetch_add(1, std::memory_order_relaxed);
    std::atomic<std::uint8_t>& slot = slots_[index(i)];
    // A steady stream of successes replaces successes: nothing changes, so
    // skip the write (a race here can at worst lose one identical sample).
    if (slot.load(std::memory_order_relaxed) == v) return;
    apply(slot.exchange(v, std::memory_order_relaxed), v);
  }

  void reset() noexcept {
    for (std::uint32_t i = 0; i < n_; ++i) apply(slots_[i].exchange(0, std::memory_order_relaxed), 0);
  }

  struct totals {
    int calls, failures, slow;
  };
  [[nodiscard]] totals read() const noexcept {
    return {std::max(0, calls_.load(std::memory_order_relaxed)), std::max(0, failures_.load(std::memory_order_relaxed)),
            std::max(0, slow_.load(std::memory_order_relaxed))};
  }

 private:
  // The 32-bit index wraps after 4 billion calls, which at worst misplaces
  // one sample.
  [[nodiscard]] std::uint32_t index(std::uint32_t i) const noexcept { return fast_mod(i, mod_, n_); }
  void apply(std::uint8_t old, std::uint8_t now) noexcept {
    auto delta = [&](std::atomic<int>& total, unsigned bit) {
      const int d = ((now & bit) != 0 ? 1 : 0) - ((old & bit) != 0 ? 1 : 0);
      if (d != 0) total.fetch_add(d, std::memory_order_relaxed);
    };
    delta(calls_, 1u);
    delta(failures_, 2u);
    delta(slow_, 4u);
  }

  std::uint32_t n_;
  std::uint64_t mod_;
  std::unique_ptr<std::atomic<std::uint8_t>[]> slots_;
  alignas(64) std::atomic<std::uint32_t> next_{0};
  alignas(64) std::atomic<int> calls_{0};
  std::atomic<int> failures_{0};
  std::atomic<int> slow_{0};
};

// The calls of the last window_length, in buckets. Each counter packs
// (epoch << 32 | count): rolling a bucket over to a new epoch and counting
// in it is one CAS.
class time_window {
 public:
  time_window(duration length, duration width)
      : n_(static_cast<std::uint32_t>(length / width)),
        width_(width),
        buckets_(std::make_unique<bucket[]>(static_cast<std::size_t>(n_))) {}

  void add(time_point now, bool failed, bool slow) noexcept {
    const std::uint32_t e = epoch(now);
    bucket& b = buckets_[e % n_];
    bump(b.calls, e);
    if (failed) bump(b.failures, e);
    if (slow) bump(b.slow, e);
  }

  void reset() noexcept {
    for (std::uint32_t i = 0; i < n_; ++i) {
      buckets_[i].calls.store(0, std::memory_order_relaxed);
      buckets_[i].failures.store(0, std::memory_order_relaxed);
      buckets_[i].slow.store(0, std::memory_order_relaxed);
    }
  }

  [[nodiscard]] count_window::totals read(time_point now) const noexcept {
    const std::uint32_t e = epoch(now);
    count_window::totals t{0, 0, 0};
    for (std::uint32_t i = 0; i < n_; ++i) {
      t.calls += live(buckets_[i].calls, e);
      t.failures += live(buckets_[i].failures, e);
      t.slow += live(buckets_[i].slow, e);
    }
    return t;
  }

 private:
  struct bucket {
    std::atomic<std::uint64_t> calls{0}, failures{0}, slow{0};
  };
  [[nodiscard]] std::uint32_t epoch(time_point now) const noexcept {
    // +1 so that epoch 0 (an unused bucket) never looks current.
    return static_cast<std::uint32_t>(now.time_since_epoch() / width_) + 1;
  }
  static void bump(std::atomic<std::uint64_t>& w, std::uint32_t e) noexcept {
    std::uint64_t v = w.load(std::memory_order_relaxed);
    std::uint64_t next = 0;
    do {
      const auto we = static_cast<std::uint32_t>(v >> 32);
      // A bucket from an older epoch restarts; one from a newer epoch (the
      // clock went backwards) keeps counting rather than losing data.
      next = static_cast<std::int32_t>(e - we) > 0 ? (std::uint64_t{e} << 32) | 1u : v + 1;
    } while (!w.compare_exchange_weak(v, next, std::memory_order_relaxed));
  }
  [[nodiscard]] int live(const std::atomic<std::uint64_t>& w, std::uint32_t e) const noexcept {
    const std::uint64_t v = w.load(std::memory_order_relaxed);
    const auto we = static_cast<std::uint32_t>(v >> 32);
    if (we == 0) return 0;
    const std::uint32_t age = e - we;
    if (age < n_ || static_cast<std::int32_t>(age) < 0) return static_cast<int>(static_cast<std::uint32_t>(v));
    return 0;
  }

  std::uint32_t n_;
  duration width_;
  std::unique_ptr<bucket[]> buckets_;
};

// The breaker's state word and how to read it; circuit_breaker derives
// from it for the names.
struct breaker_word {
  // word_: state (3 bits) | generation (21) | probes admitted (10) |
  // probes succeeded (10) | failed (10) | ignored (10). One CAS moves any.
  static constexpr std::uint64_t kGenShift = 3, kAdmittedShift = 24, kSucceededShift = 34, kFailedShift = 44,
                                 kIgnoredShift = 54;
  static constexpr std::uint64_t kGenMask = (1u << 21) - 1, kCountMask = (1u << 10) - 1;
  static constexpr std::uint64_t kAdmittedOne = std::uint64_t{1} << kAdmittedShift;
  static constexpr std::uint64_t kSucceededOne = std::uint64_t{1} << kSucceededShift;
  static constexpr std::uint64_t kFailedOne = std::uint64_t{1} << kFailedShift;
  static constexpr std::uint64_t kIgnoredOne = std::uint64_t{1} << kIgnoredShift;

  static constexpr std::uint64_t pack(breaker_state s, std::uint32_t gen, int admitted, int succeeded,
                                      int failed) noexcept {
    return static_cast<std::uint64_t>(s) | ((gen & kGenMask) << kGenShift) |
           (static_cast<std::uint64_t>(admitted) << kAdmittedShift) |
           (static_cast<std::uint64_t>(succeeded) << kSucceededShift) |
           (static_cast<std::uint64_t>(failed) << kFailedShift);
  }
  static constexpr breaker_state state_of(std::uint64_t w) noexcept { return static_cast<breaker_state>(w & 7u); }
  static constexpr std::uint32_t gen_of(std::uint64_t w) noexcept {
    return static_cast<std::uint32_t>((w >> kGenShift) & kGenMask);
  }
  static constexpr int admitted_of(std::uint64_t w) noexcept {
    return static_cast<int>((w >> kAdmittedShift) & kCountMask);
  }
  static constexpr int succeeded_of(std::uint64_t w) noexcept {
    return static_cast<int>((w >> kSucceededShift) & kCountMask);
  }
  static constexpr int failed_of(std::uint64_t w) noexcept {
    return static_cast<int>((w >> kFailedShift) & kCountMask);
  }
  static constexpr int ignored_of(std::uint64_t w) noexcept {
    return static_cast<int>((w >> kIgnoredShift) & kCountMask);
  }
  // Probes of this period that came back (or were reclaimed).
  static constexpr int returned_of(std::uint64_t w) noexcept { return succeeded_of(w) + failed_of(w) + ignored_of(w); }
};

}  // namespace keel::detail
