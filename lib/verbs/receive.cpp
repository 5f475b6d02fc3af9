// A connection's receive side: completions of its receives, and its
// buffers going back to the QP (or the SRQ) as the application releases
// the messages.
#include "operations.hpp"

namespace shuttle::detail::verbs_impl {

void conn_state::on_recv_wc(wr_ctx* w, const ibv_wc& wc) noexcept {
  auto* s = static_cast<recv_slot*>(w);
  conn_state* c = s->pool->conn;
  if (core* k = s->pool->srq_core) {
    // SRQ: the completion names the QP; a buffer nobody can take goes back.
    c = k->conn_of(wc.qp_num);
    s->qp_num = wc.qp_num;
    if (!c || c->dying || !c->usable() || wc.status != IBV_WC_SUCCESS) {
      if (c && wc.status != IBV_WC_SUCCESS && wc.status != IBV_WC_WR_FLUSH_ERR)
        c->fail(verbs::make_wc_error(wc.status));
      if (wc.status == IBV_WC_SUCCESS || wc.status == IBV_WC_WR_FLUSH_ERR) (void)k->post_srq(*s);
      return;
    }
  } else {
    --c->outstanding;
    if (wc.status != IBV_WC_SUCCESS) {
      if (wc.status != IBV_WC_WR_FLUSH_ERR) c->fail(verbs::make_wc_error(wc.status));
      return;
    }
  }
  ++c->rx_count;
  if (wc.opcode == IBV_WC_RECV && (wc.wc_flags & IBV_WC_WITH_IMM) && !c->plain) {
    std::uint32_t imm = ntohl(wc.imm_data);
    if ((imm & 0xffff) && !c->take_credits(imm & 0xffff)) {
      if (core* k = s->pool->srq_core) (void)k->post_srq(*s);
      return;
    }
    if (imm & ctrl_flag) {  // control message: its receive goes straight back
      if (c->usable() || s->pool->srq_core) (void)c->repost(*s);
      return;
    }
  }
  if (c->user_slots < c->opts.receive_buffers && !c->grow_pending && !c->grow_stopped && !s->pool->srq_core) {
    c->grow_pending = true;  // the peer uses its credits: more receives at the next poll (post_released)
    if (!c->in_repost_list) {
      c->in_repost_list = true;
      c->dom->repost_conns.push_back(c);
    }
  }
  rx_item it{s, 0, std::nullopt};
  if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM)
    it.imm = ntohl(wc.imm_data);
  else
    it.len = wc.byte_len;
  if (c->plain && wc.opcode == IBV_WC_RECV && (wc.wc_flags & IBV_WC_WITH_IMM)) it.imm = ntohl(wc.imm_data);
  if (wait_node* n = c->receivers.wake_one()) {
    auto* w = static_cast<recv_waiter*>(n);
    ++s->pool->refs;  // the waiter's until it builds the message (adopt_message)
    w->item = it;
    w->has_msg = true;
  } else {
    c->rx.push_back(it);
  }
}

void conn_state::on_message_released(recv_slot& slot) {
  if (!usable()) return;
  released.push_back(&slot);
  if (!in_repost_list) {
    in_repost_list = true;
    dom->repost_conns.push_back(this);
  }
}

// Posts the released buffers as one chain; each posted one is a credit.
void conn_state::post_released() noexcept {
  std::size_t done = 0;
  while (usable() && done < released.size()) {
    constexpr std::size_t chunk = 32;
    ibv_sge sge[chunk];
    ibv_recv_wr wr[chunk];
    const std::size_t n = std::min(chunk, released.size() - done);
    for (std::size_t i = 0; i < n; ++i) {
      fill_recv_wr(*released[done + i], wr[i], sge[i]);
      wr[i].next = i + 1 < n ? &wr[i + 1] : nullptr;
    }
    ibv_recv_wr* bad = nullptr;
    const int e = ibv_post_recv(qp, wr, &bad);
    const std::size_t posted = e == 0 ? n : static_cast<std::size_t>(bad - wr);
    outstanding += posted;
    to_return += static_cast<std::uint32_t>(posted);
    done += n;
    if (e != 0) break;  // as a failed single post: that buffer is not posted, its credit not returned
  }
  released.clear();
  if (std::exchange(grow_pending, false)) grow_receives();
  maybe_send_credits();
}

// SRQ: the buffer went back to the SRQ; the credit goes to this connection.
void conn_state::on_srq_credit() {
  if (!usable()) return;
  ++to_return;
  maybe_send_credits();
}

}  // namespace shuttle::detail::verbs_impl
