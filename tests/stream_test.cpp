// Streams (keel/compose/stream.hpp, keel/provider/sse.hpp): the SSE parser
// on real stream shapes, the stream policy's budgets, commit point, partial
// answers, continuation, first-token hedge and cancellation on the manual
// clock, and the libcurl adapter against a scripted SSE server.
#include "keel/compose/stream.hpp"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

#include "keel/compose/executor.hpp"
#include "keel/compose/pipeline.hpp"
#include "keel/compose/token_estimate.hpp"
#include "keel/core/call.hpp"
#include "keel/policy/admission.hpp"
#include "keel/policy/backoff.hpp"
#include "keel/policy/retry.hpp"
#include "keel/policy/retry_budget.hpp"
#include "keel/observe/metrics.hpp"
#include "keel/observe/slo.hpp"
#include "keel/observe/stream_slo.hpp"
#include "keel/provider/sse.hpp"
#include "keel/testing/manual_clock.hpp"
#include "keel/testing/scripted_stream.hpp"
#include "support/alloc_counter.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;
using keel::testing::end;
using keel::testing::manual_clock;
using keel::testing::tok;

namespace {

std::string chunk(std::string_view content) {
  return "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{"
         "\"content\":\"" +
         std::string(content) + "\"},\"finish_reason\":null}]}\n\n";
}

// A recorded stream's shape: role chunk, keep-alive, tokens (one with
// escapes), a finish chunk, the usage chunk, [DONE]. CR LF line ends.
std::string recorded_stream() {
  std::string s =
      ": OPENROUTER PROCESSING\r\n\r\n"
      "data: {\"id\":\"chatcmpl-1\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},"
      "\"finish_reason\":null}]}\r\n\r\n";
  for (std::string_view t : {"The", " quick", " \\\"brown\\\"", " fox\\n", " \\u00e9t\\u00e9"}) {
    std::string c = chunk(t);
    c.replace(c.size() - 2, 2, "\r\n\r\n");
    s += c;
  }
  s += "data: {\"id\":\"chatcmpl-1\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\r\n\r\n";
  s += "data: {\"id\":\"chatcmpl-1\",\"choices\":[],\"usage\":{\"prompt_tokens\":11,\"completion_tokens\":5,"
       "\"total_tokens\":16}}\r\n\r\n";
  s += "data: [DONE]\r\n\r\n";
  return s;
}

struct parsed {
  std::string text;
  std::vector<keel::chunk_kind> kinds;
  keel::token_usage usage;
  std::string error;
  absl::Status status;
};

parsed parse_in_pieces(std::string_view body, std::size_t piece) {
  keel::sse_parser p;
  parsed out;
  auto on = [&](const keel::chat_chunk& c) {
    out.kinds.push_back(c.kind);
    if (c.kind == keel::chunk_kind::content) out.text.append(c.text);
    if (c.has_usage) out.usage = c.usage;
    if (c.kind == keel::chunk_kind::error) out.error = std::string(c.text);
    return true;
  };
  for (std::size_t i = 0; i < body.size() && out.status.ok(); i += piece)
    out.status = p.feed(body.substr(i, piece), on);
  return out;
}

int count(const std::vector<keel::chunk_kind>& kinds, keel::chunk_kind k) {
  return static_cast<int>(std::count(kinds.begin(), kinds.end(), k));
}

}  // namespace

// --- the parser ---------------------------------------------------------------

TEST_CASE("sse: a recorded stream reads the same whatever the read sizes, CR LF split included", "[stream][sse]") {
  const std::string body = recorded_stream();
  const parsed whole = parse_in_pieces(body, body.size());
  REQUIRE(whole.status.ok());
  CHECK(whole.text == "The quick \"brown\" fox\n \xc3\xa9t\xc3\xa9");
  CHECK(count(whole.kinds, keel::chunk_kind::content) == 5);
  CHECK(count(whole.kinds, keel::chunk_kind::role) == 1);
  CHECK(count(whole.kinds, keel::chunk_kind::keepalive) == 1);
  CHECK(count(whole.kinds, keel::chunk_kind::usage) == 1);
  CHECK(count(whole.kinds, keel::chunk_kind::done) == 1);
  CHECK(whole.usage.completion_tokens == 5);
  CHECK(whole.usage.prompt_tokens == 11);
  CHECK(whole.usage.total_tokens == 16);
  for (std::size_t piece : {1, 2, 3, 7, 64}) {
    const parsed p = parse_in_pieces(body, piece);
    INFO("piece " << piece);
    CHECK(p.status.ok());
    CHECK(p.text == whole.text);
    CHECK(p.kinds == whole.kinds);
  }
}

TEST_CASE("sse: multi-line data is joined by newlines; bare CR ends lines; comments and unknown fields are skipped",
          "[stream][sse]") {
  const std::string body =
      "id: 7\nretry: 100\n: comment\n"
      "data: {\"choices\":[{\"delta\":\n"
      "data: {\"content\":\"a\"}}]}\n\n"
      "data: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\r\r"
      "event: ignored\n\n";  // no data: not dispatched
  const parsed p = parse_in_pieces(body, 5);
  REQUIRE(p.status.ok());
  CHECK(p.text == "ab");
  CHECK(p.kinds == std::vector<keel::chunk_kind>{keel::chunk_kind::keepalive, keel::chunk_kind::content,
                                                 keel::chunk_kind::content});
}

TEST_CASE("sse: role-only deltas, empty content, null content and no choices are not tokens", "[stream][sse]") {
  const std::string body =
      "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n"
      "data: {\"choices\":[{\"delta\":{\"content\":\"\"}}]}\n\n"
      "data: {\"choices\":[{\"delta\":{\"content\":null}}]}\n\n"
      "data: {\"choices\":[]}\n\n"
      "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"length\"}],\"usage\":null}\n\n";
  const parsed p = parse_in_pieces(body, 4);
  REQUIRE(p.status.ok());
  CHECK(p.text.empty());
  CHECK(count(p.kinds, keel::chunk_kind::content) == 0);
  CHECK(count(p.kinds, keel::chunk_kind::role) == 1);
  CHECK(count(p.kinds, keel::chunk_kind::empty) == 4);
}

TEST_CASE("sse: an error object mid-stream is an error chunk with a classified status", "[stream][sse]") {
  const std::string body = chunk("Hi") +
                           "data: {\"error\":{\"message\":\"Rate limit reached\",\"type\":\"rate_limit_error\"}}\n\n" +
                           "event: error\ndata: {\"message\":\"overloaded\",\"code\":503}\n\n" +
                           "event: error\ndata: not json\n\n" + "data: {not json}\n\n";
  keel::sse_parser parser;
  std::vector<keel::chat_chunk> chunks;
  std::vector<absl::Status> statuses;
  REQUIRE(parser
              .feed(body,
                    [&](const keel::chat_chunk& c) {
                      chunks.push_back(c);
                      if (c.kind == keel::chunk_kind::error) statuses.push_back(keel::error_status(c));
                      return true;
                    })
              .ok());
  REQUIRE(chunks.size() == 5);
  CHECK(chunks[1].kind == keel::chunk_kind::error);
  CHECK(absl::IsResourceExhausted(statuses[0]));
  CHECK(chunks[2].kind == keel::chunk_kind::error);  // event: error, no "error" key
  CHECK(absl::IsUnavailable(statuses[1]));
  CHECK(chunks[3].kind == keel::chunk_kind::error);  // event: error, not JSON: the data is the message
  CHECK(chunks[4].kind == keel::chunk_kind::invalid);
  keel::chat_chunk bad;
  bad.error_code = 400;
  CHECK(absl::IsInvalidArgument(keel::error_status(bad)));
}

TEST_CASE("sse: [DONE] ends the stream; an over-long event fails the parse; a false callback stops it",
          "[stream][sse]") {
  keel::sse_parser p({.max_event_bytes = 64});
  int seen = 0;
  auto on = [&](const keel::chat_chunk&) { return ++seen < 2; };
  REQUIRE(p.feed("data: [DONE]\n\n", on).ok());
  CHECK(p.done());
  REQUIRE(p.feed("data: [DONE]\n\ndata: [DONE]\n\n", on).ok());
  CHECK(seen == 2);  // stopped after the second
  p.reset();
  CHECK_FALSE(p.done());
  const absl::Status s = p.feed("data: " + std::string(100, 'x'), on);
  CHECK(absl::IsOutOfRange(s));
  CHECK_THROWS_AS(keel::sse_parser({.max_event_bytes = 0}), keel::invalid_options);
}

