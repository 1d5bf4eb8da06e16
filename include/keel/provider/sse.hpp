// keel/provider/sse.hpp — a server-sent events parser for OpenAI-compatible
// chat completion streams (`stream: true`), built to sit in a transfer's
// write callback.
//
// keel::http::sse_parser takes the response body in whatever pieces the
// network delivers (a `data:` line split across reads, a CR LF split between
// two), assembles events as the SSE specification says (fields per line,
// `data` lines of one event joined by '\n', a blank line dispatches, lines
// starting with ':' are comments, an event unterminated at the end of the
// body is dropped), and reads each event's JSON as a chat completion chunk:
//
//   kind::content    a delta with content text: a token for the stream policy
//   kind::role       a role-only delta (the start of the message): not a token
//   kind::empty      a chunk with nothing in it (no choices, an empty or null
//                    content, a finish_reason alone): not a token
//   kind::usage      the usage chunk (stream_options.include_usage), also set
//                    on whatever chunk carries `usage`: see chat_chunk::usage
//   kind::error      an error object mid-stream ({"error": {...}}, or an
//                    `event: error`): chat_chunk::text is its message;
//                    error_status(chunk) maps it to a keel status
//   kind::done       `data: [DONE]`: the stream ended properly
//   kind::invalid    a data event that is not a JSON object: the stream is corrupt
//   kind::keepalive  a comment line (": ping"), for who wants to see the line alive
//
// The parser allocates nothing per token: the bytes of an unfinished line
// and of the event's data are kept in buffers whose capacity stays, a
// token's text is a view into the event's data (or, when the JSON string
// has escapes, into a reused unescape buffer), valid during the callback.
//
// The shape cache (sse_options::shape_cache, on by default): a stream's
// content chunks are byte-identical but for the content string (the same
// id, model, created, fingerprint, and the same bytes after the string).
// After a full read of a plain content chunk the parser keeps the bytes
// before the string's opening quote and from its closing quote on; an
// event that starts and ends with exactly those bytes and has a valid
// string body between them is handed over as a content chunk with that
// text, without reading its JSON again. It is exact, not a guess: the
// reader's path through the bytes before the string cannot depend on what
// follows them, a valid string body ends where the cached one did, and the
// same bytes after it read the same way, so the full read would give the
// same chunk; anything else (another id, a finish_reason, a raw quote or
// control character in the middle, a bad escape) is read in full, and a
// full read of a plain content chunk refreshes the cache. A whole event in
// the piece skips the line split too; a piece that ends inside an event
// matching so far leaves its bytes in a small stash, and the next piece
// completes the match there (a mismatch hands the stashed bytes to the
// line split as the piece they came in: where pieces end changes nothing).
//
// Example:
//
//   keel::http::sse_parser parser;
//   std::string text;
//   auto on = [&](const keel::http::chat_chunk& c) {
//     if (c.kind == keel::http::chunk_kind::content) text.append(c.text);
//     return true;  // false: stop feeding (the rest of this piece is not parsed)
//   };
//   absl::Status s = parser.feed("data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n", on);
//   s = parser.feed("\n", on);   // text == "Hi"
//
// Limits: an event longer than sse_options::max_event_bytes fails the
// parse (absl::OutOfRangeError); JSON nested deeper than 64 levels is read
// as invalid. A chunk's other choices (n > 1) are skipped: the content is
// choice 0's. tool_calls deltas are kind::empty here.
//
// Thread-safety: a parser belongs to one stream; distinct parsers are independent.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "keel/compose/stream.hpp"
#include "keel/core/status.hpp"

namespace keel::http {

enum class chunk_kind : std::uint8_t { content, role, empty, usage, error, done, invalid, keepalive };

[[nodiscard]] constexpr std::string_view to_string(chunk_kind k) noexcept {
  switch (k) {
    case chunk_kind::content: return "content";
    case chunk_kind::role: return "role";
    case chunk_kind::empty: return "empty";
    case chunk_kind::usage: return "usage";
    case chunk_kind::error: return "error";
    case chunk_kind::done: return "done";
    case chunk_kind::invalid: return "invalid";
    case chunk_kind::keepalive: return "keepalive";
  }
  return "unknown";
}

// One event, read. Views valid during the callback only.
struct chat_chunk {
  chunk_kind kind = chunk_kind::empty;
  std::string_view text{};           // content: the token; error: the message
  std::string_view finish_reason{};  // "stop", "length", ...; empty when absent
  bool has_usage = false;            // `usage` was present (and an object)
  keel::token_usage usage{};
  std::string_view error_type{};     // error: its "type" or string "code"
  std::int64_t error_code = 0;       // error: a numeric "code" (often the HTTP status), else 0
  std::string_view data{};           // the event's data, as received
};

struct sse_options {
  // An event (its data lines together) longer than this fails the parse; > 0.
  std::size_t max_event_bytes = std::size_t{1} << 20;
  // The shape cache (see the header comment): content chunks that repeat the
  // last plain content chunk's bytes around another string are not read
  // again. Off, every event is read in full; the chunks are the same either
  // way (the differential tests and the fuzz target check it). Any value is valid.
  bool shape_cache = true;

