// keel/core/internal/thread_slot.hpp — a small per-thread index, so a count that
// every call bumps (a retry budget's requests) can be kept in per-thread
// cells that the owning thread updates with a plain load and store instead
// of a locked read-modify-write (~5 ns each under no contention, far more
// when two cores fight over the line).
//
// A thread takes one of kThreadSlots indexes the first time it asks and
// gives it back when it exits; a thread that finds them all taken gets
// kSharedSlot, whose cell is updated atomically by whoever uses it.
//
// Thread-safety: my_thread_slot() may be called from any thread; a slot
// is owned by one live thread at a time (the hand-over on thread exit is a
// release/acquire pair, so the next owner sees the previous one's writes).
#pragma once

#include <array>
#include <atomic>
#include <bit>
#include <cstdint>

namespace keel::detail {

inline constexpr int kThreadSlots = 64;
inline constexpr int kSharedSlot = kThreadSlots;  // the cell for threads without a slot of their own

class thread_slot_pool {
 public:
  static int take() noexcept {
    std::uint64_t v = used().load(std::memory_order_relaxed);
    for (;;) {
      if (v == ~std::uint64_t{0}) return kSharedSlot;
      const int i = std::countr_one(v);
      if (used().compare_exchange_weak(v, v | (std::uint64_t{1} << i), std::memory_order_acquire,
                                       std::memory_order_relaxed))
        return i;
    }
  }
  static void give_back(int i) noexcept {
    if (i < kThreadSlots) used().fetch_and(~(std::uint64_t{1} << i), std::memory_order_release);
  }
  // Slots held by live threads, for tests.
  static int taken() noexcept { return std::popcount(used().load(std::memory_order_relaxed)); }

 private:
  static std::atomic<std::uint64_t>& used() noexcept {
    static std::atomic<std::uint64_t> bits{0};
    return bits;
  }
};

// Gives the slot back when its thread exits. Separate from the index itself:
// a thread_local with a destructor is reached through an init guard, and
// the index is read on every call.
inline thread_local int thread_slot_index = -1;

struct thread_slot_holder {
  int index = -1;
  ~thread_slot_holder() {
    if (index >= 0) thread_slot_pool::give_back(index);
    thread_slot_index = kSharedSlot;  // a later thread_local destructor must not use the slot given back
  }
};

[[gnu::cold, gnu::noinline]] inline int take_thread_slot() noexcept {
  thread_local thread_slot_holder holder;
  holder.index = thread_slot_pool::take();
  thread_slot_index = holder.index;
  return holder.index;
}

// This thread's slot: in [0, kThreadSlots), or kSharedSlot.
[[nodiscard]] inline int my_thread_slot() noexcept {
  const int i = thread_slot_index;
  return i >= 0 ? i : take_thread_slot();
}

// A count that many threads add to and few read (completed calls): each
// thread adds to its own cell with a plain load and store; read() sums
// the cells. 4 KiB.
class sharded_count {
 public:
  void add(std::int64_t n = 1) noexcept { add_as(n, std::memory_order_relaxed); }
  [[nodiscard]] std::int64_t read() const noexcept { return sum(std::memory_order_relaxed); }

  // For a count that says when an object may go (a hedge's races): an add
  // that publishes what this thread did before it, and a read that sees it.
  // On x86 both are plain moves, as add() and read() are.
  void add_release(std::int64_t n) noexcept { add_as(n, std::memory_order_release); }
  [[nodiscard]] std::int64_t read_acquire() const noexcept { return sum(std::memory_order_acquire); }

 private:
  // The owner's cell with a plain load and store (ordered `order`); the
  // shared cell, for threads without one, with a read-modify-write.
  void add_as(std::int64_t n, std::memory_order order) noexcept {
    const int slot = my_thread_slot();
    std::atomic<std::int64_t>& c = cells_[static_cast<std::size_t>(slot)].value;
    if (slot == kSharedSlot) [[unlikely]] {
      c.fetch_add(n, order == std::memory_order_relaxed ? order : std::memory_order_acq_rel);
    } else {
      c.store(c.load(std::memory_order_relaxed) + n, order);
    }
  }

  [[nodiscard]] std::int64_t sum(std::memory_order order) const noexcept {
    std::int64_t total = 0;
    for (const cell& c : cells_) total += c.value.load(order);
    return total;
  }

  struct alignas(64) cell {
    std::atomic<std::int64_t> value{0};
  };
  std::array<cell, kThreadSlots + 1> cells_{};
};

}  // namespace keel::detail
