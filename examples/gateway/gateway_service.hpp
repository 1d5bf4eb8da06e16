// gateway/gateway_service.hpp — the example gateway as an HTTP service on a
// loopback port: a thin adapter from gateway/http_server.hpp (the front
// door that frames, bounds and times every request) to gateway_core.
//
// Endpoints:
//
//   POST /v1/feedback        interactive feedback (Idempotency-Key required)
//   POST /v1/chat/completions  OpenAI-compatible chat; "stream": true relays
//                            tokens as server-sent events (gateway/chat.hpp)
//   POST /v1/embeddings      OpenAI-compatible embeddings, relayed to the model's deployment
//   GET  /v1/models          the configured models
//   POST /v1/batch           submit a batch report job (Idempotency-Key required)
//   GET  /v1/batch/<id>?tenant=<t>   a job's state (and report, once done)
//   GET  /healthz            breakers, shed classes, bulkheads, queue, SLOs, the front door's figures
//   GET  /metrics            Prometheus text
//   POST /admin/breaker      {"mode": "open" | "closed" | "auto"}
//   POST /admin/shed         {"class": "interactive" | "batch", "shed": bool}
//   POST /admin/fault        {"kind": "slowdown" | "stall" | "rate_limit" | "outage" |
//                             "invalid_output" | "none", ...}
//
// With API keys (gateway_options::api_keys) every /v1/ request needs
// "Authorization: Bearer <key>" (401 otherwise) and is the key's tenant's.
// Every answer carries x-request-id. Every error is JSON in OpenAI's shape
// plus keel's fields: {"error": {"message", "type", "param", "code",
// "status", ["refused_by"], ["retry_after_ms"]}} with retry-after-ms and
// Retry-After headers when there is a hint, and x-should-retry: false when
// the gateway already spent the retries that make sense. The
// front door's own refusals (a body over options.max_body_bytes: 413 before
// it is read; an encoded body: 415; a head or body too slow: 408; a
// malformed head: 400; a full lane: 503) are JSON too, name the limit, carry
// refused_by "http:<reason>" and are counted in gateway_http_requests_total
// like every other reply. /healthz, /metrics and /admin/* are served by the
// front door's reserved workers, so they answer while the ordinary ones are
// all busy. Header values reach the gateway as the bytes that were sent.
//
// Example:
//
//   gateway::gateway_options o;
//   o.data_dir = dir;
//   auto svc = gateway::service::open(o);           // StatusOr<unique_ptr<service>>
//   absl::Status up = (*svc)->start("127.0.0.1", 0);  // 0: any free port
//   int port = (*svc)->port();
//   ...
//   (*svc)->stop();
//
// Thread-safety: start() and stop() from one controlling thread; the
// endpoints run on the front door's threads.
#pragma once

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>


#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "text.hpp"
#include "keel/store/sqlite_jobs.hpp"
#include "gateway_core.hpp"
#include "http_server.hpp"

namespace gateway {

// The PORT of `gateway --serve PORT`: a decimal number in [0, 65535] (0:
// any free port), nothing else; the error says what was wrong.
[[nodiscard]] inline absl::StatusOr<int> parse_port(std::string_view text) {
  int port = -1;
  const char* end = text.data() + text.size();
  const auto [at, ec] = std::from_chars(text.data(), end, port);
  if (text.empty() || ec != std::errc() || at != end || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        cat("the port must be a number in [0, 65535] (0: any free port); got '", text.substr(0, 32), "'"));
  }
  return port;
}

// What gateway_http_requests_total calls the endpoint at `path`.
[[nodiscard]] inline std::string_view endpoint_of(std::string_view path) {
  if (path == "/v1/feedback") return "feedback";
  if (path == "/v1/chat/completions") return "chat";
  if (path == "/v1/models") return "models";
  if (path == "/v1/embeddings") return "embeddings";
  if (path == "/v1/batch") return "batch";
  if (path.starts_with("/v1/batch/")) return "batch_status";
  if (path == "/healthz") return "health";
  if (path == "/metrics") return "metrics";
  if (path == "/admin/breaker") return "admin_breaker";
  if (path == "/admin/shed") return "admin_shed";
  if (path == "/admin/fault") return "admin_fault";
  return "other";
}

