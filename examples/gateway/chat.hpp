// gateway/chat.hpp — what the streaming endpoint (POST /v1/chat/completions,
// OpenAI-compatible, gateway_core::chat_completions) carries and writes:
// the parsed request, the sink a streamed reply goes into, the relay that
// turns each content token into a server-sent event, and the provider
// adapter that asks a simulated model for a stream.
//
// The wire format is OpenAI's: a reply with "stream": true is
// `text/event-stream`, one `data: {chat.completion.chunk}` event per token
// (the first preceded by a role chunk), then a chunk with the
// finish_reason, a usage chunk (`"choices": []`) and `data: [DONE]`. keel's
// view of the stream rides along under a "keel" key in the last chunk
// (complete, partial, degraded, continuations, hedge, served_by, ttft_ms). A
// stream that ends early after its first token, and is not continued, ends
// with an error event (`{"error": {"type": "stream_interrupted", "code":
// <why>}}`) instead of a finish_reason: the client has a partial answer and
// must be told so.
//
// Nothing is sent before the first content token (the commit point): until
// then the gateway may still retry, hedge or fail over, and a failure is an
// ordinary JSON error with its HTTP status (429, 503, 504).
//
// Example:
//
//   gateway::recording_sink sink;                       // what a test reads
//   gateway::reply r = core.chat_completions(R"({"tenant":"acme","model":"feedback-large",
//       "messages":[{"role":"user","content":"hi"}],"stream":true})", &sink);
//   // r.streamed: the reply went into `sink` as server-sent events
//
// Thread-safety: a chat_relay belongs to one request; its token() runs on
// whichever thread runs the winning stream (one at a time). A sink's send()
// is called by one thread at a time; client_gone() from any thread.
#pragma once

#include <atomic>
#include <algorithm>
#include <cstdint>
#include <mutex>
#include <stop_token>
#include <string>
#include <string_view>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "keel/compose/stream.hpp"
#include "keel/core/call.hpp"
#include "keel/policy/admission.hpp"
#include "simulated_provider.hpp"
#include "text.hpp"
#include "upstream.hpp"

namespace gateway {

// POST /v1/chat/completions, parsed and checked.
struct chat_request {
  std::string tenant, model, prompt;
  int max_tokens = 0;
  bool stream = false;
  std::int64_t input_tokens = 0;  // estimated: a token per 4 bytes of the messages
  // The client's request as an upstream gets it: every field it sent
  // (messages with their tool calls and parts, tools, tool_choice,
  // response_format, sampling), less the gateway's own ("tenant") and what
  // each upstream call sets ("model", "stream", "stream_options", the token cap).
  nlohmann::json upstream_request = nlohmann::json::object();
};

// What the call carries to the token estimate and the provider.
struct chat_call {
  const chat_request& body;
  const keel::admission_key* tenant_key = nullptr;
  std::int64_t reserved = 0;  // the tokens admission reserves (set before the run)
};

// What a call carries through the embeddings path (POST /v1/embeddings).
struct embeddings_call {
  const keel::admission_key* tenant_key = nullptr;
  std::int64_t reserved = 0;  // tokens admission reserves: the input's estimate
};

// Where a streamed reply goes: the front door's chunked response, or a
// test's recorder. The first send() also sends the head (200, event stream).
class chat_sink {
 public:
  virtual ~chat_sink() = default;
  // False: the client is gone (or the write timed out); stop streaming.
  virtual bool send(std::string_view bytes) = 0;
  // Requested when the client hangs up, between writes too.
  [[nodiscard]] virtual std::stop_token client_gone() const = 0;
};

// A sink that keeps what was sent (tests, and the non-streaming reply's
// dry run); its client never goes away unless told to.
class recording_sink final : public chat_sink {
 public:
  bool send(std::string_view bytes) override {
    std::lock_guard lock(mu_);
    if (gone_.stop_requested()) return false;
    text_.append(bytes.data(), bytes.size());
    ++sends_;
    return true;
  }
  [[nodiscard]] std::stop_token client_gone() const override { return gone_.get_token(); }
  void hang_up() { gone_.request_stop(); }
  [[nodiscard]] std::string text() const {
    std::lock_guard lock(mu_);
    return text_;
  }
  [[nodiscard]] int sends() const {
    std::lock_guard lock(mu_);
    return sends_;
  }

 private:
  mutable std::mutex mu_;
  std::string text_;
  int sends_ = 0;
  std::stop_source gone_;
};

namespace detail {

// JSON string body of `s` (no quotes), appended to `out`. Control bytes as
// \u00XX; invalid UTF-8 passes as it came (the provider's bytes).
inline void append_json_string(std::string& out, std::string_view s) {
  static constexpr char hex[] = "0123456789abcdef";
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          out += "\\u00";
          out += hex[c >> 4];
          out += hex[c & 15];
        } else {
          out += ch;
        }
    }
  }
}

}  // namespace detail

// One request's relay: each content token becomes one server-sent event.
// The buffer is reused, so a token costs its formatting and one send().
class chat_relay {
 public:
  chat_relay(chat_sink* sink, std::string id, std::int64_t created, std::string_view model, std::stop_source& stop)
      : sink_(sink), stop_(&stop) {
    head_ = cat("{\"id\":\"", id, "\",\"object\":\"chat.completion.chunk\",\"created\":", created, ",\"model\":\"");
    detail::append_json_string(head_, model);
    head_ += "\",\"choices\":[";
    buf_.reserve(head_.size() + 256);
  }

