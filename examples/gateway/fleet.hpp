// gateway/fleet.hpp — what replicas of the gateway share when they are given
// a Redis (`gateway --serve PORT [DIR] --redis host:port`): the provider's
// concurrency as one fleet-wide limit (keel::shared_concurrency) and its
// state (keel::shared_provider_state: a breaker that opened in one replica,
// a cooldown the provider asked one replica for, half-open probes for the
// fleet). Without a Redis the gateway runs alone.
//
// Both sit inside the retry and in front of the provider's breakers, as two
// keel::optional_stage (plan.hpp: fleet_state(), fleet_permit(); left out
// when there is no fleet), so every attempt is gated by the fleet's view of
// the provider and holds one of its permits while it runs:
//
//   ... retry -> provider state -> permit -> breakers -> timeout -> provider
//
// Their refusals are keel's (not started, refused), so the interactive
// fallback serves them as it serves the local breaker's.
//
// Thread-safety: as keel's components: every operation from any thread.
#pragma once

#include <charconv>
#include <memory>
#include <string>
#include <string_view>
#include <system_error>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "keel/policy/breaker_registry.hpp"
#include "keel/fleet/shared_concurrency.hpp"
#include "keel/fleet/shared_provider_state.hpp"

namespace gateway {

using namespace std::chrono_literals;

struct fleet_config {
  // "host:port" of the Redis the replicas share; empty: this gateway alone.
  std::string redis{};
  std::string key_prefix = "gateway:";
  // Provider attempts in flight across the fleet, and the replicas sharing it
  // (each takes limit / replicas while Redis is down).
  int provider_concurrency = 32;
  int expected_replicas = 2;
  // How stale a replica's view of the provider may be (docs/scaleout.md).
  keel::duration refresh_every = 100ms;

  [[nodiscard]] bool enabled() const noexcept { return !redis.empty(); }

  [[nodiscard]] absl::StatusOr<keel::redis_options> redis_options() const {
    const std::size_t colon = redis.rfind(':');
    int port = 0;
    const char* end = redis.data() + redis.size();
    if (colon == std::string::npos || colon == 0 ||
        std::from_chars(redis.data() + colon + 1, end, port).ptr != end)
      return keel::invalid_option("gateway_options.fleet", "redis", "be host:port", redis);
    keel::redis_options r{.host = redis.substr(0, colon),
                          .port = port,
                          .key_prefix = key_prefix,
                          .pool_size = 16,
                          .connect_timeout = 200ms,
                          .command_timeout = 200ms,
                          .acquire_timeout = 100ms};
    if (absl::Status s = r.validate(); !s.ok()) return keel::annotate(s, "gateway_options.fleet");
    return r;
  }
  [[nodiscard]] keel::shared_concurrency_options concurrency(std::string_view provider) const {
    return {.name = std::string("provider:").append(provider),
            .limit = provider_concurrency,
            .expected_replicas = expected_replicas};
  }
  [[nodiscard]] keel::shared_provider_state_options state() const {
    return {.refresh_every = refresh_every, .max_probes = 1, .probe_window = 1s, .reopen_for = 2s};
  }

  [[nodiscard]] absl::Status validate() const {
    if (!enabled()) return absl::OkStatus();
    absl::StatusOr<keel::redis_options> r = redis_options();
    if (!r.ok()) return r.status();
    if (absl::Status s = concurrency("p").validate(); !s.ok()) return keel::annotate(s, "gateway_options.fleet");
    if (absl::Status s = state().validate(); !s.ok()) return keel::annotate(s, "gateway_options.fleet");
    return absl::OkStatus();
  }
};

// The shared components, made when the gateway is given a Redis.
class fleet_sharing {
 public:
  // `c` must be valid and enabled; `breakers` outlives this object.
  fleet_sharing(const fleet_config& c, keel::breaker_registry& breakers, std::string_view provider)
      : redis_(c.redis),
        concurrency_(c.redis_options().value(), c.concurrency(provider)),
        state_(c.redis_options().value(), c.state(), &breakers) {}

  [[nodiscard]] const std::string& redis() const noexcept { return redis_; }
  [[nodiscard]] keel::shared_concurrency& concurrency() noexcept { return concurrency_; }
  [[nodiscard]] keel::shared_provider_state& state() noexcept { return state_; }

 private:
  std::string redis_;
  keel::shared_concurrency concurrency_;
  keel::shared_provider_state state_;
};

}  // namespace gateway
