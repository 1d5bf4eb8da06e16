// keel's asynchronous runs (keel/asio/run.hpp) beside the synchronous runs
// of the same pipelines, measured in the same run:
//
//   BM_AsyncRun_Empty                   an async_run through a pipeline with
//                                       no policy: the fiber, the posted
//                                       start and the provider's post
//   BM_SyncRun_Empty                    the same pipeline run synchronously
//   BM_AsyncPipeline_Full_Success       BM_Pipeline_Full_Success's policies
//                                       (keel_bench_protection) run by
//                                       async_run; one thread runs the executor
//   BM_SyncPipeline_Full_Success        the same pipeline, synchronously, here
//   BM_AsyncPipeline_Full_Success_Posted  the same, the operation completing
//                                       through a post to the executor
//   BM_AsyncBaseline_PostedAnswer       that operation alone, back to back
//   BM_AsyncPipeline_Full_Success_OnFiber  the pipeline run on a fiber the
//                                       service already has (no fiber per
//                                       call); _Posted: the posting operation
//   BM_Fiber_SpawnFinish                a fiber started and finished
//   BM_AsyncHedge_PrimaryWins           a hedged async run whose primary
//                                       (on the caller's fiber) answers first
//   BM_SyncHedge_PrimaryWins_OnCallerThread  BM_Hedge_PrimaryWins_OnCallerThread
//                                       (keel_bench_fanout), here
//
// Each benchmark thread runs its own io_context: the next run starts from
// the completion handler of the last, on the executor's thread, as a
// service's would. The asynchronous provider completes at once through a
// dispatch (on the executor's thread: before it returns), the twin of the
// synchronous benchmarks' trivial provider; _Posted variants complete
// through a post, as a ready socket read does.
#include <chrono>
#include <optional>

#include <asio/associated_executor.hpp>
#include <asio/async_result.hpp>
#include <asio/bind_executor.hpp>
#include <asio/dispatch.hpp>
#include <asio/io_context.hpp>
#include <asio/post.hpp>
#include <benchmark/benchmark.h>

#include "keel/asio/executor.hpp"
#include "keel/asio/run.hpp"
#include "keel/compose/executor.hpp"
#include "keel/compose/hedge.hpp"
#include "keel/compose/pipeline.hpp"
#include "keel/core/call.hpp"
#include "keel/policy/adaptive_timeout.hpp"
#include "keel/policy/admission.hpp"
#include "keel/policy/bulkhead.hpp"
#include "keel/policy/circuit_breaker.hpp"
#include "keel/policy/retry.hpp"
#include "keel/policy/retry_budget.hpp"
#include "keel/policy/time_limit.hpp"
#include "support/alloc_counter.hpp"
#include "support/baselines.hpp"

using namespace std::chrono_literals;

