// keel/policy/admission.hpp — multi-level quotas, admitted all-or-nothing before
// any expensive work starts.
//
// A request is admitted only if every level admits it: its tenant's quota
// and its model's quota, each of which may limit
//
//   rate         requests per second, with a burst (a lock-free token
//                bucket, keel/policy/rate_limiter.hpp)
//   in flight    requests running at once
//   queued       requests admitted as queued work (batch jobs waiting for a
//                worker) that have not started yet
//   compute      caller-defined units per window (for model calls: tokens).
//                A request reserves an estimate up front; reconcile() settles
//                the actual cost afterwards, refunding the difference or
//                charging the excess. The budget is a token bucket holding
//                `compute_budget` units and refilling that many per
//                `compute_window`.
//
// Levels are taken in a fixed order and any refusal rolls back everything
// already taken (tokens refunded, slots released), so no level keeps a
// reservation when another refuses. The same holds for levels further in:
// when a later level refuses the admitted request before any work started
// (keel::shared_quota, a bulkhead, a breaker), ticket.roll_back() gives
// everything back, rate tokens included; the policy does this itself.
//
// Refusal is absl::ResourceExhaustedError, marked not-started, with
// refused-by "<level>:<key>:<limit>" (for example "tenant:acme:rate") and a
// retry-after hint (when the bucket will hold the request; for in-flight
// and queued limits, options.busy_retry_after).
//
// A replay (an answer served from a cache or an idempotency record) spends
// no model capacity but counts toward its tenant's request rate: admit it
// with kind = request_kind::replay.
//
// Example:
//
//   keel::admission quotas({
//       .tenant_defaults = {.rate = 20, .burst = 40, .max_in_flight = 8, .compute_budget = 200'000},
//       .model_defaults = {.max_in_flight = 64},
//       .tenants = {{"acme", {.rate = 100, .max_in_flight = 32}}},
//   });
//   keel::time_point now = keel::real_clock{}.now();
//   absl::StatusOr<keel::admission_ticket> t =
//       quotas.admit({.tenant = "acme", .model = "m-large", .estimate = 1200}, now);
//   if (!t.ok()) return t.status();      // ResourceExhausted, refused-by, retry-after
//   int used = run_model();              // tokens actually used
//   t->reconcile(used, keel::real_clock{}.now());
//   // the in-flight slots are released when the ticket goes out of scope
//
// As a policy (keel::pipeline(quotas, ...)) it admits each pass from the
// call's tenant and model labels, as a replay when the call is marked
// replayed, and reconciles the compute estimate against the cost the
// attempts charged to the call (keel::attempt::charge). A pass that comes
// back marked not started with no attempt begun and no cost charged (a
// level further in refused it: keel::shared_quota, a bulkhead, a breaker,
// no time left) did no work, so admission rolls it back: the request counts
// nowhere, not even toward its rate. Use
// quotas.with_estimate(f) to reserve f(call) units per call. Place it
// first inside keel::fallback (the seed's order: fallback, admission,
// bulkhead, time_limit, hedge, retry, ...), so refusal comes before any
// expensive work. Its refusal is keel's (outcome_kind::refused), so the
// fallback outside may then serve a degraded answer: where a tenant over its
// quota must get nothing, give the alternative a gate or put admission
// outside the fallback.
//
// Keys are bounded: each level keeps at most max_keys quotas besides its
// configured overrides. When the table is full, a new key reclaims the keys
// that are idle — nothing in flight or queued and every bucket full again, so
// forgetting them loses nothing: a returning tenant gets exactly the quota it
// would have had. If none is idle (every key in use), the new key is refused
// with limit table_full (refused-by "tenant:<key>:table_full", retry-after
// when the first key will be idle), counted in table_full_refusals() and
// reported to the listener like any refusal; it never shares another key's
// quota. A level whose defaults set no limit keeps no keys besides its
// overrides.
//
// Thread-safety: every operation may be called from any thread. Lookups
// and admission are lock-free once a key is in the table (a ticket pins its
// key: one atomic add, one subtract on release); a new key takes the level's
// mutex and allocates once, and when the table is full it is scanned for
// idle keys at most once per retry-after. A ticket may be reconciled or
// released on any thread, once.
#pragma once

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "keel/core/call.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/policy.hpp"
#include "keel/core/status.hpp"
#include "keel/core/telemetry.hpp"
#include "keel/policy/internal/keyed_table.hpp"
#include "keel/policy/internal/short_key.hpp"
#include "keel/policy/events.hpp"
#include "keel/policy/rate_limiter.hpp"

namespace keel {

// The limits of one key (one tenant, or one model). nullopt: no limit.
struct quota_limits {
  std::optional<double> rate = std::nullopt;              // requests per second, > 0
  std::optional<double> burst = std::nullopt;             // requests at once, >= 1; default max(1, rate)
  std::optional<int> max_in_flight = std::nullopt;        // >= 1
  std::optional<int> max_queued = std::nullopt;           // >= 1
  std::optional<std::int64_t> compute_budget = std::nullopt;  // units per compute_window, >= 1
  duration compute_window = std::chrono::minutes(1);      // > 0, at most 1e8 s

  [[nodiscard]] bool any() const noexcept {
    return rate || max_in_flight || max_queued || compute_budget;
  }

