// keel::shared_concurrency and keel::shared_provider_state in one process,
// against the real Redis the ctest fixture starts: several instances stand
// for several replicas. The server's clock is moved with the test offset,
// the replicas' with keel::testing::manual_clock. (K real processes:
// scaleout_fleet_process_test.cpp.)
#include <chrono>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "keel/compose/pipeline.hpp"
#include "keel/policy/breaker_registry.hpp"
#include "keel/policy/retry.hpp"
#include "keel/fleet/shared_concurrency.hpp"
#include "keel/fleet/shared_provider_state.hpp"
#include "keel/testing/manual_clock.hpp"
#include "support/catch.hpp"
#include "support/loopback.hpp"
#include "support/scaleout.hpp"

using namespace std::chrono_literals;
using keel::testing::manual_clock;

namespace {

keel::redis_options fleet_redis(const std::string& prefix, std::shared_ptr<std::atomic<std::int64_t>> offset = {}) {
  return keel::redis_options{.port = keel_scaleout::redis_port(),
                             .key_prefix = prefix + ":",
                             .command_timeout = 500ms,
                             .testing_clock_offset = std::move(offset)};
}

keel::redis_options unreachable_redis() {
  keel::redis_options r = fleet_redis(keel_scaleout::fresh_name("fleet"));
  r.port = keel_test::unused_loopback_port();
  return r;
}

std::string message(const absl::Status& s) { return std::string(s.message()); }

// Records what the fleet components report.
struct fleet_log {
  std::vector<std::string>* lines;
  void operator()(const keel::events::shared_concurrency_refused& e) const {
    lines->push_back("refused " + std::string(e.name) + " " + std::string(keel::to_string(e.source)));
  }
  void operator()(const keel::events::shared_concurrency_local_share& e) const {
    lines->push_back("local-share " + std::string(e.name));
  }
  void operator()(const keel::events::shared_permit_lost& e) const { lines->push_back("lost " + std::string(e.name)); }
  void operator()(const keel::events::fleet_state_refused& e) const {
    lines->push_back("fleet-refused " + std::string(keel::to_string(e.why)));
  }
  void operator()(const keel::events::fleet_state_published& e) const {
    lines->push_back("published " + std::string(keel::to_string(e.what)));
  }
  void operator()(const keel::events::fleet_state_unavailable&) const { lines->push_back("unavailable"); }
};

const keel::labels llm{.tenant = "acme", .model = "m-large", .endpoint = "api.provider", .region = "eu"};
const keel::failure_domain llm_domain{.endpoint = "api.provider", .model = "m-large", .region = "eu"};

}  // namespace

// ---- options ----------------------------------------------------------------

TEST_CASE("shared concurrency options are validated, naming the field and the rule", "[scaleout][fleet]") {
  auto m = [](keel::shared_concurrency_options o) { return message(o.validate()); };
  CHECK(m({.name = "", .limit = 1}) ==
        "shared_concurrency_options.name must be 1-255 bytes without control characters (got shared concurrency name "
        "must not be empty)");
  CHECK(m({.name = "p"}) == "shared_concurrency_options.limit must be in [1, 1000000] (got 0)");
  CHECK(m({.name = "p", .limit = 2'000'000}) == "shared_concurrency_options.limit must be in [1, 1000000] (got 2000000)");
  CHECK(m({.name = "p", .limit = 1, .permit_ttl = 0s}) ==
        "shared_concurrency_options.permit_ttl must be in [1ms, 24h] (got 0s)");
  CHECK(m({.name = "p", .limit = 1, .permit_ttl = 25h}) ==
        "shared_concurrency_options.permit_ttl must be in [1ms, 24h] (got 90000s)");
  CHECK(m({.name = "p", .limit = 1, .expiry_grace = -1s}) ==
        "shared_concurrency_options.expiry_grace must be in [0, 1h] (got -1s)");
  CHECK(m({.name = "p", .limit = 1, .expected_replicas = 0}) ==
        "shared_concurrency_options.expected_replicas must be in [1, 100000] (got 0)");
  CHECK(m({.name = "p", .limit = 1, .fallback_hold = 2h}) ==
        "shared_concurrency_options.fallback_hold must be in [0, 1h] (got 7200s)");
  CHECK(m({.name = "p", .limit = 1}).empty());
  CHECK(keel::shared_concurrency_options{.name = "p", .limit = 10, .expected_replicas = 4}.local_share() == 2);
  CHECK(keel::shared_concurrency_options{.name = "p", .limit = 3, .expected_replicas = 4}.local_share() == 1);
  CHECK_THROWS_WITH(keel::shared_concurrency(fleet_redis("c"), {.name = "p"}),
                    "shared_concurrency_options.limit must be in [1, 1000000] (got 0)");
}

