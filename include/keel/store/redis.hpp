// keel/store/redis.hpp — idempotency records, leases and results in Redis,
// shared by every replica of a service. Link keel::redis (hiredis).
//
// keel::redis_store implements keel::idempotency_store, keel::lease_store
// and keel::result_store (docs/stores.md has the contracts; docs/scaleout.md
// the operational side):
//
//   - every begin, claim, extend, renew, commit, abandon, release, save and
//     load is ONE Lua script on ONE key (EVALSHA; the source is sent with
//     EVAL only when the server answers NOSCRIPT), so it is atomic on the
//     server, checks owner and fence before writing, and costs one round
//     trip;
//   - time is the server's: TIME inside each script (microseconds);
//   - each record, lease or result is one hash holding its own fence, under
//     a key with a hash tag ("<prefix>idem:{...}"), so it maps to one slot;
//   - Redis expires dead keys itself: each write sets PEXPIRE to the end of
//     what the key must remember plus forget_after;
//   - fences never go backwards: a key with no hash (new, or forgotten)
//     starts from the server clock in microseconds, above every fence it had
//     before it was forgotten (keel/store/internal/redis_scripts.hpp says why); a
//     key the store still has goes up by 1 per new owner;
//   - a bounded pool of connections (pool_size), each lent to one thread at
//     a time; a connection timeout and a command timeout on every command;
//     an idle connection the server closed is noticed before use and replaced.
//
// Durability is the server's configuration: only AOF with appendfsync
// always makes a committed decision survive a crash of the Redis process or
// machine (everysec may lose the last second; no AOF loses everything since
// the last snapshot). durability() reports what the server said at open;
// require_aof_always refuses to open on anything weaker. Replication is
// asynchronous: after a failover the new primary may lack the last writes —
// a decision may be made again, a lease or an in-flight claim may vanish
// and be granted again, and with sequential fences a key the replica has at
// an older state continues from that state's fence, which the lost writes
// may already have used. keel's owner check still refuses the stale holder;
// for downstream fence checks choose fences = redis_fences::from_clock (a
// fence is never handed out twice), and for decisions wait_replicas (the
// script, a PUBLISH and WAIT in one round trip: nothing acknowledged is
// lost; too few replicas is unknown_outcome). With several servers in
// `endpoints` each connection goes to the one answering ROLE as primary, so
// the store follows a promotion by itself. docs/scaleout.md, "Failover",
// has what each combination keeps, measured.
//
// Values and keys always travel as command arguments (never in script text).
//
// Errors (see keel/store/internal/redis_connection.hpp for the mapping):
//
//   keel::store_unavailable_error   cannot connect, every connection busy past
//                                   acquire_timeout, or refused before running
//                                   (LOADING, BUSY, READONLY, ...): safe to repeat
//   keel::unknown_outcome_error     a write whose connection dropped or timed out
//                                   after it was sent: it may have run; repeat it
//                                   (rule 7 of docs/stores.md) or begin again
//   Unavailable / DeadlineExceeded  the same for a read (load_result)
//   PermissionDenied                AUTH refused (permanent)
//   FailedPrecondition              require_aof_always and the server is not
//
// Example:
//
//   absl::StatusOr<std::unique_ptr<keel::redis_store>> store =
//       keel::redis_store::open({.host = "redis.internal", .port = 6379, .key_prefix = "receipts:"});
//   if (!store.ok()) return store.status();
//   keel::once decide(**store, {.lease = std::chrono::seconds(30)});
//
// Thread-safety: every operation may be called from any number of threads;
// at most pool_size commands run at once. Do not carry a store across
// fork(): open a new one in the child.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "keel/core/clock.hpp"
#include "keel/core/status.hpp"
#include "keel/store/internal/client_pool.hpp"
#include "keel/store/internal/redis_connection.hpp"
#include "keel/store/internal/redis_scripts.hpp"
#include "keel/store/internal/stored_record.hpp"
#include "keel/durable/digest.hpp"
#include "keel/durable/idempotency.hpp"
#include "keel/durable/lease.hpp"
#include "keel/durable/ownership.hpp"
#include "keel/durable/result_store.hpp"

