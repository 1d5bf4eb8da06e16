// libFuzzer property target: the digest builder's field framing
// (keel/durable/digest.hpp). Two field lists are read from the input; each is
// framed (detail::frame_*, the code digest_builder hashes through) into
// bytes. Promises checked:
//
//   - an independent parser, written here from the documented encoding,
//     reads every framing back to exactly the list it came from and nothing
//     more: the framing is injective, so distinct lists never frame alike;
//   - distinct lists frame to distinct bytes (checked directly as well);
//   - digest_builder's digest is sha256 of exactly those bytes, so the
//     builder hashes the framing and nothing else.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "check.hpp"
#include "keel/durable/digest.hpp"

namespace {

struct field {
  std::string name;
  std::variant<std::string, std::int64_t> value;
  friend bool operator==(const field&, const field&) = default;
};
using fields = std::vector<field>;

struct string_sink {
  std::string bytes;
  void update(const unsigned char* p, std::size_t n) { bytes.append(reinterpret_cast<const char*>(p), n); }
};

std::string frame(const fields& fs) {
  string_sink s;
  keel::detail::frame_bytes(s, keel::detail::digest_domain_tag);
  for (const field& f : fs) {
    if (const auto* v = std::get_if<std::string>(&f.value)) keel::detail::frame_field(s, f.name, std::string_view(*v));
    else keel::detail::frame_field(s, f.name, std::get<std::int64_t>(f.value));
  }
  return s.bytes;
}

keel::digest build(const fields& fs) {
  keel::digest_builder b;
  for (const field& f : fs) {
    if (const auto* v = std::get_if<std::string>(&f.value)) b.field(f.name, std::string_view(*v));
    else b.field(f.name, std::get<std::int64_t>(f.value));
  }
  return b.finish();
}

// The documented encoding, read back: "keel.digest.v1", then per field u8
// type ('s' or 'i'), u64 name length, name, and for 's' u64 length + bytes,
// for 'i' 8 bytes; all big-endian. nullopt for anything else.
std::optional<fields> parse(std::string_view in) {
  constexpr std::string_view tag = "keel.digest.v1";
  if (in.substr(0, tag.size()) != tag) return std::nullopt;
  in.remove_prefix(tag.size());
  auto u64 = [&](std::uint64_t& v) {
    if (in.size() < 8) return false;
    v = 0;
    for (int i = 0; i < 8; ++i) v = v << 8 | static_cast<unsigned char>(in[static_cast<std::size_t>(i)]);
    in.remove_prefix(8);
    return true;
  };
  auto bytes = [&](std::string& out) {
    std::uint64_t n = 0;
    if (!u64(n) || n > in.size()) return false;
    out.assign(in.substr(0, static_cast<std::size_t>(n)));
    in.remove_prefix(static_cast<std::size_t>(n));
    return true;
  };
  fields out;
  while (!in.empty()) {
    const char type = in[0];
    in.remove_prefix(1);
    field f;
    if (!bytes(f.name)) return std::nullopt;
    if (type == 's') {
      std::string v;
      if (!bytes(v)) return std::nullopt;
      f.value = std::move(v);
    } else if (type == 'i') {
      std::uint64_t v = 0;
      if (!u64(v)) return std::nullopt;
      f.value = static_cast<std::int64_t>(v);
    } else {
      return std::nullopt;
    }
    out.push_back(std::move(f));
  }
  return out;
}

// A list of up to 8 fields from the input. Names and values are short and
// drawn from a small alphabet half the time, so that near-misses (the same
// bytes split differently, "7" beside 7) are common.
fields read_list(keel::fuzz::reader& in) {
  fields out;
  const int n = in.u8() % 9;
  for (int i = 0; i < n && !in.empty(); ++i) {
    const std::uint8_t kind = in.u8();
    field f;
    f.name = std::string(in.take(in.u8() % 8));
    if (kind & 1) {
      f.value = static_cast<std::int64_t>(in.u64());
    } else {
      f.value = std::string(in.take(in.u8() % ((kind & 2) ? 256 : 8)));
    }
    out.push_back(std::move(f));
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  keel::fuzz::reader in(data, size);
  const fields a = read_list(in), b = read_list(in);
  const std::string fa = frame(a), fb = frame(b);

  const std::optional<fields> ra = parse(fa), rb = parse(fb);
  KEEL_FUZZ_CHECK(ra.has_value() && *ra == a, "the framing reads back to the list it came from");
  KEEL_FUZZ_CHECK(rb.has_value() && *rb == b, "the framing reads back to the list it came from");
  KEEL_FUZZ_CHECK((a == b) == (fa == fb), "distinct field lists frame to distinct bytes");

  const keel::digest da = build(a);
  KEEL_FUZZ_CHECK(da == keel::sha256(fa), "digest_builder hashes exactly the framing");
  KEEL_FUZZ_CHECK((a == b) == (da == build(b)), "distinct field lists give distinct digests");

  // The rest of the input as a framing: the parser must not crash, and what
  // it accepts must frame back to the same bytes (no two framings of one list).
  const std::string_view tail = in.rest();
  const std::string raw = std::string(keel::detail::digest_domain_tag) + std::string(tail);
  if (const std::optional<fields> r = parse(raw)) KEEL_FUZZ_CHECK(frame(*r) == raw, "one framing per list");
  return 0;
}
