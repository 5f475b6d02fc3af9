// The domain's core: device context, PD, completion channel, the CQ poller,
// registrations and staging.
#pragma once

#include "recv_pool.hpp"
#include "registration_cache.hpp"
#include "staging.hpp"

#include <atomic>
#include <chrono>

namespace shuttle::verbs {
extern std::atomic<const device_memory_hooks*> installed_hooks;  // common.cpp
}

namespace shuttle::detail::verbs_impl {

// ------------------------------------------------------------------ core

struct core final : poller, std::enable_shared_from_this<core> {
  std::shared_ptr<pd_holder> pdh;
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_comp_channel* channel = nullptr;
  ibv_cq* cq = nullptr;
  int cq_size = 0;
  int cq_reserved = 0;
  int cq_limit = 0;  // reservations never pass it: the device's max_cqe, or verbs::limit_cq_entries
  ibv_device_attr dattr{};
  std::uint32_t max_msg = 0;  // the port's max_msg_sz: the largest buffer size a peer may announce
  std::uint8_t port = 1;
  int gid_index = -1;
  std::string name, gid_text;

  io_context* loop = nullptr;
  fd_watch* cq_watch = nullptr;
  bool notify_armed = false;
  unsigned unacked = 0;
  std::chrono::nanoseconds budget = std::chrono::microseconds(200);
  // When the last completion was seen, stamped lazily: poll() only counts
  // (a clock read per poll is microseconds where the clock is HPET, as in
  // a TCG guest); the stamp is taken when the loop next wants to sleep.
  std::int64_t last_wc = 0;  // spin_clock ns
  std::uint64_t wc_seen = 0, wc_stamped = 0;
  std::size_t inflight = 0;
  std::vector<std::shared_ptr<conn_state>> graveyard;
  verbs::domain_stats st{};

  // The user's registrations (weak: alive while the user holds one),
  // found by address for operations on memory they cover. Other memory is
  // cached only where the memory monitor watches it (rcache), else staged or
  // registered per operation (transient).
  std::multimap<std::uintptr_t, std::weak_ptr<verbs_region>> user_regs;
  std::uint64_t reg_seq = 0;
  std::size_t device_registrations = 0;  // device-memory registrations ever made (dma-buf, peermem)
  std::shared_ptr<staging_pool> staging;  // made on first use
  // Registrations of memory the user did not register, dropped when its
  // pages go away (registration_cache.hpp). Made on first use; null where
  // the process has no memory monitor or the user turned it off.
  std::unique_ptr<registration_cache> rcache;
  bool rcache_decided = false;
  registration_cache* cache() {
    if (!rcache_decided) {
      rcache_decided = true;
      if (memory_monitor* m = memory_monitor::instance()) rcache = std::make_unique<registration_cache>(*m);
    }
    return rcache.get();
  }
  // Shared with the transient registrations it times, which may outlive this.
  std::shared_ptr<copy_or_register> path_costs = std::make_shared<copy_or_register>();
  // The staging lease or transient registration that find_region made for
  // the operation being built: the operation takes it (take_hold) and holds
  // it until it completes.
  std::shared_ptr<verbs_region> op_owned;

  // Shared receive queue (created on first use), its buffers, and who uses it.
  ibv_srq* srq = nullptr;
  recv_pool* srq_pool = nullptr;
  std::uint32_t srq_cap = 0;      // the SRQ's max_wr
  std::uint64_t srq_granted = 0;  // sum of the live connections' grants
  // qp_num -> connection, for every QP of this core: an SRQ's receive
  // completion and an unsignaled send's error completion name only their QP.
  std::map<std::uint32_t, conn_state*> qp_conns;
  conn_state* conn_of(std::uint32_t qp_num) const noexcept {
    auto it = qp_conns.find(qp_num);
    return it == qp_conns.end() ? nullptr : it->second;
  }
  std::size_t rx_waiters = 0;  // recv() calls waiting: a reason to keep busy-polling

  // Receive buffers whose messages were released, posted again at the next
  // poll (one ibv_post_recv per connection for all of them): a released
  // message costs no post on the latency path between a receive and the
  // send that answers it. Credits go back only for posted buffers.
  std::vector<conn_state*> repost_conns;  // connections with released buffers
  std::vector<recv_slot*> srq_released;   // SRQ buffers released
  void flush_reposts() noexcept;

