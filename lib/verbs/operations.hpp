// A connection's operations: one signaled WR awaited in the caller's frame,
// posting in call order, in-flight cancellation; and the core's CQ dispatch.
// The hot path: inline, included wherever it is used.
#pragma once

#include "conn_state.hpp"

namespace shuttle::detail::verbs_impl {

// The stop callback of an operation whose work requests the NIC may hold:
// they cannot be withdrawn alone, so the connection goes to the error state
// (from the loop's thread) and the operation resumes on the flushed
// completion.
template <class Wait>
struct conn_state::cancel_in_flight {
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
struct conn_state::op_wait : wr_ctx {
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
inline bool conn_state::try_reserve(bool credit) noexcept {
  if (ordered_waiting > 0) return false;  // an operation that waited posts first
  if (!take_send_slot()) return false;
  if (credit && !credits.try_acquire()) {
    sq.release();
    return false;
  }
  return true;
}

inline void conn_state::unreserve(bool credit) noexcept {
  sq.release();
  if (credit) credits.release();
}

// One signaled WR whose slot (and credit) the caller holds: posted when
// awaited, its completion awaited in the caller's frame (no frame of its
// own: the latency path of every operation goes through here).
// `atomic_result`: the local sge becomes a scratch word whose value is
// returned.
struct conn_state::posted_op : op_wait {
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
  // Inlined into the launch (finish_setup): a call's prologue and epilogue
  // are a measurable part of this path (docs/measurements.md, 2026-12-02).
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

inline conn_state::posted_op conn_state::post_reserved(const ibv_send_wr& wr, const ibv_sge& sge, bool credit,
                                                       bool atomic_result) noexcept {
  return posted_op(this, wr, sge, credit, atomic_result);
}

struct conn_state::ordered_turn {  // counts one operation in ordered_waiting, until done()
  conn_state* c;
  bool in = true;
  explicit ordered_turn(conn_state* s) noexcept : c(s) { ++c->ordered_waiting; }
  void done() noexcept {
    if (std::exchange(in, false)) --c->ordered_waiting;
  }
  ~ordered_turn() { done(); }
};

// Resumes when a posted_op posted by hand completes.
struct conn_state::posted_wait {
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
inline task<result<std::uint64_t>> conn_state::execute(ibv_send_wr wr, ibv_sge sge, bool credit,
                                                       bool atomic_result, std::shared_ptr<verbs_region> keep) {
  // The caller's frame holds the registration; this frame the state.
  (void)keep;
  auto self = shared_from_this();
  if (!usable()) co_return disconnected();
  ordered_turn turn(this);
  auto order = co_await post_order.lock();
  if (!order) co_return order.error();
  if (!take_send_slot())
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
