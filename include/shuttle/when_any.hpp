// when_any: runs tasks concurrently; the first to finish wins, the others are
// cancelled through their stop tokens and awaited before when_any completes,
// so nothing outlives it. Returns a variant whose index names the winner; if
// the winner threw, its exception is rethrown.
#pragma once

#include <shuttle/when_all.hpp>

namespace shuttle {

namespace detail {
template <class T>
driver run_racer(task<T> t, child_result<T>& out, std::stop_source& stop, std::size_t index,
                 std::atomic<std::size_t>& winner) {
  try {
    if constexpr (std::is_void_v<T>) {
      co_await std::move(t);
      out.value.emplace();
    } else {
      out.value.emplace(co_await std::move(t));
    }
  } catch (...) {
    out.error = std::current_exception();
  }
  std::size_t none = SIZE_MAX;
  winner.compare_exchange_strong(none, index, std::memory_order_acq_rel);
  stop.request_stop();
}
}  // namespace detail

template <class... Ts>
task<std::variant<non_void_t<Ts>...>> when_any(task<Ts>... tasks) {
  static_assert(sizeof...(Ts) > 0);
  detail::join_counter counter;
  std::stop_token parent_token = co_await get_stop_token();
  std::stop_callback<detail::forward_stop> forward(parent_token, detail::forward_stop{&counter.stop});
  std::tuple<detail::child_result<Ts>...> results;
  std::vector<detail::driver> drivers;
  drivers.reserve(sizeof...(Ts));
  std::atomic<std::size_t> winner{SIZE_MAX};
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    (drivers.push_back(detail::run_racer(std::move(tasks), std::get<I>(results), counter.stop, I, winner)), ...);
  }(std::index_sequence_for<Ts...>{});
  co_await detail::start_children(counter, drivers);
  using variant_t = std::variant<non_void_t<Ts>...>;
  std::optional<variant_t> out;
  auto take = [&]<std::size_t I>(std::integral_constant<std::size_t, I>) {
    auto& r = std::get<I>(results);
    if (r.error) std::rethrow_exception(r.error);
    out.emplace(std::in_place_index<I>, std::move(*r.value));
  };
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    ((I == winner.load() ? take(std::integral_constant<std::size_t, I>{}) : void()), ...);
  }(std::index_sequence_for<Ts...>{});
  co_return std::move(*out);
}

// Any awaitables, each run as a task.
template <awaitable... As>
  requires(!(detail::is_task_v<std::remove_cvref_t<As>> && ...))
auto when_any(As&&... as) {
  return when_any(detail::to_task(std::forward<As>(as))...);
}

}  // namespace shuttle
