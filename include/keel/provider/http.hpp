// keel/provider/http.hpp — a model provider over HTTP (libcurl), speaking
// keel's outcomes and hints, so a caller writes no status mapping and no
// header parser.
//
// A keel::http::client holds what every request to one service shares
// (base URL, headers such as the API key, a pool of libcurl handles whose
// connections are kept alive and reused across calls and threads).
// client.exchange(request, parse) makes a provider for one call: each attempt
// sends one HTTP request and
//
//   - gives the transfer the attempt's time left (CURLOPT_TIMEOUT_MS) and
//     tells the server how long that is (client_options::deadline_header);
//   - aborts the transfer within a millisecond of a stop request on the
//     attempt's stop token (the transfer runs on a curl multi handle whose
//     poll the stop wakes);
//   - sends an Idempotency-Key on writes (the call's operation says which):
//     the request's key, or one drawn once per exchange, so every attempt of
//     the call carries the same one;
//   - classifies the response (keel/provider/hints.hpp, docs/providers.md):
//     the status code, x-should-retry, and before-or-after sending for
//     transport failures; failures carry the provider's retry-after hint
//     (retry-after-ms, Retry-After, rate-limit resets on a 429, a JSON body's
//     retryDelay), which keel::retry waits out, or, when it is longer than
//     the time left or than retry_options::max_retry_after, stops on and
//     hands to the caller;
//   - keeps the upstream's HTTP status and the headers a relay passes on
//     (keel/core/upstream.hpp: rate-limit headers, retry-after, request id)
//     beside that classification: in response::upstream on a 2xx, in a
//     stream's result and events, as a payload of a failure's status
//     (keel::upstream_of);
//   - on a 2xx calls parse(response) while the body is still in the pooled
//     buffer, and returns what parse returns. A parse failure (a 200 with an
//     invalid body) is returned as parse gave it: absl::InternalError is
//     retried for a read and ambiguous for a write (the server acted).
//
// Example:
//
//   keel::http::client llm({.base_url = "http://127.0.0.1:8000",
//                           .headers = {"Authorization: Bearer sk-..."}});
//   keel::call call(keel::real_clock{}.now(), {.timeout = std::chrono::seconds(10)});
//   auto chat = llm.exchange({.path = "/v1/chat/completions", .body = R"({"model":"m","messages":[]})"},
//                            [](const keel::http::response& r) -> absl::StatusOr<std::string> {
//                              return std::string(r.body);
//                            });
//   absl::StatusOr<std::string> answer = keel::pipeline(keel::retry()).run(call, chat);
//
// The request's strings are views: they must outlive the exchange.
//
// Allocation: none on a successful attempt beyond what libcurl makes for a
// transfer and what `parse` does, once the pool and its buffers have grown
// to the load (bench/provider_bench.cpp measures both).
//
// Thread-safety: a client is shared by any number of threads; an exchange is
// a small copyable value (copies share the idempotency key), and its
// attempts may run at once (a hedge), each on its own pooled handle. A
// client must outlive its exchanges' attempts, a hedge's losers included.
#pragma once

#include <curl/curl.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <optional>
#include <stop_token>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "keel/core/call.hpp"
#include "keel/core/outcome.hpp"
#include "keel/core/policy.hpp"
#include "keel/core/status.hpp"
#include "keel/core/upstream.hpp"
#include "keel/policy/backoff.hpp"
#include "keel/compose/stream.hpp"
#include "keel/provider/hints.hpp"
#include "keel/provider/sse.hpp"

namespace keel::http {

enum class method { get, post, put, patch, del };

// How the attempt's time left is written into client_options::deadline_header.
enum class deadline_format {
  milliseconds,  // "2500": an integer, as x-request-timeout-ms style headers take it
  grpc,          // "2500m": the grpc-timeout format (gRPC-over-HTTP gateways)
};

struct client_options {
  // Put before every request's path; may be empty when paths are full URLs.
  std::string base_url{};
  // Sent with every request, "Name: value" (for example the API key).
  std::vector<std::string> headers{};
  // Carries the attempt's time left to the server, so it can stop working
  // on an answer nobody will wait for; empty: not sent.
  std::string deadline_header = "x-request-timeout-ms";
  http::deadline_format deadline_format = http::deadline_format::milliseconds;
  // Sent on writes with the exchange's idempotency key; empty: not sent.
  std::string idempotency_header = "Idempotency-Key";
  // A longer response body fails the attempt (absl::OutOfRangeError, permanent).
  std::size_t max_body_bytes = std::size_t{8} << 20;
  // Connecting may take at most this (and never more than the attempt's time).
  duration connect_timeout = std::chrono::seconds(10);
  // Idle handles (each with its kept-alive connection) the pool keeps; > 0.
  std::size_t max_idle_handles = 64;
  // TLS peer verification; off only for a test server with its own certificate.
  bool verify_peer = true;

