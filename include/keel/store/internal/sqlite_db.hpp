// keel/store/internal/sqlite_db.hpp — the SQLite connection keel's SQLite stores
// share: opening and checking a keel file, the versioned base schema, the
// store clock with its persisted high-water mark, and one BEGIN IMMEDIATE
// transaction per operation. keel::sqlite_store (keel/store/sqlite.hpp) and
// keel::sqlite_job_store (keel/store/sqlite_jobs.hpp) are built on it, so
// both can use one file and one store clock.
//
// sqlite_db<Time>::transact(op, body) runs body(times) inside BEGIN
// IMMEDIATE ... COMMIT: the write lock is taken before anything is read, so
// no other connection (thread or process) can interleave. `times.check`
// decides what has expired and `times.grant` is the base of new expiries
// (docs/stores.md, "Time"). The body returns an absl::StatusOr<T>; an error
// rolls the transaction back. A failure at COMMIT with an I/O error is an
// unknown outcome; any other failure is "not started".
//
// Thread-safety: none. The owning store serialises use with its own mutex.
#pragma once

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sqlite3.h>
#include <unistd.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "keel/core/clock.hpp"
#include "keel/core/status.hpp"
#include "keel/durable/ownership.hpp"

namespace keel {

enum class sqlite_sync { normal, full };

// What opening an existing keel file checks before keel uses it.
//   quick  PRAGMA quick_check: every page and b-tree is read and checked
//          (time linear in the file's size; not index contents)
//   full   PRAGMA integrity_check: quick, plus that indexes match their tables
//   off    nothing: damage shows up at the first read of a damaged page
enum class sqlite_integrity_check { quick, full, off };

struct sqlite_options {
  // PRAGMA synchronous: normal (fsync at checkpoints) or full (at every commit).
  sqlite_sync synchronous = sqlite_sync::normal;
  // How long an operation waits for another writer; in [0, 24h].
  duration busy_timeout = std::chrono::seconds(5);
  // Create the file (and the schema in an empty file). Off: a missing file is NotFound.
  bool create = true;
  // A registered SQLite VFS to open the file with; empty: the default. (Tests
  // use a fault-injecting VFS to make commits fail.)
  std::string vfs{};
  // The check run when an existing file is opened. A damaged file is refused
  // (DataLoss, naming the file and what the check found) and never written.
  // Unless off, the write-ahead log left beside it (by a crash, or by a
  // process that has it open) is read first, the way SQLite's recovery
  // reads it: a damaged header, or a damaged frame with frames of the same
  // log after it, is refused the same way (recovery would silently drop
  // committed transactions there). A bad last frame is a torn write, which
  // SQLite discards with the unfinished transaction it belonged to.
  sqlite_integrity_check integrity_check = sqlite_integrity_check::quick;
  // The check's time limit, in (0, 24h]. A check that runs longer refuses the
  // file unverified (DeadlineExceeded): raise it, or turn the check off, for a
  // file that big (quick_check reads on the order of 1 GB/s).
  duration integrity_check_timeout = std::chrono::seconds(30);
  // The most the database file may grow to, in bytes (PRAGMA max_page_count,
  // rounded down to whole pages); 0: no limit but the disk's. An operation
  // that would grow it further is refused (Unavailable, not started:
  // nothing was written) and the file keeps what was committed. A file
  // already larger is not shrunk; it just stops growing. 0 or >= 64 KiB.
  std::int64_t max_size_bytes = 0;

