// keel::adaptive_throttle: the SRE formula exactly, rejections drawn at that
// probability from a seeded source, what counts as accepted by classified
// outcome, the sliding window, classes shed in order (batch before
// interactive), a provider that goes down and comes back, counts under
// contention, and options refused with the field named.
#include "keel/policy/adaptive_throttle.hpp"

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "keel/compose/pipeline.hpp"
#include "keel/core/call.hpp"
#include "keel/policy/adaptive_limit.hpp"
#include "keel/policy/retry.hpp"
#include "keel/testing/manual_clock.hpp"
#include "keel/testing/seeded_random.hpp"
#include "support/alloc_counter.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;
using keel::testing::manual_clock;
using keel::testing::seeded_random;

namespace {

template <class T>
void feed(T& t, keel::time_point now, int requests, int accepts) {
  for (int i = 0; i < requests; ++i) t.record(now, i < accepts);
}

std::string message(const keel::adaptive_throttle_options& o) { return std::string(o.validate().message()); }

}  // namespace

TEST_CASE("adaptive throttle: the probability is max(0, (requests - k * accepts) / (requests + 1))",
          "[adaptive_throttle]") {
  manual_clock clock;
  keel::adaptive_throttle t({.k = 2.0}, seeded_random(1));
  CHECK(t.reject_probability(0, clock.now()) == 0.0);
  feed(t, clock.now(), 100, 60);  // 100 - 120 < 0
  CHECK(t.reject_probability(0, clock.now()) == 0.0);
  feed(t, clock.now(), 100, 0);  // 200 requests, 60 accepts: (200 - 120) / 201
  CHECK(t.reject_probability(0, clock.now()) == Approx(80.0 / 201.0));
  const keel::adaptive_throttle_figures f = t.figures(clock.now());
  CHECK(f.requests == 200);
  CHECK(f.accepts == 60);
}

TEST_CASE("adaptive throttle: rejects at that probability, reproducibly with a seeded source; rejections count as requests",
          "[adaptive_throttle]") {
  manual_clock clock;
  auto run = [&](std::uint64_t seed) {
    keel::adaptive_throttle t({.k = 2.0, .max_reject = 1.0, .window = 1h}, seeded_random(seed));
    feed(t, clock.now(), 1000, 250);  // p = (1000 - 500) / 1001, about 0.5
    std::vector<bool> outcomes;
    int rejected = 0;
    for (int i = 0; i < 2000; ++i) {
      const bool ok = t.allow(0, clock.now());
      outcomes.push_back(ok);
      if (!ok) ++rejected;
      // Only rejections change the counts here (allowed calls are not recorded).
    }
    return std::pair{outcomes, rejected};
  };
  const auto [a, rejected] = run(7);
  const auto [b, rejected_again] = run(7);
  CHECK(a == b);  // the same seed, the same rejections
  CHECK(rejected == rejected_again);
  // Each rejection raises requests, and so the probability: from 0.50 after
  // 1000 requests towards (1000 + r - 500) / (1001 + r). With 2000 draws it
  // ends near 0.8, so between 1000 and 1600 rejections.
  CHECK(rejected > 1000);
  CHECK(rejected < 1600);
  keel::adaptive_throttle t({.k = 2.0, .max_reject = 1.0, .window = 1h}, seeded_random(7));
  feed(t, clock.now(), 1000, 250);
  int r = 0;
  for (int i = 0; i < 2000; ++i) r += t.allow(0, clock.now()) ? 0 : 1;
  CHECK(t.figures(clock.now()).requests == 1000 + r);
  CHECK(t.figures(clock.now()).rejected == r);
  CHECK(t.figures(0, clock.now()).allowed == 2000 - r);
}

TEST_CASE("adaptive throttle: a healthy provider is never throttled", "[adaptive_throttle]") {
  manual_clock clock;
  keel::adaptive_throttle t({}, seeded_random(3));
  for (int i = 0; i < 10000; ++i) {
    REQUIRE(t.allow(0, clock.now()));
    t.record(clock.now(), i % 3 != 2);  // two thirds accepted: above 1/k
    clock.advance(1ms);
  }
  CHECK(t.figures(clock.now()).rejected == 0);
}

TEST_CASE("adaptive throttle: the window slides; old requests and accepts are forgotten", "[adaptive_throttle]") {
  manual_clock clock;
  keel::adaptive_throttle t({.max_reject = 1.0, .window = 10s}, seeded_random(5));
  feed(t, clock.now(), 100, 0);
  CHECK(t.reject_probability(0, clock.now()) == Approx(100.0 / 101.0));
  clock.advance(5s);
  feed(t, clock.now(), 10, 10);
  CHECK(t.reject_probability(0, clock.now()) == Approx((110.0 - 20.0) / 111.0));
  clock.advance(6s);  // the first 100 are out of the window
  CHECK(t.figures(clock.now()).requests == 10);
  CHECK(t.reject_probability(0, clock.now()) == 0.0);
}

