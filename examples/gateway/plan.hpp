// gateway/plan.hpp — the plan a configuration describes, read top to
// bottom: for each model, where it is served and the pipeline each endpoint
// runs, every stage of the seed's plan in order.
//
// A `routing` is one plan: the models (each a `model_state`: its
// deployments, stream budgets, stream guard, retry budget and three
// pipelines), the tenants' and models' quotas, and the API keys.
// plan_builder::build() makes one from gateway_options; the gateway serves
// one at a time, and a configuration reload swaps in a new one
// (gateway_core.hpp). What the plans share and what outlives each of them
// is not in a plan: the breakers, bulkheads, shed switches, stores and the
// gateway's retry budget are the gateway's (plan_builder::shared); the
// stream guards, the models' own retry budgets and the deadline cut's
// timer are the builder's, kept for its life and reused by the next plan
// when unchanged (what they learned and counted carries over a reload).
//
// The three pipelines of a model, outer stage first (docs/gateway.md says
// why in this order):
//
//   interactive  fallback (residency, permission and schema gates; the
//   (feedback)   rubric-only answer) -> shed switch -> quotas (tenant and
//                model, in tokens) -> the idempotency record (keel::once)
//                -> the interactive bulkhead -> rubric retrieval (its own
//                time limit and retry) -> the model's time limit -> retry
//                under the model's retry budget -> [with a Redis: the
//                fleet's gate] -> the deployment's breaker -> adaptive
//                attempt timeout -> the deadline cut -> the model upstream
//   chat         shed switch -> quotas in tokens -> the streaming bulkhead
//                -> on the first deployment: retry -> [fleet gate] ->
//                breaker, under the stream guard's budgets and first-token
//                hedge; on a failure before the first token the second
//                deployment (then each further one) behind its own breaker;
//                after a cut, a continuation there
//   embeddings   shed switch -> quotas -> the interactive bulkhead -> retry
//                -> breaker -> the deadline cut; on failure, the model's
//                other deployments of the same upstream model
//
// Example (what gateway_core does with the resources it owns):
//
//   using plans_type = gateway::plan_builder<keel::real_clock>;
//   plans_type plans({.options = options, .clock = {}, .listener = listener, .breakers = breakers,
//                     .budget = budget, .pools = pools, .shed = shed, .fleet = fleet, .once = once,
//                     .rubrics = rubrics, .primary = &primary, .second = &second, .hedge_pool = pool});
//   std::shared_ptr<plans_type::routing> plan = plans.build(options, /*generation=*/1, /*serving=*/nullptr);
//   plans_type::model_state* model = plan->find("feedback-large");
//   absl::StatusOr<gateway::detail::answer> a = model->interactive(call, now);  // the call carries the request
//
// Thread-safety: build() from one thread at a time (the gateway's reload
// lock); stream_totals() from any thread. A built plan is read-only: its
// pipelines run on every thread at once.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "keel/compose/cut_at_deadline.hpp"
#include "keel/compose/executor.hpp"
#include "keel/compose/fallback.hpp"
#include "keel/compose/hedge.hpp"
#include "keel/compose/optional_stage.hpp"
#include "keel/compose/pipeline.hpp"
#include "keel/compose/stream.hpp"
#include "keel/compose/token_estimate.hpp"
#include "keel/core/call.hpp"
#include "keel/core/clock.hpp"
#include "keel/durable/once.hpp"
#include "keel/observe/telemetry_metrics.hpp"
#include "keel/policy/adaptive_timeout.hpp"
#include "keel/policy/admission.hpp"
#include "keel/policy/breaker_registry.hpp"
#include "keel/policy/bulkhead.hpp"
#include "keel/policy/circuit_breaker.hpp"
#include "keel/policy/retry.hpp"
#include "keel/policy/retry_budget.hpp"
#include "keel/policy/time_limit.hpp"
#include "keel/store/sqlite.hpp"
#include "chat.hpp"
#include "fleet.hpp"
#include "gateway_options.hpp"
#include "simulated_provider.hpp"
#include "stages.hpp"
#include "upstream.hpp"

