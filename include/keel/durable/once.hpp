// keel/durable/once.hpp — one decision per request on top of any idempotency
// store (keel/durable/idempotency.hpp has the store contract).
//
// keel::once runs a provider at most once per logical request on top of any
// such store: duplicates in flight wait for the first within their deadline
// or get "retry later" (keel::in_flight_error) — never a second provider
// call; a retry after a lost response replays the decision with its id; a
// failed provider either removes the record or stores the failure; a replay
// under a newer policy revision replays, conflicts or decides again.
//
// Example:
//
//   keel::sqlite_store<>& store = ...;                    // keel/store/sqlite.hpp
//   const auto env = keel::environment<>{}.with_listener(listener);   // the service's, built once
//   keel::once decide(store, {.lease = 30s, .retention = 24h, .retry_window = 1h,
//                             .policy_revision = "receipts-v4"}, env);
//   keel::request_identity id{.tenant = "merchant-82", .endpoint = "receipts", .key = "key-47"};
//   keel::digest request = keel::digest_builder().field("receipt", canonical_receipt).finish();
//   absl::StatusOr<keel::once_result> r = decide.run(call, id, request,
//       [&](const keel::claim_context& c) -> absl::StatusOr<keel::decision> {
//         absl::StatusOr<std::string> verdict = ask_the_model(c.deadline, c.stop);
//         if (!verdict.ok()) return verdict.status();
//         return keel::decision{.model_digest = "m-large@sha256:1f0c", .result = *verdict};
//       });
//   // r->decision.id is the same on every retry; r->replayed says it was stored.
//   // keel::is_conflict(r.status()): same key, other contents.
//   // keel::is_in_flight(r.status()): still being decided; retry after the hint.
//
// Time, classification and events come from an environment
// (keel/core/environment.hpp): the one given to the constructor
// (keel::once decide(store, options, env)), or, when run() is given a
// pipeline stage's run context instead of a call, the run context's, so one
// environment configures the pipeline and the decision inside it. The
// classifier decides which provider failures are stored
// (idempotency_options::remember_failures) and which are unresolved.
//
// Events (keel/durable/events.hpp): events::idempotency_begin for each
// answer of the store's begin() acted on, and a keep-alive keeper's
// events::lease_lost.
//
// Thread-safety: keel::once::run may be called from any number of threads
// at once; stores are thread-safe (and the durable ones process-safe).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <stop_token>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "keel/core/call.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/deadline.hpp"
#include "keel/core/environment.hpp"
#include "keel/core/outcome.hpp"
#include "keel/core/policy.hpp"
#include "keel/core/status.hpp"
#include "keel/core/telemetry.hpp"
#include "keel/core/internal/boundary.hpp"
#include "keel/durable/digest.hpp"
#include "keel/durable/events.hpp"
#include "keel/durable/idempotency.hpp"
#include "keel/durable/lease.hpp"
#include "keel/durable/ownership.hpp"
#include "keel/policy/backoff.hpp"

namespace keel {

// ---------------------------------------------------------------------------
// keel::once
// ---------------------------------------------------------------------------

// A duplicate arriving while the first request is in flight:
enum class on_duplicate {
  wait,         // wait for the first within the call's deadline, then replay its decision
  retry_later,  // answer at once with keel::in_flight_error (retry-after = the holder's lease)
};

// Which of the provider's failures keel::once stores as the key's answer,
// by outcome kind (keel/core/outcome.hpp). A stored failure is replayed to every
// retry until retention ends; a forgotten one frees the key, so a retry
// decides afresh. Two kinds are never stored, whatever this says: a refusal
// (keel declined before any work: an open breaker, a full quota, no time
// left) and a cancellation; nothing ran, so a retry must be free to run.
struct failure_memory {
  bool permanent = true;   // bad input, bad credential: the same request fails the same way
  bool transient = false;
  bool throttled = false;
  // An ambiguous failure (the write may have been applied) of a repeatable
  // operation (a read, or an idempotent write). For a non-repeatable write it
  // is always kept, as an unresolved record, until keel::once::resolve()
  // settles it: running it again could apply it twice.
  bool ambiguous = false;
};

// The settlement of an unresolved record (keel::once::resolve).
enum class settlement {
  applied,      // the effect happened: store the decision given; retries replay it
  not_applied,  // it did not: free the key; the next request decides afresh
};

// A replay meets a decision made under another policy revision:
enum class on_policy_change {
  replay,        // replay it anyway
  conflict,      // refuse: keel::conflict_error
  decide_again,  // supersede it: the provider runs once more, under the current revision
};

struct idempotency_options {
  // How long a claim holds the record in flight; > 0. A provider that may
  // run longer needs keep_alive (or its deadline is cut to the lease).
  duration lease = std::chrono::seconds(30);
  // How long a record (and so a replay) lives; must exceed lease and retry_window.
  duration retention = std::chrono::hours(24);
  // How long clients may retry a request (the API's documented retry window); >= 0.
  duration retry_window = std::chrono::hours(1);
  keel::on_duplicate on_duplicate = keel::on_duplicate::wait;
  keel::failure_memory remember_failures{};
  keel::on_policy_change on_policy_change = keel::on_policy_change::replay;
  // The policy in force, stored with each new decision; <= 255 bytes, and
  // non-empty when on_policy_change is conflict or decide_again.
  std::string policy_revision{};
  // Renew the in-flight lease from a background thread while the provider
  // runs (every lease/3). Off: the provider's deadline ends at the lease.
  bool keep_alive = false;
  // Waiting on a store that cannot notify: first poll after poll_initial,
  // doubling up to poll_max (each drawn with jitter), never past the
  // holder's lease or the deadline.
  duration poll_initial = std::chrono::milliseconds(5);
  duration poll_max = std::chrono::milliseconds(250);

