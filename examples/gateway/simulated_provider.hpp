// gateway/simulated_provider.hpp — the model provider and the rubric
// database of the example gateway, simulated in-process, with faults an
// operator (or a test) switches at run time.
//
// simulated_provider behaves like an LLM endpoint seen through a socket
// whose timeout is the attempt's deadline:
//
//   - an answer takes a latency drawn around `median_latency` (log-normal,
//     `spread` is sigma; 0 gives exactly the median), and charges its tokens
//     to the call (keel::attempt::charge);
//   - the attempt's deadline is the socket timeout: when the answer would come
//     later, the attempt gives up at its deadline with DeadlineExceeded and
//     the upstream work is counted as abandoned (the provider may still be
//     computing it: freeing our side does not free its GPU);
//   - a stop request (a cancelled call, a lost hedge, a service shutdown)
//     ends the wait at once with Cancelled;
//   - closing the attempt costs `close_latency` (the seed's cancel window).
//
// stream() is the same provider as a token stream (OpenAI-compatible chat
// completions with "stream": true, seen through keel::stream_writer): the
// first token after a draw around `first_token_latency`, a share
// `tail_ratio` of streams `tail_factor` times later (a cold replica, a long
// prefill queue: what first-token hedging is for), then tokens `token_gap`
// apart. The text is a deterministic function of the prompt, and a
// continuation (a writer whose text_so_far() is not empty) goes on from the
// token where the earlier stream stopped, so a stitched answer reads as one.
// A fault switched while a stream runs reaches it at its next token: an
// outage cuts it (Unavailable after the commit), a stall stops its tokens.
//
// Faults (one at a time, affecting a share `ratio` of calls):
//
//   slowdown        latency times `factor`
//   stall           no answer at all: the attempt waits out its deadline; a
//                   stream stops sending after half its tokens
//   rate_limit      429 at once: ResourceExhausted with a retry-after hint
//                   (also, without any fault, past `capacity` concurrent calls)
//   outage          503 at once: Unavailable (connection refused); a running
//                   stream is cut at its next token
//   invalid_output  an answer that is not the JSON the contract promises; a
//                   stream sends an error event halfway
//
// rubric_store is the shared database the interactive path reads in its
// retrieve stage: question id -> rubric points, with its own small latency.
//
// Both take a keel clock, so tests can drive them on a manual clock.
//
// Example:
//
//   gateway::simulated_provider<> llm({.median_latency = std::chrono::milliseconds(400)});
//   llm.set_fault({.kind = gateway::fault_kind::outage});
//   absl::StatusOr<std::string> out = llm.complete(attempt, prompt);   // Unavailable
//
// Thread-safety: every operation may be called from any thread; set_fault
// takes effect for attempts that start afterwards.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "text.hpp"
#include "upstream.hpp"
#include "keel/compose/stream.hpp"
#include "keel/core/call.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/outcome.hpp"
#include "keel/core/status.hpp"

namespace gateway {

using namespace std::chrono_literals;

enum class fault_kind { none, slowdown, stall, rate_limit, outage, invalid_output };

[[nodiscard]] constexpr std::string_view to_string(fault_kind k) noexcept {
  switch (k) {
    case fault_kind::none: return "none";
    case fault_kind::slowdown: return "slowdown";
    case fault_kind::stall: return "stall";
    case fault_kind::rate_limit: return "rate_limit";
    case fault_kind::outage: return "outage";
    case fault_kind::invalid_output: return "invalid_output";
  }
  return "unknown";
}

[[nodiscard]] inline std::optional<fault_kind> parse_fault_kind(std::string_view s) noexcept {
  for (fault_kind k : {fault_kind::none, fault_kind::slowdown, fault_kind::stall, fault_kind::rate_limit,
                       fault_kind::outage, fault_kind::invalid_output}) {
    if (s == to_string(k)) return k;
  }
  return std::nullopt;
}

struct fault {
  fault_kind kind = fault_kind::none;
  double factor = 3.0;                 // slowdown: latency multiplier, in [1, 1000]
  keel::duration retry_after = 1s;     // rate_limit: the provider's hint, in [0, 1h]
  double ratio = 1.0;                  // share of calls affected, in [0, 1]

