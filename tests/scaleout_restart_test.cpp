// The server killed (PostgreSQL: immediate shutdown; Redis: SIGKILL, with
// AOF appendfsync always) and restarted while clients decide requests:
// clients see classified errors while it is down, recover when it returns,
// and no decision that was reported committed is lost.
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <libpq-fe.h>

#include "keel/core/call.hpp"
#include "keel/durable/digest.hpp"
#include "keel/durable/once.hpp"
#include "support/scaleout_backends.hpp"
#include "support/scaleout.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;
using keel_scaleout::backend;

namespace {

template <class Pred>
bool eventually(Pred pred, std::chrono::milliseconds limit) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(5ms);
  }
  return true;
}

keel::request_identity identity_of(const std::string& key) { return {.tenant = "t-1", .endpoint = "decide", .key = key}; }
keel::digest digest_of(const std::string& key) { return keel::digest_builder().field("request", key).finish(); }

struct worker_log {
  std::mutex mu;
  std::map<std::string, std::string> committed;  // key -> decision id, as reported to the caller
  std::vector<absl::Status> errors;              // what the caller saw while the server was away
  std::atomic<int> ok_after_restart{0};
};

// Shortens crash recovery so the restart takes a moment, not seconds; the
// crash itself is still immediate: syncfs replaces recovery's fsync of every
// file in the throwaway cluster (thousands: one schema per test) with one
// call. (The redo of the WAL since the last checkpoint is quick.)
template <class Store>
void before_kill() {}
template <>
void before_kill<keel::postgres_store>() {
  PGconn* c = PQconnectdb(keel_scaleout::pg_conninfo().c_str());
  PQclear(PQexec(c, "ALTER SYSTEM SET recovery_init_sync_method = 'syncfs'"));
  PQclear(PQexec(c, "SELECT pg_reload_conf()"));
  PQfinish(c);
}

}  // namespace

TEMPLATE_TEST_CASE("the server killed and restarted mid-run: classified errors, recovery, no committed decision lost",
                   "[scaleout][restart]", keel::postgres_store, keel::redis_store) {
  using B = backend<TestType>;
  const std::string server = B::name;
  const std::string ns = keel_scaleout::fresh_name("restart");
  auto offset = std::make_shared<std::atomic<std::int64_t>>(0);
  auto store = B::open(ns, offset, 8);
  keel_scaleout::restart_guard guard(server);
  constexpr int threads = 4;
  const keel::idempotency_options io{.lease = 30s, .retention = 2h, .retry_window = 1h};

  std::vector<worker_log> logs(threads);
  std::atomic<bool> stop{false}, restarted{false};
  std::atomic<int> successes{0}, errors{0};
  {
    // Each client decides its requests one after another and, like a real
    // client, retries a request that failed until it gets an answer.
    std::vector<std::jthread> workers;
    for (int t = 0; t < threads; ++t)
      workers.emplace_back([&, t] {
        keel::once<TestType> decide(*store, io);
        for (int i = 0; !stop.load(); ++i) {
          const std::string key = "k-" + std::to_string(t) + "-" + std::to_string(i);
          while (!stop.load()) {
            keel::call call(keel::real_clock{}.now(), {.timeout = 5s});
            auto r = decide.run(call, identity_of(key), digest_of(key),
                                [&](const keel::claim_context&) -> absl::StatusOr<keel::decision> {
                                  return keel::decision{.model_digest = "m", .result = key};
                                });
            std::lock_guard lock(logs[t].mu);
            if (r.ok()) {
              logs[t].committed[key] = r->decision.id;
              successes.fetch_add(1);
              if (restarted.load()) logs[t].ok_after_restart.fetch_add(1);
              break;
            }
            logs[t].errors.push_back(r.status());
            errors.fetch_add(1);
            std::this_thread::sleep_for(20ms);  // a client's pause before retrying
          }
        }
      });

    REQUIRE(eventually([&] { return successes.load() >= 40; }, 30s));
    before_kill<TestType>();
    REQUIRE(guard.kill());
    REQUIRE(eventually([&] { return errors.load() >= threads; }, 30s));
    REQUIRE(guard.restart());
    // A write cut off mid-claim leaves its record in flight under an owner
    // that gave up; move the server's clock past that lease so the retries
    // take it over now instead of in 30 s.
    offset->fetch_add(keel::detail::to_ns(31s));
    restarted.store(true);
    const bool recovered = eventually(
        [&] {
          for (auto& l : logs)
            if (l.ok_after_restart.load() < 3) return false;
          return true;
        },
        30s);
    stop.store(true);
    CHECK(recovered);  // every client works again once the server is back
  }

  // Every error was classified: transient and not started (refused before
  // anything was sent), or an unknown outcome (a write cut off mid-flight).
  int unknown = 0, unavailable = 0;
  for (auto& l : logs) {
    for (const absl::Status& s : l.errors) {
      INFO(server << ": " << s.ToString());
      const bool refused = s.code() == absl::StatusCode::kUnavailable && keel::not_started(s);
      const bool cut_off = keel::is_unknown_outcome(s);
      CHECK((refused || cut_off));
      const keel::outcome_kind kind = keel::default_classifier{}(s, {.effect = keel::effect::write});
      CHECK((kind == keel::outcome_kind::transient || kind == keel::outcome_kind::ambiguous));
      unknown += cut_off;
      unavailable += refused;
    }
  }
  CHECK(errors.load() > 0);
  CHECK(unavailable > 0);
  UNSCOPED_INFO(server << ": " << successes.load() << " decided, " << unavailable << " refused while down, " << unknown
                       << " cut off mid-write");

  // No decision reported to a caller was lost.
  const keel::begin_options bo{.lease = 30s, .retention = 2h};
  int checked = 0;
  for (auto& l : logs) {
    for (const auto& [key, id] : l.committed) {
      auto r = store->begin(identity_of(key), digest_of(key), keel::owner_id::random(), bo);
      REQUIRE(r.ok());
      INFO(server << " " << key);
      CHECK(r->state == keel::begin_state::replay);
      CHECK(r->decision.id == id);
      ++checked;
    }
  }
  CHECK(checked == successes.load());

}
