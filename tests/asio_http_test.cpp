// keel::asio::http_client (keel/asio/http.hpp): keel's HTTP provider on one
// event loop, against scripted cpp-httplib servers in this process, beside
// the blocking keel::http::client on the same answers. The loop runs on the
// test's thread (run_until) unless a test says otherwise; nothing sleeps to
// assert timing.
#include "keel/asio/http.hpp"

#include <dirent.h>
#include <httplib.h>

#include <asio/bind_cancellation_slot.hpp>
#include <asio/bind_executor.hpp>
#include <asio/cancellation_signal.hpp>
#include <asio/io_context.hpp>
#include <asio/strand.hpp>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

#include "keel/asio/run.hpp"
#include "keel/compose/pipeline.hpp"
#include "keel/compose/stream.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/outcome.hpp"
#include "keel/core/upstream.hpp"
#include "keel/policy/backoff.hpp"
#include "keel/policy/retry.hpp"
#include "keel/provider/http.hpp"
#include "support/alloc_counter.hpp"
#include "support/async.hpp"
#include "support/catch.hpp"
#include "support/loopback.hpp"
#include "support/sse_server.hpp"

using namespace std::chrono_literals;
namespace http = keel::http;

namespace {

// What the server saw of one request.
struct seen {
  std::string path;
  std::string deadline;
  std::string key;
};

// The scripted upstream: each path plays one behaviour.
//   /ok            200 with a JSON object
//   /503-then-ok   503 the first time, then as /ok
//   /429-ms ...    the throttled and failing answers the blocking client's tests use
//   /hang          200, then a space every 20 ms until the client leaves (left())
//   /gate          held until gate_size() requests are held at once, then 200
class scripted_server {
 public:
  explicit scripted_server(int threads = 16, int gate = 0) : gate_(gate) {
    server_.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<std::size_t>(threads)); };
    server_.set_keep_alive_max_count(100000);
    server_.set_keep_alive_timeout(60);  // connections a test opened stay for the whole test
    server_.set_tcp_nodelay(true);
    auto handler = [this](const httplib::Request& req, httplib::Response& res) { serve(req, res); };
    server_.Get(".*", handler);
    server_.Post(".*", handler);
    port_ = server_.bind_to_any_port("127.0.0.1");
    listener_ = std::thread([this] { server_.listen_after_bind(); });
    while (!server_.is_running()) std::this_thread::sleep_for(1ms);
  }
  ~scripted_server() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    server_.stop();
    listener_.join();
  }
  scripted_server(const scripted_server&) = delete;
  scripted_server& operator=(const scripted_server&) = delete;

  [[nodiscard]] std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  [[nodiscard]] std::vector<seen> requests() const {
    std::lock_guard lock(mu_);
    return seen_;
  }
  // /hang transfers under way, and those whose client went away.
  [[nodiscard]] int hanging() const noexcept { return hanging_.load(); }
  [[nodiscard]] int left() const noexcept { return left_.load(); }
  // /gate requests held at the most at once.
  [[nodiscard]] int gate_peak() const noexcept { return gate_peak_.load(); }

 private:
  void serve(const httplib::Request& req, httplib::Response& res) {
    int n = 0;
    {
      std::lock_guard lock(mu_);
      seen_.push_back({req.path, req.get_header_value("x-request-timeout-ms"),
                       req.get_header_value("Idempotency-Key")});
      n = ++count_[req.path];
    }
    const std::string& p = req.path;
    if (p == "/ok") {
      res.set_content(R"({"ok":true})", "application/json");
    } else if (p == "/429-ms") {
      res.status = 429;
      res.set_header("retry-after-ms", "150");
      res.set_header("x-request-id", "req-1");
    } else if (p == "/429-seconds") {
      res.status = 429;
      res.set_header("Retry-After", "1");
    } else if (p == "/429-openai") {
      res.status = 429;
      res.set_header("x-ratelimit-remaining-requests", "0");
      res.set_header("x-ratelimit-reset-requests", "20ms");
    } else if (p == "/429-body") {
      res.status = 429;
      res.set_content(R"({"error":{"code":429,"details":[{"@type":"type.googleapis.com/google.rpc.RetryInfo",)"
                      R"("retryDelay":"0.05s"}]}})",
                      "application/json");
    } else if (p == "/503-then-ok") {
      if (n == 1) res.status = 503;
      else res.set_content(R"({"ok":true})", "application/json");
    } else if (p == "/500") {
      res.status = 500;
      res.set_content("internal error", "text/plain");
    } else if (p == "/503-no-retry") {
      res.status = 503;
      res.set_header("x-should-retry", "false");
    } else if (p == "/400-retry") {
      res.status = 400;
      res.set_header("x-should-retry", "true");
    } else if (p.rfind("/status/", 0) == 0) {
      res.status = std::stoi(p.substr(8));
      res.set_content(R"({"error":"scripted"})", "application/json");
    } else if (p == "/hang") {
      hanging_.fetch_add(1);
      res.set_chunked_content_provider("application/json", [this](std::size_t, httplib::DataSink& sink) {
        for (;;) {
          {
            std::unique_lock lock(mu_);
            if (cv_.wait_for(lock, 20ms, [this] { return stopping_; })) return false;
          }
          if (!sink.is_writable() || !sink.write(" ", 1)) {
            left_.fetch_add(1);
            return false;
          }
        }
      });
    } else if (p == "/gate") {
      std::unique_lock lock(mu_);
      ++gate_in_;
      if (gate_in_ > gate_peak_.load()) gate_peak_.store(gate_in_);
      cv_.notify_all();
      cv_.wait_for(lock, 30s, [this] { return stopping_ || gate_peak_.load() >= gate_; });
      --gate_in_;
      res.set_content(R"({"ok":true})", "application/json");
    } else {
      res.status = 404;
    }
  }

  httplib::Server server_;
  int port_ = 0;
  int gate_ = 0;
  int gate_in_ = 0;
  std::thread listener_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::vector<seen> seen_;
  std::map<std::string, int> count_;
  std::atomic<int> hanging_{0};
  std::atomic<int> left_{0};
  std::atomic<int> gate_peak_{0};
};

