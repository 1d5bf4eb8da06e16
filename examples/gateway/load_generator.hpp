// gateway/load_generator.hpp — drives the gateway over HTTP through phases
// and reports, per phase and work class, what users saw.
//
// Arrivals are open-loop (Poisson at each phase's rate): a slow service does
// not slow the arrivals down, exactly as with real users, so overload shows
// up as rejections and latency rather than as a politely smaller load. A
// pool of client threads, each with its own keep-alive connection, sends
// them.
//
// Interactive requests come from a few tenants (plus "noisy", which exceeds
// its quota on purpose); a share of them repeat an earlier request with the
// same Idempotency-Key, as a client retrying after a lost response would.
// Batch submissions carry fresh keys (and some repeats too). Chat streams
// (POST /v1/chat/completions, "stream": true) are read as they come with
// keel's SSE parser: time to first token is measured at the client, from
// the send to the first content token.
//
// Every response is classified from the client's side:
//
//   ok         200/202 with a full answer (or an accepted job)
//   degraded   200 with "degraded": true (a fallback answered, and said so)
//   rejected   refused before any work, with the limit named (refused_by):
//              429 / 503 from quotas, bulkheads, shedding, a full queue;
//              409 for a duplicate still in flight
//   failed     anything else: 5xx without a refusal, a transport error
//
// and its latency is measured from the moment the request was sent to the
// moment the whole response was read. A stream is one of
//
//   complete   every token, from the model asked
//   continued  cut or stalled after its first token, finished on the second model
//   failover   the first model failed before its first token; the second answered
//   partial    ended early after its first token (an error event), not continued
//   rejected   refused before any token, the limit named (as above)
//   failed     anything else: an error before the first token, no [DONE]
//
// Example:
//
//   gateway::load_generator load({.port = port});
//   std::vector<gateway::phase_report> r = load.run({
//       {.name = "normal", .length = std::chrono::seconds(8), .interactive_rate = 20, .batch_rate = 8},
//       {.name = "outage", .length = std::chrono::seconds(8), .interactive_rate = 20, .batch_rate = 8,
//        .on_start = [&] { load.post("/admin/fault", R"({"kind":"outage"})"); }}});
//
// Thread-safety: run() from one thread; post()/get() from any thread.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "keel/core/clock.hpp"
#include "keel/provider/sse.hpp"
#include "text.hpp"

namespace gateway {

struct phase {
  std::string name;
  keel::duration length = std::chrono::seconds(5);
  double interactive_rate = 20;  // requests per second
  double batch_rate = 5;         // submissions per second
  double stream_rate = 0;        // chat streams per second
  std::function<void()> on_start{};  // at the start of the phase (switch a fault, shed a class)
  std::function<void()> on_end{};    // when its arrivals end (take a snapshot)
};

struct load_options {
  std::string host = "127.0.0.1";
  int port = 0;
  int clients = 64;  // concurrent connections
  std::vector<std::string> tenants{"acme", "globex", "initech", "umbrella"};
  double noisy_share = 0.1;       // interactive requests from the tenant "noisy" (over its quota)
  double duplicate_share = 0.05;  // requests that repeat an earlier one with the same key
  std::string model = "feedback-large";
  // Each tenant's API key, sent as "Authorization: Bearer" (a gateway
  // configured with [clients] refuses requests without one); a tenant
  // missing here sends none.
  std::map<std::string, std::string, std::less<>> api_keys{};
  int stream_max_tokens = 40;  // each chat stream asks for this many tokens
  keel::duration client_timeout = std::chrono::seconds(10);
  std::uint64_t seed = 7;
};

enum class verdict { ok, degraded, rejected, failed };
enum class stream_verdict { complete, continued, failover, partial, rejected, failed };

// One response as the client saw it.
struct sample {
  std::size_t phase = 0;
  bool interactive = true;
  int status = 0;  // 0: transport error
  verdict what = verdict::failed;
  keel::duration latency{};
  keel::duration deadline{};  // what the service promised (interactive), from its reply
  std::optional<keel::duration> elapsed{};  // the service's own time for the request, from its reply
  std::string refused_by{};
  std::string served_by{};
  std::string decision_id{};
  std::string key{};
  std::string tenant{};
  bool replayed = false;
  bool retry_after = false;  // the reply carried a Retry-After header
  std::int64_t job_id = 0;
  // A chat stream (interactive is false):
  bool stream = false;
  stream_verdict stream_what = stream_verdict::failed;
  std::optional<keel::duration> ttft{};  // send to the first content token
  std::int64_t tokens = 0;
  bool hedged = false;
};

struct class_summary {
  std::int64_t requests = 0, ok = 0, degraded = 0, rejected = 0, failed = 0;
  keel::duration p50{}, p99{}, max{};     // of answered requests (ok and degraded)
  keel::duration rejection_max{};         // how long the slowest rejection took
};

struct stream_summary {
  std::int64_t requests = 0, complete = 0, continued = 0, failover = 0, partial = 0, rejected = 0, failed = 0;
  std::int64_t hedged = 0;     // won by the first-token hedge
  keel::duration ttft_p50{}, ttft_p99{};  // of streams that showed a token
  keel::duration p50{}, p99{};            // first byte sent to [DONE], of answered streams
};

struct phase_report {
  std::string name;
  class_summary interactive, batch;
  stream_summary streams;
};

[[nodiscard]] inline keel::duration nearest_rank(std::vector<keel::duration> v, double q) {
  if (v.empty()) return {};
  std::sort(v.begin(), v.end());
  const auto rank = static_cast<std::size_t>(std::ceil(q * static_cast<double>(v.size())));
  return v[std::clamp<std::size_t>(rank, 1, v.size()) - 1];
}

class load_generator {
 public:
  explicit load_generator(load_options o) : o_(std::move(o)), rng_(o_.seed) {}

