// keel/provider/grpc.hpp: the status mapping row by row, then the adapter
// against a real gRPC server in this process (tests/support/grpc_player.hpp)
// through keel pipelines: every status code, the pushback trailer, the
// deadline, cancellation by the stop token, metadata, retry with a budget.
#include "keel/provider/grpc.hpp"

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "keel/core/timer.hpp"
#include "keel/compose/executor.hpp"
#include "keel/compose/hedge.hpp"
#include "keel/compose/pipeline.hpp"
#include "keel/core/call.hpp"
#include "keel/core/outcome.hpp"
#include "keel/policy/retry.hpp"
#include "keel/policy/retry_budget.hpp"
#include "keel/testing/manual_clock.hpp"
#include "support/catch.hpp"
#include "support/grpc_player.hpp"

using namespace std::chrono_literals;
using keel::outcome_kind;
using keel::testing::manual_clock;
using keel_test::PlayReply;
using keel_test::PlayRequest;

namespace {

constexpr keel::operation read_op{};
constexpr keel::operation write_op{.effect = keel::effect::write};

outcome_kind kind_of(const absl::Status& s, const keel::operation& op) { return keel::default_classifier{}(s, op); }

// One row of the table in docs/providers.md.
struct row {
  grpc::StatusCode code;
  outcome_kind read;
  outcome_kind write;
};

const std::vector<row>& table() {
  using enum outcome_kind;
  static const std::vector<row> rows = {
      {grpc::StatusCode::CANCELLED, transient, ambiguous},  // not by our stop token
      {grpc::StatusCode::UNKNOWN, transient, ambiguous},
      {grpc::StatusCode::INVALID_ARGUMENT, permanent, permanent},
      {grpc::StatusCode::DEADLINE_EXCEEDED, transient, ambiguous},
      {grpc::StatusCode::NOT_FOUND, permanent, permanent},
      {grpc::StatusCode::ALREADY_EXISTS, permanent, permanent},
      {grpc::StatusCode::PERMISSION_DENIED, permanent, permanent},
      {grpc::StatusCode::RESOURCE_EXHAUSTED, throttled, throttled},
      {grpc::StatusCode::FAILED_PRECONDITION, permanent, permanent},
      {grpc::StatusCode::ABORTED, transient, transient},
      {grpc::StatusCode::OUT_OF_RANGE, permanent, permanent},
      {grpc::StatusCode::UNIMPLEMENTED, permanent, permanent},
      {grpc::StatusCode::INTERNAL, transient, ambiguous},
      {grpc::StatusCode::UNAVAILABLE, transient, transient},
      {grpc::StatusCode::DATA_LOSS, permanent, permanent},
      {grpc::StatusCode::UNAUTHENTICATED, permanent, permanent},
  };
  return rows;
}

// Waits (bounded, real time) until `done` holds; false if it never did.
template <class F>
bool eventually(F done, std::chrono::milliseconds limit = 10s) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

PlayRequest play(int code, std::string pushback = {}) {
  PlayRequest r;
  r.set_code(code);
  r.set_pushback(std::move(pushback));
  return r;
}

}  // namespace

TEST_CASE("grpc: every status code maps to its outcome kind, for a read and a write", "[grpc][classify]") {
  for (const row& r : table()) {
    INFO("code " << static_cast<int>(r.code));
    const grpc::Status st(r.code, "from the server");
    const absl::Status read = keel::from_grpc_status(st, read_op);
    const absl::Status write = keel::from_grpc_status(st, write_op);
    CHECK(kind_of(read, read_op) == r.read);
    CHECK(kind_of(write, write_op) == r.write);
    CHECK(absl::StrContains(read.message(), "from the server"));
    if (r.code != grpc::StatusCode::CANCELLED) CHECK(static_cast<int>(read.code()) == static_cast<int>(r.code));
  }
  CHECK(keel::from_grpc_status(grpc::Status::OK, write_op).ok());
}

