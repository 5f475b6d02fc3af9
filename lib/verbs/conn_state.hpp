// One RC connection's state: QP, receive pool, credits, and its operations
// (the hot path, inline so that it reaches across files).
#pragma once

#include "core.hpp"

#include "../transport/scratch.hpp"

namespace shuttle::detail {
// A batch's work requests are written whole before they are posted: by
// build_wrs (zeroed, then filled) or build_block_wrs (every field a
// provider reads for a one-sided operation) and batch_chunk::link.
template <>
inline constexpr bool scratch_uninitialized<ibv_send_wr> = true;
}  // namespace shuttle::detail

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

  // The connection's life, changed only by the transitions below:
  //   connecting -> open          enter_open: established; operations may be posted
  //   open -> closing -> closed   close(): no new operations; those in flight
  //                               drain, then the DISCONNECT goes out
  //   any but closed -> failed    fail(ec): terminal; pending and later
  //                               operations fail, the QP is flushed
  // A fail() after closed keeps `closed` (close() succeeded) and only tears
  // down. The first error is kept in first_error.
  enum class phase : std::uint8_t { connecting, open, closing, closed, failed };
  phase state = phase::connecting;
  std::error_code first_error;
  bool was_open = false;  // reached open once (the cm events after that are not the handshake's)
  bool usable_ = false;   // usable()
  // Teardown steps, each taken once: QP moved to error, DISCONNECT sent,
  // shutdown begun (the connection object is gone), resources freed.
  bool qp_err = false, disconnect_sent = false, dying = false, reaped = false;
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
  // Send-queue slots whose completions the shared CQ has room for: a few at
  // connect, doubled (up to send_queue_depth) when an operation finds none
  // free and the CQ can reserve more; else this connection waits for its
  // own completions and no other connection is refused.
  static constexpr std::uint32_t initial_send_slots = 4;
  std::uint32_t sq_granted = 0;
  [[gnu::noinline]] bool grow_send() noexcept {
    const std::uint32_t add = std::min(sq_granted, opts.send_queue_depth - sq_granted);
    if (add == 0 || !usable() || !dom->reserve_cq(static_cast<int>(add))) return false;
    cq_reserve += static_cast<int>(add);
    sq_granted += add;
    sq.release(add);
    return true;
  }
  // A free send-queue slot, granting more if none is.
  [[gnu::always_inline]] bool take_send_slot() noexcept {
    return sq.try_acquire() || (sq_granted < opts.send_queue_depth && grow_send() && sq.try_acquire());
  }
  // Up to `want` free slots in one take (a batch's chunk), granting more
  // while some are missing and the CQ has room; none while others wait.
  std::size_t take_send_slots(std::size_t want) noexcept {
    std::size_t k = sq.try_acquire_up_to(want);
    while (k < want && sq_granted < opts.send_queue_depth && grow_send()) {
      const std::size_t more = sq.try_acquire_up_to(want - k);
      if (more == 0) break;  // the new slots went to waiters
      k += more;
    }
    return k;
  }
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
  std::vector<recv_slot*> released;  // own receive queue: buffers to post again (core::flush_reposts)
  bool in_repost_list = false;
  struct ctrl_ctx : wr_ctx {
    conn_state* c = nullptr;
  } ctrl;

  std::vector<verbs_grant*> grants;  // memory windows bound on this QP (connection::grant)

  // wire_protocol::plain: no hello and no credits (sends take none, none
  // are returned, no control messages); every receive posted from the
  // start; an incoming immediate is the message's, not credits. Set
  // before create_qp.
  bool plain = false;
  void make_plain() noexcept {
    plain = true;
    opts.protocol = wire_protocol::plain;
    inline_wr.opcode = IBV_WR_SEND;
    peer_buffer = dom->max_msg;  // the peer's buffers are its own business: the port's limit
  }

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
    if (opts.protocol == wire_protocol::plain) make_plain();
  }
  ~conn_state() { reap(); }

  result<void> init_channel();

  static void on_cm(void* arg) noexcept;

  // Passive side: told when the handshake ends (true: established).
  // (an error: the handshake failed, and why).
  void (*on_accept_done)(void* listener, conn_state* st, std::error_code failed) noexcept = nullptr;
  void* acceptor = nullptr;

  void on_event(const cm_evt& e);

  task<result<cm_evt>> next_event();

  result<void> create_qp();

  result<void> ready_qp(const rdma_conn_param* accepted);

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
    if (state == phase::failed) return true;  // failed already: every waiter was woken
    if (credits.available() + n > peer_max_slots) {
      ++dom->st.protocol_errors;
      fail(make_error_code(errc::protocol_error));
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

  // `hello` holds the private data (the hello and opts.payload) the result points to.
  rdma_conn_param conn_param(wire_hello_payload& hello, const cm_evt* req) const;

  // The peer's hello and payload from a REQ or REP: errc::protocol_error
  // for a hello this side cannot honour, errc::message_too_long for a
  // payload length past the bound or the private data.
  std::error_code take_hello(const cm_evt& e);
  std::vector<std::byte> peer_payload;  // connection::peer_payload
  // A plain peer's REQ or REP: its private data, as the CM delivered it, is its payload.
  void take_plain(const cm_evt& e) {
    peer_payload.assign(reinterpret_cast<const std::byte*>(e.priv.data()),
                        reinterpret_cast<const std::byte*>(e.priv.data()) + e.priv_len);
  }

  // Transition: connecting -> open.
  void enter_open() {
    if (state != phase::connecting) return;
    state = phase::open;
    was_open = true;
    refresh_usable();
    credits.release(peer_slots);
  }

  // Transition: open -> closing (close(): no new operations).
  void enter_closing() {
    if (state != phase::open) return;
    state = phase::closing;
    refresh_usable();
  }

  // What recv() fails with once failed: the first error where it is the
  // connection's own fault (the peer broke the protocol, or said nothing for
  // idle_timeout), else errc::disconnected (the tcp provider's later_error).
  std::error_code later_error() const noexcept {
    if (first_error == make_error_code(errc::protocol_error) || first_error == make_error_code(errc::idle_timeout))
      return first_error;
    return disconnected();
  }

  // Transition: -> failed (terminal); closed stays closed. Pending and
  // later operations fail (those waiting for a slot or a credit with
  // errc::disconnected, as the flushed ones), the QP is flushed, the peer
  // told. Idempotent; the first error is kept.
  void fail(std::error_code ec) {
    if (!first_error) first_error = ec;
    if (state != phase::closed) state = phase::failed;
    refresh_usable();
    if (was_open && !disconnect_sent && id) {
      disconnect_sent = true;
      rdma_disconnect(id);  // tells the peer; moves the QP to error
    }
    abort_qp();
    credits.close(disconnected());
    sq.close(disconnected());
    receivers.wake_all();
    cm_event.set();
    drained.set();
  }

  void abort_qp();

  void shutdown();

  void reap() noexcept;

  // Operations may be posted: kept as one flag (the transitions and the
  // QP's creation and reaping refresh it), tested once per operation.
  bool usable() const noexcept { return usable_; }
  void refresh_usable() noexcept { usable_ = state == phase::open && qp; }

  // Credits: freed receive buffers go back to the peer.
  void maybe_send_credits() {
    if (plain) return;  // the peer knows no credits
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
    // Settles too when it takes the last free slot: the unsignaled sends'
    // slots come back only through a settling WR.
    const bool settles = unsignaled + 1 >= settle_every || sq.available() == 0;
    wr.send_flags = settles ? IBV_SEND_INLINE | IBV_SEND_SIGNALED : IBV_SEND_INLINE;
    wr.wr_id = settles ? reinterpret_cast<std::uintptr_t>(static_cast<wr_ctx*>(&settle)) : 0;
    ibv_send_wr* bad = nullptr;
    if (int e = ibv_post_send(qp, &wr, &bad)) {
      unreserve(!plain);
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

  // The receive side (receive.cpp): a receive's completion (a message, a
  // control message's credits, or its buffer going back), a message's
  // buffer released by the application, the released buffers posted again
  // at the next poll, and an SRQ buffer's credit.
  static void on_recv_wc(wr_ctx* w, const ibv_wc& wc) noexcept;
  void on_message_released(recv_slot& slot);
  void post_released() noexcept;
  void on_srq_credit();

  // An operation is over (its slot given back or about to be): close() waits
  // for the last one. Inlined: it ends every operation's latency path.
  [[gnu::always_inline]] void end_op() noexcept {
    if (--inflight_ops == 0 && state == phase::closing) drained.set();
  }

  // ---------------------------------------------------------------- operations (operations.hpp)

  template <class Wait> struct cancel_in_flight;
  struct op_wait;
  bool try_reserve(bool credit) noexcept;
  void unreserve(bool credit) noexcept;

  struct posted_op;
  posted_op post_reserved(const ibv_send_wr& wr, const ibv_sge& sge, bool credit, bool atomic_result) noexcept;

  // Operations post in the order they were called. One that must wait for
  // a send-queue slot or a credit queues on `post_order` (FIFO) and holds it
  // from its first wait to its post; while any is in there, try_reserve
  // fails, so no later operation overtakes it. Without this a waiter handed
  // a unit by release() resumed only after a newer operation had taken
  // another unit of the same release and posted (transfer-rdma saw chunk 8
  // before chunk 5 once credits ran short).
  mutex post_order;
  std::uint32_t ordered_waiting = 0;  // operations from their first wait to their post
  struct ordered_turn;
  struct posted_wait;

  task<result<std::uint64_t>> execute(ibv_send_wr wr, ibv_sge sge, bool credit, bool atomic_result,
                                      std::shared_ptr<verbs_region> keep);

  // ---------------------------------------------------------------- batches (batches.hpp)

  struct batch_wait;
  struct batch_chunk;
  // `failed`, where given: on an error, the index of the WR that failed, or
  // wrs.size() where that is not known (a flush, a failed post).
  task<result<void>> execute_batch(scratch_vector<ibv_send_wr> wrs, scratch_vector<ibv_sge> sges,
                                   scratch_vector<char> credit, std::vector<std::shared_ptr<verbs_region>> keep,
                                   std::size_t* failed = nullptr);

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

}  // namespace shuttle::detail::verbs_impl
