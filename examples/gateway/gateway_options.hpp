// gateway/gateway_options.hpp — everything the example gateway is configured
// with: the seed's deadline plan, bulkheads, quotas, breaker, timeouts,
// retries, SLOs, the simulated provider and the durable batch queue.
//
// The defaults are the seed's figures: a 3 s interactive deadline with a
// 200 ms response reserve, stages admit 0-100 ms, retrieve 100-300 ms, model
// 300-1300 ms, cancel 1300-1400 ms, fallback 1400-2400 ms, respond by
// 2600 ms; bulkheads 24 interactive / 8 batch / 8 recovery. scale_time()
// shrinks every duration by one factor, so tests run the same plan in a
// fraction of the time.
//
// Example:
//
//   gateway::gateway_options o;
//   o.data_dir = "/var/lib/gateway";
//   gateway::scale_time(o, 0.2);          // a 600 ms deadline, everything in proportion
//   absl::Status ok = o.validate();
//
// Thread-safety: plain values.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <openssl/crypto.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "text.hpp"
#include "keel/core/status.hpp"
#include "keel/durable/digest.hpp"
#include "keel/policy/adaptive_timeout.hpp"
#include "keel/policy/admission.hpp"
#include "keel/policy/backoff.hpp"
#include "keel/policy/circuit_breaker.hpp"
#include "keel/policy/retry_budget.hpp"
#include "fleet.hpp"
#include "simulated_provider.hpp"
#include "upstream.hpp"

namespace gateway {

using namespace std::chrono_literals;

// The interactive request's deadline, spent once, stage by stage. Each
// stage gets at most its share of what is left of the call, never a fresh
// timeout; the stages add up to `respond_by()`, which must leave the
// response reserve untouched.
struct deadline_plan {
  keel::duration deadline = 3000ms;          // end to end, from arrival
  keel::duration response_reserve = 200ms;   // kept back for sending the answer
  keel::duration admit = 100ms;              // authenticate, quotas, bulkhead queue
  keel::duration retrieve = 200ms;           // read the rubric from the database
  keel::duration model = 1000ms;             // the model attempt(s)
  keel::duration cancel = 100ms;             // close a failed read attempt
  keel::duration fallback = 1000ms;          // an evaluated fallback
  keel::duration respond = 200ms;            // validate and finish

  // When the answer must be ready, from arrival: 2600 ms in the seed.
  [[nodiscard]] keel::duration respond_by() const noexcept {
    return admit + retrieve + model + cancel + fallback + respond;
  }

  [[nodiscard]] absl::Status validate() const {
    constexpr std::string_view who = "deadline_plan";
    const std::pair<std::string_view, keel::duration> positive[] = {
        {"deadline", deadline}, {"admit", admit},       {"retrieve", retrieve},
        {"model", model},       {"fallback", fallback}, {"respond", respond}};
    for (const auto& [field, d] : positive) {
      if (d <= keel::duration::zero()) return keel::invalid_option(who, field, "be > 0", d);
    }
    if (cancel < keel::duration::zero()) return keel::invalid_option(who, "cancel", "be >= 0", cancel);
    if (response_reserve < keel::duration::zero() || response_reserve >= deadline)
      return keel::invalid_option(who, "response_reserve", "be in [0, deadline)", response_reserve);
    if (respond_by() > deadline - response_reserve)
      return keel::invalid_option(
          who, "respond", "leave the stages within deadline - response_reserve",
          cat(keel::describe_duration(respond_by()), " > ",
                       keel::describe_duration(deadline - response_reserve)));
    return absl::OkStatus();
  }
};

struct tenant_config {
  std::string name;
  keel::quota_limits limits{};
  std::string region = "eu";   // where its data may be processed
  bool allow_degraded = true;  // may it be served a degraded (fallback) answer?
};

// A client's API key, known by its SHA-256 (never the key itself), and the
// tenant whose quotas it spends.
struct api_key {
  keel::digest sha256{};
  std::string tenant;
};

// The entry whose digest (`digest_of`) is the SHA-256 of `presented`,
// compared with every entry in constant time (CRYPTO_memcmp, no early
// exit), so timing says nothing about which keys exist. nullptr: none.
template <class Entry>
[[nodiscard]] const Entry* find_by_key_digest(const std::vector<Entry>& entries, keel::digest Entry::*digest_of,
                                              std::string_view presented) {
  const keel::digest h = keel::sha256(presented);
  const Entry* found = nullptr;
  for (const Entry& e : entries) {
    const bool same = CRYPTO_memcmp(h.bytes.data(), (e.*digest_of).bytes.data(), h.bytes.size()) == 0;
    found = same ? &e : found;
  }
  return found;
}

// The streaming endpoint (POST /v1/chat/completions with "stream": true,
// gateway/chat.hpp): one deadline per stream, the stream's three budgets
// (keel::stream_guard), the first-token hedge, the continuation on a second
// model, and its own bulkhead class: a stream holds its slot for seconds.
struct chat_config {
  keel::duration deadline = 20s;      // the whole request, first token to last
  keel::duration first_token = 1s;    // per attempt: the first content token
  keel::duration stall = 400ms;       // the longest gap between two tokens
  keel::duration whole = 15s;         // one stream attempt, end to end
  // First-token hedge: after the learned `hedge_percentile` of recent times
  // to first token (hedge_delay until 20 are known, never below hedge_min_delay).
  keel::duration hedge_delay = 400ms;
  double hedge_percentile = 0.95;
  keel::duration hedge_min_delay = 50ms;
  int hedge_threads = 16;             // the hedges' executor
  int attempts = 2;                   // per model, before the commit
  int slots = 32, queue = 16;         // the "streaming" bulkhead class
  keel::duration queue_age = 200ms;
  int default_max_tokens = 256, max_tokens_limit = 4096;
  // A stream that fails before its first token is failed over, and one cut
  // mid-stream is continued, on this model (degraded); false: neither.
  bool continue_on_backup = true;
  provider_options backup{.name = "sim-llm-backup", .median_latency = 500ms, .capacity = 40,
                          .first_token_latency = 300ms, .tail_ratio = 0.01, .token_gap = 20ms};
  // The objective on time to first token: `ttft_target` of streams show a
  // token within `ttft_threshold`.
  keel::duration ttft_threshold = 1s;
  double ttft_target = 0.95;
  double availability_target = 0.99;  // answered (complete, continued or failed over)

