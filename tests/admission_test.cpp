// keel::rate_limiter and keel::admission: the token bucket's arithmetic
// and its bound under contention; multi-level, all-or-nothing admission
// with rollback, compute reservations reconciled after the work, replays,
// queued work, refusal payloads, the pipeline policy, and bad options.
#include "keel/policy/admission.hpp"

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "keel/compose/pipeline.hpp"
#include "keel/core/call.hpp"
#include "keel/policy/internal/short_key.hpp"
#include "keel/policy/backoff.hpp"
#include "keel/policy/bulkhead.hpp"
#include "keel/policy/circuit_breaker.hpp"
#include "keel/policy/rate_limiter.hpp"
#include "keel/policy/retry.hpp"
#include "keel/testing/manual_clock.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;
using keel::testing::manual_clock;

namespace {
std::string refused_by(const absl::Status& s) { return keel::refused_by(s).value_or("(none)"); }
}  // namespace

// --- token bucket --------------------------------------------------------------

TEST_CASE("the token bucket admits its burst, then its rate", "[rate_limiter]") {
  manual_clock clock;
  keel::rate_limiter limiter({.rate = 2, .burst = 3});  // one every 500 ms, three at once
  for (int i = 0; i < 3; ++i) CHECK(limiter.try_acquire(clock.now()));
  const keel::rate_decision refused = limiter.try_acquire(clock.now());
  CHECK(!refused);
  CHECK(refused.retry_after == 500ms);
  clock.advance(499ms);
  CHECK(!limiter.try_acquire(clock.now()));
  clock.advance(1ms);
  CHECK(limiter.try_acquire(clock.now()));
  CHECK(!limiter.try_acquire(clock.now()));

  clock.advance(10s);  // idle: full again, never more than the burst
  CHECK(limiter.available(clock.now()) == 3.0);
  for (int i = 0; i < 3; ++i) CHECK(limiter.try_acquire(clock.now()));
  CHECK(!limiter.try_acquire(clock.now()));

  CHECK(limiter.try_acquire(clock.now() + 1h, 4).retry_after == keel::duration::max());  // more than it holds

  limiter.refund(2);  // an all-or-nothing admission rolled back
  CHECK(limiter.available(clock.now()) == 2.0);
  CHECK(limiter.try_acquire(clock.now(), 2));
  CHECK(!limiter.try_acquire(clock.now()));
}

TEST_CASE("charging past the bucket leaves a debt later callers wait off", "[rate_limiter]") {
  manual_clock clock;
  keel::rate_limiter compute({.rate = 100, .burst = 1000});  // 1000 units, refilling 100/s
  CHECK(compute.try_acquire(clock.now(), 800));
  compute.charge(clock.now(), 500);  // the work cost 500 more than reserved
  CHECK(compute.available(clock.now()) == -300.0);
  const keel::rate_decision d = compute.try_acquire(clock.now(), 100);
  CHECK(!d);
  CHECK(d.retry_after == 4s);  // 300 of debt + 100 wanted, at 100 per second
  clock.advance(4s);
  CHECK(compute.try_acquire(clock.now(), 100));
  // An idle, full bucket charged from now, not from long ago.
  clock.advance(1h);
  compute.charge(clock.now(), 250);
  CHECK(compute.available(clock.now()) == 750.0);
}

TEST_CASE("concurrent callers never take more than the bucket holds", "[rate_limiter][concurrency]") {
  const keel::time_point frozen = manual_clock().now();
  keel::rate_limiter limiter({.rate = 1, .burst = 1000});  // no refill worth speaking of at a frozen time
  std::atomic<int> granted{0};
  {
    std::vector<std::jthread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&] {
        for (int i = 0; i < 2000; ++i)
          if (limiter.try_acquire(frozen)) granted.fetch_add(1);
      });
    }
  }
  CHECK(granted.load() == 1000);
}

TEST_CASE("invalid rate limiter options are refused with the field named", "[rate_limiter][options]") {
  CHECK(std::string(keel::rate_limiter_options{.rate = 0}.validate().message()) ==
        "rate_limiter_options.rate must be in (0, 1e9] units per second (got 0)");
  CHECK(std::string(keel::rate_limiter_options{.rate = -5}.validate().message()) ==
        "rate_limiter_options.rate must be in (0, 1e9] units per second (got -5)");
  CHECK(std::string(keel::rate_limiter_options{.rate = 10, .burst = 0.5}.validate().message()) ==
        "rate_limiter_options.burst must be a finite number >= 1 (got 0.5)");
  CHECK_THROWS_AS(keel::rate_limiter({.rate = 0}), keel::invalid_options);
}

