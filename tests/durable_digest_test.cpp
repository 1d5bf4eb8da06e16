// keel::digest, keel::digest_builder, keel::sha256, keel::owner_id and key validation.
#include "keel/durable/digest.hpp"

#include <array>
#include <cctype>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include "keel/durable/ownership.hpp"
#include "support/alloc_counter.hpp"
#include "support/catch.hpp"

using namespace std::string_literals;

TEST_CASE("sha256 matches the published test vectors", "[digest]") {
  CHECK(keel::sha256("").hex() == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(keel::sha256("abc").hex() == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(keel::sha256("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq").hex() ==
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
}

TEST_CASE("digest hex round-trips and rejects malformed text", "[digest]") {
  const keel::digest d = keel::sha256("receipt-A");
  CHECK(keel::digest::from_hex(d.hex()) == d);
  std::string upper = d.hex();
  for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  CHECK(keel::digest::from_hex(upper) == d);
  CHECK_FALSE(keel::digest::from_hex(d.hex().substr(1)).has_value());
  // Built in place: g++ 12 at -O2 warns (-Warray-bounds, a false positive)
  // on std::string(n, c) + "g".
  std::string bad_digit(63, '0');
  bad_digit.push_back('g');
  CHECK_FALSE(keel::digest::from_hex(bad_digit).has_value());
}

TEST_CASE("the builder frames fields: moving bytes between fields changes the digest", "[digest]") {
  auto two = [](std::string_view a, std::string_view b) {
    return keel::digest_builder().field("x", a).field("y", b).finish();
  };
  CHECK(two("ab", "c") != two("a", "bc"));
  CHECK(two("", "abc") != two("abc", ""));
  // A name is not a value.
  CHECK(keel::digest_builder().field("ab", "c").finish() != keel::digest_builder().field("a", "bc").finish());
  // Integers are typed and fixed width: 7 is not "7", and not 7 bytes of something else.
  CHECK(keel::digest_builder().field("n", std::int64_t{7}).finish() !=
        keel::digest_builder().field("n", "7").finish());
  CHECK(keel::digest_builder().field("n", std::int64_t{-1}).finish() !=
        keel::digest_builder().field("n", std::int64_t{1}).finish());
  // Field order matters; the same fields in the same order agree.
  CHECK(two("a", "b") != keel::digest_builder().field("y", "b").field("x", "a").finish());
  CHECK(two("a", "b") == two("a", "b"));
  // Embedded NULs are data.
  CHECK(two("a\0b"s, "") != two("a", "b"));
  // The builder is not a plain hash of the concatenation.
  CHECK(keel::digest_builder().field("x", "abc").finish() != keel::sha256("abc"));
}

TEST_CASE("the builder's encoding is stable across processes and machines", "[digest]") {
  // Pinned value: if this changes, every stored idempotency record and
  // result key changes meaning. Bump the domain tag instead.
  const keel::digest d = keel::digest_builder()
                             .field("facts", "{\"sku\":\"A-1\",\"price\":1299}")
                             .field("model", "m-large")
                             .field("rubric", "panel-v3")
                             .field("rubric_revision", std::int64_t{7})
                             .finish();
  // Computed independently (Python):
  //   import hashlib, struct
  //   def s(n, v): return b's' + struct.pack('>Q', len(n)) + n + struct.pack('>Q', len(v)) + v
  //   def i(n, v): return b'i' + struct.pack('>Q', len(n)) + n + struct.pack('>q', v)
  //   hashlib.sha256(b'keel.digest.v1' + s(b'facts', b'{"sku":"A-1","price":1299}') + s(b'model', b'm-large')
  //                  + s(b'rubric', b'panel-v3') + i(b'rubric_revision', 7)).hexdigest()
  CHECK(d.hex() == "2c88c7d20c0b6dbfa87f2b4cdf4a3f50a3adf32e56b7694fe5dbfd0afd048b2a");
}

TEST_CASE("builders on many threads agree, and nested builders do not share a context", "[digest]") {
  const keel::digest expected = keel::digest_builder().field("k", "v").finish();
  std::vector<keel::digest> got(8);
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        keel::digest_builder outer;
        outer.field("k", "v");
        const keel::digest inner = keel::digest_builder().field("other", "x").finish();  // while outer is open
        (void)inner;
        got[t] = outer.finish();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& d : got) CHECK(d == expected);
}

TEST_CASE("a digest after the thread's first allocates nothing", "[digest][alloc]") {
  (void)keel::digest_builder().field("warm", "up").finish();
  (void)keel::sha256("warm up");
  keel_test::count_allocations allocs;
  const keel::digest a = keel::digest_builder().field("facts", "abc").field("n", std::int64_t{3}).finish();
  const keel::digest b = keel::sha256("abc");
  CHECK(allocs.count() == 0);
  CHECK(a != b);
}

TEST_CASE("owner ids are random, 128-bit, and round-trip as bytes and hex", "[ownership]") {
  std::set<std::pair<std::uint64_t, std::uint64_t>> seen;
  for (int i = 0; i < 1000; ++i) {
    const keel::owner_id o = keel::owner_id::random();
    CHECK_FALSE(o.is_nil());
    CHECK(keel::owner_id::from_bytes(o.bytes()) == o);
    CHECK(keel::owner_id::from_hex(o.hex()) == o);
    seen.insert({o.hi, o.lo});
  }
  CHECK(seen.size() == 1000);
  CHECK_FALSE(keel::owner_id::from_hex("xyz").has_value());
  std::string bad_owner(31, 'a');
  bad_owner.push_back('g');  // see above: not std::string(n, c) + "g"
  CHECK_FALSE(keel::owner_id::from_hex(bad_owner).has_value());
}

TEST_CASE("a forked child never repeats its parent's owner ids", "[ownership]") {
  // The parent's per-thread generator exists before the fork, so the child
  // starts with a copy of its state: it must reseed, not replay it.
  (void)keel::owner_id::random();
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {  // the child: one owner id into the pipe, then leave at once
    const auto b = keel::owner_id::random().bytes();
    const ssize_t n = ::write(fds[1], b.data(), b.size());
    ::_exit(n == static_cast<ssize_t>(b.size()) ? 0 : 1);
  }
  ::close(fds[1]);
  const keel::owner_id mine = keel::owner_id::random();
  std::array<unsigned char, 16> theirs{};
  std::size_t got = 0;
  while (got < theirs.size()) {
    const ssize_t n = ::read(fds[0], theirs.data() + got, theirs.size() - got);
    if (n <= 0) break;
    got += static_cast<std::size_t>(n);
  }
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  REQUIRE(got == theirs.size());
  CHECK(WIFEXITED(status));
  CHECK(keel::owner_id::from_bytes(theirs) != mine);
}

TEST_CASE("keys: empty, longer than 255 bytes, or with control characters are refused", "[ownership]") {
  CHECK(keel::validate_key("idempotency key", "key-47").ok());
  CHECK(keel::validate_key("idempotency key", std::string(255, 'k')).ok());
  CHECK(keel::validate_key("idempotency key", "k\xc3\xa9y").ok());  // UTF-8 is fine

  const absl::Status empty = keel::validate_key("idempotency key", "");
  CHECK(empty.code() == absl::StatusCode::kInvalidArgument);
  CHECK(empty.message() == "idempotency key must not be empty");
  const absl::Status long_key = keel::validate_key("tenant", std::string(256, 'k'));
  CHECK(long_key.code() == absl::StatusCode::kInvalidArgument);
  CHECK(long_key.message() == "tenant must be at most 255 bytes (got 256)");
  for (std::string bad : {"a\nb"s, "a\0b"s, "\x7f"s, "tab\there"s, "\x1b[31m"s}) {
    const absl::Status s = keel::validate_key("work key", bad);
    CHECK(s.code() == absl::StatusCode::kInvalidArgument);
    CHECK(s.message().find("must not contain control characters") != absl::string_view::npos);
  }
}

TEST_CASE("store statuses carry their condition and classification", "[ownership]") {
  const absl::Status lost = keel::lost_ownership_error("taken over");
  CHECK(keel::is_lost_ownership(lost));
  CHECK(lost.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(keel::default_classifier{}(lost, {}) == keel::outcome_kind::permanent);

  const absl::Status unknown = keel::unknown_outcome_error("commit", absl::InternalError("disk I/O error"));
  CHECK(keel::is_unknown_outcome(unknown));
  CHECK(keel::default_classifier{}(unknown, {.effect = keel::effect::write}) == keel::outcome_kind::ambiguous);
  CHECK(unknown.message().find("disk I/O error") != absl::string_view::npos);

  const absl::Status busy = keel::in_flight_error("request 'a/b/c'", std::chrono::seconds(3));
  CHECK(keel::is_in_flight(busy));
  CHECK(keel::not_started(busy));
  CHECK(keel::retry_after(busy) == std::chrono::seconds(3));
  CHECK(keel::default_classifier{}(busy, {.effect = keel::effect::write}) == keel::outcome_kind::transient);

  const absl::Status conflict = keel::conflict_error("other contents");
  CHECK(keel::is_conflict(conflict));
  CHECK_FALSE(keel::is_lost_ownership(conflict));
  CHECK(keel::default_classifier{}(conflict, {}) == keel::outcome_kind::permanent);

  const absl::Status unavailable = keel::store_unavailable_error("database is locked");
  CHECK(keel::not_started(unavailable));
  CHECK_FALSE(keel::condition_of(unavailable).has_value());
}
