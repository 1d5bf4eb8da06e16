// libFuzzer target: the PostgreSQL store decoding what its begin statement
// answers (detail::pg_begin_outcome), without a server. The input describes
// a result — how many columns and rows, and each value as binary bytes of
// any length or NULL, biased toward the shapes the statement returns — which
// is built client-side with libpq's own PGresult functions
// (PQmakeEmptyPGresult, PQsetResultAttrs, PQsetvalue), the object the store
// would get. A row damaged or written by another keel version comes back
// this way.
//
// Promises checked beyond the sanitizers: an outcome is trusted only if
// well-formed (a claim's fence in [1, 2^63 - 2], a replayed decision commit()
// would accept); anything else is DataLoss or "run the statement again".
#include <libpq-fe.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "check.hpp"
#include "keel/store/postgres.hpp"

namespace {

std::string be(std::int64_t v, std::size_t width) {
  std::string out(width, '\0');
  for (std::size_t i = 0; i < width; ++i) out[width - 1 - i] = static_cast<char>(static_cast<std::uint64_t>(v) >> (8 * i));
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  keel::fuzz::reader in(data, size);
  const std::uint8_t shape = in.u8();
  const int columns = (shape & 0x80) ? shape % 20 : 14;
  const int rows = (shape & 0x40) ? 0 : 1 + (shape & 1);
  PGresult* res = PQmakeEmptyPGresult(nullptr, PGRES_TUPLES_OK);
  if (res == nullptr) std::abort();
  std::vector<PGresAttDesc> attrs(static_cast<std::size_t>(columns));
  std::vector<std::string> names(attrs.size());
  for (std::size_t c = 0; c < attrs.size(); ++c) {
    names[c] = "c" + std::to_string(c);
    attrs[c] = {.name = names[c].data(), .tableid = 0, .columnid = 0, .format = 1, .typid = 17, .typlen = -1, .atttypmod = -1};
  }
  if (columns > 0 && PQsetResultAttrs(res, columns, attrs.data()) == 0) std::abort();
  // Integer columns as the statement types them (int4, int8, bool), the rest bytea.
  static constexpr int width[14] = {4, 8, 8, 4, 1, 8, 1, 0, 0, 0, 0, 8, 0, 8};
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < columns; ++c) {
      const std::uint8_t how = in.u8();
      std::string v;
      const int w = c < 14 ? width[c] : 0;
      switch (how % 6) {
        case 0: v = w > 0 ? be(static_cast<std::int8_t>(in.u8()), static_cast<std::size_t>(w)) : std::string(in.str()); break;
        case 1: v = w > 0 ? be(in.i64(), static_cast<std::size_t>(w)) : std::string(in.str()); break;
        case 2: v = be((how & 0x80) ? INT64_MAX : INT64_MIN, w > 0 ? static_cast<std::size_t>(w) : 8); break;
        case 3: v = std::string(in.str()); break;  // any bytes, any length
        case 4:
          if (PQsetvalue(res, r, c, nullptr, -1) == 0) std::abort();  // NULL
          continue;
        default: v = w > 0 ? be(how >> 3, static_cast<std::size_t>(w)) : std::string(in.take(how >> 4)); break;
      }
      if (PQsetvalue(res, r, c, v.data(), static_cast<int>(v.size())) == 0) std::abort();
    }
  }
  const keel::detail::pg_result x(res);

  const keel::request_identity id{.tenant = "t", .endpoint = "e", .key = "k"};
  const keel::owner_id owner{1, 2};
  const keel::begin_options o{.supersede_revision = (shape & 2) ? "rev" : ""};
  const std::optional<absl::StatusOr<keel::begin_outcome>> out =
      keel::detail::pg_begin_outcome(x, id, owner, o, "postgres store 'fuzz'");
  if (!out) return 0;  // run again
  if (!out->ok()) {
    KEEL_FUZZ_CHECK(out->status().code() == absl::StatusCode::kDataLoss, std::string(out->status().message()).c_str());
    return 0;
  }
  const keel::begin_outcome& b = **out;
  if (b.state != keel::begin_state::conflict)
    KEEL_FUZZ_CHECK(b.ownership.fence >= 1 && b.ownership.fence < INT64_MAX, "a fence a claim could issue");
  if (b.state == keel::begin_state::claimed) KEEL_FUZZ_CHECK(b.ownership.owner == owner, "a claim is the claimant's");
  if (b.state == keel::begin_state::replay) {
    KEEL_FUZZ_CHECK(b.decision.validate().ok(), "a replayed decision is one commit() would accept");
    const int code = static_cast<int>(b.decision.error_code);
    KEEL_FUZZ_CHECK(code >= 0 && code <= 16, "a replayed failure has a known status code");
  }
  return 0;
}
