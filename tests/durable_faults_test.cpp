// SQLite out of space: a database limited by sqlite_options.max_size_bytes
// fills up. The caller hears Unavailable, not started (nothing was written,
// so a retry is safe and a write is not ambiguous); everything committed
// before stays readable; the file is neither truncated nor recreated, and a
// larger limit lets it grow again. (The corrupted-file cases are in
// durable_sqlite_test.cpp.)
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>

#include "keel/core/outcome.hpp"
#include "keel/durable/digest.hpp"
#include "keel/store/sqlite.hpp"
#include "keel/testing/manual_clock.hpp"
#include "support/catch.hpp"
#include "support/durable.hpp"

using namespace std::chrono_literals;
using keel::testing::manual_clock;
using store_t = keel::sqlite_store<manual_clock>;

namespace {

keel::digest digest_of(const std::string& s) { return keel::digest_builder().field("request", s).finish(); }
const keel::begin_options bo{.lease = 30s, .retention = 2h};

bool contains(absl::string_view s, absl::string_view part) { return s.find(part) != absl::string_view::npos; }

}  // namespace

TEST_CASE("sqlite max_size_bytes is validated, naming the field and the rule", "[sqlite][faults]") {
  CHECK(keel::sqlite_options{.max_size_bytes = 0}.validate().ok());
  CHECK(keel::sqlite_options{.max_size_bytes = 65536}.validate().ok());
  CHECK(std::string(keel::sqlite_options{.max_size_bytes = 4096}.validate().message()) ==
        "sqlite_options.max_size_bytes must be 0 (no limit) or at least 65536 (got 4096)");
  CHECK(std::string(keel::sqlite_options{.max_size_bytes = -1}.validate().message()) ==
        "sqlite_options.max_size_bytes must be 0 (no limit) or at least 65536 (got -1)");
}

TEST_CASE("sqlite out of space: Unavailable and not started, nothing committed lost, the file kept",
          "[sqlite][faults]") {
  manual_clock clock;
  keel_durable::temp_dir dir;
  const std::string db = dir.file("full.db");
  constexpr std::int64_t limit = 256 * 1024;
  const keel::sqlite_options o{.max_size_bytes = limit};
  std::vector<std::string> saved;
  absl::Status full;
  {
    auto store = keel_durable::open_sqlite(db, clock, o);
    auto c = store->begin({"t", "e", "kept"}, digest_of("kept"), keel::owner_id::random(), bo);
    REQUIRE(c.ok());
    REQUIRE(store->commit({"t", "e", "kept"}, c->ownership, keel::decision{.id = "dec-kept", .result = "yes"}, 2h).ok());
    // Fill it: 4 KiB results until the limit refuses one.
    for (int i = 0; i < 1000; ++i) {
      const std::string key = "r-" + std::to_string(i);
      absl::StatusOr<bool> r = store->save_result(key, std::string(4096, static_cast<char>('a' + i % 26)), 2h);
      if (!r.ok()) {
        full = r.status();
        break;
      }
      REQUIRE(*r);
      saved.push_back(key);
    }
    INFO(full.ToString());
    REQUIRE_FALSE(full.ok());
    CHECK(saved.size() > 10);
    CHECK(full.code() == absl::StatusCode::kUnavailable);
    CHECK(keel::not_started(full));
    CHECK(contains(full.message(), "max_size_bytes = 262144"));
    CHECK(contains(full.message(), db));
    CHECK(keel::default_classifier{}(full, {.effect = keel::effect::write}) == keel::outcome_kind::transient);
    CHECK_FALSE(keel::is_unknown_outcome(full));

    // A claim and a commit refused the same way once the file is full.
    auto claim = store->begin({"t", "e", "new"}, digest_of("new"), keel::owner_id::random(),
                              {.lease = 30s, .retention = 2h});
    if (!claim.ok()) {
      CHECK(claim.status().code() == absl::StatusCode::kUnavailable);
      CHECK(keel::not_started(claim.status()));
    }
    // What was committed is all there, in the same session.
    for (const std::string& key : saved) REQUIRE(store->load_result(key).value_or(std::nullopt).has_value());
    auto replay = store->begin({"t", "e", "kept"}, digest_of("kept"), keel::owner_id::random(), bo);
    REQUIRE(replay.ok());
    CHECK(replay->state == keel::begin_state::replay);
  }
  // Reopened with the same limit: the same file, everything in it; still full.
  CHECK(std::filesystem::file_size(db) <= static_cast<std::uintmax_t>(limit));
  {
    auto store = keel_durable::open_sqlite(db, clock, o);
    for (const std::string& key : saved) {
      auto r = store->load_result(key);
      REQUIRE(r.ok());
      REQUIRE(r->has_value());
      CHECK(r->value().size() == 4096);
    }
    auto replay = store->begin({"t", "e", "kept"}, digest_of("kept"), keel::owner_id::random(), bo);
    REQUIRE(replay.ok());
    CHECK(replay->state == keel::begin_state::replay);
    CHECK(replay->decision.id == "dec-kept");
    const absl::StatusOr<bool> more = store->save_result("more", std::string(4096, 'z'), 2h);
    CHECK(more.status().code() == absl::StatusCode::kUnavailable);
  }
  // A larger limit: it grows again, and nothing was lost.
  {
    auto store = keel_durable::open_sqlite(db, clock, keel::sqlite_options{.max_size_bytes = 4 * limit});
    CHECK(store->save_result("more", std::string(4096, 'z'), 2h).value_or(false));
    CHECK(store->load_result(saved.front()).value_or(std::nullopt).has_value());
    CHECK(store->load_result(saved.back()).value_or(std::nullopt).has_value());
  }
}

