// K = 4 real processes against the real Redis the ctest fixture starts,
// sharing one concurrency limit and one provider state:
//
//   - the fleet's in-flight count never exceeds the limit at any instant,
//     measured on the provider's side: a counter in shared memory that every
//     process raises inside its permit, with the highest value seen kept;
//   - the permits of a SIGKILLed replica return when they expire;
//   - a breaker opened in one replica stops the others, and their half-open
//     probing sends max_probes probes for the fleet, not per replica;
//   - a provider's cooldown hint heard by one replica is honoured by all;
//   - with Redis killed, each replica takes at most its local share, so the
//     fleet stays within the limit; after the restart they are back on Redis.
//
// Children are this test binary re-executed, running only the hidden test
// case "scaleout fleet child process" (support/child_process.hpp).
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "keel/compose/pipeline.hpp"
#include "keel/policy/breaker_registry.hpp"
#include "keel/fleet/shared_concurrency.hpp"
#include "keel/fleet/shared_provider_state.hpp"
#include "support/catch.hpp"
#include "support/child_process.hpp"
#include "support/scaleout.hpp"

using namespace std::chrono_literals;

namespace {

constexpr int replicas = 4;
constexpr int phases = 6;  // the outage test's phases; the last one means "stop"

// The provider's side, in a shared file every process maps.
struct provider_side {
  std::atomic<int> in_flight;
  std::atomic<int> max_in_flight[phases];
  std::atomic<int> phase;
  std::atomic<int> ready;  // children set up and waiting
  std::atomic<long> calls[replicas];
  std::atomic<long> shared_grants[replicas][phases];
  std::atomic<long> local_grants[replicas][phases];
};
static_assert(std::atomic<int>::is_always_lock_free && std::atomic<long>::is_always_lock_free);

class shared_file {
 public:
  explicit shared_file(const std::string& path, bool create) : path_(path), owner_(create) {
    const int fd = ::open(path.c_str(), create ? O_RDWR | O_CREAT | O_TRUNC : O_RDWR, 0600);
    if (fd < 0) throw std::runtime_error("cannot open " + path);
    if (create && ::ftruncate(fd, sizeof(provider_side)) != 0) throw std::runtime_error("ftruncate failed");
    void* p = ::mmap(nullptr, sizeof(provider_side), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) throw std::runtime_error("mmap failed");
    side_ = static_cast<provider_side*>(p);  // a zero-filled file: every atomic starts at 0
  }
  ~shared_file() {
    ::munmap(side_, sizeof(provider_side));
    if (owner_) std::remove(path_.c_str());
  }
  shared_file(const shared_file&) = delete;
  shared_file& operator=(const shared_file&) = delete;
  provider_side* operator->() const noexcept { return side_; }

