// keel::lease_keeper and keel::run_leased on the in-memory store and the
// manual clock: renewals on schedule, a lost lease stops the work and says
// why, and a claimant after an expired lease checks the result store first.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <latch>
#include <mutex>
#include <string>
#include <thread>

#include "keel/durable/lease.hpp"
#include "keel/store/memory.hpp"
#include "keel/testing/manual_clock.hpp"
#include "support/async.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;
using keel::testing::manual_clock;
using store_t = keel::memory_store;

namespace {

bool contains(absl::string_view s, absl::string_view part) { return s.find(part) != absl::string_view::npos; }

// A renew function the test can hold at a gate (a process paused by the
// scheduler or a GC), counting the renewals that went through.
struct gated_renew {
  store_t* store;
  std::string key;
  keel::ownership token;
  std::mutex* gate;
  std::atomic<int>* attempts;
  absl::Status operator()(keel::duration ttl) const {
    std::lock_guard hold(*gate);
    absl::Status s = store->renew(key, token, ttl);
    attempts->fetch_add(1);
    attempts->notify_all();
    return s;
  }
};

void await_count(std::atomic<int>& n, int at_least) {
  for (int seen = n.load(); seen < at_least; seen = n.load()) n.wait(seen);
}

// Runs on the keeper's thread: records, the test asserts after stop().
struct lost_counter {
  std::atomic<int>* lost;
  std::atomic<bool>* right_key;
  void operator()(const keel::events::lease_lost& e) const {
    right_key->store(e.work_key == "nightly" && keel::is_lost_ownership(e.why));
    lost->fetch_add(1);
  }
};

}  // namespace

TEST_CASE("lease keeper options are validated", "[lease][keeper]") {
  CHECK(keel::lease_keeper_options{}.validate().ok());
  CHECK(keel::lease_keeper_options{.ttl = 0s}.validate().message() == "lease_keeper_options.ttl must be > 0 (got 0s)");
  CHECK(keel::lease_keeper_options{.ttl = 10s, .renew_every = 10s}.validate().message() ==
        "lease_keeper_options.renew_every must be in [0, ttl) (got 10s)");
  CHECK(keel::lease_keeper_options{.ttl = 10s, .margin = 11s}.validate().message() ==
        "lease_keeper_options.margin must be in [0, ttl) (got 11s)");
  CHECK(keel::leased_work_options{.ttl = 10s, .result_retention = -1s}.validate().message() ==
        "leased_work_options.result_retention must be >= 0 (got -1s)");
  manual_clock clock;
  CHECK_THROWS_AS(keel::lease_keeper<keel::environment<manual_clock>>("k", [](keel::duration) { return absl::OkStatus(); },
                                                   std::stop_source(), clock.now(), {.ttl = 0s}, keel::environment{clock}),
                  keel::invalid_options);
}

TEST_CASE("the keeper renews every ttl/3 and keeps a second claimant out", "[lease][keeper]") {
  manual_clock clock;
  store_t store(clock);
  const keel::time_point sent = clock.now();
  auto c = store.claim("nightly", keel::owner_id::random(), 9s);
  REQUIRE(c.ok());
  REQUIRE(c->acquired);
  std::mutex gate;
  std::atomic<int> renewals{0};
  std::stop_source work;
  {
    keel::lease_keeper keeper("nightly", gated_renew{&store, "nightly", c->ownership, &gate, &renewals},
                                            work, sent, {.ttl = 9s}, keel::environment{clock});
    for (int i = 1; i <= 5; ++i) {  // 15 s, well past the first 9 s lease
      clock.await_sleepers(1);
      clock.advance(3s);
      await_count(renewals, i);
    }
    auto other = store.claim("nightly", keel::owner_id::random(), 9s);
    REQUIRE(other.ok());
    CHECK_FALSE(other->acquired);
    CHECK(other->remaining == 9s);  // renewed at 15 s for 9 s
    // The keeper counts a renewal after its callback returns: wait for that
    // (bounded) rather than race the keeper's thread.
    CHECK(keel_test::eventually([&] { return keeper.renewals() == 5; }));
    CHECK_FALSE(keeper.lost());
    CHECK(keeper.status().ok());
  }  // the destructor stops the keeper; it does not release
  CHECK_FALSE(work.stop_requested());
  CHECK_FALSE(store.claim("nightly", keel::owner_id::random(), 9s)->acquired);
}

