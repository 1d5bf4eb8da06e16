// keel/fleet/shared_provider_state.hpp — what one replica learns about a
// provider (its breaker opened, the provider asked for a cooldown), told to
// every replica through Redis, and half-open probing decided fleet-wide.
//
// Without it each of K replicas discovers an outage on its own (K breakers
// each letting minimum_calls fail), a provider's Retry-After reaches only
// the replica that got it, and K half-open breakers send K times the
// probes. keel::shared_provider_state keeps, per failure domain (the
// labels a keel::breaker_registry scopes by), one Redis hash on the
// server's clock:
//
//   b  the fleet's breaker is open until (a replica's breaker opened, or a
//      fleet probe failed); once passed and not closed: fleet half-open
//   c  the provider asked the fleet to wait until (a throttled answer with a
//      retry-after hint: Retry-After, retry-after-ms, a rate-limit reset;
//      keel/provider/hints.hpp reads them)
//
// As a policy it sits in front of the breaker registry (and inside
// keel::retry, so every attempt is gated):
//
//   keel::breaker_registry breakers({.breaker = {.minimum_calls = 20, .open_duration = 10s}});
//   keel::shared_provider_state fleet({.port = 6379, .key_prefix = "svc:"}, {.refresh_every = 100ms}, &breakers);
//   auto pipe = keel::pipeline(quotas, keel::retry({.max_attempts = 3}), fleet, breakers, timeouts);
//
// Before a pass it reads the domain's state (cached, see staleness) and
// refuses while the fleet's breaker is open or a cooldown runs; fleet
// half-open, a pass goes ahead only with one of `max_probes` probe tokens
// per `probe_window` (counted in the domain's hash, so the fleet, not each replica,
// sends that many). After the pass:
//
//   - a probe that succeeded closes the fleet's breaker (one round trip);
//     one that failed (transient or ambiguous) opens it for `reopen_for`;
//   - a throttled outcome with a retry-after hint publishes a cooldown of
//     that hint (at most max_cooldown);
//   - when the domain's breaker in `breakers` is open (or forced open) and
//     this replica has not yet published that open period, it publishes
//     it: open for the breaker's remaining open time (reopen_for, renewed,
//     while forced open).
//
// Each publish is one round trip, on those paths only. The healthy path
// costs a lookup of the domain (lock-free, no allocation once it exists),
// three atomic loads before and one (the local breaker's state) after.
//
// Staleness, documented and bounded: a replica reads a domain's state at
// most once per `refresh_every` (one round trip, on the calling thread that
// finds it stale; the others use the cache meanwhile), so a state published
// by another replica stops this one within refresh_every plus one round
// trip. refresh_every = 0 reads on every pass: then a published state stops
// every replica's next pass. The replica that publishes sees its own state
// at once. Times travel as "remaining on the server's clock", so replica
// clocks need not agree.
//
// Refusals are keel's (keel::refusal: not started, classified refused,
// never counted by a breaker), refused-by "fleet:<domain>:cooldown"
// (ResourceExhausted), "fleet:<domain>:breaker" or "fleet:<domain>:probing"
// (Unavailable), each with a retry-after.
//
// When Redis cannot answer, for `fallback_hold` every replica decides
// alone: cached states run out at their own times, no probe tokens are
// asked for (the local breaker probes as it would alone), nothing is
// published; events::fleet_state_unavailable says so, redis_failures()
// counts it.
//
// Thread-safety: every operation may be called from any thread; at most
// pool_size Redis commands run at once. The registry, when given, must
// outlive this object.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
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
#include "keel/policy/internal/keyed_table.hpp"
#include "keel/store/internal/redis_connection.hpp"
#include "keel/policy/internal/short_key.hpp"
#include "keel/durable/ownership.hpp"
#include "keel/policy/breaker_registry.hpp"
#include "keel/policy/circuit_breaker.hpp"
#include "keel/store/redis.hpp"

