// The mock OpenAI-compatible upstream (examples/mock_upstream/) as a real
// child process on a free port: its answers checked on the wire (libcurl,
// raw bytes) and through keel's own HTTP client (keel::http::client and its
// SSE stream reader), which is what the gateway will put in front of it;
// every fault kind as keel classifies it; the control API; the command line.
// Real clock: waits are bounded polls on a condition, never a sleep that hopes.
#include <curl/curl.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "keel/compose/pipeline.hpp"
#include "keel/compose/stream.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/outcome.hpp"
#include "keel/core/status.hpp"
#include "keel/policy/backoff.hpp"
#include "keel/policy/retry.hpp"
#include "keel/provider/http.hpp"
#include "support/catch.hpp"
#include "support/child_process.hpp"
#include "support/child_program.hpp"
#include "support/mock_upstream.hpp"

using namespace std::chrono_literals;
using json = nlohmann::json;
namespace http = keel::http;

namespace {

// Fast enough for tests, slow enough that timing faults are visible.
const std::vector<std::string> quick = {"--latency-ms", "5", "--first-token-ms", "5", "--token-gap-ms", "2",
                                        "--tokens", "8", "--threads", "64"};

// ---- raw HTTP through libcurl: the bytes as sent ----

struct raw_response {
  CURLcode rc = CURLE_OK;
  long status = 0;
  std::string headers;  // lower-cased names
  std::string body;
  [[nodiscard]] std::string header(const std::string& name) const {
    const std::string key = "\n" + name + ":";
    const std::size_t at = ("\n" + headers).find(key);
    if (at == std::string::npos) return "";
    std::size_t from = at + key.size() - 1;
    while (from < headers.size() && headers[from] == ' ') ++from;
    const std::size_t end = headers.find_first_of("\r\n", from);
    return headers.substr(from, end - from);
  }
};

std::size_t append(char* p, std::size_t size, std::size_t n, void* out) {
  static_cast<std::string*>(out)->append(p, size * n);
  return size * n;
}
std::size_t append_lower(char* p, std::size_t size, std::size_t n, void* out) {
  std::string s(p, size * n);
  const std::size_t colon = s.find(':');
  for (std::size_t i = 0; i < colon && colon != std::string::npos; ++i)
    s[i] = static_cast<char>(std::tolower(static_cast<unsigned char>(s[i])));
  static_cast<std::string*>(out)->append(s);
  return size * n;
}

int abort_when_set(void* flag, curl_off_t, curl_off_t, curl_off_t, curl_off_t) {
  return static_cast<std::atomic<bool>*>(flag)->load() ? 1 : 0;
}

// One request; `abort` (when given) ends the transfer once it is set.
raw_response raw(const keel_test::mock_upstream_process& mock, const std::string& path, const std::string& body = "",
                 long timeout_ms = 10000, std::atomic<bool>* abort = nullptr) {
  raw_response r;
  CURL* c = curl_easy_init();
  if (abort != nullptr) {
    curl_easy_setopt(c, CURLOPT_XFERINFOFUNCTION, abort_when_set);
    curl_easy_setopt(c, CURLOPT_XFERINFODATA, abort);
    curl_easy_setopt(c, CURLOPT_NOPROGRESS, 0L);
  }
  const std::string url = mock.url() + path;
  curl_easy_setopt(c, CURLOPT_URL, url.c_str());
  curl_slist* h = curl_slist_append(nullptr, "Content-Type: application/json");
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
  if (!body.empty()) curl_easy_setopt(c, CURLOPT_POSTFIELDS, body.c_str());
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, append);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, &r.body);
  curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, append_lower);
  curl_easy_setopt(c, CURLOPT_HEADERDATA, &r.headers);
  curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, timeout_ms);
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  r.rc = curl_easy_perform(c);
  curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &r.status);
  curl_slist_free_all(h);
  curl_easy_cleanup(c);
  return r;
}

// The JSON of each `data:` event of an SSE body, and whether it ended with [DONE].
struct sse_events {
  std::vector<json> events;
  bool done = false;
  std::vector<std::string> raw_data;
};
sse_events parse_sse(const std::string& body) {
  sse_events out;
  std::size_t at = 0;
  while (at < body.size()) {
    const std::size_t end = body.find("\n\n", at);
    if (end == std::string::npos) break;
    const std::string ev = body.substr(at, end - at);
    at = end + 2;
    if (ev.rfind("data: ", 0) != 0) continue;
    const std::string data = ev.substr(6);
    out.raw_data.push_back(data);
    if (data == "[DONE]") {
      out.done = true;
      continue;
    }
    out.events.push_back(json::parse(data));
  }
  return out;
}

std::string chat_body(const std::string& prompt, bool stream, json extra = json::object()) {
  json b = {{"model", "mock-small"}, {"messages", json::array({{{"role", "user"}, {"content", prompt}}})}};
  if (stream) b["stream"] = true;
  for (auto& [k, v] : extra.items()) b[k] = v;
  return b.dump();
}