  [[nodiscard]] absl::Status validate() const {
    if (max_size_bytes != 0 && max_size_bytes < 65536)
      return detail::invalid_field("sqlite_options", "max_size_bytes", "be 0 (no limit) or at least 65536",
                                   max_size_bytes);
    if (busy_timeout < duration::zero() || busy_timeout > std::chrono::hours(24))
      return detail::invalid_field("sqlite_options", "busy_timeout", "be in [0, 24h]", busy_timeout);
    if (integrity_check != sqlite_integrity_check::quick && integrity_check != sqlite_integrity_check::full &&
        integrity_check != sqlite_integrity_check::off)
      return detail::invalid_field("sqlite_options", "integrity_check", "be quick, full or off",
                                   static_cast<int>(integrity_check));
    if (integrity_check_timeout <= duration::zero() || integrity_check_timeout > std::chrono::hours(24))
      return detail::invalid_field("sqlite_options", "integrity_check_timeout", "be in (0, 24h]",
                                   integrity_check_timeout);
    return absl::OkStatus();
  }
};

// The schema version this keel reads and writes.
inline constexpr int sqlite_schema_version = 1;
// PRAGMA application_id of a keel store: "keel" in ASCII.
inline constexpr std::int32_t sqlite_application_id = 0x6B65656C;

namespace detail {

// The high-water mark is written when the clock has moved this far past it
// (so: not on every transaction; see docs/stores.md, "Time").
inline constexpr std::int64_t sqlite_mark_granularity_ns = 10'000'000;

[[nodiscard]] inline absl::StatusCode sqlite_code(int rc) noexcept {
  switch (rc & 0xff) {
    case SQLITE_BUSY:
    case SQLITE_LOCKED:
    case SQLITE_PROTOCOL:
      return absl::StatusCode::kUnavailable;
    case SQLITE_CORRUPT:
    case SQLITE_NOTADB:
      return absl::StatusCode::kDataLoss;
    case SQLITE_READONLY:
    case SQLITE_PERM:
    case SQLITE_AUTH:
      return absl::StatusCode::kPermissionDenied;
    case SQLITE_FULL:  // the size limit or the disk: the transaction was rolled back
      return absl::StatusCode::kUnavailable;
    case SQLITE_NOMEM:
      return absl::StatusCode::kResourceExhausted;
    case SQLITE_CANTOPEN:
      return absl::StatusCode::kUnavailable;
    case SQLITE_SCHEMA:
    case SQLITE_CONSTRAINT:
    case SQLITE_MISMATCH:
      return absl::StatusCode::kFailedPrecondition;
    default:
      return absl::StatusCode::kInternal;
  }
}

// One prepared statement, reset (and unbound) when a use ends.
class sqlite_stmt {
 public:
  sqlite_stmt() = default;
  ~sqlite_stmt() { sqlite3_finalize(s_); }
  sqlite_stmt(const sqlite_stmt&) = delete;
  sqlite_stmt& operator=(const sqlite_stmt&) = delete;

  int prepare(sqlite3* db, std::string_view sql) {
    return sqlite3_prepare_v3(db, sql.data(), static_cast<int>(sql.size()), SQLITE_PREPARE_PERSISTENT, &s_, nullptr);
  }
  [[nodiscard]] sqlite3_stmt* get() const noexcept { return s_; }

  // A use of the statement: binds, steps, reads columns; resets at the end.
  class use {
   public:
    explicit use(sqlite_stmt& s) noexcept : s_(s.s_) {}
    ~use() {
      sqlite3_reset(s_);
      sqlite3_clear_bindings(s_);
    }
    use(const use&) = delete;
    use& operator=(const use&) = delete;

    use& bind(int i, std::string_view bytes) {
      // A non-null pointer: a zero-length blob, not NULL.
      rc_ = keep(sqlite3_bind_blob(s_, i, bytes.empty() ? "" : bytes.data(), static_cast<int>(bytes.size()),
                                   SQLITE_STATIC));
      return *this;
    }
    use& bind(int i, std::int64_t v) {
      rc_ = keep(sqlite3_bind_int64(s_, i, v));
      return *this;
    }
    use& bind_null(int i) {
      rc_ = keep(sqlite3_bind_null(s_, i));
      return *this;
    }
    // SQLITE_ROW, SQLITE_DONE or an error code.
    int step() {
      if (rc_ != SQLITE_OK) return rc_;
      return sqlite3_step(s_);
    }
    [[nodiscard]] std::int64_t i64(int col) const { return sqlite3_column_int64(s_, col); }
    [[nodiscard]] bool is_null(int col) const { return sqlite3_column_type(s_, col) == SQLITE_NULL; }
    // SQLITE_INTEGER, SQLITE_FLOAT, SQLITE_TEXT, SQLITE_BLOB or SQLITE_NULL.
    [[nodiscard]] int type(int col) const { return sqlite3_column_type(s_, col); }
    [[nodiscard]] std::string_view bytes(int col) const {
      const void* p = sqlite3_column_blob(s_, col);
      const int n = sqlite3_column_bytes(s_, col);
      return p == nullptr ? std::string_view() : std::string_view(static_cast<const char*>(p), n);
    }

