// The store conformance suite (keel/testing/store_conformance.hpp) run
// against the in-memory and SQLite backends, one SECTION per check, plus
// tests that the suite itself catches broken stores.
#include "keel/testing/store_conformance.hpp"

#include <memory>
#include <stdexcept>
#include <string>

#include "support/durable.hpp"
#include "keel/store/memory.hpp"
#include "keel/store/sqlite.hpp"
#include "keel/testing/manual_clock.hpp"
#include "support/catch.hpp"

using keel::testing::manual_clock;
using memory = keel::memory_store;
using sqlite = keel::sqlite_store<manual_clock>;

namespace {

template <class Store>
void run_sections(const keel::testing::store_harness<Store>& h) {
  const std::vector<std::string> names = keel::testing::conformance_checks<Store>();
  REQUIRE(names.size() == 43);  // 24 idempotency + 13 lease + 6 results
  for (const std::string& name : names) {
    SECTION(name) {
      const keel::testing::conformance_report r = keel::testing::run_store_conformance(h, name);
      for (const auto& f : r.failures) FAIL_CHECK(f.check << " (line " << f.line << "): " << f.message);
      CHECK(r.skipped.empty());
      CHECK(r.passed.size() == 1);
    }
  }
}

}  // namespace

TEST_CASE("the in-memory store passes the conformance suite", "[conformance][memory]") {
  manual_clock clock;
  keel::testing::store_harness<memory> h{
      .make = [&] { return std::make_shared<memory>(clock); },
      .advance = [&](keel::duration d) { clock.advance(d); },
      .step_back = [&](keel::duration d) { clock.set(clock.now() - d); },
      .peer = [](memory& s) { return std::shared_ptr<memory>(std::shared_ptr<memory>(), &s); },
      .purge = [](memory& s) { s.purge_expired(); },
      .slack = keel::duration::zero()};
  run_sections(h);
}

TEST_CASE("the SQLite store passes the conformance suite", "[conformance][sqlite]") {
  keel_durable::temp_dir dir;
  manual_clock clock;
  int n = 0;
  std::string current;
  keel::testing::store_harness<sqlite> h{
      .make =
          [&] {
            current = dir.file("conformance-" + std::to_string(++n) + ".db");
            return std::shared_ptr<sqlite>(keel_durable::open_sqlite(current, clock));
          },
      .advance = [&](keel::duration d) { clock.advance(d); },
      .step_back = [&](keel::duration d) { clock.set(clock.now() - d); },
      // Another connection on the same file: what another process would have.
      .peer = [&](sqlite&) { return std::shared_ptr<sqlite>(keel_durable::open_sqlite(current, clock)); },
      .purge =
          [](sqlite& s) {
            if (auto n = s.purge_expired(); !n.ok()) throw std::runtime_error(n.status().ToString());
          },
      .slack = keel::duration::zero()};
  run_sections(h);
}

namespace {

// A store that breaks the contract on purpose: commits without checking
// the fence, as the idempotency utilities the issue names do.
class unfenced_store : public memory {
 public:
  using memory::memory;
  absl::Status commit(const keel::request_identity& id, const keel::ownership& token, const keel::decision& d,
                      keel::duration retention) {
    absl::Status s = memory::commit(id, token, d, retention);
    return keel::is_lost_ownership(s) ? absl::OkStatus() : s;
  }
};

// Results that overwrite: last write wins.
class overwriting_results : public memory {
 public:
  using memory::memory;
  absl::StatusOr<bool> save_result(std::string_view key, std::string_view value, keel::duration retention) {
    (void)memory::erase_result(key);
    return memory::save_result(key, value, retention);
  }
};

}  // namespace

TEST_CASE("the suite catches a store that does not check fences", "[conformance]") {
  manual_clock clock;
  keel::testing::store_harness<unfenced_store> h{.make = [&] { return std::make_shared<unfenced_store>(clock); },
                                                 .advance = [&](keel::duration d) { clock.advance(d); }};
  const keel::testing::conformance_report r = keel::testing::run_store_conformance(h);
  CHECK_FALSE(r.ok());
  bool takeover_failed = false;
  for (const auto& f : r.failures)
    if (f.check.find("takes over with a higher fence") != std::string::npos) takeover_failed = true;
  CHECK(takeover_failed);
  CHECK(r.skipped.size() == 9);  // no step_back (4 checks), no peer (3), no purge (2)
  INFO(r.summary());
  CHECK(r.summary().find("FAIL") != std::string::npos);
}

TEST_CASE("the suite catches results that are overwritten", "[conformance]") {
  manual_clock clock;
  keel::testing::store_harness<overwriting_results> h{
      .make = [&] { return std::make_shared<overwriting_results>(clock); },
      .advance = [&](keel::duration d) { clock.advance(d); }};
  const keel::testing::conformance_report r =
      keel::testing::run_store_conformance(h, "results: first write wins; erase makes room");
  CHECK_FALSE(r.ok());
  CHECK(r.passed.empty());
}

TEST_CASE("the suite reports a harness without make/advance and an unknown check name", "[conformance]") {
  keel::testing::store_harness<memory> empty{};
  CHECK_FALSE(keel::testing::run_store_conformance(empty).ok());
  manual_clock clock;
  keel::testing::store_harness<memory> h{.make = [&] { return std::make_shared<memory>(clock); },
                                         .advance = [&](keel::duration d) { clock.advance(d); }};
  const auto r = keel::testing::run_store_conformance(h, "no such check");
  REQUIRE(r.failures.size() == 1);
  CHECK(r.failures[0].message == "no such check for this store type");
}
