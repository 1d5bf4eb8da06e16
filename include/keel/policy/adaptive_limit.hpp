// keel/policy/adaptive_limit.hpp — a concurrency limit that follows what the
// provider can take, instead of a number an operator guessed.
//
// The limit grows while latency stays near its baseline (the provider's
// latency when nothing queues) and shrinks when queueing shows, in the
// family of TCP Vegas and the gradient limits (Netflix's concurrency-limits,
// Envoy's adaptive concurrency filter, failsafe-go's adaptive limiter):
//
//   every `window` completed calls, with m their mean latency:
//     m <= baseline * tolerance   limit += sqrt(limit)         (when it was used:
//                                                              at least half in flight)
//     m >  baseline * tolerance   limit *= max(0.5, baseline * tolerance / m)
//   a window in which a share f of the calls came back throttled, unavailable
//   or timed out shrinks by at least that: limit *= min(gradient, 1 - f/2).
//   The limit stays within [min_limit, max_limit].
//
// The baseline is measured, never inferred from the latency under load: at
// the start and every `probe_interval` (stretched by up to `probe_jitter`
// of itself, so replicas do not probe in step) the limiter lowers the limit
// to `probe_limit`, as Envoy's filter does, takes the mean of the next
// `probe_samples` calls admitted at that concurrency (calls admitted before
// the probe do not count: their latency carries the old queue), sets the
// baseline from it and restores the limit. So queueing of our own making is
// never mistaken for the provider's speed. (Between probes the baseline
// stays put: a running minimum of window means, as in Vegas, sinks below
// the true mean when latency varies as much as a model's does, and the
// limit then shrinks for no reason.) A probe costs about
// probe_samples / probe_limit call latencies at low concurrency per
// interval: with the defaults and 1 s calls, 8 s in every 60.
//
// The failure this guards against: in a long incident the baseline drifts
// up to the incident's latency, the limit stops shrinking, and the limiter
// stops shedding just when it is needed (reported of Netflix's Gradient2,
// which learns its baseline as a long average of latency: concurrency-limits
// issue #137, pull request #88). Here the baseline moves only by a probe at
// low concurrency, and a probe may raise it to at most `max_drift` times the
// floor: the lowest probe measurement of the last one to two
// `drift_horizon`s. A provider more than max_drift times slower than its
// floor keeps being shed for the horizon; a latency that lasts longer is the
// provider's new normal, and the limit follows it then.
//
// Work classes shed in order: each class may fill only its `share` of the
// limit (for example interactive 1.0, batch 0.5). As the limit shrinks,
// batch reaches its share first and is refused while interactive calls are
// still admitted.
//
// A refusal is ResourceExhausted, not started, classified refused, with
// refused-by "adaptive_limit:<name>:<class>" and no retry-after: the limiter
// sheds because the provider is saturated, so no time is known at which
// trying again is better than going elsewhere (a fallback). There is no
// queue: put a keel::bulkhead outside it where callers should wait.
//
// Example:
//
//   keel::adaptive_limit limit({.name = "llm", .initial_limit = 16, .max_limit = 256,
//                               .classes = {{.name = "interactive"}, {.name = "batch", .share = 0.5}},
//                               .default_class = "interactive"});
//   // As a policy next to the provider (inside retry: each attempt is one sample):
//   auto pipe = keel::pipeline(keel::retry({.max_attempts = 2}), limit);
//   // Standalone:
//   if (keel::adaptive_limit_permit p = limit.try_acquire(*limit.class_index("batch"))) {
//     const keel::time_point start = keel::real_clock{}.now();
//     run_job();
//     const keel::time_point end = keel::real_clock{}.now();
//     p.release(end - start, end, keel::limit_sample::ok);
//   }
//
// Cost: acquiring is one load of the limit word and one CAS on the in-flight
// count; releasing with a sample is one decrement and one CAS on the
// window's word. The in-flight count and the window share one cache line,
// so two threads contend for one line, as on a bulkhead's word; admissions
// are counted per thread. Once per window one thread takes a mutex to move
// the limit.
//
// Thread-safety: every operation may be called from any thread; a permit
// may be released on another thread than the one that acquired it.
// try_acquire, limit and in_flight are lock-free; a release with a sample
// is too, except for the thread that completes a window (it takes the
// mutex to move the limit); figures() takes the mutex.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "keel/core/call.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/internal/thread_slot.hpp"
#include "keel/core/outcome.hpp"
#include "keel/core/policy.hpp"
#include "keel/core/status.hpp"
#include "keel/core/telemetry.hpp"
#include "keel/policy/internal/short_key.hpp"
#include "keel/policy/events.hpp"

