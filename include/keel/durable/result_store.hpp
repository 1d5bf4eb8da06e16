// keel/durable/result_store.hpp — the contract for saving a unit of work's validated
// result under a deterministic key, so a rerun pays only for what is missing.
//
// A fan-out over several providers saves each valid provider result as soon
// as it arrives, under a key built from what determines it (product facts,
// model, rubric: see keel::digest_builder). A rerun loads what is there and
// runs only the rest; a lease claimant whose predecessor's lease expired
// checks here before starting the work again (keel::run_leased).
//
// The contract (every backend: keel::memory_store, keel::sqlite_store, and
// the PostgreSQL and Redis stores):
//
//   save_result(key, value, retention) -> absl::StatusOr<bool>
//       First write wins. Stores `value` under `key` if no live value is
//       there and answers true; if a live value is already stored, changes
//       nothing (whatever its contents) and answers false. Atomic: of any
//       number of concurrent saves of one key exactly one answers true, and
//       every later load returns that one's value. `retention` > 0 makes the
//       value expire that long after the save (on the store's clock);
//       zero keeps it until erased. An expired value counts as absent.
//   load_result(key) -> absl::StatusOr<std::optional<std::string>>
//       The live value, or nullopt.
//   erase_result(key) -> absl::Status
//       Removes the value if any (OK either way): the explicit way to replace
//       a result, for example after the validation rules changed.
//
// Why first write wins: keys are deterministic, so two savers of one key
// computed the same unit of work; keeping the first means a slow or stale
// worker (one whose lease was taken over) can never overwrite a result that
// others may already have read.
//
// Keys are validated like every store key (keel::validate_key: 1-255 bytes,
// no control characters); a digest's hex() (64 characters), optionally with
// a prefix, is the usual key. Values are arbitrary bytes.
//
// Example:
//
//   std::string key = "panel:" + keel::digest_builder().field("facts", facts).field("model", "m1").finish().hex();
//   absl::StatusOr<std::optional<std::string>> cached = store.load_result(key);
//   if (cached.ok() && !cached->has_value()) {
//     std::string value = run_the_provider();
//     absl::StatusOr<bool> stored = store.save_result(key, value, std::chrono::hours(24 * 7));
//   }
//
// Thread-safety: backends are safe to use from many threads (and, for the
// durable ones, many processes) at once.
#pragma once

#include <concepts>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "keel/core/clock.hpp"

namespace keel {

template <class S>
concept result_store = requires(S& s, std::string_view key, std::string_view value, duration retention) {
  { s.save_result(key, value, retention) } -> std::same_as<absl::StatusOr<bool>>;
  { s.load_result(key) } -> std::same_as<absl::StatusOr<std::optional<std::string>>>;
  { s.erase_result(key) } -> std::same_as<absl::Status>;
};

}  // namespace keel
