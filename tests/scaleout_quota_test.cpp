// keel::shared_quota: one GCRA bucket in Redis shared by every replica,
// timed by the server's clock (moved with the test offset), with a local
// fallback (timed by the manual clock) when Redis cannot answer, and as a
// pipeline level after keel::admission.
#include "keel/fleet/shared_quota.hpp"

#include <chrono>
#include <memory>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include <arpa/inet.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "keel/compose/pipeline.hpp"
#include "keel/compose/stream.hpp"
#include "keel/policy/admission.hpp"
#include "keel/policy/circuit_breaker.hpp"
#include "keel/policy/retry.hpp"
#include "keel/testing/manual_clock.hpp"
#include "keel/testing/scripted_stream.hpp"
#include "support/scaleout.hpp"
#include "support/catch.hpp"
#include "support/loopback.hpp"

using namespace std::chrono_literals;
using keel::testing::manual_clock;

namespace {

keel::redis_options quota_redis(const std::string& prefix, std::shared_ptr<std::atomic<std::int64_t>> offset = {}) {
  return keel::redis_options{.port = keel_scaleout::redis_port(),
                             .key_prefix = prefix + ":",
                             .command_timeout = 200ms,
                             .testing_clock_offset = std::move(offset)};
}

bool redis_admin(std::initializer_list<const char*> args) {
  redisContext* c = redisConnect("127.0.0.1", keel_scaleout::redis_port());
  if (c == nullptr || c->err) return false;
  std::vector<const char*> argv(args);
  std::vector<std::size_t> lens;
  for (const char* a : argv) lens.push_back(std::strlen(a));
  auto* r = static_cast<redisReply*>(redisCommandArgv(c, static_cast<int>(argv.size()), argv.data(), lens.data()));
  const bool ok = r != nullptr && r->type == REDIS_REPLY_STATUS;
  if (r) freeReplyObject(r);
  redisFree(c);
  return ok;
}


}  // namespace

TEST_CASE("shared quota options are validated, naming the field and the rule", "[scaleout][quota]") {
  auto message = [](keel::shared_quota_options o) { return std::string(o.validate().message()); };
  CHECK(message({.name = "", .fallback_rate = 1}) ==
        "shared_quota_options.name must be 1-255 bytes without control characters (got shared quota name must not "
        "be empty)");
  CHECK(message({.name = "a\nb", .fallback_rate = 1}) ==
        "shared_quota_options.name must be 1-255 bytes without control characters (got shared quota name must not "
        "contain control characters (byte 0x0a at offset 1))");
  CHECK(message({.name = "p", .per = 0s, .fallback_rate = 1}) == "shared_quota_options.per must be > 0 (got 0s)");
  CHECK(message({.name = "p", .rate = 0, .fallback_rate = 1}) ==
        "shared_quota_options.rate must be in (0, 1e6] units per second (got 0)");
  CHECK(message({.name = "p", .rate = 2e6, .fallback_rate = 1}) ==
        "shared_quota_options.rate must be in (0, 1e6] units per second (got 2e+06)");
  CHECK(message({.name = "p", .rate = 120, .per = 1min, .fallback_rate = 1}).empty());  // 2 per second
  CHECK(message({.name = "p", .burst = 0.5, .fallback_rate = 1}) ==
        "shared_quota_options.burst must be a finite number >= 1 (got 0.5)");
  CHECK(message({.name = "p"}) ==
        "shared_quota_options.fallback_rate must be set (> 0): the local limit while Redis is unreachable (got 0)");
  CHECK(message({.name = "p", .fallback_rate = 2e9}) ==
        "shared_quota_options.fallback_rate must be at most 1e6 units per second (got 2e+09)");
  CHECK(message({.name = "p", .fallback_rate = 1, .fallback_burst = 0}) ==
        "shared_quota_options.fallback_burst must be a finite number >= 1 (got 0)");
  CHECK(message({.name = "p", .fallback_rate = 1e-6, .fallback_burst = 1000}) ==
        "shared_quota_options.fallback_burst must be at most 1e8 seconds of fallback_rate (got 1000)");
  CHECK(message({.name = "p", .fallback_rate = 1, .fallback_hold = -1s}) ==
        "shared_quota_options.fallback_hold must be in [0, 1h] (got -1s)");
  CHECK(message({.name = "p", .fallback_rate = 1, .fallback_hold = 2h}) ==
        "shared_quota_options.fallback_hold must be in [0, 1h] (got 7200s)");
  CHECK_THROWS_AS(keel::shared_quota(quota_redis("q"), {.name = "p"}), keel::invalid_options);
  CHECK_THROWS_WITH(
      keel::shared_quota(quota_redis("q"), {.name = "p"}),
      "shared_quota_options.fallback_rate must be set (> 0): the local limit while Redis is unreachable (got 0)");
  CHECK(keel::shared_quota_options{.name = "p", .fallback_rate = 1}.validate().ok());
}

