// The example gateway in front of real model servers: two mock upstream
// processes (examples/mock_upstream, OpenAI-compatible over HTTP) started on
// loopback, the gateway's model calls going to them through keel's libcurl
// provider and SSE reader. Faults are switched on the upstream itself
// (its /control/fault) and what the upstream saw is read from its
// /control/stats, so every claim is about what crossed the wire.
//
// Latency bounds are correctness bounds (keel_service::http_slack), never
// speed claims.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "config.hpp"
#include "gateway_service.hpp"
#include "keel/durable/digest.hpp"
#include "support/catch.hpp"
#include "support/child_program.hpp"
#include "support/mock_upstream.hpp"
#include "support/service.hpp"
#include "support/started_service.hpp"

using namespace std::chrono_literals;
using json = nlohmann::json;
using keel_service::start;
using keel_service::temp_dir;

namespace {

// A mock upstream process (examples/mock_upstream) named for its failure domain.
struct mock_upstream {
  mock_upstream(const temp_dir& /*dir*/, std::string n, const std::vector<std::string>& flags = {})
      : name(std::move(n)), process(flags, name) {}
  [[nodiscard]] std::string url() const { return process.url(); }
  void fault(const json& f) { REQUIRE(process.set_fault(f.dump()) == 200); }
  [[nodiscard]] json stats() const { return process.stats(); }

  std::string name;
  keel_test::mock_upstream_process process;
};

gateway::http_upstream_options upstream_of(const mock_upstream& m) {
  return {.name = m.name + "/mock-small", .base_url = m.url(), .model = "mock-small"};
}

struct reply {
  int status = 0;
  json body;
};

reply post(int port, const std::string& path, const json& body, const std::string& key = {}) {
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(30s);
  httplib::Headers h;
  if (!key.empty()) h.emplace("Idempotency-Key", key);
  const httplib::Result r = c.Post(path.c_str(), h, body.dump(), "application/json");
  if (!r) return {};
  return {r->status, json::parse(r->body, nullptr, false)};
}

json healthz(int port) {
  httplib::Client c("127.0.0.1", port);
  const httplib::Result r = c.Get("/healthz");
  REQUIRE(r);
  return json::parse(r->body);
}

json feedback_body(const std::string& answer = "one deadline, stages get what remains") {
  return {{"tenant", "acme"}, {"question_id", "q-timeouts"}, {"answer", answer}};
}

json chat_body(int max_tokens) {
  return {{"tenant", "acme"},
          {"messages", {{{"role", "user"}, {"content", "How long may one stage take?"}}}},
          {"max_tokens", max_tokens},
          {"stream", true}};
}

std::string chat_request(const json& body) {
  const std::string b = body.dump();
  return "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " +
         std::to_string(b.size()) + "\r\n\r\n" + b;
}

// A stat of the mock, 0 when absent.
std::int64_t stat(const json& s, const char* group, const char* name) {
  if (!s.contains(group) || !s[group].contains(name) || !s[group][name].is_number()) return 0;
  return s[group][name].get<std::int64_t>();
}

template <class Pred>
bool eventually(Pred p, std::chrono::milliseconds limit = 10s) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!p()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

// The seed's plan at full scale (a 3 s deadline, 1 s for the model): a real
// upstream on a loaded sanitizer build must still answer within its stage,
// or a test meant for one path would see the fallback.
gateway::gateway_options options_for(const std::string& dir, const mock_upstream& a, const mock_upstream& b) {
  gateway::gateway_options o;
  o.data_dir = dir;
  o.http_threads = 64;
  o.upstream = upstream_of(a);
  o.upstream_backup = upstream_of(b);
  o.batch_workers = 0;  // the batch path has its own tests; here every upstream call is one we made
  return o;
}

}  // namespace

