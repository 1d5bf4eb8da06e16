// What keel's fuzz targets share: a check that names the broken promise and
// aborts (libFuzzer records the input; the replay test fails), and a reader
// that splits the fuzzer's bytes into typed pieces.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#define KEEL_FUZZ_CHECK(cond, what)                                                      \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      std::fprintf(stderr, "%s:%d: fuzz check failed: %s (%s)\n", __FILE__, __LINE__, #cond, what); \
      std::abort();                                                                      \
    }                                                                                    \
  } while (0)

namespace keel::fuzz {

// Takes bytes off the front of the input; past the end it yields zeros and
// empty strings, so every input is a valid (if short) program.
class reader {
 public:
  reader(const std::uint8_t* data, std::size_t size) : rest_(reinterpret_cast<const char*>(data), size) {}

  [[nodiscard]] bool empty() const noexcept { return rest_.empty(); }
  [[nodiscard]] std::size_t left() const noexcept { return rest_.size(); }

  std::uint8_t u8() noexcept {
    if (rest_.empty()) return 0;
    const auto c = static_cast<std::uint8_t>(rest_[0]);
    rest_.remove_prefix(1);
    return c;
  }
  std::uint64_t u64() noexcept {
    std::uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v = v << 8 | u8();
    return v;
  }
  std::int64_t i64() noexcept { return static_cast<std::int64_t>(u64()); }
  // A string of a length read first (one byte, so at most 255).
  std::string_view str() noexcept { return take(u8()); }
  // n bytes (fewer at the end).
  std::string_view take(std::size_t n) noexcept {
    const std::string_view s = rest_.substr(0, n);
    rest_.remove_prefix(s.size());
    return s;
  }
  // Everything left.
  std::string_view rest() noexcept { return take(rest_.size()); }

 private:
  std::string_view rest_;
};

}  // namespace keel::fuzz
