// The core's cold paths: SRQ growth, the graveyard, unsignaled errors.
#include "operations.hpp"

namespace shuttle::detail::verbs_impl {

void recv_pool::release(void* owner, std::uint64_t slot) noexcept {
  auto* p = static_cast<recv_pool*>(owner);
  auto* s = reinterpret_cast<recv_slot*>(slot);
  if (s->readers > 0)
    s->release_deferred = true;  // a send still reads it: back when the last completes
  else
    p->give_back(*s);
  p->unref();
}

void recv_pool::give_back(recv_slot& s) noexcept {
  if (srq_core)
    srq_core->on_srq_release(s);
  else if (conn)
    conn->on_message_released(s);
}

void core::rx_slot_hold::operator()(verbs_region*) const noexcept {
  if (--slot->readers == 0 && std::exchange(slot->release_deferred, false)) pool->give_back(*slot);
  pool->unref();
}

bool recv_pool::note_slab(std::byte* buf, std::uint32_t n, std::uint32_t first, ibv_mr* mr) noexcept {
  auto k = home.lock();
  if (!k) return true;  // no core to find it through: sends from it are staged or registered
  try {
    auto r = std::make_shared<verbs_region>();  // mr stays null: the slab's MR is the pool's to deregister
    r->addr = buf;
    r->length = std::size_t(n) * slot_size;
    r->lkey = mr->lkey;
    r->rkey = mr->rkey;
    r->access = access::local_write;
    slab_regions.push_back(r);
    const auto base = reinterpret_cast<std::uintptr_t>(buf);
    k->rx_slabs[base] = core::rx_slab{base + r->length, this, r.get(), first, n};
  } catch (...) {
    return false;
  }
  return true;
}

recv_pool::~recv_pool() {
  if (auto k = home.lock())
    for (auto& [b, mr] : slabs) {
      auto it = k->rx_slabs.find(reinterpret_cast<std::uintptr_t>(b));
      if (it != k->rx_slabs.end() && it->second.pool == this) k->rx_slabs.erase(it);
    }
  for (auto& [b, mr] : slabs) {
    if (mr) ibv_dereg_mr(mr);
    std::free(b);
  }
}

result<void> core::srq_join(std::uint32_t grant, std::size_t slot_size) {
  if (!srq) {
    if (dattr.max_srq <= 0 || dattr.max_srq_wr <= 0) return make_error_code(errc::not_supported);
    ibv_srq_init_attr a{};
    a.attr.max_wr = static_cast<std::uint32_t>(std::min(dattr.max_srq_wr, 16384));
    a.attr.max_sge = 1;
    srq = ibv_create_srq(pd, &a);
    if (!srq) return last_errno();
    srq_cap = a.attr.max_wr;
    srq_pool = new recv_pool;
    srq_pool->pd = pdh;
    srq_pool->srq_core = this;
    srq_pool->home = weak_from_this();
    srq_pool->slot_size = slot_size;
  }
  if (slot_size > srq_pool->slot_size) return std::make_error_code(std::errc::invalid_argument);
  std::uint64_t need = srq_granted + grant;
  if (need > srq_cap) return std::make_error_code(std::errc::no_buffer_space);
  if (need > srq_pool->slots.size()) {
    auto first = srq_pool->grow(static_cast<std::uint32_t>(need - srq_pool->slots.size()), &conn_state::on_recv_wc);
    if (!first) return first.error();
    for (std::size_t i = *first; i < srq_pool->slots.size(); ++i)
      if (auto r = post_srq(srq_pool->slots[i]); !r) return r;
  }
  srq_granted = need;
  return {};
}

bool core::poll_cq() { return poll_cq_inlined(); }

bool core::device_memory_slow(std::span<const std::byte> mem, const verbs::device_memory_hooks* h) {
  const auto a = reinterpret_cast<std::uintptr_t>(mem.data());
  if (a >= last_base && a <= last_end && mem.size() <= last_end - a && !last_region.expired())
    return last_ptr->device_memory;  // the registration operations found last decides
  if (!user_regs.empty())
    if (auto sp = find_cover(user_regs, a, mem.size(), false)) return sp->device_memory;
  return h && h->is_device_memory && h->is_device_memory(mem.data(), mem.size());
}

result<verbs_region*> core::device_region(std::span<const std::byte> mem, bool need_write,
                                          const verbs::device_memory_hooks& h) {
  const int acc = need_write ? IBV_ACCESS_LOCAL_WRITE : 0;
  ibv_mr* mr = nullptr;
#ifdef SHUTTLE_HAVE_VERBS_DMABUF
  if (h.export_dmabuf) {
    std::uint64_t offset = 0;
    const int fd = h.export_dmabuf(mem.data(), mem.size(), &offset);
    if (fd >= 0) {
      mr = ibv_reg_dmabuf_mr(pd, offset, mem.size(), reinterpret_cast<std::uintptr_t>(mem.data()), fd, acc);
      ::close(fd);  // the registration holds its own reference to the buffer
    }
  }
#endif
  if (!mr && h.peermem && h.peermem())
    mr = ibv_reg_mr(pd, const_cast<std::byte*>(mem.data()), mem.size(), acc);
  if (!mr) return make_error_code(errc::unregistered_device_memory);
  ++st.registrations;
  ++st.transient_registrations;
  auto r = std::make_shared<verbs_region>();
  r->mr = mr;
  r->pd = pdh;
  r->addr = const_cast<std::byte*>(mem.data());
  r->length = mem.size();
  r->access = need_write ? unsigned(access::local_write) : 0u;
  r->lkey = mr->lkey;
  r->rkey = mr->rkey;
  r->device_memory = true;
  op_owned = std::move(r);
  return op_owned.get();
}

void core::on_unsignaled_error(const ibv_wc& wc) noexcept {
  if (conn_state* c = conn_of(wc.qp_num)) c->fail(wc_error(wc.status));
}

void core::reap_graveyard() {
  std::vector<std::shared_ptr<conn_state>> done;
  for (auto it = graveyard.begin(); it != graveyard.end();) {
    if ((*it)->outstanding == 0) {
      (*it)->reap();
      done.push_back(std::move(*it));
      it = graveyard.erase(it);
      loop->release();
    } else {
      ++it;
    }
  }
  if (!done.empty()) {
    // The last reference to this core may be among them: drop them on a
    // later turn, outside the loop's iteration over its pollers.
    loop->dispatch([d = std::move(done)]() mutable { d.clear(); });
  }
}


}  // namespace shuttle::detail::verbs_impl
