// keel/compose/pipeline.hpp — composes policies around a provider, outer to inner,
// at compile time.
//
// A provider is any callable taking `const keel::attempt&` (or nothing) and
// returning absl::StatusOr<T> or absl::Status. A pipeline wraps it in
// policies, written outer to inner: in `keel::pipeline(a, b, c)` policy `a`
// sees the whole call and `c` sits next to the provider. Composition is a
// tuple and inlined calls: no type erasure, no heap allocation on the success
// path. Below a keel::hedge the provider is copied (its losing attempts may
// outlive run()): pass std::ref(provider) for one that outlives them.
//
// Policies passed as lvalues are held by reference (shared state such as a
// breaker or an adaptive timeout lives once and is used by many pipelines);
// temporaries are moved in and held by value.
//
// Example:
//
//   keel::retry_budget budget({.ratio = 0.1, .min_per_second = 5});
//   keel::adaptive_timeout timeouts;
//   const auto env = keel::environment<>{};   // the service's clock, classifier and listener, built once
//   auto pipe = keel::pipeline(keel::retry({.max_attempts = 3, .budget = &budget}), timeouts).in(env);
//   keel::call call(keel::real_clock{}.now(), {.timeout = std::chrono::seconds(3)});
//   absl::StatusOr<int> r = pipe.run(call, [](const keel::attempt&) -> absl::StatusOr<int> { return 42; });
//
// Writing a policy: a type with a member (const when the pipeline holds it
// by value; the keel::policy concept in keel/core/policy.hpp)
//
//   template <class Ctx, class Next>
//   auto execute(Ctx& ctx, const keel::attempt_plan& plan, Next& next) const
//       -> decltype(next(ctx, plan));
//
// It may call next(ctx, plan) zero or more times, with a plan whose deadline
// is no later than the one it got (plan.narrowed(d)). ctx.call is the keel::call, ctx.clock the
// pipeline's clock, ctx.classify(status) the pipeline's classifier. Read the
// clock sparingly (once per attempt): plan.now already holds the time the
// pass started.
//
// A pipeline runs in an environment (keel/core/environment.hpp): the clock,
// classifier and event listener of the service, built once at startup.
// `.in(env)` returns the same policies in `env`, the one way to give a
// pipeline its clock, classifier and listener (a test's is one line:
// `.in(keel::environment{manual_clock})`). A run builds a run context, the
// environment plus the call, and every policy takes all three from it.
//
// Thread-safety: run() is const and may be called from many threads at once,
// each with its own keel::call; policies keep shared state in thread-safe
// objects. A provider that throws is caught here and turned into
// absl::UnknownError (classified ambiguous for a write, retried for a read).
#pragma once

#include <concepts>
#include <cstddef>
#include <stop_token>
#include <tuple>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "keel/core/call.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/deadline.hpp"
#include "keel/core/environment.hpp"
#include "keel/core/outcome.hpp"
#include "keel/core/policy.hpp"
#include "keel/core/status.hpp"
#include "keel/core/telemetry.hpp"
#include "keel/core/internal/boundary.hpp"

namespace keel {

namespace detail {

template <class R, class Ctx, class Provider>
R invoke_provider(Ctx& ctx, const attempt_plan& plan, Provider& provider) {
  if (plan.stop.stop_requested()) {
    return R(mark_not_started(absl::CancelledError("keel: call cancelled before the attempt started")));
  }
  if (plan.deadline.expired(plan.now)) {
    return R(refusal(absl::DeadlineExceededError("keel: no time left to start an attempt"), "deadline"));
  }
  // A provider that runs another pipeline on the same call (an SDK layer
  // inside an application layer) hands its own attempt to the first inner
  // attempt, so the cap counts downstream calls, not layers.
  invocation* const outer = current_invocation;
  int number = 0;
  if (outer != nullptr && outer->owner == &ctx.call && outer->credit) {
    outer->credit = false;
    number = outer->number;
  } else {
    number = ctx.call.begin_attempt();
  }
  if (number == 0) {
    return R(refusal(absl::ResourceExhaustedError(absl::StrCat("keel: attempt cap of ", ctx.call.max_attempts(),
                                                               " reached for this call")),
                     "attempt_cap"));
  }
  ctx.attempt_started();
  invocation self{&ctx.call, number, true};
  const invocation_scope scope(&self, outer);
  const attempt a{.number = number,
                  .start = plan.now,
                  .deadline = plan.deadline,
                  .timeout = plan.deadline.remaining(plan.now),
                  .stop = plan.stop,
                  .owner = &ctx.call,
                  .hedge = plan.hedge};
  return call_provider<R>("provider", provider, a);
}

// The last stage of a pipeline run: the provider, held by reference, or by
// value below a policy whose attempts may outlive run() (keel::hedge).
template <class R, class Provider>
struct provider_stage {
  using provider_type = Provider;
  Provider provider;
  template <class Ctx>
  R operator()(Ctx& c, const attempt_plan& p) {
    return invoke_provider<R>(c, p, provider);
  }
};
template <class T>
inline constexpr bool is_provider_stage = false;
template <class R, class P>
inline constexpr bool is_provider_stage<provider_stage<R, P>> = true;

// What the stages of one pass run through: the pipeline's policies and its
// last stage (the provider, or the next stage of an outer pipeline this one
// is nested in). Each stage's `next` holds one pointer to it: a `next`
// holding both would be built from a 16-byte load of what the stage above
// stored 8 bytes at a time, a store-forwarding stall (~12 cycles) a stage.
template <class Tuple, class Last>
struct stage_chain {
  const Tuple& policies;
  Last& last;
};

// Runs policies I.. of the chain, then its last stage.
template <std::size_t I, class R, class Tuple, class Last, class Ctx>
R run_from(const stage_chain<Tuple, Last>& chain, Ctx& ctx, const attempt_plan& plan) {
  if constexpr (I == std::tuple_size_v<Tuple>) {
    return chain.last(ctx, plan);
  } else if constexpr (concurrent_policy<std::tuple_element_t<I, Tuple>>) {
    // Its attempts may outlive run() (keel/compose/hedge.hpp): they call a
    // copy of the provider, and reach the policies (which outlive every
    // attempt, with the pipeline) directly, not through this pass's chain.
    static_assert(is_provider_stage<Last>,
                  "keel: keel::hedge must sit in the outermost pipeline (the one run() is called on): its losing "
                  "attempts may outlive the pass, and a nested pipeline's next stage belongs to the outer pass");
    using P = std::decay_t<typename Last::provider_type>;  // a function: a pointer to it
    static_assert(std::is_copy_constructible_v<P>,
                  "keel: a hedged pipeline copies its provider, because a losing attempt may still run after "
                  "run() returns; make the provider copyable (hold shared state by shared_ptr), or pass "
                  "std::ref(provider) for one that outlives every attempt");
    using Owned = provider_stage<R, P>;
    auto next = [policies = &chain.policies, owned = Owned{P(chain.last.provider)}](
                    Ctx& c, const attempt_plan& p) mutable -> R {
      const stage_chain<Tuple, Owned> below{*policies, owned};
      return run_from<I + 1, R>(below, c, p);
    };
    return std::get<I>(chain.policies).execute(ctx, plan, next);
  } else {
    auto next = [&chain](Ctx& c, const attempt_plan& p) -> R { return run_from<I + 1, R>(chain, c, p); };
    return std::get<I>(chain.policies).execute(ctx, plan, next);
  }
}

// Held by reference: any execute; held by value: a const one.
template <class P>
inline constexpr bool pipeline_stage_ok =
    std::is_reference_v<P> ? policy<std::remove_reference_t<P>> : const_policy<P>;

}  // namespace detail

template <keel::clock Clock, keel::classifier Classifier, class Listener, class... Policies>
class basic_pipeline {
 public:
  using environment_type = keel::environment<Clock, Classifier, Listener>;

