// gateway/batch_worker.hpp — the workers that turn queued batch jobs into
// progress reports: claim a job from the durable queue under a fenced lease,
// ask the model (retries, the provider's breaker, an adaptive timeout, all
// within the job's own deadline), deliver the report once, complete the job.
//
// Why nothing is lost or done twice:
//   - the job lives in the durable queue (keel::job_queue over SQLite) from
//     submission on; a worker that dies mid-job stops renewing its lease, and
//     another worker takes the job over (fence + 1) after it lapses;
//   - the report is delivered to an inbox that honours a receiver-side
//     deduplication contract keyed by the job (gateway/effect_log.hpp), so a
//     takeover after a delivery the dead worker made is absorbed;
//   - the queue refuses the dead worker's late completion (fenced write).
//
// Batch work waits out an outage instead of degrading: a worker takes the
// provider's breaker's permission before it claims (a claim spends one of
// the job's attempts), so while the breaker is open nothing is claimed and
// while it is half-open only its few probes are; the breaker counts each
// job attempt once, by its outcome, and an attempt gate stops the attempt's
// retries as soon as the breaker opens. A job whose attempt fails goes back
// to the queue with the provider's retry-after hint (or the backoff) as its
// delay.
//
// Each running job holds a slot of the bulkhead's batch class, so batch work
// can never take more than its 8 slots of the provider, however long the
// queue.
//
// Example:
//
//   gateway::batch_worker<keel::real_clock, keel::sqlite_job_store<>, L> workers(resources);
//   workers.start(8);
//   ...
//   workers.stop();   // asks every worker to stop and joins them
//
// Thread-safety: start() and stop() from one controlling thread; run_once()
// from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stop_token>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "text.hpp"
#include "keel/compose/pipeline.hpp"
#include "keel/core/call.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/outcome.hpp"
#include "keel/core/status.hpp"
#include "keel/durable/job_queue.hpp"
#include "keel/observe/slo.hpp"
#include "keel/policy/adaptive_timeout.hpp"
#include "keel/policy/breaker_registry.hpp"
#include "keel/policy/bulkhead.hpp"
#include "keel/policy/retry.hpp"
#include "keel/policy/retry_budget.hpp"
#include "effect_log.hpp"
#include "gateway_options.hpp"
#include "simulated_provider.hpp"
#include "upstream.hpp"

namespace gateway {

// The batch queue's options: the gateway and every worker process use these.
[[nodiscard]] inline keel::job_queue_options report_queue_options(const gateway_options& o) {
  return {.queue = "reports",
          .max_depth = o.batch_max_depth,
          .max_age = o.batch_max_age,
          .max_attempts = o.batch_max_job_attempts,
          .lease = o.batch_lease,
          .retry_backoff = o.batch_retry_backoff,
          .retry_backoff_cap = o.batch_retry_backoff_cap,
          .poll_interval = o.batch_poll,
          .max_payload_bytes = o.max_body_bytes};
}

// What the workers use; owned by the gateway (or, in a worker process, by
// whoever runs them). Everything must outlive the workers.
template <keel::clock Clock, keel::job_store JobStore, class Listener>
struct batch_resources {
  keel::job_queue<JobStore, keel::environment<Clock, keel::default_classifier, Listener>>& queue;
  model_upstream& provider;
  keel::breaker_registry& breakers;
  keel::adaptive_timeout& timeout;
  keel::retry_budget& budget;
  effect_log& effects;
  keel::bulkhead& pools;
  std::size_t batch_class = 0;
  const gateway_options& options;
  Listener listener{};
  Clock clock{};
  keel::work_class_slo* slo = nullptr;  // job outcomes, when set
  // Called as a job's report is requested from the model ("start") and
  // delivered ("delivered"), with the job id: how a test knows a worker is
  // mid-job. Called from worker threads.
  std::function<void(std::string_view event, std::int64_t job)> on_progress{};
};

template <keel::clock Clock, keel::job_store JobStore, class Listener>
class batch_worker {
 public:
  explicit batch_worker(batch_resources<Clock, JobStore, Listener> r) : r_(std::move(r)) {}
  batch_worker(const batch_worker&) = delete;
  batch_worker& operator=(const batch_worker&) = delete;
  ~batch_worker() { stop(); }

