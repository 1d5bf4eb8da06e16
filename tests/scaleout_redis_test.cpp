// keel::redis_store against a real Redis server (started by the
// redis_server CTest fixture, AOF with appendfsync always): the conformance
// suite, bad input and faults.
#include "keel/store/redis.hpp"

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <hiredis/hiredis.h>

#include "keel/testing/store_conformance.hpp"
#include "support/scaleout.hpp"
#include "support/catch.hpp"
#include "support/loopback.hpp"

using namespace std::chrono_literals;

namespace {

std::unique_ptr<keel::redis_store> open_redis(keel::redis_options o) {
  auto s = keel::redis_store::open(std::move(o));
  if (!s.ok()) throw std::runtime_error(std::string(s.status().ToString()));
  return std::move(*s);
}

// Deletes every key under `prefix`: what the server does by itself once
// each has ended and forget_after has passed (the test moves the scripts'
// clock with an offset, which Redis's own expiry does not see).
void forget_all(const std::string& prefix) {
  redisContext* c = redisConnect("127.0.0.1", keel_scaleout::redis_port());
  if (c == nullptr || c->err) throw std::runtime_error("raw redis connect failed");
  const std::string pattern = prefix + "*";
  auto* keys = static_cast<redisReply*>(redisCommand(c, "KEYS %b", pattern.data(), pattern.size()));
  bool ok = keys != nullptr && keys->type == REDIS_REPLY_ARRAY;
  for (std::size_t i = 0; ok && i < keys->elements; ++i) {
    auto* d = static_cast<redisReply*>(redisCommand(c, "DEL %b", keys->element[i]->str, keys->element[i]->len));
    ok = d != nullptr && d->type == REDIS_REPLY_INTEGER;
    if (d != nullptr) freeReplyObject(d);
  }
  if (keys != nullptr) freeReplyObject(keys);
  redisFree(c);
  if (!ok) throw std::runtime_error("deleting the store's keys failed");
}

keel::redis_options redis_options(std::string prefix) {
  return keel::redis_options{.port = keel_scaleout::redis_port(), .key_prefix = prefix + ":", .pool_size = 4};
}

}  // namespace

TEST_CASE("the Redis store passes the conformance suite", "[scaleout][redis][conformance]") {
  // Both fence modes: previous + 1, and from the server's clock (only "above the previous").
  const bool clock_fences = GENERATE(false, true);
  CAPTURE(clock_fences);
  auto offset = std::make_shared<std::atomic<std::int64_t>>(0);
  keel::testing::store_harness<keel::redis_store> h{
      .make =
          [&] {
            keel::redis_options o = redis_options(keel_scaleout::fresh_name("conf"));
            o.testing_clock_offset = offset;
            o.fences = clock_fences ? keel::redis_fences::from_clock : keel::redis_fences::sequential;
            return std::shared_ptr<keel::redis_store>(open_redis(std::move(o)));
          },
      .advance = [&](keel::duration d) { offset->fetch_add(keel::detail::to_ns(d)); },
      .step_back = [&](keel::duration d) { offset->fetch_sub(keel::detail::to_ns(d)); },
      .peer = [&](keel::redis_store& s) { return std::shared_ptr<keel::redis_store>(open_redis(s.options())); },
      // Redis forgets by itself: forget_after past a key's end the key is gone.
      .purge = [](keel::redis_store& s) { forget_all(s.options().key_prefix); },
      .server_clock = true,
      .dense_fences = !clock_fences,
  };
  const std::vector<std::string> names = keel::testing::conformance_checks<keel::redis_store>();
  REQUIRE(names.size() == 43);
  for (const std::string& name : names) {
    SECTION(name) {
      const keel::testing::conformance_report r = keel::testing::run_store_conformance(h, name);
      for (const auto& f : r.failures) FAIL_CHECK(f.check << " (line " << f.line << "): " << f.message);
      if (name.find("while the clock is behind") != std::string::npos) {
        // No high-water mark of the server's clock: keel::testing::server_clock_reason.
        REQUIRE(r.skipped.size() == 1);
        CHECK(r.skipped[0].find(keel::testing::server_clock_reason) != std::string::npos);
      } else {
        CHECK(r.passed.size() == 1);
      }
    }
  }
}