TEST_CASE("replicas share one bucket on the server's clock: burst, then the rate", "[scaleout][quota]") {
  auto offset = std::make_shared<std::atomic<std::int64_t>>(0);
  const std::string prefix = keel_scaleout::fresh_name("quota");
  const keel::shared_quota_options o{.name = "provider:m-large", .rate = 10, .burst = 3, .fallback_rate = 5};
  keel::shared_quota a(quota_redis(prefix, offset), o), b(quota_redis(prefix, offset), o);
  const keel::time_point now{};  // only the fallback would use it
  const auto burst_start = std::chrono::steady_clock::now();
  for (int i = 0; i < 3; ++i) {
    const keel::shared_quota_decision d = (i % 2 == 0 ? a : b).try_acquire(now);
    CHECK(d.granted);
    CHECK(d.source == keel::quota_source::shared);
  }
  const keel::shared_quota_decision refused = b.try_acquire(now);
  CHECK_FALSE(refused.granted);
  CHECK(refused.source == keel::quota_source::shared);
  const auto spent = std::chrono::steady_clock::now() - burst_start;
  CHECK(refused.retry_after <= 100ms);
  // The server's clock moved on since the burst by about what these round
  // trips took (much more than usual on a loaded machine under a sanitizer).
  CHECK(refused.retry_after >= 100ms - spent - 5ms);
  const absl::Status s = keel::shared_quota::refusal(o.name, refused);
  CHECK(s.code() == absl::StatusCode::kResourceExhausted);
  CHECK(keel::not_started(s));
  CHECK(keel::refused_by(s) == std::optional<std::string>("shared:provider:m-large:rate"));
  CHECK(keel::retry_after(s) == std::optional<keel::duration>(refused.retry_after));

  offset->fetch_add(keel::detail::to_ns(100ms));  // one interval later, on the server's clock
  CHECK(a.try_acquire(now).granted);
  CHECK_FALSE(b.try_acquire(now).granted);
  // A refund (another level refused) gives the unit back to the fleet.
  offset->fetch_add(keel::detail::to_ns(100ms));
  const keel::shared_quota_decision got = a.try_acquire(now);
  REQUIRE(got.granted);
  a.refund(got);
  CHECK(b.try_acquire(now).granted);
  CHECK(a.fallback_decisions() + b.fallback_decisions() == 0);
  CHECK(a.redis_failures() + b.redis_failures() == 0);
}

TEST_CASE("Redis unreachable: the local fallback decides, says so, and Redis is asked again after the hold",
          "[scaleout][quota][faults]") {
  keel::redis_options r = quota_redis(keel_scaleout::fresh_name("quota"));
  r.port = keel_test::unused_loopback_port();
  keel::shared_quota q(r, {.name = "provider:m", .rate = 100, .fallback_rate = 10, .fallback_burst = 2,
                           .fallback_hold = 1s});
  manual_clock clock;
  for (int i = 0; i < 2; ++i) {
    const keel::shared_quota_decision d = q.try_acquire(clock.now());
    CHECK(d.granted);
    CHECK(d.source == keel::quota_source::fallback);
    CHECK(d.redis_error.code() == absl::StatusCode::kUnavailable);
  }
  const keel::shared_quota_decision refused = q.try_acquire(clock.now());
  CHECK_FALSE(refused.granted);
  CHECK(refused.source == keel::quota_source::fallback);
  CHECK(refused.retry_after == 100ms);
  const absl::Status s = keel::shared_quota::refusal(q.name(), refused);
  INFO(s.ToString());
  CHECK(keel::refused_by(s) == std::optional<std::string>("shared:provider:m:fallback"));
  CHECK(std::string(s.message()).find("Redis unreachable") != std::string::npos);
  CHECK(q.redis_failures() == 1);  // held on the fallback: no second connection attempt
  clock.advance(100ms);
  CHECK(q.try_acquire(clock.now()).granted);
  CHECK(q.redis_failures() == 1);
  clock.advance(1s);  // the hold is over: Redis is asked (and still fails)
  (void)q.try_acquire(clock.now());
  CHECK(q.redis_failures() == 2);
}

