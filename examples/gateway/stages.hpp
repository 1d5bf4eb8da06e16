// gateway/stages.hpp — what the gateway adds to keel for its interactive path:
// the request type a call carries through the pipeline, the gateway's own
// stages (policies), the model provider and the rubric-only fallback.
//
// The interactive path (gateway/plan.hpp) is one keel::pipeline per
// model, built once when the gateway starts and shared by every request:
//
//   keel::pipeline(
//       keel::fallback({.passes_through = gateway::heard_as_is}, {residency, permission, schema},
//                      keel::alternate("rubric-feedback", gateway::rubric_only<Clock>{...}, {...})),
//       gateway::shed_switch{&shed[interactive], "interactive"},
//       quotas.for_model(model_key).with_estimate(...).with_tenant_key(...),
//       gateway::record_once<Once>{&once},
//       pools.for_class("interactive"),
//       gateway::retrieve_rubric<Clock, Retrieval>{&rubrics, retrieval},
//       keel::time_limit({.at_most = plan.model}), keel::retry({...}), breakers, model.interactive_timeout)
//
// Per request nothing of it is built: the caller makes an interactive_request
// (views of the parsed body, the tenant's and the model's configuration, the
// progress record the stages fill) and a keel::call carrying it, and runs the
// model's pipeline with gateway::model_call as the provider. Every stage
// reads the request from the call (call.request<interactive_request>()).
//
// Example:
//
//   gateway::interactive_progress p;
//   const gateway::interactive_request req{.body = rq, .tenant = tenant, .model = model, .progress = p};
//   keel::call call(t0, {.timeout = 3s, .labels = {...}}, req);
//   absl::StatusOr<gateway::detail::answer> got = pipe.run(call, t0, gateway::model_call{&provider});
//   // p.decision: the recorded decision (fresh or replayed); call.record().degraded: the fallback served
//
// Thread-safety: the stages are immutable once built (execute() is const)
// and may run for any number of calls at once; what they point to (the
// idempotency store, the rubric store, the provider, the breakers) is
// thread-safe. An interactive_progress belongs to one request.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "gateway_options.hpp"
#include "keel/core/timer.hpp"
#include "keel/core/call.hpp"
#include "keel/core/policy.hpp"
#include "keel/core/status.hpp"
#include "keel/durable/digest.hpp"
#include "keel/durable/once.hpp"
#include "keel/durable/ownership.hpp"
#include "keel/policy/admission.hpp"
#include "keel/policy/breaker_registry.hpp"
#include "keel/policy/circuit_breaker.hpp"
#include "simulated_provider.hpp"
#include "text.hpp"
#include "upstream.hpp"

