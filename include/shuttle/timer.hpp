// Timers: sleep_for / sleep_until (IORING_OP_TIMEOUT on CLOCK_MONOTONIC) and
// with_timeout, which bounds any awaitable.
#pragma once

#include <chrono>
#include <system_error>

#include <shuttle/detail/uring_op.hpp>
#include <shuttle/error.hpp>
#include <shuttle/result.hpp>
#include <shuttle/when_any.hpp>

namespace shuttle {

using clock = std::chrono::steady_clock;  // CLOCK_MONOTONIC, as io_uring's absolute timeouts

namespace detail {
inline __kernel_timespec to_timespec(clock::time_point tp) noexcept {
  auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(tp.time_since_epoch()).count();
  if (ns < 0) ns = 0;
  return {ns / 1'000'000'000, ns % 1'000'000'000};
}

// Completes with success at the deadline, or operation_canceled when stopped.
class sleep_awaitable : private uring_op_base {
 public:
  sleep_awaitable(io_context& ctx, clock::time_point deadline) noexcept
      : uring_op_base(ctx), ts_(to_timespec(deadline)) {}
  sleep_awaitable(sleep_awaitable&& o) noexcept : uring_op_base(*o.ctx_), ts_(o.ts_) {}
  bool await_ready() const noexcept { return false; }
  template <class P>
  bool await_suspend(std::coroutine_handle<P> h) {
    return start(h, [this](io_uring_sqe* sqe) { io_uring_prep_timeout(sqe, &ts_, 0, IORING_TIMEOUT_ABS); });
  }
  result<void> await_resume() const noexcept {
    if (res_ == -ETIME || res_ == 0) return {};
    return errno_code(-res_);
  }

 private:
  __kernel_timespec ts_;
};
}  // namespace detail

// co_await sleep_until(t): result<void>; error operation_canceled if stopped first.
inline detail::sleep_awaitable sleep_until(clock::time_point deadline) {
  return {io_context::current(), deadline};
}
template <class Rep, class Period>
detail::sleep_awaitable sleep_for(std::chrono::duration<Rep, Period> d) {
  return {io_context::current(), clock::now() + std::chrono::duration_cast<clock::duration>(d)};
}

// Runs `t`; if it has not finished after `d`, it is cancelled (through its stop
// token) and awaited, and the result is errc::operation_timeout (equivalent
// to std::errc::timed_out: `ec == std::errc::timed_out` holds).
template <class T, class Rep, class Period>
task<result<T>> with_timeout(task<T> t, std::chrono::duration<Rep, Period> d) {
  auto timer = [](std::chrono::duration<Rep, Period> d) -> task<void> { (void)co_await sleep_for(d); };
  auto r = co_await when_any(std::move(t), timer(d));
  if (r.index() == 1) co_return make_error_code(errc::operation_timeout);
  if constexpr (std::is_void_v<T>)
    co_return result<void>{};
  else
    co_return std::move(std::get<0>(r));
}

// For tasks that already return result<T>: the timeout folds into the error.
template <class T, class Rep, class Period>
task<result<T>> with_timeout(task<result<T>> t, std::chrono::duration<Rep, Period> d) {
  auto timer = [](std::chrono::duration<Rep, Period> d) -> task<void> { (void)co_await sleep_for(d); };
  auto r = co_await when_any(std::move(t), timer(d));
  if (r.index() == 1) co_return make_error_code(errc::operation_timeout);
  co_return std::move(std::get<0>(r));
}

// Any other awaitable (a connection operation, say), run as a task.
template <awaitable A, class Rep, class Period>
  requires(!detail::is_task_v<std::remove_cvref_t<A>>)
auto with_timeout(A&& a, std::chrono::duration<Rep, Period> d) {
  return with_timeout(as_task(std::forward<A>(a)), d);
}

}  // namespace shuttle
