// keel/policy/bulkhead.hpp — isolate classes of work so one cannot take another's
// capacity.
//
// A bulkhead has classes, each owning a number of slots (for example
// interactive 24, batch 8, recovery 8). A call takes one slot of its class
// for as long as it runs; a batch flood fills the batch slots and the batch
// queue, and interactive calls still find their 24.
//
//   - Each class has a bounded FIFO queue: at most `max_queue` callers wait,
//     each at most `max_queue_age` and never past its own deadline or stop
//     token. When the queue is full the caller is refused at once.
//   - A class may use another's idle slots only under an explicit lending
//     rule {lender, borrower, max_slots}. Lending never touches the lender's
//     guarantee: a class owns `capacity` slots of which `guaranteed` are
//     never lent, and construction refuses rules whose max_slots, summed per
//     lender, exceed capacity - guaranteed. So the lender can always run its
//     guaranteed number at once, however much is out on loan. Lent slots go
//     back to the lender's own waiters first, and nobody borrows from a class
//     that has callers waiting.
//   - Permits are move-only RAII objects: a slot is given back exactly once,
//     when the permit is destroyed or release()d, on every path — success,
//     an exception inside the protected call, a timeout inside the work. A
//     caller that times out or is cancelled while queued never held a slot
//     and leaves the queue under the class lock, so nothing leaks.
//   - Per class: active, borrowed, lent, queued, admitted, completed,
//     rejected, timed out, cancelled, and a queue-delay histogram.
//
// Refusals are "not started" statuses naming "bulkhead:<class>" as refused-by:
// ResourceExhausted (queue full, or waited max_queue_age), DeadlineExceeded
// (the caller's deadline came first) or Cancelled. All but Cancelled carry
// retry-after = max_queue_age: when a slot frees is unknown (keel does not
// know how long work holds one), but by then everyone queued now has been
// served or has left.
//
// Example:
//
//   keel::bulkhead pools({.classes = {{.name = "interactive", .capacity = 24, .max_queue = 48},
//                                     {.name = "batch", .capacity = 8, .max_queue = 16,
//                                      .max_queue_age = std::chrono::seconds(2)},
//                                     {.name = "recovery", .capacity = 8}}});
//   // As a policy, by the call's work_class label...
//   auto pipe = keel::pipeline(pools, keel::retry({.max_attempts = 2}));
//   // ...or for one class.
//   auto batch_pipe = keel::pipeline(pools.for_class("batch"), keel::retry({.max_attempts = 2}));
//   // Standalone:
//   std::size_t batch = *pools.class_index("batch");
//   if (keel::bulkhead_permit p = pools.try_acquire(batch)) { run_job(); }   // released here
//   absl::StatusOr<keel::bulkhead_permit> waited =
//       pools.acquire(batch, keel::real_clock{}, keel::real_clock{}.now(), keel::deadline::infinite(), {});
//
// Waiting goes through the clock given to acquire() (keel/core/clock.hpp), so a
// test's manual clock drives queue ages and deadlines.
//
// Cost: taking and giving back a slot without waiting is lock-free — one
// CAS each; the completed count is kept per thread (a plain store).
//
// Thread-safety: every operation may be called from any thread. A permit
// may be released on a thread other than the one that acquired it.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <stop_token>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "keel/core/call.hpp"
#include "keel/core/clock.hpp"
#include "keel/core/condition.hpp"
#include "keel/core/deadline.hpp"
#include "keel/core/outcome.hpp"
#include "keel/core/policy.hpp"
#include "keel/core/status.hpp"
#include "keel/core/telemetry.hpp"
#include "keel/policy/internal/short_key.hpp"
#include "keel/core/internal/thread_slot.hpp"
#include "keel/policy/events.hpp"

