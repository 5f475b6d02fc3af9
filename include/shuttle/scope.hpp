// async_scope: structured spawning. spawn() starts a task that runs
// concurrently with the spawner; join() completes once every spawned task has
// finished. The scope must be joined before it is destroyed (destroying it
// with children still running terminates, as std::thread does), so no child
// outlives the objects the scope's owner gave it.
//
// Stop, as P2300's counting_scope and libunifex's async_scope define it:
//  - Children get the scope's stop token; request_stop() stops them all.
//    Stop is sticky: a task spawned after it still starts, with a stopped
//    token, so it sees the stop at its first cancellable await, runs its own
//    clean-up, and is joined like the others (it is not silently dropped).
//  - A scope follows its owner's stop token, so with_timeout or when_any
//    around a task that owns a scope reach the scope's children:
//      async_scope s;  // follows the task that awaits s.join(): a stop
//                      // requested on it, before or during join(), stops
//                      // the children.
//      async_scope s{co_await get_stop_token()};  // also from construction:
//                      // the children stop as soon as the creating task is
//                      // stopped, before it reaches join().
//      async_scope s{async_scope::independent};  // opt out: only
//                      // request_stop() stops the children (say, to drain
//                      // connections after the owner itself was stopped).
//    A default-constructed scope cannot follow its creator from construction:
//    C++ gives a constructor no way to see the coroutine it runs in, and
//    join() is the first point where the scope meets its owner.
//  - join() is cancellable in that stopping the joiner stops the children,
//    but it never abandons them: it completes only once the last child has
//    finished, because children hold references into their owner's frame.
//    A child that ignores its token (a blocking system call, a loop that
//    never awaits) keeps join() waiting; bound such a child itself.
//  - The first exception a child lets escape is rethrown by join(); it does
//    not stop the child's siblings.
#pragma once

#include <atomic>
#include <coroutine>
#include <cstdio>
#include <exception>
#include <mutex>
#include <optional>
#include <stop_token>

#include <shuttle/detail/driver.hpp>
#include <shuttle/task.hpp>

namespace shuttle {

class async_scope {
  struct forward_stop {
    std::stop_source* target;
    void operator()() const noexcept { target->request_stop(); }
  };
  using stop_link = std::optional<std::stop_callback<forward_stop>>;

 public:
  struct independent_t {
    explicit independent_t() = default;
  };
  // Tag: a scope whose children only request_stop() stops.
  static constexpr independent_t independent{};

  async_scope() = default;
  // Follows `parent` from now on (and the joiner's token in join()).
  explicit async_scope(std::stop_token parent) { parent_link_.emplace(std::move(parent), forward_stop{&stop_}); }
  explicit async_scope(independent_t) noexcept : follows_joiner_(false) {}
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
    // Movable before it is awaited (as_task, with_timeout take it by value);
    // the stop link exists only while suspended.
    join_awaitable(join_awaitable&& o) noexcept : s_(o.s_) {}
    bool await_ready() const noexcept { return false; }
    template <class P>
    bool await_suspend(std::coroutine_handle<P> h) {
      // Linked before the count is read, and outside the lock: a stop that
      // is already requested runs the link here, and a child that finishes
      // inside it takes the lock in on_child_done.
      if (s_.follows_joiner_) link_.emplace(detail::stop_token_of(h), forward_stop{&s_.stop_});
      std::lock_guard lock(s_.mutex_);
      if (s_.active_.load(std::memory_order_relaxed) == 0) return false;
      s_.joiner_ = h;
      return true;
    }
    void await_resume() {
      link_.reset();
      std::lock_guard lock(s_.mutex_);
      if (s_.error_) std::rethrow_exception(std::exchange(s_.error_, nullptr));
    }

   private:
    async_scope& s_;
    stop_link link_;
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
  stop_link parent_link_;  // after stop_: unlinked before the source goes
  bool follows_joiner_ = true;
  std::mutex mutex_;
  std::exception_ptr error_;
};

}  // namespace shuttle
