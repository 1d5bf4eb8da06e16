// quickstart: a model call behind a deadline, classified retries with a
// service-wide budget, and an adaptive attempt timeout. The README's example.
#include <chrono>

#include <fmt/core.h>

#include "keel/core/format.hpp"
#include "keel/keel.hpp"

using namespace std::chrono_literals;

int main() {
  // Shared, long-lived: one budget and one latency estimate per dependency.
  keel::retry_budget budget({.ratio = 0.1, .min_per_second = 5});
  keel::adaptive_timeout timeouts({.margin = 200ms, .lower = 50ms, .upper = 1500ms, .initial = 500ms});
  auto pipe = keel::pipeline(keel::retry({.max_attempts = 3, .budget = &budget},
                                         keel::full_jitter{.base = 20ms, .cap = 200ms}),
                             timeouts);

  // One per request: a 3 s deadline with 200 ms kept back for the response.
  keel::call call(keel::real_clock{}.now(), {.timeout = 3s,
                                             .response_reserve = 200ms,
                                             .labels = {.tenant = "acme", .model = "summarizer-v2"}});

  int calls = 0;
  absl::StatusOr<std::string> answer = pipe.run(call, [&](const keel::attempt& a) -> absl::StatusOr<std::string> {
    // A real provider sets its socket timeout to a.timeout and watches a.stop.
    if (++calls == 1) return absl::UnavailableError("503 from the provider");
    a.charge(412);  // tokens spent
    return std::string("a short summary");
  });

  // keel/core/format.hpp prints keel's values with fmt.
  fmt::print("answer: {}\n", answer.ok() ? *answer : answer.status().ToString());
  fmt::print("{}: {}\n", call.labels(), call.record());   // tenant=acme model=summarizer-v2: attempts=2 retries=1 cost=412
  return answer.ok() ? 0 : 1;
}
