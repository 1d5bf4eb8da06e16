// keel/store/memory.hpp — the in-process store: idempotency records, leases
// and results in abseil hash maps behind one std::mutex.
//
// keel::memory_store implements all three store contracts
// (keel::idempotency_store, keel::lease_store, keel::result_store; see
// docs/stores.md) for one process: tests, single-replica services, caches in
// front of a durable store. It forgets everything when the process ends, so
// it cannot deduplicate across replicas or restarts — use keel::sqlite_store
// (one host) or the PostgreSQL / Redis stores (a fleet) for that.
//
// Time comes from the clock given at construction (keel::real_clock by
// default; keel::testing::manual_clock in tests, so expiry is driven by
// hand). The store never lets its time go backwards: it uses the highest
// time it has seen, so a clock stepped back cannot make a lease live longer
// or shorter than granted, nor let two owners hold one key.
//
// Duplicates waiting for an in-flight request (keel::once) are woken by a
// condition variable when a record changes, instead of polling
// (wait_for_change; keel::notifying_store).
//
// Example:
//
//   keel::memory_store store;
//   keel::once decide(store, {.lease = std::chrono::seconds(10)});
//   absl::StatusOr<keel::lease_claim> c = store.claim("reindex", keel::owner_id::random(), std::chrono::seconds(5));
//
// Memory: records stay until purge_expired() removes the expired ones (call
// it periodically in a long-running process). Purging never lets a fence go
// backwards: the store keeps the highest fence it purged, and a key it no
// longer has starts above it.
//
// Thread-safety: every operation may be called from any thread; each is
// atomic (one critical section). wait_for_change blocks only the caller.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <stop_token>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/hash/hash.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "keel/core/any_clock.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/condition.hpp"
#include "keel/core/status.hpp"
#include "keel/durable/digest.hpp"
#include "keel/durable/idempotency.hpp"
#include "keel/durable/lease.hpp"
#include "keel/durable/ownership.hpp"
#include "keel/durable/result_store.hpp"

namespace keel {

namespace detail {

struct identity_key {
  std::string tenant, endpoint, key;
};

// Transparent hashing: look up by request_identity (views) without building
// strings; strings are made only when a record is inserted.
struct identity_hash {
  using is_transparent = void;
  [[nodiscard]] std::size_t operator()(const request_identity& id) const noexcept {
    return absl::HashOf(to_absl(id.tenant), to_absl(id.endpoint), to_absl(id.key));
  }
  [[nodiscard]] std::size_t operator()(const identity_key& k) const noexcept {
    return (*this)(request_identity{k.tenant, k.endpoint, k.key});
  }
};
struct identity_eq {
  using is_transparent = void;
  static request_identity view(const identity_key& k) noexcept { return {k.tenant, k.endpoint, k.key}; }
  static const request_identity& view(const request_identity& id) noexcept { return id; }
  template <class A, class B>
  [[nodiscard]] bool operator()(const A& a, const B& b) const noexcept {
    return view(a) == view(b);
  }
};

enum class record_state { in_flight, committed, abandoned };

}  // namespace detail

class memory_store {
 public:
  // The store's clock: any keel clock (keel/core/any_clock.hpp), the real one by default.
  explicit memory_store(any_clock clock = {}) : clock_(std::move(clock)) {}
  memory_store(const memory_store&) = delete;
  memory_store& operator=(const memory_store&) = delete;

  // ---- idempotency_store ---------------------------------------------------

