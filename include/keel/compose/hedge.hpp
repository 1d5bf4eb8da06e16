// keel/compose/hedge.hpp — hedged requests: when the first attempt has not answered
// after a delay, start another, and return the first ACCEPTABLE answer.
//
// A hedge trades a little spare capacity for tail latency (Dean and
// Barroso, "The Tail at Scale": hedging after the 95th-percentile latency
// cut the 99.9th percentile from 1,800 ms to 74 ms for about 2% more
// requests). keel::hedge is a pipeline policy that does this inside the
// call's deadline and the service's retry budget:
//
//   - The primary attempt runs on the executor while the caller waits. If
//     it has not answered after `delay` (fixed, or the `percentile` of
//     recent latency learned online), a hedge attempt starts on the
//     executor; up to `max_hedges` of them, one per delay.
//   - The race returns the first acceptable success (an OK result that the
//     `accept` predicate takes), not the first attempt to finish. A failure,
//     however fast, does not end the race while another attempt is still
//     running. When every attempt has failed and nothing is running, the
//     next hedge starts at once if the failure is retryable; otherwise the
//     last failure is the answer.
//   - The call returns as soon as the race is decided. Every attempt has its
//     own std::stop_source, linked to the call's stop token. When a winner
//     is chosen the others are asked to stop; those still running are
//     counted as outstanding (figures().outstanding, and
//     events::hedge_losers_cancelled) until they return, because their
//     upstream work may go on after a local cancel. They finish on the
//     executor with what they own (below), not holding the caller.
//   - With `cut`, every attempt is also stopped at the race's deadline, on
//     the hedge's timer: a race whose attempts watch only their stop tokens
//     ends then instead of waiting for them (an attempt cut so answers
//     DeadlineExceeded).
//   - Each hedge spends one retry from `budget` (the same keel::retry_budget
//     as retries); when it is spent, no hedge starts. Hedges also count
//     against the call's attempt cap. A hedge the executor refuses is
//     skipped (events::hedge_skipped): it is not reported as started, and
//     the race's answer stays what its attempts returned.
//   - A consequential write is never hedged unless it is idempotent
//     (keel::operation{.effect = write, .idempotent = true}: it carries an
//     idempotency identity). At compile time, a pipeline with a hedge does
//     not compile around a provider type that declares a non-idempotent
//     write (keel/core/policy.hpp, declares_operation). At run time, a call whose
//     operation is such a write is refused with FailedPrecondition ("not
//     started", permanent), or run as one unhedged attempt when
//     `run_unsafe_writes_unhedged` is set.
//
// Same or alternate provider: every attempt sees keel::attempt::hedge (0 for
// the primary, k for the k-th hedge); keel::alternates(a, b, ...) is a
// provider that sends attempt k to the k-th callable (the last one repeats).
//
// Example:
//
//   keel::bounded_pool pool({.threads = 8, .queue_capacity = 64});
//   keel::retry_budget budget({.ratio = 0.05});
//   keel::hedge hedger({.delay = std::chrono::milliseconds(80), .percentile = 0.95,
//                       .max_hedges = 1, .budget = &budget}, pool);
//   auto pipe = keel::pipeline(hedger);
//   keel::call call(keel::real_clock{}.now(), {.timeout = std::chrono::seconds(2)});
//   absl::StatusOr<int> r = pipe.run(call, [](const keel::attempt& a) -> absl::StatusOr<int> { return a.hedge; });
//
// Costs: the primary's hand-off to the executor (a queue push and a thread
// wake-up each way; measured in docs/fanout.md) and one executor thread per
// call in flight: size the executor for the calls in flight through the
// hedge plus their hedges, or a primary stalled on every thread keeps the
// hedges that would beat it waiting in the queue. A primary the executor
// refuses runs on the caller's thread. `primary_on_caller_thread` runs
// every primary there: no hand-off, no thread, but a call whose hedge wins
// then returns only when its primary returns. When the primary wins, the
// race allocates nothing: its block (its state, and the copies below) is
// kept per calling thread and reused. A hedge allocates its stop source and
// may allocate in the executor.
//
// What a hedged pipeline's attempts may hold. A losing attempt may run after
// run() has returned, so:
//   - the provider is copied into the race (keel/compose/pipeline.hpp; a provider
//     that cannot be copied does not compile: pass std::ref(p) for one that
//     outlives every attempt). What the copy refers to must outlive the
//     attempt too: capture per-request state by value (or shared_ptr), never
//     the caller's locals or its keel::call by reference. Use the
//     keel::attempt the provider is given: its owner, labels and charge()
//     are the race's own, safe after the call returned.
//   - the attempts run with the race's own keel::call (the caller's
//     deadline, operation, attempt cap and copies of its labels) and copies
//     of the pipeline's clock, classifier and listener. What the attempts
//     did (attempts, retries, cost, missing units) is added to the caller's
//     call when the race is decided; what a loser does after that is not.
//   - the policies between the hedge and the provider are the pipeline's:
//     keep a pipeline with policies below its hedge alive until
//     figures().outstanding is 0 (build pipelines once, not per call).
//     Put keel::fallback outside the hedge, not below it (it records the
//     serving path on the call).
//   - the hedge's destructor waits for every attempt still running.
// The hedge's own events are reported while the caller waits for the
// answer, never after. Policies below the hedge report to the race's copy of
// the listener, also from losers after run() has returned: a listener must
// be copyable and safe to call then (keel::metrics_listener is).
//
// Hedges are started when due by a keel::deadline_timer (keel/core/
// timer.hpp): the one given to the constructor, on the pipeline's
// clock, or keel::process_timer() on the real clock. The hedge has no
// thread of its own. The executor runs the attempts and must use other
// threads than the timer's (see keel/compose/executor.hpp). On a
// keel::testing::manual_clock the timer's thread is one of the clock's
// sleepers while a call is armed on it.
//
// Events (keel/core/telemetry.hpp): hedge_started, hedge_skipped (budget,
// executor, attempt cap, deadline, cancelled), hedge_refused_write,
// hedge_losers_cancelled. They are reported on the thread that decided,
// which may be the timer thread or an executor thread.
//
// Thread-safety: execute() may run for many calls at once; figures() and
// current_delay() from any thread. Destroy a hedge only when no call is
// running through it; its destructor then waits for the losers still
// running.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <stop_token>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "keel/compose/cut_at_deadline.hpp"
#include "keel/compose/events.hpp"
#include "keel/compose/executor.hpp"
#include "keel/core/call.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/condition.hpp"
#include "keel/core/outcome.hpp"
#include "keel/core/policy.hpp"
#include "keel/core/status.hpp"
#include "keel/core/telemetry.hpp"
#include "keel/core/internal/boundary.hpp"
#include "keel/core/internal/thread_slot.hpp"
#include "keel/policy/latency_tracker.hpp"
#include "keel/policy/retry_budget.hpp"

