// gateway/http_server.hpp — the gateway's HTTP/1.1 front door, written for
// hostile clients: every request is framed, bounded and timed here, before a
// worker thread or the gateway's logic sees a byte of it.
//
// Built on Boost.Asio and Boost.Beast (Debian's Boost 1.74, header-only):
// Beast's request parser frames the requests (gateway/http_request.hpp says
// what is checked around it), and all socket I/O is asynchronous on a small
// io_context (`io_threads`, 2 by default), so thousands of idle, trickling
// or streaming connections cost a socket and a buffer each, not a thread.
// The handlers are synchronous and may block for seconds (model calls), so
// they run on worker threads, never on the I/O threads.
//
//   per request         the head must arrive within `header_timeout` of its
//                       first byte, the body within `body_timeout` of the
//                       head, however the bytes trickle in (408 otherwise); a
//                       connection may sit idle between requests for
//                       `idle_timeout` (closed silently); blank lines do not
//                       start a request nor extend the idle time
//   bodies              Content-Length above `max_body_bytes`: 413 before the
//                       body is read; a chunked body: 413 as soon as its chunk
//                       sizes add up past the limit; Content-Encoding (gzip...)
//                       or a Transfer-Encoding other than chunked: 415, unread.
//                       `Expect: 100-continue` is answered once the head passed
//   headers             kept as the bytes that were sent (no decoding); a NUL
//                       or another control byte, an obsolete line fold, a
//                       bare CR or LF: 400 at once; a head above
//                       `max_header_bytes` or with more than 100 fields: 431
//   workers             three lanes, each with its own threads and a bounded
//                       queue (`max_queue`, beyond that 503): `threads` for
//                       ordinary requests, `reserved_threads` and
//                       `admin_threads` for what the lane function puts there
//                       (the gateway: /healthz and /metrics reserved, /admin/*
//                       admin), so operators get through while the ordinary
//                       lane is full, and monitoring polled hard does not
//                       push an operator's action off; with `fibers` set,
//                       each lane's requests run on fibers of those
//                       threads instead, its thread count bounding how
//                       many run at once (gateway/fibers.hpp)
//   connections         at most `max_connections`; when the table is full a
//                       new connection evicts the one idle the longest (no
//                       request on it), so /healthz answers however many idle
//                       connections a client holds open; with none idle, new
//                       ones wait in the backlog (`listen_backlog`)
//   responses           in the order the requests came (pipelining); each
//                       within `write_timeout`, else the connection is closed;
//                       `Connection: close` (or HTTP/1.0) closes right after
//                       the response; HEAD gets the head only
//   streams             a response with a `stream` function is written as
//                       it is produced (chunked, each write one chunk, each
//                       within `write_timeout`; on fibers queued, at most
//                       `stream_buffer_bytes` unsent); the connection is read
//                       meanwhile, so a hang-up (FIN or RST) requests
//                       http_stream::client_gone at once
//
// The server's own refusals go through the `refusal_handler` the owner
// gives, so they are answered (and counted) like every other reply; a 408 or
// 503 without a Retry-After gets one (1 s). After a refusal the connection is
// closed; what the client still sends is read and discarded (at most 1 MiB,
// 2 s) so that it sees the answer, not a reset.
//
// Example:
//
//   gateway::http_server server({.threads = 16},
//       [](const gateway::http_request& r) { return gateway::http_response{.status = 200, .body = r.path}; },
//       [](const gateway::http_refusal& f) { return gateway::http_response{.status = f.status, .body = f.message}; },
//       [](const gateway::http_request& r) {
//         return r.path == "/healthz" ? gateway::http_lane::reserved : gateway::http_lane::ordinary;
//       });
//   absl::Status up = server.start("127.0.0.1", 0);
//   int port = server.port();
//   ...
//   server.stop();
//
// Thread-safety: start() and stop() from one controlling thread (the fiber
// pool, when given, must outlive the server); port() and
// figures() from any thread. The handlers run on the server's threads,
// concurrently: the request handler on the workers, the refusal handler and
// the lane function on the I/O threads. A connection's I/O runs on its own
// strand; a worker holding its request reaches it only by posting there.
// http_stream::write belongs to the worker serving the stream.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
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

#include <pthread.h>

#include <boost/asio/buffer.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/write.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "http_request.hpp"
#include "fibers.hpp"
#include "keel/core/status.hpp"
#include "text.hpp"

