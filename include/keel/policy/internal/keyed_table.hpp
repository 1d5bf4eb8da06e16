// keel/policy/internal/keyed_table.hpp — an insert-only hash table with lock-free
// lookups, for shared state kept per key (a breaker per failure domain, a
// quota per configured tenant or model).
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
#include <memory>
#include <mutex>

#include "keel/policy/internal/short_key.hpp"

namespace keel::detail {

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