json weather_tools() {
  return json::array(
      {{{"type", "function"},
        {"function",
         {{"name", "get_weather"},
          {"parameters",
           {{"type", "object"},
            {"properties", {{"city", {{"type", "string"}}}, {"days", {{"type", "integer"}}},
                            {"unit", {{"type", "string"}, {"enum", {"celsius", "fahrenheit"}}}}}}}}}}},
       {{"type", "function"},
        {"function", {{"name", "get_time"}, {"parameters", {{"type", "object"}, {"properties", {{"zone", {{"type", "string"}}}}}}}}}}});
}

// ---- keel's client ----

// One attempt (no retry): the status as keel's client classifies it.
absl::StatusOr<std::string> exchange(http::client& client, const std::string& path, const std::string& body,
                                     keel::duration timeout = 10s, keel::operation op = {}) {
  keel::call call(keel::real_clock{}.now(), {.timeout = timeout, .operation = op, .max_attempts = 1});
  auto provider = client.exchange({.path = path, .body = body},
                                  [](const http::response& r) -> absl::StatusOr<std::string> { return std::string(r.body); });
  return keel::pipeline(keel::retry({.max_attempts = 1})).run(call, provider);
}

struct streamed {
  absl::StatusOr<keel::stream_result> result{absl::UnknownError("not run")};
  std::string shown;
  keel::duration took{};
  std::chrono::system_clock::time_point returned{};
};

streamed stream_once(http::client& client, const std::string& body, const keel::stream_options& o,
                     std::atomic<int>* seen = nullptr, keel::duration timeout = 20s) {
  keel::stream_guard guard(o);
  streamed out;
  keel::call call(keel::real_clock{}.now(), {.timeout = timeout, .max_attempts = 1});
  keel::token_stream stream(guard, [&](std::string_view t) {
    out.shown.append(t);
    if (seen != nullptr) seen->fetch_add(1);
  });
  auto provider = client.stream({.path = "/v1/chat/completions", .body = body});
  const auto pipe = keel::pipeline(keel::retry({.max_attempts = 1}, keel::constant_backoff{.delay_each = 1ms}));
  const auto start = std::chrono::steady_clock::now();
  out.result = pipe.run(call, stream.attempts(provider));
  out.took = std::chrono::steady_clock::now() - start;
  out.returned = std::chrono::system_clock::now();
  return out;
}

keel::outcome_kind kind_of(const absl::Status& s, keel::operation op = {}) { return keel::default_classifier{}(s, op); }

// Polls (real time) until `done` holds or `limit` passed; whether it held.
template <class Done>
bool wait_until(Done done, std::chrono::milliseconds limit = 10s) {
  const auto give_up = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() > give_up) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

std::int64_t unix_ms(std::chrono::system_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count();
}

std::vector<float> decode_base64_floats(const std::string& s) {
  auto val = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    return c == '+' ? 62 : c == '/' ? 63 : -1;
  };
  std::string bytes;
  int buf = 0, bits = 0;
  for (char c : s) {
    const int v = val(c);
    if (v < 0) break;
    buf = (buf << 6) | v;
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      bytes += static_cast<char>((buf >> bits) & 0xff);
    }
  }
  std::vector<float> out(bytes.size() / 4);
  std::memcpy(out.data(), bytes.data(), out.size() * 4);  // little-endian hosts, as the mock sends
  return out;
}

}  // namespace

TEST_CASE("mock upstream: a non-streamed chat completion has OpenAI's shape", "[upstream]") {
  keel_test::mock_upstream_process mock(quick);
  CHECK(mock.line() == "mock_upstream mock listening on 127.0.0.1:" + std::to_string(mock.port()));
  const raw_response r = raw(mock, "/v1/chat/completions", chat_body("Explain deadlines.", false));
  REQUIRE(r.rc == CURLE_OK);
  CHECK(r.status == 200);
  CHECK(r.header("content-type") == "application/json");
  CHECK(r.header("x-request-id").rfind("req_", 0) == 0);
  const json j = json::parse(r.body);
  CHECK(j["id"].get<std::string>().rfind("chatcmpl-", 0) == 0);
  CHECK(j["object"] == "chat.completion");
  CHECK(j["created"].is_number_integer());
  CHECK(j["model"] == "mock-small");
  CHECK(j["choices"][0]["message"]["role"] == "assistant");
  CHECK(j["choices"][0]["finish_reason"] == "stop");
  const std::string content = j["choices"][0]["message"]["content"];
  CHECK(!content.empty());
  CHECK(j["usage"]["completion_tokens"] == 8);
  CHECK(j["usage"]["total_tokens"] == j["usage"]["prompt_tokens"].get<int>() + 8);
  // Deterministic: the same prompt, the same text.
  CHECK(json::parse(raw(mock, "/v1/chat/completions", chat_body("Explain deadlines.", false)).body)["choices"][0]
            ["message"]["content"] == content);
  // max_tokens caps it.
  const json capped =
      json::parse(raw(mock, "/v1/chat/completions", chat_body("Explain deadlines.", false, {{"max_tokens", 3}})).body);
  CHECK(capped["choices"][0]["finish_reason"] == "length");
  CHECK(capped["usage"]["completion_tokens"] == 3);
  // Through keel's client.
  http::client client({.base_url = mock.url()});
  absl::StatusOr<std::string> via_keel = exchange(client, "/v1/chat/completions", chat_body("Explain deadlines.", false));
  REQUIRE(via_keel.ok());
  CHECK(json::parse(*via_keel)["choices"][0]["message"]["content"] == content);
  // A request without a model is OpenAI's 400.
  const raw_response bad = raw(mock, "/v1/chat/completions", R"({"messages":[{"role":"user","content":"x"}]})");
  CHECK(bad.status == 400);
  CHECK(json::parse(bad.body)["error"]["type"] == "invalid_request_error");
  CHECK(mock.terminate() == 0);
}

