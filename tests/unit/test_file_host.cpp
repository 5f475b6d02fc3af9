// Host-side parts of gpu_file: the io_uring engine's chunking and
// alignment arithmetic, the cuFile loader where the library is missing or
// wrong, and the fallback of a file opened for cuFile on such a host.
#include <doctest/doctest.h>

#include "../../lib/cuda/cufile_api.hpp"
#include "../../lib/cuda/file_impl.hpp"
#include "../../lib/cuda/file_plan.hpp"

#include <shuttle/cuda/gpu_file.hpp>
#include <shuttle/shuttle.hpp>

#include <cstdlib>
#include <random>

using namespace shuttle;
using namespace shuttle::cuda::detail;

namespace {
// Every chunk aligned (when `align` > 1) and within `chunk`; the requested
// bytes covered once, in order, at the right GPU offsets.
void check_read_plan(std::uint64_t off, std::size_t len, std::size_t align, std::size_t chunk) {
  CAPTURE(off);
  CAPTURE(len);
  CAPTURE(align);
  auto plan = plan_read(off, len, align, chunk);
  std::uint64_t covered = 0, next_file = align_down(off, align);
  for (auto& c : plan) {
    CHECK(c.file_offset % align == 0);
    CHECK(c.length % align == 0);
    CHECK(c.length <= usable_chunk(chunk, align));
    CHECK(c.file_offset == next_file);  // contiguous reads
    next_file += c.length;
    CHECK(c.dest_offset == covered);
    CHECK(c.file_offset + c.skip == off + c.dest_offset);
    CHECK(c.skip + c.take <= c.length);
    covered += c.take;
  }
  CHECK(covered == len);
  if (len) CHECK(next_file == align_up(off + len, align));
}

// Stands in for cuda::stream_awaiter: owns a resource (there a pooled
// event) that its destructor hands back, once per awaiter.
struct counting_awaiter {
  static inline int made = 0, handed_back = 0;
  bool owns = true;
  counting_awaiter() { ++made; }
  counting_awaiter(counting_awaiter&& o) noexcept : owns(std::exchange(o.owns, false)) {}
  ~counting_awaiter() {
    if (owns) ++handed_back;
  }
  bool await_ready() const noexcept { return false; }
  bool await_suspend(std::coroutine_handle<>) const noexcept { return false; }  // done at once
  int await_resume() const noexcept { return 1; }
};
counting_awaiter counting_wait() { return counting_awaiter{}; }
}  // namespace

// The uring engine's lanes await `unstoppable{cuda::wait(s)}` once per
// chunk. Built as an aggregate by g++ 12, the inner awaiter was destroyed
// twice per await: every pooled event went back to the pool twice, and a
// 2 GiB read (512 waits) made the full pool destroy events it still held,
// then record one (SIGSEGV in cuEventRecord).
TEST_CASE("unstoppable: the awaited object is destroyed once per co_await") {
  counting_awaiter::made = counting_awaiter::handed_back = 0;
  io_context ctx;
  int sum = ctx.run([]() -> task<int> {
    int s = 0;
    for (int i = 0; i < 8; ++i) {
      auto w = co_await unstoppable{counting_wait()};
      s += w;
    }
    for (int i = 0; i < 8; ++i)
      if (auto w = co_await unstoppable{counting_wait()}; w) s += w;
    co_return s;
  }());
  CHECK(sum == 16);
  CHECK(counting_awaiter::made == 16);
  CHECK(counting_awaiter::handed_back == 16);
}

TEST_CASE("plan_read: aligned, unaligned head and tail, a size that is not a block multiple") {
  constexpr std::size_t mib = 1 << 20;
  auto p = plan_read(0, 8 * mib, 4096, 4 * mib);
  REQUIRE(p.size() == 2);
  CHECK(p[1].file_offset == 4 * mib);
  CHECK(p[1].skip == 0);
  CHECK(p[1].take == 4 * mib);

  // 10 MiB + 123 bytes from offset 0: the last block is read whole, 123 of it used.
  p = plan_read(0, 10 * mib + 123, 4096, 4 * mib);
  REQUIRE(p.size() == 3);
  CHECK(p[2].length == 2 * mib + 4096);
  CHECK(p[2].take == 2 * mib + 123);

  // From offset 4097: the first block starts at 4096, one byte skipped.
  p = plan_read(4097, 5 * mib + 7, 4096, 4 * mib);
  CHECK(p[0].file_offset == 4096);
  CHECK(p[0].skip == 1);
  CHECK(p[0].dest_offset == 0);
  CHECK(p[0].take == 4 * mib - 1);

  // Within one block.
  p = plan_read(5000, 10, 4096, 4 * mib);
  REQUIRE(p.size() == 1);
  CHECK(p[0].file_offset == 4096);
  CHECK(p[0].length == 4096);
  CHECK(p[0].skip == 904);
  CHECK(p[0].take == 10);

  // Buffered (align 1): exact.
  p = plan_read(7, 100, 1, 64);
  REQUIRE(p.size() == 2);
  CHECK(p[0].file_offset == 7);
  CHECK(p[0].length == 64);
  CHECK(p[1].length == 36);

  CHECK(plan_read(123, 0, 4096, mib).empty());
  // A chunk size that is not a block multiple is rounded down, never to 0.
  CHECK(usable_chunk(10000, 4096) == 8192);
  CHECK(usable_chunk(100, 4096) == 4096);
}

