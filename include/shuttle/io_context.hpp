// io_context: one event loop per thread, built on one io_uring. It owns every
// completion source of its thread: io_uring operations (sockets, timers,
// signals, fds of RDMA completion channels and rdma_cm), busy-polled sources
// registered as pollers, coroutines posted locally and work posted from other
// threads.
//
// Submissions are batched: operations fill SQEs while the loop runs ready
// coroutines, and one io_uring_enter submits them and waits. One turn of the
// loop, and the two ways a coroutine is resumed: docs/architecture.md.
#pragma once

#include <atomic>
#include <chrono>
#include <coroutine>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <stop_token>
#include <thread>
#include <vector>

#include <liburing.h>

#include <shuttle/detail/driver.hpp>
#include <shuttle/detail/io_op.hpp>
#include <shuttle/detail/registered_buffer.hpp>
#include <shuttle/detail/registered_file.hpp>
#include <shuttle/detail/uring_backend.hpp>
#include <shuttle/poller.hpp>
#include <shuttle/result.hpp>
#include <shuttle/task.hpp>

namespace shuttle {

class io_context : private detail::uring_backend {
 public:
  struct options {
    unsigned sq_entries = 1024;  // CQ is four times larger
    // How long the loop keeps busy-polling its pollers after the last one
    // that did work, before it arms them and sleeps in the ring.
    std::chrono::nanoseconds spin_budget = std::chrono::microseconds(50);
    // How long the loop keeps polling the ring itself (io_uring_get_events,
    // no sleep) and every poller after the last completion (the ring's, or
    // work a poller did), pollers or not. A sleeping loop pays a wake-up
    // per completion; latency-bound users that can spare a core (a
    // ping-pong over the tcp provider, or over the local provider's rings,
    // which are pollers that do not spin by themselves) set this. 0: sleep
    // as soon as nothing is ready. Figures: docs/measurements.md.
    std::chrono::nanoseconds ring_spin_budget{0};
    // Slots in the ring's registered-file table, made on the first
    // register_file() and capped by RLIMIT_NOFILE. 0: none (register_file
    // fails with ENFILE).
    unsigned registered_files = 4096;
    // Slots in the ring's registered-buffer table, made on the first
    // register_buffer(). 0: none (register_buffer fails with ENFILE).
    unsigned registered_buffers = 64;
  };

  io_context();
  explicit io_context(options opts);
  ~io_context();
  io_context(const io_context&) = delete;
  io_context& operator=(const io_context&) = delete;

  // The context of the calling thread (one per thread). Throws if none.
  // Out of line, like running_in_this_thread: a thread_local read inlined
  // into a coroutine may be reused across a hop to another thread.
  static io_context& current();
  static io_context* current_or_null() noexcept;

  // Runs the loop until `t` completes (stop() does not end it); returns its
  // value or rethrows.
  template <class T>
  T run(task<T> t);
  template <awaitable A>
  await_result_t<A> run(A a) {
    return run(as_task(std::move(a)));
  }
  // Runs the loop until stop() is called.
  void run();
  // Thread-safe: makes run() return at its next iteration.
  void stop() noexcept;

  // co_await ctx.schedule(): continue on this context's thread (from any thread).
  class schedule_awaitable;
  schedule_awaitable schedule() noexcept;

  // Loop thread only: resume `h` on a later turn of the loop.
  void post(std::coroutine_handle<> h) { ready_.push_back(h); }
  // Any thread: run a callable on the loop (allocates).
  void dispatch(std::function<void()> fn);
  // Any thread: queue an intrusive remote operation.
  void post_remote(detail::remote_op* op) noexcept;

  // Out of line on purpose: pthread_self() is declared const, so a compiler may
  // reuse one thread identity across a coroutine's suspension points, and a
  // coroutine that hops threads would see the old one (clang 14 does).
  bool running_in_this_thread() const noexcept;

  // The calls for code that builds operations and completion sources on
  // this loop (SQEs, cancellation, the ring, orphans, pollers):
  // detail/uring_backend.hpp.
  detail::uring_backend& backend() noexcept { return *this; }

  // Loop thread only. Puts `fd` in a free slot of the ring's file table
  // (tcp_socket::register_file uses it); the slot holds a reference to the
  // file until unregister_file. Errors: ENFILE when the table is full;
  // the kernel's when it has no sparse tables (before 5.19).
  result<detail::registered_file> register_file(int fd);
  // Loop thread only: empties the slot (the file's last reference may go).
  void unregister_file(detail::registered_file& f) noexcept;

  // Loop thread only. Registers `buf` as a fixed buffer of the ring (the
  // kernel pins its pages, counted against RLIMIT_MEMLOCK without
  // CAP_IPC_LOCK); reads and writes that name its index
  // (io_uring_prep_read_fixed) must stay inside it. Errors: EINVAL for an
  // empty buffer or one over 1 GiB; ENFILE when the table is full; the
  // kernel's (ENOMEM past the memlock limit, EFAULT for memory it cannot
  // pin, EOPNOTSUPP/EINVAL before 5.19's sparse tables).
  result<detail::registered_buffer> register_buffer(std::span<std::byte> buf);
  // Loop thread only: empties the slot (a buffer of another or a dead
  // context is left alone).
  void unregister_buffer(detail::registered_buffer& b) noexcept;

