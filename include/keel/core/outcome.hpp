// keel/core/outcome.hpp — classify before retrying.
//
// Every result of a call is one of seven kinds. Five are the provider's:
//
//   success     the answer
//   transient   unavailable, a read that timed out, a write known not to have
//               been sent: retry
//   throttled   rate limited; retry after the provider's hint
//   permanent   bad credential, unsupported model, invalid argument: never retry
//   ambiguous   a write whose effect is unknown: retry only when the
//               operation is idempotent (it carries an idempotency identity)
//
// and two are not the provider's at all:
//
//   refused     keel itself declined before any work: a breaker open, a
//               bulkhead or quota full, the retry budget or the attempt cap
//               spent, no time left. It carries who refused (refused_by) and,
//               when known, when to come back (retry_after). Retried, if at
//               all, only after that hint (keel::retry's wait_out_refusals);
//               never counted by a breaker, never stored as an
//               idempotency decision, reported as missing (not failed) by
//               fan-out, and exactly when an allowed fallback should serve.
//   cancelled   the caller went away (its stop token, absl::CancelledError).
//               Never retried, counted, stored or reported as a failure.
//
// default_classifier maps absl status codes onto these kinds (the table is
// below and in docs/outcomes.md); a status marked with keel::with_outcome()
// keeps the kind it was given; keel::refusal() builds a refused status; and a
// pipeline can be given its own classifier (any `keel::classifier`).
//
// Example:
//
//   keel::operation write{.effect = keel::effect::write};
//   keel::outcome_kind k = keel::default_classifier{}(absl::InternalError("500"), write);
//   // k == keel::outcome_kind::ambiguous: the write may have been applied
//   absl::Status r = keel::refusal(absl::UnavailableError("breaker open"), "breaker:llm",
//                                  std::chrono::seconds(5));
//   // default_classifier{}(r, write) == keel::outcome_kind::refused; retry_after(r) == 5 s
//
// Thread-safety: everything here is a pure function of its arguments.
#pragma once

#include <concepts>
#include <optional>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "keel/core/status.hpp"

namespace keel {

enum class outcome_kind { success, transient, throttled, permanent, ambiguous, refused, cancelled };

[[nodiscard]] constexpr std::string_view to_string(outcome_kind k) noexcept {
  switch (k) {
    case outcome_kind::success: return "success";
    case outcome_kind::transient: return "transient";
    case outcome_kind::throttled: return "throttled";
    case outcome_kind::permanent: return "permanent";
    case outcome_kind::ambiguous: return "ambiguous";
    case outcome_kind::refused: return "refused";
    case outcome_kind::cancelled: return "cancelled";
  }
  return "unknown";
}

// What the call does to the world. A read can be repeated; a write is a
// consequential action that must not happen twice.
enum class effect { read, write };

struct operation {
  keel::effect effect = keel::effect::read;
  // True when repeating the operation cannot duplicate its effect, for
  // example a write that carries an idempotency identity the receiver honours.
  bool idempotent = false;

