// How many threads this process has now, for tests that claim work in flight
// holds no thread of its own.
//
//   const int before = keel_test::threads_in_process();
//   ...start 2,000 runs...
//   CHECK(keel_test::threads_in_process() <= before);
//
// A thread joined a moment ago can still be listed: the kernel wakes the
// joiner before it removes the thread's task. So a count taken after a join
// may be one high; compare "no more than before", never "equal to".
//
// Thread-safety: a free function; safe from any thread.
#pragma once

#include <filesystem>

namespace keel_test {

inline int threads_in_process() {
  int n = 0;
  for ([[maybe_unused]] const auto& task : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

}  // namespace keel_test