const keel::operation read_op{};
const keel::operation write_op{.effect = keel::effect::write};

// One attempt of its own call, outside any pipeline.
struct one_attempt {
  keel::call call;
  keel::attempt a;
  one_attempt(keel::operation op, keel::duration timeout, std::stop_token stop = {}, std::stop_token call_stop = {})
      : call(keel::real_clock{}.now(), {.timeout = timeout, .stop = call_stop, .operation = op}),
        a{.number = 1, .start = keel::real_clock{}.now(), .deadline = call.work_deadline(), .timeout = timeout,
          .stop = std::move(stop), .owner = &call} {}
};

// Runs `io` on this thread until `done()` or `limit` (real time) passed.
template <class Done>
bool run_until(::asio::io_context& io, Done done, std::chrono::milliseconds limit = 20s) {
  const auto give_up = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() > give_up) return false;
    io.restart();
    io.run_one_for(10ms);
  }
  return true;
}

// Where a completion landed.
template <class R>
struct landing {
  std::optional<R> result;
  int calls = 0;
  std::thread::id thread;
  auto handler() {
    return [this](R r) {
      result.emplace(std::move(r));
      ++calls;
      thread = std::this_thread::get_id();
    };
  }
  [[nodiscard]] bool done() const { return result.has_value(); }
};

absl::StatusOr<std::string> json_object(const http::response& r) {
  if (r.body.empty() || r.body.front() != '{') return absl::InternalError("keel test: not a JSON object");
  return std::string(r.body);
}

int process_threads() {
  int n = 0;
  DIR* d = ::opendir("/proc/self/task");
  if (d == nullptr) return -1;
  while (dirent* e = ::readdir(d))
    if (e->d_name[0] != '.') ++n;
  ::closedir(d);
  return n;
}

}  // namespace