TEST_CASE("grpc: CANCELLED is the caller's cancellation only when our stop token did it", "[grpc][classify]") {
  const grpc::Status st(grpc::StatusCode::CANCELLED, "Cancelled");
  const absl::Status ours = keel::from_grpc_status(st, write_op, std::nullopt, /*stopped_by_caller=*/true);
  CHECK(ours.code() == absl::StatusCode::kCancelled);
  CHECK(kind_of(ours, write_op) == outcome_kind::cancelled);
  const absl::Status theirs = keel::from_grpc_status(st, write_op, std::nullopt, false);
  CHECK(theirs.code() == absl::StatusCode::kUnknown);
  CHECK(kind_of(theirs, write_op) == outcome_kind::ambiguous);
  // A stop that came while the server answered something else: that answer counts.
  const absl::Status other = keel::from_grpc_status(grpc::Status(grpc::StatusCode::UNAVAILABLE, "down"), read_op,
                                                    std::nullopt, true);
  CHECK(kind_of(other, read_op) == outcome_kind::transient);
}

TEST_CASE("grpc: the pushback trailer is a retry-after hint; negative or malformed means do not retry",
          "[grpc][classify]") {
  const grpc::Status busy(grpc::StatusCode::RESOURCE_EXHAUSTED, "busy");
  const absl::Status hinted = keel::from_grpc_status(busy, read_op, "250");
  CHECK(kind_of(hinted, read_op) == outcome_kind::throttled);
  REQUIRE(keel::retry_after(hinted).has_value());
  CHECK(*keel::retry_after(hinted) == 250ms);
  CHECK(keel::retry_after(keel::from_grpc_status(busy, read_op, "0")) == keel::duration::zero());

  for (const char* refuse : {"-1", "-9223372036854775808", "soon", "", "1.5"}) {
    INFO("pushback '" << refuse << "'");
    const absl::Status s =
        keel::from_grpc_status(grpc::Status(grpc::StatusCode::UNAVAILABLE, "down"), read_op, refuse);
    CHECK(kind_of(s, read_op) == outcome_kind::permanent);
    CHECK(!keel::retryable(s, kind_of(s, read_op), read_op));
    CHECK(absl::StrContains(s.message(), "asked not to retry"));
    CHECK(s.code() == absl::StatusCode::kUnavailable);
  }
  CHECK(keel::from_grpc_status(grpc::Status::OK, read_op, "-1").ok());
}

TEST_CASE("grpc: options are validated, naming the field and the rule", "[grpc][options]") {
  CHECK(keel::grpc_options{}.validate().ok());
  CHECK(keel::grpc_options{.idempotency_key = "k-1", .remaining_time_header = "keel-remaining-ms"}.validate().ok());
  const absl::Status upper = keel::grpc_options{.idempotency_key_header = "Idempotency-Key"}.validate();
  CHECK(upper.message() ==
        "grpc_options.idempotency_key_header must be lowercase letters, digits, -, _ or . (got \"Idempotency-Key\")");
  CHECK(keel::grpc_options{.remaining_time_header = "grpc-timeout"}.validate().message() ==
        "grpc_options.remaining_time_header must not start with grpc- (got \"grpc-timeout\")");
  CHECK(keel::grpc_options{.remaining_time_header = "left-bin"}.validate().message() ==
        "grpc_options.remaining_time_header must not end with -bin (got \"left-bin\")");
  CHECK(keel::grpc_options{.idempotency_key = "a\nb"}.validate().message() ==
        "grpc_options.idempotency_key must be printable ASCII (got \"a\nb\")");
  CHECK(keel::grpc_options{.idempotency_key = "k", .idempotency_key_header = ""}.validate().code() ==
        absl::StatusCode::kInvalidArgument);
  keel_test::player_server server;
  const PlayRequest request;
  CHECK_THROWS_AS(keel::grpc_provider(*server.stub, &keel_test::Player::Stub::Play, request,
                                      {.idempotency_key_header = "Bad Key"}),
                  keel::invalid_options);
}