  [[nodiscard]] absl::Status validate() const {
    constexpr std::string_view who = "gateway_options.chat";
    const std::pair<std::string_view, keel::duration> positive[] = {
        {"deadline", deadline}, {"first_token", first_token}, {"stall", stall}, {"whole", whole},
        {"ttft_threshold", ttft_threshold}, {"queue_age", queue_age}};
    for (const auto& [field, d] : positive) {
      if (d <= keel::duration::zero()) return keel::invalid_option(who, field, "be > 0", d);
    }
    if (first_token >= deadline)
      return keel::invalid_option(who, "first_token", "be shorter than the deadline", first_token);
    if (hedge_delay < keel::duration::zero())
      return keel::invalid_option(who, "hedge_delay", "be >= 0 (0: no hedge)", hedge_delay);
    if (!(hedge_percentile == 0.0 || (hedge_percentile > 0.0 && hedge_percentile < 1.0)))
      return keel::invalid_option(who, "hedge_percentile", "be 0 (fixed delay) or in (0, 1)", hedge_percentile);
    if (hedge_threads < 1) return keel::invalid_option(who, "hedge_threads", "be >= 1", hedge_threads);
    if (attempts < 1) return keel::invalid_option(who, "attempts", "be >= 1", attempts);
    if (slots < 1 || slots > 32767) return keel::invalid_option(who, "slots", "be in [1, 32767]", slots);
    if (queue < 0) return keel::invalid_option(who, "queue", "be >= 0", queue);
    if (max_tokens_limit < 1) return keel::invalid_option(who, "max_tokens_limit", "be >= 1", max_tokens_limit);
    if (default_max_tokens < 1 || default_max_tokens > max_tokens_limit)
      return keel::invalid_option(who, "default_max_tokens", "be in [1, max_tokens_limit]", default_max_tokens);
    if (!(ttft_target > 0 && ttft_target < 1))
      return keel::invalid_option(who, "ttft_target", "be in (0, 1)", ttft_target);
    if (!(availability_target > 0 && availability_target < 1))
      return keel::invalid_option(who, "availability_target", "be in (0, 1)", availability_target);
    if (absl::Status s = backup.validate(); !s.ok()) return keel::annotate(s, "gateway_options.chat.backup");
    return absl::OkStatus();
  }
};

// What a config file's [models.NAME].breaker can set, compared (the name
// aside): whether a deployment's breaker is the one these options make.
[[nodiscard]] inline bool same_breaker(const keel::circuit_breaker_options& a, const keel::circuit_breaker_options& b) {
  return a.failure_rate_threshold == b.failure_rate_threshold && a.window_calls == b.window_calls &&
         a.minimum_calls == b.minimum_calls && a.open_duration == b.open_duration &&
         a.probe_timeout == b.probe_timeout && a.half_open_probes == b.half_open_probes;
}

struct model_config {
  std::string name;
  std::string digest;                  // which model (and version) decided: stored with each decision
  keel::quota_limits limits{};
  std::int64_t token_estimate = 600;   // reserved from the tenant's compute budget per request
  // Where this model is served over HTTP (a config file's deployments,
  // primary first); unset: gateway_options::upstream / upstream_backup.
  std::optional<http_upstream_options> upstream{};
  std::optional<http_upstream_options> upstream_backup{};
  // Deployments after the second, tried in order (each behind its own
  // breaker) when the first two fail before a stream's first token.
  std::vector<http_upstream_options> upstream_fallbacks{};
  // This model's stream budgets, hedge and attempts (a config file's
  // [models.NAME]); unset: gateway_options::chat. Its slots, hedge
  // threads and token limits are the gateway's whatever this says.
  std::optional<chat_config> chat{};
  // The breaker of each of this model's own deployments (one per
  // deployment name: a deployment two models share gets the first one's),
  // and the retry budget its retries and hedges spend; unset:
  // gateway_options::breaker / retry_budget, shared with the gateway.
  std::optional<keel::circuit_breaker_options> breaker{};
  std::optional<keel::retry_budget_options> retry_budget{};
  // The interactive path hedges too: after the hedge delay of `chat` (else
  // gateway_options::chat), a second attempt on the model's second
  // deployment. A config file's [models.NAME].hedge turns it on.
  bool interactive_hedge = false;
};

struct gateway_options {
  deadline_plan interactive{};

