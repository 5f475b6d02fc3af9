// A connection's cold paths: the event channel, QP creation and transitions,
// the hello, shutdown and reaping.
#include "operations.hpp"

namespace shuttle::detail::verbs_impl {

result<void> conn_state::init_channel() {
  ech = rdma_create_event_channel();
  if (!ech) return last_errno();
  if (!set_nonblock(ech->fd)) return last_errno();
  cm_watch = new fd_watch(ech->fd, &on_cm, this);
  cm_watch->arm(*dom->loop);
  return {};
}

void conn_state::on_cm(void* arg) noexcept {
  auto* self = static_cast<conn_state*>(arg);
  auto keep = self->shared_from_this();  // a handler may drop the last other reference
  rdma_cm_event* e;
  while (self->ech && rdma_get_cm_event(self->ech, &e) == 0) {
    cm_evt c = copy_event(e);
    rdma_ack_cm_event(e);
    self->on_event(c);
  }
  if (self->cm_watch) self->cm_watch->arm(*self->dom->loop);
}

void conn_state::on_event(const cm_evt& e) {
  if (dying) return;
  if (acceptor && !was_open) {
    bool ok = e.type == RDMA_CM_EVENT_ESTABLISHED;
    if (ok) enter_open();
    auto* l = std::exchange(acceptor, nullptr);
    on_accept_done(l, this, ok ? std::error_code{} : cm_error(e));
    return;
  }
  if (was_open && (e.type == RDMA_CM_EVENT_DISCONNECTED || e.type == RDMA_CM_EVENT_DEVICE_REMOVAL)) {
    // What the peer sent before it disconnected completed on its side,
    // so its receives' completions are in this side's CQ already; the
    // loop may reap this event before it polls them: take them first,
    // or a recv() fails "disconnected" with its message in the CQ.
    if (e.type == RDMA_CM_EVENT_DISCONNECTED) dom->poll_cq();
    fail(disconnected());
    return;
  }
  if (was_open) return;  // TIMEWAIT_EXIT and the like
  events.push_back(e);
  cm_event.set();
}

task<result<cm_evt>> conn_state::next_event() {
  while (events.empty()) {
    if (dying) co_return make_error_code(std::errc::operation_canceled);
    cm_event.reset();
    if (auto r = co_await cm_event.wait(); !r) co_return r.error();
  }
  cm_evt e = events.front();
  events.pop_front();
  co_return e;
}

// The QP is created with ibv_create_qp and moved to INIT here, to RTR and
// RTS by ready_qp, on both sides, so that its RNR retry count is this
// side's: rdma_accept and rdma_connect would take the one the peer asked
// for in its REQ or REP, maybe 7 (retry forever).
result<void> conn_state::create_qp() {
  if (id->verbs != dom->ctx) return make_error_code(errc::not_supported);  // another device
  const std::uint32_t n = opts.receive_buffers + ctrl_reserve;  // the QP's receive queue
  if (opts.shared_receive_queue && plain) return make_error_code(errc::not_supported);  // credits keep an SRQ fed
  if (opts.shared_receive_queue) {
    if (auto r = dom->srq_join(n, opts.receive_buffer_size); !r) return r;
    srq_grant = n;
  }
  // Own receive queue: only the first few receives now (grow_receives).
  // Plain: all of them (a plain peer is told of none, it just sends).
  user_slots = srq_grant || plain ? opts.receive_buffers : std::min(opts.receive_buffers, initial_receives);
  const std::uint32_t posted_now = srq_grant ? n : user_slots + ctrl_reserve;
  // Send slots: a few now, more as they are used (grow_send).
  sq_granted = std::min(opts.send_queue_depth, initial_send_slots);
  const int want_cq = static_cast<int>(sq_granted + ctrl_reserve + 1 + posted_now);
  if (!dom->reserve_cq(want_cq)) return make_error_code(std::errc::no_buffer_space);
  cq_reserve = want_cq;

  ibv_qp_init_attr a{};
  a.send_cq = dom->cq;
  a.recv_cq = dom->cq;
  a.qp_type = IBV_QPT_RC;
  a.cap.max_send_wr = opts.send_queue_depth + ctrl_reserve + 1;  // + close()'s settling marker
  a.cap.max_recv_wr = srq_grant ? 0 : n;
  a.cap.max_send_sge = 1;
  a.cap.max_recv_sge = srq_grant ? 0 : 1;
  a.srq = srq_grant ? dom->srq : nullptr;
  a.cap.max_inline_data = opts.max_inline_data;
  a.sq_sig_all = 0;
  {
    qp = ibv_create_qp(dom->pd, &a);
    if (!qp) {  // some devices cap inline data: retry without it
      a.cap.max_inline_data = 0;
      qp = ibv_create_qp(dom->pd, &a);
    }
    if (!qp) return last_errno();
    own_qp = true;
    ibv_qp_attr qa{};
    int mask = 0;
    qa.qp_state = IBV_QPS_INIT;
    if (rdma_init_qp_attr(id, &qa, &mask) != 0) return last_errno();
    // The connecting side is here before the CM has a connection, and
    // rdma_init_qp_attr then gives no remote access (librdmacm's own
    // rdma_connect asks again before RTR): the peer's writes would end in
    // "remote invalid request". Both sides take every remote access; what
    // a peer may touch is the registrations' and windows' rights.
    qa.qp_access_flags |= IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
                          IBV_ACCESS_REMOTE_ATOMIC;
    mask |= IBV_QP_ACCESS_FLAGS;
    if (int e = ibv_modify_qp(qp, &qa, mask)) return errno_code(e);
  }
  qp_num = qp->qp_num;
  refresh_usable();
  max_inline = std::min(a.cap.max_inline_data, opts.max_inline_data);
  sq.release(sq_granted);
  dom->qp_conns[qp_num] = this;

  if (srq_grant) {  // the SRQ's buffers, already posted (srq_join)
    pool = dom->srq_pool;
    ++pool->refs;
  } else {
    // Receive pool, all posted now (before the peer may send).
    pool = new recv_pool;
    pool->pd = dom->pdh;
    pool->conn = this;
    pool->home = dom;
    pool->slot_size = opts.receive_buffer_size;
    if (auto r = pool->grow(posted_now, &on_recv_wc); !r) return r.error();
    for (std::uint32_t i = 0; i < posted_now; ++i)
      if (auto r = post_recv(pool->slots[i]); !r) return r;
  }
  // Results of atomics.
  std::size_t sbytes = (opts.send_queue_depth * 8 + 63) & ~std::size_t(63);
  scratch = static_cast<std::uint64_t*>(std::aligned_alloc(64, sbytes));
  if (!scratch) return make_error_code(std::errc::not_enough_memory);
  scratch_mr = ibv_reg_mr(dom->pd, scratch, sbytes, static_cast<int>(IBV_ACCESS_LOCAL_WRITE));
  if (!scratch_mr) return last_errno();
  for (std::uint32_t i = opts.send_queue_depth; i > 0; --i) scratch_free.push_back(i - 1);
  return {};
}

// The QP to RTR and RTS, as rdma_accept (`accepted`: this side's answer)
// or rdma_connect's handling of the REP would (its attributes from the
// CM), but with this side's RNR retry count.
result<void> conn_state::ready_qp(const rdma_conn_param* accepted) {
  ibv_qp_attr qa{};
  int mask = 0;
  qa.qp_state = IBV_QPS_RTR;
  if (rdma_init_qp_attr(id, &qa, &mask) != 0) return last_errno();
  if (accepted) qa.max_dest_rd_atomic = accepted->responder_resources;
  if (int e = ibv_modify_qp(qp, &qa, mask)) return errno_code(e);
  qa = {};
  mask = 0;
  qa.qp_state = IBV_QPS_RTS;
  if (rdma_init_qp_attr(id, &qa, &mask) != 0) return last_errno();
  if (accepted) qa.max_rd_atomic = accepted->initiator_depth;
  qa.rnr_retry = std::min<std::uint8_t>(qa.rnr_retry, rnr_retries);
  if (int e = ibv_modify_qp(qp, &qa, mask)) return errno_code(e);
  return {};
}

rdma_conn_param conn_state::conn_param(wire_hello_payload& data, const cm_evt* req) const {
  wire_hello& hello = data.hello;
  hello.magic = htonl(wire_magic);
  hello.max_slots = htonl(opts.receive_buffers);
  hello.initial_slots = htonl(user_slots);
  hello.buffer_size = htonl(static_cast<std::uint32_t>(std::min<std::size_t>(opts.receive_buffer_size, UINT32_MAX)));
  const std::size_t n = std::min(opts.payload.size(), max_connect_payload);  // checked by connect() / listen()
  data.payload_len = static_cast<std::uint8_t>(n);
  if (n) std::memcpy(data.payload, opts.payload.data(), n);  // (an empty span's data() may be null)
  rdma_conn_param p{};
  p.private_data = &data;
  p.private_data_len = static_cast<std::uint8_t>(hello_payload_offset + 1 + n);
  if (plain) {  // the payload alone, as the bare private data
    p.private_data = n ? opts.payload.data() : nullptr;
    p.private_data_len = static_cast<std::uint8_t>(n);
  }
  // As many RDMA READs (and atomics) in flight as the device allows, each
  // way: every READ of a block list holds one of the responder's resources
  // until its response is in, so this depth bounds a list of small reads
  // (rxe allows 128; the CM's field is 8 bits). The passive side answers
  // with at most what the request offers.
  const auto cap = [](int v) { return static_cast<std::uint8_t>(std::clamp(v, 0, 255)); };
  const std::uint8_t responder = cap(dom->dattr.max_qp_rd_atom), initiator = cap(dom->dattr.max_qp_init_rd_atom);
  p.responder_resources = responder;
  p.initiator_depth = initiator;
  if (req) {
    p.responder_resources = std::min(responder, req->initiator_depth);
    p.initiator_depth = std::min(initiator, req->responder_resources);
  }
  p.retry_count = 7;
  p.rnr_retry_count = rnr_retries;  // the peer's QP: what it may retry on this side's RNR NAKs
  return p;
}

// The peer's hello, checked against what this side can honour: credits
// (its receives) at most what a QP of this device can have posted, the
// initial ones within its cap, a buffer size in [1, the port's max
// message size].
// Then its payload: a length byte (none, past 16 bytes of private data:
// an empty payload) within the bound and within what arrived.
std::error_code conn_state::take_hello(const cm_evt& e) {
  const auto bad = make_error_code(errc::protocol_error);
  if (e.priv_len < sizeof(wire_hello)) return bad;
  wire_hello h;
  std::memcpy(&h, e.priv.data(), sizeof h);
  if (ntohl(h.magic) != wire_magic) return bad;
  const std::uint32_t max_slots = ntohl(h.max_slots), initial = ntohl(h.initial_slots);
  const std::uint32_t buffer = ntohl(h.buffer_size);
  const auto device_cap = static_cast<std::uint32_t>(std::max({dom->dattr.max_qp_wr, dom->dattr.max_srq_wr, 1}));
  if (max_slots == 0 || max_slots > device_cap || initial == 0 || initial > max_slots) return bad;
  if (buffer == 0 || buffer > dom->max_msg) return bad;
  const std::size_t n = e.priv_len > hello_payload_offset ? e.priv[hello_payload_offset] : 0;
  if (n > max_connect_payload || (n > 0 && hello_payload_offset + 1 + n > e.priv_len))
    return make_error_code(errc::message_too_long);
  const auto* first = reinterpret_cast<const std::byte*>(e.priv.data()) + hello_payload_offset + 1;
  peer_payload.assign(first, first + n);
  peer_max_slots = max_slots;
  peer_slots = initial;
  peer_buffer = buffer;
  return {};
}

void conn_state::abort_qp() {
  if (qp && !qp_err) {
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_ERR;
    ibv_modify_qp(qp, &a, IBV_QP_STATE);
    qp_err = true;
  }
}

// The connection object is gone: flush, then free once nothing is posted.
void conn_state::shutdown() {
  if (dying) return;
  fail(disconnected());
  dying = true;
  if (outstanding == 0)
    reap();
  else {
    dom->graveyard.push_back(shared_from_this());
    dom->loop->hold();  // until reaped: the loop's end lets the flush finish (io_context::hold)
  }
}

void conn_state::reap() noexcept {
  if (reaped) return;
  reaped = true;
  if (in_repost_list) {  // freed before the next poll (a graveyard reap dropped on the next turn)
    auto& l = dom->repost_conns;
    l.erase(std::remove(l.begin(), l.end(), this), l.end());
    in_repost_list = false;
  }
  if (cm_watch) std::exchange(cm_watch, nullptr)->destroy();
  if (qp) {
    auto it = dom->qp_conns.find(qp_num);
    if (it != dom->qp_conns.end() && it->second == this) dom->qp_conns.erase(it);
    if (own_qp)
      ibv_destroy_qp(qp);
    else
      rdma_destroy_qp(id);
  }
  qp = nullptr;
  refresh_usable();
  if (id) rdma_destroy_id(id);
  if (ech) rdma_destroy_event_channel(ech);
  id = nullptr;
  ech = nullptr;
  if (srq_grant) {
    // Messages never taken by recv() hold SRQ buffers: back to the SRQ.
    if (dom->srq)
      for (auto& it : rx) (void)dom->post_srq(*it.slot);
    rx.clear();
    dom->srq_leave(std::exchange(srq_grant, 0));
  }
  if (pool) {
    if (pool->conn == this) pool->conn = nullptr;
    std::exchange(pool, nullptr)->unref();
  }
  if (scratch_mr) ibv_dereg_mr(scratch_mr);
  std::free(scratch);
  scratch = nullptr;
  dom->cq_reserved -= cq_reserve;
  --dom->st.live_connections;
}

}  // namespace shuttle::detail::verbs_impl
