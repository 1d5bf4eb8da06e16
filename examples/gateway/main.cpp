// gateway: the seed service end to end. Starts the interview-feedback
// gateway on loopback, drives it through four phases — normal, a provider
// slowdown, an outage, recovery — and prints what users saw per phase and
// class: requests, full answers, degraded answers, rejections, failures,
// p50/p99, and the error budget left; then, for the chat streams that run
// alongside, time to first token p50/p99 and how each stream ended
// (complete, continued on the second model, failed over, partial). Then
// stops the service.
//
//   gateway --demo FILE          the demo (about 35 s) against the model servers FILE names
//                                (scripts/demo starts two mock upstreams and passes
//                                config/demo.toml); faults go to the primary's /control/fault
//   gateway                      the same demo with the model simulated in-process
//   gateway --config FILE        serve as FILE says (listen address, upstreams, models, clients)
//                                SIGHUP reads FILE again: new requests get its plan, requests in
//                                flight finish on theirs, a bad file is refused (docs/gateway.md)
//   gateway --check-config FILE  validate FILE and exit (0: ok, 2: the error, naming line and field)
//   gateway --serve PORT [DIR]   serve on 127.0.0.1:PORT (0-65535; 0: a free one) until Ctrl-C
//                                (data in DIR, or a temporary one), the model simulated in-process
//   ... --redis HOST:PORT        share the provider's concurrency limit and state with other replicas
//                                through that Redis (gateway/fleet.hpp)
//   gateway --work DIR           a batch worker process for a gateway serving DIR, until Ctrl-C
//
// docs/gateway.md explains the endpoints and how the policies compose.
#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <httplib.h>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

#include "config.hpp"
#include "gateway_service.hpp"
#include "load_generator.hpp"

using namespace std::chrono_literals;

namespace {

long long ms(keel::duration d) { return std::chrono::duration_cast<std::chrono::milliseconds>(d).count(); }

struct temp_dir {
  temp_dir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "keel-gateway-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) {
      std::perror("mkdtemp");
      std::exit(1);
    }
    path = pattern;
  }
  ~temp_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string path;
};

// Breaker transitions as they happen, stamped with the demo's clock.
struct event_log {
  std::mutex mu;
  std::vector<std::pair<keel::time_point, std::string>> events;
  void add(std::string what) {
    std::lock_guard lock(mu);
    events.emplace_back(keel::real_clock{}.now(), std::move(what));
  }
};

volatile std::sig_atomic_t interrupted = 0;
volatile std::sig_atomic_t reload_requested = 0;

void on_signals() {
  std::signal(SIGINT, [](int) { interrupted = 1; });
  std::signal(SIGTERM, [](int) { interrupted = 1; });
}

// Gives the C library's free heap back to the system every 10 s when more
// than 8 MiB of it is free. glibc's malloc keeps what a burst freed: a
// thread's arena returns memory only from its top, so one live allocation
// above a freed run pins the run, across up to 8 arenas per core. 96
// concurrent 64 KB request bodies left 78 MB of heap holding 4 MB in use,
// RSS 96 MB where it had been 25, for as long as the process ran;
// malloc_trim(0) brought it back to 30 MB (docs/reliability.md, "The soak,
// open loop"). Checking costs a walk of the free lists, trimming a madvise
// per free page run: nothing at 10 s intervals.
class heap_trimmer {
 public:
  void tick() {
#if defined(__GLIBC__)
    const auto now = std::chrono::steady_clock::now();
    if (now < next_) return;
    next_ = now + 10s;
    if (::mallinfo2().fordblks > (std::size_t{8} << 20)) ::malloc_trim(0);
#endif
  }

 private:
  std::chrono::steady_clock::time_point next_ = std::chrono::steady_clock::now() + 10s;
};

// --redis host:port: replicas share the provider's concurrency and state (gateway/fleet.hpp).
std::string redis_flag;