TEST_CASE("mock upstream: a streamed chat completion: role first, a token per chunk, usage, [DONE]", "[upstream]") {
  keel_test::mock_upstream_process mock(quick);
  const std::string prompt = "Explain deadlines.";
  const raw_response r = raw(mock, "/v1/chat/completions",
                             chat_body(prompt, true, {{"stream_options", {{"include_usage", true}}}}));
  REQUIRE(r.rc == CURLE_OK);
  CHECK(r.header("content-type").rfind("text/event-stream", 0) == 0);
  const sse_events s = parse_sse(r.body);
  CHECK(s.done);
  CHECK(s.raw_data.back() == "[DONE]");
  REQUIRE(s.events.size() == 1 + 8 + 1 + 1);  // role, 8 tokens, finish, usage
  CHECK(s.events[0]["choices"][0]["delta"]["role"] == "assistant");
  std::string text;
  for (std::size_t i = 1; i <= 8; ++i) {
    CHECK(s.events[i]["object"] == "chat.completion.chunk");
    text += s.events[i]["choices"][0]["delta"]["content"].get<std::string>();
  }
  CHECK(s.events[9]["choices"][0]["finish_reason"] == "stop");
  CHECK(s.events[10]["choices"].empty());
  CHECK(s.events[10]["usage"]["completion_tokens"] == 8);
  const json whole = json::parse(raw(mock, "/v1/chat/completions", chat_body(prompt, false)).body);
  CHECK(text == whole["choices"][0]["message"]["content"]);
  // Without include_usage, no usage chunk.
  const sse_events plain = parse_sse(raw(mock, "/v1/chat/completions", chat_body(prompt, true)).body);
  CHECK(plain.events.size() == 10);
  CHECK(plain.done);

  // Through keel's SSE reader: the same tokens, complete, with the usage.
  http::client client({.base_url = mock.url()});
  const streamed st = stream_once(client, chat_body(prompt, true, {{"stream_options", {{"include_usage", true}}}}),
                                  {.first_token = 5s, .stall = 5s});
  REQUIRE(st.result.ok());
  CHECK(st.result->complete);
  CHECK(st.result->text == text);
  CHECK(st.result->tokens == 8);
  CHECK(st.result->usage.completion_tokens == 8);
  const json stats = mock.stats();
  CHECK(stats["chat"]["streams_completed"] == 3);
  // The stream's work ends when the server drops its response, just after [DONE] went out.
  CHECK(wait_until([&] { return mock.stats()["in_flight"] == 0; }));
}

TEST_CASE("mock upstream: json_object answers the gateway's feedback contract", "[upstream]") {
  keel_test::mock_upstream_process mock(quick);
  const std::string prompt(100, 'x');  // score = min(10, 3 + 100 / 40) = 5
  const json rf = {{"response_format", {{"type", "json_object"}}}};
  const json j = json::parse(raw(mock, "/v1/chat/completions", chat_body(prompt, false, rf)).body);
  const json content = json::parse(j["choices"][0]["message"]["content"].get<std::string>());
  CHECK(content["score"] == 5);
  CHECK(content["feedback"] == "Clear structure; give one concrete example and expand the trade-offs.");
  const json high = json::parse(json::parse(raw(mock, "/v1/chat/completions", chat_body(std::string(400, 'y'), false, rf)).body)
                                    ["choices"][0]["message"]["content"].get<std::string>());
  CHECK(high["score"] == 10);
  // Streamed, the pieces join to the same JSON.
  const sse_events s = parse_sse(raw(mock, "/v1/chat/completions", chat_body(prompt, true, rf)).body);
  std::string joined;
  for (const json& e : s.events)
    if (!e["choices"].empty() && e["choices"][0]["delta"].contains("content") && e["choices"][0]["delta"]["content"].is_string())
      joined += e["choices"][0]["delta"]["content"].get<std::string>();
  CHECK(json::parse(joined) == content);
}

