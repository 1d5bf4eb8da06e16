// keel's PostgreSQL stores through PgBouncer in transaction pooling mode
// (the CTest fixture pgbouncer_server, tests/servers/pgbouncer.sh, in front
// of the postgres_server fixture): with pooling = transaction the store
// conformance suite and the job queue suite pass through it; with the
// default session pooling, prepared statements meet server connections that
// never saw them, and the store says so.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "keel/store/postgres.hpp"
#include "keel/store/postgres_jobs.hpp"
#include "keel/testing/store_conformance.hpp"
#include "support/catch.hpp"
#include "support/jobs.hpp"
#include "support/jobs_suite.hpp"
#include "support/scaleout.hpp"

using namespace std::chrono_literals;

namespace {

std::string bouncer_conninfo() {
  return keel_scaleout::read_first_line(keel_scaleout::servers_dir() + "/pgbouncer/conninfo");
}

keel::postgres_options through_bouncer(std::string schema,
                                       keel::postgres_pooling pooling = keel::postgres_pooling::transaction) {
  return keel::postgres_options{
      .conninfo = bouncer_conninfo(), .schema = std::move(schema), .pool_size = 4, .pooling = pooling};
}

std::unique_ptr<keel::postgres_store> open_pg(keel::postgres_options o) {
  auto s = keel::postgres_store::open(std::move(o));
  if (!s.ok()) throw std::runtime_error(std::string(s.status().ToString()));
  return std::move(*s);
}

struct bouncer_jobs {
  using store_type = keel::postgres_job_store;
  keel_jobs::manual_clock clock;
  std::shared_ptr<std::atomic<std::int64_t>> offset = std::make_shared<std::atomic<std::int64_t>>(0);
  std::string schema = keel_scaleout::fresh_name("bjobs");
  std::unique_ptr<store_type> open() {
    keel::postgres_options o = through_bouncer(schema);
    o.testing_clock_offset = offset;
    auto s = store_type::open(std::move(o));
    if (!s.ok()) throw std::runtime_error(std::string(s.status().ToString()));
    return std::move(*s);
  }
  void advance(keel::duration d) {
    offset->fetch_add(keel::detail::to_ns(d));
    clock.advance(d);
  }
};

}  // namespace

TEST_CASE("through PgBouncer (transaction pooling): the PostgreSQL store passes the conformance suite",
          "[pooler][postgres][conformance]") {
  auto offset = std::make_shared<std::atomic<std::int64_t>>(0);
  keel::testing::store_harness<keel::postgres_store> h{
      .make =
          [&] {
            keel::postgres_options o = through_bouncer(keel_scaleout::fresh_name("bconf"));
            o.testing_clock_offset = offset;
            return std::shared_ptr<keel::postgres_store>(open_pg(std::move(o)));
          },
      .advance = [&](keel::duration d) { offset->fetch_add(keel::detail::to_ns(d)); },
      .step_back = [&](keel::duration d) { offset->fetch_sub(keel::detail::to_ns(d)); },
      .peer = [&](keel::postgres_store& s) { return std::shared_ptr<keel::postgres_store>(open_pg(s.options())); },
      .purge =
          [](keel::postgres_store& s) {
            if (auto n = s.purge_expired(); !n.ok()) throw std::runtime_error(n.status().ToString());
          },
      .server_clock = true,
  };
  for (const std::string& name : keel::testing::conformance_checks<keel::postgres_store>()) {
    SECTION(name) {
      const keel::testing::conformance_report r = keel::testing::run_store_conformance(h, name);
      for (const auto& f : r.failures) FAIL_CHECK(f.check << " (line " << f.line << "): " << f.message);
      CHECK(r.passed.size() + r.skipped.size() == 1);
    }
  }
}

TEST_CASE("through PgBouncer (transaction pooling): session pooling's prepared statements break, and say so",
          "[pooler][postgres]") {
  // Two stores in session mode: each prepares its statements on whichever
  // server connection PgBouncer lends for that moment, usually the same idle
  // one, which then holds the other's statements already; and under
  // concurrency a statement meets a server connection that never saw it.
  const std::string schema = keel_scaleout::fresh_name("bsess");
  auto a = keel::postgres_store::open(through_bouncer(schema, keel::postgres_pooling::session));
  auto b = keel::postgres_store::open(through_bouncer(schema, keel::postgres_pooling::session));
  std::atomic<int> failures{0};
  std::string first_error;
  std::mutex mu;
  {
    std::vector<std::jthread> threads;
    for (auto* s : {&a, &b}) {
      if (!s->ok()) continue;
      for (int t = 0; t < 3; ++t)
        threads.emplace_back([&, s, t] {
          for (int i = 0; i < 30; ++i) {
            auto c = (**s)->claim(absl::StrCat("k-", t, "-", i), keel::owner_id::random(), 10s);
            if (!c.ok()) {
              failures.fetch_add(1);
              std::lock_guard lock(mu);
              if (first_error.empty()) first_error = std::string(c.status().message());
            }
          }
        });
    }
  }
  const std::string open_error = b.ok() ? (a.ok() ? "" : std::string(a.status().message())) : std::string(b.status().message());
  std::printf("PgBouncer, session pooling: second open %s; %d claims failed; %s\n", b.ok() ? "succeeded" : "failed",
              failures.load(), (open_error.empty() ? first_error : open_error).c_str());
  CHECK((!a.ok() || !b.ok() || failures.load() > 0));
  CHECK((open_error + first_error).find("prepared statement") != std::string::npos);
}

KEEL_JOBS_SUITE(bouncer_jobs, "postgres through PgBouncer", "[pooler][postgres]")
