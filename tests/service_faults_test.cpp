// The example gateway with its store and its provider failing at once: its
// durable batch queue on the test run's real PostgreSQL server, the server
// killed and restarted while the simulated provider is out and requests
// keep coming. Every request must get an answer or a classified error, in
// time; every job queued before the faults must be done afterwards.
//
// Real clock (a real server restarts in real time); the time bounds are
// correctness bounds with keel_service::http_slack, not speed claims.
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "gateway_core.hpp"
#include "gateway_service.hpp"
#include "keel/store/postgres_jobs.hpp"
#include "support/catch.hpp"
#include "support/scaleout.hpp"
#include "support/service.hpp"

using namespace std::chrono_literals;
using json = nlohmann::json;

namespace {

using core_t = gateway::gateway_core<keel::real_clock, keel::postgres_job_store>;

// What the test accepts as a classified refusal: a JSON error naming a
// status a caller can act on (wait and retry, or give up), never a bare 500.
// A submission in flight when the server died is an unknown outcome: 503
// with condition "unknown_outcome" (retry with the same key to settle it).
bool classified(const gateway::reply& r, std::string& why) {
  const json j = json::parse(r.body, nullptr, false);
  if (j.is_discarded() || !j.contains("error")) {
    why = "no JSON error: " + r.body;
    return false;
  }
  const std::string status = j["error"].value("status", "");
  const bool unknown_outcome = status == "UNKNOWN" && j["error"].value("condition", "") == "unknown_outcome";
  const bool known = status == "UNAVAILABLE" || status == "DEADLINE_EXCEEDED" || status == "RESOURCE_EXHAUSTED" ||
                     status == "ABORTED" || unknown_outcome;
  if (!known || (r.status != 429 && r.status != 503 && r.status != 504)) {
    why = "HTTP " + std::to_string(r.status) + " " + r.body;
    return false;
  }
  return true;
}

struct verdicts {
  std::mutex mu;
  std::map<std::string, int> by_kind;  // "feedback 200", "batch 503", ...
  std::vector<std::string> wrong;      // replies that broke a rule, with why
  std::map<std::string, std::string> unknown;  // key -> body of a write with an unknown outcome
  void add(const std::string& what, const gateway::reply& r, keel::duration took, keel::duration bound,
           const std::string& key = {}, const std::string& body = {}) {
    std::string why;
    const bool ok = (r.status >= 200 && r.status < 300) || classified(r, why);
    std::lock_guard lock(mu);
    ++by_kind[what + " " + std::to_string(r.status)];
    if (r.body.find("unknown_outcome") != std::string::npos) unknown[key] = body;
    if (!ok) wrong.push_back(what + ": " + why);
    if (took > bound) {
      using std::chrono::duration_cast, std::chrono::milliseconds;
      wrong.push_back(what + " took " + std::to_string(duration_cast<milliseconds>(took).count()) +
                      " ms, over its bound of " + std::to_string(duration_cast<milliseconds>(bound).count()) + " ms");
    }
  }
};

}  // namespace