 private:
  std::string path_;
  bool owner_;
  provider_side* side_ = nullptr;
};

std::string env(const char* name) { return keel_test::child_var("KEEL_FLEET_", name); }

pid_t spawn(const std::string& role, std::map<std::string, std::string> vars) {
  vars["ROLE"] = role;
  return keel_test::spawn_self(
      {.test_case = "scaleout fleet child process", .env_prefix = "KEEL_FLEET_", .vars = std::move(vars)});
}

keel::redis_options child_redis() {
  return {.port = keel_scaleout::redis_port(),
          .key_prefix = env("PREFIX"),
          .pool_size = 4,
          .connect_timeout = 200ms,
          .command_timeout = 500ms,
          .acquire_timeout = 500ms};
}

const keel::labels llm{.model = "m-large", .endpoint = "api.provider", .region = "eu"};

void raise_max(std::atomic<int>& max, int v) {
  int m = max.load();
  while (v > m && !max.compare_exchange_weak(m, v)) {
  }
}

// ---- child roles ------------------------------------------------------------

// In a child: says it is set up, then waits (bounded) for the parent's go.
void ready_then_wait(provider_side& side) {
  side.ready.fetch_add(1);
  const auto limit = std::chrono::steady_clock::now() + 120s;
  while (side.phase.load() == 0 && std::chrono::steady_clock::now() < limit) std::this_thread::sleep_for(1ms);
}


// THREADS threads take permits until the phase reaches the last one, hold
// each for ~1 ms while counting themselves in the provider's in-flight count.
int child_permits(provider_side& side, int me) {
  keel::shared_concurrency c(child_redis(), {.name = "provider:m-large",
                                             .limit = std::stoi(env("LIMIT")),
                                             .permit_ttl = std::chrono::milliseconds(std::stoi(env("TTL_MS"))),
                                             .expected_replicas = replicas,
                                             .fallback_hold = 200ms});
  const int threads = std::stoi(env("THREADS"));
  std::vector<std::jthread> workers;
  for (int t = 0; t < threads; ++t)
    workers.emplace_back([&] {
      for (int before = side.phase.load(); before < phases - 1; before = side.phase.load()) {
        keel::shared_permit p = c.try_acquire(keel::real_clock{}.now());
        if (!p) {
          std::this_thread::sleep_for(std::min<keel::duration>(p.retry_after(), 2ms));
          continue;
        }
        const int now_in = side.in_flight.fetch_add(1) + 1;
        const int phase = side.phase.load();
        raise_max(side.max_in_flight[phase], now_in);
        // A grant is counted in a phase only when it was decided wholly inside it.
        if (phase == before) (p.local_share() ? side.local_grants : side.shared_grants)[me][phase].fetch_add(1);
        side.calls[me].fetch_add(1);
        std::this_thread::sleep_for(1ms);
        side.in_flight.fetch_sub(1);
        (void)p.release();
      }
    });
  return 0;
}

// Takes HOLD permits, says so, and waits to be killed.
[[noreturn]] void child_holder() {
  static keel::shared_concurrency c(child_redis(), {.name = "provider:m-large",
                                                    .limit = std::stoi(env("LIMIT")),
                                                    .permit_ttl = std::chrono::milliseconds(std::stoi(env("TTL_MS")))});
  static std::vector<keel::shared_permit> held;
  for (int i = 0, n = std::stoi(env("HOLD")); i < n; ++i) {
    held.push_back(c.try_acquire(keel::real_clock{}.now()));
    if (!held.back()) throw std::runtime_error("the holder could not take its permits");
  }
  std::ofstream(env("OUT"), std::ios::trunc) << "held\n";
  for (;;) std::this_thread::sleep_for(1s);
}

// Through (shared provider state, breaker registry): MODE trip sends calls
// that fail until its breaker opens; MODE follow sends calls for MILLIS to
// a provider still failing and counts what stopped them; MODE throttle gets
// one cooldown hint; MODE after-cooldown is refused by the cooldown, waits
// it out, then is served.
int child_state(provider_side& side, int me) {
  keel::breaker_registry breakers({.breaker = {.window_calls = 5, .minimum_calls = 5, .open_duration = 2s}});
  keel::shared_provider_state state(child_redis(),
                                    {.refresh_every = 20ms, .max_probes = 1, .probe_window = 1s, .reopen_for = 30s},
                                    &breakers);
  auto pipe = keel::pipeline(state, breakers);
  const std::string mode = env("MODE");
  auto failing = [&](const keel::attempt&) -> absl::StatusOr<int> {
    side.calls[me].fetch_add(1);
    return absl::UnavailableError("503 the provider is down");
  };
  auto throttled = [&](const keel::attempt&) -> absl::StatusOr<int> {
    side.calls[me].fetch_add(1);
    return keel::with_retry_after(absl::ResourceExhaustedError("429"), 5s);
  };
  auto healthy = [&](const keel::attempt&) -> absl::StatusOr<int> {
    side.calls[me].fetch_add(1);
    return 1;
  };
  std::ofstream out(env("OUT"), std::ios::trunc);
  if (mode == "trip") {
    for (int i = 0; i < 5; ++i) {
      keel::call c(keel::real_clock{}.now(), {.labels = llm});
      (void)pipe.run(c, failing);
    }
    out << keel::to_string(breakers.breaker_for(llm).state()) << "\n";
  } else if (mode == "follow") {
    ready_then_wait(side);
    long breaker = 0, probing = 0, other = 0;
    const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(std::stoi(env("MILLIS")));
    while (std::chrono::steady_clock::now() < end) {
      keel::call c(keel::real_clock{}.now(), {.labels = llm});
      const absl::Status s = pipe.run(c, failing).status();
      const std::string by = keel::refused_by(s).value_or("");
      if (by == "fleet:endpoint=api.provider,model=m-large,region=eu:breaker") {
        ++breaker;
      } else if (by == "fleet:endpoint=api.provider,model=m-large,region=eu:probing") {
        ++probing;
      } else {
        ++other;
      }
      std::this_thread::sleep_for(2ms);
    }
    out << breaker << " " << probing << " " << other << "\n";
  } else if (mode == "throttle") {
    keel::call c(keel::real_clock{}.now(), {.labels = llm});
    out << (pipe.run(c, throttled).status().code() == absl::StatusCode::kResourceExhausted ? "throttled" : "?") << "\n";
  } else {
    ready_then_wait(side);
    keel::call first(keel::real_clock{}.now(), {.labels = llm});
    const absl::Status s = pipe.run(first, healthy).status();
    const keel::duration wait = keel::retry_after(s).value_or(keel::duration::zero());
    std::this_thread::sleep_for(wait + 50ms);  // the cooldown's end, plus more than refresh_every
    keel::call second(keel::real_clock{}.now(), {.labels = llm});
    const bool served = pipe.run(second, healthy).ok();
    out << keel::refused_by(s).value_or("none") << " " << std::chrono::duration_cast<std::chrono::milliseconds>(wait).count()
        << " " << (served ? "served" : "refused") << "\n";
  }
  return 0;
}

// In the parent: waits (in real time, bounded) until `done` holds. Children
// start slowly under sanitizers on a loaded machine: the test waits for what
// it needs to have happened instead of guessing how long it takes.
template <class Done>
bool await(Done done, std::chrono::seconds limit = 120s) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(2ms);
  }
  return true;
}

