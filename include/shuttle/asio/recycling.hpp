// Memory for the interop's operation frames, as Asio allocates its own:
//
//  - a frame is allocated with the completion handler's associated allocator
//    when it has one (asio::bind_allocator, a handler's allocator_type);
//  - otherwise (std::allocator, the common case) from a small per-thread
//    cache of recently freed frames, like Asio's recycling allocator, so a
//    steady stream of operations allocates nothing;
//  - a frame is freed before its handler is called (Asio's rule), so the next
//    operation the handler starts reuses it.
//
// with_asio_thread makes Asio's own per-thread recycling (the frames of
// asio::awaitable coroutines, type-erased executor functions) work on a
// shuttle loop's thread: Asio recycles only while a thread runs inside one of
// its execution contexts (it finds the per-thread cache on its "thread call
// stack"); shuttle's loop is not one, so without this every use_awaitable
// operation allocated and freed its initiation frame through operator new.
// It pushes a per-thread cache when nothing is on that stack (an
// asio::io_context's run/poll pushes its own). It uses Asio internals
// (detail::call_stack, thread_context, thread_info_base; as used here they
// are the same in Boost 1.74 and 1.81, both tested).
#pragma once

#include <shuttle/asio/config.hpp>

#include <coroutine>
#include <cstddef>
#include <exception>
#include <memory>
#include <new>
#include <stop_token>
#include <type_traits>
#include <utility>

#include <boost/asio/associated_allocator.hpp>
#include <boost/asio/detail/call_stack.hpp>
#include <boost/asio/detail/thread_context.hpp>
#include <boost/asio/detail/thread_info_base.hpp>

namespace shuttle::asio::detail {

// ---------------------------------------------------------------- Asio's per-thread cache

struct asio_thread {
  using stack = net::detail::call_stack<net::detail::thread_context, net::detail::thread_info_base>;
  // A key no Asio context compares equal to: Asio's running_in_this_thread
  // checks look for their own scheduler on the stack, never for this one.
  static net::detail::thread_context& key() noexcept {
    static net::detail::thread_context k;
    return k;
  }
  static net::detail::thread_info_base& info() noexcept {
    thread_local net::detail::thread_info_base i;
    return i;
  }
};

// Calls f() with Asio's per-thread cache reachable.
template <class F>
decltype(auto) with_asio_thread(F&& f) {
  if (asio_thread::stack::top() != nullptr) return std::forward<F>(f)();
  asio_thread::stack::context ctx(&asio_thread::key(), asio_thread::info());
  return std::forward<F>(f)();
}

// ---------------------------------------------------------------- frame memory

// Every frame is preceded by a 16-byte prefix: how to free it.
struct frame_prefix {
  void (*release)(void* frame, std::size_t frame_size) noexcept;
  std::size_t capacity;  // recycled frames: usable bytes of the block
};
inline constexpr std::size_t frame_prefix_size = 16;
static_assert(sizeof(frame_prefix) <= frame_prefix_size);
static_assert(frame_prefix_size % __STDCPP_DEFAULT_NEW_ALIGNMENT__ == 0);

inline frame_prefix* prefix_of(void* frame) noexcept {
  return reinterpret_cast<frame_prefix*>(static_cast<std::byte*>(frame) - frame_prefix_size);
}

// The per-thread cache: a few free blocks, any size class (frames of one
// program come in a handful of sizes). The state is trivially destructible
// (usable until the thread is gone); a separate object frees the blocks at
// thread exit.
struct frame_cache_state {
  static constexpr int slots = 4;
  void* free[slots];
  bool dead;
};
inline thread_local frame_cache_state frame_cache_tls{};

class frame_cache {
 public:
  static constexpr std::size_t granule = 64;

  static void* allocate(std::size_t n) {
    frame_cache_state& c = frame_cache_tls;
    for (void*& b : c.free) {
      if (b && static_cast<frame_prefix*>(b)->capacity >= n) {
        void* r = static_cast<std::byte*>(std::exchange(b, nullptr)) + frame_prefix_size;
        return r;
      }
    }
    if (!c.dead) {
      thread_local frame_cache reaper;  // registered on the thread's first miss
      (void)reaper;
    }
    std::size_t cap = (n + granule - 1) / granule * granule;
    void* b = ::operator new(frame_prefix_size + cap);
    auto* p = static_cast<frame_prefix*>(b);
    p->release = &release;
    p->capacity = cap;
    return static_cast<std::byte*>(b) + frame_prefix_size;
  }

