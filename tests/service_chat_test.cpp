// The gateway's streaming endpoint without HTTP (gateway_core::chat_completions,
// examples/gateway/chat.hpp) on the manual clock: tokens relayed as they
// come and nothing before the first; a stall or a cut connection continued
// on the second model with the same text; an outage before the first token
// failed over; the first-token hedge; a client that hangs up stops the
// provider at once; tokens reserved and settled; bad bodies refused.
//
// Each step moves the clock to the next thing that happens (a token, a
// budget, a hedge) once the threads that wait for it are parked, then waits
// (real time) until it has happened: the timings asserted are exact.
#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "gateway_core.hpp"
#include "keel/store/sqlite_jobs.hpp"
#include "keel/testing/manual_clock.hpp"
#include "support/service.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;
namespace kt = keel::testing;
using json = nlohmann::json;
using keel_service::temp_dir;

namespace {

using core_t = gateway::gateway_core<kt::manual_clock, keel::sqlite_job_store<>>;

std::unique_ptr<core_t> open_core(const gateway::gateway_options& o, kt::manual_clock clock) {
  auto core = core_t::open(
      o, [](const std::string& path) { return keel::sqlite_job_store<>::open(path); }, clock);
  if (!core.ok()) FAIL(std::string(core.status().message()));
  return std::move(*core);
}

// Both models: first token at 100 ms, a token every 10 ms, six tokens, no
// spread and no tail. The guard: 500 ms to the first token, 50 ms stall, no
// hedge. A tenant budget of 10 000 tokens an hour (it refills < 1 a test).
gateway::gateway_options chat_options(const std::string& dir) {
  gateway::gateway_options o;
  o.data_dir = dir;
  for (gateway::provider_options* p : {&o.provider, &o.chat.backup}) {
    p->spread = 0;
    p->first_token_latency = 100ms;
    p->tail_ratio = 0;
    p->token_gap = 10ms;
    p->stream_tokens = 6;
    p->refuse_latency = 0ms;
  }
  o.chat.first_token = 500ms;
  o.chat.stall = 50ms;
  o.chat.whole = 5s;
  o.chat.deadline = 10s;
  o.chat.hedge_delay = 0ms;
  o.chat.hedge_percentile = 0;
  o.chat.attempts = 1;
  o.tenant_defaults.compute_budget = 10'000;
  o.tenant_defaults.compute_window = 1h;
  return o;
}

std::string chat_body(bool stream, int max_tokens = 64, const std::string& content = "Explain deadlines.") {
  return json{{"tenant", "acme"},
              {"model", "feedback-large"},
              {"messages", {{{"role", "user"}, {"content", content}}}},
              {"max_tokens", max_tokens},
              {"stream", stream}}
      .dump();
}

// Polls (real time) until `done` holds: a woken thread may not have run yet.
template <class Done>
void wait_for(Done done) {
  const auto give_up = std::chrono::steady_clock::now() + 60s;
  while (!done()) {
    if (std::chrono::steady_clock::now() > give_up) FAIL("gave up waiting (60 s of real time)");
    std::this_thread::sleep_for(1ms);
  }
}

// One chat request on its own thread while the test moves the clock.
struct chat_run {
  chat_run(core_t& core, std::string body, gateway::chat_sink* sink)
      : thread([this, &core, body = std::move(body), sink] {
          result = core.chat_completions(body, sink);
          done.store(true);
        }) {}
  gateway::reply finish() {
    wait_for([&] { return done.load(); });
    thread.join();
    return result;
  }
  gateway::reply result;
  std::atomic<bool> done{false};
  std::jthread thread;
};

// The content tokens a recording sink received so far.
int content_events(const gateway::recording_sink& sink) {
  const std::string t = sink.text();
  int n = 0;
  for (std::size_t at = t.find("\"content\":\""); at != std::string::npos; at = t.find("\"content\":\"", at + 1)) {
    if (t.compare(at, 12, "\"content\":\"\"") != 0) ++n;  // the role chunk's empty content is not a token
  }
  return n;
}

// The data of each server-sent event, in order.
std::vector<std::string> events(const std::string& sse) {
  std::vector<std::string> out;
  for (std::size_t at = 0; at < sse.size();) {
    const std::size_t end = sse.find("\n\n", at);
    REQUIRE(end != std::string::npos);
    const std::string e = sse.substr(at, end - at);
    REQUIRE(e.rfind("data: ", 0) == 0);
    out.push_back(e.substr(6));
    at = end + 2;
  }
  return out;
}

// The streamed answer's text, from its content chunks.
std::string streamed_text(const std::vector<std::string>& evs) {
  std::string text;
  for (const std::string& e : evs) {
    if (e == "[DONE]") continue;
    const json j = json::parse(e);
    if (j.contains("choices") && !j["choices"].empty() && j["choices"][0]["delta"].contains("content"))
      text += j["choices"][0]["delta"]["content"].get<std::string>();
  }
  return text;
}

// Plays `n` tokens a gap apart from `first` (the sink has `before` already).
void play_tokens(const kt::manual_clock& clock, const gateway::recording_sink& sink, int before, int n,
                 keel::duration first, keel::duration gap, int sleepers = 2) {
  for (int i = 0; i < n; ++i) {
    clock.await_sleepers(sleepers);
    clock.advance(i == 0 ? first : gap);
    wait_for([&] { return content_events(sink) == before + i + 1; });
  }
}

double tenant_tokens_left(core_t& core, const kt::manual_clock& clock) {
  return core.quotas().tenant_figures("acme", clock.now())->compute_available;
}

}  // namespace

