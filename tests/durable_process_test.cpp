// Real processes against one SQLite file: N processes racing one key, and a
// child SIGKILLed while it holds an in-flight record or a lease.
//
// Children are this test binary re-executed (posix_spawn of /proc/self/exe)
// running only the hidden test case "durable child process", which reads
// its role from KEEL_CHILD_ROLE. Re-executing instead of fork()ing keeps the
// child a clean single-threaded process even though the test binary runs
// threads (and it works the same under the sanitizers).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <latch>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include "support/durable.hpp"
#include "keel/core/call.hpp"
#include "keel/durable/digest.hpp"
#include "keel/durable/lease.hpp"
#include "keel/durable/once.hpp"
#include "keel/store/sqlite.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;
using keel_durable::shared_clock;

namespace {

const keel::request_identity receipt_key{.tenant = "merchant-82", .endpoint = "receipts", .key = "key-47"};
keel::digest receipt_a() { return keel::digest_builder().field("receipt", "receipt-A").finish(); }

std::string env(const char* name) {
  const char* v = std::getenv((std::string("KEEL_CHILD_") + name).c_str());
  return v ? v : "";
}

// One line appended atomically (O_APPEND): how executions are counted
// across processes, outside any process's memory.
void append_line(const std::string& path, const std::string& line) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  if (fd < 0) std::_Exit(90);
  const std::string l = line + "\n";
  if (::write(fd, l.data(), l.size()) != static_cast<ssize_t>(l.size())) std::_Exit(91);
  ::fsync(fd);
  ::close(fd);
}

int count_lines(const std::string& path) {
  const std::string s = keel_durable::read_file(path);
  return static_cast<int>(std::count(s.begin(), s.end(), '\n'));
}

void wait_for_gate(int fd) {
  char c;
  while (::read(fd, &c, 1) > 0) {
  }
  ::close(fd);
}

// ---- child roles ------------------------------------------------------------

// Decide the receipt once (wall-clock store time, real waits) and report.
int child_once() {
  auto store = keel::sqlite_store<>::open(env("DB"));
  if (!store.ok()) {
    append_line(env("OUT"), "open-failed " + std::string(store.status().message()));
    return 2;
  }
  keel::once decide(**store, {.lease = 60s,
                              .retention = 2h,
                              .retry_window = 1h,
                              .poll_initial = 2ms,
                              .poll_max = 50ms});
  wait_for_gate(std::atoi(env("GATE").c_str()));
  keel::call call(keel::real_clock{}.now(), {.timeout = 60s});
  auto r = decide.run(call, receipt_key, receipt_a(), [&](const keel::claim_context& c) -> absl::StatusOr<keel::decision> {
    append_line(env("EXECUTIONS"), std::to_string(::getpid()) + " fence " + std::to_string(c.ownership.fence));
    std::this_thread::sleep_for(200ms);  // long enough for every other process to arrive
    return keel::decision{.model_digest = "m-large@1", .result = "approve"};
  });
  if (!r.ok()) {
    append_line(env("OUT"), "error " + std::string(r.status().message()));
    return 3;
  }
  append_line(env("OUT"), r->decision.id + (r->replayed ? " replayed" : " fresh"));
  return 0;
}

// Begin deciding on the shared clock, report the claim, then hang mid-work
// until killed.
int child_hold_record() {
  auto store = keel::sqlite_store<shared_clock>::open(env("DB"), {}, shared_clock(env("CLOCK"), false));
  if (!store.ok()) return 2;
  keel::once decide(**store, {.lease = 30s, .retention = 2h, .retry_window = 1h},
                    keel::environment{shared_clock(env("CLOCK"), false)});
  keel::call call(keel::real_clock{}.now(), {.timeout = 10min});
  (void)decide.run(call, receipt_key, receipt_a(), [&](const keel::claim_context& c) -> absl::StatusOr<keel::decision> {
    append_line(env("OUT"), c.ownership.owner.hex() + " " + std::to_string(c.ownership.fence));
    for (;;) ::pause();  // mid-work: the model call never returns
  });
  return 4;
}

// Hold a lease on the shared clock: optionally save the result first, then
// hang before releasing, until killed.
int child_hold_lease() {
  auto store = keel::sqlite_store<shared_clock>::open(env("DB"), {}, shared_clock(env("CLOCK"), false));
  if (!store.ok()) return 2;
  auto c = (*store)->claim("nightly", keel::owner_id::random(), 30s);
  if (!c.ok() || !c->acquired) return 3;
  if (env("SAVE") == "1" && !(*store)->save_result("nightly-result", "saved-by-the-dead", 0s).ok()) return 5;
  append_line(env("OUT"), c->ownership.owner.hex() + " " + std::to_string(c->ownership.fence));
  for (;;) ::pause();
}

// Open a store as an unprivileged user (when started as root, drop to
// nobody first) and report the status code and message.
int child_open_unprivileged() {
  if (::geteuid() == 0) {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) return 6;
  }
  auto store = keel::sqlite_store<>::open(env("DB"));
  append_line(env("OUT"), std::to_string(static_cast<int>(store.status().code())) + " " +
                              std::string(store.status().message()));
  return 0;
}

}  // namespace

