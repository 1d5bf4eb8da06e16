// The seed scenario on a real SQLite file and real processes: providers A,
// B, C; B times out on the first run (in a child process); the saved results
// survive that process; the next process calls only B; an answer that
// conflicts with the facts is reported, not cached.
//
// The child is this test binary re-executed (posix_spawn of /proc/self/exe)
// running only the hidden test case "fan-out child process": a clean,
// single-threaded process, which also works under the sanitizers.
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "keel/compose/executor.hpp"
#include "keel/compose/pipeline.hpp"
#include "keel/core/call.hpp"
#include "keel/durable/digest.hpp"
#include "keel/durable/fan_out.hpp"
#include "keel/policy/time_limit.hpp"
#include "keel/store/sqlite.hpp"
#include "keel/testing/manual_clock.hpp"
#include "keel/testing/scripted_provider.hpp"
#include "support/catch.hpp"
#include "support/child_process.hpp"
#include "support/temp_dir.hpp"

using namespace std::chrono_literals;
using keel::testing::manual_clock;
namespace kt = keel::testing;

namespace {

using store_t = keel::sqlite_store<>;
using panel_t = keel::fan_out<std::string, store_t, keel::bounded_pool, keel::environment<manual_clock>>;
using text_provider = kt::scripted_provider<std::string>;

constexpr std::string_view facts = "product 42: stainless, 1.2 l, 2 year warranty";

std::vector<keel::unit> seed_units() {
  std::vector<keel::unit> out;
  for (std::string_view m : {"A", "B", "C"}) {
    out.push_back({.name = std::string(m),
                   .key = keel::digest_builder().field("facts", facts).field("model", m).field("rubric", "panel-v3").finish(),
                   .labels = {.model = m}});
  }
  return out;
}

// Valid: a score about this product. An answer about another product
// conflicts with the facts.
absl::Status about_this_product(const std::string& r) {
  if (r.rfind("product 42 score:", 0) == 0) return absl::OkStatus();
  if (r.rfind("product ", 0) == 0)
    return absl::FailedPreconditionError(absl::StrCat("answer conflicts with the facts: \"", r, "\" is not about product 42"));
  return absl::InvalidArgumentError(absl::StrCat("invalid answer \"", r, "\""));
}

std::unique_ptr<store_t> open_store(const std::string& path) {
  absl::StatusOr<std::unique_ptr<store_t>> s = store_t::open(path);
  if (!s.ok()) throw std::runtime_error(std::string(s.status().message()));
  return std::move(*s);
}

// Runs the panel once, width 1 so the story is deterministic; providers move
// the manual clock themselves (a stalled one runs into its 1 s attempt limit).
keel::fan_out_report<std::string> run_panel(store_t& store, manual_clock clock,
                                            std::map<std::string, std::unique_ptr<text_provider>>& providers) {
  keel::bounded_pool pool({.threads = 2, .queue_capacity = 8});
  panel_t panel({.width = 1, .validator = about_this_product}, store, pool, keel::environment{clock});
  const std::vector<keel::unit> units = seed_units();
  keel::call call(clock.now(), {.timeout = 10s});
  return panel.run(call, units, [&](const keel::unit_context& u) -> absl::StatusOr<std::string> {
    keel::call c(clock.now(), u.call_options());
    return keel::pipeline(keel::time_limit({.at_most = 1s})).in(keel::environment{clock}).run(c, *providers.at(u.unit.name));
  });
}

std::string summary(const keel::fan_out_report<std::string>& r,
                    std::map<std::string, std::unique_ptr<text_provider>>& providers) {
  std::ostringstream out;
  for (const auto& u : r.units) {
    out << u.name << ' ' << keel::to_string(u.state);
    if (u.kind) out << ' ' << keel::to_string(*u.kind);
    out << " calls=" << providers.at(u.name)->calls() << '\n';
  }
  return out.str();
}

using keel_test::read_file;

// Spawns this binary running only the child test case; returns its exit code.
int run_child(const std::map<std::string, std::string>& vars) {
  return keel_test::wait_child(
      keel_test::spawn_self({.test_case = "[fanout-child]", .env_prefix = "KEEL_FANOUT_CHILD_", .vars = vars}));
}

std::string child_env(const char* name) { return keel_test::child_var("KEEL_FANOUT_CHILD_", name); }

using keel_test::temp_dir;

}  // namespace

