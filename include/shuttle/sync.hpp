// Loop-local synchronisation for pipelines: event, semaphore, mutex. They
// belong to one io_context's thread (no atomics on the fast path); cross
// threads with io_context::schedule() or a channel per thread. Every wait is
// cancellable through the waiting task's stop token and then yields
// std::errc::operation_canceled.
#pragma once

#include <cstddef>
#include <system_error>

#include <shuttle/detail/wait_list.hpp>
#include <shuttle/result.hpp>

namespace shuttle {

namespace detail {
inline std::error_code canceled() noexcept { return std::make_error_code(std::errc::operation_canceled); }
}  // namespace detail

// A manual-reset event.
class event {
 public:
  explicit event(bool set = false) noexcept : set_(set) {}
  bool is_set() const noexcept { return set_; }
  void set() noexcept {
    set_ = true;
    waiters_.wake_all();
  }
  void reset() noexcept { set_ = false; }

  class awaiter {
   public:
    explicit awaiter(event& e) noexcept : e_(e) {}
    bool await_ready() const noexcept { return e_.set_; }
    template <class P>
    bool await_suspend(std::coroutine_handle<P> h) {
      return e_.waiters_.park(node_, h, detail::stop_token_of(h));
    }
    result<void> await_resume() const noexcept {
      if (node_.cancelled) return detail::canceled();
      return {};
    }

   private:
    event& e_;
    detail::wait_node node_;
  };
  // co_await ev.wait(): result<void>
  awaiter wait() noexcept { return awaiter{*this}; }

 private:
  bool set_;
  detail::wait_list waiters_;
};

// A counting semaphore; release() hands a unit straight to the oldest waiter
// (FIFO, no barging). close(ec) ends it for good: every waiter resumes with
// `ec`, later acquires fail with it at once, and release() does nothing (a
// connection that failed closes its credits so that everything waiting for
// one fails).
class semaphore {
 public:
  explicit semaphore(std::size_t initial) noexcept : count_(initial) {}
  std::size_t available() const noexcept { return count_; }
  // Whether try_acquire() would succeed now (never once closed).
  bool can_acquire() const noexcept { return count_ > 0 && waiters_.empty(); }
  bool try_acquire() noexcept {
    if (!can_acquire()) return false;
    --count_;
    return true;
  }
  // As many units as are free now, up to `n` (none while others wait):
  // how many the caller now owns.
  std::size_t try_acquire_up_to(std::size_t n) noexcept {
    if (!waiters_.empty()) return 0;
    const std::size_t k = n < count_ ? n : count_;
    count_ -= k;
    return k;
  }
  void release(std::size_t n = 1) noexcept {
    if (waiters_.empty()) {  // the common case: no call into the wait list
      if (!closed_) count_ += n;
      return;
    }
    while (n > 0 && waiters_.wake_one()) --n;
    count_ += n;
  }
  void close(std::error_code ec) noexcept {
    if (closed_) return;
    closed_ = ec ? ec : std::make_error_code(std::errc::operation_canceled);
    count_ = 0;
    waiters_.wake_all();
  }
  // The error it was closed with; empty while open.
  std::error_code closed() const noexcept { return closed_; }

  class awaiter {
   public:
    explicit awaiter(semaphore& s) noexcept : s_(s) {}
    bool await_ready() noexcept { return s_.try_acquire() || s_.closed_; }
    template <class P>
    bool await_suspend(std::coroutine_handle<P> h) {
      return s_.waiters_.park(node_, h, detail::stop_token_of(h));
    }
    // A unit handed over just before close() is dropped with the rest.
    result<void> await_resume() const noexcept {
      if (node_.cancelled) return detail::canceled();
      if (s_.closed_) return s_.closed_;
      return {};
    }

   private:
    semaphore& s_;
    detail::wait_node node_;
  };
  // co_await sem.acquire(): result<void>; on success the caller owns one unit.
  awaiter acquire() noexcept { return awaiter{*this}; }

 private:
  std::size_t count_;
  std::error_code closed_{};
  detail::wait_list waiters_;
};

// An async mutex: co_await m.lock() yields a result holding a guard.
class mutex {
 public:
  class guard {
   public:
    guard() noexcept = default;
    explicit guard(mutex* m) noexcept : m_(m) {}
    guard(guard&& o) noexcept : m_(std::exchange(o.m_, nullptr)) {}
    guard& operator=(guard&& o) noexcept {
      if (this != &o) {
        unlock();
        m_ = std::exchange(o.m_, nullptr);
      }
      return *this;
    }
    ~guard() { unlock(); }
    void unlock() noexcept {
      if (m_) std::exchange(m_, nullptr)->sem_.release();
    }
    bool owns_lock() const noexcept { return m_ != nullptr; }

   private:
    mutex* m_ = nullptr;
  };

  class awaiter {
   public:
    explicit awaiter(mutex& m) noexcept : m_(m), inner_(m.sem_) {}
    bool await_ready() noexcept { return inner_.await_ready(); }
    template <class P>
    bool await_suspend(std::coroutine_handle<P> h) {
      return inner_.await_suspend(h);
    }
    result<guard> await_resume() noexcept {
      auto r = inner_.await_resume();
      if (!r) return r.error();
      return guard{&m_};
    }

   private:
    mutex& m_;
    semaphore::awaiter inner_;
  };
  awaiter lock() noexcept { return awaiter{*this}; }
  bool try_lock() noexcept { return sem_.try_acquire(); }
  void unlock() noexcept { sem_.release(); }

 private:
  semaphore sem_{1};
};

}  // namespace shuttle
