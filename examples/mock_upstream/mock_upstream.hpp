// mock_upstream/mock_upstream.hpp — a small OpenAI-compatible model server
// over real HTTP, with faults switched at run time: what keel's gateway, its
// tests, its demo and its benchmarks put behind them instead of vLLM,
// llama.cpp or OpenAI.
//
// It answers as OpenAI's published API does (chat completion objects,
// chat.completion.chunk events over SSE ending with `data: [DONE]`, the
// embeddings object, the error object {"error":{message,type,param,code}}),
// with deterministic text: the same prompt gives the same answer, so a test
// can check what it got. The words follow the gateway's simulated provider
// (examples/gateway/simulated_provider.hpp), and so does the feedback JSON a
// `response_format: json_object` request gets.
//
//   POST /v1/chat/completions   stream or not; tool calls, refusals, json_object
//   POST /v1/embeddings         float or base64 vectors
//   GET  /v1/models             the configured model ids
//   GET  /healthz               {"status":"ok"}
//   POST /control/fault         switch the fault (JSON, see fault below)
//   GET  /control/fault         the fault now
//   GET  /control/stats         what the server saw (figures, as JSON)
//   POST /control/reset         zero the figures, clear the fault
//
// A fault applies to model requests (chat completions and embeddings) that
// start after it is set; an outage also cuts running streams at their next
// token. The server notices a client that hangs up while it streams, waits
// or holds a request (it polls the connection every few milliseconds) and
// stops the work at once: the figures say how many and when.
//
// Example:
//
//   mock_upstream::server mock({.name = "vllm-a", .first_token = std::chrono::milliseconds(30)});
//   absl::StatusOr<int> port = mock.start();   // 127.0.0.1, a free port
//   mock.set_fault({.kind = mock_upstream::fault_kind::rate_limit, .retry_after_ms = 250});
//   ... requests to http://127.0.0.1:<port>/v1/chat/completions get 429s ...
//   mock.stop();
//
// Real clock only: it stands for a real server, and tests drive it as one.
//
// Thread-safety: start and stop from one thread (the owner's); set_fault,
// current_fault, reset and figures from any thread, also while it serves.
// Requests are served on the server's own pool of `threads` threads.
#pragma once

#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <arpa/inet.h>
#include <unistd.h>

#include <httplib.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "keel/core/status.hpp"

namespace mock_upstream {

using json = nlohmann::json;
using millis = std::chrono::milliseconds;
using steady = std::chrono::steady_clock;

// ---------------------------------------------------------------- options ---

struct options {
  std::string name = "mock";             // owned_by in /v1/models, and the "listening" line; no spaces
  int port = 0;                          // on 127.0.0.1; 0: a free one
  millis latency{50};                    // a non-streamed answer (and an embedding) takes this
  millis first_token{50};                // a stream's first token comes this long after its headers
  millis token_gap{10};                  // then one token every gap
  int tokens = 16;                       // tokens in an answer (before max_tokens), in [1, 100000]
  std::uint64_t seed = 0;                // mixed into the text, the ids and the fault draws
  std::vector<std::string> models = {"mock-small", "mock-large"};
  // Request threads: every stream and every held request keeps one, and so
  // does every idle kept-alive connection, so many more than the cores.
  int threads = 512;
  // The kernel's queue of connections not yet accepted (cpp-httplib 0.11
  // listens with 5: a burst of clients would see refused connections).
  int listen_backlog = 1024;

  [[nodiscard]] absl::Status validate() const {
    using keel::invalid_option;
    if (name.empty() || name.find_first_of(" \t\r\n") != std::string::npos)
      return invalid_option("mock_upstream::options", "name", "be a non-empty word (no spaces)", "'" + name + "'");
    if (port < 0 || port > 65535) return invalid_option("mock_upstream::options", "port", "be in [0, 65535]", port);
    for (auto [field, v] : {std::pair{"latency", latency}, {"first_token", first_token}, {"token_gap", token_gap}}) {
      if (v < millis::zero() || v > std::chrono::minutes(10))
        return invalid_option("mock_upstream::options", field, "be in [0, 10min]", v);
    }
    if (tokens < 1 || tokens > 100000)
      return invalid_option("mock_upstream::options", "tokens", "be in [1, 100000]", tokens);
    if (models.empty()) return invalid_option("mock_upstream::options", "models", "name at least one model", 0);
    for (const std::string& m : models) {
      if (m.empty() || m.find_first_of(" ,\t\r\n\"") != std::string::npos)
        return invalid_option("mock_upstream::options", "models", "be ids without spaces, commas or quotes",
                             "'" + m + "'");
    }
    if (threads < 1 || threads > 4096)
      return invalid_option("mock_upstream::options", "threads", "be in [1, 4096]", threads);
    if (listen_backlog < 1 || listen_backlog > 65535)
      return invalid_option("mock_upstream::options", "listen_backlog", "be in [1, 65535]", listen_backlog);
    return absl::OkStatus();
  }
};

// ----------------------------------------------------------------- faults ---

enum class fault_kind {
  none,
  slowdown,          // every latency times `factor`
  outage,            // 503 at once; running streams are cut at their next token
  rate_limit,        // 429 with retry-after-ms, Retry-After and x-ratelimit-reset-requests
  server_error,      // `status` (500, 502, 503) for the next `count` requests (0: every one)
  slow_first_token,  // the first token after `first_token_ms` (a non-streamed answer: that much later)
  stall,             // a stream sends `after_tokens` tokens, then nothing until the client leaves
  cut,               // a stream sends `after_tokens` tokens, then the connection is closed without [DONE]
  error_event,       // a stream sends `after_tokens` tokens, then an error event, and ends
  hang,              // no headers ever: the request is held until the client leaves
};

inline constexpr std::array<fault_kind, 10> all_fault_kinds = {
    fault_kind::none,         fault_kind::slowdown,         fault_kind::outage, fault_kind::rate_limit,
    fault_kind::server_error, fault_kind::slow_first_token, fault_kind::stall,  fault_kind::cut,
    fault_kind::error_event,  fault_kind::hang};

[[nodiscard]] constexpr std::string_view to_string(fault_kind k) noexcept {
  switch (k) {
    case fault_kind::none: return "none";
    case fault_kind::slowdown: return "slowdown";
    case fault_kind::outage: return "outage";
    case fault_kind::rate_limit: return "rate_limit";
    case fault_kind::server_error: return "server_error";
    case fault_kind::slow_first_token: return "slow_first_token";
    case fault_kind::stall: return "stall";
    case fault_kind::cut: return "cut";
    case fault_kind::error_event: return "error_event";
    case fault_kind::hang: return "hang";
  }
  return "unknown";
}

struct fault {
  fault_kind kind = fault_kind::none;
  double factor = 3.0;          // slowdown: in [1, 1000]
  int retry_after_ms = 1000;    // rate_limit: the hint, in [0, 3600000]
  int status = 500;             // server_error: 500, 502 or 503
  int count = 0;                // any kind: this many affected requests, then healthy; 0: every request
  std::string hint_headers = "both";  // rate_limit: "both", "retry-after-ms" only or "retry-after" only
  int first_token_ms = 2000;    // slow_first_token: in [0, 600000]
  int after_tokens = 3;         // stall, cut, error_event: tokens sent first, in [0, 100000]
  double ratio = 1.0;           // share of requests affected, in [0, 1]
  std::string x_should_retry{}; // "true" or "false": sent with error answers; empty: not sent

