// A network partition between a lease holder and its Redis: the store runs
// in a network namespace joined to the test by a veth pair
// (tests/servers/partition.sh; root only), the partition is a blackhole
// route on each side, so nothing leaves the namespaces the test made. The
// holder notices within its lease (its keeper's renewals fail), stops its
// work through the stop token; a worker inside the namespace takes the
// lease over with a higher fence; once healed, the old holder's late
// writes are refused.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <optional>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

#include "keel/durable/lease.hpp"
#include "keel/store/postgres.hpp"
#include "keel/store/redis.hpp"
#include "keel/fleet/shared_concurrency.hpp"
#include "support/catch.hpp"
#include "support/child_program.hpp"
#include "support/failover.hpp"
#include "support/temp_dir.hpp"

using namespace std::chrono_literals;

namespace {

std::string self_exe() {
  char buf[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string();
}

class partition {
 public:
  explicit partition(const std::string& with = {}) : dir_(root_.path() + "/net") {
    if (!keel_failover::control("partition.sh", "start", dir_, with)) {
      const std::string log = keel_test::read_file(dir_ + ".log");
      (void)keel_failover::control("partition.sh", "stop", dir_);  // the destructor will not run
      throw std::runtime_error("partition.sh start failed: " + log);
    }
  }
  ~partition() { (void)keel_failover::control("partition.sh", "stop", dir_); }
  partition(const partition&) = delete;
  partition& operator=(const partition&) = delete;
  bool cut() { return keel_failover::control("partition.sh", "cut", dir_); }
  bool heal() { return keel_failover::control("partition.sh", "heal", dir_); }
  [[nodiscard]] std::string ns() const { return keel_failover::first_line(dir_ + "/ns"); }
  [[nodiscard]] std::string ns_ip() const { return keel_failover::first_line(dir_ + "/ns_ip"); }

 private:
  keel_test::temp_dir root_;
  std::string dir_;
};

template <class Store>
void holder_partitioned(const char* what, partition& net, Store& store, const std::string& taker_kind) {
  constexpr keel::duration ttl = 1500ms;
  const keel::time_point confirmed = keel::real_clock{}.now();  // read before the claim is sent
  auto held = store.claim("report", keel::owner_id::random(), ttl);
  REQUIRE(held.ok());
  REQUIRE(held->acquired);
  std::stop_source work;
  keel::lease_keeper keeper(
      "report", [&](keel::duration t) { return store.renew("report", held->ownership, t); }, work, confirmed,
      {.ttl = ttl});
  std::this_thread::sleep_for(700ms);  // a renewal or two go through first
  REQUIRE_FALSE(work.stop_requested());

  const auto cut_at = std::chrono::steady_clock::now();
  REQUIRE(net.cut());
  // The holder's keeper fails to renew, and stops the work before its last
  // confirmed lease ends (margin ttl / 10): within ttl of the cut at most.
  const auto limit = cut_at + 5s;
  while (!work.stop_requested() && std::chrono::steady_clock::now() < limit) std::this_thread::sleep_for(5ms);
  const auto noticed = std::chrono::steady_clock::now() - cut_at;
  REQUIRE(work.stop_requested());
  CHECK(noticed <= ttl);
  CHECK_FALSE(keeper.status().ok());

  // A worker on the store's side of the cut takes the lease over once it
  // has expired on the server's clock.
  keel_test::child_program taker({"/usr/sbin/ip", "netns", "exec", net.ns(), "env", "KEEL_FAILOVER_BACKEND=taker",
                                  "KEEL_FAILOVER_THREADS=1", "KEEL_FAILOVER_KIND=" + taker_kind,
                                  "KEEL_FAILOVER_HOST=" + net.ns_ip(), self_exe(), "failover child process"});
  std::optional<std::string> line;
  for (int i = 0; i < 20; ++i) {
    line = taker.read_line(10s);
    if (!line || line->rfind("acquired ", 0) == 0) break;
  }
  REQUIRE(line.has_value());
  REQUIRE(line->rfind("acquired ", 0) == 0);
  const std::int64_t taker_fence = std::stoll(line->substr(9));
  CHECK(taker.wait(10s) == 0);
  CHECK(taker_fence > held->ownership.fence);

  // Healed: the old holder's late writes are refused.
  REQUIRE(net.heal());
  const auto refused = [&](auto op) {
    // The first statement after the heal may meet a connection the cut broke: not an answer.
    for (int i = 0; i < 5; ++i) {
      const absl::Status s = op();
      if (keel::is_lost_ownership(s)) return true;
      if (s.ok()) return false;
    }
    return false;
  };
  CHECK(refused([&] { return store.renew("report", held->ownership, ttl); }));
  CHECK(refused([&] { return store.release("report", held->ownership); }));
  std::printf("partition from %s: holder stopped %.0f ms after the cut (lease %lld ms); fences %lld -> %lld\n", what,
              std::chrono::duration<double, std::milli>(noticed).count(),
              static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(ttl).count()),
              static_cast<long long>(held->ownership.fence), static_cast<long long>(taker_fence));
}

}  // namespace

