// keel/core/environment.hpp — one value that carries a service's clock,
// classifier and event listener to every keel component.
//
// A service builds its environment once, at startup, and hands the same
// value to everything time- or observation-dependent: a pipeline
// (`.in(env)`), keel::once, keel::fan_out, keel::job_queue and
// keel::lease_keeper. A component never mixes sources: it reads time from
// env.clock, classifies outcomes with env.classifier and reports events to
// env.listener. Inside a pipeline stage the run context (keel/core/policy.hpp)
// is that environment plus the call: once and fan_out run on a run context
// take all three from it.
//
// An environment is a small value: components copy it. A clock and a
// listener are meant to be cheap handles (keel::real_clock is empty, a
// testing::manual_clock shares its timeline between copies,
// keel::metrics_listener is a few pointers); pass std::ref(listener) for a
// listener that must not be copied.
//
// Example:
//
//   keel::metrics_registry registry;
//   keel::metrics_listener listener(registry);               // keel/observe/telemetry_metrics.hpp
//   const auto env = keel::environment<>{}.with_listener(listener);
//   auto pipe = keel::pipeline(keel::retry({.max_attempts = 3})).in(env);
//   keel::job_queue queue(jobs, {.queue = "reports"}, env);  // the same clock and listener
//
//   // In tests: a manual clock for every component at once.
//   keel::testing::manual_clock clock;
//   keel::environment test_env{clock};                       // the default classifier, no listener
//
// Thread-safety: a plain value. Its members are called from many threads at
// once: clocks and classifiers are, listeners must be, thread-safe
// (keel/core/telemetry.hpp).
#pragma once

#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "keel/core/clock.hpp"
#include "keel/core/outcome.hpp"
#include "keel/core/telemetry.hpp"

namespace keel {

template <keel::clock Clock = real_clock, keel::classifier Classifier = default_classifier,
          class Listener = null_listener>
struct environment {
  using clock_type = Clock;
  using classifier_type = Classifier;
  using listener_type = Listener;

  Clock clock{};
  Classifier classifier{};
  Listener listener{};

  // The kind of `s` for `op`: success for OK, otherwise the classifier's.
  [[nodiscard]] outcome_kind classify(const absl::Status& s, const operation& op) const {
    return s.ok() ? outcome_kind::success : classifier(s, op);
  }

  // The same environment with one member replaced.
  template <keel::clock C>
  [[nodiscard]] environment<C, Classifier, Listener> with_clock(C c) const {
    return {std::move(c), classifier, listener};
  }
  template <keel::classifier K>
  [[nodiscard]] environment<Clock, K, Listener> with_classifier(K k) const {
    return {clock, std::move(k), listener};
  }
  template <class L>
  [[nodiscard]] environment<Clock, Classifier, L> with_listener(L l) const {
    return {clock, classifier, std::move(l)};
  }
};

// keel::environment{clock}, {clock, classifier}, {clock, classifier, listener}.
template <keel::clock C>
environment(C) -> environment<C>;
template <keel::clock C, keel::classifier K>
environment(C, K) -> environment<C, K>;
template <keel::clock C, keel::classifier K, class L>
environment(C, K, L) -> environment<C, K, L>;

namespace detail {
template <class E>
inline constexpr bool is_environment = false;
template <class C, class K, class L>
inline constexpr bool is_environment<environment<C, K, L>> = true;
}  // namespace detail

// A specialisation of keel::environment.
template <class E>
concept any_environment = detail::is_environment<std::remove_cvref_t<E>>;

}  // namespace keel