namespace keel {

struct hedge_options {
  // The hedge delay when `percentile` is 0; in percentile mode, the delay
  // until enough latencies are known. >= 0.
  duration delay = std::chrono::milliseconds(100);
  // 0: fixed delay. In (0, 1): hedge after this percentile of the latencies
  // of recent acceptable answers (losers count at the time they were cut).
  double percentile = 0.0;
  // The learned delay never goes below this; >= 0.
  duration min_delay = std::chrono::milliseconds(1);
  // Hedges per call, one per delay; in [0, 7]. 0 turns hedging off.
  int max_hedges = 1;
  // Each hedge spends one retry from this budget; null: no budget.
  keel::retry_budget* budget = nullptr;
  // Deposit one request per call into `budget` (once per call, also when a
  // keel::retry shares the budget). Turn off only when the application
  // deposits for its requests itself.
  bool deposit_requests = true;
  // Do not start a hedge with less time than this left; >= 0.
  duration min_attempt_time = duration::zero();
  // Latency window of the percentile mode (see keel/policy/latency_tracker.hpp).
  int samples = 512;
  int min_samples = 50;
  // A non-idempotent write: refuse it (false) or run it as one attempt (true).
  bool run_unsafe_writes_unhedged = false;
  // false: the primary runs on the executor and the caller waits for the
  // first acceptable answer, so it returns at once even when the attempt
  // that lost ignores its stop token. true: the primary runs on the
  // caller's thread (no hand-off, no executor thread spent on it), but a
  // call whose hedge wins then returns only when its primary returns: only
  // for providers that honour their stop token at once.
  bool primary_on_caller_thread = false;
  // Cuts every attempt of the race at the race's deadline, on the timer
  // that starts the hedges: its stop is requested then (keel::deadline_cut,
  // keel/core/timer.hpp), so a race whose attempts watch only their stop
  // tokens ends at its deadline, and an attempt cut that way answers
  // DeadlineExceeded, not Cancelled. false: the attempts are stopped only
  // when the race is decided or the call is cancelled.
  bool cut = false;

  static constexpr int max_hedges_limit = 7;