  // Runs the phases back to back, then waits for the last responses.
  std::vector<phase_report> run(const std::vector<phase>& phases) {
    {
      std::lock_guard lock(mu_);
      samples_.clear();
      done_ = false;
    }
    std::vector<std::thread> clients;
    for (int i = 0; i < o_.clients; ++i) clients.emplace_back([this] { client_loop(); });
    for (std::size_t p = 0; p < phases.size(); ++p) {
      if (phases[p].on_start) phases[p].on_start();
      dispatch(p, phases[p]);
      if (phases[p].on_end) phases[p].on_end();
    }
    {
      std::lock_guard lock(mu_);
      done_ = true;
    }
    ready_.notify_all();
    for (std::thread& t : clients) t.join();
    return summarize(phases);
  }

  // Every response of the last run.
  [[nodiscard]] std::vector<sample> samples() const {
    std::lock_guard lock(mu_);
    return samples_;
  }

  // Requests the generator could not send on time because every client was busy.
  [[nodiscard]] std::int64_t late_sends() const noexcept { return late_.load(std::memory_order_relaxed); }

  // One-off calls (an operator switching a fault): the status, 0 on a transport error.
  int post(const std::string& path, const std::string& body) {
    httplib::Client c(o_.host, o_.port);
    c.set_read_timeout(std::chrono::seconds(5));
    httplib::Result r = c.Post(path.c_str(), body, "application/json");
    return r ? r->status : 0;
  }
  std::optional<std::string> get(const std::string& path) {
    httplib::Client c(o_.host, o_.port);
    c.set_read_timeout(std::chrono::seconds(5));
    httplib::Result r = c.Get(path.c_str());
    if (!r || r->status != 200) return std::nullopt;
    return r->body;
  }

 private:
  struct task {
    std::size_t phase = 0;
    bool interactive = true;
    bool stream = false;
    std::string key, body, tenant;
    std::string authorization{};  // "Bearer <key>", or empty
    std::chrono::steady_clock::time_point due{};
  };

  void dispatch(std::size_t p, const phase& ph) {
    using clock = std::chrono::steady_clock;
    const clock::time_point start = clock::now(), end = start + ph.length;
    auto next_after = [&](clock::time_point t, double rate) {
      if (rate <= 0) return clock::time_point::max();
      std::exponential_distribution<double> gap(rate);
      return t + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(gap(rng_)));
    };
    clock::time_point next_i = next_after(start, ph.interactive_rate), next_b = next_after(start, ph.batch_rate),
                      next_s = next_after(start, ph.stream_rate);
    for (;;) {
      const clock::time_point at = std::min({next_i, next_b, next_s});
      if (at >= end) break;
      std::this_thread::sleep_until(at);
      task t = at == next_i ? make_interactive(p) : at == next_b ? make_batch(p) : make_stream(p);
      t.due = at;
      {
        std::lock_guard lock(mu_);
        if (static_cast<int>(queue_.size()) >= o_.clients) late_.fetch_add(1, std::memory_order_relaxed);
        queue_.push_back(std::move(t));
      }
      ready_.notify_one();
      if (at == next_i) {
        next_i = next_after(at, ph.interactive_rate);
      } else if (at == next_b) {
        next_b = next_after(at, ph.batch_rate);
      } else {
        next_s = next_after(at, ph.stream_rate);
      }
    }
    std::this_thread::sleep_until(end);
  }

