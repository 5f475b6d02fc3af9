// uring_op: an awaitable io_uring submission with per-operation cancellation.
//
// Cancellation follows libunifex's io_uring_context: a stop callback asks the
// kernel to cancel (IORING_OP_ASYNC_CANCEL) and the coroutine resumes only
// after the operation's own CQE arrived, so the kernel never writes a buffer
// after its owner resumed. A stop request from another thread is handed to the
// loop (loop_cancel.hpp); the operation resumes once both that hand-off and
// the CQE are done.
#pragma once

#include <atomic>
#include <cerrno>
#include <coroutine>
#include <optional>
#include <stop_token>

#include <shuttle/detail/loop_cancel.hpp>
#include <shuttle/io_context.hpp>

namespace shuttle::detail {

class uring_op_base : protected io_op, protected loop_cancel<uring_op_base> {
  friend loop_cancel<uring_op_base>;

 protected:
  explicit uring_op_base(io_context& ctx) noexcept : ctx_(&ctx) {}

  // Returns false when the operation finished (cancelled) without suspending.
  template <class P, class Prep>
  bool start(std::coroutine_handle<P> h, Prep&& prep) {
    std::stop_token token = stop_token_of(h);
    if (token.stop_requested()) {
      res_ = -ECANCELED;
      return false;
    }
    io_uring_sqe* sqe = ctx_->backend().get_sqe();
    prep(sqe);
    io_uring_sqe_set_data(sqe, static_cast<io_op*>(this));
    io_op::complete = &on_complete;
    waiter_ = h;
    refs.store(1, std::memory_order_relaxed);
    if (token.stop_possible()) stop_cb_.emplace(std::move(token), cancel_callback{this});
    return true;
  }

  io_context* ctx_;
  int res_ = 0;
  std::uint32_t cqe_flags_ = 0;

 private:
  struct cancel_callback {
    uring_op_base* self;
    void operator()() const noexcept { self->request_cancel(*self->ctx_); }
  };

  // On the loop (loop_cancel): the kernel may still hold the operation.
  void cancel_here() noexcept {
    if (!done_) ctx_->backend().submit_cancel(this);
  }

  static void on_complete(io_op* op, int res, std::uint32_t flags) noexcept {
    auto* self = static_cast<uring_op_base*>(op);
    self->res_ = res;
    self->cqe_flags_ = flags;
    self->done_ = true;
    if (!self->stop_cb_) {
      self->waiter_.resume();  // nobody else can hold a reference
      return;
    }
    // Blocks while a callback runs on another thread; none runs after it.
    self->stop_cb_.reset();
    self->release();
  }

  void release() noexcept {
    if (unref()) waiter_.resume();
  }

  std::coroutine_handle<> waiter_{};
  std::optional<std::stop_callback<cancel_callback>> stop_cb_;
  bool done_ = false;
};

// The common shape: prep(sqe) fills the submission; await_resume converts the
// kernel's result.
template <class Prep, class Convert>
class uring_awaitable : private uring_op_base {
 public:
  uring_awaitable(io_context& ctx, Prep prep, Convert convert) noexcept
      : uring_op_base(ctx), prep_(std::move(prep)), convert_(std::move(convert)) {}
  uring_awaitable(const uring_awaitable&) = delete;
  uring_awaitable& operator=(const uring_awaitable&) = delete;
  // Movable only before it is awaited (returned from functions).
  uring_awaitable(uring_awaitable&& o) noexcept
      : uring_op_base(*o.ctx_), prep_(std::move(o.prep_)), convert_(std::move(o.convert_)) {}

  bool await_ready() const noexcept { return false; }
  template <class P>
  bool await_suspend(std::coroutine_handle<P> h) {
    return start(h, prep_);
  }
  decltype(auto) await_resume() { return convert_(res_, cqe_flags_); }

 private:
  Prep prep_;
  Convert convert_;
};

template <class Prep, class Convert>
auto make_uring_awaitable(io_context& ctx, Prep prep, Convert convert) {
  return uring_awaitable<Prep, Convert>(ctx, std::move(prep), std::move(convert));
}

}  // namespace shuttle::detail