namespace keel {

struct bulkhead_class_options {
  std::string name;
  // Slots the class owns; in [1, 32767].
  int capacity = 1;
  // Of which never lent; in [0, capacity]. nullopt: all of them.
  std::optional<int> guaranteed = std::nullopt;
  // Callers that may wait for a slot; in [0, 32767]. 0: refuse at once.
  int max_queue = 0;
  // Longest a caller waits in the queue; in (0, 24h].
  duration max_queue_age = std::chrono::milliseconds(100);
};

// Lets `borrower` use up to `max_slots` of `lender`'s idle lendable slots.
struct bulkhead_lending {
  std::string lender;
  std::string borrower;
  int max_slots = 1;
};

struct bulkhead_options {
  std::vector<bulkhead_class_options> classes;
  std::vector<bulkhead_lending> lending{};
  // The class of calls whose work_class label is empty (as a policy);
  // empty: such calls are refused.
  std::string default_class{};

  [[nodiscard]] absl::Status validate() const {
    constexpr std::string_view who = "bulkhead_options";
    if (classes.empty() || classes.size() > 1000)
      return detail::invalid_field(who, "classes", "name between 1 and 1000 classes", classes.size());
    auto find = [&](std::string_view name) -> const bulkhead_class_options* {
      for (const auto& c : classes)
        if (c.name == name) return &c;
      return nullptr;
    };
    for (std::size_t i = 0; i < classes.size(); ++i) {
      const bulkhead_class_options& c = classes[i];
      const std::string field = absl::StrCat("classes[", i, "].");
      if (c.name.empty()) return detail::invalid_field(who, field + "name", "not be empty", "\"\"");
      for (std::size_t j = 0; j < i; ++j)
        if (classes[j].name == c.name) return detail::invalid_field(who, field + "name", "be unique", c.name);
      if (c.capacity < 1 || c.capacity > 32767)
        return detail::invalid_field(who, field + "capacity", "be in [1, 32767]", c.capacity);
      if (c.guaranteed && (*c.guaranteed < 0 || *c.guaranteed > c.capacity))
        return detail::invalid_field(who, field + "guaranteed", "be in [0, capacity]", *c.guaranteed);
      if (c.max_queue < 0 || c.max_queue > 32767)
        return detail::invalid_field(who, field + "max_queue", "be in [0, 32767]", c.max_queue);
      if (c.max_queue_age <= duration::zero() || c.max_queue_age > std::chrono::hours(24))
        return detail::invalid_field(who, field + "max_queue_age", "be in (0, 24h]", c.max_queue_age);
    }
    for (std::size_t i = 0; i < lending.size(); ++i) {
      const bulkhead_lending& l = lending[i];
      const std::string field = absl::StrCat("lending[", i, "].");
      const bulkhead_class_options* lender = find(l.lender);
      if (lender == nullptr) return detail::invalid_field(who, field + "lender", "name a class", l.lender);
      if (find(l.borrower) == nullptr)
        return detail::invalid_field(who, field + "borrower", "name a class", l.borrower);
      if (l.borrower == l.lender)
        return detail::invalid_field(who, field + "borrower", "differ from the lender", l.borrower);
      for (std::size_t j = 0; j < i; ++j)
        if (lending[j].lender == l.lender && lending[j].borrower == l.borrower)
          return detail::invalid_field(who, field + "borrower", "appear once per lender", l.borrower);
      if (l.max_slots < 1) return detail::invalid_field(who, field + "max_slots", "be >= 1", l.max_slots);
      // The guarantee: lending from one lender, all rules together, must fit
      // in what it owns beyond its guaranteed slots.
      int lent = 0;
      for (std::size_t j = 0; j <= i; ++j)
        if (lending[j].lender == l.lender) lent += lending[j].max_slots;
      const int guaranteed = lender->guaranteed.value_or(lender->capacity);
      if (lent > lender->capacity - guaranteed) {
        return detail::invalid_field(
            who, field + "max_slots",
            absl::StrCat("keep lender '", l.lender, "' its guaranteed ", guaranteed, " of ", lender->capacity,
                         " slots (at most ", lender->capacity - guaranteed, " lendable in all)"),
            l.max_slots);
      }
    }
    if (!default_class.empty() && find(default_class) == nullptr)
      return detail::invalid_field(who, "default_class", "name a class", default_class);
    return absl::OkStatus();
  }
};

// Per-class figures, read at one moment (each counter exact; the set is not
// one atomic snapshot while calls run).
struct bulkhead_figures {
  // Upper bounds of the queue-delay histogram's buckets; bucket 0 counts
  // admissions that did not wait, the last one everything above 5 s.
  static constexpr std::array<duration, 12> delay_bounds{
      duration::zero(),
      std::chrono::microseconds(100),
      std::chrono::milliseconds(1),
      std::chrono::milliseconds(5),
      std::chrono::milliseconds(10),
      std::chrono::milliseconds(25),
      std::chrono::milliseconds(50),
      std::chrono::milliseconds(100),
      std::chrono::milliseconds(250),
      std::chrono::milliseconds(500),
      std::chrono::seconds(1),
      std::chrono::seconds(5)};

