// keel/policy/chaos.hpp — chaos stages for a service's own drills: inject a
// fault, latency or a chosen outcome into a pipeline, at a rate, for chosen
// labels; off until an operator turns them on.
//
// Three stages, as Polly's chaos strategies:
//
//   keel::chaos_fault        returns a chosen absl::Status instead of calling inward
//   keel::chaos_latency      waits, on the run context's clock, before calling inward
//   keel::chaos_outcome<T>   returns a chosen result (a fake success) instead of calling inward
//
// Each is shared state held by reference in a pipeline, placed where the
// drill wants the trouble: next to the provider (below keel::retry) to act
// as a misbehaving provider per attempt, or outermost to act on the whole
// call. Each is off by default. Off, a stage does one relaxed atomic load
// and a branch, then calls inward; the injection path is out of line.
// Measured (docs/benchmarks.md, "Chaos stages"): two stages off next to the
// provider add 6 ns per call to a four-stage pipeline of 103 ns on a quiet
// machine (up to 24 ns loaded: two more levels of its inlined call chain),
// outermost nothing measurable; 0 allocations. On, it checks the
// call's labels against `when` (each non-empty field must equal the call's
// label: tenant, model, endpoint, region, work class), then draws: the k-th
// call a stage evaluates is hit when splitmix64(seed, k) falls under the
// rate. The same seed and the same sequence of calls give the same hits, so
// a drill reproduces; with calls on several threads the sequence is the
// order they reached the stage. Give replicas different seeds to
// decorrelate them.
//
// What the caller hears:
//   - a fault is the chosen status, exactly: it is classified as that
//     status says (Unavailable is transient and retried, InvalidArgument
//     permanent, DeadlineExceeded ambiguous for a write unless marked not
//     started), by the pipeline's classifier. It carries the payload
//     `keel.dev/chaos` (the stage's name; keel::chaos_injected(status)), so
//     logs can tell a drill from an outage. The provider is not invoked, so
//     the call's attempt count does not grow; a retry layer counts its own.
//   - latency waits `delay` on ctx.clock from the pass's start, then calls
//     inward with plan.now read again. The wait ends early at the plan's
//     deadline (DeadlineExceeded, not started: transient, nothing was sent)
//     and on the plan's stop token (Cancelled, not started): a drill never
//     outlives the caller's deadline or keeps a cancelled caller waiting.
//   - an outcome is `outcome` converted to the pipeline's result type: for
//     absl::StatusOr<std::string>, a std::string (or a StatusOr); for
//     absl::Status, a status (OK by default).
// Each injection reports events::chaos_injected (keel/policy/events.hpp) to
// the run context's listener; keel::metrics_listener counts it as
// keel_chaos_injections_total{stage,kind}.
//
// Run time: enable(), disable(), set_rate(), and for latency set_delay(),
// from any thread while calls run. Each setting is its own atomic: a call
// sees each one's latest value or the one before. What is injected (the
// status, the outcome) and `when` are fixed at construction; build another
// stage for another fault.
//
// Example (a drill: 5% of acme's calls to m-large fail as unavailable, and
// 10% wait 800 ms):
//
//   keel::chaos_fault outage({.name = "acme-outage", .rate = 0.05,
//                             .fault = absl::UnavailableError("drill: provider down"),
//                             .when = {.tenant = "acme", .model = "m-large"}, .seed = 7});
//   keel::chaos_latency slow({.name = "slow", .rate = 0.1, .delay = std::chrono::milliseconds(800)});
//   auto pipe = keel::pipeline(keel::retry({.max_attempts = 3}), outage, slow).in(env);
//   outage.enable();               // from an admin endpoint, while traffic flows
//   (void)slow.set_rate(0.25);     // InvalidArgument outside [0, 1]
//   outage.disable();
//
// Thread-safety: execute() and every setter and reader may run on any
// number of threads at once; lock-free.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "keel/core/call.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/outcome.hpp"
#include "keel/core/policy.hpp"
#include "keel/core/status.hpp"
#include "keel/core/telemetry.hpp"
#include "keel/policy/events.hpp"

namespace keel {

// The payload an injected fault carries: the chaos stage's name.
inline constexpr std::string_view chaos_payload = "keel.dev/chaos";

// The name of the chaos stage that injected `s`, if one did.
[[nodiscard]] inline std::optional<std::string> chaos_injected(const absl::Status& s) {
  auto p = s.GetPayload(detail::to_absl(chaos_payload));
  if (!p) return std::nullopt;
  return std::string(*p);
}

// Which calls a chaos stage may touch: every non-empty field must equal the
// call's label of that name; all empty: every call.
struct chaos_selector {
  std::string tenant{};
  std::string model{};
  std::string endpoint{};
  std::string region{};
  std::string work_class{};