   private:
    int keep(int rc) const noexcept { return rc_ != SQLITE_OK ? rc_ : rc; }
    sqlite3_stmt* s_;
    int rc_ = SQLITE_OK;
  };

 private:
  sqlite3_stmt* s_ = nullptr;
};

struct sqlite_closer {
  void operator()(sqlite3* db) const noexcept { sqlite3_close_v2(db); }
};

}  // namespace detail

}  // namespace keel

namespace keel::detail {

// What a look at a WAL file found (see wal_damage below).
struct wal_scan {
  bool damaged = false;
  std::string what;  // why, when damaged
};

// Reads the write-ahead log `wal` (the -wal file beside a database) the way
// SQLite's recovery does, to find damage that recovery would hide. SQLite
// replays frames up to the first one whose salts or checksum fail and
// silently drops everything from there on: a damaged frame in the middle,
// or a damaged header, would lose transactions that were reported
// committed, and the next write would overwrite them for good. So:
//   - a header with a wrong magic, version, page size or checksum, on a
//     file that holds frames, is damage;
//   - a frame that fails its checksum followed by a frame of the same log
//     generation (the header's salts) is damage: a torn write (a crash
//     mid-append) only ever leaves the log's last frames bad.
// A bad last frame is indistinguishable from a torn write and is left to
// SQLite (it drops that last, unfinished transaction). Read-only.
[[nodiscard]] inline wal_scan scan_wal(const std::string& wal) {
  const int fd = ::open(wal.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return {};  // no log: nothing to lose
  struct closer {
    int fd;
    ~closer() { ::close(fd); }
  } close_it{fd};
  auto read_at = [fd](std::vector<unsigned char>& buf, std::size_t n, off_t at) {
    buf.resize(n);
    std::size_t got = 0;
    while (got < n) {
      const ssize_t r = ::pread(fd, buf.data() + got, n - got, at + static_cast<off_t>(got));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) break;
      got += static_cast<std::size_t>(r);
    }
    return got == n;
  };
  auto be32 = [](const unsigned char* p) {
    return (std::uint32_t{p[0]} << 24) | (std::uint32_t{p[1]} << 16) | (std::uint32_t{p[2]} << 8) | p[3];
  };
  const off_t size = ::lseek(fd, 0, SEEK_END);
  constexpr std::size_t header_size = 32, frame_header_size = 24;
  std::vector<unsigned char> header;
  if (size <= static_cast<off_t>(header_size) || !read_at(header, header_size, 0)) return {};
  const std::uint32_t magic = be32(&header[0]);
  const std::uint32_t page = be32(&header[8]);
  const bool page_ok = page >= 512 && page <= 65536 && (page & (page - 1)) == 0;
  if ((magic != 0x377f0682u && magic != 0x377f0683u) || be32(&header[4]) != 3007000u || !page_ok) {
    return {true, "its header is not a valid SQLite write-ahead log header"};
  }
  const bool big_endian = (magic & 1u) != 0;
  auto word = [&](const unsigned char* p) {
    return big_endian ? be32(p)
                      : (std::uint32_t{p[3]} << 24) | (std::uint32_t{p[2]} << 16) | (std::uint32_t{p[1]} << 8) | p[0];
  };
  auto sum = [&](const unsigned char* p, std::size_t n, std::uint32_t& s1, std::uint32_t& s2) {
    for (std::size_t i = 0; i + 8 <= n; i += 8) {
      s1 += word(p + i) + s2;
      s2 += word(p + i + 4) + s1;
    }
  };
  std::uint32_t s1 = 0, s2 = 0;
  sum(header.data(), 24, s1, s2);
  if (s1 != be32(&header[24]) || s2 != be32(&header[28])) {
    return {true, "its header fails its checksum"};
  }
  const std::uint32_t salt1 = be32(&header[16]), salt2 = be32(&header[20]);
  const std::size_t frame_size = frame_header_size + page;
  const auto frames = static_cast<std::size_t>((size - static_cast<off_t>(header_size)) / static_cast<off_t>(frame_size));
  std::vector<unsigned char> frame;
  std::optional<std::size_t> first_bad;
  std::size_t later = 0;
  for (std::size_t i = 0; i < frames; ++i) {
    if (!read_at(frame, frame_size, static_cast<off_t>(header_size + i * frame_size))) break;
    const bool ours = be32(&frame[8]) == salt1 && be32(&frame[12]) == salt2;
    if (first_bad) {
      if (ours) ++later;
      continue;
    }
    if (!ours) break;  // the end of this generation: older frames follow, ignored by SQLite too
    std::uint32_t f1 = s1, f2 = s2;
    sum(frame.data(), 8, f1, f2);
    sum(frame.data() + frame_header_size, page, f1, f2);
    if (f1 != be32(&frame[16]) || f2 != be32(&frame[20]) || be32(&frame[0]) == 0) {
      first_bad = i;
      continue;
    }
    s1 = f1;
    s2 = f2;
  }
  if (first_bad && later > 0) {
    return {true, absl::StrCat("frame ", *first_bad + 1, " of ", frames, " fails its checksum and ", later,
                               " later frame(s) of the same log follow it")};
  }
  return {};
}

// Store time inside a transaction: `check` decides what has expired,
// `grant` is the base of new expiries (see docs/stores.md, "Time").
struct sqlite_times {
  std::int64_t check;
  std::int64_t grant;
};

template <store_time_source Time>
class sqlite_db {
 public:
  sqlite_db(std::string path, const sqlite_options& o, Time time)
      : path_(std::move(path)), options_(o), time_(std::move(time)) {}
  sqlite_db(const sqlite_db&) = delete;
  sqlite_db& operator=(const sqlite_db&) = delete;
  // Statements are members declared after the connection, so they are
  // finalized before it closes.
  ~sqlite_db() = default;

