// keel/core/call.hpp — one logical request: its deadline, its cancellation, its
// labels, its attempt cap, and a record of what happened to it.
//
// A keel::call is created once per request at the edge of the service and
// passed (by reference) through every pipeline the request uses. It carries:
//
//   - the end-to-end deadline and the response reserve kept back for
//     answering; stages get child deadlines from stage(), never fresh ones;
//   - the caller's std::stop_token;
//   - labels (tenant, model, endpoint, region, work class) that scope
//     breakers, quotas and bulkheads;
//   - the operation (read or consequential write, idempotent or not);
//   - the attempt cap shared by every retry layer of the call, so three
//     attempts inside three attempts cannot become nine provider calls;
//   - the record: attempts, retries, cost, which path served, degraded,
//     replayed, missing;
//   - optionally, the service's own request (any type: tenant, payload size,
//     residency, estimated tokens), for gates, estimates and routing built
//     once at startup to read per call: call.request<T>(), keel::from_request.
//
// A provider sees one keel::attempt: its number, deadline, timeout and stop
// token, and a way to charge cost to the call.
//
// Example:
//
//   keel::real_clock clock;
//   keel::call call(clock.now(), {.timeout = std::chrono::seconds(3),
//                                 .response_reserve = std::chrono::milliseconds(200),
//                                 .labels = {.tenant = "acme", .model = "m-large"}});
//   keel::deadline retrieve = call.stage(clock.now(), std::chrono::milliseconds(200));
//
// Labels are string_views: the strings they name must outlive the call.
//
// Thread-safety: a call belongs to one request, run by one thread at a time.
// Its counters (attempts, retries, cost, missing, deposits) may be updated
// from several threads at once only after share_across_threads(): until then
// each update is a plain load and store (a locked read-modify-write costs
// ~6 ns, and a call that never leaves its thread, the common case, makes
// several), after it each is atomic. keel::hedge and keel::fan_out share the
// calls they hand to other threads; code of yours that runs attempts of one
// call on several threads at once must share it first, before the hand-off.
// served_by/degraded/replayed are set by the thread that runs the request's
// pipeline. Reading record() while attempts run gives a consistent-enough
// snapshot of each counter, not of all together.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <stop_token>
#include <string_view>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "keel/core/clock.hpp"
#include "keel/core/deadline.hpp"
#include "keel/core/outcome.hpp"
#include "keel/core/status.hpp"

namespace keel {

struct labels {
  std::string_view tenant{};
  std::string_view model{};
  std::string_view endpoint{};
  std::string_view region{};
  std::string_view work_class{};
};

struct call_options {
  // The end-to-end deadline: `deadline` as received from upstream, or
  // `timeout` from the moment the call is created, whichever ends first.
  keel::deadline deadline = keel::deadline::infinite();
  duration timeout = duration::zero();  // zero: no relative timeout
  // Kept back from every stage for validating and sending the answer.
  duration response_reserve = duration::zero();
  std::stop_token stop{};
  keel::labels labels{};
  keel::operation operation{};
  // Provider invocations allowed for the whole call, across nested retry
  // layers, hedges and fallbacks.
  int max_attempts = 3;

