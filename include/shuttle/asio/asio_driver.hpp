// asio_driver: an asio::io_context driven from a shuttle loop, on the same
// thread, with one place to sleep.
//
//   shuttle::io_context loop;
//   boost::asio::io_context actx(1);
//   ... set up Asio work as usual (co_spawn, timers, acceptors) ...
//   shuttle::asio::asio_driver drive(loop, actx);   // from here on, the loop runs actx
//   drive.run();            // instead of actx.run(): returns when actx stops
//
// Asio's rules hold: the driven context is run by the loop, so it stops as
// io_context::run() would, when it runs out of work (stopped() becomes
// true) or on actx.stop() (from any thread); drive.run() returns then, as
// does `co_await drive.until_stopped()` in a shuttle task. A stopped context
// stays stopped (the driver no longer polls it) until actx.restart() on the
// loop's thread. The driver holds no work of its own: a program that uses
// Asio objects from shuttle tasks between Asio operations (nothing pending
// in Asio for a while) holds `net::make_work_guard(actx)` for as long, as a
// thread calling io_context::run() would need to.
//
// How: the driver is one of the loop's pollers. Asio's epoll reactor keeps
// every descriptor, its timerfd and its interrupter in one epoll instance;
// while the loop sleeps, the driver keeps a one-shot IORING_OP_POLL_ADD
// armed on that epoll fd, so readiness of any Asio socket or timer completes
// a CQE in shuttle's ring and the loop wakes. The driver then calls
// actx.poll() (non-blocking: handlers run on the loop thread, inside the
// shuttle loop's turn).
//
// Work posted from other threads (the resolver's thread, asio::post from a
// worker, actx.stop()): Asio wakes a thread blocked in its reactor by
// writing its interrupter, but only while its scheduler believes one is
// blocked there (its task_interrupted_ flag is false; after poll() it is
// true). The loop sleeping on the epoll fd is exactly that thread, so the
// driver clears the flag, under the scheduler's lock, when the loop goes to
// sleep with nothing queued in Asio, and sets it again when the loop wakes:
// a post from another thread then interrupts the reactor, the epoll fd
// becomes readable and the loop wakes. While the loop is busy, such posts
// are seen by the driver's next poll (below) or its check before sleeping.
//
// While the loop is busy the driver polls Asio when the epoll fd fired, when
// a shuttle operation handed a handler to Asio, and every 64th turn
// otherwise (for work the application posted to Asio itself), so an idle
// Asio costs the loop one poll per 64 turns.
//
// Limits: do not call actx.run() from another thread while a driver exists
// (a pool of threads: one loop and one driven context per thread).
// Destroy the driver before the loop. Needs Asio's epoll reactor (the Linux
// default); reads the reactor's fd and four of the scheduler's private
// members (Asio internals, the same in every Boost from 1.74 to 1.81).
#pragma once

#include <shuttle/asio/config.hpp>
#include <shuttle/asio/executor.hpp>

#include <poll.h>

#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include <boost/asio/io_context.hpp>

#if !defined(BOOST_ASIO_HAS_EPOLL) || defined(BOOST_ASIO_HAS_IO_URING_AS_DEFAULT)
#  error "shuttle::asio::asio_driver needs Asio's epoll reactor"
#endif
#include <boost/asio/detail/epoll_reactor.hpp>
#include <boost/asio/detail/scheduler.hpp>

#include <shuttle/detail/io_op.hpp>
#include <shuttle/io_context.hpp>
#include <shuttle/poller.hpp>
#include <shuttle/task.hpp>

