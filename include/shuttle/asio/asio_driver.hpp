// asio_driver: an asio::io_context driven from a shuttle loop, on the same
// thread, with one place to sleep.
//
//   shuttle::io_context loop;
//   boost::asio::io_context actx(1);
//   ... set up Asio work as usual (co_spawn, timers, acceptors) ...
//   shuttle::asio::asio_driver drive(loop, actx);   // from here on, the loop runs actx
//   drive.run();            // instead of actx.run(): returns when actx stops
//
// Asio's rules hold: the driven context is run by the loop, so it stops as
// io_context::run() would, when it runs out of work (stopped() becomes
// true) or on actx.stop() (from any thread); drive.run() returns then, as
// does `co_await drive.until_stopped()` in a shuttle task. A stopped context
// stays stopped (the driver no longer polls it) until actx.restart() on the
// loop's thread. The driver holds no work of its own: a program that uses
// Asio objects from shuttle tasks between Asio operations (nothing pending
// in Asio for a while) holds `net::make_work_guard(actx)` for as long, as a
// thread calling io_context::run() would need to.
//
// How (scheduler_driver.hpp): the driver is one of the loop's pollers; while
// the loop sleeps it has an io_uring poll armed on Asio's epoll fd, and it
// polls the context (actx.poll(), handlers on the loop's thread) when that
// fd fired, when a shuttle operation handed a handler to Asio, when Asio's
// queue holds work as the loop is about to sleep, and every 64th busy turn.
// Asio's own threads (the resolver's, workers posting, stop()) wake the
// sleeping loop through Asio's interrupter.
//
// Limits: do not call actx.run() from another thread while a driver exists;
// several loops may drive one context, each with its own driver (a pool:
// shuttle::asio::run(runtime&, io_context&), runtime.hpp). Destroy the
// driver before the loop. Needs Asio's epoll reactor (the Linux default).
#pragma once

#include <shuttle/asio/config.hpp>
#include <shuttle/asio/executor.hpp>
#include <shuttle/asio/scheduler_driver.hpp>

#include <cstddef>
#include <cstdint>
#include <utility>

#include <boost/asio/io_context.hpp>

#include <shuttle/io_context.hpp>
#include <shuttle/task.hpp>

namespace shuttle::asio {

class asio_driver final : public detail::scheduler_driver {
 public:
  asio_driver(shuttle::io_context& loop, net::io_context& actx)
      : scheduler_driver(loop, actx, net::use_service<net::detail::scheduler>(actx), -1), actx_(actx) {
    previous_kick_ = std::exchange(detail::driver_kick, &kick_);
  }
  ~asio_driver() override { detail::driver_kick = previous_kick_; }

  net::io_context& asio_context() noexcept { return actx_; }

  // co_await drive.until_stopped() (scheduler_driver): resumes (on the
  // loop) once the driven context has stopped: out of work, or
  // actx.stop(). Ready at once if it is stopped already.

  // io_context::run() on the shuttle loop: runs the loop (shuttle tasks and
  // Asio handlers) until the driven context stops; returns the number of
  // Asio handlers run meanwhile. Like io_context::run(), returns 0 at once
  // if the context is stopped (restart() it first). Call it where
  // actx.run() was called, outside the loop (not from one of its tasks:
  // co_await until_stopped() there).
  std::size_t run() {
    if (actx_.stopped()) return 0;
    const std::uint64_t before = handlers();
    loop().run([](asio_driver& d) -> shuttle::task<void> { co_await d.until_stopped(); }(*this));
    return static_cast<std::size_t>(handlers() - before);
  }

 private:
  net::io_context& actx_;
  bool* previous_kick_ = nullptr;
};

}  // namespace shuttle::asio
