// keel/store/internal/redis_connection.hpp — one hiredis (0.14) connection as keel's
// Redis store and shared quota use it: a connect timeout, a command timeout
// on every command (socket send/receive timeouts), AUTH and SELECT, Lua
// scripts by SHA with the source re-sent on NOSCRIPT, and failures mapped
// onto keel's classified statuses.
//
//   connection refused / unreachable / connect timeout   Unavailable, not started
//   AUTH refused (WRONGPASS, NOAUTH, NOPERM)              PermissionDenied (permanent)
//   LOADING, BUSY, READONLY (a replica), MASTERDOWN,      Unavailable, not started: the server
//     TRYAGAIN, CLUSTERDOWN, MISCONF                      refused before running anything
//   OOM                                                   ResourceExhausted, not started
//   the connection dropped or the command timed out       a write: keel::unknown_outcome_error
//     after it was sent                                   (it may have run); a read: Unavailable
//
// Writing to a socket the server closed raises SIGPIPE; hiredis uses plain
// write(), so each command runs with SIGPIPE blocked in the calling thread
// and a SIGPIPE it caused is consumed (as libpq does).
//
// Thread-safety: none. A connection is used by one thread at a time (the
// pool lends it to one holder).
#pragma once

#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/time.h>

#include <array>
#include <atomic>
#include <vector>
#include <cerrno>
#include <initializer_list>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <string_view>
#include <utility>

#include <hiredis/hiredis.h>
#include <openssl/evp.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "keel/core/clock.hpp"
#include "keel/core/outcome.hpp"
#include "keel/core/status.hpp"
#include "keel/durable/ownership.hpp"

namespace keel::detail {

enum class redis_effect { read, write };

struct redis_reply_free {
  void operator()(redisReply* r) const noexcept { freeReplyObject(r); }
};
using redis_reply = std::unique_ptr<redisReply, redis_reply_free>;

struct redis_context_free {
  void operator()(redisContext* c) const noexcept { redisFree(c); }
};

// A Lua script: its source and SHA-1 (hex), computed once.
class redis_script {
 public:
  explicit redis_script(std::string source) : source_(std::move(source)) {
    std::array<unsigned char, EVP_MAX_MD_SIZE> md{};
    unsigned len = 0;
    if (EVP_Digest(source_.data(), source_.size(), md.data(), &len, EVP_sha1(), nullptr) != 1) throw std::bad_alloc();
    static constexpr char digits[] = "0123456789abcdef";
    sha_.resize(2 * len);
    for (unsigned i = 0; i < len; ++i) {
      sha_[2 * i] = digits[md[i] >> 4];
      sha_[2 * i + 1] = digits[md[i] & 0xf];
    }
  }
  [[nodiscard]] std::string_view source() const noexcept { return source_; }
  [[nodiscard]] std::string_view sha() const noexcept { return sha_; }

