// keel/observe/slo.hpp — service-level indicators per work class, kept separately,
// and the error budget each objective leaves.
//
// Every finished request of a work class (interactive, batch, recovery...,
// any name) is recorded with its outcome and latency:
//
//   success    a full answer
//   partial    a degraded or incomplete answer (a fallback, a partial panel)
//   failure    an error the service is responsible for
//   rejected   refused by admission or shedding before work started
//   abandoned  the caller gave up or cancelled first
//
// Each is counted on its own, so a blended score cannot hide a defect: a
// class that sheds half its load still shows the rejections, a fallback that
// answers everything still shows the partial answers. Two objectives are
// tracked per class, each with an error budget:
//
//   availability  good / eligible over the window, target `target`.
//                 success is good, failure is bad; whether rejected, partial
//                 and abandoned requests are good, bad or not eligible is
//                 configured per class and has no default: leaving one unset
//                 is refused at construction.
//   latency       (when latency_threshold > 0) of the answered requests
//                 (success and partial), those within latency_threshold,
//                 target `latency_target`.
//
// Error budget: with E eligible requests in the window and target T, the
// window allows floor(E * (1 - T)) bad ones (T is taken to nine decimal
// places); 100,000 eligible requests at 99.9 % allow 100. remaining is that
// minus the bad ones, negative once overspent.
//
// The window rolls in steps: it is split in window_buckets buckets and
// covers the current one and the window_buckets - 1 before it, so a request
// stays counted for between window - window/window_buckets and window.
// Alongside, each class keeps counts since it started (for Prometheus
// counters) and a latency_histogram of answered requests (percentiles, see
// keel/observe/latency_histogram.hpp).
//
// Example:
//
//   keel::slo_tracker slos({
//       {"interactive", {.target = 0.999, .window = std::chrono::hours(1), .window_buckets = 60,
//                        .rejected = keel::counts_as::bad, .partial = keel::counts_as::good,
//                        .abandoned = keel::counts_as::not_eligible,
//                        .latency_threshold = std::chrono::seconds(3), .latency_target = 0.99}},
//       {"batch", {.target = 0.99, .rejected = keel::counts_as::not_eligible,
//                  .partial = keel::counts_as::bad, .abandoned = keel::counts_as::not_eligible}}});
//   keel::work_class_slo& interactive = *slos.find("interactive");   // once
//   interactive.record(keel::request_outcome::success, took, now);    // per request
//   keel::slo_report r = interactive.report(now);
//   std::int64_t left = r.availability.remaining;                      // failures left in the window
//
// Thread-safety: record() and report() may be called from any thread. The
// latency histogram is lock-free; the window's counters sit under one
// std::mutex per class (held for a few additions). slo_tracker's set of
// classes is fixed at construction, so finding a class takes no lock.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "keel/core/clock.hpp"
#include "keel/core/status.hpp"
#include "keel/observe/latency_histogram.hpp"
#include "keel/observe/metrics.hpp"

namespace keel {

enum class request_outcome { success, partial, failure, rejected, abandoned };

[[nodiscard]] constexpr std::string_view to_string(request_outcome o) noexcept {
  switch (o) {
    case request_outcome::success: return "success";
    case request_outcome::partial: return "partial";
    case request_outcome::failure: return "failure";
    case request_outcome::rejected: return "rejected";
    case request_outcome::abandoned: return "abandoned";
  }
  return "unknown";
}

// How an outcome counts toward the availability objective.
enum class counts_as { unset, good, bad, not_eligible };

[[nodiscard]] constexpr std::string_view to_string(counts_as c) noexcept {
  switch (c) {
    case counts_as::unset: return "unset";
    case counts_as::good: return "good";
    case counts_as::bad: return "bad";
    case counts_as::not_eligible: return "not_eligible";
  }
  return "unknown";
}

struct slo_options {
  double target = 0.999;                          // availability objective, in (0, 1)
  duration window = std::chrono::hours(24 * 28);  // > 0
  int window_buckets = 672;                       // in [1, 100000]; window / window_buckets > 0
  // How each outcome counts; must be set (there is no default on purpose).
  counts_as rejected = counts_as::unset;
  counts_as partial = counts_as::unset;
  counts_as abandoned = counts_as::unset;
  // Latency objective: answered requests within the threshold. Zero: none.
  duration latency_threshold = duration::zero();  // >= 0
  double latency_target = 0.99;                   // in (0, 1) when a threshold is set
  latency_histogram_options latency{};            // the distribution kept for percentiles

