// keel/core/timer.hpp — keel's timer: one thread that runs what is due at
// a time on one clock. A deadline cut requests stop on a std::stop_source
// when its deadline passes; a keel::hedge's next attempt starts when its
// delay is up; a stream's first-token, stall and whole budgets are checked
// when they fall due. One timer serves them all, owned by whoever owns the
// clock (a service builds one beside its environment; keel::process_timer()
// is the real clock's, for components given none).
//
//   - keel::deadline_timer<Clock> owns one background thread. Entries
//     (detail::timer_entry: a keel::deadline_cut, a hedge's race block, a
//     stream's watch) live wherever their owner keeps them and are linked
//     into 16 buckets, one chosen per thread, each with its own small mutex:
//     arming and disarming allocate nothing and take no lock shared by all
//     threads. The thread is woken only when an entry is due before the time
//     it already sleeps until: the common arm is a bucket lock, a link, an
//     unlock and one atomic load.
//   - Firing is the slow path: the thread walks every bucket when it wakes
//     (at the earliest due entry), unlinks what is due and runs each outside
//     the bucket lock. An entry's function says when to run it again (a
//     hedge stays armed for its next attempt). An entry disarmed while it
//     runs waits for that run to finish, so a disarmed cut's stop_source may
//     be destroyed at once.
//   - keel::deadline_cut is the entry that cuts: armed on a stop source, its
//     settle() turns a cut attempt's "cancelled" into the timeout it is. The
//     pipeline policy that opts into cutting is keel::cut_at_deadline
//     (keel/compose/cut_at_deadline.hpp).
//
// Example:
//
//   keel::deadline_timer timer;   // real clock; one thread
//   keel::call call(keel::real_clock{}.now(), {.timeout = std::chrono::seconds(2)});
//   std::stop_source request_stop;
//   keel::deadline_cut cut(timer, call.end(), request_stop);   // stop requested at the call's end
//   // ... work that watches request_stop.get_token() ...
//   bool timed_out = cut.disarm();                              // also done by its destructor
//
// On a keel::testing::manual_clock the timer thread is one of the clock's
// sleepers while it has entries armed (it waits through the clock until the
// earliest), and not while it has none.
//
// Thread-safety: deadline_timer's operations may be called from any thread.
// A deadline_cut belongs to one owner at a time: arm() and disarm() are not
// called on one cut from two threads at once (the timer's thread firing it
// meanwhile is fine). Destroying the timer while cuts are armed is safe:
// the thread stops and joins, and every cut still armed is detached, never
// fired (its disarm() then returns false and touches nothing of the timer).
// No cut may be armed or disarmed while the timer's destructor runs.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <mutex>
#include <stop_token>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "keel/core/clock.hpp"
#include "keel/core/condition.hpp"
#include "keel/core/deadline.hpp"
#include "keel/core/outcome.hpp"
#include "keel/core/policy.hpp"
#include "keel/core/status.hpp"

namespace keel {

class deadline_timer_base;

namespace detail {

struct cut_shard;

// One armed deadline: an intrusive list node, living with its owner (a
// deadline_cut, a hedge's race block). Guarded by its shard's mutex.
struct timer_entry {
  enum class state : std::uint8_t { idle, armed, firing, fired };
  time_point due{};
  // Run by the timer's thread, outside every lock of the timer, once `due`
  // has passed; returns when to run again (time_point::max(): done).
  // A cancel waits for a run in progress to finish.
  time_point (*fire)(timer_entry&, time_point now) = nullptr;
  std::stop_source* target = nullptr;  // a cut's: the stop it requests
  time_point wake_by = time_point::max();  // brought forward while it ran: run again by then
  timer_entry* prev = nullptr;
  timer_entry* next = nullptr;
  cut_shard* shard = nullptr;  // where it was armed; null: never armed, or detached
  state st = state::idle;
};

// One address per clock type: what a timer says it runs on.
template <class Clock>
inline constexpr char clock_tag = 0;

inline time_point request_stop_at_deadline(timer_entry& e, time_point) {
  e.target->request_stop();
  return time_point::max();
}

struct alignas(64) cut_shard {
  std::mutex mu;
  std::condition_variable done;  // a disarm waits here while its entry fires
  timer_entry* head = nullptr;

