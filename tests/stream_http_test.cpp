// The libcurl adapter's streaming (keel::http::client::stream) against the
// scripted SSE server (support/sse_server.hpp), through keel::token_stream
// and a retry pipeline, on the real clock. Budgets are short, bounds asserted
// generous: the machine is shared.
#include <atomic>
#include <chrono>
#include <stop_token>
#include <string>
#include <thread>

#include "keel/compose/executor.hpp"
#include "keel/compose/pipeline.hpp"
#include "keel/compose/stream.hpp"
#include "keel/core/clock.hpp"
#include "keel/policy/backoff.hpp"
#include "keel/policy/retry.hpp"
#include "keel/provider/http.hpp"
#include "support/catch.hpp"
#include "support/sse_server.hpp"

using namespace std::chrono_literals;
namespace http = keel::http;

namespace {

constexpr std::string_view body = R"({"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]})";

struct outcome {
  absl::StatusOr<keel::stream_result> result;
  std::string shown;
  int attempts = 0;
  keel::duration took{};
};

outcome stream_once(http::client& client, const std::string& path, const keel::stream_options& o, int max_attempts = 3,
                    std::stop_token stop = {}, std::atomic<int>* seen = nullptr) {
  keel::stream_guard guard(o);
  outcome out{absl::UnknownError("not run"), {}, 0, {}};
  keel::call call(keel::real_clock{}.now(), {.timeout = 20s, .stop = stop, .max_attempts = max_attempts});
  keel::token_stream stream(guard, [&](std::string_view t) {
    out.shown.append(t);
    if (seen != nullptr) seen->fetch_add(1);
  });
  auto provider = client.stream({.path = path, .body = body});
  const auto pipe =
      keel::pipeline(keel::retry({.max_attempts = max_attempts}, keel::constant_backoff{.delay_each = 1ms}));
  const auto start = std::chrono::steady_clock::now();
  out.result = pipe.run(call, stream.attempts(provider));
  out.took = std::chrono::steady_clock::now() - start;
  out.attempts = call.record().attempts;
  return out;
}

// Polls (real time) until `done` holds or `limit` passed.
template <class Done>
void wait_until(Done done, std::chrono::steady_clock::duration limit) {
  const auto give_up = std::chrono::steady_clock::now() + limit;
  while (!done() && std::chrono::steady_clock::now() < give_up) std::this_thread::sleep_for(1ms);
}

}  // namespace

TEST_CASE("http stream: tokens, the usage chunk and [DONE] through libcurl's write callback", "[stream][http]") {
  keel_test::sse_server server(5);
  http::client client({.base_url = server.url()});
  const outcome o = stream_once(client, "/normal", {.first_token = 5s, .stall = 5s});
  REQUIRE(o.result.ok());
  CHECK(o.result->complete);
  CHECK(o.result->text == "t0 t1 t2 t3 t4 ");
  CHECK(o.shown == o.result->text);
  CHECK(o.result->tokens == 5);
  CHECK(o.result->usage.completion_tokens == 5);
  CHECK(o.attempts == 1);
}

TEST_CASE("http stream: a usage chunk that disagrees with the count is the provider's word", "[stream][http]") {
  keel_test::sse_server server(3);
  http::client client({.base_url = server.url()});
  const outcome o = stream_once(client, "/usage_mismatch", {.first_token = 5s, .stall = 5s});
  REQUIRE(o.result.ok());
  CHECK(o.result->tokens == 3);
  CHECK(o.result->usage.completion_tokens == 50);
  CHECK(o.result->usage.prompt_tokens == 9);
}

TEST_CASE("http stream: a 429 before the stream is retried after its hint, and the retry streams", "[stream][http]") {
  keel_test::sse_server server(2);
  http::client client({.base_url = server.url()});
  const outcome o = stream_once(client, "/429_then_ok", {.first_token = 5s, .stall = 5s});
  REQUIRE(o.result.ok());
  CHECK(o.result->text == "t0 t1 ");
  CHECK(o.attempts == 2);
  CHECK(server.requests("/429_then_ok") == 2);
}

