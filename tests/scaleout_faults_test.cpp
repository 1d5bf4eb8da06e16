// Store faults against the real servers: PostgreSQL or Redis frozen
// (SIGSTOP) mid-operation until past the command timeout, then thawed; and
// the server killed between a claim and its commit. Each checks what the
// caller hears (a classified error within its timeout) and that nothing
// committed is lost.
#include <dirent.h>
#include <signal.h>
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "keel/durable/digest.hpp"
#include "keel/durable/idempotency.hpp"
#include "keel/store/postgres.hpp"
#include "keel/store/redis.hpp"
#include "support/catch.hpp"
#include "support/scaleout.hpp"

using namespace std::chrono_literals;

namespace {

using clock_offset = std::shared_ptr<std::atomic<std::int64_t>>;

template <class Store>
struct faulty;

template <>
struct faulty<keel::postgres_store> {
  static constexpr const char* name = "postgres";
  static std::unique_ptr<keel::postgres_store> open(const std::string& ns, clock_offset offset) {
    auto s = keel::postgres_store::open({.conninfo = keel_scaleout::pg_conninfo(),
                                         .schema = ns,
                                         .pool_size = 2,
                                         .connect_timeout = 1s,
                                         .command_timeout = 500ms,
                                         .acquire_timeout = 500ms,
                                         .testing_clock_offset = std::move(offset)});
    if (!s.ok()) throw std::runtime_error(std::string(s.status().ToString()));
    return std::move(*s);
  }
  // The postmaster and every process it started (the backends, the writers):
  // all of the server, frozen at once.
  static std::vector<pid_t> pids() {
    const std::string run = keel_scaleout::read_first_line(keel_scaleout::servers_dir() + "/postgres/run");
    const pid_t master = std::stoi(keel_scaleout::read_first_line(run + "/data/postmaster.pid"));
    std::vector<pid_t> out{master};
    DIR* proc = ::opendir("/proc");
    if (proc == nullptr) throw std::runtime_error("cannot list /proc");
    while (dirent* e = ::readdir(proc)) {
      const std::string n = e->d_name;
      if (n.empty() || n.find_first_not_of("0123456789") != std::string::npos) continue;
      std::ifstream status("/proc/" + n + "/status");
      std::string line;
      while (std::getline(status, line)) {
        if (line.rfind("PPid:", 0) == 0) {
          if (std::stoi(line.substr(5)) == master) out.push_back(std::stoi(n));
          break;
        }
      }
    }
    ::closedir(proc);
    return out;
  }
};

template <>
struct faulty<keel::redis_store> {
  static constexpr const char* name = "redis";
  static std::unique_ptr<keel::redis_store> open(const std::string& ns, clock_offset offset) {
    auto s = keel::redis_store::open({.port = keel_scaleout::redis_port(),
                                      .key_prefix = ns + ":",
                                      .pool_size = 2,
                                      .connect_timeout = 500ms,
                                      .command_timeout = 500ms,
                                      .acquire_timeout = 500ms,
                                      .testing_clock_offset = std::move(offset)});
    if (!s.ok()) throw std::runtime_error(std::string(s.status().ToString()));
    return std::move(*s);
  }
  static std::vector<pid_t> pids() {
    return {static_cast<pid_t>(
        std::stoi(keel_scaleout::read_first_line(keel_scaleout::servers_dir() + "/redis/redis.pid")))};
  }
};

// Freezes the processes, and thaws them however the scope is left (a
// failed REQUIRE throws): no later test may find a frozen server.
class freeze_guard {
 public:
  explicit freeze_guard(std::vector<pid_t> pids) : pids_(std::move(pids)) {
    for (pid_t p : pids_) (void)::kill(p, SIGSTOP);
  }
  ~freeze_guard() { thaw(); }
  freeze_guard(const freeze_guard&) = delete;
  freeze_guard& operator=(const freeze_guard&) = delete;
  void thaw() noexcept {
    for (pid_t p : pids_) (void)::kill(p, SIGCONT);
    pids_.clear();
  }

 private:
  std::vector<pid_t> pids_;
};

template <class Pred>
bool eventually(Pred pred, std::chrono::milliseconds limit) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(20ms);
  }
  return true;
}

