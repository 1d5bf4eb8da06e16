// keel/store/internal/pg_connection.hpp — one libpq connection as keel's PostgreSQL
// store uses it: binary parameters and results, a client-side timeout on
// every statement, and failures mapped onto keel's classified statuses.
//
// Every statement is sent with PQsendQueryPrepared / PQsendQueryParams on a
// non-blocking socket and awaited with poll() until the command timeout; a
// statement that runs past it is abandoned and its connection discarded.
// Values always travel as parameters (binary format); only the schema name,
// validated and quoted with PQescapeIdentifier, appears in statement text.
//
// How a failure is reported (see docs/stores.md, "Statuses"):
//
//   cannot connect (refused, unreachable,     Unavailable, not started
//     starting up, too many connections)
//   authentication / role / database refused  PermissionDenied (permanent)
//   the statement failed with an ERROR and    the statement was rolled back: not started
//     the session is intact                   (Unavailable for transient SQLSTATEs,
//                                             FailedPrecondition / PermissionDenied / Internal otherwise)
//   the connection dropped, the server shut   a write: keel::unknown_outcome_error (it may have
//     down, or the command timed out after      committed); a read: Unavailable
//     the statement was sent
//
// detail::pg_transaction wraps BEGIN ... COMMIT on one connection and rolls
// back on every path that does not commit.
//
// Thread-safety: none. A connection is used by one thread at a time (the
// pool lends it to one holder).
#pragma once

#include <poll.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <libpq-fe.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "keel/core/clock.hpp"
#include "keel/core/status.hpp"
#include "keel/durable/ownership.hpp"

namespace keel::detail {

inline constexpr unsigned pg_bytea_oid = 17;
inline constexpr unsigned pg_int8_oid = 20;
inline constexpr unsigned pg_text_oid = 25;

// Whether a statement changes the store: decides how a dropped connection
// is reported (unknown outcome for a write, unavailable for a read).
enum class pg_effect { read, write };

struct pg_result_deleter {
  void operator()(PGresult* r) const noexcept { PQclear(r); }
};

// A result with binary columns.
class pg_result {
 public:
  pg_result() = default;
  explicit pg_result(PGresult* r) noexcept : r_(r) {}

  [[nodiscard]] PGresult* get() const noexcept { return r_.get(); }
  [[nodiscard]] int rows() const noexcept { return r_ ? PQntuples(r_.get()) : 0; }
  [[nodiscard]] int columns() const noexcept { return r_ ? PQnfields(r_.get()) : 0; }
  [[nodiscard]] bool is_null(int row, int col) const noexcept { return PQgetisnull(r_.get(), row, col) != 0; }
  [[nodiscard]] std::string_view bytes(int row, int col) const noexcept {
    return {PQgetvalue(r_.get(), row, col), static_cast<std::size_t>(PQgetlength(r_.get(), row, col))};
  }
  // Binary int8 / int4 / int2 / bool (network byte order), by the column's length.
  [[nodiscard]] std::int64_t integer(int row, int col) const noexcept {
    const std::string_view b = bytes(row, col);
    std::uint64_t v = 0;
    for (unsigned char c : b) v = v << 8 | c;
    const unsigned bits = static_cast<unsigned>(b.size()) * 8;
    if (bits > 0 && bits < 64 && (v >> (bits - 1)) != 0) v |= ~std::uint64_t{0} << bits;  // sign-extend
    return static_cast<std::int64_t>(v);
  }