namespace {

// Completes at once, through a post to the handler's executor.
struct posted_answer {
  using result_type = absl::StatusOr<int>;
  template <class Token>
  auto operator()(const keel::attempt& a, Token&& token) const {
    return asio::async_initiate<Token, void(result_type)>(
        [](auto handler, int number) {
          auto ex = asio::get_associated_executor(handler);
          asio::post(ex, [h = std::move(handler), number]() mutable { std::move(h)(result_type(number)); });
        },
        token, a.number);
  }
};

// Completes at once through a dispatch: on the executor's thread (where an
// attempt's fiber runs) the handler runs before the operation returns, the
// asynchronous twin of keel_bench::trivial_provider.
struct immediate_answer {
  using result_type = absl::StatusOr<int>;
  template <class Token>
  auto operator()(const keel::attempt& a, Token&& token) const {
    return asio::async_initiate<Token, void(result_type)>(
        [](auto handler, int number) {
          auto ex = asio::get_associated_executor(handler);
          asio::dispatch(ex, [h = std::move(handler), number]() mutable { std::move(h)(result_type(number)); });
        },
        token, a.number);
  }
};

struct session_request {
  const keel::admission_key* tenant = nullptr;
};

// Runs `make_call` + async_run back to back on this thread's io_context
// until the benchmark is done.
template <class Provider = immediate_answer, class Pipe, class MakeCall>
void drive_async(benchmark::State& state, const Pipe& pipe, MakeCall make_call) {
  asio::io_context io(1);
  struct driver {
    benchmark::State& state;
    asio::io_context& io;
    const Pipe& pipe;
    MakeCall& make_call;
    std::optional<keel::call> call;
    struct on_answer {
      driver* d;
      void operator()(absl::StatusOr<int> r) const {
        benchmark::DoNotOptimize(r);
        d->next();
      }
    };
    void next() {
      if (!state.KeepRunning()) return;
      make_call(call);
      keel::asio::async_run(io.get_executor(), pipe, *call, Provider{}, on_answer{this});
    }
  };
  driver d{state, io, pipe, make_call, std::nullopt};
  keel_bench::count_allocations allocs(state);
  d.next();
  io.run();
}

template <class Pipe, class MakeCall>
void drive_sync(benchmark::State& state, const Pipe& pipe, MakeCall make_call) {
  keel_bench::count_allocations allocs(state);
  std::optional<keel::call> call;
  for (auto _ : state) {
    make_call(call);
    absl::StatusOr<int> r = pipe.run(*call, keel_bench::trivial_provider{});
    benchmark::DoNotOptimize(r);
  }
}

auto plain_call() {
  return [](std::optional<keel::call>& c) { c.emplace(keel::real_clock{}.now(), keel::call_options{.timeout = 3s}); };
}

void BM_AsyncRun_Empty(benchmark::State& state) {
  static const auto pipe = keel::pipeline();
  drive_async(state, pipe, plain_call());
}
BENCHMARK(BM_AsyncRun_Empty)->Threads(1)->Threads(2);

void BM_SyncRun_Empty(benchmark::State& state) {
  static const auto pipe = keel::pipeline();
  drive_sync(state, pipe, plain_call());
}
BENCHMARK(BM_SyncRun_Empty)->Threads(1)->Threads(2);

// BM_Pipeline_Full_Success's pipeline: time limit, admission (tenant and
// model, resolved once), bulkhead, breaker, retry with budget, adaptive timeout.
struct full {
  keel::admission quotas{{.tenant_defaults = {.rate = 1e9, .burst = 1e12, .max_in_flight = 1000},
                          .model_defaults = {.max_in_flight = 1000}}};
  keel::bulkhead pools{{.classes = {{.name = "interactive", .capacity = 24}, {.name = "batch", .capacity = 8}}}};
  keel::circuit_breaker breaker{{.name = "llm"}};
  keel::retry_budget budget{{.ratio = 0.1}};
  keel::adaptive_timeout timeouts;
  keel::admission_key model = *quotas.model_key("m-large", keel::real_clock{}.now());
  keel::admission_key tenant = *quotas.tenant_key("acme", keel::real_clock{}.now());
  session_request session{.tenant = &tenant};