TEST_CASE("asio http: a 200 goes to parse on the loop; the time left and the key go out", "[asio][http]") {
  scripted_server server;
  ::asio::io_context io;
  keel::asio::http_client client(io.get_executor(), {.base_url = server.url()});
  auto ex = client.exchange({.path = "/ok", .body = "{}"}, json_object);
  static_assert(std::is_same_v<decltype(ex)::result_type, absl::StatusOr<std::string>>);

  one_attempt w(write_op, 1500ms);
  landing<absl::StatusOr<std::string>> got;
  ex(w.a, got.handler());
  CHECK_FALSE(got.done());  // never inline from the initiating call
  REQUIRE(run_until(io, [&] { return got.done(); }));
  REQUIRE(got.result->ok());
  CHECK(**got.result == R"({"ok":true})");
  CHECK(got.calls == 1);
  CHECK(got.thread == std::this_thread::get_id());

  one_attempt r(read_op, 1500ms);
  landing<absl::StatusOr<std::string>> again;
  ex(r.a, again.handler());
  REQUIRE(run_until(io, [&] { return again.done(); }));
  REQUIRE(again.result->ok());

  const std::vector<seen> req = server.requests();
  REQUIRE(req.size() == 2);
  CHECK(std::stoi(req[0].deadline) > 1000);
  CHECK(std::stoi(req[0].deadline) <= 1500);
  CHECK(req[0].key == std::string(ex.idempotency_key()));
  CHECK(req[0].key.size() == 32);
  CHECK(req[1].key.empty());  // reads carry no key

  // A copy sends the same key.
  auto copy = ex;
  CHECK(copy.idempotency_key() == ex.idempotency_key());
  one_attempt w2(write_op, 1s);
  landing<absl::StatusOr<std::string>> third;
  copy(w2.a, third.handler());
  REQUIRE(run_until(io, [&] { return third.done(); }));
  CHECK(server.requests().back().key == std::string(ex.idempotency_key()));
}

TEST_CASE("asio http: invalid options are refused as the blocking client refuses them", "[asio][http]") {
  ::asio::io_context io;
  http::client_options bad{.headers = {"no colon"}};
  CHECK_THROWS_AS(keel::asio::http_client(io.get_executor(), bad), keel::invalid_options);
  CHECK_THROWS_AS(keel::asio::http_client(io.get_executor(), {.max_idle_handles = 0}), keel::invalid_options);
}

TEST_CASE("asio http: failures are classified exactly as the blocking client classifies them", "[asio][http]") {
  scripted_server server;
  ::asio::io_context io;
  keel::asio::http_client async_client(io.get_executor(), {.base_url = server.url()});
  http::client sync_client({.base_url = server.url()});
  const std::string refused = "http://127.0.0.1:" + std::to_string(keel_test::unused_loopback_port());
  keel::asio::http_client async_refused(io.get_executor(), {.base_url = refused});
  http::client sync_refused({.base_url = refused});

  struct probe {
    const char* path;
    bool refused;
  };
  for (const probe p : {probe{"/429-ms", false}, probe{"/429-seconds", false}, probe{"/429-openai", false},
                        probe{"/429-body", false}, probe{"/500", false}, probe{"/503-no-retry", false},
                        probe{"/400-retry", false}, probe{"/status/401", false}, probe{"/status/404", false},
                        probe{"/status/529", false}, probe{"/ok", true}}) {
    for (const keel::operation& op : {read_op, write_op}) {
      INFO(p.path << (p.refused ? " (refused)" : "") << (op.effect == keel::effect::write ? " write" : " read"));
      const http::request req{.path = p.path, .body = "{}"};
      one_attempt sa(op, 2s);
      const absl::Status want = p.refused ? sync_refused.exchange(req)(sa.a) : sync_client.exchange(req)(sa.a);

      one_attempt aa(op, 2s);
      landing<absl::Status> got;
      (p.refused ? async_refused : async_client).exchange(req)(aa.a, got.handler());
      REQUIRE(run_until(io, [&] { return got.done(); }));
      const absl::Status& st = *got.result;

      REQUIRE_FALSE(want.ok());
      CHECK(st.code() == want.code());
      CHECK(st.message() == want.message());
      CHECK(keel::default_classifier{}(st, op) == keel::default_classifier{}(want, op));
      CHECK(keel::not_started(st) == keel::not_started(want));
      const std::optional<keel::duration> hint = keel::retry_after(st);
      const std::optional<keel::duration> want_hint = keel::retry_after(want);
      REQUIRE(hint.has_value() == want_hint.has_value());
      if (hint) CHECK(*hint == *want_hint);
      const std::optional<keel::upstream_reply> up = keel::upstream_of(st);
      const std::optional<keel::upstream_reply> want_up = keel::upstream_of(want);
      REQUIRE(up.has_value() == want_up.has_value());
      if (up) CHECK(up->status == want_up->status);
    }
  }
  // The 429's hint and class, spelt out.
  one_attempt a(read_op, 2s);
  landing<absl::Status> got;
  async_client.exchange({.path = "/429-ms"})(a.a, got.handler());
  REQUIRE(run_until(io, [&] { return got.done(); }));
  CHECK(absl::IsResourceExhausted(*got.result));
  CHECK(keel::retry_after(*got.result) == std::optional<keel::duration>(150ms));
  CHECK(keel::default_classifier{}(*got.result, read_op) == keel::outcome_kind::throttled);
}

