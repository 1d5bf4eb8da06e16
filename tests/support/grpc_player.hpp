// A real gRPC server in the test process, on a free loopback port, that
// plays what each request asks for (tests/proto/keel_grpc_test.proto): a
// status code, a grpc-retry-pushback-ms trailer, a delay, a hang until the
// client cancels, a script that fails its first n calls. It reports what it
// received (metadata, its deadline) in the reply and counts what it saw.
// Used by tests/grpc_test.cpp and bench/grpc_bench.cpp.
#pragma once

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "keel_grpc_test.grpc.pb.h"

namespace keel_test {

class player_service final : public Player::Service {
 public:
  ::grpc::Status Play(::grpc::ServerContext* context, const PlayRequest* request, PlayReply* reply) override {
    calls.fetch_add(1, std::memory_order_relaxed);
    const auto arrived = std::chrono::system_clock::now();
    int number = 0;
    if (!request->script().empty()) {
      const std::lock_guard<std::mutex> lock(mu_);
      number = ++scripts_[request->script()];
    }
    reply->set_call(number);
    reply->set_text(request->text());
    reply->set_idempotency_key(metadata(*context, "idempotency-key"));
    reply->set_remaining_ms(metadata(*context, "keel-remaining-ms"));
    const auto deadline = context->deadline();
    reply->set_deadline_ms(deadline == std::chrono::system_clock::time_point::max()
                               ? -1
                               : std::chrono::duration_cast<std::chrono::milliseconds>(deadline - arrived).count());

    if (request->hang() || request->delay_ms() > 0) {
      hanging.fetch_add(1, std::memory_order_release);
      const auto until = arrived + std::chrono::milliseconds(request->delay_ms());
      while (!context->IsCancelled() && (request->hang() || std::chrono::system_clock::now() < until)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      hanging.fetch_sub(1, std::memory_order_release);
      if (context->IsCancelled()) {
        saw_cancel.fetch_add(1, std::memory_order_relaxed);
        return ::grpc::Status(::grpc::StatusCode::CANCELLED, "the client went away");
      }
    }
    if (!request->pushback().empty()) context->AddTrailingMetadata("grpc-retry-pushback-ms", request->pushback());
    const bool fail = request->script().empty() || number <= request->fail_first();
    if (request->code() != 0 && fail) {
      return ::grpc::Status(static_cast<::grpc::StatusCode>(request->code()), "played " + std::to_string(request->code()));
    }
    return ::grpc::Status::OK;
  }

  std::atomic<int> calls{0};
  std::atomic<int> hanging{0};     // handlers waiting now
  std::atomic<int> saw_cancel{0};  // handlers that ended because the client cancelled

 private:
  static std::string metadata(const ::grpc::ServerContext& context, std::string_view key) {
    const auto& md = context.client_metadata();
    const auto it = md.find(::grpc::string_ref(key.data(), key.size()));
    return it == md.end() ? std::string() : std::string(it->second.data(), it->second.size());
  }

  std::mutex mu_;
  std::map<std::string, int> scripts_;
};

// The server and a stub for it. Shut down (cancelling what still runs) when destroyed.
class player_server {
 public:
  player_server() {
    ::grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", ::grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service);
    server_ = builder.BuildAndStart();
    address_ = "127.0.0.1:" + std::to_string(port_);
    channel_ = ::grpc::CreateChannel(address_, ::grpc::InsecureChannelCredentials());
    stub = Player::NewStub(channel_);
  }
  ~player_server() { server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1)); }
  player_server(const player_server&) = delete;
  player_server& operator=(const player_server&) = delete;

  [[nodiscard]] bool started() const { return server_ != nullptr && port_ != 0; }
  [[nodiscard]] const std::string& address() const { return address_; }
  [[nodiscard]] const std::shared_ptr<::grpc::Channel>& channel() const { return channel_; }

  player_service service;
  std::unique_ptr<Player::Stub> stub;

 private:
  int port_ = 0;
  std::string address_;
  std::unique_ptr<::grpc::Server> server_;
  std::shared_ptr<::grpc::Channel> channel_;
};

}  // namespace keel_test
