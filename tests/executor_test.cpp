// The executor concept and keel::bounded_pool.
#include "keel/compose/executor.hpp"

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "support/alloc_counter.hpp"
#include "support/catch.hpp"

namespace {

// Holds pool threads inside a task until the test opens it.
class gate {
 public:
  void wait() {
    std::unique_lock lock(mu_);
    ++waiting_;
    changed_.notify_all();
    changed_.wait(lock, [&] { return open_; });
  }
  void await_waiting(int n) {
    std::unique_lock lock(mu_);
    changed_.wait(lock, [&] { return waiting_ == n; });
  }
  void open() {
    std::lock_guard lock(mu_);
    open_ = true;
    changed_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable changed_;
  int waiting_ = 0;
  bool open_ = false;
};

// A user's own executor: one std::thread per task, joined on destruction.
class thread_per_task {
 public:
  absl::Status try_execute(absl::AnyInvocable<void() &&> task) {
    std::lock_guard lock(mu_);
    threads_.emplace_back([t = std::move(task)]() mutable { std::move(t)(); });
    return absl::OkStatus();
  }
  ~thread_per_task() {
    for (std::thread& t : threads_) t.join();
  }

 private:
  std::mutex mu_;
  std::vector<std::thread> threads_;
};

bool contains(absl::string_view haystack, absl::string_view needle) {
  return haystack.find(needle) != absl::string_view::npos;
}

}  // namespace

TEST_CASE("the executor concept accepts keel's pool and a user's own executor", "[executor]") {
  STATIC_REQUIRE(keel::executor<keel::bounded_pool>);
  STATIC_REQUIRE(keel::executor<thread_per_task>);
  STATIC_REQUIRE_FALSE(keel::executor<int>);
  std::atomic<int> ran{0};
  {
    thread_per_task mine;
    for (int i = 0; i < 4; ++i) REQUIRE(mine.try_execute([&ran] { ++ran; }).ok());
  }
  CHECK(ran == 4);
}

TEST_CASE("bounded_pool takes a two-pointer task without allocating, and destroys each task before counting it done",
          "[executor][alloc]") {
  keel::bounded_pool pool({.threads = 1, .queue_capacity = 4});
  std::atomic<int> hits{0};
  int step = 1;  // not const: a constant would not be captured
  keel_test::count_allocations allocations;
  // The shape of keel's own tasks (hedge, fan_out): an object and an index.
  REQUIRE(pool.try_execute([&hits, &step] { hits += step; }).ok());
  const std::int64_t submit_allocs = allocations.count();

  // A move-only callable too large to store inline, owning a resource.
  auto owned = std::make_shared<int>(2);
  std::weak_ptr<int> watch = owned;
  std::array<char, 64> big{};
  REQUIRE(pool.try_execute([&hits, p = std::move(owned), big] { hits += *p + big[0]; }).ok());
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (pool.completed() < 2 && std::chrono::steady_clock::now() < give_up) std::this_thread::yield();
  REQUIRE(pool.completed() == 2);
  CHECK(watch.expired());  // already destroyed when it was counted
  CHECK(hits == 3);
  if (keel_test::allocations_counted()) CHECK(submit_allocs == 0);
}

TEST_CASE("bounded_pool runs every accepted task exactly once, from many submitters", "[executor][pool]") {
  keel::bounded_pool pool({.threads = 3, .queue_capacity = 1024});
  CHECK(pool.threads() == 3);
  CHECK(pool.queue_capacity() == 1024);
  constexpr int submitters = 4;
  constexpr int per_submitter = 200;
  std::vector<std::atomic<int>> runs(submitters * per_submitter);
  std::atomic<int> refused{0};
  {
    std::vector<std::thread> threads;
    for (int t = 0; t < submitters; ++t) {
      threads.emplace_back([&, t] {
        for (int i = 0; i < per_submitter; ++i) {
          const int id = t * per_submitter + i;
          if (!pool.try_execute([&runs, id] { runs[static_cast<std::size_t>(id)].fetch_add(1); }).ok()) ++refused;
        }
      });
    }
    for (std::thread& t : threads) t.join();
  }
  pool.shutdown();  // runs what was accepted, then joins
  int ran_once = 0;
  for (const auto& r : runs) ran_once += r.load() == 1 ? 1 : 0;
  CHECK(refused == 0);
  CHECK(ran_once == submitters * per_submitter);
  CHECK(pool.completed() == submitters * per_submitter);
}

TEST_CASE("a full bounded_pool refuses at once with a clear status, and runs what it accepted", "[executor][pool]") {
  keel::bounded_pool pool({.threads = 1, .queue_capacity = 2});
  gate hold;
  std::atomic<int> ran{0};
  REQUIRE(pool.try_execute([&] { hold.wait(); ++ran; }).ok());
  hold.await_waiting(1);  // the only thread is busy
  REQUIRE(pool.try_execute([&] { ++ran; }).ok());
  REQUIRE(pool.try_execute([&] { ++ran; }).ok());
  CHECK(pool.queued() == 2);
  CHECK(pool.running() == 1);

  const absl::Status full = pool.try_execute([&] { ++ran; });
  CHECK(full.code() == absl::StatusCode::kResourceExhausted);
  CHECK(keel::not_started(full));
  CHECK(keel::refused_by(full) == "executor:queue");
  CHECK(contains(full.message(), "queue full"));
  CHECK(pool.refused() == 1);

  hold.open();
  pool.shutdown();
  CHECK(ran == 3);  // the refused task never ran; the accepted ones all did
  const absl::Status closed = pool.try_execute([&] { ++ran; });
  CHECK(closed.code() == absl::StatusCode::kUnavailable);
  CHECK(keel::not_started(closed));
  CHECK(ran == 3);
}

TEST_CASE("bounded_pool's destructor drains accepted tasks and joins its threads", "[executor][pool]") {
  std::atomic<int> ran{0};
  {
    keel::bounded_pool pool({.threads = 2, .queue_capacity = 64});
    for (int i = 0; i < 50; ++i) REQUIRE(pool.try_execute([&ran] { ++ran; }).ok());
  }
  CHECK(ran == 50);
}

TEST_CASE("a task that throws does not take its pool thread down", "[executor][pool]") {
  keel::bounded_pool pool({.threads = 1, .queue_capacity = 8});
  std::atomic<int> ran{0};
  REQUIRE(pool.try_execute([] { throw std::runtime_error("boom"); }).ok());
  REQUIRE(pool.try_execute([&ran] { ++ran; }).ok());
  pool.shutdown();
  CHECK(ran == 1);
  CHECK(pool.threw() == 1);
}

TEST_CASE("a task may submit another task to its own pool", "[executor][pool]") {
  keel::bounded_pool pool({.threads = 2, .queue_capacity = 4});
  std::atomic<int> ran{0};
  std::atomic<bool> inner_ok{false};
  REQUIRE(pool.try_execute([&] {
                inner_ok = pool.try_execute([&ran] { ++ran; }).ok();
                ++ran;
              }).ok());
  // Wait for both before shutting down (a task submitted after shutdown is refused).
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (ran.load() < 2 && std::chrono::steady_clock::now() < give_up) std::this_thread::yield();
  pool.shutdown();
  CHECK(inner_ok);
  CHECK(ran == 2);
}

TEST_CASE("invalid pool options are refused naming the field", "[executor][options]") {
  CHECK(keel::pool_options{.threads = 0}.validate().message() == "pool_options.threads must be in [1, 1024] (got 0)");
  CHECK(keel::pool_options{.queue_capacity = 0}.validate().message() ==
        "pool_options.queue_capacity must be in [1, 1048576] (got 0)");
  CHECK_THROWS_AS(keel::bounded_pool({.threads = -1}), keel::invalid_options);
}
