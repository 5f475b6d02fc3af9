#include <shuttle/detail/frame_pool.hpp>

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

#if SHUTTLE_FRAME_POOL
namespace {

constexpr std::size_t granule = 64;         // size classes: 64, 128, ... bytes
constexpr std::size_t classes = 32;         // up to 2 KiB; larger frames use the heap
constexpr unsigned max_cached = 16;         // blocks kept per class and thread

struct free_block {
  free_block* next;
};

// Trivially destructible, so that reaching it costs no initialization
// guard; initial-exec: one thread-pointer-relative load (the library is
// linked, not dlopen'ed, in every supported use; the block is small).
struct frame_cache {
  free_block* head[classes];
  unsigned count[classes];
  bool cleanup_armed;
  bool gone;  // this thread is exiting: blocks go straight to the heap
};
[[gnu::tls_model("initial-exec")]] thread_local frame_cache cache{};

// Returns the cached blocks to the heap when the thread exits; armed the
// first time a block is cached.
struct frame_cache_cleanup {
  bool armed = false;
  ~frame_cache_cleanup() {
    for (std::size_t c = 0; c < classes; ++c)
      while (free_block* b = cache.head[c]) {
        cache.head[c] = b->next;
        ::operator delete(b);
      }
    cache.gone = true;
  }
};
thread_local frame_cache_cleanup cleanup;

[[gnu::noinline]] void arm_cleanup() noexcept {
  cleanup.armed = true;  // constructs it, which registers its destructor
  cache.cleanup_armed = true;
}

std::size_t class_of(std::size_t size) noexcept { return (size + granule - 1) / granule - 1; }

}  // namespace

void* allocate_task_frame(std::size_t size) {
  std::size_t c = class_of(size);
  if (c < classes) {
    if (free_block* b = cache.head[c]) {
      cache.head[c] = b->next;
      --cache.count[c];
      return b;
    }
    return ::operator new((c + 1) * granule);
  }
  return ::operator new(size);
}

void free_task_frame(void* p, std::size_t size) noexcept {
  std::size_t c = class_of(size);
  if (c < classes && cache.count[c] < max_cached && !cache.gone) {
    if (!cache.cleanup_armed) arm_cleanup();
    auto* b = static_cast<free_block*>(p);
    b->next = cache.head[c];
    cache.head[c] = b;
    ++cache.count[c];
    return;
  }
  ::operator delete(p);
}

#else

void* allocate_task_frame(std::size_t size) { return ::operator new(size); }
void free_task_frame(void* p, std::size_t) noexcept { ::operator delete(p); }

#endif

}  // namespace shuttle::detail
