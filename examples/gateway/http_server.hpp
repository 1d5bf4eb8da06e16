// gateway/http_server.hpp — the gateway's HTTP/1.1 front door, written for
// hostile clients: every request is framed, bounded and timed here, before a
// worker thread or the gateway's logic sees a byte of it.
//
// Why not cpp-httplib's server (which the gateway used before): it reads a
// request on the worker thread that will serve it, with a timeout per recv()
// rather than per request, so clients sending one byte a second hold every
// worker and /healthz times out; its listen backlog is compiled in (5); its
// body limit holds only for a Content-Length (a chunked or gzip body is read
// and inflated whole); and it rewrites header values (a NUL truncates them,
// %xx is decoded). Here:
//
//   one reader thread   accepts (backlog `listen_backlog`) and reads every
//                       connection without blocking; a connection costs a
//                       descriptor and a buffer, not a thread, until its
//                       request is complete
//   per request         the head must arrive within `header_timeout` of its
//                       first byte, the body within `body_timeout` of the
//                       head, however the bytes trickle in (408 otherwise); a
//                       connection may sit idle between requests for
//                       `idle_timeout` (closed silently)
//   bodies              Content-Length above `max_body_bytes`: 413 before the
//                       body is read; a chunked body: 413 as soon as its chunk
//                       sizes add up past the limit; Content-Encoding (gzip...)
//                       or a Transfer-Encoding other than chunked: 415, unread.
//                       Nothing is decoded or inflated, so memory does not
//                       grow with what a client sends
//   headers             kept as the bytes that were sent (no decoding); a NUL
//                       or another control byte, an obsolete line fold, a
//                       bare CR or LF: 400; a head above `max_header_bytes`
//                       or with more than 100 fields: 431
//   workers             two lanes: `threads` for ordinary requests and
//                       `reserved_threads` only for the requests `lane_of`
//                       puts in the reserved lane (the gateway's /healthz,
//                       /metrics and /admin/*), so operators get through
//                       while the ordinary lane is full; a lane's requests
//                       waiting for a worker are bounded (`max_queue`),
//                       beyond that 503
//   streams             a response with a `stream` function is written as
//                       it is produced (chunked, each write one chunk, each
//                       within `write_timeout`); the reader thread watches
//                       the connection for a hang-up meanwhile and tells the
//                       stream at once (http_stream::client_gone)
//
// The server's own refusals go through the `refusal_handler` the owner
// gives, so they are answered (and counted) like every other reply. After a
// refusal the connection is closed; what the client still sends is read and
// discarded (at most 1 MiB, 2 s) so that it sees the answer, not a reset.
//
// Example:
//
//   gateway::http_server server({.threads = 16},
//       [](const gateway::http_request& r) { return gateway::http_response{.status = 200, .body = r.path}; },
//       [](const gateway::http_refusal& f) { return gateway::http_response{.status = f.status, .body = f.message}; });
//   absl::Status up = server.start("127.0.0.1", 0);
//   int port = server.port();
//   ...
//   server.stop();
//
// Thread-safety: start() and stop() from one controlling thread; figures()
// from any thread. The handlers run on the server's threads, concurrently:
// the request handler on the workers, the refusal handler on the reader
// thread. A connection belongs to one thread at a time (the reader, or the
// worker serving its request), handed over under a mutex.
#pragma once

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stop_token>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "keel/core/status.hpp"
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

class http_stream;

struct http_response {
  int status = 200;
  std::string content_type = "application/json";
  std::string body{};
  std::vector<std::pair<std::string, std::string>> headers{};
  // A streamed response: called on the worker with the connection's writer.
  // Its first write() sends the head (status, content_type and headers of
  // this response, chunked); the response it returns is sent instead when
  // it wrote nothing (an error before the first byte).
  std::function<http_response(http_stream&)> stream{};
};

// A streamed response's writer: each write() is one chunk of a chunked
// body, sent at once (the head with the first). The reader thread watches
// the connection meanwhile: a client that hangs up (FIN or RST) requests
// client_gone() between writes, so a stream stops without waiting for its
// next write to fail. A client that half-closes its side counts as gone.
class http_stream {
 public:
  http_stream(const http_stream&) = delete;
  http_stream& operator=(const http_stream&) = delete;

  // False: the client is gone, or did not take the bytes within the
  // server's write_timeout; the stream should stop (client_gone() says so too).
  bool write(std::string_view bytes);
  [[nodiscard]] std::stop_token client_gone() const noexcept { return gone_.get_token(); }
  [[nodiscard]] bool opened() const noexcept { return opened_; }

 private:
  friend class http_server;
  http_stream(int fd, std::chrono::milliseconds write_timeout, bool keep_alive, const http_response& head)
      : fd_(fd), write_timeout_(write_timeout), keep_alive_(keep_alive), head_(&head) {}
  // The last chunk; false if the stream failed or could not end.
  bool finish();

  int fd_;
  std::chrono::milliseconds write_timeout_;
  bool keep_alive_;
  const http_response* head_;
  bool opened_ = false;
  bool failed_ = false;
  std::string buf_;
  std::stop_source gone_;
};

// A request the server refused itself, before any handler.
struct http_refusal {
  int status = 400;
  std::string reason;   // a stable name: malformed, headers_too_large, body_too_large, encoded_body,
                        // header_timeout, body_timeout, busy, unsupported_version
  std::string message;  // for the client: what was wrong and which limit
  std::string path;     // the request's path, when its request line was read
};

