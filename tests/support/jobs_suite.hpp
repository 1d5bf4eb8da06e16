// The job queue behaviour suite, written once and run against every backend:
// KEEL_JOBS_SUITE(fixture, "name", "[tags]") defines one Catch2 test case per
// behaviour for that backend's fixture (see support/jobs.hpp for the fixture
// shape: open(), advance(d), clock, slack).
//
// Time: the SQLite fixture's store reads the manual clock; the PostgreSQL
// fixture adds a test-only offset to the server's clock (time still comes
// from the server) and moves the manual clock with it, so workers' lease
// keepers see the same jumps. Nothing sleeps to let time pass.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <latch>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "support/jobs.hpp"
#include "keel/durable/job_queue.hpp"
#include "support/catch.hpp"

namespace keel_jobs::suite {

using namespace std::chrono_literals;
using keel::job_state;

inline absl::StatusOr<std::string> echo(const keel::job_context& j) { return "ran:" + std::string(j.payload); }

template <class Store>
keel::job_info info(Store& s, std::int64_t id) {
  absl::StatusOr<std::optional<keel::job_info>> j = s.get(id);
  REQUIRE(j.ok());
  REQUIRE(j->has_value());
  return **j;
}

template <class Store>
std::optional<keel::job_claim> claim(Store& s, std::string_view queue, keel::duration lease = 30s,
                                     keel::owner_id owner = keel::owner_id::random()) {
  absl::StatusOr<std::optional<keel::job_claim>> c = s.claim(queue, owner, lease);
  INFO(c.status().ToString());
  REQUIRE(c.ok());
  return std::move(*c);
}

inline keel::job_limits limits(std::int64_t depth = 100, keel::duration age = 1h, int attempts = 3) {
  return {.max_depth = depth, .max_age = age, .max_attempts = attempts, .overload_retry_after = 2s};
}

template <class Store>
std::int64_t submit(Store& s, std::string_view queue, std::string_view key, std::string_view payload,
                    const keel::job_limits& l = limits()) {
  absl::StatusOr<keel::job_submission> r =
      s.submit({.queue = queue, .tenant = "acme", .key = key}, keel::sha256(payload), payload, l);
  INFO(r.status().ToString());
  REQUIRE(r.ok());
  REQUIRE(r->created);
  return r->id;
}

// ---------------------------------------------------------------------------

template <class F>
void submit_and_dedup() {
  F f;
  auto s = f.open();
  keel::job_queue q(*s, {.queue = "reports"}, keel::environment{f.clock});
  absl::StatusOr<keel::job_submission> a = q.submit("acme", "k-1", "payload one");
  REQUIRE(a.ok());
  CHECK(a->created);
  CHECK(a->id > 0);
  CHECK(a->state == job_state::queued);
  CHECK(a->attempts == 0);

  keel::job_info j = info(*s, a->id);
  CHECK(j.queue == "reports");
  CHECK(j.tenant == "acme");
  CHECK(j.key == "k-1");
  CHECK(j.payload == "payload one");
  CHECK(j.payload_digest == keel::sha256("payload one"));
  CHECK(j.state == job_state::queued);
  CHECK(j.attempts == 0);
  CHECK(j.max_attempts == 3);
  CHECK(j.fence == 0);
  CHECK(j.created_at_ns > 0);
  CHECK(j.available_at_ns == j.created_at_ns);
  CHECK(j.expires_at_ns - j.created_at_ns == keel::detail::to_ns(1h));
  CHECK(j.started_at_ns == 0);
  CHECK(j.finished_at_ns == 0);

  SECTION("the same key and payload is the same job, whatever its state") {
    absl::StatusOr<keel::job_submission> b = q.submit("acme", "k-1", "payload one");
    REQUIRE(b.ok());
    CHECK_FALSE(b->created);
    CHECK(b->id == a->id);
    REQUIRE(q.run_one(echo).ok());
    absl::StatusOr<keel::job_submission> c = q.submit("acme", "k-1", "payload one");
    REQUIRE(c.ok());
    CHECK_FALSE(c->created);
    CHECK(c->id == a->id);
    CHECK(c->state == job_state::done);
    CHECK(c->attempts == 1);
    CHECK(q.counts()->total() == 1);
  }
  SECTION("the same key with another payload is a conflict and changes nothing") {
    absl::StatusOr<keel::job_submission> b = q.submit("acme", "k-1", "payload two");
    CHECK(keel::is_conflict(b.status()));
    CHECK(b.status().code() == absl::StatusCode::kAlreadyExists);
    CHECK(info(*s, a->id).payload == "payload one");
    CHECK(q.counts()->total() == 1);
    // A caller-supplied digest decides too: the same bytes under another digest conflict.
    CHECK(keel::is_conflict(q.submit("acme", "k-1", "payload one", keel::sha256("canonical")).status()));
  }
  SECTION("keys are scoped by tenant and queue") {
    absl::StatusOr<keel::job_submission> other_tenant = q.submit("globex", "k-1", "payload two");
    REQUIRE(other_tenant.ok());
    CHECK(other_tenant->created);
    keel::job_queue q2(*s, {.queue = "reports-2"}, keel::environment{f.clock});
    absl::StatusOr<keel::job_submission> other_queue = q2.submit("acme", "k-1", "payload two");
    REQUIRE(other_queue.ok());
    CHECK(other_queue->created);
    CHECK(std::set<std::int64_t>{a->id, other_tenant->id, other_queue->id}.size() == 3);
    absl::StatusOr<std::optional<keel::job_info>> found = q.find("globex", "k-1");
    REQUIRE(found.ok());
    REQUIRE(found->has_value());
    CHECK((*found)->id == other_tenant->id);
    CHECK(q.find("initech", "k-1")->has_value() == false);
    CHECK(q.counts()->total() == 2);
    CHECK(q2.counts()->total() == 1);
  }
  SECTION("another handle sees the job") {
    auto peer = f.open();
    CHECK(info(*peer, a->id).payload == "payload one");
  }
}

template <class F>
void depth_bound() {
  F f;
  auto s = f.open();
  keel::job_queue q(*s, {.queue = "q", .max_depth = 3, .overload_retry_after = 2s}, keel::environment{f.clock});
  std::vector<std::int64_t> ids;
  for (int i = 0; i < 3; ++i) ids.push_back(q.submit("acme", "k" + std::to_string(i), "p")->id);
  absl::StatusOr<keel::job_submission> over = q.submit("acme", "k3", "p");
  INFO(over.status().ToString());
  CHECK(keel::is_job_queue_full(over.status()));
  CHECK(over.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK(keel::refused_by(over.status()) == "job-queue:q");
  CHECK(keel::retry_after(over.status()) == keel::duration(2s));
  CHECK(keel::not_started(over.status()));
  CHECK_FALSE(q.find("acme", "k3")->has_value());  // nothing stored
  CHECK(q.counts()->total() == 3);
  CHECK(q.counts()->depth == 3);

  // A duplicate of a job already in the queue is not new work: it is answered, not refused.
  absl::StatusOr<keel::job_submission> dup = q.submit("acme", "k1", "p");
  REQUIRE(dup.ok());
  CHECK(dup->id == ids[1]);

  // Running jobs still count; finished ones do not.
  std::optional<keel::job_claim> c = claim(*s, "q");
  REQUIRE(c.has_value());
  CHECK(keel::is_job_queue_full(q.submit("acme", "k3", "p").status()));
  REQUIRE(s->complete(c->id, c->ownership, "r").ok());
  absl::StatusOr<keel::job_submission> now_fits = q.submit("acme", "k3", "p");
  REQUIRE(now_fits.ok());
  CHECK(now_fits->created);
  CHECK(keel::is_job_queue_full(q.submit("acme", "k4", "p").status()));

  // Another queue has its own bound.
  keel::job_queue other(*s, {.queue = "other", .max_depth = 1}, keel::environment{f.clock});
  CHECK(other.submit("acme", "k0", "p").ok());
}

template <class F>
void depth_bound_under_contention() {
  F f;
  constexpr int threads = 6, per_thread = 15, max_depth = 40;
  std::vector<std::unique_ptr<typename F::store_type>> stores;
  for (int t = 0; t < threads; ++t) stores.push_back(f.open());
  std::vector<int> accepted(threads, 0), rejected(threads, 0), other(threads, 0);
  std::latch go(threads);
  {
    std::vector<std::jthread> workers;
    for (int t = 0; t < threads; ++t) {
      workers.emplace_back([&, t] {
        keel::job_queue q(*stores[t], {.queue = "q", .max_depth = max_depth}, keel::environment{f.clock});
        go.arrive_and_wait();
        for (int i = 0; i < per_thread; ++i) {
          absl::StatusOr<keel::job_submission> r = q.submit("acme", std::to_string(t) + "-" + std::to_string(i), "p");
          if (r.ok() && r->created) ++accepted[t];
          else if (keel::is_job_queue_full(r.status())) ++rejected[t];
          else ++other[t];
        }
      });
    }
  }
  int a = 0, r = 0, o = 0;
  for (int t = 0; t < threads; ++t) a += accepted[t], r += rejected[t], o += other[t];
  CHECK(o == 0);
  CHECK(a == max_depth);
  CHECK(r == threads * per_thread - max_depth);
  absl::StatusOr<keel::job_counts> c = stores[0]->counts("q");
  REQUIRE(c.ok());
  CHECK(c->queued == max_depth);
  CHECK(c->depth == max_depth);
}

template <class F>
void age_bound() {
  F f;
  auto s = f.open();
  keel::job_queue q(*s, {.queue = "q", .max_depth = 2, .max_age = 10s}, keel::environment{f.clock});
  const std::int64_t old_a = q.submit("acme", "a", "p")->id;
  f.advance(4s);
  const std::int64_t old_b = q.submit("acme", "b", "p")->id;
  f.advance(7s);  // a is 11 s old, b 7 s

  // Visible at once, before any write marks it.
  keel::job_info a = info(*s, old_a);
  CHECK(a.state == job_state::expired);
  CHECK(a.finished_at_ns == a.expires_at_ns);
  CHECK(info(*s, old_b).state == job_state::queued);
  absl::StatusOr<keel::job_counts> c = q.counts();
  CHECK(c->expired == 1);
  CHECK(c->queued == 1);

  // An expired job does not take a place in the queue...
  absl::StatusOr<keel::job_submission> fresh = q.submit("acme", "c", "p");
  REQUIRE(fresh.ok());
  CHECK(fresh->created);
  // ... is never claimed, and is kept (not silently dropped).
  std::optional<keel::job_claim> first = claim(*s, "q");
  REQUIRE(first.has_value());
  CHECK(first->id == old_b);
  CHECK(info(*s, old_a).state == job_state::expired);
  CHECK(q.submit("acme", "a", "p")->id == old_a);  // its key still answers with it
  CHECK(q.submit("acme", "a", "p")->state == job_state::expired);

  // A retry that waits past the job's age expires too.
  REQUIRE(s->fail(first->id, first->ownership, {.code = absl::StatusCode::kUnavailable, .message = "x",
                                                 .retry_after = 5s})
              .ok());
  f.advance(5s);
  CHECK(info(*s, old_b).state == job_state::expired);
  std::optional<keel::job_claim> next = claim(*s, "q");
  REQUIRE(next.has_value());
  CHECK(next->id == fresh->id);
  CHECK(q.counts()->expired == 2);
  CHECK(q.counts()->depth == 1);
}

template <class F>
void claim_order() {
  F f;
  auto s = f.open();
  std::vector<std::int64_t> ids;
  for (int i = 0; i < 5; ++i) {
    ids.push_back(submit(*s, "q", "k" + std::to_string(i), "p" + std::to_string(i)));
    f.advance(1ms);
  }
  CHECK(std::is_sorted(ids.begin(), ids.end()));
  CHECK(submit(*s, "elsewhere", "k0", "p") > 0);

  std::optional<keel::job_claim> c0 = claim(*s, "q", 10s);
  REQUIRE(c0.has_value());
  CHECK(c0->id == ids[0]);
  CHECK(c0->ownership.fence == 1);
  CHECK(c0->attempt == 1);
  CHECK(c0->max_attempts == 3);
  CHECK_FALSE(c0->took_over);
  CHECK(c0->payload == "p0");
  CHECK(c0->tenant == "acme");
  CHECK(c0->key == "k0");
  CHECK(c0->lease == keel::duration(10s));

  std::optional<keel::job_claim> c1 = claim(*s, "q", 60s);
  REQUIRE(c1.has_value());
  CHECK(c1->id == ids[1]);
  // Job 1 fails and waits 5 s before its retry: job 2 goes first.
  REQUIRE(s->fail(c1->id, c1->ownership, {.code = absl::StatusCode::kUnavailable, .retry_after = 5s}).ok());
  std::optional<keel::job_claim> c2 = claim(*s, "q", 60s);
  REQUIRE(c2.has_value());
  CHECK(c2->id == ids[2]);

  f.advance(11s);  // job 0's lease lapsed; job 1 is due again
  // Oldest first: the lapsed job 0 is taken over before the due job 1.
  std::optional<keel::job_claim> t0 = claim(*s, "q", 60s);
  REQUIRE(t0.has_value());
  CHECK(t0->id == ids[0]);
  CHECK(t0->took_over);
  CHECK(t0->ownership.fence == 2);
  CHECK(t0->attempt == 2);
  std::optional<keel::job_claim> r1 = claim(*s, "q", 60s);
  REQUIRE(r1.has_value());
  CHECK(r1->id == ids[1]);
  CHECK_FALSE(r1->took_over);
  CHECK(r1->attempt == 2);
  CHECK(r1->ownership.fence == 2);
  CHECK(claim(*s, "q", 60s)->id == ids[3]);
  CHECK(claim(*s, "q", 60s)->id == ids[4]);
  CHECK_FALSE(claim(*s, "q", 60s).has_value());  // everything is running
  CHECK(claim(*s, "elsewhere")->key == "k0");
}

template <class F>
void fenced_completion() {
  F f;
  auto s = f.open();
  auto peer = f.open();
  const std::int64_t id = submit(*s, "q", "k", "p");
  std::optional<keel::job_claim> first = claim(*s, "q", 10s);
  REQUIRE(first.has_value());
  const keel::ownership stale = first->ownership;

  SECTION("a holder whose lease lapsed but was not taken over still completes") {
    f.advance(30s);
    REQUIRE(s->renew(id, stale, 10s).ok());
    REQUIRE(s->complete(id, stale, "late but fine").ok());
    CHECK(info(*s, id).result == "late but fine");
  }
  SECTION("after a takeover the stale worker's writes are refused and change nothing") {
    f.advance(11s);
    std::optional<keel::job_claim> second = claim(*peer, "q", 10s);
    REQUIRE(second.has_value());
    CHECK(second->id == id);
    CHECK(second->took_over);
    CHECK(second->ownership.fence == stale.fence + 1);
    CHECK(second->attempt == 2);

    absl::Status late = s->complete(id, stale, "stale result");
    INFO(late.ToString());
    CHECK(keel::is_lost_ownership(late));
    CHECK(late.code() == absl::StatusCode::kFailedPrecondition);
    CHECK(keel::is_lost_ownership(s->renew(id, stale, 10s)));
    CHECK(keel::is_lost_ownership(
        s->fail(id, stale, {.code = absl::StatusCode::kInternal, .message = "stale"}).status()));
    keel::job_info j = info(*s, id);
    CHECK(j.state == job_state::running);
    CHECK(j.fence == 2);
    CHECK(j.attempts == 2);
    CHECK(j.result.empty());
    CHECK(j.error_code == absl::StatusCode::kOk);

    REQUIRE(peer->complete(id, second->ownership, std::string("winner\0bytes", 12)).ok());
    CHECK(keel::is_lost_ownership(s->complete(id, stale, "stale again")));
    // Repeating the winner's complete (a lost reply) is OK and changes nothing.
    REQUIRE(peer->complete(id, second->ownership, "something else").ok());
    j = info(*s, id);
    CHECK(j.state == job_state::done);
    CHECK(j.result == std::string("winner\0bytes", 12));
    CHECK(j.finished_at_ns >= j.started_at_ns);
    CHECK(j.attempts == 2);
    // A fail after completion by the holder is refused too: done is final.
    CHECK(keel::is_lost_ownership(peer->fail(id, second->ownership, {.code = absl::StatusCode::kInternal}).status()));
    CHECK(info(*s, id).state == job_state::done);
    CHECK(s->counts("q")->depth == 0);
  }
  SECTION("an owner that never held the job is refused") {
    const keel::ownership forged{keel::owner_id::random(), stale.fence};
    CHECK(keel::is_lost_ownership(s->complete(id, forged, "x")));
    CHECK(keel::is_lost_ownership(s->complete(id + 1000, stale, "x")));
    CHECK(info(*s, id).state == job_state::running);
  }
}

template <class F>
void renewals_keep_the_job() {
  F f;
  auto s = f.open();
  auto other = f.open();
  const std::int64_t id = submit(*s, "q", "k", "p");
  const keel::owner_id me = keel::owner_id::random();
  std::optional<keel::job_claim> c = claim(*s, "q", 10s, me);
  REQUIRE(c.has_value());

  // The same owner claiming again (a lost reply) gets the same job and fence.
  f.advance(2s);
  std::optional<keel::job_claim> again = claim(*s, "q", 10s, me);
  REQUIRE(again.has_value());
  CHECK(again->id == id);
  CHECK(again->ownership == c->ownership);
  CHECK(again->attempt == 1);
  CHECK(info(*s, id).attempts == 1);

  f.advance(8s);  // 2 s left on the re-claim's lease
  REQUIRE(s->renew(id, c->ownership, 10s).ok());
  REQUIRE(s->renew(id, c->ownership, 1s).ok());  // never shortens
  f.advance(9s);
  CHECK_FALSE(claim(*other, "q").has_value());
  CHECK(info(*s, id).lease_remaining > keel::duration::zero());
  CHECK(info(*s, id).lease_remaining <= keel::duration(1s));
  f.advance(2s);
  CHECK(info(*s, id).lease_remaining == keel::duration::zero());
  std::optional<keel::job_claim> taken = claim(*other, "q");
  REQUIRE(taken.has_value());
  CHECK(taken->took_over);
}

template <class F>
void worker_renews_while_working() {
  F f;
  auto s = f.open();
  auto rival = f.open();
  keel::job_queue q(*s, {.queue = "q", .lease = 9s}, keel::environment{f.clock});
  const std::int64_t id = q.submit("acme", "k", "p")->id;
  std::atomic<bool> release{false};
  std::atomic<bool> started{false};
  absl::StatusOr<std::optional<keel::job_outcome>> out = absl::UnknownError("not run");
  {
    std::jthread worker([&] {
      out = q.run_one([&](const keel::job_context& j) -> absl::StatusOr<std::string> {
        started = true;
        while (!release.load()) std::this_thread::yield();
        return "finished attempt " + std::to_string(j.attempt);
      });
    });
    while (!started.load()) std::this_thread::yield();
    // Three renewal periods (3 s each) pass in steps; each time the keeper
    // renews, the lease is pushed out again.
    for (int i = 0; i < 4; ++i) {
      f.clock.await_sleepers(1);  // the keeper is parked until its next renewal
      const std::int64_t before = info(*s, id).lease_remaining.count();
      f.advance(3s);
      // Wait (bounded, real time) until the keeper's renewal shows in the store.
      const auto limit = std::chrono::steady_clock::now() + 20s;
      while (info(*s, id).lease_remaining.count() <= before - keel::detail::to_ns(3s) &&
             std::chrono::steady_clock::now() < limit)
        std::this_thread::yield();
    }
    // 12 s after the claim, past the original 9 s lease: still held.
    CHECK_FALSE(claim(*rival, "q").has_value());
    release = true;
  }
  REQUIRE(out.ok());
  REQUIRE(out->has_value());
  CHECK((*out)->state == job_state::done);
  CHECK_FALSE((*out)->took_over);
  keel::job_info j = info(*s, id);
  CHECK(j.result == "finished attempt 1");
  CHECK(j.attempts == 1);
}

template <class F>
void retries_and_final_failure() {
  F f;
  auto s = f.open();
  keel::job_queue q(*s, {.queue = "q", .max_attempts = 3, .retry_backoff = 2s, .retry_backoff_cap = 3s}, keel::environment{f.clock});
  const std::int64_t id = q.submit("acme", "k", "p")->id;
  int calls = 0;
  auto flaky = [&](const keel::job_context& j) -> absl::StatusOr<std::string> {
    ++calls;
    return absl::UnavailableError("provider down on attempt " + std::to_string(j.attempt));
  };

  absl::StatusOr<std::optional<keel::job_outcome>> r = q.run_one(flaky);
  REQUIRE(r.ok());
  REQUIRE(r->has_value());
  CHECK((*r)->state == job_state::queued);
  CHECK((*r)->attempt == 1);
  CHECK((*r)->handler_status.code() == absl::StatusCode::kUnavailable);
  keel::job_info j = info(*s, id);
  CHECK(j.state == job_state::queued);
  CHECK(j.attempts == 1);
  CHECK(j.error_code == absl::StatusCode::kUnavailable);
  CHECK(j.error_message == "provider down on attempt 1");
  CHECK(j.available_at_ns - j.started_at_ns >= keel::detail::to_ns(2s));
  CHECK(j.finished_at_ns == 0);

  // Waiting out the backoff: 2 s after attempt 1, then 3 s (2 * 2 capped at 3).
  CHECK_FALSE(q.run_one(flaky)->has_value());
  f.advance(2s);
  r = q.run_one(flaky);
  REQUIRE(r->has_value());
  CHECK((*r)->attempt == 2);
  CHECK((*r)->state == job_state::queued);
  f.advance(2s);
  CHECK_FALSE(q.run_one(flaky)->has_value());
  f.advance(1s);
  r = q.run_one(flaky);
  REQUIRE(r->has_value());
  CHECK((*r)->attempt == 3);
  CHECK((*r)->state == job_state::failed);

  j = info(*s, id);
  CHECK(j.state == job_state::failed);
  CHECK(j.attempts == 3);
  CHECK(j.error_code == absl::StatusCode::kUnavailable);
  CHECK(j.error_message == "provider down on attempt 3");
  CHECK(j.finished_at_ns > 0);
  CHECK(calls == 3);
  f.advance(1h);
  CHECK_FALSE(q.run_one(flaky)->has_value());  // failed is final
  CHECK(q.counts()->failed == 1);
  CHECK(q.counts()->depth == 0);
}

template <class F>
void failure_kinds() {
  F f;
  auto s = f.open();
  keel::job_queue q(*s, {.queue = "q", .max_attempts = 5, .retry_backoff = 1s}, keel::environment{f.clock});

  SECTION("a permanent failure fails the job at once") {
    const std::int64_t id = q.submit("acme", "k", "p")->id;
    auto r = q.run_one([](const keel::job_context&) -> absl::StatusOr<std::string> {
      return absl::InvalidArgumentError("the report spec names an unknown model");
    });
    REQUIRE(r->has_value());
    CHECK((*r)->state == job_state::failed);
    keel::job_info j = info(*s, id);
    CHECK(j.state == job_state::failed);
    CHECK(j.attempts == 1);
    CHECK(j.error_code == absl::StatusCode::kInvalidArgument);
    CHECK(j.error_message == "the report spec names an unknown model");
  }
  SECTION("a throttled failure waits for its retry-after hint") {
    const std::int64_t id = q.submit("acme", "k", "p")->id;
    auto r = q.run_one([](const keel::job_context&) -> absl::StatusOr<std::string> {
      return keel::with_retry_after(absl::ResourceExhaustedError("429"), 7s);
    });
    REQUIRE(r->has_value());
    CHECK((*r)->state == job_state::queued);
    keel::job_info j = info(*s, id);
    // 7 s from the store's now at the failure (a server clock moves a little in between).
    CHECK(j.available_at_ns - j.started_at_ns >= keel::detail::to_ns(7s));
    CHECK(j.available_at_ns - j.started_at_ns < keel::detail::to_ns(7s + 1s));
    f.advance(6s);
    CHECK_FALSE(q.run_one(echo)->has_value());
    f.advance(1s);
    CHECK(q.run_one(echo).value()->state == job_state::done);
  }
  SECTION("a hint shorter than the backoff does not shorten it") {
    const std::int64_t id = q.submit("acme", "k", "p")->id;
    auto breaker_open = [](const keel::job_context&) -> absl::StatusOr<std::string> {
      return keel::with_retry_after(absl::UnavailableError("breaker open"), 100ms);
    };
    REQUIRE(q.run_one(breaker_open)->has_value());  // attempt 1: backoff 1 s > hint
    f.advance(1s);
    REQUIRE(q.run_one(breaker_open)->has_value());  // attempt 2: backoff 2 s > hint
    f.advance(1s);
    CHECK_FALSE(q.run_one(echo)->has_value());  // the 100 ms hint alone would have let it run
    f.advance(1s);
    CHECK(q.run_one(echo).value()->state == job_state::done);
    CHECK(info(*s, id).attempts == 3);
  }
  SECTION("a handler that throws is retried, not lost") {
    const std::int64_t id = q.submit("acme", "k", "p")->id;
    auto r = q.run_one([](const keel::job_context&) -> absl::StatusOr<std::string> {
      throw std::runtime_error("boom");
    });
    REQUIRE(r->has_value());
    CHECK((*r)->state == job_state::queued);
    CHECK(info(*s, id).error_message.find("boom") != std::string::npos);
    f.advance(1s);
    CHECK(q.run_one(echo).value()->state == job_state::done);
    CHECK(info(*s, id).result == "ran:p");
    CHECK(info(*s, id).attempts == 2);
  }
  SECTION("a handler stopped by shutdown is retried, whatever status it returns") {
    const std::int64_t id = q.submit("acme", "k", "p")->id;
    std::stop_source shutdown;
    auto r = q.run_one(
        [&](const keel::job_context& j) -> absl::StatusOr<std::string> {
          shutdown.request_stop();  // the service is stopping while the job runs
          if (j.stop.stop_requested()) return absl::CancelledError("stopping");  // permanent by itself
          return "not stopped";
        },
        shutdown.get_token());
    REQUIRE(r->has_value());
    CHECK((*r)->state == job_state::queued);
    CHECK((*r)->handler_status.code() == absl::StatusCode::kCancelled);
    keel::job_info j = info(*s, id);
    CHECK(j.state == job_state::queued);
    CHECK(j.attempts == 1);
    CHECK(j.error_code == absl::StatusCode::kCancelled);
    f.advance(1s);
    CHECK(q.run_one(echo).value()->state == job_state::done);
  }
  SECTION("fail and complete repeated by the same holder are answered, not applied twice") {
    const std::int64_t id = q.submit("acme", "k", "p")->id;
    std::optional<keel::job_claim> c = claim(*s, "q");
    REQUIRE(c.has_value());
    const keel::job_failure f1{.code = absl::StatusCode::kUnavailable, .message = "m", .retry_after = 1s};
    CHECK(s->fail(id, c->ownership, f1).value() == job_state::queued);
    CHECK(s->fail(id, c->ownership, f1).value() == job_state::queued);
    CHECK(info(*s, id).attempts == 1);
    CHECK(keel::is_lost_ownership(s->complete(id, c->ownership, "x")));  // it gave the job back
  }
}

template <class F>
void crash_on_the_last_attempt_fails_the_job() {
  F f;
  auto s = f.open();
  const std::int64_t id = submit(*s, "q", "k", "p", limits(10, 1h, 2));
  const std::int64_t later = submit(*s, "q", "k2", "p", limits(10, 1h, 2));
  std::optional<keel::job_claim> a = claim(*s, "q", 10s);
  REQUIRE(a->id == id);
  f.advance(11s);
  std::optional<keel::job_claim> b = claim(*s, "q", 10s);  // attempt 2 of 2: a takeover
  REQUIRE(b->id == id);
  CHECK(b->attempt == 2);
  f.advance(11s);  // the second worker dies too
  std::optional<keel::job_claim> c = claim(*s, "q", 10s);
  REQUIRE(c.has_value());
  CHECK(c->id == later);  // job `id` was not handed out a third time...
  keel::job_info j = info(*s, id);
  CHECK(j.state == job_state::failed);  // ... it failed, with the reason
  CHECK(j.attempts == 2);
  CHECK(j.error_code == absl::StatusCode::kDeadlineExceeded);
  CHECK(j.error_message.find("lease expired during the last attempt") != std::string::npos);
  CHECK(keel::is_lost_ownership(s->complete(id, b->ownership, "too late")));
  CHECK(s->counts("q")->depth == 1);
}

template <class F>
void purge_and_reuse() {
  F f;
  auto s = f.open();
  keel::job_queue q(*s, {.queue = "q", .max_age = 10s}, keel::environment{f.clock});
  const std::int64_t done_id = q.submit("acme", "done", "p")->id;  // t0
  REQUIRE(q.run_one(echo).value()->state == job_state::done);        // finished at t0
  const std::int64_t expired_id = q.submit("acme", "expired", "p")->id;  // expires at t0 + 10 s
  f.advance(9s);
  const std::int64_t queued_id = q.submit("acme", "queued", "p")->id;  // expires at t0 + 19 s
  f.advance(2s);
  CHECK(q.purge_finished(1h).value() == 0);
  f.advance(1h - 5s);  // t0 + 1 h 6 s: only `done` finished more than 1 h ago
  CHECK(q.purge_finished(1h).value() == 1);
  CHECK_FALSE(s->get(done_id)->has_value());
  CHECK(info(*s, expired_id).state == job_state::expired);
  f.advance(10s);  // t0 + 1 h 16 s: `expired` (finished t0 + 10 s) goes, `queued` (t0 + 19 s) stays
  CHECK(q.purge_finished(1h).value() == 1);
  CHECK_FALSE(s->get(expired_id)->has_value());
  CHECK(info(*s, queued_id).state == job_state::expired);
  CHECK(q.counts()->total() == 1);
  // The key of a purged job may be used again: a new job, a new id.
  absl::StatusOr<keel::job_submission> again = q.submit("acme", "done", "other payload");
  REQUIRE(again.ok());
  CHECK(again->created);
  CHECK(again->id > queued_id);
}

template <class F>
void bad_input_is_refused() {
  F f;
  auto s = f.open();
  const std::string long_key(256, 'k');
  const std::string ctl("bad\nkey");
  const std::string nul_key("k\0", 2);  // job_key holds views: the bytes must outlive it
  auto invalid = [](const absl::Status& st, const std::string& needle) {
    INFO(st.ToString());
    CHECK(st.code() == absl::StatusCode::kInvalidArgument);
    CHECK(std::string(st.message()).find(needle) != std::string::npos);
  };
  const keel::digest d = keel::sha256("p");
  for (const auto& [k, field] : std::vector<std::pair<keel::job_key, std::string>>{
           {{.queue = "", .tenant = "t", .key = "k"}, "queue must not be empty"},
           {{.queue = "q", .tenant = "", .key = "k"}, "tenant must not be empty"},
           {{.queue = "q", .tenant = "t", .key = ""}, "job key must not be empty"},
           {{.queue = "q", .tenant = "t", .key = long_key}, "job key must be at most 255 bytes (got 256)"},
           {{.queue = long_key, .tenant = "t", .key = "k"}, "queue must be at most 255 bytes"},
           {{.queue = "q", .tenant = ctl, .key = "k"}, "tenant must not contain control characters (byte 0x0a"},
           {{.queue = "q", .tenant = "t", .key = nul_key}, "job key must not contain control characters (byte 0x00"},
           {{.queue = "q", .tenant = "t", .key = "k\x7f"}, "job key must not contain control characters (byte 0x7f"},
       }) {
    invalid(s->submit(k, d, "p", limits()).status(), field);
    invalid(s->find(k).status(), field);
  }
  invalid(s->submit({"q", "t", "k"}, d, "p", {.max_depth = 0}).status(), "job_limits.max_depth must be >= 1 (got 0)");
  invalid(s->submit({"q", "t", "k"}, d, "p", {.max_depth = -5}).status(), "job_limits.max_depth must be >= 1 (got -5)");
  invalid(s->submit({"q", "t", "k"}, d, "p", {.max_age = keel::duration::zero()}).status(), "job_limits.max_age must be > 0");
  invalid(s->submit({"q", "t", "k"}, d, "p", {.max_age = -1s}).status(), "job_limits.max_age must be > 0 (got -1s)");
  invalid(s->submit({"q", "t", "k"}, d, "p", {.max_attempts = 0}).status(), "job_limits.max_attempts must be >= 1 (got 0)");
  invalid(s->submit({"q", "t", "k"}, d, "p", {.overload_retry_after = -1s}).status(), "job_limits.overload_retry_after");

  const keel::ownership token{keel::owner_id::random(), 1};
  invalid(s->claim("", keel::owner_id::random(), 10s).status(), "queue must not be empty");
  invalid(s->claim("q", keel::owner_id::random(), keel::duration::zero()).status(), "claim.lease must be > 0");
  invalid(s->claim("q", keel::owner_id::random(), -1s).status(), "claim.lease must be > 0");
  invalid(s->claim("q", keel::owner_id{}, 10s).status(), "owner must not be nil");
  invalid(s->renew(1, token, keel::duration::zero()), "renew.lease must be > 0");
  invalid(s->renew(0, token, 1s), "job.id must be > 0 (got 0)");
  invalid(s->complete(-3, token, "r"), "job.id must be > 0 (got -3)");
  invalid(s->fail(0, token, {.code = absl::StatusCode::kInternal}).status(), "job.id must be > 0");
  invalid(s->fail(1, token, {.code = absl::StatusCode::kOk}).status(), "job_failure.code must not be OK");
  invalid(s->fail(1, token, {.code = absl::StatusCode::kInternal, .retry_after = -1s}).status(),
          "job_failure.retry_after must be >= 0");
  invalid(s->get(0).status(), "job.id must be > 0");
  invalid(s->counts("").status(), "queue must not be empty");
  invalid(s->purge_finished("q", -1s).status(), "purge_finished.retention must be >= 0");

  // The queue's options, refused at construction with the field and the rule.
  auto refused = [&](keel::job_queue_options o, const std::string& needle) {
    INFO(needle);
    CHECK(std::string(o.validate().message()).find(needle) != std::string::npos);
    try {
      keel::job_queue q(*s, std::move(o), keel::environment{f.clock});
      FAIL("constructed with invalid options");
    } catch (const keel::invalid_options& e) {
      CHECK(e.status().code() == absl::StatusCode::kInvalidArgument);
      CHECK(std::string(e.what()).find(needle) != std::string::npos);
    }
  };
  refused({.queue = ""}, "job_queue_options.queue must not be empty");
  refused({.queue = "a\tb"}, "job_queue_options.queue must not contain control characters");
  refused({.max_depth = 0}, "job_queue_options.max_depth must be >= 1 (got 0)");
  refused({.max_depth = -1}, "job_queue_options.max_depth must be >= 1 (got -1)");
  refused({.max_age = keel::duration::zero()}, "job_queue_options.max_age must be > 0 (got 0s)");
  refused({.max_age = -1s}, "job_queue_options.max_age must be > 0");
  refused({.max_attempts = 0}, "job_queue_options.max_attempts must be >= 1 (got 0)");
  refused({.max_attempts = -2}, "job_queue_options.max_attempts must be >= 1 (got -2)");
  refused({.lease = keel::duration::zero()}, "job_queue_options.lease must be > 0");
  refused({.lease = 10s, .renew_every = 10s}, "job_queue_options.renew_every must be in [0, lease)");
  refused({.retry_backoff = -1s}, "job_queue_options.retry_backoff must be >= 0");
  refused({.retry_backoff = 2s, .retry_backoff_cap = 1s}, "job_queue_options.retry_backoff_cap must be >= retry_backoff");
  refused({.poll_interval = keel::duration::zero()}, "job_queue_options.poll_interval must be > 0");
  refused({.overload_retry_after = -1s}, "job_queue_options.overload_retry_after must be >= 0");
  refused({.max_payload_bytes = 0}, "job_queue_options.max_payload_bytes must be >= 1 (got 0)");

  keel::job_queue q(*s, {.queue = "q", .max_payload_bytes = 8}, keel::environment{f.clock});
  invalid(q.submit("t", "k", "123456789").status(), "job.payload must be at most 8 bytes (got 9 bytes)");
  invalid(q.submit("t", "", "p").status(), "job key must not be empty");
  invalid(q.submit("t", long_key, "p").status(), "job key must be at most 255 bytes");
  invalid(q.submit("t\x01", "k", "p").status(), "tenant must not contain control characters");
  // Nothing was stored by any of it.
  CHECK(s->counts("q")->total() == 0);
  CHECK_FALSE(s->get(1)->has_value());
}

// N threads, each with its own store handle (connection), drain one queue:
// every job runs once and is done once, counted in a durable log.
template <class F>
void threads_drain_exactly_once() {
  F f;
  constexpr int threads = 6, jobs = 120;
  std::vector<std::unique_ptr<typename F::store_type>> stores;
  for (int t = 0; t < threads; ++t) stores.push_back(f.open());
  {
    keel::job_queue q(*stores[0], {.queue = "drain"}, keel::environment{f.clock});
    for (int i = 0; i < jobs; ++i) REQUIRE(q.submit("acme", "job-" + std::to_string(i), "p" + std::to_string(i)).ok());
  }
  keel_durable::temp_dir logs;
  const std::string log_path = logs.file("exec.log");
  exec_log log(log_path);
  std::vector<int> ran(threads, 0), errors(threads, 0), lost(threads, 0);
  std::latch go(threads);
  {
    std::vector<std::jthread> workers;
    for (int t = 0; t < threads; ++t) {
      workers.emplace_back([&, t] {
        keel::job_queue q(*stores[t], {.queue = "drain"}, keel::environment{f.clock});
        go.arrive_and_wait();
        for (;;) {
          absl::StatusOr<std::optional<keel::job_outcome>> r =
              q.run_one([&](const keel::job_context& j) -> absl::StatusOr<std::string> {
                log.record(j.id, j.ownership.fence, "start");
                return "result of " + std::string(j.payload);
              });
          if (!r.ok()) {
            ++errors[t];
            if (errors[t] > 100) return;
            continue;
          }
          if (!r->has_value()) return;  // nothing left to claim
          if ((*r)->lost) ++lost[t];
          else if ((*r)->state == job_state::done) log.record((*r)->id, 0, "done"), ++ran[t];
        }
      });
    }
  }
  int total = 0;
  for (int t = 0; t < threads; ++t) {
    CHECK(errors[t] == 0);
    CHECK(lost[t] == 0);
    total += ran[t];
  }
  CHECK(total == jobs);
  const auto starts = exec_log::count(log_path, "start");
  const auto dones = exec_log::count(log_path, "done");
  CHECK(starts.size() == static_cast<std::size_t>(jobs));
  CHECK(dones.size() == static_cast<std::size_t>(jobs));
  for (const auto& [id, n] : starts) CHECK(n == 1);
  for (const auto& [id, n] : dones) CHECK(n == 1);
  absl::StatusOr<keel::job_counts> c = stores[0]->counts("drain");
  CHECK(c->done == jobs);
  CHECK(c->depth == 0);
  for (const auto& [id, n] : dones) {
    keel::job_info j = info(*stores[0], id);
    CHECK(j.result == "result of " + j.payload);
    CHECK(j.attempts == 1);
  }
}

}  // namespace keel_jobs::suite

#define KEEL_JOBS_CASE(fixture, label, tags, name, fn) \
  TEST_CASE(label ": " name, "[jobs]" tags) { keel_jobs::suite::fn<fixture>(); }

// One test case per behaviour for `fixture`; `label` prefixes the names.
#define KEEL_JOBS_SUITE(fixture, label, tags)                                                                      \
  KEEL_JOBS_CASE(fixture, label, tags, "submission is durable and deduplicated by key and payload digest",          \
                 submit_and_dedup)                                                                                 \
  KEEL_JOBS_CASE(fixture, label, tags, "a full queue refuses new work visibly and stores nothing", depth_bound)    \
  KEEL_JOBS_CASE(fixture, label, tags, "the depth bound holds exactly under concurrent submitters",                 \
                 depth_bound_under_contention)                                                                     \
  KEEL_JOBS_CASE(fixture, label, tags, "jobs older than the max age expire visibly and are never claimed",         \
                 age_bound)                                                                                        \
  KEEL_JOBS_CASE(fixture, label, tags, "claims take the oldest eligible job", claim_order)                         \
  KEEL_JOBS_CASE(fixture, label, tags, "completion is fenced: a stale worker's writes are refused", fenced_completion) \
  KEEL_JOBS_CASE(fixture, label, tags, "renewals keep the job; a repeated claim by its owner is answered",          \
                 renewals_keep_the_job)                                                                            \
  KEEL_JOBS_CASE(fixture, label, tags, "a worker renews its lease while the handler runs", worker_renews_while_working) \
  KEEL_JOBS_CASE(fixture, label, tags, "failed attempts are counted, retried after a backoff, then failed",         \
                 retries_and_final_failure)                                                                        \
  KEEL_JOBS_CASE(fixture, label, tags, "permanent, throttled and thrown failures", failure_kinds)                  \
  KEEL_JOBS_CASE(fixture, label, tags, "a job whose last attempt's lease lapses fails with the reason",             \
                 crash_on_the_last_attempt_fails_the_job)                                                          \
  KEEL_JOBS_CASE(fixture, label, tags, "finished jobs are purged after their retention", purge_and_reuse)         \
  KEEL_JOBS_CASE(fixture, label, tags, "bad input is refused with the field named, nothing stored",                \
                 bad_input_is_refused)                                                                             \
  KEEL_JOBS_CASE(fixture, label, tags, "threads with their own connections drain a queue exactly once",            \
                 threads_drain_exactly_once)