  [[nodiscard]] const std::string& path() const noexcept { return path_; }
  [[nodiscard]] const Time& time() const noexcept { return time_; }
  [[nodiscard]] sqlite3* handle() const noexcept { return db_.get(); }

  // ---- opening -------------------------------------------------------------

  absl::Status open_error(int rc, std::string_view what) const {
    const int sys = db_ ? sqlite3_system_errno(db_.get()) : 0;
    const std::string msg = db_ ? sqlite3_errmsg(db_.get()) : sqlite3_errstr(rc);
    absl::StatusCode code = detail::sqlite_code(rc);
    if ((rc & 0xff) == SQLITE_CANTOPEN) {
      if (sys == EACCES || sys == EPERM || sys == EROFS) {
        code = absl::StatusCode::kPermissionDenied;
      } else if (sys == ENOENT) {
        // SQLite retries a create it may not make as a read-only open, which
        // then fails with ENOENT: a directory this process may not write is
        // PermissionDenied, a missing one NotFound.
        const std::size_t slash = path_.rfind('/');
        const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path_.substr(0, slash);
        const bool unwritable = ::access(dir.c_str(), F_OK) == 0 && ::access(dir.c_str(), W_OK) != 0;
        code = options_.create && unwritable ? absl::StatusCode::kPermissionDenied : absl::StatusCode::kNotFound;
      }
    }
    return absl::Status(code, absl::StrCat("keel: sqlite store '", path_, "': ", detail::to_absl(what), ": ", msg,
                                           sys != 0 ? absl::StrCat(" (errno ", sys, ")") : std::string()));
  }

  absl::Status connect() {
    // Before SQLite reads the file: its recovery would drop what follows a
    // damaged frame of the log, and the first write would overwrite it.
    if (absl::Status s = check_wal_frames(); !s.ok()) return s;
    sqlite3* raw = nullptr;
    const int flags = SQLITE_OPEN_READWRITE | (options_.create ? SQLITE_OPEN_CREATE : 0) | SQLITE_OPEN_NOMUTEX |
                      SQLITE_OPEN_EXRESCODE;
    const int rc = sqlite3_open_v2(path_.c_str(), &raw, flags, options_.vfs.empty() ? nullptr : options_.vfs.c_str());
    db_.reset(raw);
    if (rc != SQLITE_OK) return open_error(rc, options_.create ? "cannot open or create" : "cannot open");
    sqlite3_busy_timeout(db_.get(),
                         static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(options_.busy_timeout).count()));
    sqlite3_db_config(db_.get(), SQLITE_DBCONFIG_DEFENSIVE, 1, nullptr);

