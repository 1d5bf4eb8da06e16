// keel/observe/metrics.hpp — counters, gauges and histograms with labels, and a
// snapshot of them as plain data (rendered for Prometheus by
// keel/observe/prometheus.hpp).
//
// A metrics_registry holds metric families: a name, a help text, label
// names and (for histograms) bucket bounds. A family hands out one series
// per set of label values; get the series once and keep the reference:
// incrementing it is one relaxed atomic add, with no lookup, lock or
// allocation. Looking a series up by label values takes the family's mutex
// and allocates only the first time those values are seen.
//
// snapshot() copies every family into a metrics_snapshot, sorted by family
// name and then by label values, and appends what the registered collectors
// add (gauges computed on demand: an SLO's error budget, a bulkhead's
// occupancy). A snapshot is plain data that may also be built or extended by
// hand; its validate() checks it against Prometheus' data model.
//
// Names follow Prometheus' data model: metric names match
// [a-zA-Z_:][a-zA-Z0-9_:]*, label names [a-zA-Z_][a-zA-Z0-9_]* and must not
// start with "__"; histograms may not use the label "le" nor summaries
// "quantile" (the format adds them). Label values may be any bytes: those
// that are not valid UTF-8 are replaced by U+FFFD, as the exposition writes
// them, so values differing only there share one series (a scrape never
// holds one series twice). Help text is required. Registering the
// same name twice returns the same family when type, labels and buckets
// agree, and is refused otherwise.
//
// Example:
//
//   keel::metrics_registry registry;
//   auto& requests = registry.counter({.name = "app_requests_total",
//                                      .help = "Requests served.",
//                                      .labels = {"class", "outcome"}});
//   keel::counter_metric& ok = requests.with({"interactive", "success"});   // once
//   ok.inc();                                                               // per request
//   auto& latency = registry.histogram({.name = "app_latency_seconds", .help = "Latency."});
//   latency.with({}).observe(std::chrono::milliseconds(120));
//   keel::metrics_snapshot snap = registry.snapshot();
//
// Thread-safety: every operation may be called from any thread. Series
// updates are relaxed atomics; a snapshot reads each series at some moment
// (a histogram's count is the sum of its buckets, its sum is read
// separately). Collectors run on the thread that takes the snapshot, one
// snapshot at a time.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "keel/core/clock.hpp"
#include "keel/core/status.hpp"

namespace keel {

enum class metric_type { counter, gauge, histogram, summary };

[[nodiscard]] constexpr std::string_view to_string(metric_type t) noexcept {
  switch (t) {
    case metric_type::counter: return "counter";
    case metric_type::gauge: return "gauge";
    case metric_type::histogram: return "histogram";
    case metric_type::summary: return "summary";
  }
  return "untyped";
}

// Upper bounds, in seconds, for latency histograms when none are given.
inline constexpr std::array<double, 13> default_latency_buckets = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                                                    0.25,  0.5,    1.0,   2.5,  5.0,   10.0};

