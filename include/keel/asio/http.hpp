// keel/asio/http.hpp — keel's HTTP provider on one event loop: every
// transfer of a client runs on one libcurl multi handle driven by
// curl_multi_socket_action, with Asio's descriptors and timer, so a service
// with thousands of calls in flight needs no thread for each.
//
// keel::asio::http_client is the asynchronous twin of keel::http::client
// (keel/provider/http.hpp): the same options, requests, responses, hints
// and classification, built by the same functions. What differs is who
// waits. The blocking client polls each transfer on its caller's thread;
// this one watches every socket libcurl opens (CURLOPT_OPENSOCKETFUNCTION,
// so the descriptors are Asio's from their first moment and closed through
// it) and one steady_timer for libcurl's timeouts, all on one strand of the
// executor it was given.
//
// client.exchange(request, parse) and client.stream(request) make
// *asynchronous providers*: copyable callables with
//
//   using result_type = R;  // absl::Status or absl::StatusOr<T>
//   template <class CompletionToken>
//   auto operator()(const keel::attempt& a, CompletionToken&& token);  // void(R)
//
// (a streamed one takes `(const keel::attempt&, keel::stream_writer&, token)`
// and completes with absl::Status). One invocation sends one HTTP request
// and:
//
//   - completes exactly once, through the handler's associated executor
//     (never inline from the initiating call), with what the blocking
//     client would return for the same answer: parse's result on a 2xx,
//     otherwise the classified status with its hints;
//   - gives the transfer the attempt's time left (CURLOPT_TIMEOUT_MS) and
//     tells the server (client_options::deadline_header);
//   - stops the transfer when the attempt's stop token `a.stop` is
//     requested or the handler's associated cancellation slot is emitted
//     (terminal or partial): the transfer is removed from the loop and the
//     operation completes with the status the blocking client gives a
//     stopped transfer (Cancelled when the call was cancelled, otherwise
//     DeadlineExceeded, marked not-started if nothing was sent);
//   - for a stream, feeds the 2xx event stream into the writer as bytes
//     arrive on the loop; the writer saying stop ends the transfer.
//
// `a` (and the writer) must stay valid until completion, the provider
// until the operation is initiated (with a deferred token, until then); the
// request's strings, as for the blocking client, must outlive the exchange.
//
// Example:
//
//   ::asio::io_context io;
//   keel::asio::http_client llm(io.get_executor(), {.base_url = "http://127.0.0.1:8000"});
//   auto chat = llm.exchange({.path = "/v1/chat/completions", .body = R"({"model":"m","messages":[]})"},
//                            [](const keel::http::response& r) -> absl::StatusOr<std::string> {
//                              return std::string(r.body);
//                            });
//   keel::call call(keel::real_clock{}.now(), {.timeout = std::chrono::seconds(10)});
//   keel::attempt a{.start = keel::real_clock{}.now(), .deadline = call.work_deadline(),
//                   .timeout = std::chrono::seconds(10), .stop = call.stop_token(), .owner = &call};
//   absl::StatusOr<std::string> answer;
//   chat(a, [&](absl::StatusOr<std::string> r) { answer = std::move(r); });  // on io's thread
//   io.run();  // returns once the exchange completed: nothing else is left on the loop
//
// Allocation: per transfer, nothing beyond what libcurl makes and what
// `parse` does once the pools (handles, buffers, sockets) have grown to the
// load, when the client is on an io_context's own executor and the
// initiating thread runs it (the operation's state comes from the
// handler's associated allocator, by default Asio's recycling allocator).
// On any other executor the strand goes through any_io_executor, whose
// property queries allocate in Asio 1.22: a few allocations per transfer.
// bench/provider_bench.cpp measures it (BM_AsyncHttp_*).
//
// Thread-safety: a client may be used from any thread; its curl handles are
// touched only on its strand. Providers are small values (copies share the
// idempotency key); any number of their operations may be in flight at
// once. parse and a stream's callbacks run on the loop, inside libcurl:
// they may start other operations but must not destroy the client. A
// client should outlive its providers' operations; destroying it cancels
// what is in flight (each completes with absl::CancelledError; a provider
// invoked afterwards completes the same way) and frees its handles once its
// executor has run that, so keep running the executor until then.
#pragma once