namespace gateway {

// Every keel component of the gateway reports to its metrics registry.
using gateway_listener = keel::metrics_listener;

// The gateway's classes of work: their bulkhead classes, shed switches and SLOs.
enum class work_class : std::uint8_t { interactive, batch, recovery };
inline constexpr std::array<std::string_view, 3> work_class_names = {"interactive", "batch", "recovery"};
[[nodiscard]] constexpr std::size_t idx(work_class w) noexcept { return static_cast<std::size_t>(w); }

// The quota tables of options `o`: every configured tenant and model an override.
[[nodiscard]] inline keel::admission_options admission_options(const gateway_options& o) {
  keel::admission_options a{.tenant_defaults = o.tenant_defaults};
  for (const tenant_config& t : o.tenants) a.tenants.emplace_back(t.name, t.limits);
  for (const model_config& m : o.models) a.models.emplace_back(m.name, m.limits);
  return a;
}

template <keel::clock Clock>
class plan_builder {
 public:
  using env_type = keel::environment<Clock, keel::default_classifier, gateway_listener>;
  using once_type = keel::once<keel::sqlite_store<>, env_type>;
  using guard_type = keel::stream_guard;
  using chat_stream = keel::token_stream<guard_type, relay_token>;
  using hedge_type = keel::hedge<keel::bounded_pool>;

  // What every plan uses and the gateway owns (it outlives the builder).
  struct shared {
    const gateway_options& options;  // as the gateway started: what a reload does not change
    Clock clock;
    gateway_listener listener;
    keel::breaker_registry& breakers;  // one per deployment name
    keel::retry_budget& budget;        // the gateway's: models without their own
    keel::bulkhead& pools;
    const std::array<std::atomic<bool>, 3>& shed;  // by work_class
    const std::unique_ptr<fleet_sharing>& fleet;   // null without a Redis
    const once_type& once;                         // feedback decisions (keel.db)
    rubric_store<Clock>& rubrics;
    model_upstream* primary;  // the gateway's own deployments, for models without theirs
    model_upstream* second;
    keel::bounded_pool& hedge_pool;  // runs the stream guards' hedges
  };

  explicit plan_builder(shared s) : s_(std::move(s)), timer_(s_.clock) {}
  plan_builder(const plan_builder&) = delete;
  plan_builder& operator=(const plan_builder&) = delete;

  // How a chat request was served, beyond its stream_result.
  struct chat_route {
    bool failed_over = false;  // another deployment served: the first failed before its first token
    const model_upstream* served = nullptr;  // which one, when failed_over
  };

  // One model of a plan: where it is served, what it may spend, its pipelines.
  struct model_state {
    explicit model_state(model_config c, const gateway_options& o)
        : config(std::move(c)),
          budgets(config.chat.value_or(o.chat)),
          interactive_timeout(o.model_timeout),
          batch_timeout(o.batch_timeout) {}
    model_config config;
    chat_config budgets;  // its stream budgets, hedge and attempts (model_config::chat, else the gateway's)
    guard_type* guard = nullptr;  // the stream guard with those budgets (guard_for())
    // The retry budget its retries and hedges spend: its own
    // (model_config::retry_budget, budget_for()) or the gateway's.
    keel::retry_budget* budget = nullptr;
    keel::adaptive_timeout interactive_timeout;
    keel::adaptive_timeout batch_timeout;
    keel::admission_key quota_key;  // the model's quota, resolved once
    // Where the model is served: its own deployments over HTTP
    // (model_config::upstream), else the gateway's.
    // Shared with the next plan when a reload keeps the deployment as it
    // was: its connections and figures carry over.
    std::shared_ptr<http_upstream> own_primary, own_second;
    std::vector<std::shared_ptr<http_upstream>> further;  // model_config::upstream_fallbacks, in order
    model_upstream* primary = nullptr;
    model_upstream* second = nullptr;
    // The interactive path for this model: one pipeline, built with the
    // plan (interactive_pipeline()); the call carries the request.
    std::function<absl::StatusOr<detail::answer>(keel::call&, keel::time_point)> interactive;
    // Tokens to reserve per chat request: input + max_tokens, then the learned p95 of output.
    keel::token_estimate tokens{{.percentile = 0.95, .samples = 512, .min_samples = 50}};
    // The streaming path for this model (chat_pipeline()).
    std::function<absl::StatusOr<keel::stream_result>(keel::call&, keel::time_point, chat_stream&, chat_route&)>
        chat;
    // The embeddings path for this model (embeddings_pipeline()), and how
    // many deployments it may fail over to (one attempt each).
    int embed_fallbacks = 0;
    std::function<absl::StatusOr<std::string>(keel::call&, keel::time_point, const detail::json&)> embed;
    // The interactive path's attempt cap: its retries, and a hedge for each
    // when it has one.
    int interactive_attempts = 1;
    // The interactive path's hedge (model_config::interactive_hedge); null:
    // none. Last, so it goes first: its destructor waits for losing
    // attempts, which run the pipeline's stages below it.
    std::unique_ptr<hedge_type> hedge;
  };

