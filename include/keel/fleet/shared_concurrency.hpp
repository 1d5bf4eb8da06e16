// keel/fleet/shared_concurrency.hpp — one concurrency limit shared by every
// replica of a service (say 64 requests in flight to one model endpoint),
// kept in Redis, with a local share of it when Redis cannot answer.
//
// A provider's concurrency belongs to the fleet: K replicas with a bulkhead
// of 64 each send K x 64. keel::shared_concurrency keeps the limit's permits
// in Redis, in one sorted set per limit: member "<id>:<owner>" scored by its
// expiry on the server's clock (TIME, microseconds). One Lua script takes a
// permit (drops expired members, checks the count against the limit, adds
// one) and one returns it: one round trip each, atomic on the server,
// whatever the replicas' clocks say. So:
//
//   - at no instant do the replicas hold more than `limit` live permits;
//   - a permit has an owner (this object's random owner_id) and an expiry:
//     a replica that dies (SIGKILL, a lost host) holds its permits only
//     until they expire, then the fleet has them back;
//   - release is fenced: every permit has a unique id (per limit,
//     max(counter + 1, the server clock in microseconds): it never goes
//     backwards, whether Redis forgot the counter or a promoted replica
//     lacks the last grants), and a release removes exactly that member. A slow replica whose permit
//     expired, and whose slot went to someone else, gets "not held" back
//     and frees nothing that is not its own.
//
// Expiry: a permit lives `permit_ttl`, or, in the policy, until the call's
// deadline plus `expiry_grace` when that is sooner — keep it above the
// longest call you run: a call still running when its permit expires no
// longer counts against the limit (its release then reports not_held and
// the policy reports events::shared_permit_lost).
//
// When Redis cannot be reached (refused, timed out, cut off), permits come
// from a local share of the limit, max(1, limit / expected_replicas), and
// keep coming from it for `fallback_hold` before Redis is asked again, so
// an outage adds no timeout to every call. A local permit says so
// (permit.local_share(), with the Redis error), its refusal names
// "shared:<name>:local-share", the policy reports
// events::shared_concurrency_local_share, and status() shows it. With
// expected_replicas at least the number of replicas, the fleet stays within
// the limit during the outage; when Redis answers again, local permits still
// out are not in Redis's count, so for as long as those calls run the fleet
// may exceed the limit by at most those permits (at most the local share
// per replica).
//
// As one more level of admission, a policy: place it inside keel::retry so
// every provider attempt holds a permit for as long as it runs:
//
//   keel::shared_concurrency fleet({.port = 6379, .key_prefix = "svc:"},
//                                  {.name = "openai:gpt-4o", .limit = 64, .expected_replicas = 4});
//   auto pipe = keel::pipeline(quotas, keel::retry({.max_attempts = 3}), fleet, breakers, timeouts);
//
// Its refusal is keel's: ResourceExhausted, not started, classified refused
// (keel::refusal), refused-by "shared:<name>:concurrency" (or
// ":local-share"), retry-after = when the earliest permit expires (an upper
// bound: most come back sooner). A replayed call (served from an
// idempotency record) spends no provider capacity and takes no permit
// (charge_replays).
//
// Standalone:
//
//   keel::shared_permit p = fleet.try_acquire(keel::real_clock{}.now());
//   if (!p) return keel::shared_concurrency::refusal(fleet.name(), p);
//   absl::Status s = call_the_model();
//   absl::StatusOr<keel::permit_release> r = p.release();  // released, or not_held
//
// A permit not released explicitly is released when it is destroyed (one
// round trip), so every permit is returned exactly once, on success,
// exception and cancellation alike.
//
// Cost: one Redis round trip to acquire and one to release (none while on
// the local share).
//
// Thread-safety: every operation may be called from any thread; at most
// pool_size Redis commands run at once. A shared_permit is used by one
// thread at a time and must not outlive its shared_concurrency.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "keel/core/call.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/outcome.hpp"
#include "keel/core/policy.hpp"
#include "keel/core/status.hpp"
#include "keel/core/telemetry.hpp"
#include "keel/store/internal/client_pool.hpp"
#include "keel/store/internal/redis_connection.hpp"
#include "keel/durable/ownership.hpp"
#include "keel/store/redis.hpp"