  [[nodiscard]] absl::Status validate() const {
    for (const std::string& h : headers) {
      if (h.find(':') == std::string::npos || h.find_first_of("\r\n") != std::string::npos)
        return keel::detail::invalid_field("client_options", "headers", "be \"Name: value\" lines without CR/LF",
                                           h);
    }
    for (const std::string* name : {&deadline_header, &idempotency_header}) {
      if (name->find_first_of(":\r\n ") != std::string::npos)
        return keel::detail::invalid_field("client_options",
                                           name == &deadline_header ? "deadline_header" : "idempotency_header",
                                           "be a header name (no ':', space, CR or LF)", *name);
    }
    if (max_body_bytes == 0) return keel::detail::invalid_field("client_options", "max_body_bytes", "be > 0", 0);
    if (connect_timeout <= duration::zero())
      return keel::detail::invalid_field("client_options", "connect_timeout", "be > 0", connect_timeout);
    if (max_idle_handles == 0)
      return keel::detail::invalid_field("client_options", "max_idle_handles", "be > 0", 0);
    return absl::OkStatus();
  }
};

// One request of a call. Views: what they name must outlive the exchange.
struct request {
  http::method method = http::method::post;
  std::string_view path{};  // appended to client_options::base_url
  std::string_view body{};
  std::string_view content_type = "application/json";
  // For writes: the key every attempt sends; empty: the exchange draws one.
  std::string_view idempotency_key{};
};

// A 2xx response as parse() sees it; the body is valid during the call only.
struct response {
  long status = 0;
  std::string_view body{};
  // The status and the headers a relay passes on (keel/core/upstream.hpp),
  // valid during the call only: copy it to keep it.
  const upstream_reply* upstream = nullptr;
};

namespace detail {

// A 2xx event stream on its way from libcurl's write callback into the
// parser and the stream's writer (keel/compose/stream.hpp).
struct sse_feed {
  sse_parser parser;
  stream_writer* writer = nullptr;
  absl::Status failure;   // an error event, or a corrupt event
  bool ended = false;     // [DONE], or a finish_reason
  bool stopped = false;   // the writer said stop

  void start(stream_writer& w) {
    parser.reset();
    writer = &w;
    failure = absl::OkStatus();
    ended = false;
    stopped = false;
  }

  // One network read: the clock is read once for all its tokens.
  bool on_bytes(std::string_view bytes) {
    const time_point now = writer->now();
    const bool relay = writer->takes_events();
    absl::Status s = parser.feed(bytes, [&](const chat_chunk& c) {
      if (c.kind == chunk_kind::keepalive) return true;
      if (!c.finish_reason.empty() || c.kind == chunk_kind::done) ended = true;
      if (c.has_usage) writer->usage(c.usage);
      bool go_on = true;
      if (c.kind == chunk_kind::content && !relay && c.finish_reason.empty() && c.refusal.empty()) {
        go_on = writer->token(c.text, now);  // the common chunk: a token and nothing else
      } else if (c.kind != chunk_kind::invalid) {
        go_on = writer->event(as_event(c), now);
      }
      if (c.kind == chunk_kind::error) {
        failure = error_status(c);
        return false;
      }
      if (c.kind == chunk_kind::invalid) {
        failure = absl::InternalError(absl::StrCat("keel::http: stream: an event is not a JSON object: ",
                                                   keel::detail::to_absl(c.data.substr(0, 128))));
        return false;
      }
      if (!go_on) stopped = true;
      return go_on;
    });
    if (!s.ok()) failure = std::move(s);
    return failure.ok() && !stopped;
  }