TEST_CASE("shared provider state options are validated, naming the field and the rule", "[scaleout][fleet]") {
  auto m = [](keel::shared_provider_state_options o) { return message(o.validate()); };
  CHECK(m({.scope = {.endpoint = false, .model = false, .region = false}}) ==
        "shared_provider_state_options.scope must name at least one label (got none)");
  CHECK(m({.refresh_every = -1ms}) == "shared_provider_state_options.refresh_every must be in [0, 1min] (got -1ms)");
  CHECK(m({.refresh_every = 2min}) == "shared_provider_state_options.refresh_every must be in [0, 1min] (got 120s)");
  CHECK(m({.max_probes = 0}) == "shared_provider_state_options.max_probes must be in [1, 1000] (got 0)");
  CHECK(m({.probe_window = 0s}) == "shared_provider_state_options.probe_window must be in [1ms, 1h] (got 0s)");
  CHECK(m({.reopen_for = 0s}) == "shared_provider_state_options.reopen_for must be in [1ms, 24h] (got 0s)");
  CHECK(m({.max_cooldown = 0s}) == "shared_provider_state_options.max_cooldown must be in [1ms, 24h] (got 0s)");
  CHECK(m({.fallback_hold = -1s}) == "shared_provider_state_options.fallback_hold must be in [0, 1h] (got -1s)");
  CHECK(m({.max_domains = 0}) == "shared_provider_state_options.max_domains must be in [1, 1048576] (got 0)");
  CHECK(m({.forget_after = 0s}) == "shared_provider_state_options.forget_after must be in [1s, 24h] (got 0s)");
  CHECK(m({}).empty());
  CHECK_THROWS_WITH(keel::shared_provider_state(fleet_redis("s"), {.max_probes = 0}),
                    "shared_provider_state_options.max_probes must be in [1, 1000] (got 0)");
}

// ---- shared concurrency -----------------------------------------------------

TEST_CASE("replicas share one count of permits; a refusal is keel's and says when the earliest permit expires",
          "[scaleout][fleet][concurrency]") {
  const std::string prefix = keel_scaleout::fresh_name("conc");
  const keel::shared_concurrency_options o{.name = "provider:m-large", .limit = 3, .permit_ttl = 10s};
  keel::shared_concurrency a(fleet_redis(prefix), o), b(fleet_redis(prefix), o);
  CHECK(a.owner() != b.owner());
  const keel::time_point now{};
  std::vector<keel::shared_permit> held;
  for (int i = 0; i < 3; ++i) {
    held.push_back((i % 2 == 0 ? a : b).try_acquire(now));
    REQUIRE(held.back());
    CHECK_FALSE(held.back().local_share());
    CHECK(held.back().held() == i + 1);
  }
  CHECK(held[1].id() > held[0].id());  // fences grow
  CHECK(held[2].id() > held[1].id());
  const keel::shared_permit refused = b.try_acquire(now);
  CHECK_FALSE(refused);
  CHECK(refused.held() == 3);
  CHECK(refused.retry_after() <= 10s);
  CHECK(refused.retry_after() > 5s);
  const absl::Status s = keel::shared_concurrency::refusal(o.name, refused);
  CHECK(s.code() == absl::StatusCode::kResourceExhausted);
  CHECK(message(s) == "keel: shared concurrency 'provider:m-large' is at its limit (3 in flight across the fleet)");
  CHECK(keel::not_started(s));
  CHECK(keel::default_classifier{}(s, {}) == keel::outcome_kind::refused);
  CHECK(keel::refused_by(s) == std::optional<std::string>("shared:provider:m-large:concurrency"));
  CHECK(keel::retry_after(s) == std::optional<keel::duration>(refused.retry_after()));

  absl::StatusOr<keel::permit_release> back = held[0].release();
  REQUIRE(back.ok());
  CHECK(*back == keel::permit_release::released);
  CHECK_FALSE(held[0]);
  CHECK(held[0].release().status().code() == absl::StatusCode::kFailedPrecondition);  // once
  keel::shared_permit again = b.try_acquire(now);
  CHECK(again);
  held.clear();  // destroyed permits are released
  CHECK(a.try_acquire(now));
  CHECK(a.local_share_decisions() + b.local_share_decisions() == 0);
}

