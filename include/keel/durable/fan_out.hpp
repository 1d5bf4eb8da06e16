// keel/durable/fan_out.hpp — run a worker over a set of units (providers, or
// provider x item) with bounded width, save each valid result the moment it
// arrives, and on a rerun pay only for what is missing.
//
// A comparison across several model providers must not be one
// all-or-nothing write. keel::fan_out gives every unit a deterministic key
// (a keel::digest of what determines it: product facts + model + rubric,
// built with keel::digest_builder) and, for each run:
//
//   1. loads every unit's key from the result store (any keel::result_store:
//      keel::memory_store, keel::sqlite_store, ...). A stored result is
//      reported `cached` and costs no work;
//   2. runs the worker for the rest on the executor, at most `width` at a
//      time, each with its own stop token and the call's remaining deadline
//      (narrowed by unit_at_most), never a fresh one;
//   3. validates each answer (`validator`: an invalid answer is a failure,
//      like a timeout, and is never saved) and saves a valid one at once,
//      on the worker's thread, before the collector moves on;
//   4. stops when the completion rule is met — all units, a quorum of k,
//      the first acceptable, or the best of n by a user score — or when the
//      deadline passes or the call is cancelled. Units still running are
//      asked to stop through their stop tokens; units not yet started are
//      not started. A failed unit never stops the others: what they produce
//      is saved for the next run.
//
// run() returns a report, per unit, in the order given: cached, succeeded,
// failed (the provider's failure: its status and classification), cancelled,
// or missing (no answer produced and none refused by the provider: never
// started for lack of time, still queued in the executor at the deadline, the
// executor refused, or the worker's own status was a keel refusal such as an
// open breaker or a full quota, or a cancellation).
// Successes and failures are kept apart; failures keep their classification.
// A unit cancelled while its worker was running is `outstanding`: its
// upstream work may go on after a local cancel (a worker that returns a
// status marked keel::mark_not_started confirms nothing ran and is not
// outstanding). A cancelled worker that still returns a valid answer has it
// saved (it was paid for), so the next run finds it.
//
// report.status() is OK when the rule was met. With completion::all and
// require_complete (the default) an incomplete panel is an error that names
// exactly which units are missing and why; with require_complete off it is
// returned as a partial panel (OK; the call is marked degraded and its
// `missing` count says how many). report.missing() lists the names.
//
// Progress is reported as events (keel/durable/events.hpp) to the
// environment's listener: every real per-unit state change as it happens —
// events::fan_out_unit_started when a worker starts, then one of
// fan_out_unit_cached, fan_out_unit_finished (succeeded, failed, cancelled)
// or fan_out_unit_missing — and events::fan_out_finished with the run's
// figures; never an invented percentage. Unit events are reported with the
// collector's lock held: one at a time, in order; keep the listener quick
// and do not call back into the collector.
//
// Clock, classifier and listener come from an environment
// (keel/core/environment.hpp): the constructor's, or, when run() is given a
// pipeline stage's run context instead of a call, the run context's. The
// classifier tells a unit's failure (the provider's) from a refusal or a
// cancellation (missing).
//
// Results are bytes in the store: std::string results are stored as they
// are; any other T needs `encode` and `decode` in the options.
//
// Example:
//
//   keel::memory_store store;                       // or keel::sqlite_store
//   keel::bounded_pool pool({.threads = 4});
//   keel::fan_out panel(
//       keel::fan_out_options<std::string>{
//           .width = 3, .validator = [](const std::string& r) { return r.empty() ? absl::InvalidArgumentError("empty")
//                                                                                : absl::OkStatus(); }},
//       store, pool, env);   // env: the service's keel::environment (its listener sees the units)
//   std::vector<keel::unit> units;
//   for (std::string_view model : {"model-a", "model-b", "model-c"})
//     units.push_back({.name = std::string(model),
//                      .key = keel::digest_builder().field("facts", facts).field("model", model)
//                                 .field("rubric", "panel-v3").finish()});
//   keel::call call(keel::real_clock{}.now(), {.timeout = std::chrono::seconds(20)});
//   keel::fan_out_report<std::string> r = panel.run(call, units, [&](const keel::unit_context& u) {
//     keel::call c(keel::real_clock{}.now(), u.call_options());  // the unit's own call
//     return model_pipeline.run(c, [&](const keel::attempt& a) { return ask(u.unit.name, a); });
//   });
//   if (!r.status().ok()) std::puts(std::string(r.status().message()).c_str());   // names what is missing
//
// Workers run on executor threads, several at once: they must be
// thread-safe. They may run whole pipelines (admission, breakers, retries)
// on a keel::call of their own made from unit_context::call_options().
// run() returns only after every worker it started has returned (they use
// the worker and the units by reference).
//
// Thread-safety: run() may be called from many threads at once, each with
// its own call and units; figures() from any thread.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <concepts>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <span>
#include <stop_token>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "keel/core/timer.hpp"
#include "keel/compose/executor.hpp"
#include "keel/core/call.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/condition.hpp"
#include "keel/core/deadline.hpp"
#include "keel/core/environment.hpp"
#include "keel/core/outcome.hpp"
#include "keel/core/policy.hpp"
#include "keel/core/status.hpp"
#include "keel/core/telemetry.hpp"
#include "keel/core/internal/boundary.hpp"
#include "keel/durable/digest.hpp"
#include "keel/durable/events.hpp"
#include "keel/durable/result_store.hpp"