  static stream_event as_event(const chat_chunk& c) noexcept {
    stream_event e;
    switch (c.kind) {
      case chunk_kind::content: e.kind = stream_event_kind::content; break;
      case chunk_kind::tool_call: e.kind = stream_event_kind::tool_call; break;
      case chunk_kind::refusal: e.kind = stream_event_kind::refusal; break;
      default: e.kind = stream_event_kind::other; break;
    }
    if (e.kind == stream_event_kind::content || e.kind == stream_event_kind::tool_call) e.content = c.text;
    if (e.kind != stream_event_kind::other) e.refusal = c.refusal;
    e.tool_calls = c.tool_calls;
    e.finish_reason = c.finish_reason;
    e.data = c.data;
    e.name = c.event;
    return e;
  }
};

inline void global_init() {
  static const CURLcode rc = curl_global_init(CURL_GLOBAL_DEFAULT);
  (void)rc;
}

// One transfer's easy handle and what it fills: buffers that keep their
// capacity from call to call, the response's hints and relay headers, the
// event-stream feed. Shared by the blocking client (detail::slot, below)
// and the asynchronous one (keel/asio/http.hpp), which drive the handle on
// their own multi handles.
struct transfer {
  CURL* easy = nullptr;
  std::string url;
  std::string body;
  std::string deadline_line;
  std::string key_line;
  std::string type_line;
  std::array<curl_slist, 3> extra{};
  std::size_t max_body = 0;
  bool too_large = false;
  bool got_status_line = false;
  wall_time now{};
  response_hints hints;
  upstream_reply reply;  // the response's status and relay headers
  std::unique_ptr<sse_feed> stream_feed;  // kept with the handle: its buffers' capacity stays
  sse_feed* feed = nullptr;  // an event stream: a 2xx body goes to it, not to `body`
  int feed_status = 0;       // 0: not known yet; 1: 2xx, fed; -1: not a 2xx, buffered

  transfer() : easy(curl_easy_init()) {}
  ~transfer() {
    if (easy != nullptr) curl_easy_cleanup(easy);
  }
  transfer(const transfer&) = delete;
  transfer& operator=(const transfer&) = delete;

  static std::size_t on_body(char* data, std::size_t size, std::size_t n, void* self) {
    auto* s = static_cast<transfer*>(self);
    const std::size_t bytes = size * n;
    if (s->feed != nullptr) {
      if (s->feed_status == 0) {
        long code = 0;
        curl_easy_getinfo(s->easy, CURLINFO_RESPONSE_CODE, &code);
        s->feed_status = code >= 200 && code < 300 ? 1 : -1;
        s->reply.status = static_cast<int>(code);
        if (s->feed_status == 1) s->feed->writer->upstream(s->reply);
      }
      if (s->feed_status == 1) return s->feed->on_bytes(std::string_view(data, bytes)) ? bytes : 0;
    }
    if (s->body.size() + bytes > s->max_body) {
      s->too_large = true;
      return 0;  // CURLE_WRITE_ERROR
    }
    s->body.append(data, bytes);
    return bytes;
  }

  static std::size_t on_header(char* data, std::size_t size, std::size_t n, void* self) {
    auto* s = static_cast<transfer*>(self);
    const std::size_t bytes = size * n;
    const std::string_view line(data, bytes);
    if (keel::http::detail::istarts_with(line, "HTTP/")) {
      // A new response (after a 100 Continue or a redirect): its own hints.
      s->hints.clear();
      s->reply.headers.clear();
      s->got_status_line = true;
      return bytes;
    }
    const std::size_t colon = line.find(':');
    if (colon != std::string_view::npos) {
      s->hints.on_header(line.substr(0, colon), line.substr(colon + 1), s->now);
      s->reply.add_if_relayed(line.substr(0, colon), line.substr(colon + 1));
    }
    return bytes;
  }
};
// One pooled blocking transfer (client): the handle on its own multi handle,
// whose poll a stop request wakes.
struct slot : transfer {
  CURLM* multi = nullptr;