  // Loop thread only. Work that must end before this context goes, such
  // as a provider's wind-down (a dropped connection's loops, a listener's
  // handshakes, a queue pair's flushed work requests): each piece holds
  // the context while it runs. ~io_context runs the loop until none is
  // held, so that nothing of it outlives the context; a holder must be
  // stopped already and end by itself, promptly.
  void hold() noexcept { ++holds_; }
  void release() noexcept {
    if (--holds_ == 0) released_ = true;
  }
  std::size_t holds() const noexcept { return holds_; }

  // Loop thread only: changes options::ring_spin_budget.
  void set_ring_spin_budget(std::chrono::nanoseconds budget) noexcept { opts_.ring_spin_budget = budget; }
  std::chrono::nanoseconds ring_spin_budget() const noexcept { return opts_.ring_spin_budget; }

  // Statistics, for tests and benchmarks.
  std::uint64_t submitted_sqes() const noexcept { return sqes_; }
  std::uint64_t loop_sleeps() const noexcept { return sleeps_; }

 private:
  template <class T>
  struct root_state;
  template <class T>
  static detail::driver run_root(task<T> t, root_state<T>& st);

  void run_until(const bool& done, bool stoppable);
  void run_ready();
  bool drain_remote();
  bool poll_pollers();
  bool enter_interrupt_mode();
  void exit_interrupt_mode();
  unsigned reap();
  // Steps of run_until, inlined into it (defined in io_context.cpp only).
  [[gnu::always_inline]] inline bool poll_ring(bool enter_anyway);
  [[gnu::always_inline]] inline void wait_in_ring();
  void arm_wakeup();
  void wake() noexcept;
  static void on_wakeup(detail::io_op* op, int res, std::uint32_t flags) noexcept;

  std::thread::id thread_;
  options opts_;
  std::deque<std::coroutine_handle<>> ready_;

  std::mutex remote_mutex_;
  detail::remote_op* remote_head_ = nullptr;
  detail::remote_op* remote_tail_ = nullptr;
  std::atomic<bool> remote_pending_{false};
  std::atomic<bool> stop_requested_{false};

  int wake_fd_ = -1;
  std::uint64_t wake_buf_ = 0;
  struct wake_op : detail::io_op {
    io_context* owner = nullptr;
  };
  wake_op wake_op_{};

  std::shared_ptr<detail::file_table> files_;  // made by the first register_file
  std::vector<int> free_slots_;
  std::shared_ptr<detail::buffer_table> buffers_;  // made by the first register_buffer
  std::vector<int> free_buffer_slots_;
  std::size_t holds_ = 0;
  bool released_ = false;  // holds_ went back to 0 (what ~io_context runs the loop until)
  std::uint64_t sleeps_ = 0;
  // The kernel flags pending completion work in the ring (IORING_SQ_TASKRUN):
  // a busy turn enters the kernel only when there is something to do.
  bool taskrun_flag_ = false;
};

class io_context::schedule_awaitable : private detail::remote_op {
 public:
  explicit schedule_awaitable(io_context& ctx) noexcept : ctx_(ctx) {}
  bool await_ready() const noexcept { return false; }
  void await_suspend(std::coroutine_handle<> h) noexcept {
    waiter_ = h;
    if (ctx_.running_in_this_thread()) {
      ctx_.post(h);  // yield: resume on a later turn
    } else {
      run = [](remote_op* self) noexcept {
        static_cast<schedule_awaitable*>(self)->waiter_.resume();
      };
      ctx_.post_remote(this);
    }
  }
  void await_resume() const noexcept {}

 private:
  io_context& ctx_;
  std::coroutine_handle<> waiter_{};
};

inline io_context::schedule_awaitable io_context::schedule() noexcept {
  return schedule_awaitable{*this};
}

// co_await yield(): let other ready coroutines and completions run.
inline io_context::schedule_awaitable yield() { return io_context::current().schedule(); }

template <class T>
struct io_context::root_state : detail::remote_op {
  std::optional<std::conditional_t<std::is_void_v<T>, bool, T>> value;
  std::exception_ptr error;
  io_context* ctx = nullptr;
  bool done = false;

  // The task may finish on another thread (it hopped there): the loop that
  // runs it learns of it through its remote queue.
  static std::coroutine_handle<> finish(void* arg) noexcept {
    auto* st = static_cast<root_state*>(arg);
    if (st->ctx->running_in_this_thread()) {
      st->done = true;
    } else {
      st->run = [](detail::remote_op* r) noexcept { static_cast<root_state*>(r)->done = true; };
      st->ctx->post_remote(st);
    }
    return std::noop_coroutine();
  }
};

template <class T>
detail::driver io_context::run_root(task<T> t, root_state<T>& st) {
  try {
    if constexpr (std::is_void_v<T>) {
      co_await std::move(t);
      st.value.emplace(true);
    } else {
      st.value.emplace(co_await std::move(t));
    }
  } catch (...) {
    st.error = std::current_exception();
  }
}

template <class T>
T io_context::run(task<T> t) {
  root_state<T> st;
  st.ctx = this;
  detail::driver d = run_root(std::move(t), st);
  d.on_done(&root_state<T>::finish, &st, false);
  d.start();
  run_until(st.done, false);
  if (st.error) std::rethrow_exception(st.error);
  if constexpr (!std::is_void_v<T>) return std::move(*st.value);
}

// Runs `t` to completion on the calling thread's io_context (made for the
// call if the thread has none).
template <class T>
T sync_wait(task<T> t) {
  if (auto* ctx = io_context::current_or_null()) return ctx->run(std::move(t));
  io_context ctx;
  return ctx.run(std::move(t));
}

}  // namespace shuttle