namespace gateway {

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

namespace detail {
// Where an http_stream's bytes go: its connection, written on the I/O threads.
class stream_sink {
 public:
  virtual ~stream_sink() = default;
  // Blocks until `bytes` are written (true) or the connection failed or
  // did not take them within the server's write_timeout (false).
  virtual bool write_blocking(std::string bytes) = 0;
  // On fibers: hands `bytes` to the connection without waiting (true), or
  // false when it failed or more than the server's stream_buffer_bytes
  // wait unsent already (a client too slow for the stream).
  virtual bool write_queued(std::string bytes) = 0;
};
}  // namespace detail

// A streamed response's writer: each write() is one chunk of a chunked
// body, sent at once (the head with the first). The connection is read
// meanwhile: a client that hangs up (FIN or RST) requests client_gone()
// between writes, so a stream stops without waiting for its next write to
// fail. A client that half-closes its side counts as gone.
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
  http_stream(std::shared_ptr<detail::stream_sink> out, bool keep_alive, bool head_only, const http_response& head,
              std::stop_source gone)
      : out_(std::move(out)), keep_alive_(keep_alive), head_only_(head_only), head_(&head), gone_(std::move(gone)) {}
  // The last chunk; false if the stream failed or could not end.
  bool finish();

  std::shared_ptr<detail::stream_sink> out_;
  bool keep_alive_;
  bool head_only_;  // a HEAD request: the head, no chunks
  bool queued_ = false;  // on a fiber: writes are queued, not waited for
  const http_response* head_;
  bool opened_ = false;
  bool failed_ = false;
  std::stop_source gone_;
};

// Which workers serve a request.
enum class http_lane : std::uint8_t { ordinary, reserved, admin };

struct http_server_options {
  int threads = 96;                        // workers for the ordinary lane
  int reserved_threads = 4;                // workers for the reserved lane (health, metrics)
  int admin_threads = 2;                   // workers for the admin lane (operators' actions)
  int io_threads = 2;                      // threads running the sockets' I/O, parsing and timers
  int max_queue = 96;                      // complete requests waiting per lane; beyond: 503
  int max_connections = 4096;              // open connections; beyond, the longest idle is closed
  int listen_backlog = 1024;               // the kernel's accept queue (capped by net.core.somaxconn)
  std::size_t max_body_bytes = 64 * 1024;  // per request, after chunked decoding
  std::size_t max_header_bytes = 16 * 1024;  // request line and header fields together
  std::chrono::milliseconds header_timeout{5000};  // first byte to the end of the head
  std::chrono::milliseconds body_timeout{10000};   // end of the head to the end of the body
  std::chrono::milliseconds idle_timeout{5000};    // a kept-alive connection waiting for a request
  std::chrono::milliseconds write_timeout{5000};   // writing one response, or one chunk of a stream
  int max_requests_per_connection = 1000;
  // Fibers instead of worker threads: with these set, every request runs on
  // a fiber of these threads (gateway/fibers.hpp), so a request
  // waiting on a model holds a fiber's stack, not a thread; `threads`,
  // `reserved_threads` and `admin_threads` then bound how many requests
  // each lane serves at once. The handler must not block its thread for
  // long (keel's waits park the fiber; a blocking HTTP client would not).
  // A stream's writes are queued without waiting: at most
  // `stream_buffer_bytes` unsent per connection, beyond which the client is
  // too slow and the stream stops. Null: worker threads, whose writes wait.
  fiber_pool* fibers = nullptr;
  std::size_t stream_buffer_bytes = 1024 * 1024;

  [[nodiscard]] absl::Status validate() const {
    constexpr std::string_view who = "http_server_options";
    const std::pair<std::string_view, int> counts[] = {{"threads", threads},
                                                       {"reserved_threads", reserved_threads},
                                                       {"admin_threads", admin_threads},
                                                       {"max_queue", max_queue},
                                                       {"max_connections", max_connections},
                                                       {"listen_backlog", listen_backlog},
                                                       {"max_requests_per_connection", max_requests_per_connection}};
    for (const auto& [field, n] : counts) {
      if (n < 1 || n > 1'000'000) return keel::invalid_option(who, field, "be in [1, 1000000]", n);
    }
    if (io_threads < 1 || io_threads > 64) return keel::invalid_option(who, "io_threads", "be in [1, 64]", io_threads);
    if (stream_buffer_bytes < 1024 || stream_buffer_bytes > (std::size_t{1} << 30))
      return keel::invalid_option(who, "stream_buffer_bytes", "be in [1 KiB, 1 GiB]", stream_buffer_bytes);
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
  int busy_admin = 0;       // admin-lane workers serving a request
  int queued = 0;           // complete requests waiting for an ordinary worker
  int queued_reserved = 0;  // ... for a reserved one
  int queued_admin = 0;     // ... for an admin one
  int io_threads = 0;       // threads doing the sockets' I/O (the workers come on top)
  std::int64_t evicted = 0;  // idle connections closed to make room for a new one
};

namespace detail {

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
    case 422: return "Unprocessable Content";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 503: return "Service Unavailable";
    case 504: return "Gateway Timeout";
    case 505: return "HTTP Version Not Supported";
    default: return "Status";
  }
}