  [[nodiscard]] absl::Status validate() const {
    constexpr std::string_view who = "hedge_options";
    if (delay < duration::zero()) return detail::invalid_field(who, "delay", "be >= 0", delay);
    if (!(percentile == 0.0 || (percentile > 0.0 && percentile < 1.0)))
      return detail::invalid_field(who, "percentile", "be 0 (fixed delay) or in (0, 1)", percentile);
    if (min_delay < duration::zero()) return detail::invalid_field(who, "min_delay", "be >= 0", min_delay);
    if (max_hedges < 0 || max_hedges > max_hedges_limit)
      return detail::invalid_field(who, "max_hedges", "be in [0, 7]", max_hedges);
    if (min_attempt_time < duration::zero())
      return detail::invalid_field(who, "min_attempt_time", "be >= 0", min_attempt_time);
    if (percentile > 0.0) {
      const latency_tracker_options t{.percentile = percentile, .samples = samples, .min_samples = min_samples,
                                      .refresh_every = std::min(32, std::max(1, samples))};
      if (absl::Status s = t.validate(); !s.ok()) {
        if (samples < 16 || samples > 65536) return detail::invalid_field(who, "samples", "be in [16, 65536]", samples);
        return detail::invalid_field(who, "min_samples", "be in [1, samples]", min_samples);
      }
    }
    return absl::OkStatus();
  }
};

// What a hedge has done since it was made.
struct hedge_figures {
  std::int64_t calls = 0;               // executions, refused writes included
  std::int64_t hedges_started = 0;      // hedge attempts handed to the executor
  std::int64_t hedge_wins = 0;          // races won by a hedge, not the primary
  std::int64_t skipped_budget = 0;      // hedges the retry budget refused
  std::int64_t skipped_executor = 0;    // hedges the executor refused
  std::int64_t skipped_other = 0;       // attempt cap, deadline or cancellation
  std::int64_t refused_writes = 0;      // non-idempotent writes that reached the hedge
  std::int64_t cancelled_losers = 0;    // attempts asked to stop while still running
  std::int64_t outstanding = 0;         // of those, how many have not returned yet
};

// Accepts every successful answer.
struct accept_any {
  template <class T>
  constexpr bool operator()(const T&) const noexcept {
    return true;
  }
};

// A provider that sends attempt k (keel::attempt::hedge) to the k-th
// callable; attempts past the last use the last. Held by value; wrap shared
// providers in std::ref.
template <class... Providers>
class alternates {
 public:
  static_assert(sizeof...(Providers) >= 1, "keel::alternates needs at least one provider");
  explicit alternates(Providers... p) : providers_(std::move(p)...) {}

  auto operator()(const attempt& a) { return pick<0>(a, std::min<int>(a.hedge, sizeof...(Providers) - 1)); }

 private:
  template <std::size_t I>
  auto pick(const attempt& a, int k) -> std::invoke_result_t<std::tuple_element_t<0, std::tuple<Providers...>>&,
                                                             const attempt&> {
    if constexpr (I + 1 < sizeof...(Providers)) {
      if (k != static_cast<int>(I)) return pick<I + 1>(a, k);
    }
    return std::get<I>(providers_)(a);
  }
  std::tuple<Providers...> providers_;
};

namespace detail {

// The race's own copies of the call's label strings: an attempt that is
// still running after the caller left reads these, not the caller's. Kept
// with the block between calls, so their capacity is reused.
struct label_store {
  std::string tenant, model, endpoint, region, work_class;

  [[nodiscard]] keel::labels copy(const keel::labels& l) {
    tenant.assign(l.tenant);
    model.assign(l.model);
    endpoint.assign(l.endpoint);
    region.assign(l.region);
    work_class.assign(l.work_class);
    return {.tenant = tenant, .model = model, .endpoint = endpoint, .region = region, .work_class = work_class};
  }
};

// The parts of a pipeline's run context (keel/core/policy.hpp).
template <class Ctx>
struct run_context_parts {
  static constexpr bool known = false;
};
template <class C, class K, class L>
struct run_context_parts<run_context<C, K, L>> {
  static constexpr bool known = true;
  using clock = C;
  using classifier = K;
  using listener = L;
};

// OK when `r` is an acceptable answer; otherwise why not. A failure's status
// is moved out of `r` (no reference count is shared with the attempt's
// thread: Debian's libabsl counts references where TSan cannot see it).
template <class R, class Accept>
[[nodiscard]] absl::Status judge(R& r, const Accept& accept) {
  if constexpr (std::same_as<R, absl::Status>) {
    if (r.ok()) return absl::OkStatus();
    return std::exchange(r, absl::OkStatus());
  } else {
    if (!r.ok()) return std::move(r).status();
    using verdict = std::invoke_result_t<const Accept&, const typename R::value_type&>;
    if constexpr (std::same_as<std::remove_cvref_t<verdict>, absl::Status>) {
      return accept(*r);
    } else {
      if (accept(*r)) return absl::OkStatus();
      return with_outcome(absl::FailedPreconditionError("keel: hedge: answer rejected by the acceptance check"),
                          outcome_kind::transient);
    }
  }
}

}  // namespace detail

template <keel::executor Executor, class Accept = accept_any>
class hedge {
 public:
  // Lets a pipeline refuse, at compile time, a provider that declares a
  // non-idempotent write, and makes it hand this policy a `next` that owns
  // a copy of the provider (keel/compose/pipeline.hpp).
  static constexpr bool concurrent_attempts = true;