namespace keel {

struct adaptive_limit_class {
  std::string name;
  // The part of the limit this class may fill, in (0, 1]; at least one
  // class has 1.
  double share = 1.0;
};

struct adaptive_limit_options {
  // Names the limiter in refusals, events and figures; not empty.
  std::string name = "adaptive";
  int initial_limit = 20;  // in [min_limit, max_limit]
  int min_limit = 1;       // in [1, max_limit]
  int max_limit = 1000;    // in [1, 1000000]
  // Latency up to baseline * tolerance counts as "near the baseline"; in [1, 100].
  // 2 suits latencies as variable as an exponential's; steadier ones can take less.
  double tolerance = 2.0;
  // Completed calls per limit update; in [4, 255].
  int window = 32;
  // How often the baseline is re-measured at low concurrency; in [1ms, 24h].
  duration probe_interval = std::chrono::seconds(60);
  // Each interval is stretched by a random share of itself up to this, so
  // that replicas started together do not all probe at once (Envoy's filter
  // jitters its probes too); in [0, 1]. 0: exactly probe_interval.
  double probe_jitter = 0.1;
  // Seeds the jitter; 0: a seed of its own per limiter.
  std::uint64_t jitter_seed = 0;
  // The limit while re-measuring (never above max_limit); in [1, 1000000].
  int probe_limit = 4;
  // Calls measured per probe; in [1, 255]. Their mean is the baseline, so
  // fewer than about 30 make it as noisy as the latency.
  int probe_samples = 32;
  // A probe raises the baseline to at most max_drift times the floor (the
  // lowest probe of the last one to two drift_horizons); >= 1, or infinity
  // to let it follow any probe.
  double max_drift = 2.0;
  // >= probe_interval.
  duration drift_horizon = std::chrono::hours(1);
  // Work classes by the call's work_class label; empty: one class for every call.
  std::vector<adaptive_limit_class> classes{};
  // The class of calls whose work_class label is empty (with classes);
  // empty: such calls are refused.
  std::string default_class{};