#include <curl/curl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <asio/any_io_executor.hpp>
#include <asio/associated_allocator.hpp>
#include <asio/associated_cancellation_slot.hpp>
#include <asio/associated_executor.hpp>
#include <asio/async_result.hpp>
#include <asio/cancellation_type.hpp>
#include <asio/io_context.hpp>
#include <asio/execution/outstanding_work.hpp>
#include <asio/posix/stream_descriptor.hpp>
#include <asio/post.hpp>
#include <asio/prefer.hpp>
#include <asio/recycling_allocator.hpp>
#include <asio/basic_waitable_timer.hpp>
#include <asio/wait_traits.hpp>
#include <asio/strand.hpp>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <stop_token>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "keel/compose/stream.hpp"
#include "keel/core/call.hpp"
#include "keel/core/status.hpp"
#include "keel/provider/http.hpp"

namespace keel::asio {

namespace detail {

class http_loop;

// One operation in flight: what the loop needs of it, type-erased.
struct http_op {
  http_loop* loop = nullptr;  // kept alive by the provider copy the operation holds
  const keel::attempt* attempt = nullptr;
  const http::request* request = nullptr;
  stream_writer* writer = nullptr;
  std::uint64_t id = 0;
  std::atomic<bool> cancel_requested{false};
  // On the loop, once: the transfer `t` ended (libcurl's `rc`; `stopped`:
  // aborted by a stop), or, `t` null, the attempt did not run (`early`).
  void (*complete)(http_op*, http::detail::transfer* t, CURLcode rc, bool stopped, const absl::Status& early) =
      nullptr;
  // Destroys the operation without completing it (its executor went away).
  void (*discard)(http_op*) = nullptr;
};

// A socket libcurl opened through the loop. Its descriptor's executor is
// the loop's strand as it is, not wrapped in an any_io_executor: Asio 1.22
// allocates for a property query through one, which a strand makes on
// every handler it runs.
template <class Strand>
struct http_socket {
  explicit http_socket(const Strand& ex) : descriptor(ex) {}
  ::asio::posix::basic_stream_descriptor<Strand> descriptor;
  curl_socket_t fd = CURL_SOCKET_BAD;
  int want = 0;           // CURL_POLL_IN / CURL_POLL_OUT bits
  bool reading = false;   // a wait_read is pending
  bool writing = false;   // a wait_write is pending
  bool foreign = false;   // not opened by the loop (libcurl's own): released, never closed
  std::uint64_t gen = 0;  // bumped when the socket closes: a stale wait's completion is ignored
};

// One pooled transfer of the loop.
struct http_transfer : http::detail::transfer {
  struct stopper {
    http_loop* loop;
    std::uint64_t id;
    void operator()() const noexcept;
  };
  http_op* op = nullptr;
  std::optional<std::stop_callback<stopper>> on_stop;
};

// The event loop of one client, as its operations and providers see it.
class http_loop : public std::enable_shared_from_this<http_loop> {
 public:
  virtual ~http_loop() = default;
  http_loop(const http_loop&) = delete;
  http_loop& operator=(const http_loop&) = delete;

  // The client's executor: a handler's, unless it has one of its own.
  [[nodiscard]] const ::asio::any_io_executor& executor() const noexcept { return executor_; }
  [[nodiscard]] const http::client_options& options() const noexcept { return options_; }
  [[nodiscard]] std::uint64_t next_id() noexcept { return ids_.fetch_add(1, std::memory_order_relaxed) + 1; }

  // From any thread: starts `op` on the loop (posted, even from the strand:
  // a provider invoked from parse or a stream callback runs inside libcurl,
  // which may not be re-entered).
  virtual void launch(http_op* op) = 0;
  // From any thread: stops operation `id`'s transfer, if it still runs.
  virtual void post_cancel(std::uint64_t id) = 0;
  // From any thread: the client went away (close(), on the strand).
  virtual void close_soon() = 0;

 protected:
  http_loop(::asio::any_io_executor ex, http::client_options o) : executor_(std::move(ex)), options_(std::move(o)) {}

  ::asio::any_io_executor executor_;
  http::client_options options_;

 private:
  std::atomic<std::uint64_t> ids_{0};
};

// Owns an operation until the loop takes it (or discards it, never run).
template <class Loop>
struct http_starter {
  Loop* loop;
  http_op* op;
  http_starter(Loop* l, http_op* o) noexcept : loop(l), op(o) {}
  http_starter(http_starter&& o) noexcept : loop(o.loop), op(std::exchange(o.op, nullptr)) {}
  http_starter& operator=(http_starter&&) = delete;
  ~http_starter() {
    if (op != nullptr) op->discard(op);
  }
  void operator()() { loop->start(std::exchange(op, nullptr)); }
};

// The loop on a strand of type Strand: a curl multi handle, its sockets and
// timer, pools of transfers and sockets. Touched only on its strand.
template <class Strand>
class http_loop_on final : public http_loop {
 public:
  using socket = http_socket<Strand>;