  [[nodiscard]] absl::Status validate(std::string_view who) const {
    if (rate && !(*rate > 0.0 && *rate <= 1e9)) return detail::invalid_field(who, "rate", "be in (0, 1e9]", *rate);
    if (burst && !rate) return detail::invalid_field(who, "burst", "come with a rate", *burst);
    if (burst && !(*burst >= 1.0 && *burst <= 1e12)) return detail::invalid_field(who, "burst", "be in [1, 1e12]", *burst);
    if (max_in_flight && *max_in_flight < 1)
      return detail::invalid_field(who, "max_in_flight", "be >= 1", *max_in_flight);
    if (max_queued && *max_queued < 1) return detail::invalid_field(who, "max_queued", "be >= 1", *max_queued);
    if (compute_budget && *compute_budget < 1)
      return detail::invalid_field(who, "compute_budget", "be >= 1", *compute_budget);
    if (compute_window <= duration::zero() || compute_window > std::chrono::seconds(100'000'000))
      return detail::invalid_field(who, "compute_window", "be in (0, 1e8 s]", compute_window);
    if (compute_budget && static_cast<double>(*compute_budget) / std::chrono::duration<double>(compute_window).count() > 1e9)
      return detail::invalid_field(who, "compute_budget", "refill at most 1e9 units per second", *compute_budget);
    return absl::OkStatus();
  }
};

enum class request_kind : std::uint8_t {
  fresh,   // new work: every limit applies
  replay,  // served from a cache or idempotency record: only the tenant's rate applies
};

class admission_key;

struct admission_request {
  std::string_view tenant{};
  std::string_view model{};
  // Keys resolved ahead (admission::tenant_key / model_key): used instead of
  // the names above, with no lookup and no pin per request.
  const admission_key* tenant_key = nullptr;
  const admission_key* model_key = nullptr;
  // Compute units reserved up front (settled by reconcile()); >= 0.
  std::int64_t estimate = 0;
  request_kind kind = request_kind::fresh;
  // Admit as queued work: hold a queued slot until start() moves it in flight.
  bool queued = false;
};

struct admission_options {
  // Limits of every tenant / model without an override.
  quota_limits tenant_defaults{};
  quota_limits model_defaults{};
  // Overrides, by key; they replace the defaults for that key.
  std::vector<std::pair<std::string, quota_limits>> tenants{};
  std::vector<std::pair<std::string, quota_limits>> models{};
  // Keys per level besides the overrides; in [1, 1048576].
  int max_keys = 10000;
  // The retry-after hint of an in-flight or queued refusal; > 0.
  duration busy_retry_after = std::chrono::milliseconds(100);

  [[nodiscard]] absl::Status validate() const {
    constexpr std::string_view who = "admission_options";
    absl::Status s = tenant_defaults.validate("admission_options.tenant_defaults");
    if (!s.ok()) return s;
    s = model_defaults.validate("admission_options.model_defaults");
    if (!s.ok()) return s;
    for (const auto& [what, list] : {std::pair{"tenants", &tenants}, std::pair{"models", &models}}) {
      for (std::size_t i = 0; i < list->size(); ++i) {
        for (std::size_t j = 0; j < i; ++j)
          if ((*list)[j].first == (*list)[i].first)
            return detail::invalid_field(who, absl::StrCat(what, "[", i, "]"), "name its key once", (*list)[i].first);
        s = (*list)[i].second.validate(absl::StrCat(detail::to_absl(who), ".", what, "[", (*list)[i].first, "]"));
        if (!s.ok()) return s;
      }
    }
    if (max_keys < 1 || max_keys > (1 << 20)) return detail::invalid_field(who, "max_keys", "be in [1, 1048576]", max_keys);
    if (busy_retry_after <= duration::zero())
      return detail::invalid_field(who, "busy_retry_after", "be > 0", busy_retry_after);
    return absl::OkStatus();
  }
};

// One key's usage at a moment.
struct quota_figures {
  int in_flight = 0;
  int queued = 0;
  double rate_available = 0.0;     // requests the bucket holds (0 without a rate limit)
  double compute_available = 0.0;  // units the budget holds (negative while in debt)
};

namespace detail {

// One key's limits and state.
class quota {
 public:
  // `pin_count`: the entry's pins when the key may be reclaimed, else null.
  quota(std::string k, const quota_limits& l, std::atomic<std::int64_t>* pin_count = nullptr)
      : max_in_flight(l.max_in_flight.value_or(0)),
        max_queued(l.max_queued.value_or(0)),
        pins(pin_count),
        key(std::move(k)) {
    if (l.rate) rate.emplace(rate_limiter_options{.rate = *l.rate, .burst = l.burst.value_or(std::max(1.0, *l.rate))});
    if (l.compute_budget) {
      const double budget = static_cast<double>(*l.compute_budget);
      compute.emplace(rate_limiter_options{.rate = budget, .per = l.compute_window, .burst = budget});
      compute_budget = *l.compute_budget;
    }
  }

