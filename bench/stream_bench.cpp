// Streams: the SSE parser against a bare line split over the same recorded
// bytes (BM_Sse_Parse vs BM_Sse_LineSplit) and against that split with
// nlohmann::json reading each event (BM_Sse_LineSplit_Nlohmann), and the stream policy's own cost
// per token (BM_Stream_PerToken: stream_writer::token, the commit, gap and
// stall bookkeeping, the copy into the call's text and the relay callback)
// beside the parser alone handing the same tokens to a plain callback
// (BM_Stream_ParserOnly) and the parser feeding the policy
// (BM_Stream_ParsedIntoPolicy). The recorded stream ends with a tool call
// streamed as OpenAI does (its first chunk, then 64 argument fragments), so
// the parser and the policy read tool-call deltas as model output too; the
// policy's own cost per tool-call fragment is BM_Stream_PerToolDelta, and
// per event handed to a relay (its data with it) BM_Stream_PerEvent_Relay.
// Allocations per iteration are counted.
//
//   build/h/bench/keel_bench_stream --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstddef>
#include <cstring>
#include <string>
#include <string_view>

#include "keel/compose/pipeline.hpp"
#include "keel/compose/stream.hpp"
#include "keel/core/call.hpp"
#include "keel/policy/retry.hpp"
#include "keel/provider/sse.hpp"
#include "keel/testing/manual_clock.hpp"
#include "support/alloc_counter.hpp"
#include "absl/status/status.h"

using namespace std::chrono_literals;

namespace {

constexpr int kTokens = 512;
constexpr int kToolDeltas = 65;  // the tool call's first chunk and 64 argument fragments
constexpr int kOutputs = kTokens + kToolDeltas;

// A recorded OpenAI-style stream: role chunk, 512 content chunks of one to
// eight characters (some escaped), a tool call (its first chunk with id and
// name, 64 argument fragments, escaped as arguments always are), a finish
// chunk, the usage chunk, [DONE].
std::string recorded_stream() {
  static const char* words[] = {"The", " quick", " brown", " fox", " jumps", " over", "\\n", " caf\\u00e9", ",", " a"};
  std::string s =
      "data: {\"id\":\"chatcmpl-AbC\",\"object\":\"chat.completion.chunk\",\"created\":1733200000,\"model\":\"gpt-4o-"
      "mini\",\"system_fingerprint\":\"fp_0\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":"
      "\"\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n";
  for (int i = 0; i < kTokens; ++i) {
    s += "data: {\"id\":\"chatcmpl-AbC\",\"object\":\"chat.completion.chunk\",\"created\":1733200000,\"model\":\"gpt-4o-"
         "mini\",\"system_fingerprint\":\"fp_0\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"";
    s += words[i % 10];
    s += "\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n";
    if (i % 64 == 0) s += ": keep-alive\n\n";
  }
  const std::string head =
      "data: {\"id\":\"chatcmpl-AbC\",\"object\":\"chat.completion.chunk\",\"created\":1733200000,\"model\":\"gpt-4o-"
      "mini\",\"system_fingerprint\":\"fp_0\",\"choices\":[{\"index\":0,\"delta\":";
  s += head +
       "{\"tool_calls\":[{\"index\":0,\"id\":\"call_DdmO9pD3xa9XTPNJ32zg2hcA\",\"type\":\"function\",\"function\":{"
       "\"name\":\"get_weather\",\"arguments\":\"\"}}]},\"logprobs\":null,\"finish_reason\":null}]}\n\n";
  static const char* pieces[] = {"{\\\"", "location", "\\\":\\\"", "Paris", ", France", "\\\",\\\"", "unit", "\\\":\\\"c\\\"}"};
  for (int i = 0; i < kToolDeltas - 1; ++i) {
    s += head + "{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"";
    s += pieces[i % 8];
    s += "\"}}]},\"logprobs\":null,\"finish_reason\":null}]}\n\n";
  }
  s += "data: {\"id\":\"chatcmpl-AbC\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n";
  s += "data: {\"id\":\"chatcmpl-AbC\",\"choices\":[],\"usage\":{\"prompt_tokens\":20,\"completion_tokens\":512,"
       "\"total_tokens\":532}}\n\n";
  s += "data: [DONE]\n\n";
  return s;
}

const std::string& body() {
  static const std::string b = recorded_stream();
  return b;
}

// Network-sized reads: 1460-byte pieces (one TCP segment's payload).
constexpr std::size_t kRead = 1460;

void BM_Sse_LineSplit(benchmark::State& state) {
  const std::string& b = body();
  std::string carry;
  for (auto _ : state) {
    std::size_t lines = 0;
    for (std::size_t off = 0; off < b.size(); off += kRead) {
      const std::string_view piece = std::string_view(b).substr(off, kRead);
      const char* p = piece.data();
      const char* end = p + piece.size();
      while (p < end) {
        const void* nl = std::memchr(p, '\n', static_cast<std::size_t>(end - p));
        if (nl == nullptr) {
          carry.append(p, static_cast<std::size_t>(end - p));
          break;
        }
        const char* e = static_cast<const char*>(nl);
        if (!carry.empty()) {
          carry.append(p, static_cast<std::size_t>(e - p));
          benchmark::DoNotOptimize(carry.data());
          carry.clear();
        }
        ++lines;
        p = e + 1;
      }
    }
    benchmark::DoNotOptimize(lines);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * b.size()));
}
BENCHMARK(BM_Sse_LineSplit);

