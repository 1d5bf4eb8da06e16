// keel/provider/grpc.hpp — a gRPC unary call as a keel provider: the
// attempt's deadline becomes the gRPC deadline, its stop token cancels the
// call, and the grpc::Status (with its grpc-retry-pushback-ms trailer)
// becomes an absl::Status that keel's default classifier and keel::retry
// read correctly. Link keel::grpc (Debian: libgrpc++-dev).
//
// Per attempt the adapter
//   - sets the gRPC deadline to the attempt's time left (attempt.timeout),
//     so the server sees it as grpc-timeout and gRPC ends the call there;
//   - cancels the call (ClientContext::TryCancel) when the attempt's stop
//     token is requested: a hedge's loser, a cancelled caller or a deadline
//     timer stops a call in flight, not after it;
//   - sends the idempotency key and, if asked, the call's remaining time as
//     metadata;
//   - maps the result (the table is in docs/providers.md):
//       OK                          success
//       UNAVAILABLE, ABORTED        transient
//       RESOURCE_EXHAUSTED          throttled
//       DEADLINE_EXCEEDED, INTERNAL transient for a read, ambiguous for a write
//       UNKNOWN                     transient for a read, ambiguous for a write
//       CANCELLED                   cancelled when our stop token did it;
//                                   otherwise like UNKNOWN
//       every other code            permanent
//     A grpc-retry-pushback-ms trailer of n >= 0 becomes a retry-after hint
//     of n ms; a negative or malformed one means "do not retry": the status
//     is marked permanent.
//
// Example (Player is the tests' generated service, tests/proto/keel_grpc_test.proto;
// any unary stub method fits):
//
//   auto stub = keel_test::Player::NewStub(grpc::CreateChannel(addr, grpc::InsecureChannelCredentials()));
//   keel::retry_budget budget;
//   auto pipe = keel::pipeline(keel::retry({.max_attempts = 3, .budget = &budget}));
//   keel_test::PlayRequest request;
//   keel::call call(keel::real_clock{}.now(), {.timeout = std::chrono::seconds(2)});
//   absl::StatusOr<keel_test::PlayReply> reply =
//       pipe.run(call, keel::grpc_provider(*stub, &keel_test::Player::Stub::Play, request));
//
// For anything else (an async or callback stub, a GenericStub, metadata of
// your own), keel::grpc_invoke(attempt, options, fn) does the same around
// fn(grpc::ClientContext&) -> grpc::Status, which makes the call.
//
// The request passed as an lvalue is held by reference and must outlive
// every attempt (a hedged loser may still run after run() returns: pass the
// request as an rvalue, then the provider owns a copy). The stub is held by
// reference and must outlive every attempt. Option strings are string_views
// and must outlive the provider too.
//
// Thread-safety: a grpc_unary_provider is const to call and may run attempts
// on several threads at once (gRPC stubs are thread-safe). from_grpc_status
// and grpc_pushback are pure functions.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <stop_token>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include <grpc/support/time.h>
#include <grpcpp/client_context.h>
#include <grpcpp/support/status.h>
#include <grpcpp/support/string_ref.h>
#include <grpcpp/support/time.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "keel/core/call.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/outcome.hpp"
#include "keel/core/status.hpp"

namespace keel {

// The trailer a gRPC server sends to ask for a pause before a retry (gRPC's
// retry design, A6): milliseconds, or negative for "do not retry".
inline constexpr std::string_view grpc_pushback_trailer = "grpc-retry-pushback-ms";

struct grpc_options {
  // Sent as metadata `idempotency_key_header: idempotency_key` on every
  // attempt when not empty: the server recognises a repeated write.
  std::string_view idempotency_key{};
  std::string_view idempotency_key_header = "idempotency-key";
  // When not empty, the call's work time left when the attempt started is
  // sent under this key, in whole milliseconds (for example
  // "keel-remaining-ms"). The attempt's own deadline always travels as
  // gRPC's grpc-timeout, which servers enforce without help.
  std::string_view remaining_time_header{};
  // gRPC's wait-for-ready: queue the call while the channel connects
  // instead of failing UNAVAILABLE at once.
  bool wait_for_ready = false;

  [[nodiscard]] absl::Status validate() const {
    if (idempotency_key_header.empty() && !idempotency_key.empty())
      return detail::invalid_field("grpc_options", "idempotency_key_header", "not be empty when a key is given",
                                   "\"\"");
    if (absl::Status s = check_key("idempotency_key_header", idempotency_key_header); !s.ok()) return s;
    if (absl::Status s = check_key("remaining_time_header", remaining_time_header); !s.ok()) return s;
    for (const char c : idempotency_key) {
      if (c < 0x20 || c > 0x7e)
        return detail::invalid_field("grpc_options", "idempotency_key", "be printable ASCII",
                                     absl::StrCat("\"", detail::to_absl(idempotency_key), "\""));
    }
    return absl::OkStatus();
  }

