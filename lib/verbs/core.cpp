// The core's cold paths: SRQ growth, the graveyard, unsignaled errors.
#include "operations.hpp"

namespace shuttle::detail::verbs_impl {

void recv_pool::release(void* owner, std::uint64_t slot) noexcept {
  auto* p = static_cast<recv_pool*>(owner);
  if (p->srq_core)
    p->srq_core->on_srq_release(*reinterpret_cast<recv_slot*>(slot));
  else if (p->conn)
    p->conn->on_message_released(*reinterpret_cast<recv_slot*>(slot));
  p->unref();
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
