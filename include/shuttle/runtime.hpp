// runtime: N threads, one io_context each (shared-nothing, as Seastar). Work
// is placed on a chosen thread; a running task moves itself with
// `co_await rt.context(i).schedule()`.
#pragma once

#include <atomic>
#include <cstddef>
#include <future>
#include <memory>
#include <thread>
#include <vector>

#include <shuttle/io_context.hpp>
#include <shuttle/scope.hpp>

namespace shuttle {

class runtime {
 public:
  // Starts `threads` threads and their contexts. SIGINT, SIGTERM and SIGPIPE
  // are blocked in them, so a signal_set on any thread receives those.
  explicit runtime(std::size_t threads, io_context::options opts = {});
  ~runtime();  // request_stop(), then join()
  runtime(const runtime&) = delete;
  runtime& operator=(const runtime&) = delete;

  std::size_t size() const noexcept { return workers_.size(); }
  io_context& context(std::size_t i);

  // Starts `t` on thread i, detached from the caller but owned by the
  // runtime: join() waits for it, request_stop() cancels it.
  void spawn(std::size_t i, task<void> t);

  // Runs `t` on thread i and blocks the calling (non-runtime) thread for its result.
  template <class T>
  T block_on(std::size_t i, task<T> t) {
    std::promise<T> p;
    auto f = p.get_future();
    spawn(i, fulfil(std::move(t), std::move(p)));
    return f.get();
  }

  void request_stop() noexcept;
  // Waits for every spawned task, then stops and joins the threads.
  void join();

 private:
  struct worker;
  template <class T>
  static task<void> fulfil(task<T> t, std::promise<T> p) {
    std::exception_ptr error;
    try {
      if constexpr (std::is_void_v<T>) {
        co_await std::move(t);
        p.set_value();
      } else {
        p.set_value(co_await std::move(t));
      }
    } catch (...) {
      error = std::current_exception();
    }
    if (error) {
      // Drop this thread's references first: the waiting thread then owns
      // the exception alone.
      t = task<T>{};
      p.set_exception(std::move(error));
    }
  }
  std::vector<std::unique_ptr<worker>> workers_;
  std::atomic<bool> released_{false};  // join() finished signalling the contexts
  bool joined_ = false;
};

}  // namespace shuttle
