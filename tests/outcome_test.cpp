// Classification and the hints that travel with a status.
#include "keel/core/outcome.hpp"

#include <chrono>
#include <string>

#include "keel/core/status.hpp"
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
  CHECK(classify(absl::InternalError("500")) == outcome_kind::transient);  // a read
  CHECK(classify(absl::ResourceExhaustedError("429")) == outcome_kind::throttled);
  // Bad credential, unsupported model, invalid argument: permanent.
  CHECK(classify(absl::UnauthenticatedError("bad key")) == outcome_kind::permanent);
  CHECK(classify(absl::PermissionDeniedError("no access")) == outcome_kind::permanent);
  CHECK(classify(absl::InvalidArgumentError("bad request")) == outcome_kind::permanent);
  CHECK(classify(absl::NotFoundError("no such model")) == outcome_kind::permanent);
  CHECK(classify(absl::UnimplementedError("unsupported")) == outcome_kind::permanent);
  CHECK(classify(absl::FailedPreconditionError("x")) == outcome_kind::permanent);
  CHECK(classify(absl::CancelledError("caller left")) == outcome_kind::cancelled);
  CHECK(classify(absl::UnknownError("?")) == outcome_kind::ambiguous);
}

// The whole table of docs/outcomes.md, row by row, for a read and a write.
TEST_CASE("the default classifier's table: for a write, whether it may have been applied decides", "[outcome]") {
  struct row {
    absl::Status status;
    outcome_kind read;
    outcome_kind write;
  };
  const absl::Status refused = keel::refusal(absl::UnavailableError("breaker open"), "breaker:llm", 5s);
  const row rows[] = {
      {absl::CancelledError("caller left"), outcome_kind::cancelled, outcome_kind::cancelled},
      {keel::mark_not_started(absl::CancelledError("before start")), outcome_kind::cancelled, outcome_kind::cancelled},
      {refused, outcome_kind::refused, outcome_kind::refused},
      // A refused-by without "not started" is a provider's failure annotated
      // by keel (the retry budget's): its own kind stands.
      {keel::with_refused_by(absl::InternalError("500"), "retry_budget"), outcome_kind::transient,
       outcome_kind::ambiguous},
      {keel::with_refused_by(keel::mark_not_started(absl::ResourceExhaustedError("full")), "bulkhead:batch"),
       outcome_kind::refused, outcome_kind::refused},
      {absl::UnavailableError("503"), outcome_kind::transient, outcome_kind::transient},
      {absl::AbortedError("conflict"), outcome_kind::transient, outcome_kind::transient},
      {absl::ResourceExhaustedError("429"), outcome_kind::throttled, outcome_kind::throttled},
      {absl::InternalError("500"), outcome_kind::transient, outcome_kind::ambiguous},
      {keel::mark_not_started(absl::InternalError("before sending")), outcome_kind::transient,
       outcome_kind::transient},
      {absl::UnknownError("?"), outcome_kind::ambiguous, outcome_kind::ambiguous},
      {keel::mark_not_started(absl::UnknownError("connect failed")), outcome_kind::transient,
       outcome_kind::transient},
      {absl::DeadlineExceededError("timed out"), outcome_kind::transient, outcome_kind::ambiguous},
      {keel::mark_not_started(absl::DeadlineExceededError("not sent")), outcome_kind::transient,
       outcome_kind::transient},
      {absl::InvalidArgumentError("bad"), outcome_kind::permanent, outcome_kind::permanent},
      {absl::UnauthenticatedError("key"), outcome_kind::permanent, outcome_kind::permanent},
      {absl::PermissionDeniedError("denied"), outcome_kind::permanent, outcome_kind::permanent},
      {absl::NotFoundError("model"), outcome_kind::permanent, outcome_kind::permanent},
      {absl::FailedPreconditionError("x"), outcome_kind::permanent, outcome_kind::permanent},
      {absl::AlreadyExistsError("x"), outcome_kind::permanent, outcome_kind::permanent},
      {absl::OutOfRangeError("x"), outcome_kind::permanent, outcome_kind::permanent},
      {absl::UnimplementedError("x"), outcome_kind::permanent, outcome_kind::permanent},
      {absl::DataLossError("x"), outcome_kind::permanent, outcome_kind::permanent},
      {keel::with_outcome(absl::InternalError("marked"), outcome_kind::transient), outcome_kind::transient,
       outcome_kind::transient},
  };
  for (const row& r : rows) {
    INFO(r.status.ToString());
    CHECK(classify(r.status, read_op) == r.read);
    CHECK(classify(r.status, write_op) == r.write);
    CHECK(classify(r.status, idempotent_write) == r.write);
  }
}

TEST_CASE("a refusal says who refused and when to come back; it is retried only by that hint", "[outcome]") {
  const absl::Status with_hint = keel::refusal(absl::UnavailableError("breaker open"), "breaker:llm", 5s);
  CHECK(keel::not_started(with_hint));
  CHECK(keel::refused_by(with_hint) == "breaker:llm");
  CHECK(keel::retry_after(with_hint) == keel::duration(5s));
  CHECK(keel::marked_outcome(with_hint) == outcome_kind::refused);
  CHECK(keel::retryable(with_hint, outcome_kind::refused, write_op));
  const absl::Status no_hint = keel::refusal(absl::ResourceExhaustedError("cap"), "attempt_cap");
  CHECK_FALSE(keel::retry_after(no_hint).has_value());
  CHECK_FALSE(keel::retryable(no_hint, outcome_kind::refused, read_op));
  CHECK_FALSE(keel::retryable(outcome_kind::refused, read_op));
  CHECK_FALSE(keel::retryable(outcome_kind::cancelled, read_op));
  CHECK_FALSE(keel::provider_outcome(outcome_kind::refused));
  CHECK_FALSE(keel::provider_outcome(outcome_kind::cancelled));
  CHECK(keel::provider_outcome(outcome_kind::permanent));
  CHECK(keel::to_string(outcome_kind::refused) == "refused");
  CHECK(keel::to_string(outcome_kind::cancelled) == "cancelled");
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