TEST_CASE("sse: parsing a stream allocates nothing per token once its buffers have grown", "[stream][sse][alloc]") {
  if (!keel_test::allocations_counted()) {
    SUCCEED("allocation counting is off in this build");
    return;
  }
  keel::sse_parser p;
  std::string body;
  for (int i = 0; i < 200; ++i) body += chunk(i % 2 == 0 ? "word" : "w\\u00f6rd");
  std::size_t bytes = 0;
  auto on = [&](const keel::chat_chunk& c) {
    bytes += c.text.size();
    return true;
  };
  // Warm-up, read as the rest will be (lines split across reads): the buffers grow.
  for (std::size_t i = 0; i < 37 * 40; i += 37) REQUIRE(p.feed(std::string_view(body).substr(i, 37), on).ok());
  keel_test::count_allocations allocations;
  for (std::size_t i = 37 * 40; i < body.size(); i += 37)
    REQUIRE(p.feed(std::string_view(body).substr(i, 37), on).ok());
  CHECK(allocations.count() == 0);
  CHECK(bytes > 0);
}

// --- the shape cache: exact, checked against the full read ------------------

namespace {

// Every field of a chunk, copied (views die with the callback).
struct seen_chunk {
  keel::chunk_kind kind;
  std::string text, finish, error_type, data;
  bool has_usage;
  std::int64_t prompt, completion, total, error_code;
  std::string tools;  // each tool-call fragment: index|id|type|name|arguments
  bool operator==(const seen_chunk&) const = default;
};

struct seen_stream {
  std::vector<seen_chunk> chunks;
  bool failed = false;
  std::size_t hits = 0;
  bool operator==(const seen_stream& o) const { return chunks == o.chunks && failed == o.failed; }
};

// Feeds `body` cut at the given offsets (ascending, within the body).
seen_stream read_cut(std::string_view body, const std::vector<std::size_t>& cuts, bool cache,
                     std::size_t max_event = std::size_t{1} << 20) {
  keel::sse_parser p({.max_event_bytes = max_event, .shape_cache = cache});
  seen_stream out;
  auto on = [&](const keel::chat_chunk& c) {
    std::string tools;
    for (const keel::tool_call_delta& d : c.tool_calls) {
      tools += std::to_string(d.index);
      for (std::string_view f : {d.id, d.type, d.name, d.arguments}) tools.append("|").append(f);
      tools += "\n";
    }
    out.chunks.push_back({c.kind, std::string(c.text), std::string(c.finish_reason), std::string(c.error_type),
                          std::string(c.data), c.has_usage, c.usage.prompt_tokens, c.usage.completion_tokens,
                          c.usage.total_tokens, c.error_code, std::move(tools)});
    return true;
  };
  std::size_t at = 0;
  auto feed = [&](std::size_t to) {
    if (!out.failed && to > at && !p.feed(body.substr(at, to - at), on).ok()) out.failed = true;
    at = to;
  };
  for (std::size_t cut : cuts) feed(cut);
  feed(body.size());
  out.hits = p.shape_cache_hits();
  return out;
}

seen_stream read_pieces(std::string_view body, std::size_t piece, bool cache,
                        std::size_t max_event = std::size_t{1} << 20) {
  std::vector<std::size_t> cuts;
  for (std::size_t i = piece; i < body.size(); i += piece) cuts.push_back(i);
  return read_cut(body, cuts, cache, max_event);
}

const std::string kHead =
    "{\"id\":\"chatcmpl-AbC\",\"object\":\"chat.completion.chunk\",\"created\":1733200000,\"model\":\"gpt-4o-mini\","
    "\"system_fingerprint\":\"fp_0\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"";
const std::string kTail = "\"},\"logprobs\":null,\"finish_reason\":null}]}";

std::string content_event(std::string_view raw, std::string_view head = kHead, std::string_view tail = kTail) {
  return "data: " + std::string(head) + std::string(raw) + std::string(tail) + "\n\n";
}

// The streams the cache must read exactly as the full parser does.
std::vector<std::string> shape_streams() {
  std::vector<std::string> out;
  const std::string role =
      "data: {\"id\":\"chatcmpl-AbC\",\"object\":\"chat.completion.chunk\",\"created\":1733200000,\"model\":\"gpt-4o-"
      "mini\",\"system_fingerprint\":\"fp_0\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":"
      "\"\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n";
  const std::string finish =
      "data: {\"id\":\"chatcmpl-AbC\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n";
  const std::string usage =
      "data: {\"id\":\"chatcmpl-AbC\",\"choices\":[],\"usage\":{\"prompt_tokens\":20,\"completion_tokens\":9,"
      "\"total_tokens\":29}}\n\n";
  // 1. The recorded shape: role, tokens (some escaped), a keep-alive, finish, usage, [DONE].
  {
    std::string s = ": OPENROUTER PROCESSING\n\n" + role;
    int i = 0;
    for (std::string_view t : {"The", " quick", " caf\\u00e9", "\\n", " \\\"brown\\\"", " fox", ",", " a", " b"}) {
      s += content_event(t);
      if (++i == 4) s += ": keep-alive\n\n";
    }
    out.push_back(s + finish + usage + "data: [DONE]\n\n");
  }
  // 2. The id changes mid-stream, and back.
  {
    std::string other = kHead;
    other.replace(other.find("AbC"), 3, "XyZ");
    out.push_back(content_event("a") + content_event("b") + content_event("c", other) + content_event("d", other) +
                  content_event("e") + content_event("f"));
  }
  // 3. Escapes: \" \\ \/ \u, a surrogate pair, a lone surrogate, a backslash
  //    before the closing quote, and bad escapes (the full read: invalid).
  out.push_back(content_event("x") + content_event("\\\"") + content_event("\\\\") + content_event("a\\\\\\\"b") +
                content_event("\\/\\b\\f\\r\\t") + content_event("\\ud83d\\ude00") + content_event("\\ud83d!") +
                content_event("\\u00") + content_event("\\q") + content_event("\\") + content_event("\\\\\\") +
                content_event("y"));
  // 4. The suffix differs: a finish_reason beside content, usage beside
  //    content, a trailing member, whitespace.
  out.push_back(content_event("a") +
                content_event("b", kHead, "\"},\"logprobs\":null,\"finish_reason\":\"stop\"}]}") +
                content_event("c", kHead, kTail + ",\"usage\":{\"completion_tokens\":3}") +
                content_event("d", kHead, "\"} ,\"logprobs\":null,\"finish_reason\":null}]}") + content_event("e"));
  // 5. The prefix matches, but the middle is not one string body: a raw
  //    quote that ends the string early (invalid; or valid JSON of another
  //    shape: a role member after the content), raw control characters.
  out.push_back(content_event("a") + content_event("b\"c") + content_event("x\",\"role\":\"assistant") +
                content_event("tab\there") + content_event("") + content_event("\x01") + content_event("z"));
  // 6. Role chunks, usage and error objects between tokens; `event: error`
  //    with data shaped like a token; a multi-line event whose data joins to
  //    the cached shape; the same event with a comment and an id inside.
  out.push_back(content_event("a") + role + content_event("b") + usage +
                "data: {\"error\":{\"message\":\"overloaded\",\"type\":\"server_error\",\"code\":503}}\n\n" +
                content_event("c") + "event: error\n" + content_event("d") + content_event("e") + "data: " + kHead +
                "f\ndata: " + kTail + "\n\n" + "id: 7\n: note\n" + content_event("g") + content_event("h"));
  // 7. Other shapes learned: n > 1 choices, a delta with role and content,
  //    message instead of delta, duplicate keys.
  {
    const std::string two = "{\"choices\":[{\"delta\":{\"content\":\"";
    const std::string two_tail = "\"}},{\"delta\":{\"content\":\"other\"}}]}";
    const std::string both = "{\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"";
    const std::string msg = "{\"choices\":[{\"message\":{\"content\":\"";
    const std::string dup = "{\"choices\":[{\"delta\":{\"content\":\"q\",\"content\":\"";
    const std::string dup_choices = "{\"choices\":[{\"delta\":{\"content\":\"q\"}}],\"choices\":[{\"delta\":{\"content\":\"";
    std::string s;
    for (const std::string* h : {&two, &both, &msg, &dup, &dup_choices}) {
      const std::string tail = h == &two ? two_tail : "\"}}]}";
      s += content_event("a", *h, tail) + content_event("b", *h, tail) + content_event("", *h, tail) +
           content_event("c", *h, tail);
    }
    out.push_back(s);
  }
  // 8. CR LF and bare CR line ends, and a blank line of LF after CR LF.
  {
    std::string crlf = out[0], cr = out[0];
    for (std::size_t i = 0; (i = crlf.find('\n', i)) != std::string::npos; i += 2) crlf.replace(i, 1, "\r\n");
    for (char& ch : cr)
      if (ch == '\n') ch = '\r';
    out.push_back(crlf);
    out.push_back(cr);
    out.push_back("data: " + kHead + "a" + kTail + "\r\n\n" + "data: " + kHead + "b" + kTail + "\n\r\n" + "data: " +
                  kHead + "c" + kTail + "\r\n\r\n" + "data:" + kHead + "d" + kTail + "\n\n" + "data: " + kHead + "e" +
                  kTail + "\n\n");
  }
  // 9. No [DONE] and an event left unterminated at the end.
  out.push_back(content_event("a") + content_event("b") + "data: " + kHead + "c" + kTail + "\n");
  // 10. What the bytes after a cut decide (split at every offset, these take
  //     the stash between reads): a line that is the whole cached shape and
  //     then another data line; a suffix that differs in its last bytes
  //     (whitespace: valid, other data; a brace too many: invalid); LF CR LF
  //     after the suffix; CR LF CR then another event (the CR alone is the
  //     blank line); bodies of escapes longer than small reads, one within
  //     the stash and one beyond it.
  {
    std::string escapes;
    for (int i = 0; i < 40; ++i) escapes += "\\u00e9\\\"x\\\\";
    out.push_back(content_event("a") + "data: " + kHead + "b" + kTail + "\ndata: " + kHead + "c" + kTail + "\n\n" +
                  content_event("d") + content_event("e", kHead, kTail + " ") + content_event("f", kHead, kTail + "}") +
                  "data: " + kHead + "g" + kTail + "\n\r\n" + "data: " + kHead + "h" + kTail + "\r\n\r" +
                  content_event("i") + content_event(escapes) + content_event(escapes + escapes) +
                  content_event("j"));
  }
  // 11. The body ends in CR LF CR: the CR alone dispatches the last event.
  out.push_back(content_event("a") + content_event("b") + "data: " + kHead + "c" + kTail + "\r\n\r");
  // 12. Tool calls (the cache also learns a plain argument fragment): one
  //     call's fragments after content, escaped; two calls interleaving by
  //     index (the index is in the cached bytes: the other call is read in
  //     full); a fragment with a name beside its arguments, one with an
  //     empty string, a bad escape, a raw quote; content again after.
  {
    const std::string head =
        "{\"id\":\"chatcmpl-AbC\",\"object\":\"chat.completion.chunk\",\"created\":1733200000,\"model\":\"gpt-4o-mini\","
        "\"system_fingerprint\":\"fp_0\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":";
    auto frag = [&](int index, std::string_view args) {
      return content_event(args, head + std::to_string(index) + ",\"function\":{\"arguments\":\"",
                           "\"}}]},\"logprobs\":null,\"finish_reason\":null}]}");
    };
    const std::string first = content_event(
        "", head + "0,\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"arguments\":\"",
        "\"}}]},\"logprobs\":null,\"finish_reason\":null}]}");
    out.push_back(content_event("a") + first + frag(0, "{\\\"") + frag(0, "city") + frag(0, "\\\":\\\"") +
                  frag(0, "Paris") + frag(0, "\\\"}") + frag(1, "{}") + frag(0, "x") + frag(1, "y") + frag(1, "z") +
                  content_event("", head + "1,\"function\":{\"name\":\"f\",\"arguments\":\"",
                                "\"}}]},\"logprobs\":null,\"finish_reason\":null}]}") +
                  frag(1, "") + frag(1, "\\q") + frag(1, "a\"b") + frag(1, "w") + content_event("b") +
                  content_event("c"));
  }
  return out;
}

}  // namespace