  [[nodiscard]] absl::StatusOr<begin_outcome> begin(const request_identity& id, const digest& request,
                                                    const owner_id& owner, const begin_options& o) {
    if (absl::Status v = id.validate(); !v.ok()) return v;
    if (absl::Status v = o.validate(); !v.ok()) return v;
    if (owner.is_nil()) return absl::InvalidArgumentError("keel: owner must not be nil");
    std::lock_guard lock(mu_);
    const std::int64_t now = now_locked();
    const std::int64_t lease = detail::to_ns(o.lease);
    auto it = records_.find(id);
    if (it == records_.end()) {
      it = records_.emplace(detail::identity_key{std::string(id.tenant), std::string(id.endpoint), std::string(id.key)},
                            record{}).first;
      return claim_locked(it->second, request, owner, purged_fence_ + 1, now, o, false, false);
    }
    record& r = it->second;
    if (r.record_expires <= now || r.state == detail::record_state::abandoned) {
      return claim_locked(r, request, owner, r.holder.fence + 1, now, o, false, false);
    }
    if (r.request != request) {
      begin_outcome out{.state = begin_state::conflict};
      out.conflict_in_flight = r.state == detail::record_state::in_flight;
      return out;
    }
    if (r.state == detail::record_state::in_flight) {
      if (r.holder.owner == owner) {  // the holder asking again (a lost reply)
        r.lease_expires = std::max(r.lease_expires, detail::add_ns(now, lease));
        r.record_expires = std::max(r.record_expires, r.lease_expires);
        return begin_outcome{.state = begin_state::claimed,
                             .ownership = r.holder,
                             .lease_remaining = detail::from_ns(r.lease_expires - now)};
      }
      if (now < r.lease_expires) {
        return begin_outcome{.state = begin_state::in_flight,
                             .ownership = {.owner = {}, .fence = r.holder.fence},
                             .lease_remaining = detail::from_ns(r.lease_expires - now)};
      }
      return claim_locked(r, request, owner, r.holder.fence + 1, now, o, /*took_over=*/true, false);
    }
    // committed
    if (!o.supersede_revision.empty() && r.decided.policy_revision != o.supersede_revision) {
      return claim_locked(r, request, owner, r.holder.fence + 1, now, o, false, /*superseded=*/true);
    }
    return begin_outcome{.state = begin_state::replay,
                         .ownership = {.owner = {}, .fence = r.holder.fence},
                         .decision = r.decided,
                         .committed_at_ns = r.committed_at};
  }

  [[nodiscard]] absl::Status extend(const request_identity& id, const ownership& token, duration ttl) {
    if (absl::Status v = id.validate(); !v.ok()) return v;
    if (ttl <= duration::zero()) return detail::invalid_field("extend", "ttl", "be > 0", ttl);
    std::lock_guard lock(mu_);
    const std::int64_t now = now_locked();
    record* r = live_locked(id, now);
    if (r == nullptr || r->state != detail::record_state::in_flight || r->holder != token)
      return lost(r, token, "extend");
    r->lease_expires = std::max(r->lease_expires, detail::add_ns(now, detail::to_ns(ttl)));
    r->record_expires = std::max(r->record_expires, r->lease_expires);
    return absl::OkStatus();
  }

  [[nodiscard]] absl::Status commit(const request_identity& id, const ownership& token, const decision& d,
                                    duration retention) {
    if (absl::Status v = id.validate(); !v.ok()) return v;
    if (absl::Status v = d.validate(); !v.ok()) return v;
    if (retention <= duration::zero()) return detail::invalid_field("commit", "retention", "be > 0", retention);
    {
      std::lock_guard lock(mu_);
      const std::int64_t now = now_locked();
      record* r = live_locked(id, now);
      if (r != nullptr && r->state == detail::record_state::committed && r->holder == token)
        return absl::OkStatus();  // a repeated commit
      if (r == nullptr || r->state != detail::record_state::in_flight || r->holder != token)
        return lost(r, token, "commit");
      r->state = detail::record_state::committed;
      r->decided = d;
      r->committed_at = now;
      r->record_expires = detail::add_ns(now, detail::to_ns(retention));
      ++version_;
    }
    changed_.notify_all();
    return absl::OkStatus();
  }

  [[nodiscard]] absl::Status abandon(const request_identity& id, const ownership& token) {
    if (absl::Status v = id.validate(); !v.ok()) return v;
    {
      std::lock_guard lock(mu_);
      const std::int64_t now = now_locked();
      record* r = live_locked(id, now);
      if (r != nullptr && r->state == detail::record_state::abandoned && r->holder == token)
        return absl::OkStatus();  // a repeated abandon
      if (r == nullptr || r->state != detail::record_state::in_flight || r->holder != token)
        return lost(r, token, "abandon");
      r->state = detail::record_state::abandoned;
      r->decided = {};
      ++version_;
    }
    changed_.notify_all();
    return absl::OkStatus();
  }

  // Blocks until some record changes, `max_wait` passes on the store's
  // clock, or stop. Spurious returns are possible; callers begin() again.
  void wait_for_change(const request_identity& /*id*/, duration max_wait, std::stop_token stop) {
    std::unique_lock lock(mu_);
    const std::uint64_t seen = version_;
    const time_point now = clock_.now();
    const time_point until = time_point::max() - now < max_wait ? time_point::max() : now + max_wait;
    clock_.wait_until(lock, changed_, until, std::move(stop), [&] { return version_ != seen; });
  }

  // ---- lease_store ---------------------------------------------------------

