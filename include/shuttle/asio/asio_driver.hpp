// asio_driver: an asio::io_context driven from a shuttle loop, on the same
// thread, with one place to sleep.
//
//   shuttle::io_context loop;
//   boost::asio::io_context actx(1);
//   shuttle::asio::asio_driver drive(loop, actx);   // from here on, the loop runs actx
//   loop.run(app());                                  // asio sockets, timers and handlers run too
//
// How: the driver is one of the loop's pollers. Asio's epoll reactor keeps
// every descriptor and its timerfd in one epoll instance; the driver keeps a
// one-shot IORING_OP_POLL_ADD armed on that epoll fd, so readiness of any
// Asio socket or timer completes a CQE in shuttle's ring and the loop wakes.
// The driver then calls actx.poll() (non-blocking: handlers run on the loop
// thread, inside the shuttle loop's turn). Before the loop sleeps, the driver
// polls Asio once more (handlers posted from this thread are not visible
// through the epoll fd); while the loop is busy it polls Asio when the epoll
// fd fired, when a shuttle operation handed a handler to Asio, and every 64th
// turn otherwise (for work the application posted to Asio itself), so an idle
// Asio costs the loop one poll per 64 turns.
//
// Limits: work posted to actx from *another* thread does not wake a sleeping
// loop (Asio wakes its reactor only when a thread is blocked inside it): post
// through shuttle (io_context::dispatch) instead. Do not call actx.run() from
// another thread while a driver exists. Destroy the driver before the loop.
// Needs Asio's epoll reactor (the Linux default).
#pragma once

#include <shuttle/asio/config.hpp>
#include <shuttle/asio/executor.hpp>

#include <poll.h>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>

#if !defined(BOOST_ASIO_HAS_EPOLL) || defined(BOOST_ASIO_HAS_IO_URING_AS_DEFAULT)
#  error "shuttle::asio::asio_driver needs Asio's epoll reactor"
#endif
#include <boost/asio/detail/epoll_reactor.hpp>

#include <shuttle/detail/io_op.hpp>
#include <shuttle/io_context.hpp>
#include <shuttle/poller.hpp>

namespace shuttle::asio {

namespace detail {
namespace {
// The epoll reactor does not publish its fd; read it through the standard
// explicit-instantiation access rule (stable member name across Boost
// 1.66-1.90). Internal linkage: one copy per translation unit.
struct epoll_fd_tag {
  using type = int net::detail::epoll_reactor::*;
  friend type member_of(epoll_fd_tag);
};
template <class Tag, typename Tag::type M>
struct expose {
  friend typename Tag::type member_of(Tag) { return M; }
};
template struct expose<epoll_fd_tag, &net::detail::epoll_reactor::epoll_fd_>;
}  // namespace

inline int asio_epoll_fd(net::io_context& actx) {
  auto& reactor = net::use_service<net::detail::epoll_reactor>(actx);
  return reactor.*member_of(epoll_fd_tag{});
}
}  // namespace detail

class asio_driver final : public shuttle::poller {
 public:
  asio_driver(shuttle::io_context& loop, net::io_context& actx)
      : loop_(loop), actx_(actx), work_(actx.get_executor()), epoll_fd_(detail::asio_epoll_fd(actx)) {
    loop_.add_poller(*this);
    previous_kick_ = std::exchange(detail::driver_kick, &kick_);
  }
  ~asio_driver() override {
    detail::driver_kick = previous_kick_;
    loop_.remove_poller(*this);
    if (op_) {
      op_->owner = nullptr;  // freed at its CQE, or by the loop's end
      loop_.submit_cancel(op_);
    }
  }
  asio_driver(const asio_driver&) = delete;
  asio_driver& operator=(const asio_driver&) = delete;

  net::io_context& asio_context() noexcept { return actx_; }
  // Statistics: Asio polls and handlers run.
  std::uint64_t polls() const noexcept { return polls_; }
  std::uint64_t handlers() const noexcept { return handlers_; }

  bool poll() override {
    // Work posted to Asio from this thread outside Asio (co_spawn from the
    // loop, asio::post) is not visible through the epoll fd: a busy loop
    // also polls Asio every `busy_poll_interval` turns.
    if (!kick_ && !ready_ && ++turns_ < busy_poll_interval) return false;
    return run_asio();
  }
  bool try_enter_interrupt_mode() override {
    if (run_asio()) return false;
    arm();
    return true;
  }
  void exit_interrupt_mode() override {}

 private:
  struct poll_op final : shuttle::detail::orphan_op {
    asio_driver* owner = nullptr;
    shuttle::io_context* loop = nullptr;
  };

  static constexpr unsigned busy_poll_interval = 64;

  bool run_asio() {
    kick_ = ready_ = false;
    turns_ = 0;
    if (actx_.stopped()) return false;  // the application stopped it
    ++polls_;
    std::size_t n = actx_.poll();
    handlers_ += n;
    return n > 0;
  }

  void arm() {
    if (op_) return;
    auto* op = new poll_op;
    op->owner = this;
    op->loop = &loop_;
    op->complete = &on_ready;
    loop_.adopt_orphan(op);
    io_uring_sqe* sqe = loop_.get_sqe();
    io_uring_prep_poll_add(sqe, epoll_fd_, POLLIN);
    io_uring_sqe_set_data(sqe, static_cast<shuttle::detail::io_op*>(op));
    op_ = op;
  }

  static void on_ready(shuttle::detail::io_op* o, int, std::uint32_t) noexcept {
    auto* op = static_cast<poll_op*>(o);
    if (op->owner) {
      op->owner->op_ = nullptr;
      op->owner->ready_ = true;
    }
    op->loop->forget_orphan(op);
    delete op;
  }

  shuttle::io_context& loop_;
  net::io_context& actx_;
  net::executor_work_guard<net::io_context::executor_type> work_;
  int epoll_fd_;
  poll_op* op_ = nullptr;
  bool kick_ = false;
  bool ready_ = true;
  unsigned turns_ = 0;
  bool* previous_kick_ = nullptr;
  std::uint64_t polls_ = 0;
  std::uint64_t handlers_ = 0;
};

}  // namespace shuttle::asio
