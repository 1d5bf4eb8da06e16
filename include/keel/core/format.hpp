// keel/core/format.hpp — printing keel's values with fmt.
//
// keel hands out std::string_view labels and kinds, and Debian's abseil
// (built with its own absl::string_view) will not take them in
// absl::StrCat; fmt takes them as they are. This header adds fmt formatters
// for keel's own types, so a service logs what happened to a call in one
// line:
//
//   - every keel enum that has a keel::to_string (outcome_kind, breaker_state,
//     unit_state, begin_state, ...) prints its name: "refused";
//   - keel::labels prints the labels that are set: "tenant=acme model=m-large";
//   - keel::call_record prints what happened to a call:
//     "attempts=2 retries=1 cost=412 served_by=alt degraded";
//   - keel::readable(d) prints a duration as people read it, the way keel's
//     own messages do: "299.996ms", "1.5s", "750us".
//
// Example:
//
//   keel::call call(keel::real_clock{}.now(), {.timeout = std::chrono::seconds(3),
//                                              .labels = {.tenant = "acme"}});
//   std::string line = fmt::format("{} {} left={}", call.labels(), call.record(),
//                                  keel::readable(call.remaining(keel::real_clock{}.now())));
//   std::string kind = fmt::format("{}", keel::outcome_kind::refused);   // "refused"
//
// Thread-safety: formatting reads its argument only; call_record is a value
// (call.record() takes the snapshot).
#pragma once

#include <concepts>
#include <iterator>
#include <string>
#include <string_view>
#include <type_traits>

#include <fmt/core.h>
#include <fmt/format.h>

#include "keel/core/call.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/status.hpp"

namespace keel {

// A duration to print as people read it (see detail::describe).
struct readable_duration {
  duration value;
};
[[nodiscard]] constexpr readable_duration readable(duration d) noexcept { return {d}; }

namespace detail {
// A keel enum with a to_string found by argument-dependent lookup.
template <class E>
concept named_enum = std::is_enum_v<E> && requires(E e) {
  { to_string(e) } -> std::convertible_to<std::string_view>;
};
}  // namespace detail

}  // namespace keel

template <class E>
  requires keel::detail::named_enum<E>
struct fmt::formatter<E> : fmt::formatter<std::string_view> {
  auto format(E e, fmt::format_context& ctx) const {
    return fmt::formatter<std::string_view>::format(to_string(e), ctx);
  }
};

template <>
struct fmt::formatter<keel::readable_duration> : fmt::formatter<std::string_view> {
  auto format(keel::readable_duration d, fmt::format_context& ctx) const {
    return fmt::formatter<std::string_view>::format(keel::detail::describe(d.value), ctx);
  }
};

template <>
struct fmt::formatter<keel::labels> : fmt::formatter<std::string_view> {
  auto format(const keel::labels& l, fmt::format_context& ctx) const {
    std::string out;
    auto add = [&out](std::string_view name, std::string_view value) {
      if (value.empty()) return;
      if (!out.empty()) out.push_back(' ');
      fmt::format_to(std::back_inserter(out), "{}={}", name, value);
    };
    add("tenant", l.tenant);
    add("model", l.model);
    add("endpoint", l.endpoint);
    add("region", l.region);
    add("class", l.work_class);
    return fmt::formatter<std::string_view>::format(out, ctx);
  }
};

template <>
struct fmt::formatter<keel::call_record> : fmt::formatter<std::string_view> {
  auto format(const keel::call_record& r, fmt::format_context& ctx) const {
    std::string out = fmt::format("attempts={} retries={} cost={}", r.attempts, r.retries, r.cost);
    if (r.missing != 0) fmt::format_to(std::back_inserter(out), " missing={}", r.missing);
    if (!r.served_by.empty()) fmt::format_to(std::back_inserter(out), " served_by={}", r.served_by);
    if (r.degraded) out += " degraded";
    if (r.replayed) out += " replayed";
    return fmt::formatter<std::string_view>::format(out, ctx);
  }
};
