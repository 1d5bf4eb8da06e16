// keel/asio/executor.hpp — a keel::executor (keel/compose/executor.hpp) that
// runs each task on a fiber of an Asio executor: a hedge's attempts and a
// fan-out's units race on the executor, with no thread handed a call.
//
// In an asynchronous run (keel/asio/run.hpp) a keel::hedge given this
// executor starts its primary and its hedges as fibers beside the caller's;
// each attempt's provider operation runs on the executor, and a loser is
// stopped through its operation's cancellation slot. With
// hedge_options::primary_on_caller_thread the primary runs on the caller's
// own fiber, which is the cheapest race (no spawn, no post): a loser that
// honours its cancellation slot returns at once, so the caller is not held.
//
// Example:
//
//   asio::io_context io(1);
//   keel::asio::fiber_executor fibers(io.get_executor());
//   keel::retry_budget budget({.ratio = 0.05});
//   keel::hedge hedger({.delay = std::chrono::milliseconds(80), .max_hedges = 1, .budget = &budget,
//                       .primary_on_caller_thread = true}, fibers);
//   static_assert(keel::executor<keel::asio::fiber_executor>);
//
// Thread-safety: try_execute from any thread (the hedge's timer thread
// calls it); the task runs on the executor.
#pragma once

#include <utility>

#include <asio/any_io_executor.hpp>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "keel/asio/fiber.hpp"
#include "keel/compose/executor.hpp"
#include "keel/core/status.hpp"

namespace keel::asio {

class fiber_executor {
 public:
  explicit fiber_executor(::asio::any_io_executor ex) : ex_(std::move(ex)) {}

  // Runs `task` on a new fiber: on the executor of the fiber that asks (a
  // race's caller), else on this one's (the hedge's timer thread asks from
  // outside any fiber). Refused (ResourceExhausted, not started) only when
  // no stack can be mapped.
  absl::Status try_execute(absl::AnyInvocable<void() &&> task) {
    const detail::fiber* asking = detail::current_asio_fiber();
    if (spawn(asking != nullptr ? asking->executor() : ex_, [t = std::move(task)]() mutable { std::move(t)(); }))
      return absl::OkStatus();
    return keel::mark_not_started(absl::ResourceExhaustedError("keel::asio: no stack could be mapped for a fiber"));
  }

  [[nodiscard]] const ::asio::any_io_executor& executor() const noexcept { return ex_; }

 private:
  ::asio::any_io_executor ex_;
};

static_assert(keel::executor<fiber_executor>);

}  // namespace keel::asio