TEST_CASE("grpc: a real server's status codes come back classified", "[grpc][server]") {
  keel_test::player_server server;
  REQUIRE(server.started());
  manual_clock clock;
  const auto pipe = keel::pipeline().in(keel::environment{clock});
  for (const row& r : table()) {
    for (const keel::operation op : {read_op, write_op}) {
      INFO("code " << static_cast<int>(r.code) << (op.effect == keel::effect::write ? ", write" : ", read"));
      keel::call call(clock.now(), {.timeout = 5s, .operation = op});
      const absl::StatusOr<PlayReply> reply =
          pipe.run(call, keel::grpc_provider(*server.stub, &keel_test::Player::Stub::Play,
                                             play(static_cast<int>(r.code))));
      REQUIRE(!reply.ok());
      CHECK(kind_of(reply.status(), op) == (op.effect == keel::effect::write ? r.write : r.read));
      CHECK(absl::StrContains(reply.status().message(), "played"));
    }
  }
  keel::call call(clock.now(), {.timeout = 5s});
  PlayRequest hello;
  hello.set_text("hello");
  const absl::StatusOr<PlayReply> ok =
      pipe.run(call, keel::grpc_provider(*server.stub, &keel_test::Player::Stub::Play, hello));
  REQUIRE(ok.ok());
  CHECK(ok->text() == "hello");
  CHECK(server.service.calls.load() == static_cast<int>(table().size()) * 2 + 1);
}

TEST_CASE("grpc: a real pushback trailer arrives as a hint, a negative one as do-not-retry", "[grpc][server]") {
  keel_test::player_server server;
  manual_clock clock;
  const auto pipe = keel::pipeline().in(keel::environment{clock});
  auto run = [&](PlayRequest request) {
    keel::call call(clock.now(), {.timeout = 5s});
    return pipe.run(call, keel::grpc_provider(*server.stub, &keel_test::Player::Stub::Play, std::move(request)))
        .status();
  };
  const absl::Status positive = run(play(8, "1500"));  // RESOURCE_EXHAUSTED
  CHECK(kind_of(positive, read_op) == outcome_kind::throttled);
  CHECK(keel::retry_after(positive) == std::optional<keel::duration>(1500ms));

  const absl::Status negative = run(play(14, "-1"));  // UNAVAILABLE
  CHECK(kind_of(negative, read_op) == outcome_kind::permanent);
  CHECK(!keel::retry_after(negative).has_value());

  // gRPC parses the trailer on the way in; what an unreadable one becomes
  // must still be "do not retry", never a hint.
  const absl::Status malformed = run(play(14, "soon"));
  CHECK(kind_of(malformed, read_op) == outcome_kind::permanent);
  CHECK(!keel::retry_after(malformed).has_value());

  const absl::Status none = run(play(14));
  CHECK(kind_of(none, read_op) == outcome_kind::transient);
  CHECK(!keel::retry_after(none).has_value());
}