namespace {

// A plain hiredis connection for the test's own commands (CLIENT PAUSE, ACL...).
class raw_redis {
 public:
  raw_redis() : c_(redisConnect("127.0.0.1", keel_scaleout::redis_port())) {
    if (c_ == nullptr || c_->err) throw std::runtime_error("raw redis connect failed");
  }
  ~raw_redis() { redisFree(c_); }
  raw_redis(const raw_redis&) = delete;
  raw_redis& operator=(const raw_redis&) = delete;

  // Runs a command (arguments as given); the reply as text ("" for nil/arrays).
  std::string run(std::vector<std::string> args) {
    std::vector<const char*> argv;
    std::vector<std::size_t> lens;
    for (const std::string& a : args) {
      argv.push_back(a.data());
      lens.push_back(a.size());
    }
    redisReply* r = static_cast<redisReply*>(redisCommandArgv(c_, static_cast<int>(argv.size()), argv.data(), lens.data()));
    if (r == nullptr) throw std::runtime_error("raw redis command failed");
    std::string out;
    if (r->type == REDIS_REPLY_STRING || r->type == REDIS_REPLY_STATUS || r->type == REDIS_REPLY_ERROR)
      out.assign(r->str, r->len);
    if (r->type == REDIS_REPLY_INTEGER) out = std::to_string(r->integer);
    freeReplyObject(r);
    return out;
  }

 private:
  redisContext* c_;
};

template <class Pred>
bool eventually(Pred pred, std::chrono::milliseconds limit = 10s) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(2ms);
  }
  return true;
}

const keel::request_identity receipt{.tenant = "merchant-82", .endpoint = "receipts", .key = "key-47"};
keel::digest receipt_a() { return keel::digest_builder().field("receipt", "A").finish(); }
const keel::begin_options bo{.lease = 10s, .retention = 60s};
keel::decision decided(std::string id) {
  return keel::decision{.id = std::move(id), .model_digest = "m-large", .result = "approve"};
}


// Commands the server is holding back (CLIENT PAUSE) show up as clients
// blocked in "postpone".
int paused_clients(raw_redis& admin) {
  const std::string list = admin.run({"CLIENT", "LIST"});
  int n = 0;
  for (std::size_t p = list.find("flags="); p != std::string::npos; p = list.find("flags=", p + 1)) {
    const std::size_t end = list.find(' ', p);
    if (list.substr(p, end - p).find('b') != std::string::npos) ++n;
  }
  return n;
}

// The ids of clients newer than `after` (ids grow with each connection)
// whose script the server is holding back (CLIENT PAUSE): flags with 'b',
// last command evalsha or eval. Other clients of the server are not counted.
std::vector<std::string> postponed_scripts(raw_redis& admin, long long after) {
  const std::string list = admin.run({"CLIENT", "LIST"});
  auto field = [](std::string_view line, std::string_view name) {
    const std::size_t p = line.find(name);
    if (p == std::string_view::npos || (p > 0 && line[p - 1] != ' ')) return std::string_view();
    const std::size_t from = p + name.size(), end = line.find(' ', from);
    return line.substr(from, end == std::string_view::npos ? std::string_view::npos : end - from);
  };
  std::vector<std::string> ids;
  std::string_view rest = list;
  while (!rest.empty()) {
    const std::size_t nl = rest.find('\n');
    const std::string_view line = rest.substr(0, nl);
    rest = nl == std::string_view::npos ? std::string_view() : rest.substr(nl + 1);
    const std::string_view id = field(line, "id="), cmd = field(line, "cmd=");
    if (id.empty() || std::stoll(std::string(id)) <= after) continue;
    if (field(line, "flags=").find('b') == std::string_view::npos) continue;
    if (cmd == "evalsha" || cmd == "eval") ids.emplace_back(id);
  }
  return ids;
}

