// runtime: N threads, one io_context each (shared-nothing, as Seastar). Work
// is placed on a chosen thread; a running task moves itself with
// `co_await rt.context(i).schedule()`.
#pragma once

#include <atomic>
#include <cstddef>
#include <condition_variable>
#include <mutex>
#include <optional>
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
    outcome<T> out;
    spawn(i, fulfil(std::move(t), out));
    std::unique_lock lock(out.mutex);
    out.cv.wait(lock, [&] { return out.done; });
    if (out.error) std::rethrow_exception(std::move(out.error));
    if constexpr (!std::is_void_v<T>) return std::move(*out.value);
  }

  void request_stop() noexcept;
  // Waits for every spawned task, then stops and joins the threads.
  void join();

 private:
  struct worker;
  template <class T>
  struct outcome {
    std::mutex mutex;
    std::condition_variable cv;
    bool done = false;
    std::optional<std::conditional_t<std::is_void_v<T>, bool, T>> value;
    std::exception_ptr error;
  };
  // The worker keeps no reference to the result or the exception once it
  // signals: the waiting thread owns them alone from then on.
  template <class T>
  static task<void> fulfil(task<T> t, outcome<T>& out) {
    std::optional<std::conditional_t<std::is_void_v<T>, bool, T>> value;
    std::exception_ptr error;
    try {
      if constexpr (std::is_void_v<T>) {
        co_await std::move(t);
        value.emplace(true);
      } else {
        value.emplace(co_await std::move(t));
      }
    } catch (...) {
      error = std::current_exception();
    }
    t = task<T>{};
    std::lock_guard lock(out.mutex);
    out.value = std::move(value);
    out.error = std::move(error);
    out.done = true;
    out.cv.notify_all();
  }
  std::vector<std::unique_ptr<worker>> workers_;
  std::atomic<bool> released_{false};  // join() finished signalling the contexts
  bool joined_ = false;
};

}  // namespace shuttle
