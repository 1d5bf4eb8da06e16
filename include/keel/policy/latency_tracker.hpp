// keel/policy/latency_tracker.hpp — a percentile of recent latencies, learned
// online, shared by every thread that records into it.
//
// keel::hedge uses it to start a hedge "after the 95th percentile": the
// tracker keeps the last `samples` latencies in a lock-free ring and one
// recording thread recomputes the exact nearest-rank percentile over the
// window (others never wait): at `min_samples`, then every `refresh_every`
// recordings, and more often while the window fills — every eighth of what
// was recorded so far — so the estimate never lags more than refresh_every
// samples nor more than an eighth of them (after 100 samples it reflects 96,
// not the first 64). Until `min_samples` latencies are known, percentile()
// is empty and the caller uses its configured default.
//
// keel::adaptive_timeout estimates with it too: one estimator in keel.
//
// Example:
//
//   keel::latency_tracker p95({.percentile = 0.95, .samples = 512, .min_samples = 50});
//   p95.record(std::chrono::milliseconds(12));
//   std::optional<keel::duration> d = p95.percentile();   // empty until 50 samples
//
// Thread-safety: record() and percentile() are lock-free and may be called
// from any thread. The window's contents are relaxed: a refresh racing with
// recordings sees each slot's old or new value, never a torn one. record()
// takes its slot with a plain load and store of the count, not a locked
// increment (~6 ns of a ~60 ns call): two threads recording in the same few
// nanoseconds may take the same slot, and then one of their two latencies
// is not kept and recorded() counts them once. A window of recent samples
// estimates the same percentile without it. A refresh for the top k <= 8
// keeps a heap of them; for more, it selects among the samples above the
// last refresh's top k plus a margin (a pass without branches, then a
// selection among a few more than k).
#pragma once

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "keel/core/clock.hpp"
#include "keel/core/status.hpp"

namespace keel {

struct latency_tracker_options {
  double percentile = 0.95;  // in (0, 1)
  int samples = 512;         // window, in [16, 65536]
  int min_samples = 50;      // before this many, percentile() is empty; in [1, samples]
  int refresh_every = 32;    // recompute period in recordings, in [1, samples]

  [[nodiscard]] absl::Status validate() const {
    constexpr std::string_view who = "latency_tracker_options";
    if (!(percentile > 0.0 && percentile < 1.0))
      return detail::invalid_field(who, "percentile", "be in (0, 1)", percentile);
    if (samples < 16 || samples > 65536) return detail::invalid_field(who, "samples", "be in [16, 65536]", samples);
    if (min_samples < 1 || min_samples > samples)
      return detail::invalid_field(who, "min_samples", "be in [1, samples]", min_samples);
    if (refresh_every < 1 || refresh_every > samples)
      return detail::invalid_field(who, "refresh_every", "be in [1, samples]", refresh_every);
    return absl::OkStatus();
  }
};

class latency_tracker {
 public:
  // Throws keel::invalid_options if `o` is invalid.
  explicit latency_tracker(const latency_tracker_options& o = {})
      : options_((detail::require_valid(o.validate()), o)),
        ring_(std::make_unique<std::atomic<std::int64_t>[]>(static_cast<std::size_t>(o.samples))),
        scratch_(static_cast<std::size_t>(o.samples)),
        samples_(static_cast<std::uint64_t>(o.samples)),
        samples_mask_(std::has_single_bit(samples_) ? samples_ - 1 : 0),
        refresh_every_(static_cast<std::uint64_t>(o.refresh_every)),
        refresh_mask_(std::has_single_bit(refresh_every_) ? refresh_every_ - 1 : 0),
        min_samples_(static_cast<std::uint64_t>(o.min_samples)) {}
  latency_tracker(const latency_tracker&) = delete;
  latency_tracker& operator=(const latency_tracker&) = delete;

  [[nodiscard]] const latency_tracker_options& options() const noexcept { return options_; }

  // The percentile over the window, once min_samples latencies are known.
  [[nodiscard]] std::optional<duration> percentile() const noexcept {
    const std::int64_t p = percentile_ns_.load(std::memory_order_relaxed);
    if (p < 0) return std::nullopt;
    return duration(p);
  }

  // Latencies recorded so far (concurrent recordings that shared a slot count once).
  [[nodiscard]] std::uint64_t recorded() const noexcept { return written_.load(std::memory_order_relaxed); }

  void record(duration latency) noexcept {
    const std::uint64_t i = written_.load(std::memory_order_relaxed);
    written_.store(i + 1, std::memory_order_relaxed);
    // A power-of-two window (the usual case) takes a mask, not a division.
    ring_[samples_mask_ != 0 ? i & samples_mask_ : i % samples_].store(std::max<std::int64_t>(0, latency.count()),
                                                                        std::memory_order_relaxed);
    const std::uint64_t n = i + 1;
    if (n >= min_samples_ && due(n)) refresh(n);
  }

