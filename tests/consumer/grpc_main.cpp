// Uses keel::grpc from outside the project: the exported target brings gRPC,
// and the adapter's mapping works without a server.
#include <cstdio>

#include "keel/provider/grpc.hpp"

int main() {
  const absl::Status s = keel::from_grpc_status(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "busy"),
                                                keel::operation{}, "250");
  const keel::outcome_kind k = keel::default_classifier{}(s, keel::operation{});
  if (k != keel::outcome_kind::throttled || keel::retry_after(s) != std::chrono::milliseconds(250)) {
    std::fprintf(stderr, "consumer_grpc: unexpected mapping\n");
    return 1;
  }
  std::printf("consumer_grpc: RESOURCE_EXHAUSTED with pushback 250 is throttled, retry after 250 ms\n");
  return 0;
}
