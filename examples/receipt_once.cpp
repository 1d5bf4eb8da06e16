// receipt_once — the seed's receipt scenario, end to end on a SQLite file.
//
// A merchant's client sends receipts for a model to decide (approve or
// flag). Retries must not pay for a second model call or produce a second,
// different decision:
//
//   1. a new receipt is decided once;
//   2. the same key is replayed with the same decision id;
//   3. the same key with changed contents is refused as a conflict;
//   4. two concurrent duplicates make one model call;
//   5. a run that exits after the commit but before answering: the next run
//      recovers the decision.
//
// Usage: receipt_once [path/to/store.db]   (default: a fresh temporary file)
#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>

#include <unistd.h>

#include "keel/core/call.hpp"
#include "keel/durable/digest.hpp"
#include "keel/durable/once.hpp"
#include "keel/store/sqlite.hpp"

using namespace std::chrono_literals;

namespace {

std::atomic<int> model_calls{0};

// The expensive part: a simulated model reading a receipt.
absl::StatusOr<keel::decision> ask_model(const keel::claim_context& claim, std::string_view receipt) {
  model_calls.fetch_add(1);
  std::this_thread::sleep_for(150ms);  // inference takes time; duplicates arrive meanwhile
  if (claim.stop.stop_requested()) return absl::CancelledError("caller gone");
  const bool flag = receipt.find("casino") != std::string_view::npos;
  return keel::decision{.model_digest = "receipt-reader@sha256:7e1f", .result = flag ? "flag" : "approve"};
}

keel::digest canonical(std::string_view receipt) {
  // The canonical request: what the decision depends on, in fixed fields.
  return keel::digest_builder().field("schema", "receipt/v2").field("body", receipt).finish();
}

keel::idempotency_options options() {
  return {.lease = 30s, .retention = 48h, .retry_window = 24h, .policy_revision = "expense-policy-2025-10"};
}

std::unique_ptr<keel::sqlite_store<>> open_store(const std::string& path) {
  auto store = keel::sqlite_store<>::open(path);
  if (!store.ok()) {
    std::fprintf(stderr, "cannot open the store: %s\n", std::string(store.status().message()).c_str());
    std::exit(1);
  }
  return std::move(*store);
}

absl::StatusOr<keel::once_result> submit(keel::once<keel::sqlite_store<>>& decide, const keel::request_identity& id,
                                         std::string_view receipt) {
  keel::call call(keel::real_clock{}.now(), {.timeout = 5s, .response_reserve = 200ms});
  return decide.run(call, id, canonical(receipt),
                    [&](const keel::claim_context& c) { return ask_model(c, receipt); });
}

const char* verdict(const absl::StatusOr<keel::once_result>& r) {
  return r.ok() ? r->decision.result.c_str() : "-";
}

// Step 5's first run: decide, commit, and exit before the answer is sent.
int decide_then_vanish(const std::string& path) {
  auto store = open_store(path);
  keel::once decide(*store, options());
  const keel::request_identity id{.tenant = "merchant-82", .endpoint = "receipts", .key = "key-49"};
  auto r = submit(decide, id, "Taxi 23.40 EUR, 2025-10-06");
  if (!r.ok()) return 1;
  std::printf("%s\n", r->decision.id.c_str());  // for the test harness reading us
  std::fflush(stdout);
  std::_Exit(0);  // the process dies after the commit; the client never hears back
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--decide-then-exit") return decide_then_vanish(argv[2]);

  std::string path;
  std::string dir;
  if (argc > 1) {
    path = argv[1];
  } else {
    std::string pattern = std::filesystem::temp_directory_path().string() + "/receipt-once-XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) return 1;
    dir = pattern;
    path = dir + "/receipts.db";
  }
  std::printf("Store: %s (SQLite, WAL; survives restarts, shared by processes)\n\n", path.c_str());
  auto store = open_store(path);
  keel::once decide(*store, options());
  const keel::request_identity key47{.tenant = "merchant-82", .endpoint = "receipts", .key = "key-47"};
  const std::string receipt_a = "Lunch 42.17 EUR, Cafe Nord, 2025-10-06";

  std::printf("1. A new receipt (key-47) arrives.\n");
  auto first = submit(decide, key47, receipt_a);
  if (!first.ok()) return std::printf("   unexpected: %s\n", first.status().ToString().c_str()), 1;
  std::printf("   The model read it once and decided '%s': decision %s.\n", verdict(first),
              first->decision.id.c_str());

  std::printf("\n2. The client did not see the answer and sends key-47 again.\n");
  auto again = submit(decide, key47, receipt_a);
  if (!again.ok()) return 1;
  std::printf("   Replayed from the store: decision %s (%s), model calls so far: %d.\n",
              again->decision.id.c_str(), again->decision.id == first->decision.id ? "the same id" : "A NEW ID?!",
              model_calls.load());

  std::printf("\n3. Someone reuses key-47 for a different receipt.\n");
  auto changed = submit(decide, key47, "Lunch 421.70 EUR, Cafe Nord, 2025-10-06");
  std::printf("   Refused: %s\n   (model calls so far: %d)\n",
              keel::is_conflict(changed.status()) ? "conflict, the key belongs to another receipt" : "NOT a conflict?!",
              model_calls.load());

  std::printf("\n4. Two copies of a new receipt (key-48) arrive at the same moment.\n");
  const int before = model_calls.load();
  const keel::request_identity key48{.tenant = "merchant-82", .endpoint = "receipts", .key = "key-48"};
  absl::StatusOr<keel::once_result> x = absl::UnknownError(""), y = absl::UnknownError("");
  {
    std::jthread a([&] { x = submit(decide, key48, "Hotel 180.00 EUR, 2 nights"); });
    std::jthread b([&] { y = submit(decide, key48, "Hotel 180.00 EUR, 2 nights"); });
  }
  if (!x.ok() || !y.ok()) return 1;
  std::printf("   One waited for the other: %d model call, decisions %s and %s (%s).\n", model_calls.load() - before,
              x->decision.id.c_str(), y->decision.id.c_str(),
              x->decision.id == y->decision.id ? "the same" : "DIFFERENT?!");

  std::printf("\n5. A run decides key-49, commits, and exits before answering.\n");
  std::string recovered_from;
  {
    // Another run of this same program, as a separate process.
    const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
    const std::string cmd = "'" + self + "' --decide-then-exit '" + path + "'";
    FILE* child = ::popen(cmd.c_str(), "r");
    std::array<char, 128> line{};
    if (child != nullptr && std::fgets(line.data(), line.size(), child) != nullptr) recovered_from = line.data();
    if (child != nullptr) ::pclose(child);
    if (!recovered_from.empty() && recovered_from.back() == '\n') recovered_from.pop_back();
  }
  std::printf("   That run committed decision %s and vanished; its client got nothing.\n", recovered_from.c_str());
  const int before_retry = model_calls.load();
  const keel::request_identity key49{.tenant = "merchant-82", .endpoint = "receipts", .key = "key-49"};
  auto retry = submit(decide, key49, "Taxi 23.40 EUR, 2025-10-06");
  if (!retry.ok()) return 1;
  std::printf("   The client retries; this run recovers decision %s ('%s') with %d model calls.\n",
              retry->decision.id.c_str(), verdict(retry), model_calls.load() - before_retry);
  const bool ok = retry->decision.id == recovered_from && retry->replayed &&
                  again->decision.id == first->decision.id && keel::is_conflict(changed.status()) &&
                  x->decision.id == y->decision.id;
  std::printf("\n%s\n", ok ? "Every retry got the decision already made; no receipt was paid for twice."
                          : "SOMETHING WENT WRONG: see above.");
  store.reset();
  if (!dir.empty()) std::filesystem::remove_all(dir);
  return ok ? 0 : 1;
}
