// The reverse direction: a shuttle task awaits Asio operations.
//
//   std::size_t n = (co_await asio_sock.async_read_some(buf, shuttle::asio::use_task)).value();
//   auto r = co_await timer.async_wait(shuttle::asio::use_task);   // result<void>
//
// use_task makes any Asio initiating function return a shuttle::task (lazy:
// the Asio operation starts when the task is awaited), yielding
//   void(error_code)          -> result<void>
//   void(error_code, T)       -> result<T>        (errors through from_boost)
//   void()                    -> void
//   void(exception_ptr[, T])  -> T, rethrown if set
//   anything else             -> std::tuple<Args...>
// The awaiting coroutine is resumed on its shuttle loop's next turn (never
// inside an Asio handler), from whichever thread Asio completes on.
//
// Cancellation by the task's stop token (when_any, with_timeout, a scope's
// request_stop): with Boost >= 1.77 through a cancellation slot bound to the
// handler (terminal cancellation); on every Boost, through a canceller given
// to the token, e.g. use_task([&] { sock.cancel(); }). Both run on the loop
// thread: the Asio objects must belong to an io_context driven by that loop
// (asio_driver) or to shuttle's executor. The task resumes only once Asio
// has called the handler.
#pragma once

#include <shuttle/asio/config.hpp>
#include <shuttle/asio/error.hpp>

#include <atomic>
#include <coroutine>
#include <exception>
#include <functional>
#include <optional>
#include <stop_token>
#include <tuple>
#include <type_traits>

#include <boost/asio/async_result.hpp>
#if SHUTTLE_ASIO_HAS_CANCELLATION_SLOTS
#  include <boost/asio/cancellation_signal.hpp>
#endif

#include <shuttle/detail/io_op.hpp>
#include <shuttle/io_context.hpp>
#include <shuttle/result.hpp>
#include <shuttle/task.hpp>

namespace shuttle::asio {

struct use_task_t {
  std::function<void()> on_stop;  // optional: how to cancel the operation
  use_task_t operator()(std::function<void()> canceller) const { return use_task_t{std::move(canceller)}; }
};
inline const use_task_t use_task{};

namespace detail {

template <class... Args>
struct task_value {
  using type = std::tuple<std::decay_t<Args>...>;
  static type make(std::tuple<std::decay_t<Args>...>&& t) { return std::move(t); }
};
template <>
struct task_value<> {
  using type = void;
};
template <>
struct task_value<boost::system::error_code> {
  using type = result<void>;
  static type make(std::tuple<boost::system::error_code>&& t) {
    if (auto& ec = std::get<0>(t)) return from_boost(ec);
    return {};
  }
};
template <class T>
struct task_value<boost::system::error_code, T> {
  using type = result<std::decay_t<T>>;
  static type make(std::tuple<boost::system::error_code, std::decay_t<T>>&& t) {
    if (auto& ec = std::get<0>(t)) return from_boost(ec);
    return std::move(std::get<1>(t));
  }
};
template <>
struct task_value<std::exception_ptr> {
  using type = void;
};
template <class T>
struct task_value<std::exception_ptr, T> {
  using type = std::decay_t<T>;
  static type make(std::tuple<std::exception_ptr, std::decay_t<T>>&& t) {
    if (std::get<0>(t)) std::rethrow_exception(std::get<0>(t));
    return std::move(std::get<1>(t));
  }
};

template <class... Args>
struct asio_op_state {
  using values = std::tuple<std::decay_t<Args>...>;

  struct cancel_node : shuttle::detail::remote_op {
    asio_op_state* self;
  };
  struct resume_node : shuttle::detail::remote_op {
    asio_op_state* self;
  };
  struct on_stop_cb {
    asio_op_state* self;
    void operator()() const noexcept { self->request_cancel(); }
  };

  shuttle::io_context* loop = nullptr;
  std::coroutine_handle<> waiter{};
  std::function<void()> canceller;
  std::optional<values> out;
  std::optional<std::stop_callback<on_stop_cb>> stop_cb;
  std::atomic<int> refs{1};
  std::atomic<bool> done{false};
  cancel_node cnode;
  resume_node rnode;
#if SHUTTLE_ASIO_HAS_CANCELLATION_SLOTS
  net::cancellation_signal signal;
#endif

