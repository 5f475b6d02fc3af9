// Asio's own rules on shuttle's loop (issue 34): a driven asio::io_context
// ends when Asio's would (out of work, stop()), work posted to it from
// Asio's threads (the resolver's, a worker's) wakes the loop, shuttle's
// executor tracks outstanding work so a program of Asio work ends with it,
// and Asio's I/O objects on shuttle's executor start no Asio thread.
//
// A hang is the failure mode of most of these (meson's timeout reports it);
// none asserts on time.
#include <shuttle/asio/asio.hpp>  // first: configures Asio

#include <doctest/doctest.h>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/bind_executor.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>

#include <shuttle/shuttle.hpp>

#include <atomic>
#include <csignal>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace net = boost::asio;
namespace sa = shuttle::asio;
using namespace std::chrono_literals;
using boost::system::error_code;
using shuttle::task;

// Asio's timer examples (time_t_timer, timer1-4): set up a timer, run, and
// the program ends when the timer has fired.
TEST_CASE("driven io_context: a program with a timer only ends on its own") {
  shuttle::io_context loop;
  net::io_context actx(1);
  net::steady_timer t(actx, 5ms);
  int fired = 0;
  t.async_wait([&](error_code ec) {
    CHECK(!ec);
    ++fired;
  });
  sa::asio_driver drive(loop, actx);
  CHECK(!actx.stopped());
  std::size_t n = drive.run();
  CHECK(fired == 1);
  CHECK(n == 1);
  CHECK(actx.stopped());
  // As io_context::run(): a stopped context returns at once until restart().
  CHECK(drive.run() == 0);
  actx.restart();
  net::post(actx, [&] { ++fired; });
  CHECK(drive.run() == 1);
  CHECK(fired == 2);
}

TEST_CASE("driven io_context: with no work, run() returns at once and the context is stopped") {
  shuttle::io_context loop;
  net::io_context actx(1);
  sa::asio_driver drive(loop, actx);
  CHECK(drive.run() == 0);
  CHECK(actx.stopped());
}

TEST_CASE("driven io_context: a chain of coroutines and timers runs to its end, then the context stops") {
  shuttle::io_context loop;
  net::io_context actx(1);
  int steps = 0;
  for (int i = 0; i < 3; ++i) {
    net::co_spawn(actx, [&]() -> net::awaitable<void> {
      for (int k = 0; k < 3; ++k) {
        net::steady_timer t(co_await net::this_coro::executor, 1ms);
        co_await t.async_wait(net::use_awaitable);
        ++steps;
      }
    }, net::detached);
  }
  sa::asio_driver drive(loop, actx);
  drive.run();
  CHECK(steps == 9);
  CHECK(actx.stopped());
}

TEST_CASE("driven io_context: stop() from a handler ends run() with work still pending") {
  shuttle::io_context loop;
  net::io_context actx(1);
  net::steady_timer long_timer(actx, 1h);
  bool long_fired = false;
  long_timer.async_wait([&](error_code) { long_fired = true; });
  net::steady_timer short_timer(actx, 1ms);
  short_timer.async_wait([&](error_code) { actx.stop(); });
  sa::asio_driver drive(loop, actx);
  drive.run();
  CHECK(actx.stopped());
  CHECK(!long_fired);
}

TEST_CASE("driven io_context: stop() from another thread wakes the sleeping loop") {
  shuttle::io_context loop;
  net::io_context actx(1);
  auto guard = net::make_work_guard(actx);  // work that never ends by itself
  sa::asio_driver drive(loop, actx);
  std::atomic<bool> started{false};
  net::post(actx, [&] { started = true; });
  std::thread stopper([&] {
    while (!started) std::this_thread::yield();
    actx.stop();
  });
  drive.run();
  stopper.join();
  CHECK(actx.stopped());
}

TEST_CASE("driven io_context: asio::post from a worker thread wakes the loop") {
  shuttle::io_context loop;
  net::io_context actx(1);
  auto guard = net::make_work_guard(actx);
  sa::asio_driver drive(loop, actx);
  std::thread::id ran_on;
  int posts = 0;
  std::thread worker([&] {
    // Several posts, some while the loop surely sleeps (it has nothing else
    // to do): each must be run on the loop's thread.
    for (int i = 0; i < 50; ++i) {
      std::atomic<bool> done{false};
      net::post(actx, [&] {
        ran_on = std::this_thread::get_id();
        ++posts;
        done = true;
      });
      while (!done) std::this_thread::yield();
      if (i % 10 == 0) std::this_thread::sleep_for(2ms);
    }
    net::post(actx, [&] { guard.reset(); });  // the last work: the context ends
  });
  drive.run();
  worker.join();
  CHECK(posts == 50);
  CHECK(ran_on == std::this_thread::get_id());
  CHECK(actx.stopped());
}