TEST_CASE("a lease taken over while the holder was paused: the keeper stops the work and says why",
          "[lease][keeper]") {
  manual_clock clock;
  store_t store(clock);
  const keel::time_point sent = clock.now();
  auto c = store.claim("nightly", keel::owner_id::random(), 9s);
  REQUIRE(c->acquired);
  std::mutex gate;
  std::atomic<int> attempts{0};
  std::atomic<int> lost_events{0};
  std::atomic<bool> right_key{false};
  std::stop_source work;
  keel::lease_keeper keeper(
      "nightly", gated_renew{&store, "nightly", c->ownership, &gate, &attempts}, work, sent, {.ttl = 9s},
      keel::environment{clock}.with_listener(lost_counter{&lost_events, &right_key}));
  clock.await_sleepers(1);
  {
    std::unique_lock pause(gate);  // the holder is paused before its renewal reaches the store
    clock.advance(10s);            // ... long enough for its lease to lapse
    auto thief = store.claim("nightly", keel::owner_id::random(), 9s);
    REQUIRE(thief->acquired);
    CHECK(thief->took_over);
    CHECK(thief->ownership.fence == 2);
  }
  await_count(attempts, 1);
  keeper.stop();
  CHECK(keeper.lost());
  CHECK(work.stop_requested());
  CHECK(keel::is_lost_ownership(keeper.status()));
  CHECK(contains(keeper.status().message(), "fence 2"));
  CHECK(lost_events == 1);
  CHECK(right_key);
}

TEST_CASE("renewals failing until the lease would run out: the keeper gives up in time", "[lease][keeper]") {
  manual_clock clock;
  std::atomic<int> attempts{0};
  std::stop_source work;
  const keel::time_point start = clock.now();
  keel::lease_keeper keeper(
      "nightly",
      [&](keel::duration) {
        attempts.fetch_add(1);
        attempts.notify_all();
        return keel::store_unavailable_error("database is locked");
      },
      work, start, {.ttl = 10s, .renew_every = 3s, .margin = 1s}, keel::environment{clock});
  // Attempts at 3 s, then every 750 ms (renew_every / 4); gives up once less
  // than the 1 s margin is left of the lease confirmed at 0 s: at 9 s.
  auto expected_attempts = [&](keel::duration elapsed) {
    return elapsed < 3s ? 0 : 1 + static_cast<int>((elapsed - 3s) / 750ms);
  };
  while (clock.now() - start < 9s) {
    clock.await_sleepers(1);
    clock.advance(250ms);
    await_count(attempts, expected_attempts(clock.now() - start));
  }
  keeper.stop();
  REQUIRE(keeper.lost());
  CHECK(work.stop_requested());
  CHECK(keeper.status().code() == absl::StatusCode::kUnavailable);
  CHECK(contains(keeper.status().message(), "could not renew lease 'nightly' before it would run out"));
  CHECK(attempts == 9);  // 3, 3.75, ... 9 s: the work was stopped before the lease ended at 10 s
}

TEST_CASE("run_leased: work runs once, its result is saved, the lease released", "[lease][run_leased]") {
  manual_clock clock;
  store_t store(clock);
  int runs = 0;
  auto work = [&](std::stop_token, const keel::ownership& lease) -> absl::StatusOr<std::string> {
    ++runs;
    CHECK(lease.fence == 1);
    return std::string("report-v1");
  };
  auto r = keel::run_leased(store, store, "nightly", "nightly-result", {.ttl = 30s}, work, keel::environment{clock});
  REQUIRE(r.ok());
  CHECK(r->value == "report-v1");
  CHECK_FALSE(r->cached);
  CHECK_FALSE(r->took_over);
  CHECK(*store.load_result("nightly-result") == std::optional<std::string>("report-v1"));
  auto next = store.claim("nightly", keel::owner_id::random(), 30s);
  CHECK(next->acquired);  // released
  CHECK(next->ownership.fence == 2);
  CHECK_FALSE(next->took_over);
  REQUIRE(store.release("nightly", next->ownership).ok());
  // A second run finds the result and does not run the work.
  auto again = keel::run_leased(store, store, "nightly", "nightly-result", {.ttl = 30s}, work, keel::environment{clock});
  REQUIRE(again.ok());
  CHECK(again->cached);
  CHECK(runs == 1);
}

