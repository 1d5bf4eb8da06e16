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