TEST_CASE("feedback goes to the upstream over HTTP with the attempt's time left and one Idempotency-Key",
          "[service][upstreams]") {
  temp_dir dir;
  mock_upstream a(dir, "mock-a", {"--latency-ms", "20"}), b(dir, "mock-b", {"--latency-ms", "20"});
  const gateway::gateway_options o = options_for(dir.path(), a, b);
  auto svc = start(o);

  const reply r = post(svc->port(), "/v1/feedback", feedback_body(), "k-1");
  REQUIRE(r.status == 200);
  CHECK(r.body["degraded"] == false);
  CHECK(r.body["score"].is_number_integer());
  const json s = a.stats();
  CHECK(stat(s, "requests", "chat") == 1);
  CHECK(stat(b.stats(), "requests", "chat") == 0);
  const json& seen = s["last_request"];
  // A completion is a read upstream (its effect, the recorded decision, is
  // the gateway's own: keel::once), so keel::http sends no Idempotency-Key.
  CHECK(seen["idempotency_key"].is_null());
  REQUIRE(seen["x_request_timeout_ms"].is_string());
  const int left_ms = std::stoi(seen["x_request_timeout_ms"].get<std::string>());
  CHECK(left_ms > 0);
  CHECK(left_ms <= std::chrono::duration_cast<std::chrono::milliseconds>(o.interactive.model).count());

  // The upstream's faults are its own: the gateway does not pretend to switch them.
  CHECK(post(svc->port(), "/admin/fault", {{"kind", "outage"}}).status == 409);

  // A replay is answered from the record: the upstream is not asked again.
  const reply again = post(svc->port(), "/v1/feedback", feedback_body(), "k-1");
  CHECK(again.status == 200);
  CHECK(again.body["score"] == r.body["score"]);
  CHECK(stat(a.stats(), "requests", "chat") == 1);
}

TEST_CASE("an upstream's 429 hint is waited before the retry", "[service][upstreams]") {
  temp_dir dir;
  mock_upstream a(dir, "mock-a", {"--latency-ms", "10"}), b(dir, "mock-b");
  gateway::gateway_options o = options_for(dir.path(), a, b);
  auto svc = start(o);
  // Without the hint the first retry's backoff is at most 50 ms (full jitter, base 50 ms).
  a.fault({{"kind", "rate_limit"}, {"retry_after_ms", 400}});
  const auto t0 = std::chrono::steady_clock::now();
  const reply r = post(svc->port(), "/v1/feedback", feedback_body(), "k-429");
  const auto took = std::chrono::steady_clock::now() - t0;
  REQUIRE(r.status == 200);
  CHECK(r.body["degraded"] == true);  // both attempts were refused: the rubric answered
  CHECK(stat(a.stats(), "requests", "chat") == 2);
  CHECK(took >= 400ms);
}

TEST_CASE("an upstream outage opens that upstream's breaker and no other", "[service][upstreams]") {
  temp_dir dir;
  mock_upstream a(dir, "mock-a", {"--latency-ms", "5"}), b(dir, "mock-b", {"--latency-ms", "5"});
  gateway::gateway_options o = options_for(dir.path(), a, b);
  auto svc = start(o);
  a.fault({{"kind", "outage"}});
  for (int i = 0; i < o.breaker.minimum_calls + 2; ++i) {
    const reply r = post(svc->port(), "/v1/feedback", feedback_body(), "k-out-" + std::to_string(i));
    CHECK(r.status == 200);  // the rubric answers, degraded
  }
  const json h = healthz(svc->port());
  INFO(h.dump());
  REQUIRE(h["breakers"].is_array());
  bool a_open = false, b_open = false;
  for (const json& e : h["breakers"]) {
    const std::string domain = e.value("domain", "");
    const bool open = e.value("state", "") == "open";
    if (domain.find("mock-a") != std::string::npos) a_open = a_open || open;
    if (domain.find("mock-b") != std::string::npos) b_open = b_open || open;
  }
  CHECK(a_open);
  CHECK_FALSE(b_open);
  // While open, the upstream is not called.
  const std::int64_t calls = stat(a.stats(), "requests", "chat");
  CHECK(post(svc->port(), "/v1/feedback", feedback_body(), "k-after").status == 200);
  CHECK(stat(a.stats(), "requests", "chat") == calls);
}