  std::string_view name;
  int capacity = 0;
  int guaranteed = 0;
  int active = 0;     // permits held by this class: own slots + borrowed ones
  int borrowed = 0;   // of which borrowed from lenders
  int lent = 0;       // this class's slots held by borrowers
  int queued = 0;
  std::int64_t admitted = 0;
  std::int64_t completed = 0;
  std::int64_t rejected = 0;   // refused at once: the queue was full
  std::int64_t timed_out = 0;  // waited max_queue_age, or the caller's deadline came first
  std::int64_t cancelled = 0;  // stop requested while waiting
  std::array<std::int64_t, delay_bounds.size() + 1> queue_delay{};

  // The bucket bound at or below which a share q of admissions waited.
  [[nodiscard]] duration queue_delay_quantile(double q) const noexcept {
    std::int64_t total = 0;
    for (std::int64_t n : queue_delay) total += n;
    if (total == 0) return duration::zero();
    const auto rank = static_cast<std::int64_t>(q * static_cast<double>(total));
    std::int64_t seen = 0;
    for (std::size_t i = 0; i < queue_delay.size(); ++i) {
      seen += queue_delay[i];
      if (seen > rank || seen == total) return i < delay_bounds.size() ? delay_bounds[i] : duration::max();
    }
    return duration::max();
  }
};

class bulkhead;

// One slot of a bulkhead class. Move-only; gives the slot back exactly once,
// on destruction or release().
class bulkhead_permit {
 public:
  bulkhead_permit() noexcept = default;  // holds nothing
  bulkhead_permit(bulkhead_permit&& o) noexcept
      : owner_(std::exchange(o.owner_, nullptr)), cls_(o.cls_), lender_(o.lender_), rule_(o.rule_),
        delay_(o.delay_), waited_(o.waited_) {}
  bulkhead_permit& operator=(bulkhead_permit&& o) noexcept {
    if (this != &o) {
      release();
      owner_ = std::exchange(o.owner_, nullptr);
      cls_ = o.cls_;
      lender_ = o.lender_;
      rule_ = o.rule_;
      delay_ = o.delay_;
      waited_ = o.waited_;
    }
    return *this;
  }
  bulkhead_permit(const bulkhead_permit&) = delete;
  bulkhead_permit& operator=(const bulkhead_permit&) = delete;
  ~bulkhead_permit() { release(); }

  [[nodiscard]] explicit operator bool() const noexcept { return owner_ != nullptr; }
  [[nodiscard]] std::size_t work_class() const noexcept { return cls_; }
  // True when the slot is borrowed from another class.
  [[nodiscard]] bool borrowed() const noexcept { return lender_ != cls_; }
  // The class whose slot this is: work_class(), or the lender when borrowed.
  [[nodiscard]] std::size_t slot_owner() const noexcept { return lender_; }
  // How long the caller waited in the queue; waited() is false when it
  // got a slot at once.
  [[nodiscard]] duration queue_delay() const noexcept { return delay_; }
  [[nodiscard]] bool waited() const noexcept { return waited_; }

  // Gives the slot back now (idempotent).
  void release() noexcept;

 private:
  friend class bulkhead;
  bulkhead_permit(bulkhead* b, std::uint16_t cls, std::uint16_t lender, std::int32_t rule, duration delay,
                  bool waited) noexcept
      : owner_(b), cls_(cls), lender_(lender), rule_(rule), delay_(delay), waited_(waited) {}

