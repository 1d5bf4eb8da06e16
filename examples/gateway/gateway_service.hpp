// gateway/gateway_service.hpp — the example gateway as an HTTP service
// (cpp-httplib) on a loopback port: a thin adapter over gateway_core.
//
// Endpoints:
//
//   POST /v1/feedback        interactive feedback (Idempotency-Key required)
//   POST /v1/batch           submit a batch report job (Idempotency-Key required)
//   GET  /v1/batch/<id>?tenant=<t>   a job's state (and report, once done)
//   GET  /healthz            breakers, shed classes, bulkheads, queue, SLOs
//   GET  /metrics            Prometheus text
//   POST /admin/breaker      {"mode": "open" | "closed" | "auto"}
//   POST /admin/shed         {"class": "interactive" | "batch", "shed": bool}
//   POST /admin/fault        {"kind": "slowdown" | "stall" | "rate_limit" | "outage" |
//                             "invalid_output" | "none", ...}
//
// Every error is JSON: {"error": {"status", "message", ["refused_by"],
// ["retry_after_ms"]}} with a Retry-After header when there is a hint.
// Bodies above options.max_body_bytes are refused with 413 before any
// handler runs.
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
// endpoints run on the server's own pool of threads.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include <httplib.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "text.hpp"
#include "keel/store/sqlite_jobs.hpp"
#include "gateway_core.hpp"

namespace gateway {

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
  // on a background thread.
  absl::Status start(const std::string& host = "127.0.0.1", int port = 0) {
    if (listener_.joinable()) return absl::FailedPreconditionError("the service is already started");
    port_ = port == 0 ? server_.bind_to_any_port(host) : (server_.bind_to_port(host, port) ? port : -1);
    if (port_ <= 0) return absl::UnavailableError(cat("cannot bind ", host, ":", port));
    core_->start_workers();
    // The socket is listening once bound: clients may connect at once.
    listener_ = std::thread([this] { server_.listen_after_bind(); });
    return absl::OkStatus();
  }

  [[nodiscard]] int port() const noexcept { return port_; }
  [[nodiscard]] core_type& core() noexcept { return *core_; }

  // Stops listening, cancels running requests, stops the workers. Idempotent.
  void stop() {
    core_->shutdown();
    if (listener_.joinable()) {
      server_.stop();
      listener_.join();
    }
  }

 private:
  explicit service(std::unique_ptr<core_type> core) : core_(std::move(core)) {
    const gateway_options& o = core_->options();
    const auto threads = static_cast<std::size_t>(o.http_threads);
    // The default pool (8 threads) would queue connections without bound
    // in front of the bulkheads; size it for every class's slots and queues.
    server_.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
    server_.set_payload_max_length(o.max_body_bytes);
    server_.set_read_timeout(std::chrono::seconds(5));
    server_.set_write_timeout(std::chrono::seconds(5));
    server_.set_keep_alive_max_count(1000);
    // An idle keep-alive connection holds a server thread this long, and
    // stop() waits for it: keep it short.
    server_.set_keep_alive_timeout(1);

    server_.Post("/v1/feedback", [this](const httplib::Request& req, httplib::Response& res) {
      const std::optional<std::string> key = header(req, "Idempotency-Key");
      send(res, core_->feedback(req.body, view(key)));
    });
    server_.Post("/v1/batch", [this](const httplib::Request& req, httplib::Response& res) {
      const std::optional<std::string> key = header(req, "Idempotency-Key");
      send(res, core_->batch_submit(req.body, view(key)));
    });
    server_.Get(R"(/v1/batch/([^/]+))", [this](const httplib::Request& req, httplib::Response& res) {
      std::optional<std::string> tenant;
      if (req.has_param("tenant")) tenant = req.get_param_value("tenant");
      send(res, core_->batch_status(req.matches[1].str(), view(tenant)));
    });
    server_.Get("/healthz", [this](const httplib::Request&, httplib::Response& res) { send(res, core_->health()); });
    server_.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) { send(res, core_->metrics()); });
    server_.Post("/admin/breaker", [this](const httplib::Request& req, httplib::Response& res) {
      send(res, core_->admin_breaker(req.body));
    });
    server_.Post("/admin/shed", [this](const httplib::Request& req, httplib::Response& res) {
      send(res, core_->admin_shed(req.body));
    });
    server_.Post("/admin/fault", [this](const httplib::Request& req, httplib::Response& res) {
      send(res, core_->admin_fault(req.body));
    });
    // Unrouted paths (404), bodies over the limit (413) and malformed
    // requests (400) come from httplib with an empty body: make it JSON.
    server_.set_error_handler(httplib::Server::HandlerWithResponse(
        [this](const httplib::Request& req, httplib::Response& res) -> httplib::Server::HandlerResponse {
      if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
      if (res.status == 404) {
        send(res, core_->not_found(req.path));
      } else {
        const absl::Status s = res.status == 413
                                   ? absl::InvalidArgumentError(cat(
                                         "the body exceeds ", core_->options().max_body_bytes, " bytes"))
                                   : absl::InvalidArgumentError(cat("the request was refused (HTTP ",
                                                                             res.status, ")"));
        const int status = res.status;
        send(res, detail::error_reply(s, status));
      }
      return httplib::Server::HandlerResponse::Handled;
    }));
    server_.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
      std::string what = "unknown exception";
      try {
        if (ep) std::rethrow_exception(ep);
      } catch (const std::exception& e) {
        what = e.what();
      } catch (...) {
      }
      send(res, detail::error_reply(absl::InternalError(cat("the gateway failed: ", what)), 500));
    });
  }

  static std::optional<std::string> header(const httplib::Request& req, const char* name) {
    if (!req.has_header(name)) return std::nullopt;
    return req.get_header_value(name);
  }
  static std::optional<std::string_view> view(const std::optional<std::string>& s) {
    if (!s) return std::nullopt;
    return std::string_view(*s);
  }

  static void send(httplib::Response& res, const reply& r) {
    res.status = r.status;
    if (r.retry_after) {
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(*r.retry_after).count();
      res.set_header("Retry-After", std::to_string((ms + 999) / 1000));
    }
    res.set_content(r.body, r.content_type.c_str());
  }

  std::unique_ptr<core_type> core_;
  httplib::Server server_;
  std::thread listener_;
  int port_ = -1;
};

}  // namespace gateway
