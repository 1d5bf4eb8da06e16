// keel/durable/events.hpp — the events the durable components report (keel::once,
// lease_keeper, job_queue, fan_out), and the small state enums they carry.
//
// A light header: a listener or a metrics backend (keel/observe/telemetry_metrics.hpp)
// includes this, not the algorithms. The components include it and report
// these to their environment's listener (keel/core/environment.hpp,
// keel/core/telemetry.hpp).
//
// Example (a listener that counts fan-out units answered from the store):
//
//   struct replay_counter {
//     std::atomic<int>* replays;
//     void operator()(const keel::events::fan_out_unit_cached&) const { ++*replays; }
//   };
//
// Thread-safety: plain types. Events refer to data owned by the reporter:
// valid only during the listener call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "keel/core/call.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/outcome.hpp"

namespace keel {

struct request_identity;  // keel/durable/idempotency.hpp

// What an idempotency store's begin() found (keel/durable/idempotency.hpp).
enum class begin_state { claimed, in_flight, replay, conflict };

[[nodiscard]] constexpr std::string_view to_string(begin_state s) noexcept {
  switch (s) {
    case begin_state::claimed: return "claimed";
    case begin_state::in_flight: return "in-flight";
    case begin_state::replay: return "replay";
    case begin_state::conflict: return "conflict";
  }
  return "unknown";
}

// Where a job is (keel/durable/job_store.hpp).
enum class job_state { queued, running, done, failed, expired };

[[nodiscard]] constexpr std::string_view to_string(job_state s) noexcept {
  switch (s) {
    case job_state::queued: return "queued";
    case job_state::running: return "running";
    case job_state::done: return "done";
    case job_state::failed: return "failed";
    case job_state::expired: return "expired";
  }
  return "unknown";
}

// What happened to a fan-out unit (keel/durable/fan_out.hpp).
enum class unit_state { pending, running, cached, succeeded, failed, cancelled, missing };

[[nodiscard]] constexpr std::string_view to_string(unit_state s) noexcept {
  switch (s) {
    case unit_state::pending: return "pending";
    case unit_state::running: return "running";
    case unit_state::cached: return "cached";
    case unit_state::succeeded: return "succeeded";
    case unit_state::failed: return "failed";
    case unit_state::cancelled: return "cancelled";
    case unit_state::missing: return "missing";
  }
  return "unknown";
}

namespace events {

// --- keel::once (keel/durable/once.hpp)

// Each answer of begin() that keel::once acted on (a waiting duplicate
// reports each poll).
struct idempotency_begin {
  const request_identity& identity;
  begin_state state;
};

// --- leases (keel/durable/lease.hpp)

// A lease_keeper gave up: the lease was taken over, or renewals failed until
// it could no longer be sure it held the lease. The work was asked to stop.
struct lease_lost {
  std::string_view work_key;
  const absl::Status& why;
};

// --- batch jobs (keel/durable/job_queue.hpp)

// A submission was refused because the queue is full.
struct job_rejected {
  std::string_view queue;
  const absl::Status& why;
};

// An attempt ended and its fenced write was accepted: the job is now done,
// queued again (a retry), or failed.
struct job_finished {
  std::string_view queue;
  std::int64_t id;
  int attempt;
  job_state state;
};

// A worker's complete/fail was refused: another worker holds the job now (or
// the store could not confirm the write). Nothing this worker did was kept.
struct job_lost {
  std::string_view queue;
  std::int64_t id;
  const absl::Status& why;
};

// --- fan-out (keel/durable/fan_out.hpp)
//
// Each unit of a run reports fan_out_unit_started when its worker starts,
// and exactly one of fan_out_unit_cached, fan_out_unit_finished and
// fan_out_unit_missing when its state in the run is settled; the run then
// reports fan_out_finished. A run's unit events come one at a time, in
// order (fan_out reports them under its collector's lock: keep the
// listener quick and do not call back into the collector).

// The unit's stored result was valid: answered from the result store, no
// work done (a rerun paying only for what is missing).
struct fan_out_unit_cached {
  const keel::call& call;  // the fan-out's call
  std::string_view unit;   // its name
  std::size_t index;       // in the units given to run()
};

// The unit's worker started on an executor thread.
struct fan_out_unit_started {
  const keel::call& call;
  std::string_view unit;
  std::size_t index;
};

// The unit ended with a verdict: succeeded (kind success), failed (the
// provider's failure, or a stored result that no longer validates: kind is
// its classification) or cancelled (the rule was met or the caller
// cancelled; kind cancelled).
struct fan_out_unit_finished {
  const keel::call& call;
  std::string_view unit;
  std::size_t index;
  unit_state state;
  outcome_kind kind;
  const absl::Status& status;  // OK when succeeded
  bool ran;                    // its worker ran in this run
  bool saved;                  // this run saved its answer to the store
  bool outstanding;            // cancelled while running: upstream work may go on
  duration latency;            // worker time (zero when it did not run)
};

// The unit ended without an answer and not by its provider's fault: never
// started (no time left, queued in the executor at the deadline, refused
// by the executor, the call cancelled), or its worker returned a keel
// refusal (an open breaker, a full quota) or a cancellation. kind is
// refused or cancelled.
struct fan_out_unit_missing {
  const keel::call& call;
  std::string_view unit;
  std::size_t index;
  outcome_kind kind;
  const absl::Status& why;
  bool ran;  // its worker ran (and returned the refusal)
};

// A run ended: its figures. Units count once each, by their state.
struct fan_out_finished {
  const keel::call& call;
  int units;
  int cached;
  int succeeded;
  int failed;
  int cancelled;
  int missing;
  int outstanding;  // cancelled while running, not confirmed stopped
  bool rule_met;    // the completion rule was met
  duration elapsed;  // from run() to the report
};

}  // namespace events
}  // namespace keel