TEST_CASE("a Redis that stops answering sends decisions to the fallback until it answers again",
          "[scaleout][quota][faults]") {
  keel::redis_options r = quota_redis(keel_scaleout::fresh_name("quota"));
  r.command_timeout = 50ms;
  keel::shared_quota q(r, {.name = "provider:m", .rate = 1000, .burst = 100, .fallback_rate = 10, .fallback_burst = 5,
                           .fallback_hold = 1s});
  manual_clock clock;
  CHECK(q.try_acquire(clock.now()).source == keel::quota_source::shared);
  REQUIRE(redis_admin({"CLIENT", "PAUSE", "3000", "WRITE"}));
  const keel::shared_quota_decision d = q.try_acquire(clock.now());
  REQUIRE(redis_admin({"CLIENT", "UNPAUSE"}));
  INFO(d.redis_error.ToString());
  CHECK(d.granted);
  CHECK(d.source == keel::quota_source::fallback);
  CHECK(keel::is_unknown_outcome(d.redis_error));  // the script may have run: the fallback decides anyway
  CHECK(q.try_acquire(clock.now()).source == keel::quota_source::fallback);  // held
  clock.advance(1s);
  CHECK(q.try_acquire(clock.now()).source == keel::quota_source::shared);
}

TEST_CASE("as a pipeline level after admission: refusal before the work, replays not charged",
          "[scaleout][quota][pipeline]") {
  manual_clock clock;
  keel::admission quotas({.tenant_defaults = {.max_in_flight = 4}});
  keel::shared_quota provider(quota_redis(keel_scaleout::fresh_name("quota")),
                              {.name = "provider:m", .rate = 1, .per = 1h, .burst = 1, .fallback_rate = 1});
  struct seen {
    std::vector<std::string>* log;
    void operator()(const keel::events::shared_quota_refused& e) const { log->push_back(std::string(e.name)); }
  };
  std::vector<std::string> refusals;
  auto pipe = keel::pipeline(quotas, provider).in(keel::environment{clock}.with_listener(seen{&refusals}));
  int ran = 0;
  auto work = [&](const keel::attempt&) -> absl::StatusOr<int> {
    ++ran;
    return 7;
  };
  const keel::labels acme{.tenant = "acme", .model = "m"};
  keel::call first(clock.now(), {.labels = acme});
  CHECK(pipe.run(first, work).ok());
  keel::call second(clock.now(), {.labels = acme});
  const absl::StatusOr<int> r = pipe.run(second, work);
  CHECK(keel::refused_by(r.status()) == std::optional<std::string>("shared:provider:m:rate"));
  CHECK(keel::not_started(r.status()));
  CHECK(ran == 1);  // refused before the work
  CHECK(refusals == std::vector<std::string>{"provider:m"});
  CHECK(quotas.tenant_figures("acme", clock.now())->in_flight == 0);  // admission's slot went back
  keel::call replayed(clock.now(), {.labels = acme});
  replayed.mark_replayed();
  CHECK(pipe.run(replayed, work).ok());  // a replay spends no provider capacity
  CHECK(provider.shared_decisions() == 2);
}

