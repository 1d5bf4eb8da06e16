// keel_async_sim: 20,000 calls in flight, through asynchronous runs on two
// executor threads and through the synchronous API (a thread per call),
// with retries and hedges on. Real time: each run takes as long as the
// slowest call (10 s by default).
//
//   keel_async_sim [--mode async|sync|both] [--calls N] [--min-ms A] [--max-ms B]
//
// The upstream answers each attempt after a delay drawn uniformly from
// [A, B] ms; one attempt in 20 is refused with 503 (retried after 100 ms);
// a call whose primary has not answered after 90% of B is hedged. keel's
// added latency is the time from the winning attempt's answer (its timer
// firing) to the caller holding the result. Printed per mode: wall time,
// CPU per 1,000 calls, peak RSS and threads, added latency p50/p99/max.
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <asio/bind_cancellation_slot.hpp>
#include <asio/executor_work_guard.hpp>
#include <asio/io_context.hpp>
#include <asio/steady_timer.hpp>

#include "keel/asio/executor.hpp"
#include "keel/asio/run.hpp"
#include "keel/compose/executor.hpp"
#include "keel/compose/hedge.hpp"
#include "keel/compose/pipeline.hpp"
#include "keel/policy/backoff.hpp"
#include "keel/policy/retry.hpp"
#include "keel/policy/retry_budget.hpp"

using namespace std::chrono_literals;
using steady = std::chrono::steady_clock;

namespace {

struct options {
  std::string mode = "both";
  int calls = 20000;
  int min_ms = 1000;
  int max_ms = 10000;
};

// What the winning attempt's answer time was, per call: the provider writes
// it into the call's slot (attempts of one call share it).
struct answer_times {
  std::vector<std::atomic<steady::rep>> at;
  explicit answer_times(int n) : at(static_cast<std::size_t>(n)) {}
};

struct upstream {
  using result_type = absl::StatusOr<int>;
  answer_times* times;
  int call;
  int min_ms, max_ms;
  template <class Token>
  auto operator()(const keel::attempt&, Token&& token) const {
    return asio::async_initiate<Token, void(result_type)>(
        [this](auto handler) {
          static thread_local std::mt19937 random(std::random_device{}());
          const int ms = min_ms + static_cast<int>(random() % static_cast<unsigned>(max_ms - min_ms + 1));
          const bool refuse = random() % 20 == 0;
          auto timer = std::make_shared<asio::steady_timer>(asio::get_associated_executor(handler),
                                                            std::chrono::milliseconds(ms));
          timer->async_wait(asio::bind_cancellation_slot(
              asio::get_associated_cancellation_slot(handler),
              [timer, refuse, t = times, c = call, h = std::move(handler)](std::error_code ec) mutable {
                if (ec) return std::move(h)(result_type(absl::CancelledError("stopped")));
                if (refuse) return std::move(h)(result_type(absl::UnavailableError("503")));
                t->at[static_cast<std::size_t>(c)].store(steady::now().time_since_epoch().count());
                std::move(h)(result_type(c));
              }));
        },
        token);
  }
};

long rss_peak_kb() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::stol(line.substr(6));
  return -1;
}
int threads_now() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  return -1;
}
double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

struct result {
  int ok = 0, failed = 0, peak_threads = 0;
  std::vector<double> added_us;
};

void report(const char* mode, const options& o, const result& r, double wall_s, double cpu_s) {
  std::vector<double> a = r.added_us;
  std::sort(a.begin(), a.end());
  auto pct = [&](double p) { return a.empty() ? 0.0 : a[std::min(a.size() - 1, static_cast<std::size_t>(p * a.size()))]; };
  std::printf(
      "%-5s calls %d ok %d failed %d | wall %.1f s | CPU %.1f ms per 1,000 calls | peak RSS %.1f MB | peak threads %d | "
      "added latency p50 %.0f us p99 %.0f us max %.0f us\n",
      mode, o.calls, r.ok, r.failed, wall_s, cpu_s * 1000.0 / (o.calls / 1000.0), rss_peak_kb() / 1024.0,
      r.peak_threads, pct(0.5), pct(0.99), a.empty() ? 0.0 : a.back());
  std::fflush(stdout);
}

template <class Hedge>
auto make_pipeline(Hedge& hedger, keel::retry_budget& budget) {
  return keel::pipeline(hedger, keel::retry({.max_attempts = 3, .budget = &budget},
                                            keel::constant_backoff{.delay_each = 100ms}));
}

keel::hedge_options hedging(const options& o, keel::retry_budget& budget) {
  return {.delay = std::chrono::milliseconds(o.max_ms * 9 / 10), .max_hedges = 1, .budget = &budget,
          .primary_on_caller_thread = true};
}

