// verbs_connection (the connection_impl); its memory windows: grant.hpp.
#pragma once

#include "batches.hpp"
#include "grant.hpp"

namespace shuttle::detail::verbs_impl {

// ------------------------------------------------------------------ connection

class verbs_connection final : public connection_impl {
 public:
  explicit verbs_connection(std::shared_ptr<conn_state> s)
      : connection_impl(launch_table_of<verbs_connection>), s_(std::move(s)) {}
  ~verbs_connection() override {
    for (verbs_grant* g : s_->grants) g->release();  // the connection's windows go before its QP
    s_->shutdown();
  }

  task<result<memory_grant>> grant(const memory_region& r, std::size_t offset, std::size_t len,
                                   unsigned rights) override {
    conn_state* s = s_.get();
    if (auto c = check_grant(r, offset, len, rights); !c) return ready(c.error());
    auto vr = std::dynamic_pointer_cast<verbs_region>(impl_access::of(r));
    if (!vr || vr->pd != s->dom->pdh) return ready(std::make_error_code(std::errc::invalid_argument));
    if (!s->dom->has_type2_windows() || vr->device_memory) return ready(make_error_code(errc::not_supported));
    if (!s->usable()) return ready(disconnected());
    auto g = std::make_unique<verbs_grant>();
    g->owner = this;
    g->conn = s_;
    g->region = std::move(vr);
    std::byte* base = g->region->addr + offset;
    // Local write only where the user's registration has it (read-only memory cannot be pinned for writing).
    const int mr_access = IBV_ACCESS_MW_BIND | ((g->region->access & access::local_write) ? IBV_ACCESS_LOCAL_WRITE : 0);
    g->window_mr = ibv_reg_mr(s->dom->pd, base, len, mr_access);
    if (!g->window_mr) return ready(last_errno());
    g->mw = ibv_alloc_mw(s->dom->pd, IBV_MW_TYPE_2);
    if (!g->mw)
      return ready(errno == EOPNOTSUPP || errno == ENOSYS ? make_error_code(errc::not_supported) : last_errno());
    s->grants.push_back(g.get());
    const auto addr = reinterpret_cast<std::uint64_t>(base);
    return bind(std::move(g), addr, len, rights);
  }
  task<result<void>> revoke(grant_impl& gi) override {
    auto& g = static_cast<verbs_grant&>(gi);
    if (!g.bound) {  // revoked already, or its connection gone
      g.release();
      return ready_void({});
    }
    g.bound = false;
    return invalidate(s_, std::exchange(g.mw, nullptr), std::exchange(g.window_mr, nullptr), g.granted.rkey);
  }

  // The single operations (launch_table_of): each is inlined into its
  // table entry, so that co_await reaches ibv_post_send through one call.
  // They use the state through a plain pointer: the caller keeps the
  // connection alive for the call, and whatever waits (posted_op, execute,
  // a receive) holds a reference for as long as it waits.
  [[gnu::always_inline]] void send(op_slot<void>& out, std::span<const std::byte> msg) {
    conn_state* s = s_.get();
    if (msg.size() > s->peer_buffer) return out.set_result(make_error_code(errc::message_too_long));
    // Inline (never from device memory: the CPU copies the bytes): done once
    // posted, if a slot and a credit are free now.
    // A plain connection (wire_protocol::plain) has no credits: a plain send, none taken.
    if (msg.size() <= s->max_inline && s->usable() && !s->dom->in_device_memory(msg) && s->try_reserve(!s->plain))
      return out.set_result(s->post_inline_send(msg));
    auto& st = out.emplace<posted_state<void>>(s, s->plain ? IBV_WR_SEND : IBV_WR_SEND_WITH_IMM, !s->plain, false);
    finish_setup(out, st, s->local_sge(msg, false, true, st.op.wr, st.op.sge));
  }

  void recv(op_slot<message>& out) { out.emplace<recv_state>(s_.get()); }

