// fd_watch: a file descriptor watched by the loop (the completion channel,
// rdma_cm event channels, the listener's timerfd).
#pragma once

#include <shuttle/io_context.hpp>

#include <poll.h>

namespace shuttle::detail::verbs_impl {

// A persistent IORING_OP_POLL_ADD on an fd with a callback. Destroying it
// while armed cancels the poll and frees it when its CQE arrives, or with
// the io_context if that ends first (it is then the context's orphan).
class fd_watch : public orphan_op {
 public:
  using callback = void (*)(void* arg) noexcept;
  fd_watch(int fd, callback cb, void* arg) noexcept : fd_(fd), cb_(cb), arg_(arg) { complete = &on_complete; }
  void arm(io_context& ctx) {
    if (armed_ || orphan_) return;
    ctx_ = &ctx;
    io_uring_sqe* sqe = ctx.backend().get_sqe();
    io_uring_prep_poll_add(sqe, fd_, POLLIN);
    io_uring_sqe_set_data(sqe, static_cast<io_op*>(this));
    armed_ = true;
  }
  void destroy() noexcept {
    if (armed_) {
      orphan_ = true;
      ctx_->backend().submit_cancel(this);
      ctx_->backend().adopt_orphan(this);
    } else {
      delete this;
    }
  }

 private:
  static void on_complete(io_op* op, int, std::uint32_t) noexcept {
    auto* self = static_cast<fd_watch*>(op);
    self->armed_ = false;
    if (self->orphan_) {
      self->ctx_->backend().forget_orphan(self);
      delete self;
      return;
    }
    self->cb_(self->arg_);
  }
  int fd_;
  callback cb_;
  void* arg_;
  io_context* ctx_ = nullptr;
  bool armed_ = false;
  bool orphan_ = false;
};

}  // namespace shuttle::detail::verbs_impl