TEST_CASE("mock upstream: tool calls, whole and streamed in fragments", "[upstream]") {
  keel_test::mock_upstream_process mock(quick);
  const json tools = {{"tools", weather_tools()}};
  SECTION("non-streamed: tool_calls, content null, finish_reason tool_calls") {
    const json j = json::parse(raw(mock, "/v1/chat/completions", chat_body("Weather in Oslo?", false, tools)).body);
    const json& m = j["choices"][0]["message"];
    CHECK(m["content"].is_null());
    CHECK(j["choices"][0]["finish_reason"] == "tool_calls");
    REQUIRE(m["tool_calls"].size() == 1);
    CHECK(m["tool_calls"][0]["id"].get<std::string>().rfind("call_", 0) == 0);
    CHECK(m["tool_calls"][0]["type"] == "function");
    CHECK(m["tool_calls"][0]["function"]["name"] == "get_weather");
    const json args = json::parse(m["tool_calls"][0]["function"]["arguments"].get<std::string>());
    CHECK(args["city"].is_string());
    CHECK(args["days"].is_number_integer());
    CHECK(args["unit"] == "celsius");
  }
  SECTION("streamed: id, type and name on the first fragment, the arguments in 5 or more pieces") {
    const sse_events s = parse_sse(raw(mock, "/v1/chat/completions", chat_body("Weather in Oslo?", true, tools)).body);
    CHECK(s.done);
    std::vector<json> calls;
    for (const json& e : s.events)
      if (!e["choices"].empty() && e["choices"][0]["delta"].contains("tool_calls"))
        calls.push_back(e["choices"][0]["delta"]["tool_calls"][0]);
    REQUIRE(calls.size() >= 6);
    CHECK(calls[0]["index"] == 0);
    CHECK(calls[0]["id"].get<std::string>().rfind("call_", 0) == 0);
    CHECK(calls[0]["type"] == "function");
    CHECK(calls[0]["function"]["name"] == "get_weather");
    CHECK(calls[0]["function"]["arguments"] == "");
    std::string args;
    for (std::size_t i = 1; i < calls.size(); ++i) {
      CHECK(calls[i]["index"] == 0);
      CHECK_FALSE(calls[i].contains("id"));
      args += calls[i]["function"]["arguments"].get<std::string>();
    }
    CHECK(calls.size() - 1 >= 5);
    const json parsed = json::parse(args);
    CHECK(parsed["unit"] == "celsius");
    CHECK(s.events[s.events.size() - 1]["choices"][0]["finish_reason"] == "tool_calls");
  }
  SECTION("two tools: both called, their fragments interleaved by index") {
    const sse_events s =
        parse_sse(raw(mock, "/v1/chat/completions", chat_body("Use two tools: weather and time.", true, tools)).body);
    std::vector<json> calls;
    for (const json& e : s.events)
      if (!e["choices"].empty() && e["choices"][0]["delta"].contains("tool_calls"))
        calls.push_back(e["choices"][0]["delta"]["tool_calls"][0]);
    std::string args[2];
    std::vector<int> order;
    for (const json& c : calls) {
      const int i = c["index"];
      REQUIRE((i == 0 || i == 1));
      if (c.contains("id")) {
        CHECK(c["function"]["name"] == (i == 0 ? "get_weather" : "get_time"));
        continue;
      }
      order.push_back(i);
      args[i] += c["function"]["arguments"].get<std::string>();
    }
    REQUIRE(order.size() >= 4);
    CHECK(order[0] != order[1]);  // interleaved, not one after the other
    CHECK(json::parse(args[0]).contains("city"));
    CHECK(json::parse(args[1]).contains("zone"));
  }
  SECTION("tool_choice none: a plain answer") {
    const json j = json::parse(raw(mock, "/v1/chat/completions",
                                   chat_body("Weather?", false, {{"tools", weather_tools()}, {"tool_choice", "none"}}))
                                   .body);
    CHECK(j["choices"][0]["message"]["content"].is_string());
    CHECK_FALSE(j["choices"][0]["message"].contains("tool_calls"));
  }
}

TEST_CASE("mock upstream: a refusal, whole and streamed", "[upstream]") {
  keel_test::mock_upstream_process mock(quick);
  const json j = json::parse(raw(mock, "/v1/chat/completions", chat_body("refuse: tell me a secret", false)).body);
  CHECK(j["choices"][0]["message"]["content"].is_null());
  const std::string refusal = j["choices"][0]["message"]["refusal"];
  CHECK(!refusal.empty());
  const sse_events s = parse_sse(raw(mock, "/v1/chat/completions", chat_body("refuse: tell me a secret", true)).body);
  std::string streamed_refusal;
  for (const json& e : s.events) {
    if (e["choices"].empty()) continue;
    const json& d = e["choices"][0]["delta"];
    CHECK_FALSE((d.contains("content") && d["content"].is_string() && !d["content"].get<std::string>().empty()));
    if (d.contains("refusal")) streamed_refusal += d["refusal"].get<std::string>();
  }
  CHECK(streamed_refusal == refusal);
  CHECK(s.done);
}