namespace keel {

struct shared_concurrency_options {
  // The limit's name, shared by every replica (a key part: 1-255 bytes, no
  // control characters), for example "provider:openai:gpt-4o".
  std::string name{};
  // Permits the whole fleet may hold at once; [1, 1000000].
  int limit = 0;
  // A permit expires this long after it was taken unless returned sooner;
  // [1 ms, 24 h]. Above the longest call: see the header comment.
  duration permit_ttl = std::chrono::seconds(30);
  // The policy's permits expire at the call's deadline plus this (when
  // sooner than permit_ttl), so a dead replica's permits return soon after
  // its calls would have ended; [0, 1 h].
  duration expiry_grace = std::chrono::seconds(1);
  // Replicas the limit is shared by: while Redis is unreachable each takes
  // at most max(1, limit / expected_replicas) permits; [1, 100000].
  int expected_replicas = 1;
  // After Redis failed, use the local share this long before asking it again; [0, 1 h].
  duration fallback_hold = std::chrono::seconds(1);
  // Take a permit for calls marked replayed (the policy); off: replays hold none.
  bool charge_replays = false;

  // The local share of the limit.
  [[nodiscard]] int local_share() const noexcept { return std::max(1, limit / std::max(1, expected_replicas)); }

  [[nodiscard]] absl::Status validate() const {
    constexpr std::string_view who = "shared_concurrency_options";
    if (absl::Status k = validate_key("shared concurrency name", name); !k.ok())
      return detail::invalid_field(who, "name", "be 1-255 bytes without control characters", k.message());
    if (limit < 1 || limit > 1'000'000) return detail::invalid_field(who, "limit", "be in [1, 1000000]", limit);
    if (permit_ttl < std::chrono::milliseconds(1) || permit_ttl > std::chrono::hours(24))
      return detail::invalid_field(who, "permit_ttl", "be in [1ms, 24h]", permit_ttl);
    if (expiry_grace < duration::zero() || expiry_grace > std::chrono::hours(1))
      return detail::invalid_field(who, "expiry_grace", "be in [0, 1h]", expiry_grace);
    if (expected_replicas < 1 || expected_replicas > 100'000)
      return detail::invalid_field(who, "expected_replicas", "be in [1, 100000]", expected_replicas);
    if (fallback_hold < duration::zero() || fallback_hold > std::chrono::hours(1))
      return detail::invalid_field(who, "fallback_hold", "be in [0, 1h]", fallback_hold);
    return absl::OkStatus();
  }
};

// Where a permit (or a refusal) came from.
enum class concurrency_source {
  shared,       // Redis: the fleet-wide count
  local_share,  // this replica's share of the limit, because Redis could not answer
};

[[nodiscard]] constexpr std::string_view to_string(concurrency_source s) noexcept {
  return s == concurrency_source::shared ? "shared" : "local-share";
}

// What returning a permit found.
enum class permit_release {
  released,  // it was held, and now it is not
  not_held,  // it had expired (and its slot may be someone else's): nothing was freed
};

class shared_concurrency;

// One permit of a shared concurrency limit, or a refusal. Move-only; see
// the header comment for its release.
class shared_permit {
 public:
  shared_permit() noexcept = default;  // refused, from nothing
  shared_permit(shared_permit&& o) noexcept
      : owner_(std::exchange(o.owner_, nullptr)),
        id_(o.id_),
        retry_after_(o.retry_after_),
        held_(o.held_),
        source_(o.source_),
        redis_error_(std::move(o.redis_error_)) {}
  shared_permit& operator=(shared_permit&& o) noexcept {
    if (this != &o) {
      drop();
      owner_ = std::exchange(o.owner_, nullptr);
      id_ = o.id_;
      retry_after_ = o.retry_after_;
      held_ = o.held_;
      source_ = o.source_;
      redis_error_ = std::move(o.redis_error_);
    }
    return *this;
  }
  shared_permit(const shared_permit&) = delete;
  shared_permit& operator=(const shared_permit&) = delete;
  ~shared_permit() { drop(); }