  [[nodiscard]] absl::Status validate() const {
    constexpr std::string_view who = "adaptive_limit_options";
    if (name.empty()) return detail::invalid_field(who, "name", "not be empty", "\"\"");
    if (max_limit < 1 || max_limit > 1000000)
      return detail::invalid_field(who, "max_limit", "be in [1, 1000000]", max_limit);
    if (min_limit < 1 || min_limit > max_limit)
      return detail::invalid_field(who, "min_limit", "be in [1, max_limit]", min_limit);
    if (initial_limit < min_limit || initial_limit > max_limit)
      return detail::invalid_field(who, "initial_limit", "be in [min_limit, max_limit]", initial_limit);
    if (!(tolerance >= 1.0 && tolerance <= 100.0))
      return detail::invalid_field(who, "tolerance", "be in [1, 100]", tolerance);
    if (window < 4 || window > 255) return detail::invalid_field(who, "window", "be in [4, 255]", window);
    if (probe_interval < std::chrono::milliseconds(1) || probe_interval > std::chrono::hours(24))
      return detail::invalid_field(who, "probe_interval", "be in [1ms, 24h]", probe_interval);
    if (!(probe_jitter >= 0.0 && probe_jitter <= 1.0))
      return detail::invalid_field(who, "probe_jitter", "be in [0, 1]", probe_jitter);
    if (probe_limit < 1 || probe_limit > 1000000)
      return detail::invalid_field(who, "probe_limit", "be in [1, 1000000]", probe_limit);
    if (probe_samples < 1 || probe_samples > 255)
      return detail::invalid_field(who, "probe_samples", "be in [1, 255]", probe_samples);
    if (!(max_drift >= 1.0)) return detail::invalid_field(who, "max_drift", "be >= 1", max_drift);
    if (drift_horizon < probe_interval)
      return detail::invalid_field(who, "drift_horizon", "be >= probe_interval", drift_horizon);
    if (classes.size() > 64) return detail::invalid_field(who, "classes", "name at most 64 classes", classes.size());
    bool full = classes.empty();
    for (std::size_t i = 0; i < classes.size(); ++i) {
      const std::string field = absl::StrCat("classes[", i, "].");
      if (classes[i].name.empty()) return detail::invalid_field(who, field + "name", "not be empty", "\"\"");
      for (std::size_t j = 0; j < i; ++j)
        if (classes[j].name == classes[i].name)
          return detail::invalid_field(who, field + "name", "be unique", classes[i].name);
      if (!(classes[i].share > 0.0 && classes[i].share <= 1.0))
        return detail::invalid_field(who, field + "share", "be in (0, 1]", classes[i].share);
      full = full || classes[i].share == 1.0;
    }
    if (!full) return detail::invalid_field(who, "classes", "give at least one class share 1", classes.size());
    if (!default_class.empty()) {
      bool found = false;
      for (const auto& c : classes) found = found || c.name == default_class;
      if (!found) return detail::invalid_field(who, "default_class", "name a class", default_class);
    }
    return absl::OkStatus();
  }
};

// How a call that held a permit ended, for the limit.
enum class limit_sample : std::uint8_t {
  ok,       // the provider answered (success, or a permanent error): its latency counts
  dropped,  // throttled, unavailable or timed out: counts, and as a sign of overload
};

[[nodiscard]] constexpr std::string_view to_string(limit_sample k) noexcept {
  return k == limit_sample::ok ? "ok" : "dropped";
}

// The limiter at one moment (each value exact; the set is not one atomic
// snapshot while calls run).
struct adaptive_limit_figures {
  std::string_view name;
  int limit = 0;
  int in_flight = 0;
  bool probing = false;
  duration baseline{};     // zero until the first probe has ended
  duration floor{};        // what bounds the baseline's drift
  duration last_sample{};  // the latest window's mean latency
  std::int64_t updates = 0;
  std::int64_t probes = 0;  // probes ended
  std::int64_t admitted = 0;
  std::int64_t rejected = 0;
};

struct adaptive_limit_class_figures {
  std::string_view name;
  double share = 1.0;
  std::int64_t admitted = 0;
  std::int64_t rejected = 0;
};

class adaptive_limit;

// One unit of an adaptive limit's concurrency. Move-only; given back exactly
// once: with a latency sample by release(latency, now, kind), without one by
// release() or destruction (a call that was refused further in or cancelled
// says nothing about the provider).
class adaptive_limit_permit {
 public:
  adaptive_limit_permit() noexcept = default;
  adaptive_limit_permit(adaptive_limit_permit&& o) noexcept
      : owner_(std::exchange(o.owner_, nullptr)), cls_(o.cls_), epoch_(o.epoch_) {}
  adaptive_limit_permit& operator=(adaptive_limit_permit&& o) noexcept {
    if (this != &o) {
      release();
      owner_ = std::exchange(o.owner_, nullptr);
      cls_ = o.cls_;
      epoch_ = o.epoch_;
    }
    return *this;
  }
  adaptive_limit_permit(const adaptive_limit_permit&) = delete;
  adaptive_limit_permit& operator=(const adaptive_limit_permit&) = delete;
  ~adaptive_limit_permit() { release(); }

  [[nodiscard]] explicit operator bool() const noexcept { return owner_ != nullptr; }
  [[nodiscard]] std::size_t work_class() const noexcept { return cls_; }

  // Gives the permit back without a sample (idempotent).
  void release() noexcept;
  // Gives it back with the call's latency, ending at `now` (idempotent).
  // `listener` receives events::adaptive_limit_changed if the limit moves.
  template <class Listener = null_listener>
  void release(duration latency, time_point now, limit_sample kind, const Listener& listener = {});

 private:
  friend class adaptive_limit;
  adaptive_limit_permit(adaptive_limit* owner, std::uint16_t cls, std::uint32_t epoch) noexcept
      : owner_(owner), cls_(cls), epoch_(epoch) {}

