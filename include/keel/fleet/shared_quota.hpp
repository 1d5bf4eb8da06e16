// keel/fleet/shared_quota.hpp — one rate limit shared by every replica of a
// service, kept in Redis, with a local fallback when Redis cannot answer.
//
// A provider's limit (say 500 requests/s to one model endpoint) belongs to
// the fleet, not to a replica: K replicas with local limiters of 500/s each
// would send K times too much. keel::shared_quota keeps the limit's state in
// Redis as a GCRA ("generic cell rate algorithm") token bucket: one key
// holds the theoretical arrival time of the next unit, and one Lua script
// (one round trip, atomic on the server, timed by the server's TIME) takes
// units if the bucket holds them. Together the replicas admit at most
// `burst` units at once and `rate` units per `per` sustained, exactly,
// whatever the contention.
//
// When Redis cannot be reached (refused, timed out, cut off), the decision
// falls back to a local token bucket with `fallback_rate` / `fallback_burst`
// (configure roughly rate / replicas), and stays on it for `fallback_hold`
// before asking Redis again, so an outage does not add a timeout to every
// call. A fallback decision says so: decision.source == quota_source::fallback
// with the Redis error, its refusal names "shared:<name>:fallback" and says
// Redis was unreachable, and the policy reports events::shared_quota_fallback.
//
// As one more level of admission (keel/policy/admission.hpp): place it in the
// pipeline after keel::admission and inside keel::retry, so that the local
// levels (cheap, lock-free) refuse first, and every provider attempt spends
// one unit of the provider's shared limit:
//
//   keel::admission quotas({.tenant_defaults = {.rate = 20, .max_in_flight = 8}});
//   keel::shared_quota provider({.port = 6379, .key_prefix = "svc:", .command_timeout = 50ms},
//                               {.name = "openai:gpt-4o", .rate = 500, .burst = 50, .fallback_rate = 500.0 / 8});
//   auto pipe = keel::pipeline(quotas, keel::retry({.max_attempts = 3}), provider, timeouts);
//
// Its refusal is like admission's: ResourceExhausted, not started, refused-by
// "shared:<name>:rate" (or ":fallback"), retry-after = when the bucket will
// hold the units. A replayed call (served from an idempotency record)
// spends no provider capacity and is not charged (charge_replays).
//
// Admission across the levels is all-or-nothing, in both directions: when
// this level refuses, keel::admission outside it rolls back what it took
// (slots, compute, and the rate tokens); when a level inside this one
// refuses the pass before any attempt began (a breaker, no time left),
// this level refunds its unit (one more round trip, on that refusal only).
//
// Standalone, after keel::admission:
//
//   absl::StatusOr<keel::admission_ticket> t = quotas.admit({.tenant = "acme"}, now);
//   if (!t.ok()) return t.status();
//   keel::shared_quota_decision d = provider.try_acquire(now);
//   if (!d) {
//     t->roll_back();  // the tenant's token and slot go back
//     return keel::shared_quota::refusal(provider.name(), d);
//   }
//
// Tokens as the unit (a provider's tokens-per-minute limit): give the
// quota a rate in tokens and reserve an estimate per attempt, settled to
// what the attempt charged its call (keel::attempt::charge; a stream
// charges its usage chunk, else its counted tokens, keel/compose/stream.hpp):
//
//   keel::shared_quota tpm(redis, {.name = "openai:gpt-4o:tpm", .rate = 450'000, .per = 1min,
//                                  .burst = 60'000, .fallback_rate = 450'000.0 / 8, .fallback_burst = 8'000});
//   auto pipe = keel::pipeline(quotas, keel::retry({.max_attempts = 3}),
//                              tpm.with_estimate([](const keel::call& c) { return input_tokens(c) + max_tokens(c); }));
//
// Each pass reserves the estimate (at most the burst: a bucket never holds
// more) and, when the attempt returns, settles: the difference to the
// call's cost in that pass is refunded, or charged unconditionally (the
// bucket goes into debt, which later reservations wait off), so the fleet's
// tokens per window hold under concurrency. A pass refused further in
// before any work (no attempt begun, no cost) gets its whole reservation
// back. Settling is one more round trip, unless the estimate was exact.
// Standalone: try_acquire(now, estimate), then settle(decision, estimate, actual).
//
// Cost: one Redis round trip per decision (none while holding the fallback).
//
// Thread-safety: every operation may be called from any thread; at most
// pool_size Redis commands run at once.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "keel/core/call.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/policy.hpp"
#include "keel/core/status.hpp"
#include "keel/core/telemetry.hpp"
#include "keel/store/internal/client_pool.hpp"
#include "keel/store/internal/redis_connection.hpp"
#include "keel/durable/ownership.hpp"
#include "keel/policy/rate_limiter.hpp"
#include "keel/store/redis.hpp"