  [[nodiscard]] absl::Status validate() const {
    constexpr std::string_view who = "idempotency_options";
    if (lease <= duration::zero()) return detail::invalid_field(who, "lease", "be > 0", lease);
    if (retry_window < duration::zero()) return detail::invalid_field(who, "retry_window", "be >= 0", retry_window);
    if (retention <= lease)
      return detail::invalid_field(who, "retention", "exceed lease",
                                   detail::describe(retention) + " <= " + detail::describe(lease));
    if (retention <= retry_window)
      return detail::invalid_field(who, "retention", "exceed retry_window",
                                   detail::describe(retention) + " <= " + detail::describe(retry_window));
    if (policy_revision.size() > max_key_bytes)
      return detail::invalid_field(who, "policy_revision", "be at most 255 bytes", policy_revision.size());
    if (policy_revision.empty() && on_policy_change != keel::on_policy_change::replay)
      return detail::invalid_field(who, "policy_revision",
                                   "be set when on_policy_change is conflict or decide_again", "\"\"");
    if (poll_initial <= duration::zero()) return detail::invalid_field(who, "poll_initial", "be > 0", poll_initial);
    if (poll_max < poll_initial)
      return detail::invalid_field(who, "poll_max", "be >= poll_initial",
                                   detail::describe(poll_max) + " < " + detail::describe(poll_initial));
    return absl::OkStatus();
  }
};

// What the provider is handed when its request owns the record.
struct claim_context {
  std::string_view decision_id;  // minted for this claim; kept if the provider leaves decision.id empty
  keel::ownership ownership{};   // pass ownership.fence to systems that check fencing tokens
  bool took_over = false;        // an earlier holder's lease expired: it may have half-run
  keel::deadline deadline{};     // the call's work deadline (cut to the lease without keep_alive)
  std::stop_token stop{};        // the call's stop, or the lease lost (keep_alive)
};

struct once_result {
  keel::decision decision{};
  bool replayed = false;    // a stored decision: no provider call was made for this request
  std::int64_t fence = 0;   // the claim that decided
};

template <idempotency_store Store, any_environment Env = keel::environment<>>
class once {
 public:
  // Throws keel::invalid_options if `o` is invalid. `env` gives the clock,
  // the classifier of the provider's failures and the listener (pass the
  // service's: the one its pipelines run in).
  once(Store& store, idempotency_options o, Env env = {})
      : store_(store), options_(std::move(o)), env_(std::move(env)) {
    detail::require_valid(options_.validate());
  }

  [[nodiscard]] const idempotency_options& options() const noexcept { return options_; }