  slot() : multi(curl_multi_init()) {}
  ~slot() {
    if (multi != nullptr) curl_multi_cleanup(multi);  // before the easy handle (~transfer)
  }
};

// Fixed-size lowercase hex from 128 random bits: an idempotency key.
struct key {
  std::array<char, 32> text{};
  static key draw() {
    key k;
    static constexpr char digits[] = "0123456789abcdef";
    const thread_local_random r;
    for (std::size_t i = 0; i < k.text.size(); i += 8) {
      auto bits = static_cast<std::uint32_t>(r.uniform(0, 0xffffffffLL));
      for (std::size_t j = 0; j < 8; ++j, bits >>= 4) k.text[i + j] = digits[bits & 0xf];
    }
    return k;
  }
  [[nodiscard]] std::string_view view() const noexcept { return {text.data(), text.size()}; }
};

template <class Parse>
using parse_result_t = std::remove_cvref_t<std::invoke_result_t<const Parse&, const response&>>;

// A parse that keeps nothing: the exchange returns absl::Status.
struct ignore_body {
  absl::Status operator()(const response&) const noexcept { return absl::OkStatus(); }
};

// The steps of one attempt that do not depend on how the transfer is
// driven, shared by keel::http::client (a multi handle per transfer, polled
// on the caller's thread) and keel::asio::http_client (one multi handle on
// an event loop): request building, classification, hints.

[[nodiscard]] inline std::int64_t whole_ms(duration d) noexcept {
  return std::chrono::duration_cast<std::chrono::milliseconds>(d).count();
}

[[nodiscard]] inline std::string_view body_excerpt(std::string_view body) noexcept {
  return body.substr(0, std::min<std::size_t>(body.size(), 256));
}

// The client's header lines, sent with every request (freed with curl_slist_free_all).
[[nodiscard]] inline curl_slist* shared_headers(const client_options& o) {
  curl_slist* list = nullptr;
  for (const std::string& h : o.headers) list = curl_slist_append(list, h.c_str());
  // libcurl would otherwise wait for a 100 Continue before larger bodies.
  return curl_slist_append(list, "Expect:");
}

// What stays the same for every transfer on a handle.
inline void setup(transfer& s, const client_options& o) {
  CURL* e = s.easy;
  curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, &transfer::on_body);
  curl_easy_setopt(e, CURLOPT_WRITEDATA, &s);
  curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, &transfer::on_header);
  curl_easy_setopt(e, CURLOPT_HEADERDATA, &s);
  curl_easy_setopt(e, CURLOPT_TCP_KEEPALIVE, 1L);
  curl_easy_setopt(e, CURLOPT_TCP_NODELAY, 1L);
  curl_easy_setopt(e, CURLOPT_SSL_VERIFYPEER, o.verify_peer ? 1L : 0L);
  curl_easy_setopt(e, CURLOPT_SSL_VERIFYHOST, o.verify_peer ? 2L : 0L);
  s.max_body = o.max_body_bytes;
}

// The caller went away (Cancelled), or only the attempt was stopped (its
// deadline, a lost race): DeadlineExceeded, not started if nothing was sent.
[[nodiscard]] inline absl::Status stopped_status(const keel::attempt& a, bool sent) {
  if (a.owner != nullptr && a.owner->stop_token().stop_requested())
    return absl::CancelledError("keel::http: transfer aborted: the call was cancelled");
  absl::Status st = absl::DeadlineExceededError("keel::http: transfer aborted: the attempt was stopped");
  return sent ? st : mark_not_started(std::move(st));
}

// Why an attempt does not start at all (no time left, already stopped); OK when it may.
[[nodiscard]] inline absl::Status refuse_start(const keel::attempt& a) {
  if (a.timeout <= duration::zero())
    return mark_not_started(absl::DeadlineExceededError("keel::http: no time left for the attempt"));
  if (a.stop.stop_requested()) return stopped_status(a, false);
  return absl::OkStatus();
}