    // Look before touching anything: a foreign or damaged file is refused
    // before a single byte of it is written.
    absl::StatusOr<file_kind> kind = inspect();
    if (!kind.ok()) return kind.status();
    if (*kind == file_kind::keel) {
      if (absl::Status s = check_integrity(); !s.ok()) return s;
    }
    if (sqlite3_db_readonly(db_.get(), "main") == 1)
      return absl::PermissionDeniedError(absl::StrCat("keel: sqlite store '", path_,
                                                      "' can only be opened read-only; keel needs to write"));
    if (absl::Status s = exec("PRAGMA journal_mode=WAL", "enabling WAL"); !s.ok()) return s;
    if (absl::Status s = check_wal(); !s.ok()) return s;
    if (absl::Status s = exec(options_.synchronous == sqlite_sync::full ? "PRAGMA synchronous=FULL"
                                                                         : "PRAGMA synchronous=NORMAL",
                              "setting synchronous");
        !s.ok())
      return s;
    if (options_.max_size_bytes > 0) {
      absl::StatusOr<std::int64_t> page = pragma_int("PRAGMA page_size");
      if (!page.ok()) return page.status();
      const std::string limit =
          absl::StrCat("PRAGMA max_page_count = ", std::max<std::int64_t>(1, options_.max_size_bytes / *page));
      if (absl::Status s = exec(limit.c_str(), "limiting the file's size"); !s.ok()) return s;
    }
    if (*kind == file_kind::empty) {
      if (absl::Status s = create_schema(); !s.ok()) return s;
    }
    const std::pair<sqlite_stmt*, const char*> items[] = {
        {&begin_, "BEGIN IMMEDIATE"},
        {&commit_, "COMMIT"},
        {&rollback_, "ROLLBACK"},
        {&clock_read_, "SELECT high_water FROM keel_clock WHERE id = 0"},
        {&clock_write_, "UPDATE keel_clock SET high_water = ?1 WHERE id = 0 AND high_water < ?1"},
    };
    for (const auto& [st, sql] : items) {
      if (absl::Status s = prepare(*st, sql); !s.ok()) return s;
    }
    return absl::OkStatus();
  }


  // Prepares a statement the owner keeps (finalized before the connection closes
  // when declared after this object).
  absl::Status prepare(sqlite_stmt& st, const char* sql) {
    if (int rc = st.prepare(db_.get(), sql); rc != SQLITE_OK) return open_error(rc, "preparing statements");
    return absl::OkStatus();
  }

  absl::Status exec(const char* sql, std::string_view what) {
    char* err = nullptr;
    const int rc = sqlite3_exec(db_.get(), sql, nullptr, nullptr, &err);
    if (rc == SQLITE_OK) return absl::OkStatus();
    std::string msg = err ? err : sqlite3_errstr(rc);
    sqlite3_free(err);
    if (sqlite3_get_autocommit(db_.get()) == 0) sqlite3_exec(db_.get(), "ROLLBACK", nullptr, nullptr, nullptr);
    return absl::Status(detail::sqlite_code(rc), absl::StrCat("keel: sqlite store '", path_, "': ", detail::to_absl(what), ": ", msg));
  }

  // ---- transactions --------------------------------------------------------


  [[nodiscard]] std::int64_t changes() const noexcept { return sqlite3_changes64(db_.get()); }

