// keel/policy/breaker_registry.hpp — one circuit breaker per failure domain.
//
// A breaker must be scoped to what actually fails. A provider endpoint, one
// model on it or one region is a failure domain; so is a tenant, for faults
// that belong to a tenant (a revoked key, an exhausted account). The
// registry keeps a keel::circuit_breaker per domain, made on first use from
// one set of options, and names each after its domain
// ("endpoint=api.example,model=m-large,region=eu").
//
// A domain may have options of its own: breaker_for(domain, options) makes
// its breaker from them (a deployment with its own thresholds).
//
// The domain comes from the labels of a keel::call (keel/core/call.hpp); `scope`
// says which labels make it up. Two registries with different scopes can
// sit in one pipeline: a provider-wide breaker that ignores permanent errors
// and a per-tenant one that counts them.
//
// Bounded: at most `max_breakers` domains get their own breaker. Once full,
// further domains share one overflow breaker named "(overflow)" (so they are
// still protected, if more coarsely) and overflowed() counts those lookups.
// Operator controls never touch that shared breaker: forcing a domain that
// has no breaker of its own gives it one from a separate reserve of
// `operator_breakers`, so the action affects that domain alone (and, when
// even the reserve is used up, is refused with a status saying so).
// Breakers are never removed, so a reference to one stays valid for the
// registry's lifetime.
//
// Example:
//
//   keel::breaker_registry providers({.breaker = {.minimum_calls = 20, .open_duration = 10s}});
//   keel::breaker_registry tenants({.breaker = {.minimum_calls = 5,
//                                               .permanent = keel::breaker_verdict::failure},
//                                   .scope = {.endpoint = false, .model = false, .region = false,
//                                             .tenant = true}});
//   auto pipe = keel::pipeline(tenants, providers, keel::retry({.max_attempts = 3}));
//   for (const keel::breaker_entry& e : providers.list(keel::real_clock{}.now()))
//     std::printf("%s %s\n", e.domain.c_str(), std::string(keel::to_string(e.state.state)).c_str());
//   // An operator contains an outage of one domain; a full reserve says so.
//   absl::Status forced = providers.force_open({.endpoint = "api.provider", .model = "m-large"},
//                                              keel::real_clock{}.now());
//
// As a policy the registry looks the domain up (lock-free, no allocation
// once the breaker exists) and behaves as that breaker would
// (keel/policy/circuit_breaker.hpp: gate, run, count; placement inside or outside
// keel::retry decides whether attempts or calls are counted).
//
// Thread-safety: every operation may be called from any thread. Lookups are
// lock-free; making a domain's breaker takes a mutex, once per domain.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "keel/core/call.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/policy.hpp"
#include "keel/core/status.hpp"
#include "keel/core/telemetry.hpp"
#include "keel/policy/internal/keyed_table.hpp"
#include "keel/policy/internal/short_key.hpp"
#include "keel/policy/circuit_breaker.hpp"

namespace keel {

// Which call labels make up a failure domain.
struct breaker_scope {
  bool endpoint = true;
  bool model = true;
  bool region = true;
  bool tenant = false;
};

// A failure domain: the scoped labels of a call (others left empty).
struct failure_domain {
  std::string_view endpoint{};
  std::string_view model{};
  std::string_view region{};
  std::string_view tenant{};

  [[nodiscard]] static failure_domain of(const labels& l, const breaker_scope& s) noexcept {
    return {s.endpoint ? l.endpoint : std::string_view{}, s.model ? l.model : std::string_view{},
            s.region ? l.region : std::string_view{}, s.tenant ? l.tenant : std::string_view{}};
  }

  // "endpoint=e,model=m,region=r,tenant=t", scoped parts only.
  [[nodiscard]] std::string to_string(const breaker_scope& s) const {
    std::string out;
    auto part = [&](bool on, std::string_view key, std::string_view value) {
      if (!on) return;
      if (!out.empty()) out += ',';
      absl::StrAppend(&out, detail::to_absl(key), "=", detail::to_absl(value));
    };
    part(s.endpoint, "endpoint", endpoint);
    part(s.model, "model", model);
    part(s.region, "region", region);
    part(s.tenant, "tenant", tenant);
    return out;
  }
};

struct breaker_registry_options {
  // Options of every domain's breaker; each gets its domain as its name.
  circuit_breaker_options breaker{};
  breaker_scope scope{};
  // Domains with their own breaker; in [1, 1048576].
  int max_breakers = 1024;
  // Further domains an operator may force open or closed once max_breakers
  // is reached, each getting its own breaker; in [0, 65536].
  int operator_breakers = 64;