  [[nodiscard]] absl::Status validate() const {
    if (max_event_bytes == 0) return keel::detail::invalid_field("sse_options", "max_event_bytes", "be > 0", 0);
    return absl::OkStatus();
  }
};

namespace detail {

// A forgiving reader of the few JSON paths a chat chunk has; never reads
// past `end`, never recurses deeper than max_depth.
class json_reader {
 public:
  static constexpr int max_depth = 64;

  json_reader(const char* p, const char* end) noexcept : p_(p), end_(end) {}

  [[nodiscard]] bool ok() const noexcept { return ok_; }
  [[nodiscard]] const char* pos() const noexcept { return p_; }
  bool fail() noexcept { return ok_ = false; }

  void ws() noexcept {
    while (p_ < end_ && (*p_ == ' ' || *p_ == '\t' || *p_ == '\n' || *p_ == '\r')) ++p_;
  }
  [[nodiscard]] bool at(char c) noexcept {
    ws();
    return p_ < end_ && *p_ == c;
  }
  bool eat(char c) noexcept {
    if (!at(c)) return false;
    ++p_;
    return true;
  }
  [[nodiscard]] bool at_end() noexcept {
    ws();
    return p_ >= end_;
  }

  // A string's raw contents (between the quotes, escapes not undone);
  // `escaped` says whether it has any.
  bool string(std::string_view& raw, bool& escaped) noexcept {
    if (!eat('"')) return fail();
    const char* s = p_;
    escaped = false;
    for (;;) {
      const void* q = std::memchr(p_, '"', static_cast<std::size_t>(end_ - p_));
      if (q == nullptr) return fail();
      const char* quote = static_cast<const char*>(q);
      // A quote preceded by an odd run of backslashes is escaped.
      std::size_t slashes = 0;
      for (const char* b = quote; b > s && b[-1] == '\\'; --b) ++slashes;
      if (!escaped && std::memchr(p_, '\\', static_cast<std::size_t>(quote - p_)) != nullptr) escaped = true;
      p_ = quote + 1;
      if (slashes % 2 == 0) {
        raw = std::string_view(s, static_cast<std::size_t>(quote - s));
        return true;
      }
    }
  }

  // Past a string whose contents nobody reads: only its closing quote is looked for.
  bool skip_string() noexcept {
    ++p_;  // the opening quote
    const char* s = p_;
    for (;;) {
      const void* q = std::memchr(p_, '"', static_cast<std::size_t>(end_ - p_));
      if (q == nullptr) return fail();
      const char* quote = static_cast<const char*>(q);
      std::size_t slashes = 0;
      for (const char* b = quote; b > s && b[-1] == '\\'; --b) ++slashes;
      p_ = quote + 1;
      if (slashes % 2 == 0) return true;
    }
  }

  // A string's text: the raw view, or its unescaped copy in `scratch`.
  bool text(std::string_view& out, std::string& scratch) {
    std::string_view raw;
    bool escaped = false;
    if (!string(raw, escaped)) return false;
    if (!escaped) {
      out = raw;
      return true;
    }
    if (!unescape(raw, scratch, out)) return fail();
    return true;
  }

  // An integer (the integral part of a number); other values are skipped and read as -1.
  bool integer(std::int64_t& out) noexcept {
    ws();
    if (p_ < end_ && (*p_ == '-' || (*p_ >= '0' && *p_ <= '9'))) {
      bool neg = *p_ == '-';
      if (neg) ++p_;
      std::int64_t v = 0;
      while (p_ < end_ && *p_ >= '0' && *p_ <= '9') {
        if (v < (std::int64_t{1} << 58)) v = v * 10 + (*p_ - '0');
        ++p_;
      }
      out = neg ? -v : v;
      return skip_number_rest();
    }
    out = -1;
    return skip();
  }

  bool literal(std::string_view word) noexcept {
    ws();
    if (static_cast<std::size_t>(end_ - p_) < word.size() || std::memcmp(p_, word.data(), word.size()) != 0)
      return fail();
    p_ += word.size();
    return true;
  }
  [[nodiscard]] bool at_null() noexcept {
    ws();
    return end_ - p_ >= 4 && std::memcmp(p_, "null", 4) == 0;
  }

  // Skips one value of any type.
  bool skip(int depth = 0) noexcept {
    if (depth > max_depth) return fail();
    ws();
    if (p_ >= end_) return fail();
    switch (*p_) {
      case '"': return skip_string();
      case '{':
        return members(depth + 1, [&](std::string_view) { return skip(depth + 1); });
      case '[':
        return elements(depth + 1, [&](int) { return skip(depth + 1); });
      case 't': return literal("true");
      case 'f': return literal("false");
      case 'n': return literal("null");
      default: {
        if (*p_ != '-' && (*p_ < '0' || *p_ > '9')) return fail();
        ++p_;
        return skip_number_rest();
      }
    }
  }

