#include <shuttle/detail/frame_pool.hpp>

#include <new>

namespace shuttle::detail {

constinit thread_local frame_cache task_frame_cache __attribute__((tls_model("initial-exec"))) = {};

namespace {

// Returns the cached blocks to the heap when the thread exits; armed the
// first time a block is to be cached.
struct frame_cache_cleanup {
  bool armed = false;
  ~frame_cache_cleanup() {
    frame_cache& cache = task_frame_cache;
    for (std::size_t c = 0; c < frame_cache::classes; ++c)
      while (frame_cache::free_block* b = cache.head[c]) {
        cache.head[c] = b->next;
        ::operator delete(b);
      }
    cache.gone = true;
  }
};
thread_local frame_cache_cleanup cleanup;

}  // namespace

// Sized for its class: a block can be cached later whatever frame had it.
void* allocate_task_frame_slow(std::size_t size) {
  const std::size_t c = frame_cache::class_of(size);
  if (c < frame_cache::classes) return ::operator new((c + 1) * frame_cache::granule);
  return ::operator new(size);
}

void free_task_frame_slow(void* p, std::size_t size) noexcept {
  frame_cache& cache = task_frame_cache;
  const std::size_t c = frame_cache::class_of(size);
  if (cache.has_room(c)) {
    if (!cache.cleanup_armed) {
      cleanup.armed = true;  // constructs it, which registers its destructor
      cache.cleanup_armed = true;
    }
    cache.push(c, p);
    return;
  }
  ::operator delete(p);
}

}  // namespace shuttle::detail
