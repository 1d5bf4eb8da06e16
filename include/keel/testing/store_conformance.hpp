// keel/testing/store_conformance.hpp — the checks every keel store backend
// must pass, runnable against any backend (yours too) from any test
// framework.
//
// The suite checks the contracts in docs/stores.md for whichever of them the
// store type models (keel::idempotency_store, keel::lease_store,
// keel::result_store): the begin() decision table, fencing and lost
// ownership, takeover after expiry, repeats, supersede, stored failures,
// byte-exact round trips, key validation and scoping, first-write-wins
// results with retention, N threads racing one key, keel::once with
// concurrent duplicates, fences that never go backwards however much the
// store forgets, and — when the harness can — a clock stepping backwards
// and a second handle on the same data.
//
// It needs no test framework: it returns a report of failures. The harness
// says how to make a fresh store and how to move its clock:
//
//   keel::testing::manual_clock clock;
//   keel::testing::store_harness<keel::memory_store> h{
//       .make = [&] { return std::make_shared<keel::memory_store>(clock); },
//       .advance = [&](keel::duration d) { clock.advance(d); },
//       .step_back = [&](keel::duration d) { clock.set(clock.now() - d); },
//   };
//   keel::testing::conformance_report r = keel::testing::run_store_conformance(h);
//   if (!r.ok()) std::fputs(r.summary().c_str(), stderr);
//
// With Catch2, one SECTION per check:
//
//   for (const std::string& name : keel::testing::conformance_checks<Store>())
//     SECTION(name) {
//       auto r = keel::testing::run_store_conformance(h, name);
//       for (const auto& f : r.failures) FAIL_CHECK(f.check << " (line " << f.line << "): " << f.message);
//       CHECK(r.passed.size() == 1);
//     }
//
// Harness fields:
//   make       required: a new, empty store on every call (a new file, schema
//              or key prefix). Checks never share a store.
//   advance    required: moves the store's clock forward (an injected clock,
//              or a test-only offset added to a server's clock).
//   step_back  optional: moves it backwards; the clock-step checks are
//              skipped (reported in `skipped`) without it.
//   peer       optional: another handle (connection, client) on the same
//              data as the store given; cross-handle checks need it.
//   purge      optional: makes the store forget what it may forget —
//              purge_expired(), or, for a store that forgets by itself
//              (Redis keys expiring forget_after after they end), deleting
//              what it would delete. The fence checks call it only when
//              everything in the store has ended (expired or released);
//              they are skipped without it.
//   server_clock  true when the store's time is a database server's clock
//              read inside each statement or script (PostgreSQL, Redis), with
//              step_back moving a test offset added to it. See
//              `server_clock_reason` for the one check this skips and why.
//   threads    how many threads race in the concurrency checks.
//   slack      how far a reported remaining time may fall short of the exact
//              value (server clocks keep moving while a check runs).
//
// Thread-safety: run one suite at a time per harness; the suite itself starts
// threads (and joins them) in the concurrency checks.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <latch>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "keel/core/call.hpp"
#include "keel/core/clock.hpp"
#include "keel/durable/digest.hpp"
#include "keel/durable/lease.hpp"
#include "keel/durable/once.hpp"
#include "keel/durable/ownership.hpp"
#include "keel/durable/result_store.hpp"

namespace keel::testing {

template <class Store>
struct store_harness {
  std::function<std::shared_ptr<Store>()> make;
  std::function<void(duration)> advance;
  std::function<void(duration)> step_back{};
  std::function<std::shared_ptr<Store>(Store&)> peer{};
  std::function<void(Store&)> purge{};
  bool server_clock = false;
  // The store gives each new owner the previous fence + 1. False for a
  // store whose fences come from a clock (keel's Redis and PostgreSQL
  // stores with fences = from_clock): a new owner's fence is then only
  // checked to be above the previous one.
  bool dense_fences = true;
  int threads = 8;
  duration slack = std::chrono::seconds(1);
};

// The fence a new owner gets after `prev`: prev + 1, or above it when the
// harness says the store's fences are not dense.
template <class H>
[[nodiscard]] bool next_fence(const H& h, std::int64_t prev, std::int64_t next) noexcept {
  return h.dense_fences ? next == prev + 1 : next > prev;
}

struct conformance_failure {
  std::string check{};
  std::string message{};
  int line = 0;  // in store_conformance.hpp
};

struct conformance_report {
  std::vector<std::string> passed{};
  std::vector<std::string> skipped{};  // "name: why"
  std::vector<conformance_failure> failures{};

  [[nodiscard]] bool ok() const noexcept { return failures.empty(); }
  [[nodiscard]] std::string summary() const {
    std::ostringstream out;
    out << "store conformance: " << passed.size() << " checks passed, " << failures.size() << " failures, "
        << skipped.size() << " skipped\n";
    for (const auto& f : failures) out << "  FAIL " << f.check << " (line " << f.line << "): " << f.message << "\n";
    for (const auto& s : skipped) out << "  skip " << s << "\n";
    return out.str();
  }
};

// Why a server-clock store skips "... while the clock is behind keeps its
// whole lease/term when it catches up": the SQLite store (and the memory
// store) keep a high-water mark of the time they have used and grant from
// it, so a lease granted while the clock is behind ends no earlier than it
// would have. A store whose time is the server's clock (PostgreSQL
// clock_timestamp(), Redis TIME) keeps no such mark: it would be one row or
// key every statement of every replica reads and writes (a hot spot, and in
// a Redis Cluster a key in another slot than the script's one key). So a
// lease granted while the server's clock is behind ends early once the
// clock is corrected, exactly as if the clock had been stepped forward. What
// protects the work then is fencing, which these stores pass: whoever takes
// over gets the next fence and the early-expired holder's writes are
// refused ("a clock stepping backwards lets no second owner in", "after
// expiry one claimant takes over with a higher fence"), and run_leased
// checks the result store before running the unit again. Keep such servers'
// clocks slewed by NTP, not stepped.
inline constexpr std::string_view server_clock_reason =
    "the store's time is a database server's clock with no high-water mark (a hot row/key for every replica); a "
    "lease granted while it is behind ends early once it is corrected, as after a forward step, and the fence "
    "refuses the early-expired holder (see server_clock_reason in keel/testing/store_conformance.hpp)";

namespace detail::conformance {

struct abort_check {};  // thrown by REQUIRE to end one check

class context {
 public:
  explicit context(std::string check) : check_(std::move(check)) {}
  bool expect(bool ok, std::string_view what, int line) {
    if (!ok) failures_.push_back({check_, std::string(what), line});
    return ok;
  }
  void require(bool ok, std::string_view what, int line) {
    if (!expect(ok, what, line)) throw abort_check{};
  }
  [[nodiscard]] std::vector<conformance_failure>& failures() noexcept { return failures_; }

