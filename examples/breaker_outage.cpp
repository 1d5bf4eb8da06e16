// breaker_outage: a provider outage contained by a circuit breaker; an
// operator forces it open, and recovery is verified by half-open probes
// before traffic returns.
//
// Four worker threads send calls every simulated second through
// keel::pipeline(retry, breakers): the breaker sits inside the retry, so it
// gates and counts each attempt, and an open breaker stops the retry instead
// of being hammered. A fifth caller uses a revoked API key the whole time;
// its 401s are permanent errors and never count against the provider.
// Time is keel's manual clock, moved one second per step by main(), so the
// story runs instantly; the threads are real.
#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "keel/compose/pipeline.hpp"
#include "keel/core/call.hpp"
#include "keel/policy/breaker_registry.hpp"
#include "keel/policy/circuit_breaker.hpp"
#include "keel/policy/retry.hpp"
#include "keel/testing/manual_clock.hpp"

using namespace std::chrono_literals;

namespace {

long long secs(keel::duration d) { return std::chrono::duration_cast<std::chrono::seconds>(d).count(); }

struct tally {
  std::atomic<int> calls{0}, ok{0}, failed{0}, refused{0}, bad_key{0}, provider_hits{0};
  void reset() {
    for (auto* c : {&calls, &ok, &failed, &refused, &bad_key, &provider_hits}) c->store(0);
  }
};

}  // namespace

int main() {
  keel::testing::manual_clock clock;
  const keel::time_point t0 = clock.now();
  std::atomic<bool> provider_up{true};
  tally step;

  // One breaker per endpoint/model/region; it opens for 5 s, then 10 s,
  // 20 s... on repeated trips, and lets 3 probes through when half-open.
  keel::breaker_registry breakers({.breaker = {
                                       .window_calls = 20,
                                       .minimum_calls = 10,
                                       .failure_rate_threshold = 0.5,
                                       .open_duration_for = [](int trips) { return keel::duration(5s) * (1 << std::min(trips - 1, 3)); },
                                       .half_open_probes = 3,
                                       .on_state_change =
                                           [&](const keel::breaker_transition& t) {
                                             std::printf("          breaker: %s -> %s\n",
                                                         std::string(keel::to_string(t.from)).c_str(),
                                                         std::string(keel::to_string(t.to)).c_str());
                                           },
                                   }});
  auto pipe = keel::pipeline(keel::retry({.max_attempts = 2}, keel::constant_backoff{.delay_each = 0ms}), breakers)
                  .in(keel::environment{clock});

  auto provider = [&](const keel::attempt& a) -> absl::StatusOr<std::string> {
    step.provider_hits.fetch_add(1);
    if (a.labels().tenant == "revoked") return absl::UnauthenticatedError("invalid API key");
    if (!provider_up.load()) return absl::UnavailableError("503 from the provider");
    return std::string("feedback");
  };
  auto one_call = [&](std::string_view tenant) {
    keel::call call(clock.now(), {.timeout = 3s,
                                  .labels = {.tenant = tenant, .model = "m-large", .endpoint = "api.llm.example",
                                             .region = "eu"}});
    const absl::StatusOr<std::string> r = pipe.run(call, provider);
    step.calls.fetch_add(1);
    if (r.ok()) {
      step.ok.fetch_add(1);
    } else if (r.status().code() == absl::StatusCode::kUnauthenticated) {
      step.bad_key.fetch_add(1);
    } else if (keel::refused_by(r.status()).value_or("").rfind("breaker:", 0) == 0) {
      step.refused.fetch_add(1);
    } else {
      step.failed.fetch_add(1);
    }
  };

  constexpr int kWorkers = 4, kCallsEach = 5, kSeconds = 22;
  std::barrier start(kWorkers + 2), done(kWorkers + 2);
  std::vector<std::jthread> workers;
  for (int w = 0; w < kWorkers; ++w) {
    workers.emplace_back([&] {
      for (int s = 0; s < kSeconds; ++s) {
        start.arrive_and_wait();
        for (int i = 0; i < kCallsEach; ++i) one_call("acme");
        done.arrive_and_wait();
      }
    });
  }
  workers.emplace_back([&] {  // the tenant with a revoked key
    for (int s = 0; s < kSeconds; ++s) {
      start.arrive_and_wait();
      for (int i = 0; i < 2; ++i) one_call("revoked");
      done.arrive_and_wait();
    }
  });

  const keel::failure_domain domain{.endpoint = "api.llm.example", .model = "m-large", .region = "eu"};
  std::printf("t (s)  provider  calls   ok  failed  refused-fast  bad-key  provider-hits  breaker\n");
  for (int s = 0; s < kSeconds; ++s) {
    const keel::time_point now = clock.now();
    if (s == 3) {
      provider_up = false;
      std::printf("--- t=%llds: the provider starts failing (503s)\n", secs(now - t0));
    }
    if (s == 10) {
      std::printf("--- t=%llds: the provider's status page confirms an outage: operator forces the breaker open\n",
                  secs(now - t0));
      if (const absl::Status forced = breakers.force_open(domain, now); !forced.ok()) {
        std::printf("%s\n", std::string(forced.message()).c_str());
      }
    }
    if (s == 14) {
      provider_up = true;
      std::printf("--- t=%llds: the provider quietly recovers (the breaker stays forced open)\n", secs(now - t0));
    }
    if (s == 17) {
      std::printf("--- t=%llds: operator hands the breaker back to automatic: probes first, then traffic\n",
                  secs(now - t0));
      breakers.automatic(domain, now);
    }
    step.reset();
    start.arrive_and_wait();  // this second's calls...
    done.arrive_and_wait();   // ...are made
    const keel::breaker_figures b = breakers.breaker_for(domain).figures(now);
    std::printf("%5lld  %-8s  %5d  %3d  %6d  %12d  %7d  %13d  %s", secs(now - t0), provider_up ? "up" : "DOWN",
                step.calls.load(), step.ok.load(), step.failed.load(), step.refused.load(), step.bad_key.load(),
                step.provider_hits.load(), std::string(keel::to_string(b.state)).c_str());
    if (b.state == keel::breaker_state::open) std::printf(" (%llds left)", secs(b.open_remaining));
    std::printf("\n");
    clock.advance(1s);
  }
  workers.clear();

  std::printf("\nevery breaker, as an operator would list them:\n");
  for (const keel::breaker_entry& e : breakers.list(clock.now())) {
    std::printf("  %-50s %-13s %d calls in window, %.0f%% failed\n", e.domain.c_str(),
                std::string(keel::to_string(e.state.state)).c_str(), e.state.calls, 100 * e.state.failure_rate);
  }
  std::printf("The bad key's 401s never counted: one tenant's credential is not a provider outage.\n");
  return 0;
}
