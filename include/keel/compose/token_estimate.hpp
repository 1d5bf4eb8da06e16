// keel/compose/token_estimate.hpp — how many tokens to reserve for a model
// call before it runs: its input plus the requested maximum, or plus a high
// percentile of the output recent streams actually produced.
//
// Admission in tokens (keel/policy/admission.hpp's compute quota,
// keel/fleet/shared_quota.hpp's with_estimate) reserves an estimate up front
// and settles it to the actual usage at the stream's end. Reserving the
// requested maximum (max_tokens: often 4096 for answers of 300) holds a
// tenant's tokens-per-minute budget for output that never comes, so far
// fewer streams run at once than the budget allows; reserving too little
// lets concurrent streams overshoot it until they settle. keel::token_estimate
// learns the `percentile` of recent output tokens (each finished stream's
// usage chunk, else its counted tokens) and reserves
//
//     input + min(max_tokens, learned percentile)
//
// once `min_samples` streams are known, input + max_tokens until then. A
// model's outputs differ from another's: keep one per model (or per route).
//
// Example:
//
//   keel::token_estimate output({.percentile = 0.95, .min_samples = 50});
//   auto pipe = keel::pipeline(quotas.with_estimate([&](const keel::call& c) -> std::int64_t {
//     const chat* req = c.request<chat>();  // the call carries the service's request
//     return req != nullptr ? output.estimate(req->input_tokens, req->max_tokens) : 0;
//   }), keel::retry({.max_attempts = 3}));
//   absl::StatusOr<keel::stream_result> r = pipe.run(call, stream.attempts(provider));
//   output.record(r);   // what it produced: the next estimates learn from it
//
// Costs: estimate() is one relaxed atomic load; record() is the window's
// lock-free store, with an exact refresh now and then (keel::latency_tracker,
// whose percentile of int64 samples it reuses: a token count is kept as a
// count of nanoseconds).
//
// Thread-safety: estimate() and record() may be called from any thread.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "keel/compose/stream.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/status.hpp"
#include "keel/policy/latency_tracker.hpp"

namespace keel {

struct token_estimate_options {
  double percentile = 0.95;  // of recent outputs, in (0, 1)
  int samples = 512;         // streams in the window, in [16, 65536]
  int min_samples = 50;      // before this many, the requested maximum; in [1, samples]

  [[nodiscard]] absl::Status validate() const {
    constexpr std::string_view who = "token_estimate_options";
    if (!(percentile > 0.0 && percentile < 1.0))
      return detail::invalid_field(who, "percentile", "be in (0, 1)", percentile);
    if (samples < 16 || samples > 65536) return detail::invalid_field(who, "samples", "be in [16, 65536]", samples);
    if (min_samples < 1 || min_samples > samples)
      return detail::invalid_field(who, "min_samples", "be in [1, samples]", min_samples);
    return absl::OkStatus();
  }
};

class token_estimate {
 public:
  // Throws keel::invalid_options if `o` is invalid.
  explicit token_estimate(const token_estimate_options& o = {})
      : options_((detail::require_valid(o.validate()), o)),
        window_(latency_tracker_options{.percentile = o.percentile,
                                        .samples = o.samples,
                                        .min_samples = o.min_samples,
                                        .refresh_every = std::min(32, o.samples)}) {}
  token_estimate(const token_estimate&) = delete;
  token_estimate& operator=(const token_estimate&) = delete;

  [[nodiscard]] const token_estimate_options& options() const noexcept { return options_; }

  // The learned percentile of output tokens, once min_samples are known.
  [[nodiscard]] std::optional<std::int64_t> learned() const noexcept {
    const std::optional<duration> p = window_.percentile();
    if (!p) return std::nullopt;
    return p->count();
  }

  // Tokens to reserve for a call reading `input` tokens and allowed up to
  // `max_tokens` of output (negative values count as 0).
  [[nodiscard]] std::int64_t estimate(std::int64_t input, std::int64_t max_tokens) const noexcept {
    const std::int64_t in = std::max<std::int64_t>(input, 0);
    const std::int64_t most = std::max<std::int64_t>(max_tokens, 0);
    const std::optional<std::int64_t> p = learned();
    return in + (p ? std::min(most, *p) : most);
  }

  // One finished call's output tokens.
  void record_output(std::int64_t tokens) noexcept { window_.record(duration(std::max<std::int64_t>(tokens, 0))); }

  // A stream's output: its usage chunk's completion_tokens when it sent one,
  // else the content tokens counted. A stream that ended early (partial)
  // says little about how long answers are and is not recorded, nor is a
  // failure.
  void record(const stream_result& r) noexcept {
    if (!r.complete || r.partial) return;
    record_output(r.usage.completion_tokens >= 0 ? r.usage.completion_tokens : r.tokens);
  }
  void record(const absl::StatusOr<stream_result>& r) noexcept {
    if (r.ok()) record(*r);
  }

 private:
  token_estimate_options options_;
  latency_tracker window_;
};

}  // namespace keel