  // The receive pools' slabs by address: a send from the bytes of a
  // received message the application holds (an echo) is posted from the
  // slab's MR, the buffer held until the send completes (hold_rx_slot).
  struct rx_slab {
    std::uintptr_t end;
    recv_pool* pool;
    verbs_region* region;
    std::uint32_t first, count;  // the slab's slots in pool->slots
  };
  std::map<std::uintptr_t, rx_slab> rx_slabs;
  // Deleter of hold_rx_slot's hold: the buffer's reader count goes down,
  // and a buffer released meanwhile goes back to its queue (core.cpp).
  struct rx_slot_hold {
    recv_pool* pool;
    recv_slot* slot;
    void operator()(verbs_region*) const noexcept;
  };
  // When [a, a+len) lies in one receive buffer: its slab's region, the
  // buffer held for the operation (op_owned). Else null.
  verbs_region* hold_rx_slot(std::uintptr_t a, std::size_t len) {
    auto it = rx_slabs.upper_bound(a);
    if (it == rx_slabs.begin()) return nullptr;
    --it;
    const rx_slab& sl = it->second;
    if (a >= sl.end) return nullptr;
    const std::size_t idx = (a - it->first) / sl.pool->slot_size;
    if (idx >= sl.count) return nullptr;  // the slab's rounding past its last buffer
    recv_slot& slot = sl.pool->slots[sl.first + idx];
    if (len > reinterpret_cast<std::uintptr_t>(slot.addr) + sl.pool->slot_size - a) return nullptr;
    ++slot.readers;
    ++sl.pool->refs;
    op_owned = std::shared_ptr<verbs_region>(sl.region, rx_slot_hold{sl.pool, &slot});
    ++st.receive_buffer_sends;
    return sl.region;
  }

  ~core() override {
    if (loop) loop->backend().remove_poller(*this);
    if (cq_watch) cq_watch->destroy();
    op_owned.reset();
    // Every QP is gone (each held a reference to this core): the SRQ can go.
    if (srq) ibv_destroy_srq(srq);
    if (srq_pool) {
      srq_pool->srq_core = nullptr;
      srq_pool->unref();
    }
    if (cq) {
      if (unacked) ibv_ack_cq_events(cq, unacked);
      ibv_destroy_cq(cq);
    }
    if (channel) ibv_destroy_comp_channel(channel);
  }

  void attach() {
    if (loop) return;
    loop = &io_context::current();
    loop->backend().add_poller(*this);
    cq_watch = new fd_watch(channel->fd, &on_cq_event, this);
    cq_watch->arm(*loop);
  }

  static void on_cq_event(void* arg) noexcept {
    auto* self = static_cast<core*>(arg);
    ibv_cq* ev_cq;
    void* ev_ctx;
    while (ibv_get_cq_event(self->channel, &ev_cq, &ev_ctx) == 0) {
      ++self->unacked;
      ++self->st.cq_events;
      self->notify_armed = false;
    }
    if (self->unacked >= ack_batch) {
      ibv_ack_cq_events(self->cq, self->unacked);
      self->unacked = 0;
    }
    self->cq_watch->arm(*self->loop);
  }

  // An empty CQ is looked at again a few times before the loop goes on: a
  // turn of the loop costs several times an empty ibv_poll_cq, so a loop
  // that spins for completions notices one sooner (and, in an emulated
  // guest, runs far less code per look).
  bool poll() override {
    inline_wrs = 0;
    if (!repost_conns.empty() || !srq_released.empty()) flush_reposts();
    for (int i = 0; i < empty_polls_per_turn; ++i)
      if (poll_cq()) return true;
    return false;
  }
  static constexpr int empty_polls_per_turn = 8;
  // A look at the CQ from an operation of `wrs` work requests just posted
  // (see finish_setup). For at most 32 work requests between two turns of
  // the loop: an operation that completes at once does not suspend, so a
  // coroutine issuing them in a row would otherwise never let the loop (its
  // timers, the other coroutines) run, and a suspension costs the latency
  // path two reference counts and a turn of the loop (the limit's measured
  // cost: docs/measurements.md, 2026-12-02). A batch counts its work
  // requests.
  [[gnu::always_inline]] void poll_inline(unsigned wrs = 1) {
    if (take_inline_look(wrs)) poll_cq_inlined();
  }
  // One of the loop turn's inline looks, if any is left (poll_inline; a
  // prepared start's latency path decides on it before it posts).
  [[gnu::always_inline]] bool take_inline_look(unsigned wrs = 1) noexcept {
    if (inline_wrs >= max_inline_wrs) return false;
    inline_wrs += wrs;
    return true;
  }
  static constexpr unsigned max_inline_wrs = 32;
  unsigned inline_wrs = 0;
  bool poll_cq();
  // poll_cq's body, inlined into each operation's launch (poll_inline) as
  // well: a call and an indirect call less on the latency path.
  [[gnu::always_inline]] inline bool poll_cq_inlined();
  // One completion to whatever waits for it (poll_cq's body).
  [[gnu::always_inline]] inline void dispatch(const ibv_wc& wc) noexcept;
  // `n` completions taken from the CQ: the statistics, and the busy-poll
  // budget's "last completion seen" (try_enter_interrupt_mode).
  void count_seen(int n) noexcept {
    st.completions += static_cast<std::uint64_t>(n);
    ++wc_seen;
  }
  bool try_enter_interrupt_mode() override {
    if (!repost_conns.empty() || !srq_released.empty()) flush_reposts();  // never sleep on unposted buffers
    if (inflight > 0 || rx_waiters > 0) {
      const std::int64_t now = detail::spin_clock::now_ns();
      if (wc_seen != wc_stamped || now < last_wc) {
        wc_stamped = wc_seen;
        last_wc = now;
      }
      if (now - last_wc < budget.count()) return false;  // keep busy-polling
    }
    if (!notify_armed) {
      if (ibv_req_notify_cq(cq, 0) != 0) return false;
      notify_armed = true;
    }
    return !poll_cq();  // a completion that arrived before arming raises no event
  }
  void exit_interrupt_mode() override {}
  void reap_graveyard();
  void on_unsignaled_error(const ibv_wc& wc) noexcept;

