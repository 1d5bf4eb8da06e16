// keel::bulkhead: class isolation, bounded queues by length and age, the
// caller's deadline and stop token, lending that keeps the lender's
// guarantee, permits released exactly once on every path, and the seed's
// batch flood beside interactive traffic.
#include "keel/policy/bulkhead.hpp"

#include <atomic>
#include <chrono>
#include <latch>
#include <optional>
#include <stdexcept>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

#include "keel/compose/pipeline.hpp"
#include "keel/core/call.hpp"
#include "keel/policy/time_limit.hpp"
#include "keel/testing/manual_clock.hpp"
#include "keel/testing/scripted_provider.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;
using keel::testing::manual_clock;
namespace kt = keel::testing;

namespace {

// The seed's split: 40 local slots as interactive 24, batch 8, recovery 8.
keel::bulkhead_options seed_pools() {
  return {.classes = {{.name = "interactive", .capacity = 24, .max_queue = 24, .max_queue_age = 200ms},
                      {.name = "batch", .capacity = 8, .max_queue = 16, .max_queue_age = 2s},
                      {.name = "recovery", .capacity = 8, .max_queue = 4}}};
}

// A thread waiting for a slot on the manual clock; its result arrives after join.
struct waiter {
  std::optional<absl::StatusOr<keel::bulkhead_permit>> result;
  std::jthread thread;

  waiter(keel::bulkhead& b, std::size_t cls, const manual_clock& clock, keel::deadline until = {},
         std::stop_token stop = {})
      : thread([this, &b, cls, clock, until, stop] { result.emplace(b.acquire(cls, clock, clock.now(), until, stop)); }) {}
};

}  // namespace

TEST_CASE("each class has its own slots; try_acquire never waits", "[bulkhead]") {
  keel::bulkhead b(seed_pools());
  const std::size_t batch = *b.class_index("batch");
  const std::size_t interactive = *b.class_index("interactive");
  std::vector<keel::bulkhead_permit> held;
  for (int i = 0; i < 8; ++i) {
    held.push_back(b.try_acquire(batch));
    REQUIRE(held.back());
  }
  CHECK(!b.try_acquire(batch));  // batch is full...
  for (int i = 0; i < 24; ++i) {
    held.push_back(b.try_acquire(interactive));
    REQUIRE(held.back());  // ...and interactive still has all 24
  }
  CHECK(!b.try_acquire(interactive));
  CHECK(b.figures(batch).active == 8);
  CHECK(b.figures(interactive).active == 24);
  held.clear();
  CHECK(b.figures(batch).active == 0);
  CHECK(b.figures(batch).completed == 8);
  CHECK(b.figures(interactive).completed == 24);
  CHECK(b.figures(interactive).admitted == 24);
}

TEST_CASE("a permit gives its slot back exactly once: move, release, destruction", "[bulkhead]") {
  keel::bulkhead b({.classes = {{.name = "only", .capacity = 1}}});
  keel::bulkhead_permit p = b.try_acquire(0);
  REQUIRE(p);
  keel::bulkhead_permit q = std::move(p);
  CHECK(!p);  // NOLINT: the moved-from permit holds nothing
  CHECK(b.figures(0).active == 1);
  q.release();
  q.release();  // idempotent
  CHECK(b.figures(0).active == 0);
  CHECK(b.figures(0).completed == 1);
  keel::bulkhead_permit r = b.try_acquire(0);
  REQUIRE(r);
  r = keel::bulkhead_permit();  // assignment releases what it held
  CHECK(b.figures(0).active == 0);
  CHECK(b.figures(0).completed == 2);
}

TEST_CASE("a throwing protected function releases its slot (standalone)", "[bulkhead]") {
  keel::bulkhead b({.classes = {{.name = "only", .capacity = 2}}});
  auto protected_call = [&] {
    keel::bulkhead_permit p = b.try_acquire(0);
    if (!p) return;
    throw std::runtime_error("model client exploded");
  };
  for (int i = 0; i < 10; ++i) CHECK_THROWS_AS(protected_call(), std::runtime_error);
  CHECK(b.figures(0).active == 0);
  CHECK(b.figures(0).completed == 10);
}