  // Decides `request` under `id` at most once. `provider` is called as
  // provider(const claim_context&) -> absl::StatusOr<keel::decision> only
  // when this call claims the record; it leaves decision.id empty to use the
  // minted one and policy_revision empty to use the options'.
  //
  // Returns the decision (replayed or fresh), or:
  //   keel::is_conflict       same key, other digest (or policy revision, if so configured)
  //   keel::is_in_flight      a duplicate is in flight and waiting was not allowed or the
  //                           deadline ran out (not started; retry after the hint)
  //   keel::is_lost_ownership the provider ran but another claimant took over first;
  //                           its decision stands (begin again to replay it)
  //   keel::is_unknown_outcome the commit failed in the store: the decision may be
  //                           stored; begin again to find out — never assume it is not
  //   the provider's failure  (stored or forgotten per remember_failures), or a stored failure replayed
  //   keel::is_unresolved     an earlier attempt's write may or may not have been applied;
  //                           nothing runs until resolve() settles it
  //   Cancelled (not started) the call was cancelled while waiting
  template <class Provider>
  absl::StatusOr<once_result> run(keel::call& call, const request_identity& id, const digest& request,
                                  Provider&& provider) const {
    return run_in(env_, call, id, request, provider);
  }

  // The same inside a pipeline stage: ctx.call is the call, and the clock,
  // classifier and listener are the run context's (the pipeline's
  // environment), not the constructor's.
  template <class C, class K, class L, class Provider>
  absl::StatusOr<once_result> run(run_context<C, K, L>& ctx, const request_identity& id, const digest& request,
                                  Provider&& provider) const {
    return run_in(ctx, ctx.call, id, request, provider);
  }

  // Settles an unresolved record (an earlier attempt failed ambiguously:
  // keel::is_unresolved) once the caller has found out, from the system the
  // write went to, whether it was applied:
  //   settlement::applied      `applied` becomes the key's decision (its id
  //                            defaults to the unresolved attempt's, its
  //                            policy revision to the options'); retries replay it.
  //   settlement::not_applied  the key is freed; the next request decides afresh.
  // Returns OK when this call settled it; FailedPrecondition when there is
  // nothing to settle (no record, or it is decided or already settled);
  // is_in_flight / is_conflict as run() does; a store error as it is.
  // The record is reclaimed with a fence above every earlier one, so a
  // resolver that loses the race to another finds it settled. Two resolvers
  // of one key under different policy revisions can still both act when a
  // fresh decision lands between one's check and its claim: settle a key
  // from one place.
  [[nodiscard]] absl::Status resolve(const request_identity& id, const digest& request, settlement how,
                                     decision applied = {}) const {
    if (absl::Status v = id.validate(); !v.ok()) return v;
    if (how == settlement::applied) {
      // Checked before the record is touched: a refused settlement leaves it unresolved.
      if (applied.policy_revision.empty()) applied.policy_revision = options_.policy_revision;
      applied.error_code = absl::StatusCode::kOk;
      applied.error_message.clear();
      if (applied.policy_revision == unresolved_revision)
        return absl::InvalidArgumentError("keel: a settled decision may not use the unresolved policy revision");
      decision probe = applied;
      if (probe.id.empty()) probe.id = "the unresolved attempt's id";
      if (absl::Status v = probe.validate(); !v.ok()) return annotate(v, "keel: the settled decision is invalid");
    }
    const owner_id me = owner_id::random();
    begin_options bo{.lease = options_.lease, .retention = options_.retention};
    auto nothing = [&](std::string_view why) {
      return absl::FailedPreconditionError(absl::StrCat("keel: nothing to settle for ", describe(id), ": ",
                                                        detail::to_absl(why)));
    };
    absl::StatusOr<begin_outcome> seen = store_.begin(id, request, me, bo);
    if (!seen.ok()) return seen.status();
    switch (seen->state) {
      case begin_state::claimed:
        (void)store_.abandon(id, seen->ownership);  // there was no record: leave none
        return nothing("no record");
      case begin_state::in_flight:
        return in_flight_error(describe(id), seen->lease_remaining);
      case begin_state::conflict:
        return conflict_error(absl::StrCat("key '", detail::to_absl(id.key), "' was used for a different request"));
      case begin_state::replay:
        if (!seen->decision.unresolved()) return nothing("it is decided");
        break;
    }
    // Reclaim it: supersede succeeds because the stored revision is the
    // reserved unresolved one; a record settled meanwhile is replayed instead.
    bo.supersede_revision = options_.policy_revision.empty() ? std::string_view("keel:settled")
                                                             : std::string_view(options_.policy_revision);
    absl::StatusOr<begin_outcome> claim = store_.begin(id, request, me, bo);
    if (!claim.ok()) return claim.status();
    if (claim->state == begin_state::replay) return nothing("already settled");
    if (claim->state == begin_state::in_flight) return in_flight_error(describe(id), claim->lease_remaining);
    if (claim->state == begin_state::conflict)
      return conflict_error(absl::StrCat("key '", detail::to_absl(id.key), "' was used for a different request"));
    if (!claim->superseded) {
      (void)store_.abandon(id, claim->ownership);
      return nothing("the record expired");
    }
    if (how == settlement::not_applied) return store_.abandon(id, claim->ownership);
    if (applied.id.empty()) applied.id = seen->decision.id;
    return store_.commit(id, claim->ownership, applied, options_.retention);
  }