TEST_CASE("run_leased: a lease held by someone else is in flight; nothing runs", "[lease][run_leased]") {
  manual_clock clock;
  store_t store(clock);
  auto holder = store.claim("nightly", keel::owner_id::random(), 30s);
  REQUIRE(holder->acquired);
  clock.advance(10s);
  int runs = 0;
  auto r = keel::run_leased(store, store, "nightly", "nightly-result", {.ttl = 30s},
                            [&](std::stop_token, const keel::ownership&) -> absl::StatusOr<std::string> {
                              ++runs;
                              return std::string("x");
                            },
                            keel::environment{clock});
  CHECK(keel::is_in_flight(r.status()));
  CHECK(keel::retry_after(r.status()) == 20s);
  CHECK(runs == 0);
}

TEST_CASE("run_leased after an expired lease: the result store is checked before the work starts again",
          "[lease][run_leased]") {
  manual_clock clock;
  store_t store(clock);
  int runs = 0;
  auto work = [&](std::stop_token, const keel::ownership& lease) -> absl::StatusOr<std::string> {
    ++runs;
    CHECK(lease.fence == 2);
    return std::string("recomputed");
  };
  SECTION("the dead holder had saved its result") {
    auto dead = store.claim("nightly", keel::owner_id::random(), 30s);
    REQUIRE(dead->acquired);
    REQUIRE(*store.save_result("nightly-result", "finished-before-dying", 0s));
    clock.advance(31s);  // it never released
    auto r = keel::run_leased(store, store, "nightly", "nightly-result", {.ttl = 30s}, work, keel::environment{clock});
    REQUIRE(r.ok());
    CHECK(r->cached);
    CHECK(r->took_over);
    CHECK(r->value == "finished-before-dying");
    CHECK(runs == 0);
  }
  SECTION("the dead holder had not finished") {
    auto dead = store.claim("nightly", keel::owner_id::random(), 30s);
    REQUIRE(dead->acquired);
    clock.advance(31s);
    auto r = keel::run_leased(store, store, "nightly", "nightly-result", {.ttl = 30s}, work, keel::environment{clock});
    REQUIRE(r.ok());
    CHECK_FALSE(r->cached);
    CHECK(r->took_over);
    CHECK(r->ownership.fence == 2);
    CHECK(r->value == "recomputed");
    CHECK(runs == 1);
    // The dead holder's late release is refused.
    CHECK(keel::is_lost_ownership(store.release("nightly", dead->ownership)));
  }
}

TEST_CASE("run_leased: a lease lost mid-work stops the work and saves nothing", "[lease][run_leased]") {
  manual_clock clock;
  // Renewals go through this store wrapper, held at a gate by the test.
  struct gated_store : store_t {
    using store_t::store_t;
    std::mutex gate;
    std::atomic<int> renews{0};
    absl::Status renew(std::string_view key, const keel::ownership& token, keel::duration ttl) {
      std::lock_guard hold(gate);
      absl::Status s = store_t::renew(key, token, ttl);
      renews.fetch_add(1);
      renews.notify_all();
      return s;
    }
  } store(clock);
  std::latch started(1);
  std::atomic<bool> saw_stop{false};
  absl::StatusOr<keel::leased_result> r = absl::UnknownError("not run");
  std::jthread worker([&] {
    r = keel::run_leased(store, store, "nightly", "nightly-result", {.ttl = 9s},
                         [&](std::stop_token stop, const keel::ownership&) -> absl::StatusOr<std::string> {
                           started.count_down();
                           keel_test::block_until_stopped(stop);
                           saw_stop = true;
                           return std::string("half-done");
                         },
                         keel::environment{clock});
  });
  started.wait();
  clock.await_sleepers(1);  // the keeper
  {
    std::unique_lock pause(store.gate);
    clock.advance(10s);
    auto thief = store.claim("nightly", keel::owner_id::random(), 9s);
    REQUIRE(thief->acquired);
  }
  worker.join();
  CHECK(saw_stop);
  CHECK(keel::is_lost_ownership(r.status()));
  CHECK_FALSE(store.load_result("nightly-result")->has_value());
}

TEST_CASE("run_leased: a failed work releases the lease and returns the failure", "[lease][run_leased]") {
  manual_clock clock;
  store_t store(clock);
  auto r = keel::run_leased(store, store, "nightly", "nightly-result", {.ttl = 30s},
                            [](std::stop_token, const keel::ownership&) -> absl::StatusOr<std::string> {
                              return absl::UnavailableError("warehouse down");
                            },
                            keel::environment{clock});
  CHECK(r.status().code() == absl::StatusCode::kUnavailable);
  auto next = store.claim("nightly", keel::owner_id::random(), 30s);
  CHECK(next->acquired);
  CHECK_FALSE(next->took_over);
  CHECK_FALSE(store.load_result("nightly-result")->has_value());
}
