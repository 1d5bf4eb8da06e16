// keel/observe/prometheus.hpp — a metrics snapshot in Prometheus' text exposition
// format (version 0.0.4), for a /metrics endpoint.
//
// For each family, sorted by name: a "# HELP name text" line (backslash and
// newline escaped), a "# TYPE name type" line, then its series sorted by
// label values:
//
//   counter, gauge   name{l="v",...} value
//   histogram        name_bucket{...,le="<bound>"} <cumulative count>   one per bound, then le="+Inf"
//                    name_sum{...} <sum>
//                    name_count{...} <count, equal to the +Inf bucket>
//   summary          name{...,quantile="<q>"} <value>   then name_sum and name_count
//
// Label values escape backslash (\\), double quote (\") and newline (\n);
// bytes that are not valid UTF-8 become U+FFFD (Prometheus would refuse them;
// metrics_snapshot::validate refuses two series that would then be written
// alike, and the registry never makes such a pair).
// Numbers are written in the shortest form that reads back exactly (1,
// 0.25, 1e-05); NaN and infinities as NaN, +Inf, -Inf. A series without
// labels is written without braces. The same snapshot always renders the
// same bytes, whatever order its families and series are in.
//
// Example:
//
//   keel::metrics_snapshot snap = registry.snapshot();        // keel/observe/metrics.hpp
//   absl::StatusOr<std::string> body = keel::to_prometheus_text(snap);
//   // serve *body with Content-Type: keel::prometheus_content_type
//
// A snapshot that breaks the data model (see metrics_snapshot::validate) is
// refused with InvalidArgument; nothing is written.
//
// Thread-safety: pure functions of their arguments.
#pragma once

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "keel/observe/metrics.hpp"

namespace keel {

inline constexpr std::string_view prometheus_content_type = "text/plain; version=0.0.4; charset=utf-8";

namespace detail {

inline void append_number(std::string& out, double v) {
  if (std::isnan(v)) {
    out += "NaN";
  } else if (std::isinf(v)) {
    out += v > 0 ? "+Inf" : "-Inf";
  } else {
    char buf[32];
    const auto r = std::to_chars(buf, buf + sizeof buf, v);  // shortest round-trip form
    out.append(buf, r.ptr);
  }
}

inline void append_number(std::string& out, std::uint64_t v) {
  char buf[24];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  out.append(buf, r.ptr);
}

// Escapes backslash, newline and (in label values) double quote; a byte that
// is not valid UTF-8 becomes U+FFFD, since Prometheus refuses a scrape with
// invalid UTF-8 in it.
inline void append_escaped(std::string& out, std::string_view s, bool quotes) {
  for (std::size_t i = 0; i < s.size();) {
    const char c = s[i];
    if (static_cast<unsigned char>(c) >= 0x80) {
      i += append_utf8_at(out, s, i);
      continue;
    }
    ++i;
    switch (c) {
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '"':
        if (quotes) {
          out += "\\\"";
          break;
        }
        [[fallthrough]];
      default: out += c;
    }
  }
}

// name{l1="v1",...[,extra_name="extra_value"]} value\n
template <class Value>
void append_sample(std::string& out, std::string_view name, std::string_view suffix,
                   const std::vector<std::string>& label_names, const std::vector<std::string>& label_values,
                   std::string_view extra_name, std::string_view extra_value, Value value) {
  out += name;
  out += suffix;
  if (!label_names.empty() || !extra_name.empty()) {
    out += '{';
    bool first = true;
    for (std::size_t i = 0; i < label_names.size(); ++i) {
      if (!first) out += ',';
      first = false;
      out += label_names[i];
      out += "=\"";
      append_escaped(out, label_values[i], true);
      out += '"';
    }
    if (!extra_name.empty()) {
      if (!first) out += ',';
      out += extra_name;
      out += "=\"";
      out += extra_value;
      out += '"';
    }
    out += '}';
  }
  out += ' ';
  append_number(out, value);
  out += '\n';
}

}  // namespace detail

// Appends the snapshot's text to `out`; on error `out` is left unchanged.
[[nodiscard]] inline absl::Status append_prometheus_text(const metrics_snapshot& snap, std::string& out) {
  if (absl::Status s = snap.validate(); !s.ok()) return s;
  std::vector<const metric_family_snapshot*> families;
  families.reserve(snap.families.size());
  for (const auto& f : snap.families) families.push_back(&f);
  std::sort(families.begin(), families.end(), [](auto* a, auto* b) { return a->name < b->name; });

  std::string number;
  for (const metric_family_snapshot* f : families) {
    out += "# HELP ";
    out += f->name;
    out += ' ';
    detail::append_escaped(out, f->help, false);
    out += "\n# TYPE ";
    out += f->name;
    out += ' ';
    out += to_string(f->type);
    out += '\n';

    std::vector<const metric_series*> series;
    series.reserve(f->series.size());
    for (const auto& s : f->series) series.push_back(&s);
    std::sort(series.begin(), series.end(), [](auto* a, auto* b) { return a->labels < b->labels; });

    for (const metric_series* s : series) {
      switch (f->type) {
        case metric_type::counter:
        case metric_type::gauge:
          detail::append_sample(out, f->name, "", f->label_names, s->labels, "", "", s->value);
          break;
        case metric_type::histogram: {
          std::uint64_t cumulative = 0;
          for (std::size_t i = 0; i < f->bounds.size(); ++i) {
            cumulative += s->buckets[i];
            number.clear();
            detail::append_number(number, f->bounds[i]);
            detail::append_sample(out, f->name, "_bucket", f->label_names, s->labels, "le", number, cumulative);
          }
          cumulative += s->buckets.back();
          detail::append_sample(out, f->name, "_bucket", f->label_names, s->labels, "le", "+Inf", cumulative);
          detail::append_sample(out, f->name, "_sum", f->label_names, s->labels, "", "", s->sum);
          detail::append_sample(out, f->name, "_count", f->label_names, s->labels, "", "", cumulative);
          break;
        }
        case metric_type::summary: {
          std::vector<quantile_value> qs = s->quantiles;
          std::sort(qs.begin(), qs.end(), [](const auto& a, const auto& b) { return a.quantile < b.quantile; });
          for (const quantile_value& q : qs) {
            number.clear();
            detail::append_number(number, q.quantile);
            detail::append_sample(out, f->name, "", f->label_names, s->labels, "quantile", number, q.value);
          }
          detail::append_sample(out, f->name, "_sum", f->label_names, s->labels, "", "", s->sum);
          detail::append_sample(out, f->name, "_count", f->label_names, s->labels, "", "", s->count);
          break;
        }
      }
    }
  }
  return absl::OkStatus();
}

[[nodiscard]] inline absl::StatusOr<std::string> to_prometheus_text(const metrics_snapshot& snap) {
  std::string out;
  if (absl::Status s = append_prometheus_text(snap, out); !s.ok()) return s;
  return out;
}

}  // namespace keel
