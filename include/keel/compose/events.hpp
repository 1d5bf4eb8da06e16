// keel/compose/events.hpp — the events keel's composition policies report
// (hedge, fallback).
//
// A light header: a listener or a metrics backend (keel/observe/telemetry_metrics.hpp)
// includes this, not keel/compose/hedge.hpp or fallback.hpp, which include
// it and report these to their run context's listener (keel/core/telemetry.hpp).
//
// Example (a listener that counts degraded answers by path):
//
//   struct degraded_counter {
//     void operator()(const keel::events::fallback_used& e) const { count(e.path); }
//   };
//
// Thread-safety: plain types. Events refer to data owned by the reporter:
// valid only during the listener call.
#pragma once

#include <string_view>

#include "absl/status/status.h"
#include "keel/core/call.hpp"
#include "keel/core/clock.hpp"

namespace keel {
namespace events {

// --- hedging (keel/compose/hedge.hpp)

// The executor accepted a hedge attempt, `after` the primary started (one
// it refuses is a hedge_skipped, never a hedge_started).
struct hedge_started {
  const keel::call& call;
  int hedge;  // 1 for the first hedge
  duration after;
};

// A hedge was due but did not start; the race goes on without it.
struct hedge_skipped {
  enum class reason {
    budget,       // the retry budget refused
    executor,     // the executor refused (queue full or shut down)
    attempt_cap,  // the call's attempt cap is reached
    deadline,     // too little time left (hedge_options::min_attempt_time)
    cancelled,    // the call was cancelled
  };
  const keel::call& call;
  int hedge;
  reason why;
};

// A consequential write without an idempotency identity reached a hedge:
// refused, or run as one attempt when ran_unhedged.
struct hedge_refused_write {
  const keel::call& call;
  bool ran_unhedged;
};

// The race was won while `outstanding` other attempts were still running:
// they were asked to stop, and their upstream work may not have stopped.
struct hedge_losers_cancelled {
  const keel::call& call;
  int winner;  // 0: the primary
  int outstanding;
};

// --- fallback (keel/compose/fallback.hpp)

// An alternative answered (or, terminal, ended the chain) for the call.
struct fallback_used {
  const keel::call& call;
  std::string_view path;
  const absl::Status& primary_failure;
};

// An alternative was not used or did not serve.
struct fallback_skipped {
  enum class reason {
    gate,      // a gate refused it; `gate` names which, `why` says why
    deadline,  // less than its min_time was left
    failed,    // it ran and failed; `why` is its failure
    cancelled  // the call was cancelled before it could run
  };
  const keel::call& call;
  std::string_view path;
  reason why_not;
  std::string_view gate;  // empty unless why_not == gate
  const absl::Status& why;
};

}  // namespace events
}  // namespace keel
