// Classification and the hints that travel with a status.
#include "keel/outcome.hpp"

#include <chrono>
#include <string>

#include "keel/status.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;
using keel::outcome_kind;

namespace {
constexpr keel::operation read_op{};
constexpr keel::operation write_op{.effect = keel::effect::write};
constexpr keel::operation idempotent_write{.effect = keel::effect::write, .idempotent = true};

outcome_kind classify(const absl::Status& s, const keel::operation& op = read_op) {
  return keel::default_classifier{}(s, op);
}
}  // namespace

TEST_CASE("default classification of absl codes", "[outcome]") {
  CHECK(classify(absl::OkStatus()) == outcome_kind::success);
  CHECK(classify(absl::UnavailableError("503")) == outcome_kind::transient);
  CHECK(classify(absl::AbortedError("conflict, try again")) == outcome_kind::transient);
  CHECK(classify(absl::InternalError("500")) == outcome_kind::transient);
  CHECK(classify(absl::ResourceExhaustedError("429")) == outcome_kind::throttled);
  // Bad credential, unsupported model, invalid argument: permanent.
  CHECK(classify(absl::UnauthenticatedError("bad key")) == outcome_kind::permanent);
  CHECK(classify(absl::PermissionDeniedError("no access")) == outcome_kind::permanent);
  CHECK(classify(absl::InvalidArgumentError("bad request")) == outcome_kind::permanent);
  CHECK(classify(absl::NotFoundError("no such model")) == outcome_kind::permanent);
  CHECK(classify(absl::UnimplementedError("unsupported")) == outcome_kind::permanent);
  CHECK(classify(absl::FailedPreconditionError("x")) == outcome_kind::permanent);
  CHECK(classify(absl::CancelledError("caller left")) == outcome_kind::permanent);
  CHECK(classify(absl::UnknownError("?")) == outcome_kind::ambiguous);
}

TEST_CASE("a timed-out read is transient, a timed-out write is ambiguous", "[outcome]") {
  const absl::Status timeout = absl::DeadlineExceededError("timed out");
  CHECK(classify(timeout, read_op) == outcome_kind::transient);
  CHECK(classify(timeout, write_op) == outcome_kind::ambiguous);
  // Refused before it started: nothing happened, so even a write may retry.
  CHECK(classify(keel::mark_not_started(timeout), write_op) == outcome_kind::transient);
}

TEST_CASE("only transient and throttled are retried; ambiguous only when repeatable", "[outcome]") {
  CHECK(keel::retryable(outcome_kind::transient, write_op));
  CHECK(keel::retryable(outcome_kind::throttled, write_op));
  CHECK_FALSE(keel::retryable(outcome_kind::permanent, read_op));
  CHECK_FALSE(keel::retryable(outcome_kind::success, read_op));
  CHECK_FALSE(keel::retryable(outcome_kind::ambiguous, write_op));
  CHECK(keel::retryable(outcome_kind::ambiguous, idempotent_write));
  CHECK(keel::retryable(outcome_kind::ambiguous, read_op));
}

TEST_CASE("an explicit outcome mark overrides the code", "[outcome]") {
  const absl::Status s = keel::with_outcome(absl::UnavailableError("breaker open"), outcome_kind::permanent);
  CHECK(keel::marked_outcome(s) == outcome_kind::permanent);
  CHECK(classify(s) == outcome_kind::permanent);
  CHECK_FALSE(keel::marked_outcome(absl::UnavailableError("x")).has_value());
  CHECK(keel::with_outcome(absl::OkStatus(), outcome_kind::permanent).ok());
}

TEST_CASE("hints travel as payloads and survive annotation", "[outcome][status]") {
  absl::Status s = keel::with_retry_after(absl::ResourceExhaustedError("429"), 2500ms);
  s = keel::with_refused_by(s, "tenant:acme:rate");
  REQUIRE(keel::retry_after(s) == std::chrono::duration_cast<keel::duration>(2500ms));
  REQUIRE(keel::refused_by(s) == "tenant:acme:rate");

  const absl::Status annotated = keel::annotate(s, "keel: retry budget exhausted");
  CHECK(annotated.code() == absl::StatusCode::kResourceExhausted);
  CHECK(annotated.message() == "keel: retry budget exhausted: 429");
  CHECK(keel::retry_after(annotated) == keel::retry_after(s));
  CHECK(keel::refused_by(annotated) == "tenant:acme:rate");

  CHECK_FALSE(keel::retry_after(absl::UnavailableError("x")).has_value());
  CHECK(keel::retry_after(keel::with_retry_after(absl::UnavailableError("x"), -5s)) == keel::duration::zero());
  CHECK(keel::not_started(keel::mark_not_started(absl::DeadlineExceededError("x"))));
  CHECK_FALSE(keel::not_started(absl::DeadlineExceededError("x")));
  CHECK(keel::annotate(absl::OkStatus(), "ignored").ok());
}

TEST_CASE("a malformed retry-after payload is ignored, not trusted", "[outcome][status]") {
  absl::Status s = absl::ResourceExhaustedError("429");
  s.SetPayload(keel::detail::to_absl(keel::retry_after_payload), absl::Cord("soon"));
  CHECK_FALSE(keel::retry_after(s).has_value());
  s.SetPayload(keel::detail::to_absl(keel::retry_after_payload), absl::Cord("-7"));
  CHECK_FALSE(keel::retry_after(s).has_value());
}