  // An object: on_member(key) reads (or skips) each member's value.
  template <class OnMember>
  bool members(int depth, OnMember&& on_member) {
    if (depth > max_depth) return fail();
    if (!eat('{')) return fail();
    if (eat('}')) return true;
    for (;;) {
      std::string_view key;
      bool escaped = false;
      if (!string(key, escaped)) return false;
      if (!eat(':')) return fail();
      if (!on_member(key)) return fail();
      if (eat(',')) continue;
      if (eat('}')) return true;
      return fail();
    }
  }
  template <class OnElement>
  bool elements(int depth, OnElement&& on_element) {
    if (depth > max_depth) return fail();
    if (!eat('[')) return fail();
    if (eat(']')) return true;
    for (int i = 0;; ++i) {
      if (!on_element(i)) return fail();
      if (eat(',')) continue;
      if (eat(']')) return true;
      return fail();
    }
  }

 private:
  bool skip_number_rest() noexcept {
    while (p_ < end_ && ((*p_ >= '0' && *p_ <= '9') || *p_ == '.' || *p_ == 'e' || *p_ == 'E' || *p_ == '+' ||
                         *p_ == '-'))
      ++p_;
    return true;
  }

  static int hex(char c) noexcept {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  }
  static bool hex4(std::string_view s, std::size_t i, std::uint32_t& out) noexcept {
    if (i + 4 > s.size()) return false;
    out = 0;
    for (std::size_t k = 0; k < 4; ++k) {
      const int h = hex(s[i + k]);
      if (h < 0) return false;
      out = out * 16 + static_cast<std::uint32_t>(h);
    }
    return true;
  }
  static char* utf8(std::uint32_t cp, char* w) noexcept {
    if (cp < 0x80) {
      *w++ = static_cast<char>(cp);
    } else if (cp < 0x800) {
      *w++ = static_cast<char>(0xC0 | (cp >> 6));
      *w++ = static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      *w++ = static_cast<char>(0xE0 | (cp >> 12));
      *w++ = static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      *w++ = static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      *w++ = static_cast<char>(0xF0 | (cp >> 18));
      *w++ = static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      *w++ = static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      *w++ = static_cast<char>(0x80 | (cp & 0x3F));
    }
    return w;
  }

 public:
  // JSON string escapes undone into `out`; `text` views the result. A lone
  // surrogate becomes U+FFFD, as decoders of model output do. Every escape
  // is longer than what it stands for, so `out` is grown to `raw`'s size
  // (never shrunk: resizing costs more than the unescape of a token) and
  // written through a pointer, no push_back per escape.
  static bool unescape(std::string_view raw, std::string& out, std::string_view& text) {
    if (out.size() < raw.size()) out.resize(raw.size());
    char* const start = out.data();
    char* w = start;
    const std::size_t n = raw.size();
    for (std::size_t i = 0; i < n; ++i) {
      if (raw[i] != '\\') {  // the run up to the next escape, at once
        const std::size_t bs = raw.find('\\', i);
        const std::size_t stop = bs == std::string_view::npos ? n : bs;
        std::memcpy(w, raw.data() + i, stop - i);
        w += stop - i;
        i = stop - 1;
        continue;
      }
      if (++i >= n) return false;
      switch (raw[i]) {
        case '"': *w++ = '"'; break;
        case '\\': *w++ = '\\'; break;
        case '/': *w++ = '/'; break;
        case 'b': *w++ = '\b'; break;
        case 'f': *w++ = '\f'; break;
        case 'n': *w++ = '\n'; break;
        case 'r': *w++ = '\r'; break;
        case 't': *w++ = '\t'; break;
        case 'u': {
          std::uint32_t cp = 0;
          if (!hex4(raw, i + 1, cp)) return false;
          i += 4;
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            std::uint32_t lo = 0;
            if (i + 2 < n && raw[i + 1] == '\\' && raw[i + 2] == 'u' && hex4(raw, i + 3, lo) && lo >= 0xDC00 &&
                lo <= 0xDFFF) {
              cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
              i += 6;
            } else {
              cp = 0xFFFD;
            }
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            cp = 0xFFFD;
          }
          w = utf8(cp, w);
          break;
        }
        default: return false;
      }
    }
    text = std::string_view(start, static_cast<std::size_t>(w - start));
    return true;
  }

 private:
  const char* p_;
  const char* end_;
  bool ok_ = true;
};

// The bytes of a JSON string body, by what the shape cache's scan does
// with them: 0 goes on, 1 is a quote, 2 a backslash, 3 a control character.
inline constexpr auto string_byte_class = [] {
  struct table {
    std::uint8_t v[256];
    constexpr std::uint8_t operator[](std::size_t i) const noexcept { return v[i]; }
  } t{};
  for (int i = 0; i < 0x20; ++i) t.v[i] = 3;
  t.v[static_cast<unsigned char>('"')] = 1;
  t.v[static_cast<unsigned char>('\\')] = 2;
  return t;
}();

}  // namespace detail