class service {
 public:
  using core_type = gateway_core<keel::real_clock, keel::sqlite_job_store<>>;

  // Opens the stores under o.data_dir; nothing listens yet.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<service>> open(gateway_options o) {
    absl::StatusOr<std::unique_ptr<core_type>> core = core_type::open(std::move(o), [](const std::string& path) {
      return keel::sqlite_job_store<>::open(path);
    });
    if (!core.ok()) return core.status();
    return std::unique_ptr<service>(new service(std::move(*core)));
  }

  service(const service&) = delete;
  service& operator=(const service&) = delete;
  ~service() { stop(); }

  // Binds host:port (0: a free port), starts the batch workers and serves
  // on the front door's threads.
  absl::Status start(const std::string& host = "127.0.0.1", int port = 0) {
    if (started_) return absl::FailedPreconditionError("the service is already started");
    if (absl::Status s = server_.start(host, port); !s.ok()) return s;
    started_ = true;
    core_->start_workers();
    return absl::OkStatus();
  }

  [[nodiscard]] int port() const noexcept { return server_.port(); }
  [[nodiscard]] core_type& core() noexcept { return *core_; }
  [[nodiscard]] http_server_figures http_figures() const { return server_.figures(); }

  // Cancels running requests, stops listening, stops the workers. Idempotent.
  void stop() {
    core_->shutdown();
    server_.stop();
  }

 private:
  explicit service(std::unique_ptr<core_type> core)
      : core_(std::move(core)),
        server_(server_options(core_->options(), core_->fibers()), [this](const http_request& r) { return route(r); },
                [this](const http_refusal& f) { return refused(f); },
                // Monitoring and operators each have workers of their own.
                [](const http_request& r) {
                  if (r.path.starts_with("/admin/")) return http_lane::admin;
                  return r.path == "/healthz" || r.path == "/metrics" ? http_lane::reserved : http_lane::ordinary;
                }) {}

  static http_server_options server_options(const gateway_options& o, fiber_pool* fibers) {
    return {.threads = o.http_threads,
            .reserved_threads = o.http_reserved_threads,
            .max_queue = o.http_queue,
            .max_connections = o.http_max_connections,
            .listen_backlog = o.http_listen_backlog,
            .max_body_bytes = o.max_body_bytes,
            .max_header_bytes = o.max_header_bytes,
            .header_timeout = std::chrono::duration_cast<std::chrono::milliseconds>(o.http_header_timeout),
            .body_timeout = std::chrono::duration_cast<std::chrono::milliseconds>(o.http_body_timeout),
            .idle_timeout = std::chrono::duration_cast<std::chrono::milliseconds>(o.http_idle_timeout),
            .write_timeout = std::chrono::duration_cast<std::chrono::milliseconds>(o.http_write_timeout),
            .fibers = fibers};
  }

  // Every answer carries an x-request-id: the client's own (printable ASCII,
  // at most 128 bytes) or one made here, so a report names one request.
  http_response route(const http_request& req) {
    std::string id;
    if (const std::optional<std::string_view> given = req.header("x-request-id"); given && client_request_id(*given)) {
      id = std::string(*given);
    } else {
      id = cat("req_", next_request_id_.fetch_add(1, std::memory_order_relaxed), "_", instance_);
    }
    http_response out = serve(req);
    out.headers.emplace_back("x-request-id", std::move(id));
    return out;
  }

  // A request id the client may give: printable ASCII, 1-128 bytes.
  [[nodiscard]] static bool client_request_id(std::string_view v) {
    return !v.empty() && v.size() <= 128 && std::all_of(v.begin(), v.end(), [](char c) { return c > 0x20 && c < 0x7f; });
  }

  // The client's own timeout, from the SDKs' X-Stainless-Timeout: whole
  // seconds, truncated, so "2" means 2-3 s; the call gets the lower bound,
  // never time the client will not wait. "0" means under a second, not no
  // time at all: it gets 1 s. Anything else (absent, not a number): none.
  [[nodiscard]] static std::optional<keel::duration> client_timeout(const http_request& req) {
    const std::optional<std::string_view> v = req.header("X-Stainless-Timeout");
    if (!v || req.header_count("X-Stainless-Timeout") != 1) return std::nullopt;
    std::int64_t seconds = -1;
    const auto [at, ec] = std::from_chars(v->data(), v->data() + v->size(), seconds);
    if (ec != std::errc() || at != v->data() + v->size() || seconds < 0 || seconds > 86400) return std::nullopt;
    return std::chrono::seconds(std::max<std::int64_t>(seconds, 1));
  }

  // With API keys configured, the tenant of the request's Bearer key
  // (find_by_key_digest); an error naming what is wrong otherwise.
  [[nodiscard]] static absl::StatusOr<std::string> authenticate(const http_request& req,
                                                                const std::vector<api_key>& keys) {
    if (req.header_count("Authorization") != 1)
      return absl::UnauthenticatedError("send one Authorization: Bearer <API key> header");
    const std::string_view v = *req.header("Authorization");
    if (v.size() < 8 || !detail::iequals(v.substr(0, 7), "Bearer "))
      return absl::UnauthenticatedError("the Authorization header must be Bearer <API key>");
    const api_key* found = find_by_key_digest(keys, &api_key::sha256, v.substr(7));
    if (found == nullptr) return absl::UnauthenticatedError("incorrect API key provided");
    return found->tenant;
  }

  http_response serve(const http_request& req) {
    const std::string_view path = req.path, method = req.method;
    const std::string_view endpoint = endpoint_of(path);
    std::optional<std::string> caller;
    // The keys of the plan serving now (a reload may replace them).
    const std::shared_ptr<const std::vector<api_key>> keys = core_->api_keys();
    if (path.starts_with("/v1/") && !keys->empty()) {
      absl::StatusOr<std::string> t = authenticate(req, *keys);
      if (!t.ok()) {
        http_response r = to_http(core_->unauthorized(endpoint, std::string(t.status().message())));
        r.headers.emplace_back("WWW-Authenticate", "Bearer");
        return r;
      }
      caller = std::move(*t);
    }
    const std::optional<std::string_view> who = caller ? std::optional<std::string_view>(*caller) : std::nullopt;
    const caller_info info{.tenant = who, .timeout = client_timeout(req)};
    auto keyed = [&](auto&& endpoint_fn) -> reply {
      // Two keys on one request are not one key.
      if (req.header_count("Idempotency-Key") > 1) {
        return core_->http_refused(endpoint, "malformed", 400, "send exactly one Idempotency-Key header");
      }
      return endpoint_fn(req.body, req.header("Idempotency-Key"));
    };
    if (method == "GET" && endpoint == "models") return to_http(core_->list_models());
    if (method == "POST" && endpoint == "embeddings") return to_http(core_->embeddings(req.body, info));
    if (method == "POST" && endpoint == "feedback") {
      return to_http(
          keyed([&](std::string_view b, const std::optional<std::string_view>& k) { return core_->feedback(b, k, info); }));
    }
    if (method == "POST" && endpoint == "chat") {
      if (req.header_count("Idempotency-Key") > 1)
        return to_http(core_->http_refused(endpoint, "malformed", 400, "send exactly one Idempotency-Key header"));
      return chat(req, caller, info.timeout);
    }
    if (method == "POST" && endpoint == "batch") {
      return to_http(keyed(
          [&](std::string_view b, const std::optional<std::string_view>& k) { return core_->batch_submit(b, k, info); }));
    }
    if (method == "GET" && endpoint == "batch_status" && path.find('/', 10) == std::string_view::npos) {
      const std::optional<std::string_view> asked = req.query_param("tenant");
      if (who && asked && *asked != *who)
        return to_http(core_->refuse_tenant(endpoint, *who));
      return to_http(core_->batch_status(path.substr(10), who ? who : asked));
    }
    if (method == "GET" && endpoint == "health") return health();
    if (method == "GET" && endpoint == "metrics") return to_http(core_->metrics());
    if (method == "POST" && endpoint == "admin_breaker") return to_http(core_->admin_breaker(req.body));
    if (method == "POST" && endpoint == "admin_shed") return to_http(core_->admin_shed(req.body));
    if (method == "POST" && endpoint == "admin_fault") return to_http(core_->admin_fault(req.body));
    return to_http(core_->not_found(cat(method, " ", path)));
  }

  // The front door's stream as the chat endpoint's sink.
  class stream_sink final : public chat_sink {
   public:
    explicit stream_sink(http_stream& s) : s_(s) {}
    bool send(std::string_view bytes) override { return s_.write(bytes); }
    [[nodiscard]] std::stop_token client_gone() const override { return s_.client_gone(); }

   private:
    http_stream& s_;
  };

  // Streamed from the worker that serves it: nothing is written until the
  // first token, so an error before it is an ordinary JSON reply.
  http_response chat(const http_request& req, std::optional<std::string> caller,
                     std::optional<keel::duration> timeout) {
    return {.content_type = "text/event-stream",
            .stream = [this, &req, caller = std::move(caller), timeout](http_stream& s) -> http_response {
              stream_sink sink(s);
              const std::optional<std::string_view> given = req.header("x-request-id");
              const reply r = core_->chat_completions(
                  req.body, &sink,
                  {.tenant = caller ? std::optional<std::string_view>(*caller) : std::nullopt,
                   .timeout = timeout,
                   .idempotency_key = req.header("Idempotency-Key"),
                   .request_id = given && client_request_id(*given) ? given : std::nullopt});
              if (r.streamed) return {};
              return to_http(r);
            }};
  }

  // /healthz with what the front door holds right now.
  http_response health() {
    reply r = core_->health();
    if (r.status == 200) {
      detail::json j = detail::json::parse(r.body, nullptr, false);
      if (j.is_object()) {
        const http_server_figures f = server_.figures();
        j["http"] = {{"connections", f.connections},
                     {"busy", f.busy},
                     {"busy_reserved", f.busy_reserved},
                     {"queued", f.queued},
                     {"queued_reserved", f.queued_reserved},
                     {"busy_admin", f.busy_admin},
                     {"queued_admin", f.queued_admin},
                     {"io_threads", f.io_threads},
                     {"evicted", f.evicted}};
        r.body = detail::dump(j);
      }
    }
    return to_http(r);
  }

  http_response refused(const http_refusal& f) {
    return to_http(core_->http_refused(endpoint_of(f.path), f.reason, f.status, f.message));
  }

  static http_response to_http(const reply& r) {
    http_response out{.status = r.status, .content_type = r.content_type, .body = r.body};
    if (r.retry_after) {
      // Both spellings the OpenAI SDKs read: retry-after-ms first, exact.
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(*r.retry_after).count();
      out.headers.emplace_back("retry-after-ms", std::to_string(ms));
      out.headers.emplace_back("Retry-After", std::to_string((ms + 999) / 1000));
    }
    if (r.should_retry) out.headers.emplace_back("x-should-retry", *r.should_retry ? "true" : "false");
    // A recorded answer sent again (Stripe's name for it; the IETF draft has none).
    if (r.replayed) out.headers.emplace_back("Idempotent-Replayed", "true");
    return out;
  }

  std::unique_ptr<core_type> core_;
  std::atomic<std::uint64_t> next_request_id_{1};
  // Tells this process's request ids from another's (a restart, a replica).
  std::uint64_t instance_ = static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  http_server server_;
  bool started_ = false;
};

}  // namespace gateway