// ---- a damaged write-ahead log ----------------------------------------------

namespace {

// A store whose last decisions are still in its write-ahead log: the files
// copied while the store has them open (as a crash leaves them), since a
// clean close checkpoints the log into the database and removes it.
struct wal_snapshot {
  std::string db;
  std::string wal;
  std::size_t page = 0;
};

wal_snapshot snapshot_with_wal(keel_durable::temp_dir& dir, const manual_clock& clock, const std::string& name) {
  const std::string live = dir.file("live-" + name + ".db");
  wal_snapshot out{.db = dir.file(name + ".db"), .wal = dir.file(name + ".db") + "-wal"};
  auto store = keel_durable::open_sqlite(live, clock);
  for (int i = 0; i < 12; ++i) {
    const std::string key = "key-" + std::to_string(i);
    auto c = store->begin({"t", "e", key}, digest_of(key), keel::owner_id::random(), bo);
    REQUIRE(c.ok());
    REQUIRE(store->commit({"t", "e", key}, c->ownership,
                          keel::decision{.id = "dec-" + std::to_string(i), .result = std::string(200, 'r')}, 2h)
                .ok());
  }
  std::filesystem::copy_file(live, out.db);
  std::filesystem::copy_file(live + "-wal", out.wal);
  const std::string header = keel_durable::read_file(out.wal).substr(0, 32);
  out.page = (static_cast<std::size_t>(static_cast<unsigned char>(header[8])) << 24) |
             (static_cast<std::size_t>(static_cast<unsigned char>(header[9])) << 16) |
             (static_cast<std::size_t>(static_cast<unsigned char>(header[10])) << 8) |
             static_cast<std::size_t>(static_cast<unsigned char>(header[11]));
  return out;
}

void overwrite(const std::string& path, std::size_t at, const std::string& bytes) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  REQUIRE(f);
  f.seekp(static_cast<std::streamoff>(at));
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(f);
}

}  // namespace

