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

struct frame_cache {
  free_block* head[classes] = {};
  unsigned count[classes] = {};
  ~frame_cache() {
    for (std::size_t c = 0; c < classes; ++c)
      while (free_block* b = head[c]) {
        head[c] = b->next;
        ::operator delete(b);
      }
    gone = true;
  }
  static thread_local bool gone;  // trivially destructible: readable after ~frame_cache
};
thread_local bool frame_cache::gone = false;
thread_local frame_cache cache;

std::size_t class_of(std::size_t size) noexcept { return (size + granule - 1) / granule - 1; }

}  // namespace

void* allocate_task_frame(std::size_t size) {
  std::size_t c = class_of(size);
  if (c < classes && !frame_cache::gone) {
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
  if (c < classes && !frame_cache::gone && cache.count[c] < max_cached) {
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
