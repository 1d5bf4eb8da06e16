// keel/policy/adaptive_throttle.hpp — client-side adaptive throttling: when the
// provider rejects most requests, most of them are rejected here instead.
//
// The formula is the one in Google's SRE book (chapter "Handling
// Overload"): over a sliding window, with `requests` the calls the
// application made (including the ones rejected here) and `accepts` the
// ones the provider accepted, each new call is rejected locally with
// probability
//
//   max(0, (requests - k * accepts) / (requests + 1))
//
// With k = 2 nothing is rejected while the provider accepts at least half;
// below that, the calls sent settle at about k times what the provider
// accepts, so it is not also flooded by callers it cannot serve.
//
// keel caps the probability at `max_reject` (0.9 by default; 1 gives the
// formula alone), as Envoy's admission control filter caps its own. The
// formula alone, once the provider accepts nothing, sends one call in
// (requests + 1): after it recovers, what is sent grows by about k times per
// window, so from one in 3,000 it takes about twelve windows (24 minutes
// with the book's two) to come back. From one in ten it takes about four.
//
// "Accepted" uses the classified outcome (keel/core/outcome.hpp): the
// provider answered — success, or a permanent error such as an invalid
// argument, which it took the trouble to refuse on purpose. Throttled,
// transient (unavailable, a read timed out) and ambiguous outcomes count as
// requests not accepted. Refused (keel declined further in) and cancelled
// outcomes did not reach the provider's judgement and count nowhere.
//
// Work classes shed in order: each class has its own k (for example
// interactive 2, batch 1.1), all judged against the same counts. A smaller
// k starts rejecting sooner and rejects more, so batch is shed first.
//
// A rejection is ResourceExhausted, not started, classified refused, with
// refused-by "adaptive_throttle:<name>:<class>" and no retry-after (trying
// again at once is what the throttle exists to prevent; a fallback may serve).
//
// Randomness is a keel::random_source (keel/policy/backoff.hpp); tests pass
// keel::testing::seeded_random for reproducible rejections.
//
// Example:
//
//   keel::adaptive_throttle throttle({.name = "llm", .window = std::chrono::minutes(2),
//                                     .classes = {{.name = "interactive", .k = 2.0}, {.name = "batch", .k = 1.1}},
//                                     .default_class = "interactive"});
//   auto pipe = keel::pipeline(throttle, keel::retry({.max_attempts = 2}));
//   // Standalone:
//   keel::time_point now = keel::real_clock{}.now();
//   if (throttle.allow(*throttle.class_index("batch"), now)) {
//     absl::Status s = send();
//     throttle.record(now, keel::default_classifier{}(s, {}));   // or record(now, s.ok())
//   }
//
// Cost: allow() sums the window's buckets (20 relaxed loads) and draws a
// random number only when the probability is above zero; record() is one
// or two CASes.
//
// Thread-safety: every operation is lock-free (but for the random source's
// own locking) and may be called from any thread.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "keel/core/call.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/outcome.hpp"
#include "keel/core/policy.hpp"
#include "keel/core/status.hpp"
#include "keel/core/telemetry.hpp"
#include "keel/policy/internal/short_key.hpp"
#include "keel/policy/backoff.hpp"
#include "keel/policy/events.hpp"

namespace keel {

struct adaptive_throttle_class {
  std::string name;
  // Accepts-to-requests slack before this class is rejected; in [1, 1000].
  double k = 2.0;
};

struct adaptive_throttle_options {
  // Names the throttle in refusals, events and figures; not empty.
  std::string name = "throttle";
  // k of the single class when `classes` is empty; in [1, 1000].
  double k = 2.0;
  // The highest probability of a local rejection; in [0, 1].
  double max_reject = 0.9;
  // How far back requests and accepts count; in [100ms, 24h].
  duration window = std::chrono::minutes(2);
  // Work classes by the call's work_class label; empty: one class for every call.
  std::vector<adaptive_throttle_class> classes{};
  // The class of calls whose work_class label is empty (with classes);
  // empty: such calls are refused.
  std::string default_class{};