  [[nodiscard]] absl::Status validate() const {
    if (!(factor >= 1.0 && factor <= 1000.0))
      return keel::invalid_option("fault", "factor", "be in [1, 1000]", factor);
    if (retry_after < keel::duration::zero() || retry_after > std::chrono::hours(1))
      return keel::invalid_option("fault", "retry_after", "be in [0, 1h]", retry_after);
    if (!(ratio >= 0.0 && ratio <= 1.0)) return keel::invalid_option("fault", "ratio", "be in [0, 1]", ratio);
    return absl::OkStatus();
  }
};

struct provider_options {
  std::string name = "sim-llm";
  keel::duration median_latency = 400ms;  // > 0
  double spread = 0.3;                    // log-normal sigma, in [0, 2]; 0.3 puts p99 near 2x the median
  keel::duration close_latency = 5ms;     // closing an abandoned attempt, >= 0
  keel::duration refuse_latency = 2ms;    // a 429 or 503 comes back this fast, >= 0
  int tokens_per_answer = 600;            // charged per answered attempt, >= 0
  // Concurrent calls the provider serves; beyond that it answers 429 with
  // `overload_retry_after` at once (a real provider's concurrency limit). 0: unlimited.
  int capacity = 0;
  keel::duration overload_retry_after = 100ms;  // >= 0
  // Streams (stream()): time to the first token (log-normal around it,
  // `spread`), the heavy tail, the gap between tokens, tokens per answer.
  keel::duration first_token_latency = 200ms;  // > 0
  double tail_ratio = 0.03;                    // in [0, 1]
  double tail_factor = 8.0;                    // in [1, 1000]
  keel::duration token_gap = 15ms;             // >= 0
  int stream_tokens = 40;                      // >= 1; at most the request's max_tokens

  [[nodiscard]] absl::Status validate() const {
    if (name.empty()) return keel::invalid_option("provider_options", "name", "not be empty", "\"\"");
    if (median_latency <= keel::duration::zero())
      return keel::invalid_option("provider_options", "median_latency", "be > 0", median_latency);
    if (!(spread >= 0.0 && spread <= 2.0))
      return keel::invalid_option("provider_options", "spread", "be in [0, 2]", spread);
    if (close_latency < keel::duration::zero())
      return keel::invalid_option("provider_options", "close_latency", "be >= 0", close_latency);
    if (refuse_latency < keel::duration::zero())
      return keel::invalid_option("provider_options", "refuse_latency", "be >= 0", refuse_latency);
    if (tokens_per_answer < 0)
      return keel::invalid_option("provider_options", "tokens_per_answer", "be >= 0", tokens_per_answer);
    if (capacity < 0) return keel::invalid_option("provider_options", "capacity", "be >= 0", capacity);
    if (overload_retry_after < keel::duration::zero())
      return keel::invalid_option("provider_options", "overload_retry_after", "be >= 0", overload_retry_after);
    if (first_token_latency <= keel::duration::zero())
      return keel::invalid_option("provider_options", "first_token_latency", "be > 0", first_token_latency);
    if (!(tail_ratio >= 0.0 && tail_ratio <= 1.0))
      return keel::invalid_option("provider_options", "tail_ratio", "be in [0, 1]", tail_ratio);
    if (!(tail_factor >= 1.0 && tail_factor <= 1000.0))
      return keel::invalid_option("provider_options", "tail_factor", "be in [1, 1000]", tail_factor);
    if (token_gap < keel::duration::zero())
      return keel::invalid_option("provider_options", "token_gap", "be >= 0", token_gap);
    if (stream_tokens < 1)
      return keel::invalid_option("provider_options", "stream_tokens", "be >= 1", stream_tokens);
    return absl::OkStatus();
  }
};

// What the provider has done since it started.
struct provider_figures {
  std::int64_t calls = 0;
  std::int64_t answered = 0;       // valid or not
  std::int64_t invalid = 0;        // answers that broke the output contract
  std::int64_t timed_out = 0;      // the attempt's deadline came first
  std::int64_t abandoned = 0;      // of which upstream was still computing (work we no longer wait for)
  std::int64_t cancelled = 0;
  std::int64_t rate_limited = 0;
  std::int64_t unavailable = 0;
  int in_flight = 0;
  std::int64_t streams = 0;          // stream() calls
  std::int64_t streams_complete = 0;
  std::int64_t streams_cut = 0;      // ended by a fault after their first token (cut, error event)
  std::int64_t streams_stopped = 0;  // stopped by the caller (a budget, a lost race, a client gone)
  std::int64_t stream_tokens = 0;    // tokens sent
};

namespace detail {

// One generator per thread: draws need no lock.
inline std::mt19937_64& thread_rng() {
  thread_local std::mt19937_64 gen{std::random_device{}()};
  return gen;
}

inline double unit_draw() { return std::uniform_real_distribution<double>(0.0, 1.0)(thread_rng()); }

}  // namespace detail

template <keel::clock Clock = keel::real_clock>
class simulated_provider final : public model_upstream {
 public:
  // Throws keel::invalid_options if `o` is invalid.
  explicit simulated_provider(provider_options o = {}, Clock clock = {})
      : options_((keel::require_valid_options(o.validate()), std::move(o))), clock_(std::move(clock)) {}
  simulated_provider(const simulated_provider&) = delete;
  simulated_provider& operator=(const simulated_provider&) = delete;

