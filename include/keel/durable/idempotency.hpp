// keel/durable/idempotency.hpp — the idempotency record store contract: one
// logical decision per request, however often the request is retried,
// across threads, processes and restarts. keel::once (keel/durable/once.hpp)
// is the algorithm on top; a store backend includes only this.
//
// A request is identified by a client key scoped to tenant and endpoint
// (keel::request_identity) plus a digest of its canonical contents
// (keel::digest, keel/durable/digest.hpp). The store keeps one record per identity:
//
//   in flight   owner, fence, lease expiry          (someone is deciding)
//   committed   decision id, model digest, policy   (replayed to every retry)
//               revision, result bytes, commit time,
//               or a stored failure (code + message)
//   plus an expiry for the whole record (retention).
//
// The store contract (keel::idempotency_store; docs/stores.md has the full
// text every backend meets and the conformance suite checks):
//
//   begin(identity, request_digest, owner, begin_options) -> StatusOr<begin_outcome>
//       One atomic step answering exactly one of:
//         claimed    no live record (or an abandoned one, or one whose lease
//                    expired: took_over): a new in-flight record is yours,
//                    with `owner` and a fence above every earlier one.
//                    `owner` beginning again while it holds the record gets
//                    the same fence (a lost reply can be retried).
//         in_flight  someone else holds it; lease_remaining says until when.
//         replay     committed with the same digest: the stored decision.
//         conflict   the record (in flight or committed) has another digest.
//       begin_options::supersede_revision (non-empty) re-claims a committed
//       record whose policy revision differs (keel::on_policy_change::decide_again).
//   extend(identity, ownership, ttl)        lease = max(lease, now + ttl) for the holder.
//   commit(identity, ownership, decision, retention)
//       The holder's record becomes committed; the record then expires
//       `retention` after the commit. Repeating a successful commit with the
//       same ownership is OK and changes nothing (the first decision stays).
//   abandon(identity, ownership)
//       The holder gives up: the record is removed (the key's fence is
//       remembered, so the next claim still gets a higher one). Repeating a
//       successful abandon is OK.
//   extend/commit/abandon by anyone but the current (owner, fence):
//       keel::lost_ownership, nothing changes. A holder whose lease expired
//       but was not taken over still holds the record. A record past its
//       retention is gone: lost_ownership too.
//   A store error during commit: keel::unknown_outcome_error (ambiguous),
//   unless the store knows nothing was applied (keel::store_unavailable_error).
//
// Example (what a backend implements; keel::memory_store is the smallest):
//
//   static_assert(keel::idempotency_store<keel::memory_store>);
//   keel::memory_store store;
//   keel::request_identity id{.tenant = "merchant-82", .endpoint = "receipts", .key = "key-47"};
//   absl::StatusOr<keel::begin_outcome> b =
//       store.begin(id, keel::digest_builder().field("receipt", "r").finish(), keel::owner_id::random(), {});
//
// Thread-safety: the types here are values; a store's operations are
// thread-safe (and the durable ones process-safe), as the contract requires.
#pragma once

#include <chrono>
#include <concepts>
#include <cstdint>
#include <stop_token>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "keel/core/clock.hpp"
#include "keel/core/status.hpp"
#include "keel/durable/digest.hpp"
#include "keel/durable/events.hpp"
#include "keel/durable/ownership.hpp"

namespace keel {

// Who is asking, for what: the record's key. Views: the strings must outlive
// the operation.
struct request_identity {
  std::string_view tenant{};
  std::string_view endpoint{};
  std::string_view key{};  // the client's idempotency key

  // Each part: 1-255 bytes, no control characters.
  [[nodiscard]] absl::Status validate() const {
    if (absl::Status s = validate_key("tenant", tenant); !s.ok()) return s;
    if (absl::Status s = validate_key("endpoint", endpoint); !s.ok()) return s;
    return validate_key("idempotency key", key);
  }

  friend bool operator==(const request_identity&, const request_identity&) = default;
};

// The policy revision a record is stored under when its outcome is
// unresolved: the provider's write may or may not have been applied (an
// ambiguous failure). Reserved: a provider's decision may not use it.
inline constexpr std::string_view unresolved_revision = "keel:unresolved";

// What a committed record holds.
struct decision {
  std::string id{};             // the decision id: stable across replays; 1-255 bytes
  std::string model_digest{};   // which model (and version) decided; <= 255 bytes
  std::string policy_revision{};  // the policy in force when it was decided; <= 255 bytes
  std::string result{};         // the answer, any bytes
  // A stored failure: the provider failed and the failure is kept so that
  // retries get the same answer. kOk for a decision.
  absl::StatusCode error_code = absl::StatusCode::kOk;
  std::string error_message{};

