// gpu_file's io_uring engine: a transfer is cut into chunks
// (file_plan.hpp) and run by up to `depth` lanes, each owning one pinned
// bounce buffer and one copy stream. A lane reads a chunk into its buffer
// (READ_FIXED where the buffers are registered), copies what it holds to
// the GPU and awaits the copy through the loop before it takes the next
// chunk, so while one lane copies the others' reads keep the disk busy.
// Writes run the other way: copy to the buffer, then write.
#include "file_impl.hpp"
#include "file_plan.hpp"

#include <shuttle/detail/uring_op.hpp>
#include <shuttle/when_all.hpp>

#include <sys/mman.h>

#include <cerrno>
#include <limits>

namespace shuttle::cuda::detail {

namespace {

// One read or write at `off`, from or into a fixed buffer when `fixed` >= 0.
auto transfer_at(io_context& ctx, int fd, std::byte* p, std::size_t n, std::uint64_t off, int fixed, bool write) {
  return shuttle::detail::make_uring_awaitable(
      ctx,
      [=](io_uring_sqe* sqe) {
        const auto len = static_cast<unsigned>(n);
        if (write && fixed >= 0)
          io_uring_prep_write_fixed(sqe, fd, p, len, off, fixed);
        else if (write)
          io_uring_prep_write(sqe, fd, p, len, off);
        else if (fixed >= 0)
          io_uring_prep_read_fixed(sqe, fd, p, len, off, fixed);
        else
          io_uring_prep_read(sqe, fd, p, len, off);
      },
      [](int res, std::uint32_t) -> result<std::size_t> {
        if (res < 0) return errno_code(-res);
        return static_cast<std::size_t>(res);
      });
}
auto read_at(io_context& ctx, int fd, std::byte* p, std::size_t n, std::uint64_t off, int fixed) {
  return transfer_at(ctx, fd, p, n, off, fixed, false);
}
auto write_at(io_context& ctx, int fd, const std::byte* p, std::size_t n, std::uint64_t off, int fixed) {
  return transfer_at(ctx, fd, const_cast<std::byte*>(p), n, off, fixed, true);  // only read by the kernel
}

// One transfer's shared state, read by all its lanes.
struct job {
  gpu_file::impl& f;
  bounce_pool& pool;
  std::vector<file_chunk> plan;
  std::byte* gpu = nullptr;
  std::size_t next = 0;
  std::uint64_t eof = std::numeric_limits<std::uint64_t>::max();  // where a read came up short
  std::error_code err;
  bool direct = false;
  bool more(std::stop_token& t) const { return !err && !t.stop_requested() && next < plan.size(); }
};

// Switches the file to buffered I/O after O_DIRECT was refused at run time
// (EINVAL: an alignment the file system will not take).
void refuse_direct(job& j, const char* op) {
  if (!j.direct) return;
  j.direct = false;
  if (j.f.direct_note.empty())
    j.f.direct_note = std::string("O_DIRECT ") + op + " refused by the file system (Invalid argument): buffered";
}

task<void> read_lane(job& j, unsigned k) {
  std::stop_token token = co_await get_stop_token();
  std::byte* buf = j.pool.buffer(k);
  const int fixed = j.pool.fixed.usable_on(*j.f.ctx) ? j.pool.fixed.index : -1;
  while (j.more(token)) {
    const file_chunk c = j.plan[j.next++];
    if (c.file_offset >= j.eof) co_return;
    std::size_t got = 0;
    while (got < c.length) {
      const bool direct = j.direct;
      auto r = co_await read_at(*j.f.ctx, direct ? j.f.dfd : j.f.fd, buf + got, c.length - got, c.file_offset + got,
                                fixed);
      if (!r && direct && r.error() == std::errc::invalid_argument) {
        refuse_direct(j, "read");
        continue;
      }
      if (!r) {
        if (!j.err) j.err = r.error();
        co_return;
      }
      if (*r == 0) break;
      got += *r;
      // A direct read that ends off a block boundary ended at the end of
      // the file; a buffered one may be short anywhere and is continued.
      if (direct && got % j.f.align != 0) break;
    }
    if (got < c.length && c.file_offset + got < j.eof) j.eof = c.file_offset + got;
    std::size_t use = usable_bytes(c, got);
    if (use == 0) continue;
    cudaStream_t s = j.pool.streams[k];
    cudaError_t e = cudaMemcpyAsync(j.gpu + c.dest_offset, buf + c.skip, use, cudaMemcpyHostToDevice, s);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      if (!j.err) j.err = make_error_code(e);
      co_return;
    }
    // The buffer is read again by the next chunk: the copy must be done,
    // whatever the stop token says.
    auto w = co_await unstoppable{cuda::wait(s)};
    if (!w && !j.err) j.err = w.error();
  }
}

task<void> write_lane(job& j, unsigned k) {
  std::stop_token token = co_await get_stop_token();
  std::byte* buf = j.pool.buffer(k);
  const int fixed = j.pool.fixed.usable_on(*j.f.ctx) ? j.pool.fixed.index : -1;
  while (j.more(token)) {
    const file_chunk c = j.plan[j.next++];
    cudaStream_t s = j.pool.streams[k];
    cudaError_t e = cudaMemcpyAsync(buf, j.gpu + c.dest_offset, c.length, cudaMemcpyDeviceToHost, s);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      if (!j.err) j.err = make_error_code(e);
      co_return;
    }
    if (auto w = co_await unstoppable{cuda::wait(s)}; !w) {
      if (!j.err) j.err = w.error();
      co_return;
    }
    std::size_t put = 0;
    while (put < c.length) {
      const bool direct = c.direct && j.direct;
      auto r = co_await write_at(*j.f.ctx, direct ? j.f.dfd : j.f.fd, buf + put, c.length - put, c.file_offset + put,
                                 fixed);
      if (!r && direct && r.error() == std::errc::invalid_argument) {
        refuse_direct(j, "write");
        continue;
      }
      if (!r || *r == 0) {
        if (!j.err) j.err = r ? errno_code(EIO) : r.error();
        co_return;
      }
      put += *r;
    }
  }
}