TEST_CASE("a hung upstream is cut at the attempt's deadline, and the upstream sees the connection go",
          "[service][upstreams]") {
  temp_dir dir;
  mock_upstream a(dir, "mock-a"), b(dir, "mock-b");
  gateway::gateway_options o = options_for(dir.path(), a, b);
  o.model_attempts = 1;
  auto svc = start(o);
  a.fault({{"kind", "hang"}});
  const auto t0 = std::chrono::steady_clock::now();
  const reply r = post(svc->port(), "/v1/feedback", feedback_body(), "k-hang");
  const auto took = std::chrono::steady_clock::now() - t0;
  CHECK(r.status == 200);
  CHECK(r.body["degraded"] == true);
  CHECK(took < o.interactive.deadline + keel_service::http_slack);
  // The transfer was aborted, not left for the upstream to finish.
  CHECK(eventually([&] { return stat(a.stats(), "client_gone", "count") == 1; }, 5s));
}

TEST_CASE("streams over HTTP: fail over before the first token, continue after it", "[service][upstreams][chat]") {
  temp_dir dir;
  const std::vector<std::string> fast = {"--first-token-ms", "10", "--token-gap-ms", "2", "--tokens", "12"};
  mock_upstream a(dir, "mock-a", fast), b(dir, "mock-b", fast);
  gateway::gateway_options o = options_for(dir.path(), a, b);
  o.chat.hedge_delay = 0ms;  // no hedge: which upstream served is then the route's doing
  o.chat.hedge_percentile = 0;
  auto svc = start(o);

  SECTION("healthy: the primary serves the whole stream") {
    keel_service::raw_connection c(svc->port());
    REQUIRE(c.send(chat_request(chat_body(12))));
    const std::string got = c.read_until("\r\n0\r\n\r\n");
    CHECK(got.find("[DONE]") != std::string::npos);
    CHECK(stat(a.stats(), "requests", "chat") == 1);
    CHECK(stat(b.stats(), "requests", "chat") == 0);
  }
  SECTION("the primary is down: the second upstream serves before a byte was sent") {
    a.fault({{"kind", "outage"}});
    keel_service::raw_connection c(svc->port());
    REQUIRE(c.send(chat_request(chat_body(12))));
    const std::string got = c.read_until("\r\n0\r\n\r\n");
    CHECK(got.rfind("HTTP/1.1 200 ", 0) == 0);
    CHECK(got.find("[DONE]") != std::string::npos);
    CHECK(got.find("backup:mock-b") != std::string::npos);
    CHECK(stat(b.stats(), "requests", "chat") == 1);
  }
  SECTION("the primary's stream is cut after 4 tokens: the second upstream continues it") {
    a.fault({{"kind", "cut"}, {"after_tokens", 4}});
    keel_service::raw_connection c(svc->port());
    REQUIRE(c.send(chat_request(chat_body(12))));
    const std::string got = c.read_until("\r\n0\r\n\r\n");
    CHECK(got.find("[DONE]") != std::string::npos);
    CHECK(stat(b.stats(), "requests", "chat") == 1);
    CHECK(healthz(svc->port())["streams"]["continuations"].get<int>() == 1);
  }
}