namespace keel {

// What the server's persistence settings let a committed record survive.
enum class redis_durability {
  unknown,       // CONFIG GET was refused (a managed service): ask the provider
  none,          // no AOF: a restart loses everything since the last snapshot
  aof_everysec,  // AOF fsynced every second: a crash may lose the last second
  aof_always,    // AOF fsynced before each write is acknowledged
};

[[nodiscard]] constexpr std::string_view to_string(redis_durability d) noexcept {
  switch (d) {
    case redis_durability::unknown: return "unknown";
    case redis_durability::none: return "none";
    case redis_durability::aof_everysec: return "aof-everysec";
    case redis_durability::aof_always: return "aof-always";
  }
  return "unknown";
}

// How a new owner's fence is made (docs/stores.md, rule 4; docs/scaleout.md,
// "Failover").
enum class redis_fences {
  // The previous fence + 1, as on every backend. After a failover to a
  // replica that lacks the last writes, a fence the lost writes handed out
  // can be handed out again.
  sequential,
  // max(previous + 1, the server's clock in microseconds). Fences are then
  // times: a fence handed out by a primary that is lost is below every
  // fence its promoted replica hands out later, as long as the replica's
  // clock is not behind the old primary's by more than the failover took
  // (seconds, where NTP keeps clocks within milliseconds). Fences grow by
  // more than 1 per owner (they are about 1.8e15); nothing else changes.
  from_clock,
};

struct redis_options {
  // A host name or address, or a Unix socket path (starting with '/').
  std::string host = "127.0.0.1";
  int port = 6379;  // [1, 65535]
  // Several servers of one replicated set (a primary and its replicas),
  // instead of host and port: each new connection goes to the one that
  // answers ROLE as a primary, and a connection whose server answers
  // READONLY (demoted) is dropped and made again. Failing over is the
  // operator's (REPLICAOF NO ONE) or Sentinel's; keel follows. At most 16.
  std::vector<detail::redis_address> endpoints{};
  // ACL user (Redis 6+); empty: the default user. Sent with AUTH when a password is set.
  std::string username{};
  std::string password{};
  int database = 0;  // SELECT; >= 0
  // Every key starts with this; at most 128 bytes, no '{' or '}' (the hash tag follows it).
  std::string key_prefix = "keel:";
  int pool_size = 8;  // [1, 1000]
  duration connect_timeout = std::chrono::seconds(2);  // [1 ms, 1 h]
  duration command_timeout = std::chrono::seconds(2);  // [1 ms, 1 h]
  duration acquire_timeout = std::chrono::seconds(2);  // [0, 1 h]
  // How long a key is kept after its record, lease or result ends; [1 s,
  // 365 days]. A forgotten key's next fence still starts above its old ones.
  duration forget_after = std::chrono::hours(24);
  // Refuse to open unless the server runs AOF with appendfsync always.
  bool require_aof_always = false;
  // How a new owner's fence is made (redis_store only; see redis_fences).
  redis_fences fences = redis_fences::sequential;
  // redis_store only: after every write, WAIT until this many replicas have
  // everything the script wrote or read (one round trip with the script);
  // fewer within wait_timeout is keel::unknown_outcome_error (the primary
  // has it; a failover may lose it: repeat it). 0: do not wait. [0, 16]
  int wait_replicas = 0;
  // [1 ms, command_timeout): WAIT's own limit, below the socket timeout.
  duration wait_timeout = std::chrono::milliseconds(500);
  // Tests only: nanoseconds added to the server's TIME inside every
  // script, shared by every store given the same pointer. Leave empty in production.
  std::shared_ptr<std::atomic<std::int64_t>> testing_clock_offset{};

  // Where and how to connect, for detail::redis_connection (make it once per
  // component: its connects share where the primary was last found).
  [[nodiscard]] detail::redis_endpoint endpoint() const {
    return {.host = host,
            .port = port,
            .username = username,
            .password = password,
            .database = database,
            .connect_timeout = connect_timeout,
            .command_timeout = command_timeout,
            .addresses = endpoints,
            .primary_hint = std::make_shared<std::atomic<std::size_t>>(0)};
  }
  // "host:port", or every endpoint's, for messages.
  [[nodiscard]] std::string where() const {
    if (endpoints.empty()) return absl::StrCat(host, ":", port);
    std::string out;
    for (const detail::redis_address& a : endpoints) absl::StrAppend(&out, out.empty() ? "" : ",", a.host, ":", a.port);
    return out;
  }