struct http_server_options {
  int threads = 96;                        // workers for the ordinary lane
  int reserved_threads = 4;                // workers for the reserved lane
  int max_queue = 96;                      // complete requests waiting per lane; beyond: 503
  int max_connections = 4096;              // open connections; beyond, new ones wait in the backlog
  int listen_backlog = 1024;               // the kernel's accept queue (capped by net.core.somaxconn)
  std::size_t max_body_bytes = 64 * 1024;  // per request, after chunked decoding
  std::size_t max_header_bytes = 16 * 1024;  // request line and header fields together
  std::chrono::milliseconds header_timeout{5000};  // first byte to the end of the head
  std::chrono::milliseconds body_timeout{10000};   // end of the head to the end of the body
  std::chrono::milliseconds idle_timeout{5000};    // a kept-alive connection waiting for a request
  std::chrono::milliseconds write_timeout{5000};   // writing one response
  int max_requests_per_connection = 1000;

  [[nodiscard]] absl::Status validate() const {
    constexpr std::string_view who = "http_server_options";
    const std::pair<std::string_view, int> counts[] = {{"threads", threads},
                                                       {"reserved_threads", reserved_threads},
                                                       {"max_queue", max_queue},
                                                       {"max_connections", max_connections},
                                                       {"listen_backlog", listen_backlog},
                                                       {"max_requests_per_connection", max_requests_per_connection}};
    for (const auto& [field, n] : counts) {
      if (n < 1 || n > 1'000'000) return keel::invalid_option(who, field, "be in [1, 1000000]", n);
    }
    if (max_body_bytes < 1 || max_body_bytes > (std::size_t{1} << 30))
      return keel::invalid_option(who, "max_body_bytes", "be in [1, 1 GiB]", max_body_bytes);
    if (max_header_bytes < 256 || max_header_bytes > (std::size_t{1} << 20))
      return keel::invalid_option(who, "max_header_bytes", "be in [256, 1 MiB]", max_header_bytes);
    const std::pair<std::string_view, std::chrono::milliseconds> times[] = {{"header_timeout", header_timeout},
                                                                           {"body_timeout", body_timeout},
                                                                           {"idle_timeout", idle_timeout},
                                                                           {"write_timeout", write_timeout}};
    for (const auto& [field, t] : times) {
      if (t <= std::chrono::milliseconds::zero())
        return keel::invalid_option(who, field, "be > 0", cat(t.count(), " ms"));
    }
    return absl::OkStatus();
  }
};

