// Permits and reservations are never leaked or over-granted, whatever
// happens to the call: 1,000,000 randomized operations on a bulkhead (with
// lending) and on multi-level quotas — immediate and waiting acquires,
// cancellation and deadlines while queued, exceptions inside the protected
// work and work that really outlives its stage's time limit, queued work
// started or dropped, compute reconciled (below, at or above the estimate,
// into debt) or cancelled — checked at every step against independent shadow
// counts and the components' own figures, and at the end for every counter
// back at zero and every token and unit accounted for. Plus: the full
// protection pipeline allocates nothing per call.
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <random>
#include <stdexcept>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

#include "keel/compose/pipeline.hpp"
#include "keel/core/call.hpp"
#include "keel/policy/adaptive_timeout.hpp"
#include "keel/policy/admission.hpp"
#include "keel/policy/bulkhead.hpp"
#include "keel/policy/circuit_breaker.hpp"
#include "keel/policy/retry.hpp"
#include "keel/policy/retry_budget.hpp"
#include "keel/policy/time_limit.hpp"
#include "support/alloc_counter.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;

// The g++ build runs the full million; sanitizer builds a tenth of it.
#ifndef KEEL_PROTECTION_STRESS_OPS
#define KEEL_PROTECTION_STRESS_OPS 1000000
#endif

namespace {

// A count that remembers its highest value.
struct shadow {
  std::atomic<int> now{0};
  std::atomic<int> peak{0};
  void enter() noexcept {
    const int n = now.fetch_add(1) + 1;
    int p = peak.load();
    while (n > p && !peak.compare_exchange_weak(p, n)) {
    }
  }
  void leave() noexcept { now.fetch_sub(1); }
};

// Counts an object as held between its construction and destruction. Declare
// it after the permit it shadows so it is destroyed first.
struct holding {
  shadow* a;
  shadow* b;
  holding(shadow* x, shadow* y = nullptr) : a(x), b(y) {
    if (a) a->enter();
    if (b) b->enter();
  }
  ~holding() {
    if (a) a->leave();
    if (b) b->leave();
  }
  holding(const holding&) = delete;
  holding& operator=(const holding&) = delete;
};

struct injected_failure : std::runtime_error {
  injected_failure() : std::runtime_error("injected") {}
};

constexpr int kThreads = 4;
constexpr std::size_t kClasses = 3;
constexpr int kTenants = 3;
constexpr int kModels = 2;
const std::array<std::string, kTenants> tenant_names{"t0", "t1", "tight"};
const std::array<std::string, kModels> model_names{"m0", "m1"};

}  // namespace