  task make_interactive(std::size_t p) {
    std::uniform_real_distribution<double> u(0, 1);
    if (!sent_interactive_.empty() && u(rng_) < o_.duplicate_share) {
      task t = sent_interactive_[std::uniform_int_distribution<std::size_t>(0, sent_interactive_.size() - 1)(rng_)];
      t.phase = p;
      return t;
    }
    static constexpr const char* questions[] = {"q-design-cache", "q-rate-limit", "q-idempotency", "q-timeouts"};
    static constexpr const char* answers[] = {
        "I would bound memory and pick an eviction policy",
        "A token bucket per tenant that returns retry-after",
        "The client key scoped to tenant with a digest of the body so the decision replays",
        "One end-to-end deadline; stages get what remains and a response reserve is kept"};
    const std::size_t q = std::uniform_int_distribution<std::size_t>(0, 3)(rng_);
    const std::string tenant = u(rng_) < o_.noisy_share
                                   ? std::string("noisy")
                                   : o_.tenants[std::uniform_int_distribution<std::size_t>(0, o_.tenants.size() - 1)(rng_)];
    nlohmann::json body = {{"tenant", tenant},
                           {"question_id", questions[q]},
                           {"answer", cat(answers[q], " (attempt ", ++counter_, ")")},
                           {"model", o_.model}};
    task t{.phase = p, .interactive = true, .key = cat("fb-", o_.seed, "-", counter_), .body = body.dump(),
           .tenant = tenant};
    sent_interactive_.push_back(t);
    return t;
  }

  task make_batch(std::size_t p) {
    std::uniform_real_distribution<double> u(0, 1);
    if (!sent_batch_.empty() && u(rng_) < o_.duplicate_share) {
      task t = sent_batch_[std::uniform_int_distribution<std::size_t>(0, sent_batch_.size() - 1)(rng_)];
      t.phase = p;
      return t;
    }
    const std::string tenant = o_.tenants[std::uniform_int_distribution<std::size_t>(0, o_.tenants.size() - 1)(rng_)];
    nlohmann::json body = {{"tenant", tenant},
                           {"learner", cat("learner-", ++counter_)},
                           {"model", o_.model},
                           {"sessions", {"mock interview: caching", "mock interview: rate limits", "review"}}};
    task t{.phase = p, .interactive = false, .key = cat("job-", o_.seed, "-", counter_), .body = body.dump(),
           .tenant = tenant};
    sent_batch_.push_back(t);
    return t;
  }

  task make_stream(std::size_t p) {
    static constexpr const char* prompts[] = {
        "How should a stream's deadline be split between its first token and the rest?",
        "What does a gateway owe a client whose stream was cut after 600 tokens?",
        "When is it safe to retry a chat completion?"};
    const std::string tenant = o_.tenants[std::uniform_int_distribution<std::size_t>(0, o_.tenants.size() - 1)(rng_)];
    const char* prompt = prompts[std::uniform_int_distribution<std::size_t>(0, 2)(rng_)];
    nlohmann::json body = {{"tenant", tenant},
                           {"model", o_.model},
                           {"messages", {{{"role", "user"}, {"content", cat(prompt, " (", ++counter_, ")")}}}},
                           {"max_tokens", o_.stream_max_tokens},
                           {"stream", true}};
    return task{.phase = p, .interactive = false, .stream = true, .key = {}, .body = body.dump(), .tenant = tenant};
  }