  [[nodiscard]] absl::Status validate() const {
    constexpr std::string_view who = "redis_options";
    if (host.empty()) return detail::invalid_field(who, "host", "not be empty", "\"\"");
    if (endpoints.size() > 16) return detail::invalid_field(who, "endpoints", "hold at most 16 servers", endpoints.size());
    for (const detail::redis_address& a : endpoints) {
      if (a.host.empty()) return detail::invalid_field(who, "endpoints", "name a host for every server", "\"\"");
      if (a.host[0] != '/' && (a.port < 1 || a.port > 65535))
        return detail::invalid_field(who, "endpoints", "have ports in [1, 65535]", a.port);
    }
    if (wait_replicas < 0 || wait_replicas > 16)
      return detail::invalid_field(who, "wait_replicas", "be in [0, 16]", wait_replicas);
    if (wait_replicas > 0 && (wait_timeout < std::chrono::milliseconds(1) || wait_timeout >= command_timeout))
      return detail::invalid_field(who, "wait_timeout", "be in [1ms, command_timeout) when wait_replicas > 0",
                                   wait_timeout);
    if (host[0] != '/' && (port < 1 || port > 65535)) return detail::invalid_field(who, "port", "be in [1, 65535]", port);
    if (database < 0) return detail::invalid_field(who, "database", "be >= 0", database);
    if (key_prefix.size() > 128) return detail::invalid_field(who, "key_prefix", "be at most 128 bytes", key_prefix.size());
    if (key_prefix.find_first_of("{}") != std::string::npos)
      return detail::invalid_field(who, "key_prefix", "not contain '{' or '}'", absl::StrCat("\"", key_prefix, "\""));
    if (pool_size < 1 || pool_size > 1000) return detail::invalid_field(who, "pool_size", "be in [1, 1000]", pool_size);
    if (connect_timeout < std::chrono::milliseconds(1) || connect_timeout > std::chrono::hours(1))
      return detail::invalid_field(who, "connect_timeout", "be in [1ms, 1h]", connect_timeout);
    if (command_timeout < std::chrono::milliseconds(1) || command_timeout > std::chrono::hours(1))
      return detail::invalid_field(who, "command_timeout", "be in [1ms, 1h]", command_timeout);
    if (acquire_timeout < duration::zero() || acquire_timeout > std::chrono::hours(1))
      return detail::invalid_field(who, "acquire_timeout", "be in [0, 1h]", acquire_timeout);
    if (forget_after < std::chrono::seconds(1) || forget_after > std::chrono::hours(24 * 365))
      return detail::invalid_field(who, "forget_after", "be in [1s, 365 days]", forget_after);
    return absl::OkStatus();
  }
};

namespace detail {

// Durations go to the scripts in whole microseconds, at least 1, capped so
// that now + d stays exact in a Lua double.
[[nodiscard]] constexpr std::int64_t redis_us(duration d) noexcept {
  const std::int64_t us = (to_ns(d) + 999) / 1000;
  return std::clamp<std::int64_t>(us, 1, 4'000'000'000'000'000);
}

// A decimal integer argument without allocating.
class redis_num {
 public:
  explicit redis_num(std::int64_t v) noexcept {
    const auto r = std::to_chars(buf_.data(), buf_.data() + buf_.size(), v);
    len_ = static_cast<std::size_t>(r.ptr - buf_.data());
  }
  [[nodiscard]] std::string_view view() const noexcept { return {buf_.data(), len_}; }

 private:
  std::array<char, 24> buf_{};
  std::size_t len_ = 0;
};

// A key built on the stack: the longest one (a 128-byte prefix, "idem:{",
// three 255-byte parts with their lengths, "}") fits in 1 KiB, so a store
// operation allocates no key string.
class redis_key {
 public:
  redis_key& add(std::string_view s) noexcept {
    const std::size_t n = std::min(s.size(), buf_.size() - len_);
    std::copy_n(s.data(), n, buf_.data() + len_);
    len_ += n;
    return *this;
  }
  redis_key& add_length(std::size_t v) noexcept {
    const auto r = std::to_chars(buf_.data() + len_, buf_.data() + buf_.size(), v);
    len_ = static_cast<std::size_t>(r.ptr - buf_.data());
    return add(":");
  }
  [[nodiscard]] std::string_view view() const noexcept { return {buf_.data(), len_}; }

 private:
  std::array<char, 1024> buf_;
  std::size_t len_ = 0;
};

// The store's keys (what redis_store::record_key, lease_key and
// result_key return): the prefix, the kind, then the identity inside one
// hash tag. The record's parts are length-prefixed, so no two identities
// share a key whatever bytes ({, }, :) they hold; the prefix may not hold
// '{', so the text before the first '{' is always prefix + kind + ':'.
// (tests/fuzz/store_keys_fuzz.cpp checks both.)
[[nodiscard]] inline redis_key redis_record_key(std::string_view prefix, const request_identity& id) noexcept {
  redis_key k;
  k.add(prefix).add("idem:{").add_length(id.tenant.size()).add(id.tenant);
  k.add_length(id.endpoint.size()).add(id.endpoint).add_length(id.key.size()).add(id.key).add("}");
  return k;
}
[[nodiscard]] inline redis_key redis_lease_key(std::string_view prefix, std::string_view work_key) noexcept {
  redis_key k;
  k.add(prefix).add("lease:{").add(work_key).add("}");
  return k;
}
[[nodiscard]] inline redis_key redis_result_key(std::string_view prefix, std::string_view key) noexcept {
  redis_key k;
  k.add(prefix).add("result:{").add(key).add("}");
  return k;
}

// Microseconds from a script as a duration, saturating (a damaged hash can
// make a script answer any number).
[[nodiscard]] constexpr duration redis_from_us(std::int64_t us) noexcept {
  constexpr std::int64_t limit = INT64_MAX / 1000;
  return std::chrono::duration_cast<duration>(std::chrono::nanoseconds(std::clamp(us, -limit, limit) * 1000));
}

// The shape of a script reply: an array of `n` elements (at least), element
// i of type t (REDIS_REPLY_INTEGER or REDIS_REPLY_STRING).
[[nodiscard]] inline bool reply_is(const redisReply* r, std::size_t i, int t) noexcept {
  return r != nullptr && r->type == REDIS_REPLY_ARRAY && i < r->elements && r->element[i] != nullptr &&
         r->element[i]->type == t;
}

// What the begin script's reply means (redis_lua_begin lists the replies),
// checked before it is trusted: a reply of another shape (a damaged hash
// makes Lua drop the array's tail at its first nil), a fence no claim could
// have issued, or a replayed decision commit() would refuse is DataLoss
// naming the record (detail/stored_record.hpp). `who` names the store.
[[nodiscard]] inline absl::StatusOr<begin_outcome> redis_begin_outcome(const redisReply* x, const request_identity& id,
                                                                       const owner_id& owner, const begin_options& o,
                                                                       std::string_view who) {
  const auto damaged = [&](std::string_view why) { return stored_damage(who, record_words(id), why); };
  if (!reply_is(x, 0, REDIS_REPLY_INTEGER) || !reply_is(x, 1, REDIS_REPLY_INTEGER))
    return damaged("the begin script's reply is not {kind, fence, ...}");
  const std::int64_t kind = reply_int(x, 0);
  const std::int64_t fence = reply_int(x, 1);
  if (std::string why = stored_fence_problem(fence); !why.empty()) return damaged(why);
  const auto ints = [&](std::initializer_list<std::size_t> cols) {
    for (std::size_t c : cols)
      if (!reply_is(x, c, REDIS_REPLY_INTEGER)) return false;
    return true;
  };
  switch (kind) {
    case 0: {
      if (!ints({2, 3})) return damaged("a claim reply is not {0, fence, lease left, how}");
      const std::int64_t how = reply_int(x, 3);
      begin_outcome out{.state = begin_state::claimed, .ownership = {owner, fence}};
      out.took_over = how == 1;
      out.superseded = how == 2;
      out.lease_remaining = how == 3 ? redis_from_us(reply_int(x, 2)) : o.lease;
      return out;
    }
    case 1:
      if (!ints({2})) return damaged("an in-flight reply is not {1, fence, lease left}");
      return begin_outcome{.state = begin_state::in_flight,
                           .ownership = {.owner = {}, .fence = fence},
                           .lease_remaining = redis_from_us(reply_int(x, 2))};
    case 2: {
      if (!ints({2, 3})) return damaged("committed at or error code is not a number");
      for (std::size_t c = 4; c <= 8; ++c)
        if (!reply_is(x, c, REDIS_REPLY_STRING)) return damaged("a decision field is missing");
      const std::int64_t at_us = reply_int(x, 2), code = reply_int(x, 3);
      if (at_us < INT64_MIN / 1000 || at_us > INT64_MAX / 1000)
        return damaged(absl::StrCat("commit time ", at_us, " us is out of range"));
      if (!known_status_code(code)) return damaged(absl::StrCat("error code ", code, " is not a status code"));
      begin_outcome out{.state = begin_state::replay, .ownership = {.owner = {}, .fence = fence}};
      out.committed_at_ns = at_us * 1000;
      out.decision.error_code = static_cast<absl::StatusCode>(code);
      out.decision.id = std::string(reply_str(x, 4));
      out.decision.model_digest = std::string(reply_str(x, 5));
      out.decision.policy_revision = std::string(reply_str(x, 6));
      out.decision.result = std::string(reply_str(x, 7));
      out.decision.error_message = std::string(reply_str(x, 8));
      if (std::string why = stored_decision_problem(out.decision); !why.empty()) return damaged(why);
      return out;
    }
    case 3: {
      if (!ints({3})) return damaged("a conflict reply is not {3, fence, 0, state}");
      begin_outcome out{.state = begin_state::conflict};
      out.conflict_in_flight = reply_int(x, 3) == 0;
      return out;
    }
    default:
      return damaged(absl::StrCat("the begin script answered kind ", kind));
  }
}

// What the claim script's reply means (redis_lua_claim), checked the same way.
[[nodiscard]] inline absl::StatusOr<lease_claim> redis_claim_outcome(const redisReply* x, std::string_view work_key,
                                                                     const owner_id& owner, duration ttl,
                                                                     std::string_view who) {
  const auto damaged = [&](std::string_view why) {
    return stored_damage(who, absl::StrCat("the lease of work key '", to_absl(work_key), "'"), why);
  };
  if (!reply_is(x, 0, REDIS_REPLY_INTEGER) || !reply_is(x, 1, REDIS_REPLY_INTEGER) ||
      !reply_is(x, 2, REDIS_REPLY_INTEGER))
    return damaged("the claim script's reply is not {acquired, fence, left, ...}");
  const std::int64_t fence = reply_int(x, 1);
  if (std::string why = stored_fence_problem(fence); !why.empty()) return damaged(why);
  if (reply_int(x, 0) == 1) {
    if (!reply_is(x, 3, REDIS_REPLY_INTEGER)) return damaged("an acquired reply is not {1, fence, left, how}");
    const std::int64_t how = reply_int(x, 3);
    return lease_claim{.acquired = true,
                       .ownership = {owner, fence},
                       .took_over = how == 1,
                       .remaining = how == 3 ? redis_from_us(reply_int(x, 2)) : ttl};
  }
  if (reply_int(x, 0) != 0) return damaged(absl::StrCat("the claim script answered ", reply_int(x, 0)));
  return lease_claim{.acquired = false, .ownership = {.owner = {}, .fence = fence}, .remaining = redis_from_us(reply_int(x, 2))};
}

struct redis_store_scripts {
  redis_script begin, extend, commit, abandon, claim, renew, release, save, load;

  static const redis_store_scripts& get(redis_fences f = redis_fences::sequential) {
    static const redis_store_scripts sequential = make(redis_lua_fence_sequential);
    static const redis_store_scripts from_clock = make(redis_lua_fence_from_clock);
    return f == redis_fences::from_clock ? from_clock : sequential;
  }

 private:
  static redis_store_scripts make(const char* fence) {
    const std::string p = absl::StrCat(redis_lua_prelude, fence);
    return redis_store_scripts{
        redis_script(absl::StrCat(p, redis_lua_begin)),
        redis_script(absl::StrCat(p, redis_lua_record_check, redis_lua_extend)),
        redis_script(absl::StrCat(p, redis_lua_record_check, redis_lua_commit)),
        redis_script(absl::StrCat(p, redis_lua_record_check, redis_lua_abandon)),
        redis_script(absl::StrCat(p, redis_lua_claim)),
        redis_script(absl::StrCat(p, redis_lua_lease_check, redis_lua_renew)),
        redis_script(absl::StrCat(p, redis_lua_lease_check, redis_lua_release)),
        redis_script(absl::StrCat(p, redis_lua_save)),
        redis_script(absl::StrCat(p, redis_lua_load)),
    };
  }
};

}  // namespace detail

class redis_store {
 public:
  // Connects, checks the server answers (and its durability).
  //
  //   InvalidArgument     invalid options
  //   Unavailable         the server cannot be reached (not started)
  //   PermissionDenied    AUTH refused
  //   FailedPrecondition  require_aof_always and the server does not run AOF with appendfsync always
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<redis_store>> open(redis_options o) {
    if (absl::Status v = o.validate(); !v.ok()) return v;
    std::unique_ptr<redis_store> s(new redis_store(std::move(o)));
    if (absl::Status st = s->initialise(); !st.ok()) return st;
    return s;
  }

