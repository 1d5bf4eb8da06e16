// Durable state: what an idempotent decision and a lease cost, and how far
// keel's SQLite store is from the same SQL done with raw sqlite3 calls in the
// same binary (BM_Baseline_Sqlite_RawUpsert). Names are stable; see
// docs/benchmarks.md.
//
// The SQLite benchmarks take Arg 0 = synchronous NORMAL, 1 = FULL, on files
// in a fresh temporary directory.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <mutex>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

#include <benchmark/benchmark.h>
#include <sqlite3.h>
#include <unistd.h>

#include "keel/core/condition.hpp"
#include "keel/durable/digest.hpp"
#include "keel/durable/idempotency.hpp"
#include "keel/durable/lease.hpp"
#include "keel/store/memory.hpp"
#include "keel/store/sqlite.hpp"
#include "support/alloc_counter.hpp"
#include "temp_dir.hpp"  // tests/support

using namespace std::chrono_literals;

namespace {

using keel_test::temp_dir;

keel::sqlite_sync sync_of(const benchmark::State& state) {
  return state.range(0) == 0 ? keel::sqlite_sync::normal : keel::sqlite_sync::full;
}

std::unique_ptr<keel::sqlite_store<>> open_store(const std::string& path, keel::sqlite_sync sync) {
  auto s = keel::sqlite_store<>::open(path, {.synchronous = sync});
  if (!s.ok()) std::abort();
  return std::move(*s);
}

// Keys "k-0".."k-N", built outside the timed loop.
std::vector<std::string> make_keys(std::size_t n) {
  std::vector<std::string> keys;
  keys.reserve(n);
  for (std::size_t i = 0; i < n; ++i) keys.push_back("k-" + std::to_string(i));
  return keys;
}

const keel::digest request = keel::digest_builder().field("receipt", "Lunch 42.17 EUR").finish();
const keel::decision verdict{.id = "dec-00000000000000000000000000000001",
                             .model_digest = "m-large@sha256:1f0c",
                             .policy_revision = "rev-1",
                             .result = "approve"};

// The steady clock plus an offset the benchmark can move forward: reading it
// costs what reading real_clock costs, and records can be made to expire
// without waiting.
struct jumping_clock {
  std::shared_ptr<std::atomic<std::int64_t>> offset = std::make_shared<std::atomic<std::int64_t>>(0);
  [[nodiscard]] keel::time_point now() const noexcept {
    return keel::real_clock{}.now() + keel::duration(offset->load(std::memory_order_relaxed));
  }
  bool sleep_until(keel::time_point t, std::stop_token stop) const {
    return keel::real_clock{}.sleep_until(t - keel::duration(offset->load()), std::move(stop));
  }
  template <class Ready>
  bool wait_until(std::unique_lock<std::mutex>& lock, keel::condition& cv, keel::time_point t,
                  std::stop_token stop, Ready ready) const {
    return keel::real_clock{}.wait_until(lock, cv, t - keel::duration(offset->load()), std::move(stop),
                                         std::move(ready));
  }
  void jump(keel::duration d) const { offset->fetch_add(d.count()); }
};
static_assert(keel::clock<jumping_clock>);

// begin (claimed) + commit of a new record, in memory. The loop cycles over
// 4096 keys and jumps the clock past their retention after each cycle, so
// every begin finds an expired record and reuses its slot (no growth).
void BM_Idempotency_BeginCommit_Memory(benchmark::State& state) {
  jumping_clock clock;
  keel::memory_store store(clock);
  constexpr std::size_t n = 4096;
  const std::vector<std::string> keys = make_keys(n);
  const keel::begin_options bo{.lease = 10s, .retention = 60s};
  std::size_t i = 0;
  keel_bench::count_allocations allocs(state);
  for (auto _ : state) {
    if ((i & (n - 1)) == 0) clock.jump(120s);
    const keel::request_identity id{"merchant-82", "receipts", keys[i++ & (n - 1)]};
    absl::StatusOr<keel::begin_outcome> b = store.begin(id, request, keel::owner_id::random(), bo);
    if (!b.ok() || b->state != keel::begin_state::claimed) {
      state.SkipWithError("not claimed");
      break;
    }
    absl::Status c = store.commit(id, b->ownership, verdict, 60s);
    if (!c.ok()) {
      state.SkipWithError("commit failed");
      break;
    }
  }
}
BENCHMARK(BM_Idempotency_BeginCommit_Memory);

// begin (claimed) + commit of a new record: two BEGIN IMMEDIATE transactions.
void BM_Idempotency_BeginCommit_Sqlite(benchmark::State& state) {
  temp_dir dir;
  auto store = open_store(dir.file("keel.db"), sync_of(state));
  const std::vector<std::string> keys = make_keys(1 << 20);
  const keel::begin_options bo{.lease = 30s, .retention = 24h};
  std::size_t i = 0;
  keel_bench::count_allocations allocs(state);
  for (auto _ : state) {
    const keel::request_identity id{"merchant-82", "receipts", keys[i++ % keys.size()]};
    absl::StatusOr<keel::begin_outcome> b = store->begin(id, request, keel::owner_id::random(), bo);
    if (!b.ok() || b->state != keel::begin_state::claimed) {
      state.SkipWithError("not claimed");
      break;
    }
    absl::Status c = store->commit(id, b->ownership, verdict, 24h);
    if (!c.ok()) {
      state.SkipWithError("commit failed");
      break;
    }
  }
}
BENCHMARK(BM_Idempotency_BeginCommit_Sqlite)->Arg(0)->Arg(1)->ArgName("full");

// begin on a committed record: the replay a retried request gets.
void BM_Idempotency_Replay_Sqlite(benchmark::State& state) {
  temp_dir dir;
  auto store = open_store(dir.file("keel.db"), keel::sqlite_sync::normal);
  const keel::request_identity id{"merchant-82", "receipts", "key-47"};
  const keel::begin_options bo{.lease = 30s, .retention = 24h};
  auto b = store->begin(id, request, keel::owner_id::random(), bo);
  if (!b.ok() || !store->commit(id, b->ownership, verdict, 24h).ok()) std::abort();
  keel_bench::count_allocations allocs(state);
  for (auto _ : state) {
    absl::StatusOr<keel::begin_outcome> r = store->begin(id, request, keel::owner_id::random(), bo);
    if (!r.ok() || r->state != keel::begin_state::replay) state.SkipWithError("not a replay");
    benchmark::DoNotOptimize(r);
  }
}
BENCHMARK(BM_Idempotency_Replay_Sqlite);

// claim + release of one work key (the fence grows every round).
void BM_Lease_ClaimRelease_Sqlite(benchmark::State& state) {
  temp_dir dir;
  auto store = open_store(dir.file("keel.db"), sync_of(state));
  keel_bench::count_allocations allocs(state);
  for (auto _ : state) {
    absl::StatusOr<keel::lease_claim> c = store->claim("nightly", keel::owner_id::random(), 30s);
    if (!c.ok() || !c->acquired) state.SkipWithError("not acquired");
    absl::Status r = store->release("nightly", c->ownership);
    if (!r.ok()) {
      state.SkipWithError("release failed");
      break;
    }
  }
}
BENCHMARK(BM_Lease_ClaimRelease_Sqlite)->Arg(0)->Arg(1)->ArgName("full");

// The same SQL work as BM_Idempotency_BeginCommit_Sqlite with raw sqlite3
// calls: same table, same prepared statements, same transactions (BEGIN
// IMMEDIATE; SELECT the row; INSERT the claim; COMMIT — BEGIN IMMEDIATE;
// fenced UPDATE; COMMIT). What it leaves out is keel's own work: key and
// option validation, the store clock and its mark, a random owner, statuses.
void BM_Baseline_Sqlite_RawUpsert(benchmark::State& state) {
  temp_dir dir;
  sqlite3* db = nullptr;
  if (sqlite3_open(dir.file("raw.db").c_str(), &db) != SQLITE_OK) std::abort();
  sqlite3_busy_timeout(db, 5000);
  auto exec = [&](const char* sql) {
    if (sqlite3_exec(db, sql, nullptr, nullptr, nullptr) != SQLITE_OK) std::abort();
  };
  exec("PRAGMA journal_mode=WAL");
  exec(state.range(0) == 0 ? "PRAGMA synchronous=NORMAL" : "PRAGMA synchronous=FULL");
  exec("CREATE TABLE keel_idempotency("
       "  tenant BLOB NOT NULL, endpoint BLOB NOT NULL, key BLOB NOT NULL,"
       "  request BLOB NOT NULL, state INTEGER NOT NULL, owner BLOB NOT NULL, fence INTEGER NOT NULL,"
       "  lease_expires INTEGER NOT NULL, record_expires INTEGER NOT NULL,"
       "  decision_id BLOB, model_digest BLOB, policy_revision BLOB, result BLOB,"
       "  error_code INTEGER NOT NULL DEFAULT 0, error_message BLOB, committed_at INTEGER NOT NULL DEFAULT 0,"
       "  PRIMARY KEY (tenant, endpoint, key)) WITHOUT ROWID");
  auto prepare = [&](const char* sql) {
    sqlite3_stmt* s = nullptr;
    if (sqlite3_prepare_v3(db, sql, -1, SQLITE_PREPARE_PERSISTENT, &s, nullptr) != SQLITE_OK) std::abort();
    return s;
  };
  sqlite3_stmt* begin = prepare("BEGIN IMMEDIATE");
  sqlite3_stmt* commit = prepare("COMMIT");
  sqlite3_stmt* select = prepare(
      "SELECT request, state, owner, fence, lease_expires, record_expires, decision_id, model_digest,"
      " policy_revision, result, error_code, error_message, committed_at"
      " FROM keel_idempotency WHERE tenant = ?1 AND endpoint = ?2 AND key = ?3");
  sqlite3_stmt* claim = prepare(
      "INSERT INTO keel_idempotency(tenant, endpoint, key, request, state, owner, fence, lease_expires,"
      " record_expires) VALUES (?1, ?2, ?3, ?4, 0, ?5, ?6, ?7, ?8)"
      " ON CONFLICT (tenant, endpoint, key) DO UPDATE SET request = excluded.request, state = 0,"
      " owner = excluded.owner, fence = excluded.fence, lease_expires = excluded.lease_expires,"
      " record_expires = excluded.record_expires, decision_id = NULL, model_digest = NULL,"
      " policy_revision = NULL, result = NULL, error_code = 0, error_message = NULL, committed_at = 0");
  sqlite3_stmt* fenced = prepare(
      "UPDATE keel_idempotency SET state = 1, decision_id = ?4, model_digest = ?5, policy_revision = ?6,"
      " result = ?7, error_code = ?8, error_message = ?9, committed_at = ?10, record_expires = ?11"
      " WHERE tenant = ?1 AND endpoint = ?2 AND key = ?3 AND state = 0 AND owner = ?12 AND fence = ?13"
      " AND record_expires > ?14");
  auto run = [&](sqlite3_stmt* s) {
    int rc;
    while ((rc = sqlite3_step(s)) == SQLITE_ROW) {
    }
    if (rc != SQLITE_DONE) std::abort();
    sqlite3_reset(s);
  };
  auto text = [](sqlite3_stmt* s, int i, std::string_view v) {
    sqlite3_bind_blob(s, i, v.data(), static_cast<int>(v.size()), SQLITE_STATIC);
  };
  const std::vector<std::string> keys = make_keys(1 << 20);
  const unsigned char owner[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
  std::size_t i = 0;
  keel_bench::count_allocations allocs(state);
  for (auto _ : state) {
    const std::string& key = keys[i++ % keys.size()];
    const std::int64_t now = std::chrono::system_clock::now().time_since_epoch().count();
    run(begin);
    text(select, 1, "merchant-82");
    text(select, 2, "receipts");
    text(select, 3, key);
    run(select);
    text(claim, 1, "merchant-82");
    text(claim, 2, "receipts");
    text(claim, 3, key);
    text(claim, 4, request.view());
    sqlite3_bind_blob(claim, 5, owner, 16, SQLITE_STATIC);
    sqlite3_bind_int64(claim, 6, 1);
    sqlite3_bind_int64(claim, 7, now + 30'000'000'000);
    sqlite3_bind_int64(claim, 8, now + 86'400'000'000'000);
    run(claim);
    run(commit);
    run(begin);
    text(fenced, 1, "merchant-82");
    text(fenced, 2, "receipts");
    text(fenced, 3, key);
    text(fenced, 4, verdict.id);
    text(fenced, 5, verdict.model_digest);
    text(fenced, 6, verdict.policy_revision);
    text(fenced, 7, verdict.result);
    sqlite3_bind_int64(fenced, 8, 0);
    text(fenced, 9, "");
    sqlite3_bind_int64(fenced, 10, now);
    sqlite3_bind_int64(fenced, 11, now + 86'400'000'000'000);
    sqlite3_bind_blob(fenced, 12, owner, 16, SQLITE_STATIC);
    sqlite3_bind_int64(fenced, 13, 1);
    sqlite3_bind_int64(fenced, 14, now);
    run(fenced);
    if (sqlite3_changes(db) != 1) std::abort();
    run(commit);
  }
  for (sqlite3_stmt* s : {begin, commit, select, claim, fenced}) sqlite3_finalize(s);
  sqlite3_close(db);
}
BENCHMARK(BM_Baseline_Sqlite_RawUpsert)->Arg(0)->Arg(1)->ArgName("full");

// The request digest a caller builds per request: three framed fields.
void BM_Digest_Builder_3Fields(benchmark::State& state) {
  const std::string facts(512, 'f');
  keel_bench::count_allocations allocs(state);
  for (auto _ : state) {
    keel::digest d =
        keel::digest_builder().field("facts", facts).field("model", "m-large").field("rubric", "panel-v3").finish();
    benchmark::DoNotOptimize(d);
  }
}
BENCHMARK(BM_Digest_Builder_3Fields);

// What a random owner costs (OpenSSL's CSPRNG; safe after fork).
void BM_OwnerId_Random(benchmark::State& state) {
  keel_bench::count_allocations allocs(state);
  for (auto _ : state) benchmark::DoNotOptimize(keel::owner_id::random());
}
BENCHMARK(BM_OwnerId_Random);

}  // namespace
