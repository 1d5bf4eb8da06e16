// keel/compose/stream.hpp — model token streams protected from the first
// token to the last: three budgets, a commit point, partial answers,
// explicit continuation and first-token hedging.
//
// A stream fails in ways a single response does not: the first token never
// comes, the stream stalls halfway, the connection drops after 600 tokens,
// an error event arrives mid-stream. keel::stream_guard watches streams
// (on a keel::deadline_timer's thread, the one that also cuts deadlines and
// starts keel::hedge's hedges) and keel::token_stream runs one call's
// stream through a keel pipeline:
//
//   - Time to first token (stream_result::time_to_first_token) is what the
//     client waited: from the call's start, whatever retries or hedges came
//     before. The serving attempt's own first-output time is a separate
//     figure (attempt_time_to_first_token), the one the learned hedge
//     delay follows.
//   - Three budgets per stream attempt, all inside the attempt's deadline
//     (the call's, as the pipeline narrowed it): time to first token
//     (`first_token`), the longest gap between two tokens (`stall`), and the
//     whole stream (`whole`). Only model output counts: content tokens
//     (stream_writer::token), tool-call fragments and refusal text
//     (stream_writer::event). Keep-alive comments, role-only deltas and
//     empty chunks are not output (keel/provider/sse.hpp sorts them out),
//     so they neither commit a stream nor reset its stall clock. A budget that runs
//     out requests stop on the attempt's stop token (the provider's
//     transfer is aborted: keel::http aborts within a millisecond).
//   - Model output beyond text: tool-call fragments are handed over as
//     views and put together in stream_result::tool_calls
//     (keel/compose/tool_calls.hpp); a refusal is stream_result::refusal.
//     A stream broken inside a tool call's arguments is partial and never
//     continuable (stream_result::in_tool_call).
//   - A relay: a token_stream whose callback takes `const
//     keel::stream_event&` gets every event of the serving attempt with its
//     data as the provider sent it and the upstream's status and relay
//     headers; events before the commit are held until it, so an attempt
//     that never commits shows the client nothing.
//   - The commit point is the first model output, not the HTTP 200. Before
//     it, a failed attempt returns its failure (a first-token timeout is a
//     transient DeadlineExceeded) and the pipeline around may retry it,
//     fall back or fail over like any attempt. From it on, the tokens have
//     been shown to the client (the on_token callback), so the attempt
//     returns OK: a stream_result, complete or partial. A retry above never
//     restarts a committed stream, because it sees no failure to retry.
//   - A partial answer says what was received (text, tokens), why it ended
//     (stream_result::reason: stall, whole, deadline, cancelled, failed),
//     the cause (a status) and whether it may be continued.
//   - Continuation is explicit: token_stream::resume(call, pipeline,
//     provider, partial) runs another provider within what is left of the
//     call's deadline; its stream_writer::text_so_far() is the text already
//     shown, for the provider to ask for the rest. The answer is marked
//     degraded (on the call too) and partial (stitched from two providers).
//   - First-token hedging (stream_options::hedge_delay and an executor):
//     when an attempt has no content token after the delay (fixed, or the
//     `hedge_percentile` of recent times to first token), a second stream
//     starts on the executor. The first to produce a content token wins and
//     the other is stopped at once (its stop token). The hedge spends one
//     retry from `budget` and one attempt of the call's cap, like a
//     keel::hedge. The call returns when both streams have returned: a
//     hedged stream's provider must honour its stop token (keel::http does).
//   - Cancelling (the call's stop token) stops every stream attempt's
//     transfer at once; a committed stream then answers partial, cancelled.
//
// Example:
//
//   keel::stream_guard guard({.first_token = std::chrono::seconds(2), .stall = std::chrono::seconds(1),
//                             .whole = std::chrono::seconds(30)});
//   keel::call call(keel::real_clock{}.now(), {.timeout = std::chrono::seconds(60)});
//   keel::token_stream stream(guard, [](std::string_view token) { /* relay to the client */ });
//   auto provider = [](const keel::attempt& a, keel::stream_writer& w) -> absl::Status {
//     // keel::http::client::stream does this: every content token goes to w.token().
//     if (!w.token("Hello")) return absl::CancelledError("stopped");
//     return absl::OkStatus();
//   };
//   absl::StatusOr<keel::stream_result> r = keel::pipeline(keel::retry()).run(call, stream.attempts(provider));
//   // r->text == "Hello", r->complete
//
// Time is the guard's timer's clock (keel::process_timer() on the real
// clock by default; in tests a keel::deadline_timer on a
// keel::testing::manual_clock, passed to the guard). A provider passes the
// time it read its bytes at to token(text, now): the HTTP adapter reads the
// clock once per network read, not once per token.
//
// Costs: per token, a stop check, a relaxed-ordered store, the copy of the
// token into the call's text (a buffer whose capacity stays with the
// token_stream) and the on_token call; nothing is allocated once the buffer
// has grown to the answer (bench/stream_bench.cpp, BM_Stream_PerToken). Per
// attempt, a timer entry armed and disarmed (a bucket lock each) and
// brought forward at the commit. A hedge allocates its task in the executor.
//
// Thread-safety: a stream_guard is shared by any number of threads and
// streams; its destructor requires that no stream is running through it. A
// token_stream belongs to one call: its attempts() run one at a time (a
// pipeline's attempts), but with hedging its provider is called from two
// threads at once (the caller's and an executor's), and on_token is called
// from whichever thread runs the winning stream. A stream_writer belongs to
// the provider invocation it was handed to.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <stop_token>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "keel/core/timer.hpp"
#include "keel/compose/executor.hpp"
#include "keel/compose/stream_event.hpp"
#include "keel/compose/tool_calls.hpp"
#include "keel/core/call.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/condition.hpp"
#include "keel/core/outcome.hpp"
#include "keel/core/policy.hpp"
#include "keel/core/status.hpp"
#include "keel/core/upstream.hpp"
#include "keel/core/internal/boundary.hpp"
#include "keel/policy/latency_tracker.hpp"
#include "keel/policy/retry_budget.hpp"