std::vector<long> numbers(const std::string& text) {
  std::istringstream in(text);
  std::vector<long> v;
  for (long x; in >> x;) v.push_back(x);
  return v;
}

}  // namespace

TEST_CASE("scaleout fleet child process", "[.]") {
  const std::string role = env("ROLE");
  if (role.empty()) return;  // run by hand: nothing to do
  int rc = 64;
  try {
    if (role == "holder") child_holder();
    shared_file side(env("SIDE"), false);
    const int me = std::stoi(env("INDEX"));
    rc = role == "permits" ? child_permits(*side.operator->(), me) : child_state(*side.operator->(), me);
  } catch (const std::exception& e) {
    std::ofstream(env("OUT") + ".error") << e.what() << "\n";
    rc = 70;
  }
  std::fflush(nullptr);
  std::_Exit(rc);
}

TEST_CASE("K processes share one concurrency limit: the provider never sees more in flight than the limit",
          "[scaleout][fleet][processes]") {
  constexpr int limit = 5;
  const std::string side_path = keel_scaleout::temp_path("fleet-side");
  shared_file side(side_path, true);
  const std::string prefix = keel_scaleout::fresh_name("fleet") + ":";
  std::vector<pid_t> children;
  for (int i = 0; i < replicas; ++i)
    children.push_back(spawn("permits", {{"PREFIX", prefix},
                                         {"SIDE", side_path},
                                         {"INDEX", std::to_string(i)},
                                         {"LIMIT", std::to_string(limit)},
                                         {"TTL_MS", "10000"},
                                         {"THREADS", "4"},
                                         {"OUT", keel_scaleout::temp_path("fleet-out")}}));
  const bool all_started = await([&] {
    for (int i = 0; i < replicas; ++i)
      if (side->calls[i].load() == 0) return false;
    return true;
  });
  CHECK(all_started);
  std::this_thread::sleep_for(1000ms);  // how long they hammer together (not a correctness wait)
  side->phase.store(phases - 1);
  for (pid_t pid : children) CHECK(keel_scaleout::wait_child(pid) == 0);
  long calls = 0, local = 0;
  for (int i = 0; i < replicas; ++i) {
    calls += side->calls[i].load();
    local += side->local_grants[i][0].load();
    CHECK(side->calls[i].load() > 0);  // every replica got permits
  }
  INFO(calls << " calls; the provider saw at most " << side->max_in_flight[0].load() << " at once");
  CHECK(local == 0);
  CHECK(side->max_in_flight[0].load() <= limit);  // the safety bound, at every instant
  CHECK(side->max_in_flight[0].load() >= 2);      // and the replicas did overlap
  CHECK(side->in_flight.load() == 0);
}

