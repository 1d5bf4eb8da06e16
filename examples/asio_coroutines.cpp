// asio_coroutines: keel inside an Asio coroutine service, one thread, no
// thread per call. 2,000 requests are in flight at once; each co_awaits a
// keel pipeline (retry with a budget, a breaker, an adaptive timeout) around
// a simulated model whose answer comes from an Asio timer: 50 to 150 ms, one
// in ten refused with 503. The retries' backoffs wait on the same thread's
// timers; the process keeps its one thread throughout.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>
#include <string>

#include <asio/bind_cancellation_slot.hpp>
#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/io_context.hpp>
#include <asio/steady_timer.hpp>
#include <asio/use_awaitable.hpp>

#include "keel/asio/run.hpp"
#include "keel/compose/pipeline.hpp"
#include "keel/policy/adaptive_timeout.hpp"
#include "keel/policy/circuit_breaker.hpp"
#include "keel/policy/retry.hpp"
#include "keel/policy/retry_budget.hpp"

using namespace std::chrono_literals;

// The model: an asynchronous provider. Its answer is a timer's; a stopped
// attempt (the adaptive timeout's cut) cancels the timer through the slot.
struct simulated_model {
  using result_type = absl::StatusOr<std::string>;
  template <class Token>
  auto operator()(const keel::attempt& a, Token&& token) const {
    return asio::async_initiate<Token, void(result_type)>(
        [](auto handler, int number) {
          static thread_local std::mt19937 random(7);
          auto timer = std::make_shared<asio::steady_timer>(asio::get_associated_executor(handler),
                                                            std::chrono::milliseconds(50 + random() % 100));
          const bool refuse = random() % 10 == 0;
          timer->async_wait(asio::bind_cancellation_slot(
              asio::get_associated_cancellation_slot(handler),
              [timer, refuse, number, h = std::move(handler)](std::error_code ec) mutable {
                if (ec) return std::move(h)(result_type(absl::CancelledError("attempt stopped")));
                if (refuse) return std::move(h)(result_type(absl::UnavailableError("503 from the model")));
                std::move(h)(result_type("answer after attempt " + std::to_string(number)));
              }));
        },
        token, a.number);
  }
};

int threads() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  return -1;
}

int main() {
  asio::io_context io(1);
  keel::retry_budget budget({.ratio = 0.5, .min_per_second = 100});
  keel::circuit_breaker breaker({.name = "model"});
  keel::adaptive_timeout timeouts;
  const auto pipe = keel::pipeline(keel::retry({.max_attempts = 3, .budget = &budget}), breaker, timeouts);

  std::atomic<int> answered{0}, failed{0}, attempts{0}, peak_threads{0};
  auto request = [&](int) -> asio::awaitable<void> {
    keel::call call(keel::real_clock{}.now(), {.timeout = 2s});
    absl::StatusOr<std::string> r =
        co_await keel::asio::async_run(io.get_executor(), pipe, call, simulated_model{}, asio::use_awaitable);
    (r.ok() ? answered : failed) += 1;
    attempts += call.record().attempts;
    peak_threads = std::max(peak_threads.load(), threads());
  };
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 2000; ++i) asio::co_spawn(io, request(i), asio::detached);
  io.run();
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
  std::printf("2000 requests in %lld ms on one thread: %d answered, %d failed, %d attempts (%d retries); "
              "threads in the process at most %d\n",
              static_cast<long long>(ms.count()), answered.load(), failed.load(), attempts.load(),
              attempts.load() - 2000, peak_threads.load());
  return answered.load() >= 1990 ? 0 : 1;  // three refusals in a row: about 1 in 1,000
}
