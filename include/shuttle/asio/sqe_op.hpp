// Asio-token operations that are one io_uring submission (TCP read_some and
// write_some, timers): the initiation fills the SQE itself and the CQE
// completes straight into the handler, as Asio's own reactor operations do,
// instead of running the native awaitable inside an async_run frame (no
// coroutine frame, no factory, no stop token, no executor hop).
//
// Same contract as async_run (async_run.hpp):
//  - memory: one block per operation, from the handler's associated
//    allocator or the per-thread cache of recycled frames (recycling.hpp),
//    freed before the handler runs;
//  - the handler runs through its associated executor (directly when that
//    is this loop's shuttle executor), never inside the initiating function
//    (a CQE is reaped only by the loop; the rare completion inside the
//    initiating call, a failure to get an SQE, is posted);
//  - cancellation (Boost >= 1.77): the handler's cancellation slot asks the
//    kernel to cancel (IORING_OP_ASYNC_CANCEL) and the handler runs only
//    after the operation's own CQE, so the kernel never touches a buffer
//    after the handler ran. The slot is cleared when the operation
//    completes, on the loop's thread;
//  - errors convert as the native operation's (to_boost); an exception
//    (no SQE to be had) becomes an error code.
//
// Used only where it is equivalent to async_run: on the loop's thread, and,
// when the handler has a connected cancellation slot, only for a handler
// whose executor is this loop's (the slot is then emitted and cleared on the
// loop's thread); other cases take async_run's path.
#pragma once

#include <shuttle/asio/async_run.hpp>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <new>
#include <span>
#include <tuple>
#include <utility>

#include <sys/socket.h>

#include <liburing.h>

#include <shuttle/detail/io_op.hpp>
#include <shuttle/error.hpp>
#include <shuttle/io_context.hpp>
#include <shuttle/tcp.hpp>
#include <shuttle/timer.hpp>

namespace shuttle::asio::detail {

// ---------------------------------------------------------------- submissions
// Each mirrors the native operation's SQE and result conversion (tcp.hpp,
// timer.hpp): prep(sqe, loop) fills the submission (the object lives in the
// operation until its CQE), args(res) makes the handler's arguments.

inline std::tuple<boost::system::error_code, std::size_t> size_args(int res) {
  if (res < 0) return {to_boost(shuttle::errno_code(-res)), 0};
  return {boost::system::error_code{}, static_cast<std::size_t>(res)};
}

// tcp_socket::read_some
struct recv_sqe {
  using signature = void(boost::system::error_code, std::size_t);
  tcp_socket* s;  // read when the operation starts (a deferred token starts it later)
  std::span<std::byte> buf;
  void prep(io_uring_sqe* sqe, const shuttle::io_context& loop) noexcept {
    auto f = s->file_for(loop);  // a registered socket by its slot
    io_uring_prep_recv(sqe, f.fd, buf.data(), buf.size(), 0);
    f.mark(sqe);
  }
  static std::tuple<boost::system::error_code, std::size_t> args(int res) { return size_args(res); }
  auto native() const { return s->read_some(buf); }
};
// tcp_socket::write_some (MSG_NOSIGNAL: a dead peer is EPIPE, never SIGPIPE)
struct send_sqe {
  using signature = void(boost::system::error_code, std::size_t);
  tcp_socket* s;
  std::span<const std::byte> buf;
  void prep(io_uring_sqe* sqe, const shuttle::io_context& loop) noexcept {
    auto f = s->file_for(loop);
    io_uring_prep_send(sqe, f.fd, buf.data(), buf.size(), MSG_NOSIGNAL);
    f.mark(sqe);
  }
  static std::tuple<boost::system::error_code, std::size_t> args(int res) { return size_args(res); }
  auto native() const { return s->write_some(buf); }
};
// sleep_until
struct timeout_sqe {
  using signature = void(boost::system::error_code);
  clock::time_point deadline;
  __kernel_timespec ts;  // the kernel reads it when the SQE is submitted: it lives in the operation
  explicit timeout_sqe(clock::time_point d) noexcept : deadline(d), ts(shuttle::detail::to_timespec(d)) {}
  void prep(io_uring_sqe* sqe, const shuttle::io_context&) noexcept {
    io_uring_prep_timeout(sqe, &ts, 0, IORING_TIMEOUT_ABS);
  }
  static std::tuple<boost::system::error_code> args(int res) {
    if (res == -ETIME || res == 0) return {boost::system::error_code{}};
    return {to_boost(shuttle::errno_code(-res))};
  }
  auto native() const { return sleep_until(deadline); }
};

template <class Signature>
struct error_args;
template <class... Rest>
struct error_args<void(boost::system::error_code, Rest...)> {
  static std::tuple<boost::system::error_code, Rest...> make(boost::system::error_code ec) { return {ec, Rest{}...}; }
};

// ---------------------------------------------------------------- the operation

// What an operation with a connected cancellation slot carries besides.
struct sqe_cancel_state : shuttle::detail::remote_op {
  std::atomic<int> refs{1};  // the CQE, and a cancellation handed over from another thread
  std::atomic<bool> queued{false};
  bool done = false;  // the CQE arrived (loop thread only)
};
struct sqe_no_cancel {};

template <class Handler, class Sqe, bool Slotted>
struct sqe_op final : shuttle::detail::io_op, std::conditional_t<Slotted, sqe_cancel_state, sqe_no_cancel> {
  Handler handler;
  Sqe sqe;
  shuttle::io_context* loop;
  int res = 0;
  bool direct;  // the handler's executor is this loop's shuttle executor
  pending_work<Handler> work;