// Sets the per-transfer options of `s` for `r` (URL, method, body, the
// attempt's time left as CURLOPT_TIMEOUT_MS and the deadline header, the
// idempotency key on writes) and resets what the transfer fills. The
// per-attempt header lines live in the transfer's own list nodes (no
// allocation), ahead of `shared`; conclude() unhooks them.
inline void prepare(transfer& s, const request& r, const keel::attempt& a, const client_options& o,
                    curl_slist* shared, stream_writer* stream) {
  CURL* e = s.easy;
  // The strings are the transfer's: their capacity stays.
  s.url.assign(o.base_url).append(r.path);
  curl_easy_setopt(e, CURLOPT_URL, s.url.c_str());
  switch (r.method) {
    case method::get:
      curl_easy_setopt(e, CURLOPT_HTTPGET, 1L);
      curl_easy_setopt(e, CURLOPT_CUSTOMREQUEST, nullptr);
      break;
    default:
      curl_easy_setopt(e, CURLOPT_POSTFIELDS, r.body.data());
      curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(r.body.size()));
      curl_easy_setopt(e, CURLOPT_CUSTOMREQUEST,
                       r.method == method::put     ? "PUT"
                       : r.method == method::patch ? "PATCH"
                       : r.method == method::del   ? "DELETE"
                                                   : nullptr);
      break;
  }
  // Whole milliseconds, at least one; a longer timeout than libcurl's long holds is none.
  const std::int64_t ms = std::max<std::int64_t>(1, whole_ms(a.timeout));
  const long timeout_ms = ms > 0x7fffffffLL ? 0L : static_cast<long>(ms);
  curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, timeout_ms);
  const std::int64_t connect_ms = std::max<std::int64_t>(1, whole_ms(o.connect_timeout));
  curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS,
                   static_cast<long>(std::min<std::int64_t>({connect_ms, ms, 0x7fffffffLL})));

  // Headers: the per-attempt lines in the transfer's own list nodes, then the shared list.
  curl_slist* head = shared;
  std::size_t used = 0;
  auto push = [&](std::string& line) {
    curl_slist& node = s.extra[used++];
    node.data = line.data();
    node.next = head;
    head = &node;
  };
  if (!o.deadline_header.empty() && timeout_ms > 0) {
    char digits[24];
    const int n = std::snprintf(digits, sizeof digits, "%lld%s", static_cast<long long>(ms),
                                o.deadline_format == deadline_format::grpc ? "m" : "");
    s.deadline_line.assign(o.deadline_header).append(": ").append(digits, static_cast<std::size_t>(n));
    push(s.deadline_line);
  }
  if (!o.idempotency_header.empty() && a.owner != nullptr && a.owner->operation().effect == effect::write &&
      !r.idempotency_key.empty()) {
    s.key_line.assign(o.idempotency_header).append(": ").append(r.idempotency_key);
    push(s.key_line);
  }
  if (r.method != method::get && !r.content_type.empty()) {
    s.type_line.assign("Content-Type: ").append(r.content_type);
    push(s.type_line);
  }
  curl_easy_setopt(e, CURLOPT_HTTPHEADER, head);

  s.body.clear();
  if (stream != nullptr) {
    if (!s.stream_feed) s.stream_feed = std::make_unique<sse_feed>();
    s.stream_feed->start(*stream);
    s.feed = s.stream_feed.get();
  } else {
    s.feed = nullptr;
  }
  s.feed_status = 0;
  s.too_large = false;
  s.got_status_line = false;
  s.hints.clear();
  s.reply.clear();
  s.now = std::chrono::system_clock::now();
}

// A transport failure (libcurl's code), classified by whether anything was sent.
[[nodiscard]] inline absl::Status transport_failure(CURLcode rc, const transfer& s, const keel::attempt& a,
                                                    const client_options& o) {
  long sent = 0;
  curl_easy_getinfo(s.easy, CURLINFO_REQUEST_SIZE, &sent);
  const bool before_sending = sent == 0 && !s.got_status_line;
  const bool write = a.owner != nullptr && a.owner->operation().effect == effect::write;
  const std::string what = absl::StrCat("keel::http: ", curl_easy_strerror(rc), " (curl ", static_cast<int>(rc),
                                        before_sending ? ", nothing sent)" : ", after sending)");
  switch (rc) {
    case CURLE_URL_MALFORMAT:
    case CURLE_UNSUPPORTED_PROTOCOL:
      return absl::InvalidArgumentError(what);
    case CURLE_PEER_FAILED_VERIFICATION:
      return absl::FailedPreconditionError(what);
    case CURLE_WRITE_ERROR:
      if (s.too_large) return absl::OutOfRangeError(absl::StrCat(what, ": body over ", o.max_body_bytes, " bytes"));
      break;
    case CURLE_OPERATION_TIMEDOUT:
      // Timed out after sending: the effect is unknown. Before (connecting):
      // the endpoint is unavailable, below.
      if (!before_sending) return absl::DeadlineExceededError(what);
      break;
    default:
      break;
  }
  // Refused, reset, unresolved, not connected in time: nothing was sent, so
  // even a write may go again (Unavailable is transient for both). Not
  // marked not-started: a breaker skips such statuses, and a dead endpoint
  // is exactly what it must see. After sending, a read is repeated and a
  // write's effect is unknown.
  if (before_sending) return absl::UnavailableError(what);
  return write ? absl::UnknownError(what) : absl::UnavailableError(what);
}

