// The durable job queue: what one job costs end to end on SQLite (submit,
// claim, complete: three BEGIN IMMEDIATE transactions), beside the same SQL
// done with raw sqlite3 calls in the same binary, and the full worker path
// (run_one, with its lease keeper thread). Names are stable; see
// docs/benchmarks.md.
//
// Arg 0 = synchronous NORMAL, 1 = FULL; files in a fresh temporary directory.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <benchmark/benchmark.h>
#include <sqlite3.h>
#include <unistd.h>

#include "keel/durable/digest.hpp"
#include "keel/durable/job_queue.hpp"
#include "keel/store/sqlite_jobs.hpp"
#include "support/alloc_counter.hpp"
#include "temp_dir.hpp"  // tests/support

namespace {

using keel_test::temp_dir;

// Keys "k-0".."k-N", built outside the timed loop (every job a new key).
std::vector<std::string> make_keys(std::size_t n) {
  std::vector<std::string> keys;
  keys.reserve(n);
  for (std::size_t i = 0; i < n; ++i) keys.push_back("k-" + std::to_string(i));
  return keys;
}

constexpr std::string_view payload = R"({"report":"weekly","tenant":"acme","window":"2025-10-06/7d"})";

std::unique_ptr<keel::sqlite_job_store<>> open_store(const std::string& path, const benchmark::State& state) {
  auto s = keel::sqlite_job_store<>::open(
      path, {.synchronous = state.range(0) == 0 ? keel::sqlite_sync::normal : keel::sqlite_sync::full});
  if (!s.ok()) std::abort();
  return std::move(*s);
}

// One job's life through the store: job_queue::submit (validation, SHA-256
// of the payload, one transaction), claim (one transaction: the owner's own
// job, age expiry, lapsed leases, the oldest due job, the take), complete
// (one fenced transaction).
void BM_JobQueue_SubmitClaimComplete_Sqlite(benchmark::State& state) {
  temp_dir dir;
  auto store = open_store(dir.file("jobs.db"), state);
  keel::job_queue q(*store, {.queue = "reports"});
  const std::vector<std::string> keys = make_keys(1 << 20);
  std::size_t i = 0;
  keel_bench::count_allocations allocs(state);
  for (auto _ : state) {
    absl::StatusOr<keel::job_submission> s = q.submit("acme", keys[i++ % keys.size()], payload);
    if (!s.ok()) state.SkipWithError("submit failed");
    absl::StatusOr<std::optional<keel::job_claim>> c = store->claim("reports", keel::owner_id::random(), std::chrono::seconds(30));
    if (!c.ok() || !c->has_value()) {
      state.SkipWithError("claim failed");
      break;
    }
    if (!store->complete((*c)->id, (*c)->ownership, "done").ok()) state.SkipWithError("complete failed");
  }
}
BENCHMARK(BM_JobQueue_SubmitClaimComplete_Sqlite)->Arg(0)->Arg(1)->ArgName("full");

// The same SQL work with raw sqlite3 calls: the same tables and indexes, the
// same prepared statements in the same three BEGIN IMMEDIATE transactions.
// What it leaves out is keel's own work: key and limit validation, the
// payload digest, the store clock and its high-water mark, a random owner,
// statuses and the strings a claim returns.
void BM_Baseline_Sqlite_RawJobTransactions(benchmark::State& state) {
  temp_dir dir;
  sqlite3* db = nullptr;
  if (sqlite3_open(dir.file("raw.db").c_str(), &db) != SQLITE_OK) std::abort();
  sqlite3_busy_timeout(db, 5000);
  auto exec = [&](const char* sql) {
    if (sqlite3_exec(db, sql, nullptr, nullptr, nullptr) != SQLITE_OK) std::abort();
  };
  exec("PRAGMA journal_mode=WAL");
  exec(state.range(0) == 0 ? "PRAGMA synchronous=NORMAL" : "PRAGMA synchronous=FULL");
  exec("CREATE TABLE keel_job("
       "  id INTEGER PRIMARY KEY AUTOINCREMENT,"
       "  queue BLOB NOT NULL, tenant BLOB NOT NULL, key BLOB NOT NULL, digest BLOB NOT NULL,"
       "  payload BLOB NOT NULL, state INTEGER NOT NULL, attempts INTEGER NOT NULL,"
       "  max_attempts INTEGER NOT NULL, owner BLOB, fence INTEGER NOT NULL,"
       "  lease_expires INTEGER NOT NULL, took_over INTEGER NOT NULL, created_at INTEGER NOT NULL,"
       "  expires_at INTEGER NOT NULL, available_at INTEGER NOT NULL, started_at INTEGER NOT NULL,"
       "  finished_at INTEGER NOT NULL, result BLOB, error_code INTEGER NOT NULL, error_message BLOB,"
       "  UNIQUE (queue, tenant, key));"
       "CREATE INDEX keel_job_queued ON keel_job(queue, id) WHERE state = 0;"
       "CREATE INDEX keel_job_aging ON keel_job(queue, expires_at) WHERE state = 0;"
       "CREATE INDEX keel_job_running ON keel_job(queue, lease_expires) WHERE state = 1;"
       "CREATE INDEX keel_job_owner ON keel_job(owner) WHERE state = 1;"
       "CREATE INDEX keel_job_finished ON keel_job(queue, finished_at) WHERE state >= 2;"
       "CREATE TABLE keel_job_depth(queue BLOB PRIMARY KEY, live INTEGER NOT NULL) WITHOUT ROWID;");
  auto prepare = [&](const char* sql) {
    sqlite3_stmt* s = nullptr;
    if (sqlite3_prepare_v3(db, sql, -1, SQLITE_PREPARE_PERSISTENT, &s, nullptr) != SQLITE_OK) std::abort();
    return s;
  };
  sqlite3_stmt* begin = prepare("BEGIN IMMEDIATE");
  sqlite3_stmt* commit = prepare("COMMIT");
  sqlite3_stmt* select_key =
      prepare("SELECT id, digest, state, attempts, expires_at FROM keel_job WHERE queue = ?1 AND tenant = ?2 AND key = ?3");
  sqlite3_stmt* expire =
      prepare("UPDATE keel_job SET state = 4, finished_at = expires_at WHERE queue = ?1 AND state = 0 AND expires_at <= ?2");
  sqlite3_stmt* depth_read = prepare("SELECT live FROM keel_job_depth WHERE queue = ?1");
  sqlite3_stmt* depth_add = prepare(
      "INSERT INTO keel_job_depth(queue, live) VALUES (?1, ?2) ON CONFLICT (queue) DO UPDATE SET live = live + excluded.live");
  sqlite3_stmt* insert = prepare(
      "INSERT INTO keel_job(queue, tenant, key, digest, payload, state, attempts, max_attempts, owner, fence,"
      " lease_expires, took_over, created_at, expires_at, available_at, started_at, finished_at, error_code)"
      " VALUES (?1, ?2, ?3, ?4, ?5, 0, 0, ?6, NULL, 0, 0, 0, ?7, ?8, ?7, 0, 0, 0) RETURNING id");
  sqlite3_stmt* select_mine =
      prepare("SELECT id FROM keel_job WHERE owner = ?2 AND state = 1 AND queue = ?1 ORDER BY id LIMIT 1");
  sqlite3_stmt* fail_lapsed = prepare(
      "UPDATE keel_job SET state = 3, finished_at = ?2, error_code = ?3, error_message = ?4"
      " WHERE queue = ?1 AND state = 1 AND lease_expires <= ?2 AND attempts >= max_attempts");
  sqlite3_stmt* pick_queued = prepare(
      "SELECT id FROM keel_job WHERE queue = ?1 AND state = 0 AND available_at <= ?2 AND expires_at > ?2"
      " ORDER BY id LIMIT 1");
  sqlite3_stmt* pick_lapsed =
      prepare("SELECT id FROM keel_job WHERE queue = ?1 AND state = 1 AND lease_expires <= ?2 ORDER BY id LIMIT 1");
  sqlite3_stmt* take = prepare(
      "UPDATE keel_job SET took_over = (state = 1), state = 1, owner = ?2, fence = fence + 1,"
      " attempts = attempts + 1, lease_expires = ?3, started_at = ?4 WHERE id = ?1 RETURNING"
      " id, tenant, key, payload, fence, attempts, max_attempts, took_over, created_at, lease_expires");
  sqlite3_stmt* complete = prepare(
      "UPDATE keel_job SET state = 2, result = ?4, finished_at = ?5"
      " WHERE id = ?1 AND state = 1 AND owner = ?2 AND fence = ?3 RETURNING queue");
  auto run = [&](sqlite3_stmt* s) {
    int rc;
    while ((rc = sqlite3_step(s)) == SQLITE_ROW) {
    }
    if (rc != SQLITE_DONE) std::abort();
    sqlite3_reset(s);
  };
  // Steps to the first row and keeps it readable (reset by the caller).
  auto row = [&](sqlite3_stmt* s) { return sqlite3_step(s) == SQLITE_ROW; };
  auto blob = [](sqlite3_stmt* s, int i, std::string_view v) {
    sqlite3_bind_blob(s, i, v.empty() ? "" : v.data(), static_cast<int>(v.size()), SQLITE_STATIC);
  };
  const std::vector<std::string> keys = make_keys(1 << 20);
  const unsigned char owner[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
  const std::string_view owner_view(reinterpret_cast<const char*>(owner), sizeof owner);
  const keel::digest d = keel::sha256(payload);
  constexpr std::string_view queue = "reports";
  std::size_t i = 0;
  keel_bench::count_allocations allocs(state);
  for (auto _ : state) {
    const std::string& key = keys[i++ % keys.size()];
    const std::int64_t now = std::chrono::system_clock::now().time_since_epoch().count();
    // submit
    run(begin);
    blob(select_key, 1, queue), blob(select_key, 2, "acme"), blob(select_key, 3, key);
    if (row(select_key)) std::abort();
    sqlite3_reset(select_key);
    blob(expire, 1, queue), sqlite3_bind_int64(expire, 2, now);
    run(expire);
    blob(depth_read, 1, queue);
    const std::int64_t live = row(depth_read) ? sqlite3_column_int64(depth_read, 0) : 0;
    sqlite3_reset(depth_read);
    if (live >= 10'000) std::abort();
    blob(insert, 1, queue), blob(insert, 2, "acme"), blob(insert, 3, key), blob(insert, 4, d.view());
    blob(insert, 5, payload), sqlite3_bind_int64(insert, 6, 3), sqlite3_bind_int64(insert, 7, now);
    sqlite3_bind_int64(insert, 8, now + 3'600'000'000'000);
    run(insert);
    blob(depth_add, 1, queue), sqlite3_bind_int64(depth_add, 2, 1);
    run(depth_add);
    run(commit);
    // claim
    run(begin);
    blob(select_mine, 1, queue), blob(select_mine, 2, owner_view);
    if (row(select_mine)) std::abort();
    sqlite3_reset(select_mine);
    blob(expire, 1, queue), sqlite3_bind_int64(expire, 2, now);
    run(expire);
    blob(fail_lapsed, 1, queue), sqlite3_bind_int64(fail_lapsed, 2, now), sqlite3_bind_int64(fail_lapsed, 3, 4);
    blob(fail_lapsed, 4, "lapsed");
    run(fail_lapsed);
    std::int64_t pick = 0;
    for (sqlite3_stmt* p : {pick_queued, pick_lapsed}) {
      blob(p, 1, queue), sqlite3_bind_int64(p, 2, now);
      if (row(p)) {
        const std::int64_t id = sqlite3_column_int64(p, 0);
        pick = pick == 0 ? id : std::min(pick, id);
      }
      sqlite3_reset(p);
    }
    sqlite3_bind_int64(take, 1, pick), blob(take, 2, owner_view), sqlite3_bind_int64(take, 3, now + 30'000'000'000);
    sqlite3_bind_int64(take, 4, now);
    if (!row(take)) std::abort();
    const std::int64_t id = sqlite3_column_int64(take, 0);
    const std::int64_t fence = sqlite3_column_int64(take, 4);
    benchmark::DoNotOptimize(sqlite3_column_blob(take, 3));
    sqlite3_reset(take);
    run(commit);
    // complete
    run(begin);
    sqlite3_bind_int64(complete, 1, id), blob(complete, 2, owner_view), sqlite3_bind_int64(complete, 3, fence);
    blob(complete, 4, "done"), sqlite3_bind_int64(complete, 5, now);
    if (!row(complete)) std::abort();
    sqlite3_reset(complete);
    blob(depth_add, 1, queue), sqlite3_bind_int64(depth_add, 2, -1);
    run(depth_add);
    run(commit);
  }
  for (sqlite3_stmt* s : {begin, commit, select_key, expire, depth_read, depth_add, insert, select_mine, fail_lapsed,
                          pick_queued, pick_lapsed, take, complete})
    sqlite3_finalize(s);
  sqlite3_close(db);
}
BENCHMARK(BM_Baseline_Sqlite_RawJobTransactions)->Arg(0)->Arg(1)->ArgName("full");

// The worker's whole path per job: submit, then run_one — claim, a
// lease_keeper thread renewing in the background while the handler runs,
// the fenced complete. The difference to SubmitClaimComplete is the keeper
// (a thread started and joined per job) and the handler call.
void BM_JobQueue_SubmitRunOne_Sqlite(benchmark::State& state) {
  temp_dir dir;
  auto store = open_store(dir.file("jobs.db"), state);
  keel::job_queue q(*store, {.queue = "reports"});
  const std::vector<std::string> keys = make_keys(1 << 20);
  std::size_t i = 0;
  auto handler = [](const keel::job_context& j) -> absl::StatusOr<std::string> { return std::string(j.key); };
  keel_bench::count_allocations allocs(state);
  for (auto _ : state) {
    if (!q.submit("acme", keys[i++ % keys.size()], payload).ok()) state.SkipWithError("submit failed");
    absl::StatusOr<std::optional<keel::job_outcome>> r = q.run_one(handler);
    if (!r.ok() || !r->has_value() || (*r)->state != keel::job_state::done) {
      state.SkipWithError("run_one failed");
      break;
    }
  }
}
BENCHMARK(BM_JobQueue_SubmitRunOne_Sqlite)->Arg(0)->ArgName("full");

}  // namespace
