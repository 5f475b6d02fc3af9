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

#include <shuttle/io_context.hpp>

namespace shuttle::detail {

class wait_list;

struct wait_node : remote_op {
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
  std::atomic<int> refs{0};
  bool cancelled = false;

  wait_node() noexcept = default;
  // Awaiters are moved only before they are awaited (as_task, returning
  // them from functions): a node that is not parked carries no state.
  wait_node(wait_node&&) noexcept {}
  wait_node& operator=(wait_node&&) = delete;

  void release() noexcept {
    if (refs.fetch_sub(1, std::memory_order_acq_rel) == 1) ctx->post(waiter);
  }
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

inline void wait_node::cancel_callback::operator()() const noexcept {
  wait_node* n = self;
  auto cancel_on_loop = [](wait_node* n) noexcept {
    if (n->list) {
      n->list->unlink(*n);
      n->cancelled = true;
      n->release();  // the queue's reference
    }
  };
  if (n->ctx->running_in_this_thread()) {
    cancel_on_loop(n);
    return;
  }
  n->refs.fetch_add(1, std::memory_order_relaxed);
  n->run = [](remote_op* r) noexcept {
    auto* n = static_cast<wait_node*>(r);
    if (n->list) {
      n->list->unlink(*n);
      n->cancelled = true;
      n->refs.fetch_sub(1, std::memory_order_relaxed);  // the queue's reference
    }
    n->release();
  };
  n->ctx->post_remote(n);
}

}  // namespace shuttle::detail