  [[nodiscard]] absl::Status validate() const {
    constexpr std::string_view who = "slo_options";
    if (!(target > 0.0 && target < 1.0)) return detail::invalid_field(who, "target", "be in (0, 1)", target);
    if (window <= duration::zero()) return detail::invalid_field(who, "window", "be > 0", window);
    if (window_buckets < 1 || window_buckets > 100000)
      return detail::invalid_field(who, "window_buckets", "be in [1, 100000]", window_buckets);
    if (window / window_buckets <= duration::zero())
      return detail::invalid_field(who, "window_buckets", "leave buckets longer than zero", window_buckets);
    const std::pair<std::string_view, counts_as> rules[] = {
        {"rejected", rejected}, {"partial", partial}, {"abandoned", abandoned}};
    for (const auto& [field, rule] : rules) {
      if (rule != counts_as::good && rule != counts_as::bad && rule != counts_as::not_eligible)
        return detail::invalid_field(who, field, "be set to good, bad or not_eligible",
                                     detail::to_absl(to_string(rule)));
    }
    if (latency_threshold < duration::zero())
      return detail::invalid_field(who, "latency_threshold", "be >= 0", latency_threshold);
    if (latency_threshold > duration::zero() && !(latency_target > 0.0 && latency_target < 1.0))
      return detail::invalid_field(who, "latency_target", "be in (0, 1)", latency_target);
    return latency.validate();
  }
};

// An objective's budget over the window.
struct error_budget {
  double target = 0;
  std::int64_t eligible = 0;
  std::int64_t good = 0;
  std::int64_t bad = 0;
  std::int64_t allowed = 0;    // floor(eligible * (1 - target)): bad requests the window allows
  std::int64_t remaining = 0;  // allowed - bad; negative once overspent

  // The budget for `good` and `bad` eligible requests at `target`.
  [[nodiscard]] static error_budget compute(double target, std::int64_t good, std::int64_t bad) noexcept {
    error_budget b{.target = target, .eligible = good + bad, .good = good, .bad = bad};
    // Integer arithmetic on parts per billion: 100,000 at 0.999 allow exactly
    // 100, where doubles would give 99.99999999999991 or 100.00000000000009.
    constexpr std::int64_t kBillion = 1'000'000'000;
    const std::int64_t spare = kBillion - std::llround(target * static_cast<double>(kBillion));
    b.allowed = (b.eligible / kBillion) * spare + ((b.eligible % kBillion) * spare) / kBillion;
    b.remaining = b.allowed - bad;
    return b;
  }

  // good / eligible; 1 when nothing was eligible.
  [[nodiscard]] double sli() const noexcept {
    return eligible == 0 ? 1.0 : static_cast<double>(good) / static_cast<double>(eligible);
  }
  // Share of the budget left: 1 untouched, 0 spent, negative overspent.
  [[nodiscard]] double remaining_ratio() const noexcept {
    const double budget = static_cast<double>(eligible) * (1.0 - target);
    return budget <= 0.0 ? (bad == 0 ? 1.0 : -std::numeric_limits<double>::infinity())
                         : 1.0 - static_cast<double>(bad) / budget;
  }
  // Spent: as many bad requests as the window allows, or more.
  [[nodiscard]] bool exhausted() const noexcept { return bad > 0 && remaining <= 0; }
};

// Requests by outcome, and how many answered within the latency threshold.
struct outcome_counts {
  std::int64_t success = 0;
  std::int64_t partial = 0;
  std::int64_t failure = 0;
  std::int64_t rejected = 0;
  std::int64_t abandoned = 0;
  std::int64_t fast = 0;  // success or partial within latency_threshold