TEST_CASE("asio http: an attempt with no time left, or already stopped, completes through the executor",
          "[asio][http]") {
  scripted_server server;
  ::asio::io_context io;
  keel::asio::http_client client(io.get_executor(), {.base_url = server.url()});
  http::client sync_client({.base_url = server.url()});
  auto ex = client.exchange({.path = "/ok"});

  one_attempt none(read_op, 0ms);
  landing<absl::Status> a;
  ex(none.a, a.handler());
  CHECK_FALSE(a.done());
  REQUIRE(run_until(io, [&] { return a.done(); }));
  CHECK(absl::IsDeadlineExceeded(*a.result));
  CHECK(keel::not_started(*a.result));

  std::stop_source stop;
  stop.request_stop();
  one_attempt stopped(read_op, 1s, stop.get_token());
  landing<absl::Status> b;
  ex(stopped.a, b.handler());
  CHECK_FALSE(b.done());
  REQUIRE(run_until(io, [&] { return b.done(); }));
  one_attempt sync_stopped(read_op, 1s, stop.get_token());
  const absl::Status want = sync_client.exchange({.path = "/ok"})(sync_stopped.a);
  CHECK(b.result->code() == want.code());
  CHECK(b.result->message() == want.message());
  CHECK(keel::not_started(*b.result));
  CHECK(server.requests().empty());  // neither went out
}

TEST_CASE("asio http: the handler's executor delivers, and the operation keeps it busy until then",
          "[asio][http]") {
  scripted_server server;
  ::asio::io_context loop_io;
  ::asio::io_context handler_io;
  keel::asio::http_client client(loop_io.get_executor(), {.base_url = server.url()});
  auto loop_work = ::asio::make_work_guard(loop_io);
  std::thread loop_thread([&] { loop_io.run(); });

  one_attempt a(read_op, 2s);
  std::optional<absl::Status> result;
  std::thread::id where;
  client.exchange({.path = "/ok"})(a.a, ::asio::bind_executor(handler_io, [&](absl::Status s) {
                                     result = s;
                                     where = std::this_thread::get_id();
                                   }));
  // The operation holds work on handler_io: run() returns once it was delivered.
  handler_io.run();
  loop_work.reset();
  loop_thread.join();
  REQUIRE(result.has_value());
  CHECK(result->ok());
  CHECK(where == std::this_thread::get_id());
}

TEST_CASE("asio http: a hung upstream is left at once when the handler's cancellation slot fires",
          "[asio][http]") {
  scripted_server server;
  http::client sync_client({.base_url = server.url()});
  ::asio::io_context io;
  keel::asio::http_client client(io.get_executor(), {.base_url = server.url()});
  auto ex = client.exchange({.path = "/hang"});

  one_attempt a(read_op, 60s);
  ::asio::cancellation_signal cancel;
  landing<absl::Status> got;
  ex(a.a, ::asio::bind_cancellation_slot(cancel.slot(), got.handler()));
  REQUIRE(run_until(io, [&] { return server.hanging() == 1; }));
  const auto asked = std::chrono::steady_clock::now();
  cancel.emit(::asio::cancellation_type::terminal);
  REQUIRE(run_until(io, [&] { return got.done(); }));
  CHECK(std::chrono::steady_clock::now() - asked < 5s);  // not the 60 s the attempt had
  REQUIRE(keel_test::eventually([&] { return server.left() == 1; }));

  // The status the blocking client gives a transfer stopped after sending.
  std::stop_source stop;
  one_attempt sa(read_op, 60s, stop.get_token());
  keel_test::async_call<absl::Status> sync_run([&] { return sync_client.exchange({.path = "/hang"})(sa.a); });
  REQUIRE(keel_test::eventually([&] { return server.hanging() == 2; }));
  stop.request_stop();
  const absl::Status want = sync_run.get();
  CHECK(got.result->code() == want.code());
  CHECK(got.result->message() == want.message());
  CHECK(absl::IsDeadlineExceeded(*got.result));
  CHECK_FALSE(keel::not_started(*got.result));
  CHECK(got.calls == 1);

  // A cancellation that comes before the transfer started stops it as well.
  one_attempt b(read_op, 60s);
  ::asio::cancellation_signal early;
  landing<absl::Status> early_got;
  ex(b.a, ::asio::bind_cancellation_slot(early.slot(), early_got.handler()));
  early.emit(::asio::cancellation_type::partial);
  REQUIRE(run_until(io, [&] { return early_got.done(); }));
  CHECK(absl::IsDeadlineExceeded(*early_got.result));
}

