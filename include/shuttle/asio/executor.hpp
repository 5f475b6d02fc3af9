// shuttle's io_context offered to Asio as an execution context.
//
//   shuttle::io_context loop;
//   shuttle::asio::context ctx(loop);              // one per shuttle loop
//   asio::co_spawn(ctx.get_executor(), session(), asio::detached);
//   ctx.run();                                      // as io_context::run()
//
// Handlers, awaitables (asio::awaitable<T> with the default any_io_executor),
// strands and callbacks bound to this executor run on the shuttle loop's
// thread, interleaved with shuttle tasks; there is no second loop. A shuttle
// operation started with an Asio token whose handler runs on this executor
// completes by a direct call from the loop (no queue, no wake-up): this is the
// cheapest way to use Asio tokens with shuttle.
//
// execute(): inline when called on the loop thread and blocking.never was not
// required (Asio's dispatch); otherwise queued on the loop (post: one small
// allocation, no syscall; from another thread: the loop's remote queue).
//
// Work, as Asio counts it: executors with outstanding_work.tracked (what
// co_spawn holds for the life of its coroutine, make_work_guard, Asio's
// handler_work) count on the context. ctx.run() runs the shuttle loop until
// that count falls to zero or ctx.stop(), like io_context::run(); a context
// that ran out of work is stopped until ctx.restart(). A shuttle operation
// pending with a plain callback is not counted (hold a work guard around
// it); one awaited in a co_spawn'd coroutine is, through co_spawn. The
// shuttle loop itself is not stopped: loop.run() still runs until
// loop.stop(), and shuttle tasks go on.
//
// Asio I/O objects (asio::ip::tcp::socket, steady_timer, resolver,
// signal_set) work on this context and run on the loop's thread: no Asio
// thread is started. The context makes Asio's scheduler service itself,
// without the private thread Asio gives a scheduler that no io_context runs,
// and drives it from the loop as asio_driver drives an io_context
// (scheduler_driver.hpp: Asio's epoll fd watched by the loop's ring). Until
// an I/O object starts its first operation that is a counter check on some
// of the loop's turns (no reactor, no epoll fd). Their
// handlers run through this executor, their pending operations count as
// work. The resolver keeps its own thread for getaddrinfo, as it does on an
// io_context; its completions come back to the loop's thread. Create I/O
// objects on the loop's thread (the driver notices the first operation
// there, at the latest before the loop sleeps). shuttle's own operations
// (ops.hpp, sqe_op.hpp, transport.hpp) remain the cheaper path: completed
// straight from the ring, no epoll.
#pragma once

#include <shuttle/asio/config.hpp>
#include <shuttle/asio/recycling.hpp>
#include <shuttle/asio/scheduler_driver.hpp>

#include <atomic>
#include <coroutine>
#include <exception>
#include <memory>
#include <optional>
#include <type_traits>

#include <boost/asio/execution.hpp>
#include <boost/asio/execution_context.hpp>

#include <shuttle/detail/io_op.hpp>
#include <shuttle/io_context.hpp>
#include <shuttle/task.hpp>

