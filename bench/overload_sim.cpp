// overload_sim: what an adaptive concurrency limit and client-side adaptive
// throttling do for a provider driven past its capacity and back.
//
// The provider is a queue with fixed capacity: 20 servers, each call's
// service time exponential with a 100 ms mean (200 calls/s at most), a FIFO
// queue of at most 400 calls in front of them (2 s of work; beyond that it
// answers 503 at once), and no way to learn that a caller gave up: a call
// whose caller timed out is still served. Its latency grows with load (the
// queue). A second scenario takes half its servers away for the overload
// (10 servers, 100 calls/s), so the right static limit is not the one
// configured.
//
// Callers arrive open-loop (Poisson), 70% interactive and 30% batch, each
// with a 2 s deadline; no retries. The offered load is
//
//   0-60 s     100/s    half the capacity
//   60-180 s   400/s    twice the capacity
//   180-300 s  100/s    half again
//
// and the same arrivals (one seed) are run through:
//
//   no limit           every call goes to the provider
//   static limit 20    keel::bulkhead, 20 slots, no queue (the right guess)
//   static limit 80    the same with 80 (a guess four times too high)
//   adaptive limit     keel::adaptive_limit, batch share 0.5
//   adaptive throttle  keel::adaptive_throttle, k 2 interactive / 1.1 batch, window 10 s
//   limit + throttle   both
//
// Goodput counts answers within the deadline. Everything runs on simulated
// time (a discrete-event loop; keel's components are handed the simulated
// times), so the table is the same on every run and machine.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <functional>
#include <memory>
#include <queue>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "keel/core/clock.hpp"
#include "keel/core/outcome.hpp"
#include "keel/policy/adaptive_limit.hpp"
#include "keel/policy/adaptive_throttle.hpp"
#include "keel/policy/bulkhead.hpp"

using namespace std::chrono_literals;