  // Reserves `n` entries of the shared CQ for one connection, growing the CQ
  // if it can; false when they do not fit (that connection is refused or
  // stops growing, the others keep theirs).
  bool reserve_cq(int n) noexcept {
    if (n > cq_limit - cq_reserved) return false;
    if (cq_reserved + n > cq_size) {
      int want = std::min(cq_limit, std::max(cq_size * 2, cq_reserved + n));
      if (ibv_resize_cq(cq, want) != 0) return false;
      cq_size = cq->cqe;
    }
    cq_reserved += n;
    return true;
  }

  result<void> srq_join(std::uint32_t grant, std::size_t slot_size);
  void srq_leave(std::uint32_t grant) noexcept { srq_granted -= grant; }
  result<void> post_srq(recv_slot& s) noexcept {
    ibv_sge sge;
    ibv_recv_wr wr;
    fill_recv_wr(s, wr, sge);
    ibv_recv_wr* bad = nullptr;
    if (int e = ibv_post_srq_recv(srq, &wr, &bad)) return errno_code(e);
    return {};
  }
  void on_srq_release(recv_slot& slot) noexcept { srq_released.push_back(&slot); }

  result<std::shared_ptr<verbs_region>> reg(std::span<std::byte> mem, unsigned flags) {
    unsigned a = normalize_access(flags);
    ibv_mr* mr = ibv_reg_mr(pd, mem.data(), mem.size(), static_cast<int>(a));
    if (!mr) return last_errno();
    ++st.registrations;
    auto r = std::make_shared<verbs_region>();
    fill(*r, mr, mem, a);
    return r;
  }
  void fill(verbs_region& r, ibv_mr* mr, std::span<std::byte> mem, unsigned a) {
    r.mr = mr;
    r.pd = pdh;
    r.addr = mem.data();
    r.length = mem.size();
    r.access = a;
    r.lkey = mr->lkey;
    r.rkey = mr->rkey;
  }

  // Memory windows (connection::grant): type 2 ones bound on a QP.
  bool has_type2_windows() const noexcept {
    return (dattr.device_cap_flags & (IBV_DEVICE_MEM_WINDOW_TYPE_2A | IBV_DEVICE_MEM_WINDOW_TYPE_2B)) != 0;
  }

#ifdef SHUTTLE_HAVE_VERBS_DMABUF
  // Device memory exported as a dma-buf; the region's addresses are `iova`
  // (the device pointer), as operations and remote descriptors use them.
  result<memory_region> register_dmabuf(int fd, std::uint64_t offset, std::size_t length, std::uint64_t iova,
                                        unsigned flags) {
    unsigned a = normalize_access(flags);
    ibv_mr* mr = ibv_reg_dmabuf_mr(pd, offset, length, iova, fd, static_cast<int>(a));
    if (!mr) return last_errno();
    ++st.registrations;
    auto r = std::make_shared<verbs_region>();
    r->mr = mr;
    r->pd = pdh;
    r->addr = reinterpret_cast<std::byte*>(static_cast<std::uintptr_t>(iova));
    r->length = length;
    r->access = a;
    r->lkey = mr->lkey;
    r->rkey = mr->rkey;
    r->device_memory = true;
    ++device_registrations;
    add_user_region(r);
    return memory_region(r);
  }
#endif