  [[nodiscard]] absl::Status validate() const {
    if (!scope.endpoint && !scope.model && !scope.region && !scope.tenant)
      return detail::invalid_field("breaker_registry_options", "scope", "name at least one label", "none");
    if (max_breakers < 1 || max_breakers > (1 << 20))
      return detail::invalid_field("breaker_registry_options", "max_breakers", "be in [1, 1048576]", max_breakers);
    if (operator_breakers < 0 || operator_breakers > 65536)
      return detail::invalid_field("breaker_registry_options", "operator_breakers", "be in [0, 65536]",
                                   operator_breakers);
    circuit_breaker_options b = breaker;
    b.name = "domain";  // the registry names each breaker
    absl::Status s = b.validate();
    if (!s.ok()) return annotate(s, "breaker_registry_options.breaker");
    return absl::OkStatus();
  }
};

// One row of breaker_registry::list().
struct breaker_entry {
  std::string domain;
  breaker_figures state;
};

class breaker_registry {
 public:
  // Throws keel::invalid_options if `o` is invalid.
  explicit breaker_registry(breaker_registry_options o)
      : options_((detail::require_valid(o.validate()), std::move(o))),
        table_(static_cast<std::size_t>(options_.max_breakers)),
        operated_(static_cast<std::size_t>(options_.operator_breakers)),
        overflow_(named("(overflow)")) {}
  breaker_registry(const breaker_registry&) = delete;
  breaker_registry& operator=(const breaker_registry&) = delete;

  [[nodiscard]] const breaker_registry_options& options() const noexcept { return options_; }

  // The breaker for `d` (only its scoped labels matter), made on first use.
  // When the registry is full, the shared overflow breaker (unless an
  // operator gave `d` its own).
  [[nodiscard]] circuit_breaker& breaker_for(const failure_domain& d) {
    const failure_domain k = scoped(d);
    const std::size_t h = hash(k);
    auto matches = [&](const key& stored) { return stored.equals(k); };
    if (circuit_breaker* b = table_.find(h, matches)) return *b;
    if (operated_.size() > 0) {
      if (circuit_breaker* b = operated_.find(h, matches)) return *b;
    }
    if (circuit_breaker* b = insert(table_, k, h)) return *b;
    overflowed_.fetch_add(1, std::memory_order_relaxed);
    return overflow_;
  }
  [[nodiscard]] circuit_breaker& breaker_for(const labels& l) {
    return breaker_for(failure_domain::of(l, options_.scope));
  }

  // The breaker for `d`, made on first use from `o` (named after its domain)
  // instead of the registry's options: a domain that needs other thresholds
  // (a slow model's deployment, a flaky region) in the same registry. Make
  // it before the pipeline's lookups do. A breaker that exists keeps the
  // options it was made with; when the registry is full, the overflow
  // breaker. Throws keel::invalid_options if `o` is invalid (its name aside).
  [[nodiscard]] circuit_breaker& breaker_for(const failure_domain& d, const circuit_breaker_options& o) {
    const failure_domain k = scoped(d);
    const std::size_t h = hash(k);
    if (circuit_breaker* b = find(d)) return *b;
    circuit_breaker_options own = o;
    own.name = k.to_string(options_.scope);
    if (own.name.empty()) own.name = "(no labels)";
    detail::require_valid(own.validate());
    if (circuit_breaker* b = insert(table_, k, h, own)) return *b;
    overflowed_.fetch_add(1, std::memory_order_relaxed);
    return overflow_;
  }

  // The breaker for `d` if it exists (never the overflow one).
  [[nodiscard]] circuit_breaker* find(const failure_domain& d) const noexcept {
    const failure_domain k = scoped(d);
    const std::size_t h = hash(k);
    auto matches = [&](const key& stored) { return stored.equals(k); };
    if (circuit_breaker* b = table_.find(h, matches)) return b;
    return operated_.find(h, matches);
  }

  // Every breaker and its state, sorted by domain; the overflow breaker last
  // when it has been used.
  [[nodiscard]] std::vector<breaker_entry> list(time_point now) const {
    std::vector<breaker_entry> out;
    auto add = [&](const key&, const circuit_breaker& b) { out.push_back({std::string(b.name()), b.figures(now)}); };
    table_.for_each(add);
    operated_.for_each(add);
    std::sort(out.begin(), out.end(), [](const breaker_entry& a, const breaker_entry& b) { return a.domain < b.domain; });
    if (overflowed() > 0) out.push_back({std::string(overflow_.name()), overflow_.figures(now)});
    return out;
  }

  // Domains with their own breaker, those operators added included.
  [[nodiscard]] std::size_t size() const noexcept { return table_.size() + operated_.size(); }
  // Lookups that got the overflow breaker because the registry was full.
  [[nodiscard]] std::int64_t overflowed() const noexcept { return overflowed_.load(std::memory_order_relaxed); }

