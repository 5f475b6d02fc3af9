#include <doctest/doctest.h>

#include "../../lib/spin_clock.hpp"
#include <shuttle/shuttle.hpp>

#include <thread>

using namespace shuttle;
using namespace std::chrono_literals;

TEST_CASE("sleep_for waits at least the duration") {
  io_context ctx;
  auto start = clock::now();
  auto r = ctx.run([]() -> task<result<void>> { co_return co_await sleep_for(20ms); }());
  CHECK(r.has_value());
  CHECK(clock::now() - start >= 20ms);
}

TEST_CASE("sleep_until in the past completes at once") {
  io_context ctx;
  auto r = ctx.run([]() -> task<result<void>> { co_return co_await sleep_until(clock::now() - 1s); }());
  CHECK(r.has_value());
}

TEST_CASE("timers fire in deadline order") {
  io_context ctx;
  std::vector<int> order;
  auto sleeper = [&](int ms) -> task<void> {
    (void)co_await sleep_for(std::chrono::milliseconds(ms));
    order.push_back(ms);
  };
  ctx.run(when_all(sleeper(30), sleeper(10), sleeper(20)));
  CHECK(order == std::vector<int>{10, 20, 30});
}

TEST_CASE("with_timeout: the task wins") {
  io_context ctx;
  auto r = ctx.run(with_timeout([]() -> task<int> {
    (void)co_await sleep_for(1ms);
    co_return 7;
  }(), 5s));
  REQUIRE(r.has_value());
  CHECK(*r == 7);
}

TEST_CASE("with_timeout: the timeout wins and the task is cancelled") {
  io_context ctx;
  bool cancelled = false;
  auto start = clock::now();
  auto r = ctx.run(with_timeout([&]() -> task<int> {
    auto s = co_await sleep_for(10s);
    cancelled = s.error() == std::errc::operation_canceled;
    co_return 7;
  }(), 10ms));
  CHECK(r.error() == std::errc::timed_out);
  CHECK(cancelled);
  CHECK(clock::now() - start < 5s);
}

TEST_CASE("cancel before submit: an already stopped token never submits") {
  io_context ctx;
  async_scope scope;
  scope.request_stop();
  std::error_code ec;
  auto before = ctx.submitted_sqes();
  auto child = [&]() -> task<void> { ec = (co_await sleep_for(10s)).error(); };
  scope.spawn(child());
  ctx.run(scope.join());
  CHECK(ec == std::errc::operation_canceled);
  CHECK(ctx.submitted_sqes() == before);
}

TEST_CASE("cancel after completion has no effect") {
  io_context ctx;
  async_scope scope;
  std::error_code ec = std::make_error_code(std::errc::io_error);
  auto child = [&]() -> task<void> { ec = (co_await sleep_for(1ms)).error(); };
  scope.spawn(child());
  ctx.run([&]() -> task<void> {
    (void)co_await sleep_for(20ms);
    scope.request_stop();
    co_await scope.join();
  }());
  CHECK_FALSE(ec);
}

TEST_CASE("cancel racing completion: every operation resumes exactly once") {
  io_context ctx;
  // Deadlines at the same instant as the cancel: some finish, some are
  // cancelled; each must resume once with one of the two outcomes.
  for (int round = 0; round < 20; ++round) {
    async_scope scope;
    int ok = 0, cancelled = 0, other = 0;
    auto deadline = clock::now() + 2ms;
    auto child = [&]() -> task<void> {
      auto r = co_await sleep_until(deadline);
      if (r)
        ++ok;
      else if (r.error() == std::errc::operation_canceled)
        ++cancelled;
      else
        ++other;
    };
    for (int i = 0; i < 50; ++i) scope.spawn(child());
    ctx.run([&]() -> task<void> {
      (void)co_await sleep_until(deadline);
      scope.request_stop();
      co_await scope.join();
    }());
    CHECK(ok + cancelled == 50);
    CHECK(other == 0);
  }
}

