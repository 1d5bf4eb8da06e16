// A circuit breaker guarding a store (keel/store/guarded.hpp): a failing
// Redis opens it, refused operations never reach the server, and a probe
// closes it when the server answers again. Time is the manual clock.
#include "keel/store/guarded.hpp"

#include <chrono>
#include <memory>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include <hiredis/hiredis.h>

#include "keel/policy/circuit_breaker.hpp"
#include "keel/store/memory.hpp"
#include "keel/store/postgres.hpp"
#include "keel/store/redis.hpp"
#include "keel/testing/manual_clock.hpp"
#include "support/scaleout.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;
using keel::testing::manual_clock;

static_assert(keel::idempotency_store<keel::guarded_store<keel::postgres_store>>);
static_assert(keel::lease_store<keel::guarded_store<keel::redis_store>>);
static_assert(keel::result_store<keel::guarded_store<keel::redis_store>>);
static_assert(keel::notifying_store<keel::guarded_store<keel::memory_store>>);
static_assert(!keel::notifying_store<keel::guarded_store<keel::redis_store>>);

namespace {

void redis_admin(std::initializer_list<const char*> args) {
  redisContext* c = redisConnect("127.0.0.1", keel_scaleout::redis_port());
  REQUIRE((c != nullptr && c->err == 0));
  std::vector<const char*> argv(args);
  std::vector<std::size_t> lens;
  for (const char* a : argv) lens.push_back(std::strlen(a));
  auto* r = static_cast<redisReply*>(redisCommandArgv(c, static_cast<int>(argv.size()), argv.data(), lens.data()));
  const bool ok = r != nullptr && r->type == REDIS_REPLY_STATUS;
  if (r) freeReplyObject(r);
  redisFree(c);
  REQUIRE(ok);
}

}  // namespace

TEST_CASE("store health: answers are successes, cut-off writes ambiguous, refusals transient",
          "[scaleout][guard]") {
  CHECK(keel::store_health(absl::OkStatus()) == keel::outcome_kind::success);
  CHECK(keel::store_health(keel::lost_ownership_error("x")) == keel::outcome_kind::success);
  CHECK(keel::store_health(keel::conflict_error("x")) == keel::outcome_kind::success);
  CHECK(keel::store_health(absl::InvalidArgumentError("bad key")) == keel::outcome_kind::success);
  CHECK(keel::store_health(keel::unknown_outcome_error("commit", absl::UnavailableError("gone"))) ==
        keel::outcome_kind::ambiguous);
  CHECK(keel::store_health(keel::store_unavailable_error("refused")) == keel::outcome_kind::transient);
  CHECK(keel::store_health(absl::DeadlineExceededError("slow read")) == keel::outcome_kind::transient);
  CHECK(keel::store_health(absl::PermissionDeniedError("auth")) == keel::outcome_kind::permanent);
}

TEST_CASE("a breaker guarding Redis opens on failures, refuses without contacting it, and closes after a probe",
          "[scaleout][guard][redis]") {
  auto s = keel::redis_store::open({.port = keel_scaleout::redis_port(),
                                    .key_prefix = keel_scaleout::fresh_name("guard") + ":",
                                    .command_timeout = 100ms});
  REQUIRE(s.ok());
  keel::redis_store& store = **s;
  manual_clock clock;
  keel::circuit_breaker breaker({.name = "redis-store",
                                 .window_calls = 4,
                                 .minimum_calls = 3,
                                 .failure_rate_threshold = 0.5,
                                 .open_duration = 30s,
                                 .half_open_probes = 1});
  keel::guarded_store guarded(store, breaker, clock);

  auto lease = guarded.claim("job", keel::owner_id::random(), 10s);
  REQUIRE(lease.ok());
  REQUIRE(lease->acquired);
  CHECK(keel::is_lost_ownership(guarded.renew("job", {keel::owner_id::random(), 1}, 10s)));  // an answer
  CHECK(breaker.state() == keel::breaker_state::closed);

  redis_admin({"CLIENT", "PAUSE", "5000", "WRITE"});
  for (int i = 0; i < 2; ++i) {  // 2 failures of 4 calls: 50%, the threshold
    CHECK(breaker.state() == keel::breaker_state::closed);
    const absl::Status r = guarded.renew("job", lease->ownership, 10s);
    INFO(r.ToString());
    CHECK(keel::is_unknown_outcome(r));  // cut off by the command timeout
  }
  CHECK(breaker.state() == keel::breaker_state::open);

  const std::uint64_t sent = store.round_trips();
  const absl::Status refused = guarded.renew("job", lease->ownership, 10s);
  INFO(refused.ToString());
  CHECK(refused.code() == absl::StatusCode::kUnavailable);
  CHECK(keel::not_started(refused));
  CHECK(keel::refused_by(refused) == std::optional<std::string>("breaker:redis-store"));
  CHECK(keel::retry_after(refused) == std::optional<keel::duration>(30s));
  CHECK(store.round_trips() == sent);  // the server was not contacted

  redis_admin({"CLIENT", "UNPAUSE"});
  clock.advance(30s);
  CHECK(guarded.renew("job", lease->ownership, 10s).ok());  // the probe
  CHECK(breaker.state() == keel::breaker_state::closed);
  CHECK(store.round_trips() == sent + 1);
}
