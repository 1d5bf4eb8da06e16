// keel/telemetry_metrics.hpp — a telemetry listener that counts keel's
// events in a metrics_registry, for a Prometheus /metrics endpoint.
//
// keel::metrics_listener is a listener in the sense of keel/telemetry.hpp:
// pass it to a pipeline with .observe(listener) (or to any component that
// takes a listener). It registers its families once, at construction, and
// resolves every series it will touch then, so handling an event is one or
// two relaxed atomic adds: no lookup, lock or allocation. It is a handful of
// pointers, cheap to copy; copies count into the same registry.
//
// What it counts (names with the default prefix "keel_"):
//
//   keel_retries_total{hinted}        retries scheduled; hinted="true" when the
//                                     wait was the provider's retry-after hint
//   keel_retry_wait_seconds           histogram of the waits before retries
//   keel_retry_stops_total{reason}    retry layers that gave up, by reason:
//                                     not_retryable, layer_attempts,
//                                     call_attempts, cancelled, hint_too_long,
//                                     deadline, budget
//
// Example:
//
//   keel::metrics_registry registry;
//   keel::metrics_listener listener(registry);
//   auto pipe = keel::pipeline(keel::retry({.max_attempts = 3})).observe(listener);
//   ...
//   std::string body = *keel::to_prometheus_text(registry.snapshot());   // keel/prometheus.hpp
//
// Thread-safety: the constructor registers into the registry (thread-safe);
// the call operators may run on any number of threads at once.
#pragma once

#include <array>
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "keel/metrics.hpp"
#include "keel/retry.hpp"
#include "keel/status.hpp"

namespace keel {

struct metrics_listener_options {
  // Put before every metric name; may be empty.
  std::string prefix = "keel_";
  // Bounds, in seconds, of the retry-wait histogram.
  std::vector<double> retry_wait_buckets = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30};

  [[nodiscard]] absl::Status validate() const {
    if (!prefix.empty() && !detail::valid_metric_name(prefix + "x"))
      return detail::invalid_field("metrics_listener_options", "prefix", "make valid metric names",
                                   detail::quoted(prefix));
    metric_options buckets{.name = "x", .help = "x", .buckets = retry_wait_buckets};
    if (absl::Status s = buckets.validate_as(metric_type::histogram); !s.ok())
      return detail::invalid_field("metrics_listener_options", "retry_wait_buckets",
                                   "be finite and strictly increasing", retry_wait_buckets.size());
    return absl::OkStatus();
  }
};

namespace detail {

[[nodiscard]] constexpr std::string_view to_string(events::retry_stopped::reason r) noexcept {
  using reason = events::retry_stopped::reason;
  switch (r) {
    case reason::not_retryable: return "not_retryable";
    case reason::layer_attempts: return "layer_attempts";
    case reason::call_attempts: return "call_attempts";
    case reason::cancelled: return "cancelled";
    case reason::hint_too_long: return "hint_too_long";
    case reason::deadline: return "deadline";
    case reason::budget: return "budget";
  }
  return "unknown";
}

inline constexpr std::size_t retry_stop_reasons = 7;

}  // namespace detail

class metrics_listener {
 public:
  // Registers the families and their series. Throws keel::invalid_options
  // if the options are invalid or a name is taken by a different metric.
  explicit metrics_listener(metrics_registry& registry, const metrics_listener_options& o = {}) {
    detail::require_valid(o.validate());
    auto& retries = registry.counter({.name = o.prefix + "retries_total",
                                      .help = "Retries scheduled, by whether the wait was the provider's "
                                              "retry-after hint.",
                                      .labels = {"hinted"}});
    retries_[0] = &retries.with({"false"});
    retries_[1] = &retries.with({"true"});
    retry_wait_ = &registry
                       .histogram({.name = o.prefix + "retry_wait_seconds",
                                   .help = "Waits before retries, in seconds.",
                                   .buckets = o.retry_wait_buckets})
                       .with({});
    auto& stops = registry.counter({.name = o.prefix + "retry_stops_total",
                                    .help = "Retry layers that gave up, by reason.",
                                    .labels = {"reason"}});
    for (std::size_t i = 0; i < detail::retry_stop_reasons; ++i) {
      retry_stops_[i] = &stops.with({detail::to_string(static_cast<events::retry_stopped::reason>(i))});
    }
  }

  void operator()(const events::retry_scheduled& e) const noexcept {
    retries_[e.hinted ? 1 : 0]->inc();
    retry_wait_->observe(e.wait);
  }

  void operator()(const events::retry_stopped& e) const noexcept {
    const auto i = static_cast<std::size_t>(e.why);
    if (i < detail::retry_stop_reasons) retry_stops_[i]->inc();
  }

 private:
  std::array<counter_metric*, 2> retries_{};
  histogram_metric* retry_wait_ = nullptr;
  std::array<counter_metric*, detail::retry_stop_reasons> retry_stops_{};
};

}  // namespace keel