  ~frame_cache() {
    frame_cache_state& c = frame_cache_tls;
    c.dead = true;  // frames freed later on this thread: plain delete
    for (void*& b : c.free) ::operator delete(std::exchange(b, nullptr));
  }

 private:
  frame_cache() = default;
  static void release(void* frame, std::size_t) noexcept {
    void* b = prefix_of(frame);
    frame_cache_state& c = frame_cache_tls;
    if (!c.dead) {
      for (void*& slot : c.free) {
        if (!slot) {
          slot = b;
          return;
        }
      }
    }
    ::operator delete(b);
  }
};

// A frame allocated with an allocator the handler carries: the allocator is
// kept in front of the frame, before the prefix.
template <class Alloc>
struct allocator_frame {
  struct alignas(16) unit {
    std::byte b[16];
  };
  using alloc_t = typename std::allocator_traits<Alloc>::template rebind_alloc<unit>;
  static constexpr std::size_t head = (sizeof(alloc_t) + 15) / 16 * 16 + frame_prefix_size;
  static std::size_t units(std::size_t n) noexcept { return (head + n + 15) / 16; }

  static void* allocate(const Alloc& a0, std::size_t n) {
    alloc_t a(a0);
    unit* u = std::allocator_traits<alloc_t>::allocate(a, units(n));
    auto* block = reinterpret_cast<std::byte*>(u);
    ::new (static_cast<void*>(block)) alloc_t(std::move(a));
    void* frame = block + head;
    prefix_of(frame)->release = &release;
    prefix_of(frame)->capacity = n;
    return frame;
  }
  static void release(void* frame, std::size_t n) noexcept {
    auto* block = static_cast<std::byte*>(frame) - head;
    auto* stored = std::launder(reinterpret_cast<alloc_t*>(block));
    alloc_t a(std::move(*stored));
    stored->~alloc_t();
    std::allocator_traits<alloc_t>::deallocate(a, reinterpret_cast<unit*>(block), units(n));
  }
};

template <class T>
struct is_std_allocator : std::false_type {};
template <class T>
struct is_std_allocator<std::allocator<T>> : std::true_type {};

template <class Handler>
void* allocate_frame(std::size_t n, const Handler& h) {
  using alloc = net::associated_allocator_t<Handler>;
  if constexpr (is_std_allocator<alloc>::value)
    return frame_cache::allocate(n);
  else
    return allocator_frame<alloc>::allocate(net::get_associated_allocator(h), n);
}
inline void free_frame(void* frame, std::size_t n) noexcept { prefix_of(frame)->release(frame, n); }

// ---------------------------------------------------------------- the operation coroutine

// A detached coroutine whose frame comes from allocate_frame (the first
// coroutine argument is the handler whose allocator is used) and which, at
// its end, frees its frame and then makes its upcall.
class op_coro {
 public:
  struct promise_type;
  using handle = std::coroutine_handle<promise_type>;
  // Called at the final suspension with the frame still alive: moves what it
  // needs out of the frame, destroys it (h.destroy()), then calls the handler.
  using upcall_fn = void (*)(void* arg, handle h) noexcept;

  struct promise_type {
    std::stop_token stop;
    upcall_fn upcall = nullptr;
    void* upcall_arg = nullptr;

    op_coro get_return_object() noexcept { return op_coro{handle::from_promise(*this)}; }
    std::suspend_always initial_suspend() const noexcept { return {}; }
    struct final_awaiter {
      bool await_ready() const noexcept { return false; }
      void await_suspend(handle h) noexcept {
        auto& p = h.promise();
        if (p.upcall)
          p.upcall(p.upcall_arg, h);
        else
          h.destroy();
      }
      void await_resume() const noexcept {}
    };
    final_awaiter final_suspend() const noexcept { return {}; }
    // Bodies catch everything themselves.
    void unhandled_exception() const noexcept { std::terminate(); }
    void return_void() const noexcept {}
    const std::stop_token& get_stop_token() const noexcept { return stop; }

    template <class First, class... Rest>
    static void* operator new(std::size_t n, First& first, Rest&...) {
      return allocate_frame(n, first);
    }
    static void operator delete(void* p, std::size_t n) noexcept { free_frame(p, n); }
  };

  explicit op_coro(handle h) noexcept : h_(h) {}
  op_coro(op_coro&& o) noexcept : h_(std::exchange(o.h_, {})) {}
  op_coro& operator=(op_coro&&) = delete;
  ~op_coro() {
    if (h_) h_.destroy();
  }
  promise_type& promise() const noexcept { return h_.promise(); }
  handle release() noexcept { return std::exchange(h_, {}); }

 private:
  handle h_;
};

}  // namespace shuttle::asio::detail