  static full& get() {
    static full f;
    return f;
  }
  auto pipeline() {
    auto tenant_of = keel::from_request<session_request>([](const session_request& r) { return r.tenant; },
                                                         static_cast<const keel::admission_key*>(nullptr));
    return keel::pipeline(keel::time_limit({.at_most = 2s}), quotas.for_model(model).with_tenant_key(tenant_of),
                          pools.for_class("interactive"), breaker,
                          keel::retry({.max_attempts = 3, .budget = &budget}), timeouts);
  }
  auto make_call() {
    return [this](std::optional<keel::call>& c) {
      const keel::labels labels{.tenant = "acme", .model = "m-large", .work_class = "interactive"};
      c.emplace(keel::real_clock{}.now(), keel::call_options{.timeout = 3s, .response_reserve = 200ms, .labels = labels},
                session);
    };
  }
};

void BM_AsyncPipeline_Full_Success(benchmark::State& state) {
  static const auto pipe = full::get().pipeline();
  drive_async(state, pipe, full::get().make_call());
}
BENCHMARK(BM_AsyncPipeline_Full_Success)->Threads(1)->Threads(2);

// The same pipeline run on a fiber the service already has (a connection's,
// a coroutine's, spawned once): each call parks the fiber on the operation's
// completion, with no fiber started per call.
template <class Provider>
void drive_on_fiber(benchmark::State& state) {
  static const auto pipe = full::get().pipeline();
  asio::io_context io(1);
  keel_bench::count_allocations allocs(state);
  keel::asio::spawn(io.get_executor(), [&] {
    auto make_call = full::get().make_call();
    auto provider = keel::asio::awaited(Provider{}, io.get_executor());
    std::optional<keel::call> call;
    for (auto _ : state) {
      make_call(call);
      absl::StatusOr<int> r = pipe.run(*call, provider);
      benchmark::DoNotOptimize(r);
    }
  });
  io.run();
}
void BM_AsyncPipeline_Full_Success_OnFiber(benchmark::State& state) { drive_on_fiber<immediate_answer>(state); }
BENCHMARK(BM_AsyncPipeline_Full_Success_OnFiber)->Threads(1)->Threads(2);
void BM_AsyncPipeline_Full_Success_OnFiber_Posted(benchmark::State& state) { drive_on_fiber<posted_answer>(state); }
BENCHMARK(BM_AsyncPipeline_Full_Success_OnFiber_Posted)->Threads(1)->Threads(2);

// The same with an operation that completes through a post (a socket read
// that is ready completes so): the post and the scheduler's turn are the
// operation's, measured alone in BM_AsyncBaseline_PostedAnswer.
void BM_AsyncPipeline_Full_Success_Posted(benchmark::State& state) {
  static const auto pipe = full::get().pipeline();
  drive_async<posted_answer>(state, pipe, full::get().make_call());
}
BENCHMARK(BM_AsyncPipeline_Full_Success_Posted)->Threads(1)->Threads(2);

// posted_answer called back to back from its own completion handler: what the
// operation and the executor cost without keel.
void BM_AsyncBaseline_PostedAnswer(benchmark::State& state) {
  asio::io_context io(1);
  struct driver {
    benchmark::State& state;
    asio::io_context* io;
    keel::attempt a{};
    void next() {
      if (!state.KeepRunning()) return;
      posted_answer{}(a, asio::bind_executor(*io, [this](absl::StatusOr<int> r) {
                        benchmark::DoNotOptimize(r);
                        next();
                      }));
    }
  };
  driver d{state, &io};
  keel_bench::count_allocations allocs(state);
  asio::post(io, [&] { d.next(); });
  io.run();
}
BENCHMARK(BM_AsyncBaseline_PostedAnswer)->Threads(1)->Threads(2);

void BM_SyncPipeline_Full_Success(benchmark::State& state) {
  static const auto pipe = full::get().pipeline();
  drive_sync(state, pipe, full::get().make_call());
}
BENCHMARK(BM_SyncPipeline_Full_Success)->Threads(1)->Threads(2);

// A hedge whose primary answers before the 1 s delay: the race's timer armed
// and disarmed, no hedge started.
void BM_AsyncHedge_PrimaryWins(benchmark::State& state) {
  // The hedges' fibers would run on the io_context of the thread that
  // started the race; none starts here (the primary always wins).
  static asio::io_context spare(1);
  static keel::asio::fiber_executor fibers(spare.get_executor());
  static keel::retry_budget budget({.ratio = 0.1});
  static keel::hedge hedger(
      {.delay = 1s, .max_hedges = 1, .budget = &budget, .primary_on_caller_thread = true}, fibers);
  static const auto pipe = keel::pipeline(hedger);
  drive_async(state, pipe, plain_call());
}
BENCHMARK(BM_AsyncHedge_PrimaryWins)->Threads(1)->Threads(2);

void BM_SyncHedge_PrimaryWins_OnCallerThread(benchmark::State& state) {
  static keel::bounded_pool pool({.threads = 2, .queue_capacity = 64});
  static keel::retry_budget budget({.ratio = 0.1});
  static keel::hedge hedger(
      {.delay = 1s, .max_hedges = 1, .budget = &budget, .primary_on_caller_thread = true}, pool);
  static const auto pipe = keel::pipeline(hedger);
  drive_sync(state, pipe, plain_call());
}
BENCHMARK(BM_SyncHedge_PrimaryWins_OnCallerThread)->Threads(1)->Threads(2);

}  // namespace

namespace {
// A fiber started and finished back to back (what every run pays): taken
// from the thread's pool, switched into, switched out of, put back.
void BM_Fiber_SpawnFinish(benchmark::State& state) {
  asio::io_context io(1);
  struct driver {
    benchmark::State& state;
    asio::io_context* io;
    void next() {
      if (!state.KeepRunning()) return;
      keel::asio::spawn(io->get_executor(), [this] { asio::post(*io, [this] { next(); }); });
    }
  };
  driver d{state, &io};
  keel_bench::count_allocations allocs(state);
  asio::post(io, [&] { d.next(); });
  io.run();
}
BENCHMARK(BM_Fiber_SpawnFinish);
}  // namespace
