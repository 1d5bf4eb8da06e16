// The mock OpenAI-compatible upstream (examples/mock_upstream/) as a child
// process of a test, on a free port, with its control API at hand.
//
//   keel_test::mock_upstream_process mock({"--first-token-ms", "20"});
//   keel::http::client llm({.base_url = mock.url()});
//   mock.set_fault(R"({"kind":"rate_limit","retry_after_ms":250})");
//   nlohmann::json stats = mock.stats();   // GET /control/stats
//
// Needs KEEL_MOCK_UPSTREAM (the program's path: tests/CMakeLists.txt defines
// it for the service area), cpp-httplib and nlohmann-json.
//
// Thread-safety: the control calls from any thread (each makes its own
// connection); construction and destruction from one.
#pragma once

#include <httplib.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "support/child_program.hpp"

namespace keel_test {

class mock_upstream_process {
 public:
  // Starts it with `--port 0 --name <name>` and `args`, and reads its line.
  // Throws std::runtime_error when it does not say where it listens.
  explicit mock_upstream_process(const std::vector<std::string>& args = {}, const std::string& name = "mock")
      : proc_(command(args, name)) {
    line_ = proc_.read_line().value_or("");
    port_ = port_in(line_);
    if (port_ <= 0) throw std::runtime_error("mock_upstream did not say where it listens: '" + line_ + "'");
  }

  [[nodiscard]] int port() const noexcept { return port_; }
  [[nodiscard]] std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  [[nodiscard]] const std::string& line() const noexcept { return line_; }
  [[nodiscard]] child_program& process() noexcept { return proc_; }

  // POST /control/fault with `body`; the HTTP status (200, or 400 with a reason).
  int set_fault(const std::string& body, std::string* answer = nullptr) const {
    httplib::Client c("127.0.0.1", port_);
    auto r = c.Post("/control/fault", body, "application/json");
    if (!r) throw std::runtime_error("mock_upstream: /control/fault: no answer");
    if (answer != nullptr) *answer = r->body;
    return r->status;
  }
  [[nodiscard]] nlohmann::json stats() const { return get_json("/control/stats"); }
  [[nodiscard]] nlohmann::json fault() const { return get_json("/control/fault"); }
  void reset() const {
    httplib::Client c("127.0.0.1", port_);
    if (!c.Post("/control/reset", "", "application/json")) throw std::runtime_error("mock_upstream: reset failed");
  }

  // SIGTERM, then its exit code (0 when it stopped cleanly).
  int terminate() { return proc_.terminate(); }

 private:
  static std::vector<std::string> command(const std::vector<std::string>& args, const std::string& name) {
    std::vector<std::string> argv = {KEEL_MOCK_UPSTREAM, "--port", "0", "--name", name};
    argv.insert(argv.end(), args.begin(), args.end());
    return argv;
  }
  [[nodiscard]] nlohmann::json get_json(const std::string& path) const {
    httplib::Client c("127.0.0.1", port_);
    auto r = c.Get(path);
    if (!r) throw std::runtime_error("mock_upstream: " + path + ": no answer");
    return nlohmann::json::parse(r->body);
  }

  child_program proc_;
  std::string line_;
  int port_ = -1;
};

}  // namespace keel_test