  [[nodiscard]] const provider_options& options() const noexcept { return options_; }
  [[nodiscard]] const std::string& name() const noexcept override { return options_.name; }

  // Switches the fault for attempts that start from now on.
  [[nodiscard]] absl::Status set_fault(const fault& f) {
    if (absl::Status s = f.validate(); !s.ok()) return s;
    std::lock_guard lock(mu_);
    fault_ = f;
    return absl::OkStatus();
  }
  [[nodiscard]] fault current_fault() const {
    std::lock_guard lock(mu_);
    return fault_;
  }

  // One completion: the model's raw output text (the gateway validates it).
  absl::StatusOr<std::string> complete(const keel::attempt& a, std::string_view prompt,
                                       std::string_view /*idempotency_key*/ = {}) override {
    calls_.fetch_add(1, std::memory_order_relaxed);
    const in_flight_scope busy(in_flight_);
    fault f = current_fault();
    if (f.kind != fault_kind::none && f.ratio < 1.0 && detail::unit_draw() >= f.ratio) f.kind = fault_kind::none;
    const keel::time_point start = clock_.now();
    if (options_.capacity > 0 && busy.count > options_.capacity) {
      if (!wait(start + options_.refuse_latency, a)) return cancelled();
      rate_limited_.fetch_add(1, std::memory_order_relaxed);
      return keel::with_retry_after(
          absl::ResourceExhaustedError(cat(options_.name, ": 429 over its concurrency limit of ",
                                                    options_.capacity)),
          options_.overload_retry_after);
    }

    switch (f.kind) {
      case fault_kind::outage:
        if (!wait(start + options_.refuse_latency, a)) return cancelled();
        unavailable_.fetch_add(1, std::memory_order_relaxed);
        return absl::UnavailableError(cat(options_.name, ": 503 service unavailable"));
      case fault_kind::rate_limit:
        if (!wait(start + options_.refuse_latency, a)) return cancelled();
        rate_limited_.fetch_add(1, std::memory_order_relaxed);
        return keel::with_retry_after(absl::ResourceExhaustedError(cat(options_.name, ": 429 too many requests")),
                                      f.retry_after);
      default:
        break;
    }

    keel::duration latency = draw_latency();
    if (f.kind == fault_kind::slowdown) {
      latency = std::chrono::duration_cast<keel::duration>(latency * f.factor);
    }
    const bool stalled = f.kind == fault_kind::stall;
    const keel::time_point answer_at = stalled ? keel::time_point::max() : start + latency;
    if (answer_at > a.deadline.when()) {
      // The socket times out at the attempt's deadline; closing it takes a moment.
      if (!wait(a.deadline.when(), a)) return cancelled();
      if (!wait(clock_.now() + options_.close_latency, a)) return cancelled();
      timed_out_.fetch_add(1, std::memory_order_relaxed);
      abandoned_.fetch_add(1, std::memory_order_relaxed);
      return absl::DeadlineExceededError(
          cat(options_.name, ": no answer within the attempt's ",
                       keel::describe_duration(std::chrono::duration_cast<std::chrono::milliseconds>(a.timeout)),
                       stalled ? " (the stream stalled)" : ""));
    }
    if (!wait(answer_at, a)) return cancelled();
    a.charge(options_.tokens_per_answer);
    answered_.fetch_add(1, std::memory_order_relaxed);
    if (f.kind == fault_kind::invalid_output) {
      invalid_.fetch_add(1, std::memory_order_relaxed);
      return std::string("I think the answer is good!!! {score: ten");  // not the promised JSON
    }
    // A deterministic "model": the score follows the answer's length, so
    // replays and tests can check what they got.
    const int score = static_cast<int>(std::min<std::size_t>(10, 3 + prompt.size() / 40));
    return cat("{\"score\":", score, ",\"feedback\":\"Clear structure; give one concrete example",
                        score < 7 ? " and expand the trade-offs" : "", ".\"}");
  }