  void start(int threads) {
    for (int i = 0; i < threads; ++i) {
      threads_.emplace_back([this](std::stop_token stop) { loop(stop); });
    }
  }

  // Asks every worker to stop (a running job's attempt is cut and goes back
  // to the queue) and joins them.
  void stop() {
    for (std::jthread& t : threads_) t.request_stop();
    threads_.clear();  // joins
  }

  // Replaces the progress hook (see batch_resources::on_progress). Call it
  // before start().
  void set_progress_hook(std::function<void(std::string_view, std::int64_t)> f) { r_.on_progress = std::move(f); }

  // Jobs this object's workers ran to a written outcome.
  [[nodiscard]] std::int64_t ran() const noexcept { return ran_.load(std::memory_order_relaxed); }

  // One pass: wait for a batch slot, take the provider's breaker's
  // permission, claim and run one job. nullopt when nothing ran.
  std::optional<keel::job_outcome> run_once(std::stop_token stop) {
    const keel::time_point now = r_.clock.now();
    absl::StatusOr<keel::bulkhead_permit> slot =
        r_.pools.acquire(r_.batch_class, r_.clock, now, keel::deadline::after(now, r_.options.batch_queue_age), stop);
    if (!slot.ok()) return std::nullopt;
    // The breaker's permission comes before the claim, because a claim
    // spends one of the job's attempts: open, no claim (nothing would
    // succeed); half-open, this worker is one of the few probes or does not
    // claim; closed, it costs nothing. Unused (nothing to claim), a probe
    // slot goes back when the permit is dropped.
    keel::breaker_permit permit = breaker().try_acquire(r_.clock.now());
    if (!permit) return std::nullopt;
    const keel::time_point t0 = r_.clock.now();
    absl::StatusOr<std::optional<keel::job_outcome>> r =
        r_.queue.run_one([&](const keel::job_context& job) { return run_job(job, permit); }, stop);
    if (!r.ok() || !r->has_value()) return std::nullopt;
    ran_.fetch_add(1, std::memory_order_relaxed);
    const keel::job_outcome& out = **r;
    if (r_.slo != nullptr && !out.lost) {
      // A failed attempt that goes back to the queue is not a failed job.
      const keel::time_point now = r_.clock.now();
      if (out.state == keel::job_state::done) r_.slo->record(keel::request_outcome::success, now - t0, now);
      if (out.state == keel::job_state::failed) r_.slo->record(keel::request_outcome::failure, now - t0, now);
    }
    return out;
  }

  [[nodiscard]] keel::circuit_breaker& breaker() {
    return r_.breakers.breaker_for(keel::failure_domain{.endpoint = r_.provider.name()});
  }