namespace keel {

// One unit of work: a provider, or a provider x item.
struct unit {
  std::string name;      // named in reports ("which providers are missing")
  keel::digest key;      // what determines its result (keel::digest_builder)
  keel::labels labels{}; // for the unit's own call (model, endpoint...); the strings must outlive the run
};

// What a worker is given for one unit.
struct unit_context {
  const keel::unit& unit;
  std::size_t index;        // in the units given to run()
  time_point start{};       // when the collector started it
  keel::deadline deadline;  // the call's work deadline, narrowed by unit_at_most
  std::stop_token stop;     // requested when the rule is met, the call is cancelled or the deadline passes
  keel::call& parent;       // the fan-out's call (its counters are thread-safe)

  // Options for the unit's own keel::call: this deadline, this stop token,
  // the unit's labels and the parent's operation.
  [[nodiscard]] keel::call_options call_options() const {
    return {.deadline = deadline, .stop = stop, .labels = unit.labels, .operation = parent.operation()};
  }
};

// unit_state (pending, running, cached, succeeded, failed, cancelled,
// missing) is in keel/durable/events.hpp.

// When a fan-out is done.
struct completion {
  enum class rule { all, quorum, first_acceptable, best_of };
  rule kind = rule::all;
  int k = 0;  // quorum: successes needed; best_of: successes to choose from

  [[nodiscard]] static constexpr completion all() noexcept { return {rule::all, 0}; }
  [[nodiscard]] static constexpr completion quorum(int k) noexcept { return {rule::quorum, k}; }
  [[nodiscard]] static constexpr completion first_acceptable() noexcept { return {rule::first_acceptable, 1}; }
  [[nodiscard]] static constexpr completion best_of(int n) noexcept { return {rule::best_of, n}; }
};

template <class T>
struct fan_out_options {
  int width = 4;  // units in flight at once, in [1, 1024]
  keel::completion complete_when = completion::all();
  // completion::all: an incomplete panel is an error (false: a partial panel
  // is returned as OK, the call marked degraded).
  bool require_complete = true;
  duration unit_at_most = duration::max();  // per unit, of what is left; > 0
  // Stops each running unit at its deadline through this timer
  // (keel/core/timer.hpp): a unit that watches only its stop
  // token ends then, failed with DeadlineExceeded. Null: units are stopped
  // only when the call's deadline passes, the rule is met or the call is
  // cancelled. The timer must outlive the runs.
  deadline_timer_base* cut = nullptr;
  duration retention = duration::zero();    // saved results expire after this; 0: kept until erased
  std::string key_prefix = "fanout:";       // store key = key_prefix + the unit's digest in hex
  // A stored result that fails the validator (the rules changed): erase it
  // and run the unit again (true), or report the unit failed (false).
  bool replace_invalid_cached = false;
  // Validates an answer; not OK: the unit failed with this status (never
  // saved). Empty: every answer is valid.
  std::function<absl::Status(const T&)> validator{};
  // completion::best_of: higher is better.
  std::function<double(const T&)> score{};
  // Bytes in the store; needed unless T is std::string.
  std::function<std::string(const T&)> encode{};
  std::function<absl::StatusOr<T>(std::string_view)> decode{};

