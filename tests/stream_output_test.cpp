// Model output beyond content (keel/compose/tool_calls.hpp, keel/provider/sse.hpp,
// keel/compose/stream.hpp): tool-call deltas and refusals as OpenAI streams
// them, byte for byte; their place in the stream policy (commit point, stall
// clock, count, hand-over, partial answers) on the manual clock; error
// objects read by meaning; the byte order mark.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "keel/compose/pipeline.hpp"
#include "keel/compose/stream.hpp"
#include "keel/compose/tool_calls.hpp"
#include "keel/core/call.hpp"
#include "keel/core/outcome.hpp"
#include "keel/policy/retry.hpp"
#include "keel/provider/sse.hpp"
#include "keel/testing/manual_clock.hpp"
#include "keel/testing/scripted_stream.hpp"
#include "support/alloc_counter.hpp"
#include "support/catch.hpp"
#include "support/sse_server.hpp"

using namespace std::chrono_literals;
using keel::testing::end;
using keel::testing::manual_clock;
using keel::testing::tok;

namespace {

std::string join(const std::vector<std::string>& events) {
  std::string s;
  for (const std::string& e : events) s += e;
  return s;
}

// What a parse saw, copied out of the callbacks.
struct read_back {
  std::vector<keel::chunk_kind> kinds;
  std::vector<keel::tool_call> fragments;  // each fragment, owned
  keel::tool_call_assembler calls;
  std::string text, refusal;
  absl::Status status;
};

read_back read_in_pieces(std::string_view body, std::size_t piece) {
  keel::sse_parser p;
  read_back out;
  auto on = [&](const keel::chat_chunk& c) {
    out.kinds.push_back(c.kind);
    if (c.kind == keel::chunk_kind::content) out.text.append(c.text);
    out.refusal.append(c.refusal);
    for (const keel::tool_call_delta& d : c.tool_calls) {
      out.fragments.push_back({.index = d.index,
                               .id = std::string(d.id),
                               .type = std::string(d.type),
                               .name = std::string(d.name),
                               .arguments = std::string(d.arguments)});
      out.calls.add(d);
    }
    return true;
  };
  for (std::size_t i = 0; i < body.size() && out.status.ok(); i += piece) out.status = p.feed(body.substr(i, piece), on);
  return out;
}

long count(const std::vector<keel::chunk_kind>& kinds, keel::chunk_kind k) {
  return std::count(kinds.begin(), kinds.end(), k);
}

}  // namespace

// --- the parser ---------------------------------------------------------------

TEST_CASE("sse: tool-call deltas are model output: OpenAI's stream of one call, arguments in five fragments",
          "[stream][sse][tools]") {
  const std::string body = join(keel_test::sse_server::tool_call_events());
  const std::size_t piece = GENERATE(1, 2, 7, 64, 100000);
  const read_back r = read_in_pieces(body, piece);
  REQUIRE(r.status.ok());
  CHECK(count(r.kinds, keel::chunk_kind::tool_call) == 6);  // the first chunk (id, name) and five fragments
  CHECK(count(r.kinds, keel::chunk_kind::empty) == 1);      // finish_reason "tool_calls" alone
  CHECK(count(r.kinds, keel::chunk_kind::done) == 1);
  CHECK(r.text.empty());
  REQUIRE(r.fragments.size() == 6);
  CHECK(r.fragments[0].id == "call_DdmO9pD3xa9XTPNJ32zg2hcA");
  CHECK(r.fragments[0].type == "function");
  CHECK(r.fragments[0].name == "get_weather");
  CHECK(r.fragments[0].arguments.empty());
  CHECK(r.fragments[1].arguments == "{\"");  // unescaped
  CHECK(r.fragments[3].arguments == "Paris, France");
  CHECK(r.fragments[5].id.empty());
  REQUIRE(r.calls.calls().size() == 1);
  const keel::tool_call& call = r.calls.calls()[0];
  CHECK(call.index == 0);
  CHECK(call.id == "call_DdmO9pD3xa9XTPNJ32zg2hcA");
  CHECK(call.name == "get_weather");
  CHECK(call.type == "function");
  CHECK(call.arguments == R"({"location":"Paris, France","unit":"celsius"})");

  // The shape cache reads argument fragments as it reads content: the first
  // plain fragment in full, the four after it from the cached bytes.
  keel::sse_parser p;
  REQUIRE(p.feed(body, [](const keel::chat_chunk&) { return true; }).ok());
  CHECK(p.shape_cache_hits() == 4);
}