  [[nodiscard]] absl::Status validate() const {
    using keel::invalid_option;
    if (!(factor >= 1.0 && factor <= 1000.0)) return invalid_option("fault", "factor", "be in [1, 1000]", factor);
    if (retry_after_ms < 0 || retry_after_ms > 3600000)
      return invalid_option("fault", "retry_after_ms", "be in [0, 3600000]", retry_after_ms);
    if (status != 500 && status != 502 && status != 503)
      return invalid_option("fault", "status", "be 500, 502 or 503", status);
    if (count < 0 || count > 1000000) return invalid_option("fault", "count", "be in [0, 1000000]", count);
    if (first_token_ms < 0 || first_token_ms > 600000)
      return invalid_option("fault", "first_token_ms", "be in [0, 600000]", first_token_ms);
    if (after_tokens < 0 || after_tokens > 100000)
      return invalid_option("fault", "after_tokens", "be in [0, 100000]", after_tokens);
    if (!(ratio >= 0.0 && ratio <= 1.0)) return invalid_option("fault", "ratio", "be in [0, 1]", ratio);
    if (hint_headers != "both" && hint_headers != "retry-after-ms" && hint_headers != "retry-after")
      return invalid_option("fault", "hint_headers", "be \"both\", \"retry-after-ms\" or \"retry-after\"",
                            "'" + hint_headers + "'");
    if (!x_should_retry.empty() && x_should_retry != "true" && x_should_retry != "false")
      return invalid_option("fault", "x_should_retry", "be \"true\" or \"false\"", "'" + x_should_retry + "'");
    return absl::OkStatus();
  }

  [[nodiscard]] json to_json() const {
    json j = {{"kind", to_string(kind)}, {"ratio", ratio}};
    switch (kind) {
      case fault_kind::slowdown: j["factor"] = factor; break;
      case fault_kind::rate_limit:
        j["retry_after_ms"] = retry_after_ms;
        if (hint_headers != "both") j["hint_headers"] = hint_headers;
        break;
      case fault_kind::server_error:
        j["status"] = status;
        j["count"] = count;
        break;
      case fault_kind::slow_first_token: j["first_token_ms"] = first_token_ms; break;
      case fault_kind::stall:
      case fault_kind::cut:
      case fault_kind::error_event: j["after_tokens"] = after_tokens; break;
      default: break;
    }
    if (count > 0 && kind != fault_kind::server_error) j["count"] = count;
    if (!x_should_retry.empty()) j["x_should_retry"] = x_should_retry;
    return j;
  }

