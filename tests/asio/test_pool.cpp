// One asio::io_context run by every loop of a shuttle::runtime
// (include/shuttle/asio/pool.hpp), as Asio's thread-pool programs run it
// from several threads. Runs under TSan in CI (the 'threads' suite). A hang
// is the failure mode of the ending tests (meson's timeout reports it).
#include <shuttle/asio/asio.hpp>  // first: configures Asio

#include <doctest/doctest.h>

#include <boost/asio/bind_executor.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>

#include <shuttle/shuttle.hpp>

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <thread>

namespace net = boost::asio;
namespace sa = shuttle::asio;
using namespace std::chrono_literals;
using boost::system::error_code;

namespace {
// Asio's timer5 tutorial: two timers on one strand, each printing and
// re-arming until a shared count reaches 10, io.run() from two threads.
struct printer {
  explicit printer(net::io_context& io)
      : strand(net::make_strand(io)), timer1(io, 1ms), timer2(io, 1ms) {
    timer1.async_wait(net::bind_executor(strand, [this](error_code) { print(timer1); }));
    timer2.async_wait(net::bind_executor(strand, [this](error_code) { print(timer2); }));
  }
  void print(net::steady_timer& t) {
    // A strand runs one handler at a time: a second one inside would be a race.
    CHECK(inside.fetch_add(1) == 0);
    record_thread();
    if (count < 10) {
      ++count;
      t.expires_at(t.expiry() + 1ms);
      t.async_wait(net::bind_executor(strand, [this, &t](error_code) { print(t); }));
    }
    inside.fetch_sub(1);
  }
  void record_thread() {
    std::lock_guard lock(m);
    threads.insert(std::this_thread::get_id());
  }
  net::strand<net::io_context::executor_type> strand;
  net::steady_timer timer1, timer2;
  int count = 0;  // the strand's
  std::atomic<int> inside{0};
  std::mutex m;
  std::set<std::thread::id> threads;
};
}  // namespace

TEST_CASE("pool: timer5 on a runtime of two loops ends on its own") {
  net::io_context io;
  printer p(io);
  shuttle::runtime rt(2);
  std::size_t n = sa::run(rt, io);
  CHECK(p.count == 10);
  // 12 timer completions; the strand's invokers are handlers of io too,
  // one per timer handler or one for several, as the loops' timing falls.
  CHECK(n >= 12);
  CHECK(io.stopped());
  // Every handler ran on one of the runtime's loops, none on this thread.
  CHECK(p.threads.count(std::this_thread::get_id()) == 0);
  CHECK(!p.threads.empty());
  CHECK(sa::run(rt, io) == 0);  // stopped: returns at once, as io_context::run()
}

// Handlers posted from all loops, counted without a strand through an
// atomic: the context ends when the last work ends, whichever loop runs it.
TEST_CASE("pool: posts fanning out from handlers on three loops all run, then the context ends") {
  net::io_context io;
  std::atomic<int> ran{0};
  std::function<void(int)> spread = [&](int depth) {
    ran.fetch_add(1);
    if (depth == 0) return;
    for (int i = 0; i < 3; ++i) net::post(io, [&spread, depth] { spread(depth - 1); });
  };
  net::post(io, [&] { spread(6); });
  shuttle::runtime rt(3);
  CHECK(sa::run(rt, io) == 1093);  // 1 + 3 + ... + 3^6 handlers
  CHECK(ran.load() == 1093);
  CHECK(io.stopped());
}

// The loop that runs the last handler (or stop()) may find the others
// asleep on Asio's epoll fd while Asio believes no thread waits there: they
// must wake and let go. Repeated: each round is a fresh chance of the race.
TEST_CASE("pool: stop() from a handler, and running out of work, end run() on every loop") {
  shuttle::runtime rt(3);
  for (int round = 0; round < 50; ++round) {
    net::io_context io;
    auto guard = net::make_work_guard(io);
    net::steady_timer t(io, 100us);
    if (round % 2 == 0) {
      t.async_wait([&](error_code) { io.stop(); });
    } else {
      t.async_wait([&](error_code) { guard.reset(); });
    }
    sa::run(rt, io);
    CHECK(io.stopped());
  }
}

// Shuttle operations started in a handler on any loop, completing back on
// the shared context: counted as its work, so the context outlives them.
TEST_CASE("pool: shuttle operations bound to the shared context keep it running") {
  net::io_context io;
  std::atomic<int> done{0};
  for (int i = 0; i < 8; ++i) {
    net::post(io, [&] {
      sa::async_wait_for(1ms, net::bind_executor(io, [&](error_code ec) {
        CHECK(!ec);
        done.fetch_add(1);
      }));
    });
  }
  shuttle::runtime rt(2);
  sa::run(rt, io);
  CHECK(done.load() == 8);
}