namespace keel {

struct shared_quota_options {
  // The limit's name, shared by every replica (a key part: 1-255 bytes, no
  // control characters), for example "provider:openai:gpt-4o".
  std::string name{};
  // Fleet-wide: units per `per` sustained, and units at once from a full bucket.
  double rate = 100.0;          // (0, 1e6] per second
  duration per = std::chrono::seconds(1);  // > 0
  double burst = 1.0;           // >= 1
  // This replica alone, while Redis cannot answer; fallback_rate must be set
  // (> 0), typically rate / replicas.
  double fallback_rate = 0.0;
  double fallback_burst = 1.0;  // >= 1
  // After Redis failed, decide locally this long before asking it again; [0, 1 h].
  duration fallback_hold = std::chrono::seconds(1);
  // Charge calls marked replayed (the policy); off: replays spend no provider capacity.
  bool charge_replays = false;

  [[nodiscard]] absl::Status validate() const {
    constexpr std::string_view who = "shared_quota_options";
    if (absl::Status k = validate_key("shared quota name", name); !k.ok())
      return detail::invalid_field(who, "name", "be 1-255 bytes without control characters", k.message());
    if (per <= duration::zero()) return detail::invalid_field(who, "per", "be > 0", per);
    const double per_second = rate / std::chrono::duration<double>(per).count();
    if (!(rate > 0.0) || !(per_second <= 1e6))
      return detail::invalid_field(who, "rate", "be in (0, 1e6] units per second", per_second);
    if (!(burst >= 1.0) || !std::isfinite(burst)) return detail::invalid_field(who, "burst", "be a finite number >= 1", burst);
    if (!(fallback_rate > 0.0))
      return detail::invalid_field(who, "fallback_rate", "be set (> 0): the local limit while Redis is unreachable",
                                   fallback_rate);
    const double fallback_per_second = fallback_rate / std::chrono::duration<double>(per).count();
    if (!(fallback_per_second <= 1e6))
      return detail::invalid_field(who, "fallback_rate", "be at most 1e6 units per second", fallback_per_second);
    if (!(fallback_burst >= 1.0) || !std::isfinite(fallback_burst))
      return detail::invalid_field(who, "fallback_burst", "be a finite number >= 1", fallback_burst);
    if (fallback_burst / fallback_per_second > 1e8)
      return detail::invalid_field(who, "fallback_burst", "be at most 1e8 seconds of fallback_rate", fallback_burst);
    if (fallback_hold < duration::zero() || fallback_hold > std::chrono::hours(1))
      return detail::invalid_field(who, "fallback_hold", "be in [0, 1h]", fallback_hold);
    // Implied by the checks above; kept so the fallback bucket can never be built invalid.
    return rate_limiter_options{.rate = fallback_rate, .per = per, .burst = fallback_burst}.validate();
  }
};

// Where a decision came from.
enum class quota_source {
  shared,    // Redis: the fleet-wide bucket
  fallback,  // the local bucket, because Redis could not answer
};

struct shared_quota_decision {
  bool granted = false;
  duration retry_after{};  // refused: when the bucket will hold the units
  quota_source source = quota_source::shared;
  absl::Status redis_error{};  // fallback: why Redis was not used (the last failure)
  [[nodiscard]] explicit operator bool() const noexcept { return granted; }
};

namespace events {

// A decision was made on the local fallback bucket.
struct shared_quota_fallback {
  std::string_view name;
  const absl::Status& redis_error;
};
// The shared quota refused a pass of `call`.
struct shared_quota_refused {
  const keel::call& call;
  std::string_view name;
  quota_source source;
};

}  // namespace events

namespace detail {

// The quota's key: the prefix, "quota:", the name inside one hash tag (a
// prefix may not hold '{': see detail::redis_record_key).
[[nodiscard]] inline std::string redis_quota_key(std::string_view prefix, std::string_view name) {
  return absl::StrCat(to_absl(prefix), "quota:{", to_absl(name), "}");
}

// KEYS[1] the bucket. ARGV: 1 test offset (us), 2 interval (us per unit),
// 3 tolerance (burst * interval, us), 4 units (negative: a refund),
// 5 (optional) "1": take them unconditionally, into debt (a settlement).
// Reply: {granted 1/0, retry after (us)}.
inline constexpr const char* redis_lua_gcra = R"lua(
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2]) + tonumber(ARGV[1])
local interval, tolerance, n = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local tat = tonumber(redis.call('GET', KEYS[1])) or now
if tat < now then tat = now end
local new = tat + n * interval
if n > 0 and ARGV[5] ~= '1' and new - now > tolerance then return {0, math.ceil(new - now - tolerance)} end
if new < now then new = now end
redis.call('SET', KEYS[1], string.format('%.17g', new), 'PX', math.ceil((new - now) / 1000) + 1000)
return {1, 0}
)lua";