  // The control endpoint's body: {"kind": K, ...fields}. Unknown fields and
  // wrong types are errors naming the field (a typo must not pass silently).
  [[nodiscard]] static absl::StatusOr<fault> from_json(const json& j) {
    using keel::invalid_option;
    if (!j.is_object()) return invalid_option("fault", "body", "be a JSON object", j.type_name());
    fault f;
    if (!j.contains("kind") || !j["kind"].is_string())
      return invalid_option("fault", "kind", "be a string: none, slowdown, outage, rate_limit, server_error, "
                                            "slow_first_token, stall, cut, error_event or hang", "missing or not a string");
    const std::string kind = j["kind"].get<std::string>();
    const auto* k = std::find_if(all_fault_kinds.begin(), all_fault_kinds.end(),
                                 [&](fault_kind c) { return to_string(c) == kind; });
    if (k == all_fault_kinds.end())
      return invalid_option("fault", "kind", "be one of none, slowdown, outage, rate_limit, server_error, "
                                            "slow_first_token, stall, cut, error_event, hang", "'" + kind + "'");
    f.kind = *k;
    for (const auto& [key, v] : j.items()) {
      if (key == "kind") continue;
      if (key == "factor" || key == "ratio") {
        if (!v.is_number()) return invalid_option("fault", key, "be a number", v.dump());
        (key == "factor" ? f.factor : f.ratio) = v.get<double>();
      } else if (key == "retry_after_ms" || key == "status" || key == "count" || key == "first_token_ms" ||
                 key == "after_tokens") {
        if (!v.is_number_integer()) return invalid_option("fault", key, "be an integer", v.dump());
        // Clamped into an int: validate() below names the field's range.
        const int i = static_cast<int>(std::clamp<std::int64_t>(v.get<std::int64_t>(), -1, 2000000000));
        if (key == "retry_after_ms") f.retry_after_ms = i;
        else if (key == "status") f.status = i;
        else if (key == "count") f.count = i;
        else if (key == "first_token_ms") f.first_token_ms = i;
        else f.after_tokens = i;
      } else if (key == "x_should_retry") {
        if (!v.is_string()) return invalid_option("fault", key, "be \"true\" or \"false\"", v.dump());
        f.x_should_retry = v.get<std::string>();
      } else if (key == "hint_headers") {
        if (!v.is_string()) return invalid_option("fault", key, "be a string", v.dump());
        f.hint_headers = v.get<std::string>();
      } else {
        return invalid_option("fault", key, "be a known field (kind, factor, retry_after_ms, status, count, "
                                           "first_token_ms, after_tokens, ratio, x_should_retry, hint_headers)", "unknown");
      }
    }
    if (absl::Status s = f.validate(); !s.ok()) return s;
    return f;
  }
};

// ---------------------------------------------------------------- figures ---

// What the server saw since it started (or since reset()).
struct figures {
  std::int64_t chat_requests = 0, embedding_requests = 0, model_requests = 0, other_requests = 0;
  std::int64_t chat_started = 0;       // chat requests that got past the faults and began answering
  std::int64_t chat_completed = 0;     // ... that answered in full (a stream: up to [DONE])
  std::int64_t streams_started = 0, streams_completed = 0;
  std::int64_t faulted = 0;            // model requests answered by a fault's error status
  std::int64_t streams_cut = 0;        // cut by `cut` or `outage`: closed without [DONE]
  std::int64_t error_events = 0;       // streams ended by an error event
  std::int64_t stalled = 0, hung = 0;  // streams that stalled, requests held without headers
  std::int64_t client_gone = 0;        // requests stopped because their client hung up ...
  std::int64_t client_gone_streaming = 0;  // ... while a stream ran (or stalled)
  std::int64_t client_gone_waiting = 0;    // ... while held (hang), or before a non-streamed answer
  std::int64_t last_client_gone_unix_ms = 0;   // when the server noticed the last one (wall clock)
  std::int64_t last_client_gone_detect_ms = -1;  // ... at most this long after the hang-up
  std::int64_t in_flight = 0;          // model requests being answered now
};

// The headers of interest of the last model request (never the key itself).
struct seen_headers {
  std::string path, idempotency_key, request_timeout_ms, stainless_retry_count, stainless_timeout, request_id;
  bool authorization = false;
  std::string authorization_scheme;  // "Bearer", ...
};

// ------------------------------------------------------------ the content ---

namespace detail {

// FNV-1a: the same hash on every platform, so the text is too.
[[nodiscard]] inline std::uint64_t fnv1a(std::string_view s, std::uint64_t h = 1469598103934665603ull) noexcept {
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}
[[nodiscard]] inline std::uint64_t mix(std::uint64_t x) noexcept {  // splitmix64
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The gateway's simulated provider's words (each ends in a space).
inline constexpr std::array<std::string_view, 16> words = {
    "Start ", "with ", "one ", "deadline ", "for ", "the ", "whole ", "request; ", "each ", "stage ",
    "spends ", "what ", "is ", "left, ", "never ", "more. "};

[[nodiscard]] inline std::vector<std::string> text_tokens(std::string_view prompt, std::uint64_t seed, int n) {
  const std::uint64_t h = fnv1a(prompt) ^ mix(seed);
  std::vector<std::string> out;
  out.reserve(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) out.emplace_back(words[(h + static_cast<std::uint64_t>(i) * 7) % words.size()]);
  return out;
}

// `s` in `k` pieces of nearly equal size (fewer when s is shorter).
[[nodiscard]] inline std::vector<std::string> split(std::string_view s, std::size_t k) {
  k = std::max<std::size_t>(1, std::min(k, s.size()));
  std::vector<std::string> out;
  for (std::size_t i = 0; i < k; ++i) out.emplace_back(s.substr(i * s.size() / k, (i + 1) * s.size() / k - i * s.size() / k));
  return out;
}

[[nodiscard]] inline std::vector<std::string> split_words(std::string_view s) {
  std::vector<std::string> out;
  std::size_t at = 0;
  while (at < s.size()) {
    std::size_t end = s.find(' ', at);
    end = end == std::string_view::npos ? s.size() : end + 1;
    out.emplace_back(s.substr(at, end - at));
    at = end;
  }
  return out;
}

[[nodiscard]] inline std::string base64(const void* data, std::size_t n) {
  static constexpr char alphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  const auto* p = static_cast<const unsigned char*>(data);
  std::string out;
  out.reserve((n + 2) / 3 * 4);
  for (std::size_t i = 0; i < n; i += 3) {
    const std::uint32_t v = (std::uint32_t{p[i]} << 16) | (i + 1 < n ? std::uint32_t{p[i + 1]} << 8 : 0u) |
                            (i + 2 < n ? std::uint32_t{p[i + 2]} : 0u);
    out += alphabet[(v >> 18) & 63];
    out += alphabet[(v >> 12) & 63];
    out += i + 1 < n ? alphabet[(v >> 6) & 63] : '=';
    out += i + 2 < n ? alphabet[v & 63] : '=';
  }
  return out;
}

// A message's content as text: a string, or the text parts of an array.
[[nodiscard]] inline std::string content_text(const json& content) {
  if (content.is_string()) return content.get<std::string>();
  std::string out;
  if (content.is_array()) {
    for (const json& part : content) {
      if (part.is_object() && part.contains("text") && part["text"].is_string()) out += part["text"].get<std::string>();
    }
  }
  return out;
}

[[nodiscard]] inline std::int64_t unix_ms() {
  return std::chrono::duration_cast<millis>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// The connection a request came on, watched for its client hanging up.
// cpp-httplib 0.11 gives a handler no socket and a content provider only
// is_writable() (which says nothing until a write fails), so the socket is
// found by its addresses: the one whose local port and peer are the
// request's. It stays open while the handler or its content provider runs.
class connection {
 public:
  enum class wait_result { reached, client_gone, stopping };

  connection(const httplib::Request& req, const std::atomic<bool>& stopping) : stopping_(stopping) {
    fd_ = find_socket(req.remote_addr, req.remote_port, req.local_port);
  }

  // Waits until `t`, polling the socket every few milliseconds.
  wait_result wait_until(steady::time_point t) {
    for (;;) {
      if (stopping_.load(std::memory_order_relaxed)) return wait_result::stopping;
      const steady::time_point now = steady::now();
      if (gone(now)) return wait_result::client_gone;
      if (now >= t) return wait_result::reached;
      const auto slice = std::min<steady::duration>(t - now, millis(5));
      const int ms = static_cast<int>(std::chrono::ceil<millis>(slice).count());
      if (fd_ < 0) {
        std::this_thread::sleep_for(slice);
        continue;
      }
      pollfd p{.fd = fd_, .events = POLLRDHUP, .revents = 0};
      alive_at_ = now;
      if (::poll(&p, 1, ms) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0) {
        gone_ = true;
        detect_ = steady::now() - alive_at_;
        return wait_result::client_gone;
      }
    }
  }
  wait_result hold() { return wait_until(steady::time_point::max()); }

  // How long after the last check that found the client there it was found gone.
  [[nodiscard]] millis detect_bound() const { return std::chrono::ceil<millis>(detect_); }

 private:
  bool gone(steady::time_point now) {
    if (gone_) return true;
    if (fd_ < 0) return false;
    pollfd p{.fd = fd_, .events = POLLRDHUP, .revents = 0};
    if (::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0) {
      gone_ = true;
      detect_ = now - alive_at_;
    }
    alive_at_ = now;
    return gone_;
  }

  // Reads no other thread's descriptor (they may be closing theirs meanwhile):
  // the socket's inode comes from /proc/self/net/tcp, and the descriptor
  // whose /proc/self/fd link names that inode is this request's.
  static int find_socket(const std::string& peer_addr, int peer_port, int local_port) {
    in_addr want{};
    if (::inet_pton(AF_INET, peer_addr.c_str(), &want) != 1) return -1;
    unsigned long inode = 0;
    if (std::FILE* tcp = std::fopen("/proc/self/net/tcp", "r")) {
      char line[512];
      while (inode == 0 && std::fgets(line, sizeof line, tcp) != nullptr) {
        unsigned local_addr = 0, lport = 0, remote_addr = 0, rport = 0;
        unsigned long node = 0;
        // "  sl  local_address rem_address   st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode"
        if (std::sscanf(line, " %*d: %8X:%4X %8X:%4X %*X %*X:%*X %*X:%*X %*X %*u %*u %lu", &local_addr, &lport,
                        &remote_addr, &rport, &node) == 5 &&
            static_cast<int>(lport) == local_port && static_cast<int>(rport) == peer_port &&
            remote_addr == want.s_addr)
          inode = node;
      }
      std::fclose(tcp);
    }
    if (inode == 0) return -1;
    const std::string target = "socket:[" + std::to_string(inode) + "]";
    int found = -1;
    if (DIR* dir = ::opendir("/proc/self/fd")) {
      while (dirent* e = ::readdir(dir)) {
        char link[64];
        const ssize_t n = ::readlinkat(::dirfd(dir), e->d_name, link, sizeof link);
        if (n > 0 && std::string_view(link, static_cast<std::size_t>(n)) == target) {
          found = std::atoi(e->d_name);
          break;
        }
      }
      ::closedir(dir);
    }
    return found;
  }

 private:
  const std::atomic<bool>& stopping_;
  int fd_ = -1;
  bool gone_ = false;
  steady::time_point alive_at_ = steady::now();
  steady::duration detect_{};
};

// cpp-httplib's server, with its listening socket in reach: 0.11 listens
// with a backlog of 5, compiled into Debian's shared library; listen() again
// on the bound socket raises it (Linux updates a listening socket's backlog).
class http_server : public httplib::Server {
 public:
  bool raise_backlog(int n) { return ::listen(svr_sock_, n) == 0; }
};

}  // namespace detail

// ----------------------------------------------------------------- server ---

class server {
 public:
  explicit server(mock_upstream::options o) : options_(std::move(o)), rng_(detail::mix(options_.seed)) {}
  ~server() { stop(); }
  server(const server&) = delete;
  server& operator=(const server&) = delete;

  // Binds 127.0.0.1:options.port and serves on the server's threads; the
  // port it listens on. Once per server.
  absl::StatusOr<int> start() {
    if (absl::Status s = options_.validate(); !s.ok()) return s;
    if (thread_.joinable()) return absl::FailedPreconditionError("mock_upstream: already started");
    const int threads = options_.threads;
    http_.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<std::size_t>(threads)); };
    http_.set_tcp_nodelay(true);                  // an SSE event goes out when written
    http_.set_keep_alive_max_count(100000);       // clients pool their connections
    // A thread on an idle kept-alive connection sees a stop only when this
    // runs out (cpp-httplib's default is 5 s): stopping takes at most this.
    http_.set_keep_alive_timeout(1);
    http_.set_payload_max_length(std::size_t{64} << 20);
    routes();
    const int port = options_.port == 0 ? http_.bind_to_any_port("127.0.0.1")
                                        : (http_.bind_to_port("127.0.0.1", options_.port) ? options_.port : -1);
    if (port <= 0) return absl::UnavailableError("mock_upstream: cannot listen on 127.0.0.1:" + std::to_string(options_.port));
    if (!http_.raise_backlog(options_.listen_backlog))
      return absl::InternalError("mock_upstream: listen(backlog) failed");
    port_ = port;
    started_unix_ = detail::unix_ms() / 1000;
    thread_ = std::thread([this] { http_.listen_after_bind(); });
    while (!http_.is_running()) std::this_thread::sleep_for(millis(1));
    return port;
  }