  redis_store(const redis_store&) = delete;
  redis_store& operator=(const redis_store&) = delete;
  ~redis_store() = default;

  [[nodiscard]] const redis_options& options() const noexcept { return options_; }
  // What the server's persistence settings were at open.
  [[nodiscard]] redis_durability durability() const noexcept { return durability_; }
  // Commands sent for store operations (each one round trip; a NOSCRIPT
  // answer makes it two), over the store's life.
  [[nodiscard]] std::uint64_t round_trips() const noexcept { return round_trips_.load(std::memory_order_relaxed); }
  [[nodiscard]] std::size_t connections() const { return pool_.open(); }

  // The keys this store uses (for operators and tests):
  // <prefix>idem:{<len>:<tenant><len>:<endpoint><len>:<key>}, <prefix>lease:{<work key>},
  // <prefix>result:{<key>}. Lengths keep the parts apart.
  [[nodiscard]] std::string record_key(const request_identity& id) const { return std::string(record_key_of(id).view()); }
  [[nodiscard]] std::string lease_key(std::string_view work_key) const {
    return std::string(lease_key_of(work_key).view());
  }
  [[nodiscard]] std::string result_key(std::string_view key) const { return std::string(result_key_of(key).view()); }

  // ---- idempotency_store ---------------------------------------------------

