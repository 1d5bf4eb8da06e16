// gateway/http_request.hpp — turns the bytes a client sends into one HTTP/1.1
// request or a refusal, with the front door's limits: Boost.Beast's request
// parser does the framing (request line, fields, Content-Length, chunked),
// and a few checks around it refuse what Beast would let through.
//
// Why Beast: a hand-written HTTP parser is a request-smuggling surface that
// people copy; Beast's is widely deployed, maintained, ships with Debian's
// Boost, and has the limits built in (header_limit, body_limit). What it is
// lenient about, this adapter checks on the bytes as they arrive:
//
//   line endings   a bare CR or LF anywhere in the head: 400 at once (Beast
//                  would wait for a CRLF CRLF that never comes: a 408 after
//                  header_timeout); empty lines before a request are skipped
//   field values   a NUL or another control byte: 400 naming the field; an
//                  obsolete line fold: 400 (Beast would unfold it)
//   sizes          a head over `max_header_bytes` or with more than 100
//                  fields: 431; a chunk header or trailer section over 4 KiB:
//                  400 (Beast buffers those lines without a limit)
//   framing        Content-Encoding other than identity, or a
//                  Transfer-Encoding other than one `chunked`: 415 before the
//                  body is read (Beast would read a `gzip` body as none);
//                  Transfer-Encoding with HTTP/1.0: 400; the request target
//                  must be an origin form of printable bytes; a version other
//                  than 1.0 or 1.1: 505
//
// Beast refuses the rest itself (both framings, lengths that disagree, a
// body or a chunk over `max_body_bytes`: 413 as soon as the length is known).
// Header names and values are kept as the bytes that were sent (values
// trimmed of spaces and tabs); nothing is decoded or inflated, so memory does
// not grow with what a client sends. The outcome does not depend on how the
// bytes are split into reads (tests/fuzz/gateway_request_fuzz.cpp checks it).
//
// Example:
//
//   gateway::http_request_parser p(64 * 1024, 16 * 1024);
//   std::size_t used = p.feed("GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
//   if (p.current() == gateway::http_request_parser::state::done) {
//     gateway::http_request r = p.take();  // r.path == "/healthz"; bytes after `used` are the next request's
//   }
//
// Thread-safety: http_request is a value; a parser belongs to one
// thread at a time (the server hands a connection's parser between its I/O
// threads through the connection's strand).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <boost/asio/buffer.hpp>
#include <boost/beast/core/error.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/field.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/string_body.hpp>

#include "text.hpp"

namespace gateway {

// A complete request, as the bytes were sent: nothing is decoded.
struct http_request {
  std::string method, target, path, query, version;
  std::vector<std::pair<std::string, std::string>> headers;  // in order; values trimmed of spaces and tabs
  std::string body;                                          // the decoded chunked body, or the raw one
  bool keep_alive = true;
  bool expect_continue = false;

  // The first header called `name` (case-insensitive), or nullopt.
  [[nodiscard]] std::optional<std::string_view> header(std::string_view name) const;
  // How many headers are called `name`.
  [[nodiscard]] int header_count(std::string_view name) const;
  // The first query parameter called `name` (exact bytes, no %xx decoding).
  [[nodiscard]] std::optional<std::string_view> query_param(std::string_view name) const;
};

// A request the server refused itself, before any handler.
struct http_refusal {
  int status = 400;
  std::string reason;   // a stable name: malformed, headers_too_large, body_too_large, encoded_body,
                        // header_timeout, body_timeout, busy, unsupported_version
  std::string message;  // for the client: what was wrong and which limit
  std::string path;     // the request's path, when its request line was read
};

namespace detail {

[[nodiscard]] inline char ascii_lower(char c) noexcept { return c >= 'A' && c <= 'Z' ? static_cast<char>(c + 32) : c; }

[[nodiscard]] inline bool iequals(std::string_view a, std::string_view b) noexcept {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (ascii_lower(a[i]) != ascii_lower(b[i])) return false;
  }
  return true;
}

[[nodiscard]] inline std::string_view trim_ows(std::string_view s) noexcept {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// Beast 1.74 speaks boost::string_view.
template <class View>
[[nodiscard]] std::string_view std_view(const View& v) noexcept {
  return {v.data(), v.size()};
}

}  // namespace detail

// Incremental HTTP/1.1 request framing with limits: feed() bytes as they
// arrive; the outcome does not depend on how they were split. Bytes after a
// complete request are not consumed (the next request's, pipelined).
class http_request_parser {
 public:
  enum class state : std::uint8_t { head, body, done, failed };