  void link(timer_entry& e) noexcept {
    e.prev = nullptr;
    e.next = head;
    if (head != nullptr) head->prev = &e;
    head = &e;
  }
  void unlink(timer_entry& e) noexcept {
    if (e.prev != nullptr) e.prev->next = e.next;
    else head = e.next;
    if (e.next != nullptr) e.next->prev = e.prev;
    e.prev = e.next = nullptr;
  }
};

// A cut attempt that answered "cancelled" timed out: DeadlineExceeded with
// the same message and payloads (a not-started mark stays), without a
// marked outcome. Failure path only: it allocates.
[[nodiscard]] inline absl::Status cut_status(const absl::Status& s) {
  absl::Status out = absl::DeadlineExceededError(absl::StrCat("keel: cut at its deadline: ", s.message()));
  s.ForEachPayload([&](absl::string_view url, const absl::Cord& payload) {
    if (url != to_absl(outcome_payload)) out.SetPayload(url, payload);
  });
  return out;
}

// Whether `s`, from an attempt cut at its deadline, must be turned into a
// timeout: it says "cancelled", and the caller did not cancel.
template <class Classify>
[[nodiscard]] bool cut_reads_cancelled(const absl::Status& s, const std::stop_token& caller,
                                       const Classify& classify) {
  return !s.ok() && classify(s) == outcome_kind::cancelled && !caller.stop_requested();
}

// Each thread arms in one bucket, handed out round-robin on first use, so
// up to shard_count threads never contend on arm or disarm.
inline std::size_t cut_shard_of_thread(std::size_t count) noexcept {
  static std::atomic<std::size_t> next{0};
  thread_local const std::size_t mine = next.fetch_add(1, std::memory_order_relaxed);
  return mine % count;
}

}  // namespace detail

// What a timer has done since it was made.
struct deadline_timer_figures {
  std::int64_t fired = 0;   // entries run at their deadline (stops requested, hedges due)
  std::int64_t wakeups = 0; // times the thread was woken early by an arm
};

// The part of a deadline timer that policies and cuts use, whatever its
// clock: keel::hedge, keel::stream_guard, cut_at_deadline,
// fallback_options::cut and fan_out_options::cut take a reference or a
// pointer to it.
class deadline_timer_base {
 public:
  static constexpr std::size_t shard_count = 16;

  deadline_timer_base(const deadline_timer_base&) = delete;
  deadline_timer_base& operator=(const deadline_timer_base&) = delete;

  [[nodiscard]] deadline_timer_figures figures() const noexcept {
    return {.fired = fired_.load(std::memory_order_relaxed), .wakeups = wakeups_.load(std::memory_order_relaxed)};
  }

  // For keel's components (a deadline_cut, a hedge's race): runs e.fire at
  // `when` on the timer's thread, and again while it returns a later time.
  // `e` must be idle (never armed, or cancelled).
  void schedule(detail::timer_entry& e, time_point when) { arm(e, when); }
  // Unlinks `e`; true when it has run at least once and is done. Returns
  // once the timer no longer touches `e` (a run in progress finishes first).
  bool cancel(detail::timer_entry& e) { return disarm(e); }

  // Brings an armed `e` forward to `when` if that is earlier (a stream's
  // first token makes its stall budget the next thing due). One owner
  // calls it, as schedule and cancel.
  void bring_forward(detail::timer_entry& e, time_point when) {
    detail::cut_shard* s = e.shard;
    if (s == nullptr) return;
    {
      std::lock_guard lock(s->mu);
      if (e.st == detail::timer_entry::state::firing) {
        e.wake_by = std::min(e.wake_by, when);  // the run in progress relinks it by then
      } else if (e.st == detail::timer_entry::state::armed && when < e.due) {
        e.due = when;
      } else {
        return;
      }
    }
    wake_for(when);
  }

  // The timer's clock, read now: components without a run context (a
  // stream's writer) read time here.
  [[nodiscard]] time_point now() const noexcept { return read_(this); }

  // Whether this timer runs on clock type `C` (a time read from another
  // clock means nothing to it).
  template <class C>
  [[nodiscard]] bool on_clock() const noexcept {
    return clock_tag_ == &detail::clock_tag<std::remove_cvref_t<C>>;
  }

 protected:
  deadline_timer_base(const void* clock, time_point (*read)(const deadline_timer_base*)) noexcept
      : clock_tag_(clock), read_(read) {}
  // Detaches the entries still armed (the derived timer has joined its
  // thread): they are never fired, and their disarm touches nothing here.
  ~deadline_timer_base() {
    for (detail::cut_shard& s : shards_) {
      std::lock_guard lock(s.mu);
      while (s.head != nullptr) {
        detail::timer_entry& e = *s.head;
        s.unlink(e);
        e.st = detail::timer_entry::state::idle;
        e.shard = nullptr;
      }
    }
  }

