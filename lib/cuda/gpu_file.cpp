// gpu_file: opening, the choice of engine, and the checks every transfer
// makes before it runs on one. The engines: file_uring.cpp, file_cufile.cpp.
#include "cufile_api.hpp"
#include "file_impl.hpp"

#include <shuttle/error.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>

namespace shuttle::cuda {

const char* to_string(file_engine e) noexcept {
  switch (e) {
    case file_engine::uring: return "uring";
    case file_engine::cufile: return "cufile";
  }
  return "?";
}

namespace detail {
std::error_code check_gpu_span(const void* p, std::size_t n) noexcept {
  if (n == 0) return {};
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return std::make_error_code(std::errc::invalid_argument);
  }
  if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged)
    return std::make_error_code(std::errc::invalid_argument);
  return {};
}

namespace {
file_options::engine_choice from_env(std::string& note) {
  const char* e = std::getenv("SHUTTLE_FILE_ENGINE");
  std::string v = e ? e : "";
  if (v.empty() || v == "auto") return file_options::engine_choice::automatic;
  if (v == "uring") return file_options::engine_choice::uring;
  if (v == "cufile") return file_options::engine_choice::cufile;
  note = "SHUTTLE_FILE_ENGINE=" + v + " not understood (auto|uring|cufile), auto; ";
  return file_options::engine_choice::automatic;
}

// Picks the engine of a file whose descriptors are open.
void choose(gpu_file::impl& f) {
  std::string prefix;
  auto c = f.opts.engine;
  if (c == file_options::engine_choice::from_env) c = from_env(prefix);
  std::string why;
  if (c == file_options::engine_choice::cufile ||
      (c == file_options::engine_choice::automatic && cufile::driver().ok && cufile::driver().nvfs)) {
    if (cufile_attach(f, why)) {
      f.engine = file_engine::cufile;
      f.note = prefix + "cufile (" + (cufile::driver().nvfs ? "GPUDirect Storage, nvidia-fs" : "compatibility mode") +
               ", " + cufile::driver().fns->path + ")";
      return;
    }
    prefix += "cuFile unavailable (" + why + "), ";
  } else if (c == file_options::engine_choice::automatic) {
    prefix += cufile::driver().ok ? "auto (nvidia-fs not loaded), " : "auto (" + cufile::driver().why + "), ";
  }
  f.engine = file_engine::uring;
  f.note = prefix + "uring";
}

result<int> reopen(int fd, int flags) {
  std::string p = "/proc/self/fd/" + std::to_string(fd);
  int r = ::open(p.c_str(), flags | O_CLOEXEC);
  if (r < 0) return errno_code(errno);
  return r;
}
}  // namespace
}  // namespace detail

gpu_file::impl::~impl() {
  detail::cufile_detach(*this);
  pool.reset();
  if (dfd >= 0) ::close(dfd);
  if (fd >= 0) ::close(fd);
}

gpu_file::gpu_file() noexcept = default;
gpu_file::~gpu_file() = default;
gpu_file::gpu_file(gpu_file&&) noexcept = default;
gpu_file& gpu_file::operator=(gpu_file&&) noexcept = default;

gpu_file::gpu_file(std::unique_ptr<impl> p) noexcept : p_(std::move(p)) {}

// Finishes an impl whose buffered descriptor is open: O_DIRECT descriptor,
// file type, engine.
result<gpu_file> gpu_file::finish_open(std::unique_ptr<gpu_file::impl> p, const std::string& direct_path) {
  struct stat st {};
  if (::fstat(p->fd, &st) != 0) return errno_code(errno);
  if (S_ISDIR(st.st_mode)) return errno_code(EISDIR);
  if (p->opts.direct) {
    int acc = p->writable ? O_RDWR : O_RDONLY;
    int d = ::open(direct_path.c_str(), acc | O_DIRECT | O_CLOEXEC);
    if (d >= 0)
      p->dfd = d;
    else
      p->direct_note = "O_DIRECT refused by the file system (" + errno_code(errno).message() + "): buffered";
  } else {
    p->direct_note = "buffered (file_options::direct off)";
  }
  detail::choose(*p);
  return gpu_file(std::move(p));
}