namespace {

constexpr int kServers = 20;
constexpr std::size_t kProviderQueue = 400;
constexpr keel::duration kMeanService = 100ms;
constexpr keel::duration kDeadline = 2s;
constexpr double kInteractiveShare = 0.7;

struct load_phase {
  keel::duration until;
  double per_second;
};
constexpr load_phase kPhases[] = {{60s, 100.0}, {180s, 400.0}, {300s, 100.0}};
constexpr keel::duration kOverloadStart = 60s, kOverloadEnd = 180s;

struct request {
  keel::duration arrival;  // since the start
  keel::duration service;
  bool batch = false;
};

// One seed, one arrival sequence for every strategy.
std::vector<request> arrivals() {
  std::mt19937_64 rng(0x0bad5eed);
  std::exponential_distribution<double> service(1.0);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<request> out;
  double t = 0;
  for (const load_phase& p : kPhases) {
    std::exponential_distribution<double> gap(p.per_second);
    const double end = std::chrono::duration<double>(p.until).count();
    while ((t += gap(rng)) < end) {
      out.push_back({std::chrono::duration_cast<keel::duration>(std::chrono::duration<double>(t)),
                     std::chrono::duration_cast<keel::duration>(kMeanService * service(rng)), u(rng) >= kInteractiveShare});
    }
  }
  return out;
}

// How a call ended, for the caller and for the strategy's bookkeeping.
enum class ending { ok, timed_out, provider_rejected, refused };

// What stands between the callers and the provider.
struct strategy {
  virtual ~strategy() = default;
  // May call `id` go to the provider at `now`?
  virtual bool admit(std::size_t id, bool batch, keel::time_point now) = 0;
  // Call `id`, admitted, ended for its caller at `now` after `latency`.
  virtual void finish(std::size_t id, keel::time_point now, keel::duration latency, ending how) = 0;
};

struct no_limit final : strategy {
  bool admit(std::size_t, bool, keel::time_point) override { return true; }
  void finish(std::size_t, keel::time_point, keel::duration, ending) override {}
};

struct static_limit final : strategy {
  explicit static_limit(int slots, std::size_t n)
      : pools({.classes = {{.name = "all", .capacity = slots}}}), permits(n) {}
  bool admit(std::size_t id, bool, keel::time_point) override {
    permits[id] = pools.try_acquire(0);
    return static_cast<bool>(permits[id]);
  }
  void finish(std::size_t id, keel::time_point, keel::duration, ending) override { permits[id].release(); }
  keel::bulkhead pools;
  std::vector<keel::bulkhead_permit> permits;
};

keel::adaptive_limit_options limit_options() {
  return {.name = "llm", .initial_limit = 20, .min_limit = 2, .max_limit = 1000, .tolerance = 2.0, .window = 32,
          .probe_interval = 30s, .probe_jitter = 0, .probe_limit = 4, .probe_samples = 32, .max_drift = 2,
          .classes = {{.name = "interactive"}, {.name = "batch", .share = 0.5}}};
}
keel::adaptive_throttle_options throttle_options() {
  return {.name = "llm", .window = 10s,
          .classes = {{.name = "interactive", .k = 2.0}, {.name = "batch", .k = 1.1}}};
}
keel::limit_sample sample_of(ending how) {
  return how == ending::ok ? keel::limit_sample::ok : keel::limit_sample::dropped;
}

struct adaptive final : strategy {
  explicit adaptive(std::size_t n) : limit(limit_options()), permits(n) {}
  bool admit(std::size_t id, bool batch, keel::time_point) override {
    permits[id] = limit.try_acquire(batch ? 1 : 0);
    return static_cast<bool>(permits[id]);
  }
  void finish(std::size_t id, keel::time_point now, keel::duration latency, ending how) override {
    permits[id].release(latency, now, sample_of(how));
  }
  keel::adaptive_limit limit;
  std::vector<keel::adaptive_limit_permit> permits;
};

// A seeded keel::random_source without a lock: the simulation has one thread.
struct sim_random {
  std::shared_ptr<std::mt19937_64> gen = std::make_shared<std::mt19937_64>(7);
  [[nodiscard]] std::int64_t uniform(std::int64_t lo, std::int64_t hi) const {
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(*gen);
  }
};

struct throttled final : strategy {
  throttled() : throttle(throttle_options(), sim_random{}) {}
  bool admit(std::size_t, bool batch, keel::time_point now) override { return throttle.allow(batch ? 1 : 0, now); }
  void finish(std::size_t, keel::time_point now, keel::duration, ending how) override {
    throttle.record(now, how == ending::ok);
  }
  keel::adaptive_throttle<sim_random> throttle;
};

struct both final : strategy {
  explicit both(std::size_t n) : limit(n) {}
  bool admit(std::size_t id, bool batch, keel::time_point now) override {
    if (!throttle.admit(id, batch, now)) return false;
    if (limit.admit(id, batch, now)) return true;
    return false;  // refused by the limit: the throttle never saw it sent
  }
  void finish(std::size_t id, keel::time_point now, keel::duration latency, ending how) override {
    limit.finish(id, now, latency, how);
    throttle.finish(id, now, latency, how);
  }
  throttled throttle;
  adaptive limit;
};

struct figures {
  std::int64_t good[2] = {0, 0};  // interactive, batch: answered within the deadline, in the overload
  std::int64_t good_total = 0;    // the whole run
  std::int64_t refused = 0, timed_out = 0, provider_rejected = 0;  // in the overload
  std::int64_t wasted = 0;        // served by the provider after its caller gave up (whole run)
  std::vector<double> latency_ms;  // answered calls' latency, in the overload
  std::int64_t good_after = 0;     // goodput in the 30 s after the overload
};

figures run(strategy& s, const std::vector<request>& reqs, int overload_servers) {
  const keel::time_point t0 = keel::time_point(std::chrono::hours(24 * 365));
  figures f;
  // Events: (time, kind, id). Kinds in tie order: service done before a
  // caller's timeout at the same instant, arrivals last.
  enum kind : int { done = 0, timeout = 1, arrive = 2 };
  using event = std::tuple<keel::time_point, int, std::size_t>;
  std::priority_queue<event, std::vector<event>, std::greater<>> events;
  std::vector<bool> caller_gone(reqs.size(), false);
  std::vector<bool> answered(reqs.size(), false);
  std::deque<std::size_t> queue;
  int busy = 0;
  std::size_t next_arrival = 0;
  if (!reqs.empty()) events.emplace(t0 + reqs[0].arrival, arrive, 0);
  auto in_overload = [&](keel::time_point t) { return t >= t0 + kOverloadStart && t < t0 + kOverloadEnd; };
  // Servers taken away finish the call they hold.
  auto servers = [&](keel::time_point t) { return in_overload(t) ? overload_servers : kServers; };
  // Free servers take queued calls, oldest first.
  auto serve = [&](keel::time_point now) {
    while (!queue.empty() && busy < servers(now)) {
      const std::size_t next = queue.front();
      queue.pop_front();
      ++busy;
      events.emplace(now + reqs[next].service, done, next);
    }
  };
  while (!events.empty()) {
    const auto [now, k, id] = events.top();
    events.pop();
    const request& r = reqs[id];
    const keel::time_point arrived = t0 + r.arrival;
    if (k == arrive) {
      if (++next_arrival < reqs.size()) events.emplace(t0 + reqs[next_arrival].arrival, arrive, next_arrival);
      if (!s.admit(id, r.batch, now)) {
        if (in_overload(arrived)) ++f.refused;
        continue;
      }
      if (busy < servers(now) || queue.size() < kProviderQueue) {
        queue.push_back(id);
        serve(now);
      } else {
        s.finish(id, now, keel::duration::zero(), ending::provider_rejected);
        if (in_overload(arrived)) ++f.provider_rejected;
        continue;
      }
      events.emplace(arrived + kDeadline, timeout, id);
    } else if (k == done) {
      --busy;
      serve(now);
      if (caller_gone[id]) {
        ++f.wasted;
        continue;
      }
      answered[id] = true;
      const keel::duration latency = now - arrived;
      s.finish(id, now, latency, ending::ok);
      ++f.good_total;
      if (in_overload(arrived)) {
        ++f.good[r.batch ? 1 : 0];
        f.latency_ms.push_back(std::chrono::duration<double, std::milli>(latency).count());
      }
      if (arrived >= t0 + kOverloadEnd && arrived < t0 + kOverloadEnd + 30s) ++f.good_after;
    } else {  // the caller's deadline
      if (answered[id]) continue;
      caller_gone[id] = true;
      s.finish(id, now, kDeadline, ending::timed_out);
      if (in_overload(arrived)) ++f.timed_out;
    }
  }
  return f;
}

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<std::size_t>(q * static_cast<double>(v.size())))];
}

}  // namespace