 private:
  std::unique_ptr<PGresult, pg_result_deleter> r_;
};

// Up to N parameters, every one binary. Views passed to add() must outlive
// the statement; integers and owners are copied in.
template <int N>
class pg_params {
 public:
  pg_params& add(std::string_view bytes) noexcept {
    values_[n_] = bytes.data() == nullptr ? "" : bytes.data();
    lengths_[n_] = static_cast<int>(bytes.size());
    formats_[n_] = 1;
    ++n_;
    return *this;
  }
  pg_params& add(std::int64_t v) noexcept {
    auto& b = raw_[n_];
    for (int i = 0; i < 8; ++i) b[7 - i] = static_cast<char>(static_cast<std::uint64_t>(v) >> (8 * i));
    return add(std::string_view(b.data(), 8));
  }
  pg_params& add(const owner_id& o) noexcept {
    auto& b = raw_[n_];
    const auto bytes = o.bytes();
    std::memcpy(b.data(), bytes.data(), bytes.size());
    return add(std::string_view(b.data(), bytes.size()));
  }

  [[nodiscard]] int size() const noexcept { return n_; }
  [[nodiscard]] const char* const* values() const noexcept { return values_.data(); }
  [[nodiscard]] const int* lengths() const noexcept { return lengths_.data(); }
  [[nodiscard]] const int* formats() const noexcept { return formats_.data(); }

 private:
  std::array<const char*, N> values_{};
  std::array<int, N> lengths_{};
  std::array<int, N> formats_{};
  std::array<std::array<char, 16>, N> raw_{};
  int n_ = 0;
};

struct pg_conn_closer {
  void operator()(PGconn* c) const noexcept { PQfinish(c); }
};

// Failures of a connection attempt: refused/unreachable is transient,
// credentials and missing roles/databases are permanent. libpq reports them
// as text only (no SQLSTATE before a session exists).
[[nodiscard]] inline absl::Status pg_connect_error(std::string_view who, PGconn* c) {
  const std::string msg = c ? PQerrorMessage(c) : "out of memory";
  const absl::string_view m(msg.data(), msg.size());
  const std::string what = absl::StrCat("keel: ", to_absl(who), ": cannot connect: ", absl::StripTrailingAsciiWhitespace(m));
  const bool credentials =
      (c != nullptr && PQconnectionNeedsPassword(c)) || absl::StrContains(m, "authentication failed") ||
      absl::StrContains(m, "no pg_hba.conf entry") || absl::StrContains(m, "password") ||
      (absl::StrContains(m, "role \"") && absl::StrContains(m, "does not exist")) ||
      absl::StrContains(m, "permission denied");
  if (credentials) return with_outcome(absl::PermissionDeniedError(what), outcome_kind::permanent);
  if (absl::StrContains(m, "database \"") && absl::StrContains(m, "does not exist"))
    return with_outcome(absl::FailedPreconditionError(what), outcome_kind::permanent);
  return mark_not_started(absl::UnavailableError(what));
}

class pg_connection {
 public:
  // Connects with libpq's `conninfo` (a connection string or URI), each
  // host within `connect_timeout` to the millisecond: libpq's own
  // connect_timeout counts whole seconds, at least 2, and a frozen server
  // (SIGSTOP, a hung host: the kernel accepts, nobody answers) held a new
  // connection that long whatever the store's timeouts. The connection is
  // made with libpq's non-blocking PQconnectStartParams/PQconnectPoll under
  // keel's own deadline. A multi-host conninfo ("host=a,b port=p,q",
  // target_session_attrs...) is tried one host at a time, each with the
  // whole connect_timeout (libpq's rule), so a frozen first host does not
  // keep keel from the next. (Name resolution is libpq's and not bounded:
  // give addresses or a local resolver.) application_name shows which store
  // a session belongs to (pg_stat_activity).
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<pg_connection>> connect(const std::string& conninfo,
                                                                             duration connect_timeout,
                                                                             const std::string& application_name,
                                                                             std::string_view who) {
    const std::vector<std::pair<std::string, std::string>> hosts = split_hosts(conninfo);
    if (hosts.size() <= 1) return connect_one(conninfo, nullptr, nullptr, connect_timeout, application_name, who);
    absl::Status last;
    for (const auto& [host, port] : hosts) {
      absl::StatusOr<std::unique_ptr<pg_connection>> c =
          connect_one(conninfo, host.c_str(), port.empty() ? nullptr : port.c_str(), connect_timeout, application_name, who);
      if (c.ok()) return c;
      last = c.status();
    }
    return last;
  }

