// gateway/gateway_core.hpp — the interview-feedback gateway's logic, without
// HTTP: every endpoint is a function from the request to a reply, so a test
// can drive it on keel's manual clock and the HTTP layer
// (gateway/gateway_service.hpp) stays a thin adapter.
//
// Each endpoint takes the plan serving now (plan.hpp: per model, its
// deployments and the pipeline each endpoint runs, every stage of the
// seed's plan in order, built when the plan is and shared by every
// request), makes its keel::call carrying the parsed request
// (gateway/stages.hpp, gateway/chat.hpp) and runs the model's pipeline; then
// the reply, the metrics and the SLOs.
//
// A request carries an Idempotency-Key: the feedback is a decision recorded
// in the learner's history, so a retried request replays the same decision
// (keel::once over SQLite) and a changed body under the same key is a
// conflict. Degraded answers are not recorded as decisions: a retry may get
// the full answer once the model is back.
//
// Batch reports (POST /v1/batch, GET /v1/batch/<id>) go to the durable queue
// (keel::job_queue over SQLite), deduplicated by the same kind of key, and
// are worked by gateway/batch_worker.hpp.
//
// Operators: force the provider's breaker open / closed / automatic, shed a
// class of work, switch the simulated provider's faults; /healthz and
// /metrics (Prometheus text) show what is going on.
//
// The plan a config file describes (the models with their deployments and
// pipelines, the quotas, the client keys) is one `routing`: reload() builds
// a new one for new requests while requests in flight finish on theirs.
//
// Example:
//
//   gateway::gateway_options o;
//   o.data_dir = dir;
//   auto core = gateway::gateway_core<keel::real_clock, keel::sqlite_job_store<>>::open(
//       o, [](const std::string& path) { return keel::sqlite_job_store<>::open(path); });
//   gateway::reply r = (*core)->feedback(body, "key-1");     // {"score":..., "degraded":false, ...}
//
// Thread-safety: every endpoint, and reload(), may be called from any
// number of threads at once; the shared state (breakers, bulkheads, quotas,
// budgets, stores) is in thread-safe keel objects, and the plan serving is
// swapped under a mutex (a request copies its shared_ptr once).
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stop_token>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "fibers.hpp"
#include "text.hpp"
#include "keel/compose/executor.hpp"
#include "keel/compose/fallback.hpp"
#include "keel/compose/pipeline.hpp"
#include "keel/compose/stream.hpp"
#include "keel/compose/token_estimate.hpp"
#include "keel/core/call.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/status.hpp"
#include "keel/durable/digest.hpp"
#include "keel/durable/job_queue.hpp"
#include "keel/durable/once.hpp"
#include "keel/observe/metrics.hpp"
#include "keel/observe/prometheus.hpp"
#include "keel/observe/slo.hpp"
#include "keel/observe/stream_slo.hpp"
#include "keel/observe/telemetry_metrics.hpp"
#include "keel/policy/adaptive_timeout.hpp"
#include "keel/policy/admission.hpp"
#include "keel/policy/breaker_registry.hpp"
#include "keel/policy/bulkhead.hpp"
#include "keel/policy/circuit_breaker.hpp"
#include "keel/policy/retry.hpp"
#include "keel/policy/retry_budget.hpp"
#include "keel/policy/time_limit.hpp"
#include "keel/store/sqlite.hpp"
#include "batch_worker.hpp"
#include "chat.hpp"
#include "effect_log.hpp"
#include "gateway_options.hpp"
#include "plan.hpp"
#include "simulated_provider.hpp"
#include "stages.hpp"
#include "upstream.hpp"

namespace gateway {

// What an endpoint answers; the HTTP layer sends it as is.
struct reply {
  int status = 200;
  std::string body{};
  std::string content_type = "application/json";
  std::optional<keel::duration> retry_after{};  // sent as Retry-After (whole seconds, rounded up)
  bool streamed = false;  // the answer went to the chat_sink as server-sent events; nothing more to send
  bool replayed = false;  // the answer an Idempotency-Key recorded (sent as Idempotent-Replayed: true)
  // Sent as x-should-retry (the header the OpenAI and Anthropic SDKs obey):
  // false when the gateway already spent the retries that make sense, so
  // an SDK's own retries do not multiply upstream calls; unset: not sent.
  std::optional<bool> should_retry{};
};

// Who is asking, as the front door learned it: the tenant of the API key
// it authenticated (gateway_options::api_keys), which the body may then
// leave out; and the client's own timeout (an SDK's X-Stainless-Timeout),
// which shortens the call's deadline: no work for a client that has left.
struct caller_info {
  std::optional<std::string_view> tenant{};
  std::optional<keel::duration> timeout{};
  // The request's Idempotency-Key header, as sent (chat completions).
  std::optional<std::string_view> idempotency_key{};
  // The client's own x-request-id (not one the gateway made): without a
  // key, what ties a client's retries of one request together.
  std::optional<std::string_view> request_id{};
};


[[nodiscard]] inline std::optional<work_class> parse_work_class(std::string_view s) noexcept {
  for (std::size_t i = 0; i < work_class_names.size(); ++i) {
    if (s == work_class_names[i]) return static_cast<work_class>(i);
  }
  return std::nullopt;
}

namespace detail {

[[nodiscard]] inline std::int64_t to_ms(keel::duration d) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(d).count();
}

[[nodiscard]] inline std::string_view code_name(absl::StatusCode c) {
  switch (c) {
    case absl::StatusCode::kOk: return "OK";
    case absl::StatusCode::kCancelled: return "CANCELLED";
    case absl::StatusCode::kInvalidArgument: return "INVALID_ARGUMENT";
    case absl::StatusCode::kDeadlineExceeded: return "DEADLINE_EXCEEDED";
    case absl::StatusCode::kNotFound: return "NOT_FOUND";
    case absl::StatusCode::kAlreadyExists: return "ALREADY_EXISTS";
    case absl::StatusCode::kPermissionDenied: return "PERMISSION_DENIED";
    case absl::StatusCode::kResourceExhausted: return "RESOURCE_EXHAUSTED";
    case absl::StatusCode::kFailedPrecondition: return "FAILED_PRECONDITION";
    case absl::StatusCode::kAborted: return "ABORTED";
    case absl::StatusCode::kUnavailable: return "UNAVAILABLE";
    case absl::StatusCode::kUnauthenticated: return "UNAUTHENTICATED";
    case absl::StatusCode::kUnknown: return "UNKNOWN";
    default: return "INTERNAL";
  }
}

// The HTTP status for a failure. A tenant over its own quota is told 429;
// the service's own limits (bulkheads, shedding, the queue, a model's
// capacity, a quota table full of other tenants, the provider) answer 503:
// the client did nothing wrong.
[[nodiscard]] inline int http_status(const absl::Status& s) {
  if (keel::is_conflict(s) || keel::is_in_flight(s)) return 409;
  // A write the store lost in transit (its server died mid-commit): it may
  // have applied. The store is unavailable, and a retry with the same
  // Idempotency-Key settles it (the job or decision if it landed, a new one
  // if not), so the client is told 503, not 500.
  if (keel::is_unknown_outcome(s)) return 503;
  const std::optional<std::string> by = keel::refused_by(s);
  // A quota table full of other tenants' keys is not the tenant's own quota.
  const bool own_quota = by && by->starts_with("tenant:") && !by->ends_with(":table_full");
  // keel refused because the request's own time ran out (no time left for
  // a stage or an attempt): to the client that is a timeout, not a limit.
  const bool out_of_time = by && (*by == "deadline" || *by == "time_limit" || *by == "adaptive_timeout");
  if (by && !out_of_time && keel::not_started(s) && s.code() != absl::StatusCode::kInvalidArgument) {
    // Refused before any work by a named limit: the tenant's own quota, or
    // the service's (a bulkhead queue that timed out included).
    return own_quota ? 429 : 503;
  }
  switch (s.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange: return 400;
    case absl::StatusCode::kNotFound: return 404;
    case absl::StatusCode::kAlreadyExists: return 409;
    case absl::StatusCode::kPermissionDenied: return 403;
    case absl::StatusCode::kUnauthenticated: return 401;
    case absl::StatusCode::kResourceExhausted: return own_quota ? 429 : 503;
    case absl::StatusCode::kDeadlineExceeded: return 504;
    case absl::StatusCode::kUnimplemented: return 501;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kAborted: return 503;
    default: return 500;
  }
}

// OpenAI's error object ({"message", "type", "param", "code"}: what the
// official SDKs read) with keel's own fields beside it (status, refused_by,
// retry_after_ms, condition), which a client that knows them can use.
[[nodiscard]] inline json openai_error_fields(int http, const absl::Status& s) {
  const bool quota = http == 429;
  const char* type = quota ? "requests" : http == 401 ? "invalid_request_error" : http >= 500 ? "server_error"
                                                                                       : "invalid_request_error";
  json code = nullptr;
  if (quota) code = "rate_limit_exceeded";
  if (http == 401) code = "invalid_api_key";
  if (http == 504) code = "timeout";
  if (keel::is_conflict(s)) code = "idempotency_conflict";
  return {{"type", type}, {"param", nullptr}, {"code", code}};
}

[[nodiscard]] inline reply error_reply(const absl::Status& s, int status = 0) {
  const int http = status != 0 ? status : http_status(s);
  json e = {{"status", code_name(s.code())}, {"message", std::string(s.message())}};
  e.update(openai_error_fields(http, s));
  if (std::optional<std::string> by = keel::refused_by(s)) e["refused_by"] = *by;
  std::optional<keel::duration> after = keel::retry_after(s);
  if (after) e["retry_after_ms"] = to_ms(*after);
  if (keel::is_conflict(s)) e["condition"] = "conflict";
  if (keel::is_in_flight(s)) e["condition"] = "in_flight";
  if (keel::is_unknown_outcome(s)) e["condition"] = "unknown_outcome";
  return {.status = http, .body = dump(json{{"error", e}}), .retry_after = after};
}

[[nodiscard]] inline absl::Status bad_input(std::string_view what) {
  return absl::InvalidArgumentError(std::string(what));
}

// The deepest nesting of arrays and objects a request body may have. A
// request the gateway serves nests a few levels (OpenAI's tool schemas
// perhaps twenty); a 64 KB body of `[[[[...` nests 32,000 deep, and its DOM
// (two small allocations a level, about 2 MB) is built before any field
// check refuses it: 96 of those at once left the heap 50 MB bigger
// (docs/reliability.md, "The soak, open loop").
inline constexpr int max_json_depth = 64;

// The deepest nesting in `body` (brackets inside strings not counted), or
// -1 past `limit`: a linear scan that allocates nothing.
[[nodiscard]] inline int json_depth(std::string_view body, int limit) noexcept {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (const char c : body) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > limit) return -1;
      deepest = std::max(deepest, depth);
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

[[nodiscard]] inline absl::StatusOr<json> parse_object(std::string_view body) {
  // nlohmann's parser stops at a NUL as at the end of the input, so
  // `{...}\0garbage` would pass. JSON text never holds a raw NUL (inside a
  // string it is written \u0000): refuse it before parsing.
  if (const std::size_t nul = body.find('\0'); nul != std::string_view::npos) {
    return bad_input(cat("the body is not valid JSON: a NUL byte at offset ", nul));
  }
  if (json_depth(body, max_json_depth) < 0)
    return bad_input(cat("the body nests arrays and objects deeper than ", max_json_depth, " levels"));
  json j = json::parse(body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return bad_input("the body is not valid JSON");
  if (!j.is_object()) return bad_input("the body must be a JSON object");
  return j;
}

// A required (or defaulted) string field of at most max_bytes.
[[nodiscard]] inline absl::StatusOr<std::string> string_field(const json& j, std::string_view field,
                                                              std::size_t max_bytes,
                                                              std::optional<std::string> fallback = std::nullopt) {
  const auto it = j.find(std::string(field));
  if (it == j.end()) {
    if (fallback) return *fallback;
    return bad_input(cat("'", field, "' is required"));
  }
  if (!it->is_string()) return bad_input(cat("'", field, "' must be a string"));
  std::string v = it->get<std::string>();
  if (v.empty()) return bad_input(cat("'", field, "' must not be empty"));
  if (v.size() > max_bytes)
    return bad_input(cat("'", field, "' must be at most ", max_bytes, " bytes (got ", v.size(), ")"));
  return v;
}

// Names: tenants, models, question ids, learners: [A-Za-z0-9._-], 1-64 bytes.
[[nodiscard]] inline absl::Status check_name(std::string_view field, std::string_view v) {
  if (v.empty() || v.size() > 64)
    return bad_input(cat("'", field, "' must be 1-64 bytes (got ", v.size(), ")"));
  for (char c : v) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                    c == '_' || c == '-';
    if (!ok) return bad_input(cat("'", field, "' may use only letters, digits, '.', '_' and '-'"));
  }
  return absl::OkStatus();
}

// The Idempotency-Key header: required on requests that cause effects.
[[nodiscard]] inline absl::StatusOr<std::string> check_idempotency_key(const std::optional<std::string_view>& key) {
  if (!key) return bad_input("the Idempotency-Key header is required: this request causes an effect");
  if (key->empty()) return bad_input("the Idempotency-Key header must not be empty");
  if (key->size() > keel::max_key_bytes)
    return bad_input(cat("the Idempotency-Key header must be at most ", keel::max_key_bytes,
                                  " bytes (got ", key->size(), ")"));
  for (char c : *key) {
    if (c < 0x21 || c > 0x7e) return bad_input("the Idempotency-Key header must be printable ASCII without spaces");
  }
  return std::string(*key);
}

// The "class" field, if any, must name the class the endpoint serves.
[[nodiscard]] inline absl::Status check_class(const json& j, work_class expected, std::string_view endpoint) {
  const auto it = j.find("class");
  if (it == j.end()) return absl::OkStatus();
  if (!it->is_string()) return bad_input("'class' must be a string");
  const std::string c = it->get<std::string>();
  const std::optional<work_class> w = parse_work_class(c);
  if (!w) return bad_input(cat("unknown class '", c, "' (known: interactive, batch, recovery)"));
  if (*w != expected)
    return bad_input(cat("class '", c, "' is not served by ", endpoint, " (it serves ",
                                  work_class_names[static_cast<std::size_t>(expected)], ")"));
  return absl::OkStatus();
}

}  // namespace detail