TEST_CASE("durable child process", "[.][child]") {
  const std::string role = env("ROLE");
  if (role.empty()) return;
  int code = 1;
  if (role == "once") code = child_once();
  else if (role == "hold-record") code = child_hold_record();
  else if (role == "hold-lease") code = child_hold_lease();
  else if (role == "open-unprivileged") code = child_open_unprivileged();
  std::fflush(nullptr);
  std::_Exit(code);
}

TEST_CASE("N processes send the same key at once: one provider execution, one decision id", "[process][sqlite]") {
  keel_durable::temp_dir dir;
  const std::string db = dir.file("receipts.db");
  REQUIRE(keel::sqlite_store<>::open(db).ok());  // the schema exists before the race
  int gate[2];
  REQUIRE(::pipe(gate) == 0);
  constexpr int n = 6;
  std::vector<pid_t> children;
  for (int i = 0; i < n; ++i) {
    children.push_back(keel_durable::spawn_child("once",
                                                 {{"DB", db},
                                                  {"GATE", std::to_string(gate[0])},
                                                  {"EXECUTIONS", dir.file("executions")},
                                                  {"OUT", dir.file("out-" + std::to_string(i))}},
                                                 {gate[1]}));
  }
  ::close(gate[0]);
  std::this_thread::sleep_for(200ms);  // let them open the store; then release them together
  ::close(gate[1]);
  for (pid_t p : children) CHECK(keel_durable::wait_child(p) == 0);

  CHECK(count_lines(dir.file("executions")) == 1);
  std::set<std::string> ids;
  int fresh = 0;
  for (int i = 0; i < n; ++i) {
    const std::string out = keel_durable::read_file(dir.file("out-" + std::to_string(i)));
    INFO("child " << i << ": " << out);
    REQUIRE(out.size() > 4);
    ids.insert(out.substr(0, out.find(' ')));
    if (out.find(" fresh") != std::string::npos) ++fresh;
  }
  CHECK(ids.size() == 1);
  CHECK(fresh == 1);
}

TEST_CASE("a child SIGKILLed mid-work: in flight until expiry, then exactly one takeover; its late commit is refused",
          "[process][sqlite]") {
  keel_durable::temp_dir dir;
  const std::string db = dir.file("receipts.db");
  shared_clock clock(dir.file("clock"), true);
  const keel::begin_options bo{.lease = 30s, .retention = 2h};

  const pid_t child = keel_durable::spawn_child("hold-record", {{"DB", db}, {"CLOCK", dir.file("clock")},
                                                                {"OUT", dir.file("claim")}});
  const std::string claim = keel_durable::await_line(dir.file("claim"));
  REQUIRE(claim.size() > 33);
  ::kill(child, SIGKILL);
  CHECK(keel_durable::wait_child(child) == 128 + SIGKILL);
  const auto dead_owner = keel::owner_id::from_hex(claim.substr(0, 32));
  REQUIRE(dead_owner.has_value());
  const keel::ownership dead{*dead_owner, std::stoll(claim.substr(33))};
  CHECK(dead.fence == 1);

  auto store = keel_durable::open_sqlite(db, clock);
  // Before expiry: everyone sees it in flight, and nobody can take it.
  clock.advance(20s);
  auto early = store->begin(receipt_key, receipt_a(), keel::owner_id::random(), bo);
  REQUIRE(early.ok());
  CHECK(early->state == keel::begin_state::in_flight);
  CHECK(early->lease_remaining == 10s);
  keel::once polite(*store, {.lease = 30s, .retention = 2h, .retry_window = 1h,
                             .on_duplicate = keel::on_duplicate::retry_later},
                    keel::environment{clock});
  keel::call call(clock.now(), {.timeout = 5s});
  int calls = 0;
  auto refused = polite.run(call, receipt_key, receipt_a(), [&](const keel::claim_context&) -> absl::StatusOr<keel::decision> {
    ++calls;
    return keel::decision{.result = "x"};
  });
  CHECK(keel::is_in_flight(refused.status()));
  CHECK(calls == 0);

  // After expiry: N connections race; exactly one takes over, with fence 2.
  clock.advance(11s);
  constexpr int n = 6;
  std::vector<std::unique_ptr<keel::sqlite_store<shared_clock>>> stores;
  for (int i = 0; i < n; ++i) stores.push_back(keel_durable::open_sqlite(db, clock));
  std::vector<absl::StatusOr<keel::begin_outcome>> got(n, absl::UnknownError("not run"));
  std::latch start(n);
  {
    std::vector<std::jthread> threads;
    for (int i = 0; i < n; ++i)
      threads.emplace_back([&, i] {
        start.arrive_and_wait();
        got[i] = stores[i]->begin(receipt_key, receipt_a(), keel::owner_id::random(), bo);
      });
  }
  int claimed = 0;
  keel::ownership winner{};
  for (const auto& g : got) {
    REQUIRE(g.ok());
    if (g->state == keel::begin_state::claimed) {
      ++claimed;
      winner = g->ownership;
      CHECK(g->took_over);
    } else {
      CHECK(g->state == keel::begin_state::in_flight);
    }
  }
  CHECK(claimed == 1);
  CHECK(winner.fence == 2);

  // The dead owner's late commit (its old owner and fence) changes nothing.
  const absl::Status late = store->commit(receipt_key, dead, keel::decision{.id = "dec-zombie", .result = "x"}, 2h);
  CHECK(keel::is_lost_ownership(late));
  REQUIRE(store->commit(receipt_key, winner, keel::decision{.id = "dec-winner", .result = "approve"}, 2h).ok());
  auto replay = store->begin(receipt_key, receipt_a(), keel::owner_id::random(), bo);
  REQUIRE(replay.ok());
  CHECK(replay->state == keel::begin_state::replay);
  CHECK(replay->decision.id == "dec-winner");
  CHECK(replay->ownership.fence == 2);
}

