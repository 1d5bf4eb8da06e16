// keel/provider/hints.hpp — what model providers say over HTTP about when to
// come back, and what their status codes mean, as keel outcomes.
//
// Pure parsers over header values and response bodies; no I/O, no
// allocation, no libcurl (keel/provider/http.hpp uses them on every response,
// and a user with their own HTTP client can too). The shapes are the ones
// providers send:
//
//   retry-after-ms: 1500                        parse_delay_ms (OpenAI, Azure)
//   Retry-After: 20                             parse_retry_after, seconds
//   Retry-After: Wed, 21 Oct 2015 07:28:00 GMT  parse_retry_after, HTTP-date
//   x-should-retry: true | false                parse_should_retry (OpenAI, Anthropic)
//   x-ratelimit-reset-requests: 6m0s            parse_go_duration (OpenAI)
//   anthropic-ratelimit-tokens-reset: 2024-05-01T12:00:30Z   parse_rfc3339
//   "retryDelay": "3s" in a JSON error body     find_retry_delay (Google)
//
// response_hints gathers them from a response's headers and picks one wait
// (see hint() for the order); http_status_code() and classify_http() are the
// status-code table of docs/providers.md.
//
// Example:
//
//   keel::http::response_hints h;
//   const auto now = std::chrono::system_clock::now();
//   h.on_header("Retry-After", "2", now);
//   h.on_header("x-should-retry", "true", now);
//   std::optional<keel::duration> wait = h.hint(429);    // 2 s
//   keel::outcome_kind k = keel::http::classify_http(503, {.effect = keel::effect::write});
//   // k == keel::outcome_kind::transient
//
// Thread-safety: free functions are pure; a response_hints belongs to one
// response (one thread at a time).
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "absl/status/status.h"
#include "keel/core/clock.hpp"
#include "keel/core/outcome.hpp"

namespace keel::http {

// Wall-clock time: HTTP-dates and RFC 3339 times are calendar times.
using wall_time = std::chrono::system_clock::time_point;

// Longer hints are read as this long: a parsed wait never overflows, and a
// year is as good as forever inside any deadline.
inline constexpr std::chrono::nanoseconds max_parsed_hint = std::chrono::hours(24 * 366);

namespace detail {

[[nodiscard]] constexpr bool is_digit(char c) noexcept { return c >= '0' && c <= '9'; }
[[nodiscard]] constexpr char lower(char c) noexcept { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; }

[[nodiscard]] constexpr bool iequals(std::string_view a, std::string_view b) noexcept {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (lower(a[i]) != lower(b[i])) return false;
  return true;
}

[[nodiscard]] constexpr bool istarts_with(std::string_view s, std::string_view prefix) noexcept {
  return s.size() >= prefix.size() && iequals(s.substr(0, prefix.size()), prefix);
}

[[nodiscard]] constexpr bool iends_with(std::string_view s, std::string_view suffix) noexcept {
  return s.size() >= suffix.size() && iequals(s.substr(s.size() - suffix.size()), suffix);
}

[[nodiscard]] constexpr std::string_view trim(std::string_view s) noexcept {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r' || s.front() == '\n'))
    s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r' || s.back() == '\n'))
    s.remove_suffix(1);
  return s;
}

// A non-negative decimal number ("12", "1.5", ".5") times `unit_ns`, read
// from the front of `s` (consumed), saturating at max_parsed_hint. Digits
// past the ninth decimal are ignored.
[[nodiscard]] constexpr std::optional<std::int64_t> take_decimal(std::string_view& s, std::int64_t unit_ns) noexcept {
  constexpr std::int64_t cap = max_parsed_hint.count();
  std::int64_t whole = 0;
  bool any = false, saturated = false;
  while (!s.empty() && is_digit(s.front())) {
    any = true;
    if (!saturated) {
      whole = whole * 10 + (s.front() - '0');
      if (whole > cap) saturated = true;
    }
    s.remove_prefix(1);
  }
  std::int64_t frac = 0, scale = 1;
  if (!s.empty() && s.front() == '.') {
    s.remove_prefix(1);
    while (!s.empty() && is_digit(s.front())) {
      any = true;
      if (scale < 1'000'000'000) {
        frac = frac * 10 + (s.front() - '0');
        scale *= 10;
      }
      s.remove_prefix(1);
    }
  }
  if (!any) return std::nullopt;
  if (saturated || whole > cap / unit_ns) return cap;
  // frac < scale, so frac * q < unit_ns and frac * r < 10^18: no overflow.
  const std::int64_t q = unit_ns / scale, r = unit_ns % scale;
  const std::int64_t part = frac * q + frac * r / scale;
  const std::int64_t ns = whole * unit_ns + part;
  return ns > cap ? cap : ns;
}

[[nodiscard]] constexpr duration to_duration(std::int64_t ns) noexcept {
  return std::chrono::duration_cast<duration>(std::chrono::nanoseconds(ns));
}

// Exactly `n` digits from the front of `s` (consumed).
[[nodiscard]] constexpr std::optional<int> take_digits(std::string_view& s, std::size_t n) noexcept {
  if (s.size() < n) return std::nullopt;
  int v = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (!is_digit(s[i])) return std::nullopt;
    v = v * 10 + (s[i] - '0');
  }
  s.remove_prefix(n);
  return v;
}

[[nodiscard]] constexpr bool take_char(std::string_view& s, char c) noexcept {
  if (s.empty() || lower(s.front()) != lower(c)) return false;
  s.remove_prefix(1);
  return true;
}

[[nodiscard]] inline std::optional<wall_time> civil(int y, int mo, int d, int h, int mi, int sec) noexcept {
  using namespace std::chrono;
  // system_clock counts nanoseconds: years past 2262 would overflow it.
  if (y < 1900 || y > 2200) return std::nullopt;
  const year_month_day ymd{year{y}, month{static_cast<unsigned>(mo)}, day{static_cast<unsigned>(d)}};
  if (!ymd.ok() || h > 23 || mi > 59 || sec > 60) return std::nullopt;  // 60: a leap second
  return time_point_cast<wall_time::duration>(sys_days{ymd} + hours{h} + minutes{mi} + seconds{sec});
}

// Time from `now` to `t`; zero when `t` has passed.
[[nodiscard]] inline duration until(wall_time t, wall_time now) noexcept {
  if (t <= now) return duration::zero();
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(t - now);
  return to_duration(ns > max_parsed_hint ? max_parsed_hint.count() : ns.count());
}

}  // namespace detail