namespace shuttle::asio {

namespace detail {

// A function run on a later turn of the loop (same thread), as a detached
// coroutine whose frame is recycled (recycling.hpp): no allocation in the
// steady state.
template <class F>
op_coro run_posted(F f) {
  with_asio_thread(f);
  co_return;
}

template <class F>
void post_local(shuttle::io_context& loop, F&& f) {
  loop.post(run_posted(std::decay_t<F>(std::forward<F>(f))).release());
}

// From another thread: through the loop's remote queue (intrusive node).
template <class F>
void post_remote(shuttle::io_context& loop, F&& f) {
  struct op : shuttle::detail::remote_op {
    std::decay_t<F> fn;
    explicit op(F&& f) : fn(std::forward<F>(f)) {}
  };
  auto* o = new op(std::forward<F>(f));
  o->run = [](shuttle::detail::remote_op* r) noexcept {
    std::unique_ptr<op> self(static_cast<op*>(r));
    with_asio_thread(self->fn);
  };
  loop.post_remote(o);
}

template <class F>
void post_to(shuttle::io_context& loop, F&& f) {
  if (loop.running_in_this_thread())
    post_local(loop, std::forward<F>(f));
  else
    post_remote(loop, std::forward<F>(f));
}

}  // namespace detail

class context;

namespace detail {
// Work counting on a context (below, after its definition).
inline void context_work_started(context* c) noexcept;
inline void context_work_finished(context* c) noexcept;
}  // namespace detail

// A standard (P0443-style) executor, as Asio 1.74+ expects; also usable as
// any_io_executor. Tracked: counts as outstanding work on its context for
// as long as it (or a copy) lives.
template <bool Never, bool Tracked = false>
class basic_executor {
 public:
  basic_executor(shuttle::io_context& loop, context* ctx) noexcept : loop_(&loop), ctx_(ctx) { started(); }
  basic_executor(const basic_executor& o) noexcept : loop_(o.loop_), ctx_(o.ctx_) { started(); }
  basic_executor(basic_executor&& o) noexcept : loop_(o.loop_), ctx_(o.ctx_) {
    if constexpr (Tracked) o.ctx_ = nullptr;  // the work moves with it
  }
  basic_executor& operator=(const basic_executor& o) noexcept {
    if (this != &o) {
      basic_executor copy(o);
      swap(copy);
    }
    return *this;
  }
  basic_executor& operator=(basic_executor&& o) noexcept {
    basic_executor moved(std::move(o));
    swap(moved);
    return *this;
  }
  ~basic_executor() {
    if constexpr (Tracked) detail::context_work_finished(ctx_);
  }

  shuttle::io_context& loop() const noexcept { return *loop_; }
  bool running_in_this_thread() const noexcept { return loop_->running_in_this_thread(); }

  context& query(net::execution::context_t) const noexcept { return *ctx_; }
  static constexpr net::execution::blocking_t query(net::execution::blocking_t) noexcept {
    if constexpr (Never)
      return net::execution::blocking.never;
    else
      return net::execution::blocking.possibly;
  }
  static constexpr net::execution::relationship_t query(net::execution::relationship_t) noexcept {
    return net::execution::relationship.fork;
  }
  static constexpr net::execution::outstanding_work_t query(net::execution::outstanding_work_t) noexcept {
    if constexpr (Tracked)
      return net::execution::outstanding_work.tracked;
    else
      return net::execution::outstanding_work.untracked;
  }
  static constexpr net::execution::mapping_t query(net::execution::mapping_t) noexcept {
    return net::execution::mapping.thread;
  }
  std::allocator<void> query(net::execution::allocator_t<void>) const noexcept { return {}; }

  basic_executor<true, Tracked> require(net::execution::blocking_t::never_t) const noexcept { return {*loop_, ctx_}; }
  basic_executor<false, Tracked> require(net::execution::blocking_t::possibly_t) const noexcept {
    return {*loop_, ctx_};
  }
  basic_executor<Never, true> require(net::execution::outstanding_work_t::tracked_t) const noexcept {
    return {*loop_, ctx_};
  }
  basic_executor<Never, false> require(net::execution::outstanding_work_t::untracked_t) const noexcept {
    return {*loop_, ctx_};
  }

  template <class F>
  void execute(F&& f) const {
    if constexpr (!Never) {
      if (loop_->running_in_this_thread()) {
        std::decay_t<F> local(std::forward<F>(f));
        detail::with_asio_thread(local);  // Asio recycles its memory here
        return;
      }
    }
    detail::post_to(*loop_, std::forward<F>(f));
  }

  friend bool operator==(const basic_executor& a, const basic_executor& b) noexcept { return a.loop_ == b.loop_; }
  friend bool operator!=(const basic_executor& a, const basic_executor& b) noexcept { return a.loop_ != b.loop_; }