// A non-2xx answer: its code, an excerpt of its body, its hint and relay headers.
[[nodiscard]] inline absl::Status http_failure(long status, const transfer& s) {
  const int code = static_cast<int>(status);
  absl::Status st(http_status_code(code),
                  absl::StrCat("HTTP ", code, ": ", keel::detail::to_absl(body_excerpt(s.body))));
  std::optional<duration> hint = s.hints.hint(code);
  if (!hint) hint = find_retry_delay(s.body);
  if (hint) st = with_retry_after(std::move(st), *hint);
  upstream_reply reply = s.reply;
  reply.status = code;
  return with_upstream(std::move(st), reply);
}

// The attempt's status once the transfer left its multi handle: `rc` is
// libcurl's result, `stopped` says the driver aborted it (a stop request).
// On a 2xx, calls on_success(response) while the body is in the buffer and
// returns what it returns.
template <class OnSuccess>
absl::Status conclude(transfer& s, const keel::attempt& a, CURLcode rc, bool stopped, const client_options& o,
                      OnSuccess&& on_success) {
  CURL* e = s.easy;
  curl_easy_setopt(e, CURLOPT_HTTPHEADER, nullptr);  // the nodes are ours
  sse_feed* const fed = s.feed_status == 1 ? s.feed : nullptr;
  s.feed = nullptr;
  if (fed != nullptr && !fed->failure.ok()) return fed->failure;  // an error event, a corrupt event
  if (stopped || (fed != nullptr && fed->stopped)) {
    long sent = 0;
    curl_easy_getinfo(e, CURLINFO_REQUEST_SIZE, &sent);
    return stopped_status(a, sent != 0 || s.got_status_line);
  }
  if (rc != CURLE_OK) return transport_failure(rc, s, a, o);

  long status = 0;
  curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, &status);
  s.reply.status = static_cast<int>(status);
  if (status < 200 || status >= 300) {
    absl::Status st = http_failure(status, s);
    if (a.owner != nullptr) {
      // x-should-retry overrides the code's meaning; absent, the code speaks.
      if (std::optional<bool> sr = s.hints.should_retry())
        st = with_outcome(std::move(st), classify_http(static_cast<int>(status), a.owner->operation(), sr));
    }
    return st;
  }
  if (fed != nullptr && !fed->ended)
    return absl::UnavailableError("keel::http: stream: the body ended before [DONE] (connection cut)");
  return std::forward<OnSuccess>(on_success)(response{.status = status, .body = s.body, .upstream = &s.reply});
}

}  // namespace detail

class client;

// A provider for one call (client::exchange). Copyable; copies share the
// idempotency key.
template <class Parse>
class exchange {
 public:
  using result_type = detail::parse_result_t<Parse>;
  static_assert(keel::result<result_type>, "keel::http: parse must return absl::Status or absl::StatusOr<T>");

  exchange(client& c, const request& r, Parse parse) : client_(&c), request_(r), parse_(std::move(parse)) {
    if (request_.idempotency_key.empty()) {
      drawn_ = detail::key::draw();
      request_.idempotency_key = drawn_.view();
    }
  }
  exchange(const exchange& o) : client_(o.client_), request_(o.request_), parse_(o.parse_), drawn_(o.drawn_) {
    if (o.request_.idempotency_key.data() == o.drawn_.text.data()) request_.idempotency_key = drawn_.view();
  }
  exchange& operator=(const exchange&) = delete;