  // Takes one in-flight (or queued) slot if the limit allows; true when
  // taken or unlimited.
  bool take(bool queued_slot) noexcept {
    std::atomic<int>& n = queued_slot ? queued : in_flight;
    const int max = queued_slot ? max_queued : max_in_flight;
    if (max == 0) return true;
    int v = n.load(std::memory_order_relaxed);
    while (v < max) {
      if (n.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel)) return true;
    }
    return false;
  }
  void give(bool queued_slot) noexcept {
    if ((queued_slot ? max_queued : max_in_flight) != 0) {
      (queued_slot ? queued : in_flight).fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  // A key from traffic is pinned by each lookup and ticket using it; it is
  // reclaimed only unpinned. Configured overrides are never reclaimed.
  void unpin() noexcept {
    if (pins != nullptr) pins->fetch_sub(1, std::memory_order_release);
  }

  // How long until this quota is as a new one would be (zero: now), given
  // nothing holds it: every bucket full again.
  [[nodiscard]] duration until_fresh(time_point now) const noexcept {
    std::int64_t ns = 0;
    for (const std::optional<rate_limiter>* b : {&rate, &compute}) {
      if (!*b) continue;
      const rate_limiter_options& o = (*b)->options();
      const double interval_ns = std::chrono::duration<double, std::nano>(o.per).count() / o.rate;
      const double missing_ns = (o.burst - (*b)->available(now)) * interval_ns;
      // Under a microsecond short is full: the rounding of the bucket's depth.
      if (missing_ns >= 1000.0) ns = std::max(ns, static_cast<std::int64_t>(missing_ns));
    }
    return std::chrono::duration_cast<duration>(std::chrono::nanoseconds(ns));
  }

  // Hot fields first, so an admission touches as few cache lines as it can.
  std::atomic<int> in_flight{0};
  std::atomic<int> queued{0};
  int max_in_flight;
  int max_queued;
  std::atomic<std::int64_t>* pins;
  std::optional<rate_limiter> rate;
  std::optional<rate_limiter> compute;
  std::int64_t compute_budget = 0;
  std::string key;  // as refusals name it
};

}  // namespace detail

class admission;

// A tenant or model resolved once, per call site or per client session:
// requests through it skip the level's lookup (a hash and a chain walk) and
// the pin each request would otherwise take on the key. It holds the key
// pinned, so it is never reclaimed while the handle lives. Move-only; it
// must not outlive its admission.
class admission_key {
 public:
  admission_key() noexcept = default;
  admission_key(admission_key&& o) noexcept
      : owner_(std::exchange(o.owner_, nullptr)), quota_(std::exchange(o.quota_, nullptr)), model_(o.model_) {}
  admission_key& operator=(admission_key&& o) noexcept {
    if (this != &o) {
      reset();
      owner_ = std::exchange(o.owner_, nullptr);
      quota_ = std::exchange(o.quota_, nullptr);
      model_ = o.model_;
    }
    return *this;
  }
  admission_key(const admission_key&) = delete;
  admission_key& operator=(const admission_key&) = delete;
  ~admission_key() { reset(); }

  // False for a moved-from or default key.
  [[nodiscard]] explicit operator bool() const noexcept { return owner_ != nullptr; }
  // The level limits nothing for this key (no quota is kept for it).
  [[nodiscard]] bool unlimited() const noexcept { return quota_ == nullptr; }

 private:
  friend class admission;
  void reset() noexcept {
    if (quota_ != nullptr) quota_->unpin();
    quota_ = nullptr;
    owner_ = nullptr;
  }
  const admission* owner_ = nullptr;
  detail::quota* quota_ = nullptr;  // null: the level does not apply to the key
  bool model_ = false;              // which level it belongs to
};

// What one admitted request holds. Move-only. Destroying it releases its
// in-flight or queued slots; a ticket still queued (never started) also
// refunds its compute estimate, a started one keeps it unless reconciled.
class admission_ticket {
 public:
  admission_ticket() noexcept = default;
  admission_ticket(admission_ticket&& o) noexcept { take(o); }
  admission_ticket& operator=(admission_ticket&& o) noexcept {
    if (this != &o) {
      release();
      take(o);
    }
    return *this;
  }
  admission_ticket(const admission_ticket&) = delete;
  admission_ticket& operator=(const admission_ticket&) = delete;
  ~admission_ticket() { release(); }

  [[nodiscard]] explicit operator bool() const noexcept { return live_; }
  [[nodiscard]] bool queued() const noexcept { return queued_; }
  [[nodiscard]] std::int64_t estimate() const noexcept { return estimate_; }

  // Moves a queued ticket in flight at every level, all-or-nothing. When an
  // in-flight limit is full the ticket stays queued and the refusal says
  // which. OK (and nothing happens) for a ticket already in flight.
  absl::Status start();

  // Settles the compute reservation with the actual cost: refunds what the
  // estimate over-reserved, charges the excess at `now`. Once; later calls
  // do nothing.
  void reconcile(std::int64_t actual, time_point now) noexcept {
    if (!live_ || settled_) return;
    settled_ = true;
    settle(tenant_, actual, now);
    settle(model_, actual, now);
  }

  // The work will not happen: releases the slots and refunds the estimate.
  // The request still counted toward the rate.
  void cancel() noexcept {
    if (!live_) return;
    if (!settled_) reconcile(0, time_point{});
    release();
  }