TEST_CASE("plan_read: random ranges cover the request exactly") {
  std::mt19937_64 rng(42);
  for (int i = 0; i < 2000; ++i) {
    std::uint64_t off = rng() % (64 << 20);
    std::size_t len = rng() % (20 << 20);
    std::size_t align = (i % 3 == 0) ? 1 : (i % 3 == 1 ? 512 : 4096);
    std::size_t chunk = (std::size_t{1} << (12 + rng() % 11)) + (rng() % 3) * 100;
    check_read_plan(off, len, align, chunk);
  }
}

TEST_CASE("usable_bytes: a short read at the end of the file") {
  file_chunk c{4096, 8192, 100, 8000, 0, true};
  CHECK(usable_bytes(c, 8192) == 8000);
  CHECK(usable_bytes(c, 4096) == 3996);  // the file ends 4096 bytes into the chunk
  CHECK(usable_bytes(c, 100) == 0);
  CHECK(usable_bytes(c, 0) == 0);
}

TEST_CASE("plan_write: buffered unaligned head and tail, direct aligned middle") {
  constexpr std::size_t mib = 1 << 20;
  auto p = plan_write(1000, 9 * mib + 5, 4096, 4 * mib);
  REQUIRE(p.size() >= 3);
  CHECK_FALSE(p.front().direct);
  CHECK(p.front().file_offset == 1000);
  CHECK(p.front().length == 4096 - 1000);
  CHECK_FALSE(p.back().direct);
  CHECK((p.back().file_offset + p.back().length) == 1000 + 9 * mib + 5);
  std::uint64_t covered = 0;
  for (auto& c : p) {
    CHECK(c.dest_offset == covered);
    CHECK(c.file_offset == 1000 + covered);
    if (c.direct) {
      CHECK(c.file_offset % 4096 == 0);
      CHECK(c.length % 4096 == 0);
      CHECK(c.length <= 4 * mib);
    }
    covered += c.length;
  }
  CHECK(covered == 9 * mib + 5);
  // Within one block: one buffered piece.
  p = plan_write(10, 20, 4096, mib);
  REQUIRE(p.size() == 1);
  CHECK_FALSE(p[0].direct);
  // Aligned: all direct.
  for (auto& c : plan_write(8192, 2 * mib, 4096, mib)) CHECK(c.direct);
  // Buffered file: nothing direct.
  for (auto& c : plan_write(0, 2 * mib, 1, mib)) CHECK_FALSE(c.direct);
}

TEST_CASE("cufile loader: a missing library and one without cuFile say so") {
  auto a = cufile::load("/nonexistent/libcufile.so.0");
  CHECK(a.lib == nullptr);
  CHECK_FALSE(a.complete());
  CHECK(a.error.find("libcufile not found") != std::string::npos);
  CHECK(a.error.find("/nonexistent/libcufile.so.0") != std::string::npos);

  auto m = cufile::load("libm.so.6");  // loads, but has no cuFile entry points
  CHECK(m.lib == nullptr);
  CHECK(m.error.find("lacks the stream API") != std::string::npos);

  ::setenv("SHUTTLE_CUFILE_LIB", "/nonexistent/by-env.so", 1);
  auto e = cufile::load();
  ::unsetenv("SHUTTLE_CUFILE_LIB");
  CHECK(e.error.find("/nonexistent/by-env.so") != std::string::npos);
}

TEST_CASE("a file opened for cuFile where cuFile cannot run falls back to uring and says why") {
  auto d = cufile::load();
  if (d.lib) {
    MESSAGE("libcufile is installed here (" << d.path << "): the fallback is checked by the gpu suite");
    return;
  }
  io_context ctx;
  cuda::file_options o;
  o.engine = cuda::file_options::engine_choice::cufile;
  auto f = cuda::gpu_file::open("/proc/self/exe", false, o);
  REQUIRE(f.has_value());
  CHECK(f->engine() == cuda::file_engine::uring);
  CHECK(f->note().find("cuFile unavailable (libcufile not found") != std::string::npos);
  ::setenv("SHUTTLE_FILE_ENGINE", "bogus", 1);
  auto g = cuda::gpu_file::open("/proc/self/exe");
  ::unsetenv("SHUTTLE_FILE_ENGINE");
  REQUIRE(g.has_value());
  CHECK(g->note().find("SHUTTLE_FILE_ENGINE=bogus not understood") != std::string::npos);
  CHECK(cuda::describe_file_engines().find("cufile unavailable (libcufile not found") != std::string::npos);
}

TEST_CASE("gpu_file: bad input") {
  io_context ctx;
  CHECK(cuda::gpu_file::open("/nonexistent/file").error() == std::errc::no_such_file_or_directory);
  CHECK(cuda::gpu_file::open("/tmp").error() == std::errc::is_a_directory);
  CHECK(cuda::gpu_file::from_fd(-1).error() == std::errc::bad_file_descriptor);
  // Host memory is not a GPU span.
  auto f = cuda::gpu_file::open("/proc/self/exe").value();
  std::vector<std::byte> host(4096);
  auto r = ctx.run(f.read_into(host, 0));
  CHECK(r.error() == std::errc::invalid_argument);
  auto w = ctx.run(f.write_from(host, 0));
  CHECK(w.error() == std::errc::bad_file_descriptor);  // opened read-only
}
