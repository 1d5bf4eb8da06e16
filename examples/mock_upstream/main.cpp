// mock_upstream: an OpenAI-compatible model server with switchable faults
// (mock_upstream.hpp), for keel's gateway, its tests, its demo and its
// benchmarks to put behind them instead of a real provider.
//
//   mock_upstream --port N [--name NAME] [--latency-ms MS] [--first-token-ms MS]
//                 [--token-gap-ms MS] [--tokens N] [--seed N] [--models a,b] [--threads N]
//
// Prints one line, "mock_upstream NAME listening on 127.0.0.1:PORT", once it
// accepts connections (--port 0: a free port, named there), serves until
// SIGTERM or SIGINT, then exits 0. A bad flag: a message naming the flag and
// its rule on stderr, exit 2. README.md lists the endpoints and the control API.
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

#include <pthread.h>

#include "mock_upstream.hpp"

namespace {

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "mock_upstream: %s\n", message.c_str());
  std::fprintf(stderr,
               "usage: mock_upstream --port N [--name NAME] [--latency-ms MS] [--first-token-ms MS] "
               "[--token-gap-ms MS] [--tokens N] [--seed N] [--models a,b] [--threads N]\n");
  std::exit(2);
}

// `text` as a whole decimal number in [lo, hi], or exit 2 naming the flag.
long long number(std::string_view flag, const std::string& text, long long lo, long long hi) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno != 0 || text[0] == '+' || text[0] == ' ' || v < lo || v > hi)
    usage_error(std::string(flag) + " must be a whole number in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                "] (got '" + text + "')");
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  mock_upstream::options o;
  bool have_port = false;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::printf("usage: mock_upstream --port N [--name NAME] [--latency-ms MS] [--first-token-ms MS] "
                  "[--token-gap-ms MS] [--tokens N] [--seed N] [--models a,b] [--threads N]\n");
      return 0;
    }
    if (flag.rfind("--", 0) != 0) usage_error("unexpected argument '" + flag + "' (flags start with --)");
    if (i + 1 >= argc) usage_error(flag + " needs a value");
    const std::string v = argv[++i];
    constexpr long long max_ms = 600000;  // 10 minutes
    if (flag == "--port") {
      o.port = static_cast<int>(number(flag, v, 0, 65535));
      have_port = true;
    } else if (flag == "--name") {
      if (v.empty() || v.find_first_of(" \t\r\n") != std::string::npos)
        usage_error("--name must be a non-empty word without spaces (got '" + v + "')");
      o.name = v;
    } else if (flag == "--latency-ms") {
      o.latency = mock_upstream::millis(number(flag, v, 0, max_ms));
    } else if (flag == "--first-token-ms") {
      o.first_token = mock_upstream::millis(number(flag, v, 0, max_ms));
    } else if (flag == "--token-gap-ms") {
      o.token_gap = mock_upstream::millis(number(flag, v, 0, max_ms));
    } else if (flag == "--tokens") {
      o.tokens = static_cast<int>(number(flag, v, 1, 100000));
    } else if (flag == "--seed") {
      o.seed = static_cast<std::uint64_t>(number(flag, v, 0, std::numeric_limits<long long>::max()));
    } else if (flag == "--threads") {
      o.threads = static_cast<int>(number(flag, v, 1, 4096));
    } else if (flag == "--models") {
      o.models.clear();
      std::size_t at = 0;
      for (;;) {
        const std::size_t comma = v.find(',', at);
        o.models.push_back(v.substr(at, comma == std::string::npos ? std::string::npos : comma - at));
        if (comma == std::string::npos) break;
        at = comma + 1;
      }
      for (const std::string& m : o.models) {
        if (m.empty() || m.find_first_of(" \t\r\n\"") != std::string::npos)
          usage_error("--models must be a comma-separated list of non-empty ids without spaces (got '" + v + "')");
      }
    } else {
      usage_error("unknown flag '" + flag + "'");
    }
  }
  if (!have_port) usage_error("--port is required (0: a free port)");
  if (absl::Status s = o.validate(); !s.ok()) usage_error(std::string(s.message()));

  // SIGTERM and SIGINT are waited for on this thread: blocked before the
  // server's threads start, so they inherit the mask and none of them takes it.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  std::signal(SIGPIPE, SIG_IGN);  // a client that left must not end the server

  mock_upstream::server server(o);
  absl::StatusOr<int> port = server.start();
  if (!port.ok()) {
    std::fprintf(stderr, "mock_upstream: %s\n", std::string(port.status().message()).c_str());
    return 1;
  }
  std::printf("mock_upstream %s listening on 127.0.0.1:%d\n", o.name.c_str(), *port);
  std::fflush(stdout);

  int sig = 0;
  sigwait(&stop_signals, &sig);
  server.stop();
  return 0;
}