  // One streamed completion of `prompt`: at most `max_tokens` tokens into
  // `w`, after the ones w.text_so_far() already holds (a continuation).
  // OK when the stream reached its end; a failure before the first token
  // is the provider's refusal (429, 503) or a stop; after it, a cut (an
  // outage), an error event (invalid_output) or a stop.
  absl::Status stream(const keel::attempt& /*a*/, keel::stream_writer& w, std::string_view prompt, int max_tokens,
                      const nlohmann::json* /*request: the simulation answers the prompt*/) override {
    calls_.fetch_add(1, std::memory_order_relaxed);
    streams_.fetch_add(1, std::memory_order_relaxed);
    const in_flight_scope busy(in_flight_);
    const double draw = detail::unit_draw();
    auto affected = [&](const fault& f) { return f.kind != fault_kind::none && draw < f.ratio; };
    const fault at_start = current_fault();
    const keel::time_point start = clock_.now();
    if (options_.capacity > 0 && busy.count > options_.capacity) {
      if (!wait(start + options_.refuse_latency, w)) return stopped();
      rate_limited_.fetch_add(1, std::memory_order_relaxed);
      return keel::with_retry_after(
          absl::ResourceExhaustedError(cat(options_.name, ": 429 over its concurrency limit of ", options_.capacity)),
          options_.overload_retry_after);
    }
    if (affected(at_start) && at_start.kind == fault_kind::outage) {
      if (!wait(start + options_.refuse_latency, w)) return stopped();
      unavailable_.fetch_add(1, std::memory_order_relaxed);
      return absl::UnavailableError(cat(options_.name, ": 503 service unavailable"));
    }
    if (affected(at_start) && at_start.kind == fault_kind::rate_limit) {
      if (!wait(start + options_.refuse_latency, w)) return stopped();
      rate_limited_.fetch_add(1, std::memory_order_relaxed);
      return keel::with_retry_after(absl::ResourceExhaustedError(cat(options_.name, ": 429 too many requests")),
                                    at_start.retry_after);
    }
    const double slow = affected(at_start) && at_start.kind == fault_kind::slowdown ? at_start.factor : 1.0;
    keel::duration ttft = draw_around(options_.first_token_latency);
    if (detail::unit_draw() < options_.tail_ratio) ttft = scaled(ttft, options_.tail_factor);
    const keel::duration gap = scaled(options_.token_gap, slow);
    ttft = scaled(ttft, slow);

    // Where this stream starts: after the tokens already shown (each ends in a space).
    const std::string_view so_far = w.text_so_far();
    const int total = std::min(max_tokens, options_.stream_tokens);
    int next = static_cast<int>(std::count(so_far.begin(), so_far.end(), ' '));
    const int half = next + std::max(1, (total - next) / 2);
    const std::uint64_t seed = std::hash<std::string_view>{}(prompt);
    keel::time_point at = start + ttft;
    int sent = 0;
    while (next < total) {
      if (!wait(at, w)) return stopped();
      const fault now = current_fault();
      if (affected(now) && now.kind == fault_kind::outage) {
        if (sent == 0) {
          unavailable_.fetch_add(1, std::memory_order_relaxed);
          return absl::UnavailableError(cat(options_.name, ": 503 service unavailable"));
        }
        streams_cut_.fetch_add(1, std::memory_order_relaxed);
        return absl::UnavailableError(cat(options_.name, ": connection reset after ", sent, " tokens"));
      }
      if (affected(now) && now.kind == fault_kind::stall && next >= half) {
        // The server keeps the connection and sends nothing more.
        (void)wait(keel::time_point::max(), w);
        return stopped();
      }
      if (affected(now) && now.kind == fault_kind::invalid_output && next >= half && sent > 0) {
        streams_cut_.fetch_add(1, std::memory_order_relaxed);
        return absl::InternalError(cat(options_.name, ": error event mid-stream: server_error"));
      }
      const std::string_view word = stream_words[(seed + static_cast<std::uint64_t>(next) * 7) % stream_words.size()];
      if (!w.token(word, clock_.now())) return stopped();
      ++next;
      ++sent;
      stream_tokens_.fetch_add(1, std::memory_order_relaxed);
      at = clock_.now() + gap;
    }
    const auto prompt_tokens = static_cast<std::int64_t>(prompt.size() / 4 + 1);
    w.usage({.prompt_tokens = prompt_tokens, .completion_tokens = sent, .total_tokens = prompt_tokens + sent});
    streams_complete_.fetch_add(1, std::memory_order_relaxed);
    answered_.fetch_add(1, std::memory_order_relaxed);
    return absl::OkStatus();
  }

