// tests/support/async_provider.hpp — asynchronous providers for keel::asio's
// tests: a gate whose attempts answer when the test opens it, each
// honouring Asio's per-operation cancellation.
#pragma once

#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>

#include <asio/associated_cancellation_slot.hpp>
#include <asio/associated_executor.hpp>
#include <asio/async_result.hpp>
#include <asio/cancellation_type.hpp>
#include <asio/post.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "keel/core/call.hpp"

namespace keel_test {

// Attempts wait at the gate until the test answers them (in arrival order)
// or cancels them; a cancelled attempt completes with Cancelled at once.
class gate {
 public:
  using result_type = absl::StatusOr<int>;

  // How many attempts are waiting, started, cancelled.
  [[nodiscard]] std::size_t waiting() const {
    std::lock_guard l(mu_);
    return waiting_.size();
  }
  [[nodiscard]] int started() const {
    std::lock_guard l(mu_);
    return started_;
  }
  [[nodiscard]] int cancelled() const {
    std::lock_guard l(mu_);
    return cancelled_;
  }
  [[nodiscard]] int last_hedge() const {
    std::lock_guard l(mu_);
    return last_hedge_;
  }

  // Answers the oldest waiting attempt; false when none waits.
  bool answer(result_type r) {
    std::unique_ptr<entry> e;
    {
      std::lock_guard l(mu_);
      if (waiting_.empty()) return false;
      e = std::move(waiting_.front());
      waiting_.pop_front();
    }
    e->complete(std::move(r));
    return true;
  }

  // Answers the newest waiting attempt; false when none waits.
  bool answer_newest(result_type r) {
    std::unique_ptr<entry> e;
    {
      std::lock_guard l(mu_);
      if (waiting_.empty()) return false;
      e = std::move(waiting_.back());
      waiting_.pop_back();
    }
    e->complete(std::move(r));
    return true;
  }

  // The provider: copies share the gate.
  struct provider {
    using result_type = gate::result_type;
    gate* g;
    template <class Token>
    auto operator()(const keel::attempt& a, Token&& token) {
      return asio::async_initiate<Token, void(result_type)>(
          [g = g, hedge = a.hedge](auto handler) { g->enter(std::move(handler), hedge); }, token);
    }
  };
  [[nodiscard]] provider as_provider() { return provider{this}; }

 private:
  struct entry {
    std::function<void(result_type)> complete;
    bool done = false;
  };

  template <class Handler>
  void enter(Handler handler, int hedge) {
    auto slot = asio::get_associated_cancellation_slot(handler);
    auto ex = asio::get_associated_executor(handler);
    auto shared = std::make_shared<Handler>(std::move(handler));
    auto e = std::make_unique<entry>();
    entry* raw = e.get();
    // The slot is the executor's: cleared there, just before the handler runs.
    raw->complete = [shared, ex, slot](result_type r) mutable {
      asio::post(ex, [shared, slot, r = std::move(r)]() mutable {
        if (slot.is_connected()) slot.clear();
        std::move(*shared)(std::move(r));
      });
    };
    {
      std::lock_guard l(mu_);
      ++started_;
      last_hedge_ = hedge;
      waiting_.push_back(std::move(e));
    }
    if (slot.is_connected()) {
      // Runs on the handler's executor (asio's rule for emitting).
      slot.assign([this, raw](asio::cancellation_type) {
        std::unique_ptr<entry> mine;
        {
          std::lock_guard l(mu_);
          for (auto it = waiting_.begin(); it != waiting_.end(); ++it) {
            if (it->get() == raw) {
              mine = std::move(*it);
              waiting_.erase(it);
              ++cancelled_;
              break;
            }
          }
        }
        if (mine) mine->complete(absl::CancelledError("gate: the attempt was cancelled"));
      });
    }
  }

  mutable std::mutex mu_;
  std::deque<std::unique_ptr<entry>> waiting_;
  int started_ = 0;
  int cancelled_ = 0;
  int last_hedge_ = -1;
};

}  // namespace keel_test
