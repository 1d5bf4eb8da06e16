// libFuzzer target for the gateway's request parsing
// (examples/gateway/http_request.hpp, gateway::http_request_parser: Boost.Beast's
// request parser with the front door's checks around it) on arbitrary bytes.
// Beyond the sanitizers' checks it asserts the framing's promises: the
// outcome does not depend on how the bytes are split into reads (the first
// input byte picks the split; the adapter buffers what Beast leaves
// unconsumed), a complete request's body is within the limit, no header
// keeps a NUL or another control byte, and a refusal carries a 4xx/5xx
// status and a reason.
//
// Build and run (clang only): scripts/fuzz, or
//   cmake -S . -B build/fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DKEEL_BUILD_FUZZERS=ON
//   cmake --build build/fuzz --target keel_gateway_request_fuzz
//   build/fuzz/tests/fuzz/keel_gateway_request_fuzz -max_total_time=20 <scratch dir> tests/fuzz/corpus/gateway_request
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "http_request.hpp"

namespace {

constexpr std::size_t max_body = 1024, max_head = 512;

struct outcome {
  gateway::http_request_parser::state state;
  std::size_t consumed = 0;
  std::string summary;
};

outcome parse(std::string_view in, std::size_t step) {
  gateway::http_request_parser p(max_body, max_head);
  outcome o{};
  while (o.consumed < in.size() && (p.current() == gateway::http_request_parser::state::head ||
                                    p.current() == gateway::http_request_parser::state::body)) {
    const std::string_view piece = in.substr(o.consumed, step);
    const std::size_t used = p.feed(piece);
    if (used > piece.size()) std::abort();
    o.consumed += used;
    if (used < piece.size()) break;  // the rest is the next request's (or the parser refused)
  }
  o.state = p.current();
  const gateway::http_request& r = p.request();
  if (o.state == gateway::http_request_parser::state::done) {
    if (r.body.size() > max_body) std::abort();
    o.summary = r.method + ' ' + r.target + ' ' + r.version + ' ' + (r.keep_alive ? "k" : "c") + '\n';
    for (const auto& [n, v] : r.headers) {
      for (char c : v) {  // a NUL or another control byte in a header is refused, never kept
        const auto u = static_cast<unsigned char>(c);
        if ((u < 0x20 && c != '\t') || u == 0x7f) std::abort();
      }
      o.summary += n + ':' + v + '\n';
    }
    o.summary += r.body;
  } else if (o.state == gateway::http_request_parser::state::failed) {
    const gateway::http_refusal& e = p.error();
    if (e.status < 400 || e.status > 599 || e.reason.empty() || e.message.empty()) std::abort();
    o.summary = std::to_string(e.status) + ' ' + e.reason;
  }
  return o;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::size_t step = 1 + data[0] % 17;
  const std::string_view in(reinterpret_cast<const char*>(data) + 1, size - 1);
  const outcome whole = parse(in, in.size() + 1);
  const outcome split = parse(in, step);
  if (whole.state != split.state || whole.summary != split.summary) std::abort();
  // Bytes after a complete request are left for the next one, whatever the split.
  if (whole.state == gateway::http_request_parser::state::done && whole.consumed != split.consumed) std::abort();
  return 0;
}