  [[gnu::always_inline]] void write(op_slot<void>& out, std::span<const std::byte> local, remote_buffer remote) {
    rdma(out, local, remote, IBV_WR_RDMA_WRITE, 0, false);
  }
  [[gnu::always_inline]] void write_with_imm(op_slot<void>& out, std::span<const std::byte> local,
                                             remote_buffer remote, std::uint32_t imm) {
    rdma(out, local, remote, IBV_WR_RDMA_WRITE_WITH_IMM, imm, true);
  }
  [[gnu::always_inline]] void read(op_slot<void>& out, std::span<std::byte> local, remote_buffer remote) {
    rdma(out, local, remote, IBV_WR_RDMA_READ, 0, false);
  }
  void compare_and_swap(op_slot<std::uint64_t>& out, remote_buffer remote, std::uint64_t expected,
                        std::uint64_t desired) {
    atomic(out, remote, IBV_WR_ATOMIC_CMP_AND_SWP, expected, desired);
  }
  void fetch_and_add(op_slot<std::uint64_t>& out, remote_buffer remote, std::uint64_t add) {
    atomic(out, remote, IBV_WR_ATOMIC_FETCH_AND_ADD, add, 0);
  }

  // A one-sided transfer is at most 2^31 bytes (docs/transport-semantics.md
  // "Sizes"), checked before anything is posted or registered.
  static constexpr bool too_long_to_transfer(std::size_t n) noexcept { return n > (std::size_t(1) << 31); }

  // One operation's WR and local sge, as post_batch and prepare build them:
  // the opcode, the remote side, the immediate. `credit`: it consumes a
  // receive on the peer. The registration, if any, is local_sge's.
  static result<verbs_region*> build_wr(conn_state* s, const operation& o, ibv_send_wr& wr, ibv_sge& sge,
                                        bool& credit, bool may_stage = true) {
    bool need_write = false, may_inline = true;
    credit = false;
    switch (o.op) {
      case operation::type::send:
        if (o.local.size() > s->peer_buffer) return make_error_code(errc::message_too_long);
        wr.opcode = s->plain ? IBV_WR_SEND : IBV_WR_SEND_WITH_IMM;  // the immediate carries returned credits
        credit = !s->plain;
        break;
      case operation::type::write:
      case operation::type::write_with_imm:
        wr.opcode = o.op == operation::type::write ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_WRITE_WITH_IMM;
        if (o.op == operation::type::write_with_imm) {
          wr.imm_data = htonl(o.imm);
          credit = !s->plain;
        }
        wr.wr.rdma.remote_addr = o.remote.address;
        wr.wr.rdma.rkey = o.remote.rkey;
        break;
      case operation::type::read:
        wr.opcode = IBV_WR_RDMA_READ;
        wr.wr.rdma.remote_addr = o.remote.address;
        wr.wr.rdma.rkey = o.remote.rkey;
        need_write = true;
        may_inline = false;
        break;
      default: return std::make_error_code(std::errc::invalid_argument);
    }
    if (too_long_to_transfer(o.local.size())) return make_error_code(errc::message_too_long);
    return s->local_sge(o.local, need_write, may_inline, wr, sge, may_stage);
  }

  task<result<void>> post_batch(std::span<const operation> ops) override { return post_batch_to(ops, nullptr); }
  task<result<void>> post_batch_at(std::span<const operation> ops, std::size_t& failed) override {
    return post_batch_to(ops, &failed);
  }
  // `failed`, where given: on an error, the failing operation's index (ops.size(): not known).
  task<result<void>> post_batch_to(std::span<const operation> ops, std::size_t* failed) {
    auto s = s_;
    if (failed) *failed = 0;
    if (ops.empty()) co_return result<void>{};
    scratch_vector<ibv_send_wr> wrs(ops.size());
    scratch_vector<ibv_sge> sges(ops.size());
    scratch_vector<char> credit(ops.size(), 0);
    std::vector<std::shared_ptr<verbs_region>> keep;
    std::size_t bad = 0;
    if (auto e = build_wrs(s.get(), ops, wrs.data(), sges.data(), credit.data(), keep, bad)) {
      if (failed) *failed = bad;
      co_return e;
    }
    co_return co_await s->execute_batch(std::move(wrs), std::move(sges), std::move(credit), std::move(keep), failed);
  }
  // post_batch_to's loop: each operation's WR, sge and credit, and the
  // registrations the batch must hold; on an error, the failing index in
  // `bad`. Not in the coroutine: its locals stay in registers, not in the
  // frame (per WR, on a list's post path).
  static std::error_code build_wrs(conn_state* s, std::span<const operation> ops, ibv_send_wr* wrs, ibv_sge* sges,
                                   char* credit, std::vector<std::shared_ptr<verbs_region>>& keep, std::size_t& bad) {
    core* dom = s->dom.get();
    for (std::size_t i = 0; i < ops.size(); ++i) {
      bool cr = false;
      wrs[i] = ibv_send_wr{};  // the array starts uninitialized (scratch_uninitialized)
      auto r = build_wr(s, ops[i], wrs[i], sges[i], cr);
      if (!r) {
        bad = i;
        return r.error();
      }
      credit[i] = cr;
      if (dom->op_owned)
        keep.push_back(std::move(dom->op_owned));  // this operation's own staging slot or registration
      else if (*r && (keep.empty() || keep.back().get() != *r))
        keep.push_back(core::hold(*r));
    }
    return {};
  }

