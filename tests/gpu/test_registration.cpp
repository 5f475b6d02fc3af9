// Registration path selection for device memory.
#include <doctest/doctest.h>

#include "common.hpp"

#include <shuttle/cuda/gpu_memory.hpp>
#include <shuttle/verbs/verbs.hpp>

#include <unistd.h>

#include <vector>

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

// Issue 37: after cudaFree and a cudaMalloc that returns the same address,
// a cached entry describes the freed allocation (on verbs, its dma-buf or
// peermem MR pins the old pages). The registry checks each hit against the
// allocation's CU_POINTER_ATTRIBUTE_BUFFER_ID; the lookup is the same for
// every provider, so a tcp domain (no NIC needed) exercises it.
TEST_CASE("a registration of freed device memory is not returned for a new allocation at its address") {
  io_context ctx;
  domain_options o;
  o.kind = transport_kind::tcp;
  auto d = domain::open(o).value();
  cuda::gpu_registry reg(d);
  constexpr std::size_t len = 2 << 20;
  const unsigned acc = access::local_write | access::remote_write;
  void* first = nullptr;
  REQUIRE(cudaMalloc(&first, len) == cudaSuccess);
  REQUIRE(reg.register_memory(first, len, acc).has_value());
  REQUIRE(reg.register_memory(first, len, acc).has_value());
  CHECK(reg.hits() == 1);  // the same allocation: a hit
  CHECK(reg.stale_dropped() == 0);
  REQUIRE(cudaFree(first) == cudaSuccess);
  // Allocate until the address comes back (usually at once); keep the
  // misses so that the allocator cannot hand them out again.
  std::vector<void*> misses;
  void* again = nullptr;
  for (int i = 0; i < 64 && again != first; ++i) {
    void* p = nullptr;
    REQUIRE(cudaMalloc(&p, len) == cudaSuccess);
    if (p == first)
      again = p;
    else
      misses.push_back(p);
  }
  const std::string came_back = again == first ? "yes" : "no";
  MESSAGE("same address again after " << misses.size() << " other allocations: " << came_back);
  if (again == first) {
    auto r = reg.register_memory(again, len, acc);
    REQUIRE(r.has_value());
    CHECK(reg.hits() == 1);  // not served from the entry of the freed allocation
    CHECK(reg.stale_dropped() == 1);
    CHECK(reg.size() == 1);  // the stale entry replaced
    REQUIRE(reg.register_memory(again, len, acc).has_value());
    CHECK(reg.hits() == 2);  // the new entry serves the new allocation
    CHECK(reg.stale_dropped() == 1);
    (void)cudaFree(again);
  }
  for (void* p : misses) (void)cudaFree(p);
  // Memory that is not the device's has no buffer id: registered, not cached.
  std::vector<std::byte> host(4096);
  REQUIRE(reg.register_memory(host.data(), host.size(), acc).has_value());
  CHECK(reg.size() == (again == first ? 1u : 0u));
}

// lib/cuda installs the verbs provider's device-memory hooks when it is
// loaded (verbs::device_memory_hooks): cudaMalloc'd memory is device
// memory; host and managed memory (the CPU may read both) are not.
TEST_CASE("the verbs device-memory hooks tell device memory from host and managed memory") {
  const auto* h = verbs::installed_device_memory_hooks();
  REQUIRE(h != nullptr);
  const bool all_set = h->is_device_memory && h->export_dmabuf && h->peermem;
  REQUIRE(all_set);
  cuda::device_buffer buf(1 << 20);
  CHECK(h->is_device_memory(buf.data(), buf.size()));
  std::vector<std::byte> host(4096);
  CHECK_FALSE(h->is_device_memory(host.data(), host.size()));
  void* managed = nullptr;
  REQUIRE(cudaMallocManaged(&managed, 4096) == cudaSuccess);
  CHECK_FALSE(h->is_device_memory(managed, 4096));
  cudaFree(managed);
}