  // Another level of an all-or-nothing admission refused the request after
  // this one admitted it (a keel::shared_quota, a bulkhead, a breaker), so
  // nothing ran: gives back everything the admission took, the rate tokens
  // too, as if it had never been admitted. Call it before reconcile(); a
  // ticket once rolled back, cancelled or released does nothing.
  void roll_back() noexcept {
    if (!live_) return;
    if (tenant_ != nullptr && tenant_->rate) tenant_->rate->refund();
    if (model_ != nullptr && model_->rate) model_->rate->refund();
    cancel();
  }

 private:
  friend class admission;

  void settle(detail::quota* q, std::int64_t actual, time_point now) noexcept {
    if (q == nullptr || !q->compute || estimate_ == 0) return;
    if (actual < estimate_) {
      q->compute->refund(static_cast<double>(estimate_ - actual));
    } else if (actual > estimate_) {
      q->compute->charge(now, static_cast<double>(actual - estimate_));
    }
  }

  void release() noexcept {
    if (!live_) return;
    live_ = false;
    if (queued_ && !settled_) {
      settled_ = true;
      settle(tenant_, 0, time_point{});
      settle(model_, 0, time_point{});
    }
    if (tenant_ != nullptr && holds_slot_) tenant_->give(queued_);
    if (model_ != nullptr && holds_slot_) model_->give(queued_);
    // Last: after this the key may be reclaimed. A key resolved ahead is
    // pinned by its admission_key, not by the ticket.
    if (tenant_ != nullptr && pinned_tenant_) tenant_->unpin();
    if (model_ != nullptr && pinned_model_) model_->unpin();
  }

  void take(admission_ticket& o) noexcept {
    tenant_ = o.tenant_;
    model_ = o.model_;
    estimate_ = o.estimate_;
    live_ = std::exchange(o.live_, false);
    queued_ = o.queued_;
    holds_slot_ = o.holds_slot_;
    settled_ = o.settled_;
    pinned_tenant_ = o.pinned_tenant_;
    pinned_model_ = o.pinned_model_;
    owner_ = o.owner_;
  }

  detail::quota* tenant_ = nullptr;  // null: the level does not apply
  detail::quota* model_ = nullptr;
  std::int64_t estimate_ = 0;        // reserved at every level with a compute budget
  const admission* owner_ = nullptr;
  bool live_ = false;
  bool queued_ = false;
  bool holds_slot_ = false;          // fresh requests hold in-flight/queued slots
  bool settled_ = false;
  bool pinned_tenant_ = true;        // the ticket pinned its tenant's key itself
  bool pinned_model_ = true;
};

// No compute reservation: admission_policy's default estimator.
struct no_estimate {
  constexpr std::int64_t operator()(const call&) const noexcept { return 0; }
};

// No key resolved ahead: the tenant comes from the call's label.
struct no_tenant_key {
  constexpr const admission_key* operator()(const call&) const noexcept { return nullptr; }
};

template <class Estimator, class TenantKey = no_tenant_key>
class admission_policy;

class admission {
 public:
  // Throws keel::invalid_options if `o` is invalid.
  explicit admission(admission_options o)
      : options_((detail::require_valid(o.validate()), std::move(o))),
        tenants_("tenant", options_.tenant_defaults, options_.tenants, options_),
        models_("model", options_.model_defaults, options_.models, options_) {}
  admission(const admission&) = delete;
  admission& operator=(const admission&) = delete;

  [[nodiscard]] const admission_options& options() const noexcept { return options_; }

  // Why a request was refused.
  struct refusal_reason {
    std::string_view level;  // "tenant" or "model"
    std::string_view key;    // views the request's tenant or model
    quota_limit limit = quota_limit::rate;
    std::optional<duration> retry_after;
    bool never = false;      // the estimate exceeds the whole compute budget
  };

  // Admits `r` at `now` at every level, or refuses with nothing held.
  [[nodiscard]] absl::StatusOr<admission_ticket> admit(const admission_request& r, time_point now) {
    refusal_reason why;
    admission_ticket t = try_admit(r, now, why);
    if (t) return t;
    return refusal(why);
  }