namespace shuttle::asio {

namespace detail {
namespace {
// Asio does not publish these members; read them through the standard
// explicit-instantiation access rule. Internal linkage: one copy per
// translation unit.
template <class Tag, typename Tag::type M>
struct expose {
  friend typename Tag::type member_of(Tag) { return M; }
};
struct epoll_fd_tag {
  using type = int net::detail::epoll_reactor::*;
  friend type member_of(epoll_fd_tag);
};
template struct expose<epoll_fd_tag, &net::detail::epoll_reactor::epoll_fd_>;
struct sched_mutex_tag {
  using type = net::detail::conditionally_enabled_mutex net::detail::scheduler::*;
  friend type member_of(sched_mutex_tag);
};
template struct expose<sched_mutex_tag, &net::detail::scheduler::mutex_>;
struct sched_interrupted_tag {
  using type = bool net::detail::scheduler::*;
  friend type member_of(sched_interrupted_tag);
};
template struct expose<sched_interrupted_tag, &net::detail::scheduler::task_interrupted_>;
struct sched_stopped_tag {
  using type = bool net::detail::scheduler::*;
  friend type member_of(sched_stopped_tag);
};
template struct expose<sched_stopped_tag, &net::detail::scheduler::stopped_>;
struct sched_queue_tag {
  using type = net::detail::op_queue<net::detail::scheduler_operation> net::detail::scheduler::*;
  friend type member_of(sched_queue_tag);
};
template struct expose<sched_queue_tag, &net::detail::scheduler::op_queue_>;
}  // namespace

// The reactor's epoll fd, once the reactor is the scheduler's task: Asio
// makes it so only when the first socket or timer service starts; until
// then poll() never runs epoll_wait, and the interrupter's readiness (set
// at the reactor's start) would keep the epoll fd readable for ever.
inline int asio_epoll_fd(net::io_context& actx) {
  auto& reactor = net::use_service<net::detail::epoll_reactor>(actx);
  reactor.init_task();
  return reactor.*member_of(epoll_fd_tag{});
}

// The driven context's scheduler, seen as a thread blocked in its reactor.
class asio_scheduler_view {
 public:
  // After epoll_reactor's construction (it installs itself as the task).
  explicit asio_scheduler_view(net::io_context& actx) : s_(net::use_service<net::detail::scheduler>(actx)) {}

  enum class sleep_check { idle, stopped, queued };
  // The loop is about to sleep on the epoll fd. Idle (nothing queued but
  // the reactor task, not stopped): the scheduler is told a thread blocks in
  // its reactor, so that a post or stop() from another thread interrupts it.
  sleep_check enter_sleep() {
    net::detail::conditionally_enabled_mutex::scoped_lock lock(s_.*member_of(sched_mutex_tag{}));
    if (s_.*member_of(sched_stopped_tag{})) return sleep_check::stopped;
    auto& q = s_.*member_of(sched_queue_tag{});
    // Outside poll() the queue holds the reactor task (always), then what
    // was posted since.
    net::detail::scheduler_operation* front = q.front();
    if (front && net::detail::op_queue_access::next(front)) return sleep_check::queued;
    s_.*member_of(sched_interrupted_tag{}) = false;
    return sleep_check::idle;
  }
  // The loop woke up: posts from its own thread need not interrupt the
  // reactor (the driver polls before sleeping again).
  void leave_sleep() {
    net::detail::conditionally_enabled_mutex::scoped_lock lock(s_.*member_of(sched_mutex_tag{}));
    s_.*member_of(sched_interrupted_tag{}) = true;
  }

 private:
  net::detail::scheduler& s_;
};
}  // namespace detail

class asio_driver final : public shuttle::poller {
 public:
  asio_driver(shuttle::io_context& loop, net::io_context& actx)
      : loop_(loop), actx_(actx), epoll_fd_(detail::asio_epoll_fd(actx)), sched_(actx) {
    loop_.backend().add_poller(*this);
    previous_kick_ = std::exchange(detail::driver_kick, &kick_);
  }
  ~asio_driver() override {
    if (sleeping_) sched_.leave_sleep();
    detail::driver_kick = previous_kick_;
    loop_.backend().remove_poller(*this);
    if (op_) {
      op_->owner = nullptr;  // freed at its CQE, or by the loop's end
      loop_.backend().submit_cancel(op_);
    }
    // Waiters never resumed: their tasks are owned by whoever awaits them.
  }
  asio_driver(const asio_driver&) = delete;
  asio_driver& operator=(const asio_driver&) = delete;

