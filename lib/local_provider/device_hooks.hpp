// GPU memory on the local provider (issue 30, point 2), without a CUDA
// dependency here: the CUDA layer (lib/cuda/local_hooks.cpp) installs this
// table when it is linked in, as it installs verbs::device_memory_hooks for
// the verbs provider. Without it, GPU memory is not recognised here: a
// peer's GPU region is refused (errc::not_supported) and local buffers are
// taken for host memory.
//
// What it does for the provider:
//  - tells device memory (the CPU must not touch it) from host memory;
//  - exports the allocation under a registration (a CUDA IPC handle, the
//    registration's offset in it), which the service channel's answer
//    carries (shared_kind::cuda_ipc);
//  - imports a peer's handle (cached per handle in the process, closed when
//    the last region using it goes);
//  - copies (cudaMemcpyAsync, any direction) on a per-connection queue (a
//    stream) and yields a task that the loop awaits (an event, polled as
//    cuda::wait does), not cancellable: the copy touches the buffers until
//    it is done, so the operation ends only then.
#pragma once

#include <shuttle/result.hpp>
#include <shuttle/task.hpp>

#include <array>
#include <cstddef>
#include <cstdint>

namespace shuttle::detail::local_provider {

// A CUDA IPC memory handle's bytes (cudaIpcMemHandle_t: 64 bytes).
inline constexpr std::size_t gpu_handle_size = 64;
using gpu_handle = std::array<std::byte, gpu_handle_size>;

struct device_hooks {
  // True when [p, p+len) is device memory the CPU cannot read (not managed).
  bool (*is_device)(const void* p, std::size_t len) noexcept = nullptr;
  // Exports the allocation that holds [p, p+len): its handle in `out`, and
  // p's offset in the allocation. errc::not_supported where the memory
  // cannot be exported (cuMemCreate memory, another process's import).
  result<std::uint64_t> (*export_handle)(const void* p, std::size_t len, gpu_handle& out) noexcept = nullptr;
  // Maps a peer's handle here: the allocation's base address and size.
  // The same handle imported twice is mapped once (counted).
  struct imported {
    std::byte* base = nullptr;
    std::size_t size = 0;
  };
  result<imported> (*import_handle)(const gpu_handle& h) noexcept = nullptr;
  // cuMemCreate memory (no IPC handle): a POSIX fd of the allocation that
  // holds [p, p+len) (cuMemExportToShareableHandle; the caller closes it),
  // the allocation's size, and p's offset in it. not_supported where the
  // allocation was not made exportable as an fd.
  result<std::uint64_t> (*export_fd)(const void* p, std::size_t len, int* fd, std::uint64_t* size) noexcept = nullptr;
  // Maps a peer's allocation of `size` bytes from its fd (which stays the caller's).
  result<imported> (*import_fd)(int fd, std::uint64_t size) noexcept = nullptr;
  // Drops one import of `base`, by handle or fd (closed with the last).
  void (*release_import)(std::byte* base) noexcept = nullptr;
  // A queue (stream) for a connection's copies, or null; closed at teardown.
  void* (*open_queue)() noexcept = nullptr;
  void (*close_queue)(void* q) noexcept = nullptr;
  // Enqueues a copy of n bytes on `q` now, and returns the task that awaits
  // its end (its error, if the copy or the enqueue failed).
  task<result<void>> (*copy)(void* q, void* dst, const void* src, std::size_t n) = nullptr;
};

// Installs `h` for every local domain (kept by pointer: a static object;
// null removes it). Returns the one installed before.
const device_hooks* set_device_hooks(const device_hooks* h) noexcept;
const device_hooks* installed_device_hooks() noexcept;

}  // namespace shuttle::detail::local_provider
