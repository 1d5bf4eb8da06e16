// keel/policy/time_limit.hpp — the share of the call's deadline one stage may use.
//
// A pipeline runs within the call's work deadline (deadline minus response
// reserve). keel::time_limit narrows that further for its stage: the stage
// gets min(work deadline, now + at_most), and nothing inside it can see a
// later deadline. It refuses, without calling inward, when the call is
// already out of time.
//
// Example (the seed's model stage: at most 1000 ms of what is left):
//
//   auto model_stage = keel::pipeline(keel::time_limit({.at_most = std::chrono::milliseconds(1000)}),
//                                     keel::retry({.max_attempts = 2}));
//
// Thread-safety: immutable; execute() may run for many calls at once.
#pragma once

#include <chrono>

#include "absl/status/status.h"
#include "keel/core/clock.hpp"
#include "keel/core/outcome.hpp"
#include "keel/core/policy.hpp"
#include "keel/core/status.hpp"

namespace keel {

struct time_limit_options {
  duration at_most = std::chrono::seconds(1);  // > 0

  [[nodiscard]] absl::Status validate() const {
    if (at_most <= duration::zero()) return detail::invalid_field("time_limit_options", "at_most", "be > 0", at_most);
    return absl::OkStatus();
  }
};

class time_limit {
 public:
  // Throws keel::invalid_options if `o` is invalid.
  explicit time_limit(const time_limit_options& o) : at_most_(o.at_most) { detail::require_valid(o.validate()); }

  template <class Ctx, class Next>
  auto execute(Ctx& ctx, const attempt_plan& plan, Next& next) const -> decltype(next(ctx, plan)) {
    using R = decltype(next(ctx, plan));
    if (plan.deadline.expired(plan.now)) {
      return R(refusal(absl::DeadlineExceededError("keel: stage not started: deadline passed"), "time_limit"));
    }
    return next(ctx, plan.narrowed(plan.deadline.within(plan.now, at_most_)));
  }

 private:
  duration at_most_;
};

}  // namespace keel