  // True while the permit is held (granted and not yet released).
  [[nodiscard]] explicit operator bool() const noexcept { return owner_ != nullptr; }
  // Granted from the local share because Redis could not answer.
  [[nodiscard]] bool local_share() const noexcept { return source_ == concurrency_source::local_share; }
  [[nodiscard]] concurrency_source source() const noexcept { return source_; }
  // The permit's fence: unique among the limit's shared permits, growing
  // (0 for a local-share permit or a refusal).
  [[nodiscard]] std::uint64_t id() const noexcept { return id_; }
  // Granted: permits held when it was taken (this one included; for the
  // local share, this replica's). Refused: permits held (the limit, or the share).
  [[nodiscard]] int held() const noexcept { return held_; }
  // Refused: when the earliest permit expires (shared; zero for the local share).
  [[nodiscard]] duration retry_after() const noexcept { return retry_after_; }
  // Local share: why Redis was not used (the last failure).
  [[nodiscard]] const absl::Status& redis_error() const noexcept { return redis_error_; }

  // Returns the permit (one round trip for a shared one). not_held: it had
  // expired first. An error: Redis could not be asked (the permit returns
  // when it expires). The permit is given up in every case. Once: a second
  // call (or one on a refusal) is FailedPrecondition.
  absl::StatusOr<permit_release> release();

 private:
  friend class shared_concurrency;
  void drop() noexcept {
    if (owner_ != nullptr) (void)release();
  }

  shared_concurrency* owner_ = nullptr;
  std::uint64_t id_ = 0;
  duration retry_after_{};
  int held_ = 0;
  concurrency_source source_ = concurrency_source::shared;
  absl::Status redis_error_{};
};

// What a shared_concurrency is deciding on now.
struct shared_concurrency_status {
  concurrency_source source = concurrency_source::shared;  // local_share while holding after a Redis failure
  int local_share = 0;                                     // permits this replica may hold without Redis
  int local_in_flight = 0;                                 // local-share permits out now
  absl::Status redis_error{};                              // the last Redis failure (OK: none yet)
};

namespace events {

// A permit was decided on the local share (Redis could not answer).
struct shared_concurrency_local_share {
  std::string_view name;
  const absl::Status& redis_error;
};
// The shared concurrency limit refused a pass of `call`.
struct shared_concurrency_refused {
  const keel::call& call;
  std::string_view name;
  concurrency_source source;
};
// A pass's permit had expired before the pass returned it: the call outlived
// permit_ttl (or its deadline plus expiry_grace) and stopped counting
// against the limit while it ran.
struct shared_permit_lost {
  const keel::call& call;
  std::string_view name;
  std::uint64_t id;
};

}  // namespace events

namespace detail {

// KEYS[1] the permits (a sorted set: "<id>:<owner>" -> expiry, us), KEYS[2]
// the id counter (ids pass 1e15: formatted with %.0f, never tostring's 14
// digits, or ids would collide). An id is max(counter + 1, now in us): a
// replica promoted after losing the last grants (asynchronous replication)
// has an older counter, and a counter alone would give a lost permit's id,
// and so its member when the owner is the same object, to a new permit,
// whose release the lost one's would then remove. From the clock, ids
// after the failover are above every lost one. ARGV: 1 test offset (us), 2 limit, 3 ttl (us), 4 owner,
// 5 forget (us). Reply: {1, id, held} granted; {0, held, retry after (us)}.
inline constexpr const char* redis_lua_permit_acquire = R"lua(
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2]) + tonumber(ARGV[1])
local function num(x) return string.format('%.0f', x) end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', num(now))
local held = redis.call('ZCARD', KEYS[1])
if held >= tonumber(ARGV[2]) then
  local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return {0, held, math.max(0, math.ceil(tonumber(first[2]) - now))}
end
local id = redis.call('INCR', KEYS[2])
if id < now then
  id = now
  redis.call('SET', KEYS[2], num(now))
end
local forget = tonumber(ARGV[5])
redis.call('PEXPIRE', KEYS[2], math.ceil(forget / 1000))
local expiry = now + tonumber(ARGV[3])
redis.call('ZADD', KEYS[1], num(expiry), num(id) .. ':' .. ARGV[4])
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
redis.call('PEXPIRE', KEYS[1], math.ceil((tonumber(last[2]) - now) / 1000) + 1000)
return {1, id, held + 1}
)lua";