  [[nodiscard]] absl::Status validate() const {
    constexpr std::string_view who = "fan_out_options";
    if (width < 1 || width > 1024) return detail::invalid_field(who, "width", "be in [1, 1024]", width);
    const auto kind = complete_when.kind;
    if ((kind == completion::rule::quorum || kind == completion::rule::best_of) && complete_when.k < 1)
      return detail::invalid_field(who, "complete_when.k", "be >= 1 for quorum and best_of", complete_when.k);
    if (kind == completion::rule::best_of && !score)
      return detail::invalid_field(who, "score", "be set for completion::best_of", "empty");
    if (unit_at_most <= duration::zero()) return detail::invalid_field(who, "unit_at_most", "be > 0", unit_at_most);
    if (retention < duration::zero()) return detail::invalid_field(who, "retention", "be >= 0", retention);
    if constexpr (!std::same_as<T, std::string>) {
      if (!encode) return detail::invalid_field(who, "encode", "be set for a result type other than std::string", "empty");
      if (!decode) return detail::invalid_field(who, "decode", "be set for a result type other than std::string", "empty");
    }
    return absl::OkStatus();
  }
};

// What happened to one unit.
template <class T>
struct unit_result {
  std::string name;                   // the unit's name (a copy: the report outlives the units)
  std::string key;                    // its key in the store
  unit_state state = unit_state::pending;
  std::optional<T> value;             // cached / succeeded (and a cancelled unit's late answer)
  absl::Status status;                // failed / cancelled / missing: why
  std::optional<outcome_kind> kind;   // failed / missing: the classification of `status`
                                      // (missing: refused or cancelled, never a provider's failure)
  bool outstanding = false;           // cancelled while running, not confirmed stopped
  bool saved = false;                 // this run saved its value
  absl::Status save_status;           // a failed save (the value is still reported)
  duration latency{};                 // worker time, for units that ran
};

template <class T>
struct fan_out_report {
  std::vector<unit_result<T>> units;  // in the order given
  keel::completion rule;
  bool require_complete = true;
  bool rule_met = false;
  std::optional<std::size_t> best;    // first_acceptable: the first success; best_of: the best score
  absl::Status refused;               // the run itself was refused (bad units for the rule)

  [[nodiscard]] int count(unit_state s) const noexcept {
    return static_cast<int>(std::count_if(units.begin(), units.end(), [s](const auto& u) { return u.state == s; }));
  }
  [[nodiscard]] int outstanding() const noexcept {
    return static_cast<int>(std::count_if(units.begin(), units.end(), [](const auto& u) { return u.outstanding; }));
  }
  // Units with a usable answer (cached or succeeded).
  [[nodiscard]] int results() const noexcept { return count(unit_state::cached) + count(unit_state::succeeded); }
  [[nodiscard]] bool complete() const noexcept { return results() == static_cast<int>(units.size()); }
  // The names of the units without an answer, in order.
  [[nodiscard]] std::vector<std::string_view> missing() const {
    std::vector<std::string_view> out;
    for (const auto& u : units)
      if (u.state != unit_state::cached && u.state != unit_state::succeeded) out.push_back(u.name);
    return out;
  }