  // A tenant's configuration and its quota key, resolved at startup for the
  // tenants the options name (others are looked up by name per request).
  struct tenant_state {
    const tenant_config* config;
    keel::admission_key key{};  // empty: not resolved ahead
  };

  // The plan a configuration reload replaces: the models with their
  // deployments and pipelines, the quotas, the tenants, the API keys. A
  // request takes the one serving when it starts (gateway_core::routing_now()) and holds
  // it to its end; the breakers, bulkheads, retry budget, stores and
  // metrics are the gateway's and outlive every plan.
  struct routing {
    routing(const gateway_options& o, std::int64_t gen)
        : models(o.models),
          tenants(o.tenants),
          api_keys(std::make_shared<const std::vector<api_key>>(o.api_keys)),
          quotas(admission_options(o)),
          default_tenant{.name = "", .region = o.region},
          generation(gen) {}
    routing(const routing&) = delete;
    routing& operator=(const routing&) = delete;

    std::vector<model_config> models;  // the first is the default model
    std::vector<tenant_config> tenants;
    std::shared_ptr<const std::vector<api_key>> api_keys;
    keel::admission quotas;
    std::map<std::string, std::unique_ptr<model_state>, std::less<>> routes;  // by model name
    tenant_config default_tenant;
    std::vector<tenant_state> tenant_states;  // `tenants`, with their quota keys
    tenant_state default_tenant_state{.config = &default_tenant};
    std::int64_t generation;

    [[nodiscard]] const std::string& default_model() const noexcept { return models.front().name; }
    [[nodiscard]] model_state* find(std::string_view model) const {
      const auto it = routes.find(model);
      return it == routes.end() ? nullptr : it->second.get();
    }
    [[nodiscard]] const tenant_state& tenant_of(std::string_view name) const {
      for (const tenant_state& t : tenant_states) {
        if (t.config->name == name) return t;
      }
      return default_tenant_state;
    }
  };

  // What every stream guard did, summed (each model has its own budgets;
  // guards of earlier plans included).
  [[nodiscard]] keel::stream_figures stream_totals() const {
    keel::stream_figures t;
    std::lock_guard lock(guards_mu_);
    for (const auto& [name, g] : guards_) t += g->figures();
    return t;
  }


  // ---- building a plan ------------------------------------------------------

  // A plan from `o`. Every configured tenant and model is an override in the
  // quota tables, never reclaimed, so resolving its key cannot be refused.
  // A model is served by its own deployments (model_config::upstream), else
  // by the gateway's; when a reload moved the gateway's default deployments
  // (options.upstream), the default models get their own from the new ones
  // (the batch reports keep the old until a restart).
  // `serving`: the plan serving now (null for the first): an unchanged
  // deployment keeps its connections and figures.
  [[nodiscard]] std::shared_ptr<routing> build(const gateway_options& o, std::int64_t generation,
                                               const routing* serving) {
    auto rt = std::make_shared<routing>(o, generation);
    const keel::time_point now = s_.clock.now();
    for (const tenant_config& t : rt->tenants)
      rt->tenant_states.push_back({&t, rt->quotas.tenant_key(t.name, now).value()});
    const bool defaults_moved =
        o.upstream && (o.upstream != s_.options.upstream || o.upstream_backup != s_.options.upstream_backup);
    for (const model_config& m : rt->models) {
      auto state = std::make_unique<model_state>(m, o);
      state->quota_key = rt->quotas.model_key(m.name, now).value();
      const bool own = m.upstream.has_value() || !defaults_moved;
      const std::optional<http_upstream_options>& first = own ? m.upstream : o.upstream;
      const std::optional<http_upstream_options>& second = own ? m.upstream_backup : o.upstream_backup;
      if (first) {
        state->own_primary = deployment_for(*first, serving);
        if (second) state->own_second = deployment_for(*second, serving);
      }
      state->primary = state->own_primary ? state->own_primary.get() : s_.primary;
      state->second = state->own_second ? state->own_second.get() : state->own_primary ? state->primary : s_.second;
      for (const http_upstream_options& u : m.upstream_fallbacks) state->further.push_back(deployment_for(u, serving));
      state->budget = budget_for(m.name, m.retry_budget);
      state->guard = &guard_for(m.name, state->budgets, state->budget);
      // Each of the model's own deployments gets its breaker from the
      // model's options before any request looks it up.
      if (m.breaker) {
        for (const http_upstream* u : {state->own_primary.get(), state->own_second.get()})
          if (u != nullptr) (void)s_.breakers.breaker_for(keel::failure_domain{.endpoint = u->name()}, *m.breaker);
        for (const std::shared_ptr<http_upstream>& u : state->further)
          (void)s_.breakers.breaker_for(keel::failure_domain{.endpoint = u->name()}, *m.breaker);
      }
      state->interactive = interactive_pipeline(*rt, *state);
      state->chat = chat_pipeline(*rt, *state);
      state->embed = embeddings_pipeline(*rt, *state);
      rt->routes.emplace(m.name, std::move(state));
    }
    return rt;
  }