int serve(int port, const char* data_dir) {
  temp_dir dir;
  gateway::gateway_options o;
  o.data_dir = data_dir != nullptr ? std::string(data_dir) : dir.path;
  o.fleet.redis = redis_flag;
  auto svc = gateway::service::open(o);
  if (!svc.ok()) {
    std::fprintf(stderr, "gateway: %s\n", std::string(svc.status().message()).c_str());
    return 1;
  }
  if (absl::Status s = (*svc)->start("127.0.0.1", port); !s.ok()) {
    std::fprintf(stderr, "gateway: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  std::printf("gateway serving on http://127.0.0.1:%d (data in %s); Ctrl-C stops it\n", (*svc)->port(),
              o.data_dir.c_str());
  std::fflush(stdout);  // at once, also into a pipe: whoever started it waits for this line
  on_signals();
  heap_trimmer trim;
  while (!interrupted) {
    std::this_thread::sleep_for(100ms);
    trim.tick();
  }
  (*svc)->stop();
  return 0;
}

// gateway --config FILE: the model calls go to the upstreams FILE names.
int serve_config(const char* path) {
  absl::StatusOr<gateway::gateway_config> cfg = gateway::load_config(path);
  if (!cfg.ok()) {
    std::fprintf(stderr, "gateway: %s\n", std::string(cfg.status().message()).c_str());
    return 2;
  }
  absl::StatusOr<gateway::gateway_options> o = gateway::with_upstreams(*cfg);
  if (!o.ok()) {
    std::fprintf(stderr, "gateway: %s: %s\n", path, std::string(o.status().message()).c_str());
    return 2;
  }
  if (!redis_flag.empty()) o->fleet.redis = redis_flag;
  const std::string listen = cfg->listen;
  // Before the serving line: whoever reads it may signal at once. SIGHUP
  // reads the file again; new requests get the new plan, requests in
  // flight finish on theirs, and a bad file leaves the plan as it was.
  on_signals();
  std::signal(SIGHUP, [](int) { reload_requested = 1; });
  auto svc = gateway::service::open(*o);
  if (!svc.ok()) {
    std::fprintf(stderr, "gateway: %s\n", std::string(svc.status().message()).c_str());
    return 1;
  }
  if (absl::Status s = (*svc)->start(cfg->listen_host, cfg->listen_port); !s.ok()) {
    std::fprintf(stderr, "gateway: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  std::printf("gateway serving on http://%s:%d (data in %s; model upstreams %s, %s); Ctrl-C stops it\n",
              cfg->listen_host.c_str(), (*svc)->port(), o->data_dir.c_str(), o->upstream->base_url.c_str(),
              o->upstream_backup ? o->upstream_backup->base_url.c_str() : "(no second)");
  std::fflush(stdout);
  heap_trimmer trim;
  while (!interrupted) {
    std::this_thread::sleep_for(50ms);
    trim.tick();
    if (!reload_requested) continue;
    reload_requested = 0;
    absl::StatusOr<gateway::gateway_config> next = gateway::load_config(path);
    absl::StatusOr<gateway::gateway_options> next_options =
        next.ok() ? gateway::with_upstreams(*next) : absl::StatusOr<gateway::gateway_options>(next.status());
    if (next_options.ok() && !redis_flag.empty()) next_options->fleet.redis = redis_flag;
    auto done = (*svc)->core().reload(std::move(next_options));
    if (!done.ok()) {
      std::fprintf(stderr, "gateway: reload refused, the plan serving stays: %s\n",
                   std::string(done.status().message()).c_str());
      continue;
    }
    if (next->listen != listen) done->kept_until_restart.push_back("gateway.listen");
    std::string kept;
    for (const std::string& f : done->kept_until_restart) absl::StrAppend(&kept, kept.empty() ? "" : ", ", f);
    std::printf("gateway: reloaded %s: plan %lld serves new requests%s%s%s\n", path,
                static_cast<long long>(done->generation), kept.empty() ? "" : " (kept until a restart: ",
                kept.c_str(), kept.empty() ? "" : ")");
    std::fflush(stdout);
  }
  (*svc)->stop();
  return 0;
}

int work(const char* data_dir) {
  gateway::gateway_options o;
  o.data_dir = data_dir;
  auto w = gateway::worker_process<keel::sqlite_job_store<>>::open(
      o, [](const std::string& path) { return keel::sqlite_job_store<>::open(path); });
  if (!w.ok()) {
    std::fprintf(stderr, "gateway: %s\n", std::string(w.status().message()).c_str());
    return 1;
  }
  (*w)->workers().start(o.batch_slots);
  std::printf("batch worker on %s (%d threads); Ctrl-C stops it\n", data_dir, o.batch_slots);
  on_signals();
  while (!interrupted) std::this_thread::sleep_for(100ms);
  (*w)->workers().stop();
  std::printf("ran %lld jobs\n", static_cast<long long>((*w)->workers().ran()));
  return 0;
}

}  // namespace

// The four phases against the gateway `o` describes; `fault` switches the
// provider's fault (a JSON body of /admin/fault, or of a mock upstream's
// /control/fault).
int demo(gateway::gateway_options o, const std::function<void(const char*)>& switch_fault,
         const std::map<std::string, std::string, std::less<>>& demo_keys = {}) {
  temp_dir dir;
  event_log log;
  o.data_dir = dir.path;
  if (!redis_flag.empty()) o.fleet.redis = redis_flag;
  o.batch_max_depth = 80;  // small enough that the outage's backlog meets it: rejections you can see
  o.breaker.on_state_change = [&log](const keel::breaker_transition& t) {
    log.add(gateway::cat("breaker ", keel::to_string(t.from), " -> ", keel::to_string(t.to)));
  };
  auto svc = gateway::service::open(o);
  if (!svc.ok()) {
    std::fprintf(stderr, "gateway: %s\n", std::string(svc.status().message()).c_str());
    return 1;
  }
  gateway::service& service = **svc;
  if (absl::Status s = service.start("127.0.0.1", 0); !s.ok()) {
    std::fprintf(stderr, "gateway: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  auto& core = service.core();
  const gateway::deadline_plan& plan = o.interactive;
  std::printf("keel gateway demo: interview feedback under a %lld ms deadline, batch reports in the background\n",
              ms(plan.deadline));
  std::printf("  serving on http://127.0.0.1:%d; data (SQLite) in %s\n", service.port(), dir.path.c_str());
  if (o.upstream) {
    std::printf("  model upstreams over HTTP: %s at %s (model %s), second %s at %s\n", o.upstream->name.c_str(),
                o.upstream->base_url.c_str(), o.upstream->model.c_str(), o.upstream_backup->name.c_str(),
                o.upstream_backup->base_url.c_str());
  }
  std::printf("  plan: admit %lld, retrieve %lld, model %lld, cancel %lld, fallback %lld, respond by %lld ms "
              "(%lld ms reserved)\n",
              ms(plan.admit), ms(plan.retrieve), ms(plan.model), ms(plan.cancel), ms(plan.fallback),
              ms(plan.respond_by()), ms(plan.response_reserve));
  std::printf("  bulkheads %d interactive / %d batch / %d recovery; breaker per provider: %d calls, %.0f%% failures, "
              "open %lld ms\n\n",
              o.interactive_slots, o.batch_slots, o.recovery_slots, o.breaker.minimum_calls,
              100 * o.breaker.failure_rate_threshold.value_or(0), ms(o.breaker.open_duration));

  const int load_tokens = 40;
  gateway::load_generator load({.port = service.port(),
                                .clients = 64,
                                .model = o.models.front().name,
                                .api_keys = demo_keys,
                                .stream_max_tokens = load_tokens});
  struct snapshot {
    keel::time_point at{};
    keel::slo_report interactive, full_answers, batch;
    keel::job_counts jobs;
    std::string jobs_error;  // the job store's error, when its counts could not be read
  };
  std::vector<snapshot> ends;
  const keel::time_point t0 = keel::real_clock{}.now();
  auto take_snapshot = [&] {
    snapshot s;
    s.at = keel::real_clock{}.now();
    s.interactive = core.slos().find("interactive")->report(s.at);
    s.full_answers = core.slos().find("interactive-full-answers")->report(s.at);
    s.batch = core.slos().find("batch")->report(s.at);
    if (absl::StatusOr<keel::job_counts> c = core.queue().counts(); c.ok()) {
      s.jobs = *c;
    } else {
      s.jobs_error = c.status().ToString();
    }
    ends.push_back(std::move(s));
  };
  auto fault = [&](const char* body, const char* what) {
    return [&switch_fault, &load, body, what] {
      std::printf("  %s\n", what);
      std::fflush(stdout);
      if (switch_fault) {
        switch_fault(body);
      } else {
        (void)load.post("/admin/fault", body);  // the in-process simulated provider
      }
    };
  };
  const double interactive_rate = 20, batch_rate = 8, stream_rate = 6;
  const std::vector<gateway::phase> phases = {
      {.name = "normal", .length = 8s, .interactive_rate = interactive_rate, .batch_rate = batch_rate,
       .stream_rate = stream_rate, .on_start = fault(R"({"kind":"none"})", "phase 1/4 normal: the provider answers in ~400 ms (p99 ~800 ms)"),
       .on_end = take_snapshot},
      {.name = "slowdown", .length = 8s, .interactive_rate = interactive_rate, .batch_rate = batch_rate,
       .stream_rate = stream_rate, .on_start = fault(R"({"kind":"slowdown","factor":3})", "phase 2/4 slowdown: the provider becomes 3x slower"),
       .on_end = take_snapshot},
      {.name = "outage", .length = 8s, .interactive_rate = interactive_rate, .batch_rate = batch_rate,
       .stream_rate = stream_rate, .on_start = fault(R"({"kind":"outage"})", "phase 3/4 outage: the provider answers 503 to everything (streams too; the second model is up)"),
       .on_end = take_snapshot},
      {.name = "recovery", .length = 8s, .interactive_rate = interactive_rate, .batch_rate = batch_rate,
       .stream_rate = stream_rate, .on_start = fault(R"({"kind":"none"})", "phase 4/4 recovery: the provider is healthy again"),
       .on_end = take_snapshot},
  };
  const std::vector<gateway::phase_report> reports = load.run(phases);
  // Let the workers finish what the recovery left queued, briefly.
  for (int i = 0; i < 30; ++i) {
    absl::StatusOr<keel::job_counts> c = core.queue().counts();
    if (!c.ok() || c->queued + c->running == 0) break;  // an error is printed with final_jobs
    std::this_thread::sleep_for(100ms);
  }
  const absl::StatusOr<keel::job_counts> final_jobs = core.queue().counts();
  const gateway::provider_figures pf = core.provider().figures();
  std::vector<std::pair<std::string, gateway::upstream_figures>> upstreams;
  for (const gateway::http_upstream* u : core.http_upstreams()) upstreams.emplace_back(u->name(), u->figures());
  const keel::stream_figures sg = core.stream_totals();
  service.stop();

  std::printf("\n%-9s %-11s %5s %5s %5s %5s %5s %7s %7s %8s  %s\n", "phase", "class", "reqs", "ok", "degr", "rej",
              "fail", "p50 ms", "p99 ms", "rej max", "error budget left (bad requests the SLO allows, since start)");
  auto budget = [](const char* what, const keel::slo_report& r) {
    const keel::error_budget& b = r.availability;
    if (b.remaining >= 0) return gateway::cat(what, " ", b.remaining, " of ", b.allowed, " left");
    return gateway::cat(what, " 0 of ", b.allowed, " left (", -b.remaining, " over)");
  };
  for (std::size_t p = 0; p < reports.size(); ++p) {
    const gateway::phase_report& r = reports[p];
    auto row = [&](const char* phase_name, const char* cls, const gateway::class_summary& c, const std::string& b) {
      std::printf("%-9s %-11s %5lld %5lld %5lld %5lld %5lld %7lld %7lld %8lld  %s\n", phase_name, cls,
                  static_cast<long long>(c.requests), static_cast<long long>(c.ok),
                  static_cast<long long>(c.degraded), static_cast<long long>(c.rejected),
                  static_cast<long long>(c.failed), ms(c.p50), ms(c.p99), ms(c.rejection_max), b.c_str());
    };
    row(r.name.c_str(), "interactive", r.interactive,
        budget("availability", ends[p].interactive) + "; full answers" +
            budget("", ends[p].full_answers));
    row("", "batch", r.batch, budget("reports", ends[p].batch));
    const std::int64_t done_before = p == 0 ? 0 : ends[p - 1].jobs.done;
    std::printf("%-9s %-11s jobs done %lld, waiting %lld, running %lld", "", "",
                static_cast<long long>(ends[p].jobs.done - done_before), static_cast<long long>(ends[p].jobs.queued),
                static_cast<long long>(ends[p].jobs.running));
    if (!ends[p].jobs_error.empty()) std::printf(" (job counts unreadable: %s)", ends[p].jobs_error.c_str());
    std::lock_guard lock(log.mu);
    const keel::time_point from = p == 0 ? t0 : ends[p - 1].at;
    for (const auto& [at, what] : log.events) {
      if (at >= from && at < ends[p].at) std::printf("; %s at +%.1f s", what.c_str(), ms(at - t0) / 1000.0);
    }
    std::printf("\n");
  }
  if (!upstreams.empty()) std::printf("\nmodel calls sent over HTTP, per deployment (upstream/model):\n");
  for (const auto& [name, f] : upstreams) {
    std::printf("  %-22s %5lld sent, %5lld answered, %5lld failed or stopped\n", name.c_str(),
                static_cast<long long>(f.calls), static_cast<long long>(f.answered), static_cast<long long>(f.failed));
  }
  if (o.upstream) {
    if (final_jobs.ok()) {
      std::printf("\nbatch after the run: %lld done, %lld failed, %lld still queued\n",
                  static_cast<long long>(final_jobs->done), static_cast<long long>(final_jobs->failed),
                  static_cast<long long>(final_jobs->queued + final_jobs->running));
    } else {
      std::printf("\nbatch after the run: the job store's counts could not be read: %s\n",
                  final_jobs.status().ToString().c_str());
    }
  } else if (final_jobs.ok()) {
    std::printf("\nbatch after the run: %lld done, %lld failed, %lld still queued; the provider abandoned %lld "
                "timed-out attempts\n",
                static_cast<long long>(final_jobs->done), static_cast<long long>(final_jobs->failed),
                static_cast<long long>(final_jobs->queued + final_jobs->running), static_cast<long long>(pf.abandoned));
  } else {
    std::printf("\nbatch after the run: the job store's counts could not be read: %s; the provider abandoned %lld "
                "timed-out attempts\n",
                final_jobs.status().ToString().c_str(), static_cast<long long>(pf.abandoned));
  }
  std::printf("\nstreams: POST /v1/chat/completions with \"stream\": true, %d tokens each; first token within %lld ms "
              "per attempt,\n  stall %lld ms, first-token hedge at the learned p%.0f; second model %s\n",
              load_tokens, ms(o.chat.first_token), ms(o.chat.stall), 100 * o.chat.hedge_percentile,
              o.upstream_backup ? o.upstream_backup->name.c_str() : o.chat.backup.name.c_str());
  std::printf("%-9s %5s %8s %9s %8s %7s %5s %5s %6s %9s %9s %7s %7s\n", "phase", "reqs", "complete", "continued",
              "failover", "partial", "rej", "fail", "hedged", "ttft p50", "ttft p99", "p50 ms", "p99 ms");
  for (const gateway::phase_report& r : reports) {
    const gateway::stream_summary& st = r.streams;
    std::printf("%-9s %5lld %8lld %9lld %8lld %7lld %5lld %5lld %6lld %9lld %9lld %7lld %7lld\n", r.name.c_str(),
                static_cast<long long>(st.requests), static_cast<long long>(st.complete),
                static_cast<long long>(st.continued), static_cast<long long>(st.failover),
                static_cast<long long>(st.partial), static_cast<long long>(st.rejected),
                static_cast<long long>(st.failed), static_cast<long long>(st.hedged), ms(st.ttft_p50), ms(st.ttft_p99),
                ms(st.p50), ms(st.p99));
  }
  std::printf("stream guard: %lld attempts, %lld first-token timeouts, %lld stalls, %lld cut mid-stream, %lld hedges "
              "started (%lld won), %lld continuations\n",
              static_cast<long long>(sg.attempts), static_cast<long long>(sg.first_token_timeouts),
              static_cast<long long>(sg.stalls), static_cast<long long>(sg.mid_stream_failures),
              static_cast<long long>(sg.hedges_started), static_cast<long long>(sg.hedge_wins),
              static_cast<long long>(sg.continuations));
  std::printf(
      "\nwhat to read: interactive p99 stays under the %lld ms deadline in every phase. The slowdown and the\n"
      "outage turn full answers into degraded ones (rubric feedback, marked degraded, not recorded) instead of\n"
      "errors: availability holds while the full-answer budget pays for it. The breaker opens and answers fast,\n"
      "probes, and closes in recovery. Batch work waits out the outage in the durable queue (refused, visibly,\n"
      "only when the queue is full) and drains afterwards. Tenant \"noisy\" is held to its own quota (429).\n"
      "Streams: nothing is sent before the first token, so in the outage each stream fails over to the second\n"
      "model before its client sees a byte (\"failover\", marked degraded); a stream cut after its first token is\n"
      "finished there (\"continued\"); the hedge races a second stream when the first token is late.\n",
      ms(plan.deadline));
  if (load.late_sends() > 0) {
    std::printf("(the load generator sent %lld requests late: every client was busy)\n",
                static_cast<long long>(load.late_sends()));
  }
  return 0;
}

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--check-config") {
    const absl::StatusOr<gateway::gateway_config> cfg = gateway::load_config(argv[2]);
    if (!cfg.ok()) {
      std::fprintf(stderr, "%s\n", std::string(cfg.status().message()).c_str());
      return 2;
    }
    std::printf("%s: ok (%zu upstreams, %zu models, %zu clients)\n", argv[2], cfg->upstreams.size(),
                cfg->models.size(), cfg->clients.size());
    return 0;
  }
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::string(argv[i]) == "--redis" && i + 1 < argc) {
      redis_flag = argv[++i];
      continue;
    }
    args.push_back(argv[i]);
  }
  args.push_back(nullptr);
  argc = static_cast<int>(args.size()) - 1;
  argv = args.data();
  if ((argc == 3 || argc == 4) && std::string(argv[1]) == "--serve") {
    const absl::StatusOr<int> port = gateway::parse_port(argv[2]);
    if (!port.ok()) {
      std::fprintf(stderr, "gateway: --serve PORT: %s\n", std::string(port.status().message()).c_str());
      return 2;
    }
    return serve(*port, argv[3]);
  }
  if (argc == 3 && std::string(argv[1]) == "--work") return work(argv[2]);
  if (argc == 3 && std::string(argv[1]) == "--config") return serve_config(argv[2]);
  if (argc == 3 && std::string(argv[1]) == "--demo") {
    absl::StatusOr<gateway::gateway_config> cfg = gateway::load_config(argv[2]);
    absl::StatusOr<gateway::gateway_options> o =
        cfg.ok() ? gateway::with_upstreams(*cfg) : absl::StatusOr<gateway::gateway_options>(cfg.status());
    if (!o.ok()) {
      std::fprintf(stderr, "gateway: %s\n", std::string(o.status().message()).c_str());
      return 2;
    }
    // A real upstream's faults are its own: the demo switches them on the mock's control endpoint.
    httplib::Client upstream(o->upstream->base_url);
    // The keys config/demo.toml knows (by their SHA-256), one per tenant the load generator plays.
    const std::map<std::string, std::string, std::less<>> keys = {{"acme", "demo-key-team-a"},
                                                                   {"noisy", "demo-key-team-b"},
                                                                   {"globex", "demo-key-globex"},
                                                                   {"initech", "demo-key-initech"},
                                                                   {"umbrella", "demo-key-umbrella"}};
    return demo(
        *o,
        [&upstream](const char* body) {
          const httplib::Result r = upstream.Post("/control/fault", body, "application/json");
          if (!r || r->status != 200) std::fprintf(stderr, "gateway demo: the upstream refused the fault %s\n", body);
        },
        keys);
  }
  if (argc == 1) return demo(gateway::gateway_options{}, {});
  std::fprintf(stderr,
               "usage: gateway [--redis HOST:PORT]                      the demo, the model simulated in-process\n"
               "       gateway --demo FILE                              the demo against the upstreams FILE names\n"
               "       gateway --config FILE [--redis HOST:PORT]        serve as FILE says\n"
               "       gateway --check-config FILE                      validate FILE\n"
               "       gateway --serve PORT [DIR] [--redis HOST:PORT]   serve, the model simulated in-process\n"
               "       gateway --work DIR                               a batch worker process\n");
  return 2;
}