TEST_CASE("sse: two tool calls interleaving by index are put back together apart", "[stream][sse][tools]") {
  const std::string head =
      R"(data: {"id":"chatcmpl-9pc","object":"chat.completion.chunk","created":1733550000,"model":"gpt-4o-2024-08-06","choices":[{"index":0,"delta":)";
  const std::string tail = R"(,"logprobs":null,"finish_reason":null}]})"
                           "\n\n";
  auto frag = [&](int index, const std::string& args) {
    return head + R"({"tool_calls":[{"index":)" + std::to_string(index) + R"(,"function":{"arguments":")" + args +
           R"("}}]})" + tail;
  };
  const std::string body =
      head + R"({"role":"assistant","content":null,"tool_calls":[{"index":0,"id":"call_a","type":"function","function":{"name":"get_weather","arguments":""}}]})" + tail +
      frag(0, R"({\"city\")") +
      head + R"({"tool_calls":[{"index":1,"id":"call_b","type":"function","function":{"name":"get_time","arguments":"{\"tz\""}}]})" + tail +
      frag(0, R"(:\"Paris\"})") + frag(1, R"(:\"Europe/Paris\"})") +
      R"(data: {"id":"chatcmpl-9pc","object":"chat.completion.chunk","created":1733550000,"model":"gpt-4o-2024-08-06","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"tool_calls"}]})"
      "\n\ndata: [DONE]\n\n";
  const read_back r = read_in_pieces(body, GENERATE(3, 100000));
  REQUIRE(r.status.ok());
  CHECK(count(r.kinds, keel::chunk_kind::tool_call) == 5);
  const std::vector<keel::tool_call> want{
      {.index = 0, .id = "call_a", .type = "function", .name = "get_weather", .arguments = R"({"city":"Paris"})"},
      {.index = 1, .id = "call_b", .type = "function", .name = "get_time", .arguments = R"({"tz":"Europe/Paris"})"}};
  CHECK(r.calls.calls() == want);

  // Started out of index order, the assembler still keeps them by index.
  keel::tool_call_assembler a;
  a.add({.index = 1, .id = "call_b", .name = "second"});
  a.add({.index = 0, .id = "call_a", .name = "first"});
  a.add({.index = 1, .arguments = "{}"});
  REQUIRE(a.calls().size() == 2);
  CHECK(a.calls()[0].name == "first");
  CHECK(a.calls()[1].arguments == "{}");
  const std::vector<keel::tool_call> taken = a.take();
  CHECK(taken.size() == 2);
  CHECK(a.empty());
}

TEST_CASE("sse: delta.refusal is its own kind with its text, never empty", "[stream][sse][refusal]") {
  const read_back r = read_in_pieces(join(keel_test::sse_server::refusal_events()), GENERATE(5, 100000));
  REQUIRE(r.status.ok());
  CHECK(count(r.kinds, keel::chunk_kind::refusal) == 2);
  CHECK(count(r.kinds, keel::chunk_kind::role) == 1);  // "refusal": "" on the role chunk is no refusal
  CHECK(r.refusal == "I'm sorry, I can't help with that.");
  CHECK(r.text.empty());
}

TEST_CASE("sse: tool-call fragments cost no allocation each once the buffers have grown",
          "[stream][sse][tools][alloc]") {
  if (!keel_test::allocations_counted()) {
    SUCCEED("allocation counting is off in this build");
    return;
  }
  const std::vector<std::string> events = keel_test::sse_server::tool_call_events();
  std::string body = events[0];
  for (int i = 0; i < 300; ++i) body += events[1 + i % 5];
  keel::sse_parser p;
  std::size_t bytes = 0;
  auto on = [&](const keel::chat_chunk& c) {
    for (const keel::tool_call_delta& d : c.tool_calls) bytes += d.arguments.size();
    return true;
  };
  const std::size_t warm = body.size() / 4;
  for (std::size_t i = 0; i < warm; i += 53) REQUIRE(p.feed(std::string_view(body).substr(i, 53), on).ok());
  keel_test::count_allocations allocations;
  for (std::size_t i = warm / 53 * 53 + 53; i < body.size(); i += 53)
    REQUIRE(p.feed(std::string_view(body).substr(i, 53), on).ok());
  CHECK(allocations.count() == 0);
  CHECK(bytes > 0);
}