TEST_CASE("a client that hangs up mid-stream stops the upstream's transfer", "[service][upstreams][chat][cancel]") {
  temp_dir dir;
  // 15 s of tokens: only the hang-up ends the stream.
  const std::vector<std::string> slow = {"--first-token-ms", "5", "--token-gap-ms", "50", "--tokens", "300"};
  mock_upstream a(dir, "mock-a", slow), b(dir, "mock-b", slow);
  gateway::gateway_options o = options_for(dir.path(), a, b);
  o.chat.max_tokens_limit = 4096;
  o.chat.whole = 1h;
  o.chat.deadline = 2h;
  // No hedge: a slow first token (a loaded sanitizer build) would start a
  // second stream whose stopped loser the upstream also sees go.
  o.chat.hedge_delay = 0ms;
  o.chat.hedge_percentile = 0;
  o.chat.first_token = 10s;  // nor a retry of a first token that was merely slow
  auto svc = start(o);
  keel_service::raw_connection c(svc->port());
  REQUIRE(c.send(chat_request(chat_body(300))));
  const std::string first = c.read_until("\"content\":\"", 30s);
  INFO(first);
  REQUIRE(first.find("\"content\":\"") != std::string::npos);
  REQUIRE(stat(a.stats(), "client_gone", "count") == 0);
  const auto gone = std::chrono::steady_clock::now();
  c.close();
  REQUIRE(eventually([&] { return stat(a.stats(), "client_gone", "count") == 1; }, 10s));
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - gone).count();
  std::printf("client hang-up to upstream connection closed (seen by the upstream): %.2f ms\n", ms);
  CHECK(ms < std::chrono::duration<double, std::milli>(keel_service::http_slack).count());
  CHECK(stat(b.stats(), "requests", "chat") == 0);  // a lost client is not continued
}

// --- from a config file: client keys, tenants and their quotas --------------

namespace {

struct http_answer {
  int status = 0;
  json body;
  httplib::Headers headers;
  [[nodiscard]] std::string header(const std::string& name) const {
    const auto it = headers.find(name);
    return it == headers.end() ? std::string() : it->second;
  }
  [[nodiscard]] std::size_t count(const std::string& name) const { return headers.count(name); }
};

http_answer call(int port, const std::string& method, const std::string& path, const json& body,
                 const httplib::Headers& h) {
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(30s);
  const httplib::Result r =
      method == "GET" ? c.Get(path.c_str(), h) : c.Post(path.c_str(), h, body.dump(), "application/json");
  if (!r) return {};
  return {r->status, json::parse(r->body, nullptr, false), r->headers};
}

std::string config_text(const std::string& dir, const mock_upstream& a, const mock_upstream& b) {
  return "[gateway]\nlisten = \"127.0.0.1:0\"\ndata_dir = \"" + dir +
         "\"\n"
         "[upstreams.mock-a]\nbase_url = \"" + a.url() + "\"\n"
         "[upstreams.mock-b]\nbase_url = \"" + b.url() + "\"\n"
         "[models.feedback-large]\n"
         "deployments = [{ upstream = \"mock-a\", model = \"m-large\" }, { upstream = \"mock-b\", model = \"m-small\" }]\n"
         "deadline = \"3s\"\n"
         "[models.other-model]\n"
         "deployments = [{ upstream = \"mock-b\", model = \"o-1\" }, { upstream = \"mock-a\", model = \"o-2\" }]\n"
         "[clients.team-a]\nkey_sha256 = \"" + keel::sha256("sk-team-a").hex() + "\"\ntenant = \"acme\"\n"
         "[clients.noisy]\nkey_sha256 = \"" + keel::sha256("sk-noisy").hex() + "\"\ntenant = \"noisy\"\n"
         "requests_per_second = 1\nburst = 1\nmax_in_flight = 4\n";
}

httplib::Headers bearer(const std::string& key) { return {{"Authorization", "Bearer " + key}}; }

// config_text's file, read and mapped as `gateway --config` does.
gateway::gateway_options options_from_config(const std::string& dir, const mock_upstream& a, const mock_upstream& b) {
  const absl::StatusOr<gateway::gateway_config> cfg = gateway::parse_config(config_text(dir, a, b), "t.toml");
  if (!cfg.ok()) throw std::runtime_error(std::string(cfg.status().message()));
  absl::StatusOr<gateway::gateway_options> o = gateway::with_upstreams(*cfg);
  if (!o.ok()) throw std::runtime_error(std::string(o.status().message()));
  return std::move(*o);
}

}  // namespace

