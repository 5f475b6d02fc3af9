// poller: a completion source the event loop busy-polls (an RDMA completion
// queue, a CUDA flag in pinned memory). The interface is Seastar's:
//
//  - poll(): reap what is ready; return true if anything was done.
//  - try_enter_interrupt_mode(): the loop is about to sleep in io_uring. Arm
//    the source's notification (ibv_req_notify_cq) so that new work wakes the
//    ring through an fd the source watches itself; return false if work
//    arrived meanwhile (poll once more after arming: the re-arm race) and
//    the loop must not sleep.
//  - exit_interrupt_mode(): the loop woke up and polls again.
//
// The loop spins over its pollers while they do work, up to the context's
// spin budget after the last useful poll, then sleeps in the ring. A poller
// whose source wakes the ring by itself as cheaply as a spin would find it
// (busy_poll() false: Asio's epoll fd, watched by an io_uring poll) is
// polled on every turn but does not make the loop spin.
#pragma once

namespace shuttle {

class poller {
 public:
  virtual ~poller() = default;
  virtual bool poll() = 0;
  virtual bool try_enter_interrupt_mode() = 0;
  virtual void exit_interrupt_mode() = 0;
  // Read once, by add_poller.
  virtual bool busy_poll() const noexcept { return true; }
};

}  // namespace shuttle