namespace gateway {

namespace detail {

using json = nlohmann::json;

[[nodiscard]] inline std::string dump(const json& j) {
  // Text from clients may be invalid UTF-8: replace it rather than throw.
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

// What the model (or the fallback) answered.
struct answer {
  int score = 0;
  std::string feedback;
  std::string served_by;  // "model:<name>" or the fallback path
  std::string note;       // why the answer is degraded, when it is
};

[[nodiscard]] inline json to_json(const answer& a) {
  json j = {{"score", a.score}, {"feedback", a.feedback}, {"served_by", a.served_by}};
  if (!a.note.empty()) j["note"] = a.note;
  return j;
}

// The model's output contract: {"score": 0-10, "feedback": "<1-2000 bytes>"}.
[[nodiscard]] inline absl::StatusOr<answer> parse_model_output(std::string_view raw, std::string_view model) {
  const json j = json::parse(raw.begin(), raw.end(), nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("score") || !j["score"].is_number_integer() ||
      !j.contains("feedback") || !j["feedback"].is_string()) {
    // Internal: transient. Sampling again may give a valid answer; the
    // breaker counts it as a failure of the provider.
    return absl::InternalError(cat("model output broke the contract: ", raw.substr(0, 60)));
  }
  const int score = j["score"].get<int>();
  std::string feedback = j["feedback"].get<std::string>();
  if (score < 0 || score > 10 || feedback.empty() || feedback.size() > 2000)
    return absl::InternalError("model output out of range (score 0-10, feedback 1-2000 bytes)");
  return answer{.score = score, .feedback = std::move(feedback), .served_by = cat("model:", model), .note = {}};
}

// The fallback: what the rubric alone can say, truthfully labelled.
[[nodiscard]] inline answer rubric_feedback(const rubric& r, std::string_view text, std::string_view why) {
  std::vector<std::string> covered, missing;
  for (const std::string& point : r.points) {
    // A point counts as covered when its first word appears in the answer.
    const std::string word = point.substr(0, point.find(' '));
    (text.find(word) != std::string_view::npos ? covered : missing).push_back(point);
  }
  std::string feedback = cat("Rubric check only: your answer covers ", covered.size(), " of ", r.points.size(),
                             " points.");
  for (const std::string& m : missing) absl::StrAppend(&feedback, " Consider: ", m, ".");
  const int score = r.points.empty() ? 0 : static_cast<int>(10 * covered.size() / r.points.size());
  return answer{.score = score,
                .feedback = std::move(feedback),
                .served_by = "rubric-feedback",
                .note = cat(why, "; this feedback comes from the rubric alone and was not recorded")};
}

}  // namespace detail

// POST /v1/feedback, parsed and checked.
struct feedback_request {
  std::string tenant, model, question_id, answer, key;
};

// What a model attempt is asked, and what the model path last said. The
// attempts hold it by shared_ptr: below a hedge, a losing attempt may still
// run after the request has its answer. Written before the first attempt
// starts (the prompt, the key, the model), then only through failed().
struct model_question {
  std::string prompt;           // retrieve_rubric: what the model is asked
  std::string idempotency_key;  // "<tenant>/<key>": one per client request, scoped to the tenant
  std::string model;            // the model clients named (the answer's served_by)

  void failed(std::string why) {
    std::lock_guard lock(mu_);
    last_failure_ = std::move(why);
  }
  [[nodiscard]] std::string last_failure() const {
    std::lock_guard lock(mu_);
    return last_failure_;
  }

 private:
  mutable std::mutex mu_;
  std::string last_failure_;
};

// What the stages learn about one request, for its reply.
struct interactive_progress {
  std::optional<keel::time_point> admitted, retrieved, answered;
  std::optional<rubric> found_rubric;  // retrieve_rubric: read within its stage
  std::string retrieval_error;         // ...or why not
  std::shared_ptr<model_question> question = std::make_shared<model_question>();
  std::optional<keel::once_result> decision;  // record_once: the recorded decision, fresh or replayed
};

// What a call carries through the interactive pipeline. The views must
// outlive the call; the stages write only to `progress`.
struct interactive_request {
  const feedback_request& body;
  const tenant_config& tenant;
  const model_config& model;
  const keel::admission_key* tenant_key = nullptr;  // resolved at startup; null: looked up by name
  interactive_progress& progress;
};

// Failures the caller must hear as they are, never replaced by the
// rubric-only answer (fallback_options::passes_through): a tenant over its
// own quota or an operator's shed switch (the refusal is the contract), and
// what the idempotency record said — another body under the key, a
// duplicate still in flight, a decision that may have been stored (the
// retry replays it; a degraded answer now would contradict it).
[[nodiscard]] inline bool heard_as_is(const absl::Status& s) {
  if (keel::is_conflict(s) || keel::is_in_flight(s) || keel::is_unknown_outcome(s) || keel::is_lost_ownership(s) ||
      keel::is_unresolved(s)) {
    return true;
  }
  const std::optional<std::string> by = keel::refused_by(s);
  return by && (by->starts_with("tenant:") || by->starts_with("shed:"));
}

// An operator's switch: while it is on, the class is refused at once,
// before its quotas are touched (refused-by "shed:<class>", retry in 1 s).
struct shed_switch {
  const std::atomic<bool>* on;
  std::string_view work_class;