TEST_CASE("provider out while the job store's PostgreSQL restarts: every request answered in time, every queued job "
          "done afterwards",
          "[service][faults]") {
  keel_service::temp_dir dir;
  gateway::gateway_options o = keel_service::options(dir.path());
  o.batch_workers = 4;
  const keel::postgres_options pg{.conninfo = keel_scaleout::pg_conninfo(),
                                  .schema = keel_scaleout::fresh_name("gw_faults"),
                                  .pool_size = 8,
                                  .connect_timeout = 2s,
                                  .command_timeout = 1s,
                                  .acquire_timeout = 1s};
  auto opened = core_t::open(o, [&](const std::string&) { return keel::postgres_job_store::open(pg); });
  REQUIRE(opened.ok());
  std::unique_ptr<core_t> core = std::move(*opened);
  keel_scaleout::restart_guard server("postgres");

  // An interactive request answers within its deadline plan; a batch
  // submission within what the store may take to refuse (connect, acquire,
  // command), since the queue is all it waits on.
  const keel::duration interactive_bound = o.interactive.respond_by() + keel_service::http_slack;
  const keel::duration batch_bound =
      pg.connect_timeout + pg.acquire_timeout + pg.command_timeout + keel_service::http_slack;

  // The provider goes out first; jobs queued now wait in the durable queue.
  REQUIRE(core->provider().set_fault({.kind = gateway::fault_kind::outage}).ok());
  core->start_workers();
  std::vector<std::int64_t> queued;
  for (int i = 0; i < 8; ++i) {
    const std::string body = json{{"tenant", "t" + std::to_string(i % 2)},
                                  {"learner", "learner-" + std::to_string(i)},
                                  {"sessions", {"session one", "session two"}}}
                                 .dump();
    const gateway::reply r = core->batch_submit(body, "before-" + std::to_string(i));
    REQUIRE(r.status == 202);
    queued.push_back(json::parse(r.body).at("job_id").get<std::int64_t>());
  }

  // Requests keep coming while the server is killed and restarted.
  verdicts v;
  std::atomic<bool> done{false};
  std::atomic<int> seq{0};
  std::vector<std::thread> clients;
  for (int t = 0; t < 4; ++t) {
    clients.emplace_back([&, t] {
      while (!done.load()) {
        const int n = seq.fetch_add(1);
        const std::string tenant = "t" + std::to_string(n % 3);
        const keel::time_point t0 = keel::real_clock{}.now();
        if (t % 2 == 0) {
          const gateway::reply r = core->feedback(
              json{{"tenant", tenant}, {"question_id", "q-timeouts"}, {"answer", "one deadline for every stage"}}
                  .dump(),
              "during-" + std::to_string(n));
          v.add("feedback", r, keel::real_clock{}.now() - t0, interactive_bound);
        } else {
          const std::string body =
              json{{"tenant", tenant}, {"learner", "l" + std::to_string(n)}, {"sessions", {"one"}}}.dump();
          const std::string key = "during-" + std::to_string(n);
          const gateway::reply r = core->batch_submit(body, key);
          v.add("batch", r, keel::real_clock{}.now() - t0, batch_bound, key, body);
        }
        std::this_thread::sleep_for(20ms);  // pacing only: ~100 requests a second in all
      }
    });
  }
  std::this_thread::sleep_for(500ms);
  REQUIRE(server.kill());
  std::this_thread::sleep_for(1500ms);  // down while requests and workers run into it
  REQUIRE(server.restart());
  std::this_thread::sleep_for(1s);
  REQUIRE(core->provider().set_fault({.kind = gateway::fault_kind::none}).ok());
  std::this_thread::sleep_for(1s);
  done = true;
  for (std::thread& c : clients) c.join();

  {
    std::lock_guard lock(v.mu);
    std::string kinds;
    for (const auto& [k, n] : v.by_kind) kinds += k + ": " + std::to_string(n) + "; ";
    INFO("replies: " << kinds);
    for (const std::string& w : v.wrong) FAIL_CHECK(w);
    CHECK(v.wrong.empty());
    // The store's restart was seen: some batch submissions were refused.
    int refused_batches = 0, answered = 0;
    for (const auto& [k, n] : v.by_kind) {
      if (k.rfind("batch 5", 0) == 0) refused_batches += n;
      if (k == "feedback 200") answered += n;
    }
    CHECK(refused_batches > 0);
    CHECK(answered > 0);  // fallback answers through the outage, and model answers after
    // A submission whose outcome was unknown is settled by the same key:
    // the job if it landed (200), a new one if not (202), never a conflict.
    for (const auto& [key, body] : v.unknown) {
      const gateway::reply r = core->batch_submit(body, key);
      INFO("resubmitted " << key << ": " << r.body);
      CHECK((r.status == 200 || r.status == 202));
    }
  }

  // Every job queued before the faults finishes (bounded wait, real time).
  const auto end = std::chrono::steady_clock::now() + 60s;
  std::map<std::int64_t, std::string> state;
  for (;;) {
    bool all_done = true;
    for (std::size_t i = 0; i < queued.size(); ++i) {
      const gateway::reply r = core->batch_status(std::to_string(queued[i]), "t" + std::to_string(i % 2));
      const json j = json::parse(r.body, nullptr, false);
      state[queued[i]] = r.status == 200 ? j.value("state", "?") : "HTTP " + std::to_string(r.status);
      all_done = all_done && state[queued[i]] == "done";
    }
    if (all_done || std::chrono::steady_clock::now() > end) break;
    std::this_thread::sleep_for(100ms);
  }
  for (const auto& [id, s] : state) {
    INFO("job " << id);
    CHECK(s == "done");
  }
  core->shutdown();
}

// --- the gateway's own SQLite file -------------------------------------------

TEST_CASE("a damaged effects.db is refused at start, naming the file, and left as it was", "[service][faults]") {
  keel_service::temp_dir dir;
  const std::string path = dir.path() + "/effects.db";
  {
    absl::StatusOr<std::unique_ptr<gateway::effect_log>> log = gateway::effect_log::open(path);
    REQUIRE(log.ok());
    // Enough rows for dozens of pages; closing the last connection checkpoints the WAL into the file.
    for (int i = 0; i < 3000; ++i)
      REQUIRE((*log)->record_feedback("acme", "key-" + std::to_string(i), "decision-" + std::to_string(i)).ok());
  }
  const std::uintmax_t size = std::filesystem::file_size(path);
  REQUIRE(size > 20 * 4096);
  // Overwrites n bytes at `at` in place; true when they were written.
  auto damage = [&](std::uintmax_t at, std::size_t n) {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(at));
    const std::string junk(n, '\xa5');
    f.write(junk.data(), static_cast<std::streamsize>(junk.size()));
    return static_cast<bool>(f);
  };
  SECTION("a page in the middle") { REQUIRE(damage(10 * 4096, 4096)); }
  SECTION("the first page") { REQUIRE(damage(0, 100)); }
  const std::string before = keel_service::read_file(path);
  const absl::StatusOr<std::unique_ptr<gateway::effect_log>> again = gateway::effect_log::open(path);
  REQUIRE_FALSE(again.ok());
  INFO(again.status().ToString());
  CHECK(again.status().code() == absl::StatusCode::kDataLoss);
  CHECK(std::string(again.status().message()).find(path) != std::string::npos);
  // The gateway refuses to start on it, saying which file.
  gateway::gateway_options o = keel_service::options(dir.path());
  const auto svc = gateway::service::open(o);
  REQUIRE_FALSE(svc.ok());
  CHECK(std::string(svc.status().message()).find("effects.db") != std::string::npos);
  CHECK(keel_service::read_file(path) == before);  // nothing was written into the damaged file
}