  bulkhead* owner_ = nullptr;
  std::uint16_t cls_ = 0;
  std::uint16_t lender_ = 0;
  std::int32_t rule_ = -1;
  duration delay_{};
  bool waited_ = false;
};

template <class Bulkhead>
class bulkhead_class_ref;

class bulkhead {
 public:
  // Throws keel::invalid_options if `o` is invalid.
  explicit bulkhead(bulkhead_options o)
      : options_((detail::require_valid(o.validate()), std::move(o))),
        classes_(std::make_unique<class_state[]>(options_.classes.size())),
        rules_(std::make_unique<rule_state[]>(options_.lending.size())) {
    for (std::size_t i = 0; i < options_.classes.size(); ++i) {
      const bulkhead_class_options& c = options_.classes[i];
      classes_[i].capacity = c.capacity;
      classes_[i].guaranteed = c.guaranteed.value_or(c.capacity);
      classes_[i].max_queue = c.max_queue;
      classes_[i].max_age = c.max_queue_age;
    }
    for (std::size_t r = 0; r < options_.lending.size(); ++r) {
      const auto lender = *class_index(options_.lending[r].lender);
      const auto borrower = *class_index(options_.lending[r].borrower);
      rules_[r].lender = static_cast<std::uint16_t>(lender);
      rules_[r].borrower = static_cast<std::uint16_t>(borrower);
      rules_[r].max = options_.lending[r].max_slots;
      classes_[lender].lends_via.push_back(static_cast<int>(r));
      classes_[borrower].borrows_via.push_back(static_cast<int>(r));
    }
    if (!options_.default_class.empty()) default_class_ = class_index(options_.default_class);
  }
  bulkhead(const bulkhead&) = delete;
  bulkhead& operator=(const bulkhead&) = delete;

  [[nodiscard]] const bulkhead_options& options() const noexcept { return options_; }
  [[nodiscard]] std::size_t classes() const noexcept { return options_.classes.size(); }
  [[nodiscard]] std::optional<std::size_t> class_index(std::string_view name) const noexcept {
    for (std::size_t i = 0; i < options_.classes.size(); ++i)
      if (detail::key_equals(options_.classes[i].name, name)) return i;
    return std::nullopt;
  }
  [[nodiscard]] std::string_view class_name(std::size_t cls) const noexcept { return options_.classes[cls].name; }

  // A slot of class `cls` if one is free now (its own, or borrowed under a
  // lending rule), without waiting. Lock-free. Never jumps the queue: with
  // callers waiting in the class, it refuses.
  [[nodiscard]] bulkhead_permit try_acquire(std::size_t cls) noexcept {
    class_state& c = classes_[cls];
    const auto self = static_cast<std::uint16_t>(cls);
    if (take_own(c)) return bulkhead_permit(this, self, self, -1, {}, false);
    if (!c.borrows_via.empty() && queued_of(c.word.load()) == 0) {
      if (std::optional<int> r = take_borrowed(c)) return bulkhead_permit(this, self, rules_[*r].lender, *r, {}, false);
    }
    return {};
  }

  // A slot of class `cls`, waiting in the class's queue if needed — at most
  // max_queue_age, never past `until` or a stop request. `now` is the time
  // the caller read last; waiting happens on `clock`.
  template <keel::clock Clock>
  [[nodiscard]] absl::StatusOr<bulkhead_permit> acquire(std::size_t cls, const Clock& clock, time_point now,
                                                        keel::deadline until, std::stop_token stop) {
    grant a = acquire_or_refuse(cls, clock, now, until, std::move(stop));
    if (a.permit) return std::move(a.permit);
    return refusal(cls, a.why);
  }