TEST_CASE("sse: the shape cache is exact: every stream reads the same with it off, split at every byte offset",
          "[stream][sse][shape]") {
  const std::vector<std::string> streams = shape_streams();
  std::size_t hits = 0;
  for (std::size_t n = 0; n < streams.size(); ++n) {
    const std::string& body = streams[n];
    INFO("stream " << n);
    const seen_stream reference = read_pieces(body, body.size(), false);
    REQUIRE_FALSE(reference.failed);
    CHECK(reference.hits == 0);  // off is off
    const seen_stream whole = read_pieces(body, body.size(), true);
    CHECK(whole == reference);
    hits += whole.hits;
    for (std::size_t piece : {1, 2, 3, 7, 64, 1460}) {
      INFO("piece " << piece);
      CHECK(read_pieces(body, piece, true) == reference);
    }
    for (std::size_t cut = 1; cut < body.size(); ++cut) {
      const seen_stream split = read_cut(body, {cut}, true);
      if (!(split == reference)) {
        INFO("cut at " << cut);
        CHECK(split == reference);
      }
      CHECK(read_cut(body, {cut}, false) == reference);
    }
  }
  CHECK(hits > 20);  // the cache did read most tokens
}

TEST_CASE("sse: the shape cache reads the recorded stream's tokens and hands over the same text", "[stream][sse][shape]") {
  const std::string body = shape_streams()[0];
  const seen_stream cached = read_pieces(body, body.size(), true);
  // 9 tokens: the first is read in full (and learned), the other 8 by the cache.
  CHECK(cached.hits == 8);
  std::string text;
  for (const seen_chunk& c : cached.chunks)
    if (c.kind == keel::chunk_kind::content) text += c.text;
  CHECK(text == "The quick caf\xc3\xa9\n \"brown\" fox, a b");
  // reset() forgets the shape: the next stream's first token is read in full.
  keel::sse_parser p;
  auto on = [](const keel::chat_chunk&) { return true; };
  REQUIRE(p.feed(content_event("a") + content_event("b"), on).ok());
  CHECK(p.shape_cache_hits() == 1);
  p.reset();
  CHECK(p.shape_cache_hits() == 0);
  REQUIRE(p.feed(content_event("c"), on).ok());
  CHECK(p.shape_cache_hits() == 0);
}

TEST_CASE("sse: an event split across two reads is still read by the cache, wherever the cut", "[stream][sse][shape]") {
  // The first event is read in full (and learned); the other two by the
  // cache however the body is cut, escapes, the suffix and the blank line
  // included: the piece that ends inside an event leaves its bytes in a stash
  // and the next piece completes them, instead of the line split.
  const std::string body = content_event("a") + content_event("b c\\u00e9\\\"\\n") + content_event("d");
  const seen_stream reference = read_pieces(body, body.size(), false);
  for (std::size_t cut = 1; cut < body.size(); ++cut) {
    INFO("cut at " << cut);
    const seen_stream split = read_cut(body, {cut}, true);
    CHECK(split == reference);
    CHECK(split.hits == 2);
  }
  // Small reads: an event over many pieces, the same with CR LF line ends.
  std::string crlf = body;
  for (std::size_t i = 0; (i = crlf.find('\n', i)) != std::string::npos; i += 2) crlf.replace(i, 1, "\r\n");
  for (const std::string* b : {&body, static_cast<const std::string*>(&crlf)}) {
    for (std::size_t piece : {1, 2, 3, 7, 64}) {
      INFO("piece " << piece);
      const seen_stream split = read_pieces(*b, piece, true);
      CHECK(split == read_pieces(*b, b->size(), false));
      CHECK(split.hits == 2);
    }
  }
  // A mismatch found only in the second piece: the suffix differs in its
  // last byte, the cut just before it. The stashed bytes go to the line split.
  const std::string late = content_event("a") + content_event("b", kHead, kTail + " ");
  const std::size_t cut = late.size() - 3;
  const seen_stream split = read_cut(late, {cut}, true);
  CHECK(split == read_pieces(late, late.size(), false));
  CHECK(split.hits == 0);
  REQUIRE(split.chunks.size() == 2);
  CHECK(split.chunks[1].text == "b");
  CHECK(split.chunks[1].data.back() == ' ');
}