  http_loop_on(::asio::any_io_executor ex, Strand strand, http::client_options o)
      : http_loop(std::move(ex), std::move(o)), strand_(std::move(strand)), timer_(strand_) {
    http::detail::global_init();
    shared_headers_ = http::detail::shared_headers(options_);
    idle_.reserve(options_.max_idle_handles);
    multi_ = curl_multi_init();
    if (multi_ != nullptr) {
      curl_multi_setopt(multi_, CURLMOPT_SOCKETFUNCTION, &http_loop_on::on_socket);
      curl_multi_setopt(multi_, CURLMOPT_SOCKETDATA, this);
      curl_multi_setopt(multi_, CURLMOPT_TIMERFUNCTION, &http_loop_on::on_timer);
      curl_multi_setopt(multi_, CURLMOPT_TIMERDATA, this);
      // Idle connections kept alive: as many as the blocking client keeps
      // idle handles (each with its connection). libcurl's default, four
      // per transfer under way, closed most of them whenever the load
      // dipped, and the next burst paid for new connections.
      curl_multi_setopt(multi_, CURLMOPT_MAXCONNECTS, static_cast<long>(options_.max_idle_handles));
    }
  }
  ~http_loop_on() override {
    // Operations hold the loop: none is active here. close() ran, or the
    // executor was destroyed before it could run it.
    shut_multi();
    for (http_transfer* t : idle_) delete t;
    curl_slist_free_all(shared_headers_);
  }

  void launch(http_op* op) override { ::asio::post(strand_, http_starter<http_loop_on>(this, op)); }

  void post_cancel(std::uint64_t id) override {
    ::asio::post(strand_, [self = self_ptr(), id] { self->cancel(id); });
  }

  void close_soon() override {
    if (strand_.running_in_this_thread()) {
      close();
    } else {
      ::asio::post(strand_, [self = self_ptr()] { self->close(); });
    }
  }

  // Starts `op`'s transfer, or completes it at once when it may not run. On the strand.
  void start(http_op* op) {
    if (closed_ || multi_ == nullptr) {
      op->complete(op, nullptr, CURLE_OK, false,
                   absl::CancelledError("keel::asio::http: the client was destroyed"));
      return;
    }
    if (absl::Status refused = http::detail::refuse_start(*op->attempt); !refused.ok()) {
      op->complete(op, nullptr, CURLE_OK, false, refused);
      return;
    }
    http_transfer* t = acquire();
    if (t == nullptr) {
      op->complete(op, nullptr, CURLE_OK, false,
                   mark_not_started(absl::UnavailableError("keel::http: could not create a libcurl handle")));
      return;
    }
    http::detail::prepare(*t, *op->request, *op->attempt, options_, shared_headers_, op->writer);
    if (curl_multi_add_handle(multi_, t->easy) != CURLM_OK) {
      unhook(*t);
      release(t);
      op->complete(op, nullptr, CURLE_OK, false,
                   mark_not_started(absl::UnavailableError("keel::http: curl_multi_add_handle failed")));
      return;
    }
    t->op = op;
    active_[op->id] = t;
    // A stop already requested runs the stopper here: it posts, as later.
    t->on_stop.emplace(op->attempt->stop, http_transfer::stopper{this, op->id});
    // The handler's cancellation slot fired before the transfer started.
    if (op->cancel_requested.load(std::memory_order_acquire)) cancel(op->id);
  }

  // Stops operation `id`'s transfer if it is still running. On the strand.
  void cancel(std::uint64_t id) {
    auto it = active_.find(id);
    if (it == active_.end()) return;  // done already
    finish(it->second, CURLE_OK, true, absl::OkStatus());
  }

  // The client went away: every transfer completes Cancelled, every
  // connection is closed. On the strand.
  void close() {
    if (closed_) return;
    closed_ = true;
    while (!active_.empty())
      finish(active_.begin()->second, CURLE_OK, true,
             absl::CancelledError("keel::asio::http: the client was destroyed"));
    shut_multi();
    disarm();
  }

 private:
  [[nodiscard]] std::shared_ptr<http_loop_on> self_ptr() {
    return std::static_pointer_cast<http_loop_on>(shared_from_this());
  }

