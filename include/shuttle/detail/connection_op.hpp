// The state of one connection operation, kept inside the awaiting
// coroutine's frame rather than in a frame of its own.
//
// connection::send() and its siblings return a connection_op: the arguments
// and a fixed block of storage. Awaiting it asks the provider to build the
// operation there (op_slot::emplace) and to start it; the provider's state
// type then suspends and resumes the awaiter itself, so the latency path of
// an operation allocates nothing and runs no coroutine of its own. A
// provider may instead hand over a task (op_slot::set_task: its slow paths,
// and the tcp provider), which is awaited as any task is.
#pragma once

#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <new>
#include <stop_token>
#include <type_traits>
#include <utility>

#include <shuttle/result.hpp>
#include <shuttle/task.hpp>

namespace shuttle {

namespace detail {

class connection_impl;

// Large enough for the verbs provider's posted work request (checked there).
inline constexpr std::size_t op_state_capacity = 320;

// A state type S provides:
//   bool start() noexcept;  true: finished already, the awaiter does not suspend
//   std::coroutine_handle<> suspend(std::coroutine_handle<> awaiter, std::stop_token);
//       what to resume now: std::noop_coroutine() to stay suspended until the
//       state resumes the awaiter, the awaiter itself to continue at once
//   result<T> take();       the outcome, once (after start() or the resumption)
template <class T>
class op_slot {
 public:
  op_slot() noexcept = default;
  op_slot(const op_slot&) = delete;
  op_slot& operator=(const op_slot&) = delete;
  ~op_slot() { reset(); }

  // Builds the state in place, replacing any earlier one.
  template <class S, class... A>
  S& emplace(A&&... a) {
    static_assert(sizeof(S) <= op_state_capacity, "op_state_capacity is too small for this state");
    static_assert(alignof(S) <= alignof(std::max_align_t));
    reset();
    S* s = ::new (static_cast<void*>(storage_)) S(std::forward<A>(a)...);
    vt_ = &vtable_of<S>;
    return *s;
  }
  // The operation is a task (awaited as a child: continuation and stop token).
  void set_task(task<result<T>> t) { emplace<task_state>(std::move(t)); }
  // The operation is over already: done when launched (an inline send),
  // bad arguments, a dead connection. Kept as a plain result, so that such
  // an operation makes no call through the table.
  void set_result(result<T> r) {
    static_assert(sizeof(result<T>) <= op_state_capacity);
    reset();
    ::new (static_cast<void*>(storage_)) result<T>(std::move(r));
    ready_ = true;
  }

  // The provider ends its state `s` (this slot's) early with the outcome:
  // an operation that completed while it was launched. start() and take()
  // then make no call through the table.
  template <class S>
  void settle(S& s, result<T> r) noexcept {
    s.~S();
    vt_ = nullptr;
    ::new (static_cast<void*>(storage_)) result<T>(std::move(r));
    ready_ = true;
  }

  bool start() noexcept { return ready_ || vt_->start(storage_); }
  // Only after start() returned false.
  std::coroutine_handle<> suspend(std::coroutine_handle<> h, std::stop_token t) {
    return vt_->suspend(storage_, h, std::move(t));
  }
  result<T> take() { return ready_ ? std::move(*ready_result()) : vt_->take(storage_); }

 private:
  struct vtable {
    bool (*start)(void*) noexcept;
    std::coroutine_handle<> (*suspend)(void*, std::coroutine_handle<>, std::stop_token);
    result<T> (*take)(void*);
    void (*destroy)(void*) noexcept;
  };
  template <class S>
  static constexpr vtable vtable_of = {
      [](void* p) noexcept { return static_cast<S*>(p)->start(); },
      [](void* p, std::coroutine_handle<> h, std::stop_token t) {
        return static_cast<S*>(p)->suspend(h, std::move(t));
      },
      [](void* p) { return static_cast<S*>(p)->take(); },
      [](void* p) noexcept { static_cast<S*>(p)->~S(); },
  };