  // The status for a refusal (allocates: refusal paths only).
  [[nodiscard]] absl::Status refusal(std::size_t cls, bulkhead_refusal why) const {
    const std::string_view name = class_name(cls);
    const class_state& c = classes_[cls];
    absl::Status s;
    switch (why) {
      case bulkhead_refusal::queue_full:
        s = with_retry_after(absl::ResourceExhaustedError(absl::StrCat(
                                 "keel: bulkhead class '", detail::to_absl(name), "' is full (", c.capacity,
                                 " slots busy, ", c.max_queue, " waiting)")),
                             c.max_age);
        break;
      case bulkhead_refusal::queue_timeout:
        s = with_retry_after(absl::ResourceExhaustedError(absl::StrCat(
                                 "keel: waited ", detail::describe(c.max_age), " in the queue of bulkhead class '",
                                 detail::to_absl(name), "' without a slot")),
                             c.max_age);
        break;
      case bulkhead_refusal::deadline:
        // The class was still full when the caller's time ran out. When a
        // slot frees is unknown (keel does not know how long work holds
        // one); within max_queue_age every caller queued now has been served
        // or has left, the same turnover the other refusals hint.
        s = with_retry_after(
            absl::DeadlineExceededError(absl::StrCat(
                "keel: deadline passed while waiting for bulkhead class '", detail::to_absl(name), "' (",
                c.capacity, " slots busy); its queue turns over within ", detail::describe(c.max_age),
                ": retry after that with a fresh deadline")),
            c.max_age);
        break;
      case bulkhead_refusal::cancelled:
        s = absl::CancelledError(
            absl::StrCat("keel: cancelled while waiting for bulkhead class '", detail::to_absl(name), "'"));
        break;
      case bulkhead_refusal::unknown_class:
        s = absl::InvalidArgumentError(absl::StrCat("keel: no bulkhead class '", detail::to_absl(name), "'"));
        break;
    }
    return with_refused_by(mark_not_started(std::move(s)), absl::StrCat("bulkhead:", detail::to_absl(name)));
  }

  [[nodiscard]] bulkhead_figures figures(std::size_t cls) const noexcept {
    const class_state& c = classes_[cls];
    bulkhead_figures f;
    f.name = class_name(cls);
    f.capacity = c.capacity;
    f.guaranteed = c.guaranteed;
    const std::uint64_t w = c.word.load();
    int borrowed = 0;
    for (int r : c.borrows_via) borrowed += rules_[r].out.load(std::memory_order_relaxed);
    f.borrowed = borrowed;
    f.active = static_cast<int>(own_of(w)) + borrowed;
    f.lent = static_cast<int>(lent_of(w));
    f.queued = static_cast<int>(queued_of(w));
    f.completed = c.completed.read();
    f.admitted = f.completed + f.active;
    f.rejected = c.rejected.load(std::memory_order_relaxed);
    f.timed_out = c.timed_out.load(std::memory_order_relaxed);
    f.cancelled = c.cancelled.load(std::memory_order_relaxed);
    std::int64_t waited = 0;
    for (std::size_t i = 1; i < f.queue_delay.size(); ++i) {
      f.queue_delay[i] = c.delay[i].load(std::memory_order_relaxed);
      waited += f.queue_delay[i];
    }
    f.queue_delay[0] = std::max<std::int64_t>(0, f.admitted - waited);
    return f;
  }

  // Slots of `lender` currently held by `borrower` (0 without a rule).
  [[nodiscard]] int on_loan(std::size_t lender, std::size_t borrower) const noexcept {
    for (int r : classes_[lender].lends_via)
      if (rules_[r].borrower == borrower) return rules_[r].out.load(std::memory_order_relaxed);
    return 0;
  }

  // A policy for one class. Throws keel::invalid_options for an unknown name.
  [[nodiscard]] bulkhead_class_ref<bulkhead> for_class(std::string_view name);

  // The policy: a slot of the call's work_class (or default_class) for the
  // pass, waiting within the plan's deadline and stop token.
  template <class Ctx, class Next>
  auto execute(Ctx& ctx, const attempt_plan& plan, Next& next) -> decltype(next(ctx, plan)) {
    using R = decltype(next(ctx, plan));
    const std::string_view label = ctx.call.labels().work_class;
    std::optional<std::size_t> cls = label.empty() ? default_class_ : class_index(label);
    if (!cls) {
      observe(ctx.listener, events::bulkhead_rejected{ctx.call, label, bulkhead_refusal::unknown_class});
      return R(with_outcome(
          with_refused_by(mark_not_started(absl::InvalidArgumentError(absl::StrCat(
                              "keel: no bulkhead class for work_class '", detail::to_absl(label), "'"))),
                          "bulkhead"),
          outcome_kind::permanent));
    }
    return run_in(*cls, ctx, plan, next);
  }

 private:
  friend class bulkhead_permit;
  template <class Bulkhead>
  friend class bulkhead_class_ref;

