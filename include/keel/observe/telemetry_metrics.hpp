// keel/observe/telemetry_metrics.hpp — a telemetry listener that counts keel's
// events in a metrics_registry, for a Prometheus /metrics endpoint.
//
// keel::metrics_listener is a listener in the sense of keel/core/telemetry.hpp:
// put it in the service's environment (keel/core/environment.hpp) and every
// component built with that environment reports to it. It includes only the
// light event headers (keel/{policy,compose,durable}/events.hpp), never the
// components. It registers its families once, at construction, and
// resolves every series with fixed labels then: handling a retry, hedge,
// lease or idempotency event is one or two relaxed atomic adds, with no
// lookup, lock or allocation. Events labelled by a name (a tenant, a work
// class, a breaker, a fallback path, a job queue) find their series under
// the family's mutex (a map lookup by string_view; it allocates only the
// first time a name is seen). It is a handful of pointers, cheap to copy;
// copies count into the same registry.
//
// What it counts (names with the default prefix "keel_"):
//
//   retries (keel/policy/retry.hpp)
//     keel_retries_total{hinted}              retries scheduled; hinted="true" when the
//                                             wait was the provider's retry-after hint
//     keel_retry_wait_seconds                 histogram of the waits before retries
//     keel_retry_stops_total{reason}          retry layers that gave up: not_retryable,
//                                             layer_attempts, call_attempts, cancelled,
//                                             hint_too_long, deadline, budget
//   admission and bulkheads (keel/policy/admission.hpp, keel/policy/bulkhead.hpp): rejections
//   with the limit that refused
//     keel_admission_rejections_total{level,key,limit}   level tenant/model, key its
//                                             name, limit rate/in_flight/queued/compute/table_full
//     keel_bulkhead_rejections_total{class,reason}        queue_full, queue_timeout,
//                                             deadline, cancelled, unknown_class
//   adaptive limits (keel/policy/adaptive_limit.hpp, keel/policy/adaptive_throttle.hpp)
//     keel_adaptive_limit{limiter}            gauge: the limit after its latest change
//     keel_adaptive_limit_rejections_total{limiter,class}
//     keel_adaptive_throttle_rejections_total{throttle,class}   rejected locally
//   chaos drills (keel/policy/chaos.hpp)
//     keel_chaos_injections_total{stage,kind} passes a chaos stage hit: fault, latency, outcome
//   circuit breakers (keel/policy/circuit_breaker.hpp)
//     keel_breaker_transitions_total{breaker,from,to}
//     keel_breaker_rejections_total{breaker,state}   calls refused, and in which state
//   hedging (keel/compose/hedge.hpp)
//     keel_hedges_started_total
//     keel_hedges_skipped_total{reason}       budget, executor, attempt_cap, deadline, cancelled
//     keel_hedge_refused_writes_total{ran_unhedged}
//     keel_hedge_losers_cancelled_total       attempts still running when the race was won
//                                             (their upstream work may go on); the live
//                                             count is keel_hedge_outstanding, see watch_hedge()
//   fan-out (keel/durable/fan_out.hpp)
//     keel_fan_out_units_started_total        unit workers started
//     keel_fan_out_unit_results_total{state}  units settled in a run, by state: cached
//                                             (answered from the result store), succeeded,
//                                             failed, cancelled, missing
//     keel_fan_out_runs_total{rule_met}       fan-out runs, by whether the completion rule was met
//     (watch_fan_out() reports a collector's own figures, outstanding units included)
//   fallback (keel/compose/fallback.hpp)
//     keel_fallbacks_total{path}              answers served by an alternative (degraded)
//     keel_fallback_skips_total{path,reason,gate}   alternatives not used: gate, deadline,
//                                             failed, cancelled (gate names the gate)
//   durable state (keel/durable/lease.hpp, keel/durable/idempotency.hpp)
//     keel_leases_lost_total                  lease keepers that gave up: the work was stopped
//     keel_idempotency_begins_total{state}    claimed, in-flight, replay, conflict
//   batch jobs (keel/durable/job_queue.hpp; its lease keepers count in keel_leases_lost_total)
//     keel_job_attempts_total{queue,result}   job attempts that ended, by where the job went:
//                                             done, requeued (to be tried again), failed
//                                             (for good), or lost (the worker's fenced write
//                                             was refused: another worker holds the job)
//     keel_job_rejections_total{queue}        submissions refused because the queue was full
//
// Labels taken from names the listener does not control (tenants, models,
// work classes, breakers, paths, gates, job queues) are capped at
// `max_series` series per family; past that, new names are counted under the
// value "_other".
//
// Example:
//
//   keel::metrics_registry registry;
//   keel::metrics_listener listener(registry);
//   const auto env = keel::environment<>{}.with_listener(listener);
//   auto pipe = keel::pipeline(keel::retry({.max_attempts = 3})).in(env);
//   ...
//   std::string body = *keel::to_prometheus_text(registry.snapshot());   // keel/observe/prometheus.hpp
//
// Thread-safety: the constructor registers into the registry (thread-safe);
// the call operators may run on any number of threads at once.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "keel/compose/events.hpp"
#include "keel/core/outcome.hpp"
#include "keel/core/status.hpp"
#include "keel/durable/events.hpp"
#include "keel/observe/metrics.hpp"
#include "keel/policy/events.hpp"