  // Stops listening, ends held requests and streams (their connections are
  // closed), and joins the threads: within about a second (an idle
  // kept-alive connection's timeout). Idempotent.
  void stop() {
    stopping_.store(true);
    if (thread_.joinable()) {
      http_.stop();
      thread_.join();
    }
  }

  [[nodiscard]] int port() const noexcept { return port_; }
  [[nodiscard]] const mock_upstream::options& config() const noexcept { return options_; }

  absl::Status set_fault(const fault& f) {
    if (absl::Status s = f.validate(); !s.ok()) return s;
    std::lock_guard lock(mu_);
    fault_ = f;
    burst_left_ = f.count;
    return absl::OkStatus();
  }
  [[nodiscard]] fault current_fault() const {
    std::lock_guard lock(mu_);
    return fault_;
  }
  // Zeroes the figures and clears the fault.
  void reset() {
    std::lock_guard lock(mu_);
    fault_ = fault{};
    const std::int64_t in_flight = figures_.in_flight;
    figures_ = mock_upstream::figures{};
    figures_.in_flight = in_flight;  // those are still running
    seen_ = seen_headers{};
  }
  [[nodiscard]] mock_upstream::figures figures() const {
    std::lock_guard lock(mu_);
    return figures_;
  }
  [[nodiscard]] seen_headers last_headers() const {
    std::lock_guard lock(mu_);
    return seen_;
  }

  // GET /control/stats's body.
  [[nodiscard]] json stats_json() const {
    const mock_upstream::figures f = figures();
    const seen_headers h = last_headers();
    auto opt = [](const std::string& s) { return s.empty() ? json(nullptr) : json(s); };
    return {
        {"name", options_.name},
        {"requests", {{"chat", f.chat_requests}, {"embeddings", f.embedding_requests}, {"models", f.model_requests},
                      {"other", f.other_requests}}},
        {"chat", {{"started", f.chat_started}, {"completed", f.chat_completed}, {"streams_started", f.streams_started},
                  {"streams_completed", f.streams_completed}}},
        {"faulted", f.faulted},
        {"streams_cut", f.streams_cut},
        {"error_events", f.error_events},
        {"stalled", f.stalled},
        {"hung", f.hung},
        {"client_gone", {{"count", f.client_gone}, {"while_streaming", f.client_gone_streaming},
                         {"while_waiting", f.client_gone_waiting}, {"last_unix_ms", f.last_client_gone_unix_ms},
                         {"last_detect_ms", f.last_client_gone_detect_ms}}},
        {"in_flight", f.in_flight},
        {"fault", current_fault().to_json()},
        {"last_request", {{"path", opt(h.path)}, {"idempotency_key", opt(h.idempotency_key)},
                          {"x_request_timeout_ms", opt(h.request_timeout_ms)},
                          {"x_stainless_retry_count", opt(h.stainless_retry_count)},
                          {"x_stainless_timeout", opt(h.stainless_timeout)}, {"x_request_id", opt(h.request_id)},
                          {"authorization", {{"present", h.authorization}, {"scheme", opt(h.authorization_scheme)}}}}},
    };
  }

 private:
  // What one model request drew at its start.
  struct draw {
    fault f;            // the fault in force
    bool affected = false;
    double u = 1.0;     // its draw against a ratio (kept: an outage later uses it too)
  };

  // A chat completion, decided before the first byte.
  struct answer {
    std::string id, model;
    std::int64_t created = 0;
    enum class kind { text, refusal, tools } what = kind::text;
    std::vector<std::string> pieces;  // content or refusal tokens
    struct tool_call {
      std::string id, name, arguments;
      std::vector<std::string> fragments;
    };
    std::vector<tool_call> tools;
    std::string finish_reason = "stop";
    std::int64_t prompt_tokens = 0;
    bool include_usage = false;
    [[nodiscard]] std::int64_t completion_tokens() const {
      if (what != kind::tools) return static_cast<std::int64_t>(pieces.size());
      std::int64_t n = 0;
      for (const tool_call& t : tools) n += static_cast<std::int64_t>(t.fragments.size());
      return n;
    }
  };

  // Decrements in_flight when the request's work ends (the handler's, or
  // its content provider's, which outlives the handler).
  struct in_flight_scope {
    explicit in_flight_scope(server& s) : s(s) {
      std::lock_guard lock(s.mu_);
      ++s.figures_.in_flight;
    }
    ~in_flight_scope() {
      std::lock_guard lock(s.mu_);
      --s.figures_.in_flight;
    }
    in_flight_scope(const in_flight_scope&) = delete;
    in_flight_scope& operator=(const in_flight_scope&) = delete;
    server& s;
  };

  template <class F>
  void count(F f) {
    std::lock_guard lock(mu_);
    f(figures_);
  }

