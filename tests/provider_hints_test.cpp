// The hint parsers and the status table (keel/provider/hints.hpp) on header
// values as providers send them.
#include "keel/provider/hints.hpp"

#include <chrono>
#include <optional>

#include "support/catch.hpp"

using namespace std::chrono_literals;
namespace http = keel::http;

namespace {

// 2015-10-21 07:28:00 UTC, the date in RFC 9110's Retry-After example.
http::wall_time oct21() {
  using namespace std::chrono;
  return time_point_cast<http::wall_time::duration>(sys_days{year{2015} / October / 21} + 7h + 28min);
}

}  // namespace

TEST_CASE("retry-after-ms: integer and fractional milliseconds", "[provider][hints]") {
  CHECK(http::parse_delay_ms("1500") == 1500ms);
  CHECK(http::parse_delay_ms(" 20 ") == 20ms);
  CHECK(http::parse_delay_ms("0.5") == 500us);
  CHECK(http::parse_delay_ms("0") == keel::duration::zero());
  CHECK_FALSE(http::parse_delay_ms("").has_value());
  CHECK_FALSE(http::parse_delay_ms("-5").has_value());
  CHECK_FALSE(http::parse_delay_ms("12ms").has_value());
  CHECK_FALSE(http::parse_delay_ms("abc").has_value());
  // Absurd values saturate instead of overflowing.
  CHECK(http::parse_delay_ms("99999999999999999999999") == http::max_parsed_hint);
}

TEST_CASE("Retry-After: delay-seconds and the three HTTP-date forms", "[provider][hints]") {
  const http::wall_time now = oct21();
  CHECK(http::parse_retry_after("120", now) == 120s);
  CHECK(http::parse_retry_after("0", now) == 0s);
  CHECK(http::parse_retry_after("1.5", now) == 1500ms);
  CHECK(http::parse_retry_after("Wed, 21 Oct 2015 07:28:20 GMT", now) == 20s);
  CHECK(http::parse_retry_after("Wednesday, 21-Oct-15 07:28:30 GMT", now) == 30s);
  CHECK(http::parse_retry_after("Wed Oct 21 07:29:00 2015", now) == 60s);
  CHECK(http::parse_retry_after("Wed Oct  1 07:29:00 2015", now) == keel::duration::zero());  // in the past
  CHECK(http::parse_retry_after("Tue, 20 Oct 2015 07:28:00 GMT", now) == keel::duration::zero());
  CHECK_FALSE(http::parse_retry_after("Wed, 32 Oct 2015 07:28:00 GMT", now).has_value());
  CHECK_FALSE(http::parse_retry_after("Wed, 21 Foo 2015 07:28:00 GMT", now).has_value());
  CHECK_FALSE(http::parse_retry_after("Wed, 21 Oct 2015 07:28:00 CET", now).has_value());
  CHECK_FALSE(http::parse_retry_after("soon", now).has_value());
  CHECK_FALSE(http::parse_retry_after("-1", now).has_value());
  CHECK_FALSE(http::parse_retry_after("", now).has_value());
}

TEST_CASE("x-ratelimit-reset-*: Go durations as OpenAI sends them", "[provider][hints]") {
  CHECK(http::parse_go_duration("1s") == 1s);
  CHECK(http::parse_go_duration("6m0s") == 6min);
  CHECK(http::parse_go_duration("20ms") == 20ms);
  CHECK(http::parse_go_duration("1h2m3.5s") == 3723500ms);
  CHECK(http::parse_go_duration("0.5s") == 500ms);
  CHECK(http::parse_go_duration("7.66s") == 7660ms);
  CHECK(http::parse_go_duration("250us") == 250us);
  CHECK(http::parse_go_duration("250\xC2\xB5s") == 250us);
  CHECK(http::parse_go_duration("10ns") == 10ns);
  CHECK(http::parse_go_duration("0") == keel::duration::zero());
  CHECK_FALSE(http::parse_go_duration("").has_value());
  CHECK_FALSE(http::parse_go_duration("5").has_value());
  CHECK_FALSE(http::parse_go_duration("-1s").has_value());
  CHECK_FALSE(http::parse_go_duration("1x").has_value());
  CHECK_FALSE(http::parse_go_duration("s").has_value());
  CHECK_FALSE(http::parse_go_duration("1.2.3s").has_value());
}