// KEYS[1] the permits. ARGV: 1 test offset (us), 2 id, 3 owner.
// Reply: 1 released; 0 not held (expired, swept or not).
inline constexpr const char* redis_lua_permit_release = R"lua(
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2]) + tonumber(ARGV[1])
local m = ARGV[2] .. ':' .. ARGV[3]
local expiry = redis.call('ZSCORE', KEYS[1], m)
if not expiry then return 0 end
redis.call('ZREM', KEYS[1], m)
if tonumber(expiry) <= now then return 0 end
return 1
)lua";

inline const redis_script& permit_acquire_script() {
  static const redis_script s{std::string(redis_lua_permit_acquire)};
  return s;
}
inline const redis_script& permit_release_script() {
  static const redis_script s{std::string(redis_lua_permit_release)};
  return s;
}

// The permits' sorted set: the prefix, "conc:", the name inside one hash tag;
// the permit ids' counter is that key + ":id" (same tag, same slot).
[[nodiscard]] inline std::string redis_concurrency_key(std::string_view prefix, std::string_view name) {
  return absl::StrCat(to_absl(prefix), "conc:{", to_absl(name), "}");
}

}  // namespace detail

class shared_concurrency {
 public:
  // Does not connect: Redis may be down when the service starts (the local
  // share decides until it is back). Throws keel::invalid_options if either
  // options struct is invalid.
  shared_concurrency(redis_options redis, shared_concurrency_options o)
      : redis_((detail::require_valid(redis.validate()), std::move(redis))),
        options_((detail::require_valid(o.validate()), std::move(o))),
        permits_key_(detail::redis_concurrency_key(redis_.key_prefix, options_.name)),
        ids_key_(absl::StrCat(permits_key_, ":id")),
        who_(absl::StrCat("shared concurrency '", options_.name, "'")),
        owner_(owner_id::random().hex()),
        limit_arg_(std::to_string(options_.limit)),
        forget_arg_(std::to_string(detail::redis_us(redis_.forget_after))),
        share_(options_.local_share()),
        pool_(static_cast<std::size_t>(redis_.pool_size), [this] { return connect(); }) {}
  shared_concurrency(const shared_concurrency&) = delete;
  shared_concurrency& operator=(const shared_concurrency&) = delete;

  [[nodiscard]] const shared_concurrency_options& options() const noexcept { return options_; }
  [[nodiscard]] std::string_view name() const noexcept { return options_.name; }
  // This replica's owner, in every permit member it writes (32 hex digits).
  [[nodiscard]] std::string_view owner() const noexcept { return owner_; }

  // Permits decided by Redis / on the local share, Redis failures, and
  // releases that found their permit expired, so far.
  [[nodiscard]] std::uint64_t shared_decisions() const noexcept { return shared_.load(std::memory_order_relaxed); }
  [[nodiscard]] std::uint64_t local_share_decisions() const noexcept { return locals_.load(std::memory_order_relaxed); }
  [[nodiscard]] std::uint64_t redis_failures() const noexcept { return failures_.load(std::memory_order_relaxed); }
  [[nodiscard]] std::uint64_t lost_permits() const noexcept { return lost_.load(std::memory_order_relaxed); }

  // Which source decides at `now` (this replica's clock), and the local share's state.
  [[nodiscard]] shared_concurrency_status status(time_point now) const {
    shared_concurrency_status s;
    s.source = now.time_since_epoch().count() < hold_until_.load(std::memory_order_acquire)
                   ? concurrency_source::local_share
                   : concurrency_source::shared;
    s.local_share = share_;
    s.local_in_flight = local_.load(std::memory_order_relaxed);
    std::lock_guard lock(mu_);
    s.redis_error = last_error();
    return s;
  }