class sse_parser {
 public:
  // Throws keel::invalid_options if `o` is invalid.
  explicit sse_parser(const sse_options& o = {}) : options_((keel::detail::require_valid(o.validate()), o)) {}

  // Parses `bytes`, the next piece of the body, calling on(const
  // chat_chunk&) -> bool for each event completed; a false return stops
  // (the rest of `bytes` is dropped, and so is the stream: call reset()
  // before reusing the parser). OutOfRange for an over-long event.
  template <class On>
  absl::Status feed(std::string_view bytes, On&& on) {
    absl::Status s = feed_piece(bytes, on);
    // The event's data may still be a view into `bytes`: kept, it is copied.
    if (data_in_view_) {
      data_.assign(data_view_.data(), data_view_.size());
      data_in_view_ = false;
    }
    return s;
  }

  // Starts a new stream: what was buffered is dropped.
  void reset() noexcept {
    line_.clear();
    stash_len_ = 0;
    data_.clear();
    data_in_view_ = false;
    event_.clear();
    has_data_ = false;
    skip_lf_ = false;
    stopped_ = false;
    done_ = false;
    shape_.clear();
    shape_prefix_ = 0;
    shape_valid_ = false;
    shape_line_ = false;
    shape_hits_ = 0;
  }

  // `data: [DONE]` was seen.
  [[nodiscard]] bool done() const noexcept { return done_; }

  // Events read through the shape cache since construction or reset() (for
  // tests and diagnostics: the rest were read in full).
  [[nodiscard]] std::size_t shape_cache_hits() const noexcept { return shape_hits_; }

  // Reads one event's data as a chat completion chunk (also for callers
  // that have the data already). Views into `data` and the parser's buffer.
  [[nodiscard]] chat_chunk read(std::string_view data, bool error_event = false) {
    chat_chunk c;
    c.data = data;
    if (data == "[DONE]") {
      c.kind = chunk_kind::done;
      return c;
    }
    detail::json_reader j(data.data(), data.data() + data.size());
    bool has_content = false, has_role = false, has_error = false;
    plain_ = plain_shape{};
    const bool parsed = j.members(0, [&](std::string_view key) -> bool {
      if (key == "choices") {
        ++plain_.choices_keys;
        return j.elements(1, [&](int i) {
          plain_.choices = i + 1;
          return i == 0 ? choice(j, c, has_content, has_role) : j.skip(2);
        });
      }
      if (key == "usage") {
        if (j.at_null()) return j.literal("null");
        c.has_usage = true;
        return j.members(1, [&](std::string_view k) {
          if (k == "prompt_tokens") return j.integer(c.usage.prompt_tokens);
          if (k == "completion_tokens") return j.integer(c.usage.completion_tokens);
          if (k == "total_tokens") return j.integer(c.usage.total_tokens);
          return j.skip(2);
        });
      }
      if (key == "error") {
        has_error = true;
        if (j.at('"')) return j.text(c.text, error_scratch_);
        if (j.at_null()) {
          has_error = false;
          return j.literal("null");
        }
        return j.members(1, [&](std::string_view k) {
          if (k == "message") return j.at('"') ? j.text(c.text, error_scratch_) : j.skip(2);
          if (k == "type") return j.at('"') ? j.text(c.error_type, type_scratch_) : j.skip(2);
          if (k == "code") {
            if (j.at('"')) return c.error_type.empty() ? j.text(c.error_type, type_scratch_) : j.skip(2);
            return j.integer(c.error_code);
          }
          return j.skip(2);
        });
      }
      return j.skip(1);
    });
    if (!parsed || !j.ok() || !j.at_end()) {
      c = chat_chunk{};
      c.data = data;
      c.kind = error_event ? chunk_kind::error : chunk_kind::invalid;
      if (error_event) c.text = data;
      return c;
    }
    if (has_error || error_event) {
      c.kind = chunk_kind::error;
      if (c.text.empty() && error_event) c.text = data;
    } else if (has_content) {
      c.kind = chunk_kind::content;
    } else if (c.has_usage) {
      c.kind = chunk_kind::usage;
    } else if (has_role) {
      c.kind = chunk_kind::role;
    } else {
      c.kind = chunk_kind::empty;
    }
    return c;
  }

 private:
  static const char* find_eol(const char* p, const char* end) noexcept {
    // Most bodies use LF; CR alone is rare, so look for LF first and then
    // for a CR before it.
    const void* lf = std::memchr(p, '\n', static_cast<std::size_t>(end - p));
    const char* stop = lf != nullptr ? static_cast<const char*>(lf) : end;
    const void* cr = std::memchr(p, '\r', static_cast<std::size_t>(stop - p));
    return cr != nullptr ? static_cast<const char*>(cr) : stop;
  }