namespace detail {

[[nodiscard]] constexpr bool is_name_start(char c) noexcept {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}
[[nodiscard]] constexpr bool is_name_char(char c) noexcept { return is_name_start(c) || (c >= '0' && c <= '9'); }

// [a-zA-Z_:][a-zA-Z0-9_:]*
[[nodiscard]] constexpr bool valid_metric_name(std::string_view n) noexcept {
  if (n.empty() || !(is_name_start(n[0]) || n[0] == ':')) return false;
  return std::all_of(n.begin(), n.end(), [](char c) { return is_name_char(c) || c == ':'; });
}
// [a-zA-Z_][a-zA-Z0-9_]*, not starting with "__" (reserved for Prometheus).
[[nodiscard]] constexpr bool valid_label_name(std::string_view n) noexcept {
  if (n.empty() || !is_name_start(n[0]) || n.starts_with("__")) return false;
  return std::all_of(n.begin(), n.end(), is_name_char);
}

// The label a type's exposition adds itself, which its families may not use.
[[nodiscard]] constexpr std::string_view reserved_label(metric_type t) noexcept {
  return t == metric_type::histogram ? "le" : t == metric_type::summary ? "quantile" : "";
}

[[nodiscard]] inline std::string quote_text(std::string_view s) { return absl::StrCat("\"", to_absl(s), "\""); }

// Length of the valid UTF-8 sequence starting s[i], or 0 if it is not one
// (overlong forms, surrogates and code points past U+10FFFF included).
[[nodiscard]] inline std::size_t utf8_sequence(std::string_view s, std::size_t i) noexcept {
  const auto b = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  if (c < 0x80) return 1;
  std::size_t n = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  if (i + n > s.size() || b(i + 1) < lo || b(i + 1) > hi) return 0;
  for (std::size_t k = 2; k < n; ++k) {
    if (b(i + k) < 0x80 || b(i + k) > 0xBF) return 0;
  }
  return n;
}

// Whether s is valid UTF-8 (label values and help text must be).
[[nodiscard]] inline bool valid_utf8(std::string_view s) noexcept {
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t n = utf8_sequence(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

// Appends the UTF-8 sequence at s[i], or U+FFFD for a byte that does not
// start one; returns the bytes it consumed. The one place the exposition's
// rule for invalid UTF-8 lives (the writer and replace_invalid_utf8 share it).
inline std::size_t append_utf8_at(std::string& out, std::string_view s, std::size_t i) {
  const std::size_t n = utf8_sequence(s, i);
  if (n == 0) {
    out += "\xEF\xBF\xBD";
    return 1;
  }
  out.append(s.substr(i, n));
  return n;
}

// s with every byte that is not part of valid UTF-8 replaced by U+FFFD: how
// the exposition writes it (Prometheus refuses a scrape with invalid UTF-8).
[[nodiscard]] inline std::string replace_invalid_utf8(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) i += append_utf8_at(out, s, i);
  return out;
}

// Label values as written: unchanged when they are all valid UTF-8 (the
// common case: the returned vector is empty and nothing is allocated),
// otherwise every value with invalid bytes replaced.
template <class Values>
[[nodiscard]] std::vector<std::string> written_labels(const Values& values) {
  bool valid = true;
  for (std::string_view v : values) valid = valid && valid_utf8(v);
  if (valid) return {};
  std::vector<std::string> out;
  out.reserve(values.size());
  for (std::string_view v : values) out.push_back(replace_invalid_utf8(v));
  return out;
}


}  // namespace detail

// A family's definition.
struct metric_options {
  std::string name{};
  std::string help{};                 // required: rendered as # HELP
  std::vector<std::string> labels{};  // label names, in the order with() takes values
  // Histograms only: finite upper bounds, strictly increasing (the +Inf
  // bucket is implicit). Empty: default_latency_buckets.
  std::vector<double> buckets{};

  [[nodiscard]] absl::Status validate() const { return validate_as(metric_type::counter); }

