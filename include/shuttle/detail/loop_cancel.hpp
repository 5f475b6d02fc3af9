// Cancelling on the loop. A stop request may come from any thread, but an
// operation's state belongs to the thread of its loop: the stop callback
// cancels at once when it runs there and otherwise hands the request to the
// loop, which cancels on a later turn (libunifex's io_uring_context:
// request_stop_local / request_stop_remote). The operation must stay alive
// until the hand-off has run; two ways to ensure it:
//
//  - loop_cancel<Op>, for an operation whose state lives in the awaiting
//    frame (uring_op, wait_list, the CUDA waits): the hand-off is a node in
//    the operation (no allocation) and a reference count holds the
//    operation, one reference for its own completion and one for a hand-off
//    in flight; whoever drops the last one resumes the waiter.
//  - cancel_on_loop(ctx, fn), for provider state held by shared_ptr (the tcp
//    and verbs providers): `fn` runs on the loop and owns what it needs (a
//    shared or weak pointer); a hand-off is allocated (io_context::dispatch).
#pragma once

#include <atomic>
#include <utility>

#include <shuttle/detail/io_op.hpp>

// `Loop` below is io_context, a parameter only so that this header needs no
// more than io_op.hpp (cuda.hpp uses it without the ring's headers).
namespace shuttle::detail {

// Op derives from loop_cancel<Op> (a friend where the base is not public)
// and provides, for the loop's thread:
//   void cancel_here() noexcept;  // cancels; the operation is alive
//   void release() noexcept;      // unref(), and resumes the waiter if last
template <class Op>
struct loop_cancel : remote_op {
  // Set to 1 (the completion's) before the stop callback is armed.
  std::atomic<int> refs{0};

  // Drops a reference; true when it was the last one.
  bool unref() noexcept { return refs.fetch_sub(1, std::memory_order_acq_rel) == 1; }

  // The body of the operation's stop callback, from any thread.
  template <class Loop>
  void request_cancel(Loop& ctx) noexcept {
    if (ctx.running_in_this_thread()) {
      static_cast<Op*>(this)->cancel_here();
      return;
    }
    refs.fetch_add(1, std::memory_order_relaxed);
    remote_op::run = [](remote_op* r) noexcept {
      Op* op = static_cast<Op*>(static_cast<loop_cancel*>(r));
      op->cancel_here();
      op->release();
    };
    ctx.post_remote(this);
  }
};

// Runs `fn` on `ctx`'s thread: now when called there, else on a later turn.
// Should the hand-off fail to allocate, the request is dropped (the operation
// then ends as it would have without it) rather than ending the process
// inside a stop callback.
template <class Loop, class Fn>
void cancel_on_loop(Loop& ctx, Fn&& fn) noexcept {
  if (ctx.running_in_this_thread()) {
    fn();
    return;
  }
  try {
    ctx.dispatch(std::forward<Fn>(fn));
  } catch (...) {
  }
}

}  // namespace shuttle::detail