  // The simulation has no embeddings model: 501 through the gateway.
  absl::StatusOr<std::string> embed(const keel::attempt& /*a*/, const nlohmann::json& /*request*/) override {
    return absl::UnimplementedError(cat(options_.name, ": the simulated provider serves no embeddings"));
  }

  [[nodiscard]] provider_figures figures() const noexcept {
    return {.calls = calls_.load(std::memory_order_relaxed),
            .answered = answered_.load(std::memory_order_relaxed),
            .invalid = invalid_.load(std::memory_order_relaxed),
            .timed_out = timed_out_.load(std::memory_order_relaxed),
            .abandoned = abandoned_.load(std::memory_order_relaxed),
            .cancelled = cancelled_.load(std::memory_order_relaxed),
            .rate_limited = rate_limited_.load(std::memory_order_relaxed),
            .unavailable = unavailable_.load(std::memory_order_relaxed),
            .in_flight = in_flight_.load(std::memory_order_relaxed),
            .streams = streams_.load(std::memory_order_relaxed),
            .streams_complete = streams_complete_.load(std::memory_order_relaxed),
            .streams_cut = streams_cut_.load(std::memory_order_relaxed),
            .streams_stopped = streams_stopped_.load(std::memory_order_relaxed),
            .stream_tokens = stream_tokens_.load(std::memory_order_relaxed)};
  }

 private:
  struct in_flight_scope {
    explicit in_flight_scope(std::atomic<int>& n) noexcept
        : n_(n), count(n_.fetch_add(1, std::memory_order_relaxed) + 1) {}
    ~in_flight_scope() { n_.fetch_sub(1, std::memory_order_relaxed); }
    in_flight_scope(const in_flight_scope&) = delete;
    in_flight_scope& operator=(const in_flight_scope&) = delete;
    std::atomic<int>& n_;
    int count;  // calls in flight, this one included, when it started
  };