 private:
  // gRPC metadata keys: lowercase ASCII letters, digits, '-', '_', '.'; not
  // gRPC's own (grpc-) and not binary (-bin), since the values are text.
  [[nodiscard]] static absl::Status check_key(std::string_view field, std::string_view key) {
    if (key.empty()) return absl::OkStatus();
    const auto got = absl::StrCat("\"", detail::to_absl(key), "\"");
    for (const char c : key) {
      const bool ok = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '_' || c == '.';
      if (!ok) return detail::invalid_field("grpc_options", field, "be lowercase letters, digits, -, _ or .", got);
    }
    if (key.starts_with("grpc-")) return detail::invalid_field("grpc_options", field, "not start with grpc-", got);
    if (key.ends_with("-bin")) return detail::invalid_field("grpc_options", field, "not end with -bin", got);
    return absl::OkStatus();
  }
};

// The grpc-retry-pushback-ms trailer of a finished call, if the server sent one.
[[nodiscard]] inline std::optional<std::string_view> grpc_pushback(const ::grpc::ClientContext& context) {
  const auto& trailers = context.GetServerTrailingMetadata();
  const auto it = trailers.find(::grpc::string_ref(grpc_pushback_trailer.data(), grpc_pushback_trailer.size()));
  if (it == trailers.end()) return std::nullopt;
  return std::string_view(it->second.data(), it->second.size());
}

// The keel status for a finished gRPC call: `status` as the call returned
// it, `op` the call's operation, `pushback` the grpc-retry-pushback-ms
// trailer (if any), `stopped_by_caller` whether our stop token was requested
// (a CANCELLED status is then the caller's cancellation). Allocates only for
// a failure.
[[nodiscard]] inline absl::Status from_grpc_status(const ::grpc::Status& status, const operation& op,
                                                   std::optional<std::string_view> pushback = std::nullopt,
                                                   bool stopped_by_caller = false) {
  if (status.ok()) return absl::OkStatus();
  const ::grpc::StatusCode code = status.error_code();
  if (code == ::grpc::StatusCode::CANCELLED && stopped_by_caller) {
    return absl::CancelledError(absl::StrCat("grpc: cancelled by keel's stop token: ", status.error_message()));
  }
  absl::Status s;
  if (code == ::grpc::StatusCode::CANCELLED) {
    // Not our doing (the server or a proxy cancelled): not the caller going
    // away, so not keel's `cancelled`. Its effect is unknown, as UNKNOWN's.
    s = absl::UnknownError(absl::StrCat("grpc: CANCELLED, not by the caller: ", status.error_message()));
  } else if (static_cast<int>(code) > 0 && static_cast<int>(code) <= 16) {
    // gRPC's codes are abseil's, number for number.
    s = absl::Status(static_cast<absl::StatusCode>(static_cast<int>(code)), status.error_message());
  } else {
    s = absl::UnknownError(absl::StrCat("grpc: status code ", static_cast<int>(code), ": ", status.error_message()));
  }
  // The default classifier calls Unknown ambiguous even for a read; for a
  // gRPC read it is an error whose repeat harms nothing.
  if (s.code() == absl::StatusCode::kUnknown && op.effect == effect::read) {
    s = with_outcome(std::move(s), outcome_kind::transient);
  }
  if (pushback) {
    std::int64_t ms = 0;
    if (absl::SimpleAtoi(detail::to_absl(*pushback), &ms) && ms >= 0) {
      s = with_retry_after(std::move(s), std::chrono::milliseconds(ms));
    } else {
      // gRPC's retry design: a negative (or unreadable) pushback means the
      // server asks not to be retried.
      s = with_outcome(annotate(s, absl::StrCat("grpc: server asked not to retry (",
                                                detail::to_absl(grpc_pushback_trailer), ": ",
                                                detail::to_absl(*pushback), ")")),
                       outcome_kind::permanent);
    }
  }
  return s;
}

namespace detail {
// A gRPC deadline `timeout` from now, or none for an attempt without one.
inline void set_grpc_deadline(::grpc::ClientContext& context, duration timeout) {
  // Beyond a year is "no deadline" (an infinite keel deadline gives duration::max()).
  if (timeout > std::chrono::hours(24 * 365)) return;
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(timeout).count();
  // A timespan: gRPC adds its own clock's now when the call is created, so
  // no clock is read here and keel's clock (a manual one in tests) never
  // meets gRPC's.
  context.set_deadline(gpr_time_from_nanos(ns < 0 ? 0 : ns, GPR_TIMESPAN));
}
}  // namespace detail

// Runs one gRPC call for attempt `a`: `fn(grpc::ClientContext&)` makes the
// call on the context it is given (deadline, cancellation and metadata set)
// and returns its grpc::Status. A stop requested before the call starts
// returns absl::CancelledError marked not started, without calling fn.
//
// Thread-safety: as safe as fn; the stop token may be requested from any thread.
template <class Fn>
  requires std::is_invocable_r_v<::grpc::Status, Fn&, ::grpc::ClientContext&>
[[nodiscard]] absl::Status grpc_invoke(const attempt& a, const grpc_options& o, Fn&& fn) {
  if (a.stop.stop_requested()) {
    return mark_not_started(absl::CancelledError("grpc: attempt cancelled before the call started"));
  }
  ::grpc::ClientContext context;
  detail::set_grpc_deadline(context, a.timeout);
  if (o.wait_for_ready) context.set_wait_for_ready(true);
  if (!o.idempotency_key.empty()) {
    context.AddMetadata(std::string(o.idempotency_key_header), std::string(o.idempotency_key));
  }
  if (!o.remaining_time_header.empty() && a.owner != nullptr && !a.owner->work_deadline().is_infinite()) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(a.owner->remaining(a.start)).count();
    context.AddMetadata(std::string(o.remaining_time_header), absl::StrCat(left < 0 ? 0 : left));
  }
  ::grpc::Status status;
  {
    // Constructed after the context and gone before it. Runs at once if the
    // stop came since the check above: TryCancel before the call cancels it
    // as it starts.
    const std::stop_callback cancel(a.stop, [&context]() noexcept { context.TryCancel(); });
    status = fn(context);
  }
  if (status.ok()) return absl::OkStatus();
  const operation op = a.owner != nullptr ? a.owner->operation() : operation{};
  return from_grpc_status(status, op, grpc_pushback(context), a.stop.stop_requested());
}