  [[nodiscard]] absl::Status validate() const {
    constexpr std::string_view who = "adaptive_throttle_options";
    if (name.empty()) return detail::invalid_field(who, "name", "not be empty", "\"\"");
    if (!(k >= 1.0 && k <= 1000.0)) return detail::invalid_field(who, "k", "be in [1, 1000]", k);
    if (!(max_reject >= 0.0 && max_reject <= 1.0))
      return detail::invalid_field(who, "max_reject", "be in [0, 1]", max_reject);
    if (window < std::chrono::milliseconds(100) || window > std::chrono::hours(24))
      return detail::invalid_field(who, "window", "be in [100ms, 24h]", window);
    if (classes.size() > 64) return detail::invalid_field(who, "classes", "name at most 64 classes", classes.size());
    for (std::size_t i = 0; i < classes.size(); ++i) {
      const std::string field = absl::StrCat("classes[", i, "].");
      if (classes[i].name.empty()) return detail::invalid_field(who, field + "name", "not be empty", "\"\"");
      for (std::size_t j = 0; j < i; ++j)
        if (classes[j].name == classes[i].name)
          return detail::invalid_field(who, field + "name", "be unique", classes[i].name);
      if (!(classes[i].k >= 1.0 && classes[i].k <= 1000.0))
        return detail::invalid_field(who, field + "k", "be in [1, 1000]", classes[i].k);
    }
    if (!default_class.empty()) {
      bool found = false;
      for (const auto& c : classes) found = found || c.name == default_class;
      if (!found) return detail::invalid_field(who, "default_class", "name a class", default_class);
    }
    return absl::OkStatus();
  }
};

struct adaptive_throttle_figures {
  std::string_view name;
  std::int64_t requests = 0;  // in the window, including local rejections
  std::int64_t accepts = 0;   // in the window
  std::int64_t rejected = 0;  // rejected locally since construction, all classes
};

struct adaptive_throttle_class_figures {
  std::string_view name;
  double k = 2.0;
  double reject_probability = 0;  // at the moment asked
  std::int64_t allowed = 0;
  std::int64_t rejected = 0;
};

namespace detail {

// Counts over a sliding window of ten buckets; each bucket packs
// (epoch << 32 | count) so that rolling it over and counting is one CAS.
class window_counts {
 public:
  static constexpr int kBuckets = 10;

  explicit window_counts(duration window) noexcept
      : per_bucket_ns_(static_cast<double>(kBuckets) / static_cast<double>(window.count())) {}

  // A multiply, not a division; monotone in `now`.
  [[nodiscard]] std::uint32_t epoch(time_point now) const noexcept {
    return static_cast<std::uint32_t>(
        static_cast<std::int64_t>(static_cast<double>(now.time_since_epoch().count()) * per_bucket_ns_));
  }

  using buckets = std::array<std::atomic<std::uint64_t>, kBuckets>;

  static void add(buckets& b, std::uint32_t e) noexcept {
    std::atomic<std::uint64_t>& slot = b[e % kBuckets];
    std::uint64_t v = slot.load(std::memory_order_relaxed);
    std::uint64_t next = 0;
    do {
      const auto slot_epoch = static_cast<std::uint32_t>(v >> 32);
      // Older epoch: stale, restart it. Newer (the clock went back): keep counting.
      next = static_cast<std::int32_t>(e - slot_epoch) > 0 ? (std::uint64_t{e} << 32) | 1u : v + 1;
    } while (!slot.compare_exchange_weak(v, next, std::memory_order_relaxed));
  }

  [[nodiscard]] static std::int64_t sum(const buckets& b, std::uint32_t e) noexcept {
    std::int64_t total = 0;
    for (const auto& slot : b) {
      const std::uint64_t v = slot.load(std::memory_order_relaxed);
      const std::uint32_t age = e - static_cast<std::uint32_t>(v >> 32);
      if (age < kBuckets || static_cast<std::int32_t>(age) < 0) total += static_cast<std::uint32_t>(v);
    }
    return total;
  }