TEST_CASE("a full queue refuses at once with a stable overload status", "[bulkhead]") {
  manual_clock clock;
  keel::bulkhead b({.classes = {{.name = "batch", .capacity = 1, .max_queue = 2, .max_queue_age = 1s}}});
  keel::bulkhead_permit holder = b.try_acquire(0);
  waiter a(b, 0, clock);
  clock.await_sleepers(1);
  waiter c(b, 0, clock);
  clock.await_sleepers(2);
  CHECK(b.figures(0).queued == 2);

  const absl::StatusOr<keel::bulkhead_permit> refused = b.acquire(0, clock, clock.now(), {}, {});
  REQUIRE(!refused.ok());
  CHECK(refused.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK(refused.status().message() == "keel: bulkhead class 'batch' is full (1 slots busy, 2 waiting)");
  CHECK(keel::refused_by(refused.status()) == std::optional<std::string>("bulkhead:batch"));
  CHECK(keel::not_started(refused.status()));
  CHECK(keel::retry_after(refused.status()) == std::optional<keel::duration>(1s));
  CHECK(b.figures(0).rejected == 1);

  // The queue is FIFO: the first waiter gets the released slot.
  holder.release();
  a.thread.join();
  REQUIRE(a.result->ok());
  CHECK(a.result->value().waited());
  CHECK(b.figures(0).queued == 1);
  a.result.reset();  // its slot goes to the second waiter
  c.thread.join();
  REQUIRE(c.result->ok());
  CHECK(b.figures(0).queued == 0);
  c.result.reset();
  CHECK(b.figures(0).active == 0);
  CHECK(b.figures(0).completed == 3);
}

TEST_CASE("a queued caller leaves after max_queue_age; the queue-delay figures see the waits", "[bulkhead]") {
  manual_clock clock;
  keel::bulkhead b({.classes = {{.name = "batch", .capacity = 1, .max_queue = 4, .max_queue_age = 100ms}}});
  keel::bulkhead_permit holder = b.try_acquire(0);
  {
    waiter w(b, 0, clock);
    clock.await_sleepers(1);
    clock.advance(99ms);
    clock.await_sleepers(1);  // still waiting
    clock.advance(1ms);
    w.thread.join();
    REQUIRE(!w.result->ok());
    const absl::Status& s = w.result->status();
    CHECK(s.code() == absl::StatusCode::kResourceExhausted);
    CHECK(s.message() == "keel: waited 100ms in the queue of bulkhead class 'batch' without a slot");
    CHECK(keel::not_started(s));
  }
  CHECK(b.figures(0).timed_out == 1);
  CHECK(b.figures(0).queued == 0);
  {
    waiter w(b, 0, clock);
    clock.await_sleepers(1);
    clock.advance(30ms);
    holder.release();
    w.thread.join();
    REQUIRE(w.result->ok());
    CHECK(w.result->value().queue_delay() == 30ms);
  }
  const keel::bulkhead_figures f = b.figures(0);
  CHECK(f.admitted == 2);
  CHECK(f.queue_delay[0] == 1);  // the holder did not wait
  CHECK(f.queue_delay[6] == 1);  // 30 ms falls in (25 ms, 50 ms]
  CHECK(f.queue_delay_quantile(0.0) == keel::duration::zero());
  CHECK(f.queue_delay_quantile(0.99) == 50ms);
}

TEST_CASE("the caller's deadline and stop token bound the wait", "[bulkhead]") {
  manual_clock clock;
  keel::bulkhead b({.classes = {{.name = "c", .capacity = 1, .max_queue = 4, .max_queue_age = 10s}}});
  keel::bulkhead_permit holder = b.try_acquire(0);
  {
    waiter w(b, 0, clock, keel::deadline::after(clock.now(), 250ms));
    clock.await_sleepers(1);
    clock.advance(250ms);
    w.thread.join();
    REQUIRE(!w.result->ok());
    CHECK(w.result->status().code() == absl::StatusCode::kDeadlineExceeded);
    CHECK(keel::not_started(w.result->status()));
    CHECK(keel::refused_by(w.result->status()) == std::optional<std::string>("bulkhead:c"));
    // The caller is told when to come back: the queue's turnover, max_queue_age.
    CHECK(keel::retry_after(w.result->status()) == std::optional<keel::duration>(10s));
    CHECK(w.result->status().message() ==
          "keel: deadline passed while waiting for bulkhead class 'c' (1 slots busy); its queue turns over within "
          "10s: retry after that with a fresh deadline");
  }
  {
    std::stop_source stop;
    waiter w(b, 0, clock, {}, stop.get_token());
    clock.await_sleepers(1);
    CHECK(b.figures(0).queued == 1);
    stop.request_stop();
    w.thread.join();
    REQUIRE(!w.result->ok());
    CHECK(w.result->status().code() == absl::StatusCode::kCancelled);
  }
  // Already out of time or cancelled: refused without queueing.
  CHECK(b.acquire(0, clock, clock.now(), keel::deadline::at(clock.now()), {}).status().code() ==
        absl::StatusCode::kDeadlineExceeded);
  std::stop_source stopped;
  stopped.request_stop();
  CHECK(b.acquire(0, clock, clock.now(), {}, stopped.get_token()).status().code() == absl::StatusCode::kCancelled);
  const keel::bulkhead_figures f = b.figures(0);
  CHECK(f.queued == 0);
  CHECK(f.timed_out == 2);
  CHECK(f.cancelled == 2);
  CHECK(f.active == 1);
  holder.release();
  CHECK(b.figures(0).active == 0);
}

TEST_CASE("as a policy: a slot per pass, released on success, exception and timeout inside the work",
          "[bulkhead][pipeline]") {
  manual_clock clock;
  keel::bulkhead b(seed_pools());
  auto pipe = keel::pipeline(b, keel::time_limit({.at_most = 100ms})).in(keel::environment{clock});
  const std::size_t interactive = *b.class_index("interactive");

  keel::call ok_call(clock.now(), {.labels = {.work_class = "interactive"}});
  CHECK(pipe.run(ok_call, [&](const keel::attempt&) -> absl::StatusOr<int> {
              return b.figures(interactive).active;  // the slot is held while the work runs
            }).value() == 1);

  keel::call throwing(clock.now(), {.labels = {.work_class = "interactive"}});
  CHECK(pipe.run(throwing, [](const keel::attempt&) -> absl::StatusOr<int> { throw std::runtime_error("boom"); })
            .status()
            .code() == absl::StatusCode::kUnknown);

  kt::scripted_provider<int> stalled(clock, {kt::stall()});
  keel::call timing_out(clock.now(), {.labels = {.work_class = "interactive"}});
  CHECK(pipe.run(timing_out, stalled).status().code() == absl::StatusCode::kDeadlineExceeded);

  CHECK(b.figures(interactive).active == 0);
  CHECK(b.figures(interactive).completed == 3);

  keel::call unknown(clock.now(), {.labels = {.work_class = "gold"}});
  const absl::StatusOr<int> r = pipe.run(unknown, [](const keel::attempt&) -> absl::StatusOr<int> { return 1; });
  CHECK(r.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(keel::marked_outcome(r.status()) == keel::outcome_kind::permanent);

  // for_class pins the class whatever the label says.
  auto batch_pipe = keel::pipeline(b.for_class("batch")).in(keel::environment{clock});
  keel::call any(clock.now(), {});
  CHECK(batch_pipe.run(any, [&](const keel::attempt&) -> absl::StatusOr<int> {
                     return b.figures(*b.class_index("batch")).active;
                   }).value() == 1);
  CHECK_THROWS_AS(b.for_class("gold"), keel::invalid_options);
}

TEST_CASE("as a policy: a caller queued past its deadline is refused before the work", "[bulkhead][pipeline]") {
  manual_clock clock;
  keel::bulkhead b({.classes = {{.name = "c", .capacity = 1, .max_queue = 2, .max_queue_age = 10s}},
                    .default_class = "c"});
  struct refusals {
    std::vector<keel::bulkhead_refusal>* seen;
    void operator()(const keel::events::bulkhead_rejected& e) const { seen->push_back(e.why); }
  };
  std::vector<keel::bulkhead_refusal> seen;
  auto pipe = keel::pipeline(b).in(keel::environment{clock}.with_listener(refusals{&seen}));
  keel::bulkhead_permit holder = b.try_acquire(0);
  int ran = 0;
  std::optional<absl::StatusOr<int>> result;
  {
    std::jthread t([&] {
      keel::call call(clock.now(), {.timeout = 300ms});  // unlabelled: the default class
      result.emplace(pipe.run(call, [&](const keel::attempt&) -> absl::StatusOr<int> { return ++ran; }));
    });
    clock.await_sleepers(1);
    clock.advance(300ms);
  }
  CHECK(ran == 0);
  CHECK(result->status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(seen == std::vector<keel::bulkhead_refusal>{keel::bulkhead_refusal::deadline});

  // A waiter that gets its slot runs with the time it has left.
  std::optional<absl::StatusOr<keel::duration>> left;
  {
    std::jthread t([&] {
      keel::call call(clock.now(), {.timeout = 300ms});
      left.emplace(pipe.run(call, [&](const keel::attempt& a) -> absl::StatusOr<keel::duration> { return a.timeout; }));
    });
    clock.await_sleepers(1);
    clock.advance(100ms);
    holder.release();
  }
  REQUIRE(left->ok());
  CHECK(**left == 200ms);
}

TEST_CASE("lending: a borrower uses idle lendable slots; the lender keeps its guarantee", "[bulkhead][lending]") {
  keel::bulkhead b({.classes = {{.name = "interactive", .capacity = 28, .guaranteed = 24},
                                {.name = "batch", .capacity = 8, .max_queue = 4}},
                    .lending = {{.lender = "interactive", .borrower = "batch", .max_slots = 4}}});
  const std::size_t interactive = 0, batch = 1;
  std::vector<keel::bulkhead_permit> batch_held;
  for (int i = 0; i < 12; ++i) {
    batch_held.push_back(b.try_acquire(batch));
    REQUIRE(batch_held.back());
  }
  CHECK(batch_held.back().borrowed());
  CHECK(!b.try_acquire(batch));  // 8 own + 4 borrowed: the rule's limit
  CHECK(b.figures(batch).active == 12);
  CHECK(b.figures(batch).borrowed == 4);
  CHECK(b.figures(interactive).lent == 4);
  CHECK(b.on_loan(interactive, batch) == 4);

  // With all 4 lent out, interactive still gets its guaranteed 24 at once.
  std::vector<keel::bulkhead_permit> interactive_held;
  for (int i = 0; i < 24; ++i) {
    interactive_held.push_back(b.try_acquire(interactive));
    REQUIRE(interactive_held.back());
  }
  CHECK(!b.try_acquire(interactive));  // the other 4 are on loan
  batch_held.pop_back();               // a borrowed slot comes home
  CHECK(b.figures(interactive).lent == 3);
  CHECK(b.try_acquire(interactive));  // ...and interactive may use it (released again at once)
}

TEST_CASE("lending: returned slots go to the lender's waiters first, then to waiting borrowers",
          "[bulkhead][lending]") {
  manual_clock clock;
  keel::bulkhead b({.classes = {{.name = "lender", .capacity = 3, .guaranteed = 1, .max_queue = 2, .max_queue_age = 1h},
                                {.name = "borrower", .capacity = 1, .max_queue = 2, .max_queue_age = 1h}},
                    .lending = {{.lender = "lender", .borrower = "borrower", .max_slots = 2}}});
  const std::size_t lender = 0, borrower = 1;
  keel::bulkhead_permit own = b.try_acquire(borrower);
  keel::bulkhead_permit lent1 = b.try_acquire(borrower);
  keel::bulkhead_permit lent2 = b.try_acquire(borrower);
  REQUIRE((own && lent1 && lent2));
  REQUIRE(lent1.borrowed());
  keel::bulkhead_permit lender_own = b.try_acquire(lender);
  REQUIRE(lender_own);
  CHECK(!b.try_acquire(lender));  // 1 own + 2 lent = 3

  // A lender caller waits; a borrower caller waits too.
  waiter lw(b, lender, clock);
  clock.await_sleepers(1);
  waiter bw(b, borrower, clock);
  clock.await_sleepers(2);
  // A borrowed slot comes back: the lender's waiter gets it, not the borrower's.
  lent1.release();
  lw.thread.join();
  REQUIRE(lw.result->ok());
  CHECK(!lw.result->value().borrowed());
  CHECK(b.figures(lender).lent == 1);
  CHECK(b.figures(borrower).queued == 1);
  // The lender's own slot frees with nobody waiting there: lent to the borrower.
  lender_own.release();
  bw.thread.join();
  REQUIRE(bw.result->ok());
  CHECK(bw.result->value().borrowed());
  CHECK(b.figures(lender).lent == 2);
  lw.result.reset();
  bw.result.reset();
  own.release();
  lent2.release();
  for (std::size_t c : {lender, borrower}) {
    CHECK(b.figures(c).active == 0);
    CHECK(b.figures(c).queued == 0);
  }
  CHECK(b.figures(lender).lent == 0);
}

TEST_CASE("the seed's flood: batch saturates its 8 slots and its queue, interactive still gets 24",
          "[bulkhead][seed]") {
  manual_clock clock;
  keel::bulkhead b(seed_pools());
  const std::size_t interactive = *b.class_index("interactive");
  const std::size_t batch = *b.class_index("batch");
  constexpr int kFlood = 40;  // batch callers, far more than 8 slots + 16 queued
  std::atomic<int> batch_refused{0};
  std::atomic<int> batch_in_slots{0};
  std::atomic<int> batch_max_in_slots{0};
  std::atomic<bool> drain{false};
  std::vector<std::jthread> flood;
  for (int i = 0; i < kFlood; ++i) {
    flood.emplace_back([&] {
      absl::StatusOr<keel::bulkhead_permit> p = b.acquire(batch, clock, clock.now(), {}, {});
      if (!p.ok()) {
        batch_refused.fetch_add(1);
        return;
      }
      const int n = batch_in_slots.fetch_add(1) + 1;
      int seen = batch_max_in_slots.load();
      while (n > seen && !batch_max_in_slots.compare_exchange_weak(seen, n)) {
      }
      while (!drain.load()) std::this_thread::yield();
      batch_in_slots.fetch_sub(1);
    });
  }
  clock.await_sleepers(16);  // the batch queue is full: 16 parked on the clock
  while (batch_refused.load() + 8 + 16 < kFlood) std::this_thread::yield();

  // Interactive traffic arrives in the middle of the flood.
  std::atomic<int> interactive_ok{0};
  std::atomic<int> interactive_waited{0};
  {
    std::latch all_in(24);  // declared first: it must outlive the threads' joins
    std::vector<std::jthread> users;
    for (int i = 0; i < 24; ++i) {
      users.emplace_back([&] {
        absl::StatusOr<keel::bulkhead_permit> p = b.acquire(interactive, clock, clock.now(), {}, {});
        if (p.ok()) {
          interactive_ok.fetch_add(1);
          if (p->waited()) interactive_waited.fetch_add(1);
        }
        all_in.arrive_and_wait();  // all 24 hold their slots at the same time
      });
    }
  }
  CHECK(interactive_ok.load() == 24);
  CHECK(interactive_waited.load() == 0);
  CHECK(b.figures(batch).active == 8);
  CHECK(b.figures(batch).queued == 16);
  CHECK(batch_refused.load() == kFlood - 24);
  CHECK(b.figures(batch).rejected == kFlood - 24);

  drain.store(true);
  flood.clear();  // joins: the 16 queued batch callers get slots as the first 8 leave
  CHECK(batch_max_in_slots.load() <= 8);
  const keel::bulkhead_figures f = b.figures(batch);
  CHECK(f.active == 0);
  CHECK(f.queued == 0);
  CHECK(f.completed == 24);
  CHECK(f.queue_delay[0] == 8);  // 8 got a slot at once, 16 waited (for zero simulated time)
  CHECK(b.figures(interactive).completed == 24);
}

TEST_CASE("invalid bulkhead options are refused with the field named", "[bulkhead][options]") {
  auto message = [](keel::bulkhead_options o) { return std::string(o.validate().message()); };
  CHECK(message({}) == "bulkhead_options.classes must name between 1 and 1000 classes (got 0)");
  CHECK(message({.classes = {{.name = "a", .capacity = 0}}}) ==
        "bulkhead_options.classes[0].capacity must be in [1, 32767] (got 0)");
  CHECK(message({.classes = {{.name = "a", .capacity = -3}}}) ==
        "bulkhead_options.classes[0].capacity must be in [1, 32767] (got -3)");
  CHECK(message({.classes = {{.name = "a"}, {.name = "a"}}}) == "bulkhead_options.classes[1].name must be unique (got a)");
  CHECK(message({.classes = {{.name = ""}}}) == "bulkhead_options.classes[0].name must not be empty (got \"\")");
  CHECK(message({.classes = {{.name = "a", .max_queue = -1}}}) ==
        "bulkhead_options.classes[0].max_queue must be in [0, 32767] (got -1)");
  CHECK(message({.classes = {{.name = "a", .max_queue_age = keel::duration::zero()}}}) ==
        "bulkhead_options.classes[0].max_queue_age must be in (0, 24h] (got 0s)");
  CHECK(message({.classes = {{.name = "a", .max_queue_age = std::chrono::hours(25)}}}) ==
        "bulkhead_options.classes[0].max_queue_age must be in (0, 24h] (got 90000s)");
  CHECK(message({.classes = {{.name = "a", .capacity = 2, .guaranteed = 3}}}) ==
        "bulkhead_options.classes[0].guaranteed must be in [0, capacity] (got 3)");
  // The seed's rule: batch may not borrow interactive capacity that is guaranteed.
  CHECK(message({.classes = {{.name = "interactive", .capacity = 24}, {.name = "batch", .capacity = 8}},
                 .lending = {{.lender = "interactive", .borrower = "batch", .max_slots = 4}}}) ==
        "bulkhead_options.lending[0].max_slots must keep lender 'interactive' its guaranteed 24 of 24 slots (at most "
        "0 lendable in all) (got 4)");
  CHECK(message({.classes = {{.name = "i", .capacity = 28, .guaranteed = 24}, {.name = "b"}, {.name = "r"}},
                 .lending = {{.lender = "i", .borrower = "b", .max_slots = 3},
                             {.lender = "i", .borrower = "r", .max_slots = 2}}}) ==
        "bulkhead_options.lending[1].max_slots must keep lender 'i' its guaranteed 24 of 28 slots (at most 4 "
        "lendable in all) (got 2)");
  CHECK(message({.classes = {{.name = "a"}}, .lending = {{.lender = "x", .borrower = "a"}}}) ==
        "bulkhead_options.lending[0].lender must name a class (got x)");
  CHECK(message({.classes = {{.name = "a", .capacity = 2, .guaranteed = 1}},
                 .lending = {{.lender = "a", .borrower = "a"}}}) ==
        "bulkhead_options.lending[0].borrower must differ from the lender (got a)");
  CHECK(message({.classes = {{.name = "a", .capacity = 2, .guaranteed = 1}, {.name = "b"}},
                 .lending = {{.lender = "a", .borrower = "b", .max_slots = 0}}}) ==
        "bulkhead_options.lending[0].max_slots must be >= 1 (got 0)");
  CHECK(message({.classes = {{.name = "a"}}, .default_class = "z"}) ==
        "bulkhead_options.default_class must name a class (got z)");
  CHECK(message(seed_pools()).empty());
  CHECK_THROWS_AS(keel::bulkhead({.classes = {{.name = "a", .capacity = 0}}}), keel::invalid_options);
}