TEST_CASE("all-or-nothing across the shared level: its refusal leaves the tenant's tokens as they were",
          "[scaleout][quota][pipeline]") {
  manual_clock clock;  // frozen: the tenant's bucket refills nothing while the test runs
  keel::admission quotas({.tenant_defaults = {.rate = 2, .burst = 2}});
  keel::shared_quota provider(quota_redis(keel_scaleout::fresh_name("quota")),
                              {.name = "provider:m", .rate = 1, .per = 1h, .burst = 1, .fallback_rate = 1});
  auto pipe = keel::pipeline(quotas, provider).in(keel::environment{clock});
  int ran = 0;
  auto work = [&](const keel::attempt&) -> absl::StatusOr<int> {
    ++ran;
    return 7;
  };
  const keel::labels acme{.tenant = "acme", .model = "m"};
  keel::call first(clock.now(), {.labels = acme});
  REQUIRE(pipe.run(first, work).ok());  // the fleet's one unit, and one of the tenant's two tokens
  REQUIRE(quotas.tenant_figures("acme", clock.now())->rate_available == 1.0);

  // The shared quota is exhausted: every further call is refused by it, never
  // by the tenant's rate, because a refused call gives the tenant's token back.
  for (int i = 0; i < 3; ++i) {
    keel::call c(clock.now(), {.labels = acme});
    const absl::StatusOr<int> r = pipe.run(c, work);
    CHECK(r.status().code() == absl::StatusCode::kResourceExhausted);
    CHECK(r.status().message() == "keel: shared quota 'provider:m' is over its rate");
    CHECK(keel::refused_by(r.status()) == std::optional<std::string>("shared:provider:m:rate"));
    CHECK(keel::not_started(r.status()));
  }
  CHECK(ran == 1);
  CHECK(quotas.tenant_figures("acme", clock.now())->rate_available == 1.0);
  CHECK(provider.fallback_decisions() == 0);
}

TEST_CASE("all-or-nothing across the shared level: a refusal further in gives the shared unit back",
          "[scaleout][quota][pipeline]") {
  manual_clock clock;
  keel::admission quotas({.tenant_defaults = {.rate = 2, .burst = 2}});
  keel::shared_quota provider(quota_redis(keel_scaleout::fresh_name("quota")),
                              {.name = "provider:m", .rate = 2, .per = 1h, .burst = 2, .fallback_rate = 1});
  keel::circuit_breaker breaker({.name = "llm"});
  breaker.force_open(clock.now());
  auto pipe = keel::pipeline(quotas, provider, breaker).in(keel::environment{clock});
  int ran = 0;
  auto work = [&](const keel::attempt&) -> absl::StatusOr<int> {
    ++ran;
    return 7;
  };
  const keel::labels acme{.tenant = "acme", .model = "m"};
  // More refusals than either bucket holds: the breaker refuses them all,
  // and neither the shared unit nor the tenant's token is kept.
  for (int i = 0; i < 3; ++i) {
    keel::call c(clock.now(), {.labels = acme});
    const absl::StatusOr<int> r = pipe.run(c, work);
    CHECK(keel::refused_by(r.status()) == std::optional<std::string>("breaker:llm"));
  }
  CHECK(ran == 0);
  CHECK(quotas.tenant_figures("acme", clock.now())->rate_available == 2.0);
  // The fleet's bucket still holds both units.
  const keel::time_point now = clock.now();
  CHECK(provider.try_acquire(now).granted);
  CHECK(provider.try_acquire(now).granted);
  CHECK_FALSE(provider.try_acquire(now).granted);
  CHECK(provider.fallback_decisions() == 0);
}

// --- tokens as the unit (issue 14) ---------------------------------------------

TEST_CASE("tokens: a pass reserves its estimate and settles fleet-wide to what its attempt charged",
          "[scaleout][quota][tokens]") {
  const std::string prefix = keel_scaleout::fresh_name("quota");
  // 1,000 tokens per 100 h: the bucket refills one token per 6 minutes, nothing while the test runs.
  const keel::shared_quota_options o{
      .name = "provider:m:tpm", .rate = 1000, .per = 100h, .burst = 1000, .fallback_rate = 100};
  keel::shared_quota a(quota_redis(prefix), o), b(quota_redis(prefix), o);
  manual_clock clock;
  const bool over = GENERATE(false, true);
  const std::int64_t estimate = over ? 100 : 400, used = over ? 400 : 100;
  auto pipe = keel::pipeline(a.with_estimate([&](const keel::call&) { return estimate; })).in(keel::environment{clock});
  auto work = [&](const keel::attempt& at) -> absl::StatusOr<int> {
    at.charge(used);
    return 7;
  };
  keel::call c(clock.now(), {});
  REQUIRE(pipe.run(c, work).ok());
  // The other replica sees the settled bucket: 1,000 - used, whatever the estimate was.
  const keel::time_point now = clock.now();
  CHECK_FALSE(b.try_acquire(now, static_cast<double>(1000 - used + 1)).granted);
  CHECK(b.try_acquire(now, static_cast<double>(1000 - used)).granted);
  CHECK_FALSE(b.try_acquire(now, 1).granted);
  CHECK(a.fallback_decisions() + b.fallback_decisions() == 0);
}

