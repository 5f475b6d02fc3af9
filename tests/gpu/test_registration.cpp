// Registration path selection for device memory.
#include <doctest/doctest.h>

#include "common.hpp"

#include <unistd.h>

using namespace shuttle;

TEST_CASE("a tcp domain stages device memory; the choice is cached") {
  io_context ctx;
  domain_options o;
  o.kind = transport_kind::tcp;
  auto d = domain::open(o).value();
  cuda::gpu_registry reg(d);
  cuda::device_buffer buf(1 << 20);
  auto r = reg.register_memory(buf.data(), buf.size(), access::local_write | access::remote_write);
  REQUIRE(r.has_value());
  CHECK(r->path == cuda::gpu_path::staged);
  CHECK(!r->region);
  CHECK(r->reason.find("tcp") != std::string::npos);
  MESSAGE("tcp domain: " << std::string(cuda::to_string(r->path)) << " (" << r->reason << ")");
  auto again = reg.register_memory(buf.data(), buf.size(), access::local_write | access::remote_write);
  REQUIRE(again.has_value());
  CHECK(reg.hits() == 1);
  CHECK(reg.size() == 1);
  reg.forget(buf.data());
  CHECK(reg.size() == 0);
}

TEST_CASE("the automatic domain picks a path and reports it") {
  io_context ctx;
  auto d = domain::open();
  REQUIRE(d.has_value());
  cuda::gpu_registry reg(*d);
  cuda::device_buffer buf(4 << 20);
  auto r = reg.register_memory(buf.data(), buf.size(), access::local_write | access::remote_write);
  REQUIRE(r.has_value());
  MESSAGE(d->describe() << ": " << std::string(cuda::to_string(r->path)) << " (" << r->reason << ")");
  if (d->kind() == transport_kind::tcp) CHECK(r->path == cuda::gpu_path::staged);
  if (r->path != cuda::gpu_path::staged) CHECK(static_cast<bool>(r->region));
}

TEST_CASE("GPUDirect capabilities are detected at run time; dma-buf export where supported") {
  auto c = cuda::probe_gdr();
  MESSAGE(c.describe());
  if (!c.dmabuf_supported) return;
  CHECK(c.dmabuf_export_ok);
  cuda::device_buffer buf(3 << 20);
  std::uint64_t off = 0;
  auto fd = cuda::export_dmabuf(buf.data() + 4097, 1 << 20, &off);
  REQUIRE(fd.has_value());
  CHECK(*fd >= 0);
  CHECK(off % 4096 == 4097 % 4096);
  ::close(*fd);
}

TEST_CASE("driver features") {
  auto f = cuda::features();
  MESSAGE("driver " << f.driver_version << ", stream mem ops " << f.stream_mem_ops << ", flush " << f.flush_remote_writes
                    << ", dma-buf " << f.dmabuf_export);
  CHECK(f.driver_version > 0);
}
