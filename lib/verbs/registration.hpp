// Memory registration: the domain's regions, the staging slots that sends
// and writes from memory the library does not own are copied into, and the
// search for the user registration covering an operation's memory. The
// domain (core, core.hpp) keeps them; this holds what needs no NIC to
// be tested (tests/verbs/test_registration.cpp).
#pragma once

#include "../transport/provider.hpp"

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>
#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace shuttle::detail::verbs_impl {

// Memory the library does not own (neither a live user registration nor its
// own) is never registered for longer than one operation: nothing can tell
// the library when such memory is unmapped (docs/memory-registration.md).
// Send and write sources up to staging_slot_size are copied into a
// registered staging slot; larger ones, read targets, and any operation
// when every slot is taken, are registered for the operation alone.
constexpr std::size_t staging_slot_size = 64 << 10;
constexpr std::uint32_t staging_slots = 32;

// Owns the device list reference and the PD; outlives every registration.
struct pd_holder {
  ibv_context** devices = nullptr;
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ~pd_holder() {
    if (pd) ibv_dealloc_pd(pd);
    if (devices) rdma_free_devices(devices);
  }
};

struct verbs_region final : region_impl, std::enable_shared_from_this<verbs_region> {
  ibv_mr* mr = nullptr;
  bool device_memory = false;  // GPU memory (dma-buf, peermem): the CPU must not read it, so never inline
  std::shared_ptr<pd_holder> pd;
  std::uint64_t seq = 0;  // creation order: the newest covering user registration wins
  ~verbs_region() override {
    if (mr) ibv_dereg_mr(mr);
  }
};

// Registered slots, one domain's, that sends and writes from memory the
// library does not own are copied into (see staging_slot_size). A slot is
// leased to one operation and comes back when the operation's hold on it
// (a shared_ptr with staging_return as deleter) goes.
struct staging_pool {
  std::byte* mem = nullptr;
  std::shared_ptr<verbs_region> region;
  std::vector<std::uint32_t> free_slots;  // capacity reserved: returning never allocates
  ~staging_pool() {
    region.reset();  // deregistered before the pages go
    if (mem) ::munmap(mem, std::size_t(staging_slots) * staging_slot_size);
  }
};
struct staging_return {
  std::shared_ptr<staging_pool> pool;
  std::uint32_t slot;
  void operator()(verbs_region*) const noexcept { pool->free_slots.push_back(slot); }
};

// The access flags a registration gets for `flags`: remote write and
// atomics need local write.
inline unsigned normalize_access(unsigned flags) noexcept {
  unsigned a = flags & access::all;
  if (a & (access::remote_write | access::remote_atomic)) a |= access::local_write;
  return a;
}

// The newest live registration covering [a, a+len) (with local write if
// asked), among the 64 nearest at or below `a` in `m` (address -> weak
// region).
template <class Map>
std::shared_ptr<verbs_region> find_cover(Map& m, std::uintptr_t a, std::size_t len, bool need_write) {
  auto it = m.upper_bound(a);
  std::shared_ptr<verbs_region> best;
  for (int steps = 0; it != m.begin() && steps < 64; ++steps) {
    --it;
    std::shared_ptr<verbs_region> sp = it->second.lock();
    if (!sp) continue;
    auto base = reinterpret_cast<std::uintptr_t>(sp->addr);
    bool writable = (sp->access & access::local_write) != 0;
    if (a >= base && a + len <= base + sp->length && (!need_write || writable) && (!best || sp->seq > best->seq))
      best = std::move(sp);
  }
  return best;
}

}  // namespace shuttle::detail::verbs_impl