  template <class On>
  absl::Status feed_piece(std::string_view bytes, On& on) {
    const char* p = bytes.data();
    const char* const end = p + bytes.size();
    if (stopped_ || p == end) return absl::OkStatus();
    if (stash_len_ != 0) {
      absl::Status s = resume(p, end, on);
      if (!s.ok() || stopped_) return s;
    }
    return scan(p, end, on, true);
  }

  // The line split, with the shape cache's fast path at each event's start.
  // `stash`: a piece that ends inside an event matching the cached shape so
  // far leaves its bytes in stash_ (resume() goes on with the next piece)
  // instead of in the line buffer.
  template <class On>
  absl::Status scan(const char* p, const char* const end, On& on, bool stash) {
    if (skip_lf_ && p < end) {  // a CR LF split between two pieces
      if (*p == '\n') ++p;
      skip_lf_ = false;
    }
    chat_chunk c;  // a hit sets kind, text and data, the rest stays as constructed
    while (p < end) {
      if (shape_line_ && line_.empty() && !has_data_ && event_.empty()) {
        const char* past = nullptr;
        const shape_match m = same_shape_event(p, end, past, c);
        if (m == shape_match::hit || m == shape_match::hit_cr) {
          p = past;
          // The next event's cache lines, while this one is handed over: its
          // first load was where the parser waited (about 4%, BM_Sse_Parse).
          __builtin_prefetch(p + 64);
          __builtin_prefetch(p + 128);
          __builtin_prefetch(p + 192);
          if (m == shape_match::hit_cr) skip_lf_ = true;
          ++shape_hits_;
          if (!on(static_cast<const chat_chunk&>(c))) {
            stopped_ = true;
            return absl::OkStatus();
          }
          continue;
        }
        if (m == shape_match::more && stash && may_stash(static_cast<std::size_t>(end - p))) {
          stash_len_ = 0;
          stash_append(p, static_cast<std::size_t>(end - p));
          return absl::OkStatus();
        }
      }
      // The next line end: LF, CR or CR LF.
      const char* eol = find_eol(p, end);
      if (eol == end) {  // the line goes on in the next piece
        if (line_.size() + static_cast<std::size_t>(end - p) > options_.max_event_bytes) return too_long();
        line_.append(p, static_cast<std::size_t>(end - p));
        break;
      }
      std::string_view line;
      if (line_.empty()) {
        line = std::string_view(p, static_cast<std::size_t>(eol - p));
      } else {
        line_.append(p, static_cast<std::size_t>(eol - p));
        line = line_;
      }
      const char* next = eol + 1;
      if (*eol == '\r') {
        if (next < end) {
          if (*next == '\n') ++next;
        } else {
          skip_lf_ = true;
        }
      }
      p = next;
      absl::Status s = on_line(line, line.data() != line_.data(), on);
      line_.clear();
      if (!s.ok()) return s;
      if (stopped_) return absl::OkStatus();
    }
    return absl::OkStatus();
  }

  // The previous piece ended inside an event that matched the cached shape
  // so far; stash_ holds its bytes. What the event needs of this piece is
  // copied after them (at first what a body of up to 32 bytes needs) and
  // the event matched again: a hit is handed over and `p` moves past it;
  // `more` with all of the piece taken waits for the next piece; anything
  // else feeds the stashed bytes to the line split as the piece they came
  // in (where pieces end changes nothing) and `p` stays, so every byte is
  // read as it would have been without the stash.
  template <class On>
  absl::Status resume(const char*& p, const char* const end, On& on) {
    const std::size_t had = stash_len_, avail = static_cast<std::size_t>(end - p);
    const std::size_t limit = stash_limit();
    std::size_t taken = 0;
    shape_match m = shape_match::miss;
    const char* past = nullptr;
    chat_chunk c;
    for (std::size_t want = std::min(limit, shape_.size() + 32);; want = limit) {
      const std::size_t upto = want > had ? std::min(avail, want - had) : 0;
      if (upto > taken) {
        stash_append(p + taken, upto - taken);
        taken = upto;
      }
      m = same_shape_event(stash_.data(), stash_.data() + stash_len_, past, c, had);
      if (m != shape_match::more || taken == avail || want == limit) break;
    }
    if (m == shape_match::hit || m == shape_match::hit_cr) {
      const std::size_t used = static_cast<std::size_t>(past - stash_.data()) - had;
      p += used;
      if (m == shape_match::hit_cr) {  // CR LF CR at the end of what was taken: an LF next is skipped
        if (p == end) {
          skip_lf_ = true;
        } else if (*p == '\n') {
          ++p;
        }
      }
      ++shape_hits_;
      const bool go_on = on(static_cast<const chat_chunk&>(c));
      stash_len_ = 0;
      if (!go_on) stopped_ = true;
      return absl::OkStatus();
    }
    if (m == shape_match::more && taken == avail && may_stash(stash_len_)) {
      p = end;
      return absl::OkStatus();
    }
    stash_len_ = had;
    absl::Status s = scan(stash_.data(), stash_.data() + had, on, false);
    if (data_in_view_) {  // a view into stash_, about to be cleared
      data_.assign(data_view_.data(), data_view_.size());
      data_in_view_ = false;
    }
    stash_len_ = 0;
    return s;
  }