  [[nodiscard]] absl::StatusOr<lease_claim> claim(std::string_view work_key, const owner_id& owner, duration ttl) {
    if (absl::Status v = validate_key("work key", work_key); !v.ok()) return v;
    if (ttl <= duration::zero()) return detail::invalid_field("claim", "ttl", "be > 0", ttl);
    if (owner.is_nil()) return absl::InvalidArgumentError("keel: owner must not be nil");
    std::lock_guard lock(mu_);
    const std::int64_t now = now_locked();
    const std::int64_t until = detail::add_ns(now, detail::to_ns(ttl));
    auto it = leases_.find(detail::to_absl(work_key));
    if (it == leases_.end()) {
      const ownership holder{owner, purged_fence_ + 1};
      leases_.emplace(std::string(work_key), lease_record{holder, until, true});
      return lease_claim{.acquired = true, .ownership = holder, .took_over = false, .remaining = ttl};
    }
    lease_record& l = it->second;
    if (l.held && l.holder.owner == owner) {  // the holder claiming again
      l.expires = std::max(l.expires, until);
      return lease_claim{.acquired = true, .ownership = l.holder, .remaining = detail::from_ns(l.expires - now)};
    }
    if (l.held && now < l.expires) {
      return lease_claim{.acquired = false,
                         .ownership = {.owner = {}, .fence = l.holder.fence},
                         .remaining = detail::from_ns(l.expires - now)};
    }
    const bool took_over = l.held;
    l = lease_record{{owner, l.holder.fence + 1}, until, true};
    return lease_claim{.acquired = true, .ownership = l.holder, .took_over = took_over, .remaining = ttl};
  }

  [[nodiscard]] absl::Status renew(std::string_view work_key, const ownership& token, duration ttl) {
    if (absl::Status v = validate_key("work key", work_key); !v.ok()) return v;
    if (ttl <= duration::zero()) return detail::invalid_field("renew", "ttl", "be > 0", ttl);
    std::lock_guard lock(mu_);
    const std::int64_t now = now_locked();
    auto it = leases_.find(detail::to_absl(work_key));
    if (it == leases_.end() || !it->second.held || it->second.holder != token)
      return lease_lost(it == leases_.end() ? nullptr : &it->second, token, "renew");
    it->second.expires = std::max(it->second.expires, detail::add_ns(now, detail::to_ns(ttl)));
    return absl::OkStatus();
  }

  [[nodiscard]] absl::Status release(std::string_view work_key, const ownership& token) {
    if (absl::Status v = validate_key("work key", work_key); !v.ok()) return v;
    std::lock_guard lock(mu_);
    const std::int64_t now = now_locked();
    auto it = leases_.find(detail::to_absl(work_key));
    if (it != leases_.end() && !it->second.held && it->second.holder == token) return absl::OkStatus();
    if (it == leases_.end() || !it->second.held || it->second.holder != token)
      return lease_lost(it == leases_.end() ? nullptr : &it->second, token, "release");
    it->second.held = false;
    it->second.expires = now;
    return absl::OkStatus();
  }

  // ---- result_store --------------------------------------------------------

  [[nodiscard]] absl::StatusOr<bool> save_result(std::string_view key, std::string_view value, duration retention) {
    if (absl::Status v = validate_key("result key", key); !v.ok()) return v;
    if (retention < duration::zero())
      return detail::invalid_field("save_result", "retention", "be >= 0", retention);
    std::lock_guard lock(mu_);
    const std::int64_t now = now_locked();
    const std::int64_t expires =
        retention == duration::zero() ? INT64_MAX : detail::add_ns(now, detail::to_ns(retention));
    auto it = results_.find(detail::to_absl(key));
    if (it == results_.end()) {
      results_.emplace(std::string(key), result_record{std::string(value), expires});
      return true;
    }
    if (now < it->second.expires) return false;  // first write wins
    it->second = result_record{std::string(value), expires};
    return true;
  }

  [[nodiscard]] absl::StatusOr<std::optional<std::string>> load_result(std::string_view key) {
    if (absl::Status v = validate_key("result key", key); !v.ok()) return v;
    std::lock_guard lock(mu_);
    const std::int64_t now = now_locked();
    auto it = results_.find(detail::to_absl(key));
    if (it == results_.end() || now >= it->second.expires) return std::optional<std::string>();
    return std::optional<std::string>(it->second.value);
  }

  [[nodiscard]] absl::Status erase_result(std::string_view key) {
    if (absl::Status v = validate_key("result key", key); !v.ok()) return v;
    std::lock_guard lock(mu_);
    results_.erase(detail::to_absl(key));
    return absl::OkStatus();
  }

  // ---- housekeeping --------------------------------------------------------