namespace keel {

struct shared_provider_state_options {
  // Which call labels make a domain; ignored when a breaker registry is
  // given (its scope is used, so the domains are the breakers').
  breaker_scope scope{};
  // Read a domain's state at most this often (the staleness bound); [0, 1 min].
  duration refresh_every = std::chrono::milliseconds(100);
  // Fleet half-open: probes the whole fleet sends per probe_window; [1, 1000].
  int max_probes = 1;
  duration probe_window = std::chrono::seconds(1);  // [1 ms, 1 h]
  // A fleet probe that failed opens the fleet's breaker this long; also the
  // period a forced-open breaker is published for (renewed); [1 ms, 24 h].
  duration reopen_for = std::chrono::seconds(10);
  // Cooldown hints are clipped to this; [1 ms, 24 h].
  duration max_cooldown = std::chrono::minutes(5);
  // After Redis failed, decide locally this long before asking it again; [0, 1 h].
  duration fallback_hold = std::chrono::seconds(1);
  // Domains shared; further domains pass through unshared (overflowed()); [1, 1048576].
  int max_domains = 1024;
  // Redis keeps a domain's state this long after it ended; [1 s, 24 h].
  duration forget_after = std::chrono::minutes(1);

  [[nodiscard]] absl::Status validate() const {
    constexpr std::string_view who = "shared_provider_state_options";
    if (!scope.endpoint && !scope.model && !scope.region && !scope.tenant)
      return detail::invalid_field(who, "scope", "name at least one label", "none");
    if (refresh_every < duration::zero() || refresh_every > std::chrono::minutes(1))
      return detail::invalid_field(who, "refresh_every", "be in [0, 1min]", refresh_every);
    if (max_probes < 1 || max_probes > 1000) return detail::invalid_field(who, "max_probes", "be in [1, 1000]", max_probes);
    if (probe_window < std::chrono::milliseconds(1) || probe_window > std::chrono::hours(1))
      return detail::invalid_field(who, "probe_window", "be in [1ms, 1h]", probe_window);
    if (reopen_for < std::chrono::milliseconds(1) || reopen_for > std::chrono::hours(24))
      return detail::invalid_field(who, "reopen_for", "be in [1ms, 24h]", reopen_for);
    if (max_cooldown < std::chrono::milliseconds(1) || max_cooldown > std::chrono::hours(24))
      return detail::invalid_field(who, "max_cooldown", "be in [1ms, 24h]", max_cooldown);
    if (fallback_hold < duration::zero() || fallback_hold > std::chrono::hours(1))
      return detail::invalid_field(who, "fallback_hold", "be in [0, 1h]", fallback_hold);
    if (max_domains < 1 || max_domains > (1 << 20))
      return detail::invalid_field(who, "max_domains", "be in [1, 1048576]", max_domains);
    if (forget_after < std::chrono::seconds(1) || forget_after > std::chrono::hours(24))
      return detail::invalid_field(who, "forget_after", "be in [1s, 24h]", forget_after);
    return absl::OkStatus();
  }
};

// Why the fleet's state refused a pass, or what a replica published.
enum class fleet_signal : std::uint8_t {
  cooldown,      // the provider asked the fleet to wait
  breaker_open,  // the fleet's breaker is open
  probing,       // fleet half-open, and this probe window's probes are out
  closed,        // published: a fleet probe succeeded
};

[[nodiscard]] constexpr std::string_view to_string(fleet_signal s) noexcept {
  switch (s) {
    case fleet_signal::cooldown: return "cooldown";
    case fleet_signal::breaker_open: return "breaker";
    case fleet_signal::probing: return "probing";
    case fleet_signal::closed: return "closed";
  }
  return "unknown";
}

// A domain's state as Redis holds it now (read()).
struct fleet_provider_view {
  bool breaker_known = false;   // the fleet's breaker is open or half-open
  duration breaker_remaining{}; // open: time left; <= 0: half-open
  duration cooldown_remaining{};  // > 0: a cooldown runs
  [[nodiscard]] bool open() const noexcept { return breaker_known && breaker_remaining > duration::zero(); }
  [[nodiscard]] bool half_open() const noexcept { return breaker_known && breaker_remaining <= duration::zero(); }
};

// What try_probe() answered.
enum class fleet_probe : std::uint8_t {
  granted,  // this pass is one of the window's probes
  refused,  // the window's probes are out (or the breaker opened again)
  closed,   // the fleet's breaker closed meanwhile: go ahead, not a probe
};

namespace events {

// The fleet's state refused a pass of `call`.
struct fleet_state_refused {
  const keel::call& call;
  std::string_view domain;
  fleet_signal why;
};
// This replica published a state for `domain` (for: how long; zero for closed).
struct fleet_state_published {
  std::string_view domain;
  fleet_signal what;
  duration for_how_long;
};
// Redis could not answer: this replica decides alone for fallback_hold.
struct fleet_state_unavailable {
  std::string_view domain;
  const absl::Status& redis_error;
};

}  // namespace events

namespace detail {

// The scripts take KEYS[1] the domain's hash and ARGV[1] the test offset
// (us). Lua numbers go to Redis formatted with %.0f (they pass 1e15 us,
// beyond tostring's 14 digits). Probe windows live in the hash too (pw its
// start, pn probes taken), on the server's clock, not as a key expiry.
inline constexpr const char* redis_lua_fleet_prelude = R"lua(
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2]) + tonumber(ARGV[1])
local function num(x) return string.format('%.0f', x) end
)lua";