  // The rules for a family of type t.
  [[nodiscard]] absl::Status validate_as(metric_type t) const {
    constexpr std::string_view who = "metric_options";
    if (!detail::valid_metric_name(name))
      return detail::invalid_field(who, "name", "match [a-zA-Z_:][a-zA-Z0-9_:]*", detail::quote_text(name));
    if (help.empty()) return detail::invalid_field(who, "help", "not be empty", detail::quote_text(name));
    for (std::size_t i = 0; i < labels.size(); ++i) {
      if (!detail::valid_label_name(labels[i]))
        return detail::invalid_field(who, "labels", "match [a-zA-Z_][a-zA-Z0-9_]* and not start with __",
                                     detail::quote_text(labels[i]));
      if (labels[i] == detail::reserved_label(t))
        return detail::invalid_field(who, "labels", absl::StrCat("not contain \"", detail::to_absl(detail::reserved_label(t)),
                                                                 "\" in a ", detail::to_absl(to_string(t))),
                                     detail::quote_text(labels[i]));
      if (std::find(labels.begin(), labels.begin() + static_cast<std::ptrdiff_t>(i), labels[i]) !=
          labels.begin() + static_cast<std::ptrdiff_t>(i))
        return detail::invalid_field(who, "labels", "be unique", detail::quote_text(labels[i]));
    }
    if (t != metric_type::histogram && !buckets.empty())
      return detail::invalid_field(who, "buckets", absl::StrCat("be empty for a ", detail::to_absl(to_string(t))), buckets.size());
    for (std::size_t i = 0; i < buckets.size(); ++i) {
      if (!std::isfinite(buckets[i])) return detail::invalid_field(who, "buckets", "be finite", buckets[i]);
      if (i > 0 && !(buckets[i] > buckets[i - 1]))
        return detail::invalid_field(who, "buckets", "be strictly increasing",
                                     absl::StrCat(buckets[i - 1], " then ", buckets[i]));
    }
    return absl::OkStatus();
  }
};

// --- the snapshot: plain data ------------------------------------------------

struct quantile_value {
  double quantile = 0;  // in [0, 1]
  double value = 0;
};

// One series of a family at one moment.
struct metric_series {
  std::vector<std::string> labels{};        // values, in the family's label_names order
  double value = 0;                         // counter, gauge
  std::vector<std::uint64_t> buckets{};     // histogram: count in each bucket (not cumulative); last: above every bound
  std::vector<quantile_value> quantiles{};  // summary
  double sum = 0;                         // histogram, summary
  std::uint64_t count = 0;                // histogram, summary
};

struct metric_family_snapshot {
  std::string name{};
  std::string help{};
  metric_type type = metric_type::counter;
  std::vector<std::string> label_names{};
  std::vector<double> bounds{};  // histogram: the buckets' upper bounds
  std::vector<metric_series> series{};
};

struct metrics_snapshot {
  std::vector<metric_family_snapshot> families{};

