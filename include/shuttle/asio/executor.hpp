// shuttle's io_context offered to Asio as an execution context.
//
//   shuttle::io_context loop;
//   shuttle::asio::context actx(loop);             // one per shuttle loop
//   asio::co_spawn(actx.get_executor(), session(), asio::detached);
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
// Asio I/O objects (asio::ip::tcp::socket, steady_timer) need Asio's reactor,
// i.e. an asio::io_context: drive one from the shuttle loop with
// shuttle::asio::asio_driver (asio_driver.hpp).
#pragma once

#include <shuttle/asio/config.hpp>
#include <shuttle/asio/recycling.hpp>

#include <exception>
#include <memory>
#include <type_traits>

#include <boost/asio/execution.hpp>
#include <boost/asio/execution_context.hpp>

#include <shuttle/detail/io_op.hpp>
#include <shuttle/io_context.hpp>

namespace shuttle::asio {

namespace detail {

// Set by asio_driver (asio_driver.hpp) on its loop's thread: operations that
// hand a handler to some other executor raise it so the driver polls Asio.
inline thread_local bool* driver_kick = nullptr;

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

// A standard (P0443-style) executor, as Asio 1.74+ expects; also usable as
// any_io_executor.
template <bool Never>
class basic_executor {
 public:
  basic_executor(shuttle::io_context& loop, context* ctx) noexcept : loop_(&loop), ctx_(ctx) {}

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
    return net::execution::outstanding_work.untracked;
  }
  static constexpr net::execution::mapping_t query(net::execution::mapping_t) noexcept {
    return net::execution::mapping.thread;
  }
  std::allocator<void> query(net::execution::allocator_t<void>) const noexcept { return {}; }

  basic_executor<true> require(net::execution::blocking_t::never_t) const noexcept { return {*loop_, ctx_}; }
  basic_executor<false> require(net::execution::blocking_t::possibly_t) const noexcept { return {*loop_, ctx_}; }

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
  template <bool>
  friend class basic_executor;
  shuttle::io_context* loop_;
  context* ctx_;
};

using executor = basic_executor<false>;

// The Asio execution_context of one shuttle loop (Asio services registered
// on it live as long as it). Create it on the loop's thread, destroy it
// before the loop.
class context : public net::execution_context {
 public:
  using executor_type = executor;
  explicit context(shuttle::io_context& loop) noexcept : loop_(loop) {}
  ~context() {
    shutdown();
    destroy();
  }
  executor_type get_executor() noexcept { return executor_type(loop_, this); }
  shuttle::io_context& loop() noexcept { return loop_; }

 private:
  shuttle::io_context& loop_;
};

}  // namespace shuttle::asio
