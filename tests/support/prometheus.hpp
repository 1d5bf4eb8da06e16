// A real Prometheus server (Debian's `prometheus`) on loopback for the
// tests that check keel's metrics as their real consumer reads them: it
// scrapes one target every second and answers PromQL over its HTTP API.
//
//   keel_test::prometheus_server prom({.dir = dir.path(), .target = "127.0.0.1:8080"});
//   prom.await_up(30s);                            // the target scraped
//   nlohmann::json v = prom.query("sum(up)");      // data.result of an instant query
//
// The server is this process's child and is stopped (SIGTERM, then SIGKILL)
// by the destructor. Thread-safety: one controlling thread.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "support/loopback.hpp"

extern char** environ;

namespace keel_test {

struct prometheus_options {
  std::string dir;     // config, TSDB and log go here
  std::string target;  // host:port serving /metrics
  std::string job = "gateway";
};

class prometheus_server {
 public:
  explicit prometheus_server(prometheus_options o) : o_(std::move(o)) {
    {
      std::ofstream cfg(o_.dir + "/prometheus.yml");
      cfg << "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
          << "scrape_configs:\n  - job_name: " << o_.job << "\n    scrape_interval: 1s\n"
          << "    scrape_timeout: 900ms\n    static_configs:\n      - targets: ['" << o_.target << "']\n";
    }
    // A port that was free a moment ago may be taken by the time the server
    // binds it: try a few.
    for (int attempt = 0; attempt < 5 && pid_ < 0; ++attempt) {
      port_ = unused_loopback_port();
      launch();
      if (!await_ready(std::chrono::seconds(60))) stop();
    }
    if (pid_ < 0) throw std::runtime_error("prometheus did not start; see " + o_.dir + "/prometheus.log");
  }
  prometheus_server(const prometheus_server&) = delete;
  prometheus_server& operator=(const prometheus_server&) = delete;
  ~prometheus_server() { stop(); }

  [[nodiscard]] int port() const noexcept { return port_; }

  // The `data.result` array of an instant query at the server's now; throws
  // with Prometheus's error text when the query is refused.
  nlohmann::json query(const std::string& promql) const {
    httplib::Client c("127.0.0.1", port_);
    c.set_read_timeout(std::chrono::seconds(10));
    const httplib::Result r = c.Get("/api/v1/query", httplib::Params{{"query", promql}}, httplib::Headers{});
    if (!r) throw std::runtime_error("prometheus query failed to connect: " + promql);
    const nlohmann::json j = nlohmann::json::parse(r->body, nullptr, false);
    if (r->status != 200 || j.is_discarded() || j.value("status", "") != "success")
      throw std::runtime_error("prometheus refused `" + promql + "`: " + r->body);
    return j["data"]["result"];
  }

  // The single sample of a query that must return one series; NaN when it
  // returns none.
  double scalar(const std::string& promql) const {
    const nlohmann::json res = query(promql);
    if (res.empty()) return std::numeric_limits<double>::quiet_NaN();
    if (res.size() != 1)
      throw std::runtime_error("`" + promql + "` returned " + std::to_string(res.size()) + " series");
    return std::stod(res[0]["value"][1].get<std::string>());
  }

  // Waits (real time, bounded) until `done()`, checking every 100 ms: how a
  // test waits for the next scrape. Returns whether it came true.
  template <class Done>
  bool await(std::chrono::seconds limit, Done done) const {
    const auto end = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < end) {
      if (done()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return done();
  }

  // Until the target has been scraped successfully.
  bool await_up(std::chrono::seconds limit) const {
    return await(limit, [&] { return scalar("up{job=\"" + o_.job + "\"}") == 1.0; });
  }

 private:
  void launch() {
    std::vector<std::string> args = {"prometheus",
                                     "--config.file=" + o_.dir + "/prometheus.yml",
                                     "--storage.tsdb.path=" + o_.dir + "/tsdb",
                                     "--web.listen-address=127.0.0.1:" + std::to_string(port_),
                                     "--log.level=warn"};
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const std::string log = o_.dir + "/prometheus.log";
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    pid_t pid = -1;
    const int rc = posix_spawnp(&pid, "prometheus", &fa, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) throw std::runtime_error("cannot run prometheus (apt-get install prometheus)");
    pid_ = pid;
  }

  bool await_ready(std::chrono::seconds limit) {
    const auto end = std::chrono::steady_clock::now() + limit;
    httplib::Client c("127.0.0.1", port_);
    c.set_connection_timeout(std::chrono::seconds(1));
    while (std::chrono::steady_clock::now() < end) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {  // exited: a taken port, say
        pid_ = -1;
        return false;
      }
      if (const httplib::Result r = c.Get("/-/ready"); r && r->status == 200) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return false;
  }

  void stop() {
    if (pid_ < 0) return;
    ::kill(pid_, SIGTERM);
    for (int i = 0; i < 100; ++i) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

  prometheus_options o_;
  int port_ = 0;
  pid_t pid_ = -1;
};

}  // namespace keel_test
