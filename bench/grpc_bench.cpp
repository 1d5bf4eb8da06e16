// The gRPC provider adapter (keel/provider/grpc.hpp) beside a bare stub call
// doing the same work: one unary call on loopback to a server in this
// process (tests/support/grpc_player.hpp), with a 5 s deadline either way.
//
//   BM_Grpc_BareStubCall   ClientContext + set_deadline + stub->Play
//   BM_Grpc_UnaryCall      the same call as keel::grpc_provider inside
//                          keel::pipeline(keel::retry(...)) with a budget
//
// Both are dominated by gRPC's round trip; the difference is keel's share.
// allocs/iter counts the calling thread's allocations only (gRPC's own
// threads allocate too). Names are stable; see docs/benchmarks.md.
#include <chrono>
#include <cstdlib>

#include <benchmark/benchmark.h>

#include "keel/compose/pipeline.hpp"
#include "keel/core/call.hpp"
#include "keel/policy/retry.hpp"
#include "keel/policy/retry_budget.hpp"
#include "keel/provider/grpc.hpp"
#include "support/alloc_counter.hpp"
#include "grpc_player.hpp"  // tests/support

namespace {

keel_test::player_server& server() {
  static keel_test::player_server s;  // one server for the whole run
  return s;
}

keel_test::PlayRequest hello() {
  keel_test::PlayRequest r;
  r.set_text("hello");
  return r;
}

void BM_Grpc_BareStubCall(benchmark::State& state) {
  auto& s = server();
  const keel_test::PlayRequest request = hello();
  keel_bench::count_allocations allocs(state);
  for (auto _ : state) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    keel_test::PlayReply reply;
    const grpc::Status st = s.stub->Play(&context, request, &reply);
    if (!st.ok()) state.SkipWithError("the bare call failed");
    benchmark::DoNotOptimize(reply);
  }
}
BENCHMARK(BM_Grpc_BareStubCall)->UseRealTime();

void BM_Grpc_UnaryCall(benchmark::State& state) {
  auto& s = server();
  const keel_test::PlayRequest request = hello();
  keel::retry_budget budget;
  const auto pipe = keel::pipeline(keel::retry({.max_attempts = 3, .budget = &budget}));
  const auto provider = keel::grpc_provider(*s.stub, &keel_test::Player::Stub::Play, request);
  const keel::real_clock clock;
  keel_bench::count_allocations allocs(state);
  for (auto _ : state) {
    keel::call call(clock.now(), {.timeout = std::chrono::seconds(5)});
    absl::StatusOr<keel_test::PlayReply> reply = pipe.run(call, provider);
    if (!reply.ok()) state.SkipWithError("the keel call failed");
    benchmark::DoNotOptimize(reply);
  }
}
BENCHMARK(BM_Grpc_UnaryCall)->UseRealTime();

}  // namespace
