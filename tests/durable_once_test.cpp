// keel::once over the in-memory store on the manual clock: one decision per
// logical request, duplicates wait or retry later, failures forgotten or
// remembered, policy revisions, keep-alive, and a provider that outlives its
// lease.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <stdexcept>
#include <latch>
#include <string>
#include <thread>
#include <vector>

#include "keel/compose/pipeline.hpp"
#include "keel/core/call.hpp"
#include "keel/core/environment.hpp"
#include "keel/durable/digest.hpp"
#include "keel/durable/once.hpp"
#include "keel/store/memory.hpp"
#include "keel/testing/manual_clock.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;
using keel::testing::manual_clock;
using store_t = keel::memory_store;

namespace {

const keel::request_identity receipt_key{.tenant = "merchant-82", .endpoint = "receipts", .key = "key-47"};
keel::digest receipt(std::string_view contents) { return keel::digest_builder().field("receipt", contents).finish(); }

keel::idempotency_options opts(std::string revision = "rev-1") {
  return {.lease = 30s, .retention = 24h, .retry_window = 1h, .policy_revision = std::move(revision)};
}

struct counting_provider {
  std::atomic<int>* calls;
  std::string result = "approve";
  absl::StatusOr<keel::decision> operator()(const keel::claim_context&) const {
    calls->fetch_add(1);
    return keel::decision{.model_digest = "m-large@1", .result = result};
  }
};

// A provider that blocks until released, so a test can act while it is in flight.
struct gated_provider {
  std::atomic<int>* calls;
  std::latch* entered;
  std::latch* release;
  absl::StatusOr<keel::decision> operator()(const keel::claim_context&) const {
    calls->fetch_add(1);
    entered->count_down();
    release->wait();
    return keel::decision{.model_digest = "m-large@1", .result = "approve"};
  }
};

bool contains(absl::string_view s, absl::string_view part) { return s.find(part) != absl::string_view::npos; }

// A service's classifier: its provider reports a revoked key as Unavailable,
// which is permanent for this service.
struct revoked_rule {
  keel::outcome_kind operator()(const absl::Status& s, const keel::operation& op) const {
    if (s.message() == "key revoked") return keel::outcome_kind::permanent;
    return keel::default_classifier{}(s, op);
  }
};

struct begin_recorder {
  std::vector<keel::begin_state>* seen;
  void operator()(const keel::events::idempotency_begin& e) const { seen->push_back(e.state); }
};

// A pipeline stage that decides receipt-A at most once, on the pass's run
// context; the rest of the pipeline runs only when this pass owns the record.
struct decide_once_stage {
  const keel::once<store_t>* decide;  // built with the default environment
  template <class Ctx, class Next>
  auto execute(Ctx& ctx, keel::attempt_plan plan, Next& next) const -> decltype(next(ctx, plan)) {
    absl::StatusOr<keel::once_result> r =
        decide->run(ctx, receipt_key, receipt("receipt-A"), [&](const keel::claim_context&) -> absl::StatusOr<keel::decision> {
          if (absl::Status s = next(ctx, plan); !s.ok()) return s;
          return keel::decision{.model_digest = "m-large@1", .result = "approve"};
        });
    return r.status();
  }
};

}  // namespace