  adaptive_limit* owner_ = nullptr;
  std::uint16_t cls_ = 0;
  std::uint32_t epoch_ = 0;
};

class adaptive_limit {
 public:
  // Throws keel::invalid_options if `o` is invalid.
  explicit adaptive_limit(adaptive_limit_options o)
      : options_((detail::require_valid(o.validate()), std::move(o))),
        classes_(std::make_unique<class_state[]>(std::max<std::size_t>(1, options_.classes.size()))),
        limit_(options_.initial_limit) {
    for (std::size_t i = 0; i < options_.classes.size(); ++i) classes_[i].share = options_.classes[i].share;
    if (!options_.default_class.empty()) default_class_ = class_index(options_.default_class);
    if (options_.classes.empty()) default_class_ = 0;
    rng_ = options_.jitter_seed != 0 ? options_.jitter_seed
                                     : reinterpret_cast<std::uintptr_t>(this) ^ (next_seed().fetch_add(1) << 32);
    // Start with a probe: the first baseline is measured at low concurrency.
    saved_limit_ = limit_;
    start_probe_locked();
  }
  adaptive_limit(const adaptive_limit&) = delete;
  adaptive_limit& operator=(const adaptive_limit&) = delete;

  [[nodiscard]] const adaptive_limit_options& options() const noexcept { return options_; }
  [[nodiscard]] std::size_t classes() const noexcept { return std::max<std::size_t>(1, options_.classes.size()); }
  [[nodiscard]] std::optional<std::size_t> class_index(std::string_view name) const noexcept {
    for (std::size_t i = 0; i < options_.classes.size(); ++i)
      if (detail::key_equals(options_.classes[i].name, name)) return i;
    return std::nullopt;
  }
  [[nodiscard]] std::string_view class_name(std::size_t cls) const noexcept {
    return options_.classes.empty() ? std::string_view("default") : std::string_view(options_.classes[cls].name);
  }

  // The current limit (probe_limit while probing).
  [[nodiscard]] int limit() const noexcept { return limit_of(state_.load(std::memory_order_acquire)); }
  [[nodiscard]] int in_flight() const noexcept { return in_flight_.load(std::memory_order_relaxed); }

  // A permit of class `cls` if its share of the limit has room now. Lock-free.
  [[nodiscard]] adaptive_limit_permit try_acquire(std::size_t cls) noexcept {
    class_state& c = classes_[cls];
    const std::uint64_t s = state_.load(std::memory_order_acquire);
    const int room = c.share == 1.0 ? limit_of(s) : static_cast<int>(c.share * limit_of(s));
    int n = in_flight_.load(std::memory_order_relaxed);
    while (n < room) {
      if (in_flight_.compare_exchange_weak(n, n + 1, std::memory_order_acquire, std::memory_order_relaxed)) {
        // A statistic: a racing store may lose a higher peak, never invent one.
        if (n + 1 > peak_.load(std::memory_order_relaxed)) peak_.store(n + 1, std::memory_order_relaxed);
        c.admitted.add();
        return adaptive_limit_permit(this, static_cast<std::uint16_t>(cls), epoch_of(s));
      }
    }
    c.rejected.fetch_add(1, std::memory_order_relaxed);
    return {};
  }

  // The status for a refusal of class `cls` (allocates: refusal paths only).
  [[nodiscard]] absl::Status refusal(std::size_t cls) const {
    const std::string_view name = class_name(cls);
    const int limit = this->limit();
    absl::Status s = absl::ResourceExhaustedError(
        absl::StrCat("keel: adaptive limit '", options_.name, "' refused class '", detail::to_absl(name),
                     "': ", in_flight(), " in flight, limit ", limit,
                     classes_[cls].share < 1.0 ? absl::StrCat(", of which this class may fill ",
                                                              static_cast<int>(classes_[cls].share * limit))
                                               : std::string()));
    return keel::refusal(std::move(s), absl::StrCat("adaptive_limit:", options_.name, ":", detail::to_absl(name)));
  }

  [[nodiscard]] adaptive_limit_figures figures() const {
    adaptive_limit_figures f;
    f.name = options_.name;
    const std::uint64_t s = state_.load(std::memory_order_acquire);
    f.limit = limit_of(s);
    f.probing = probing_of(s);
    f.in_flight = in_flight();
    for (std::size_t i = 0; i < classes(); ++i) {
      f.admitted += classes_[i].admitted.read();
      f.rejected += classes_[i].rejected.load(std::memory_order_relaxed);
    }
    std::lock_guard lock(mu_);
    f.baseline = baseline_;
    f.floor = std::min(floor_now_, floor_before_) == duration::max() ? duration::zero()
                                                                    : std::min(floor_now_, floor_before_);
    f.last_sample = last_sample_;
    f.updates = updates_;
    f.probes = probes_;
    return f;
  }