result<gpu_file> gpu_file::open(const std::string& path, bool writable, file_options o) {
  auto* ctx = io_context::current_or_null();
  if (!ctx) return make_error_code(errc::no_io_context);
  auto p = std::make_unique<impl>();
  p->ctx = ctx;
  p->opts = o;
  p->writable = writable;
  p->fd = ::open(path.c_str(), (writable ? O_RDWR | O_CREAT : O_RDONLY) | O_CLOEXEC, 0644);
  if (p->fd < 0) return errno_code(errno);
  return finish_open(std::move(p), path);
}

result<gpu_file> gpu_file::from_fd(int fd, file_options o) {
  auto* ctx = io_context::current_or_null();
  if (!ctx) return make_error_code(errc::no_io_context);
  int fl = ::fcntl(fd, F_GETFL);
  if (fl < 0) return errno_code(errno);
  auto p = std::make_unique<impl>();
  p->ctx = ctx;
  p->opts = o;
  p->writable = (fl & O_ACCMODE) != O_RDONLY;
  auto b = detail::reopen(fd, p->writable ? O_RDWR : O_RDONLY);
  if (!b) return b.error();
  p->fd = *b;
  return finish_open(std::move(p), "/proc/self/fd/" + std::to_string(fd));
}

namespace {
// What makes a transfer on `p` with `gpu` fail before it starts (none: {}).
std::error_code refuse(const gpu_file::impl* p, const void* gpu, std::size_t len, bool write) {
  if (!p || (write && !p->writable)) return std::make_error_code(std::errc::bad_file_descriptor);
  if (io_context::current_or_null() != p->ctx) return make_error_code(errc::no_io_context);
  return detail::check_gpu_span(gpu, len);
}
}  // namespace

task<result<std::size_t>> gpu_file::read_into(std::span<std::byte> gpu, std::uint64_t offset) {
  if (auto e = refuse(p_.get(), gpu.data(), gpu.size(), false)) co_return e;
  if (gpu.empty()) co_return std::size_t{0};
  auto g = co_await p_->busy.lock();
  if (!g) co_return g.error();
  if (p_->engine == file_engine::cufile) co_return co_await detail::cufile_read(*p_, gpu, offset);
  co_return co_await detail::uring_read(*p_, gpu, offset);
}

task<result<std::size_t>> gpu_file::write_from(std::span<const std::byte> gpu, std::uint64_t offset) {
  if (auto e = refuse(p_.get(), gpu.data(), gpu.size(), true)) co_return e;
  if (gpu.empty()) co_return std::size_t{0};
  auto g = co_await p_->busy.lock();
  if (!g) co_return g.error();
  if (p_->engine == file_engine::cufile) co_return co_await detail::cufile_write(*p_, gpu, offset);
  co_return co_await detail::uring_write(*p_, gpu, offset);
}

result<std::uint64_t> gpu_file::size() const {
  if (!p_) return std::make_error_code(std::errc::bad_file_descriptor);
  struct stat st {};
  if (::fstat(p_->fd, &st) != 0) return errno_code(errno);
  return static_cast<std::uint64_t>(st.st_size);
}

file_engine gpu_file::engine() const noexcept { return p_ ? p_->engine : file_engine::uring; }

std::string gpu_file::note() const {
  if (!p_) return "closed";
  std::string n = p_->note;
  if (p_->engine == file_engine::uring) {
    n += p_->direct_note.empty() ? ", O_DIRECT" : ", " + p_->direct_note;
    if (p_->pool && !p_->pool->note.empty()) n += ", " + p_->pool->note;
  }
  return n;
}

std::string describe_file_engines() {
  const auto& d = detail::cufile::driver();
  std::string s = "file engines: uring (O_DIRECT, fixed bounce buffers) available; cufile ";
  if (d.ok)
    s += std::string("available (") + d.fns->path + (d.nvfs ? ", nvidia-fs loaded: GPUDirect Storage)"
                                                            : ", nvidia-fs not loaded: compatibility mode if enabled)");
  else
    s += "unavailable (" + d.why + ")";
  std::string note;
  auto c = detail::from_env(note);
  const char* pick = c == file_options::engine_choice::uring    ? "uring"
                     : c == file_options::engine_choice::cufile ? "cufile (uring where registration fails)"
                     : (d.ok && d.nvfs)                         ? "cufile"
                                                                : "uring";
  s += "\n    SHUTTLE_FILE_ENGINE: " + note + "files open with " + pick;
  return s;
}

}  // namespace shuttle::cuda
