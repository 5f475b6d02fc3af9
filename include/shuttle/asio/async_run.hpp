// async_run: starts any shuttle awaitable (an operation, a task) with any
// Asio completion token.
//
//   co_await shuttle::asio::async_run(loop, [&] { return sock.read_some(buf); }, asio::use_awaitable);
//   shuttle::asio::async_run(loop, factory, [](boost::system::error_code ec, std::size_t n) { ... });
//   auto fut = shuttle::asio::async_run(loop, factory, asio::use_future);
//
// The factory is called on the loop's thread when the operation starts (now,
// when async_run is called on that thread; otherwise on the loop's next turn)
// and must return an awaitable; it is kept alive (in the operation's frame)
// until the operation completes, so a factory that is itself a capturing
// lambda coroutine is safe. Objects it refers to must outlive the operation,
// as Asio requires of I/O objects.
//
// Completion signature, from what the awaitable yields:
//   result<void>  -> void(boost::system::error_code)
//   result<T>     -> void(boost::system::error_code, T)     (T default-constructible)
//   void          -> void(std::exception_ptr)
//   T             -> void(std::exception_ptr, T)
// Errors convert with to_boost (error.hpp): a cancelled operation completes
// with asio::error::operation_aborted. An exception escaping an operation
// that yields result<...> becomes an error code (std::system_error: its code;
// anything else: errc::state_not_recoverable) rather than being lost.
//
// The handler runs through its associated executor: dispatched (inline when
// that executor is shuttle's own, executor.hpp) on completion, or posted when
// the operation finished before async_run returned (Asio's rule: a handler is
// never called from inside the initiating function).
//
// Cancellation: with Boost >= 1.77 the handler's associated cancellation slot
// (asio::bind_cancellation_slot, the awaitable operators, co_spawn's
// cancellation) maps onto the operation's std::stop_token, so cancellation is
// shuttle's: an io_uring operation resumes only after its CQE, an RDMA
// operation only when the provider guarantees that its buffers are no longer
// touched. `accepted` says which Asio cancellation types an operation honours
// (transport operations: terminal only, since cancelling an in-flight RDMA
// operation may break its connection). On every Boost, the overload taking a
// std::stop_token cancels through that token.
//
// Cost: one allocation per operation (the frame that holds handler, factory
// and awaitable), no allocation for the stop state unless a slot or token is
// connected, no syscall beyond the operation's own.
#pragma once

#include <shuttle/asio/config.hpp>
#include <shuttle/asio/error.hpp>
#include <shuttle/asio/executor.hpp>

#include <exception>
#include <new>
#include <optional>
#include <stop_token>
#include <system_error>
#include <tuple>
#include <type_traits>
#include <typeinfo>

#include <boost/asio/associated_executor.hpp>
#include <boost/asio/async_result.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/post.hpp>
#if SHUTTLE_ASIO_HAS_CANCELLATION_SLOTS
#  include <boost/asio/associated_cancellation_slot.hpp>
#  include <boost/asio/cancellation_type.hpp>
#endif

#include <shuttle/detail/driver.hpp>
#include <shuttle/io_context.hpp>
#include <shuttle/result.hpp>
#include <shuttle/task.hpp>
#include <shuttle/when_all.hpp>  // non_void_t