  // Fires what is due at `now`; returns the earliest due entry left.
  time_point fire_due(time_point now) {
    time_point earliest = time_point::max();
    for (detail::cut_shard& s : shards_) {
      detail::timer_entry* due = nullptr;  // chained through `next` once unlinked
      {
        std::lock_guard lock(s.mu);
        for (detail::timer_entry* e = s.head; e != nullptr;) {
          detail::timer_entry* following = e->next;
          if (e->due <= now) {
            s.unlink(*e);
            e->st = detail::timer_entry::state::firing;
            e->next = due;
            due = e;
          } else {
            earliest = std::min(earliest, e->due);
          }
          e = following;
        }
      }
      if (due == nullptr) continue;
      // Outside the bucket lock: a stop request runs the token's callbacks
      // (an adapter aborting a transfer), a hedge hands an attempt to its
      // executor. The entries stay valid meanwhile: their disarm waits for
      // `fired`.
      std::int64_t n = 0;
      for (detail::timer_entry* e = due; e != nullptr; e = e->next) ++n;
      fired_.fetch_add(n, std::memory_order_relaxed);  // counted before anyone can see the stops
      for (detail::timer_entry* e = due; e != nullptr; e = e->next) e->due = e->fire(*e, now);
      {
        std::lock_guard lock(s.mu);
        for (detail::timer_entry* e = due; e != nullptr;) {
          detail::timer_entry* following = e->next;
          e->next = nullptr;
          if (e->due != time_point::max()) e->due = std::min(e->due, e->wake_by);
          e->wake_by = time_point::max();
          if (e->due != time_point::max()) {  // runs again: back in its bucket
            s.link(*e);
            e->st = detail::timer_entry::state::armed;
            earliest = std::min(earliest, e->due);
          } else {
            e->st = detail::timer_entry::state::fired;
          }
          e = following;
        }
      }
      s.done.notify_all();
    }
    return earliest;
  }

  // What the thread sleeps until, as a count of ticks; scanning while it
  // walks the buckets (an arm then always wakes it: it may have passed the
  // arm's bucket already), idle when it waits for a first entry.
  static constexpr duration::rep scanning = std::numeric_limits<duration::rep>::min();
  static constexpr duration::rep idle = std::numeric_limits<duration::rep>::max();

  const void* clock_tag_;  // detail::clock_tag of the derived timer's clock
  time_point (*read_)(const deadline_timer_base*);
  std::array<detail::cut_shard, shard_count> shards_{};
  std::atomic<duration::rep> next_wake_{scanning};
  std::mutex wake_mu_;
  keel::condition wake_cv_;
  bool poked_ = false;  // guarded by wake_mu_
  std::atomic<std::int64_t> fired_{0};
  std::atomic<std::int64_t> wakeups_{0};

 private:
  friend class deadline_cut;

  void arm(detail::timer_entry& e, time_point when) {
    detail::cut_shard& s = shards_[detail::cut_shard_of_thread(shard_count)];
    e.due = when;
    {
      std::lock_guard lock(s.mu);
      s.link(e);
      e.shard = &s;
      e.st = detail::timer_entry::state::armed;
    }
    wake_for(when);
  }

  // After a link or a move forward: a thread that has not yet walked this
  // bucket sees the entry; one that has, published `scanning` before it
  // did, or the time it now sleeps until, which this compares with.
  void wake_for(time_point when) {
    const duration::rep wake = next_wake_.load(std::memory_order_acquire);
    if (wake == scanning || when.time_since_epoch().count() < wake) poke();
  }

  // True when the entry fired. Returns once the timer no longer touches it.
  bool disarm(detail::timer_entry& e) {
    detail::cut_shard* s = e.shard;
    if (s == nullptr) return e.st == detail::timer_entry::state::fired;
    std::unique_lock lock(s->mu);
    // A run in progress finishes first; it may have asked to run again.
    s->done.wait(lock, [&] { return e.st != detail::timer_entry::state::firing; });
    if (e.st == detail::timer_entry::state::armed) {
      s->unlink(e);
      e.st = detail::timer_entry::state::idle;
      e.shard = nullptr;
      return false;
    }
    e.shard = nullptr;
    return e.st == detail::timer_entry::state::fired;
  }