TEST_CASE("sse: a UTF-8 byte order mark at the stream's start is skipped, wherever the read ends",
          "[stream][sse][bom]") {
  const std::string body = "\xEF\xBB\xBF" "data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\ndata: [DONE]\n\n";
  for (std::size_t piece = 1; piece <= 5; ++piece) {
    const read_back r = read_in_pieces(body, piece);
    REQUIRE(r.status.ok());
    CHECK(r.text == "Hi");
    CHECK(count(r.kinds, keel::chunk_kind::content) == 1);
  }
  // Only at the start: after it, the bytes are the stream's (an unknown field here).
  const read_back later = read_in_pieces(
      "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n\xEF\xBB\xBF"
      "data: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\n\n",
      100000);
  CHECK(later.text == "a");
  // A stream that starts with part of one is not a BOM: its bytes stay.
  const read_back partial = read_in_pieces("\xEF\xBB" "data: {}\n\n", 1);
  CHECK(partial.kinds.empty());
}

TEST_CASE("sse: error objects mid-stream are read by what they mean (docs/streaming.md)", "[stream][sse][errors]") {
  struct row {
    const char* who;
    std::string event;
    absl::StatusCode code;
    keel::outcome_kind kind;
  };
  const std::vector<row> table{
      {"OpenAI rate limit (tokens)",
       R"(data: {"error":{"message":"Rate limit reached for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000, Used 29000, Requested 1500.","type":"tokens","param":null,"code":"rate_limit_exceeded"}})",
       absl::StatusCode::kResourceExhausted, keel::outcome_kind::throttled},
      {"OpenAI rate limit (requests)",
       R"(data: {"error":{"message":"Rate limit reached for requests","type":"requests","param":null,"code":"rate_limit_exceeded"}})",
       absl::StatusCode::kResourceExhausted, keel::outcome_kind::throttled},
      {"OpenAI insufficient_quota",
       R"(data: {"error":{"message":"You exceeded your current quota, please check your plan and billing details.","type":"insufficient_quota","param":null,"code":"insufficient_quota"}})",
       absl::StatusCode::kResourceExhausted, keel::outcome_kind::permanent},
      {"OpenAI server_error",
       R"(data: {"error":{"message":"The server had an error while processing your request. Sorry about that!","type":"server_error","param":null,"code":null}})",
       absl::StatusCode::kUnavailable, keel::outcome_kind::transient},
      {"OpenAI context_length_exceeded",
       R"(data: {"error":{"message":"This model's maximum context length is 128000 tokens.","type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}})",
       absl::StatusCode::kInvalidArgument, keel::outcome_kind::permanent},
      {"Azure OpenAI content filter",
       R"(data: {"error":{"message":"The response was filtered due to the prompt triggering Azure OpenAI's content management policy.","type":null,"param":"prompt","code":"content_filter","status":400,"innererror":{"code":"ResponsibleAIPolicyViolation","content_filter_result":{"hate":{"filtered":true,"severity":"high"}}}}})",
       absl::StatusCode::kInvalidArgument, keel::outcome_kind::permanent},
      {"vLLM",
       R"(data: {"error":{"object":"error","message":"This model's maximum context length is 4096 tokens.","type":"BadRequestError","param":null,"code":400}})",
       absl::StatusCode::kInvalidArgument, keel::outcome_kind::permanent},
      {"llama.cpp server",
       R"(data: {"error":{"code":400,"message":"the request exceeds the available context size, try increasing it","type":"exceed_context_size_error","n_prompt_tokens":5000,"n_ctx":4096}})",
       absl::StatusCode::kInvalidArgument, keel::outcome_kind::permanent},
      {"llama.cpp server, loading",
       R"(data: {"error":{"code":503,"message":"Loading model","type":"unavailable_error"}})",
       absl::StatusCode::kUnavailable, keel::outcome_kind::transient},
      {"Anthropic-style event: error",
       "event: error\n" R"(data: {"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}})",
       absl::StatusCode::kUnavailable, keel::outcome_kind::transient},
      {"Anthropic-style rate limit",
       "event: error\n" R"(data: {"type":"error","error":{"type":"rate_limit_error","message":"Number of request tokens has exceeded your per-minute rate limit"}})",
       absl::StatusCode::kResourceExhausted, keel::outcome_kind::throttled},
  };
  for (const row& r : table) {
    INFO(r.who);
    keel::sse_parser p;
    std::optional<absl::Status> status;
    std::int64_t code = -2;
    REQUIRE(p.feed(r.event + "\n\n",
                   [&](const keel::chat_chunk& c) {
                     REQUIRE(c.kind == keel::chunk_kind::error);
                     status = keel::error_status(c);
                     code = c.error_code;
                     return true;
                   })
                .ok());
    REQUIRE(status.has_value());
    CHECK(status->code() == r.code);
    CHECK(keel::default_classifier{}(*status, {}) == r.kind);
    CHECK(code >= 0);
  }
  // "code": null is the documented "no numeric code": 0.
  keel::sse_parser p;
  std::int64_t code = -2;
  REQUIRE(p.feed("data: {\"error\":{\"message\":\"x\",\"type\":\"server_error\",\"code\":null}}\n\n",
                 [&](const keel::chat_chunk& c) {
                   code = c.error_code;
                   return true;
                 })
              .ok());
  CHECK(code == 0);
}