TEST_CASE("grpc: the attempt's deadline is the gRPC deadline: a slow handler is cut there", "[grpc][server]") {
  keel_test::player_server server;
  manual_clock clock;  // keel's clock; gRPC's deadline runs on real time from the attempt's timeout
  const auto pipe = keel::pipeline().in(keel::environment{clock});
  for (const keel::operation op : {read_op, write_op}) {
    PlayRequest slow;
    slow.set_delay_ms(10'000);
    keel::call call(clock.now(), {.timeout = 300ms, .operation = op});
    const auto start = std::chrono::steady_clock::now();
    const absl::StatusOr<PlayReply> reply =
        pipe.run(call, keel::grpc_provider(*server.stub, &keel_test::Player::Stub::Play, slow));
    const auto took = std::chrono::steady_clock::now() - start;
    REQUIRE(!reply.ok());
    CHECK(reply.status().code() == absl::StatusCode::kDeadlineExceeded);
    CHECK(kind_of(reply.status(), op) ==
          (op.effect == keel::effect::write ? outcome_kind::ambiguous : outcome_kind::transient));
    CHECK(took >= 250ms);  // not before its deadline
    CHECK(took < 2s);      // generous: shared CI machines
  }
  // The server saw a deadline, within the attempt's 500 ms. gRPC rounds the
  // grpc-timeout header up and the server turns it into a wall-clock
  // deadline from its own clock, so the server may see up to 1 ms more.
  keel::call call(clock.now(), {.timeout = 500ms});
  const absl::StatusOr<PlayReply> reply =
      pipe.run(call, keel::grpc_provider(*server.stub, &keel_test::Player::Stub::Play, PlayRequest{}));
  REQUIRE(reply.ok());
  CHECK(reply->deadline_ms() > 300);
  CHECK(reply->deadline_ms() <= 501);
  // No deadline at all: none is sent.
  keel::call open(clock.now(), {});
  const absl::StatusOr<PlayReply> unbounded =
      pipe.run(open, keel::grpc_provider(*server.stub, &keel_test::Player::Stub::Play, PlayRequest{}));
  REQUIRE(unbounded.ok());
  CHECK(unbounded->deadline_ms() == -1);
}

TEST_CASE("grpc: the stop token cancels a call in flight at once, and the server sees it", "[grpc][server]") {
  keel_test::player_server server;
  manual_clock clock;
  const auto pipe = keel::pipeline().in(keel::environment{clock});
  std::stop_source stop;
  PlayRequest hang;
  hang.set_hang(true);
  absl::Status result;
  std::chrono::steady_clock::time_point returned_at;
  std::thread caller([&] {
    keel::call call(clock.now(), {.timeout = 30s, .stop = stop.get_token(), .operation = write_op});
    result = pipe.run(call, keel::grpc_provider(*server.stub, &keel_test::Player::Stub::Play, hang)).status();
    returned_at = std::chrono::steady_clock::now();
  });
  const bool parked = eventually([&] { return server.service.hanging.load(std::memory_order_acquire) == 1; });
  const auto stopped_at = std::chrono::steady_clock::now();
  stop.request_stop();
  caller.join();
  REQUIRE(parked);
  CHECK(kind_of(result, write_op) == outcome_kind::cancelled);
  CHECK(returned_at - stopped_at < 500ms);  // generous: measured 0.3-1.5 ms on a loaded 2-vCPU VM
  CHECK(eventually([&] { return server.service.saw_cancel.load() == 1; }));
}

TEST_CASE("grpc: a hedge's losing call is cancelled on the wire, and the hedge answers", "[grpc][server]") {
  keel_test::player_server server;
  manual_clock clock;
  keel::bounded_pool pool({.threads = 2, .queue_capacity = 8});
  keel::deadline_timer timer{clock};
  std::optional<keel::hedge<keel::bounded_pool>> hedger;
  hedger.emplace(keel::hedge_options{.delay = 50ms, .max_hedges = 1}, pool, timer);
  const auto pipe = keel::pipeline(*hedger).in(keel::environment{clock});
  PlayRequest hang;
  hang.set_hang(true);
  PlayRequest quick;
  quick.set_text("hedge");
  // Each attempt owns its request (rvalues): a loser may outlive run().
  const auto primary = keel::grpc_provider(*server.stub, &keel_test::Player::Stub::Play, std::move(hang));
  const auto backup = keel::grpc_provider(*server.stub, &keel_test::Player::Stub::Play, std::move(quick));
  absl::StatusOr<PlayReply> reply;
  std::thread caller([&] {
    keel::call call(clock.now(), {.timeout = 30s});
    reply = pipe.run(call, keel::alternates(primary, backup));
  });
  const bool parked = eventually([&] { return server.service.hanging.load(std::memory_order_acquire) == 1; });
  clock.advance(50ms);  // the hedge's delay: the backup starts and answers
  caller.join();
  REQUIRE(parked);
  REQUIRE(reply.ok());
  CHECK(reply->text() == "hedge");
  // The primary was told to stop: its call ends on the server too, at once.
  CHECK(eventually([&] { return server.service.saw_cancel.load() == 1; }, 2s));
  CHECK(eventually([&] { return hedger->figures().outstanding == 0; }, 2s));
  hedger.reset();  // waits for its attempts before the server goes
}

TEST_CASE("grpc: one provider serves many threads at once while others' calls are cancelled", "[grpc][server]") {
  keel_test::player_server server;
  manual_clock clock;
  const auto pipe = keel::pipeline().in(keel::environment{clock});
  PlayRequest quick;
  quick.set_text("ok");
  PlayRequest hang;
  hang.set_hang(true);
  // Shared by every thread: the provider is const to call.
  const auto answer = keel::grpc_provider(*server.stub, &keel_test::Player::Stub::Play, quick);
  const auto stuck = keel::grpc_provider(*server.stub, &keel_test::Player::Stub::Play, hang);
  constexpr int kThreads = 4;
  constexpr int kCalls = 25;
  std::vector<std::stop_source> stops(kThreads);
  std::vector<int> answered(kThreads, 0);
  std::vector<absl::Status> cancelled(kThreads);
  std::vector<std::thread> workers;
  for (int t = 0; t < kThreads; ++t) {
    workers.emplace_back([&, t] {
      for (int i = 0; i < kCalls; ++i) {
        keel::call call(clock.now(), {.timeout = 30s});
        if (const absl::StatusOr<PlayReply> r = pipe.run(call, answer); r.ok() && r->text() == "ok") ++answered[t];
      }
      keel::call call(clock.now(), {.timeout = 30s, .stop = stops[static_cast<std::size_t>(t)].get_token()});
      cancelled[static_cast<std::size_t>(t)] = pipe.run(call, stuck).status();
    });
  }
  // Stop each worker's hanging call as soon as all of them hang.
  const bool parked = eventually([&] { return server.service.hanging.load(std::memory_order_acquire) == kThreads; });
  for (std::stop_source& s : stops) s.request_stop();
  for (std::thread& w : workers) w.join();
  REQUIRE(parked);
  for (int t = 0; t < kThreads; ++t) {
    CHECK(answered[static_cast<std::size_t>(t)] == kCalls);
    CHECK(kind_of(cancelled[static_cast<std::size_t>(t)], read_op) == outcome_kind::cancelled);
  }
  CHECK(eventually([&] { return server.service.saw_cancel.load() == kThreads; }));
}

TEST_CASE("grpc: a stop requested before the attempt sends nothing", "[grpc][server]") {
  keel_test::player_server server;
  std::stop_source stop;
  stop.request_stop();
  keel::call call(keel::real_clock{}.now(), {.timeout = 5s, .stop = stop.get_token()});
  const keel::attempt a{.number = 1, .start = keel::real_clock{}.now(), .deadline = call.work_deadline(),
                        .timeout = 5s, .stop = stop.get_token(), .owner = &call};
  const auto provider = keel::grpc_provider(*server.stub, &keel_test::Player::Stub::Play, PlayRequest{});
  const absl::StatusOr<PlayReply> reply = provider(a);
  CHECK(reply.status().code() == absl::StatusCode::kCancelled);
  CHECK(keel::not_started(reply.status()));
  CHECK(server.service.calls.load() == 0);
}

TEST_CASE("grpc: the idempotency key and the call's remaining time travel as metadata", "[grpc][server]") {
  keel_test::player_server server;
  manual_clock clock;
  const auto pipe = keel::pipeline().in(keel::environment{clock});
  keel::call call(clock.now(), {.timeout = 4s, .response_reserve = 1s, .operation = {.effect = keel::effect::write,
                                                                                        .idempotent = true}});
  const absl::StatusOr<PlayReply> reply =
      pipe.run(call, keel::grpc_provider(*server.stub, &keel_test::Player::Stub::Play, PlayRequest{},
                                         {.idempotency_key = "order-42", .remaining_time_header = "keel-remaining-ms"}));
  REQUIRE(reply.ok());
  CHECK(reply->idempotency_key() == "order-42");
  CHECK(reply->remaining_ms() == "3000");  // the work time: 4 s less the 1 s reserve, on the manual clock
  // Neither is sent unless asked for.
  keel::call plain(clock.now(), {.timeout = 4s});
  const absl::StatusOr<PlayReply> bare =
      pipe.run(plain, keel::grpc_provider(*server.stub, &keel_test::Player::Stub::Play, PlayRequest{}));
  REQUIRE(bare.ok());
  CHECK(bare->idempotency_key().empty());
  CHECK(bare->remaining_ms().empty());
}

TEST_CASE("grpc: a full pipeline retries what the server says it may, within the budget", "[grpc][pipeline]") {
  keel_test::player_server server;
  manual_clock clock;
  clock.auto_advance(true);  // backoff and hints pass on keel's clock, at once
  keel::retry_budget budget;
  const auto pipe = keel::pipeline(keel::retry({.max_attempts = 3, .budget = &budget})).in(keel::environment{clock});

  SECTION("unavailable twice, then the answer") {
    PlayRequest r = play(14);
    r.set_script("twice");
    r.set_fail_first(2);
    keel::call call(clock.now(), {.timeout = 10s});
    const absl::StatusOr<PlayReply> reply =
        pipe.run(call, keel::grpc_provider(*server.stub, &keel_test::Player::Stub::Play, r));
    REQUIRE(reply.ok());
    CHECK(reply->call() == 3);
    CHECK(call.record().attempts == 3);
    CHECK(call.record().retries == 2);
    CHECK(budget.figures(clock.now()).retries == 2);
  }
  SECTION("throttled with a pushback: the wait is the server's") {
    PlayRequest r = play(8, "700");
    r.set_script("throttled");
    r.set_fail_first(1);
    keel::call call(clock.now(), {.timeout = 10s});
    const keel::time_point start = clock.now();
    const absl::StatusOr<PlayReply> reply =
        pipe.run(call, keel::grpc_provider(*server.stub, &keel_test::Player::Stub::Play, r));
    REQUIRE(reply.ok());
    CHECK(clock.now() - start == 700ms);
    CHECK(call.record().attempts == 2);
  }
  SECTION("a pushback longer than the time left: not retried, the caller hears when to come back") {
    keel::call call(clock.now(), {.timeout = 2s});
    const absl::StatusOr<PlayReply> reply =
        pipe.run(call, keel::grpc_provider(*server.stub, &keel_test::Player::Stub::Play, play(8, "5000")));
    CHECK(call.record().attempts == 1);
    CHECK(keel::retry_after(reply.status()) == std::optional<keel::duration>(5s));
  }
  SECTION("a negative pushback stops the retries") {
    keel::call call(clock.now(), {.timeout = 10s});
    const absl::StatusOr<PlayReply> reply =
        pipe.run(call, keel::grpc_provider(*server.stub, &keel_test::Player::Stub::Play, play(14, "-1")));
    CHECK(reply.status().code() == absl::StatusCode::kUnavailable);
    CHECK(call.record().attempts == 1);
    CHECK(server.service.calls.load() == 1);
  }
  SECTION("INTERNAL: a read is retried, a write is not") {
    keel::call read(clock.now(), {.timeout = 10s});
    (void)pipe.run(read, keel::grpc_provider(*server.stub, &keel_test::Player::Stub::Play, play(13)));
    CHECK(read.record().attempts == 3);
    keel::call write(clock.now(), {.timeout = 10s, .operation = write_op});
    (void)pipe.run(write, keel::grpc_provider(*server.stub, &keel_test::Player::Stub::Play, play(13)));
    CHECK(write.record().attempts == 1);
    keel::call keyed(clock.now(), {.timeout = 10s, .operation = {.effect = keel::effect::write, .idempotent = true}});
    (void)pipe.run(keyed, keel::grpc_provider(*server.stub, &keel_test::Player::Stub::Play, play(13),
                                              {.idempotency_key = "k-7"}));
    CHECK(keyed.record().attempts == 3);
  }
  SECTION("a permanent code is not retried") {
    keel::call call(clock.now(), {.timeout = 10s});
    (void)pipe.run(call, keel::grpc_provider(*server.stub, &keel_test::Player::Stub::Play, play(16)));
    CHECK(call.record().attempts == 1);
  }
}

TEST_CASE("grpc: a spent retry budget stops the retries of an unavailable server", "[grpc][pipeline]") {
  keel_test::player_server server;
  manual_clock clock;
  clock.auto_advance(true);
  keel::retry_budget budget({.ratio = 0.0, .min_per_second = 0.0});
  const auto pipe = keel::pipeline(keel::retry({.max_attempts = 3, .budget = &budget})).in(keel::environment{clock});
  keel::call call(clock.now(), {.timeout = 10s});
  const absl::StatusOr<PlayReply> reply =
      pipe.run(call, keel::grpc_provider(*server.stub, &keel_test::Player::Stub::Play, play(14)));
  CHECK(reply.status().code() == absl::StatusCode::kUnavailable);
  CHECK(keel::refused_by(reply.status()) == std::optional<std::string>("retry_budget"));
  CHECK(call.record().attempts == 1);
}

TEST_CASE("grpc: grpc_invoke runs any call shape, here the callback stub", "[grpc][server]") {
  keel_test::player_server server;
  keel::call call(keel::real_clock{}.now(), {.timeout = 5s});
  const keel::attempt a{.number = 1, .start = keel::real_clock{}.now(), .deadline = call.work_deadline(),
                        .timeout = 5s, .owner = &call};
  PlayRequest request = play(8, "40");
  PlayReply reply;
  const absl::Status s = keel::grpc_invoke(a, {}, [&](grpc::ClientContext& context) {
    std::mutex mu;
    std::condition_variable cv;
    std::optional<grpc::Status> done;
    server.stub->async()->Play(&context, &request, &reply, [&](grpc::Status st) {
      const std::lock_guard<std::mutex> lock(mu);
      done = std::move(st);
      cv.notify_one();
    });
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done.has_value(); });
    return *done;
  });
  CHECK(kind_of(s, read_op) == outcome_kind::throttled);
  CHECK(keel::retry_after(s) == std::optional<keel::duration>(40ms));

  // The generated interface (what a mock or a wrapper implements) fits as well.
  keel_test::Player::StubInterface& iface = *server.stub;
  PlayRequest hello;
  hello.set_text("through the interface");
  const absl::StatusOr<PlayReply> r =
      keel::grpc_provider(iface, &keel_test::Player::StubInterface::Play, std::move(hello))(a);
  REQUIRE(r.ok());
  CHECK(r->text() == "through the interface");
}

