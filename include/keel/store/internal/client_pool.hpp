// keel/store/internal/client_pool.hpp — a bounded pool of network client
// connections, shared by the PostgreSQL and Redis stores.
//
// At most `capacity` connections exist at once. They are made on demand
// (outside the pool's lock, so a slow connect blocks only its caller) and a
// connection is handed to exactly one thread at a time: acquire() (or
// acquire_alive(), which first replaces one found dead while idle) returns a
// move-only handle that gives the connection back when it is destroyed,
// or discards it when the user marked it broken (a dropped connection, a
// command that timed out). A caller that finds every connection busy waits
// until one is returned or its wait limit passes; then it gets Unavailable,
// marked not-started (nothing was sent).
//
// Thread-safety: acquire() and the handles' destruction may happen on any
// thread; the connection behind a handle is used only by its holder.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "keel/core/clock.hpp"
#include "keel/core/status.hpp"
#include "keel/durable/ownership.hpp"

namespace keel::detail {

template <class Conn>
class client_pool {
 public:
  using factory = std::function<absl::StatusOr<std::unique_ptr<Conn>>()>;

  // A connection lent to one thread.
  class handle {
   public:
    handle() = default;
    handle(handle&& o) noexcept : pool_(std::exchange(o.pool_, nullptr)), conn_(std::move(o.conn_)), broken_(o.broken_) {}
    handle& operator=(handle&& o) noexcept {
      if (this != &o) {
        give_back();
        pool_ = std::exchange(o.pool_, nullptr);
        conn_ = std::move(o.conn_);
        broken_ = o.broken_;
      }
      return *this;
    }
    handle(const handle&) = delete;
    handle& operator=(const handle&) = delete;
    ~handle() { give_back(); }

    [[nodiscard]] Conn& operator*() const noexcept { return *conn_; }
    [[nodiscard]] Conn* operator->() const noexcept { return conn_.get(); }
    // The connection is not to be reused: it is closed when the handle ends.
    void mark_broken() noexcept { broken_ = true; }
    // Replaces the connection (a reconnect) while keeping the slot.
    void replace(std::unique_ptr<Conn> c) noexcept {
      conn_ = std::move(c);
      broken_ = false;
    }

   private:
    friend class client_pool;
    handle(client_pool* p, std::unique_ptr<Conn> c) noexcept : pool_(p), conn_(std::move(c)) {}
    void give_back() noexcept {
      if (pool_ != nullptr) pool_->put_back(std::move(conn_), broken_);
      pool_ = nullptr;
    }
    client_pool* pool_ = nullptr;
    std::unique_ptr<Conn> conn_;
    bool broken_ = false;
  };

  client_pool(std::size_t capacity, factory make) : capacity_(capacity), make_(std::move(make)) {}
  client_pool(const client_pool&) = delete;
  client_pool& operator=(const client_pool&) = delete;
  ~client_pool() = default;  // every handle must have been returned

  // A connection within `wait`, or Unavailable (not started) when all are
  // busy that long, or the factory's error when a new one cannot be made.
  [[nodiscard]] absl::StatusOr<handle> acquire(duration wait, std::string_view who) {
    std::unique_lock lock(mu_);
    if (idle_.empty() && open_ >= capacity_) {
      const auto until = std::chrono::steady_clock::now() + wait;
      if (!freed_.wait_until(lock, until, [&] { return !idle_.empty() || open_ < capacity_; })) {
        return store_unavailable_error(absl::StrCat(to_absl(who), ": all ", capacity_,
                                                    " connections stayed busy for ", describe(wait)));
      }
    }
    if (!idle_.empty()) {
      std::unique_ptr<Conn> c = std::move(idle_.back());
      idle_.pop_back();
      return handle(this, std::move(c));
    }
    ++open_;
    lock.unlock();
    absl::StatusOr<std::unique_ptr<Conn>> made = make_();
    if (!made.ok()) {
      put_back(nullptr, true);
      return made.status();
    }
    return handle(this, std::move(*made));
  }

  // acquire(), and a connection the server closed while it sat idle
  // (Conn::idle_and_alive() false) replaced by a fresh one in the same slot,
  // so an operation never starts on a dead connection.
  [[nodiscard]] absl::StatusOr<handle> acquire_alive(duration wait, std::string_view who) {
    absl::StatusOr<handle> h = acquire(wait, who);
    if (!h.ok() || (*h)->idle_and_alive()) return h;
    absl::StatusOr<std::unique_ptr<Conn>> fresh = make_();
    if (!fresh.ok()) {
      h->mark_broken();
      return fresh.status();
    }
    h->replace(std::move(*fresh));
    return h;
  }

  // An idle connection, or none: never waits, never connects (for work on
  // the side, such as ending a session another statement abandoned, which
  // must not wait on a server that may be frozen).
  [[nodiscard]] std::optional<handle> try_idle() {
    std::lock_guard lock(mu_);
    if (idle_.empty()) return std::nullopt;
    std::unique_ptr<Conn> c = std::move(idle_.back());
    idle_.pop_back();
    return handle(this, std::move(c));
  }

  // Connections open now (lent or idle).
  [[nodiscard]] std::size_t open() const {
    std::lock_guard lock(mu_);
    return open_;
  }
  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }

  // Closes every idle connection (the lent ones close when returned broken
  // or stay for reuse).
  void drain() {
    std::vector<std::unique_ptr<Conn>> closing;
    {
      std::lock_guard lock(mu_);
      closing.swap(idle_);
      open_ -= closing.size();
    }
    freed_.notify_all();
  }

 private:
  void put_back(std::unique_ptr<Conn> c, bool broken) noexcept {
    std::unique_ptr<Conn> closing;
    {
      std::lock_guard lock(mu_);
      if (broken || c == nullptr) {
        closing = std::move(c);  // closed outside the lock
        --open_;
      } else {
        idle_.push_back(std::move(c));
      }
    }
    freed_.notify_one();
  }

  const std::size_t capacity_;
  factory make_;
  mutable std::mutex mu_;
  std::condition_variable freed_;
  std::vector<std::unique_ptr<Conn>> idle_;
  std::size_t open_ = 0;
};

}  // namespace keel::detail
