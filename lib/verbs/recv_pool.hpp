// Receive buffers: a pool of registered slots, owned by one connection or by
// a core's shared receive queue.
#pragma once

#include "basics.hpp"

namespace shuttle::detail::verbs_impl {

// ------------------------------------------------------------------ receive pool

struct recv_pool;
struct recv_slot : wr_ctx {
  recv_pool* pool = nullptr;
  std::byte* addr = nullptr;
  std::uint32_t lkey = 0;
  std::uint32_t qp_num = 0;  // SRQ: the QP that consumed it (its connection gets the credit back)
  // Sends posted from this buffer's bytes (core::hold_rx_slot), not completed
  // yet: a buffer released meanwhile is posted again only after the last
  // (the NIC must not receive into bytes it is still sending).
  std::uint32_t readers = 0;
  bool release_deferred = false;
};

// Receive buffers: a connection's own (conn set) or the SRQ's of a core
// (srq_core set). Refcounted: the owner + one per message handed out.
struct recv_pool {
  std::shared_ptr<pd_holder> pd;
  conn_state* conn = nullptr;  // own pool: null once the connection is gone
  core* srq_core = nullptr;    // SRQ pool: null once the core is gone
  std::size_t slot_size = 0;
  std::vector<std::pair<std::byte*, ibv_mr*>> slabs;
  std::deque<recv_slot> slots;  // stable addresses: a posted receive's wr_id names its slot
  std::size_t refs = 1;
  // The core whose rx_slabs name this pool's slabs, so that a send from a
  // received message's bytes is posted from the slab's MR (find_region).
  std::weak_ptr<core> home;
  std::vector<std::shared_ptr<verbs_region>> slab_regions;  // lkey views of slabs' MRs (owning nothing)

  ~recv_pool();  // core.cpp
  void unref() noexcept {
    if (--refs == 0) delete this;
  }
  // Adds n slots in one registered slab; returns the index of the first.
  result<std::uint32_t> grow(std::uint32_t n, void (*on_wc)(wr_ctx*, const ibv_wc&) noexcept) {
    std::size_t bytes = (n * slot_size + 4095) & ~std::size_t(4095);
    auto* buf = static_cast<std::byte*>(std::aligned_alloc(4096, bytes));
    if (!buf) return make_error_code(std::errc::not_enough_memory);
    slabs.emplace_back(buf, nullptr);
    ibv_mr* mr = ibv_reg_mr(pd->pd, buf, bytes, static_cast<int>(IBV_ACCESS_LOCAL_WRITE));
    if (!mr) return last_errno();
    slabs.back().second = mr;
    auto first = static_cast<std::uint32_t>(slots.size());
    if (!note_slab(buf, n, first, mr)) return make_error_code(std::errc::not_enough_memory);
    for (std::uint32_t i = 0; i < n; ++i) {
      recv_slot& sl = slots.emplace_back();
      sl.pool = this;
      sl.addr = buf + std::size_t(i) * slot_size;
      sl.lkey = mr->lkey;
      sl.on_wc = on_wc;
    }
    return first;
  }
  // Tells the home core of a new slab (core.cpp); false: out of memory.
  bool note_slab(std::byte* buf, std::uint32_t n, std::uint32_t first, ibv_mr* mr) noexcept;
  static void release(void* owner, std::uint64_t slot) noexcept;
  // A released buffer goes back to its receive queue (a connection's or the SRQ).
  void give_back(recv_slot& s) noexcept;
};

// The receive work request of a slot: its whole buffer, wr_id naming the slot.
inline void fill_recv_wr(recv_slot& s, ibv_recv_wr& wr, ibv_sge& sge) noexcept {
  sge = {reinterpret_cast<std::uintptr_t>(s.addr), static_cast<std::uint32_t>(s.pool->slot_size), s.lkey};
  wr = {};
  wr.wr_id = reinterpret_cast<std::uintptr_t>(static_cast<wr_ctx*>(&s));
  wr.sg_list = &sge;
  wr.num_sge = 1;
}

}  // namespace shuttle::detail::verbs_impl