  [[nodiscard]] bool failed() const noexcept { return error_code != absl::StatusCode::kOk; }
  // An ambiguous outcome kept until it is settled (keel::once::resolve):
  // whether the effect happened is unknown, so it is never re-run.
  [[nodiscard]] bool unresolved() const noexcept { return failed() && policy_revision == unresolved_revision; }
  [[nodiscard]] absl::Status error() const { return absl::Status(error_code, error_message); }

  [[nodiscard]] absl::Status validate() const {
    if (absl::Status s = validate_key("decision id", id); !s.ok()) return s;
    if (model_digest.size() > max_key_bytes)
      return absl::InvalidArgumentError(absl::StrCat("decision model_digest must be at most ", max_key_bytes,
                                                     " bytes (got ", model_digest.size(), ")"));
    if (policy_revision.size() > max_key_bytes)
      return absl::InvalidArgumentError(absl::StrCat("decision policy_revision must be at most ", max_key_bytes,
                                                     " bytes (got ", policy_revision.size(), ")"));
    return absl::OkStatus();
  }

  friend bool operator==(const decision&, const decision&) = default;
};

struct begin_options {
  // How long a claim holds the record in flight; > 0.
  duration lease = std::chrono::seconds(30);
  // How long the record lives from the claim (commit restarts it); > lease.
  duration retention = std::chrono::hours(24);
  // Non-empty: a committed record (same digest) whose policy_revision
  // differs from this one is claimed again instead of replayed (superseded).
  std::string_view supersede_revision{};

  [[nodiscard]] absl::Status validate() const {
    if (lease <= duration::zero()) return detail::invalid_field("begin_options", "lease", "be > 0", lease);
    if (retention <= lease)
      return detail::invalid_field("begin_options", "retention", "exceed lease",
                                   detail::describe(retention) + " <= " + detail::describe(lease));
    if (supersede_revision.size() > max_key_bytes)
      return detail::invalid_field("begin_options", "supersede_revision", "be at most 255 bytes",
                                   supersede_revision.size());
    return absl::OkStatus();
  }
};

// begin_state (claimed, in_flight, replay, conflict) is in keel/durable/events.hpp.

// What begin() answers. Which fields mean something depends on `state`.
struct begin_outcome {
  begin_state state = begin_state::claimed;
  // claimed: your token. in_flight: the holder's fence (owner not disclosed).
  // replay: the fence that committed.
  keel::ownership ownership{};
  // claimed: an earlier holder's lease had expired (its provider call may
  // have run; it never committed).
  bool took_over = false;
  // claimed: a decision of another policy revision was superseded.
  bool superseded = false;
  // claimed: the lease granted. in_flight: time left on the holder's lease.
  duration lease_remaining{};
  // replay: the stored decision and when it was committed (nanoseconds on
  // the store's clock: Unix time for the wall-clock and database clocks).
  keel::decision decision{};
  std::int64_t committed_at_ns = 0;
  // conflict: the other request is still in flight (otherwise committed).
  bool conflict_in_flight = false;
};

template <class S>
concept idempotency_store = requires(S& s, const request_identity& id, const digest& d, const owner_id& owner,
                                     const begin_options& bo, const ownership& token, const decision& dec,
                                     duration ttl) {
  { s.begin(id, d, owner, bo) } -> std::same_as<absl::StatusOr<begin_outcome>>;
  { s.extend(id, token, ttl) } -> std::same_as<absl::Status>;
  { s.commit(id, token, dec, ttl) } -> std::same_as<absl::Status>;
  { s.abandon(id, token) } -> std::same_as<absl::Status>;
};

// A store that can wake a waiter when a record changes (the in-memory store).
// Others are polled with backoff. wait_for_change returns when the record
// may have changed, after at most `max_wait` on the store's clock, or on
// stop; spurious returns are allowed. The wait is relative so that the
// caller's clock and the store's need not agree.
template <class S>
concept notifying_store = requires(S& s, const request_identity& id, duration max_wait, std::stop_token stop) {
  s.wait_for_change(id, max_wait, stop);
};

}  // namespace keel