namespace keel {

// Why a stream attempt was stopped or ended early.
enum class stream_stop : std::uint8_t {
  none,         // it was not: it ended on its own
  first_token,  // no content token within stream_options::first_token
  stall,        // a gap between tokens longer than stream_options::stall
  whole,        // the whole stream took longer than stream_options::whole
  deadline,     // the attempt's (the call's) deadline
  lost_race,    // a first-token hedge produced content first
  cancelled,    // the caller went away (the call's stop token)
  failed,       // the provider failed: a cut connection, an error event
};

[[nodiscard]] constexpr std::string_view to_string(stream_stop s) noexcept {
  switch (s) {
    case stream_stop::none: return "none";
    case stream_stop::first_token: return "first_token";
    case stream_stop::stall: return "stall";
    case stream_stop::whole: return "whole";
    case stream_stop::deadline: return "deadline";
    case stream_stop::lost_race: return "lost_race";
    case stream_stop::cancelled: return "cancelled";
    case stream_stop::failed: return "failed";
  }
  return "unknown";
}

struct stream_options {
  // Time to the first content token, from the attempt's start; > 0.
  duration first_token = std::chrono::seconds(10);
  // The longest gap allowed between two content tokens; > 0.
  duration stall = std::chrono::seconds(10);
  // The whole stream, from the attempt's start; zero: only the attempt's deadline.
  duration whole = duration::zero();
  // First-token hedging: start a second stream when the first has no content
  // token after this long; zero: no hedging. Needs an executor (stream_guard's
  // constructor). In percentile mode, the delay until enough are known.
  duration hedge_delay = duration::zero();
  // 0: the fixed hedge_delay. In (0, 1): this percentile of recent times to
  // first token (a stream that lost the race counts as long as it ran),
  // never below hedge_min_delay.
  double hedge_percentile = 0.0;
  duration hedge_min_delay = std::chrono::milliseconds(1);
  // Each hedge spends one retry from this budget; null: no budget.
  keel::retry_budget* budget = nullptr;
  // Deposit one request per call into `budget` (once per call, also when a
  // keel::retry or keel::hedge shares the budget). Turn off only when the
  // application deposits for its requests itself.
  bool deposit_requests = true;
  // Do not start a hedge with less time than this left in the attempt; >= 0.
  duration hedge_min_time = duration::zero();
  // Tokens as the unit of cost: every stream attempt charges its call
  // (keel::attempt::charge) what the provider billed for it: the usage
  // chunk's total_tokens when it sent one (else completion_tokens plus
  // prompt_tokens, as far as known), otherwise the content tokens counted.
  // keel::admission's compute quota (with_estimate: the reservation) then
  // settles to that at the stream's end, refunding or charging the
  // difference. A stream that fails before its first token is charged what
  // its usage says, else nothing; a hedge's loser likewise.
  bool charge_tokens = true;

  [[nodiscard]] absl::Status validate() const {
    constexpr std::string_view who = "stream_options";
    if (first_token <= duration::zero()) return detail::invalid_field(who, "first_token", "be > 0", first_token);
    if (stall <= duration::zero()) return detail::invalid_field(who, "stall", "be > 0", stall);
    if (whole < duration::zero()) return detail::invalid_field(who, "whole", "be >= 0", whole);
    if (hedge_delay < duration::zero()) return detail::invalid_field(who, "hedge_delay", "be >= 0", hedge_delay);
    if (!(hedge_percentile == 0.0 || (hedge_percentile > 0.0 && hedge_percentile < 1.0)))
      return detail::invalid_field(who, "hedge_percentile", "be 0 (fixed delay) or in (0, 1)", hedge_percentile);
    if (hedge_min_delay < duration::zero())
      return detail::invalid_field(who, "hedge_min_delay", "be >= 0", hedge_min_delay);
    if (hedge_min_time < duration::zero())
      return detail::invalid_field(who, "hedge_min_time", "be >= 0", hedge_min_time);
    return absl::OkStatus();
  }
};

// A stream's answer: complete, or partial with what was received and why.
struct stream_result {
  std::string text;            // every content token shown to the client, in order
  std::string refusal;         // the model's refusal text (delta.refusal), in order; a refusal is output
  std::vector<tool_call> tool_calls;  // the tool calls streamed, put together (keel::tool_call_assembler)
  bool complete = false;       // the last stream reached its end ([DONE], or the provider returned OK)
  bool partial = false;        // not one provider's whole answer: ended early, or continued
  stream_stop reason = stream_stop::none;  // why it ended early (none when complete)
  absl::Status cause;          // what ended it early (OK when complete)
  bool continuable = false;    // resume() may continue it: not cancelled, not a permanent failure,
                               // not broken inside a tool call
  // Partial, and it broke inside a tool call: the last model output was a
  // tool-call fragment with no finish_reason after it, so the call's
  // arguments may be cut mid-JSON. Never continuable: a continuation would
  // go on as text and turn the arguments into garbage.
  bool in_tool_call = false;
  bool degraded = false;       // continued on another provider
  int continuations = 0;       // resume() calls that committed
  absl::Status continuation_failure;  // the last resume() that did not commit, if any
  std::int64_t tokens = 0;     // model output counted: content tokens, tool-call and refusal deltas
  std::int64_t charged = 0;    // tokens charged to the call (stream_options::charge_tokens), all streams
  token_usage usage{};         // the provider's usage chunk, when it sent one (the last stream's)
  // What the client waited for the first model output: from the call's
  // start (keel::call::start()), retries, backoffs and first-token hedges
  // before it included. The figure for objectives and dashboards.
  duration time_to_first_token{};
  // The serving stream attempt's own first-output time, from that attempt's
  // start: what the provider took, the figure the learned hedge delay uses.
  // Never the client's wait: after a retry it leaves out the attempts before.
  duration attempt_time_to_first_token{};
  duration longest_gap{};      // between two tokens of the streams that served
  duration generation_time{};  // first to last token of the streams that served
                               // (generation_time / (tokens - 1): the mean gap)
  int hedge = 0;               // 0: the attempt's primary stream served; 1: its first-token hedge
  upstream_reply upstream{};   // the serving stream's HTTP status and relay headers, when its provider reported them
};

// Figures of a stream_guard since it was made.
struct stream_figures {
  std::int64_t attempts = 0;             // stream attempts (hedges included)
  std::int64_t committed = 0;            // attempts that produced a content token
  std::int64_t first_token_timeouts = 0; // stopped for `first_token`
  std::int64_t stalls = 0;               // stopped for `stall`
  std::int64_t whole_timeouts = 0;       // stopped for `whole` or the deadline
  std::int64_t mid_stream_failures = 0;  // committed attempts that ended partial
  std::int64_t hedges_started = 0;
  std::int64_t hedge_wins = 0;
  std::int64_t hedges_skipped = 0;       // budget, attempt cap, time or executor
  std::int64_t continuations = 0;        // resume() calls

