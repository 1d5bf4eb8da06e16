// The HTTP provider (keel/provider/http.hpp) against a loopback cpp-httplib
// server in this process, beside the same request made with a bare reused
// curl easy handle; the same provider on one event loop (keel/asio/http.hpp,
// when keel::asio is built: KEEL_BENCH_ASIO), one transfer at a time and 64
// in flight on one thread; and the header-hint parsers on a real 429's
// headers. Names are stable; see docs/benchmarks.md.
//
// Two allocation counters: allocs/iter counts operator new on the calling
// thread (keel's and the caller's side), curl_allocs/iter the calls libcurl
// makes to its allocator (curl_global_init_mem), for both benchmarks.
#include <curl/curl.h>
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>

#include <benchmark/benchmark.h>

#include "keel/compose/pipeline.hpp"
#include "keel/policy/retry.hpp"
#include "keel/provider/hints.hpp"
#include "keel/provider/http.hpp"
#include "support/alloc_counter.hpp"

#ifdef KEEL_BENCH_ASIO
#include <asio/io_context.hpp>
#include <functional>
#include <optional>
#include <vector>

#include "keel/asio/http.hpp"
#endif

using namespace std::chrono_literals;

namespace {

// libcurl's allocations, counted per thread.
thread_local std::int64_t curl_allocs = 0;
void* count_malloc(std::size_t n) {
  ++curl_allocs;
  return std::malloc(n);
}
void count_free(void* p) { std::free(p); }
void* count_realloc(void* p, std::size_t n) {
  ++curl_allocs;
  return std::realloc(p, n);
}
char* count_strdup(const char* s) {
  ++curl_allocs;
  return ::strdup(s);
}
void* count_calloc(std::size_t n, std::size_t size) {
  ++curl_allocs;
  return std::calloc(n, size);
}

class counting_curl {
 public:
  explicit counting_curl(benchmark::State& state) : state_(state), start_(curl_allocs) {}
  ~counting_curl() {
    state_.counters["curl_allocs/iter"] =
        benchmark::Counter(static_cast<double>(curl_allocs - start_), benchmark::Counter::kAvgIterations);
  }

 private:
  benchmark::State& state_;
  std::int64_t start_;
};

constexpr std::string_view kBody = R"({"model":"m","messages":[{"role":"user","content":"hello"}]})";

// One loopback server for the whole run; libcurl set up to count first.
struct loopback {
  httplib::Server server;
  std::thread thread;
  int port = 0;
  loopback() {
    curl_global_init_mem(CURL_GLOBAL_DEFAULT, count_malloc, count_free, count_realloc, count_strdup, count_calloc);
    // A thread per kept-alive connection: enough for 64 transfers in flight.
    server.new_task_queue = [] { return new httplib::ThreadPool(72); };
    server.set_keep_alive_max_count(1'000'000'000);
    server.set_tcp_nodelay(true);  // else Nagle + delayed ACK put 40 ms on every response
    server.Post("/v1/chat/completions", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(R"({"choices":[{"message":{"role":"assistant","content":"hi"}}]})", "application/json");
    });
    port = server.bind_to_any_port("127.0.0.1");
    thread = std::thread([this] { server.listen_after_bind(); });
    while (!server.is_running()) std::this_thread::sleep_for(1ms);
  }
  ~loopback() {
    server.stop();
    thread.join();
  }
  [[nodiscard]] std::string url() const { return "http://127.0.0.1:" + std::to_string(port); }
};

loopback& server() {
  static loopback s;
  return s;
}

std::size_t discard(char*, std::size_t size, std::size_t n, void* out) {
  static_cast<std::string*>(out)->clear();
  return size * n;
}

// The floor: one reused easy handle, the same request and headers, no keel.
void BM_Baseline_CurlEasyPerform(benchmark::State& state) {
  const std::string url = server().url() + "/v1/chat/completions";
  CURL* e = curl_easy_init();
  std::string sink;
  curl_slist* headers = curl_slist_append(nullptr, "Content-Type: application/json");
  headers = curl_slist_append(headers, "Expect:");
  curl_easy_setopt(e, CURLOPT_URL, url.c_str());
  curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(e, CURLOPT_TCP_NODELAY, 1L);
  curl_easy_setopt(e, CURLOPT_HTTPHEADER, headers);
  curl_easy_setopt(e, CURLOPT_POSTFIELDS, kBody.data());
  curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(kBody.size()));
  curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, &discard);
  curl_easy_setopt(e, CURLOPT_WRITEDATA, &sink);
  curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, 3000L);
  {
    keel_bench::count_allocations allocs(state);
    counting_curl curl(state);
    for (auto _ : state) {
      const CURLcode rc = curl_easy_perform(e);
      if (rc != CURLE_OK) state.SkipWithError(curl_easy_strerror(rc));
    }
  }
  curl_slist_free_all(headers);
  curl_easy_cleanup(e);
}
BENCHMARK(BM_Baseline_CurlEasyPerform)->UseRealTime();

// A new keel::call per request (a write: the idempotency key is sent), a
// retry layer, one HTTP request per call on a pooled handle.
void BM_Http_Call(benchmark::State& state) {
  static keel::http::client client({.base_url = server().url()});
  auto chat = client.exchange({.path = "/v1/chat/completions", .body = kBody});
  auto pipe = keel::pipeline(keel::retry({.max_attempts = 3}));
  keel_bench::count_allocations allocs(state);
  counting_curl curl(state);
  for (auto _ : state) {
    const keel::time_point now = keel::real_clock{}.now();
    keel::call call(now, {.timeout = 3s, .operation = {.effect = keel::effect::write}});
    const absl::Status s = pipe.run(call, now, chat);
    if (!s.ok()) state.SkipWithError("call failed");
  }
}
BENCHMARK(BM_Http_Call)->UseRealTime()->Threads(1)->Threads(2);