  [[nodiscard]] absl::Status validate() const {
    if (timeout < duration::zero()) return detail::invalid_field("call_options", "timeout", "be >= 0", timeout);
    if (response_reserve < duration::zero())
      return detail::invalid_field("call_options", "response_reserve", "be >= 0", response_reserve);
    if (timeout > duration::zero() && response_reserve >= timeout)
      return detail::invalid_field("call_options", "response_reserve", "be below timeout",
                                   detail::describe(response_reserve) + " >= " + detail::describe(timeout));
    if (max_attempts < 1) return detail::invalid_field("call_options", "max_attempts", "be >= 1", max_attempts);
    return absl::OkStatus();
  }
};

// What happened to a call, read after (or during) it.
struct call_record {
  int attempts = 0;        // provider invocations started, failed ones included
  int retries = 0;         // of which were retries
  std::int64_t cost = 0;   // caller-defined units charged by attempts (for example tokens)
  int missing = 0;         // units a fan-out could not produce
  std::string_view served_by{};  // the path that produced the answer; empty: the primary
  bool degraded = false;   // the answer came from a fallback or is partial
  bool replayed = false;   // the answer is a stored decision, not fresh work
};

namespace detail {
// One address per request type (an inline variable is one object across
// translation units): call::request<T>() compares it, no RTTI needed.
template <class Request>
inline constexpr char request_tag = 0;
}  // namespace detail

class call {
 public:
  // Throws keel::invalid_options if `o` is invalid.
  call(time_point now, const call_options& o)
      : stop_(o.stop),
        reserve_(o.response_reserve),
        end_(o.timeout > duration::zero() ? o.deadline.within(now, o.timeout) : o.deadline),
        start_(now),
        labels_(copy(o.labels)),
        max_attempts_(o.max_attempts),
        operation_{o.operation.effect, o.operation.idempotent} {  // by field: see copy()
    // Checked inline and reported out of line, from the fields alone: the
    // options' address never escapes, so a call built from a designated
    // initializer compiles to a few register moves (no copy through memory).
    const bool valid = o.timeout >= duration::zero() && o.response_reserve >= duration::zero() &&
                       (o.timeout <= duration::zero() || o.response_reserve < o.timeout) && o.max_attempts >= 1;
    if (!valid) [[unlikely]] refuse(o.timeout, o.response_reserve, o.max_attempts);
  }
  // The same, carrying the caller's own description of the request (tenant,
  // payload size, residency, estimated tokens: whatever it has), for gates,
  // estimators and routing to read (request<Request>(), keel::from_request).
  // Held by pointer: `request` must outlive the call.
  template <class Request>
  call(time_point now, const call_options& o, const Request& request) : call(now, o) {
    request_ = &request;
    request_type_ = &detail::request_tag<Request>;
  }
  template <class Request>
  call(time_point, const call_options&, const Request&&) = delete;  // would dangle

  call(const call&) = delete;
  call& operator=(const call&) = delete;

  // The request this call carries, if it carries a Request; else null.
  template <class Request>
  [[nodiscard]] const Request* request() const noexcept {
    return request_type_ == &detail::request_tag<std::remove_cv_t<Request>> ? static_cast<const Request*>(request_)
                                                                          : nullptr;
  }

  // When the call was made (the `now` it was made with): what its client
  // has waited since, whatever retries or hedges happened.
  [[nodiscard]] time_point start() const noexcept { return start_; }
  // The end-to-end deadline.
  [[nodiscard]] keel::deadline end() const noexcept { return end_; }
  // The deadline for work: end() minus the response reserve.
  [[nodiscard]] keel::deadline work_deadline() const noexcept { return end_.minus(reserve_); }
  [[nodiscard]] duration response_reserve() const noexcept { return reserve_; }
  // Work time left at `now`.
  [[nodiscard]] duration remaining(time_point now) const noexcept { return work_deadline().remaining(now); }
  // A stage's deadline: at most `at_most` from now, never past work_deadline().
  [[nodiscard]] keel::deadline stage(time_point now, duration at_most) const noexcept {
    return work_deadline().within(now, at_most);
  }

  [[nodiscard]] const std::stop_token& stop_token() const noexcept { return stop_; }
  // The stop token the call honours from now on: keel::asio::async_run ties
  // an operation's cancellation slot to the call with it. Not while a
  // pipeline runs the call.
  void stop_with(std::stop_token t) noexcept { stop_ = std::move(t); }
  [[nodiscard]] const keel::labels& labels() const noexcept { return labels_; }
  [[nodiscard]] const keel::operation& operation() const noexcept { return operation_; }