// The service's listener: keel's metrics_listener counts every component's
// events, the job queue's included (keel_job_attempts_total{queue,result},
// keel_job_rejections_total{queue}).

template <keel::clock Clock, keel::job_store JobStore>
class gateway_core {
 public:
  using plan_type = plan_builder<Clock>;  // plan.hpp: the models, their deployments and pipelines
  using env_type = typename plan_type::env_type;
  using queue_type = keel::job_queue<JobStore, env_type>;
  using worker_type = batch_worker<Clock, JobStore, gateway_listener>;
  using once_type = typename plan_type::once_type;
  using guard_type = typename plan_type::guard_type;
  using chat_stream = typename plan_type::chat_stream;
  using routing = typename plan_type::routing;
  using model_state = typename plan_type::model_state;
  using tenant_state = typename plan_type::tenant_state;
  using chat_route = typename plan_type::chat_route;

  // Opens the stores under o.data_dir (keel.db, jobs.db, effects.db) with
  // `open_jobs(path)` for the job store; invalid options are refused
  // (InvalidArgument naming the field), a store that cannot open says which
  // file and why. Batch workers are not started: start_workers().
  template <class OpenJobs>
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<gateway_core>> open(gateway_options o, OpenJobs open_jobs,
                                                                          Clock clock = {}) {
    if (absl::Status s = o.validate(); !s.ok()) return s;
    absl::StatusOr<std::unique_ptr<keel::sqlite_store<>>> ids =
        keel::sqlite_store<>::open(o.data_dir + "/keel.db", {.busy_timeout = o.store_busy_timeout});
    if (!ids.ok()) return ids.status();
    absl::StatusOr<std::unique_ptr<JobStore>> jobs = open_jobs(o.data_dir + "/jobs.db");
    if (!jobs.ok()) return jobs.status();
    // The learner-history write comes after the decision is committed (it
    // must not hold a request past its deadline) and is repeated by replays
    // until it is there (feedback() says why).
    absl::StatusOr<std::unique_ptr<effect_log>> effects = effect_log::open(
        o.data_dir + "/effects.db", std::chrono::duration_cast<std::chrono::milliseconds>(o.store_busy_timeout));
    if (!effects.ok()) return effects.status();
    return std::unique_ptr<gateway_core>(
        new gateway_core(std::move(o), std::move(*ids), std::move(*jobs), std::move(*effects), std::move(clock)));
  }

  gateway_core(const gateway_core&) = delete;
  gateway_core& operator=(const gateway_core&) = delete;
  ~gateway_core() {
    shutdown();
    // The plans go first: a plan's hedges wait for their losing attempts,
    // which run on hedge_pool_ and use the builder's timer.
    {
      std::lock_guard lock(routing_mu_);
      routing_.reset();
    }
    start_routing_.reset();
  }

  // Starts o.batch_workers in-process batch workers.
  void start_workers() {
    if (options_.batch_workers > 0) workers_->start(options_.batch_workers);
  }
  // Cancels every running request and stops the workers. Idempotent.
  void shutdown() {
    stop_.request_stop();
    workers_->stop();
  }

  // ---- endpoints -----------------------------------------------------------

  // POST /v1/feedback: {"tenant", "question_id", "answer", ["model"], ["class"]}
  // with an Idempotency-Key. `caller`: what the front door learned of the
  // client (caller_info); every endpoint below takes it the same way.
  reply feedback(std::string_view body, const std::optional<std::string_view>& key_header,
                 const caller_info& caller = {}) {
    const keel::time_point t0 = clock_.now();
    const std::shared_ptr<routing> rt = routing_now();  // this request's, whatever reloads come
    absl::StatusOr<feedback_request> parsed = parse_feedback(*rt, body, key_header, caller.tenant);
    if (!parsed.ok()) return answered("feedback", detail::error_reply(parsed.status()));
    const feedback_request& rq = *parsed;
    const tenant_state& tenant = rt->tenant_of(rq.tenant);
    const model_state& model = *rt->find(rq.model);
    const deadline_plan& plan = options_.interactive;

    // The request travels with the call; the model's pipeline, built at
    // startup, does the rest. The stages write what they learn to `p`.
    interactive_progress p;
    p.question->idempotency_key = cat(rq.tenant, "/", rq.key);
    p.question->model = rq.model;
    const interactive_request req{
        .body = rq,
        .tenant = *tenant.config,
        .model = model.config,
        .tenant_key = tenant.key ? &tenant.key : nullptr,
        .progress = p};
    keel::call call(t0,
                    {.timeout = caller.timeout ? std::min(plan.deadline, *caller.timeout) : plan.deadline,
                     .response_reserve = plan.response_reserve,
                     .stop = stop_.get_token(),
                     .labels = {.tenant = rq.tenant,
                                .model = rq.model,
                                .endpoint = model.primary->name(),
                                .region = tenant.config->region,
                                .work_class = "interactive"},
                     .max_attempts = 2 + model.interactive_attempts},
                    req);
    absl::StatusOr<detail::answer> got = model.interactive(call, t0);
    const keel::time_point done = clock_.now();

    if (got.ok() && p.decision) {
      const keel::once_result& r = *p.decision;
      // The effect: the decision goes into the learner's history once. The
      // decision commits in keel.db and the row in effects.db, so no one
      // transaction holds both; instead the row is written by every reply
      // that carries the decision, fresh or replayed, and written only if
      // it is not there. A crash between the two commits leaves the client
      // without an answer; its retry replays the decision and writes the row.
      if (effect_hook_) effect_hook_("decided");
      if (absl::StatusOr<bool> e = effects_->record_feedback(rq.tenant, rq.key, r.decision.id); !e.ok()) {
        effect_errors_->inc();
      } else if (*e && r.replayed) {
        effects_replayed_->inc();
      }
      const detail::json stored = detail::json::parse(r.decision.result, nullptr, false);
      detail::json out = stored.is_object() ? stored : detail::json::object();
      out["decision_id"] = r.decision.id;
      out["model_digest"] = r.decision.model_digest;
      out["policy_revision"] = r.decision.policy_revision;
      out["replayed"] = r.replayed;
      out["degraded"] = false;
      out["recorded"] = true;
      finish_body(out, call, t0, p, done);
      return served(work_class::interactive, keel::request_outcome::success,
                    r.replayed ? "replay" : out.value("served_by", std::string("model")), out, t0, done);
    }
    if (got.ok()) {
      // Only the fallback answers without a decision: degraded, not recorded.
      got->served_by = std::string(call.record().served_by);
      detail::json out = detail::to_json(*got);
      out["decision_id"] = nullptr;
      out["replayed"] = false;
      out["degraded"] = true;
      out["recorded"] = false;  // a retry with the same key decides again
      finish_body(out, call, t0, p, done);
      return served(work_class::interactive, keel::request_outcome::partial, got->served_by, out, t0, done);
    }
    const absl::Status& s = got.status();
    if (std::optional<std::string_view> reason = admission_refusal(s)) {
      // A tenant over its own quota is its own doing and stays out of the
      // SLO; the service's limits (a model's quota, a quota table full of
      // other tenants' keys, the bulkhead, shedding) are the service's.
      const bool own_quota = *reason == "tenant_quota";
      return rejected(work_class::interactive, *reason, s, t0, /*counts_in_slo=*/!own_quota);
    }
    if (keel::is_conflict(s)) return answered("feedback", detail::error_reply(s));
    if (keel::is_in_flight(s)) return rejected(work_class::interactive, "in_flight", s, t0, /*counts_in_slo=*/false);
    // A clear failure: the model did not answer and no fallback could.
    record_slo(work_class::interactive, keel::request_outcome::failure, done - t0, done);
    reply e = !p.found_rubric && !p.retrieval_error.empty()
                  // Without a rubric there is no fallback: say so, or an outage reads as a mystery.
                  ? detail::error_reply(keel::annotate(s, cat("no rubric-only fallback (", p.retrieval_error, ")")), 0)
                  : detail::error_reply(s);
    return answered("feedback", after_attempts(std::move(e), call));
  }

  // A request the HTTP layer refused itself (gateway/http_server.hpp):
  // counted like every reply, and JSON like every error. refused_by
  // "http:<reason>"; a 408 or 503 says when to come back.
  reply http_refused(std::string_view endpoint, std::string_view reason, int status, std::string_view message) {
    absl::Status s = status == 408   ? absl::DeadlineExceededError(std::string(message))
                     : status == 503 ? absl::UnavailableError(std::string(message))
                     : status >= 500 ? absl::InternalError(std::string(message))
                                     : absl::InvalidArgumentError(std::string(message));
    if (status < 500 || status == 503) s = keel::with_refused_by(keel::mark_not_started(std::move(s)), cat("http:", reason));
    if (status == 408 || status == 503) s = keel::with_retry_after(std::move(s), std::chrono::seconds(1));
    http_refusals_->with({reason}).inc();
    return answered(endpoint, detail::error_reply(s, status));
  }