  explicit http_request_parser(std::size_t max_body_bytes = 64 * 1024, std::size_t max_header_bytes = 16 * 1024)
      : max_body_(max_body_bytes), max_head_(max_header_bytes) {}

  // Consumes from `bytes` what belongs to this request; returns how many.
  std::size_t feed(std::string_view bytes) {
    std::size_t used = 0;
    if (state_ == state::head) {
      used = scan_head(bytes);
      if (state_ != state::head || !head_seen_) return used;
      parse_head();
    }
    if (state_ == state::body) return used + feed_body(bytes.substr(used));
    return used;
  }

  [[nodiscard]] state current() const noexcept { return state_; }
  [[nodiscard]] bool started() const noexcept { return started_; }  // a byte of a request arrived
  [[nodiscard]] bool head_complete() const noexcept { return head_ok_; }
  [[nodiscard]] const http_request& request() const noexcept { return req_; }
  [[nodiscard]] http_request take() { return std::move(req_); }
  [[nodiscard]] const http_refusal& error() const noexcept { return err_; }
  [[nodiscard]] std::size_t body_bytes() const noexcept {
    return state_ == state::done ? req_.body.size() : beast_ ? beast_->get().body().size() : 0;
  }

  void reset() { *this = http_request_parser(max_body_, max_head_); }

 private:
  using beast_parser = boost::beast::http::request_parser<boost::beast::http::string_body>;
  // What Beast may hold unconsumed in a body: a chunk-size line with its
  // extensions, or the trailer section. Fed in windows of this size, the
  // verdict on a longer one does not depend on how the bytes came.
  static constexpr std::size_t body_window = 4096;

  std::size_t fail(int status, std::string_view reason, std::string message) {
    state_ = state::failed;
    err_ = {.status = status, .reason = std::string(reason), .message = std::move(message), .path = req_.path};
    return 0;
  }

  std::size_t fail_head_size() {
    return fail(431, "headers_too_large", cat("the request head exceeds ", max_head_, " bytes (max_header_bytes)"));
  }

  // The head's bytes, checked one by one as they come (lexically: the
  // framing is Beast's) and kept for Beast until the blank line ends it.
  std::size_t scan_head(std::string_view in) {
    std::size_t i = 0;
    // Empty lines before a request line are ignored (RFC 9112 2.2); CRLF only.
    if (!started_) {
      while (i < in.size() && (in[i] == '\r' || in[i] == '\n')) {
        if (in[i] == '\n' && !crlf_pending_) return i + fail(400, "malformed", "a bare LF before the request");
        crlf_pending_ = in[i] == '\r';
        ++i;
      }
      if (i == in.size()) return i;
      if (crlf_pending_) return i + fail(400, "malformed", "a bare CR before the request");
      started_ = true;
    }
    for (; i < in.size(); ++i) {
      const char c = in[i];
      head_.push_back(c);
      if (cr_) {
        cr_ = false;
        if (c != '\n') return i + 1 + fail(400, "malformed", "a bare CR in the request head");
        if (end_of_line()) return i + 1;  // the head is complete, or refused
        if (head_.size() >= max_head_ + 4) return i + 1 + fail_head_size();
        continue;
      }
      const auto u = static_cast<unsigned char>(c);
      if (c == '\r') {
        cr_ = true;
      } else if (c == '\n') {
        return i + 1 + fail(400, "malformed", "a bare LF in the request head: lines end with CRLF");
      } else if (u == 0 || (u < 0x20 && c != '\t') || u == 0x7f) {
        if (lines_ == 0) return i + 1 + fail(400, "malformed", "the request line contains a control byte");
        return i + 1 + fail(400, "malformed",
                            cat("the header '", name_, "' contains ", u == 0 ? "a NUL byte" : "a control byte"));
      } else {
        if (lines_ > 0 && line_bytes_ == 0 && (c == ' ' || c == '\t')) {
          return i + 1 + fail(400, "malformed", "an obsolete folded header line");
        }
        if (lines_ > 0 && !colon_) {
          if (c == ':') {
            colon_ = true;
          } else if (name_.size() < 64) {
            name_.push_back(c);
          }
        }
        ++line_bytes_;
      }
      // A head of at most max_head_ bytes ends within max_head_ + 4 (its blank line).
      if (head_.size() >= max_head_ + 4) return i + 1 + fail_head_size();
    }
    return in.size();
  }