  // A list whose local span lies inside one of the user's registrations
  // (a registered KV-cache pool, as a rule): its WRs built straight from
  // the blocks, one registration lookup for the list and no operation per
  // block. Other memory: the generic path (transport/blocks.cpp), which
  // finds, registers or stages each merged operation's memory.
  task<block_result> transfer_blocks(block_list l) override {
    conn_state* s = s_.get();
    verbs_region* r = s->dom->user_region_covering({l.base, l.size}, !l.write);
    if (!r) co_return co_await connection_impl::transfer_blocks(l);
    scratch_vector<ibv_send_wr> wrs(l.blocks.size());
    scratch_vector<ibv_sge> sges(l.blocks.size());
    scratch_vector<char> credit(l.blocks.size(), 0);
    if (auto bad = build_block_wrs(s, l, r->lkey, wrs, sges, credit); !bad) co_return bad;
    if (!is_open()) co_return block_result{make_error_code(errc::disconnected), 0};
    count_block_list(l.blocks.size(), wrs.size());
    std::vector<std::shared_ptr<verbs_region>> keep{core::hold(r)};
    std::size_t failed = wrs.size();
    const std::size_t ops = wrs.size();
    auto res = co_await s->execute_batch(std::move(wrs), std::move(sges), std::move(credit), std::move(keep), &failed);
    if (res) co_return block_result{};
    co_return block_result{res.error(), failed < ops ? block_of_operation(l, failed) : block_result::unknown};
  }
  // The blocks checked and merged as plan_blocks does (transport/blocks.cpp:
  // the same errors, indices and merging, so block_of_operation maps a
  // failed WR back to its block), each merged run one WR and sge; the
  // vectors cut to the runs' count. Not in the coroutine (per block).
  static block_result build_block_wrs(conn_state* s, const block_list& l, std::uint32_t lkey,
                                      scratch_vector<ibv_send_wr>& wrs, scratch_vector<ibv_sge>& sges,
                                      scratch_vector<char>& credit) noexcept {
    const block* blocks = l.blocks.data();
    const std::size_t n = l.blocks.size();
    const std::uint64_t size = l.size, remote_length = l.remote.length, raddr = l.remote.address;
    const auto base = reinterpret_cast<std::uintptr_t>(l.base);
    const std::uint32_t rkey = l.remote.rkey;
    const ibv_wr_opcode opcode = l.write ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_READ;
    std::uint64_t local_end = UINT64_MAX, remote_end = UINT64_MAX;
    std::size_t k = 0;  // WRs so far
    std::size_t too_long = SIZE_MAX;  // reported after the list's own checks, as the generic path does
    for (std::size_t i = 0; i < n; ++i) {
      const block b = blocks[i];
      if (auto e = block_error(b, size, remote_length)) return {e, i};
      if (k > 0 && extends(b, local_end, remote_end, sges[k - 1].length)) {
        sges[k - 1].length += static_cast<std::uint32_t>(b.length);
      } else {
        if (too_long_to_transfer(b.length) && too_long == SIZE_MAX) too_long = i;
        ibv_sge& sge = sges[k];
        sge.addr = base + b.local_offset;
        sge.length = static_cast<std::uint32_t>(b.length);
        sge.lkey = lkey;
        // Not zeroed first (scratch_uninitialized): every field a provider
        // reads for a one-sided WR is written here or in batch_chunk::link
        // (wr_id, next, sg_list, num_sge, the signaled flag).
        ibv_send_wr& wr = wrs[k];
        wr.opcode = opcode;
        wr.send_flags = 0;
        wr.imm_data = 0;
        wr.wr.rdma.remote_addr = raddr + b.remote_offset;
        wr.wr.rdma.rkey = rkey;
        ++k;
      }
      local_end = b.local_offset + b.length;
      remote_end = b.remote_offset + b.length;
    }
    if (too_long != SIZE_MAX) return {make_error_code(errc::message_too_long), too_long};
    if (l.notify) {
      wrs[k - 1].opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
      wrs[k - 1].imm_data = htonl(*l.notify);
      credit[k - 1] = !s->plain;
    }
    wrs.resize(k);
    sges.resize(k);
    credit.resize(k);
    return {};
  }

