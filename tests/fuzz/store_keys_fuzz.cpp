// libFuzzer property target: no two distinct identities map to the same
// stored key on any backend.
//
//   Redis      keys are derived strings (detail::redis_record_key, _lease_key,
//              _result_key, _quota_key, _concurrency_key (+ ":id"),
//              _fleet_key): for up to six things (a record's
//              tenant/endpoint/key, a work key, a result key, a quota name,
//              a shared concurrency limit's name, a failure domain's scoped
//              labels, each under a store prefix) distinct things must give
//              distinct keys, the prefix + kind must be what precedes the first '{'
//              (so stores with other prefixes on one server stay apart), and
//              no key may be cut short by the key buffer.
//   SQLite     the identity is the (tenant, endpoint, key) BLOB primary key:
//   memory     checked by behaviour on real stores: a second identity begun
//              with another request is a fresh claim if it differs from the
//              first and a conflict if it is the same; likewise for leases and
//              results. (PostgreSQL keys by the same tuple of bytea columns;
//              its statements are covered by the conformance suite.)
//
// Parts are drawn half the time from the bytes keys and SQL care about:
// { } : digits (the record key's length prefixes), quotes, backslash, % _ ; and
// the , = a failure domain's display name is made of
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "check.hpp"
#include "keel/store/memory.hpp"
#include "keel/store/redis.hpp"
#include "keel/fleet/shared_concurrency.hpp"
#include "keel/fleet/shared_provider_state.hpp"
#include "keel/fleet/shared_quota.hpp"
#include "keel/testing/manual_clock.hpp"
#include "sqlite_fixture.hpp"

