// async_scope: structured spawning. spawn() starts a task that runs
// concurrently with the spawner; join() completes once every spawned task has
// finished. The scope must be joined before it is destroyed (destroying it
// with children still running terminates, as std::thread does), so no child
// outlives the objects the scope's owner gave it.
//
// Children get the scope's stop token: request_stop() cancels them all. The
// first exception a child lets escape is rethrown by join().
#pragma once

#include <atomic>
#include <coroutine>
#include <cstdio>
#include <exception>
#include <mutex>
#include <stop_token>

#include <shuttle/detail/driver.hpp>
#include <shuttle/task.hpp>

namespace shuttle {

class async_scope {
 public:
  async_scope() = default;
  async_scope(const async_scope&) = delete;
  async_scope& operator=(const async_scope&) = delete;
  ~async_scope() {
    if (active_.load() != 0) {
      std::fputs("shuttle::async_scope destroyed with running tasks (join it first)\n", stderr);
      std::terminate();
    }
  }

  // Starts `t` now; it runs until its first suspension before spawn returns.
  void spawn(task<void> t) {
    {
      std::lock_guard lock(mutex_);
      active_.fetch_add(1, std::memory_order_relaxed);
    }
    detail::driver d = run_child(std::move(t), *this);
    d.set_stop_token(stop_.get_token());
    d.on_done(&on_child_done, this, true);
    d.release().resume();
  }

  void request_stop() noexcept { stop_.request_stop(); }
  std::stop_token get_stop_token() const noexcept { return stop_.get_token(); }
  std::size_t active() const noexcept { return active_.load(std::memory_order_relaxed); }

  class join_awaitable {
   public:
    explicit join_awaitable(async_scope& s) noexcept : s_(s) {}
    bool await_ready() const noexcept { return false; }
    bool await_suspend(std::coroutine_handle<> h) noexcept {
      std::lock_guard lock(s_.mutex_);
      if (s_.active_.load(std::memory_order_relaxed) == 0) return false;
      s_.joiner_ = h;
      return true;
    }
    void await_resume() const {
      std::lock_guard lock(s_.mutex_);
      if (s_.error_) std::rethrow_exception(std::exchange(s_.error_, nullptr));
    }

   private:
    async_scope& s_;
  };
  // co_await scope.join(): waits for every task spawned so far (and any they spawn).
  join_awaitable join() noexcept { return join_awaitable{*this}; }

 private:
  static detail::driver run_child(task<void> t, async_scope& s) {
    try {
      co_await std::move(t);
    } catch (...) {
      std::lock_guard lock(s.mutex_);
      if (!s.error_) s.error_ = std::current_exception();
    }
  }
  // Count and joiner change under one lock: a child may finish on another
  // thread, and the joiner must neither be missed nor resumed twice.
  static std::coroutine_handle<> on_child_done(void* arg) noexcept {
    auto* s = static_cast<async_scope*>(arg);
    std::coroutine_handle<> joiner;
    {
      std::lock_guard lock(s->mutex_);
      if (s->active_.fetch_sub(1, std::memory_order_relaxed) == 1) joiner = std::exchange(s->joiner_, {});
    }
    return joiner ? joiner : std::noop_coroutine();
  }

  std::atomic<std::size_t> active_{0};
  std::coroutine_handle<> joiner_{};
  std::stop_source stop_;
  std::mutex mutex_;
  std::exception_ptr error_;
};

}  // namespace shuttle