 private:
  // At min_samples, then every min(refresh_every, bit_floor(n) / 8) samples:
  // a power of two while the window fills, so the test is a mask there.
  [[nodiscard]] bool due(std::uint64_t n) const noexcept {
    if (n == min_samples_) return true;
    const std::uint64_t step = std::bit_floor(n) / 8;
    if (step < refresh_every_) return (n & (std::max<std::uint64_t>(step, 1) - 1)) == 0;
    return refresh_mask_ != 0 || refresh_every_ == 1 ? (n & refresh_mask_) == 0 : n % refresh_every_ == 0;
  }

  void refresh(std::uint64_t written) noexcept {
    if (refreshing_.exchange(true, std::memory_order_acquire)) return;  // someone else is on it
    const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(written, static_cast<std::uint64_t>(options_.samples)));
    // Nearest rank: the smallest sample with at least p of all samples at or
    // below it, i.e. the k-th largest for k = n - rank + 1.
    const auto rank =
        std::max<std::size_t>(1, static_cast<std::size_t>(std::ceil(options_.percentile * static_cast<double>(n))));
    const std::size_t k = n - rank + 1;
    if (k <= 8) {
      // A high percentile of a small window needs only the top k: one pass
      // with a min-heap of the largest k so far, its least in a register.
      // A new entrant is rare (about k ln(n / k) of n, fewer with ties), so
      // the scan is a load and a compare per sample.
      std::int64_t* const first = scratch_.data();
      std::int64_t* const last = first + k;
      for (std::size_t j = 0; j < k; ++j) first[j] = ring_[j].load(std::memory_order_relaxed);
      std::make_heap(first, last, std::greater<>());
      std::int64_t least = *first;
      for (std::size_t j = k; j < n; ++j) {
        const std::int64_t v = ring_[j].load(std::memory_order_relaxed);
        if (v > least) [[unlikely]] {
          std::pop_heap(first, last, std::greater<>());
          *(last - 1) = v;
          std::push_heap(first, last, std::greater<>());
          least = *first;
        }
      }
      publish(least);
      return;
    }
    // Larger k: the candidates are the samples at or above the floor the last refresh
    // left, which held its top k plus a margin; usually a few more than k.
    // If at least k samples are at or above it, the k-th largest is one of
    // them, so the answer stays exact. The scan is a load, a store and a
    // compare per sample, without a branch (a heap of the top k costs a
    // mispredicted branch and a heap update per new entrant).
    const std::int64_t floor = floor_;
    std::int64_t* const c0 = scratch_.data();
    std::size_t c = 0;
    for (std::size_t j = 0; j < n; ++j) {
      const std::int64_t v = ring_[j].load(std::memory_order_relaxed);
      c0[c] = v;
      c += v >= floor ? 1 : 0;
    }
    if (c < k) {  // the window moved below the floor: all of it
      for (std::size_t j = 0; j < n; ++j) c0[j] = ring_[j].load(std::memory_order_relaxed);
      c = n;
    }
    // Ascending order: the k-th largest of c sits at c - k.
    std::nth_element(c0, c0 + (c - k), c0 + c);
    const std::int64_t result = c0[c - k];
    // The next floor: the (k + margin)-th largest, below which lies [0, c - k).
    const std::size_t want = std::min(c, k + std::max<std::size_t>(8, k / 2));
    if (c - want < c - k) {
      std::nth_element(c0, c0 + (c - want), c0 + (c - k));
      floor_ = c0[c - want];
    } else {
      floor_ = result;
    }
    publish(result);
  }

  void publish(std::int64_t percentile) noexcept {
    percentile_ns_.store(percentile, std::memory_order_relaxed);
    refreshing_.store(false, std::memory_order_release);
  }

  latency_tracker_options options_;
  std::unique_ptr<std::atomic<std::int64_t>[]> ring_;
  std::vector<std::int64_t> scratch_;  // guarded by refreshing_
  std::uint64_t samples_;
  std::uint64_t samples_mask_;  // samples_ - 1 when a power of two, else 0
  std::uint64_t refresh_every_;
  std::uint64_t refresh_mask_;  // refresh_every_ - 1 when a power of two, else 0
  std::uint64_t min_samples_;
  std::atomic<std::uint64_t> written_{0};
  std::atomic<std::int64_t> percentile_ns_{-1};
  std::atomic<bool> refreshing_{false};
  std::int64_t floor_ = std::numeric_limits<std::int64_t>::min();  // guarded by refreshing_
};

}  // namespace keel