// "1500" or "1500.5" milliseconds (retry-after-ms).
[[nodiscard]] constexpr std::optional<duration> parse_delay_ms(std::string_view v) noexcept {
  v = detail::trim(v);
  std::optional<std::int64_t> ns = detail::take_decimal(v, 1'000'000);
  if (!ns || !v.empty()) return std::nullopt;
  return detail::to_duration(*ns);
}

// An HTTP-date (RFC 9110 §5.6.7): the preferred IMF-fixdate
// "Sun, 06 Nov 1994 08:49:37 GMT", and the obsolete RFC 850
// "Sunday, 06-Nov-94 08:49:37 GMT" and asctime "Sun Nov  6 08:49:37 1994".
// RFC 850's two-digit year is read relative to `now`, as §5.6.7 says: in
// this century, unless that is more than 50 years in the future, then in
// the century before ("-94" read in 2026 is 1994, "-70" is 2070).
[[nodiscard]] inline std::optional<wall_time> parse_http_date(std::string_view v, wall_time now) noexcept {
  using detail::take_char;
  using detail::take_digits;
  static constexpr std::array<std::string_view, 12> months = {"jan", "feb", "mar", "apr", "may", "jun",
                                                               "jul", "aug", "sep", "oct", "nov", "dec"};
  auto take_month = [](std::string_view& s) -> std::optional<int> {
    if (s.size() < 3) return std::nullopt;
    for (std::size_t i = 0; i < months.size(); ++i) {
      if (detail::iequals(s.substr(0, 3), months[i])) {
        s.remove_prefix(3);
        return static_cast<int>(i) + 1;
      }
    }
    return std::nullopt;
  };
  auto take_time = [](std::string_view& s, int& h, int& mi, int& sec) {
    auto hh = take_digits(s, 2);
    if (!hh || !take_char(s, ':')) return false;
    auto mm = take_digits(s, 2);
    if (!mm || !take_char(s, ':')) return false;
    auto ss = take_digits(s, 2);
    if (!ss) return false;
    h = *hh, mi = *mm, sec = *ss;
    return true;
  };
  v = detail::trim(v);
  const std::size_t word = v.find_first_of(", ");
  if (word == std::string_view::npos || word < 3) return std::nullopt;
  const bool comma = v[word] == ',';
  v.remove_prefix(word);
  int y = 0, mo = 0, d = 0, h = 0, mi = 0, sec = 0;
  if (comma) {
    v.remove_prefix(1);
    if (!take_char(v, ' ')) return std::nullopt;
    auto dd = take_digits(v, 2);
    if (!dd) return std::nullopt;
    d = *dd;
    const bool rfc850 = take_char(v, '-');
    if (!rfc850 && !take_char(v, ' ')) return std::nullopt;
    auto m = take_month(v);
    if (!m) return std::nullopt;
    mo = *m;
    if (rfc850) {
      if (!take_char(v, '-')) return std::nullopt;
      auto yy = take_digits(v, 2);
      if (!yy) return std::nullopt;
      y = -1 - *yy;  // settled below, once the rest is read (the rule compares whole timestamps)
    } else {
      if (!take_char(v, ' ')) return std::nullopt;
      auto yyyy = take_digits(v, 4);
      if (!yyyy) return std::nullopt;
      y = *yyyy;
    }
    if (!take_char(v, ' ') || !take_time(v, h, mi, sec)) return std::nullopt;
    if (!take_char(v, ' ') || !detail::iequals(v, "GMT")) return std::nullopt;
  } else {  // asctime: "Sun Nov  6 08:49:37 1994"
    if (!take_char(v, ' ')) return std::nullopt;
    auto m = take_month(v);
    if (!m || !take_char(v, ' ')) return std::nullopt;
    mo = *m;
    if (take_char(v, ' ')) {
      auto dd = take_digits(v, 1);
      if (!dd) return std::nullopt;
      d = *dd;
    } else {
      auto dd = take_digits(v, 2);
      if (!dd) return std::nullopt;
      d = *dd;
    }
    if (!take_char(v, ' ') || !take_time(v, h, mi, sec) || !take_char(v, ' ')) return std::nullopt;
    auto yyyy = take_digits(v, 4);
    if (!yyyy || !v.empty()) return std::nullopt;
    y = *yyyy;
  }
  if (y < 0) {  // RFC 850: the two-digit year, relative to now
    using namespace std::chrono;
    const int yy = -1 - y;
    const year_month_day today{floor<days>(now)};
    const int this_year = static_cast<int>(today.year());
    y = this_year - this_year % 100 + yy;
    const std::optional<wall_time> t = detail::civil(y, mo, d, h, mi, sec);
    const year_month_day limit_day{today.year() + years{50}, today.month(), today.day()};
    const wall_time limit =
        time_point_cast<wall_time::duration>(sys_days{limit_day.ok() ? limit_day : limit_day.year() / limit_day.month() / last}) +
        (now - time_point_cast<wall_time::duration>(floor<days>(now)));
    if (t && *t <= limit) return t;
    if (!t && y <= this_year + 50) return std::nullopt;  // an impossible date, not a far-future one
    return detail::civil(y - 100, mo, d, h, mi, sec);
  }
  return detail::civil(y, mo, d, h, mi, sec);
}