TEST_CASE("fenced release: a permit that expired and was handed on cannot be returned by its old holder",
          "[scaleout][fleet][concurrency]") {
  auto offset = std::make_shared<std::atomic<std::int64_t>>(0);
  const std::string prefix = keel_scaleout::fresh_name("conc");
  const keel::shared_concurrency_options o{.name = "provider:m", .limit = 1, .permit_ttl = 2s};
  keel::shared_concurrency slow(fleet_redis(prefix, offset), o), next(fleet_redis(prefix, offset), o),
      third(fleet_redis(prefix, offset), o);
  const keel::time_point now{};
  keel::shared_permit stale = slow.try_acquire(now);
  REQUIRE(stale);
  CHECK_FALSE(next.try_acquire(now));
  offset->fetch_add(keel::detail::to_ns(3s));  // the slow replica's permit expires on the server's clock
  keel::shared_permit current = next.try_acquire(now);
  REQUIRE(current);
  CHECK(current.id() > stale.id());
  absl::StatusOr<keel::permit_release> late = stale.release();
  REQUIRE(late.ok());
  CHECK(*late == keel::permit_release::not_held);
  CHECK(slow.lost_permits() == 1);
  CHECK_FALSE(third.try_acquire(now));  // the new holder's permit is still held
  REQUIRE(current.release().ok());
  CHECK(third.try_acquire(now));
}

TEST_CASE("a permit nobody returns (its replica died) returns to the fleet when it expires",
          "[scaleout][fleet][concurrency]") {
  auto offset = std::make_shared<std::atomic<std::int64_t>>(0);
  const std::string prefix = keel_scaleout::fresh_name("conc");
  const keel::shared_concurrency_options o{.name = "provider:m", .limit = 2, .permit_ttl = 30s};
  keel::shared_concurrency survivor(fleet_redis(prefix, offset), o);
  const keel::time_point now{};
  alignas(keel::shared_permit) unsigned char dead_permits[2][sizeof(keel::shared_permit)];
  {
    keel::shared_concurrency dead(fleet_redis(prefix, offset), o);
    keel::shared_permit a = dead.try_acquire(now, 5s), b = dead.try_acquire(now, 20s);
    REQUIRE(a);
    REQUIRE(b);
    // The replica dies holding both: the permits are moved into storage whose
    // destructors never run (no heap involved, so nothing leaks).
    ::new (static_cast<void*>(dead_permits[0])) keel::shared_permit(std::move(a));
    ::new (static_cast<void*>(dead_permits[1])) keel::shared_permit(std::move(b));
  }
  const keel::shared_permit refused = survivor.try_acquire(now);
  CHECK_FALSE(refused);
  CHECK(refused.retry_after() <= 5s);  // the earliest expiry
  offset->fetch_add(keel::detail::to_ns(6s));
  keel::shared_permit one = survivor.try_acquire(now);
  CHECK(one);
  CHECK_FALSE(survivor.try_acquire(now));
  offset->fetch_add(keel::detail::to_ns(15s));
  CHECK(survivor.try_acquire(now));
}