TEST_CASE("a lease holder SIGKILLed: after expiry the claimant checks the result store before working again",
          "[process][sqlite][lease]") {
  keel_durable::temp_dir dir;
  const std::string db = dir.file("work.db");
  shared_clock clock(dir.file("clock"), true);
  const bool saved = GENERATE(false, true);
  INFO("the dead holder had saved its result: " << saved);

  const pid_t child = keel_durable::spawn_child(
      "hold-lease", {{"DB", db}, {"CLOCK", dir.file("clock")}, {"OUT", dir.file("claim")}, {"SAVE", saved ? "1" : "0"}});
  const std::string claim = keel_durable::await_line(dir.file("claim"));
  REQUIRE(claim.size() > 33);
  ::kill(child, SIGKILL);
  CHECK(keel_durable::wait_child(child) == 128 + SIGKILL);
  const keel::ownership dead{*keel::owner_id::from_hex(claim.substr(0, 32)), std::stoll(claim.substr(33))};

  auto store = keel_durable::open_sqlite(db, clock);
  int runs = 0;
  auto work = [&](std::stop_token, const keel::ownership& lease) -> absl::StatusOr<std::string> {
    ++runs;
    CHECK(lease.fence == 2);
    return std::string("recomputed");
  };
  clock.advance(29s);
  auto early = keel::run_leased(*store, *store, "nightly", "nightly-result", {.ttl = 30s}, work, keel::environment{clock});
  CHECK(keel::is_in_flight(early.status()));
  CHECK(keel::retry_after(early.status()) == 1s);
  clock.advance(2s);
  auto r = keel::run_leased(*store, *store, "nightly", "nightly-result", {.ttl = 30s}, work, keel::environment{clock});
  REQUIRE(r.ok());
  CHECK(r->took_over);
  CHECK(r->ownership.fence == 2);
  CHECK(r->cached == saved);
  CHECK(r->value == (saved ? "saved-by-the-dead" : "recomputed"));
  CHECK(runs == (saved ? 0 : 1));
  CHECK(keel::is_lost_ownership(store->release("nightly", dead)));
}

TEST_CASE("a path the process cannot write is refused with PermissionDenied, nothing changed", "[sqlite][errors]") {
  keel_durable::temp_dir dir;
  REQUIRE(::chmod(dir.path().c_str(), 0755) == 0);  // the unprivileged child may look in
  const std::string out = dir.file("out");
  keel_durable::write_file(out, "");
  REQUIRE(::chmod(out.c_str(), 0666) == 0);
  auto run_child = [&](const std::string& db) {
    keel_durable::write_file(out, "");
    const pid_t p = keel_durable::spawn_child("open-unprivileged", {{"DB", db}, {"OUT", out}});
    REQUIRE(keel_durable::wait_child(p) == 0);
    return keel_durable::read_file(out);
  };
  const std::string denied = std::to_string(static_cast<int>(absl::StatusCode::kPermissionDenied)) + " ";

  SECTION("an existing keel file the user may only read") {
    const std::string db = dir.file("readonly.db");
    REQUIRE(keel::sqlite_store<>::open(db).ok());
    REQUIRE(::chmod(db.c_str(), 0644) == 0);  // owned by the test's user; the child is another user...
    if (::geteuid() != 0) REQUIRE(::chmod(db.c_str(), 0444) == 0);  // ... or the same user without write permission
    const std::string before = keel_durable::read_file(db);
    const std::string got = run_child(db);
    INFO(got);
    CHECK(got.rfind(denied, 0) == 0);
    CHECK(got.find(db) != std::string::npos);
    CHECK(keel_durable::read_file(db) == before);
  }
  SECTION("a new file in a directory the user may not write") {
    const std::string sub = dir.file("locked");
    REQUIRE(::mkdir(sub.c_str(), 0555) == 0);
    const std::string db = sub + "/new.db";
    const std::string got = run_child(db);
    INFO(got);
    CHECK(got.rfind(denied, 0) == 0);
    CHECK(got.find("cannot open or create") != std::string::npos);
    CHECK(::access(db.c_str(), F_OK) != 0);
  }
}