TEST_CASE("idempotency options are validated with the field and the rule named", "[once]") {
  auto message = [](const keel::idempotency_options& o) { return std::string(o.validate().message()); };
  CHECK(opts().validate().ok());
  CHECK(message({.lease = 0s}) == "idempotency_options.lease must be > 0 (got 0s)");
  CHECK(message({.lease = 30s, .retention = 30s}) == "idempotency_options.retention must exceed lease (got 30s <= 30s)");
  CHECK(message({.lease = 30s, .retention = 1h, .retry_window = 1h}) ==
        "idempotency_options.retention must exceed retry_window (got 3600s <= 3600s)");
  CHECK(message({.retry_window = -1s}) == "idempotency_options.retry_window must be >= 0 (got -1s)");
  CHECK(contains(message({.on_policy_change = keel::on_policy_change::conflict}),
                 "idempotency_options.policy_revision must be set when on_policy_change is conflict or decide_again"));
  CHECK(message({.poll_initial = 10ms, .poll_max = 5ms}) == "idempotency_options.poll_max must be >= poll_initial (got 5ms < 10ms)");
  CHECK(contains(message({.policy_revision = std::string(256, 'r')}), "policy_revision must be at most 255 bytes"));

  store_t store(manual_clock{});
  CHECK_THROWS_AS(keel::once(store, {.lease = 30s, .retention = 10s}), keel::invalid_options);
  try {
    keel::once bad(store, {.lease = 1h, .retention = 2h, .retry_window = 3h});
    FAIL("accepted a retention shorter than the retry window");
  } catch (const keel::invalid_options& e) {
    CHECK(e.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(contains(e.status().message(), "retention must exceed retry_window"));
  }
}

TEST_CASE("a new request is decided once; the same key is replayed with the same decision id", "[once][seed]") {
  manual_clock clock;
  store_t store(clock);
  keel::once decide(store, opts(), keel::environment{clock});
  std::atomic<int> calls{0};
  std::string context_id;
  auto provider = [&](const keel::claim_context& c) -> absl::StatusOr<keel::decision> {
    ++calls;
    context_id = std::string(c.decision_id);
    CHECK(c.ownership.fence == 1);
    CHECK_FALSE(c.took_over);
    return keel::decision{.model_digest = "m-large@1", .result = "approve"};
  };
  keel::call first(clock.now(), {.timeout = 3s});
  auto a = decide.run(first, receipt_key, receipt("receipt-A"), provider);
  REQUIRE(a.ok());
  CHECK_FALSE(a->replayed);
  CHECK_FALSE(first.record().replayed);
  CHECK(a->decision.id == context_id);
  CHECK(a->decision.id.rfind("dec-", 0) == 0);
  CHECK(a->decision.id.size() == 36);
  CHECK(a->decision.policy_revision == "rev-1");
  CHECK(a->decision.model_digest == "m-large@1");
  CHECK(a->fence == 1);

  clock.advance(10min);
  keel::call retry(clock.now(), {.timeout = 3s});
  auto b = decide.run(retry, receipt_key, receipt("receipt-A"), provider);
  REQUIRE(b.ok());
  CHECK(b->replayed);
  CHECK(retry.record().replayed);
  CHECK(b->decision == a->decision);
  CHECK(calls == 1);
}

TEST_CASE("changed contents under the same key are a conflict, in flight and after commit", "[once][seed]") {
  manual_clock clock;
  store_t store(clock);
  keel::once decide(store, opts(), keel::environment{clock});
  std::atomic<int> calls{0};
  std::latch entered(1), release(1);
  absl::StatusOr<keel::once_result> first = absl::UnknownError("not run");
  std::jthread holder([&] {
    keel::call call(clock.now(), {.timeout = 3s});
    first = decide.run(call, receipt_key, receipt("receipt-A"), gated_provider{&calls, &entered, &release});
  });
  entered.wait();
  keel::call during(clock.now(), {.timeout = 3s});
  auto c1 = decide.run(during, receipt_key, receipt("receipt-B"), counting_provider{&calls});
  CHECK(keel::is_conflict(c1.status()));
  CHECK(contains(c1.status().message(), "in flight"));
  release.count_down();
  holder.join();
  REQUIRE(first.ok());
  keel::call after(clock.now(), {.timeout = 3s});
  auto c2 = decide.run(after, receipt_key, receipt("receipt-B"), counting_provider{&calls});
  CHECK(keel::is_conflict(c2.status()));
  CHECK(contains(c2.status().message(), "committed"));
  CHECK(c2.status().code() == absl::StatusCode::kAlreadyExists);
  CHECK(calls == 1);
}

TEST_CASE("a duplicate waits for the first request and replays its decision: one provider call", "[once]") {
  manual_clock clock;
  store_t store(clock);
  std::vector<keel::begin_state> seen;
  std::mutex seen_mu;
  auto listener = [&](const keel::events::idempotency_begin& e) {
    std::lock_guard lock(seen_mu);
    seen.push_back(e.state);
  };
  keel::once decide(store, opts(), keel::environment{clock}.with_listener(listener));
  std::atomic<int> calls{0};
  std::latch entered(1), release(1);
  absl::StatusOr<keel::once_result> first = absl::UnknownError("not run"), second = absl::UnknownError("not run");
  std::jthread holder([&] {
    keel::call call(clock.now(), {.timeout = 5s});
    first = decide.run(call, receipt_key, receipt("receipt-A"), gated_provider{&calls, &entered, &release});
  });
  entered.wait();
  std::jthread duplicate([&] {
    keel::call call(clock.now(), {.timeout = 5s});
    second = decide.run(call, receipt_key, receipt("receipt-A"), counting_provider{&calls});
  });
  clock.await_sleepers(1);  // the duplicate is parked on the store, not polling
  release.count_down();     // the first commits and the store wakes the duplicate
  holder.join();
  duplicate.join();
  REQUIRE(first.ok());
  REQUIRE(second.ok());
  CHECK(second->replayed);
  CHECK(second->decision.id == first->decision.id);
  CHECK(calls == 1);
  std::lock_guard lock(seen_mu);
  CHECK(std::count(seen.begin(), seen.end(), keel::begin_state::claimed) == 1);
  CHECK(std::count(seen.begin(), seen.end(), keel::begin_state::in_flight) >= 1);
  CHECK(seen.back() == keel::begin_state::replay);
}

TEST_CASE("retry_later answers a duplicate at once with the holder's remaining lease", "[once]") {
  manual_clock clock;
  store_t store(clock);
  auto o = opts();
  o.on_duplicate = keel::on_duplicate::retry_later;
  keel::once decide(store, o, keel::environment{clock});
  std::atomic<int> calls{0};
  std::latch entered(1), release(1);
  std::jthread holder([&] {
    keel::call call(clock.now(), {.timeout = 5s});
    (void)decide.run(call, receipt_key, receipt("receipt-A"), gated_provider{&calls, &entered, &release});
  });
  entered.wait();
  clock.advance(5s);
  keel::call call(clock.now(), {.timeout = 5s});
  auto r = decide.run(call, receipt_key, receipt("receipt-A"), counting_provider{&calls});
  CHECK(keel::is_in_flight(r.status()));
  CHECK(keel::not_started(r.status()));
  CHECK(r.status().code() == absl::StatusCode::kAborted);
  CHECK(keel::retry_after(r.status()) == 25s);
  release.count_down();
  holder.join();
  CHECK(calls == 1);
}

TEST_CASE("a duplicate whose deadline runs out while waiting gets retry-later, never a second call", "[once]") {
  manual_clock clock;
  store_t store(clock);
  keel::once decide(store, opts(), keel::environment{clock});
  std::atomic<int> calls{0};
  std::latch entered(1), release(1);
  std::jthread holder([&] {
    keel::call call(clock.now(), {.timeout = 60s});
    (void)decide.run(call, receipt_key, receipt("receipt-A"), gated_provider{&calls, &entered, &release});
  });
  entered.wait();
  absl::StatusOr<keel::once_result> second = absl::UnknownError("not run");
  std::jthread duplicate([&] {
    keel::call call(clock.now(), {.timeout = 2s});
    second = decide.run(call, receipt_key, receipt("receipt-A"), counting_provider{&calls});
  });
  clock.await_sleepers(1);
  clock.advance(2s);
  duplicate.join();
  CHECK(keel::is_in_flight(second.status()));
  CHECK(keel::retry_after(second.status()) == 28s);
  release.count_down();
  holder.join();
  CHECK(calls == 1);
}

TEST_CASE("a duplicate cancelled while waiting returns Cancelled, not started", "[once]") {
  manual_clock clock;
  store_t store(clock);
  keel::once decide(store, opts(), keel::environment{clock});
  std::atomic<int> calls{0};
  std::latch entered(1), release(1);
  std::jthread holder([&] {
    keel::call call(clock.now(), {.timeout = 60s});
    (void)decide.run(call, receipt_key, receipt("receipt-A"), gated_provider{&calls, &entered, &release});
  });
  entered.wait();
  std::stop_source cancel;
  absl::StatusOr<keel::once_result> second = absl::UnknownError("not run");
  std::jthread duplicate([&] {
    keel::call call(clock.now(), {.timeout = 30s, .stop = cancel.get_token()});
    second = decide.run(call, receipt_key, receipt("receipt-A"), counting_provider{&calls});
  });
  clock.await_sleepers(1);
  cancel.request_stop();
  duplicate.join();
  CHECK(second.status().code() == absl::StatusCode::kCancelled);
  CHECK(keel::not_started(second.status()));
  release.count_down();
  holder.join();
  CHECK(calls == 1);
}

TEST_CASE("handler failure, forget: the record is removed and a retry decides afresh", "[once]") {
  manual_clock clock;
  store_t store(clock);
  auto o = opts();
  o.remember_failures = {.permanent = false};
  keel::once decide(store, o, keel::environment{clock});
  int calls = 0;
  auto flaky = [&](const keel::claim_context& c) -> absl::StatusOr<keel::decision> {
    ++calls;
    if (calls == 1) return absl::PermissionDeniedError("model refused the credential");
    CHECK(c.ownership.fence == 2);  // the abandoned record's fence is remembered
    CHECK_FALSE(c.took_over);
    return keel::decision{.result = "approve"};
  };
  keel::call first(clock.now(), {.timeout = 3s});
  auto a = decide.run(first, receipt_key, receipt("receipt-A"), flaky);
  CHECK(a.status().code() == absl::StatusCode::kPermissionDenied);
  keel::call retry(clock.now(), {.timeout = 3s});
  auto b = decide.run(retry, receipt_key, receipt("receipt-A"), flaky);
  REQUIRE(b.ok());
  CHECK_FALSE(b->replayed);
  CHECK(calls == 2);
}

TEST_CASE("handler failure, remember: the failure is stored and replayed without a call", "[once]") {
  manual_clock clock;
  store_t store(clock);
  auto o = opts();
  o.remember_failures = {.permanent = true, .transient = true, .throttled = true, .ambiguous = true};
  keel::once decide(store, o, keel::environment{clock});
  int calls = 0;
  auto failing = [&](const keel::claim_context&) -> absl::StatusOr<keel::decision> {
    ++calls;
    return absl::UnavailableError("provider overloaded");
  };
  keel::call first(clock.now(), {.timeout = 3s});
  auto a = decide.run(first, receipt_key, receipt("receipt-A"), failing);
  CHECK(a.status().code() == absl::StatusCode::kUnavailable);
  keel::call retry(clock.now(), {.timeout = 3s});
  auto b = decide.run(retry, receipt_key, receipt("receipt-A"), failing);
  CHECK(b.status().code() == absl::StatusCode::kUnavailable);
  CHECK(b.status().message() == "provider overloaded");
  CHECK(retry.record().replayed);
  CHECK(calls == 1);
}

TEST_CASE("handler failure, by default: permanent failures stored, transient ones forgotten", "[once]") {
  manual_clock clock;
  store_t store(clock);
  keel::once decide(store, opts(), keel::environment{clock});  // permanent failures only, by default
  REQUIRE(decide.options().remember_failures.permanent);
  REQUIRE_FALSE(decide.options().remember_failures.transient);
  int calls = 0;
  auto transient = [&](const keel::claim_context&) -> absl::StatusOr<keel::decision> {
    ++calls;
    return absl::UnavailableError("503");
  };
  auto permanent = [&](const keel::claim_context&) -> absl::StatusOr<keel::decision> {
    ++calls;
    return absl::InvalidArgumentError("unsupported model");
  };
  for (int i = 0; i < 2; ++i) {
    keel::call call(clock.now(), {.timeout = 3s});
    CHECK(decide.run(call, receipt_key, receipt("receipt-A"), transient).status().code() ==
          absl::StatusCode::kUnavailable);
  }
  CHECK(calls == 2);  // forgotten: the retry called again
  const keel::request_identity other{.tenant = "merchant-82", .endpoint = "receipts", .key = "key-48"};
  for (int i = 0; i < 2; ++i) {
    keel::call call(clock.now(), {.timeout = 3s});
    CHECK(decide.run(call, other, receipt("receipt-A"), permanent).status().code() ==
          absl::StatusCode::kInvalidArgument);
  }
  CHECK(calls == 3);  // remembered: replayed without a call
}

TEST_CASE("a provider that throws leaves no record in flight", "[once]") {
  manual_clock clock;
  store_t store(clock);
  keel::once decide(store, opts(), keel::environment{clock});
  int calls = 0;
  keel::call first(clock.now(), {.timeout = 3s});
  auto a = decide.run(first, receipt_key, receipt("receipt-A"), [&](const keel::claim_context&) -> absl::StatusOr<keel::decision> {
    ++calls;
    throw std::runtime_error("socket closed");
  });
  CHECK(a.status().code() == absl::StatusCode::kUnknown);
  CHECK(contains(a.status().message(), "socket closed"));
  std::atomic<int> later_calls{0};
  keel::call retry(clock.now(), {.timeout = 3s});
  auto b = decide.run(retry, receipt_key, receipt("receipt-A"), counting_provider{&later_calls});
  // Not in flight: the retry was decided at once (no wait, no takeover).
  REQUIRE(b.ok());
  CHECK_FALSE(b->replayed);
  CHECK(b->fence == 2);
  CHECK(calls == 1);
}

TEST_CASE("a newer policy revision meets a stored decision: replay, conflict or decide again", "[once]") {
  manual_clock clock;
  store_t store(clock);
  std::atomic<int> calls{0};
  keel::once v1(store, opts("rev-1"), keel::environment{clock});
  keel::call c0(clock.now(), {.timeout = 3s});
  auto first = v1.run(c0, receipt_key, receipt("receipt-A"), counting_provider{&calls, "approve"});
  REQUIRE(first.ok());

  auto replaying = opts("rev-2");
  keel::once replay(store, replaying, keel::environment{clock});
  keel::call c1(clock.now(), {.timeout = 3s});
  auto r = replay.run(c1, receipt_key, receipt("receipt-A"), counting_provider{&calls});
  REQUIRE(r.ok());
  CHECK(r->replayed);
  CHECK(r->decision.policy_revision == "rev-1");

  auto conflicting = opts("rev-2");
  conflicting.on_policy_change = keel::on_policy_change::conflict;
  keel::once conflict(store, conflicting, keel::environment{clock});
  keel::call c2(clock.now(), {.timeout = 3s});
  auto x = conflict.run(c2, receipt_key, receipt("receipt-A"), counting_provider{&calls});
  CHECK(keel::is_conflict(x.status()));
  CHECK(contains(x.status().message(), "decided under policy revision 'rev-1', now 'rev-2'"));
  CHECK(calls == 1);

  auto again = opts("rev-2");
  again.on_policy_change = keel::on_policy_change::decide_again;
  keel::once decide_again(store, again, keel::environment{clock});
  keel::call c3(clock.now(), {.timeout = 3s});
  auto d = decide_again.run(c3, receipt_key, receipt("receipt-A"), counting_provider{&calls, "decline"});
  REQUIRE(d.ok());
  CHECK_FALSE(d->replayed);
  CHECK(d->decision.policy_revision == "rev-2");
  CHECK(d->decision.result == "decline");
  CHECK(d->decision.id != first->decision.id);
  CHECK(d->fence == 2);
  CHECK(calls == 2);
  keel::call c4(clock.now(), {.timeout = 3s});
  auto d2 = decide_again.run(c4, receipt_key, receipt("receipt-A"), counting_provider{&calls});
  REQUIRE(d2.ok());
  CHECK(d2->replayed);
  CHECK(d2->decision.id == d->decision.id);
  CHECK(calls == 2);
}

TEST_CASE("without keep_alive the provider's deadline ends at the lease", "[once]") {
  manual_clock clock;
  store_t store(clock);
  keel::once decide(store, opts(), keel::environment{clock});  // lease 30 s
  keel::deadline seen;
  auto provider = [&](const keel::claim_context& c) -> absl::StatusOr<keel::decision> {
    seen = c.deadline;
    return keel::decision{.result = "ok"};
  };
  const keel::time_point t0 = clock.now();
  keel::call long_call(t0, {.timeout = 5min});
  REQUIRE(decide.run(long_call, receipt_key, receipt("a"), provider).ok());
  CHECK(seen.when() == t0 + 30s);
  keel::call short_call(t0, {.timeout = 3s, .response_reserve = 200ms});
  const keel::request_identity other{.tenant = "t", .endpoint = "e", .key = "k2"};
  REQUIRE(decide.run(short_call, other, receipt("a"), provider).ok());
  CHECK(seen == short_call.work_deadline());
}

namespace {
// Counts extend() calls so a test knows when a renewal has happened.
class extend_counting_store : public store_t {
 public:
  using store_t::store_t;
  absl::Status extend(const keel::request_identity& id, const keel::ownership& token, keel::duration ttl) {
    absl::Status s = store_t::extend(id, token, ttl);
    extends.fetch_add(1);
    extends.notify_all();
    return s;
  }
  std::atomic<int> extends{0};
};
}  // namespace

TEST_CASE("keep_alive renews the record while a long provider runs", "[once][keeper]") {
  manual_clock clock;
  extend_counting_store store(clock);
  auto o = opts();
  o.lease = 9s;
  o.keep_alive = true;
  keel::once decide(store, o, keel::environment{clock});
  std::atomic<int> calls{0};
  std::latch entered(1), release(1);
  absl::StatusOr<keel::once_result> first = absl::UnknownError("not run");
  std::jthread holder([&] {
    keel::call call(clock.now(), {.timeout = 10min});
    first = decide.run(call, receipt_key, receipt("receipt-A"), gated_provider{&calls, &entered, &release});
  });
  entered.wait();
  for (int i = 0; i < 6; ++i) {  // 18 s: twice the lease
    clock.await_sleepers(1);     // the keeper waits for its next renewal
    clock.advance(3s);
    for (int seen = store.extends.load(); seen < i + 1; seen = store.extends.load()) store.extends.wait(seen);
  }
  CHECK(store.extends.load() == 6);
  auto other = store.begin(receipt_key, receipt("receipt-A"), keel::owner_id::random(), {.lease = 9s});
  REQUIRE(other.ok());
  CHECK(other->state == keel::begin_state::in_flight);  // without renewals it would have been taken over
  release.count_down();
  holder.join();
  REQUIRE(first.ok());
  CHECK(first->fence == 1);
  CHECK(calls == 1);
}

TEST_CASE("a provider that outlives its lease: the takeover decides, the late commit is refused", "[once]") {
  manual_clock clock;
  store_t store(clock);
  keel::once decide(store, opts(), keel::environment{clock});
  std::atomic<int> calls{0};
  std::latch entered(1), release(1);
  absl::StatusOr<keel::once_result> slow = absl::UnknownError("not run");
  std::jthread holder([&] {
    keel::call call(clock.now(), {.timeout = 10min});
    slow = decide.run(call, receipt_key, receipt("receipt-A"), gated_provider{&calls, &entered, &release});
  });
  entered.wait();
  clock.advance(31s);  // the slow owner's lease has lapsed
  bool took_over = false;
  keel::call retry(clock.now(), {.timeout = 3s});
  auto fresh = decide.run(retry, receipt_key, receipt("receipt-A"),
                          [&](const keel::claim_context& c) -> absl::StatusOr<keel::decision> {
                            took_over = c.took_over;
                            ++calls;
                            return keel::decision{.result = "approve"};
                          });
  REQUIRE(fresh.ok());
  CHECK(took_over);
  CHECK(fresh->fence == 2);
  release.count_down();
  holder.join();
  CHECK(keel::is_lost_ownership(slow.status()));
  keel::call later(clock.now(), {.timeout = 3s});
  auto replay = decide.run(later, receipt_key, receipt("receipt-A"), counting_provider{&calls});
  REQUIRE(replay.ok());
  CHECK(replay->decision.id == fresh->decision.id);
  CHECK(calls == 2);
}

TEST_CASE("an invalid identity is refused before the store is touched", "[once]") {
  manual_clock clock;
  store_t store(clock);
  keel::once decide(store, opts(), keel::environment{clock});
  std::atomic<int> calls{0};
  keel::call call(clock.now(), {.timeout = 3s});
  const keel::request_identity bad{.tenant = "merchant-82", .endpoint = "receipts", .key = "key\n47"};
  auto r = decide.run(call, bad, receipt("a"), counting_provider{&calls});
  CHECK(r.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(r.status().message() == "idempotency key must not contain control characters (byte 0x0a at offset 3)");
  CHECK(calls == 0);
}

TEST_CASE("refusals and cancellations are never stored as the key's decision", "[once][outcome]") {
  manual_clock clock;
  store_t store(clock);
  // Even with every provider failure remembered: nothing ran here. Before
  // refusals had their own kind, the breaker's and the attempt's refusals
  // were "permanent" and replayed to every retry for 24 h.
  auto o = opts();
  o.remember_failures = {.permanent = true, .transient = true, .throttled = true, .ambiguous = true};
  keel::once decide(store, o, keel::environment{clock});
  const absl::Status refusals[] = {
      keel::refusal(absl::UnavailableError("keel: circuit breaker 'llm' is open"), "breaker:llm", 5s),
      keel::refusal(absl::DeadlineExceededError("keel: attempt not started: 10 ms left"), "adaptive_timeout"),
      absl::CancelledError("keel: call cancelled before the attempt started"),
  };
  const std::string keys[] = {"key-breaker", "key-attempt", "key-cancelled"};
  for (int i = 0; i < 3; ++i) {
    const absl::Status& refusal = refusals[i];
    INFO(refusal.ToString());
    const keel::request_identity id{.tenant = "merchant-82", .endpoint = "receipts", .key = keys[i]};
    int refused_calls = 0;
    keel::call first(clock.now(), {.timeout = 3s});
    auto a = decide.run(first, id, receipt("receipt-A"), [&](const keel::claim_context&) -> absl::StatusOr<keel::decision> {
      ++refused_calls;
      return refusal;
    });
    // The caller hears the refusal with its payloads: not started, who, when.
    CHECK(a.status().code() == refusal.code());
    CHECK(keel::not_started(a.status()) == keel::not_started(refusal));
    CHECK(keel::retry_after(a.status()) == keel::retry_after(refusal));
    CHECK(keel::refused_by(a.status()) == keel::refused_by(refusal));
    // The provider recovered: the retry runs it instead of replaying the refusal.
    std::atomic<int> calls{0};
    keel::call retry(clock.now(), {.timeout = 3s});
    auto b = decide.run(retry, id, receipt("receipt-A"), counting_provider{&calls});
    REQUIRE(b.ok());
    CHECK_FALSE(b->replayed);
    CHECK(calls == 1);
    CHECK(refused_calls == 1);
  }
}

TEST_CASE("once takes the pipeline's classifier to choose what it stores", "[once][outcome]") {
  manual_clock clock;
  store_t store(clock);
  // This service's provider reports a revoked key as Unavailable; its own
  // classifier knows that is permanent, and so must once.
  struct revoked_is_permanent {
    keel::outcome_kind operator()(const absl::Status& s, const keel::operation& op) const {
      if (s.message() == "key revoked") return keel::outcome_kind::permanent;
      return keel::default_classifier{}(s, op);
    }
  };
  keel::once decide(store, opts(), keel::environment{clock, revoked_is_permanent{}});
  int calls = 0;
  auto revoked = [&](const keel::claim_context&) -> absl::StatusOr<keel::decision> {
    ++calls;
    return absl::UnavailableError("key revoked");
  };
  keel::call first(clock.now(), {.timeout = 3s});
  CHECK(decide.run(first, receipt_key, receipt("receipt-A"), revoked).status().code() == absl::StatusCode::kUnavailable);
  keel::call retry(clock.now(), {.timeout = 3s});
  auto b = decide.run(retry, receipt_key, receipt("receipt-A"), revoked);
  CHECK(b.status().message() == "key revoked");
  CHECK(retry.record().replayed);
  CHECK(calls == 1);
}

TEST_CASE("once run in a pipeline stage takes the pipeline's environment: its classifier and listener",
          "[once][outcome][environment]") {
  manual_clock clock;
  store_t store(clock);
  const keel::once<store_t> decide(store, opts());  // real clock, default classifier, no listener
  std::vector<keel::begin_state> seen;
  const auto env = keel::environment{clock, revoked_rule{}, begin_recorder{&seen}};
  int calls = 0;
  auto revoked = [&](const keel::attempt&) -> absl::Status {
    ++calls;
    return absl::UnavailableError("key revoked");
  };
  auto pipe = keel::pipeline(decide_once_stage{&decide}).in(env);
  keel::call first(clock.now(), {.timeout = 3s});
  CHECK(pipe.run(first, revoked).code() == absl::StatusCode::kUnavailable);
  // Stored as permanent by the pipeline's classifier (the default one would
  // have forgotten it as transient): the retry replays it, no second call.
  keel::call retry(clock.now(), {.timeout = 3s});
  CHECK(pipe.run(retry, revoked).message() == "key revoked");
  CHECK(retry.record().replayed);
  CHECK(calls == 1);
  CHECK(seen == std::vector<keel::begin_state>{keel::begin_state::claimed, keel::begin_state::replay});
}

TEST_CASE("an ambiguous write stays unresolved until settled: never charged twice", "[once][outcome][seed]") {
  manual_clock clock;
  store_t store(clock);
  keel::once decide(store, opts(), keel::environment{clock});
  constexpr keel::operation charge{.effect = keel::effect::write};  // not idempotent downstream
  int charges = 0;
  auto charge_card = [&](const keel::claim_context&) -> absl::StatusOr<keel::decision> {
    ++charges;
    if (charges == 1) return absl::InternalError("500 after the request was sent");
    return keel::decision{.model_digest = "m-large@1", .result = "charged"};
  };
  keel::call first(clock.now(), {.timeout = 3s, .operation = charge});
  auto a = decide.run(first, receipt_key, receipt("receipt-A"), charge_card);
  REQUIRE(keel::is_unresolved(a.status()));
  CHECK(keel::default_classifier{}(a.status(), charge) == keel::outcome_kind::ambiguous);
  // The client's retry, even after the lease would have ended: not re-run.
  clock.advance(2min);
  keel::call retry(clock.now(), {.timeout = 3s, .operation = charge});
  auto b = decide.run(retry, receipt_key, receipt("receipt-A"), charge_card);
  CHECK(keel::is_unresolved(b.status()));
  CHECK(charges == 1);

  SECTION("settled as applied: retries replay the settled decision under the attempt's id") {
    const keel::digest request = receipt("receipt-A");
    REQUIRE(decide.resolve(receipt_key, request, keel::settlement::applied,
                           {.model_digest = "m-large@1", .result = "charged (found at the processor)"})
                .ok());
    keel::call later(clock.now(), {.timeout = 3s, .operation = charge});
    auto c = decide.run(later, receipt_key, request, charge_card);
    REQUIRE(c.ok());
    CHECK(c->replayed);
    CHECK(c->decision.result == "charged (found at the processor)");
    CHECK(c->decision.policy_revision == "rev-1");
    CHECK(charges == 1);
    // Settled once: a second settlement finds nothing to settle.
    CHECK(decide.resolve(receipt_key, request, keel::settlement::not_applied).code() ==
          absl::StatusCode::kFailedPrecondition);
    keel::call again(clock.now(), {.timeout = 3s, .operation = charge});
    CHECK(decide.run(again, receipt_key, request, charge_card)->decision.id == c->decision.id);
  }
  SECTION("settled as not applied: the next request decides afresh, with a higher fence") {
    REQUIRE(decide.resolve(receipt_key, receipt("receipt-A"), keel::settlement::not_applied).ok());
    keel::call later(clock.now(), {.timeout = 3s, .operation = charge});
    auto c = decide.run(later, receipt_key, receipt("receipt-A"), charge_card);
    REQUIRE(c.ok());
    CHECK_FALSE(c->replayed);
    CHECK(c->decision.result == "charged");
    CHECK(charges == 2);
    CHECK(c->fence > 2);
  }
  SECTION("a settlement for other contents is a conflict and settles nothing") {
    CHECK(keel::is_conflict(decide.resolve(receipt_key, receipt("receipt-B"), keel::settlement::not_applied)));
    keel::call later(clock.now(), {.timeout = 3s, .operation = charge});
    CHECK(keel::is_unresolved(decide.run(later, receipt_key, receipt("receipt-A"), charge_card).status()));
  }
  SECTION("an invalid settled decision is refused and leaves the record unresolved") {
    CHECK(decide.resolve(receipt_key, receipt("receipt-A"), keel::settlement::applied,
                         {.model_digest = std::string(300, 'm')})
              .code() == absl::StatusCode::kInvalidArgument);
    keel::call later(clock.now(), {.timeout = 3s, .operation = charge});
    CHECK(keel::is_unresolved(decide.run(later, receipt_key, receipt("receipt-A"), charge_card).status()));
    CHECK(charges == 1);
  }
}

TEST_CASE("resolve finds nothing to settle for a decided or absent key, and leaves no record", "[once]") {
  manual_clock clock;
  store_t store(clock);
  keel::once decide(store, opts(), keel::environment{clock});
  const keel::request_identity absent{.tenant = "merchant-82", .endpoint = "receipts", .key = "never-seen"};
  CHECK(decide.resolve(absent, receipt("receipt-A"), keel::settlement::not_applied).code() ==
        absl::StatusCode::kFailedPrecondition);
  std::atomic<int> calls{0};
  keel::call c(clock.now(), {.timeout = 3s});
  auto fresh = decide.run(c, absent, receipt("receipt-A"), counting_provider{&calls});
  REQUIRE(fresh.ok());
  CHECK_FALSE(fresh->replayed);  // resolve left no record in flight
  CHECK(decide.resolve(absent, receipt("receipt-A"), keel::settlement::not_applied).code() ==
        absl::StatusCode::kFailedPrecondition);
  keel::call again(clock.now(), {.timeout = 3s});
  CHECK(decide.run(again, absent, receipt("receipt-A"), counting_provider{&calls})->replayed);
  CHECK(calls == 1);
}