// The response's bytes; for a HEAD request the head alone (with the
// Content-Length a GET would get).
[[nodiscard]] inline std::string serialize(const http_response& r, bool keep_alive, bool head_only = false) {
  std::string out = cat("HTTP/1.1 ", r.status, " ", reason_phrase(r.status), "\r\nContent-Type: ", r.content_type,
                        "\r\nContent-Length: ", r.body.size(), "\r\n");
  for (const auto& [n, v] : r.headers) absl::StrAppend(&out, n, ": ", v, "\r\n");
  absl::StrAppend(&out, keep_alive ? "Connection: keep-alive\r\n\r\n" : "Connection: close\r\n\r\n");
  if (!head_only) out += r.body;
  return out;
}

}  // namespace detail

inline bool http_stream::write(std::string_view bytes) {
  if (failed_ || gone_.stop_requested()) return false;
  if (bytes.empty()) return true;  // an empty chunk would end the body
  std::string buf;
  if (!opened_) {
    opened_ = true;
    const http_response& h = *head_;
    buf = cat("HTTP/1.1 ", h.status, " ", detail::reason_phrase(h.status), "\r\nContent-Type: ", h.content_type,
              "\r\nCache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n");
    for (const auto& [n, v] : h.headers) absl::StrAppend(&buf, n, ": ", v, "\r\n");
    buf += keep_alive_ ? "Connection: keep-alive\r\n\r\n" : "Connection: close\r\n\r\n";
  } else if (head_only_) {
    return true;
  }
  if (!head_only_) {
    absl::StrAppend(&buf, absl::Hex(bytes.size()), "\r\n");
    buf.append(bytes.data(), bytes.size());
    buf += "\r\n";
  }
  if (!(queued_ ? out_->write_queued(std::move(buf)) : out_->write_blocking(std::move(buf)))) {
    failed_ = true;
    gone_.request_stop();
    return false;
  }
  return true;
}

inline bool http_stream::finish() {
  if (failed_ || gone_.stop_requested()) return false;
  return head_only_ || out_->write_blocking("0\r\n\r\n");
}

class http_server {
 public:
  using handler = std::function<http_response(const http_request&)>;
  using refusal_handler = std::function<http_response(const http_refusal&)>;
  // True: the request goes to the reserved lane (the two-lane form).
  using lane_function = std::function<bool(const http_request&)>;
  // The lane for a request (runs on an I/O thread: keep it quick).
  using lane_picker = std::function<http_lane(const http_request&)>;

  http_server(http_server_options o, handler h, refusal_handler refuse, lane_function reserved = {})
      : http_server(std::move(o), std::move(h), std::move(refuse), to_picker(std::move(reserved))) {}

  http_server(http_server_options o, handler h, refusal_handler refuse, lane_picker pick)
      : options_(std::move(o)), handler_(std::move(h)), refuse_(std::move(refuse)), pick_(std::move(pick)) {}

  http_server(const http_server&) = delete;
  http_server& operator=(const http_server&) = delete;
  ~http_server() { stop(); }

  // Binds host:port (0: a free port), listens and starts the threads.
  absl::Status start(const std::string& host, int port) {
    if (ioc_) return absl::FailedPreconditionError("the HTTP server is already started");
    if (absl::Status s = options_.validate(); !s.ok()) return s;
    if (port < 0 || port > 65535) return absl::InvalidArgumentError(cat("port ", port, " is not in [0, 65535]"));
    auto ioc = std::make_unique<boost::asio::io_context>(options_.io_threads);
    boost::system::error_code ec;
    tcp::resolver resolver(*ioc);
    const auto found = resolver.resolve(host, std::to_string(port),
                                        tcp::resolver::passive | tcp::resolver::numeric_service, ec);
    if (ec) return absl::InvalidArgumentError(cat("cannot resolve '", host, "': ", ec.message()));
    auto acceptor = std::make_unique<tcp::acceptor>(boost::asio::make_strand(*ioc));
    std::string why = "no address";
    bool listening = false;
    for (const auto& entry : found) {
      boost::system::error_code e;
      acceptor->open(entry.endpoint().protocol(), e);
      if (!e) acceptor->set_option(tcp::acceptor::reuse_address(true), e);
      if (!e) acceptor->bind(entry.endpoint(), e);
      if (!e) acceptor->listen(options_.listen_backlog, e);
      if (!e) {
        listening = true;
        break;
      }
      why = e.message();
      boost::system::error_code ignored;
      acceptor->close(ignored);
    }
    if (!listening) return absl::UnavailableError(cat("cannot listen on ", host, ":", port, ": ", why));
    port_ = acceptor->local_endpoint(ec).port();
    ioc_ = std::move(ioc);
    acceptor_ = std::move(acceptor);
    accept_retry_.emplace(acceptor_->get_executor());
    stopping_.store(false);
    io_count_.store(options_.io_threads);
    lanes_[0].workers = options_.threads;
    lanes_[1].workers = options_.reserved_threads;
    lanes_[2].workers = options_.admin_threads;
    // Named for top -H and /proc/PID/task/*/comm.
    const char* names[] = {"http-work", "http-reserved", "http-admin"};
    for (int k = 0; k < 3 && options_.fibers == nullptr; ++k) {
      for (int i = 0; i < lanes_[k].workers; ++i) {
        workers_.emplace_back([this, &l = lanes_[k]] { work(l); });
        ::pthread_setname_np(workers_.back().native_handle(), names[k]);
      }
    }
    work_guard_.emplace(ioc_->get_executor());
    boost::asio::post(acceptor_->get_executor(), [this] { accept(); });
    for (int i = 0; i < options_.io_threads; ++i) {
      io_.emplace_back([this] { ioc_->run(); });
      ::pthread_setname_np(io_.back().native_handle(), "http-io");
    }
    return absl::OkStatus();
  }

