// keel/testing/seeded_random.hpp — a reproducible keel::random_source.
//
// Jitter drawn from the same seed is the same on every run, so tests can
// assert exact waits. Copies share one generator.
//
// Example:
//
//   keel::testing::seeded_random rng(7);
//   keel::retry r({.max_attempts = 4}, keel::full_jitter{}, rng);
//
// Thread-safety: uniform() locks a mutex; safe from any thread (the sequence
// then depends on the interleaving).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <random>

#include "absl/random/distributions.h"
#include "keel/policy/backoff.hpp"

namespace keel::testing {

class seeded_random {
 public:
  explicit seeded_random(std::uint64_t seed = 42) : state_(std::make_shared<state>(seed)) {}

  [[nodiscard]] std::int64_t uniform(std::int64_t lo, std::int64_t hi) const {
    std::lock_guard lock(state_->mu);
    return absl::Uniform(absl::IntervalClosed, state_->gen, lo, hi);
  }

 private:
  struct state {
    explicit state(std::uint64_t seed) : gen(seed) {}
    std::mutex mu;
    std::mt19937_64 gen;
  };
  std::shared_ptr<state> state_;
};

static_assert(keel::random_source<seeded_random>);

}  // namespace keel::testing
