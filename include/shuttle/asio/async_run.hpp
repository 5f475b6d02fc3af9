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
// The handler runs through its associated executor: dispatched on
// completion, or posted when the operation finished before async_run returned
// (Asio's rule: a handler is never called from inside the initiating
// function). When that executor is this loop's shuttle executor (executor.hpp;
// directly or inside any_io_executor, as for use_awaitable in a coroutine
// co_spawned on shuttle::asio::context), dispatch would call inline anyway:
// the handler is called directly, without Asio's type-erased executor
// function; the "post" case waits for the loop's next turn in the
// operation's own frame.
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
// Cost: no allocation per operation in the steady state: the frame (handler,
// factory, awaitable) comes from the handler's associated allocator, or else
// from a per-thread cache of recycled frames (recycling.hpp), and is freed
// before the handler runs; on shuttle's executor Asio's own awaitable frames
// are recycled too. The stop state is allocated only when a slot is
// connected (std::stop_source's shared state). No syscall beyond the
// operation's own. bench/asio_interop measures it against the native
// co_await form and against a minimal hand-written Asio initiation.
#pragma once

#include <shuttle/asio/config.hpp>
#include <shuttle/asio/error.hpp>
#include <shuttle/asio/executor.hpp>
#include <shuttle/asio/recycling.hpp>

#include <exception>
#include <memory>
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
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/prefer.hpp>
#include <boost/asio/post.hpp>
#if SHUTTLE_ASIO_HAS_CANCELLATION_SLOTS
#  include <boost/asio/associated_cancellation_slot.hpp>
#  include <boost/asio/cancellation_type.hpp>
#endif

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
// handler's executor context, right before the call (Asio's rule), unless the
// operation did (clear_slot false: sqe_op.hpp, on the handler's own thread).
template <class Handler, class... Args>
struct bound_completion {
  Handler handler;
  std::tuple<Args...> args;
  bool clear_slot = true;
  void operator()() {
#if SHUTTLE_ASIO_HAS_CANCELLATION_SLOTS
    if (clear_slot) {
      auto slot = net::get_associated_cancellation_slot(handler);
      if (slot.is_connected()) slot.clear();
    }
#endif
    std::apply([this](auto&... a) { std::move(handler)(std::move(a)...); }, args);
  }
  using allocator_type = net::associated_allocator_t<Handler>;
  allocator_type get_allocator() const noexcept { return net::get_associated_allocator(handler); }
};

// The shuttle loop behind `ex` when it is shuttle's executor (directly or
// inside any_io_executor); null otherwise.
template <class Ex>
shuttle::io_context* shuttle_loop_of(const Ex& ex) noexcept {
  if constexpr (is_basic_executor_v<Ex>) {
    return &ex.loop();
  } else if constexpr (requires { ex.target_type(); }) {
    // any_io_executor. (target<T>() only after the type check: Boost 1.74's
    // does not check it.)
#if !defined(BOOST_ASIO_NO_TYPEID)
    if (ex.target_type() == typeid(basic_executor<false>))
      return &ex.template target<basic_executor<false>>()->loop();
    if (ex.target_type() == typeid(basic_executor<true>))
      return &ex.template target<basic_executor<true>>()->loop();
    if (ex.target_type() == typeid(basic_executor<false, true>))
      return &ex.template target<basic_executor<false, true>>()->loop();
    if (ex.target_type() == typeid(basic_executor<true, true>))
      return &ex.template target<basic_executor<true, true>>()->loop();
#endif
    return nullptr;  // unknown: dispatched (and the driver kicked, a wasted poll at worst)
  } else {
    (void)ex;
    return nullptr;
  }
}
template <class Ex>
bool is_shuttle_executor(const Ex& ex) noexcept {
  return shuttle_loop_of(ex) != nullptr;
}

// Hands a completion to its handler, the operation's memory already freed.
// A handler that throws ends the program (it runs inside the loop's
// completion).
//  - direct (the handler's executor is this loop's shuttle executor):
//    dispatch() from the loop's own thread would call inline: the handler is
//    called directly, without Asio's type-erased executor function (an
//    allocation and two executor hops); with `posted` (the operation finished
//    inside its initiating function), on the loop's next turn instead, from a
//    recycled frame. The Asio thread scope lets Asio recycle the frames of
//    the awaitable coroutine that the handler resumes.
//  - otherwise: dispatched (posted) through the handler's associated
//    executor, Asio's queued handler coming from its per-thread cache.
template <class Handler, class... Args>
void deliver(bound_completion<Handler, Args...>&& call, shuttle::io_context& loop, bool direct, bool posted) {
  if (direct) {
    if (posted)
      post_local(loop, std::move(call));
    else
      with_asio_thread(call);
    return;
  }
  auto ex = net::get_associated_executor(call.handler, executor(loop, nullptr));
  const bool kick = driver_kick && !is_shuttle_executor(ex);
  with_asio_thread([&] {
    if (posted)
      net::post(ex, std::move(call));
    else
      net::dispatch(ex, std::move(call));
  });
  // If that queued the handler on an asio::io_context driven by this loop,
  // the driver polls it on the loop's next turn.
  if (kick) *driver_kick = true;
}

