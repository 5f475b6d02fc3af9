// The loop's spin policy (lib/spin_policy.hpp) on a fake clock: when
// run_until spins, how often it reads the clock, what extends a budget.
#include "../../lib/spin_policy.hpp"

#include <shuttle/poller.hpp>

#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <vector>

using namespace std::chrono_literals;

namespace {

struct fake_clock {
  static inline std::int64_t now = 0;
  static inline int reads = 0;
  static std::int64_t now_ns() noexcept {
    ++reads;
    return now;
  }
};
using policy = shuttle::detail::basic_spin_policy<fake_clock>;
constexpr unsigned clock_every = policy::clock_every;

struct idle_poller final : shuttle::poller {
  bool poll() override { return false; }
  bool try_enter_interrupt_mode() override { return true; }
  void exit_interrupt_mode() override {}
};
idle_poller some_poller;

void reset_clock() {
  fake_clock::now = 1'000'000;
  fake_clock::reads = 0;
}

}  // namespace

TEST_CASE("spin_policy: no pollers and no ring budget: never spins, no clock read") {
  reset_clock();
  std::chrono::nanoseconds spin = 50us, ring = 0ns;
  std::vector<shuttle::poller*> pollers;  // none
  policy p(spin, ring, pollers);
  const int reads = fake_clock::reads;
  for (int i = 0; i < 100; ++i) CHECK_FALSE(p.next_turn(true));
  CHECK(fake_clock::reads == reads);
}

TEST_CASE("spin_policy: pollers spin for spin_budget after the last work, read the clock every 16 turns") {
  reset_clock();
  std::chrono::nanoseconds spin = 50us, ring = 0ns;
  std::vector<shuttle::poller*> pollers{&some_poller};
  policy p(spin, ring, pollers);
  CHECK(p.next_turn(true));  // not spinning yet: reads the clock, stamps the work
  const int reads = fake_clock::reads;
  fake_clock::now += 60'000;  // past the budget, but the next reads are 16 turns apart
  unsigned turns = 1;
  while (turns % clock_every != clock_every - 1) {
    CHECK(p.next_turn(false));
    ++turns;
  }
  CHECK(fake_clock::reads == reads);
  CHECK_FALSE(p.next_turn(false));  // turn 16 reads the clock: the budget is spent
  CHECK(fake_clock::reads == reads + 1);
  // Not spinning: every turn reads the clock, and work starts the budget again.
  CHECK(p.next_turn(true));
  CHECK(fake_clock::reads == reads + 2);
}

TEST_CASE("spin_policy: work seen between clock reads is stamped at the next read") {
  reset_clock();
  std::chrono::nanoseconds spin = 50us, ring = 0ns;
  std::vector<shuttle::poller*> pollers{&some_poller};
  policy p(spin, ring, pollers);
  CHECK(p.next_turn(true));
  unsigned turns = 1;
  fake_clock::now += 40'000;
  CHECK(p.next_turn(true));  // work, unstamped (no read on this turn)
  ++turns;
  while (turns % clock_every != 0) {
    CHECK(p.next_turn(false));
    ++turns;
  }
  fake_clock::now += 40'000;  // 80 us after the first work, 40 us after the second's stamp
  for (unsigned i = 0; i < clock_every; ++i) CHECK(p.next_turn(false));
  fake_clock::now += 20'000;  // 60 us after the stamp
  for (unsigned i = 0; i + 1 < clock_every; ++i) CHECK(p.next_turn(false));
  CHECK_FALSE(p.next_turn(false));
}

TEST_CASE("spin_policy: ring completions extend ring_spin_budget, pollers or not") {
  reset_clock();
  std::chrono::nanoseconds spin = 50us, ring = 10us;
  std::vector<shuttle::poller*> pollers;  // none
  policy p(spin, ring, pollers);
  CHECK(p.next_turn(false));  // turn 1: within the ring budget of the start
  fake_clock::now += 9'000;
  p.reaped_completions();
  for (unsigned i = 1; i < clock_every; ++i) CHECK(p.next_turn(false));  // turn 16 stamps them
  fake_clock::now += 5'000;  // 14 us after the start, 5 us after the completions' stamp
  for (unsigned i = 0; i < clock_every; ++i) CHECK(p.next_turn(false));
  fake_clock::now += 6'000;  // 11 us after the stamp
  for (unsigned i = 1; i < clock_every; ++i) CHECK(p.next_turn(false));
  CHECK_FALSE(p.next_turn(false));
}

TEST_CASE("spin_policy: a budget changed while the loop runs counts at once") {
  reset_clock();
  std::chrono::nanoseconds spin = 50us, ring = 0ns;
  std::vector<shuttle::poller*> pollers;  // none
  policy p(spin, ring, pollers);
  CHECK_FALSE(p.next_turn(false));
  ring = 1s;  // io_context::set_ring_spin_budget
  CHECK(p.next_turn(false));
  p.reaped_completions();
  ring = 0ns;
  CHECK_FALSE(p.next_turn(false));
}

TEST_CASE("spin_policy: waking up and a refused interrupt mode restart the budgets") {
  reset_clock();
  std::chrono::nanoseconds spin = 50us, ring = 0ns;
  std::vector<shuttle::poller*> pollers{&some_poller};
  policy p(spin, ring, pollers);
  fake_clock::now += 100'000;
  CHECK_FALSE(p.next_turn(false));  // turn 1: the budget from the start is spent
  p.interrupt_mode_refused();             // stamps now
  for (unsigned i = 1; i < clock_every; ++i) CHECK(p.next_turn(false));  // turn 16 reads: 0 us
  fake_clock::now += 100'000;
  for (unsigned i = 1; i < clock_every; ++i) CHECK(p.next_turn(false));
  CHECK_FALSE(p.next_turn(false));  // turn 32
  fake_clock::now += 100'000;
  p.woke_up();  // stamps now, spins on without reading the clock
  int reads = fake_clock::reads;
  for (unsigned i = 1; i < clock_every; ++i) CHECK(p.next_turn(false));
  CHECK(fake_clock::reads == reads);
  CHECK(p.next_turn(false));  // turn 48 reads: 0 us since the wake-up
  pollers.clear();
  p.woke_up();  // no pollers, no ring budget: not spinning...
  pollers.push_back(&some_poller);  // ...so the next turn, with a poller again, reads the clock
  reads = fake_clock::reads;
  CHECK(p.next_turn(false));  // turn 49
  CHECK(fake_clock::reads == reads + 1);
}

TEST_CASE("spin_policy: the kernel is entered anyway every 64 turns") {
  reset_clock();
  std::chrono::nanoseconds spin = 50us, ring = 0ns;
  std::vector<shuttle::poller*> pollers{&some_poller};
  policy p(spin, ring, pollers);
  unsigned due = 0;
  for (unsigned i = 0; i < 4 * policy::enter_every; ++i) {
    p.next_turn(false);
    if (p.enter_due()) ++due;
  }
  CHECK(due == 4);
}