TEST_CASE("asio http: a hung upstream is left at once when the attempt's stop token is requested",
          "[asio][http]") {
  scripted_server server;
  ::asio::io_context io;
  keel::asio::http_client client(io.get_executor(), {.base_url = server.url()});
  auto ex = client.exchange({.path = "/hang"});

  // The attempt stopped (a deadline cut, a lost hedge): DeadlineExceeded.
  std::stop_source attempt_stop;
  one_attempt a(read_op, 60s, attempt_stop.get_token());
  landing<absl::Status> got;
  ex(a.a, got.handler());
  REQUIRE(run_until(io, [&] { return server.hanging() == 1; }));
  // Requested from another thread, as a deadline timer or a hedge does.
  std::thread([&] { attempt_stop.request_stop(); }).join();
  const auto asked = std::chrono::steady_clock::now();
  REQUIRE(run_until(io, [&] { return got.done(); }));
  CHECK(std::chrono::steady_clock::now() - asked < 5s);
  CHECK(absl::IsDeadlineExceeded(*got.result));
  REQUIRE(keel_test::eventually([&] { return server.left() == 1; }));

  // The call cancelled (the caller went away): Cancelled.
  std::stop_source call_stop;
  one_attempt c(write_op, 60s, call_stop.get_token(), call_stop.get_token());
  landing<absl::Status> cancelled;
  ex(c.a, cancelled.handler());
  REQUIRE(run_until(io, [&] { return server.hanging() == 2; }));
  call_stop.request_stop();
  REQUIRE(run_until(io, [&] { return cancelled.done(); }));
  CHECK(absl::IsCancelled(*cancelled.result));
  CHECK(keel::default_classifier{}(*cancelled.result, write_op) == keel::outcome_kind::cancelled);
  REQUIRE(keel_test::eventually([&] { return server.left() == 2; }));
}

TEST_CASE("asio http: 200 transfers in flight at once on one thread, and no thread more", "[asio][http]") {
  constexpr int n = 200;
  scripted_server server(n + 8, n);  // answers once all n are held at once
  ::asio::io_context io;
  keel::asio::http_client client(io.get_executor(), {.base_url = server.url()});
  auto ex = client.exchange({.path = "/gate"}, json_object);

  {  // the server's pool and the client's loop are up
    one_attempt warm(read_op, 5s);
    landing<absl::Status> done;
    client.exchange({.path = "/ok"})(warm.a, done.handler());
    REQUIRE(run_until(io, [&] { return done.done(); }));
  }
  const int threads_before = process_threads();
  // Started one after another, each once the server holds the one before
  // (its listen backlog is short: a burst of connects would wait for SYN
  // retransmits); all n are in flight together once the last arrives.
  std::vector<std::unique_ptr<one_attempt>> attempts;
  std::vector<landing<absl::StatusOr<std::string>>> got(n);
  for (int i = 0; i < n; ++i) {
    attempts.push_back(std::make_unique<one_attempt>(read_op, 60s));
    ex(attempts.back()->a, got[static_cast<std::size_t>(i)].handler());
    if (i + 1 < n) REQUIRE(run_until(io, [&] { return server.gate_peak() == i + 1; }));
  }
  int threads_during = 0;
  REQUIRE(run_until(io, [&] {
    if (server.gate_peak() == n && threads_during == 0) threads_during = process_threads();
    for (const auto& g : got)
      if (!g.done()) return false;
    return true;
  }));
  CHECK(server.gate_peak() == n);  // all were held by the server at the same time
  CHECK(threads_during == threads_before);
  int ok = 0;
  for (const auto& g : got) {
    if (g.result->ok() && **g.result == R"({"ok":true})" && g.thread == std::this_thread::get_id()) ++ok;
    CHECK(g.calls == 1);
  }
  CHECK(ok == n);
}