  // Hedges start on `timer` (the pipeline's clock's: a manual clock's timer
  // in tests). Throws keel::invalid_options if `o` is invalid.
  hedge(const hedge_options& o, Executor& executor, deadline_timer_base& timer = process_timer(),
        Accept accept = {})
      : options_((detail::require_valid(o.validate()), o)),
        executor_(executor),
        timer_(timer),
        accept_(std::move(accept)),
        tracker_(o.percentile > 0.0 ? std::make_unique<latency_tracker>(latency_tracker_options{
                                          .percentile = o.percentile,
                                          .samples = o.samples,
                                          .min_samples = o.min_samples,
                                          .refresh_every = std::min(32, o.samples)})
                                    : nullptr) {}
  hedge(const hedge&) = delete;
  hedge& operator=(const hedge&) = delete;
  // Waits for the attempts still running (losers whose callers have their
  // answers).
  ~hedge() {
    // Polled, not notified: a release's last touch of the hedge is its
    // store to the count (a release store; read here with acquire), so
    // nothing of the hedge is used once the count reads zero. The count
    // only falls while this runs (no call starts), so a sum read cell by
    // cell that is zero is zero. Losers are few and end at their cut or
    // their answer.
    for (auto pause = std::chrono::microseconds(10); races_.read_acquire() != 0;
         pause = std::min(pause * 2, std::chrono::microseconds(1000))) {
      std::this_thread::sleep_for(pause);
    }
  }

  [[nodiscard]] const hedge_options& options() const noexcept { return options_; }

  // The delay a call starting now would hedge after.
  [[nodiscard]] duration current_delay() const noexcept {
    if (tracker_ == nullptr) return options_.delay;
    const std::optional<duration> p = tracker_->percentile();
    return p ? std::max(*p, options_.min_delay) : options_.delay;
  }

  [[nodiscard]] hedge_figures figures() const noexcept {
    auto get = [](const std::atomic<std::int64_t>& a) { return a.load(std::memory_order_relaxed); };
    return {.calls = calls_.read(),
            .hedges_started = get(hedges_started_),
            .hedge_wins = get(hedge_wins_),
            .skipped_budget = get(skipped_budget_),
            .skipped_executor = get(skipped_executor_),
            .skipped_other = get(skipped_other_),
            .refused_writes = get(refused_writes_),
            .cancelled_losers = get(cancelled_losers_),
            .outstanding = get(outstanding_)};
  }

  template <class Ctx, class Next>
  auto execute(Ctx& ctx, const attempt_plan& plan, Next& next) -> decltype(next(ctx, plan)) {
    using R = decltype(next(ctx, plan));
    static_assert(detail::run_context_parts<Ctx>::known,
                  "keel::hedge runs inside a keel::pipeline: its ctx must be a keel::run_context");
    static_assert(std::is_move_constructible_v<Next>,
                  "keel::hedge keeps the rest of the pipeline for attempts that outlive the call: `next` must be "
                  "movable");
    calls_.add();
    if (!ctx.call.operation().repeatable()) {
      refused_writes_.fetch_add(1, std::memory_order_relaxed);
      observe(ctx.listener, events::hedge_refused_write{ctx.call, options_.run_unsafe_writes_unhedged});
      if (options_.run_unsafe_writes_unhedged) return next(ctx, plan);
      return R(with_outcome(
          mark_not_started(absl::FailedPreconditionError(
              "keel: a consequential write without an idempotency identity is never hedged "
              "(give the call operation{.effect = write, .idempotent = true} with a key the receiver honours, "
              "or set hedge_options::run_unsafe_writes_unhedged)")),
          outcome_kind::permanent));
    }
    if (options_.max_hedges == 0) return next(ctx, plan);
    if (!timer_.template on_clock<decltype(ctx.clock)>()) {
      return R(with_outcome(mark_not_started(absl::FailedPreconditionError(
                                "keel: hedge: its timer runs on another clock than the pipeline (give the hedge a "
                                "keel::deadline_timer on the pipeline's clock)")),
                            outcome_kind::permanent));
    }
    if (options_.budget != nullptr && options_.deposit_requests) options_.budget->record_request(ctx.call, plan.now);
    return race<R, Ctx, Next>::acquire().run(*this, ctx, next, plan, current_delay());
  }