// What the server holds right now.
struct http_server_figures {
  int connections = 0;      // open, whoever holds them
  int busy = 0;             // ordinary-lane workers serving a request
  int busy_reserved = 0;    // reserved-lane workers serving a request
  int queued = 0;           // complete requests waiting for an ordinary worker
  int queued_reserved = 0;  // ... for a reserved one
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

[[nodiscard]] inline bool is_tchar(char c) noexcept {
  if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')) return true;
  return std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos;
}

[[nodiscard]] inline std::string_view trim_ows(std::string_view s) noexcept {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// Incremental HTTP/1.1 request framing with limits: feed() bytes as they
// arrive; the outcome does not depend on how they were split. Bytes after a
// complete request are not consumed (the next request's, pipelined).
class request_parser {
 public:
  enum class state : std::uint8_t { head, body, done, failed };

  explicit request_parser(std::size_t max_body_bytes = 64 * 1024, std::size_t max_header_bytes = 16 * 1024)
      : max_body_(max_body_bytes), max_head_(max_header_bytes) {}

  // Consumes from `bytes` what belongs to this request; returns how many.
  std::size_t feed(std::string_view bytes) {
    std::size_t used = 0;
    while (used < bytes.size() && (state_ == state::head || state_ == state::body)) {
      used += state_ == state::head ? feed_head(bytes.substr(used)) : feed_body(bytes.substr(used));
    }
    return used;
  }

  [[nodiscard]] state current() const noexcept { return state_; }
  [[nodiscard]] bool started() const noexcept { return started_; }   // a byte of a request arrived
  [[nodiscard]] bool head_complete() const noexcept { return state_ != state::head && head_ok_; }
  [[nodiscard]] const http_request& request() const noexcept { return req_; }
  [[nodiscard]] http_request take() { return std::move(req_); }
  [[nodiscard]] const http_refusal& error() const noexcept { return err_; }
  [[nodiscard]] std::size_t body_bytes() const noexcept { return req_.body.size(); }

  void reset() { *this = request_parser(max_body_, max_head_); }

 private:
  enum class chunk_state : std::uint8_t { size_line, data, data_end, trailers };

  std::size_t fail(int status, std::string_view reason, std::string message) {
    state_ = state::failed;
    err_ = {.status = status, .reason = std::string(reason), .message = std::move(message), .path = req_.path};
    return 0;
  }

  std::size_t feed_head(std::string_view in) {
    std::size_t used = 0;
    // Empty lines before a request line are ignored (RFC 9112 2.2).
    if (!started_) {
      while (used < in.size() && (in[used] == '\r' || in[used] == '\n')) {
        if (in[used] == '\n' && !crlf_pending_) return used + fail(400, "malformed", "a bare LF before the request");
        crlf_pending_ = in[used] == '\r';
        ++used;
      }
      if (used == in.size()) return used;
      if (crlf_pending_) return used + fail(400, "malformed", "a bare CR before the request");
      started_ = true;
    }
    const std::size_t before = head_.size();
    // A head of at most max_head_ bytes ends within max_head_ + 4 (its
    // blank line): never buffer more than that.
    const std::size_t room = max_head_ + 4 - std::min(max_head_ + 4, head_.size());
    const std::string_view take = in.substr(used, room);
    head_.append(take.data(), take.size());
    // Look for the blank line from a little before the new bytes.
    const std::size_t from = before >= 3 ? before - 3 : 0;
    const std::size_t end = head_.find("\r\n\r\n", from);
    if (end == std::string::npos) {
      if (head_.size() >= max_head_ + 4) {
        return used + take.size() +
               fail(431, "headers_too_large", cat("the request head exceeds ", max_head_, " bytes (max_header_bytes)"));
      }
      if (!req_line_done_) peek_request_line();
      return used + take.size();
    }
    if (end > max_head_) {
      return used + take.size() +
             fail(431, "headers_too_large", cat("the request head exceeds ", max_head_, " bytes (max_header_bytes)"));
    }
    const std::size_t head_bytes = end + 4;
    const std::size_t consumed = used + (head_bytes - before);
    head_.resize(end);
    parse_head();
    return consumed;
  }

  // The request line, as soon as it is there: a refusal can name the path.
  void peek_request_line() {
    const std::size_t eol = head_.find("\r\n");
    if (eol == std::string::npos) return;
    const std::string_view line(head_.data(), eol);
    const std::size_t a = line.find(' ');
    const std::size_t b = a == std::string_view::npos ? a : line.find(' ', a + 1);
    if (b == std::string_view::npos) return;
    const std::string_view target = line.substr(a + 1, b - a - 1);
    if (target.empty() || target.front() != '/' || target.size() > 8192) return;
    for (char c : target) {
      if (c < 0x21 || c > 0x7e) return;
    }
    req_.path = std::string(target.substr(0, target.find('?')));
    req_line_done_ = true;
  }

  void parse_head() {
    std::string_view rest(head_);
    // Every line ends in CRLF; a lone CR or LF anywhere is refused.
    std::vector<std::string_view> lines;
    for (;;) {
      const std::size_t eol = rest.find("\r\n");
      const std::string_view line = rest.substr(0, eol);
      if (line.find_first_of("\r\n") != std::string_view::npos) {
        fail(400, "malformed", "a bare CR or LF in the request head");
        return;
      }
      lines.push_back(line);
      if (eol == std::string_view::npos) break;
      rest.remove_prefix(eol + 2);
    }
    if (!parse_request_line(lines.front())) return;
    if (lines.size() - 1 > 100) {
      fail(431, "headers_too_large", "the request has more than 100 header fields");
      return;
    }
    for (std::size_t i = 1; i < lines.size(); ++i) {
      if (!parse_field(lines[i])) return;
    }
    decide_framing();
  }

  bool parse_request_line(std::string_view line) {
    const std::size_t a = line.find(' ');
    const std::size_t b = a == std::string_view::npos ? a : line.find(' ', a + 1);
    if (b == std::string_view::npos || line.find(' ', b + 1) != std::string_view::npos) {
      fail(400, "malformed", "the request line must be 'METHOD /path HTTP/1.1'");
      return false;
    }
    const std::string_view method = line.substr(0, a), target = line.substr(a + 1, b - a - 1),
                           version = line.substr(b + 1);
    if (method.empty() || method.size() > 20 || !std::all_of(method.begin(), method.end(), is_tchar)) {
      fail(400, "malformed", "the request method is not a token of 1-20 bytes");
      return false;
    }
    if (target.empty() || target.front() != '/' || target.size() > 8192 ||
        !std::all_of(target.begin(), target.end(), [](char c) { return c >= 0x21 && c <= 0x7e; })) {
      fail(400, "malformed", "the request target must be a path of 1-8192 printable bytes starting with '/'");
      return false;
    }
    req_.method = std::string(method);
    req_.target = std::string(target);
    const std::size_t q = target.find('?');
    req_.path = std::string(target.substr(0, q));
    if (q != std::string_view::npos) req_.query = std::string(target.substr(q + 1));
    if (version != "HTTP/1.1" && version != "HTTP/1.0") {
      fail(505, "unsupported_version", "only HTTP/1.1 and HTTP/1.0 are served");
      return false;
    }
    req_.version = std::string(version);
    req_.keep_alive = version == "HTTP/1.1";
    return true;
  }

  bool parse_field(std::string_view line) {
    if (!line.empty() && (line.front() == ' ' || line.front() == '\t')) {
      fail(400, "malformed", "an obsolete folded header line");
      return false;
    }
    const std::size_t colon = line.find(':');
    const std::string_view name = line.substr(0, colon);
    if (colon == std::string_view::npos || name.empty() || !std::all_of(name.begin(), name.end(), is_tchar)) {
      fail(400, "malformed", "a header field without a valid 'name:'");
      return false;
    }
    const std::string_view value = trim_ows(line.substr(colon + 1));
    for (char c : value) {
      const auto u = static_cast<unsigned char>(c);
      if (u == 0) {
        fail(400, "malformed", cat("the header '", name.substr(0, 64), "' contains a NUL byte"));
        return false;
      }
      if ((u < 0x20 && c != '\t') || u == 0x7f) {
        fail(400, "malformed", cat("the header '", name.substr(0, 64), "' contains a control byte"));
        return false;
      }
    }
    req_.headers.emplace_back(std::string(name), std::string(value));
    return true;
  }

  void decide_framing() {
    const int te_count = req_.header_count("Transfer-Encoding");
    const int cl_count = req_.header_count("Content-Length");
    if (const std::optional<std::string_view> ce = req_.header("Content-Encoding");
        ce && !iequals(trim_ows(*ce), "identity")) {
      fail(415, "encoded_body",
           cat("Content-Encoding '", ce->substr(0, 32),
               "' is not accepted: send the body uncompressed (the gateway never inflates a body)"));
      return;
    }
    if (te_count > 0) {
      const std::string_view te = trim_ows(*req_.header("Transfer-Encoding"));
      if (te_count > 1 || !iequals(te, "chunked")) {
        fail(415, "encoded_body",
             cat("Transfer-Encoding '", te.substr(0, 32), "' is not accepted: only 'chunked' is"));
        return;
      }
      if (cl_count > 0) {
        fail(400, "malformed", "both Transfer-Encoding and Content-Length: the body's length is ambiguous");
        return;
      }
      if (req_.version == "HTTP/1.0") {
        fail(400, "malformed", "Transfer-Encoding is not defined for HTTP/1.0");
        return;
      }
      chunked_ = true;
    } else if (cl_count > 0) {
      std::optional<std::string_view> first;
      for (const auto& [n, v] : req_.headers) {
        if (!iequals(n, "Content-Length")) continue;
        if (first && *first != v) {
          fail(400, "malformed", "Content-Length headers that disagree");
          return;
        }
        first = v;
      }
      const std::string_view v = *first;
      if (v.empty() || v.size() > 18 || !std::all_of(v.begin(), v.end(), [](char c) { return c >= '0' && c <= '9'; })) {
        fail(400, "malformed", "Content-Length must be a decimal number");
        return;
      }
      std::uint64_t n = 0;
      for (char c : v) n = n * 10 + static_cast<std::uint64_t>(c - '0');
      if (n > max_body_) {
        fail(413, "body_too_large",
             cat("the body is ", n, " bytes; this gateway accepts at most ", max_body_,
                 " bytes per request (max_body_bytes)"));
        return;
      }
      remaining_ = n;
    }
    for (const auto& [n, v] : req_.headers) {
      if (iequals(n, "Connection")) {
        std::string_view rest = v;
        while (!rest.empty()) {
          const std::size_t comma = rest.find(',');
          const std::string_view token = trim_ows(rest.substr(0, comma));
          if (iequals(token, "close")) req_.keep_alive = false;
          if (iequals(token, "keep-alive") && req_.version == "HTTP/1.0") req_.keep_alive = true;
          if (comma == std::string_view::npos) break;
          rest.remove_prefix(comma + 1);
        }
      }
      if (iequals(n, "Expect") && iequals(v, "100-continue")) req_.expect_continue = true;
    }
    head_ok_ = true;
    state_ = chunked_ || remaining_ > 0 ? state::body : state::done;
  }

  std::size_t feed_body(std::string_view in) {
    if (!chunked_) {
      const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(remaining_, in.size()));
      req_.body.append(in.data(), n);
      remaining_ -= n;
      if (remaining_ == 0) state_ = state::done;
      return n;
    }
    std::size_t used = 0;
    while (used < in.size() && state_ == state::body) {
      switch (chunk_) {
        case chunk_state::size_line: {
          const char c = in[used++];
          if (c != '\n') {
            line_.push_back(c);
            if (line_.size() > 256) return used + fail(400, "malformed", "a chunk-size line over 256 bytes");
            break;
          }
          if (line_.empty() || line_.back() != '\r') return used + fail(400, "malformed", "a chunk-size line without CRLF");
          line_.pop_back();
          const std::string_view size = std::string_view(line_).substr(0, line_.find(';'));
          const std::string_view digits = trim_ows(size);
          if (digits.empty() || digits.size() > 15) return used + fail(400, "malformed", "a chunk size is not 1-15 hex digits");
          std::uint64_t n = 0;
          for (char h : digits) {
            int d = -1;
            if (h >= '0' && h <= '9') d = h - '0';
            if (h >= 'a' && h <= 'f') d = h - 'a' + 10;
            if (h >= 'A' && h <= 'F') d = h - 'A' + 10;
            if (d < 0) return used + fail(400, "malformed", "a chunk size is not hexadecimal");
            n = n * 16 + static_cast<std::uint64_t>(d);
          }
          line_.clear();
          if (n > max_body_ - req_.body.size()) {
            return used + fail(413, "body_too_large",
                               cat("the chunked body exceeds ", max_body_,
                                   " bytes per request (max_body_bytes); refused after ", req_.body.size(),
                                   " bytes, before reading the rest"));
          }
          remaining_ = n;
          chunk_ = n == 0 ? chunk_state::trailers : chunk_state::data;
          break;
        }
        case chunk_state::data: {
          const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(remaining_, in.size() - used));
          req_.body.append(in.data() + used, n);
          used += n;
          remaining_ -= n;
          if (remaining_ == 0) chunk_ = chunk_state::data_end;
          break;
        }
        case chunk_state::data_end: {
          line_.push_back(in[used++]);
          if (line_.size() == 2) {
            if (line_ != "\r\n") return used + fail(400, "malformed", "a chunk's data is not followed by CRLF");
            line_.clear();
            chunk_ = chunk_state::size_line;
          }
          break;
        }
        case chunk_state::trailers: {
          // Trailer fields are read and dropped, up to an empty line.
          const char c = in[used++];
          if (++trailer_bytes_ > 4096) return used + fail(431, "headers_too_large", "trailer fields over 4096 bytes");
          if (c != '\n') {
            line_.push_back(c);
            break;
          }
          if (line_.empty() || line_.back() != '\r') return used + fail(400, "malformed", "a trailer line without CRLF");
          line_.pop_back();
          if (line_.empty()) state_ = state::done;
          line_.clear();
          break;
        }
      }
    }
    return used;
  }