  // Attempt cap. begin_attempt() reserves one provider invocation and returns
  // its 1-based number, or 0 when the cap is reached (nothing is reserved).
  [[nodiscard]] int begin_attempt() noexcept {
    int n = attempts_.load(std::memory_order_relaxed);
    if (!shared()) {
      if (n >= max_attempts_) return 0;
      attempts_.store(n + 1, std::memory_order_relaxed);
      return n + 1;
    }
    while (n < max_attempts_) {
      if (attempts_.compare_exchange_weak(n, n + 1, std::memory_order_relaxed)) return n + 1;
    }
    return 0;
  }
  [[nodiscard]] int max_attempts() const noexcept { return max_attempts_; }
  [[nodiscard]] bool attempts_exhausted() const noexcept {
    return attempts_.load(std::memory_order_relaxed) >= max_attempts_;
  }

  // True the first time this call asks about `budget` (a keel::retry_budget):
  // the call deposits one request per budget, however many layers share it.
  // Up to kDepositSlots budgets are remembered; beyond, every ask is true.
  [[nodiscard]] bool first_deposit(const void* budget) noexcept {
    for (std::atomic<const void*>& slot : deposited_) {
      // Slots fill in order and never empty, so a budget sits in one slot.
      const void* seen = slot.load(std::memory_order_relaxed);
      if (seen == nullptr && !shared()) {
        slot.store(budget, std::memory_order_relaxed);
        return true;
      }
      if (seen == nullptr && slot.compare_exchange_strong(seen, budget, std::memory_order_relaxed)) return true;
      if (seen == budget) return false;
    }
    return true;
  }

  // Takes on the budgets `from` has deposited into: a call that stands in
  // for another (a hedge's race) must not deposit its request again.
  void inherit_deposits(const call& from) noexcept {
    for (std::size_t i = 0; i < static_cast<std::size_t>(kDepositSlots); ++i) {
      const void* b = from.deposited_[i].load(std::memory_order_relaxed);
      if (b == nullptr) break;
      (void)first_deposit(b);
    }
  }

  // Lets other threads update the counters while this one does: every
  // update from now on is atomic. Call it before handing the call over (the
  // hand-off, a mutex or an executor's queue, publishes it). Idempotent.
  void share_across_threads() noexcept { shared_.store(true, std::memory_order_relaxed); }
  [[nodiscard]] bool shared() const noexcept { return shared_.load(std::memory_order_relaxed); }

  // Record keeping, for policies and providers. Charging is a counter a
  // provider adds to through its attempt's read-only view of the call.
  void charge(std::int64_t units) const noexcept { add(cost_, units); }
  void note_retry() noexcept { add(retries_, 1); }
  void note_missing(int units = 1) noexcept { add(missing_, units); }
  void set_served_by(std::string_view path) noexcept { served_by_ = path; }
  void mark_degraded() noexcept { degraded_ = true; }
  void mark_replayed() noexcept { replayed_ = true; }

  [[nodiscard]] call_record record() const noexcept {
    return {.attempts = attempts_.load(std::memory_order_relaxed),
            .retries = retries_.load(std::memory_order_relaxed),
            .cost = cost_.load(std::memory_order_relaxed),
            .missing = missing_.load(std::memory_order_relaxed),
            .served_by = served_by_,
            .degraded = degraded_,
            .replayed = replayed_};
  }

 private:
  // Word by word: a whole-struct copy compiles to 16-byte loads of what
  // the caller has just stored 8 bytes at a time (a designated initializer),
  // and each such load stalls on store forwarding (~12 cycles, 5 per call).
  [[nodiscard]] static keel::labels copy(const keel::labels& l) noexcept {
    auto word = [](std::string_view v) noexcept { return std::string_view(v.data(), v.size()); };
    return {word(l.tenant), word(l.model), word(l.endpoint), word(l.region), word(l.work_class)};
  }