  // Checks names, label arity and uniqueness (as written: invalid UTF-8
  // replaced), histogram shapes, summary quantiles (in [0, 1], none twice)
  // and that no two families would render the same metric name (x_count
  // beside a histogram x, say).
  [[nodiscard]] absl::Status validate() const {
    std::map<std::string, std::string_view> emitted;  // rendered name -> its family
    for (const metric_family_snapshot& f : families) {
      metric_options o{.name = f.name, .help = f.help, .labels = f.label_names, .buckets = f.bounds};
      if (absl::Status s = o.validate_as(f.type); !s.ok()) return annotate(s, absl::StrCat("family ", f.name));
      std::vector<std::string> names{f.name};
      if (f.type == metric_type::histogram) names.push_back(f.name + "_bucket");
      if (f.type == metric_type::histogram || f.type == metric_type::summary) {
        names.push_back(f.name + "_sum");
        names.push_back(f.name + "_count");
      }
      for (std::string& n : names) {
        auto [it, fresh] = emitted.emplace(std::move(n), f.name);
        if (!fresh) {
          return absl::InvalidArgumentError(absl::StrCat("keel: metric families ", detail::to_absl(it->second),
                                                         " and ", f.name, " both render ", it->first));
        }
      }
      // Series are compared as written (invalid UTF-8 replaced): two that
      // differ only in bytes the writer replaces would be one series twice.
      std::vector<const std::vector<std::string>*> seen;
      std::vector<std::vector<std::string>> replaced;
      replaced.reserve(f.series.size());  // seen points into it
      for (const metric_series& s : f.series) {
        if (s.labels.size() != f.label_names.size()) {
          return absl::InvalidArgumentError(absl::StrCat("keel: a series of ", f.name, " has ", s.labels.size(),
                                                         " label values for ", f.label_names.size(), " labels"));
        }
        if (f.type == metric_type::histogram && s.buckets.size() != f.bounds.size() + 1) {
          return absl::InvalidArgumentError(absl::StrCat("keel: a series of ", f.name, " has ", s.buckets.size(),
                                                         " buckets for ", f.bounds.size(), " bounds (want bounds + 1)"));
        }
        for (std::size_t i = 0; i < s.quantiles.size(); ++i) {
          const quantile_value& q = s.quantiles[i];
          if (!(q.quantile >= 0.0 && q.quantile <= 1.0)) {
            return absl::InvalidArgumentError(
                absl::StrCat("keel: a series of ", f.name, " has quantile ", q.quantile, ", outside [0, 1]"));
          }
          for (std::size_t j = 0; j < i; ++j) {
            if (s.quantiles[j].quantile == q.quantile)  // one sample written twice
              return absl::InvalidArgumentError(
                  absl::StrCat("keel: a series of ", f.name, " has quantile ", q.quantile, " twice"));
          }
        }
        if (std::vector<std::string> w = detail::written_labels(s.labels); !w.empty()) {
          replaced.push_back(std::move(w));
          seen.push_back(&replaced.back());
        } else {
          seen.push_back(&s.labels);
        }
      }
      std::sort(seen.begin(), seen.end(), [](auto* a, auto* b) { return *a < *b; });
      for (std::size_t i = 1; i < seen.size(); ++i) {
        if (*seen[i] == *seen[i - 1]) {
          return absl::InvalidArgumentError(absl::StrCat("keel: two series of ", f.name, " have the labels {",
                                                         absl::StrJoin(*seen[i], ","), "}",
                                                         replaced.empty()
                                                             ? ""
                                                             : " (as written: bytes that are not UTF-8 become U+FFFD)"));
        }
      }
    }
    return absl::OkStatus();
  }
};

// --- series ------------------------------------------------------------------

// A monotonically increasing count.
class alignas(64) counter_metric {
 public:
  void inc(std::uint64_t n = 1) noexcept { value_.fetch_add(n, std::memory_order_relaxed); }
  [[nodiscard]] std::uint64_t value() const noexcept { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<std::uint64_t> value_{0};
};

// A value that goes up and down.
class alignas(64) gauge_metric {
 public:
  void set(double v) noexcept { value_.store(v, std::memory_order_relaxed); }
  void add(double v) noexcept { value_.fetch_add(v, std::memory_order_relaxed); }
  void sub(double v) noexcept { value_.fetch_sub(v, std::memory_order_relaxed); }
  void inc() noexcept { add(1.0); }
  void dec() noexcept { sub(1.0); }
  [[nodiscard]] double value() const noexcept { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// Observations counted in fixed buckets (upper bounds, inclusive).
class histogram_metric {
 public:
  explicit histogram_metric(std::span<const double> bounds)
      : bounds_(bounds), counts_(std::make_unique<std::atomic<std::uint64_t>[]>(bounds.size() + 1)) {}

  // Counts v in the first bucket whose bound is >= v. NaN is ignored.
  void observe(double v) noexcept {
    if (std::isnan(v)) return;
    const auto i = static_cast<std::size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin());
    counts_[i].fetch_add(1, std::memory_order_relaxed);
    sum_.fetch_add(v, std::memory_order_relaxed);
  }
  // A duration, observed in seconds.
  void observe(duration d) noexcept { observe(std::chrono::duration<double>(d).count()); }

  [[nodiscard]] std::span<const double> bounds() const noexcept { return bounds_; }
  // Per-bucket counts (the last one above every bound), count and sum.
  void read(metric_series& out) const {
    out.buckets.resize(bounds_.size() + 1);
    out.count = 0;
    for (std::size_t i = 0; i <= bounds_.size(); ++i) {
      out.buckets[i] = counts_[i].load(std::memory_order_relaxed);
      out.count += out.buckets[i];
    }
    out.sum = sum_.load(std::memory_order_relaxed);
  }

 private:
  std::span<const double> bounds_;  // owned by the family
  std::unique_ptr<std::atomic<std::uint64_t>[]> counts_;
  std::atomic<double> sum_{0.0};
};

namespace detail {

// Orders stored label values and looked-up ones alike, so lookups by
// string_view allocate nothing.
struct label_values_less {
  using is_transparent = void;
  template <class A, class B>
  bool operator()(const A& a, const B& b) const noexcept {
    return std::lexicographical_compare(a.begin(), a.end(), b.begin(), b.end(),
                                        [](std::string_view x, std::string_view y) { return x < y; });
  }
};

class family_base {
 public:
  family_base(metric_type type, metric_options o) : type_(type), options_(std::move(o)) {}
  virtual ~family_base() = default;
  family_base(const family_base&) = delete;
  family_base& operator=(const family_base&) = delete;