 private:
  using skip = events::hedge_skipped::reason;

  // One call's race. Owned jointly by the caller (until it has its answer)
  // and by every attempt handed to the executor (until it returns), so a
  // loser that ignores its stop token holds only this block, never the
  // caller. The last owner puts it back in its thread's spare slot: a thread
  // that calls through the hedge again reuses it without allocating.
  //
  // What a running attempt touches: this block (its own call, context,
  // clock, classifier and listener copies, and the rest of the pipeline
  // with its own copy of the provider), and the hedge. The caller's ctx
  // (its keel::call, the pipeline's listener) only under `mu` while the
  // caller is still waiting (!decided): the caller leaves only after taking
  // `mu` and seeing `decided`.
  template <class R, class Ctx, class Next>
  struct race final : detail::timer_entry {
    using parts = detail::run_context_parts<Ctx>;
    using clock_type = typename parts::clock;
    using classifier_type = typename parts::classifier;
    using listener_type = typename parts::listener;
    static_assert(std::is_copy_constructible_v<classifier_type> && std::is_copy_constructible_v<listener_type>,
                  "keel::hedge copies the pipeline's classifier and listener for attempts that outlive the call: "
                  "they must be copyable (hold shared state by pointer or reference)");

    struct slot {
      std::stop_source stop{std::nostopstate};
      std::stop_token token;  // stop's, which this attempt's plan refers to
      std::optional<std::stop_callback<detail::forward_stop_to>> link;
      keel::deadline_cut cut;  // hedge_options::cut: stops this attempt at the race's deadline
      time_point start{};
      bool running = false;
      bool cancelled = false;
    };

    race() = default;
    race(const race&) = delete;
    race& operator=(const race&) = delete;
    ~race() = default;

    // A thread's spare block: the last owner of a block leaves it here.
    struct spare {
      race* block = nullptr;
      spare() = default;
      spare(const spare&) = delete;
      spare& operator=(const spare&) = delete;
      ~spare() { delete block; }
    };
    static spare& thread_spare() noexcept {
      thread_local spare s;
      return s;
    }

    static race& acquire() {
      spare& s = thread_spare();
      if (s.block != nullptr) return *std::exchange(s.block, nullptr);
      return *new race();
    }

    R run(hedge& o, Ctx& c, Next& n, const attempt_plan& p, duration delay) {
      owner = &o;
      caller = &c;
      plan = p;
      // Ours: losers may read it after the caller (and its token) are gone.
      caller_stop = p.stop.token();
      plan.stop = caller_stop;
      clock.emplace(c.clock);
      classifier.emplace(c.classifier);
      listener.emplace(c.listener);
      const keel::call& from = c.call;
      // The race's own call: what attempts see as their owner (labels,
      // operation, attempt numbers, charges). Its counters are added to the
      // caller's call when the race is decided.
      own_call.emplace(p.now, call_options{.deadline = from.end(),
                                           .response_reserve = from.response_reserve(),
                                           .labels = labels.copy(from.labels()),
                                           .operation = from.operation(),
                                           .max_attempts = from.max_attempts()});
      base = from.record();
      for (int k = 0; k < base.attempts; ++k) (void)own_call->begin_attempt();  // numbers go on from the call's
      own_call->inherit_deposits(from);  // a retry below must not deposit the call's request again
      own_call->share_across_threads();  // the racers update it at once
      // Run from inside a provider on the same call: the primary takes over
      // that provider's attempt, as a pipeline's first attempt would.
      handed = 0;
      if (detail::invocation* outer = detail::current_invocation;
          outer != nullptr && outer->owner == &c.call && outer->credit) {
        outer->credit = false;
        handed = outer->number;
      }
      ctx.emplace(Ctx{*own_call, *clock, *classifier, *listener});
      next.emplace(std::move(n));

      slot& primary = slots[0];
      if (!primary.stop.stop_possible() || primary.stop.stop_requested()) primary.stop = std::stop_source();
      if (p.stop.stop_possible()) primary.link.emplace(p.stop, detail::forward_stop_to{&primary.stop});
      if (o.options_.cut) primary.cut.arm(o.timer_, p.deadline, primary.stop);
      primary.start = p.now;
      primary.running = true;
      primary.cancelled = false;
      launched = 1;
      returned = 0;
      hedges = 0;
      winner = -1;
      decided = false;
      no_more = false;
      refs = 1;
      due = p.now + delay;
      fire = &race::on_timer;
      o.arm(*this);

      bool on_caller = o.options_.primary_on_caller_thread;
      if (!on_caller) {
        std::lock_guard lock(mu);
        // Refused: the caller runs its primary itself rather than fail it.
        on_caller = !hand_over_locked(0);
      }
      if (on_caller) attempt(0, /*owns_ref=*/false);

      R result = [&] {
        std::unique_lock lock(mu);
        done.wait(lock, [&] { return decided; });
        settle_call_locked();
        caller = nullptr;
        if (winner >= 0) return std::move(*answer);
        return R(std::move(last_failure));
      }();
      // Disarmed first (a hedge being started meanwhile finishes), then the
      // caller's reference dropped: on_timer never sees a released block.
      if (o.disarm_and_release(*this, [this] { return --refs == 0; })) recycle(/*counted=*/true);
      return result;
    }

