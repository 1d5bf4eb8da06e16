// A scripted server of OpenAI-compatible chat completion streams (server-sent
// events over chunked HTTP), in the test process, on a loopback port
// (cpp-httplib). Each path plays one behaviour:
//
//   /normal          role chunk, ": ping", N content tokens, usage chunk, [DONE]
//   /slow_first      as /normal, but the first content token comes after `slow` (keep-alives meanwhile)
//   /stall           N tokens, then nothing for `slow` (keep-alives only), then the rest
//   /cut             N tokens, then the connection is closed without [DONE]
//   /error           N tokens, then an error event (server_error, 503)
//   /429_then_ok     the first request: 429 with retry-after-ms: 20; then /normal
//   /slow_then_ok    the first request: /slow_first; then /normal
//   /usage_mismatch  N tokens and a usage chunk that says 50 completion tokens
//   /keepalive_only  keep-alives and a role chunk only, for `slow`, then [DONE]
//   /tool_calls      OpenAI's tool-call stream, byte for byte (tool_call_events()):
//                    one call whose arguments come in five fragments, 60 ms
//                    apart, no content at all, finish_reason "tool_calls", [DONE]
//   /tool_calls_cut  the same, cut after the third fragment (mid-arguments)
//   /refusal         a refusal-only message (delta.refusal fragments), then [DONE]
//
// Every 2xx and 4xx answer carries an x-request-id ("req-<path>-<n>") and
// rate-limit headers, as OpenAI sends them.
//
// Tokens are "t0 ", "t1 ", ...; N is `tokens`. Every handler that waits
// watches the server's stop and its client (a closed connection ends it at
// once), and counts how its streams ended (aborted(): the client went away).
//
// Thread-safety: requests are served on the server's threads; the figures are atomic.
#pragma once

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace keel_test {

class sse_server {
 public:
  explicit sse_server(int tokens = 5, std::chrono::milliseconds slow = std::chrono::milliseconds(1500))
      : tokens_(tokens), slow_(slow) {
    server_.new_task_queue = [] { return new httplib::ThreadPool(8); };
    server_.set_tcp_nodelay(true);
    auto handler = [this](const httplib::Request& req, httplib::Response& res) { serve(req, res); };
    for (const char* p : {"/normal", "/slow_first", "/stall", "/cut", "/error", "/429_then_ok", "/slow_then_ok",
                          "/usage_mismatch", "/keepalive_only", "/tool_calls", "/tool_calls_cut", "/refusal"})
      server_.Post(p, handler);
    port_ = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    while (!server_.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ~sse_server() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    server_.stop();
    thread_.join();
  }
  sse_server(const sse_server&) = delete;
  sse_server& operator=(const sse_server&) = delete;

  [[nodiscard]] std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  [[nodiscard]] int requests(const std::string& path) {
    std::lock_guard lock(mu_);
    return count_[path];
  }
  // Streams whose client went away before the stream ended.
  [[nodiscard]] int aborted() const noexcept { return aborted_.load(); }
  // Streams the server played to their end.
  [[nodiscard]] int finished() const noexcept { return finished_.load(); }

  // The tool-call stream's events, as OpenAI's chat completions stream a
  // function call (role chunk with the call's id and name, then argument
  // fragments, then finish_reason "tool_calls").
  static std::vector<std::string> tool_call_events() {
    const std::string head =
        R"(data: {"id":"chatcmpl-9tc","object":"chat.completion.chunk","created":1733550000,"model":"gpt-4o-2024-08-06","system_fingerprint":"fp_7f6be3efb0","choices":[{"index":0,"delta":)";
    const std::string tail = R"(,"logprobs":null,"finish_reason":null}]})" "\n\n";
    std::vector<std::string> out;
    out.push_back(head +
                  R"({"role":"assistant","content":null,"tool_calls":[{"index":0,"id":"call_DdmO9pD3xa9XTPNJ32zg2hcA","type":"function","function":{"name":"get_weather","arguments":""}}],"refusal":null})" +
                  tail);
    for (const char* piece : {R"({\")", R"(location\":\")", R"(Paris, France)", R"(\",\"unit\":\"celsius)", R"(\"})"})
      out.push_back(head + R"({"tool_calls":[{"index":0,"function":{"arguments":")" + piece + R"("}}]})" + tail);
    out.push_back(
        R"(data: {"id":"chatcmpl-9tc","object":"chat.completion.chunk","created":1733550000,"model":"gpt-4o-2024-08-06","system_fingerprint":"fp_7f6be3efb0","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"tool_calls"}]})"
        "\n\n");
    out.push_back("data: [DONE]\n\n");
    return out;
  }

  static std::vector<std::string> refusal_events() {
    const std::string head =
        R"(data: {"id":"chatcmpl-9rf","object":"chat.completion.chunk","created":1733550000,"model":"gpt-4o-2024-08-06","system_fingerprint":"fp_7f6be3efb0","choices":[{"index":0,"delta":)";
    const std::string tail = R"(,"logprobs":null,"finish_reason":null}]})" "\n\n";
    return {head + R"({"role":"assistant","content":null,"refusal":""})" + tail,
            head + R"({"refusal":"I'm sorry"})" + tail,
            head + R"({"refusal":", I can't help with that."})" + tail,
            R"(data: {"id":"chatcmpl-9rf","object":"chat.completion.chunk","created":1733550000,"model":"gpt-4o-2024-08-06","system_fingerprint":"fp_7f6be3efb0","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}]})"
            "\n\n",
            "data: [DONE]\n\n"};
  }

  static std::string token_event(int i) {
    return "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"t" +
           std::to_string(i) + " \"},\"finish_reason\":null}]}\n\n";
  }

 private:
  void serve(const httplib::Request& req, httplib::Response& res) {
    int n = 0;
    {
      std::lock_guard lock(mu_);
      n = ++count_[req.path];
    }
    std::string path = req.path;
    res.set_header("x-request-id", "req-" + path.substr(1) + "-" + std::to_string(n));
    res.set_header("x-ratelimit-limit-requests", "10000");
    res.set_header("x-ratelimit-remaining-requests", "9999");
    res.set_header("x-ratelimit-reset-requests", "6ms");
    if (path == "/429_then_ok") {
      if (n == 1) {
        res.status = 429;
        res.set_header("retry-after-ms", "20");
        res.set_content(R"({"error":{"message":"rate limited","type":"rate_limit_error"}})", "application/json");
        return;
      }
      path = "/normal";
    }
    if (path == "/slow_then_ok") path = n == 1 ? "/slow_first" : "/normal";
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider("text/event-stream", [this, path](std::size_t, httplib::DataSink& sink) {
      const bool ok = play(path, sink);
      if (ok) {
        finished_.fetch_add(1);
        sink.done();
      } else {
        aborted_.fetch_add(1);
      }
      return ok;  // false: the connection is closed without the last chunk
    });
  }

  // Keep-alives every 50 ms for `d`; false when the client or the server went away.
  bool wait(httplib::DataSink& sink, std::chrono::milliseconds d) {
    const auto until = std::chrono::steady_clock::now() + d;
    for (;;) {
      {
        std::unique_lock lock(mu_);
        if (cv_.wait_until(lock, std::min(until, std::chrono::steady_clock::now() + std::chrono::milliseconds(50)),
                           [&] { return stopping_; }))
          return false;
      }
      if (!write(sink, ": keep-alive\n\n")) return false;
      if (std::chrono::steady_clock::now() >= until) return true;
    }
  }
  static bool write(httplib::DataSink& sink, const std::string& s) {
    return sink.is_writable() && sink.write(s.data(), s.size());
  }

  bool play(const std::string& path, httplib::DataSink& sink) {
    if (path == "/tool_calls" || path == "/tool_calls_cut") {
      const std::vector<std::string> events = tool_call_events();
      for (std::size_t i = 0; i < events.size(); ++i) {
        if (path == "/tool_calls_cut" && i == 4) return false;  // after the third argument fragment
        if (i >= 2 && i <= 5 && !wait(sink, std::chrono::milliseconds(60))) return false;
        if (!write(sink, events[i])) return false;
      }
      return true;
    }
    if (path == "/refusal") {
      for (const std::string& e : refusal_events())
        if (!write(sink, e)) return false;
      return true;
    }
    if (!write(sink, "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n"))
      return false;
    if (!write(sink, ": ping\n\n")) return false;
    if (path == "/keepalive_only") {
      if (!wait(sink, slow_)) return false;
      return write(sink, "data: [DONE]\n\n");
    }
    if (path == "/slow_first" && !wait(sink, slow_)) return false;
    for (int i = 0; i < tokens_; ++i) {
      if (!write(sink, token_event(i))) return false;
    }
    if (path == "/stall") {
      if (!wait(sink, slow_)) return false;
      if (!write(sink, token_event(tokens_))) return false;
    }
    if (path == "/cut") return false;
    if (path == "/error") {
      return write(sink, "data: {\"error\":{\"message\":\"The server is overloaded\",\"type\":\"server_error\",\"code\":503}}\n\n") &&
             write(sink, "data: [DONE]\n\n");
    }
    const int completion = path == "/usage_mismatch" ? 50 : tokens_;
    if (!write(sink, "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n")) return false;
    if (!write(sink, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":" +
                         std::to_string(completion) + ",\"total_tokens\":" + std::to_string(9 + completion) + "}}\n\n"))
      return false;
    return write(sink, "data: [DONE]\n\n");
  }

  int tokens_;
  std::chrono::milliseconds slow_;
  httplib::Server server_;
  std::thread thread_;
  int port_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::map<std::string, int> count_;
  std::atomic<int> aborted_{0};
  std::atomic<int> finished_{0};
};

}  // namespace keel_test