  // The same, without building a status: on refusal the ticket is empty and
  // `why` says which limit refused. Allocates only for a key not seen before.
  [[nodiscard]] admission_ticket try_admit(const admission_request& r, time_point now, refusal_reason& why) {
    const bool fresh = r.kind == request_kind::fresh;
    const bool queued = fresh && r.queued;
    const std::int64_t estimate = fresh ? std::max<std::int64_t>(0, r.estimate) : 0;
    detail::quota* t = nullptr;
    detail::quota* m = nullptr;
    const bool t_ahead = resolved(r.tenant_key, false);
    const bool m_ahead = resolved(r.model_key, true);

    // Each step either takes its reservation or undoes all earlier ones.
    auto refuse = [&](const level& lv, quota_limit limit, std::optional<duration> after, bool never = false) {
      const bool is_tenant = &lv == &tenants_;
      // A handle's key stays pinned (its name with it); a looked-up one may
      // be reclaimed once unpinned below, so name it by the request's view.
      const detail::quota* ahead = is_tenant ? (t_ahead ? t : nullptr) : (m_ahead ? m : nullptr);
      why = {lv.name, ahead != nullptr ? std::string_view(ahead->key) : is_tenant ? r.tenant : r.model, limit, after,
             never};
      if (t != nullptr && !t_ahead) t->unpin();
      if (m != nullptr && !m_ahead) m->unpin();
      return admission_ticket();
    };
    if (t_ahead) {
      t = r.tenant_key->quota_;
    } else if (tenants_.active) {
      duration full{};
      t = tenants_.acquire(r.tenant, now, full);
      if (full > duration::zero()) return refuse(tenants_, quota_limit::table_full, full);
    }
    if (!fresh) {
      // A replay spends no model capacity.
    } else if (m_ahead) {
      m = r.model_key->quota_;
    } else if (models_.active) {
      duration full{};
      m = models_.acquire(r.model, now, full);
      if (full > duration::zero()) return refuse(models_, quota_limit::table_full, full);
    }
    if (t != nullptr && t->rate) {
      if (rate_decision d = t->rate->try_acquire(now); !d) return refuse(tenants_, quota_limit::rate, d.retry_after);
    }
    if (m != nullptr && m->rate) {
      if (rate_decision d = m->rate->try_acquire(now); !d) {
        if (t != nullptr && t->rate) t->rate->refund();
        return refuse(models_, quota_limit::rate, d.retry_after);
      }
    }
    auto undo_rates = [&] {
      if (t != nullptr && t->rate) t->rate->refund();
      if (m != nullptr && m->rate) m->rate->refund();
    };
    const quota_limit slot = queued ? quota_limit::queued : quota_limit::in_flight;
    if (fresh) {
      if (t != nullptr && !t->take(queued)) {
        undo_rates();
        return refuse(tenants_, slot, options_.busy_retry_after);
      }
      if (m != nullptr && !m->take(queued)) {
        undo_rates();
        if (t != nullptr) t->give(queued);
        return refuse(models_, slot, options_.busy_retry_after);
      }
    }
    auto undo_slots = [&] {
      if (!fresh) return;
      if (t != nullptr) t->give(queued);
      if (m != nullptr) m->give(queued);
    };
    if (estimate > 0) {
      for (int i = 0; i < 2; ++i) {
        detail::quota* q = i == 0 ? t : m;
        if (q == nullptr || !q->compute) continue;
        const level& lv = i == 0 ? tenants_ : models_;
        const bool never = estimate > q->compute_budget;
        rate_decision d = never ? rate_decision{} : q->compute->try_acquire(now, static_cast<double>(estimate));
        if (!d) {
          if (i == 1 && t != nullptr && t->compute) t->compute->refund(static_cast<double>(estimate));
          undo_slots();
          undo_rates();
          return refuse(lv, quota_limit::compute, never ? std::nullopt : std::optional(d.retry_after), never);
        }
      }
    }
    admission_ticket ticket;
    ticket.tenant_ = t;
    ticket.model_ = m;
    ticket.estimate_ = estimate;
    ticket.owner_ = this;
    ticket.live_ = true;
    ticket.queued_ = queued;
    ticket.holds_slot_ = fresh;
    ticket.pinned_tenant_ = !t_ahead;
    ticket.pinned_model_ = !m_ahead;
    return ticket;
  }

  // Resolves a tenant (or model) once, for requests that pass the handle in
  // admission_request::tenant_key (model_key) or through for_model(). The
  // key is pinned while the handle lives. Refused (table_full) only when
  // the level's table is full of keys in use.
  [[nodiscard]] absl::StatusOr<admission_key> tenant_key(std::string_view tenant, time_point now) {
    return resolve(tenants_, tenant, now, false);
  }
  [[nodiscard]] absl::StatusOr<admission_key> model_key(std::string_view model, time_point now) {
    return resolve(models_, model, now, true);
  }

  // The status for a refusal (allocates: refusal paths only).
  [[nodiscard]] static absl::Status refusal(const refusal_reason& why) {
    const std::string refused_by =
        absl::StrCat(detail::to_absl(why.level), ":", detail::to_absl(why.key), ":", detail::to_absl(to_string(why.limit)));
    absl::Status s = absl::ResourceExhaustedError(
        why.never ? absl::StrCat("keel: ", detail::to_absl(why.level), " '", detail::to_absl(why.key),
                                 "': the compute estimate exceeds the whole budget")
                  : absl::StrCat("keel: ", detail::to_absl(why.level), " '", detail::to_absl(why.key), "' is over its ",
                                 detail::to_absl(to_string(why.limit)), " quota"));
    if (why.retry_after) s = with_retry_after(std::move(s), *why.retry_after);
    s = with_refused_by(mark_not_started(std::move(s)), refused_by);
    // An estimate larger than the budget can never be admitted: not retryable.
    return why.never ? with_outcome(std::move(s), outcome_kind::permanent) : s;
  }

  // Usage of one tenant / model, if it is in the table (overrides always are).
  [[nodiscard]] std::optional<quota_figures> tenant_figures(std::string_view key, time_point now) const {
    return tenants_.usage(key, now);
  }
  [[nodiscard]] std::optional<quota_figures> model_figures(std::string_view key, time_point now) const {
    return models_.usage(key, now);
  }
  // Keys each level holds besides its overrides (at most max_keys).
  [[nodiscard]] std::int64_t tenant_keys() const noexcept { return tenants_.size.load(std::memory_order_relaxed); }
  [[nodiscard]] std::int64_t model_keys() const noexcept { return models_.size.load(std::memory_order_relaxed); }
  // Requests refused with table_full, at either level.
  [[nodiscard]] std::int64_t table_full_refusals() const noexcept {
    return tenants_.refused.load(std::memory_order_relaxed) + models_.refused.load(std::memory_order_relaxed);
  }
  // Idle keys forgotten to make room for new ones, at either level.
  [[nodiscard]] std::int64_t keys_reclaimed() const noexcept {
    return tenants_.reclaimed.load(std::memory_order_relaxed) + models_.reclaimed.load(std::memory_order_relaxed);
  }

