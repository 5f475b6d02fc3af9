// Files read into and written from GPU memory, awaited in the io_context:
//
//   auto f = cuda::gpu_file::open("/data/weights.bin").value();
//   auto n = co_await f.read_into(gpu_span, offset);   // result<size_t>
//   auto w = co_await f.write_from(gpu_span, offset);  // result<size_t>
//
// Two engines, chosen when the file is opened (file_options::engine, by
// default from SHUTTLE_FILE_ENGINE=auto|uring|cufile); engine() says which
// one the file got and note() why (docs/gpu-file.md):
//
//  - uring: O_DIRECT reads into pinned bounce buffers registered with the
//    ring (fixed buffers), `depth` chunks in flight; each chunk is copied
//    to the GPU (cudaMemcpyAsync on its own stream, awaited through the
//    loop) as soon as it lands, while the others are still being read.
//    Where the file system refuses O_DIRECT the same path reads buffered
//    and note() says so.
//  - cufile: NVIDIA's cuFile (libcufile, opened with dlopen at run time),
//    its stream API (cuFileReadAsync) on a stream whose events the loop
//    awaits: true GPUDirect Storage with the nvidia-fs module, its
//    compatibility mode without it (when enabled; otherwise the file
//    falls back to uring and note() says why).
//
// auto picks cufile only where nvidia-fs is loaded, uring elsewhere.
//
// Reads end at the end of the file: read_into returns the bytes that were
// there (fewer than asked for a short or truncated file). Both operations
// follow the awaiting task's stop token and then yield
// std::errc::operation_canceled, after every transfer already handed to
// the kernel or the GPU has finished (nothing writes the span, or reads
// it, after they return). GPU memory is the current device's; a span that
// is not device (or managed) memory yields std::errc::invalid_argument.
// One gpu_file belongs to the thread that opened it; its operations run
// one at a time (a second waits for the first).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include <shuttle/result.hpp>
#include <shuttle/task.hpp>

namespace shuttle::cuda {

enum class file_engine { uring, cufile };
const char* to_string(file_engine e) noexcept;

struct file_options {
  enum class engine_choice { from_env, automatic, uring, cufile };
  engine_choice engine = engine_choice::from_env;
  // uring: read and write with O_DIRECT where the file system allows it.
  bool direct = true;
  // uring: the bounce buffers, `depth` of `chunk_size` bytes each (a
  // multiple of 4 KiB), pinned and registered on the first transfer. Large
  // requests matter more than many (docs/gpu-file.md, the 2026-12-06 sweep).
  std::size_t chunk_size = std::size_t{16} << 20;
  unsigned depth = 4;
};

class gpu_file {
 public:
  gpu_file() noexcept;
  ~gpu_file();
  gpu_file(gpu_file&&) noexcept;
  gpu_file& operator=(gpu_file&&) noexcept;

  // Opens `path` read-only, or read-write (created if missing, mode 0644)
  // with `writable`. Loop thread of the calling thread's io_context.
  static result<gpu_file> open(const std::string& path, bool writable = false, file_options o = {});
  // Uses a file the caller opened: gpu_file works on its own descriptors
  // (reopened through /proc/self/fd, O_DIRECT where allowed), so `fd`
  // stays the caller's, unchanged.
  static result<gpu_file> from_fd(int fd, file_options o = {});

  task<result<std::size_t>> read_into(std::span<std::byte> gpu, std::uint64_t offset);
  task<result<std::size_t>> write_from(std::span<const std::byte> gpu, std::uint64_t offset);

  result<std::uint64_t> size() const;
  file_engine engine() const noexcept;
  // How this file is read and why: the engine, O_DIRECT or buffered (and
  // why), fixed buffers or not, cuFile's mode or the reason it was not used.
  std::string note() const;
  explicit operator bool() const noexcept { return static_cast<bool>(p_); }

  struct impl;

 private:
  explicit gpu_file(std::unique_ptr<impl> p) noexcept;
  static result<gpu_file> finish_open(std::unique_ptr<impl> p, const std::string& direct_path);
  std::unique_ptr<impl> p_;
};

// What SHUTTLE_FILE_ENGINE=auto would choose here, and each engine's
// state (for shuttle-info). Never throws.
std::string describe_file_engines();

}  // namespace shuttle::cuda
