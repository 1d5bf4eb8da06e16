// keel/outcome.hpp — classify before retrying.
//
// Every result a provider returns is one of five kinds, and only two of them
// may be tried again on their own:
//
//   success     the answer
//   transient   unavailable, a read that timed out: retry
//   throttled   rate limited; retry after the provider's hint
//   permanent   bad credential, unsupported model, invalid argument: never retry
//   ambiguous   a write whose effect is unknown: retry only when the
//               operation is idempotent (it carries an idempotency identity)
//
// default_classifier maps absl status codes onto these kinds; a status marked
// with keel::with_outcome() keeps the kind it was given, and a pipeline can be
// given its own classifier (any `keel::classifier`).
//
// Example:
//
//   keel::operation write{.effect = keel::effect::write};
//   keel::outcome_kind k = keel::default_classifier{}(absl::DeadlineExceededError("t"), write);
//   // k == keel::outcome_kind::ambiguous: the write may have happened
//
// Thread-safety: everything here is a pure function of its arguments.
#pragma once

#include <concepts>
#include <optional>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "keel/status.hpp"

namespace keel {

enum class outcome_kind { success, transient, throttled, permanent, ambiguous };

[[nodiscard]] constexpr std::string_view to_string(outcome_kind k) noexcept {
  switch (k) {
    case outcome_kind::success: return "success";
    case outcome_kind::transient: return "transient";
    case outcome_kind::throttled: return "throttled";
    case outcome_kind::permanent: return "permanent";
    case outcome_kind::ambiguous: return "ambiguous";
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
                         outcome_kind::ambiguous}) {
    if (*p == detail::to_absl(to_string(k))) return k;
  }
  return std::nullopt;
}

// A classifier maps a status (never OK) and the operation to a kind.
template <class C>
concept classifier = requires(const C& c, const absl::Status& s, const operation& op) {
  { c(s, op) } -> std::same_as<outcome_kind>;
};

// The default mapping from absl codes.
//
//   Unavailable, Aborted, Internal          transient
//   DeadlineExceeded                        transient for a read, ambiguous for a write
//   Unknown                                 ambiguous (a thrown provider lands here)
//   ResourceExhausted                       throttled
//   Cancelled                               permanent (the caller gave up)
//   everything else                         permanent
//
// A status marked "not started" was refused before any effect, so a timeout
// that carries it is transient even for a write.
struct default_classifier {
  [[nodiscard]] outcome_kind operator()(const absl::Status& s, const operation& op) const {
    if (s.ok()) return outcome_kind::success;
    if (std::optional<outcome_kind> marked = marked_outcome(s)) return *marked;
    switch (s.code()) {
      case absl::StatusCode::kUnavailable:
      case absl::StatusCode::kAborted:
      case absl::StatusCode::kInternal:
        return outcome_kind::transient;
      case absl::StatusCode::kDeadlineExceeded:
        if (op.effect == effect::read || not_started(s)) return outcome_kind::transient;
        return outcome_kind::ambiguous;
      case absl::StatusCode::kUnknown:
        return not_started(s) ? outcome_kind::transient : outcome_kind::ambiguous;
      case absl::StatusCode::kResourceExhausted:
        return outcome_kind::throttled;
      default:
        return outcome_kind::permanent;
    }
  }
};

static_assert(classifier<default_classifier>);

// Whether a result of kind k may be tried again for operation op.
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

}  // namespace keel