// Reply: {breaker known 1/0, breaker until - now (us), cooldown until - now (us), 0 when none}.
inline constexpr const char* redis_lua_fleet_read = R"lua(
local r = redis.call('HMGET', KEYS[1], 'b', 'c')
local out = {0, 0, 0}
if r[1] then out[1] = 1; out[2] = tonumber(r[1]) - now end
if r[2] and tonumber(r[2]) > now then out[3] = tonumber(r[2]) - now end
return out
)lua";

// ARGV: 2 field ('b' or 'c'), 3 for (us), 4 owner, 5 forget (us). Sets the
// field to the later of what it holds and now + for; a breaker period ends
// the previous half-open period's probe window. Reply: until - now (us).
inline constexpr const char* redis_lua_fleet_publish = R"lua(
local f = ARGV[2]
local u = now + tonumber(ARGV[3])
local cur = tonumber(redis.call('HGET', KEYS[1], f))
if f == 'b' then redis.call('HDEL', KEYS[1], 'pw', 'pn') end
if cur and cur > u then u = cur end
redis.call('HSET', KEYS[1], f, num(u), 'o' .. f, ARGV[4])
local r = redis.call('HMGET', KEYS[1], 'b', 'c')
local last = math.max(tonumber(r[1]) or 0, tonumber(r[2]) or 0)
redis.call('PEXPIRE', KEYS[1], math.max(1, math.ceil((last - now + tonumber(ARGV[5])) / 1000)))
return u - now
)lua";

// A fleet probe succeeded. Reply: 1 closed; 0 already closed; -1 open
// again (another probe failed meanwhile): left open.
inline constexpr const char* redis_lua_fleet_close = R"lua(
local b = tonumber(redis.call('HGET', KEYS[1], 'b'))
if not b then return 0 end
if b > now then return -1 end
redis.call('HDEL', KEYS[1], 'b', 'ob', 'pw', 'pn')
return 1
)lua";

// ARGV: 2 max probes, 3 window (us). Reply: {1, 0} a probe; {0, retry
// after (us)} refused; {2, 0} closed.
inline constexpr const char* redis_lua_fleet_probe = R"lua(
local r = redis.call('HMGET', KEYS[1], 'b', 'pw', 'pn')
local b = tonumber(r[1])
if not b then return {2, 0} end
if b > now then return {0, b - now} end
local window = tonumber(ARGV[3])
local pw, pn = tonumber(r[2]), tonumber(r[3]) or 0
if not pw or now >= pw + window then pw = now; pn = 0 end
if pn >= tonumber(ARGV[2]) then return {0, pw + window - now} end
redis.call('HSET', KEYS[1], 'pw', num(pw), 'pn', pn + 1)
return {1, 0}
)lua";

inline const redis_script& fleet_script(int which) {
  static const redis_script read{absl::StrCat(redis_lua_fleet_prelude, redis_lua_fleet_read)};
  static const redis_script publish{absl::StrCat(redis_lua_fleet_prelude, redis_lua_fleet_publish)};
  static const redis_script close{absl::StrCat(redis_lua_fleet_prelude, redis_lua_fleet_close)};
  static const redis_script probe{absl::StrCat(redis_lua_fleet_prelude, redis_lua_fleet_probe)};
  switch (which) {
    case 0: return read;
    case 1: return publish;
    case 2: return close;
    default: return probe;
  }
}

