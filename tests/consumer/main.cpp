// Uses keel from outside the project: a retry around a provider that fails
// once, then answers.
#include <chrono>
#include <cstdio>

#include "keel/keel.hpp"

int main() {
  using namespace std::chrono_literals;
  auto pipe = keel::pipeline(keel::retry({.max_attempts = 3}, keel::constant_backoff{.delay_each = 1ms}));
  keel::call call(keel::real_clock{}.now(), {.timeout = 2s});
  int calls = 0;
  absl::StatusOr<int> r = pipe.run(call, [&](const keel::attempt&) -> absl::StatusOr<int> {
    if (++calls == 1) return absl::UnavailableError("first attempt fails");
    return 42;
  });
  if (!r.ok() || *r != 42 || call.record().attempts != 2) {
    std::fprintf(stderr, "consumer: unexpected result\n");
    return 1;
  }
  std::printf("consumer: keel answered %d after %d attempts\n", *r, call.record().attempts);
  return 0;
}