// Work on the handler's executor while the operation is pending, as Asio's
// handler_work does for its own operations: an io_context (driven or not),
// or a strand on one, does not run out of work, and stop, under a pending
// shuttle operation whose handler it will run. Not taken for a handler that
// runs on this loop's shuttle executor (direct): its coroutine or guard
// counts there, and the common path stays free of it.
template <class Ex>
auto tracked_work(const Ex& ex) {
  if constexpr (net::execution::is_executor<Ex>::value)
    return net::prefer(ex, net::execution::outstanding_work.tracked);
  else
    return net::make_work_guard(ex);  // a Networking TS executor
}
template <class Handler>
class pending_work {
 public:
  using executor_type = net::associated_executor_t<Handler, executor>;
  pending_work(const Handler& h, shuttle::io_context& loop, bool direct) {
    if (!direct) {
      ::new (static_cast<void*>(buf_)) work_type(tracked_work(net::get_associated_executor(h, executor(loop, nullptr))));
      has_ = true;
    }
  }
  // Moves leave the source empty (not a moved-from executor to destroy).
  pending_work(pending_work&& o) noexcept : has_(o.has_) {
    if (has_) {
      ::new (static_cast<void*>(buf_)) work_type(std::move(*o.get()));
      o.reset();
    }
  }
  pending_work& operator=(pending_work&&) = delete;
  ~pending_work() { reset(); }

 private:
  using work_type = decltype(tracked_work(std::declval<const executor_type&>()));
  work_type* get() noexcept { return std::launder(reinterpret_cast<work_type*>(buf_)); }
  void reset() noexcept {
    if (has_) get()->~work_type();
    has_ = false;
  }
  alignas(work_type) unsigned char buf_[sizeof(work_type)];
  bool has_ = false;
};

// Detects completion inside the initiating call: the frame holds a pointer to
// the launcher's flag, which the launcher clears once start() returned.
struct launch {
  launch** slot = nullptr;
};

struct forward_stop {
  std::stop_source to;
  void operator()() noexcept { to.request_stop(); }
};
// An explicit stop token together with an Asio slot (rare): the token feeds
// the slot's source while the operation runs. Outside the frame, which stays
// small for the common case.
using stop_forwarder = std::stop_callback<forward_stop>;

#if SHUTTLE_ASIO_HAS_CANCELLATION_SLOTS
struct slot_handler {
  std::stop_source source;
  cancel_on accepted;
  void operator()(net::cancellation_type t) {
    if ((static_cast<unsigned>(t) & static_cast<unsigned>(accepted)) != 0) source.request_stop();
  }
};
#endif

// An operation's state, the first parameter of its frame (parameters live
// until the frame is destroyed, after the final suspension, where the upcall
// moves handler and results out). Small on purpose: the frame is touched
// right after the kernel round trip.
template <class Handler, class... Args>
struct op_state {
  Handler handler;
  shuttle::io_context* loop;
  launch* launcher;  // non-null while the initiating function runs
  bool direct;       // the handler's executor is this loop's shuttle executor
  bool posted = false;
  std::optional<std::tuple<Args...>> args;
  std::unique_ptr<stop_forwarder> forward;
  pending_work<Handler> work;

  // The frame is allocated with the handler's associated allocator.
  using allocator_type = net::associated_allocator_t<Handler>;
  allocator_type get_allocator() const noexcept { return net::get_associated_allocator(handler); }

  template <class... A>
  void set(A&&... a) {
    args.emplace(std::forward<A>(a)...);
  }

  static void upcall(void* self, op_coro::handle h) noexcept {
    auto& st = *static_cast<op_state*>(self);
    bound_completion<Handler, Args...> call{std::move(st.handler), std::move(*st.args)};
    shuttle::io_context* loop = st.loop;
    const bool direct = st.direct, posted = st.posted;
    auto work = std::move(st.work);  // until the handler is queued or run
    h.destroy();  // Asio's rule: the operation's memory is freed before the upcall
    deliver(std::move(call), *loop, direct, posted);
  }
};