TEST_CASE("sse: the cache's stash between reads allocates nothing per token", "[stream][sse][shape][alloc]") {
  if (!keel_test::allocations_counted()) {
    SUCCEED("allocation counting is off in this build");
    return;
  }
  std::string body;
  for (int i = 0; i < 400; ++i) body += content_event(i % 3 == 0 ? "caf\\u00e9" : " word");
  keel::sse_parser p;
  std::size_t tokens = 0;
  auto on = [&](const keel::chat_chunk& c) {
    tokens += c.kind == keel::chunk_kind::content;
    return true;
  };
  for (std::size_t i = 0; i < 101 * 40; i += 101) REQUIRE(p.feed(std::string_view(body).substr(i, 101), on).ok());
  keel_test::count_allocations allocations;
  for (std::size_t i = 101 * 40; i < body.size(); i += 101)
    REQUIRE(p.feed(std::string_view(body).substr(i, 101), on).ok());
  CHECK(allocations.count() == 0);
  CHECK(tokens == 400);
  CHECK(p.shape_cache_hits() == 399);
}

TEST_CASE("sse: an event the cache would read is still refused when over max_event_bytes", "[stream][sse][shape]") {
  const std::string body = content_event("a") + content_event(std::string(300, 'x')) + content_event("b");
  for (std::size_t piece : {body.size(), std::size_t{1}, std::size_t{7}, std::size_t{100}, std::size_t{300}}) {
    INFO("piece " << piece);
    const seen_stream off = read_pieces(body, piece, false, 400);
    const seen_stream on = read_pieces(body, piece, true, 400);
    CHECK(off.failed);
    CHECK(on == off);
  }
}

// --- the stream policy on the manual clock ------------------------------------

namespace {

// Polls (real time) until `done` holds: what a step on the manual clock
// caused has happened (a woken thread may not have run yet when advance()
// returns, and until it runs it still counts as the clock's sleeper).
template <class Done>
void wait_for(Done done) {
  const auto give_up = std::chrono::steady_clock::now() + 60s;
  while (!done()) {
    if (std::chrono::steady_clock::now() > give_up) FAIL("gave up waiting (60 s of real time)");
    std::this_thread::sleep_for(1ms);
  }
}

// Runs one call's stream on its own thread while the test moves the clock.
template <class Guard, class Pipe, class Provider>
struct stream_run {
  std::string shown;  // what on_token relayed
  std::atomic<int> seen{0};  // tokens relayed, for the test thread to wait on
  keel::call call;
  keel::token_stream<Guard, std::function<void(std::string_view)>> stream;
  std::optional<absl::StatusOr<keel::stream_result>> result;
  std::jthread thread;

  stream_run(Guard& g, const Pipe& pipe, Provider& provider, keel::call_options o)
      : call(g.timer().now(), o), stream(g, [this](std::string_view t) {
          shown.append(t);
          seen.fetch_add(1);
        }) {
    thread = std::jthread([this, &pipe, &provider] { result.emplace(pipe.run(call, stream.attempts(provider))); });
  }
  absl::StatusOr<keel::stream_result>& get() {
    thread.join();
    return *result;
  }
};

template <class Guard, class Pipe, class Provider>
stream_run(Guard&, const Pipe&, Provider&, keel::call_options) -> stream_run<Guard, Pipe, Provider>;

const keel::stream_options budgets{.first_token = 2s, .stall = 1s, .whole = 30s};

}  // namespace

TEST_CASE("stream: tokens pass through as they come; a usage chunk that disagrees with the count is reported as sent",
          "[stream][policy]") {
  manual_clock clock;
  keel::deadline_timer guard_timer{clock};
  keel::stream_guard guard(budgets, guard_timer);
  keel::testing::scripted_stream provider(
      clock, {{tok("a", 500ms), tok("b", 500ms), keel::testing::usage({.prompt_tokens = 3, .completion_tokens = 50}),
               end()}});
  const auto pipe = keel::pipeline(keel::retry({.max_attempts = 3})).in(keel::environment{clock});
  stream_run run(guard, pipe, provider, {.timeout = 60s});
  clock.await_sleepers(2);  // the provider and the watchdog
  clock.advance(500ms);
  wait_for([&] { return run.seen.load() == 1; });
  clock.await_sleepers(2);
  clock.advance(500ms);
  auto& r = run.get();
  REQUIRE(r.ok());
  CHECK(r->complete);
  CHECK_FALSE(r->partial);
  CHECK(r->text == "ab");
  CHECK(run.shown == "ab");
  CHECK(r->tokens == 2);
  CHECK(r->usage.completion_tokens == 50);  // the provider's bill, not the count
  CHECK(r->time_to_first_token == 500ms);
  CHECK(r->longest_gap == 500ms);
  CHECK(guard.figures().committed == 1);
}

TEST_CASE("stream: no first token within its budget is a transient failure before the commit: retried, the retry serves",
          "[stream][policy]") {
  manual_clock clock;
  keel::deadline_timer guard_timer{clock};
  keel::stream_guard guard(budgets, guard_timer);
  keel::testing::scripted_stream provider(clock, {{tok("late", 5s), end()}, {tok("x", 100ms), end()}});
  const auto pipe = keel::pipeline(keel::retry({.max_attempts = 2}, keel::constant_backoff{.delay_each = 0s})).in(keel::environment{clock});
  stream_run run(guard, pipe, provider, {.timeout = 60s});
  clock.await_sleepers(2);
  clock.advance(2s);  // the first-token budget: the watchdog stops attempt 1
  wait_for([&] { return provider.stopped() == 1 && provider.invocations() == 2; });
  clock.await_sleepers(2);  // attempt 2 sleeping, the watchdog
  clock.advance(100ms);
  auto& r = run.get();
  REQUIRE(r.ok());
  CHECK(r->text == "x");
  CHECK(r->complete);
  CHECK(run.call.record().attempts == 2);
  CHECK(provider.stopped() == 1);
  CHECK(guard.figures().first_token_timeouts == 1);
  CHECK(run.shown == "x");  // nothing of attempt 1 was shown
}

TEST_CASE("stream: the first-token timeout's status is a transient DeadlineExceeded when nothing retries it",
          "[stream][policy]") {
  manual_clock clock;
  keel::deadline_timer guard_timer{clock};
  keel::stream_guard guard(budgets, guard_timer);
  keel::testing::scripted_stream provider(clock, {{tok("late", 5s), end()}});
  const auto pipe = keel::pipeline(keel::retry({.max_attempts = 1})).in(keel::environment{clock});
  stream_run run(guard, pipe, provider, {.timeout = 60s});
  clock.await_sleepers(2);
  clock.advance(2s);
  auto& r = run.get();
  REQUIRE_FALSE(r.ok());
  CHECK(absl::IsDeadlineExceeded(r.status()));
  CHECK(keel::default_classifier{}(r.status(), {}) == keel::outcome_kind::transient);
}

TEST_CASE("stream: a stall after the commit is a partial answer with the text, never restarted by a retry",
          "[stream][policy]") {
  manual_clock clock;
  keel::deadline_timer guard_timer{clock};
  keel::stream_guard guard(budgets, guard_timer);
  keel::testing::scripted_stream provider(clock,
                                          {{tok("a", 100ms), tok("b", 100ms), tok("c", 100ms), tok("d", 10s), end()}});
  const auto pipe = keel::pipeline(keel::retry({.max_attempts = 3})).in(keel::environment{clock});
  stream_run run(guard, pipe, provider, {.timeout = 60s});
  for (int i = 0; i < 3; ++i) {
    clock.await_sleepers(2);
    clock.advance(100ms);
    wait_for([&] { return run.seen.load() == i + 1; });
  }
  clock.await_sleepers(2);
  clock.advance(999ms);  // the stall budget is 1 s: not yet
  clock.await_sleepers(2);
  clock.advance(1ms);
  auto& r = run.get();
  REQUIRE(r.ok());
  CHECK(r->partial);
  CHECK_FALSE(r->complete);
  CHECK(r->reason == keel::stream_stop::stall);
  CHECK(r->text == "abc");
  CHECK(r->tokens == 3);
  CHECK(r->continuable);
  CHECK(absl::IsDeadlineExceeded(r->cause));
  CHECK(run.call.record().attempts == 1);  // committed: not retried
  CHECK(guard.figures().stalls == 1);
  CHECK(guard.figures().mid_stream_failures == 1);
}

