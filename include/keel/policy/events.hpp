// keel/policy/events.hpp — the events keel's policies report (retry, admission,
// bulkhead, circuit breaker, adaptive limit and throttle, chaos), and the small enums
// and values they carry.
//
// A light header: a listener or a metrics backend (keel/observe/telemetry_metrics.hpp)
// includes this, not the policies. The policies include it and report these
// to their run context's listener (keel/core/policy.hpp, keel/core/telemetry.hpp).
//
// Example (a listener that counts breaker trips):
//
//   struct trip_counter {
//     std::atomic<int>* trips;
//     void operator()(const keel::events::breaker_state_changed& e) const {
//       if (e.change.to == keel::breaker_state::open) ++*trips;
//     }
//   };
//
// Thread-safety: plain types. Events refer to data owned by the reporter:
// valid only during the listener call.
#pragma once

#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "keel/core/call.hpp"
#include "keel/core/clock.hpp"

namespace keel {

// Which limit of an admission level refused (keel/policy/admission.hpp). table_full: the level's table of keys is
// full of keys in use, so a new key could not get its own quota.
enum class quota_limit : std::uint8_t { rate, in_flight, queued, compute, table_full };

[[nodiscard]] constexpr std::string_view to_string(quota_limit l) noexcept {
  switch (l) {
    case quota_limit::rate: return "rate";
    case quota_limit::in_flight: return "in_flight";
    case quota_limit::queued: return "queued";
    case quota_limit::compute: return "compute";
    case quota_limit::table_full: return "table_full";
  }
  return "unknown";
}

// Why a bulkhead refused (keel/policy/bulkhead.hpp).
enum class bulkhead_refusal : std::uint8_t { queue_full, queue_timeout, deadline, cancelled, unknown_class };

[[nodiscard]] constexpr std::string_view to_string(bulkhead_refusal r) noexcept {
  switch (r) {
    case bulkhead_refusal::queue_full: return "queue full";
    case bulkhead_refusal::queue_timeout: return "queue timeout";
    case bulkhead_refusal::deadline: return "deadline";
    case bulkhead_refusal::cancelled: return "cancelled";
    case bulkhead_refusal::unknown_class: return "unknown class";
  }
  return "unknown";
}

// A circuit breaker's state (keel/policy/circuit_breaker.hpp).
enum class breaker_state : std::uint8_t { closed, open, half_open, forced_open, forced_closed };

[[nodiscard]] constexpr std::string_view to_string(breaker_state s) noexcept {
  switch (s) {
    case breaker_state::closed: return "closed";
    case breaker_state::open: return "open";
    case breaker_state::half_open: return "half-open";
    case breaker_state::forced_open: return "forced-open";
    case breaker_state::forced_closed: return "forced-closed";
  }
  return "unknown";
}

// What a chaos stage injects (keel/policy/chaos.hpp).
enum class chaos_kind : std::uint8_t { fault, latency, outcome };

[[nodiscard]] constexpr std::string_view to_string(chaos_kind k) noexcept {
  switch (k) {
    case chaos_kind::fault: return "fault";
    case chaos_kind::latency: return "latency";
    case chaos_kind::outcome: return "outcome";
  }
  return "unknown";
}

// One state change of a circuit breaker.
struct breaker_transition {
  breaker_state from = breaker_state::closed;
  breaker_state to = breaker_state::closed;
  time_point at{};
  int trips = 0;  // consecutive trips without closing, after this change
};

namespace events {

// --- retries (keel/policy/retry.hpp)

// A retry will be made after `wait`.
struct retry_scheduled {
  const keel::call& call;
  int layer_attempt;          // attempts this layer has made so far
  duration wait;
  bool hinted;                // the wait is the provider's retry-after hint
  const absl::Status& cause;  // the failure being retried
};

// A retry layer gave up; `last` is what the caller receives.
struct retry_stopped {
  enum class reason {
    not_retryable,       // permanent, ambiguous for a non-repeatable operation,
                         // or a refusal that gave no retry-after
    layer_attempts,      // retry_options::max_attempts reached
    call_attempts,       // the call's attempt cap reached
    cancelled,           // stop requested
    hint_too_long,       // retry-after above max_retry_after
    deadline,            // no time for another attempt
    budget,              // the retry budget refused
  };
  const keel::call& call;
  reason why;
  const absl::Status& last;
};

// --- admission (keel/policy/admission.hpp)

// Admission refused a pass of `call`.
struct admission_refused {
  const keel::call& call;
  std::string_view level;  // "tenant" or "model"
  std::string_view key;
  quota_limit limit;
};

// --- bulkheads (keel/policy/bulkhead.hpp)

// A bulkhead refused a pass of `call`.
struct bulkhead_rejected {
  const keel::call& call;
  std::string_view work_class;
  bulkhead_refusal why;
};

// --- circuit breakers (keel/policy/circuit_breaker.hpp)

// A breaker changed state while running a pipeline's call.
struct breaker_state_changed {
  std::string_view breaker;
  breaker_transition change;
};

// A breaker refused a pass: it is open, forced open, or half-open with all
// its probes out.
struct breaker_rejected {
  const keel::call& call;
  std::string_view breaker;
  breaker_state state;
};

// --- adaptive limits (keel/policy/adaptive_limit.hpp, adaptive_throttle.hpp)

// An adaptive concurrency limit refused a pass: its class's share of the
// current limit was taken.
struct adaptive_limit_rejected {
  const keel::call& call;
  std::string_view limiter;
  std::string_view work_class;
  int limit;      // the whole limit at the moment
  int in_flight;  // calls holding a permit at the moment
};

// An adaptive concurrency limit moved, or started or ended a baseline probe.
struct adaptive_limit_changed {
  std::string_view limiter;
  int from;
  int to;
  duration baseline;  // the latency the limit compares against
  duration sample;    // the window's mean latency that caused the change
  bool probing;       // true while the limit is lowered to re-measure the baseline
};

// An adaptive throttle rejected a pass locally, with probability
// `reject_probability`.
struct adaptive_throttle_rejected {
  const keel::call& call;
  std::string_view throttle;
  std::string_view work_class;
  double reject_probability;
};

// --- chaos (keel/policy/chaos.hpp)

// A chaos stage hit a pass of `call`: it returns `fault` (kind fault), waits
// `delay` (latency) or returns its chosen result (outcome).
struct chaos_injected {
  const keel::call& call;
  std::string_view stage;      // the stage's name
  chaos_kind kind;
  duration delay;              // latency: the wait; otherwise zero
  const absl::Status& fault;   // fault: the status injected; otherwise OK
};

}  // namespace events
}  // namespace keel