  enum : int { in = CURL_POLL_IN, out = CURL_POLL_OUT };

  http_transfer* acquire() {
    if (!idle_.empty()) {
      http_transfer* t = idle_.back();
      idle_.pop_back();
      return t;
    }
    auto* t = new http_transfer();
    if (t->easy == nullptr) {
      delete t;
      return nullptr;
    }
    http::detail::setup(*t, options_);
    CURL* e = t->easy;
    curl_easy_setopt(e, CURLOPT_PRIVATE, static_cast<void*>(t));
    curl_easy_setopt(e, CURLOPT_OPENSOCKETFUNCTION, &http_loop_on::on_open);
    curl_easy_setopt(e, CURLOPT_OPENSOCKETDATA, static_cast<void*>(this));
    curl_easy_setopt(e, CURLOPT_CLOSESOCKETFUNCTION, &http_loop_on::on_close);
    curl_easy_setopt(e, CURLOPT_CLOSESOCKETDATA, static_cast<void*>(this));
    return t;
  }

  void release(http_transfer* t) {
    if (idle_.size() < options_.max_idle_handles) {
      idle_.push_back(t);
    } else {
      delete t;
    }
  }

  static void unhook(http_transfer& t) {
    curl_easy_setopt(t.easy, CURLOPT_HTTPHEADER, nullptr);  // the nodes are the transfer's
    t.feed = nullptr;
  }

  // The transfer left the loop: its operation completes, the handle goes back to the pool.
  void finish(http_transfer* t, CURLcode rc, bool stopped, const absl::Status& forced) {
    http_op* op = std::exchange(t->op, nullptr);
    active_.erase(op->id);
    curl_multi_remove_handle(multi_, t->easy);
    t->on_stop.reset();  // waits for a stopper running on another thread
    if (forced.ok()) {
      op->complete(op, t, rc, stopped, forced);
    } else {
      unhook(*t);
      op->complete(op, nullptr, rc, stopped, forced);
    }
    release(t);
    if (active_.empty() && !curl_timeout_) disarm();  // libcurl said "no timeout" while it ran
  }

  // Every finished transfer libcurl reports.
  void drain() {
    int queued = 0;
    while (multi_ != nullptr) {
      CURLMsg* m = curl_multi_info_read(multi_, &queued);
      if (m == nullptr) return;
      if (m->msg != CURLMSG_DONE) continue;
      const CURLcode rc = m->data.result;
      void* p = nullptr;
      curl_easy_getinfo(m->easy_handle, CURLINFO_PRIVATE, &p);
      finish(static_cast<http_transfer*>(p), rc, false, absl::OkStatus());
    }
  }

  void act(curl_socket_t fd, int flags) {
    int running = 0;
    curl_multi_socket_action(multi_, fd, flags, &running);
    drain();
  }

  // Waits for what libcurl wants of `k`, unless a wait for it is pending.
  void arm(socket& k) {
    if ((k.want & in) != 0 && !k.reading) {
      k.reading = true;
      k.descriptor.async_wait(::asio::posix::descriptor_base::wait_read,
                              [self = self_ptr(), k = &k, gen = k.gen](const std::error_code& ec) {
                                self->on_ready(k, gen, in, ec);
                              });
    }
    if ((k.want & out) != 0 && !k.writing) {
      k.writing = true;
      k.descriptor.async_wait(::asio::posix::descriptor_base::wait_write,
                              [self = self_ptr(), k = &k, gen = k.gen](const std::error_code& ec) {
                                self->on_ready(k, gen, out, ec);
                              });
    }
  }

  void on_ready(socket* k, std::uint64_t gen, int dir, const std::error_code& ec) {
    if (k->gen != gen) return;  // closed (and perhaps reused) since
    (dir == in ? k->reading : k->writing) = false;
    if (ec == ::asio::error::operation_aborted || multi_ == nullptr) return;
    if ((k->want & dir) == 0) return;  // libcurl no longer asks
    act(k->fd, ec ? CURL_CSELECT_ERR : (dir == in ? CURL_CSELECT_IN : CURL_CSELECT_OUT));
    if (k->gen == gen && multi_ != nullptr) arm(*k);  // still wanted: wait again
  }

  void on_timeout() {
    if (multi_ != nullptr) act(CURL_SOCKET_TIMEOUT, 0);
  }

  [[nodiscard]] socket* socket_for(curl_socket_t fd) const noexcept {
    return fd >= 0 && static_cast<std::size_t>(fd) < by_fd_.size() ? by_fd_[static_cast<std::size_t>(fd)] : nullptr;
  }