 private:
  // The interactive path of model `m`, every stage in one pipeline, outer
  // to inner (docs/gateway.md says why in this order). Built once; run()
  // is const, so requests on every thread share it.
  std::function<absl::StatusOr<detail::answer>(keel::call&, keel::time_point)> interactive_pipeline(routing& rt, model_state& m) {
    const deadline_plan& plan = s_.options.interactive;
    // The hedge: after the model's hedge delay (fixed, or the learned
    // percentile of its answers), a second attempt on its second
    // deployment; the first acceptable answer wins, the other is stopped.
    // It spends the model's retry budget; the primary runs on the caller's
    // thread, the hedge on the hedge pool.
    const bool hedged = m.config.interactive_hedge && m.budgets.hedge_delay > keel::duration::zero();
    if (hedged) {
      m.hedge = std::make_unique<hedge_type>(keel::hedge_options{.delay = m.budgets.hedge_delay,
                                                                 .percentile = m.budgets.hedge_percentile,
                                                                 .min_delay = m.budgets.hedge_min_delay,
                                                                 .max_hedges = 1,
                                                                 .budget = m.budget,
                                                                 .primary_on_caller_thread = true,
                                                                 .cut = cut_timer() != nullptr},
                                             s_.hedge_pool, timer_);
    }
    m.interactive_attempts = s_.options.model_attempts * (hedged ? 2 : 1);
    // By value (a pipeline holds an lvalue by reference).
    deployment_breaker breakers{{&s_.breakers.breaker_for(keel::failure_domain{.endpoint = m.primary->name()}),
                                 &s_.breakers.breaker_for(keel::failure_domain{.endpoint = m.second->name()})}};
    std::vector<keel::gate> gates;
    gates.emplace_back("residency", [](const keel::labels& c, const keel::path& alt) {
      return c.region.empty() || c.region == alt.labels.region;
    });
    gates.emplace_back("permission", keel::from_request<interactive_request>(
                                         [](const interactive_request& r, const keel::path&) -> absl::Status {
                                           if (r.tenant.allow_degraded) return absl::OkStatus();
                                           return absl::PermissionDeniedError(
                                               "this tenant does not accept degraded answers");
                                         },
                                         absl::PermissionDeniedError("no feedback request to check")));
    gates.emplace_back("schema", keel::from_request<interactive_request>(
                                     [](const interactive_request& r, const keel::path&) -> absl::Status {
                                       if (r.progress.found_rubric) return absl::OkStatus();
                                       return absl::FailedPreconditionError(
                                           "no rubric was retrieved to check the answer against");
                                     },
                                     absl::FailedPreconditionError("no feedback request to check")));
    auto retrieval = keel::pipeline(keel::time_limit({.at_most = plan.retrieve}),
                                    keel::retry({.max_attempts = 2}, s_.options.backoff))
                         .in(env());
    auto pipe =
        keel::pipeline(
            keel::fallback({.passes_through = &heard_as_is}, std::move(gates),
                           keel::alternate("rubric-feedback", rubric_only{&s_.breakers, keel::failure_domain{.endpoint = m.primary->name()}},
                                           {.labels = {.region = s_.options.region},
                                            .at_most = plan.fallback,
                                            .provider_call = false})),
            shed_switch{&s_.shed[idx(work_class::interactive)], work_class_names[idx(work_class::interactive)]},
            rt.quotas.for_model(m.quota_key)
                .with_estimate(keel::from_request<interactive_request>(
                    [](const interactive_request& r) { return r.model.token_estimate; }, std::int64_t{0}))
                .with_tenant_key(keel::from_request<interactive_request>(
                    [](const interactive_request& r) { return r.tenant_key; },
                    static_cast<const keel::admission_key*>(nullptr))),
            record_once<once_type>{&s_.once},
            s_.pools.for_class("interactive"),
            retrieve_rubric<Clock, decltype(retrieval)>{&s_.rubrics, std::move(retrieval)},
            keel::time_limit({.at_most = plan.model}),
            keel::retry({.max_attempts = s_.options.model_attempts,
                         .budget = m.budget,
                         .min_attempt_time = m.interactive_timeout.options().lower},
                        s_.options.backoff),
            keel::optional_stage(m.hedge.get()), fleet_state(), fleet_permit(), std::move(breakers), m.interactive_timeout,
            cut())
            .in(env());
    return [pipe = std::move(pipe), deployments = std::array<model_upstream*, 2>{m.primary, m.second}](
               keel::call& call, keel::time_point now) {
      const interactive_request* rq = call.request<interactive_request>();
      if (rq == nullptr) return absl::StatusOr<detail::answer>(absl::InvalidArgumentError("no feedback request"));
      return pipe.run(call, now, model_call{deployments, rq->progress.question});
    };
  }