// One attempt of a new call (a write), no pipeline: the blocking client's
// side of BM_AsyncHttp_Exchange.
void BM_Http_Exchange(benchmark::State& state) {
  static keel::http::client client({.base_url = server().url()});
  auto chat = client.exchange({.path = "/v1/chat/completions", .body = kBody});
  keel_bench::count_allocations allocs(state);
  counting_curl curl(state);
  for (auto _ : state) {
    const keel::time_point now = keel::real_clock{}.now();
    keel::call call(now, {.timeout = 3s, .operation = {.effect = keel::effect::write}});
    const keel::attempt a{.start = now, .deadline = call.work_deadline(), .timeout = 3s, .owner = &call};
    if (!chat(a).ok()) state.SkipWithError("exchange failed");
  }
}
BENCHMARK(BM_Http_Exchange)->UseRealTime();

#ifdef KEEL_BENCH_ASIO
// One call's attempt at a time through keel::asio::http_client, the
// io_context run on the benchmark's thread until it completes.
void BM_AsyncHttp_Exchange(benchmark::State& state) {
  ::asio::io_context io;
  keel::asio::http_client client(io.get_executor(), {.base_url = server().url()});
  auto chat = client.exchange({.path = "/v1/chat/completions", .body = kBody});
  bool failed = false;
  auto run_one = [&] {
    const keel::time_point now = keel::real_clock{}.now();
    keel::call call(now, {.timeout = 3s, .operation = {.effect = keel::effect::write}});
    const keel::attempt a{.start = now, .deadline = call.work_deadline(), .timeout = 3s, .owner = &call};
    bool done = false;
    chat(a, [&](absl::Status s) {
      failed = failed || !s.ok();
      done = true;
    });
    io.restart();  // run_one() stopped when the last transfer left the loop without work
    while (!done) io.run_one();
  };
  run_one();  // the connection, the pools
  {
    keel_bench::count_allocations allocs(state);
    counting_curl curl(state);
    for (auto _ : state) run_one();
  }
  if (failed) state.SkipWithError("exchange failed");
}
BENCHMARK(BM_AsyncHttp_Exchange)->UseRealTime();

// state.range(0) transfers in flight on one thread: each completion starts
// the next. ns/op is per transfer (iterations count transfers).
void BM_AsyncHttp_Exchange_InFlight(benchmark::State& state) {
  const auto in_flight = static_cast<int>(state.range(0));
  const int batch = in_flight * 16;
  ::asio::io_context io;
  keel::asio::http_client client(io.get_executor(), {.base_url = server().url()});
  auto chat = client.exchange({.path = "/v1/chat/completions", .body = kBody});
  struct slot {
    std::optional<keel::call> call;
    keel::attempt a;
  };
  std::vector<slot> slots(static_cast<std::size_t>(in_flight));
  int started = 0;
  int finished = 0;
  int goal = 0;
  bool failed = false;
  // Starts the next transfer on `s` (the call is made anew, as a request would be).
  std::function<void(slot&)> next = [&](slot& s) {
    if (started == goal) return;
    ++started;
    const keel::time_point now = keel::real_clock{}.now();
    s.call.emplace(now, keel::call_options{.timeout = 3s, .operation = {.effect = keel::effect::write}});
    s.a = keel::attempt{.start = now, .deadline = s.call->work_deadline(), .timeout = 3s, .owner = &*s.call};
    chat(s.a, [&, sp = &s](absl::Status st) {
      failed = failed || !st.ok();
      ++finished;
      next(*sp);
    });
  };
  auto run_batch = [&](int n) {
    started = finished = 0;
    goal = n;
    for (slot& s : slots) next(s);
    io.restart();
    while (finished < n) io.run_one();
  };
  run_batch(in_flight);  // the connections, the pools
  {
    keel_bench::count_allocations allocs(state);
    counting_curl curl(state);
    while (state.KeepRunningBatch(batch)) run_batch(batch);
  }
  if (failed) state.SkipWithError("exchange failed");
}
BENCHMARK(BM_AsyncHttp_Exchange_InFlight)->Arg(8)->Arg(64)->UseRealTime();
#endif

// The headers of an OpenAI 429, through response_hints, and the wait picked.
void BM_Hints_OpenAI429(benchmark::State& state) {
  keel_bench::count_allocations allocs(state);
  const keel::http::wall_time now = std::chrono::system_clock::now();
  for (auto _ : state) {
    keel::http::response_hints h;
    h.on_header("content-type", " application/json", now);
    h.on_header("x-ratelimit-limit-requests", " 60", now);
    h.on_header("x-ratelimit-remaining-requests", " 0", now);
    h.on_header("x-ratelimit-reset-requests", " 1s", now);
    h.on_header("x-ratelimit-remaining-tokens", " 149984", now);
    h.on_header("x-ratelimit-reset-tokens", " 6m0s", now);
    h.on_header("x-should-retry", " true", now);
    benchmark::DoNotOptimize(h.hint(429));
  }
}
BENCHMARK(BM_Hints_OpenAI429);

}  // namespace
