// libFuzzer target: the SQLite store reading rows it did not write — damaged,
// hand-edited, or from another keel version — in a real database
// (sqlite_fixture.hpp: a temporary file). Each input writes one record, one
// lease, one result and the purged-fence floor with column values of any
// SQLite type (integers at the edges, bytes of any length, text, reals,
// NULL), then runs the store's operations on them through its public API,
// moving the clock between them.
//
// Promises checked beyond the sanitizers (a fence + 1 that overflows is
// undefined behaviour, caught by UBSan):
//   - a replay hands back only a decision commit() would accept (a known
//     status code, an id of 1-255 bytes, ...);
//   - a claim's fence is >= 1 and above the damaged row's fence when it
//     replaced a row;
//   - every failure is a status, and a failure about the data itself is
//     DataLoss (the row is left alone: the next read fails the same way).
#include <sqlite3.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "check.hpp"
#include "sqlite_fixture.hpp"

namespace {

const keel::request_identity id{.tenant = "t", .endpoint = "e", .key = "k"};
const keel::owner_id owner_a{0x0102030405060708, 0x090a0b0c0d0e0f10}, owner_b{7, 7};
constexpr std::string_view work = "w", result_key = "r";

keel::digest request_a() { return keel::digest_builder().field("r", "a").finish(); }

// One column value of any type, biased toward what keel itself writes.
void bind_any(sqlite3_stmt* st, int col, keel::fuzz::reader& in, std::string_view usual_bytes) {
  const std::uint8_t how = in.u8();
  switch (how % 8) {
    case 0: sqlite3_bind_int64(st, col, in.i64()); break;
    case 1: {
      static constexpr std::int64_t edges[] = {0, 1, 2, 3, -1, INT64_MAX, INT64_MAX - 1, INT64_MIN, 16, 17, 255};
      sqlite3_bind_int64(st, col, edges[(how >> 3) % std::size(edges)]);
      break;
    }
    case 2: sqlite3_bind_int64(st, col, static_cast<std::int64_t>(how >> 3)); break;
    case 3: {
      const std::string_view b = in.str();
      sqlite3_bind_blob(st, col, b.empty() ? "" : b.data(), static_cast<int>(b.size()), SQLITE_TRANSIENT);
      break;
    }
    case 4: {
      const std::string_view t = in.str();
      sqlite3_bind_text(st, col, t.data(), static_cast<int>(t.size()), SQLITE_TRANSIENT);
      break;
    }
    case 5: sqlite3_bind_double(st, col, static_cast<double>(in.i64()) / 1024); break;
    case 6: sqlite3_bind_null(st, col); break;
    default:
      sqlite3_bind_blob(st, col, usual_bytes.empty() ? "" : usual_bytes.data(), static_cast<int>(usual_bytes.size()),
                        SQLITE_TRANSIENT);
  }
}

// INSERT with every column bound from the input; a NOT NULL or CHECK
// violation just leaves the table without that row.
void insert(sqlite3* db, const char* sql, int columns, keel::fuzz::reader& in, const std::string_view* usual) {
  sqlite3_stmt* st = nullptr;
  if (sqlite3_prepare_v2(db, sql, -1, &st, nullptr) != SQLITE_OK) std::abort();
  for (int c = 1; c <= columns; ++c) bind_any(st, c, in, usual[c - 1]);
  (void)sqlite3_step(st);
  sqlite3_finalize(st);
}

void check_status(const absl::Status& s) {
  if (s.ok()) return;
  const absl::StatusCode c = s.code();
  KEEL_FUZZ_CHECK(c == absl::StatusCode::kDataLoss || c == absl::StatusCode::kFailedPrecondition ||
                      c == absl::StatusCode::kAlreadyExists || c == absl::StatusCode::kAborted,
                  std::string(s.message()).c_str());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  keel::fuzz::reader in(data, size);
  keel::fuzz::sqlite_fixture& f = keel::fuzz::sqlite_fixture::get();
  f.reset();
  auto& store = f.store();
  sqlite3* db = f.raw();

  const keel::digest req = request_a();
  const auto ob = owner_a.bytes();
  const std::string_view owner_bytes(reinterpret_cast<const char*>(ob.data()), ob.size());
  const std::string_view rec_usual[] = {"t", "e", "k", req.view(), "", owner_bytes, "", "", "", "id", "m", "rev",
                                        "res", "", "msg", ""};
  const std::uint8_t what = in.u8();
  if (what & 1) {
    // tenant, endpoint, key fixed; the other 13 columns from the input.
    sqlite3_stmt* st = nullptr;
    if (sqlite3_prepare_v2(db,
                           "INSERT INTO keel_idempotency(tenant, endpoint, key, request, state, owner, fence,"
                           " lease_expires, record_expires, decision_id, model_digest, policy_revision, result,"
                           " error_code, error_message, committed_at)"
                           " VALUES (X'74', X'65', X'6b', ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16)",
                           -1, &st, nullptr) != SQLITE_OK)
      std::abort();
    for (int c = 4; c <= 16; ++c) bind_any(st, c, in, rec_usual[c - 1]);
    (void)sqlite3_step(st);
    sqlite3_finalize(st);
  }
  if (what & 2) {
    const std::string_view usual[] = {"w", owner_bytes, "", "", ""};
    insert(db, "INSERT INTO keel_lease(work_key, owner, fence, expires, held) VALUES (X'77', ?2, ?3, ?4, ?5)", 5, in,
           usual);
  }
  if (what & 4) {
    const std::string_view usual[] = {"r", "value", "", ""};
    insert(db, "INSERT INTO keel_result(key, value, saved_at, expires) VALUES (X'72', ?2, ?3, ?4)", 4, in, usual);
  }
  if (what & 8) {
    const std::string_view usual[] = {"", "", "", "", ""};
    insert(db, "INSERT INTO keel_lease(work_key, owner, fence, expires, held) VALUES (X'00', X'', ?3, ?4, ?5)", 5, in,
           usual);
  }
  // Read the damaged row's fence as the store would have to, to check claims go above it.
  std::int64_t row_fence = 0;
  {
    sqlite3_stmt* st = nullptr;
    if (sqlite3_prepare_v2(db, "SELECT fence, typeof(fence) FROM keel_idempotency", -1, &st, nullptr) != SQLITE_OK)
      std::abort();
    if (sqlite3_step(st) == SQLITE_ROW && std::string_view(reinterpret_cast<const char*>(sqlite3_column_text(st, 1))) == "integer")
      row_fence = sqlite3_column_int64(st, 0);
    sqlite3_finalize(st);
  }

  // The operations, in an order and with tokens chosen by the input.
  for (int step = 0; step < 6 && !in.empty(); ++step) {
    const std::uint8_t op = in.u8();
    f.clock().advance(std::chrono::milliseconds(in.u8()) * ((op & 0x80) ? 1000 : 1));
    const keel::owner_id& who = (op & 0x40) ? owner_b : owner_a;
    const keel::ownership token{who, (op & 0x20) ? row_fence : 1};
    switch (op % 10) {
      case 0:
      case 1: {
        const keel::digest d = (op & 0x10) ? keel::digest_builder().field("r", "b").finish() : req;
        const absl::StatusOr<keel::begin_outcome> b = store.begin(id, d, who, {});
        check_status(b.status());
        if (!b.ok()) break;
        if (b->state == keel::begin_state::replay) {
          KEEL_FUZZ_CHECK(b->decision.validate().ok(), "a replayed decision is one commit() would accept");
          KEEL_FUZZ_CHECK(static_cast<int>(b->decision.error_code) >= 0 && static_cast<int>(b->decision.error_code) <= 16,
                          "a replayed failure has a known status code");
        }
        if (b->state == keel::begin_state::claimed) {
          KEEL_FUZZ_CHECK(b->ownership.fence >= 1, "a claim's fence is >= 1");
          KEEL_FUZZ_CHECK(b->ownership.fence >= row_fence, "fences never go backwards past a row read back");
        }
        break;
      }
      case 2: check_status(store.extend(id, token, std::chrono::seconds(5))); break;
      case 3:
        check_status(store.commit(id, token, {.id = "d", .result = "x"}, std::chrono::seconds(60)));
        break;
      case 4: check_status(store.abandon(id, token)); break;
      case 5: {
        const absl::StatusOr<keel::lease_claim> c = store.claim(work, who, std::chrono::seconds(5));
        check_status(c.status());
        if (c.ok() && c->acquired) KEEL_FUZZ_CHECK(c->ownership.fence >= 1, "a lease fence is >= 1");
        break;
      }
      case 6: check_status(store.renew(work, token, std::chrono::seconds(5))); break;
      case 7: check_status(store.release(work, token)); break;
      case 8: {
        const auto r = store.load_result(result_key);
        check_status(r.status());
        check_status(store.save_result(result_key, "v", std::chrono::seconds(5)).status());
        break;
      }
      default: {
        const absl::StatusOr<std::int64_t> n = store.purge_expired();
        check_status(n.status());
        if (n.ok()) KEEL_FUZZ_CHECK(*n >= 0, "purge counts rows");
      }
    }
  }
  return 0;
}
