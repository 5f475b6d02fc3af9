// co_await counted_acquire(sem, waiters): a unit of `sem`, as sem.acquire()
// gives it, with `waiters` counting this task while it is parked. The
// counts say that an operation of ours waits in the engine: the local
// provider's direct accesses must not overtake it (RC order).
#pragma once

#include <coroutine>
#include <cstddef>

#include <shuttle/sync.hpp>

namespace shuttle::detail::tcp_provider {

class counted_acquire {
 public:
  counted_acquire(semaphore& sem, std::size_t& waiters) noexcept : inner_(sem), waiters_(waiters) {}
  bool await_ready() noexcept { return inner_.await_ready(); }
  template <class P>
  bool await_suspend(std::coroutine_handle<P> h) {
    ++waiters_;
    parked_ = inner_.await_suspend(h);
    if (!parked_) --waiters_;
    return parked_;
  }
  result<void> await_resume() noexcept {
    if (parked_) --waiters_;
    return inner_.await_resume();
  }

 private:
  semaphore::awaiter inner_;
  std::size_t& waiters_;
  bool parked_ = false;
};

}  // namespace shuttle::detail::tcp_provider
