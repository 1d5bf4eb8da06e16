// keel::sqlite_store beyond the conformance suite: restarts, the persisted
// clock mark, foreign / corrupted / mismatched files, a busy file, an I/O
// error at COMMIT, and N threads on their own connections.
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <latch>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <sqlite3.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "support/durable.hpp"
#include "keel/core/call.hpp"
#include "keel/core/outcome.hpp"
#include "keel/durable/digest.hpp"
#include "keel/durable/once.hpp"
#include "keel/store/sqlite.hpp"
#include "keel/testing/manual_clock.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;
using keel::testing::manual_clock;
using store_t = keel::sqlite_store<manual_clock>;

namespace {

const keel::request_identity receipt_key{.tenant = "merchant-82", .endpoint = "receipts", .key = "key-47"};
keel::digest receipt(std::string_view s) { return keel::digest_builder().field("receipt", s).finish(); }
const keel::begin_options bo{.lease = 30s, .retention = 2h};

bool contains(absl::string_view s, absl::string_view part) { return s.find(part) != absl::string_view::npos; }

void raw_exec(const std::string& path, const char* sql) {
  sqlite3* db = nullptr;
  REQUIRE(sqlite3_open(path.c_str(), &db) == SQLITE_OK);
  char* err = nullptr;
  const int rc = sqlite3_exec(db, sql, nullptr, nullptr, &err);
  INFO((err ? err : ""));
  sqlite3_free(err);
  sqlite3_close(db);
  REQUIRE(rc == SQLITE_OK);
}

// ---- a fault-injecting VFS: the default one, with WAL writes that fail on demand
std::atomic<bool> fail_wal_writes{false};
std::atomic<int> failed_writes{0};
sqlite3_vfs faulty_vfs;
sqlite3_io_methods faulty_methods;

struct faulty_file {
  sqlite3_file base;
  sqlite3_file* real;
  bool wal;
};
sqlite3_file* real_of(sqlite3_file* f) { return reinterpret_cast<faulty_file*>(f)->real; }

int faulty_open(sqlite3_vfs* vfs, const char* name, sqlite3_file* file, int flags, int* out_flags) {
  auto* parent = static_cast<sqlite3_vfs*>(vfs->pAppData);
  auto* f = reinterpret_cast<faulty_file*>(file);
  f->real = reinterpret_cast<sqlite3_file*>(f + 1);
  f->wal = (flags & SQLITE_OPEN_WAL) != 0;
  const int rc = parent->xOpen(parent, name, f->real, flags, out_flags);
  f->base.pMethods = f->real->pMethods != nullptr ? &faulty_methods : nullptr;
  return rc;
}

void install_faulty_vfs() {
  static const bool installed = [] {
    sqlite3_vfs* parent = sqlite3_vfs_find(nullptr);
    faulty_vfs = *parent;
    faulty_vfs.zName = "keel-faulty";
    faulty_vfs.szOsFile = static_cast<int>(sizeof(faulty_file)) + parent->szOsFile;
    faulty_vfs.pAppData = parent;
    faulty_vfs.xOpen = faulty_open;
    faulty_methods.iVersion = 3;
    faulty_methods.xClose = [](sqlite3_file* f) { return real_of(f)->pMethods->xClose(real_of(f)); };
    faulty_methods.xRead = [](sqlite3_file* f, void* b, int n, sqlite3_int64 o) {
      return real_of(f)->pMethods->xRead(real_of(f), b, n, o);
    };
    faulty_methods.xWrite = [](sqlite3_file* f, const void* b, int n, sqlite3_int64 o) {
      if (reinterpret_cast<faulty_file*>(f)->wal && fail_wal_writes.load()) {
        failed_writes.fetch_add(1);
        return SQLITE_IOERR_WRITE;
      }
      return real_of(f)->pMethods->xWrite(real_of(f), b, n, o);
    };
    faulty_methods.xTruncate = [](sqlite3_file* f, sqlite3_int64 s) {
      return real_of(f)->pMethods->xTruncate(real_of(f), s);
    };
    faulty_methods.xSync = [](sqlite3_file* f, int flags) { return real_of(f)->pMethods->xSync(real_of(f), flags); };
    faulty_methods.xFileSize = [](sqlite3_file* f, sqlite3_int64* s) {
      return real_of(f)->pMethods->xFileSize(real_of(f), s);
    };
    faulty_methods.xLock = [](sqlite3_file* f, int l) { return real_of(f)->pMethods->xLock(real_of(f), l); };
    faulty_methods.xUnlock = [](sqlite3_file* f, int l) { return real_of(f)->pMethods->xUnlock(real_of(f), l); };
    faulty_methods.xCheckReservedLock = [](sqlite3_file* f, int* r) {
      return real_of(f)->pMethods->xCheckReservedLock(real_of(f), r);
    };
    faulty_methods.xFileControl = [](sqlite3_file* f, int op, void* a) {
      return real_of(f)->pMethods->xFileControl(real_of(f), op, a);
    };
    faulty_methods.xSectorSize = [](sqlite3_file* f) { return real_of(f)->pMethods->xSectorSize(real_of(f)); };
    faulty_methods.xDeviceCharacteristics = [](sqlite3_file* f) {
      return real_of(f)->pMethods->xDeviceCharacteristics(real_of(f));
    };
    faulty_methods.xShmMap = [](sqlite3_file* f, int p, int s, int e, void volatile** m) {
      return real_of(f)->pMethods->xShmMap(real_of(f), p, s, e, m);
    };
    faulty_methods.xShmLock = [](sqlite3_file* f, int o, int n, int fl) {
      return real_of(f)->pMethods->xShmLock(real_of(f), o, n, fl);
    };
    faulty_methods.xShmBarrier = [](sqlite3_file* f) { real_of(f)->pMethods->xShmBarrier(real_of(f)); };
    faulty_methods.xShmUnmap = [](sqlite3_file* f, int d) { return real_of(f)->pMethods->xShmUnmap(real_of(f), d); };
    faulty_methods.xFetch = [](sqlite3_file* f, sqlite3_int64 o, int n, void** p) {
      return real_of(f)->pMethods->xFetch(real_of(f), o, n, p);
    };
    faulty_methods.xUnfetch = [](sqlite3_file* f, sqlite3_int64 o, void* p) {
      return real_of(f)->pMethods->xUnfetch(real_of(f), o, p);
    };
    return sqlite3_vfs_register(&faulty_vfs, 0) == SQLITE_OK;
  }();
  REQUIRE(installed);
}

}  // namespace

