// keel/core/policy.hpp — what a policy is handed: the plan for one pass down a
// pipeline, the run context, and helpers over absl::Status / StatusOr<T>.
//
// Policies (retry, adaptive timeout, breaker, bulkhead, quota, hedge,
// fallback, a whole pipeline, or your own) are types with a member
//
//   template <class Ctx, class Next>
//   auto execute(Ctx& ctx, const keel::attempt_plan& plan, Next& next) [const]
//       -> decltype(next(ctx, plan));
//
// that call next(ctx, plan) zero or more times: the `keel::policy` concept
// below, which keel/compose/pipeline.hpp checks for every stage it composes.
// A policy may only narrow the deadline, never extend it: it passes on
// plan.narrowed(d) (a policy taking the plan by value also works). Policies a
// pipeline holds by value (configuration only, like keel::retry) make
// execute const; shared-state objects (a breaker, an adaptive timeout) are
// held by reference and may mutate themselves.
//
// Example (a policy that refuses calls without a tenant label):
//
//   struct require_tenant {
//     template <class Ctx, class Next>
//     auto execute(Ctx& ctx, const keel::attempt_plan& plan, Next& next) const -> decltype(next(ctx, plan)) {
//       using R = decltype(next(ctx, plan));
//       if (ctx.call.labels().tenant.empty()) return R(absl::InvalidArgumentError("no tenant"));
//       return next(ctx, plan);
//     }
//   };
//
// Thread-safety: plain values and pure functions.
#pragma once

#include <concepts>
#include <stop_token>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "keel/core/call.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/deadline.hpp"
#include "keel/core/environment.hpp"
#include "keel/core/outcome.hpp"
#include "keel/core/telemetry.hpp"

namespace keel {

// A std::stop_token held by reference, as a plan carries it down the
// stages: a plan is passed by value at every stage, and copying a
// std::stop_token that has a stop state is two locked read-modify-writes
// (its count up, then down): ~10 ns per stage per call. It reads like the
// token (stop_requested, stop_possible) and converts to `const
// std::stop_token&` for std::stop_callback and clock::sleep_until. The token
// must outlive every plan that refers to it: a stage that puts its own token
// in the plan keeps it for as long as it runs what is below (binding a
// temporary does not compile). Keep a copy (token()) to use it later.
class stop_ref {
 public:
  stop_ref() noexcept = default;  // a token that is never stopped
  stop_ref(const std::stop_token& token) noexcept : token_(&token) {}  // NOLINT: implicit, as a token
  stop_ref(std::stop_token&&) = delete;                                 // would dangle

  [[nodiscard]] bool stop_requested() const noexcept { return token_->stop_requested(); }
  [[nodiscard]] bool stop_possible() const noexcept { return token_->stop_possible(); }
  [[nodiscard]] const std::stop_token& token() const noexcept { return *token_; }
  operator const std::stop_token&() const noexcept { return *token_; }  // NOLINT: implicit, as a token

 private:
  static inline const std::stop_token never_{};
  const std::stop_token* token_ = &never_;
};

// What flows down the chain on one pass: the time the pass started, the
// deadline it must finish by, and the stop token to honour (by reference:
// see stop_ref).
//
// Stages receive it by const reference: a plan built from field stores and
// copied into a by-value argument is read back with 16-byte loads that
// stall on store forwarding (~7 ns a stage). A stage that changes the plan
// passes on a new one built field by field: narrowed(d), from(t).
struct attempt_plan {
  time_point now{};
  keel::deadline deadline{};
  stop_ref stop{};
  int hedge = 0;  // 0: the primary attempt; k: the k-th hedge a keel::hedge started