// Holds writes on the whole server (CLIENT PAUSE ... WRITE) until destroyed,
// so a failed assertion never leaves the server paused for the next test.
class write_pause {
 public:
  explicit write_pause(raw_redis& admin) : admin_(admin) {
    if (admin_.run({"CLIENT", "PAUSE", "20000", "WRITE"}) != "OK") throw std::runtime_error("CLIENT PAUSE failed");
  }
  ~write_pause() {
    try {
      end();
    } catch (const std::exception&) {  // the server went away: nothing is paused
    }
  }
  write_pause(const write_pause&) = delete;
  write_pause& operator=(const write_pause&) = delete;
  void end() {
    if (std::exchange(paused_, false)) admin_.run({"CLIENT", "UNPAUSE"});
  }

 private:
  raw_redis& admin_;
  bool paused_ = true;
};

}  // namespace

TEST_CASE("redis options are validated, naming the field and the rule", "[scaleout][redis]") {
  const std::pair<keel::redis_options, std::string> bad[] = {
      {{.host = ""}, "redis_options.host must not be empty (got \"\")"},
      {{.port = 0}, "redis_options.port must be in [1, 65535] (got 0)"},
      {{.port = 65536}, "redis_options.port must be in [1, 65535] (got 65536)"},
      {{.database = -1}, "redis_options.database must be >= 0 (got -1)"},
      {{.key_prefix = "a{b"}, "redis_options.key_prefix must not contain '{' or '}' (got \"a{b\")"},
      {{.key_prefix = "b}"}, "redis_options.key_prefix must not contain '{' or '}' (got \"b}\")"},
      {{.key_prefix = std::string(129, 'p')}, "redis_options.key_prefix must be at most 128 bytes (got 129)"},
      {{.pool_size = 0}, "redis_options.pool_size must be in [1, 1000] (got 0)"},
      {{.pool_size = 1001}, "redis_options.pool_size must be in [1, 1000] (got 1001)"},
      {{.connect_timeout = 2h}, "redis_options.connect_timeout must be in [1ms, 1h] (got 7200s)"},
      {{.command_timeout = 0ms}, "redis_options.command_timeout must be in [1ms, 1h] (got 0s)"},
      {{.acquire_timeout = -1ms}, "redis_options.acquire_timeout must be in [0, 1h] (got -1ms)"},
      {{.forget_after = 10ms}, "redis_options.forget_after must be in [1s, 365 days] (got 10ms)"},
  };
  for (const auto& [o, message] : bad) {
    const absl::Status v = o.validate();
    CHECK(v.code() == absl::StatusCode::kInvalidArgument);
    CHECK(std::string(v.message()) == message);
    CHECK(keel::redis_store::open(o).status() == v);  // refused before connecting, with the same status
  }
  // The edges of each range are accepted.
  CHECK(keel::redis_options{.host = "/run/redis.sock", .port = 0}.validate().ok());  // a Unix socket has no port
  CHECK(keel::redis_options{.port = 65535, .key_prefix = std::string(128, 'p'), .pool_size = 1000}.validate().ok());
  CHECK(keel::redis_options{.connect_timeout = 1ms, .command_timeout = 1h, .acquire_timeout = 0ms}.validate().ok());
}

TEST_CASE("redis: a server nobody listens on is unavailable and nothing started", "[scaleout][redis][faults]") {
  auto s = keel::redis_store::open({.port = keel_test::unused_loopback_port(), .key_prefix = keel_scaleout::fresh_name("down")});
  REQUIRE_FALSE(s.ok());
  INFO(s.status().ToString());
  CHECK(s.status().code() == absl::StatusCode::kUnavailable);
  CHECK(keel::not_started(s.status()));
  CHECK(keel::default_classifier{}(s.status(), {.effect = keel::effect::write}) == keel::outcome_kind::transient);
}

