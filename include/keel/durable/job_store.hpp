// keel/durable/job_store.hpp — the job store contract behind keel::job_queue
// (keel/durable/job_queue.hpp); a backend includes only this. A durable batch
// job queue: jobs submitted once per
// idempotency key, bounded in depth and age, claimed by workers under a fenced
// lease, retried up to a limit, and their state kept where every replica can
// read it.
//
// A job is identified by (queue, tenant, key) — the key is the client's
// idempotency key — plus a digest of its payload. Its life:
//
//   submit ──> queued ──claim──> running ──complete──> done (result kept)
//                 ^                 │ │
//                 └──fail, retry────┘ └──fail, last attempt / permanent──> failed (reason kept)
//   queued past its max age ──> expired          (visible; never silently dropped)
//   running, lease lapsed ──claim by another──> running (fence + 1, took_over)
//
// The store contract (keel::job_store; every operation is one atomic step in
// the store — one BEGIN IMMEDIATE transaction in SQLite, one statement in
// PostgreSQL — and one round trip; time is the store's, never the caller's):
//
//   submit(job_key, payload_digest, payload, job_limits) -> StatusOr<job_submission>
//       No job under the key: a new queued job (created = true), unless the
//       queue already holds limits.max_depth live (queued or running) jobs:
//       then keel::job_queue_full_error (ResourceExhausted, refused-by
//       "job-queue:<queue>", retry-after, not started) and nothing is stored.
//       A job under the key with the same digest: that job (created = false),
//       whatever its state. With another digest: keel::conflict_error.
//       Queued jobs past their age are marked expired first, so they do not
//       count toward the depth.
//   claim(queue, owner, lease) -> StatusOr<optional<job_claim>>
//       The oldest eligible job by submission order — queued and due (not
//       waiting out a retry delay, not past its age), or running with a lapsed
//       lease (took_over) — becomes running for `owner` with fence + 1 and
//       attempts + 1, its lease `lease` from the store's now. A lapsed job
//       that already used its last attempt is marked failed instead ("the
//       lease expired during the last attempt") and the next one is looked at.
//       nullopt: nothing eligible. `owner` claiming again while it holds a job
//       of that queue gets the same job and fence back, its lease extended (a
//       lost reply can be retried with the same owner).
//   renew(id, ownership, lease)       holder only: lease = max(lease, now + lease).
//   complete(id, ownership, result)   holder only: done, the result stored. Once.
//   fail(id, ownership, job_failure)  holder only: queued again after
//       failure.retry_after, or failed with the reason when failure.permanent
//       or the job has used max_attempts; answers the state it went to.
//   renew / complete / fail by anyone but the current (owner, fence):
//       keel::lost_ownership_error, nothing changes. A holder whose lease
//       lapsed but was not taken over still holds the job. Repeating a
//       complete or fail that succeeded, with the same ownership, is OK and
//       changes nothing (docs/stores.md rule 7).
//   get(id), find(job_key) -> StatusOr<optional<job_info>>   state, attempts,
//       timestamps (store clock, ns), result or last error. A queued job past
//       its age reads as expired even before a write marks it.
//   counts(queue) -> StatusOr<job_counts>
//   purge_finished(queue, retention) -> StatusOr<int64>   deletes done, failed
//       and expired jobs finished more than `retention` ago; their keys may
//       then be used again.
//
// Store faults: keel::store_unavailable_error (nothing applied, safe to
// repeat) or keel::unknown_outcome_error (a write that may have applied:
// repeat it — rule 7 makes that safe). Bad input (keys: 1-255 bytes without
// control characters; ids > 0; positive durations and bounds) is
// InvalidArgument naming the field, before the store is touched.
//
// Example (what a backend meets; keel/store/sqlite_jobs.hpp is one):
//
//   static_assert(keel::job_store<keel::sqlite_job_store<>>);
//   absl::Status full = keel::job_queue_full_error("reports", 500, 500, std::chrono::seconds(5));
//   // keel::is_job_queue_full(full): refused before anything was stored
//
// Thread-safety: the types here are values; job stores are safe from any
// number of threads (and the durable ones from several processes).
#pragma once

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "keel/core/clock.hpp"
#include "keel/core/status.hpp"
#include "keel/durable/digest.hpp"
#include "keel/durable/events.hpp"
#include "keel/durable/ownership.hpp"

