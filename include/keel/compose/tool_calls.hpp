// keel/compose/tool_calls.hpp — tool (function) calls as a model streams
// them, and a small helper that puts them back together.
//
// OpenAI-compatible providers stream a tool call as fragments of
// `choices[0].delta.tool_calls[]`: the first fragment of a call carries its
// `index`, `id`, `type` and `function.name`, the ones after it only the
// `index` and a piece of `function.arguments` (JSON text, cut anywhere,
// mid-string included). Parallel calls interleave, told apart by `index`.
//
// keel::tool_call_delta is one fragment as it arrived (views, valid while
// it is handed over: keel/provider/sse.hpp reads them, keel::stream_writer
// carries them to the caller). keel::tool_call_assembler collects fragments
// into whole calls: a call's id, type and name from its first fragment that
// has them, its arguments the fragments' text joined in order. Calls are kept
// in index order, whatever order they were started in.
//
// Example:
//
//   keel::tool_call_assembler calls;
//   calls.add({.index = 0, .id = "call_1", .type = "function", .name = "get_weather", .arguments = ""});
//   calls.add({.index = 0, .arguments = "{\"city\":"});
//   calls.add({.index = 0, .arguments = "\"Paris\"}"});
//   // calls.calls()[0].arguments == "{\"city\":\"Paris\"}"
//
// The assembler allocates when a call is first seen and when a call's
// arguments outgrow their buffer (doubling); clear() keeps the buffers.
// Nothing here checks that the arguments are valid JSON: the caller parses
// them once the call is complete (the stream's finish_reason "tool_calls").
//
// Thread-safety: a tool_call_assembler belongs to one stream; const
// operations may run concurrently with each other.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace keel {

// One fragment of a streamed tool call. Views: valid while handed over.
struct tool_call_delta {
  std::int64_t index = 0;        // which call of the message (parallel calls interleave)
  std::string_view id{};         // the call's id ("call_..."), on its first fragment
  std::string_view type{};       // "function", on its first fragment
  std::string_view name{};       // function.name, on its first fragment
  std::string_view arguments{};  // a piece of function.arguments
};

// One tool call, whole (or as far as it came).
struct tool_call {
  std::int64_t index = 0;
  std::string id;
  std::string type;
  std::string name;
  std::string arguments;  // the JSON text of the arguments, as the model wrote it

  friend bool operator==(const tool_call&, const tool_call&) = default;
};

class tool_call_assembler {
 public:
  // Adds one fragment to its call (started if this index is new).
  void add(const tool_call_delta& d) {
    // Most fragments: more arguments for the call being streamed.
    if (!calls_.empty() && calls_.back().index == d.index && d.id.empty() && d.type.empty() && d.name.empty())
        [[likely]] {
      calls_.back().arguments.append(d.arguments.data(), d.arguments.size());
      return;
    }
    tool_call& c = find(d.index);
    // Set once: some servers repeat the id and name on every fragment.
    if (c.id.empty() && !d.id.empty()) c.id.assign(d.id.data(), d.id.size());
    if (c.type.empty() && !d.type.empty()) c.type.assign(d.type.data(), d.type.size());
    if (c.name.empty() && !d.name.empty()) c.name.assign(d.name.data(), d.name.size());
    c.arguments.append(d.arguments.data(), d.arguments.size());
  }

  // The calls so far, in index order.
  [[nodiscard]] const std::vector<tool_call>& calls() const noexcept { return calls_; }
  [[nodiscard]] bool empty() const noexcept { return calls_.empty(); }

  // Hands the calls over, leaving the assembler empty.
  [[nodiscard]] std::vector<tool_call> take() noexcept { return std::exchange(calls_, {}); }
  void clear() noexcept { calls_.clear(); }

 private:
  tool_call& find(std::int64_t index) {
    // A message has a handful of calls: a linear scan from the back (the
    // call being streamed) beats any map.
    for (std::size_t i = calls_.size(); i-- > 0;) {
      if (calls_[i].index == index) return calls_[i];
    }
    std::size_t at = calls_.size();
    while (at > 0 && calls_[at - 1].index > index) --at;
    tool_call& c = *calls_.insert(calls_.begin() + static_cast<std::ptrdiff_t>(at), tool_call{});
    c.index = index;
    return c;
  }

  std::vector<tool_call> calls_;
};

}  // namespace keel