inline const redis_script& gcra_script() {
  static const redis_script s{std::string(redis_lua_gcra)};
  return s;
}

}  // namespace detail

class shared_quota {
 public:
  // Does not connect: Redis may be down when the service starts (the
  // fallback decides until it is back). Throws keel::invalid_options if
  // either options struct is invalid.
  shared_quota(redis_options redis, shared_quota_options o)
      : redis_((detail::require_valid(redis.validate()), std::move(redis))),
        options_((detail::require_valid(o.validate()), std::move(o))),
        key_(detail::redis_quota_key(redis_.key_prefix, options_.name)),
        who_(absl::StrCat("shared quota '", options_.name, "'")),
        interval_us_(std::chrono::duration<double, std::micro>(options_.per).count() / options_.rate),
        tolerance_us_(interval_us_ * options_.burst),
        interval_arg_(absl::StrFormat("%.17g", interval_us_)),
        tolerance_arg_(absl::StrFormat("%.17g", tolerance_us_)),
        fallback_({.rate = options_.fallback_rate, .per = options_.per, .burst = options_.fallback_burst}),
        pool_(static_cast<std::size_t>(redis_.pool_size), [this] { return connect(); }) {}
  shared_quota(const shared_quota&) = delete;
  shared_quota& operator=(const shared_quota&) = delete;

  [[nodiscard]] const shared_quota_options& options() const noexcept { return options_; }
  [[nodiscard]] std::string_view name() const noexcept { return options_.name; }
  // Decisions made by Redis / by the fallback, and Redis failures, so far.
  [[nodiscard]] std::uint64_t shared_decisions() const noexcept { return shared_.load(std::memory_order_relaxed); }
  [[nodiscard]] std::uint64_t fallback_decisions() const noexcept { return fallbacks_.load(std::memory_order_relaxed); }
  [[nodiscard]] std::uint64_t redis_failures() const noexcept { return failures_.load(std::memory_order_relaxed); }

  // Takes `units` (> 0) from the fleet's bucket, or from the local fallback
  // when Redis cannot answer (or failed less than fallback_hold before
  // `now`). `now` is this replica's clock: it times the fallback only; the
  // shared bucket runs on the server's clock.
  [[nodiscard]] shared_quota_decision try_acquire(time_point now, double units = 1.0) {
    if (now.time_since_epoch().count() >= hold_until_.load(std::memory_order_acquire)) {
      absl::StatusOr<detail::redis_reply> r = eval(units);
      if (r.ok()) {
        shared_.fetch_add(1, std::memory_order_relaxed);
        const redisReply* x = r->get();
        return {.granted = detail::reply_int(x, 0) == 1,
                .retry_after = std::chrono::duration_cast<duration>(std::chrono::microseconds(detail::reply_int(x, 1))),
                .source = quota_source::shared};
      }
      failures_.fetch_add(1, std::memory_order_relaxed);
      hold_until_.store((now + options_.fallback_hold).time_since_epoch().count(), std::memory_order_release);
      std::lock_guard lock(mu_);
      last_error_ = r.status();
    }
    fallbacks_.fetch_add(1, std::memory_order_relaxed);
    const rate_decision d = fallback_.try_acquire(now, units);
    std::lock_guard lock(mu_);
    return {.granted = d.granted, .retry_after = d.retry_after, .source = quota_source::fallback, .redis_error = last_error_};
  }