  [[nodiscard]] absl::StatusOr<begin_outcome> begin(const request_identity& id, const digest& request,
                                                    const owner_id& owner, const begin_options& o) {
    if (absl::Status v = id.validate(); !v.ok()) return v;
    if (absl::Status v = o.validate(); !v.ok()) return v;
    if (owner.is_nil()) return absl::InvalidArgumentError("keel: owner must not be nil");
    const detail::redis_key key_buf = record_key_of(id);
    const std::string_view key = key_buf.view();
    const auto ob = owner.bytes();
    const detail::redis_num off(offset_us()), lease(detail::redis_us(o.lease)), ret(detail::redis_us(o.retention)),
        forget(detail::redis_us(options_.forget_after));
    absl::StatusOr<detail::redis_reply> r =
        run(scripts().begin,
            std::array<std::string_view, 8>{key, off.view(), request.view(), bytes_of(ob), lease.view(), ret.view(),
                                            o.supersede_revision, forget.view()},
            detail::redis_effect::write, "begin");
    if (!r.ok()) return r.status();
    return detail::redis_begin_outcome(r->get(), id, owner, o, who_);
  }

  [[nodiscard]] absl::Status extend(const request_identity& id, const ownership& token, duration ttl) {
    if (absl::Status v = id.validate(); !v.ok()) return v;
    if (ttl <= duration::zero()) return detail::invalid_field("extend", "ttl", "be > 0", ttl);
    const detail::redis_key key_buf = record_key_of(id);
    const std::string_view key = key_buf.view();
    const auto ob = token.owner.bytes();
    const detail::redis_num off(offset_us()), fence(token.fence), t(detail::redis_us(ttl)),
        forget(detail::redis_us(options_.forget_after));
    return fenced_record(scripts().extend,
                         std::array<std::string_view, 6>{key, off.view(), bytes_of(ob), fence.view(), t.view(),
                                                         forget.view()},
                         token, "extend");
  }