  // Takes one permit that expires `ttl` (at most permit_ttl; at least 1 ms)
  // from now on the server's clock, or from the local share when Redis
  // cannot answer (or failed less than fallback_hold before `now`, this
  // replica's clock, which times the hold only).
  [[nodiscard]] shared_permit try_acquire(time_point now, duration ttl = duration::max()) {
    ttl = std::clamp<duration>(ttl, std::chrono::milliseconds(1), options_.permit_ttl);
    shared_permit p;
    if (now.time_since_epoch().count() >= hold_until_.load(std::memory_order_acquire)) {
      absl::StatusOr<detail::redis_reply> r = acquire_script(ttl);
      if (r.ok()) {
        shared_.fetch_add(1, std::memory_order_relaxed);
        const redisReply* x = r->get();
        if (detail::reply_int(x, 0) == 1) {
          p.owner_ = this;
          p.id_ = static_cast<std::uint64_t>(detail::reply_int(x, 1));
          p.held_ = static_cast<int>(detail::reply_int(x, 2));
        } else {
          p.held_ = static_cast<int>(detail::reply_int(x, 1));
          p.retry_after_ = std::chrono::duration_cast<duration>(std::chrono::microseconds(detail::reply_int(x, 2)));
        }
        return p;
      }
      failures_.fetch_add(1, std::memory_order_relaxed);
      hold_until_.store((now + options_.fallback_hold).time_since_epoch().count(), std::memory_order_release);
      std::lock_guard lock(mu_);
      last_code_ = r.status().code();
      last_message_ = std::string(r.status().message());
    }
    locals_.fetch_add(1, std::memory_order_relaxed);
    p.source_ = concurrency_source::local_share;
    {
      std::lock_guard lock(mu_);
      p.redis_error_ = last_error();
    }
    int n = local_.load(std::memory_order_relaxed);
    while (n < share_ && !local_.compare_exchange_weak(n, n + 1, std::memory_order_acq_rel)) {
    }
    if (n >= share_) {
      p.held_ = n;
      return p;
    }
    p.owner_ = this;
    p.held_ = n + 1;
    return p;
  }

  // The status for a refused permit (allocates: refusal paths only).
  [[nodiscard]] static absl::Status refusal(std::string_view name, const shared_permit& p) {
    const bool local = p.local_share();
    absl::Status s = absl::ResourceExhaustedError(
        local ? absl::StrCat("keel: shared concurrency '", detail::to_absl(name), "' is at its local share (",
                             p.held(), " in flight; Redis unreachable: ", p.redis_error().message(), ")")
              : absl::StrCat("keel: shared concurrency '", detail::to_absl(name), "' is at its limit (", p.held(),
                             " in flight across the fleet)"));
    return keel::refusal(std::move(s),
                         absl::StrCat("shared:", detail::to_absl(name), local ? ":local-share" : ":concurrency"),
                         p.retry_after());
  }

  // The policy: one permit per pass (place it inside keel::retry to hold
  // one per attempt), taken before and returned after the stages within,
  // expiring at the pass's deadline plus expiry_grace at the latest.
  template <class Ctx, class Next>
  auto execute(Ctx& ctx, attempt_plan plan, Next& next) -> decltype(next(ctx, plan)) {
    using R = decltype(next(ctx, plan));
    if (!options_.charge_replays && ctx.call.record().replayed) return next(ctx, plan);
    const duration left = plan.deadline.remaining(plan.now);
    shared_permit p = try_acquire(plan.now, left >= options_.permit_ttl ? options_.permit_ttl : left + options_.expiry_grace);
    if (p.local_share()) observe(ctx.listener, events::shared_concurrency_local_share{name(), p.redis_error()});
    if (!p) {
      observe(ctx.listener, events::shared_concurrency_refused{ctx.call, name(), p.source()});
      return R(refusal(name(), p));
    }
    const std::uint64_t id = p.id();
    R r = next(ctx, plan);
    absl::StatusOr<permit_release> back = p.release();
    if (back.ok() && *back == permit_release::not_held)
      observe(ctx.listener, events::shared_permit_lost{ctx.call, name(), id});
    return r;
  }