  [[nodiscard]] bool matches(const keel::labels& l) const noexcept {
    auto ok = [](const std::string& want, std::string_view got) noexcept { return want.empty() || want == got; };
    return ok(tenant, l.tenant) && ok(model, l.model) && ok(endpoint, l.endpoint) && ok(region, l.region) &&
           ok(work_class, l.work_class);
  }
};

// What a chaos stage has done, and how it is set at the moment.
struct chaos_figures {
  std::string_view name;
  chaos_kind kind = chaos_kind::fault;
  bool enabled = false;
  double rate = 0;
  std::int64_t evaluated = 0;  // calls that matched `when` while enabled
  std::int64_t injected = 0;
};

namespace detail {

[[nodiscard]] inline absl::Status validate_chaos(std::string_view who, const std::string& name, double rate) {
  if (name.empty()) return invalid_field(who, "name", "not be empty", "\"\"");
  if (!(rate >= 0.0 && rate <= 1.0)) return invalid_field(who, "rate", "be in [0, 1]", rate);
  return absl::OkStatus();
}

// Latencies above a day are a typo, and now + delay must not overflow.
inline constexpr duration max_chaos_delay = std::chrono::hours(24);

[[nodiscard]] inline absl::Status validate_chaos_delay(std::string_view who, duration delay) {
  if (delay < duration::zero() || delay > max_chaos_delay)
    return invalid_field(who, "delay", "be in [0s, 24h]", delay);
  return absl::OkStatus();
}

// SplitMix64's finaliser: a counter turned into well-mixed bits.
[[nodiscard]] constexpr std::uint64_t splitmix64(std::uint64_t x) noexcept {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The part every chaos stage shares: the switch, the rate, the selector and
// a reproducible draw.
class chaos_switch {
 public:
  chaos_switch(std::string name, chaos_kind kind, bool enabled, double rate, chaos_selector when,
               std::uint64_t seed)
      : name_(std::move(name)), kind_(kind), when_(std::move(when)), seed_(seed), rate_(rate), enabled_(enabled) {}
  chaos_switch(const chaos_switch&) = delete;
  chaos_switch& operator=(const chaos_switch&) = delete;

  // The hot path when off: one relaxed load.
  [[nodiscard]] bool enabled() const noexcept { return enabled_.load(std::memory_order_relaxed); }
  void set_enabled(bool on) noexcept { enabled_.store(on, std::memory_order_relaxed); }

  [[nodiscard]] absl::Status set_rate(std::string_view who, double rate) {
    if (!(rate >= 0.0 && rate <= 1.0)) return invalid_field(who, "rate", "be in [0, 1]", rate);
    rate_.store(rate, std::memory_order_relaxed);
    return absl::OkStatus();
  }
  [[nodiscard]] double rate() const noexcept { return rate_.load(std::memory_order_relaxed); }

  // Whether this call is hit: it matches `when` and the next draw falls
  // under the rate. Counts what it evaluates and hits.
  [[nodiscard]] bool hit(const keel::labels& labels) noexcept {
    if (!when_.matches(labels)) return false;
    const std::uint64_t k = draws_.fetch_add(1, std::memory_order_relaxed);
    const double u = static_cast<double>(splitmix64(seed_ ^ splitmix64(k)) >> 11) * 0x1p-53;  // [0, 1)
    if (!(u < rate_.load(std::memory_order_relaxed))) return false;
    injected_.fetch_add(1, std::memory_order_relaxed);
    return true;
  }

  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  [[nodiscard]] chaos_figures figures() const noexcept {
    return {.name = name_,
            .kind = kind_,
            .enabled = enabled(),
            .rate = rate(),
            .evaluated = static_cast<std::int64_t>(draws_.load(std::memory_order_relaxed)),
            .injected = injected_.load(std::memory_order_relaxed)};
  }

 private:
  std::string name_;
  chaos_kind kind_;
  chaos_selector when_;
  std::uint64_t seed_;
  std::atomic<double> rate_;
  std::atomic<std::uint64_t> draws_{0};
  std::atomic<std::int64_t> injected_{0};
  std::atomic<bool> enabled_;
};

}  // namespace detail

// --- faults

struct chaos_fault_options {
  // Names the stage in events, figures and the injected status; not empty.
  std::string name = "fault";
  // Off by default: enable() turns it on.
  bool enabled = false;
  // The share of matching calls that get the fault; in [0, 1].
  double rate = 0.0;
  // What the caller hears; not OK. Mark it not started
  // (keel::mark_not_started) to say nothing was sent.
  absl::Status fault = absl::UnavailableError("keel chaos: injected fault");
  chaos_selector when{};
  std::uint64_t seed = 1;