  // The key writes send (the request's, or the drawn one).
  [[nodiscard]] std::string_view idempotency_key() const noexcept { return request_.idempotency_key; }

  result_type operator()(const keel::attempt& a) const;

 private:
  client* client_;
  request request_;
  Parse parse_;
  detail::key drawn_{};
};

// A streaming provider for one call (client::stream): each attempt sends
// one request and feeds the 2xx event stream into the attempt's
// keel::stream_writer (keel/compose/stream.hpp). Copyable.
class stream_exchange {
 public:
  stream_exchange(client& c, const request& r) : client_(&c), request_(r) {}

  absl::Status operator()(const keel::attempt& a, stream_writer& w) const;

 private:
  client* client_;
  request request_;
};

class client {
 public:
  // Throws keel::invalid_options if `o` is invalid.
  explicit client(client_options o) : options_(std::move(o)) {
    keel::detail::require_valid(options_.validate());
    detail::global_init();
    shared_headers_ = detail::shared_headers(options_);
    idle_.reserve(options_.max_idle_handles);
  }
  ~client() {
    for (detail::slot* s : idle_) delete s;
    curl_slist_free_all(shared_headers_);
  }
  client(const client&) = delete;
  client& operator=(const client&) = delete;

  [[nodiscard]] const client_options& options() const noexcept { return options_; }

  // A provider for one call: each attempt sends `r`; a 2xx response is
  // handed to `parse`, whose result the attempt returns.
  template <class Parse>
  [[nodiscard]] http::exchange<std::decay_t<Parse>> exchange(const request& r, Parse&& parse) {
    return http::exchange<std::decay_t<Parse>>(*this, r, std::forward<Parse>(parse));
  }
  // A provider whose attempts return absl::Status and ignore the body.
  [[nodiscard]] http::exchange<detail::ignore_body> exchange(const request& r) {
    return http::exchange<detail::ignore_body>(*this, r, detail::ignore_body{});
  }

  // A streaming provider for keel::token_stream::attempts: each attempt
  // sends `r` (a chat completion request with "stream": true) and hands
  // every content token of the 2xx event stream (keel/provider/sse.hpp) to
  // the writer as it arrives (tool-call fragments and refusals too, and
  // to a writer whose caller takes events, every event with its data:
  // stream_writer::event). A non-2xx answer (a 429 before the stream) is
  // classified as exchange() does; an error event mid-stream is its
  // error_status(); a body that ends without [DONE] or a finish_reason is
  // Unavailable (the connection was cut). The writer's stop (a budget, a
  // lost race, the caller) aborts the transfer within a millisecond.
  [[nodiscard]] stream_exchange stream(const request& r) { return stream_exchange(*this, r); }

  // One streaming attempt (stream_exchange's).
  absl::Status perform_stream(const request& r, const keel::attempt& a, stream_writer& w) {
    return perform_impl(r, a, &w, [](const response&) { return absl::OkStatus(); });
  }

  // Performs one attempt: the status (classified, with hints) and, on a 2xx,
  // `on_success` called with the response while its body is valid.
  template <class OnSuccess>
  absl::Status perform(const request& r, const keel::attempt& a, OnSuccess&& on_success);

  // Handles idle in the pool (for tests and metrics).
  [[nodiscard]] std::size_t idle_handles() const {
    std::lock_guard lock(mu_);
    return idle_.size();
  }

 private:
  struct slot_deleter {
    client* owner;
    void operator()(detail::slot* s) const { owner->release(s); }
  };
  using lease = std::unique_ptr<detail::slot, slot_deleter>;

  lease acquire() {
    {
      std::lock_guard lock(mu_);
      if (!idle_.empty()) {
        detail::slot* s = idle_.back();
        idle_.pop_back();
        return lease(s, slot_deleter{this});
      }
    }
    auto* s = new detail::slot();
    if (s->easy == nullptr || s->multi == nullptr) {
      delete s;
      return lease(nullptr, slot_deleter{this});
    }
    detail::setup(*s, options_);
    return lease(s, slot_deleter{this});
  }

