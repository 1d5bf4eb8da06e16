// Must NOT compile: a hedge around a provider type that declares a
// consequential write without an idempotency identity. With
// -DKEEL_EXPECT_OK the provider declares an idempotent write and it must
// compile (the control: the failure is the static_assert, nothing else).
// Run by the fanout_compile_*_write tests (tests/CMakeLists.txt).
#include "keel/compose/executor.hpp"
#include "keel/compose/hedge.hpp"
#include "keel/compose/pipeline.hpp"
#include "keel/core/call.hpp"

struct charge_card {
#ifdef KEEL_EXPECT_OK
  static constexpr keel::operation operation{.effect = keel::effect::write, .idempotent = true};
#else
  static constexpr keel::operation operation{.effect = keel::effect::write};
#endif
  absl::StatusOr<int> operator()(const keel::attempt&) const { return 1; }
};

int main() {
  keel::bounded_pool pool({.threads = 1});
  keel::hedge hedger({}, pool);
  keel::call call(keel::real_clock{}.now(), {});
  return keel::pipeline(hedger).run(call, charge_card{}).ok() ? 0 : 1;
}
