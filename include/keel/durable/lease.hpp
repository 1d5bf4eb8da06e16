// keel/durable/lease.hpp — a fenced work lease: one owner at a time for a unit of
// work, across threads, processes and (with a shared store) machines.
//
// A lease has a work key, a random 128-bit owner (keel::owner_id), an expiry
// on the store's clock and a fencing token that strictly increases every time
// the key changes hands. The store contract (keel::lease_store):
//
//   claim(work_key, owner, ttl) -> absl::StatusOr<lease_claim>
//       Atomically: if nobody holds the key, or the holder's lease has
//       expired, or `owner` already holds it, the caller gets it for `ttl`
//       (acquired = true). A new holder gets fence = previous fence + 1; a
//       key the store has no lease for (never seen, or purged) gets a fence
//       above every fence it ever had (docs/stores.md, rule 4), so fences
//       never go backwards. `owner` claiming again keeps its fence (a lost
//       reply can be retried). took_over says the previous holder's
//       lease had expired without a release: its work may have half-run.
//       Otherwise acquired = false, with the holder's fence and the time
//       left on its lease.
//   renew(work_key, ownership, ttl) -> absl::Status
//       If (owner, fence) is the current holder: expiry = max(expiry,
//       now + ttl) — a renewal never shortens a lease — and OK. Otherwise
//       keel::lost_ownership and nothing changes. A lease that expired but
//       was not taken over is still the holder's and may be renewed.
//   release(work_key, ownership) -> absl::Status
//       If (owner, fence) is the current holder, frees the key (the next
//       claim gets fence + 1 at once) and OK. Repeating a successful release
//       is OK and changes nothing. Otherwise keel::lost_ownership.
//
// Each operation is one atomic step in the store (one transaction or one
// statement or script) and costs one round trip. Time is the store's: no
// operation takes the caller's clock. Store faults surface as statuses:
// keel::store_unavailable_error when nothing was applied, otherwise
// keel::unknown_outcome_error (see keel/durable/ownership.hpp and docs/stores.md).
//
// On top of the contract:
//
//   lease_keeper   renews a lease in the background while work runs; when a
//                  renewal is refused (lost ownership) or cannot be confirmed
//                  before the lease would run out, it requests stop on the
//                  work's stop_source and keeps the reason (status()).
//   run_leased()   claim, then check the result store (a previous holder may
//                  have finished before its lease expired), run the work
//                  under a keeper, save the result (first write wins),
//                  release. The seed's "when a lease expires, recheck the
//                  result cache before starting again".
//
// Example:
//
//   keel::sqlite_store<>& store = ...;   // a lease_store and a result_store
//   absl::StatusOr<keel::leased_result> r = keel::run_leased(
//       store, store, "nightly:2025-10-06", "nightly-result:2025-10-06", {.ttl = std::chrono::seconds(30)},
//       [&](std::stop_token stop, const keel::ownership& lease) -> absl::StatusOr<std::string> {
//         return build_report(stop, lease.fence);   // pass the fence on to systems that check it
//       });
//   // r->cached: an earlier holder had already saved it; in-flight: keel::is_in_flight(r.status())
//
// Time and events come from an environment (keel/core/environment.hpp):
// a keeper waits on env.clock and reports to env.listener.
// Events (keel/durable/events.hpp): events::lease_lost when a keeper gives up.
//
// Thread-safety: lease stores are safe from many threads. A lease_keeper's
// status()/lost() may be read from any thread; it is stopped and joined by
// its destructor. run_leased may run concurrently for any keys.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <concepts>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <stop_token>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "keel/core/clock.hpp"
#include "keel/core/outcome.hpp"
#include "keel/core/status.hpp"
#include "keel/core/environment.hpp"
#include "keel/core/telemetry.hpp"
#include "keel/durable/events.hpp"
#include "keel/durable/ownership.hpp"
#include "keel/durable/result_store.hpp"

namespace keel {

// What claim() answers.
struct lease_claim {
  bool acquired = false;
  // acquired: your token (your owner, the new fence). Otherwise the holder's
  // fence (its owner is not disclosed).
  keel::ownership ownership{};
  // acquired: the previous holder's lease had expired without a release.
  bool took_over = false;
  // acquired: the ttl granted. Otherwise: time left on the holder's lease.
  duration remaining{};
};

template <class S>
concept lease_store = requires(S& s, std::string_view work_key, const owner_id& owner, const ownership& token,
                               duration ttl) {
  { s.claim(work_key, owner, ttl) } -> std::same_as<absl::StatusOr<lease_claim>>;
  { s.renew(work_key, token, ttl) } -> std::same_as<absl::Status>;
  { s.release(work_key, token) } -> std::same_as<absl::Status>;
};

struct lease_keeper_options {
  // Requested at each renewal; > 0.
  duration ttl = std::chrono::seconds(30);
  // Time between renewals; zero means ttl / 3. Must be below ttl.
  duration renew_every = duration::zero();
  // The keeper gives up (and stops the work) when it has not confirmed a
  // renewal and less than this remains of the last confirmed lease; zero
  // means ttl / 10. Must be below ttl.
  duration margin = duration::zero();

