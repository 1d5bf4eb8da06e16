// model_panel: the seed's multi-model panel, resumable.
//
// Three (simulated) model providers rate one product. Each valid rating is
// saved to a SQLite file the moment it arrives, under a key built from the
// product facts, the model and the rubric. On the first run provider B is
// having a bad minute and times out: the report names exactly what is
// missing. The second run — a new store handle on the same file, as a
// restarted process would have — finds A and C saved and calls only B.
//
//   model_panel              uses a fresh file in /tmp and removes it afterwards
//   model_panel panel.db     keeps panel.db: run it again and nobody is called
//
// The providers sleep for real (tens of milliseconds), on keel's bounded
// pool, with each unit's own pipeline (an attempt limit) inside the call's
// deadline.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <unistd.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "keel/compose/executor.hpp"
#include "keel/compose/pipeline.hpp"
#include "keel/core/call.hpp"
#include "keel/core/environment.hpp"
#include "keel/durable/digest.hpp"
#include "keel/durable/fan_out.hpp"
#include "keel/policy/time_limit.hpp"
#include "keel/store/sqlite.hpp"

using namespace std::chrono_literals;

namespace {

constexpr std::string_view facts = "product 42: stainless kettle, 1.2 l, 2-year warranty";
constexpr std::string_view rubric = "panel-rubric-v3";

// A simulated provider: answers after `latency`, except that the first
// `stall_first` calls hang until the attempt's deadline (a provider having
// a bad minute). It honours its stop token, as a real client should.
struct simulated_model {
  simulated_model(std::string n, int s, keel::duration l, int stalls = 0)
      : name(std::move(n)), score(s), latency(l), stall_first(stalls) {}

  std::string name;
  int score;
  keel::duration latency;
  int stall_first;
  std::atomic<int> calls{0};

