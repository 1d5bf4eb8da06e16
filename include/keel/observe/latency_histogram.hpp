// keel/observe/latency_histogram.hpp — a latency histogram for hot paths: lock-free,
// allocation-free recording, mergeable, with percentiles that are never
// below the true value and at most a known relative error above it.
//
// Buckets are log-linear (as in HDR histograms): every power of two is split
// into S = 2^precision_bits equal sub-buckets, and values below 2S
// nanoseconds get a bucket each. A value v >= 2S nanoseconds lands in a
// bucket [lower, upper] of width 2^(floor(log2 v) - precision_bits) <= v / S,
// so any value in the bucket is within v / S of v. With the default
// precision_bits = 7 (S = 128) that is 0.79 %, for 4,563 buckets (36 KiB) up
// to `highest` = 1 hour; values above `highest` are counted in one overflow
// bucket.
//
// Percentile (what percentile(q) reports, precisely):
//   - the nearest rank: for n recorded values sorted x_1 <= ... <= x_n and
//     q in (0, 1], the rank is r = ceil(q * n) (at least 1), the true
//     percentile is x_r;
//   - reported: min(upper edge of the bucket holding x_r, max()), so
//         x_r <= percentile(q) <= x_r + x_r / S       (x_r <= highest)
//     i.e. never below the true value, relative error below 2^-precision_bits
//     (exact for x_r < 2S ns); above `highest` the overflow bucket reports
//     max(), still never below.
//   - percentile(0) is min() and percentile(1) is max(), both exact.
// count, sum, min and max are exact.
//
// Example:
//
//   keel::latency_histogram h;                       // 7 bits, up to 1 h
//   h.record(std::chrono::milliseconds(12));         // lock-free, no allocation
//   keel::latency_histogram_snapshot s = h.snapshot();
//   keel::duration p99 = s.percentile(0.99);         // >= the true p99, < 0.8 % above
//   absl::Status merged = s.merge(other.snapshot()); // same or finer precision
//
// Thread-safety: record() and merge() into a live histogram may run from any
// number of threads at once (relaxed atomics: each bucket, the sum, min and
// max are exact; a snapshot taken while others record sees each field at some
// moment, so count() may include a value whose sum is not in yet).
// Snapshots are plain values: use one from one thread, or copy it.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <new>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "keel/core/clock.hpp"
#include "keel/core/status.hpp"

namespace keel {

struct latency_histogram_options {
  // 2^precision_bits sub-buckets per power of two; relative error < 2^-bits.
  int precision_bits = 7;  // in [1, 12]
  // Largest value kept at full precision; above it, an overflow bucket.
  duration highest = std::chrono::hours(1);  // > 0

  [[nodiscard]] absl::Status validate() const {
    if (precision_bits < 1 || precision_bits > 12)
      return detail::invalid_field("latency_histogram_options", "precision_bits", "be in [1, 12]", precision_bits);
    if (highest <= duration::zero())
      return detail::invalid_field("latency_histogram_options", "highest", "be > 0", highest);
    return absl::OkStatus();
  }
};

namespace detail {

// The nearest rank of quantile q among n values: ceil(q * n), in [1, n].
// A product that is an integer but for rounding (0.99 * 100) is that integer.
[[nodiscard]] inline std::uint64_t nearest_rank(double q, std::uint64_t n) noexcept {
  if (n == 0) return 0;
  const long double x = static_cast<long double>(q) * static_cast<long double>(n);
  long double r = std::ceil(x - x * 1e-12L);
  if (r < 1) r = 1;
  if (r > static_cast<long double>(n)) r = static_cast<long double>(n);
  return static_cast<std::uint64_t>(r);
}

// The bucket arithmetic, shared by the live histogram and its snapshots.
//   shift(v) = max(0, floor(log2 v) - p),  index(v) = shift * S + (v >> shift)
// Values below 2S have index v; above, index / S - 1 is the shift and
// index - shift * S the sub-bucket's leading bits m in [S, 2S).
struct log_linear_layout {
  int precision = 7;
  std::size_t regular = 0;  // buckets up to index(highest); the overflow bucket is index `regular`
  std::uint64_t highest = 0;