  // A socket record for `fd`, from the pool.
  socket* take_socket(curl_socket_t fd) {
    if (static_cast<std::size_t>(fd) >= by_fd_.size()) by_fd_.resize(static_cast<std::size_t>(fd) + 1, nullptr);
    if (socket* stale = by_fd_[static_cast<std::size_t>(fd)]) drop(*stale);  // libcurl closed it unseen
    socket* k = nullptr;
    if (!free_sockets_.empty()) {
      k = free_sockets_.back();
      free_sockets_.pop_back();
    } else {
      sockets_.push_back(std::make_unique<socket>(strand_));
      k = sockets_.back().get();
    }
    k->fd = fd;
    k->want = 0;
    k->reading = k->writing = false;
    k->foreign = false;
    by_fd_[static_cast<std::size_t>(fd)] = k;
    return k;
  }

  // Forgets `k`: its pending waits complete aborted, its descriptor is
  // closed (ours) or handed back unclosed (libcurl's own).
  void drop(socket& k) {
    ++k.gen;
    std::error_code ec;
    if (k.foreign) {
      k.descriptor.cancel(ec);
      (void)k.descriptor.release();
    } else {
      k.descriptor.close(ec);
    }
    if (static_cast<std::size_t>(k.fd) < by_fd_.size() && by_fd_[static_cast<std::size_t>(k.fd)] == &k)
      by_fd_[static_cast<std::size_t>(k.fd)] = nullptr;
    k.fd = CURL_SOCKET_BAD;
    k.want = 0;
    free_sockets_.push_back(&k);
  }

  void shut_multi() {
    if (multi_ == nullptr) return;
    // Closing the cached connections calls on_close; nothing else may call back.
    curl_multi_setopt(multi_, CURLMOPT_SOCKETFUNCTION, nullptr);
    curl_multi_setopt(multi_, CURLMOPT_TIMERFUNCTION, nullptr);
    CURLM* m = std::exchange(multi_, nullptr);
    curl_multi_cleanup(m);
    for (socket* k : by_fd_)
      if (k != nullptr) drop(*k);
  }

  // libcurl's callbacks (CURLMOPT_SOCKETFUNCTION and so on).
  static int on_socket(CURL*, curl_socket_t fd, int what, void* data, void*) {
    auto* self = static_cast<http_loop_on*>(data);
    socket* k = self->socket_for(fd);
    if (what == CURL_POLL_REMOVE) {
      if (k != nullptr) {
        k->want = 0;
        if (k->foreign) self->drop(*k);
      }
      return 0;
    }
    if (k == nullptr) {  // a socket libcurl made itself (a resolver's): watched, never closed by us
      k = self->take_socket(fd);
      k->foreign = true;
      std::error_code ec;
      k->descriptor.assign(fd, ec);
      if (ec) {
        self->drop(*k);
        return -1;
      }
    }
    k->want = what & (in | out);
    self->arm(*k);
    return 0;
  }

  // libcurl's timeout, on the one timer. Arming it costs a
  // timerfd_settime (a fifth of the loop's time in BM_AsyncHttp_Exchange
  // when every change re-armed it), so it is armed only when libcurl's
  // timeout comes before the armed one: firing early is harmless (libcurl
  // acts on what expired and asks again). Without a timeout, it is
  // cancelled once no transfer runs, so an idle loop leaves the executor.
  static int on_timer(CURLM*, long ms, void* data) {
    auto* self = static_cast<http_loop_on*>(data);
    if (self->closed_) {
      self->disarm();
      return 0;
    }
    if (ms < 0) {
      self->curl_timeout_ = false;
      if (self->active_.empty()) self->disarm();
      return 0;
    }
    self->curl_timeout_ = true;
    if (ms == 0) {  // now (a transfer was added): a posted action, not a timer
      ::asio::post(self->strand_, [keep = self->self_ptr()] { keep->on_timeout(); });
      return 0;
    }
    const auto due = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    if (self->armed_ && self->armed_until_ <= due) return 0;
    self->timer_.expires_at(due);
    self->armed_ = true;
    self->armed_until_ = due;
    self->timer_.async_wait([keep = self->self_ptr(), gen = ++self->timer_gen_](const std::error_code& ec) {
      if (ec) return;  // re-armed or cancelled
      if (gen == keep->timer_gen_) keep->armed_ = false;
      keep->on_timeout();
    });
    return 0;
  }