  void routes() {
    http_.Post("/v1/chat/completions", [this](const httplib::Request& q, httplib::Response& r) { chat(q, r); });
    http_.Post("/v1/embeddings", [this](const httplib::Request& q, httplib::Response& r) { embeddings(q, r); });
    http_.Get("/v1/models", [this](const httplib::Request& q, httplib::Response& r) { models(q, r); });
    http_.Get("/healthz", [](const httplib::Request&, httplib::Response& r) {
      r.set_content(R"({"status":"ok"})", "application/json");
    });
    http_.Get("/control/fault", [this](const httplib::Request&, httplib::Response& r) {
      r.set_content(current_fault().to_json().dump(), "application/json");
    });
    http_.Post("/control/fault", [this](const httplib::Request& q, httplib::Response& r) { control_fault(q, r); });
    http_.Get("/control/stats", [this](const httplib::Request&, httplib::Response& r) {
      r.set_content(stats_json().dump(), "application/json");
    });
    http_.Post("/control/reset", [this](const httplib::Request&, httplib::Response& r) {
      reset();
      r.set_content(R"({"status":"reset"})", "application/json");
    });
    // Every answer carries a request id; unknown paths get OpenAI's error shape.
    http_.set_post_routing_handler([this](const httplib::Request&, httplib::Response& r) {
      if (!r.has_header("x-request-id")) r.set_header("x-request-id", next_id("req_"));
    });
    http_.set_error_handler([this](const httplib::Request& q, httplib::Response& r) {
      if (!r.body.empty()) return;
      count([](mock_upstream::figures& g) { ++g.other_requests; });
      r.set_content(error_body("Unknown request URL: " + q.method + " " + q.path, "invalid_request_error", "", "unknown_url"),
                    "application/json");
    });
  }

  // ---- shared pieces ----

  [[nodiscard]] std::string next_id(std::string_view prefix) {
    const std::uint64_t n = ids_.fetch_add(1, std::memory_order_relaxed);
    char buf[24];
    // Two mocks with the same seed but other names give other ids.
    const std::uint64_t salt = detail::mix(options_.seed) ^ detail::fnv1a(options_.name);
    std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(detail::mix(n ^ salt)));
    return std::string(prefix) + buf;
  }

  [[nodiscard]] static std::string error_body(std::string_view message, std::string_view type, std::string_view param,
                                              std::string_view code) {
    auto opt = [](std::string_view s) { return s.empty() ? json(nullptr) : json(std::string(s)); };
    return json{{"error", {{"message", message}, {"type", type}, {"param", opt(param)}, {"code", opt(code)}}}}.dump();
  }
  static void bad_request(httplib::Response& r, std::string_view message, std::string_view param) {
    r.status = 400;
    r.set_content(error_body(message, "invalid_request_error", param, ""), "application/json");
  }

  void record_headers(const httplib::Request& q) {
    seen_headers h;
    h.path = q.path;
    h.idempotency_key = q.get_header_value("Idempotency-Key");
    h.request_timeout_ms = q.get_header_value("x-request-timeout-ms");
    h.stainless_retry_count = q.get_header_value("X-Stainless-Retry-Count");
    h.stainless_timeout = q.get_header_value("X-Stainless-Timeout");
    h.request_id = q.get_header_value("x-request-id");
    if (q.has_header("Authorization")) {
      h.authorization = true;
      const std::string a = q.get_header_value("Authorization");
      h.authorization_scheme = a.substr(0, a.find(' '));  // the scheme only, never the key
    }
    std::lock_guard lock(mu_);
    seen_ = std::move(h);
  }

  // The fault this request meets; a burst (count > 0) spends one of its count.
  draw take_fault() {
    std::lock_guard lock(mu_);
    draw d{fault_, false, std::uniform_real_distribution<double>(0.0, 1.0)(rng_)};
    d.affected = fault_.kind != fault_kind::none && d.u < fault_.ratio;
    if (d.affected && fault_.count > 0) {
      if (--burst_left_ <= 0) fault_ = fault{};  // the burst is over: healthy again
    }
    return d;
  }
  [[nodiscard]] bool outage_now(double u) const {
    std::lock_guard lock(mu_);
    return fault_.kind == fault_kind::outage && u < fault_.ratio;
  }

  // Answers an error-status fault (outage, rate_limit, server_error); false when `d` is none of them.
  bool answer_error_fault(const draw& d, httplib::Response& r) {
    if (!d.affected) return false;
    const fault& f = d.f;
    switch (f.kind) {
      case fault_kind::outage:
        r.status = 503;
        r.set_content(error_body("The server is temporarily unavailable (mock outage).", "server_error", "", ""),
                      "application/json");
        break;
      case fault_kind::rate_limit: {
        r.status = 429;
        if (f.hint_headers != "retry-after") r.set_header("retry-after-ms", std::to_string(f.retry_after_ms));
        if (f.hint_headers != "retry-after-ms")
          r.set_header("Retry-After", std::to_string((f.retry_after_ms + 999) / 1000));
        r.set_header("x-ratelimit-limit-requests", "60");
        r.set_header("x-ratelimit-remaining-requests", "0");
        r.set_header("x-ratelimit-reset-requests",
                     f.retry_after_ms % 1000 == 0 ? std::to_string(f.retry_after_ms / 1000) + "s"
                                                  : std::to_string(f.retry_after_ms) + "ms");
        r.set_content(error_body("Rate limit reached for requests (mock). Please try again in " +
                                     std::to_string(f.retry_after_ms) + "ms.",
                                 "rate_limit_exceeded", "", "rate_limit_exceeded"),
                      "application/json");
        break;
      }
      case fault_kind::server_error:
        r.status = f.status;
        r.set_content(error_body(f.status == 502   ? "Bad gateway (mock)."
                                 : f.status == 503 ? "The engine is currently overloaded (mock)."
                                                   : "The server had an error while processing your request (mock).",
                                 "server_error", "", ""),
                      "application/json");
        break;
      default: return false;
    }
    if (!f.x_should_retry.empty()) r.set_header("x-should-retry", f.x_should_retry);
    count([](mock_upstream::figures& g) { ++g.faulted; });
    return true;
  }

  // Holds the request without an answer until its client leaves (hang, and
  // stall on a non-streamed request).
  void hold(const httplib::Request& q, httplib::Response& r) {
    count([](mock_upstream::figures& g) { ++g.hung; });
    detail::connection conn(q, stopping_);
    if (conn.hold() == detail::connection::wait_result::client_gone) client_left(conn, false);
    r.status = 503;  // nobody reads it (or the server is stopping)
    r.set_content(error_body("The request was held (mock hang).", "server_error", "", ""), "application/json");
  }

  void client_left(const detail::connection& conn, bool streaming) {
    count([&](mock_upstream::figures& g) {
      ++g.client_gone;
      ++(streaming ? g.client_gone_streaming : g.client_gone_waiting);
      g.last_client_gone_unix_ms = detail::unix_ms();
      g.last_client_gone_detect_ms = conn.detect_bound().count();
    });
  }

  [[nodiscard]] static millis scaled(millis d, const draw& dr) {
    if (dr.affected && dr.f.kind == fault_kind::slowdown)
      return std::chrono::duration_cast<millis>(std::chrono::duration<double, std::milli>(d) * dr.f.factor);
    return d;
  }

  // ---- chat completions ----

