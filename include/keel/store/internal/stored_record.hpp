// keel/store/internal/stored_record.hpp — the checks a store runs on a record, lease
// or fence it reads back before trusting it.
//
// A row or hash may be damaged (a disk error SQLite did not catch, a hand
// edit, a bug) or written by another keel version with other rules. Read
// without checking, it could replay a decision no keel would have committed
// (an empty id, a status code absl does not have), or overflow a fence.
// Each backend decodes what it read, runs these checks, and answers a
// failed one with stored_damage(): DataLoss, permanent, naming what and why;
// the damaged data is left as it is for an operator to look at.
//
//   if (std::string why = detail::stored_fence_problem(fence); !why.empty())
//     return detail::stored_damage(who, "the lease of work key 'k'", why);
//
// Internal to keel: the API may change. Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "keel/core/outcome.hpp"
#include "keel/core/status.hpp"
#include "keel/durable/idempotency.hpp"
#include "keel/durable/ownership.hpp"

namespace keel::detail {

// The highest fence a store accepts reading back: the next claim adds 1.
inline constexpr std::int64_t max_stored_fence = INT64_MAX - 1;

// A status code absl defines (a stored failure carries one).
[[nodiscard]] constexpr bool known_status_code(std::int64_t c) noexcept { return c >= 0 && c <= 16; }

// "" when the state is one keel writes (0 in flight, 1 committed, 2 abandoned).
[[nodiscard]] inline std::string stored_state_problem(std::int64_t state) {
  if (state >= 0 && state <= 2) return {};
  return absl::StrCat("state ", state, " is not 0, 1 or 2");
}

// "" when the fence is one a claim could have issued.
[[nodiscard]] inline std::string stored_fence_problem(std::int64_t fence) {
  if (fence >= 1 && fence <= max_stored_fence) return {};
  return absl::StrCat("fence ", fence, " is outside [1, 2^63 - 2]");
}

// "" when the owner has the 16 bytes of an owner_id.
[[nodiscard]] inline std::string stored_owner_problem(std::string_view owner) {
  if (owner.size() == 16) return {};
  return absl::StrCat("owner is ", owner.size(), " bytes, not 16");
}

// "" when a committed decision is one commit() would have accepted.
[[nodiscard]] inline std::string stored_decision_problem(const decision& d) {
  if (!known_status_code(static_cast<std::int64_t>(d.error_code)))
    return absl::StrCat("error code ", static_cast<std::int64_t>(d.error_code), " is not a status code");
  if (absl::Status v = d.validate(); !v.ok()) return std::string(v.message());
  return {};
}

// The answer to a failed check: DataLoss, permanent.
[[nodiscard]] inline absl::Status stored_damage(std::string_view who, std::string_view what, std::string_view why) {
  return with_outcome(absl::DataLossError(absl::StrCat("keel: ", to_absl(who), ": ", to_absl(what),
                                                       " is damaged or was written by another keel version (",
                                                       to_absl(why), "); it was left as it is")),
                      outcome_kind::permanent);
}

// "the record for key 'k' (tenant 't', endpoint 'e')".
[[nodiscard]] inline std::string record_words(const request_identity& id) {
  return absl::StrCat("the record for key '", to_absl(id.key), "' (tenant '", to_absl(id.tenant), "', endpoint '",
                      to_absl(id.endpoint), "')");
}

}  // namespace keel::detail
