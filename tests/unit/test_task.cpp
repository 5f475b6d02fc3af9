#include <doctest/doctest.h>

#include <shuttle/shuttle.hpp>

#include <stdexcept>
#include <string>

using namespace shuttle;
using namespace std::chrono_literals;

namespace {
task<int> forty_two() { co_return 42; }
task<int> add(int a, int b) { co_return co_await forty_two() - 42 + a + b; }
task<void> thrower() {
  throw std::runtime_error("boom");
  co_return;
}
task<int> deep(int n) {
  if (n == 0) co_return 0;
  co_return 1 + co_await deep(n - 1);
}
}  // namespace

TEST_CASE("task returns values and propagates exceptions") {
  CHECK(sync_wait(add(1, 2)) == 3);
  CHECK_THROWS_WITH_AS(sync_wait(thrower()), "boom", std::runtime_error);
  CHECK(sync_wait([]() -> task<std::string> { co_return "hi"; }()) == "hi");
}

TEST_CASE("task is lazy") {
  bool started = false;
  auto body = [&]() -> task<void> {
    started = true;
    co_return;
  };
  auto t = body();
  CHECK_FALSE(started);
  sync_wait(std::move(t));
  CHECK(started);
}

TEST_CASE("deep recursion uses symmetric transfer, not the stack") {
#if defined(__OPTIMIZE__) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
  CHECK(sync_wait(deep(100000)) == 100000);
#else
  // Unoptimised and sanitizer builds do not turn symmetric transfer into tail calls.
  CHECK(sync_wait(deep(1000)) == 1000);
#endif
}

TEST_CASE("task can be destroyed without being run") {
  auto t = forty_two();
  CHECK(t.valid());
}

TEST_CASE("when_all returns every result") {
  auto r = sync_wait(when_all(forty_two(), add(1, 1), []() -> task<void> { co_return; }()));
  CHECK(std::get<0>(r) == 42);
  CHECK(std::get<1>(r) == 2);
}

TEST_CASE("when_all over a vector runs concurrently") {
  io_context ctx;
  auto start = clock::now();
  std::vector<task<int>> v;
  for (int i = 0; i < 50; ++i)
    v.push_back([](int i) -> task<int> {
      (void)co_await sleep_for(20ms);
      co_return i;
    }(i));
  auto r = ctx.run(when_all(std::move(v)));
  REQUIRE(r.size() == 50);
  for (int i = 0; i < 50; ++i) CHECK(r[i] == i);
  // 50 sleeps of 20 ms one after another would take a second.
  CHECK(clock::now() - start < 900ms);
}

TEST_CASE("when_all stops the others when one throws, then rethrows") {
  io_context ctx;
  bool other_cancelled = false;
  auto sleeper = [&]() -> task<void> {
    auto r = co_await sleep_for(10s);
    other_cancelled = r.error() == std::errc::operation_canceled;
  };
  auto failing = []() -> task<void> {
    (void)co_await sleep_for(1ms);
    throw std::runtime_error("fail");
  };
  CHECK_THROWS_AS(ctx.run(when_all(sleeper(), failing())), std::runtime_error);
  CHECK(other_cancelled);
}

TEST_CASE("when_any returns the first and cancels and awaits the losers") {
  io_context ctx;
  bool loser_finished = false;
  auto slow = [&]() -> task<int> {
    auto r = co_await sleep_for(10s);
    CHECK(r.error() == std::errc::operation_canceled);
    loser_finished = true;
    co_return 1;
  };
  auto fast = []() -> task<int> {
    (void)co_await sleep_for(1ms);
    co_return 2;
  };
  auto start = clock::now();
  auto r = ctx.run(when_any(slow(), fast()));
  CHECK(r.index() == 1);
  CHECK(std::get<1>(r) == 2);
  CHECK(loser_finished);  // awaited before when_any returned
  CHECK(clock::now() - start < 5s);
}

TEST_CASE("when_any with a synchronously finishing child") {
  auto r = sync_wait(when_any(forty_two(), []() -> task<void> {
    (void)co_await sleep_for(10s);
  }()));
  CHECK(r.index() == 0);
}

TEST_CASE("stop token propagates from parent to nested tasks") {
  io_context ctx;
  auto inner = []() -> task<std::error_code> {
    auto r = co_await sleep_for(10s);
    co_return r.error();
  };
  auto outer = [&]() -> task<std::error_code> { co_return co_await inner(); };
  async_scope scope;
  std::error_code got;
  auto guarded = [&]() -> task<void> {
    auto token = co_await get_stop_token();
    CHECK_FALSE(token.stop_requested());
  };
  ctx.run(guarded());
  // async_scope children get the scope's token.
  // Lambda coroutines keep their captures in the lambda object: it must
  // outlive the task, so it is named here rather than a temporary.
  auto child = [&]() -> task<void> { got = co_await outer(); };
  scope.spawn(child());
  ctx.run([&]() -> task<void> {
    (void)co_await sleep_for(5ms);
    scope.request_stop();
    co_await scope.join();
  }());
  CHECK(got == std::errc::operation_canceled);
}

TEST_CASE("async_scope joins children and rethrows the first failure") {
  io_context ctx;
  async_scope scope;
  int done = 0;
  for (int i = 0; i < 100; ++i)
    scope.spawn([](int& done, int i) -> task<void> {
      (void)co_await sleep_for(std::chrono::milliseconds(i % 5));
      ++done;
    }(done, i));
  ctx.run(scope.join());
  CHECK(done == 100);
  scope.spawn([]() -> task<void> {
    throw std::logic_error("child");
    co_return;
  }());
  CHECK_THROWS_AS(ctx.run(scope.join()), std::logic_error);
  CHECK(scope.active() == 0);
}

TEST_CASE("yield lets other coroutines run") {
  io_context ctx;
  std::string trace;
  auto a = [&]() -> task<void> {
    trace += 'a';
    co_await yield();
    trace += 'a';
  };
  auto b = [&]() -> task<void> {
    trace += 'b';
    co_await yield();
    trace += 'b';
  };
  ctx.run(when_all(a(), b()));
  CHECK(trace == "abab");
}