TEST_CASE("from a config file: Bearer keys name the tenant, a bad key is a 401, a tenant's quota a 429 with both hints",
          "[service][upstreams][auth]") {
  temp_dir dir;
  mock_upstream a(dir, "mock-a", {"--latency-ms", "5"}), b(dir, "mock-b", {"--latency-ms", "5"});
  const gateway::gateway_options o = options_from_config(dir.path(), a, b);
  REQUIRE(o.api_keys.size() == 2);
  CHECK(o.upstream->name == "mock-a/m-large");
  CHECK(o.upstream_backup->name == "mock-b/m-small");
  auto svc = start(o);
  const int port = svc->port();
  const json body = {{"question_id", "q-timeouts"}, {"answer", "one deadline, stages get what remains"}};
  auto keyed = [](httplib::Headers h, const std::string& key) {
    h.emplace("Idempotency-Key", key);
    return h;
  };

  SECTION("no key, a wrong key, another scheme: 401 in OpenAI's shape, and the upstream is not called") {
    for (const httplib::Headers& h : {httplib::Headers{}, bearer("sk-wrong"), bearer("sk-team-"),
                                      httplib::Headers{{"Authorization", "Basic c2stdGVhbS1h"}}}) {
      const http_answer r = call(port, "POST", "/v1/feedback", body, keyed(h, "k-1"));
      REQUIRE(r.status == 401);
      CHECK(r.body["error"]["code"] == "invalid_api_key");
      CHECK(r.body["error"]["type"] == "invalid_request_error");
      CHECK(r.body["error"].contains("param"));
      CHECK(r.header("WWW-Authenticate") == "Bearer");
      CHECK_FALSE(r.header("x-request-id").empty());
    }
    CHECK(stat(a.stats(), "requests", "chat") == 0);
    CHECK(call(port, "GET", "/v1/models", {}, {}).status == 401);
    CHECK(call(port, "GET", "/healthz", {}, {}).status == 200);  // operators' endpoints are not /v1/
  }
  SECTION("the key's tenant serves a body that names none; a body naming another tenant is refused") {
    const http_answer r = call(port, "POST", "/v1/feedback", body, keyed(bearer("sk-team-a"), "k-2"));
    CHECK(r.status == 200);
    CHECK(r.body["degraded"] == false);
    json other = body;
    other["tenant"] = "globex";
    CHECK(call(port, "POST", "/v1/feedback", other, keyed(bearer("sk-team-a"), "k-3")).status == 403);
    other["tenant"] = "acme";
    CHECK(call(port, "POST", "/v1/feedback", other, keyed(bearer("sk-team-a"), "k-4")).status == 200);
    // The models clients may name, as OpenAI lists them.
    const http_answer m = call(port, "GET", "/v1/models", {}, bearer("sk-team-a"));
    CHECK(m.status == 200);
    CHECK(m.body["object"] == "list");
    CHECK(m.body["data"][0]["id"] == "feedback-large");
    // The client's request id is echoed; without one, one is made.
    httplib::Headers with_id = bearer("sk-team-a");
    with_id.emplace("x-request-id", "trace-42");
    CHECK(call(port, "GET", "/v1/models", {}, with_id).header("x-request-id") == "trace-42");
  }
  SECTION("a tenant over its own quota: 429 with retry-after-ms and Retry-After, once each") {
    CHECK(call(port, "POST", "/v1/feedback", body, keyed(bearer("sk-noisy"), "n-1")).status == 200);
    const http_answer r = call(port, "POST", "/v1/feedback", body, keyed(bearer("sk-noisy"), "n-2"));
    REQUIRE(r.status == 429);
    CHECK(r.body["error"]["code"] == "rate_limit_exceeded");
    CHECK(r.count("retry-after-ms") == 1);
    CHECK(r.count("Retry-After") == 1);
    CHECK(std::stoll(r.header("retry-after-ms")) > 0);
    // Another tenant's key is not held to it.
    CHECK(call(port, "POST", "/v1/feedback", body, keyed(bearer("sk-team-a"), "a-1")).status == 200);
  }
  SECTION("a stream with a key and no tenant in the body") {
    keel_service::raw_connection c(port);
    const std::string b = json{{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"max_tokens", 4}, {"stream", true}}.dump();
    REQUIRE(c.send("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-team-a\r\n"
                   "Content-Type: application/json\r\nContent-Length: " +
                   std::to_string(b.size()) + "\r\n\r\n" + b));
    const std::string got = c.read_until("\r\n0\r\n\r\n");
    CHECK(got.rfind("HTTP/1.1 200 ", 0) == 0);
    CHECK(got.find("x-request-id: ") != std::string::npos);
    CHECK(got.find("[DONE]") != std::string::npos);
  }
}