  template <class... Ps>
  constexpr basic_pipeline(environment_type env, Ps&&... policies)
      : env_(std::move(env)), policies_(std::forward<Ps>(policies)...) {}

  // Runs `provider` for `call` through every policy. Never throws.
  template <class Provider>
  provider_result_t<Provider> run(keel::call& call, Provider&& provider) const {
    return run(call, env_.clock.now(), std::forward<Provider>(provider));
  }

  // The same, from a time the caller has just read from this pipeline's
  // clock (the one it made the call with, say): a successful single-attempt
  // call then reads the clock once more, when the attempt ends.
  template <class Provider>
  provider_result_t<Provider> run(keel::call& call, time_point now, Provider&& provider) const {
    using R = provider_result_t<Provider>;
    static_assert(result<R>, "a keel provider returns absl::Status or absl::StatusOr<T>");
    static_assert(!((concurrent_policy<Policies> || ...) && declares_unsafe_write<Provider>()),
                  "keel: this provider declares a consequential write without an idempotency identity; "
                  "a policy here (keel::hedge) would run it more than once at a time");
    run_context<Clock, Classifier, Listener> ctx{call, env_.clock, env_.classifier, env_.listener};
    const attempt_plan plan{.now = now, .deadline = call.work_deadline(), .stop = call.stop_token()};
    detail::provider_stage<R, Provider&> last{provider};
    const detail::stage_chain<std::tuple<Policies...>, detail::provider_stage<R, Provider&>> chain{policies_, last};
    return detail::run_from<0, R>(chain, ctx, plan);
  }

  // A pipeline is itself a policy: nested in another pipeline (a model stage
  // inside a request pipeline), its policies run with the outer pipeline's
  // run context (clock, classifier, listener) and its last stage is the
  // outer pipeline's next one. Its own environment is not used there.
  template <class Ctx, class Next>
  auto execute(Ctx& ctx, const attempt_plan& plan, Next& next) const -> decltype(next(ctx, plan)) {
    using R = decltype(next(ctx, plan));
    const detail::stage_chain<std::tuple<Policies...>, Next> chain{policies_, next};
    return detail::run_from<0, R>(chain, ctx, plan);
  }

  // The same policies in another environment: the service's, built once
  // (or, in a test, one on a manual clock).
  template <class C, class K, class L>
  [[nodiscard]] basic_pipeline<C, K, L, Policies...> in(keel::environment<C, K, L> env) const {
    return std::apply(
        [&](auto&&... p) {
          return basic_pipeline<C, K, L, Policies...>(std::move(env), static_cast<Policies>(p)...);
        },
        policies_);
  }

  [[nodiscard]] const environment_type& environment() const noexcept { return env_; }
  [[nodiscard]] const Clock& clock() const noexcept { return env_.clock; }

 private:
  environment_type env_;
  std::tuple<Policies...> policies_;
};

// Policies outer to inner; lvalues by reference, temporaries by value.
template <class... Policies>
[[nodiscard]] auto pipeline(Policies&&... policies) {
  static_assert((detail::pipeline_stage_ok<Policies> && ...),
                "keel::pipeline: a stage is not a keel::policy. A policy has a member "
                "`template <class Ctx, class Next> auto execute(Ctx& ctx, const keel::attempt_plan& plan, Next& next) "
                "const -> decltype(next(ctx, plan))` (const when the pipeline holds it by value, that is when it "
                "is passed as a temporary); see keel/core/policy.hpp");
  return basic_pipeline<real_clock, default_classifier, null_listener, Policies...>(
      keel::environment<>{}, std::forward<Policies>(policies)...);
}

}  // namespace keel
