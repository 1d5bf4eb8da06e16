// keel/core/telemetry.hpp — how components report what they do, at no cost when
// nobody listens.
//
// Every component that decides something worth counting (a retry, a
// breaker transition, a rejection and the limit that refused, a hedge, a
// fallback, a lost lease, work left running after cancel) reports it as an
// event: a small struct in namespace keel::events, defined in its layer's
// light events header (keel/policy/events.hpp, keel/compose/events.hpp,
// keel/durable/events.hpp) so a listener need not include the component. A
// listener is any callable that accepts the events it cares about; keel
// calls it synchronously on the thread that made the decision. A service
// puts its listener in its keel::environment (keel/core/environment.hpp),
// and every component built with that environment reports to it.
//
// keel::null_listener accepts everything and does nothing: it is the default
// everywhere, and with it keel::observe calls nothing. The event passed to
// observe is still built and its arguments evaluated (the optimiser drops
// what has no side effects); guard a costly one with keel::wants<L, E>.
// keel::observe(listener, event) calls a listener only for events it
// accepts, so a listener may handle just the events it wants.
//
// Example:
//
//   struct retry_counter {
//     std::atomic<int>* retries;
//     void operator()(const keel::events::retry_scheduled&) const { ++*retries; }
//   };
//   std::atomic<int> retries{0};
//   auto pipe = keel::pipeline(keel::retry({.max_attempts = 3}))
//                   .in(keel::environment<>{}.with_listener(retry_counter{&retries}));
//
// Thread-safety: listeners are called concurrently from every thread that
// runs keel components; they must be thread-safe and should be quick (count,
// enqueue), never block.
#pragma once

#include <concepts>
#include <type_traits>

namespace keel {

// Accepts every event and compiles to nothing.
struct null_listener {
  template <class Event>
  constexpr void operator()(const Event&) const noexcept {}
};

// A listener for events of type E.
template <class L, class E>
concept listener_for = std::invocable<const L&, const E&>;

// Calls `l` with `e` if it accepts events of that type; otherwise nothing.
template <class L, class E>
constexpr void observe(const L& l, const E& e) {
  if constexpr (!std::is_same_v<L, null_listener> && listener_for<L, E>) l(e);
}

// Does `l` want events of type E at all? Lets a component skip building an
// event (for example formatting a name) when nobody listens.
template <class L, class E>
inline constexpr bool wants = !std::is_same_v<L, null_listener> && listener_for<L, E>;

}  // namespace keel