  // OK when the rule was met (and, for completion::all with
  // require_complete, the panel is complete). Otherwise Unavailable
  // (FailedPrecondition only when every unit without an answer failed
  // permanently: a rerun cannot help) naming each missing unit and why.
  [[nodiscard]] absl::Status status() const {
    if (!refused.ok()) return refused;
    const bool partial_ok = rule.kind == completion::rule::all && !require_complete && results() > 0;
    if (rule_met || partial_ok) return absl::OkStatus();
    std::string why;
    bool all_permanent = true;
    int without = 0;
    for (const auto& u : units) {
      if (u.state == unit_state::cached || u.state == unit_state::succeeded) continue;
      ++without;
      // Only a unit that failed permanently makes a rerun pointless; a missing
      // one (refused, not started, cancelled) may well succeed next time.
      if (u.state != unit_state::failed || u.kind != outcome_kind::permanent) all_permanent = false;
      absl::StrAppend(&why, without == 1 ? "" : "; ", u.name, " (", detail::to_absl(to_string(u.state)));
      if (u.kind) absl::StrAppend(&why, ", ", detail::to_absl(to_string(*u.kind)));
      if (!u.status.ok()) absl::StrAppend(&why, ": ", u.status.message());
      absl::StrAppend(&why, ")");
    }
    std::string head;
    if (rule.kind == completion::rule::all) {
      head = absl::StrCat("keel: panel incomplete: ", without, " of ", units.size(), " missing: ");
    } else {
      head = absl::StrCat("keel: completion rule not met (", results(), " of ", rule.k, " needed results); missing: ");
    }
    std::string message = absl::StrCat(head, why);
    return all_permanent && without > 0 ? absl::FailedPreconditionError(message) : absl::UnavailableError(message);
  }
};

// What a collector has done since it was made.
struct fan_out_figures {
  std::int64_t runs = 0;
  std::int64_t cached = 0;       // units answered from the store
  std::int64_t started = 0;      // units handed to the executor
  std::int64_t succeeded = 0;
  std::int64_t failed = 0;         // the provider's failures only
  std::int64_t missing = 0;        // never produced: refused, not started, cancelled before an answer
  std::int64_t cancelled = 0;
  std::int64_t outstanding = 0;  // units cancelled while running, not confirmed stopped
  std::int64_t saved = 0;        // results this collector saved
  std::int64_t save_errors = 0;
};

template <class T, keel::result_store Store, keel::executor Executor, any_environment Env = keel::environment<>>
class fan_out {
 public:
  // Throws keel::invalid_options if `o` is invalid. `env`: the clock, the
  // classifier and the listener of runs given a call.
  fan_out(fan_out_options<T> o, Store& store, Executor& executor, Env env = {})
      : options_((detail::require_valid(o.validate()), std::move(o))),
        store_(store),
        executor_(executor),
        env_(std::move(env)) {}
  fan_out(const fan_out&) = delete;
  fan_out& operator=(const fan_out&) = delete;

  [[nodiscard]] const fan_out_options<T>& options() const noexcept { return options_; }

  [[nodiscard]] fan_out_figures figures() const noexcept {
    auto get = [](const std::atomic<std::int64_t>& a) { return a.load(std::memory_order_relaxed); };
    return {.runs = get(runs_),
            .cached = get(cached_),
            .started = get(started_),
            .succeeded = get(succeeded_),
            .failed = get(failed_),
            .missing = get(missing_),
            .cancelled = get(cancelled_),
            .outstanding = get(outstanding_),
            .saved = get(saved_),
            .save_errors = get(save_errors_)};
  }

  // The store key of a unit: key_prefix + its digest in lower-case hex (one allocation).
  [[nodiscard]] std::string key_of(const unit& u) const {
    static constexpr char digits[] = "0123456789abcdef";
    std::string k;
    k.reserve(options_.key_prefix.size() + 2 * u.key.bytes.size());
    k.append(options_.key_prefix);
    for (const unsigned char b : u.key.bytes) {
      k.push_back(digits[b >> 4]);
      k.push_back(digits[b & 0xf]);
    }
    return k;
  }

  // Runs `worker` (unit_context -> absl::StatusOr<T>) over `units` within
  // `call`'s deadline. Never throws; returns after every started worker
  // has returned.
  template <class Worker>
  [[nodiscard]] fan_out_report<T> run(keel::call& call, std::span<const unit> units, Worker&& worker) {
    return run_in(env_, call, units, worker);
  }

  // The same inside a pipeline stage: ctx.call is the fan-out's call, and
  // the clock, classifier and listener are the run context's (the
  // pipeline's environment), not the constructor's.
  template <class C, class K, class L, class Worker>
  [[nodiscard]] fan_out_report<T> run(run_context<C, K, L>& ctx, std::span<const unit> units, Worker&& worker) {
    return run_in(ctx, ctx.call, units, worker);
  }

