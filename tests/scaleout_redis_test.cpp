// keel::redis_store against a real Redis server (started by the
// redis_server CTest fixture, AOF with appendfsync always): the conformance
// suite, bad input and faults.
#include "keel/store/redis.hpp"

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "keel/testing/store_conformance.hpp"
#include "scaleout_support.hpp"
#include "support/catch.hpp"

using namespace std::chrono_literals;

namespace {

std::unique_ptr<keel::redis_store> open_redis(keel::redis_options o) {
  auto s = keel::redis_store::open(std::move(o));
  if (!s.ok()) throw std::runtime_error(std::string(s.status().ToString()));
  return std::move(*s);
}

keel::redis_options redis_options(std::string prefix) {
  return keel::redis_options{.port = keel_scaleout::redis_port(), .key_prefix = prefix + ":", .pool_size = 4};
}

}  // namespace

TEST_CASE("the Redis store passes the conformance suite", "[scaleout][redis][conformance]") {
  auto offset = std::make_shared<std::atomic<std::int64_t>>(0);
  keel::testing::store_harness<keel::redis_store> h{
      .make =
          [&] {
            keel::redis_options o = redis_options(keel_scaleout::fresh_name("conf"));
            o.testing_clock_offset = offset;
            return std::shared_ptr<keel::redis_store>(open_redis(std::move(o)));
          },
      .advance = [&](keel::duration d) { offset->fetch_add(keel::detail::to_ns(d)); },
      .peer = [&](keel::redis_store& s) { return std::shared_ptr<keel::redis_store>(open_redis(s.options())); },
  };
  const std::vector<std::string> names = keel::testing::conformance_checks<keel::redis_store>();
  REQUIRE(names.size() == 39);
  for (const std::string& name : names) {
    SECTION(name) {
      const keel::testing::conformance_report r = keel::testing::run_store_conformance(h, name);
      for (const auto& f : r.failures) FAIL_CHECK(f.check << " (line " << f.line << "): " << f.message);
      if (name.find("clock stepping backwards") != std::string::npos) {
        CHECK(r.skipped.size() == 1);  // see docs/scaleout.md: the server's clock is trusted
      } else {
        CHECK(r.passed.size() == 1);
      }
    }
  }
}