  task<result<void>> close() override {
    auto s = s_;
    using phase = conn_state::phase;
    if (!s->usable())  // a second close() (or one while the first drains) succeeds
      co_return s->state == phase::closing || s->state == phase::closed ? result<void>{}
                                                                         : result<void>{disconnected()};
    s->settle_unsignaled();  // the inline sends reach the peer before the disconnect
    s->enter_closing();
    while (s->inflight_ops > 0 && s->state == phase::closing) {
      s->drained.reset();
      if (auto r = co_await s->drained.wait(); !r) co_return r.error();
    }
    if (s->id && !s->disconnect_sent) {
      s->disconnect_sent = true;
      rdma_disconnect(s->id);
    }
    s->receivers.wake_all();
    // Failed while draining: an operation or an inline send may not have
    // reached the peer.
    if (s->state == phase::failed) co_return disconnected();
    s->state = phase::closed;
    co_return result<void>{};
  }

  result<std::unique_ptr<prepared_impl>> prepare(const operation& o) override {
    auto p = std::make_unique<prepared_state>(s_);
    auto r = build_wr(s_.get(), o, p->op.wr, p->op.sge, p->op.credit, false);
    if (!r) return r.error();
    p->region = s_->dom->take_hold(*r);  // memory not the user's registered: for the prepared operation's life
    p->op.set_post_fields();
    p->inline_send = p->op.wr.opcode == IBV_WR_SEND_WITH_IMM && (p->op.wr.send_flags & IBV_SEND_INLINE) != 0;
    p->read_or_write = p->op.wr.opcode == IBV_WR_RDMA_READ || p->op.wr.opcode == IBV_WR_RDMA_WRITE;
    return std::unique_ptr<prepared_impl>(std::move(p));
  }

  bool is_open() const noexcept override { return s_->usable(); }
  transport_kind kind() const noexcept override { return transport_kind::verbs; }
  std::size_t max_message_size() const noexcept override { return s_->peer_buffer; }
  std::span<const std::byte> peer_payload() const noexcept override { return s_->peer_payload; }
  wire_protocol protocol() const noexcept override {
    return s_->plain ? wire_protocol::plain : wire_protocol::shuttle;
  }
  endpoint remote_endpoint() const noexcept override {
    if (!s_->id) return {};
    sockaddr* sa = rdma_get_peer_addr(s_->id);
    return endpoint(sa, sa->sa_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in));
  }