  [[nodiscard]] int port() const noexcept { return port_; }

  [[nodiscard]] http_server_figures figures() const {
    http_server_figures f;
    f.connections = connections_.load(std::memory_order_relaxed);
    f.io_threads = io_count_.load(std::memory_order_relaxed);
    f.evicted = evicted_.load(std::memory_order_relaxed);
    std::lock_guard lock(mu_);
    f.busy = lanes_[0].busy;
    f.busy_reserved = lanes_[1].busy;
    f.busy_admin = lanes_[2].busy;
    f.queued = static_cast<int>(lanes_[0].jobs.size());
    f.queued_reserved = static_cast<int>(lanes_[1].jobs.size());
    f.queued_admin = static_cast<int>(lanes_[2].jobs.size());
    return f;
  }

  // Stops accepting, closes idle connections, tells streams their client is
  // gone, lets the workers finish the requests they serve (their responses
  // are written, briefly) and closes the rest. Idempotent.
  void stop() {
    if (!ioc_) return;
    {
      std::lock_guard lock(mu_);
      stopping_.store(true);
    }
    boost::asio::post(acceptor_->get_executor(), [this] {
      boost::system::error_code ignored;
      acceptor_->close(ignored);
      accept_retry_->cancel();
    });
    for (const std::shared_ptr<connection>& c : open_connections()) {
      boost::asio::post(c->ex, [c] { c->on_stop(); });
    }
    for (lane& l : lanes_) l.cv.notify_all();
    for (std::thread& t : workers_) t.join();
    workers_.clear();
    {
      // On fibers: the requests being served end (their clients are told
      // they are gone); what is queued is closed below. The fibers' threads
      // must outlive this server.
      std::unique_lock lock(mu_);
      fibers_idle_.wait(lock, [&] { return lanes_[0].busy + lanes_[1].busy + lanes_[2].busy == 0; });
    }
    std::vector<job> left;
    {
      std::lock_guard lock(mu_);
      for (lane& l : lanes_) {
        for (job& j : l.jobs) left.push_back(std::move(j));
        l.jobs.clear();
      }
    }
    for (job& j : left) boost::asio::post(j.conn->ex, [c = j.conn] { c->close(); });
    left.clear();
    {
      // What the workers answered last is still being written: a moment for it.
      std::unique_lock lock(table_mu_);
      table_cv_.wait_for(lock, std::chrono::seconds(2), [&] { return table_.empty(); });
    }
    work_guard_.reset();
    ioc_->stop();
    for (std::thread& t : io_) t.join();
    io_.clear();
    io_count_.store(0);
    accept_retry_.reset();
    acceptor_.reset();
    ioc_.reset();  // destroys what is left: the connections its handlers held
  }

 private:
  using tcp = boost::asio::ip::tcp;
  using steady = std::chrono::steady_clock;
  enum class phase : std::uint8_t { idle, head, body, serving, draining, closed };

  static constexpr std::size_t drain_limit = 1 << 20;
  static constexpr std::chrono::seconds drain_time{2};
  // Bytes read ahead while a request is served (the next pipelined ones);
  // past this the connection is not read until the response is written.
  static constexpr std::size_t read_ahead_limit = 64 * 1024;
  // A request's clock starts when an I/O thread reads its first byte, which
  // can be a scheduling slice before the client took its own time: the 408
  // comes this much after the limit, so it is never early from either side.
  static constexpr std::chrono::milliseconds clock_grace{50};

  static lane_picker to_picker(lane_function reserved) {
    if (!reserved) return {};
    return [reserved = std::move(reserved)](const http_request& r) {
      return reserved(r) ? http_lane::reserved : http_lane::ordinary;
    };
  }

  // One client connection. Everything but write_blocking() runs on `ex`,
  // the connection's strand.
  struct connection final : detail::stream_sink, std::enable_shared_from_this<connection> {
    connection(http_server& s, tcp::socket sock)
        : server(s),
          ex(sock.get_executor()),
          socket(std::move(sock)),
          timer(ex),
          write_timer(ex),
          parser(s.options_.max_body_bytes, s.options_.max_header_bytes) {}
    ~connection() override {
      if (at != phase::closed) server.closed_one(this);
    }