TEST_CASE("stream: the whole-stream budget and the call's deadline end a stream that keeps trickling",
          "[stream][policy]") {
  manual_clock clock;
  keel::deadline_timer guard_timer{clock};
  keel::stream_guard guard({.first_token = 2s, .stall = 1s, .whole = 2500ms}, guard_timer);
  std::vector<keel::testing::stream_step> trickle;
  for (int i = 0; i < 10; ++i) trickle.push_back(tok("t", 800ms));
  keel::testing::scripted_stream provider(clock, {trickle});
  const auto pipe = keel::pipeline(keel::retry({.max_attempts = 3})).in(keel::environment{clock});
  SECTION("whole") {
    stream_run run(guard, pipe, provider, {.timeout = 60s});
    for (int i = 0; i < 3; ++i) {
      clock.await_sleepers(2);
      clock.advance(800ms);
      wait_for([&] { return run.seen.load() == i + 1; });
    }
    clock.await_sleepers(2);
    clock.advance(100ms);  // 2.5 s
    auto& r = run.get();
    REQUIRE(r.ok());
    CHECK(r->reason == keel::stream_stop::whole);
    CHECK(r->text == "ttt");
  }
  SECTION("the call's deadline") {
    stream_run run(guard, pipe, provider, {.timeout = 1s});
    clock.await_sleepers(2);
    clock.advance(800ms);
    wait_for([&] { return run.seen.load() == 1; });
    clock.await_sleepers(2);
    clock.advance(200ms);
    auto& r = run.get();
    REQUIRE(r.ok());
    CHECK(r->reason == keel::stream_stop::deadline);
    CHECK(r->text == "t");
  }
}

TEST_CASE("stream: a failure after the commit is partial; continuable unless permanent", "[stream][policy]") {
  manual_clock clock;
  keel::deadline_timer guard_timer{clock};
  keel::stream_guard guard(budgets, guard_timer);
  const bool permanent = GENERATE(false, true);
  keel::testing::scripted_stream provider(
      clock, {{tok("a", 100ms), tok("b"),
               end(permanent ? absl::InvalidArgumentError("content filter") : absl::UnavailableError("connection cut"),
                   100ms)}});
  const auto pipe = keel::pipeline(keel::retry({.max_attempts = 3})).in(keel::environment{clock});
  stream_run run(guard, pipe, provider, {.timeout = 60s});
  clock.await_sleepers(2);
  clock.advance(100ms);
  wait_for([&] { return run.seen.load() == 2; });
  clock.await_sleepers(2);
  clock.advance(100ms);
  auto& r = run.get();
  REQUIRE(r.ok());
  CHECK(r->partial);
  CHECK(r->reason == keel::stream_stop::failed);
  CHECK(r->text == "ab");
  CHECK(r->continuable == !permanent);
  CHECK(run.call.record().attempts == 1);
}

TEST_CASE("stream: continuation is explicit: another provider resumes with the text so far, degraded and partial",
          "[stream][policy]") {
  manual_clock clock;
  keel::deadline_timer guard_timer{clock};
  keel::stream_guard guard(budgets, guard_timer);
  keel::testing::scripted_stream first(clock, {{tok("ab", 100ms), tok("c", 100ms), tok("never", 10s), end()}});
  std::string asked_with;
  keel::testing::scripted_stream rest(clock, {{tok("def", 100ms), end()}});
  auto second = [&](const keel::attempt& a, keel::stream_writer& w) {
    asked_with = std::string(w.text_so_far());
    return rest(a, w);
  };
  const auto pipe = keel::pipeline(keel::retry({.max_attempts = 3})).in(keel::environment{clock});
  std::string shown;
  std::atomic<int> seen{0};
  keel::call call(clock.now(), {.timeout = 5s});
  keel::token_stream stream(guard, [&](std::string_view t) {
    shown.append(t);
    seen.fetch_add(1);
  });
  std::optional<keel::stream_result> final_answer;
  std::jthread t([&] {
    absl::StatusOr<keel::stream_result> r = pipe.run(call, stream.attempts(first));
    if (r.ok()) final_answer = stream.resume(call, pipe, second, std::move(*r));
  });
  clock.await_sleepers(2);
  clock.advance(100ms);
  wait_for([&] { return seen.load() == 1; });
  clock.await_sleepers(2);
  clock.advance(100ms);
  wait_for([&] { return seen.load() == 2; });
  clock.await_sleepers(2);
  clock.advance(1s);  // stall: partial "abc"
  wait_for([&] { return rest.invocations() == 1; });
  clock.await_sleepers(2);  // the continuation's stream
  clock.advance(100ms);
  t.join();
  REQUIRE(final_answer.has_value());
  CHECK(asked_with == "abc");
  CHECK(final_answer->text == "abcdef");
  CHECK(shown == "abcdef");
  CHECK(final_answer->partial);
  CHECK(final_answer->degraded);
  CHECK(final_answer->complete);
  CHECK(final_answer->continuations == 1);
  CHECK(final_answer->tokens == 3);
  CHECK(call.record().degraded);
  CHECK(guard.figures().continuations == 1);
}

TEST_CASE("stream: a continuation that cannot commit leaves the partial answer as it was", "[stream][policy]") {
  manual_clock clock;
  keel::deadline_timer guard_timer{clock};
  keel::stream_guard guard(budgets, guard_timer);
  keel::testing::scripted_stream rest(clock, {{end(absl::UnavailableError("down"))}});
  const auto pipe = keel::pipeline(keel::retry({.max_attempts = 1})).in(keel::environment{clock});
  keel::call call(clock.now(), {.timeout = 5s});
  keel::token_stream stream(guard, [](std::string_view) {});
  keel::stream_result partial;
  partial.text = "abc";
  partial.partial = true;
  partial.continuable = true;
  partial.reason = keel::stream_stop::stall;
  const keel::stream_result r = stream.resume(call, pipe, rest, partial);
  CHECK(r.text == "abc");
  CHECK(r.reason == keel::stream_stop::stall);
  CHECK(absl::IsUnavailable(r.continuation_failure));
  CHECK_FALSE(r.degraded);
  partial.continuable = false;
  CHECK(stream.resume(call, pipe, rest, partial).continuation_failure.ok());  // not continued at all
  CHECK(rest.invocations() == 1);
}

TEST_CASE("stream: cancelling the call stops the stream at once, before or after the commit", "[stream][policy][cancel]") {
  manual_clock clock;
  keel::deadline_timer guard_timer{clock};
  keel::stream_guard guard(budgets, guard_timer);
  const bool committed = GENERATE(false, true);
  keel::testing::scripted_stream provider(clock, {{tok("a", 100ms), tok("b", 10s), end()}});
  const auto pipe = keel::pipeline(keel::retry({.max_attempts = 3})).in(keel::environment{clock});
  std::stop_source caller;
  stream_run run(guard, pipe, provider, {.timeout = 60s, .stop = caller.get_token()});
  clock.await_sleepers(2);
  if (committed) {
    clock.advance(100ms);
    wait_for([&] { return run.seen.load() == 1; });
    clock.await_sleepers(2);
  }
  caller.request_stop();  // no time passes
  auto& r = run.get();
  CHECK(provider.stopped() == 1);
  if (committed) {
    REQUIRE(r.ok());
    CHECK(r->reason == keel::stream_stop::cancelled);
    CHECK(r->text == "a");
    CHECK_FALSE(r->continuable);
  } else {
    REQUIRE_FALSE(r.ok());
    CHECK(absl::IsCancelled(r.status()));
  }
  CHECK(run.call.record().attempts == 1);
}

TEST_CASE("stream: a first-token hedge races a second stream; the first to produce content wins, the other stops",
          "[stream][policy][hedge]") {
  manual_clock clock;
  keel::bounded_pool pool({.threads = 2, .queue_capacity = 4});
  keel::retry_budget budget({.ratio = 0.5, .min_per_second = 10});
  keel::deadline_timer guard_timer{clock};
  keel::stream_guard guard({.first_token = 5s, .stall = 1s, .hedge_delay = 1s, .budget = &budget}, pool, guard_timer);
  const bool hedge_wins = GENERATE(true, false);
  // Primary: first token at 3 s (or 1.5 s); hedge (started at 1 s): at 1.2 s from its start (2.2 s).
  keel::testing::scripted_stream provider(
      clock, {{tok("primary", hedge_wins ? 3s : 1500ms), end()}, {tok("hedge", 1200ms), end()}});
  const auto pipe = keel::pipeline(keel::retry({.max_attempts = 3})).in(keel::environment{clock});
  stream_run run(guard, pipe, provider, {.timeout = 60s});
  clock.await_sleepers(2);
  clock.advance(1s);        // the hedge starts
  wait_for([&] { return provider.invocations() == 2; });
  clock.await_sleepers(3);  // the primary, the hedge, the watchdog
  if (hedge_wins) {
    clock.advance(1200ms);  // the hedge's first token; the primary is stopped
  } else {
    clock.advance(500ms);  // the primary's first token; the hedge is stopped
  }
  auto& r = run.get();
  REQUIRE(r.ok());
  CHECK(r->complete);
  CHECK(r->text == (hedge_wins ? "hedge" : "primary"));
  CHECK(run.shown == r->text);
  CHECK(r->hedge == (hedge_wins ? 1 : 0));
  // The client waited from the call's start; the serving stream's own time is apart.
  CHECK(r->time_to_first_token == (hedge_wins ? 2200ms : 1500ms));
  CHECK(r->attempt_time_to_first_token == (hedge_wins ? 1200ms : 1500ms));
  CHECK(provider.invocations() == 2);
  CHECK(provider.stopped() == 1);
  CHECK(run.call.record().attempts == 2);  // the hedge counts against the call's cap
  const keel::stream_figures f = guard.figures();
  CHECK(f.hedges_started == 1);
  CHECK(f.hedge_wins == (hedge_wins ? 1 : 0));
}