namespace keel {

// ---------------------------------------------------------------------------
// Vocabulary shared by every job store
// ---------------------------------------------------------------------------

// job_state (queued, running, done, failed, expired) is in keel/durable/events.hpp.

// Done, failed and expired are final: nothing moves a job out of them.
[[nodiscard]] constexpr bool is_final(job_state s) noexcept {
  return s == job_state::done || s == job_state::failed || s == job_state::expired;
}

// Which job: views, which must outlive the operation.
struct job_key {
  std::string_view queue{};
  std::string_view tenant{};
  std::string_view key{};  // the client's idempotency key

  // Each part: 1-255 bytes, no control characters.
  [[nodiscard]] absl::Status validate() const {
    if (absl::Status s = validate_key("queue", queue); !s.ok()) return s;
    if (absl::Status s = validate_key("tenant", tenant); !s.ok()) return s;
    return validate_key("job key", key);
  }
};

// The bounds a submission is checked against, sent with it (the store keeps
// max_attempts and the age deadline with the job).
struct job_limits {
  // Live (queued + running) jobs the queue may hold; >= 1.
  std::int64_t max_depth = 10'000;
  // A job still queued this long after submission expires; > 0.
  duration max_age = std::chrono::hours(1);
  // Attempts (claims) a job may use; >= 1.
  int max_attempts = 3;
  // The retry-after hint on a rejection; >= 0.
  duration overload_retry_after = std::chrono::seconds(1);

  [[nodiscard]] absl::Status validate() const {
    if (max_depth < 1) return detail::invalid_field("job_limits", "max_depth", "be >= 1", max_depth);
    if (max_age <= duration::zero()) return detail::invalid_field("job_limits", "max_age", "be > 0", max_age);
    if (max_attempts < 1) return detail::invalid_field("job_limits", "max_attempts", "be >= 1", max_attempts);
    if (overload_retry_after < duration::zero())
      return detail::invalid_field("job_limits", "overload_retry_after", "be >= 0", overload_retry_after);
    return absl::OkStatus();
  }
};

// What submit() answers.
struct job_submission {
  std::int64_t id = 0;
  // false: a job with this key and payload digest already existed; this is it.
  bool created = false;
  job_state state = job_state::queued;
  int attempts = 0;
};

// A claimed job: what the worker needs to run it.
struct job_claim {
  std::int64_t id = 0;
  std::string tenant{};
  std::string key{};
  std::string payload{};
  // The worker's token: every later write names it.
  keel::ownership ownership{};
  // This attempt, 1-based, and the job's limit.
  int attempt = 0;
  int max_attempts = 0;
  // The previous holder's lease lapsed while the job ran: its work may have
  // half-run (anything it wrote outside should be checked or fenced).
  bool took_over = false;
  // The lease granted, from the store's now.
  duration lease{};
  std::int64_t created_at_ns = 0;
};

// Why an attempt failed, and what to do next.
struct job_failure {
  absl::StatusCode code = absl::StatusCode::kUnknown;
  std::string_view message{};
  // Do not retry: the job fails now.
  bool permanent = false;
  // How long the job waits before it may be claimed again (from the store's
  // now); >= 0.
  duration retry_after = duration::zero();

