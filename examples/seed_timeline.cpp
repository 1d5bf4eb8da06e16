// seed_timeline: the seed's 3-second request, stage by stage.
//
// One deadline is spent once: admission, retrieval, a model attempt that
// times out, a fallback that gets only what remains, and the answer with the
// response reserve intact. The clock is keel's manual clock so the story
// runs instantly and identically every time; in a service it is
// keel::real_clock and the provider really waits.
#include <chrono>
#include <cstdio>
#include <string>

#include "keel/keel.hpp"
#include "keel/testing/manual_clock.hpp"
#include "keel/testing/scripted_provider.hpp"

using namespace std::chrono_literals;
namespace kt = keel::testing;

namespace {
long long ms(keel::duration d) { return std::chrono::duration_cast<std::chrono::milliseconds>(d).count(); }
}  // namespace

int main() {
  kt::manual_clock clock;
  const keel::time_point t0 = clock.now();
  auto at = [&] { return ms(clock.now() - t0); };

  keel::call call(t0, {.timeout = 3s, .response_reserve = 200ms, .labels = {.tenant = "learner-7"}});
  std::printf("%5lld ms  request arrives: deadline %lld ms, %lld ms kept back to answer\n", at(),
              ms(call.end().when() - t0), ms(call.response_reserve()));

  clock.advance(100ms);
  std::printf("%5lld ms  authenticated and admitted\n", at());
  clock.advance(200ms);
  std::printf("%5lld ms  context retrieved\n", at());

  // The model: at most 1000 ms of what is left. Today it stalls.
  kt::scripted_provider<std::string> model(clock, {kt::stall()});
  auto model_stage = keel::pipeline(keel::time_limit({.at_most = 1000ms})).on(clock);
  const absl::StatusOr<std::string> primary = model_stage.run(call, model);
  std::printf("%5lld ms  model attempt ended: %s (its timeout was %lld ms)\n", at(),
              std::string(primary.status().message()).c_str(), ms(model.attempts().back().timeout));

  clock.advance(100ms);
  std::printf("%5lld ms  failed read cancelled and closed\n", at());

  // The fallback asks for a fresh 3 s; the call gives it only what remains.
  kt::scripted_provider<std::string> fallback(clock, {kt::answer(std::string("cached rubric feedback"), 1000ms)});
  auto fallback_stage = keel::pipeline(keel::time_limit({.at_most = 3s})).on(clock);
  std::printf("%5lld ms  fallback starts: asked for 3000 ms, may use %lld ms\n", at(),
              ms(call.stage(clock.now(), 3s).remaining(clock.now())));
  const absl::StatusOr<std::string> degraded = fallback_stage.run(call, fallback);
  call.set_served_by("fallback:cached-feedback");
  call.mark_degraded();
  std::printf("%5lld ms  fallback answered: \"%s\" (degraded)\n", at(), degraded->c_str());

  clock.advance(200ms);
  std::printf("%5lld ms  answer validated and sent; %lld ms of the deadline left\n", at(),
              ms(call.end().remaining(clock.now())));
  const keel::call_record rec = call.record();
  std::printf("record: %d attempts, served by %s, degraded=%s\n", rec.attempts, std::string(rec.served_by).c_str(),
              rec.degraded ? "yes" : "no");
  return 0;
}
