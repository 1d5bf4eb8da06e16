// keel/compose/fallback.hpp — ordered alternatives for when the primary path fails:
// each must pass the call's gates, each gets only what is left of the
// deadline, and an answer from one of them is marked degraded.
//
// keel::fallback is a pipeline policy, normally the outermost:
//
//   primary (everything inside the fallback: retries, hedges, the provider)
//     fails ->  alternative 1  (if every gate passes and time is left)
//     fails ->  alternative 2  ...
//
// - Gates are the call's requirements that every alternative must meet
//   before it is used: residency, permissions, schema, anything a predicate
//   over the call's labels and the alternative's own labels can decide. A
//   gate returns bool or an absl::Status (its reason). A refused alternative
//   is skipped, never called.
// - Each alternative receives the deadline the fallback itself received,
//   narrowed by its own at_most, never a fresh one: with 1.4 s left, an
//   alternative that asks for 3 s gets 1.4 s. One with less than its
//   min_time left is skipped.
// - Deadlines that cut: with fallback_options::cut (a keel::deadline_timer)
//   the primary, given at most primary_at_most of the deadline, and each
//   alternative are stopped at their deadlines, so a primary stalled on
//   the network leaves the alternatives their time.
// - An answer from an alternative records the path on the call
//   (call.set_served_by(name)) and marks the call degraded.
// - A terminal alternative ends the chain whatever it returns: a deferred
//   result ("accepted, check back": keel::deferred(ticket, after)) or a
//   clear failure written for the user. It is recorded as the serving path.
// - When the primary failed, the fallback runs unless the call was
//   cancelled, or the failure is ambiguous for an operation that may not be
//   repeated (a write whose effect is unknown must not be done again
//   elsewhere), or it is permanent and fallback_options::on_permanent is off.
// - When no alternative serves, the caller gets the primary's failure (its
//   code and payloads) with what happened to each alternative put before its
//   message.
//
// An alternative marked provider_call (the default) is a provider
// invocation: it spends the call's attempt cap like any attempt, and a
// pipeline run inside it on the same call uses that attempt (see
// keel/compose/pipeline.hpp). Local answers (a cache, a static text, a deferral) set
// provider_call = false. fallback.hpp sits beside pipeline.hpp in the
// composition layer: it invokes alternatives the way a pipeline invokes its
// provider.
//
// Example (the seed's timeline: a stalled model, then cached feedback):
//
//   auto eu_only = keel::gate("residency", [](const keel::labels& call, const keel::path& p) {
//     return call.region.empty() || call.region == p.labels.region;
//   });
//   auto pipe = keel::pipeline(
//       keel::fallback({eu_only},
//                      keel::alternate("small-model", small_model, {.labels = {.region = "eu"}}),
//                      keel::alternate("cached-feedback", cached, {.provider_call = false})),
//       keel::time_limit({.at_most = std::chrono::milliseconds(1000)}));
//   // pipe.run(call, model): on failure call.record().served_by == "small-model" or
//   // "cached-feedback", and call.record().degraded
//
// Events (keel/core/telemetry.hpp): events::fallback_used when an alternative
// serves, events::fallback_skipped for each one refused by a gate, out of
// time, or failed.
//
// Thread-safety: execute() is const and may run for many calls at once; the
// alternatives and gates are called from those threads (held by reference
// when passed as lvalues, so shared providers live once).
#pragma once

#include <chrono>
#include <concepts>
#include <cstddef>
#include <functional>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "keel/compose/cut_at_deadline.hpp"
#include "keel/compose/events.hpp"
#include "keel/compose/pipeline.hpp"
#include "keel/core/call.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/deadline.hpp"
#include "keel/core/outcome.hpp"
#include "keel/core/policy.hpp"
#include "keel/core/status.hpp"
#include "keel/core/telemetry.hpp"
#include "keel/core/internal/boundary.hpp"