TEST_CASE("mock upstream: embeddings as floats and as base64 are the same vectors", "[upstream]") {
  keel_test::mock_upstream_process mock(quick);
  const raw_response f = raw(mock, "/v1/embeddings", R"({"model":"e","input":["alpha","beta"]})");
  REQUIRE(f.status == 200);
  CHECK(f.header("content-type") == "application/json");
  const json jf = json::parse(f.body);
  CHECK(jf["object"] == "list");
  REQUIRE(jf["data"].size() == 2);
  CHECK(jf["data"][0]["embedding"].size() == 8);
  CHECK(jf["usage"]["prompt_tokens"].get<int>() > 0);
  const json jb = json::parse(
      raw(mock, "/v1/embeddings", R"({"model":"e","input":["alpha","beta"],"encoding_format":"base64"})").body);
  for (int i = 0; i < 2; ++i) {
    const std::vector<float> decoded = decode_base64_floats(jb["data"][i]["embedding"].get<std::string>());
    REQUIRE(decoded.size() == 8);
    double norm = 0;
    for (std::size_t k = 0; k < 8; ++k) {
      CHECK(decoded[k] == static_cast<float>(jf["data"][i]["embedding"][k].get<double>()));
      norm += decoded[k] * decoded[k];
    }
    CHECK(std::abs(norm - 1.0) < 1e-4);
  }
  const json one = json::parse(raw(mock, "/v1/embeddings", R"({"model":"e","input":"alpha","dimensions":3})").body);
  CHECK(one["data"].size() == 1);
  CHECK(one["data"][0]["embedding"].size() == 3);
  CHECK(raw(mock, "/v1/embeddings", R"({"model":"e","input":[1,2]})").status == 400);
}

TEST_CASE("mock upstream: the models list, health, and an unknown path", "[upstream]") {
  keel_test::mock_upstream_process mock({"--models", "a,b,c"}, "vllm-a");
  const json j = json::parse(raw(mock, "/v1/models").body);
  CHECK(j["object"] == "list");
  REQUIRE(j["data"].size() == 3);
  CHECK(j["data"][1]["id"] == "b");
  CHECK(j["data"][1]["object"] == "model");
  CHECK(j["data"][1]["owned_by"] == "vllm-a");
  CHECK(raw(mock, "/healthz").body == R"({"status":"ok"})");
  const raw_response nf = raw(mock, "/v1/nope");
  CHECK(nf.status == 404);
  CHECK(json::parse(nf.body)["error"]["message"].is_string());
}

TEST_CASE("mock upstream: error faults as keel's client classifies them", "[upstream]") {
  keel_test::mock_upstream_process mock(quick);
  http::client client({.base_url = mock.url()});
  const std::string body = chat_body("hi", false);
  SECTION("outage: 503, transient") {
    REQUIRE(mock.set_fault(R"({"kind":"outage"})") == 200);
    const auto r = exchange(client, "/v1/chat/completions", body);
    REQUIRE_FALSE(r.ok());
    CHECK(absl::IsUnavailable(r.status()));
    CHECK(kind_of(r.status()) == keel::outcome_kind::transient);
    const raw_response w = raw(mock, "/v1/chat/completions", body);
    CHECK(w.status == 503);
    CHECK(json::parse(w.body)["error"]["type"] == "server_error");
  }
  SECTION("rate_limit: 429, throttled, with the retry-after hint keel reads") {
    REQUIRE(mock.set_fault(R"({"kind":"rate_limit","retry_after_ms":250})") == 200);
    const auto r = exchange(client, "/v1/chat/completions", body);
    REQUIRE_FALSE(r.ok());
    CHECK(absl::IsResourceExhausted(r.status()));
    CHECK(kind_of(r.status()) == keel::outcome_kind::throttled);
    REQUIRE(keel::retry_after(r.status()).has_value());
    CHECK(*keel::retry_after(r.status()) == 250ms);
    const raw_response w = raw(mock, "/v1/chat/completions", body);
    CHECK(w.status == 429);
    CHECK(w.header("retry-after-ms") == "250");
    CHECK(w.header("retry-after") == "1");
    CHECK(w.header("x-ratelimit-reset-requests") == "250ms");
    CHECK(json::parse(w.body)["error"]["type"] == "rate_limit_exceeded");
  }
  SECTION("server_error: a burst of `count`, then healthy; x_should_retry is sent") {
    REQUIRE(mock.set_fault(R"({"kind":"server_error","status":502,"count":2,"x_should_retry":"false"})") == 200);
    const auto r = exchange(client, "/v1/chat/completions", body);
    REQUIRE_FALSE(r.ok());
    CHECK(kind_of(r.status()) == keel::outcome_kind::permanent);  // x-should-retry: false wins
    const raw_response w = raw(mock, "/v1/chat/completions", body);
    CHECK(w.status == 502);
    CHECK(w.header("x-should-retry") == "false");
    CHECK(raw(mock, "/v1/chat/completions", body).status == 200);  // the burst is over
    CHECK(mock.fault()["kind"] == "none");
    CHECK(mock.stats()["faulted"] == 2);
  }
  SECTION("server_error 500 for a write: ambiguous") {
    REQUIRE(mock.set_fault(R"({"kind":"server_error","status":500})") == 200);
    const auto r = exchange(client, "/v1/chat/completions", body, 10s, {.effect = keel::effect::write});
    REQUIRE_FALSE(r.ok());
    CHECK(kind_of(r.status(), {.effect = keel::effect::write}) == keel::outcome_kind::ambiguous);
    CHECK(raw(mock, "/v1/chat/completions", body).status == 500);  // count 0: every request
  }
  SECTION("ratio 0: nobody is affected") {
    REQUIRE(mock.set_fault(R"({"kind":"outage","ratio":0})") == 200);
    CHECK(exchange(client, "/v1/chat/completions", body).ok());
  }
  SECTION("slowdown: every latency times the factor") {
    const auto t0 = std::chrono::steady_clock::now();
    REQUIRE(exchange(client, "/v1/chat/completions", body).ok());
    const auto normal = std::chrono::steady_clock::now() - t0;
    REQUIRE(mock.set_fault(R"({"kind":"slowdown","factor":40})") == 200);  // 5 ms -> 200 ms
    const auto t1 = std::chrono::steady_clock::now();
    REQUIRE(exchange(client, "/v1/chat/completions", body).ok());
    const auto slowed = std::chrono::steady_clock::now() - t1;
    CHECK(slowed >= 200ms);
    CHECK(slowed > normal);
  }
}