TEST_CASE("short-key equality sees a difference in any byte, at any length", "[admission][keys]") {
  for (std::size_t n = 0; n <= 40; ++n) {
    std::string a(n, 'x');
    for (std::size_t i = 0; i < n; ++i) a[i] = static_cast<char>('a' + (i * 7) % 26);
    const std::string same = a;
    CHECK(keel::detail::key_equals(a, same));
    CHECK(keel::detail::key_hash(a) == keel::detail::key_hash(same));
    CHECK(!keel::detail::key_equals(a, a + "y"));
    for (std::size_t i = 0; i < n; ++i) {
      std::string b = a;
      b[i] = static_cast<char>(b[i] ^ 0x20);
      if (keel::detail::key_equals(a, b)) FAIL("length " << n << ": byte " << i << " differs but compared equal");
    }
  }
  // Hashes spread over the low bits the tables use.
  std::vector<int> buckets(64, 0);
  for (int i = 0; i < 6400; ++i) ++buckets[keel::detail::key_hash("tenant-" + std::to_string(i)) & 63];
  for (int b : buckets) CHECK((b > 50 && b < 150));
}

// --- admission ------------------------------------------------------------------

TEST_CASE("a request is admitted only if every level admits it; a refusal keeps nothing", "[admission]") {
  manual_clock clock;
  keel::admission quotas({.tenant_defaults = {.rate = 10, .burst = 10, .max_in_flight = 5},
                          .model_defaults = {.max_in_flight = 1}});
  absl::StatusOr<keel::admission_ticket> first = quotas.admit({.tenant = "acme", .model = "m"}, clock.now());
  REQUIRE(first.ok());
  CHECK(quotas.tenant_figures("acme", clock.now())->in_flight == 1);
  CHECK(quotas.tenant_figures("acme", clock.now())->rate_available == 9.0);

  // The model level refuses: the tenant's slot and rate token are given back.
  const absl::StatusOr<keel::admission_ticket> second = quotas.admit({.tenant = "acme", .model = "m"}, clock.now());
  REQUIRE(!second.ok());
  CHECK(second.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK(refused_by(second.status()) == "model:m:in_flight");
  CHECK(second.status().message() == "keel: model 'm' is over its in_flight quota");
  CHECK(keel::retry_after(second.status()) == std::optional<keel::duration>(100ms));
  CHECK(keel::not_started(second.status()));
  CHECK(quotas.tenant_figures("acme", clock.now())->in_flight == 1);
  CHECK(quotas.tenant_figures("acme", clock.now())->rate_available == 9.0);

  // Another model is a separate key at the model level.
  absl::StatusOr<keel::admission_ticket> other = quotas.admit({.tenant = "acme", .model = "n"}, clock.now());
  CHECK(other.ok());
  CHECK(quotas.tenant_figures("acme", clock.now())->in_flight == 2);
  first->cancel();
  *other = keel::admission_ticket();
  CHECK(quotas.tenant_figures("acme", clock.now())->in_flight == 0);
  CHECK(quotas.model_figures("m", clock.now())->in_flight == 0);
}

TEST_CASE("the rate level refuses with when to come back", "[admission]") {
  manual_clock clock;
  keel::admission quotas({.tenant_defaults = {.rate = 5, .burst = 2}, .tenants = {{"vip", {.rate = 100, .burst = 100}}}});
  CHECK(quotas.admit({.tenant = "acme"}, clock.now()).ok());
  CHECK(quotas.admit({.tenant = "acme"}, clock.now()).ok());
  const absl::Status s = quotas.admit({.tenant = "acme"}, clock.now()).status();
  CHECK(refused_by(s) == "tenant:acme:rate");
  CHECK(keel::retry_after(s) == std::optional<keel::duration>(200ms));
  for (int i = 0; i < 50; ++i) CHECK(quotas.admit({.tenant = "vip"}, clock.now()).ok());  // its override
  clock.advance(200ms);
  CHECK(quotas.admit({.tenant = "acme"}, clock.now()).ok());
}

TEST_CASE("compute is reserved up front and reconciled with the actual cost", "[admission][compute]") {
  manual_clock clock;
  keel::admission quotas({.tenant_defaults = {.compute_budget = 1000, .compute_window = 60s}});
  absl::StatusOr<keel::admission_ticket> a = quotas.admit({.tenant = "acme", .estimate = 600}, clock.now());
  REQUIRE(a.ok());
  const absl::Status over = quotas.admit({.tenant = "acme", .estimate = 600}, clock.now()).status();
  CHECK(refused_by(over) == "tenant:acme:compute");
  CHECK(keel::retry_after(over) == std::optional<keel::duration>(12s));  // 200 units at 1000 per minute

  a->reconcile(300, clock.now());  // the call used half its estimate: 300 come back
  CHECK(quotas.tenant_figures("acme", clock.now())->compute_available == 700.0);
  absl::StatusOr<keel::admission_ticket> b = quotas.admit({.tenant = "acme", .estimate = 600}, clock.now());
  REQUIRE(b.ok());
  b->reconcile(900, clock.now());  // and this one more than estimated: charged
  CHECK(quotas.tenant_figures("acme", clock.now())->compute_available == -200.0);
  a->reconcile(0, clock.now());  // settled once; later calls change nothing
  CHECK(quotas.tenant_figures("acme", clock.now())->compute_available == -200.0);

  // An estimate above the whole budget can never pass: refused as permanent.
  const absl::Status never = quotas.admit({.tenant = "t2", .estimate = 5000}, clock.now()).status();
  CHECK(refused_by(never) == "tenant:t2:compute");
  CHECK(!keel::retry_after(never).has_value());
  CHECK(keel::marked_outcome(never) == keel::outcome_kind::permanent);
}

TEST_CASE("a compute refusal at the model level gives back the tenant's reservation", "[admission][compute]") {
  manual_clock clock;
  keel::admission quotas({.tenant_defaults = {.rate = 10, .burst = 10, .max_in_flight = 4, .compute_budget = 10'000},
                          .model_defaults = {.max_in_flight = 4, .compute_budget = 1000}});
  absl::StatusOr<keel::admission_ticket> big = quotas.admit({.tenant = "a", .model = "m", .estimate = 900}, clock.now());
  REQUIRE(big.ok());
  const absl::Status s = quotas.admit({.tenant = "b", .model = "m", .estimate = 500}, clock.now()).status();
  CHECK(refused_by(s) == "model:m:compute");
  const keel::quota_figures b = *quotas.tenant_figures("b", clock.now());
  CHECK(b.compute_available == 10'000.0);
  CHECK(b.in_flight == 0);
  CHECK(b.rate_available == 10.0);
  CHECK(quotas.model_figures("m", clock.now())->in_flight == 1);
}

TEST_CASE("a replay counts toward the tenant's rate but spends no model capacity", "[admission][replay]") {
  manual_clock clock;
  keel::admission quotas({.tenant_defaults = {.rate = 1, .burst = 3, .max_in_flight = 1, .compute_budget = 100},
                          .model_defaults = {.rate = 1, .burst = 1, .max_in_flight = 1}});
  absl::StatusOr<keel::admission_ticket> fresh =
      quotas.admit({.tenant = "acme", .model = "m", .estimate = 100}, clock.now());
  REQUIRE(fresh.ok());
  // The model and the tenant's in-flight and compute are all used up; a
  // replay still passes, twice, until the tenant's rate runs out.
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<keel::admission_ticket> r = quotas.admit(
        {.tenant = "acme", .model = "m", .estimate = 100, .kind = keel::request_kind::replay}, clock.now());
    CHECK(r.ok());
  }
  const absl::Status s =
      quotas.admit({.tenant = "acme", .model = "m", .kind = keel::request_kind::replay}, clock.now()).status();
  CHECK(refused_by(s) == "tenant:acme:rate");
  CHECK(quotas.model_figures("m", clock.now())->rate_available == 0.0);
  CHECK(quotas.tenant_figures("acme", clock.now())->compute_available == 0.0);
}

TEST_CASE("queued work holds a queued slot until it starts", "[admission][queued]") {
  manual_clock clock;
  keel::admission quotas({.tenant_defaults = {.max_in_flight = 1, .max_queued = 1, .compute_budget = 1000}});
  absl::StatusOr<keel::admission_ticket> a = quotas.admit({.tenant = "t", .queued = true}, clock.now());
  REQUIRE(a.ok());
  CHECK(a->queued());
  CHECK(refused_by(quotas.admit({.tenant = "t", .queued = true}, clock.now()).status()) == "tenant:t:queued");
  CHECK(a->start().ok());
  CHECK(!a->queued());
  CHECK(quotas.tenant_figures("t", clock.now())->queued == 0);
  CHECK(quotas.tenant_figures("t", clock.now())->in_flight == 1);

  absl::StatusOr<keel::admission_ticket> c = quotas.admit({.tenant = "t", .estimate = 400, .queued = true}, clock.now());
  REQUIRE(c.ok());
  const absl::Status busy = c->start();  // in flight is full: stays queued
  CHECK(refused_by(busy) == "tenant:t:in_flight");
  CHECK(c->queued());
  CHECK(quotas.tenant_figures("t", clock.now())->queued == 1);
  *a = keel::admission_ticket();  // the running one finishes
  CHECK(c->start().ok());
  CHECK(quotas.tenant_figures("t", clock.now())->in_flight == 1);
  CHECK(quotas.tenant_figures("t", clock.now())->compute_available == 600.0);

  // A queued ticket dropped before it started gives its estimate back.
  {
    absl::StatusOr<keel::admission_ticket> d =
        quotas.admit({.tenant = "t", .estimate = 300, .queued = true}, clock.now());
    REQUIRE(d.ok());
    CHECK(quotas.tenant_figures("t", clock.now())->compute_available == 300.0);
  }
  CHECK(quotas.tenant_figures("t", clock.now())->compute_available == 600.0);
  CHECK(quotas.tenant_figures("t", clock.now())->queued == 0);
}

TEST_CASE("10,000 made-up tenants fill the table; a real tenant still gets its own full quota, never a shared one",
          "[admission][keys]") {
  manual_clock clock;
  keel::admission quotas(
      {.tenant_defaults = {.rate = 10, .burst = 20, .max_in_flight = 4, .compute_budget = 1000}, .max_keys = 10'000});
  // One request each under 10,000 names, each reserving compute it never
  // gives back: every key's compute budget is 100 short, for 6 s.
  for (int i = 0; i < 10'000; ++i) {
    const std::string name = "made-up-" + std::to_string(i);
    absl::StatusOr<keel::admission_ticket> t = quotas.admit({.tenant = name, .estimate = 100}, clock.now());
    REQUIRE(t.ok());
  }
  CHECK(quotas.tenant_keys() == 10'000);

  // No key is idle yet: forgetting one would hand its owner a fresh budget.
  // The newcomer is refused, visibly, with its own name and when to come back.
  const absl::StatusOr<keel::admission_ticket> early = quotas.admit({.tenant = "acme"}, clock.now());
  CHECK(early.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK(refused_by(early.status()) == "tenant:acme:table_full");
  CHECK(keel::retry_after(early.status()) == std::optional<keel::duration>(6s));
  CHECK(keel::not_started(early.status()));
  // A second newcomer is refused on its own account too: nobody shares a bucket.
  CHECK(refused_by(quotas.admit({.tenant = "globex"}, clock.now()).status()) == "tenant:globex:table_full");
  CHECK(quotas.table_full_refusals() == 2);
  CHECK(!quotas.tenant_figures("acme", clock.now()).has_value());

  // Once the made-up keys are idle they are reclaimed, and acme gets
  // exactly a new tenant's quota: 4 in flight, 20 at once, 1000 units.
  clock.advance(6s);
  std::vector<keel::admission_ticket> held;
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<keel::admission_ticket> t = quotas.admit({.tenant = "acme", .estimate = 250}, clock.now());
    REQUIRE(t.ok());
    held.push_back(std::move(*t));
  }
  CHECK(quotas.keys_reclaimed() == 10'000);
  CHECK(refused_by(quotas.admit({.tenant = "acme"}, clock.now()).status()) == "tenant:acme:in_flight");
  const keel::quota_figures acme = *quotas.tenant_figures("acme", clock.now());
  CHECK(acme.in_flight == 4);
  CHECK(acme.rate_available == 16.0);
  CHECK(acme.compute_available == 0.0);
  // ...and globex, arriving now, has its own, untouched by acme's.
  absl::StatusOr<keel::admission_ticket> g = quotas.admit({.tenant = "globex", .estimate = 1000}, clock.now());
  REQUIRE(g.ok());
  CHECK(quotas.tenant_figures("globex", clock.now())->in_flight == 1);
  CHECK(quotas.tenant_keys() == 2);
}

TEST_CASE("idle keys are reclaimed when the table is full; keys in use never are", "[admission][keys]") {
  manual_clock clock;
  keel::admission quotas({.tenant_defaults = {.rate = 1, .max_in_flight = 1}, .max_keys = 3});
  absl::StatusOr<keel::admission_ticket> a = quotas.admit({.tenant = "a"}, clock.now());
  REQUIRE(a.ok());  // held: in use
  REQUIRE(quotas.admit({.tenant = "b"}, clock.now()).ok());
  REQUIRE(quotas.admit({.tenant = "c"}, clock.now()).ok());
  CHECK(quotas.tenant_keys() == 3);

  // b and c are released but their rate buckets refill only in 1 s.
  const absl::Status full = quotas.admit({.tenant = "d"}, clock.now()).status();
  CHECK(refused_by(full) == "tenant:d:table_full");
  CHECK(keel::retry_after(full) == std::optional<keel::duration>(100ms));  // a's ticket may end sooner
  clock.advance(50ms);
  // Looked again lately: refused without another scan, with the time left.
  CHECK(keel::retry_after(quotas.admit({.tenant = "d"}, clock.now()).status()) ==
        std::optional<keel::duration>(50ms));

  clock.advance(950ms);  // b and c are idle now; a is still held
  absl::StatusOr<keel::admission_ticket> d = quotas.admit({.tenant = "d"}, clock.now());
  REQUIRE(d.ok());
  CHECK(quotas.keys_reclaimed() == 2);
  CHECK(!quotas.tenant_figures("b", clock.now()).has_value());
  CHECK(quotas.tenant_figures("a", clock.now())->in_flight == 1);  // kept, with its slot
  CHECK(refused_by(quotas.admit({.tenant = "a"}, clock.now()).status()) == "tenant:a:in_flight");

  // A returning key starts as a new one would: its state was a new one's.
  REQUIRE(quotas.admit({.tenant = "b"}, clock.now()).ok());
  CHECK(quotas.tenant_figures("b", clock.now())->rate_available == 0.0);

  // Released, a is reclaimable like any other once idle.
  *a = keel::admission_ticket();
  clock.advance(1s);
  REQUIRE(quotas.admit({.tenant = "e"}, clock.now()).ok());
  CHECK(quotas.tenant_keys() <= 3);
  CHECK(!quotas.tenant_figures("a", clock.now()).has_value());
}

TEST_CASE("threads churning a small table: lookups race reclaiming, no key ever has two quotas, all comes back",
          "[admission][keys][threads]") {
  // 64 names through a table of 8: keys are reclaimed and their entries
  // reused while other threads look them up without a lock.
  keel::admission quotas({.tenant_defaults = {.max_in_flight = 1}, .max_keys = 8});
  constexpr int names = 64, threads = 4, ops = 20'000;
  std::vector<std::atomic<int>> holders(names);
  std::atomic<int> over{0};  // a key admitted twice at once: two quotas for one name
  std::atomic<long> admitted{0}, full{0};
  const keel::time_point now{};
  std::vector<std::thread> workers;
  for (int w = 0; w < threads; ++w) {
    workers.emplace_back([&, w] {
      std::uint64_t x = 0x9e3779b97f4a7c15ull * static_cast<std::uint64_t>(w + 1);
      for (int i = 0; i < ops; ++i) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        const int k = static_cast<int>(x % names);
        const std::string name = "tenant-" + std::to_string(k);
        keel::admission::refusal_reason why;
        keel::admission_ticket t = quotas.try_admit({.tenant = name}, now, why);
        if (!t) {
          if (why.limit == keel::quota_limit::table_full) full.fetch_add(1);
          continue;
        }
        admitted.fetch_add(1);
        if (holders[k].fetch_add(1) != 0) over.fetch_add(1);
        holders[k].fetch_sub(1);
      }
    });
  }
  for (std::thread& t : workers) t.join();
  CHECK(over.load() == 0);
  CHECK(admitted.load() > 0);
  CHECK(quotas.keys_reclaimed() > 0);
  CHECK(quotas.tenant_keys() <= 8);
  for (int k = 0; k < names; ++k) {
    if (auto u = quotas.tenant_figures("tenant-" + std::to_string(k), now)) CHECK(u->in_flight == 0);
  }
  INFO("admitted " << admitted.load() << ", table_full " << full.load() << ", reclaimed " << quotas.keys_reclaimed());
  CHECK(quotas.table_full_refusals() == full.load());
}

TEST_CASE("configured overrides are never reclaimed; a level without default limits keeps no keys",
          "[admission][keys]") {
  manual_clock clock;
  keel::admission quotas({.tenant_defaults = {.max_in_flight = 1},
                          .tenants = {{"vip", {.max_in_flight = 2}}},
                          .models = {{"m-large", {.max_in_flight = 1}}},
                          .max_keys = 1});
  for (int i = 0; i < 5; ++i) REQUIRE(quotas.admit({.tenant = "t" + std::to_string(i), .model = "m" + std::to_string(i)},
                                                   clock.now()).ok());
  CHECK(quotas.tenant_figures("vip", clock.now()).has_value());
  CHECK(quotas.model_figures("m-large", clock.now()).has_value());
  CHECK(quotas.model_keys() == 0);  // models other than m-large have no limit: nothing to keep
  CHECK(quotas.tenant_keys() == 1);
  CHECK(quotas.keys_reclaimed() == 4);
}

TEST_CASE("a table_full refusal is reported to the listener like any refusal, with its own limit",
          "[admission][keys][pipeline]") {
  manual_clock clock;
  keel::admission quotas({.tenant_defaults = {.max_in_flight = 1}, .max_keys = 1});
  absl::StatusOr<keel::admission_ticket> held = quotas.admit({.tenant = "first"}, clock.now());
  REQUIRE(held.ok());
  struct refusals {
    std::vector<std::string>* seen;
    void operator()(const keel::events::admission_refused& e) const {
      seen->push_back(std::string(e.level) + ":" + std::string(e.key) + ":" + std::string(keel::to_string(e.limit)));
    }
  };
  std::vector<std::string> seen;
  auto pipe = keel::pipeline(quotas).in(keel::environment{clock}.with_listener(refusals{&seen}));
  int ran = 0;
  keel::call c(clock.now(), {.labels = {.tenant = "second"}});
  const absl::StatusOr<int> r = pipe.run(c, [&](const keel::attempt&) -> absl::StatusOr<int> { return ++ran; });
  CHECK(refused_by(r.status()) == "tenant:second:table_full");
  CHECK(ran == 0);
  CHECK(seen == std::vector<std::string>{"tenant:second:table_full"});
}

TEST_CASE("as a policy: refusal before the work, compute reconciled with what attempts charged",
          "[admission][pipeline]") {
  manual_clock clock;
  keel::admission quotas({.tenant_defaults = {.rate = 10, .burst = 2, .compute_budget = 10'000}});
  struct refusals {
    std::vector<std::string>* seen;
    void operator()(const keel::events::admission_refused& e) const {
      seen->push_back(std::string(e.level) + ":" + std::string(e.key) + ":" + std::string(keel::to_string(e.limit)));
    }
  };
  std::vector<std::string> seen;
  auto pipe = keel::pipeline(quotas.with_estimate([](const keel::call&) { return 2000; }))
                  .in(keel::environment{clock}.with_listener(refusals{&seen}));
  int ran = 0;
  auto provider = [&](const keel::attempt& a) -> absl::StatusOr<int> {
    ++ran;
    a.charge(500);  // tokens actually used
    return 1;
  };
  const keel::labels acme{.tenant = "acme", .model = "m"};
  for (int i = 0; i < 2; ++i) {
    keel::call c(clock.now(), {.labels = acme});
    CHECK(pipe.run(c, provider).ok());
  }
  CHECK(quotas.tenant_figures("acme", clock.now())->compute_available == 9000.0);  // 2 x 500, not 2 x 2000
  keel::call third(clock.now(), {.labels = acme});
  const absl::StatusOr<int> r = pipe.run(third, provider);
  CHECK(refused_by(r.status()) == "tenant:acme:rate");
  CHECK(ran == 2);  // refused before the work
  CHECK(seen == std::vector<std::string>{"tenant:acme:rate"});

  // A call already marked replayed is admitted as a replay.
  keel::admission models({.model_defaults = {.max_in_flight = 1}});
  absl::StatusOr<keel::admission_ticket> busy = models.admit({.model = "m"}, clock.now());
  REQUIRE(busy.ok());
  auto replay_pipe = keel::pipeline(models).in(keel::environment{clock});
  keel::call fresh(clock.now(), {.labels = acme});
  CHECK(refused_by(replay_pipe.run(fresh, provider).status()) == "model:m:in_flight");
  keel::call replayed(clock.now(), {.labels = acme});
  replayed.mark_replayed();
  CHECK(replay_pipe.run(replayed, provider).ok());
}

TEST_CASE("keys resolved ahead: no lookup or pin per request, never reclaimed while held, same limits",
          "[admission][keys]") {
  manual_clock clock;
  keel::admission quotas(
      {.tenant_defaults = {.rate = 100, .max_in_flight = 1}, .model_defaults = {.max_in_flight = 2}, .max_keys = 2});
  absl::StatusOr<keel::admission_key> acme = quotas.tenant_key("acme", clock.now());
  absl::StatusOr<keel::admission_key> m = quotas.model_key("m", clock.now());
  REQUIRE(acme.ok());
  REQUIRE(m.ok());
  CHECK(!acme->unlimited());

  // The handle's quota is the key's quota: the names are not looked at.
  keel::admission::refusal_reason why;
  keel::admission_ticket t =
      quotas.try_admit({.tenant = "ignored", .tenant_key = &*acme, .model_key = &*m}, clock.now(), why);
  REQUIRE(t);
  CHECK(quotas.tenant_figures("acme", clock.now())->in_flight == 1);
  CHECK(quotas.model_figures("m", clock.now())->in_flight == 1);
  CHECK(!quotas.tenant_figures("ignored", clock.now()).has_value());
  // Refusals through a handle name the handle's key.
  CHECK(refused_by(quotas.admit({.tenant_key = &*acme}, clock.now()).status()) == "tenant:acme:in_flight");
  t = keel::admission_ticket();
  CHECK(quotas.model_figures("m", clock.now())->in_flight == 0);

  // Held by its handle, the key is never reclaimed, however idle: the
  // table's other slot is all new tenants get.
  clock.advance(10s);
  REQUIRE(quotas.admit({.tenant = "b"}, clock.now()).ok());
  clock.advance(10s);
  REQUIRE(quotas.admit({.tenant = "c"}, clock.now()).ok());  // b reclaimed, not acme
  CHECK(quotas.tenant_figures("acme", clock.now()).has_value());
  CHECK(!quotas.tenant_figures("b", clock.now()).has_value());
  // Dropped, it is reclaimable like any other.
  *acme = keel::admission_key();
  clock.advance(10s);
  REQUIRE(quotas.admit({.tenant = "d"}, clock.now()).ok());
  absl::StatusOr<keel::admission_ticket> e = quotas.admit({.tenant = "e"}, clock.now());  // held
  REQUIRE(e.ok());
  CHECK(!quotas.tenant_figures("acme", clock.now()).has_value());

  // A key of the other level (or another admission) is not used: the name is.
  keel::admission_ticket by_name = quotas.try_admit({.tenant = "e", .tenant_key = &*m}, clock.now(), why);
  CHECK(!by_name);
  CHECK(refused_by(keel::admission::refusal(why)) == "tenant:e:in_flight");

  // A table full of keys in use refuses a new handle, saying when to come back.
  keel::admission tight({.tenant_defaults = {.max_in_flight = 1}, .max_keys = 1});
  absl::StatusOr<keel::admission_key> first = tight.tenant_key("first", clock.now());
  REQUIRE(first.ok());
  const absl::StatusOr<keel::admission_key> second = tight.tenant_key("second", clock.now());
  CHECK(refused_by(second.status()) == "tenant:second:table_full");
  CHECK(keel::retry_after(second.status()).has_value());
}

TEST_CASE("a call site's model and a session's tenant, resolved ahead, through the pipeline", "[admission][pipeline]") {
  manual_clock clock;
  keel::admission quotas({.tenant_defaults = {.rate = 100, .max_in_flight = 1, .compute_budget = 10'000},
                          .model_defaults = {.max_in_flight = 4}});
  struct session {
    const keel::admission_key* tenant;
    std::int64_t tokens;
  };
  const keel::admission_key model = *quotas.model_key("m-large", clock.now());
  const keel::admission_key acme = *quotas.tenant_key("acme", clock.now());
  auto pipe =
      keel::pipeline(quotas.for_model(model)
                         .with_tenant_key(keel::from_request<session>([](const session& s) { return s.tenant; },
                                                                      static_cast<const keel::admission_key*>(nullptr)))
                         .with_estimate(keel::from_request<session>([](const session& s) { return s.tokens; },
                                                                    std::int64_t{0})))
          .in(keel::environment{clock});
  const session rq{.tenant = &acme, .tokens = 3000};
  keel::call c(clock.now(), {.labels = {.tenant = "someone-else", .model = "other"}}, rq);
  int inside = 0;
  auto provider = [&](const keel::attempt& a) -> absl::StatusOr<int> {
    // While the attempt runs, the handles' quotas hold its slots and estimate.
    inside = quotas.tenant_figures("acme", clock.now())->in_flight + quotas.model_figures("m-large", clock.now())->in_flight;
    if (a.owner->request<session>() != nullptr) {
      CHECK(quotas.tenant_figures("acme", clock.now())->compute_available == 7000.0);
    }
    a.charge(1000);
    return 1;
  };
  REQUIRE(pipe.run(c, provider).ok());
  CHECK(inside == 2);
  CHECK(quotas.tenant_figures("acme", clock.now())->compute_available == 9000.0);  // settled to what was charged
  CHECK(!quotas.tenant_figures("someone-else", clock.now()).has_value());
  CHECK(!quotas.model_figures("other", clock.now()).has_value());

  // A call without the request type falls back to the tenant label.
  keel::call plain(clock.now(), {.labels = {.tenant = "beta"}});
  REQUIRE(pipe.run(plain, provider).ok());
  CHECK(quotas.tenant_figures("beta", clock.now()).has_value());
}

TEST_CASE("a level further in that refuses before any work rolls admission back, rate tokens included",
          "[admission][pipeline]") {
  manual_clock clock;
  keel::admission quotas({.tenant_defaults = {.rate = 2, .burst = 2, .max_in_flight = 4, .compute_budget = 1000},
                          .model_defaults = {.rate = 5, .burst = 5, .max_in_flight = 4}});
  const keel::labels acme{.tenant = "acme", .model = "m"};
  auto tenant = [&] { return *quotas.tenant_figures("acme", clock.now()); };
  auto model = [&] { return *quotas.model_figures("m", clock.now()); };
  int ran = 0;
  auto provider = [&](const keel::attempt& a) -> absl::Status {
    ++ran;
    a.charge(100);
    return absl::UnavailableError("the model is down");
  };

  // An open breaker inside admission refuses five calls, more than the
  // tenant's burst: none of them keeps a token, a slot or compute.
  keel::circuit_breaker breaker({.name = "llm"});
  breaker.force_open(clock.now());
  auto guarded = keel::pipeline(quotas.with_estimate([](const keel::call&) { return 300; }), breaker).in(keel::environment{clock});
  for (int i = 0; i < 5; ++i) {
    keel::call c(clock.now(), {.labels = acme});
    const absl::Status s = guarded.run(c, provider);
    CHECK(refused_by(s) == "breaker:llm");  // never "tenant:acme:rate"
    CHECK(keel::not_started(s));
  }
  CHECK(tenant().rate_available == 2.0);
  CHECK(tenant().in_flight == 0);
  CHECK(tenant().compute_available == 1000.0);
  CHECK(model().rate_available == 5.0);
  CHECK(model().in_flight == 0);

  // A full bulkhead inside admission: the same.
  keel::bulkhead pools({.classes = {{.name = "only", .capacity = 1}}});
  keel::bulkhead_permit held = pools.try_acquire(0);
  REQUIRE(held);
  auto pooled = keel::pipeline(quotas, pools.for_class("only")).in(keel::environment{clock});
  for (int i = 0; i < 3; ++i) {
    keel::call c(clock.now(), {.labels = acme});
    CHECK(refused_by(pooled.run(c, provider)) == "bulkhead:only");
  }
  CHECK(tenant().rate_available == 2.0);
  CHECK(model().rate_available == 5.0);
  CHECK(ran == 0);

  // Work that ran keeps its token, even when a later attempt of the same
  // call is refused: the breaker opens on attempt 1's failure and refuses
  // attempt 2, so the call ends not started, but attempt 1 reached the model.
  keel::circuit_breaker tripping({.name = "dep", .window_calls = 10, .minimum_calls = 1});
  auto retried =
      keel::pipeline(quotas, keel::retry({.max_attempts = 2}, keel::constant_backoff{.delay_each = keel::duration::zero()}),
                     tripping)
          .in(keel::environment{clock});
  keel::call c(clock.now(), {.labels = acme});
  const absl::Status s = retried.run(c, provider);
  CHECK(refused_by(s) == "breaker:dep");
  CHECK(keel::not_started(s));
  CHECK(c.record().attempts == 1);
  CHECK(ran == 1);
  CHECK(tenant().rate_available == 1.0);
  CHECK(model().rate_available == 4.0);
  CHECK(tenant().in_flight == 0);

  // Standalone: roll_back() after admit() undoes the whole admission.
  absl::StatusOr<keel::admission_ticket> t = quotas.admit({.tenant = "acme", .model = "m", .estimate = 400}, clock.now());
  REQUIRE(t.ok());
  CHECK(tenant().compute_available == 600.0);
  t->roll_back();
  CHECK(!*t);
  CHECK(tenant().rate_available == 1.0);
  CHECK(tenant().in_flight == 0);
  CHECK(tenant().compute_available == 1000.0);
  CHECK(model().rate_available == 4.0);
  CHECK(model().in_flight == 0);
  t->roll_back();  // once
  CHECK(tenant().rate_available == 1.0);
}

TEST_CASE("invalid quota options are refused with the field named", "[admission][options]") {
  auto message = [](keel::admission_options o) { return std::string(o.validate().message()); };
  CHECK(message({.tenant_defaults = {.rate = 0}}) == "admission_options.tenant_defaults.rate must be in (0, 1e9] (got 0)");
  CHECK(message({.tenant_defaults = {.burst = 3}}) ==
        "admission_options.tenant_defaults.burst must come with a rate (got 3)");
  CHECK(message({.model_defaults = {.max_in_flight = 0}}) ==
        "admission_options.model_defaults.max_in_flight must be >= 1 (got 0)");
  CHECK(message({.model_defaults = {.max_queued = -2}}) ==
        "admission_options.model_defaults.max_queued must be >= 1 (got -2)");
  CHECK(message({.tenant_defaults = {.compute_budget = -100}}) ==
        "admission_options.tenant_defaults.compute_budget must be >= 1 (got -100)");
  CHECK(message({.tenant_defaults = {.compute_budget = 10, .compute_window = keel::duration::zero()}}) ==
        "admission_options.tenant_defaults.compute_window must be in (0, 1e8 s] (got 0s)");
  CHECK(message({.tenants = {{"acme", {.max_in_flight = 0}}}}) ==
        "admission_options.tenants[acme].max_in_flight must be >= 1 (got 0)");
  CHECK(message({.tenants = {{"a", {}}, {"a", {}}}}) == "admission_options.tenants[1] must name its key once (got a)");
  CHECK(message({.max_keys = 0}) == "admission_options.max_keys must be in [1, 1048576] (got 0)");
  CHECK(message({.busy_retry_after = -1ms}) == "admission_options.busy_retry_after must be > 0 (got -1ms)");
  CHECK_THROWS_AS(keel::admission({.tenant_defaults = {.rate = -1}}), keel::invalid_options);
}