  template <class T>
  void add(std::atomic<T>& counter, T n) const noexcept {
    if (shared()) {
      counter.fetch_add(n, std::memory_order_relaxed);
    } else {
      counter.store(counter.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
    }
  }

  [[noreturn, gnu::cold, gnu::noinline]] static void refuse(duration timeout, duration reserve, int max_attempts) {
    detail::require_valid(call_options{.timeout = timeout, .response_reserve = reserve, .max_attempts = max_attempts}.validate());
    std::abort();  // unreachable: the inline check and validate() agree
  }

  // Ordered so that what may start zeroed (a call without a request, stop
  // token, reserve, labels or operation) comes in runs of at most 80 bytes,
  // split by the fields that are never zero (end_, start_, max_attempts_): GCC
  // zeroes a longer run with `rep stos`, whose start-up alone costs ~6 ns.
  static constexpr int kDepositSlots = 4;
  const void* request_ = nullptr;
  const void* request_type_ = nullptr;  // &detail::request_tag<Request>
  std::atomic<const void*> deposited_[kDepositSlots] = {};
  std::stop_token stop_;
  duration reserve_;
  keel::deadline end_;
  time_point start_;
  keel::labels labels_;
  int max_attempts_;
  keel::operation operation_;
  std::atomic<int> attempts_{0};
  std::atomic<int> retries_{0};
  std::atomic<int> missing_{0};
  mutable std::atomic<std::int64_t> cost_{0};
  std::string_view served_by_;
  bool degraded_ = false;
  bool replayed_ = false;
  std::atomic<bool> shared_{false};  // counters updated atomically (share_across_threads)
};

// What a provider sees of one attempt.
struct attempt {
  int number = 1;             // 1-based, counted across the whole call
  time_point start{};         // when the attempt began
  keel::deadline deadline{};  // the attempt must be done by then
  duration timeout{};         // deadline - start
  std::stop_token stop{};     // requested when the call is cancelled or this attempt lost a race
  // The call this attempt belongs to, read-only: its request, operation,
  // labels, stop token and deadlines. Its bookkeeping (attempt numbers,
  // retries, deposits, marks) is the policies' and stays out of reach.
  const keel::call* owner = nullptr;
  int hedge = 0;              // 0: the primary; k: the k-th hedge (keel/compose/hedge.hpp), e.g. to pick an alternate

  [[nodiscard]] const keel::labels& labels() const noexcept { return owner->labels(); }
  // Charges caller-defined cost (for example tokens) to the call, whether
  // the attempt then succeeds or fails.
  void charge(std::int64_t units) const noexcept { owner->charge(units); }
};

namespace detail {

// The call behind an attempt keel's own stages made from a call they hold
// (never a const one): a stream's first-token hedge begins its attempt on it.
[[nodiscard]] inline keel::call& bookkeeping(const attempt& a) noexcept { return const_cast<keel::call&>(*a.owner); }

}  // namespace detail

// Adapts `f(const Request&, args...)` into a callable on
// `(const keel::call&, args...)`: it reads the call's request and gives
// `otherwise` when the call carries none of that type. This is how a gate,
// an estimator or a route is written against the service's own request type
// and still plugged where keel hands over a call:
//
//   struct chat_request { std::string_view tenant; bool eu_only; std::int64_t tokens; };
//   auto estimate = keel::from_request<chat_request>([](const chat_request& r) { return r.tokens; }, 0);
//   auto pipe = keel::pipeline(quotas.with_estimate(estimate), ...);
//   chat_request rq{...};
//   keel::call call(now, {.timeout = 3s}, rq);
template <class Request, class F, class Otherwise>
struct request_reader {
  F f;
  Otherwise otherwise;
  template <class... Args>
  auto operator()(const call& c, Args&&... args) const
      -> std::common_type_t<std::invoke_result_t<const F&, const Request&, Args...>, Otherwise> {
    if (const Request* r = c.request<Request>()) return std::invoke(f, *r, std::forward<Args>(args)...);
    return otherwise;
  }
};

template <class Request, class F, class Otherwise>
[[nodiscard]] request_reader<Request, F, Otherwise> from_request(F f, Otherwise otherwise) {
  return {std::move(f), std::move(otherwise)};
}

}  // namespace keel
