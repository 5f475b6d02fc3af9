#include "scratch.hpp"

#include <array>
#include <new>

namespace shuttle::detail {

namespace {

// A large block starts with its usable size (a kept block may be handed
// out for a smaller request), then the caller's bytes, max_align_t-aligned.
constexpr std::size_t header = alignof(std::max_align_t) < sizeof(std::size_t) ? sizeof(std::size_t)
                                                                               : alignof(std::max_align_t);

// Trivially destructible, so that it is still there for a vector freed
// after the thread's destructors ran (a static object's, at exit): it is
// then `closed`, and blocks are simply deleted.
struct kept_blocks {
  struct block {
    std::byte* base = nullptr;
    std::size_t size = 0;  // usable bytes
  };
  std::array<block, scratch_cache::max_blocks> blocks{};
  std::size_t count = 0, bytes = 0;
  bool closed = false;
};
thread_local kept_blocks kept;

struct kept_release {
  ~kept_release() {
    for (std::size_t i = 0; i < kept.count; ++i) ::operator delete(kept.blocks[i].base);
    kept.count = kept.bytes = 0;
    kept.closed = true;
  }
};

}  // namespace

std::size_t scratch_cache::kept_count() noexcept { return kept.count; }
std::size_t scratch_cache::kept_bytes() noexcept { return kept.bytes; }

void* scratch_cache::take(std::size_t bytes) {
  if (bytes < min_bytes) return ::operator new(bytes);
  // The smallest kept block that holds it, if not more than twice as large.
  std::size_t best = kept.count;
  for (std::size_t i = 0; i < kept.count; ++i) {
    const std::size_t s = kept.blocks[i].size;
    if (s >= bytes && s / 2 <= bytes && (best == kept.count || s < kept.blocks[best].size)) best = i;
  }
  std::byte* base;
  if (best < kept.count) {
    base = kept.blocks[best].base;
    kept.bytes -= kept.blocks[best].size;
    kept.blocks[best] = kept.blocks[--kept.count];
  } else {
    base = static_cast<std::byte*>(::operator new(header + bytes));
    *reinterpret_cast<std::size_t*>(base) = bytes;
  }
  return base + header;
}

void scratch_cache::give(void* p, std::size_t bytes) noexcept {
  if (!p) return;
  if (bytes < min_bytes) return ::operator delete(p);
  std::byte* base = static_cast<std::byte*>(p) - header;
  const std::size_t size = *reinterpret_cast<std::size_t*>(base);
  if (!kept.closed && size <= max_bytes - kept.bytes) {
    static thread_local kept_release release;  // (from the first block kept on this thread on)
    (void)release;
    if (kept.count == max_blocks) {  // the smallest goes, if smaller than this one
      std::size_t small = 0;
      for (std::size_t i = 1; i < kept.count; ++i)
        if (kept.blocks[i].size < kept.blocks[small].size) small = i;
      if (kept.blocks[small].size >= size) return ::operator delete(base);
      kept.bytes -= kept.blocks[small].size;
      ::operator delete(kept.blocks[small].base);
      kept.blocks[small] = kept.blocks[--kept.count];
    }
    kept.blocks[kept.count++] = {base, size};
    kept.bytes += size;
    return;
  }
  ::operator delete(base);
}

}  // namespace shuttle::detail
