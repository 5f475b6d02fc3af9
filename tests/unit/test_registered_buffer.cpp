// io_context::register_buffer: io_uring fixed buffers, read into with
// READ_FIXED.
#include <doctest/doctest.h>

#include <shuttle/detail/uring_op.hpp>
#include <shuttle/shuttle.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

using namespace shuttle;

namespace {
struct temp_file {
  std::string path;
  int fd = -1;
  explicit temp_file(const std::string& content) {
    char tmpl[] = "/tmp/shuttle-regbuf-XXXXXX";
    fd = ::mkstemp(tmpl);
    REQUIRE(fd >= 0);
    path = tmpl;
    REQUIRE(::write(fd, content.data(), content.size()) == static_cast<ssize_t>(content.size()));
  }
  ~temp_file() {
    ::close(fd);
    ::unlink(path.c_str());
  }
};

// A READ_FIXED of `n` bytes at file offset 0 into `p`, which lies in buffer `index`.
task<int> read_fixed(int fd, std::byte* p, unsigned n, int index) {
  co_return co_await detail::make_uring_awaitable(
      io_context::current(), [=](io_uring_sqe* sqe) { io_uring_prep_read_fixed(sqe, fd, p, n, 0, index); },
      [](int res, std::uint32_t) { return res; });
}
}  // namespace

TEST_CASE("register_buffer: READ_FIXED lands in the registered memory") {
  io_context ctx;
  temp_file f("fixed buffers are pinned once");
  std::vector<std::byte> mem(8192);
  auto b = ctx.register_buffer(mem);
  REQUIRE(b.has_value());
  CHECK(b->usable_on(ctx));
  int n = ctx.run(read_fixed(f.fd, mem.data() + 100, 64, b->index));
  CHECK(n == 29);
  CHECK(std::string(reinterpret_cast<char*>(mem.data() + 100), 29) == "fixed buffers are pinned once");
  // Outside the registered range the kernel refuses the address.
  std::vector<std::byte> other(4096);
  CHECK(ctx.run(read_fixed(f.fd, other.data(), 64, b->index)) == -EFAULT);
  ctx.unregister_buffer(*b);
  CHECK(b->index == -1);
  CHECK_FALSE(b->usable_on(ctx));
}

TEST_CASE("register_buffer: bad input and a full table fail with a clear error") {
  io_context::options o;
  o.registered_buffers = 2;
  io_context ctx(o);
  std::vector<std::byte> a(4096), c(4096), d(4096);
  CHECK(ctx.register_buffer({}).error() == std::errc::invalid_argument);
  auto ra = ctx.register_buffer(a);
  auto rc = ctx.register_buffer(c);
  REQUIRE(ra.has_value());
  REQUIRE(rc.has_value());
  CHECK(ra->index != rc->index);
  CHECK(ctx.register_buffer(d).error() == std::errc::too_many_files_open_in_system);  // ENFILE
  ctx.unregister_buffer(*ra);
  auto rd = ctx.register_buffer(d);  // the freed slot is reused
  REQUIRE(rd.has_value());
  ctx.unregister_buffer(*ra);  // twice: a no-op
  ctx.unregister_buffer(*rc);
  ctx.unregister_buffer(*rd);
}

TEST_CASE("register_buffer: no table asked for; a buffer outliving its context") {
  {
    io_context::options o;
    o.registered_buffers = 0;
    io_context ctx(o);
    std::vector<std::byte> a(4096);
    CHECK(ctx.register_buffer(a).error() == std::errc::too_many_files_open_in_system);
  }
  detail::registered_buffer kept;
  {
    io_context ctx;
    std::vector<std::byte> a(4096);
    kept = ctx.register_buffer(a).value();
  }
  CHECK(kept.table);
  CHECK(kept.table->owner == nullptr);  // the ring is gone: nothing to unregister
  io_context ctx2;
  CHECK_FALSE(kept.usable_on(ctx2));
  ctx2.unregister_buffer(kept);  // another context's buffer: left alone
  CHECK(kept.index >= 0);
}