TEST_CASE("sqlite: a write-ahead log holding committed decisions is replayed when the store opens", "[sqlite][faults]") {
  manual_clock clock;
  keel_durable::temp_dir dir;
  const wal_snapshot snap = snapshot_with_wal(dir, clock, "intact");
  REQUIRE(std::filesystem::file_size(snap.wal) > 32 + 4 * (24 + snap.page));
  auto store = keel_durable::open_sqlite(snap.db, clock);
  for (int i = 0; i < 12; ++i) {
    const std::string key = "key-" + std::to_string(i);
    auto r = store->begin({"t", "e", key}, digest_of(key), keel::owner_id::random(), bo);
    REQUIRE(r.ok());
    CHECK(r->state == keel::begin_state::replay);
    CHECK(r->decision.id == "dec-" + std::to_string(i));
  }
}

TEST_CASE("sqlite: a damaged write-ahead log is refused (DataLoss, naming it) and neither file is changed",
          "[sqlite][faults]") {
  manual_clock clock;
  keel_durable::temp_dir dir;
  SECTION("a damaged frame in the middle of the log") {
    const wal_snapshot snap = snapshot_with_wal(dir, clock, "frame");
    const std::size_t frame = 24 + snap.page;
    // The page data of the log's second frame.
    overwrite(snap.wal, 32 + frame + 24 + 100, std::string(64, '\x5a'));
    const std::string db_before = keel_durable::read_file(snap.db), wal_before = keel_durable::read_file(snap.wal);
    auto r = store_t::open(snap.db, {}, clock);
    REQUIRE_FALSE(r.ok());
    INFO(r.status().ToString());
    CHECK(r.status().code() == absl::StatusCode::kDataLoss);
    CHECK(contains(r.status().message(), "damaged write-ahead log '" + snap.wal + "'"));
    CHECK(contains(r.status().message(), "frame 2 of"));
    CHECK(keel::default_classifier{}(r.status(), {}) == keel::outcome_kind::permanent);
    CHECK(keel_durable::read_file(snap.db) == db_before);
    CHECK(keel_durable::read_file(snap.wal) == wal_before);
    CHECK_FALSE(std::filesystem::exists(snap.db + "-shm"));  // SQLite never saw it
  }
  SECTION("why: with the check off, SQLite's recovery opens it and drops the committed decisions after the damage") {
    const wal_snapshot snap = snapshot_with_wal(dir, clock, "unchecked");
    overwrite(snap.wal, 32 + (24 + snap.page) + 24 + 100, std::string(64, '\x5a'));
    auto r = store_t::open(snap.db, {.integrity_check = keel::sqlite_integrity_check::off}, clock);
    REQUIRE(r.ok());
    int lost = 0;
    for (int i = 0; i < 12; ++i) {
      const std::string key = "key-" + std::to_string(i);
      auto b = (*r)->begin({"t", "e", key}, digest_of(key), keel::owner_id::random(), bo);
      REQUIRE(b.ok());
      if (b->state != keel::begin_state::replay) ++lost;
    }
    CHECK(lost > 0);
  }
  SECTION("a damaged log header") {
    const wal_snapshot snap = snapshot_with_wal(dir, clock, "header");
    overwrite(snap.wal, 16, "\x01\x02\x03\x04");  // salt-1
    const std::string wal_before = keel_durable::read_file(snap.wal);
    auto r = store_t::open(snap.db, {}, clock);
    REQUIRE_FALSE(r.ok());
    INFO(r.status().ToString());
    CHECK(r.status().code() == absl::StatusCode::kDataLoss);
    CHECK(contains(r.status().message(), "header fails its checksum"));
    CHECK(keel_durable::read_file(snap.wal) == wal_before);
  }
  SECTION("a torn last frame (a crash mid-append): opens, without the unfinished last transaction") {
    const wal_snapshot snap = snapshot_with_wal(dir, clock, "torn");
    const std::size_t size = std::filesystem::file_size(snap.wal);
    std::filesystem::resize_file(snap.wal, size - 100);
    auto r = store_t::open(snap.db, {}, clock);
    INFO(r.status().ToString());
    REQUIRE(r.ok());
    // The first decisions, in frames before the torn one, are there.
    auto first = (*r)->begin({"t", "e", "key-0"}, digest_of("key-0"), keel::owner_id::random(), bo);
    REQUIRE(first.ok());
    CHECK(first->state == keel::begin_state::replay);
  }
}