  [[nodiscard]] absl::Status validate() const {
    if (code == absl::StatusCode::kOk) return absl::InvalidArgumentError("job_failure.code must not be OK");
    if (retry_after < duration::zero())
      return detail::invalid_field("job_failure", "retry_after", "be >= 0", retry_after);
    return absl::OkStatus();
  }
};

// A job as stored. Times are nanoseconds on the store's clock (Unix time for
// the wall-clock and database clocks); 0 means "not yet".
struct job_info {
  std::int64_t id = 0;
  std::string queue{};
  std::string tenant{};
  std::string key{};
  keel::digest payload_digest{};
  std::string payload{};
  job_state state = job_state::queued;
  int attempts = 0;  // claims so far (the running one included)
  int max_attempts = 0;
  std::int64_t fence = 0;  // of the last claim (0: never claimed)
  bool took_over = false;  // the last claim took the job over from a lapsed holder
  std::int64_t created_at_ns = 0;
  std::int64_t expires_at_ns = 0;    // a job still queued at this time expires
  std::int64_t available_at_ns = 0;  // queued: claimable from this time (retry delay)
  std::int64_t started_at_ns = 0;    // the last claim
  std::int64_t finished_at_ns = 0;   // done / failed / expired
  duration lease_remaining{};        // running: left on the lease (zero once it lapsed)
  std::string result{};              // done
  // failed: why. queued after a failed attempt: the last failure.
  absl::StatusCode error_code = absl::StatusCode::kOk;
  std::string error_message{};
};

struct job_counts {
  std::int64_t queued = 0;
  std::int64_t running = 0;
  std::int64_t done = 0;
  std::int64_t failed = 0;
  std::int64_t expired = 0;
  // The store's live-job counter for the depth bound (queued + running
  // jobs, counting queued ones past their age until a write marks them).
  std::int64_t depth = 0;

  [[nodiscard]] std::int64_t total() const noexcept { return queued + running + done + failed + expired; }
};

template <class S>
concept job_store = requires(S& s, const job_key& key, const digest& d, std::string_view bytes,
                             const job_limits& limits, const owner_id& owner, const ownership& token, duration ttl,
                             std::int64_t id, const job_failure& failure) {
  { s.submit(key, d, bytes, limits) } -> std::same_as<absl::StatusOr<job_submission>>;
  { s.claim(bytes, owner, ttl) } -> std::same_as<absl::StatusOr<std::optional<job_claim>>>;
  { s.renew(id, token, ttl) } -> std::same_as<absl::Status>;
  { s.complete(id, token, bytes) } -> std::same_as<absl::Status>;
  { s.fail(id, token, failure) } -> std::same_as<absl::StatusOr<job_state>>;
  { s.get(id) } -> std::same_as<absl::StatusOr<std::optional<job_info>>>;
  { s.find(key) } -> std::same_as<absl::StatusOr<std::optional<job_info>>>;
  { s.counts(bytes) } -> std::same_as<absl::StatusOr<job_counts>>;
  { s.purge_finished(bytes, ttl) } -> std::same_as<absl::StatusOr<std::int64_t>>;
};

// ---------------------------------------------------------------------------
// Statuses
// ---------------------------------------------------------------------------

// refused-by value of a full queue: "job-queue:<queue>".
inline constexpr std::string_view job_queue_refusal_prefix = "job-queue:";

// The queue holds max_depth live jobs: nothing was stored (not started);
// retry after the hint.
[[nodiscard]] inline absl::Status job_queue_full_error(std::string_view queue, std::int64_t live,
                                                       std::int64_t max_depth, duration retry_after) {
  absl::Status s = absl::ResourceExhaustedError(absl::StrCat("keel: job queue '", detail::to_absl(queue), "' is full (",
                                                             live, " live jobs, max_depth ", max_depth, ")"));
  s = with_refused_by(std::move(s), absl::StrCat(detail::to_absl(job_queue_refusal_prefix), detail::to_absl(queue)));
  return with_retry_after(mark_not_started(std::move(s)), retry_after);
}

[[nodiscard]] inline bool is_job_queue_full(const absl::Status& s) {
  if (s.code() != absl::StatusCode::kResourceExhausted) return false;
  const std::optional<std::string> by = refused_by(s);
  return by.has_value() && absl::StartsWith(*by, detail::to_absl(job_queue_refusal_prefix));
}

namespace detail {

// Checks shared by the backends.
[[nodiscard]] inline absl::Status validate_job_id(std::int64_t id) {
  if (id <= 0) return invalid_field("job", "id", "be > 0", id);
  return absl::OkStatus();
}

[[nodiscard]] inline absl::Status validate_job_lease(std::string_view op, duration lease) {
  if (lease <= duration::zero()) return invalid_field(op, "lease", "be > 0", lease);
  return absl::OkStatus();
}

// The lapsed-on-the-last-attempt failure written by claim().
inline constexpr std::string_view job_lease_lapsed_message =
    "keel: the lease expired during the last attempt (the worker stopped renewing: crashed, stalled or cut off)";

}  // namespace detail

}  // namespace keel