TEST_CASE("adaptive throttle: batch (k 1.1) is shed before interactive (k 2)", "[adaptive_throttle]") {
  manual_clock clock;
  keel::adaptive_throttle t({.classes = {{.name = "interactive", .k = 2.0}, {.name = "batch", .k = 1.1}}},
                            seeded_random(11));
  const std::size_t interactive = *t.class_index("interactive");
  const std::size_t batch = *t.class_index("batch");
  feed(t, clock.now(), 1000, 700);  // the provider accepts 70%
  CHECK(t.reject_probability(interactive, clock.now()) == 0.0);
  CHECK(t.reject_probability(batch, clock.now()) == Approx((1000.0 - 770.0) / 1001.0));
  int batch_rejected = 0, interactive_rejected = 0;
  for (int i = 0; i < 500; ++i) {
    batch_rejected += t.allow(batch, clock.now()) ? 0 : 1;
    interactive_rejected += t.allow(interactive, clock.now()) ? 0 : 1;
  }
  CHECK(batch_rejected > 50);
  CHECK(interactive_rejected == 0);
  // Worse (30% accepted): both shed, batch more.
  feed(t, clock.now(), 2000, 0);
  CHECK(t.reject_probability(batch, clock.now()) > t.reject_probability(interactive, clock.now()));
  CHECK(t.reject_probability(interactive, clock.now()) > 0.3);
  CHECK(t.figures(batch, clock.now()).rejected == batch_rejected);
}

TEST_CASE("adaptive throttle as a policy: accepted by classified outcome; refusals and events",
          "[adaptive_throttle]") {
  manual_clock clock;
  keel::adaptive_throttle t({.name = "llm", .window = 1min,
                             .classes = {{.name = "interactive"}, {.name = "batch", .k = 1.1}},
                             .default_class = "interactive"},
                            seeded_random(2));
  struct listener {
    std::vector<std::string>* seen;
    void operator()(const keel::events::adaptive_throttle_rejected& e) const {
      seen->push_back(std::string(e.work_class));
    }
  };
  std::vector<std::string> seen;
  auto pipe = keel::pipeline(t).in(keel::environment{clock}.with_listener(listener{&seen}));
  auto call_with = [&](std::string_view cls, absl::Status result) {
    keel::call call(clock.now(), {.timeout = 10s, .labels = {.work_class = cls}});
    return pipe.run(call, [&](const keel::attempt&) -> absl::Status { return result; });
  };
  // Accepted: success, and a permanent error (the provider answered).
  CHECK(call_with("", absl::OkStatus()).ok());
  CHECK(!call_with("", absl::InvalidArgumentError("bad prompt")).ok());
  CHECK(t.figures(clock.now()).requests == 2);
  CHECK(t.figures(clock.now()).accepts == 2);
  // Not accepted: throttled, transient, ambiguous.
  CHECK(!call_with("interactive", absl::ResourceExhaustedError("429")).ok());
  CHECK(!call_with("interactive", absl::UnavailableError("503")).ok());
  CHECK(!call_with("interactive", absl::UnknownError("threw")).ok());
  CHECK(t.figures(clock.now()).requests == 5);
  CHECK(t.figures(clock.now()).accepts == 2);
  // Counted nowhere: refused further in, cancelled.
  CHECK(!call_with("interactive", keel::refusal(absl::UnavailableError("open"), "breaker:llm")).ok());
  CHECK(!call_with("interactive", absl::CancelledError("gone")).ok());
  CHECK(t.figures(clock.now()).requests == 5);
  // A provider that throttles everything: batch is soon rejected locally.
  int refused = 0;
  absl::Status last;
  for (int i = 0; i < 100; ++i) {
    absl::Status s = call_with("batch", absl::ResourceExhaustedError("429"));
    if (keel::refused_by(s) == "adaptive_throttle:llm:batch") {
      ++refused;
      last = s;
    }
  }
  CHECK(refused > 50);
  CHECK(static_cast<int>(seen.size()) == refused);
  CHECK(seen.back() == "batch");
  CHECK(last.code() == absl::StatusCode::kResourceExhausted);
  CHECK(keel::not_started(last));
  CHECK(keel::default_classifier{}(last, {}) == keel::outcome_kind::refused);
  CHECK(!keel::retry_after(last).has_value());
  CHECK(std::string(last.message()).find("the provider accepted 2 of") != std::string::npos);
  // An unknown class: permanent.
  absl::Status u = call_with("gold", absl::OkStatus());
  CHECK(u.code() == absl::StatusCode::kInvalidArgument);
  CHECK(keel::default_classifier{}(u, {}) == keel::outcome_kind::permanent);
}

