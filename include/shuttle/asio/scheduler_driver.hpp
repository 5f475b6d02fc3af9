// scheduler_driver: runs an Asio scheduler (the implementation behind an
// asio::io_context, or the one shuttle::asio::context keeps for Asio's I/O
// objects) from a shuttle loop, on the loop's thread, with one place to
// sleep. asio_driver (asio_driver.hpp) and shuttle::asio::context
// (executor.hpp) are built on it; applications use those.
//
// How: the driver is one of the loop's pollers. Asio's epoll reactor keeps
// every descriptor, its timerfd and its interrupter in one epoll instance;
// while the loop sleeps, the driver keeps an IORING_OP_POLL_ADD armed on that
// epoll fd, so readiness of any Asio socket or timer completes a CQE in
// shuttle's ring and the loop wakes. The driver then polls the scheduler
// (non-blocking: handlers run on the loop thread, inside the loop's turn).
// The poll stays armed across sleeps until it fires (the loop also sleeps
// for shuttle's own reasons).
//
// Before sleeping the driver does not poll Asio again (an epoll_wait that
// the armed poll makes redundant: io_uring's poll completes at once on an
// epoll fd with events ready); it looks at the scheduler's queue, under its
// lock, and polls only when something was queued there (a post, an
// operation that completed at once).
//
// Work posted from other threads (the resolver's thread, asio::post from a
// worker, stop()): Asio wakes a thread blocked in its reactor by writing its
// interrupter, but only while its scheduler believes one is blocked there
// (its task_interrupted_ flag is false; after a poll it is true). The loop
// sleeping on the epoll fd is exactly that thread, so the driver clears the
// flag, under the scheduler's lock, when the loop goes to sleep with nothing
// queued in Asio: a post from another thread then interrupts the reactor,
// the epoll fd becomes readable and the loop wakes. While the loop is busy,
// such posts are seen by the driver's next poll or its check before
// sleeping.
//
// While the loop is busy the driver polls Asio when the epoll fd fired, when
// a shuttle operation handed a handler to Asio (driver_kick), and every 64th
// turn otherwise (work the application posted to Asio itself), so an idle
// Asio costs the loop one poll per 64 turns.
//
// Several loops may drive one scheduler (an io_context run by a pool of
// loops, runtime.hpp): Asio's scheduler is thread-safe, every sleeping
// loop's poll fires on the shared epoll fd, and the driver that first sees
// the scheduler stopped interrupts the reactor so that loops asleep wake
// and see it too.
//
// Needs Asio's epoll reactor (the Linux default); reads the reactor's fd and
// five of the scheduler's private members (Asio internals, the same in every
// Boost from 1.74 to 1.81).
#pragma once

#include <shuttle/asio/config.hpp>

#include <poll.h>

#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include <boost/asio/execution_context.hpp>
#include <boost/asio/io_context.hpp>  // before the reactor: its scheduler and hints

#if !defined(BOOST_ASIO_HAS_EPOLL) || defined(BOOST_ASIO_HAS_IO_URING_AS_DEFAULT)
#  error "shuttle's Asio interop needs Asio's epoll reactor"
#endif
#include <boost/asio/detail/epoll_reactor.hpp>
#include <boost/asio/detail/scheduler.hpp>

#include <shuttle/detail/io_op.hpp>
#include <shuttle/io_context.hpp>
#include <shuttle/poller.hpp>

namespace shuttle::asio::detail {

// Set by asio_driver on its loop's thread: operations that hand a handler to
// some other executor raise it so the driver polls Asio.
inline thread_local bool* driver_kick = nullptr;

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
struct sched_work_tag {
  using type = net::detail::atomic_count net::detail::scheduler::*;
  friend type member_of(sched_work_tag);
};
template struct expose<sched_work_tag, &net::detail::scheduler::outstanding_work_>;
}  // namespace

// The scheduler, seen as a thread blocked in its reactor.
class asio_scheduler_view {
 public:
  explicit asio_scheduler_view(net::detail::scheduler& s) noexcept : s_(s) {}

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
  // The loop woke up for another reason than Asio: posts from its own thread
  // need not interrupt the reactor (the driver looks before sleeping again).
  void leave_sleep() {
    net::detail::conditionally_enabled_mutex::scoped_lock lock(s_.*member_of(sched_mutex_tag{}));
    s_.*member_of(sched_interrupted_tag{}) = true;
  }
  // Work counted on the scheduler (pending operations, queued handlers,
  // work guards). A read only: any thread.
  long outstanding_work() const noexcept { return static_cast<long>(s_.*member_of(sched_work_tag{})); }

 private:
  net::detail::scheduler& s_;
};

class scheduler_driver : public shuttle::poller {
 public:
  // idle_work < 0: start Asio's reactor and drive the scheduler at once (an
  // io_context, which may have work already). Otherwise the driver costs
  // nothing until the scheduler counts more than `idle_work` (its owner's
  // own guard): I/O objects started an operation.
  scheduler_driver(shuttle::io_context& loop, net::execution_context& ctx, net::detail::scheduler& s,
                   long idle_work)
      : loop_(loop), ctx_(ctx), s_(s), view_(s), idle_work_(idle_work) {
    if (idle_work < 0) activate();
    loop_.backend().add_poller(*this);
  }
  ~scheduler_driver() override {
    if (sleeping_ && active_) view_.leave_sleep();
    loop_.backend().remove_poller(*this);
    if (op_) {
      op_->owner = nullptr;  // freed at its CQE, or by the loop's end
      loop_.backend().submit_cancel(op_);
    }
    // Waiters never resumed: their tasks are owned by whoever awaits them.
  }
  scheduler_driver(const scheduler_driver&) = delete;
  scheduler_driver& operator=(const scheduler_driver&) = delete;