  template <class Ctx, class Next>
  auto run_in(std::size_t cls, Ctx& ctx, const attempt_plan& plan, Next& next) -> decltype(next(ctx, plan)) {
    using R = decltype(next(ctx, plan));
    if (bulkhead_permit p = try_acquire(cls)) return next(ctx, plan);
    grant a = acquire_or_refuse(cls, ctx.clock, plan.now, plan.deadline, plan.stop);
    if (!a.permit) {
      observe(ctx.listener, events::bulkhead_rejected{ctx.call, class_name(cls), a.why});
      return R(refusal(cls, a.why));
    }
    if (a.permit.waited()) return next(ctx, plan.from(ctx.clock.now()));  // time passed in the queue
    return next(ctx, plan);
  }

  // word: own slots in use (16 bits) | slots lent out (16) | callers queued (16)
  static constexpr std::uint64_t kOwnOne = 1, kLentOne = std::uint64_t{1} << 16, kQueuedOne = std::uint64_t{1} << 32;
  static constexpr std::uint64_t own_of(std::uint64_t w) noexcept { return w & 0xffffu; }
  static constexpr std::uint64_t lent_of(std::uint64_t w) noexcept { return (w >> 16) & 0xffffu; }
  static constexpr std::uint64_t queued_of(std::uint64_t w) noexcept { return (w >> 32) & 0xffffu; }
  static constexpr std::uint64_t used_of(std::uint64_t w) noexcept { return own_of(w) + lent_of(w); }

  struct waiter {
    waiter* next = nullptr;
    waiter* prev = nullptr;
    bool granted = false;
    std::uint16_t lender = 0;
    std::int32_t rule = -1;
    duration delay{};
  };

  struct class_state {
    // The word is the only thing the lock-free paths touch. Its memory
    // order is seq_cst: a lender's release (write the lender's word, read
    // the borrower's queue) and a borrower joining its queue (write its
    // word, read the lender's) must not both miss each other.
    alignas(64) std::atomic<std::uint64_t> word{0};
    detail::sharded_count completed;  // bumped by every call: per-thread cells
    std::atomic<std::int64_t> rejected{0}, timed_out{0}, cancelled{0};
    std::array<std::atomic<std::int64_t>, bulkhead_figures::delay_bounds.size() + 1> delay{};
    int capacity = 0, guaranteed = 0, max_queue = 0;
    duration max_age{};
    std::vector<int> lends_via, borrows_via;  // lending rules by index
    std::mutex mu;                            // the queue
    keel::condition cv;
    waiter* head = nullptr;
    waiter* tail = nullptr;
  };

  struct rule_state {
    std::uint16_t lender = 0, borrower = 0;
    int max = 0;
    std::atomic<int> out{0};  // slots of lender held by borrower, <= max
  };

  static bool take_own(class_state& c) noexcept {
    std::uint64_t w = c.word.load();
    while (queued_of(w) == 0 && used_of(w) < static_cast<std::uint64_t>(c.capacity)) {
      if (c.word.compare_exchange_weak(w, w + kOwnOne)) return true;
    }
    return false;
  }

  // Reserves the rule first (bounded by its max), then a lent slot of the
  // lender (bounded by its capacity, and only when nobody waits there);
  // rolls the rule back if the lender has nothing idle.
  [[nodiscard]] std::optional<int> take_borrowed(class_state& c) noexcept {
    for (int r : c.borrows_via) {
      rule_state& rule = rules_[r];
      int out = rule.out.load();
      bool reserved = false;
      while (out < rule.max) {
        if (rule.out.compare_exchange_weak(out, out + 1)) {
          reserved = true;
          break;
        }
      }
      if (!reserved) continue;
      class_state& lender = classes_[rule.lender];
      std::uint64_t w = lender.word.load();
      while (queued_of(w) == 0 && used_of(w) < static_cast<std::uint64_t>(lender.capacity)) {
        if (lender.word.compare_exchange_weak(w, w + kLentOne)) return r;
      }
      rule.out.fetch_sub(1);
    }
    return std::nullopt;
  }

  // What waiting for a slot gave: a permit, or why not.
  struct grant {
    bulkhead_permit permit;
    bulkhead_refusal why{};
  };

