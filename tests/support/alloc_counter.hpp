// Counts heap allocations made by the current thread while a scope is open.
// The test binaries replace global operator new (alloc_counter.cpp).
#pragma once

#include <cstdint>

namespace keel_test {

std::int64_t thread_allocations() noexcept;
// False in sanitizer builds, where operator new belongs to the sanitizer.
bool allocations_counted() noexcept;

class count_allocations {
 public:
  count_allocations() noexcept : start_(thread_allocations()) {}
  [[nodiscard]] std::int64_t count() const noexcept { return thread_allocations() - start_; }

 private:
  std::int64_t start_;
};

}  // namespace keel_test
