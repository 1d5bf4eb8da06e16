// keel/policy/internal/short_key.hpp — hashing and comparing short labels (tenant,
// model, endpoint, work-class names) on every call.
//
// Eight bytes at a time, inline: a general-purpose hash plus a libc memcmp
// call were half the cost of an admission. Not a cryptographic or
// flood-resistant hash: keys come from the service's own configuration and
// labels, and the tables using it are bounded.
//
// Internal to keel: the API may change.
//
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace keel::detail {

// The last n < 8 bytes at p as one word, from fixed-size loads that the
// compiler inlines: two overlapping 4-byte loads cover 4..7 bytes, three
// single bytes cover 1..3. For a given n every byte takes part, so equal
// words mean equal bytes.
[[nodiscard]] inline std::uint64_t load_tail(const char* p, std::size_t n) noexcept {
  if (n >= 4) {
    std::uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + n - 4, 4);
    return lo | (std::uint64_t{hi} << 32);
  }
  if (n == 0) return 0;
  const auto byte = [&](std::size_t i) { return std::uint64_t{static_cast<unsigned char>(p[i])}; };
  return byte(0) | (byte(n / 2) << 8) | (byte(n - 1) << 16);
}

[[nodiscard]] inline std::size_t key_hash(std::string_view s, std::uint64_t seed = 0) noexcept {
  constexpr std::uint64_t k = 0x9e3779b97f4a7c15ull;
  std::uint64_t h = seed ^ (s.size() * k);
  std::size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    std::uint64_t w;
    std::memcpy(&w, s.data() + i, 8);
    h = (h ^ w) * k;
    h ^= h >> 29;
  }
  if (i < s.size()) {
    h = (h ^ load_tail(s.data() + i, s.size() - i)) * k;
    h ^= h >> 29;
  }
  // murmur3's finaliser: every input bit reaches the low bits the table uses.
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  h *= 0xc4ceb9fe1a85ec53ull;
  h ^= h >> 33;
  return static_cast<std::size_t>(h);
}

[[nodiscard]] inline bool key_equals(std::string_view a, std::string_view b) noexcept {
  if (a.size() != b.size()) return false;
  std::size_t i = 0;
  for (; i + 8 <= a.size(); i += 8) {
    std::uint64_t x, y;
    std::memcpy(&x, a.data() + i, 8);
    std::memcpy(&y, b.data() + i, 8);
    if (x != y) return false;
  }
  return i == a.size() || load_tail(a.data() + i, a.size() - i) == load_tail(b.data() + i, b.size() - i);
}

}  // namespace keel::detail