TEST_CASE("stream: no hedge when the retry budget is spent or the attempt cap reached", "[stream][policy][hedge]") {
  manual_clock clock;
  keel::bounded_pool pool({.threads = 2, .queue_capacity = 4});
  keel::retry_budget budget({.ratio = 0.0, .min_per_second = 0});
  const bool by_budget = GENERATE(true, false);
  keel::deadline_timer guard_timer{clock};
  keel::stream_guard guard({.first_token = 5s, .stall = 1s, .hedge_delay = 1s, .budget = by_budget ? &budget : nullptr},
                           pool, guard_timer);
  keel::testing::scripted_stream provider(clock, {{tok("primary", 3s), end()}});
  const auto pipe = keel::pipeline(keel::retry({.max_attempts = 1})).in(keel::environment{clock});
  stream_run run(guard, pipe, provider, {.timeout = 60s, .max_attempts = by_budget ? 3 : 1});
  clock.await_sleepers(2);
  clock.advance(1s);  // the hedge is due: refused
  wait_for([&] { return guard.figures().hedges_skipped == 1; });
  clock.await_sleepers(2);
  clock.advance(2s);
  auto& r = run.get();
  REQUIRE(r.ok());
  CHECK(r->text == "primary");
  CHECK(provider.invocations() == 1);
  CHECK(guard.figures().hedges_started == 0);
  CHECK(guard.figures().hedges_skipped == 1);
}

TEST_CASE("stream: the first-token hedge spends one retry of the budget and deposits the call's request",
          "[stream][policy][hedge]") {
  manual_clock clock;
  keel::bounded_pool pool({.threads = 2, .queue_capacity = 4});
  keel::retry_budget budget({.ratio = 0.5, .min_per_second = 10});
  keel::deadline_timer guard_timer{clock};
  keel::stream_guard guard({.first_token = 5s, .stall = 1s, .hedge_delay = 1s, .budget = &budget}, pool, guard_timer);
  keel::testing::scripted_stream provider(clock, {{tok("primary", 3s), end()}, {tok("hedge", 100ms), end()}});
  const auto pipe = keel::pipeline(keel::retry({.max_attempts = 1})).in(keel::environment{clock});
  stream_run run(guard, pipe, provider, {.timeout = 60s});
  clock.await_sleepers(2);
  clock.advance(1s);
  wait_for([&] { return provider.invocations() == 2; });
  clock.await_sleepers(3);
  clock.advance(100ms);
  auto& r = run.get();
  REQUIRE(r.ok());
  CHECK(r->text == "hedge");
  const keel::retry_budget_figures f = budget.figures(clock.now());
  CHECK(f.requests == 1);  // the call's one deposit, not one per stream
  CHECK(f.retries == 1);   // the hedge
}

TEST_CASE("stream: a learned first-token hedge delay follows the recent times to first token",
          "[stream][policy][hedge]") {
  manual_clock clock;
  keel::bounded_pool pool({.threads = 2, .queue_capacity = 4});
  keel::deadline_timer guard_timer{clock};
  keel::stream_guard guard(
      {.first_token = 10s, .stall = 1s, .hedge_delay = 1s, .hedge_percentile = 0.95, .hedge_min_delay = 10ms}, pool,
      guard_timer);
  const auto pipe = keel::pipeline(keel::retry({.max_attempts = 3})).in(keel::environment{clock});
  CHECK(guard.current_hedge_delay() == 1s);  // nothing learned yet: the fixed delay
  keel::testing::scripted_stream quick(clock, {{tok("q", 200ms), end()}});
  for (int i = 0; i < 20; ++i) {  // the tracker's min_samples: 20 times to first token of 200 ms
    stream_run warm(guard, pipe, quick, {.timeout = 60s});
    clock.await_sleepers(2);
    clock.advance(200ms);
    REQUIRE(warm.get().ok());
  }
  CHECK(guard.current_hedge_delay() == 200ms);
  CHECK(guard.figures().hedges_started == 0);
  // Now a slow primary is hedged after the learned 200 ms, not the fixed 1 s.
  keel::testing::scripted_stream provider(clock, {{tok("slow", 5s), end()}, {tok("fast", 100ms), end()}});
  stream_run run(guard, pipe, provider, {.timeout = 60s});
  clock.await_sleepers(2);
  clock.advance(200ms);
  wait_for([&] { return provider.invocations() == 2; });
  clock.await_sleepers(3);
  clock.advance(100ms);
  auto& r = run.get();
  REQUIRE(r.ok());
  CHECK(r->text == "fast");
  CHECK(r->hedge == 1);
  CHECK(r->time_to_first_token == 300ms);          // the client's wait: the hedge delay and the winner's time
  CHECK(r->attempt_time_to_first_token == 100ms);  // the winner's, from its own start
  CHECK(guard.figures().hedges_started == 1);
}

TEST_CASE("stream: options are validated, naming the field", "[stream][policy]") {
  CHECK_FALSE(keel::stream_options{.first_token = 0s}.validate().ok());
  CHECK_FALSE(keel::stream_options{.stall = -1s}.validate().ok());
  CHECK_FALSE(keel::stream_options{.hedge_percentile = 1.0}.validate().ok());
  const absl::Status s = keel::stream_options{.whole = -1s}.validate();
  CHECK(std::string(s.message()).find("whole") != std::string::npos);
  CHECK_THROWS_AS(keel::stream_guard(keel::stream_options{.first_token = 0s}), keel::invalid_options);
}

TEST_CASE("stream: the policy allocates nothing per token", "[stream][policy][alloc]") {
  if (!keel_test::allocations_counted()) {
    SUCCEED("allocation counting is off in this build");
    return;
  }
  manual_clock clock;
  keel::deadline_timer guard_timer{clock};
  keel::stream_guard guard(budgets, guard_timer);
  std::int64_t allocations_in_stream = -1;
  std::size_t relayed = 0;
  auto provider = [&](const keel::attempt&, keel::stream_writer& w) -> absl::Status {
    const keel::time_point now = clock.now();
    for (int i = 0; i < 64; ++i) (void)w.token("warm", now);  // the commit, and the first tokens
    keel_test::count_allocations allocations;
    for (int i = 0; i < 1000; ++i) {
      if (!w.token("token", now)) return absl::CancelledError("stopped");
    }
    allocations_in_stream = allocations.count();
    return absl::OkStatus();
  };
  keel::call call(clock.now(), {.timeout = 60s});
  keel::token_stream stream(guard, [&](std::string_view t) { relayed += t.size(); });
  stream.reserve(8 << 10);
  auto r = keel::pipeline(keel::retry({.max_attempts = 1})).in(keel::environment{clock}).run(call, stream.attempts(provider));
  REQUIRE(r.ok());
  CHECK(r->tokens == 1064);
  CHECK(relayed == 64 * 4 + 1000 * 5);
  CHECK(allocations_in_stream == 0);
}

// --- metrics and the time-to-first-token objective ------------------------------

namespace {

const keel::metric_series* series(const keel::metrics_snapshot& s, std::string_view family,
                                  std::vector<std::string> labels) {
  for (const auto& f : s.families) {
    if (f.name != family) continue;
    for (const auto& x : f.series)
      if (x.labels == labels) return &x;
  }
  return nullptr;
}

double value(const keel::metrics_snapshot& s, std::string_view family, std::vector<std::string> labels) {
  const keel::metric_series* x = series(s, family, std::move(labels));
  return x == nullptr ? -1 : x->value;
}

}  // namespace