  absl::Status too_long() {
    stopped_ = true;
    return absl::OutOfRangeError(
        absl::StrCat("keel::http: server-sent event over ", options_.max_event_bytes, " bytes"));
  }

  // `in_piece`: the line is a view into the piece being fed (not line_).
  template <class On>
  absl::Status on_line(std::string_view line, bool in_piece, On& on) {
    if (line.empty()) return dispatch(on);
    if (line.size() >= 5 && std::memcmp(line.data(), "data:", 5) == 0) {
      std::string_view value = line.substr(5);
      if (!value.empty() && value.front() == ' ') value.remove_prefix(1);
      return on_data(value, in_piece);
    }
    if (line.front() == ':') {
      chat_chunk c;
      c.kind = chunk_kind::keepalive;
      c.data = line.substr(1);
      if (!on(static_cast<const chat_chunk&>(c))) stopped_ = true;
      return absl::OkStatus();
    }
    const std::size_t colon = line.find(':');
    const std::string_view field = line.substr(0, colon);
    std::string_view value = colon == std::string_view::npos ? std::string_view{} : line.substr(colon + 1);
    if (!value.empty() && value.front() == ' ') value.remove_prefix(1);
    if (field == "data") return on_data(value, false);
    if (field == "event") {
      event_.assign(value.data(), value.size());
    }
    // id, retry and unknown fields: nothing a chat stream needs.
    return absl::OkStatus();
  }

  // A data line: the event's first, from the piece, is kept as a view
  // (copied by feed() if the event is not dispatched within the piece).
  absl::Status on_data(std::string_view value, bool in_piece) {
    const std::size_t have = data_in_view_ ? data_view_.size() : data_.size();
    if (have + value.size() + 1 > options_.max_event_bytes) return too_long();
    if (!has_data_ && in_piece) {
      data_view_ = value;
      data_in_view_ = true;
      has_data_ = true;
      return absl::OkStatus();
    }
    if (data_in_view_) {
      data_.assign(data_view_.data(), data_view_.size());
      data_in_view_ = false;
    }
    if (has_data_) data_.push_back('\n');
    data_.append(value.data(), value.size());
    has_data_ = true;
    return absl::OkStatus();
  }

  template <class On>
  absl::Status dispatch(On& on) {
    if (!has_data_) {  // an event without data is not dispatched (the SSE rule)
      event_.clear();
      return absl::OkStatus();
    }
    const bool error_event = event_ == "error";
    const std::string_view data = data_in_view_ ? data_view_ : std::string_view(data_);
    chat_chunk c;
    if (options_.shape_cache && !error_event && same_shape(data, c)) {
      ++shape_hits_;
    } else {
      c = read(data, error_event);
      if (options_.shape_cache && !error_event) learn_shape(data, c);
    }
    if (c.kind == chunk_kind::done) done_ = true;
    // The callback first: clearing data_ writes its terminator over the
    // first byte c.data (and a text at its start) views.
    const bool go_on = on(c);
    data_.clear();
    data_in_view_ = false;
    event_.clear();
    has_data_ = false;
    if (!go_on) stopped_ = true;
    return absl::OkStatus();
  }

  // The shape cache's fast path: data_ is the cached prefix, a string body,
  // the cached suffix (see the header comment for why this is exact).
  bool same_shape(std::string_view data, chat_chunk& c) {
    if (!shape_valid_) return false;
    const std::size_t pre = shape_prefix_, suf = shape_suffix();
    const std::size_t n = data.size();
    if (n <= pre + suf) return false;  // an empty string is no token: read in full
    const char* d = data.data();
    const char* s = shape_.data() + 6;  // past "data: "
    if (std::memcmp(d, s, pre) != 0 || std::memcmp(d + n - suf, s + pre, suf) != 0) return false;
    const char* const body = d + pre;
    const char* const stop = d + n - suf;
    bool escaped = false;
    const char* q = scan_body(body, stop, escaped);
    if (q != stop) return false;  // a raw quote or control character, or the closing quote escaped
    return hand_over(body, q, escaped, data, c);
  }