 private:
  std::string source_;
  std::string sha_;
};

// Blocks SIGPIPE in this thread for one command and swallows a SIGPIPE the
// command raised.
class sigpipe_guard {
 public:
  sigpipe_guard() noexcept {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
    sigset_t pending;
    sigpending(&pending);
    was_pending_ = sigismember(&pending, SIGPIPE) == 1;
  }
  ~sigpipe_guard() {
    if (!was_pending_) {
      sigset_t pending;
      sigpending(&pending);
      if (sigismember(&pending, SIGPIPE) == 1) {
        const timespec zero{0, 0};
        (void)sigtimedwait(&pipe_, nullptr, &zero);
      }
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  sigpipe_guard(const sigpipe_guard&) = delete;
  sigpipe_guard& operator=(const sigpipe_guard&) = delete;

 private:
  sigset_t pipe_{}, old_{};
  bool was_pending_ = false;
};

[[nodiscard]] inline timeval to_timeval(duration d) noexcept {
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(d).count();
  return timeval{static_cast<time_t>(us / 1'000'000), static_cast<suseconds_t>(us % 1'000'000)};
}

// The status for an error reply (not NOSCRIPT, which the caller handles).
[[nodiscard]] inline absl::Status redis_error_reply(std::string_view who, std::string_view what, std::string_view err,
                                                    redis_effect effect) {
  const std::string msg = absl::StrCat("keel: ", to_absl(who), ": ", to_absl(what), ": ", to_absl(err));
  const absl::string_view e = to_absl(err);
  if (absl::StartsWith(e, "WRONGPASS") || absl::StartsWith(e, "NOAUTH") || absl::StartsWith(e, "NOPERM") ||
      absl::StrContains(e, "invalid password") || absl::StrContains(e, "invalid username-password"))
    return with_outcome(absl::PermissionDeniedError(msg), outcome_kind::permanent);
  for (std::string_view busy : {"LOADING", "BUSY", "READONLY", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "MISCONF"})
    if (absl::StartsWith(e, to_absl(busy))) return mark_not_started(absl::UnavailableError(msg));
  if (absl::StartsWith(e, "OOM")) return mark_not_started(absl::ResourceExhaustedError(msg));
  if (absl::StartsWith(e, "MOVED") || absl::StartsWith(e, "ASK"))
    return with_outcome(absl::FailedPreconditionError(absl::StrCat(
                            msg, " (a Redis Cluster redirection: connect through a cluster-aware proxy)")),
                        outcome_kind::permanent);
  // A script error: the scripts validate before they write, but stay
  // conservative for writes.
  if (effect == redis_effect::write) return unknown_outcome_error(absl::StrCat(to_absl(who), ": ", to_absl(what)), absl::InternalError(msg));
  return with_outcome(absl::InternalError(msg), outcome_kind::permanent);
}

struct redis_address {
  std::string host;  // a host name or address, or a Unix socket path (starting with '/')
  int port = 6379;
};

struct redis_endpoint {
  std::string host;  // a host name or address, or a Unix socket path (starting with '/')
  int port = 6379;
  std::string username;
  std::string password;
  int database = 0;
  duration connect_timeout{};
  duration command_timeout{};
  // Several servers of one replicated set: when it holds more than one, a
  // connection is made to the one that answers ROLE as a primary (host and
  // port are then unused). `primary_hint` (shared by the connects of one
  // component) is where the last primary was found, tried first.
  std::vector<redis_address> addresses{};
  std::shared_ptr<std::atomic<std::size_t>> primary_hint{};
};

class redis_connection {
 public:
  // A connection to `e`; with several addresses, to the one that answers
  // ROLE as a primary ("master"), starting where the last one was found. A
  // replica, a server that refuses or does not answer is passed over; none
  // answering as a primary is Unavailable, not started, naming each.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<redis_connection>> connect(const redis_endpoint& e,
                                                                                std::string_view who) {
    if (e.addresses.size() <= 1) {
      if (e.addresses.empty()) return connect_one(e, who);
      redis_endpoint one = e;
      one.host = e.addresses[0].host;
      one.port = e.addresses[0].port;
      return connect_one(one, who);
    }
    const std::size_t n = e.addresses.size();
    const std::size_t start = e.primary_hint ? e.primary_hint->load(std::memory_order_relaxed) % n : 0;
    std::string tried;
    for (std::size_t k = 0; k < n; ++k) {
      const std::size_t i = (start + k) % n;
      redis_endpoint one = e;
      one.host = e.addresses[i].host;
      one.port = e.addresses[i].port;
      absl::StatusOr<std::unique_ptr<redis_connection>> c = connect_one(one, who);
      std::string why;
      if (!c.ok()) {
        if (c.status().code() == absl::StatusCode::kPermissionDenied) return c.status();  // the same credentials everywhere
        why = std::string(c.status().message());
      } else {
        absl::StatusOr<redis_reply> role = (*c)->command({"ROLE"}, redis_effect::read, "ROLE");
        if (!role.ok()) {
          why = std::string(role.status().message());
        } else if ((*role)->type == REDIS_REPLY_ARRAY && (*role)->elements > 0 &&
                   (*role)->element[0]->type == REDIS_REPLY_STRING &&
                   std::string_view((*role)->element[0]->str, (*role)->element[0]->len) == "master") {
          if (e.primary_hint) e.primary_hint->store(i, std::memory_order_relaxed);
          return c;
        } else if ((*role)->type == REDIS_REPLY_ERROR) {
          why = absl::StrCat("ROLE refused: ", absl::string_view((*role)->str, (*role)->len));
        } else {
          why = absl::StrCat("a ", (*role)->type == REDIS_REPLY_ARRAY && (*role)->elements > 0
                                       ? absl::string_view((*role)->element[0]->str, (*role)->element[0]->len)
                                       : absl::string_view("server of unknown role"));
        }
      }
      absl::StrAppend(&tried, tried.empty() ? "" : "; ", one.host, ":", one.port, ": ", why);
    }
    return store_unavailable_error(absl::StrCat(to_absl(who), ": no primary among ", n, " servers (", tried, ")"));
  }

  [[nodiscard]] static absl::StatusOr<std::unique_ptr<redis_connection>> connect_one(const redis_endpoint& e,
                                                                                    std::string_view who) {
    const timeval ct = to_timeval(e.connect_timeout);
    std::unique_ptr<redisContext, redis_context_free> c(
        !e.host.empty() && e.host[0] == '/' ? redisConnectUnixWithTimeout(e.host.c_str(), ct)
                                            : redisConnectWithTimeout(e.host.c_str(), e.port, ct));
    if (c == nullptr) return store_unavailable_error(absl::StrCat(to_absl(who), ": cannot allocate a connection"));
    if (c->err != 0)
      return store_unavailable_error(absl::StrCat(to_absl(who), ": cannot connect to ", e.host, ":", e.port, ": ", c->errstr));
    if (redisSetTimeout(c.get(), to_timeval(e.command_timeout)) != REDIS_OK)
      return store_unavailable_error(absl::StrCat(to_absl(who), ": cannot set the command timeout: ", c->errstr));
    std::unique_ptr<redis_connection> conn(new redis_connection(std::move(c), who));
    if (!e.password.empty()) {
      absl::StatusOr<redis_reply> r =
          e.username.empty() ? conn->command({"AUTH", e.password}, redis_effect::read, "AUTH")
                             : conn->command({"AUTH", e.username, e.password}, redis_effect::read, "AUTH");
      if (!r.ok()) return r.status();
      if ((*r)->type == REDIS_REPLY_ERROR)
        return with_outcome(absl::PermissionDeniedError(absl::StrCat("keel: ", to_absl(who), ": authentication refused: ",
                                                                     absl::string_view((*r)->str, (*r)->len))),
                            outcome_kind::permanent);
    }
    if (e.database != 0) {
      const std::string db = std::to_string(e.database);
      absl::StatusOr<redis_reply> r = conn->command({"SELECT", db}, redis_effect::read, "SELECT");
      if (!r.ok()) return r.status();
      if ((*r)->type == REDIS_REPLY_ERROR)
        return redis_error_reply(who, "SELECT", std::string_view((*r)->str, (*r)->len), redis_effect::read);
    }
    return conn;
  }

  redis_connection(const redis_connection&) = delete;
  redis_connection& operator=(const redis_connection&) = delete;

  [[nodiscard]] bool broken() const noexcept { return broken_ || c_->err != 0; }

  // False when the server closed this idle connection: Redis sends nothing
  // unasked, so any readiness on an idle socket is EOF. One poll() syscall.
  [[nodiscard]] bool idle_and_alive() const noexcept {
    if (broken()) return false;
    pollfd p{c_->fd, static_cast<short>(POLLIN | POLLRDHUP), 0};
    return ::poll(&p, 1, 0) == 0;
  }

  // Sends one command and reads its reply (which may be an error reply: the
  // caller decides). A failed exchange marks the connection broken.
  [[nodiscard]] absl::StatusOr<redis_reply> command(int argc, const char** argv, const std::size_t* lens,
                                                    redis_effect effect, std::string_view what) {
    redisReply* r = nullptr;
    int error = 0;
    {
      sigpipe_guard guard;
      r = static_cast<redisReply*>(redisCommandArgv(c_.get(), argc, argv, lens));
      error = errno;
    }
    if (r != nullptr) {
      // A server that is no longer the primary (demoted after a failover):
      // this connection is never useful again; the pool replaces it and the
      // new one goes to whichever server is the primary now.
      if (r->type == REDIS_REPLY_ERROR && (absl::StartsWith(absl::string_view(r->str, r->len), "READONLY") ||
                                          absl::StartsWith(absl::string_view(r->str, r->len), "MASTERDOWN")))
        broken_ = true;
      return redis_reply(r);
    }
    return exchange_failed(error, effect, what);
  }
  [[nodiscard]] absl::StatusOr<redis_reply> command(std::initializer_list<std::string_view> args, redis_effect effect,
                                                    std::string_view what) {
    std::array<const char*, 8> argv{};
    std::array<std::size_t, 8> lens{};
    int n = 0;
    for (std::string_view a : args) {
      argv[n] = a.data();
      lens[n] = a.size();
      ++n;
    }
    return command(n, argv.data(), lens.data(), effect, what);
  }

  // EVALSHA, and EVAL with the source when the server does not have the
  // script (NOSCRIPT: nothing ran, so re-sending is safe). `args` are
  // {keys..., argv...}: `keys` keys (1-9, one by default; several only when
  // they share a hash tag, so a Redis Cluster keeps them in one slot).
  // Error replies come back as statuses.
  template <std::size_t N>
  [[nodiscard]] absl::StatusOr<redis_reply> eval(const redis_script& s, const std::array<std::string_view, N>& args,
                                                 redis_effect effect, std::string_view what, int keys = 1) {
    static constexpr const char* counts[] = {"0", "1", "2", "3", "4", "5", "6", "7", "8", "9"};
    std::array<const char*, N + 3> argv{};
    std::array<std::size_t, N + 3> lens{};
    argv[0] = "EVALSHA";
    lens[0] = 7;
    argv[1] = s.sha().data();
    lens[1] = s.sha().size();
    argv[2] = counts[keys >= 1 && keys <= 9 ? keys : 1];
    lens[2] = 1;
    for (std::size_t i = 0; i < N; ++i) {
      argv[i + 3] = args[i].data() == nullptr ? "" : args[i].data();
      lens[i + 3] = args[i].size();
    }
    absl::StatusOr<redis_reply> r = command(static_cast<int>(N + 3), argv.data(), lens.data(), effect, what);
    if (!r.ok()) return r;
    if ((*r)->type == REDIS_REPLY_ERROR && absl::StartsWith(absl::string_view((*r)->str, (*r)->len), "NOSCRIPT")) {
      ++script_loads_;
      argv[0] = "EVAL";
      lens[0] = 4;
      argv[1] = s.source().data();
      lens[1] = s.source().size();
      r = command(static_cast<int>(N + 3), argv.data(), lens.data(), effect, what);
      if (!r.ok()) return r;
    }
    if ((*r)->type == REDIS_REPLY_ERROR)
      return redis_error_reply(who_, what, std::string_view((*r)->str, (*r)->len), effect);
    return r;
  }

  // eval(), then, in the same write (one round trip), PUBLISH <channel> ""
  // and WAIT <replicas> <timeout_ms>: the script's reply and how many
  // replicas WAIT counted. PUBLISH is replicated, so this connection's
  // replication offset is the end of the stream when WAIT starts: WAIT then
  // covers the script's own write and every write it read (a replayed
  // decision another client committed), even when the script wrote nothing.
  // The socket timeout (command_timeout) must exceed `timeout_ms`.
  template <std::size_t N>
  [[nodiscard]] absl::StatusOr<std::pair<redis_reply, long long>> eval_replicated(
      const redis_script& s, const std::array<std::string_view, N>& args, redis_effect effect, std::string_view what,
      std::string_view channel, int replicas, long long timeout_ms) {
    std::array<const char*, N + 3> argv{};
    std::array<std::size_t, N + 3> lens{};
    argv[0] = "EVALSHA";
    lens[0] = 7;
    argv[1] = s.sha().data();
    lens[1] = s.sha().size();
    argv[2] = "1";
    lens[2] = 1;
    for (std::size_t i = 0; i < N; ++i) {
      argv[i + 3] = args[i].data() == nullptr ? "" : args[i].data();
      lens[i + 3] = args[i].size();
    }
    const std::string n = std::to_string(replicas), t = std::to_string(timeout_ms);
    const char* pub[] = {"PUBLISH", channel.data(), ""};
    const std::size_t pub_lens[] = {7, channel.size(), 0};
    const char* wait[] = {"WAIT", n.c_str(), t.c_str()};
    const std::size_t wait_lens[] = {4, n.size(), t.size()};
    for (int attempt = 0;; ++attempt) {
      std::array<redisReply*, 3> got{};
      int error = 0;
      bool ok = true;
      {
        sigpipe_guard guard;
        ok = redisAppendCommandArgv(c_.get(), static_cast<int>(N + 3), argv.data(), lens.data()) == REDIS_OK &&
             redisAppendCommandArgv(c_.get(), 3, pub, pub_lens) == REDIS_OK &&
             redisAppendCommandArgv(c_.get(), 3, wait, wait_lens) == REDIS_OK;
        for (std::size_t i = 0; ok && i < got.size(); ++i) {
          void* r = nullptr;
          ok = redisGetReply(c_.get(), &r) == REDIS_OK && r != nullptr;
          got[i] = static_cast<redisReply*>(r);
        }
        error = errno;
      }
      redis_reply script(got[0]), published(got[1]), waited(got[2]);
      if (!ok) return exchange_failed(error, effect, what);
      if (script->type == REDIS_REPLY_ERROR && attempt == 0 &&
          absl::StartsWith(absl::string_view(script->str, script->len), "NOSCRIPT")) {
        ++script_loads_;
        argv[0] = "EVAL";
        lens[0] = 4;
        argv[1] = s.source().data();
        lens[1] = s.source().size();
        continue;
      }
      if (script->type == REDIS_REPLY_ERROR) {
        if (absl::StartsWith(absl::string_view(script->str, script->len), "READONLY")) broken_ = true;
        return redis_error_reply(who_, what, std::string_view(script->str, script->len), effect);
      }
      const long long acked = waited->type == REDIS_REPLY_INTEGER ? waited->integer : -1;
      return std::pair<redis_reply, long long>(std::move(script), acked);
    }
  }

  // Scripts sent in full because the server did not know them.
  [[nodiscard]] std::uint64_t script_loads() const noexcept { return script_loads_; }

 private:
  redis_connection(std::unique_ptr<redisContext, redis_context_free> c, std::string_view who)
      : c_(std::move(c)), who_(who) {}

  // A command sent (or being sent) whose reply did not come: the connection
  // is broken; for a write its effect is unknown.
  absl::Status exchange_failed(int error, redis_effect effect, std::string_view what) {
    broken_ = true;
    const bool timeout = c_->err == REDIS_ERR_IO && (error == EAGAIN || error == EWOULDBLOCK);
    const absl::Status cause =
        timeout ? absl::DeadlineExceededError(absl::StrCat("keel: ", who_, ": ", to_absl(what), ": no reply within the command timeout"))
                : absl::UnavailableError(absl::StrCat("keel: ", who_, ": ", to_absl(what), ": connection lost: ", c_->errstr));
    if (effect == redis_effect::write) return unknown_outcome_error(absl::StrCat(who_, ": ", to_absl(what)), cause);
    return cause;
  }

  std::unique_ptr<redisContext, redis_context_free> c_;
  std::string who_;
  bool broken_ = false;
  std::uint64_t script_loads_ = 0;
};

// Reply accessors (scripts answer arrays of integers and bulk strings).
[[nodiscard]] inline std::int64_t reply_int(const redisReply* r, std::size_t i) noexcept {
  if (r->type != REDIS_REPLY_ARRAY || i >= r->elements) return 0;
  const redisReply* e = r->element[i];
  return e->type == REDIS_REPLY_INTEGER ? static_cast<std::int64_t>(e->integer) : 0;
}
[[nodiscard]] inline std::string_view reply_str(const redisReply* r, std::size_t i) noexcept {
  if (r->type != REDIS_REPLY_ARRAY || i >= r->elements) return {};
  const redisReply* e = r->element[i];
  return e->type == REDIS_REPLY_STRING || e->type == REDIS_REPLY_STATUS ? std::string_view(e->str, e->len)
                                                                          : std::string_view();
}

}  // namespace keel::detail