int main() {
  const std::vector<request> reqs = arrivals();
  std::int64_t offered = 0, offered_batch = 0;
  for (const request& r : reqs)
    if (r.arrival >= kOverloadStart && r.arrival < kOverloadEnd) {
      ++offered;
      offered_batch += r.batch ? 1 : 0;
    }
  std::printf("provider: %d servers x %.0f ms mean service = %.0f calls/s; queue %zu; caller deadline %.0f s\n",
              kServers, std::chrono::duration<double, std::milli>(kMeanService).count(),
              kServers / std::chrono::duration<double>(kMeanService).count(), kProviderQueue,
              std::chrono::duration<double>(kDeadline).count());
  std::printf("overload 60-180 s: %lld calls offered (%lld interactive, %lld batch), %.0f/s\n",
              static_cast<long long>(offered), static_cast<long long>(offered - offered_batch),
              static_cast<long long>(offered_batch), static_cast<double>(offered) / 120.0);
  struct row {
    const char* name;
    std::function<std::unique_ptr<strategy>()> make;
  };
  const row rows[] = {
      {"no limit", [] { return std::make_unique<no_limit>(); }},
      {"static limit 20", [&] { return std::make_unique<static_limit>(20, reqs.size()); }},
      {"static limit 80", [&] { return std::make_unique<static_limit>(80, reqs.size()); }},
      {"adaptive limit", [&] { return std::make_unique<adaptive>(reqs.size()); }},
      {"adaptive throttle", [] { return std::make_unique<throttled>(); }},
      {"limit + throttle", [&] { return std::make_unique<both>(reqs.size()); }},
  };
  for (const int overload_servers : {kServers, kServers / 2}) {
    std::printf("\nduring the overload the provider has %d servers (%.0f calls/s)\n\n", overload_servers,
                overload_servers / std::chrono::duration<double>(kMeanService).count());
    std::printf("| strategy | goodput in overload (/s) | interactive / batch good | p50 / p99 answered (ms) | "
                "refused by keel | caller timeouts | provider 503s | goodput 30 s after (/s) | wasted work |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|\n");
    for (const row& r : rows) {
      std::unique_ptr<strategy> s = r.make();
      const figures f = run(*s, reqs, overload_servers);
      std::printf("| %s | %.1f | %lld / %lld | %.0f / %.0f | %lld | %lld | %lld | %.1f | %lld |\n", r.name,
                  static_cast<double>(f.good[0] + f.good[1]) / 120.0, static_cast<long long>(f.good[0]),
                  static_cast<long long>(f.good[1]), percentile(f.latency_ms, 0.50), percentile(f.latency_ms, 0.99),
                  static_cast<long long>(f.refused), static_cast<long long>(f.timed_out),
                  static_cast<long long>(f.provider_rejected), static_cast<double>(f.good_after) / 30.0,
                  static_cast<long long>(f.wasted));
    }
  }
  return 0;
}
