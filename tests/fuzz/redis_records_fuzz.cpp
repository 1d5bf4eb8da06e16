// libFuzzer target: the Redis store decoding what its scripts answer
// (detail::redis_begin_outcome, detail::redis_claim_outcome), without a
// server. The input describes a reply — an array of integers, bulk strings,
// nils and nested arrays, or a lone value — which is written as RESP and
// parsed by hiredis' own reader into the redisReply the store would get. A
// hash damaged or written by another version makes the scripts answer such
// things (Lua ends an array at its first nil; tonumber of garbage is nil).
//
// Promises checked beyond the sanitizers (committed_at * 1000 and us -> ns
// conversions are signed arithmetic, caught by UBSan on overflow):
//   - an outcome is trusted only if well-formed: a claim or lease fence in
//     [1, 2^63 - 2], a replayed decision commit() would accept;
//   - anything else is DataLoss.
#include <hiredis/hiredis.h>
#include <hiredis/read.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "check.hpp"
#include "keel/store/redis.hpp"

namespace {

// One RESP value from the input (arrays nest at most two deep).
void resp(keel::fuzz::reader& in, std::string& out, int depth) {
  const std::uint8_t t = in.u8();
  switch (t % 6) {
    case 0:
    case 1: {  // an integer: small, at the edges, or any
      std::int64_t v = static_cast<std::int8_t>(in.u8());
      if (t & 0x40) v = in.i64();
      if (t & 0x80) v = (t & 0x20) ? INT64_MAX : INT64_MIN;
      out += ":" + std::to_string(v) + "\r\n";
      break;
    }
    case 2:
    case 3: {
      const std::string_view s = in.str();
      out += "$" + std::to_string(s.size()) + "\r\n";
      out.append(s);
      out += "\r\n";
      break;
    }
    case 4: out += "$-1\r\n"; break;  // nil
    default: {
      if (depth >= 2) {
        out += ":0\r\n";
        break;
      }
      const int n = in.u8() % 11;
      out += "*" + std::to_string(n) + "\r\n";
      for (int i = 0; i < n; ++i) resp(in, out, depth + 1);
    }
  }
}

struct reply_deleter {
  void operator()(redisReply* r) const noexcept { freeReplyObject(r); }
};

void check_error(const absl::Status& s) {
  KEEL_FUZZ_CHECK(s.code() == absl::StatusCode::kDataLoss, std::string(s.message()).c_str());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  keel::fuzz::reader in(data, size);
  const std::uint8_t mode = in.u8();
  std::string wire;
  if (mode & 0x80) {  // a well-formed-looking reply: an array whose head is a plausible kind and fence
    const int n = 1 + in.u8() % 10;
    wire = "*" + std::to_string(n + 1) + "\r\n:" + std::to_string(in.u8() % 5) + "\r\n";
    for (int i = 0; i < n; ++i) resp(in, wire, 1);
  } else {
    resp(in, wire, 0);
  }
  redisReader* reader = redisReaderCreate();
  if (reader == nullptr) std::abort();
  KEEL_FUZZ_CHECK(redisReaderFeed(reader, wire.data(), wire.size()) == REDIS_OK, "feeding the reader");
  void* raw = nullptr;
  const int rc = redisReaderGetReply(reader, &raw);
  redisReaderFree(reader);
  KEEL_FUZZ_CHECK(rc == REDIS_OK && raw != nullptr, "the RESP written here parses");
  const std::unique_ptr<redisReply, reply_deleter> reply(static_cast<redisReply*>(raw));

  const keel::request_identity id{.tenant = "t", .endpoint = "e", .key = "k"};
  const keel::owner_id owner{1, 2};
  if (mode & 1) {
    const absl::StatusOr<keel::lease_claim> c =
        keel::detail::redis_claim_outcome(reply.get(), "w", owner, std::chrono::seconds(5), "redis store 'fuzz'");
    if (!c.ok()) return check_error(c.status()), 0;
    KEEL_FUZZ_CHECK(c->ownership.fence >= 1 && c->ownership.fence < INT64_MAX, "a lease fence a claim could issue");
    if (c->acquired) KEEL_FUZZ_CHECK(c->ownership.owner == owner, "an acquired lease is the claimant's");
    return 0;
  }
  const absl::StatusOr<keel::begin_outcome> b =
      keel::detail::redis_begin_outcome(reply.get(), id, owner, {}, "redis store 'fuzz'");
  if (!b.ok()) return check_error(b.status()), 0;
  if (b->state != keel::begin_state::conflict)
    KEEL_FUZZ_CHECK(b->ownership.fence >= 1 && b->ownership.fence < INT64_MAX, "a fence a claim could issue");
  if (b->state == keel::begin_state::replay) {
    KEEL_FUZZ_CHECK(b->decision.validate().ok(), "a replayed decision is one commit() would accept");
    const int code = static_cast<int>(b->decision.error_code);
    KEEL_FUZZ_CHECK(code >= 0 && code <= 16, "a replayed failure has a known status code");
  }
  if (b->state == keel::begin_state::claimed) KEEL_FUZZ_CHECK(b->ownership.owner == owner, "a claim is the claimant's");
  return 0;
}
