// Scale-out: what an idempotent decision, a lease and a shared-quota
// decision cost on PostgreSQL and Redis, each beside a raw-client baseline
// doing one round trip of comparable work in the same binary and run.
//
//   BM_Idempotency_BeginCommit_Postgres   begin (claim) + commit of a fresh key: 2 statements
//   BM_Lease_ClaimRelease_Postgres        claim + release of one key: 2 statements
//   BM_Baseline_Postgres_RawUpsert        one prepared INSERT ... ON CONFLICT DO UPDATE
//                                         of a comparable row with raw libpq
//   BM_Idempotency_BeginCommit_Redis      begin + commit: 2 EVALSHA
//   BM_Lease_ClaimRelease_Redis           claim + release: 2 EVALSHA
//   BM_Baseline_Redis_RawHset             one HSET of comparable fields with raw hiredis
//   BM_SharedQuota_Acquire_Redis          one shared-quota decision: 1 EVALSHA
//   BM_Baseline_Redis_RawIncr             one INCR with raw hiredis
//   BM_SharedConcurrency_AcquireRelease_Redis  take + return one fleet-wide permit: 2 EVALSHA
//   BM_Baseline_Redis_RawSetDel           SET + DEL of one key with raw hiredis: 2 round trips
//   BM_SharedProviderState_HealthyPass    a pipeline pass through the shared provider state
//                                         and a breaker registry, the state's cache fresh
//   BM_Baseline_BreakerRegistry_Pass      the same pass through the breaker registry alone
//
// Counters: round_trips/op counted in keel's client layer (statements or
// commands sent per iteration), server_cmds/op from Redis's own INFO
// commandstats (calls of EVALSHA, EVAL, HSET, INCR during the benchmark),
// allocs/iter.
//
// Servers: with KEEL_BENCH_SERVERS=<dir> (holding postgres/conninfo and
// redis/port, as tests/servers/*.sh write them) those servers are used;
// otherwise the binary starts a throwaway PostgreSQL and Redis with
// tests/servers/{postgres,redis}.sh in a temporary directory and stops them
// at exit. PostgreSQL runs with fsync on (every commit is flushed), Redis
// with AOF appendfsync always, as in the tests.
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>
#include <hiredis/hiredis.h>
#include <libpq-fe.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "keel/durable/digest.hpp"
#include "keel/durable/idempotency.hpp"
#include "keel/durable/lease.hpp"
#include "keel/store/postgres.hpp"
#include "keel/store/redis.hpp"
#include "keel/compose/pipeline.hpp"
#include "keel/policy/breaker_registry.hpp"
#include "keel/fleet/shared_concurrency.hpp"
#include "keel/fleet/shared_provider_state.hpp"
#include "keel/fleet/shared_quota.hpp"
#include "support/alloc_counter.hpp"

#ifndef KEEL_SOURCE_DIR
#error "KEEL_SOURCE_DIR must name the source tree (for tests/servers/*.sh)"
#endif

using namespace std::chrono_literals;

namespace {

// The servers, started once for the whole binary (or taken from the environment).
class servers {
 public:
  static servers& get() {
    static servers s;
    return s;
  }
  [[nodiscard]] const std::string& conninfo() const { return conninfo_; }
  [[nodiscard]] int redis_port() const { return redis_port_; }