TEST_CASE("anthropic-ratelimit-*-reset: RFC 3339 times", "[provider][hints]") {
  const http::wall_time t = oct21();
  CHECK(http::parse_rfc3339("2015-10-21T07:28:00Z") == t);
  CHECK(http::parse_rfc3339("2015-10-21T07:28:30.25Z") == t + 30250ms);
  CHECK(http::parse_rfc3339("2015-10-21T09:28:00+02:00") == t);
  CHECK(http::parse_rfc3339("2015-10-21t07:28:00z") == t);
  CHECK(http::parse_rfc3339("2015-10-21 07:28:00-00:30") == t + 30min);
  CHECK_FALSE(http::parse_rfc3339("2015-10-21T07:28:00").has_value());
  CHECK_FALSE(http::parse_rfc3339("2015-02-30T07:28:00Z").has_value());
  CHECK_FALSE(http::parse_rfc3339("2015-10-21T24:00:00Z").has_value());
  CHECK_FALSE(http::parse_rfc3339("2015-10-21T07:28:00.Z").has_value());
  // Found by the fuzzer: a year past what system_clock's nanoseconds hold.
  CHECK_FALSE(http::parse_rfc3339("4048-05-01T12:00:30Z").has_value());
  CHECK_FALSE(http::parse_http_date("Fri, 01 May 9999 12:00:30 GMT").has_value());
}