  // Adds another guard's figures (a service's totals over its guards).
  stream_figures& operator+=(const stream_figures& o) noexcept {
    attempts += o.attempts;
    committed += o.committed;
    first_token_timeouts += o.first_token_timeouts;
    stalls += o.stalls;
    whole_timeouts += o.whole_timeouts;
    mid_stream_failures += o.mid_stream_failures;
    hedges_started += o.hedges_started;
    hedge_wins += o.hedge_wins;
    hedges_skipped += o.hedges_skipped;
    continuations += o.continuations;
    return *this;
  }
};

namespace detail {

inline constexpr std::int64_t no_token = std::numeric_limits<std::int64_t>::min();

[[nodiscard]] inline std::int64_t ticks(time_point t) noexcept { return t.time_since_epoch().count(); }
[[nodiscard]] inline time_point from_ticks(std::int64_t n) noexcept { return time_point(duration(n)); }

class stream_hub;

// One stream attempt as the guard's timer sees it: an entry armed for its
// next due budget or hedge. Lives with the attempt.
struct stream_watch : timer_entry {
  stream_hub* hub = nullptr;
  // Set before arm(), read when the timer runs it.
  time_point start{};
  time_point first_token_due = time_point::max();
  time_point end_due = time_point::max();
  bool end_is_deadline = false;  // end_due is the attempt's deadline, not `whole`
  duration stall{};
  std::stop_source* stop = nullptr;
  // When a hedge is due, and what starts it: set before arm(), then the
  // timer's (it runs the entry).
  time_point hedge_due = time_point::max();
  void (*on_hedge)(stream_watch*, time_point) = nullptr;
  void* race = nullptr;
  // The attempt's thread writes, the timer reads.
  std::atomic<std::int64_t> last_token{no_token};
  std::atomic<stream_stop> why{stream_stop::none};
};

// What every stream attempt of one call writes into: the text and the
// client's callback. Written by one attempt at a time (the winner).
struct stream_sink {
  std::string text;
  std::string refusal;
  tool_call_assembler tools;
  void (*on_token)(void*, std::string_view) = nullptr;
  // Set instead of on_token when the caller takes every event (a relay).
  void (*on_event)(void*, const stream_event&) = nullptr;
  void* on_token_ctx = nullptr;
};

class stream_hub;  // the guard's non-template part: figures, watch list
struct stream_race;

}  // namespace detail

// What a streaming provider writes its stream into (one per provider invocation).
class stream_writer {
 public:
  stream_writer(const stream_writer&) = delete;
  stream_writer& operator=(const stream_writer&) = delete;

  // One content token, read at `now` (the guard's clock). Returns false when
  // the provider must stop: a budget ran out, another stream won the race,
  // or the caller went away (stop_token() says so too). The first call is
  // the commit point.
  [[nodiscard]] bool token(std::string_view text, time_point now) noexcept {
    if (!output_at(now)) return false;
    in_tool_call_ = false;
    sink_->text.append(text.data(), text.size());
    if (sink_->on_token != nullptr) {
      sink_->on_token(sink_->on_token_ctx, text);
    } else if (sink_->on_event != nullptr) [[unlikely]] {
      hand_over(stream_event{.kind = stream_event_kind::content, .content = text});
    }
    return true;
  }

  // One event of the stream, read at `now`. Model output (content, tool-call
  // fragments, a refusal) is what token() does for content: the commit point
  // when it comes first, a reset of the stall clock, one counted unit of
  // output, the content and refusal text kept, the tool-call fragments put
  // together in the answer. Every event is handed to a caller that takes
  // events (token_stream's callback on `const keel::stream_event&`); one
  // that takes text gets the content only. Events before the commit point
  // (a role chunk) are held, copied, and handed over at the commit in
  // order: an attempt that fails before it shows the client nothing. Returns
  // false when the provider must stop, as token() does.
  [[nodiscard]] bool event(const stream_event& e, time_point now) noexcept {
    if (!e.output()) {
      if (!e.finish_reason.empty()) in_tool_call_ = false;
      if (stop_.stop_requested()) return false;
      if (sink_->on_event == nullptr) return true;
      if (committed_) {
        hand_over(e);
      } else {
        hold(e);
      }
      return true;
    }
    if (!output_at(now)) return false;
    for (const tool_call_delta& d : e.tool_calls) sink_->tools.add(d);
    in_tool_call_ = !e.tool_calls.empty() && e.finish_reason.empty();
    if (!e.content.empty()) sink_->text.append(e.content.data(), e.content.size());
    if (!e.refusal.empty()) sink_->refusal.append(e.refusal.data(), e.refusal.size());
    if (sink_->on_event != nullptr) {
      hand_over(e);
    } else if (sink_->on_token != nullptr && !e.content.empty()) {
      sink_->on_token(sink_->on_token_ctx, e.content);
    }
    return true;
  }
  [[nodiscard]] bool event(const stream_event& e) noexcept { return event(e, timer_->now()); }