// A generated stub's unary method, `request` and options as a keel provider:
// callable with a const keel::attempt&, it returns absl::StatusOr<Response>.
// Build it with keel::grpc_provider().
template <class Stub, class Request, class Response, class RequestHolder>
class grpc_unary_provider {
 public:
  using method_type = ::grpc::Status (Stub::*)(::grpc::ClientContext*, const Request&, Response*);

  // Throws keel::invalid_options if `o` is invalid.
  template <class R>
  grpc_unary_provider(Stub& stub, method_type method, R&& request, const grpc_options& o)
      : stub_(&stub), method_(method), request_(std::forward<R>(request)), options_(o) {
    detail::require_valid(o.validate());
  }

  [[nodiscard]] absl::StatusOr<Response> operator()(const attempt& a) const {
    Response response;
    absl::Status s = grpc_invoke(a, options_, [&](::grpc::ClientContext& context) {
      return (stub_->*method_)(&context, this->request(), &response);
    });
    if (!s.ok()) return s;
    return absl::StatusOr<Response>(std::move(response));
  }

  [[nodiscard]] const Request& request() const noexcept {
    if constexpr (std::is_pointer_v<RequestHolder>) {
      return *request_;
    } else {
      return request_;
    }
  }
  [[nodiscard]] const grpc_options& options() const noexcept { return options_; }

 private:
  Stub* stub_;
  method_type method_;
  RequestHolder request_;
  grpc_options options_;
};

// A request given as an lvalue is held by reference (it must outlive every
// attempt); one given as an rvalue is moved into the provider. Throws
// keel::invalid_options if `o` is invalid.
template <class Stub, class Request, class Response>
[[nodiscard]] auto grpc_provider(std::type_identity_t<Stub>& stub,
                                 ::grpc::Status (Stub::*method)(::grpc::ClientContext*, const Request&, Response*),
                                 const Request& request, const grpc_options& o = {}) {
  return grpc_unary_provider<Stub, Request, Response, const Request*>(stub, method, &request, o);
}

template <class Stub, class Request, class Response>
[[nodiscard]] auto grpc_provider(std::type_identity_t<Stub>& stub,
                                 ::grpc::Status (Stub::*method)(::grpc::ClientContext*, const Request&, Response*),
                                 Request&& request, const grpc_options& o = {}) {
  return grpc_unary_provider<Stub, Request, Response, Request>(stub, method, std::move(request), o);
}

}  // namespace keel