 private:
  template <bool, bool>
  friend class basic_executor;
  void started() noexcept {
    if constexpr (Tracked) detail::context_work_started(ctx_);
  }
  void swap(basic_executor& o) noexcept {
    std::swap(loop_, o.loop_);
    std::swap(ctx_, o.ctx_);
  }
  shuttle::io_context* loop_;
  context* ctx_;
};

using executor = basic_executor<false>;

namespace detail {
template <class Ex>
inline constexpr bool is_basic_executor_v = false;
template <bool N, bool T>
inline constexpr bool is_basic_executor_v<basic_executor<N, T>> = true;
}  // namespace detail

// The Asio execution_context of one shuttle loop (Asio services registered
// on it live as long as it). Create it on the loop's thread, destroy it
// before the loop.
class context : public net::execution_context {
 public:
  using executor_type = executor;
  explicit context(shuttle::io_context& loop)
      : loop_(loop), sched_(net::make_service<net::detail::scheduler>(*this, 0, false)) {
    // Asio's own thread for such a scheduler would hold this one unit of
    // work (it never stops by itself); this context counts Asio's work.
    sched_.work_started();
    io_driver_.emplace(loop, *this, sched_, 1);
  }
  ~context() {
    io_driver_.reset();  // off the loop before Asio's services go
    shutdown();
    destroy();
  }
  executor_type get_executor() noexcept { return executor_type(loop_, this); }
  shuttle::io_context& loop() noexcept { return loop_; }

  // io_context::run() on the shuttle loop: runs the loop (shuttle tasks and
  // Asio handlers alike) until this context has no outstanding work or
  // stop() is called. Returns at once if stopped (restart() first); a
  // context with no work at the call stops, as Asio's does. Call it outside
  // the loop; inside a shuttle task, co_await until_stopped().
  void run() {
    if (stopped()) return;
    if (work_.load(std::memory_order_acquire) == 0) {
      stop();
      return;
    }
    loop_.run([](context& c) -> shuttle::task<void> { co_await c.until_stopped(); }(*this));
  }
  // Any thread: ends run() / until_stopped() at the loop's next turn.
  void stop() noexcept {
    stopped_.store(true, std::memory_order_release);
    if (loop_.running_in_this_thread())
      wake_waiter();
    else
      detail::post_remote(loop_, [this] { wake_waiter(); });
  }
  bool stopped() const noexcept { return stopped_.load(std::memory_order_acquire); }
  void restart() noexcept { stopped_.store(false, std::memory_order_release); }
  // Outstanding work now (tracked executors, work guards, co_spawn'd coroutines).
  std::size_t outstanding_work() const noexcept { return work_.load(std::memory_order_acquire); }

  class stopped_awaitable {
   public:
    explicit stopped_awaitable(context& c) noexcept : c_(c) {}
    bool await_ready() const noexcept { return c_.stopped(); }
    void await_suspend(std::coroutine_handle<> h) noexcept { c_.waiter_ = h; }
    void await_resume() const noexcept {}

   private:
    context& c_;
  };
  // Loop thread: completes once the context stops (out of work, stop()).
  stopped_awaitable until_stopped() noexcept { return stopped_awaitable(*this); }

 private:
  friend void detail::context_work_started(context*) noexcept;
  friend void detail::context_work_finished(context*) noexcept;

  // Loop thread: resumes the run()/until_stopped() waiter, if any.
  void wake_waiter() noexcept {
    if (auto h = std::exchange(waiter_, {})) loop_.post(h);
  }

  shuttle::io_context& loop_;
  net::detail::scheduler& sched_;  // for Asio's I/O objects, driven by io_driver_
  std::optional<detail::scheduler_driver> io_driver_;
  std::atomic<std::size_t> work_{0};
  std::atomic<bool> stopped_{false};
  std::coroutine_handle<> waiter_{};
};

namespace detail {
inline void context_work_started(context* c) noexcept {
  if (c) c->work_.fetch_add(1, std::memory_order_relaxed);
}
// The last work's end stops the context, as in Asio's scheduler.
inline void context_work_finished(context* c) noexcept {
  if (c && c->work_.fetch_sub(1, std::memory_order_acq_rel) == 1) c->stop();
}
}  // namespace detail

}  // namespace shuttle::asio
