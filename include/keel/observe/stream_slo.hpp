// keel/observe/stream_slo.hpp — what streams did, per model, in a
// metrics_registry, and an objective on time to first token.
//
// keel::stream_metrics records each call's stream (the answer of a
// keel::token_stream, keel/compose/stream.hpp, or its failure before the
// first token) once it has ended:
//
//   keel_stream_time_to_first_token_seconds{model}   histogram, streams that committed
//   keel_stream_inter_token_seconds{model}           histogram of each stream's mean gap
//                                                    between tokens (generation time / (tokens - 1))
//   keel_stream_longest_gap_seconds{model}           histogram of each stream's longest gap
//   keel_streams_total{model,outcome}                complete, partial (ended early or continued),
//                                                    failed (before the first token), cancelled
//   keel_stream_stalls_total{model}                  streams that ended partial for a stall
//   keel_stream_mid_stream_failures_total{model,reason}   committed streams that ended early:
//                                                    stall, whole, deadline, cancelled, failed
//   keel_stream_continuations_total{model}           answers continued on another provider
//   keel_stream_tokens_total{model}                  model output relayed: content tokens, tool-call
//                                                    and refusal fragments
//   keel_stream_tokens_reserved_total{model}         tokens admission reserved (record_tokens)
//   keel_stream_tokens_settled_total{model}          tokens they settled to (usage, or the count)
//
// (The guard's own figures, stream_guard::figures(), count per guard: first-
// token timeouts, hedges started and won.) Model names come from outside:
// past `max_series` series in a family, new ones count under "_other".
//
// The objective on time to first token is a keel::work_class_slo
// (keel/observe/slo.hpp) whose latency is the time to first token:
// record_time_to_first_token(slo, answer, now) records a complete answer as
// success, a partial one as partial, a failure before the first token as
// failure (a cancelled one as abandoned), each with its time to first token,
// so the class's latency objective (latency_threshold, latency_target) is
// "this share of streams show a token within the threshold". Both the
// histogram and the objective use stream_result::time_to_first_token, the
// client's wait from the call's start: a stream that served after a retry
// or a first-token hedge is recorded with the time its client waited, not
// the serving attempt's own (attempt_time_to_first_token).
//
// Example:
//
//   keel::metrics_registry registry;
//   keel::stream_metrics streams(registry);
//   keel::slo_tracker slos({{"chat_ttft", {.target = 0.99, .rejected = keel::counts_as::not_eligible,
//                                          .partial = keel::counts_as::good,
//                                          .abandoned = keel::counts_as::not_eligible,
//                                          .latency_threshold = std::chrono::milliseconds(800),
//                                          .latency_target = 0.95}}});
//   absl::StatusOr<keel::stream_result> r = pipe.run(call, stream.attempts(provider));
//   streams.record("gpt-4o-mini", r);
//   keel::record_time_to_first_token(*slos.find("chat_ttft"), r, clock.now());
//
// Thread-safety: every operation may be called from any thread. A record
// finds its model's series under each family's mutex (a map lookup; it
// allocates the first time a model is seen), then adds atomically.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "keel/compose/stream.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/status.hpp"
#include "keel/observe/metrics.hpp"
#include "keel/observe/slo.hpp"

namespace keel {

struct stream_metrics_options {
  std::string prefix = "keel_";
  // Series per family (model names come from outside); past it, new ones count as "_other". >= 1.
  std::size_t max_series = 256;
  // Bounds in seconds; empty: a default suited to each.
  std::vector<double> ttft_buckets{};
  std::vector<double> gap_buckets{};