  std::size_t max_body_, max_head_;
  state state_ = state::head;
  bool started_ = false, crlf_pending_ = false, req_line_done_ = false, head_ok_ = false, chunked_ = false;
  chunk_state chunk_ = chunk_state::size_line;
  std::string head_, line_;
  std::uint64_t remaining_ = 0;
  std::size_t trailer_bytes_ = 0;
  http_request req_;
  http_refusal err_;
};

[[nodiscard]] inline std::string_view reason_phrase(int status) {
  switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 202: return "Accepted";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 403: return "Forbidden";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 409: return "Conflict";
    case 413: return "Content Too Large";
    case 415: return "Unsupported Media Type";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 503: return "Service Unavailable";
    case 504: return "Gateway Timeout";
    case 505: return "HTTP Version Not Supported";
    default: return "Status";
  }
}

[[nodiscard]] inline std::string serialize(const http_response& r, bool keep_alive) {
  std::string out = cat("HTTP/1.1 ", r.status, " ", reason_phrase(r.status), "\r\nContent-Type: ", r.content_type,
                        "\r\nContent-Length: ", r.body.size(), "\r\n");
  for (const auto& [n, v] : r.headers) absl::StrAppend(&out, n, ": ", v, "\r\n");
  absl::StrAppend(&out, keep_alive ? "Connection: keep-alive\r\n\r\n" : "Connection: close\r\n\r\n");
  out += r.body;
  return out;
}