  // Operator controls over one domain, never over the shared overflow
  // breaker. force_open / force_closed give a domain without a breaker its
  // own (from operator_breakers once max_breakers is reached);
  // ResourceExhausted, changing nothing, when there is no room left.
  // automatic() on a domain without its own breaker has nothing to undo.
  [[nodiscard]] absl::Status force_open(const failure_domain& d, time_point now) {
    circuit_breaker* b = own_breaker(d);
    if (b == nullptr) return no_room(d, "force open");
    b->force_open(now);
    return absl::OkStatus();
  }
  [[nodiscard]] absl::Status force_closed(const failure_domain& d, time_point now) {
    circuit_breaker* b = own_breaker(d);
    if (b == nullptr) return no_room(d, "force closed");
    b->force_closed(now);
    return absl::OkStatus();
  }
  void automatic(const failure_domain& d, time_point now) {
    if (circuit_breaker* b = find(d)) b->automatic(now);
  }

  // The policy: the call's domain breaker gates, runs and counts the pass.
  template <class Ctx, class Next>
  auto execute(Ctx& ctx, const attempt_plan& plan, Next& next) -> decltype(next(ctx, plan)) {
    return breaker_for(ctx.call.labels()).execute(ctx, plan, next);
  }

  // A policy that refuses attempts while the call's domain breaker is open,
  // counting nothing: keel::pipeline(registry, retry, registry.attempt_gate())
  // counts calls but gates every attempt (see keel/policy/circuit_breaker.hpp).
  class gate {
   public:
    explicit gate(breaker_registry& r) noexcept : registry_(&r) {}
    template <class Ctx, class Next>
    auto execute(Ctx& ctx, const attempt_plan& plan, Next& next) const -> decltype(next(ctx, plan)) {
      return registry_->breaker_for(ctx.call.labels()).attempt_gate().execute(ctx, plan, next);
    }

   private:
    breaker_registry* registry_;
  };
  [[nodiscard]] gate attempt_gate() noexcept { return gate(*this); }

 private:
  struct key {
    std::string endpoint, model, region, tenant;
    static key from(const failure_domain& d) {
      return {std::string(d.endpoint), std::string(d.model), std::string(d.region), std::string(d.tenant)};
    }
    [[nodiscard]] bool equals(const failure_domain& d) const noexcept {
      return detail::key_equals(endpoint, d.endpoint) && detail::key_equals(model, d.model) &&
             detail::key_equals(region, d.region) && detail::key_equals(tenant, d.tenant);
    }
  };

  [[nodiscard]] failure_domain scoped(const failure_domain& d) const noexcept {
    const breaker_scope& s = options_.scope;
    return {s.endpoint ? d.endpoint : std::string_view{}, s.model ? d.model : std::string_view{},
            s.region ? d.region : std::string_view{}, s.tenant ? d.tenant : std::string_view{}};
  }
  [[nodiscard]] static std::size_t hash(const failure_domain& d) noexcept {
    return detail::key_hash(d.tenant, detail::key_hash(d.region, detail::key_hash(d.model, detail::key_hash(d.endpoint))));
  }
  using table = detail::keyed_table<key, circuit_breaker>;

  // Null when `t` is full.
  circuit_breaker* insert(table& t, const failure_domain& k, std::size_t h) {
    return insert(t, k, h, named(k.to_string(options_.scope)));
  }
  circuit_breaker* insert(table& t, const failure_domain& k, std::size_t h, const circuit_breaker_options& o) {
    if (t.size() >= t.capacity()) return nullptr;  // full for good: skip the insert lock
    return t.find_or_insert(
        h, [&](const key& stored) { return stored.equals(k); }, [&] { return key::from(k); },
        [&] { return circuit_breaker(o); });
  }

  // `d`'s own breaker, made if absent (from the operator reserve once the
  // registry is full); null when there is no room for it.
  circuit_breaker* own_breaker(const failure_domain& d) {
    const failure_domain k = scoped(d);
    const std::size_t h = hash(k);
    if (circuit_breaker* b = find(d)) return b;
    if (circuit_breaker* b = insert(table_, k, h)) return b;
    return insert(operated_, k, h);
  }

  [[nodiscard]] absl::Status no_room(const failure_domain& d, std::string_view action) const {
    return absl::ResourceExhaustedError(absl::StrCat(
        "keel: cannot ", detail::to_absl(action), " domain '", d.to_string(options_.scope),
        "': the breaker registry is full (max_breakers ", options_.max_breakers, " and operator_breakers ",
        options_.operator_breakers,
        " used up), and its domains beyond that share the overflow breaker, which an operator action on one "
        "domain must not move; raise max_breakers or operator_breakers"));
  }

  [[nodiscard]] circuit_breaker_options named(std::string name) const {
    circuit_breaker_options o = options_.breaker;
    o.name = std::move(name);
    if (o.name.empty()) o.name = "(no labels)";
    return o;
  }

  breaker_registry_options options_;
  table table_;
  table operated_;  // domains operators forced after table_ filled
  circuit_breaker overflow_;
  std::atomic<std::int64_t> overflowed_{0};
};

}  // namespace keel