  void disarm() {
    if (!armed_) return;
    armed_ = false;
    ++timer_gen_;
    timer_.cancel();
  }

  static curl_socket_t on_open(void* data, curlsocktype purpose, curl_sockaddr* address) {
    auto* self = static_cast<http_loop_on*>(data);
    if (purpose != CURLSOCKTYPE_IPCXN) return CURL_SOCKET_BAD;
    const int fd = ::socket(address->family, address->socktype | SOCK_CLOEXEC, address->protocol);
    if (fd < 0) return CURL_SOCKET_BAD;
    socket* k = self->take_socket(fd);
    std::error_code ec;
    k->descriptor.assign(fd, ec);
    if (ec) {
      k->foreign = true;  // not the descriptor's: closed below
      self->drop(*k);
      ::close(fd);
      return CURL_SOCKET_BAD;
    }
    return fd;
  }

  static int on_close(void* data, curl_socket_t fd) {
    auto* self = static_cast<http_loop_on*>(data);
    socket* k = self->socket_for(fd);
    if (k == nullptr || k->foreign) {
      if (k != nullptr) self->drop(*k);
      return ::close(fd);
    }
    self->drop(*k);  // closes the descriptor
    return 0;
  }

  Strand strand_;
  curl_slist* shared_headers_ = nullptr;
  CURLM* multi_ = nullptr;
  ::asio::basic_waitable_timer<std::chrono::steady_clock, ::asio::wait_traits<std::chrono::steady_clock>, Strand> timer_;
  std::vector<http_transfer*> idle_;
  absl::flat_hash_map<std::uint64_t, http_transfer*> active_;
  std::vector<socket*> by_fd_;
  std::vector<std::unique_ptr<socket>> sockets_;
  std::vector<socket*> free_sockets_;
  bool closed_ = false;
  bool curl_timeout_ = false;                          // libcurl has a timeout pending
  bool armed_ = false;                                 // a wait on timer_ is pending
  std::chrono::steady_clock::time_point armed_until_{};  // when it fires
  std::uint64_t timer_gen_ = 0;                        // bumped when armed or disarmed
};

inline void http_transfer::stopper::operator()() const noexcept { loop->post_cancel(id); }

// Installed in the handler's cancellation slot.
struct http_canceller {
  explicit http_canceller(http_op* o) noexcept : op(o) {}
  http_op* op;
  void operator()(::asio::cancellation_type_t type) const {
    if ((type & (::asio::cancellation_type::terminal | ::asio::cancellation_type::partial)) ==
        ::asio::cancellation_type::none)
      return;
    op->cancel_requested.store(true, std::memory_order_release);
    op->loop->post_cancel(op->id);
  }
};

// One operation: the provider's copy (`Body`: its loop, request, parse),
// the handler, the work it keeps on the handler's executor, the result.
template <class Body, class Handler>
class http_op_impl final : public http_op {
 public:
  using result_type = typename Body::result_type;
  using allocator_type = typename std::allocator_traits<
      ::asio::associated_allocator_t<Handler, ::asio::recycling_allocator<void>>>::template rebind_alloc<http_op_impl>;
  using work_type = std::decay_t<decltype(::asio::prefer(
      std::declval<::asio::associated_executor_t<Handler, ::asio::any_io_executor>>(),
      ::asio::execution::outstanding_work.tracked))>;

  http_op_impl(Handler&& h, const Body& body, const keel::attempt& a, stream_writer* w)
      : body_(body),
        handler_(std::move(h)),
        work_(::asio::prefer(::asio::get_associated_executor(handler_, body_.loop()->executor()),
                             ::asio::execution::outstanding_work.tracked)) {
    loop = body_.loop().get();
    attempt = &a;
    request = &body_.request();
    writer = w;
    id = loop->next_id();
    complete = &http_op_impl::do_complete;
    discard = &http_op_impl::do_discard;
  }

  // Allocates the operation with the handler's allocator and starts it on the loop.
  static void launch(Handler&& h, const Body& body, const keel::attempt& a, stream_writer* w) {
    allocator_type alloc(::asio::get_associated_allocator(h, ::asio::recycling_allocator<void>()));
    http_op_impl* op = std::allocator_traits<allocator_type>::allocate(alloc, 1);
    try {
      std::allocator_traits<allocator_type>::construct(alloc, op, std::move(h), body, a, w);
    } catch (...) {
      std::allocator_traits<allocator_type>::deallocate(alloc, op, 1);
      throw;
    }
    // Before the start is posted: an emission after this is seen by the
    // start (the flag) or by the cancel it posts behind it.
    auto slot = ::asio::get_associated_cancellation_slot(op->handler_);
    if (slot.is_connected()) slot.template emplace<http_canceller>(op);
    op->loop->launch(op);
  }