  void chat(const httplib::Request& q, httplib::Response& r) {
    count([](mock_upstream::figures& g) { ++g.chat_requests; });
    record_headers(q);
    auto busy = std::make_shared<in_flight_scope>(*this);
    json body = json::parse(q.body, nullptr, false);
    if (body.is_discarded() || !body.is_object()) return bad_request(r, "The body is not a JSON object.", "");
    auto a = std::make_shared<answer>();
    if (absl::Status s = plan(body, *a); !s.ok()) {
      const std::string m(s.message());
      return bad_request(r, m, m.substr(0, m.find(' ')));
    }
    const draw d = take_fault();
    if (answer_error_fault(d, r)) return;
    if (d.affected && d.f.kind == fault_kind::hang) return hold(q, r);
    const bool stream = body.value("stream", false);
    count([&](mock_upstream::figures& g) {
      ++g.chat_started;
      if (stream) ++g.streams_started;
    });
    if (!stream) return chat_whole(q, r, *a, d);

    millis first = scaled(options_.first_token, d);
    if (d.affected && d.f.kind == fault_kind::slow_first_token) first = millis(d.f.first_token_ms);
    const millis gap = scaled(options_.token_gap, d);
    auto conn = std::make_shared<detail::connection>(q, stopping_);
    r.set_header("Cache-Control", "no-cache");
    r.set_chunked_content_provider(
        "text/event-stream", [this, a, d, first, gap, conn, busy](std::size_t, httplib::DataSink& sink) {
          return play(*a, d, first, gap, *conn, sink);
        });
  }

  // Reads the request into an answer; InvalidArgument names the field.
  absl::Status plan(const json& body, answer& a) {
    if (!body.contains("model") || !body["model"].is_string())
      return absl::InvalidArgumentError("model must be a string: you must provide a model parameter");
    if (!body.contains("messages") || !body["messages"].is_array() || body["messages"].empty())
      return absl::InvalidArgumentError("messages must be a non-empty array");
    a.model = body["model"].get<std::string>();
    a.id = next_id("chatcmpl-");
    a.created = detail::unix_ms() / 1000;
    std::string prompt, all;
    for (const json& m : body["messages"]) {
      if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
        return absl::InvalidArgumentError("messages must be objects with a string role");
      const std::string text = m.contains("content") ? detail::content_text(m["content"]) : "";
      all += text;
      if (m["role"] == "user") prompt = text;
    }
    a.prompt_tokens = static_cast<std::int64_t>(all.size() / 4 + 1);
    int cap = 0;
    for (const char* field : {"max_tokens", "max_completion_tokens"}) {
      if (!body.contains(field) || body[field].is_null()) continue;
      if (!body[field].is_number_integer() || body[field].get<std::int64_t>() < 1)
        return absl::InvalidArgumentError(std::string(field) + " must be an integer >= 1");
      cap = static_cast<int>(std::min<std::int64_t>(body[field].get<std::int64_t>(), 1000000));
    }
    if (body.contains("stream_options") && body["stream_options"].is_object())
      a.include_usage = body["stream_options"].value("include_usage", false);
    const bool json_mode = body.contains("response_format") && body["response_format"].is_object() &&
                           body["response_format"].value("type", "") == "json_object";
    if (absl::Status s = plan_tools(body, prompt, a); !s.ok()) return s;
    if (a.what == answer::kind::tools) return absl::OkStatus();
    if (prompt.rfind("refuse:", 0) == 0) {
      a.what = answer::kind::refusal;
      a.pieces = detail::split_words("I'm sorry, but I can't help with that request.");
    } else if (json_mode) {
      // The gateway's feedback contract, scored as its simulated provider does.
      const int score = static_cast<int>(std::min<std::size_t>(10, 3 + prompt.size() / 40));
      const std::string content = json{{"score", score},
                                       {"feedback", std::string("Clear structure; give one concrete example") +
                                                        (score < 7 ? " and expand the trade-offs" : "") + "."}}
                                      .dump();
      a.pieces = detail::split(content, (content.size() + 5) / 6);
    } else {
      a.pieces = detail::text_tokens(prompt, options_.seed, options_.tokens);
    }
    if (cap > 0 && static_cast<std::size_t>(cap) < a.pieces.size()) {
      a.pieces.resize(static_cast<std::size_t>(cap));
      a.finish_reason = "length";
    }
    return absl::OkStatus();
  }

  absl::Status plan_tools(const json& body, const std::string& prompt, answer& a) {
    if (!body.contains("tools")) return absl::OkStatus();
    const json& tools = body["tools"];
    if (!tools.is_array()) return absl::InvalidArgumentError("tools must be an array");
    for (const json& t : tools) {
      if (!t.is_object() || t.value("type", "") != "function" || !t.contains("function") ||
          !t["function"].is_object() || !t["function"].contains("name") || !t["function"]["name"].is_string())
        return absl::InvalidArgumentError("tools must be {\"type\":\"function\",\"function\":{\"name\":...}} objects");
    }
    if (tools.empty()) return absl::OkStatus();
    std::vector<const json*> chosen;
    const json choice = body.contains("tool_choice") ? body["tool_choice"] : json("auto");
    if (choice.is_string()) {
      if (choice == "none") return absl::OkStatus();
      chosen.push_back(&tools[0]);
      if (tools.size() >= 2 && prompt.find("two tools") != std::string::npos) chosen.push_back(&tools[1]);
    } else if (choice.is_object() && choice.contains("function") && choice["function"].is_object()) {
      const std::string want = choice["function"].value("name", "");
      for (const json& t : tools) {
        if (t["function"]["name"] == want) chosen.push_back(&t);
      }
      if (chosen.empty()) return absl::InvalidArgumentError("tool_choice must name one of the tools");
    } else {
      return absl::InvalidArgumentError("tool_choice must be \"none\", \"auto\", \"required\" or a function");
    }
    a.what = answer::kind::tools;
    a.finish_reason = "tool_calls";
    for (std::size_t i = 0; i < chosen.size(); ++i) {
      const json& fn = (*chosen[i])["function"];
      answer::tool_call call;
      call.name = fn["name"].get<std::string>();
      call.id = next_id("call_");
      call.arguments = arguments_for(fn, prompt, i).dump();
      call.fragments = detail::split(call.arguments, std::max<std::size_t>(6, call.arguments.size() / 8));
      a.tools.push_back(std::move(call));
    }
    return absl::OkStatus();
  }

  // Deterministic arguments that fit the function's parameter schema.
  [[nodiscard]] json arguments_for(const json& fn, const std::string& prompt, std::size_t index) const {
    const std::uint64_t h = detail::fnv1a(prompt) ^ detail::mix(options_.seed + index);
    std::string phrase;
    for (const std::string& w : detail::text_tokens(prompt, options_.seed + index, 3)) phrase += w;
    phrase.pop_back();
    json args = json::object();
    const json* props = nullptr;
    if (fn.contains("parameters") && fn["parameters"].is_object() && fn["parameters"].contains("properties") &&
        fn["parameters"]["properties"].is_object())
      props = &fn["parameters"]["properties"];
    if (props == nullptr || props->empty()) return json{{"input", phrase}};
    for (const auto& [name, schema] : props->items()) {
      const std::string type = schema.is_object() ? schema.value("type", "string") : "string";
      if (schema.is_object() && schema.contains("enum") && schema["enum"].is_array() && !schema["enum"].empty())
        args[name] = schema["enum"][0];
      else if (type == "integer") args[name] = static_cast<int>(h % 100);
      else if (type == "number") args[name] = static_cast<double>(h % 1000) / 10.0;
      else if (type == "boolean") args[name] = true;
      else if (type == "array") args[name] = json::array({phrase});
      else if (type == "object") args[name] = json::object();
      else args[name] = phrase;
    }
    return args;
  }