 private:
  // `e` is this fan-out's environment or a run context: both have clock,
  // classifier and listener.
  template <class E, class Worker>
  fan_out_report<T> run_in(const E& e, keel::call& call, std::span<const unit> units, Worker& worker) {
    static_assert(std::is_invocable_v<Worker&, const unit_context&>,
                  "a fan_out worker takes const keel::unit_context&");
    static_assert(std::is_convertible_v<std::invoke_result_t<Worker&, const unit_context&>, absl::StatusOr<T>>,
                  "a fan_out worker returns absl::StatusOr<T>");
    runs_.fetch_add(1, std::memory_order_relaxed);
    session<Worker, E> s(*this, e, call, units, worker);
    return s.run();
  }

  template <class Worker, class E>
  struct session {
    using listener_type = std::remove_cvref_t<decltype(std::declval<const E&>().listener)>;

    struct slot {
      std::optional<std::stop_source> stop;
      bool submitted = false;  // handed to the executor, not yet returned
      bool cancel_requested = false;
      bool ran = false;  // its worker started
      time_point start{};
      keel::deadline work{};  // the unit's own; here, not in the task, so the task fits inline
    };

    session(fan_out& o, const E& e, keel::call& c, std::span<const unit> u, Worker& w)
        : owner(o), env(e), call(c), units(u), worker(w), slots(u.size()) {
      call.share_across_threads();  // workers charge it through unit_context::parent
      report.rule = o.options_.complete_when;
      report.require_complete = o.options_.require_complete;
      report.units.resize(u.size());
      success_order.reserve(u.size());
      for (std::size_t i = 0; i < u.size(); ++i) {
        report.units[i].name = u[i].name;
        report.units[i].key = o.key_of(u[i]);
      }
    }

    fan_out_report<T> run() {
      if constexpr (wants<listener_type, events::fan_out_finished>) started_at = env.clock.now();
      const std::size_t n = units.size();
      const int needed = needed_results();
      if (needed > static_cast<int>(n)) {
        report.refused = detail::invalid_field("fan_out", "complete_when.k", "be at most the number of units",
                                               absl::StrCat(needed, " > ", n));
        for (auto& u : report.units) u.state = unit_state::missing;
        report_finished();
        return std::move(report);
      }
      load_cached();

      const keel::deadline work = call.work_deadline();
      std::unique_lock lock(mu);
      std::size_t next = 0;
      enum class end { rule, deadline, cancelled, exhausted } why = end::exhausted;
      for (;;) {
        if (rule_met_locked()) {
          why = end::rule;
          break;
        }
        if (call.stop_token().stop_requested()) {
          why = end::cancelled;
          break;
        }
        const time_point now = env.clock.now();
        if (work.expired(now)) {
          why = end::deadline;
          break;
        }
        while (in_flight < owner.options_.width && next < n) {
          if (report.units[next].state != unit_state::pending) {
            ++next;
            continue;
          }
          if (!submit_locked(lock, next, now, work)) break;  // refused: retry after a completion
          ++next;
        }
        if (in_flight == 0 && !any_pending_locked()) break;  // everything has answered
        const std::uint64_t seen = completions;
        auto ready = [&] { return completions != seen; };
        if (work.is_infinite()) {
          cv.wait(lock, call.stop_token(), ready);
        } else {
          env.clock.wait_until(lock, cv, work.when(), call.stop_token(), ready);
        }
      }
      stop_the_rest_locked(why);
      cv.wait(lock, [&] { return in_flight == 0; });  // they were asked to stop; they use us by reference
      lock.unlock();
      finish_report(why == end::rule || rule_met_now());
      report_finished();
      return std::move(report);
    }

    [[nodiscard]] int needed_results() const {
      const completion& c = owner.options_.complete_when;
      return c.kind == completion::rule::all ? static_cast<int>(units.size()) : c.k;
    }

    void load_cached() {
      for (std::size_t i = 0; i < units.size(); ++i) {
        unit_result<T>& r = report.units[i];
        absl::StatusOr<std::optional<std::string>> stored = owner.store_.load_result(r.key);
        if (!stored.ok() || !stored->has_value()) continue;  // a store error: the unit runs (and reports it if it persists)
        absl::StatusOr<T> value = owner.decode(**stored);
        absl::Status verdict = value.ok() ? owner.check(*value) : std::move(value).status();
        if (verdict.ok()) {
          r.state = unit_state::cached;
          r.value = std::move(*value);
          owner.cached_.fetch_add(1, std::memory_order_relaxed);
          success_order.push_back(i);
          progress_unlocked(i);
          continue;
        }
        if (owner.options_.replace_invalid_cached && owner.store_.erase_result(r.key).ok()) continue;
        r.state = unit_state::failed;
        r.status = annotate(verdict, "keel: stored result fails validation");
        r.kind = classify(r.status);
        owner.failed_.fetch_add(1, std::memory_order_relaxed);
        progress_unlocked(i);
      }
    }