  // Removes expired idempotency records, results, and leases that are
  // released or expired (held ones too: their holder may only be paused).
  // The highest fence removed is kept and a key claimed again starts above
  // it, so a fence never goes backwards: a paused holder's token stays below
  // the new owner's. Returns the number of entries removed.
  std::size_t purge_expired() {
    std::lock_guard lock(mu_);
    const std::int64_t now = now_locked();
    std::size_t n = 0;
    n += absl::erase_if(records_, [&](const auto& kv) {
      if (kv.second.record_expires > now) return false;
      purged_fence_ = std::max(purged_fence_, kv.second.holder.fence);
      return true;
    });
    n += absl::erase_if(leases_, [&](const auto& kv) {
      if (kv.second.held && kv.second.expires > now) return false;
      purged_fence_ = std::max(purged_fence_, kv.second.holder.fence);
      return true;
    });
    n += absl::erase_if(results_, [&](const auto& kv) { return kv.second.expires <= now; });
    return n;
  }

  [[nodiscard]] const any_clock& clock() const noexcept { return clock_; }

 private:
  struct record {
    digest request{};
    detail::record_state state = detail::record_state::in_flight;
    ownership holder{};
    std::int64_t lease_expires = 0;
    std::int64_t record_expires = 0;
    decision decided{};
    std::int64_t committed_at = 0;
  };
  struct lease_record {
    ownership holder{};
    std::int64_t expires = 0;
    bool held = false;
  };
  struct result_record {
    std::string value{};
    std::int64_t expires = INT64_MAX;
  };

  // The store's time: the clock, but never earlier than any time already used.
  std::int64_t now_locked() noexcept {
    high_water_ = std::max(high_water_, detail::store_now_ns(clock_));
    return high_water_;
  }

  record* live_locked(const request_identity& id, std::int64_t now) {
    auto it = records_.find(id);
    if (it == records_.end() || it->second.record_expires <= now) return nullptr;
    return &it->second;
  }

  begin_outcome claim_locked(record& r, const digest& request, const owner_id& owner, std::int64_t fence,
                             std::int64_t now, const begin_options& o, bool took_over, bool superseded) {
    r.request = request;
    r.state = detail::record_state::in_flight;
    r.holder = {owner, fence};
    r.lease_expires = detail::add_ns(now, detail::to_ns(o.lease));
    r.record_expires = detail::add_ns(now, detail::to_ns(o.retention));
    r.decided = {};
    r.committed_at = 0;
    ++version_;
    return begin_outcome{.state = begin_state::claimed,
                         .ownership = r.holder,
                         .took_over = took_over,
                         .superseded = superseded,
                         .lease_remaining = o.lease};
  }

  static absl::Status lost(const record* r, const ownership& token, std::string_view op) {
    if (r == nullptr)
      return lost_ownership_error(absl::StrCat(detail::to_absl(op), " by fence ", token.fence,
                                               ": no live record for this key (expired or never claimed)"));
    const std::string_view state = r->state == detail::record_state::in_flight   ? "in flight"
                                   : r->state == detail::record_state::committed ? "committed"
                                                                                 : "abandoned";
    return lost_ownership_error(absl::StrCat(detail::to_absl(op), " by fence ", token.fence, ": the record is ",
                                             detail::to_absl(state), " under fence ", r->holder.fence,
                                             r->holder.fence == token.fence ? " and another owner" : ""));
  }
  static absl::Status lease_lost(const lease_record* l, const ownership& token, std::string_view op) {
    if (l == nullptr)
      return lost_ownership_error(absl::StrCat(detail::to_absl(op), " by fence ", token.fence,
                                               ": no lease for this key"));
    return lost_ownership_error(absl::StrCat(detail::to_absl(op), " by fence ", token.fence, ": the lease is ",
                                             l->held ? "held" : "free", " at fence ", l->holder.fence,
                                             l->holder.fence == token.fence && l->held ? " by another owner" : ""));
  }

  any_clock clock_;
  std::mutex mu_;
  keel::condition changed_;
  std::uint64_t version_ = 0;
  std::int64_t high_water_ = INT64_MIN;
  std::int64_t purged_fence_ = 0;  // the highest fence purge_expired removed
  absl::flat_hash_map<detail::identity_key, record, detail::identity_hash, detail::identity_eq> records_;
  absl::flat_hash_map<std::string, lease_record> leases_;
  absl::flat_hash_map<std::string, result_record> results_;
};

static_assert(idempotency_store<memory_store>);
static_assert(notifying_store<memory_store>);
static_assert(lease_store<memory_store>);
static_assert(result_store<memory_store>);

}  // namespace keel