  [[nodiscard]] absl::Status validate() const {
    if (ttl <= duration::zero()) return detail::invalid_field("lease_keeper_options", "ttl", "be > 0", ttl);
    if (renew_every < duration::zero() || renew_every >= ttl)
      return detail::invalid_field("lease_keeper_options", "renew_every", "be in [0, ttl)", renew_every);
    if (margin < duration::zero() || margin >= ttl)
      return detail::invalid_field("lease_keeper_options", "margin", "be in [0, ttl)", margin);
    return absl::OkStatus();
  }
  [[nodiscard]] duration effective_renew_every() const noexcept {
    return renew_every > duration::zero() ? renew_every : ttl / 3;
  }
  [[nodiscard]] duration effective_margin() const noexcept { return margin > duration::zero() ? margin : ttl / 10; }
};

// Renews a held lease from a background thread until destroyed or stopped.
//
// `renew` is called with the ttl and returns the store's answer (for a lease:
// [&](keel::duration ttl) { return store.renew(key, token, ttl); }; the
// idempotency helper renews an in-flight record the same way). `confirmed`
// is when the current lease was granted, on the keeper's clock, read
// *before* the claim was sent, so the keeper's idea of the lease end is never
// later than the store's.
//
// On a refused renewal (keel::lost_ownership, or any permanent error) the
// keeper stops at once. A transient failure is retried every renew_every / 4
// until the last confirmed lease is within `margin` of its end; then the
// keeper gives up. Giving up means: status() becomes the reason,
// work.request_stop() is called, events::lease_lost is reported.
template <any_environment Env = keel::environment<>>
class lease_keeper {
 public:
  using renew_fn = std::function<absl::Status(duration ttl)>;

  // Throws keel::invalid_options if `o` is invalid. `env` gives the clock
  // (also `confirmed`'s) and the listener; the keeper's thread owns a copy.
  lease_keeper(std::string work_key, renew_fn renew, std::stop_source work, time_point confirmed,
               const lease_keeper_options& o, Env env = {})
      : key_(std::move(work_key)),
        renew_(std::move(renew)),
        work_(std::move(work)),
        options_((detail::require_valid(o.validate()), o)),
        env_(std::move(env)),
        thread_([this, confirmed](std::stop_token stop) { loop(stop, confirmed); }) {}

  ~lease_keeper() { stop(); }
  lease_keeper(const lease_keeper&) = delete;
  lease_keeper& operator=(const lease_keeper&) = delete;

  // Stops renewing (does not release the lease). Idempotent.
  void stop() {
    if (thread_.joinable()) {
      thread_.request_stop();
      thread_.join();
    }
  }

  // OK while the lease is held; the reason once the keeper gave up.
  [[nodiscard]] absl::Status status() const {
    std::lock_guard lock(mu_);
    return status_;
  }
  [[nodiscard]] bool lost() const noexcept { return lost_.load(std::memory_order_acquire); }
  // Successful renewals so far.
  [[nodiscard]] int renewals() const noexcept { return renewals_.load(std::memory_order_relaxed); }

 private:
  void loop(std::stop_token stop, time_point confirmed) {
    const duration every = options_.effective_renew_every();
    const duration margin = options_.effective_margin();
    time_point held_until = confirmed + options_.ttl;
    time_point next = confirmed + every;
    while (!stop.stop_requested()) {
      if (!env_.clock.sleep_until(std::min(next, held_until - margin), stop)) return;
      const time_point sent = env_.clock.now();
      absl::Status s;
      try {
        s = renew_(options_.ttl);
      } catch (const std::exception& e) {
        s = absl::UnknownError(absl::StrCat("keel: lease renewal threw: ", e.what()));
      }
      if (s.ok()) {
        renewals_.fetch_add(1, std::memory_order_relaxed);
        held_until = sent + options_.ttl;
        next = sent + every;
        continue;
      }
      // The store's answer, in keel's own status vocabulary (docs/stores.md):
      // the default classifier reads it, not the service's provider classifier.
      const outcome_kind kind = default_classifier{}(s, operation{.effect = effect::write, .idempotent = true});
      if (is_lost_ownership(s) || kind == outcome_kind::permanent) return give_up(std::move(s));
      const time_point now = env_.clock.now();
      if (now >= held_until - margin) {
        return give_up(annotate(s, absl::StrCat("keel: could not renew lease '", key_,
                                                "' before it would run out")));
      }
      next = now + std::max(every / 4, duration(std::chrono::milliseconds(1)));
    }
  }

  void give_up(absl::Status why) {
    {
      std::lock_guard lock(mu_);
      status_ = std::move(why);
    }
    lost_.store(true, std::memory_order_release);
    work_.request_stop();
    absl::Status copy = status();
    observe(env_.listener, events::lease_lost{key_, copy});
  }