// ring_spin_budget: the loop polls the ring instead of sleeping in it while
// completions keep arriving within the budget.
TEST_CASE("ring_spin_budget: the loop polls the ring instead of sleeping") {
  auto ten_sleeps = []() -> task<void> {
    for (int i = 0; i < 10; ++i) (void)co_await sleep_for(1ms);
  };
  {
    io_context ctx;
    ctx.run(ten_sleeps());
    CHECK(ctx.loop_sleeps() >= 10);  // each timer was waited for asleep
  }
  {
    io_context::options o;
    o.ring_spin_budget = 10s;
    io_context ctx(o);
    ctx.run(ten_sleeps());
    CHECK(ctx.loop_sleeps() == 0);
    ctx.set_ring_spin_budget(0ns);
    ctx.run(ten_sleeps());
    CHECK(ctx.loop_sleeps() >= 10);
  }
}

// A loop that never sleeps (its poller keeps it busy) must still see the
// ring's completions: busy turns enter the kernel only when it flags
// completion work (IORING_SETUP_TASKRUN_FLAG) or every few dozen turns.
TEST_CASE("a busy-polling loop still completes io_uring operations") {
  struct busy_poller : poller {
    bool report_work;
    std::uint64_t polls = 0;
    explicit busy_poller(bool w) : report_work(w) {}
    bool poll() override {
      ++polls;
      return report_work;
    }
    bool try_enter_interrupt_mode() override { return false; }  // never lets it sleep
    void exit_interrupt_mode() override {}
  };
  for (bool report_work : {true, false}) {
    CAPTURE(report_work);
    io_context ctx;
    busy_poller p(report_work);
    ctx.backend().add_poller(p);
    auto t0 = std::chrono::steady_clock::now();
    ctx.run([]() -> task<void> {
      for (int i = 0; i < 5; ++i) (void)co_await sleep_for(2ms);
    }());
    auto took = std::chrono::steady_clock::now() - t0;
    ctx.backend().remove_poller(p);
    CHECK(ctx.loop_sleeps() == 0);
    CHECK(p.polls > 5);
    CHECK(took >= 10ms);
    CHECK(took < 5s);
  }
}

// spin_clock (the busy-polling budgets' clock: the TSC on x86) keeps time
// with steady_clock. Each end is a spin_clock read bracketed by two
// steady_clock reads, retried until the bracket is tight: a preemption next
// to one read (a loaded CI machine) would otherwise skew a 30 ms window by
// more than the tolerance.
TEST_CASE("spin_clock advances with steady_clock") {
  (void)detail::spin_clock::now_ns();  // calibrates, outside the measured window
  struct point {
    double steady_ns;
    std::int64_t spin_ns;
  };
  const auto sample = [] {
    for (int attempt = 0;; ++attempt) {
      const auto a = std::chrono::steady_clock::now();
      const std::int64_t s = detail::spin_clock::now_ns();
      const auto b = std::chrono::steady_clock::now();
      if (b - a < 100us || attempt == 1000)
        return point{std::chrono::duration<double, std::nano>((a + (b - a) / 2).time_since_epoch()).count(), s};
    }
  };
  const point p0 = sample();
  std::this_thread::sleep_for(30ms);
  const point p1 = sample();
  const double ratio = double(p1.spin_ns - p0.spin_ns) / (p1.steady_ns - p0.steady_ns);
  CAPTURE(ratio);
  CHECK(ratio > 0.8);
  CHECK(ratio < 1.2);
}

// The loop busy-polls its pollers for spin_budget after the last work and
// only then offers them interrupt mode and sleeps.
TEST_CASE("spin_budget: the loop spins for the budget, then sleeps") {
  struct idle_poller : poller {
    std::chrono::steady_clock::time_point first_offer{};
    bool poll() override { return false; }
    bool try_enter_interrupt_mode() override {
      if (first_offer == std::chrono::steady_clock::time_point{}) first_offer = std::chrono::steady_clock::now();
      return true;
    }
    void exit_interrupt_mode() override {}
  };
  io_context::options o;
  o.spin_budget = 20ms;
  io_context ctx(o);
  idle_poller p;
  ctx.backend().add_poller(p);
  const auto t0 = std::chrono::steady_clock::now();
  ctx.run([]() -> task<void> { (void)co_await sleep_for(200ms); }());
  ctx.backend().remove_poller(p);
  const auto spun = p.first_offer - t0;
  const double spun_ms = std::chrono::duration<double, std::milli>(spun).count();
  CAPTURE(spun_ms);
  CHECK(spun >= 15ms);   // the budget, less the spin clock's calibration error
  CHECK(spun < 190ms);  // before the timer: it did not spin until the next work (slack for a loaded machine)
  CHECK(ctx.loop_sleeps() >= 1);
}