    // Runs attempt i and records its result. On an executor thread (owns_ref:
    // it holds a reference to the block), or on the caller's.
    void attempt(int i, bool owns_ref) {
      attempt_plan p;
      bool go = false;
      {
        std::lock_guard lock(mu);
        if (!decided) {
          go = true;
          p = plan;
          slot& s = slots[static_cast<std::size_t>(i)];
          s.token = s.stop.get_token();
          p.stop = s.token;
          p.hedge = i;
        }
      }
      if (!go) {  // decided while it waited for a thread: never invoked
        finish(i, R(absl::CancelledError("keel: hedge: race decided before the attempt started")), owns_ref);
        return;
      }
      if (i > 0 || owns_ref) p.now = clock->now();  // it may have waited for a thread
      time_point end{};
      R r = [&] {
        if (i != 0 || handed == 0) return invoke(p, end);
        detail::invocation taken{&*own_call, handed, true};
        const detail::invocation_scope scope(&taken, detail::current_invocation);
        return invoke(p, end);
      }();
      finish(i, std::move(r), owns_ref, end);
    }

    // A run context belongs to one thread: each attempt runs with its own
    // copy, whose attempt end (read once, by whichever policy below asks
    // first) is the race's end time for it too.
    R invoke(const attempt_plan& p, time_point& end) {
      Ctx mine = *ctx;
      mine.attempt_started();
      R r = detail::call_user<R>("hedge: attempt", *next, mine, p);
      if (owner->tracker_ != nullptr) end = mine.attempt_end(p.now);
      return r;
    }

    // Records attempt i's result and decides the race when it can. An
    // attempt that owns a reference gives it up in the same critical
    // section, so the waiting caller (woken by it) is the one that releases
    // the block when the primary wins.
    void finish(int i, R&& r, bool owns_ref, std::optional<time_point> ended = std::nullopt) {
      const bool timed = owner->tracker_ != nullptr;
      const time_point end = timed ? (ended ? *ended : clock->now()) : time_point{};
      // Armed before the attempt was handed over; only its own thread disarms.
      r = slots[static_cast<std::size_t>(i)].cut.settle(std::move(r), plan.stop,
                                                         [&](const absl::Status& st) { return ctx->classify(st); });
      bool last = false;
      {
        std::lock_guard lock(mu);
        slot& s = slots[static_cast<std::size_t>(i)];
        s.running = false;
        ++returned;
        if (s.cancelled) owner->outstanding_.fetch_sub(1, std::memory_order_relaxed);
        if (!decided) {
          absl::Status why = detail::judge(r, owner->accept_);
          if (why.ok()) {
            decided = true;
            winner = i;
            answer.emplace(std::move(r));
            if (i > 0) owner->hedge_wins_.fetch_add(1, std::memory_order_relaxed);
            if (timed) owner->tracker_->record(end - s.start);
            cancel_losers_locked(i, end);
          } else {
            last_failure = std::move(why);
            if (returned == launched) {
              // Nothing is running: a retryable failure starts the next
              // hedge at once; anything else (or a refused hedge) ends the
              // race with this failure.
              if (retryable(ctx->classify(last_failure), own_call->operation())) {
                const int k = reserve_locked(timed ? end : clock->now());
                if (k >= 0) hand_over_locked(k);
              }
              if (returned == launched) decided = true;
            }
          }
          if (decided) done.notify_all();
        }
        if (owns_ref) last = --refs == 0;
      }
      if (last) recycle(/*counted=*/false);
    }

