// Composition: order, exceptions, classifiers, clocks, shared policies, and
// no heap allocation on the success path.
#include "keel/compose/pipeline.hpp"

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <stop_token>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "keel/compose/executor.hpp"
#include "keel/compose/hedge.hpp"
#include "keel/compose/optional_stage.hpp"
#include "keel/core/call.hpp"
#include "keel/policy/circuit_breaker.hpp"
#include "keel/policy/adaptive_timeout.hpp"
#include "keel/policy/retry.hpp"
#include "keel/policy/retry_budget.hpp"
#include "keel/policy/time_limit.hpp"
#include "keel/testing/manual_clock.hpp"
#include "support/alloc_counter.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;
using keel::testing::manual_clock;

namespace {
// A policy that writes its name on the way in and out.
struct tracer {
  std::vector<std::string>* trace;
  std::string name;
  template <class Ctx, class Next>
  auto execute(Ctx& ctx, keel::attempt_plan plan, Next& next) const -> decltype(next(ctx, plan)) {
    trace->push_back(name + ">");
    auto r = next(ctx, plan);
    trace->push_back("<" + name);
    return r;
  }
};
}  // namespace

TEST_CASE("policies run outer to inner in the order written", "[pipeline]") {
  std::vector<std::string> trace;
  auto pipe = keel::pipeline(tracer{&trace, "a"}, tracer{&trace, "b"}, tracer{&trace, "c"});
  keel::call call(keel::real_clock{}.now(), {});
  const absl::StatusOr<int> r = pipe.run(call, [&] {
    trace.push_back("provider");
    return absl::StatusOr<int>(1);
  });
  REQUIRE(r.ok());
  CHECK(trace == std::vector<std::string>{"a>", "b>", "c>", "provider", "<c", "<b", "<a"});
}

TEST_CASE("a provider that throws is caught and classified", "[pipeline]") {
  manual_clock clock;
  clock.auto_advance(true);
  auto pipe = keel::pipeline(keel::retry({.max_attempts = 2}, keel::constant_backoff{.delay_each = 1ms})).in(keel::environment{clock});
  int calls = 0;
  auto thrower = [&](const keel::attempt&) -> absl::StatusOr<int> {
    ++calls;
    throw std::runtime_error("socket exploded");
  };

  keel::call read(clock.now(), {.timeout = 1s});
  const absl::StatusOr<int> r = pipe.run(read, thrower);
  CHECK(r.status().code() == absl::StatusCode::kUnknown);
  CHECK(r.status().message() == "keel: provider threw: socket exploded");
  CHECK(calls == 2);  // a read is repeatable: retried

  calls = 0;
  keel::call write(clock.now(), {.timeout = 1s, .operation = {.effect = keel::effect::write}});
  CHECK(pipe.run(write, thrower).status().code() == absl::StatusCode::kUnknown);
  CHECK(calls == 1);  // a write that threw may have happened: not retried

  keel::call odd(clock.now(), {.timeout = 1s, .max_attempts = 1});
  const absl::Status s = pipe.run(odd, [](const keel::attempt&) -> absl::Status { throw 42; });
  CHECK(s.message() == "keel: provider threw a non-standard exception");
}

TEST_CASE("providers may return absl::Status and may ignore the attempt", "[pipeline]") {
  auto pipe = keel::pipeline(keel::retry({.max_attempts = 2}));
  keel::call call(keel::real_clock{}.now(), {});
  int effects = 0;
  const absl::Status s = pipe.run(call, [&]() -> absl::Status {
    ++effects;
    return absl::OkStatus();
  });
  CHECK(s.ok());
  CHECK(effects == 1);
}

TEST_CASE("a pipeline's classifier can be replaced", "[pipeline]") {
  manual_clock clock;
  clock.auto_advance(true);
  // This provider returns NotFound while a replica catches up: transient here.
  struct eventually_consistent {
    keel::outcome_kind operator()(const absl::Status& s, const keel::operation& op) const {
      if (s.code() == absl::StatusCode::kNotFound) return keel::outcome_kind::transient;
      return keel::default_classifier{}(s, op);
    }
  };
  int calls = 0;
  auto provider = [&]() -> absl::StatusOr<int> {
    if (++calls < 3) return absl::NotFoundError("not replicated yet");
    return 5;
  };
  const keel::retry three({.max_attempts = 3}, keel::constant_backoff{.delay_each = 1ms});
  keel::call a(clock.now(), {.timeout = 1s});
  CHECK_FALSE(keel::pipeline(three).in(keel::environment{clock}).run(a, provider).ok());
  CHECK(calls == 1);

  calls = 0;
  keel::call b(clock.now(), {.timeout = 1s});
  CHECK(keel::pipeline(three).in(keel::environment{clock, eventually_consistent{}}).run(b, provider).value() == 5);
  CHECK(calls == 3);
}