  // A policy reserving estimator(call) compute units per call.
  template <class Estimator>
  [[nodiscard]] admission_policy<Estimator> with_estimate(Estimator estimator);

  // A policy for one call site's model, resolved ahead (model_key()): the
  // tenant still comes from the call's label. `model` must outlive it.
  [[nodiscard]] admission_policy<no_estimate> for_model(const admission_key& model);

  // The policy: admit the pass (estimate 0), run it, release.
  template <class Ctx, class Next>
  auto execute(Ctx& ctx, const attempt_plan& plan, Next& next) -> decltype(next(ctx, plan)) {
    return run(ctx, plan, next, 0);
  }

  template <class Ctx, class Next>
  auto run(Ctx& ctx, const attempt_plan& plan, Next& next, std::int64_t estimate, const admission_key* model = nullptr,
           const admission_key* tenant = nullptr) -> decltype(next(ctx, plan)) {
    using R = decltype(next(ctx, plan));
    const labels& l = ctx.call.labels();
    const call_record before = ctx.call.record();
    refusal_reason why;
    admission_ticket ticket = try_admit({.tenant = l.tenant,
                                         .model = l.model,
                                         .tenant_key = tenant,
                                         .model_key = model,
                                         .estimate = estimate,
                                         .kind = before.replayed ? request_kind::replay : request_kind::fresh},
                                        plan.now, why);
    if (!ticket) {
      observe(ctx.listener, events::admission_refused{ctx.call, why.level, why.key, why.limit});
      return R(refusal(why));
    }
    R r = next(ctx, plan);
    if (const absl::Status& s = status_of(r); !s.ok() && not_started(s)) {
      // Refused further in (or out of time) before any attempt began: all or
      // nothing, so this level keeps nothing either.
      const call_record after = ctx.call.record();
      if (after.attempts == before.attempts && after.cost == before.cost) {
        ticket.roll_back();
        return r;
      }
    }
    if (ticket.estimate() > 0) ticket.reconcile(ctx.call.record().cost - before.cost, plan.now);
    return r;
  }

 private:
  friend class admission_ticket;
  struct level;

  // A key handle of this admission and of the expected level; any other is
  // ignored (the request's name is looked up instead).
  [[nodiscard]] bool resolved(const admission_key* k, bool model) const noexcept {
    return k != nullptr && k->owner_ == this && k->model_ == model;
  }

  absl::StatusOr<admission_key> resolve(level& lv, std::string_view name, time_point now, bool model) {
    admission_key k;
    if (lv.active) {
      duration full{};
      k.quota_ = lv.acquire(name, now, full);
      if (full > duration::zero()) return refusal({lv.name, name, quota_limit::table_full, full});
    }
    k.owner_ = this;
    k.model_ = model;
    return k;
  }

  struct level {
    level(std::string_view n, const quota_limits& d, const std::vector<std::pair<std::string, quota_limits>>& overrides,
          const admission_options& o)
        : name(n),
          defaults(d),
          limited(d.any()),
          active(d.any() || std::any_of(overrides.begin(), overrides.end(), [](const auto& e) { return e.second.any(); })),
          max_keys(o.max_keys),
          busy_retry_after(o.busy_retry_after),
          fixed(overrides.size()),
          // Chains of one entry or so: at most max_keys keys in 2 * max_keys
          // buckets (one, for a level that keeps no keys).
          mask(d.any() ? std::bit_ceil(static_cast<std::size_t>(o.max_keys) * 2) - 1 : 0),
          buckets(std::make_unique<std::atomic<entry*>[]>(mask + 1)) {
      for (const auto& entry : overrides) {
        const std::string& key = entry.first;
        const quota_limits& limits = entry.second;
        (void)fixed.find_or_insert(
            detail::key_hash(key, seed), [&](const std::string& k) { return detail::key_equals(k, key); },
            [&] { return key; }, [&] { return detail::quota(key, limits); });
      }
    }

    // The quota of `key`, pinned until unpin() when reclaimable; null when
    // the level has no limit for it, or when the table is full of keys in
    // use (then `full` is the retry-after hint, > 0).
    detail::quota* acquire(std::string_view key, time_point now, duration& full) {
      const std::size_t h = detail::key_hash(key, seed);  // one hash for both tables
      if (detail::quota* q = override_of(key, h)) return q;
      if (!limited) return nullptr;
      if (detail::quota* q = find_pinned(key, h)) return q;
      return insert(key, h, now, full);
    }

    [[nodiscard]] std::optional<quota_figures> usage(std::string_view key, time_point now) const {
      const std::size_t h = detail::key_hash(key, seed);
      if (const detail::quota* q = override_of(key, h)) return usage_of(*q, now);
      if (!limited) return std::nullopt;
      std::lock_guard lock(mu);  // no key is reclaimed while we read it
      const entry* e = chain_find(key, h);
      if (e == nullptr) return std::nullopt;
      return usage_of(*e->q, now);
    }