TEST_CASE("sqlite options are validated", "[sqlite]") {
  CHECK(keel::sqlite_options{}.validate().ok());
  CHECK(keel::sqlite_options{.busy_timeout = -1ms}.validate().message() ==
        "sqlite_options.busy_timeout must be in [0, 24h] (got -1ms)");
  CHECK(keel::sqlite_options{.integrity_check_timeout = 0s}.validate().message() ==
        "sqlite_options.integrity_check_timeout must be in (0, 24h] (got 0s)");
  CHECK(keel::sqlite_options{.integrity_check = static_cast<keel::sqlite_integrity_check>(7)}.validate().message() ==
        "sqlite_options.integrity_check must be quick, full or off (got 7)");
  auto r = keel::sqlite_store<>::open("/tmp/never-created.db", {.busy_timeout = 25h});
  CHECK(r.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(::access("/tmp/never-created.db", F_OK) != 0);
}

TEST_CASE("decisions, leases and results survive closing and reopening the file", "[sqlite][restart]") {
  keel_durable::temp_dir dir;
  const std::string db = dir.file("receipts.db");
  manual_clock clock;
  std::string decided;
  {
    auto store = keel_durable::open_sqlite(db, clock);
    keel::once decide(*store, {.lease = 30s, .retention = 2h, .retry_window = 1h}, keel::environment{clock});
    keel::call call(clock.now(), {.timeout = 3s});
    auto r = decide.run(call, receipt_key, receipt("A"), [](const keel::claim_context&) -> absl::StatusOr<keel::decision> {
      return keel::decision{.result = "approve"};
    });
    REQUIRE(r.ok());
    decided = r->decision.id;
    auto l = store->claim("nightly", keel::owner_id::random(), 30s);
    REQUIRE(store->release("nightly", l->ownership).ok());
    REQUIRE(*store->save_result("panel", "score=80", 0s));
  }
  clock.advance(10min);
  auto store = keel_durable::open_sqlite(db, clock);
  auto replay = store->begin(receipt_key, receipt("A"), keel::owner_id::random(), bo);
  REQUIRE(replay.ok());
  CHECK(replay->state == keel::begin_state::replay);
  CHECK(replay->decision.id == decided);
  auto l = store->claim("nightly", keel::owner_id::random(), 30s);
  CHECK(l->ownership.fence == 2);  // the fence survived the restart
  CHECK(*store->load_result("panel") == std::optional<std::string>("score=80"));
}

TEST_CASE("the clock mark is persisted: a clock stepped back after a restart lets no second owner in",
          "[sqlite][restart][clock]") {
  keel_durable::temp_dir dir;
  const std::string db = dir.file("leases.db");
  manual_clock clock;
  keel::ownership holder;
  {
    auto store = keel_durable::open_sqlite(db, clock);
    auto c = store->claim("nightly", keel::owner_id::random(), 30s);
    REQUIRE(c->acquired);
    holder = c->ownership;
  }
  clock.advance(20s);
  clock.set(clock.now() - 2h);  // the machine restarts with its clock two hours behind
  auto store = keel_durable::open_sqlite(db, clock);
  auto other = store->claim("nightly", keel::owner_id::random(), 30s);
  REQUIRE(other.ok());
  CHECK_FALSE(other->acquired);
  CHECK(other->remaining == 30s);  // frozen at the mark: the claim time
  // A lease granted while the clock is behind is measured from the mark, so
  // it does not expire early when the clock is corrected.
  auto fresh = store->claim("weekly", keel::owner_id::random(), 30s);
  REQUIRE(fresh->acquired);
  clock.advance(2h + 5s);  // corrected: 25 s after the first claim
  // Measured from the behind clock it would have ended 1.5 h ago.
  auto weekly = store->claim("weekly", keel::owner_id::random(), 30s);
  CHECK_FALSE(weekly->acquired);
  CHECK_FALSE(store->claim("nightly", keel::owner_id::random(), 30s)->acquired);
  clock.advance(6s);  // 31 s after the first claim
  auto nightly = store->claim("nightly", keel::owner_id::random(), 30s);
  CHECK(nightly->acquired);
  CHECK(nightly->took_over);
  CHECK(nightly->ownership.fence == 2);
  CHECK(keel::is_lost_ownership(store->renew("nightly", holder, 30s)));
}

TEST_CASE("the file is in WAL mode, with synchronous NORMAL or FULL", "[sqlite]") {
  keel_durable::temp_dir dir;
  manual_clock clock;
  for (const keel::sqlite_sync sync : {keel::sqlite_sync::normal, keel::sqlite_sync::full}) {
    const std::string db = dir.file(sync == keel::sqlite_sync::full ? "full.db" : "normal.db");
    {
      auto store = keel_durable::open_sqlite(db, clock, {.synchronous = sync});
      auto c = store->begin(receipt_key, receipt("A"), keel::owner_id::random(), bo);
      REQUIRE(c.ok());
      REQUIRE(store->commit(receipt_key, c->ownership, keel::decision{.id = "d", .result = "r"}, 2h).ok());
      CHECK(std::filesystem::exists(db + "-wal"));
    }
    const std::string header = keel_durable::read_file(db).substr(0, 100);
    REQUIRE(header.size() == 100);
    CHECK(header.substr(0, 16) == std::string("SQLite format 3\0", 16));
    CHECK(header[18] == 2);  // file format write version 2: WAL
    CHECK(header[19] == 2);
    // application_id (offset 68) and user_version (offset 60), big-endian.
    CHECK(header.substr(68, 4) == "keel");
    CHECK(header.substr(60, 4) == std::string("\0\0\0\1", 4));
  }
}

TEST_CASE("another application's SQLite database is refused and left untouched", "[sqlite][errors]") {
  keel_durable::temp_dir dir;
  manual_clock clock;
  SECTION("an ordinary database") {
    const std::string db = dir.file("crm.db");
    raw_exec(db, "CREATE TABLE customers(id INTEGER PRIMARY KEY, name TEXT); INSERT INTO customers VALUES (1, 'Ada');");
    const std::string before = keel_durable::read_file(db);
    auto r = store_t::open(db, {}, clock);
    CHECK(r.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK(contains(r.status().message(), "another application's database"));
    CHECK(contains(r.status().message(), "customers"));
    CHECK(contains(r.status().message(), db));
    CHECK(keel_durable::read_file(db) == before);
    CHECK_FALSE(std::filesystem::exists(db + "-wal"));
  }
  SECTION("a database with another application id") {
    const std::string db = dir.file("other.db");
    raw_exec(db, "PRAGMA application_id = 42;");
    const std::string before = keel_durable::read_file(db);
    auto r = store_t::open(db, {}, clock);
    CHECK(r.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK(contains(r.status().message(), "application_id 42"));
    CHECK(keel_durable::read_file(db) == before);
  }
}

TEST_CASE("a file that is not a database, or a corrupted keel file: a clear error, no crash, untouched",
          "[sqlite][errors]") {
  keel_durable::temp_dir dir;
  manual_clock clock;
  SECTION("not a database") {
    const std::string db = dir.file("notes.txt");
    std::string garbage(8192, '\0');
    for (std::size_t i = 0; i < garbage.size(); ++i) garbage[i] = static_cast<char>((i * 7919) % 251);
    keel_durable::write_file(db, garbage);
    auto r = store_t::open(db, {}, clock);
    CHECK(r.status().code() == absl::StatusCode::kDataLoss);
    CHECK(contains(r.status().message(), "file is not a database"));
    CHECK(keel_durable::read_file(db) == garbage);
  }
  SECTION("a keel file whose table pages were overwritten") {
    const std::string db = dir.file("keel.db");
    {
      auto store = keel_durable::open_sqlite(db, clock);
      for (int i = 0; i < 50; ++i) {
        const std::string key = "key-" + std::to_string(i);
        auto c = store->begin({"t", "e", key}, receipt(key), keel::owner_id::random(), bo);
        REQUIRE(store->commit({"t", "e", key}, c->ownership, keel::decision{.id = "d", .result = std::string(500, 'r')}, 2h).ok());
      }
    }  // closed: checkpointed into the main file
    std::string bytes = keel_durable::read_file(db);
    REQUIRE(bytes.size() > 4 * 4096);
    for (std::size_t i = 4096; i < bytes.size(); ++i) bytes[i] = static_cast<char>(0xA5 ^ (i & 0xff));
    keel_durable::write_file(db, bytes);
    // The header and schema are intact: only the integrity check sees it.
    auto opened = store_t::open(db, {}, clock);
    CHECK(opened.status().code() == absl::StatusCode::kDataLoss);
    CHECK(contains(opened.status().message(), db));
    CHECK(keel_durable::read_file(db) == bytes);
  }
}

namespace {

// A keel file with 200 decisions, a lease and a result, closed (so
// checkpointed into the main file); returns its page size.
std::size_t write_store(const std::string& db, const manual_clock& clock) {
  auto store = keel_durable::open_sqlite(db, clock);
  for (int i = 0; i < 200; ++i) {
    const std::string key = "key-" + std::to_string(i);
    auto c = store->begin({"t", "e", key}, receipt(key), keel::owner_id::random(), bo);
    REQUIRE(c.ok());
    REQUIRE(store->commit({"t", "e", key}, c->ownership, keel::decision{.id = "d", .result = std::string(300, 'r')}, 2h)
                .ok());
  }
  REQUIRE(store->claim("nightly", keel::owner_id::random(), 30s).ok());
  REQUIRE(store->save_result("panel", "v", 1h).ok());
  const std::string header = keel_durable::read_file(db).substr(0, 100);
  const std::size_t page = (static_cast<unsigned char>(header[16]) << 8) | static_cast<unsigned char>(header[17]);
  return page == 1 ? 65536 : page;
}

// Overwrites the page in the middle of the file with garbage, in place.
void damage_middle_page(const std::string& db, std::size_t page) {
  const std::size_t pages = std::filesystem::file_size(db) / page;
  REQUIRE(pages >= 8);
  std::string garbage(page, '\0');
  for (std::size_t i = 0; i < garbage.size(); ++i) garbage[i] = static_cast<char>((i * 7919 + 13) % 251);
  const int fd = ::open(db.c_str(), O_WRONLY);
  REQUIRE(fd >= 0);
  const auto at = static_cast<off_t>(pages / 2 * page);
  const ssize_t n = ::pwrite(fd, garbage.data(), garbage.size(), at);
  ::close(fd);
  REQUIRE(n == static_cast<ssize_t>(garbage.size()));
}

}  // namespace

TEST_CASE("a store file with a damaged page is refused when it opens, naming the file, and left byte for byte",
          "[sqlite][errors][integrity]") {
  keel_durable::temp_dir dir;
  manual_clock clock;
  const std::string db = dir.file("keel.db");
  damage_middle_page(db, write_store(db, clock));
  const std::string before = keel_durable::read_file(db);
  bool wrote = false;  // only the check-off section writes (and then may change the file)
  SECTION("quick_check, the default") {
    auto r = store_t::open(db, {}, clock);
    INFO(r.status().ToString());
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == absl::StatusCode::kDataLoss);
    CHECK(contains(r.status().message(), absl::StrCat("sqlite store '", db, "' is damaged: PRAGMA quick_check found: ")));
    CHECK(contains(r.status().message(), "refuses to open it and has not changed it"));
    // Permanent: nothing retries an open of a damaged file.
    CHECK(keel::default_classifier{}(r.status(), {.effect = keel::effect::read}) == keel::outcome_kind::permanent);
    CHECK(keel::default_classifier{}(r.status(), {.effect = keel::effect::write}) == keel::outcome_kind::permanent);
  }
  SECTION("integrity_check, when asked for") {
    auto r = store_t::open(db, {.integrity_check = keel::sqlite_integrity_check::full}, clock);
    INFO(r.status().ToString());
    CHECK(r.status().code() == absl::StatusCode::kDataLoss);
    CHECK(contains(r.status().message(), "PRAGMA integrity_check found: "));
  }
  SECTION("opening again: refused again, never recreated") {
    CHECK(store_t::open(db, {}, clock).status().code() == absl::StatusCode::kDataLoss);
    CHECK(store_t::open(db, {.create = false}, clock).status().code() == absl::StatusCode::kDataLoss);
  }
  SECTION("the check off: it opens, and the damage shows at the first read of that page") {
    auto r = store_t::open(db, {.integrity_check = keel::sqlite_integrity_check::off}, clock);
    REQUIRE(r.ok());
    bool any_data_loss = false;
    for (int i = 0; i < 200 && !any_data_loss; ++i) {
      const std::string key = "key-" + std::to_string(i);
      auto b = (*r)->begin({"t", "e", key}, receipt(key), keel::owner_id::random(), bo);
      any_data_loss = b.status().code() == absl::StatusCode::kDataLoss;
    }
    CHECK(any_data_loss);
    wrote = true;
  }
  if (!wrote) CHECK(keel_durable::read_file(db) == before);
}

TEST_CASE("the integrity check has a time limit: past it the file is refused unverified, and left untouched",
          "[sqlite][errors][integrity]") {
  keel_durable::temp_dir dir;
  manual_clock clock;
  const std::string db = dir.file("keel.db");
  (void)write_store(db, clock);
  const std::string before = keel_durable::read_file(db);
  auto r = store_t::open(db, {.integrity_check_timeout = 1ns}, clock);
  INFO(r.status().ToString());
  CHECK(r.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(contains(r.status().message(), db));
  CHECK(contains(r.status().message(), "PRAGMA quick_check did not finish within 1ns"));
  CHECK(keel_durable::read_file(db) == before);
  // A healthy file passes the default check.
  CHECK(store_t::open(db, {}, clock).ok());
  CHECK(store_t::open(db, {.integrity_check = keel::sqlite_integrity_check::full}, clock).ok());
}

TEST_CASE("a keel file of another schema version, or with a damaged schema, is refused untouched",
          "[sqlite][errors]") {
  keel_durable::temp_dir dir;
  manual_clock clock;
  const std::string db = dir.file("keel.db");
  { REQUIRE(store_t::open(db, {}, clock).ok()); }
  SECTION("a newer schema version") {
    raw_exec(db, "PRAGMA user_version = 7;");
    const std::string before = keel_durable::read_file(db);
    auto r = store_t::open(db, {}, clock);
    CHECK(r.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK(contains(r.status().message(), "keel schema version 7; this keel reads version 1 only"));
    CHECK(keel_durable::read_file(db) == before);
  }
  SECTION("a missing table") {
    raw_exec(db, "DROP TABLE keel_lease;");
    const std::string before = keel_durable::read_file(db);
    auto r = store_t::open(db, {}, clock);
    CHECK(r.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK(contains(r.status().message(), "damaged schema: table keel_lease is missing"));
    CHECK(keel_durable::read_file(db) == before);
  }
}

TEST_CASE("a missing file with create off, or a missing directory: NotFound", "[sqlite][errors]") {
  keel_durable::temp_dir dir;
  manual_clock clock;
  auto off = store_t::open(dir.file("absent.db"), {.create = false}, clock);
  CHECK(off.status().code() == absl::StatusCode::kNotFound);
  CHECK_FALSE(std::filesystem::exists(dir.file("absent.db")));
  auto nodir = store_t::open(dir.file("no/such/dir/keel.db"), {}, clock);
  CHECK(nodir.status().code() == absl::StatusCode::kNotFound);
  CHECK(contains(nodir.status().message(), "cannot open or create"));
}

TEST_CASE("a busy file: Unavailable and not started, nothing applied", "[sqlite][errors]") {
  keel_durable::temp_dir dir;
  manual_clock clock;
  const std::string db = dir.file("busy.db");
  auto store = keel_durable::open_sqlite(db, clock, {.busy_timeout = 0ms});
  sqlite3* other = nullptr;
  REQUIRE(sqlite3_open(db.c_str(), &other) == SQLITE_OK);
  REQUIRE(sqlite3_exec(other, "BEGIN IMMEDIATE", nullptr, nullptr, nullptr) == SQLITE_OK);
  auto b = store->begin(receipt_key, receipt("A"), keel::owner_id::random(), bo);
  CHECK(b.status().code() == absl::StatusCode::kUnavailable);
  CHECK(keel::not_started(b.status()));
  auto l = store->claim("nightly", keel::owner_id::random(), 30s);
  CHECK(l.status().code() == absl::StatusCode::kUnavailable);
  auto s = store->save_result("panel", "v", 0s);
  CHECK(s.status().code() == absl::StatusCode::kUnavailable);
  REQUIRE(sqlite3_exec(other, "COMMIT", nullptr, nullptr, nullptr) == SQLITE_OK);
  sqlite3_close(other);
  auto again = store->begin(receipt_key, receipt("A"), keel::owner_id::random(), bo);
  REQUIRE(again.ok());
  CHECK(again->state == keel::begin_state::claimed);  // the refused begin left nothing behind
  CHECK(again->ownership.fence == 1);
}

TEST_CASE("an I/O error at COMMIT is an unknown outcome; repeating the commit settles it", "[sqlite][errors]") {
  install_faulty_vfs();
  keel_durable::temp_dir dir;
  manual_clock clock;
  auto store = keel_durable::open_sqlite(dir.file("faulty.db"), clock, {.vfs = "keel-faulty"});
  auto c = store->begin(receipt_key, receipt("A"), keel::owner_id::random(), bo);
  REQUIRE(c.ok());
  const keel::decision d{.id = "dec-1", .result = "approve"};
  fail_wal_writes = true;
  const absl::Status s = store->commit(receipt_key, c->ownership, d, 2h);
  fail_wal_writes = false;
  CHECK(failed_writes > 0);
  CHECK(keel::is_unknown_outcome(s));
  CHECK(s.code() == absl::StatusCode::kUnknown);
  CHECK(keel::default_classifier{}(s, {.effect = keel::effect::write}) == keel::outcome_kind::ambiguous);
  CHECK(contains(s.message(), "COMMIT"));
  // The owner repeats the commit (fenced, idempotent): it lands exactly once.
  REQUIRE(store->commit(receipt_key, c->ownership, d, 2h).ok());
  REQUIRE(store->commit(receipt_key, c->ownership, d, 2h).ok());
  auto r = store->begin(receipt_key, receipt("A"), keel::owner_id::random(), bo);
  REQUIRE(r.ok());
  CHECK(r->state == keel::begin_state::replay);
  CHECK(r->decision.id == "dec-1");

  // Through keel::once the unknown outcome reaches the caller as such.
  keel::once decide(*store, {.lease = 30s, .retention = 2h, .retry_window = 1h}, keel::environment{clock});
  keel::call call(clock.now(), {.timeout = 3s});
  const keel::request_identity other{.tenant = "merchant-82", .endpoint = "receipts", .key = "key-48"};
  auto once_r = decide.run(call, other, receipt("B"), [&](const keel::claim_context&) -> absl::StatusOr<keel::decision> {
    fail_wal_writes = true;  // the model answered; the store fails while recording it
    return keel::decision{.result = "approve"};
  });
  fail_wal_writes = false;
  CHECK(keel::is_unknown_outcome(once_r.status()));
}

TEST_CASE("N threads, each on its own connection, send one key: one provider execution, one decision id",
          "[sqlite][threads]") {
  keel_durable::temp_dir dir;
  const std::string db = dir.file("receipts.db");
  const std::string executions = dir.file("executions");
  { REQUIRE(keel::sqlite_store<>::open(db).ok()); }
  constexpr int n = 8;
  std::vector<std::unique_ptr<keel::sqlite_store<>>> stores;
  for (int i = 0; i < n; ++i) stores.push_back(keel_durable::open_sqlite(db, keel::system_time{}));
  std::vector<absl::StatusOr<keel::once_result>> got(n, absl::UnknownError("not run"));
  std::latch start(n);
  {
    std::vector<std::jthread> threads;
    for (int i = 0; i < n; ++i)
      threads.emplace_back([&, i] {
        keel::once decide(*stores[i], {.lease = 60s, .retention = 2h, .retry_window = 1h,
                                       .poll_initial = 1ms, .poll_max = 20ms});
        keel::call call(keel::real_clock{}.now(), {.timeout = 60s});
        start.arrive_and_wait();
        got[i] = decide.run(call, receipt_key, receipt("A"), [&](const keel::claim_context&) -> absl::StatusOr<keel::decision> {
          const int fd = ::open(executions.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
          (void)!::write(fd, "x\n", 2);
          ::close(fd);
          std::this_thread::sleep_for(100ms);
          return keel::decision{.result = "approve"};
        });
      });
  }
  CHECK(keel_durable::read_file(executions) == "x\n");
  std::set<std::string> ids;
  int fresh = 0;
  for (const auto& g : got) {
    REQUIRE(g.ok());
    ids.insert(g->decision.id);
    if (!g->replayed) ++fresh;
  }
  CHECK(ids.size() == 1);
  CHECK(fresh == 1);
}

TEST_CASE("purge_expired removes expired records, results and free leases only", "[sqlite]") {
  keel_durable::temp_dir dir;
  manual_clock clock;
  auto store = keel_durable::open_sqlite(dir.file("purge.db"), clock);
  auto live = store->begin({"t", "e", "live"}, receipt("A"), keel::owner_id::random(), {.lease = 30s, .retention = 10h});
  auto old = store->begin({"t", "e", "old"}, receipt("A"), keel::owner_id::random(), {.lease = 30s, .retention = 1h});
  REQUIRE(live.ok());
  REQUIRE(old.ok());
  REQUIRE(*store->save_result("short", "v", 1h));
  REQUIRE(*store->save_result("forever", "v", 0s));
  auto held = store->claim("held", keel::owner_id::random(), 10h);
  auto freed = store->claim("freed", keel::owner_id::random(), 10h);
  REQUIRE(store->release("freed", freed->ownership).ok());
  clock.advance(2h);
  auto n = store->purge_expired();
  REQUIRE(n.ok());
  CHECK(*n == 3);  // the old record, the short result, the free lease
  auto still = store->begin({"t", "e", "live"}, receipt("other contents"), keel::owner_id::random(), bo);
  CHECK(still->state == keel::begin_state::conflict);  // the live record is still there
  CHECK(store->load_result("forever")->has_value());
  CHECK_FALSE(store->claim("held", keel::owner_id::random(), 10h)->acquired);
}

// Found by the sqlite_records fuzz target (tests/fuzz/corpus/sqlite_records/
// regression_*): rows the store did not write were trusted as read. A
// negative fence gave a claim fence 0 or below, a fence of 2^63 - 1
// overflowed on the next claim (undefined behaviour), and a committed row
// with a status code absl does not have or an empty decision id was
// replayed as a decision. Each is now DataLoss naming the row and the
// column, and the row is left as it is.
TEST_CASE("a damaged or foreign row is DataLoss naming it, never trusted, and left as it is", "[sqlite][errors][fuzz]") {
  keel_durable::temp_dir dir;
  const std::string db = dir.file("damaged.db");
  manual_clock clock;
  auto store = keel_durable::open_sqlite(db, clock);
  const keel::owner_id me = keel::owner_id::random();
  // A committed decision to damage, column by column.
  auto b = store->begin(receipt_key, receipt("A"), me, bo);
  REQUIRE(b.ok());
  REQUIRE(store->commit(receipt_key, b->ownership, {.id = "d-1", .result = "approve"}, 2h).ok());
  REQUIRE(store->begin(receipt_key, receipt("A"), me, bo)->state == keel::begin_state::replay);

  struct damage {
    const char* sql;
    const char* says;
  };
  const damage cases[] = {
      {"UPDATE keel_idempotency SET fence = -5", "fence -5 is outside"},
      {"UPDATE keel_idempotency SET fence = 9223372036854775807", "fence 9223372036854775807 is outside"},
      {"UPDATE keel_idempotency SET error_code = 99", "error code 99 is not a status code"},
      {"UPDATE keel_idempotency SET decision_id = X''", "decision id must not be empty"},
      {"UPDATE keel_idempotency SET state = 7", "state 7 is not 0, 1 or 2"},
      {"UPDATE keel_idempotency SET owner = X'01'", "owner is 1 bytes, not 16"},
      {"UPDATE keel_idempotency SET request = X'00'", "request digest is 1 bytes, not 32"},
      {"UPDATE keel_idempotency SET record_expires = 'soon'", "record_expires is not an integer"},
  };
  for (const damage& d : cases) {
    DYNAMIC_SECTION(d.sql) {
      raw_exec(db, d.sql);
      for (int i = 0; i < 2; ++i) {  // the same answer again: the row was left alone
        const auto again = store->begin(receipt_key, receipt("A"), me, bo);
        REQUIRE(again.status().code() == absl::StatusCode::kDataLoss);
        CHECK(contains(again.status().message(), "the record for key 'key-47'"));
        CHECK(contains(again.status().message(), d.says));
        CHECK(keel::marked_outcome(again.status()) == keel::outcome_kind::permanent);
      }
      // Waiting out the retention does not make the store overwrite it either.
      clock.advance(3h);
      CHECK(store->begin(receipt_key, receipt("A"), me, bo).status().code() == absl::StatusCode::kDataLoss);
    }
  }

  SECTION("a lease with a negative fence, and a purged-fence floor at the top") {
    auto l = store->claim("nightly", me, 30s);
    REQUIRE(l.ok());
    raw_exec(db, "UPDATE keel_lease SET fence = -1 WHERE work_key = 'nightly' OR work_key = X'6e696768746c79'");
    const auto c = store->claim("nightly", keel::owner_id::random(), 30s);
    REQUIRE(c.status().code() == absl::StatusCode::kDataLoss);
    CHECK(contains(c.status().message(), "the lease of work key 'nightly'"));
    CHECK(store->release("nightly", l->ownership).code() == absl::StatusCode::kDataLoss);

    raw_exec(db, "INSERT INTO keel_lease VALUES (X'00', X'', 9223372036854775807, 9223372036854775807, 0)");
    const auto fresh = store->claim("never-seen", me, 30s);
    REQUIRE(fresh.status().code() == absl::StatusCode::kDataLoss);
    CHECK(contains(fresh.status().message(), "the highest purged fence"));
  }
}