  // The upstream's HTTP status and relay headers (keel/core/upstream.hpp),
  // reported by the provider before its first event: handed over with every
  // event and kept in the answer.
  void upstream(const upstream_reply& r) {
    upstream_ = r;
    has_upstream_ = true;
  }
  // The same, reading the guard's clock.
  [[nodiscard]] bool token(std::string_view text) noexcept { return token(text, timer_->now()); }

  // The guard's clock, read now: a provider reads it once per network read
  // and passes it to every token of that read.
  [[nodiscard]] time_point now() const noexcept { return timer_->now(); }

  // The provider's usage report (the usage chunk); the last one counts.
  void usage(const token_usage& u) noexcept { usage_ = u; }

  // Requested when the provider must stop; watch it (keel::http does).
  [[nodiscard]] const std::stop_token& stop_token() const noexcept { return token_; }
  [[nodiscard]] bool committed() const noexcept { return committed_; }
  [[nodiscard]] std::int64_t tokens() const noexcept { return tokens_; }
  // The caller takes every event (a relay): a provider hands them all to event().
  [[nodiscard]] bool takes_events() const noexcept { return sink_->on_event != nullptr; }
  // The last model output was a tool-call fragment not yet finished.
  [[nodiscard]] bool in_tool_call() const noexcept { return in_tool_call_; }
  // The text shown to the client so far, by earlier streams of this call
  // included (a continuation asks its provider for the rest of it). Read
  // only before this writer's first token.
  [[nodiscard]] std::string_view text_so_far() const noexcept { return sink_->text; }

 private:
  friend class stream_guard;
  template <class, class>
  friend class token_stream;
  friend struct detail::stream_race;

  stream_writer(detail::stream_hub& hub, detail::stream_sink& sink, const deadline_timer_base& timer)
      : hub_(&hub), sink_(&sink), timer_(&timer), token_(stop_.get_token()) {}

  bool commit(time_point now) noexcept;

  // What every piece of model output does first: the stop check, the
  // commit or the gap, the stall clock, the count.
  [[gnu::always_inline]] bool output_at(time_point now) noexcept {
    if (stop_.stop_requested()) return false;
    if (!committed_) [[unlikely]] {
      if (!commit(now)) return false;
      if (!held_.empty()) flush_held();
    } else {
      const duration gap = now - last_;
      if (gap > longest_gap_) longest_gap_ = gap;
    }
    last_ = now;
    watch_.last_token.store(detail::ticks(now), std::memory_order_release);
    ++tokens_;
    return true;
  }

  void hand_over(const stream_event& e) noexcept {
    if (e.upstream == nullptr && has_upstream_) {
      stream_event with = e;
      with.upstream = &upstream_;
      sink_->on_event(sink_->on_token_ctx, with);
    } else {
      sink_->on_event(sink_->on_token_ctx, e);
    }
  }

  // Held events: each its three lengths, then data, name and finish_reason.
  void hold(const stream_event& e) noexcept {
    const std::uint32_t n[3] = {static_cast<std::uint32_t>(e.data.size()), static_cast<std::uint32_t>(e.name.size()),
                                static_cast<std::uint32_t>(e.finish_reason.size())};
    held_.append(reinterpret_cast<const char*>(n), sizeof n);
    held_.append(e.data.data(), e.data.size());
    held_.append(e.name.data(), e.name.size());
    held_.append(e.finish_reason.data(), e.finish_reason.size());
  }
  void flush_held() noexcept {
    std::string held = std::move(held_);
    held_.clear();
    std::size_t at = 0;
    while (at + 3 * sizeof(std::uint32_t) <= held.size()) {
      std::uint32_t n[3];
      std::memcpy(n, held.data() + at, sizeof n);
      at += sizeof n;
      const std::string_view all(held.data() + at, std::size_t{n[0]} + n[1] + n[2]);
      at += all.size();
      hand_over(stream_event{.finish_reason = all.substr(n[0] + n[1]), .data = all.substr(0, n[0]),
                             .name = all.substr(n[0], n[1])});
    }
  }

  detail::stream_hub* hub_;
  detail::stream_sink* sink_;
  const deadline_timer_base* timer_;
  std::stop_source stop_;
  std::stop_token token_;
  detail::stream_watch watch_;
  detail::stream_race* race_ = nullptr;
  int index_ = 0;
  bool committed_ = false;
  std::int64_t tokens_ = 0;
  bool in_tool_call_ = false;
  bool has_upstream_ = false;
  upstream_reply upstream_{};
  std::string held_;  // events before the commit (only for a caller that takes events)
  time_point first_{};
  time_point last_{};
  duration longest_gap_{};
  token_usage usage_{};
};

namespace detail {

// The attempt's stop (the call cancelled, or a policy above stopped the
// attempt: a deadline cut, a lost keel::hedge race) stops the stream.
struct forward_stream_stop {
  std::stop_source* to;
  stream_watch* watch;
  const keel::call* owner;
  void operator()() const noexcept {
    stream_stop none = stream_stop::none;
    const bool cancelled = owner == nullptr || owner->stop_token().stop_requested();
    watch->why.compare_exchange_strong(none, cancelled ? stream_stop::cancelled : stream_stop::deadline,
                                       std::memory_order_relaxed);
    to->request_stop();
  }
};

// The guard's figures, and its streams armed on its timer.
class stream_hub {
 public:
  struct counters {
    std::atomic<std::int64_t> attempts{0}, committed{0}, first_token_timeouts{0}, stalls{0}, whole_timeouts{0},
        mid_stream_failures{0}, hedges_started{0}, hedge_wins{0}, hedges_skipped{0}, continuations{0};
  };