  log_linear_layout() = default;
  log_linear_layout(int p, std::uint64_t h) noexcept : precision(p), regular(index(p, h) + 1), highest(h) {}

  [[nodiscard]] static std::size_t index(int p, std::uint64_t v) noexcept {
    const int width = std::bit_width(v);  // floor(log2 v) + 1, 0 for v == 0
    const int shift = width - 1 - p > 0 ? width - 1 - p : 0;
    return (static_cast<std::size_t>(shift) << p) + static_cast<std::size_t>(v >> shift);
  }
  [[nodiscard]] std::size_t slot(std::uint64_t v) const noexcept { return v > highest ? regular : index(precision, v); }
  [[nodiscard]] std::size_t slots() const noexcept { return regular + 1; }

  // Smallest and largest value of regular bucket i.
  [[nodiscard]] std::uint64_t lower(std::size_t i) const noexcept {
    const std::size_t s = std::size_t{1} << precision;
    if (i < 2 * s) return i;
    const std::size_t shift = i / s - 1;
    return static_cast<std::uint64_t>(i - shift * s) << shift;
  }
  [[nodiscard]] std::uint64_t upper(std::size_t i) const noexcept {
    const std::size_t s = std::size_t{1} << precision;
    if (i < 2 * s) return i;
    const std::size_t shift = i / s - 1;
    return ((static_cast<std::uint64_t>(i - shift * s) + 1) << shift) - 1;
  }
};

[[nodiscard]] inline std::uint64_t histogram_ns(duration d) noexcept {
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(d).count();
  return ns < 0 ? 0 : static_cast<std::uint64_t>(ns);  // a clock step backwards is recorded as 0
}

}  // namespace detail

class latency_histogram;

// A histogram's counts at one moment: a plain value to query, merge and
// subtract. Empty snapshots (default-constructed) take the layout of the
// first snapshot merged into them.
class latency_histogram_snapshot {
 public:
  latency_histogram_snapshot() = default;
  // An empty snapshot with this layout. Throws keel::invalid_options.
  explicit latency_histogram_snapshot(const latency_histogram_options& o)
      : layout_((detail::require_valid(o.validate()), o.precision_bits), detail::histogram_ns(o.highest)),
        counts_(layout_.slots(), 0) {}

  [[nodiscard]] std::uint64_t count() const noexcept { return count_; }
  // Sum of the recorded values (exact; wraps after 292 years of total latency).
  [[nodiscard]] duration sum() const noexcept { return as_duration(sum_); }
  [[nodiscard]] duration min() const noexcept { return as_duration(count_ == 0 ? 0 : min_); }
  [[nodiscard]] duration max() const noexcept { return as_duration(max_); }
  [[nodiscard]] duration mean() const noexcept {
    return count_ == 0 ? duration::zero() : as_duration(sum_ / count_);
  }
  [[nodiscard]] int precision_bits() const noexcept { return layout_.precision; }
  // The bound on percentile()'s overestimate, relative to the true value.
  [[nodiscard]] double relative_error() const noexcept { return std::ldexp(1.0, -layout_.precision); }

  // The nearest-rank percentile, never below the true value (see the header
  // comment). q is clamped to [0, 1]; an empty snapshot reports zero.
  [[nodiscard]] duration percentile(double q) const noexcept {
    if (count_ == 0) return duration::zero();
    if (!(q > 0.0)) return min();
    const std::uint64_t rank = detail::nearest_rank(std::min(q, 1.0), count_);
    std::uint64_t seen = 0;
    for (std::size_t i = 0; i < counts_.size(); ++i) {
      seen += counts_[i];
      if (seen >= rank) return as_duration(i == layout_.regular ? max_ : std::min(layout_.upper(i), max_));
    }
    return max();
  }