TEST_CASE("1,000,000 randomized acquire/cancel/timeout/throw operations leak nothing and never over-grant",
          "[protection][stress][concurrency]") {
  // Bulkhead: "a" lends one slot beyond its guarantee to "b"; "c" stands alone.
  keel::bulkhead pools({.classes = {{.name = "a", .capacity = 4, .guaranteed = 3, .max_queue = 3, .max_queue_age = 200us},
                                    {.name = "b", .capacity = 2, .max_queue = 2, .max_queue_age = 100us},
                                    {.name = "c", .capacity = 1, .max_queue = 2, .max_queue_age = 300us}},
                        .lending = {{.lender = "a", .borrower = "b", .max_slots = 1}}});
  const std::array<int, kClasses> capacity{4, 2, 1};
  const std::array<int, kClasses> max_queue{3, 2, 2};

  // Quotas at a frozen time (no refill), so every token and unit can be
  // accounted for exactly at the end. The tight tenant's budget is below
  // what its slots could reserve at once (3 tickets x up to 1000 units), so
  // only admission's compute check keeps it from over-reserving.
  constexpr double kBurst = 1e8;
  constexpr std::int64_t kBudget = 100'000'000, kTightBudget = 2000;
  keel::admission quotas(
      {.tenant_defaults = {.rate = 10, .burst = kBurst, .max_in_flight = 3, .max_queued = 2,
                           .compute_budget = kBudget, .compute_window = 10'000'000s},
       .model_defaults = {.max_in_flight = 2},  // below the tenants' sum: model refusals roll tenant slots back
       .tenants = {{"tight", {.rate = 10, .burst = kBurst, .max_in_flight = 2, .max_queued = 1,
                              .compute_budget = kTightBudget, .compute_window = 10'000'000s}}}});
  const std::array<int, kTenants> tenant_in_flight{3, 3, 2}, tenant_queued{2, 2, 1};
  const keel::time_point frozen = keel::real_clock{}.now();

  // Independent shadows: held permits per class, slots per owning class,
  // borrowed slots, tickets per tenant/model.
  std::array<shadow, kClasses> class_held, slot_held;
  shadow borrowed;
  std::array<shadow, kTenants> tenant_running, tenant_waiting;
  std::array<shadow, kModels> model_running;
  std::atomic<std::int64_t> rate_spent{0};       // requests that kept their token
  // Compute per tenant: units kept (actual costs reconciled, estimates of
  // work that blew up), and the debt allowed: what reconciles charged above
  // their estimates. Admission reserves only what the bucket holds, so a
  // bucket can go below zero only by that much. Each shadow is raised
  // before the operation it shadows, so a reader never sees it lag.
  std::array<std::atomic<std::int64_t>, kTenants> compute_kept{}, debt_allowed{};
  std::atomic<std::int64_t> violations{0};
  std::mutex first_violation_mu;
  std::string first_violation;
  auto violated = [&](std::string what) {
    if (violations.fetch_add(1) == 0) {
      std::lock_guard lock(first_violation_mu);
      first_violation = std::move(what);
    }
  };
  std::atomic<std::int64_t> counts[10] = {};  // what happened, to show the mix was exercised
  enum {
    granted_now, granted_waited, refused_full, refused_deadline, refused_cancel, thrown, admitted, admit_refused,
    timed_out, charged_over,
  };

  // Cancellation from another thread while a worker waits in a queue.
  std::mutex cancel_mu;
  std::array<std::stop_source, kThreads> cancellable;
  std::atomic<bool> done{false};
  std::jthread canceller([&] {
    std::minstd_rand rng(7);
    while (!done.load()) {
      std::stop_source victim(std::nostopstate);
      {
        std::lock_guard lock(cancel_mu);
        victim = cancellable[rng() % kThreads];
      }
      if (victim.stop_possible()) victim.request_stop();
      std::this_thread::sleep_for(20us);
    }
  });

  auto check_figures = [&](std::size_t c) {
    const keel::bulkhead_figures f = pools.figures(c);
    const int own = f.active - f.borrowed;
    if (own + f.lent > capacity[c]) violated("class " + std::to_string(c) + " slots over capacity");
    if (f.queued > max_queue[c]) violated("class " + std::to_string(c) + " queue over its bound");
    if (f.borrowed > (c == 1 ? 1 : 0)) violated("borrowed beyond the lending rule");
    if (own < 0 || f.queued < 0 || f.lent < 0) violated("negative figure");
  };

  constexpr int kOps = KEEL_PROTECTION_STRESS_OPS;
  {
    std::vector<std::jthread> workers;
    for (int w = 0; w < kThreads; ++w) {
      workers.emplace_back([&, w] {
        std::minstd_rand rng(static_cast<unsigned>(1000 + w));
        auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<unsigned>(n)); };
        const keel::real_clock clock;
        for (int op = 0; op < kOps / kThreads; ++op) {
          const int kind = pick(100);
          const auto cls = static_cast<std::size_t>(pick(kClasses));
          try {
            if (kind < 40) {
              // Immediate acquire; maybe throw while holding it.
              keel::bulkhead_permit p = pools.try_acquire(cls);
              if (!p) {
                counts[refused_full].fetch_add(1);
                continue;
              }
              counts[granted_now].fetch_add(1);
              const holding h(&class_held[cls], &slot_held[p.slot_owner()]);
              const holding hb(p.borrowed() ? &borrowed : nullptr);
              check_figures(cls);
              if (pick(10) == 0) throw injected_failure();
            } else if (kind < 50) {
              // Waiting acquire, bounded by a short deadline, perhaps cancelled.
              std::stop_token stop;
              const bool cancel = pick(2) == 0;
              if (cancel) {
                std::lock_guard lock(cancel_mu);
                cancellable[w] = std::stop_source();
                stop = cancellable[w].get_token();
              }
              const keel::time_point now = clock.now();
              absl::StatusOr<keel::bulkhead_permit> p =
                  pools.acquire(cls, clock, now, keel::deadline::after(now, std::chrono::microseconds(pick(300))), stop);
              if (cancel) {
                std::lock_guard lock(cancel_mu);
                cancellable[w] = std::stop_source(std::nostopstate);
              }
              if (!p.ok()) {
                const absl::StatusCode code = p.status().code();
                counts[code == absl::StatusCode::kCancelled           ? refused_cancel
                       : code == absl::StatusCode::kDeadlineExceeded ? refused_deadline
                                                                     : refused_full]
                    .fetch_add(1);
                if (!keel::not_started(p.status())) violated("a bulkhead refusal not marked not-started");
                continue;
              }
              counts[p->waited() ? granted_waited : granted_now].fetch_add(1);
              const holding h(&class_held[cls], &slot_held[p->slot_owner()]);
              const holding hb(p->borrowed() ? &borrowed : nullptr);
              check_figures(cls);
              if (pick(4) == 0) throw injected_failure();
            } else if (kind < 85) {
              // Multi-level admission: fresh, queued then started, or replay.
              const int t = pick(kTenants);
              const int m = pick(kModels);
              const int mode = pick(10);
              const bool replay = mode == 0;
              const bool queued = mode >= 7;
              const std::int64_t estimate = pick(3) == 0 ? 0 : 1 + pick(1000);
              keel::admission::refusal_reason why;
              keel::admission_ticket ticket = quotas.try_admit(
                  {.tenant = tenant_names[t], .model = model_names[m], .estimate = estimate,
                   .kind = replay ? keel::request_kind::replay : keel::request_kind::fresh, .queued = queued},
                  frozen, why);
              if (!ticket) {
                counts[admit_refused].fetch_add(1);
                continue;
              }
              counts[admitted].fetch_add(1);
              rate_spent.fetch_add(1);
              if (replay) continue;  // holds nothing but the token
              bool started = !queued;
              // A shadow leaves before the slot it shadows is given back.
              if (queued) {
                std::optional<holding> waiting;
                waiting.emplace(&tenant_waiting[t]);
                if (pick(3) == 0) {
                  waiting.reset();
                  ticket.cancel();  // dropped before it started
                  continue;
                }
                if (pick(8) == 0) {
                  waiting.reset();
                  throw injected_failure();  // destroyed while queued
                }
                waiting.reset();
                started = ticket.start().ok();
              }
              if (!started) continue;  // stays queued until the ticket dies
              std::optional<holding> running;
              running.emplace(&tenant_running[t], &model_running[m]);
              const int outcome = pick(4);
              if (outcome == 0 && t != 2) {
                compute_kept[t].fetch_add(estimate);  // work blew up before reconciling: estimate kept
                throw injected_failure();
              }
              if (outcome == 1) {
                running.reset();
                ticket.cancel();  // work abandoned: estimate refunded
              } else {
                // The actual cost: the tight tenant's work usually costs
                // nothing, the others' a part of the estimate; one in ten
                // reconciles costs more than estimated and is charged the
                // excess. The tight tenant's only in the second half of the
                // run, and by more than its whole budget: its bucket goes
                // into debt and, with no refill, stays there, refusing every
                // further reservation.
                std::int64_t actual = 0;
                const bool over = estimate > 0 && pick(10) == 0 && (t != 2 || op >= kOps / kThreads / 2);
                if (over) {
                  actual = estimate + 1 + pick(500) + (t == 2 ? kTightBudget : 0);
                  debt_allowed[t].fetch_add(actual - estimate);
                  counts[charged_over].fetch_add(1);
                } else if (t != 2 && pick(10) == 0) {
                  actual = pick(static_cast<int>(estimate) + 1);
                }
                compute_kept[t].fetch_add(actual);
                ticket.reconcile(actual, frozen);
              }
            } else {
              // The whole thing through a pipeline: admission, bulkhead, a
              // stage time limit; the work succeeds, throws, or (one in ten)
              // outlives the attempt deadline the time limit gave it,
              // holding its permit and slots all the while.
              const int t = pick(kTenants);
              const int m = pick(kModels);
              constexpr keel::duration kStage = 20us;
              auto pipe = keel::pipeline(quotas, pools.for_class(cls == 0 ? "a" : cls == 1 ? "b" : "c"),
                                         keel::time_limit({.at_most = kStage}));
              keel::call call(clock.now(), {.timeout = 2ms,
                                            .labels = {.tenant = tenant_names[t], .model = model_names[m]},
                                            .max_attempts = 1});
              const int behaviour = pick(10);
              const bool times_out = behaviour == 1;
              bool ran = false;
              const absl::Status s = pipe.run(call, [&](const keel::attempt& a) -> absl::Status {
                ran = true;
                const holding h(&class_held[cls]);
                const holding running(&tenant_running[t], &model_running[m]);
                check_figures(cls);
                if (a.timeout > kStage) violated("the stage's time limit did not bound the attempt");
                if (behaviour == 0) throw injected_failure();
                if (times_out) {
                  // The model does not answer: the work runs on past the
                  // attempt's deadline on the real clock (busy, like work
                  // that computes: a sleep or a yield this short would cost
                  // the timer slack or a trip through the scheduler), then
                  // gives up as a client does.
                  while (!a.deadline.expired(clock.now())) {
                  }
                  return absl::DeadlineExceededError("the model did not answer in time");
                }
                return absl::OkStatus();
              });
              if (times_out && ran) {
                counts[timed_out].fetch_add(1);
                if (s.code() != absl::StatusCode::kDeadlineExceeded || keel::not_started(s))
                  violated("a timeout inside the work did not come back as one");
              }
              if (s.code() == absl::StatusCode::kResourceExhausted && keel::refused_by(s) &&
                  keel::refused_by(s)->rfind("bulkhead", 0) != 0) {
                counts[admit_refused].fetch_add(1);
              } else {
                counts[admitted].fetch_add(1);
              }
              // Only a pass whose work ran keeps its token: one refused
              // before any work (admission, the bulkhead, no time left)
              // leaves every level as it was.
              if (ran) rate_spent.fetch_add(1);
            }
          } catch (const injected_failure&) {
            counts[thrown].fetch_add(1);
          }
          // Shadow bounds, at every step.
          for (std::size_t c = 0; c < kClasses; ++c) {
            if (slot_held[c].now.load() > capacity[c]) violated("slots held over capacity");
          }
          for (int t = 0; t < kTenants; ++t) {
            if (tenant_running[t].now.load() > tenant_in_flight[t]) violated("tenant in flight over its limit");
            if (tenant_waiting[t].now.load() > tenant_queued[t]) violated("tenant queued over its limit");
            const std::optional<keel::quota_figures> seen = quotas.tenant_figures(tenant_names[t], frozen);
            if (!seen) continue;  // no request for this tenant yet
            const keel::quota_figures& u = *seen;
            if (u.in_flight > tenant_in_flight[t] || u.queued > tenant_queued[t] || u.in_flight < 0 || u.queued < 0)
              violated("tenant usage out of bounds");
            // Read after the usage: it can only have grown since.
            if (u.compute_available < -static_cast<double>(debt_allowed[t].load()))
              violated("compute over-reserved: below zero by more than the excess charged");
          }
          for (int m = 0; m < kModels; ++m) {
            if (model_running[m].now.load() > 2) violated("model in flight over its limit");
          }
        }
      });
    }
  }
  done.store(true);
  canceller.join();

  INFO("first violation: " << first_violation);
  CHECK(violations.load() == 0);
  // The mix really happened.
  for (auto* c : {&counts[granted_now], &counts[granted_waited], &counts[refused_full], &counts[refused_deadline],
                  &counts[refused_cancel], &counts[thrown], &counts[admitted], &counts[admit_refused],
                  &counts[timed_out], &counts[charged_over]}) {
    CHECK(c->load() > 0);
  }
  // Peaks from the independent shadows never passed a limit.
  for (std::size_t c = 0; c < kClasses; ++c) {
    CHECK(slot_held[c].peak.load() <= capacity[c]);
    CHECK(class_held[c].peak.load() <= capacity[c] + (c == 1 ? 1 : 0));
  }
  CHECK(borrowed.peak.load() <= 1);
  for (int t = 0; t < kTenants; ++t) {
    CHECK(tenant_running[t].peak.load() <= tenant_in_flight[t]);
    CHECK(tenant_waiting[t].peak.load() <= tenant_queued[t]);
  }
  // Every counter back at zero.
  for (std::size_t c = 0; c < kClasses; ++c) {
    const keel::bulkhead_figures f = pools.figures(c);
    INFO("class " << c);
    CHECK(f.active == 0);
    CHECK(f.queued == 0);
    CHECK(f.lent == 0);
    CHECK(f.borrowed == 0);
    CHECK(f.admitted == f.completed);
  }
  CHECK(pools.on_loan(0, 1) == 0);
  for (int t = 0; t < kTenants; ++t) REQUIRE(quotas.tenant_figures(tenant_names[t], frozen).has_value());
  for (int m = 0; m < kModels; ++m) REQUIRE(quotas.model_figures(model_names[m], frozen).has_value());
  // Compute: each tenant's bucket holds exactly its budget minus what it
  // kept (actual costs reconciled, excess charges included, plus the
  // estimates of work that blew up before reconciling); everything else
  // came back. The tight tenant ends in debt: it was charged more than it had.
  for (int t = 0; t < kTenants; ++t) {
    const keel::quota_figures u = *quotas.tenant_figures(tenant_names[t], frozen);
    INFO("tenant " << tenant_names[t]);
    CHECK(u.in_flight == 0);
    CHECK(u.queued == 0);
    const std::int64_t budget = t == 2 ? kTightBudget : kBudget;
    CHECK(u.compute_available == static_cast<double>(budget - compute_kept[t].load()));
    CHECK(u.compute_available >= -static_cast<double>(debt_allowed[t].load()));
  }
  CHECK(debt_allowed[2].load() > 0);
  CHECK(quotas.tenant_figures("tight", frozen)->compute_available < 0);
  for (int m = 0; m < kModels; ++m) {
    CHECK(model_running[m].peak.load() <= 2);
    CHECK(quotas.model_figures(model_names[m], frozen)->in_flight == 0);
  }
  // Tokens: exactly one per request admitted whose work ran (or that was
  // admitted directly), none kept by refused ones.
  double tokens_left = 0;
  for (int t = 0; t < kTenants; ++t) tokens_left += kBurst - quotas.tenant_figures(tenant_names[t], frozen)->rate_available;
  CHECK(static_cast<std::int64_t>(tokens_left) == rate_spent.load());
}

