#include <doctest/doctest.h>

#include <shuttle/shuttle.hpp>

using namespace shuttle;
using namespace std::chrono_literals;

TEST_CASE("event wakes every waiter") {
  io_context ctx;
  event ev;
  int woken = 0;
  auto waiter = [&]() -> task<void> {
    auto r = co_await ev.wait();
    CHECK(r.has_value());
    ++woken;
  };
  auto setter = [&]() -> task<void> {
    (void)co_await sleep_for(1ms);
    ev.set();
  };
  ctx.run(when_all(waiter(), waiter(), waiter(), setter()));
  CHECK(woken == 3);
  // Already set: no suspension.
  ctx.run(waiter());
  CHECK(woken == 4);
}

TEST_CASE("semaphore limits concurrency and is FIFO") {
  io_context ctx;
  semaphore sem(2);
  int inside = 0, max_inside = 0;
  std::vector<int> order;
  auto worker = [&](int id) -> task<void> {
    REQUIRE((co_await sem.acquire()).has_value());
    order.push_back(id);
    ++inside;
    max_inside = std::max(max_inside, inside);
    (void)co_await sleep_for(1ms);
    --inside;
    sem.release();
  };
  std::vector<task<void>> ts;
  for (int i = 0; i < 10; ++i) ts.push_back(worker(i));
  ctx.run(when_all(std::move(ts)));
  CHECK(max_inside == 2);
  CHECK(order == std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9});
  CHECK(sem.available() == 2);
}

TEST_CASE("semaphore: try_acquire_up_to takes what is free, none while others wait") {
  io_context ctx;
  semaphore sem(5);
  CHECK(sem.try_acquire_up_to(3) == 3);
  CHECK(sem.try_acquire_up_to(3) == 2);  // only 2 left
  CHECK(sem.try_acquire_up_to(3) == 0);
  CHECK(sem.available() == 0);
  bool got = false;
  auto waiter = [&]() -> task<void> {
    REQUIRE((co_await sem.acquire()).has_value());
    got = true;
  };
  auto other = [&]() -> task<void> {
    co_await yield();  // the waiter is parked
    CHECK(sem.try_acquire_up_to(1) == 0);
    sem.release(2);  // one to the waiter, one free
    CHECK(sem.try_acquire_up_to(4) == 1);
  };
  ctx.run(when_all(waiter(), other()));
  CHECK(got);
  CHECK(sem.available() == 0);
  sem.close(std::make_error_code(std::errc::connection_reset));
  sem.release(3);
  CHECK(sem.try_acquire_up_to(3) == 0);  // closed: nothing
}

TEST_CASE("a cancelled semaphore wait does not consume a unit") {
  io_context ctx;
  semaphore sem(0);
  auto r = ctx.run(with_timeout([&]() -> task<result<void>> { co_return co_await sem.acquire(); }(), 5ms));
  CHECK(r.error() == std::errc::timed_out);
  sem.release();
  CHECK(sem.available() == 1);
}

TEST_CASE("a closed semaphore fails its waiters and later acquires with its error") {
  io_context ctx;
  semaphore sem(0);
  const auto why = std::make_error_code(std::errc::connection_reset);
  std::vector<std::error_code> got;
  auto waiter = [&]() -> task<void> {
    auto r = co_await sem.acquire();
    got.push_back(r ? std::error_code{} : r.error());
  };
  auto closer = [&]() -> task<void> {
    co_await yield();
    sem.close(why);
    sem.close(std::make_error_code(std::errc::io_error));  // the first error stays
  };
  ctx.run(when_all(waiter(), waiter(), closer()));
  CHECK(got == std::vector<std::error_code>{why, why});
  CHECK(sem.closed() == why);
  sem.release(5);  // units given back after the close are dropped
  CHECK(sem.available() == 0);
  CHECK_FALSE(sem.try_acquire());
  auto r = ctx.run([&]() -> task<result<void>> { co_return co_await sem.acquire(); }());
  CHECK(r.error() == why);
}

TEST_CASE("mutex serialises critical sections") {
  io_context ctx;
  shuttle::mutex m;
  int value = 0;
  auto incr = [&]() -> task<void> {
    for (int i = 0; i < 100; ++i) {
      auto g = co_await m.lock();
      REQUIRE(g.has_value());
      int v = value;
      co_await yield();
      value = v + 1;
    }
  };
  ctx.run(when_all(incr(), incr(), incr()));
  CHECK(value == 300);
}

TEST_CASE("channel: backpressure, order, close drains") {
  io_context ctx;
  channel<int> ch(4);
  std::vector<int> got;
  int max_size = 0;
  auto producer = [&]() -> task<void> {
    for (int i = 0; i < 1000; ++i) {
      REQUIRE((co_await ch.send(i)).has_value());
      max_size = std::max<int>(max_size, static_cast<int>(ch.size()));
    }
    ch.close();
  };
  auto consumer = [&]() -> task<void> {
    for (;;) {
      auto v = co_await ch.receive();
      if (!v) {
        CHECK(v.error() == std::errc::broken_pipe);
        break;
      }
      got.push_back(*v);
      if (got.size() % 7 == 0) (void)co_await sleep_for(100us);
    }
  };
  ctx.run(when_all(producer(), consumer(), consumer()));
  REQUIRE(got.size() == 1000);
  CHECK(max_size <= 4);
  std::vector<int> sorted = got;
  std::sort(sorted.begin(), sorted.end());
  for (int i = 0; i < 1000; ++i) CHECK(sorted[i] == i);
}

TEST_CASE("channel: single consumer sees FIFO order; send after close fails") {
  io_context ctx;
  channel<std::unique_ptr<int>> ch(2);
  std::vector<int> got;
  ctx.run(when_all(
      [&]() -> task<void> {
        for (int i = 0; i < 100; ++i) REQUIRE((co_await ch.send(std::make_unique<int>(i))).has_value());
        ch.close();
        auto r = co_await ch.send(std::make_unique<int>(-1));
        CHECK(r.error() == std::errc::broken_pipe);
      }(),
      [&]() -> task<void> {
        while (auto v = co_await ch.receive()) got.push_back(**v);
      }()));
  REQUIRE(got.size() == 100);
  for (int i = 0; i < 100; ++i) CHECK(got[i] == i);
}

TEST_CASE("channel: a cancelled receive leaves items for others") {
  io_context ctx;
  channel<int> ch(1);
  auto r = ctx.run(with_timeout([&]() -> task<result<int>> { co_return co_await ch.receive(); }(), 2ms));
  CHECK(r.error() == std::errc::timed_out);
  int v = 5;
  CHECK(ch.try_send(v));
  CHECK(ch.try_receive() == 5);
}
