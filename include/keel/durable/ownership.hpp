// keel/durable/ownership.hpp — who holds a claim: the random owner of a claim
// and its fencing token, with the key validation and the store time source
// every backend shares.
//
// An idempotency record in flight and a work lease are both *claims*: a
// random 128-bit owner chosen by the claimant plus a fencing token (`fence`)
// that the store increases every time the claim changes hands. Every later
// write (commit, renew, release, abandon) names both and succeeds only while
// they are still current. A stale owner — one whose lease lapsed and was
// taken over — gets keel::lost_ownership and changes nothing.
//
// The status conventions a store reports with (lost ownership, unknown
// outcome, in flight, conflict, unavailable) are keel/core/store_status.hpp.
//
// Example:
//
//   keel::owner_id me = keel::owner_id::random();
//   absl::Status s = store.release("nightly-report", {.owner = me, .fence = 3});
//   if (keel::is_lost_ownership(s)) { /* someone took over: do not publish */ }
//
// Thread-safety: everything here is a value or a pure function, except
// owner_id::random(), which draws from a per-thread generator seeded from
// OpenSSL's CSPRNG: safe from any thread, and in a forked child.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <compare>
#include <concepts>
#include <cstdint>
#include <new>
#include <optional>
#include <random>
#include <string>
#include <string_view>

#include <openssl/rand.h>
#include <pthread.h>

#include "absl/random/random.h"
#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "keel/core/clock.hpp"
#include "keel/core/outcome.hpp"
#include "keel/core/status.hpp"
#include "keel/core/store_status.hpp"

namespace keel {

// A random 128-bit claimant identity. Chosen by the claimant (the stores
// never make one up), so it can be generated before a round trip and a lost
// reply can be retried with the same owner.
struct owner_id {
  std::uint64_t hi = 0;
  std::uint64_t lo = 0;

  // 128 random bits from a per-thread generator (absl::BitGen, Randen)
  // seeded from OpenSSL's CSPRNG, reseeded after fork(): a forked child never
  // repeats its parent's owners. (OpenSSL's RAND_bytes per call costs ~1 us;
  // this costs a few ns.)
  [[nodiscard]] static owner_id random();

  [[nodiscard]] constexpr bool is_nil() const noexcept { return hi == 0 && lo == 0; }

  // Big-endian bytes (how SQL backends store it: BLOB / bytea).
  [[nodiscard]] constexpr std::array<unsigned char, 16> bytes() const noexcept {
    std::array<unsigned char, 16> b{};
    for (int i = 0; i < 8; ++i) {
      b[7 - i] = static_cast<unsigned char>(hi >> (8 * i));
      b[15 - i] = static_cast<unsigned char>(lo >> (8 * i));
    }
    return b;
  }
  [[nodiscard]] static constexpr owner_id from_bytes(const std::array<unsigned char, 16>& b) noexcept {
    owner_id o;
    for (int i = 0; i < 8; ++i) {
      o.hi = o.hi << 8 | b[i];
      o.lo = o.lo << 8 | b[8 + i];
    }
    return o;
  }

  // 32 lower-case hex digits (how text backends store it: Redis).
  [[nodiscard]] std::string hex() const {
    static constexpr char digits[] = "0123456789abcdef";
    std::string out(32, '0');
    const auto b = bytes();
    for (int i = 0; i < 16; ++i) {
      out[2 * i] = digits[b[i] >> 4];
      out[2 * i + 1] = digits[b[i] & 0xf];
    }
    return out;
  }
  [[nodiscard]] static std::optional<owner_id> from_hex(std::string_view s) {
    if (s.size() != 32) return std::nullopt;
    std::array<unsigned char, 16> b{};
    for (int i = 0; i < 16; ++i) {
      int v = 0;
      for (char c : {s[2 * i], s[2 * i + 1]}) {
        v <<= 4;
        if (c >= '0' && c <= '9') v |= c - '0';
        else if (c >= 'a' && c <= 'f') v |= c - 'a' + 10;
        else if (c >= 'A' && c <= 'F') v |= c - 'A' + 10;
        else return std::nullopt;
      }
      b[i] = static_cast<unsigned char>(v);
    }
    return from_bytes(b);
  }