  [[nodiscard]] absl::Status validate() const {
    constexpr std::string_view who = "chaos_fault_options";
    if (absl::Status s = detail::validate_chaos(who, name, rate); !s.ok()) return s;
    if (fault.ok()) return detail::invalid_field(who, "fault", "not be OK (use keel::chaos_outcome)", "OK");
    return absl::OkStatus();
  }
};

class chaos_fault {
 public:
  // Throws keel::invalid_options if `o` is invalid.
  explicit chaos_fault(chaos_fault_options o)
      : fault_((detail::require_valid(o.validate()), mark(std::move(o.fault), o.name))),
        switch_(std::move(o.name), chaos_kind::fault, o.enabled, o.rate, std::move(o.when), o.seed) {}

  template <class Ctx, class Next>
  auto execute(Ctx& ctx, attempt_plan plan, Next& next) -> decltype(next(ctx, plan)) {
    if (!switch_.enabled()) [[likely]] return next(ctx, plan);
    return drill(ctx, plan, next);
  }

 private:
  // Out of line, so that the off path above inlines to a load and a branch.
  template <class Ctx, class Next>
  [[gnu::noinline, gnu::cold]] auto drill(Ctx& ctx, const attempt_plan& given, Next& next)
      -> decltype(next(ctx, attempt_plan{})) {
    attempt_plan plan = given;
    using R = decltype(next(ctx, plan));
    if (!switch_.hit(ctx.call.labels())) return next(ctx, plan);
    observe(ctx.listener, events::chaos_injected{.call = ctx.call,
                                                 .stage = switch_.name(),
                                                 .kind = chaos_kind::fault,
                                                 .delay = duration::zero(),
                                                 .fault = fault_});
    return R(fault_);  // a copy shares the status's representation: no allocation
  }

 public:
  void enable() noexcept { switch_.set_enabled(true); }
  void disable() noexcept { switch_.set_enabled(false); }
  void set_enabled(bool on) noexcept { switch_.set_enabled(on); }
  // InvalidArgument, naming the field, outside [0, 1]; the rate is then unchanged.
  [[nodiscard]] absl::Status set_rate(double rate) { return switch_.set_rate("chaos_fault", rate); }
  [[nodiscard]] bool enabled() const noexcept { return switch_.enabled(); }
  [[nodiscard]] double rate() const noexcept { return switch_.rate(); }
  // The status injected, with its keel.dev/chaos payload.
  [[nodiscard]] const absl::Status& fault() const noexcept { return fault_; }
  [[nodiscard]] chaos_figures figures() const noexcept { return switch_.figures(); }

 private:
  static absl::Status mark(absl::Status s, const std::string& name) {
    s.SetPayload(detail::to_absl(chaos_payload), absl::Cord(detail::to_absl(name)));
    return s;
  }

  absl::Status fault_;
  detail::chaos_switch switch_;
};

// --- latency

struct chaos_latency_options {
  std::string name = "latency";  // not empty
  bool enabled = false;
  double rate = 0.0;  // in [0, 1]
  // How long a hit call waits before going inward; in [0s, 24h].
  duration delay = std::chrono::seconds(1);
  chaos_selector when{};
  std::uint64_t seed = 1;

  [[nodiscard]] absl::Status validate() const {
    constexpr std::string_view who = "chaos_latency_options";
    if (absl::Status s = detail::validate_chaos(who, name, rate); !s.ok()) return s;
    return detail::validate_chaos_delay(who, delay);
  }
};

class chaos_latency {
 public:
  // Throws keel::invalid_options if `o` is invalid.
  explicit chaos_latency(chaos_latency_options o)
      : delay_ns_((detail::require_valid(o.validate()), o.delay.count())),
        switch_(std::move(o.name), chaos_kind::latency, o.enabled, o.rate, std::move(o.when), o.seed) {}

  template <class Ctx, class Next>
  auto execute(Ctx& ctx, attempt_plan plan, Next& next) -> decltype(next(ctx, plan)) {
    if (!switch_.enabled()) [[likely]] return next(ctx, plan);
    return drill(ctx, plan, next);
  }

