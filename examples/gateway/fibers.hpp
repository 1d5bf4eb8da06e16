// gateway/fibers.hpp — the gateway's fiber mode, behind a face free of Asio:
// the threads requests run on as fibers, and each upstream's event-loop
// HTTP client on them (gateway/fibers.cpp holds the Asio side).
//
// Why a separate translation unit: keel::asio is built on standalone Asio
// 1.22 (for its per-operation cancellation slots, which Boost 1.74's Asio
// lacks), and the front door on Boost.Asio and Beast (gateway/http_server.hpp).
// The two Asios cannot be compiled into one translation unit (they define
// the same global names), so what touches keel::asio is compiled once in
// fibers.cpp, and the rest of the gateway sees these two classes.
//
// Example:
//
//   gateway::fiber_pool fibers(2);
//   fibers.spawn([] { /* serves one request: keel's waits park the fiber */ });
//   gateway::fiber_http llm({.base_url = "http://127.0.0.1:8000"});
//   // on one of fibers' fibers:
//   absl::Status s = llm.stream(attempt, writer, {.path = "/v1/chat/completions", .body = body});
//
// Thread-safety: every operation from any thread; fiber_http's calls from
// fibers of a fiber_pool (on_fiber() says whether the caller is on one).
#pragma once

#include <memory>
#include <string>

#include "absl/functional/any_invocable.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "keel/core/call.hpp"
#include "keel/provider/http.hpp"

namespace keel {
class stream_writer;
}  // namespace keel

namespace gateway {

// Threads that run fibers, one single-threaded event loop each
// (keel::asio::fiber_threads).
class fiber_pool {
 public:
  // Throws keel::invalid_options unless 1 <= threads <= 64.
  explicit fiber_pool(int threads);
  ~fiber_pool();  // waits for the fibers and the loops to finish
  fiber_pool(const fiber_pool&) = delete;
  fiber_pool& operator=(const fiber_pool&) = delete;

  [[nodiscard]] int threads() const noexcept;
  // Starts `fn` on a fiber of the next thread in turn; false when no stack
  // could be mapped (fn is then destroyed unrun).
  bool spawn(absl::AnyInvocable<void() &&> fn);
  // Lets the loops finish what they hold, then joins them. Idempotent.
  void stop();

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

// One upstream's HTTP client on the event loop of each fiber_pool thread
// (keel::asio::http_client, made on a thread's first call). A call parks
// its fiber until the answer.
class fiber_http {
 public:
  // Throws keel::invalid_options if `o` is invalid.
  explicit fiber_http(keel::http::client_options o);
  ~fiber_http();  // cancels what is in flight; the fiber_pool must outlive it
  fiber_http(const fiber_http&) = delete;
  fiber_http& operator=(const fiber_http&) = delete;

  // True on a fiber of a fiber_pool thread: where exchange() and stream() may run.
  [[nodiscard]] static bool on_fiber() noexcept;

  // One request; a 2xx answer goes to `parse` (on the loop, while the fiber waits).
  using parse_fn = absl::FunctionRef<absl::StatusOr<std::string>(const keel::http::response&)>;
  absl::StatusOr<std::string> exchange(const keel::attempt& a, const keel::http::request& r, parse_fn parse);
  // One event stream fed into `w` on the loop as its bytes arrive.
  absl::Status stream(const keel::attempt& a, keel::stream_writer& w, const keel::http::request& r);

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace gateway