 private:
  // A posted work request kept in the awaiter's frame (connection_op.hpp):
  // the latency path of every single operation allocates nothing. Posted
  // as it is launched (finish_setup); one that completed then is settled
  // into a plain result at once, so what is left here is in flight.
  template <class T>
  struct posted_state {
    conn_state::posted_op op;
    verbs_region* region = nullptr;      // the local registration (local_region)...
    std::shared_ptr<verbs_region> keep;  // ...held while the operation waits: the NIC may use it
    posted_state(conn_state* c, ibv_wr_opcode opcode, bool credit, bool atomic_result) noexcept
        : op(c, opcode, credit, atomic_result) {}
    bool start() noexcept { return op.done; }
    std::coroutine_handle<> suspend(std::coroutine_handle<> h, std::stop_token t) {
      if (!keep) keep = core::hold(region);  // else the operation's own, from finish_setup
      op.suspend(h, std::move(t));
      return std::noop_coroutine();
    }
    [[gnu::always_inline]] result<T> take() noexcept { return as_result<T>(op.await_resume()); }
  };
  // A prepared operation (connection::prepare): one posted_op whose WR is
  // built (build_wr, set_post_fields) once and posted again by each start.
  // The connection's state and the local registration are held for its
  // life, so a start takes no reference of its own either. A read or a
  // write that completes at once (start's latency path) is over before it
  // needs a slot, a count or a wake-up.
  struct prepared_state final : prepared_impl {
    std::shared_ptr<conn_state> conn;
    std::shared_ptr<verbs_region> region;  // null: inline or empty
    conn_state::posted_op op;  // opcode, credit, WR and sge: build_wr's
    op_slot<std::uint64_t> waiting;  // a start that waits for a slot or a credit (execute)

    explicit prepared_state(std::shared_ptr<conn_state> c) noexcept
        : conn(std::move(c)), op(conn.get(), IBV_WR_SEND, false, false) {
      op.sge = {};
    }
    start_result start() noexcept override {
      conn_state* s = op.c;
      core* d = s->dom.get();
      if (read_or_write && s->usable() && s->sq.can_acquire() && d->take_inline_look()) {
        // The latency path (perftest's: post, then poll). Its own completion
        // found at once, successful, as the next completion in the CQ: the
        // operation began and ended with nothing run in between, so it takes
        // no slot, no count and no state, and there is nothing to take.
        ibv_send_wr* bad = nullptr;
        if (int e = ibv_post_send(s->qp, &op.wr, &bad)) {
          op.post_error = e;
          posted = true;
          return start_result::over;
        }
        ibv_wc wc;
        const int n = ibv_poll_cq(d->cq, 1, &wc);
        if (n == 1 && wc.wr_id == op.wr.wr_id && wc.status == IBV_WC_SUCCESS) [[likely]] {
          d->count_seen(1);
          return start_result::succeeded;
        }
        return posted_unfinished(n, wc);
      }
      return start_general();
    }
    // Every other start: a send (inline or with a credit), a write with an
    // immediate, an atomic, one that waits for a slot, a failed connection.
    [[gnu::noinline]] start_result start_general() noexcept {
      conn_state* s = op.c;
      if (inline_send && s->usable() && s->try_reserve(true)) {
        // As a single small send: inline, unsignaled, done once posted.
        sent_inline = true;
        inline_result = s->post_inline_send({reinterpret_cast<const std::byte*>(op.sge.addr), op.sge.length});
        return start_result::over;
      }
      posted = s->try_reserve(op.credit);
      if (!posted) return start_result::pending;  // suspend() waits for them
      rearm();
      return op.post() ? start_result::over : start_result::pending;
    }
    std::coroutine_handle<> suspend(std::coroutine_handle<> h, std::stop_token t) override {
      if (posted) {
        op.h = h;
        if (t.stop_possible()) op.scb.emplace(std::move(t), conn_state::op_wait::cancel_cb{&op});
        return std::noop_coroutine();
      }
      // A task waits for the slot and the credit, as for a single operation.
      waiting.set_task(op.c->execute(op.wr, op.sge, op.credit, false, region));
      if (waiting.start()) return h;
      return waiting.suspend(h, std::move(t));
    }
    result<void> take() override {
      if (sent_inline) {
        sent_inline = false;
        return inline_result;
      }
      return as_result<void>(posted ? op.await_resume() : waiting.take());
    }

    bool inline_send = false;    // a send that goes inline (connection::send's small ones)
    bool read_or_write = false;  // no credit, no field to fill per post: start's latency path