 private:
  // The handler: one attempt at a job's report. The breaker counts the
  // attempt once, by its outcome (the permit); inside, the attempt gate
  // stops retries as soon as the breaker opens.
  absl::StatusOr<std::string> run_job(const keel::job_context& job, keel::breaker_permit& permit) {
    const keel::time_point t0 = r_.clock.now();
    const nlohmann::json payload = nlohmann::json::parse(job.payload, nullptr, false);
    if (payload.is_discarded() || !payload.is_object() || !payload.contains("model") ||
        !payload["model"].is_string() || !payload.contains("sessions") || !payload["sessions"].is_array()) {
      return absl::InvalidArgumentError("the job's payload is not a batch request");  // permanent
    }
    const std::string model = payload["model"].get<std::string>();
    std::string prompt = "Write a progress report over these sessions:";
    for (const auto& s : payload["sessions"]) {
      if (s.is_string()) absl::StrAppend(&prompt, "\n- ", s.get<std::string>());
    }
    const std::string upstream_key = cat("report-", job.id);
    keel::call call(t0, {.timeout = r_.options.batch_job_deadline,
                         .stop = job.stop,
                         .labels = {.tenant = job.tenant,
                                    .model = model,
                                    .endpoint = r_.provider.name(),
                                    .work_class = "batch"},
                         .max_attempts = r_.options.batch_attempts});
    auto pipe = keel::pipeline(keel::retry({.max_attempts = r_.options.batch_attempts,
                                            .budget = &r_.budget,
                                            .min_attempt_time = r_.timeout.options().lower},
                                           r_.options.backoff),
                               breaker().attempt_gate(), r_.timeout)
                    .in(keel::environment{r_.clock}.with_listener(r_.listener));
    if (r_.on_progress) r_.on_progress("start", job.id);
    const keel::time_point asked = r_.clock.now();
    absl::StatusOr<std::string> raw =
        pipe.run(call, [&](const keel::attempt& a) -> absl::StatusOr<std::string> {
          // One key per job, whichever worker or lease runs it: the upstream sees one request.
          absl::StatusOr<std::string> out = r_.provider.complete(a, prompt, upstream_key);
          if (!out.ok()) return out;
          const nlohmann::json j = nlohmann::json::parse(*out, nullptr, false);
          if (j.is_discarded() || !j.is_object() || !j.contains("score") || !j["score"].is_number_integer() ||
              !j.contains("feedback") || !j["feedback"].is_string()) {
            return absl::InternalError(cat(r_.provider.name(), ": output broke the report contract"));
          }
          return out;
        });
    const keel::time_point answered = r_.clock.now();
    if (raw.ok()) {
      permit.record(keel::outcome_kind::success, answered, answered - asked);
    } else if (keel::not_started(raw.status())) {
      permit.ignore();  // nothing reached the provider
    } else {
      permit.record(keel::default_classifier{}(raw.status(), call.operation()), answered, answered - asked);
    }
    if (job.stop.stop_requested()) {
      // Stopped or the lease was lost: back to the queue, not a failure of the job.
      return keel::with_outcome(absl::UnavailableError("batch worker stopping; the job goes back to the queue"),
                                keel::outcome_kind::transient);
    }
    if (!raw.ok()) {
      // Wait out the breaker or the provider's hint; never fail the job for
      // a provider that is down (the breaker's refusal is marked permanent
      // for retry layers, which must not hammer it, but the job should come back).
      absl::Status why = keel::annotate(raw.status(), "report attempt");
      if (!keel::retry_after(why)) why = keel::with_retry_after(std::move(why), r_.options.batch_retry_backoff);
      return keel::with_outcome(std::move(why), keel::outcome_kind::transient);
    }
    const nlohmann::json answer = nlohmann::json::parse(*raw, nullptr, false);
    nlohmann::json report = {{"job_id", job.id},
                             {"tenant", job.tenant},
                             {"learner", payload.value("learner", std::string())},
                             {"sessions", payload["sessions"].size()},
                             {"score", answer["score"]},
                             {"summary", answer["feedback"]},
                             {"model", model},
                             {"attempt", job.attempt},
                             {"fence", job.ownership.fence}};
    const std::string text = report.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    absl::StatusOr<effect_log::delivery> delivered =
        r_.effects.deliver_report(job.id, job.tenant, job.key, job.ownership.fence, text);
    if (!delivered.ok()) {
      return keel::with_outcome(keel::annotate(delivered.status(), "delivering the report"),
                                keel::outcome_kind::transient);
    }
    if (r_.on_progress) r_.on_progress(delivered->applied ? "delivered" : "already-delivered", job.id);
    // The job's result is the report the learner has: after a takeover, the
    // one an earlier worker delivered.
    return std::move(delivered->report);
  }

  void loop(std::stop_token stop) {
    while (!stop.stop_requested()) {
      if (run_once(stop)) continue;
      if (!r_.clock.sleep_until(r_.clock.now() + r_.options.batch_poll, stop)) break;
    }
  }