  // The streaming path of model `m`, outer to inner: the shed switch
  // (streams are interactive work), admission in tokens (the reservation
  // settles to what the call was charged: keel::stream_options::charge_tokens),
  // the "streaming" bulkhead class; then, on the same call, the first model
  // (retry under the service's budget, the fleet's gate, the provider's
  // breaker; the guard's budgets and first-token hedge around each attempt)
  // and, when it fails before its first token or is cut after it, the
  // second deployment behind its own breaker; when that fails before a first
  // token too, each further deployment in order, each behind its own.
  // Built once per plan; shared by every request on it.
  std::function<absl::StatusOr<keel::stream_result>(keel::call&, keel::time_point, chat_stream&, chat_route&)>
  chat_pipeline(routing& rt, model_state& m) {
    auto outer =
        keel::pipeline(
            shed_switch{&s_.shed[idx(work_class::interactive)], work_class_names[idx(work_class::interactive)]},
            rt.quotas.for_model(m.quota_key)
                .with_estimate(keel::from_request<chat_call>([](const chat_call& c) { return c.reserved; },
                                                             std::int64_t{0}))
                .with_tenant_key(keel::from_request<chat_call>(
                    [](const chat_call& c) { return c.tenant_key; }, static_cast<const keel::admission_key*>(nullptr))),
            s_.pools.for_class("streaming"))
            .in(env());
    auto first = keel::pipeline(keel::retry({.max_attempts = m.budgets.attempts, .budget = m.budget},
                                            s_.options.backoff),
                                fleet_state(), fleet_permit(), s_.breakers)
                     .in(env());
    auto behind_breaker = [this](const model_upstream& u) {
      return keel::pipeline(s_.breakers.breaker_for(keel::failure_domain{.endpoint = u.name()})).in(env());
    };
    auto second = behind_breaker(*m.second);
    std::vector<decltype(second)> further;
    for (const std::shared_ptr<http_upstream>& u : m.further) further.push_back(behind_breaker(*u));
    return [this, &m, outer = std::move(outer), first = std::move(first), second = std::move(second),
            further = std::move(further)](keel::call& call, keel::time_point now, chat_stream& stream,
                                          chat_route& route) {
      chat_model_call primary{m.primary, m.second != m.primary ? m.second : nullptr}, backup{m.second};
      return outer.run(call, now, [&](const keel::attempt& a) -> absl::StatusOr<keel::stream_result> {
        absl::StatusOr<keel::stream_result> r = first.run(call, a.start, stream.attempts(primary));
        if (!s_.options.chat.continue_on_backup || m.second == m.primary || call.stop_token().stop_requested()) return r;
        if (!r.ok()) {
          // Nothing was shown yet: the second model may answer instead. A
          // request the first refused as invalid would be refused there too.
          if (absl::IsInvalidArgument(r.status()) || absl::IsCancelled(r.status())) return r;
          absl::StatusOr<keel::stream_result> b = second.run(call, s_.clock.now(), stream.attempts(backup));
          route.served = m.second;
          for (std::size_t i = 0; !b.ok() && i < further.size() && !call.stop_token().stop_requested(); ++i) {
            chat_model_call next{m.further[i].get()};
            b = further[i].run(call, s_.clock.now(), stream.attempts(next));
            route.served = m.further[i].get();
          }
          if (!b.ok()) return r;  // the first deployment's failure is the answer's
          route.failed_over = true;
          b->degraded = true;
          call.mark_degraded();
          return b;
        }
        if (r->partial && r->continuable) {
          chat_model_call rest{m.second, nullptr, r->tokens};
          return stream.resume(call, second, rest, std::move(*r));
        }
        return r;
      });
    };
  }

