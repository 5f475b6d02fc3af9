// Multi-threaded: these run under TSan in CI.
#include <doctest/doctest.h>

#include <shuttle/detail/loop_cancel.hpp>
#include <shuttle/shuttle.hpp>

#include <atomic>
#include <thread>

using namespace shuttle;
using namespace std::chrono_literals;

TEST_CASE("cross-thread post wakes a sleeping loop") {
  io_context ctx;
  std::atomic<int> ran{0};
  std::thread t;
  ctx.run([&]() -> task<void> {
    event done;
    t = std::thread([&] {
      for (int i = 0; i < 1000; ++i) ctx.dispatch([&] { ran.fetch_add(1); });
      ctx.dispatch([&] { done.set(); });
    });
    (void)co_await done.wait();
  }());
  t.join();
  CHECK(ran.load() == 1000);
}

TEST_CASE("stop() from another thread ends run()") {
  io_context ctx;
  std::thread t([&] {
    std::this_thread::sleep_for(10ms);
    ctx.stop();
  });
  ctx.run();
  t.join();
}

TEST_CASE("runtime: tasks run on the chosen thread and hop between threads") {
  runtime rt(3);
  std::thread::id ids[3];
  for (std::size_t i = 0; i < 3; ++i)
    ids[i] = rt.block_on(i, []() -> task<std::thread::id> { co_return std::this_thread::get_id(); }());
  CHECK(ids[0] != ids[1]);
  CHECK(ids[1] != ids[2]);
  auto hops = rt.block_on(0, [&]() -> task<int> {
    int n = 0;
    for (int i = 0; i < 300; ++i) {
      std::size_t target = static_cast<std::size_t>(i % 3);
      co_await rt.context(target).schedule();
      if (std::this_thread::get_id() == ids[target]) ++n;
    }
    co_return n;
  }());
  CHECK(hops == 300);
}

TEST_CASE("runtime: block_on propagates exceptions") {
  runtime rt(1);
  CHECK_THROWS_AS(rt.block_on(0, []() -> task<int> {
    throw std::runtime_error("x");
    co_return 1;
  }()), std::runtime_error);
}

TEST_CASE("runtime: request_stop cancels spawned tasks on every thread") {
  std::atomic<int> cancelled{0};
  {
    auto sleeper = [&]() -> task<void> {
      auto r = co_await sleep_for(60s);
      if (r.error() == std::errc::operation_canceled) cancelled.fetch_add(1);
    };
    runtime rt(2);
    for (std::size_t i = 0; i < 2; ++i)
      for (int k = 0; k < 10; ++k) rt.spawn(i, sleeper());
    std::this_thread::sleep_for(20ms);
    rt.request_stop();
    rt.join();
  }
  CHECK(cancelled.load() == 20);
}

TEST_CASE("cancellation requested from a foreign thread reaches the loop") {
  io_context ctx;
  std::stop_source src;
  async_scope scope;
  std::error_code ec;
  std::thread t;
  auto child = [&]() -> task<void> { ec = (co_await sleep_for(60s)).error(); };
  ctx.run([&]() -> task<void> {
    scope.spawn(child());
    t = std::thread([&] {
      std::this_thread::sleep_for(10ms);
      scope.request_stop();
    });
    co_await scope.join();
  }());
  t.join();
  CHECK(ec == std::errc::operation_canceled);
}

namespace {
// An operation cancelled through detail::loop_cancel: records where and
// when its cancellation ran and when its last reference went.
struct probe_op : detail::loop_cancel<probe_op> {
  std::thread::id cancelled_on{};
  int refs_at_cancel = 0;
  bool finished = false;
  void cancel_here() noexcept {
    cancelled_on = std::this_thread::get_id();
    refs_at_cancel = refs.load();
  }
  void release() noexcept {
    if (unref()) finished = true;
  }
};
}  // namespace

TEST_CASE("loop_cancel: cancels inline on the loop, hands over from another thread") {
  io_context ctx;
  ctx.run([&]() -> task<void> {
    const auto loop_id = std::this_thread::get_id();
    probe_op op;
    op.refs.store(1);
    op.request_cancel(ctx);  // the loop's own thread: at once, no reference taken
    CHECK(op.cancelled_on == loop_id);
    CHECK(op.refs_at_cancel == 1);

    op.cancelled_on = {};
    std::thread([&] { op.request_cancel(ctx); }).join();
    CHECK(op.cancelled_on == std::thread::id{});  // not on the foreign thread
    CHECK(op.refs.load() == 2);                   // the hand-off holds the operation
    for (int i = 0; i < 100 && op.cancelled_on == std::thread::id{}; ++i) co_await yield();
    CHECK(op.cancelled_on == loop_id);
    CHECK(op.refs_at_cancel == 2);  // still held while it cancels
    CHECK(op.refs.load() == 1);     // the hand-off let go afterwards
    CHECK_FALSE(op.finished);
    op.release();  // the operation's own completion
    CHECK(op.finished);
  }());
}

TEST_CASE("cancel_on_loop: runs at once on the loop, later from another thread") {
  io_context ctx;
  ctx.run([&]() -> task<void> {
    const auto loop_id = std::this_thread::get_id();
    std::thread::id ran_on{};
    detail::cancel_on_loop(ctx, [&] { ran_on = std::this_thread::get_id(); });
    CHECK(ran_on == loop_id);

    ran_on = {};
    std::thread([&] { detail::cancel_on_loop(ctx, [&] { ran_on = std::this_thread::get_id(); }); }).join();
    CHECK(ran_on == std::thread::id{});
    for (int i = 0; i < 100 && ran_on == std::thread::id{}; ++i) co_await yield();
    CHECK(ran_on == loop_id);
  }());
}

TEST_CASE("signal_set receives a raised signal") {
  io_context ctx;
  signal_set sigs{SIGUSR1};
  auto r = ctx.run([&]() -> task<result<int>> {
    std::thread([] {
      std::this_thread::sleep_for(5ms);
      ::kill(::getpid(), SIGUSR1);
    }).detach();
    co_return co_await sigs.wait();
  }());
  REQUIRE(r.has_value());
  CHECK(*r == SIGUSR1);
}

TEST_CASE("runtime: tasks spawned just before join() still run") {
  std::atomic<int> ran{0};
  auto count = [&]() -> task<void> {
    ran.fetch_add(1);
    co_return;
  };
  for (int i = 0; i < 200; ++i) {
    runtime rt(1);
    rt.spawn(0, count());
    rt.join();
  }
  CHECK(ran.load() == 200);
}

TEST_CASE("run(task) is not ended by stop(); run() is") {
  io_context ctx;
  std::thread t([&] {
    std::this_thread::sleep_for(5ms);
    ctx.stop();
  });
  int v = ctx.run([]() -> task<int> {
    (void)co_await sleep_for(30ms);
    co_return 9;
  }());
  t.join();
  CHECK(v == 9);
}