  net::io_context& asio_context() noexcept { return actx_; }

  // co_await drive.until_stopped(): resumes (on the loop) once the driven
  // context has stopped: out of work, or actx.stop(). Ready at once if it
  // is stopped already.
  class stopped_awaitable {
   public:
    explicit stopped_awaitable(asio_driver& d) noexcept : d_(d) {}
    bool await_ready() const { return d_.actx_.stopped(); }
    void await_suspend(std::coroutine_handle<> h) {
      d_.waiters_.push_back(h);
      d_.ready_ = true;  // poll on the next turn: an idle context stops there
    }
    void await_resume() const noexcept {}

   private:
    asio_driver& d_;
  };
  stopped_awaitable until_stopped() noexcept { return stopped_awaitable(*this); }

  // io_context::run() on the shuttle loop: runs the loop (shuttle tasks and
  // Asio handlers) until the driven context stops; returns the number of
  // Asio handlers run meanwhile. Like io_context::run(), returns 0 at once
  // if the context is stopped (restart() it first). Call it where
  // actx.run() was called, outside the loop (not from one of its tasks:
  // co_await until_stopped() there).
  std::size_t run() {
    if (actx_.stopped()) return 0;
    const std::uint64_t before = handlers_;
    loop_.run([](asio_driver& d) -> shuttle::task<void> { co_await d.until_stopped(); }(*this));
    return static_cast<std::size_t>(handlers_ - before);
  }

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
    switch (sched_.enter_sleep()) {
      case detail::asio_scheduler_view::sleep_check::queued:
        ready_ = true;  // posted from another thread since the poll
        return false;
      case detail::asio_scheduler_view::sleep_check::stopped:
        return true;  // nothing to watch until restart()
      case detail::asio_scheduler_view::sleep_check::idle:
        sleeping_ = true;
        arm();
        return true;
    }
    return true;
  }
  void exit_interrupt_mode() override {
    if (!sleeping_) return;
    sleeping_ = false;
    sched_.leave_sleep();
  }

 private:
  struct poll_op final : shuttle::detail::orphan_op {
    asio_driver* owner = nullptr;
    shuttle::io_context* loop = nullptr;
  };

  static constexpr unsigned busy_poll_interval = 64;

  bool run_asio() {
    kick_ = ready_ = false;
    turns_ = 0;
    std::size_t n = 0;
    if (!actx_.stopped()) {  // stopped: out of work, or by the application
      ++polls_;
      n = actx_.poll();
      handlers_ += n;
    }
    if (!waiters_.empty() && actx_.stopped()) {
      for (auto h : waiters_) loop_.post(h);
      waiters_.clear();
      return true;
    }
    return n > 0;
  }

  void arm() {
    if (op_) return;
    auto* op = new poll_op;
    op->owner = this;
    op->loop = &loop_;
    op->complete = &on_ready;
    loop_.backend().adopt_orphan(op);
    io_uring_sqe* sqe = loop_.backend().get_sqe();
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
    op->loop->backend().forget_orphan(op);
    delete op;
  }

  shuttle::io_context& loop_;
  net::io_context& actx_;
  int epoll_fd_;
  detail::asio_scheduler_view sched_;
  poll_op* op_ = nullptr;
  bool kick_ = false;
  bool ready_ = true;
  bool sleeping_ = false;
  unsigned turns_ = 0;
  bool* previous_kick_ = nullptr;
  std::vector<std::coroutine_handle<>> waiters_;
  std::uint64_t polls_ = 0;
  std::uint64_t handlers_ = 0;
};

}  // namespace shuttle::asio