TEST_CASE("a stream is relayed token by token from the first content token, then usage and [DONE]",
          "[service][chat]") {
  temp_dir dir;
  kt::manual_clock clock;
  auto core = open_core(chat_options(dir.path()), clock);
  gateway::recording_sink sink;
  const keel::time_point t0 = clock.now();
  chat_run run(*core, chat_body(true), &sink);

  clock.await_sleepers(2);  // the provider before its first token, the guard's watchdog
  CHECK(sink.sends() == 0);  // the commit point is the first content token: nothing shown yet
  const int input_tokens = static_cast<int>(std::string("user: Explain deadlines.\n").size() / 4 + 1);
  // Admission reserved input + max_tokens (no outputs learned yet) from the tenant's budget.
  const double reserved_left = tenant_tokens_left(*core, clock);
  CHECK(reserved_left == Approx(10'000 - (64 + input_tokens)).margin(1));

  play_tokens(clock, sink, 0, 6, 100ms, 10ms);
  const gateway::reply r = run.finish();
  REQUIRE(r.status == 200);
  CHECK(r.streamed);
  CHECK(clock.now() - t0 == 150ms);

  const std::vector<std::string> evs = events(sink.text());
  REQUIRE(evs.size() == 1 + 6 + 2 + 1);  // role, tokens, finish_reason, usage, [DONE]
  const json role = json::parse(evs[0]);
  CHECK(role["object"] == "chat.completion.chunk");
  CHECK(role["choices"][0]["delta"]["role"] == "assistant");
  CHECK(json::parse(evs[7])["choices"][0]["finish_reason"] == "stop");
  const json last = json::parse(evs[8]);
  CHECK(last["choices"].empty());
  CHECK(last["usage"]["completion_tokens"] == 6);
  CHECK(last["keel"]["complete"] == true);
  CHECK(last["keel"]["degraded"] == false);
  CHECK(last["keel"]["served_by"] == "model:feedback-large");
  CHECK(last["keel"]["ttft_ms"].get<double>() == Approx(100));
  CHECK(last["keel"]["reserved_tokens"] == 64 + input_tokens);
  CHECK(evs[9] == "[DONE]");
  // Every chunk is one answer's: one id.
  CHECK(json::parse(evs[3])["id"] == role["id"]);

  // Settled to what the provider billed: its usage chunk's total.
  const std::int64_t charged = last["keel"]["charged_tokens"].get<std::int64_t>();
  CHECK(charged == last["usage"]["total_tokens"].get<std::int64_t>());
  CHECK(tenant_tokens_left(*core, clock) == Approx(10'000 - charged).margin(1));
  CHECK(core->provider().figures().streams_complete == 1);
  CHECK(core->backup_provider().figures().streams == 0);

  SECTION("the same request without stream: one chat.completion with the same text") {
    chat_run plain(*core, chat_body(false), nullptr);
    for (int i = 0; i < 6; ++i) {
      clock.await_sleepers(2);
      clock.advance(i == 0 ? 100ms : 10ms);
      wait_for([&] { return core->provider().figures().stream_tokens == 6 + i + 1; });
    }
    const gateway::reply p = plain.finish();
    REQUIRE(p.status == 200);
    CHECK_FALSE(p.streamed);
    const json j = json::parse(p.body);
    CHECK(j["object"] == "chat.completion");
    CHECK(j["choices"][0]["message"]["content"] == streamed_text(evs));
    CHECK(j["choices"][0]["finish_reason"] == "stop");
    CHECK(j["degraded"] == false);
  }
}

TEST_CASE("a stall after the commit is continued on the second model: the same text, marked degraded",
          "[service][chat]") {
  temp_dir dir;
  kt::manual_clock clock;
  auto core = open_core(chat_options(dir.path()), clock);

  // The uninterrupted answer first.
  gateway::recording_sink whole;
  chat_run healthy(*core, chat_body(true), &whole);
  play_tokens(clock, whole, 0, 6, 100ms, 10ms);
  REQUIRE(healthy.finish().status == 200);
  const std::string expected = streamed_text(events(whole.text()));

  REQUIRE(core->provider().set_fault({.kind = gateway::fault_kind::stall}).ok());
  gateway::recording_sink sink;
  const keel::time_point t0 = clock.now();
  chat_run run(*core, chat_body(true), &sink);
  play_tokens(clock, sink, 0, 3, 100ms, 10ms);  // the model stalls after half its tokens
  clock.await_sleepers(2);
  clock.advance(49ms);  // 49 ms without a token: not yet a stall
  clock.await_sleepers(2);
  CHECK(core->stream_guard().figures().stalls == 0);
  clock.advance(1ms);
  wait_for([&] { return core->backup_provider().figures().streams == 1; });
  CHECK(core->stream_guard().figures().stalls == 1);
  CHECK(core->provider().figures().streams_stopped == 1);  // the stalled transfer was closed
  play_tokens(clock, sink, 3, 3, 100ms, 10ms);              // the rest, from the second model
  const gateway::reply r = run.finish();
  REQUIRE(r.status == 200);
  CHECK(clock.now() - t0 == 120ms + 50ms + 100ms + 20ms);

  const std::vector<std::string> evs = events(sink.text());
  CHECK(streamed_text(evs) == expected);  // continued where it stopped: no token twice, none lost
  const json last = json::parse(evs[evs.size() - 2]);
  CHECK(last["keel"]["complete"] == true);
  CHECK(last["keel"]["partial"] == true);
  CHECK(last["keel"]["degraded"] == true);
  CHECK(last["keel"]["continuations"] == 1);
  CHECK(last["keel"]["served_by"] == "model:feedback-large+backup:sim-llm-backup");
  CHECK(last["usage"]["completion_tokens"] == 6);
  CHECK(core->stream_guard().figures().continuations == 1);
}

TEST_CASE("a connection cut mid-stream is continued; one the client cannot be told about ends with an error event",
          "[service][chat]") {
  temp_dir dir;
  kt::manual_clock clock;
  gateway::gateway_options o = chat_options(dir.path());

  SECTION("cut after two tokens: continued on the second model") {
    auto core = open_core(o, clock);
    gateway::recording_sink sink;
    chat_run run(*core, chat_body(true), &sink);
    play_tokens(clock, sink, 0, 2, 100ms, 10ms);
    clock.await_sleepers(2);
    REQUIRE(core->provider().set_fault({.kind = gateway::fault_kind::outage}).ok());
    clock.advance(10ms);  // the next token finds the connection reset
    wait_for([&] { return core->backup_provider().figures().streams == 1; });
    CHECK(core->provider().figures().streams_cut == 1);
    play_tokens(clock, sink, 2, 4, 100ms, 10ms);
    REQUIRE(run.finish().status == 200);
    const std::vector<std::string> evs = events(sink.text());
    const json last = json::parse(evs[evs.size() - 2]);
    CHECK(last["keel"]["complete"] == true);
    CHECK(last["keel"]["continuations"] == 1);
    CHECK(last["usage"]["completion_tokens"] == 6);
  }

  SECTION("continuation switched off: a partial answer, told as an error event after the tokens") {
    o.chat.continue_on_backup = false;
    auto core = open_core(o, clock);
    gateway::recording_sink sink;
    chat_run run(*core, chat_body(true), &sink);
    play_tokens(clock, sink, 0, 2, 100ms, 10ms);
    clock.await_sleepers(2);
    REQUIRE(core->provider().set_fault({.kind = gateway::fault_kind::outage}).ok());
    clock.advance(10ms);
    const gateway::reply r = run.finish();
    CHECK(r.status == 200);  // the head went out with the first token
    const std::vector<std::string> evs = events(sink.text());
    REQUIRE(evs.size() == 1 + 2 + 2);  // role, two tokens, the error, [DONE]
    const json err = json::parse(evs[3]);
    CHECK(err["error"]["type"] == "stream_interrupted");
    CHECK(err["keel"]["partial"] == true);
    CHECK(err["keel"]["complete"] == false);
    CHECK(err["keel"]["continuable"] == true);
    CHECK(err["keel"]["tokens"] == 2);
    CHECK(err["keel"]["cause"].get<std::string>().find("connection reset after 2 tokens") != std::string::npos);
    CHECK(evs[4] == "[DONE]");
    CHECK(core->backup_provider().figures().streams == 0);
  }
}

TEST_CASE("before the first token a failure is not shown: failed over to the second model, or a plain JSON error",
          "[service][chat]") {
  temp_dir dir;
  kt::manual_clock clock;
  auto core = open_core(chat_options(dir.path()), clock);
  REQUIRE(core->provider().set_fault({.kind = gateway::fault_kind::outage}).ok());

  SECTION("the first model is down: the second answers, degraded") {
    gateway::recording_sink sink;
    chat_run run(*core, chat_body(true), &sink);
    wait_for([&] { return core->backup_provider().figures().streams == 1; });
    CHECK(sink.sends() == 0);  // the 503 never reached the client
    play_tokens(clock, sink, 0, 6, 100ms, 10ms);
    REQUIRE(run.finish().status == 200);
    const std::vector<std::string> evs = events(sink.text());
    const json last = json::parse(evs[evs.size() - 2]);
    CHECK(last["keel"]["failed_over"] == true);
    CHECK(last["keel"]["degraded"] == true);
    CHECK(last["keel"]["served_by"] == "backup:sim-llm-backup");
    CHECK(core->provider().figures().unavailable == 1);
  }

  SECTION("both down: 503 as JSON, nothing streamed, the reservation given back") {
    REQUIRE(core->backup_provider().set_fault({.kind = gateway::fault_kind::outage}).ok());
    gateway::recording_sink sink;
    const gateway::reply r = core->chat_completions(chat_body(true), &sink);
    CHECK(r.status == 503);
    CHECK_FALSE(r.streamed);
    CHECK(sink.sends() == 0);
    CHECK(json::parse(r.body)["error"]["message"].get<std::string>().find("503") != std::string::npos);
    CHECK(tenant_tokens_left(*core, clock) == Approx(10'000).margin(1));  // billed nothing
  }

  SECTION("a 429 from both models before the stream: 503 with their Retry-After (429 is the tenant's own quota)") {
    REQUIRE(core->provider().set_fault({.kind = gateway::fault_kind::rate_limit, .retry_after = 3s}).ok());
    REQUIRE(core->backup_provider().set_fault({.kind = gateway::fault_kind::rate_limit, .retry_after = 3s}).ok());
    const gateway::reply r = core->chat_completions(chat_body(true), nullptr);
    INFO(r.body);
    CHECK(r.status == 503);
    REQUIRE(r.retry_after.has_value());
    CHECK(*r.retry_after == 3s);
  }
}

TEST_CASE("first-token hedge: a second stream after the delay; the first to show content wins, the other stops",
          "[service][chat][hedge]") {
  temp_dir dir;
  kt::manual_clock clock;
  gateway::gateway_options o = chat_options(dir.path());
  o.chat.hedge_delay = 150ms;
  auto core = open_core(o, clock);
  // This stream's first token would take 400 ms; the hedge's takes 100.
  REQUIRE(core->provider().set_fault({.kind = gateway::fault_kind::slowdown, .factor = 4}).ok());
  gateway::recording_sink sink;
  const keel::time_point t0 = clock.now();
  chat_run run(*core, chat_body(true), &sink);
  clock.await_sleepers(2);
  REQUIRE(core->provider().set_fault({}).ok());  // the hedge starts on a healthy provider
  clock.advance(150ms);
  wait_for([&] { return core->stream_guard().figures().hedges_started == 1; });
  play_tokens(clock, sink, 0, 1, 100ms, 10ms, 3);  // both streams and the watchdog
  wait_for([&] { return core->provider().figures().streams_stopped == 1; });  // the loser, at once
  CHECK(clock.now() - t0 == 250ms);
  play_tokens(clock, sink, 1, 5, 10ms, 10ms);
  REQUIRE(run.finish().status == 200);
  const std::vector<std::string> evs = events(sink.text());
  const json last = json::parse(evs[evs.size() - 2]);
  CHECK(last["keel"]["hedged"] == true);
  CHECK(last["keel"]["ttft_ms"].get<double>() == Approx(250));          // what the client waited
  CHECK(last["keel"]["attempt_ttft_ms"].get<double>() == Approx(100));  // the winner's, from its own start
  CHECK(last["keel"]["complete"] == true);
  CHECK(core->stream_guard().figures().hedge_wins == 1);
  // The hedge went to the second model, not to the one slow to its first token.
  CHECK(core->provider().figures().streams == 1);
  CHECK(core->backup_provider().figures().streams == 1);
}

TEST_CASE("a client that hangs up mid-stream stops the provider at once, with no time passing",
          "[service][chat][cancel]") {
  temp_dir dir;
  kt::manual_clock clock;
  auto core = open_core(chat_options(dir.path()), clock);
  gateway::recording_sink sink;
  chat_run run(*core, chat_body(true), &sink);
  play_tokens(clock, sink, 0, 2, 100ms, 10ms);
  clock.await_sleepers(2);
  const keel::time_point gone_at = clock.now();
  sink.hang_up();
  wait_for([&] { return core->provider().figures().streams_stopped == 1; });
  CHECK(clock.now() == gone_at);  // stopped on the hang-up itself, not at its next token
  const gateway::reply r = run.finish();
  CHECK(r.status == 200);
  CHECK(core->backup_provider().figures().streams == 0);  // a lost client is not continued
  // Billed for the two tokens it produced (no usage chunk: counted), the rest refunded.
  CHECK(tenant_tokens_left(*core, clock) == Approx(10'000 - 2).margin(1));
}

TEST_CASE("chat bodies that break the rules are refused with 400, naming the rule", "[service][chat][input]") {
  temp_dir dir;
  kt::manual_clock clock;
  auto core = open_core(chat_options(dir.path()), clock);
  const std::pair<std::string, std::string> cases[] = {
      {R"({"model":"feedback-large","messages":[{"role":"user","content":"x"}]})", "tenant"},
      {R"({"tenant":"acme","messages":[]})", "messages"},
      {R"({"tenant":"acme","messages":[{"role":"robot","content":"x"}]})", "unknown role"},
      {R"({"tenant":"acme","messages":[{"role":"user","content":3}]})", "content"},
      {R"({"tenant":"acme","messages":[{"role":"user","content":"x"}],"max_tokens":0})", "max_tokens"},
      {R"({"tenant":"acme","messages":[{"role":"user","content":"x"}],"max_tokens":99999})", "max_tokens"},
      {R"({"tenant":"acme","messages":[{"role":"user","content":"x"}],"stream":"yes"})", "stream"},
      {R"({"tenant":"acme","model":"gpt-9","messages":[{"role":"user","content":"x"}]})", "unknown model"},
      {R"({"tenant":"acme","messages":[{"role":"user","content":"x"}]} trailing)", ""},
  };
  for (const auto& [body, rule] : cases) {
    INFO(body);
    gateway::recording_sink sink;
    const gateway::reply r = core->chat_completions(body, &sink);
    CHECK(r.status == 400);
    CHECK(sink.sends() == 0);
    CHECK(json::parse(r.body)["error"]["message"].get<std::string>().find(rule) != std::string::npos);
  }
  CHECK(core->provider().figures().streams == 0);
}