  [[nodiscard]] metric_type type() const noexcept { return type_; }
  [[nodiscard]] const metric_options& options() const noexcept { return options_; }
  virtual void collect(metric_family_snapshot& out) const = 0;

 protected:
  metric_type type_;
  metric_options options_;
};

}  // namespace detail

// Every series of one metric, by label values.
template <class Series>
class metric_family final : public detail::family_base {
 public:
  metric_family(metric_type type, metric_options o) : family_base(type, std::move(o)) {
    if (options_.labels.empty()) (void)with({});  // an unlabelled metric exists (as 0) from the start
  }

  [[nodiscard]] const std::string& name() const noexcept { return options_.name; }

  // The series for these label values (one per label name, in order),
  // created on first use. The reference stays valid as long as the
  // registry. Throws keel::invalid_options on a wrong number of values.
  [[nodiscard]] Series& with(std::initializer_list<std::string_view> values) {
    return with(std::span<const std::string_view>(values.begin(), values.size()));
  }
  [[nodiscard]] Series& with(std::span<const std::string_view> values) {
    if (values.size() != options_.labels.size()) {
      throw invalid_options(absl::InvalidArgumentError(
          absl::StrCat("keel: metric ", options_.name, " takes ", options_.labels.size(), " label values {",
                       absl::StrJoin(options_.labels, ","), "}, got ", values.size())));
    }
    // Values with invalid UTF-8 name the series they are written as, so that
    // two that differ only in replaced bytes are one series, not a scrape
    // with a duplicate (rare: only then does this allocate).
    if (std::vector<std::string> w = detail::written_labels(values); !w.empty()) {
      const std::vector<std::string_view> views(w.begin(), w.end());
      return with(std::span<const std::string_view>(views));
    }
    std::lock_guard lock(mu_);
    auto it = series_.find(values);
    if (it == series_.end()) {
      it = series_.emplace(std::vector<std::string>(values.begin(), values.end()), make()).first;
    }
    return *it->second;
  }

  // Like with(), but creates no series past `max_series`: returns null
  // instead, so a caller labelling by names it does not control (breakers,
  // paths) can fold the excess into one series rather than grow without
  // bound.
  [[nodiscard]] Series* with_at_most(std::span<const std::string_view> values, std::size_t max_series) {
    if (values.size() != options_.labels.size()) return &with(values);  // throws, naming the labels
    if (std::vector<std::string> w = detail::written_labels(values); !w.empty()) {  // as in with()
      const std::vector<std::string_view> views(w.begin(), w.end());
      return with_at_most(std::span<const std::string_view>(views), max_series);
    }
    std::lock_guard lock(mu_);
    auto it = series_.find(values);
    if (it == series_.end()) {
      if (series_.size() >= max_series) return nullptr;
      it = series_.emplace(std::vector<std::string>(values.begin(), values.end()), make()).first;
    }
    return it->second.get();
  }

  // How many series the family has.
  [[nodiscard]] std::size_t size() const {
    std::lock_guard lock(mu_);
    return series_.size();
  }