    void cancel_losers_locked(int won, time_point now) {
      int outstanding = 0;
      for (int j = 0; j < launched; ++j) {
        slot& s = slots[static_cast<std::size_t>(j)];
        if (j == won || !s.running || s.cancelled) continue;
        s.cancelled = true;
        ++outstanding;
        s.stop.request_stop();
        // A loser took at least this long: recorded so the learned delay is
        // not biased towards the fast answers that won.
        if (owner->tracker_ != nullptr) owner->tracker_->record(now - s.start);
      }
      if (outstanding > 0) {
        owner->cancelled_losers_.fetch_add(outstanding, std::memory_order_relaxed);
        owner->outstanding_.fetch_add(outstanding, std::memory_order_relaxed);
        observe(caller->listener, events::hedge_losers_cancelled{caller->call, won, outstanding});
      }
    }

    // Reserves the next hedge, or returns -1 (and reports why) when none may
    // start. Then hand_over_locked(i).
    int reserve_locked(time_point now) {
      if (no_more || hedges >= owner->options_.max_hedges) return -1;
      const int k = hedges + 1;
      std::optional<skip> why;
      if (plan.stop.stop_requested()) {
        why = skip::cancelled;
      } else if (plan.deadline.expired(now) ||
                 plan.deadline.remaining(now) < std::max(owner->options_.min_attempt_time, duration(1))) {
        why = skip::deadline;
      } else if (own_call->attempts_exhausted()) {
        why = skip::attempt_cap;
      } else if (owner->options_.budget != nullptr && !owner->options_.budget->try_acquire_retry(now)) {
        why = skip::budget;
      }
      if (why) {
        no_more = true;
        owner->count_skip(*why);
        observe(caller->listener, events::hedge_skipped{caller->call, k, *why});
        return -1;
      }
      const int i = launched;
      slot& s = slots[static_cast<std::size_t>(i)];
      s.stop = std::stop_source();
      if (plan.stop.stop_possible()) s.link.emplace(plan.stop, detail::forward_stop_to{&s.stop});
      if (owner->options_.cut) s.cut.arm(owner->timer_, plan.deadline, s.stop);
      s.start = now;
      s.running = true;
      s.cancelled = false;
      ++launched;
      ++hedges;
      return i;
    }

    // Hands attempt i (reserved) to the executor. Under `mu`, so the caller
    // is still here when hedge_started is reported, and only for a hedge the
    // executor accepted. A refused hedge is taken back as if never reserved:
    // the race's answer stays what the attempts returned.
    bool hand_over_locked(int i) {
      ++refs;
      if (absl::Status s = owner->executor_.try_execute([this, i] { attempt(i, /*owns_ref=*/true); }); s.ok()) {
        if (i > 0) {
          owner->hedges_started_.fetch_add(1, std::memory_order_relaxed);
          observe(caller->listener,
                  events::hedge_started{caller->call, i, slots[static_cast<std::size_t>(i)].start - plan.now});
        }
        return true;
      }
      --refs;
      if (i == 0) return false;  // the caller runs its primary itself
      slot& s = slots[static_cast<std::size_t>(i)];
      s.link.reset();
      (void)s.cut.disarm();
      s.running = false;
      --launched;
      --hedges;
      no_more = true;
      owner->count_skip(skip::executor);
      observe(caller->listener, events::hedge_skipped{caller->call, i, skip::executor});
      return false;
    }

    // The caller, deciding: what the attempts did goes on the caller's call
    // (attempts, retries, cost and missing units since the race began).
    // What a loser does after this is not on the call's record.
    void settle_call_locked() {
      keel::call& to = caller->call;
      const call_record now = own_call->record();
      for (int k = base.attempts; k < now.attempts; ++k) (void)to.begin_attempt();
      for (int k = 0; k < now.retries; ++k) to.note_retry();
      if (now.cost != 0) to.charge(now.cost);
      if (now.missing != 0) to.note_missing(now.missing);
    }

