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