TEST_CASE("from a config file: each model is served by its own deployments, with its own breakers",
          "[service][upstreams]") {
  temp_dir dir;
  mock_upstream a(dir, "mock-a", {"--latency-ms", "5"}), b(dir, "mock-b", {"--latency-ms", "5"});
  const gateway::gateway_options o = options_from_config(dir.path(), a, b);
  auto svc = start(o);
  const int port = svc->port();
  auto ask = [&](const std::string& model, const std::string& key) {
    httplib::Headers h = bearer("sk-team-a");
    h.emplace("Idempotency-Key", key);
    return call(port, "POST", "/v1/feedback",
                {{"model", model}, {"question_id", "q-timeouts"}, {"answer", "one deadline, stages get what remains"}},
                h);
  };
  CHECK(ask("other-model", "m-1").status == 200);
  CHECK(stat(b.stats(), "requests", "chat") == 1);
  CHECK(stat(a.stats(), "requests", "chat") == 0);
  CHECK(b.stats()["last_request"]["path"] == "/v1/chat/completions");
  CHECK(ask("feedback-large", "m-2").status == 200);
  CHECK(stat(a.stats(), "requests", "chat") == 1);

  // mock-b down: other-model's breaker (mock-b/o-1) opens; feedback-large's (mock-a/m-large) stays closed.
  b.fault({{"kind", "outage"}});
  for (int i = 0; i < o.breaker.minimum_calls + 2; ++i) CHECK(ask("other-model", "o-" + std::to_string(i)).status == 200);
  const json h = healthz(port);
  std::string open_domains;
  for (const json& e : h["breakers"])
    if (e.value("state", "") == "open") open_domains += e.value("domain", "") + " ";
  INFO(h["breakers"].dump());
  CHECK(open_domains.find("mock-b/o-1") != std::string::npos);
  CHECK(open_domains.find("mock-a") == std::string::npos);
  CHECK(ask("feedback-large", "m-3").body["degraded"] == false);
}

// --- one retry budget across the client's layer -------------------------------

namespace {

// The OpenAI SDK's retry loop, as openai-node 5.23 runs it: at most 2
// retries, of 408, 409, 429 and 5xx (and of a transport error), unless the
// answer says x-should-retry: false (true forces one); backoff
// min(0.5 s * 2^n, 8 s) less up to 25% jitter (shortened here by `scale`:
// the counts, not the waits, are under test); X-Stainless-Retry-Count on
// every attempt and X-Stainless-Timeout for a per-request timeout.
struct sdk_result {
  int attempts = 0;
  int status = 0;
  std::string should_retry;
};

sdk_result sdk_chat(int port, const json& body, int timeout_s, double scale) {
  sdk_result out;
  std::mt19937 rng(7);
  for (int retry = 0;; ++retry) {
    httplib::Headers h = {{"X-Stainless-Retry-Count", std::to_string(retry)},
                          {"X-Stainless-Timeout", std::to_string(timeout_s)}};
    const http_answer r = call(port, "POST", "/v1/chat/completions", body, h);
    ++out.attempts;
    out.status = r.status;
    out.should_retry = r.header("x-should-retry");
    bool again = r.status == 0 || r.status == 408 || r.status == 409 || r.status == 429 || r.status >= 500;
    if (out.should_retry == "false") again = false;
    if (out.should_retry == "true") again = true;
    if (!again || retry == 2) return out;
    const double wait_s = std::min(0.5 * std::pow(2.0, retry), 8.0) *
                          (1.0 - 0.25 * std::uniform_real_distribution<double>(0, 1)(rng));
    std::this_thread::sleep_for(std::chrono::duration<double>(wait_s * scale));
  }
}

}  // namespace

