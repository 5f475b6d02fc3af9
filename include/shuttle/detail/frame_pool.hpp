// Coroutine frames recycled per thread: a task's frame is allocated when it
// is called and freed when it finishes, once per operation on the hot paths
// (a send, a receive, the provider's step below them). A per-thread cache of
// freed blocks, by size class, turns that malloc/free pair into a few loads
// and stores. Blocks may be freed on another thread than the one that
// allocated them (they then join that thread's cache); each cache is
// bounded, and returns its blocks to the heap when its thread exits.
// Sanitizer builds use the heap directly, so that use-after-free in a
// coroutine frame stays visible.
#pragma once

#include <cstddef>

namespace shuttle::detail {

void* allocate_task_frame(std::size_t size);
void free_task_frame(void* p, std::size_t size) noexcept;

}  // namespace shuttle::detail
