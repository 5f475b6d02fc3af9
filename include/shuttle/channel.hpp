// channel<T>: a bounded FIFO between coroutines of one loop, with
// backpressure: send() waits while the channel is full, receive() while it is
// empty. Values are handed over directly to the oldest waiter, so a waiter
// that was woken never finds its slot taken (no barging).
//
// close(): later and waiting sends fail with errc::broken_pipe (the value is
// dropped with the error); receivers first drain what is queued, then fail
// with errc::broken_pipe.
#pragma once

#include <cstddef>
#include <deque>
#include <optional>
#include <stdexcept>
#include <system_error>

#include <shuttle/detail/wait_list.hpp>
#include <shuttle/result.hpp>
#include <shuttle/sync.hpp>

namespace shuttle {

template <class T>
class channel {
  struct send_node : detail::wait_node {
    T* value = nullptr;
    bool delivered = false;
  };
  struct receive_node : detail::wait_node {
    std::optional<T> value;
  };

 public:
  explicit channel(std::size_t capacity) : capacity_(capacity) {
    if (capacity == 0) throw std::invalid_argument("shuttle::channel: capacity must be at least 1");
  }
  channel(const channel&) = delete;
  channel& operator=(const channel&) = delete;

  std::size_t size() const noexcept { return items_.size(); }
  std::size_t capacity() const noexcept { return capacity_; }
  bool closed() const noexcept { return closed_; }

  void close() noexcept {
    closed_ = true;
    senders_.wake_all();
    receivers_.wake_all();
  }

  // Non-blocking send; false if closed or full (the value is left in `v`).
  bool try_send(T& v) {
    if (closed_) return false;
    if (auto* r = static_cast<receive_node*>(receivers_.wake_one())) {
      r->value.emplace(std::move(v));
      return true;
    }
    if (items_.size() >= capacity_) return false;
    items_.push_back(std::move(v));
    return true;
  }
  std::optional<T> try_receive() {
    if (items_.empty()) return std::nullopt;
    std::optional<T> v(std::move(items_.front()));
    items_.pop_front();
    // The freed slot goes to the oldest waiting sender.
    if (auto* s = static_cast<send_node*>(senders_.wake_one())) {
      items_.push_back(std::move(*s->value));
      s->delivered = true;
    }
    return v;
  }

  class send_awaiter {
   public:
    send_awaiter(channel& c, T v) : c_(c), v_(std::move(v)) {}
    bool await_ready() {
      if (c_.closed_) return true;
      if (!c_.senders_.empty()) return false;  // FIFO: queue behind earlier senders
      done_ = c_.try_send(v_);
      return done_;
    }
    template <class P>
    bool await_suspend(std::coroutine_handle<P> h) {
      node_.value = &v_;
      return c_.senders_.park(node_, h, detail::stop_token_of(h));
    }
    result<void> await_resume() const noexcept {
      if (done_ || node_.delivered) return {};
      if (node_.cancelled) return detail::canceled();
      return std::make_error_code(std::errc::broken_pipe);
    }

   private:
    channel& c_;
    T v_;
    bool done_ = false;
    send_node node_;
  };
  // co_await ch.send(v): result<void>
  send_awaiter send(T v) { return send_awaiter{*this, std::move(v)}; }

  class receive_awaiter {
   public:
    explicit receive_awaiter(channel& c) noexcept : c_(c) {}
    bool await_ready() {
      node_.value = c_.try_receive();
      return node_.value.has_value() || c_.closed_;
    }
    template <class P>
    bool await_suspend(std::coroutine_handle<P> h) {
      return c_.receivers_.park(node_, h, detail::stop_token_of(h));
    }
    // await_suspend with the stop token given: for an awaiter that holds
    // this one (a provider's operation state, detail/connection_op.hpp).
    bool suspend_with(std::coroutine_handle<> h, std::stop_token token) {
      return c_.receivers_.park(node_, h, std::move(token));
    }
    result<T> await_resume() {
      if (node_.value) return std::move(*node_.value);
      if (node_.cancelled) return detail::canceled();
      return std::make_error_code(std::errc::broken_pipe);
    }

   private:
    channel& c_;
    receive_node node_;
  };
  // co_await ch.receive(): result<T>
  receive_awaiter receive() noexcept { return receive_awaiter{*this}; }

 private:
  std::size_t capacity_;
  bool closed_ = false;
  std::deque<T> items_;
  detail::wait_list senders_;
  detail::wait_list receivers_;
};

}  // namespace shuttle
