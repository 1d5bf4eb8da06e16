// libFuzzer target for keel/provider/hints.hpp: every parser on arbitrary
// bytes, and a response's headers ("Name: value" lines) through
// response_hints. Beyond the sanitizers' checks it asserts the parsers'
// promises: a wait is never negative and never above max_parsed_hint.
//
// Build and run (clang only): scripts/fuzz, or
//   cmake -S . -B build/fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DKEEL_BUILD_FUZZERS=ON
//   cmake --build build/fuzz --target keel_hints_fuzz
//   build/fuzz/tests/fuzz/keel_hints_fuzz -max_total_time=20 <scratch dir> tests/fuzz/corpus/hints
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string_view>

#include "keel/provider/hints.hpp"

namespace {

void check(std::optional<keel::duration> d) {
  if (d && (*d < keel::duration::zero() || *d > keel::http::max_parsed_hint)) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace http = keel::http;
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  // A fixed "now" keeps runs reproducible.
  const http::wall_time now{std::chrono::seconds(1'700'000'000)};

  check(http::parse_delay_ms(in));
  check(http::parse_retry_after(in, now));
  check(http::parse_go_duration(in));
  check(http::find_retry_delay(in));
  if (auto t = http::parse_rfc3339(in)) check(http::detail::until(*t, now));
  if (auto t = http::parse_http_date(in)) check(http::detail::until(*t, now));
  (void)http::parse_should_retry(in);

  http::response_hints hints;
  std::string_view rest = in;
  while (!rest.empty()) {
    const std::size_t eol = rest.find('\n');
    const std::string_view line = rest.substr(0, eol);
    rest = eol == std::string_view::npos ? std::string_view{} : rest.substr(eol + 1);
    const std::size_t colon = line.find(':');
    if (colon != std::string_view::npos) hints.on_header(line.substr(0, colon), line.substr(colon + 1), now);
  }
  for (int status : {429, 503}) check(hints.hint(status));
  if (size >= 2) {
    const int status = data[0] * 4 + (data[1] & 3);  // 0..1023
    const keel::outcome_kind k = http::classify_http(status, {.effect = keel::effect::write}, hints.should_retry());
    if ((status >= 200 && status < 300) != (k == keel::outcome_kind::success)) std::abort();
  }
  return 0;
}