TEST_CASE("http stream: a slow first token is stopped at its budget, the transfer aborted, and the retry serves",
          "[stream][http]") {
  keel_test::sse_server server(2, 10s);  // the slow first token would come after 10 s
  http::client client({.base_url = server.url()});
  const outcome o = stream_once(client, "/slow_then_ok", {.first_token = 300ms, .stall = 5s});
  REQUIRE(o.result.ok());
  CHECK(o.result->text == "t0 t1 ");
  CHECK(o.attempts == 2);
  CHECK(o.took < 8s);  // not the 10 s the first stream would have taken
  // The server saw the first stream's client go away (its next keep-alive
  // write failed): the transfer was aborted, not left running.
  wait_until([&] { return server.aborted() == 1; }, 5s);
  CHECK(server.aborted() == 1);
  CHECK(server.finished() == 1);
}

TEST_CASE("http stream: keep-alives and a role chunk never commit: the first-token budget still fires",
          "[stream][http]") {
  keel_test::sse_server server(2, 10s);
  http::client client({.base_url = server.url()});
  const outcome o = stream_once(client, "/keepalive_only", {.first_token = 300ms, .stall = 100ms}, 1);
  REQUIRE_FALSE(o.result.ok());
  CHECK(absl::IsDeadlineExceeded(o.result.status()));
  CHECK(o.took < 8s);
}

TEST_CASE("http stream: a stall after N tokens is a partial answer with the tokens received", "[stream][http]") {
  keel_test::sse_server server(3, 10s);
  http::client client({.base_url = server.url()});
  // Keep-alives flow during the stall: they are not tokens.
  const outcome o = stream_once(client, "/stall", {.first_token = 5s, .stall = 300ms});
  REQUIRE(o.result.ok());
  CHECK(o.result->partial);
  CHECK(o.result->reason == keel::stream_stop::stall);
  CHECK(o.result->text == "t0 t1 t2 ");
  CHECK(o.result->continuable);
  CHECK(o.attempts == 1);
  CHECK(o.took < 8s);
}

TEST_CASE("http stream: a cut connection after N tokens is partial, failed, continuable", "[stream][http]") {
  keel_test::sse_server server(4);
  http::client client({.base_url = server.url()});
  const outcome o = stream_once(client, "/cut", {.first_token = 5s, .stall = 5s});
  REQUIRE(o.result.ok());
  CHECK(o.result->partial);
  CHECK(o.result->reason == keel::stream_stop::failed);
  CHECK(o.result->text == "t0 t1 t2 t3 ");
  CHECK(absl::IsUnavailable(o.result->cause));
  CHECK(o.result->continuable);
  CHECK(o.attempts == 1);
}

TEST_CASE("http stream: an error event mid-stream is partial with the provider's error", "[stream][http]") {
  keel_test::sse_server server(2);
  http::client client({.base_url = server.url()});
  const outcome o = stream_once(client, "/error", {.first_token = 5s, .stall = 5s});
  REQUIRE(o.result.ok());
  CHECK(o.result->partial);
  CHECK(o.result->reason == keel::stream_stop::failed);
  CHECK(o.result->text == "t0 t1 ");
  CHECK(absl::IsUnavailable(o.result->cause));
  CHECK(std::string(o.result->cause.message()).find("overloaded") != std::string::npos);
}

