// keel/keel.hpp — every core keel header at once, for convenience.
//
// Prefer including the component headers you use: each is self-contained
// and compiles faster alone. Store backends (keel/store/*.hpp) and the test
// kit (keel/testing/*.hpp) are not included here: they link their own
// clients.
//
// Example:
//
//   #include "keel/keel.hpp"
//   auto pipe = keel::pipeline(keel::retry({.max_attempts = 3}));
#pragma once

#include "keel/adaptive_timeout.hpp"
#include "keel/admission.hpp"
#include "keel/backoff.hpp"
#include "keel/breaker_registry.hpp"
#include "keel/bulkhead.hpp"
#include "keel/call.hpp"
#include "keel/circuit_breaker.hpp"
#include "keel/clock.hpp"
#include "keel/deadline.hpp"
#include "keel/digest.hpp"
#include "keel/executor.hpp"
#include "keel/fallback.hpp"
#include "keel/fan_out.hpp"
#include "keel/format.hpp"
#include "keel/hedge.hpp"
#include "keel/idempotency.hpp"
#include "keel/job_queue.hpp"
#include "keel/latency_histogram.hpp"
#include "keel/latency_tracker.hpp"
#include "keel/lease.hpp"
#include "keel/metrics.hpp"
#include "keel/outcome.hpp"
#include "keel/ownership.hpp"
#include "keel/pipeline.hpp"
#include "keel/policy.hpp"
#include "keel/prometheus.hpp"
#include "keel/rate_limiter.hpp"
#include "keel/result_store.hpp"
#include "keel/retry.hpp"
#include "keel/retry_budget.hpp"
#include "keel/slo.hpp"
#include "keel/status.hpp"
#include "keel/telemetry.hpp"
#include "keel/telemetry_metrics.hpp"
#include "keel/time_limit.hpp"