  [[nodiscard]] absl::Status validate() const {
    if (max_series < 1) return detail::invalid_field("stream_metrics_options", "max_series", "be >= 1", max_series);
    return absl::OkStatus();
  }
};

class stream_metrics {
 public:
  // Registers the families. Throws keel::invalid_options if the options are
  // invalid or a name is taken by a different metric.
  explicit stream_metrics(metrics_registry& registry, const stream_metrics_options& o = {})
      : max_((detail::require_valid(o.validate()), o.max_series)) {
    const std::string& p = o.prefix;
    static const std::vector<double> ttft{0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30};
    static const std::vector<double> gap{0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1, 2, 5, 10};
    ttft_ = &registry.histogram({.name = p + "stream_time_to_first_token_seconds",
                                 .help = "Time from a stream attempt's start to its first content token.",
                                 .labels = {"model"},
                                 .buckets = o.ttft_buckets.empty() ? ttft : o.ttft_buckets});
    inter_ = &registry.histogram({.name = p + "stream_inter_token_seconds",
                                  .help = "Each stream's mean gap between content tokens.",
                                  .labels = {"model"},
                                  .buckets = o.gap_buckets.empty() ? gap : o.gap_buckets});
    longest_ = &registry.histogram({.name = p + "stream_longest_gap_seconds",
                                    .help = "Each stream's longest gap between content tokens.",
                                    .labels = {"model"},
                                    .buckets = o.gap_buckets.empty() ? gap : o.gap_buckets});
    streams_ = &registry.counter({.name = p + "streams_total",
                                  .help = "Streams that ended, by outcome: complete, partial, failed (before the "
                                          "first token), cancelled.",
                                  .labels = {"model", "outcome"}});
    stalls_ = &registry.counter(
        {.name = p + "stream_stalls_total", .help = "Streams that ended partial for a stall.", .labels = {"model"}});
    mid_ = &registry.counter({.name = p + "stream_mid_stream_failures_total",
                              .help = "Streams that ended early after their first token, by reason.",
                              .labels = {"model", "reason"}});
    continuations_ = &registry.counter({.name = p + "stream_continuations_total",
                                        .help = "Answers continued on another provider (degraded).",
                                        .labels = {"model"}});
    tokens_ = &registry.counter(
        {.name = p + "stream_tokens_total", .help = "Content tokens relayed.", .labels = {"model"}});
    reserved_ = &registry.counter({.name = p + "stream_tokens_reserved_total",
                                   .help = "Tokens admission reserved for streams.",
                                   .labels = {"model"}});
    settled_ = &registry.counter({.name = p + "stream_tokens_settled_total",
                                  .help = "Tokens streams settled to at their end (usage, or the count).",
                                  .labels = {"model"}});
  }

  // One call's stream, once it has ended.
  void record(std::string_view model, const absl::StatusOr<stream_result>& r) {
    if (!r.ok()) {
      one(*streams_, model, absl::IsCancelled(r.status()) ? "cancelled" : "failed").inc();
      return;
    }
    const stream_result& s = *r;
    if (s.tokens > 0) {
      one(*ttft_, model).observe(s.time_to_first_token);
      one(*longest_, model).observe(s.longest_gap);
      if (s.tokens > 1) one(*inter_, model).observe(s.generation_time / (s.tokens - 1));
      one(*tokens_, model).inc(static_cast<std::uint64_t>(s.tokens));
    }
    if (s.continuations > 0) one(*continuations_, model).inc(static_cast<std::uint64_t>(s.continuations));
    if (s.reason == stream_stop::stall) one(*stalls_, model).inc();
    if (s.reason != stream_stop::none) one(*mid_, model, to_string(s.reason)).inc();
    const std::string_view outcome = s.reason == stream_stop::cancelled ? "cancelled"
                                     : s.partial                       ? "partial"
                                                                       : "complete";
    one(*streams_, model, outcome).inc();
  }

  // What admission reserved for a stream and what it settled to.
  void record_tokens(std::string_view model, std::int64_t reserved, std::int64_t settled) {
    if (reserved > 0) one(*reserved_, model).inc(static_cast<std::uint64_t>(reserved));
    if (settled > 0) one(*settled_, model).inc(static_cast<std::uint64_t>(settled));
  }

 private:
  template <class Metric, class... Rest>
  Metric& one(metric_family<Metric>& f, std::string_view model, Rest... rest) {
    std::array<std::string_view, 1 + sizeof...(Rest)> labels{model, rest...};
    if (Metric* m = f.with_at_most(std::span<const std::string_view>(labels), max_)) return *m;
    labels[0] = "_other";
    return f.with(std::span<const std::string_view>(labels));
  }

  std::size_t max_;
  histogram_family* ttft_;
  histogram_family* inter_;
  histogram_family* longest_;
  counter_family* streams_;
  counter_family* stalls_;
  counter_family* mid_;
  counter_family* continuations_;
  counter_family* tokens_;
  counter_family* reserved_;
  counter_family* settled_;
};

// Records a stream's time to first token into `slo` (see above).
inline void record_time_to_first_token(work_class_slo& slo, const absl::StatusOr<stream_result>& r, time_point now) {
  if (!r.ok()) {
    slo.record(absl::IsCancelled(r.status()) ? request_outcome::abandoned : request_outcome::failure, duration::zero(),
               now);
    return;
  }
  if (r->reason == stream_stop::cancelled) {
    slo.record(request_outcome::abandoned, r->time_to_first_token, now);
    return;
  }
  slo.record(r->partial ? request_outcome::partial : request_outcome::success, r->time_to_first_token, now);
}

}  // namespace keel
