// Must NOT compile: a hedged pipeline run with a provider it cannot copy (a
// losing attempt may still call it after run() returns). With
// -DKEEL_EXPECT_OK the provider is passed as std::ref(p), the documented way
// to share one that outlives every attempt, and it must compile.
// Run by the fanout_compile_*_provider tests (tests/CMakeLists.txt).
#include <functional>
#include <mutex>

#include "keel/compose/executor.hpp"
#include "keel/compose/hedge.hpp"
#include "keel/compose/pipeline.hpp"
#include "keel/core/call.hpp"

struct counting_provider {
  std::mutex mu;  // not copyable
  int calls = 0;
  absl::StatusOr<int> operator()(const keel::attempt&) {
    std::lock_guard lock(mu);
    return ++calls;
  }
};

int main() {
  keel::bounded_pool pool({.threads = 1});
  keel::hedge hedger({}, pool);
  keel::call call(keel::real_clock{}.now(), {});
  counting_provider p;
#ifdef KEEL_EXPECT_OK
  return keel::pipeline(hedger).run(call, std::ref(p)).ok() ? 0 : 1;
#else
  return keel::pipeline(hedger).run(call, p).ok() ? 0 : 1;
#endif
}