// The first run, in its own process: B stalls and times out.
TEST_CASE("fan-out child process", "[.][fanout-child]") {
  const std::string db = child_env("DB");
  if (db.empty()) return;
  manual_clock clock;
  std::map<std::string, std::unique_ptr<text_provider>> providers;
  providers["A"] = std::make_unique<text_provider>(clock, std::vector<kt::step<std::string>>{
                                                              kt::answer(std::string("product 42 score:80"), 300ms)});
  providers["B"] = std::make_unique<text_provider>(clock, std::vector<kt::step<std::string>>{kt::stall()});
  providers["C"] = std::make_unique<text_provider>(clock, std::vector<kt::step<std::string>>{
                                                              kt::answer(std::string("product 42 score:78"), 400ms)});
  std::unique_ptr<store_t> store = open_store(db);
  const keel::fan_out_report<std::string> r = run_panel(*store, clock, providers);
  std::ofstream(child_env("OUT")) << summary(r, providers) << r.status().message() << '\n';
  REQUIRE(r.units[1].state == keel::unit_state::failed);
}

TEST_CASE("the seed on SQLite: saved results survive the process; the next process calls only B; a conflicting "
          "answer is reported, not cached",
          "[fan_out][sqlite][seed]") {
  temp_dir dir;
  const std::string db = dir.file("panel.db");

  // Process 1 (a child): A and C answer, B times out.
  REQUIRE(run_child({{"DB", db}, {"OUT", dir.file("first-run.txt")}}) == 0);
  const std::string first = read_file(dir.file("first-run.txt"));
  CHECK(first ==
        "A succeeded calls=1\n"
        "B failed transient calls=1\n"
        "C succeeded calls=1\n"
        "keel: panel incomplete: 1 of 3 missing: B (failed, transient: scripted: attempt timed out)\n");

  // Process 2 (this one), on the same file: what process 1 saved is there.
  std::unique_ptr<store_t> store = open_store(db);
  keel::bounded_pool probe_pool({.threads = 1});
  panel_t probe({}, *store, probe_pool);
  const std::vector<keel::unit> units = seed_units();
  CHECK(store->load_result(probe.key_of(units[0])).value() == "product 42 score:80");
  CHECK_FALSE(store->load_result(probe.key_of(units[1])).value().has_value());
  CHECK(store->load_result(probe.key_of(units[2])).value() == "product 42 score:78");

  manual_clock clock;
  std::map<std::string, std::unique_ptr<text_provider>> providers;
  providers["A"] = std::make_unique<text_provider>(clock, std::vector<kt::step<std::string>>{
                                                              kt::answer(std::string("product 42 score:11"))});
  providers["C"] = std::make_unique<text_provider>(clock, std::vector<kt::step<std::string>>{
                                                              kt::answer(std::string("product 42 score:11"))});
  // B's next answer is about another product: it conflicts with the facts.
  providers["B"] = std::make_unique<text_provider>(
      clock, std::vector<kt::step<std::string>>{kt::answer(std::string("product 17 score:95"), 200ms),
                                                kt::answer(std::string("product 42 score:81"), 200ms)});

  {
    const keel::fan_out_report<std::string> r = run_panel(*store, clock, providers);
    CHECK(r.units[0].state == keel::unit_state::cached);
    CHECK(r.units[1].state == keel::unit_state::failed);
    CHECK(r.units[2].state == keel::unit_state::cached);
    CHECK(r.units[1].status.message() == "answer conflicts with the facts: \"product 17 score:95\" is not about product 42");
    CHECK(r.units[1].kind == keel::outcome_kind::permanent);
    CHECK(r.missing() == std::vector<std::string_view>{"B"});
    CHECK_FALSE(store->load_result(probe.key_of(units[1])).value().has_value());  // not cached
  }
  {
    const keel::fan_out_report<std::string> r = run_panel(*store, clock, providers);
    REQUIRE(r.status().ok());
    CHECK(r.units[1].state == keel::unit_state::succeeded);
    CHECK(*r.units[1].value == "product 42 score:81");
    CHECK(r.units[1].saved);
  }
  // Only B was ever called in this process.
  CHECK(providers["A"]->calls() == 0);
  CHECK(providers["B"]->calls() == 2);
  CHECK(providers["C"]->calls() == 0);

  // Reopened, as a restarted process would: the whole panel is there, nobody is called.
  store.reset();
  std::unique_ptr<store_t> reopened = open_store(db);
  keel::bounded_pool pool({.threads = 1});
  panel_t panel({.validator = about_this_product}, *reopened, pool);
  keel::call call(keel::real_clock{}.now(), {.timeout = 5s});
  int calls = 0;
  const keel::fan_out_report<std::string> r = panel.run(call, units, [&](const keel::unit_context&) {
    ++calls;
    return absl::StatusOr<std::string>(absl::InternalError("must not be called"));
  });
  CHECK(r.status().ok());
  CHECK(r.count(keel::unit_state::cached) == 3);
  CHECK(calls == 0);
}
