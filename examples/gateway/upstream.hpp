// gateway/upstream.hpp — where the gateway's model calls go: one interface
// for a model upstream, and its implementation over HTTP (an
// OpenAI-compatible server: vLLM, llama.cpp's server, TGI, OpenAI, or
// examples/mock_upstream) through keel's libcurl provider and SSE reader.
//
// The plan (gateway_core.hpp) calls a model_upstream; it does not know
// whether the model runs in another process or, in the tests on keel's
// manual clock, is the in-process simulated_provider. http_upstream gives
// each call what keel::http::client gives: connection reuse, the attempt's
// time left sent upstream (x-request-timeout-ms), the transfer aborted on
// the attempt's stop token, an Idempotency-Key on writes, and the
// provider's hints (retry-after-ms, Retry-After, x-should-retry,
// rate-limit resets) classified into keel's outcomes.
//
// Example:
//
//   gateway::http_upstream llm({.name = "local", .base_url = "http://127.0.0.1:8000", .model = "llama-3.1-8b"});
//   absl::StatusOr<std::string> text = llm.complete(attempt, "Question q-1. Answer: ...", "key-1");
//
// On a fiber of a gateway::fiber_pool (the front door's fiber mode,
// gateway/http_server.hpp) a call goes through keel::asio::http_client on
// that thread's event loop and parks the fiber until the answer (a stream's
// tokens are handed over on the loop as they arrive); anywhere else (a
// worker thread, a hedge's thread) it blocks on keel::http::client. The
// same requests, hints and statuses either way: both clients build and
// classify them with the same functions.
//
// Thread-safety: complete() and stream() may run on any number of threads
// and fibers at once (each transfer takes its own pooled handle).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "keel/compose/stream.hpp"
#include "keel/core/call.hpp"
#include "keel/core/status.hpp"
#include "keel/provider/http.hpp"
#include "fibers.hpp"
#include "text.hpp"

namespace gateway {

// A model the plan calls: one completion (the feedback and report
// contract's JSON as text) or one token stream.
class model_upstream {
 public:
  virtual ~model_upstream() = default;
  [[nodiscard]] virtual const std::string& name() const noexcept = 0;
  // One completion of `prompt`; `idempotency_key` ties every attempt of one
  // client request together upstream (empty: one is drawn per call).
  virtual absl::StatusOr<std::string> complete(const keel::attempt& a, std::string_view prompt,
                                               std::string_view idempotency_key) = 0;
  // One streamed completion into `w`, after what w.text_so_far() holds.
  // `request`: the client's own request (messages, tools, tool_choice,
  // sampling; see chat_request::upstream_request), sent as it came with the
  // upstream's model; null: `prompt` as one user message.
  virtual absl::Status stream(const keel::attempt& a, keel::stream_writer& w, std::string_view prompt,
                              int max_tokens, const nlohmann::json* request) = 0;
  // One embeddings request (OpenAI's body; its "model" is set to the
  // upstream's): the upstream's JSON answer as it was sent.
  virtual absl::StatusOr<std::string> embed(const keel::attempt& a, const nlohmann::json& request) = 0;
};

// What one HTTP upstream deployment is: where, which model, how to connect.
struct http_upstream_options {
  std::string name{};    // the failure domain: breakers, metrics and served_by use it
  std::string base_url{};  // http(s)://host:port, without /v1
  std::string model{};     // the model name the upstream knows
  std::string api_key{};   // sent as "Authorization: Bearer"; empty: none (resolved from the environment, never a file)
  std::vector<std::string> headers{};          // extra "Name: value" lines
  std::size_t max_connections = 64;            // kept-alive connections (pooled handles)
  keel::duration connect_timeout = std::chrono::seconds(2);

  bool operator==(const http_upstream_options&) const = default;

  [[nodiscard]] absl::Status validate() const {
    constexpr std::string_view who = "http_upstream_options";
    if (name.empty()) return keel::invalid_option(who, "name", "not be empty", "\"\"");
    if (!base_url.starts_with("http://") && !base_url.starts_with("https://"))
      return keel::invalid_option(who, "base_url", "start with http:// or https://", base_url);
    if (model.empty()) return keel::invalid_option(who, "model", "not be empty", "\"\"");
    if (api_key.find_first_of("\r\n") != std::string::npos)
      return keel::invalid_option(who, "api_key", "have no CR or LF", "(hidden)");
    if (max_connections == 0) return keel::invalid_option(who, "max_connections", "be > 0", 0);
    if (connect_timeout <= keel::duration::zero())
      return keel::invalid_option(who, "connect_timeout", "be > 0", connect_timeout);
    return absl::OkStatus();
  }
};

// What an HTTP upstream has done since it started.
struct upstream_figures {
  std::int64_t calls = 0;     // completions and streams started
  std::int64_t answered = 0;  // a 2xx completion, or a stream that reached its end
  std::int64_t failed = 0;    // everything else, stops included
};

class http_upstream final : public model_upstream {
 public:
  // Throws keel::invalid_options if `o` is invalid.
  explicit http_upstream(http_upstream_options o)
      : options_((keel::require_valid_options(o.validate()), std::move(o))),
        client_(client_options(options_)),
        loop_client_(client_options(options_)) {}

