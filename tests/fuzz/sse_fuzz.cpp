// libFuzzer target for keel/provider/sse.hpp: arbitrary bytes as an event
// stream body. Beyond the sanitizers' checks it asserts the parser's
// promise that the read sizes do not matter: the body fed whole and fed in
// pieces (sizes drawn from the input's first byte) gives the same chunks,
// kinds, texts and usage, in the same order; and that the shape cache
// (sse_options::shape_cache) is exact: with it off, both ways, every
// field of every chunk (the event's data included) is the same. Tool-call
// fragments and refusals are compared too, and a tool-call fragment's
// unescaped strings never overlap one another (each has its own bytes).
//
// Build and run (clang only): scripts/fuzz, or
//   cmake -S . -B build/fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DKEEL_BUILD_FUZZERS=ON
//   cmake --build build/fuzz --target keel_sse_fuzz
//   build/fuzz/tests/fuzz/keel_sse_fuzz -max_total_time=20 <scratch dir> tests/fuzz/corpus/sse
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "keel/provider/sse.hpp"

namespace {

struct seen {
  keel::chunk_kind kind;
  std::string text;
  std::string finish;
  std::int64_t completion;
  bool has_usage;
  std::int64_t prompt;
  std::int64_t total;
  std::string error_type;
  std::int64_t error_code;
  std::string data;
  std::string refusal;
  std::string tools;  // each fragment's index, id, type, name and arguments
  std::string error_code_name;
  std::string event;
  bool operator==(const seen&) const = default;
};

std::vector<seen> parse(std::string_view body, std::size_t piece, bool& failed, bool shape_cache) {
  keel::sse_parser p({.max_event_bytes = 4096, .shape_cache = shape_cache});
  std::vector<seen> out;
  auto on = [&](const keel::chat_chunk& c) {
    if (c.kind == keel::chunk_kind::error) (void)keel::error_status(c);
    if (c.kind == keel::chunk_kind::content && c.text.empty()) std::abort();  // empty content is not a token
    if (c.kind == keel::chunk_kind::tool_call && c.tool_calls.empty()) std::abort();
    if (c.kind == keel::chunk_kind::error && c.error_code < 0) std::abort();  // 0 is "no numeric code"
    std::string tools;
    for (const keel::tool_call_delta& d : c.tool_calls) {
      tools += std::to_string(d.index);
      for (std::string_view f : {d.id, d.type, d.name, d.arguments}) tools.append("|").append(f);
      tools += "\n";
    }
    out.push_back({c.kind, std::string(c.text), std::string(c.finish_reason), c.usage.completion_tokens, c.has_usage,
                   c.usage.prompt_tokens, c.usage.total_tokens, std::string(c.error_type), c.error_code,
                   std::string(c.data), std::string(c.refusal), std::move(tools), std::string(c.error_code_name),
                   std::string(c.event)});
    return true;
  };
  failed = false;
  for (std::size_t i = 0; i < body.size(); i += piece) {
    if (!p.feed(body.substr(i, piece), on).ok()) {
      failed = true;
      break;
    }
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::size_t piece = 1 + data[0] % 17;
  const std::string_view body(reinterpret_cast<const char*>(data) + 1, size - 1);
  bool whole_failed = false, split_failed = false, full_whole_failed = false, full_split_failed = false;
  const std::vector<seen> whole = parse(body, body.size() + 1, whole_failed, true);
  const std::vector<seen> split = parse(body, piece, split_failed, true);
  const std::vector<seen> full_whole = parse(body, body.size() + 1, full_whole_failed, false);
  const std::vector<seen> full_split = parse(body, piece, full_split_failed, false);
  // An over-long event fails both ways; what came before it is the same.
  if (whole_failed != split_failed) std::abort();
  if (!whole_failed && whole != split) std::abort();
  // The shape cache changes nothing, failures included.
  if (whole_failed != full_whole_failed || split_failed != full_split_failed) std::abort();
  if (whole != full_whole || split != full_split) std::abort();
  return 0;
}