 private:
  double per_bucket_ns_;
};

}  // namespace detail

template <random_source Random = thread_local_random>
class adaptive_throttle {
 public:
  // Throws keel::invalid_options if `o` is invalid.
  explicit adaptive_throttle(adaptive_throttle_options o, Random random = {})
      : options_((detail::require_valid(o.validate()), std::move(o))),
        random_(std::move(random)),
        counts_(options_.window),
        classes_(std::make_unique<class_state[]>(std::max<std::size_t>(1, options_.classes.size()))) {
    if (options_.classes.empty()) {
      classes_[0].k = options_.k;
      default_class_ = 0;
    }
    for (std::size_t i = 0; i < options_.classes.size(); ++i) classes_[i].k = options_.classes[i].k;
    if (!options_.default_class.empty()) default_class_ = class_index(options_.default_class);
  }
  adaptive_throttle(const adaptive_throttle&) = delete;
  adaptive_throttle& operator=(const adaptive_throttle&) = delete;

  [[nodiscard]] const adaptive_throttle_options& options() const noexcept { return options_; }
  [[nodiscard]] std::size_t classes() const noexcept { return std::max<std::size_t>(1, options_.classes.size()); }
  [[nodiscard]] std::optional<std::size_t> class_index(std::string_view name) const noexcept {
    for (std::size_t i = 0; i < options_.classes.size(); ++i)
      if (detail::key_equals(options_.classes[i].name, name)) return i;
    return std::nullopt;
  }
  [[nodiscard]] std::string_view class_name(std::size_t cls) const noexcept {
    return options_.classes.empty() ? std::string_view("default") : std::string_view(options_.classes[cls].name);
  }

  // min(max_reject, max(0, (requests - k * accepts) / (requests + 1))) for class `cls` at `now`.
  [[nodiscard]] double reject_probability(std::size_t cls, time_point now) const noexcept {
    const std::uint32_t e = counts_.epoch(now);
    return probability(classes_[cls].k, detail::window_counts::sum(requests_, e),
                       detail::window_counts::sum(accepts_, e));
  }

  // Whether a call of class `cls` may go to the provider now. A rejection
  // counts as a request; an allowed call is counted by record() when it ends.
  [[nodiscard]] bool allow(std::size_t cls, time_point now) {
    class_state& c = classes_[cls];
    const std::uint32_t e = counts_.epoch(now);
    const double p =
        probability(c.k, detail::window_counts::sum(requests_, e), detail::window_counts::sum(accepts_, e));
    if (p > 0.0 && static_cast<double>(random_.uniform(0, kScale - 1)) < p * static_cast<double>(kScale)) {
      detail::window_counts::add(requests_, e);
      c.rejected.fetch_add(1, std::memory_order_relaxed);
      return false;
    }
    c.allowed.fetch_add(1, std::memory_order_relaxed);
    return true;
  }

  // An allowed call ended at `now`; `accepted`: the provider answered it.
  void record(time_point now, bool accepted) noexcept {
    const std::uint32_t e = counts_.epoch(now);
    detail::window_counts::add(requests_, e);
    if (accepted) detail::window_counts::add(accepts_, e);
  }

  // The same by classified outcome: success and permanent are accepted;
  // transient, throttled and ambiguous are not; refused and cancelled count nowhere.
  void record(time_point now, outcome_kind kind) noexcept {
    if (!provider_outcome(kind)) return;
    record(now, kind == outcome_kind::success || kind == outcome_kind::permanent);
  }