  [[nodiscard]] adaptive_limit_class_figures figures(std::size_t cls) const noexcept {
    return {class_name(cls), classes_[cls].share, classes_[cls].admitted.read(),
            classes_[cls].rejected.load(std::memory_order_relaxed)};
  }

  // The policy: a permit of the call's work_class (or default_class) for
  // the pass; the pass's latency is a sample unless it was refused further
  // in or cancelled.
  template <class Ctx, class Next>
  auto execute(Ctx& ctx, const attempt_plan& plan, Next& next) -> decltype(next(ctx, plan)) {
    using R = decltype(next(ctx, plan));
    const std::string_view label = ctx.call.labels().work_class;
    const std::optional<std::size_t> cls =
        label.empty() || options_.classes.empty() ? default_class_ : class_index(label);
    if (!cls) [[unlikely]] {
      observe(ctx.listener, events::adaptive_limit_rejected{ctx.call, options_.name, label, limit(), in_flight()});
      return R(unknown_class(label));
    }
    adaptive_limit_permit p = try_acquire(*cls);
    if (!p) [[unlikely]] {
      observe(ctx.listener,
              events::adaptive_limit_rejected{ctx.call, options_.name, class_name(*cls), limit(), in_flight()});
      return R(refusal(*cls));
    }
    const time_point start = plan.now;
    R r = next(ctx, plan);
    const absl::Status& s = status_of(r);
    if (s.ok()) [[likely]] {
      const time_point end = ctx.attempt_end(start);
      p.release(end - start, end, limit_sample::ok, ctx.listener);
      return r;
    }
    switch (ctx.classify(s)) {
      case outcome_kind::permanent: {
        const time_point end = ctx.attempt_end(start);
        p.release(end - start, end, limit_sample::ok, ctx.listener);
        break;
      }
      case outcome_kind::transient:
      case outcome_kind::throttled:
      case outcome_kind::ambiguous: {
        const time_point end = ctx.attempt_end(start);
        p.release(end - start, end, limit_sample::dropped, ctx.listener);
        break;
      }
      default: break;  // refused further in, or cancelled: no sample
    }
    return r;
  }

 private:
  friend class adaptive_limit_permit;

  // state_: epoch (31 bits) << 33 | probing << 32 | limit (32 bits).
  static std::atomic<std::uint64_t>& next_seed() noexcept {
    static std::atomic<std::uint64_t> seed{0x5eed};
    return seed;
  }

  static constexpr int limit_of(std::uint64_t s) noexcept { return static_cast<int>(s & 0xffffffffu); }
  static constexpr bool probing_of(std::uint64_t s) noexcept { return ((s >> 32) & 1u) != 0; }
  static constexpr std::uint32_t epoch_of(std::uint64_t s) noexcept { return static_cast<std::uint32_t>(s >> 33); }
  static constexpr std::uint64_t make_state(std::uint32_t epoch, bool probing, int limit) noexcept {
    return (std::uint64_t{epoch & 0x7fffffffu} << 33) | (std::uint64_t{probing} << 32) |
           static_cast<std::uint32_t>(limit);
  }

  // window_: epoch tag (8 bits) << 56 | count (8) << 48 | dropped (8) << 40 | latency sum in us (40 bits).
  // The tag keeps a sample taken under one epoch (before a probe began or
  // ended) out of another epoch's window.
  static constexpr std::uint64_t tag_of(std::uint64_t w) noexcept { return w >> 56; }
  static constexpr int count_of(std::uint64_t w) noexcept { return static_cast<int>((w >> 48) & 0xffu); }
  static constexpr int dropped_of(std::uint64_t w) noexcept { return static_cast<int>((w >> 40) & 0xffu); }
  static constexpr std::uint64_t sum_of(std::uint64_t w) noexcept { return w & ((std::uint64_t{1} << 40) - 1); }
  static constexpr std::uint64_t empty_window(std::uint32_t epoch) noexcept {
    return std::uint64_t{epoch & 0xffu} << 56;
  }

  struct class_state {
    double share = 1.0;
    // Bumped by every admission: per-thread cells, so two threads admitting
    // do not fight over one line (a shared counter cost a fifth of a
    // two-thread acquire + release).
    detail::sharded_count admitted;
    std::atomic<std::int64_t> rejected{0};  // refusal paths only
  };