namespace shuttle::asio {

// Which Asio cancellation types an operation honours (mirrors
// asio::cancellation_type, which Boost < 1.77 lacks).
enum class cancel_on : unsigned { none = 0, terminal = 1, partial = 2, total = 4, all = 7 };

namespace detail {

template <class R>
struct completion_of {
  using signature = void(std::exception_ptr, R);
  static constexpr bool is_result = false;
};
template <>
struct completion_of<void> {
  using signature = void(std::exception_ptr);
  static constexpr bool is_result = false;
};
template <class T>
struct completion_of<result<T>> {
  using signature = void(boost::system::error_code, T);
  static constexpr bool is_result = true;
};
template <>
struct completion_of<result<void>> {
  using signature = void(boost::system::error_code);
  static constexpr bool is_result = true;
};

template <class Factory>
using factory_result_t = await_result_t<std::invoke_result_t<Factory&>>;

template <class Factory>
using signature_of_t = typename completion_of<factory_result_t<Factory>>::signature;

inline std::error_code error_of(std::exception_ptr e) noexcept {
  try {
    std::rethrow_exception(e);
  } catch (const std::system_error& s) {
    return s.code();
  } catch (const std::bad_alloc&) {
    return std::make_error_code(std::errc::not_enough_memory);
  } catch (...) {
    return std::make_error_code(std::errc::state_not_recoverable);
  }
}

// The handler bound to its arguments; clears the cancellation slot in the
// handler's executor context, right before the call (Asio's rule).
template <class Handler, class... Args>
struct bound_completion {
  Handler handler;
  std::tuple<Args...> args;
  void operator()() {
#if SHUTTLE_ASIO_HAS_CANCELLATION_SLOTS
    auto slot = net::get_associated_cancellation_slot(handler);
    if (slot.is_connected()) slot.clear();
#endif
    std::apply([this](auto&... a) { std::move(handler)(std::move(a)...); }, args);
  }
  using allocator_type = net::associated_allocator_t<Handler>;
  allocator_type get_allocator() const noexcept { return net::get_associated_allocator(handler); }
};

// Whether `ex` is shuttle's executor (directly or inside any_io_executor).
template <class Ex>
bool is_shuttle_executor(const Ex& ex) noexcept {
  if constexpr (std::is_same_v<Ex, basic_executor<false>> || std::is_same_v<Ex, basic_executor<true>>) {
    return true;
  } else if constexpr (requires { ex.target_type(); }) {
    // any_io_executor. (Not target<T>(): Boost 1.74's does not check the type.)
#if !defined(BOOST_ASIO_NO_TYPEID)
    return ex.target_type() == typeid(basic_executor<false>) || ex.target_type() == typeid(basic_executor<true>);
#else
    return false;  // unknown: the driver is kicked, which is only a wasted poll
#endif
  } else {
    (void)ex;
    return false;
  }
}

// Called on the loop thread, from the operation's frame.
template <class Handler, class... Args>
void complete(Handler&& handler, bool posted, shuttle::io_context& loop, Args&&... args) {
  auto ex = net::get_associated_executor(handler, executor(loop, nullptr));
  bound_completion<std::decay_t<Handler>, std::decay_t<Args>...> c{std::forward<Handler>(handler),
                                                                   {std::forward<Args>(args)...}};
  const bool kick = driver_kick && !is_shuttle_executor(ex);
  if (posted)
    net::post(ex, std::move(c));
  else
    net::dispatch(ex, std::move(c));
  // If that queued the handler on an asio::io_context driven by this loop,
  // the driver polls it on the loop's next turn.
  if (kick) *driver_kick = true;
}

// Detects completion inside the initiating call: the frame holds a pointer to
// the launcher's flag, which the launcher clears once start() returned.
struct launch {
  launch** slot = nullptr;
};

struct forward_stop {
  std::stop_source* to;
  void operator()() const noexcept { to->request_stop(); }
};

#if SHUTTLE_ASIO_HAS_CANCELLATION_SLOTS
struct slot_handler {
  std::stop_source source;
  cancel_on accepted;
  void operator()(net::cancellation_type t) {
    if ((static_cast<unsigned>(t) & static_cast<unsigned>(accepted)) != 0) source.request_stop();
  }
};
#endif

template <class Handler, class Factory>
shuttle::detail::driver run_op(Handler handler, Factory factory, launch* l, shuttle::io_context* loop,
                               std::stop_token forward_from, std::stop_source forward_to) {
  launch* lp = l;
  if (lp) lp->slot = &lp;
  // An explicit token and an Asio slot together: the token feeds the slot's source.
  std::optional<std::stop_callback<forward_stop>> fwd;
  if (forward_from.stop_possible() && forward_to.stop_possible()) fwd.emplace(forward_from, forward_stop{&forward_to});

  using R = factory_result_t<Factory>;
  using traits = completion_of<R>;
  std::exception_ptr error;
  std::optional<non_void_t<R>> value;
  try {
    if constexpr (std::is_void_v<R>) {
      co_await factory();
      value.emplace();
    } else {
      value.emplace(co_await factory());
    }
  } catch (...) {
    error = std::current_exception();
  }
  fwd.reset();
  const bool posted = lp != nullptr;
  if (lp) lp->slot = nullptr;

  if constexpr (traits::is_result) {
    std::error_code ec = error ? error_of(error) : value->error();
    if constexpr (std::is_same_v<R, result<void>>) {
      complete(std::move(handler), posted, *loop, to_boost(ec));
    } else {
      using T = typename R::value_type;
      if (!error && *value)
        complete(std::move(handler), posted, *loop, boost::system::error_code{}, std::move(**value));
      else
        complete(std::move(handler), posted, *loop, to_boost(ec), T{});
    }
  } else if constexpr (std::is_void_v<R>) {
    complete(std::move(handler), posted, *loop, error);
  } else {
    if (error)
      complete(std::move(handler), posted, *loop, error, R{});
    else
      complete(std::move(handler), posted, *loop, std::exception_ptr{}, std::move(*value));
  }
}

struct initiate_run {
  shuttle::io_context* loop;
  std::stop_token token;
  cancel_on accepted;

