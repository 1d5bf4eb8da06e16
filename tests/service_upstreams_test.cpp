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
#include <atomic>
#include <chrono>
#include <csignal>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
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
#include "support/threads.hpp"

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

// POST /v1/chat/completions as raw bytes; `headers`: more lines, each ending in \r\n.
std::string chat_request(const json& body, const std::string& headers = {}) {
  const std::string b = body.dump();
  return "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + headers +
         "Content-Type: application/json\r\nContent-Length: " + std::to_string(b.size()) + "\r\n\r\n" + b;
}

// No first-token hedge: which upstream served is then the route's doing alone.
void without_hedge(gateway::gateway_options& o) {
  o.chat.hedge_delay = 0ms;
  o.chat.hedge_percentile = 0;
}

// A stat of the mock, 0 when absent.
std::int64_t stat(const json& s, const char* group, const char* name) {
  if (!s.contains(group) || !s[group].contains(name) || !s[group][name].is_number()) return 0;
  return s[group][name].get<std::int64_t>();
}

// Chat requests the two mocks have received, together.
std::int64_t chat_calls(const mock_upstream& a, const mock_upstream& b) {
  return stat(a.stats(), "requests", "chat") + stat(b.stats(), "requests", "chat");
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
  gateway::gateway_options o = options_for(dir.path(), a, b);
  o.http_fiber_threads = GENERATE(0, 2);  // a worker thread per request; fibers on the event loop's client
  CAPTURE(o.http_fiber_threads);
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
  o.http_fiber_threads = GENERATE(0, 2);  // a worker thread per request; fibers on the event loop's client
  CAPTURE(o.http_fiber_threads);
  without_hedge(o);
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
    // The second upstream was asked for the 8 tokens the client's cap left,
    // not 12 more: the client gets the 12 it asked for.
    INFO(got);
    CHECK(got.find("\"completion_tokens\":12") != std::string::npos);
  }
  SECTION("the primary is slow to its first token: the first-token hedge goes to the second upstream, and the "
          "primary's attempt is stopped") {
    gateway::gateway_options h = options_for(dir.path() + "/hedged", a, b);
    h.http_fiber_threads = o.http_fiber_threads;
    h.chat.hedge_delay = 100ms;
    h.chat.hedge_percentile = 0;
    svc.reset();
    std::filesystem::create_directories(dir.path() + "/hedged");
    auto hedged = start(h);
    a.fault({{"kind", "slow_first_token"}, {"first_token_ms", 5000}});
    keel_service::raw_connection c(hedged->port());
    REQUIRE(c.send(chat_request(chat_body(12))));
    const std::string got = c.read_until("\r\n0\r\n\r\n");
    INFO(got);
    CHECK(got.find("[DONE]") != std::string::npos);
    CHECK(got.find("\"hedged\":true") != std::string::npos);
    CHECK(stat(b.stats(), "requests", "chat") == 1);
    CHECK(eventually([&] { return stat(a.stats(), "client_gone", "while_waiting") +
                                  stat(a.stats(), "client_gone", "while_streaming") == 1; }));
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
  without_hedge(o);
  o.chat.first_token = 10s;  // nor a retry of a first token that was merely slow
  o.http_fiber_threads = GENERATE(0, 2);  // a worker thread per request; fibers on the event loop's client
  CAPTURE(o.http_fiber_threads);
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

TEST_CASE("on fibers, 64 streams in flight hold no thread each, and every one is answered whole",
          "[service][upstreams][chat][fibers]") {
  temp_dir dir;
  // 2 s of tokens: every stream is in flight at once.
  const std::vector<std::string> slow = {"--first-token-ms", "5", "--token-gap-ms", "100", "--tokens", "20",
                                         "--threads", "256"};
  mock_upstream a(dir, "mock-a", slow), b(dir, "mock-b", slow);
  gateway::gateway_options o = options_for(dir.path(), a, b);
  o.http_fiber_threads = 2;
  o.http_threads = 256;
  o.chat.slots = 128;
  o.tenant_defaults.rate = o.tenant_defaults.burst = 1000;  // the tenant's quotas admit them all
  o.tenant_defaults.max_in_flight = 256;
  for (gateway::model_config& m : o.models) m.limits.max_in_flight = 256;  // and the model's
  o.chat.first_token = 10s;  // a loaded sanitizer build: no retry of a first token merely slow
  without_hedge(o);
  auto svc = start(o);
  constexpr int streams = 64;
  const int before = keel_test::threads_in_process();
  std::vector<std::unique_ptr<keel_service::raw_connection>> clients;
  for (int i = 0; i < streams; ++i) {
    clients.push_back(std::make_unique<keel_service::raw_connection>(svc->port()));
    REQUIRE(clients.back()->send(chat_request(chat_body(20))));
  }
  // Every request is being served at once (a fiber each), on the threads there were.
  int busy = 0;
  const bool all_busy = eventually([&] { return (busy = svc->http_figures().busy) == streams; }, 30s);
  INFO("busy " << busy << "; healthz " << healthz(svc->port()).dump()
                << (all_busy ? std::string() : "; the first answer: " + clients.front()->read_until("}", 2s)));
  REQUIRE(all_busy);
  const int during = keel_test::threads_in_process();
  INFO("threads before " << before << ", with " << streams << " streams in flight " << during);
  // Fewer threads in the whole process than streams in flight (worker
  // threads would need one each: this process would hold 256 of them), and
  // none started for them.
  CHECK(during < streams);
  CHECK(during - before < 8);
  for (auto& c : clients) {
    const std::string got = c->read_until("\r\n0\r\n\r\n", 30s);
    CHECK(got.rfind("HTTP/1.1 200 ", 0) == 0);
    CHECK(got.find("\"completion_tokens\":20") != std::string::npos);
    CHECK(got.find("[DONE]") != std::string::npos);
  }
  CHECK(stat(a.stats(), "requests", "chat") == streams);
  CHECK(stat(b.stats(), "requests", "chat") == 0);
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
    REQUIRE(c.send(chat_request(
        json{{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"max_tokens", 4}, {"stream", true}},
        "Authorization: Bearer sk-team-a\r\n")));
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

// `max_retries`: the SDK's maxRetries option (2 by default); `extra`: the
// caller's own headers, sent on every attempt (an Idempotency-Key).
sdk_result sdk_chat(int port, const json& body, int timeout_s, double scale, int max_retries = 2,
                    const httplib::Headers& extra = {}) {
  sdk_result out;
  std::mt19937 rng(7);
  for (int retry = 0;; ++retry) {
    httplib::Headers h = {{"X-Stainless-Retry-Count", std::to_string(retry)},
                          {"X-Stainless-Timeout", std::to_string(timeout_s)}};
    h.insert(extra.begin(), extra.end());
    const http_answer r = call(port, "POST", "/v1/chat/completions", body, h);
    ++out.attempts;
    out.status = r.status;
    out.should_retry = r.header("x-should-retry");
    bool again = r.status == 0 || r.status == 408 || r.status == 409 || r.status == 429 || r.status >= 500;
    if (out.should_retry == "false") again = false;
    if (out.should_retry == "true") again = true;
    if (!again || retry == max_retries) return out;
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
  auto upstream_calls = [&] { return chat_calls(a, b); };
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
  without_hedge(o);
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

// --- a configuration reload (SIGHUP) -----------------------------------------

namespace {

// config_text with other-model served by mock-a alone, a new model on
// mock-b, and team-a's key replaced by `team_a_key`.
std::string moved_config_text(const std::string& dir, const mock_upstream& a, const mock_upstream& b,
                              const std::string& team_a_key = "sk-team-a") {
  std::string text = config_text(dir, a, b);
  auto replace = [&text](const std::string& from, const std::string& to) {
    const std::size_t at = text.find(from);
    if (at == std::string::npos) throw std::runtime_error("moved_config_text: no " + from);
    text.replace(at, from.size(), to);
  };
  replace("deployments = [{ upstream = \"mock-b\", model = \"o-1\" }, { upstream = \"mock-a\", model = \"o-2\" }]",
          "deployments = [{ upstream = \"mock-a\", model = \"o-2\" }]\n"
          "[models.new-model]\ndeployments = [{ upstream = \"mock-b\", model = \"n-1\" }]");
  replace(keel::sha256("sk-team-a").hex(), keel::sha256(team_a_key).hex());
  return text;
}

absl::StatusOr<gateway::gateway_options> options_of(const std::string& text) {
  absl::StatusOr<gateway::gateway_config> cfg = gateway::parse_config(text, "reload.toml");
  if (!cfg.ok()) return cfg.status();
  return gateway::with_upstreams(*cfg);
}

std::string metrics_text(int port) {
  httplib::Client c("127.0.0.1", port);
  const httplib::Result r = c.Get("/metrics");
  return r ? r->body : std::string();
}

// A config file's [gateway] (a free port, data in `dir`, then `gateway_extra`
// lines) and one [upstreams.NAME] per mock, named as the mock is; a test
// adds its models.
std::string config_head(const std::string& dir, std::initializer_list<const mock_upstream*> mocks,
                        const std::string& gateway_extra = {}) {
  std::string text = "[gateway]\nlisten = \"127.0.0.1:0\"\ndata_dir = \"" + dir + "\"\n" + gateway_extra;
  for (const mock_upstream* m : mocks) text += "[upstreams." + m->name + "]\nbase_url = \"" + m->url() + "\"\n";
  return text;
}

// The state /healthz shows for the breaker whose domain names `deployment`; "none" without one.
std::string breaker_state(int port, const std::string& deployment) {
  const json h = healthz(port);  // held: a range over a temporary's member would dangle
  for (const json& e : h["breakers"])
    if (e.value("domain", "").find(deployment) != std::string::npos) return e.value("state", "");
  return "none";
}

json chat_for(const std::string& model, int max_tokens, bool stream) {
  return {{"model", model},
          {"messages", {{{"role", "user"}, {"content", "How long may one stage take?"}}}},
          {"max_tokens", max_tokens},
          {"stream", stream}};
}

}  // namespace

TEST_CASE("a config reload: new requests take the new plan, a stream in flight finishes on its own, a bad file "
          "changes nothing",
          "[service][upstreams][reload]") {
  temp_dir dir;
  // 100 tokens 20 ms apart: the stream runs for 2 s, across the reload.
  const std::vector<std::string> slow = {"--latency-ms", "5", "--first-token-ms", "5", "--token-gap-ms", "20",
                                         "--tokens", "100"};
  mock_upstream a(dir, "mock-a", slow), b(dir, "mock-b", slow);
  gateway::gateway_options o = options_from_config(dir.path(), a, b);
  without_hedge(o);
  o.chat.first_token = 10s;
  o.chat.whole = 1min;
  o.chat.deadline = 2min;
  auto svc = start(o);
  const int port = svc->port();
  CHECK(svc->core().plan_generation() == 1);

  // A stream on other-model, served by its first deployment (mock-b/o-1).
  keel_service::raw_connection c(port);
  REQUIRE(c.send(chat_request(chat_for("other-model", 100, true), "Authorization: Bearer sk-team-a\r\n")));
  REQUIRE(c.read_until("\"content\":\"", 30s).find("\"content\":\"") != std::string::npos);
  REQUIRE(stat(b.stats(), "requests", "chat") == 1);

  // The new plan: other-model on mock-a, a new model, team-a's key replaced.
  absl::StatusOr<gateway::gateway_options> next = options_of(moved_config_text(dir.path(), a, b, "sk-team-a2"));
  REQUIRE(next.ok());
  const absl::StatusOr<gateway::service::core_type::reload_result> done = svc->core().reload(std::move(next));
  REQUIRE(done.ok());
  CHECK(done->generation == 2);
  CHECK(svc->core().plan_generation() == 2);

  // New requests: the new key, the new route, the new model.
  CHECK(call(port, "GET", "/v1/models", {}, bearer("sk-team-a")).status == 401);
  const http_answer models = call(port, "GET", "/v1/models", {}, bearer("sk-team-a2"));
  REQUIRE(models.status == 200);
  CHECK(models.body.dump().find("new-model") != std::string::npos);
  const http_answer moved = call(port, "POST", "/v1/chat/completions", chat_for("other-model", 4, false), bearer("sk-team-a2"));
  INFO(moved.body.dump());
  CHECK(moved.status == 200);
  CHECK(stat(a.stats(), "requests", "chat") == 1);  // other-model now goes to mock-a
  CHECK(call(port, "POST", "/v1/chat/completions", chat_for("new-model", 4, false), bearer("sk-team-a2")).status == 200);
  CHECK(stat(b.stats(), "requests", "chat") == 2);  // new-model is on mock-b

  // The stream that started before finishes on its plan: every token from mock-b, nothing continued elsewhere.
  const std::string rest = c.read_until("\r\n0\r\n\r\n", 60s);
  INFO(rest.substr(rest.size() > 400 ? rest.size() - 400 : 0));
  CHECK(rest.find("[DONE]") != std::string::npos);
  CHECK(rest.find("\"complete\":true") != std::string::npos);
  CHECK(rest.find("\"continuations\":0") != std::string::npos);
  CHECK(stat(a.stats(), "requests", "chat") == 1);

  // A bad file: refused, naming it; the plan serving stays.
  const absl::StatusOr<gateway::service::core_type::reload_result> bad =
      svc->core().reload(options_of("[gateway]\nlisten = \"127.0.0.1:0\"\ndata_dir = 7\n"));
  REQUIRE_FALSE(bad.ok());
  CHECK(std::string(bad.status().message()).find("reload.toml:3:") != std::string::npos);
  CHECK(svc->core().plan_generation() == 2);
  CHECK(call(port, "POST", "/v1/chat/completions", chat_for("new-model", 4, false), bearer("sk-team-a2")).status == 200);
  const std::string m = metrics_text(port);
  CHECK(m.find("gateway_config_reloads_total{result=\"applied\"} 1") != std::string::npos);
  CHECK(m.find("gateway_config_reloads_total{result=\"refused\"} 1") != std::string::npos);
  CHECK(m.find("gateway_config_generation 2") != std::string::npos);
}

TEST_CASE("SIGHUP under load: gateway --config reloads its file, no request fails, a bad file is refused",
          "[service][upstreams][reload][cli]") {
  temp_dir dir;
  mock_upstream a(dir, "mock-a", {"--latency-ms", "5"}), b(dir, "mock-b", {"--latency-ms", "5"});
  const std::string file = dir.path() + "/gateway.toml", err = dir.path() + "/gateway.err";
  auto write = [&file](const std::string& text) {
    const std::string next = file + ".next";
    {
      std::ofstream out(next);
      out << text;
    }
    std::filesystem::rename(next, file);  // whole, as a deploy tool writes it
  };
  std::filesystem::create_directories(dir.path() + "/data");
  write(config_text(dir.path() + "/data", a, b));
  keel_test::child_program gw({KEEL_GATEWAY_CLI, "--config", file}, err);
  const std::optional<std::string> line = gw.read_line();
  REQUIRE(line);
  const std::size_t at = line->find("serving on http://");
  REQUIRE(at != std::string::npos);
  const int port = keel_test::port_in(line->substr(at, line->find(' ', at + 18) - at));
  REQUIRE(port > 0);

  // Four clients asking other-model without pause, through every reload.
  std::atomic<bool> stop{false};
  std::atomic<int> answered{0};
  std::mutex mu;
  std::vector<std::string> failures;
  std::vector<std::thread> load;
  for (int t = 0; t < 4; ++t) {
    load.emplace_back([&] {
      while (!stop.load()) {
        const http_answer r =
            call(port, "POST", "/v1/chat/completions", chat_for("other-model", 4, false), bearer("sk-team-a"));
        if (r.status == 200) {
          answered.fetch_add(1);
        } else {
          std::lock_guard lock(mu);
          failures.push_back(std::to_string(r.status) + " " + r.body.dump());
        }
      }
    });
  }
  auto reload_and_wait = [&](const std::string& text, const std::string& expect) {
    const int before = answered.load();
    write(text);
    REQUIRE(::kill(gw.pid(), SIGHUP) == 0);
    if (expect == "reloaded") {
      const std::optional<std::string> said = gw.read_line();
      REQUIRE(said);
      CHECK(said->find("gateway: reloaded " + file) != std::string::npos);
    } else {
      REQUIRE(eventually([&] { return keel_test::read_file(err).find(expect) != std::string::npos; }, 30s));
    }
    // Traffic went on across it.
    REQUIRE(eventually([&] { return answered.load() > before + 20; }, 30s));
  };
  REQUIRE(eventually([&] { return answered.load() > 20; }, 30s));
  reload_and_wait(moved_config_text(dir.path() + "/data", a, b), "reloaded");
  const std::int64_t on_a = stat(a.stats(), "requests", "chat");
  CHECK(on_a > 0);  // other-model moved to mock-a
  reload_and_wait(config_text(dir.path() + "/data", a, b), "reloaded");
  reload_and_wait("[gateway]\nlisten = \"127.0.0.1:0\"\n[models.x]\ndeployments = 3\n", "reload refused");
  stop = true;
  for (std::thread& t : load) t.join();
  INFO(keel_test::read_file(err));
  CHECK(failures.empty());
  if (!failures.empty()) INFO(failures.front());
  CHECK(answered.load() > 60);
  CHECK(keel_test::read_file(err).find(file + ":") != std::string::npos);  // the refusal names the file
  const std::string m = metrics_text(port);
  CHECK(m.find("gateway_config_reloads_total{result=\"applied\"} 2") != std::string::npos);
  CHECK(m.find("gateway_config_reloads_total{result=\"refused\"} 1") != std::string::npos);
  CHECK(m.find("gateway_config_generation 3") != std::string::npos);
  CHECK(gw.terminate() == 0);
}

// --- Idempotency-Key on chat completions ----------------------------------------

namespace {

json keyed_chat(const std::string& content, int max_tokens, bool stream) {
  return {{"tenant", "acme"},
          {"messages", {{{"role", "user"}, {"content", content}}}},
          {"max_tokens", max_tokens},
          {"stream", stream}};
}

httplib::Headers idempotency(const std::string& key) { return {{"Idempotency-Key", key}}; }

std::string raw_chat(const json& body, const std::string& key) {
  return chat_request(body, "Idempotency-Key: " + key + "\r\n");
}

}  // namespace

TEST_CASE("chat completions with an Idempotency-Key: a retry replays the answer (after a restart too), another "
          "body is a 422, a retry while it runs a 409",
          "[service][upstreams][idempotency]") {
  temp_dir dir;
  // 60 tokens 20 ms apart: a stream runs for over a second.
  const std::vector<std::string> slow = {"--latency-ms", "5", "--first-token-ms", "5", "--token-gap-ms", "20",
                                         "--tokens", "60"};
  mock_upstream a(dir, "mock-a", slow), b(dir, "mock-b", slow);
  gateway::gateway_options o = options_for(dir.path(), a, b);
  without_hedge(o);
  o.chat.first_token = 10s;
  o.chat.whole = 1min;
  o.chat.deadline = 2min;
  o.idempotency_retention = 1h;
  auto svc = std::make_unique<std::unique_ptr<gateway::service>>(start(o));
  auto port = [&] { return (*svc)->port(); };
  auto upstream_calls = [&] { return chat_calls(a, b); };

  const http_answer first = call(port(), "POST", "/v1/chat/completions", keyed_chat("q-1", 8, false), idempotency("k-1"));
  INFO(first.body.dump());
  REQUIRE(first.status == 200);
  REQUIRE(upstream_calls() == 1);
  CHECK(first.header("Idempotent-Replayed").empty());
  const std::string text = first.body["choices"][0]["message"]["content"];

  SECTION("the same request again: the recorded answer, no upstream call") {
    const http_answer again = call(port(), "POST", "/v1/chat/completions", keyed_chat("q-1", 8, false), idempotency("k-1"));
    CHECK(again.status == 200);
    CHECK(again.header("Idempotent-Replayed") == "true");
    CHECK(again.body["id"] == first.body["id"]);
    CHECK(again.body["choices"][0]["message"]["content"] == text);
    CHECK(again.body["keel"]["replayed"] == true);
    CHECK(upstream_calls() == 1);
  }
  SECTION("the same request as a stream: the recorded answer as one content chunk, usage and [DONE]") {
    keel_service::raw_connection c(port());
    REQUIRE(c.send(raw_chat(keyed_chat("q-1", 8, true), "k-1")));
    const std::string got = c.read_until("\r\n0\r\n\r\n");
    INFO(got);
    CHECK(got.rfind("HTTP/1.1 200 ", 0) == 0);
    CHECK(got.find("\"role\":\"assistant\"") != std::string::npos);
    CHECK(got.find(json(text).dump().substr(1, 20)) != std::string::npos);
    CHECK(got.find("\"usage\":") != std::string::npos);
    CHECK(got.find("\"replayed\":true") != std::string::npos);
    CHECK(got.find("data: [DONE]") != std::string::npos);
    CHECK(upstream_calls() == 1);
  }
  SECTION("another body under the same key: 422, as the IETF draft says, and nothing is called") {
    const http_answer other = call(port(), "POST", "/v1/chat/completions", keyed_chat("q-2", 8, false), idempotency("k-1"));
    CHECK(other.status == 422);
    CHECK(other.body["error"]["code"] == "idempotency_conflict");
    CHECK(other.body["error"]["condition"] == "conflict");
    CHECK(upstream_calls() == 1);
    // Another tenant's key space is its own.
    json globex = keyed_chat("q-2", 8, false);
    globex["tenant"] = "globex";
    CHECK(call(port(), "POST", "/v1/chat/completions", globex, idempotency("k-1")).status == 200);
  }
  SECTION("a retry while the first still streams: 409 with a hint, then the replay once it is done") {
    keel_service::raw_connection c(port());
    REQUIRE(c.send(raw_chat(keyed_chat("q-3", 60, true), "k-3")));
    REQUIRE(c.read_until("\"content\":\"", 30s).find("\"content\":\"") != std::string::npos);
    const http_answer busy = call(port(), "POST", "/v1/chat/completions", keyed_chat("q-3", 60, false), idempotency("k-3"));
    INFO(busy.body.dump());
    CHECK(busy.status == 409);
    CHECK(busy.body["error"]["condition"] == "in_flight");
    CHECK(busy.count("retry-after-ms") == 1);
    CHECK(upstream_calls() == 2);
    REQUIRE(c.read_until("\r\n0\r\n\r\n", 60s).find("[DONE]") != std::string::npos);
    const http_answer done = call(port(), "POST", "/v1/chat/completions", keyed_chat("q-3", 60, false), idempotency("k-3"));
    CHECK(done.status == 200);
    CHECK(done.header("Idempotent-Replayed") == "true");
    CHECK(done.body["usage"]["completion_tokens"] == 60);
    CHECK(upstream_calls() == 2);
  }
  SECTION("after a restart of the gateway on the same data directory: still the recorded answer") {
    svc->reset();
    *svc = start(o);
    const http_answer again = call(port(), "POST", "/v1/chat/completions", keyed_chat("q-1", 8, false), idempotency("k-1"));
    CHECK(again.status == 200);
    CHECK(again.header("Idempotent-Replayed") == "true");
    CHECK(again.body["choices"][0]["message"]["content"] == text);
    CHECK(upstream_calls() == 1);
  }
  SECTION("a failed request is not recorded: its key stays free for a retry that succeeds") {
    a.fault({{"kind", "outage"}});
    b.fault({{"kind", "outage"}});
    CHECK(call(port(), "POST", "/v1/chat/completions", keyed_chat("q-4", 8, false), idempotency("k-4")).status == 503);
    a.fault({{"kind", "none"}});
    b.fault({{"kind", "none"}});
    const http_answer later = call(port(), "POST", "/v1/chat/completions", keyed_chat("q-4", 8, false), idempotency("k-4"));
    CHECK(later.status == 200);
    CHECK(later.header("Idempotent-Replayed").empty());
  }
}

TEST_CASE("a client's retries tied by an Idempotency-Key share one attempt cap: an SDK that ignores x-should-retry "
          "cannot multiply upstream calls",
          "[service][upstreams][amplification][idempotency]") {
  temp_dir dir;
  mock_upstream a(dir, "mock-a", {"--latency-ms", "5"}), b(dir, "mock-b", {"--latency-ms", "5"});
  const json body = keyed_chat("Summarise the plan.", 8, false);
  auto upstream_calls = [&] { return chat_calls(a, b); };
  a.fault({{"kind", "outage"}});
  b.fault({{"kind", "outage"}});
  int cap = 0;
  // One gateway per run, so that each starts with closed breakers and a full budget.
  auto run = [&](const std::string& name, const httplib::Headers& tie) {
    gateway::gateway_options o = options_for(dir.path() + "/" + name, a, b);
    std::filesystem::create_directories(o.data_dir);
    o.tell_clients_retries_spent = false;  // an SDK that retries whatever the gateway says of its retries
    o.retry_budget = {.ratio = 1, .min_per_second = 100};  // the cap under test, not the budget
    o.breaker.minimum_calls = 1000;                          // nor the breaker
    o.breaker.window_calls = 1000;
    cap = 2 * o.chat.attempts + 4;
    auto svc = start(o);
    const std::int64_t before = upstream_calls();
    const sdk_result r = sdk_chat(svc->port(), body, 20, 0.02, 5, tie);  // maxRetries: 5, as services raise it
    return std::pair{r, upstream_calls() - before};
  };
  const auto [untied, untied_calls] = run("untied", {});
  const auto [tied, tied_calls] = run("tied", idempotency("tie-1"));
  const auto [own_id, own_id_calls] = run("own-id", {{"x-request-id", "client-req-7"}});
  std::printf("full outage, an SDK with maxRetries 5 ignoring x-should-retry: %lld upstream calls in %d client "
              "attempts without an Idempotency-Key, %lld in %d with one (attempt cap %d per request)\n",
              static_cast<long long>(untied_calls), untied.attempts, static_cast<long long>(tied_calls), tied.attempts,
              cap);
  CHECK(untied.attempts == 6);
  CHECK(untied_calls > cap);
  CHECK(tied_calls <= cap);
  CHECK(tied.attempts < 6);             // the refusal once the cap is spent stops the SDK...
  CHECK(tied.status == 503);
  CHECK(tied.should_retry == "false");  // ...because it says so, whatever the options
  // A client that ties its retries by its own x-request-id gets the same.
  CHECK(own_id_calls <= cap);
  CHECK(own_id.should_retry == "false");
}

TEST_CASE("each model's stream budgets are its own: the file's first-token budget cuts that model's slow first "
          "token and no other's",
          "[service][upstreams][chat][config]") {
  temp_dir dir;
  mock_upstream a(dir, "mock-a", {"--latency-ms", "5", "--tokens", "6"}), b(dir, "mock-b", {"--latency-ms", "5", "--tokens", "6"});
  const std::string text = config_head(dir.path(), {&a, &b}, "default_model = \"patient\"\n") +
                           "[models.patient]\n"
                           "deployments = [{ upstream = \"mock-a\", model = \"p-1\" }, { upstream = \"mock-b\", model = \"p-2\" }]\n"
                           "deadline = \"10s\"\nfirst_token = \"3s\"\nattempts = 1\n"
                           "[models.eager]\n"
                           "deployments = [{ upstream = \"mock-a\", model = \"e-1\" }, { upstream = \"mock-b\", model = \"e-2\" }]\n"
                           "deadline = \"10s\"\nfirst_token = \"250ms\"\nattempts = 1\n";
  absl::StatusOr<gateway::gateway_options> o = options_of(text);
  REQUIRE(o.ok());
  auto svc = start(*o);
  a.fault({{"kind", "slow_first_token"}, {"first_token_ms", 800}});
  auto ask = [&](const std::string& model) {
    json body = chat_for(model, 6, false);
    body["tenant"] = "acme";
    return call(svc->port(), "POST", "/v1/chat/completions", body, {});
  };
  const http_answer eager = ask("eager");
  INFO(eager.body.dump());
  REQUIRE(eager.status == 200);
  CHECK(eager.body["keel"]["failed_over"] == true);  // 250 ms passed without a token: mock-b answered
  CHECK(eager.body["keel"]["served_by"] == "backup:mock-b/e-2");
  const http_answer patient = ask("patient");
  INFO(patient.body.dump());
  REQUIRE(patient.status == 200);
  CHECK(patient.body["keel"]["failed_over"] == false);  // 800 ms is within its 3 s
  CHECK(patient.body["keel"]["complete"] == true);
  CHECK(stat(b.stats(), "requests", "chat") == 1);
  CHECK(healthz(svc->port())["streams"]["first_token_timeouts"] == 1);
}

TEST_CASE("a model's third deployment serves when the first two fail before the first token, behind its own breaker",
          "[service][upstreams][chat][config]") {
  temp_dir dir;
  const std::vector<std::string> fast = {"--latency-ms", "5", "--tokens", "6"};
  mock_upstream a(dir, "mock-a", fast), b(dir, "mock-b", fast), c(dir, "mock-c", fast);
  const std::string text = config_head(dir.path(), {&a, &b, &c}) +
                           "[models.three]\n"
                           "deployments = [{ upstream = \"mock-a\", model = \"t-1\" }, { upstream = \"mock-b\", model = \"t-2\" },"
                           " { upstream = \"mock-c\", model = \"t-3\" }]\n"
                           "deadline = \"10s\"\nattempts = 1\n";
  absl::StatusOr<gateway::gateway_options> o = options_of(text);
  REQUIRE(o.ok());
  REQUIRE(o->models.front().upstream_fallbacks.size() == 1);
  auto svc = start(*o);
  json body = chat_for("three", 6, false);
  body["tenant"] = "acme";
  const http_answer healthy = call(svc->port(), "POST", "/v1/chat/completions", body, {});
  CHECK(healthy.status == 200);
  CHECK(healthy.body["keel"]["served_by"] == "model:three");
  a.fault({{"kind", "outage"}});
  b.fault({{"kind", "outage"}});
  const http_answer third = call(svc->port(), "POST", "/v1/chat/completions", body, {});
  INFO(third.body.dump());
  CHECK(third.status == 200);
  CHECK(third.body["keel"]["served_by"] == "backup:mock-c/t-3");
  CHECK(third.body["keel"]["failed_over"] == true);
  CHECK(stat(c.stats(), "requests", "chat") == 1);
  CHECK(breaker_state(svc->port(), "mock-c/t-3") == "closed");  // its own, and it served
}

TEST_CASE("each model has its own breaker options and retry budget; embeddings fail over only to the same upstream "
          "model",
          "[service][upstreams][config]") {
  temp_dir dir;
  const std::vector<std::string> fast = {"--latency-ms", "5", "--tokens", "4"};
  mock_upstream a(dir, "mock-a", fast), b(dir, "mock-b", fast), c(dir, "mock-c", fast);
  // main: the default model (the gateway's breaker, minimum_calls 10, and its
  // budget); touchy: a breaker that opens after 3 calls, and a budget with
  // no retries at all.
  const std::string text = config_head(dir.path(), {&a, &b, &c}) +
                           "[models.main]\n"
                           "deployments = [{ upstream = \"mock-a\", model = \"m-1\" }, { upstream = \"mock-b\", model = \"m-2\" }]\n"
                           "[models.touchy]\n"
                           "deployments = [{ upstream = \"mock-c\", model = \"t-1\" }, { upstream = \"mock-b\", model = \"t-1\" }]\n"
                           "breaker = { minimum_calls = 3, window_calls = 3, open_for = \"60s\" }\n"
                           "retry_budget = { ratio = 0, min_per_second = 0 }\n";
  absl::StatusOr<gateway::gateway_options> o = options_of(text);
  REQUIRE(o.ok());
  REQUIRE(o->models.size() == 2);
  CHECK_FALSE(o->models[0].breaker.has_value());  // the default model's are the gateway's own
  REQUIRE(o->models[1].breaker.has_value());
  CHECK(o->models[1].breaker->minimum_calls == 3);
  REQUIRE(o->models[1].retry_budget.has_value());
  CHECK(o->models[1].retry_budget->ratio == 0);
  o->batch_workers = 0;
  auto svc = start(*o);
  const int port = svc->port();
  auto chat = [&](const std::string& model) {
    json body = chat_for(model, 4, false);
    body["tenant"] = "acme";
    return call(port, "POST", "/v1/chat/completions", body, {});
  };

  a.fault({{"kind", "outage"}});
  c.fault({{"kind", "outage"}});
  for (int i = 0; i < 3; ++i) CHECK(chat("touchy").status == 200);  // the second deployment serves
  CHECK(stat(c.stats(), "requests", "chat") == 3);  // one attempt each: touchy's budget has no retry
  for (int i = 0; i < 3; ++i) CHECK(chat("main").status == 200);
  CHECK(stat(a.stats(), "requests", "chat") == 6);  // two each: the gateway's budget lets the retry go

  INFO(healthz(port)["breakers"].dump());
  CHECK(breaker_state(port, "mock-c/t-1") == "open");    // 3 failures: touchy's own minimum
  CHECK(breaker_state(port, "mock-a/m-1") == "closed");  // 6 failures, under the gateway's 10
  CHECK(chat("touchy").status == 200);
  CHECK(stat(c.stats(), "requests", "chat") == 3);  // its breaker refused before the upstream
  const std::string metrics = metrics_text(port);
  CHECK(metrics.find("gateway_retry_budget{budget=\"model:touchy\",figure=\"requests\"} 4") != std::string::npos);
  CHECK(metrics.find("gateway_retry_budget{budget=\"gateway\",figure=\"retries\"} 3") != std::string::npos);

  // Embeddings: touchy's second deployment serves the same upstream model
  // (t-1), so it answers; main's second is another model (m-2), whose
  // vectors would not be comparable, so main's outage is the answer.
  const http_answer touchy = call(port, "POST", "/v1/embeddings", {{"model", "touchy"}, {"input", "x"}, {"tenant", "acme"}}, {});
  CHECK(touchy.status == 200);
  CHECK(touchy.body["model"] == "t-1");
  CHECK(stat(b.stats(), "requests", "embeddings") == 1);
  const http_answer main = call(port, "POST", "/v1/embeddings", {{"model", "main"}, {"input", "x"}, {"tenant", "acme"}}, {});
  CHECK(main.status == 503);
  CHECK(stat(b.stats(), "requests", "embeddings") == 1);
}

TEST_CASE("the interactive path hedges on the model's second deployment: a hung first one is stopped, the answer "
          "is the model's, not the fallback's",
          "[service][upstreams][hedge]") {
  temp_dir dir;
  const std::vector<std::string> fast = {"--latency-ms", "5"};
  mock_upstream a(dir, "mock-a", fast), b(dir, "mock-b", fast);
  // One pair of deployments, two models: `hedged` with a 100 ms hedge,
  // `plain` without one.
  const std::string deployments =
      "deployments = [{ upstream = \"mock-a\", model = \"m-1\" }, { upstream = \"mock-b\", model = \"m-2\" }]\n";
  const std::string text = config_head(dir.path(), {&a, &b}) +
                           "[models.plain]\n" + deployments +
                           "[models.hedged]\n" + deployments + "hedge = { delay = \"100ms\" }\n";
  absl::StatusOr<gateway::gateway_options> o = options_of(text);
  REQUIRE(o.ok());
  CHECK_FALSE(o->models[0].interactive_hedge);
  CHECK(o->models[1].interactive_hedge);
  o->batch_workers = 0;
  auto svc = start(*o);
  const int port = svc->port();
  auto ask = [&](const std::string& model, const std::string& key) {
    return call(port, "POST", "/v1/feedback",
                {{"tenant", "acme"}, {"model", model}, {"question_id", "q-timeouts"},
                 {"answer", "one deadline, stages get what remains"}},
                {{"Idempotency-Key", key}});
  };
  a.fault({{"kind", "hang"}});

  // Without a hedge, the hung deployment spends the model's stage: the
  // rubric-only fallback answers.
  const http_answer plain = ask("plain", "p-1");
  INFO(plain.body.dump());
  REQUIRE(plain.status == 200);
  CHECK(plain.body["degraded"] == true);
  CHECK(stat(b.stats(), "requests", "chat") == 0);

  // With one, the second deployment answers after 100 ms, and the first
  // attempt is stopped: the hung upstream sees its client go.
  const std::int64_t gone_before = stat(a.stats(), "client_gone", "while_waiting");
  const http_answer hedged = ask("hedged", "h-1");
  INFO(hedged.body.dump());
  REQUIRE(hedged.status == 200);
  CHECK(hedged.body["degraded"] == false);
  CHECK(hedged.body["served_by"] == "model:hedged");
  CHECK(stat(b.stats(), "requests", "chat") == 1);
  CHECK(eventually([&] { return stat(a.stats(), "client_gone", "while_waiting") == gone_before + 1; }));
  const std::string metrics = metrics_text(port);
  CHECK(metrics.find("keel_hedges_started_total 1") != std::string::npos);
}

// --- tool calls and refusals, relayed as the upstream sent them ------------------

namespace {

json tools_body(const std::string& content, bool stream) {
  const json weather = {{"type", "function"},
                        {"function",
                         {{"name", "get_weather"},
                          {"parameters",
                           {{"type", "object"},
                            {"properties", {{"city", {{"type", "string"}}}, {"days", {{"type", "integer"}}}}},
                            {"required", {"city"}}}}}}};
  const json time_at = {{"type", "function"},
                        {"function",
                         {{"name", "get_time"},
                          {"parameters", {{"type", "object"}, {"properties", {{"zone", {{"type", "string"}}}}}}}}}};
  return {{"tenant", "acme"},
          {"messages", {{{"role", "user"}, {"content", content}}}},
          {"tools", {weather, time_at}},
          {"tool_choice", "auto"},
          {"max_tokens", 64},
          {"stream", stream}};
}

// The data of each server-sent event in a chunked HTTP answer's text.
std::vector<json> sse_chunks(const std::string& raw) {
  std::vector<json> out;
  for (std::size_t at = raw.find("data: "); at != std::string::npos; at = raw.find("data: ", at + 6)) {
    const std::size_t end = raw.find('\n', at);
    const std::string data = raw.substr(at + 6, end - at - 6);
    if (data == "[DONE]") continue;
    json j = json::parse(data, nullptr, false);
    if (!j.is_discarded()) out.push_back(std::move(j));
  }
  return out;
}

}  // namespace

TEST_CASE("tool calls and refusals are relayed as the upstream sent them, streamed and not; the client's tools "
          "reach the upstream",
          "[service][upstreams][chat][relay]") {
  temp_dir dir;
  const std::vector<std::string> fast = {"--latency-ms", "5", "--first-token-ms", "5", "--token-gap-ms", "2"};
  mock_upstream a(dir, "mock-a", fast), b(dir, "mock-b", fast);
  gateway::gateway_options o = options_for(dir.path(), a, b);
  without_hedge(o);
  auto svc = start(o);

  SECTION("non-streamed: message.tool_calls with id, type, name and JSON arguments; finish_reason tool_calls") {
    const http_answer r = call(svc->port(), "POST", "/v1/chat/completions", tools_body("Weather in Paris?", false), {});
    INFO(r.body.dump());
    REQUIRE(r.status == 200);
    const json& choice = r.body["choices"][0];
    CHECK(choice["finish_reason"] == "tool_calls");
    CHECK(choice["message"]["content"].is_null());
    REQUIRE(choice["message"]["tool_calls"].size() == 1);
    const json& call0 = choice["message"]["tool_calls"][0];
    CHECK(call0["type"] == "function");
    CHECK(call0["id"].get<std::string>().rfind("call_", 0) == 0);
    CHECK(call0["function"]["name"] == "get_weather");
    const json args = json::parse(call0["function"]["arguments"].get<std::string>(), nullptr, false);
    REQUIRE(args.is_object());
    CHECK(args["city"].is_string());
    CHECK(b.stats()["requests"].value("chat", 0) == 0);
  }
  SECTION("streamed: two calls' fragments relayed as sent, each call's first with id, type and name") {
    keel_service::raw_connection c(svc->port());
    REQUIRE(c.send(chat_request(tools_body("Use two tools: weather and time", true))));
    const std::string got = c.read_until("\r\n0\r\n\r\n");
    INFO(got);
    CHECK(got.find("data: [DONE]") != std::string::npos);
    std::map<std::int64_t, std::string> arguments;
    std::map<std::int64_t, json> heads;
    bool role_first = false;
    std::string finish;
    const std::vector<json> chunks = sse_chunks(got);
    REQUIRE(!chunks.empty());
    role_first = chunks.front()["choices"][0]["delta"].value("role", "") == "assistant";
    for (const json& ch : chunks) {
      if (!ch.contains("choices") || ch["choices"].empty()) continue;
      const json& choice = ch["choices"][0];
      if (choice.contains("finish_reason") && choice["finish_reason"].is_string()) finish = choice["finish_reason"];
      if (!choice["delta"].contains("tool_calls")) continue;
      for (const json& d : choice["delta"]["tool_calls"]) {
        const std::int64_t i = d["index"];
        if (!heads.contains(i)) heads[i] = d;  // the first fragment of call i
        arguments[i] += d["function"].value("arguments", "");
      }
    }
    CHECK(role_first);
    CHECK(finish == "tool_calls");
    REQUIRE(heads.size() == 2);
    for (const auto& [i, h] : heads) {
      CHECK(h["id"].is_string());
      CHECK(h["type"] == "function");
      CHECK(h["function"]["name"].is_string());
      CHECK(json::parse(arguments[i], nullptr, false).is_object());  // the fragments put back together
    }
    CHECK(got.find("\"keel\":") != std::string::npos);  // the gateway's own last chunk
  }
  SECTION("a refusal: message.refusal with content null; streamed, delta.refusal fragments") {
    json body = tools_body("refuse: I will not", false);
    body.erase("tools");
    body.erase("tool_choice");
    const http_answer r = call(svc->port(), "POST", "/v1/chat/completions", body, {});
    INFO(r.body.dump());
    REQUIRE(r.status == 200);
    CHECK(r.body["choices"][0]["message"]["content"].is_null());
    CHECK_FALSE(r.body["choices"][0]["message"].value("refusal", "").empty());
    body["stream"] = true;
    keel_service::raw_connection c(svc->port());
    REQUIRE(c.send(chat_request(body)));
    const std::string got = c.read_until("\r\n0\r\n\r\n");
    INFO(got);
    std::string refusal;
    for (const json& ch : sse_chunks(got))
      if (ch.contains("choices") && !ch["choices"].empty()) refusal += ch["choices"][0]["delta"].value("refusal", "");
    CHECK(refusal == r.body["choices"][0]["message"]["refusal"].get<std::string>());
  }
}
