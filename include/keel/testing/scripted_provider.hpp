// keel/testing/scripted_provider.hpp — a provider that plays a script of
// outcomes and latencies on a manual clock.
//
// Each call plays the next step (the last step repeats once the script is
// used up): an answer, or a failure, after a latency. A step slower than the
// attempt's deadline ends at the deadline with DeadlineExceeded, as a real
// client with a socket timeout would.
//
//   mode::advance  the provider moves the manual clock itself (single-threaded tests)
//   mode::sleep    the provider sleeps on the manual clock; the test advances it
//                  (tests with several threads, hedges, cancellation)
//
// Example:
//
//   keel::testing::manual_clock clock;
//   keel::testing::scripted_provider<int> provider(clock, {
//       keel::testing::rate_limited(std::chrono::seconds(2)),
//       keel::testing::unavailable(std::chrono::milliseconds(30)),
//       keel::testing::answer(42, std::chrono::milliseconds(80)),
//   });
//   // pipe.in(keel::environment{clock}).run(call, provider) sees 429 (retry after 2 s), 503, then 42.
//
// Thread-safety: operator() may be called from several threads at once;
// which step each gets then depends on the interleaving.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "keel/core/call.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/status.hpp"
#include "keel/testing/manual_clock.hpp"

namespace keel::testing {

// A failing step, usable in a script of any value type.
struct failure {
  absl::Status status;
  duration latency{};
};

// Never answers: the attempt runs into its deadline.
inline constexpr duration forever = duration::max();

template <class T>
struct step {
  step(failure f) : result(std::move(f.status)), latency(f.latency) {}  // NOLINT: implicit by design
  step(absl::StatusOr<T> r, duration l) : result(std::move(r)), latency(l) {}

  absl::StatusOr<T> result;
  duration latency{};
};

template <class T>
[[nodiscard]] step<T> answer(T value, duration latency = {}) {
  return step<T>(absl::StatusOr<T>(std::move(value)), latency);
}
[[nodiscard]] inline failure fail(absl::Status s, duration latency = {}) { return {std::move(s), latency}; }
[[nodiscard]] inline failure unavailable(duration latency = {}) {
  return {absl::UnavailableError("scripted: provider unavailable"), latency};
}
[[nodiscard]] inline failure rate_limited(duration retry_after_hint, duration latency = {}) {
  return {keel::with_retry_after(absl::ResourceExhaustedError("scripted: rate limited"), retry_after_hint), latency};
}
[[nodiscard]] inline failure bad_credential(duration latency = {}) {
  return {absl::UnauthenticatedError("scripted: invalid API key"), latency};
}
[[nodiscard]] inline failure unsupported_model(duration latency = {}) {
  return {absl::InvalidArgumentError("scripted: model not supported"), latency};
}
// A write whose effect is unknown (the connection dropped after sending).
[[nodiscard]] inline failure lost_write(duration latency = {}) {
  return {absl::UnknownError("scripted: connection lost after the request was sent"), latency};
}
[[nodiscard]] inline failure stall() { return {absl::InternalError("scripted: stalled"), forever}; }

template <class T>
class scripted_provider {
 public:
  enum class mode { advance, sleep };

  scripted_provider(manual_clock clock, std::vector<step<T>> script, mode m = mode::advance)
      : clock_(std::move(clock)), script_(std::move(script)), mode_(m) {}
  scripted_provider(const scripted_provider&) = delete;
  scripted_provider& operator=(const scripted_provider&) = delete;

  absl::StatusOr<T> operator()(const keel::attempt& a) {
    step<T> s = next(a);
    const time_point start = clock_.now();
    const time_point limit = a.deadline.when();
    const bool too_slow = s.latency == forever || limit - start < s.latency;
    const time_point done = too_slow ? limit : start + s.latency;
    if (mode_ == mode::advance) {
      if (done == time_point::max()) return absl::FailedPreconditionError("scripted: step never ends and no deadline");
      clock_.set(std::max(clock_.now(), done));
    } else if (!clock_.sleep_until(done, a.stop)) {
      return absl::CancelledError("scripted: attempt cancelled");
    }
    if (too_slow) return absl::DeadlineExceededError("scripted: attempt timed out");
    return std::move(s.result);
  }

  [[nodiscard]] int calls() const {
    std::lock_guard lock(mu_);
    return static_cast<int>(seen_.size());
  }
  // The attempts this provider saw, in call order.
  [[nodiscard]] std::vector<keel::attempt> attempts() const {
    std::lock_guard lock(mu_);
    return seen_;
  }

 private:
  step<T> next(const keel::attempt& a) {
    std::lock_guard lock(mu_);
    seen_.push_back(a);
    if (script_.empty()) return step<T>(failure{absl::FailedPreconditionError("scripted: empty script")});
    const std::size_t i = std::min(index_++, script_.size() - 1);
    return script_[i];
  }

  manual_clock clock_;
  std::vector<step<T>> script_;
  mode mode_;
  mutable std::mutex mu_;
  std::size_t index_ = 0;
  std::vector<keel::attempt> seen_;
};

}  // namespace keel::testing