TEST_CASE("http stream: cancelling the call aborts the transfer at once", "[stream][http][cancel]") {
  keel_test::sse_server server(3, 30s);
  http::client client({.base_url = server.url()});
  std::stop_source caller;
  outcome o{absl::UnknownError("not run"), {}, 0, {}};
  std::chrono::steady_clock::time_point stopped_at{};
  std::atomic<int> seen{0};
  std::jthread t(
      [&] { o = stream_once(client, "/stall", {.first_token = 5s, .stall = 60s}, 3, caller.get_token(), &seen); });
  while (seen.load() < 3) std::this_thread::sleep_for(1ms);  // the three tokens before the stall
  stopped_at = std::chrono::steady_clock::now();
  caller.request_stop();
  t.join();
  const auto after_stop = std::chrono::steady_clock::now() - stopped_at;
  REQUIRE(o.result.ok());
  CHECK(o.result->reason == keel::stream_stop::cancelled);
  CHECK(o.result->text == "t0 t1 t2 ");
  CHECK(after_stop < 5s);  // milliseconds in practice; generous on a loaded machine
  // Upstream the stream stops too: the server's handler, writing a keep-alive
  // every 50 ms, finds its client gone instead of playing on for 30 s.
  wait_until([&] { return server.aborted() == 1; }, 5s);
  const auto upstream = std::chrono::steady_clock::now() - stopped_at;
  CHECK(server.aborted() == 1);
  CHECK(server.finished() == 0);
  CHECK(upstream < 5s);
  using ms = std::chrono::duration<double, std::milli>;
  const double to_return = ms(after_stop).count(), to_server = ms(upstream).count();
  UNSCOPED_INFO("cancel to return: " << to_return << " ms; to the server seeing it: " << to_server << " ms");
}

// --- model output beyond content, and what a relay needs ----------------------

TEST_CASE("http stream: a tool-call stream commits at its first fragment and its call is put back together",
          "[stream][http][tools]") {
  keel_test::sse_server server;
  http::client client({.base_url = server.url()});
  // No content token ever comes: with tool-call deltas not counted as
  // output, the 250 ms first-token budget would cut this healthy stream.
  const outcome o = stream_once(client, "/tool_calls", {.first_token = 250ms, .stall = 5s}, 1);
  REQUIRE(o.result.ok());
  CHECK(o.result->complete);
  CHECK(o.result->text.empty());
  CHECK(o.shown.empty());  // a text callback is handed content only
  CHECK(o.result->tokens == 6);
  REQUIRE(o.result->tool_calls.size() == 1);
  CHECK(o.result->tool_calls[0].id == "call_DdmO9pD3xa9XTPNJ32zg2hcA");
  CHECK(o.result->tool_calls[0].name == "get_weather");
  CHECK(o.result->tool_calls[0].arguments == R"({"location":"Paris, France","unit":"celsius"})");
}

TEST_CASE("http stream: a stream cut inside tool-call arguments is partial, in a tool call, not continuable",
          "[stream][http][tools]") {
  keel_test::sse_server server;
  http::client client({.base_url = server.url()});
  const outcome o = stream_once(client, "/tool_calls_cut", {.first_token = 5s, .stall = 5s});
  REQUIRE(o.result.ok());
  CHECK(o.result->partial);
  CHECK(o.result->reason == keel::stream_stop::failed);
  CHECK(o.result->in_tool_call);
  CHECK_FALSE(o.result->continuable);
  REQUIRE(o.result->tool_calls.size() == 1);
  CHECK(o.result->tool_calls[0].arguments == R"({"location":"Paris, France)");
  CHECK(o.attempts == 1);
}

TEST_CASE("http stream: a refusal-only stream commits with the refusal's text", "[stream][http][refusal]") {
  keel_test::sse_server server;
  http::client client({.base_url = server.url()});
  const outcome o = stream_once(client, "/refusal", {.first_token = 5s, .stall = 5s}, 1);
  REQUIRE(o.result.ok());
  CHECK(o.result->complete);
  CHECK(o.result->refusal == "I'm sorry, I can't help with that.");
  CHECK(o.result->tokens == 2);
}

namespace {

struct relayed {
  absl::StatusOr<keel::stream_result> result{absl::UnknownError("not run")};
  std::string wire;  // what a relay would write, event by event
  int events = 0;
  int statuses = 0;  // events that came with the upstream's status
  std::string request_id;
};

relayed relay_once(http::client& client, const std::string& path, const keel::stream_options& o, int max_attempts) {
  keel::stream_guard guard(o);
  relayed out;
  keel::call call(keel::real_clock{}.now(), {.timeout = 20s, .max_attempts = max_attempts});
  keel::token_stream stream(guard, [&](const keel::stream_event& e) {
    ++out.events;
    keel::write_sse_event(out.wire, e.data, e.name);
    if (e.upstream != nullptr && e.upstream->status == 200) {
      ++out.statuses;
      out.request_id = std::string(e.upstream->header("x-request-id"));
    }
  });
  auto provider = client.stream({.path = path, .body = body});
  const auto pipe =
      keel::pipeline(keel::retry({.max_attempts = max_attempts}, keel::constant_backoff{.delay_each = 1ms}));
  out.result = pipe.run(call, stream.attempts(provider));
  return out;
}

}  // namespace

