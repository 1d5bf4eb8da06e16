// keel/core/upstream.hpp — what an upstream HTTP service answered, kept
// beside keel's classification for a relay to pass on.
//
// keel classifies a provider's answer into an absl::Status (a 429 is
// ResourceExhausted, throttled; a 503 Unavailable, transient). A relay (a
// gateway in front of the provider) must still answer its client with the
// provider's own HTTP status and the headers clients act on: the rate-limit
// headers, retry-after, the request id. keel::upstream_reply is that: the
// status code and those header lines. keel::http (keel/provider/http.hpp)
// fills one for every response: on a 2xx in keel::http::response and in a
// stream's keel::stream_result, on a failure as a payload of the status
// (keel::upstream_of).
//
// Which headers: relay_header(name) says (case-insensitive): x-request-id,
// request-id, retry-after, retry-after-ms, x-should-retry,
// openai-processing-ms, and every name that starts with x-ratelimit-,
// ratelimit (the IETF RateLimit / RateLimit-Policy fields) or
// anthropic-ratelimit-.
//
// Example:
//
//   absl::Status s = ...;  // a keel::http attempt's failure
//   if (std::optional<keel::upstream_reply> up = keel::upstream_of(s)) {
//     int code = up->status;                                  // 429
//     std::string_view left = up->header("x-ratelimit-remaining-requests");
//     up->for_each_header([&](std::string_view name, std::string_view value) { /* pass on */ });
//   }
//
// Thread-safety: a value type; const operations may run concurrently.
#pragma once

#include <algorithm>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "keel/core/status.hpp"

namespace keel {

namespace detail {

[[nodiscard]] inline bool iequals(std::string_view a, std::string_view b) noexcept {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    char x = a[i], y = b[i];
    if (x >= 'A' && x <= 'Z') x = static_cast<char>(x - 'A' + 'a');
    if (y >= 'A' && y <= 'Z') y = static_cast<char>(y - 'A' + 'a');
    if (x != y) return false;
  }
  return true;
}

[[nodiscard]] inline bool iprefix(std::string_view s, std::string_view prefix) noexcept {
  return s.size() >= prefix.size() && iequals(s.substr(0, prefix.size()), prefix);
}

inline constexpr std::string_view upstream_payload = "keel.dev/upstream";

}  // namespace detail

// Whether a response header is one a relay passes on to its client.
[[nodiscard]] inline bool relay_header(std::string_view name) noexcept {
  for (std::string_view exact : {"x-request-id", "request-id", "retry-after", "retry-after-ms", "x-should-retry",
                                 "openai-processing-ms"}) {
    if (detail::iequals(name, exact)) return true;
  }
  return detail::iprefix(name, "x-ratelimit-") || detail::iprefix(name, "ratelimit") ||
         detail::iprefix(name, "anthropic-ratelimit-");
}

struct upstream_reply {
  int status = 0;       // the HTTP status code; 0: no response was read
  std::string headers;  // the relay headers, "Name: value\r\n" each, as received (name case kept)

  // The first value of header `name` (case-insensitive); empty when absent.
  [[nodiscard]] std::string_view header(std::string_view name) const noexcept {
    std::string_view found;
    for_each_header([&](std::string_view n, std::string_view v) {
      if (found.empty() && detail::iequals(n, name)) found = v;
    });
    return found;
  }

  // f(name, value) for each header line, in the order received.
  template <class F>
  void for_each_header(F&& f) const {
    std::string_view rest = headers;
    while (!rest.empty()) {
      const std::size_t eol = rest.find("\r\n");
      const std::string_view line = rest.substr(0, eol);
      rest = eol == std::string_view::npos ? std::string_view{} : rest.substr(eol + 2);
      const std::size_t colon = line.find(':');
      if (colon == std::string_view::npos) continue;
      std::string_view value = line.substr(colon + 1);
      while (!value.empty() && (value.front() == ' ' || value.front() == '\t')) value.remove_prefix(1);
      f(line.substr(0, colon), value);
    }
  }

  // Adds one header line if relay_header(name) (value trimmed of blanks and CR LF).
  void add_if_relayed(std::string_view name, std::string_view value) {
    while (!name.empty() && (name.back() == ' ' || name.back() == '\t')) name.remove_suffix(1);
    if (!relay_header(name)) return;
    while (!value.empty() && (value.front() == ' ' || value.front() == '\t')) value.remove_prefix(1);
    while (!value.empty() && (value.back() == '\r' || value.back() == '\n' || value.back() == ' ')) value.remove_suffix(1);
    headers.append(name.data(), name.size()).append(": ").append(value.data(), value.size()).append("\r\n");
  }

  void clear() noexcept {
    status = 0;
    headers.clear();
  }

  friend bool operator==(const upstream_reply&, const upstream_reply&) = default;
};

// `s` with `reply` as its upstream payload (an OK status stays as it is).
[[nodiscard]] inline absl::Status with_upstream(absl::Status s, const upstream_reply& reply) {
  if (s.ok()) return s;
  std::string packed = std::to_string(reply.status);
  packed.push_back('\n');
  packed.append(reply.headers);
  s.SetPayload(detail::to_absl(detail::upstream_payload), absl::Cord(packed));
  return s;
}

// The upstream reply a status carries (with_upstream), if any.
[[nodiscard]] inline std::optional<upstream_reply> upstream_of(const absl::Status& s) {
  const auto p = s.GetPayload(detail::to_absl(detail::upstream_payload));
  if (!p) return std::nullopt;
  const std::string packed(*p);
  const std::size_t nl = packed.find('\n');
  upstream_reply r;
  for (std::size_t i = 0; i < std::min(nl, packed.size()); ++i) {
    if (packed[i] < '0' || packed[i] > '9') return std::nullopt;
    r.status = r.status * 10 + (packed[i] - '0');
    if (r.status > 999) return std::nullopt;
  }
  if (nl != std::string::npos) r.headers = packed.substr(nl + 1);
  return r;
}

}  // namespace keel