  // "host" and "port" of a conninfo with several hosts, paired (one port for
  // all, or one each); empty when it names one host, or uses hostaddr lists
  // (left to libpq).
  [[nodiscard]] static std::vector<std::pair<std::string, std::string>> split_hosts(const std::string& conninfo) {
    std::vector<std::pair<std::string, std::string>> out;
    char* err = nullptr;
    PQconninfoOption* opts = PQconninfoParse(conninfo.c_str(), &err);
    if (err != nullptr) PQfreemem(err);
    if (opts == nullptr) return out;
    std::string host, port, hostaddr;
    for (PQconninfoOption* o = opts; o->keyword != nullptr; ++o) {
      if (o->val == nullptr) continue;
      const std::string_view k = o->keyword;
      if (k == "host") host = o->val;
      if (k == "port") port = o->val;
      if (k == "hostaddr") hostaddr = o->val;
    }
    PQconninfoFree(opts);
    if (host.find(',') == std::string::npos || !hostaddr.empty()) return out;
    const std::vector<std::string> hs = absl::StrSplit(host, ',');
    const std::vector<std::string> ps = port.empty() ? std::vector<std::string>() : absl::StrSplit(port, ',');
    if (!ps.empty() && ps.size() != 1 && ps.size() != hs.size()) return out;  // libpq will say what is wrong
    for (std::size_t i = 0; i < hs.size(); ++i)
      out.emplace_back(hs[i], ps.empty() ? std::string() : ps.size() == 1 ? ps[0] : ps[i]);
    return out;
  }