    // Hands unit i to the executor; false when the executor refused and
    // another of ours is still running (try again after it answers).
    bool submit_locked(std::unique_lock<std::mutex>& lock, std::size_t i, time_point now, keel::deadline work) {
      slot& s = slots[i];
      s.work = work.within(now, owner.options_.unit_at_most);
      absl::Status refused;
      for (;;) {
        s.stop.emplace();
        s.submitted = true;
        s.start = now;
        ++in_flight;
        const std::uint64_t seen = completions;
        lock.unlock();
        refused = owner.executor_.try_execute([this, i] { run_unit(i); });
        lock.lock();
        if (refused.ok()) {
          owner.started_.fetch_add(1, std::memory_order_relaxed);
          return true;
        }
        s.submitted = false;
        s.stop.reset();
        --in_flight;
        if (in_flight > 0) return false;  // ours will finish and make room
        // Ours that filled the queue finished while the lock was free: the
        // refusal is stale, and none is left whose answer would retry it.
        if (completions == seen) break;
      }
      unit_result<T>& r = report.units[i];
      r.state = unit_state::missing;
      r.status = annotate(refused, "keel: not started: the executor refused");
      r.kind = classify(r.status);
      owner.missing_.fetch_add(1, std::memory_order_relaxed);
      progress_locked(i);
      return true;
    }

    // On an executor thread.
    void run_unit(std::size_t i) {
      slot& s = slots[i];
      const std::stop_token stop = s.stop->get_token();
      {
        std::lock_guard lock(mu);
        if (!stop.stop_requested()) {
          report.units[i].state = unit_state::running;
          s.ran = true;
          progress_locked(i);
        }
      }
      absl::StatusOr<T> answer = absl::CancelledError("unset");
      if (stop.stop_requested()) {
        // Still queued in the executor when the run ended: never started.
        answer = s.cancel_requested
                     ? mark_not_started(absl::CancelledError("keel: unit cancelled before it started"))
                     : refusal(absl::DeadlineExceededError(
                                   "keel: not started: queued in the executor until no time was left"),
                               "deadline");
      } else {
        const unit_context uc{units[i], i, s.start, s.work, stop, call};
        keel::deadline_cut cut;
        if (owner.options_.cut != nullptr) cut.arm(*owner.options_.cut, s.work, *s.stop);
        answer = cut.settle(invoke(uc), call.stop_token(), [&](const absl::Status& st) { return classify(st); });
      }
      const time_point end = env.clock.now();
      // Moved, not copied: the status goes to the caller's thread, and
      // Debian's libabsl counts references where TSan cannot see it.
      absl::Status verdict = answer.ok() ? owner.check(*answer) : std::move(answer).status();
      bool saved = false;
      absl::Status save_status;
      if (verdict.ok()) {
        // Saved at once, before the collector hears of it: a rerun finds it
        // even if this process dies the next moment.
        const std::string bytes = owner.encode(*answer);
        absl::StatusOr<bool> stored = owner.store_.save_result(report.units[i].key, bytes, owner.options_.retention);
        if (!stored.ok()) {
          save_status = stored.status();
        } else if (*stored) {
          saved = true;
        } else {
          // Another saver was first: report what the store keeps.
          absl::StatusOr<std::optional<std::string>> kept = owner.store_.load_result(report.units[i].key);
          if (kept.ok() && kept->has_value()) {
            absl::StatusOr<T> theirs = owner.decode(**kept);
            if (theirs.ok()) answer = std::move(theirs);
          }
        }
      }
      std::lock_guard lock(mu);
      unit_result<T>& r = report.units[i];
      r.latency = end - s.start;
      r.saved = saved;
      r.save_status = std::move(save_status);
      if (saved) owner.saved_.fetch_add(1, std::memory_order_relaxed);
      if (!r.save_status.ok()) owner.save_errors_.fetch_add(1, std::memory_order_relaxed);
      if (r.outstanding && !verdict.ok() && not_started(verdict)) {
        r.outstanding = false;  // confirmed: nothing ran upstream
        owner.outstanding_.fetch_sub(1, std::memory_order_relaxed);
      }
      if (s.cancel_requested) {
        r.state = unit_state::cancelled;
        if (verdict.ok()) r.value = std::move(*answer);  // paid for, and saved above
      } else if (verdict.ok()) {
        r.state = unit_state::succeeded;
        r.value = std::move(*answer);
        success_order.push_back(i);
        owner.succeeded_.fetch_add(1, std::memory_order_relaxed);
      } else {
        r.status = std::move(verdict);
        r.kind = classify(r.status);
        if (provider_outcome(*r.kind)) {
          r.state = unit_state::failed;
          owner.failed_.fetch_add(1, std::memory_order_relaxed);
        } else {
          // Refused before any work (a breaker open, a quota full, no time
          // left) or cancelled: the unit is missing, not failed.
          r.state = unit_state::missing;
          owner.missing_.fetch_add(1, std::memory_order_relaxed);
        }
      }
      progress_locked(i);
      s.submitted = false;
      --in_flight;
      ++completions;
      cv.notify_all();  // under the lock: the collector may return as soon as it is released
    }