  explicit stream_hub(deadline_timer_base& timer) noexcept : timer_(&timer) {}

  // Armed for its first due time: its first token, its end, its hedge.
  void arm(stream_watch& w) {
    w.hub = this;
    w.fire = &on_due;
    timer_->schedule(w, earliest_due(w));
  }
  // After it returns the timer no longer touches `w`, and no hedge starts.
  void disarm(stream_watch& w) { (void)timer_->cancel(w); }
  // Stream `w` committed at `now`: its stall budget may now be due before
  // the time it is armed for.
  void changed(stream_watch& w, time_point now) { timer_->bring_forward(w, std::min(now + w.stall, w.end_due)); }

  // Sets why and requests stop, unless the attempt was stopped already.
  static bool stop(stream_watch& w, stream_stop why) noexcept {
    stream_stop none = stream_stop::none;
    if (!w.why.compare_exchange_strong(none, why, std::memory_order_relaxed)) return false;
    w.stop->request_stop();
    return true;
  }

  counters figures_;

 protected:
  // On the timer's thread, when `e` is due: stops the stream whose budget
  // ran out, starts its hedge when due; returns when it is next due.
  static time_point on_due(timer_entry& e, time_point now) {
    stream_watch& w = static_cast<stream_watch&>(e);
    if (w.why.load(std::memory_order_relaxed) != stream_stop::none) return time_point::max();
    const std::int64_t last = w.last_token.load(std::memory_order_acquire);
    if (last == no_token) {
      if (w.hedge_due <= now && w.on_hedge != nullptr) {
        w.hedge_due = time_point::max();
        w.on_hedge(&w, now);
      }
      const time_point due = std::min(w.first_token_due, w.end_due);
      if (now >= due) {
        const bool first = w.first_token_due <= w.end_due;
        if (stop(w, first ? stream_stop::first_token : end_reason(w))) w.hub->count_stop(w);
        return time_point::max();
      }
      return std::min(due, w.hedge_due);
    }
    const time_point stall_due = from_ticks(last) + w.stall;
    const time_point due = std::min(stall_due, w.end_due);
    if (now >= due) {
      if (stop(w, stall_due <= w.end_due ? stream_stop::stall : end_reason(w))) w.hub->count_stop(w);
      return time_point::max();
    }
    return due;
  }

  static stream_stop end_reason(const stream_watch& w) noexcept {
    return w.end_is_deadline ? stream_stop::deadline : stream_stop::whole;
  }
  void count_stop(const stream_watch& w) noexcept {
    switch (w.why.load(std::memory_order_relaxed)) {
      case stream_stop::first_token: figures_.first_token_timeouts.fetch_add(1, std::memory_order_relaxed); break;
      case stream_stop::stall: figures_.stalls.fetch_add(1, std::memory_order_relaxed); break;
      default: figures_.whole_timeouts.fetch_add(1, std::memory_order_relaxed); break;
    }
  }

  // When `w`, not yet committed, is first due: its first token, its end, its hedge.
  static time_point earliest_due(const stream_watch& w) noexcept {
    return std::min({w.first_token_due, w.end_due, w.hedge_due});
  }

  deadline_timer_base* timer_;
};

// Two streams of one attempt racing to the first content token.
struct stream_race {
  std::mutex mu;
  keel::condition done;
  int winner = -1;
  bool hedge_launched = false;
  bool hedge_running = false;
  stream_writer* writers[2] = {nullptr, nullptr};
};

}  // namespace detail

inline bool stream_writer::commit(time_point now) noexcept {
  if (race_ != nullptr) {
    std::lock_guard lock(race_->mu);
    if (race_->winner >= 0 && race_->winner != index_) return false;
    race_->winner = index_;
    stream_writer* other = race_->writers[1 - index_];
    if (other != nullptr) (void)detail::stream_hub::stop(other->watch_, stream_stop::lost_race);
    if (index_ == 1) hub_->figures_.hedge_wins.fetch_add(1, std::memory_order_relaxed);
  }
  committed_ = true;
  first_ = now;
  last_ = now;
  hub_->figures_.committed.fetch_add(1, std::memory_order_relaxed);
  watch_.last_token.store(detail::ticks(now), std::memory_order_release);
  hub_->changed(watch_, now);
  return true;
}

class stream_guard : private detail::stream_hub {
 public:
  // Budgets and hedges run out on `timer` (it must outlive the guard), and
  // time is its clock's. Throws keel::invalid_options if `o` is invalid.
  explicit stream_guard(const stream_options& o, deadline_timer_base& timer = process_timer())
      : stream_hub(timer), options_((detail::require_valid(o.validate()), o)), tracker_(make_tracker(o)) {}
  // The same, with an executor for first-token hedges (it must outlive the guard).
  template <keel::executor Executor>
  stream_guard(const stream_options& o, Executor& executor, deadline_timer_base& timer = process_timer())
      : stream_hub(timer),
        options_((detail::require_valid(o.validate()), o)),
        tracker_(make_tracker(o)),
        executor_(&executor),
        submit_([](void* e, absl::AnyInvocable<void() &&> task) {
          return static_cast<Executor*>(e)->try_execute(std::move(task));
        }) {}
  stream_guard(const stream_guard&) = delete;
  stream_guard& operator=(const stream_guard&) = delete;
  ~stream_guard() = default;