TEST_CASE("mock upstream: stream faults as keel's stream reader sees them", "[upstream]") {
  keel_test::mock_upstream_process mock(quick);
  http::client client({.base_url = mock.url()});
  const std::string body = chat_body("hi", true);
  SECTION("slow_first_token: the first-token budget fires") {
    REQUIRE(mock.set_fault(R"({"kind":"slow_first_token","first_token_ms":3000})") == 200);
    const streamed s = stream_once(client, body, {.first_token = 200ms, .stall = 5s});
    REQUIRE_FALSE(s.result.ok());
    CHECK(absl::IsDeadlineExceeded(s.result.status()));
    CHECK(s.took < 2s);
    CHECK(wait_until([&] { return mock.stats()["client_gone"]["while_streaming"] == 1; }));
  }
  SECTION("cut: closed after N tokens without [DONE]: a partial answer, transient") {
    REQUIRE(mock.set_fault(R"({"kind":"cut","after_tokens":3})") == 200);
    const raw_response w = raw(mock, "/v1/chat/completions", body);
    CHECK(w.rc != CURLE_OK);  // the chunked body never ended
    const sse_events ev = parse_sse(w.body);
    CHECK_FALSE(ev.done);
    CHECK(ev.events.size() == 1 + 3);
    const streamed s = stream_once(client, body, {.first_token = 5s, .stall = 5s});
    REQUIRE(s.result.ok());
    CHECK_FALSE(s.result->complete);
    CHECK(s.result->tokens == 3);
    CHECK(absl::IsUnavailable(s.result->cause));
    CHECK(kind_of(s.result->cause) == keel::outcome_kind::transient);
    CHECK(mock.stats()["streams_cut"] == 2);
  }
  SECTION("error_event: an error object after N tokens, then the end") {
    REQUIRE(mock.set_fault(R"({"kind":"error_event","after_tokens":2})") == 200);
    const raw_response w = raw(mock, "/v1/chat/completions", body);
    CHECK(w.rc == CURLE_OK);
    const sse_events ev = parse_sse(w.body);
    CHECK_FALSE(ev.done);
    REQUIRE(ev.events.size() == 1 + 2 + 1);
    CHECK(ev.events.back()["error"]["type"] == "server_error");
    const streamed s = stream_once(client, body, {.first_token = 5s, .stall = 5s});
    REQUIRE(s.result.ok());
    CHECK(s.result->tokens == 2);
    CHECK_FALSE(s.result->cause.ok());
    CHECK(mock.stats()["error_events"] == 2);
  }
  SECTION("outage while streaming: the running stream is cut at its next token") {
    keel_test::mock_upstream_process slow({"--tokens", "200", "--token-gap-ms", "20", "--first-token-ms", "5"});
    http::client slow_client({.base_url = slow.url()});
    std::atomic<int> seen{0};
    streamed s;
    std::thread t([&] { s = stream_once(slow_client, body, {.first_token = 5s, .stall = 5s}, &seen); });
    REQUIRE(wait_until([&] { return seen.load() >= 2; }));
    REQUIRE(slow.set_fault(R"({"kind":"outage"})") == 200);
    t.join();
    REQUIRE(s.result.ok());
    CHECK_FALSE(s.result->complete);
    CHECK(s.result->tokens < 200);
    CHECK(absl::IsUnavailable(s.result->cause));
    CHECK(slow.stats()["streams_cut"] == 1);
  }
}