  template <class Ctx, class Next>
  auto execute(Ctx& ctx, keel::attempt_plan plan, Next& next) const -> decltype(next(ctx, plan)) {
    using R = decltype(next(ctx, plan));
    if (on->load(std::memory_order_relaxed)) return R(refusal(work_class));
    return next(ctx, plan);
  }

  [[nodiscard]] static absl::Status refusal(std::string_view work_class) {
    return keel::with_retry_after(
        keel::with_refused_by(keel::mark_not_started(absl::UnavailableError(
                                  cat("the ", work_class, " class is being shed by an operator"))),
                              cat("shed:", work_class)),
        std::chrono::seconds(1));
  }
};

// The feedback is a decision recorded in the learner's history: one per
// idempotency key (keel::once). Everything inward runs only when this call
// claims the record; a model answer becomes the decision; a replay returns
// the stored answer without running anything inward. A failure leaves the
// key free (the fallback outside serves unrecorded). The once_result goes to
// the request's progress.
template <class Once>
struct record_once {
  const Once* once;

  template <class Ctx, class Next>
  auto execute(Ctx& ctx, keel::attempt_plan plan, Next& next) const -> decltype(next(ctx, plan)) {
    using R = decltype(next(ctx, plan));
    const interactive_request* rq = ctx.call.template request<interactive_request>();
    if (rq == nullptr) return R(absl::InvalidArgumentError("record_once: the call carries no feedback request"));
    const keel::request_identity id{.tenant = rq->body.tenant, .endpoint = "feedback", .key = rq->body.key};
    const keel::digest request = keel::digest_builder()
                                     .field("question_id", rq->body.question_id)
                                     .field("answer", rq->body.answer)
                                     .field("model", rq->body.model)
                                     .finish();
    std::optional<R> fresh;
    absl::StatusOr<keel::once_result> r =
        once->run(ctx.call, id, request, [&](const keel::claim_context& claim) -> absl::StatusOr<keel::decision> {
          keel::attempt_plan inner = plan;
          inner.deadline = plan.deadline.earliest(claim.deadline);  // never past the record's lease
          R got = next(ctx, inner);
          if (!got.ok()) return got.status();
          // The attempt's end, as the timeout and breaker read it: no clock read here.
          rq->progress.answered = ctx.attempt_end(plan.now);
          keel::decision d{.model_digest = rq->model.digest, .result = detail::dump(detail::to_json(*got))};
          fresh.emplace(std::move(got));
          return d;
        });
    if (!r.ok()) return R(r.status());
    rq->progress.decision = std::move(*r);
    if (fresh) return std::move(*fresh);
    // A replay: the stored answer.
    const detail::json stored = detail::json::parse(rq->progress.decision->decision.result, nullptr, false);
    detail::answer a;
    if (stored.is_object()) {
      a.score = stored.value("score", 0);
      a.feedback = stored.value("feedback", std::string());
      a.served_by = stored.value("served_by", std::string());
    }
    return R(std::move(a));
  }
};

// The retrieve stage: the question's rubric, through its own pipeline (built
// once: a time limit and a retry) on the same call, so it spends the call's
// deadline and attempt cap. A missing rubric is noted on the call, not a
// failure: the model can still answer (the fallback's schema gate cannot).
// Then the prompt, and the pass goes on from the time retrieval ended.
template <class Clock, class Retrieval>
struct retrieve_rubric {
  const rubric_store<Clock>* rubrics;
  Retrieval retrieval;

