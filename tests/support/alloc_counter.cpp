#include "support/alloc_counter.hpp"

#include <cstdlib>
#include <new>

namespace {
thread_local std::int64_t allocations = 0;

[[maybe_unused]] void* allocate(std::size_t n) {
  ++allocations;
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
}  // namespace

namespace keel_test {
std::int64_t thread_allocations() noexcept { return allocations; }
bool allocations_counted() noexcept {
#ifdef KEEL_NO_ALLOCATION_COUNTING
  return false;
#else
  return true;
#endif
}
}  // namespace keel_test

// Sanitizer runtimes bring their own operator new; there, nothing is counted
// (allocations_counted() says so) and the sanitizer checks memory instead.
#ifndef KEEL_NO_ALLOCATION_COUNTING
void* operator new(std::size_t n) { return allocate(n); }
void* operator new[](std::size_t n) { return allocate(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
#endif