TEST_CASE("mock upstream: stall and hang end when the client aborts, and the server notices within 100 ms",
          "[upstream]") {
  keel_test::mock_upstream_process mock(quick);
  http::client client({.base_url = mock.url()});
  SECTION("stall: N tokens, then silence until keel's stall budget aborts the transfer") {
    REQUIRE(mock.set_fault(R"({"kind":"stall","after_tokens":2})") == 200);
    const streamed s = stream_once(client, chat_body("hi", true), {.first_token = 5s, .stall = 300ms});
    REQUIRE(s.result.ok());
    CHECK(s.result->tokens == 2);
    CHECK(s.result->reason == keel::stream_stop::stall);
    CHECK(s.took < 3s);
    json stats;
    REQUIRE(wait_until([&] {
      stats = mock.stats();
      return stats["client_gone"]["while_streaming"] == 1;
    }));
    CHECK(stats["stalled"] == 1);
    CHECK(stats["client_gone"]["last_unix_ms"].get<std::int64_t>() - unix_ms(s.returned) < 100);
    CHECK(stats["client_gone"]["last_detect_ms"].get<std::int64_t>() <= 100);
    CHECK(wait_until([&] { return mock.stats()["in_flight"] == 0; }));
  }
  SECTION("hang: no headers; the call's deadline aborts the transfer") {
    REQUIRE(mock.set_fault(R"({"kind":"hang"})") == 200);
    const auto r = exchange(client, "/v1/chat/completions", chat_body("hi", false), 300ms);
    const auto returned = std::chrono::system_clock::now();
    REQUIRE_FALSE(r.ok());
    CHECK(absl::IsDeadlineExceeded(r.status()));
    json stats;
    REQUIRE(wait_until([&] {
      stats = mock.stats();
      return stats["client_gone"]["while_waiting"] == 1;
    }));
    CHECK(stats["hung"] == 1);
    CHECK(stats["client_gone"]["last_unix_ms"].get<std::int64_t>() - unix_ms(returned) < 100);
    CHECK(wait_until([&] { return mock.stats()["in_flight"] == 0; }));
  }
  SECTION("hang on a stream: keel's first-token budget aborts it") {
    REQUIRE(mock.set_fault(R"({"kind":"hang"})") == 200);
    const streamed s = stream_once(client, chat_body("hi", true), {.first_token = 300ms, .stall = 5s});
    REQUIRE_FALSE(s.result.ok());
    CHECK(absl::IsDeadlineExceeded(s.result.status()));
    REQUIRE(wait_until([&] { return mock.stats()["client_gone"]["while_waiting"] == 1; }));
    CHECK(mock.stats()["client_gone"]["last_unix_ms"].get<std::int64_t>() - unix_ms(s.returned) < 100);
  }
}

TEST_CASE("mock upstream: the deadline, Idempotency-Key and Authorization scheme are recorded, never the key",
          "[upstream]") {
  keel_test::mock_upstream_process mock(quick);
  http::client client({.base_url = mock.url(), .headers = {"Authorization: Bearer sk-secret-123", "X-Stainless-Retry-Count: 0"}});
  REQUIRE(exchange(client, "/v1/chat/completions", chat_body("hi", false), 5s,
                   {.effect = keel::effect::write, .idempotent = true})
              .ok());
  const json last = mock.stats()["last_request"];
  CHECK(last["path"] == "/v1/chat/completions");
  CHECK(last["idempotency_key"].is_string());
  CHECK(!last["idempotency_key"].get<std::string>().empty());
  const int deadline = std::stoi(last["x_request_timeout_ms"].get<std::string>());
  CHECK(deadline > 0);
  CHECK(deadline <= 5000);
  CHECK(last["x_stainless_retry_count"] == "0");
  CHECK(last["authorization"]["present"] == true);
  CHECK(last["authorization"]["scheme"] == "Bearer");
  CHECK(mock.stats().dump().find("sk-secret") == std::string::npos);
  // reset zeroes the figures and the fault.
  REQUIRE(mock.set_fault(R"({"kind":"outage"})") == 200);
  mock.reset();
  const json after = mock.stats();
  CHECK(after["requests"]["chat"] == 0);
  CHECK(after["fault"]["kind"] == "none");
  CHECK(after["last_request"]["path"].is_null());
}

TEST_CASE("mock upstream: an invalid control body is a 400 naming the field and the rule", "[upstream]") {
  keel_test::mock_upstream_process mock(quick);
  struct bad {
    const char* body;
    const char* param;
    const char* rule;
  };
  for (const bad& b : {bad{"not json", "body", "must be a JSON object"},
                       bad{"[1]", "body", "must be a JSON object"},
                       bad{R"({"factor":2})", "kind", "must be a string"},
                       bad{R"({"kind":"meltdown"})", "kind", "must be one of"},
                       bad{R"({"kind":"slowdown","factor":0.5})", "factor", "must be in [1, 1000]"},
                       bad{R"({"kind":"slowdown","factor":"2"})", "factor", "must be a number"},
                       bad{R"({"kind":"outage","ratio":1.5})", "ratio", "must be in [0, 1]"},
                       bad{R"({"kind":"server_error","status":418})", "status", "must be 500, 502 or 503"},
                       bad{R"({"kind":"server_error","count":-1})", "count", "must be in [0, 1000000]"},
                       bad{R"({"kind":"rate_limit","retry_after_ms":1.5})", "retry_after_ms", "must be an integer"},
                       bad{R"({"kind":"stall","after_tokens":-2})", "after_tokens", "must be in [0, 100000]"},
                       bad{R"({"kind":"outage","x_should_retry":"maybe"})", "x_should_retry", "must be \"true\" or \"false\""},
                       bad{R"({"kind":"outage","ratoi":0.5})", "ratoi", "must be a known field"}}) {
    INFO(b.body);
    std::string answer;
    CHECK(mock.set_fault(b.body, &answer) == 400);
    const json e = json::parse(answer)["error"];
    CHECK(e["param"] == b.param);
    CHECK(e["message"].get<std::string>().find(b.rule) != std::string::npos);
    CHECK(e["type"] == "invalid_request_error");
  }
  CHECK(mock.fault()["kind"] == "none");  // nothing invalid was applied
  REQUIRE(mock.set_fault(R"({"kind":"cut","after_tokens":4,"ratio":0.5})") == 200);
  const json f = mock.fault();
  CHECK(f["kind"] == "cut");
  CHECK(f["after_tokens"] == 4);
  CHECK(f["ratio"] == 0.5);
}