  template <class Ctx, class Next>
  auto execute(Ctx& ctx, keel::attempt_plan plan, Next& next) const -> decltype(next(ctx, plan)) {
    using R = decltype(next(ctx, plan));
    const interactive_request* rq = ctx.call.template request<interactive_request>();
    if (rq == nullptr) return R(absl::InvalidArgumentError("retrieve_rubric: the call carries no feedback request"));
    interactive_progress& p = rq->progress;
    const keel::time_point admitted = ctx.clock.now();  // after the record's claim and the bulkhead
    p.admitted = admitted;
    absl::StatusOr<rubric> rub = retrieval.run(ctx.call, admitted, [&](const keel::attempt& a) {
      return rubrics->lookup(a, rq->body.question_id);
    });
    plan.now = ctx.clock.now();
    p.retrieved = plan.now;
    std::string& prompt = p.question->prompt;
    prompt = cat("Question ", rq->body.question_id, ".");
    if (rub.ok()) {
      for (const std::string& point : rub->points) absl::StrAppend(&prompt, " Rubric: ", point, ".");
      p.found_rubric = std::move(*rub);
    } else {
      p.retrieval_error = std::string(rub.status().message());
      ctx.call.note_missing();
    }
    absl::StrAppend(&prompt, " Answer: ", rq->body.answer);
    return next(ctx, plan);
  }
};

// The breaker of the deployment an attempt goes to: the first's for the
// primary attempt, the second's for a hedge (keel::attempt_plan::hedge), so
// each deployment's breaker counts only its own calls.
struct deployment_breaker {
  std::array<keel::circuit_breaker*, 2> by_attempt;  // [0]: the first deployment; [1]: the hedge's

  template <class Ctx, class Next>
  auto execute(Ctx& ctx, const keel::attempt_plan& plan, Next& next) const -> decltype(next(ctx, plan)) {
    return by_attempt[plan.hedge > 0 ? 1 : 0]->execute(ctx, plan, next);
  }
};

// The provider: the model upstream asked the request's question (over
// HTTP, or the in-process simulation on a manual clock): the first
// deployment for the primary attempt, the second for a hedge; its output
// checked against the contract. What failed is kept for the degraded
// answer's note. The upstream gets the question's idempotency key;
// keel::http sends it only when the call is a write. Copied into a hedge's
// race: it holds the question by shared_ptr, never the request.
struct model_call {
  std::array<model_upstream*, 2> deployments;  // [0]: the first; [1]: where a hedge goes
  std::shared_ptr<model_question> question;

  absl::StatusOr<detail::answer> operator()(const keel::attempt& a) const {
    if (question == nullptr) return absl::InvalidArgumentError("model_call: no question to ask");
    model_upstream* provider = deployments[a.hedge > 0 ? 1 : 0];
    absl::StatusOr<std::string> raw = provider->complete(a, question->prompt, question->idempotency_key);
    absl::StatusOr<detail::answer> parsed =
        raw.ok() ? detail::parse_model_output(*raw, question->model) : absl::StatusOr<detail::answer>(raw.status());
    if (!parsed.ok()) question->failed(std::string(parsed.status().message()));
    return parsed;
  }
};

// The fallback's alternative: rubric-only feedback, saying why the model
// did not answer (its breaker, its last failure, or no time left).
struct rubric_only {
  keel::breaker_registry* breakers;
  keel::failure_domain domain;

  absl::StatusOr<detail::answer> operator()(const keel::attempt& a) const {
    const interactive_request* rq = a.owner->request<interactive_request>();
    // The schema gate passed only with a rubric; this is the belt to its braces.
    if (rq == nullptr || !rq->progress.found_rubric) return absl::FailedPreconditionError("no rubric to answer from");
    const interactive_progress& p = rq->progress;
    const keel::breaker_state b = breakers->breaker_for(domain).state();
    const std::string why = b == keel::breaker_state::open || b == keel::breaker_state::forced_open
                                ? cat("the provider's circuit breaker is ", keel::to_string(b))
                            : p.question->last_failure().empty()
                                ? std::string("the model had no time left in its stage")
                                : cat("the model failed: ", p.question->last_failure());
    rq->progress.answered = a.start;  // a local answer: ready as soon as it starts
    return detail::rubric_feedback(*p.found_rubric, rq->body.answer, why);
  }
};

}  // namespace gateway