void BM_Sse_Parse(benchmark::State& state) {
  const std::string& b = body();
  keel::sse_parser parser;
  std::size_t text = 0;
  auto on = [&](const keel::chat_chunk& c) {
    if (c.kind == keel::chunk_kind::content) text += c.text.size();
    return true;
  };
  {
    keel_bench::count_allocations allocs(state);
    for (auto _ : state) {
      parser.reset();
      for (std::size_t off = 0; off < b.size(); off += kRead) (void)parser.feed(std::string_view(b).substr(off, kRead), on);
      benchmark::DoNotOptimize(text);
    }
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * b.size()));
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(state.iterations() * kOutputs),
                                                  benchmark::Counter::kIsRate);
}
BENCHMARK(BM_Sse_Parse);

// What a gateway commonly writes instead: the same line split, and each
// data line parsed with nlohmann::json (a DOM per event) for its content.
void BM_Sse_LineSplit_Nlohmann(benchmark::State& state) {
  const std::string& b = body();
  std::string carry;
  std::size_t text = 0;
  auto on_line = [&](std::string_view line) {
    if (line.size() < 6 || line.substr(0, 6) != "data: ") return;
    const std::string_view data = line.substr(6);
    if (data == "[DONE]") return;
    const nlohmann::json j = nlohmann::json::parse(data.begin(), data.end(), nullptr, false);
    if (j.is_discarded()) return;
    const auto choices = j.find("choices");
    if (choices == j.end() || !choices->is_array() || choices->empty()) return;
    const auto delta = (*choices)[0].find("delta");
    if (delta == (*choices)[0].end()) return;
    const auto content = delta->find("content");
    if (content != delta->end() && content->is_string()) text += content->get_ref<const std::string&>().size();
  };
  {
    keel_bench::count_allocations allocs(state);
    for (auto _ : state) {
      for (std::size_t off = 0; off < b.size(); off += kRead) {
        const std::string_view piece = std::string_view(b).substr(off, kRead);
        const char* p = piece.data();
        const char* end = p + piece.size();
        while (p < end) {
          const void* nl = std::memchr(p, '\n', static_cast<std::size_t>(end - p));
          if (nl == nullptr) {
            carry.append(p, static_cast<std::size_t>(end - p));
            break;
          }
          const char* e = static_cast<const char*>(nl);
          if (!carry.empty()) {
            carry.append(p, static_cast<std::size_t>(e - p));
            on_line(carry);
            carry.clear();
          } else {
            on_line(std::string_view(p, static_cast<std::size_t>(e - p)));
          }
          p = e + 1;
        }
      }
      benchmark::DoNotOptimize(text);
    }
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * b.size()));
}
BENCHMARK(BM_Sse_LineSplit_Nlohmann);