TEST_CASE("adaptive throttle: a provider down for a minute gets a tenth, and all of it again once it is back",
          "[adaptive_throttle]") {
  manual_clock clock;
  keel::adaptive_throttle t({.k = 2.0, .window = 30s}, seeded_random(9));
  bool up = true;
  // One second of 100 calls; returns how many were sent.
  auto second = [&] {
    int sent = 0;
    for (int i = 0; i < 100; ++i) {
      if (t.allow(0, clock.now())) {
        ++sent;
        t.record(clock.now(), up);
      }
      clock.advance(10ms);
    }
    return sent;
  };
  int sent = 0;
  for (int s = 0; s < 30; ++s) sent += second();
  CHECK(sent == 3000);
  up = false;
  int sent_down = 0;
  for (int s = 0; s < 60; ++s) {
    const int n = second();
    if (s >= 40) sent_down += n;  // the last 20 s: the window holds only the outage
  }
  // Down: capped at max_reject 0.9, about one in ten still goes (2000 x 0.1 = 200).
  CHECK(sent_down > 130);
  CHECK(sent_down < 270);
  up = true;
  std::vector<int> per_window;
  for (int w = 0; w < 6; ++w) {
    int n = 0;
    for (int s = 0; s < 30; ++s) n += second();
    per_window.push_back(n);
  }
  // What is sent grows window by window, and within three minutes all of it.
  CHECK(per_window[1] > per_window[0]);
  CHECK(per_window[0] > 300);
  CHECK(per_window[5] == 3000);
}

TEST_CASE("adaptive throttle: counts are exact under contention", "[adaptive_throttle][contention]") {
  manual_clock clock;
  keel::adaptive_throttle t({.k = 1.5, .window = 1h});
  constexpr int kThreads = 8;
  constexpr int kOps = 20000;
  std::atomic<std::int64_t> allowed{0}, rejected{0}, accepted{0};
  std::vector<std::thread> threads;
  for (int th = 0; th < kThreads; ++th) {
    threads.emplace_back([&, th] {
      std::int64_t a = 0, r = 0, acc = 0;
      for (int i = 0; i < kOps; ++i) {
        if (t.allow(0, clock.now())) {
          ++a;
          const bool ok = (i + th) % 2 == 0;  // half accepted: below 1/k, so some are rejected
          acc += ok ? 1 : 0;
          t.record(clock.now(), ok);
        } else {
          ++r;
        }
      }
      allowed += a;
      rejected += r;
      accepted += acc;
    });
  }
  for (auto& th : threads) th.join();
  const keel::adaptive_throttle_figures f = t.figures(clock.now());
  CHECK(f.requests == kThreads * kOps);
  CHECK(f.accepts == accepted.load());
  CHECK(f.rejected == rejected.load());
  CHECK(allowed.load() + rejected.load() == kThreads * kOps);
  CHECK(rejected.load() > 0);
}

TEST_CASE("adaptive throttle options: refused at construction with the field and rule named", "[adaptive_throttle]") {
  CHECK(message({.name = ""}) == "adaptive_throttle_options.name must not be empty (got \"\")");
  CHECK(message({.k = 0.5}) == "adaptive_throttle_options.k must be in [1, 1000] (got 0.5)");
  CHECK(message({.max_reject = 1.5}) == "adaptive_throttle_options.max_reject must be in [0, 1] (got 1.5)");
  CHECK(message({.window = 10ms}) == "adaptive_throttle_options.window must be in [100ms, 24h] (got 10ms)");
  CHECK(message({.classes = {{.name = "a"}, {.name = "b", .k = 0.9}}}) ==
        "adaptive_throttle_options.classes[1].k must be in [1, 1000] (got 0.9)");
  CHECK(message({.classes = {{.name = ""}}}) == "adaptive_throttle_options.classes[0].name must not be empty (got \"\")");
  CHECK(message({.classes = {{.name = "a"}, {.name = "a"}}}) ==
        "adaptive_throttle_options.classes[1].name must be unique (got a)");
  CHECK(message({.classes = {{.name = "a"}}, .default_class = "b"}) ==
        "adaptive_throttle_options.default_class must name a class (got b)");
  CHECK(message({}).empty());
  CHECK_THROWS_AS(keel::adaptive_throttle({.k = 0}), keel::invalid_options);
}

TEST_CASE("adaptive throttle and limit in a pipeline allocate nothing per call", "[adaptive_throttle][alloc]") {
  if (!keel_test::allocations_counted()) {
    WARN("allocation counting is off in sanitizer builds; the g++ build asserts it");
    return;
  }
  keel::adaptive_throttle throttle({});
  keel::adaptive_limit lim({.initial_limit = 64, .probe_interval = 1ms});
  auto pipe = keel::pipeline(throttle, keel::retry({.max_attempts = 2}), lim);
  auto provider = [](const keel::attempt& a) -> absl::StatusOr<int> { return a.number; };
  keel_test::count_allocations allocations;
  for (int i = 0; i < 2000; ++i) {
    keel::call call(keel::real_clock{}.now(), {.timeout = 3s});
    absl::StatusOr<int> r = pipe.run(call, provider);
    if (!r.ok()) FAIL("pipeline failed: " << r.status());
  }
  CHECK(allocations.count() == 0);
  CHECK(throttle.figures(keel::real_clock{}.now()).accepts == 2000);
  CHECK(lim.figures().updates > 50);
}