TEST_CASE("stream metrics: time to first token, gaps, outcomes, stalls, continuations and tokens per model",
          "[stream][metrics]") {
  keel::metrics_registry registry;
  keel::stream_metrics metrics(registry, {.max_series = 3});
  keel::stream_result complete;
  complete.complete = true;
  complete.tokens = 11;
  complete.time_to_first_token = 250ms;
  complete.generation_time = 500ms;  // a 50 ms mean gap
  complete.longest_gap = 120ms;
  keel::stream_result stalled;
  stalled.partial = true;
  stalled.reason = keel::stream_stop::stall;
  stalled.tokens = 3;
  stalled.time_to_first_token = 1500ms;
  stalled.continuations = 1;
  metrics.record("m1", complete);
  metrics.record("m1", stalled);
  metrics.record("m2", absl::StatusOr<keel::stream_result>(absl::DeadlineExceededError("no first token")));
  metrics.record("m3", absl::StatusOr<keel::stream_result>(absl::CancelledError("gone")));  // past max_models
  metrics.record_tokens("m1", 4096, 14);
  const keel::metrics_snapshot s = registry.snapshot();
  const keel::metric_series* ttft = series(s, "keel_stream_time_to_first_token_seconds", {"m1"});
  REQUIRE(ttft != nullptr);
  CHECK(ttft->count == 2);
  CHECK(ttft->sum == Approx(1.75));
  const keel::metric_series* gap = series(s, "keel_stream_inter_token_seconds", {"m1"});
  REQUIRE(gap != nullptr);
  CHECK(gap->sum == Approx(0.05 + 0.0));  // the stalled stream's generation_time is 0
  CHECK(value(s, "keel_streams_total", {"m1", "complete"}) == 1);
  CHECK(value(s, "keel_streams_total", {"m1", "partial"}) == 1);
  CHECK(value(s, "keel_streams_total", {"m2", "failed"}) == 1);
  CHECK(value(s, "keel_streams_total", {"_other", "cancelled"}) == 1);
  CHECK(value(s, "keel_stream_stalls_total", {"m1"}) == 1);
  CHECK(value(s, "keel_stream_mid_stream_failures_total", {"m1", "stall"}) == 1);
  CHECK(value(s, "keel_stream_continuations_total", {"m1"}) == 1);
  CHECK(value(s, "keel_stream_tokens_total", {"m1"}) == 14);
  CHECK(value(s, "keel_stream_tokens_reserved_total", {"m1"}) == 4096);
  CHECK(value(s, "keel_stream_tokens_settled_total", {"m1"}) == 14);
}

TEST_CASE("stream SLO: the latency objective of a class is its time to first token", "[stream][metrics]") {
  keel::work_class_slo slo("chat_ttft", {.target = 0.9,
                                         .window = 1h,
                                         .window_buckets = 60,
                                         .rejected = keel::counts_as::not_eligible,
                                         .partial = keel::counts_as::good,
                                         .abandoned = keel::counts_as::not_eligible,
                                         .latency_threshold = 800ms,
                                         .latency_target = 0.5});
  const keel::time_point now = manual_clock{}.now();
  keel::stream_result fast;
  fast.complete = true;
  fast.tokens = 5;
  fast.time_to_first_token = 300ms;
  keel::stream_result slow = fast;
  slow.time_to_first_token = 2s;  // a whole stream may be quick after a slow first token: still slow here
  keel::stream_result partial = fast;
  partial.partial = true;
  partial.reason = keel::stream_stop::failed;
  keel::record_time_to_first_token(slo, fast, now);
  keel::record_time_to_first_token(slo, slow, now);
  keel::record_time_to_first_token(slo, partial, now);
  keel::record_time_to_first_token(slo, absl::StatusOr<keel::stream_result>(absl::DeadlineExceededError("x")), now);
  keel::record_time_to_first_token(slo, absl::StatusOr<keel::stream_result>(absl::CancelledError("x")), now);
  const keel::slo_report r = slo.report(now);
  CHECK(r.in_window.success == 2);
  CHECK(r.in_window.partial == 1);
  CHECK(r.in_window.failure == 1);
  CHECK(r.in_window.abandoned == 1);
  REQUIRE(r.latency.has_value());
  CHECK(r.latency->good == 2);  // fast and partial within 800 ms
  CHECK(r.latency->bad == 1);   // slow
}

TEST_CASE("stream: time to first token is what the client waited, from the call's start, after a retry too",
          "[stream][policy][metrics]") {
  manual_clock clock;
  keel::deadline_timer guard_timer{clock};
  keel::stream_guard guard(budgets, guard_timer);
  // Attempt 1 never shows a token within the 2 s budget; attempt 2 does after 500 ms.
  keel::testing::scripted_stream provider(clock, {{tok("late", 5s), end()}, {tok("x", 500ms), end()}});
  const auto pipe = keel::pipeline(keel::retry({.max_attempts = 2}, keel::constant_backoff{.delay_each = 0s})).in(keel::environment{clock});
  stream_run run(guard, pipe, provider, {.timeout = 60s});
  clock.await_sleepers(2);
  clock.advance(2s);
  wait_for([&] { return provider.invocations() == 2; });
  clock.await_sleepers(2);
  clock.advance(500ms);
  auto& r = run.get();
  REQUIRE(r.ok());
  CHECK(r->time_to_first_token == 2500ms);         // the client's wait
  CHECK(r->attempt_time_to_first_token == 500ms);  // the serving attempt's own
  // An 800 ms objective counts this stream as slow, as its client saw it.
  keel::work_class_slo slo("chat_ttft", {.target = 0.9,
                                         .window = 1h,
                                         .window_buckets = 60,
                                         .rejected = keel::counts_as::not_eligible,
                                         .partial = keel::counts_as::good,
                                         .abandoned = keel::counts_as::not_eligible,
                                         .latency_threshold = 800ms,
                                         .latency_target = 0.5});
  keel::record_time_to_first_token(slo, r, clock.now());
  REQUIRE(slo.report(clock.now()).latency.has_value());
  CHECK(slo.report(clock.now()).latency->bad == 1);
  // And the histogram records the same figure.
  keel::metrics_registry registry;
  keel::stream_metrics streams(registry);
  streams.record("m", r);
  const keel::metrics_snapshot snapshot = registry.snapshot();  // the series points into it
  const keel::metric_series* ttft = series(snapshot, "keel_stream_time_to_first_token_seconds", {"m"});
  REQUIRE(ttft != nullptr);
  CHECK(ttft->sum == Approx(2.5));
}

// --- tokens as the unit of cost -------------------------------------------------

