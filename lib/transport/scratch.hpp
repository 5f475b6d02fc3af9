// Large per-list arrays (a block list's operations, a batch's work
// requests) kept from one list to the next on a thread. glibc gives a
// freed block of some MiB back to the kernel, so the next list of that
// size faults every page in again: about 1,000 minor faults for each
// 18,880-block list on the verbs provider, some 60% of its post path in
// the Soft-RoCE guest (docs/measurements.md, 2026-12-07).
#pragma once

#include <cstddef>
#include <new>
#include <utility>
#include <vector>

namespace shuttle::detail {

// Blocks of at least min_bytes are kept when freed, at most max_blocks of
// them and max_bytes in all per thread (given back at the thread's end);
// smaller ones are plain operator new's.
struct scratch_cache {
  static constexpr std::size_t min_bytes = 128 << 10, max_bytes = 32 << 20, max_blocks = 8;
  static void* take(std::size_t bytes);
  static void give(void* p, std::size_t bytes) noexcept;
  // This thread's kept blocks and their bytes.
  static std::size_t kept_count() noexcept;
  static std::size_t kept_bytes() noexcept;
};

// Element types whose scratch arrays start uninitialized (`vector(n)`
// default-initializes them): every user writes each element it hands on.
// A list's work requests: zeroing 128 bytes per block, some MiB a list,
// for fields that are then written anyway.
template <class T>
inline constexpr bool scratch_uninitialized = false;

template <class T>
struct scratch_allocator {
  static_assert(alignof(T) <= alignof(std::max_align_t));
  using value_type = T;
  scratch_allocator() noexcept = default;
  template <class U>
  scratch_allocator(const scratch_allocator<U>&) noexcept {}
  T* allocate(std::size_t n) { return static_cast<T*>(scratch_cache::take(n * sizeof(T))); }
  void deallocate(T* p, std::size_t n) noexcept { scratch_cache::give(p, n * sizeof(T)); }
  template <class U, class... A>
  void construct(U* p, A&&... a) {
    if constexpr (sizeof...(A) == 0 && scratch_uninitialized<U>)
      ::new (static_cast<void*>(p)) U;
    else
      ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
  }
  friend bool operator==(scratch_allocator, scratch_allocator) noexcept { return true; }
};

template <class T>
using scratch_vector = std::vector<T, scratch_allocator<T>>;

}  // namespace shuttle::detail
