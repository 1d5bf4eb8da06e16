// keel/testing/scripted_stream.hpp — a streaming provider that plays a
// script of tokens, gaps and failures on a manual clock, for
// keel::token_stream (keel/compose/stream.hpp).
//
// Invocation k plays script k (the last script repeats). A script is a list
// of steps, each after a gap from the previous one (the first from the
// invocation's start): a content token, a tool-call fragment, a refusal
// fragment (both model output, handed to stream_writer::event), a usage
// report, or the end (OK or a failure). A script that runs out of steps ends OK. The provider sleeps on
// the clock with the writer's stop token, so a stream stopped by a budget,
// a lost race or the caller returns at once, as a real transfer aborted does.
//
// Example (a first token after 3 s, then a stall after two tokens):
//
//   keel::testing::manual_clock clock;
//   keel::testing::scripted_stream provider(clock, {{
//       keel::testing::tok("Hel", std::chrono::seconds(3)), keel::testing::tok("lo"),
//       keel::testing::end(absl::OkStatus(), std::chrono::seconds(60))}});
//   // stream.attempts(provider): the test advances the clock.
//
// Thread-safety: operator() may be called from several threads at once (a
// first-token hedge); the figures are atomic.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "keel/compose/stream.hpp"
#include "keel/core/call.hpp"
#include "keel/core/clock.hpp"

namespace keel::testing {

struct stream_step {
  duration after{};                    // gap since the previous step (the first: since the start)
  std::optional<std::string> token{};  // a content token
  std::optional<tool_call> tool{};     // a tool-call fragment (its arguments: this fragment's piece)
  std::optional<std::string> refusal{};  // a refusal fragment
  std::optional<token_usage> usage{};  // a usage report
  std::optional<absl::Status> end{};   // the stream ends with this
};

[[nodiscard]] inline stream_step tok(std::string text, duration after = duration::zero()) {
  stream_step s;
  s.after = after;
  s.token = std::move(text);
  return s;
}
// A tool-call fragment: the call's first carries id and name, the next only a piece of the arguments.
[[nodiscard]] inline stream_step tool(std::int64_t index, std::string arguments, std::string id = {},
                                      std::string name = {}, duration after = duration::zero()) {
  stream_step s;
  s.after = after;
  std::string type = id.empty() ? std::string() : std::string("function");
  s.tool = tool_call{
      .index = index, .id = std::move(id), .type = std::move(type), .name = std::move(name), .arguments = std::move(arguments)};
  return s;
}
[[nodiscard]] inline stream_step refusal(std::string text, duration after = duration::zero()) {
  stream_step s;
  s.after = after;
  s.refusal = std::move(text);
  return s;
}
[[nodiscard]] inline stream_step usage(token_usage u, duration after = duration::zero()) {
  stream_step s;
  s.after = after;
  s.usage = u;
  return s;
}
[[nodiscard]] inline stream_step end(absl::Status s = absl::OkStatus(), duration after = duration::zero()) {
  stream_step step;
  step.after = after;
  step.end = std::move(s);
  return step;
}

template <keel::clock Clock>
class scripted_stream {
 public:
  scripted_stream(Clock clock, std::vector<std::vector<stream_step>> scripts)
      : clock_(std::move(clock)), scripts_(std::move(scripts)) {}

  absl::Status operator()(const attempt& a, stream_writer& w) {
    const auto k = static_cast<std::size_t>(invocations_.fetch_add(1, std::memory_order_relaxed));
    const std::vector<stream_step>& script = scripts_.empty() ? empty_ : scripts_[std::min(k, scripts_.size() - 1)];
    time_point t = clock_.now();
    for (const stream_step& step : script) {
      t += step.after;
      if (!clock_.sleep_until(t, w.stop_token()) || a.stop.stop_requested()) {
        stopped_.fetch_add(1, std::memory_order_relaxed);
        return absl::CancelledError("scripted_stream: stopped");
      }
      if (step.usage) w.usage(*step.usage);
      bool go_on = true;
      if (step.token) go_on = w.token(*step.token, t);
      if (step.tool) {
        const tool_call& c = *step.tool;
        const tool_call_delta d{.index = c.index, .id = c.id, .type = c.type, .name = c.name, .arguments = c.arguments};
        go_on = w.event({.kind = stream_event_kind::tool_call, .tool_calls = {&d, 1}}, t);
      }
      if (step.refusal) go_on = w.event({.kind = stream_event_kind::refusal, .refusal = *step.refusal}, t);
      if (!go_on) {
        stopped_.fetch_add(1, std::memory_order_relaxed);
        return absl::CancelledError("scripted_stream: stopped");
      }
      if (step.end) return *step.end;
    }
    return absl::OkStatus();
  }

  [[nodiscard]] int invocations() const noexcept { return invocations_.load(std::memory_order_relaxed); }
  // Invocations that returned because they were stopped.
  [[nodiscard]] int stopped() const noexcept { return stopped_.load(std::memory_order_relaxed); }

 private:
  Clock clock_;
  std::vector<std::vector<stream_step>> scripts_;
  std::vector<stream_step> empty_;
  std::atomic<int> invocations_{0};
  std::atomic<int> stopped_{0};
};

template <keel::clock Clock>
scripted_stream(Clock, std::vector<std::vector<stream_step>>) -> scripted_stream<Clock>;

}  // namespace keel::testing
