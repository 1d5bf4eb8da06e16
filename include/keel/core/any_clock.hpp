// keel/core/any_clock.hpp — any keel clock behind one type, for components
// that keep a clock of their own but should not be templates on it.
//
// The environment is where a service's clock lives; policies read it from
// the run context. A few components hold a clock for their whole life and
// are not run through a pipeline: the in-process store (its leases expire
// on it), the store guard (it times each store operation). keel::any_clock
// lets them take whichever clock the environment has, real or manual,
// without a Clock template parameter of their own:
//
//   keel::testing::manual_clock clock;
//   keel::memory_store store(clock);          // expiry driven by the test
//   keel::memory_store production;            // keel::real_clock
//
// It holds the clock by value, as a component that took a `Clock` did: a
// copy of a manual clock shares its timeline. A clock must fit in two
// pointers and be nothrow copyable (real_clock is empty; manual_clock holds
// one shared pointer), which is checked at compile time. Each operation is
// one indirect call: fine for a store operation, not for a policy's hot path.
//
// Thread-safety: as the clock it holds; copying an any_clock copies the clock.
#pragma once

#include <cstddef>
#include <mutex>
#include <new>
#include <stop_token>
#include <type_traits>
#include <utility>

#include "absl/functional/function_ref.h"
#include "keel/core/clock.hpp"
#include "keel/core/condition.hpp"

namespace keel {

class any_clock {
 public:
  // keel::real_clock.
  any_clock() noexcept : any_clock(real_clock{}) {}

  template <keel::clock C>
    requires(!std::same_as<std::remove_cvref_t<C>, any_clock>)
  any_clock(const C& c) noexcept  // NOLINT: implicit, as the clock it holds
      : ops_(&ops_for<C>) {
    static_assert(sizeof(C) <= sizeof(buf_) && alignof(C) <= alignof(std::max_align_t),
                  "keel::any_clock holds a clock of at most two pointers: hold its state by pointer");
    static_assert(std::is_nothrow_copy_constructible_v<C>, "keel::any_clock: the clock must be nothrow copyable");
    ::new (static_cast<void*>(buf_)) C(c);
  }

  any_clock(const any_clock& o) noexcept : ops_(o.ops_) { ops_->copy(o.buf_, buf_); }
  any_clock& operator=(const any_clock& o) noexcept {
    if (this != &o) {
      ops_->destroy(buf_);
      ops_ = o.ops_;
      ops_->copy(o.buf_, buf_);
    }
    return *this;
  }
  ~any_clock() { ops_->destroy(buf_); }

  [[nodiscard]] time_point now() const noexcept { return ops_->now(buf_); }

  bool sleep_until(time_point t, std::stop_token stop) const { return ops_->sleep_until(buf_, t, std::move(stop)); }

  template <class Ready>
  bool wait_until(std::unique_lock<std::mutex>& lock, keel::condition& cv, time_point t, std::stop_token stop,
                  Ready ready) const {
    return ops_->wait_until(buf_, lock, cv, t, std::move(stop), absl::FunctionRef<bool()>(ready));
  }

  // The clock held, when it is a C; else null.
  template <keel::clock C>
  [[nodiscard]] const C* target() const noexcept {
    return ops_ == &ops_for<C> ? std::launder(reinterpret_cast<const C*>(buf_)) : nullptr;
  }

 private:
  struct ops {
    time_point (*now)(const unsigned char*) noexcept;
    bool (*sleep_until)(const unsigned char*, time_point, std::stop_token);
    bool (*wait_until)(const unsigned char*, std::unique_lock<std::mutex>&, keel::condition&, time_point,
                       std::stop_token, absl::FunctionRef<bool()>);
    void (*copy)(const unsigned char*, unsigned char*) noexcept;
    void (*destroy)(unsigned char*) noexcept;
  };

  template <class C>
  static const C& as(const unsigned char* b) noexcept {
    return *std::launder(reinterpret_cast<const C*>(b));
  }

  template <class C>
  static constexpr ops ops_for{
      [](const unsigned char* b) noexcept { return as<C>(b).now(); },
      [](const unsigned char* b, time_point t, std::stop_token stop) { return as<C>(b).sleep_until(t, std::move(stop)); },
      [](const unsigned char* b, std::unique_lock<std::mutex>& lock, keel::condition& cv, time_point t,
         std::stop_token stop, absl::FunctionRef<bool()> ready) {
        return as<C>(b).wait_until(lock, cv, t, std::move(stop), ready);
      },
      [](const unsigned char* from, unsigned char* to) noexcept { ::new (static_cast<void*>(to)) C(as<C>(from)); },
      [](unsigned char* b) noexcept { std::launder(reinterpret_cast<C*>(b))->~C(); },
  };

  alignas(std::max_align_t) unsigned char buf_[2 * sizeof(void*)];
  const ops* ops_;
};

static_assert(clock<any_clock>);

}  // namespace keel