  [[nodiscard]] const std::string& name() const noexcept override { return options_.name; }
  [[nodiscard]] const http_upstream_options& options() const noexcept { return options_; }

  absl::StatusOr<std::string> complete(const keel::attempt& a, std::string_view prompt,
                                       std::string_view idempotency_key) override {
    calls_.fetch_add(1, std::memory_order_relaxed);
    // JSON mode: the feedback and report contract is a JSON object.
    const std::string body =
        nlohmann::json{{"model", options_.model},
                       {"messages", {{{"role", "user"}, {"content", prompt}}}},
                       {"response_format", {{"type", "json_object"}}},
                       {"stream", false}}
            .dump();
    const keel::http::request request{.path = "/v1/chat/completions", .body = body, .idempotency_key = idempotency_key};
    auto parse = [&a](const keel::http::response& r) -> absl::StatusOr<std::string> {
          const nlohmann::json j = nlohmann::json::parse(r.body, nullptr, false);
          if (j.is_discarded() || !j.is_object()) return absl::InternalError("upstream: the answer is not JSON");
          const nlohmann::json* usage = j.contains("usage") ? &j["usage"] : nullptr;
          if (usage != nullptr && usage->is_object() && usage->contains("total_tokens") &&
              (*usage)["total_tokens"].is_number_integer())
            a.charge((*usage)["total_tokens"].get<std::int64_t>());
          if (!j.contains("choices") || !j["choices"].is_array() || j["choices"].empty())
            return absl::InternalError("upstream: the answer has no choices");
          const nlohmann::json& message = j["choices"][0]["message"];
          if (!message.is_object() || !message.contains("content") || !message["content"].is_string())
            return absl::InternalError("upstream: the answer's message has no text content");
          return message["content"].get<std::string>();
        };
    absl::StatusOr<std::string> out = exchange(a, request, parse);
    (out.ok() ? answered_ : failed_).fetch_add(1, std::memory_order_relaxed);
    return out;
  }

  absl::Status stream(const keel::attempt& a, keel::stream_writer& w, std::string_view prompt, int max_tokens,
                      const nlohmann::json* request) override {
    calls_.fetch_add(1, std::memory_order_relaxed);
    nlohmann::json out = request != nullptr && request->is_object() ? *request : nlohmann::json::object();
    if (request == nullptr) out["messages"] = {{{"role", "user"}, {"content", prompt}}};
    // A continuation: the text shown so far is the assistant's, to go on from.
    if (!w.text_so_far().empty())
      out["messages"].push_back({{"role", "assistant"}, {"content", std::string(w.text_so_far())}});
    out["model"] = options_.model;
    out["max_tokens"] = max_tokens;
    out["stream"] = true;
    out["stream_options"] = {{"include_usage", true}};
    const std::string body = out.dump();
    const keel::http::request req{.path = "/v1/chat/completions", .body = body};
    const absl::Status s = fiber_http::on_fiber() ? loop_client_.stream(a, w, req) : client_.stream(req)(a, w);
    (s.ok() ? answered_ : failed_).fetch_add(1, std::memory_order_relaxed);
    return s;
  }

  absl::StatusOr<std::string> embed(const keel::attempt& a, const nlohmann::json& request) override {
    calls_.fetch_add(1, std::memory_order_relaxed);
    nlohmann::json j = request;
    j["model"] = options_.model;
    const std::string body = j.dump();
    absl::StatusOr<std::string> out =
        exchange(a, {.path = "/v1/embeddings", .body = body},
                 [](const keel::http::response& r) -> absl::StatusOr<std::string> { return std::string(r.body); });
    (out.ok() ? answered_ : failed_).fetch_add(1, std::memory_order_relaxed);
    return out;
  }

  [[nodiscard]] upstream_figures figures() const noexcept {
    return {.calls = calls_.load(std::memory_order_relaxed),
            .answered = answered_.load(std::memory_order_relaxed),
            .failed = failed_.load(std::memory_order_relaxed)};
  }

 private:
  // One exchange on whichever client serves this caller.
  template <class Parse>
  absl::StatusOr<std::string> exchange(const keel::attempt& a, const keel::http::request& r, Parse parse) {
    if (fiber_http::on_fiber()) return loop_client_.exchange(a, r, parse);
    return client_.exchange(r, std::move(parse))(a);
  }

  static keel::http::client_options client_options(const http_upstream_options& o) {
    std::vector<std::string> headers = o.headers;
    if (!o.api_key.empty()) headers.push_back(cat("Authorization: Bearer ", o.api_key));
    return {.base_url = o.base_url,
            .headers = std::move(headers),
            .connect_timeout = o.connect_timeout,
            .max_idle_handles = o.max_connections,
            .verify_peer = true};
  }

  http_upstream_options options_;
  keel::http::client client_;
  fiber_http loop_client_;  // on fibers; the fiber_pool outlives the upstreams
  std::atomic<std::int64_t> calls_{0}, answered_{0}, failed_{0};
};

}  // namespace gateway