  // A failure inside a transaction: the caller rolls back, so nothing was applied.
  absl::Status failure(int rc, std::string_view what) const {
    const std::string full =
        (rc & 0xff) != SQLITE_FULL ? std::string()
        : options_.max_size_bytes > 0
            ? absl::StrCat(" (the file reached sqlite_options.max_size_bytes = ", options_.max_size_bytes,
                           ", or the disk is full; nothing was written)")
            : std::string(" (the disk is full; nothing was written)");
    absl::Status s(detail::sqlite_code(rc), absl::StrCat("keel: sqlite store '", path_, "': ", detail::to_absl(what), ": ",
                                                         sqlite3_errmsg(db_.get()), full));
    return s.code() == absl::StatusCode::kUnavailable ? mark_not_started(std::move(s)) : s;
  }

  // BEGIN IMMEDIATE; read (and maybe move) the high-water mark; body; COMMIT.
  template <class Body>
  std::invoke_result_t<Body&, const sqlite_times&> transact(std::string_view op, Body&& body) {
    using result = std::invoke_result_t<Body&, const sqlite_times&>;
    {
      detail::sqlite_stmt::use b(begin_);
      if (int rc = b.step(); rc != SQLITE_DONE) return failure(rc, absl::StrCat(detail::to_absl(op), ": taking the write lock"));
    }
    result out = [&]() -> result {
      absl::StatusOr<sqlite_times> now = read_time();
      if (!now.ok()) return now.status();
      return body(*now);
    }();
    if (!out.ok()) {
      rollback();
      return out;
    }
    detail::sqlite_stmt::use c(commit_);
    const int rc = c.step();
    if (rc == SQLITE_DONE) return out;
    const absl::Status cause = failure(rc, absl::StrCat(detail::to_absl(op), ": COMMIT"));
    if ((rc & 0xff) == SQLITE_IOERR) {
      rollback();
      return unknown_outcome_error(absl::StrCat("sqlite store '", path_, "': ", detail::to_absl(op)), cause);
    }
    rollback();  // BUSY, FULL, ...: the transaction did not commit
    return cause.code() == absl::StatusCode::kUnavailable ? cause : mark_not_started(cause);
  }

  void rollback() {
    if (sqlite3_get_autocommit(db_.get()) != 0) return;  // SQLite already rolled back
    detail::sqlite_stmt::use r(rollback_);
    (void)r.step();
  }

 private:
  enum class file_kind { empty, keel };

  absl::StatusOr<file_kind> inspect() {
    absl::StatusOr<std::int64_t> app = pragma_int("PRAGMA application_id");
    if (!app.ok()) return app.status();
    absl::StatusOr<std::int64_t> version = pragma_int("PRAGMA user_version");
    if (!version.ok()) return version.status();
    std::vector<std::string> tables;
    {
      detail::sqlite_stmt q;
      int rc = q.prepare(db_.get(), "SELECT name FROM sqlite_schema WHERE type = 'table' ORDER BY name");
      if (rc != SQLITE_OK) return open_error(rc, "reading the schema");
      detail::sqlite_stmt::use u(q);
      while ((rc = u.step()) == SQLITE_ROW) tables.emplace_back(u.bytes(0));
      if (rc != SQLITE_DONE) return open_error(rc, "reading the schema");
    }
    if (*app == 0 && tables.empty() && *version == 0) return file_kind::empty;
    if (*app != sqlite_application_id) {
      return absl::FailedPreconditionError(absl::StrCat(
          "keel: sqlite store '", path_, "' is another application's database (application_id ", *app,
          ", tables: ", tables.empty() ? "none" : absl::StrJoin(tables, ", "), "); keel will not touch it"));
    }
    if (*version != sqlite_schema_version) {
      return absl::FailedPreconditionError(absl::StrCat("keel: sqlite store '", path_, "' has keel schema version ",
                                                        *version, "; this keel reads version ",
                                                        sqlite_schema_version, " only; refusing to change it"));
    }
    for (const char* t : {"keel_clock", "keel_idempotency", "keel_lease", "keel_result"}) {
      if (std::find(tables.begin(), tables.end(), t) == tables.end())
        return absl::FailedPreconditionError(absl::StrCat("keel: sqlite store '", path_,
                                                          "' is a keel store with a damaged schema: table ", t,
                                                          " is missing"));
    }
    return file_kind::keel;
  }