void run_async(const options& o) {
  asio::io_context io0(1), io1(1);
  asio::io_context* io[2] = {&io0, &io1};
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work[2];
  for (int i = 0; i < 2; ++i) work[i].emplace(io[i]->get_executor());
  keel::asio::fiber_executor fibers(io[0]->get_executor());
  keel::retry_budget budget({.ratio = 1.0, .min_per_second = 1000});
  keel::hedge hedger(hedging(o, budget), fibers);
  const auto pipe = make_pipeline(hedger, budget);
  answer_times times(o.calls);
  std::vector<std::optional<keel::call>> calls(static_cast<std::size_t>(o.calls));
  std::mutex mu;
  result r;
  std::atomic<int> left{o.calls};
  const double cpu0 = cpu_seconds();
  const auto t0 = steady::now();
  std::thread runners[2] = {std::thread([&] { io[0]->run(); }), std::thread([&] { io[1]->run(); })};
  for (int i = 0; i < o.calls; ++i) {
    auto& c = calls[static_cast<std::size_t>(i)];
    c.emplace(keel::real_clock{}.now(), keel::call_options{.timeout = std::chrono::milliseconds(o.max_ms * 3)});
    keel::asio::async_run(io[i % 2]->get_executor(), pipe, *c, upstream{&times, i, o.min_ms, o.max_ms},
                          [&, i](absl::StatusOr<int> answer) {
                            const auto now = steady::now().time_since_epoch().count();
                            std::lock_guard l(mu);
                            if (answer.ok()) {
                              ++r.ok;
                              r.added_us.push_back(
                                  static_cast<double>(now - times.at[static_cast<std::size_t>(i)].load()) / 1e3);
                            } else {
                              ++r.failed;
                            }
                            if (left.fetch_sub(1) == 1)
                              for (auto& w : work) w.reset();
                          });
  }
  r.peak_threads = threads_now();
  for (auto& t : runners) t.join();
  report("async", o, r, std::chrono::duration<double>(steady::now() - t0).count(), cpu_seconds() - cpu0);
}

void run_sync(const options& o) {
  // The provider's timers still run on an io_context; each call's thread
  // waits for its answer (keel::asio::awaited off a fiber), as a blocking
  // client's would.
  asio::io_context io(1);
  auto work = asio::make_work_guard(io);
  std::thread loop([&] { io.run(); });
  // Hedges wait for a pool thread each; the pool holds at most 1,024.
  keel::bounded_pool pool({.threads = std::clamp(o.calls / 5, 1, 1024), .queue_capacity = 1024});
  keel::retry_budget budget({.ratio = 1.0, .min_per_second = 1000});
  keel::hedge hedger(hedging(o, budget), pool);
  const auto pipe = make_pipeline(hedger, budget);
  answer_times times(o.calls);
  std::mutex mu;
  result r;
  const double cpu0 = cpu_seconds();
  const auto t0 = steady::now();
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(o.calls));
  int started = 0;
  for (int i = 0; i < o.calls; ++i) {
    try {
      threads.emplace_back([&, i] {
        keel::call call(keel::real_clock{}.now(), {.timeout = std::chrono::milliseconds(o.max_ms * 3)});
        absl::StatusOr<int> answer =
            pipe.run(call, keel::asio::awaited(upstream{&times, i, o.min_ms, o.max_ms}, io.get_executor()));
        const auto now = steady::now().time_since_epoch().count();
        std::lock_guard l(mu);
        if (answer.ok()) {
          ++r.ok;
          r.added_us.push_back(static_cast<double>(now - times.at[static_cast<std::size_t>(i)].load()) / 1e3);
        } else {
          ++r.failed;
        }
      });
      ++started;
    } catch (const std::system_error& e) {
      std::printf("sync: thread %d could not start (%s): %d calls run\n", i, e.what(), started);
      break;
    }
  }
  r.peak_threads = threads_now();
  for (auto& t : threads) t.join();
  work.reset();
  loop.join();
  report("sync", o, r, std::chrono::duration<double>(steady::now() - t0).count(), cpu_seconds() - cpu0);
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--mode") o.mode = argv[i + 1];
    else if (k == "--calls") o.calls = std::stoi(argv[i + 1]);
    else if (k == "--min-ms") o.min_ms = std::stoi(argv[i + 1]);
    else if (k == "--max-ms") o.max_ms = std::stoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "usage: keel_async_sim [--mode async|sync|both] [--calls N] [--min-ms A] [--max-ms B]\n");
      return 2;
    }
  }
  if (o.calls < 1 || o.min_ms < 1 || o.max_ms < o.min_ms) {
    std::fprintf(stderr, "keel_async_sim: --calls >= 1 and 1 <= --min-ms <= --max-ms\n");
    return 2;
  }
  std::printf("%d calls in flight, upstream %d..%d ms, 1 in 20 refused (retried), hedge after %d ms\n", o.calls,
              o.min_ms, o.max_ms, o.max_ms * 9 / 10);
  // Async first: peak RSS is a high-water mark, so the lighter mode goes first.
  if (o.mode == "async" || o.mode == "both") run_async(o);
  if (o.mode == "sync" || o.mode == "both") run_sync(o);
  return 0;
}