TEST_CASE("Redis unreachable: permits come from the local share of the limit, which says so",
          "[scaleout][fleet][concurrency][faults]") {
  keel::shared_concurrency c(unreachable_redis(),
                             {.name = "provider:m", .limit = 9, .expected_replicas = 4, .fallback_hold = 1s});
  manual_clock clock;
  CHECK(c.status(clock.now()).source == keel::concurrency_source::shared);
  keel::shared_permit a = c.try_acquire(clock.now());
  keel::shared_permit b = c.try_acquire(clock.now());
  REQUIRE(a);
  REQUIRE(b);
  CHECK(a.local_share());
  CHECK(a.redis_error().code() == absl::StatusCode::kUnavailable);
  const keel::shared_permit refused = c.try_acquire(clock.now());
  CHECK_FALSE(refused);
  CHECK(refused.local_share());
  const absl::Status s = keel::shared_concurrency::refusal(c.name(), refused);
  INFO(s.ToString());
  CHECK(keel::refused_by(s) == std::optional<std::string>("shared:provider:m:local-share"));
  CHECK(message(s).find("is at its local share (2 in flight; Redis unreachable: ") != std::string::npos);
  CHECK(keel::default_classifier{}(s, {}) == keel::outcome_kind::refused);
  const keel::shared_concurrency_status st = c.status(clock.now());
  CHECK(st.source == keel::concurrency_source::local_share);
  CHECK(st.local_share == 2);
  CHECK(st.local_in_flight == 2);
  CHECK(st.redis_error.code() == absl::StatusCode::kUnavailable);
  CHECK(c.redis_failures() == 1);  // held on the local share: Redis asked once
  REQUIRE(a.release().ok());
  CHECK(c.status(clock.now()).local_in_flight == 1);
  CHECK(c.try_acquire(clock.now()));
  clock.advance(1s);  // the hold is over: Redis is asked again (and still fails)
  CHECK(c.status(clock.now()).source == keel::concurrency_source::shared);
  (void)c.try_acquire(clock.now());
  CHECK(c.redis_failures() == 2);
}

TEST_CASE("as a pipeline stage: refused before the work, a permit per attempt, replays hold none, a lost permit "
          "reported",
          "[scaleout][fleet][concurrency][pipeline]") {
  auto offset = std::make_shared<std::atomic<std::int64_t>>(0);
  manual_clock clock;
  const std::string prefix = keel_scaleout::fresh_name("conc");
  keel::shared_concurrency fleet(fleet_redis(prefix, offset), {.name = "provider:m", .limit = 1, .permit_ttl = 5s});
  keel::shared_concurrency other(fleet_redis(prefix, offset), {.name = "provider:m", .limit = 1, .permit_ttl = 5s});
  std::vector<std::string> log;
  auto pipe = keel::pipeline(fleet).in(keel::environment{clock}.with_listener(fleet_log{&log}));
  int ran = 0;
  bool outlive = false;
  auto work = [&](const keel::attempt&) -> absl::StatusOr<int> {
    ++ran;
    if (outlive) offset->fetch_add(keel::detail::to_ns(6s));  // the call outlives its permit
    return 7;
  };
  {
    keel::call c(clock.now(), {.labels = llm});
    CHECK(pipe.run(c, work).ok());
  }
  keel::shared_permit taken = other.try_acquire(clock.now());  // another replica holds the only permit
  REQUIRE(taken);
  {
    keel::call c(clock.now(), {.labels = llm});
    const absl::StatusOr<int> r = pipe.run(c, work);
    CHECK(keel::refused_by(r.status()) == std::optional<std::string>("shared:provider:m:concurrency"));
    CHECK(keel::not_started(r.status()));
    CHECK(ran == 1);
  }
  {
    keel::call replayed(clock.now(), {.labels = llm});
    replayed.mark_replayed();
    CHECK(pipe.run(replayed, work).ok());  // no permit needed
    CHECK(ran == 2);
  }
  REQUIRE(taken.release().ok());
  outlive = true;
  {
    keel::call c(clock.now(), {.deadline = keel::deadline::after(clock.now(), 1h), .labels = llm});
    CHECK(pipe.run(c, work).ok());
  }
  CHECK(log == std::vector<std::string>{"refused provider:m shared", "lost provider:m"});
  CHECK(fleet.lost_permits() == 1);
}

// ---- shared provider state --------------------------------------------------