  // inspect() reads the header and the schema only: a damaged page further
  // in would open cleanly and fail every request later. Read-only; interrupted
  // at the time limit through the progress handler.
  absl::Status check_integrity() {
    if (options_.integrity_check == sqlite_integrity_check::off) return absl::OkStatus();
    const bool full = options_.integrity_check == sqlite_integrity_check::full;
    const std::string_view name = full ? "integrity_check" : "quick_check";
    struct limit {
      std::chrono::steady_clock::time_point deadline;
      bool expired = false;
    } lim{std::chrono::steady_clock::now() +
          std::chrono::duration_cast<std::chrono::steady_clock::duration>(options_.integrity_check_timeout)};
    sqlite3_progress_handler(
        db_.get(), 16,
        [](void* p) -> int {
          auto* l = static_cast<limit*>(p);
          l->expired = l->expired || std::chrono::steady_clock::now() >= l->deadline;
          return l->expired ? 1 : 0;
        },
        &lim);
    std::vector<std::string> found;  // at most 8 lines: the pragma's argument
    int rc = SQLITE_OK;
    {
      detail::sqlite_stmt q;
      rc = q.prepare(db_.get(), full ? "PRAGMA integrity_check(8)" : "PRAGMA quick_check(8)");
      if (rc == SQLITE_OK) {
        detail::sqlite_stmt::use u(q);
        while ((rc = u.step()) == SQLITE_ROW) found.emplace_back(u.bytes(0));
      }
    }
    sqlite3_progress_handler(db_.get(), 0, nullptr, nullptr);
    if (lim.expired) {
      return absl::DeadlineExceededError(absl::StrCat(
          "keel: sqlite store '", path_, "': PRAGMA ", detail::to_absl(name), " did not finish within ",
          detail::describe(options_.integrity_check_timeout),
          " (sqlite_options.integrity_check_timeout); the file is not verified, so keel does not use it; raise the "
          "limit, or set integrity_check = off"));
    }
    const int code = rc & 0xff;
    if (rc != SQLITE_DONE && code != SQLITE_CORRUPT && code != SQLITE_NOTADB)
      return open_error(rc, absl::StrCat("checking integrity (PRAGMA ", detail::to_absl(name), ")"));
    if (rc == SQLITE_DONE && found.size() == 1 && found[0] == "ok") return absl::OkStatus();
    if (rc != SQLITE_DONE) found.emplace_back(sqlite3_errmsg(db_.get()));
    const std::size_t shown = std::min<std::size_t>(found.size(), 3);
    return absl::DataLossError(absl::StrCat(
        "keel: sqlite store '", path_, "' is damaged: PRAGMA ", detail::to_absl(name), " found: ",
        absl::StrJoin(found.begin(), found.begin() + static_cast<std::ptrdiff_t>(shown), "; "),
        found.size() > shown ? absl::StrCat(" (and ", found.size() - shown, " more)") : std::string(),
        "; keel refuses to open it and has not changed it (restore it from a backup, or move it aside)"));
  }

  absl::StatusOr<std::int64_t> pragma_int(const char* sql) {
    detail::sqlite_stmt q;
    int rc = q.prepare(db_.get(), sql);
    if (rc != SQLITE_OK) return open_error(rc, "reading the file header");
    detail::sqlite_stmt::use u(q);
    rc = u.step();
    if (rc != SQLITE_ROW) return open_error(rc, "reading the file header");
    return u.i64(0);
  }

