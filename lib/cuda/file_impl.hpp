// gpu_file's state and its two engines (lib/cuda/file_uring.cpp,
// lib/cuda/file_cufile.cpp); gpu_file.cpp opens files and picks one.
#pragma once

#include <shuttle/cuda/cuda.hpp>
#include <shuttle/cuda/gpu_file.hpp>
#include <shuttle/detail/registered_buffer.hpp>
#include <shuttle/io_context.hpp>
#include <shuttle/sync.hpp>

#include <coroutine>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace shuttle::cuda {

namespace detail {

// Awaits `a` without the awaiting task's stop token: for waits that must
// finish before the operation may return (a copy out of a bounce buffer
// that is about to be reused, a GPU transfer into the caller's span).
//
// Not an aggregate on purpose: g++ 12 destroys the inner awaiter of
// `co_await unstoppable{cuda::wait(s)}` twice when `unstoppable` is an
// aggregate, so a stream_awaiter handed its pooled event back twice; the
// pool then held duplicates and, once full, destroyed events that it
// still held (cuEventRecord crashed on one). The constructor makes the
// inner awaiter a member built by a move, destroyed once.
template <class A>
struct unstoppable {
  explicit unstoppable(A&& x) noexcept : a(std::move(x)) {}
  A a;
  bool await_ready() { return a.await_ready(); }
  bool await_suspend(std::coroutine_handle<> h) { return a.await_suspend(h); }
  decltype(auto) await_resume() { return a.await_resume(); }
};
template <class A>
unstoppable(A&&) -> unstoppable<A>;

// Pinned host memory (mmap'd, cudaHostRegister'ed) cut into `depth`
// buffers of `chunk` bytes, registered with the ring as one fixed buffer
// when the kernel allows, and a copy stream per buffer.
struct bounce_pool {
  io_context* ctx = nullptr;
  std::byte* mem = nullptr;
  std::size_t chunk = 0;
  unsigned depth = 0;
  bool host_registered = false;
  shuttle::detail::registered_buffer fixed;  // index -1: plain reads and writes
  std::vector<stream> streams;
  std::string note;
  std::byte* buffer(unsigned k) const noexcept { return mem + static_cast<std::size_t>(k) * chunk; }
  static result<std::unique_ptr<bounce_pool>> make(io_context& ctx, std::size_t chunk, unsigned depth);
  bounce_pool() = default;
  bounce_pool(const bounce_pool&) = delete;
  bounce_pool& operator=(const bounce_pool&) = delete;
  ~bounce_pool();
};

}  // namespace detail

struct gpu_file::impl {
  io_context* ctx = nullptr;
  int fd = -1;   // buffered
  int dfd = -1;  // O_DIRECT; -1 where refused or not asked for
  bool writable = false;
  file_options opts;
  file_engine engine = file_engine::uring;
  std::string note;          // the engine and its mode
  std::string direct_note;   // why reads are buffered, when they are
  std::size_t align = 4096;  // O_DIRECT offsets and lengths
  void* cufile_handle = nullptr;
  std::optional<stream> cufile_stream;
  std::unique_ptr<detail::bounce_pool> pool;
  shuttle::mutex busy;
  impl() = default;
  impl(const impl&) = delete;
  impl& operator=(const impl&) = delete;
  ~impl();
};

namespace detail {
task<result<std::size_t>> uring_read(gpu_file::impl& f, std::span<std::byte> gpu, std::uint64_t offset);
task<result<std::size_t>> uring_write(gpu_file::impl& f, std::span<const std::byte> gpu, std::uint64_t offset);
// Registers the file with cuFile; false with the reason in `why`.
bool cufile_attach(gpu_file::impl& f, std::string& why);
void cufile_detach(gpu_file::impl& f) noexcept;
task<result<std::size_t>> cufile_read(gpu_file::impl& f, std::span<std::byte> gpu, std::uint64_t offset);
task<result<std::size_t>> cufile_write(gpu_file::impl& f, std::span<const std::byte> gpu, std::uint64_t offset);
// EINVAL unless `p` is device or managed memory of a CUDA context.
std::error_code check_gpu_span(const void* p, std::size_t n) noexcept;
}  // namespace detail

}  // namespace shuttle::cuda