  // Scans a JSON string body from `p`: returns the first unescaped quote or
  // control character (raw, or after a backslash: unescape refuses it
  // anyway), `end` when the bytes run out between characters, nullptr when
  // they run out after a backslash (its escape letter is beyond `end`).
  // `escaped`: a backslash was seen. One table load per byte (an eight-byte
  // word scan measured slower on tokens of a few bytes).
  static const char* scan_body(const char* p, const char* end, bool& escaped) noexcept {
    const auto& cls = detail::string_byte_class;
    for (;;) {
      while (p < end && cls[static_cast<unsigned char>(*p)] == 0) ++p;
      if (p == end) return end;
      if (cls[static_cast<unsigned char>(*p)] != 2) return p;  // a quote, or a control character
      escaped = true;
      if (++p == end) return nullptr;
      if (cls[static_cast<unsigned char>(*p)] == 3) return p;
      ++p;
    }
  }

  // The content chunk of a matched event: its text is the body, unescaped if need be.
  bool hand_over(const char* body, const char* q, bool escaped, std::string_view data, chat_chunk& c) {
    const std::string_view raw(body, static_cast<std::size_t>(q - body));
    if (escaped) {
      if (!detail::json_reader::unescape(raw, text_scratch_, c.text)) return false;  // read in full: invalid
      if (c.text.empty()) return false;
    } else {
      c.text = raw;
    }
    c.kind = chunk_kind::content;
    c.data = data;
    return true;
  }

  std::size_t shape_suffix() const noexcept { return shape_.size() - 6 - shape_prefix_ - 2; }

  // The shape cache on a whole event, line split included: `data: `, the
  // cached prefix, a string body, the cached suffix, and a blank line (LF LF
  // or CR LF CR LF). Neither the cached bytes (shape_line_) nor the body (no
  // control characters) have a line end, so this is exactly the one-line
  // event the line split would find and dispatch; then same_shape's
  // reasoning holds. shape_ holds `data: `, the prefix, the suffix and LF LF,
  // so the common event is two comparisons and the body scan. hit: `past`
  // is after the event; more: every byte to `end` is as such an event would
  // have it and it goes on past `end`; hit_cr: the bytes end in CR LF CR,
  // where the line split dispatches (an LF next is skipped, skip_lf_).
  enum class shape_match : std::uint8_t { hit, hit_cr, miss, more };
  // `known`: how many leading bytes are already known to match (a stash's).
  // Always inlined: out of line, `past` and `c` go through memory (a few
  // percent of BM_Sse_Parse, 2026-12-06).
  [[gnu::always_inline]] shape_match same_shape_event(const char* p, const char* end, const char*& past, chat_chunk& c,
                                                      std::size_t known = 0) {
    using m = shape_match;
    const std::size_t head = 6 + shape_prefix_, suf = shape_suffix();
    const std::size_t avail = static_cast<std::size_t>(end - p);
    const char* const s = shape_.data();
    known = std::min(known, std::min(avail, head));
    if (avail < head) return std::memcmp(p + known, s + known, avail - known) == 0 ? m::more : m::miss;
    if (std::memcmp(p + known, s + known, head - known) != 0) return m::miss;
    const char* const body = p + head;
    bool escaped = false;
    const char* const q = scan_body(body, end, escaped);
    if (q == nullptr || q == end) return m::more;
    if (*q != '"' || q == body) return m::miss;
    const std::size_t rest = static_cast<std::size_t>(end - q);
    const char* const sx = s + head;  // the suffix, then LF LF
    m verdict = m::hit;
    if (rest >= suf + 2 && std::memcmp(q, sx, suf + 2) == 0) {
      past = q + suf + 2;
    } else {
      if (rest < suf) return std::memcmp(q, sx, rest) == 0 ? m::more : m::miss;
      if (std::memcmp(q, sx, suf) != 0) return m::miss;
      const char* const e = q + suf;  // the blank line: not LF LF, or not all there
      const std::size_t r = rest - suf;
      if (r < 2 && std::memcmp(e, "\n", r) == 0) return m::more;
      if (r >= 4 && std::memcmp(e, "\r\n\r\n", 4) == 0) {
        past = e + 4;
      } else if (r == 3 && std::memcmp(e, "\r\n\r", 3) == 0) {
        past = end;
        verdict = m::hit_cr;
      } else {
        return r < 3 && std::memcmp(e, "\r\n\r", r) == 0 ? m::more : m::miss;
      }
    }
    const std::size_t n = static_cast<std::size_t>(q + suf - p - 6);
    // An event the line split would refuse as over-long is left to it.
    if (n + 1 > options_.max_event_bytes) return m::miss;
    if (!hand_over(body, q, escaped, std::string_view(p + 6, n), c)) return m::miss;
    return verdict;
  }

  // How many bytes of one event the stash holds at most: the cached bytes,
  // a blank line, and a body of up to 512 bytes (a longer token is rare and
  // takes the line split).
  std::size_t stash_limit() const noexcept { return shape_.size() + 2 + 512; }
  // Whether `n` bytes of an unfinished event may wait in the stash: the line
  // split would not have refused them as over-long (it reports that in the
  // piece that brings them).
  bool may_stash(std::size_t n) const noexcept { return n <= stash_limit() && n + 1 <= options_.max_event_bytes; }
  // stash_ is a buffer grown to the limit once and never shrunk (bytes past
  // stash_len_ are unused): a copy into it is a memcpy, not a string operation.
  void stash_append(const char* p, std::size_t n) {
    if (stash_.size() < stash_len_ + n) stash_.resize(std::max(stash_limit(), stash_len_ + n));
    std::memcpy(stash_.data() + stash_len_, p, n);
    stash_len_ += n;
  }