namespace keel {

struct metrics_listener_options {
  // Put before every metric name; may be empty.
  std::string prefix = "keel_";
  // Bounds, in seconds, of the retry-wait histogram.
  std::vector<double> retry_wait_buckets = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30};
  // Series per family labelled by breaker, path or gate names; >= 1.
  std::size_t max_series = 1000;

  [[nodiscard]] absl::Status validate() const {
    if (!prefix.empty() && !detail::valid_metric_name(prefix + "x"))
      return detail::invalid_field("metrics_listener_options", "prefix", "make valid metric names",
                                   detail::quote_text(prefix));
    metric_options buckets{.name = "x", .help = "x", .buckets = retry_wait_buckets};
    if (absl::Status s = buckets.validate_as(metric_type::histogram); !s.ok())
      return detail::invalid_field("metrics_listener_options", "retry_wait_buckets",
                                   "be finite and strictly increasing", retry_wait_buckets.size());
    if (max_series < 1) return detail::invalid_field("metrics_listener_options", "max_series", "be >= 1", max_series);
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

[[nodiscard]] constexpr std::string_view to_string(events::hedge_skipped::reason r) noexcept {
  using reason = events::hedge_skipped::reason;
  switch (r) {
    case reason::budget: return "budget";
    case reason::executor: return "executor";
    case reason::attempt_cap: return "attempt_cap";
    case reason::deadline: return "deadline";
    case reason::cancelled: return "cancelled";
  }
  return "unknown";
}
inline constexpr std::size_t hedge_skip_reasons = 5;

[[nodiscard]] constexpr std::string_view to_string(events::fallback_skipped::reason r) noexcept {
  using reason = events::fallback_skipped::reason;
  switch (r) {
    case reason::gate: return "gate";
    case reason::deadline: return "deadline";
    case reason::failed: return "failed";
    case reason::cancelled: return "cancelled";
  }
  return "unknown";
}

inline constexpr std::size_t begin_states = 4;

// The states a fan-out unit settles in (events::fan_out_unit_*), as label values.
inline constexpr std::array<unit_state, 5> fan_out_settled = {unit_state::cached, unit_state::succeeded,
                                                              unit_state::failed, unit_state::cancelled,
                                                              unit_state::missing};
[[nodiscard]] constexpr std::size_t fan_out_slot(unit_state s) noexcept {
  for (std::size_t i = 0; i < fan_out_settled.size(); ++i)
    if (fan_out_settled[i] == s) return i;
  return fan_out_settled.size();
}

// snake_case, as label values go (bulkhead.hpp's own to_string has spaces).
[[nodiscard]] constexpr std::string_view label_of(bulkhead_refusal r) noexcept {
  switch (r) {
    case bulkhead_refusal::queue_full: return "queue_full";
    case bulkhead_refusal::queue_timeout: return "queue_timeout";
    case bulkhead_refusal::deadline: return "deadline";
    case bulkhead_refusal::cancelled: return "cancelled";
    case bulkhead_refusal::unknown_class: return "unknown_class";
  }
  return "unknown";
}

// Where a job went after an attempt (events::job_finished): a job queued
// again is a retry.
[[nodiscard]] constexpr std::string_view job_attempt_result(job_state s) noexcept {
  return s == job_state::queued ? "requeued" : to_string(s);
}

inline constexpr std::string_view other_label = "_other";

}  // namespace detail

class metrics_listener {
 public:
  // Registers the families and the series with fixed labels. Throws
  // keel::invalid_options if the options are invalid or a name is taken by
  // a different metric.
  explicit metrics_listener(metrics_registry& registry, const metrics_listener_options& o = {})
      : max_series_((detail::require_valid(o.validate()), o.max_series)) {
    register_policy_metrics(registry, o);
    register_composition_metrics(registry, o.prefix);
    register_durable_metrics(registry, o.prefix);
  }