TEST_CASE("a shared policy passed as an lvalue is held by reference", "[pipeline]") {
  manual_clock clock;
  keel::adaptive_timeout timeouts({.min_samples = 1, .refresh_every = 1});
  auto first = keel::pipeline(timeouts).in(keel::environment{clock});
  auto second = keel::pipeline(keel::time_limit({.at_most = 1s}), timeouts).in(keel::environment{clock});
  auto slow = [&]() -> absl::StatusOr<int> {
    clock.advance(700ms);
    return 1;
  };
  keel::call a(clock.now(), {.timeout = 10s});
  REQUIRE(first.run(a, slow).ok());
  keel::call b(clock.now(), {.timeout = 10s});
  REQUIRE(second.run(b, slow).ok());
  CHECK(timeouts.observed() == std::chrono::duration_cast<keel::duration>(700ms));  // both recorded into one
}

TEST_CASE("time_limit narrows the stage and refuses when out of time", "[pipeline]") {
  manual_clock clock;
  auto pipe = keel::pipeline(keel::time_limit({.at_most = 300ms})).in(keel::environment{clock});
  keel::call call(clock.now(), {.timeout = 3s, .response_reserve = 200ms});
  keel::duration seen{};
  REQUIRE(pipe.run(call, [&](const keel::attempt& a) {
                seen = a.timeout;
                return absl::OkStatus();
              }).ok());
  CHECK(seen == std::chrono::duration_cast<keel::duration>(300ms));

  clock.advance(2900ms);  // past the work deadline (2800 ms)
  int calls = 0;
  const absl::Status late = pipe.run(call, [&] {
    ++calls;
    return absl::OkStatus();
  });
  CHECK(late.code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(keel::not_started(late));
  CHECK(calls == 0);
  CHECK_THROWS_AS(keel::time_limit({.at_most = 0ms}), keel::invalid_options);
}

TEST_CASE("keel's own refusals are classified refused and name the refuser", "[pipeline][outcome]") {
  manual_clock clock;
  keel::default_classifier classify;
  constexpr keel::operation read{};
  // time_limit with no time left.
  auto limited = keel::pipeline(keel::time_limit({.at_most = 300ms})).in(keel::environment{clock});
  keel::call late(clock.now(), {.timeout = 1s});
  clock.advance(2s);
  const absl::Status no_time = limited.run(late, [] { return absl::OkStatus(); });
  CHECK(classify(no_time, read) == keel::outcome_kind::refused);
  CHECK(keel::refused_by(no_time) == "time_limit");
  // The pipeline itself with no time left to start an attempt.
  keel::call expired(clock.now(), {.timeout = 1s});
  clock.advance(2s);
  const absl::Status none = keel::pipeline().in(keel::environment{clock}).run(expired, [] { return absl::OkStatus(); });
  CHECK(classify(none, read) == keel::outcome_kind::refused);
  CHECK(keel::refused_by(none) == "deadline");
  // The call's attempt cap.
  keel::call capped(clock.now(), {.timeout = 1s, .max_attempts = 1});
  auto pipe = keel::pipeline().in(keel::environment{clock});
  REQUIRE(pipe.run(capped, [] { return absl::OkStatus(); }).ok());
  const absl::Status over = pipe.run(capped, [] { return absl::OkStatus(); });
  CHECK(classify(over, read) == keel::outcome_kind::refused);
  CHECK(keel::refused_by(over) == "attempt_cap");
  CHECK(keel::not_started(over));
  // The caller's cancellation is its own kind, not a refusal.
  std::stop_source stop;
  stop.request_stop();
  keel::call gone(clock.now(), {.timeout = 1s, .stop = stop.get_token()});
  CHECK(classify(pipe.run(gone, [] { return absl::OkStatus(); }), read) == keel::outcome_kind::cancelled);
}

TEST_CASE("a pipeline is a policy: pipelines nest and share the outer run context", "[pipeline]") {
  manual_clock clock;
  clock.auto_advance(true);
  // A model stage built on its own (real clock, no listener)...
  auto model_stage = keel::pipeline(keel::retry({.max_attempts = 2}, keel::constant_backoff{.delay_each = 1s}));
  static_assert(keel::policy<decltype(model_stage)>);
  static_assert(keel::const_policy<decltype(model_stage)>);
  // ...inside a request pipeline on the manual clock with a listener.
  std::vector<keel::duration> waits;
  auto on_retry = [&](const keel::events::retry_scheduled& e) { waits.push_back(e.wait); };
  auto request = keel::pipeline(keel::time_limit({.at_most = 5s}), model_stage).in(keel::environment{clock}.with_listener(on_retry));
  keel::call call(clock.now(), {.timeout = 10s});
  std::vector<keel::attempt> seen;
  const absl::Status s = request.run(call, [&](const keel::attempt& a) {
    seen.push_back(a);
    return seen.size() == 1 ? absl::UnavailableError("503") : absl::OkStatus();
  });
  REQUIRE(s.ok());
  REQUIRE(seen.size() == 2);
  // The nested retry waited on the outer (manual) clock, inside the outer
  // time_limit's deadline, and reported to the outer listener.
  CHECK(seen[1].start - seen[0].start == std::chrono::duration_cast<keel::duration>(1s));
  CHECK(seen[1].deadline == seen[0].deadline);
  CHECK(seen[0].deadline.when() - seen[0].start == std::chrono::duration_cast<keel::duration>(5s));
  CHECK(waits == std::vector<keel::duration>{std::chrono::duration_cast<keel::duration>(1s)});
  CHECK(call.record().attempts == 2);
}

TEST_CASE("a cancelled call does not start an attempt", "[pipeline]") {
  std::stop_source stop;
  stop.request_stop();
  keel::call call(keel::real_clock{}.now(), {.timeout = 1s, .stop = stop.get_token()});
  int calls = 0;
  const absl::Status s = keel::pipeline().run(call, [&] {
    ++calls;
    return absl::OkStatus();
  });
  CHECK(s.code() == absl::StatusCode::kCancelled);
  CHECK(keel::not_started(s));
  CHECK(calls == 0);
}

TEST_CASE("the success path allocates nothing on the heap", "[pipeline][alloc]") {
  if (!keel_test::allocations_counted()) {
    WARN("allocation counting is off in sanitizer builds; the g++ build asserts it");
    return;
  }
  keel::retry_budget budget({.ratio = 0.1});
  keel::adaptive_timeout timeouts;
  auto pipe = keel::pipeline(keel::time_limit({.at_most = 2s}), keel::retry({.max_attempts = 3, .budget = &budget}),
                             timeouts);
  auto provider = [](const keel::attempt& a) -> absl::StatusOr<int> { return a.number; };
  {
    keel::call warm(keel::real_clock{}.now(), {.timeout = 3s});
    REQUIRE(pipe.run(warm, provider).ok());
  }
  keel_test::count_allocations allocations;
  for (int i = 0; i < 1000; ++i) {
    keel::call call(keel::real_clock{}.now(),
                    {.timeout = 3s, .response_reserve = 200ms, .labels = {.tenant = "acme", .model = "m"}});
    absl::StatusOr<int> r = pipe.run(call, provider);
    if (!r.ok()) FAIL("pipeline failed");
  }
  CHECK(allocations.count() == 0);
}

TEST_CASE("policies report events to the pipeline's listener", "[pipeline][telemetry]") {
  manual_clock clock;
  clock.auto_advance(true);
  struct recorder {
    std::vector<std::string>* log;
    void operator()(const keel::events::retry_scheduled& e) const {
      log->push_back("retry after attempt " + std::to_string(e.layer_attempt) + (e.hinted ? " (hinted)" : ""));
    }
    void operator()(const keel::events::retry_stopped& e) const {
      log->push_back(e.why == keel::events::retry_stopped::reason::layer_attempts ? "stopped: attempts"
                                                                                 : "stopped: other");
    }
  };
  std::vector<std::string> log;
  auto pipe = keel::pipeline(keel::retry({.max_attempts = 3}, keel::constant_backoff{.delay_each = 1ms}))
                  .in(keel::environment{clock}.with_listener(recorder{&log}));
  keel::call call(clock.now(), {.timeout = 1s});
  int n = 0;
  (void)pipe.run(call, [&]() -> absl::Status {
    if (++n == 1) return keel::with_retry_after(absl::ResourceExhaustedError("429"), 5ms);
    return absl::UnavailableError("503");
  });
  CHECK(log == std::vector<std::string>{"retry after attempt 1 (hinted)", "retry after attempt 2",
                                        "stopped: attempts"});

  // A listener that takes only some events is fine; the rest are not delivered.
  struct only_stops {
    int* stops;
    void operator()(const keel::events::retry_stopped&) const { ++*stops; }
  };
  int stops = 0;
  keel::call again(clock.now(), {.timeout = 1s});
  (void)keel::pipeline(keel::retry({.max_attempts = 2}))
      .in(keel::environment{clock}.with_listener(only_stops{&stops}))
      .run(again, [] { return absl::UnauthenticatedError("bad key"); });
  CHECK(stops == 1);
}

TEST_CASE("a call carries the caller's own request type; from_request reads it or gives the default",
          "[pipeline][request]") {
  struct chat_request {
    std::string tenant;
    std::int64_t tokens;
  };
  struct other_request {
    int x;
  };
  const chat_request rq{.tenant = "acme", .tokens = 1200};
  keel::call with(keel::real_clock{}.now(), {.timeout = 1s}, rq);
  keel::call without(keel::real_clock{}.now(), {.timeout = 1s});
  REQUIRE(with.request<chat_request>() == &rq);
  CHECK(with.request<const chat_request>() == &rq);
  CHECK(with.request<other_request>() == nullptr);  // another type: not handed out
  CHECK(without.request<chat_request>() == nullptr);

  auto tokens = keel::from_request<chat_request>([](const chat_request& r) { return r.tokens; }, std::int64_t{-1});
  CHECK(tokens(with) == 1200);
  CHECK(tokens(without) == -1);
  auto heavier = keel::from_request<chat_request>(
      [](const chat_request& r, std::int64_t than) { return r.tokens > than; }, false);
  CHECK(heavier(with, 1000));
  CHECK(!heavier(with, 2000));
  CHECK(!heavier(without, 0));
  // Binding a temporary would dangle: it does not compile.
  STATIC_REQUIRE(!std::is_constructible_v<keel::call, keel::time_point, keel::call_options, chat_request&&>);
}

TEST_CASE("a call built from valid options skips nothing: invalid ones still throw naming the field",
          "[pipeline][options]") {
  const keel::time_point now = keel::real_clock{}.now();
  auto refusal = [&](const keel::call_options& o) -> std::string {
    try {
      keel::call c(now, o);
    } catch (const keel::invalid_options& e) {
      return std::string(e.status().message());
    }
    return "(accepted)";
  };
  CHECK(refusal({.timeout = 1s, .response_reserve = 2s}).find("call_options.response_reserve must be below timeout") !=
        std::string::npos);
  CHECK(refusal({.max_attempts = 0}).find("call_options.max_attempts must be >= 1") != std::string::npos);
  CHECK(refusal({.timeout = -1s}).find("call_options.timeout must be >= 0") != std::string::npos);
  CHECK(refusal({.response_reserve = -1s}).find("call_options.response_reserve must be >= 0") != std::string::npos);
  CHECK(refusal({.timeout = 1s, .response_reserve = 999ms, .max_attempts = 1}) == "(accepted)");
}

// A call's counters are plain loads and stores until it is shared; once
// shared, every update is atomic: four threads racing for one call's attempt
// cap take exactly the cap between them, and every charge and retry counts.
TEST_CASE("a call shared across threads counts every attempt, retry and charge exactly", "[pipeline][call][threads]") {
  constexpr int kThreads = 4;
  constexpr int kTries = 2000;
  constexpr int kCap = kThreads * kTries / 2;
  keel::call call(keel::time_point{}, {.max_attempts = kCap});
  CHECK_FALSE(call.shared());
  call.share_across_threads();
  CHECK(call.shared());
  keel::retry_budget budget({.ratio = 0.1});
  std::atomic<int> granted{0};
  std::atomic<int> first_deposits{0};
  {
    std::vector<std::jthread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&] {
        for (int i = 0; i < kTries; ++i) {
          if (call.begin_attempt() != 0) granted.fetch_add(1);
          call.charge(3);
          call.note_retry();
          if (call.first_deposit(&budget)) first_deposits.fetch_add(1);
        }
      });
    }
  }
  const keel::call_record r = call.record();
  CHECK(granted.load() == kCap);
  CHECK(r.attempts == kCap);
  CHECK(r.retries == kThreads * kTries);
  CHECK(r.cost == 3 * kThreads * kTries);
  CHECK(first_deposits.load() == 1);  // one deposit per budget, whoever asked first
}