TEST_CASE("mock upstream: a bad flag exits 2 naming the flag and the rule; SIGTERM exits 0", "[upstream][cli]") {
  struct bad {
    std::vector<std::string> args;
    const char* says;
  };
  const std::string err =
      (std::filesystem::temp_directory_path() / ("keel-mock-cli-" + std::to_string(::getpid()) + ".err")).string();
  for (const bad& b : {bad{{"--port", "70000"}, "--port must be a whole number in [0, 65535] (got '70000')"},
                       bad{{"--port", "abc"}, "--port must be a whole number in [0, 65535]"},
                       bad{{}, "--port is required"},
                       bad{{"--port", "0", "--tokens", "0"}, "--tokens must be a whole number in [1, 100000]"},
                       bad{{"--port", "0", "--latency-ms", "-5"}, "--latency-ms must be a whole number in [0, 600000]"},
                       bad{{"--port", "0", "--name", ""}, "--name must be a non-empty word"},
                       bad{{"--port", "0", "--models", "a,,b"}, "--models must be a comma-separated list"},
                       bad{{"--port", "0", "--seed"}, "--seed needs a value"},
                       bad{{"--port", "0", "--colour", "red"}, "unknown flag '--colour'"}}) {
    std::vector<std::string> argv = {KEEL_MOCK_UPSTREAM};
    argv.insert(argv.end(), b.args.begin(), b.args.end());
    keel_test::child_program p(argv, err);
    INFO(b.says);
    CHECK(p.wait() == 2);
    const std::string said = keel_test::read_file(err);
    CHECK(said.find(b.says) != std::string::npos);
  }
  std::filesystem::remove(err);
  keel_test::mock_upstream_process mock({}, "named");
  CHECK(mock.line().rfind("mock_upstream named listening on 127.0.0.1:", 0) == 0);
  CHECK(raw(mock, "/healthz").status == 200);
  CHECK(mock.terminate() == 0);
}

TEST_CASE("mock upstream: 200 concurrent streams are served while 20 requests are held", "[upstream][load]") {
  // The default pool (512 threads) and backlog (1024): held requests and
  // streams each keep a thread, and 200 connections arrive at once.
  keel_test::mock_upstream_process mock({"--first-token-ms", "20", "--token-gap-ms", "5", "--tokens", "8"});
  REQUIRE(mock.set_fault(R"({"kind":"hang"})") == 200);
  std::atomic<bool> release{false};
  std::vector<std::thread> held;
  for (int i = 0; i < 20; ++i)
    held.emplace_back([&] { (void)raw(mock, "/v1/chat/completions", chat_body("hold", false), 120000, &release); });
  REQUIRE(wait_until([&] { return mock.stats()["hung"] == 20; }, 30s));
  REQUIRE(mock.set_fault(R"({"kind":"none"})") == 200);
  std::atomic<int> complete{0};
  std::vector<std::thread> streams;
  for (int i = 0; i < 200; ++i)
    streams.emplace_back([&, i] {
      const raw_response r = raw(mock, "/v1/chat/completions", chat_body("stream " + std::to_string(i), true), 60000);
      if (r.rc == CURLE_OK && parse_sse(r.body).done) complete.fetch_add(1);
    });
  for (std::thread& t : streams) t.join();
  CHECK(complete.load() == 200);
  release.store(true);
  for (std::thread& t : held) t.join();
  json stats;
  REQUIRE(wait_until([&] {
    stats = mock.stats();
    return stats["client_gone"]["while_waiting"] == 20;
  }));
  CHECK(stats["chat"]["streams_completed"] == 200);
  CHECK(wait_until([&] { return mock.stats()["in_flight"] == 0; }));  // the handlers return after counting
  CHECK(mock.terminate() == 0);
}

TEST_CASE("mock upstream: SIGTERM ends held requests and streams, and exits 0 at once", "[upstream][cli]") {
  keel_test::mock_upstream_process mock({"--first-token-ms", "5", "--token-gap-ms", "1000", "--tokens", "100"});
  std::atomic<bool> never{false};
  std::thread stream([&] { (void)raw(mock, "/v1/chat/completions", chat_body("long", true), 60000, &never); });
  REQUIRE(wait_until([&] { return mock.stats()["chat"]["streams_started"] == 1; }));
  REQUIRE(mock.set_fault(R"({"kind":"hang"})") == 200);
  std::thread hung([&] { (void)raw(mock, "/v1/chat/completions", chat_body("hold", false), 60000, &never); });
  REQUIRE(wait_until([&] { return mock.stats()["hung"] == 1; }));
  const auto t0 = std::chrono::steady_clock::now();
  CHECK(mock.terminate() == 0);
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);
  stream.join();
  hung.join();
}