  // One chat stream, read as it arrives.
  static sample run_stream(httplib::Client& c, const task& t) {
    sample s{.phase = t.phase, .interactive = false, .tenant = t.tenant, .stream = true};
    keel::sse_parser parser;
    std::string raw;  // an error reply's body (and the first bytes of a stream)
    bool done = false, saw_error = false;
    nlohmann::json view;  // the gateway's "keel" object, from the last chunk
    const auto sent = std::chrono::steady_clock::now();
    auto on = [&](const keel::chat_chunk& ch) {
      if (ch.kind == keel::chunk_kind::content) {
        if (!s.ttft) s.ttft = std::chrono::steady_clock::now() - sent;
        ++s.tokens;
      } else if (ch.kind == keel::chunk_kind::done) {
        done = true;
      } else if (ch.kind == keel::chunk_kind::error || ch.kind == keel::chunk_kind::usage) {
        saw_error = saw_error || ch.kind == keel::chunk_kind::error;
        const nlohmann::json j = nlohmann::json::parse(ch.data, nullptr, false);
        if (j.is_object() && j.contains("keel")) view = j["keel"];
      }
      return true;
    };
    bool stream_ok = true;
    httplib::Request req;
    req.method = "POST";
    req.path = "/v1/chat/completions";
    req.headers = {{"Content-Type", "application/json"}, {"Accept", "text/event-stream"}};
    if (!t.authorization.empty()) req.headers.emplace("Authorization", t.authorization);
    req.body = t.body;
    req.content_receiver = [&](const char* data, std::size_t n, std::uint64_t, std::uint64_t) {
      if (raw.size() < 64 * 1024) raw.append(data, n);
      if (stream_ok) stream_ok = parser.feed(std::string_view(data, n), on).ok();
      return true;
    };
    httplib::Response res;
    httplib::Error error = httplib::Error::Success;
    const bool got = c.send(req, res, error);
    s.latency = std::chrono::steady_clock::now() - sent;
    if (!got) return s;  // a transport error: failed
    s.status = res.status;
    if (res.status != 200) {
      httplib::Response as_reply = res;
      as_reply.body = raw;
      classify(as_reply, s);
      s.stream_what = s.what == verdict::rejected ? stream_verdict::rejected : stream_verdict::failed;
      return s;
    }
    s.hedged = view.is_object() && view.value("hedged", false);
    if (!done || !view.is_object() || !stream_ok) return s;  // cut without [DONE]: failed
    if (saw_error) {
      s.stream_what = s.tokens > 0 ? stream_verdict::partial : stream_verdict::failed;
    } else if (view.value("failed_over", false)) {
      s.stream_what = stream_verdict::failover;
    } else if (view.value("continuations", 0) > 0) {
      s.stream_what = stream_verdict::continued;
    } else {
      s.stream_what = stream_verdict::complete;
    }
    return s;
  }

  void client_loop() {
    httplib::Client c(o_.host, o_.port);
    c.set_keep_alive(true);
    c.set_connection_timeout(std::chrono::seconds(2));
    c.set_read_timeout(o_.client_timeout);
    c.set_write_timeout(std::chrono::seconds(2));
    for (;;) {
      task t;
      {
        std::unique_lock lock(mu_);
        ready_.wait(lock, [&] { return done_ || !queue_.empty(); });
        if (queue_.empty()) return;
        t = std::move(queue_.front());
        queue_.pop_front();
      }
      if (const auto k = o_.api_keys.find(t.tenant); k != o_.api_keys.end()) t.authorization = cat("Bearer ", k->second);
      if (t.stream) {
        sample s = run_stream(c, t);
        std::lock_guard lock(mu_);
        samples_.push_back(std::move(s));
        continue;
      }
      httplib::Headers headers = {{"Idempotency-Key", t.key}};
      if (!t.authorization.empty()) headers.emplace("Authorization", t.authorization);
      const auto sent = std::chrono::steady_clock::now();
      httplib::Result r = c.Post(t.interactive ? "/v1/feedback" : "/v1/batch", headers, t.body, "application/json");
      const auto got = std::chrono::steady_clock::now();
      sample s{.phase = t.phase, .interactive = t.interactive, .latency = got - sent, .key = t.key, .tenant = t.tenant};
      if (r) classify(*r, s);
      std::lock_guard lock(mu_);
      samples_.push_back(std::move(s));
    }
  }

