// retry_after: a throttled provider says when to come back; keel waits
// exactly that long instead of its own backoff, inside the deadline.
#include <chrono>
#include <cstdio>
#include <string>

#include "keel/keel.hpp"

using namespace std::chrono_literals;

int main() {
  keel::real_clock clock;
  auto pipe = keel::pipeline(keel::retry({.max_attempts = 4}, keel::full_jitter{.base = 50ms, .cap = 1s}));
  keel::call call(clock.now(), {.timeout = 3s, .labels = {.tenant = "acme", .model = "m-large"}});

  const keel::time_point start = clock.now();
  auto since = [&] { return std::chrono::duration_cast<std::chrono::milliseconds>(clock.now() - start).count(); };
  absl::StatusOr<std::string> r = pipe.run(call, [&](const keel::attempt& a) -> absl::StatusOr<std::string> {
    std::printf("%4lld ms  attempt %d (timeout %lld ms)\n", static_cast<long long>(since()), a.number,
                static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(a.timeout).count()));
    if (a.number == 1) {
      std::printf("          429: rate limited, retry after 300 ms\n");
      return keel::with_retry_after(absl::ResourceExhaustedError("429 Too Many Requests"), 300ms);
    }
    return std::string("ok");
  });
  std::printf("%4lld ms  %s after %d attempts; the wait followed the provider's hint, not the jitter\n",
              static_cast<long long>(since()), r.ok() ? "answered" : "failed", call.record().attempts);
  return r.ok() ? 0 : 1;
}