  // False when the attempt was asked to stop first.
  bool wait(keel::time_point until, const keel::attempt& a) const { return clock_.sleep_until(until, a.stop); }
  bool wait(keel::time_point until, const keel::stream_writer& w) const {
    return clock_.sleep_until(until, w.stop_token());
  }

  absl::Status stopped() {
    streams_stopped_.fetch_add(1, std::memory_order_relaxed);
    return absl::CancelledError(cat(options_.name, ": stream stopped, connection closed"));
  }

  static constexpr std::array<std::string_view, 16> stream_words = {
      "Start ", "with ", "one ", "deadline ", "for ", "the ", "whole ", "request; ", "each ", "stage ",
      "spends ", "what ", "is ", "left, ", "never ", "more. "};

  [[nodiscard]] static keel::duration scaled(keel::duration d, double f) {
    return std::chrono::duration_cast<keel::duration>(d * f);
  }

  [[nodiscard]] keel::duration draw_around(keel::duration median_d) const {
    if (options_.spread == 0.0) return median_d;
    const double median = std::chrono::duration<double>(median_d).count();
    std::lognormal_distribution<double> d(std::log(median), options_.spread);
    const double s = std::clamp(d(detail::thread_rng()), median / 4, median * 4);
    return std::chrono::duration_cast<keel::duration>(std::chrono::duration<double>(s));
  }

  absl::Status cancelled() {
    cancelled_.fetch_add(1, std::memory_order_relaxed);
    return absl::CancelledError(cat(options_.name, ": attempt cancelled, connection closed"));
  }

  [[nodiscard]] keel::duration draw_latency() const { return draw_around(options_.median_latency); }

  provider_options options_;
  Clock clock_;
  mutable std::mutex mu_;
  fault fault_{};  // guarded by mu_
  std::atomic<std::int64_t> calls_{0}, answered_{0}, invalid_{0}, timed_out_{0}, abandoned_{0}, cancelled_{0},
      rate_limited_{0}, unavailable_{0}, streams_{0}, streams_complete_{0}, streams_cut_{0}, streams_stopped_{0},
      stream_tokens_{0};
  std::atomic<int> in_flight_{0};
};

// A rubric: what a good answer to a question covers.
struct rubric {
  std::string question_id;
  std::vector<std::string> points;
};

// The shared database the interactive path reads in its retrieve stage.
template <keel::clock Clock = keel::real_clock>
class rubric_store {
 public:
  explicit rubric_store(keel::duration latency = 5ms, Clock clock = {}) : latency_(latency), clock_(std::move(clock)) {
    add({"q-design-cache", {"names the eviction policy", "bounds memory", "handles stampedes"}});
    add({"q-rate-limit", {"token bucket or GCRA", "per-tenant keys", "returns retry-after"}});
    add({"q-idempotency", {"client key scoped to tenant", "digest of the body", "replays the decision"}});
    add({"q-timeouts", {"one end-to-end deadline", "stages get what remains", "response reserve"}});
  }

  void add(rubric r) {
    std::lock_guard lock(mu_);
    const std::string key = r.question_id;
    rubrics_.insert_or_assign(key, std::move(r));
  }

  // The rubric for `question_id`, read within the attempt's deadline.
  absl::StatusOr<rubric> lookup(const keel::attempt& a, std::string_view question_id) const {
    const keel::time_point ready = clock_.now() + latency_;
    if (ready > a.deadline.when()) {
      clock_.sleep_until(a.deadline.when(), a.stop);
      return absl::DeadlineExceededError("rubric database: no answer within the stage's deadline");
    }
    if (!clock_.sleep_until(ready, a.stop)) return absl::CancelledError("rubric database: read cancelled");
    std::lock_guard lock(mu_);
    const auto it = rubrics_.find(question_id);
    if (it == rubrics_.end())
      return absl::NotFoundError(cat("no rubric for question '", question_id, "'"));
    return it->second;
  }

 private:
  keel::duration latency_;
  Clock clock_;
  mutable std::mutex mu_;
  std::map<std::string, rubric, std::less<>> rubrics_;  // guarded by mu_
};

}  // namespace gateway