  // Where keel.db (idempotency records), jobs.db (the batch queue) and
  // effects.db (the downstream systems) live. Required.
  std::string data_dir{};
  std::string region = "eu";  // where this gateway (and its fallback) runs
  std::string policy_revision = "feedback-policy-v1";

  // Bulkheads: slots per class, callers that may wait, and how long.
  int interactive_slots = 24, batch_slots = 8, recovery_slots = 8;
  int interactive_queue = 24, batch_queue = 8, recovery_queue = 8;
  keel::duration batch_queue_age = 500ms;     // a batch worker waits this long for a slot
  keel::duration recovery_queue_age = 500ms;  // an operator request waits this long

  // Quotas: every tenant gets tenant_defaults unless it is listed.
  keel::quota_limits tenant_defaults{.rate = 40, .burst = 40, .max_in_flight = 24, .compute_budget = 600'000};
  std::vector<tenant_config> tenants{
      {.name = "noisy", .limits = {.rate = 1, .burst = 1, .max_in_flight = 4}},
      {.name = "us-clinic", .limits = {.rate = 20, .burst = 20}, .region = "us"},
      {.name = "strict", .limits = {.rate = 20, .burst = 20}, .allow_degraded = false},
  };
  std::vector<model_config> models{
      {.name = "feedback-large", .digest = "feedback-large@sim-2025-06", .limits = {.max_in_flight = 48}},
      {.name = "feedback-small", .digest = "feedback-small@sim-2025-06", .limits = {.max_in_flight = 48},
       .token_estimate = 300},
  };

  // The provider's breaker (one per provider endpoint), its attempt
  // timeouts, retries and the service-wide retry budget.
  keel::circuit_breaker_options breaker{.window_calls = 40,
                                        .minimum_calls = 10,
                                        .failure_rate_threshold = 0.5,
                                        .open_duration = 2s,
                                        .half_open_probes = 3,
                                        .probe_timeout = 3s};
  keel::adaptive_timeout_options model_timeout{
      .margin = 200ms, .lower = 300ms, .upper = 1500ms, .initial = 1000ms, .min_samples = 20};
  keel::adaptive_timeout_options batch_timeout{
      .margin = 500ms, .lower = 500ms, .upper = 4000ms, .initial = 2000ms, .min_samples = 20};
  int model_attempts = 2;  // per interactive request, the first included
  // The deadline cut (keel::cut_at_deadline): each interactive and
  // embeddings attempt's stop token fires at its deadline, which aborts the
  // upstream transfer at once; one timer thread. Off only for a test on a
  // manual clock that auto-advances: any waiting thread moves that clock,
  // so the timer's would jump every call to its deadline.
  bool cut_at_deadline = true;
  int batch_attempts = 3;  // per batch job attempt
  keel::full_jitter backoff{.base = 50ms, .cap = 200ms};
  keel::retry_budget_options retry_budget{.ratio = 0.1, .min_per_second = 5};

  // Durable state.
  keel::duration idempotency_lease = 4s;      // > the interactive deadline
  keel::duration idempotency_retention = 24h;
  keel::duration store_busy_timeout = 200ms;  // a busy idempotency file never holds a request long

  // The batch queue and its workers.
  std::int64_t batch_max_depth = 200;
  keel::duration batch_max_age = 10min;
  // With the backoff below, 8 attempts span about 22 s: longer than an
  // outage the breaker rides out, short enough to fail a poisoned job soon.
  int batch_max_job_attempts = 8;
  keel::duration batch_job_deadline = 10s;  // one attempt at a report
  keel::duration batch_lease = 5s;
  keel::duration batch_poll = 100ms;
  keel::duration batch_retry_backoff = 500ms;
  keel::duration batch_retry_backoff_cap = 5s;
  int batch_workers = 8;  // in-process worker threads; 0: none (another process works the queue)

  // SLOs: availability targets over a window.
  double interactive_target = 0.99;   // answered (full or degraded) within the deadline
  double full_answer_target = 0.95;   // of the answered, by the model itself
  double batch_target = 0.99;
  keel::duration slo_window = 10min;

  // Where model calls go. With `upstream` set, every model call (feedback,
  // batch reports, streams) goes over HTTP to that OpenAI-compatible server,
  // and the streams' second model is `upstream_backup` (without one, streams
  // are neither failed over nor continued). Unset: the in-process simulated
  // provider below, as the tests on keel's manual clock use.
  // gateway/config.hpp fills both from a config file (with_upstreams).
  std::optional<http_upstream_options> upstream{};
  std::optional<http_upstream_options> upstream_backup{};
  // Client API keys (a config file's [clients]). With any, every /v1/
  // request must carry "Authorization: Bearer <key>" and is served as the
  // key's tenant; a body naming another tenant is refused (403). None: the
  // body names its tenant, as the tests and the in-process demo do.
  std::vector<api_key> api_keys{};
  // A failure after the upstreams were tried (retries and failover spent)
  // tells the client x-should-retry: false, so 3 SDK attempts around 3
  // gateway attempts do not become 9 upstream calls. false: not sent.
  bool tell_clients_retries_spent = true;
  // The simulated provider (when `upstream` is unset) and the rubric database.
  provider_options provider{.capacity = 40};
  // Streaming chat completions (and their second model, chat.backup).
  chat_config chat{};
  keel::duration rubric_latency = 5ms;

  // Replicas: with fleet.redis set ("host:port"), the provider's concurrency
  // and state are shared through that Redis (gateway/fleet.hpp).
  fleet_config fleet{};

  // HTTP: the front door (gateway/http_server.hpp says why each limit).
  // Network timeouts, so scale_time() leaves them alone.
  int http_threads = 96;              // workers for /v1/*: every class's slots and queues
  // Fibers instead of a worker thread per request (0: threads): requests,
  // and their model calls and streams, run on fibers over this many
  // threads; http_threads then bounds requests in flight, not threads.
  int http_fiber_threads = 0;
  int http_reserved_threads = 4;      // workers only /healthz and /metrics use (/admin/* has a lane of its own)
  int http_queue = 96;                // complete requests waiting for a worker, per lane; beyond: 503
  int http_max_connections = 4096;    // open connections; beyond, new ones wait in the backlog
  int http_listen_backlog = 1024;     // the kernel's accept queue: a burst of connects is not dropped
  std::size_t max_body_bytes = 64 * 1024;    // per request, chunked or not; 413 before it is read
  std::size_t max_header_bytes = 16 * 1024;  // request line and header fields; 431 beyond
  keel::duration http_header_timeout = 5s;   // first byte to the end of the head, however it trickles: 408
  keel::duration http_body_timeout = 10s;    // end of the head to the end of the body: 408
  keel::duration http_idle_timeout = 5s;     // a kept-alive connection between requests: closed
  keel::duration http_write_timeout = 5s;    // writing one response

  [[nodiscard]] absl::Status validate() const {
    constexpr std::string_view who = "gateway_options";
    if (absl::Status s = interactive.validate(); !s.ok()) return keel::annotate(s, "gateway_options.interactive");
    if (data_dir.empty()) return keel::invalid_option(who, "data_dir", "name a directory", "\"\"");
    const std::pair<std::string_view, int> slots[] = {{"interactive_slots", interactive_slots},
                                                      {"batch_slots", batch_slots},
                                                      {"recovery_slots", recovery_slots}};
    for (const auto& [field, n] : slots) {
      if (n < 1 || n > 32767) return keel::invalid_option(who, field, "be in [1, 32767]", n);
    }
    if (models.empty()) return keel::invalid_option(who, "models", "name at least one model", 0);
    for (const model_config& m : models) {
      if (m.name.empty() || m.digest.empty())
        return keel::invalid_option(who, "models", "give every model a name and a digest", m.name);
      if (m.upstream_backup && !m.upstream)
        return keel::invalid_option(who, "models.upstream_backup", "be set only with the model's upstream", m.name);
      for (const std::optional<http_upstream_options>* u : {&m.upstream, &m.upstream_backup}) {
        if (!*u) continue;
        if (absl::Status s = (*u)->validate(); !s.ok()) return keel::annotate(s, cat("gateway_options.models.", m.name));
      }
      if (m.chat) {
        if (absl::Status s = m.chat->validate(); !s.ok()) return keel::annotate(s, cat("gateway_options.models.", m.name));
      }
      if (m.breaker) {
        if (absl::Status s = m.breaker->validate(); !s.ok())
          return keel::annotate(s, cat("gateway_options.models.", m.name, ".breaker"));
      }
      if (m.retry_budget) {
        if (absl::Status s = m.retry_budget->validate(); !s.ok())
          return keel::annotate(s, cat("gateway_options.models.", m.name, ".retry_budget"));
      }
      for (const http_upstream_options& u : m.upstream_fallbacks) {
        if (absl::Status s = u.validate(); !s.ok()) return keel::annotate(s, cat("gateway_options.models.", m.name));
      }
      if (!m.upstream_fallbacks.empty() && !m.upstream_backup && !(m.name == models.front().name && upstream_backup))
        return keel::invalid_option(who, "models.upstream_fallbacks", "follow a second deployment", m.name);
    }
    if (model_attempts < 1) return keel::invalid_option(who, "model_attempts", "be >= 1", model_attempts);
    if (batch_attempts < 1) return keel::invalid_option(who, "batch_attempts", "be >= 1", batch_attempts);
    if (idempotency_lease <= interactive.deadline)
      return keel::invalid_option(who, "idempotency_lease", "exceed the interactive deadline",
                                         idempotency_lease);
    // A record outlives the claim that holds it: the feedback lease, and a
    // keyed chat request's (its deadline + 10 s).
    if (idempotency_retention <= std::max(idempotency_lease, chat.deadline + 10s))
      return keel::invalid_option(who, "idempotency_retention",
                                         "exceed idempotency_lease and chat.deadline + 10 s", idempotency_retention);
    if (batch_workers < 0) return keel::invalid_option(who, "batch_workers", "be >= 0", batch_workers);
    if (http_threads < 4) return keel::invalid_option(who, "http_threads", "be >= 4", http_threads);
    if (http_fiber_threads < 0 || http_fiber_threads > 64)
      return keel::invalid_option(who, "http_fiber_threads", "be in [0, 64]", http_fiber_threads);
    if (max_body_bytes < 1024)
      return keel::invalid_option(who, "max_body_bytes", "be >= 1024", max_body_bytes);
    const std::pair<std::string_view, int> http_counts[] = {{"http_reserved_threads", http_reserved_threads},
                                                            {"http_queue", http_queue},
                                                            {"http_max_connections", http_max_connections},
                                                            {"http_listen_backlog", http_listen_backlog}};
    for (const auto& [field, n] : http_counts) {
      if (n < 1) return keel::invalid_option(who, field, "be >= 1", n);
    }
    if (max_header_bytes < 1024)
      return keel::invalid_option(who, "max_header_bytes", "be >= 1024", max_header_bytes);
    const std::pair<std::string_view, keel::duration> http_times[] = {{"http_header_timeout", http_header_timeout},
                                                                      {"http_body_timeout", http_body_timeout},
                                                                      {"http_idle_timeout", http_idle_timeout},
                                                                      {"http_write_timeout", http_write_timeout}};
    for (const auto& [field, d] : http_times) {
      if (d < 1ms) return keel::invalid_option(who, field, "be >= 1 ms", d);
    }
    if (!(interactive_target > 0 && interactive_target < 1))
      return keel::invalid_option(who, "interactive_target", "be in (0, 1)", interactive_target);
    if (!(full_answer_target > 0 && full_answer_target < 1))
      return keel::invalid_option(who, "full_answer_target", "be in (0, 1)", full_answer_target);
    if (!(batch_target > 0 && batch_target < 1))
      return keel::invalid_option(who, "batch_target", "be in (0, 1)", batch_target);
    if (absl::Status s = provider.validate(); !s.ok()) return s;
    if (absl::Status s = chat.validate(); !s.ok()) return s;
    for (const api_key& k : api_keys) {
      if (k.tenant.empty()) return keel::invalid_option(who, "api_keys", "give every key a tenant", "\"\"");
    }
    if (upstream_backup && !upstream)
      return keel::invalid_option(who, "upstream_backup", "be set only with upstream", upstream_backup->name);
    if (upstream) {
      if (absl::Status s = upstream->validate(); !s.ok()) return keel::annotate(s, "gateway_options.upstream");
    }
    if (upstream_backup) {
      if (absl::Status s = upstream_backup->validate(); !s.ok())
        return keel::annotate(s, "gateway_options.upstream_backup");
      if (upstream->name == upstream_backup->name)
        return keel::invalid_option(who, "upstream_backup.name", "differ from upstream.name",
                                           upstream_backup->name);
    }
    if (chat.backup.name == provider.name)
      return keel::invalid_option(who, "chat.backup.name", "differ from provider.name", chat.backup.name);
    if (absl::Status s = fleet.validate(); !s.ok()) return s;
    if (absl::Status s = model_timeout.validate(); !s.ok()) return keel::annotate(s, "gateway_options.model_timeout");
    if (absl::Status s = batch_timeout.validate(); !s.ok()) return keel::annotate(s, "gateway_options.batch_timeout");
    if (absl::Status s = backoff.validate(); !s.ok()) return keel::annotate(s, "gateway_options.backoff");
    return absl::OkStatus();
  }
};

// Multiplies every duration of `o` by `f` (for tests: the same plan, faster).
// Rates scale inversely, so quotas keep their meaning per request.
inline void scale_time(gateway_options& o, double f) {
  auto s = [f](keel::duration& d) {
    d = std::chrono::duration_cast<keel::duration>(std::chrono::duration<double, std::nano>(d) * f);
  };
  deadline_plan& p = o.interactive;
  for (keel::duration* d : {&p.deadline, &p.response_reserve, &p.admit, &p.retrieve, &p.model, &p.cancel,
                            &p.fallback, &p.respond}) {
    s(*d);
  }
  for (keel::duration* d : {&o.batch_queue_age, &o.recovery_queue_age, &o.breaker.open_duration,
                            &o.breaker.probe_timeout, &o.model_timeout.margin, &o.model_timeout.lower,
                            &o.model_timeout.upper, &o.model_timeout.initial, &o.batch_timeout.margin,
                            &o.batch_timeout.lower, &o.batch_timeout.upper, &o.batch_timeout.initial,
                            &o.backoff.base, &o.backoff.cap, &o.idempotency_lease, &o.store_busy_timeout,
                            &o.batch_job_deadline, &o.batch_lease, &o.batch_poll, &o.batch_retry_backoff,
                            &o.batch_retry_backoff_cap, &o.provider.median_latency, &o.provider.close_latency,
                            &o.provider.refuse_latency, &o.rubric_latency, &o.provider.first_token_latency,
                            &o.provider.token_gap, &o.chat.deadline, &o.chat.first_token, &o.chat.stall,
                            &o.chat.whole, &o.chat.hedge_delay, &o.chat.hedge_min_delay, &o.chat.queue_age,
                            &o.chat.ttft_threshold, &o.chat.backup.median_latency, &o.chat.backup.close_latency,
                            &o.chat.backup.refuse_latency, &o.chat.backup.first_token_latency,
                            &o.chat.backup.token_gap}) {
    s(*d);
  }
  // Rates per second grow by 1/f so a quota admits the same share of the
  // (faster) traffic; compute windows shrink with time.
  auto q = [f, &s](keel::quota_limits& l) {
    if (l.rate) *l.rate /= f;
    s(l.compute_window);
  };
  q(o.tenant_defaults);
  for (tenant_config& t : o.tenants) q(t.limits);
  for (model_config& m : o.models) q(m.limits);
  o.retry_budget.min_per_second /= f;
  s(o.retry_budget.window);
  s(o.slo_window);
  s(o.batch_max_age);
  s(o.provider.overload_retry_after);
  s(o.chat.backup.overload_retry_after);
}

}  // namespace gateway
