// Failover tests: a replicated store started by the test itself (a
// PostgreSQL primary + streaming standby, a Redis primary + replica:
// tests/servers/{postgres,redis}_pair.sh), K worker processes deciding keys
// and claiming leases through keel's public API while the test cuts the
// replication link, kills the primary and promotes the standby, and the
// bookkeeping that says afterwards what every acknowledgement became.
//
// Workers are this test binary re-executed (support/child_process.hpp)
// running the hidden test case "failover child process". They follow a
// phase file the parent writes:
//
//   A, B, X, C   run, labelling every acknowledgement with the phase it
//                started in (A before the link is cut, B after the cut and
//                before the kill, X while the failover happens, C after
//                the promotion)
//   pause        finish the operation in hand and park (each process
//                writes <out>.parked once all its threads are parked)
//   stop         write the log and exit
//
// Each acknowledgement is one line of the worker's log:
//
//   D <phase> <key> <decision id> <fence> <owner hex> <replayed 0/1>   keel::once returned a decision
//   L <phase> <work key> <owner hex> <fence>                            claim() acquired a lease
//   S <phase> <job id> <job key>                  a job store's submit() created a job (PostgreSQL)
//   J <phase> <job id> <owner hex> <fence> <key>  a claimed job's complete() succeeded
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "keel/core/call.hpp"
#include "keel/durable/digest.hpp"
#include "keel/durable/once.hpp"
#include "keel/durable/ownership.hpp"
#include "support/child_process.hpp"
#include "support/temp_dir.hpp"

namespace keel_failover {

inline std::string scripts_dir() {
  const char* s = std::getenv("KEEL_TEST_SERVER_SCRIPTS");
  if (s == nullptr || *s == '\0')
    throw std::runtime_error("KEEL_TEST_SERVER_SCRIPTS is not set: run through ctest, or export it as <repo>/tests/servers");
  return s;
}

// Runs `script cmd dir [arg]`; its output goes to <dir>.log. True on success.
inline bool control(const std::string& script, const std::string& cmd, const std::string& dir,
                    const std::string& arg = {}) {
  const std::string line = absl::StrCat("'", scripts_dir(), "/", script, "' ", cmd, " '", dir, "' ", arg, " >>'", dir,
                                        ".log' 2>&1");
  return std::system(line.c_str()) == 0;
}

inline std::string first_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// A replicated pair started by a tests/servers/*_pair.sh script in a fresh
// directory; stopped, data and all, when it goes out of scope.
class server_pair {
 public:
  server_pair(std::string script, const std::string& mode) : script_(std::move(script)) {
    dir_ = root_.path() + "/pair";
    if (!control(script_, "start", dir_, mode)) {
      const std::string log = keel_test::read_file(dir_ + ".log");
      (void)control(script_, "stop", dir_);  // whatever did start (the destructor will not run)
      throw std::runtime_error(absl::StrCat(script_, " start failed: ", log));
    }
  }
  ~server_pair() { (void)control(script_, "stop", dir_); }
  server_pair(const server_pair&) = delete;
  server_pair& operator=(const server_pair&) = delete;

  [[nodiscard]] const std::string& dir() const noexcept { return dir_; }
  [[nodiscard]] std::string file(const std::string& name) const { return first_line(dir_ + "/" + name); }
  bool run(const std::string& cmd) { return control(script_, cmd, dir_); }
  [[nodiscard]] std::string log() const { return keel_test::read_file(dir_ + ".log"); }

