// spin_policy: decides, turn by turn, whether io_context::run_until keeps
// busy-polling or may sleep in the ring. The loop spins while
//  - it has pollers and the last turn that did work (remote work or a
//    poller's) is less than options::spin_budget ago, or
//  - the last turn that reaped ring completions, or whose pollers did
//    work, is less than options::ring_spin_budget ago.
//
// Time is read on a cheap clock (spin_clock), and even so only once every
// `clock_every` spinning turns: a spinning turn must cost little more than
// its polls. Work seen between two reads is stamped at the next read. A
// turn that is not spinning reads the clock before it gives up spinning.
//
// Inline on purpose: the policy is a local of run_until and its state stays
// in registers, as the loop's own locals would.
#pragma once

#include "spin_clock.hpp"

#include <chrono>
#include <cstdint>
#include <vector>

namespace shuttle {
class poller;
}

namespace shuttle::detail {

// Clock: a type with `static std::int64_t now_ns() noexcept` (tests pass a
// fake one).
template <class Clock>
class basic_spin_policy {
 public:
  static constexpr unsigned clock_every = 16;  // spinning turns per clock read
  static constexpr unsigned enter_every = 64;  // turns between unconditional kernel entries

  // The budgets and the poller list are read through the references every
  // time: they may change while the loop runs (set_ring_spin_budget,
  // add_poller).
  basic_spin_policy(const std::chrono::nanoseconds& spin_budget, const std::chrono::nanoseconds& ring_spin_budget,
                    const std::vector<poller*>& pollers) noexcept
      : spin_budget_(spin_budget), ring_spin_budget_(ring_spin_budget), pollers_(pollers) {}

  // Once per turn, after the turn's ready work and polls. `work`: remote
  // work ran or a poller did work this turn. Returns whether to spin.
  [[gnu::always_inline]] bool next_turn(bool work) noexcept {
    ++turn_;
    if (!has_pollers() && ring_budget() == 0) return spinning_ = false;
    if (work) work_unstamped_ = true;
    if (!spinning_ || turn_ % clock_every == 0) {
      const std::int64_t now = Clock::now_ns();
      // A clock step back (another core's TSC) counts as "no time passed".
      if (work_unstamped_ || now < last_work_) last_work_ = now;
      if (completion_unstamped_ || now < last_completion_) last_completion_ = now;
      work_unstamped_ = completion_unstamped_ = false;
      spinning_ = (has_pollers() && now - last_work_ < poller_budget()) || now - last_completion_ < ring_budget();
    }
    return spinning_;
  }

  // Whether this turn enters the kernel even when the ring flags nothing
  // to do (a periodic safety net for kernels that report no task work).
  [[gnu::always_inline]] bool enter_due() const noexcept { return turn_ % enter_every == 0; }

  // A turn reaped ring completions (or its pollers did work): they extend
  // the ring budget.
  [[gnu::always_inline]] void reaped_completions() noexcept {
    if (ring_budget() > 0) completion_unstamped_ = true;
  }

  // A poller refused interrupt mode (work arrived while arming): spin on,
  // with a fresh poller budget.
  void interrupt_mode_refused() noexcept {
    last_work_ = Clock::now_ns();
    spinning_ = true;
  }

  // The loop woke from the ring: both budgets start again.
  void woke_up() noexcept {
    last_work_ = last_completion_ = Clock::now_ns();
    spinning_ = has_pollers() || ring_budget() > 0;
  }

 private:
  std::int64_t poller_budget() const noexcept { return std::int64_t(spin_budget_.count()); }
  std::int64_t ring_budget() const noexcept { return std::int64_t(ring_spin_budget_.count()); }
  bool has_pollers() const noexcept { return !pollers_.empty(); }

  const std::chrono::nanoseconds& spin_budget_;
  const std::chrono::nanoseconds& ring_spin_budget_;
  const std::vector<poller*>& pollers_;
  std::int64_t last_work_ = Clock::now_ns();
  std::int64_t last_completion_ = last_work_;
  unsigned turn_ = 0;
  bool spinning_ = false;
  bool work_unstamped_ = false;
  bool completion_unstamped_ = false;
};

using spin_policy = basic_spin_policy<spin_clock>;

}  // namespace shuttle::detail
