// keel/durable/job_queue.hpp — the durable batch job queue over any job store
// (keel/durable/job_store.hpp has the store contract).
//
// On top of the contract, keel::job_queue<Store, Env> holds the
// options (queue name, bounds, lease, retry backoff) and runs workers:
// run_one() claims a job, runs the handler while a keel::lease_keeper renews
// the lease, and completes or fails it with a fenced write; work() repeats it
// until stopped, waiting poll_interval on its clock when the queue is empty.
// Clock, classifier and listener come from one environment
// (keel/core/environment.hpp), the service's: the same value its pipelines
// run in (keel::job_queue q(store, options, env)).
// A worker that dies mid-job loses nothing: its lease lapses, another worker
// takes the job over with a higher fence, and the dead worker's late
// completion is refused — the result is written once.
//
// Example:
//
//   auto store = keel::sqlite_job_store<>::open("/var/lib/gateway/keel.db");   // keel/store/sqlite_jobs.hpp
//   keel::job_queue reports(**store, {.queue = "reports", .max_depth = 500, .max_age = std::chrono::hours(1)},
//                           env);   // keel::environment: the service's clock, classifier and listener
//   absl::StatusOr<keel::job_submission> s = reports.submit("acme", "report-2025-10-06", request_json);
//   // keel::is_job_queue_full(s.status()): rejected, retry after keel::retry_after(s.status())
//   // keel::is_conflict(s.status()): this key was used for another payload
//
//   std::jthread worker([&](std::stop_token stop) {
//     reports.work([](const keel::job_context& job) -> absl::StatusOr<std::string> {
//       return build_report(job.payload, job.stop);   // pass job.ownership.fence on to systems that check it
//     }, stop);
//   });
//   absl::StatusOr<std::optional<keel::job_info>> st = reports.get(s->id);   // queued / running / done / failed / expired
//
// Handler outcomes: OK -> complete. A failure the environment's classifier
// calls permanent (by default InvalidArgument, PermissionDenied, ...) fails the
// job at once, unless the handler was cut short (stop requested, lease lost);
// any other failure (and an exception, and a stop) is retried
// after the later of the status's retry-after hint and retry_backoff *
// 2^(attempt-1), capped at retry_backoff_cap, until max_attempts attempts were
// made. The hint is a floor, not a replacement: a provider that keeps asking
// for a short wait (a breaker's time left open, a 429) would otherwise let
// one job spend all its attempts within a single outage.
//
// Events (keel/durable/events.hpp): events::job_rejected (queue full),
// events::job_finished (done / queued again / failed after an attempt),
// events::job_lost (a worker's fenced write was refused), and the keeper's
// events::lease_lost.
//
// Thread-safety: job stores are safe from any number of threads (and the
// durable ones from several processes); job_queue's members may be called
// concurrently from any number of threads, each work() loop on its own.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <stop_token>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "keel/core/clock.hpp"
#include "keel/core/environment.hpp"
#include "keel/core/outcome.hpp"
#include "keel/core/status.hpp"
#include "keel/core/telemetry.hpp"
#include "keel/durable/digest.hpp"
#include "keel/durable/events.hpp"
#include "keel/durable/job_store.hpp"
#include "keel/durable/lease.hpp"
#include "keel/durable/ownership.hpp"

namespace keel {

// ---------------------------------------------------------------------------
// The queue
// ---------------------------------------------------------------------------

struct job_queue_options {
  // The queue's name: 1-255 bytes, no control characters.
  std::string queue = "default";
  // Live (queued + running) jobs at most; >= 1.
  std::int64_t max_depth = 10'000;
  // A job not started this long after submission expires; > 0.
  duration max_age = std::chrono::hours(1);
  // Attempts per job; >= 1.
  int max_attempts = 3;
  // The lease a worker holds a job under, renewed every renew_every; > 0.
  duration lease = std::chrono::seconds(30);
  // Zero: lease / 3. Must be below lease.
  duration renew_every = duration::zero();
  // Wait before attempt k+1: retry_backoff * 2^(k-1), at most retry_backoff_cap
  // (a longer retry-after hint on the failure wins, also capped); >= 0, cap >= base.
  duration retry_backoff = std::chrono::seconds(1);
  duration retry_backoff_cap = std::chrono::minutes(5);
  // How long an idle work() loop waits before looking again; > 0.
  duration poll_interval = std::chrono::milliseconds(500);
  // The retry-after hint on a rejection (queue full); >= 0.
  duration overload_retry_after = std::chrono::seconds(1);
  // Largest payload submit() accepts, and largest result a handler may
  // return (a larger one fails the attempt permanently); >= 1.
  std::size_t max_payload_bytes = std::size_t{1} << 20;
  std::size_t max_result_bytes = std::size_t{16} << 20;