  [[nodiscard]] const stream_options& options() const noexcept { return options_; }
  // The timer its budgets run out on; its clock is the guard's.
  [[nodiscard]] const deadline_timer_base& timer() const noexcept { return *timer_; }
  [[nodiscard]] bool hedging() const noexcept { return executor_ != nullptr && options_.hedge_delay > duration::zero(); }

  // The delay a stream starting now would hedge after.
  [[nodiscard]] duration current_hedge_delay() const noexcept {
    if (tracker_ == nullptr) return options_.hedge_delay;
    const std::optional<duration> p = tracker_->percentile();
    return p ? std::max(*p, options_.hedge_min_delay) : options_.hedge_delay;
  }

  [[nodiscard]] stream_figures figures() const noexcept {
    auto get = [](const std::atomic<std::int64_t>& a) { return a.load(std::memory_order_relaxed); };
    const counters& c = figures_;
    return {.attempts = get(c.attempts),
            .committed = get(c.committed),
            .first_token_timeouts = get(c.first_token_timeouts),
            .stalls = get(c.stalls),
            .whole_timeouts = get(c.whole_timeouts),
            .mid_stream_failures = get(c.mid_stream_failures),
            .hedges_started = get(c.hedges_started),
            .hedge_wins = get(c.hedge_wins),
            .hedges_skipped = get(c.hedges_skipped),
            .continuations = get(c.continuations)};
  }

 private:
  template <class, class>
  friend class token_stream;

  static std::unique_ptr<latency_tracker> make_tracker(const stream_options& o) {
    if (o.hedge_percentile <= 0.0) return nullptr;
    return std::make_unique<latency_tracker>(latency_tracker_options{
        .percentile = o.hedge_percentile, .samples = 256, .min_samples = 20, .refresh_every = 16});
  }

  // Arms `w` for an attempt from `a` starting at `now`: budgets, the
  // caller's stop linked in.
  void prepare(stream_writer& w, const attempt& a, time_point now) {
    detail::stream_watch& watch = w.watch_;
    watch.start = now;
    watch.first_token_due = now + std::min(options_.first_token, a.deadline.remaining(now));
    const time_point whole_due = options_.whole > duration::zero() ? now + options_.whole : time_point::max();
    watch.end_is_deadline = a.deadline.when() <= whole_due;
    watch.end_due = std::min(whole_due, a.deadline.when());
    if (watch.first_token_due > watch.end_due) watch.first_token_due = watch.end_due;
    watch.stall = options_.stall;
    watch.stop = &w.stop_;
    figures_.attempts.fetch_add(1, std::memory_order_relaxed);
  }

  void record_first_token(duration ttft) {
    if (tracker_ != nullptr) tracker_->record(ttft);
  }

  stream_options options_;
  std::unique_ptr<latency_tracker> tracker_;
  void* executor_ = nullptr;
  absl::Status (*submit_)(void*, absl::AnyInvocable<void() &&>) = nullptr;
};

// One call's stream: the text shown so far and the client's callback.
template <class Guard, class OnToken>
class token_stream {
 public:
  // `on_token`: called with each content token (std::string_view), or, if
  // it takes `const keel::stream_event&` instead, with every event of the
  // serving stream: model output of each kind and, for a relay, the other
  // events (role chunk, finish_reason, usage, [DONE]) with the bytes the
  // provider sent (stream_writer::event says what is held before the commit).
  token_stream(Guard& guard, OnToken on_token) : guard_(&guard), on_token_(std::move(on_token)) {
    if constexpr (std::is_invocable_v<OnToken&, std::string_view>) {
      sink_.on_token = [](void* self, std::string_view t) { static_cast<token_stream*>(self)->on_token_(t); };
    } else {
      static_assert(std::is_invocable_v<OnToken&, const stream_event&>,
                    "keel::token_stream: the callback takes std::string_view or const keel::stream_event&");
      sink_.on_event = [](void* self, const stream_event& e) { static_cast<token_stream*>(self)->on_token_(e); };
    }
    sink_.on_token_ctx = this;
  }
  token_stream(const token_stream&) = delete;
  token_stream& operator=(const token_stream&) = delete;

  // A provider for a pipeline: each attempt runs `provider(attempt,
  // writer)` (absl::Status) under the guard's budgets. Refers to this
  // token_stream and to `provider`, which must outlive the run.
  template <class Provider>
  [[nodiscard]] auto attempts(Provider& provider) {
    return [this, &provider](const attempt& a) -> absl::StatusOr<stream_result> { return run_attempt(a, provider); };
  }