TEST_CASE("the permits of a SIGKILLed replica return to the fleet when they expire", "[scaleout][fleet][processes]") {
  constexpr int limit = 3;
  const std::string prefix = keel_scaleout::fresh_name("fleet") + ":";
  const std::string out = keel_scaleout::temp_path("fleet-holder");
  const pid_t holder = spawn("holder", {{"PREFIX", prefix}, {"LIMIT", std::to_string(limit)}, {"TTL_MS", "4000"},
                                        {"HOLD", std::to_string(limit)}, {"OUT", out}});
  const std::string said = keel_test::await_line(out);
  REQUIRE(said == "held\n");
  ::kill(holder, SIGKILL);
  CHECK(keel_scaleout::wait_child(holder) == 128 + SIGKILL);
  std::remove(out.c_str());
  keel::shared_concurrency survivor({.port = keel_scaleout::redis_port(), .key_prefix = prefix},
                                    {.name = "provider:m-large", .limit = limit});
  const keel::shared_permit refused = survivor.try_acquire(keel::real_clock{}.now());
  REQUIRE_FALSE(refused);  // the dead replica's permits are still held ...
  CHECK(refused.held() == limit);
  CHECK(refused.retry_after() <= 4s);
  std::this_thread::sleep_for(refused.retry_after() + 100ms);  // ... until they expire (all were taken at once)
  std::vector<keel::shared_permit> back;
  for (int i = 0; i < limit; ++i) {
    back.push_back(survivor.try_acquire(keel::real_clock{}.now()));
    CHECK(back.back());
  }
  CHECK_FALSE(survivor.try_acquire(keel::real_clock{}.now()));
}

TEST_CASE("a breaker opened in one replica stops the others; the fleet sends max_probes half-open probes, not K times",
          "[scaleout][fleet][processes][state]") {
  const std::string side_path = keel_scaleout::temp_path("fleet-side");
  shared_file side(side_path, true);
  const std::string prefix = keel_scaleout::fresh_name("fleet") + ":";
  // The others start first and wait; once the tripper's breaker is open they
  // run until past its open period (2 s): every call is refused by the
  // fleet's breaker, then, fleet half-open, one probe (it fails: the
  // provider is still down) reopens it for 30 s.
  std::vector<pid_t> followers;
  std::vector<std::string> outs;
  for (int i = 1; i < replicas; ++i) {
    outs.push_back(keel_scaleout::temp_path("fleet-follow"));
    followers.push_back(spawn("state", {{"PREFIX", prefix},
                                        {"SIDE", side_path},
                                        {"INDEX", std::to_string(i)},
                                        {"MODE", "follow"},
                                        {"MILLIS", "3500"},
                                        {"OUT", outs.back()}}));
  }
  CHECK(await([&] { return side->ready.load() == replicas - 1; }));
  const std::string trip_out = keel_scaleout::temp_path("fleet-trip");
  const pid_t tripper =
      spawn("state", {{"PREFIX", prefix}, {"SIDE", side_path}, {"INDEX", "0"}, {"MODE", "trip"}, {"OUT", trip_out}});
  REQUIRE(keel_scaleout::wait_child(tripper) == 0);
  CHECK(keel_scaleout::read_file(trip_out) == "open\n");
  std::remove(trip_out.c_str());
  CHECK(side->calls[0].load() == 5);
  side->phase.store(1);  // go
  for (pid_t pid : followers) CHECK(keel_scaleout::wait_child(pid) == 0);
  long probes = 0, refused_breaker = 0;
  for (int i = 1; i < replicas; ++i) {
    const std::vector<long> v = numbers(keel_scaleout::read_file(outs[i - 1]));
    std::remove(outs[i - 1].c_str());
    REQUIRE(v.size() == 3);
    INFO("replica " << i << ": refused by the fleet's breaker " << v[0] << ", probing " << v[1] << ", other " << v[2]);
    CHECK(v[0] > 0);  // stopped by another replica's breaker
    CHECK(v[2] == side->calls[i].load());  // only its probes reached the provider
    refused_breaker += v[0];
    probes += side->calls[i].load();
  }
  // Each follower's own breaker would have let 5 calls fail, then probed 3
  // times: up to 24 calls; the fleet sent one probe.
  CHECK(probes == 1);
  CHECK(refused_breaker > 0);
}