 private:
  std::string check_;
  std::vector<conformance_failure> failures_;
};

inline std::string show(const absl::Status& s) { return s.ok() ? "OK" : s.ToString(); }
template <class T>
std::string show(const absl::StatusOr<T>& s) {
  return show(s.status());
}
inline std::string show(begin_state s) { return std::string(to_string(s)); }
inline std::string show(duration d) { return keel::detail::describe(d); }

// Fixed test data.
inline digest digest_of(std::string_view s) { return digest_builder().field("request", s).finish(); }
inline const std::string& binary_bytes() {
  static const std::string b = [] {
    std::string s;
    for (int i = 0; i < 256; ++i) s.push_back(static_cast<char>(i));
    s += std::string("\0\0end\0", 6);
    return s;
  }();
  return b;
}
inline decision sample_decision(std::string id, std::string result = "approve") {
  return decision{.id = std::move(id),
                  .model_digest = "m-large@sha256:1f0c",
                  .policy_revision = "rev-1",
                  .result = std::move(result)};
}

// What a check needs beyond a fresh store and a clock that moves forward;
// a harness that lacks it skips the check (reported in `skipped`).
struct check_needs {
  bool step_back = false;   // the harness's step_back
  bool peer = false;        // the harness's peer
  bool purge = false;       // the harness's purge
  bool high_water = false;  // a store that keeps a high-water mark of its time (not server_clock)
};

template <class Store>
struct check {
  std::string name;
  check_needs needs;
  std::function<void(context&, const store_harness<Store>&)> run;
};

}  // namespace detail::conformance

// Expectation macros used only in this header (undefined at its end).
#define KEEL_CONFORM_EXPECT(cond, msg) ctx.expect(static_cast<bool>(cond), ::absl::StrCat(#cond, " -- ", msg), __LINE__)
#define KEEL_CONFORM_REQUIRE(cond, msg) ctx.require(static_cast<bool>(cond), ::absl::StrCat(#cond, " -- ", msg), __LINE__)

namespace detail::conformance {

// Adds a named check to a suite's list, under the suite's area ("lease: ").
template <class Store>
struct check_list {
  std::vector<check<Store>>& v;
  std::string_view area;
  void operator()(std::string_view name, std::function<void(context&, const store_harness<Store>&)> fn,
                  check_needs n = {}) const {
    v.push_back({std::string(area).append(name), n, std::move(fn)});
  }
};

// What the idempotency checks share: one identity, the begin options and
// two receipts with different contents.
struct idempotency_inputs {
  begin_options bo{.lease = std::chrono::seconds(10), .retention = std::chrono::seconds(60)};
  request_identity id{.tenant = "merchant-82", .endpoint = "receipts", .key = "key-47"};
  digest receipt_a = digest_of("receipt-A");
  digest receipt_b = digest_of("receipt-B");
};

// Inputs are validated.
template <class Store>
void idempotency_input_checks(const check_list<Store>& add,
    [[maybe_unused]] const begin_options bo,
    [[maybe_unused]] const request_identity id,
    [[maybe_unused]] const digest receipt_a,
    [[maybe_unused]] const digest receipt_b) {
  using H = store_harness<Store>;
  using std::chrono::hours;
  using std::chrono::seconds;

  add("identity parts are validated", [=](context& ctx, const H& h) {
    auto s = h.make();
    const std::string long_part(256, 'k');
    const std::string bads[] = {"", long_part, "a\nb", std::string("a\0b", 3), "\x7f", "tab\there"};
    for (int part = 0; part < 3; ++part) {
      for (const std::string& bad : bads) {
        request_identity r = id;
        (part == 0 ? r.tenant : part == 1 ? r.endpoint : r.key) = bad;
        const std::string_view name = part == 0 ? "tenant" : part == 1 ? "endpoint" : "idempotency key";
        auto b = s->begin(r, receipt_a, owner_id::random(), bo);
        KEEL_CONFORM_EXPECT(b.status().code() == absl::StatusCode::kInvalidArgument, show(b));
        KEEL_CONFORM_EXPECT(b.status().message().find(keel::detail::to_absl(name)) != absl::string_view::npos,
                            show(b));
        const ownership t{owner_id::random(), 1};
        KEEL_CONFORM_EXPECT(s->commit(r, t, sample_decision("d"), seconds(60)).code() ==
                                absl::StatusCode::kInvalidArgument,
                            "commit with an invalid identity");
        KEEL_CONFORM_EXPECT(s->extend(r, t, seconds(5)).code() == absl::StatusCode::kInvalidArgument,
                            "extend with an invalid identity");
        KEEL_CONFORM_EXPECT(s->abandon(r, t).code() == absl::StatusCode::kInvalidArgument,
                            "abandon with an invalid identity");
      }
    }
    request_identity longest = id;
    const std::string k255(255, 'k');
    longest.key = k255;
    auto ok = s->begin(longest, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_EXPECT(ok.ok() && ok->state == begin_state::claimed, show(ok));
  });

  add("begin options, owners, durations and decisions are validated", [=](context& ctx, const H& h) {
    auto s = h.make();
    const owner_id me = owner_id::random();
    for (const begin_options& bad : {begin_options{.lease = duration::zero(), .retention = seconds(60)},
                                     begin_options{.lease = seconds(10), .retention = seconds(10)},
                                     begin_options{.lease = -seconds(1), .retention = seconds(60)}}) {
      auto b = s->begin(id, receipt_a, me, bad);
      KEEL_CONFORM_EXPECT(b.status().code() == absl::StatusCode::kInvalidArgument, show(b));
    }
    auto nil = s->begin(id, receipt_a, owner_id{}, bo);
    KEEL_CONFORM_EXPECT(nil.status().code() == absl::StatusCode::kInvalidArgument, "nil owner: " + show(nil));
    auto b = s->begin(id, receipt_a, me, bo);
    KEEL_CONFORM_REQUIRE(b.ok() && b->state == begin_state::claimed, show(b));
    KEEL_CONFORM_EXPECT(b->ownership.fence >= 1 && !b->took_over, b->ownership.fence);
    KEEL_CONFORM_EXPECT(s->commit(id, b->ownership, sample_decision(""), seconds(60)).code() ==
                            absl::StatusCode::kInvalidArgument,
                        "empty decision id");
    KEEL_CONFORM_EXPECT(s->commit(id, b->ownership, sample_decision("d\n1"), seconds(60)).code() ==
                            absl::StatusCode::kInvalidArgument,
                        "control character in decision id");
    decision long_model = sample_decision("d-1");
    long_model.model_digest = std::string(256, 'm');
    KEEL_CONFORM_EXPECT(s->commit(id, b->ownership, long_model, seconds(60)).code() ==
                            absl::StatusCode::kInvalidArgument,
                        "model digest over 255 bytes");
    KEEL_CONFORM_EXPECT(s->commit(id, b->ownership, sample_decision("d-1"), duration::zero()).code() ==
                            absl::StatusCode::kInvalidArgument,
                        "zero retention");
    KEEL_CONFORM_EXPECT(s->extend(id, b->ownership, duration::zero()).code() == absl::StatusCode::kInvalidArgument,
                        "zero extension");
    // The refused commits changed nothing: the record is still in flight for its holder.
    auto again = s->begin(id, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_EXPECT(again.ok() && again->state == begin_state::in_flight, show(again));
    KEEL_CONFORM_EXPECT(s->commit(id, b->ownership, sample_decision("d-1"), seconds(60)).ok(), "valid commit");
  });
}

// Claims, conflicts, replays and retention.
template <class Store>
void idempotency_claim_checks(const check_list<Store>& add,
    [[maybe_unused]] const begin_options bo,
    [[maybe_unused]] const request_identity id,
    [[maybe_unused]] const digest receipt_a,
    [[maybe_unused]] const digest receipt_b) {
  using H = store_harness<Store>;
  using std::chrono::hours;
  using std::chrono::seconds;

  add("a new key is claimed; a duplicate sees it in flight with the time left", [=](context& ctx, const H& h) {
    auto s = h.make();
    auto a = s->begin(id, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_REQUIRE(a.ok() && a->state == begin_state::claimed, show(a));
    KEEL_CONFORM_EXPECT(a->ownership.fence >= 1, a->ownership.fence);
    KEEL_CONFORM_EXPECT(!a->took_over && !a->superseded, "fresh claim");
    KEEL_CONFORM_EXPECT(a->lease_remaining == bo.lease, show(a->lease_remaining));
    auto b = s->begin(id, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_REQUIRE(b.ok() && b->state == begin_state::in_flight, show(b));
    KEEL_CONFORM_EXPECT(b->ownership.fence == a->ownership.fence, b->ownership.fence);
    KEEL_CONFORM_EXPECT(b->ownership.owner.is_nil(), "the holder's owner is not disclosed");
    KEEL_CONFORM_EXPECT(b->lease_remaining <= bo.lease && b->lease_remaining >= bo.lease - h.slack,
                        show(b->lease_remaining));
    h.advance(seconds(4));
    auto c = s->begin(id, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_REQUIRE(c.ok() && c->state == begin_state::in_flight, show(c));
    KEEL_CONFORM_EXPECT(c->lease_remaining <= seconds(6) && c->lease_remaining >= seconds(6) - h.slack,
                        show(c->lease_remaining));
  });

  add("same key, other contents: conflict while in flight and after commit", [=](context& ctx, const H& h) {
    auto s = h.make();
    auto a = s->begin(id, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_REQUIRE(a.ok() && a->state == begin_state::claimed, show(a));
    auto x = s->begin(id, receipt_b, owner_id::random(), bo);
    KEEL_CONFORM_REQUIRE(x.ok(), show(x));
    KEEL_CONFORM_EXPECT(x->state == begin_state::conflict, show(x->state));
    KEEL_CONFORM_EXPECT(x->conflict_in_flight, "conflict with a request in flight");
    h.advance(seconds(11));  // the lease lapsed: still a conflict, not a takeover
    auto y = s->begin(id, receipt_b, owner_id::random(), bo);
    KEEL_CONFORM_EXPECT(y.ok() && y->state == begin_state::conflict, show(y));
    KEEL_CONFORM_REQUIRE(s->commit(id, a->ownership, sample_decision("d-1"), seconds(60)).ok(), "commit");
    auto z = s->begin(id, receipt_b, owner_id::random(), bo);
    KEEL_CONFORM_REQUIRE(z.ok(), show(z));
    KEEL_CONFORM_EXPECT(z->state == begin_state::conflict, show(z->state));
    KEEL_CONFORM_EXPECT(!z->conflict_in_flight, "conflict with a committed decision");
    // The conflicting begins changed nothing.
    auto r = s->begin(id, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_EXPECT(r.ok() && r->state == begin_state::replay && r->decision.id == "d-1", show(r));
  });

  add("a committed decision is replayed byte for byte", [=](context& ctx, const H& h) {
    auto s = h.make();
    auto a = s->begin(id, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_REQUIRE(a.ok() && a->state == begin_state::claimed, show(a));
    decision d = sample_decision("dec-47", binary_bytes() + std::string(256 * 1024, 'r'));
    d.model_digest = "m-large@sha256:\xc3\xa9";
    KEEL_CONFORM_REQUIRE(s->commit(id, a->ownership, d, seconds(60)).ok(), "commit");
    h.advance(seconds(30));
    auto r1 = s->begin(id, receipt_a, owner_id::random(), bo);
    auto r2 = s->begin(id, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_REQUIRE(r1.ok() && r1->state == begin_state::replay, show(r1));
    KEEL_CONFORM_REQUIRE(r2.ok() && r2->state == begin_state::replay, show(r2));
    KEEL_CONFORM_EXPECT(r1->decision == d, "stored decision differs from the committed one");
    KEEL_CONFORM_EXPECT(r1->decision.result.size() == d.result.size(), r1->decision.result.size());
    KEEL_CONFORM_EXPECT(r1->ownership.fence == a->ownership.fence, r1->ownership.fence);
    KEEL_CONFORM_EXPECT(r1->committed_at_ns != 0 && r1->committed_at_ns == r2->committed_at_ns,
                        absl::StrCat(r1->committed_at_ns, " vs ", r2->committed_at_ns));
    KEEL_CONFORM_EXPECT(!r1->decision.failed(), "a decision, not a failure");
  });

  add("commit restarts the retention; a record past retention is gone", [=](context& ctx, const H& h) {
    auto s = h.make();
    auto a = s->begin(id, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_REQUIRE(a.ok() && a->state == begin_state::claimed, show(a));
    h.advance(seconds(50));
    KEEL_CONFORM_REQUIRE(s->commit(id, a->ownership, sample_decision("d-1"), seconds(60)).ok(), "commit");
    h.advance(seconds(50));  // 100 s after the claim, 50 s after the commit
    auto r = s->begin(id, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_EXPECT(r.ok() && r->state == begin_state::replay, show(r));
    h.advance(seconds(11));  // 61 s after the commit
    auto n = s->begin(id, receipt_b, owner_id::random(), bo);
    KEEL_CONFORM_REQUIRE(n.ok(), show(n));
    KEEL_CONFORM_EXPECT(n->state == begin_state::claimed, "an expired record is gone: " + show(n->state));
    KEEL_CONFORM_EXPECT(!n->took_over, "an expired record is not a takeover");
  });

  add("a repeated commit is OK and keeps the first decision", [=](context& ctx, const H& h) {
    auto s = h.make();
    auto a = s->begin(id, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_REQUIRE(a.ok() && a->state == begin_state::claimed, show(a));
    KEEL_CONFORM_REQUIRE(s->commit(id, a->ownership, sample_decision("d-1", "first"), seconds(60)).ok(), "commit");
    const absl::Status again = s->commit(id, a->ownership, sample_decision("d-2", "second"), seconds(60));
    KEEL_CONFORM_EXPECT(again.ok(), show(again));
    auto r = s->begin(id, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_EXPECT(r.ok() && r->state == begin_state::replay && r->decision.id == "d-1" &&
                            r->decision.result == "first",
                        show(r));
  });
}

// Who may commit: owners, fences, takeovers, expiry.
template <class Store>
void idempotency_ownership_checks(const check_list<Store>& add,
    [[maybe_unused]] const begin_options bo,
    [[maybe_unused]] const request_identity id,
    [[maybe_unused]] const digest receipt_a,
    [[maybe_unused]] const digest receipt_b) {
  using H = store_harness<Store>;
  using std::chrono::hours;
  using std::chrono::seconds;

  add("wrong owner or wrong fence: lost ownership, nothing changes", [=](context& ctx, const H& h) {
    auto s = h.make();
    auto a = s->begin(id, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_REQUIRE(a.ok() && a->state == begin_state::claimed, show(a));
    const ownership wrong_owner{owner_id::random(), a->ownership.fence};
    const ownership wrong_fence{a->ownership.owner, a->ownership.fence + 1};
    for (const ownership& t : {wrong_owner, wrong_fence}) {
      const absl::Status c = s->commit(id, t, sample_decision("forged"), seconds(60));
      KEEL_CONFORM_EXPECT(keel::is_lost_ownership(c), show(c));
      KEEL_CONFORM_EXPECT(c.code() == absl::StatusCode::kFailedPrecondition, show(c));
      KEEL_CONFORM_EXPECT(keel::is_lost_ownership(s->extend(id, t, seconds(5))), "extend");
      KEEL_CONFORM_EXPECT(keel::is_lost_ownership(s->abandon(id, t)), "abandon");
    }
    auto b = s->begin(id, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_EXPECT(b.ok() && b->state == begin_state::in_flight, show(b));
    KEEL_CONFORM_EXPECT(s->commit(id, a->ownership, sample_decision("d-1"), seconds(60)).ok(), "holder commit");
    const absl::Status late = s->commit(id, wrong_owner, sample_decision("forged"), seconds(60));
    KEEL_CONFORM_EXPECT(keel::is_lost_ownership(late), show(late));
    auto r = s->begin(id, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_EXPECT(r.ok() && r->state == begin_state::replay && r->decision.id == "d-1", show(r));
    // Operations on a key never claimed are lost ownership too.
    const request_identity other{.tenant = "merchant-82", .endpoint = "receipts", .key = "never-claimed"};
    KEEL_CONFORM_EXPECT(keel::is_lost_ownership(s->commit(other, a->ownership, sample_decision("x"), seconds(60))),
                        "commit on an unknown key");
  });

  add("after the lease expires, one claimant takes over with a higher fence; the old owner is refused",
      [=](context& ctx, const H& h) {
        auto s = h.make();
        auto a = s->begin(id, receipt_a, owner_id::random(), bo);
        KEEL_CONFORM_REQUIRE(a.ok() && a->state == begin_state::claimed, show(a));
        h.advance(seconds(9));
        auto still = s->begin(id, receipt_a, owner_id::random(), bo);
        KEEL_CONFORM_EXPECT(still.ok() && still->state == begin_state::in_flight, show(still));
        h.advance(seconds(2));
        auto b = s->begin(id, receipt_a, owner_id::random(), bo);
        KEEL_CONFORM_REQUIRE(b.ok() && b->state == begin_state::claimed, show(b));
        KEEL_CONFORM_EXPECT(b->took_over, "took_over");
        KEEL_CONFORM_EXPECT(next_fence(h, a->ownership.fence, b->ownership.fence), b->ownership.fence);
        KEEL_CONFORM_EXPECT(keel::is_lost_ownership(s->commit(id, a->ownership, sample_decision("old"), seconds(60))),
                            "the old owner's late commit");
        KEEL_CONFORM_EXPECT(keel::is_lost_ownership(s->extend(id, a->ownership, seconds(5))), "old extend");
        KEEL_CONFORM_EXPECT(keel::is_lost_ownership(s->abandon(id, a->ownership)), "old abandon");
        auto c = s->begin(id, receipt_a, owner_id::random(), bo);
        KEEL_CONFORM_EXPECT(c.ok() && c->state == begin_state::in_flight && c->ownership.fence == b->ownership.fence,
                            show(c));
        KEEL_CONFORM_REQUIRE(s->commit(id, b->ownership, sample_decision("new"), seconds(60)).ok(), "new commit");
        auto r = s->begin(id, receipt_a, owner_id::random(), bo);
        KEEL_CONFORM_EXPECT(r.ok() && r->state == begin_state::replay && r->decision.id == "new" &&
                                r->ownership.fence == b->ownership.fence,
                            show(r));
      });

  add("a lapsed lease nobody took over still commits", [=](context& ctx, const H& h) {
    auto s = h.make();
    auto a = s->begin(id, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_REQUIRE(a.ok() && a->state == begin_state::claimed, show(a));
    h.advance(seconds(30));
    const absl::Status c = s->commit(id, a->ownership, sample_decision("late"), seconds(60));
    KEEL_CONFORM_EXPECT(c.ok(), show(c));
    auto r = s->begin(id, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_EXPECT(r.ok() && r->state == begin_state::replay && r->decision.id == "late", show(r));
  });

  add("a record expiring between claim and commit is detected", [=](context& ctx, const H& h) {
    auto s = h.make();
    auto a = s->begin(id, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_REQUIRE(a.ok() && a->state == begin_state::claimed, show(a));
    h.advance(seconds(61));  // past the record's retention, nobody else came
    const absl::Status c = s->commit(id, a->ownership, sample_decision("too-late"), seconds(60));
    KEEL_CONFORM_EXPECT(keel::is_lost_ownership(c), show(c));
    auto b = s->begin(id, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_EXPECT(b.ok() && b->state == begin_state::claimed && !b->took_over, show(b));
  });
}

// A claim's lease: extended, abandoned, begun again.
template <class Store>
void idempotency_lease_checks(const check_list<Store>& add,
    [[maybe_unused]] const begin_options bo,
    [[maybe_unused]] const request_identity id,
    [[maybe_unused]] const digest receipt_a,
    [[maybe_unused]] const digest receipt_b) {
  using H = store_harness<Store>;
  using std::chrono::hours;
  using std::chrono::seconds;

  add("extend lengthens the lease, never shortens it, and only for the holder", [=](context& ctx, const H& h) {
    auto s = h.make();
    auto a = s->begin(id, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_REQUIRE(a.ok() && a->state == begin_state::claimed, show(a));
    h.advance(seconds(8));
    KEEL_CONFORM_REQUIRE(s->extend(id, a->ownership, seconds(20)).ok(), "extend");   // until 28
    KEEL_CONFORM_REQUIRE(s->extend(id, a->ownership, seconds(1)).ok(), "shorter extend");  // still 28
    h.advance(seconds(15));  // 23
    auto b = s->begin(id, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_REQUIRE(b.ok() && b->state == begin_state::in_flight, show(b));
    KEEL_CONFORM_EXPECT(b->lease_remaining <= seconds(5) && b->lease_remaining >= seconds(5) - h.slack,
                        show(b->lease_remaining));
    KEEL_CONFORM_EXPECT(keel::is_lost_ownership(s->extend(id, {owner_id::random(), 1}, seconds(60))),
                        "a non-holder's extend");
    h.advance(seconds(6));  // 29
    auto c = s->begin(id, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_EXPECT(c.ok() && c->state == begin_state::claimed && c->took_over &&
                            next_fence(h, a->ownership.fence, c->ownership.fence),
                        show(c));
  });

  add("abandon frees the key for a fresh claim with a higher fence", [=](context& ctx, const H& h) {
    auto s = h.make();
    auto a = s->begin(id, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_REQUIRE(a.ok() && a->state == begin_state::claimed, show(a));
    KEEL_CONFORM_REQUIRE(s->abandon(id, a->ownership).ok(), "abandon");
    KEEL_CONFORM_EXPECT(s->abandon(id, a->ownership).ok(), "a repeated abandon is OK");
    KEEL_CONFORM_EXPECT(keel::is_lost_ownership(s->commit(id, a->ownership, sample_decision("x"), seconds(60))),
                        "commit after abandon");
    // Abandoned is absent: even other contents may claim it.
    auto b = s->begin(id, receipt_b, owner_id::random(), bo);
    KEEL_CONFORM_REQUIRE(b.ok() && b->state == begin_state::claimed, show(b));
    KEEL_CONFORM_EXPECT(next_fence(h, a->ownership.fence, b->ownership.fence) && !b->took_over, show(b));
    KEEL_CONFORM_EXPECT(keel::is_lost_ownership(s->abandon(id, a->ownership)), "the old owner's abandon");
  });

  add("the holder beginning again gets the same claim", [=](context& ctx, const H& h) {
    auto s = h.make();
    const owner_id me = owner_id::random();
    auto a = s->begin(id, receipt_a, me, bo);
    KEEL_CONFORM_REQUIRE(a.ok() && a->state == begin_state::claimed, show(a));
    h.advance(seconds(5));
    auto again = s->begin(id, receipt_a, me, bo);
    KEEL_CONFORM_REQUIRE(again.ok() && again->state == begin_state::claimed, show(again));
    KEEL_CONFORM_EXPECT(again->ownership == a->ownership, again->ownership.fence);
    KEEL_CONFORM_EXPECT(!again->took_over, "not a takeover");
    h.advance(seconds(8));  // 13 s after the first claim, 8 s after the second
    auto other = s->begin(id, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_EXPECT(other.ok() && other->state == begin_state::in_flight, "the lease was extended: " + show(other));
  });
}

// What is stored: failures, policy revisions, identities kept apart.
template <class Store>
void idempotency_record_checks(const check_list<Store>& add,
    [[maybe_unused]] const begin_options bo,
    [[maybe_unused]] const request_identity id,
    [[maybe_unused]] const digest receipt_a,
    [[maybe_unused]] const digest receipt_b) {
  using H = store_harness<Store>;
  using std::chrono::hours;
  using std::chrono::seconds;

  add("a stored failure is replayed with its code and message", [=](context& ctx, const H& h) {
    auto s = h.make();
    auto a = s->begin(id, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_REQUIRE(a.ok() && a->state == begin_state::claimed, show(a));
    decision failed{.id = "dec-f", .policy_revision = "rev-1"};
    failed.error_code = absl::StatusCode::kPermissionDenied;
    failed.error_message = "credential revoked";
    KEEL_CONFORM_REQUIRE(s->commit(id, a->ownership, failed, seconds(60)).ok(), "commit failure");
    auto r = s->begin(id, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_REQUIRE(r.ok() && r->state == begin_state::replay, show(r));
    KEEL_CONFORM_EXPECT(r->decision.failed(), "a stored failure");
    KEEL_CONFORM_EXPECT(r->decision.error_code == absl::StatusCode::kPermissionDenied, show(r->decision.error()));
    KEEL_CONFORM_EXPECT(r->decision.error_message == "credential revoked", r->decision.error_message);
    KEEL_CONFORM_EXPECT(r->decision.id == "dec-f", r->decision.id);
  });

  add("a decision of another policy revision is superseded only when asked", [=](context& ctx, const H& h) {
    auto s = h.make();
    auto a = s->begin(id, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_REQUIRE(a.ok() && a->state == begin_state::claimed, show(a));
    KEEL_CONFORM_REQUIRE(s->commit(id, a->ownership, sample_decision("d-r1"), seconds(60)).ok(), "commit");
    begin_options same = bo;
    same.supersede_revision = "rev-1";
    auto r = s->begin(id, receipt_a, owner_id::random(), same);
    KEEL_CONFORM_EXPECT(r.ok() && r->state == begin_state::replay, "same revision replays: " + show(r));
    auto plain = s->begin(id, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_EXPECT(plain.ok() && plain->state == begin_state::replay, "no supersede: " + show(plain));
    begin_options newer = bo;
    newer.supersede_revision = "rev-2";
    auto x = s->begin(id, receipt_b, owner_id::random(), newer);
    KEEL_CONFORM_EXPECT(x.ok() && x->state == begin_state::conflict, "other contents still conflict: " + show(x));
    auto b = s->begin(id, receipt_a, owner_id::random(), newer);
    KEEL_CONFORM_REQUIRE(b.ok() && b->state == begin_state::claimed, show(b));
    KEEL_CONFORM_EXPECT(b->superseded && !b->took_over && next_fence(h, a->ownership.fence, b->ownership.fence), show(b));
    auto c = s->begin(id, receipt_a, owner_id::random(), newer);
    KEEL_CONFORM_EXPECT(c.ok() && c->state == begin_state::in_flight, show(c));
    KEEL_CONFORM_EXPECT(keel::is_lost_ownership(s->commit(id, a->ownership, sample_decision("old"), seconds(60))),
                        "the superseded owner");
    decision d2 = sample_decision("d-r2");
    d2.policy_revision = "rev-2";
    KEEL_CONFORM_REQUIRE(s->commit(id, b->ownership, d2, seconds(60)).ok(), "commit r2");
    auto r2 = s->begin(id, receipt_a, owner_id::random(), newer);
    KEEL_CONFORM_EXPECT(r2.ok() && r2->state == begin_state::replay && r2->decision.id == "d-r2", show(r2));
  });

  add("identity parts are kept apart: separators cannot make two identities one", [=](context& ctx, const H& h) {
    auto s = h.make();
    const request_identity ids[] = {
        {"a/b", "c", "d"}, {"a", "b/c", "d"}, {"a", "b", "c/d"}, {"a:b", "c", "d"}, {"a", "b:c", "d"},
        {"a", "b", "c:d"}, {"a|b", "c", "d"}, {"a", "b|c", "d"}, {"ab", "c", "d"}, {"a", "bc", "d"},
        {"other-tenant", "receipts", "key-47"}, {"merchant-82", "other-endpoint", "key-47"}, id};
    for (const request_identity& r : ids) {
      auto b = s->begin(r, receipt_a, owner_id::random(), bo);
      KEEL_CONFORM_EXPECT(b.ok() && b->state == begin_state::claimed && !b->took_over,
                          absl::StrCat(keel::detail::to_absl(r.tenant), " | ", keel::detail::to_absl(r.endpoint),
                                       " | ", keel::detail::to_absl(r.key), ": ", show(b)));
    }
    const request_identity utf8{"t\xc3\xa9nant", "\xe6\x94\xb6\xe6\x8d\xae", "cl\xc3\xa9"};
    auto u = s->begin(utf8, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_REQUIRE(u.ok() && u->state == begin_state::claimed, show(u));
    KEEL_CONFORM_REQUIRE(s->commit(utf8, u->ownership, sample_decision("d-utf8"), seconds(60)).ok(), "commit");
    auto r = s->begin(utf8, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_EXPECT(r.ok() && r->state == begin_state::replay && r->decision.id == "d-utf8", show(r));
  });
}

// Threads racing for one key.
template <class Store>
void idempotency_race_checks(const check_list<Store>& add,
    [[maybe_unused]] const begin_options bo,
    [[maybe_unused]] const request_identity id,
    [[maybe_unused]] const digest receipt_a,
    [[maybe_unused]] const digest receipt_b) {
  using H = store_harness<Store>;
  using std::chrono::hours;
  using std::chrono::seconds;

  add("N threads begin one key at once: exactly one claim", [=](context& ctx, const H& h) {
    auto s = h.make();
    const int n = h.threads;
    std::vector<std::shared_ptr<Store>> handles(n, s);
    if (h.peer)
      for (int i = 1; i < n; i += 2) handles[i] = h.peer(*s);
    std::vector<absl::StatusOr<begin_outcome>> got(n, absl::UnknownError("not run"));
    std::latch start(n);
    {
      std::vector<std::jthread> threads;
      for (int i = 0; i < n; ++i)
        threads.emplace_back([&, i] {
          start.arrive_and_wait();
          got[i] = handles[i]->begin(id, receipt_a, owner_id::random(), bo);
        });
    }
    int claimed = 0, in_flight = 0;
    std::int64_t fence = 0;  // the winner's; everyone sees it
    for (const auto& g : got)
      if (g.ok() && g->state == begin_state::claimed) fence = g->ownership.fence;
    for (const auto& g : got) {
      KEEL_CONFORM_EXPECT(g.ok(), show(g));
      if (!g.ok()) continue;
      if (g->state == begin_state::claimed) ++claimed;
      if (g->state == begin_state::in_flight) ++in_flight;
      KEEL_CONFORM_EXPECT(g->ownership.fence == fence && fence >= 1, g->ownership.fence);
    }
    KEEL_CONFORM_EXPECT(claimed == 1, claimed);
    KEEL_CONFORM_EXPECT(in_flight == n - 1, in_flight);
  });

  add("N threads race to take over an expired claim: exactly one wins, with the next fence", [=](context& ctx, const H& h) {
    auto s = h.make();
    auto a = s->begin(id, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_REQUIRE(a.ok() && a->state == begin_state::claimed, show(a));
    h.advance(seconds(11));
    const int n = h.threads;
    std::vector<std::shared_ptr<Store>> handles(n, s);
    if (h.peer)
      for (int i = 1; i < n; i += 2) handles[i] = h.peer(*s);
    std::vector<absl::StatusOr<begin_outcome>> got(n, absl::UnknownError("not run"));
    std::latch start(n);
    {
      std::vector<std::jthread> threads;
      for (int i = 0; i < n; ++i)
        threads.emplace_back([&, i] {
          start.arrive_and_wait();
          got[i] = handles[i]->begin(id, receipt_a, owner_id::random(), bo);
        });
    }
    int claimed = 0;
    for (const auto& g : got) {
      KEEL_CONFORM_EXPECT(g.ok(), show(g));
      if (!g.ok()) continue;
      if (g->state == begin_state::claimed) {
        ++claimed;
        KEEL_CONFORM_EXPECT(g->took_over && next_fence(h, a->ownership.fence, g->ownership.fence), g->ownership.fence);
      } else {
        KEEL_CONFORM_EXPECT(g->state == begin_state::in_flight && next_fence(h, a->ownership.fence, g->ownership.fence),
                            show(g->state));
      }
    }
    KEEL_CONFORM_EXPECT(claimed == 1, claimed);
  });
}

// Keel::once over the store, and a second handle.
template <class Store>
void idempotency_once_checks(const check_list<Store>& add,
    [[maybe_unused]] const begin_options bo,
    [[maybe_unused]] const request_identity id,
    [[maybe_unused]] const digest receipt_a,
    [[maybe_unused]] const digest receipt_b) {
  using H = store_harness<Store>;
  using std::chrono::hours;
  using std::chrono::seconds;

  add("keel::once: concurrent duplicates make one provider call and share one decision id",
      [=](context& ctx, const H& h) {
        auto s = h.make();
        const int n = h.threads;
        std::vector<std::shared_ptr<Store>> handles(n, s);
        if (h.peer)
          for (int i = 1; i < n; i += 2) handles[i] = h.peer(*s);
        std::atomic<int> calls{0};
        std::vector<absl::StatusOr<once_result>> got(n, absl::UnknownError("not run"));
        std::latch start(n);
        {
          std::vector<std::jthread> threads;
          for (int i = 0; i < n; ++i)
            threads.emplace_back([&, i] {
              once<Store> decide(*handles[i], {.lease = std::chrono::seconds(30),
                                               .retention = std::chrono::hours(2),
                                               .retry_window = std::chrono::hours(1),
                                               .poll_initial = std::chrono::milliseconds(1),
                                               .poll_max = std::chrono::milliseconds(20)});
              keel::call call(real_clock{}.now(), {.timeout = std::chrono::seconds(30)});
              start.arrive_and_wait();
              got[i] = decide.run(call, id, receipt_a, [&](const claim_context&) -> absl::StatusOr<decision> {
                calls.fetch_add(1);
                std::this_thread::sleep_for(std::chrono::milliseconds(30));  // let the duplicates arrive
                return decision{.model_digest = "m-large", .result = "approve"};
              });
            });
        }
        KEEL_CONFORM_EXPECT(calls.load() == 1, calls.load());
        std::string first_id;
        int fresh = 0;
        for (const auto& g : got) {
          KEEL_CONFORM_EXPECT(g.ok(), show(g));
          if (!g.ok()) continue;
          if (first_id.empty()) first_id = g->decision.id;
          KEEL_CONFORM_EXPECT(g->decision.id == first_id, g->decision.id + " vs " + first_id);
          KEEL_CONFORM_EXPECT(g->decision.result == "approve", g->decision.result);
          if (!g->replayed) ++fresh;
        }
        KEEL_CONFORM_EXPECT(fresh == 1, fresh);
      });

  add("keel::once: a retry after a lost response returns the same decision id", [=](context& ctx, const H& h) {
    auto s = h.make();
    once<Store> decide(*s, {.lease = std::chrono::seconds(30), .retention = hours(2), .retry_window = hours(1)});
    int calls = 0;
    auto provider = [&](const claim_context&) -> absl::StatusOr<decision> {
      ++calls;
      return decision{.model_digest = "m-large", .result = "approve"};
    };
    keel::call first(real_clock{}.now(), {.timeout = std::chrono::seconds(5)});
    auto a = decide.run(first, id, receipt_a, provider);
    KEEL_CONFORM_REQUIRE(a.ok() && !a->replayed, show(a));
    // ... the response is lost on the way to the client, which retries:
    keel::call retry(real_clock{}.now(), {.timeout = std::chrono::seconds(5)});
    auto b = decide.run(retry, id, receipt_a, provider);
    KEEL_CONFORM_REQUIRE(b.ok(), show(b));
    KEEL_CONFORM_EXPECT(b->replayed && retry.record().replayed, "replayed");
    KEEL_CONFORM_EXPECT(b->decision.id == a->decision.id, b->decision.id + " vs " + a->decision.id);
    KEEL_CONFORM_EXPECT(calls == 1, calls);
  });

  add("a second handle sees the same records, and tokens work across handles", [=](context& ctx, const H& h) {
    auto s = h.make();
    auto p = h.peer(*s);
    auto a = s->begin(id, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_REQUIRE(a.ok() && a->state == begin_state::claimed, show(a));
    auto b = p->begin(id, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_EXPECT(b.ok() && b->state == begin_state::in_flight, show(b));
    KEEL_CONFORM_REQUIRE(p->commit(id, a->ownership, sample_decision("via-peer"), seconds(60)).ok(), "commit");
    auto r = s->begin(id, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_EXPECT(r.ok() && r->state == begin_state::replay && r->decision.id == "via-peer", show(r));
  }, {.peer = true});
}

// Clocks that step back, and fences after a purge.
template <class Store>
void idempotency_clock_checks(const check_list<Store>& add,
    [[maybe_unused]] const begin_options bo,
    [[maybe_unused]] const request_identity id,
    [[maybe_unused]] const digest receipt_a,
    [[maybe_unused]] const digest receipt_b) {
  using H = store_harness<Store>;
  using std::chrono::hours;
  using std::chrono::seconds;

  add("a clock stepping backwards lets no second owner in", [=](context& ctx, const H& h) {
    auto s = h.make();
    auto a = s->begin(id, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_REQUIRE(a.ok() && a->state == begin_state::claimed, show(a));
    h.advance(seconds(5));
    h.step_back(hours(1));
    auto b = s->begin(id, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_REQUIRE(b.ok() && b->state == begin_state::in_flight, show(b));
    KEEL_CONFORM_EXPECT(b->lease_remaining >= seconds(5) - h.slack, show(b->lease_remaining));
    // The holder extends while the clock is behind: that never shortens its lease.
    KEEL_CONFORM_EXPECT(s->extend(id, a->ownership, seconds(1)).ok(), "extend");
    h.advance(hours(1));  // back where it was: 5 s into a's lease
    auto b2 = s->begin(id, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_EXPECT(b2.ok() && b2->state == begin_state::in_flight, "a's lease: " + show(b2));
    h.advance(seconds(6));  // 11 s into a's lease
    auto t = s->begin(id, receipt_a, owner_id::random(), bo);
    KEEL_CONFORM_EXPECT(t.ok() && t->state == begin_state::claimed && t->took_over &&
                            next_fence(h, a->ownership.fence, t->ownership.fence),
                        show(t));
    KEEL_CONFORM_EXPECT(keel::is_lost_ownership(s->commit(id, a->ownership, sample_decision("old"), seconds(60))),
                        "the old owner");
  }, {.step_back = true});

  add("a claim made while the clock is behind keeps its whole lease when it catches up",
      [=](context& ctx, const H& h) {
        auto s = h.make();
        auto a = s->begin(id, receipt_a, owner_id::random(), bo);  // the store has seen the present
        KEEL_CONFORM_REQUIRE(a.ok() && a->state == begin_state::claimed, show(a));
        h.advance(seconds(5));
        h.step_back(hours(1));
        const request_identity other{.tenant = "merchant-82", .endpoint = "receipts", .key = "key-48"};
        auto c = s->begin(other, receipt_a, owner_id::random(), bo);
        KEEL_CONFORM_REQUIRE(c.ok() && c->state == begin_state::claimed, show(c));
        h.advance(hours(1));
        auto c2 = s->begin(other, receipt_a, owner_id::random(), bo);
        KEEL_CONFORM_EXPECT(c2.ok() && c2->state == begin_state::in_flight,
                            "the claim made while the clock was behind: " + show(c2));
      },
      {.step_back = true, .high_water = true});

  add("a fence never goes backwards: a record purged after it expired is claimed above every fence it had",
      [=](context& ctx, const H& h) {
        auto s = h.make();
        // Two takeovers: a and b are stale holders, c the last one.
        auto a = s->begin(id, receipt_a, owner_id::random(), bo);
        KEEL_CONFORM_REQUIRE(a.ok() && a->state == begin_state::claimed, show(a));
        h.advance(seconds(11));
        auto b = s->begin(id, receipt_a, owner_id::random(), bo);
        KEEL_CONFORM_REQUIRE(b.ok() && b->state == begin_state::claimed && b->took_over, show(b));
        h.advance(seconds(11));
        auto c = s->begin(id, receipt_a, owner_id::random(), bo);
        KEEL_CONFORM_REQUIRE(c.ok() && c->state == begin_state::claimed && c->took_over, show(c));
        // c is paused past its lease and the record's retention; the store forgets the record.
        h.advance(seconds(61));
        h.purge(*s);
        auto d = s->begin(id, receipt_a, owner_id::random(), bo);
        KEEL_CONFORM_REQUIRE(d.ok() && d->state == begin_state::claimed && !d->took_over, show(d));
        KEEL_CONFORM_EXPECT(d->ownership.fence > c->ownership.fence,
                            absl::StrCat("fence ", d->ownership.fence, " after purge, the paused holder has ",
                                         c->ownership.fence));
        for (const auto& stale : {a->ownership, b->ownership, c->ownership}) {
          KEEL_CONFORM_EXPECT(
              keel::is_lost_ownership(s->commit(id, stale, sample_decision("stale"), seconds(60))),
              absl::StrCat("a stale commit by fence ", stale.fence));
          KEEL_CONFORM_EXPECT(keel::is_lost_ownership(s->extend(id, stale, seconds(5))), "a stale extend");
          KEEL_CONFORM_EXPECT(keel::is_lost_ownership(s->abandon(id, stale)), "a stale abandon");
        }
        // A committed record purged after its retention, too.
        KEEL_CONFORM_REQUIRE(s->commit(id, d->ownership, sample_decision("d-1"), seconds(60)).ok(), "commit");
        h.advance(seconds(61));
        h.purge(*s);
        auto e = s->begin(id, receipt_a, owner_id::random(), bo);
        KEEL_CONFORM_REQUIRE(e.ok() && e->state == begin_state::claimed, show(e));
        KEEL_CONFORM_EXPECT(e->ownership.fence > d->ownership.fence,
                            absl::StrCat("fence ", e->ownership.fence, " after ", d->ownership.fence));
        KEEL_CONFORM_EXPECT(
            keel::is_lost_ownership(s->commit(id, d->ownership, sample_decision("stale"), seconds(60))),
            "the purged decision's owner");
        KEEL_CONFORM_EXPECT(s->commit(id, e->ownership, sample_decision("d-2"), seconds(60)).ok(), "new commit");
      },
      {.purge = true});
}
template <class Store>
std::vector<check<Store>> idempotency_checks() {
  std::vector<check<Store>> v;
  const check_list<Store> add{v, "idempotency: "};
  const idempotency_inputs in;
  idempotency_input_checks<Store>(add, in.bo, in.id, in.receipt_a, in.receipt_b);
  idempotency_claim_checks<Store>(add, in.bo, in.id, in.receipt_a, in.receipt_b);
  idempotency_ownership_checks<Store>(add, in.bo, in.id, in.receipt_a, in.receipt_b);
  idempotency_lease_checks<Store>(add, in.bo, in.id, in.receipt_a, in.receipt_b);
  idempotency_record_checks<Store>(add, in.bo, in.id, in.receipt_a, in.receipt_b);
  idempotency_race_checks<Store>(add, in.bo, in.id, in.receipt_a, in.receipt_b);
  idempotency_once_checks<Store>(add, in.bo, in.id, in.receipt_a, in.receipt_b);
  idempotency_clock_checks<Store>(add, in.bo, in.id, in.receipt_a, in.receipt_b);
  return v;
}

// What the lease checks share: one key and a lease's term.
struct lease_inputs {
  duration ttl = std::chrono::seconds(10);
  std::string_view key = "nightly-report";
};

// Validation, and a lease's whole life on one key.
template <class Store>
void lease_basic_checks(const check_list<Store>& add,
    [[maybe_unused]] const duration ttl,
    [[maybe_unused]] const std::string_view key) {
  using H = store_harness<Store>;
  using std::chrono::hours;
  using std::chrono::seconds;

  add("keys, ttls and owners are validated", [=](context& ctx, const H& h) {
    auto s = h.make();
    const std::string long_key(256, 'w');
    for (std::string_view bad : {std::string_view(""), std::string_view(long_key), std::string_view("a\nb")}) {
      auto c = s->claim(bad, owner_id::random(), ttl);
      KEEL_CONFORM_EXPECT(c.status().code() == absl::StatusCode::kInvalidArgument, show(c));
      KEEL_CONFORM_EXPECT(s->renew(bad, {owner_id::random(), 1}, ttl).code() == absl::StatusCode::kInvalidArgument,
                          "renew");
      KEEL_CONFORM_EXPECT(s->release(bad, {owner_id::random(), 1}).code() == absl::StatusCode::kInvalidArgument,
                          "release");
    }
    KEEL_CONFORM_EXPECT(s->claim(key, owner_id::random(), duration::zero()).status().code() ==
                            absl::StatusCode::kInvalidArgument,
                        "zero ttl");
    KEEL_CONFORM_EXPECT(s->claim(key, owner_id{}, ttl).status().code() == absl::StatusCode::kInvalidArgument,
                        "nil owner");
    auto c = s->claim(key, owner_id::random(), ttl);
    KEEL_CONFORM_REQUIRE(c.ok() && c->acquired, show(c));
    KEEL_CONFORM_EXPECT(!c->took_over && c->ownership.fence >= 1, "nothing was stored by the refused claims");
    KEEL_CONFORM_EXPECT(s->renew(key, c->ownership, duration::zero()).code() == absl::StatusCode::kInvalidArgument,
                        "zero renewal");
  });

  add("claim, held by another, renew, release, claim again with fence + 1", [=](context& ctx, const H& h) {
    auto s = h.make();
    const owner_id a = owner_id::random(), b = owner_id::random();
    auto ca = s->claim(key, a, ttl);
    KEEL_CONFORM_REQUIRE(ca.ok() && ca->acquired, show(ca));
    KEEL_CONFORM_EXPECT(ca->ownership.owner == a && ca->ownership.fence >= 1, ca->ownership.fence);
    KEEL_CONFORM_EXPECT(!ca->took_over && ca->remaining == ttl, show(ca->remaining));
    h.advance(seconds(3));
    auto cb = s->claim(key, b, ttl);
    KEEL_CONFORM_REQUIRE(cb.ok() && !cb->acquired, show(cb));
    KEEL_CONFORM_EXPECT(cb->ownership.fence == ca->ownership.fence && cb->ownership.owner.is_nil(),
                        cb->ownership.fence);
    KEEL_CONFORM_EXPECT(cb->remaining <= seconds(7) && cb->remaining >= seconds(7) - h.slack, show(cb->remaining));
    KEEL_CONFORM_EXPECT(s->renew(key, ca->ownership, ttl).ok(), "renew");
    KEEL_CONFORM_EXPECT(keel::is_lost_ownership(s->renew(key, {b, ca->ownership.fence}, ttl)), "a non-holder's renew");
    KEEL_CONFORM_EXPECT(keel::is_lost_ownership(s->release(key, {b, ca->ownership.fence})),
                        "a non-holder's release");
    KEEL_CONFORM_REQUIRE(s->release(key, ca->ownership).ok(), "release");
    KEEL_CONFORM_EXPECT(s->release(key, ca->ownership).ok(), "a repeated release");
    KEEL_CONFORM_EXPECT(keel::is_lost_ownership(s->renew(key, ca->ownership, ttl)), "renew after release");
    auto cb2 = s->claim(key, b, ttl);
    KEEL_CONFORM_REQUIRE(cb2.ok() && cb2->acquired, show(cb2));
    KEEL_CONFORM_EXPECT(next_fence(h, ca->ownership.fence, cb2->ownership.fence) && !cb2->took_over, cb2->ownership.fence);
    KEEL_CONFORM_EXPECT(keel::is_lost_ownership(s->release(key, ca->ownership)), "the old owner's release");
  });

  add("after expiry one claimant takes over with a higher fence; the old owner is refused",
      [=](context& ctx, const H& h) {
        auto s = h.make();
        auto a = s->claim(key, owner_id::random(), ttl);
        KEEL_CONFORM_REQUIRE(a.ok() && a->acquired, show(a));
        h.advance(seconds(9));
        auto early = s->claim(key, owner_id::random(), ttl);
        KEEL_CONFORM_EXPECT(early.ok() && !early->acquired, show(early));
        h.advance(seconds(2));
        auto b = s->claim(key, owner_id::random(), ttl);
        KEEL_CONFORM_REQUIRE(b.ok() && b->acquired, show(b));
        KEEL_CONFORM_EXPECT(b->took_over && next_fence(h, a->ownership.fence, b->ownership.fence), b->ownership.fence);
        KEEL_CONFORM_EXPECT(keel::is_lost_ownership(s->renew(key, a->ownership, ttl)), "old renew");
        KEEL_CONFORM_EXPECT(keel::is_lost_ownership(s->release(key, a->ownership)), "old release");
        KEEL_CONFORM_EXPECT(s->release(key, b->ownership).ok(), "new release");
      });
}

// Terms that lapse, renew and repeat; fences over keys.
template <class Store>
void lease_term_checks(const check_list<Store>& add,
    [[maybe_unused]] const duration ttl,
    [[maybe_unused]] const std::string_view key) {
  using H = store_harness<Store>;
  using std::chrono::hours;
  using std::chrono::seconds;

  add("a lapsed lease nobody took over is still the holder's", [=](context& ctx, const H& h) {
    auto s = h.make();
    auto a = s->claim(key, owner_id::random(), ttl);
    KEEL_CONFORM_REQUIRE(a.ok() && a->acquired, show(a));
    h.advance(seconds(30));
    KEEL_CONFORM_EXPECT(s->renew(key, a->ownership, ttl).ok(), "renew after lapse");
    auto b = s->claim(key, owner_id::random(), ttl);
    KEEL_CONFORM_EXPECT(b.ok() && !b->acquired, show(b));
  });

  add("renew never shortens a lease", [=](context& ctx, const H& h) {
    auto s = h.make();
    auto a = s->claim(key, owner_id::random(), seconds(30));
    KEEL_CONFORM_REQUIRE(a.ok() && a->acquired, show(a));
    KEEL_CONFORM_REQUIRE(s->renew(key, a->ownership, seconds(1)).ok(), "short renew");
    h.advance(seconds(20));
    auto b = s->claim(key, owner_id::random(), ttl);
    KEEL_CONFORM_REQUIRE(b.ok() && !b->acquired, show(b));
    KEEL_CONFORM_EXPECT(b->remaining <= seconds(10) && b->remaining >= seconds(10) - h.slack, show(b->remaining));
  });

  add("the holder claiming again keeps its fence", [=](context& ctx, const H& h) {
    auto s = h.make();
    const owner_id me = owner_id::random();
    auto a = s->claim(key, me, ttl);
    KEEL_CONFORM_REQUIRE(a.ok() && a->acquired, show(a));
    h.advance(seconds(6));
    auto again = s->claim(key, me, ttl);
    KEEL_CONFORM_REQUIRE(again.ok() && again->acquired, show(again));
    KEEL_CONFORM_EXPECT(again->ownership == a->ownership && !again->took_over, again->ownership.fence);
    h.advance(seconds(6));  // 12 s after the first claim
    auto other = s->claim(key, owner_id::random(), ttl);
    KEEL_CONFORM_EXPECT(other.ok() && !other->acquired, "extended by the second claim: " + show(other));
  });

  add("fences strictly increase over releases and takeovers; keys are independent", [=](context& ctx, const H& h) {
    auto s = h.make();
    std::int64_t last = 0;
    for (int i = 0; i < 10; ++i) {
      auto c = s->claim(key, owner_id::random(), ttl);
      KEEL_CONFORM_REQUIRE(c.ok() && c->acquired, show(c));
      KEEL_CONFORM_EXPECT(i == 0 ? c->ownership.fence >= 1 : next_fence(h, last, c->ownership.fence),
                          absl::StrCat(c->ownership.fence, " after ", last));
      KEEL_CONFORM_EXPECT(c->took_over == (i > 0 && i % 2 == 0), absl::StrCat("round ", i));
      last = c->ownership.fence;
      if (i % 2 == 0) {
        KEEL_CONFORM_EXPECT(s->release(key, c->ownership).ok(), "release");
      } else {
        h.advance(ttl + seconds(1));  // let it lapse: the next claim is a takeover
      }
    }
    auto other = s->claim("other-work", owner_id::random(), ttl);
    KEEL_CONFORM_EXPECT(other.ok() && other->acquired && !other->took_over, show(other));
  });
}

// Threads racing, a second handle, clocks that step back.
template <class Store>
void lease_race_checks(const check_list<Store>& add,
    [[maybe_unused]] const duration ttl,
    [[maybe_unused]] const std::string_view key) {
  using H = store_harness<Store>;
  using std::chrono::hours;
  using std::chrono::seconds;

  add("N threads claim one key at once: exactly one acquires it", [=](context& ctx, const H& h) {
    auto s = h.make();
    const int n = h.threads;
    std::vector<std::shared_ptr<Store>> handles(n, s);
    if (h.peer)
      for (int i = 1; i < n; i += 2) handles[i] = h.peer(*s);
    std::vector<absl::StatusOr<lease_claim>> got(n, absl::UnknownError("not run"));
    std::latch start(n);
    {
      std::vector<std::jthread> threads;
      for (int i = 0; i < n; ++i)
        threads.emplace_back([&, i] {
          start.arrive_and_wait();
          got[i] = handles[i]->claim(key, owner_id::random(), ttl);
        });
    }
    int acquired = 0;
    std::int64_t fence = 0;  // the winner's; everyone sees it
    for (const auto& g : got)
      if (g.ok() && g->acquired) fence = g->ownership.fence;
    for (const auto& g : got) {
      KEEL_CONFORM_EXPECT(g.ok(), show(g));
      if (g.ok() && g->acquired) ++acquired;
      if (g.ok()) KEEL_CONFORM_EXPECT(g->ownership.fence == fence && fence >= 1, g->ownership.fence);
    }
    KEEL_CONFORM_EXPECT(acquired == 1, acquired);
  });

  add("a second handle sees the same leases", [=](context& ctx, const H& h) {
    auto s = h.make();
    auto p = h.peer(*s);
    auto a = s->claim(key, owner_id::random(), ttl);
    KEEL_CONFORM_REQUIRE(a.ok() && a->acquired, show(a));
    auto b = p->claim(key, owner_id::random(), ttl);
    KEEL_CONFORM_EXPECT(b.ok() && !b->acquired, show(b));
    KEEL_CONFORM_EXPECT(p->release(key, a->ownership).ok(), "release through the other handle");
    auto c = s->claim(key, owner_id::random(), ttl);
    KEEL_CONFORM_EXPECT(c.ok() && c->acquired && next_fence(h, a->ownership.fence, c->ownership.fence), show(c));
  }, {.peer = true});

  add("a clock stepping backwards lets no second owner in", [=](context& ctx, const H& h) {
    auto s = h.make();
    auto a = s->claim(key, owner_id::random(), ttl);
    KEEL_CONFORM_REQUIRE(a.ok() && a->acquired, show(a));
    h.advance(seconds(5));
    h.step_back(hours(1));
    auto b = s->claim(key, owner_id::random(), ttl);
    KEEL_CONFORM_REQUIRE(b.ok() && !b->acquired, show(b));
    KEEL_CONFORM_EXPECT(b->remaining >= seconds(5) - h.slack, show(b->remaining));
    KEEL_CONFORM_EXPECT(s->renew(key, a->ownership, seconds(1)).ok(), "a renewal while the clock is behind");
    h.advance(hours(1));
    auto a2 = s->claim(key, owner_id::random(), ttl);
    KEEL_CONFORM_EXPECT(a2.ok() && !a2->acquired, "a's lease is still live: " + show(a2));
    h.advance(seconds(6));
    auto t = s->claim(key, owner_id::random(), ttl);
    KEEL_CONFORM_EXPECT(t.ok() && t->acquired && t->took_over && next_fence(h, a->ownership.fence, t->ownership.fence),
                        show(t));
    KEEL_CONFORM_EXPECT(keel::is_lost_ownership(s->renew(key, a->ownership, ttl)), "the old owner");
  }, {.step_back = true});

  add("a lease granted while the clock is behind keeps its whole term when it catches up",
      [=](context& ctx, const H& h) {
        auto s = h.make();
        auto a = s->claim(key, owner_id::random(), ttl);  // the store has seen the present
        KEEL_CONFORM_REQUIRE(a.ok() && a->acquired, show(a));
        h.advance(seconds(5));
        h.step_back(hours(1));
        auto c = s->claim("claimed-while-behind", owner_id::random(), ttl);
        KEEL_CONFORM_REQUIRE(c.ok() && c->acquired, show(c));
        h.advance(hours(1));
        auto c2 = s->claim("claimed-while-behind", owner_id::random(), ttl);
        KEEL_CONFORM_EXPECT(c2.ok() && !c2->acquired,
                            "the lease granted while the clock was behind is still live: " + show(c2));
      },
      {.step_back = true, .high_water = true});
}

// Fences after a purge.
template <class Store>
void lease_fence_checks(const check_list<Store>& add,
    [[maybe_unused]] const duration ttl,
    [[maybe_unused]] const std::string_view key) {
  using H = store_harness<Store>;
  using std::chrono::hours;
  using std::chrono::seconds;

  add("a fence never goes backwards: a lease purged after it expired while held is claimed above every fence it had",
      [=](context& ctx, const H& h) {
        auto s = h.make();
        // Two takeovers: a and b are stale holders, c the last one.
        auto a = s->claim(key, owner_id::random(), ttl);
        KEEL_CONFORM_REQUIRE(a.ok() && a->acquired, show(a));
        h.advance(ttl + seconds(1));
        auto b = s->claim(key, owner_id::random(), ttl);
        KEEL_CONFORM_REQUIRE(b.ok() && b->acquired && b->took_over, show(b));
        h.advance(ttl + seconds(1));
        auto c = s->claim(key, owner_id::random(), ttl);
        KEEL_CONFORM_REQUIRE(c.ok() && c->acquired && c->took_over, show(c));
        // c is paused past its expiry, still holding; the store forgets the lease.
        h.advance(ttl + seconds(1));
        h.purge(*s);
        auto d = s->claim(key, owner_id::random(), ttl);
        KEEL_CONFORM_REQUIRE(d.ok() && d->acquired, show(d));
        KEEL_CONFORM_EXPECT(d->ownership.fence > c->ownership.fence,
                            absl::StrCat("fence ", d->ownership.fence, " after purge, the paused holder has ",
                                         c->ownership.fence));
        for (const auto& stale : {a->ownership, b->ownership, c->ownership}) {
          KEEL_CONFORM_EXPECT(keel::is_lost_ownership(s->release(key, stale)),
                              absl::StrCat("a stale release by fence ", stale.fence));
          KEEL_CONFORM_EXPECT(keel::is_lost_ownership(s->renew(key, stale, ttl)), "a stale renew");
        }
        // A released lease purged, too.
        KEEL_CONFORM_REQUIRE(s->release(key, d->ownership).ok(), "release");
        h.advance(seconds(1));
        h.purge(*s);
        auto e = s->claim(key, owner_id::random(), ttl);
        KEEL_CONFORM_REQUIRE(e.ok() && e->acquired, show(e));
        KEEL_CONFORM_EXPECT(e->ownership.fence > d->ownership.fence,
                            absl::StrCat("fence ", e->ownership.fence, " after ", d->ownership.fence));
        KEEL_CONFORM_EXPECT(keel::is_lost_ownership(s->renew(key, d->ownership, ttl)), "the released owner's renew");
        KEEL_CONFORM_EXPECT(s->release(key, e->ownership).ok(), "the new owner's release");
      },
      {.purge = true});
}
template <class Store>
std::vector<check<Store>> lease_checks() {
  std::vector<check<Store>> v;
  const check_list<Store> add{v, "lease: "};
  const lease_inputs in;
  lease_basic_checks<Store>(add, in.ttl, in.key);
  lease_term_checks<Store>(add, in.ttl, in.key);
  lease_race_checks<Store>(add, in.ttl, in.key);
  lease_fence_checks<Store>(add, in.ttl, in.key);
  return v;
}

// What the result checks share: one key, as a fan-out names a unit's result.
struct result_inputs {
  std::string key = "panel:" + digest_of("facts+model+rubric").hex();
};

// Validation, first write wins, values byte for byte.
template <class Store>
void result_basic_checks(const check_list<Store>& add,
    [[maybe_unused]] const std::string key) {
  using H = store_harness<Store>;
  using std::chrono::hours;
  using std::chrono::seconds;

  add("keys and retention are validated", [=](context& ctx, const H& h) {
    auto s = h.make();
    const std::string long_key(256, 'r');
    for (std::string_view bad : {std::string_view(""), std::string_view(long_key), std::string_view("a\tb")}) {
      KEEL_CONFORM_EXPECT(s->save_result(bad, "v", duration::zero()).status().code() ==
                              absl::StatusCode::kInvalidArgument,
                          "save");
      KEEL_CONFORM_EXPECT(s->load_result(bad).status().code() == absl::StatusCode::kInvalidArgument, "load");
      KEEL_CONFORM_EXPECT(s->erase_result(bad).code() == absl::StatusCode::kInvalidArgument, "erase");
    }
    KEEL_CONFORM_EXPECT(s->save_result(key, "v", -seconds(1)).status().code() == absl::StatusCode::kInvalidArgument,
                        "negative retention");
    auto l = s->load_result(key);
    KEEL_CONFORM_EXPECT(l.ok() && !l->has_value(), "nothing was stored");
  });

  add("first write wins; erase makes room", [=](context& ctx, const H& h) {
    auto s = h.make();
    auto none = s->load_result(key);
    KEEL_CONFORM_REQUIRE(none.ok() && !none->has_value(), show(none));
    auto first = s->save_result(key, "score=80", duration::zero());
    KEEL_CONFORM_REQUIRE(first.ok() && *first, show(first));
    auto second = s->save_result(key, "score=81", duration::zero());
    KEEL_CONFORM_REQUIRE(second.ok(), show(second));
    KEEL_CONFORM_EXPECT(!*second, "a second save must not overwrite");
    auto l = s->load_result(key);
    KEEL_CONFORM_EXPECT(l.ok() && l->has_value() && **l == "score=80", show(l));
    KEEL_CONFORM_REQUIRE(s->erase_result(key).ok(), "erase");
    KEEL_CONFORM_EXPECT(s->erase_result(key).ok(), "erasing nothing is OK");
    auto gone = s->load_result(key);
    KEEL_CONFORM_EXPECT(gone.ok() && !gone->has_value(), show(gone));
    auto third = s->save_result(key, "score=81", duration::zero());
    KEEL_CONFORM_EXPECT(third.ok() && *third, show(third));
    auto l2 = s->load_result(key);
    KEEL_CONFORM_EXPECT(l2.ok() && l2->has_value() && **l2 == "score=81", show(l2));
  });

  add("values round-trip byte for byte (NULs, empty, 1 MiB)", [=](context& ctx, const H& h) {
    auto s = h.make();
    const std::string big = [] {
      std::string b(1 << 20, '\0');
      for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<char>((i * 131) & 0xff);
      return b;
    }();
    const std::pair<std::string, std::string> cases[] = {{"bin", binary_bytes()}, {"empty", ""}, {"big", big}};
    for (const auto& [k, value] : cases) {
      auto saved = s->save_result(k, value, duration::zero());
      KEEL_CONFORM_REQUIRE(saved.ok() && *saved, k + ": " + show(saved));
      auto l = s->load_result(k);
      KEEL_CONFORM_REQUIRE(l.ok() && l->has_value(), k + ": " + show(l));
      KEEL_CONFORM_EXPECT(**l == value, absl::StrCat(k, ": ", (*l)->size(), " bytes back, ", value.size(), " saved"));
    }
  });
}

// Retention, races and a second handle.
template <class Store>
void result_retention_checks(const check_list<Store>& add,
    [[maybe_unused]] const std::string key) {
  using H = store_harness<Store>;
  using std::chrono::hours;
  using std::chrono::seconds;

  add("retention: a value expires on the store's clock; zero keeps it", [=](context& ctx, const H& h) {
    auto s = h.make();
    KEEL_CONFORM_REQUIRE(s->save_result("short", "v1", seconds(10)).value_or(false), "save short");
    KEEL_CONFORM_REQUIRE(s->save_result("forever", "v", duration::zero()).value_or(false), "save forever");
    h.advance(seconds(9));
    auto live = s->load_result("short");
    KEEL_CONFORM_EXPECT(live.ok() && live->has_value(), show(live));
    KEEL_CONFORM_EXPECT(!s->save_result("short", "v2", seconds(10)).value_or(true), "still live: first wins");
    h.advance(seconds(2));
    auto gone = s->load_result("short");
    KEEL_CONFORM_EXPECT(gone.ok() && !gone->has_value(), show(gone));
    KEEL_CONFORM_EXPECT(s->save_result("short", "v2", seconds(10)).value_or(false), "expired: may be saved again");
    auto l = s->load_result("short");
    KEEL_CONFORM_EXPECT(l.ok() && l->has_value() && **l == "v2", show(l));
    h.advance(hours(24 * 400));
    auto f = s->load_result("forever");
    KEEL_CONFORM_EXPECT(f.ok() && f->has_value(), show(f));
  });

  add("N threads save one key at once: exactly one wins and everyone loads its value",
      [=](context& ctx, const H& h) {
        auto s = h.make();
        const int n = h.threads;
        std::vector<std::shared_ptr<Store>> handles(n, s);
        if (h.peer)
          for (int i = 1; i < n; i += 2) handles[i] = h.peer(*s);
        std::vector<absl::StatusOr<bool>> saved(n, absl::UnknownError("not run"));
        std::vector<absl::StatusOr<std::optional<std::string>>> loaded(n, absl::UnknownError("not run"));
        std::latch start(n);
        {
          std::vector<std::jthread> threads;
          for (int i = 0; i < n; ++i)
            threads.emplace_back([&, i] {
              start.arrive_and_wait();
              saved[i] = handles[i]->save_result(key, absl::StrCat("value-", i), duration::zero());
              loaded[i] = handles[i]->load_result(key);
            });
        }
        int winners = 0, winner = -1;
        for (int i = 0; i < n; ++i) {
          KEEL_CONFORM_EXPECT(saved[i].ok(), show(saved[i]));
          if (saved[i].ok() && *saved[i]) {
            ++winners;
            winner = i;
          }
        }
        KEEL_CONFORM_REQUIRE(winners == 1, winners);
        for (int i = 0; i < n; ++i) {
          KEEL_CONFORM_EXPECT(loaded[i].ok() && loaded[i]->has_value() && **loaded[i] == absl::StrCat("value-", winner),
                              show(loaded[i]));
        }
      });

  add("a second handle sees the same results", [=](context& ctx, const H& h) {
    auto s = h.make();
    auto p = h.peer(*s);
    KEEL_CONFORM_REQUIRE(s->save_result(key, "v", duration::zero()).value_or(false), "save");
    auto l = p->load_result(key);
    KEEL_CONFORM_EXPECT(l.ok() && l->has_value() && **l == "v", show(l));
    KEEL_CONFORM_EXPECT(!p->save_result(key, "w", duration::zero()).value_or(true), "first write wins across handles");
  }, {.peer = true});
}
template <class Store>
std::vector<check<Store>> result_checks() {
  std::vector<check<Store>> v;
  const check_list<Store> add{v, "results: "};
  const result_inputs in;
  result_basic_checks<Store>(add, in.key);
  result_retention_checks<Store>(add, in.key);
  return v;
}

template <class Store>
std::vector<check<Store>> all_checks() {
  std::vector<check<Store>> v;
  if constexpr (idempotency_store<Store>)
    for (auto& c : idempotency_checks<Store>()) v.push_back(std::move(c));
  if constexpr (lease_store<Store>)
    for (auto& c : lease_checks<Store>()) v.push_back(std::move(c));
  if constexpr (result_store<Store>)
    for (auto& c : result_checks<Store>()) v.push_back(std::move(c));
  return v;
}

}  // namespace detail::conformance

#undef KEEL_CONFORM_EXPECT
#undef KEEL_CONFORM_REQUIRE

// The names of the checks that apply to Store (all of them, including those
// a harness without step_back/peer would skip).
template <class Store>
[[nodiscard]] std::vector<std::string> conformance_checks() {
  std::vector<std::string> names;
  for (const auto& c : detail::conformance::all_checks<Store>()) names.push_back(c.name);
  return names;
}

// Runs every applicable check (or only the one named `only`) against fresh
// stores from the harness. Never throws: a store that throws fails the check.
template <class Store>
[[nodiscard]] conformance_report run_store_conformance(const store_harness<Store>& h, std::string_view only = {}) {
  static_assert(idempotency_store<Store> || lease_store<Store> || result_store<Store>,
                "the store models none of keel::idempotency_store, keel::lease_store, keel::result_store");
  conformance_report report;
  if (!h.make || !h.advance) {
    report.failures.push_back({"harness", "store_harness needs make and advance", __LINE__});
    return report;
  }
  for (auto& c : detail::conformance::all_checks<Store>()) {
    if (!only.empty() && c.name != only) continue;
    if (c.needs.step_back && !h.step_back) {
      report.skipped.push_back(c.name + ": the harness cannot step the clock back");
      continue;
    }
    if (c.needs.peer && !h.peer) {
      report.skipped.push_back(c.name + ": the harness has no peer handle");
      continue;
    }
    if (c.needs.purge && !h.purge) {
      report.skipped.push_back(c.name + ": the harness cannot purge the store");
      continue;
    }
    if (c.needs.high_water && h.server_clock) {
      report.skipped.push_back(c.name + ": " + std::string(server_clock_reason));
      continue;
    }
    detail::conformance::context ctx(c.name);
    try {
      c.run(ctx, h);
    } catch (const detail::conformance::abort_check&) {
    } catch (const std::exception& e) {
      ctx.failures().push_back({c.name, std::string("threw: ") + e.what(), 0});
    } catch (...) {
      ctx.failures().push_back({c.name, "threw a non-exception", 0});
    }
    if (ctx.failures().empty()) {
      report.passed.push_back(c.name);
    } else {
      for (auto& f : ctx.failures()) report.failures.push_back(std::move(f));
    }
  }
  if (!only.empty() && report.passed.empty() && report.failures.empty() && report.skipped.empty())
    report.failures.push_back({std::string(only), "no such check for this store type", __LINE__});
  return report;
}

}  // namespace keel::testing