 private:
  // The families of keel/policy's events: retries, admission, bulkheads,
  // adaptive limits and throttles, chaos stages, breakers.
  void register_policy_metrics(metrics_registry& registry, const metrics_listener_options& o) {
    const std::string& p = o.prefix;
    auto& retries = registry.counter({.name = p + "retries_total",
                                      .help = "Retries scheduled, by whether the wait was the provider's "
                                              "retry-after hint.",
                                      .labels = {"hinted"}});
    retries_[0] = &retries.with({"false"});
    retries_[1] = &retries.with({"true"});
    retry_wait_ = &registry
                       .histogram({.name = p + "retry_wait_seconds",
                                   .help = "Waits before retries, in seconds.",
                                   .buckets = o.retry_wait_buckets})
                       .with({});
    auto& stops = registry.counter(
        {.name = p + "retry_stops_total", .help = "Retry layers that gave up, by reason.", .labels = {"reason"}});
    for (std::size_t i = 0; i < detail::retry_stop_reasons; ++i) {
      retry_stops_[i] = &stops.with({detail::to_string(static_cast<events::retry_stopped::reason>(i))});
    }

    admission_rejections_ = &registry.counter({.name = p + "admission_rejections_total",
                                               .help = "Calls admission refused, by quota level, key and the "
                                                       "limit that refused.",
                                               .labels = {"level", "key", "limit"}});
    bulkhead_rejections_ = &registry.counter({.name = p + "bulkhead_rejections_total",
                                              .help = "Calls a bulkhead refused, by work class and reason.",
                                              .labels = {"class", "reason"}});

    adaptive_limit_ = &registry.gauge({.name = p + "adaptive_limit",
                                       .help = "An adaptive concurrency limit, after its latest change.",
                                       .labels = {"limiter"}});
    adaptive_limit_rejections_ = &registry.counter({.name = p + "adaptive_limit_rejections_total",
                                                    .help = "Calls an adaptive concurrency limit refused, by "
                                                            "work class.",
                                                    .labels = {"limiter", "class"}});
    adaptive_throttle_rejections_ = &registry.counter({.name = p + "adaptive_throttle_rejections_total",
                                                       .help = "Calls an adaptive throttle rejected locally, by "
                                                               "work class.",
                                                       .labels = {"throttle", "class"}});

    chaos_injections_ = &registry.counter({.name = p + "chaos_injections_total",
                                           .help = "Passes a chaos stage hit, by stage and what it injected.",
                                           .labels = {"stage", "kind"}});

    transitions_ = &registry.counter({.name = p + "breaker_transitions_total",
                                      .help = "Circuit breaker state changes.",
                                      .labels = {"breaker", "from", "to"}});
    breaker_rejections_ = &registry.counter({.name = p + "breaker_rejections_total",
                                             .help = "Calls a circuit breaker refused, by the state it was in.",
                                             .labels = {"breaker", "state"}});
  }