    std::string_view name;
    quota_limits defaults;
    bool limited;  // the defaults limit something: keys besides the overrides are kept
    bool active;
    int max_keys;
    duration busy_retry_after;
    std::atomic<std::int64_t> size{0};
    std::atomic<std::int64_t> refused{0};
    std::atomic<std::int64_t> reclaimed{0};

   private:
    // Keys from traffic: a chained hash table whose lookups take no lock.
    // An entry is never freed while the level lives, only reused: its pin
    // count is negative (vacant) or counts the lookups and tickets holding
    // it. A lookup pins before it reads the key; reclaiming turns a count of
    // exactly zero vacant (one CAS, under `mu`), so a pinned entry is never
    // reclaimed and a vacant one never read. Every change to the chains is
    // under `mu`; a lookup that races one may miss and goes to insert(),
    // which looks again under `mu`.
    static constexpr std::int64_t vacant = std::numeric_limits<std::int64_t>::min() / 2;
    struct entry {
      std::atomic<std::int64_t> pins{vacant};
      std::atomic<std::size_t> hash{0};
      std::atomic<entry*> next{nullptr};
      entry* next_free = nullptr;  // under mu
      std::optional<detail::quota> q;  // engaged while live; written only while vacant
    };

    detail::quota* override_of(std::string_view key, std::size_t h) const noexcept {
      if (fixed.size() == 0) return nullptr;
      return fixed.find(h, [&](const std::string& k) { return detail::key_equals(k, key); });
    }

    detail::quota* find_pinned(std::string_view key, std::size_t h) noexcept {
      int steps = 0;  // a chain long by chance (or by a racing reuse): let insert() look
      for (entry* e = buckets[h & mask].load(std::memory_order_acquire); e != nullptr && steps < 16;
           e = e->next.load(std::memory_order_acquire), ++steps) {
        if (e->hash.load(std::memory_order_relaxed) != h) continue;
        if (e->pins.fetch_add(1, std::memory_order_acquire) < 0) {
          e->pins.fetch_sub(1, std::memory_order_relaxed);
          continue;
        }
        if (detail::key_equals(e->q->key, key)) return &*e->q;
        e->pins.fetch_sub(1, std::memory_order_release);
      }
      return nullptr;
    }

    // Under mu: chains hold live entries only.
    const entry* chain_find(std::string_view key, std::size_t h) const noexcept {
      for (const entry* e = buckets[h & mask].load(std::memory_order_relaxed); e != nullptr;
           e = e->next.load(std::memory_order_relaxed)) {
        if (e->hash.load(std::memory_order_relaxed) == h && detail::key_equals(e->q->key, key)) return e;
      }
      return nullptr;
    }

    static quota_figures usage_of(const detail::quota& q, time_point now) noexcept {
      quota_figures u;
      u.in_flight = q.in_flight.load(std::memory_order_acquire);
      u.queued = q.queued.load(std::memory_order_acquire);
      if (q.rate) u.rate_available = q.rate->available(now);
      if (q.compute) u.compute_available = q.compute->available(now);
      return u;
    }

    // A key not found without the lock (allocates when new).
    detail::quota* insert(std::string_view key, std::size_t h, time_point now, duration& full) {
      std::lock_guard lock(mu);
      if (const entry* found = chain_find(key, h)) {
        auto* e = const_cast<entry*>(found);
        e->pins.fetch_add(1, std::memory_order_relaxed);  // live: not reclaimable while we hold mu
        return &*e->q;
      }
      entry* e = take_entry(now, full);
      if (e == nullptr) {
        refused.fetch_add(1, std::memory_order_relaxed);
        return nullptr;
      }
      e->q.emplace(std::string(key), defaults, &e->pins);
      e->hash.store(h, std::memory_order_relaxed);
      std::atomic<entry*>& head = buckets[h & mask];
      e->next.store(head.load(std::memory_order_relaxed), std::memory_order_relaxed);
      // Live with our pin; the release publishes the quota and key to every
      // lookup that pins it.
      e->pins.fetch_add(1 - vacant, std::memory_order_release);
      head.store(e, std::memory_order_release);
      size.fetch_add(1, std::memory_order_relaxed);
      return &*e->q;
    }

    // Under mu: a vacant entry, or null with the retry-after in `full`.
    entry* take_entry(time_point now, duration& full) {
      if (free_list == nullptr && entries.size() < static_cast<std::size_t>(max_keys)) {
        entries.push_back(std::make_unique<entry>());
        return entries.back().get();
      }
      if (free_list == nullptr) {
        if (now < next_sweep) {  // swept lately and found every key in use
          full = std::max(next_sweep - now, duration(1));
          return nullptr;
        }
        const duration soonest = sweep(now);
        if (free_list == nullptr) {
          next_sweep = now + soonest;
          full = soonest;
          return nullptr;
        }
      }
      entry* e = free_list;
      free_list = e->next_free;
      return e;
    }