TEST_CASE("redis: a refused password is permanent; the right one works", "[scaleout][redis][faults]") {
  raw_redis admin;
  const std::string user = keel_scaleout::fresh_name("user");
  REQUIRE(admin.run({"ACL", "SETUSER", user, "on", ">s3cret", "~*", "+@all"}) == "OK");
  keel::redis_options o = redis_options(keel_scaleout::fresh_name("auth"));
  o.username = user;
  o.password = "wrong";
  auto refused = keel::redis_store::open(o);
  REQUIRE_FALSE(refused.ok());
  INFO(refused.status().ToString());
  CHECK(refused.status().code() == absl::StatusCode::kPermissionDenied);
  CHECK(keel::default_classifier{}(refused.status(), {}) == keel::outcome_kind::permanent);
  o.password = "s3cret";
  auto ok = keel::redis_store::open(o);
  REQUIRE(ok.ok());
  CHECK((*ok)->save_result("k", "v", 0s).value_or(false));
  admin.run({"ACL", "DELUSER", user});
}

TEST_CASE("redis: durability is read from the server and can be required", "[scaleout][redis][faults]") {
  raw_redis admin;
  keel::redis_options o = redis_options(keel_scaleout::fresh_name("dur"));
  o.require_aof_always = true;
  auto s = keel::redis_store::open(o);
  REQUIRE(s.ok());  // the fixture runs AOF with appendfsync always
  CHECK((*s)->durability() == keel::redis_durability::aof_always);
  REQUIRE(admin.run({"CONFIG", "SET", "appendfsync", "everysec"}) == "OK");
  auto weak = keel::redis_store::open(o);
  REQUIRE(admin.run({"CONFIG", "SET", "appendfsync", "always"}) == "OK");
  REQUIRE_FALSE(weak.ok());
  INFO(weak.status().ToString());
  CHECK(weak.status().code() == absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("redis: keys and values are arguments, never script text", "[scaleout][redis]") {
  auto s = open_redis(redis_options(keel_scaleout::fresh_name("inject")));
  const std::string evil = "']) redis.call('FLUSHALL') --[[ {x} \r\n*1\r\n$8\r\nFLUSHALL\r\n";
  const keel::request_identity id{.tenant = "t{1}", .endpoint = "}{", .key = "k"};
  auto b = s->begin(id, receipt_a(), keel::owner_id::random(), bo);
  REQUIRE(b.ok());
  REQUIRE(b->state == keel::begin_state::claimed);
  keel::decision d = decided("dec-1");
  d.result = evil;
  REQUIRE(s->commit(id, b->ownership, d, 60s).ok());
  REQUIRE(s->save_result("r{", evil, 0s).value_or(false));
  auto r = s->begin(id, receipt_a(), keel::owner_id::random(), bo);
  REQUIRE(r.ok());
  CHECK(r->state == keel::begin_state::replay);
  CHECK(r->decision == d);
  CHECK(s->load_result("r{").value_or(std::nullopt) == std::optional<std::string>(evil));
}

TEST_CASE("redis: a flushed script cache is answered by sending the script again", "[scaleout][redis][faults]") {
  auto s = open_redis(redis_options(keel_scaleout::fresh_name("noscript")));
  REQUIRE(s->save_result("a", "1", 0s).value_or(false));
  REQUIRE(s->load_result("a").ok());  // the server now has the load script (whichever test ran first)
  const std::uint64_t warm = s->round_trips();
  REQUIRE(s->load_result("a").ok());
  CHECK(s->round_trips() == warm + 1);  // EVALSHA hit
  raw_redis admin;
  REQUIRE(admin.run({"SCRIPT", "FLUSH"}) == "OK");
  const std::uint64_t before = s->round_trips();
  auto l = s->load_result("a");
  REQUIRE(l.ok());
  CHECK(l->value_or("") == "1");
  CHECK(s->round_trips() == before + 2);  // NOSCRIPT, then EVAL with the source
}

TEST_CASE("redis: idle connections the server closed are replaced before use", "[scaleout][redis][faults]") {
  keel::redis_options o = redis_options(keel_scaleout::fresh_name("idle"));
  o.pool_size = 1;
  auto s = open_redis(o);
  REQUIRE(s->save_result("before", "v", 0s).value_or(false));
  raw_redis admin;
  CHECK(std::stoi(admin.run({"CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"})) >= 1);
  const std::uint64_t before = s->round_trips();
  auto l = s->load_result("before");
  REQUIRE(l.ok());
  CHECK(l->value_or("") == "v");
  CHECK(s->round_trips() == before + 1);
}

TEST_CASE("redis: a commit whose connection drops is an unknown outcome, and repeating it settles it",
          "[scaleout][redis][faults]") {
  raw_redis admin;
  // Every client that connects later gets a larger id: the store's are above this.
  const long long admin_id = std::stoll(admin.run({"CLIENT", "ID"}));
  keel::redis_options o = redis_options(keel_scaleout::fresh_name("drop"));
  o.pool_size = 1;
  o.command_timeout = 20s;  // the dropped connection, not the timeout, must end the commit
  auto s = open_redis(o);
  const keel::owner_id owner = keel::owner_id::random();
  auto b = s->begin(receipt, receipt_a(), owner, bo);
  REQUIRE(b.ok());
  REQUIRE(b->state == keel::begin_state::claimed);
  absl::Status commit;
  std::jthread t;        // joined after the pause ends (declared first, destroyed last)
  write_pause pause(admin);
  t = std::jthread([&] { commit = s->commit(receipt, b->ownership, decided("dec-1"), 60s); });
  // The commit's script has reached the server and is held there, unanswered.
  std::vector<std::string> held;
  REQUIRE(eventually([&] { return (held = postponed_scripts(admin, admin_id)).size() == 1; }));
  REQUIRE(admin.run({"CLIENT", "KILL", "ID", held[0]}) == "1");
  t.join();
  pause.end();
  INFO(commit.ToString());
  CHECK(keel::is_unknown_outcome(commit));
  CHECK(commit.code() == absl::StatusCode::kUnknown);
  CHECK(std::string(commit.message()).find("commit: connection lost") != std::string::npos);
  CHECK(keel::default_classifier{}(commit, {.effect = keel::effect::write}) == keel::outcome_kind::ambiguous);
  // The truth: the killed client's script never ran; the record is still ours, in flight.
  auto other = s->begin(receipt, receipt_a(), keel::owner_id::random(), bo);
  REQUIRE(other.ok());
  CHECK(other->state == keel::begin_state::in_flight);
  CHECK(other->ownership.fence == b->ownership.fence);
  // Repeating the commit with the same owner and fence settles it (rule 7), on a new connection ...
  CHECK(s->commit(receipt, b->ownership, decided("dec-1"), 60s).ok());
  CHECK(s->commit(receipt, b->ownership, decided("dec-1"), 60s).ok());  // ... and again: a repeat
  CHECK(s->connections() == 1);
  // ... and every later begin replays that decision.
  auto r = s->begin(receipt, receipt_a(), keel::owner_id::random(), bo);
  REQUIRE(r.ok());
  CHECK(r->state == keel::begin_state::replay);
  CHECK(r->decision == decided("dec-1"));
  CHECK(r->ownership.fence == b->ownership.fence);
}

TEST_CASE("redis: past the command timeout a write is an unknown outcome and a read is transient",
          "[scaleout][redis][faults]") {
  keel::redis_options o = redis_options(keel_scaleout::fresh_name("slow"));
  o.command_timeout = 200ms;
  auto s = open_redis(o);
  auto b = s->begin(receipt, receipt_a(), keel::owner_id::random(), bo);
  REQUIRE(b.ok());
  REQUIRE(s->save_result("r", "v", 0s).value_or(false));
  raw_redis admin;
  REQUIRE(admin.run({"CLIENT", "PAUSE", "3000", "WRITE"}) == "OK");
  const absl::Status commit = s->commit(receipt, b->ownership, decided("dec-1"), 60s);
  auto l = s->load_result("r");
  REQUIRE(admin.run({"CLIENT", "UNPAUSE"}) == "OK");
  INFO(commit.ToString());
  CHECK(keel::is_unknown_outcome(commit));
  CHECK(keel::default_classifier{}(commit, {.effect = keel::effect::write}) == keel::outcome_kind::ambiguous);
  INFO(l.status().ToString());
  CHECK(l.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK_FALSE(keel::is_unknown_outcome(l.status()));
  CHECK(keel::default_classifier{}(l.status(), {.effect = keel::effect::read}) == keel::outcome_kind::transient);
  // Whatever became of the paused commit, repeating it settles it (rule 7).
  CHECK(s->commit(receipt, b->ownership, decided("dec-1"), 60s).ok());
  auto r = s->begin(receipt, receipt_a(), keel::owner_id::random(), bo);
  REQUIRE(r.ok());
  CHECK((r->state == keel::begin_state::replay && r->decision.id == "dec-1"));
}

TEST_CASE("redis: the pool never exceeds pool_size and refuses after acquire_timeout", "[scaleout][redis][faults]") {
  keel::redis_options o = redis_options(keel_scaleout::fresh_name("pool"));
  o.pool_size = 2;
  o.acquire_timeout = 200ms;
  o.command_timeout = 5s;
  auto s = open_redis(o);
  auto b = s->begin(receipt, receipt_a(), keel::owner_id::random(), bo);
  REQUIRE(b.ok());
  raw_redis admin;
  const int paused_before = paused_clients(admin);
  REQUIRE(admin.run({"CLIENT", "PAUSE", "5000", "WRITE"}) == "OK");
  std::vector<absl::Status> extended(2);
  {
    std::vector<std::jthread> holders;
    for (int i = 0; i < 2; ++i) holders.emplace_back([&, i] { extended[i] = s->extend(receipt, b->ownership, 20s); });
    const bool blocked = eventually([&] { return paused_clients(admin) == paused_before + 2; });
    CHECK(blocked);
    CHECK(s->connections() == 2);
    const auto t0 = std::chrono::steady_clock::now();
    auto l = s->load_result("anything");
    const auto waited = std::chrono::steady_clock::now() - t0;
    admin.run({"CLIENT", "UNPAUSE"});
    INFO(l.status().ToString());
    CHECK(l.status().code() == absl::StatusCode::kUnavailable);
    CHECK(keel::not_started(l.status()));
    CHECK(waited >= 200ms);
  }
  CHECK(extended[0].ok());
  CHECK(extended[1].ok());
  CHECK(s->connections() == 2);
}

namespace {

// A reply as the store would get it: RESP text through hiredis' reader.
std::unique_ptr<redisReply, void (*)(void*)> resp_reply(std::string_view wire) {
  redisReader* reader = redisReaderCreate();
  REQUIRE(reader != nullptr);
  REQUIRE(redisReaderFeed(reader, wire.data(), wire.size()) == REDIS_OK);
  void* raw = nullptr;
  const int rc = redisReaderGetReply(reader, &raw);
  redisReaderFree(reader);
  REQUIRE(rc == REDIS_OK);
  REQUIRE(raw != nullptr);
  return {static_cast<redisReply*>(raw), freeReplyObject};
}

}  // namespace

// Found while factoring the decoding out for the redis_records fuzz target
// (tests/fuzz/redis_records_fuzz.cpp): replies were read with missing
// elements as 0 or "". A damaged hash field makes Lua end the reply array
// at its first nil, so a replay came back as a decision with an empty id; a
// reply that is not an array read as "claimed, fence 0".
TEST_CASE("a Redis reply no keel script would send is DataLoss, never an outcome", "[redis][fuzz]") {
  const keel::request_identity id{.tenant = "t", .endpoint = "e", .key = "k"};
  const keel::owner_id me{1, 2};
  const auto begin = [&](std::string_view wire) {
    auto r = resp_reply(wire);
    return keel::detail::redis_begin_outcome(r.get(), id, me, {}, "redis store 'test'");
  };
  // Well-formed: a claim, and a replay.
  auto claimed = begin("*4\r\n:0\r\n:7\r\n:30000000\r\n:0\r\n");
  REQUIRE(claimed.ok());
  CHECK(claimed->state == keel::begin_state::claimed);
  CHECK(claimed->ownership == keel::ownership{me, 7});
  auto replay = begin("*9\r\n:2\r\n:7\r\n:5\r\n:0\r\n$2\r\nd1\r\n$0\r\n\r\n$0\r\n\r\n$1\r\nr\r\n$0\r\n\r\n");
  REQUIRE(replay.ok());
  CHECK(replay->state == keel::begin_state::replay);
  CHECK(replay->decision.id == "d1");
  CHECK(replay->committed_at_ns == 5000);

  struct bad {
    const char* wire;
    const char* says;
  };
  const bad cases[] = {
      {":1\r\n", "is not {kind, fence"},                                        // not an array
      {"*2\r\n:2\r\n:7\r\n", "committed at or error code is not a number"},    // cut at a nil
      {"*4\r\n:2\r\n:7\r\n:5\r\n:0\r\n", "a decision field is missing"},
      {"*9\r\n:2\r\n:7\r\n:5\r\n:99\r\n$2\r\nd1\r\n$0\r\n\r\n$0\r\n\r\n$0\r\n\r\n$0\r\n\r\n", "error code 99"},
      {"*9\r\n:2\r\n:7\r\n:5\r\n:0\r\n$0\r\n\r\n$0\r\n\r\n$0\r\n\r\n$0\r\n\r\n$0\r\n\r\n", "decision id must not be empty"},
      {"*9\r\n:2\r\n:7\r\n:9223372036854775807\r\n:0\r\n$1\r\nd\r\n$0\r\n\r\n$0\r\n\r\n$0\r\n\r\n$0\r\n\r\n",
       "commit time"},
      {"*4\r\n:0\r\n:0\r\n:1\r\n:0\r\n", "fence 0 is outside"},
      {"*4\r\n:0\r\n:9223372036854775807\r\n:1\r\n:0\r\n", "fence 9223372036854775807 is outside"},
      {"*3\r\n:9\r\n:7\r\n:0\r\n", "answered kind 9"},
  };
  for (const bad& b : cases) {
    INFO(b.wire);
    const auto out = begin(b.wire);
    REQUIRE(out.status().code() == absl::StatusCode::kDataLoss);
    CHECK(std::string(out.status().message()).find(b.says) != std::string::npos);
    CHECK(std::string(out.status().message()).find("the record for key 'k'") != std::string::npos);
  }
  // A lease claim reply, the same way; a huge "left" saturates rather than overflows.
  auto lease = [&](std::string_view wire) {
    auto r = resp_reply(wire);
    return keel::detail::redis_claim_outcome(r.get(), "w", me, 5s, "redis store 'test'");
  };
  CHECK(lease("*3\r\n:0\r\n:3\r\n:9223372036854775807\r\n")->remaining > 1000h);
  CHECK(lease(":0\r\n").status().code() == absl::StatusCode::kDataLoss);
  CHECK(lease("*3\r\n:1\r\n:3\r\n:5\r\n").status().code() == absl::StatusCode::kDataLoss);  // acquired without how
  CHECK(lease("*4\r\n:1\r\n:-3\r\n:5\r\n:0\r\n").status().code() == absl::StatusCode::kDataLoss);
}