namespace {

constexpr std::string_view tricky = "{}:0123456789'\"\\%_;-x,=";

std::string part(keel::fuzz::reader& in, std::size_t max) {
  const std::uint8_t how = in.u8();
  std::string s(in.take(how % (max + 1)));
  if (how & 0x80)
    for (char& c : s) c = tricky[static_cast<unsigned char>(c) % tricky.size()];
  return s;
}

enum kind : int { record, lease, result, quota, concurrency, concurrency_ids, fleet, kinds };

struct thing {
  int k = record;
  std::string prefix, a, b, c, d;
  std::uint8_t scope = 0;  // fleet: bits 1, 2, 4, 8 = a..d (endpoint, model, region, tenant) make the domain
  friend bool operator==(const thing&, const thing&) = default;
};

std::string key_of(const thing& t) {
  namespace d = keel::detail;
  switch (t.k) {
    case record: return std::string(d::redis_record_key(t.prefix, {t.a, t.b, t.c}).view());
    case lease: return std::string(d::redis_lease_key(t.prefix, t.a).view());
    case result: return std::string(d::redis_result_key(t.prefix, t.a).view());
    case quota: return d::redis_quota_key(t.prefix, t.a);
    case concurrency: return d::redis_concurrency_key(t.prefix, t.a);
    case concurrency_ids: return d::redis_concurrency_key(t.prefix, t.a) + ":id";
    default:
      return d::redis_fleet_key(t.prefix, {.endpoint = t.a, .model = t.b, .region = t.c, .tenant = t.d},
                                {.endpoint = (t.scope & 1) != 0, .model = (t.scope & 2) != 0,
                                 .region = (t.scope & 4) != 0, .tenant = (t.scope & 8) != 0});
  }
}

std::size_t expected_size(const thing& t) {
  const auto len = [](std::string_view s) { return std::to_string(s.size()).size() + 1 + s.size(); };
  switch (t.k) {
    case record: return t.prefix.size() + 6 + len(t.a) + len(t.b) + len(t.c) + 1;
    case lease: return t.prefix.size() + 7 + t.a.size() + 1;
    case result: return t.prefix.size() + 8 + t.a.size() + 1;
    default: return 0;  // a std::string: no buffer to cut it short
  }
}

std::string_view kind_word(int k) {
  switch (k) {
    case record: return "idem:";
    case lease: return "lease:";
    case result: return "result:";
    case quota: return "quota:";
    case concurrency:
    case concurrency_ids: return "conc:";
    default: return "fleet:";
  }
}

bool valid(const thing& t) {
  if (t.prefix.size() > 128 || t.prefix.find_first_of("{}") != std::string::npos) return false;
  if (t.k == fleet) return t.scope != 0;
  if (!keel::validate_key("a", t.a).ok()) return false;
  if (t.k == record) return keel::validate_key("b", t.b).ok() && keel::validate_key("c", t.c).ok();
  return true;
}

keel::digest digest_of(std::string_view s) { return keel::digest_builder().field("r", s).finish(); }

void check_redis(keel::fuzz::reader& in) {
  // Two or three prefixes, so that collisions across stores are tried too.
  const std::string prefixes[] = {"keel:", part(in, 12), part(in, 12)};
  std::vector<thing> things;
  std::vector<std::string> keys;
  const int n = 2 + in.u8() % 5;
  for (int i = 0; i < n && !in.empty(); ++i) {
    thing t;
    const std::uint8_t sel = in.u8();
    t.k = sel % kinds;
    t.prefix = prefixes[(sel >> 3) % 3];
    t.a = part(in, 255);
    if (t.k == record || t.k == fleet) {
      t.b = part(in, 255);
      t.c = part(in, 255);
    }
    if (t.k == fleet) {
      t.d = part(in, 255);
      t.scope = in.u8() & 15;
    }
    if ((sel & 0x40) && !things.empty()) {  // a near-copy of an earlier one: one part changed by a byte
      t = things.back();
      std::string& p = (sel & 0x80) ? t.a : (t.k == record ? t.c : t.a);
      if (!p.empty()) p.back() = tricky[in.u8() % tricky.size()];
      else p = "{";
    }
    if (!valid(t)) continue;
    if (t.k == fleet) {  // labels outside the scope are not part of the domain
      if (!(t.scope & 1)) t.a.clear();
      if (!(t.scope & 2)) t.b.clear();
      if (!(t.scope & 4)) t.c.clear();
      if (!(t.scope & 8)) t.d.clear();
    }
    const std::string key = key_of(t);
    if (t.k <= result) KEEL_FUZZ_CHECK(key.size() == expected_size(t), "a key is never cut short by the key buffer");
    const std::string head = t.prefix + std::string(kind_word(t.k));
    KEEL_FUZZ_CHECK(key.substr(0, key.find('{')) == head, "prefix + kind is what precedes the first '{'");
    for (std::size_t j = 0; j < things.size(); ++j)
      KEEL_FUZZ_CHECK((things[j] == t) == (keys[j] == key), "distinct identities, distinct Redis keys");
    things.push_back(std::move(t));
    keys.push_back(key);
  }
}

template <class Store>
void check_store(Store& store, const keel::request_identity& a, const keel::request_identity& b,
                 std::string_view wa, std::string_view wb) {
  const keel::owner_id o1{1, 1}, o2{2, 2};
  const auto first = store.begin(a, digest_of("first"), o1, {});
  KEEL_FUZZ_CHECK(first.ok() && first->state == keel::begin_state::claimed, "a new identity is claimed");
  const auto second = store.begin(b, digest_of("second"), o2, {});
  KEEL_FUZZ_CHECK(second.ok(), "begin of a valid identity");
  if (a == b) {
    KEEL_FUZZ_CHECK(second->state == keel::begin_state::conflict, "the same identity, another request: conflict");
  } else {
    KEEL_FUZZ_CHECK(second->state == keel::begin_state::claimed && !second->took_over,
                    "a distinct identity is a record of its own");
  }
  if (!keel::validate_key("w", wa).ok() || !keel::validate_key("w", wb).ok()) return;
  const auto la = store.claim(wa, o1, std::chrono::seconds(10));
  const auto lb = store.claim(wb, o2, std::chrono::seconds(10));
  KEEL_FUZZ_CHECK(la.ok() && la->acquired && lb.ok(), "lease claims");
  KEEL_FUZZ_CHECK(lb->acquired == (wa != wb), "distinct work keys, distinct leases");
  const auto ra = store.save_result(wa, "a", std::chrono::seconds(10));
  const auto rb = store.save_result(wb, "b", std::chrono::seconds(10));
  KEEL_FUZZ_CHECK(ra.ok() && *ra && rb.ok(), "result saves");
  KEEL_FUZZ_CHECK(*rb == (wa != wb), "distinct result keys, distinct results");
  const auto back = store.load_result(wa);
  KEEL_FUZZ_CHECK(back.ok() && back->has_value() && **back == "a", "a result is read back from its own key");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  keel::fuzz::reader in(data, size);
  const std::uint8_t mode = in.u8();
  if (mode & 1) {
    check_redis(in);
    return 0;
  }
  // Real stores: two identities (the second often a near-copy of the first).
  std::string p[6];
  for (std::string& s : p) s = part(in, 40);
  if (mode & 2) {
    p[3] = p[0], p[4] = p[1], p[5] = p[2];
    std::string& changed = p[3 + in.u8() % 3];
    changed += tricky[in.u8() % tricky.size()];
    if (mode & 4) changed.erase(0, 1);
  }
  if (mode & 8) p[3] = p[0], p[4] = p[1], p[5] = p[2];
  const keel::request_identity a{p[0], p[1], p[2]}, b{p[3], p[4], p[5]};
  if (!a.validate().ok() || !b.validate().ok()) return 0;
  // Work and result keys: the identities' concatenations, which differ
  // exactly when a naive key derivation would collide or not.
  const std::string wa = p[0] + p[1], wb = p[3] + p[4];

  keel::memory_store memory{keel::testing::manual_clock()};
  check_store(memory, a, b, wa, wb);
  keel::fuzz::sqlite_fixture& f = keel::fuzz::sqlite_fixture::get();
  f.reset();
  check_store(f.store(), a, b, wa, wb);
  return 0;
}