  // The embeddings path of model `m`, outer to inner: the shed switch,
  // admission (the input's tokens), an interactive slot, retry under the
  // model's budget, the deployment's breaker. When the first deployment
  // fails, the model's other deployments that serve the same upstream model
  // are tried in order, each behind its own breaker: vectors from another
  // model are not comparable with the first's, so a route whose second
  // deployment is another model does not fail over. Built once per plan.
  std::function<absl::StatusOr<std::string>(keel::call&, keel::time_point, const detail::json&)>
  embeddings_pipeline(routing& rt, model_state& m) {
    auto pipe = keel::pipeline(
                    shed_switch{&s_.shed[idx(work_class::interactive)], work_class_names[idx(work_class::interactive)]},
                    rt.quotas.for_model(m.quota_key)
                        .with_estimate(keel::from_request<embeddings_call>(
                            [](const embeddings_call& c) { return c.reserved; }, std::int64_t{0}))
                        .with_tenant_key(keel::from_request<embeddings_call>(
                            [](const embeddings_call& c) { return c.tenant_key; },
                            static_cast<const keel::admission_key*>(nullptr))),
                    s_.pools.for_class("interactive"),
                    keel::retry({.max_attempts = s_.options.model_attempts, .budget = m.budget}, s_.options.backoff),
                    s_.breakers, cut())
                    .in(env());
    std::vector<model_upstream*> same_model;
    for (const std::shared_ptr<http_upstream>& u : embeddings_fallbacks(m)) same_model.push_back(u.get());
    m.embed_fallbacks = static_cast<int>(same_model.size());
    using behind_breaker = decltype(keel::pipeline(std::declval<keel::circuit_breaker&>()).in(env()));
    std::vector<behind_breaker> backups;
    for (model_upstream* u : same_model)
      backups.push_back(keel::pipeline(s_.breakers.breaker_for(keel::failure_domain{.endpoint = u->name()})).in(env()));
    return [this, &m, pipe = std::move(pipe), same_model = std::move(same_model), backups = std::move(backups)](
               keel::call& call, keel::time_point now, const detail::json& request) {
      absl::StatusOr<std::string> r =
          pipe.run(call, now, [&](const keel::attempt& a) { return m.primary->embed(a, request); });
      for (std::size_t i = 0; !r.ok() && i < backups.size(); ++i) {
        if (absl::IsInvalidArgument(r.status()) || absl::IsCancelled(r.status()) ||
            call.stop_token().stop_requested() || call.remaining(s_.clock.now()) <= keel::duration::zero())
          break;
        absl::StatusOr<std::string> b = backups[i].run(
            call, s_.clock.now(), [&](const keel::attempt& a) { return same_model[i]->embed(a, request); });
        if (b.ok()) {
          call.mark_degraded();
          return b;
        }
      }
      return r;
    };
  }

  // Model `m`'s deployments after its first that serve the same upstream
  // model as the first (where its embeddings may fail over), in order.
  [[nodiscard]] static std::vector<std::shared_ptr<http_upstream>> embeddings_fallbacks(const model_state& m) {
    std::vector<std::shared_ptr<http_upstream>> out;
    if (m.own_primary == nullptr) return out;
    auto add = [&](const std::shared_ptr<http_upstream>& u) {
      if (u != nullptr && u != m.own_primary && u->options().model == m.own_primary->options().model) out.push_back(u);
    };
    add(m.own_second);
    for (const std::shared_ptr<http_upstream>& u : m.further) add(u);
    return out;
  }

  // ---- what plans share across reloads ---------------------------------------

