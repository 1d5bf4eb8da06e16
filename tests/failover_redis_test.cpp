// Redis failover with a real replica: a primary and one or two replicas
// started by the test (tests/servers/redis_pair.sh), K worker processes
// on keel::redis_store given every server (redis_options::endpoints: it
// follows whichever answers ROLE as primary), the replication link cut,
// the primary SIGKILLed and the replica promoted with REPLICAOF NO ONE.
// Replication is asynchronous: what the primary acknowledged after the cut
// is lost, and with sequential fences a fence already handed out is handed
// out again. The two remedies, each measured: fences from the server clock
// (never repeated), and wait_replicas (nothing acknowledged is lost).
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "keel/store/redis.hpp"
#include "keel/fleet/shared_concurrency.hpp"
#include "keel/fleet/shared_quota.hpp"
#include "support/catch.hpp"
#include "support/failover.hpp"

using namespace std::chrono_literals;
using keel_failover::server_pair;
using keel_failover::workers;

namespace {

std::string fresh_prefix() {
  static int n = 0;
  return "failover:" + std::to_string(::getpid()) + ":" + std::to_string(n++) + ":";
}

struct setup {
  keel::redis_fences fences = keel::redis_fences::sequential;
  int wait_replicas = 0;
  int replicas = 1;
};

template <class Done>
bool eventually(std::chrono::milliseconds limit, Done done) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(10ms);
  }
  return true;
}

keel_failover::verdict fail_over(const setup& how, const char* label) {
  server_pair pair("redis_pair.sh", std::to_string(how.replicas));
  std::string ports = pair.file("primary/port") + "," + pair.file("replica/port");
  if (how.replicas == 2) ports += "," + pair.file("replica2/port");
  const std::string prefix = fresh_prefix();
  keel::redis_options o{.key_prefix = prefix,
                        .command_timeout = 1s,
                        .fences = how.fences,
                        .wait_replicas = how.wait_replicas,
                        .wait_timeout = 200ms};
  for (const std::string& p : {pair.file("primary/port"), pair.file("replica/port")})
    o.endpoints.push_back({.host = "127.0.0.1", .port = std::stoi(p)});
  {
    workers w(3, 2, 4,
              {{"BACKEND", "redis"},
               {"PORTS", ports},
               {"NS", prefix},
               {"FENCES", how.fences == keel::redis_fences::from_clock ? "from_clock" : "sequential"},
               {"WAIT", std::to_string(how.wait_replicas)}});
    workers::run_for(1500ms);
    // Everything acknowledged so far is on the replica (INFO's offsets agree), then the link is cut.
    REQUIRE(w.pause());
    const int primary = std::stoi(pair.file("primary/port"));
    auto offset = [](int port, const char* field) {
      const std::string cmd = "redis-cli -p " + std::to_string(port) + " info replication | tr -d '\\r' | sed -n 's/^" +
                              field + "://p'";
      FILE* f = ::popen(cmd.c_str(), "r");
      char buf[128] = {};
      const bool got = f != nullptr && std::fgets(buf, sizeof buf, f) != nullptr;
      if (f != nullptr) ::pclose(f);
      return got ? std::string(buf) : std::string();
    };
    REQUIRE(eventually(10s, [&] {
      const std::string mine = offset(primary, "master_repl_offset");
      const std::string theirs = offset(std::stoi(pair.file("replica/port")), "slave_repl_offset");
      return !mine.empty() && mine == theirs;
    }));
    REQUIRE(pair.run("cut-link"));
    w.set_phase("B");
    workers::run_for(1000ms);
    w.set_phase("X");
    REQUIRE(pair.run("kill-primary"));
    REQUIRE(pair.run("promote"));
    w.set_phase("C");
    workers::run_for(2000ms);
    for (int rc : w.stop()) CHECK(rc == 0);
    const keel_failover::acks a = w.collect();
    INFO(w.errors());
    REQUIRE(a.complete);
    auto s = keel::redis_store::open(o);
    REQUIRE(s.ok());
    keel_failover::verdict v = keel_failover::verify(**s, a, "B");
    std::printf("redis failover (%s): %s\n", label, v.summary().c_str());
    return v;
  }
}

}  // namespace

TEST_CASE("redis failover, sequential fences: what the cut loses, a fence handed out twice, stale owners refused",
          "[failover][redis]") {
  keel_failover::verdict v = fail_over({}, "sequential fences");
  INFO(v.summary());
  REQUIRE(v.phases["A"].decisions > 0);
  REQUIRE(v.phases["B"].decisions > 0);
  REQUIRE(v.phases["C"].decisions > 0);
  CHECK(v.phases["A"].decisions_kept == v.phases["A"].decisions);
  CHECK(v.phases["C"].decisions_kept == v.phases["C"].decisions);
  CHECK(v.phases["B"].decisions_kept == 0);  // acknowledged, then lost
  CHECK(v.fences_reused > 0);                // what docs/scaleout.md warns of
  CHECK(v.stale_writes > 0);
  CHECK(v.stale_writes_refused == v.stale_writes);  // the owner check still refuses them
}

TEST_CASE("redis failover, fences from the clock: no fence is handed out twice", "[failover][redis]") {
  keel_failover::verdict v = fail_over({.fences = keel::redis_fences::from_clock}, "fences from the clock");
  INFO(v.summary());
  REQUIRE(v.phases["B"].claims > 0);
  REQUIRE(v.phases["C"].claims > 0);
  CHECK(v.phases["B"].decisions_kept == 0);  // decisions are still lost: only WAIT keeps them
  CHECK(v.fences_reused == 0);
  CHECK(v.new_claims_at_used_fence == 0);
  CHECK(v.fences_backwards == 0);
  CHECK(v.stale_writes_refused == v.stale_writes);
}