  // Device memory the NIC reaches through a peer-memory module (nvidia_peermem):
  // ibv_reg_mr on the device pointer, flagged so that it is never sent
  // inline (the CPU would read it).
  result<memory_region> register_device_memory(std::span<std::byte> mem, unsigned flags) {
    auto r = reg(mem, flags);
    if (!r) return r.error();
    (*r)->device_memory = true;
    ++device_registrations;
    add_user_region(*r);
    return memory_region(*r);
  }

  // True when `mem` is device memory (the inline decision: the CPU would
  // read it): a registration of device memory covers it, else the GPU
  // layer's hooks say so (verbs::device_memory_hooks). Host-only domains
  // without hooks skip the lookup.
  bool in_device_memory(std::span<const std::byte> mem) {
    const auto* h = verbs::installed_hooks.load(std::memory_order_acquire);
    if (device_registrations == 0 && (!h || !h->is_device_memory)) return false;
    return device_memory_slow(mem, h);
  }
  bool device_memory_slow(std::span<const std::byte> mem, const verbs::device_memory_hooks* h);
  // Device memory no registration covers, registered for one operation
  // through the GPU layer's hooks (dma-buf, else peer memory), or refused.
  result<verbs_region*> device_region(std::span<const std::byte> mem, bool need_write,
                                      const verbs::device_memory_hooks& h);

  // Every call registers anew, as ibv_reg_mr does: an earlier region of the
  // same range may describe pages that are no longer mapped there (its
  // memory freed while the user still held it), and nothing can tell.
  result<memory_region> register_memory(std::span<std::byte> mem, unsigned flags) {
    auto r = reg(mem, flags);
    if (!r) return r.error();
    add_user_region(*r);
    return memory_region(*r);
  }
  void add_user_region(const std::shared_ptr<verbs_region>& r) {
    auto key = reinterpret_cast<std::uintptr_t>(r->addr);
    auto [b, e] = user_regs.equal_range(key);  // drop the expired ones of this address
    for (auto it = b; it != e;) it = it->second.expired() ? user_regs.erase(it) : std::next(it);
    r->seq = ++reg_seq;
    user_regs.emplace(key, r);
    // Operations find the newest registration covering their memory, not
    // the one they used last.
    last_region.reset();
    last_ptr = nullptr;
    last_base = last_end = 0;
  }

  void remember(const std::shared_ptr<verbs_region>& r) noexcept {
    last_region = r;
    last_ptr = r.get();
    last_base = reinterpret_cast<std::uintptr_t>(r->addr);
    last_end = last_base + r->length;
  }

  // The registration local_region found last: operations on one buffer in
  // a row skip the map walk. Weak, as the maps' user entries: it keeps no
  // registration alive, and one deregistered since has expired.
  std::weak_ptr<verbs_region> last_region;
  verbs_region* last_ptr = nullptr;  // last_region's object, while it has not expired
  std::uintptr_t last_base = 0, last_end = 0;

