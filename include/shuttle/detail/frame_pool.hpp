// Coroutine frames recycled per thread: a task's frame is allocated when it
// is called and freed when it finishes, once per operation on the hot paths
// (a send, a receive, the provider's step below them). A per-thread cache of
// freed blocks, by size class, turns that malloc/free pair into a few loads
// and stores, inline here (a call into the library per frame costs more than
// the cache itself). Blocks may be freed on another thread than the one that
// allocated them (they then join that thread's cache); each cache is
// bounded, and returns its blocks to the heap when its thread exits.
// Sanitizer builds use the heap directly, so that use-after-free in a
// coroutine frame stays visible.
#pragma once

#include <cstddef>
#include <new>

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#  define SHUTTLE_FRAME_POOL 0
#elif defined(__has_feature)
#  if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#    define SHUTTLE_FRAME_POOL 0
#  endif
#endif
#ifndef SHUTTLE_FRAME_POOL
#  define SHUTTLE_FRAME_POOL 1
#endif

namespace shuttle::detail {

struct frame_cache {
  static constexpr std::size_t granule = 64;  // size classes: 64, 128, ... bytes
  static constexpr std::size_t classes = 32;  // up to 2 KiB; larger frames use the heap
  static constexpr unsigned max_cached = 16;  // blocks kept per class and thread
  struct free_block {
    free_block* next;
  };
  free_block* head[classes];
  unsigned count[classes];
  bool cleanup_armed;  // the thread-exit cleanup is registered: blocks may be cached
  bool gone;           // this thread is exiting: blocks go straight to the heap

  static std::size_t class_of(std::size_t size) noexcept { return (size + granule - 1) / granule - 1; }
  bool has_room(std::size_t c) const noexcept { return c < classes && count[c] < max_cached && !gone; }
  void push(std::size_t c, void* p) noexcept {
    auto* b = static_cast<free_block*>(p);
    b->next = head[c];
    head[c] = b;
    ++count[c];
  }
};

// Trivially destructible and constant-initialized, so that reaching it costs
// no guard; initial-exec: one thread-pointer-relative load (libshuttle is
// linked, not dlopen'ed, in every supported use; the block is small).
extern constinit thread_local frame_cache task_frame_cache __attribute__((tls_model("initial-exec")));

// The paths that leave the cache (lib/frame_pool.cpp).
void* allocate_task_frame_slow(std::size_t size);
void free_task_frame_slow(void* p, std::size_t size) noexcept;

#if SHUTTLE_FRAME_POOL
inline void* allocate_task_frame(std::size_t size) {
  frame_cache& cache = task_frame_cache;
  const std::size_t c = frame_cache::class_of(size);
  if (c < frame_cache::classes) {
    if (frame_cache::free_block* b = cache.head[c]) {
      cache.head[c] = b->next;
      --cache.count[c];
      return b;
    }
  }
  return allocate_task_frame_slow(size);
}

inline void free_task_frame(void* p, std::size_t size) noexcept {
  frame_cache& cache = task_frame_cache;
  const std::size_t c = frame_cache::class_of(size);
  if (cache.cleanup_armed && cache.has_room(c)) {
    cache.push(c, p);
    return;
  }
  free_task_frame_slow(p, size);
}
#else
inline void* allocate_task_frame(std::size_t size) { return ::operator new(size); }
inline void free_task_frame(void* p, std::size_t) noexcept { ::operator delete(p); }
#endif

}  // namespace shuttle::detail
