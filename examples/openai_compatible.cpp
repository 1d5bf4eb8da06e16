// openai_compatible: a chat completion from an OpenAI-compatible endpoint
// (OpenAI, vLLM, TGI, llama.cpp server, ...) through keel: retries with a
// service-wide budget, an adaptive attempt timeout and a circuit breaker
// around keel::http (libcurl), which classifies each response and reads the
// provider's retry hints itself.
//
//   openai_compatible [BASE_URL]      e.g. http://127.0.0.1:8000 (vLLM), https://api.openai.com/v1
//
// BASE_URL may also come from OPENAI_BASE_URL; OPENAI_API_KEY and
// OPENAI_MODEL are used when set. With no URL the program starts a
// simulated endpoint in-process that now and then answers 429 with a
// retry-after-ms hint or 503, and prints what keel did about it.
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "keel/core/format.hpp"
#include "keel/keel.hpp"
#include "keel/provider/http.hpp"

using namespace std::chrono_literals;
using json = nlohmann::json;

namespace {

// The simulated endpoint: a scripted sequence of answers.
class simulated_endpoint {
 public:
  simulated_endpoint() {
    server_.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
      const int n = ++requests_;
      if (n % 5 == 2) {  // rate limited, with OpenAI's hints
        res.status = 429;
        res.set_header("retry-after-ms", "250");
        res.set_header("x-ratelimit-remaining-requests", "0");
        res.set_header("x-ratelimit-reset-requests", "250ms");
        res.set_content(R"({"error":{"message":"Rate limit reached","type":"requests"}})", "application/json");
        return;
      }
      if (n % 7 == 4) {  // a brief overload
        res.status = 503;
        res.set_content(R"({"error":{"message":"overloaded"}})", "application/json");
        return;
      }
      const json in = json::parse(req.body, nullptr, false);
      const std::string question = in.is_discarded() ? "?" : in["messages"].back().value("content", "?");
      json out = {{"id", "chatcmpl-" + std::to_string(n)},
                  {"object", "chat.completion"},
                  {"choices", {{{"index", 0},
                                {"message", {{"role", "assistant"}, {"content", "simulated answer to: " + question}}},
                                {"finish_reason", "stop"}}}},
                  {"usage", {{"prompt_tokens", 12}, {"completion_tokens", 7}, {"total_tokens", 19}}}};
      res.set_content(out.dump(), "application/json");
    });
    server_.set_tcp_nodelay(true);
    port_ = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    while (!server_.is_running()) std::this_thread::sleep_for(1ms);
  }
  ~simulated_endpoint() {
    server_.stop();
    thread_.join();
  }
  [[nodiscard]] std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }

 private:
  httplib::Server server_;
  std::thread thread_;
  int port_ = 0;
  std::atomic<int> requests_{0};
};

struct answer {
  std::string text;
  std::int64_t tokens = 0;
};

// A 2xx body into an answer; a body that is not a chat completion is the
// provider's fault (InternalError: retried for a read).
absl::StatusOr<answer> parse_completion(const keel::http::response& r) {
  const json j = json::parse(r.body, nullptr, false);
  if (j.is_discarded() || !j.contains("choices") || j["choices"].empty())
    return absl::InternalError("not a chat completion");
  return answer{.text = j["choices"][0]["message"].value("content", ""),
                .tokens = j.contains("usage") ? j["usage"].value("total_tokens", std::int64_t{0}) : 0};
}

}  // namespace

int main(int argc, char** argv) {
  std::string base = argc > 1 ? argv[1] : (std::getenv("OPENAI_BASE_URL") ? std::getenv("OPENAI_BASE_URL") : "");
  std::unique_ptr<simulated_endpoint> simulated;
  if (base.empty()) {
    simulated = std::make_unique<simulated_endpoint>();
    base = simulated->url();
    fmt::print("no URL given: a simulated endpoint at {}\n", base);
  }
  // OPENAI_BASE_URL conventionally ends in /v1 (https://api.openai.com/v1); both forms work.
  while (!base.empty() && base.back() == '/') base.pop_back();
  const std::string path = base.size() >= 3 && base.compare(base.size() - 3, 3, "/v1") == 0 ? "/chat/completions"
                                                                                            : "/v1/chat/completions";
  const char* key = std::getenv("OPENAI_API_KEY");
  const std::string model = std::getenv("OPENAI_MODEL") ? std::getenv("OPENAI_MODEL") : "gpt-4o-mini";

  // Shared, long-lived: one client (connections), budget, timeout estimate and breaker per endpoint.
  keel::http::client llm({.base_url = base,
                          .headers = key ? std::vector<std::string>{std::string("Authorization: Bearer ") + key}
                                         : std::vector<std::string>{}});
  keel::retry_budget budget({.ratio = 0.2, .min_per_second = 5});
  keel::adaptive_timeout timeouts({.margin = 500ms, .lower = 1s, .upper = 30s, .initial = 20s});
  keel::circuit_breaker breaker({.name = "chat", .window_calls = 20, .minimum_calls = 10});
  auto pipe = keel::pipeline(keel::retry({.max_attempts = 3, .budget = &budget, .max_retry_after = 5s},
                                         keel::full_jitter{.base = 100ms, .cap = 1s}),
                             breaker, timeouts);

  const char* questions[] = {"What is a circuit breaker?", "Why jitter retries?", "What is a retry budget?",
                             "What does 429 mean?", "Why propagate deadlines?"};
  int answered = 0;
  for (const char* q : questions) {
    const std::string body =
        json{{"model", model}, {"messages", {{{"role", "user"}, {"content", q}}}}, {"max_tokens", 64}}.dump();
    keel::real_clock clock;
    const keel::time_point start = clock.now();
    // Chat completions are reads: nothing happens twice if one is repeated.
    keel::call call(start, {.timeout = 30s, .labels = {.model = model}});
    auto chat = llm.exchange({.path = path, .body = body}, parse_completion);
    absl::StatusOr<answer> a = pipe.run(call, [&](const keel::attempt& at) {
      absl::StatusOr<answer> r = chat(at);
      if (!r.ok()) {
        const auto hint = keel::retry_after(r.status());
        fmt::print("  attempt {}: {} ({}){}\n", at.number, std::string(r.status().message()),
                   keel::to_string(keel::default_classifier{}(r.status(), call.operation())),
                   hint ? fmt::format(", provider asks to wait {} ms",
                                      std::chrono::duration_cast<std::chrono::milliseconds>(*hint).count())
                        : "");
      } else {
        at.charge(r->tokens);
      }
      return r;
    });
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(clock.now() - start).count();
    if (a.ok()) {
      ++answered;
      fmt::print("{} -> {}\n  {} ms, {}\n", q, a->text, ms, call.record());
    } else {
      fmt::print("{} -> failed: {}\n  {} ms, {}\n", q, a.status().ToString(), ms, call.record());
    }
  }
  fmt::print("{} of {} answered\n", answered, std::size(questions));
  return answered > 0 ? 0 : 1;
}
