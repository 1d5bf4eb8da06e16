// keel/durable/digest.hpp — SHA-256 request digests, and a builder that frames named
// fields so that the same logical request gives the same key on every
// process and machine.
//
// An idempotency record is keyed by a client key *and* a digest of the
// request's canonical contents: the same key with other contents is a
// conflict, not a replay. A fan-out unit's result is saved under a digest of
// what determines it (product facts, model, rubric). Both need a digest that
// is
//
//   - unambiguous: fields are framed by type and length, so ("ab", "c") and
//     ("a", "bc") never collide, and a name cannot be confused with a value;
//   - stable: integers are encoded big-endian at fixed width, nothing depends
//     on the host's byte order, locale or struct layout;
//   - versioned: every digest starts with the domain tag "keel.digest.v1".
//
// Example:
//
//   keel::digest key = keel::digest_builder()
//                          .field("facts", canonical_facts_json)
//                          .field("model", "gpt-x-2025-06")
//                          .field("rubric", "panel-v3")
//                          .field("rubric_revision", std::int64_t{7})
//                          .finish();
//   std::string hex = key.hex();   // 64 lower-case hex digits
//
//   keel::digest body = keel::sha256(raw_bytes);   // a plain SHA-256
//
// The builder hashes as it goes (OpenSSL's EVP interface, libcrypto): the
// SHA-256 implementation is fetched once per process and each thread reuses
// one EVP_MD_CTX, so building a digest allocates nothing after a thread's
// first one. Field order matters: callers write fields in a fixed order.
//
// Thread-safety: digest is a value. A digest_builder belongs to one thread;
// any number of builders may run on different threads at once (and several
// on one thread: only the first borrows the thread's reusable context).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include <openssl/evp.h>

namespace keel {

// A SHA-256 value.
struct digest {
  std::array<unsigned char, 32> bytes{};

  // 64 lower-case hex digits.
  [[nodiscard]] std::string hex() const {
    static constexpr char digits[] = "0123456789abcdef";
    std::string out(64, '0');
    for (std::size_t i = 0; i < bytes.size(); ++i) {
      out[2 * i] = digits[bytes[i] >> 4];
      out[2 * i + 1] = digits[bytes[i] & 0xf];
    }
    return out;
  }

  // Parses 64 hex digits (either case); nullopt for anything else.
  [[nodiscard]] static std::optional<digest> from_hex(std::string_view s) {
    if (s.size() != 64) return std::nullopt;
    digest d;
    for (std::size_t i = 0; i < 32; ++i) {
      const int hi = nibble(s[2 * i]), lo = nibble(s[2 * i + 1]);
      if (hi < 0 || lo < 0) return std::nullopt;
      d.bytes[i] = static_cast<unsigned char>(hi << 4 | lo);
    }
    return d;
  }

  [[nodiscard]] std::string_view view() const noexcept {
    return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
  }

  friend bool operator==(const digest&, const digest&) = default;

 private:
  static constexpr int nibble(char c) noexcept {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  }
};

namespace detail {

// The SHA-256 implementation, fetched once per process (fetching it per call
// costs more than hashing 64 bytes).
[[nodiscard]] inline const EVP_MD* sha256_md() {
  static EVP_MD* const md = EVP_MD_fetch(nullptr, "SHA256", nullptr);
  return md;
}

// One reusable EVP_MD_CTX per thread, lent to one builder at a time.
struct ctx_slot {
  EVP_MD_CTX* ctx = nullptr;
  ~ctx_slot() { EVP_MD_CTX_free(ctx); }
};
inline thread_local ctx_slot thread_ctx;

[[noreturn]] inline void digest_failure() {
  // Only a broken libcrypto (no SHA-256, out of memory inside OpenSSL) gets
  // here; a digest that silently differed would merge unrelated requests.
  throw std::bad_alloc();
}

// The framing of digest_builder (version 1), written to any sink with
// `void update(const unsigned char*, std::size_t)`: the builder's sink
// hashes, the fuzz target's (tests/fuzz/digest_fuzz.cpp) keeps the bytes and
// checks that distinct field lists never frame to the same ones.
inline constexpr std::string_view digest_domain_tag = "keel.digest.v1";

template <class Sink>
void frame_bytes(Sink& sink, std::string_view s) {
  if (!s.empty()) sink.update(reinterpret_cast<const unsigned char*>(s.data()), s.size());
}
template <class Sink>
void frame_u64(Sink& sink, std::uint64_t v) {
  unsigned char b[8];
  for (int i = 7; i >= 0; --i) {
    b[i] = static_cast<unsigned char>(v & 0xff);
    v >>= 8;
  }
  sink.update(b, sizeof b);
}
template <class Sink>
void frame_header(Sink& sink, char type, std::string_view name) {
  const auto t = static_cast<unsigned char>(type);
  sink.update(&t, 1);
  frame_u64(sink, name.size());
  frame_bytes(sink, name);
}
template <class Sink>
void frame_field(Sink& sink, std::string_view name, std::string_view value) {
  frame_header(sink, 's', name);
  frame_u64(sink, value.size());
  frame_bytes(sink, value);
}
template <class Sink>
void frame_field(Sink& sink, std::string_view name, std::int64_t value) {
  frame_header(sink, 'i', name);
  frame_u64(sink, static_cast<std::uint64_t>(value));
}

}  // namespace detail

// Builds a digest over typed, named, length-framed fields.
//
// Encoding (version 1), all integers big-endian:
//   "keel.digest.v1"
//   per field: u8 type ('s' bytes, 'i' int64), u64 name length, name,
//              then for 's': u64 value length, value; for 'i': 8 bytes.
class digest_builder {
 public:
  digest_builder() {
    ctx_ = detail::thread_ctx.ctx;
    if (ctx_ != nullptr) {
      detail::thread_ctx.ctx = nullptr;  // borrowed; a nested builder makes its own
    } else {
      ctx_ = EVP_MD_CTX_new();
      if (ctx_ == nullptr) detail::digest_failure();
    }
    if (EVP_DigestInit_ex2(ctx_, detail::sha256_md(), nullptr) != 1) {
      give_back();
      detail::digest_failure();
    }
    hasher h = sink();
    detail::frame_bytes(h, detail::digest_domain_tag);
  }
  ~digest_builder() { give_back(); }
  digest_builder(const digest_builder&) = delete;
  digest_builder& operator=(const digest_builder&) = delete;