TEST_CASE("http stream: a relay is handed every event as the provider sent it, with the upstream's status and headers",
          "[stream][http][relay]") {
  keel_test::sse_server server;
  http::client client({.base_url = server.url()});
  const relayed r = relay_once(client, "/tool_calls", {.first_token = 5s, .stall = 5s}, 1);
  REQUIRE(r.result.ok());
  CHECK(r.result->complete);
  std::string sent;
  for (const std::string& e : keel_test::sse_server::tool_call_events()) sent += e;
  CHECK(r.wire == sent);  // byte for byte: id, model, role, tool deltas, finish_reason, [DONE]
  CHECK(r.events == 8);
  CHECK(r.statuses == 8);
  CHECK(r.request_id == "req-tool_calls-1");
  CHECK(r.result->upstream.status == 200);
  CHECK(r.result->upstream.header("x-ratelimit-remaining-requests") == "9999");
  CHECK(r.result->upstream.header("X-Request-Id") == "req-tool_calls-1");
  CHECK(r.result->upstream.header("content-type").empty());  // not a relay header
}

TEST_CASE("http stream: a relay sees nothing of an attempt that failed before its commit", "[stream][http][relay]") {
  keel_test::sse_server server(2, 10s);
  http::client client({.base_url = server.url()});
  const relayed r = relay_once(client, "/slow_then_ok", {.first_token = 300ms, .stall = 5s}, 2);
  REQUIRE(r.result.ok());
  CHECK(r.result->complete);
  // The first attempt's role chunk was held until a commit that never came:
  // the client sees the serving attempt's events only, its role chunk once.
  std::size_t roles = 0;
  for (std::size_t at = 0; (at = r.wire.find("\"role\"", at)) != std::string::npos; ++at) ++roles;
  CHECK(roles == 1);
  CHECK(r.wire.rfind("data: {\"choices\":[{\"index\":0,\"delta\":{\"role\"", 0) == 0);
  CHECK(r.wire.find(keel_test::sse_server::token_event(0)) != std::string::npos);
  CHECK(r.wire.size() >= 14);
  CHECK(r.wire.substr(r.wire.size() - 14) == "data: [DONE]\n\n");
  CHECK(r.request_id == "req-slow_then_ok-2");
}

TEST_CASE("http: a failure keeps the upstream's HTTP status and relay headers beside keel's classification",
          "[stream][http][relay]") {
  keel_test::sse_server server(2);
  http::client client({.base_url = server.url()});
  const outcome o = stream_once(client, "/429_then_ok", {.first_token = 5s, .stall = 5s}, 1);
  REQUIRE_FALSE(o.result.ok());
  CHECK(absl::IsResourceExhausted(o.result.status()));
  const std::optional<keel::upstream_reply> up = keel::upstream_of(o.result.status());
  REQUIRE(up.has_value());
  CHECK(up->status == 429);
  CHECK(up->header("retry-after-ms") == "20");
  CHECK(up->header("x-request-id") == "req-429_then_ok-1");
  CHECK(up->header("x-ratelimit-reset-requests") == "6ms");

  // A 2xx: the parse sees them too.
  keel::call call(keel::real_clock{}.now(), {.timeout = 10s});
  auto ex = client.exchange({.path = "/normal", .body = body}, [](const http::response& r) -> absl::StatusOr<std::string> {
    if (r.upstream == nullptr) return absl::InternalError("no upstream");
    return absl::StrCat(r.upstream->status, " ", keel::detail::to_absl(r.upstream->header("x-request-id")));
  });
  const absl::StatusOr<std::string> got = keel::pipeline(keel::retry({.max_attempts = 1})).run(call, ex);
  REQUIRE(got.ok());
  CHECK(*got == "200 req-normal-1");
}