TEST_CASE("a breaker opened in one replica stops the others at their next read, within refresh_every",
          "[scaleout][fleet][state]") {
  auto offset = std::make_shared<std::atomic<std::int64_t>>(0);
  const std::string prefix = keel_scaleout::fresh_name("state");
  manual_clock clock;
  const keel::breaker_registry_options bo{.breaker = {.window_calls = 4, .minimum_calls = 4, .open_duration = 10s}};
  keel::breaker_registry breakers_a(bo), breakers_b(bo);
  keel::shared_provider_state a(fleet_redis(prefix, offset), {.refresh_every = 100ms}, &breakers_a);
  keel::shared_provider_state b(fleet_redis(prefix, offset), {.refresh_every = 100ms}, &breakers_b);
  std::vector<std::string> log_a, log_b;
  auto pipe_a = keel::pipeline(a, breakers_a).in(keel::environment{clock}.with_listener(fleet_log{&log_a}));
  auto pipe_b = keel::pipeline(b, breakers_b).in(keel::environment{clock}.with_listener(fleet_log{&log_b}));
  int calls_a = 0, calls_b = 0;
  auto failing = [&](const keel::attempt&) -> absl::StatusOr<int> {
    ++calls_a;
    return absl::UnavailableError("503");
  };
  auto healthy = [&](const keel::attempt&) -> absl::StatusOr<int> {
    ++calls_b;
    return 1;
  };
  keel::call warm(clock.now(), {.labels = llm});
  CHECK(pipe_b.run(warm, healthy).ok());  // b has read the (closed) state at t0
  for (int i = 0; i < 4; ++i) {
    keel::call c(clock.now(), {.labels = llm});
    (void)pipe_a.run(c, failing);
  }
  REQUIRE(breakers_a.breaker_for(llm).state() == keel::breaker_state::open);
  CHECK(log_a == std::vector<std::string>{"published breaker"});
  CHECK(calls_a == 4);
  // b's cached read is still fresh: it sends (the documented staleness) ...
  clock.advance(50ms);
  keel::call stale(clock.now(), {.labels = llm});
  CHECK(pipe_b.run(stale, healthy).ok());
  CHECK(calls_b == 2);
  // ... and once refresh_every has passed since its read, it stops.
  clock.advance(50ms);
  keel::call stopped(clock.now(), {.labels = llm});
  const absl::StatusOr<int> r = pipe_b.run(stopped, healthy);
  INFO(r.status().ToString());
  CHECK(calls_b == 2);
  CHECK(r.status().code() == absl::StatusCode::kUnavailable);
  CHECK(keel::refused_by(r.status()) ==
        std::optional<std::string>("fleet:endpoint=api.provider,model=m-large,region=eu:breaker"));
  CHECK(keel::default_classifier{}(r.status(), {}) == keel::outcome_kind::refused);
  const std::optional<keel::duration> wait = keel::retry_after(r.status());
  REQUIRE(wait);
  CHECK(*wait <= 10s);
  CHECK(*wait > 9s);
  CHECK(log_b == std::vector<std::string>{"fleet-refused breaker"});
  // b's own breaker counted nothing: the refusal is keel's.
  CHECK(breakers_b.breaker_for(llm).figures(clock.now()).calls == 2);
  CHECK(breakers_b.breaker_for(llm).state() == keel::breaker_state::closed);
  const absl::StatusOr<keel::fleet_provider_view> v = b.read(llm_domain, clock.now());
  REQUIRE(v.ok());
  CHECK(v->open());
}