  void chat_whole(const httplib::Request& q, httplib::Response& r, const answer& a, const draw& d) {
    if (d.affected && d.f.kind == fault_kind::stall) return hold(q, r);
    millis wait = scaled(options_.latency, d);
    if (d.affected && d.f.kind == fault_kind::slow_first_token) wait += millis(d.f.first_token_ms);
    detail::connection conn(q, stopping_);
    const auto w = conn.wait_until(steady::now() + wait);
    if (w != detail::connection::wait_result::reached) {
      if (w == detail::connection::wait_result::client_gone) client_left(conn, false);
      r.status = 503;
      return;
    }
    if (d.affected && d.f.kind == fault_kind::error_event) {
      count([](mock_upstream::figures& g) { ++g.faulted; });
      r.status = 500;
      if (!d.f.x_should_retry.empty()) r.set_header("x-should-retry", d.f.x_should_retry);
      r.set_content(error_body("The server had an error while processing your request (mock).", "server_error", "", ""),
                    "application/json");
      return;
    }
    json message = {{"role", "assistant"}, {"content", nullptr}, {"refusal", nullptr}};
    std::string text;
    for (const std::string& p : a.pieces) text += p;
    if (a.what == answer::kind::text) message["content"] = text;
    if (a.what == answer::kind::refusal) message["refusal"] = text;
    if (a.what == answer::kind::tools) {
      message["tool_calls"] = json::array();
      for (const answer::tool_call& t : a.tools)
        message["tool_calls"].push_back(
            {{"id", t.id}, {"type", "function"}, {"function", {{"name", t.name}, {"arguments", t.arguments}}}});
    }
    const std::int64_t completion = a.completion_tokens();
    const std::string out =
        json{{"id", a.id},
             {"object", "chat.completion"},
             {"created", a.created},
             {"model", a.model},
             {"system_fingerprint", "fp_mock"},
             {"choices", json::array({{{"index", 0}, {"message", message}, {"logprobs", nullptr},
                                       {"finish_reason", a.finish_reason}}})},
             {"usage", {{"prompt_tokens", a.prompt_tokens}, {"completion_tokens", completion},
                        {"total_tokens", a.prompt_tokens + completion}}}}
            .dump();
    if (d.affected && d.f.kind == fault_kind::cut) {
      // Headers and half the body, then the connection is closed.
      count([](mock_upstream::figures& g) { ++g.streams_cut; });
      auto body = std::make_shared<std::string>(out);
      r.set_content_provider(body->size(), "application/json",
                             [body](std::size_t offset, std::size_t, httplib::DataSink& sink) {
                               if (offset > 0) return false;
                               sink.write(body->data(), body->size() / 2);
                               return false;
                             });
      return;
    }
    count([](mock_upstream::figures& g) { ++g.chat_completed; });
    r.set_content(out, "application/json");
  }

  // One chat.completion.chunk event.
  [[nodiscard]] static std::string chunk(const answer& a, json delta, const json& finish, bool usage_null) {
    json c = {{"id", a.id},
              {"object", "chat.completion.chunk"},
              {"created", a.created},
              {"model", a.model},
              {"system_fingerprint", "fp_mock"},
              {"choices", json::array({{{"index", 0}, {"delta", std::move(delta)}, {"logprobs", nullptr},
                                        {"finish_reason", finish}}})}};
    if (usage_null) c["usage"] = nullptr;  // as OpenAI does when include_usage is set
    return "data: " + c.dump() + "\n\n";
  }

  // The stream's token events, in order.
  [[nodiscard]] static std::vector<std::string> token_events(const answer& a) {
    std::vector<std::string> out;
    const bool u = a.include_usage;
    if (a.what != answer::kind::tools) {
      const char* field = a.what == answer::kind::refusal ? "refusal" : "content";
      for (const std::string& p : a.pieces) out.push_back(chunk(a, {{field, p}}, nullptr, u));
      return out;
    }
    // Each call's header (index, id, type, name, empty arguments), then the
    // arguments' fragments, interleaved by index when there are two.
    for (std::size_t i = 0; i < a.tools.size(); ++i) {
      const answer::tool_call& t = a.tools[i];
      out.push_back(chunk(a,
                          {{"tool_calls", json::array({{{"index", i}, {"id", t.id}, {"type", "function"},
                                                        {"function", {{"name", t.name}, {"arguments", ""}}}}})}},
                          nullptr, u));
    }
    std::size_t longest = 0;
    for (const answer::tool_call& t : a.tools) longest = std::max(longest, t.fragments.size());
    for (std::size_t k = 0; k < longest; ++k) {
      for (std::size_t i = 0; i < a.tools.size(); ++i) {
        if (k >= a.tools[i].fragments.size()) continue;
        out.push_back(chunk(
            a, {{"tool_calls", json::array({{{"index", i}, {"function", {{"arguments", a.tools[i].fragments[k]}}}}})}},
            nullptr, u));
      }
    }
    return out;
  }