  // The same plan with deadline `d` (which must be no later than deadline).
  [[nodiscard]] attempt_plan narrowed(keel::deadline d) const noexcept { return {now, d, stop, hedge}; }
  // The same plan starting at `t` (a pass that waited).
  [[nodiscard]] attempt_plan from(time_point t) const noexcept { return {t, deadline, stop, hedge}; }
};

namespace detail {
template <class R>
struct is_statusor : std::false_type {};
template <class T>
struct is_statusor<absl::StatusOr<T>> : std::true_type {};
}  // namespace detail

// absl::Status or absl::StatusOr<T>.
template <class R>
concept result = std::same_as<R, absl::Status> || detail::is_statusor<R>::value;

template <result R>
[[nodiscard]] const absl::Status& status_of(const R& r) noexcept {
  if constexpr (std::same_as<R, absl::Status>) {
    return r;
  } else {
    return r.status();
  }
}

namespace detail {
template <class P, bool WithAttempt = std::is_invocable_v<P&, const attempt&>>
struct provider_result {
  using type = std::remove_cvref_t<std::invoke_result_t<P&, const attempt&>>;
};
template <class P>
struct provider_result<P, false> {
  using type = std::remove_cvref_t<std::invoke_result_t<P&>>;
};
}  // namespace detail

// The result type of a provider.
template <class Provider>
using provider_result_t = typename detail::provider_result<std::remove_reference_t<Provider>>::type;

// Compile-time safety for consequential writes. A provider type may declare
// what it does to the world:
//
//   struct charge_card {
//     static constexpr keel::operation operation{.effect = keel::effect::write};
//     absl::StatusOr<receipt> operator()(const keel::attempt&);
//   };
//
// and a policy that runs several attempts of one call at once (keel::hedge)
// declares `static constexpr bool concurrent_attempts = true;`. A pipeline
// with such a policy does not compile around a provider that declares a
// write without an idempotency identity (operation.idempotent false).
// std::ref(provider) declares what the provider declares.
template <class Provider>
using declared_provider_t = std::unwrap_reference_t<std::remove_cvref_t<Provider>>;

template <class Provider>
concept declares_operation = requires {
  { declared_provider_t<Provider>::operation } -> std::convertible_to<operation>;
};

template <class Provider>
[[nodiscard]] consteval bool declares_unsafe_write() {
  if constexpr (declares_operation<Provider>) {
    return !declared_provider_t<Provider>::operation.repeatable();
  } else {
    return false;
  }
}

template <class Policy>
concept concurrent_policy = requires {
  requires std::remove_cvref_t<Policy>::concurrent_attempts;
};

// What a policy's ctx is: the pipeline's environment (keel/core/environment.hpp)
// plus the call. `clock`, `classifier` and `listener` are the environment's;
// `listener` receives the events policies report (keel/core/telemetry.hpp):
// call keel::observe(ctx.listener, event). keel::once and keel::fan_out run
// on a run context (instead of a bare call) take all three from it.
//
// Reading the clock costs as much as ten atomics, so one pass reads it at
// most twice: plan.now when the pass starts, and attempt_end() once the
// attempt has returned, shared by every policy that wants it (the adaptive
// timeout, the breaker, the hedge, the retry's wait). A run context belongs
// to one thread: a policy that runs attempts on other threads (keel::hedge)
// gives each its own copy, and reads the clock once more when an attempt
// starts on another thread (it may have waited there).
template <keel::clock Clock, keel::classifier Classifier, class Listener = null_listener>
struct run_context {
  run_context(keel::call& c, const Clock& k, const Classifier& cl, const Listener& l) noexcept
      : call(c), clock(k), classifier(cl), listener(l) {}

  keel::call& call;
  const Clock& clock;
  const Classifier& classifier;
  const Listener& listener;

  using environment_type = keel::environment<Clock, Classifier, Listener>;

  // A copy of the environment, for what must own one (a lease keeper's thread).
  [[nodiscard]] environment_type env() const { return {clock, classifier, listener}; }

  [[nodiscard]] outcome_kind classify(const absl::Status& s) const {
    return s.ok() ? outcome_kind::success : classifier(s, call.operation());
  }

  // When the latest attempt of a pass that started at `pass_start` ended:
  // the clock is read by the first policy to ask after the attempt returned,
  // and the others get the same time. A time read before `pass_start`
  // belongs to an earlier pass and is never handed out.
  [[nodiscard]] time_point attempt_end(time_point pass_start) {
    if (!end_read_ || end_ < pass_start) {
      end_ = clock.now();
      end_read_ = true;
    }
    return end_;
  }
  // Called as an attempt starts (keel's pipeline does): the next
  // attempt_end() reads the clock.
  void attempt_started() noexcept { end_read_ = false; }

 private:
  time_point end_{};
  bool end_read_ = false;
};

namespace detail {

// The provider invocation running on this thread, if any: a pipeline run
// from inside a provider on the same call (an SDK layer inside an
// application layer) takes over that invocation's attempt for its first
// one, so the call's attempt cap counts downstream calls, not layers.
struct invocation {
  keel::call* owner;
  int number;
  bool credit;  // not yet handed to a nested pipeline's first attempt
};
inline thread_local invocation* current_invocation = nullptr;

struct invocation_scope {
  invocation_scope(invocation* self, invocation* outer) noexcept : outer_(outer) { current_invocation = self; }
  ~invocation_scope() { current_invocation = outer_; }
  invocation_scope(const invocation_scope&) = delete;
  invocation_scope& operator=(const invocation_scope&) = delete;
  invocation* outer_;
};

// What a policy is checked against: the default run context and a next
// stage returning absl::Status. Only execute()'s declaration is looked at.
using probe_context = run_context<real_clock, default_classifier, null_listener>;
struct probe_next {
  absl::Status operator()(probe_context&, const attempt_plan&) const;
};
}  // namespace detail

// A policy: a type whose execute(ctx, plan, next) returns what next returns.
// keel::pipeline checks every stage against it (held by value: a const
// execute; held by reference: any execute).
template <class P>
concept policy = requires(P& p, detail::probe_context& ctx, const attempt_plan& plan, detail::probe_next& next) {
  { p.execute(ctx, plan, next) } -> std::same_as<absl::Status>;
};

// A policy that a pipeline may hold by value: its execute is const, since a
// pipeline's run() is const and may run for many calls at once.
template <class P>
concept const_policy = policy<P> && requires(const P& p, detail::probe_context& ctx, const attempt_plan& plan,
                                             detail::probe_next& next) {
  { p.execute(ctx, plan, next) } -> std::same_as<absl::Status>;
};

}  // namespace keel