  template <class H>
  sqe_op(H&& h, const Sqe& s, shuttle::io_context* l, bool d)
      : handler(std::forward<H>(h)), sqe(s), loop(l), direct(d), work(handler, *l, d) {}

  static void on_complete(shuttle::detail::io_op* o, int res, std::uint32_t) noexcept {
    auto* self = static_cast<sqe_op*>(o);
    self->res = res;
    if constexpr (Slotted) {
      self->done = true;
      if (self->refs.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    }
    self->finish();
  }

  // IORING_OP_ASYNC_CANCEL for this operation; its CQE still completes it.
  void request_cancel() noexcept
    requires Slotted
  {
    if (loop->running_in_this_thread()) {
      if (!this->done) loop->backend().submit_cancel(this);
      return;
    }
    // Asio emits a slot on the operation's executor, i.e. this loop's thread;
    // from another thread, through the loop's remote queue (once).
    if (this->queued.exchange(true, std::memory_order_acq_rel)) return;
    this->refs.fetch_add(1, std::memory_order_relaxed);
    this->run = [](shuttle::detail::remote_op* r) noexcept {
      auto* self = static_cast<sqe_op*>(static_cast<sqe_cancel_state*>(r));
      if (!self->done) self->loop->backend().submit_cancel(self);
      if (self->refs.fetch_sub(1, std::memory_order_acq_rel) == 1) self->finish();
    };
    loop->post_remote(this);
  }

  // Loop thread: frees the operation, then calls the handler.
  void finish() noexcept { finish_with(Sqe::args(res), false); }

  template <class... Args>
  void finish_with(std::tuple<Args...>&& args, bool posted) {
    // The slot handler points here: cleared now (the handler's executor is
    // this thread's); a slot that was not connected at the start stays so.
#if SHUTTLE_ASIO_HAS_CANCELLATION_SLOTS
    if constexpr (Slotted) net::get_associated_cancellation_slot(handler).clear();
#endif
    bound_completion<Handler, Args...> call{std::move(handler), std::move(args), false};
    shuttle::io_context& l = *loop;
    const bool d = direct;
    auto w = std::move(work);  // until the handler is queued or run
    this->~sqe_op();
    free_frame(this, sizeof(sqe_op));  // Asio's rule: the operation's memory is freed before the upcall
    deliver(std::move(call), l, d, posted);
  }

  // Fills the SQE. The handler must not run inside the initiating function:
  // when no SQE is to be had, the error is posted to it.
  void submit() {
    io_uring_sqe* s;
    try {
      s = loop->backend().get_sqe();
    } catch (...) {
      auto ec = to_boost(error_of(std::current_exception()));
      finish_with(error_args<typename Sqe::signature>::make(ec), true);
      return;
    }
    this->complete = &on_complete;
    sqe.prep(s, *loop);
    io_uring_sqe_set_data(s, static_cast<shuttle::detail::io_op*>(this));
  }
};

#if SHUTTLE_ASIO_HAS_CANCELLATION_SLOTS
template <class Op>
struct sqe_cancel {
  Op* op;
  void operator()(net::cancellation_type t) {
    // Every type: an io_uring cancellation leaves the object usable.
    if (t != net::cancellation_type::none) op->request_cancel();
  }
};
#endif

template <class Sqe>
struct initiate_sqe {
  shuttle::io_context* loop;

  template <class Handler>
  void operator()(Handler&& handler, const Sqe& sqe) const {
    using H = std::decay_t<Handler>;
    const bool direct = shuttle_loop_of(net::get_associated_executor(handler, executor(*loop, nullptr))) == loop;
#if SHUTTLE_ASIO_HAS_CANCELLATION_SLOTS
    auto slot = net::get_associated_cancellation_slot(handler);
    const bool slotted = slot.is_connected();
#else
    constexpr bool slotted = false;
#endif
    // (A deferred token may start the operation on another thread.)
    const bool here = shuttle::io_context::current_or_null() == loop || loop->running_in_this_thread();
    if ((slotted && !direct) || !here) {
      // The general path: a slot emitted on another executor's thread goes
      // through a std::stop_source; from another thread, the loop's queue.
      initiate_run{loop, {}, cancel_on::all}(std::forward<Handler>(handler), [sqe] { return sqe.native(); });
      return;
    }
#if SHUTTLE_ASIO_HAS_CANCELLATION_SLOTS
    if (slotted) {
      using op = sqe_op<H, Sqe, true>;
      void* mem = allocate_frame(sizeof(op), handler);
      op* o;
      try {
        slot.template emplace<sqe_cancel<op>>(sqe_cancel<op>{static_cast<op*>(mem)});
        o = ::new (mem) op(std::forward<Handler>(handler), sqe, loop, direct);
      } catch (...) {
        slot.clear();
        free_frame(mem, sizeof(op));
        throw;  // as async_run's: nothing started
      }
      o->submit();
      return;
    }
#endif
    using op = sqe_op<H, Sqe, false>;
    void* mem = allocate_frame(sizeof(op), handler);
    op* o;
    try {
      o = ::new (mem) op(std::forward<Handler>(handler), sqe, loop, direct);
    } catch (...) {
      free_frame(mem, sizeof(op));
      throw;
    }
    o->submit();
  }
};

// Starts `sqe` with `token` on the calling thread's loop. (The general path
// runs sqe.native(), the native operation, in async_run's frame.)
template <class Sqe, class CompletionToken>
auto async_sqe(const Sqe& sqe, CompletionToken&& token) {
  return net::async_initiate<CompletionToken, typename Sqe::signature>(
      initiate_sqe<Sqe>{&shuttle::io_context::current()}, token, sqe);
}

}  // namespace shuttle::asio::detail