    http_server& server;
    boost::asio::any_io_executor ex;
    tcp::socket socket;
    boost::asio::steady_timer timer;        // the phase's deadline
    boost::asio::steady_timer write_timer;  // the write in flight's
    http_request_parser parser;
    std::string pending;  // read, not yet parsed (a pipelined request)
    std::array<char, 16 * 1024> buf{};
    phase at = phase::idle;
    steady::time_point deadline = steady::time_point::max();
    bool reading = false;
    bool peer_closed = false;  // the client's side ended (FIN or RST) while a request was served
    std::size_t drained = 0;
    int served = 0;
    std::stop_source gone;  // the request being served: its client hung up
    // When it became idle (steady nanoseconds), or -1: read by the acceptor.
    std::atomic<std::int64_t> idle_since{-1};

    struct outgoing {
      std::shared_ptr<const std::string> bytes;
      std::function<void(bool)> done;
    };
    std::deque<outgoing> outbox;  // written in order, one at a time
    std::atomic<std::size_t> unsent{0};  // bytes of queued stream writes not yet written
    bool writing = false;
    std::uint64_t write_seq = 0;

    void begin() {
      boost::system::error_code ignored;
      socket.set_option(tcp::no_delay(true), ignored);
      become_idle();
      read();
    }

    void become_idle() {
      at = phase::idle;
      parser.reset();
      const steady::time_point now = steady::now();
      idle_since.store(now.time_since_epoch().count(), std::memory_order_relaxed);
      arm(now + server.options_.idle_timeout);
    }