keel::request_identity identity(const std::string& key) { return {.tenant = "t-1", .endpoint = "faults", .key = key}; }
keel::digest digest_of(const std::string& key) { return keel::digest_builder().field("request", key).finish(); }
keel::decision decided(std::string id) { return {.id = std::move(id), .model_digest = "m", .result = "approve"}; }
const keel::begin_options bo{.lease = 30s, .retention = 1h};

double seconds(std::chrono::steady_clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

TEMPLATE_TEST_CASE("a server frozen mid-operation: a classified error within the command timeout, nothing committed lost",
                   "[scaleout][faults][freeze]", keel::postgres_store, keel::redis_store) {
  using F = faulty<TestType>;
  const std::string server = F::name;
  auto offset = std::make_shared<std::atomic<std::int64_t>>(0);
  auto store = F::open(keel_scaleout::fresh_name("freeze"), offset);

  auto committed = store->begin(identity("committed"), digest_of("committed"), keel::owner_id::random(), bo);
  REQUIRE(committed.ok());
  REQUIRE(store->commit(identity("committed"), committed->ownership, decided("dec-1"), 1h).ok());
  REQUIRE(store->save_result("result-1", "kept", 1h).value_or(false));
  auto pending = store->begin(identity("pending"), digest_of("pending"), keel::owner_id::random(), bo);
  REQUIRE(pending.ok());
  REQUIRE(pending->state == keel::begin_state::claimed);

  absl::Status commit, read;
  double commit_took = 0, read_took = 0;
  {
    freeze_guard frozen(F::pids());
    auto t0 = std::chrono::steady_clock::now();
    commit = store->commit(identity("pending"), pending->ownership, decided("dec-2"), 1h);
    commit_took = seconds(std::chrono::steady_clock::now() - t0);
    t0 = std::chrono::steady_clock::now();
    read = store->load_result("result-1").status();
    read_took = seconds(std::chrono::steady_clock::now() - t0);
  }  // thawed
  INFO(server << ": commit after " << commit_took << " s: " << commit.ToString());
  INFO(server << ": read after " << read_took << " s: " << read.ToString());
  // The write: its fate is unknown (it was sent), or it never left (not
  // started). Either is classified, and a write's unknown is ambiguous.
  REQUIRE_FALSE(commit.ok());
  CHECK((keel::is_unknown_outcome(commit) || (commit.code() == absl::StatusCode::kUnavailable && keel::not_started(commit))));
  const keel::outcome_kind wk = keel::default_classifier{}(commit, {.effect = keel::effect::write});
  CHECK((wk == keel::outcome_kind::ambiguous || wk == keel::outcome_kind::transient));
  // The read: transient (timed out or refused), never an unknown outcome.
  REQUIRE_FALSE(read.ok());
  CHECK((read.code() == absl::StatusCode::kDeadlineExceeded || read.code() == absl::StatusCode::kUnavailable));
  CHECK_FALSE(keel::is_unknown_outcome(read));
  CHECK(keel::default_classifier{}(read, {.effect = keel::effect::read}) == keel::outcome_kind::transient);
  // Each within its timeouts: it waited for the command timeout (500 ms;
  // the read may be refused sooner, acquiring or connecting), and did not
  // hang on the frozen server. The upper bound is generous: a loaded machine.
  CHECK(commit_took >= 0.45);
  CHECK(commit_took < 8.0);
  CHECK(read_took < 8.0);

  // Thawed: the store works again, and nothing committed was lost.
  REQUIRE(eventually([&] { return store->load_result("result-1").ok(); }, 30s));
  CHECK(store->load_result("result-1").value_or(std::nullopt) == std::optional<std::string>("kept"));
  auto replay = store->begin(identity("committed"), digest_of("committed"), keel::owner_id::random(), bo);
  REQUIRE(replay.ok());
  CHECK(replay->state == keel::begin_state::replay);
  CHECK(replay->decision.id == "dec-1");
  // The unknown commit is settled by the holder repeating it: either it had
  // landed (a repeat changes nothing) or it lands now.
  auto other = store->begin(identity("pending"), digest_of("pending"), keel::owner_id::random(), bo);
  REQUIRE(other.ok());
  CHECK((other->state == keel::begin_state::in_flight || other->state == keel::begin_state::replay));
  REQUIRE(store->commit(identity("pending"), pending->ownership, decided("dec-2"), 1h).ok());
  auto settled = store->begin(identity("pending"), digest_of("pending"), keel::owner_id::random(), bo);
  REQUIRE(settled.ok());
  CHECK(settled->state == keel::begin_state::replay);
  CHECK(settled->decision.id == "dec-2");
}

TEMPLATE_TEST_CASE("the server killed between a claim and its commit: the claim expires, a new owner takes over, the "
                   "stale commit is fenced",
                   "[scaleout][faults][restart]", keel::postgres_store, keel::redis_store) {
  using F = faulty<TestType>;
  const std::string server = F::name;
  auto offset = std::make_shared<std::atomic<std::int64_t>>(0);
  auto store = F::open(keel_scaleout::fresh_name("claimkill"), offset);
  keel_scaleout::restart_guard guard(server);

  auto kept = store->begin(identity("kept"), digest_of("kept"), keel::owner_id::random(), bo);
  REQUIRE(kept.ok());
  REQUIRE(store->commit(identity("kept"), kept->ownership, decided("dec-kept"), 1h).ok());
  const keel::begin_options short_lease{.lease = 5s, .retention = 1h};
  auto stale = store->begin(identity("job"), digest_of("job"), keel::owner_id::random(), short_lease);
  REQUIRE(stale.ok());
  REQUIRE(stale->state == keel::begin_state::claimed);

  REQUIRE(guard.kill());
  REQUIRE(guard.restart());
  offset->fetch_add(keel::detail::to_ns(6s));  // past the stale owner's lease, on the server's clock

  // A new owner takes the expired claim over, with a higher fence.
  absl::StatusOr<keel::begin_outcome> next = absl::UnknownError("not tried");
  REQUIRE(eventually(
      [&] {
        next = store->begin(identity("job"), digest_of("job"), keel::owner_id::random(), short_lease);
        return next.ok();
      },
      30s));
  INFO(server);
  REQUIRE(next->state == keel::begin_state::claimed);
  CHECK(next->ownership.fence > stale->ownership.fence);
  // The stale owner's commit is refused: lost ownership, nothing changed.
  const absl::Status late = store->commit(identity("job"), stale->ownership, decided("dec-stale"), 1h);
  INFO(late.ToString());
  CHECK(keel::is_lost_ownership(late));
  REQUIRE(store->commit(identity("job"), next->ownership, decided("dec-new"), 1h).ok());
  auto r = store->begin(identity("job"), digest_of("job"), keel::owner_id::random(), short_lease);
  REQUIRE(r.ok());
  CHECK(r->state == keel::begin_state::replay);
  CHECK(r->decision.id == "dec-new");
  // What was committed before the crash is still there.
  auto k = store->begin(identity("kept"), digest_of("kept"), keel::owner_id::random(), bo);
  REQUIRE(k.ok());
  CHECK(k->state == keel::begin_state::replay);
  CHECK(k->decision.id == "dec-kept");
}

// A frozen PostgreSQL (SIGSTOP: the kernel still accepts connections, no
// one answers) used to hold a new connection for libpq's 2 s minimum
// whatever connect_timeout said; keel's own deadline around the
// non-blocking connect cuts it at connect_timeout, to the millisecond, and
// with several hosts each gets its own.
TEST_CASE("a frozen PostgreSQL: a new connection gives up at connect_timeout, not libpq's 2 s",
          "[scaleout][faults][freeze]") {
  using F = faulty<keel::postgres_store>;
  const std::string schema = keel_scaleout::fresh_name("connfreeze");
  (void)F::open(schema, {});  // the schema exists: opening only connects and checks
  const std::string port = keel_scaleout::read_first_line(keel_scaleout::servers_dir() + "/postgres/port");
  freeze_guard frozen(F::pids());
  for (const std::string& conninfo :
       {keel_scaleout::pg_conninfo(),
        "host=127.0.0.1,127.0.0.1 port=" + port + "," + port + " user=keel dbname=postgres"}) {
    const auto start = std::chrono::steady_clock::now();
    auto s = keel::postgres_store::open({.conninfo = conninfo, .schema = schema, .connect_timeout = 300ms});
    const double took = seconds(std::chrono::steady_clock::now() - start);
    INFO(conninfo << ": " << took << " s");
    REQUIRE_FALSE(s.ok());
    CHECK(s.status().code() == absl::StatusCode::kUnavailable);
    CHECK(keel::not_started(s.status()));
    const int hosts = conninfo.find(',') != std::string::npos ? 2 : 1;
    CHECK(took >= 0.3 * hosts);
    CHECK(took < 0.3 * hosts + 0.7);  // was 2 s per host
  }
}