TEST_CASE("the full protection pipeline allocates nothing per call", "[protection][alloc]") {
  if (!keel_test::allocations_counted()) {
    WARN("allocation counting is off in sanitizer builds; the g++ build asserts it");
    return;
  }
  keel::admission quotas({.tenant_defaults = {.rate = 1e9, .burst = 1e9, .max_in_flight = 64}});
  keel::bulkhead pools({.classes = {{.name = "interactive", .capacity = 24}, {.name = "batch", .capacity = 8}}});
  keel::circuit_breaker breaker({.name = "llm"});
  keel::retry_budget budget({.ratio = 0.1});
  keel::adaptive_timeout timeouts;
  auto pipe = keel::pipeline(keel::time_limit({.at_most = 2s}), quotas, pools, breaker,
                             keel::retry({.max_attempts = 3, .budget = &budget}), timeouts);
  auto provider = [](const keel::attempt& a) -> absl::StatusOr<int> { return a.number; };
  const keel::labels labels{.tenant = "acme", .model = "m", .work_class = "interactive"};
  {
    keel::call warm(keel::real_clock{}.now(), {.timeout = 3s, .labels = labels});
    REQUIRE(pipe.run(warm, provider).ok());  // first sight of the tenant makes its quota
  }
  keel_test::count_allocations allocations;
  for (int i = 0; i < 1000; ++i) {
    keel::call call(keel::real_clock{}.now(), {.timeout = 3s, .response_reserve = 200ms, .labels = labels});
    absl::StatusOr<int> r = pipe.run(call, provider);
    if (!r.ok()) FAIL("pipeline failed: " << r.status());
  }
  CHECK(allocations.count() == 0);
  CHECK(breaker.figures(keel::real_clock{}.now()).calls == 100);  // the window is full of successes
  CHECK(pools.figures(0).completed == 1001);
}