template <class Handler, class Signature>
struct op_state_for;
template <class Handler, class... Args>
struct op_state_for<Handler, void(Args...)> {
  using type = op_state<Handler, Args...>;
};

// Resumes the frame on the loop's next turn (same thread).
struct repost {
  shuttle::io_context* loop;
  bool await_ready() const noexcept { return false; }
  void await_suspend(std::coroutine_handle<> h) const { loop->post(h); }
  void await_resume() const noexcept {}
};

// co_await set_upcall{...}: registers the final upcall, without suspending.
struct set_upcall {
  op_coro::upcall_fn fn;
  void* arg;
  bool await_ready() const noexcept { return false; }
  bool await_suspend(op_coro::handle h) const noexcept {
    h.promise().upcall = fn;
    h.promise().upcall_arg = arg;
    return false;
  }
  void await_resume() const noexcept {}
};

template <class Factory, class State>
op_coro run_op(State st, Factory factory) {
  co_await set_upcall{&State::upcall, &st};
  if (st.launcher) st.launcher->slot = &st.launcher;

  using R = factory_result_t<Factory>;
  using traits = completion_of<R>;
  try {
    if constexpr (std::is_void_v<R>) {
      co_await factory();
      st.set(std::exception_ptr{});
    } else if constexpr (!traits::is_result) {
      st.set(std::exception_ptr{}, co_await factory());
    } else if constexpr (std::is_same_v<R, result<void>>) {
      R r = co_await factory();
      st.set(to_boost(r ? std::error_code{} : r.error()));
    } else {
      R r = co_await factory();
      if (r)
        st.set(boost::system::error_code{}, std::move(*r));
      else
        st.set(to_boost(r.error()), typename R::value_type{});
    }
  } catch (...) {
    // An exception escaping the operation: to the handler, as an error code
    // when the signature has one.
    auto e = std::current_exception();
    if constexpr (std::is_void_v<R>)
      st.set(e);
    else if constexpr (!traits::is_result)
      st.set(e, R{});
    else if constexpr (std::is_same_v<R, result<void>>)
      st.set(to_boost(error_of(e)));
    else
      st.set(to_boost(error_of(e)), typename R::value_type{});
  }
  st.forward.reset();
  // Asio's rule: a handler is never called from inside the initiating
  // function. When the handler runs on this loop, the frame itself waits for
  // the loop's next turn (no second allocation); otherwise Asio's post.
  if (st.launcher) {
    st.launcher->slot = nullptr;
    st.launcher = nullptr;
    if (st.direct)
      co_await repost{st.loop};
    else
      st.posted = true;
  }
  // The upcall runs at the final suspension, after the frame is freed.
}

struct initiate_run {
  shuttle::io_context* loop;
  std::stop_token token;
  cancel_on accepted;

  template <class Handler, class Factory>
  void operator()(Handler&& handler, Factory factory) const {
    using State = typename op_state_for<std::decay_t<Handler>, signature_of_t<Factory>>::type;
    std::stop_token stop = token;
    std::unique_ptr<stop_forwarder> forward;
#if SHUTTLE_ASIO_HAS_CANCELLATION_SLOTS
    auto slot = net::get_associated_cancellation_slot(handler);
    if (slot.is_connected() && accepted != cancel_on::none) {
      std::stop_source src;
      slot.template emplace<slot_handler>(slot_handler{src, accepted});
      if (token.stop_possible()) forward = std::make_unique<stop_forwarder>(token, forward_stop{src});
      stop = src.get_token();
    }
#endif
    const bool direct = shuttle_loop_of(net::get_associated_executor(handler, executor(*loop, nullptr))) == loop;
    const bool here = loop->running_in_this_thread();
    launch l;
    pending_work<std::decay_t<Handler>> work(handler, *loop, direct);
    op_coro op = run_op<Factory, State>(
        State{std::forward<Handler>(handler), loop, here ? &l : nullptr, direct, false, std::nullopt,
              std::move(forward), std::move(work)},
        std::move(factory));
    op.promise().stop = std::move(stop);
    if (here) {
      op.release().resume();
      if (l.slot) *l.slot = nullptr;  // still running: it completes from the loop
    } else {
      detail::post_remote(*loop, [h = op.release()] { h.resume(); });
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