 private:
  // Out of line, so that the off path above inlines to a load and a branch.
  template <class Ctx, class Next>
  [[gnu::noinline, gnu::cold]] auto drill(Ctx& ctx, const attempt_plan& given, Next& next)
      -> decltype(next(ctx, attempt_plan{})) {
    attempt_plan plan = given;
    using R = decltype(next(ctx, plan));
    if (!switch_.hit(ctx.call.labels())) return next(ctx, plan);
    const duration delay = this->delay();
    observe(ctx.listener, events::chaos_injected{.call = ctx.call,
                                                 .stage = switch_.name(),
                                                 .kind = chaos_kind::latency,
                                                 .delay = delay,
                                                 .fault = ok_});
    const time_point wake = plan.now + delay;
    const time_point until = std::min(wake, plan.deadline.when());
    if (!ctx.clock.sleep_until(until, plan.stop.token())) {
      return R(mark_not_started(absl::CancelledError("keel chaos: injected latency cut by the call's stop")));
    }
    if (until < wake) {
      return R(mark_not_started(
          absl::DeadlineExceededError("keel chaos: injected latency outlasted the deadline")));
    }
    plan.now = ctx.clock.now();  // the pass waited: what is inward sees the time it starts
    return next(ctx, plan);
  }

 public:
  void enable() noexcept { switch_.set_enabled(true); }
  void disable() noexcept { switch_.set_enabled(false); }
  void set_enabled(bool on) noexcept { switch_.set_enabled(on); }
  [[nodiscard]] absl::Status set_rate(double rate) { return switch_.set_rate("chaos_latency", rate); }
  // InvalidArgument, naming the field, outside [0s, 24h]; the delay is then unchanged.
  [[nodiscard]] absl::Status set_delay(duration delay) {
    if (absl::Status s = detail::validate_chaos_delay("chaos_latency", delay); !s.ok()) return s;
    delay_ns_.store(delay.count(), std::memory_order_relaxed);
    return absl::OkStatus();
  }
  [[nodiscard]] bool enabled() const noexcept { return switch_.enabled(); }
  [[nodiscard]] double rate() const noexcept { return switch_.rate(); }
  [[nodiscard]] duration delay() const noexcept { return duration(delay_ns_.load(std::memory_order_relaxed)); }
  [[nodiscard]] chaos_figures figures() const noexcept { return switch_.figures(); }

 private:
  static inline const absl::Status ok_{};
  std::atomic<duration::rep> delay_ns_;
  detail::chaos_switch switch_;
};

// --- outcomes

template <class T>
struct chaos_outcome_options {
  std::string name = "outcome";  // not empty
  bool enabled = false;
  double rate = 0.0;  // in [0, 1]
  // What a hit call returns, converted to the pipeline's result type.
  T outcome{};
  chaos_selector when{};
  std::uint64_t seed = 1;

  [[nodiscard]] absl::Status validate() const { return detail::validate_chaos("chaos_outcome_options", name, rate); }
};

template <class T>
class chaos_outcome {
 public:
  // Throws keel::invalid_options if `o` is invalid.
  explicit chaos_outcome(chaos_outcome_options<T> o)
      : outcome_((detail::require_valid(o.validate()), std::move(o.outcome))),
        switch_(std::move(o.name), chaos_kind::outcome, o.enabled, o.rate, std::move(o.when), o.seed) {}

  template <class Ctx, class Next>
  auto execute(Ctx& ctx, attempt_plan plan, Next& next) -> decltype(next(ctx, plan)) {
    static_assert(std::is_constructible_v<decltype(next(ctx, plan)), const T&>,
                  "keel: a chaos_outcome<T> must be convertible to the pipeline's result type");
    if (!switch_.enabled()) [[likely]] return next(ctx, plan);
    return drill(ctx, plan, next);
  }

 private:
  template <class Ctx, class Next>
  [[gnu::noinline, gnu::cold]] auto drill(Ctx& ctx, const attempt_plan& given, Next& next)
      -> decltype(next(ctx, attempt_plan{})) {
    attempt_plan plan = given;
    using R = decltype(next(ctx, plan));
    if (!switch_.hit(ctx.call.labels())) return next(ctx, plan);
    observe(ctx.listener, events::chaos_injected{.call = ctx.call,
                                                 .stage = switch_.name(),
                                                 .kind = chaos_kind::outcome,
                                                 .delay = duration::zero(),
                                                 .fault = ok_});
    return R(outcome_);
  }

 public:
  void enable() noexcept { switch_.set_enabled(true); }
  void disable() noexcept { switch_.set_enabled(false); }
  void set_enabled(bool on) noexcept { switch_.set_enabled(on); }
  [[nodiscard]] absl::Status set_rate(double rate) { return switch_.set_rate("chaos_outcome", rate); }
  [[nodiscard]] bool enabled() const noexcept { return switch_.enabled(); }
  [[nodiscard]] double rate() const noexcept { return switch_.rate(); }
  [[nodiscard]] const T& outcome() const noexcept { return outcome_; }
  [[nodiscard]] chaos_figures figures() const noexcept { return switch_.figures(); }

 private:
  static inline const absl::Status ok_{};
  T outcome_;
  detail::chaos_switch switch_;
};

}  // namespace keel