  void poke() {
    {
      std::lock_guard lock(wake_mu_);
      poked_ = true;
    }
    wakeups_.fetch_add(1, std::memory_order_relaxed);
    wake_cv_.notify_one();
  }
};

// A deadline timer on `Clock`: one thread, started by the constructor and
// joined by the destructor.
template <keel::clock Clock = real_clock>
class deadline_timer final : public deadline_timer_base {
 public:
  explicit deadline_timer(Clock clock = {})
      : deadline_timer_base(&detail::clock_tag<Clock>,
                            [](const deadline_timer_base* t) { return static_cast<const deadline_timer*>(t)->clock_.now(); }),
        clock_(std::move(clock)),
        thread_([this](const std::stop_token& stop) { loop(stop); }) {}
  // Stops and joins the thread (thread_ is the last member), then the base
  // detaches the entries still armed.
  ~deadline_timer() = default;

  [[nodiscard]] const Clock& clock() const noexcept { return clock_; }

 private:
  void loop(const std::stop_token& stop) {
    for (;;) {
      next_wake_.store(scanning, std::memory_order_seq_cst);
      const time_point earliest = fire_due(clock_.now());
      std::unique_lock lock(wake_mu_);
      if (stop.stop_requested()) return;
      if (poked_) {  // an arm during the walk: walk again
        poked_ = false;
        continue;
      }
      next_wake_.store(earliest == time_point::max() ? idle : earliest.time_since_epoch().count(),
                       std::memory_order_seq_cst);
      auto poked = [&] { return poked_; };
      if (earliest == time_point::max()) {
        // Nothing armed: not a sleeper on a manual clock.
        wake_cv_.wait(lock, stop, poked);
      } else {
        clock_.wait_until(lock, wake_cv_, earliest, stop, poked);
      }
      poked_ = false;
      if (stop.stop_requested()) return;
    }
  }

  Clock clock_;
  std::jthread thread_;  // last: starts after the members above exist, stops first
};

// The process's timer on the real clock, for components given none of their
// own (a keel::hedge built without a timer): one thread, started on first
// use and never stopped, so components in static storage may use it until
// the process exits.
inline deadline_timer_base& process_timer() {
  static deadline_timer<real_clock>* const timer = new deadline_timer<real_clock>();
  return *timer;
}

// One armed deadline: requests stop on `target` when `d` passes, unless
// disarmed first. Lives wherever its owner keeps it (no allocation);
// disarmed by its destructor. Not copyable or movable (the timer links it).
class deadline_cut {
 public:
  deadline_cut() noexcept = default;
  // Arms at once; an infinite deadline arms nothing.
  deadline_cut(deadline_timer_base& timer, keel::deadline d, std::stop_source& target) { arm(timer, d, target); }
  deadline_cut(const deadline_cut&) = delete;
  deadline_cut& operator=(const deadline_cut&) = delete;
  ~deadline_cut() { (void)disarm(); }

  // Arms for `d` on `target` (disarming first if armed). An infinite
  // deadline, or a target without a stop state, arms nothing.
  void arm(deadline_timer_base& timer, keel::deadline d, std::stop_source& target) {
    (void)disarm();
    fired_ = false;
    if (d.is_infinite() || !target.stop_possible()) return;
    timer_ = &timer;
    entry_.fire = &detail::request_stop_at_deadline;
    entry_.target = &target;
    timer.arm(entry_, d.when());
  }

  // Disarms; true when the stop was requested at the deadline (now or by an
  // earlier disarm since the last arm). Once it returns the timer no longer
  // touches the target.
  bool disarm() {
    if (timer_ != nullptr) {
      fired_ = timer_->disarm(entry_) || fired_;
      timer_ = nullptr;
    }
    return fired_;
  }

  [[nodiscard]] bool armed() const noexcept { return timer_ != nullptr; }

  // Disarms, and gives back what the cut work answered: when this cut
  // stopped it and it answered "cancelled" (classify(status) says so) while
  // the caller did not cancel (`caller`), that is a timeout, DeadlineExceeded
  // "keel: cut at its deadline: ...", never the caller going away. The one
  // place a cut's answer is read: cut_at_deadline, hedge, fallback and
  // fan_out all settle through it. R: absl::Status or absl::StatusOr<T>.
  template <class R, class Classify>
  [[nodiscard]] R settle(R r, const std::stop_token& caller, const Classify& classify) {
    if (disarm() && detail::cut_reads_cancelled(status_of(r), caller, classify)) r = R(detail::cut_status(status_of(r)));
    return r;
  }

 private:
  detail::timer_entry entry_;
  deadline_timer_base* timer_ = nullptr;
  bool fired_ = false;
};

}  // namespace keel