  template <class Clock>
  grant acquire_or_refuse(std::size_t cls, const Clock& clock, time_point now, keel::deadline until,
                            std::stop_token stop) {
    const auto self = static_cast<std::uint16_t>(cls);
    if (bulkhead_permit p = try_acquire(cls)) return {std::move(p)};
    class_state& c = classes_[cls];
    std::unique_lock lock(c.mu);
    bulkhead_refusal why{};
    for (;;) {
      // Under the lock nobody else can join the queue; take a slot only if
      // nobody is waiting for it already.
      if (take_own(c)) return {bulkhead_permit(this, self, self, -1, {}, false)};
      std::uint64_t w = c.word.load();
      if (queued_of(w) == 0 && !c.borrows_via.empty()) {
        if (std::optional<int> r = take_borrowed(c))
          return {bulkhead_permit(this, self, rules_[*r].lender, *r, {}, false)};
      }
      if (queued_of(w) >= static_cast<std::uint64_t>(c.max_queue)) {
        why = bulkhead_refusal::queue_full;
        break;
      }
      if (stop.stop_requested()) {
        why = bulkhead_refusal::cancelled;
        break;
      }
      if (until.expired(now)) {
        why = bulkhead_refusal::deadline;
        break;
      }
      if (queued_of(w) == 0 && used_of(w) < static_cast<std::uint64_t>(c.capacity)) continue;  // freed meanwhile
      // Join the queue only if nothing changed since we looked: a release in
      // between changes the word, fails this CAS, and we look again.
      if (c.word.compare_exchange_strong(w, w + kQueuedOne)) {
        waiter me;
        why = wait(c, me, lock, clock, now, until, stop);
        if (me.granted) return {bulkhead_permit(this, self, me.lender, me.rule, me.delay, true)};
        break;
      }
    }
    count_refusal(c, why);
    return {bulkhead_permit(), why};
  }

  // Under c.mu, with the caller counted in c's queue: waits for a slot to be
  // handed over, or leaves the queue.
  template <class Clock>
  bulkhead_refusal wait(class_state& c, waiter& me, std::unique_lock<std::mutex>& lock, const Clock& clock,
                        time_point now, keel::deadline until, const std::stop_token& stop) {
    me.prev = c.tail;
    if (c.tail != nullptr) {
      c.tail->next = &me;
    } else {
      c.head = &me;
    }
    c.tail = &me;
    // A lender may have freed a slot before it could see us queued.
    serve_by_borrowing(c);
    const time_point aged = time_point::max() - now < c.max_age ? time_point::max() : now + c.max_age;
    const time_point limit = std::min(aged, until.when());
    clock.wait_until(lock, c.cv, limit, stop, [&] { return me.granted; });
    if (me.granted) {
      me.delay = std::max(duration::zero(), clock.now() - now);
      c.delay[delay_bucket(me.delay)].fetch_add(1, std::memory_order_relaxed);
      return bulkhead_refusal{};
    }
    unlink(c, me);
    c.word.fetch_sub(kQueuedOne);
    if (stop.stop_requested()) return bulkhead_refusal::cancelled;
    if (until.expired(clock.now())) return bulkhead_refusal::deadline;
    return bulkhead_refusal::queue_timeout;
  }

  static void unlink(class_state& c, waiter& w) noexcept {
    if (w.prev != nullptr) {
      w.prev->next = w.next;
    } else {
      c.head = w.next;
    }
    if (w.next != nullptr) {
      w.next->prev = w.prev;
    } else {
      c.tail = w.prev;
    }
    w.next = w.prev = nullptr;
  }

  // Under c.mu: the head waiter gets the slot.
  static void grant_head(class_state& c, std::uint16_t lender, std::int32_t rule) noexcept {
    waiter* w = c.head;
    unlink(c, *w);
    w->granted = true;
    w->lender = lender;
    w->rule = rule;
    c.cv.notify_all();
  }

  // Under c.mu: while c has waiters and a lender has an idle slot for them.
  void serve_by_borrowing(class_state& c) noexcept {
    while (c.head != nullptr) {
      std::optional<int> r = take_borrowed(c);
      if (!r) return;
      c.word.fetch_sub(kQueuedOne);
      grant_head(c, rules_[*r].lender, *r);
    }
  }