// The domain's hash: the prefix, "fleet:", then inside one hash tag each
// scoped label as a letter, its length, ':' and its bytes, e.g.
// "svc:fleet:{e12:api.provider,m7:m-large}". Not the display name
// ("endpoint=api.provider,model=m-large"): labels may hold ',' and '=', and
// two domains must never share a hash (tests/fuzz/store_keys_fuzz.cpp).
[[nodiscard]] inline std::string redis_fleet_key(std::string_view prefix, const failure_domain& d,
                                                 const breaker_scope& scope) {
  std::string k = absl::StrCat(to_absl(prefix), "fleet:{");
  bool first = true;
  const auto part = [&](bool on, std::string_view letter, std::string_view v) {
    if (!on) return;
    absl::StrAppend(&k, first ? "" : ",", to_absl(letter), v.size(), ":", to_absl(v));
    first = false;
  };
  part(scope.endpoint, "e", d.endpoint);
  part(scope.model, "m", d.model);
  part(scope.region, "r", d.region);
  part(scope.tenant, "t", d.tenant);
  k += '}';
  return k;
}

}  // namespace detail

class shared_provider_state {
  static constexpr std::int64_t none = INT64_MIN;  // "no such time": closed, no cooldown

 public:
  // Does not connect. `breakers` (optional) is the registry whose breakers'
  // openings are published and whose scope makes the domains. Throws
  // keel::invalid_options if either options struct is invalid.
  shared_provider_state(redis_options redis, shared_provider_state_options o, breaker_registry* breakers = nullptr)
      : redis_((detail::require_valid(redis.validate()), std::move(redis))),
        options_((detail::require_valid(o.validate()), std::move(o))),
        breakers_(breakers),
        scope_(breakers != nullptr ? breakers->options().scope : options_.scope),
        who_("shared provider state"),
        owner_(owner_id::random().hex()),
        forget_arg_(std::to_string(detail::redis_us(options_.forget_after))),
        probes_arg_(std::to_string(options_.max_probes)),
        window_arg_(std::to_string(detail::redis_us(options_.probe_window))),
        table_(static_cast<std::size_t>(options_.max_domains)),
        pool_(static_cast<std::size_t>(redis_.pool_size), [this] { return connect(); }) {}
  shared_provider_state(const shared_provider_state&) = delete;
  shared_provider_state& operator=(const shared_provider_state&) = delete;

  [[nodiscard]] const shared_provider_state_options& options() const noexcept { return options_; }
  [[nodiscard]] const breaker_scope& scope() const noexcept { return scope_; }

  // Round trips made, Redis failures, and lookups of domains beyond max_domains.
  [[nodiscard]] std::uint64_t round_trips() const noexcept { return trips_.load(std::memory_order_relaxed); }
  [[nodiscard]] std::uint64_t redis_failures() const noexcept { return failures_.load(std::memory_order_relaxed); }
  [[nodiscard]] std::uint64_t overflowed() const noexcept { return overflowed_.load(std::memory_order_relaxed); }
  // True while Redis is held off after a failure (at `now`, this replica's clock).
  [[nodiscard]] bool deciding_alone(time_point now) const noexcept { return held(now); }

  // ---- standalone: one round trip each, bypassing the cache (and updating it) ----

  [[nodiscard]] absl::StatusOr<fleet_provider_view> read(const failure_domain& d, time_point now) {
    entry* e = entry_for(d);
    if (e == nullptr) return overflow_error();
    return read(*e, now);
  }
  // Publishes the fleet's breaker open for `for_how_long` (at least: a later
  // end already published stays).
  [[nodiscard]] absl::Status publish_open(const failure_domain& d, duration for_how_long, time_point now) {
    entry* e = entry_for(d);
    if (e == nullptr) return overflow_error();
    return publish(*e, 'b', for_how_long, now);
  }
  // Publishes a cooldown the provider asked for (clipped to max_cooldown).
  [[nodiscard]] absl::Status publish_cooldown(const failure_domain& d, duration for_how_long, time_point now) {
    entry* e = entry_for(d);
    if (e == nullptr) return overflow_error();
    return publish(*e, 'c', std::min(for_how_long, options_.max_cooldown), now);
  }
  // Closes the fleet's breaker after a probe succeeded (unless it opened
  // again meanwhile: then false).
  [[nodiscard]] absl::StatusOr<bool> publish_closed(const failure_domain& d, time_point now) {
    entry* e = entry_for(d);
    if (e == nullptr) return overflow_error();
    return close(*e, now);
  }
  // Fleet half-open: asks for one of the window's probe tokens.
  [[nodiscard]] absl::StatusOr<fleet_probe> try_probe(const failure_domain& d, time_point now) {
    entry* e = entry_for(d);
    if (e == nullptr) return overflow_error();
    duration wait{};
    return probe(*e, now, wait);
  }