  // Gives `units` back (another level of an all-or-nothing admission
  // refused after this one granted), to whichever bucket granted them.
  void refund(const shared_quota_decision& d, double units = 1.0) {
    if (!d.granted) return;
    if (d.source == quota_source::fallback) {
      fallback_.refund(units);
      return;
    }
    (void)eval(-units);  // best effort: if Redis is gone the units are lost, never doubled
  }

  // Takes `units` (> 0) unconditionally from whichever bucket granted `d`:
  // the bucket may go into debt, which later decisions wait off. Best
  // effort against Redis, like refund().
  void charge(const shared_quota_decision& d, time_point now, double units) {
    if (!d.granted || !(units > 0.0)) return;
    if (d.source == quota_source::fallback) {
      fallback_.charge(now, units);
      return;
    }
    (void)eval(units, true);
  }

  // Settles a grant of `reserved` units to the `actual` cost: refunds the
  // difference, or charges the excess unconditionally.
  void settle(const shared_quota_decision& d, time_point now, double reserved, double actual) {
    if (actual < reserved) refund(d, reserved - actual);
    if (actual > reserved) charge(d, now, actual - reserved);
  }

  // The units a reservation of `estimate` takes: at most the burst (a bucket
  // never holds more; the rest is charged when it settles), at least one.
  [[nodiscard]] double reservation(double estimate) const noexcept {
    return std::clamp(estimate, 1.0, options_.burst);
  }

  template <class Estimator>
  class estimate_policy;

  // The policy reserving estimator(call) units per pass (for example the
  // request's input tokens plus its max_tokens) and settling each pass to
  // the cost its attempts charged the call. Refers to this quota, which
  // must outlive it.
  template <class Estimator>
  [[nodiscard]] estimate_policy<Estimator> with_estimate(Estimator estimator) {
    return estimate_policy<Estimator>(*this, std::move(estimator));
  }

  // The status for a refused decision (allocates: refusal paths only).
  [[nodiscard]] static absl::Status refusal(std::string_view name, const shared_quota_decision& d) {
    const bool local = d.source == quota_source::fallback;
    absl::Status s = absl::ResourceExhaustedError(
        local ? absl::StrCat("keel: shared quota '", detail::to_absl(name),
                             "' is over its local fallback limit (Redis unreachable: ", d.redis_error.message(), ")")
              : absl::StrCat("keel: shared quota '", detail::to_absl(name), "' is over its rate"));
    s = with_retry_after(std::move(s), d.retry_after);
    return with_refused_by(mark_not_started(std::move(s)),
                           absl::StrCat("shared:", detail::to_absl(name), local ? ":fallback" : ":rate"));
  }

  // The policy: one unit per pass (place it inside keel::retry to charge
  // every attempt). A pass that comes back marked not started with no
  // attempt begun and no cost charged (a level further in refused it)
  // refunds its unit.
  template <class Ctx, class Next>
  auto execute(Ctx& ctx, const attempt_plan& plan, Next& next) -> decltype(next(ctx, plan)) {
    using R = decltype(next(ctx, plan));
    const call_record before = ctx.call.record();
    if (!options_.charge_replays && before.replayed) return next(ctx, plan);
    const shared_quota_decision d = try_acquire(plan.now);
    if (d.source == quota_source::fallback) observe(ctx.listener, events::shared_quota_fallback{name(), d.redis_error});
    if (!d) {
      observe(ctx.listener, events::shared_quota_refused{ctx.call, name(), d.source});
      return R(refusal(name(), d));
    }
    R r = next(ctx, plan);
    if (const absl::Status& s = status_of(r); !s.ok() && not_started(s)) {
      const call_record after = ctx.call.record();
      if (after.attempts == before.attempts && after.cost == before.cost) refund(d);
    }
    return r;
  }