// The resolver runs getaddrinfo on its own thread and posts the completion
// back to the driven context from there. "localhost" resolves from
// /etc/hosts (no network).
TEST_CASE("driven io_context: async_resolve completes (the resolver's thread wakes the loop)") {
  shuttle::io_context loop;
  net::io_context actx(1);
  net::ip::tcp::resolver resolver(actx);
  std::optional<error_code> got;
  std::size_t results = 0;
  resolver.async_resolve("localhost", "7", [&](error_code ec, net::ip::tcp::resolver::results_type r) {
    got = ec;
    results = r.size();
  });
  sa::asio_driver drive(loop, actx);
  drive.run();
  REQUIRE(got.has_value());
  CHECK_MESSAGE(!*got, got->message());
  CHECK(results > 0);
  CHECK(actx.stopped());
}

TEST_CASE("driven io_context: a shuttle task awaits until_stopped() while shuttle work goes on") {
  shuttle::io_context loop;
  net::io_context actx(1);
  sa::asio_driver drive(loop, actx);
  int shuttle_turns = 0;
  bool asio_done = false;
  loop.run([&]() -> task<void> {
    net::steady_timer t(actx, 3ms);
    t.async_wait([&](error_code) { asio_done = true; });
    auto ticker = [&]() -> task<void> {
      while (!asio_done) {
        (void)co_await shuttle::sleep_for(200us);
        ++shuttle_turns;
      }
    };
    auto waiter = [&]() -> task<void> { co_await drive.until_stopped(); };
    co_await shuttle::when_all(ticker(), waiter());
  }());
  CHECK(asio_done);
  CHECK(actx.stopped());
  CHECK(shuttle_turns > 0);
}

// shuttle's executor counts Asio's outstanding work: co_spawn on the context
// and run() end when the coroutines end, as on an asio::io_context.
TEST_CASE("shuttle::asio::context: outstanding_work.tracked counts; run() ends when the work ends") {
  shuttle::io_context loop;
  sa::context ctx(loop);
  {
    auto ex = net::prefer(ctx.get_executor(), net::execution::outstanding_work.tracked);
    CHECK(net::query(ex, net::execution::outstanding_work) == net::execution::outstanding_work.tracked);
    CHECK(ctx.outstanding_work() == 1);
    auto copy = ex;
    CHECK(ctx.outstanding_work() == 2);
    auto moved = std::move(copy);
    CHECK(ctx.outstanding_work() == 2);
    auto guard = net::make_work_guard(ctx.get_executor());
    CHECK(ctx.outstanding_work() == 3);
    net::any_io_executor any = ex;
    CHECK(ctx.outstanding_work() == 4);
  }
  CHECK(ctx.outstanding_work() == 0);
  CHECK(ctx.stopped());  // the last work's end stops it, as in Asio
  ctx.restart();

  int steps = 0;
  for (int i = 0; i < 3; ++i) {
    net::co_spawn(ctx.get_executor(), [&]() -> net::awaitable<void> {
      for (int k = 0; k < 3; ++k) {
        co_await sa::async_wait_for(1ms, net::use_awaitable);  // a shuttle timer
        ++steps;
      }
    }, net::detached);
  }
  CHECK(ctx.outstanding_work() > 0);
  ctx.run();
  CHECK(steps == 9);
  CHECK(ctx.outstanding_work() == 0);
  CHECK(ctx.stopped());
}

TEST_CASE("shuttle::asio::context: run() with no work returns; stop() from another thread ends it") {
  shuttle::io_context loop;
  sa::context ctx(loop);
  ctx.run();
  CHECK(ctx.stopped());
  ctx.restart();
  auto guard = net::make_work_guard(ctx.get_executor());
  std::atomic<bool> started{false};
  net::post(ctx.get_executor(), [&] { started = true; });
  std::thread stopper([&] {
    while (!started) std::this_thread::yield();
    ctx.stop();
  });
  ctx.run();
  stopper.join();
  CHECK(ctx.stopped());
  CHECK(ctx.outstanding_work() == 1);
}