  // The families of keel/compose's events: hedges and fallbacks.
  void register_composition_metrics(metrics_registry& registry, const std::string& p) {
    hedges_started_ =
        &registry.counter({.name = p + "hedges_started_total", .help = "Hedge attempts started."}).with({});
    auto& skipped = registry.counter(
        {.name = p + "hedges_skipped_total", .help = "Hedges that were due but not started.", .labels = {"reason"}});
    for (std::size_t i = 0; i < detail::hedge_skip_reasons; ++i) {
      hedges_skipped_[i] = &skipped.with({detail::to_string(static_cast<events::hedge_skipped::reason>(i))});
    }
    auto& refused = registry.counter({.name = p + "hedge_refused_writes_total",
                                      .help = "Non-idempotent writes that reached a hedge: refused, or run "
                                              "unhedged.",
                                      .labels = {"ran_unhedged"}});
    hedge_refused_writes_[0] = &refused.with({"false"});
    hedge_refused_writes_[1] = &refused.with({"true"});
    hedge_losers_ = &registry
                         .counter({.name = p + "hedge_losers_cancelled_total",
                                   .help = "Attempts still running when their race was won, asked to stop; "
                                           "their upstream work may go on."})
                         .with({});

    fallbacks_ = &registry.counter(
        {.name = p + "fallbacks_total", .help = "Answers served by a fallback alternative.", .labels = {"path"}});
    fallback_skips_ = &registry.counter({.name = p + "fallback_skips_total",
                                         .help = "Fallback alternatives not used, by reason (and gate).",
                                         .labels = {"path", "reason", "gate"}});
  }

  // The families of keel/durable's events: leases, idempotency, jobs, fan-out.
  void register_durable_metrics(metrics_registry& registry, const std::string& p) {
    leases_lost_ = &registry
                        .counter({.name = p + "leases_lost_total",
                                  .help = "Lease keepers that gave up the lease; their work was asked to stop."})
                        .with({});
    auto& begins = registry.counter({.name = p + "idempotency_begins_total",
                                     .help = "Idempotent requests begun, by what the record store answered.",
                                     .labels = {"state"}});
    for (std::size_t i = 0; i < detail::begin_states; ++i) {
      idempotency_begins_[i] = &begins.with({to_string(static_cast<begin_state>(i))});
    }

    job_attempts_ = &registry.counter({.name = p + "job_attempts_total",
                                       .help = "Job attempts that ended, by where the job went: done, requeued, "
                                               "failed, or lost (the fenced write was refused).",
                                       .labels = {"queue", "result"}});
    job_rejections_ = &registry.counter({.name = p + "job_rejections_total",
                                         .help = "Job submissions refused because the queue was full.",
                                         .labels = {"queue"}});

    fan_out_started_ = &registry
                            .counter({.name = p + "fan_out_units_started_total",
                                      .help = "Fan-out unit workers started."})
                            .with({});
    auto& settled = registry.counter({.name = p + "fan_out_unit_results_total",
                                      .help = "Fan-out units settled in a run, by state: cached (answered from the "
                                              "result store), succeeded, failed, cancelled, missing.",
                                      .labels = {"state"}});
    for (std::size_t i = 0; i < detail::fan_out_settled.size(); ++i) {
      fan_out_settled_[i] = &settled.with({to_string(detail::fan_out_settled[i])});
    }
    auto& runs = registry.counter({.name = p + "fan_out_runs_total",
                                   .help = "Fan-out runs, by whether the completion rule was met.",
                                   .labels = {"rule_met"}});
    fan_out_runs_[0] = &runs.with({"false"});
    fan_out_runs_[1] = &runs.with({"true"});
  }