    // The last owner: clears the call's state and keeps the block as this
    // thread's spare, then lets the hedge know (its destructor waits for it)
    // unless that was counted already.
    void recycle(bool counted) {
      hedge& o = *owner;
      for (int j = 0; j < launched; ++j) {
        slot& s = slots[static_cast<std::size_t>(j)];
        s.link.reset();  // before the source it forwards to is replaced
        (void)s.cut.disarm();
        s.token = {};
        if (j > 0) s.stop = std::stop_source(std::nostopstate);
      }
      answer.reset();
      last_failure = absl::OkStatus();
      next.reset();
      ctx.reset();
      own_call.reset();
      listener.reset();
      classifier.reset();
      clock.reset();
      plan = {};
      caller_stop = {};
      owner = nullptr;
      spare& s = thread_spare();
      if (s.block == nullptr) {
        s.block = this;
      } else {
        delete this;
      }
      if (!counted) o.race_released();
    }

    // On the timer's thread, once the next hedge is due; returns when the
    // one after it is. The caller's disarm waits for this to return.
    static time_point on_timer(detail::timer_entry& t, time_point now) {
      race& self = static_cast<race&>(t);
      std::lock_guard lock(self.mu);
      if (self.decided) return time_point::max();
      const int i = self.reserve_locked(now);
      if (i < 0) return time_point::max();
      const bool more = self.hedges < self.owner->options_.max_hedges;
      if (!self.hand_over_locked(i) || !more) return time_point::max();
      return now + self.owner->current_delay();
    }

    hedge* owner = nullptr;
    Ctx* caller = nullptr;  // while the caller waits: its ctx (its call, the pipeline's listener)
    std::optional<clock_type> clock;
    std::optional<classifier_type> classifier;
    std::optional<listener_type> listener;
    detail::label_store labels;
    std::optional<keel::call> own_call;
    call_record base;
    std::optional<Ctx> ctx;  // attempts run with this: own_call and the copies above
    std::optional<Next> next;
    attempt_plan plan;
    std::stop_token caller_stop;  // plan.stop refers to it
    std::mutex mu;
    keel::condition done;
    std::array<slot, hedge_options::max_hedges_limit + 1> slots;
    int launched = 0;  // attempts started, the primary included
    int returned = 0;  // attempts that have returned
    int hedges = 0;    // hedges reserved
    int winner = -1;
    int handed = 0;  // the attempt number the primary takes over (0: none)
    int refs = 0;      // the caller while it waits, and each attempt handed to the executor
    bool decided = false;
    bool no_more = false;  // a hedge was refused: start no other
    std::optional<R> answer;
    absl::Status last_failure;
  };

  void count_skip(skip why) noexcept {
    switch (why) {
      case skip::budget: skipped_budget_.fetch_add(1, std::memory_order_relaxed); break;
      case skip::executor: skipped_executor_.fetch_add(1, std::memory_order_relaxed); break;
      default: skipped_other_.fetch_add(1, std::memory_order_relaxed); break;
    }
  }

  // --- the timer ------------------------------------------------------------

  // A race begins: counted until released, and armed for its hedge time.
  void arm(detail::timer_entry& t) {
    races_.add(1);  // no call starts while the destructor runs
    timer_.schedule(t, t.due);
  }

  // The caller leaves its race: disarmed (a hedge being started finishes
  // first), then `drop` (its reference, under the race's lock). True when
  // it was the last: the race is released.
  template <class Race, class Drop>
  bool disarm_and_release(Race& r, Drop drop) {
    (void)timer_.cancel(r);
    bool last = false;
    {
      std::lock_guard race_lock(r.mu);
      last = drop();
    }
    if (last) race_released();
    return last;
  }

  // A race block has no owner left: the last thing a loser does with the
  // hedge (the destructor waits for the count to read zero).
  void race_released() { races_.add_release(-1); }

  hedge_options options_;
  Executor& executor_;
  deadline_timer_base& timer_;
  Accept accept_;
  std::unique_ptr<latency_tracker> tracker_;

  detail::sharded_count calls_;  // every call bumps it: per-thread cells
  std::atomic<std::int64_t> hedges_started_{0};
  std::atomic<std::int64_t> hedge_wins_{0};
  std::atomic<std::int64_t> skipped_budget_{0};
  std::atomic<std::int64_t> skipped_executor_{0};
  std::atomic<std::int64_t> skipped_other_{0};
  std::atomic<std::int64_t> refused_writes_{0};
  std::atomic<std::int64_t> cancelled_losers_{0};
  std::atomic<std::int64_t> outstanding_{0};

  // Race blocks not yet released, in per-thread cells: a race armed and
  // released on the caller's thread (a primary that wins) touches no line
  // another thread writes. A loser's release may land in another cell; the
  // sum is exact.
  detail::sharded_count races_;
};

}  // namespace keel