// The same, RFC 850's two-digit year read relative to the system clock's now.
[[nodiscard]] inline std::optional<wall_time> parse_http_date(std::string_view v) noexcept {
  return parse_http_date(v, std::chrono::time_point_cast<wall_time::duration>(std::chrono::system_clock::now()));
}

// Retry-After: delay-seconds ("120"; a decimal is accepted too) or an
// HTTP-date, as a wait from `now` (zero for a date in the past).
[[nodiscard]] inline std::optional<duration> parse_retry_after(std::string_view v, wall_time now) noexcept {
  v = detail::trim(v);
  if (!v.empty() && (detail::is_digit(v.front()) || v.front() == '.')) {
    std::string_view rest = v;
    std::optional<std::int64_t> ns = detail::take_decimal(rest, 1'000'000'000);
    if (!ns || !rest.empty()) return std::nullopt;
    return detail::to_duration(*ns);
  }
  std::optional<wall_time> t = parse_http_date(v, now);
  if (!t) return std::nullopt;
  return detail::until(*t, now);
}

// A Go duration as OpenAI's x-ratelimit-reset-* send it: "1s", "6m0s",
// "20ms", "1h2m3.5s", "0.5s", "250us" (also "µs", "μs"), "10ns", "0".
// Negative durations are not waits and are refused.
[[nodiscard]] constexpr std::optional<duration> parse_go_duration(std::string_view v) noexcept {
  v = detail::trim(v);
  if (v == "0") return duration::zero();
  if (v.empty()) return std::nullopt;
  if (v.front() == '+') v.remove_prefix(1);
  constexpr std::int64_t cap = max_parsed_hint.count();
  std::int64_t total = 0;
  while (!v.empty()) {
    // Number first (kept as text), then its unit decides the scale.
    std::size_t n = 0;
    while (n < v.size() && (detail::is_digit(v[n]) || v[n] == '.')) ++n;
    if (n == 0) return std::nullopt;
    std::string_view number = v.substr(0, n);
    v.remove_prefix(n);
    struct unit {
      std::string_view name;
      std::int64_t ns;
    };
    // "ms" is tried before "m".
    constexpr std::array<unit, 8> units = {{{"ns", 1},
                                            {"us", 1'000},
                                            {"\xC2\xB5s", 1'000},
                                            {"\xCE\xBCs", 1'000},
                                            {"ms", 1'000'000},
                                            {"s", 1'000'000'000},
                                            {"m", 60'000'000'000},
                                            {"h", 3'600'000'000'000}}};
    std::int64_t scale = 0;
    for (const unit& u : units) {
      if (v.substr(0, u.name.size()) == u.name) {
        scale = u.ns;
        v.remove_prefix(u.name.size());
        break;
      }
    }
    if (scale == 0) return std::nullopt;
    std::optional<std::int64_t> part = detail::take_decimal(number, scale);
    if (!part || !number.empty()) return std::nullopt;
    total = *part > cap - total ? cap : total + *part;
  }
  return detail::to_duration(total);
}

// An RFC 3339 time: "2024-05-01T12:00:30Z", "2024-05-01T12:00:30.25+02:00",
// lower-case 't'/'z' and a space for 'T' accepted.
[[nodiscard]] inline std::optional<wall_time> parse_rfc3339(std::string_view v) noexcept {
  using detail::take_char;
  using detail::take_digits;
  v = detail::trim(v);
  auto y = take_digits(v, 4);
  if (!y || !take_char(v, '-')) return std::nullopt;
  auto mo = take_digits(v, 2);
  if (!mo || !take_char(v, '-')) return std::nullopt;
  auto d = take_digits(v, 2);
  if (!d || !(take_char(v, 'T') || take_char(v, ' '))) return std::nullopt;
  auto h = take_digits(v, 2);
  if (!h || !take_char(v, ':')) return std::nullopt;
  auto mi = take_digits(v, 2);
  if (!mi || !take_char(v, ':')) return std::nullopt;
  auto s = take_digits(v, 2);
  if (!s) return std::nullopt;
  std::int64_t frac_ns = 0;
  if (take_char(v, '.')) {
    std::size_t n = 0;
    while (n < v.size() && detail::is_digit(v[n])) ++n;
    if (n == 0) return std::nullopt;
    const std::string_view frac = v.substr(0, n);
    v.remove_prefix(n);
    // ".25" of a second; digits past nanoseconds are dropped.
    std::int64_t scale = 100'000'000;
    for (char c : frac) {
      if (scale == 0) break;
      frac_ns += (c - '0') * scale;
      scale /= 10;
    }
  }
  std::chrono::minutes offset{0};
  if (!(take_char(v, 'Z'))) {
    int sign = 0;
    if (take_char(v, '+')) sign = 1;
    else if (take_char(v, '-')) sign = -1;
    else return std::nullopt;
    auto oh = take_digits(v, 2);
    if (!oh || !take_char(v, ':')) return std::nullopt;
    auto om = take_digits(v, 2);
    if (!om || *oh > 23 || *om > 59) return std::nullopt;
    offset = std::chrono::minutes(sign * (*oh * 60 + *om));
  }
  if (!v.empty()) return std::nullopt;
  std::optional<wall_time> t = detail::civil(*y, *mo, *d, *h, *mi, *s);
  if (!t) return std::nullopt;
  return *t - offset + std::chrono::duration_cast<wall_time::duration>(std::chrono::nanoseconds(frac_ns));
}

// x-should-retry: "true" or "false" (any case); anything else: no opinion.
[[nodiscard]] constexpr std::optional<bool> parse_should_retry(std::string_view v) noexcept {
  v = detail::trim(v);
  if (detail::iequals(v, "true")) return true;
  if (detail::iequals(v, "false")) return false;
  return std::nullopt;
}

// The first `"retryDelay": "<seconds>s"` in a JSON body (google.rpc.RetryInfo
// in an error's details, as Gemini sends it: "3s", "1.5s", "0.25s").
[[nodiscard]] constexpr std::optional<duration> find_retry_delay(std::string_view body) noexcept {
  constexpr std::string_view key = "\"retryDelay\"";
  std::size_t at = 0;
  while ((at = body.find(key, at)) != std::string_view::npos) {
    std::string_view rest = body.substr(at + key.size());
    at += key.size();
    while (!rest.empty() && (rest.front() == ' ' || rest.front() == '\t' || rest.front() == '\r' || rest.front() == '\n'))
      rest.remove_prefix(1);
    if (!detail::take_char(rest, ':')) continue;
    while (!rest.empty() && (rest.front() == ' ' || rest.front() == '\t' || rest.front() == '\r' || rest.front() == '\n'))
      rest.remove_prefix(1);
    if (!detail::take_char(rest, '"')) continue;
    const std::size_t end = rest.find('"');
    if (end == std::string_view::npos) return std::nullopt;
    std::string_view value = rest.substr(0, end);
    if (value.empty() || value.back() != 's') continue;
    value.remove_suffix(1);
    std::optional<std::int64_t> ns = detail::take_decimal(value, 1'000'000'000);
    if (ns && value.empty()) return detail::to_duration(*ns);
  }
  return std::nullopt;
}

// The hints of one response, gathered header by header.
class response_hints {
 public:
  // One header (name without the colon, value as received). `now` is the
  // wall-clock time the response arrived; only dates read it.
  void on_header(std::string_view name, std::string_view value, wall_time now) noexcept {
    name = detail::trim(name);
    if (detail::iequals(name, "retry-after-ms")) {
      if (auto d = parse_delay_ms(value)) retry_after_ms_ = d;
    } else if (detail::iequals(name, "retry-after")) {
      if (auto d = parse_retry_after(value, now)) retry_after_ = d;
    } else if (detail::iequals(name, "x-should-retry")) {
      should_retry_ = parse_should_retry(value);
    } else if (detail::istarts_with(name, "x-ratelimit-")) {
      // OpenAI: x-ratelimit-{reset,remaining}-{requests,tokens}
      std::string_view rest = name.substr(12);
      if (detail::istarts_with(rest, "reset-")) {
        if (limit* l = find(rest.substr(6))) l->reset = parse_go_duration(value);
      } else if (detail::istarts_with(rest, "remaining-")) {
        if (limit* l = find(rest.substr(10))) l->exhausted = detail::trim(value) == "0";
      }
    } else if (detail::istarts_with(name, "anthropic-ratelimit-")) {
      // Anthropic: anthropic-ratelimit-<limit>-{reset,remaining}
      std::string_view rest = name.substr(20);
      if (detail::iends_with(rest, "-reset")) {
        if (limit* l = find(rest.substr(0, rest.size() - 6))) {
          if (auto t = parse_rfc3339(value)) l->reset = detail::until(*t, now);
        }
      } else if (detail::iends_with(rest, "-remaining")) {
        if (limit* l = find(rest.substr(0, rest.size() - 10))) l->exhausted = detail::trim(value) == "0";
      }
    }
  }

  // The wait this response asks for, in this order: retry-after-ms;
  // Retry-After; on a 429, the rate-limit resets (the longest among the
  // limits whose remaining is 0, or the shortest when none says so). A JSON
  // body's retryDelay is read by the caller (find_retry_delay) when this
  // gives nothing.
  [[nodiscard]] std::optional<duration> hint(int http_status) const noexcept {
    if (retry_after_ms_) return retry_after_ms_;
    if (retry_after_) return retry_after_;
    if (http_status != 429) return std::nullopt;
    std::optional<duration> exhausted, shortest;
    for (const limit& l : limits_) {
      if (!l.reset) continue;
      if (l.exhausted && (!exhausted || *l.reset > *exhausted)) exhausted = l.reset;
      if (!shortest || *l.reset < *shortest) shortest = l.reset;
    }
    return exhausted ? exhausted : shortest;
  }

  // x-should-retry, when the response had it.
  [[nodiscard]] std::optional<bool> should_retry() const noexcept { return should_retry_; }

  void clear() noexcept { *this = response_hints{}; }

 private:
  struct limit {
    std::optional<duration> reset;
    bool exhausted = false;
  };
  // requests, tokens, input-tokens, output-tokens
  [[nodiscard]] limit* find(std::string_view which) noexcept {
    static constexpr std::array<std::string_view, 4> names = {"requests", "tokens", "input-tokens", "output-tokens"};
    for (std::size_t i = 0; i < names.size(); ++i)
      if (detail::iequals(which, names[i])) return &limits_[i];
    return nullptr;
  }

  std::optional<duration> retry_after_ms_;
  std::optional<duration> retry_after_;
  std::optional<bool> should_retry_;
  std::array<limit, 4> limits_{};
};

// The absl code an HTTP status maps to (docs/providers.md); with
// keel::default_classifier it gives classify_http()'s kinds.
//
//   2xx                         OK
//   408 Request Timeout         Unavailable         transient: the request was not read
//   409 Conflict                Aborted             transient
//   429 Too Many Requests       ResourceExhausted   throttled
//   400, 422                    InvalidArgument     permanent
//   401                         Unauthenticated     permanent
//   403                         PermissionDenied    permanent
//   404                         NotFound            permanent
//   other 4xx                   FailedPrecondition  permanent
//   500 and other 5xx           Internal            transient for a read, ambiguous for a write
//   501                         Unimplemented       permanent
//   502, 503, 504, 529          Unavailable         transient
//   1xx, 3xx (not followed)     Unknown             ambiguous
[[nodiscard]] constexpr absl::StatusCode http_status_code(int status) noexcept {
  if (status >= 200 && status < 300) return absl::StatusCode::kOk;
  switch (status) {
    case 408: return absl::StatusCode::kUnavailable;
    case 409: return absl::StatusCode::kAborted;
    case 429: return absl::StatusCode::kResourceExhausted;
    case 400:
    case 422: return absl::StatusCode::kInvalidArgument;
    case 401: return absl::StatusCode::kUnauthenticated;
    case 403: return absl::StatusCode::kPermissionDenied;
    case 404: return absl::StatusCode::kNotFound;
    case 501: return absl::StatusCode::kUnimplemented;
    case 502:
    case 503:
    case 504:
    case 529: return absl::StatusCode::kUnavailable;  // 529: Anthropic's "overloaded"
    default: break;
  }
  if (status >= 400 && status < 500) return absl::StatusCode::kFailedPrecondition;
  if (status >= 500 && status < 600) return absl::StatusCode::kInternal;
  return absl::StatusCode::kUnknown;
}

// The kind of an HTTP status for `op`, with x-should-retry when present:
// true makes a failure retryable (throttled for a 429, else transient),
// false makes it permanent.
[[nodiscard]] constexpr outcome_kind classify_http(int status, const operation& op,
                                                   std::optional<bool> should_retry = std::nullopt) noexcept {
  const absl::StatusCode code = http_status_code(status);
  if (code == absl::StatusCode::kOk) return outcome_kind::success;
  if (should_retry) {
    if (!*should_retry) return outcome_kind::permanent;
    return code == absl::StatusCode::kResourceExhausted ? outcome_kind::throttled : outcome_kind::transient;
  }
  switch (code) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kAborted: return outcome_kind::transient;
    case absl::StatusCode::kResourceExhausted: return outcome_kind::throttled;
    case absl::StatusCode::kInternal:
      return op.effect == effect::read ? outcome_kind::transient : outcome_kind::ambiguous;
    case absl::StatusCode::kUnknown: return outcome_kind::ambiguous;
    default: return outcome_kind::permanent;
  }
}

}  // namespace keel::http