  batch_resources<Clock, JobStore, Listener> r_;
  std::atomic<std::int64_t> ran_{0};
  std::vector<std::jthread> threads_;
};

// A worker process of its own: everything a batch_worker needs, opened on
// the gateway's data directory (jobs.db and effects.db), with its own
// provider connection, breaker and timeouts. `gateway --work <dir>` runs one;
// so do the crash tests.
template <keel::job_store JobStore, keel::clock Clock = keel::real_clock>
class worker_process {
 public:
  using queue_type = keel::job_queue<JobStore, keel::environment<Clock>>;

  template <class OpenJobs>
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<worker_process>> open(gateway_options o, OpenJobs open_jobs,
                                                                            Clock clock = {}) {
    if (absl::Status s = o.validate(); !s.ok()) return s;
    absl::StatusOr<std::unique_ptr<JobStore>> jobs = open_jobs(o.data_dir + "/jobs.db");
    if (!jobs.ok()) return jobs.status();
    absl::StatusOr<std::unique_ptr<effect_log>> effects = effect_log::open(o.data_dir + "/effects.db");
    if (!effects.ok()) return effects.status();
    return std::unique_ptr<worker_process>(
        new worker_process(std::move(o), std::move(*jobs), std::move(*effects), std::move(clock)));
  }

  worker_process(const worker_process&) = delete;
  worker_process& operator=(const worker_process&) = delete;

  batch_worker<Clock, JobStore, keel::null_listener>& workers() noexcept { return *workers_; }
  simulated_provider<Clock>& provider() noexcept { return provider_; }
  model_upstream& upstream() noexcept { return *upstream_; }
  queue_type& queue() noexcept { return queue_; }

 private:
  worker_process(gateway_options o, std::unique_ptr<JobStore> jobs, std::unique_ptr<effect_log> effects, Clock clock)
      : options_(std::move(o)),
        clock_(std::move(clock)),
        jobs_(std::move(jobs)),
        effects_(std::move(effects)),
        queue_(*jobs_, report_queue_options(options_), keel::environment{clock_}),
        provider_(options_.provider, clock_),
        http_(options_.upstream ? std::make_unique<http_upstream>(*options_.upstream) : nullptr),
        upstream_(http_ != nullptr ? static_cast<model_upstream*>(http_.get()) : &provider_),
        breakers_(keel::breaker_registry_options{.breaker = options_.breaker,
                                                 .scope = {.endpoint = true, .model = false, .region = false}}),
        timeout_(options_.batch_timeout),
        budget_(options_.retry_budget),
        pools_(keel::bulkhead_options{.classes = {{.name = "batch",
                                                   .capacity = options_.batch_slots,
                                                   .max_queue = options_.batch_queue,
                                                   .max_queue_age = options_.batch_queue_age}}}) {
    workers_ = std::make_unique<batch_worker<Clock, JobStore, keel::null_listener>>(
        batch_resources<Clock, JobStore, keel::null_listener>{.queue = queue_,
                                                              .provider = *upstream_,
                                                              .breakers = breakers_,
                                                              .timeout = timeout_,
                                                              .budget = budget_,
                                                              .effects = *effects_,
                                                              .pools = pools_,
                                                              .batch_class = 0,
                                                              .options = options_,
                                                              .clock = clock_});
  }

  gateway_options options_;
  Clock clock_;
  std::unique_ptr<JobStore> jobs_;
  std::unique_ptr<effect_log> effects_;
  queue_type queue_;
  simulated_provider<Clock> provider_;  // without options_.upstream
  std::unique_ptr<http_upstream> http_;  // with it
  model_upstream* upstream_;
  keel::breaker_registry breakers_;
  keel::adaptive_timeout timeout_;
  keel::retry_budget budget_;
  keel::bulkhead pools_;
  std::unique_ptr<batch_worker<Clock, JobStore, keel::null_listener>> workers_;
};

}  // namespace gateway