  [[gnu::cold]] absl::Status unknown_class(std::string_view label) const {
    return with_outcome(
        with_refused_by(mark_not_started(absl::InvalidArgumentError(absl::StrCat(
                            "keel: adaptive limit '", options_.name, "' has no class for work_class '",
                            detail::to_absl(label), "'"))),
                        absl::StrCat("adaptive_limit:", options_.name)),
        outcome_kind::permanent);
  }

  void release_unsampled() noexcept { in_flight_.fetch_sub(1, std::memory_order_release); }

  template <class Listener>
  void release(std::uint32_t epoch, duration latency, time_point now, limit_sample kind, const Listener& listener) {
    // The state first: its line is another, and the decrement and the
    // window's CAS below then follow each other on the hot line.
    const std::uint64_t s = state_.load(std::memory_order_acquire);
    in_flight_.fetch_sub(1, std::memory_order_release);
    const std::uint32_t current = epoch_of(s);
    // While probing, only calls admitted at the probe's concurrency count.
    if (probing_of(s) && epoch != current) return;
    const int target = probing_of(s) ? options_.probe_samples : options_.window;
    constexpr std::int64_t kMaxUs = (std::int64_t{1} << 32) - 1;  // 71 minutes per sample
    const auto us = static_cast<std::uint64_t>(
        std::clamp<std::int64_t>(std::chrono::duration_cast<std::chrono::microseconds>(latency).count(), 0, kMaxUs));
    const std::uint64_t drop = kind == limit_sample::dropped ? std::uint64_t{1} << 40 : 0;
    const std::uint64_t add = (std::uint64_t{1} << 48) | drop | us;
    std::uint64_t w = window_.load(std::memory_order_relaxed);
    for (;;) {
      if (tag_of(w) != (current & 0xffu)) return;  // the window belongs to another epoch
      const std::uint64_t next = w + add;
      if (count_of(next) >= target) {
        if (window_.compare_exchange_weak(w, empty_window(current), std::memory_order_acq_rel)) {
          update(current, count_of(next), dropped_of(next), sum_of(next), now, listener);
          return;
        }
      } else if (window_.compare_exchange_weak(w, next, std::memory_order_relaxed)) {
        return;
      }
    }
  }

  // One full window of `count` samples, taken in `epoch`.
  template <class Listener>
  void update(std::uint32_t epoch, int count, int dropped, std::uint64_t sum_us, time_point now,
              const Listener& listener) {
    const duration mean = std::max<duration>(
        std::chrono::microseconds(1), std::chrono::microseconds(static_cast<std::int64_t>(sum_us) / count));
    int from = 0, to = 0;
    bool probing = false;
    duration baseline{};
    {
      std::lock_guard lock(mu_);
      if (epoch != epoch_) return;  // a window of an epoch that has ended meanwhile
      last_sample_ = mean;
      ++updates_;
      from = limit_of(state_.load(std::memory_order_relaxed));
      if (probing_) {
        end_probe_locked(mean, now);
      } else {
        const double limit = limit_;
        const double near = static_cast<double>(baseline_.count()) * options_.tolerance;
        double gradient = std::clamp(near / static_cast<double>(mean.count()), 0.5, 1.0);
        if (dropped > 0) gradient = std::min(gradient, 1.0 - 0.5 * dropped / count);
        double next = limit;
        if (gradient < 1.0) {
          next = limit * gradient;
        } else if (peak_.load(std::memory_order_relaxed) * 2 >= static_cast<int>(limit)) {
          next = limit + std::sqrt(limit);  // grow only a limit that is in use
        }
        limit_ = std::clamp(next, static_cast<double>(options_.min_limit), static_cast<double>(options_.max_limit));
        if (now >= next_probe_) {
          // The window still counts; the probe comes after it.
          saved_limit_ = limit_;
          start_probe_locked();
        } else {
          publish_locked();
        }
      }
      peak_.store(in_flight(), std::memory_order_relaxed);
      to = limit_of(state_.load(std::memory_order_relaxed));
      probing = probing_;
      baseline = baseline_;
    }
    if (from != to) observe(listener, events::adaptive_limit_changed{options_.name, from, to, baseline, mean, probing});
  }