 public:

  // --- retries
  void operator()(const events::retry_scheduled& e) const noexcept {
    retries_[e.hinted ? 1 : 0]->inc();
    retry_wait_->observe(e.wait);
  }
  void operator()(const events::retry_stopped& e) const noexcept {
    const auto i = static_cast<std::size_t>(e.why);
    if (i < detail::retry_stop_reasons) retry_stops_[i]->inc();
  }

  // --- admission and bulkheads (looked up by name: the family's lock, no allocation once seen)
  void operator()(const events::admission_refused& e) const {
    std::string_view labels[] = {e.level, e.key, to_string(e.limit)};
    named(*admission_rejections_, labels, 0b010).inc();
  }
  void operator()(const events::bulkhead_rejected& e) const {
    std::string_view labels[] = {e.work_class, detail::label_of(e.why)};
    named(*bulkhead_rejections_, labels, 0b01).inc();
  }

  // --- adaptive limits (looked up by name: the family's lock, no allocation once seen)
  void operator()(const events::adaptive_limit_changed& e) const {
    std::string_view labels[] = {e.limiter};
    named(*adaptive_limit_, labels, 0b1).set(static_cast<double>(e.to));
  }
  void operator()(const events::adaptive_limit_rejected& e) const {
    std::string_view labels[] = {e.limiter, e.work_class};
    named(*adaptive_limit_rejections_, labels, 0b11).inc();
  }
  void operator()(const events::adaptive_throttle_rejected& e) const {
    std::string_view labels[] = {e.throttle, e.work_class};
    named(*adaptive_throttle_rejections_, labels, 0b11).inc();
  }

  // --- chaos drills (looked up by stage name: the family's lock, no allocation once seen)
  void operator()(const events::chaos_injected& e) const {
    std::string_view labels[] = {e.stage, to_string(e.kind)};
    named(*chaos_injections_, labels, 0b01).inc();
  }

  // --- circuit breakers (looked up by name: the family's lock, no allocation once seen)
  void operator()(const events::breaker_state_changed& e) const {
    std::string_view labels[] = {e.breaker, to_string(e.change.from), to_string(e.change.to)};
    named(*transitions_, labels, 0b001).inc();
  }
  void operator()(const events::breaker_rejected& e) const {
    std::string_view labels[] = {e.breaker, to_string(e.state)};
    named(*breaker_rejections_, labels, 0b01).inc();
  }

  // --- hedging
  void operator()(const events::hedge_started&) const noexcept { hedges_started_->inc(); }
  void operator()(const events::hedge_skipped& e) const noexcept {
    const auto i = static_cast<std::size_t>(e.why);
    if (i < detail::hedge_skip_reasons) hedges_skipped_[i]->inc();
  }
  void operator()(const events::hedge_refused_write& e) const noexcept {
    hedge_refused_writes_[e.ran_unhedged ? 1 : 0]->inc();
  }
  void operator()(const events::hedge_losers_cancelled& e) const noexcept {
    if (e.outstanding > 0) hedge_losers_->inc(static_cast<std::uint64_t>(e.outstanding));
  }

  // --- fallback
  void operator()(const events::fallback_used& e) const {
    std::string_view labels[] = {e.path};
    named(*fallbacks_, labels, 0b1).inc();
  }
  void operator()(const events::fallback_skipped& e) const {
    std::string_view labels[] = {e.path, detail::to_string(e.why_not), e.gate};
    named(*fallback_skips_, labels, 0b101).inc();
  }

  // --- durable state
  void operator()(const events::lease_lost&) const noexcept { leases_lost_->inc(); }
  void operator()(const events::idempotency_begin& e) const noexcept {
    const auto i = static_cast<std::size_t>(e.state);
    if (i < detail::begin_states) idempotency_begins_[i]->inc();
  }