  void cancel_on_loop() noexcept {
    if (done) return;
#if SHUTTLE_ASIO_HAS_CANCELLATION_SLOTS
    signal.emit(net::cancellation_type::terminal);
#endif
    if (canceller) {
      try {
        canceller();
      } catch (...) {
      }
    }
  }
  void request_cancel() noexcept {
    if (loop->running_in_this_thread()) {
      cancel_on_loop();
      return;
    }
    refs.fetch_add(1, std::memory_order_relaxed);
    cnode.self = this;
    cnode.run = [](shuttle::detail::remote_op* r) noexcept {
      auto* s = static_cast<cancel_node*>(r)->self;
      s->cancel_on_loop();
      s->release();
    };
    loop->post_remote(&cnode);
  }
  // Called by the handler, on whatever thread Asio completes.
  void finish() noexcept {
    stop_cb.reset();  // waits for a callback running on another thread
    release();
  }
  void release() noexcept {
    if (refs.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    if (loop->running_in_this_thread()) {
      loop->post(waiter);
      return;
    }
    rnode.self = this;
    rnode.run = [](shuttle::detail::remote_op* r) noexcept { static_cast<resume_node*>(r)->self->waiter.resume(); };
    loop->post_remote(&rnode);
  }
};

template <class... Args>
struct use_task_handler {
  asio_op_state<Args...>* s;
  void operator()(Args... a) {
    s->done = true;
    s->out.emplace(std::move(a)...);
    s->finish();
  }
#if SHUTTLE_ASIO_HAS_CANCELLATION_SLOTS
  using cancellation_slot_type = net::cancellation_slot;
  cancellation_slot_type get_cancellation_slot() const noexcept { return s->signal.slot(); }
#endif
};

template <class Init, class ArgTuple, class... Args>
struct asio_op_awaiter {
  Init init;
  ArgTuple init_args;
  std::function<void()> canceller;
  asio_op_state<Args...> st;

  bool await_ready() const noexcept { return false; }
  template <class P>
  void await_suspend(std::coroutine_handle<P> h) {
    st.loop = &shuttle::io_context::current();
    st.waiter = h;
    st.canceller = std::move(canceller);
    std::stop_token token = shuttle::detail::stop_token_of(h);
    // Two references: the operation's and this call's, so a completion on
    // another thread cannot resume the coroutine before this returns.
    st.refs.store(2, std::memory_order_relaxed);
    if (token.stop_possible()) st.stop_cb.emplace(token, typename asio_op_state<Args...>::on_stop_cb{&st});
    std::apply([this](auto&... a) { std::move(init)(use_task_handler<Args...>{&st}, std::move(a)...); }, init_args);
    // A stop requested before the operation existed: cancel it now.
    if (token.stop_requested()) st.cancel_on_loop();
    st.release();
  }
  decltype(auto) await_resume() {
    using tv = task_value<std::decay_t<Args>...>;
    if constexpr (!std::is_void_v<typename tv::type>) {
      return tv::make(std::move(*st.out));
    } else if constexpr (sizeof...(Args) == 1) {
      if (auto& e = std::get<0>(*st.out)) std::rethrow_exception(e);
    }
  }
};

template <class... Args>
using use_task_value_t = typename task_value<std::decay_t<Args>...>::type;

}  // namespace detail
}  // namespace shuttle::asio

namespace boost::asio {

template <class... Args>
class async_result<::shuttle::asio::use_task_t, void(Args...)> {
 public:
  using return_type = ::shuttle::task<::shuttle::asio::detail::use_task_value_t<Args...>>;

  template <class Initiation, class... InitArgs>
  static return_type initiate(Initiation init, ::shuttle::asio::use_task_t token, InitArgs... args) {
    co_return co_await ::shuttle::asio::detail::asio_op_awaiter<Initiation, std::tuple<InitArgs...>, Args...>{
        std::move(init), std::tuple<InitArgs...>(std::move(args)...), std::move(token.on_stop), {}};
  }
};

}  // namespace boost::asio