task<result<std::size_t>> run(gpu_file::impl& f, std::byte* gpu, std::uint64_t offset, std::size_t length,
                              bool reading) {
  if (!f.pool) {
    auto p = bounce_pool::make(*f.ctx, usable_chunk(f.opts.chunk_size, 4096), f.opts.depth ? f.opts.depth : 1);
    if (!p) co_return p.error();
    f.pool = std::move(*p);
  }
  const bool direct = f.dfd >= 0;
  const std::size_t align = direct ? f.align : 1;
  job j{f, *f.pool, reading ? plan_read(offset, length, align, f.pool->chunk)
                            : plan_write(offset, length, align, f.pool->chunk),
        gpu, 0, std::numeric_limits<std::uint64_t>::max(), {}, direct};
  const unsigned lanes = static_cast<unsigned>(std::min<std::size_t>(f.pool->depth, j.plan.size()));
  std::vector<task<void>> ts;
  ts.reserve(lanes);
  for (unsigned k = 0; k < lanes; ++k) ts.push_back(reading ? read_lane(j, k) : write_lane(j, k));
  co_await when_all(std::move(ts));
  if (!j.direct && direct && f.dfd >= 0) {
    // Refused at run time: later transfers go buffered from the start.
    ::close(f.dfd);
    f.dfd = -1;
  }
  std::stop_token token = co_await get_stop_token();
  if (j.err) co_return j.err;
  if (token.stop_requested() && j.next < j.plan.size()) co_return std::make_error_code(std::errc::operation_canceled);
  if (!reading) co_return length;
  if (j.eof <= offset) co_return std::size_t{0};
  co_return static_cast<std::size_t>(std::min<std::uint64_t>(length, j.eof - offset));
}

}  // namespace

result<std::unique_ptr<bounce_pool>> bounce_pool::make(io_context& ctx, std::size_t chunk, unsigned depth) {
  auto p = std::make_unique<bounce_pool>();
  p->ctx = &ctx;
  p->chunk = chunk;
  p->depth = depth;
  const std::size_t bytes = chunk * depth;
  void* m = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (m == MAP_FAILED) return errno_code(errno);
  p->mem = static_cast<std::byte*>(m);
  if (cudaError_t e = cudaHostRegister(m, bytes, cudaHostRegisterDefault); e != cudaSuccess) {
    (void)cudaGetLastError();
    return make_error_code(e);
  }
  p->host_registered = true;
  try {
    for (unsigned k = 0; k < depth; ++k) p->streams.emplace_back();
  } catch (const std::system_error& e) {
    return e.code();
  }
  if (auto r = ctx.register_buffer({p->mem, bytes}))
    p->fixed = std::move(*r);
  else
    p->note = "fixed buffers unavailable (" + r.error().message() + "): plain reads";
  return p;
}

bounce_pool::~bounce_pool() {
  if (fixed.usable_on(*ctx) && ctx->running_in_this_thread()) ctx->unregister_buffer(fixed);
  streams.clear();
  if (host_registered) (void)cudaHostUnregister(mem);
  if (mem) ::munmap(mem, chunk * depth);
}

task<result<std::size_t>> uring_read(gpu_file::impl& f, std::span<std::byte> gpu, std::uint64_t offset) {
  return run(f, gpu.data(), offset, gpu.size(), true);
}

task<result<std::size_t>> uring_write(gpu_file::impl& f, std::span<const std::byte> gpu, std::uint64_t offset) {
  return run(f, const_cast<std::byte*>(gpu.data()), offset, gpu.size(), false);
}

}  // namespace shuttle::cuda::detail