namespace keel {

// "Accepted, check back": the payload's value is the ticket to ask with.
inline constexpr std::string_view deferred_payload = "keel.dev/deferred";

// A deferred answer: Unavailable ("not yet"), classified permanent so no
// retry layer repeats the work it queued, with the ticket and a retry-after
// hint of `check_after`.
[[nodiscard]] inline absl::Status deferred(std::string_view ticket, duration check_after,
                                           std::string_view message = "accepted; check back later") {
  absl::Status s = with_outcome(with_retry_after(absl::UnavailableError(detail::to_absl(message)), check_after),
                                outcome_kind::permanent);
  s.SetPayload(detail::to_absl(deferred_payload), absl::Cord(detail::to_absl(ticket)));
  return s;
}

// The ticket of a deferred answer, if `s` is one.
[[nodiscard]] inline std::optional<std::string> deferred_ticket(const absl::Status& s) {
  auto p = s.GetPayload(detail::to_absl(deferred_payload));
  if (!p) return std::nullopt;
  return std::string(*p);
}

// What a gate sees of an alternative.
struct path {
  std::string_view name;
  keel::labels labels;
};

// A named requirement every alternative must meet before it is used.
class gate {
 public:
  // `check` returns bool (false: refused) or absl::Status (not OK: refused,
  // with the reason), and takes either the call's labels or the whole call
  // (to read the request it carries: keel::from_request), then the
  // alternative:
  //   check(const keel::labels& call, const keel::path& alternative)
  //   check(const keel::call& call, const keel::path& alternative)
  template <class F>
    requires std::invocable<const F&, const labels&, const path&> || std::invocable<const F&, const call&, const path&>
  gate(std::string name, F check) : name_(std::move(name)) {
    constexpr bool whole_call = std::invocable<const F&, const call&, const path&>;
    using arg = std::conditional_t<whole_call, const call&, const labels&>;
    using verdict = std::remove_cvref_t<std::invoke_result_t<const F&, arg, const path&>>;
    static_assert(std::same_as<verdict, absl::Status> || std::convertible_to<verdict, bool>,
                  "a keel::gate returns bool or absl::Status");
    check_ = [f = std::move(check)](const call& c, const path& p) -> absl::Status {
      auto v = [&] {
        if constexpr (whole_call) {
          return f(c, p);
        } else {
          return f(c.labels(), p);
        }
      }();
      if constexpr (std::same_as<verdict, absl::Status>) {
        return v;
      } else {
        return v ? absl::OkStatus() : absl::PermissionDeniedError("refused");
      }
    };
  }

  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  [[nodiscard]] absl::Status check(const call& call, const path& alternative) const {
    return check_(call, alternative);
  }

 private:
  std::string name_;
  std::function<absl::Status(const call&, const path&)> check_;
};

struct alternative_options {
  keel::labels labels{};                 // what this path is (model, region...); gates read them
  duration at_most = duration::max();    // at most this much of what is left; > 0
  duration min_time = duration::zero();  // skipped when less than this is left; >= 0
  bool provider_call = true;             // a provider invocation: spends the call's attempt cap
  bool terminal = false;                 // its result ends the chain, OK or not

  [[nodiscard]] absl::Status validate() const {
    if (at_most <= duration::zero())
      return detail::invalid_field("alternative_options", "at_most", "be > 0", at_most);
    if (min_time < duration::zero())
      return detail::invalid_field("alternative_options", "min_time", "be >= 0", min_time);
    return absl::OkStatus();
  }
};

// One alternative: a name (recorded as served_by; must outlive the calls),
// a provider, and its options. Made with keel::alternate.
template <class Provider>
struct alternative {
  std::string_view name;
  Provider provider;
  alternative_options options;
};

// An alternative; an lvalue provider is held by reference, a temporary by
// value. Throws keel::invalid_options if `o` is invalid.
template <class Provider>
[[nodiscard]] alternative<Provider> alternate(std::string_view name, Provider&& provider,
                                              alternative_options o = {}) {
  detail::require_valid(o.validate());
  return alternative<Provider>{name, std::forward<Provider>(provider), o};
}

struct fallback_options {
  // Fall back after a permanent failure of the primary (a bad credential,
  // an unsupported model). Off: only transient, throttled and (for
  // repeatable operations) ambiguous failures fall back.
  bool on_permanent = true;
  // Failures the caller must hear as they are, never replaced by a degraded
  // answer: for example a tenant over its own quota (keel refused it, and a
  // refusal otherwise falls back), an idempotency conflict. Null: none.
  bool (*passes_through)(const absl::Status& failure) = nullptr;
  // The primary's share of the fallback's deadline: what runs inside the
  // fallback gets at most this much of what is left, so the alternatives
  // keep the rest; > 0. The default leaves the deadline as it is.
  duration primary_at_most = duration::max();
  // Cuts the primary at its deadline (above), and each alternative at its
  // own, through this timer (keel/compose/cut_at_deadline.hpp): a stalled
  // primary that watches only its stop token is stopped in time for the
  // alternatives, and answers DeadlineExceeded, which falls back. Null:
  // the primary is not cut. The timer must outlive the fallback.
  deadline_timer_base* cut = nullptr;

  [[nodiscard]] absl::Status validate() const {
    if (primary_at_most <= duration::zero())
      return detail::invalid_field("fallback_options", "primary_at_most", "be > 0", primary_at_most);
    return absl::OkStatus();
  }
};

template <class... Providers>
class fallback {
 public:
  // Throws keel::invalid_options if the options or an alternative's options
  // are invalid.
  explicit fallback(std::vector<gate> gates, alternative<Providers>... alternatives)
      : fallback(fallback_options{}, std::move(gates), std::move(alternatives)...) {}
  fallback(fallback_options o, std::vector<gate> gates, alternative<Providers>... alternatives)
      : options_((detail::require_valid(o.validate()), o)),
        gates_(std::move(gates)),
        alternatives_(std::move(alternatives)...) {
    std::apply([](const auto&... a) { (detail::require_valid(a.options.validate()), ...); }, alternatives_);
  }

  [[nodiscard]] const std::vector<gate>& gates() const noexcept { return gates_; }