 private:
  // `e` is this once's environment or a run context: both have clock,
  // classifier and listener.
  template <class E, class Provider>
  absl::StatusOr<once_result> run_in(const E& e, keel::call& call, const request_identity& id,
                                     const digest& request, Provider& provider) const {
    if (absl::Status v = id.validate(); !v.ok()) return v;
    const owner_id me = owner_id::random();
    const begin_options bo{
        .lease = options_.lease,
        .retention = options_.retention,
        .supersede_revision = options_.on_policy_change == on_policy_change::decide_again
                                  ? std::string_view(options_.policy_revision)
                                  : std::string_view()};
    duration poll = options_.poll_initial;
    for (;;) {
      const time_point sent = e.clock.now();
      absl::StatusOr<begin_outcome> r = store_.begin(id, request, me, bo);
      if (!r.ok()) return r.status();
      observe(e.listener, events::idempotency_begin{id, r->state});
      switch (r->state) {
        case begin_state::claimed:
          return decide(e, call, id, *r, sent, provider);
        case begin_state::replay:
          return replay(call, id, std::move(*r));
        case begin_state::conflict:
          return conflict_error(absl::StrCat("key '", detail::to_absl(id.key), "' was used for a different request (",
                                             r->conflict_in_flight ? "in flight" : "committed", ")"));
        case begin_state::in_flight:
          break;
      }
      if (options_.on_duplicate == on_duplicate::retry_later)
        return in_flight_error(describe(id), r->lease_remaining);
      const time_point now = e.clock.now();
      const deadline end = call.work_deadline();
      if (end.expired(now)) return in_flight_error(describe(id), r->lease_remaining);
      const duration jittered = detail::uniform(thread_local_random{}, poll / 2, poll);
      // Wake no later than the holder's lease end (a lapsed lease is taken
      // over by the first poller) and the deadline.
      const time_point wake =
          std::min(end.when(), now + std::min(jittered, r->lease_remaining + std::chrono::milliseconds(1)));
      if constexpr (notifying_store<Store>) {
        store_.wait_for_change(id, wake - now, call.stop_token());
      } else {
        e.clock.sleep_until(wake, call.stop_token());
      }
      if (call.stop_token().stop_requested())
        return mark_not_started(absl::CancelledError("keel: cancelled while waiting for an in-flight duplicate"));
      poll = std::min(poll * 2, options_.poll_max);
    }
  }

  static std::string describe(const request_identity& id) {
    return absl::StrCat("request '", detail::to_absl(id.tenant), "/", detail::to_absl(id.endpoint), "/",
                        detail::to_absl(id.key), "'");
  }

  absl::StatusOr<once_result> replay(keel::call& call, const request_identity& id, begin_outcome r) const {
    if (options_.on_policy_change == on_policy_change::conflict &&
        r.decision.policy_revision != options_.policy_revision) {
      return conflict_error(absl::StrCat("decided under policy revision '", r.decision.policy_revision,
                                         "', now '", options_.policy_revision, "'"));
    }
    call.mark_replayed();
    if (r.decision.unresolved())
      return unresolved_error(absl::StrCat(describe(id), " (attempt ", r.decision.id, ")"), r.decision.error_message);
    if (r.decision.failed()) return r.decision.error();
    return once_result{.decision = std::move(r.decision), .replayed = true, .fence = r.ownership.fence};
  }