TEST_CASE("a cooldown hint one replica got is honoured by every replica until it ends", "[scaleout][fleet][processes][state]") {
  const std::string side_path = keel_scaleout::temp_path("fleet-side");
  shared_file side(side_path, true);
  const std::string prefix = keel_scaleout::fresh_name("fleet") + ":";
  std::vector<pid_t> others;
  std::vector<std::string> outs;
  for (int i = 1; i < replicas; ++i) {
    outs.push_back(keel_scaleout::temp_path("fleet-cool"));
    others.push_back(spawn("state", {{"PREFIX", prefix},
                                     {"SIDE", side_path},
                                     {"INDEX", std::to_string(i)},
                                     {"MODE", "after-cooldown"},
                                     {"OUT", outs.back()}}));
  }
  CHECK(await([&] { return side->ready.load() == replicas - 1; }));  // set up before the hint arrives
  const std::string out0 = keel_scaleout::temp_path("fleet-throttle");
  const pid_t first =
      spawn("state", {{"PREFIX", prefix}, {"SIDE", side_path}, {"INDEX", "0"}, {"MODE", "throttle"}, {"OUT", out0}});
  REQUIRE(keel_scaleout::wait_child(first) == 0);
  CHECK(keel_scaleout::read_file(out0) == "throttled\n");
  std::remove(out0.c_str());
  side->phase.store(1);  // go
  for (pid_t pid : others) CHECK(keel_scaleout::wait_child(pid) == 0);
  for (int i = 1; i < replicas; ++i) {
    const std::string said = keel_scaleout::read_file(outs[i - 1]);
    std::remove(outs[i - 1].c_str());
    INFO("replica " << i << ": " << said);
    std::istringstream in(said);
    std::string by, served;
    long wait_ms = -1;
    in >> by >> wait_ms >> served;
    CHECK(by == "fleet:endpoint=api.provider,model=m-large,region=eu:cooldown");
    CHECK(wait_ms > 0);
    CHECK(wait_ms <= 5000);
    CHECK(served == "served");  // after the cooldown, it sends again
    CHECK(side->calls[i].load() == 1);  // and only then
  }
}

TEST_CASE("Redis killed: every replica takes its local share, so the fleet stays within the limit; back on Redis "
          "after the restart",
          "[scaleout][fleet][processes][faults]") {
  constexpr int limit = 8;  // a local share of 2 per replica
  const std::string side_path = keel_scaleout::temp_path("fleet-side");
  shared_file side(side_path, true);
  const std::string prefix = keel_scaleout::fresh_name("fleet") + ":";
  keel_scaleout::restart_guard redis("redis");
  std::vector<pid_t> children;
  for (int i = 0; i < replicas; ++i)
    children.push_back(spawn("permits", {{"PREFIX", prefix},
                                         {"SIDE", side_path},
                                         {"INDEX", std::to_string(i)},
                                         {"LIMIT", std::to_string(limit)},
                                         {"TTL_MS", "1000"},
                                         {"THREADS", "4"},
                                         {"OUT", keel_scaleout::temp_path("fleet-out")}}));
  // Phases: 0 Redis up; 1 just killed (shared permits still out finish);
  // 2 the outage; 3 just restarted (local permits still out finish); 4 back.
  // Each phase lasts until every replica has done what the phase is about.
  auto every = [&](std::atomic<long> (&grants)[replicas][phases], int phase) {
    return [&grants, phase] {
      for (int i = 0; i < replicas; ++i)
        if (grants[i][phase].load() == 0) return false;
      return true;
    };
  };
  CHECK(await(every(side->shared_grants, 0)));
  side->phase.store(1);
  REQUIRE(redis.kill());
  std::this_thread::sleep_for(400ms);  // shared permits still out finish (~1 ms calls)
  side->phase.store(2);
  CHECK(await(every(side->local_grants, 2)));
  std::this_thread::sleep_for(300ms);
  side->phase.store(3);
  REQUIRE(redis.restart());
  std::this_thread::sleep_for(1500ms);  // local permits finish; those restored from the AOF expire (1 s)
  side->phase.store(4);
  CHECK(await(every(side->shared_grants, 4)));
  std::this_thread::sleep_for(300ms);
  side->phase.store(phases - 1);
  for (pid_t pid : children) CHECK(keel_scaleout::wait_child(pid) == 0);
  std::string seen;
  for (int p = 0; p < 5; ++p) seen += " " + std::to_string(side->max_in_flight[p].load());
  INFO("at most in flight, by phase:" << seen);
  CHECK(side->max_in_flight[0].load() <= limit);
  CHECK(side->max_in_flight[2].load() <= limit);  // K local shares of limit / K
  CHECK(side->max_in_flight[4].load() <= limit);
  // The switches: what is still out from the other source finishes (~1 ms
  // calls), so at most a local share more per replica (docs/scaleout.md).
  CHECK(side->max_in_flight[1].load() <= 2 * limit);
  CHECK(side->max_in_flight[3].load() <= 2 * limit);
  for (int i = 0; i < replicas; ++i) {
    INFO("replica " << i);
    CHECK(side->shared_grants[i][0].load() > 0);
    CHECK(side->local_grants[i][0].load() == 0);
    CHECK(side->local_grants[i][2].load() > 0);  // the outage: on the local share
    CHECK(side->shared_grants[i][2].load() == 0);
    CHECK(side->shared_grants[i][4].load() > 0);  // back on Redis
  }
}