TEST_CASE("grpc: gRPC hands on the pushback trailer parsed: a malformed one arrives as the most negative",
          "[grpc][server]") {
  // gRPC 1.51 parses grpc-retry-pushback-ms into a duration as it arrives and
  // gives the application that number back; what it cannot read becomes
  // minus infinity. Either way the adapter then sees a negative: do not retry.
  keel_test::player_server server;
  keel::call call(keel::real_clock{}.now(), {.timeout = 5s});
  const keel::attempt a{.number = 1, .start = keel::real_clock{}.now(), .deadline = call.work_deadline(),
                        .timeout = 5s, .owner = &call};
  const std::pair<const char*, const char*> cases[] = {
      {"250", "250"}, {"0", "0"}, {"-1", "-1"}, {"soon", "-9223372036854775808"}, {"1.5", "-9223372036854775808"}};
  for (const auto& [sent, delivered] : cases) {
    std::optional<std::string> seen;
    const PlayRequest request = play(14, sent);
    PlayReply reply;
    const absl::Status s = keel::grpc_invoke(a, {}, [&](grpc::ClientContext& context) {
      grpc::Status st = server.stub->Play(&context, request, &reply);
      if (auto p = keel::grpc_pushback(context)) seen = std::string(*p);
      return st;
    });
    INFO("sent '" << sent << "'");
    CHECK(seen.value_or("<none>") == delivered);
    CHECK(kind_of(s, read_op) == (sent[0] == '2' || sent[0] == '0' ? outcome_kind::transient
                                                                     : outcome_kind::permanent));
  }
}
