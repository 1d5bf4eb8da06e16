// seed_timeline: the seed's 3-second request through the seed's whole plan.
//
// The plan is ONE pipeline, built once at startup, outer to inner:
//
//   fallback -> admission -> bulkhead -> time_limit -> hedge -> retry
//            -> breaker registry -> adaptive timeout -> model
//
// One deadline is spent once. Today the model stalls: the model stage gets
// at most 1000 ms of what is left, the hedge races a second attempt inside
// that same stage, both reads time out and are closed, and the fallback gets
// only what remains (minus the response reserve), never a fresh 3 s. It
// marks the answer degraded and names itself as the serving path.
//
// The clock is keel's manual clock, so the story runs instantly and the same
// every time; main() moves it the way the world would (the part marked
// "driver"). In a service the clock is keel::real_clock (the service's
// environment in `.in(env)`, and no clock argument to the hedge) and the model really waits.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <thread>

#include "keel/keel.hpp"
#include "keel/testing/manual_clock.hpp"
#include "keel/testing/scripted_provider.hpp"

using namespace std::chrono_literals;
namespace kt = keel::testing;

namespace {

long long ms(keel::duration d) { return std::chrono::duration_cast<std::chrono::milliseconds>(d).count(); }

// The model client: a read that times out is cancelled and its connection
// closed, which takes 100 ms (the seed's 1,300-1,400 ms).
struct model_client {
  kt::scripted_provider<std::string>* model;
  kt::manual_clock clock;
  std::atomic<int>* closing;
  absl::StatusOr<std::string> operator()(const keel::attempt& a) const {
    absl::StatusOr<std::string> r = (*model)(a);
    if (r.status().code() == absl::StatusCode::kDeadlineExceeded) {
      closing->fetch_add(1);
      clock.sleep_until(clock.now() + 100ms, {});
    }
    return r;
  }
};

}  // namespace

int main() {
  kt::manual_clock clock;

  // --- Built once at startup, shared by every request. ---
  keel::admission quotas({.tenant_defaults = {.rate = 20, .burst = 40, .max_in_flight = 8},
                          .model_defaults = {.max_in_flight = 64}});
  keel::bulkhead pools({.classes = {{.name = "interactive", .capacity = 24, .max_queue = 48},
                                    {.name = "batch", .capacity = 8, .max_queue = 16},
                                    {.name = "recovery", .capacity = 8}}});
  keel::retry_budget budget({.ratio = 0.1});
  keel::bounded_pool hedge_pool({.threads = 2, .queue_capacity = 8});
  // Hedge after the learned p95 (400 ms until enough answers are known);
  // the retry inside deposits each call into the budget, the hedge spends it.
  keel::deadline_timer timer{clock};  // starts the hedges on the story's clock
  keel::hedge hedger(
      {.delay = 400ms, .percentile = 0.95, .min_delay = 100ms, .max_hedges = 1, .budget = &budget,
       .deposit_requests = false, .min_attempt_time = 500ms},
      hedge_pool, timer);
  keel::breaker_registry breakers({.breaker = {.minimum_calls = 20, .open_duration = 10s}});
  keel::adaptive_timeout timeouts({.margin = 200ms, .lower = 500ms, .upper = 1500ms, .initial = 1s});
  kt::scripted_provider<std::string> small_model(clock, {kt::answer(std::string("small-model feedback"), 1000ms)});
  auto cached = [](const keel::attempt&) -> absl::StatusOr<std::string> { return std::string("cached feedback"); };
  const keel::gate residency("residency", [](const keel::labels& call, const keel::path& p) {
    return call.region.empty() || call.region == p.labels.region;
  });

  const auto plan =
      keel::pipeline(keel::fallback({residency},
                                    keel::alternate("small-model", small_model,
                                                    {.labels = {.region = "eu"}, .at_most = 3s}),
                                    keel::alternate("cached-feedback", cached, {.provider_call = false})),
                     quotas, pools, keel::time_limit({.at_most = 1000ms}), hedger,
                     keel::retry({.max_attempts = 2, .budget = &budget, .min_attempt_time = 500ms}), breakers,
                     timeouts)
          .in(keel::environment{clock});

  // --- One request. ---
  const keel::time_point t0 = clock.now();
  auto at = [&] { return ms(clock.now() - t0); };
  keel::call call(t0, {.timeout = 3s,
                       .response_reserve = 200ms,
                       .labels = {.tenant = "learner-7", .model = "m-large", .endpoint = "api.provider",
                                  .region = "eu", .work_class = "interactive"}});
  std::printf("%5lld ms  request arrives: deadline %lld ms, %lld ms kept back to answer\n", at(),
              ms(call.end().when() - t0), ms(call.response_reserve()));
  clock.advance(100ms);
  std::printf("%5lld ms  authenticated\n", at());
  clock.advance(200ms);
  std::printf("%5lld ms  context retrieved; the plan runs: admitted, an interactive slot taken\n", at());

  kt::scripted_provider<std::string> stalled(clock, {kt::stall()}, kt::scripted_provider<std::string>::mode::sleep);
  std::atomic<int> closing{0};
  std::optional<absl::StatusOr<std::string>> answer;
  std::thread request([&] { answer.emplace(plan.run(call, model_client{&stalled, clock, &closing})); });

  // --- Driver: time passes while the request's attempts wait. ---
  auto wait_for = [](auto done) {
    while (!done()) std::this_thread::yield();
  };
  clock.await_sleepers(2);  // the model attempt, and the hedge timer
  std::printf("%5lld ms  model attempt 1 starts: timeout %lld ms (the model stage's 1000 ms)\n", at(),
              ms(stalled.attempts()[0].timeout));
  clock.advance(400ms);
  wait_for([&] { return stalled.calls() == 2; });
  clock.await_sleepers(2);  // both attempts
  std::printf("%5lld ms  no answer yet: hedge attempt 2 starts with what is left of the stage, %lld ms\n", at(),
              ms(stalled.attempts()[1].timeout));
  clock.advance(600ms);
  wait_for([&] { return closing.load() == 2; });
  clock.await_sleepers(2);  // both closing
  std::printf("%5lld ms  both reads time out at the stage's end; no time for a retry; cancelling and closing\n",
              at());
  clock.advance(100ms);
  request.join();
  // --- End of the driver. ---

  const keel::attempt fb = small_model.attempts().at(0);
  std::printf("%5lld ms  fallback small-model starts: asked for 3000 ms, may use %lld ms\n", ms(fb.start - t0),
              ms(fb.timeout));
  std::printf("%5lld ms  fallback answered: \"%s\"\n", at(), answer->ok() ? (*answer)->c_str() : "(failed)");
  clock.advance(200ms);
  std::printf("%5lld ms  answer validated and sent; %lld ms of the deadline left\n", at(),
              ms(call.end().remaining(clock.now())));
  const keel::call_record rec = call.record();
  std::printf("record: %d attempts (model, hedge, fallback), served by %s, degraded=%s\n", rec.attempts,
              std::string(rec.served_by).c_str(), rec.degraded ? "yes" : "no");
  return answer->ok() && rec.degraded ? 0 : 1;
}