   private:
    bool posted = false;  // this start posted its WR and holds its slot (and credit): take() ends it as a posted_op
    bool sent_inline = false;
    result<void> inline_result;
    // The latency path's WR is in the send queue, and its completion was
    // not the CQ's next (`n` and `wc`: what the look found): it becomes a
    // posted start as op.post() leaves one, and the completion found goes
    // where it belongs.
    [[gnu::noinline]] start_result posted_unfinished(int n, const ibv_wc& wc) noexcept {
      conn_state* s = op.c;
      core* d = s->dom.get();
      (void)s->sq.try_acquire();  // can_acquire() held, and nothing has run since
      posted = true;
      rearm();
      op.count_posted();
      if (n == 1) {
        d->dispatch(wc);
        d->count_seen(1);
        if (!op.done) d->poll_cq();  // its own may be next
      }
      return op.done ? start_result::over : start_result::pending;
    }
    void rearm() noexcept {
      op.h = {};  // complete() must not wake an earlier start's awaiter
      op.done = false;
      op.status = IBV_WC_SUCCESS;
      op.post_error = 0;
      op.cancelled.store(false, std::memory_order_relaxed);
    }
  };

  // posted_op yields the atomic's word (or byte_len); void operations drop it.
  template <class T>
  static result<T> as_result(result<std::uint64_t> r) noexcept {
    if (!r) return r.error();
    if constexpr (std::is_void_v<T>)
      return result<void>{};
    else
      return *r;
  }

  // A recv() in the awaiter's frame: takes an arrived message, or queues on
  // the connection's receivers until one is handed to it.
  struct recv_state {
    conn_state* s;
    std::shared_ptr<conn_state> keep;  // while it waits
    conn_state::recv_waiter node;
    bool parked = false;
    explicit recv_state(conn_state* c) noexcept : s(c) {}
    recv_state(const recv_state&) = delete;
    // Taken (the common case), nothing is left. A frame destroyed while the
    // recv waits, or after a message was handed to it, gives both back.
    ~recv_state() {
      if (node.list) node.list->unlink(node);
      if (parked) --s->dom->rx_waiters;
      if (node.has_msg) (void)conn_state::adopt_message(node.item);  // the buffer goes straight back
    }
    bool start() noexcept {
      if (s->rx.empty()) s->dom->poll_inline();  // it may be in the CQ already (as posted_op)
      return !s->rx.empty() || s->state != conn_state::phase::open;
    }
    std::coroutine_handle<> suspend(std::coroutine_handle<> h, std::stop_token t) {
      if (!s->receivers.park(node, h, std::move(t))) return h;  // stopped already: canceled
      keep = s->shared_from_this();
      parked = true;
      ++s->dom->rx_waiters;
      return std::noop_coroutine();
    }
    result<message> take() noexcept {
      if (parked) {
        parked = false;
        --s->dom->rx_waiters;
      }
      if (node.has_msg) {
        node.has_msg = false;
        return conn_state::adopt_message(node.item);
      }
      if (node.cancelled) return canceled();
      if (!s->rx.empty() && s->pool) {
        auto it = s->rx.front();
        s->rx.pop_front();
        return conn_state::take_message(it);
      }
      return s->later_error();
    }
  };

  // After local_sge: posts now if a send-queue slot (and a credit) is free,
  // else a task waits for them. Launching is followed at once by the await
  // (connection_op::await_ready), so posting here is posting when awaited;
  // an operation that completed already (Soft-RoCE runs a read inside
  // ibv_post_send) ends as a plain result, with no call through the slot's
  // table to start, take or destroy it.
  template <class T>
  [[gnu::always_inline]] static void finish_setup(op_slot<T>& out, posted_state<T>& st,
                                                 result<verbs_region*> region) {
    if (!region) return out.set_result(region.error());
    conn_state* s = st.op.c;
    if (s->dom->op_owned) [[unlikely]]
      st.keep = std::move(s->dom->op_owned);  // a staging slot or transient registration: until it completes
    if (s->try_reserve(st.op.credit)) {
      st.region = *region;
      if (st.op.await_ready()) out.settle(st, st.take());
      return;
    }
    auto t = s->execute(st.op.wr, st.op.sge, st.op.credit, st.op.atomic_result,
                        st.keep ? std::move(st.keep) : core::hold(*region));
    if constexpr (std::is_void_v<T>)
      out.set_task(drop_value(std::move(t)));
    else
      out.set_task(std::move(t));
  }
  static task<result<void>> drop_value(task<result<std::uint64_t>> t) {
    co_return as_result<void>(co_await std::move(t));
  }