  static void classify(const httplib::Response& r, sample& s) {
    s.status = r.status;
    s.retry_after = r.has_header("Retry-After");
    const nlohmann::json j = nlohmann::json::parse(r.body, nullptr, false);
    if (j.is_object() && j.contains("error") && j["error"].is_object()) {
      const nlohmann::json& e = j["error"];
      if (e.contains("refused_by") && e["refused_by"].is_string()) s.refused_by = e["refused_by"].get<std::string>();
      const bool in_flight = e.value("condition", std::string()) == "in_flight";
      s.what = (!s.refused_by.empty() && (r.status == 429 || r.status == 503)) || in_flight ? verdict::rejected
                                                                                           : verdict::failed;
      return;
    }
    if ((r.status == 200 || r.status == 202) && j.is_object()) {
      s.what = j.value("degraded", false) ? verdict::degraded : verdict::ok;
      s.replayed = j.value("replayed", false);
      if (j.contains("served_by") && j["served_by"].is_string()) s.served_by = j["served_by"].get<std::string>();
      if (j.contains("decision_id") && j["decision_id"].is_string())
        s.decision_id = j["decision_id"].get<std::string>();
      if (j.contains("deadline_ms") && j["deadline_ms"].is_number_integer())
        s.deadline = std::chrono::milliseconds(j["deadline_ms"].get<std::int64_t>());
      if (j.contains("elapsed_ms") && j["elapsed_ms"].is_number_integer())
        s.elapsed = std::chrono::milliseconds(j["elapsed_ms"].get<std::int64_t>());
      if (j.contains("job_id") && j["job_id"].is_number_integer()) s.job_id = j["job_id"].get<std::int64_t>();
      return;
    }
    s.what = verdict::failed;
  }

  std::vector<phase_report> summarize(const std::vector<phase>& phases) const {
    std::vector<phase_report> out(phases.size());
    std::vector<std::vector<keel::duration>> answered(phases.size() * 2);
    std::lock_guard lock(mu_);
    for (std::size_t p = 0; p < phases.size(); ++p) out[p].name = phases[p].name;
    std::vector<std::vector<keel::duration>> ttfts(phases.size()), streamed(phases.size());
    for (const sample& s : samples_) {
      if (s.stream) {
        stream_summary& st = out[s.phase].streams;
        ++st.requests;
        switch (s.stream_what) {
          case stream_verdict::complete: ++st.complete; break;
          case stream_verdict::continued: ++st.continued; break;
          case stream_verdict::failover: ++st.failover; break;
          case stream_verdict::partial: ++st.partial; break;
          case stream_verdict::rejected: ++st.rejected; break;
          case stream_verdict::failed: ++st.failed; break;
        }
        st.hedged += s.hedged ? 1 : 0;
        if (s.ttft) ttfts[s.phase].push_back(*s.ttft);
        if (s.stream_what <= stream_verdict::failover) streamed[s.phase].push_back(s.latency);
        continue;
      }
      class_summary& c = s.interactive ? out[s.phase].interactive : out[s.phase].batch;
      ++c.requests;
      switch (s.what) {
        case verdict::ok: ++c.ok; break;
        case verdict::degraded: ++c.degraded; break;
        case verdict::rejected:
          ++c.rejected;
          c.rejection_max = std::max(c.rejection_max, s.latency);
          break;
        case verdict::failed: ++c.failed; break;
      }
      if (s.what == verdict::ok || s.what == verdict::degraded) {
        answered[s.phase * 2 + (s.interactive ? 0 : 1)].push_back(s.latency);
        c.max = std::max(c.max, s.latency);
      }
    }
    for (std::size_t p = 0; p < phases.size(); ++p) {
      stream_summary& st = out[p].streams;
      st.ttft_p50 = nearest_rank(ttfts[p], 0.5);
      st.ttft_p99 = nearest_rank(ttfts[p], 0.99);
      st.p50 = nearest_rank(streamed[p], 0.5);
      st.p99 = nearest_rank(streamed[p], 0.99);
      for (int k = 0; k < 2; ++k) {
        class_summary& c = k == 0 ? out[p].interactive : out[p].batch;
        c.p50 = nearest_rank(answered[p * 2 + k], 0.5);
        c.p99 = nearest_rank(answered[p * 2 + k], 0.99);
      }
    }
    return out;
  }

  load_options o_;
  std::mt19937_64 rng_;            // dispatcher thread only
  std::int64_t counter_ = 0;       // dispatcher thread only
  std::vector<task> sent_interactive_, sent_batch_;  // dispatcher thread only
  mutable std::mutex mu_;
  std::condition_variable ready_;
  std::deque<task> queue_;         // guarded by mu_
  std::vector<sample> samples_;    // guarded by mu_
  bool done_ = false;              // guarded by mu_
  std::atomic<std::int64_t> late_{0};
};

}  // namespace gateway