 private:
  friend class shared_permit;

  absl::StatusOr<std::unique_ptr<detail::redis_connection>> connect() {
    return detail::redis_connection::connect(endpoint_, who_);
  }

  [[nodiscard]] std::int64_t offset_us() const noexcept {
    return redis_.testing_clock_offset ? redis_.testing_clock_offset->load(std::memory_order_relaxed) / 1000 : 0;
  }

  absl::StatusOr<detail::redis_reply> acquire_script(duration ttl) {
    absl::StatusOr<detail::client_pool<detail::redis_connection>::handle> h =
        pool_.acquire_alive(redis_.acquire_timeout, who_);
    if (!h.ok()) return h.status();
    const detail::redis_num off(offset_us()), ttl_us(detail::redis_us(ttl));
    absl::StatusOr<detail::redis_reply> r = (*h)->eval(
        detail::permit_acquire_script(),
        std::array<std::string_view, 7>{permits_key_, ids_key_, off.view(), limit_arg_, ttl_us.view(), owner_,
                                        forget_arg_},
        detail::redis_effect::write, "acquire", 2);
    if ((*h)->broken()) h->mark_broken();
    return r;
  }

  absl::StatusOr<permit_release> release(shared_permit& p) {
    if (p.source_ == concurrency_source::local_share) {
      local_.fetch_sub(1, std::memory_order_acq_rel);
      return permit_release::released;
    }
    absl::StatusOr<detail::client_pool<detail::redis_connection>::handle> h =
        pool_.acquire_alive(redis_.acquire_timeout, who_);
    if (!h.ok()) {
      failures_.fetch_add(1, std::memory_order_relaxed);
      return h.status();
    }
    const detail::redis_num off(offset_us()), id(static_cast<std::int64_t>(p.id_));
    absl::StatusOr<detail::redis_reply> r =
        (*h)->eval(detail::permit_release_script(),
                   std::array<std::string_view, 4>{permits_key_, off.view(), id.view(), owner_},
                   detail::redis_effect::write, "release");
    if ((*h)->broken()) h->mark_broken();
    if (!r.ok()) {
      failures_.fetch_add(1, std::memory_order_relaxed);
      return r.status();
    }
    if ((*r)->type == REDIS_REPLY_INTEGER && (*r)->integer == 1) return permit_release::released;
    lost_.fetch_add(1, std::memory_order_relaxed);
    return permit_release::not_held;
  }

  redis_options redis_;
  detail::redis_endpoint endpoint_ = redis_.endpoint();  // made once: its connects share the primary hint
  shared_concurrency_options options_;
  std::string permits_key_, ids_key_;
  std::string who_;
  std::string owner_;
  std::string limit_arg_, forget_arg_;
  int share_;
  detail::client_pool<detail::redis_connection> pool_;
  std::atomic<std::int64_t> hold_until_{INT64_MIN};
  std::atomic<int> local_{0};
  std::atomic<std::uint64_t> shared_{0}, locals_{0}, failures_{0}, lost_{0};
  // The last Redis failure, kept as code and text: every permit gets its own
  // absl::Status, never a copy sharing one across threads (Debian's abseil is
  // not built for TSan, which then cannot see the shared count's ordering).
  [[nodiscard]] absl::Status last_error() const {
    return last_code_ == absl::StatusCode::kOk ? absl::OkStatus() : absl::Status(last_code_, last_message_);
  }
  mutable std::mutex mu_;
  absl::StatusCode last_code_ = absl::StatusCode::kOk;
  std::string last_message_;
};

inline absl::StatusOr<permit_release> shared_permit::release() {
  if (owner_ == nullptr)
    return absl::FailedPreconditionError("keel: shared permit: nothing to release (refused, or released already)");
  shared_concurrency* c = std::exchange(owner_, nullptr);
  return c->release(*this);
}

}  // namespace keel