  // --- batch jobs (looked up by queue name: the family's lock, no allocation once seen)
  void operator()(const events::job_finished& e) const {
    std::string_view labels[] = {e.queue, detail::job_attempt_result(e.state)};
    named(*job_attempts_, labels, 0b01).inc();
  }
  void operator()(const events::job_lost& e) const {
    std::string_view labels[] = {e.queue, "lost"};
    named(*job_attempts_, labels, 0b01).inc();
  }
  void operator()(const events::job_rejected& e) const {
    std::string_view labels[] = {e.queue};
    named(*job_rejections_, labels, 0b1).inc();
  }

  // --- fan-out
  void operator()(const events::fan_out_unit_started&) const noexcept { fan_out_started_->inc(); }
  void operator()(const events::fan_out_unit_cached&) const noexcept { settled(unit_state::cached); }
  void operator()(const events::fan_out_unit_finished& e) const noexcept { settled(e.state); }
  void operator()(const events::fan_out_unit_missing&) const noexcept { settled(unit_state::missing); }
  void operator()(const events::fan_out_finished& e) const noexcept { fan_out_runs_[e.rule_met ? 1 : 0]->inc(); }

 private:
  void settled(unit_state s) const noexcept {
    const std::size_t i = detail::fan_out_slot(s);
    if (i < detail::fan_out_settled.size()) fan_out_settled_[i]->inc();
  }

  // The series for `labels`; the values whose bit is set in `named` are
  // names from outside, which become "_other" once the family is full.
  template <class Metric>
  Metric& named(metric_family<Metric>& f, std::span<std::string_view> labels, unsigned named) const {
    if (Metric* c = f.with_at_most(labels, max_series_)) return *c;
    for (std::size_t i = 0; i < labels.size(); ++i) {
      if ((named >> i) & 1u) labels[i] = detail::other_label;
    }
    return f.with(labels);
  }