  template <class Ctx, class Next>
  auto execute(Ctx& ctx, const attempt_plan& plan, Next& next) const -> decltype(next(ctx, plan)) {
    using R = decltype(next(ctx, plan));
    R primary = run_primary(ctx, plan, next);
    const absl::Status& failure = status_of(primary);
    if (failure.ok() || !may_fall_back(ctx, plan, failure)) return primary;

    std::optional<R> served;
    std::string trail;  // why each alternative did not serve; failure path only
    std::apply([&](const auto&... a) { (try_one(ctx, plan, a, failure, served, trail) || ...); }, alternatives_);
    if (served) return std::move(*served);
    return R(annotate(failure, absl::StrCat("keel: no fallback served (", trail, "); the primary failed")));
  }

 private:
  template <class Ctx, class Next>
  auto run_primary(Ctx& ctx, const attempt_plan& plan, Next& next) const -> decltype(next(ctx, plan)) {
    const attempt_plan primary = plan.narrowed(plan.deadline.within(plan.now, options_.primary_at_most));
    if (options_.cut == nullptr) return next(ctx, primary);
    return detail::run_cut(*options_.cut, ctx, primary, next);
  }

  template <class Ctx>
  bool may_fall_back(Ctx& ctx, const attempt_plan& plan, const absl::Status& failure) const {
    if (plan.stop.stop_requested()) return false;
    const outcome_kind kind = ctx.classify(failure);
    if (kind == outcome_kind::ambiguous && !ctx.call.operation().repeatable()) return false;
    // A caller that went away has nobody to serve. A refusal (breaker open,
    // quota or bulkhead full, no attempt left) falls through: it is exactly
    // when the allowed alternate path should serve, on_permanent or not.
    if (kind == outcome_kind::cancelled) return false;
    if (kind == outcome_kind::permanent && !options_.on_permanent) return false;
    return options_.passes_through == nullptr || !options_.passes_through(failure);
  }

  // Tries one alternative; true when it served (the chain stops).
  template <class Ctx, class Provider, class R>
  bool try_one(Ctx& ctx, const attempt_plan& plan, const alternative<Provider>& alt, const absl::Status& primary,
               std::optional<R>& served, std::string& trail) const {
    using skip = events::fallback_skipped::reason;
    auto skipped = [&](skip why_not, std::string_view gate_name, const absl::Status& why) {
      observe(ctx.listener, events::fallback_skipped{ctx.call, alt.name, why_not, gate_name, why});
      absl::StrAppend(&trail, trail.empty() ? "" : "; ", detail::to_absl(alt.name), ": ",
                      gate_name.empty() ? "" : absl::StrCat("gate ", detail::to_absl(gate_name), " refused: "),
                      why.message());
      return false;
    };
    if (plan.stop.stop_requested()) return skipped(skip::cancelled, {}, absl::CancelledError("call cancelled"));
    const path p{alt.name, alt.options.labels};
    for (const gate& g : gates_) {
      absl::Status verdict = g.check(ctx.call, p);
      if (!verdict.ok()) return skipped(skip::gate, g.name(), verdict);
    }
    const time_point now = ctx.clock.now();
    const duration left = plan.deadline.remaining(now);
    if (plan.deadline.expired(now) || left < alt.options.min_time) {
      return skipped(skip::deadline, {},
                     absl::DeadlineExceededError(absl::StrCat(detail::describe(left), " left, below its min_time of ",
                                                              detail::describe(alt.options.min_time))));
    }
    // What is left of the fallback's own deadline, never more.
    const attempt_plan stage{.now = now, .deadline = plan.deadline.within(now, alt.options.at_most),
                             .stop = plan.stop, .hedge = 0};
    auto invoke = [&](Ctx& c, const attempt_plan& st) -> R {
      return alt.options.provider_call ? detail::invoke_provider<R>(c, st, alt.provider)
                                       : invoke_local<R>(c, st, alt.provider);
    };
    R r = options_.cut != nullptr ? detail::run_cut(*options_.cut, ctx, stage, invoke) : invoke(ctx, stage);
    const absl::Status& s = status_of(r);
    if (!s.ok() && !alt.options.terminal) return skipped(skip::failed, {}, s);
    ctx.call.set_served_by(alt.name);
    ctx.call.mark_degraded();
    observe(ctx.listener, events::fallback_used{ctx.call, alt.name, primary});
    served.emplace(std::move(r));
    return true;
  }

  // A local answer: no attempt is spent; a throw becomes a status.
  template <class R, class Ctx, class Provider>
  static R invoke_local(Ctx& ctx, const attempt_plan& plan, Provider& provider) {
    const attempt a{.number = 0,
                    .start = plan.now,
                    .deadline = plan.deadline,
                    .timeout = plan.deadline.remaining(plan.now),
                    .stop = plan.stop,
                    .owner = &ctx.call};
    return detail::call_provider<R>("fallback", provider, a);
  }

  fallback_options options_;
  std::vector<gate> gates_;
  std::tuple<alternative<Providers>...> alternatives_;
};

}  // namespace keel