  // Model `model`'s stream guard for budgets `c`: the one it had when they
  // are unchanged (its learned hedge delay carries over a reload), else a
  // new one. Guards are kept for the gateway's life: requests on an old
  // plan may still use theirs, and their figures stay in the totals.
  guard_type& guard_for(const std::string& model, const chat_config& c, keel::retry_budget* budget) {
    const keel::stream_options o{.first_token = c.first_token,
                                 .stall = c.stall,
                                 .whole = c.whole,
                                 .hedge_delay = c.hedge_delay,
                                 .hedge_percentile = c.hedge_percentile,
                                 .hedge_min_delay = c.hedge_min_delay,
                                 .budget = budget};
    std::lock_guard lock(guards_mu_);
    for (const auto& [name, g] : guards_) {
      const keel::stream_options& h = g->options();
      if (name == model && h.budget == o.budget && h.first_token == o.first_token && h.stall == o.stall && h.whole == o.whole &&
          h.hedge_delay == o.hedge_delay && h.hedge_percentile == o.hedge_percentile &&
          h.hedge_min_delay == o.hedge_min_delay)
        return *g;
    }
    guards_.emplace_back(model, std::make_unique<guard_type>(o, s_.hedge_pool, timer_));
    return *guards_.back().second;
  }

  // Model `model`'s retry budget for `o`: the gateway's when unset, else
  // its own, the one it had when `o` is unchanged (what it counted carries
  // over a reload). Kept for the gateway's life, like the guards.
  keel::retry_budget* budget_for(const std::string& model, const std::optional<keel::retry_budget_options>& o) {
    if (!o) return &s_.budget;
    std::lock_guard lock(guards_mu_);
    for (const model_budget& b : model_budgets_) {
      if (b.model == model && b.options.ratio == o->ratio && b.options.min_per_second == o->min_per_second &&
          b.options.window == o->window)
        return b.budget.get();
    }
    model_budgets_.push_back({model, *o, std::make_unique<keel::retry_budget>(*o)});
    return model_budgets_.back().budget.get();
  }

  // The serving plan's upstream with these very options, else a new one.
  [[nodiscard]] static std::shared_ptr<http_upstream> deployment_for(const http_upstream_options& o,
                                                                      const routing* serving) {
    if (serving != nullptr) {
      for (const auto& [name, m] : serving->routes) {
        for (const std::shared_ptr<http_upstream>& u : {m->own_primary, m->own_second})
          if (u != nullptr && u->options() == o) return u;
        for (const std::shared_ptr<http_upstream>& u : m->further)
          if (u->options() == o) return u;
      }
    }
    return std::make_shared<http_upstream>(o);
  }


  // The one environment every component runs in: the gateway's clock and
  // its metrics listener.
  [[nodiscard]] env_type env() const { return env_type{s_.clock, {}, s_.listener}; }
  // The deadline cut, unless the options switch it off.
  [[nodiscard]] keel::deadline_timer_base* cut_timer() {
    return s_.options.cut_at_deadline ? &timer_ : nullptr;
  }
  [[nodiscard]] keel::optional_stage<const keel::cut_at_deadline> cut() const {
    return keel::optional_stage<const keel::cut_at_deadline>(s_.options.cut_at_deadline ? &cut_ : nullptr);
  }
  // The fleet's provider state, then a permit (keel/fleet/shared_*.hpp):
  // with no fleet, both pass every attempt straight on.
  [[nodiscard]] keel::optional_stage<keel::shared_provider_state> fleet_state() const {
    return keel::optional_stage(s_.fleet ? &s_.fleet->state() : nullptr);
  }
  [[nodiscard]] keel::optional_stage<keel::shared_concurrency> fleet_permit() const {
    return keel::optional_stage(s_.fleet ? &s_.fleet->concurrency() : nullptr);
  }

  shared s_;
  // The gateway's timer (one thread): starts the interactive hedges and the
  // streams' first-token hedges, stops streams at their budgets, and cuts
  // each interactive and embeddings attempt at its deadline.
  keel::deadline_timer<Clock> timer_;
  const keel::cut_at_deadline cut_{timer_};
  // Every stream guard made (guard_for()): per model and budgets, kept for life.
  mutable std::mutex guards_mu_;
  std::vector<std::pair<std::string, std::unique_ptr<guard_type>>> guards_;
  // Every model's own retry budget (budget_for()), kept for life; under guards_mu_.
  struct model_budget {
    std::string model;
    keel::retry_budget_options options;
    std::unique_ptr<keel::retry_budget> budget;
  };
  std::vector<model_budget> model_budgets_;
};

}  // namespace gateway