  [[nodiscard]] absl::Status validate() const {
    constexpr std::string_view who = "job_queue_options";
    if (absl::Status s = validate_key("job_queue_options.queue", queue); !s.ok()) return s;
    if (max_depth < 1) return detail::invalid_field(who, "max_depth", "be >= 1", max_depth);
    if (max_age <= duration::zero()) return detail::invalid_field(who, "max_age", "be > 0", max_age);
    if (max_attempts < 1) return detail::invalid_field(who, "max_attempts", "be >= 1", max_attempts);
    if (lease <= duration::zero()) return detail::invalid_field(who, "lease", "be > 0", lease);
    if (renew_every < duration::zero() || renew_every >= lease)
      return detail::invalid_field(who, "renew_every", "be in [0, lease)", renew_every);
    if (retry_backoff < duration::zero()) return detail::invalid_field(who, "retry_backoff", "be >= 0", retry_backoff);
    if (retry_backoff_cap < retry_backoff)
      return detail::invalid_field(who, "retry_backoff_cap", "be >= retry_backoff", retry_backoff_cap);
    if (poll_interval <= duration::zero()) return detail::invalid_field(who, "poll_interval", "be > 0", poll_interval);
    if (overload_retry_after < duration::zero())
      return detail::invalid_field(who, "overload_retry_after", "be >= 0", overload_retry_after);
    if (max_payload_bytes < 1) return detail::invalid_field(who, "max_payload_bytes", "be >= 1", max_payload_bytes);
    if (max_result_bytes < 1) return detail::invalid_field(who, "max_result_bytes", "be >= 1", max_result_bytes);
    return absl::OkStatus();
  }

  [[nodiscard]] job_limits limits() const noexcept {
    return {.max_depth = max_depth,
            .max_age = max_age,
            .max_attempts = max_attempts,
            .overload_retry_after = overload_retry_after};
  }
};

// What a handler sees.
struct job_context {
  std::int64_t id = 0;
  std::string_view queue{};
  std::string_view tenant{};
  std::string_view key{};
  std::string_view payload{};
  int attempt = 0;
  int max_attempts = 0;
  bool took_over = false;
  keel::ownership ownership{};
  // Fires when work() is stopped or the lease is lost: stop and return.
  std::stop_token stop{};
};

// What run_one() did with a job.
struct job_outcome {
  std::int64_t id = 0;
  int attempt = 0;
  bool took_over = false;
  // Where the job went: done, queued (a retry) or failed. Unchanged (running)
  // when the fenced write was refused (`lost`).
  job_state state = job_state::running;
  // The handler's failure (OK when it succeeded).
  absl::Status handler_status{};
  // The fenced write was refused (another worker holds the job) or could not
  // be confirmed; `write_status` says which. Nothing this attempt did was kept.
  bool lost = false;
  absl::Status write_status{};
};

template <job_store Store, any_environment Env = keel::environment<>>
class job_queue {
 public:
  // Throws keel::invalid_options when `o` is invalid (call o.validate() first
  // to get the status instead). `env` gives the clock, the classifier of a
  // handler's failure (permanent: the job fails for good) and the listener.
  explicit job_queue(Store& store, job_queue_options o = {}, Env env = {})
      : store_(store), options_((detail::require_valid(o.validate()), std::move(o))), env_(std::move(env)) {}