  // POST /v1/chat/completions (OpenAI-compatible): {"tenant", ["model"],
  // "messages": [{"role", "content"}], ["max_tokens"], ["stream"], and any
  // other OpenAI field, sent upstream as it came}. One deadline (the
  // model's, model_config::chat) for the whole stream; admission
  // reserves the model's token estimate and settles it to what the streams
  // were billed; the "streaming" bulkhead class; then the model's stream
  // through retry, the fleet's gate and the provider's breaker, under the
  // guard's three budgets and its first-token hedge. Before the first token
  // a failed stream fails over to the model's next deployments; after it, a
  // stream cut short is continued on the second (degraded). With "stream": true
  // and a sink the tokens go to `sink` as they come (reply.streamed);
  // otherwise the answer is one chat.completion. Nothing is sent before the
  // first token: a failure until then is an ordinary JSON error.
  //
  // With an Idempotency-Key (caller.idempotency_key; the IETF
  // Idempotency-Key draft's rules), a complete answer is recorded in
  // keel.db under the tenant and key, and a retry gets it again, streamed
  // or not as the retry asks (a stream replays as one content chunk, then
  // the finish chunk with usage), with reply.replayed set, after a restart
  // too. The same key with another request: 422. The same key while the
  // first is running: 409 with a retry hint. A partial or failed answer is
  // not recorded: the key stays free. Whatever ties a client's retries
  // together (the key, or the client's own request id) also ties their
  // attempts: a retry after a failure gets what is left of the attempt
  // cap, spends the retry budget, and is refused at once when nothing is left.
  reply chat_completions(std::string_view body, chat_sink* sink, const caller_info& caller = {}) {
    const keel::time_point t0 = clock_.now();
    const std::shared_ptr<routing> rt = routing_now();  // this request's, whatever reloads come
    absl::StatusOr<chat_request> parsed = parse_chat(*rt, body, caller.tenant);
    if (!parsed.ok()) return answered("chat", detail::error_reply(parsed.status()));
    const chat_request& rq = *parsed;
    if (!caller.idempotency_key) return serve_chat(*rt, rq, sink, caller, t0, nullptr);
    absl::StatusOr<std::string> key = detail::check_idempotency_key(caller.idempotency_key);
    if (!key.ok()) return answered("chat", detail::error_reply(key.status()));
    const keel::request_identity id{.tenant = rq.tenant, .endpoint = "chat", .key = *key};
    keel::call claim(t0, {.timeout = rt->find(rq.model)->budgets.deadline, .stop = stop_.get_token()});
    std::optional<reply> fresh;
    absl::StatusOr<keel::once_result> r =
        chat_once_.run(claim, id, chat_digest(rq), [&](const keel::claim_context& c) -> absl::StatusOr<keel::decision> {
          std::string completion;
          // Never past the claim's lease: a duplicate may take the key over after it.
          caller_info within = caller;
          const keel::duration lease_left = c.deadline.remaining(clock_.now());
          within.timeout = caller.timeout ? std::min(*caller.timeout, lease_left) : lease_left;
          fresh = serve_chat(*rt, rq, sink, within, t0, &completion);
          // Only a complete answer is the key's; anything else leaves it free.
          if (completion.empty()) return absl::AbortedError("not a complete answer: not recorded");
          return keel::decision{.model_digest = rq.model, .result = std::move(completion)};
        });
    if (fresh) return std::move(*fresh);  // it ran here, recorded or not
    if (!r.ok()) {
      const absl::Status& s = r.status();
      // The draft's codes: another request under a used key is 422 (a 409
      // would be retried by the SDKs for nothing); one still running, 409.
      if (keel::is_conflict(s)) return answered("chat", detail::error_reply(s, 422));
      if (keel::is_in_flight(s)) return answered("chat", detail::error_reply(s, 409));
      return answered("chat", detail::error_reply(s));
    }
    return answered("chat", replay_chat(r->decision.result, rq, rq.stream ? sink : nullptr));
  }

  // What an Idempotency-Key is held to: the request as its upstreams get it
  // (keys sorted), its tenant, model and token cap; not "stream" (a retry
  // may ask for the answer either way). Made only for keyed requests.
  [[nodiscard]] static keel::digest chat_digest(const chat_request& rq) {
    return keel::digest_builder()
        .field("tenant", rq.tenant)
        .field("model", rq.model)
        .field("max_tokens", std::int64_t{rq.max_tokens})
        .field("request", detail::dump(rq.upstream_request))
        .finish();
  }

