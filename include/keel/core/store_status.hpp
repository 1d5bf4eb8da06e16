// keel/core/store_status.hpp — how a store says what happened to an
// operation: the status conventions every durable backend (and the
// components above them) report and test with.
//
// Status conventions (payload "keel.dev/store-condition"; also see
// keel/core/status.hpp):
//
//   lost_ownership   FailedPrecondition  the owner/fence is no longer current; nothing changed.
//                                        Permanent: repeating it cannot help.
//   unknown_outcome  Unknown             a write may or may not have been applied (the store
//                                        failed mid-commit). Ambiguous: never treat it as
//                                        "not done"; begin/claim again to learn the truth.
//   in_flight        Aborted             another owner holds the key; retry after the hint.
//                                        Marked not-started: nothing was done.
//   conflict         AlreadyExists       the key is taken by a different request.
//   store unavailable Unavailable        the operation was not applied (busy, cannot open):
//                                        marked not-started, safe to repeat.
//
// Example:
//
//   absl::Status s = store.release("nightly-report", {.owner = me, .fence = 3});
//   if (keel::is_lost_ownership(s)) { /* someone took over: do not publish */ }
//   if (keel::is_unknown_outcome(s)) { /* it may have applied: claim again to learn */ }
//
// Thread-safety: pure functions over absl::Status values.
#pragma once

#include <optional>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "keel/core/clock.hpp"
#include "keel/core/outcome.hpp"
#include "keel/core/status.hpp"

namespace keel {

// ---------------------------------------------------------------------------
// Status conventions
// ---------------------------------------------------------------------------

inline constexpr std::string_view store_condition_payload = "keel.dev/store-condition";

enum class store_condition { lost_ownership, unknown_outcome, in_flight, conflict, unresolved };

[[nodiscard]] constexpr std::string_view to_string(store_condition c) noexcept {
  switch (c) {
    case store_condition::lost_ownership: return "lost-ownership";
    case store_condition::unknown_outcome: return "unknown-outcome";
    case store_condition::in_flight: return "in-flight";
    case store_condition::conflict: return "conflict";
    case store_condition::unresolved: return "unresolved";
  }
  return "unknown";
}

[[nodiscard]] inline std::optional<store_condition> condition_of(const absl::Status& s) {
  auto p = s.GetPayload(detail::to_absl(store_condition_payload));
  if (!p) return std::nullopt;
  for (store_condition c : {store_condition::lost_ownership, store_condition::unknown_outcome,
                            store_condition::in_flight, store_condition::conflict, store_condition::unresolved}) {
    if (*p == detail::to_absl(to_string(c))) return c;
  }
  return std::nullopt;
}

namespace detail {
[[nodiscard]] inline absl::Status with_condition(absl::Status s, store_condition c) {
  s.SetPayload(to_absl(store_condition_payload), absl::Cord(to_absl(to_string(c))));
  return s;
}
}  // namespace detail

// The owner/fence named is not the current claim (taken over, released,
// abandoned, committed by another owner, or the record expired). Nothing changed.
[[nodiscard]] inline absl::Status lost_ownership_error(std::string_view why) {
  return with_outcome(detail::with_condition(absl::FailedPreconditionError(absl::StrCat(
                                                 "keel: lost ownership: ", detail::to_absl(why))),
                                             store_condition::lost_ownership),
                      outcome_kind::permanent);
}
[[nodiscard]] inline bool is_lost_ownership(const absl::Status& s) {
  return condition_of(s) == store_condition::lost_ownership;
}

// A write whose effect is unknown. `cause` is the store's own error.
[[nodiscard]] inline absl::Status unknown_outcome_error(std::string_view what, const absl::Status& cause) {
  return with_outcome(detail::with_condition(absl::UnknownError(absl::StrCat(
                                                 "keel: unknown outcome: ", detail::to_absl(what), ": ",
                                                 cause.message())),
                                             store_condition::unknown_outcome),
                      outcome_kind::ambiguous);
}
[[nodiscard]] inline bool is_unknown_outcome(const absl::Status& s) {
  return condition_of(s) == store_condition::unknown_outcome;
}

// Another owner holds the key; `remaining` is what is left of its lease.
[[nodiscard]] inline absl::Status in_flight_error(std::string_view what, duration remaining) {
  return with_retry_after(
      mark_not_started(detail::with_condition(
          absl::AbortedError(absl::StrCat("keel: in flight elsewhere: ", detail::to_absl(what), "; retry after ",
                                          detail::describe(remaining))),
          store_condition::in_flight)),
      remaining);
}
[[nodiscard]] inline bool is_in_flight(const absl::Status& s) { return condition_of(s) == store_condition::in_flight; }

// The key belongs to a different request (other contents, or a decision made
// under another policy revision when that is configured as a conflict).
[[nodiscard]] inline absl::Status conflict_error(std::string_view why) {
  return with_outcome(detail::with_condition(absl::AlreadyExistsError(absl::StrCat(
                                                 "keel: idempotency conflict: ", detail::to_absl(why))),
                                             store_condition::conflict),
                      outcome_kind::permanent);
}
[[nodiscard]] inline bool is_conflict(const absl::Status& s) { return condition_of(s) == store_condition::conflict; }

// An earlier attempt of this request failed after its write may have been
// applied, and nobody has settled it (keel::once::resolve). Classified
// ambiguous: it is not retried blindly and must not be run again.
[[nodiscard]] inline absl::Status unresolved_error(std::string_view what, std::string_view cause) {
  return with_outcome(detail::with_condition(absl::UnknownError(absl::StrCat(
                                                 "keel: unresolved: ", detail::to_absl(what),
                                                 " may or may not have been applied (", detail::to_absl(cause),
                                                 "); settle it with keel::once::resolve before deciding again")),
                                             store_condition::unresolved),
                      outcome_kind::ambiguous);
}
[[nodiscard]] inline bool is_unresolved(const absl::Status& s) { return condition_of(s) == store_condition::unresolved; }

// The store could not perform the operation and did not apply it (busy
// beyond its timeout, connection refused before sending): safe to repeat.
[[nodiscard]] inline absl::Status store_unavailable_error(std::string_view what) {
  return mark_not_started(absl::UnavailableError(absl::StrCat("keel: store unavailable: ", detail::to_absl(what))));
}

}  // namespace keel