  void start_probe_locked() {
    probing_ = true;
    epoch_ = (epoch_ + 1) & 0x7fffffffu;
    state_.store(make_state(epoch_, true, std::min(options_.probe_limit, options_.max_limit)),
                 std::memory_order_release);
    window_.store(empty_window(epoch_), std::memory_order_release);
  }

  void end_probe_locked(duration measured, time_point now) {
    // The floor: the lowest probe of this horizon and the one before.
    if (!horizon_started_ || now - horizon_start_ >= options_.drift_horizon) {
      // A horizon with no probe at all leaves nothing to remember.
      const bool adjacent = horizon_started_ && now - horizon_start_ < 2 * options_.drift_horizon;
      floor_before_ = adjacent ? floor_now_ : duration::max();
      floor_now_ = duration::max();
      horizon_start_ = now;
      horizon_started_ = true;
    }
    floor_now_ = std::min(floor_now_, measured);
    const duration floor = std::min(floor_now_, floor_before_);
    duration cap = duration::max();
    if (std::isfinite(options_.max_drift)) {
      const double c = static_cast<double>(floor.count()) * options_.max_drift;
      cap = c >= static_cast<double>(duration::max().count()) ? duration::max()
                                                              : duration(static_cast<duration::rep>(c));
    }
    baseline_ = std::min(measured, cap);
    ++probes_;
    probing_ = false;
    limit_ = saved_limit_;
    next_probe_ = now + options_.probe_interval + jitter_locked();
    epoch_ = (epoch_ + 1) & 0x7fffffffu;
    publish_locked();
    window_.store(empty_window(epoch_), std::memory_order_release);
  }

  // A random share of the interval up to probe_jitter (splitmix64: no
  // dependency, and reproducible from jitter_seed).
  duration jitter_locked() {
    if (options_.probe_jitter <= 0.0) return duration::zero();
    std::uint64_t z = (rng_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    const double u = static_cast<double>(z >> 11) * 0x1.0p-53;  // [0, 1)
    return duration(static_cast<duration::rep>(
        u * options_.probe_jitter * static_cast<double>(options_.probe_interval.count())));
  }

  void publish_locked() {
    const int l = std::clamp(static_cast<int>(limit_), options_.min_limit, options_.max_limit);
    const int published = probing_ ? std::min(options_.probe_limit, options_.max_limit) : l;
    const std::uint64_t s = make_state(epoch_, probing_, published);
    // An unchanged limit is not stored again: every call reads this line.
    if (state_.load(std::memory_order_relaxed) != s) state_.store(s, std::memory_order_release);
  }

  adaptive_limit_options options_;
  std::unique_ptr<class_state[]> classes_;
  std::optional<std::size_t> default_class_;

  // Read on every call, written once per window at most: a line of its own,
  // so the words every call writes do not evict it.
  alignas(64) std::atomic<std::uint64_t> state_{0};
  // The words every call writes, on one line on purpose: a release
  // decrements in_flight_ and then adds to window_, an acquire bumps
  // in_flight_ and reads peak_, so each takes the line once and finds the
  // rest of its work there. (Apart, a release moved two lines between the
  // cores and an acquire a third for peak_: 3.4x the bulkhead at two threads.)
  alignas(64) std::atomic<int> in_flight_{0};
  std::atomic<int> peak_{0};
  std::atomic<std::uint64_t> window_{0};

  // Under mu_: the controller (off the hot line).
  alignas(64) mutable std::mutex mu_;
  double limit_ = 0;
  double saved_limit_ = 0;
  bool probing_ = false;
  std::uint32_t epoch_ = 0;
  duration baseline_{};
  duration last_sample_{};
  duration floor_now_ = duration::max();
  duration floor_before_ = duration::max();
  time_point horizon_start_{};
  bool horizon_started_ = false;
  time_point next_probe_{};
  std::uint64_t rng_ = 0;
  std::int64_t updates_ = 0;
  std::int64_t probes_ = 0;
};

inline void adaptive_limit_permit::release() noexcept {
  if (owner_ == nullptr) return;
  std::exchange(owner_, nullptr)->release_unsampled();
}

template <class Listener>
void adaptive_limit_permit::release(duration latency, time_point now, limit_sample kind, const Listener& listener) {
  if (owner_ == nullptr) return;
  std::exchange(owner_, nullptr)->release(epoch_, latency, now, kind, listener);
}

}  // namespace keel