  // ---- the policy ----

  template <class Ctx, class Next>
  auto execute(Ctx& ctx, attempt_plan plan, Next& next) -> decltype(next(ctx, plan)) {
    using R = decltype(next(ctx, plan));
    entry* e = entry_for(failure_domain::of(ctx.call.labels(), scope_));
    if (e == nullptr) return next(ctx, plan);
    const std::int64_t t = plan.now.time_since_epoch().count();
    if (t >= e->fresh_until.load(std::memory_order_acquire)) refresh(ctx, *e, plan.now);
    if (const std::int64_t c = e->cooldown_until.load(std::memory_order_acquire); t < c)
      return R(refuse(ctx, *e, fleet_signal::cooldown, duration(c - t)));
    bool probing = false;
    if (const std::int64_t b = e->breaker_until.load(std::memory_order_acquire); b != none) {
      if (t < b) return R(refuse(ctx, *e, fleet_signal::breaker_open, duration(b - t)));
      if (!held(plan.now)) {
        duration wait{};
        absl::StatusOr<fleet_probe> p = probe(*e, plan.now, wait);
        if (!p.ok()) {
          observe(ctx.listener, events::fleet_state_unavailable{e->domain, p.status()});
        } else if (*p == fleet_probe::refused) {
          return R(refuse(ctx, *e, fleet_signal::probing, wait));
        } else {
          probing = *p == fleet_probe::granted;
        }
      }
    }
    R r = next(ctx, plan);
    after(ctx, *e, plan.now, status_of(r), probing);
    return r;
  }

 private:
  struct key {
    std::string endpoint, model, region, tenant;
    [[nodiscard]] bool equals(const failure_domain& d) const noexcept {
      return detail::key_equals(endpoint, d.endpoint) && detail::key_equals(model, d.model) &&
             detail::key_equals(region, d.region) && detail::key_equals(tenant, d.tenant);
    }
  };
  struct entry {
    entry(std::string d, std::string key) : domain(std::move(d)), state_key(std::move(key)) {}
    std::string domain, state_key;
    std::atomic<std::int64_t> fresh_until{none};     // local clock: the cached state is good until
    std::atomic<std::int64_t> breaker_until{none};   // local clock: the fleet's breaker open until (none: closed)
    std::atomic<std::int64_t> cooldown_until{none};  // local clock
    std::atomic<std::int64_t> published_until{none}; // the local breaker's open period, published until
    std::atomic<circuit_breaker*> breaker{nullptr};
  };

  [[nodiscard]] failure_domain scoped(const failure_domain& d) const noexcept {
    return {scope_.endpoint ? d.endpoint : std::string_view{}, scope_.model ? d.model : std::string_view{},
            scope_.region ? d.region : std::string_view{}, scope_.tenant ? d.tenant : std::string_view{}};
  }

  entry* entry_for(const failure_domain& raw) {
    const failure_domain d = scoped(raw);
    const std::size_t h =
        detail::key_hash(d.tenant, detail::key_hash(d.region, detail::key_hash(d.model, detail::key_hash(d.endpoint))));
    auto matches = [&](const key& k) { return k.equals(d); };
    if (entry* e = table_.find(h, matches)) return e;
    entry* e = table_.size() >= table_.capacity()
                   ? nullptr
                   : table_.find_or_insert(
                         h, matches,
                         [&] { return key{std::string(d.endpoint), std::string(d.model), std::string(d.region),
                                          std::string(d.tenant)}; },
                         [&] {
                           std::string name = d.to_string(scope_);
                           if (name.empty()) name = "(no labels)";
                           return entry(std::move(name), detail::redis_fleet_key(redis_.key_prefix, d, scope_));
                         });
    if (e == nullptr) overflowed_.fetch_add(1, std::memory_order_relaxed);
    return e;
  }

  [[nodiscard]] static absl::Status overflow_error() {
    return absl::ResourceExhaustedError(
        "keel: shared provider state: max_domains domains are shared already; this one is not");
  }

  [[nodiscard]] bool held(time_point now) const noexcept {
    return now.time_since_epoch().count() < hold_until_.load(std::memory_order_acquire);
  }

  absl::StatusOr<std::unique_ptr<detail::redis_connection>> connect() {
    return detail::redis_connection::connect(endpoint_, who_);
  }