  void collect(metric_family_snapshot& out) const override {
    out.name = options_.name;
    out.help = options_.help;
    out.type = type_;
    out.label_names = options_.labels;
    out.bounds = options_.buckets;
    std::lock_guard lock(mu_);
    out.series.reserve(series_.size());
    for (const auto& [labels, series] : series_) {
      metric_series& s = out.series.emplace_back();
      s.labels = labels;
      if constexpr (std::is_same_v<Series, histogram_metric>) {
        series->read(s);
      } else {
        s.value = static_cast<double>(series->value());
      }
    }
  }

 private:
  std::unique_ptr<Series> make() const {
    if constexpr (std::is_same_v<Series, histogram_metric>) {
      return std::make_unique<Series>(std::span<const double>(options_.buckets));
    } else {
      return std::make_unique<Series>();
    }
  }

  mutable std::mutex mu_;
  std::map<std::vector<std::string>, std::unique_ptr<Series>, detail::label_values_less> series_;
};

using counter_family = metric_family<counter_metric>;
using gauge_family = metric_family<gauge_metric>;
using histogram_family = metric_family<histogram_metric>;

class metrics_registry {
 public:
  metrics_registry() = default;
  metrics_registry(const metrics_registry&) = delete;
  metrics_registry& operator=(const metrics_registry&) = delete;

  // The family with this definition, created on first use. Throws
  // keel::invalid_options if the options are invalid or the name is taken
  // by a different definition.
  keel::counter_family& counter(const metric_options& o) { return get<counter_metric>(metric_type::counter, o); }
  keel::gauge_family& gauge(const metric_options& o) { return get<gauge_metric>(metric_type::gauge, o); }
  keel::histogram_family& histogram(metric_options o) {
    if (o.buckets.empty()) o.buckets.assign(default_latency_buckets.begin(), default_latency_buckets.end());
    return get<histogram_metric>(metric_type::histogram, o);
  }

  // Adds families computed when a snapshot is taken. `collect` runs on the
  // snapshotting thread and must not call back into this registry.
  void add_collector(std::function<void(metrics_snapshot&)> collect) {
    std::lock_guard lock(mu_);
    collectors_.push_back(std::move(collect));
  }

  // Every family and every collector's, sorted by family name and label
  // values. Allocates.
  [[nodiscard]] metrics_snapshot snapshot() const {
    metrics_snapshot out;
    std::lock_guard lock(mu_);
    out.families.reserve(families_.size());
    for (const auto& [name, family] : families_) family->collect(out.families.emplace_back());
    for (const auto& collect : collectors_) collect(out);
    std::stable_sort(out.families.begin(), out.families.end(),
                     [](const auto& a, const auto& b) { return a.name < b.name; });
    for (auto& f : out.families) {
      std::stable_sort(f.series.begin(), f.series.end(),
                       [](const auto& a, const auto& b) { return a.labels < b.labels; });
    }
    return out;
  }

 private:
  template <class Series>
  metric_family<Series>& get(metric_type type, const metric_options& o) {
    detail::require_valid(o.validate_as(type));
    std::lock_guard lock(mu_);
    auto it = families_.find(o.name);
    if (it != families_.end()) {
      const detail::family_base& f = *it->second;
      if (f.type() != type || f.options().labels != o.labels || f.options().buckets != o.buckets) {
        throw invalid_options(detail::invalid_field(
            "metric_options", "name", "be unique across definitions",
            absl::StrCat(detail::quote_text(o.name), ", already a ", detail::to_absl(to_string(f.type())), " with labels {",
                         absl::StrJoin(f.options().labels, ","), "}")));
      }
      return static_cast<metric_family<Series>&>(*it->second);
    }
    auto family = std::make_unique<metric_family<Series>>(type, o);
    auto& ref = *family;
    families_.emplace(o.name, std::move(family));
    return ref;
  }

  mutable std::mutex mu_;
  std::map<std::string, std::unique_ptr<detail::family_base>, std::less<>> families_;
  std::vector<std::function<void(metrics_snapshot&)>> collectors_;
};

}  // namespace keel
