// keel/store/guarded.hpp — a circuit breaker in front of a store: when the
// store's server is failing, operations fail fast without touching it, and
// a few probes find out when it is back.
//
// keel::guarded_store<Store> wraps any store (PostgreSQL, Redis, SQLite,
// memory, yours) and models the same contracts the store models
// (keel::idempotency_store, keel::lease_store, keel::result_store). Every
// operation first asks the breaker; a refused one returns the breaker's
// refusal (Unavailable, not started, refused-by "breaker:<name>",
// retry-after = time left open) and the store is not contacted. An admitted
// one runs, and its outcome is recorded:
//
//   OK, lost ownership, conflict, invalid argument   success (the store answered)
//   unknown outcome (a write cut off)                ambiguous
//   Unavailable (refused, not started), timeouts,    transient
//     Internal, ResourceExhausted
//   PermissionDenied, FailedPrecondition, others     permanent
//
// Unlike a breaker around a provider call, a refused connection (marked not
// started) *is* counted: it is exactly the store failure the breaker is for.
// How each kind counts is the breaker's configuration (transient and
// ambiguous are failures by default, permanent ones are ignored).
//
// Example:
//
//   keel::circuit_breaker breaker({.name = "redis-store", .minimum_calls = 10, .open_duration = 5s});
//   keel::guarded_store guarded(*redis, breaker);
//   keel::once decide(guarded, {.lease = 30s});   // fails fast while Redis is down
//
// Thread-safety: as the wrapped store (the breaker is thread-safe).
#pragma once

#include <chrono>
#include <optional>
#include <stop_token>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "keel/core/any_clock.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/outcome.hpp"
#include "keel/core/status.hpp"
#include "keel/durable/digest.hpp"
#include "keel/durable/idempotency.hpp"
#include "keel/durable/lease.hpp"
#include "keel/durable/ownership.hpp"
#include "keel/durable/result_store.hpp"
#include "keel/policy/circuit_breaker.hpp"

namespace keel {

// How a store's answer counts for the breaker guarding it.
[[nodiscard]] inline outcome_kind store_health(const absl::Status& s) {
  if (s.ok() || is_lost_ownership(s) || is_conflict(s) || is_in_flight(s) ||
      s.code() == absl::StatusCode::kInvalidArgument)
    return outcome_kind::success;
  if (is_unknown_outcome(s)) return outcome_kind::ambiguous;
  switch (s.code()) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kAborted:
      return outcome_kind::transient;
    case absl::StatusCode::kUnknown:
      return outcome_kind::ambiguous;
    default:
      return outcome_kind::permanent;
  }
}

template <class Store>
class guarded_store {
 public:
  // `store` and `breaker` must outlive the guard.
  // `clock` times each operation for the breaker (any keel clock; the real one by default).
  guarded_store(Store& store, circuit_breaker& breaker, any_clock clock = {})
      : store_(store), breaker_(breaker), clock_(std::move(clock)) {}

  [[nodiscard]] Store& store() noexcept { return store_; }
  [[nodiscard]] circuit_breaker& breaker() noexcept { return breaker_; }

  // ---- idempotency_store ---------------------------------------------------
  [[nodiscard]] absl::StatusOr<begin_outcome> begin(const request_identity& id, const digest& d, const owner_id& owner,
                                                    const begin_options& o)
    requires idempotency_store<Store>
  {
    return guard([&] { return store_.begin(id, d, owner, o); });
  }
  [[nodiscard]] absl::Status extend(const request_identity& id, const ownership& t, duration ttl)
    requires idempotency_store<Store>
  {
    return guard([&] { return store_.extend(id, t, ttl); });
  }
  [[nodiscard]] absl::Status commit(const request_identity& id, const ownership& t, const decision& d,
                                    duration retention)
    requires idempotency_store<Store>
  {
    return guard([&] { return store_.commit(id, t, d, retention); });
  }
  [[nodiscard]] absl::Status abandon(const request_identity& id, const ownership& t)
    requires idempotency_store<Store>
  {
    return guard([&] { return store_.abandon(id, t); });
  }
  // Waiting is not a store operation the breaker judges.
  void wait_for_change(const request_identity& id, duration max_wait, std::stop_token stop)
    requires notifying_store<Store>
  {
    store_.wait_for_change(id, max_wait, std::move(stop));
  }

  // ---- lease_store ---------------------------------------------------------
  [[nodiscard]] absl::StatusOr<lease_claim> claim(std::string_view key, const owner_id& owner, duration ttl)
    requires lease_store<Store>
  {
    return guard([&] { return store_.claim(key, owner, ttl); });
  }
  [[nodiscard]] absl::Status renew(std::string_view key, const ownership& t, duration ttl)
    requires lease_store<Store>
  {
    return guard([&] { return store_.renew(key, t, ttl); });
  }
  [[nodiscard]] absl::Status release(std::string_view key, const ownership& t)
    requires lease_store<Store>
  {
    return guard([&] { return store_.release(key, t); });
  }

  // ---- result_store --------------------------------------------------------
  [[nodiscard]] absl::StatusOr<bool> save_result(std::string_view key, std::string_view value, duration retention)
    requires result_store<Store>
  {
    return guard([&] { return store_.save_result(key, value, retention); });
  }
  [[nodiscard]] absl::StatusOr<std::optional<std::string>> load_result(std::string_view key)
    requires result_store<Store>
  {
    return guard([&] { return store_.load_result(key); });
  }
  [[nodiscard]] absl::Status erase_result(std::string_view key)
    requires result_store<Store>
  {
    return guard([&] { return store_.erase_result(key); });
  }

 private:
  static const absl::Status& status_of(const absl::Status& s) noexcept { return s; }
  template <class T>
  static const absl::Status& status_of(const absl::StatusOr<T>& s) noexcept {
    return s.status();
  }

  template <class F>
  auto guard(F f) -> decltype(f()) {
    const time_point start = clock_.now();
    breaker_permit permit = breaker_.try_acquire(start);
    if (!permit) return breaker_.refusal(start);
    auto r = f();
    const time_point end = clock_.now();
    permit.record(store_health(status_of(r)), end, end - start);
    return r;
  }

  Store& store_;
  circuit_breaker& breaker_;
  any_clock clock_;
};

}  // namespace keel