 private:
  servers() {
    if (const char* d = std::getenv("KEEL_BENCH_SERVERS"); d != nullptr && *d != '\0') {
      dir_ = d;
    } else {
      std::string pattern = std::filesystem::temp_directory_path().string() + "/keel-bench-servers-XXXXXX";
      if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
      dir_ = pattern;
      ::chmod(dir_.c_str(), 0755);  // PostgreSQL runs as its own user when started by root
      owned_ = true;
      for (const char* s : {"postgres", "redis"}) {
        const std::string cmd = absl::StrCat(KEEL_SOURCE_DIR, "/tests/servers/", s, ".sh start ", dir_, "/", s, " >&2");
        if (std::system(cmd.c_str()) != 0) throw std::runtime_error(cmd + " failed");
      }
    }
    conninfo_ = first_line(dir_ + "/postgres/conninfo");
    redis_port_ = std::stoi(first_line(dir_ + "/redis/port"));
  }
  ~servers() {
    if (!owned_) return;
    for (const char* s : {"postgres", "redis"}) {
      const std::string cmd = absl::StrCat(KEEL_SOURCE_DIR, "/tests/servers/", s, ".sh stop ", dir_, "/", s);
      (void)std::system(cmd.c_str());
    }
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  static std::string first_line(const std::string& path) {
    std::ifstream in(path);
    std::string line;
    if (!std::getline(in, line)) throw std::runtime_error("cannot read " + path);
    return line;
  }

  std::string dir_, conninfo_;
  int redis_port_ = 0;
  bool owned_ = false;
};

std::string fresh(const char* stem) {
  static std::atomic<int> n{0};
  return absl::StrCat(stem, "_", ::getpid(), "_", n.fetch_add(1));
}

// Keys "k-0".."k-N", built outside the timed loop.
std::vector<std::string> keys(std::int64_t n) {
  std::vector<std::string> k;
  k.reserve(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) k.push_back(absl::StrCat("k-", i));
  return k;
}
constexpr std::int64_t key_space = 200'000;

const keel::digest request = keel::digest_builder().field("receipt", "receipt-A").finish();
const keel::decision decided{.id = "dec-47", .model_digest = "m-large@sha256:1f0c", .policy_revision = "rev-1",
                             .result = std::string(200, 'r')};

// ---- Redis's own count of commands ------------------------------------------

class redis_raw {
 public:
  redis_raw() : c_(redisConnect("127.0.0.1", servers::get().redis_port())) {
    if (c_ == nullptr || c_->err) throw std::runtime_error("redis connect failed");
  }
  ~redis_raw() { redisFree(c_); }
  redis_raw(const redis_raw&) = delete;
  redis_raw& operator=(const redis_raw&) = delete;
  [[nodiscard]] redisContext* get() const noexcept { return c_; }

  // Calls of `names`, from INFO commandstats (commands a script runs are
  // counted under their own names, so EVALSHA counts scripts only).
  std::int64_t commands(const std::vector<const char*>& names) {
    auto* r = static_cast<redisReply*>(redisCommand(c_, "INFO commandstats"));
    std::int64_t total = 0;
    if (r != nullptr && r->type == REDIS_REPLY_STRING) {
      const std::string info(r->str, r->len);
      for (const char* cmd : names) {
        const std::string tag = absl::StrCat("cmdstat_", cmd, ":calls=");
        const std::size_t p = info.find(tag);
        if (p == std::string::npos) continue;
        std::int64_t v = 0;
        const std::size_t start = p + tag.size();
        (void)absl::SimpleAtoi(info.substr(start, info.find(',', start) - start), &v);
        total += v;
      }
    }
    if (r) freeReplyObject(r);
    return total;
  }

 private:
  redisContext* c_;
};

// Round trips as the server saw them: calls of the top-level commands the
// benchmark sends, per iteration.
class server_commands {
 public:
  server_commands(benchmark::State& state, std::vector<const char*> names)
      : state_(state), names_(std::move(names)), start_(admin_.commands(names_)) {}
  ~server_commands() {
    state_.counters["server_cmds/op"] = benchmark::Counter(static_cast<double>(admin_.commands(names_) - start_),
                                                           benchmark::Counter::kAvgIterations);
  }

