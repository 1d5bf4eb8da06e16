// keel/core/status.hpp — hints that travel with an absl::Status, and the error
// keel raises for invalid options.
//
// keel reports every outcome as absl::Status / absl::StatusOr<T>. What a
// caller needs beyond the code travels as a status payload:
//
//   retry-after   how long to wait before trying again (a provider's hint, a
//                 quota refill, a breaker's remaining open time)
//   refused-by    which limit refused (for example "tenant:acme:rate")
//   outcome       an explicit classification that overrides the classifier
//   not-started   the work was refused before it began: "not processed",
//                 as opposed to a timeout whose effect is unknown
//
// Example:
//
//   absl::Status s = keel::with_retry_after(absl::ResourceExhaustedError("429"),
//                                           std::chrono::seconds(2));
//   std::optional<keel::duration> wait = keel::retry_after(s);   // 2 s
//
// Invalid options are refused when a component is constructed: the
// constructor throws keel::invalid_options, whose status() is an
// absl::InvalidArgumentError naming the field and the rule. Call the options'
// validate() first to get the same status without an exception.
//
// Thread-safety: free functions on values; safe from any thread.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "keel/core/clock.hpp"

namespace keel {

namespace detail {
// Debian's abseil has its own string_view (ABSL_OPTION_USE_STD_STRING_VIEW is
// 0); keel's API speaks std::string_view and converts at the boundary.
[[nodiscard]] constexpr absl::string_view to_absl(std::string_view s) noexcept { return {s.data(), s.size()}; }
[[nodiscard]] constexpr std::string_view to_std(absl::string_view s) noexcept { return {s.data(), s.size()}; }
}  // namespace detail

// Payload type URLs. Stable: callers and other languages may read them.
inline constexpr std::string_view retry_after_payload = "keel.dev/retry-after-ns";
inline constexpr std::string_view refused_by_payload = "keel.dev/refused-by";
inline constexpr std::string_view outcome_payload = "keel.dev/outcome";
inline constexpr std::string_view not_started_payload = "keel.dev/not-started";

// Attaches a retry-after hint (negative hints are stored as zero).
[[nodiscard]] inline absl::Status with_retry_after(absl::Status s, duration wait) {
  if (s.ok()) return s;
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(wait).count();
  s.SetPayload(detail::to_absl(retry_after_payload), absl::Cord(absl::StrCat(ns < 0 ? 0 : ns)));
  return s;
}

[[nodiscard]] inline std::optional<duration> retry_after(const absl::Status& s) {
  auto p = s.GetPayload(detail::to_absl(retry_after_payload));
  if (!p) return std::nullopt;
  std::int64_t ns = 0;
  if (!absl::SimpleAtoi(std::string(*p), &ns) || ns < 0) return std::nullopt;
  return std::chrono::duration_cast<duration>(std::chrono::nanoseconds(ns));
}

// Names the limit that refused (a quota level, a bulkhead class, a breaker).
[[nodiscard]] inline absl::Status with_refused_by(absl::Status s, std::string_view limit) {
  if (s.ok()) return s;
  s.SetPayload(detail::to_absl(refused_by_payload), absl::Cord(detail::to_absl(limit)));
  return s;
}

[[nodiscard]] inline std::optional<std::string> refused_by(const absl::Status& s) {
  auto p = s.GetPayload(detail::to_absl(refused_by_payload));
  if (!p) return std::nullopt;
  return std::string(*p);
}

// Marks a status as "the work was not started": safe to retry, nothing
// happened downstream.
[[nodiscard]] inline absl::Status mark_not_started(absl::Status s) {
  if (s.ok()) return s;
  s.SetPayload(detail::to_absl(not_started_payload), absl::Cord("1"));
  return s;
}

[[nodiscard]] inline bool not_started(const absl::Status& s) {
  return s.GetPayload(detail::to_absl(not_started_payload)).has_value();
}

// A status with the same code and payloads and `context` put before its
// message. Used on failure paths only: it allocates.
[[nodiscard]] inline absl::Status annotate(const absl::Status& s, std::string_view context) {
  if (s.ok()) return s;
  absl::Status out(s.code(), absl::StrCat(detail::to_absl(context), ": ", s.message()));
  s.ForEachPayload([&](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
  return out;
}

// Thrown by a component's constructor when its options are invalid. The
// status is an absl::InvalidArgumentError naming the field and the rule.
class invalid_options : public std::invalid_argument {
 public:
  explicit invalid_options(absl::Status status)
      : std::invalid_argument(std::string(status.message())), status_(std::move(status)) {}
  [[nodiscard]] const absl::Status& status() const noexcept { return status_; }

 private:
  absl::Status status_;
};

namespace detail {

// Throws invalid_options when `s` is not OK. Called once, at construction.
inline void require_valid(absl::Status s) {
  if (!s.ok()) throw invalid_options(std::move(s));
}

// "<component>.<field> must <rule> (got <value>)"
template <class V>
[[nodiscard]] absl::Status invalid_field(std::string_view component, std::string_view field,
                                         std::string_view rule, const V& got) {
  return absl::InvalidArgumentError(absl::StrCat(to_absl(component), ".", to_absl(field), " must ", to_absl(rule),
                                                 " (got ", got, ")"));
}

// A duration as people read it, in the largest unit it reaches, to at most
// three decimals: "299.996ms", "1.5s", "2s", "750us", "0s". Seconds are the
// largest unit ("7200s"). For messages and option errors, not hot paths.
template <class Rep, class Period>
[[nodiscard]] std::string describe(std::chrono::duration<Rep, Period> d) {
  const std::int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(d).count();
  if (ns == 0) return "0s";
  // |ns| without overflow at INT64_MIN.
  const std::uint64_t mag = ns < 0 ? std::uint64_t{0} - static_cast<std::uint64_t>(ns) : static_cast<std::uint64_t>(ns);
  const char* sign = ns < 0 ? "-" : "";
  if (mag < 1'000) return absl::StrCat(sign, mag, "ns");
  struct unit {
    std::uint64_t ns;
    const char* name;
  };
  constexpr unit units[] = {{1'000, "us"}, {1'000'000, "ms"}, {1'000'000'000, "s"}};
  std::size_t u = mag >= 1'000'000'000 ? 2 : mag >= 1'000'000 ? 1 : 0;
  // Thousandths of the unit, rounded half up; 999.9996ms rounds into the next unit.
  std::uint64_t milli = (mag + units[u].ns / 2'000) / (units[u].ns / 1'000);
  if (milli >= 1'000'000 && u < 2) {
    ++u;
    milli = (mag + units[u].ns / 2'000) / (units[u].ns / 1'000);
  }
  std::uint64_t frac = milli % 1'000;
  if (frac == 0) return absl::StrCat(sign, milli / 1'000, units[u].name);
  int digits = 3;
  while (frac % 10 == 0) {
    frac /= 10;
    --digits;
  }
  std::string f = absl::StrCat(frac);
  f.insert(0, static_cast<std::size_t>(digits) - f.size(), '0');
  return absl::StrCat(sign, milli / 1'000, ".", f, units[u].name);
}

template <class Rep, class Period>
[[nodiscard]] absl::Status invalid_field(std::string_view component, std::string_view field,
                                         std::string_view rule, std::chrono::duration<Rep, Period> got) {
  return invalid_field(component, field, rule, describe(got));
}

}  // namespace detail

// For a service's own options, checked the way keel's components check
// theirs: InvalidArgumentError "<component>.<field> must <rule> (got <value>)",
// a duration given as people read it ("1.5s", "250ms").
template <class V>
[[nodiscard]] absl::Status invalid_option(std::string_view component, std::string_view field, std::string_view rule,
                                          const V& got) {
  return detail::invalid_field(component, field, rule, got);
}

// Throws keel::invalid_options when `s` is not OK: a constructor's check of
// its options, as keel's components make it.
inline void require_valid_options(absl::Status s) { detail::require_valid(std::move(s)); }

// A duration as people read it: "299.996ms", "1.5s", "750us", "0s".
template <class Rep, class Period>
[[nodiscard]] std::string describe_duration(std::chrono::duration<Rep, Period> d) {
  return detail::describe(d);
}

}  // namespace keel
