// when_all: runs tasks concurrently (on the awaiting thread, interleaved at
// their suspension points) and completes when all have. If one throws, the
// others are asked to stop, all are awaited, and the first exception is
// rethrown. The children inherit the awaiting task's stop token.
#pragma once

#include <atomic>
#include <exception>
#include <optional>
#include <stop_token>
#include <tuple>
#include <variant>
#include <vector>

#include <shuttle/detail/driver.hpp>
#include <shuttle/task.hpp>

namespace shuttle {

template <class T>
using non_void_t = std::conditional_t<std::is_void_v<T>, std::monostate, T>;

namespace detail {

// Shared by the children of one when_all / when_any.
struct join_counter {
  std::atomic<std::size_t> remaining{0};
  std::coroutine_handle<> parent{};
  std::stop_source stop;

  static std::coroutine_handle<> child_done(void* arg) noexcept {
    auto* self = static_cast<join_counter*>(arg);
    if (self->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) return self->parent;
    return std::noop_coroutine();
  }
};

// Starts every driver, then suspends until the last one finishes. The extra
// count held while starting keeps a child that finishes synchronously from
// resuming the parent in the middle of the loop.
class start_children {
 public:
  start_children(join_counter& c, std::vector<driver>& d) noexcept : c_(c), d_(d) {}
  bool await_ready() const noexcept { return false; }
  bool await_suspend(std::coroutine_handle<> parent) noexcept {
    c_.parent = parent;
    c_.remaining.store(d_.size() + 1, std::memory_order_relaxed);
    for (auto& d : d_) {
      d.on_done(&join_counter::child_done, &c_, false);
      d.set_stop_token(c_.stop.get_token());
      d.start();
    }
    return c_.remaining.fetch_sub(1, std::memory_order_acq_rel) != 1;
  }
  void await_resume() const noexcept {}

 private:
  join_counter& c_;
  std::vector<driver>& d_;
};

template <class T>
struct child_result {
  std::optional<non_void_t<T>> value;
  std::exception_ptr error;
};

template <class T>
driver run_child(task<T> t, child_result<T>& out, std::stop_source* stop_on_error) {
  try {
    if constexpr (std::is_void_v<T>) {
      co_await std::move(t);
      out.value.emplace();
    } else {
      out.value.emplace(co_await std::move(t));
    }
  } catch (...) {
    out.error = std::current_exception();
    if (stop_on_error) stop_on_error->request_stop();
  }
}

// Forwards the parent's stop request to the children's source.
struct forward_stop {
  std::stop_source* target;
  void operator()() const noexcept { target->request_stop(); }
};

}  // namespace detail

template <class... Ts>
task<std::tuple<non_void_t<Ts>...>> when_all(task<Ts>... tasks) {
  detail::join_counter counter;
  std::stop_token parent_token = co_await get_stop_token();
  std::stop_callback<detail::forward_stop> forward(parent_token, detail::forward_stop{&counter.stop});
  std::tuple<detail::child_result<Ts>...> results;
  std::vector<detail::driver> drivers;
  drivers.reserve(sizeof...(Ts));
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    (drivers.push_back(detail::run_child(std::move(tasks), std::get<I>(results), &counter.stop)), ...);
  }(std::index_sequence_for<Ts...>{});
  co_await detail::start_children(counter, drivers);
  std::apply([](auto&... r) {
    ((r.error ? std::rethrow_exception(r.error) : void()), ...);
  }, results);
  co_return std::apply([](auto&... r) { return std::tuple<non_void_t<Ts>...>(std::move(*r.value)...); }, results);
}

// Any awaitables (connection operations, sleeps), each run as a task.
template <awaitable... As>
  requires(!(detail::is_task_v<std::remove_cvref_t<As>> && ...))
auto when_all(As&&... as) {
  return when_all(detail::to_task(std::forward<As>(as))...);
}

// when_all over a run-time number of tasks of one type.
template <class T>
task<std::conditional_t<std::is_void_v<T>, void, std::vector<T>>> when_all(std::vector<task<T>> tasks) {
  detail::join_counter counter;
  std::stop_token parent_token = co_await get_stop_token();
  std::stop_callback<detail::forward_stop> forward(parent_token, detail::forward_stop{&counter.stop});
  std::vector<detail::child_result<T>> results(tasks.size());
  std::vector<detail::driver> drivers;
  drivers.reserve(tasks.size());
  for (std::size_t i = 0; i < tasks.size(); ++i)
    drivers.push_back(detail::run_child(std::move(tasks[i]), results[i], &counter.stop));
  if (!drivers.empty()) co_await detail::start_children(counter, drivers);
  for (auto& r : results)
    if (r.error) std::rethrow_exception(r.error);
  if constexpr (!std::is_void_v<T>) {
    std::vector<T> out;
    out.reserve(results.size());
    for (auto& r : results) out.push_back(std::move(*r.value));
    co_return out;
  }
}

}  // namespace shuttle