TEST_CASE("redis failover, wait_replicas = 1: nothing acknowledged is lost", "[failover][redis]") {
  keel_failover::verdict v = fail_over({.wait_replicas = 1, .replicas = 2}, "wait_replicas 1, two replicas");
  INFO(v.summary());
  REQUIRE(v.phases["A"].decisions > 0);
  REQUIRE(v.phases["C"].decisions > 0);
  CHECK(v.phases["B"].decisions == 0);  // no replica confirmed: unknown outcome, never acknowledged
  CHECK(v.phases["B"].claims == 0);
  for (const auto& [phase, f] : v.phases) CHECK(f.decisions_kept == f.decisions);
  CHECK(v.keys_decided_twice == 0);
  CHECK(v.fences_reused == 0);
  CHECK(v.fences_backwards == 0);
}

// The fleet-wide limits across a failover that loses the last writes: by
// how much, and for how long, the fleet goes over.
TEST_CASE("redis failover, fleet limits: over the limit by what the lost writes granted", "[failover][redis]") {
  server_pair pair("redis_pair.sh", "1");
  const int primary = std::stoi(pair.file("primary/port")), replica = std::stoi(pair.file("replica/port"));
  keel::redis_options ro{.key_prefix = fresh_prefix(), .command_timeout = 1s};
  ro.endpoints = {{.host = "127.0.0.1", .port = primary}, {.host = "127.0.0.1", .port = replica}};
  keel::shared_concurrency fleet(ro, {.name = "m", .limit = 4, .permit_ttl = 30s, .fallback_hold = 0ms});
  keel::shared_quota quota(ro, {.name = "q", .rate = 1, .per = 60s, .burst = 5, .fallback_rate = 1, .fallback_hold = 0ms});
  auto now = [] { return keel::real_clock{}.now(); };
  auto replicated = [&] {
    return eventually(10s, [&] {
      auto field = [](int port, const char* f) {
        const std::string cmd = "redis-cli -p " + std::to_string(port) + " info replication | tr -d '\\r' | sed -n 's/^" +
                                f + "://p'";
        FILE* p = ::popen(cmd.c_str(), "r");
        char buf[128] = {};
        const bool got = p != nullptr && std::fgets(buf, sizeof buf, p) != nullptr;
        if (p != nullptr) ::pclose(p);
        return got ? std::string(buf) : std::string();
      };
      const std::string a = field(primary, "master_repl_offset"), b = field(replica, "slave_repl_offset");
      return !a.empty() && a == b;
    });
  };
  std::vector<keel::shared_permit> held;
  for (int i = 0; i < 2; ++i) held.push_back(fleet.try_acquire(now()));
  REQUIRE(quota.try_acquire(now()).granted);
  REQUIRE(replicated());
  REQUIRE(pair.run("cut-link"));
  // The old primary grants the rest of the limit and of the burst; the replica never hears of it.
  for (int i = 0; i < 2; ++i) held.push_back(fleet.try_acquire(now()));
  for (const auto& p : held) REQUIRE((p && !p.local_share()));
  REQUIRE_FALSE(fleet.try_acquire(now()));
  int quota_before = 1;
  while (quota.try_acquire(now()).granted) ++quota_before;
  CHECK(quota_before == 5);
  REQUIRE(pair.run("kill-primary"));
  REQUIRE(pair.run("promote"));
  const auto promoted = std::chrono::steady_clock::now();
  // The first call after the kill may find its pooled connection dead (local share for it); then Redis again.
  std::vector<keel::shared_permit> after;
  REQUIRE(eventually(10s, [&] {
    keel::shared_permit p = fleet.try_acquire(now());
    const bool shared_answer = !p.local_share(), granted = static_cast<bool>(p);
    if (granted && shared_answer) after.push_back(std::move(p));
    return shared_answer && !granted && !after.empty();
  }));
  int quota_after = 0;
  for (int i = 0; i < 50; ++i) {
    const keel::shared_quota_decision d = quota.try_acquire(now());
    if (d.source == keel::quota_source::shared && !d.granted) break;
    if (d.source == keel::quota_source::shared) ++quota_after;
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - promoted).count();
  // Live at once: the 4 the old primary granted (their calls still run) and what the new one grants.
  const int live = static_cast<int>(held.size() + after.size());
  std::printf("redis failover, fleet limits: %d permits live for a limit of 4 (%zu granted after the promotion); "
              "%d quota units granted in %.2f s for a burst of 5 (%d before the failover, %d after)\n",
              live, after.size(), quota_before + quota_after, took, quota_before, quota_after);
  CHECK(after.size() == 2);  // the new primary knows only the 2 replicated permits
  CHECK(live == 6);          // over by the 2 granted in the window, while their calls run
  CHECK(quota_after == 4);   // the 4 units granted in the window are granted again
  // The lost permits' releases find nothing: they cannot remove someone else's.
  for (std::size_t i = 2; i < 4; ++i) {
    auto r = held[i].release();
    REQUIRE(r.ok());
    CHECK(*r == keel::permit_release::not_held);
  }
  CHECK_FALSE(fleet.try_acquire(now()));  // and freed nothing: the new primary's 4 are still held
}