  std::string key_;
  renew_fn renew_;
  std::stop_source work_;
  lease_keeper_options options_;
  Env env_;
  mutable std::mutex mu_;
  absl::Status status_;
  std::atomic<bool> lost_{false};
  std::atomic<int> renewals_{0};
  std::jthread thread_;  // last: starts after everything it uses exists
};

struct leased_work_options {
  // The lease asked for; renewed every ttl/3 while the work runs; > 0.
  duration ttl = std::chrono::seconds(30);
  // Zero: ttl / 3 (see lease_keeper_options).
  duration renew_every = duration::zero();
  // How long a saved result is kept; zero: until erased.
  duration result_retention = duration::zero();

  [[nodiscard]] absl::Status validate() const {
    if (ttl <= duration::zero()) return detail::invalid_field("leased_work_options", "ttl", "be > 0", ttl);
    if (renew_every < duration::zero() || renew_every >= ttl)
      return detail::invalid_field("leased_work_options", "renew_every", "be in [0, ttl)", renew_every);
    if (result_retention < duration::zero())
      return detail::invalid_field("leased_work_options", "result_retention", "be >= 0", result_retention);
    return absl::OkStatus();
  }
};

struct leased_result {
  std::string value{};
  // The value was already in the result store (saved by an earlier holder,
  // or by a concurrent one that won the save): no work ran for it here.
  bool cached = false;
  // The lease was taken over from a holder whose lease had expired.
  bool took_over = false;
  keel::ownership ownership{};
};

// Runs `work` at most once at a time per work key, and not at all when its
// result is already saved.
//
//   1. claim(work_key). Held by someone else: keel::in_flight_error with the
//      holder's remaining time as retry-after (not started).
//   2. load_result(result_key): present -> release, return it (cached).
//   3. run work(stop_token, ownership) under a lease_keeper; the stop token
//      fires when `stop` does or when the lease is lost.
//   4. lost lease: return the keeper's reason; nothing is saved (a stale
//      owner changes nothing).
//   5. failure: release, return the failure.
//   6. save_result (first write wins; if another holder's value is already
//      there, that value is returned, cached = true), then release.
//
// `work` returns absl::StatusOr<std::string>; exceptions become
// absl::UnknownError. Invalid options: InvalidArgument, nothing claimed.
// `env` gives the clock the lease is measured on and the keeper's listener.
template <lease_store Leases, result_store Results, class Work, any_environment Env = keel::environment<>>
absl::StatusOr<leased_result> run_leased(Leases& leases, Results& results, std::string_view work_key,
                                         std::string_view result_key, const leased_work_options& o, Work&& work,
                                         const Env& env = {}, std::stop_token stop = {}) {
  if (absl::Status v = o.validate(); !v.ok()) return v;
  if (absl::Status v = validate_key("result key", result_key); !v.ok()) return v;
  const owner_id me = owner_id::random();
  const time_point sent = env.clock.now();
  absl::StatusOr<lease_claim> c = leases.claim(work_key, me, o.ttl);
  if (!c.ok()) return c.status();
  if (!c->acquired) return in_flight_error(absl::StrCat("lease '", detail::to_absl(work_key), "'"), c->remaining);
  const ownership token = c->ownership;
  auto release = [&] { return leases.release(work_key, token); };

  absl::StatusOr<std::optional<std::string>> cached = results.load_result(result_key);
  if (!cached.ok()) {
    (void)release();
    return cached.status();
  }
  if (cached->has_value()) {
    (void)release();
    return leased_result{.value = std::move(**cached), .cached = true, .took_over = c->took_over, .ownership = token};
  }

  std::stop_source work_stop;
  std::stop_callback forward(stop, [&] { work_stop.request_stop(); });
  absl::StatusOr<std::string> r = absl::UnknownError("keel: work did not run");
  absl::Status lost;
  {
    lease_keeper<Env> keeper(
        std::string(work_key), [&](duration ttl) { return leases.renew(work_key, token, ttl); }, work_stop, sent,
        {.ttl = o.ttl, .renew_every = o.renew_every}, env);
    try {
      r = std::invoke(work, work_stop.get_token(), token);
    } catch (const std::exception& e) {
      r = absl::UnknownError(absl::StrCat("keel: leased work threw: ", e.what()));
    } catch (...) {
      r = absl::UnknownError("keel: leased work threw");
    }
    keeper.stop();
    if (keeper.lost()) lost = keeper.status();
  }
  if (!lost.ok()) return lost;
  if (!r.ok()) {
    (void)release();
    return r.status();
  }
  absl::StatusOr<bool> saved = results.save_result(result_key, *r, o.result_retention);
  if (!saved.ok()) {
    (void)release();
    return saved.status();
  }
  leased_result out{.value = std::move(*r), .cached = false, .took_over = c->took_over, .ownership = token};
  if (!*saved) {  // another holder saved first: theirs is the result
    absl::StatusOr<std::optional<std::string>> theirs = results.load_result(result_key);
    if (theirs.ok() && theirs->has_value()) {
      out.value = std::move(**theirs);
      out.cached = true;
    }
  }
  // A release refused here means the lease lapsed and was taken over after
  // the save; the saved result stands (first write wins), so it is returned.
  (void)release();
  return out;
}

}  // namespace keel