  [[nodiscard]] absl::Status commit(const request_identity& id, const ownership& token, const decision& d,
                                    duration retention) {
    if (absl::Status v = id.validate(); !v.ok()) return v;
    if (absl::Status v = d.validate(); !v.ok()) return v;
    if (retention <= duration::zero()) return detail::invalid_field("commit", "retention", "be > 0", retention);
    const detail::redis_key key_buf = record_key_of(id);
    const std::string_view key = key_buf.view();
    const auto ob = token.owner.bytes();
    const detail::redis_num off(offset_us()), fence(token.fence), code(static_cast<std::int64_t>(d.error_code)),
        ret(detail::redis_us(retention)), forget(detail::redis_us(options_.forget_after));
    return fenced_record(scripts().commit,
                         std::array<std::string_view, 12>{key, off.view(), bytes_of(ob), fence.view(), d.id,
                                                          d.model_digest, d.policy_revision, d.result, code.view(),
                                                          d.error_message, ret.view(), forget.view()},
                         token, "commit");
  }

  [[nodiscard]] absl::Status abandon(const request_identity& id, const ownership& token) {
    if (absl::Status v = id.validate(); !v.ok()) return v;
    const detail::redis_key key_buf = record_key_of(id);
    const std::string_view key = key_buf.view();
    const auto ob = token.owner.bytes();
    const detail::redis_num off(offset_us()), fence(token.fence), forget(detail::redis_us(options_.forget_after));
    return fenced_record(scripts().abandon,
                         std::array<std::string_view, 5>{key, off.view(), bytes_of(ob), fence.view(), forget.view()},
                         token, "abandon");
  }

  // ---- lease_store ---------------------------------------------------------

  [[nodiscard]] absl::StatusOr<lease_claim> claim(std::string_view work_key, const owner_id& owner, duration ttl) {
    if (absl::Status v = validate_key("work key", work_key); !v.ok()) return v;
    if (ttl <= duration::zero()) return detail::invalid_field("claim", "ttl", "be > 0", ttl);
    if (owner.is_nil()) return absl::InvalidArgumentError("keel: owner must not be nil");
    const detail::redis_key key_buf = lease_key_of(work_key);
    const std::string_view key = key_buf.view();
    const auto ob = owner.bytes();
    const detail::redis_num off(offset_us()), t(detail::redis_us(ttl)), forget(detail::redis_us(options_.forget_after));
    absl::StatusOr<detail::redis_reply> r =
        run(scripts().claim,
            std::array<std::string_view, 5>{key, off.view(), bytes_of(ob), t.view(), forget.view()},
            detail::redis_effect::write, "claim");
    if (!r.ok()) return r.status();
    return detail::redis_claim_outcome(r->get(), work_key, owner, ttl, who_);
  }

  [[nodiscard]] absl::Status renew(std::string_view work_key, const ownership& token, duration ttl) {
    if (absl::Status v = validate_key("work key", work_key); !v.ok()) return v;
    if (ttl <= duration::zero()) return detail::invalid_field("renew", "ttl", "be > 0", ttl);
    const detail::redis_key key_buf = lease_key_of(work_key);
    const std::string_view key = key_buf.view();
    const auto ob = token.owner.bytes();
    const detail::redis_num off(offset_us()), fence(token.fence), t(detail::redis_us(ttl)),
        forget(detail::redis_us(options_.forget_after));
    return fenced_lease(scripts().renew,
                        std::array<std::string_view, 6>{key, off.view(), bytes_of(ob), fence.view(), t.view(),
                                                        forget.view()},
                        token, "renew");
  }

  [[nodiscard]] absl::Status release(std::string_view work_key, const ownership& token) {
    if (absl::Status v = validate_key("work key", work_key); !v.ok()) return v;
    const detail::redis_key key_buf = lease_key_of(work_key);
    const std::string_view key = key_buf.view();
    const auto ob = token.owner.bytes();
    const detail::redis_num off(offset_us()), fence(token.fence), forget(detail::redis_us(options_.forget_after));
    return fenced_lease(scripts().release,
                        std::array<std::string_view, 5>{key, off.view(), bytes_of(ob), fence.view(), forget.view()},
                        token, "release");
  }

  // ---- result_store --------------------------------------------------------

  [[nodiscard]] absl::StatusOr<bool> save_result(std::string_view key, std::string_view value, duration retention) {
    if (absl::Status v = validate_key("result key", key); !v.ok()) return v;
    if (retention < duration::zero())
      return detail::invalid_field("save_result", "retention", "be >= 0", retention);
    const detail::redis_key key_buf = result_key_of(key);
    const std::string_view k = key_buf.view();
    const detail::redis_num off(offset_us()),
        ret(retention == duration::zero() ? 0 : detail::redis_us(retention)), grace(1'000'000);
    absl::StatusOr<detail::redis_reply> r =
        run(scripts().save,
            std::array<std::string_view, 5>{k, off.view(), value, ret.view(), grace.view()}, detail::redis_effect::write,
            "save_result");
    if (!r.ok()) return r.status();
    return (*r)->type == REDIS_REPLY_INTEGER && (*r)->integer == 1;
  }