  // Adds `other`'s values. Exact when other's precision is the same or finer
  // (its buckets nest in ours); a coarser one is refused.
  [[nodiscard]] absl::Status merge(const latency_histogram_snapshot& other) {
    if (other.counts_.empty()) return absl::OkStatus();
    if (counts_.empty()) {
      *this = other;
      return absl::OkStatus();
    }
    if (other.layout_.precision < layout_.precision) {
      return absl::InvalidArgumentError(
          absl::StrCat("keel: cannot merge a latency histogram of precision_bits ", other.layout_.precision,
                       " into one of precision_bits ", layout_.precision, ": its buckets are coarser"));
    }
    other.for_each_slot([&](std::uint64_t lower, bool overflow, std::uint64_t n) {
      counts_[overflow ? layout_.regular : layout_.slot(lower)] += n;
    });
    if (other.count_ != 0) {
      min_ = count_ == 0 ? other.min_ : std::min(min_, other.min_);
      max_ = std::max(max_, other.max_);
    }
    count_ += other.count_;
    sum_ += other.sum_;
    return absl::OkStatus();
  }

  // What was recorded after `earlier` (a snapshot of the same histogram
  // taken before this one): counts and sum are exact; min() and max() become
  // bounds from the bucket edges (true min >= min(), true max <= max()), so
  // percentiles stay never below the true value.
  [[nodiscard]] absl::StatusOr<latency_histogram_snapshot> since(const latency_histogram_snapshot& earlier) const {
    if (earlier.counts_.empty()) return *this;
    if (earlier.layout_.precision != layout_.precision || earlier.layout_.regular != layout_.regular) {
      return absl::InvalidArgumentError("keel: latency histogram snapshots with different layouts");
    }
    latency_histogram_snapshot d(*this);
    d.count_ = 0;
    for (std::size_t i = 0; i < counts_.size(); ++i) {
      if (earlier.counts_[i] > counts_[i]) {
        return absl::InvalidArgumentError("keel: the earlier latency snapshot has more values than this one");
      }
      d.counts_[i] = counts_[i] - earlier.counts_[i];
      d.count_ += d.counts_[i];
    }
    d.sum_ = sum_ - earlier.sum_;
    d.min_ = 0;
    d.max_ = 0;
    bool first = true;
    for (std::size_t i = 0; i < d.counts_.size(); ++i) {
      if (d.counts_[i] == 0) continue;
      if (first) d.min_ = i == layout_.regular ? layout_.highest + 1 : std::max(layout_.lower(i), min_);
      first = false;
      d.max_ = i == layout_.regular ? max_ : std::min(layout_.upper(i), max_);
    }
    return d;
  }

  // Calls f(lower_ns, upper_ns, count) for every non-empty bucket in order;
  // the overflow bucket's range is (highest, max()].
  template <class F>
  void for_each_bucket(F&& f) const {
    for (std::size_t i = 0; i < counts_.size(); ++i) {
      if (counts_[i] == 0) continue;
      if (i == layout_.regular) {
        f(layout_.highest + 1, max_, counts_[i]);
      } else {
        f(layout_.lower(i), layout_.upper(i), counts_[i]);
      }
    }
  }

 private:
  friend class latency_histogram;

  template <class F>
  void for_each_slot(F&& f) const {
    for (std::size_t i = 0; i < counts_.size(); ++i) {
      if (counts_[i] != 0) f(i == layout_.regular ? 0 : layout_.lower(i), i == layout_.regular, counts_[i]);
    }
  }

  static duration as_duration(std::uint64_t ns) noexcept {
    return std::chrono::duration_cast<duration>(std::chrono::nanoseconds(static_cast<std::int64_t>(ns)));
  }

  detail::log_linear_layout layout_{};
  std::vector<std::uint64_t> counts_;  // empty: no layout yet
  std::uint64_t count_ = 0;
  std::uint64_t sum_ = 0;
  std::uint64_t min_ = 0;
  std::uint64_t max_ = 0;
};

class latency_histogram {
  static_assert(std::atomic<std::uint64_t>::is_always_lock_free, "recording must be lock-free");

 public:
  // Allocates every bucket up front. Throws keel::invalid_options.
  explicit latency_histogram(const latency_histogram_options& o = {})
      : options_((detail::require_valid(o.validate()), o)),
        layout_(o.precision_bits, detail::histogram_ns(o.highest)),
        counts_(std::make_unique<std::atomic<std::uint64_t>[]>(layout_.slots())) {}
  latency_histogram(const latency_histogram&) = delete;
  latency_histogram& operator=(const latency_histogram&) = delete;