  // One script on the domain's key; a failure holds Redis off.
  template <std::size_t N>
  absl::StatusOr<detail::redis_reply> run(int which, entry& e, const std::array<std::string_view, N>& argv,
                                          time_point now, detail::redis_effect effect) {
    trips_.fetch_add(1, std::memory_order_relaxed);
    absl::StatusOr<detail::redis_reply> r;
    {
      absl::StatusOr<detail::client_pool<detail::redis_connection>::handle> h =
          pool_.acquire_alive(redis_.acquire_timeout, who_);
      if (!h.ok()) {
        r = h.status();
      } else {
        const std::int64_t offset =
            redis_.testing_clock_offset ? redis_.testing_clock_offset->load(std::memory_order_relaxed) / 1000 : 0;
        const detail::redis_num off(offset);
        std::array<std::string_view, N + 2> args{e.state_key, off.view()};
        std::copy(argv.begin(), argv.end(), args.begin() + 2);
        r = (*h)->eval(detail::fleet_script(which), args, effect, "fleet state");
        if ((*h)->broken()) h->mark_broken();
      }
    }
    if (!r.ok()) {
      failures_.fetch_add(1, std::memory_order_relaxed);
      hold_until_.store((now + options_.fallback_hold).time_since_epoch().count(), std::memory_order_release);
    }
    return r;
  }

  static duration from_us(std::int64_t us) {
    return std::chrono::duration_cast<duration>(std::chrono::microseconds(us));
  }

  absl::StatusOr<fleet_provider_view> read(entry& e, time_point now) {
    absl::StatusOr<detail::redis_reply> r = run(0, e, std::array<std::string_view, 0>{}, now, detail::redis_effect::read);
    if (!r.ok()) return r.status();
    const redisReply* x = r->get();
    fleet_provider_view v{.breaker_known = detail::reply_int(x, 0) == 1,
                          .breaker_remaining = from_us(detail::reply_int(x, 1)),
                          .cooldown_remaining = from_us(detail::reply_int(x, 2))};
    const std::int64_t t = now.time_since_epoch().count();
    e.breaker_until.store(v.breaker_known ? t + v.breaker_remaining.count() : none, std::memory_order_release);
    e.cooldown_until.store(v.cooldown_remaining > duration::zero() ? t + v.cooldown_remaining.count() : none,
                           std::memory_order_release);
    return v;
  }

  absl::Status publish(entry& e, char field, duration for_how_long, time_point now) {
    const std::string_view f = field == 'b' ? "b" : "c";
    const detail::redis_num us(detail::redis_us(std::max(for_how_long, duration(1))));
    absl::StatusOr<detail::redis_reply> r =
        run(1, e, std::array<std::string_view, 4>{f, us.view(), owner_, forget_arg_}, now, detail::redis_effect::write);
    if (!r.ok()) return r.status();
    const std::int64_t until = now.time_since_epoch().count() + from_us((*r)->integer).count();
    std::atomic<std::int64_t>& slot = field == 'b' ? e.breaker_until : e.cooldown_until;
    slot.store(until, std::memory_order_release);
    return absl::OkStatus();
  }

  absl::StatusOr<bool> close(entry& e, time_point now) {
    absl::StatusOr<detail::redis_reply> r = run(2, e, std::array<std::string_view, 0>{}, now, detail::redis_effect::write);
    if (!r.ok()) return r.status();
    if ((*r)->integer >= 0) e.breaker_until.store(none, std::memory_order_release);
    return (*r)->integer >= 0;
  }

  absl::StatusOr<fleet_probe> probe(entry& e, time_point now, duration& wait) {
    absl::StatusOr<detail::redis_reply> r =
        run(3, e, std::array<std::string_view, 2>{probes_arg_, window_arg_}, now, detail::redis_effect::write);
    if (!r.ok()) return r.status();
    const std::int64_t k = detail::reply_int(r->get(), 0);
    wait = from_us(detail::reply_int(r->get(), 1));
    if (k == 2) {
      e.breaker_until.store(none, std::memory_order_release);
      return fleet_probe::closed;
    }
    return k == 1 ? fleet_probe::granted : fleet_probe::refused;
  }

