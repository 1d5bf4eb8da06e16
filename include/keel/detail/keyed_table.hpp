// keel/detail/keyed_table.hpp — an insert-only hash table with lock-free
// lookups, for shared state kept per key (a breaker per failure domain, a
// quota per tenant or model).
//
// Capacity is fixed at construction and entries live until the table is
// destroyed: nothing is ever removed or moved, so a lookup is a few atomic
// loads with no lock and a pointer to a value stays valid. Inserts take a
// mutex (they happen once per key). Open addressing with linear probing at
// a load factor of at most one half, so a probe always ends.
//
// Internal to keel: the API may change.
//
// Thread-safety: find() and find_or_insert() may be called from any thread
// at once; for_each() sees every entry inserted before it started, and
// possibly some inserted while it runs.
#pragma once

#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string_view>

namespace keel::detail {

// Keys here are short labels (tenant, model, endpoint ids), looked up on
// every call: hash and compare them eight bytes at a time, inline, instead
// of a general-purpose hash and a libc memcmp call.
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

template <class Key, class Value>
class keyed_table {
 public:
  explicit keyed_table(std::size_t capacity)
      : capacity_(capacity),
        mask_(std::bit_ceil(capacity * 2 < 2 ? std::size_t{2} : capacity * 2) - 1),
        slots_(std::make_unique<std::atomic<node*>[]>(mask_ + 1)) {}
  keyed_table(const keyed_table&) = delete;
  keyed_table& operator=(const keyed_table&) = delete;
  ~keyed_table() {
    for (std::size_t i = 0; i <= mask_; ++i) delete slots_[i].load(std::memory_order_relaxed);
  }

  // The value whose key satisfies `matches`, or null.
  template <class Matches>
  [[nodiscard]] Value* find(std::size_t hash, const Matches& matches) const noexcept {
    for (std::size_t i = hash & mask_;; i = (i + 1) & mask_) {
      node* n = slots_[i].load(std::memory_order_acquire);
      if (n == nullptr) return nullptr;
      if (n->hash == hash && matches(n->key)) return &n->value;
    }
  }

  // The value for the key, inserted from make_key() / make_value() (both
  // returning by value) when absent. Null when the table is full.
  template <class Matches, class MakeKey, class MakeValue>
  [[nodiscard]] Value* find_or_insert(std::size_t hash, const Matches& matches, MakeKey&& make_key,
                                      MakeValue&& make_value) {
    if (Value* v = find(hash, matches)) return v;
    std::lock_guard lock(insert_mu_);
    std::size_t i = hash & mask_;
    for (;; i = (i + 1) & mask_) {
      node* n = slots_[i].load(std::memory_order_relaxed);
      if (n == nullptr) break;
      if (n->hash == hash && matches(n->key)) return &n->value;  // inserted while we waited
    }
    if (size_.load(std::memory_order_relaxed) >= capacity_) return nullptr;
    node* n = new node{make_key(), hash, make_value()};
    slots_[i].store(n, std::memory_order_release);
    size_.fetch_add(1, std::memory_order_relaxed);
    return &n->value;
  }

  template <class F>
  void for_each(F&& f) const {
    for (std::size_t i = 0; i <= mask_; ++i) {
      if (node* n = slots_[i].load(std::memory_order_acquire)) f(n->key, n->value);
    }
  }

  [[nodiscard]] std::size_t size() const noexcept { return size_.load(std::memory_order_relaxed); }
  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }

 private:
  struct node {
    Key key;
    std::size_t hash;
    Value value;
  };

  std::size_t capacity_;
  std::size_t mask_;
  std::unique_ptr<std::atomic<node*>[]> slots_;
  std::atomic<std::size_t> size_{0};
  std::mutex insert_mu_;
};

}  // namespace keel::detail