  [[nodiscard]] const latency_histogram_options& options() const noexcept { return options_; }

  // Records one value (negative: as zero). Lock-free, no allocation: one
  // bucket increment, one add to this thread's share of the sum, and a
  // compare for min and max (a CAS only when either moves).
  void record(duration d) noexcept { record_ns(detail::histogram_ns(d)); }

  void record_ns(std::uint64_t v) noexcept {
    counts_[layout_.slot(v)].fetch_add(1, std::memory_order_relaxed);
    sums_[detail_stripe()].value.fetch_add(v, std::memory_order_relaxed);
    std::uint64_t lo = min_.load(std::memory_order_relaxed);
    while (v < lo && !min_.compare_exchange_weak(lo, v, std::memory_order_relaxed)) {
    }
    std::uint64_t hi = max_.load(std::memory_order_relaxed);
    while (v > hi && !max_.compare_exchange_weak(hi, v, std::memory_order_relaxed)) {
    }
  }

  // The counts now. Allocates the snapshot's buckets.
  [[nodiscard]] latency_histogram_snapshot snapshot() const {
    latency_histogram_snapshot s;
    s.layout_ = layout_;
    s.counts_.resize(layout_.slots());
    for (std::size_t i = 0; i < s.counts_.size(); ++i) {
      s.counts_[i] = counts_[i].load(std::memory_order_relaxed);
      s.count_ += s.counts_[i];
    }
    for (const auto& part : sums_) s.sum_ += part.value.load(std::memory_order_relaxed);
    const std::uint64_t lo = min_.load(std::memory_order_relaxed);
    s.min_ = lo == kNoMin ? 0 : lo;
    s.max_ = max_.load(std::memory_order_relaxed);
    return s;
  }

  // Adds another histogram's (or snapshot's) values to this one; the source
  // must have the same or a finer precision. Safe while others record.
  [[nodiscard]] absl::Status merge(const latency_histogram& other) { return merge(other.snapshot()); }
  [[nodiscard]] absl::Status merge(const latency_histogram_snapshot& s) {
    if (s.counts_.empty()) return absl::OkStatus();
    if (s.layout_.precision < layout_.precision) {
      return absl::InvalidArgumentError(
          absl::StrCat("keel: cannot merge a latency histogram of precision_bits ", s.layout_.precision,
                       " into one of precision_bits ", layout_.precision, ": its buckets are coarser"));
    }
    s.for_each_slot([&](std::uint64_t lower, bool overflow, std::uint64_t n) {
      counts_[overflow ? layout_.regular : layout_.slot(lower)].fetch_add(n, std::memory_order_relaxed);
    });
    sums_[detail_stripe()].value.fetch_add(s.sum_, std::memory_order_relaxed);
    if (s.count_ != 0) {
      std::uint64_t lo = min_.load(std::memory_order_relaxed);
      while (s.min_ < lo && !min_.compare_exchange_weak(lo, s.min_, std::memory_order_relaxed)) {
      }
      std::uint64_t hi = max_.load(std::memory_order_relaxed);
      while (s.max_ > hi && !max_.compare_exchange_weak(hi, s.max_, std::memory_order_relaxed)) {
      }
    }
    return absl::OkStatus();
  }

 private:
  static constexpr std::uint64_t kNoMin = std::numeric_limits<std::uint64_t>::max();
  // The sum is the one word every record writes; striping it by thread keeps
  // two recording threads from bouncing one cache line on every value.
  static constexpr std::size_t kStripes = 8;
  struct alignas(64) stripe {
    std::atomic<std::uint64_t> value{0};
  };
  static std::size_t detail_stripe() noexcept {
    static std::atomic<std::size_t> next{0};
    thread_local const std::size_t mine = next.fetch_add(1, std::memory_order_relaxed) % kStripes;
    return mine;
  }

  latency_histogram_options options_;
  detail::log_linear_layout layout_;
  std::unique_ptr<std::atomic<std::uint64_t>[]> counts_;
  std::array<stripe, kStripes> sums_{};
  alignas(64) std::atomic<std::uint64_t> min_{kNoMin};
  std::atomic<std::uint64_t> max_{0};
};

}  // namespace keel