// --- the stream policy, on the manual clock -----------------------------------

namespace {

template <class Done>
void wait_for(Done done) {
  const auto give_up = std::chrono::steady_clock::now() + 60s;
  while (!done()) {
    if (std::chrono::steady_clock::now() > give_up) FAIL("gave up waiting (60 s of real time)");
    std::this_thread::sleep_for(1ms);
  }
}

// What a caller that takes events saw, owned.
struct seen_event {
  keel::stream_event_kind kind;
  std::string content, refusal, arguments, name;
  std::size_t fragments;
};

// One call's stream, its caller taking events, run on its own thread while the test moves the clock.
template <class Guard, class Pipe, class Provider>
struct event_run {
  std::vector<seen_event> events;
  std::atomic<int> seen{0};
  keel::call call;
  keel::token_stream<Guard, std::function<void(const keel::stream_event&)>> stream;
  std::optional<absl::StatusOr<keel::stream_result>> result;
  std::jthread thread;

  event_run(Guard& g, const Pipe& pipe, Provider& provider, keel::call_options o)
      : call(g.timer().now(), o), stream(g, [this](const keel::stream_event& e) {
          seen_event s{e.kind, std::string(e.content), std::string(e.refusal), {}, {}, e.tool_calls.size()};
          for (const keel::tool_call_delta& d : e.tool_calls) {
            s.arguments += d.arguments;
            s.name += d.name;
          }
          events.push_back(std::move(s));
          seen.fetch_add(1);
        }) {
    thread = std::jthread([this, &pipe, &provider] { result.emplace(pipe.run(call, stream.attempts(provider))); });
  }
  absl::StatusOr<keel::stream_result>& get() {
    thread.join();
    return *result;
  }
};

template <class Guard, class Pipe, class Provider>
event_run(Guard&, const Pipe&, Provider&, keel::call_options) -> event_run<Guard, Pipe, Provider>;

const keel::stream_options budgets{.first_token = 2s, .stall = 1s, .whole = 30s};

}  // namespace

TEST_CASE("stream: tool-call deltas alone commit the stream, keep its stall clock fresh, are counted and handed over",
          "[stream][policy][tools]") {
  manual_clock clock;
  keel::deadline_timer guard_timer{clock};
  keel::stream_guard guard(budgets, guard_timer);
  using keel::testing::tool;
  // The first fragment at 1.5 s (inside the 2 s first-token budget), the
  // rest 800 ms apart (inside the 1 s stall budget): 4.7 s in all.
  keel::testing::scripted_stream provider(
      clock, {{tool(0, "", "call_1", "get_weather", 1500ms), tool(0, "{\"city\":", {}, {}, 800ms),
               tool(0, "\"Pa", {}, {}, 800ms), tool(0, "ris\"", {}, {}, 800ms), tool(0, "}", {}, {}, 800ms), end()}});
  const auto pipe = keel::pipeline(keel::retry({.max_attempts = 1})).in(keel::environment{clock});
  event_run run(guard, pipe, provider, {.timeout = 60s});
  clock.await_sleepers(2);
  clock.advance(1500ms);
  for (int i = 1; i < 5; ++i) {
    wait_for([&] { return run.seen.load() == i; });
    clock.await_sleepers(2);
    clock.advance(800ms);
  }
  auto& r = run.get();
  REQUIRE(r.ok());
  CHECK(r->complete);
  CHECK_FALSE(r->partial);
  CHECK(r->text.empty());
  CHECK(r->tokens == 5);
  CHECK(r->time_to_first_token == 1500ms);
  CHECK(r->longest_gap == 800ms);
  REQUIRE(r->tool_calls.size() == 1);
  CHECK(r->tool_calls[0].id == "call_1");
  CHECK(r->tool_calls[0].name == "get_weather");
  CHECK(r->tool_calls[0].arguments == "{\"city\":\"Paris\"}");
  REQUIRE(run.events.size() == 5);
  for (const seen_event& e : run.events) {
    CHECK(e.kind == keel::stream_event_kind::tool_call);
    CHECK(e.fragments == 1);
  }
  CHECK(run.events[0].name == "get_weather");
  CHECK(run.events[2].arguments == "\"Pa");
  CHECK(guard.figures().committed == 1);
  CHECK(guard.figures().first_token_timeouts == 0);
  CHECK(guard.figures().stalls == 0);
}