  // stream_writer's on_token: the first token sends the role chunk first.
  void token(std::string_view t) {
    if (sink_ == nullptr || failed_.load(std::memory_order_relaxed)) return;
    open();
    buf_.assign("data: ");
    buf_ += head_;
    buf_ += R"({"index":0,"delta":{"content":")";
    detail::append_json_string(buf_, t);
    buf_ += "\"},\"finish_reason\":null}]}\n\n";
    flush();
  }

  // token_stream's event hand-over: model output (content, tool-call
  // fragments, a refusal) relayed as the provider sent it when it sent
  // JSON (its chunk, its id and model included), else rebuilt from the
  // parsed view (the simulated provider). The upstream's usage chunk and
  // [DONE] are not relayed: the gateway's own finish, usage and keel chunks
  // end the stream, with the finish_reason the upstream gave.
  void on_event(const keel::stream_event& e) {
    if (!e.finish_reason.empty()) finish_reason_.assign(e.finish_reason.data(), e.finish_reason.size());
    if (!e.output() || sink_ == nullptr || failed_.load(std::memory_order_relaxed)) return;
    if (e.data.empty()) {
      if (!e.content.empty()) token(e.content);
      if (!e.refusal.empty()) {
        open();
        buf_.assign("data: ");
        buf_ += head_;
        buf_ += R"({"index":0,"delta":{"refusal":")";
        detail::append_json_string(buf_, e.refusal);
        buf_ += "\"},\"finish_reason\":null}]}\n\n";
        flush();
      }
      return;
    }
    open();
    buf_.assign("data: ");
    buf_.append(e.data.data(), e.data.size());
    buf_ += "\n\n";
    flush();
  }
  // The finish_reason the upstream's stream ended with ("stop", "length",
  // "tool_calls", "content_filter"); empty when it gave none.
  [[nodiscard]] const std::string& finish_reason() const noexcept { return finish_reason_; }

  // The role chunk, if no token sent it (an answer without content).
  void open() {
    if (sink_ == nullptr || opened_ || failed_.load(std::memory_order_relaxed)) return;
    opened_ = true;
    event(R"({"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}])");
  }

  // A chunk of this stream: its choices and the fields after them
  // (`{"index":0,...}],"usage":...`).
  void event(std::string_view choices_and_rest) {
    if (sink_ == nullptr || failed_.load(std::memory_order_relaxed)) return;
    buf_.assign("data: ");
    buf_ += head_;
    buf_ += choices_and_rest;
    buf_ += "}\n\n";
    flush();
  }
  void done() {
    if (sink_ == nullptr || failed_.load(std::memory_order_relaxed)) return;
    buf_.assign("data: [DONE]\n\n");
    flush();
  }
  // The error event a partial answer ends with.
  void fail(std::string_view error_object) {
    if (sink_ == nullptr || failed_.load(std::memory_order_relaxed)) return;
    buf_.assign("data: ");
    buf_ += error_object;
    buf_ += "\n\ndata: [DONE]\n\n";
    flush();
  }

  [[nodiscard]] bool opened() const noexcept { return opened_; }
  [[nodiscard]] bool client_lost() const noexcept { return failed_.load(std::memory_order_relaxed); }

 private:
  void flush() {
    if (!sink_->send(buf_)) {
      // The client went away: stop the stream upstream, now.
      failed_.store(true, std::memory_order_relaxed);
      stop_->request_stop();
    }
  }

  chat_sink* sink_;
  std::stop_source* stop_;
  std::string head_;  // the chunk up to its choices: id, object, created, model
  std::string buf_;
  std::string finish_reason_;
  bool opened_ = false;
  std::atomic<bool> failed_{false};
};

// token_stream's OnToken: a pointer, so one pipeline type serves every
// request; it takes each event whole, so a relay forwards what it got.
struct relay_token {
  chat_relay* relay;
  void operator()(const keel::stream_event& e) const { relay->on_event(e); }
};

// The provider of a stream attempt: the model upstream asked the request's
// prompt. A first-token hedge (keel::attempt::hedge) goes to `hedge_to`,
// the model's next deployment, when there is one: racing the deployment
// that is slow to its first token would mostly race its slowness. A
// continuation asks only for what the client's token cap leaves after the
// `shown` tokens.
struct chat_model_call {
  model_upstream* provider;
  model_upstream* hedge_to = nullptr;  // null: a hedge asks `provider` again
  std::int64_t shown = 0;              // tokens already shown (a continuation)

  absl::Status operator()(const keel::attempt& a, keel::stream_writer& w) const {
    const chat_call* rq = a.owner != nullptr ? a.owner->request<chat_call>() : nullptr;
    if (rq == nullptr) return absl::InvalidArgumentError("chat_model_call: the call carries no chat request");
    model_upstream* to = a.hedge > 0 && hedge_to != nullptr ? hedge_to : provider;
    const std::int64_t left = std::max<std::int64_t>(1, rq->body.max_tokens - shown);
    return to->stream(a, w, rq->body.prompt, static_cast<int>(left), &rq->body.upstream_request);
  }
};

}  // namespace gateway