TEST_CASE("a call that stays on its thread counts the same without sharing", "[pipeline][call]") {
  keel::call call(keel::time_point{}, {.max_attempts = 2});
  CHECK(call.begin_attempt() == 1);
  CHECK(call.begin_attempt() == 2);
  CHECK(call.begin_attempt() == 0);  // the cap holds
  CHECK(call.attempts_exhausted());
  int budget = 0;
  CHECK(call.first_deposit(&budget));
  CHECK_FALSE(call.first_deposit(&budget));
  call.charge(5);
  call.note_missing(2);
  CHECK(call.record().cost == 5);
  CHECK(call.record().missing == 2);
}

// A plan refers to its stop token rather than copying it; one made from a
// temporary token would dangle, so it does not compile.
static_assert(!std::is_constructible_v<keel::stop_ref, std::stop_token&&>);
static_assert(std::is_constructible_v<keel::stop_ref, const std::stop_token&>);
static_assert(std::is_trivially_copyable_v<keel::attempt_plan>);

TEST_CASE("a plan's stop reference reads the caller's token as it changes", "[pipeline][call]") {
  keel::stop_ref never;
  CHECK_FALSE(never.stop_possible());
  CHECK_FALSE(never.stop_requested());
  std::stop_source source;
  manual_clock clock;
  keel::call call(clock.now(), {.timeout = 1s, .stop = source.get_token()});
  auto pipe = keel::pipeline(keel::time_limit({.at_most = 500ms})).in(keel::environment{clock});
  bool seen_before = true;
  bool seen_after = false;
  absl::Status s = pipe.run(call, [&](const keel::attempt& a) {
    seen_before = a.stop.stop_requested();
    source.request_stop();  // the caller leaves while the attempt runs
    seen_after = a.stop.stop_requested();
    return absl::OkStatus();
  });
  INFO(s);
  CHECK(s.ok());
  CHECK_FALSE(seen_before);
  CHECK(seen_after);
}