  // A CRLF ended a line; true when that ends the head (or refused it).
  bool end_of_line() {
    if (line_bytes_ == 0) {
      head_seen_ = true;
      return true;
    }
    if (lines_ == 0) peek_request_line();
    ++lines_;
    if (lines_ - 1 > 100) {
      fail(431, "headers_too_large", "the request has more than 100 header fields");
      return true;
    }
    line_bytes_ = 0;
    colon_ = false;
    name_.clear();
    return false;
  }

  // The request line, as soon as it is there: a refusal can name the path.
  void peek_request_line() {
    const std::string_view line(head_.data(), head_.size() - 2);
    const std::size_t a = line.find(' ');
    const std::size_t b = a == std::string_view::npos ? a : line.find(' ', a + 1);
    if (b == std::string_view::npos) return;
    const std::string_view target = line.substr(a + 1, b - a - 1);
    if (!printable_origin(target)) return;
    req_.path = std::string(target.substr(0, target.find('?')));
  }

  [[nodiscard]] static bool printable_origin(std::string_view target) noexcept {
    return !target.empty() && target.front() == '/' && target.size() <= 8192 &&
           std::all_of(target.begin(), target.end(), [](char c) { return c >= 0x21 && c <= 0x7e; });
  }

  // The whole head, in one piece, to Beast.
  void parse_head() {
    beast_ = std::make_unique<beast_parser>();
    beast_->header_limit(static_cast<std::uint32_t>(max_head_ + 4));
    beast_->body_limit(static_cast<std::uint64_t>(max_body_));
    beast_->eager(false);  // stop after the head: it is checked before a byte of the body is taken
    boost::beast::error_code ec;
    const std::size_t n = beast_->put(boost::asio::buffer(head_), ec);
    if (ec) {
      fail_beast(ec);
      return;
    }
    if (n != head_.size() || !beast_->is_header_done()) {
      fail(400, "malformed", "the request head could not be read");
      return;
    }
    std::string().swap(head_);
    if (!check_head()) return;
    head_ok_ = true;
    if (beast_->is_done()) {
      finish();
    } else {
      beast_->eager(true);
      state_ = state::body;
    }
  }

  void fail_beast(const boost::beast::error_code& ec) {
    namespace bh = boost::beast::http;
    if (ec == bh::error::header_limit) {
      fail_head_size();
    } else if (ec == bh::error::body_limit && !beast_->is_header_done()) {
      // A Content-Length over the limit: refused from the head alone.
      fail(413, "body_too_large",
           cat("the body is ", detail::std_view(beast_->get()[bh::field::content_length]),
               " bytes; this gateway accepts at most ", max_body_, " bytes per request (max_body_bytes)"));
    } else if (ec == bh::error::bad_version && req_.path.empty()) {
      // Not a request for a path either (HTTP/2's "PRI * HTTP/2.0"): malformed, as the old parser said.
      fail(400, "malformed", "the request target must be a path of 1-8192 printable bytes starting with '/'");
    } else if (ec == bh::error::bad_version) {
      fail(505, "unsupported_version", "only HTTP/1.1 and HTTP/1.0 are served");
    } else if (ec == bh::error::body_limit) {
      fail(413, "body_too_large",
           cat("the chunked body exceeds ", max_body_, " bytes per request (max_body_bytes); refused after ",
               beast_->get().body().size(), " bytes, before reading the rest"));
    } else {
      fail(400, "malformed", cat("the request is malformed: ", ec.message()));
    }
  }

