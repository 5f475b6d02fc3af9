// Asio programs that run one io_context from several threads (a thread
// pool: Asio's timer5, HTTP server 3) on a shuttle::runtime:
//
//   boost::asio::io_context io;
//   ... set up Asio work ...
//   shuttle::runtime rt(4);
//   shuttle::asio::run(rt, io);     // was: N threads calling io.run()
//
// Every loop of the runtime drives the one context (an asio_driver each, on
// the loop's thread); run() returns once the context has stopped (out of
// work, or io.stop()) and every loop has let go of it. As with N threads in
// io_context::run(), handlers run on whichever loop polls the context first,
// two of them possibly at once on two loops: what must not run concurrently
// goes through a strand (asio::make_strand(io)), which keeps its handlers
// in order and one at a time. Each loop's shuttle tasks stay on that loop;
// a shuttle operation started in a handler runs on the loop of that
// handler, and its completion goes back through the handler's executor (the
// shared context: any loop), counted as the context's work while pending.
// A handler that throws ends the program (it runs inside a runtime thread).
//
// The other way, when a context's handlers should stay on one thread: one
// io_context per loop, each driven there (rt.spawn(i, ...) a task that
// makes an asio_driver for context i and co_awaits drive.until_stopped()),
// work handed between contexts with asio::post.
#pragma once

#include <shuttle/asio/config.hpp>
#include <shuttle/asio/asio_driver.hpp>

#include <atomic>
#include <cstddef>
#include <latch>

#include <boost/asio/io_context.hpp>

#include <shuttle/io_context.hpp>
#include <shuttle/runtime.hpp>
#include <shuttle/task.hpp>

namespace shuttle::asio {

// io_context::run() from every thread of `rt`; returns the number of Asio
// handlers run. Like io_context::run(), returns 0 at once if `actx` is
// stopped (restart() it first). Call it from a thread outside `rt`.
inline std::size_t run(shuttle::runtime& rt, net::io_context& actx) {
  if (actx.stopped()) return 0;
  std::atomic<std::size_t> handlers{0};
  std::latch done(static_cast<std::ptrdiff_t>(rt.size()));
  for (std::size_t i = 0; i < rt.size(); ++i) {
    rt.spawn(i, [](net::io_context& a, std::atomic<std::size_t>& n, std::latch& l) -> shuttle::task<void> {
      {
        asio_driver drive(shuttle::io_context::current(), a);
        co_await drive.until_stopped();
        n.fetch_add(drive.handlers(), std::memory_order_relaxed);
      }  // off this loop before run() returns
      l.count_down();
    }(actx, handlers, done));
  }
  done.wait();
  return handlers.load(std::memory_order_relaxed);
}

}  // namespace shuttle::asio