  // The status for a local rejection of class `cls` (allocates: refusal paths only).
  [[nodiscard]] absl::Status refusal(std::size_t cls, time_point now) const {
    const std::uint32_t e = counts_.epoch(now);
    const std::int64_t requests = detail::window_counts::sum(requests_, e);
    const std::int64_t accepts = detail::window_counts::sum(accepts_, e);
    const std::string_view name = class_name(cls);
    return keel::refusal(
        absl::ResourceExhaustedError(absl::StrCat(
            "keel: adaptive throttle '", options_.name, "' rejected class '", detail::to_absl(name),
            "' locally: the provider accepted ", accepts, " of ", requests, " requests in the last ",
            detail::describe(options_.window), " (reject probability ",
            probability(classes_[cls].k, requests, accepts), ")")),
        absl::StrCat("adaptive_throttle:", options_.name, ":", detail::to_absl(name)));
  }

  [[nodiscard]] adaptive_throttle_figures figures(time_point now) const noexcept {
    const std::uint32_t e = counts_.epoch(now);
    adaptive_throttle_figures f{options_.name, detail::window_counts::sum(requests_, e),
                                detail::window_counts::sum(accepts_, e), 0};
    for (std::size_t i = 0; i < classes(); ++i) f.rejected += classes_[i].rejected.load(std::memory_order_relaxed);
    return f;
  }

  [[nodiscard]] adaptive_throttle_class_figures figures(std::size_t cls, time_point now) const noexcept {
    const class_state& c = classes_[cls];
    return {class_name(cls), c.k, reject_probability(cls, now), c.allowed.load(std::memory_order_relaxed),
            c.rejected.load(std::memory_order_relaxed)};
  }

  // The policy: a pass of the call's work_class (or default_class) is
  // allowed or rejected at plan.now; its classified outcome is recorded at
  // the time it ended.
  template <class Ctx, class Next>
  auto execute(Ctx& ctx, const attempt_plan& plan, Next& next) -> decltype(next(ctx, plan)) {
    using R = decltype(next(ctx, plan));
    const std::string_view label = ctx.call.labels().work_class;
    const std::optional<std::size_t> cls =
        label.empty() || options_.classes.empty() ? default_class_ : class_index(label);
    if (!cls) [[unlikely]] {
      observe(ctx.listener, events::adaptive_throttle_rejected{ctx.call, options_.name, label, 1.0});
      return R(unknown_class(label));
    }
    if (!allow(*cls, plan.now)) [[unlikely]] {
      observe(ctx.listener, events::adaptive_throttle_rejected{ctx.call, options_.name, class_name(*cls),
                                                               reject_probability(*cls, plan.now)});
      return R(refusal(*cls, plan.now));
    }
    const time_point start = plan.now;
    R r = next(ctx, plan);
    const absl::Status& s = status_of(r);
    if (s.ok()) [[likely]] {
      record(ctx.attempt_end(start), true);
    } else {
      const outcome_kind k = ctx.classify(s);
      if (provider_outcome(k)) record(ctx.attempt_end(start), k);
    }
    return r;
  }

 private:
  static constexpr std::int64_t kScale = std::int64_t{1} << 24;

  [[nodiscard]] double probability(double k, std::int64_t requests, std::int64_t accepts) const noexcept {
    const double r = static_cast<double>(requests);
    return std::clamp((r - k * static_cast<double>(accepts)) / (r + 1.0), 0.0, options_.max_reject);
  }

  [[gnu::cold]] absl::Status unknown_class(std::string_view label) const {
    return with_outcome(
        with_refused_by(mark_not_started(absl::InvalidArgumentError(absl::StrCat(
                            "keel: adaptive throttle '", options_.name, "' has no class for work_class '",
                            detail::to_absl(label), "'"))),
                        absl::StrCat("adaptive_throttle:", options_.name)),
        outcome_kind::permanent);
  }

  struct class_state {
    double k = 2.0;
    alignas(64) std::atomic<std::int64_t> allowed{0};
    std::atomic<std::int64_t> rejected{0};
  };

  adaptive_throttle_options options_;
  Random random_;
  detail::window_counts counts_;
  std::unique_ptr<class_state[]> classes_;
  std::optional<std::size_t> default_class_;
  alignas(64) detail::window_counts::buckets requests_{};
  alignas(64) detail::window_counts::buckets accepts_{};
};

}  // namespace keel
