// gpu_file: reads into and writes from GPU memory, on each engine that
// runs here (uring always; cufile where libcufile registers the file, e.g.
// in compatibility mode: tests/gpu/run-device.sh enables it).
#include <doctest/doctest.h>

#include "common.hpp"

#include <shuttle/cuda/gpu_file.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

using namespace shuttle;
constexpr std::size_t mib = 1 << 20;

namespace {
std::uint8_t byte_at(std::uint64_t o) { return cuda::kernels::pattern_byte(o, 7); }

// A file of `n` pattern bytes in TMPDIR (or /var/tmp: a disk, not tmpfs).
struct temp_file {
  std::string path;
  explicit temp_file(std::size_t n, const char* name) {
    const char* d = std::getenv("TMPDIR");
    path = std::string(d && *d ? d : "/var/tmp") + "/shuttle-gpu-file-" + name + "-" + std::to_string(::getpid());
    std::vector<std::uint8_t> buf(std::min<std::size_t>(n, 8 * mib));
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    REQUIRE(fd >= 0);
    for (std::size_t done = 0; done < n;) {
      std::size_t k = std::min(buf.size(), n - done);
      for (std::size_t i = 0; i < k; ++i) buf[i] = byte_at(done + i);
      REQUIRE(::write(fd, buf.data(), k) == static_cast<ssize_t>(k));
      done += k;
    }
    ::close(fd);
  }
  ~temp_file() { ::unlink(path.c_str()); }
};

std::vector<std::uint8_t> to_host(const cuda::device_buffer& b, std::size_t n) {
  std::vector<std::uint8_t> h(n);
  cuda::check(cudaMemcpy(h.data(), b.data(), n, cudaMemcpyDeviceToHost), "cudaMemcpy");
  return h;
}

// Index of the first byte of `h` that is not the file's byte at `base` + i; n if none.
std::size_t first_mismatch(const std::vector<std::uint8_t>& h, std::size_t n, std::uint64_t base) {
  for (std::size_t i = 0; i < n; ++i)
    if (h[i] != byte_at(base + i)) return i;
  return n;
}

using choice = cuda::file_options::engine_choice;

// The engines to run a case on: uring, and cufile where it registers files here.
std::vector<choice> engines() {
  std::vector<choice> v{choice::uring};
  io_context ctx;
  temp_file t(4096, "probe");
  cuda::file_options o;
  o.engine = choice::cufile;
  auto f = cuda::gpu_file::open(t.path, false, o);
  REQUIRE(f.has_value());
  if (f->engine() == cuda::file_engine::cufile)
    v.push_back(choice::cufile);
  else
    MESSAGE("cufile engine not tested here: " << f->note());
  return v;
}

cuda::file_options with(choice c) {
  cuda::file_options o;
  o.engine = c;
  return o;
}
const char* name(choice c) { return c == choice::cufile ? "cufile" : "uring"; }
}  // namespace

TEST_CASE("read_into: sizes not a multiple of the block size, offsets, a short file, past the end") {
  for (auto e : engines()) {
    CAPTURE(name(e));
    io_context ctx;
    temp_file t(10 * mib + 123, "sizes");
    auto f = cuda::gpu_file::open(t.path, false, with(e)).value();
    MESSAGE(name(e) << ": " << f.note());
    cuda::device_buffer d(16 * mib);
    struct probe {
      std::uint64_t offset;
      std::size_t length, expect;
    };
    for (auto p : {probe{0, 10 * mib + 123, 10 * mib + 123}, probe{4097, 5 * mib + 7, 5 * mib + 7},
                   probe{5000, 10, 10}, probe{8 * mib, 8 * mib, 2 * mib + 123},  // runs into the end
                   probe{10 * mib + 123, 4096, 0}, probe{64 * mib, 100, 0}}) {
      CAPTURE(p.offset);
      CAPTURE(p.length);
      cudaMemset(d.data(), 0, d.size());
      auto n = ctx.run(f.read_into({d.data(), p.length}, p.offset));
      REQUIRE(n.has_value());
      CHECK(*n == p.expect);
      auto h = to_host(d, p.expect);
      CHECK(first_mismatch(h, p.expect, p.offset) == p.expect);
    }
    // A file shorter than one block.
    temp_file s(1000, "short");
    auto g = cuda::gpu_file::open(s.path, false, with(e)).value();
    auto n = ctx.run(g.read_into({d.data(), mib}, 0));
    REQUIRE(n.has_value());
    CHECK(*n == 1000);
    CHECK(first_mismatch(to_host(d, 1000), 1000, 0) == 1000);
  }
}