  // Continues a partial answer on `provider` (through `pipe`, on `call`,
  // within what is left of its deadline). The provider's writer gives the
  // text already shown (text_so_far()). The answer is `previous` with the
  // continuation's text appended, marked degraded and partial; a
  // continuation that does not commit leaves `previous` as it was, with
  // continuation_failure set. An answer that is not continuable is
  // returned unchanged.
  template <class Pipe, class Provider>
  [[nodiscard]] stream_result resume(keel::call& call, const Pipe& pipe, Provider& provider, stream_result previous) {
    if (previous.complete || !previous.continuable) return previous;
    guard_->figures_.continuations.fetch_add(1, std::memory_order_relaxed);
    sink_.text = std::move(previous.text);
    const std::size_t before = sink_.text.size();
    absl::StatusOr<stream_result> next = pipe.run(call, attempts(provider));
    if (!next.ok() || next->text.size() == before) {
      if (next.ok()) sink_.text = std::move(next->text);
      previous.text = std::move(sink_.text);
      previous.continuation_failure =
          next.ok() ? absl::UnavailableError("keel: stream: the continuation produced no token") : next.status();
      return previous;
    }
    stream_result r = std::move(*next);
    r.refusal.insert(0, previous.refusal);
    r.tool_calls.insert(r.tool_calls.begin(), std::make_move_iterator(previous.tool_calls.begin()),
                        std::make_move_iterator(previous.tool_calls.end()));
    r.partial = true;
    r.degraded = true;
    r.continuations = previous.continuations + 1;
    r.tokens += previous.tokens;
    r.charged += previous.charged;
    r.time_to_first_token = previous.time_to_first_token;
    r.attempt_time_to_first_token = previous.attempt_time_to_first_token;
    r.longest_gap = std::max(r.longest_gap, previous.longest_gap);
    r.generation_time += previous.generation_time;
    call.mark_degraded();
    return r;
  }

  // The text shown so far.
  [[nodiscard]] std::string_view text() const noexcept { return sink_.text; }
  // Room for an answer of `bytes` (the text buffer grows otherwise by doubling).
  void reserve(std::size_t bytes) { sink_.text.reserve(bytes); }

 private:
  // What a hedge needs of its attempt; lives on the caller's stack, which
  // waits for the hedge to return.
  template <class Provider>
  struct hedge_ctx {
    token_stream* self;
    Provider* provider;
    const attempt* a;
    detail::stream_race race;
    std::unique_ptr<stream_writer> second;  // the hedge's writer (allocated only for a hedge)
    absl::Status result;
  };

  template <class Provider>
  absl::StatusOr<stream_result> run_attempt(const attempt& a, Provider& provider) {
    Guard& g = *guard_;
    const time_point now = g.timer_->now();
    stream_writer w(g, sink_, *g.timer_);
    g.prepare(w, a, now);
    std::optional<std::stop_callback<detail::forward_stream_stop>> link;
    if (a.stop.stop_possible()) link.emplace(a.stop, detail::forward_stream_stop{&w.stop_, &w.watch_, a.owner});

    hedge_ctx<Provider> hc{this, &provider, &a, {}, nullptr, absl::OkStatus()};
    detail::stream_race& race = hc.race;
    if (g.hedging() && a.owner != nullptr) {
      keel::call& c = detail::bookkeeping(a);
      if (g.options_.budget != nullptr && g.options_.deposit_requests) g.options_.budget->record_request(c, now);
      c.share_across_threads();  // the hedge begins an attempt on it from the timer's thread
      race.writers[0] = &w;
      w.race_ = &race;
      w.watch_.hedge_due = now + g.current_hedge_delay();
      w.watch_.race = &hc;
      w.watch_.on_hedge = &start_hedge<Provider>;
    }
    g.arm(w.watch_);
    attempt mine = a;
    mine.stop = w.token_;
    absl::Status st = detail::call_user<absl::Status>("stream: provider", provider, mine, w);
    g.disarm(w.watch_);  // from here on no hedge starts
    link.reset();

    if (w.race_ == nullptr) return finish(w, std::move(st), a, 0);
    std::unique_lock lock(race.mu);
    if (!race.hedge_launched) return finish(w, std::move(st), a, 0);
    if (race.winner < 0 && st.ok() && w.watch_.why.load(std::memory_order_relaxed) == stream_stop::none) {
      // The primary ended properly without content (an empty answer): it
      // is the answer, and the hedge stops.
      race.winner = 0;
      (void)detail::stream_hub::stop(hc.second->watch_, stream_stop::lost_race);
    }
    // A primary that failed before its first token leaves the race to the hedge.
    race.done.wait(lock, [&] { return !race.hedge_running; });
    if (race.winner == 0) return finish(w, std::move(st), a, 0, hc.second.get());
    // The primary lost: it took at least until the hedge's first token, and
    // is recorded so, or the learned delay would lean to the fast winners.
    if (race.winner == 1) g.record_first_token(hc.second->first_ - w.watch_.start);
    // The hedge won, or neither committed: the hedge's outcome is the last.
    return finish(*hc.second, std::move(hc.result), a, 1, &w);
  }

  // On the timer's thread: a stream has no content token after the hedge
  // delay. Starts its hedge, or counts why not.
  template <class Provider>
  static void start_hedge(detail::stream_watch* watch, time_point now) {
    auto& hc = *static_cast<hedge_ctx<Provider>*>(watch->race);
    Guard& g = *hc.self->guard_;
    const attempt& a = *hc.a;
    auto skipped = [&] { g.figures_.hedges_skipped.fetch_add(1, std::memory_order_relaxed); };
    if (a.stop.stop_requested() || a.deadline.remaining(now) <= std::max(g.options_.hedge_min_time, duration(1)))
      return skipped();
    if (a.owner->attempts_exhausted()) return skipped();
    if (g.options_.budget != nullptr && !g.options_.budget->try_acquire_retry(now)) return skipped();
    const int number = detail::bookkeeping(a).begin_attempt();
    if (number == 0) return skipped();
    std::lock_guard lock(hc.race.mu);
    if (hc.race.winner >= 0) return;
    hc.second.reset(new stream_writer(g, hc.self->sink_, *g.timer_));
    stream_writer& w2 = *hc.second;
    g.prepare(w2, a, now);
    w2.race_ = &hc.race;
    w2.index_ = 1;
    attempt view = a;
    view.number = number;
    view.start = now;
    view.timeout = a.deadline.remaining(now);
    view.hedge = 1;
    hedge_ctx<Provider>* ctx = &hc;
    absl::Status submitted = g.submit_(g.executor_, [ctx, view]() mutable {
      stream_writer& w = *ctx->second;
      Guard& guard = *ctx->self->guard_;
      std::optional<std::stop_callback<detail::forward_stream_stop>> link;
      if (ctx->a->stop.stop_possible())
        link.emplace(ctx->a->stop, detail::forward_stream_stop{&w.stop_, &w.watch_, ctx->a->owner});
      guard.arm(w.watch_);
      view.stop = w.token_;
      absl::Status st = detail::call_user<absl::Status>("stream: provider", *ctx->provider, view, w);
      guard.disarm(w.watch_);
      link.reset();
      std::lock_guard done_lock(ctx->race.mu);
      ctx->result = std::move(st);
      ctx->race.hedge_running = false;
      ctx->race.done.notify_all();
    });
    if (!submitted.ok()) {
      hc.second.reset();
      return skipped();
    }
    hc.race.writers[1] = &w2;
    hc.race.hedge_launched = true;
    hc.race.hedge_running = true;
    g.figures_.hedges_started.fetch_add(1, std::memory_order_relaxed);
  }

