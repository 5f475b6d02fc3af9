// One RC connection's state: QP, receive pool, credits, and its operations
// (the hot path, inline so that it reaches across files).
#pragma once

#include "core.hpp"

namespace shuttle::detail::verbs_impl {

// ------------------------------------------------------------------ connection state

struct conn_state final : std::enable_shared_from_this<conn_state> {
  std::shared_ptr<core> dom;
  connection_options opts;
  rdma_event_channel* ech = nullptr;
  rdma_cm_id* id = nullptr;
  ibv_qp* qp = nullptr;
  fd_watch* cm_watch = nullptr;
  int cq_reserve = 0;

  bool established = false, closed = false, error = false, qp_err = false, dying = false, reaped = false;
  bool usable_ = false;  // usable()
  bool disconnect_sent = false, woken = false;
  std::deque<cm_evt> events;
  event cm_event;

  recv_pool* pool = nullptr;
  struct rx_item {
    recv_slot* slot;
    std::uint32_t len;
    std::optional<std::uint32_t> imm;
  };
  std::deque<rx_item> rx;  // arrived, not yet taken (no recv() was waiting)
  // recv() calls waiting, oldest first: an arriving message goes straight to
  // the oldest (it then owns it, whatever else calls recv() before it runs).
  struct recv_waiter : wait_node {
    rx_item item{};  // handed over, not yet a message (built where the recv() resumes)
    bool has_msg = false;
  };
  wait_list receivers;
  // The message owns its buffer (and a reference to the buffer's pool) from
  // here on; built in the result, not moved there.
  static result<message> take_message(const rx_item& it) noexcept {
    ++it.slot->pool->refs;
    return adopt_message(it);
  }
  // The same, for a buffer whose pool reference is held already (a message
  // handed to a waiting recv(): the connection may be gone when it resumes).
  static result<message> adopt_message(const rx_item& it) noexcept {
    // The message's slot word is the buffer's recv_slot (see recv_pool::release).
    return result<message>(std::in_place, std::span<const std::byte>(it.slot->addr, it.len), it.imm,
                           &recv_pool::release, it.slot->pool, reinterpret_cast<std::uintptr_t>(it.slot));
  }

  semaphore sq{0};
  semaphore credits{0};
  std::uint32_t srq_grant = 0;  // SRQ: the receives this connection accounts for in the SRQ
  std::uint32_t qp_num = 0;
  std::size_t outstanding = 0;  // posted WRs (sends and receives) not completed yet
  std::size_t inflight_ops = 0;
  event drained;

  // Inline sends complete once posted: their bytes are in the work request,
  // so nothing waits for the NIC. They go unsignaled (wr_id 0), except every
  // settle_every-th, which is signaled and names `settle`: its completion
  // gives back the send-queue slots of the unsignaled ones before it (RC
  // completes a send queue in order). An unsignaled WR comes back only with
  // an error or a flush; poll_cq finds its connection by QP number.
  std::uint32_t unsignaled = 0;        // inline sends posted since the last settling WR
  std::uint32_t settle_every = 1;
  std::deque<std::uint32_t> settling;  // slots each posted settling WR gives back, oldest first
  struct settle_ctx : wr_ctx {
    conn_state* c = nullptr;
  } settle;
  ibv_send_wr inline_wr{};  // post_inline_send's work request (opcode and sge set once)
  ibv_sge inline_sge{};

  std::uint32_t peer_slots = 0, peer_buffer = 0, max_inline = 0;
  std::uint32_t peer_max_slots = 0;  // the peer's announced cap: credits held never exceed it
  std::uint32_t to_return = 0, ctrl_inflight = 0;
  // Own receive queue: user receives posted so far (the rest of the pool
  // comes as messages arrive, grow_receives); grow_pending: one is due.
  std::uint32_t user_slots = 0;
  bool grow_pending = false, grow_stopped = false;
  bool own_qp = false;        // created here (passive side), not by rdma_create_qp: its transitions are ours
  std::uint64_t rx_count = 0;  // receive completions: the listener's idle check
  std::error_code fail_reason;  // why it failed, when the connection's own fault (recv returns it)
  std::vector<recv_slot*> released;  // own receive queue: buffers to post again (core::flush_reposts)
  bool in_repost_list = false;
  struct ctrl_ctx : wr_ctx {
    conn_state* c = nullptr;
  } ctrl;

  std::vector<verbs_grant*> grants;  // memory windows bound on this QP (connection::grant)

  ibv_mr* scratch_mr = nullptr;
  std::uint64_t* scratch = nullptr;
  std::vector<std::uint32_t> scratch_free;