  // One connection attempt (to `host`/`port` instead of the conninfo's when
  // given) under keel's own deadline.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<pg_connection>> connect_one(
      const std::string& conninfo, const char* host, const char* port, duration connect_timeout,
      const std::string& application_name, std::string_view who) {
    // libpq's own limit too (whole seconds, at least 2): unused by the
    // non-blocking calls below, kept for anything libpq does on its own.
    const auto secs = std::max<std::int64_t>(
        2, std::chrono::duration_cast<std::chrono::seconds>(connect_timeout + std::chrono::milliseconds(999)).count());
    const std::string timeout = std::to_string(secs);
    // Later keywords win over what the expanded conninfo (dbname) says.
    std::vector<const char*> keys = {"dbname", "connect_timeout", "application_name"};
    std::vector<const char*> values = {conninfo.c_str(), timeout.c_str(), application_name.c_str()};
    if (host != nullptr) {
      keys.push_back("host");
      values.push_back(host);
    }
    if (port != nullptr) {
      keys.push_back("port");
      values.push_back(port);
    }
    keys.push_back(nullptr);
    values.push_back(nullptr);
    const auto until = std::chrono::steady_clock::now() + connect_timeout;
    std::unique_ptr<PGconn, pg_conn_closer> c(PQconnectStartParams(keys.data(), values.data(), /*expand_dbname=*/1));
    if (c == nullptr || PQstatus(c.get()) == CONNECTION_BAD) return pg_connect_error(who, c.get());
    PostgresPollingStatusType st = PGRES_POLLING_WRITING;
    while (st != PGRES_POLLING_OK) {
      if (st == PGRES_POLLING_FAILED) return pg_connect_error(who, c.get());
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
      if (left.count() <= 0)
        return store_unavailable_error(absl::StrCat(to_absl(who), ": cannot connect",
                                                    host != nullptr ? absl::StrCat(" to ", host) : std::string(),
                                                    ": no answer within the connect timeout of ",
                                                    describe(connect_timeout)));
      pollfd p{PQsocket(c.get()), static_cast<short>(st == PGRES_POLLING_READING ? POLLIN : POLLOUT), 0};
      const int r = ::poll(&p, 1, static_cast<int>(std::min<std::int64_t>(left.count() + 1, 60'000)));
      if (r < 0 && errno != EINTR) return pg_connect_error(who, c.get());
      if (r <= 0) continue;  // re-check the deadline
      st = PQconnectPoll(c.get());
    }
    if (PQsetnonblocking(c.get(), 1) != 0) return pg_connect_error(who, c.get());
    // libpq prints server notices (for example "terminating connection due
    // to immediate shutdown") to stderr by default; a library must not.
    PQsetNoticeProcessor(c.get(), [](void*, const char*) {}, nullptr);
    return std::unique_ptr<pg_connection>(new pg_connection(std::move(c), who));
  }

  pg_connection(const pg_connection&) = delete;
  pg_connection& operator=(const pg_connection&) = delete;
  ~pg_connection() = default;

  [[nodiscard]] PGconn* raw() const noexcept { return c_.get(); }
  [[nodiscard]] bool broken() const noexcept { return broken_ || PQstatus(c_.get()) != CONNECTION_OK; }
  // Statements sent on this connection (round trips), for benchmarks.
  [[nodiscard]] std::uint64_t sent() const noexcept { return sent_; }
  // Never send on this session again (its state is unknown); a pool replaces it.
  void mark_broken() noexcept { broken_ = true; }
  [[nodiscard]] std::string_view who() const noexcept { return who_; }
  // The last statement was abandoned at its timeout (its session may still run it).
  [[nodiscard]] bool abandoned() const noexcept { return abandoned_; }

  // False when the server has closed this idle connection (it restarted, or
  // terminated the session): an idle connection has nothing to read, so any
  // readiness means EOF or a termination notice. Costs one poll() syscall.
  [[nodiscard]] bool idle_and_alive() const noexcept {
    if (broken()) return false;
    pollfd p{PQsocket(c_.get()), static_cast<short>(POLLIN | POLLRDHUP), 0};
    const int r = ::poll(&p, 1, 0);
    return r == 0;
  }

  // From now on prepare() keeps the statement here and exec_prepared() sends
  // its text with every execution (an unnamed statement): for a pooler in
  // transaction mode (PgBouncer), where consecutive statements may run on
  // different server connections and a statement prepared on one is unknown
  // on the others.
  void keep_statements_unprepared() noexcept { unprepared_ = true; }

  [[nodiscard]] absl::Status prepare(const char* name, std::string_view sql, int nparams, const unsigned* types) {
    if (unprepared_) {
      kept_.push_back({name, std::string(sql), std::vector<unsigned>(types, types + nparams)});
      return absl::OkStatus();
    }
    const std::string text(sql);
    return status_of(run(
        [&] {
          return PQsendPrepare(c_.get(), name, text.c_str(), nparams, reinterpret_cast<const Oid*>(types));
        },
        pg_effect::read, std::chrono::seconds(30), name));
  }

  template <int N>
  [[nodiscard]] absl::StatusOr<pg_result> exec_prepared(const char* name, const pg_params<N>& p, pg_effect effect,
                                                        duration timeout) {
    if (unprepared_) {
      const kept_statement* k = nullptr;
      for (const kept_statement& e : kept_)
        if (std::string_view(e.name) == name) k = &e;
      if (k == nullptr) return absl::InternalError(absl::StrCat("keel: ", to_absl(who_), ": no statement ", name));
      return run(
          [&] {
            return PQsendQueryParams(c_.get(), k->sql.c_str(), p.size(), reinterpret_cast<const Oid*>(k->types.data()),
                                     p.values(), p.lengths(), p.formats(), /*resultFormat=*/1);
          },
          effect, timeout, name);
    }
    return run(
        [&] {
          return PQsendQueryPrepared(c_.get(), name, p.size(), p.values(), p.lengths(), p.formats(),
                                     /*resultFormat=*/1);
        },
        effect, timeout, name);
  }

  // An unprepared statement with parameters (setup, schema creation).
  template <int N>
  [[nodiscard]] absl::StatusOr<pg_result> exec(std::string_view sql, const pg_params<N>& p, pg_effect effect,
                                               duration timeout) {
    const std::string text(sql);
    return run(
        [&] {
          return PQsendQueryParams(c_.get(), text.c_str(), p.size(), nullptr, p.values(), p.lengths(), p.formats(),
                                   /*resultFormat=*/1);
        },
        effect, timeout, "setup");
  }
  // The server-side backstops for a statement whose client gave up:
  // `statement_timeout`, and (server 14 and later) a check every 500 ms that
  // the client is still there, so a statement abandoned at the client's
  // timeout stops soon after. Each setting is bounded by `command_timeout`.
  [[nodiscard]] absl::Status set_backstops(duration statement_timeout, duration command_timeout) {
    const std::string timeout =
        absl::StrCat(std::chrono::duration_cast<std::chrono::milliseconds>(statement_timeout).count(), "ms");
    pg_params<1> t;
    t.add(timeout);
    if (auto r = exec("SELECT set_config('statement_timeout', $1::text, false)", t, pg_effect::read, command_timeout);
        !r.ok())
      return r.status();
    if (PQserverVersion(c_.get()) >= 140000) {
      if (auto r = exec("SELECT set_config('client_connection_check_interval', '500ms', false)", pg_effect::read,
                        command_timeout);
          !r.ok())
        return r.status();
    }
    return absl::OkStatus();
  }

  [[nodiscard]] absl::StatusOr<pg_result> exec(std::string_view sql, pg_effect effect, duration timeout) {
    return exec(sql, pg_params<1>{}, effect, timeout);
  }

  // Quotes an identifier (the schema name) for statement text.
  [[nodiscard]] std::string quote_identifier(std::string_view id) const {
    char* q = PQescapeIdentifier(c_.get(), id.data(), id.size());
    if (q == nullptr) return {};
    std::string out(q);
    PQfreemem(q);
    return out;
  }

 private:
  pg_connection(std::unique_ptr<PGconn, pg_conn_closer> c, std::string_view who) : c_(std::move(c)), who_(who) {}

  static absl::Status status_of(const absl::StatusOr<pg_result>& r) { return r.ok() ? absl::OkStatus() : r.status(); }

  // Waits for the socket; false on timeout.
  bool wait_socket(short events, std::chrono::steady_clock::time_point until) const noexcept {
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
      if (left.count() <= 0) return false;
      pollfd p{PQsocket(c_.get()), events, 0};
      const int r = ::poll(&p, 1, static_cast<int>(std::min<std::int64_t>(left.count() + 1, 60'000)));
      if (r > 0) return true;
      if (r < 0 && errno != EINTR) return true;  // let libpq report the error
    }
  }

  // Sends (send() queues the message), flushes, waits for the result within
  // `timeout`, and classifies whatever went wrong.
  template <class Send>
  absl::StatusOr<pg_result> run(Send send, pg_effect effect, duration timeout, std::string_view what) {
    PGconn* c = c_.get();
    if (broken()) return store_unavailable_error(absl::StrCat(to_absl(who_), ": connection is closed"));
    const auto until = std::chrono::steady_clock::now() + timeout;
    if (send() == 0) {
      // libpq refused to queue it: nothing reached the server.
      broken_ = true;
      return store_unavailable_error(
          absl::StrCat(to_absl(who_), ": ", to_absl(what), ": ", absl::StripTrailingAsciiWhitespace(PQerrorMessage(c))));
    }
    ++sent_;
    for (;;) {
      const int f = PQflush(c);
      if (f == 0) break;
      if (f < 0) return lost(effect, what, "sending");
      if (!wait_socket(POLLIN | POLLOUT, until)) return timed_out(effect, what, timeout);
      if (PQconsumeInput(c) == 0) return lost(effect, what, "sending");
    }
    while (PQisBusy(c) != 0) {
      if (!wait_socket(POLLIN, until)) return timed_out(effect, what, timeout);
      if (PQconsumeInput(c) == 0) return lost(effect, what, "waiting for the result");
    }
    pg_result first;
    bool have = false;
    for (;;) {
      // Results after the first (there are none for one statement) are
      // drained so the connection is ready for the next one.
      while (PQisBusy(c) != 0) {
        if (!wait_socket(POLLIN, until)) return timed_out(effect, what, timeout);
        if (PQconsumeInput(c) == 0) return lost(effect, what, "waiting for the result");
      }
      PGresult* r = PQgetResult(c);
      if (r == nullptr) break;
      if (!have) {
        first = pg_result(r);
        have = true;
      } else {
        PQclear(r);
      }
    }
    if (!have) return lost(effect, what, "reading the result");
    return classify(std::move(first), effect, what);
  }

  // An answer from the server: rows, or an ERROR. A statement that failed
  // while its session survives was rolled back (not applied); one that ended
  // with the session (a shutdown, a crash, a lost connection) or was
  // cancelled may have committed before it ended.
  absl::StatusOr<pg_result> classify(pg_result r, pg_effect effect, std::string_view what) {
    const ExecStatusType st = PQresultStatus(r.get());
    if (st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK) return r;
    const char* code = PQresultErrorField(r.get(), PG_DIAG_SQLSTATE);
    const std::string_view sqlstate = code ? code : "";
    const std::string_view cls = sqlstate.substr(0, 2);
    const std::string detail =
        absl::StrCat(absl::StripTrailingAsciiWhitespace(PQresultErrorMessage(r.get())),
                     sqlstate.empty() ? "" : " (SQLSTATE ", to_absl(sqlstate), sqlstate.empty() ? "" : ")");
    const std::string message = absl::StrCat("keel: ", to_absl(who_), ": ", to_absl(what), ": ", detail);
    if (PQstatus(c_.get()) != CONNECTION_OK || sqlstate.empty() || cls == "08" || cls == "57" || cls == "58" ||
        cls == "XX") {
      return failed(absl::StatusCode::kUnavailable, effect, what, detail);
    }
    absl::Status s;
    if (cls == "28" || sqlstate == "42501") {
      s = with_outcome(absl::PermissionDeniedError(message), outcome_kind::permanent);
    } else if (sqlstate == "42P01" || sqlstate == "3F000" || sqlstate == "42703" || sqlstate == "26000") {
      s = with_outcome(absl::FailedPreconditionError(absl::StrCat(message, "; the keel schema is missing or of another version")),
                       outcome_kind::permanent);
    } else if (cls == "40" || cls == "53" || sqlstate == "55P03" || sqlstate == "25006") {
      s = absl::UnavailableError(message);  // contention, resources, a read-only standby: transient
    } else {
      s = with_outcome(absl::InternalError(message), outcome_kind::permanent);
    }
    return mark_not_started(std::move(s));
  }

  // A statement whose fate is unknown: for a write, keel's unknown outcome
  // (it may have committed); for a read, `code` (transient).
  absl::Status failed(absl::StatusCode code, pg_effect effect, std::string_view what, std::string_view detail) {
    broken_ = true;
    if (effect == pg_effect::write)
      return unknown_outcome_error(absl::StrCat(to_absl(who_), ": ", to_absl(what)), absl::Status(code, to_absl(detail)));
    return absl::Status(code, absl::StrCat("keel: ", to_absl(who_), ": ", to_absl(what), ": ", to_absl(detail)));
  }

  absl::Status lost(pg_effect effect, std::string_view what, std::string_view when) {
    return failed(absl::StatusCode::kUnavailable, effect, what,
                  absl::StrCat("connection lost while ", to_absl(when), ": ",
                               absl::StripTrailingAsciiWhitespace(PQerrorMessage(c_.get()))));
  }

  absl::Status timed_out(pg_effect effect, std::string_view what, duration timeout) {
    // Never reuse this session: its state is unknown. No PQcancel: it opens
    // a connection and waits for the server's answer without any bound, so
    // against a frozen server (SIGSTOP, a hung host) the caller would hang
    // past its timeout (tests/scaleout_faults_test.cpp). The session is
    // closed instead; the server ends the abandoned statement when it sees
    // the client gone (client_connection_check_interval, set by the stores
    // where the server has it) or at statement_timeout, one second later.
    abandoned_ = true;
    return failed(absl::StatusCode::kDeadlineExceeded, effect, what,
                  absl::StrCat("no answer within the command timeout of ", describe(timeout)));
  }

  struct kept_statement {
    const char* name;
    std::string sql;
    std::vector<unsigned> types;
  };

  std::unique_ptr<PGconn, pg_conn_closer> c_;
  std::string who_;
  bool broken_ = false;
  bool abandoned_ = false;
  bool unprepared_ = false;
  std::vector<kept_statement> kept_;
  std::uint64_t sent_ = 0;
};

// One transaction on one connection, ended exactly once: commit() sends
// COMMIT; every other way out (an early return, an exception) rolls back in
// the destructor. A session that cannot be rolled back (already broken, or
// ROLLBACK failing) is marked broken, so a pool never lends a connection
// with a transaction still open.
//
//   absl::StatusOr<pg_transaction> tx = pg_transaction::begin(conn, timeout);
//   if (!tx.ok()) return tx.status();
//   if (auto r = conn.exec(...); !r.ok()) return r.status();   // rolled back
//   return tx->commit();
//
// Thread-safety: as the connection's (one thread at a time).
class pg_transaction {
 public:
  // Sends BEGIN on `c`; `timeout` bounds each of BEGIN, COMMIT and ROLLBACK.
  [[nodiscard]] static absl::StatusOr<pg_transaction> begin(pg_connection& c, duration timeout) {
    absl::StatusOr<pg_result> r = c.exec("BEGIN", pg_effect::read, timeout);
    if (!r.ok()) return r.status();
    return pg_transaction(c, timeout);
  }

  pg_transaction(pg_transaction&& o) noexcept : c_(std::exchange(o.c_, nullptr)), timeout_(o.timeout_) {}
  pg_transaction& operator=(pg_transaction&&) = delete;
  pg_transaction(const pg_transaction&) = delete;
  pg_transaction& operator=(const pg_transaction&) = delete;
  ~pg_transaction() { rollback(); }

  // Sends COMMIT and ends the transaction whatever the answer. A COMMIT the
  // server answers with ROLLBACK (a statement in the transaction had failed
  // and the caller went on) applied nothing: Unavailable, not started. One
  // lost in transit is an unknown outcome, as for any write.
  [[nodiscard]] absl::Status commit() {
    pg_connection* c = std::exchange(c_, nullptr);
    if (c == nullptr) return absl::FailedPreconditionError("keel: the PostgreSQL transaction has already ended");
    absl::StatusOr<pg_result> r = c->exec("COMMIT", pg_effect::write, timeout_);
    if (!r.ok()) return r.status();
    if (std::string_view(PQcmdStatus(r->get())) != "COMMIT")
      return store_unavailable_error(absl::StrCat(to_absl(c->who()),
                                                  ": COMMIT was answered with a rollback (a statement of the "
                                                  "transaction had failed); nothing applied"));
    return absl::OkStatus();
  }

  // Rolls back now (the destructor does it otherwise). Idempotent.
  void rollback() noexcept {
    pg_connection* c = std::exchange(c_, nullptr);
    if (c == nullptr || c->broken()) return;  // a broken session is discarded, transaction and all
    try {
      if (c->exec("ROLLBACK", pg_effect::read, timeout_).ok()) return;
    } catch (...) {  // an allocation failing while composing the message
    }
    c->mark_broken();
  }

 private:
  pg_transaction(pg_connection& c, duration timeout) noexcept : c_(&c), timeout_(timeout) {}

  pg_connection* c_;
  duration timeout_;
};

}  // namespace keel::detail