  // A byte-string field.
  digest_builder& field(std::string_view name, std::string_view value) & {
    hasher h = sink();
    detail::frame_field(h, name, value);
    return *this;
  }
  digest_builder&& field(std::string_view name, std::string_view value) && { return std::move(field(name, value)); }
  // Without this, a string literal would pick the bool-like integer overload.
  digest_builder& field(std::string_view name, const char* value) & { return field(name, std::string_view(value)); }
  digest_builder&& field(std::string_view name, const char* value) && {
    return std::move(field(name, std::string_view(value)));
  }

  // An integer field (fixed width: 7 and "7" are different fields).
  digest_builder& field(std::string_view name, std::int64_t value) & {
    hasher h = sink();
    detail::frame_field(h, name, value);
    return *this;
  }
  digest_builder&& field(std::string_view name, std::int64_t value) && { return std::move(field(name, value)); }

  // The digest. The builder must not be used afterwards.
  [[nodiscard]] keel::digest finish() {
    keel::digest d;
    unsigned int n = 0;
    if (EVP_DigestFinal_ex(ctx_, d.bytes.data(), &n) != 1 || n != d.bytes.size()) detail::digest_failure();
    return d;
  }

 private:
  void give_back() noexcept {
    if (ctx_ == nullptr) return;
    if (detail::thread_ctx.ctx == nullptr) {
      detail::thread_ctx.ctx = ctx_;
    } else {
      EVP_MD_CTX_free(ctx_);
    }
    ctx_ = nullptr;
  }
  // The framing's sink (detail::frame_*): hashes what it is given.
  struct hasher {
    EVP_MD_CTX* ctx;
    void update(const unsigned char* p, std::size_t n) const {
      if (EVP_DigestUpdate(ctx, p, n) != 1) detail::digest_failure();
    }
  };
  [[nodiscard]] hasher sink() const noexcept { return {ctx_}; }

  EVP_MD_CTX* ctx_ = nullptr;
};

// Plain SHA-256 of `bytes` (no framing, no domain tag): equal to
// `sha256sum` of the same bytes.
[[nodiscard]] inline digest sha256(std::string_view bytes) {
  EVP_MD_CTX* ctx = detail::thread_ctx.ctx;
  if (ctx != nullptr) {
    detail::thread_ctx.ctx = nullptr;
  } else {
    ctx = EVP_MD_CTX_new();
    if (ctx == nullptr) detail::digest_failure();
  }
  digest d;
  unsigned int n = 0;
  const bool ok = EVP_DigestInit_ex2(ctx, detail::sha256_md(), nullptr) == 1 &&
                  EVP_DigestUpdate(ctx, bytes.data(), bytes.size()) == 1 &&
                  EVP_DigestFinal_ex(ctx, d.bytes.data(), &n) == 1 && n == d.bytes.size();
  if (detail::thread_ctx.ctx == nullptr) {
    detail::thread_ctx.ctx = ctx;
  } else {
    EVP_MD_CTX_free(ctx);
  }
  if (!ok) detail::digest_failure();
  return d;
}

}  // namespace keel