  conn_state(std::shared_ptr<core> d, connection_options o) : dom(std::move(d)), opts(o) {
    if (opts.send_queue_depth == 0) opts.send_queue_depth = 1;
    if (opts.receive_buffers == 0) opts.receive_buffers = 1;
    if (opts.receive_buffer_size == 0) opts.receive_buffer_size = 1;
    ctrl.c = this;
    ctrl.on_wc = &on_ctrl_wc;
    settle.c = this;
    settle.on_wc = &on_settle_wc;
    inline_wr.opcode = IBV_WR_SEND_WITH_IMM;
    inline_wr.sg_list = &inline_sge;
    // A quarter of the queue: at most that many slots wait to be given back.
    settle_every = std::max<std::uint32_t>(1, opts.send_queue_depth / 4);
    ++dom->st.live_connections;
  }
  ~conn_state() { reap(); }

  result<void> init_channel() {
    ech = rdma_create_event_channel();
    if (!ech) return last_errno();
    if (!set_nonblock(ech->fd)) return last_errno();
    cm_watch = new fd_watch(ech->fd, &on_cm, this);
    cm_watch->arm(*dom->loop);
    return {};
  }

  static void on_cm(void* arg) noexcept {
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

  // Passive side: told when the handshake ends (true: established).
  // (an error: the handshake failed, and why).
  void (*on_accept_done)(void* listener, conn_state* st, std::error_code failed) noexcept = nullptr;
  void* acceptor = nullptr;

  void on_event(const cm_evt& e) {
    if (dying) return;
    if (acceptor && !established) {
      bool ok = e.type == RDMA_CM_EVENT_ESTABLISHED;
      if (ok) on_established();
      auto* l = std::exchange(acceptor, nullptr);
      on_accept_done(l, this, ok ? std::error_code{} : cm_error(e));
      return;
    }
    if (established && (e.type == RDMA_CM_EVENT_DISCONNECTED || e.type == RDMA_CM_EVENT_DEVICE_REMOVAL)) {
      // What the peer sent before it disconnected completed on its side,
      // so its receives' completions are in this side's CQ already; the
      // loop may reap this event before it polls them: take them first,
      // or a recv() fails "disconnected" with its message in the CQ.
      if (e.type == RDMA_CM_EVENT_DISCONNECTED) dom->poll_cq();
      fail(disconnected());
      return;
    }
    if (established) return;  // TIMEWAIT_EXIT and the like
    events.push_back(e);
    cm_event.set();
  }

  task<result<cm_evt>> next_event() {
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
  result<void> create_qp() {
    if (id->verbs != dom->ctx) return make_error_code(errc::not_supported);  // another device
    const std::uint32_t n = opts.receive_buffers + ctrl_reserve;  // the QP's receive queue
    if (opts.shared_receive_queue) {
      if (auto r = dom->srq_join(n, opts.receive_buffer_size); !r) return r;
      srq_grant = n;
    }
    // Own receive queue: only the first few receives now (grow_receives).
    user_slots = srq_grant ? opts.receive_buffers : std::min(opts.receive_buffers, initial_receives);
    const std::uint32_t posted_now = srq_grant ? n : user_slots + ctrl_reserve;
    const int want_cq = static_cast<int>(opts.send_queue_depth + ctrl_reserve + 1 + posted_now);
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
    sq.release(opts.send_queue_depth);
    dom->qp_conns[qp_num] = this;

    if (srq_grant) {  // the SRQ's buffers, already posted (srq_join)
      pool = dom->srq_pool;
      ++pool->refs;
    } else {
      // Receive pool, all posted now (before the peer may send).
      pool = new recv_pool;
      pool->pd = dom->pdh;
      pool->conn = this;
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
  result<void> ready_qp(const rdma_conn_param* accepted) {
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

  // Own receive queue: the user receives double (up to receive_buffers)
  // once the peer uses them; each new one is a credit for it. Growth stops
  // where memory or the shared CQ runs out (the connection keeps working
  // with what it has).
  void grow_receives() noexcept {
    const std::uint32_t add = std::min(user_slots, opts.receive_buffers - user_slots);
    if (add == 0 || grow_stopped || !usable()) return;
    if (!dom->reserve_cq(static_cast<int>(add))) {
      grow_stopped = true;
      return;
    }
    cq_reserve += static_cast<int>(add);
    auto first = pool->grow(add, &on_recv_wc);
    if (!first) {
      grow_stopped = true;
      return;
    }
    for (std::size_t i = *first; i < pool->slots.size(); ++i) {
      if (!post_recv(pool->slots[i])) {
        grow_stopped = true;
        break;
      }
      ++user_slots;
      ++to_return;
    }
  }

  // Credits the peer returns: never more outstanding than it announced it
  // could have posted; past that it broke the protocol (false: failed).
  bool take_credits(std::uint32_t n) noexcept {
    if (error) return true;  // failed already: every waiter was woken
    if (credits.available() + n > peer_max_slots) {
      ++dom->st.protocol_errors;
      fail_with(make_error_code(errc::protocol_error));
      return false;
    }
    credits.release(n);
    return true;
  }

  // Puts a receive buffer back: on the QP's own receive queue or the SRQ.
  result<void> repost(recv_slot& s) { return s.pool->srq_core ? s.pool->srq_core->post_srq(s) : post_recv(s); }

  result<void> post_recv(recv_slot& s) {
    ibv_sge sge;
    ibv_recv_wr wr;
    fill_recv_wr(s, wr, sge);
    ibv_recv_wr* bad = nullptr;
    if (int e = ibv_post_recv(qp, &wr, &bad)) return errno_code(e);
    ++outstanding;
    return {};
  }

  rdma_conn_param conn_param(wire_hello& hello, const cm_evt* req) const {
    hello.magic = htonl(wire_magic);
    hello.max_slots = htonl(opts.receive_buffers);
    hello.initial_slots = htonl(user_slots);
    hello.buffer_size = htonl(static_cast<std::uint32_t>(std::min<std::size_t>(opts.receive_buffer_size, UINT32_MAX)));
    rdma_conn_param p{};
    p.private_data = &hello;
    p.private_data_len = sizeof hello;
    auto rd = static_cast<std::uint8_t>(std::min({dom->dattr.max_qp_rd_atom, dom->dattr.max_qp_init_rd_atom, 16}));
    p.responder_resources = rd;
    p.initiator_depth = rd;
    if (req) {
      p.responder_resources = std::min(rd, req->initiator_depth);
      p.initiator_depth = std::min(rd, req->responder_resources);
    }
    p.retry_count = 7;
    p.rnr_retry_count = rnr_retries;  // the peer's QP: what it may retry on this side's RNR NAKs
    return p;
  }

  // The peer's hello, checked against what this side can honour: credits
  // (its receives) at most what a QP of this device can have posted, the
  // initial ones within its cap, a buffer size in [1, the port's max
  // message size].
  bool take_hello(const cm_evt& e) {
    if (e.priv_len < sizeof(wire_hello)) return false;
    wire_hello h;
    std::memcpy(&h, e.priv.data(), sizeof h);
    if (ntohl(h.magic) != wire_magic) return false;
    const std::uint32_t max_slots = ntohl(h.max_slots), initial = ntohl(h.initial_slots);
    const std::uint32_t buffer = ntohl(h.buffer_size);
    const auto device_cap = static_cast<std::uint32_t>(std::max({dom->dattr.max_qp_wr, dom->dattr.max_srq_wr, 1}));
    if (max_slots == 0 || max_slots > device_cap || initial == 0 || initial > max_slots) return false;
    if (buffer == 0 || buffer > dom->max_msg) return false;
    peer_max_slots = max_slots;
    peer_slots = initial;
    peer_buffer = buffer;
    return true;
  }

  void on_established() {
    established = true;
    refresh_usable();
    credits.release(peer_slots);
  }

  // fail, remembering why (recv() returns it): the connection's own fault.
  void fail_with(std::error_code ec) {
    if (!fail_reason) fail_reason = ec;
    fail(ec);
  }

  // Terminal: pending and later operations fail; the QP is flushed.
  void fail(std::error_code) {
    error = true;
    refresh_usable();
    if (established && !disconnect_sent && id) {
      disconnect_sent = true;
      rdma_disconnect(id);  // tells the peer; moves the QP to error
    }
    abort_qp();
    if (!woken) {
      woken = true;
      credits.release(1u << 20);
      sq.release(1u << 20);
    }
    receivers.wake_all();
    cm_event.set();
    drained.set();
  }

  void abort_qp() {
    if (qp && !qp_err) {
      ibv_qp_attr a{};
      a.qp_state = IBV_QPS_ERR;
      ibv_modify_qp(qp, &a, IBV_QP_STATE);
      qp_err = true;
    }
  }

  // The connection object is gone: flush, then free once nothing is posted.
  void shutdown() {
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

  void reap() noexcept {
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

  // Operations may be posted: kept as one flag (refresh_usable after each
  // of its four inputs changes), tested once per operation.
  bool usable() const noexcept { return usable_; }
  void refresh_usable() noexcept { usable_ = established && !error && !closed && qp; }

  // Credits: freed receive buffers go back to the peer.
  void maybe_send_credits() {
    std::uint32_t threshold = std::max<std::uint32_t>(1, user_slots / 4);
    while (usable() && to_return >= threshold && ctrl_inflight < ctrl_reserve) {
      std::uint32_t n = std::min<std::uint32_t>(to_return, 0xffff);
      ibv_send_wr wr{};
      wr.wr_id = reinterpret_cast<std::uintptr_t>(static_cast<wr_ctx*>(&ctrl));
      wr.opcode = IBV_WR_SEND_WITH_IMM;
      wr.send_flags = IBV_SEND_SIGNALED;
      wr.imm_data = htonl(ctrl_flag | n);
      ibv_send_wr* bad = nullptr;
      if (ibv_post_send(qp, &wr, &bad) != 0) return;
      to_return -= n;
      ++ctrl_inflight;
      ++outstanding;
    }
  }

  static void on_ctrl_wc(wr_ctx* w, const ibv_wc& wc) noexcept {
    conn_state* c = static_cast<ctrl_ctx*>(w)->c;
    --c->outstanding;
    --c->ctrl_inflight;
    if (wc.status != IBV_WC_SUCCESS) {
      if (wc.status != IBV_WC_WR_FLUSH_ERR) c->fail(verbs::make_wc_error(wc.status));
      return;
    }
    c->maybe_send_credits();
  }

  // An inline send whose slot and credit the caller holds (try_reserve):
  // done once posted (see `settle`). It fills in only what changes of the
  // work request built once (inline_wr).
  result<void> post_inline_send(std::span<const std::byte> msg) noexcept {
    ibv_send_wr& wr = inline_wr;
    inline_sge.addr = reinterpret_cast<std::uintptr_t>(msg.data());
    inline_sge.length = static_cast<std::uint32_t>(msg.size());
    wr.num_sge = msg.empty() ? 0 : 1;
    const std::uint32_t credits_back = std::min<std::uint32_t>(to_return, 0xffff);  // piggybacked
    wr.imm_data = htonl(credits_back);
    const bool settles = unsignaled + 1 >= settle_every;
    wr.send_flags = settles ? IBV_SEND_INLINE | IBV_SEND_SIGNALED : IBV_SEND_INLINE;
    wr.wr_id = settles ? reinterpret_cast<std::uintptr_t>(static_cast<wr_ctx*>(&settle)) : 0;
    ibv_send_wr* bad = nullptr;
    if (int e = ibv_post_send(qp, &wr, &bad)) {
      unreserve(true);
      return errno_code(e);
    }
    to_return -= credits_back;
    if (settles)
      track_settling(unsignaled + 1);
    else
      ++unsignaled;
    return {};
  }
  // close(): the unsignaled sends are settled before the disconnect, which
  // would flush any the NIC has not sent yet. The marker is a zero-length
  // RDMA write (IB C9-88: it names no memory and needs no rkey) on the send
  // queue entry kept for it; it holds no slot of its own.
  void settle_unsignaled() noexcept {
    if (unsignaled == 0 || !usable()) return;
    ibv_send_wr wr{};
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr_id = reinterpret_cast<std::uintptr_t>(static_cast<wr_ctx*>(&settle));
    ibv_send_wr* bad = nullptr;
    if (ibv_post_send(qp, &wr, &bad) != 0) return;  // the disconnect flushes what is left
    track_settling(unsignaled);
  }
  void track_settling(std::uint32_t slots) {
    settling.push_back(slots);
    unsignaled = 0;
    ++outstanding;
    ++inflight_ops;
    ++dom->inflight;
  }
  static void on_settle_wc(wr_ctx* w, const ibv_wc& wc) noexcept {
    conn_state* c = static_cast<settle_ctx*>(w)->c;
    --c->outstanding;
    --c->dom->inflight;
    c->sq.release(c->settling.front());
    c->settling.pop_front();
    c->end_op();
    if (wc.status != IBV_WC_SUCCESS && wc.status != IBV_WC_WR_FLUSH_ERR) c->fail(verbs::make_wc_error(wc.status));
  }

  static void on_recv_wc(wr_ctx* w, const ibv_wc& wc) noexcept {
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
    if (wc.opcode == IBV_WC_RECV && (wc.wc_flags & IBV_WC_WITH_IMM)) {
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
    if (wait_node* n = c->receivers.wake_one()) {
      auto* w = static_cast<recv_waiter*>(n);
      ++s->pool->refs;  // the waiter's until it builds the message (adopt_message)
      w->item = it;
      w->has_msg = true;
    } else {
      c->rx.push_back(it);
    }
  }

  void on_message_released(recv_slot& slot) {
    if (!usable()) return;
    released.push_back(&slot);
    if (!in_repost_list) {
      in_repost_list = true;
      dom->repost_conns.push_back(this);
    }
  }
  // Posts the released buffers as one chain; each posted one is a credit.
  void post_released() noexcept {
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
  void on_srq_credit() {
    if (!usable()) return;
    ++to_return;
    maybe_send_credits();
  }

  // An operation is over (its slot given back or about to be): close() waits
  // for the last one. Inlined: it ends every operation's latency path.
  [[gnu::always_inline]] void end_op() noexcept {
    if (--inflight_ops == 0 && closed) drained.set();
  }

  // The stop callback of an operation whose work requests the NIC may hold:
  // they cannot be withdrawn alone, so the connection goes to the error state
  // (from the loop's thread) and the operation resumes on the flushed
  // completion.
  template <class Wait>
  struct cancel_in_flight {
    Wait* self;
    void operator()() const noexcept {
      self->cancelled.store(true);
      cancel_on_loop(*self->ctx, [wp = self->c->weak_from_this()] {
        if (auto s = wp.lock()) s->fail(disconnected());
      });
    }
  };

  // Posts one signaled WR and waits for its completion. `credit`: it consumes
  // a receive on the peer. `atomic_result`: local sge is a scratch word whose
  // value is returned.
  struct op_wait : wr_ctx {
    conn_state* c = nullptr;
    io_context* ctx = nullptr;
    std::coroutine_handle<> h{};
    ibv_wc_status status = IBV_WC_SUCCESS;
    std::uint32_t byte_len = 0;
    bool done = false;
    std::atomic<bool> cancelled{false};
    using cancel_cb = cancel_in_flight<op_wait>;
    std::optional<std::stop_callback<cancel_cb>> scb;

    bool await_ready() const noexcept { return done; }
    // Callers hold no reference of their own to the connection state while
    // nothing waits: the wait takes one (the state may be dying by the time
    // the completion resumes it).
    std::shared_ptr<conn_state> keep;
    template <class P>
    void await_suspend(std::coroutine_handle<P> hh) {
      suspend(hh, stop_token_of(hh));
    }
    void suspend(std::coroutine_handle<> hh, std::stop_token t) {
      h = hh;
      keep = c->shared_from_this();
      if (t.stop_possible()) scb.emplace(std::move(t), cancel_cb{this});
    }
    void await_resume() const noexcept {}

    static void on_complete(wr_ctx* w, const ibv_wc& wc) noexcept { static_cast<op_wait*>(w)->complete(wc); }
    [[gnu::always_inline]] void complete(const ibv_wc& wc) noexcept {  // also inlined into core::poll_cq
      status = wc.status;
      byte_len = wc.byte_len;
      done = true;
      --c->outstanding;
      --c->dom->inflight;
      if (wc.status != IBV_WC_SUCCESS && wc.status != IBV_WC_WR_FLUSH_ERR) c->fail(verbs::make_wc_error(wc.status));
      scb.reset();
      if (h) ctx->post(h);
    }
  };

  // A send-queue slot and, for `credit`, a peer receive, if both can be had
  // now (the semaphores are FIFO: this never overtakes a waiter).
  bool try_reserve(bool credit) noexcept {
    if (ordered_waiting > 0) return false;  // an operation that waited posts first
    if (!sq.try_acquire()) return false;
    if (credit && !credits.try_acquire()) {
      sq.release();
      return false;
    }
    return true;
  }
  void unreserve(bool credit) noexcept {
    sq.release();
    if (credit) credits.release();
  }

  // One signaled WR whose slot (and credit) the caller holds: posted when
  // awaited, its completion awaited in the caller's frame (no frame of its
  // own: the latency path of every operation goes through here).
  // `atomic_result`: the local sge becomes a scratch word whose value is
  // returned.
  struct posted_op : op_wait {
    ibv_send_wr wr;
    ibv_sge sge;
    bool credit, atomic_result;
    std::uint32_t slot = 0;
    int post_error = 0;

    posted_op(conn_state* conn, const ibv_send_wr& w, const ibv_sge& g, bool cr, bool atomic) noexcept
        : wr(w), sge(g), credit(cr), atomic_result(atomic) {
      c = conn;
    }
    // Filled in place by the caller: no copy of the WR. Not zeroed (128
    // bytes on every operation's path): the caller sets the fields its
    // opcode uses (remote address, rkey, imm_data, atomic operands) and
    // local_sge the sge; a provider reads nothing else of an RC WR.
    posted_op(conn_state* conn, ibv_wr_opcode opcode, bool cr, bool atomic) noexcept
        : credit(cr), atomic_result(atomic) {  // NOLINT(cppcoreguidelines-pro-type-member-init)
      c = conn;
      wr.next = nullptr;
      wr.opcode = opcode;
      wr.send_flags = 0;
    }
    // Inlined into the launch (finish_setup): a call's prologue and
    // epilogue cost a tenth of this path in an emulated guest.
    [[gnu::always_inline]] bool await_ready() noexcept {
      set_post_fields();
      return post();
    }
    // The fields that tie the WR to this op: the same for every post of
    // it, so a prepared operation sets them once.
    [[gnu::always_inline]] void set_post_fields() noexcept {
      ctx = c->dom->loop;
      on_wc = &op_wait::on_complete;
      wr.wr_id = reinterpret_cast<std::uintptr_t>(static_cast<wr_ctx*>(this));
      wr.send_flags |= IBV_SEND_SIGNALED;
      wr.sg_list = &sge;
      wr.num_sge = sge.length > 0 || atomic_result ? 1 : 0;
    }
    // Posts the WR (set_post_fields done); true: over already (failed, or
    // completed by the inline look at the CQ).
    [[gnu::always_inline]] bool post() noexcept {
      if (!c->usable()) {
        post_error = -1;
        c->unreserve(credit);
        return true;
      }
      if (atomic_result) {
        slot = c->scratch_free.back();
        c->scratch_free.pop_back();
        sge.addr = reinterpret_cast<std::uintptr_t>(c->scratch + slot);
        sge.length = 8;
        sge.lkey = c->scratch_mr->lkey;
      }
      if (wr.opcode == IBV_WR_SEND_WITH_IMM) {  // piggybacked credits
        std::uint32_t n = std::min<std::uint32_t>(c->to_return, 0xffff);
        c->to_return -= n;
        wr.imm_data = htonl(n);
      }
      ibv_send_wr* bad = nullptr;
      if (int e = ibv_post_send(c->qp, &wr, &bad)) {
        post_error = e;
        if (atomic_result) c->scratch_free.push_back(slot);
        c->unreserve(credit);
        return true;
      }
      count_posted();
      // Soft-RoCE (and a fast NIC) may have completed it already: one look
      // at the CQ here saves a turn of the loop (a suspension, a wake-up) on
      // the latency path. Coroutines are never resumed from inside the
      // poller (wake-ups are posted), so this cannot re-enter core::poll.
      c->dom->poll_inline();
      return done;
    }
    // The WR is in the send queue: complete() and end_op() count it out.
    [[gnu::always_inline]] void count_posted() noexcept {
      ++c->outstanding;
      ++c->inflight_ops;
      ++c->dom->inflight;
    }
    [[gnu::always_inline]] result<std::uint64_t> await_resume() noexcept {
      if (post_error < 0) return disconnected();
      if (post_error > 0) return errno_code(post_error);
      if (atomic_result) c->scratch_free.push_back(slot);
      c->end_op();
      c->sq.release();
      if (status == IBV_WC_SUCCESS) return atomic_result ? c->scratch[slot] : byte_len;
      if (cancelled.load()) return std::make_error_code(std::errc::operation_canceled);
      if (status == IBV_WC_WR_FLUSH_ERR) return disconnected();
      return wc_error(status);
    }
  };
  posted_op post_reserved(const ibv_send_wr& wr, const ibv_sge& sge, bool credit, bool atomic_result) noexcept {
    return posted_op(this, wr, sge, credit, atomic_result);
  }

  // Operations post in the order they were called. One that must wait for
  // a send-queue slot or a credit queues on `post_order` (FIFO) and holds it
  // from its first wait to its post; while any is in there, try_reserve
  // fails, so no later operation overtakes it. Without this a waiter handed
  // a unit by release() resumed only after a newer operation had taken
  // another unit of the same release and posted (transfer-rdma saw chunk 8
  // before chunk 5 once credits ran short).
  mutex post_order;
  std::uint32_t ordered_waiting = 0;  // operations from their first wait to their post
  struct ordered_turn {  // counts one operation in ordered_waiting, until done()
    conn_state* c;
    bool in = true;
    explicit ordered_turn(conn_state* s) noexcept : c(s) { ++c->ordered_waiting; }
    void done() noexcept {
      if (std::exchange(in, false)) --c->ordered_waiting;
    }
    ~ordered_turn() { done(); }
  };
  // Resumes when a posted_op posted by hand completes.
  struct posted_wait {
    posted_op& op;
    bool await_ready() const noexcept { return op.done; }
    template <class P>
    void await_suspend(std::coroutine_handle<P> h) {
      op.await_suspend(h);
    }
    void await_resume() const noexcept {}
  };

  // Waits for a send-queue slot (and a credit), then posts. Callers try
  // try_reserve + post_reserved first, in their own frame.
  task<result<std::uint64_t>> execute(ibv_send_wr wr, ibv_sge sge, bool credit, bool atomic_result,
                                      std::shared_ptr<verbs_region> keep) {
    // The caller's frame holds the registration; this frame the state.
    (void)keep;
    auto self = shared_from_this();
    if (!usable()) co_return disconnected();
    ordered_turn turn(this);
    auto order = co_await post_order.lock();
    if (!order) co_return order.error();
    if (auto r = co_await sq.acquire(); !r) co_return r.error();
    if (credit) {
      if (auto r = co_await credits.acquire(); !r) {
        sq.release();
        co_return r.error();
      }
    }
    posted_op op = post_reserved(wr, sge, credit, atomic_result);
    const bool over = op.await_ready();  // posts
    turn.done();
    order->unlock();
    if (!over) co_await posted_wait{op};
    co_return op.await_resume();
  }

  // ---------------------------------------------------------------- batches

  struct batch_wait;
  struct batch_chunk {
    struct ctx : wr_ctx {
      batch_chunk* ch = nullptr;
    } early, last;  // early: the unsignaled WRs (errors and flushes only); last: the signaled one
    batch_wait* b = nullptr;
    std::uint32_t slots = 0;
    std::size_t partial = 0;  // ibv_post_send took only a prefix: its WRs, each to be flushed
    ibv_wc_status early_status = IBV_WC_SUCCESS, status = IBV_WC_SUCCESS;

    static void on_early(wr_ctx* w, const ibv_wc& wc) noexcept {
      batch_chunk* ch = static_cast<ctx*>(w)->ch;
      conn_state* c = ch->b->c;
      if (wc.status != IBV_WC_SUCCESS && ch->early_status == IBV_WC_SUCCESS) ch->early_status = wc.status;
      if (wc.status != IBV_WC_SUCCESS && wc.status != IBV_WC_WR_FLUSH_ERR) c->fail(verbs::make_wc_error(wc.status));
      if (ch->partial > 0) {
        --c->outstanding;
        if (--ch->partial == 0) ch->b->chunk_done();
      }
    }
    static void on_last(wr_ctx* w, const ibv_wc& wc) noexcept {
      batch_chunk* ch = static_cast<ctx*>(w)->ch;
      conn_state* c = ch->b->c;
      ch->status = wc.status;
      --c->outstanding;
      --c->dom->inflight;
      c->sq.release(ch->slots);  // the unsignaled WRs before it are complete too
      if (wc.status != IBV_WC_SUCCESS && wc.status != IBV_WC_WR_FLUSH_ERR) c->fail(verbs::make_wc_error(wc.status));
      ch->b->chunk_done();
    }
  };

  struct batch_wait {
    conn_state* c = nullptr;
    io_context* ctx = nullptr;
    std::coroutine_handle<> h{};
    std::size_t pending = 0;  // chunks posted, not completed
    std::atomic<bool> cancelled{false};
    using cancel_cb = cancel_in_flight<batch_wait>;
    std::optional<std::stop_callback<cancel_cb>> scb;

    void chunk_done() noexcept {
      if (--pending == 0 && h) {
        scb.reset();
        ctx->post(std::exchange(h, {}));
      }
    }
    bool await_ready() const noexcept { return pending == 0; }
    template <class P>
    void await_suspend(std::coroutine_handle<P> hh) {
      h = hh;
      std::stop_token t = stop_token_of(hh);
      if (t.stop_possible()) scb.emplace(std::move(t), cancel_cb{this});
    }
    void await_resume() const noexcept {}
  };

  // `wrs[i]` and `sges[i]` describe operation i (opcode, remote side, flags,
  // local sge); `credit[i]`: it consumes a receive on the peer.
  task<result<void>> execute_batch(std::vector<ibv_send_wr> wrs, std::vector<ibv_sge> sges, std::vector<char> credit,
                                   std::vector<std::shared_ptr<verbs_region>> keep) {
    auto self = shared_from_this();
    (void)keep;
    if (!usable()) co_return disconnected();
    // In call order with the other operations (post_order), all of it.
    ordered_turn turn(this);
    auto order = co_await post_order.lock();
    if (!order) co_return order.error();
    // Chunks of at most send_queue_depth WRs (at most one per WR).
    std::vector<batch_chunk> chunks(wrs.size());
    batch_wait b;
    b.c = this;
    b.ctx = dom->loop;
    std::size_t posted = 0, first = 0;
    std::error_code early{};
    while (first < wrs.size() && !early) {
      // The chunk [first, end): as many WRs as slots and credits allow now;
      // only an empty chunk waits, so a batch never holds units while it
      // waits for more (no deadlock between batches, none with a peer that
      // holds some of its receive buffers).
      std::size_t end = first;
      std::uint32_t credits_taken = 0;
      while (end < wrs.size() && end - first < opts.send_queue_depth) {
        if (!sq.try_acquire()) {
          if (end > first) break;
          if (auto r = co_await sq.acquire(); !r) {
            early = r.error();
            break;
          }
        }
        if (credit[end] && !credits.try_acquire()) {
          if (end > first) {
            sq.release();
            break;
          }
          if (auto r = co_await credits.acquire(); !r) {
            sq.release();
            early = r.error();
            break;
          }
        }
        credits_taken += credit[end] ? 1 : 0;
        ++end;
      }
      const auto need = static_cast<std::uint32_t>(end - first);
      if (!early && !usable()) early = disconnected();
      if (early) {
        sq.release(need);
        credits.release(credits_taken);
        break;
      }
      batch_chunk& ch = chunks[posted];
      ch.b = &b;
      ch.slots = need;
      ch.early.ch = ch.last.ch = &ch;
      ch.early.on_wc = &batch_chunk::on_early;
      ch.last.on_wc = &batch_chunk::on_last;
      bool piggybacked = false;
      for (std::size_t i = first; i < end; ++i) {
        ibv_send_wr& wr = wrs[i];
        wr.sg_list = &sges[i];
        wr.num_sge = sges[i].length > 0 ? 1 : 0;
        wr.next = i + 1 < end ? &wrs[i + 1] : nullptr;
        wr.wr_id = reinterpret_cast<std::uintptr_t>(static_cast<wr_ctx*>(i + 1 < end ? &ch.early : &ch.last));
        if (i + 1 == end) wr.send_flags |= IBV_SEND_SIGNALED;
        if (wr.opcode == IBV_WR_SEND_WITH_IMM) {  // piggybacked credits, on the chunk's first send
          std::uint32_t n = piggybacked ? 0 : std::min<std::uint32_t>(to_return, 0xffff);
          piggybacked = true;
          to_return -= n;
          wr.imm_data = htonl(n);
        }
      }
      ibv_send_wr* bad = nullptr;
      if (int e = ibv_post_send(qp, &wrs[first], &bad)) {
        std::size_t taken = bad ? static_cast<std::size_t>(bad - &wrs[first]) : 0;
        sq.release(need);
        credits.release(credits_taken);
        early = errno_code(e);
        if (taken > 0) {
          // A prefix is on the send queue, unsignaled: the connection goes
          // to error and each of those WRs comes back flushed.
          ch.partial = taken;
          outstanding += taken;
          ++b.pending;
          if (posted++ == 0) ++inflight_ops;
          fail(disconnected());
        }
        break;
      }
      ++outstanding;
      ++dom->inflight;
      ++b.pending;
      if (posted++ == 0) ++inflight_ops;
      first = end;
    }
    turn.done();
    order->unlock();
    if (posted > 0 && !early) dom->poll_inline(static_cast<unsigned>(wrs.size()));  // it may be done already
    if (posted > 0) {
      co_await b;
      end_op();
    }
    for (std::size_t k = 0; k < posted; ++k) {
      ibv_wc_status st = chunks[k].early_status != IBV_WC_SUCCESS ? chunks[k].early_status : chunks[k].status;
      if (st == IBV_WC_SUCCESS) continue;
      if (b.cancelled.load()) co_return std::make_error_code(std::errc::operation_canceled);
      if (st == IBV_WC_WR_FLUSH_ERR) co_return early ? early : disconnected();
      co_return wc_error(st);
    }
    if (early) {
      if (posted > 0) fail(disconnected());  // part of the batch is done: RC has no partial undo
      co_return early;
    }
    co_return result<void>{};
  }

  // Local sge for user memory: inline when small (no registration). The
  // registration, if any, is core::local_region's (no reference).
  // `may_stage`: the bytes of memory the library does not own may be copied
  // into a staging slot now (not for a prepared operation: each start sends
  // the memory's bytes of then).
  [[gnu::always_inline]] result<verbs_region*> local_sge(std::span<const std::byte> mem, bool need_write,
                                                         bool may_inline, ibv_send_wr& wr, ibv_sge& sge,
                                                         bool may_stage = true) {
    sge.addr = reinterpret_cast<std::uintptr_t>(mem.data());
    sge.length = static_cast<std::uint32_t>(mem.size());
    if (mem.empty()) return nullptr;
    // Inline means the CPU copies the bytes into the WQE: never from GPU memory.
    if (may_inline && mem.size() <= max_inline && !dom->in_device_memory(mem)) {
      wr.send_flags |= IBV_SEND_INLINE;
      return nullptr;
    }
    auto r = dom->local_region(mem, need_write, may_stage, sge);
    if (!r) return r.error();
    sge.lkey = (*r)->lkey;
    return r;
  }
};

inline void core::flush_reposts() noexcept {
  // Swapped out first: maybe_send_credits may complete work that releases more.
  std::vector<conn_state*> conns;
  conns.swap(repost_conns);
  for (conn_state* c : conns) {
    c->in_repost_list = false;
    c->post_released();
  }
  conns.clear();
  if (repost_conns.empty()) repost_conns.swap(conns);  // keep the capacity
  if (srq_released.empty()) return;
  std::vector<recv_slot*> slots;
  slots.swap(srq_released);
  for (recv_slot* s : slots) {
    if (!post_srq(*s)) continue;
    if (conn_state* c = conn_of(s->qp_num)) c->on_srq_credit();
  }
  slots.clear();
  if (srq_released.empty()) srq_released.swap(slots);
}


inline bool core::poll_cq_inlined() {
  ibv_wc wc[32];
  int n = ibv_poll_cq(cq, 32, wc);
  for (int i = 0; i < n; ++i) dispatch(wc[i]);
  if (n > 0) count_seen(n);
  if (!graveyard.empty()) reap_graveyard();
  return n > 0;
}
inline void core::dispatch(const ibv_wc& wc) noexcept {
  auto* w = reinterpret_cast<wr_ctx*>(static_cast<std::uintptr_t>(wc.wr_id));
  if (w && w->on_wc == &conn_state::op_wait::on_complete)  // a single operation's: the common case
    static_cast<conn_state::op_wait*>(w)->complete(wc);
  else if (w)
    w->on_wc(w, wc);
  else if (wc.status != IBV_WC_SUCCESS && wc.status != IBV_WC_WR_FLUSH_ERR)
    on_unsignaled_error(wc);  // an unsignaled send failed: its connection fails
}

}  // namespace shuttle::detail::verbs_impl