TEST_CASE("read_into: a file truncated while it is read returns what was there") {
  for (auto e : engines()) {
    CAPTURE(name(e));
    io_context ctx;
    temp_file t(64 * mib, "truncated");
    auto f = cuda::gpu_file::open(t.path, false, with(e)).value();
    cuda::device_buffer d(64 * mib);
    result<std::size_t> n = std::size_t{0};
    ctx.run([&]() -> task<void> {
      co_await when_all(
          [&]() -> task<void> { n = co_await f.read_into({d.data(), 64 * mib}, 0); }(),
          [&]() -> task<void> {
            co_await yield();  // the read has its first chunks in flight
            REQUIRE(::truncate(t.path.c_str(), 10 * mib) == 0);
          }());
    }());
    REQUIRE(n.has_value());
    // The first 10 MiB are never cut; what came from before the cut is the old data.
    CHECK(*n >= 10 * mib);
    CHECK(*n <= 64 * mib);
    MESSAGE(name(e) << ": " << *n << " bytes read of a 64 MiB file cut to 10 MiB during the read");
    CHECK(first_mismatch(to_host(d, *n), *n, 0) == *n);
    // Read again: the new size.
    auto m = ctx.run(f.read_into({d.data(), 64 * mib}, 0));
    REQUIRE(m.has_value());
    CHECK(*m == 10 * mib);
  }
}

TEST_CASE("read_into: cancelled in the middle, then the file reads whole again") {
  for (auto e : engines()) {
    CAPTURE(name(e));
    io_context ctx;
    temp_file t(256 * mib, "cancel");
    auto f = cuda::gpu_file::open(t.path, false, with(e)).value();
    cuda::device_buffer d(256 * mib);
    result<std::size_t> n = std::size_t{0};
    auto r = ctx.run(when_any([&]() -> task<void> { n = co_await f.read_into({d.data(), d.size()}, 0); }(),
                              []() -> task<void> { co_await yield(); }()));
    CHECK(r.index() == 1);
    REQUIRE_FALSE(n.has_value());
    CHECK(n.error() == std::errc::operation_canceled);
    cudaMemset(d.data(), 0, d.size());
    auto m = ctx.run(f.read_into({d.data(), d.size()}, 0));
    REQUIRE(m.has_value());
    CHECK(*m == 256 * mib);
    CHECK(first_mismatch(to_host(d, *m), *m, 0) == *m);
  }
}

TEST_CASE("O_DIRECT refused by the file system: buffered reads, and the note says so") {
  io_context ctx;
  std::ifstream in("/proc/version");
  std::string want((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  REQUIRE_FALSE(want.empty());
  auto f = cuda::gpu_file::open("/proc/version", false, with(choice::uring)).value();
  MESSAGE(f.note());
  CHECK(f.note().find("O_DIRECT refused by the file system") != std::string::npos);
  cuda::device_buffer d(mib);
  auto n = ctx.run(f.read_into({d.data(), 65536}, 0));
  REQUIRE(n.has_value());
  REQUIRE(*n == want.size());
  auto h = to_host(d, *n);
  CHECK(std::string(h.begin(), h.end()) == want);
}

TEST_CASE("write_from: unaligned offset and size, read back by the host and by read_into") {
  for (auto e : engines()) {
    CAPTURE(name(e));
    io_context ctx;
    temp_file t(0, "write");
    auto f = cuda::gpu_file::open(t.path, true, with(e)).value();
    const std::size_t len = 9 * mib + 5;
    const std::uint64_t off = 1000;
    cuda::device_buffer src(len);
    cuda::stream s;
    REQUIRE(cuda::kernels::fill_pattern(src.data(), len, off, 7, s) == cudaSuccess);
    s.synchronize();
    auto w = ctx.run(f.write_from({src.data(), len}, off));
    REQUIRE(w.has_value());
    CHECK(*w == len);
    CHECK(f.size().value() == off + len);
    std::ifstream in(t.path, std::ios::binary);
    std::vector<std::uint8_t> h((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    REQUIRE(h.size() == off + len);
    CHECK(std::vector<std::uint8_t>(h.begin(), h.begin() + off) == std::vector<std::uint8_t>(off, 0));
    std::vector<std::uint8_t> tail(h.begin() + off, h.end());
    CHECK(first_mismatch(tail, len, off) == len);
    cuda::device_buffer back(len);
    auto r = ctx.run(f.read_into({back.data(), len}, off));
    REQUIRE(r.has_value());
    CHECK(*r == len);
    CHECK(first_mismatch(to_host(back, len), len, off) == len);
  }
}

TEST_CASE("bad spans and closed files fail with clear errors") {
  io_context ctx;
  temp_file t(4096, "bad");
  auto f = cuda::gpu_file::open(t.path).value();
  std::vector<std::byte> host(4096);
  CHECK(ctx.run(f.read_into(host, 0)).error() == std::errc::invalid_argument);
  cuda::device_buffer d(4096);
  CHECK(ctx.run(f.write_from({d.data(), 4096}, 0)).error() == std::errc::bad_file_descriptor);  // read-only
  cuda::gpu_file none;
  CHECK(ctx.run(none.read_into({d.data(), 4096}, 0)).error() == std::errc::bad_file_descriptor);
  CHECK(ctx.run(f.read_into({d.data(), 0}, 0)).value() == 0);
}