TEST_CASE("stream: a stream broken inside a tool call's arguments is partial and never continued as text",
          "[stream][policy][tools]") {
  manual_clock clock;
  keel::deadline_timer guard_timer{clock};
  keel::stream_guard guard(budgets, guard_timer);
  using keel::testing::tool;
  keel::testing::scripted_stream provider(
      clock, {{tok("Let me look.", 100ms), tool(0, "", "call_1", "get_weather"), tool(0, "{\"city\":\"Pa", {}, {}, 100ms),
               end(absl::UnavailableError("connection cut"), 100ms)}});
  keel::testing::scripted_stream rest(clock, {{tok("ris\"}"), end()}});
  const auto pipe = keel::pipeline(keel::retry({.max_attempts = 3})).in(keel::environment{clock});
  keel::call call(clock.now(), {.timeout = 60s});
  keel::token_stream stream(guard, [](std::string_view) {});
  std::optional<absl::StatusOr<keel::stream_result>> result;
  std::jthread t([&] { result.emplace(pipe.run(call, stream.attempts(provider))); });
  clock.await_sleepers(2);
  clock.advance(100ms);
  clock.await_sleepers(2);
  clock.advance(100ms);
  clock.await_sleepers(2);
  clock.advance(100ms);
  t.join();
  auto& r = *result;
  REQUIRE(r.ok());
  CHECK(r->partial);
  CHECK(r->reason == keel::stream_stop::failed);
  CHECK(r->in_tool_call);
  CHECK_FALSE(r->continuable);  // Unavailable alone would be continuable
  CHECK(r->text == "Let me look.");
  REQUIRE(r->tool_calls.size() == 1);
  CHECK(r->tool_calls[0].arguments == "{\"city\":\"Pa");
  const keel::stream_result after = stream.resume(call, pipe, rest, *r);
  CHECK(rest.invocations() == 0);  // not continued
  CHECK(after.text == "Let me look.");
  CHECK_FALSE(after.degraded);

  // Broken after the call was finished (content after it), it is continuable as usual.
  keel::testing::scripted_stream later(
      clock, {{tool(0, "{}", "call_1", "f", 100ms), tok("done"), end(absl::UnavailableError("cut"), 100ms)}});
  keel::call call2(clock.now(), {.timeout = 60s});
  std::jthread t2([&] { result.emplace(pipe.run(call2, stream.attempts(later))); });
  clock.await_sleepers(2);
  clock.advance(100ms);
  clock.await_sleepers(2);
  clock.advance(100ms);
  t2.join();
  REQUIRE(result->ok());
  CHECK((*result)->partial);
  CHECK_FALSE((*result)->in_tool_call);
  CHECK((*result)->continuable);
}

TEST_CASE("stream: a refusal-only stream commits; its answer is the refusal, not an empty one",
          "[stream][policy][refusal]") {
  manual_clock clock;
  keel::deadline_timer guard_timer{clock};
  keel::stream_guard guard(budgets, guard_timer);
  keel::testing::scripted_stream provider(
      clock, {{keel::testing::refusal("I'm sorry", 1500ms), keel::testing::refusal(", I can't.", 800ms), end()}});
  const auto pipe = keel::pipeline(keel::retry({.max_attempts = 1})).in(keel::environment{clock});
  event_run run(guard, pipe, provider, {.timeout = 60s});
  clock.await_sleepers(2);
  clock.advance(1500ms);
  wait_for([&] { return run.seen.load() == 1; });
  clock.await_sleepers(2);
  clock.advance(800ms);
  auto& r = run.get();
  REQUIRE(r.ok());
  CHECK(r->complete);
  CHECK(r->refusal == "I'm sorry, I can't.");
  CHECK(r->text.empty());
  CHECK(r->tokens == 2);
  CHECK(r->time_to_first_token == 1500ms);
  REQUIRE(run.events.size() == 2);
  CHECK(run.events[0].kind == keel::stream_event_kind::refusal);
  CHECK(run.events[1].refusal == ", I can't.");
  CHECK(guard.figures().committed == 1);
}