  [[nodiscard]] std::int64_t requests() const noexcept { return success + partial + failure + rejected + abandoned; }
  [[nodiscard]] std::int64_t answered() const noexcept { return success + partial; }
  [[nodiscard]] std::int64_t of(request_outcome o) const noexcept {
    switch (o) {
      case request_outcome::success: return success;
      case request_outcome::partial: return partial;
      case request_outcome::failure: return failure;
      case request_outcome::rejected: return rejected;
      case request_outcome::abandoned: return abandoned;
    }
    return 0;
  }
};

// One class's indicators at one moment.
struct slo_report {
  std::string work_class{};
  duration window{};
  outcome_counts in_window{};
  outcome_counts since_start{};
  error_budget availability{};
  std::optional<error_budget> latency{};  // when a latency objective is set
  latency_histogram_snapshot latency_distribution{};  // answered requests, since start

  // rejected / requests in the window; 0 with no requests.
  [[nodiscard]] double rejection_ratio() const noexcept {
    const auto n = in_window.requests();
    return n == 0 ? 0.0 : static_cast<double>(in_window.rejected) / static_cast<double>(n);
  }
  // partial / answered in the window; 0 with no answers.
  [[nodiscard]] double partial_ratio() const noexcept {
    const auto n = in_window.answered();
    return n == 0 ? 0.0 : static_cast<double>(in_window.partial) / static_cast<double>(n);
  }
};

class work_class_slo {
 public:
  // Throws keel::invalid_options if `o` is invalid.
  work_class_slo(std::string name, const slo_options& o)
      : name_(std::move(name)),
        options_((detail::require_valid(o.validate()), o)),
        width_(o.window / o.window_buckets),
        ring_(static_cast<std::size_t>(o.window_buckets)),
        latency_(o.latency) {}
  work_class_slo(const work_class_slo&) = delete;
  work_class_slo& operator=(const work_class_slo&) = delete;

  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  [[nodiscard]] const slo_options& options() const noexcept { return options_; }

  // Records one finished request. No allocation.
  void record(request_outcome outcome, duration latency, time_point now) noexcept {
    const bool answered = outcome == request_outcome::success || outcome == request_outcome::partial;
    if (answered) latency_.record(latency);
    const bool fast = answered && options_.latency_threshold > duration::zero() &&
                      latency <= options_.latency_threshold;
    const std::int64_t e = epoch(now);
    std::lock_guard lock(mu_);
    slot& s = ring_[index(e)];
    // An older bucket is stale: restart it. A newer one (the clock went
    // backwards) keeps counting rather than losing the request.
    if (s.epoch < e) {
      s.epoch = e;
      s.counts = {};
    }
    add(s.counts, outcome, fast);
    add(total_, outcome, fast);
  }

  // The indicators at `now`. Allocates (the latency snapshot).
  [[nodiscard]] slo_report report(time_point now) const {
    slo_report r;
    r.work_class = name_;
    r.window = options_.window;
    r.latency_distribution = latency_.snapshot();
    const std::int64_t e = epoch(now);
    {
      std::lock_guard lock(mu_);
      for (const slot& s : ring_) {
        if (s.epoch > e - options_.window_buckets) {
          r.in_window.success += s.counts.success;
          r.in_window.partial += s.counts.partial;
          r.in_window.failure += s.counts.failure;
          r.in_window.rejected += s.counts.rejected;
          r.in_window.abandoned += s.counts.abandoned;
          r.in_window.fast += s.counts.fast;
        }
      }
      r.since_start = total_;
    }
    std::int64_t good = r.in_window.success, bad = r.in_window.failure;
    auto apply = [&](counts_as rule, std::int64_t n) {
      if (rule == counts_as::good) good += n;
      if (rule == counts_as::bad) bad += n;
    };
    apply(options_.rejected, r.in_window.rejected);
    apply(options_.partial, r.in_window.partial);
    apply(options_.abandoned, r.in_window.abandoned);
    r.availability = error_budget::compute(options_.target, good, bad);
    if (options_.latency_threshold > duration::zero()) {
      r.latency = error_budget::compute(options_.latency_target, r.in_window.fast,
                                        r.in_window.answered() - r.in_window.fast);
    }
    return r;
  }