 private:
  std::string script_;
  keel_test::temp_dir root_;
  std::string dir_;
};

// ---- the workers ----------------------------------------------------------

inline std::string child_env(const char* name) { return keel_test::child_var("KEEL_FAILOVER_", name); }

inline keel::request_identity identity_of(const std::string& key) {
  return {.tenant = "t-1", .endpoint = "decide", .key = key};
}
inline keel::digest digest_of(const std::string& key) { return keel::digest_builder().field("request", key).finish(); }

inline bool file_exists(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0;
}

// The loop of one worker process: THREADS threads, each walking the same
// key sequence (so every key is contested by every thread of every
// process), deciding it through keel::once and then claiming and releasing
// one of LEASES work keys. Store is any keel store with both contracts.
// `extra(phase, n, log)`, when given, runs after each key's lease (the job
// store's part).
template <class Store>
int run_worker(Store& store,
               std::function<void(const std::string&, int, std::ostream&)> extra = {}) {
  const std::string phase_path = child_env("PHASE"), out_path = child_env("OUT");
  const int threads = std::stoi(child_env("THREADS"));
  const int leases = std::stoi(child_env("LEASES"));
  std::atomic<int> parked{0};
  std::vector<std::string> logs(static_cast<std::size_t>(threads));
  {
    std::vector<std::jthread> workers;
    for (int t = 0; t < threads; ++t)
      workers.emplace_back([&, t] {
        keel::once<Store> decide(store, {.lease = std::chrono::seconds(5),
                                         .retention = std::chrono::hours(2),
                                         .retry_window = std::chrono::hours(1),
                                         .on_duplicate = keel::on_duplicate::retry_later});
        std::ostringstream log;
        std::map<std::string, int> next;  // per phase
        for (;;) {
          const std::string phase = first_line(phase_path);
          if (phase == "stop") break;
          if (phase == "pause" || phase.empty()) {
            parked.fetch_add(1);
            while (first_line(phase_path) == "pause") std::this_thread::sleep_for(std::chrono::milliseconds(2));
            parked.fetch_sub(1);
            continue;
          }
          const int n = next[phase]++;
          const std::string key = absl::StrCat("d-", phase, "-", n);
          keel::ownership mine{};
          keel::call call(keel::real_clock{}.now(), {.timeout = std::chrono::seconds(3)});
          auto r = decide.run(call, identity_of(key), digest_of(key),
                              [&](const keel::claim_context& c) -> absl::StatusOr<keel::decision> {
                                mine = c.ownership;
                                return keel::decision{.model_digest = "m", .result = "approve " + key};
                              });
          if (r.ok())
            log << "D " << phase << " " << key << " " << r->decision.id << " " << r->fence << " "
                << (r->replayed ? std::string("-") : mine.owner.hex()) << " " << (r->replayed ? 1 : 0) << "\n";
          const std::string work = absl::StrCat("w-", n % leases);
          const keel::owner_id me = keel::owner_id::random();
          auto c = store.claim(work, me, std::chrono::seconds(5));
          if (c.ok() && c->acquired) {
            log << "L " << phase << " " << work << " " << me.hex() << " " << c->ownership.fence << "\n";
            (void)store.release(work, c->ownership);
          }
          if (extra) extra(phase, n, log);
        }
        logs[static_cast<std::size_t>(t)] = log.str();
      });
    // Tell the parent when every thread is parked (and when no longer).
    bool said = false;
    while (first_line(phase_path) != "stop") {
      const bool all = parked.load() == threads;
      if (all && !said) std::ofstream(out_path + ".parked") << "parked\n";
      if (!all && said) std::remove((out_path + ".parked").c_str());
      said = all;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  std::ofstream out(out_path, std::ios::trunc);
  for (const std::string& l : logs) out << l;
  out << "end\n";
  return out.good() ? 0 : 3;
}

// ---- the parent's side ------------------------------------------------------

struct decision_ack {
  std::string phase, key, id;
  std::int64_t fence = 0;
  std::string owner;  // "-" for a replay
  bool replayed = false;
};
struct lease_ack {
  std::string phase, work, owner;
  std::int64_t fence = 0;
};

struct job_ack {
  char kind = 'S';  // S submitted (created), J completed
  std::string phase;
  std::int64_t id = 0;
  std::string key_or_owner;
  std::int64_t fence = 0;
  std::string key;  // J: the job's key
};

struct acks {
  std::vector<decision_ack> decisions;
  std::vector<lease_ack> leases;
  std::vector<job_ack> jobs;
  bool complete = true;  // every worker's log ended with "end"
};

inline acks parse_logs(const std::vector<std::string>& paths) {
  acks a;
  for (const std::string& p : paths) {
    std::istringstream in(keel_test::read_file(p));
    std::string line;
    bool ended = false;
    while (std::getline(in, line)) {
      std::istringstream f(line);
      std::string kind;
      f >> kind;
      if (kind == "D") {
        decision_ack d;
        int rep = 0;
        f >> d.phase >> d.key >> d.id >> d.fence >> d.owner >> rep;
        d.replayed = rep != 0;
        a.decisions.push_back(d);
      } else if (kind == "L") {
        lease_ack l;
        f >> l.phase >> l.work >> l.owner >> l.fence;
        a.leases.push_back(l);
      } else if (kind == "S" || kind == "J") {
        job_ack j;
        j.kind = kind[0];
        f >> j.phase >> j.id >> j.key_or_owner;
        if (j.kind == 'J') f >> j.fence >> j.key;
        a.jobs.push_back(j);
      } else if (kind == "end") {
        ended = true;
      }
    }
    a.complete = a.complete && ended;
  }
  return a;
}

// K worker processes following one phase file.
class workers {
 public:
  workers(int processes, int threads, int leases, std::map<std::string, std::string> vars) {
    phase_ = dir_.path() + "/phase";
    set_phase("A");
    for (int i = 0; i < processes; ++i) {
      const std::string out = absl::StrCat(dir_.path(), "/worker-", i);
      outs_.push_back(out);
      std::map<std::string, std::string> v = vars;
      v["PHASE"] = phase_;
      v["OUT"] = out;
      v["THREADS"] = std::to_string(threads);
      v["LEASES"] = std::to_string(leases);
      pids_.push_back(keel_test::spawn_self({.test_case = "failover child process",
                                             .env_prefix = "KEEL_FAILOVER_",
                                             .vars = std::move(v),
                                             .stderr_path = out + ".err"}));
    }
  }
  ~workers() {
    set_phase("stop");
    for (pid_t p : pids_) (void)keel_test::wait_child(p, std::chrono::seconds(20));
  }
  workers(const workers&) = delete;
  workers& operator=(const workers&) = delete;

  void set_phase(const std::string& p) {
    const std::string tmp = phase_ + ".tmp";
    std::ofstream(tmp, std::ios::trunc) << p << "\n";
    std::rename(tmp.c_str(), phase_.c_str());  // atomic: a reader sees the old or the new phase
  }

  // Pauses every worker; true once all have parked (bounded).
  bool pause(std::chrono::seconds limit = std::chrono::seconds(20)) {
    set_phase("pause");
    const auto end = std::chrono::steady_clock::now() + limit;
    for (;;) {
      bool all = true;
      for (const std::string& o : outs_) all = all && file_exists(o + ".parked");
      if (all) return true;
      if (std::chrono::steady_clock::now() > end) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

  // Lets the workers run until `enough` acknowledgements were seen (counted
  // from their live logs is not possible: they write at the end), so: for
  // `d` of real time.
  static void run_for(std::chrono::milliseconds d) { std::this_thread::sleep_for(d); }

  // Stops them; their exit codes (0 each when all went well).
  std::vector<int> stop() {
    set_phase("stop");
    std::vector<int> codes;
    for (pid_t p : pids_) codes.push_back(keel_test::wait_child(p, std::chrono::seconds(30)));
    pids_.clear();
    return codes;
  }
  [[nodiscard]] acks collect() const { return parse_logs(outs_); }
  [[nodiscard]] std::string errors() const {
    std::string e;
    for (const std::string& o : outs_) e += keel_test::read_file(o + ".err");
    return e;
  }

 private:
  keel_test::temp_dir dir_;
  std::string phase_;
  std::vector<std::string> outs_;
  std::vector<pid_t> pids_;
};

// What became of the acknowledgements, read back through the store after
// the failover (`s` talks to the new primary).
struct phase_figures {
  int decisions = 0;       // decisions acknowledged in the phase (fresh or replayed)
  int decisions_kept = 0;  // ... found on the new primary with the same decision id
  int claims = 0;          // lease claims acknowledged in the phase
};
struct verdict {
  std::map<std::string, phase_figures> phases;
  int keys_decided_twice = 0;     // keys with two acknowledged decision ids
  int fences_reused = 0;          // (work key, fence) acknowledged to two owners
  int stale_writes = 0;           // stale owners' release/renew/commit sent to the new primary
  int stale_writes_refused = 0;   // ... refused with lost ownership
  int stale_decisions_refused_same_fence = 0;  // refused although the key's new holder has the stale fence
  int new_claims_at_used_fence = 0;  // a claim on the new primary got a fence already acknowledged to someone
  // Work keys whose lowest fence acknowledged after the promotion (phase
  // C) is not above every fence acknowledged for them before the failover
  // began (A, B; an X claim may have been served by either primary).
  int fences_backwards = 0;
  std::string summary() const {
    std::string out;
    for (const auto& [p, f] : phases)
      absl::StrAppend(&out, p, ": ", f.decisions_kept, "/", f.decisions, " decisions kept, ", f.claims, " claims; ");
    absl::StrAppend(&out, "keys decided twice ", keys_decided_twice, ", fences reused ", fences_reused,
                    ", new claims at a used fence ", new_claims_at_used_fence, ", work keys whose fence went back ",
                    fences_backwards, ", stale writes refused ",
                    stale_writes_refused, "/", stale_writes, " (", stale_decisions_refused_same_fence,
                    " at the holder's own fence)");
    return out;
  }
};

// `stale_phase`: the phase whose acknowledgements the new primary may lack
// (B with the link cut; "" for none): its owners' writes are sent again and
// must be refused.
template <class Store>
verdict verify(Store& s, const acks& a, const std::string& stale_phase) {
  verdict v;
  std::map<std::string, std::set<std::string>> ids;
  std::map<std::string, const decision_ack*> first;
  for (const decision_ack& d : a.decisions) {
    ids[d.key].insert(d.id);
    ++v.phases[d.phase].decisions;
    first.emplace(d.key, &d);
  }
  for (const auto& [k, set] : ids)
    if (set.size() > 1) ++v.keys_decided_twice;
  std::map<std::pair<std::string, std::int64_t>, std::set<std::string>> holders;
  std::map<std::string, std::set<std::int64_t>> used;
  std::map<std::string, std::pair<std::int64_t, std::int64_t>> span;  // work key -> (max before C, min in C)
  for (const lease_ack& l : a.leases) {
    ++v.phases[l.phase].claims;
    holders[{l.work, l.fence}].insert(l.owner);
    used[l.work].insert(l.fence);
    auto& [before, after] = span[l.work];
    if (l.phase == "C") after = after == 0 ? l.fence : std::min(after, l.fence);
    else if (l.phase != "X") before = std::max(before, l.fence);
  }
  for (const auto& [work, ba] : span)
    if (ba.second != 0 && ba.second <= ba.first) ++v.fences_backwards;
  for (const auto& [k, owners] : holders)
    if (owners.size() > 1) ++v.fences_reused;
  // Stale owners first: whatever the new primary has, they must not write.
  auto stale_write = [&](const absl::Status& st) {
    ++v.stale_writes;
    if (keel::is_lost_ownership(st)) ++v.stale_writes_refused;
  };
  for (const lease_ack& l : a.leases) {
    if (l.phase != stale_phase) continue;
    const keel::ownership o{*keel::owner_id::from_hex(l.owner), l.fence};
    stale_write(s.renew(l.work, o, std::chrono::seconds(5)));
    stale_write(s.release(l.work, o));
  }
  // Every decision acknowledged: is it on the new primary, with its id?
  for (const auto& [key, d] : first) {
    const keel::owner_id probe = keel::owner_id::random();
    auto b = s.begin(identity_of(key), digest_of(key), probe,
                     {.lease = std::chrono::seconds(30), .retention = std::chrono::hours(2)});
    if (!b.ok()) continue;
    if (b->state == keel::begin_state::replay) {
      for (const decision_ack& x : a.decisions)
        if (x.key == key && x.id == b->decision.id) ++v.phases[x.phase].decisions_kept;
      continue;
    }
    // Gone: the probe now holds the key. A stale holder of it must still be refused.
    for (const decision_ack& x : a.decisions) {
      if (x.key != key || x.replayed || x.phase != stale_phase) continue;
      const keel::ownership o{*keel::owner_id::from_hex(x.owner), x.fence};
      const absl::Status st = s.commit(identity_of(key), o, keel::decision{.id = "stale-" + x.id}, std::chrono::hours(1));
      stale_write(st);
      if (keel::is_lost_ownership(st) && b->ownership.fence == x.fence) ++v.stale_decisions_refused_same_fence;
    }
  }
  // A new owner of every work key: is its fence one that was handed out already?
  for (const auto& [work, fences] : used) {
    auto c = s.claim(work, keel::owner_id::random(), std::chrono::seconds(5));
    if (c.ok() && c->acquired && fences.count(c->ownership.fence) > 0) ++v.new_claims_at_used_fence;
  }
  return v;
}

}  // namespace keel_failover