  job_queue(const job_queue&) = delete;
  job_queue& operator=(const job_queue&) = delete;

  [[nodiscard]] const job_queue_options& options() const noexcept { return options_; }
  [[nodiscard]] Store& store() const noexcept { return store_; }

  // Submits `payload` under (tenant, key), deduplicated by the payload's
  // SHA-256 (or the digest given: a canonical request digest from
  // keel::digest_builder). One store round trip. Answers as
  // job_store::submit, plus InvalidArgument for a bad tenant/key or a
  // payload over max_payload_bytes.
  [[nodiscard]] absl::StatusOr<job_submission> submit(std::string_view tenant, std::string_view key,
                                                      std::string_view payload) {
    if (payload.size() > options_.max_payload_bytes) return payload_too_large(payload.size());
    return submit(tenant, key, payload, sha256(payload));
  }
  [[nodiscard]] absl::StatusOr<job_submission> submit(std::string_view tenant, std::string_view key,
                                                      std::string_view payload, const digest& payload_digest) {
    if (payload.size() > options_.max_payload_bytes) return payload_too_large(payload.size());
    absl::StatusOr<job_submission> s =
        store_.submit(job_key{options_.queue, tenant, key}, payload_digest, payload, options_.limits());
    if (!s.ok() && is_job_queue_full(s.status())) observe(env_.listener, events::job_rejected{options_.queue, s.status()});
    return s;
  }

  [[nodiscard]] absl::StatusOr<std::optional<job_info>> get(std::int64_t id) { return store_.get(id); }
  [[nodiscard]] absl::StatusOr<std::optional<job_info>> find(std::string_view tenant, std::string_view key) {
    return store_.find(job_key{options_.queue, tenant, key});
  }
  [[nodiscard]] absl::StatusOr<job_counts> counts() { return store_.counts(options_.queue); }
  absl::StatusOr<std::int64_t> purge_finished(duration retention) {
    return store_.purge_finished(options_.queue, retention);
  }