  [[nodiscard]] const latency_histogram& latency() const noexcept { return latency_; }

 private:
  struct slot {
    std::int64_t epoch = std::numeric_limits<std::int64_t>::min();
    outcome_counts counts{};
  };

  static void add(outcome_counts& c, request_outcome o, bool fast) noexcept {
    switch (o) {
      case request_outcome::success: ++c.success; break;
      case request_outcome::partial: ++c.partial; break;
      case request_outcome::failure: ++c.failure; break;
      case request_outcome::rejected: ++c.rejected; break;
      case request_outcome::abandoned: ++c.abandoned; break;
    }
    if (fast) ++c.fast;
  }

  [[nodiscard]] std::int64_t epoch(time_point now) const noexcept {
    const duration t = now.time_since_epoch();
    std::int64_t e = t / width_;
    if (t < duration::zero() && t % width_ != duration::zero()) --e;  // floor, not truncation
    return e;
  }
  [[nodiscard]] std::size_t index(std::int64_t e) const noexcept {
    const auto n = static_cast<std::int64_t>(ring_.size());
    return static_cast<std::size_t>(((e % n) + n) % n);
  }

  std::string name_;
  slo_options options_;
  duration width_;
  mutable std::mutex mu_;
  std::vector<slot> ring_;  // guarded by mu_
  outcome_counts total_{};  // guarded by mu_
  latency_histogram latency_;
};

// A work class and its objectives, for slo_tracker.
struct slo_class {
  std::string name{};
  slo_options options{};
};

// The SLOs of every work class of a service. The set of classes is fixed at
// construction.
class slo_tracker {
 public:
  // Throws keel::invalid_options for an empty or repeated class name or
  // invalid options (the message names the class).
  explicit slo_tracker(std::vector<slo_class> classes) {
    for (slo_class& c : classes) {
      if (c.name.empty()) detail::require_valid(detail::invalid_field("slo_class", "name", "not be empty", "\"\""));
      if (absl::Status s = c.options.validate(); !s.ok()) {
        detail::require_valid(annotate(s, absl::StrCat("work class \"", c.name, "\"")));
      }
      if (classes_.contains(c.name)) {
        detail::require_valid(detail::invalid_field("slo_class", "name", "be unique", detail::quote_text(c.name)));
      }
      auto slo = std::make_unique<work_class_slo>(c.name, c.options);
      classes_.emplace(std::move(c.name), std::move(slo));
    }
  }
  slo_tracker(const slo_tracker&) = delete;
  slo_tracker& operator=(const slo_tracker&) = delete;

  // The class's tracker, or null. Lock-free (the map never changes).
  [[nodiscard]] work_class_slo* find(std::string_view work_class) const noexcept {
    const auto it = classes_.find(work_class);
    return it == classes_.end() ? nullptr : it->second.get();
  }

  // Records a request of a class; NotFound for a class that was not defined.
  [[nodiscard]] absl::Status record(std::string_view work_class, request_outcome outcome, duration latency,
                                    time_point now) {
    work_class_slo* c = find(work_class);
    if (c == nullptr) {
      return absl::NotFoundError(
          absl::StrCat("keel: no SLO is defined for work class \"", detail::to_absl(work_class), "\""));
    }
    c->record(outcome, latency, now);
    return absl::OkStatus();
  }

  // Every class's report, sorted by class name.
  [[nodiscard]] std::vector<slo_report> report(time_point now) const {
    std::vector<slo_report> out;
    out.reserve(classes_.size());
    for (const auto& [name, c] : classes_) out.push_back(c->report(now));
    return out;
  }