  // The stored answer of a keyed chat request, as the retry asks for it.
  reply replay_chat(const std::string& stored, const chat_request& rq, chat_sink* sink) {
    detail::json out = detail::json::parse(stored, nullptr, false);
    if (!out.is_object() || !out.contains("choices"))
      return detail::error_reply(absl::DataLossError("the recorded answer for this Idempotency-Key cannot be read"));
    out["keel"]["replayed"] = true;
    if (sink == nullptr) return {.status = 200, .body = detail::dump(out), .replayed = true};
    std::stop_source stop;
    const detail::json& message = out["choices"][0]["message"];
    chat_relay relay(sink, out.value("id", std::string("chatcmpl-replay")), out.value("created", std::int64_t{0}),
                     rq.model, stop);
    relay.open();
    if (message.contains("content") && message["content"].is_string() && !message["content"].get_ref<const std::string&>().empty())
      relay.token(message["content"].get_ref<const std::string&>());
    if (message.contains("refusal") && message["refusal"].is_string())
      relay.event(cat(R"({"index":0,"delta":{"refusal":)", detail::dump(message["refusal"]), R"(},"finish_reason":null}])"));
    if (message.contains("tool_calls") && message["tool_calls"].is_array()) {
      // Each call whole, in one fragment with its index.
      detail::json calls = detail::json::array();
      for (std::size_t i = 0; i < message["tool_calls"].size(); ++i) {
        detail::json c = message["tool_calls"][i];
        c["index"] = i;
        calls.push_back(std::move(c));
      }
      relay.event(cat(R"({"index":0,"delta":{"tool_calls":)", detail::dump(calls), R"(},"finish_reason":null}])"));
    }
    relay.event(cat(R"({"index":0,"delta":{},"finish_reason":")",
                    out["choices"][0].value("finish_reason", std::string("stop")), "\"}]"));
    relay.event(cat("],\"usage\":", detail::dump(out["usage"]), ",\"keel\":", detail::dump(out["keel"])));
    relay.done();
    return {.status = 200, .streamed = true, .replayed = true};
  }

  // POST /v1/batch: {"tenant", "learner", "sessions": [...], ["model"], ["class"]}
  // with an Idempotency-Key. 202 with the job (200 when the key was seen).
  reply batch_submit(std::string_view body, const std::optional<std::string_view>& key_header,
                     const caller_info& caller = {}) {
    const keel::time_point t0 = clock_.now();
    const std::shared_ptr<routing> rt = routing_now();
    absl::StatusOr<batch_request> parsed = parse_batch(*rt, body, key_header, caller.tenant);
    if (!parsed.ok()) return answered("batch", detail::error_reply(parsed.status()));
    const batch_request& rq = *parsed;
    if (shed_[idx(work_class::batch)].load(std::memory_order_relaxed)) {
      return rejected(work_class::batch, "shed", shed_switch::refusal(work_class_names[idx(work_class::batch)]), t0);
    }
    // The tenant's quota counts the submission; the job's compute is spent
    // later, by a worker.
    keel::admission::refusal_reason why;
    keel::admission_ticket ticket = rt->quotas.try_admit({.tenant = rq.tenant, .model = rq.model}, t0, why);
    if (!ticket) return quota_refusal(work_class::batch, why, t0);
    absl::StatusOr<keel::job_submission> s = queue_.submit(rq.tenant, rq.key, rq.payload);
    if (!s.ok()) {
      if (keel::is_job_queue_full(s.status())) return rejected(work_class::batch, "job_queue", s.status(), t0);
      return answered("batch", detail::error_reply(s.status()));  // 409 for a key reused with another body
    }
    detail::json out = {{"job_id", s->id},
                        {"state", std::string(keel::to_string(s->state))},
                        {"attempts", s->attempts},
                        {"created", s->created},
                        {"replayed", !s->created}};
    return answered("batch", {.status = s->created ? 202 : 200, .body = detail::dump(out)});
  }

  // GET /v1/batch/<id>?tenant=<tenant>
  reply batch_status(std::string_view id_text, const std::optional<std::string_view>& tenant) {
    // One spelling per job: digits only, no sign, no leading zero ("+1" and
    // "01" are not job 1; a lenient parse would let two paths name one job).
    std::int64_t id = 0;
    const bool canonical = !id_text.empty() && id_text.size() <= 18 && id_text.front() != '0' &&
                           std::all_of(id_text.begin(), id_text.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (!canonical || std::from_chars(id_text.data(), id_text.data() + id_text.size(), id).ec != std::errc()) {
      return answered("batch_status", detail::error_reply(detail::bad_input("the job id must be a positive integer, "
                                                                            "in digits without a sign or leading zero")));
    }
    if (!tenant) return answered("batch_status", detail::error_reply(detail::bad_input("'tenant' is required")));
    if (absl::Status s = detail::check_name("tenant", *tenant); !s.ok()) {
      return answered("batch_status", detail::error_reply(s));
    }
    absl::StatusOr<std::optional<keel::job_info>> j = queue_.get(id);
    if (!j.ok()) return answered("batch_status", detail::error_reply(j.status()));
    // Another tenant's job does not exist, as far as this tenant can tell.
    if (!j->has_value() || (*j)->tenant != *tenant || (*j)->queue != queue_.options().queue) {
      return answered("batch_status",
                      detail::error_reply(absl::NotFoundError(cat("no job ", id, " for this tenant"))));
    }
    const keel::job_info& info = **j;
    detail::json out = {{"job_id", info.id},
                        {"tenant", info.tenant},
                        {"key", info.key},
                        {"state", std::string(keel::to_string(info.state))},
                        {"attempts", info.attempts},
                        {"max_attempts", info.max_attempts},
                        {"fence", info.fence},
                        {"took_over", info.took_over}};
    if (info.state == keel::job_state::done) {
      const detail::json report = detail::json::parse(info.result, nullptr, false);
      out["report"] = report.is_discarded() ? detail::json(info.result) : report;
    }
    if (info.error_code != absl::StatusCode::kOk) {
      out["last_error"] = {{"status", detail::code_name(info.error_code)}, {"message", info.error_message}};
    }
    return answered("batch_status", {.status = 200, .body = detail::dump(out)});
  }

  // POST /admin/breaker: {"provider": "<name>", "mode": "open" | "closed" | "auto"}
  reply admin_breaker(std::string_view body) {
    return operator_request("admin_breaker", [&]() -> reply {
      absl::StatusOr<detail::json> j = detail::parse_object(body);
      if (!j.ok()) return detail::error_reply(j.status());
      absl::StatusOr<std::string> provider = detail::string_field(*j, "provider", 64, primary_->name());
      if (!provider.ok()) return detail::error_reply(provider.status());
      absl::StatusOr<std::string> mode = detail::string_field(*j, "mode", 16);
      if (!mode.ok()) return detail::error_reply(mode.status());
      if (*provider != primary_->name()) {
        return detail::error_reply(absl::NotFoundError(cat("no provider '", *provider, "'")));
      }
      if (*mode != "open" && *mode != "closed" && *mode != "auto") {
        return detail::error_reply(detail::bad_input("'mode' must be open, closed or auto"));
      }
      const keel::breaker_state s = force_breaker(*mode);
      return {.status = 200, .body = detail::dump({{"provider", *provider}, {"state", std::string(keel::to_string(s))}})};
    });
  }

  // POST /admin/shed: {"class": "interactive" | "batch", "shed": true | false}
  reply admin_shed(std::string_view body) {
    return operator_request("admin_shed", [&]() -> reply {
      absl::StatusOr<detail::json> j = detail::parse_object(body);
      if (!j.ok()) return detail::error_reply(j.status());
      absl::StatusOr<std::string> cls = detail::string_field(*j, "class", 32);
      if (!cls.ok()) return detail::error_reply(cls.status());
      const std::optional<work_class> w = parse_work_class(*cls);
      if (!w) {
        return detail::error_reply(
            detail::bad_input(cat("unknown class '", *cls, "' (known: interactive, batch, recovery)")));
      }
      if (*w == work_class::recovery) {
        return detail::error_reply(detail::bad_input("the recovery class cannot be shed: operators need it"));
      }
      const auto it = j->find("shed");
      if (it == j->end() || !it->is_boolean()) return detail::error_reply(detail::bad_input("'shed' must be true or false"));
      set_shed(*w, it->get<bool>());
      return {.status = 200, .body = detail::dump({{"class", *cls}, {"shed", it->get<bool>()}})};
    });
  }

  // POST /admin/fault: {"kind": "none" | "slowdown" | "stall" | "rate_limit" |
  // "outage" | "invalid_output", ["factor"], ["retry_after_ms"], ["ratio"]}
  reply admin_fault(std::string_view body) {
    return operator_request("admin_fault", [&]() -> reply {
      absl::StatusOr<detail::json> j = detail::parse_object(body);
      if (!j.ok()) return detail::error_reply(j.status());
      absl::StatusOr<std::string> kind = detail::string_field(*j, "kind", 32);
      if (!kind.ok()) return detail::error_reply(kind.status());
      if (http_primary_ != nullptr) {
        // A real upstream's faults are its own (examples/mock_upstream takes
        // them on its /control/fault); the gateway does not pretend.
        return detail::error_reply(absl::FailedPreconditionError(
            cat("the model upstream is an HTTP server (", http_primary_->options().base_url,
                "): switch faults on the upstream itself")),
            409);
      }
      absl::StatusOr<std::string> which = detail::string_field(*j, "provider", 64, provider_.name());
      if (!which.ok()) return detail::error_reply(which.status());
      if (*which != provider_.name() && *which != backup_.name()) {
        return detail::error_reply(
            absl::NotFoundError(cat("no provider '", *which, "' (known: ", provider_.name(), ", ", backup_.name(), ")")));
      }
      simulated_provider<Clock>& target = *which == provider_.name() ? provider_ : backup_;
      const std::optional<fault_kind> k = parse_fault_kind(*kind);
      if (!k) {
        return detail::error_reply(detail::bad_input(cat(
            "unknown fault '", *kind, "' (known: none, slowdown, stall, rate_limit, outage, invalid_output)")));
      }
      fault f{.kind = *k};
      for (const char* field : {"factor", "ratio", "retry_after_ms"}) {
        const auto it = j->find(field);
        if (it == j->end()) continue;
        if (!it->is_number()) return detail::error_reply(detail::bad_input(cat("'", field, "' must be a number")));
        const double v = it->get<double>();
        if (std::string_view(field) == "factor") f.factor = v;
        if (std::string_view(field) == "ratio") f.ratio = v;
        if (std::string_view(field) == "retry_after_ms") {
          if (!(v >= 0 && v <= 3'600'000)) {
            return detail::error_reply(detail::bad_input("'retry_after_ms' must be in [0, 3600000]"));
          }
          f.retry_after = std::chrono::duration_cast<keel::duration>(std::chrono::duration<double, std::milli>(v));
        }
      }
      if (absl::Status s = target.set_fault(f); !s.ok()) return detail::error_reply(s);
      return {.status = 200, .body = detail::dump({{"provider", target.name()}, {"fault", *kind}})};
    });
  }

  // GET /healthz
  reply health() {
    return operator_request("health", [&]() -> reply {
      const keel::time_point now = clock_.now();
      detail::json breakers = detail::json::array();
      bool degraded = false;
      for (const keel::breaker_entry& e : breakers_.list(now)) {
        degraded |= e.state.state != keel::breaker_state::closed;
        breakers.push_back({{"domain", e.domain},
                            {"state", std::string(keel::to_string(e.state.state))},
                            {"failure_rate", e.state.failure_rate},
                            {"open_remaining_ms", detail::to_ms(e.state.open_remaining)}});
      }
      detail::json shed = detail::json::array();
      for (work_class w : {work_class::interactive, work_class::batch}) {
        if (shed_[idx(w)].load(std::memory_order_relaxed)) {
          shed.push_back(std::string(work_class_names[idx(w)]));
          degraded = true;
        }
      }
      detail::json pools = detail::json::object();
      for (std::size_t c = 0; c < pools_.classes(); ++c) {
        const keel::bulkhead_figures f = pools_.figures(c);
        pools[std::string(f.name)] = {{"capacity", f.capacity}, {"active", f.active}, {"queued", f.queued},
                                      {"rejected", f.rejected}, {"timed_out", f.timed_out}};
      }
      // A job store that cannot be read is not "ok": say so, with its error.
      detail::json batch_queue;
      if (absl::StatusOr<keel::job_counts> c = queue_.counts(); c.ok()) {
        batch_queue = {{"queued", c->queued}, {"running", c->running}, {"done", c->done},
                       {"failed", c->failed}, {"expired", c->expired}, {"depth", c->depth}};
      } else {
        batch_queue = {{"error", c.status().ToString()}};
        degraded = true;
      }
      detail::json out = {{"status", degraded ? "degraded" : "ok"},
                          {"breakers", breakers},
                          {"shed", shed},
                          {"fault", http_primary_ ? "upstream" : std::string(to_string(provider_.current_fault().kind))},
                          {"bulkheads", pools},
                          {"batch_queue", batch_queue}};
      if (fleet_ != nullptr) {
        const keel::shared_concurrency_status c = fleet_->concurrency().status(now);
        out["fleet"] = {{"redis", fleet_->redis()},
                        {"concurrency", {{"source", std::string(keel::to_string(c.source))},
                                         {"limit", fleet_->concurrency().options().limit},
                                         {"local_share", c.local_share},
                                         {"shared_decisions", fleet_->concurrency().shared_decisions()},
                                         {"local_share_decisions", fleet_->concurrency().local_share_decisions()}}},
                        {"provider_state", {{"deciding_alone", fleet_->state().deciding_alone(now)},
                                            {"round_trips", fleet_->state().round_trips()},
                                            {"redis_failures", fleet_->state().redis_failures()}}}};
      }
      detail::json slos = detail::json::object();
      for (const keel::slo_report& s : slos_.report(now)) {
        slos[s.work_class] = {{"target", s.availability.target},
                              {"error_budget_allowed", s.availability.allowed},
                              {"error_budget_remaining", s.availability.remaining},
                              {"requests", s.in_window.requests()}};
      }
      out["slo"] = slos;
      const keel::stream_figures g = stream_totals();
      out["streams"] = {{"attempts", g.attempts},
                        {"committed", g.committed},
                        {"first_token_timeouts", g.first_token_timeouts},
                        {"stalls", g.stalls},
                        {"mid_stream_failures", g.mid_stream_failures},
                        {"hedges_started", g.hedges_started},
                        {"hedge_wins", g.hedge_wins},
                        {"continuations", g.continuations},
                        {"hedge_delay_ms", std::chrono::duration<double, std::milli>(stream_guard().current_hedge_delay()).count()},
                        {"backup", {{"provider", second_->name()},
                                    {"fault", http_backup_ ? "upstream" : std::string(to_string(backup_.current_fault().kind))}}}};
      if (const std::shared_ptr<routing> rt = routing_now(); http_primary_ != nullptr) {
        detail::json ups = detail::json::array();
        for (const http_upstream* u : upstreams_in(*rt)) {
          const upstream_figures f = u->figures();
          ups.push_back({{"name", u->name()}, {"base_url", u->options().base_url}, {"model", u->options().model},
                         {"calls", f.calls}, {"answered", f.answered}, {"failed", f.failed}});
        }
        out["upstreams"] = std::move(ups);
      }
      return {.status = 200, .body = detail::dump(out)};
    });
  }

  // GET /metrics: Prometheus text.
  reply metrics() {
    return operator_request("metrics", [&]() -> reply {
      absl::StatusOr<std::string> text = keel::to_prometheus_text(registry_.snapshot());
      if (!text.ok()) return detail::error_reply(text.status(), 500);
      return {.status = 200, .body = std::move(*text), .content_type = std::string(keel::prometheus_content_type)};
    });
  }

  // Any other path.
  // POST /v1/embeddings (OpenAI-compatible): {"model", "input", ...} sent
  // to the model's first deployment under its name there, every other
  // field (encoding_format, dimensions, user) as the client sent it; the
  // answer relayed as the upstream sent it. "tenant", keel's, is not sent.
  reply embeddings(std::string_view body, const caller_info& caller = {}) {
    const keel::time_point t0 = clock_.now();
    const std::shared_ptr<routing> rt = routing_now();
    absl::StatusOr<detail::json> j = detail::parse_object(body);
    if (!j.ok()) return answered("embeddings", detail::error_reply(j.status()));
    absl::StatusOr<std::string> tenant_name = request_tenant(*j, caller.tenant);
    if (!tenant_name.ok()) return answered("embeddings", detail::error_reply(tenant_name.status()));
    if (absl::Status s = detail::check_name("tenant", *tenant_name); !s.ok())
      return answered("embeddings", detail::error_reply(s));
    absl::StatusOr<std::string> model_name = detail::string_field(*j, "model", 64, rt->default_model());
    if (!model_name.ok()) return answered("embeddings", detail::error_reply(model_name.status()));
    model_state* found = rt->find(*model_name);
    if (found == nullptr)
      return answered("embeddings", detail::error_reply(detail::bad_input(cat("unknown model '", *model_name, "'"))));
    const auto input = j->find("input");
    if (input == j->end() || !(input->is_string() || (input->is_array() && !input->empty())))
      return answered("embeddings",
                      detail::error_reply(detail::bad_input("'input' must be a string or a non-empty array")));
    j->erase("tenant");
    model_state& model = *found;
    const tenant_state& tenant = rt->tenant_of(*tenant_name);
    const embeddings_call carried{.tenant_key = tenant.key ? &tenant.key : nullptr,
                                  .reserved = static_cast<std::int64_t>(input->dump().size() / 4 + 1)};
    keel::call call(t0,
                    {.timeout = caller.timeout ? std::min(options_.interactive.deadline, *caller.timeout)
                                               : options_.interactive.deadline,
                     .stop = stop_.get_token(),
                     .labels = {.tenant = *tenant_name,
                                .model = *model_name,
                                .endpoint = model.primary->name(),
                                .region = tenant.config->region,
                                .work_class = "interactive"},
                     .max_attempts = options_.model_attempts + model.embed_fallbacks},
                    carried);
    absl::StatusOr<std::string> r = model.embed(call, t0, *j);
    if (!r.ok()) {
      return answered("embeddings", after_attempts(detail::error_reply(r.status()), call));
    }
    return answered("embeddings", {.status = 200, .body = std::move(*r)});
  }

  // GET /v1/batch/<id>?tenant=<t> naming another tenant than the API key's.
  reply refuse_tenant(std::string_view endpoint, std::string_view caller) {
    return answered(endpoint, detail::error_reply(absl::PermissionDeniedError(
                                  cat("this API key belongs to tenant '", caller, "'; the query names another"))));
  }

  // GET /v1/models: the models clients may name, as OpenAI lists them.
  reply list_models() {
    detail::json data = detail::json::array();
    const std::shared_ptr<routing> rt = routing_now();
    for (const model_config& m : rt->models)
      data.push_back({{"id", m.name}, {"object", "model"}, {"created", 0}, {"owned_by", "keel-gateway"}});
    return answered("models", {.status = 200, .body = detail::dump({{"object", "list"}, {"data", std::move(data)}})});
  }

  // A /v1/ request without a valid "Authorization: Bearer" key, when the
  // gateway has keys (gateway_options::api_keys): 401, as OpenAI answers it.
  reply unauthorized(std::string_view endpoint, std::string_view why) {
    return answered(endpoint, detail::error_reply(absl::UnauthenticatedError(std::string(why)), 401));
  }

  reply not_found(std::string_view path) {
    return answered("other", detail::error_reply(absl::NotFoundError(
                                 cat("no endpoint ", path.substr(0, 100),
                                              " (try POST /v1/feedback, POST /v1/chat/completions, POST /v1/batch, GET /v1/batch/<id>, "
                                              "GET /v1/models, GET /healthz, GET /metrics, POST /admin/{breaker,shed,fault})"))));
  }

  // ---- the in-process operator API ----------------------------------------

  simulated_provider<Clock>& provider() noexcept { return provider_; }
  // The second model: chat streams fail over and continue on it.
  simulated_provider<Clock>& backup_provider() noexcept { return backup_; }
  // The model upstreams over HTTP (gateway_options::upstream); null without them.
  // The threads requests run on as fibers, or null (a worker thread each).
  [[nodiscard]] fiber_pool* fibers() const noexcept { return fibers_.get(); }
  [[nodiscard]] const http_upstream* http_primary() const noexcept { return http_primary_.get(); }
  [[nodiscard]] const http_upstream* http_backup() const noexcept { return http_backup_.get(); }
  // Every HTTP upstream the gateway calls now: its own, then each model's
  // (valid until the next reload()).
  [[nodiscard]] std::vector<const http_upstream*> http_upstreams() const { return upstreams_in(*routing_now()); }

  // ---- configuration reload -----------------------------------------------

  struct reload_result {
    std::int64_t generation = 0;  // the plan now serving (the first is 1)
    // Settings the new options change that only a restart applies (named
    // as gateway_options names them); they keep their old values.
    std::vector<std::string> kept_until_restart{};
  };

  // Serves new requests with a plan built from `o`: the models, their
  // deployments and pipelines, the tenants' and models' quotas, the API
  // keys. Requests in flight finish on the plan they started with (each
  // holds it; the old one goes when its last request does). A refused `o`
  // (not ok: the file could not be read or parsed; or invalid) leaves the
  // plan as it was. Both are counted (gateway_config_reloads_total). Quota
  // buckets start full in the new plan; breakers are per deployment name
  // and keep their state. One reload at a time; from any thread.
  absl::StatusOr<reload_result> reload(absl::StatusOr<gateway_options> o) {
    std::lock_guard serial(reload_mu_);
    if (o.ok()) {
      if (absl::Status s = o->validate(); !s.ok()) o = std::move(s);
    }
    if (!o.ok()) {
      reloads_->with({"refused"}).inc();
      return o.status();
    }
    reload_result out{.generation = routing_now()->generation + 1, .kept_until_restart = restart_only_changes(*o)};
    std::shared_ptr<routing> next = plan_.build(*o, out.generation, routing_now().get());
    {
      std::lock_guard lock(routing_mu_);
      routing_.swap(next);
    }
    next.reset();  // the old plan, unless requests still hold it
    reloads_->with({"applied"}).inc();
    return out;
  }

  // The API keys of the plan serving now (gateway_options::api_keys); the
  // caller holds them as long as it reads them.
  [[nodiscard]] std::shared_ptr<const std::vector<api_key>> api_keys() const { return routing_now()->api_keys; }
  [[nodiscard]] std::int64_t plan_generation() const { return routing_now()->generation; }

  // The default model's stream guard in the plan serving now.
  guard_type& stream_guard() { const auto rt = routing_now(); return *rt->find(rt->default_model())->guard; }
  // What every model's stream guard did, summed (each model has its own budgets).
  [[nodiscard]] keel::stream_figures stream_totals() const { return plan_.stream_totals(); }
  keel::breaker_registry& breakers() noexcept { return breakers_; }
  keel::circuit_breaker& provider_breaker() { return breakers_.breaker_for(provider_domain()); }
  // What the replicas share through Redis; null without one.
  fleet_sharing* fleet() noexcept { return fleet_.get(); }
  keel::bulkhead& bulkheads() noexcept { return pools_; }
  // The quotas of the plan serving now (until the next reload()).
  keel::admission& quotas() noexcept { return routing_now()->quotas; }
  keel::slo_tracker& slos() noexcept { return slos_; }
  keel::metrics_registry& registry() noexcept { return registry_; }
  queue_type& queue() noexcept { return queue_; }
  effect_log& effects() noexcept { return *effects_; }
  worker_type& workers() noexcept { return *workers_; }
  const gateway_options& options() const noexcept { return options_; }
  const Clock& clock() const noexcept { return clock_; }

  // For crash tests: called with "decided" after a fresh or replayed
  // decision is committed, before its learner-history row is written.
  void set_effect_hook(std::function<void(std::string_view)> hook) { effect_hook_ = std::move(hook); }

  void set_shed(work_class w, bool on) { shed_[idx(w)].store(on, std::memory_order_relaxed); }

  // "open", "closed" or "auto" (anything else: auto). Returns the new state.
  keel::breaker_state force_breaker(std::string_view mode) {
    keel::circuit_breaker& b = provider_breaker();
    const keel::time_point now = clock_.now();
    if (mode == "open") {
      b.force_open(now);
    } else if (mode == "closed") {
      b.force_closed(now);
    } else {
      b.automatic(now);
    }
    return b.state();
  }

 private:
  struct batch_request {
    std::string tenant, model, key, payload;
  };


  [[nodiscard]] std::shared_ptr<routing> routing_now() const {
    std::lock_guard lock(routing_mu_);
    return routing_;
  }

  // One chat request on plan `rt`: the pipeline, the reply, the metrics.
  // `completion`: set to the answer as one chat.completion when it is
  // complete (what an Idempotency-Key records).
  reply serve_chat(routing& rt, const chat_request& rq, chat_sink* sink, const caller_info& caller,
                   keel::time_point t0, std::string* completion) {
    const bool streaming = rq.stream && sink != nullptr;
    const tenant_state& tenant = rt.tenant_of(rq.tenant);
    model_state& model = *rt.find(rq.model);
    const chat_call carried{.body = rq,
                            .tenant_key = tenant.key ? &tenant.key : nullptr,
                            .reserved = model.tokens.estimate(rq.input_tokens, rq.max_tokens)};
    // The call stops for a service shutdown or a client that went away.
    std::stop_source stop;
    auto forward = [&stop] { stop.request_stop(); };
    std::stop_callback<decltype(forward)> on_shutdown(stop_.get_token(), forward);
    std::optional<std::stop_callback<decltype(forward)>> on_gone;
    if (streaming) on_gone.emplace(sink->client_gone(), forward);
    const std::int64_t created =
        std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
    const std::string id = cat("chatcmpl-", chat_ids_.fetch_add(1, std::memory_order_relaxed) + 1);
    chat_relay relay(streaming ? sink : nullptr, id, created, rq.model, stop);
    chat_stream stream(*model.guard, relay_token{&relay});
    stream.reserve(static_cast<std::size_t>(rq.max_tokens) * 8);
    // A client's retry of a request that failed here continues its attempt
    // count (the cap is the request's, not each retry's) and spends the
    // retry budget instead of depositing a new request.
    const int cap = 2 * model.budgets.attempts + 4;
    const std::string tie = tie_of(rq, caller);
    const int spent = tie.empty() ? 0 : attempts_spent(tie, t0);
    if (spent >= cap) {
      rejections_->with({"streaming", "attempts_spent"}).inc();
      reply e = detail::error_reply(keel::with_refused_by(absl::UnavailableError(cat(
                                       "this request's retries already spent its ", spent, " attempts of ", cap,
                                       "; the gateway will not try it again")), "attempts"), 503);
      e.should_retry = false;
      return answered("chat", std::move(e));
    }
    keel::call call(t0,
                    {.timeout = caller.timeout ? std::min(model.budgets.deadline, *caller.timeout)
                                               : model.budgets.deadline,
                     .stop = stop.get_token(),
                     .labels = {.tenant = rq.tenant,
                                .model = rq.model,
                                .endpoint = model.primary->name(),
                                .region = tenant.config->region,
                                .work_class = "streaming"},
                     .max_attempts = cap - spent},
                    carried);
    if (spent > 0) {
      (void)call.first_deposit(model.budget);  // the request deposited when it first came
      if (!model.budget->try_acquire_retry(t0)) {
        rejections_->with({"streaming", "retry_budget"}).inc();
        reply e = detail::error_reply(
            keel::with_refused_by(absl::UnavailableError("the service's retry budget is spent: this request's "
                                                                 "retry is not sent upstream"), "retry_budget"),
            503);
        e.should_retry = false;
        return answered("chat", std::move(e));
      }
    }
    chat_route route;
    absl::StatusOr<keel::stream_result> r = model.chat(call, t0, stream, route);
    const keel::time_point done = clock_.now();
    stream_metrics_.record(rq.model, r);
    keel::record_time_to_first_token(*chat_ttft_, r, done);
    if (!tie.empty()) note_attempts(tie, r.ok() ? 0 : call.record().attempts, done + model.budgets.deadline);

    if (!r.ok()) {
      const absl::Status& s = r.status();
      if (std::optional<std::string_view> reason = admission_refusal(s)) {
        const bool own_quota = *reason == "tenant_quota";
        rejections_->with({"streaming", *reason}).inc();
        if (!own_quota) chat_slo_->record(keel::request_outcome::rejected, done - t0, done);
        absl::Status refused = s;
        if (!keel::retry_after(refused)) refused = keel::with_retry_after(std::move(refused), options_.interactive.admit);
        return answered("chat", detail::error_reply(refused));
      }
      chat_slo_->record(absl::IsCancelled(s) ? keel::request_outcome::abandoned : keel::request_outcome::failure,
                        done - t0, done);
      return answered("chat", after_attempts(detail::error_reply(s), call));
    }
    keel::stream_result& a = *r;
    stream_metrics_.record_tokens(rq.model, carried.reserved, a.charged);
    model.tokens.record(r);
    const bool answered_whole = a.complete;
    chat_slo_->record(answered_whole ? keel::request_outcome::success
                      : a.reason == keel::stream_stop::cancelled ? keel::request_outcome::abandoned
                                                                 : keel::request_outcome::partial,
                      done - t0, done);
    const std::string served_by = route.failed_over ? cat("backup:", route.served->name())
                                  : a.continuations > 0 ? cat("model:", rq.model, "+backup:", model.second->name())
                                                        : cat("model:", rq.model);
    answers_->with({"streaming", served_by}).inc();
    detail::json keel_view = {{"complete", a.complete},
                              {"partial", a.partial},
                              {"degraded", a.degraded || route.failed_over},
                              {"continuations", a.continuations},
                              {"failed_over", route.failed_over},
                              {"hedged", a.hedge == 1},
                              {"served_by", served_by},
                              // What the client waited, from the call's start; and the serving attempt's own.
                              {"ttft_ms", std::chrono::duration<double, std::milli>(a.time_to_first_token).count()},
                              {"attempt_ttft_ms",
                               std::chrono::duration<double, std::milli>(a.attempt_time_to_first_token).count()},
                              {"elapsed_ms", detail::to_ms(done - t0)},
                              {"tokens", a.tokens},
                              {"reserved_tokens", carried.reserved},
                              {"charged_tokens", a.charged},
                              {"attempts", call.record().attempts}};
    if (!a.complete) {
      keel_view["reason"] = std::string(keel::to_string(a.reason));
      keel_view["cause"] = std::string(a.cause.message());
      keel_view["continuable"] = a.continuable;
      if (!a.continuation_failure.ok()) keel_view["continuation_failure"] = std::string(a.continuation_failure.message());
    }
    const std::int64_t prompt_tokens = a.usage.prompt_tokens >= 0 ? a.usage.prompt_tokens : rq.input_tokens;
    const detail::json usage = {{"prompt_tokens", prompt_tokens},
                                {"completion_tokens", a.tokens},
                                {"total_tokens", prompt_tokens + a.tokens}};
    // The upstream's own finish_reason ("tool_calls", "content_filter"...)
    // when it gave one; else what the tokens say.
    const std::string finish = !relay.finish_reason().empty() ? relay.finish_reason()
                               : a.tokens >= rq.max_tokens   ? std::string("length")
                                                             : std::string("stop");
    detail::json message = {{"role", "assistant"}, {"content", a.text}};
    if (a.text.empty() && (!a.tool_calls.empty() || !a.refusal.empty())) message["content"] = nullptr;
    if (!a.refusal.empty()) message["refusal"] = a.refusal;
    if (!a.tool_calls.empty()) {
      detail::json calls = detail::json::array();
      for (const keel::tool_call& t : a.tool_calls)
        calls.push_back({{"id", t.id}, {"type", t.type.empty() ? std::string("function") : t.type},
                         {"function", {{"name", t.name}, {"arguments", t.arguments}}}});
      message["tool_calls"] = std::move(calls);
    }
    // The answer as one chat.completion: the reply, or (streamed) what an
    // Idempotency-Key records.
    const detail::json out = {{"id", id},
                        {"object", "chat.completion"},
                        {"created", created},
                        {"model", rq.model},
                        {"choices",
                         {{{"index", 0},
                           {"message", message},
                           {"finish_reason", a.complete ? finish : "partial"}}}},
                        {"usage", usage},
                        {"degraded", a.degraded || route.failed_over || !a.complete},
                        {"keel", keel_view}};
    if (streaming) {
      if (a.complete) {
        relay.open();
        relay.event(cat(R"({"index":0,"delta":{},"finish_reason":")", finish, "\"}]"));
        relay.event(cat("],\"usage\":", detail::dump(usage), ",\"keel\":", detail::dump(keel_view)));
        relay.done();
      } else {
        relay.fail(detail::dump({{"error",
                                  {{"message", cat("the stream ended early (", keel::to_string(a.reason),
                                                   "): ", a.cause.message())},
                                   {"type", "stream_interrupted"},
                                   {"code", std::string(keel::to_string(a.reason))}}},
                                 {"keel", keel_view}}));
      }
      if (a.complete && completion != nullptr) *completion = detail::dump(out);
      return answered("chat", {.status = 200, .streamed = true});
    }
    if (a.complete && completion != nullptr) *completion = detail::dump(out);
    return answered("chat", {.status = 200, .body = detail::dump(out)});
  }

  // What ties a client's retries of one chat request together: its
  // Idempotency-Key, else its own request id; "" for neither.
  [[nodiscard]] static std::string tie_of(const chat_request& rq, const caller_info& caller) {
    if (caller.idempotency_key) return cat("key\n", rq.tenant, "\n", *caller.idempotency_key);
    if (caller.request_id) return cat("id\n", rq.tenant, "\n", *caller.request_id);
    return {};
  }

  // Attempts the failed requests tied by `tie` spent, within the model's chat deadline of the last.
  [[nodiscard]] int attempts_spent(const std::string& tie, keel::time_point now) {
    std::lock_guard lock(spent_mu_);
    const auto it = spent_.find(tie);
    if (it == spent_.end()) return 0;
    if (it->second.until <= now) {
      spent_.erase(it);
      return 0;
    }
    return it->second.attempts;
  }

  // Adds a failed request's attempts to its tie, remembered until `until`
  // (0 attempts: it was answered; the tie is forgotten).
  void note_attempts(const std::string& tie, int attempts, keel::time_point until) {
    std::lock_guard lock(spent_mu_);
    if (attempts <= 0) {
      spent_.erase(tie);
      return;
    }
    if (spent_.size() >= kMaxTies) {
      // Full: drop what has lapsed; if still full, this tie goes unremembered
      // (its retries get a whole cap again, as without a key).
      const keel::time_point now = clock_.now();
      for (auto it = spent_.begin(); it != spent_.end();) it = it->second.until <= now ? spent_.erase(it) : std::next(it);
      if (spent_.size() >= kMaxTies) return;
    }
    spent_attempts& e = spent_[tie];
    e.attempts += attempts;
    e.until = until;
  }

  // What `o` changes that a reload does not apply (reload_result).
  [[nodiscard]] std::vector<std::string> restart_only_changes(const gateway_options& o) const {
    const gateway_options& was = options_;
    const std::pair<const char*, bool> fields[] = {
        {"data_dir", o.data_dir != was.data_dir},
        {"region", o.region != was.region},
        {"fleet.redis", o.fleet.redis != was.fleet.redis},
        {"idempotency_retention", o.idempotency_retention != was.idempotency_retention},
        {"interactive.deadline", o.interactive.deadline != was.interactive.deadline},
        {"chat (slots, hedge threads, token limits)", o.chat.slots != was.chat.slots ||
                                                           o.chat.hedge_threads != was.chat.hedge_threads ||
                                                           o.chat.max_tokens_limit != was.chat.max_tokens_limit},
        {"breaker", o.breaker.window_calls != was.breaker.window_calls ||
                        o.breaker.failure_rate_threshold != was.breaker.failure_rate_threshold ||
                        o.breaker.open_duration != was.breaker.open_duration ||
                        o.breaker.minimum_calls != was.breaker.minimum_calls},
        {"retry_budget", o.retry_budget.ratio != was.retry_budget.ratio ||
                             o.retry_budget.min_per_second != was.retry_budget.min_per_second},
        {"upstream (batch reports)", o.upstream != was.upstream || o.upstream_backup != was.upstream_backup},
        {"http", o.http_threads != was.http_threads || o.http_max_connections != was.http_max_connections ||
                     o.http_fiber_threads != was.http_fiber_threads || o.http_queue != was.http_queue ||
                     o.max_body_bytes != was.max_body_bytes || o.max_header_bytes != was.max_header_bytes},
    };
    std::vector<std::string> out;
    for (const auto& [name, changed] : fields)
      if (changed) out.emplace_back(name);
    // A deployment keeps the breaker it has (and its state): new options
    // for it apply at a restart.
    for (const model_config& m : o.models) {
      if (!m.breaker) continue;
      bool kept = false;
      auto check = [&](const http_upstream_options& u) {
        const keel::circuit_breaker* b = breakers_.find(keel::failure_domain{.endpoint = u.name});
        kept = kept || (b != nullptr && !same_breaker(b->options(), *m.breaker));
      };
      for (const std::optional<http_upstream_options>* u : {&m.upstream, &m.upstream_backup})
        if (*u) check(**u);
      for (const http_upstream_options& u : m.upstream_fallbacks) check(u);
      if (kept) out.push_back(cat("models.", m.name, ".breaker"));
    }
    return out;
  }

  // The HTTP upstreams `rt` calls, the gateway's own first, once per name.
  [[nodiscard]] std::vector<const http_upstream*> upstreams_in(const routing& rt) const {
    std::vector<const http_upstream*> out;
    auto add = [&out](const http_upstream* u) {
      if (u == nullptr) return;
      for (const http_upstream* seen : out)
        if (seen->name() == u->name()) return;
      out.push_back(u);
    };
    add(http_primary_.get());
    add(http_backup_.get());
    for (const auto& [name, m] : rt.routes) {
      add(m->own_primary.get());
      add(m->own_second.get());
      for (const std::shared_ptr<http_upstream>& u : m->further) add(u.get());
    }
    return out;
  }

  gateway_core(gateway_options o, std::unique_ptr<keel::sqlite_store<>> ids, std::unique_ptr<JobStore> jobs,
               std::unique_ptr<effect_log> effects, Clock clock)
      : fibers_(o.http_fiber_threads > 0 ? std::make_unique<fiber_pool>(o.http_fiber_threads) : nullptr),
        options_(std::move(o)),
        clock_(std::move(clock)),
        listener_(registry_),
        provider_(options_.provider, clock_),
        http_primary_(options_.upstream ? std::make_unique<http_upstream>(*options_.upstream) : nullptr),
        primary_(http_primary_ != nullptr ? static_cast<model_upstream*>(http_primary_.get()) : &provider_),
        rubrics_(options_.rubric_latency, clock_),
        breakers_(keel::breaker_registry_options{
            .breaker = options_.breaker, .scope = {.endpoint = true, .model = false, .region = false}}),
        budget_(options_.retry_budget),
        pools_(keel::bulkhead_options{
            .classes = {{.name = "interactive",
                         .capacity = options_.interactive_slots,
                         .max_queue = options_.interactive_queue,
                         .max_queue_age = options_.interactive.admit},
                        {.name = "batch",
                         .capacity = options_.batch_slots,
                         .max_queue = options_.batch_queue,
                         .max_queue_age = options_.batch_queue_age},
                        {.name = "recovery",
                         .capacity = options_.recovery_slots,
                         .max_queue = options_.recovery_queue,
                         .max_queue_age = options_.recovery_queue_age},
                        {.name = "streaming",
                         .capacity = options_.chat.slots,
                         .max_queue = options_.chat.queue,
                         .max_queue_age = options_.chat.queue_age}}}),
        slos_(slo_classes(options_)),
        ids_(std::move(ids)),
        once_(*ids_,
              keel::idempotency_options{.lease = options_.idempotency_lease,
                                        .retention = options_.idempotency_retention,
                                        .retry_window = std::min<keel::duration>(std::chrono::hours(1),
                                                                                 options_.idempotency_retention / 2),
                                        // Only decisions are kept: a provider's failure leaves the key free
                                        // for a retry (refusals and cancellations always do).
                                        .remember_failures = {.permanent = false},
                                        .policy_revision = options_.policy_revision},
              env()),
        chat_once_(*ids_,
                   keel::idempotency_options{
                       .lease = std::max(options_.idempotency_lease, options_.chat.deadline + std::chrono::seconds(10)),
                       .retention = options_.idempotency_retention,
                       .retry_window = std::min<keel::duration>(std::chrono::hours(1),
                                                                options_.idempotency_retention / 2),
                       .on_duplicate = keel::on_duplicate::retry_later,
                       .remember_failures = {.permanent = false},
                       .policy_revision = options_.policy_revision},
                   env()),
        jobs_(std::move(jobs)),
        queue_(*jobs_, report_queue_options(options_),
               env()),
        effects_(std::move(effects)),
        backup_(options_.chat.backup, clock_),
        http_backup_(options_.upstream_backup ? std::make_unique<http_upstream>(*options_.upstream_backup) : nullptr),
        // Over HTTP without a second deployment: streams are neither failed over nor continued.
        second_(http_backup_ != nullptr ? static_cast<model_upstream*>(http_backup_.get())
                : http_primary_ != nullptr ? primary_
                                           : &backup_),
        hedge_pool_({.threads = options_.chat.hedge_threads, .queue_capacity = options_.chat.hedge_threads}),
        stream_metrics_(registry_),
        plan_({.options = options_,
               .clock = clock_,
               .listener = listener_,
               .breakers = breakers_,
               .budget = budget_,
               .pools = pools_,
               .shed = shed_,
               .fleet = fleet_,
               .once = once_,
               .rubrics = rubrics_,
               .primary = primary_,
               .second = second_,
               .hedge_pool = hedge_pool_}) {
    if (options_.fleet.enabled()) fleet_ = std::make_unique<fleet_sharing>(options_.fleet, breakers_, primary_->name());
    routing_ = plan_.build(options_, 1, nullptr);
    start_routing_ = routing_;
    full_answers_ = slos_.find("interactive-full-answers");
    chat_slo_ = slos_.find("streaming");
    chat_ttft_ = slos_.find("streaming-ttft");
    interactive_cls_ = *pools_.class_index("interactive");
    recovery_cls_ = *pools_.class_index("recovery");
    http_requests_ = &registry_.counter({.name = "gateway_http_requests_total",
                                         .help = "HTTP requests by endpoint and status code.",
                                         .labels = {"endpoint", "code"}});
    rejections_ = &registry_.counter({.name = "gateway_rejections_total",
                                      .help = "Requests refused before work started, by class and the limit that refused.",
                                      .labels = {"class", "reason"}});
    answers_ = &registry_.counter({.name = "gateway_answers_total",
                                   .help = "Answers by class and the path that served them.",
                                   .labels = {"class", "served_by"}});
    latency_ = &registry_.histogram({.name = "gateway_request_seconds",
                                     .help = "Server-side latency of answered and refused requests, by class.",
                                     .labels = {"class"}});
    reloads_ = &registry_.counter({.name = "gateway_config_reloads_total",
                                   .help = "Configuration reloads (SIGHUP), by result: applied or refused.",
                                   .labels = {"result"}});
    http_refusals_ = &registry_.counter({.name = "gateway_http_refusals_total",
                                         .help = "Requests the HTTP front door refused itself, by reason.",
                                         .labels = {"reason"}});
    effects_replayed_ = &registry_
                             .counter({.name = "gateway_effects_replayed_total",
                                       .help = "Learner-history rows written by a replay: the first reply was lost "
                                               "between the decision and its row."})
                             .with({});
    effect_errors_ = &registry_
                          .counter({.name = "gateway_effect_errors_total",
                                    .help = "Learner-history writes that failed after a decision was committed."})
                          .with({});
    registry_.add_collector([this](keel::metrics_snapshot& s) { collect(s); });
    workers_ = std::make_unique<worker_type>(batch_resources<Clock, JobStore, gateway_listener>{
        .queue = queue_,
        .provider = *primary_,
        .breakers = breakers_,
        .timeout = start_routing_->routes.begin()->second->batch_timeout,
        .budget = budget_,
        .effects = *effects_,
        .pools = pools_,
        .batch_class = *pools_.class_index("batch"),
        .options = options_,
        .listener = listener_,
        .clock = clock_,
        .slo = slos_.find("batch")});
  }

  // The one environment every component runs in: the gateway's clock and
  // its metrics listener.
  [[nodiscard]] env_type env() const { return env_type{clock_, {}, listener_}; }

  static std::vector<keel::slo_class> slo_classes(const gateway_options& o) {
    // Interactive availability: a degraded answer within the deadline is
    // useful (good), an overload refusal is not (bad); tenants over their own
    // quota are not recorded at all (their 429 is the contract working).
    // Interactive full answers: the same requests judged by whether the model
    // answered — degraded answers spend this budget, refusals are not
    // eligible (availability has them). One blended score would hide either.
    // Batch: only complete reports count; a full queue is bad.
    return {{"interactive-full-answers",
             {.target = o.full_answer_target,
              .window = o.slo_window,
              .window_buckets = 60,
              .rejected = keel::counts_as::not_eligible,
              .partial = keel::counts_as::bad,
              .abandoned = keel::counts_as::not_eligible}},
            {"interactive",
             {.target = o.interactive_target,
              .window = o.slo_window,
              .window_buckets = 60,
              .rejected = keel::counts_as::bad,
              .partial = keel::counts_as::good,
              .abandoned = keel::counts_as::not_eligible,
              .latency_threshold = o.interactive.deadline,
              .latency_target = 0.99}},
            {"batch",
             {.target = o.batch_target,
              .window = o.slo_window,
              .window_buckets = 60,
              .rejected = keel::counts_as::bad,
              .partial = keel::counts_as::bad,
              .abandoned = keel::counts_as::not_eligible}},
            // Streams: answered whole (continued or failed over included) is
            // good; cut short and not continued, or refused by the service, is bad.
            {"streaming",
             {.target = o.chat.availability_target,
              .window = o.slo_window,
              .window_buckets = 60,
              .rejected = keel::counts_as::bad,
              .partial = keel::counts_as::bad,
              .abandoned = keel::counts_as::not_eligible}},
            // Time to first token: the share of streams that showed a token
            // within ttft_threshold (keel::record_time_to_first_token).
            {"streaming-ttft",
             {.target = o.chat.availability_target,
              .window = o.slo_window,
              .window_buckets = 60,
              .rejected = keel::counts_as::not_eligible,
              .partial = keel::counts_as::good,
              .abandoned = keel::counts_as::not_eligible,
              .latency_threshold = o.chat.ttft_threshold,
              .latency_target = o.chat.ttft_target}}};
  }


  [[nodiscard]] keel::failure_domain provider_domain() const noexcept {
    return keel::failure_domain{.endpoint = primary_->name()};
  }

  // The request's tenant: the authenticated key's (a body naming another is
  // refused), else the body's "tenant".
  [[nodiscard]] static absl::StatusOr<std::string> request_tenant(const detail::json& j,
                                                                  std::optional<std::string_view> caller) {
    if (!caller) return detail::string_field(j, "tenant", 64);
    const auto it = j.find("tenant");
    if (it != j.end() && !(it->is_string() && it->get<std::string>() == *caller))
      return absl::PermissionDeniedError(
          cat("this API key belongs to tenant '", *caller, "'; the body names another tenant"));
    return std::string(*caller);
  }

  [[nodiscard]] absl::StatusOr<feedback_request> parse_feedback(const routing& rt, std::string_view body,
                                                                const std::optional<std::string_view>& key,
                                                                std::optional<std::string_view> caller) const {
    absl::StatusOr<detail::json> j = detail::parse_object(body);
    if (!j.ok()) return j.status();
    if (absl::Status s = detail::check_class(*j, work_class::interactive, "/v1/feedback"); !s.ok()) return s;
    absl::StatusOr<std::string> k = detail::check_idempotency_key(key);
    if (!k.ok()) return k.status();
    feedback_request r;
    r.key = std::move(*k);
    absl::StatusOr<std::string> tenant = request_tenant(*j, caller);
    if (!tenant.ok()) return tenant.status();
    r.tenant = std::move(*tenant);
    for (auto [field, out, max] : {std::tuple{"question_id", &r.question_id, std::size_t{64}},
                                   std::tuple{"answer", &r.answer, std::size_t{8192}}}) {
      absl::StatusOr<std::string> v = detail::string_field(*j, field, max);
      if (!v.ok()) return v.status();
      *out = std::move(*v);
    }
    absl::StatusOr<std::string> m = detail::string_field(*j, "model", 64, rt.default_model());
    if (!m.ok()) return m.status();
    r.model = std::move(*m);
    if (absl::Status s = detail::check_name("tenant", r.tenant); !s.ok()) return s;
    if (absl::Status s = detail::check_name("question_id", r.question_id); !s.ok()) return s;
    if (rt.find(r.model) == nullptr) return detail::bad_input(cat("unknown model '", r.model, "'"));
    return r;
  }

  [[nodiscard]] absl::StatusOr<batch_request> parse_batch(const routing& rt, std::string_view body,
                                                          const std::optional<std::string_view>& key,
                                                          std::optional<std::string_view> caller) const {
    absl::StatusOr<detail::json> j = detail::parse_object(body);
    if (!j.ok()) return j.status();
    if (absl::Status s = detail::check_class(*j, work_class::batch, "/v1/batch"); !s.ok()) return s;
    absl::StatusOr<std::string> k = detail::check_idempotency_key(key);
    if (!k.ok()) return k.status();
    absl::StatusOr<std::string> tenant = request_tenant(*j, caller);
    if (!tenant.ok()) return tenant.status();
    absl::StatusOr<std::string> learner = detail::string_field(*j, "learner", 64);
    if (!learner.ok()) return learner.status();
    absl::StatusOr<std::string> model = detail::string_field(*j, "model", 64, rt.default_model());
    if (!model.ok()) return model.status();
    if (absl::Status s = detail::check_name("tenant", *tenant); !s.ok()) return s;
    if (absl::Status s = detail::check_name("learner", *learner); !s.ok()) return s;
    if (rt.find(*model) == nullptr) return detail::bad_input(cat("unknown model '", *model, "'"));
    const auto sessions = j->find("sessions");
    if (sessions == j->end() || !sessions->is_array() || sessions->empty() || sessions->size() > 50) {
      return detail::bad_input("'sessions' must be an array of 1-50 strings");
    }
    for (const auto& s : *sessions) {
      if (!s.is_string() || s.get<std::string>().empty() || s.get<std::string>().size() > 4096)
        return detail::bad_input("each session must be a string of 1-4096 bytes");
    }
    // The canonical payload (keys sorted): its digest deduplicates the job.
    detail::json payload = {{"tenant", *tenant}, {"learner", *learner}, {"model", *model}, {"sessions", *sessions}};
    return batch_request{.tenant = std::move(*tenant),
                         .model = std::move(*model),
                         .key = std::move(*k),
                         .payload = detail::dump(payload)};
  }

  [[nodiscard]] absl::StatusOr<chat_request> parse_chat(const routing& rt, std::string_view body,
                                                        std::optional<std::string_view> caller) const {
    absl::StatusOr<detail::json> j = detail::parse_object(body);
    if (!j.ok()) return j.status();
    chat_request r;
    absl::StatusOr<std::string> tenant = request_tenant(*j, caller);
    if (!tenant.ok()) return tenant.status();
    absl::StatusOr<std::string> model = detail::string_field(*j, "model", 64, rt.default_model());
    if (!model.ok()) return model.status();
    if (absl::Status s = detail::check_name("tenant", *tenant); !s.ok()) return s;
    if (rt.find(*model) == nullptr) return detail::bad_input(cat("unknown model '", *model, "'"));
    r.tenant = std::move(*tenant);
    r.model = std::move(*model);
    const auto messages = j->find("messages");
    if (messages == j->end() || !messages->is_array() || messages->empty() || messages->size() > 64)
      return detail::bad_input("'messages' must be an array of 1-64 messages");
    for (const detail::json& m : *messages) {
      if (!m.is_object()) return detail::bad_input("each message must be an object with a role and a content");
      const auto role = m.find("role");
      const auto content = m.find("content");
      if (role == m.end() || !role->is_string()) return detail::bad_input("each message needs a 'role' string");
      const std::string rl = role->get<std::string>();
      if (rl != "system" && rl != "user" && rl != "assistant" && rl != "tool" && rl != "developer")
        return detail::bad_input(
            cat("unknown role '", rl.substr(0, 32), "' (known: system, developer, user, assistant, tool)"));
      // OpenAI's shapes: a string; an array of parts (text, images); null
      // for an assistant message that only calls tools.
      const bool calls_tools = rl == "assistant" && m.contains("tool_calls");
      if (content == m.end() ? !calls_tools
                             : !(content->is_string() || content->is_array() || (content->is_null() && calls_tools)))
        return detail::bad_input("each message needs a 'content': a string, an array of parts, or null beside tool_calls");
      absl::StrAppend(&r.prompt, rl, ": ");
      if (content != m.end() && content->is_string()) {
        r.prompt += content->get<std::string>();
      } else if (content != m.end() && content->is_array()) {
        for (const detail::json& part : *content)
          if (part.is_object() && part.value("type", "") == "text" && part.contains("text") && part["text"].is_string())
            r.prompt += part["text"].get<std::string>();
      }
      if (calls_tools) r.prompt += m["tool_calls"].dump();  // counted in the token estimate
      r.prompt += "\n";
      if (r.prompt.size() > 32 * 1024) return detail::bad_input("the messages must be at most 32768 bytes in all");
    }
    r.max_tokens = options_.chat.default_max_tokens;
    // max_completion_tokens is OpenAI's newer name for the same cap.
    for (const char* field : {"max_completion_tokens", "max_tokens"}) {
      const auto mt = j->find(field);
      if (mt == j->end() || mt->is_null()) continue;
      if (!mt->is_number_integer() || mt->get<std::int64_t>() < 1 ||
          mt->get<std::int64_t>() > options_.chat.max_tokens_limit)
        return detail::bad_input(cat("'", field, "' must be an integer in [1, ", options_.chat.max_tokens_limit, "]"));
      r.max_tokens = mt->get<int>();
    }
    if (const auto st = j->find("stream"); st != j->end() && !st->is_null()) {
      if (!st->is_boolean()) return detail::bad_input("'stream' must be true or false");
      r.stream = st->get<bool>();
    }
    r.input_tokens = static_cast<std::int64_t>(r.prompt.size() / 4 + 1);
    r.upstream_request = std::move(*j);
    for (const char* own : {"tenant", "model", "stream", "stream_options", "max_tokens", "max_completion_tokens"})
      r.upstream_request.erase(own);
    return r;
  }

  void finish_body(detail::json& out, const keel::call& call, keel::time_point t0, const interactive_progress& p,
                   keel::time_point done) const {
    const keel::call_record rec = call.record();
    out["attempts"] = rec.attempts;
    out["retries"] = rec.retries;
    out["deadline_ms"] = detail::to_ms(options_.interactive.deadline);
    out["elapsed_ms"] = detail::to_ms(done - t0);
    detail::json timeline = detail::json::object();
    if (p.admitted) timeline["admitted"] = detail::to_ms(*p.admitted - t0);
    if (p.retrieved) timeline["retrieved"] = detail::to_ms(*p.retrieved - t0);
    if (p.answered) timeline["answered"] = detail::to_ms(*p.answered - t0);
    timeline["responded"] = detail::to_ms(done - t0);
    out["timeline_ms"] = timeline;
    if (!p.retrieval_error.empty()) out["missing"] = {{"rubric", p.retrieval_error}};
  }

  reply served(work_class w, keel::request_outcome o, std::string_view served_by, const detail::json& out,
               keel::time_point t0, keel::time_point done) {
    record_slo(w, o, done - t0, done);
    answers_->with({work_class_names[idx(w)], served_by}).inc();
    latency_->with({work_class_names[idx(w)]}).observe(done - t0);
    return answered(w == work_class::batch ? "batch" : "feedback", {.status = 200, .body = detail::dump(out)});
  }

  reply rejected(work_class w, std::string_view reason, absl::Status s, keel::time_point t0,
                 bool counts_in_slo = true) {
    const keel::time_point now = clock_.now();
    // Every refusal says when to come back (a bulkhead that waited out the
    // stage has no hint of its own: the stage's length is a fair one).
    if (!keel::retry_after(s)) s = keel::with_retry_after(std::move(s), options_.interactive.admit);
    rejections_->with({work_class_names[idx(w)], reason}).inc();
    latency_->with({work_class_names[idx(w)]}).observe(now - t0);
    if (counts_in_slo) record_slo(w, keel::request_outcome::rejected, now - t0, now);
    return answered(w == work_class::batch ? "batch" : "feedback", detail::error_reply(s));
  }

  // A tenant over its own quota is its own doing and stays out of the SLO; a
  // model's quota, or a quota table full of other tenants' keys, is the service's.
  reply quota_refusal(work_class w, const keel::admission::refusal_reason& why, keel::time_point t0) {
    const bool table_full = why.limit == keel::quota_limit::table_full;
    return rejected(w, table_full ? "quota_table_full" : why.level == "tenant" ? "tenant_quota" : "model_quota",
                    keel::admission::refusal(why), t0, /*counts_in_slo=*/table_full || why.level != "tenant");
  }

  // Which of the interactive pipeline's front stages refused, as
  // gateway_rejections_total names it, read from the refusal's refused-by
  // (the admission policy's "<level>:<key>:<limit>", "bulkhead:<class>",
  // "shed:<class>"); nullopt for anything else.
  [[nodiscard]] static std::optional<std::string_view> admission_refusal(const absl::Status& s) {
    const std::optional<std::string> by = keel::refused_by(s);
    if (!by) return std::nullopt;
    if (by->starts_with("shed:")) return "shed";
    if (by->starts_with("bulkhead:")) return "bulkhead";
    const bool tenant = by->starts_with("tenant:");
    if (!tenant && !by->starts_with("model:")) return std::nullopt;
    if (by->ends_with(":table_full")) return "quota_table_full";
    return tenant ? "tenant_quota" : "model_quota";
  }

  void record_slo(work_class w, keel::request_outcome o, keel::duration took, keel::time_point now) {
    if (keel::work_class_slo* s = slos_.find(work_class_names[idx(w)])) s->record(o, took, now);
    if (w == work_class::interactive) full_answers_->record(o, took, now);
  }

  // A failure after the upstreams were tried (retried, failed over) within
  // `call`: x-should-retry: false, since an SDK's retry of the whole request
  // would only multiply that (gateway_options::tell_clients_retries_spent).
  // A refusal with a hint (4xx) is left to the client's retry.
  [[nodiscard]] reply after_attempts(reply e, const keel::call& call) const {
    if (options_.tell_clients_retries_spent && call.record().attempts > 0 && e.status >= 500) e.should_retry = false;
    return e;
  }

  reply answered(std::string_view endpoint, reply r) {
    http_requests_->with({endpoint, cat(r.status)}).inc();
    return r;
  }

  // Operator and monitoring requests run in the recovery class, so they get
  // through while interactive and batch work is saturated.
  template <class F>
  reply operator_request(std::string_view endpoint, F&& f) {
    const keel::time_point now = clock_.now();
    absl::StatusOr<keel::bulkhead_permit> slot = pools_.acquire(
        recovery_cls_, clock_, now, keel::deadline::after(now, options_.recovery_queue_age), stop_.get_token());
    if (!slot.ok()) {
      rejections_->with({"recovery", "bulkhead"}).inc();
      return answered(endpoint, detail::error_reply(slot.status()));
    }
    return answered(endpoint, f());
  }

  void collect(keel::metrics_snapshot& s) {
    const keel::time_point now = clock_.now();
    slos_.collect(s, now);
    auto gauge = [](std::string name, std::string help, std::vector<std::string> labels) {
      return keel::metric_family_snapshot{.name = std::move(name),
                                          .help = std::move(help),
                                          .type = keel::metric_type::gauge,
                                          .label_names = std::move(labels)};
    };
    auto counter = [](std::string name, std::string help, std::vector<std::string> labels) {
      return keel::metric_family_snapshot{.name = std::move(name),
                                          .help = std::move(help),
                                          .type = keel::metric_type::counter,
                                          .label_names = std::move(labels)};
    };
    keel::metric_family_snapshot active = gauge("gateway_bulkhead_active", "Slots in use, by class.", {"class"});
    keel::metric_family_snapshot queued = gauge("gateway_bulkhead_queued", "Callers waiting for a slot.", {"class"});
    keel::metric_family_snapshot refused =
        counter("gateway_bulkhead_refusals_total", "Callers refused: queue full or waited too long.", {"class"});
    for (std::size_t c = 0; c < pools_.classes(); ++c) {
      const keel::bulkhead_figures f = pools_.figures(c);
      const std::string name(f.name);
      active.series.push_back({.labels = {name}, .value = static_cast<double>(f.active)});
      queued.series.push_back({.labels = {name}, .value = static_cast<double>(f.queued)});
      refused.series.push_back({.labels = {name}, .value = static_cast<double>(f.rejected + f.timed_out)});
    }
    keel::metric_family_snapshot breaker =
        gauge("gateway_breaker_open", "1 while the provider's breaker refuses calls (open or forced open).",
              {"breaker", "state"});
    for (const keel::breaker_entry& e : breakers_.list(now)) {
      const bool open = e.state.state == keel::breaker_state::open || e.state.state == keel::breaker_state::forced_open;
      breaker.series.push_back(
          {.labels = {e.domain, std::string(keel::to_string(e.state.state))}, .value = open ? 1.0 : 0.0});
    }
    const provider_figures pf = provider_.figures();
    keel::metric_family_snapshot calls =
        counter("gateway_provider_calls_total", "Calls to the simulated provider, by what happened.", {"result"});
    const std::pair<const char*, std::int64_t> results[] = {
        {"answered", pf.answered},         {"invalid_output", pf.invalid}, {"timed_out", pf.timed_out},
        {"cancelled", pf.cancelled},       {"rate_limited", pf.rate_limited}, {"unavailable", pf.unavailable}};
    for (const auto& [label, n] : results) calls.series.push_back({.labels = {label}, .value = static_cast<double>(n)});
    keel::metric_family_snapshot abandoned =
        counter("gateway_provider_abandoned_total",
                "Attempts given up at their deadline while the provider may still be computing them.", {});
    abandoned.series.push_back({.labels = {}, .value = static_cast<double>(pf.abandoned)});
    keel::metric_family_snapshot shed = gauge("gateway_shed", "1 while an operator sheds the class.", {"class"});
    for (work_class w : {work_class::interactive, work_class::batch}) {
      shed.series.push_back({.labels = {std::string(work_class_names[idx(w)])},
                             .value = shed_[idx(w)].load(std::memory_order_relaxed) ? 1.0 : 0.0});
    }
    keel::metric_family_snapshot jobs = gauge("gateway_batch_jobs", "Batch jobs in the queue by state.", {"state"});
    keel::metric_family_snapshot readable =
        gauge("gateway_batch_queue_readable", "1 when the job store answered the queue's counts, 0 on an error.", {});
    const absl::StatusOr<keel::job_counts> c = queue_.counts();
    readable.series.push_back({.labels = {}, .value = c.ok() ? 1.0 : 0.0});
    if (c.ok()) {
      const std::pair<const char*, std::int64_t> states[] = {
          {"queued", c->queued}, {"running", c->running}, {"done", c->done}, {"failed", c->failed},
          {"expired", c->expired}};
      for (const auto& [label, n] : states) jobs.series.push_back({.labels = {label}, .value = static_cast<double>(n)});
    }
    keel::metric_family_snapshot budget =
        gauge("gateway_retry_budget",
              "Retry budgets over their window: the gateway's, and each model's own (budget=\"model:<name>\").",
              {"budget", "figure"});
    auto add_budget = [&](const std::string& name, const keel::retry_budget& rb) {
      const keel::retry_budget_figures b = rb.figures(now);
      budget.series.push_back({.labels = {name, "requests"}, .value = static_cast<double>(b.requests)});
      budget.series.push_back({.labels = {name, "retries"}, .value = static_cast<double>(b.retries)});
      budget.series.push_back({.labels = {name, "allowed"}, .value = static_cast<double>(b.allowed)});
    };
    add_budget("gateway", budget_);
    for (const auto& [name, m] : routing_now()->routes)  // the plan serving: one series per model
      if (m->budget != &budget_) add_budget(cat("model:", name), *m->budget);
    keel::metric_family_snapshot streams =
        counter("gateway_provider_streams_total", "Streams the simulated providers served, by what happened.",
                {"provider", "result"});
    for (const simulated_provider<Clock>* p : {&provider_, &backup_}) {
      const provider_figures f = p->figures();
      const std::pair<const char*, std::int64_t> stream_results[] = {
          {"started", f.streams}, {"complete", f.streams_complete}, {"cut", f.streams_cut},
          {"stopped", f.streams_stopped}};
      for (const auto& [label, n] : stream_results)
        streams.series.push_back({.labels = {p->name(), label}, .value = static_cast<double>(n)});
    }
    keel::metric_family_snapshot guard =
        counter("gateway_stream_guard_total", "What the stream guard did: attempts, commits, budgets, hedges.",
                {"event"});
    const keel::stream_figures g = stream_totals();
    const std::pair<const char*, std::int64_t> guard_events[] = {
        {"attempt", g.attempts}, {"committed", g.committed}, {"first_token_timeout", g.first_token_timeouts},
        {"stall", g.stalls}, {"whole_timeout", g.whole_timeouts}, {"mid_stream_failure", g.mid_stream_failures},
        {"hedge_started", g.hedges_started}, {"hedge_won", g.hedge_wins}, {"hedge_skipped", g.hedges_skipped},
        {"continuation", g.continuations}};
    for (const auto& [label, n] : guard_events) guard.series.push_back({.labels = {label}, .value = static_cast<double>(n)});
    keel::metric_family_snapshot upstream_calls =
        counter("gateway_upstream_calls_total", "Completions and streams sent to the HTTP model upstreams, by result.",
                {"upstream", "result"});
    const std::shared_ptr<routing> rt = routing_now();
    for (const http_upstream* u : upstreams_in(*rt)) {
      const upstream_figures f = u->figures();
      upstream_calls.series.push_back({.labels = {u->name(), "answered"}, .value = static_cast<double>(f.answered)});
      upstream_calls.series.push_back({.labels = {u->name(), "failed"}, .value = static_cast<double>(f.failed)});
    }
    keel::metric_family_snapshot generation =
        gauge("gateway_config_generation", "The configuration plan serving new requests: 1 at start, +1 per applied reload.", {});
    generation.series.push_back({.labels = {}, .value = static_cast<double>(rt->generation)});
    for (auto* f : {&active, &queued, &refused, &breaker, &calls, &abandoned, &shed, &jobs, &readable, &budget, &streams,
                    &guard, &upstream_calls, &generation}) {
      s.families.push_back(std::move(*f));
    }
  }

  // First, so it goes last: the requests and the upstreams' event loops run
  // on these threads (http_fiber_threads > 0), and what they hold must be
  // gone before the loops stop.
  std::unique_ptr<fiber_pool> fibers_;
  gateway_options options_;
  Clock clock_;
  keel::metrics_registry registry_;
  gateway_listener listener_;
  simulated_provider<Clock> provider_;        // the model, simulated in-process (without options_.upstream)
  std::unique_ptr<http_upstream> http_primary_;  // the model over HTTP (options_.upstream)
  model_upstream* primary_;                      // whichever of the two serves
  rubric_store<Clock> rubrics_;
  keel::breaker_registry breakers_;
  std::unique_ptr<fleet_sharing> fleet_;  // with a Redis only; after breakers_, which it refers to
  keel::retry_budget budget_;
  keel::bulkhead pools_;
  keel::slo_tracker slos_;
  // The plan serving now (reload() replaces it) and the first, which the
  // batch workers' adaptive timeout lives in.
  mutable std::mutex routing_mu_;
  std::shared_ptr<routing> routing_;
  std::shared_ptr<routing> start_routing_;
  std::mutex reload_mu_;
  // The attempts that failed chat requests spent, by what ties their
  // retries (tie_of).
  struct spent_attempts {
    int attempts = 0;
    keel::time_point until{};
  };
  static constexpr std::size_t kMaxTies = 100'000;
  std::mutex spent_mu_;
  std::map<std::string, spent_attempts, std::less<>> spent_;
  std::unique_ptr<keel::sqlite_store<>> ids_;
  once_type once_;
  // Keyed chat requests: their own keel::once over keel.db, answering a
  // duplicate in flight at once (409) instead of holding it for a stream.
  once_type chat_once_;
  std::unique_ptr<JobStore> jobs_;
  queue_type queue_;
  std::unique_ptr<effect_log> effects_;
  std::unique_ptr<worker_type> workers_;
  // Streaming: the second model, the hedges' threads, the guard (after the
  // pool it submits to, before nothing that outlives it), what streams did.
  simulated_provider<Clock> backup_;
  std::unique_ptr<http_upstream> http_backup_;  // options_.upstream_backup
  model_upstream* second_;                      // whichever of the two serves
  keel::bounded_pool hedge_pool_;
  keel::stream_metrics stream_metrics_;
  std::atomic<std::int64_t> chat_ids_{0};
  keel::work_class_slo* chat_slo_ = nullptr;
  keel::work_class_slo* chat_ttft_ = nullptr;
  keel::work_class_slo* full_answers_ = nullptr;
  std::size_t interactive_cls_ = 0, recovery_cls_ = 0;
  std::array<std::atomic<bool>, 3> shed_{};
  std::stop_source stop_;
  keel::metric_family<keel::counter_metric>* http_requests_ = nullptr;
  keel::metric_family<keel::counter_metric>* rejections_ = nullptr;
  keel::metric_family<keel::counter_metric>* answers_ = nullptr;
  keel::metric_family<keel::histogram_metric>* latency_ = nullptr;
  keel::counter_metric* effect_errors_ = nullptr;
  keel::metric_family<keel::counter_metric>* http_refusals_ = nullptr;
  keel::metric_family<keel::counter_metric>* reloads_ = nullptr;
  keel::counter_metric* effects_replayed_ = nullptr;
  std::function<void(std::string_view)> effect_hook_;  // set before requests run
  // Builds each plan and keeps what plans share across reloads (plan.hpp).
  // Last: it refers to the members above, and its stream guards submit to
  // hedge_pool_, so it goes first.
  plan_type plan_;
};

}  // namespace gateway