  void release(detail::slot* s) {
    if (s == nullptr) return;
    {
      std::lock_guard lock(mu_);
      if (idle_.size() < options_.max_idle_handles) {
        idle_.push_back(s);
        return;
      }
    }
    delete s;
  }

  template <class OnSuccess>
  absl::Status perform_impl(const request& r, const keel::attempt& a, stream_writer* stream, OnSuccess&& on_success);

  client_options options_;
  curl_slist* shared_headers_ = nullptr;
  mutable std::mutex mu_;
  std::vector<detail::slot*> idle_;
};

template <class OnSuccess>
absl::Status client::perform(const request& r, const keel::attempt& a, OnSuccess&& on_success) {
  return perform_impl(r, a, nullptr, std::forward<OnSuccess>(on_success));
}

template <class OnSuccess>
absl::Status client::perform_impl(const request& r, const keel::attempt& a, stream_writer* stream,
                                  OnSuccess&& on_success) {
  if (absl::Status refused = detail::refuse_start(a); !refused.ok()) return refused;
  lease held = acquire();
  if (!held) return mark_not_started(absl::UnavailableError("keel::http: could not create a libcurl handle"));
  detail::slot& s = *held;
  detail::prepare(s, r, a, options_, shared_headers_, stream);

  // The transfer, on the slot's multi handle: a stop request wakes the
  // poll at once, and the transfer is dropped.
  CURLcode rc = CURLE_OK;
  bool stopped = false;
  if (curl_multi_add_handle(s.multi, s.easy) != CURLM_OK) {
    curl_easy_setopt(s.easy, CURLOPT_HTTPHEADER, nullptr);
    return mark_not_started(absl::UnavailableError("keel::http: curl_multi_add_handle failed"));
  }
  {
    CURLM* m = s.multi;
    std::stop_callback wake(a.stop, [m] { curl_multi_wakeup(m); });
    for (;;) {
      if (a.stop.stop_requested()) {
        stopped = true;
        break;
      }
      int running = 0;
      if (curl_multi_perform(m, &running) != CURLM_OK) {
        rc = CURLE_FAILED_INIT;
        break;
      }
      int queued = 0;
      bool done = false;
      while (CURLMsg* msg = curl_multi_info_read(m, &queued)) {
        if (msg->msg == CURLMSG_DONE) {
          rc = msg->data.result;
          done = true;
        }
      }
      if (done || running == 0) break;
      // libcurl's CURLOPT_TIMEOUT_MS ends the transfer; the poll's own
      // timeout only bounds how long one wait may take.
      if (curl_multi_poll(m, nullptr, 0, 1000, nullptr) != CURLM_OK) {
        rc = CURLE_FAILED_INIT;
        break;
      }
    }
  }
  curl_multi_remove_handle(s.multi, s.easy);
  return detail::conclude(s, a, rc, stopped, options_, std::forward<OnSuccess>(on_success));
}

inline absl::Status stream_exchange::operator()(const keel::attempt& a, stream_writer& w) const {
  return client_->perform_stream(request_, a, w);
}

namespace detail {

// An exchange's result: `perform(on_success)` runs the attempt (returning
// its status) and calls on_success with a 2xx response, which `parse` reads.
template <class Parse, class Perform>
parse_result_t<Parse> parsed_result(const Parse& parse, Perform&& perform) {
  using result_type = parse_result_t<Parse>;
  if constexpr (std::is_same_v<result_type, absl::Status>) {
    absl::Status parsed;
    absl::Status st = std::forward<Perform>(perform)([&](const response& r) {
      parsed = parse(r);
      return absl::OkStatus();
    });
    return st.ok() ? parsed : st;
  } else {
    std::optional<result_type> parsed;
    absl::Status st = std::forward<Perform>(perform)([&](const response& r) {
      parsed.emplace(parse(r));
      return absl::OkStatus();
    });
    if (!st.ok()) return result_type(std::move(st));
    return std::move(*parsed);
  }
}

}  // namespace detail

template <class Parse>
auto exchange<Parse>::operator()(const keel::attempt& a) const -> result_type {
  return detail::parsed_result(parse_, [&](auto&& on_success) { return client_->perform(request_, a, on_success); });
}

}  // namespace keel::http