TEST_CASE("asio http: destroying the client completes what is in flight as cancelled", "[asio][http]") {
  scripted_server server;
  ::asio::io_context io;
  auto client = std::make_unique<keel::asio::http_client>(io.get_executor(), http::client_options{.base_url = server.url()});
  auto ex = client->exchange({.path = "/hang"}, json_object);
  auto ok = client->exchange({.path = "/ok"}, json_object);

  std::vector<std::unique_ptr<one_attempt>> attempts;
  std::vector<landing<absl::StatusOr<std::string>>> got(3);
  for (auto& g : got) {
    attempts.push_back(std::make_unique<one_attempt>(read_op, 60s));
    ex(attempts.back()->a, g.handler());
  }
  REQUIRE(run_until(io, [&] { return server.hanging() == 3; }));
  client.reset();
  REQUIRE(run_until(io, [&] {
    for (const auto& g : got)
      if (!g.done()) return false;
    return true;
  }));
  for (const auto& g : got) {
    CHECK(absl::IsCancelled(g.result->status()));
    CHECK(g.calls == 1);
  }
  REQUIRE(keel_test::eventually([&] { return server.left() == 3; }));

  // A provider that outlived its client is refused, not undefined.
  one_attempt late(read_op, 1s);
  landing<absl::StatusOr<std::string>> after;
  ok(late.a, after.handler());
  REQUIRE(run_until(io, [&] { return after.done(); }));
  CHECK(absl::IsCancelled(after.result->status()));
  // Nothing is left on the loop: run() returns.
  io.restart();
  io.run();
}

TEST_CASE("asio http: a stream's chunks reach the writer in order, as the loop reads them", "[asio][http][stream]") {
  constexpr int n = 40;
  keel_test::sse_server server(n);
  ::asio::io_context io;
  keel::asio::http_client client(io.get_executor(), {.base_url = server.url()});
  auto provider = client.stream(
      {.path = "/normal", .body = R"({"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]})"});

  keel::stream_guard guard({.first_token = 5s, .stall = 5s});
  keel::call call(keel::real_clock{}.now(), {.timeout = 20s});
  std::vector<std::string> shown;
  std::vector<std::thread::id> shown_on;
  keel::token_stream stream(guard, [&](std::string_view t) {
    shown.emplace_back(t);
    shown_on.push_back(std::this_thread::get_id());
  });
  // The blocking pipeline's attempt runs the asynchronous provider and the
  // loop on this thread until it completes (as a fiber runner would park).
  auto attempt = [&](const keel::attempt& a, keel::stream_writer& w) -> absl::Status {
    landing<absl::Status> got;
    provider(a, w, got.handler());
    if (!run_until(io, [&] { return got.done(); })) return absl::DeadlineExceededError("test: loop stuck");
    return *got.result;
  };
  const absl::StatusOr<keel::stream_result> r =
      keel::pipeline(keel::retry({.max_attempts = 1})).run(call, stream.attempts(attempt));
  REQUIRE(r.ok());
  CHECK(r->complete);
  CHECK(r->tokens == n);
  CHECK(r->usage.completion_tokens == n);
  REQUIRE(shown.size() == static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) CHECK(shown[static_cast<std::size_t>(i)] == "t" + std::to_string(i) + " ");
  for (const std::thread::id& t : shown_on) CHECK(t == std::this_thread::get_id());
  CHECK(r->upstream.status == 200);
}

TEST_CASE("asio http: a stream whose first token is late is stopped at its budget, and the server sees it",
          "[asio][http][stream]") {
  keel_test::sse_server server(2, 10s);  // the first token would come after 10 s
  ::asio::io_context io;
  keel::asio::http_client client(io.get_executor(), {.base_url = server.url()});
  auto provider = client.stream({.path = "/slow_first", .body = R"({"stream":true})"});

  keel::stream_guard guard({.first_token = 300ms, .stall = 5s});
  keel::call call(keel::real_clock{}.now(), {.timeout = 20s});
  keel::token_stream stream(guard, [](std::string_view) {});
  auto attempt = [&](const keel::attempt& a, keel::stream_writer& w) -> absl::Status {
    landing<absl::Status> got;
    provider(a, w, got.handler());
    if (!run_until(io, [&] { return got.done(); })) return absl::InternalError("test: loop stuck");
    return *got.result;
  };
  const auto start = std::chrono::steady_clock::now();
  const absl::StatusOr<keel::stream_result> r =
      keel::pipeline(keel::retry({.max_attempts = 1})).run(call, stream.attempts(attempt));
  CHECK(std::chrono::steady_clock::now() - start < 8s);  // not the 10 s the stream would take
  REQUIRE_FALSE(r.ok());
  CHECK(absl::IsDeadlineExceeded(r.status()));
  REQUIRE(keel_test::eventually([&] { return server.aborted() == 1; }));
}