  template <class Handler, class Factory>
  void operator()(Handler&& handler, Factory factory) const {
    std::stop_token stop = token;
    std::stop_source forward_to(std::nostopstate);
#if SHUTTLE_ASIO_HAS_CANCELLATION_SLOTS
    auto slot = net::get_associated_cancellation_slot(handler);
    if (slot.is_connected() && accepted != cancel_on::none) {
      std::stop_source src;
      slot.template emplace<slot_handler>(slot_handler{src, accepted});
      if (token.stop_possible()) forward_to = src;
      stop = src.get_token();
    }
#endif
    if (loop->running_in_this_thread()) {
      launch l;
      auto d = run_op(std::forward<Handler>(handler), std::move(factory), &l, loop, token, std::move(forward_to));
      d.set_stop_token(std::move(stop));
      d.on_done(nullptr, nullptr, true);
      d.release().resume();
      if (l.slot) *l.slot = nullptr;  // still running: it completes from the loop
    } else {
      auto d = run_op(std::forward<Handler>(handler), std::move(factory), nullptr, loop, token, std::move(forward_to));
      d.set_stop_token(std::move(stop));
      d.on_done(nullptr, nullptr, true);
      detail::post_remote(*loop, [h = d.release()] { h.resume(); });
    }
  }
};

}  // namespace detail

// Starts factory()'s awaitable on `loop` and completes `token`.
template <class Factory, class CompletionToken>
auto async_run(shuttle::io_context& loop, Factory factory, CompletionToken&& token,
               cancel_on accepted = cancel_on::all) {
  return net::async_initiate<CompletionToken, detail::signature_of_t<Factory>>(
      detail::initiate_run{&loop, {}, accepted}, token, std::move(factory));
}

// The same, also cancelled by `stop` (works on every Boost, slots or not).
template <class Factory, class CompletionToken>
auto async_run(shuttle::io_context& loop, std::stop_token stop, Factory factory, CompletionToken&& token,
               cancel_on accepted = cancel_on::all) {
  return net::async_initiate<CompletionToken, detail::signature_of_t<Factory>>(
      detail::initiate_run{&loop, std::move(stop), accepted}, token, std::move(factory));
}

}  // namespace shuttle::asio