// Writes all of `bytes` within `timeout`; false if the peer is gone or slow.
[[nodiscard]] inline bool write_all(int fd, std::string_view bytes, std::chrono::milliseconds timeout) {
  using steady = std::chrono::steady_clock;
  const steady::time_point until = steady::now() + timeout;
  while (!bytes.empty()) {
    const ssize_t n = ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    if (n > 0) {
      bytes.remove_prefix(static_cast<std::size_t>(n));
      continue;
    }
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return false;
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(until - steady::now());
    if (left.count() <= 0) return false;
    pollfd p{.fd = fd, .events = POLLOUT, .revents = 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) < 0 && errno != EINTR) return false;
  }
  return true;
}

}  // namespace detail

inline bool http_stream::write(std::string_view bytes) {
  if (failed_ || gone_.stop_requested()) return false;
  if (bytes.empty()) return true;  // an empty chunk would end the body
  buf_.clear();
  if (!opened_) {
    opened_ = true;
    const http_response& h = *head_;
    buf_ = cat("HTTP/1.1 ", h.status, " ", detail::reason_phrase(h.status), "\r\nContent-Type: ", h.content_type,
               "\r\nCache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n");
    for (const auto& [n, v] : h.headers) absl::StrAppend(&buf_, n, ": ", v, "\r\n");
    buf_ += keep_alive_ ? "Connection: keep-alive\r\n\r\n" : "Connection: close\r\n\r\n";
  }
  absl::StrAppend(&buf_, absl::Hex(bytes.size()), "\r\n");
  buf_.append(bytes.data(), bytes.size());
  buf_ += "\r\n";
  if (!detail::write_all(fd_, buf_, write_timeout_)) {
    failed_ = true;
    gone_.request_stop();
    return false;
  }
  return true;
}

inline bool http_stream::finish() {
  if (failed_ || gone_.stop_requested()) return false;
  return detail::write_all(fd_, "0\r\n\r\n", write_timeout_);
}

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

class http_server {
 public:
  using handler = std::function<http_response(const http_request&)>;
  using refusal_handler = std::function<http_response(const http_refusal&)>;
  // True: the request goes to the reserved lane.
  using lane_function = std::function<bool(const http_request&)>;

  http_server(http_server_options o, handler h, refusal_handler refuse, lane_function reserved = {})
      : options_(std::move(o)), handler_(std::move(h)), refuse_(std::move(refuse)), reserved_(std::move(reserved)) {}

  http_server(const http_server&) = delete;
  http_server& operator=(const http_server&) = delete;
  ~http_server() { stop(); }