  // The stream, on the content provider's thread, start to end. False: the
  // connection is closed without the last chunk (a cut, or the client left).
  bool play(const answer& a, const draw& d, millis first, millis gap, detail::connection& conn,
            httplib::DataSink& sink) {
    using wr = detail::connection::wait_result;
    auto write = [&](const std::string& s) { return sink.write(s.data(), s.size()); };
    auto left = [&] {
      client_left(conn, true);
      return false;
    };
    const json role = a.what == answer::kind::text ? json{{"role", "assistant"}, {"content", ""}}
                                                    : json{{"role", "assistant"}, {"content", nullptr}};
    if (!write(chunk(a, role, nullptr, a.include_usage))) return left();
    // Text and refusals are rendered one event at a time, as they are sent:
    // a long stream's first token must not wait for its last to be built.
    // Tool calls (a few dozen fragments) are laid out ahead, interleaved.
    const bool tools = a.what == answer::kind::tools;
    const std::vector<std::string> tool_events = tools ? token_events(a) : std::vector<std::string>{};
    const std::size_t n = tools ? tool_events.size() : a.pieces.size();
    const char* field = a.what == answer::kind::refusal ? "refusal" : "content";
    auto event = [&](std::size_t i) {
      return tools ? tool_events[i] : chunk(a, {{field, a.pieces[i]}}, nullptr, a.include_usage);
    };
    const bool stream_fault = d.affected && (d.f.kind == fault_kind::stall || d.f.kind == fault_kind::cut ||
                                             d.f.kind == fault_kind::error_event);
    steady::time_point at = steady::now() + first;
    for (std::size_t i = 0; i <= n; ++i) {
      if (stream_fault && i == static_cast<std::size_t>(d.f.after_tokens)) {
        if (d.f.kind == fault_kind::cut) {
          count([](mock_upstream::figures& g) { ++g.streams_cut; });
          return false;
        }
        if (d.f.kind == fault_kind::error_event) {
          count([](mock_upstream::figures& g) { ++g.error_events; });
          const std::string e = "data: " +
                                error_body("The server had an error while processing your request (mock).",
                                           "server_error", "", "") +
                                "\n\n";
          if (!write(e)) return left();
          sink.done();
          return true;
        }
        count([](mock_upstream::figures& g) { ++g.stalled; });
        if (conn.hold() == wr::client_gone) return left();
        return false;
      }
      if (i == n) break;
      const wr w = conn.wait_until(at);
      if (w == wr::client_gone) return left();
      if (w == wr::stopping) return false;
      if (outage_now(d.u)) {
        count([](mock_upstream::figures& g) { ++g.streams_cut; });
        return false;
      }
      if (!write(event(i))) return left();
      at = steady::now() + gap;
    }
    if (!write(chunk(a, json::object(), a.finish_reason, a.include_usage))) return left();
    if (a.include_usage) {
      const std::int64_t c = a.completion_tokens();
      const json u = {{"id", a.id},          {"object", "chat.completion.chunk"},
                      {"created", a.created}, {"model", a.model},
                      {"system_fingerprint", "fp_mock"}, {"choices", json::array()},
                      {"usage", {{"prompt_tokens", a.prompt_tokens}, {"completion_tokens", c},
                                 {"total_tokens", a.prompt_tokens + c}}}};
      if (!write("data: " + u.dump() + "\n\n")) return left();
    }
    if (!write("data: [DONE]\n\n")) return left();
    count([](mock_upstream::figures& g) {
      ++g.chat_completed;
      ++g.streams_completed;
    });
    sink.done();
    return true;
  }

  // ---- embeddings, models, control ----

  void embeddings(const httplib::Request& q, httplib::Response& r) {
    count([](mock_upstream::figures& g) { ++g.embedding_requests; });
    record_headers(q);
    const in_flight_scope busy(*this);
    json body = json::parse(q.body, nullptr, false);
    if (body.is_discarded() || !body.is_object()) return bad_request(r, "The body is not a JSON object.", "");
    if (!body.contains("model") || !body["model"].is_string())
      return bad_request(r, "model must be a string: you must provide a model parameter", "model");
    std::vector<std::string> inputs;
    const json in = body.contains("input") ? body["input"] : json();
    if (in.is_string()) {
      inputs.push_back(in.get<std::string>());
    } else if (in.is_array() && !in.empty() && std::all_of(in.begin(), in.end(), [](const json& x) { return x.is_string(); })) {
      for (const json& x : in) inputs.push_back(x.get<std::string>());
    } else {
      return bad_request(r, "input must be a string or a non-empty array of strings", "input");
    }
    const std::string format = body.value("encoding_format", "float");
    if (format != "float" && format != "base64")
      return bad_request(r, "encoding_format must be \"float\" or \"base64\"", "encoding_format");
    int dims = 8;
    if (body.contains("dimensions")) {
      if (!body["dimensions"].is_number_integer() || body["dimensions"].get<std::int64_t>() < 1 ||
          body["dimensions"].get<std::int64_t>() > 4096)
        return bad_request(r, "dimensions must be an integer in [1, 4096]", "dimensions");
      dims = body["dimensions"].get<int>();
    }
    const draw d = take_fault();
    if (answer_error_fault(d, r)) return;
    if (d.affected && d.f.kind == fault_kind::hang) return hold(q, r);
    detail::connection conn(q, stopping_);
    const auto w = conn.wait_until(steady::now() + scaled(options_.latency, d));
    if (w != detail::connection::wait_result::reached) {
      if (w == detail::connection::wait_result::client_gone) client_left(conn, false);
      r.status = 503;
      return;
    }
    json data = json::array();
    std::int64_t tokens = 0;
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      const std::vector<float> v = vector_for(inputs[i], dims);
      tokens += static_cast<std::int64_t>(inputs[i].size() / 4 + 1);
      json e = {{"object", "embedding"}, {"index", i}};
      if (format == "base64") {
        // Little-endian float32 bytes, as OpenAI sends them (x86 and ARM Linux are little-endian).
        e["embedding"] = detail::base64(v.data(), v.size() * sizeof(float));
      } else {
        json arr = json::array();
        for (float x : v) arr.push_back(static_cast<double>(x));
        e["embedding"] = std::move(arr);
      }
      data.push_back(std::move(e));
    }
    r.set_content(json{{"object", "list"},
                       {"data", std::move(data)},
                       {"model", body["model"]},
                       {"usage", {{"prompt_tokens", tokens}, {"total_tokens", tokens}}}}
                      .dump(),
                  "application/json");
  }

  // A unit vector that depends only on the text, the seed and the size.
  [[nodiscard]] std::vector<float> vector_for(const std::string& text, int dims) const {
    std::vector<float> v(static_cast<std::size_t>(dims));
    const std::uint64_t h = detail::fnv1a(text) ^ detail::mix(options_.seed);
    double norm = 0;
    for (int j = 0; j < dims; ++j) {
      const std::uint64_t x = detail::mix(h + static_cast<std::uint64_t>(j));
      const double value = static_cast<double>(x % 2001) / 1000.0 - 1.0;
      v[static_cast<std::size_t>(j)] = static_cast<float>(value);
      norm += value * value;
    }
    if (norm > 0)
      for (float& x : v) x = static_cast<float>(x / std::sqrt(norm));
    return v;
  }

  void models(const httplib::Request& q, httplib::Response& r) {
    count([](mock_upstream::figures& g) { ++g.model_requests; });
    record_headers(q);
    json data = json::array();
    for (const std::string& m : options_.models)
      data.push_back({{"id", m}, {"object", "model"}, {"created", started_unix_}, {"owned_by", options_.name}});
    r.set_content(json{{"object", "list"}, {"data", std::move(data)}}.dump(), "application/json");
  }

  void control_fault(const httplib::Request& q, httplib::Response& r) {
    json body = json::parse(q.body, nullptr, false);
    if (body.is_discarded())
      return bad_request(r, "fault.body must be a JSON object (got text that is not JSON)", "body");
    absl::StatusOr<fault> f = fault::from_json(body);
    if (!f.ok()) {
      const std::string m(f.status().message());  // "fault.<field> must ..."
      const std::size_t dot = m.find('.'), space = m.find(' ');
      return bad_request(r, m, dot < space ? m.substr(dot + 1, space - dot - 1) : "");
    }
    (void)set_fault(*f);
    r.set_content(f->to_json().dump(), "application/json");
  }

  const mock_upstream::options options_;
  detail::http_server http_;
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  std::atomic<std::uint64_t> ids_{1};
  int port_ = 0;
  std::int64_t started_unix_ = 0;

  mutable std::mutex mu_;  // guards the fault, the figures, the headers and the draws
  fault fault_{};
  int burst_left_ = 0;
  mock_upstream::figures figures_{};
  seen_headers seen_{};
  std::mt19937_64 rng_;
};

}  // namespace mock_upstream