TEST_CASE("x-should-retry and a JSON body's retryDelay", "[provider][hints]") {
  CHECK(http::parse_should_retry("true") == true);
  CHECK(http::parse_should_retry("False") == false);
  CHECK_FALSE(http::parse_should_retry("yes").has_value());

  // Gemini's 429 body, shortened.
  CHECK(http::find_retry_delay(R"({"error":{"code":429,"status":"RESOURCE_EXHAUSTED","details":[)"
                               R"({"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay": "38s"}]}})") == 38s);
  CHECK(http::find_retry_delay(R"({"retryDelay":"1.5s"})") == 1500ms);
  CHECK(http::find_retry_delay("{\"retryDelay\" :\n \"0.25s\"}") == 250ms);
  CHECK_FALSE(http::find_retry_delay(R"({"retryDelay":3})").has_value());
  CHECK_FALSE(http::find_retry_delay(R"({"retryDelay":"3m"})").has_value());
  CHECK_FALSE(http::find_retry_delay(R"({"retryDelay":"3s)").has_value());
  CHECK_FALSE(http::find_retry_delay("").has_value());
  // A malformed first one does not hide a good second one.
  CHECK(http::find_retry_delay(R"({"retryDelay":"x","retryDelay":"2s"})") == 2s);
}

TEST_CASE("response_hints picks one wait in a documented order", "[provider][hints]") {
  const http::wall_time now = oct21();
  SECTION("retry-after-ms wins over Retry-After") {
    http::response_hints h;
    h.on_header("Retry-After", "2", now);
    h.on_header("retry-after-ms", "1500", now);
    CHECK(h.hint(429) == 1500ms);
    CHECK(h.hint(503) == 1500ms);
  }
  SECTION("OpenAI resets on a 429: the exhausted limit's reset") {
    http::response_hints h;
    h.on_header("x-ratelimit-limit-requests", "60", now);
    h.on_header("x-ratelimit-remaining-requests", "59", now);
    h.on_header("x-ratelimit-reset-requests", "1s", now);
    h.on_header("X-RateLimit-Remaining-Tokens", "0", now);
    h.on_header("x-ratelimit-reset-tokens", "6m0s", now);
    CHECK(h.hint(429) == 6min);
    CHECK_FALSE(h.hint(503).has_value());  // resets describe quotas, not an outage
  }
  SECTION("without remaining counts, the earliest reset") {
    http::response_hints h;
    h.on_header("x-ratelimit-reset-requests", "20ms", now);
    h.on_header("x-ratelimit-reset-tokens", "6m0s", now);
    CHECK(h.hint(429) == 20ms);
  }
  SECTION("Anthropic resets are times") {
    http::response_hints h;
    h.on_header("anthropic-ratelimit-requests-remaining", "0", now);
    h.on_header("anthropic-ratelimit-requests-reset", "2015-10-21T07:28:05Z", now);
    h.on_header("anthropic-ratelimit-tokens-reset", "2015-10-21T07:28:01Z", now);
    CHECK(h.hint(429) == 5s);
  }
  SECTION("x-should-retry is kept, nothing else read") {
    http::response_hints h;
    h.on_header("x-should-retry", " false\r\n", now);
    h.on_header("content-type", "application/json", now);
    CHECK(h.should_retry() == false);
    CHECK_FALSE(h.hint(429).has_value());
  }
}

TEST_CASE("HTTP status table", "[provider][hints]") {
  const keel::operation read{};
  const keel::operation write{.effect = keel::effect::write};
  using k = keel::outcome_kind;
  CHECK(http::classify_http(200, write) == k::success);
  CHECK(http::classify_http(204, write) == k::success);
  CHECK(http::classify_http(429, write) == k::throttled);
  for (int code : {408, 409, 502, 503, 504, 529}) {
    INFO(code);
    CHECK(http::classify_http(code, write) == k::transient);
  }
  CHECK(http::classify_http(500, read) == k::transient);
  CHECK(http::classify_http(500, write) == k::ambiguous);
  for (int code : {400, 401, 403, 404, 422, 501, 418}) {
    INFO(code);
    CHECK(http::classify_http(code, read) == k::permanent);
  }
  CHECK(http::classify_http(400, read, true) == k::transient);
  CHECK(http::classify_http(429, read, true) == k::throttled);
  CHECK(http::classify_http(503, read, false) == k::permanent);

  // The absl codes agree with keel::default_classifier.
  for (int code : {200, 400, 401, 403, 404, 408, 409, 422, 429, 500, 501, 502, 503, 504, 529}) {
    for (const keel::operation& op : {read, write}) {
      INFO(code);
      const absl::StatusCode c = http::http_status_code(code);
      const absl::Status s = c == absl::StatusCode::kOk ? absl::OkStatus() : absl::Status(c, "x");
      CHECK(keel::default_classifier{}(s, op) == http::classify_http(code, op));
    }
  }
}

TEST_CASE("an RFC 850 date's two-digit year is read relative to now (RFC 9110 §5.6.7), not by a fixed cutoff",
          "[provider][hints]") {
  using namespace std::chrono;
  auto at = [](int y, unsigned m, unsigned d) { return keel::http::wall_time(sys_days{year{y} / m / d}); };
  const keel::http::wall_time now = at(2026, 12, 7);
  // This century unless that is more than 50 years ahead.
  CHECK(http::parse_http_date("Sunday, 06-Nov-94 08:49:37 GMT", now) == at(1994, 11, 6) + 8h + 49min + 37s);
  CHECK(http::parse_http_date("Thursday, 01-Jan-70 00:00:00 GMT", now) == at(2070, 1, 1));  // a fixed 70 cutoff: 1970
  CHECK(http::parse_http_date("Monday, 07-Dec-76 00:00:00 GMT", now) == at(2076, 12, 7));  // exactly 50 years: not more
  CHECK(http::parse_http_date("Tuesday, 08-Dec-76 00:00:00 GMT", now) == at(1976, 12, 8));  // a day more than 50
  CHECK(http::parse_http_date("Monday, 07-Dec-26 00:00:00 GMT", now) == at(2026, 12, 7));
  // Relative to now: in 2069, "-70" is next year, so a Retry-After in it is a wait, not "already passed".
  const keel::http::wall_time late = at(2069, 12, 31) + 23h + 59min;
  CHECK(http::parse_retry_after("Tuesday, 01-Jan-70 00:00:30 GMT", late) == 90s);
  // And in 2130, "-94" is 2094, "-99" 2099 (a fixed cutoff would say 1994 and 1999).
  CHECK(http::parse_http_date("Sunday, 06-Nov-94 08:49:37 GMT", at(2130, 1, 1)) == at(2094, 11, 6) + 8h + 49min + 37s);
  CHECK_FALSE(http::parse_http_date("Monday, 30-Feb-26 00:00:00 GMT", now).has_value());
}