  // After a full read: a plain content chunk (one choice, a delta with its
  // content alone, no finish_reason, usage or error) becomes the cached shape.
  void learn_shape(std::string_view data, const chat_chunk& c) {
    const bool plain = c.kind == chunk_kind::content && plain_.open != nullptr && plain_.choices_keys == 1 &&
                       plain_.choices == 1 && plain_.deltas == 1 && plain_.delta_keys == 1 &&
                       c.finish_reason.empty() && !c.has_usage && c.error_type.empty() && c.error_code == 0 &&
                       c.data.data() == data.data();
    if (!plain) return;
    const char* d = data.data();
    shape_prefix_ = static_cast<std::size_t>(plain_.open + 1 - d);
    shape_.assign("data: ");
    shape_.append(d, shape_prefix_);
    shape_.append(plain_.close, static_cast<std::size_t>(d + data.size() - plain_.close));
    shape_valid_ = true;
    shape_line_ = std::memchr(shape_.data(), '\n', shape_.size()) == nullptr &&
                  std::memchr(shape_.data(), '\r', shape_.size()) == nullptr;
    shape_.append("\n\n");
  }

  bool choice(detail::json_reader& j, chat_chunk& c, bool& has_content, bool& has_role) {
    return j.members(2, [&](std::string_view key) -> bool {
      if (key == "delta" || key == "message") {
        ++plain_.deltas;
        if (j.at_null()) return j.literal("null");
        return j.members(3, [&](std::string_view k) -> bool {
          ++plain_.delta_keys;
          if (k == "content") {
            if (!j.at('"')) return j.skip(4);  // null, or a structured content array
            plain_.open = j.pos();
            if (!j.text(c.text, text_scratch_)) return false;
            plain_.close = j.pos() - 1;
            has_content = !c.text.empty();
            return true;
          }
          if (k == "role") {
            has_role = true;
            return j.skip(4);
          }
          return j.skip(4);
        });
      }
      if (key == "finish_reason") {
        if (j.at('"')) return j.text(c.finish_reason, finish_scratch_);
        return j.skip(3);
      }
      return j.skip(3);
    });
  }

  sse_options options_;
  std::string line_;   // the unfinished line of the previous piece
  std::string stash_;  // or the unfinished event that matches the cached shape so far: its first stash_len_ bytes
  std::size_t stash_len_ = 0;
  std::string data_;   // the event's data lines so far (unless data_in_view_)
  std::string_view data_view_;  // the event's one data line, in the piece being fed
  bool data_in_view_ = false;
  std::string event_;  // the event's `event:` field
  std::string text_scratch_, error_scratch_, type_scratch_, finish_scratch_;
  // What the last full read saw of the chunk's structure, for the cache.
  struct plain_shape {
    const char* open = nullptr;   // choice 0's content string: its opening quote
    const char* close = nullptr;  // and its closing quote
    int choices_keys = 0, choices = 0, deltas = 0, delta_keys = 0;
  };
  plain_shape plain_;
  std::string shape_;             // `data: `, the cached prefix, the cached suffix, LF LF
  std::size_t shape_prefix_ = 0;  // the prefix's length (through the opening quote)
  bool shape_valid_ = false;
  bool shape_line_ = false;       // valid, and no line end in it: same_shape_event applies
  std::size_t shape_hits_ = 0;
  bool has_data_ = false;
  bool skip_lf_ = false;
  bool stopped_ = false;
  bool done_ = false;
};

// The status an error event stands for, classified as a provider's failure
// mid-stream would be: a rate limit is throttled, an overload or server error
// transient (Unavailable), a bad request permanent. "keel::http: stream error: <message>".
[[nodiscard]] inline absl::Status error_status(const chat_chunk& c) {
  const std::string_view t = c.error_type;
  const std::int64_t code = c.error_code;
  const auto msg = absl::StrCat("keel::http: stream error: ", keel::detail::to_absl(c.text.substr(0, 256)));
  auto has = [&](std::string_view w) { return t.find(w) != std::string_view::npos; };
  if (code == 429 || has("rate_limit") || has("rate-limit") || has("quota")) return absl::ResourceExhaustedError(msg);
  if (code == 400 || code == 422 || has("invalid_request")) return absl::InvalidArgumentError(msg);
  if (code == 401 || code == 403 || has("authentication") || has("permission")) return absl::PermissionDeniedError(msg);
  if (code == 404 || has("not_found")) return absl::NotFoundError(msg);
  return absl::UnavailableError(msg);  // server_error, overloaded, timeouts, unknown
}

}  // namespace keel::http