  absl::StatusOr<std::string> operator()(const keel::attempt& a) {
    const int n = ++calls;
    const keel::real_clock clock;
    if (n <= stall_first) {
      if (!clock.sleep_until(a.deadline.when(), a.stop)) return absl::CancelledError(name + ": cancelled");
      return absl::DeadlineExceededError(name + ": no answer before the attempt's deadline");
    }
    if (!clock.sleep_until(clock.now() + latency, a.stop)) return absl::CancelledError(name + ": cancelled");
    return absl::StrCat("product 42 score:", score);
  }
};

// A rating is valid when it is a score for this product.
absl::Status valid_rating(const std::string& r) {
  int score = 0;
  if (r.rfind("product 42 score:", 0) != 0 || !absl::SimpleAtoi(r.substr(17), &score) || score < 0 || score > 100)
    return absl::InvalidArgumentError(absl::StrCat("not a rating of product 42: \"", r, "\""));
  return absl::OkStatus();
}

long long ms(keel::duration d) { return std::chrono::duration_cast<std::chrono::milliseconds>(d).count(); }

std::unique_ptr<keel::sqlite_store<>> open_or_die(const std::string& path) {
  auto store = keel::sqlite_store<>::open(path);
  if (!store.ok()) {
    std::fprintf(stderr, "cannot open %s: %s\n", path.c_str(), std::string(store.status().message()).c_str());
    std::exit(1);
  }
  return std::move(*store);
}

// Prints each unit's state changes as the fan-out reports them (events on
// the environment's listener, one at a time, in order).
struct progress_printer {
  keel::time_point t0;
  void line(std::string_view unit, std::string_view what, const absl::Status& why) const {
    std::printf("  [%4lld ms] %.*s %.*s", ms(keel::real_clock{}.now() - t0), static_cast<int>(unit.size()),
                unit.data(), static_cast<int>(what.size()), what.data());
    if (!why.ok()) std::printf(": %s", std::string(why.message()).c_str());
    std::printf("\n");
  }
  void operator()(const keel::events::fan_out_unit_started& e) const { line(e.unit, "running", absl::OkStatus()); }
  void operator()(const keel::events::fan_out_unit_cached& e) const { line(e.unit, "cached", absl::OkStatus()); }
  void operator()(const keel::events::fan_out_unit_finished& e) const {
    line(e.unit, keel::to_string(e.state), e.status);
  }
  void operator()(const keel::events::fan_out_unit_missing& e) const { line(e.unit, "missing", e.why); }
};

void run_panel(const char* title, const std::string& path, std::map<std::string, std::unique_ptr<simulated_model>>& models,
               const std::vector<keel::unit>& units) {
  std::printf("\n%s\n", title);
  std::unique_ptr<keel::sqlite_store<>> store = open_or_die(path);  // a fresh handle each run
  keel::bounded_pool pool({.threads = 3, .queue_capacity = 16});
  const keel::time_point t0 = keel::real_clock{}.now();
  keel::fan_out panel(keel::fan_out_options<std::string>{.width = 3, .validator = valid_rating}, *store, pool,
                      keel::environment<>{}.with_listener(progress_printer{t0}));

  // The call's deadline covers the whole panel; each unit gets what is left
  // of it, and its own pipeline limits each attempt to 250 ms.
  keel::call call(t0, {.timeout = 2s, .labels = {.tenant = "shop-7", .endpoint = "ratings"}});
  auto attempt_limit = keel::pipeline(keel::time_limit({.at_most = 250ms}));
  const keel::fan_out_report<std::string> r =
      panel.run(call, units, [&](const keel::unit_context& u) -> absl::StatusOr<std::string> {
        keel::call unit_call(keel::real_clock{}.now(), u.call_options());
        return attempt_limit.run(unit_call, *models.at(u.unit.name));
      });

  if (r.status().ok()) {
    std::printf("  complete panel:");
    for (const auto& u : r.units) std::printf(" %s=%s", u.name.c_str(), u.value->substr(17).c_str());
    std::printf("\n");
  } else {
    std::printf("  partial panel, not shown as complete: %s\n", std::string(r.status().message()).c_str());
    std::printf("  saved for the next run:");
    for (const auto& u : r.units)
      if (u.value) std::printf(" %s", u.name.c_str());
    std::printf("; missing:");
    for (std::string_view m : r.missing()) std::printf(" %.*s", static_cast<int>(m.size()), m.data());
    std::printf("\n");
  }
  std::printf("  provider calls so far:");
  for (const auto& [name, m] : models) std::printf(" %s=%d", name.c_str(), m->calls.load());
  std::printf("\n");
}

}  // namespace

int main(int argc, char** argv) {
  const bool keep = argc > 1;
  const std::string path =
      keep ? argv[1] : (std::filesystem::temp_directory_path() / absl::StrCat("keel-model-panel-", ::getpid(), ".db")).string();

  std::map<std::string, std::unique_ptr<simulated_model>> models;
  models["A"] = std::make_unique<simulated_model>("A", 80, 40ms);
  models["B"] = std::make_unique<simulated_model>("B", 81, 60ms, /*stalls=*/1);
  models["C"] = std::make_unique<simulated_model>("C", 78, 90ms);

  // Each unit's key: the product facts, the model and the rubric, framed by
  // keel's digest builder. The same inputs give the same key in any process.
  std::vector<keel::unit> units;
  for (std::string_view m : {"A", "B", "C"}) {
    units.push_back({.name = std::string(m),
                     .key = keel::digest_builder().field("facts", facts).field("model", m).field("rubric", rubric).finish(),
                     .labels = {.model = m}});
  }

  std::printf("model panel: three providers rate %s\nresults are saved in %s\n", std::string(facts).c_str(),
              path.c_str());
  run_panel("run 1: provider B is having a bad minute", path, models, units);
  run_panel("run 2: the same file reopened, as after a restart", path, models, units);

  if (!keep) {
    std::error_code ec;
    for (const char* suffix : {"", "-wal", "-shm"}) std::filesystem::remove(path + suffix, ec);
  }
  return 0;
}