TEST_CASE("asio http: a warm transfer allocates nothing on keel's side", "[asio][http][alloc]") {
  scripted_server server;
  ::asio::io_context io;
  keel::asio::http_client client(io.get_executor(), {.base_url = server.url()});
  auto ex = client.exchange({.path = "/ok", .body = "{}"});
  auto once = [&] {
    one_attempt w(write_op, 2s);
    landing<absl::Status> got;
    ex(w.a, got.handler());
    REQUIRE(run_until(io, [&] { return got.done(); }));
    REQUIRE(got.result->ok());
  };
  for (int i = 0; i < 5; ++i) once();  // the pools grow, the connection opens
  keel_test::count_allocations allocs;
  for (int i = 0; i < 20; ++i) once();
  const std::int64_t n = allocs.count();
  if (keel_test::allocations_counted()) CHECK(n == 0);  // libcurl's go through malloc, not counted here
}

TEST_CASE("asio http: a client on an executor other than an io_context's (a strand) works alike", "[asio][http]") {
  scripted_server server;
  ::asio::io_context io;
  keel::asio::http_client client(::asio::make_strand(io), {.base_url = server.url()});
  one_attempt a(read_op, 2s);
  landing<absl::StatusOr<std::string>> got;
  client.exchange({.path = "/ok"}, json_object)(a.a, got.handler());
  REQUIRE(run_until(io, [&] { return got.done(); }));
  REQUIRE(got.result->ok());
  CHECK(**got.result == R"({"ok":true})");

  one_attempt h(read_op, 60s);
  ::asio::cancellation_signal cancel;
  landing<absl::Status> hung;
  client.exchange({.path = "/hang"})(h.a, ::asio::bind_cancellation_slot(cancel.slot(), hung.handler()));
  REQUIRE(run_until(io, [&] { return server.hanging() == 1; }));
  cancel.emit(::asio::cancellation_type::terminal);
  REQUIRE(run_until(io, [&] { return hung.done(); }));
  CHECK(absl::IsDeadlineExceeded(*hung.result));
  REQUIRE(keel_test::eventually([&] { return server.left() == 1; }));
}

TEST_CASE("asio http: a stream that stalls after its first tokens is stopped, and partial", "[asio][http][stream]") {
  keel_test::sse_server server(3, 10s);  // three tokens, then only keep-alives for 10 s
  ::asio::io_context io;
  keel::asio::http_client client(io.get_executor(), {.base_url = server.url()});
  auto provider = client.stream({.path = "/stall", .body = R"({"stream":true})"});

  keel::stream_guard guard({.first_token = 5s, .stall = 300ms});
  keel::call call(keel::real_clock{}.now(), {.timeout = 20s});
  keel::token_stream stream(guard, [](std::string_view) {});
  auto attempt = [&](const keel::attempt& a, keel::stream_writer& w) -> absl::Status {
    landing<absl::Status> got;
    provider(a, w, got.handler());
    if (!run_until(io, [&] { return got.done(); })) return absl::InternalError("test: loop stuck");
    return *got.result;
  };
  const auto start = std::chrono::steady_clock::now();
  const absl::StatusOr<keel::stream_result> r =
      keel::pipeline(keel::retry({.max_attempts = 1})).run(call, stream.attempts(attempt));
  CHECK(std::chrono::steady_clock::now() - start < 8s);
  REQUIRE(r.ok());
  CHECK(r->partial);
  CHECK(r->reason == keel::stream_stop::stall);
  CHECK(r->text == "t0 t1 t2 ");
  REQUIRE(keel_test::eventually([&] { return server.aborted() == 1; }));
}

