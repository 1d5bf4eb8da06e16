// keel/provider/internal/json_reader.hpp — the small JSON reader behind the
// SSE parser (keel/provider/sse.hpp): it walks the few paths a chat
// completion chunk has (choices[0].delta.content, tool_calls[], usage,
// error) in place, without building a document, so a token costs no
// allocation. Forgiving of what it skips, exact about what it reads.
//
//   keel::detail::json_reader r(data.data(), data.data() + data.size());
//
// Thread-safety: a reader belongs to the one parse that made it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace keel::detail {

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
    return unescape_to(raw, out.data(), text);
  }
  // The same into `start`, which has room for raw.size() bytes.
  static bool unescape_to(std::string_view raw, char* const start, std::string_view& text) {
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

}  // namespace keel::detail