TEST_CASE("a full outage: the SDK's retries do not multiply the gateway's (upstream calls per client request)",
          "[service][upstreams][amplification]") {
  temp_dir dir;
  mock_upstream a(dir, "mock-a", {"--latency-ms", "5"}), b(dir, "mock-b", {"--latency-ms", "5"});
  const json body = {{"tenant", "acme"},
                     {"messages", {{{"role", "user"}, {"content", "Summarise the plan."}}}},
                     {"max_tokens", 8},
                     {"stream", false}};
  auto upstream_calls = [&] { return stat(a.stats(), "requests", "chat") + stat(b.stats(), "requests", "chat"); };
  auto run = [&](bool tell) {
    gateway::gateway_options o = options_for(dir.path() + (tell ? "/with" : "/without"), a, b);
    std::filesystem::create_directories(o.data_dir);
    o.tell_clients_retries_spent = tell;
    auto svc = start(o);
    a.fault({{"kind", "outage"}});
    b.fault({{"kind", "outage"}});
    const std::int64_t before = upstream_calls();
    const sdk_result r = sdk_chat(svc->port(), body, 20, 0.02);
    return std::pair{r, upstream_calls() - before};
  };
  const auto [with, with_calls] = run(true);
  const auto [without, without_calls] = run(false);
  std::printf("full outage, one client request through the OpenAI SDK's retries: %lld upstream calls with "
              "x-should-retry (%d client attempt%s), %lld without (%d client attempts)\n",
              static_cast<long long>(with_calls), with.attempts, with.attempts == 1 ? "" : "s",
              static_cast<long long>(without_calls), without.attempts);
  CHECK(with.status == 503);
  CHECK(with.should_retry == "false");
  CHECK(with.attempts == 1);
  CHECK(without.attempts == 3);
  CHECK(without.should_retry.empty());
  CHECK(with_calls >= 2);  // the gateway did retry and fail over, once
  CHECK(without_calls == 3 * with_calls);
}

TEST_CASE("the SDK's X-Stainless-Timeout shortens the call's deadline: no work after the client left",
          "[service][upstreams]") {
  temp_dir dir;
  mock_upstream a(dir, "mock-a"), b(dir, "mock-b");
  gateway::gateway_options o = options_for(dir.path(), a, b);
  o.chat.hedge_delay = 0ms;
  o.chat.hedge_percentile = 0;
  auto svc = start(o);
  a.fault({{"kind", "hang"}});
  b.fault({{"kind", "hang"}});
  const json body = {{"tenant", "acme"},
                     {"messages", {{{"role", "user"}, {"content", "hi"}}}},
                     {"max_tokens", 8},
                     {"stream", false}};
  // "0": under a second (the SDK truncates), so the call gets 1 s, not none and not the gateway's 20 s.
  const auto t0 = std::chrono::steady_clock::now();
  const http_answer r = call(svc->port(), "POST", "/v1/chat/completions", body, {{"X-Stainless-Timeout", "0"}});
  const auto took = std::chrono::steady_clock::now() - t0;
  CHECK(r.status == 504);
  CHECK(took >= 1s);
  CHECK(took < 1s + keel_service::http_slack);
  CHECK(eventually([&] { return stat(a.stats(), "client_gone", "count") >= 1; }, 5s));  // the upstream was let go
}

