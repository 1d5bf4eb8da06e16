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

#include "keel/store/redis.hpp"
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