// A shuttle operation whose handler runs on the driven context counts as
// work there, as Asio's own operations do (handler_work): the context does
// not stop, and run() does not return, while it is pending.
TEST_CASE("driven io_context: a pending shuttle operation bound to it is its work") {
  shuttle::io_context loop;
  net::io_context actx(1);
  bool fired = false;
  std::thread::id ran_on;
  sa::async_wait_for(3ms, net::bind_executor(actx, [&](error_code ec) {
    CHECK(!ec);
    fired = true;
    ran_on = std::this_thread::get_id();
  }));
  // The same through async_run's general path (a shuttle task's result).
  std::optional<int> got;
  sa::async_run(loop, []() -> task<int> {
    (void)co_await shuttle::sleep_for(2ms);
    co_return 7;
  }, net::bind_executor(actx, [&](std::exception_ptr, int v) { got = v; }));
  sa::asio_driver drive(loop, actx);
  CHECK(drive.run() == 2);
  CHECK(fired);
  CHECK(got == 7);
  CHECK(ran_on == std::this_thread::get_id());
  CHECK(actx.stopped());
}

namespace {
// Threads of this process now.
std::size_t thread_count() {
  std::size_t n = 0;
  for ([[maybe_unused]] auto& e : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}
}  // namespace

// Asio's I/O objects on shuttle's executor: no Asio scheduler thread, every
// completion on the loop's thread.
TEST_CASE("shuttle::asio::context: steady_timer, tcp sockets and signal_set run on the loop's thread") {
  const std::size_t before = thread_count();
  const auto me = std::this_thread::get_id();
  shuttle::io_context loop;
  sa::context ctx(loop);
  net::steady_timer timer(ctx, 1ms);
  net::ip::tcp::acceptor acceptor(ctx, {net::ip::make_address("127.0.0.1"), 0});
  net::ip::tcp::socket client(ctx), server(ctx);
  net::signal_set signals(ctx, SIGUSR1);
  CHECK(thread_count() == before);
  std::vector<std::thread::id> ran_on;
  std::string echoed;
  int signal_number = 0;
  net::co_spawn(ctx, [&]() -> net::awaitable<void> {
    co_await timer.async_wait(net::use_awaitable);
    ran_on.push_back(std::this_thread::get_id());
    acceptor.async_accept(server, [&](error_code ec) {
      CHECK(!ec);
      ran_on.push_back(std::this_thread::get_id());
    });
    co_await client.async_connect(acceptor.local_endpoint(), net::use_awaitable);
    ran_on.push_back(std::this_thread::get_id());
    co_await net::async_write(client, net::buffer(std::string_view("ping")), net::use_awaitable);
    char buf[4];
    co_await net::async_read(server, net::buffer(buf), net::use_awaitable);
    ran_on.push_back(std::this_thread::get_id());
    echoed.assign(buf, 4);
    ::raise(SIGUSR1);  // to this thread: Asio's handler writes its pipe
    signal_number = co_await signals.async_wait(net::use_awaitable);
    ran_on.push_back(std::this_thread::get_id());
  }, net::detached);
  ctx.run();  // ends with the coroutine: the operations counted as work
  CHECK(echoed == "ping");
  CHECK(signal_number == SIGUSR1);
  REQUIRE(ran_on.size() == 5);
  for (auto id : ran_on) CHECK(id == me);
  CHECK(thread_count() == before);
}

// The resolver keeps its own getaddrinfo thread, as on an io_context (made
// at the first async_resolve); its completion comes back to the loop.
TEST_CASE("shuttle::asio::context: async_resolve completes on the loop's thread") {
  const std::size_t before = thread_count();
  shuttle::io_context loop;
  sa::context ctx(loop);
  net::ip::tcp::resolver resolver(ctx);
  CHECK(thread_count() == before);
  std::optional<error_code> got;
  std::thread::id ran_on;
  resolver.async_resolve("localhost", "7", [&](error_code ec, net::ip::tcp::resolver::results_type r) {
    got = ec;
    ran_on = std::this_thread::get_id();
    CHECK(r.size() > 0);
  });
  ctx.run();
  REQUIRE(got.has_value());
  CHECK_MESSAGE(!*got, got->message());
  CHECK(ran_on == std::this_thread::get_id());
  CHECK(thread_count() <= before + 1);  // the resolver's own, as on an io_context
}

// A context whose Asio objects are only shuttle operations never starts
// Asio's reactor: no epoll, no extra descriptors.
TEST_CASE("shuttle::asio::context: without I/O objects the reactor is not started") {
  shuttle::io_context loop;
  sa::context ctx(loop);
  net::co_spawn(ctx.get_executor(), []() -> net::awaitable<void> {
    co_await sa::async_wait_for(1ms, net::use_awaitable);
  }, net::detached);
  ctx.run();
  CHECK(!net::has_service<net::detail::epoll_reactor>(ctx));
}