TEST_CASE("an optional stage runs its policy when present and passes through when left out", "[pipeline]") {
  keel::circuit_breaker breaker({.name = "model"});
  breaker.force_open(keel::real_clock{}.now());
  auto answer = [](const keel::attempt&) -> absl::StatusOr<int> { return 7; };
  const auto with = keel::pipeline(keel::retry({.max_attempts = 2}), keel::optional_stage(&breaker));
  const auto without = keel::pipeline(keel::retry({.max_attempts = 2}), keel::optional_stage<keel::circuit_breaker>{});
  static_assert(std::is_same_v<decltype(with), decltype(without)>, "one pipeline type, in or out");

  keel::call refused(keel::real_clock{}.now(), {.timeout = std::chrono::seconds(1)});
  const absl::StatusOr<int> r = with.run(refused, answer);
  CHECK(keel::refused_by(r.status()) == std::optional<std::string>("breaker:model"));
  CHECK(refused.record().attempts == 0);

  keel::call passed(keel::real_clock{}.now(), {.timeout = std::chrono::seconds(1)});
  CHECK(without.run(passed, answer).value() == 7);
  CHECK(passed.record().attempts == 1);
}

TEST_CASE("an optional hedge stays a concurrent stage, in the plan or out of it", "[pipeline]") {
  using hedge_type = keel::hedge<keel::bounded_pool>;
  static_assert(keel::concurrent_policy<keel::optional_stage<hedge_type>>);
  static_assert(!keel::concurrent_policy<keel::optional_stage<keel::circuit_breaker>>);
  keel::bounded_pool pool({.threads = 1, .queue_capacity = 4});
  hedge_type hedger({.delay = std::chrono::seconds(5), .max_hedges = 1, .primary_on_caller_thread = true}, pool);
  auto answer = [](const keel::attempt& a) -> absl::StatusOr<int> { return a.hedge; };
  for (hedge_type* h : {&hedger, static_cast<hedge_type*>(nullptr)}) {
    const auto pipe = keel::pipeline(keel::optional_stage(h));
    keel::call call(keel::real_clock{}.now(), {.timeout = std::chrono::seconds(1)});
    CHECK(pipe.run(call, answer).value() == 0);  // the primary answered
  }
  CHECK(hedger.figures().calls == 1);  // only the pipeline that had it ran through it
}