// Per token: s/token and allocs/token counters (seconds per token, inverted rate).
void per_token(benchmark::State& state, std::int64_t tokens_per_iter, std::int64_t allocs_before) {
  // Seconds per token of CPU time, printed with its SI prefix ("8.2n": 8.2 ns).
  state.counters["s/token"] = benchmark::Counter(static_cast<double>(state.iterations() * tokens_per_iter),
                                                 benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  state.counters["allocs/token"] =
      benchmark::Counter(static_cast<double>(keel_bench::thread_allocations() - allocs_before) /
                         static_cast<double>(state.iterations() * tokens_per_iter));
}

// The policy's own per-token work: stream_writer::token (the commit, the gap
// and stall bookkeeping, the copy into the call's text, the relay callback)
// for a stream of 4096 tokens, one stream per iteration through a one-attempt
// pipeline, so the per-stream work (the pipeline, arming the watchdog, the
// result, the text buffer: one allocation) is amortised over its tokens.
void BM_Stream_PerToken(benchmark::State& state) {
  constexpr std::int64_t kStream = 4096;
  keel::testing::manual_clock clock;
  keel::deadline_timer guard_timer{clock};
  keel::stream_guard guard({.first_token = 10s, .stall = 10s}, guard_timer);
  std::size_t relayed = 0;
  keel::token_stream stream(guard, [&](std::string_view t) { relayed += t.size(); });
  const auto pipe = keel::pipeline(keel::retry({.max_attempts = 1})).in(keel::environment{clock});
  auto provider = [&](const keel::attempt&, keel::stream_writer& w) -> absl::Status {
    const keel::time_point now = clock.now();  // a transport reads it once per network read
    for (std::int64_t i = 0; i < kStream; ++i) benchmark::DoNotOptimize(w.token(" fox", now));
    return absl::OkStatus();
  };
  const std::int64_t before = keel_bench::thread_allocations();
  for (auto _ : state) {
    keel::call call(clock.now(), {.timeout = 1h});
    stream.reserve(static_cast<std::size_t>(kStream) * 4);
    auto r = pipe.run(call, stream.attempts(provider));
    benchmark::DoNotOptimize(r);
  }
  per_token(state, kStream, before);
  // How often a stream's arm woke the timer's thread (a futex wake each).
  state.counters["timer_wakeups/stream"] =
      static_cast<double>(guard_timer.figures().wakeups) / static_cast<double>(state.iterations());
  benchmark::DoNotOptimize(relayed);
}
BENCHMARK(BM_Stream_PerToken);

// The policy's own cost per tool-call fragment: stream_writer::event with one
// fragment (4 bytes of arguments), the commit, gap and stall bookkeeping,
// the fragment into the call's assembler, the hand-over to the callback.
void BM_Stream_PerToolDelta(benchmark::State& state) {
  constexpr std::int64_t kStream = 4096;
  keel::testing::manual_clock clock;
  keel::deadline_timer guard_timer{clock};
  keel::stream_guard guard({.first_token = 10s, .stall = 10s}, guard_timer);
  std::size_t relayed = 0;
  keel::token_stream stream(guard, [&](std::string_view t) { relayed += t.size(); });
  const auto pipe = keel::pipeline(keel::retry({.max_attempts = 1})).in(keel::environment{clock});
  const keel::tool_call_delta first{.index = 0, .id = "call_1", .type = "function", .name = "get_weather"};
  const keel::tool_call_delta piece{.index = 0, .arguments = "\"ab\""};
  auto provider = [&](const keel::attempt&, keel::stream_writer& w) -> absl::Status {
    const keel::time_point now = clock.now();
    benchmark::DoNotOptimize(w.event({.kind = keel::stream_event_kind::tool_call, .tool_calls = {&first, 1}}, now));
    for (std::int64_t i = 1; i < kStream; ++i)
      benchmark::DoNotOptimize(w.event({.kind = keel::stream_event_kind::tool_call, .tool_calls = {&piece, 1}}, now));
    return absl::OkStatus();
  };
  const std::int64_t before = keel_bench::thread_allocations();
  for (auto _ : state) {
    keel::call call(clock.now(), {.timeout = 1h});
    auto r = pipe.run(call, stream.attempts(provider));
    benchmark::DoNotOptimize(r);
  }
  per_token(state, kStream, before);
  benchmark::DoNotOptimize(relayed);
}
BENCHMARK(BM_Stream_PerToolDelta);

// A relay's view: the same 4096 content tokens handed over as events with
// their data (what a provider with the wire bytes passes), to a callback
// on const keel::stream_event&.
void BM_Stream_PerEvent_Relay(benchmark::State& state) {
  constexpr std::int64_t kStream = 4096;
  keel::testing::manual_clock clock;
  keel::deadline_timer guard_timer{clock};
  keel::stream_guard guard({.first_token = 10s, .stall = 10s}, guard_timer);
  std::size_t relayed = 0;
  keel::token_stream stream(guard, [&](const keel::stream_event& e) { relayed += e.data.size(); });
  const auto pipe = keel::pipeline(keel::retry({.max_attempts = 1})).in(keel::environment{clock});
  constexpr std::string_view data = R"({"choices":[{"index":0,"delta":{"content":" fox"},"finish_reason":null}]})";
  auto provider = [&](const keel::attempt&, keel::stream_writer& w) -> absl::Status {
    const keel::time_point now = clock.now();
    for (std::int64_t i = 0; i < kStream; ++i)
      benchmark::DoNotOptimize(w.event({.kind = keel::stream_event_kind::content, .content = " fox", .data = data}, now));
    return absl::OkStatus();
  };
  const std::int64_t before = keel_bench::thread_allocations();
  for (auto _ : state) {
    keel::call call(clock.now(), {.timeout = 1h});
    stream.reserve(static_cast<std::size_t>(kStream) * 4);
    auto r = pipe.run(call, stream.attempts(provider));
    benchmark::DoNotOptimize(r);
  }
  per_token(state, kStream, before);
  benchmark::DoNotOptimize(relayed);
}
BENCHMARK(BM_Stream_PerEvent_Relay);

// The same 4096 tokens to a plain callback that appends them to a reused
// string: the per-token work without the policy, for the difference.
void BM_Stream_PerToken_Bare(benchmark::State& state) {
  constexpr std::int64_t kStream = 4096;
  std::string text;
  text.reserve(static_cast<std::size_t>(kStream) * 4);
  std::size_t relayed = 0;
  auto on = [&](std::string_view t) {
    text.append(t.data(), t.size());
    relayed += t.size();
  };
  const std::int64_t before = keel_bench::thread_allocations();
  for (auto _ : state) {
    text.clear();
    for (std::int64_t i = 0; i < kStream; ++i) {
      on(" fox");
      benchmark::DoNotOptimize(text.data());
    }
  }
  per_token(state, kStream, before);
  benchmark::DoNotOptimize(relayed);
}
BENCHMARK(BM_Stream_PerToken_Bare);

// The recorded stream parsed, its tokens to a plain callback (the parser
// alone), and parsed into the policy (a token_stream attempt): one stream
// per iteration.
void BM_Stream_ParserOnly(benchmark::State& state) {
  const std::string& b = body();
  keel::sse_parser parser;
  std::string text;
  text.reserve(8192);
  auto on = [&](const keel::chat_chunk& c) {
    if (c.kind == keel::chunk_kind::content) text.append(c.text.data(), c.text.size());
    for (const keel::tool_call_delta& d : c.tool_calls) text.append(d.arguments.data(), d.arguments.size());
    return true;
  };
  const std::int64_t before = keel_bench::thread_allocations();
  for (auto _ : state) {
    parser.reset();
    text.clear();
    for (std::size_t off = 0; off < b.size(); off += kRead) (void)parser.feed(std::string_view(b).substr(off, kRead), on);
    benchmark::DoNotOptimize(text.data());
  }
  per_token(state, kOutputs, before);
}
BENCHMARK(BM_Stream_ParserOnly);

void BM_Stream_ParsedIntoPolicy(benchmark::State& state) {
  const std::string& b = body();
  keel::testing::manual_clock clock;
  keel::deadline_timer guard_timer{clock};
  keel::stream_guard guard({.first_token = 10s, .stall = 10s}, guard_timer);
  keel::sse_parser parser;
  std::size_t relayed = 0;
  keel::token_stream stream(guard, [&](std::string_view t) { relayed += t.size(); });
  const auto pipe = keel::pipeline(keel::retry({.max_attempts = 1})).in(keel::environment{clock});
  auto provider = [&](const keel::attempt&, keel::stream_writer& w) -> absl::Status {
    parser.reset();
    for (std::size_t off = 0; off < b.size(); off += kRead) {
      const keel::time_point now = w.now();  // once per read, as keel::http does
      (void)parser.feed(std::string_view(b).substr(off, kRead), [&](const keel::chat_chunk& c) {
        if (c.kind == keel::chunk_kind::content) return w.token(c.text, now);
        if (c.kind == keel::chunk_kind::tool_call)
          return w.event({.kind = keel::stream_event_kind::tool_call, .content = c.text, .tool_calls = c.tool_calls}, now);
        if (c.has_usage) w.usage(c.usage);
        return true;
      });
    }
    return absl::OkStatus();
  };
  const std::int64_t before = keel_bench::thread_allocations();
  for (auto _ : state) {
    keel::call call(clock.now(), {.timeout = 1h});
    stream.reserve(8192);
    auto r = pipe.run(call, stream.attempts(provider));
    benchmark::DoNotOptimize(r);
  }
  per_token(state, kOutputs, before);
  benchmark::DoNotOptimize(relayed);
}
BENCHMARK(BM_Stream_ParsedIntoPolicy);

}  // namespace