TEST_CASE("fleet half-open: the fleet sends max_probes probes per window, a success closes it for every replica",
          "[scaleout][fleet][state]") {
  auto offset = std::make_shared<std::atomic<std::int64_t>>(0);
  const std::string prefix = keel_scaleout::fresh_name("state");
  manual_clock clock;
  const keel::shared_provider_state_options o{.refresh_every = 0ms, .max_probes = 2, .probe_window = 1s,
                                              .reopen_for = 5s};
  std::vector<std::unique_ptr<keel::shared_provider_state>> replicas;
  for (int i = 0; i < 4; ++i)
    replicas.push_back(std::make_unique<keel::shared_provider_state>(fleet_redis(prefix, offset), o));
  REQUIRE(replicas[0]->publish_open(llm_domain, 2s, clock.now()).ok());
  offset->fetch_add(keel::detail::to_ns(2s));  // the open period ends on the server's clock
  int probes = 0;
  bool provider_up = false;
  auto provider = [&](const keel::attempt&) -> absl::StatusOr<int> {
    ++probes;
    if (!provider_up) return absl::UnavailableError("503");
    return 1;
  };
  // Every replica would send; the slow probes have not come back yet.
  std::vector<std::string> refusals;
  for (auto& r : replicas) {
    for (int i = 0; i < 3; ++i) {
      const absl::StatusOr<keel::fleet_probe> p = r->try_probe(llm_domain, clock.now());
      REQUIRE(p.ok());
      if (*p == keel::fleet_probe::granted) ++probes;
    }
  }
  CHECK(probes == 2);  // not 4 x 3
  // A failed probe (through the policy) opens the fleet's breaker again for reopen_for.
  offset->fetch_add(keel::detail::to_ns(1s));  // the next window
  probes = 0;
  std::vector<std::string> log;
  auto pipe0 = keel::pipeline(*replicas[0]).in(keel::environment{clock}.with_listener(fleet_log{&log}));
  keel::call probe_call(clock.now(), {.labels = llm});
  CHECK(pipe0.run(probe_call, provider).status().code() == absl::StatusCode::kUnavailable);
  CHECK(probes == 1);
  CHECK(log == std::vector<std::string>{"published breaker"});
  auto pipe1 = keel::pipeline(*replicas[1]).in(keel::environment{clock});
  keel::call refused(clock.now(), {.labels = llm});
  CHECK(keel::refused_by(pipe1.run(refused, provider).status()) ==
        std::optional<std::string>("fleet:endpoint=api.provider,model=m-large,region=eu:breaker"));
  CHECK(probes == 1);
  // Reopened for 5 s; then a probe that succeeds closes it for all.
  offset->fetch_add(keel::detail::to_ns(5s));
  provider_up = true;
  keel::call good(clock.now(), {.labels = llm});
  CHECK(pipe1.run(good, provider).ok());
  CHECK(probes == 2);
  const absl::StatusOr<keel::fleet_provider_view> v = replicas[3]->read(llm_domain, clock.now());
  REQUIRE(v.ok());
  CHECK_FALSE(v->breaker_known);
  auto pipe3 = keel::pipeline(*replicas[3]).in(keel::environment{clock});
  for (int i = 0; i < 3; ++i) {
    keel::call c(clock.now(), {.labels = llm});
    CHECK(pipe3.run(c, provider).ok());
  }
  CHECK(probes == 5);
}

