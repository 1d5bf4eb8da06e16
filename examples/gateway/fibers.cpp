// gateway/fibers.cpp — the Asio side of gateway/fibers.hpp: keel::asio's
// fiber threads and event-loop HTTP clients, compiled apart from the front
// door's Boost.Asio (fibers.hpp says why).
#include "fibers.hpp"

#include <array>
#include <atomic>
#include <cstddef>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "keel/asio/fiber_threads.hpp"
#include "keel/asio/http.hpp"
#include "keel/asio/run.hpp"
#include "keel/compose/stream.hpp"

namespace gateway {

struct fiber_pool::impl {
  keel::asio::fiber_threads threads;
};

fiber_pool::fiber_pool(int threads)
    : impl_(new impl{keel::asio::fiber_threads({.threads = threads})}) {}
fiber_pool::~fiber_pool() = default;

int fiber_pool::threads() const noexcept { return impl_->threads.size(); }

bool fiber_pool::spawn(absl::AnyInvocable<void() &&> fn) {
  return impl_->threads.spawn([f = std::move(fn)]() mutable { std::move(f)(); });
}

void fiber_pool::stop() { impl_->threads.stop(); }

namespace {

// The parse function as a copyable value for the exchange's provider: it
// is called only while the fiber that owns the referent waits.
struct parse_ref {
  fiber_http::parse_fn* fn;
  absl::StatusOr<std::string> operator()(const keel::http::response& r) const { return (*fn)(r); }
};

}  // namespace

struct fiber_http::impl {
  static constexpr int max_loops = 256;

  keel::http::client_options options;
  std::array<std::atomic<keel::asio::http_client*>, max_loops> loops{};
  std::mutex mu;
  // Each cancels what it has in flight on its loop when destroyed.
  std::vector<std::unique_ptr<keel::asio::http_client>> owned;

  // This fiber's thread's client, made on its first call there.
  keel::asio::http_client& here() {
    const int i = keel::asio::fiber_threads::index_here();
    std::atomic<keel::asio::http_client*>& slot = loops[static_cast<std::size_t>(i)];
    if (keel::asio::http_client* c = slot.load(std::memory_order_acquire)) return *c;
    const std::lock_guard lock(mu);
    if (keel::asio::http_client* c = slot.load(std::memory_order_relaxed)) return *c;
    owned.push_back(std::make_unique<keel::asio::http_client>(*keel::asio::current_executor(), options));
    slot.store(owned.back().get(), std::memory_order_release);
    return *owned.back();
  }
};

fiber_http::fiber_http(keel::http::client_options o) : impl_(std::make_unique<impl>()) {
  keel::require_valid_options(o.validate());
  impl_->options = std::move(o);
}
fiber_http::~fiber_http() = default;

bool fiber_http::on_fiber() noexcept {
  const int i = keel::asio::fiber_threads::index_here();
  return i >= 0 && i < impl::max_loops && keel::asio::current_executor() != nullptr;
}

absl::StatusOr<std::string> fiber_http::exchange(const keel::attempt& a, const keel::http::request& r,
                                                 parse_fn parse) {
  keel::asio::http_client& c = impl_->here();
  return keel::asio::awaited(c.exchange(r, parse_ref{&parse}), c.get_executor())(a);
}

absl::Status fiber_http::stream(const keel::attempt& a, keel::stream_writer& w, const keel::http::request& r) {
  keel::asio::http_client& c = impl_->here();
  return keel::asio::awaited(c.stream(r), c.get_executor())(a, w);
}

}  // namespace gateway