  friend constexpr bool operator==(const owner_id&, const owner_id&) noexcept = default;
  friend constexpr auto operator<=>(const owner_id&, const owner_id&) noexcept = default;
};

namespace detail {

// Bumped in every child process after fork(), so per-thread generators
// copied into the child reseed instead of repeating the parent's sequence.
inline std::atomic<std::uint64_t> fork_generation{0};
inline void note_fork() noexcept { fork_generation.fetch_add(1, std::memory_order_relaxed); }

[[nodiscard]] inline absl::BitGen& owner_generator() {
  static const bool hooked = ::pthread_atfork(nullptr, nullptr, &note_fork) == 0;
  (void)hooked;
  struct state {
    std::optional<absl::BitGen> gen;
    std::uint64_t generation = 0;
  };
  thread_local state s;
  const std::uint64_t g = fork_generation.load(std::memory_order_relaxed);
  if (!s.gen || s.generation != g) {
    std::array<std::uint32_t, 8> seed{};
    if (RAND_bytes(reinterpret_cast<unsigned char*>(seed.data()), static_cast<int>(sizeof seed)) != 1)
      throw std::bad_alloc();  // no entropy: refuse rather than hand out guessable owners
    std::seed_seq seq(seed.begin(), seed.end());
    s.gen.emplace(seq);
    s.generation = g;
  }
  return *s.gen;
}

}  // namespace detail

inline owner_id owner_id::random() {
  absl::BitGen& gen = detail::owner_generator();
  owner_id o;
  do {
    o.hi = absl::Uniform<std::uint64_t>(gen);
    o.lo = absl::Uniform<std::uint64_t>(gen);
  } while (o.is_nil());
  return o;
}

// A claim token: who holds the claim and which hand-over it is. The fence of
// a key starts at 1 and strictly increases with every claim of that key
// (first claim, takeover after expiry, claim after release or abandon) for
// as long as the store remembers the key.
struct ownership {
  owner_id owner{};
  std::int64_t fence = 0;

  friend constexpr bool operator==(const ownership&, const ownership&) noexcept = default;
};

// ---------------------------------------------------------------------------
// Keys
// ---------------------------------------------------------------------------

// Longest key part a store accepts, in bytes.
inline constexpr std::size_t max_key_bytes = 255;

// Validates one key part: 1..255 bytes, no ASCII control characters (0x00-0x1f,
// 0x7f). `what` names the part in the message ("idempotency key", "tenant").
// Bytes >= 0x80 are accepted (UTF-8 keys are fine; keel does not normalise).
[[nodiscard]] inline absl::Status validate_key(std::string_view what, std::string_view key) {
  if (key.empty()) return absl::InvalidArgumentError(absl::StrCat(detail::to_absl(what), " must not be empty"));
  if (key.size() > max_key_bytes)
    return absl::InvalidArgumentError(absl::StrCat(detail::to_absl(what), " must be at most ", max_key_bytes,
                                                   " bytes (got ", key.size(), ")"));
  for (std::size_t i = 0; i < key.size(); ++i) {
    const auto c = static_cast<unsigned char>(key[i]);
    if (c < 0x20 || c == 0x7f)
      return absl::InvalidArgumentError(absl::StrCat(detail::to_absl(what),
                                                     " must not contain control characters (byte 0x",
                                                     absl::Hex(c, absl::kZeroPad2), " at offset ", i, ")"));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Time
// ---------------------------------------------------------------------------

// Where a store takes "now" from. Store operations never take the caller's
// time: expiry is decided on the store's clock (PostgreSQL's, Redis's TIME,
// or for the in-process backends a source given at construction).
//
// Any object with now() returning a std::chrono time point qualifies:
// keel::system_time (the wall clock, durable across reboots), keel::real_clock
// (steady; fine for the in-memory store) or keel::testing::manual_clock.
template <class T>
concept store_time_source = requires(const T& t) {
  { t.now().time_since_epoch() } -> std::convertible_to<std::chrono::nanoseconds>;
};

// The wall clock (std::chrono::system_clock). The SQLite store's default:
// its expiries outlive the process and the machine's uptime, and CLOCK_MONOTONIC
// restarts at every boot.
struct system_time {
  [[nodiscard]] std::chrono::system_clock::time_point now() const noexcept {
    return std::chrono::system_clock::now();
  }
};

namespace detail {
// Nanoseconds since the source's epoch: how backends store time.
template <store_time_source T>
[[nodiscard]] std::int64_t store_now_ns(const T& t) noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.now().time_since_epoch()).count();
}
[[nodiscard]] constexpr std::int64_t to_ns(duration d) noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(d).count();
}
[[nodiscard]] constexpr duration from_ns(std::int64_t ns) noexcept {
  return std::chrono::duration_cast<duration>(std::chrono::nanoseconds(ns));
}
// a + b without signed overflow (expiries far in the future saturate).
[[nodiscard]] constexpr std::int64_t add_ns(std::int64_t a, std::int64_t b) noexcept {
  if (b > 0 && a > INT64_MAX - b) return INT64_MAX;
  if (b < 0 && a < INT64_MIN - b) return INT64_MIN;
  return a + b;
}
}  // namespace detail

}  // namespace keel
