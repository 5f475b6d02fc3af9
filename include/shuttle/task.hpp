// task<T>: a lazy coroutine. Nothing runs until it is awaited (or handed to
// io_context::run / async_scope::spawn); completion resumes the awaiter by
// symmetric transfer, so chains of tasks use no stack and no allocation beyond
// their frames. Exceptions propagate to the awaiter.
//
// Symmetric transfer relies on the compiler making the resumption a tail
// call. Clang 14 does on x86-64 (measured at -O0, and with ASan); GCC (12 measured
// here; 11 and 13 reported) only when optimizing (-O2) without ASan. In a GCC
// -O0 or ASan build, a coroutine that awaits very many tasks in a row that
// complete without suspending (a loop of 10^5-10^6 of them) grows the stack
// until it overflows; a task that suspends (any I/O) resets the depth.
//
// Cancellation: every task carries a std::stop_token inherited from whoever
// awaits it. I/O operations awaited inside the task observe that token, so
// request_stop() on a parent's source cancels everything below it.
#pragma once

#include <coroutine>
#include <exception>
#include <stop_token>
#include <type_traits>
#include <utility>
#include <variant>

#include <shuttle/detail/frame_pool.hpp>

namespace shuttle {

template <class T = void>
class task;

namespace detail {

// Promises that carry a stop token (task, drivers). Leaf awaitables read the
// token of the coroutine that awaits them through this concept.
template <class P>
concept stop_token_provider = requires(const P& p) {
  { p.get_stop_token() } -> std::convertible_to<std::stop_token>;
};

template <class P>
std::stop_token stop_token_of(std::coroutine_handle<P> h) noexcept {
  if constexpr (stop_token_provider<P>)
    return h.promise().get_stop_token();
  else
    return {};
}

class task_promise_base {
 public:
  struct final_awaiter {
    bool await_ready() const noexcept { return false; }
    template <class P>
    std::coroutine_handle<> await_suspend(std::coroutine_handle<P> h) noexcept {
      auto next = h.promise().continuation_;
      return next ? next : std::noop_coroutine();
    }
    void await_resume() const noexcept {}
  };

  // Frames come from the per-thread cache (frame_pool.hpp).
  static void* operator new(std::size_t size) { return allocate_task_frame(size); }
  static void operator delete(void* p, std::size_t size) noexcept { free_task_frame(p, size); }

  std::suspend_always initial_suspend() const noexcept { return {}; }
  final_awaiter final_suspend() const noexcept { return {}; }
  void unhandled_exception() noexcept { exception_ = std::current_exception(); }

  const std::stop_token& get_stop_token() const noexcept { return stop_token_; }
  void set_stop_token(std::stop_token t) noexcept { stop_token_ = std::move(t); }
  void set_continuation(std::coroutine_handle<> c) noexcept { continuation_ = c; }

 protected:
  void rethrow_if_failed() const {
    if (exception_) std::rethrow_exception(exception_);
  }

 private:
  std::coroutine_handle<> continuation_{};
  std::stop_token stop_token_{};
  std::exception_ptr exception_{};
};

template <class T>
class task_promise final : public task_promise_base {
 public:
  task<T> get_return_object() noexcept;
  template <class U>
    requires std::is_convertible_v<U&&, T>
  void return_value(U&& v) noexcept(std::is_nothrow_constructible_v<T, U&&>) {
    value_.template emplace<1>(std::forward<U>(v));
  }
  T take() {
    rethrow_if_failed();
    return std::move(std::get<1>(value_));
  }

 private:
  std::variant<std::monostate, T> value_;
};

template <>
class task_promise<void> final : public task_promise_base {
 public:
  task<void> get_return_object() noexcept;
  void return_void() const noexcept {}
  void take() const { rethrow_if_failed(); }
};

}  // namespace detail

template <class T>
class [[nodiscard]] task {
 public:
  using promise_type = detail::task_promise<T>;
  using handle_type = std::coroutine_handle<promise_type>;
  using value_type = T;

  task() noexcept = default;
  explicit task(handle_type h) noexcept : handle_(h) {}
  task(task&& o) noexcept : handle_(std::exchange(o.handle_, {})) {}
  task& operator=(task&& o) noexcept {
    if (this != &o) {
      destroy();
      handle_ = std::exchange(o.handle_, {});
    }
    return *this;
  }
  task(const task&) = delete;
  task& operator=(const task&) = delete;
  ~task() { destroy(); }

  bool valid() const noexcept { return static_cast<bool>(handle_); }

  struct awaiter {
    handle_type child;
    bool await_ready() const noexcept { return false; }
    template <class P>
    std::coroutine_handle<> await_suspend(std::coroutine_handle<P> parent) noexcept {
      child.promise().set_continuation(parent);
      child.promise().set_stop_token(detail::stop_token_of(parent));
      return child;
    }
    T await_resume() { return child.promise().take(); }
  };
  awaiter operator co_await() && noexcept { return awaiter{handle_}; }
  awaiter operator co_await() & noexcept { return awaiter{handle_}; }

  // For drivers (run, spawn, when_all): give up ownership of the frame.
  handle_type release() noexcept { return std::exchange(handle_, {}); }
  handle_type handle() const noexcept { return handle_; }

 private:
  void destroy() noexcept {
    if (handle_) handle_.destroy();
  }
  handle_type handle_{};
};

namespace detail {
template <class T>
task<T> task_promise<T>::get_return_object() noexcept {
  return task<T>{std::coroutine_handle<task_promise<T>>::from_promise(*this)};
}
inline task<void> task_promise<void>::get_return_object() noexcept {
  return task<void>{std::coroutine_handle<task_promise<void>>::from_promise(*this)};
}
}  // namespace detail

// co_await get_stop_token(): the stop token of the calling task, without suspending.
struct get_stop_token_t {
  std::stop_token token;
  bool await_ready() const noexcept { return false; }
  template <class P>
  bool await_suspend(std::coroutine_handle<P> h) noexcept {
    token = detail::stop_token_of(h);
    return false;
  }
  std::stop_token await_resume() noexcept { return std::move(token); }
};
inline get_stop_token_t get_stop_token() noexcept { return {}; }

// Anything `co_await`-able (member operator co_await or an awaiter itself),
// and what awaiting it yields.
template <class A>
concept awaitable = requires(A&& a) { std::forward<A>(a).operator co_await(); } ||
                    requires(A&& a) { std::forward<A>(a).await_ready(); };

namespace detail {
template <class A>
decltype(auto) get_awaiter(A&& a) {
  if constexpr (requires { std::forward<A>(a).operator co_await(); })
    return std::forward<A>(a).operator co_await();
  else
    return std::forward<A>(a);
}
}  // namespace detail

template <class A>
using await_result_t = decltype(detail::get_awaiter(std::declval<A>()).await_resume());

// Wraps any awaitable in a task (for run(), when_all, with_timeout).
template <awaitable A>
task<await_result_t<A>> as_task(A a) {
  if constexpr (std::is_void_v<await_result_t<A>>)
    co_await std::move(a);
  else
    co_return co_await std::move(a);
}

namespace detail {
template <class A>
inline constexpr bool is_task_v = false;
template <class T>
inline constexpr bool is_task_v<task<T>> = true;

// A task as it is; any other awaitable (an rvalue) wrapped by as_task.
template <class A>
auto to_task(A&& a) {
  if constexpr (is_task_v<std::remove_cvref_t<A>>)
    return std::remove_cvref_t<A>(std::move(a));
  else
    return as_task(std::forward<A>(a));
}
}  // namespace detail

}  // namespace shuttle