  // After a slot of `lender` became idle: offer it to borrowers waiting.
  void offer_to_borrowers(class_state& lender) noexcept {
    for (int r : lender.lends_via) {
      class_state& b = classes_[rules_[r].borrower];
      if (queued_of(b.word.load()) == 0) continue;
      std::lock_guard lock(b.mu);
      serve_by_borrowing(b);
    }
  }

  void release(std::size_t cls, std::uint16_t lender_index, std::int32_t rule) noexcept {
    class_state& c = classes_[cls];
    c.completed.add();
    if (rule < 0) {
      give_back(c, kOwnOne, static_cast<std::uint16_t>(cls));
    } else {
      rules_[rule].out.fetch_sub(1);
      give_back(classes_[lender_index], kLentOne, lender_index);
    }
  }

  // Frees one slot of `owner` held as `unit` (own or lent): to the owner's
  // first waiter when there is one, else idle (and offered to borrowers).
  void give_back(class_state& owner, std::uint64_t unit, std::uint16_t owner_index) noexcept {
    std::uint64_t w = owner.word.load();
    for (;;) {
      if (queued_of(w) == 0) {
        if (owner.word.compare_exchange_weak(w, w - unit)) break;
        continue;
      }
      std::unique_lock lock(owner.mu);
      w = owner.word.load();
      if (queued_of(w) == 0) continue;  // the waiters left meanwhile
      // Hand the slot over: it becomes the waiter's own slot, and the waiter
      // leaves the queue, in one step.
      while (!owner.word.compare_exchange_weak(w, w - unit + kOwnOne - kQueuedOne)) {
      }
      grant_head(owner, owner_index, -1);
      return;
    }
    if (!owner.lends_via.empty()) offer_to_borrowers(owner);
  }

  void count_refusal(class_state& c, bulkhead_refusal why) noexcept {
    switch (why) {
      case bulkhead_refusal::queue_full: c.rejected.fetch_add(1, std::memory_order_relaxed); break;
      case bulkhead_refusal::queue_timeout:
      case bulkhead_refusal::deadline: c.timed_out.fetch_add(1, std::memory_order_relaxed); break;
      case bulkhead_refusal::cancelled: c.cancelled.fetch_add(1, std::memory_order_relaxed); break;
      default: break;
    }
  }

  static std::size_t delay_bucket(duration d) noexcept {
    for (std::size_t i = 1; i < bulkhead_figures::delay_bounds.size(); ++i)
      if (d <= bulkhead_figures::delay_bounds[i]) return i;
    return bulkhead_figures::delay_bounds.size();
  }

  bulkhead_options options_;
  std::unique_ptr<class_state[]> classes_;
  std::unique_ptr<rule_state[]> rules_;
  std::optional<std::size_t> default_class_;
};

inline void bulkhead_permit::release() noexcept {
  if (owner_ == nullptr) return;
  bulkhead* b = std::exchange(owner_, nullptr);
  b->release(cls_, lender_, rule_);
}

// A policy for one class of a bulkhead (see bulkhead::for_class).
template <class Bulkhead>
class bulkhead_class_ref {
 public:
  bulkhead_class_ref(Bulkhead& b, std::size_t cls) noexcept : bulkhead_(&b), cls_(cls) {}

  [[nodiscard]] std::size_t work_class() const noexcept { return cls_; }

  template <class Ctx, class Next>
  auto execute(Ctx& ctx, const attempt_plan& plan, Next& next) const -> decltype(next(ctx, plan)) {
    return bulkhead_->run_in(cls_, ctx, plan, next);
  }

 private:
  Bulkhead* bulkhead_;
  std::size_t cls_;
};

inline bulkhead_class_ref<bulkhead> bulkhead::for_class(std::string_view name) {
  const std::optional<std::size_t> cls = class_index(name);
  if (!cls) {
    throw invalid_options(absl::InvalidArgumentError(
        absl::StrCat("bulkhead::for_class: no class named '", detail::to_absl(name), "'")));
  }
  return {*this, *cls};
}

}  // namespace keel