  // scan_wal on the file's log; damage is looked at twice more, a moment
  // apart, before it is believed: another process appending to a live log
  // can look torn in the middle to a reader that does not take its locks.
  absl::Status check_wal_frames() const {
    if (options_.integrity_check == sqlite_integrity_check::off) return absl::OkStatus();
    const std::string wal = path_ + "-wal";
    wal_scan scan = scan_wal(wal);
    for (int again = 0; scan.damaged && again < 2; ++again) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      scan = scan_wal(wal);
    }
    if (!scan.damaged) return absl::OkStatus();
    return absl::DataLossError(absl::StrCat(
        "keel: sqlite store '", path_, "' has a damaged write-ahead log '", wal, "': ", scan.what,
        "; opening it would drop transactions that were committed, so keel refuses to open it and has not changed "
        "either file (restore both from a backup, or move them aside)"));
  }

  absl::Status check_wal() {
    detail::sqlite_stmt q;
    int rc = q.prepare(db_.get(), "PRAGMA journal_mode");
    if (rc != SQLITE_OK) return open_error(rc, "reading the journal mode");
    detail::sqlite_stmt::use u(q);
    rc = u.step();
    if (rc != SQLITE_ROW) return open_error(rc, "reading the journal mode");
    if (u.bytes(0) != "wal")
      return absl::FailedPreconditionError(absl::StrCat("keel: sqlite store '", path_,
                                                        "': WAL journal mode is not available here (got ",
                                                        std::string(u.bytes(0)), ")"));
    return absl::OkStatus();
  }

  absl::Status create_schema() {
    // Another process may be creating it at the same moment: take the write
    // lock, then look again.
    if (absl::Status s = exec("BEGIN IMMEDIATE", "creating the schema"); !s.ok()) return s;
    absl::StatusOr<std::int64_t> app = pragma_int("PRAGMA application_id");
    if (!app.ok()) {
      (void)exec("ROLLBACK", "creating the schema");
      return app.status();
    }
    if (*app == sqlite_application_id) return exec("COMMIT", "creating the schema");
    static constexpr const char* schema =
        "CREATE TABLE keel_clock(id INTEGER PRIMARY KEY CHECK (id = 0), high_water INTEGER NOT NULL);"
        "INSERT INTO keel_clock VALUES (0, -9223372036854775808);"
        "CREATE TABLE keel_idempotency("
        "  tenant BLOB NOT NULL, endpoint BLOB NOT NULL, key BLOB NOT NULL,"
        "  request BLOB NOT NULL, state INTEGER NOT NULL, owner BLOB NOT NULL, fence INTEGER NOT NULL,"
        "  lease_expires INTEGER NOT NULL, record_expires INTEGER NOT NULL,"
        "  decision_id BLOB, model_digest BLOB, policy_revision BLOB, result BLOB,"
        "  error_code INTEGER NOT NULL DEFAULT 0, error_message BLOB, committed_at INTEGER NOT NULL DEFAULT 0,"
        "  PRIMARY KEY (tenant, endpoint, key)) WITHOUT ROWID;"
        "CREATE TABLE keel_lease(work_key BLOB PRIMARY KEY, owner BLOB NOT NULL, fence INTEGER NOT NULL,"
        "  expires INTEGER NOT NULL, held INTEGER NOT NULL) WITHOUT ROWID;"
        "CREATE TABLE keel_result(key BLOB PRIMARY KEY, value BLOB NOT NULL, saved_at INTEGER NOT NULL,"
        "  expires INTEGER NOT NULL) WITHOUT ROWID;"
        "PRAGMA application_id = 1801807212;"  // 0x6B65656C
        "PRAGMA user_version = 1;"
        "COMMIT;";
    static_assert(sqlite_application_id == 1801807212 && sqlite_schema_version == 1);
    return exec(schema, "creating the schema");
  }

  absl::StatusOr<sqlite_times> read_time() {
    const std::int64_t s = detail::store_now_ns(time_);
    std::int64_t mark = INT64_MIN;
    {
      detail::sqlite_stmt::use q(clock_read_);
      const int rc = q.step();
      if (rc != SQLITE_ROW) return failure(rc == SQLITE_DONE ? SQLITE_CORRUPT : rc, "reading the store clock");
      mark = q.i64(0);
    }
    if (s < mark) return sqlite_times{mark, detail::add_ns(mark, detail::sqlite_mark_granularity_ns)};  // stepped back
    if (mark == INT64_MIN || s - mark >= detail::sqlite_mark_granularity_ns) {
      detail::sqlite_stmt::use w(clock_write_);
      w.bind(1, s);
      if (int rc = w.step(); rc != SQLITE_DONE) return failure(rc, "moving the store clock");
    }
    return sqlite_times{s, s};
  }
  std::string path_;
  sqlite_options options_;
  Time time_;
  std::unique_ptr<sqlite3, sqlite_closer> db_;
  sqlite_stmt begin_, commit_, rollback_, clock_read_, clock_write_;
};

}  // namespace keel::detail