  [[nodiscard]] absl::StatusOr<std::optional<std::string>> load_result(std::string_view key) {
    if (absl::Status v = validate_key("result key", key); !v.ok()) return v;
    const detail::redis_key key_buf = result_key_of(key);
    const std::string_view k = key_buf.view();
    const detail::redis_num off(offset_us());
    absl::StatusOr<detail::redis_reply> r = run(scripts().load,
                                                std::array<std::string_view, 2>{k, off.view()},
                                                detail::redis_effect::read, "load_result");
    if (!r.ok()) return r.status();
    if ((*r)->type != REDIS_REPLY_STRING) return std::optional<std::string>();
    return std::optional<std::string>(std::string((*r)->str, (*r)->len));
  }

  [[nodiscard]] absl::Status erase_result(std::string_view key) {
    if (absl::Status v = validate_key("result key", key); !v.ok()) return v;
    const detail::redis_key key_buf = result_key_of(key);
    const std::string_view k = key_buf.view();
    absl::StatusOr<handle> h = lend();
    if (!h.ok()) return h.status();
    round_trips_.fetch_add(1, std::memory_order_relaxed);
    absl::StatusOr<detail::redis_reply> r = (*h)->command({"DEL", k}, detail::redis_effect::write, "erase_result");
    if ((*h)->broken()) h->mark_broken();
    if (!r.ok()) return r.status();
    if ((*r)->type == REDIS_REPLY_ERROR)
      return detail::redis_error_reply(who_, "erase_result", std::string_view((*r)->str, (*r)->len),
                                       detail::redis_effect::write);
    return absl::OkStatus();
  }

 private:
  using handle = detail::client_pool<detail::redis_connection>::handle;

  explicit redis_store(redis_options o)
      : options_(std::move(o)),
        who_(absl::StrCat("redis store '", options_.where(), "/", options_.key_prefix, "'")),
        pool_(static_cast<std::size_t>(options_.pool_size), [this] { return connect(); }) {}

  [[nodiscard]] detail::redis_key record_key_of(const request_identity& id) const noexcept {
    return detail::redis_record_key(options_.key_prefix, id);
  }
  [[nodiscard]] detail::redis_key lease_key_of(std::string_view work_key) const noexcept {
    return detail::redis_lease_key(options_.key_prefix, work_key);
  }
  [[nodiscard]] detail::redis_key result_key_of(std::string_view key) const noexcept {
    return detail::redis_result_key(options_.key_prefix, key);
  }

  static std::string_view bytes_of(const std::array<unsigned char, 16>& b) noexcept {
    return {reinterpret_cast<const char*>(b.data()), b.size()};
  }
  [[nodiscard]] std::int64_t offset_us() const noexcept {
    return options_.testing_clock_offset ? options_.testing_clock_offset->load(std::memory_order_relaxed) / 1000 : 0;
  }
  absl::Status unexpected(std::string_view op) const {
    return absl::InternalError(absl::StrCat("keel: ", who_, ": ", detail::to_absl(op), ": unexpected script reply"));
  }

  absl::StatusOr<std::unique_ptr<detail::redis_connection>> connect() {
    return detail::redis_connection::connect(endpoint_, who_);
  }

  absl::Status initialise() {
    absl::StatusOr<handle> h = lend();
    if (!h.ok()) return h.status();
    durability_ = redis_durability::unknown;
    absl::StatusOr<detail::redis_reply> aof = (*h)->command({"CONFIG", "GET", "append*"}, detail::redis_effect::read, "CONFIG GET");
    if (!aof.ok()) {
      h->mark_broken();
      return aof.status();
    }
    if ((*aof)->type == REDIS_REPLY_ARRAY) {
      std::string_view appendonly, appendfsync;
      for (std::size_t i = 0; i + 1 < (*aof)->elements; i += 2) {
        const std::string_view name = detail::reply_str(aof->get(), i);
        if (name == "appendonly") appendonly = detail::reply_str(aof->get(), i + 1);
        if (name == "appendfsync") appendfsync = detail::reply_str(aof->get(), i + 1);
      }
      if (appendonly == "no") durability_ = redis_durability::none;
      else if (appendonly == "yes" && appendfsync == "always") durability_ = redis_durability::aof_always;
      else if (appendonly == "yes") durability_ = redis_durability::aof_everysec;
    } else if ((*aof)->type == REDIS_REPLY_ERROR) {
      // CONFIG may be renamed or forbidden (managed services, ACLs): then
      // durability stays unknown. Not being let in at all is an error.
      const std::string_view e((*aof)->str, (*aof)->len);
      const absl::Status s = detail::redis_error_reply(who_, "CONFIG GET", e, detail::redis_effect::read);
      if (absl::StartsWith(detail::to_absl(e), "NOAUTH") || absl::StartsWith(detail::to_absl(e), "WRONGPASS") ||
          not_started(s))
        return s;
    }
    if (options_.require_aof_always && durability_ != redis_durability::aof_always)
      return with_outcome(
          absl::FailedPreconditionError(absl::StrCat("keel: ", who_, ": require_aof_always, but the server's durability is ",
                                                     detail::to_absl(to_string(durability_)),
                                                     " (set appendonly yes and appendfsync always)")),
          outcome_kind::permanent);
    return absl::OkStatus();
  }