    // Under mu: reclaims every unpinned key whose buckets are full again.
    // Returns when to look again: when the first unpinned key will be idle,
    // or busy_retry_after when some key only waits for its tickets.
    duration sweep(time_point now) {
      duration soonest = duration::max();
      std::int64_t freed = 0;
      for (std::size_t b = 0; b <= mask; ++b) {
        std::atomic<entry*>* link = &buckets[b];
        for (entry* e = link->load(std::memory_order_relaxed); e != nullptr;) {
          entry* next = e->next.load(std::memory_order_relaxed);
          std::int64_t expected = 0;
          const duration wait =
              e->pins.load(std::memory_order_relaxed) != 0 ? busy_retry_after : e->q->until_fresh(now);
          bool take = wait == duration::zero() && e->pins.compare_exchange_strong(
                                                      expected, vacant, std::memory_order_acquire,
                                                      std::memory_order_relaxed);
          if (take && e->q->until_fresh(now) != duration::zero()) {
            // A ticket used and released it since we looked: it keeps its state.
            e->pins.fetch_add(-vacant, std::memory_order_relaxed);
            take = false;
          }
          if (take) {
            // Unlinked, but its own next is left: a lookup standing on it
            // walks on. Vacant, so no lookup reads its quota.
            link->store(next, std::memory_order_release);
            e->q.reset();
            e->next_free = free_list;
            free_list = e;
            ++freed;
          } else {
            soonest = std::min(soonest, wait == duration::zero() ? busy_retry_after : wait);
            link = &e->next;
          }
          e = next;
        }
      }
      size.fetch_sub(freed, std::memory_order_relaxed);
      reclaimed.fetch_add(freed, std::memory_order_relaxed);
      return std::max(soonest == duration::max() ? busy_retry_after : soonest, duration(1));
    }

    // Names come from traffic, so they may be chosen to collide: the hash is
    // seeded per level.
    std::uint64_t seed = (std::uint64_t{std::random_device{}()} << 32) | std::random_device{}();
    detail::keyed_table<std::string, detail::quota> fixed;  // the overrides: lock-free, never reclaimed
    std::size_t mask;
    std::unique_ptr<std::atomic<entry*>[]> buckets;
    mutable std::mutex mu;                        // guards the chains, entries, free_list, next_sweep
    std::vector<std::unique_ptr<entry>> entries;  // every entry ever made: at most max_keys
    entry* free_list = nullptr;
    time_point next_sweep{time_point::min()};
  };

  admission_options options_;
  level tenants_;
  level models_;
};

inline absl::Status admission_ticket::start() {
  if (!live_ || !queued_) return absl::OkStatus();
  if (tenant_ != nullptr && !tenant_->take(false)) {
    return admission::refusal({"tenant", tenant_->key, quota_limit::in_flight, owner_->options().busy_retry_after});
  }
  if (model_ != nullptr && !model_->take(false)) {
    if (tenant_ != nullptr) tenant_->give(false);
    return admission::refusal({"model", model_->key, quota_limit::in_flight, owner_->options().busy_retry_after});
  }
  // In flight everywhere: now give the queued slots back.
  if (tenant_ != nullptr) tenant_->give(true);
  if (model_ != nullptr) model_->give(true);
  queued_ = false;
  return absl::OkStatus();
}

// See admission::with_estimate and admission::for_model.
template <class Estimator, class TenantKey>
class admission_policy {
 public:
  admission_policy(admission& a, Estimator e, const admission_key* model = nullptr, TenantKey tenant = {})
      : admission_(&a), estimate_(std::move(e)), tenant_(std::move(tenant)), model_(model) {}

  // The same site reserving estimator(call) compute units per call.
  template <class E>
  [[nodiscard]] admission_policy<E, TenantKey> with_estimate(E estimator) const {
    return admission_policy<E, TenantKey>(*admission_, std::move(estimator), model_, tenant_);
  }

  // The same site taking each call's tenant from tenant_key(call), a
  // `const admission_key*` resolved ahead (per client session, say, and
  // carried in the call's request: keel::from_request); null falls back to
  // the tenant label.
  template <class K>
  [[nodiscard]] admission_policy<Estimator, K> with_tenant_key(K tenant_key) const {
    return admission_policy<Estimator, K>(*admission_, estimate_, model_, std::move(tenant_key));
  }

  template <class Ctx, class Next>
  auto execute(Ctx& ctx, const attempt_plan& plan, Next& next) const -> decltype(next(ctx, plan)) {
    std::int64_t estimate = 0;
    if constexpr (!std::is_same_v<Estimator, no_estimate>) {
      estimate = static_cast<std::int64_t>(estimate_(std::as_const(ctx.call)));
    }
    const admission_key* tenant = nullptr;
    if constexpr (!std::is_same_v<TenantKey, no_tenant_key>) tenant = tenant_(std::as_const(ctx.call));
    return admission_->run(ctx, plan, next, estimate, model_, tenant);
  }

 private:
  admission* admission_;
  [[no_unique_address]] Estimator estimate_;
  [[no_unique_address]] TenantKey tenant_;
  const admission_key* model_;
};

template <class Estimator>
admission_policy<Estimator> admission::with_estimate(Estimator estimator) {
  return admission_policy<Estimator>(*this, std::move(estimator));
}

inline admission_policy<no_estimate> admission::for_model(const admission_key& model) {
  return admission_policy<no_estimate>(*this, no_estimate{}, &model);
}

}  // namespace keel