TEST_CASE("a provider's cooldown hint heard by one replica is honoured by all, until it ends",
          "[scaleout][fleet][state]") {
  auto offset = std::make_shared<std::atomic<std::int64_t>>(0);
  const std::string prefix = keel_scaleout::fresh_name("state");
  manual_clock clock;
  keel::shared_provider_state a(fleet_redis(prefix, offset), {.refresh_every = 0ms, .max_cooldown = 1min});
  keel::shared_provider_state b(fleet_redis(prefix, offset), {.refresh_every = 0ms, .max_cooldown = 1min});
  std::vector<std::string> log_a;
  auto pipe_a = keel::pipeline(a).in(keel::environment{clock}.with_listener(fleet_log{&log_a}));
  auto pipe_b = keel::pipeline(b).in(keel::environment{clock});
  int calls = 0;
  auto throttled = [&](const keel::attempt&) -> absl::StatusOr<int> {
    ++calls;
    return keel::with_retry_after(absl::ResourceExhaustedError("429 rate limited"), 20s);
  };
  auto ok = [&](const keel::attempt&) -> absl::StatusOr<int> {
    ++calls;
    return 1;
  };
  keel::call first(clock.now(), {.labels = llm});
  CHECK(pipe_a.run(first, throttled).status().code() == absl::StatusCode::kResourceExhausted);
  CHECK(log_a == std::vector<std::string>{"published cooldown"});
  keel::call other(clock.now(), {.labels = llm});
  const absl::StatusOr<int> r = pipe_b.run(other, ok);
  INFO(r.status().ToString());
  CHECK(calls == 1);
  CHECK(keel::refused_by(r.status()) ==
        std::optional<std::string>("fleet:endpoint=api.provider,model=m-large,region=eu:cooldown"));
  CHECK(r.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK(keel::default_classifier{}(r.status(), {}) == keel::outcome_kind::refused);
  const std::optional<keel::duration> wait = keel::retry_after(r.status());
  REQUIRE(wait);
  CHECK(*wait <= 20s);
  CHECK(*wait > 19s);
  // Another domain (another model) is not affected.
  keel::call small(clock.now(), {.labels = {.model = "m-small", .endpoint = "api.provider", .region = "eu"}});
  CHECK(pipe_b.run(small, ok).ok());
  CHECK(calls == 2);
  // Once the cooldown has run out on the server's clock, b sends again.
  offset->fetch_add(keel::detail::to_ns(21s));
  clock.advance(21s);  // the local cache's copy ends too
  keel::call later(clock.now(), {.labels = llm});
  CHECK(pipe_b.run(later, ok).ok());
  CHECK(calls == 3);
}

// Found by the store_keys fuzz target (docs/fuzzing.md): the domain's hash
// was keyed by its display name "endpoint=e,model=m", so a label holding
// ",model=" made two domains one key, and one's cooldown refused the other.
TEST_CASE("failure domains whose display names coincide keep separate fleet state",
          "[scaleout][fleet][state][fuzz]") {
  auto offset = std::make_shared<std::atomic<std::int64_t>>(0);
  const std::string prefix = keel_scaleout::fresh_name("state");
  manual_clock clock;
  const keel::shared_provider_state_options o{.scope = {.endpoint = true, .model = true, .region = false},
                                              .refresh_every = 0ms,
                                              .max_cooldown = 1min};
  keel::shared_provider_state a(fleet_redis(prefix, offset), o);
  keel::shared_provider_state b(fleet_redis(prefix, offset), o);
  auto pipe_a = keel::pipeline(a).in(keel::environment{clock});
  auto pipe_b = keel::pipeline(b).in(keel::environment{clock});
  int calls = 0;
  auto throttled = [&](const keel::attempt&) -> absl::StatusOr<int> {
    ++calls;
    return keel::with_retry_after(absl::ResourceExhaustedError("429 rate limited"), 20s);
  };
  auto ok = [&](const keel::attempt&) -> absl::StatusOr<int> {
    ++calls;
    return 1;
  };
  const keel::labels x{.model = "x", .endpoint = "api,model=m"};
  const keel::labels y{.model = "m,model=x", .endpoint = "api"};
  REQUIRE(keel::failure_domain::of(x, o.scope).to_string(o.scope) ==
          keel::failure_domain::of(y, o.scope).to_string(o.scope));  // the names coincide
  keel::call first(clock.now(), {.labels = x});
  CHECK(pipe_a.run(first, throttled).status().code() == absl::StatusCode::kResourceExhausted);
  keel::call other(clock.now(), {.labels = y});
  const absl::StatusOr<int> r = pipe_b.run(other, ok);
  INFO(r.status().ToString());
  CHECK(r.ok());
  CHECK(calls == 2);
  keel::call same(clock.now(), {.labels = x});  // x itself is still cooling down, for every replica
  CHECK(pipe_b.run(same, ok).status().code() == absl::StatusCode::kResourceExhausted);
  CHECK(calls == 2);
}

TEST_CASE("Redis unreachable: the provider state decides alone, says so, and asks again after the hold",
          "[scaleout][fleet][state][faults]") {
  manual_clock clock;
  keel::breaker_registry breakers({.breaker = {.window_calls = 2, .minimum_calls = 2, .open_duration = 10s}});
  keel::shared_provider_state s(unreachable_redis(), {.refresh_every = 0ms, .fallback_hold = 1s}, &breakers);
  std::vector<std::string> log;
  auto pipe = keel::pipeline(s, breakers).in(keel::environment{clock}.with_listener(fleet_log{&log}));
  int calls = 0;
  auto ok = [&](const keel::attempt&) -> absl::StatusOr<int> {
    ++calls;
    return 1;
  };
  for (int i = 0; i < 3; ++i) {
    keel::call c(clock.now(), {.labels = llm});
    CHECK(pipe.run(c, ok).ok());
  }
  CHECK(calls == 3);
  CHECK(log == std::vector<std::string>{"unavailable"});
  CHECK(s.redis_failures() == 1);
  CHECK(s.deciding_alone(clock.now()));
  clock.advance(1s);
  CHECK_FALSE(s.deciding_alone(clock.now()));
  keel::call c(clock.now(), {.labels = llm});
  CHECK(pipe.run(c, ok).ok());
  CHECK(s.redis_failures() == 2);
}