    absl::StatusOr<T> invoke(const unit_context& uc) {
      return detail::call_user<absl::StatusOr<T>>("fan_out worker", worker, uc);
    }

    [[nodiscard]] outcome_kind classify(const absl::Status& s) const {
      return s.ok() ? outcome_kind::success : env.classifier(s, call.operation());
    }

    [[nodiscard]] int results_locked() const {
      int n = 0;
      for (const auto& u : report.units)
        if (u.state == unit_state::cached || u.state == unit_state::succeeded) ++n;
      return n;
    }
    [[nodiscard]] bool rule_met_locked() const { return results_locked() >= needed_results(); }
    [[nodiscard]] bool rule_met_now() {
      std::lock_guard lock(mu);
      return rule_met_locked();
    }
    [[nodiscard]] bool any_pending_locked() const {
      for (const auto& u : report.units)
        if (u.state == unit_state::pending) return true;
      return false;
    }

    void stop_the_rest_locked(auto why) {
      using end = decltype(why);
      int cancelled_running = 0;
      for (std::size_t i = 0; i < units.size(); ++i) {
        unit_result<T>& r = report.units[i];
        slot& s = slots[i];
        if (s.submitted) {
          if (r.state == unit_state::running) {
            r.outstanding = true;  // until it confirms otherwise
            ++cancelled_running;
          }
          // At the deadline a unit's own answer (most likely its timeout) is
          // what it reports; the rule or the caller cancels it.
          if (why != end::deadline) {
            s.cancel_requested = true;
            r.status = why == end::rule ? absl::CancelledError("keel: cancelled: the completion rule was met")
                                        : absl::CancelledError("keel: cancelled: the call was cancelled");
            owner.cancelled_.fetch_add(1, std::memory_order_relaxed);
          }
          s.stop->request_stop();
        } else if (r.state == unit_state::pending) {
          if (why == end::rule) {
            r.state = unit_state::cancelled;
            r.status = absl::CancelledError("keel: not started: the completion rule was met");
            owner.cancelled_.fetch_add(1, std::memory_order_relaxed);
          } else {
            r.state = unit_state::missing;
            r.status = why == end::cancelled
                           ? mark_not_started(absl::CancelledError("keel: not started: the call was cancelled"))
                           : refusal(absl::DeadlineExceededError("keel: not started: no time left"), "deadline");
            r.kind = classify(r.status);
            owner.missing_.fetch_add(1, std::memory_order_relaxed);
          }
          progress_locked(i);
        }
      }
      owner.outstanding_.fetch_add(cancelled_running, std::memory_order_relaxed);
    }