  std::size_t max_series_;
  std::array<counter_metric*, 2> retries_{};
  histogram_metric* retry_wait_ = nullptr;
  std::array<counter_metric*, detail::retry_stop_reasons> retry_stops_{};
  counter_family* admission_rejections_ = nullptr;
  counter_family* bulkhead_rejections_ = nullptr;
  gauge_family* adaptive_limit_ = nullptr;
  counter_family* adaptive_limit_rejections_ = nullptr;
  counter_family* adaptive_throttle_rejections_ = nullptr;
  counter_family* chaos_injections_ = nullptr;
  counter_family* transitions_ = nullptr;
  counter_family* breaker_rejections_ = nullptr;
  counter_metric* hedges_started_ = nullptr;
  std::array<counter_metric*, detail::hedge_skip_reasons> hedges_skipped_{};
  std::array<counter_metric*, 2> hedge_refused_writes_{};
  counter_metric* hedge_losers_ = nullptr;
  counter_family* fallbacks_ = nullptr;
  counter_family* fallback_skips_ = nullptr;
  counter_metric* leases_lost_ = nullptr;
  std::array<counter_metric*, detail::begin_states> idempotency_begins_{};
  counter_family* job_attempts_ = nullptr;
  counter_family* job_rejections_ = nullptr;
  counter_metric* fan_out_started_ = nullptr;
  std::array<counter_metric*, detail::fan_out_settled.size()> fan_out_settled_{};
  std::array<counter_metric*, 2> fan_out_runs_{};
};

namespace detail {

// The family `name` in `s`, added (labelled by `label`) if not there yet, so
// several watched objects share one family.
inline metric_family_snapshot& family_in(metrics_snapshot& s, std::string name, std::string_view help,
                                         metric_type type, std::vector<std::string> labels) {
  for (auto& f : s.families)
    if (f.name == name) return f;
  return s.families.emplace_back(metric_family_snapshot{
      .name = std::move(name), .help = std::string(help), .type = type, .label_names = std::move(labels)});
}

}  // namespace detail

// Reports a hedge's live figures at every snapshot of `registry`:
//   keel_hedge_outstanding{hedge}    attempts asked to stop that have not returned yet
//   keel_hedge_wins_total{hedge}     races won by a hedge rather than the primary
// `h` (a keel::hedge, or anything whose figures() has `outstanding` and
// `hedge_wins`) must outlive the registry's snapshots. Several hedges may be
// watched under different names.
template <class Hedge>
  requires requires(const Hedge& h) {
    h.figures().outstanding;
    h.figures().hedge_wins;
  }
void watch_hedge(metrics_registry& registry, std::string name, const Hedge& h, std::string prefix = "keel_") {
  registry.add_collector([&h, name = std::move(name), prefix = std::move(prefix)](metrics_snapshot& s) {
    const auto f = h.figures();
    detail::family_in(s, prefix + "hedge_outstanding", "Hedge race losers asked to stop that have not returned yet.",
                      metric_type::gauge, {"hedge"})
        .series.push_back({.labels = {name}, .value = static_cast<double>(f.outstanding)});
    detail::family_in(s, prefix + "hedge_wins_total", "Races won by a hedge rather than the primary.",
                      metric_type::counter, {"hedge"})
        .series.push_back({.labels = {name}, .value = static_cast<double>(f.hedge_wins)});
  });
}

// Reports a fan-out collector's figures at every snapshot of `registry`:
//   keel_fan_out_units_total{fan_out,state}   units by what happened: cached,
//                                             started, succeeded, failed, cancelled
//   keel_fan_out_outstanding{fan_out}         units cancelled while running and not
//                                             confirmed stopped (upstream work may go on)
//   keel_fan_out_saved_total{fan_out}, keel_fan_out_save_errors_total{fan_out}
// `f` (a keel::fan_out, or anything whose figures() has the same fields as
// keel::fan_out_figures) must outlive the registry's snapshots.
template <class FanOut>
  requires requires(const FanOut& f) {
    f.figures().cached;
    f.figures().outstanding;
    f.figures().save_errors;
  }
void watch_fan_out(metrics_registry& registry, std::string name, const FanOut& fan, std::string prefix = "keel_") {
  registry.add_collector([&fan, name = std::move(name), prefix = std::move(prefix)](metrics_snapshot& s) {
    const auto f = fan.figures();
    auto& units = detail::family_in(s, prefix + "fan_out_units_total", "Fan-out units, by what happened to them.",
                                    metric_type::counter, {"fan_out", "state"});
    const std::pair<const char*, std::int64_t> states[] = {{"cached", f.cached},
                                                           {"started", f.started},
                                                           {"succeeded", f.succeeded},
                                                           {"failed", f.failed},
                                                           {"missing", f.missing},
                                                           {"cancelled", f.cancelled}};
    for (const auto& [state, n] : states) {
      units.series.push_back({.labels = {name, state}, .value = static_cast<double>(n)});
    }
    detail::family_in(s, prefix + "fan_out_outstanding",
                      "Fan-out units cancelled while running, not confirmed stopped.", metric_type::gauge,
                      {"fan_out"})
        .series.push_back({.labels = {name}, .value = static_cast<double>(f.outstanding)});
    detail::family_in(s, prefix + "fan_out_saved_total", "Fan-out results saved to the store.", metric_type::counter,
                      {"fan_out"})
        .series.push_back({.labels = {name}, .value = static_cast<double>(f.saved)});
    detail::family_in(s, prefix + "fan_out_save_errors_total", "Fan-out results the store failed to save.",
                      metric_type::counter, {"fan_out"})
        .series.push_back({.labels = {name}, .value = static_cast<double>(f.save_errors)});
  });
}

}  // namespace keel