 private:
  // Owns the operation until the handler is called on its executor.
  struct deliverer {
    http_op_impl* op;
    explicit deliverer(http_op_impl* o) noexcept : op(o) {}
    deliverer(deliverer&& o) noexcept : op(std::exchange(o.op, nullptr)) {}
    deliverer& operator=(deliverer&&) = delete;
    ~deliverer() {
      if (op != nullptr) destroy(op);
    }
    void operator()() {
      http_op_impl* o = std::exchange(op, nullptr);
      // Emissions happen on this executor: none can race the clear.
      ::asio::get_associated_cancellation_slot(o->handler_).clear();
      Handler h(std::move(o->handler_));
      result_type r(std::move(*o->result_));
      destroy(o);  // its memory is free again before the handler runs
      std::move(h)(std::move(r));
    }
  };

  static void destroy(http_op_impl* op) {
    ::asio::get_associated_cancellation_slot(op->handler_).clear();  // the canceller points here
    allocator_type alloc(::asio::get_associated_allocator(op->handler_, ::asio::recycling_allocator<void>()));
    std::allocator_traits<allocator_type>::destroy(alloc, op);
    std::allocator_traits<allocator_type>::deallocate(alloc, op, 1);
  }

  static void do_complete(http_op* base, http::detail::transfer* t, CURLcode rc, bool stopped,
                          const absl::Status& early) {
    auto* self = static_cast<http_op_impl*>(base);
    if (t == nullptr) {
      self->result_.emplace(early);
    } else {
      self->result_.emplace(self->body_.conclude(*t, *self->attempt, rc, stopped, self->loop->options()));
    }
    work_type ex = self->work_;
    ::asio::post(ex, deliverer(self));
  }

  static void do_discard(http_op* base) { destroy(static_cast<http_op_impl*>(base)); }

  Body body_;
  Handler handler_;
  work_type work_;
  std::optional<result_type> result_;
};

}  // namespace detail

class http_client;

// An asynchronous provider for one call (http_client::exchange): each
// invocation sends the request; a 2xx is handed to parse on the loop.
// Copyable; copies share the idempotency key.
template <class Parse>
class http_exchange {
 public:
  using result_type = http::detail::parse_result_t<Parse>;
  static_assert(keel::result<result_type>, "keel::asio::http: parse must return absl::Status or absl::StatusOr<T>");

  http_exchange(std::shared_ptr<detail::http_loop> loop, const http::request& r, Parse parse)
      : loop_(std::move(loop)), request_(r), parse_(std::move(parse)) {
    if (request_.idempotency_key.empty()) {
      drawn_ = http::detail::key::draw();
      request_.idempotency_key = drawn_.view();
    }
  }
  http_exchange(const http_exchange& o) : loop_(o.loop_), request_(o.request_), parse_(o.parse_), drawn_(o.drawn_) {
    if (o.request_.idempotency_key.data() == o.drawn_.text.data()) request_.idempotency_key = drawn_.view();
  }
  http_exchange& operator=(const http_exchange&) = delete;

  // The key writes send (the request's, or the drawn one).
  [[nodiscard]] std::string_view idempotency_key() const noexcept { return request_.idempotency_key; }

  // Sends the request; completes with void(result_type) on the handler's executor.
  template <class CompletionToken>
  auto operator()(const keel::attempt& a, CompletionToken&& token) const {
    return ::asio::async_initiate<CompletionToken, void(result_type)>(initiation{}, token, this, &a);
  }

  // For the operation (detail::http_op_impl).
  [[nodiscard]] const std::shared_ptr<detail::http_loop>& loop() const noexcept { return loop_; }
  [[nodiscard]] const http::request& request() const noexcept { return request_; }
  result_type conclude(http::detail::transfer& t, const keel::attempt& a, CURLcode rc, bool stopped,
                       const http::client_options& o) const {
    return http::detail::parsed_result(
        parse_, [&](auto&& on_success) { return http::detail::conclude(t, a, rc, stopped, o, on_success); });
  }

 private:
  struct initiation {
    template <class Handler>
    void operator()(Handler&& h, const http_exchange* self, const keel::attempt* a) const {
      std::decay_t<Handler> handler(std::forward<Handler>(h));
      detail::http_op_impl<http_exchange, std::decay_t<Handler>>::launch(std::move(handler), *self, *a, nullptr);
    }
  };

