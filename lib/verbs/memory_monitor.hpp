// The process's memory monitor: tells registration caches when pages they
// registered go away (unmapped, moved by mremap, dropped by madvise), before
// the call that dropped them returns. Built on userfaultfd's non-cooperative
// events (UFFD_EVENT_UNMAP, REMOVE, REMAP), delivered for ranges registered
// in write-protect mode that are never write-protected: no fault of the
// process is ever handled here, only the events. The thread that unmaps
// waits in the kernel until the monitor's thread has read the event, and the
// monitor reads and applies events under its lock, so once munmap returns,
// whoever takes the lock sees the listeners told (docs/memory-registration.md).
//
// Only private anonymous memory is watched (the heap, the stack, anonymous
// mmaps): shared or file-backed pages can also go through calls that raise
// no event (shmdt, a hole punched in a memfd, a truncated file).
//
// Whatever runs under the lock must not allocate, free or block: a free()
// that trims a watched heap raises an event, and its thread then waits for
// the monitor, which waits for the lock.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <system_error>

namespace shuttle::detail::verbs_impl {

// Told, on the monitor's thread and under its lock, of [begin, end) whose
// pages went away. Must not allocate, free or block.
class unmap_listener {
 public:
  virtual void on_unmapped(std::uintptr_t begin, std::uintptr_t end) noexcept = 0;

 protected:
  ~unmap_listener() = default;

 private:
  friend class memory_monitor;
  unmap_listener* next_ = nullptr;  // the monitor's list: linking allocates nothing
  unmap_listener* prev_ = nullptr;
};

class memory_monitor {
 public:
  // The process's monitor, started on the first call; null where this
  // process cannot have one (unavailable_reason() says why: no userfaultfd,
  // not permitted, or a kernel without the events or anonymous
  // write-protect registration).
  static memory_monitor* instance() noexcept;
  static std::error_code unavailable_reason() noexcept;

  // False in a child of fork(): the monitor's thread and its userfaultfd
  // (bound to the parent's address space) stay with the parent, and the
  // child's mappings raise no event, so nothing may be cached there.
  static bool usable() noexcept { return !forked_; }

  // Watches the pages of [begin, end): every mapping overlapping them, whole,
  // so that watching never splits a mapping. errc::not_supported when part of
  // the range is not private anonymous memory, or is not mapped; the
  // kernel's errno when it refuses (EBUSY: another userfaultfd watches it).
  // Not under lock().
  std::error_code watch(std::uintptr_t begin, std::uintptr_t end);

  // Held while events are read and applied; listeners' state is guarded by it.
  std::mutex& lock() noexcept { return lock_; }
  // Events applied so far (under lock(), or as a hint without it): a
  // registration made while this moved may describe pages gone meanwhile.
  std::uint64_t events() const noexcept { return events_.load(std::memory_order_acquire); }

  // Under lock().
  void subscribe(unmap_listener& l) noexcept;
  void unsubscribe(unmap_listener& l) noexcept;

  memory_monitor(const memory_monitor&) = delete;
  memory_monitor& operator=(const memory_monitor&) = delete;

 private:
  memory_monitor() = default;
  ~memory_monitor() = default;  // never destroyed: its thread lives as long as the process
  static std::error_code start(memory_monitor& m) noexcept;
  static void* run(void* self) noexcept;
  void apply(std::uintptr_t begin, std::uintptr_t end) noexcept;

  static void on_fork_child() noexcept { forked_ = true; }
  static inline bool forked_ = false;  // set in the child (single-threaded then)

  int uffd_ = -1;
  std::mutex lock_;
  std::atomic<std::uint64_t> events_{0};
  unmap_listener* listeners_ = nullptr;
};

}  // namespace shuttle::detail::verbs_impl