TEST_CASE("partition from Redis: the holder stops within its lease, the taker's fence is higher, late writes refused",
          "[failover][partition]") {
  if (::geteuid() != 0) {
    WARN("network namespaces need root: not run");
    return;
  }
  partition net;
  auto a = keel::redis_store::open({.host = net.ns_ip(),
                                    .key_prefix = "part:",
                                    .connect_timeout = 200ms,
                                    .command_timeout = 200ms,
                                    .acquire_timeout = 200ms});
  REQUIRE(a.ok());
  holder_partitioned("Redis", net, **a, "redis");
}

TEST_CASE("partition from PostgreSQL: the holder stops within its lease, the taker's fence is higher, late writes refused",
          "[failover][partition]") {
  if (::geteuid() != 0) {
    WARN("network namespaces need root: not run");
    return;
  }
  partition net("postgres");
  auto a = keel::postgres_store::open({.conninfo = "host=" + net.ns_ip() + " port=5432 user=keel dbname=postgres",
                                       .schema = "part",
                                       .pool_size = 2,
                                       .connect_timeout = 1s,
                                       .command_timeout = 200ms,
                                       .acquire_timeout = 200ms});
  REQUIRE(a.ok());
  holder_partitioned("PostgreSQL", net, **a, "postgres");
}

// The fleet-wide concurrency limit when one replica is partitioned from
// Redis and the others are not: the cut-off replica serves from its local
// share (limit / expected_replicas) while the others still fill the whole
// limit through Redis, so the fleet holds up to one local share per
// cut-off replica above the limit, for as long as the partition lasts.
TEST_CASE("partition from Redis, fleet limits: the cut-off replica's local share comes on top of the limit",
          "[failover][partition]") {
  if (::geteuid() != 0) {
    WARN("network namespaces need root: not run");
    return;
  }
  partition net;
  // Replica B, on Redis's side: takes the whole limit and holds it.
  keel_test::child_program b({"/usr/sbin/ip", "netns", "exec", net.ns(), "env", "KEEL_FAILOVER_BACKEND=fleet-holder",
                              "KEEL_FAILOVER_THREADS=1", "KEEL_FAILOVER_HOST=" + net.ns_ip(), self_exe(),
                              "failover child process"});
  std::optional<std::string> line;
  for (int i = 0; i < 20; ++i) {
    line = b.read_line(10s);
    if (!line || line->rfind("held ", 0) == 0) break;
  }
  REQUIRE(line.has_value());
  REQUIRE(*line == "held 4");
  // Replica A, here.
  keel::shared_concurrency a({.host = net.ns_ip(),
                              .key_prefix = "part:",
                              .connect_timeout = 200ms,
                              .command_timeout = 200ms,
                              .acquire_timeout = 200ms},
                             {.name = "m", .limit = 4, .permit_ttl = 30s, .expected_replicas = 2, .fallback_hold = 5s});
  auto now = [] { return keel::real_clock{}.now(); };
  {
    keel::shared_permit p = a.try_acquire(now());
    REQUIRE_FALSE(p);  // the fleet is full, and Redis says so
    REQUIRE_FALSE(p.local_share());
  }
  REQUIRE(net.cut());
  std::vector<keel::shared_permit> local;
  for (int i = 0; i < 4; ++i) {
    keel::shared_permit p = a.try_acquire(now());
    CHECK(p.local_share());
    if (p) local.push_back(std::move(p));
  }
  const int fleet = 4 + static_cast<int>(local.size());
  std::printf("partition from Redis, fleet limits: %d permits live for a limit of 4 (4 through Redis on one side, "
              "%zu from the local share on the other)\n",
              fleet, local.size());
  CHECK(local.size() == 2);  // limit / expected_replicas
  CHECK(fleet == 6);         // over by one local share per cut-off replica
  REQUIRE(net.heal());
  b.terminate(SIGKILL);
}
