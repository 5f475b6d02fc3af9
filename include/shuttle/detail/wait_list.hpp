// wait_list: coroutines parked on a loop-local primitive (event, semaphore,
// mutex, channel), each cancellable through its stop token.
//
// A waiter is resumed through io_context::post, never inline from notify() or
// a stop callback, so user code never runs inside request_stop() or inside a
// primitive's bookkeeping. A stop request from another thread is handed to
// the owning loop; a reference count keeps the node alive until it is handled.
#pragma once

#include <atomic>
#include <coroutine>
#include <optional>
#include <stop_token>

#include <shuttle/detail/loop_cancel.hpp>
#include <shuttle/io_context.hpp>

namespace shuttle::detail {

class wait_list;

struct wait_node : loop_cancel<wait_node> {
  struct cancel_callback {
    wait_node* self;
    void operator()() const noexcept;
  };
  wait_list* list = nullptr;  // non-null while queued
  wait_node* prev = nullptr;
  wait_node* next = nullptr;
  io_context* ctx = nullptr;
  std::coroutine_handle<> waiter{};
  std::optional<std::stop_callback<cancel_callback>> stop_cb;
  bool cancelled = false;

  wait_node() noexcept = default;
  // Awaiters are moved only before they are awaited (as_task, returning
  // them from functions): a node that is not parked carries no state.
  wait_node(wait_node&&) noexcept {}
  wait_node& operator=(wait_node&&) = delete;

  void release() noexcept {
    if (unref()) ctx->post(waiter);
  }
  // On the loop (loop_cancel): leaves the queue unless it was woken first.
  inline void cancel_here() noexcept;
};

class wait_list {
 public:
  bool empty() const noexcept { return head_ == nullptr; }

  // Queues `n` for `h`; false (do not suspend) if `token` is already stopped.
  bool park(wait_node& n, std::coroutine_handle<> h, std::stop_token token) {
    if (token.stop_requested()) {
      n.cancelled = true;
      return false;
    }
    n.ctx = &io_context::current();
    n.waiter = h;
    n.refs.store(1, std::memory_order_relaxed);
    link(n);
    if (token.stop_possible()) n.stop_cb.emplace(std::move(token), wait_node::cancel_callback{&n});
    return true;
  }

  // Wakes the oldest waiter; returns it (so the caller can hand it a value).
  wait_node* wake_one() noexcept {
    wait_node* n = head_;
    if (!n) return nullptr;
    unlink(*n);
    n->stop_cb.reset();
    // Once its stop callback is gone nothing else can take a reference: a
    // count of one is the queue's alone, so no atomic update is needed.
    if (n->refs.load(std::memory_order_acquire) == 1) {
      n->refs.store(0, std::memory_order_relaxed);
      n->ctx->post(n->waiter);
    } else {
      n->release();  // a cancellation from another thread is on its way to this loop
    }
    return n;
  }
  void wake_all() noexcept {
    while (wake_one()) {
    }
  }

  void link(wait_node& n) noexcept {
    n.list = this;
    n.next = nullptr;
    n.prev = tail_;
    if (tail_)
      tail_->next = &n;
    else
      head_ = &n;
    tail_ = &n;
  }
  void unlink(wait_node& n) noexcept {
    if (n.prev)
      n.prev->next = n.next;
    else
      head_ = n.next;
    if (n.next)
      n.next->prev = n.prev;
    else
      tail_ = n.prev;
    n.prev = n.next = nullptr;
    n.list = nullptr;
  }

 private:
  wait_node* head_ = nullptr;
  wait_node* tail_ = nullptr;
};

inline void wait_node::cancel_here() noexcept {
  if (list) {
    list->unlink(*this);
    cancelled = true;
    release();  // the queue's reference
  }
}

inline void wait_node::cancel_callback::operator()() const noexcept { self->request_cancel(*self->ctx); }

}  // namespace shuttle::detail
