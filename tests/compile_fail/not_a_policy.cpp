// Must NOT compile: a pipeline stage that is not a keel::policy (its execute
// is not const, and the pipeline would hold it by value). The error must be
// keel's readable one. With -DKEEL_EXPECT_OK the stage is passed as an lvalue
// (held by reference, so a non-const execute is fine) and it must compile.
// Run by the core_compile_*_policy tests (tests/CMakeLists.txt).
#include "keel/compose/pipeline.hpp"
#include "keel/core/call.hpp"
#include "keel/core/policy.hpp"

struct counts_passes {
  int passes = 0;
  template <class Ctx, class Next>
  auto execute(Ctx& ctx, keel::attempt_plan plan, Next& next) -> decltype(next(ctx, plan)) {
    ++passes;
    return next(ctx, plan);
  }
};

int main() {
  keel::call call(keel::real_clock{}.now(), {});
#ifdef KEEL_EXPECT_OK
  counts_passes shared;
  auto pipe = keel::pipeline(shared);
#else
  auto pipe = keel::pipeline(counts_passes{});
#endif
  return pipe.run(call, [] { return absl::OkStatus(); }).ok() ? 0 : 1;
}