TEST_CASE("stream tokens: admission reserves an estimate and settles to the usage chunk, else to the count",
          "[stream][admission]") {
  manual_clock clock;
  keel::deadline_timer guard_timer{clock};
  keel::stream_guard guard(budgets, guard_timer);
  keel::admission quotas({.tenant_defaults = {.compute_budget = 10'000, .compute_window = 1h}});
  struct chat {
    std::int64_t max_tokens;
  };
  const auto pipe =
      keel::pipeline(quotas.with_estimate(keel::from_request<chat>([](const chat& c) { return c.max_tokens; },
                                                                     std::int64_t{0})),
                     keel::retry({.max_attempts = 1}))
          .in(keel::environment{clock});
  const bool usage_sent = GENERATE(true, false);
  // The usage chunk disagrees with the count: the provider's bill wins.
  std::vector<keel::testing::stream_step> script{tok("a"), tok("b"), tok("c")};
  if (usage_sent) script.push_back(keel::testing::usage({.prompt_tokens = 40, .completion_tokens = 60, .total_tokens = 100}));
  keel::testing::scripted_stream provider(clock, {script});
  const chat request{.max_tokens = 4000};
  keel::call call(clock.now(), {.timeout = 60s, .labels = {.tenant = "acme"}}, request);
  keel::token_stream stream(guard, [](std::string_view) {});
  const absl::StatusOr<keel::stream_result> r = pipe.run(call, stream.attempts(provider));  // no time passes
  REQUIRE(r.ok());
  const std::int64_t billed = usage_sent ? 100 : 3;
  CHECK(r->charged == billed);
  CHECK(call.record().cost == billed);
  const std::optional<keel::quota_figures> f = quotas.tenant_figures("acme", clock.now());
  REQUIRE(f.has_value());
  CHECK(f->compute_available == Approx(10'000 - billed));  // 4000 reserved, the rest refunded
}

TEST_CASE("stream tokens: a stream that fails before its first token is charged what its usage says, else nothing",
          "[stream][admission]") {
  manual_clock clock;
  keel::deadline_timer guard_timer{clock};
  keel::stream_guard guard(budgets, guard_timer);
  keel::admission quotas({.tenant_defaults = {.compute_budget = 1'000, .compute_window = 1h}});
  const auto pipe = keel::pipeline(quotas.with_estimate([](const keel::call&) { return std::int64_t{300}; }),
                                   keel::retry({.max_attempts = 1}))
                        .in(keel::environment{clock});
  const bool usage_sent = GENERATE(true, false);
  std::vector<keel::testing::stream_step> script;
  if (usage_sent) script.push_back(keel::testing::usage({.prompt_tokens = 40, .completion_tokens = 0}));
  script.push_back(end(absl::UnavailableError("upstream overloaded")));
  keel::testing::scripted_stream provider(clock, {script});
  keel::call call(clock.now(), {.timeout = 60s, .labels = {.tenant = "acme"}});
  keel::token_stream stream(guard, [](std::string_view) {});
  const absl::StatusOr<keel::stream_result> r = pipe.run(call, stream.attempts(provider));
  REQUIRE_FALSE(r.ok());
  CHECK(absl::IsUnavailable(r.status()));
  const std::int64_t billed = usage_sent ? 40 : 0;  // the prompt the provider says it read
  CHECK(call.record().cost == billed);
  CHECK(quotas.tenant_figures("acme", clock.now())->compute_available == Approx(1'000 - billed));
}

TEST_CASE("stream tokens: a first-token race charges the winner's bill and what the loser's usage says",
          "[stream][admission][hedge]") {
  manual_clock clock;
  keel::bounded_pool pool({.threads = 2, .queue_capacity = 4});
  keel::deadline_timer guard_timer{clock};
  keel::stream_guard guard({.first_token = 5s, .stall = 1s, .hedge_delay = 1s}, pool, guard_timer);
  // The primary reported its prompt (25 tokens) before it went quiet; the hedge bills 3 + 25.
  keel::testing::scripted_stream provider(
      clock, {{keel::testing::usage({.prompt_tokens = 25, .completion_tokens = 0}), tok("slow", 3s), end()},
              {tok("a", 100ms), tok("b"), tok("c"), keel::testing::usage({.prompt_tokens = 25, .completion_tokens = 3}),
               end()}});
  const auto pipe = keel::pipeline(keel::retry({.max_attempts = 1})).in(keel::environment{clock});
  stream_run run(guard, pipe, provider, {.timeout = 60s});
  clock.await_sleepers(2);
  clock.advance(1s);
  wait_for([&] { return provider.invocations() == 2; });
  clock.await_sleepers(3);
  clock.advance(100ms);
  auto& r = run.get();
  REQUIRE(r.ok());
  CHECK(r->text == "abc");
  CHECK(r->charged == 28 + 25);
  CHECK(run.call.record().cost == 53);
}

TEST_CASE("stream tokens: a stream over its estimate is charged the excess", "[stream][admission]") {
  manual_clock clock;
  keel::deadline_timer guard_timer{clock};
  keel::stream_guard guard(budgets, guard_timer);
  keel::admission quotas({.tenant_defaults = {.compute_budget = 1'000, .compute_window = 1h}});
  const auto pipe = keel::pipeline(quotas.with_estimate([](const keel::call&) { return std::int64_t{200}; }),
                                   keel::retry({.max_attempts = 1}))
                        .in(keel::environment{clock});
  keel::testing::scripted_stream provider(
      clock, {{tok("a"), keel::testing::usage({.prompt_tokens = 100, .completion_tokens = 400}), end()}});
  keel::call call(clock.now(), {.timeout = 60s, .labels = {.tenant = "acme"}});
  keel::token_stream stream(guard, [](std::string_view) {});
  const absl::StatusOr<keel::stream_result> r = pipe.run(call, stream.attempts(provider));
  REQUIRE(r.ok());
  CHECK(r->charged == 500);
  CHECK(quotas.tenant_figures("acme", clock.now())->compute_available == Approx(500));
}

TEST_CASE("token estimate: input plus the requested maximum until enough streams are known, then their percentile",
          "[stream][admission]") {
  keel::token_estimate output({.percentile = 0.9, .samples = 64, .min_samples = 20});
  CHECK(output.estimate(100, 4000) == 4100);
  CHECK_FALSE(output.learned().has_value());
  keel::stream_result r;
  r.complete = true;
  for (int i = 1; i <= 20; ++i) {  // outputs of 10, 20, ..., 200 tokens: the usage chunk's word
    r.usage.completion_tokens = 10 * i;
    r.tokens = 1;  // counted: ignored when the usage says
    output.record(r);
  }
  REQUIRE(output.learned().has_value());
  CHECK(*output.learned() == 180);           // nearest rank: the 18th of 20
  CHECK(output.estimate(100, 4000) == 280);  // input + the learned p90
  CHECK(output.estimate(100, 50) == 150);    // never more than the request allows
  CHECK(output.estimate(-5, -1) == 0);
  // Partial answers and failures say nothing about how long answers are.
  keel::stream_result partial = r;
  partial.partial = true;
  partial.usage.completion_tokens = 100'000;
  for (int i = 0; i < 64; ++i) output.record(partial);
  output.record(absl::StatusOr<keel::stream_result>(absl::UnavailableError("x")));
  CHECK(*output.learned() == 180);
  // Without a usage chunk, the counted tokens.
  keel::stream_result counted;
  counted.complete = true;
  counted.tokens = 1000;
  for (int i = 0; i < 64; ++i) output.record(counted);  // the whole window now
  CHECK(*output.learned() == 1000);
  CHECK_FALSE(keel::token_estimate_options{.percentile = 1.0}.validate().ok());
  CHECK_THROWS_AS(keel::token_estimate({.samples = 8}), keel::invalid_options);
}

TEST_CASE("token estimate: a learned reservation lets a tokens-per-window quota run the streams it can afford",
          "[stream][admission]") {
  manual_clock clock;
  keel::admission quotas({.tenant_defaults = {.compute_budget = 10'000, .compute_window = 1h}});
  keel::token_estimate output({.percentile = 0.95, .samples = 64, .min_samples = 20});
  auto admit_all = [&](std::int64_t estimate) {
    std::vector<keel::admission_ticket> held;  // streams running at once: nothing settles
    for (;;) {
      absl::StatusOr<keel::admission_ticket> t = quotas.admit({.tenant = "acme", .estimate = estimate}, clock.now());
      if (!t.ok()) {
        CHECK(absl::IsResourceExhausted(t.status()));
        break;
      }
      held.push_back(std::move(*t));
    }
    const auto n = held.size();
    for (keel::admission_ticket& t : held) t.reconcile(0, clock.now());  // nothing was used: all refunded
    return n;
  };
  // Reserving max_tokens (4000) for answers of about 500: two streams at once.
  CHECK(admit_all(output.estimate(100, 4000)) == 2);
  keel::stream_result r;
  r.complete = true;
  for (int i = 0; i < 20; ++i) {
    r.usage.completion_tokens = 400 + 5 * i;  // 400 ... 495
    output.record(r);
  }
  CHECK(output.estimate(100, 4000) == 100 + 490);  // nearest rank: the 19th of 20
  CHECK(admit_all(output.estimate(100, 4000)) == 16);  // 16 x 595 of 10,000
}

TEST_CASE("stream figures add up field by field", "[stream]") {
  const keel::stream_figures a{.attempts = 1, .committed = 2, .first_token_timeouts = 3, .stalls = 4,
                               .whole_timeouts = 5, .mid_stream_failures = 6, .hedges_started = 7,
                               .hedge_wins = 8, .hedges_skipped = 9, .continuations = 10};
  keel::stream_figures t = a;
  t += a;
  t += keel::stream_figures{};
  CHECK(t.attempts == 2);
  CHECK(t.committed == 4);
  CHECK(t.first_token_timeouts == 6);
  CHECK(t.stalls == 8);
  CHECK(t.whole_timeouts == 10);
  CHECK(t.mid_stream_failures == 12);
  CHECK(t.hedges_started == 14);
  CHECK(t.hedge_wins == 16);
  CHECK(t.hedges_skipped == 18);
  CHECK(t.continuations == 20);
}
