// libFuzzer target: key and identity validation (keel/durable/ownership.hpp,
// keel/durable/idempotency.hpp) on arbitrary bytes, and the hex forms a store
// reads back (owner_id::from_hex, digest::from_hex).
//
// Beyond the sanitizers it checks the documented rules against an
// independent statement of them: validate_key accepts exactly 1-255 bytes
// with no ASCII control byte; request_identity::validate accepts exactly
// when every part does; a decision's limits; from_hex accepts exactly the
// right number of hex digits and round-trips through hex().
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "check.hpp"
#include "keel/durable/digest.hpp"
#include "keel/durable/idempotency.hpp"
#include "keel/durable/ownership.hpp"

namespace {

bool rule(std::string_view k) {
  if (k.empty() || k.size() > 255) return false;
  for (unsigned char c : k)
    if (c < 0x20 || c == 0x7f) return false;
  return true;
}

bool hex_rule(std::string_view s, std::size_t n) {
  if (s.size() != n) return false;
  for (char c : s)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'))) return false;
  return true;
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out)
    if (c >= 'A' && c <= 'F') c = static_cast<char>(c - 'A' + 'a');
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view all(reinterpret_cast<const char*>(data), size);
  keel::fuzz::reader in(data, size);

  const absl::Status whole = keel::validate_key("key", all);
  KEEL_FUZZ_CHECK(whole.ok() == rule(all), "validate_key on the whole input");
  if (!whole.ok()) KEEL_FUZZ_CHECK(whole.code() == absl::StatusCode::kInvalidArgument, "a refused key is InvalidArgument");

  const std::string_view tenant = in.str(), endpoint = in.str();
  const std::size_t key_size = in.u8();
  const std::string_view key = in.take(key_size + 8u * (in.u8() & 1));  // up to 263: past the limit too
  const keel::request_identity id{.tenant = tenant, .endpoint = endpoint, .key = key};
  KEEL_FUZZ_CHECK(id.validate().ok() == (rule(tenant) && rule(endpoint) && rule(key)), "request_identity::validate");

  keel::decision d{.id = std::string(in.str()), .model_digest = std::string(in.str()),
                   .policy_revision = std::string(in.str())};
  KEEL_FUZZ_CHECK(d.validate().ok() == rule(d.id), "decision::validate (model and revision are <= 255 by construction)");

  const std::string_view h32 = all.substr(0, 32), h64 = all.substr(0, 64);
  const auto owner = keel::owner_id::from_hex(h32);
  KEEL_FUZZ_CHECK(owner.has_value() == hex_rule(h32, 32), "owner_id::from_hex accepts exactly 32 hex digits");
  if (owner) {
    KEEL_FUZZ_CHECK(owner->hex() == lower(h32), "owner_id hex round trip");
    KEEL_FUZZ_CHECK(keel::owner_id::from_bytes(owner->bytes()) == *owner, "owner_id bytes round trip");
  }
  const auto dg = keel::digest::from_hex(h64);
  KEEL_FUZZ_CHECK(dg.has_value() == hex_rule(h64, 64), "digest::from_hex accepts exactly 64 hex digits");
  if (dg) KEEL_FUZZ_CHECK(dg->hex() == lower(h64), "digest hex round trip");
  return 0;
}