 private:
  absl::StatusOr<std::unique_ptr<detail::redis_connection>> connect() {
    return detail::redis_connection::connect(endpoint_, who_);
  }

  absl::StatusOr<detail::redis_reply> eval(double units, bool force = false) {
    absl::StatusOr<detail::client_pool<detail::redis_connection>::handle> h =
        pool_.acquire_alive(redis_.acquire_timeout, who_);
    if (!h.ok()) return h.status();
    const std::int64_t offset =
        redis_.testing_clock_offset ? redis_.testing_clock_offset->load(std::memory_order_relaxed) / 1000 : 0;
    const detail::redis_num off(offset);
    // One unit (the common case) without formatting a number.
    const std::string n = units == 1.0 ? std::string() : absl::StrFormat("%.17g", units);
    const std::string_view count = units == 1.0 ? std::string_view("1") : std::string_view(n);
    absl::StatusOr<detail::redis_reply> r =
        force ? (*h)->eval(detail::gcra_script(),
                           std::array<std::string_view, 6>{key_, off.view(), interval_arg_, tolerance_arg_, count, "1"},
                           detail::redis_effect::write, "charge")
              : (*h)->eval(detail::gcra_script(),
                           std::array<std::string_view, 5>{key_, off.view(), interval_arg_, tolerance_arg_, count},
                           detail::redis_effect::write, "acquire");
    if ((*h)->broken()) h->mark_broken();
    return r;
  }

  redis_options redis_;
  detail::redis_endpoint endpoint_ = redis_.endpoint();  // made once: its connects share the primary hint
  shared_quota_options options_;
  std::string key_;
  std::string who_;
  double interval_us_;
  double tolerance_us_;
  std::string interval_arg_, tolerance_arg_;
  rate_limiter fallback_;
  detail::client_pool<detail::redis_connection> pool_;
  std::atomic<std::int64_t> hold_until_{INT64_MIN};
  std::atomic<std::uint64_t> shared_{0}, fallbacks_{0}, failures_{0};
  std::mutex mu_;
  absl::Status last_error_;
};

template <class Estimator>
class shared_quota::estimate_policy {
 public:
  estimate_policy(shared_quota& quota, Estimator estimator) : quota_(&quota), estimator_(std::move(estimator)) {}

  [[nodiscard]] shared_quota& quota() const noexcept { return *quota_; }

  template <class Ctx, class Next>
  auto execute(Ctx& ctx, const attempt_plan& plan, Next& next) const -> decltype(next(ctx, plan)) {
    using R = decltype(next(ctx, plan));
    shared_quota& q = *quota_;
    const call_record before = ctx.call.record();
    if (!q.options_.charge_replays && before.replayed) return next(ctx, plan);
    const double units = q.reservation(static_cast<double>(estimator_(std::as_const(ctx.call))));
    const shared_quota_decision d = q.try_acquire(plan.now, units);
    if (d.source == quota_source::fallback) observe(ctx.listener, events::shared_quota_fallback{q.name(), d.redis_error});
    if (!d) {
      observe(ctx.listener, events::shared_quota_refused{ctx.call, q.name(), d.source});
      return R(refusal(q.name(), d));
    }
    R r = next(ctx, plan);
    const call_record after = ctx.call.record();
    const std::int64_t cost = after.cost - before.cost;
    if (const absl::Status& s = status_of(r); !s.ok() && not_started(s) && after.attempts == before.attempts && cost == 0) {
      q.refund(d, units);  // refused further in: no work, nothing kept
    } else {
      q.settle(d, ctx.attempt_end(plan.now), units, static_cast<double>(cost));
    }
    return r;
  }

 private:
  shared_quota* quota_;
  Estimator estimator_;
};

}  // namespace keel