  std::shared_ptr<detail::http_loop> loop_;
  http::request request_;
  Parse parse_;
  http::detail::key drawn_{};
};

// An asynchronous streaming provider (http_client::stream): each
// invocation sends the request and feeds the 2xx event stream into the
// writer on the loop. Copyable.
class http_stream_exchange {
 public:
  using result_type = absl::Status;

  http_stream_exchange(std::shared_ptr<detail::http_loop> loop, const http::request& r)
      : loop_(std::move(loop)), request_(r) {}

  // Streams into `w`; completes with void(absl::Status) on the handler's executor.
  template <class CompletionToken>
  auto operator()(const keel::attempt& a, stream_writer& w, CompletionToken&& token) const {
    return ::asio::async_initiate<CompletionToken, void(absl::Status)>(initiation{}, token, this, &a, &w);
  }

  [[nodiscard]] const std::shared_ptr<detail::http_loop>& loop() const noexcept { return loop_; }
  [[nodiscard]] const http::request& request() const noexcept { return request_; }
  absl::Status conclude(http::detail::transfer& t, const keel::attempt& a, CURLcode rc, bool stopped,
                        const http::client_options& o) const {
    return http::detail::conclude(t, a, rc, stopped, o, [](const http::response&) { return absl::OkStatus(); });
  }

 private:
  struct initiation {
    template <class Handler>
    void operator()(Handler&& h, const http_stream_exchange* self, const keel::attempt* a, stream_writer* w) const {
      std::decay_t<Handler> handler(std::forward<Handler>(h));
      detail::http_op_impl<http_stream_exchange, std::decay_t<Handler>>::launch(std::move(handler), *self, *a, w);
    }
  };

  std::shared_ptr<detail::http_loop> loop_;
  http::request request_;
};

// An HTTP client whose transfers all run on one event loop (a strand of `ex`).
class http_client {
 public:
  // Throws keel::invalid_options if `o` is invalid (client_options::validate).
  http_client(::asio::any_io_executor ex, http::client_options o)
      : loop_(make_loop(std::move(ex), std::move(o))) {}
  // Cancels what is in flight: each operation completes with absl::CancelledError.
  ~http_client() { loop_->close_soon(); }
  http_client(const http_client&) = delete;
  http_client& operator=(const http_client&) = delete;

  [[nodiscard]] const http::client_options& options() const noexcept { return loop_->options(); }
  [[nodiscard]] const ::asio::any_io_executor& get_executor() const noexcept { return loop_->executor(); }

  // An asynchronous provider for one call: each invocation sends `r`; a 2xx
  // response is handed to `parse` (on the loop), whose result it completes with.
  template <class Parse>
  [[nodiscard]] http_exchange<std::decay_t<Parse>> exchange(const http::request& r, Parse&& parse) {
    return http_exchange<std::decay_t<Parse>>(loop_, r, std::forward<Parse>(parse));
  }
  // One that completes with absl::Status and ignores the body.
  [[nodiscard]] http_exchange<http::detail::ignore_body> exchange(const http::request& r) {
    return http_exchange<http::detail::ignore_body>(loop_, r, http::detail::ignore_body{});
  }

  // An asynchronous streaming provider: as keel::http::client::stream, its
  // tokens handed to the writer on the loop as they arrive.
  [[nodiscard]] http_stream_exchange stream(const http::request& r) { return http_stream_exchange(loop_, r); }

 private:
  static std::shared_ptr<detail::http_loop> make_loop(::asio::any_io_executor ex, http::client_options o) {
    keel::detail::require_valid(o.validate());
    // An io_context's own executor gets a strand of that type (no
    // allocation per handler); any other, a strand of the polymorphic one.
    using io_executor = ::asio::io_context::executor_type;
    if (const io_executor* io = ex.target<io_executor>()) {
      using strand = ::asio::strand<io_executor>;
      strand s = ::asio::make_strand(*io);
      return std::make_shared<detail::http_loop_on<strand>>(std::move(ex), std::move(s), std::move(o));
    }
    using strand = ::asio::strand<::asio::any_io_executor>;
    strand s = ::asio::make_strand(ex);
    return std::make_shared<detail::http_loop_on<strand>>(std::move(ex), std::move(s), std::move(o));
  }

  std::shared_ptr<detail::http_loop> loop_;
};

}  // namespace keel::asio