  // Inlined (as finish_setup, local_sge and posted_op's steps): the launch
  // of a one-sided operation is one function, one prologue.
  [[gnu::always_inline]] void rdma(op_slot<void>& out, std::span<const std::byte> local, remote_buffer remote,
                                   ibv_wr_opcode opcode, std::uint32_t imm, bool credit) {
    conn_state* s = s_.get();
    if (too_long_to_transfer(local.size())) return out.set_result(make_error_code(errc::message_too_long));
    auto& st = out.emplace<posted_state<void>>(s, opcode, credit && !s->plain, false);
    ibv_send_wr& wr = st.op.wr;
    wr.wr.rdma.remote_addr = remote.address;
    wr.wr.rdma.rkey = remote.rkey;
    if (opcode == IBV_WR_RDMA_WRITE_WITH_IMM) wr.imm_data = htonl(imm);
    finish_setup(out, st,
                 s->local_sge(local, opcode == IBV_WR_RDMA_READ, opcode != IBV_WR_RDMA_READ, wr, st.op.sge));
  }

  void atomic(op_slot<std::uint64_t>& out, remote_buffer remote, ibv_wr_opcode opcode, std::uint64_t a,
              std::uint64_t b) {
    conn_state* s = s_.get();
    if (remote.address % 8 != 0) return out.set_result(std::make_error_code(std::errc::invalid_argument));
    auto& st = out.emplace<posted_state<std::uint64_t>>(s, opcode, false, true);
    ibv_send_wr& wr = st.op.wr;
    wr.wr.atomic.remote_addr = remote.address;
    wr.wr.atomic.rkey = remote.rkey;
    wr.wr.atomic.compare_add = a;
    wr.wr.atomic.swap = b;
    finish_setup(out, st, nullptr);
  }

  static task<result<memory_grant>> ready(std::error_code ec) { co_return ec; }
  static task<result<void>> ready_void(std::error_code ec) {
    if (ec) co_return ec;
    co_return result<void>{};
  }
  // An IBV_WR_BIND_MW on the QP, awaited: the window answers to the new
  // key, from this QP's peer only (type 2).
  static task<result<memory_grant>> bind(std::unique_ptr<verbs_grant> g, std::uint64_t addr, std::size_t len,
                                         unsigned rights) {
    ibv_send_wr wr{};
    wr.opcode = IBV_WR_BIND_MW;
    wr.bind_mw.mw = g->mw;
    wr.bind_mw.rkey = ibv_inc_rkey(g->mw->rkey);
    wr.bind_mw.bind_info.mr = g->window_mr;
    wr.bind_mw.bind_info.addr = addr;
    wr.bind_mw.bind_info.length = len;
    wr.bind_mw.bind_info.mw_access_flags = static_cast<int>(rights);  // ibv_access_flags values
    auto r = co_await g->conn->execute(wr, ibv_sge{}, false, false, nullptr);
    if (!r) co_return r.error();  // g goes: the window is deallocated
    g->granted = {addr, wr.bind_mw.rkey, len};
    g->bound = true;
    co_return memory_grant(std::move(g));
  }
  // An IBV_WR_LOCAL_INV of the window on the QP, awaited; then the window
  // is deallocated. A QP in the error state takes no access any more: the
  // flushed invalidation is as good.
  static task<result<void>> invalidate(std::shared_ptr<conn_state> s, ibv_mw* mw, ibv_mr* mr, std::uint32_t rkey) {
    ibv_send_wr wr{};
    wr.opcode = IBV_WR_LOCAL_INV;
    wr.invalidate_rkey = rkey;
    auto r = co_await s->execute(wr, ibv_sge{}, false, false, nullptr);
    verbs_grant::free_window(mw, mr);
    if (!r && r.error() != disconnected()) co_return r.error();
    co_return result<void>{};
  }
  std::shared_ptr<conn_state> s_;
};

}  // namespace shuttle::detail::verbs_impl