TEST_CASE("embeddings go to the model's first deployment as the client asked them (floats or base64)",
          "[service][upstreams]") {
  temp_dir dir;
  mock_upstream a(dir, "mock-a", {"--latency-ms", "5"}), b(dir, "mock-b", {"--latency-ms", "5"});
  const gateway::gateway_options o = options_from_config(dir.path(), a, b);
  auto svc = start(o);
  const int port = svc->port();
  const http_answer floats =
      call(port, "POST", "/v1/embeddings", {{"input", "hello"}, {"encoding_format", "float"}}, bearer("sk-team-a"));
  REQUIRE(floats.status == 200);
  CHECK(floats.body["object"] == "list");
  REQUIRE(floats.body["data"][0]["embedding"].is_array());
  const http_answer b64 = call(port, "POST", "/v1/embeddings",
                               {{"input", {"hello", "world"}}, {"encoding_format", "base64"}}, bearer("sk-team-a"));
  REQUIRE(b64.status == 200);
  CHECK(b64.body["data"].size() == 2);
  CHECK(b64.body["data"][0]["embedding"].is_string());  // the SDK's default, not silently floats
  const json s = a.stats();
  CHECK(stat(s, "requests", "embeddings") == 2);
  CHECK(stat(b.stats(), "requests", "embeddings") == 0);
  CHECK(floats.body["model"] == "m-large");  // the deployment's name for the model
  CHECK(call(port, "POST", "/v1/embeddings", {{"input", json::array()}}, bearer("sk-team-a")).status == 400);
  CHECK(call(port, "POST", "/v1/embeddings", {{"input", "x"}, {"model", "nope"}}, bearer("sk-team-a")).status == 400);
  CHECK(call(port, "POST", "/v1/embeddings", {{"input", "x"}}, {}).status == 401);
  a.fault({{"kind", "outage"}});
  const http_answer down = call(port, "POST", "/v1/embeddings", {{"input", "x"}}, bearer("sk-team-a"));
  CHECK(down.status == 503);
  CHECK(down.header("x-should-retry") == "false");
}

TEST_CASE("gateway --config FILE serves in front of the upstreams the file names", "[service][upstreams][cli]") {
  temp_dir dir;
  mock_upstream a(dir, "mock-a", {"--latency-ms", "5"}), b(dir, "mock-b", {"--latency-ms", "5"});
  const std::string file = dir.path() + "/gateway.toml";
  {
    std::ofstream out(file);
    out << config_text(dir.path() + "/data", a, b);
  }
  std::filesystem::create_directories(dir.path() + "/data");
  keel_test::child_program gw({KEEL_GATEWAY_CLI, "--config", file}, dir.path() + "/gateway.err");
  const std::optional<std::string> line = gw.read_line();
  REQUIRE(line);
  INFO(*line << keel_test::read_file(dir.path() + "/gateway.err"));
  // "gateway serving on http://127.0.0.1:PORT (... model upstreams URL, URL)": the first address is ours.
  const std::size_t at = line->find("serving on http://");
  REQUIRE(at != std::string::npos);
  const int port = keel_test::port_in(line->substr(at, line->find(' ', at + 18) - at));
  REQUIRE(port > 0);
  CHECK(line->find(a.url()) != std::string::npos);  // it says which upstreams it serves
  httplib::Headers h = bearer("sk-team-a");
  h.emplace("Idempotency-Key", "cli-1");
  const http_answer r = call(port, "POST", "/v1/feedback",
                             {{"question_id", "q-timeouts"}, {"answer", "one deadline, stages get what remains"}}, h);
  INFO(r.body.dump());
  REQUIRE(r.status == 200);
  CHECK(r.body.value("degraded", true) == false);
  CHECK(stat(a.stats(), "requests", "chat") == 1);
  CHECK(call(port, "POST", "/v1/feedback", {{"question_id", "q"}, {"answer", "x"}}, {}).status == 401);
  CHECK(gw.terminate() == 0);
}