  // Binds host:port (0: a free port), listens and starts the threads.
  absl::Status start(const std::string& host, int port) {
    if (reader_.joinable()) return absl::FailedPreconditionError("the HTTP server is already started");
    if (absl::Status s = options_.validate(); !s.ok()) return s;
    if (port < 0 || port > 65535) return absl::InvalidArgumentError(cat("port ", port, " is not in [0, 65535]"));
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    addrinfo* found = nullptr;
    const std::string service = std::to_string(port);
    if (const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &found); rc != 0) {
      return absl::InvalidArgumentError(cat("cannot resolve '", host, "': ", ::gai_strerror(rc)));
    }
    std::string why = "no address";
    for (addrinfo* a = found; a != nullptr && listen_fd_ < 0; a = a->ai_next) {
      const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      const int one = 1;
      ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
      if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, options_.listen_backlog) == 0) {
        listen_fd_ = fd;
      } else {
        why = std::strerror(errno);
        ::close(fd);
      }
    }
    ::freeaddrinfo(found);
    if (listen_fd_ < 0) return absl::UnavailableError(cat("cannot listen on ", host, ":", port, ": ", why));
    sockaddr_storage bound{};
    socklen_t len = sizeof bound;
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound), &len);
    port_ = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                        : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_fd_ < 0) {
      ::close(listen_fd_);
      listen_fd_ = -1;
      return absl::UnavailableError(cat("eventfd: ", std::strerror(errno)));
    }
    stopping_.store(false);
    lanes_[0].workers = options_.threads;
    lanes_[1].workers = options_.reserved_threads;
    for (int i = 0; i < options_.threads; ++i) workers_.emplace_back([this] { work(lanes_[0]); });
    for (int i = 0; i < options_.reserved_threads; ++i) workers_.emplace_back([this] { work(lanes_[1]); });
    reader_ = std::thread([this] { read_loop(); });
    return absl::OkStatus();
  }

  [[nodiscard]] int port() const noexcept { return port_; }

  [[nodiscard]] http_server_figures figures() const {
    http_server_figures f;
    f.connections = connections_.load(std::memory_order_relaxed);
    std::lock_guard lock(mu_);
    f.busy = lanes_[0].busy;
    f.busy_reserved = lanes_[1].busy;
    f.queued = static_cast<int>(lanes_[0].jobs.size());
    f.queued_reserved = static_cast<int>(lanes_[1].jobs.size());
    return f;
  }

  // Stops accepting, closes idle connections, lets the workers finish the
  // requests they serve and closes the rest. Idempotent.
  void stop() {
    if (!reader_.joinable()) return;
    {
      std::lock_guard lock(mu_);
      stopping_.store(true);
    }
    wake();
    for (lane& l : lanes_) l.cv.notify_all();
    reader_.join();
    for (std::thread& t : workers_) t.join();
    workers_.clear();
    std::lock_guard lock(mu_);
    for (lane& l : lanes_) {
      for (job& j : l.jobs) close_connection(*j.conn);
      l.jobs.clear();
    }
    for (auto& c : returned_) close_connection(*c);
    returned_.clear();
    ::close(wake_fd_);
    wake_fd_ = -1;
  }

 private:
  using steady = std::chrono::steady_clock;
  enum class phase : std::uint8_t { idle, head, body, draining };

  struct connection {
    int fd = -1;
    detail::request_parser parser;
    std::string pending;  // read, not yet parsed (a pipelined request)
    phase at = phase::idle;
    steady::time_point deadline{};
    std::size_t drained = 0;
    int served = 0;
  };

  struct job {
    std::unique_ptr<connection> conn;
    http_request request;
  };

  struct lane {
    std::deque<job> jobs;  // guarded by mu_
    int busy = 0;          // guarded by mu_
    int workers = 0;       // set before the threads start
    std::condition_variable cv;
  };

  static constexpr std::size_t drain_limit = 1 << 20;
  static constexpr std::chrono::seconds drain_time{2};

  void wake() const {
    const std::uint64_t one = 1;
    [[maybe_unused]] const ssize_t n = ::write(wake_fd_, &one, sizeof one);
  }

  void close_connection(connection& c) {
    if (c.fd >= 0) {
      ::close(c.fd);
      c.fd = -1;
      connections_.fetch_sub(1, std::memory_order_relaxed);
    }
  }

  // ---- the reader thread ----------------------------------------------------

  void read_loop() {
    std::unordered_map<int, std::unique_ptr<connection>> open;
    std::vector<pollfd> fds;
    std::vector<watched_stream> watching;
    std::vector<char> buf(16 * 1024);
    while (!stopping_.load()) {
      const steady::time_point now = steady::now();
      steady::time_point next = now + std::chrono::seconds(1);
      fds.clear();
      fds.push_back({.fd = wake_fd_, .events = POLLIN, .revents = 0});
      const bool accepting = connections_.load(std::memory_order_relaxed) < options_.max_connections;
      fds.push_back({.fd = accepting ? listen_fd_ : -1, .events = POLLIN, .revents = 0});
      for (const auto& [fd, c] : open) {
        fds.push_back({.fd = fd, .events = POLLIN, .revents = 0});
        next = std::min(next, c->deadline);
      }
      // Streaming connections: only a hang-up (their bytes are read after the stream).
      const std::size_t first_watched = fds.size();
      {
        std::lock_guard lock(mu_);
        watching.assign(watched_.begin(), watched_.end());
      }
      for (const watched_stream& w : watching) fds.push_back({.fd = w.fd, .events = POLLRDHUP, .revents = 0});
      const auto wait = std::chrono::ceil<std::chrono::milliseconds>(std::max(next - now, steady::duration::zero()));
      const int ready = ::poll(fds.data(), fds.size(), static_cast<int>(wait.count()));
      if (ready < 0 && errno != EINTR) break;
      if (stopping_.load()) break;
      if (fds[0].revents != 0) {
        std::uint64_t n = 0;
        [[maybe_unused]] const ssize_t r = ::read(wake_fd_, &n, sizeof n);
        std::vector<std::unique_ptr<connection>> back;
        {
          std::lock_guard lock(mu_);
          back.swap(returned_);
        }
        for (auto& c : back) {
          c->at = phase::idle;
          c->deadline = steady::now() + options_.idle_timeout;
          c->parser.reset();
          connection* raw = c.get();
          open.emplace(raw->fd, std::move(c));
          std::string pending = std::exchange(raw->pending, {});
          if (!pending.empty()) input(open, *raw, pending);
        }
      }
      if (fds[1].revents != 0) accept_all(open);
      for (std::size_t i = first_watched; i < fds.size(); ++i) {
        if ((fds[i].revents & (POLLRDHUP | POLLHUP | POLLERR)) == 0) continue;
        const watched_stream& w = watching[i - first_watched];
        w.gone.request_stop();  // the stream stops now, not at its next write
        unwatch(w.id);          // and is not polled again
      }
      for (std::size_t i = 2; i < first_watched; ++i) {
        if (fds[i].revents == 0) continue;
        const auto it = open.find(fds[i].fd);
        if (it == open.end()) continue;
        connection& c = *it->second;
        const ssize_t n = ::recv(c.fd, buf.data(), buf.size(), 0);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
          drop(open, c);
          continue;
        }
        if (n > 0) input(open, c, std::string_view(buf.data(), static_cast<std::size_t>(n)));
      }
      const steady::time_point after = steady::now();
      std::vector<connection*> late;
      for (const auto& [fd, c] : open) {
        if (c->deadline <= after) late.push_back(c.get());
      }
      for (connection* c : late) expire(open, *c);
    }
    ::close(listen_fd_);
    listen_fd_ = -1;
    for (auto& [fd, c] : open) close_connection(*c);
  }

  void accept_all(std::unordered_map<int, std::unique_ptr<connection>>& open) {
    while (connections_.load(std::memory_order_relaxed) < options_.max_connections) {
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;  // EAGAIN, or a connection that went away before accept
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      auto c = std::make_unique<connection>();
      c->fd = fd;
      c->parser = detail::request_parser(options_.max_body_bytes, options_.max_header_bytes);
      c->deadline = steady::now() + options_.idle_timeout;
      connections_.fetch_add(1, std::memory_order_relaxed);
      open.emplace(fd, std::move(c));
    }
  }

  void drop(std::unordered_map<int, std::unique_ptr<connection>>& open, connection& c) {
    const int fd = c.fd;
    close_connection(c);
    open.erase(fd);
  }

  void input(std::unordered_map<int, std::unique_ptr<connection>>& open, connection& c, std::string_view data) {
    if (c.at == phase::draining) {
      c.drained += data.size();
      if (c.drained > drain_limit) drop(open, c);
      return;
    }
    // Blank lines before a request do not start it, nor do they extend the
    // idle time: "\r\n" every few seconds must not hold a connection forever.
    const steady::time_point idle_deadline = c.deadline;
    if (c.at == phase::idle) {
      // The head's clock starts at the request's first byte.
      c.at = phase::head;
      c.deadline = steady::now() + options_.header_timeout;
    }
    const std::size_t used = c.parser.feed(data);
    switch (c.parser.current()) {
      case detail::request_parser::state::failed:
        refuse(c, c.parser.error());
        return;
      case detail::request_parser::state::done: {
        c.pending.append(data.substr(used).data(), data.size() - used);
        dispatch(open, c);
        return;
      }
      case detail::request_parser::state::body:
        if (c.at == phase::head) {
          c.at = phase::body;
          c.deadline = steady::now() + options_.body_timeout;
          if (c.parser.request().expect_continue) send_now(c, "HTTP/1.1 100 Continue\r\n\r\n");
        }
        return;
      case detail::request_parser::state::head:
        if (!c.parser.started()) {  // only blank lines so far
          c.at = phase::idle;
          c.deadline = idle_deadline;
        }
        return;
    }
  }

  void expire(std::unordered_map<int, std::unique_ptr<connection>>& open, connection& c) {
    switch (c.at) {
      case phase::idle:
      case phase::draining: drop(open, c); return;
      case phase::head:
        refuse(c, {.status = 408,
                   .reason = "header_timeout",
                   .message = cat("the request head did not arrive within ", options_.header_timeout.count(),
                                  " ms of its first byte (header_timeout)"),
                   .path = c.parser.request().path});
        return;
      case phase::body:
        refuse(c, {.status = 408,
                   .reason = "body_timeout",
                   .message = cat("the request body did not arrive within ", options_.body_timeout.count(),
                                  " ms of its head (body_timeout); ", c.parser.body_bytes(), " bytes came"),
                   .path = c.parser.request().path});
        return;
    }
  }

  // Best effort, without blocking: the socket's buffer is empty here (every
  // earlier response was written whole), so a short answer fits.
  static bool send_now(const connection& c, std::string_view bytes) {
    while (!bytes.empty()) {
      const ssize_t n = ::send(c.fd, bytes.data(), bytes.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n <= 0) return false;
      bytes.remove_prefix(static_cast<std::size_t>(n));
    }
    return true;
  }

  // Answers a refusal and closes the connection: its framing can no longer
  // be trusted. The rest of what the client sends is drained, so it reads
  // the answer rather than a reset.
  void refuse(connection& c, const http_refusal& why) {
    http_response r = refuse_(why);
    // One Retry-After: the refusal's own hint when it carries one, else 1 s.
    const bool hinted = std::any_of(r.headers.begin(), r.headers.end(),
                                    [](const auto& h) { return detail::iequals(h.first, "Retry-After"); });
    if ((r.status == 408 || r.status == 503) && !hinted) r.headers.emplace_back("Retry-After", "1");
    (void)send_now(c, detail::serialize(r, false));
    ::shutdown(c.fd, SHUT_WR);
    c.at = phase::draining;
    c.drained = 0;
    c.pending.clear();
    c.deadline = steady::now() + drain_time;
  }

  void dispatch(std::unordered_map<int, std::unique_ptr<connection>>& open, connection& c) {
    http_request request = c.parser.take();
    const bool reserved = reserved_ && reserved_(request);
    lane& l = lanes_[reserved ? 1 : 0];
    {
      std::lock_guard lock(mu_);
      // Room: a worker free, or a place in the queue behind the busy ones.
      if (l.busy + static_cast<int>(l.jobs.size()) < l.workers + options_.max_queue) {
        const int fd = c.fd;
        auto it = open.find(fd);
        l.jobs.push_back({.conn = std::move(it->second), .request = std::move(request)});
        open.erase(it);
        l.cv.notify_one();
        return;
      }
    }
    refuse(c, {.status = 503,
               .reason = "busy",
               .message = cat("every HTTP worker of the ", reserved ? "reserved" : "ordinary", " lane is busy and ",
                              options_.max_queue, " requests wait already (max_queue)"),
               .path = request.path});
  }

  // ---- the workers ----------------------------------------------------------

  void work(lane& l) {
    for (;;) {
      job j;
      {
        std::unique_lock lock(mu_);
        l.cv.wait(lock, [&] { return stopping_.load() || !l.jobs.empty(); });
        if (stopping_.load()) return;
        j = std::move(l.jobs.front());
        l.jobs.pop_front();
        ++l.busy;
      }
      serve(j);
      std::lock_guard lock(mu_);
      --l.busy;
      if (j.conn) {
        if (stopping_.load()) {
          close_connection(*j.conn);
        } else {
          returned_.push_back(std::move(j.conn));
          wake();
        }
      }
    }
  }

  void serve(job& j) {
    connection& c = *j.conn;
    http_response r;
    try {
      r = handler_(j.request);
    } catch (const std::exception& e) {
      r = refuse_({.status = 500, .reason = "handler", .message = cat("the gateway failed: ", e.what()),
                   .path = j.request.path});
    }
    ++c.served;
    const bool keep = j.request.keep_alive && c.served < options_.max_requests_per_connection && !stopping_.load();
    bool written = false;
    if (r.stream) {
      http_stream out(c.fd, options_.write_timeout, keep, r);
      const std::uint64_t id = watch(c.fd, out.gone_);
      http_response instead;
      try {
        instead = r.stream(out);
      } catch (const std::exception& e) {
        instead = refuse_({.status = 500, .reason = "handler", .message = cat("the gateway failed: ", e.what()),
                           .path = j.request.path});
        out.failed_ = out.opened_;  // a body cut short: the connection cannot carry another response
      }
      unwatch(id);
      written = out.opened() ? out.finish() : write_all(c.fd, detail::serialize(instead, keep));
    } else {
      written = write_all(c.fd, detail::serialize(r, keep));
    }
    if (!keep || !written) {
      close_connection(c);
      j.conn.reset();
    }
  }

  [[nodiscard]] bool write_all(int fd, std::string_view bytes) const {
    return detail::write_all(fd, bytes, options_.write_timeout);
  }

  // The streams the reader thread watches for a hang-up (guarded by mu_).
  struct watched_stream {
    std::uint64_t id;
    int fd;
    std::stop_source gone;  // shares the stream's state: safe to request after it ended
  };
  std::uint64_t watch(int fd, const std::stop_source& gone) {
    std::uint64_t id = 0;
    {
      std::lock_guard lock(mu_);
      id = ++watch_ids_;
      watched_.push_back({.id = id, .fd = fd, .gone = gone});
    }
    wake();
    return id;
  }
  void unwatch(std::uint64_t id) {
    std::lock_guard lock(mu_);
    std::erase_if(watched_, [&](const watched_stream& w) { return w.id == id; });
  }

  http_server_options options_;
  handler handler_;
  refusal_handler refuse_;
  lane_function reserved_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;
  int port_ = -1;
  std::atomic<bool> stopping_{false};
  std::atomic<int> connections_{0};
  mutable std::mutex mu_;
  lane lanes_[2];                                    // ordinary, reserved
  std::vector<std::unique_ptr<connection>> returned_;  // served, kept alive; guarded by mu_
  std::vector<watched_stream> watched_;                // streaming now; guarded by mu_
  std::uint64_t watch_ids_ = 0;                        // guarded by mu_
  std::vector<std::thread> workers_;
  std::thread reader_;
};

}  // namespace gateway
