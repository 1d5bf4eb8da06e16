// keel/keel.hpp — every core keel header at once, for convenience.
//
// Prefer including the component headers you use: each is self-contained
// and compiles faster alone. The folders are keel's layers, each including
// only from the ones before it: core (vocabulary), policy, compose, provider,
// asio, durable, observe, then store (backends) and testing. Store backends
// (keel/store/*.hpp), the libcurl adapter (keel/provider/http.hpp), the
// asynchronous runs (keel/asio/*.hpp) and the test kit (keel/testing/*.hpp)
// are not included here: they link their own clients.
//
// Example:
//
//   #include "keel/keel.hpp"
//   auto pipe = keel::pipeline(keel::retry({.max_attempts = 3}));
#pragma once

#include "keel/core/any_clock.hpp"
#include "keel/core/call.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/condition.hpp"
#include "keel/core/deadline.hpp"
#include "keel/core/environment.hpp"
#include "keel/core/fiber.hpp"
#include "keel/core/format.hpp"
#include "keel/core/outcome.hpp"
#include "keel/core/policy.hpp"
#include "keel/core/status.hpp"
#include "keel/core/store_status.hpp"
#include "keel/core/telemetry.hpp"
#include "keel/core/timer.hpp"
#include "keel/core/upstream.hpp"

#include "keel/policy/adaptive_limit.hpp"
#include "keel/policy/adaptive_throttle.hpp"
#include "keel/policy/adaptive_timeout.hpp"
#include "keel/policy/admission.hpp"
#include "keel/policy/backoff.hpp"
#include "keel/policy/breaker_registry.hpp"
#include "keel/policy/bulkhead.hpp"
#include "keel/policy/chaos.hpp"
#include "keel/policy/circuit_breaker.hpp"
#include "keel/policy/events.hpp"
#include "keel/policy/latency_tracker.hpp"
#include "keel/policy/rate_limiter.hpp"
#include "keel/policy/retry.hpp"
#include "keel/policy/retry_budget.hpp"
#include "keel/policy/time_limit.hpp"

#include "keel/compose/cut_at_deadline.hpp"
#include "keel/compose/events.hpp"
#include "keel/compose/executor.hpp"
#include "keel/compose/fallback.hpp"
#include "keel/compose/hedge.hpp"
#include "keel/compose/optional_stage.hpp"
#include "keel/compose/pipeline.hpp"
#include "keel/compose/stream.hpp"
#include "keel/compose/stream_event.hpp"
#include "keel/compose/token_estimate.hpp"
#include "keel/compose/tool_calls.hpp"

#include "keel/provider/hints.hpp"
#include "keel/provider/sse.hpp"

#include "keel/durable/digest.hpp"
#include "keel/durable/events.hpp"
#include "keel/durable/fan_out.hpp"
#include "keel/durable/idempotency.hpp"
#include "keel/durable/job_queue.hpp"
#include "keel/durable/job_store.hpp"
#include "keel/durable/lease.hpp"
#include "keel/durable/once.hpp"
#include "keel/durable/ownership.hpp"
#include "keel/durable/result_store.hpp"

#include "keel/observe/latency_histogram.hpp"
#include "keel/observe/metrics.hpp"
#include "keel/observe/prometheus.hpp"
#include "keel/observe/slo.hpp"
#include "keel/observe/stream_slo.hpp"
#include "keel/observe/telemetry_metrics.hpp"