 private:
  benchmark::State& state_;
  redis_raw admin_;
  std::vector<const char*> names_;
  std::int64_t start_;
};

const std::vector<const char*> scripts = {"evalsha", "eval"};

template <class Store>
void report_round_trips(benchmark::State& state, const Store& s, std::uint64_t before) {
  state.counters["round_trips/op"] =
      benchmark::Counter(static_cast<double>(s.round_trips() - before), benchmark::Counter::kAvgIterations);
}

// ---- PostgreSQL -------------------------------------------------------------

std::unique_ptr<keel::postgres_store> open_pg() {
  auto s = keel::postgres_store::open({.conninfo = servers::get().conninfo(), .schema = fresh("bench"), .pool_size = 2});
  if (!s.ok()) throw std::runtime_error(std::string(s.status().ToString()));
  return std::move(*s);
}

void BM_Idempotency_BeginCommit_Postgres(benchmark::State& state) {
  auto store = open_pg();
  const std::vector<std::string> k = keys(key_space);
  const keel::begin_options bo{.lease = 30s, .retention = 1h};
  std::int64_t i = 0;
  const std::uint64_t before = store->round_trips();
  {
    keel_bench::count_allocations allocs(state);
    for (auto _ : state) {
      const keel::request_identity id{.tenant = "merchant-82", .endpoint = "receipts", .key = k[i++ % key_space]};
      absl::StatusOr<keel::begin_outcome> b = store->begin(id, request, keel::owner_id::random(), bo);
      if (!b.ok() || b->state != keel::begin_state::claimed) {
        state.SkipWithError("begin failed");
        break;
      }
      if (!store->commit(id, b->ownership, decided, 1h).ok()) {
        state.SkipWithError("commit failed");
        break;
      }
    }
  }
  report_round_trips(state, *store, before);
}
BENCHMARK(BM_Idempotency_BeginCommit_Postgres)->Unit(benchmark::kMicrosecond)->UseRealTime();

void BM_Lease_ClaimRelease_Postgres(benchmark::State& state) {
  auto store = open_pg();
  const keel::owner_id me = keel::owner_id::random();
  const std::uint64_t before = store->round_trips();
  {
    keel_bench::count_allocations allocs(state);
    for (auto _ : state) {
      absl::StatusOr<keel::lease_claim> c = store->claim("nightly-report", me, 30s);
      if (!c.ok() || !c->acquired || !store->release("nightly-report", c->ownership).ok()) {
        state.SkipWithError("claim/release failed");
        break;
      }
    }
  }
  report_round_trips(state, *store, before);
}
BENCHMARK(BM_Lease_ClaimRelease_Postgres)->Unit(benchmark::kMicrosecond)->UseRealTime();

// One round trip of comparable work: a prepared INSERT ... ON CONFLICT DO
// UPDATE of a row like the idempotency record's, binary parameters,
// autocommit (so one fsynced commit, as each keel statement has).
void BM_Baseline_Postgres_RawUpsert(benchmark::State& state) {
  PGconn* c = PQconnectdb(servers::get().conninfo().c_str());
  const std::string schema = fresh("raw");
  PQclear(PQexec(c, ("CREATE SCHEMA " + schema + "; CREATE TABLE " + schema +
                     ".t (tenant bytea, endpoint bytea, key bytea, request bytea, owner bytea, fence int8,"
                     " expires int8, result bytea, PRIMARY KEY (tenant, endpoint, key))")
                        .c_str()));
  PQclear(PQprepare(c, "up",
                    ("INSERT INTO " + schema +
                     ".t VALUES ($1, $2, $3, $4, $5, 1, $6, $7) ON CONFLICT (tenant, endpoint, key) DO UPDATE SET"
                     " fence = t.fence + 1, expires = excluded.expires, result = excluded.result RETURNING fence")
                        .c_str(),
                    0, nullptr));
  const std::vector<std::string> k = keys(key_space);
  const auto owner = keel::owner_id::random().bytes();
  std::int64_t i = 0;
  {
    keel_bench::count_allocations allocs(state);
    for (auto _ : state) {
      const std::string& key = k[i++ % key_space];
      char expires[8] = {0, 0, 0, 0, 0, 0, 0, 1};
      const char* values[] = {"merchant-82", "receipts", key.data(), request.view().data(),
                              reinterpret_cast<const char*>(owner.data()), expires, decided.result.data()};
      const int lengths[] = {11, 8, static_cast<int>(key.size()), 32, 16, 8, static_cast<int>(decided.result.size())};
      const int formats[] = {1, 1, 1, 1, 1, 1, 1};
      PGresult* r = PQexecPrepared(c, "up", 7, values, lengths, formats, 1);
      const bool ok = PQresultStatus(r) == PGRES_TUPLES_OK;
      PQclear(r);
      if (!ok) {
        state.SkipWithError("raw upsert failed");
        break;
      }
    }
  }
  state.counters["round_trips/op"] = 1;
  PQfinish(c);
}
BENCHMARK(BM_Baseline_Postgres_RawUpsert)->Unit(benchmark::kMicrosecond)->UseRealTime();

// ---- Redis ------------------------------------------------------------------

std::unique_ptr<keel::redis_store> open_redis() {
  auto s = keel::redis_store::open({.port = servers::get().redis_port(), .key_prefix = fresh("bench") + ":", .pool_size = 2});
  if (!s.ok()) throw std::runtime_error(std::string(s.status().ToString()));
  return std::move(*s);
}

void BM_Idempotency_BeginCommit_Redis(benchmark::State& state) {
  auto store = open_redis();
  const std::vector<std::string> k = keys(key_space);
  const keel::begin_options bo{.lease = 30s, .retention = 1h};
  std::int64_t i = 0;
  const std::uint64_t before = store->round_trips();
  {
    server_commands cmds(state, scripts);
    keel_bench::count_allocations allocs(state);
    for (auto _ : state) {
      const keel::request_identity id{.tenant = "merchant-82", .endpoint = "receipts", .key = k[i++ % key_space]};
      absl::StatusOr<keel::begin_outcome> b = store->begin(id, request, keel::owner_id::random(), bo);
      if (!b.ok() || b->state != keel::begin_state::claimed) {
        state.SkipWithError("begin failed");
        break;
      }
      if (!store->commit(id, b->ownership, decided, 1h).ok()) {
        state.SkipWithError("commit failed");
        break;
      }
    }
  }
  report_round_trips(state, *store, before);
}
BENCHMARK(BM_Idempotency_BeginCommit_Redis)->Unit(benchmark::kMicrosecond)->UseRealTime();

void BM_Lease_ClaimRelease_Redis(benchmark::State& state) {
  auto store = open_redis();
  const keel::owner_id me = keel::owner_id::random();
  const std::uint64_t before = store->round_trips();
  {
    server_commands cmds(state, scripts);
    keel_bench::count_allocations allocs(state);
    for (auto _ : state) {
      absl::StatusOr<keel::lease_claim> c = store->claim("nightly-report", me, 30s);
      if (!c.ok() || !c->acquired || !store->release("nightly-report", c->ownership).ok()) {
        state.SkipWithError("claim/release failed");
        break;
      }
    }
  }
  report_round_trips(state, *store, before);
}
BENCHMARK(BM_Lease_ClaimRelease_Redis)->Unit(benchmark::kMicrosecond)->UseRealTime();

// One round trip of comparable work: HSET of the fields a claim writes.
void BM_Baseline_Redis_RawHset(benchmark::State& state) {
  redis_raw raw;
  const std::string prefix = fresh("raw") + ":idem:{";
  const std::vector<std::string> k = keys(key_space);
  const auto owner = keel::owner_id::random().bytes();
  std::int64_t i = 0;
  {
    server_commands cmds(state, {"hset"});
    keel_bench::count_allocations allocs(state);
    for (auto _ : state) {
      const std::string key = prefix + k[i++ % key_space] + "}";
      const char* argv[] = {"HSET", key.data(), "q", request.view().data(), "s", "0",
                            "o", reinterpret_cast<const char*>(owner.data()), "f", "1", "le", "1796013091784069"};
      const std::size_t lens[] = {4, key.size(), 1, 32, 1, 1, 1, 16, 1, 1, 2, 16};
      auto* r = static_cast<redisReply*>(redisCommandArgv(raw.get(), 12, argv, lens));
      const bool ok = r != nullptr && r->type == REDIS_REPLY_INTEGER;
      if (r) freeReplyObject(r);
      if (!ok) {
        state.SkipWithError("raw HSET failed");
        break;
      }
    }
  }
  state.counters["round_trips/op"] = 1;
}
BENCHMARK(BM_Baseline_Redis_RawHset)->Unit(benchmark::kMicrosecond)->UseRealTime();

void BM_SharedQuota_Acquire_Redis(benchmark::State& state) {
  keel::shared_quota q({.port = servers::get().redis_port(), .key_prefix = fresh("bench") + ":", .pool_size = 2},
                       {.name = "provider:m-large", .rate = 1e6, .burst = 1e9, .fallback_rate = 1});
  const keel::time_point now = keel::real_clock{}.now();
  {
    server_commands cmds(state, scripts);
    keel_bench::count_allocations allocs(state);
    for (auto _ : state) {
      const keel::shared_quota_decision d = q.try_acquire(now);
      if (!d.granted || d.source != keel::quota_source::shared) {
        state.SkipWithError("acquire refused or fell back");
        break;
      }
    }
  }
  state.counters["round_trips/op"] = benchmark::Counter(static_cast<double>(q.shared_decisions()),
                                                        benchmark::Counter::kAvgIterations);
}
BENCHMARK(BM_SharedQuota_Acquire_Redis)->Unit(benchmark::kMicrosecond)->UseRealTime();

void BM_Baseline_Redis_RawIncr(benchmark::State& state) {
  redis_raw raw;
  const std::string key = fresh("raw") + ":quota";
  {
    server_commands cmds(state, {"incr"});
    keel_bench::count_allocations allocs(state);
    for (auto _ : state) {
      const char* argv[] = {"INCR", key.data()};
      const std::size_t lens[] = {4, key.size()};
      auto* r = static_cast<redisReply*>(redisCommandArgv(raw.get(), 2, argv, lens));
      const bool ok = r != nullptr && r->type == REDIS_REPLY_INTEGER;
      if (r) freeReplyObject(r);
      if (!ok) {
        state.SkipWithError("raw INCR failed");
        break;
      }
    }
  }
  state.counters["round_trips/op"] = 1;
}
BENCHMARK(BM_Baseline_Redis_RawIncr)->Unit(benchmark::kMicrosecond)->UseRealTime();

// ---- fleet-wide concurrency and provider state ------------------------------

void BM_SharedConcurrency_AcquireRelease_Redis(benchmark::State& state) {
  keel::shared_concurrency c({.port = servers::get().redis_port(), .key_prefix = fresh("bench") + ":", .pool_size = 2},
                             {.name = "provider:m-large", .limit = 64});
  const keel::time_point now = keel::real_clock{}.now();
  {
    server_commands cmds(state, scripts);
    keel_bench::count_allocations allocs(state);
    for (auto _ : state) {
      keel::shared_permit p = c.try_acquire(now);
      if (!p || p.local_share()) {
        state.SkipWithError("acquire refused or on the local share");
        break;
      }
      absl::StatusOr<keel::permit_release> r = p.release();
      if (!r.ok() || *r != keel::permit_release::released) {
        state.SkipWithError("release failed");
        break;
      }
    }
  }
  state.counters["round_trips/op"] = benchmark::Counter(static_cast<double>(2 * c.shared_decisions()),
                                                        benchmark::Counter::kAvgIterations);
}
BENCHMARK(BM_SharedConcurrency_AcquireRelease_Redis)->Unit(benchmark::kMicrosecond)->UseRealTime();

// Two round trips of the simplest kind: SET a key, DEL it.
void BM_Baseline_Redis_RawSetDel(benchmark::State& state) {
  redis_raw raw;
  const std::string key = fresh("raw") + ":permit";
  {
    server_commands cmds(state, {"set", "del"});
    keel_bench::count_allocations allocs(state);
    for (auto _ : state) {
      const char* set[] = {"SET", key.data(), "1"};
      const std::size_t set_lens[] = {3, key.size(), 1};
      auto* r = static_cast<redisReply*>(redisCommandArgv(raw.get(), 3, set, set_lens));
      bool ok = r != nullptr && r->type == REDIS_REPLY_STATUS;
      if (r) freeReplyObject(r);
      const char* del[] = {"DEL", key.data()};
      const std::size_t del_lens[] = {3, key.size()};
      r = static_cast<redisReply*>(redisCommandArgv(raw.get(), 2, del, del_lens));
      ok = ok && r != nullptr && r->type == REDIS_REPLY_INTEGER;
      if (r) freeReplyObject(r);
      if (!ok) {
        state.SkipWithError("raw SET/DEL failed");
        break;
      }
    }
  }
  state.counters["round_trips/op"] = 2;
}
BENCHMARK(BM_Baseline_Redis_RawSetDel)->Unit(benchmark::kMicrosecond)->UseRealTime();

struct trivial_provider {
  absl::StatusOr<int> operator()(const keel::attempt&) const { return 1; }
};

// The healthy path: the state's cache is fresh (refresh_every 1 min: one
// read at the first pass), so a pass costs the lookup and a few loads.
void BM_SharedProviderState_HealthyPass(benchmark::State& state) {
  keel::breaker_registry breakers({});
  keel::shared_provider_state fleet({.port = servers::get().redis_port(), .key_prefix = fresh("bench") + ":"},
                                    {.refresh_every = 1min}, &breakers);
  auto pipe = keel::pipeline(fleet, breakers);
  const keel::labels labels{.model = "m-large", .endpoint = "api.provider", .region = "eu"};
  const keel::time_point now = keel::real_clock{}.now();
  {
    keel::call warm(now, {.timeout = 24h, .labels = labels});
    (void)pipe.run(warm, trivial_provider{});
  }
  const std::uint64_t trips = fleet.round_trips();
  {
    keel_bench::count_allocations allocs(state);
    for (auto _ : state) {
      keel::call call(now, {.timeout = 24h, .labels = labels});
      absl::StatusOr<int> r = pipe.run(call, trivial_provider{});
      benchmark::DoNotOptimize(r);
    }
  }
  state.counters["round_trips/op"] = benchmark::Counter(static_cast<double>(fleet.round_trips() - trips),
                                                        benchmark::Counter::kAvgIterations);
}
BENCHMARK(BM_SharedProviderState_HealthyPass);

void BM_Baseline_BreakerRegistry_Pass(benchmark::State& state) {
  keel::breaker_registry breakers({});
  auto pipe = keel::pipeline(breakers);
  const keel::labels labels{.model = "m-large", .endpoint = "api.provider", .region = "eu"};
  const keel::time_point now = keel::real_clock{}.now();
  keel_bench::count_allocations allocs(state);
  for (auto _ : state) {
    keel::call call(now, {.timeout = 24h, .labels = labels});
    absl::StatusOr<int> r = pipe.run(call, trivial_provider{});
    benchmark::DoNotOptimize(r);
  }
}
BENCHMARK(BM_Baseline_BreakerRegistry_Pass);

}  // namespace
