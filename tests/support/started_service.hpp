// The example gateway as an HTTP service on a free loopback port, for the
// tests that talk to it over the wire (service_http_test.cpp,
// service_upstreams_test.cpp).
//
//   auto svc = keel_service::start(options);   // throws when it cannot open or bind
//   httplib::Client c("127.0.0.1", svc->port());
//
// Thread-safety: start() from the test's thread; the service is gateway::service.
#pragma once

#include <memory>
#include <stdexcept>
#include <string>
#include <utility>

#include "gateway_service.hpp"

namespace keel_service {

// Opens the gateway's stores and serves on 127.0.0.1:<a free port>; a
// failure throws, which Catch reports with its message.
inline std::unique_ptr<gateway::service> start(const gateway::gateway_options& o) {
  auto svc = gateway::service::open(o);
  if (!svc.ok()) throw std::runtime_error(std::string(svc.status().message()));
  if (const absl::Status up = (*svc)->start("127.0.0.1", 0); !up.ok()) throw std::runtime_error(std::string(up.message()));
  return std::move(*svc);
}

}  // namespace keel_service