  shuttle::io_context& loop() noexcept { return loop_; }
  bool stopped() const noexcept { return s_.stopped(); }

  // Resumes (on the loop) once the scheduler has stopped: out of work, or
  // stop(). Ready at once if it is stopped already.
  class stopped_awaitable {
   public:
    explicit stopped_awaitable(scheduler_driver& d) noexcept : d_(d) {}
    bool await_ready() const { return d_.stopped(); }
    void await_suspend(std::coroutine_handle<> h) {
      d_.waiters_.push_back(h);
      d_.ready_ = true;  // poll on the next turn: an idle scheduler stops there
    }
    void await_resume() const noexcept {}

   private:
    scheduler_driver& d_;
  };
  stopped_awaitable until_stopped() noexcept { return stopped_awaitable(*this); }

  // Statistics: Asio polls and handlers run.
  std::uint64_t polls() const noexcept { return polls_; }
  std::uint64_t handlers() const noexcept { return handlers_; }

  // Asio's readiness wakes the ring through the armed poll: no spinning for
  // it (a plain io_context blocks in epoll_wait at once, too).
  bool busy_poll() const noexcept override { return false; }

  bool poll() override {
    if (!kick_ && !ready_ && ++turns_ < busy_poll_interval) return false;
    return pump();
  }
  bool try_enter_interrupt_mode() override {
    if (!active_ && !try_activate()) return true;
    if ((kick_ || ready_) && pump()) return false;
    switch (view_.enter_sleep()) {
      case asio_scheduler_view::sleep_check::queued:  // posted since the last poll
        pump();
        return false;
      case asio_scheduler_view::sleep_check::stopped:  // nothing to watch until restart()
        return !note_stopped();
      case asio_scheduler_view::sleep_check::idle:
        sleeping_ = true;
        arm();
        return true;
    }
    return true;
  }
  void exit_interrupt_mode() override {
    if (!sleeping_) return;
    sleeping_ = false;
    // Woken by Asio: the poll this turn marks the reactor interrupted.
    if (!ready_) view_.leave_sleep();
  }

 private:
  struct poll_op final : shuttle::detail::orphan_op {
    scheduler_driver* owner = nullptr;
    shuttle::io_context* loop = nullptr;
  };

  static constexpr unsigned busy_poll_interval = 64;

  // The reactor's epoll fd, once the reactor is the scheduler's task: Asio
  // makes it so only when the first socket or timer service starts; until
  // then poll() never runs epoll_wait, and the interrupter's readiness (set
  // at the reactor's start) would keep the epoll fd readable for ever.
  void activate() {
    reactor_ = &net::use_service<net::detail::epoll_reactor>(ctx_);
    reactor_->init_task();
    epoll_fd_ = reactor_->*member_of(epoll_fd_tag{});
    active_ = true;
    ready_ = true;
  }
  bool try_activate() {
    if (view_.outstanding_work() <= idle_work_) return false;
    activate();
    return true;
  }

  bool pump() {
    turns_ = 0;
    if (!active_ && !try_activate()) return false;
    kick_ = ready_ = false;
    std::size_t n = 0;
    if (!s_.stopped()) {  // stopped: out of work, or by the application
      seen_stopped_ = false;
      ++polls_;
      boost::system::error_code ec;
      n = s_.poll(ec);
      handlers_ += n;
    }
    if (s_.stopped() && note_stopped()) return true;
    return n > 0;
  }

  // The scheduler is stopped: tells the other loops driving it, once, and
  // resumes this driver's waiters. True if any was resumed.
  bool note_stopped() {
    if (!seen_stopped_) {
      seen_stopped_ = true;
      // A loop asleep on the epoll fd while the scheduler believed it was
      // interrupted (another loop awake) would not learn of the stop.
      reactor_->interrupt();
    }
    if (waiters_.empty()) return false;
    for (auto h : waiters_) loop_.post(h);
    waiters_.clear();
    return true;
  }

  void arm() {
    if (op_) return;  // still armed from an earlier sleep
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

 protected:
  bool kick_ = false;

 private:
  shuttle::io_context& loop_;
  net::execution_context& ctx_;
  net::detail::scheduler& s_;
  asio_scheduler_view view_;
  long idle_work_;
  net::detail::epoll_reactor* reactor_ = nullptr;
  int epoll_fd_ = -1;
  poll_op* op_ = nullptr;
  bool active_ = false;
  bool ready_ = false;
  bool sleeping_ = false;
  bool seen_stopped_ = false;
  unsigned turns_ = 0;
  std::vector<std::coroutine_handle<>> waiters_;
  std::uint64_t polls_ = 0;
  std::uint64_t handlers_ = 0;
};

}  // namespace shuttle::asio::detail