  // Adds the SLO families to a metrics snapshot (all labelled by class):
  //   keel_slo_requests_total{class,outcome}              counter, since start
  //   keel_slo_window_requests{class,outcome}             gauge, in the window
  //   keel_slo_objective{class,sli}                       gauge: the target
  //   keel_slo_ratio{class,sli}                           gauge: good / eligible in the window
  //   keel_slo_error_budget_allowed{class,sli}            gauge: bad requests the window allows
  //   keel_slo_error_budget_remaining{class,sli}          gauge: of which are left (negative: overspent)
  //   keel_slo_error_budget_remaining_ratio{class,sli}    gauge
  //   keel_slo_latency_seconds{class,quantile}            summary of answered requests, since start
  // sli is "availability" or "latency". Use as a registry collector:
  //   registry.add_collector([&](keel::metrics_snapshot& s) { slos.collect(s, clock.now()); });
  void collect(metrics_snapshot& out, time_point now,
               std::span<const double> quantiles = default_quantiles) const {
    metric_family_snapshot total{.name = "keel_slo_requests_total",
                                 .help = "Requests finished, by work class and outcome, since start.",
                                 .type = metric_type::counter,
                                 .label_names = {"class", "outcome"}};
    metric_family_snapshot window{.name = "keel_slo_window_requests",
                                  .help = "Requests finished in the SLO window, by work class and outcome.",
                                  .type = metric_type::gauge,
                                  .label_names = {"class", "outcome"}};
    auto per_sli = [](std::string name, std::string help) {
      return metric_family_snapshot{
          .name = std::move(name), .help = std::move(help), .type = metric_type::gauge, .label_names = {"class", "sli"}};
    };
    metric_family_snapshot objective = per_sli("keel_slo_objective", "The SLO target.");
    metric_family_snapshot ratio = per_sli("keel_slo_ratio", "Good over eligible requests in the SLO window.");
    metric_family_snapshot allowed =
        per_sli("keel_slo_error_budget_allowed", "Bad requests the SLO window allows (its error budget).");
    metric_family_snapshot remaining = per_sli(
        "keel_slo_error_budget_remaining", "Bad requests the error budget has left; negative once overspent.");
    metric_family_snapshot remaining_ratio =
        per_sli("keel_slo_error_budget_remaining_ratio", "Share of the error budget left: 1 untouched, 0 spent.");
    metric_family_snapshot latency{.name = "keel_slo_latency_seconds",
                                   .help = "Latency of answered requests (success and partial) since start.",
                                   .type = metric_type::summary,
                                   .label_names = {"class"}};

    constexpr request_outcome outcomes[] = {request_outcome::success, request_outcome::partial,
                                            request_outcome::failure, request_outcome::rejected,
                                            request_outcome::abandoned};
    for (const slo_report& r : report(now)) {
      for (request_outcome o : outcomes) {
        const std::string outcome(to_string(o));
        total.series.push_back({.labels = {r.work_class, outcome}, .value = static_cast<double>(r.since_start.of(o))});
        window.series.push_back({.labels = {r.work_class, outcome}, .value = static_cast<double>(r.in_window.of(o))});
      }
      auto add = [&](std::string_view sli, const error_budget& b) {
        const std::vector<std::string> labels{r.work_class, std::string(sli)};
        objective.series.push_back({.labels = labels, .value = b.target});
        ratio.series.push_back({.labels = labels, .value = b.sli()});
        allowed.series.push_back({.labels = labels, .value = static_cast<double>(b.allowed)});
        remaining.series.push_back({.labels = labels, .value = static_cast<double>(b.remaining)});
        remaining_ratio.series.push_back({.labels = labels, .value = b.remaining_ratio()});
      };
      add("availability", r.availability);
      if (r.latency) add("latency", *r.latency);
      metric_series& l = latency.series.emplace_back();
      l.labels = {r.work_class};
      for (double q : quantiles) {
        l.quantiles.push_back({.quantile = q,
                               .value = std::chrono::duration<double>(r.latency_distribution.percentile(q)).count()});
      }
      l.sum = std::chrono::duration<double>(r.latency_distribution.sum()).count();
      l.count = r.latency_distribution.count();
    }
    for (auto* f : {&total, &window, &objective, &ratio, &allowed, &remaining, &remaining_ratio, &latency}) {
      out.families.push_back(std::move(*f));
    }
  }

  static constexpr std::array<double, 4> default_quantiles = {0.5, 0.9, 0.99, 0.999};

 private:
  std::map<std::string, std::unique_ptr<work_class_slo>, std::less<>> classes_;
};

}  // namespace keel