  struct task_state {
    task<result<T>> t;
    explicit task_state(task<result<T>> tt) noexcept : t(std::move(tt)) {}
    bool start() noexcept { return false; }
    std::coroutine_handle<> suspend(std::coroutine_handle<> h, std::stop_token token) noexcept {
      auto child = t.handle();
      child.promise().set_continuation(h);
      child.promise().set_stop_token(std::move(token));
      return child;
    }
    result<T> take() { return t.handle().promise().take(); }
  };
  result<T>* ready_result() noexcept { return std::launder(reinterpret_cast<result<T>*>(storage_)); }
  void reset() noexcept {
    if (ready_) {
      ready_result()->~result<T>();
      ready_ = false;
    } else if (vt_) {
      std::exchange(vt_, nullptr)->destroy(storage_);
    }
  }

  const vtable* vt_ = nullptr;
  bool ready_ = false;  // storage_ holds a result<T> (set_result), no state
  alignas(std::max_align_t) std::byte storage_[op_state_capacity];
};

// What a connection operation was called with (each uses some of it).
struct op_args {
  std::byte* data = nullptr;  // local memory (read: written)
  std::size_t size = 0;
  std::uint64_t address = 0;  // remote_buffer, flattened (transport.hpp defines it after this header)
  std::uint32_t rkey = 0;
  std::uint32_t imm = 0;
  std::uint64_t length = 0;
  std::uint64_t a = 0, b = 0;  // atomics' operands
};

// The provider's state of a prepared operation (connection::prepare): its
// arguments resolved once, then started any number of times, one start at
// a time. Each start is driven as an op_slot state: start() posts and says
// how far it got, suspend() waits (what to resume now, as op_slot's),
// take() yields the outcome once. The two flags are the awaiter's
// (transport.hpp: prepared_operation).
class prepared_impl {
 public:
  enum class start_result : std::uint8_t {
    not_started,  // the awaiter's own: the start was refused (empty, or one in flight)
    pending,      // suspend() waits for it
    over,         // take() yields the outcome
    succeeded,    // over and succeeded, with nothing to take: a start that completed at once
  };
  virtual ~prepared_impl() = default;
  virtual start_result start() noexcept = 0;
  virtual std::coroutine_handle<> suspend(std::coroutine_handle<> awaiter, std::stop_token token) = 0;
  virtual result<void> take() = 0;
  bool in_flight = false;  // a start is being awaited
  bool orphaned = false;   // its prepared_operation is gone: the awaiter deletes it after take()
};

// A provider's entry for one single operation (transport.hpp: launch_table):
// builds the operation in `out`. `c` is null for a connection without a
// provider.
template <class T>
using launch_fn = void (*)(connection_impl* c, const op_args& a, op_slot<T>& out);

}  // namespace detail

// What connection::send(), recv(), write(), write_with_imm(), read(),
// compare_and_swap() and fetch_and_add() return: an awaitable that yields
// result<T> (co_await it once). Lazy like a task: nothing happens until it
// is awaited, and the arguments (spans included) must stay valid until
// then. It converts to task<result<T>> (when_all, with_timeout and
// when_any take it directly). Movable until it is awaited, not after.
template <class T>
class [[nodiscard]] connection_op {
 public:
  connection_op(detail::connection_impl* impl, detail::launch_fn<T> launch, detail::op_args args) noexcept
      : impl_(impl), launch_(launch), args_(args) {}
  // Only before it is awaited: a started operation's state lives here.
  connection_op(connection_op&& o) noexcept : impl_(o.impl_), launch_(o.launch_), args_(o.args_) {}
  connection_op& operator=(connection_op&&) = delete;

  // Inlined into the awaiting coroutine (compilers seldom inline into one):
  // a call less on every operation's path.
  [[gnu::always_inline]] bool await_ready() {
    launch_(impl_, args_, slot_);
    return slot_.start();
  }
  template <class P>
  std::coroutine_handle<> await_suspend(std::coroutine_handle<P> h) {
    return slot_.suspend(h, detail::stop_token_of(h));
  }
  result<T> await_resume() { return slot_.take(); }

  operator task<result<T>>() && { return as_task(std::move(*this)); }  // NOLINT: implicit by design

 private:
  detail::connection_impl* impl_;  // null for a connection without a provider
  detail::launch_fn<T> launch_;
  detail::op_args args_;
  detail::op_slot<T> slot_;
};

}  // namespace shuttle