  // What one stream attempt's ending means: a failure before the commit, a
  // result (complete or partial) after it.
  // What a stream is billed: its usage report, else its counted tokens.
  [[nodiscard]] static std::int64_t billed(const stream_writer& w) noexcept {
    const token_usage& u = w.usage_;
    if (u.total_tokens >= 0) return u.total_tokens;
    if (u.completion_tokens >= 0) return u.completion_tokens + std::max<std::int64_t>(u.prompt_tokens, 0);
    return w.tokens_;
  }

  // Charges the call for the attempt's streams (the loser of a race too).
  std::int64_t charge(const attempt& a, const stream_writer& w, const stream_writer* other) {
    if (!guard_->options_.charge_tokens || a.owner == nullptr) return 0;
    const std::int64_t n = billed(w) + (other != nullptr ? billed(*other) : 0);
    if (n > 0) a.charge(n);
    return n;
  }

  absl::StatusOr<stream_result> finish(stream_writer& w, absl::Status st, const attempt& a, int hedge,
                                       const stream_writer* other = nullptr) {
    Guard& g = *guard_;
    const stream_stop why = w.watch_.why.load(std::memory_order_relaxed);
    const std::int64_t charged = charge(a, w, other);
    if (!w.committed_) {
      if (st.ok() && why == stream_stop::none) {  // an empty answer, ended properly
        if (!w.held_.empty()) w.flush_held();  // its events are the answer a relay passes on
        stream_result r;
        r.complete = true;
        r.upstream = w.upstream_;
        r.usage = w.usage_;
        r.hedge = hedge;
        r.charged = charged;
        return r;
      }
      if (why == stream_stop::cancelled || (a.owner != nullptr && a.owner->stop_token().stop_requested()))
        return absl::CancelledError("keel: stream: cancelled before the first token");
      if (why == stream_stop::first_token) {
        return with_outcome(absl::DeadlineExceededError(absl::StrCat(
                                "keel: stream: no content token within ", detail::describe(g.options_.first_token))),
                            outcome_kind::transient);
      }
      if (why == stream_stop::whole || why == stream_stop::deadline)
        return absl::DeadlineExceededError("keel: stream: out of time before the first token");
      if (st.ok()) return absl::CancelledError("keel: stream: lost the first-token race");
      return st;
    }
    g.record_first_token(w.first_ - w.watch_.start);
    stream_result r;
    r.text = std::move(sink_.text);
    sink_.text = std::string();
    r.refusal = std::move(sink_.refusal);
    sink_.refusal = std::string();
    r.tool_calls = sink_.tools.take();
    r.upstream = w.upstream_;
    r.tokens = w.tokens_;
    r.usage = w.usage_;
    r.attempt_time_to_first_token = w.first_ - w.watch_.start;
    r.time_to_first_token = a.owner != nullptr ? w.first_ - a.owner->start() : r.attempt_time_to_first_token;
    r.longest_gap = w.longest_gap_;
    r.generation_time = w.last_ - w.first_;
    r.hedge = hedge;
    r.charged = charged;
    if (st.ok()) {
      r.complete = true;
      return r;
    }
    r.partial = true;
    g.figures_.mid_stream_failures.fetch_add(1, std::memory_order_relaxed);
    r.reason = why != stream_stop::none ? why : stream_stop::failed;
    if (r.reason == stream_stop::stall) {
      r.cause = absl::DeadlineExceededError(
          absl::StrCat("keel: stream: stalled (no token for ", detail::describe(g.options_.stall), ")"));
    } else if (r.reason == stream_stop::whole) {
      r.cause = absl::DeadlineExceededError("keel: stream: over its whole-stream budget");
    } else if (r.reason == stream_stop::deadline) {
      r.cause = absl::DeadlineExceededError("keel: stream: the call's deadline passed mid-stream");
    } else if (r.reason == stream_stop::cancelled) {
      r.cause = absl::CancelledError("keel: stream: cancelled mid-stream");
    } else {
      r.cause = std::move(st);
    }
    const operation op = a.owner != nullptr ? a.owner->operation() : operation{};
    const outcome_kind k = default_classifier{}(r.cause, op);
    r.in_tool_call = w.in_tool_call_;
    r.continuable = r.reason != stream_stop::cancelled && k != outcome_kind::permanent &&
                    k != outcome_kind::cancelled && !r.in_tool_call;
    return r;
  }

  Guard* guard_;
  OnToken on_token_;
  detail::stream_sink sink_;
};

template <class Guard, class OnToken>
token_stream(Guard&, OnToken) -> token_stream<Guard, OnToken>;

}  // namespace keel