    void arm(steady::time_point until) {
      deadline = until;
      timer.expires_at(until);
      timer.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
        if (!ec) self->on_timer();
      });
    }

    void disarm() {
      deadline = steady::time_point::max();
      timer.cancel();
    }

    void read() {
      if (reading || at == phase::closed) return;
      if (at == phase::serving && pending.size() >= read_ahead_limit) return;
      reading = true;
      socket.async_read_some(boost::asio::buffer(buf),
                             [self = shared_from_this()](const boost::system::error_code& ec, std::size_t n) {
                               self->on_read(ec, n);
                             });
    }

    void on_read(const boost::system::error_code& ec, std::size_t n) {
      reading = false;
      if (at == phase::closed) return;
      if (ec) {
        if (at == phase::serving) {
          // The client hung up (or half-closed) while its request is served:
          // a stream stops now, not at its next write.
          peer_closed = true;
          gone.request_stop();
          return;
        }
        close();
        return;
      }
      const std::string_view data(buf.data(), n);
      switch (at) {
        case phase::draining:
          drained += n;
          if (drained > drain_limit) {
            close();
            return;
          }
          break;
        case phase::serving: pending.append(data.data(), data.size()); break;
        default: input(data); break;
      }
      read();
    }

    void input(std::string_view data) {
      const bool was_idle = at == phase::idle;
      const std::size_t used = parser.feed(data);
      if (was_idle) {
        // Blank lines before a request do not start it, nor do they extend
        // the idle time: "\r\n" every few seconds must not hold a connection.
        if (!parser.started() && parser.current() == http_request_parser::state::head) return;
        // The head's clock starts at the request's first byte.
        at = phase::head;
        idle_since.store(-1, std::memory_order_relaxed);
        arm(steady::now() + server.options_.header_timeout + clock_grace);
      }
      switch (parser.current()) {
        case http_request_parser::state::failed: refuse(parser.error()); return;
        case http_request_parser::state::done:
          pending.append(data.data() + used, data.size() - used);
          dispatch();
          return;
        case http_request_parser::state::body:
          if (at == phase::head) {
            at = phase::body;
            arm(steady::now() + server.options_.body_timeout + clock_grace);
            if (parser.request().expect_continue) {
              send(std::make_shared<const std::string>("HTTP/1.1 100 Continue\r\n\r\n"), nullptr);
            }
          }
          return;
        case http_request_parser::state::head: return;
      }
    }

    void on_timer() {
      if (at == phase::closed || steady::now() < deadline) return;  // moved since it was set
      const http_server_options& o = server.options_;
      switch (at) {
        case phase::head:
          refuse({.status = 408,
                  .reason = "header_timeout",
                  .message = cat("the request head did not arrive within ", o.header_timeout.count(),
                                 " ms of its first byte (header_timeout)"),
                  .path = parser.request().path});
          return;
        case phase::body:
          refuse({.status = 408,
                  .reason = "body_timeout",
                  .message = cat("the request body did not arrive within ", o.body_timeout.count(),
                                 " ms of its head (body_timeout); ", parser.body_bytes(), " bytes came"),
                  .path = parser.request().path});
          return;
        case phase::serving: return;
        default: close(); return;
      }
    }

    // Answers a refusal and closes the connection: its framing can no longer
    // be trusted. The rest of what the client sends is drained, so it reads
    // the answer rather than a reset.
    void refuse(const http_refusal& why) {
      http_response r;
      try {
        r = server.refuse_(why);
      } catch (const std::exception& e) {
        r = {.status = why.status, .content_type = "text/plain", .body = cat(why.message, " (", e.what(), ")")};
      }
      // One Retry-After: the refusal's own hint when it carries one, else 1 s.
      const bool hinted = std::any_of(r.headers.begin(), r.headers.end(),
                                      [](const auto& h) { return detail::iequals(h.first, "Retry-After"); });
      if ((r.status == 408 || r.status == 503) && !hinted) r.headers.emplace_back("Retry-After", "1");
      send(std::make_shared<const std::string>(detail::serialize(r, false)), [self = shared_from_this()](bool ok) {
        if (ok) self->shut_send();
      });
      drain();
    }

    void drain() {
      at = phase::draining;
      drained = 0;
      pending.clear();
      idle_since.store(-1, std::memory_order_relaxed);
      arm(steady::now() + drain_time);
    }

    void shut_send() {
      boost::system::error_code ignored;
      socket.shutdown(tcp::socket::shutdown_send, ignored);
    }

    void dispatch() {
      http_request request = parser.take();
      const http_lane which = server.pick_ ? server.pick_(request) : http_lane::ordinary;
      ++served;
      const bool keep = request.keep_alive && served < server.options_.max_requests_per_connection;
      const bool head_only = request.method == "HEAD";
      at = phase::serving;
      disarm();
      gone = std::stop_source();
      std::string path = request.path;
      if (server.enqueue(which, {.conn = shared_from_this(), .request = std::move(request), .keep = keep,
                                 .head_only = head_only, .gone = gone})) {
        return;
      }
      const std::string_view name = which == http_lane::ordinary ? "ordinary"
                                    : which == http_lane::reserved ? "reserved"
                                                                   : "admin";
      refuse({.status = 503,
              .reason = "busy",
              .message = cat("every HTTP worker of the ", name, " lane is busy and ", server.options_.max_queue,
                             " requests wait already (max_queue)"),
              .path = std::move(path)});
    }

    // A worker's answer, written here; the next request is read after it.
    void respond(std::shared_ptr<const std::string> bytes, bool keep) {
      send(std::move(bytes), [self = shared_from_this(), keep](bool ok) { self->served_one(keep, ok); });
    }

    void served_one(bool keep, bool ok) {
      if (at != phase::serving) return;
      if (!ok || peer_closed || server.stopping_.load()) {
        close();
        return;
      }
      if (!keep) {
        // Connection: close: the client sees the end right after the body.
        shut_send();
        drain();
        read();
        return;
      }
      become_idle();
      if (std::string next = std::exchange(pending, {}); !next.empty()) input(next);
      read();
    }

    void send(std::shared_ptr<const std::string> bytes, std::function<void(bool)> done) {
      if (at == phase::closed) {
        if (done) done(false);
        return;
      }
      outbox.push_back({std::move(bytes), std::move(done)});
      if (!writing) write_next();
    }

    void write_next() {
      if (outbox.empty() || at == phase::closed) {
        writing = false;
        return;
      }
      writing = true;
      const std::uint64_t seq = ++write_seq;
      write_timer.expires_after(server.options_.write_timeout);
      write_timer.async_wait([self = shared_from_this(), seq](const boost::system::error_code& ec) {
        // Too slow a reader: closing the socket ends the write with an error.
        if (!ec && self->writing && self->write_seq == seq) self->close();
      });
      // The handler holds the bytes: close() may drop the outbox while the
      // write is still in the reactor's hands.
      const std::shared_ptr<const std::string>& bytes = outbox.front().bytes;
      boost::asio::async_write(socket, boost::asio::buffer(*bytes),
                               [self = shared_from_this(), bytes](const boost::system::error_code& ec, std::size_t) {
                                 self->written(!ec);
                               });
    }

    void written(bool ok) {
      if (at == phase::closed) return;  // close() failed this write and the rest already
      write_timer.cancel();
      outgoing done = std::move(outbox.front());
      outbox.pop_front();
      if (!ok) {
        writing = false;
        close();  // fails what waits in the outbox too
        if (done.done) done.done(false);
        return;
      }
      if (done.done) done.done(true);
      write_next();
    }

    // On a worker thread: hands the bytes to the strand and waits for them.
    bool write_blocking(std::string bytes) override {
      struct waiter {
        std::mutex mu;
        std::condition_variable cv;
        bool done = false, ok = false;
      };
      auto w = std::make_shared<waiter>();
      auto b = std::make_shared<const std::string>(std::move(bytes));
      boost::asio::post(ex, [self = shared_from_this(), b, w] {
        self->send(b, [w](bool ok) {
          std::lock_guard lock(w->mu);
          w->ok = ok;
          w->done = true;
          w->cv.notify_all();
        });
      });
      std::unique_lock lock(w->mu);
      // The write timer ends every write; the margin only guards a stopped server.
      w->cv.wait_for(lock, server.options_.write_timeout + std::chrono::seconds(2), [&] { return w->done; });
      return w->done && w->ok;
    }

    // On a fiber (or the loop a fiber's model stream is read on): queued,
    // not waited for. A failed write closes the connection, which the
    // stream sees as its client gone.
    bool write_queued(std::string bytes) override {
      const std::size_t n = bytes.size();
      if (unsent.fetch_add(n, std::memory_order_relaxed) + n > server.options_.stream_buffer_bytes) {
        unsent.fetch_sub(n, std::memory_order_relaxed);
        return false;
      }
      boost::asio::post(ex, [self = shared_from_this(), b = std::make_shared<const std::string>(std::move(bytes)), n] {
        self->send(b, [self, n](bool) { self->unsent.fetch_sub(n, std::memory_order_relaxed); });
      });
      return true;
    }

    void on_stop() {
      if (at == phase::serving) {
        gone.request_stop();  // a stream ends; its response closes the connection
        return;
      }
      close();
    }

    void close() {
      if (at == phase::closed) return;
      at = phase::closed;
      idle_since.store(-1, std::memory_order_relaxed);
      gone.request_stop();
      boost::system::error_code ignored;
      socket.close(ignored);
      timer.cancel();
      write_timer.cancel();
      std::deque<outgoing> failed = std::move(outbox);
      outbox.clear();
      writing = false;
      for (outgoing& o : failed) {
        if (o.done) o.done(false);
      }
      server.closed_one(this);
    }
  };

  struct job {
    std::shared_ptr<connection> conn;
    http_request request;
    bool keep = true;
    bool head_only = false;
    std::stop_source gone;
  };

  struct lane {
    std::deque<job> jobs;  // guarded by mu_
    int busy = 0;          // guarded by mu_
    int workers = 0;       // set before the threads start
    std::condition_variable cv;
  };

  // ---- connections (the acceptor's strand) ------------------------------------

  void accept() {
    if (stopping_.load()) return;
    if (connections_.load() >= options_.max_connections && !evict_idle()) {
      // Full, none idle: new connections wait in the backlog until one closes.
      paused_.store(true);
      if (connections_.load() >= options_.max_connections || !paused_.exchange(false)) return;
    }
    acceptor_->async_accept(boost::asio::make_strand(*ioc_),
                            [this](const boost::system::error_code& ec, tcp::socket s) {
                              if (ec == boost::asio::error::operation_aborted || stopping_.load()) return;
                              if (ec) {
                                // Out of descriptors, say: try again shortly rather than spin.
                                accept_retry_->expires_after(std::chrono::milliseconds(50));
                                accept_retry_->async_wait([this](const boost::system::error_code& e) {
                                  if (!e) accept();
                                });
                                return;
                              }
                              admit(std::move(s));
                              accept();
                            });
  }

  void admit(tcp::socket s) {
    auto c = std::make_shared<connection>(*this, std::move(s));
    connections_.fetch_add(1);
    {
      std::lock_guard lock(table_mu_);
      table_.emplace(c.get(), c);
    }
    boost::asio::post(c->ex, [c] { c->begin(); });
  }

  // Closes the connection idle the longest; false when none is idle.
  bool evict_idle() {
    std::shared_ptr<connection> oldest;
    {
      std::lock_guard lock(table_mu_);
      const std::weak_ptr<connection>* pick = nullptr;
      std::int64_t since = 0;
      for (const auto& [raw, weak] : table_) {
        const std::int64_t t = raw->idle_since.load(std::memory_order_relaxed);
        if (t < 0 || (pick != nullptr && t >= since)) continue;
        pick = &weak;
        since = t;
      }
      // Locked once, kept past the lock: a last reference must not go
      // (and take table_mu_ in its destructor) while it is held.
      if (pick != nullptr) oldest = pick->lock();
    }
    if (!oldest) return false;
    oldest->idle_since.store(-1, std::memory_order_relaxed);  // chosen once
    evicted_.fetch_add(1, std::memory_order_relaxed);
    boost::asio::post(oldest->ex, [c = oldest] {
      if (c->at == phase::idle) c->close();  // unless a request began meanwhile
    });
    return true;
  }

  void closed_one(connection* c) {
    connections_.fetch_sub(1);
    {
      std::lock_guard lock(table_mu_);
      table_.erase(c);
      if (table_.empty()) table_cv_.notify_all();
    }
    if (paused_.exchange(false) && !stopping_.load()) {
      boost::asio::post(acceptor_->get_executor(), [this] { accept(); });
    }
  }

  std::vector<std::shared_ptr<connection>> open_connections() {
    std::vector<std::shared_ptr<connection>> out;
    std::lock_guard lock(table_mu_);
    for (const auto& [raw, weak] : table_) {
      if (std::shared_ptr<connection> c = weak.lock()) out.push_back(std::move(c));
    }
    return out;
  }

  // ---- the workers --------------------------------------------------------------

  bool enqueue(http_lane which, job j) {
    lane& l = lanes_[static_cast<int>(which)];
    {
      std::lock_guard lock(mu_);
      // Room: a worker free, or a place in the queue behind the busy ones.
      if (stopping_.load() || l.busy + static_cast<int>(l.jobs.size()) >= l.workers + options_.max_queue)
        return false;
      if (options_.fibers == nullptr || l.busy >= l.workers) {
        l.jobs.push_back(std::move(j));
        l.cv.notify_one();
        return true;
      }
      ++l.busy;  // a fiber of its own, started below
    }
    if (options_.fibers->spawn([this, &l, j = std::move(j)]() mutable { fiber_work(l, std::move(j)); })) return true;
    // No stack could be mapped: refused like a full lane (the job went with the fiber).
    std::lock_guard lock(mu_);
    if (--l.busy == 0) fibers_idle_.notify_all();
    return false;
  }

  // A lane's fiber: serves its request, then what queued behind the busy ones.
  void fiber_work(lane& l, job j) {
    for (;;) {
      serve(j);
      j = {};  // the connection is the strand's again
      std::lock_guard lock(mu_);
      if (stopping_.load() || l.jobs.empty()) {
        if (--l.busy == 0) fibers_idle_.notify_all();
        return;
      }
      j = std::move(l.jobs.front());
      l.jobs.pop_front();
    }
  }

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
      j = {};  // the connection is the strand's again
      std::lock_guard lock(mu_);
      --l.busy;
    }
  }

  void serve(job& j) {
    const std::shared_ptr<connection>& c = j.conn;
    http_response r;
    try {
      r = handler_(j.request);
    } catch (const std::exception& e) {
      r = refused_by_handler(j.request, e);
    }
    const bool keep = j.keep && !stopping_.load();
    if (!r.stream) {
      auto bytes = std::make_shared<const std::string>(detail::serialize(r, keep, j.head_only));
      boost::asio::post(c->ex, [c, bytes = std::move(bytes), keep]() mutable { c->respond(std::move(bytes), keep); });
      return;
    }
    http_stream out(c, keep, j.head_only, r, j.gone);
    out.queued_ = options_.fibers != nullptr;
    http_response instead;
    try {
      instead = r.stream(out);
    } catch (const std::exception& e) {
      instead = refused_by_handler(j.request, e);
      out.failed_ = out.opened_;  // a body cut short: the connection cannot carry another response
    }
    if (!out.opened()) {
      // Answered whole (a non-streamed chat completion, a refusal): handed
      // to the strand like any whole response, without waiting for it;
      // only a stream's chunks wait, for back-pressure.
      auto bytes = std::make_shared<const std::string>(detail::serialize(instead, keep, j.head_only));
      boost::asio::post(c->ex, [c, bytes = std::move(bytes), keep]() mutable { c->respond(std::move(bytes), keep); });
      return;
    }
    if (out.queued_) {
      // The last chunk goes behind the queued ones; the next request is read once it is written.
      if (out.failed_ || out.gone_.stop_requested()) {
        boost::asio::post(c->ex, [c, keep] { c->served_one(keep, false); });
      } else {
        auto last = std::make_shared<const std::string>(j.head_only ? "" : "0\r\n\r\n");
        boost::asio::post(c->ex, [c, keep, last = std::move(last)]() mutable { c->respond(std::move(last), keep); });
      }
      return;
    }
    const bool written = out.finish();
    boost::asio::post(c->ex, [c, keep, written] { c->served_one(keep, written); });
  }

  http_response refused_by_handler(const http_request& req, const std::exception& e) {
    return refuse_({.status = 500, .reason = "handler", .message = cat("the gateway failed: ", e.what()),
                    .path = req.path});
  }

  http_server_options options_;
  handler handler_;
  refusal_handler refuse_;
  lane_picker pick_;
  int port_ = -1;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> paused_{false};  // accepting waits for a connection to close
  std::atomic<int> connections_{0};
  std::atomic<std::int64_t> evicted_{0};
  std::atomic<int> io_count_{0};  // figures() reads it while start() may still be spawning
  mutable std::mutex mu_;
  std::condition_variable fibers_idle_;  // on fibers: every lane's busy count reached 0
  lane lanes_[3];  // ordinary, reserved, admin
  std::mutex table_mu_;
  std::condition_variable table_cv_;
  std::unordered_map<connection*, std::weak_ptr<connection>> table_;  // open connections; guarded by table_mu_
  std::unique_ptr<boost::asio::io_context> ioc_;
  std::unique_ptr<tcp::acceptor> acceptor_;
  std::optional<boost::asio::steady_timer> accept_retry_;
  std::optional<boost::asio::executor_work_guard<boost::asio::io_context::executor_type>> work_guard_;
  std::vector<std::thread> workers_;
  std::vector<std::thread> io_;
};

}  // namespace gateway