    void finish_report(bool met) {
      report.rule_met = met;
      const completion& c = owner.options_.complete_when;
      if (!success_order.empty()) {
        if (c.kind == completion::rule::first_acceptable) {
          report.best = success_order.front();
        } else if (c.kind == completion::rule::best_of) {
          std::size_t best = success_order.front();
          double best_score = owner.options_.score(*report.units[best].value);
          for (std::size_t i : success_order) {
            if (!report.units[i].value) continue;
            const double sc = owner.options_.score(*report.units[i].value);
            if (sc > best_score) {
              best = i;
              best_score = sc;
            }
          }
          report.best = best;
        }
      }
      if (c.kind == completion::rule::all) {
        const int without = static_cast<int>(units.size()) - report.results();
        if (without > 0) {
          call.note_missing(without);
          if (!report.require_complete && report.results() > 0) call.mark_degraded();
        }
      }
    }

    // Reports unit i's new state to the listener.
    void progress_locked(std::size_t i) {
      const unit_result<T>& r = report.units[i];
      const std::string_view name = r.name;
      switch (r.state) {
        case unit_state::pending:
          return;
        case unit_state::running:
          observe(env.listener, events::fan_out_unit_started{call, name, i});
          return;
        case unit_state::cached:
          observe(env.listener, events::fan_out_unit_cached{call, name, i});
          return;
        case unit_state::missing:
          observe(env.listener, events::fan_out_unit_missing{call, name, i, r.kind.value_or(outcome_kind::refused),
                                                             r.status, slots[i].ran});
          return;
        case unit_state::succeeded:
        case unit_state::failed:
        case unit_state::cancelled: {
          const outcome_kind kind = r.state == unit_state::succeeded   ? outcome_kind::success
                                    : r.state == unit_state::cancelled ? outcome_kind::cancelled
                                                                       : r.kind.value_or(outcome_kind::permanent);
          observe(env.listener, events::fan_out_unit_finished{call, name, i, r.state, kind, r.status, slots[i].ran,
                                                              r.saved, r.outstanding, r.latency});
          return;
        }
      }
    }

    void report_finished() {
      if constexpr (wants<listener_type, events::fan_out_finished>) {
        observe(env.listener, events::fan_out_finished{.call = call,
                                                       .units = static_cast<int>(units.size()),
                                                       .cached = report.count(unit_state::cached),
                                                       .succeeded = report.count(unit_state::succeeded),
                                                       .failed = report.count(unit_state::failed),
                                                       .cancelled = report.count(unit_state::cancelled),
                                                       .missing = report.count(unit_state::missing),
                                                       .outstanding = report.outstanding(),
                                                       .rule_met = report.rule_met,
                                                       .elapsed = env.clock.now() - started_at});
      }
    }
    void progress_unlocked(std::size_t i) {
      std::lock_guard lock(mu);
      progress_locked(i);
    }

    fan_out& owner;
    const E& env;
    keel::call& call;
    std::span<const unit> units;
    Worker& worker;
    std::vector<slot> slots;
    fan_out_report<T> report;
    std::vector<std::size_t> success_order;  // guarded by mu
    std::mutex mu;
    keel::condition cv;
    int in_flight = 0;            // guarded by mu
    std::uint64_t completions = 0;  // guarded by mu
    time_point started_at{};        // read only when the listener wants fan_out_finished
  };

  [[nodiscard]] absl::Status check(const T& value) const {
    return options_.validator ? options_.validator(value) : absl::OkStatus();
  }
  [[nodiscard]] std::string encode(const T& value) const {
    if constexpr (std::same_as<T, std::string>) {
      return options_.encode ? options_.encode(value) : value;
    } else {
      return options_.encode(value);
    }
  }
  [[nodiscard]] absl::StatusOr<T> decode(std::string_view bytes) const {
    if constexpr (std::same_as<T, std::string>) {
      return options_.decode ? options_.decode(bytes) : absl::StatusOr<T>(std::string(bytes));
    } else {
      return options_.decode(bytes);
    }
  }

  fan_out_options<T> options_;
  Store& store_;
  Executor& executor_;
  Env env_;
  std::atomic<std::int64_t> runs_{0};
  std::atomic<std::int64_t> cached_{0};
  std::atomic<std::int64_t> started_{0};
  std::atomic<std::int64_t> succeeded_{0};
  std::atomic<std::int64_t> failed_{0};
  std::atomic<std::int64_t> missing_{0};
  std::atomic<std::int64_t> cancelled_{0};
  std::atomic<std::int64_t> outstanding_{0};
  std::atomic<std::int64_t> saved_{0};
  std::atomic<std::int64_t> save_errors_{0};
};

}  // namespace keel