  // Claims the oldest eligible job and runs `handler` on it:
  //
  //   handler(const job_context&) -> absl::StatusOr<std::string>
  //
  // while a lease_keeper renews the lease every renew_every (the context's
  // stop token fires when `stop` does or the lease is lost). Then one fenced
  // write: complete with the result, or fail (retry or final, see the header
  // comment). A write answered "not started" or "unknown outcome" is repeated
  // (at most 3 times; repeats are safe), and so is a claim (with the same
  // owner, which gets back a job the lost claim took). nullopt: nothing was
  // eligible. A store error on the claim is returned as is.
  template <class Handler>
  absl::StatusOr<std::optional<job_outcome>> run_one(Handler&& handler, std::stop_token stop = {}) {
    const owner_id me = owner_id::random();
    const time_point sent = env_.clock.now();
    // A claim whose outcome is unknown may have taken a job for `me`: asking
    // again with the same owner returns it (or another one, or none).
    absl::StatusOr<std::optional<job_claim>> c;
    for (int i = 0; i < 3; ++i) {
      c = store_.claim(options_.queue, me, options_.lease);
      if (c.ok() || !(not_started(c.status()) || is_unknown_outcome(c.status()))) break;
    }
    if (!c.ok()) return c.status();
    if (!c->has_value()) return std::optional<job_outcome>();
    const job_claim& job = **c;
    const ownership token = job.ownership;

    std::stop_source work_stop;
    std::stop_callback forward(stop, [&] { work_stop.request_stop(); });
    absl::StatusOr<std::string> r = absl::UnknownError("keel: job handler did not run");
    {
      lease_keeper<Env> keeper(
          absl::StrCat("job ", job.id), [&](duration ttl) { return store_.renew(job.id, token, ttl); }, work_stop,
          sent, {.ttl = options_.lease, .renew_every = options_.renew_every}, env_);
      const job_context ctx{.id = job.id,
                            .queue = options_.queue,
                            .tenant = job.tenant,
                            .key = job.key,
                            .payload = job.payload,
                            .attempt = job.attempt,
                            .max_attempts = job.max_attempts,
                            .took_over = job.took_over,
                            .ownership = token,
                            .stop = work_stop.get_token()};
      try {
        r = std::invoke(handler, ctx);
      } catch (const std::exception& e) {
        r = absl::UnknownError(absl::StrCat("keel: job handler threw: ", e.what()));
      } catch (...) {
        r = absl::UnknownError("keel: job handler threw");
      }
      keeper.stop();
    }
    // Even when the keeper gave up, the fenced write is tried: the store
    // decides whether this worker still holds the job (docs/stores.md rule 6).
    job_outcome out{.id = job.id, .attempt = job.attempt, .took_over = job.took_over};
    if (r.ok() && r->size() > options_.max_result_bytes) {
      r = absl::FailedPreconditionError(absl::StrCat("keel: job result of ", r->size(),
                                                     " bytes exceeds max_result_bytes ", options_.max_result_bytes));
    }
    absl::Status written;
    if (r.ok()) {
      written = repeat_write([&] { return store_.complete(job.id, token, *r); });
      if (written.ok()) out.state = job_state::done;
    } else {
      out.handler_status = r.status();
      // The handler's failure, classified by the service's classifier: a job
      // runs as an idempotent write (its fenced commit makes a repeat safe).
      const outcome_kind kind = env_.classify(r.status(), operation{.effect = effect::write, .idempotent = true});
      // A handler cut short (work() stopping, the lease lost) says nothing
      // about the job: however it reports that, the job is tried again.
      const bool cut_short = work_stop.stop_requested();
      const job_failure f{.code = r.status().code(),
                          .message = detail::to_std(r.status().message()),
                          .permanent = kind == outcome_kind::permanent && !cut_short,
                          .retry_after = retry_delay(job.attempt, r.status())};
      absl::StatusOr<job_state> next;
      written = repeat_write([&] {
        next = store_.fail(job.id, token, f);
        return next.status();
      });
      if (written.ok()) out.state = *next;
    }
    if (written.ok()) {
      observe(env_.listener, events::job_finished{options_.queue, job.id, job.attempt, out.state});
    } else {
      out.lost = true;
      out.write_status = written;
      observe(env_.listener, events::job_lost{options_.queue, job.id, out.write_status});
    }
    return std::optional<job_outcome>(std::move(out));
  }

  // Runs jobs until `stop`: run_one in a loop, waiting poll_interval on the
  // clock when nothing was eligible or the store failed. Returns the number
  // of jobs it ran.
  template <class Handler>
  std::int64_t work(Handler&& handler, std::stop_token stop) {
    std::int64_t ran = 0;
    while (!stop.stop_requested()) {
      absl::StatusOr<std::optional<job_outcome>> r = run_one(handler, stop);
      if (r.ok() && r->has_value()) {
        ++ran;
        continue;
      }
      if (!env_.clock.sleep_until(env_.clock.now() + options_.poll_interval, stop)) break;
    }
    return ran;
  }

  // The wait before the attempt after `attempt` failed with `why`.
  [[nodiscard]] duration retry_delay(int attempt, const absl::Status& why) const {
    duration d = options_.retry_backoff;
    for (int i = 1; i < attempt && d < options_.retry_backoff_cap; ++i) d *= 2;
    if (std::optional<duration> hint = retry_after(why)) d = std::max(d, *hint);
    return std::min(d, options_.retry_backoff_cap);
  }

 private:
  absl::Status payload_too_large(std::size_t n) const {
    return detail::invalid_field("job", "payload", absl::StrCat("be at most ", options_.max_payload_bytes, " bytes"),
                                 absl::StrCat(n, " bytes"));
  }

  // Repeats a fenced write whose effect is not known to have happened:
  // rule 7 makes a repeat with the same ownership safe.
  template <class Write>
  static absl::Status repeat_write(Write&& write) {
    absl::Status s;
    for (int i = 0; i < 3; ++i) {
      s = write();
      if (s.ok() || !(not_started(s) || is_unknown_outcome(s))) return s;
    }
    return s;
  }

  Store& store_;
  job_queue_options options_;
  Env env_;
};

}  // namespace keel