TEST_CASE("asio http: the attempt's time left ends a transfer on the loop's timer, as libcurl's timeout",
          "[asio][http]") {
  scripted_server server;
  http::client sync_client({.base_url = server.url()});
  ::asio::io_context io;
  keel::asio::http_client client(io.get_executor(), {.base_url = server.url()});
  auto ex = client.exchange({.path = "/hang"});

  // A long transfer first: its timeout is the one armed when the short one comes.
  one_attempt long_one(read_op, 3s);
  landing<absl::Status> long_got;
  ex(long_one.a, long_got.handler());
  REQUIRE(run_until(io, [&] { return server.hanging() == 1; }));
  one_attempt short_one(read_op, 300ms);
  landing<absl::Status> short_got;
  const auto start = std::chrono::steady_clock::now();
  ex(short_one.a, short_got.handler());
  REQUIRE(run_until(io, [&] { return short_got.done(); }));
  CHECK(std::chrono::steady_clock::now() - start < 2500ms);  // its own 300 ms, not the 3 s armed before
  CHECK_FALSE(long_got.done());

  one_attempt sa(read_op, 300ms);
  const absl::Status want = sync_client.exchange({.path = "/hang"})(sa.a);
  CHECK(absl::IsDeadlineExceeded(want));
  CHECK(short_got.result->code() == want.code());
  CHECK(short_got.result->message() == want.message());

  REQUIRE(run_until(io, [&] { return long_got.done(); }));
  CHECK(absl::IsDeadlineExceeded(*long_got.result));
  // Nothing is left on the loop: run() returns.
  io.restart();
  io.run();
}

// keel::asio::async_run (keel/asio/run.hpp) runs keel's pipelines on fibers:
// the event-loop client is the asynchronous provider it was built for.

TEST_CASE("asio http: async_run drives the client through a retry, on the loop's one thread", "[asio][http][run]") {
  scripted_server server;
  ::asio::io_context io;
  keel::asio::http_client client(io.get_executor(), {.base_url = server.url()});
  auto ex = client.exchange({.path = "/503-then-ok"}, json_object);
  const auto pipe = keel::pipeline(keel::retry({.max_attempts = 3}, keel::constant_backoff{.delay_each = 1ms}));
  keel::call call(keel::real_clock{}.now(), {.timeout = 5s});
  landing<absl::StatusOr<std::string>> got;
  keel::asio::async_run(io.get_executor(), pipe, call, ex, got.handler());
  REQUIRE(run_until(io, [&] { return got.done(); }));
  REQUIRE(got.result->ok());
  CHECK(**got.result == R"({"ok":true})");
  CHECK(call.record().attempts == 2);
  CHECK(got.thread == std::this_thread::get_id());
}

TEST_CASE("asio http: a cancelled async_run stops its transfer, and the server sees the client leave",
          "[asio][http][run]") {
  scripted_server server;
  ::asio::io_context io;
  keel::asio::http_client client(io.get_executor(), {.base_url = server.url()});
  auto ex = client.exchange({.path = "/hang"});
  const auto pipe = keel::pipeline(keel::retry({.max_attempts = 1}));
  keel::call call(keel::real_clock{}.now(), {.timeout = 60s});
  ::asio::cancellation_signal cancel;
  landing<absl::Status> got;
  keel::asio::async_run(io.get_executor(), pipe, call, ex, ::asio::bind_cancellation_slot(cancel.slot(), got.handler()));
  REQUIRE(run_until(io, [&] { return server.hanging() == 1; }));
  const auto asked = std::chrono::steady_clock::now();
  cancel.emit(::asio::cancellation_type::terminal);
  REQUIRE(run_until(io, [&] { return got.done(); }));
  CHECK(std::chrono::steady_clock::now() - asked < 5s);
  CHECK(absl::IsCancelled(*got.result));
  REQUIRE(keel_test::eventually([&] { return server.left() == 1; }));
}

TEST_CASE("asio http: many async_runs in flight share the loop's thread", "[asio][http][run]") {
  constexpr int n = 32;
  scripted_server server(n + 8);
  ::asio::io_context io;
  keel::asio::http_client client(io.get_executor(), {.base_url = server.url()});
  auto ex = client.exchange({.path = "/ok"}, json_object);
  const auto pipe = keel::pipeline(keel::retry({.max_attempts = 2}));
  std::vector<std::unique_ptr<keel::call>> calls;
  std::vector<landing<absl::StatusOr<std::string>>> got(n);
  for (auto& g : got) {
    calls.push_back(std::make_unique<keel::call>(keel::real_clock{}.now(), keel::call_options{.timeout = 30s}));
    keel::asio::async_run(io.get_executor(), pipe, *calls.back(), ex, g.handler());
  }
  REQUIRE(run_until(io, [&] {
    for (const auto& g : got)
      if (!g.done()) return false;
    return true;
  }));
  for (const auto& g : got) {
    CHECK(g.result->ok());
    CHECK(g.thread == std::this_thread::get_id());
  }
}