  // A registration covering `mem` for a local sge. For the user's memory,
  // not a reference: the registration is alive until user code runs again
  // (the user's handle holds it), which is all an operation that completes
  // while it is launched needs; one that waits takes a reference (hold).
  // No reference counting on the latency path of an operation on
  // registered memory. Other memory: see find_region.
  result<verbs_region*> local_region(std::span<const std::byte> mem, bool need_write, bool may_stage, ibv_sge& sge) {
    if (last_covers(mem, need_write)) {
      ++st.cache_hits;
      return last_ptr;
    }
    return find_region(mem, need_write, may_stage, sge);
  }
  bool last_covers(std::span<const std::byte> mem, bool need_write) const noexcept {
    auto a = reinterpret_cast<std::uintptr_t>(mem.data());
    return a >= last_base && a <= last_end && mem.size() <= last_end - a && !last_region.expired() &&
           (!need_write || (last_ptr->access & access::local_write));
  }
  // The user's registration covering `mem` (the newest, as local_region
  // finds it), or null; nothing registered or staged. A block list's local
  // span: one lookup for all of its blocks.
  verbs_region* user_region_covering(std::span<const std::byte> mem, bool need_write) {
    if (last_covers(mem, need_write)) {
      ++st.cache_hits;
      return last_ptr;
    }
    if (auto sp = find_cover(user_regs, reinterpret_cast<std::uintptr_t>(mem.data()), mem.size(), need_write)) {
      ++st.cache_hits;
      remember(sp);
      return sp.get();
    }
    return nullptr;
  }
  // local_region past the last registration: a receive buffer holding
  // `mem` (a send of received bytes), else a user registration covering
  // `mem`, else a registration the cache holds for it (memory the monitor
  // watches, seen before), else a staging slot that the
  // bytes are copied into now (sge then points at it; `may_stage`: a send
  // or write source whose bytes may be taken now), else a registration for
  // this operation alone. Either is left in op_owned for the operation to
  // hold until it completes; neither is ever found by another operation.
  [[gnu::noinline]] result<verbs_region*> find_region(std::span<const std::byte> mem, bool need_write, bool may_stage,
                                                      ibv_sge& sge) {
    auto a = reinterpret_cast<std::uintptr_t>(mem.data());
    if (!need_write && !rx_slabs.empty())
      if (verbs_region* r = hold_rx_slot(a, mem.size())) return r;
    if (auto sp = find_cover(user_regs, a, mem.size(), need_write)) {
      ++st.cache_hits;
      remember(sp);
      return sp.get();
    }
    // Neither copied by the CPU nor registered as host memory.
    if (const auto* h = verbs::installed_hooks.load(std::memory_order_acquire);
        h && h->is_device_memory && h->is_device_memory(mem.data(), mem.size()))
      return device_region(mem, need_write, *h);
    std::span<std::byte> m(const_cast<std::byte*>(mem.data()), mem.size());
    if (registration_cache* rc = cache()) {
      if (auto sp = rc->find(a, mem.size(), need_write)) {
        ++st.cache_hits;
        op_owned = std::move(sp);
        return op_owned.get();
      }
      // Memory seen once is staged or registered for its operation; seen
      // again, it is registered for the cache.
      if (rc->seen_before(a, mem.size()))
        if (auto r = rc->insert(a, mem.size(), [&](std::span<std::byte> pages) {
              auto x = reg(pages, access::local_write);
              if (!x && !need_write) x = reg(pages, 0);  // read-only memory (a send source)
              return x;
            })) {
          op_owned = std::move(*r);
          return op_owned.get();
        }
    }
    if (may_stage && !need_write && mem.size() <= staging_max) {
      const unsigned cls = staging_class(mem.size());
      if (!path_costs->stage(cls)) {
        if (auto r = timed_registration(m, cls)) {
          ++st.transient_registrations;
          op_owned = std::move(*r);
          return op_owned.get();
        }  // (memory a registration refuses may still be copied)
      }
      if (!staging) staging = std::make_shared<staging_pool>();
      if (auto lease = staging->take(mem.size(), [this](std::span<std::byte> c) { return reg(c, 0); })) {
        const auto t0 = std::chrono::steady_clock::now();
        std::memcpy(lease->addr, mem.data(), mem.size());
        path_costs->copied(cls, (std::chrono::steady_clock::now() - t0).count());
        ++st.staged;
        sge.addr = reinterpret_cast<std::uintptr_t>(lease->addr);
        op_owned = std::move(lease->hold);
        return lease->region;
      }
    }
    auto r = reg(m, access::local_write);
    if (!r && !need_write) r = reg(m, 0);  // read-only memory (a send source)
    if (!r) return r.error();
    ++st.transient_registrations;
    op_owned = std::move(*r);
    return op_owned.get();
  }
  // A registration of a staging-sized source for one operation, whose cost
  // (ibv_reg_mr now, ibv_dereg_mr when the operation lets go) goes to
  // path_costs.
  result<std::shared_ptr<verbs_region>> timed_registration(std::span<std::byte> m, unsigned cls) {
    using clk = std::chrono::steady_clock;
    auto region = std::make_unique<verbs_region>();
    const auto t0 = clk::now();
    ibv_mr* mr = ibv_reg_mr(pd, m.data(), m.size(), 0);
    if (!mr) return last_errno();
    const auto reg_ns = (clk::now() - t0).count();
    ++st.registrations;
    fill(*region, mr, m, 0);
    // (Should the control block fail to allocate, the deleter still runs.)
    return std::shared_ptr<verbs_region>(region.release(), [costs = path_costs, cls, reg_ns](verbs_region* p) {
      const auto t1 = clk::now();
      delete p;  // ibv_dereg_mr
      costs->registered(cls, reg_ns + (clk::now() - t1).count());
    });
  }
  // A reference to what local_region returned, for an operation that waits.
  static std::shared_ptr<verbs_region> hold(verbs_region* r) { return r ? r->shared_from_this() : nullptr; }
  // What an operation holds while it waits: the staging lease or transient
  // registration find_region just made, else a reference to `r`.
  std::shared_ptr<verbs_region> take_hold(verbs_region* r) {
    if (op_owned) return std::move(op_owned);
    return hold(r);
  }
};

}  // namespace shuttle::detail::verbs_impl