  template <class E, class Provider>
  absl::StatusOr<once_result> decide(const E& e, keel::call& call, const request_identity& id,
                                     const begin_outcome& claim, time_point sent, Provider& provider) const {
    const ownership token = claim.ownership;
    const std::string minted = absl::StrCat("dec-", owner_id::random().hex());
    std::stop_source stop;
    std::stop_callback forward(call.stop_token(), [&] { stop.request_stop(); });
    const deadline lease_end = deadline::at(sent + options_.lease);
    const claim_context ctx{
        .decision_id = minted,
        .ownership = token,
        .took_over = claim.took_over,
        .deadline = options_.keep_alive ? call.work_deadline() : call.work_deadline().earliest(lease_end),
        .stop = stop.get_token()};

    absl::StatusOr<decision> made = absl::UnknownError("keel: provider did not run");
    {
      using keeper_env = std::remove_cvref_t<decltype(environment_of(e))>;
      std::optional<lease_keeper<keeper_env>> keeper;
      if (options_.keep_alive) {
        keeper.emplace(
            describe(id), [&](duration ttl) { return store_.extend(id, token, ttl); }, stop, sent,
            lease_keeper_options{.ttl = options_.lease}, environment_of(e));
      }
      made = detail::call_user<absl::StatusOr<decision>>("provider", provider, ctx);
    }  // the keeper stops here; the commit's fence check decides whether we still own the record

    if (made.ok()) {
      decision d = std::move(*made);
      if (d.id.empty()) d.id = minted;
      if (d.policy_revision.empty()) d.policy_revision = options_.policy_revision;
      if (d.policy_revision == unresolved_revision) {
        (void)store_.abandon(id, token);
        return absl::InvalidArgumentError(absl::StrCat("keel: the provider's decision uses the reserved policy revision '",
                                                       detail::to_absl(unresolved_revision), "'"));
      }
      d.error_code = absl::StatusCode::kOk;
      d.error_message.clear();
      if (absl::Status v = d.validate(); !v.ok()) {
        (void)store_.abandon(id, token);
        return annotate(v, "keel: the provider's decision is invalid");
      }
      if (absl::Status s = commit(e, call, id, token, d); !s.ok()) return s;
      return once_result{.decision = std::move(d), .replayed = false, .fence = token.fence};
    }

    const absl::Status failure = made.status();
    const outcome_kind kind = e.classifier(failure, call.operation());
    const bool unresolved = kind == outcome_kind::ambiguous && !call.operation().repeatable();
    if (unresolved) {
      // Kept, never re-run: a retry gets keel::is_unresolved until resolve().
      decision d{.id = minted,
                 .policy_revision = std::string(unresolved_revision),
                 .error_code = absl::StatusCode::kUnknown,
                 .error_message = std::string(failure.message())};
      if (absl::Status s = commit(e, call, id, token, d); !s.ok()) return s;
      return unresolved_error(absl::StrCat(describe(id), " (attempt ", minted, ")"), detail::to_std(failure.message()));
    }
    if (remembered(kind)) {
      decision d{.id = minted,
                 .policy_revision = options_.policy_revision,
                 .error_code = failure.code(),
                 .error_message = std::string(failure.message())};
      if (absl::Status s = commit(e, call, id, token, d); !s.ok()) return s;
    } else {
      // If this fails the record stays in flight until its lease ends; then
      // a retry takes it over. Either way the provider's failure is the answer.
      (void)store_.abandon(id, token);
    }
    return failure;
  }

  [[nodiscard]] bool remembered(outcome_kind k) const noexcept {
    const failure_memory& m = options_.remember_failures;
    switch (k) {
      case outcome_kind::permanent: return m.permanent;
      case outcome_kind::transient: return m.transient;
      case outcome_kind::throttled: return m.throttled;
      case outcome_kind::ambiguous: return m.ambiguous;
      case outcome_kind::success:
      case outcome_kind::refused:
      case outcome_kind::cancelled: return false;
    }
    return false;
  }

  // Commits; a commit the store says was not applied is repeated (it is
  // fenced and idempotent) while the deadline allows.
  template <class E>
  absl::Status commit(const E& e, keel::call& call, const request_identity& id, const ownership& token,
                      const decision& d) const {
    duration pause = options_.poll_initial;
    for (;;) {
      absl::Status s = store_.commit(id, token, d, options_.retention);
      if (s.ok() || !not_started(s)) return s;
      const time_point now = e.clock.now();
      if (call.work_deadline().remaining(now) <= pause) return s;
      e.clock.sleep_until(now + pause, {});
      pause = std::min(pause * 2, options_.poll_max);
    }
  }

  // What a keep-alive keeper owns a copy of: the environment itself, or a run context's.
  static const Env& environment_of(const Env& e) noexcept { return e; }
  template <class C, class K, class L>
  static keel::environment<C, K, L> environment_of(const run_context<C, K, L>& ctx) {
    return ctx.env();
  }

  Store& store_;
  idempotency_options options_;
  Env env_;
};

}  // namespace keel
