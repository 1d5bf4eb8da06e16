// keel/compose/optional_stage.hpp — a stage that a plan built at startup may
// leave out, so one pipeline type serves the configurations with and
// without it (tower's option_layer).
//
// A service builds its pipelines once, from configuration: a model with a
// hedge and one without, a fleet-wide limit on or off, a deadline cut on
// or off. Their pipeline types must not depend on the configuration, or the
// plan becomes a template per combination. keel::optional_stage(&policy)
// runs `policy`; keel::optional_stage<P>{} (or a null pointer) passes every
// pass straight on. It declares what `P` declares: over a keel::hedge it is a
// concurrent policy, so the pipeline hands it a `next` that owns a copy of
// the provider whether the hedge is there or not.
//
// Example:
//
//   keel::circuit_breaker breaker({.name = "model"});
//   const bool breaker_on = true;   // from configuration
//   auto pipe = keel::pipeline(keel::retry({.max_attempts = 3}),
//                              keel::optional_stage(breaker_on ? &breaker : nullptr));
//
// The policy pointed to is held by pointer, as a pipeline holds an lvalue
// policy by reference: it must outlive the pipeline.
//
// Thread-safety: as the policy's; an optional_stage is an immutable pointer.
#pragma once

#include "keel/core/policy.hpp"

namespace keel {

template <class Policy>
class optional_stage {
 public:
  // A hedge (or another policy whose attempts may outlive the pass) stays one
  // in or out of the plan.
  static constexpr bool concurrent_attempts = concurrent_policy<Policy>;

  constexpr optional_stage() noexcept = default;  // left out
  constexpr explicit optional_stage(Policy* policy) noexcept : policy_(policy) {}

  [[nodiscard]] constexpr bool present() const noexcept { return policy_ != nullptr; }

  template <class Ctx, class Next>
  auto execute(Ctx& ctx, const attempt_plan& plan, Next& next) const -> decltype(next(ctx, plan)) {
    if (policy_ == nullptr) return next(ctx, plan);
    return policy_->execute(ctx, plan, next);
  }

 private:
  Policy* policy_ = nullptr;
};

template <class Policy>
optional_stage(Policy*) -> optional_stage<Policy>;

}  // namespace keel