  absl::StatusOr<handle> lend() { return pool_.acquire_alive(options_.acquire_timeout, who_); }

  [[nodiscard]] const detail::redis_store_scripts& scripts() const noexcept {
    return detail::redis_store_scripts::get(options_.fences);
  }

  template <std::size_t N>
  absl::StatusOr<detail::redis_reply> run(const detail::redis_script& script, const std::array<std::string_view, N>& args,
                                          detail::redis_effect effect, std::string_view op) {
    absl::StatusOr<handle> h = lend();
    if (!h.ok()) return h.status();
    const std::uint64_t loads = (*h)->script_loads();
    if (options_.wait_replicas > 0 && effect == detail::redis_effect::write) {
      // The script, PUBLISH and WAIT in one round trip (redis_connection::eval_replicated).
      const std::string channel = absl::StrCat(options_.key_prefix, "wait");
      auto r = (*h)->eval_replicated(script, args, effect, op, channel, options_.wait_replicas,
                                     std::chrono::duration_cast<std::chrono::milliseconds>(options_.wait_timeout).count());
      round_trips_.fetch_add(1 + ((*h)->script_loads() - loads), std::memory_order_relaxed);
      if ((*h)->broken()) h->mark_broken();
      if (!r.ok()) return r.status();
      if (r->second < options_.wait_replicas)
        return unknown_outcome_error(
            absl::StrCat(who_, ": ", detail::to_absl(op)),
            absl::UnavailableError(absl::StrCat("keel: ", who_, ": ", detail::to_absl(op), ": the primary answered, but ",
                                                std::max<long long>(r->second, 0), " of the ", options_.wait_replicas,
                                                " replicas wait_replicas asks for confirmed it within ",
                                                detail::describe(options_.wait_timeout),
                                                "; a failover may lose it (repeat it: repeats are safe)")));
      return std::move(r->first);
    }
    absl::StatusOr<detail::redis_reply> r = (*h)->eval(script, args, effect, op);
    round_trips_.fetch_add(1 + ((*h)->script_loads() - loads), std::memory_order_relaxed);
    if ((*h)->broken()) h->mark_broken();
    return r;
  }

  template <std::size_t N>
  absl::Status fenced_record(const detail::redis_script& script, const std::array<std::string_view, N>& args,
                             const ownership& token, std::string_view op) {
    absl::StatusOr<detail::redis_reply> r = run(script, args, detail::redis_effect::write, op);
    if (!r.ok()) return r.status();
    const redisReply* x = r->get();
    switch (detail::reply_int(x, 0)) {
      case 0:
      case 1:
        return absl::OkStatus();
      case -1:
        return lost_ownership_error(absl::StrCat(detail::to_absl(op), " by fence ", token.fence,
                                                 ": no live record for this key (expired or never claimed)"));
      case -2: {
        const std::int64_t state = detail::reply_int(x, 1), fence = detail::reply_int(x, 2);
        const std::string_view name = state == 0 ? "in flight" : state == 1 ? "committed" : "abandoned";
        return lost_ownership_error(absl::StrCat(detail::to_absl(op), " by fence ", token.fence, ": the record is ",
                                                 detail::to_absl(name), " under fence ", fence,
                                                 fence == token.fence ? " and another owner" : ""));
      }
      default:
        return unexpected(op);
    }
  }

  template <std::size_t N>
  absl::Status fenced_lease(const detail::redis_script& script, const std::array<std::string_view, N>& args,
                            const ownership& token, std::string_view op) {
    absl::StatusOr<detail::redis_reply> r = run(script, args, detail::redis_effect::write, op);
    if (!r.ok()) return r.status();
    const redisReply* x = r->get();
    switch (detail::reply_int(x, 0)) {
      case 0:
      case 1:
        return absl::OkStatus();
      case -1:
        return lost_ownership_error(
            absl::StrCat(detail::to_absl(op), " by fence ", token.fence, ": no lease for this key"));
      case -2: {
        const bool held = detail::reply_int(x, 1) != 0;
        const std::int64_t fence = detail::reply_int(x, 2);
        return lost_ownership_error(absl::StrCat(detail::to_absl(op), " by fence ", token.fence, ": the lease is ",
                                                 held ? "held" : "free", " at fence ", fence,
                                                 held && fence == token.fence ? " by another owner" : ""));
      }
      default:
        return unexpected(op);
    }
  }

  redis_options options_;
  detail::redis_endpoint endpoint_ = options_.endpoint();  // made once: its connects share the primary hint
  std::string who_;
  detail::client_pool<detail::redis_connection> pool_;
  redis_durability durability_ = redis_durability::unknown;
  std::atomic<std::uint64_t> round_trips_{0};
};

static_assert(idempotency_store<redis_store>);
static_assert(lease_store<redis_store>);
static_assert(result_store<redis_store>);

}  // namespace keel