  // What Beast accepts and the front door does not.
  bool check_head() {
    const auto& m = beast_->get();
    const std::string_view method = detail::std_view(m.method_string()), target = detail::std_view(m.target());
    if (method.empty() || method.size() > 20) {
      fail(400, "malformed", "the request method is not a token of 1-20 bytes");
      return false;
    }
    if (!printable_origin(target)) {
      fail(400, "malformed", "the request target must be a path of 1-8192 printable bytes starting with '/'");
      return false;
    }
    req_.method = std::string(method);
    req_.target = std::string(target);
    const std::size_t q = target.find('?');
    req_.path = std::string(target.substr(0, q));
    if (q != std::string_view::npos) req_.query = std::string(target.substr(q + 1));
    if (m.version() != 11 && m.version() != 10) {
      fail(505, "unsupported_version", "only HTTP/1.1 and HTTP/1.0 are served");
      return false;
    }
    req_.version = m.version() == 11 ? "HTTP/1.1" : "HTTP/1.0";
    req_.keep_alive = m.version() == 11;
    for (const auto& f : m) req_.headers.emplace_back(detail::std_view(f.name_string()), detail::trim_ows(detail::std_view(f.value())));

    if (const std::optional<std::string_view> ce = req_.header("Content-Encoding");
        ce && !detail::iequals(*ce, "identity")) {
      fail(415, "encoded_body",
           cat("Content-Encoding '", ce->substr(0, 32),
               "' is not accepted: send the body uncompressed (the gateway never inflates a body)"));
      return false;
    }
    if (const int te_count = req_.header_count("Transfer-Encoding"); te_count > 0) {
      const std::string_view te = *req_.header("Transfer-Encoding");
      if (te_count > 1 || !detail::iequals(te, "chunked")) {
        fail(415, "encoded_body", cat("Transfer-Encoding '", te.substr(0, 32), "' is not accepted: only 'chunked' is"));
        return false;
      }
      if (m.version() == 10) {
        fail(400, "malformed", "Transfer-Encoding is not defined for HTTP/1.0");
        return false;
      }
    }
    for (const auto& [n, v] : req_.headers) {
      if (detail::iequals(n, "Connection")) {
        std::string_view rest = v;
        while (!rest.empty()) {
          const std::size_t comma = rest.find(',');
          const std::string_view token = detail::trim_ows(rest.substr(0, comma));
          if (detail::iequals(token, "close")) req_.keep_alive = false;
          if (detail::iequals(token, "keep-alive") && m.version() == 10) req_.keep_alive = true;
          if (comma == std::string_view::npos) break;
          rest.remove_prefix(comma + 1);
        }
      }
      if (detail::iequals(n, "Expect") && detail::iequals(v, "100-continue")) req_.expect_continue = true;
    }
    return true;
  }

  // Body bytes to Beast, in windows; what it leaves unconsumed waits for more.
  std::size_t feed_body(std::string_view in) {
    body_in_.append(in.data(), in.size());
    std::size_t off = 0;
    while (state_ == state::body && off < body_in_.size()) {
      const std::size_t window = std::min(body_in_.size() - off, body_window);
      boost::beast::error_code ec;
      const std::size_t n = beast_->put(boost::asio::buffer(body_in_.data() + off, window), ec);
      off += n;
      if (ec == boost::beast::http::error::need_more) {
        if (n > 0) continue;
        if (window >= body_window) fail(400, "malformed", "a chunk header or the trailer fields over 4 KiB");
        break;
      }
      if (ec) {
        fail_beast(ec);
        break;
      }
      if (beast_->is_done()) {
        finish();
        break;
      }
      if (n == 0) break;
    }
    body_in_.erase(0, off);
    if (state_ != state::done) return in.size();
    // The rest is the next request's: it came with these bytes (a request
    // that ended in earlier bytes would have been done then).
    const std::size_t rest = std::min(body_in_.size(), in.size());
    std::string().swap(body_in_);
    return in.size() - rest;
  }

  void finish() {
    req_.body = std::move(beast_->get().body());
    beast_.reset();
    state_ = state::done;
  }

  std::size_t max_body_, max_head_;
  state state_ = state::head;
  bool started_ = false, crlf_pending_ = false, cr_ = false, colon_ = false, head_seen_ = false, head_ok_ = false;
  std::size_t lines_ = 0, line_bytes_ = 0;
  std::string head_, name_, body_in_;
  std::unique_ptr<beast_parser> beast_;
  http_request req_;
  http_refusal err_;
};

namespace detail {
using request_parser = http_request_parser;  // its name before the front door moved to Beast
}  // namespace detail

inline std::optional<std::string_view> http_request::header(std::string_view name) const {
  for (const auto& [n, v] : headers) {
    if (detail::iequals(n, name)) return std::string_view(v);
  }
  return std::nullopt;
}

inline int http_request::header_count(std::string_view name) const {
  int n = 0;
  for (const auto& h : headers) n += detail::iequals(h.first, name) ? 1 : 0;
  return n;
}

inline std::optional<std::string_view> http_request::query_param(std::string_view name) const {
  std::string_view rest = query;
  while (!rest.empty()) {
    const std::size_t amp = rest.find('&');
    const std::string_view pair = rest.substr(0, amp);
    const std::size_t eq = pair.find('=');
    if (pair.substr(0, eq) == name) return eq == std::string_view::npos ? std::string_view() : pair.substr(eq + 1);
    if (amp == std::string_view::npos) break;
    rest.remove_prefix(amp + 1);
  }
  return std::nullopt;
}

}  // namespace gateway