  [[nodiscard]] constexpr bool repeatable() const noexcept {
    return effect == keel::effect::read || idempotent;
  }
};

// Gives a status an explicit kind that every classifier respects.
[[nodiscard]] inline absl::Status with_outcome(absl::Status s, outcome_kind k) {
  if (s.ok()) return s;
  s.SetPayload(detail::to_absl(outcome_payload), absl::Cord(detail::to_absl(to_string(k))));
  return s;
}

[[nodiscard]] inline std::optional<outcome_kind> marked_outcome(const absl::Status& s) {
  auto p = s.GetPayload(detail::to_absl(outcome_payload));
  if (!p) return std::nullopt;
  for (outcome_kind k : {outcome_kind::transient, outcome_kind::throttled, outcome_kind::permanent,
                         outcome_kind::ambiguous, outcome_kind::refused, outcome_kind::cancelled}) {
    if (*p == detail::to_absl(to_string(k))) return k;
  }
  return std::nullopt;
}

// keel declined before any work: `s` marked not started, refused by `who`
// (for example "breaker:llm", "bulkhead:batch", "attempt_cap"), with a
// retry-after hint when one is known, and classified refused. Used on
// refusal paths only: it allocates.
[[nodiscard]] inline absl::Status refusal(absl::Status s, std::string_view who,
                                          std::optional<duration> retry_after = std::nullopt) {
  if (s.ok()) return s;
  s = with_refused_by(mark_not_started(std::move(s)), who);
  if (retry_after) s = with_retry_after(std::move(s), *retry_after);
  return with_outcome(std::move(s), outcome_kind::refused);
}

// A classifier maps a status (never OK) and the operation to a kind.
template <class C>
concept classifier = requires(const C& c, const absl::Status& s, const operation& op) {
  { c(s, op) } -> std::same_as<outcome_kind>;
};

// The default mapping from absl codes. For a write, what decides is whether
// the request may have been applied: an error known to have happened before
// the request was sent (a status marked not started) is transient, anything
// after sending whose effect is unknown is ambiguous.
//
//   code                 read        write
//   (marked kind)        that kind   that kind            keel::with_outcome
//   Cancelled            cancelled   cancelled            the caller went away
//   not started, with    refused     refused              keel declined before
//     a refused-by                                        any work
//   Unavailable          transient   transient            not processed (gRPC, HTTP 503)
//   Aborted              transient   transient            conflict, not applied
//   ResourceExhausted    throttled   throttled            429, quota
//   Internal             transient   ambiguous            500: may have been applied
//   Unknown              ambiguous   ambiguous            a thrown provider lands here
//   DeadlineExceeded     transient   ambiguous            timed out after sending
//   other codes          permanent   permanent            invalid argument, auth, ...
//
// A status marked not started (without a refused-by) is transient for
// Internal, Unknown and DeadlineExceeded: nothing was sent.
struct default_classifier {
  [[nodiscard]] outcome_kind operator()(const absl::Status& s, const operation& op) const {
    if (s.ok()) return outcome_kind::success;
    if (std::optional<outcome_kind> marked = marked_outcome(s)) return *marked;
    if (s.code() == absl::StatusCode::kCancelled) return outcome_kind::cancelled;
    const bool before_sending = not_started(s);
    if (before_sending && s.GetPayload(detail::to_absl(refused_by_payload)).has_value()) return outcome_kind::refused;
    switch (s.code()) {
      case absl::StatusCode::kUnavailable:
      case absl::StatusCode::kAborted:
        return outcome_kind::transient;
      case absl::StatusCode::kInternal:
      case absl::StatusCode::kDeadlineExceeded:
        if (op.effect == effect::read || before_sending) return outcome_kind::transient;
        return outcome_kind::ambiguous;
      case absl::StatusCode::kUnknown:
        return before_sending ? outcome_kind::transient : outcome_kind::ambiguous;
      case absl::StatusCode::kResourceExhausted:
        return outcome_kind::throttled;
      default:
        return outcome_kind::permanent;
    }
  }
};

static_assert(classifier<default_classifier>);

// Whether a result of kind k may be tried again for operation op. A refusal
// is not retryable by its kind: only by its retry-after hint, when it has one
// (keel::retry does that); see retryable(status, kind, op).
[[nodiscard]] constexpr bool retryable(outcome_kind k, const operation& op) noexcept {
  switch (k) {
    case outcome_kind::transient:
    case outcome_kind::throttled:
      return true;
    case outcome_kind::ambiguous:
      return op.repeatable();
    default:
      return false;
  }
}

// Whether `s`, of kind k, may be tried again: retryable(k, op), or a refusal
// that says when to come back.
[[nodiscard]] inline bool retryable(const absl::Status& s, outcome_kind k, const operation& op) {
  if (k == outcome_kind::refused) return retry_after(s).has_value();
  return retryable(k, op);
}

// Whether k is the provider's outcome (success, transient, throttled,
// permanent, ambiguous) rather than keel's refusal or the caller's
// cancellation. Only provider outcomes are counted by breakers, stored as
// idempotency decisions or reported as a provider's failure.
[[nodiscard]] constexpr bool provider_outcome(outcome_kind k) noexcept {
  return k != outcome_kind::refused && k != outcome_kind::cancelled;
}

}  // namespace keel