TEST_CASE("tokens: a stream's usage chunk settles the fleet's reservation; a refusal further in keeps nothing",
          "[scaleout][quota][tokens]") {
  const std::string prefix = keel_scaleout::fresh_name("quota");
  const keel::shared_quota_options o{
      .name = "provider:m:tpm", .rate = 1000, .per = 100h, .burst = 1000, .fallback_rate = 100};
  keel::shared_quota a(quota_redis(prefix), o), b(quota_redis(prefix), o);
  manual_clock clock;
  keel::deadline_timer guard_timer{clock};
  keel::stream_guard guard({.first_token = 2s, .stall = 1s}, guard_timer);
  keel::circuit_breaker breaker({.name = "llm"});
  auto pipe = keel::pipeline(keel::retry({.max_attempts = 1}),
                             a.with_estimate([](const keel::call&) { return std::int64_t{700}; }), breaker)
                  .in(keel::environment{clock});
  // Three tokens counted, the provider's bill 250: the bill settles.
  keel::testing::scripted_stream provider(
      clock, {{keel::testing::tok("a"), keel::testing::tok("b"), keel::testing::tok("c"),
               keel::testing::usage({.prompt_tokens = 50, .completion_tokens = 200, .total_tokens = 250}),
               keel::testing::end()}});
  keel::call c(clock.now(), {.timeout = 60s});
  keel::token_stream stream(guard, [](std::string_view) {});
  const absl::StatusOr<keel::stream_result> r = pipe.run(c, stream.attempts(provider));  // no time passes
  REQUIRE(r.ok());
  CHECK(r->charged == 250);
  // The breaker opens: a pass it refuses reserved 700 (of the 750 left) and gives them all back.
  breaker.force_open(clock.now());
  keel::call refused(clock.now(), {.timeout = 60s});
  const absl::StatusOr<keel::stream_result> no = pipe.run(refused, stream.attempts(provider));
  CHECK(keel::refused_by(no.status()) == std::optional<std::string>("breaker:llm"));
  CHECK(provider.invocations() == 1);
  const keel::time_point now = clock.now();
  CHECK_FALSE(b.try_acquire(now, 751).granted);
  CHECK(b.try_acquire(now, 750).granted);
}

TEST_CASE("tokens: an estimate over the burst reserves the burst and settles the rest; the fallback settles too",
          "[scaleout][quota][tokens][faults]") {
  manual_clock clock;
  const bool redis_down = GENERATE(false, true);
  keel::redis_options r = quota_redis(keel_scaleout::fresh_name("quota"));
  if (redis_down) r.port = keel_test::unused_loopback_port();
  keel::shared_quota q(r, {.name = "provider:m:tpm", .rate = 1000, .per = 100h, .burst = 500, .fallback_rate = 1000,
                           .fallback_burst = 500, .fallback_hold = 1h});
  CHECK(q.reservation(5000) == 500);
  CHECK(q.reservation(0) == 1);
  auto pipe = keel::pipeline(q.with_estimate([](const keel::call&) { return std::int64_t{5000}; })).in(keel::environment{clock});
  auto work = [&](const keel::attempt& at) -> absl::StatusOr<int> {
    at.charge(600);  // more than the bucket holds: it goes 100 into debt
    return 7;
  };
  keel::call c(clock.now(), {});
  REQUIRE(pipe.run(c, work).ok());
  const keel::shared_quota_decision d = q.try_acquire(clock.now(), 1);
  CHECK_FALSE(d.granted);
  CHECK(d.source == (redis_down ? keel::quota_source::fallback : keel::quota_source::shared));
  // The debt (100 tokens) plus the one asked for, at 1,000 per 100 h: 360 s per token.
  if (redis_down) CHECK(d.retry_after == 101 * 360s);
  if (!redis_down) CHECK(d.retry_after > 100 * 360s);
  if (!redis_down) CHECK(d.retry_after <= 101 * 360s);
}