  // The thread that finds the cache stale claims the refresh (one CAS); the
  // others go on with what is cached.
  template <class Ctx>
  void refresh(Ctx& ctx, entry& e, time_point now) {
    const std::int64_t t = now.time_since_epoch().count();
    std::int64_t f = e.fresh_until.load(std::memory_order_acquire);
    if (t < f || held(now)) return;
    if (!e.fresh_until.compare_exchange_strong(f, t + options_.refresh_every.count(), std::memory_order_acq_rel))
      return;
    absl::StatusOr<fleet_provider_view> v = read(e, now);
    if (!v.ok()) observe(ctx.listener, events::fleet_state_unavailable{e.domain, v.status()});
  }

  template <class Ctx>
  absl::Status refuse(Ctx& ctx, const entry& e, fleet_signal why, duration wait) const {
    observe(ctx.listener, events::fleet_state_refused{ctx.call, e.domain, why});
    absl::Status s;
    switch (why) {
      case fleet_signal::cooldown:
        s = absl::ResourceExhaustedError(
            absl::StrCat("keel: the provider asked the fleet to wait (domain '", e.domain, "')"));
        break;
      case fleet_signal::breaker_open:
        s = absl::UnavailableError(absl::StrCat("keel: the fleet's circuit breaker for '", e.domain, "' is open"));
        break;
      default:
        s = absl::UnavailableError(absl::StrCat("keel: the fleet's circuit breaker for '", e.domain,
                                                "' is half-open and this window's probes are out"));
        break;
    }
    return keel::refusal(std::move(s), absl::StrCat("fleet:", e.domain, ":", detail::to_absl(to_string(why))), wait);
  }

  template <class Ctx>
  void after(Ctx& ctx, entry& e, time_point now, const absl::Status& s, bool probing) {
    const outcome_kind kind = ctx.classify(s);
    if (probing && !held(now)) {
      if (kind == outcome_kind::success) {
        if (close(e, now).ok()) observe(ctx.listener, events::fleet_state_published{e.domain, fleet_signal::closed, {}});
      } else if (kind == outcome_kind::transient || kind == outcome_kind::ambiguous) {
        if (publish(e, 'b', options_.reopen_for, now).ok())
          observe(ctx.listener, events::fleet_state_published{e.domain, fleet_signal::breaker_open, options_.reopen_for});
      }
    }
    if (kind == outcome_kind::throttled && !held(now)) {
      if (std::optional<duration> hint = retry_after(s); hint && *hint > duration::zero()) {
        const duration d = std::min(*hint, options_.max_cooldown);
        if (now.time_since_epoch().count() + d.count() > e.cooldown_until.load(std::memory_order_acquire) &&
            publish(e, 'c', d, now).ok())
          observe(ctx.listener, events::fleet_state_published{e.domain, fleet_signal::cooldown, d});
      }
    }
    if (breakers_ == nullptr) return;
    circuit_breaker* b = e.breaker.load(std::memory_order_acquire);
    if (b == nullptr) {
      b = breakers_->find(failure_domain::of(ctx.call.labels(), scope_));
      if (b == nullptr) return;
      e.breaker.store(b, std::memory_order_release);
    }
    const breaker_state st = b->state();
    if (st != breaker_state::open && st != breaker_state::forced_open) return;
    std::int64_t published = e.published_until.load(std::memory_order_acquire);
    const std::int64_t t = now.time_since_epoch().count();
    if (t < published || held(now)) return;
    const duration left = st == breaker_state::open ? b->figures(now).open_remaining : options_.reopen_for;
    if (left <= duration::zero()) return;
    // One publisher per open period.
    if (!e.published_until.compare_exchange_strong(published, t + left.count(), std::memory_order_acq_rel)) return;
    if (publish(e, 'b', left, now).ok())
      observe(ctx.listener, events::fleet_state_published{e.domain, fleet_signal::breaker_open, left});
  }

  redis_options redis_;
  detail::redis_endpoint endpoint_ = redis_.endpoint();  // made once: its connects share the primary hint
  shared_provider_state_options options_;
  breaker_registry* breakers_;
  breaker_scope scope_;
  std::string who_;
  std::string owner_;
  std::string forget_arg_, probes_arg_, window_arg_;
  detail::keyed_table<key, entry> table_;
  detail::client_pool<detail::redis_connection> pool_;
  std::atomic<std::int64_t> hold_until_{INT64_MIN};
  std::atomic<std::uint64_t> trips_{0}, failures_{0}, overflowed_{0};
};

}  // namespace keel
